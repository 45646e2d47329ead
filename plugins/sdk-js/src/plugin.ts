// What a plugin is: a declaration, a pure reconcile function, and optional hooks
// (finalize, customize, validate, convert) whose defaults the binding supplies.

import type { Context } from './context.js';
import type { FailurePolicy, PluginInfo } from './contract.js';
import type { Desired, Finalized } from './desired.js';
import type { KindRef, KubeObject } from './objects.js';
import type { Related } from './related.js';

export type { FailurePolicy, PluginInfo };

/** What a plugin declares; `describe` returns it. Omitted fields take the defaults shown. */
export interface Declaration {
  /** Plugin name: lower-case letters, digits and `-`. Used in logs, labels and events. */
  name: string;
  /** The plugin's own version (semver recommended). */
  version: string;
  /** The kind it reconciles. */
  parent: KindRef;
  /** Every kind it may return as a child (default: none). */
  children?: KindRef[];
  /** Whether the host adds a finalizer and calls `finalize` on deletion (default: false). */
  finalizer?: boolean;
  /** How often to reconcile an unchanged parent, in seconds (default: the host's). */
  resyncSeconds?: number;
  /** The parent kind's CustomResourceDefinition, as an object or JSON text. */
  crd?: object | string;
  /**
   * Kinds it reads but never writes (default: none): `customize` asks for objects of
   * them, and the host passes those that exist to `reconcile` and `finalize`. Not the
   * parent's kind, nor a child kind.
   */
  related?: KindRef[];
  /**
   * When set, the host calls `validate` on each create and update of a parent (a
   * validating admission webhook), and the API server does this when it cannot answer:
   * `'fail'` refuses the change, `'ignore'` stores it. Default: `validate` is never called.
   */
  validation?: FailurePolicy;
  /**
   * Whether the host serves the CRD's conversion webhook with `convert` (default: false).
   * The CRD (`crd`) must then be shipped and list the versions.
   */
  conversion?: boolean;
}

/**
 * A Capstan plugin. Export it with `exportPlugin` from `@capstan/sdk/component`. Only
 * `describe` and `reconcile` are required: a plugin writes only the hooks it uses.
 */
export interface Plugin<Spec = Record<string, unknown>, Status = Record<string, unknown>> {
  /** What the plugin reconciles and may create. Must return the same value every time. */
  describe(): Declaration;
  /**
   * Computes the desired state from the observed one. Must be idempotent: generate
   * things such as passwords only when they are absent from what was observed. Throw
   * `Invalid` for a wrong spec and `Retry` for a transient failure.
   */
  reconcile(ctx: Context<Spec, Status>): Desired;
  /**
   * Cleans up before the parent is deleted; called only with `finalizer: true`. Return
   * `Finalized.wave()`s to delete children in order, then `Finalized.done()`.
   * Default: done at once.
   */
  finalize?(ctx: Context<Spec, Status>): Finalized;
  /**
   * Which related objects this parent needs (only the parent is set in `ctx`). Called
   * before each `reconcile` and `finalize` of a plugin that declares `related` kinds; the
   * host reconciles the parent again when one of them changes. Default: none.
   */
  customize?(ctx: Context<Spec, Status>): Related[];
  /**
   * Admission: may a parent become `object` (`old` is undefined on create)? Return
   * warnings for `kubectl` to print (or nothing), or throw `Invalid` to refuse with a
   * one-line message. Called only with `validation` declared. Default: allow everything.
   */
  validate?(old: KubeObject<Spec, Status> | undefined, object: KubeObject<Spec, Status>): string[] | void;
  /**
   * Conversion: `object` (any version the CRD serves) as `toVersion` of the same group,
   * with `apiVersion` set to it. Must be lossless both ways. Throw `Invalid` to refuse.
   * Called only with `conversion: true`. Default: refuse.
   */
  convert?(object: KubeObject, toVersion: string): KubeObject;
}

/** Returns `plugin` unchanged: a place for TypeScript to infer and check its type. */
export function definePlugin<Spec, Status>(plugin: Plugin<Spec, Status>): Plugin<Spec, Status> {
  return plugin;
}

/** The contract's `plugin-info` for a declaration, with the defaults filled in. */
export function pluginInfo(declaration: Declaration): PluginInfo {
  const { crd, validation } = declaration;
  if (validation !== undefined && validation !== 'fail' && validation !== 'ignore') {
    throw new TypeError(`validation is ${JSON.stringify(validation)}, not 'fail' or 'ignore'`);
  }
  return {
    name: declaration.name,
    version: declaration.version,
    parent: declaration.parent,
    children: declaration.children ?? [],
    finalizer: declaration.finalizer ?? false,
    resyncSeconds: declaration.resyncSeconds,
    crd: crd === undefined || typeof crd === 'string' ? crd : JSON.stringify(crd),
    related: declaration.related ?? [],
    validation,
    conversion: declaration.conversion ?? false,
  };
}
