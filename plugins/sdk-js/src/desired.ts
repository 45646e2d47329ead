// What a reconcile returns: children, status, conditions, events, requeue.

import type {
  ChildRef,
  Condition as WitCondition,
  Desired as WitDesired,
  Event as WitEvent,
  FinalizeResult,
  PluginInfo,
} from './contract.js';
import { Invalid } from './errors.js';
import { apiVersion, type KindRef, kindIndex } from './objects.js';

/** Whether a condition holds: `true`, `false` or `'unknown'`. */
export type Holds = boolean | 'unknown';

/** A child manifest: `apiVersion`, `kind` and `metadata.name` are required. */
export interface Manifest {
  apiVersion: string;
  kind: string;
  metadata: { name: string; [field: string]: unknown };
  [field: string]: unknown;
}

/** The desired state of one parent, built with chained calls. */
export class Desired {
  readonly #children: Manifest[] = [];
  #status: object | undefined;
  readonly #conditions: WitCondition[] = [];
  readonly #events: WitEvent[] = [];
  #requeueAfterSeconds: number | undefined;

  /**
   * Adds a child. Leave the namespace and ownerReferences out: the host sets them, with
   * its labels, and applies the child with server-side apply.
   */
  child(manifest: Manifest): this {
    this.#children.push(manifest);
    return this;
  }

  /** Sets the plugin's status fields. The host adds `observedGeneration` and `conditions`. */
  status(status: object): this {
    this.#status = status;
    return this;
  }

  /** Adds a condition. One of type `Ready` replaces the host's own reason and message. */
  condition(type: string, holds: Holds, reason: string, message: string): this {
    const status = holds === 'unknown' ? 'unknown' : holds ? 'true' : 'false';
    this.#conditions.push({ type, status, reason, message });
    return this;
  }

  /** Adds a Normal event to post on the parent. Never put secrets in `message`. */
  event(reason: string, message: string): this {
    this.#events.push({ type: 'normal', reason, message });
    return this;
  }

  /** Adds a Warning event to post on the parent. */
  warning(reason: string, message: string): this {
    this.#events.push({ type: 'warning', reason, message });
    return this;
  }

  /** Reconcile again after `seconds` even if nothing changes (whole seconds, at least 1). */
  requeueAfter(seconds: number): this {
    this.#requeueAfterSeconds = wholeSeconds(seconds);
    return this;
  }

  /** The children added so far. */
  get children(): readonly Manifest[] {
    return this.#children;
  }

  /** The status set so far. */
  get statusValue(): object | undefined {
    return this.#status;
  }

  /** The conditions added so far, as the contract carries them. */
  get conditions(): readonly WitCondition[] {
    return this.#conditions;
  }

  /** The events added so far. */
  get events(): readonly WitEvent[] {
    return this.#events;
  }

  /** The requeue delay in seconds, if set. */
  get requeueAfterSeconds(): number | undefined {
    return this.#requeueAfterSeconds;
  }

  /** The contract's `desired` record: every object as JSON text. */
  toWit(): WitDesired {
    return {
      children: this.#children.map((c) => JSON.stringify(c)),
      status: this.#status === undefined ? undefined : JSON.stringify(this.#status),
      conditions: [...this.#conditions],
      events: [...this.#events],
      requeueAfterSeconds: this.#requeueAfterSeconds,
    };
  }
}

/**
 * What `finalize` returns: `Finalized.done()`, `Finalized.pending(seconds)`, or a
 * teardown wave, `Finalized.wave().delete(kind, name)…`.
 */
export class Finalized {
  readonly #done: boolean;
  readonly #requeueAfterSeconds: number | undefined;
  readonly #events: WitEvent[] = [];
  readonly #deletes: Array<{ kind: KindRef; name: string }> = [];

  private constructor(done: boolean, requeueAfterSeconds: number | undefined) {
    this.#done = done;
    this.#requeueAfterSeconds = requeueAfterSeconds;
  }

  /** Cleanup is complete; the host removes its finalizer. */
  static done(): Finalized {
    return new Finalized(true, undefined);
  }

  /** Cleanup is still under way; call again after `seconds`. */
  static pending(seconds: number): Finalized {
    return new Finalized(false, wholeSeconds(seconds));
  }

  /**
   * A teardown wave: the host deletes the children named with `delete` (only those this
   * parent controls), waits until they are gone, and calls `finalize` again. Return the
   * next wave from there, or `Finalized.done()` when nothing is left to order. A wave
   * that names no observed child is over at once; children never named go with the
   * parent, through their ownerReference.
   */
  static wave(): Finalized {
    return new Finalized(false, undefined);
  }

  /** Names an observed child of a declared child kind to delete in this wave. */
  delete(kind: KindRef, name: string): this {
    if (typeof name !== 'string' || name === '') {
      throw new TypeError(`a child to delete needs a non-empty name, not ${JSON.stringify(name)}`);
    }
    this.#deletes.push({ kind, name });
    return this;
  }

  /** Adds a Normal event. */
  event(reason: string, message: string): this {
    this.#events.push({ type: 'normal', reason, message });
    return this;
  }

  /** Adds a Warning event. */
  warning(reason: string, message: string): this {
    this.#events.push({ type: 'warning', reason, message });
    return this;
  }

  /** Whether cleanup is complete (ignored by the host while `deletes` is not empty). */
  get isDone(): boolean {
    return this.#done;
  }

  /** The children this wave deletes. */
  get deletes(): ReadonlyArray<{ kind: KindRef; name: string }> {
    return this.#deletes;
  }

  /**
   * The contract's `finalize-result` record, each child to delete as the index of its
   * kind in `info.children`; a kind not declared a child is `Invalid`.
   */
  toWit(info: PluginInfo): FinalizeResult {
    const deletes = this.#deletes.map(({ kind, name }): ChildRef => {
      const index = kindIndex(info.children, kind);
      if (index < 0) {
        throw new Invalid(`finalize names ${kind.kind} ${JSON.stringify(name)} (${apiVersion(kind)}), not a declared child kind`);
      }
      return { kindIndex: index, name };
    });
    return {
      done: this.#done,
      events: [...this.#events],
      requeueAfterSeconds: this.#requeueAfterSeconds,
      delete: deletes,
    };
  }
}

const U32_MAX = 0xffff_ffff;

function wholeSeconds(seconds: number): number {
  if (!Number.isFinite(seconds)) {
    return U32_MAX;
  }
  return Math.min(Math.max(Math.ceil(seconds), 1), U32_MAX);
}
