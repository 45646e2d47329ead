// The contract's `reconciler` export for a `Plugin`: JSON text in, records out, and
// every exception turned into the `error` variant. No WIT import, so it runs in Node too.

import type * as Reconciler from 'capstan:plugin/reconciler@0.1.0';
import type { Observed } from 'capstan:plugin/types@0.1.0';
import { Context } from './context.js';
import { Invalid, Retry, toWitError } from './errors.js';
import { log } from './log.js';
import type { KubeObject } from './objects.js';
import { Finalized } from './desired.js';
import { type Plugin, type PluginInfo, pluginInfo } from './plugin.js';

/** The functions of `capstan:plugin/reconciler`, as componentize-js calls them. */
export type ReconcilerExports = typeof Reconciler;

/**
 * The error componentize-js turns into `result::err`: it reads the thrown value's
 * `payload`. A thrown value without one traps the instance instead.
 */
export class ComponentError extends Error {
  readonly payload: Reconciler.Error;

  constructor(payload: Reconciler.Error) {
    super(`${payload.tag}: ${payload.val}`);
    this.payload = payload;
  }
}

/** The `reconciler` export of `plugin`. */
export function bindPlugin<Spec, Status>(plugin: Plugin<Spec, Status>): ReconcilerExports {
  let info: PluginInfo | undefined;
  const describe = (): PluginInfo => (info ??= pluginInfo(plugin.describe()));
  return {
    describe,
    reconcile: (observed) => guarded(() => plugin.reconcile(context<Spec, Status>(describe(), observed)).toWit()),
    finalize: (observed) =>
      guarded(() => {
        const ctx = context<Spec, Status>(describe(), observed);
        return (plugin.finalize?.(ctx) ?? Finalized.done()).toWit();
      }),
  };
}

function context<Spec, Status>(info: PluginInfo, observed: Observed): Context<Spec, Status> {
  const parent = parseObject<KubeObject<Spec, Status>>(observed.parent, 'parent');
  const children = observed.children.map(
    (c): [number, KubeObject] => [c.kindIndex, parseObject<KubeObject>(c.object, 'child')],
  );
  return new Context(info, parent, children);
}

function parseObject<T>(json: string, what: string): T {
  try {
    return JSON.parse(json) as T;
  } catch (e) {
    throw new Retry(`host sent a ${what} that is not JSON: ${(e as Error).message}`);
  }
}

function guarded<T>(call: () => T): T {
  try {
    return call();
  } catch (thrown) {
    if (thrown instanceof Error && !(thrown instanceof Invalid || thrown instanceof Retry)) {
      log.error(() => `uncaught ${thrown.stack ?? String(thrown)}`);
    }
    throw new ComponentError(toWitError(thrown));
  }
}
