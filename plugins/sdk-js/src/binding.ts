// The contract's `reconciler` export for a `Plugin`: JSON text in, records out, the
// defaults of the optional hooks, and every exception turned into the function's error
// (the `error` variant, or the one-line refusal of validate and convert). No WIT import,
// so it runs in Node too.

import { Context } from './context.js';
import type { Error as WitError, Observed, Reconciler } from './contract.js';
import { Finalized } from './desired.js';
import { Invalid, Retry, toRefusal, toWitError } from './errors.js';
import { log } from './log.js';
import type { KubeObject } from './objects.js';
import { type Plugin, type PluginInfo, pluginInfo } from './plugin.js';
import { Related } from './related.js';
import { mapStack } from './sourcemap.js';

/** The functions of `capstan:plugin/reconciler`, as componentize-js calls them. */
export type ReconcilerExports = typeof Reconciler;

/**
 * The error componentize-js turns into `result::err`: it reads the thrown value's own
 * `payload`. A thrown value without one traps the instance instead.
 */
export class ComponentError<Payload = WitError> extends Error {
  readonly payload: Payload;

  constructor(payload: Payload, message: string) {
    super(message);
    this.payload = payload;
  }
}

/** The `reconciler` export of `plugin`. */
export function bindPlugin<Spec, Status>(plugin: Plugin<Spec, Status>): ReconcilerExports {
  let info: PluginInfo | undefined;
  const describe = (): PluginInfo => (info ??= pluginInfo(plugin.describe()));
  return {
    describe,
    customize: (parent) =>
      guarded('customize', () => {
        const ctx = new Context<Spec, Status>(describe(), parseObject(parent, 'a parent'), []);
        const requests = plugin.customize?.(ctx) ?? [];
        if (!Array.isArray(requests)) {
          throw new Retry(`customize returned ${typeName(requests)}, not an array of Related`);
        }
        return requests.map((r: unknown) => {
          if (!(r instanceof Related)) {
            throw new Retry(`customize returned ${typeName(r)} in its array, not a Related`);
          }
          return r.toWit(describe());
        });
      }),
    reconcile: (observed) =>
      guarded('reconcile', () => plugin.reconcile(context<Spec, Status>(describe(), observed)).toWit()),
    finalize: (observed) =>
      guarded('finalize', () => {
        const ctx = context<Spec, Status>(describe(), observed);
        return (plugin.finalize?.(ctx) ?? Finalized.done()).toWit(describe());
      }),
    validate: (old, object) =>
      refusing('validate', () => {
        const before = old === undefined ? undefined : parseObject<KubeObject<Spec, Status>>(old, 'an old object');
        const warnings = plugin.validate?.(before, parseObject(object, 'an object')) ?? [];
        if (!Array.isArray(warnings) || !warnings.every((w) => typeof w === 'string')) {
          throw new Retry(`validate returned ${JSON.stringify(warnings)}, not an array of warning strings`);
        }
        return warnings;
      }),
    convert: (object, toVersion) =>
      refusing('convert', () => {
        if (plugin.convert === undefined) {
          throw new Invalid(`this plugin does not convert (asked for ${toVersion})`);
        }
        const converted: unknown = plugin.convert(parseObject(object, 'an object'), toVersion);
        if (typeof converted !== 'object' || converted === null || Array.isArray(converted)) {
          throw new Retry(`convert returned ${typeName(converted)}, not an object`);
        }
        return JSON.stringify(converted);
      }),
  };
}

function context<Spec, Status>(info: PluginInfo, observed: Observed): Context<Spec, Status> {
  const parent = parseObject<KubeObject<Spec, Status>>(observed.parent, 'a parent');
  const children = observed.children.map(
    (c): [number, KubeObject] => [c.kindIndex, parseObject<KubeObject>(c.object, 'a child')],
  );
  const related = observed.related.map(
    (r): [number, KubeObject] => [r.kindIndex, parseObject<KubeObject>(r.object, 'a related object')],
  );
  return new Context(info, parent, children, related);
}

function parseObject<T>(json: string, what: string): T {
  try {
    return JSON.parse(json) as T;
  } catch (e) {
    throw new Retry(`host sent ${what} that is not JSON: ${(e as Error).message}`);
  }
}

function typeName(value: unknown): string {
  return value === null ? 'null' : Array.isArray(value) ? 'an array' : typeof value;
}

/** Runs a hook whose error is the contract's `error` variant. */
function guarded<T>(hook: string, call: () => T): T {
  try {
    return call();
  } catch (thrown) {
    logBug(hook, thrown);
    const payload = toWitError(thrown);
    throw new ComponentError(payload, `${payload.tag}: ${payload.val}`);
  }
}

/** Runs a hook whose error is a refusal: one line the user reads. */
function refusing<T>(hook: string, call: () => T): T {
  try {
    return call();
  } catch (thrown) {
    logBug(hook, thrown);
    const refusal = toRefusal(thrown);
    throw new ComponentError(refusal, refusal);
  }
}

/**
 * Anything but `Invalid` and `Retry` is a bug: the SDK caught it and the host gets a
 * `retry` naming it; its stack goes to the log (in the author's TypeScript positions,
 * when the build appended its source map), never to the user.
 */
function logBug(hook: string, thrown: unknown): void {
  if (thrown instanceof Error && !(thrown instanceof Invalid || thrown instanceof Retry)) {
    log.error(() => `${hook} threw ${thrown.name}: ${thrown.message} (a bug in the plugin)\n${mapStack(thrown.stack ?? '')}`.trimEnd());
  }
}
