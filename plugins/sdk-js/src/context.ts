// What a reconcile sees: the parent, the children it controls and the related objects
// `customize` asked for, as plain objects.

import { Invalid } from './errors.js';
import { type KindRef, type KubeObject } from './objects.js';
import type { PluginInfo } from './plugin.js';

/** The observed state of one parent, as the host read it from the API server. */
export class Context<Spec = Record<string, unknown>, Status = Record<string, unknown>> {
  /** What the plugin declared. */
  readonly info: PluginInfo;
  /** The parent object. */
  readonly parent: KubeObject<Spec, Status>;
  readonly #children: ReadonlyArray<{ kind: KindRef; object: KubeObject }>;
  readonly #related: ReadonlyArray<{ kind: KindRef; object: KubeObject }>;

  /**
   * `children` and `related` pair each observed object with the index of its kind in
   * `info.children` and `info.related`.
   */
  constructor(
    info: PluginInfo,
    parent: KubeObject<Spec, Status>,
    children: ReadonlyArray<[number, KubeObject]>,
    related: ReadonlyArray<[number, KubeObject]> = [],
  ) {
    this.info = info;
    this.parent = parent;
    this.#children = withKinds(info.children, children);
    this.#related = withKinds(info.related, related);
  }

  /** The parent's name. */
  get name(): string {
    return this.parent.metadata?.name ?? '';
  }

  /** The parent's namespace (empty for cluster-scoped parents). */
  get namespace(): string {
    return this.parent.metadata?.namespace ?? '';
  }

  /** The parent's UID. */
  get uid(): string {
    return this.parent.metadata?.uid ?? '';
  }

  /** The parent's `metadata.generation`. */
  get generation(): number {
    return this.parent.metadata?.generation ?? 0;
  }

  /** Whether the parent is being deleted. */
  get isDeleting(): boolean {
    return this.parent.metadata?.deletionTimestamp !== undefined;
  }

  /**
   * The parent's spec (an empty object when it has none). It is not checked against
   * `Spec`: validate what you use, and throw `Invalid` with the field's path when it is
   * wrong, or pass `parse`, whose `Invalid` or `TypeError` becomes `Invalid("spec: …")`.
   */
  spec(): Spec;
  spec<T>(parse: (raw: unknown) => T): T;
  spec<T>(parse?: (raw: unknown) => T): Spec | T {
    const raw = this.parent.spec ?? {};
    if (parse === undefined) {
      return raw as Spec;
    }
    try {
      return parse(raw);
    } catch (e) {
      if (e instanceof Invalid || e instanceof TypeError) {
        throw new Invalid(e.message.startsWith('spec') ? e.message : `spec: ${e.message}`);
      }
      throw e;
    }
  }

  /** The parent's current status, if it has one: the plugin's own earlier output. */
  status(): Status | undefined {
    return this.parent.status;
  }

  /** Observed children of `kind` (one of the declared child kinds). */
  children<T extends KubeObject = KubeObject>(kind: KindRef): T[] {
    return this.#children.filter((c) => sameKind(c.kind, kind)).map((c) => c.object as T);
  }

  /** The observed child of `kind` named `name`, if any. */
  child<T extends KubeObject = KubeObject>(kind: KindRef, name: string): T | undefined {
    return this.children<T>(kind).find((c) => c.metadata?.name === name);
  }

  /** Every observed child, whatever its kind. */
  allChildren(): KubeObject[] {
    return this.#children.map((c) => c.object);
  }

  /**
   * The objects of `kind` (one of the declared related kinds) that `customize` asked for
   * and that exist. Empty in `customize` itself.
   */
  related<T extends KubeObject = KubeObject>(kind: KindRef): T[] {
    return this.#related.filter((r) => sameKind(r.kind, kind)).map((r) => r.object as T);
  }

  /** The related object of `kind` named `name`, if `customize` asked for it and it exists. */
  relatedNamed<T extends KubeObject = KubeObject>(kind: KindRef, name: string): T | undefined {
    return this.related<T>(kind).find((r) => r.metadata?.name === name);
  }

  /** Every related object, whatever its kind. */
  allRelated(): KubeObject[] {
    return this.#related.map((r) => r.object);
  }
}

function withKinds(
  kinds: readonly KindRef[],
  objects: ReadonlyArray<[number, KubeObject]>,
): Array<{ kind: KindRef; object: KubeObject }> {
  return objects.flatMap(([index, object]) => {
    const kind = kinds[index];
    return kind === undefined ? [] : [{ kind, object }];
  });
}

function sameKind(a: KindRef, b: KindRef): boolean {
  return a.group === b.group && a.version === b.version && a.kind === b.kind;
}
