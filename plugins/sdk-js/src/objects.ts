// Kubernetes objects and kinds as plain TypeScript: what crosses the contract as JSON.

import type { KindRef } from './contract.js';

export type { KindRef };

/** Any JSON value. */
export type Json = string | number | boolean | null | Json[] | { [key: string]: Json };

/** The metadata fields a plugin usually reads. */
export interface ObjectMeta {
  name?: string;
  namespace?: string;
  uid?: string;
  generation?: number;
  resourceVersion?: string;
  labels?: Record<string, string>;
  annotations?: Record<string, string>;
  deletionTimestamp?: string;
  [field: string]: unknown;
}

/**
 * A Kubernetes object as the host observed it. `Spec` and `Status` type the parent's
 * own fields; children use the other fields (`data` of a ConfigMap, say) directly.
 */
export interface KubeObject<Spec = Record<string, unknown>, Status = Record<string, unknown>> {
  apiVersion: string;
  kind: string;
  metadata: ObjectMeta;
  spec?: Spec;
  status?: Status;
  [field: string]: unknown;
}

/** A namespaced kind; `group` is empty for the core group. */
export function namespacedKind(group: string, version: string, kind: string, plural: string): KindRef {
  return { group, version, kind, plural, namespaced: true };
}

/** A cluster-scoped kind. */
export function clusterKind(group: string, version: string, kind: string, plural: string): KindRef {
  return { group, version, kind, plural, namespaced: false };
}

/** `apiVersion` as written in manifests: `v1` for the core group, else `group/version`. */
export function apiVersion(kind: KindRef): string {
  return kind.group === '' ? kind.version : `${kind.group}/${kind.version}`;
}

/** Whether `object` is of `kind`, by `apiVersion` and `kind`. */
export function isKind(object: { apiVersion?: unknown; kind?: unknown }, kind: KindRef): boolean {
  return object.apiVersion === apiVersion(kind) && object.kind === kind.kind;
}

/** Index of `kind` in `kinds`, by group, version and kind; -1 when it is not there. */
export function kindIndex(kinds: readonly KindRef[], kind: KindRef): number {
  return kinds.findIndex((k) => k.group === kind.group && k.version === kind.version && k.kind === kind.kind);
}

/** The built-in kinds plugins most often own or read. */
export const Kinds = {
  ConfigMap: namespacedKind('', 'v1', 'ConfigMap', 'configmaps'),
  Secret: namespacedKind('', 'v1', 'Secret', 'secrets'),
  Service: namespacedKind('', 'v1', 'Service', 'services'),
  ServiceAccount: namespacedKind('', 'v1', 'ServiceAccount', 'serviceaccounts'),
  PersistentVolumeClaim: namespacedKind('', 'v1', 'PersistentVolumeClaim', 'persistentvolumeclaims'),
  Deployment: namespacedKind('apps', 'v1', 'Deployment', 'deployments'),
  StatefulSet: namespacedKind('apps', 'v1', 'StatefulSet', 'statefulsets'),
  Job: namespacedKind('batch', 'v1', 'Job', 'jobs'),
  CronJob: namespacedKind('batch', 'v1', 'CronJob', 'cronjobs'),
  Pod: namespacedKind('', 'v1', 'Pod', 'pods'),
  Namespace: clusterKind('', 'v1', 'Namespace', 'namespaces'),
} as const satisfies Record<string, KindRef>;
