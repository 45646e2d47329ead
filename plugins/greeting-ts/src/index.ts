// The module componentize-js turns into the component: it exports the plugin as
// `capstan:plugin/reconciler`. Keep the plugin itself in greeting.ts, which tests import.

import { exportPlugin } from '@capstan/sdk/component';
import { greeting } from './greeting.js';

export const reconciler = exportPlugin(greeting);
