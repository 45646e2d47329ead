// Why a reconcile or finalize failed: the two cases of the contract's `error` variant.

import type { Error as WitError } from 'capstan:plugin/types@0.1.0';

/**
 * The spec is wrong: nothing changes until it does. The host applies nothing, sets
 * `Ready=False` with this message, posts a Warning event and waits for a new generation.
 */
export class Invalid extends Error {
  override name = 'Invalid';

  /** The contract's error value, as componentize-js reads it from a thrown error. */
  get payload(): WitError {
    return { tag: 'invalid', val: this.message };
  }
}

/** A transient failure: the host retries with exponential backoff. */
export class Retry extends Error {
  override name = 'Retry';

  /** The contract's error value, as componentize-js reads it from a thrown error. */
  get payload(): WitError {
    return { tag: 'retry', val: this.message };
  }
}

/**
 * The contract's error for anything a plugin throws. `Invalid` and `Retry` map to their
 * case; any other exception is a bug in the plugin, reported as `retry` with its name and
 * message (the host backs off and the message reaches the parent's `Ready` condition),
 * where an uncaught exception would trap and show only "wasm `unreachable`".
 */
export function toWitError(thrown: unknown): WitError {
  if (thrown instanceof Invalid || thrown instanceof Retry) {
    return thrown.payload;
  }
  if (thrown instanceof Error) {
    return { tag: 'retry', val: `${thrown.name}: ${thrown.message}` };
  }
  return { tag: 'retry', val: `plugin threw ${String(thrown)}` };
}
