// Greeting (example.com/v1): each Greeting gets a ConfigMap with one line per audience
// member, and reports in its status whether the ConfigMap exists yet.

import { Desired, definePlugin, Invalid, Kinds, log, namespacedKind } from '@capstan/sdk';
import { crd } from './crd.js';

/** The spec, once checked. */
export interface GreetingSpec {
  message: string;
  audience: string[];
  shout: boolean;
}

/** What the plugin writes to the status (the host adds observedGeneration, conditions). */
export interface GreetingStatus {
  phase: 'Pending' | 'Ready';
  configMap: string;
  lines: number;
}

/** How long to wait for a created ConfigMap to show up before looking again. */
const PENDING_REQUEUE_SECONDS = 5;
/** Bound on the ConfigMap's size, far below the API server's 1 MiB. */
const MAX_LINES = 100;

export const greeting = definePlugin<GreetingSpec, GreetingStatus>({
  describe: () => ({
    name: 'greeting',
    version: '0.1.0',
    parent: namespacedKind('example.com', 'v1', 'Greeting', 'greetings'),
    children: [Kinds.ConfigMap],
    crd,
  }),

  reconcile(ctx) {
    const spec = ctx.spec(parseSpec);
    const name = `${ctx.name}-greeting`;
    const lines = (spec.audience.length > 0 ? spec.audience : ['world']).map((who) => {
      const line = `${spec.message}, ${who}!`;
      return spec.shout ? line.toUpperCase() : line;
    });
    const exists = ctx.child(Kinds.ConfigMap, name) !== undefined;
    log.debug(() => `${ctx.namespace}/${ctx.name}: ${lines.length} lines, ConfigMap ${exists ? 'observed' : 'not yet observed'}`);

    const desired = new Desired()
      .child({
        apiVersion: 'v1',
        kind: 'ConfigMap',
        metadata: { name, labels: { 'example.com/greeting': ctx.name } },
        data: { 'greeting.txt': lines.join('\n') + '\n' },
      })
      .status({ phase: exists ? 'Ready' : 'Pending', configMap: name, lines: lines.length } satisfies GreetingStatus)
      .condition(
        'ConfigMapReady',
        exists,
        exists ? 'Observed' : 'Created',
        exists ? `ConfigMap ${name} holds ${lines.length} lines` : `ConfigMap ${name} was asked for`,
      );
    if (!exists) {
      desired.event('Greeting', `creating ConfigMap ${name}`).requeueAfter(PENDING_REQUEUE_SECONDS);
    }
    return desired;
  },
});

/** Checks the spec; every mistake is one `Invalid` line naming the field. */
export function parseSpec(raw: unknown): GreetingSpec {
  const spec = raw as Record<string, unknown>;
  const { message, audience = [], shout = false } = spec;
  if (typeof message !== 'string' || message.trim() === '') {
    throw new Invalid('spec.message: a non-empty string is required');
  }
  if (!Array.isArray(audience) || !audience.every((who) => typeof who === 'string' && who !== '')) {
    throw new Invalid('spec.audience: must be a list of non-empty strings');
  }
  if (audience.length > MAX_LINES) {
    throw new Invalid(`spec.audience: at most ${MAX_LINES} names, got ${audience.length}`);
  }
  if (typeof shout !== 'boolean') {
    throw new Invalid('spec.shout: must be true or false');
  }
  return { message, audience, shout };
}
