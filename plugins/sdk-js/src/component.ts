// The entry point of a plugin component: routes logging to the host and exports the
// plugin as `capstan:plugin/reconciler`. Import it only from the module you componentize.

import * as hostLog from 'capstan:plugin/log@0.2.0';
import { type ReconcilerExports, bindPlugin } from './binding.js';
import { setLogSink } from './log.js';
import type { Plugin } from './plugin.js';

setLogSink(hostLog);

/**
 * The `reconciler` export of `plugin`. The componentized module must export it under
 * that name: `export const reconciler = exportPlugin(myPlugin);`
 */
export function exportPlugin<Spec, Status>(plugin: Plugin<Spec, Status>): ReconcilerExports {
  return bindPlugin(plugin);
}
