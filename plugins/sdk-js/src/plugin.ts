// What a plugin is: a declaration and a pure reconcile function.

import type { PluginInfo } from 'capstan:plugin/types@0.1.0';
import type { Context } from './context.js';
import type { Desired, Finalized } from './desired.js';
import type { KindRef } from './objects.js';

export type { PluginInfo };

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
}

/** A Capstan plugin. Export it with `exportPlugin` from `@capstan/sdk/component`. */
export interface Plugin<Spec = Record<string, unknown>, Status = Record<string, unknown>> {
  /** What the plugin reconciles and may create. Must return the same value every time. */
  describe(): Declaration;
  /**
   * Computes the desired state from the observed one. Must be idempotent: generate
   * things such as passwords only when they are absent from what was observed. Throw
   * `Invalid` for a wrong spec and `Retry` for a transient failure.
   */
  reconcile(ctx: Context<Spec, Status>): Desired;
  /** Cleans up before the parent is deleted; called only with `finalizer: true`. Default: done. */
  finalize?(ctx: Context<Spec, Status>): Finalized;
}

/** Returns `plugin` unchanged: a place for TypeScript to infer and check its type. */
export function definePlugin<Spec, Status>(plugin: Plugin<Spec, Status>): Plugin<Spec, Status> {
  return plugin;
}

/** The contract's `plugin-info` for a declaration, with the defaults filled in. */
export function pluginInfo(declaration: Declaration): PluginInfo {
  const { crd } = declaration;
  return {
    name: declaration.name,
    version: declaration.version,
    parent: declaration.parent,
    children: declaration.children ?? [],
    finalizer: declaration.finalizer ?? false,
    resyncSeconds: declaration.resyncSeconds,
    crd: crd === undefined || typeof crd === 'string' ? crd : JSON.stringify(crd),
  };
}
