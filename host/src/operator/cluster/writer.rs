//! Act: the writer of one plugin's controller. It takes what a reconcile decided for one
//! parent (a plan, a teardown wave, a finalizer, a failure to report) and makes the API
//! calls under the ownership rules, through the write fence. It alone keeps the
//! bookkeeping of what it wrote, so that no caller updates its maps after a call:
//!
//! - the parents as its writes returned them, until the parent cache shows them
//!   ([`OwnWrites`]);
//! - what it applied to each child, to skip applies that would change nothing
//!   ([`AppliedChildren`]);
//! - what the child caches must show before the parent's next reconcile may trust them
//!   ([`Expectations`]), recorded also when a write fails half-way.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::api::{DynamicObject, PropagationPolicy};
use serde_json::Value;
use tracing::{info, warn};

use super::{ChildKinds, ChildOutcome, ClusterWrites, ErrorClass, OwnershipConflict, Result};
use crate::contract::{ChildRef, Event, Observed, ObservedChild};
use crate::operator::children::{Cached, Key, KindCache};
use crate::operator::freshness::{AppliedChildren, CacheState, Expectations, OwnWrites, Written};
use crate::operator::metrics::Metrics;
use crate::operator::parent::{CachedParent, ParentKind};
use crate::plan::{self, Plan};

/// The writer of one plugin's reconciles.
pub struct Writer {
    /// The API calls, through the write fence.
    api: ClusterWrites,
    /// The child kinds, resolved.
    kinds: ChildKinds,
    /// The shared caches of the child kinds, in the same order.
    caches: Vec<Arc<KindCache>>,
    /// The parents as the host last wrote them, until the parent cache shows them
    /// (shared with the controller's other plugins' writers: one parent cache).
    own_writes: Arc<OwnWrites>,
    /// What the host last applied to each child.
    applied: AppliedChildren,
    /// Writes the caches have not shown yet, per parent.
    expectations: Expectations,
    /// Counters of what was written.
    metrics: Arc<Metrics>,
    /// The plugin, as the metrics label it.
    plugin: String,
}

/// How the children of a plan were written.
#[derive(Debug)]
pub enum Acted {
    /// Everything desired was written; the parent is looked at again after this.
    Done(Option<Duration>),
    /// Some desired children could not be written because their names are taken by
    /// objects this parent does not control; the rest was written, and the conflicts
    /// are on the parent.
    WithConflicts,
}

/// What a teardown wave did.
#[derive(Debug, PartialEq, Eq)]
pub enum Wave {
    /// Nothing of it was left to delete: `finalize` can be called again now.
    Gone,
    /// Its children are being deleted; `finalize` waits until the caches show them gone.
    Deleting,
}

impl Writer {
    /// The writer of `plugin`'s reconciles, reading what it wrote back from `caches`
    /// (one per child kind, in the order of `kinds`).
    pub fn new(
        api: ClusterWrites,
        kinds: ChildKinds,
        caches: Vec<Arc<KindCache>>,
        own_writes: Arc<OwnWrites>,
        metrics: Arc<Metrics>,
        plugin: &str,
    ) -> Self {
        Writer {
            api,
            kinds,
            caches,
            own_writes,
            applied: AppliedChildren::default(),
            expectations: Expectations::default(),
            metrics,
            plugin: plugin.to_string(),
        }
    }

    /// The caches of the child kinds, in their order.
    pub fn caches(&self) -> &[Arc<KindCache>] {
        &self.caches
    }

    /// The parent as the host last wrote it, if the cache does not show that yet; else
    /// the cached one.
    pub fn freshest(&self, cached: &CachedParent, kind: &ParentKind) -> Arc<DynamicObject> {
        self.own_writes.freshest(cached, kind)
    }

    /// Whether the child caches show what was last written for the parent `uid`;
    /// after `limit` they are trusted anyway.
    pub fn caches_current(&self, uid: &str, limit: Duration) -> CacheState {
        let seen = |index: usize, key: &Key| {
            self.caches
                .get(index)
                .map_or(Cached::Absent, |c| c.lookup(key))
        };
        self.expectations.check(uid, seen, limit)
    }

    /// Forgets everything about a parent that is gone.
    pub fn forget(&self, uid: &str) {
        self.expectations.forget(uid);
        self.own_writes.forget(uid);
    }

    /// Writes `plan` for `obj` (as JSON, `parent`), whose children were `observed`:
    /// applies every desired child under the ownership rules, prunes the observed ones
    /// no longer desired (only after every apply succeeded), writes the status when it
    /// changed and posts the events. Ownership conflicts go on the parent (`Ready=False`,
    /// `ChildConflict`, and a Warning event each).
    pub async fn apply(
        &self,
        obj: &DynamicObject,
        parent: &Value,
        observed: &Observed,
        mut plan: Plan,
    ) -> Result<Acted> {
        let mut written = Written::default();
        let result = self
            .write_children(obj, observed, &plan, &mut written)
            .await;
        // Also after a failure: what was written must be seen before the next reconcile.
        self.expectations.expect(uid_of(obj), written);
        let conflicts = result?;
        if !conflicts.is_empty() {
            let message = conflicts
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; ");
            plan::set_condition(
                &mut plan.status,
                parent,
                &plan::not_ready("ChildConflict", &message),
                &plan::now(),
            );
            for conflict in &conflicts {
                plan.events
                    .push(plan::warning("ChildConflict", conflict.to_string()));
            }
        }
        if obj.data.get("status") != Some(&plan.status) {
            let written = self.api.write_status(obj, &plan.status).await?;
            self.own_writes.remember(written);
            self.metrics.status_written(&self.plugin);
        }
        if plan.dropped_events > 0
            && self
                .metrics
                .events_dropped(&self.plugin, plan.dropped_events)
        {
            warn!(plugin = %self.plugin, parent = obj.metadata.name.as_deref().unwrap_or_default(), dropped = plan.dropped_events, "the plugin asked for more than {} events in one reconcile: the rest are dropped, and counted in capstan_events_dropped_total (said once per plugin)", plan::MAX_EVENTS);
        }
        for event in &plan.events {
            self.api.publish(obj, event).await;
        }
        Ok(if conflicts.is_empty() {
            Acted::Done(plan.requeue_after)
        } else {
            Acted::WithConflicts
        })
    }

    /// Applies every desired child, then prunes; records in `written` what it wrote,
    /// also when it fails half-way. Returns the ownership conflicts.
    async fn write_children(
        &self,
        obj: &DynamicObject,
        observed: &Observed,
        plan: &Plan,
        written: &mut Written,
    ) -> Result<Vec<OwnershipConflict>> {
        // Each observed child's version, by (kind index, name).
        let observed_versions: HashMap<(usize, String), Option<&str>> = observed
            .children
            .iter()
            .map(|c| {
                let rv = c
                    .object
                    .pointer("/metadata/resourceVersion")
                    .and_then(Value::as_str);
                (
                    (
                        c.kind_index as usize,
                        field(c, "/metadata/name").unwrap_or_default(),
                    ),
                    rv,
                )
            })
            .collect();
        let mut conflicts = Vec::new();
        for child in &plan.children {
            let cached_rv = observed_versions.get(&(child.kind_index, child.name.clone()));
            let key = (
                child
                    .manifest
                    .pointer("/metadata/namespace")
                    .and_then(Value::as_str)
                    .map(String::from),
                child.name.clone(),
            );
            if let Some(&cached_rv) = cached_rv
                && self
                    .applied
                    .unchanged(child.kind_index, &key, &child.manifest, cached_rv)
            {
                self.metrics.child_written(&self.plugin, "unchanged");
                continue;
            }
            let outcome = self
                .api
                .apply_child(&self.kinds, obj, child, cached_rv.is_some())
                .await?;
            match outcome {
                ChildOutcome::Applied { resource_version } => {
                    self.metrics.child_written(&self.plugin, "applied");
                    let live = |index: usize, key: &Key| {
                        self.caches
                            .get(index)
                            .is_some_and(|c| matches!(c.lookup(key), Cached::Present(_)))
                    };
                    self.applied.record(
                        child.kind_index,
                        key.clone(),
                        &child.manifest,
                        resource_version.clone(),
                        live,
                    );
                    written
                        .applied
                        .push((child.kind_index, key, resource_version));
                }
                ChildOutcome::Adopted => {
                    self.metrics.child_written(&self.plugin, "applied");
                    self.applied.forget(child.kind_index, &key);
                    written.applied.push((child.kind_index, key, None));
                    let kind = self.kinds.kind(child.kind_index);
                    info!(kind = %kind, child = %child.name, "adopted");
                    let event = plan::normal(
                        "Adopted",
                        format!(
                            "{} {:?} consented to adoption and is now controlled by this object",
                            kind.kind, child.name
                        ),
                    );
                    self.api.publish(obj, &event).await;
                }
                ChildOutcome::Conflict(conflict) => {
                    warn!(kind = %conflict.kind, child = %conflict.name, "ownership conflict: {conflict}");
                    conflicts.push(conflict);
                }
            }
        }
        // A conflict is not a failed apply (nothing was written): the children this
        // parent controls stay in step with the plugin.
        let wanted: HashSet<(usize, &str)> = plan
            .children
            .iter()
            .map(|c| (c.kind_index, c.name.as_str()))
            .collect();
        for child in &observed.children {
            let index = child.kind_index as usize;
            let name = field(child, "/metadata/name").unwrap_or_default();
            if wanted.contains(&(index, name.as_str())) {
                continue;
            }
            self.api.prune_child(&self.kinds, child).await?;
            self.metrics.child_written(&self.plugin, "pruned");
            let key = (field(child, "/metadata/namespace"), name);
            self.applied.forget(index, &key);
            info!(kind = %self.kinds.kind(index), child = %key.1, "pruned");
            written
                .pruned
                .push((index, key, field(child, "/metadata/uid")));
        }
        Ok(conflicts)
    }

    /// Deletes the children of a teardown wave that `observed` holds (the ones this
    /// parent controls; the others are gone already, or never were its), in the
    /// foreground and with their UID as precondition, and expects the caches to show
    /// them gone. The wave's kind indexes are the engine's to check.
    pub async fn delete_wave(
        &self,
        obj: &DynamicObject,
        observed: &Observed,
        wave: &[ChildRef],
    ) -> Result<Wave> {
        let mut written = Written::default();
        let mut deleted = Vec::new();
        let mut first: Option<ObjectReference> = None;
        for named in wave {
            let index = named.kind_index as usize;
            let Some(child) = observed.children.iter().find(|c| {
                c.kind_index == named.kind_index
                    && c.object.pointer("/metadata/name").and_then(Value::as_str)
                        == Some(named.name.as_str())
            }) else {
                continue;
            };
            let result = self
                .api
                .delete_child(&self.kinds, child, PropagationPolicy::Foreground)
                .await;
            if let Err(e) = result {
                self.expectations.expect(uid_of(obj), written);
                return Err(e);
            }
            let namespace = field(child, "/metadata/namespace");
            let uid = field(child, "/metadata/uid");
            written
                .pruned
                .push((index, (namespace.clone(), named.name.clone()), uid.clone()));
            let kind = self.kinds.kind(index);
            deleted.push(format!("{} {:?}", kind.kind, named.name));
            first.get_or_insert_with(|| ObjectReference {
                api_version: Some(kind.api_version()),
                kind: Some(kind.kind.clone()),
                name: Some(named.name.clone()),
                namespace,
                uid,
                ..ObjectReference::default()
            });
        }
        if deleted.is_empty() {
            return Ok(Wave::Gone);
        }
        self.expectations.expect(uid_of(obj), written);
        let message = format!("teardown wave: deleting {}", deleted.join(", "));
        info!("{message}");
        self.api
            .publish_about(obj, &plan::normal("TeardownWave", message), "Delete", first)
            .await;
        Ok(Wave::Deleting)
    }

    /// Puts `finalizer` on the parent; the parent as written, or none if it is gone.
    pub async fn add_finalizer(
        &self,
        obj: &DynamicObject,
        finalizer: &str,
    ) -> Result<Option<Arc<DynamicObject>>> {
        let written = self.api.add_finalizer(obj, finalizer).await?;
        Ok(written.map(|w| self.own_writes.remember(w)))
    }

    /// Removes `finalizer` from the parent.
    pub async fn remove_finalizer(&self, obj: &DynamicObject, finalizer: &str) -> Result<()> {
        if let Some(written) = self.api.remove_finalizer(obj, finalizer).await? {
            self.own_writes.remember(written);
        }
        Ok(())
    }

    /// Puts a failure on the parent: `Ready=False` with `reason`, written as conditions
    /// only (the plugin's status fields are not touched), and a Warning event. Best
    /// effort: a failure to report is logged. Returns false when the conditions could
    /// not be written because the parent changed under them (409): report again soon.
    pub async fn report_failure(
        &self,
        obj: &DynamicObject,
        parent: &Value,
        reason: &str,
        message: &str,
    ) -> bool {
        let conditions = plan::failed_conditions(parent, reason, message, &plan::now());
        let mut reported = true;
        if obj.data.pointer("/status/conditions") != Some(&conditions) {
            match self.api.write_conditions(obj, &conditions).await {
                Ok(written) => {
                    self.own_writes.remember(written);
                    self.metrics.status_written(&self.plugin);
                }
                Err(e) => {
                    warn!("cannot write the failure to the status: {e}");
                    reported = e.class() != ErrorClass::Conflict;
                }
            }
        }
        self.api
            .publish(obj, &plan::warning(reason, message.to_string()))
            .await;
        reported
    }

    /// Posts an event on the parent (best effort).
    pub async fn publish(&self, obj: &DynamicObject, event: &Event) {
        self.api.publish(obj, event).await;
    }
}

/// How many entries the writer's per-parent maps hold, for the pipeline tests.
#[cfg(test)]
impl Writer {
    pub(crate) fn tracked(&self) -> (usize, usize) {
        (self.expectations.len(), self.applied.len())
    }

    pub(crate) fn make_sweeps_due(&self) {
        self.expectations.make_sweep_due();
        self.applied.make_sweep_due();
        self.own_writes.make_sweep_due();
    }
}

fn uid_of(obj: &DynamicObject) -> &str {
    obj.metadata.uid.as_deref().unwrap_or_default()
}

/// A string field of an observed child.
fn field(child: &ObservedChild, pointer: &str) -> Option<String> {
    child
        .object
        .pointer(pointer)
        .and_then(Value::as_str)
        .map(String::from)
}
