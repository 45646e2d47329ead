// Why a reconcile, finalize or customize failed (the two cases of the contract's `error`
// variant), and why validate or convert refused (a one-line message).

import type { Error as WitError } from './contract.js';

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
  return { tag: 'retry', val: describeThrown(thrown) };
}

/**
 * The one line a user reads when `validate` or `convert` refuses: the message of an
 * `Invalid` or `Retry` (both refuse: an admission or a conversion is not retried), or
 * the name and message of any other exception, a bug in the plugin.
 */
export function toRefusal(thrown: unknown): string {
  if (thrown instanceof Invalid || thrown instanceof Retry) {
    return oneLine(thrown.message);
  }
  return describeThrown(thrown);
}

/** `text` with its line breaks folded, for messages read on one line. */
export function oneLine(text: string): string {
  return text
    .split(/\r?\n/)
    .map((line) => line.trim())
    .filter((line) => line !== '')
    .join(' ');
}

function describeThrown(thrown: unknown): string {
  if (thrown instanceof Error) {
    return oneLine(`${thrown.name}: ${thrown.message}`);
  }
  return oneLine(`plugin threw ${String(thrown)}`);
}
