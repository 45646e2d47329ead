// The module componentize-js turns into the component: it exports the plugin as
// `capstan:plugin/reconciler`. The plugin itself is in plugin.ts.

import { exportPlugin } from '@capstan/sdk/component';
import { plugin } from './plugin.js';

export const reconciler = exportPlugin(plugin);
