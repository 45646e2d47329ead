// Write Capstan plugins in TypeScript: Kubernetes reconcilers that run as sandboxed
// WebAssembly components (componentize-js) inside the Capstan host.
//
// A plugin reconciles one custom resource kind. It is a pure function of what the host
// observed (the parent, the children it controls and the related objects it asked for in
// `customize`) and returns the children it wants, its status, conditions and events; the
// host does every API call. It may also tear its children down in order
// (`Finalized.wave()`), check changes at admission (`validate`) and convert between the
// versions of its CRD (`convert`). Define it with `definePlugin`, export it from the
// componentized module with `exportPlugin` (`@capstan/sdk/component`), and test it in
// Node with `@capstan/sdk/testing`.

export { Context } from './context.js';
export { Desired, Finalized, type Holds, type Manifest } from './desired.js';
export { Invalid, Retry } from './errors.js';
export { type Level, log, type Message } from './log.js';
export {
  apiVersion,
  clusterKind,
  isKind,
  type Json,
  kindIndex,
  type KindRef,
  Kinds,
  type KubeObject,
  namespacedKind,
  type ObjectMeta,
} from './objects.js';
export {
  type Declaration,
  definePlugin,
  type FailurePolicy,
  type Plugin,
  type PluginInfo,
  pluginInfo,
} from './plugin.js';
export { Related, type RelatedSelector } from './related.js';
