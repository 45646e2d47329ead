// The {{kind}} plugin ({{group}}/{{version}}): each {{kind}} gets a ConfigMap holding its
// `spec.message`, and reports in its status whether the ConfigMap exists yet.

import { Desired, definePlugin, Invalid, Kinds, namespacedKind } from '@capstan/sdk';
import { crd } from './crd.js';

/** The spec, once checked. */
export interface Spec {
  message: string;
}

/** What the plugin writes to the status (the host adds observedGeneration, conditions). */
export interface Status {
  phase: 'Pending' | 'Ready';
  configMap: string;
}

export const plugin = definePlugin<Spec, Status>({
  describe: () => ({
    name: '{{name}}',
    version: '0.1.0',
    parent: namespacedKind('{{group}}', '{{version}}', '{{kind}}', '{{plural}}'),
    children: [Kinds.ConfigMap],
    // Shipped in `describe`: `capstan crd` prints it and `capstan run --install-crds`
    // applies it.
    crd,
  }),

  reconcile(ctx) {
    const spec = ctx.spec(parseSpec);
    const name = `${ctx.name}-{{singular}}`;
    const exists = ctx.child(Kinds.ConfigMap, name) !== undefined;
    return new Desired()
      .child({
        apiVersion: 'v1',
        kind: 'ConfigMap',
        metadata: { name, labels: { 'app.kubernetes.io/part-of': ctx.name } },
        data: { message: spec.message },
      })
      .status({ phase: exists ? 'Ready' : 'Pending', configMap: name } satisfies Status)
      .condition(
        'ConfigMapReady',
        exists,
        exists ? 'Observed' : 'Created',
        exists ? `ConfigMap ${name} exists` : `ConfigMap ${name} was asked for`,
      );
  },
});

/** Checks the spec; a mistake is one `Invalid` line naming the field. */
export function parseSpec(raw: unknown): Spec {
  const { message } = (raw ?? {}) as Record<string, unknown>;
  if (typeof message !== 'string' || message.trim() === '') {
    throw new Invalid('spec.message: a non-empty string is required');
  }
  return { message };
}
