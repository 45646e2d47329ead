// Testing a plugin in Node, without a cluster or a component: a `Context` from plain
// objects, the exact contract output of each hook, and captured log lines.

import { bindPlugin } from './binding.js';
import { Context } from './context.js';
import type { Condition, Error as WitError, Event, KindRef, Observed, PluginInfo } from './contract.js';
import { type Level, setLogSink } from './log.js';
import { isKind, type KubeObject } from './objects.js';
import { type Plugin, pluginInfo } from './plugin.js';
import { Related } from './related.js';

/**
 * A `Context` for `plugin` from a parent, observed children and related objects. They
 * are matched to the declared child and related kinds by `apiVersion` and `kind`;
 * undeclared ones are dropped, as the host would never pass them.
 */
export function observeFor<Spec, Status>(
  plugin: Plugin<Spec, Status>,
  parent: KubeObject,
  children: KubeObject[] = [],
  related: KubeObject[] = [],
): Context<Spec, Status> {
  const info = pluginInfo(plugin.describe());
  return new Context(
    info,
    parent as KubeObject<Spec, Status>,
    indexObjects(info.children, children),
    indexObjects(info.related, related),
  );
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
 * Runs `reconcile` through the same binding as the component: the parent, children and
 * related objects (what the host would pass for the requests of `customize`) go in as
 * JSON text, the result comes out as the contract's records, and whatever the plugin
 * throws becomes the `error` variant the host would receive.
 */
export function render<Spec, Status>(
  plugin: Plugin<Spec, Status>,
  parent: KubeObject,
  children: KubeObject[] = [],
  related: KubeObject[] = [],
): Rendered {
  const reconciler = bindPlugin(plugin);
  return outcome(() => {
    const desired = reconciler.reconcile(observed(reconciler.describe(), parent, children, related));
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
  });
}

/** One finalize as the host sees it, each child to delete with its declared kind. */
export interface RenderedFinalize {
  done: boolean;
  events: Event[];
  requeueAfterSeconds: number | undefined;
  delete: Array<{ kind: KindRef; name: string }>;
}

/** The outcome of `renderFinalize`: the contract's `result<finalize-result, error>`. */
export type RenderedFinalized = { ok: true; result: RenderedFinalize } | { ok: false; error: WitError };

/** Runs `finalize` (or its default) through the same binding as the component. */
export function renderFinalize<Spec, Status>(
  plugin: Plugin<Spec, Status>,
  parent: KubeObject,
  children: KubeObject[] = [],
  related: KubeObject[] = [],
): RenderedFinalized {
  const reconciler = bindPlugin(plugin);
  return outcome(() => {
    const info = reconciler.describe();
    const result = reconciler.finalize(observed(info, parent, children, related));
    return {
      ok: true,
      result: {
        done: result.done,
        events: result.events,
        requeueAfterSeconds: result.requeueAfterSeconds,
        delete: result.delete.map((c) => ({ kind: declared(info.children, c.kindIndex), name: c.name })),
      },
    };
  });
}

/** The outcome of `renderCustomize`: the contract's `result<list<related-request>, error>`. */
export type RenderedCustomize = { ok: true; requests: Related[] } | { ok: false; error: WitError };

/**
 * Runs `customize` (or its default) through the same binding as the component; the
 * requests are read back from the kind indexes the host receives.
 */
export function renderCustomize<Spec, Status>(plugin: Plugin<Spec, Status>, parent: KubeObject): RenderedCustomize {
  const reconciler = bindPlugin(plugin);
  return outcome(() => {
    const info = reconciler.describe();
    const requests = reconciler.customize(JSON.stringify(parent)).map((r) => {
      const kind = declared(info.related, r.kindIndex);
      return r.selector.tag === 'name' ? Related.named(kind, r.selector.val) : Related.labelled(kind, r.selector.val);
    });
    return { ok: true, requests };
  });
}

/** The outcome of `renderValidate`: the warnings of an allowed change, or the refusal. */
export type RenderedValidate = { ok: true; warnings: string[] } | { ok: false; refusal: string };

/**
 * Runs `validate` (or its default) as the admission webhook does (`old` is undefined
 * on create); a refusal is the one line the user would read.
 */
export function renderValidate<Spec, Status>(
  plugin: Plugin<Spec, Status>,
  old: KubeObject | undefined,
  object: KubeObject,
): RenderedValidate {
  const reconciler = bindPlugin(plugin);
  return refusal(() => ({
    ok: true,
    warnings: reconciler.validate(old === undefined ? undefined : JSON.stringify(old), JSON.stringify(object)),
  }));
}

/** The outcome of `renderConvert`: the converted object, or the refusal. */
export type RenderedConvert = { ok: true; object: KubeObject } | { ok: false; refusal: string };

/** Runs `convert` (or its default) as the conversion webhook does. */
export function renderConvert<Spec, Status>(
  plugin: Plugin<Spec, Status>,
  object: KubeObject,
  toVersion: string,
): RenderedConvert {
  const reconciler = bindPlugin(plugin);
  return refusal(() => ({
    ok: true,
    object: JSON.parse(reconciler.convert(JSON.stringify(object), toVersion)) as KubeObject,
  }));
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

function observed(info: PluginInfo, parent: KubeObject, children: KubeObject[], related: KubeObject[]): Observed {
  const wire = (objects: Array<[number, KubeObject]>) =>
    objects.map(([kindIndex, object]) => ({ kindIndex, object: JSON.stringify(object) }));
  return {
    parent: JSON.stringify(parent),
    children: wire(indexObjects(info.children, children)),
    related: wire(indexObjects(info.related, related)),
  };
}

/** The ok value of `call`, or the `error` variant the binding threw. */
function outcome<T>(call: () => T): T | { ok: false; error: WitError } {
  try {
    return call();
  } catch (thrown) {
    const payload = (thrown as { payload?: WitError }).payload;
    if (payload === undefined) {
      throw thrown;
    }
    return { ok: false, error: payload };
  }
}

/** The ok value of `call`, or the refusal the binding threw. */
function refusal<T>(call: () => T): T | { ok: false; refusal: string } {
  try {
    return call();
  } catch (thrown) {
    const payload = (thrown as { payload?: unknown }).payload;
    if (typeof payload !== 'string') {
      throw thrown;
    }
    return { ok: false, refusal: payload };
  }
}

function declared(kinds: readonly KindRef[], index: number): KindRef {
  const kind = kinds[index];
  if (kind === undefined) {
    throw new Error(`kind index ${index} is not declared (the plugin declares ${kinds.length})`);
  }
  return kind;
}

function indexObjects(kinds: readonly KindRef[], objects: KubeObject[]): Array<[number, KubeObject]> {
  return objects.flatMap((object): Array<[number, KubeObject]> => {
    const index = kinds.findIndex((kind) => isKind(object, kind));
    return index < 0 ? [] : [[index, object]];
  });
}
