// Write Capstan plugins in TypeScript: Kubernetes reconcilers that run as sandboxed
// WebAssembly components (componentize-js) inside the Capstan host.
//
// A plugin reconciles one custom resource kind. It is a pure function of what the host
// observed (the parent and the children it controls) and returns the children it wants,
// its status, conditions and events; the host does every API call. Define it with
// `definePlugin`, export it from the componentized module with `exportPlugin`
// (`@capstan/sdk/component`), and test it in Node with `@capstan/sdk/testing`.

export { Context } from './context.js';
export { Desired, Finalized, type Holds, type Manifest } from './desired.js';
export { Invalid, Retry } from './errors.js';
export { type Level, log, type Message } from './log.js';
export {
  apiVersion,
  clusterKind,
  isKind,
  type Json,
  type KindRef,
  Kinds,
  type KubeObject,
  namespacedKind,
  type ObjectMeta,
} from './objects.js';
export { type Declaration, definePlugin, type Plugin, type PluginInfo, pluginInfo } from './plugin.js';
