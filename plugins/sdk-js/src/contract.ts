// The contract's types, as jco generates them from wit/capstan.wit: the one module that
// names the contract release (with component.ts, which imports the host's `log`).

export type * as Reconciler from 'capstan:plugin/reconciler@0.2.0';
export type {
  ChildRef,
  Condition,
  Desired,
  Error,
  Event,
  FailurePolicy,
  FinalizeResult,
  KindRef,
  Observed,
  PluginInfo,
  RelatedRequest,
  Selector,
} from 'capstan:plugin/types@0.2.0';
export type { Level } from 'capstan:plugin/log@0.2.0';
