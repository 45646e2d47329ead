// What `customize` answers: which related objects one parent needs.

import type { PluginInfo, RelatedRequest } from './contract.js';
import { Invalid } from './errors.js';
import { apiVersion, type KindRef, kindIndex } from './objects.js';

/** Which objects of a related kind: the one of a name, or all that carry some labels. */
export type RelatedSelector = { name: string } | { labels: Array<[string, string]> };

/**
 * A request for objects of one declared related kind, made with `Related.named` or
 * `Related.labelled`.
 */
export class Related {
  /** A kind of the declaration's `related`. */
  readonly kind: KindRef;
  readonly selector: RelatedSelector;

  private constructor(kind: KindRef, selector: RelatedSelector) {
    this.kind = kind;
    this.selector = selector;
  }

  /**
   * The object of `kind` named `name` (in the parent's namespace for a namespaced kind),
   * such as `Related.named(Kinds.ConfigMap, spec.config)`.
   */
  static named(kind: KindRef, name: string): Related {
    if (typeof name !== 'string' || name === '') {
      throw new TypeError(`Related.named needs a non-empty name, not ${JSON.stringify(name)}`);
    }
    return new Related(kind, { name });
  }

  /**
   * Every object of `kind` in the parent's namespace that carries all of `labels`
   * (Kubernetes' `matchLabels`; none selects every object of the namespace), such as
   * the Pods of a StatefulSet: `Related.labelled(Kinds.Pod, { app: ctx.name })`.
   * Namespaced kinds only.
   */
  static labelled(kind: KindRef, labels: Record<string, string> | Array<[string, string]>): Related {
    const pairs = Array.isArray(labels) ? labels : Object.entries(labels);
    for (const pair of pairs) {
      if (!Array.isArray(pair) || pair.length !== 2 || pair.some((p) => typeof p !== 'string')) {
        throw new TypeError(`Related.labelled needs string label keys and values, not ${JSON.stringify(pair)}`);
      }
    }
    return new Related(kind, { labels: pairs.map(([k, v]): [string, string] => [k, v]) });
  }

  /** The contract's `related-request`; a kind not declared related is `Invalid`. */
  toWit(info: PluginInfo): RelatedRequest {
    const index = kindIndex(info.related, this.kind);
    if (index < 0) {
      throw new Invalid(
        `customize asks for ${this.kind.kind} (${apiVersion(this.kind)}), which the plugin does not declare as related`,
      );
    }
    return {
      kindIndex: index,
      selector: 'name' in this.selector ? { tag: 'name', val: this.selector.name } : { tag: 'labels', val: this.selector.labels },
    };
  }
}
