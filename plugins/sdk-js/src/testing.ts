// Testing a plugin in Node, without a cluster or a component: a `Context` from plain
// objects, the exact contract output of one reconcile, and captured log lines.

import type { Condition, Error as WitError, Event } from 'capstan:plugin/types@0.1.0';
import { bindPlugin } from './binding.js';
import { Context } from './context.js';
import { type Level, setLogSink } from './log.js';
import { isKind, type KubeObject } from './objects.js';
import { type Plugin, pluginInfo } from './plugin.js';

/**
 * A `Context` for `plugin` from a parent and observed children. Children are matched to
 * the declared kinds by `apiVersion` and `kind`; undeclared ones are dropped, as the host
 * would never pass them.
 */
export function observeFor<Spec, Status>(
  plugin: Plugin<Spec, Status>,
  parent: KubeObject,
  children: KubeObject[] = [],
): Context<Spec, Status> {
  const info = pluginInfo(plugin.describe());
  return new Context(info, parent as KubeObject<Spec, Status>, indexChildren(info.children, children));
}

/** One reconcile as the host sees it: the desired state, objects parsed back from JSON. */
export interface RenderedDesired {
  children: KubeObject[];
  status: Record<string, unknown> | undefined;
  conditions: Condition[];
  events: Event[];
  requeueAfterSeconds: number | undefined;
}

/** The outcome of `render`: the contract's `result<desired, error>`. */
export type Rendered = { ok: true; desired: RenderedDesired } | { ok: false; error: WitError };

/**
 * Runs `reconcile` through the same binding as the component: the parent and children go
 * in as JSON text, the result comes out as the contract's records, and whatever the
 * plugin throws becomes the `error` variant the host would receive.
 */
export function render<Spec, Status>(
  plugin: Plugin<Spec, Status>,
  parent: KubeObject,
  children: KubeObject[] = [],
): Rendered {
  const reconciler = bindPlugin(plugin);
  const info = reconciler.describe();
  const observed = {
    parent: JSON.stringify(parent),
    children: indexChildren(info.children, children).map(([kindIndex, object]) => ({
      kindIndex,
      object: JSON.stringify(object),
    })),
  };
  try {
    const desired = reconciler.reconcile(observed);
    return {
      ok: true,
      desired: {
        children: desired.children.map((c) => JSON.parse(c) as KubeObject),
        status: desired.status === undefined ? undefined : (JSON.parse(desired.status) as Record<string, unknown>),
        conditions: desired.conditions,
        events: desired.events,
        requeueAfterSeconds: desired.requeueAfterSeconds,
      },
    };
  } catch (thrown) {
    const payload = (thrown as { payload?: WitError }).payload;
    if (payload === undefined) {
      throw thrown;
    }
    return { ok: false, error: payload };
  }
}

/** Log lines recorded by `captureLogs`. */
export interface CapturedLogs {
  /** Every line at or above the minimum level, in order. */
  readonly lines: Array<{ level: Level; message: string }>;
  /** Puts the previous sink back. */
  restore(): void;
}

const ORDER: Level[] = ['trace', 'debug', 'info', 'warn', 'error'];

/** Records the plugin's log lines at `minimum` and above instead of printing them. */
export function captureLogs(minimum: Level = 'debug'): CapturedLogs {
  const lines: CapturedLogs['lines'] = [];
  const enabled = (level: Level) => ORDER.indexOf(level) >= ORDER.indexOf(minimum);
  const previous = setLogSink({ enabled, log: (level, message) => lines.push({ level, message }) });
  return { lines, restore: () => void setLogSink(previous) };
}

function indexChildren(kinds: Context['info']['children'], children: KubeObject[]): Array<[number, KubeObject]> {
  return children.flatMap((object): Array<[number, KubeObject]> => {
    const index = kinds.findIndex((kind) => isKind(object, kind));
    return index < 0 ? [] : [[index, object]];
  });
}
