//! One reconcile of one parent (design sketch section 3): where the parent stands
//! ([`Phase`]: apply, add or drop the finalizer, finalize, force release, gone), then
//! Observe from the operator's caches, Decide through the [`engine`], Act through the
//! [`Writer`]; the canary's routing of a parent to a version; how the outcome becomes
//! the controller's next action (docs/internals.md).

use std::sync::Arc;
use std::time::Duration;

use kube::api::DynamicObject;
use kube::runtime::controller::Action;
use kube::{Resource, ResourceExt};
use serde_json::Value;
use tracing::{debug, info, instrument, warn};

use super::children::KindCache;
use super::cluster::{Acted, ChildKinds, ClusterWrites, Wave, Writer};
use super::failure::{
    Backoff, CONFLICT_RETRY, Failure, Reaction, api_code, jittered, random_fraction,
};
use super::finalizers::{FINALIZER, ForceRelease};
use super::freshness::{CacheState, OwnWrites};
use super::kinds::api_resource;
use super::metrics::Metrics;
use super::parent::{CachedParent, ParentKind};
use super::related::RelatedCache;
use super::rollout::canary::{self, Canary, Transition, Version};
use super::rollout::shadow;
use super::rollout::slot::ShadowSlot;
use crate::contract::{KindRef, Observed, ObservedChild, RelatedObject, Selector};
use crate::engine::{self, DecideError, ObserveError, RelatedSource, World};
use crate::plan;
use crate::plugin::{Pinned, Plugin};

/// Everything a reconcile needs, shared by every reconcile of one plugin's controller.
pub struct Context {
    /// The plugin.
    pub plugin: Plugin,
    /// Acts on what a reconcile decided, and keeps the bookkeeping of what it wrote.
    writer: Writer,
    /// The parent kind, as the parent cache keys it.
    parent_kind: ParentKind,
    /// Counters and timings.
    pub metrics: Arc<Metrics>,
    /// Resync period when the plugin sets none.
    pub default_resync: Duration,
    /// Consecutive failures per parent, for backoff.
    failures: Backoff,
    /// Parents being deleted that an administrator lets go without `finalize`.
    force_release: ForceRelease,
    /// The caches of the related kinds, in the order of `PluginInfo::related`, each
    /// with this controller's subscription to it.
    related: Vec<(Arc<RelatedCache>, u64)>,
    /// The plugin's shadow version, called with the same observed state and compared,
    /// never applied (shadow mode).
    shadow: ShadowSlot,
    /// The plugin's clock and random, pinned (tests and `capstan check`); none: the
    /// host's, as `capstan run` gives them.
    pinned: Option<Pinned>,
}

impl Context {
    /// A context for `plugin`.
    pub fn new(
        plugin: Plugin,
        cluster: ClusterWrites,
        children: ChildKinds,
        caches: Vec<Arc<KindCache>>,
        own_writes: Arc<OwnWrites>,
        metrics: Arc<Metrics>,
        default_resync: Duration,
    ) -> Self {
        let parent_kind = ParentKind::new(api_resource(&plugin.info().parent));
        let writer = Writer::new(
            cluster,
            children,
            caches,
            own_writes,
            metrics.clone(),
            &plugin.info().name,
        );
        Context {
            plugin,
            writer,
            parent_kind,
            metrics,
            default_resync,
            failures: Backoff::default(),
            force_release: ForceRelease::default(),
            related: Vec::new(),
            shadow: ShadowSlot::default(),
            pinned: None,
        }
    }

    /// The same context, every plugin call of it with its clock and random `pinned`
    /// (the front doors' agreement test; `capstan check` will drive the engine so).
    #[cfg(test)]
    pub fn with_pinned(mut self, pinned: Pinned) -> Self {
        self.pinned = Some(pinned);
        self
    }

    /// The world a decision is made on: `observed`, now (or at the pinned instant).
    fn world(&self, observed: Observed) -> World {
        match self.pinned {
            Some(pinned) => World::pinned(observed, pinned),
            None => World::at_present(observed),
        }
    }

    /// The same context, calling the shadow version `shadow` holds (if any) on every
    /// reconcile too.
    pub fn with_shadow(mut self, shadow: ShadowSlot) -> Self {
        self.shadow = shadow;
        self
    }

    /// The canary candidate and its canary, if one runs (`--canary`), checked against
    /// this serving version.
    fn canary(&self) -> Option<(Plugin, Arc<Canary>)> {
        let (candidate, canary) = self.shadow.canary()?;
        canary.check(&self.plugin, candidate.info());
        Some((candidate, canary))
    }

    /// The same context, reading related objects from `related` (one cache per related
    /// kind, in declaration order, with this controller's subscription).
    pub fn with_related(mut self, related: Vec<(Arc<RelatedCache>, u64)>) -> Self {
        self.related = related;
        self
    }

    /// The same context, letting go the parents `force` names without `finalize`
    /// (parents annotated for it are let go in any case).
    pub fn with_force_release(mut self, force: ForceRelease) -> Self {
        self.force_release = force;
        self
    }

    /// The resync period, spread by ±10 % per parent and time, so that parents created
    /// together (10 000 of them after a restart) do not all wake up in the same second.
    fn resync(&self) -> Duration {
        let period = self
            .plugin
            .info()
            .resync_seconds
            .map(|s| Duration::from_secs(u64::from(s.max(1))))
            .unwrap_or(self.default_resync);
        period.mul_f64(0.9 + random_fraction() * 0.2)
    }

    /// The parent's children as the caches hold them, once the caches are synced.
    fn observed_children(&self, parent: &DynamicObject) -> Result<Vec<ObservedChild>, Failure> {
        let uid = parent.metadata.uid.as_deref().unwrap_or_default();
        let ns = parent.metadata.namespace.as_deref();
        let mut observed = Vec::new();
        for (index, cache) in self.writer.caches().iter().enumerate() {
            for child in cache.children_of(uid, ns) {
                let object = serde_json::to_value(&*child)
                    .map_err(|e| Failure::Retry(format!("cannot read a cached child: {e}")))?;
                observed.push(ObservedChild {
                    kind_index: index as u32,
                    object,
                });
            }
        }
        Ok(observed)
    }

    /// The related objects `customize` asks for, for `parent`, as the caches hold them;
    /// records the requests, so that a change to what they select reconciles it again.
    async fn observed_related(
        &self,
        plugin: &Plugin,
        obj: &DynamicObject,
        parent: &Value,
    ) -> Result<Vec<RelatedObject>, Failure> {
        if self.related.is_empty() {
            return Ok(Vec::new());
        }
        let source = CachedRelated {
            caches: &self.related,
            parent: (obj.metadata.namespace.clone(), obj.name_any()),
        };
        let selected = engine::observe::related(plugin, parent, &source, self.pinned).await?;
        Ok(selected.objects)
    }

    /// Forgets everything about a parent that is gone: what the writer keeps and what
    /// it asked for of the related caches.
    fn forget(&self, obj: &DynamicObject) {
        self.writer.forget(uid_of(obj));
        self.forget_related(obj);
    }

    /// Forgets what a parent that is gone asked for.
    fn forget_related(&self, obj: &DynamicObject) {
        let key = (obj.metadata.namespace.clone(), obj.name_any());
        for (cache, subscriber) in &self.related {
            cache.forget(*subscriber, &key);
        }
    }

    /// Waits (bounded) until every child and related kind's cache completed its first
    /// list.
    async fn caches_synced(&self) -> Result<(), Failure> {
        for cache in self.writer.caches() {
            if !cache.synced(CACHE_SYNC_TIMEOUT).await {
                return Err(Failure::CacheNotSynced(cache.kind().to_string()));
            }
        }
        for (cache, _) in &self.related {
            if !cache.synced(CACHE_SYNC_TIMEOUT).await {
                return Err(Failure::CacheNotSynced(cache.kind().to_string()));
            }
        }
        Ok(())
    }
}

/// The related caches of one controller, as the engine's source of one parent's
/// related objects: a selection records what the parent asked for.
struct CachedRelated<'a> {
    caches: &'a [(Arc<RelatedCache>, u64)],
    parent: (Option<String>, String),
}

impl RelatedSource for CachedRelated<'_> {
    fn select(
        &self,
        index: usize,
        _kind: &KindRef,
        _parent: &Value,
        selectors: &[Selector],
    ) -> Result<Vec<Value>, ObserveError> {
        let Some((cache, subscriber)) = self.caches.get(index) else {
            return Ok(Vec::new());
        };
        cache
            .select_for(*subscriber, &self.parent, selectors)
            .iter()
            .map(|object| {
                serde_json::to_value(&**object).map_err(|e| {
                    ObserveError::Source(format!("cannot read a cached related object: {e}"))
                })
            })
            .collect()
    }
}

/// How long a reconcile waits for the child caches' first list.
const CACHE_SYNC_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a parent waits for the caches to show the host's own writes before it
/// trusts them anyway.
const EXPECTATION_LIMIT: Duration = Duration::from_secs(30);
/// How soon a parent whose caches are behind is looked at again.
const CACHE_BEHIND_RETRY: Duration = Duration::from_millis(200);

/// Error type of the controller; every failure is reported inside [`reconcile`], so
/// this only carries what could not even be reported.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ReportError(String);

/// The reconcile function handed to `kube::runtime::Controller`.
#[instrument(skip_all, fields(plugin = %ctx.plugin.info().name, name = cached.meta().name.as_deref().unwrap_or_default(), namespace = cached.meta().namespace.as_deref().unwrap_or_default()))]
pub async fn reconcile(
    cached: Arc<CachedParent>,
    ctx: Arc<Context>,
) -> Result<Action, ReportError> {
    let _timer = ctx.metrics.reconcile_timer(&ctx.plugin.info().name);
    // The cache may not show this host's last write of the parent yet.
    let obj = ctx.writer.freshest(&cached, &ctx.parent_kind);
    let uid = obj.metadata.uid.clone().unwrap_or_default();
    let parent = serde_json::to_value(&*obj).map_err(|e| ReportError(e.to_string()))?;
    // While a canary runs, the candidate reconciles the parents of its share (never a
    // parent being deleted: teardown stays with the serving version).
    let canary = ctx.canary();
    let version = match &canary {
        Some((_, c)) if obj.metadata.deletion_timestamp.is_none() && c.serves(&uid) => {
            Version::Candidate
        }
        _ => Version::Serving,
    };
    let by = Serve {
        candidate: canary
            .as_ref()
            .filter(|_| version == Version::Candidate)
            .map(|(p, _)| p),
        canary: canary.as_ref().map(|(_, c)| &**c),
    };
    let result = reconcile_parent(&obj, &parent, &ctx, &by).await;
    if let Some((_, canary)) = &canary
        && obj.metadata.deletion_timestamp.is_none()
    {
        count_for_canary(&ctx, canary, version, &uid, &result);
    }
    match result {
        Ok(Reconciled::Done(action)) => {
            ctx.failures.succeeded(&uid);
            ctx.metrics.reconciled(&ctx.plugin.info().name, "ok");
            Ok(action)
        }
        Ok(Reconciled::CacheBehind) => {
            ctx.metrics
                .reconciled(&ctx.plugin.info().name, "CacheBehind");
            Ok(Action::requeue(CACHE_BEHIND_RETRY))
        }
        Ok(Reconciled::WithConflicts) => {
            ctx.metrics
                .reconciled(&ctx.plugin.info().name, "ChildConflict");
            // The taken name frees up only by a change to an object the host does not
            // watch (the user deletes or annotates it): look again with backoff.
            Ok(Action::requeue(ctx.failures.backoff(&uid)))
        }
        Err(failure) => {
            let reaction = failure.reaction();
            ctx.metrics
                .reconciled(&ctx.plugin.info().name, failure.reason());
            match reaction {
                Reaction::RetrySoon => {
                    debug!("reconcile raced another writer, retrying soon: {failure}");
                    return Ok(Action::requeue(jittered(CONFLICT_RETRY)));
                }
                Reaction::Backoff => {
                    warn!(reason = failure.reason(), code = ?api_code(&failure), "reconcile failed, will retry: {failure}");
                    return Ok(Action::requeue(ctx.failures.backoff(&uid)));
                }
                _ => {}
            }
            warn!(reason = failure.reason(), code = ?api_code(&failure), "reconcile failed: {failure}");
            // The reconcile may have written the parent (its finalizer) before failing:
            // the report goes on that version, else it is refused as a conflict.
            let obj = ctx.writer.freshest(&cached, &ctx.parent_kind);
            let parent = serde_json::to_value(&*obj).map_err(|e| ReportError(e.to_string()))?;
            let reported = ctx
                .writer
                .report_failure(&obj, &parent, failure.reason(), &failure.to_string())
                .await;
            if !reported {
                // Not on the parent yet (another writer was first): report again soon,
                // or a failure that waits for a new spec would never show.
                return Ok(Action::requeue(jittered(CONFLICT_RETRY)));
            }
            Ok(match reaction {
                Reaction::ReportAndBackoff => Action::requeue(ctx.failures.backoff(&uid)),
                Reaction::ReportAndResync => Action::requeue(jittered(ctx.resync())),
                // Permanent until the spec changes (a new generation triggers a
                // reconcile) or a new plugin version is loaded (its controller starts
                // over); retrying the same input would give the same answer.
                _ => Action::await_change(),
            })
        }
    }
}

/// Which version reconciles a parent.
struct Serve<'a> {
    /// The canary candidate, for a parent of its share; none: the serving version.
    candidate: Option<&'a Plugin>,
    /// The canary running, if any.
    canary: Option<&'a Canary>,
}

/// Counts the outcome of a reconcile by `version` for the canary; rolls it back when
/// this one takes it past the bound. Transient trouble (the API server unwell, a race,
/// caches behind) says nothing about the plugin and is not counted.
fn count_for_canary(
    ctx: &Context,
    canary: &Canary,
    version: Version,
    uid: &str,
    result: &Result<Reconciled, Failure>,
) {
    let failure = match result {
        Ok(Reconciled::Done(_)) => None,
        Ok(Reconciled::WithConflicts) => {
            Some("a child's name is taken by an object this parent does not control".to_string())
        }
        Ok(Reconciled::CacheBehind) => return,
        Err(failure) => match failure.reaction() {
            Reaction::RetrySoon | Reaction::Backoff => return,
            _ => Some(failure.to_string()),
        },
    };
    let plugin = &ctx.plugin.info().name;
    ctx.metrics
        .canary_reconciled(plugin, version.label(), failure.is_some());
    if let Some(reason) = canary.record(version, uid, failure.as_deref()) {
        canary::announce(
            &ctx.metrics,
            plugin,
            canary,
            &Transition::RolledBack(reason),
        );
    }
}

/// The controller's error policy: only reached when a failure could not be reported.
pub fn error_policy(_obj: Arc<CachedParent>, err: &ReportError, ctx: Arc<Context>) -> Action {
    warn!(plugin = %ctx.plugin.info().name, "reconcile error: {err}");
    Action::requeue(Duration::from_secs(5))
}

/// How a reconcile that did not fail ended.
enum Reconciled {
    /// Everything desired was written.
    Done(Action),
    /// Some desired children could not be written because their names are taken by
    /// objects this parent does not control; the rest was written.
    WithConflicts,
    /// The caches do not show the host's last writes for this parent yet: acting now
    /// could prune or re-create a child on stale information.
    CacheBehind,
}

/// Where a parent stands, which decides what a reconcile does with it (as kube-rs's
/// `finalizer` helper splits apply from cleanup).
enum Phase {
    /// Live, with the finalizer its plugin asks for, if any: decide and apply.
    Apply,
    /// Live, and its plugin asks for a finalizer it does not carry yet: put it on first.
    AddFinalizer,
    /// It carries the host's finalizer but its plugin no longer asks for one: nothing
    /// would ever remove it, and a deletion would hang.
    DropFinalizer,
    /// Being deleted, with the finalizer: `finalize` until done.
    Finalize,
    /// Being deleted with the finalizer, and an administrator lets it go without its
    /// cleanup.
    ForceRelease,
    /// Being deleted without the finalizer: Kubernetes garbage-collects the children
    /// through their ownerReferences; the host forgets it.
    Gone,
}

impl Phase {
    fn of(obj: &DynamicObject, ctx: &Context) -> Phase {
        let info = ctx.plugin.info();
        let has_finalizer = obj
            .metadata
            .finalizers
            .iter()
            .flatten()
            .any(|f| f == FINALIZER);
        let deleting = obj.metadata.deletion_timestamp.is_some();
        let released = has_finalizer && ctx.force_release.applies(&info.parent, obj);
        match (deleting, info.finalizer, has_finalizer) {
            (_, false, true) => Phase::DropFinalizer,
            (true, true, true) if !released => Phase::Finalize,
            (true, _, true) => Phase::ForceRelease,
            (true, _, false) => Phase::Gone,
            (false, true, false) => Phase::AddFinalizer,
            (false, _, _) => Phase::Apply,
        }
    }
}

async fn reconcile_parent(
    obj: &DynamicObject,
    parent: &Value,
    ctx: &Context,
    by: &Serve<'_>,
) -> Result<Reconciled, Failure> {
    match Phase::of(obj, ctx) {
        Phase::Apply => reconcile_live(obj, parent, ctx, by).await,
        Phase::AddFinalizer => {
            let Some(written) = ctx.writer.add_finalizer(obj, FINALIZER).await? else {
                return Ok(Reconciled::Done(Action::await_change()));
            };
            // Go on from the parent as written: the status write carries the version it
            // was computed from, and the one before the finalizer would be refused (409).
            let parent = serde_json::to_value(&*written)
                .map_err(|e| Failure::Retry(format!("cannot read the parent: {e}")))?;
            reconcile_live(&written, &parent, ctx, by).await
        }
        Phase::DropFinalizer => {
            ctx.writer.remove_finalizer(obj, FINALIZER).await?;
            info!("the plugin no longer declares a finalizer; {FINALIZER} removed");
            Ok(Reconciled::Done(Action::await_change()))
        }
        // The expectations of a teardown wave stay until finalize is done.
        Phase::Finalize => finalize(obj, parent, ctx).await,
        Phase::ForceRelease => {
            let released = force_release(obj, ctx).await.map(Reconciled::Done);
            ctx.forget(obj);
            released
        }
        Phase::Gone => {
            ctx.forget(obj);
            Ok(Reconciled::Done(Action::await_change()))
        }
    }
}

/// The reconcile of a parent that is not being deleted and has the finalizer it needs:
/// observe, decide, act.
async fn reconcile_live(
    obj: &DynamicObject,
    parent: &Value,
    ctx: &Context,
    by: &Serve<'_>,
) -> Result<Reconciled, Failure> {
    let plugin = by.candidate.unwrap_or(&ctx.plugin);
    let uid = obj.metadata.uid.as_deref().unwrap_or_default();
    ctx.caches_synced().await?;
    match ctx.writer.caches_current(uid, EXPECTATION_LIMIT) {
        CacheState::Current => {}
        CacheState::Behind => return Ok(Reconciled::CacheBehind),
        CacheState::GaveUp => warn!(
            "the child caches did not show this parent's last writes within {EXPECTATION_LIMIT:?}; trusting them"
        ),
    }
    let world = ctx.world(Observed {
        parent: parent.clone(),
        children: ctx.observed_children(obj)?,
        related: ctx.observed_related(plugin, obj, parent).await?,
    });
    let mut plan = engine::decide(plugin, &world).await?;
    if by.candidate.is_none()
        && let Some(notice) = by.canary.and_then(|c| c.rolled_back_notice(uid))
    {
        plan.events.push(plan::warning("CanaryRolledBack", notice));
    }
    // The shadow's answer to the same state is compared with this plan, whatever the
    // writes do: it judges the plugin's logic, not the API server's answers. A parent
    // the canary candidate serves is not shadowed (the shadow is the candidate).
    let served = (by.candidate.is_none() && ctx.shadow.get().is_some()).then(|| plan.clone());
    let acted = ctx.writer.apply(obj, parent, &world.observed, plan).await;
    if let Some(served) = served {
        shadow::shadow_reconcile(&ctx.shadow, &world, &served, &ctx.plugin, &ctx.metrics).await;
    }
    Ok(match acted? {
        Acted::Done(requeue) => {
            Reconciled::Done(Action::requeue(requeue.unwrap_or_else(|| ctx.resync())))
        }
        Acted::WithConflicts => Reconciled::WithConflicts,
    })
}

/// One step of a parent's teardown: calls `finalize` once the caches show the last
/// wave gone, deletes the next wave it names, or removes the finalizer when it is done.
async fn finalize(
    obj: &DynamicObject,
    parent: &Value,
    ctx: &Context,
) -> Result<Reconciled, Failure> {
    ctx.caches_synced().await?;
    match ctx.writer.caches_current(uid_of(obj), WAVE_LIMIT) {
        CacheState::Current => {}
        CacheState::Behind => return Ok(Reconciled::CacheBehind),
        CacheState::GaveUp => {
            let message = format!(
                "children of the last teardown wave are still there after {}s; finalize runs again",
                WAVE_LIMIT.as_secs()
            );
            warn!("{message}");
            ctx.writer
                .publish(obj, &plan::warning("TeardownWaveSlow", message))
                .await;
        }
    }
    let world = ctx.world(Observed {
        parent: parent.clone(),
        children: ctx.observed_children(obj)?,
        related: ctx
            .observed_related(&ctx.plugin, obj, parent)
            .await
            .map_err(|e| Failure::FinalizeFailed(e.to_string()))?,
    });
    let result = match engine::finalize(&ctx.plugin, &world).await {
        Ok(result) => result,
        Err(DecideError::Plugin(e)) => return Err(Failure::FinalizeFailed(e.to_string())),
        Err(DecideError::Refused(v)) => return Err(Failure::FinalizeFailed(v.to_string())),
        Err(e) => return Err(Failure::FinalizeFailed(e.to_string())),
    };
    for event in &result.events {
        ctx.writer.publish(obj, event).await;
    }
    if !result.delete.is_empty() {
        return match ctx
            .writer
            .delete_wave(obj, &world.observed, &result.delete)
            .await?
        {
            // The whole wave is gone: finalize again now.
            Wave::Gone => Ok(Reconciled::Done(Action::requeue(Duration::from_millis(1)))),
            // The deletions reach this parent as child events; this is in case one is
            // missed.
            Wave::Deleting => Ok(Reconciled::CacheBehind),
        };
    }
    if result.done {
        ctx.writer.remove_finalizer(obj, FINALIZER).await?;
        ctx.forget(obj);
        info!("finalized; finalizer removed");
        Ok(Reconciled::Done(Action::await_change()))
    } else {
        let delay = result.requeue_after_seconds.unwrap_or(5).max(1);
        Ok(Reconciled::Done(Action::requeue(Duration::from_secs(
            u64::from(delay),
        ))))
    }
}

/// How long a teardown wave may take before `finalize` is called again anyway (with
/// a Warning event): its children and what they own are deleted in the foreground, so
/// a StatefulSet's wave lasts until its Pods have stopped.
const WAVE_LIMIT: Duration = Duration::from_secs(100);

fn uid_of(obj: &DynamicObject) -> &str {
    obj.metadata.uid.as_deref().unwrap_or_default()
}

/// Removes the host's finalizer from a parent being deleted without calling
/// `finalize`, because an administrator said so ([`ForceRelease`]); says so in a
/// Warning event.
async fn force_release(obj: &DynamicObject, ctx: &Context) -> Result<Action, Failure> {
    ctx.writer.remove_finalizer(obj, FINALIZER).await?;
    warn!("{FINALIZER} removed without finalize: force release");
    let event = plan::warning(
        "FinalizerForceReleased",
        format!("{FINALIZER} removed without finalize: an administrator let this object go"),
    );
    ctx.writer.publish(obj, &event).await;
    Ok(Action::await_change())
}

/// What the per-parent maps of a context hold, for the pipeline tests.
#[cfg(test)]
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Tracked {
    pub expectations: usize,
    pub applied: usize,
    pub failures: usize,
}

#[cfg(test)]
impl Context {
    pub(super) fn tracked(&self) -> Tracked {
        let (expectations, applied) = self.writer.tracked();
        Tracked {
            expectations,
            applied,
            failures: self.failures.len(),
        }
    }

    /// Makes the next use of each map sweep it, as if its period had passed.
    pub(super) fn make_sweeps_due(&self) {
        self.writer.make_sweeps_due();
    }
}

/// The finalize path against a fake API server, with the `guard` test plugin as a
/// native plugin: no wasm is built for these.
#[cfg(test)]
mod finalize_tests {
    use http::Method;
    use serde_json::json;

    use super::super::children::{ChildCaches, KindWatch};
    use super::super::fake_api::{self, Call};
    use super::super::leader::WriteFence;
    use super::*;
    use crate::contract::{Desired, FinalizeResult, PluginError, PluginInfo};
    use crate::plugin::Native;

    /// A server with no ConfigMaps that accepts status writes and events.
    fn server(call: &Call) -> (u16, Value) {
        match call.method {
            Method::GET if call.path.ends_with("/configmaps") => (
                200,
                json!({"apiVersion": "v1", "kind": "ConfigMapList",
                       "metadata": {"resourceVersion": "1"}, "items": []}),
            ),
            Method::PATCH => (
                200,
                json!({
                    "apiVersion": "test.capstan.dev/v1", "kind": "Guard",
                    "metadata": {"name": "g", "namespace": "ns", "uid": "uid-g", "resourceVersion": "3"},
                }),
            ),
            Method::POST if call.path.contains("/events") => (201, call.body.clone()),
            _ => fake_api::status(404, "NotFound", "not here"),
        }
    }

    /// The `guard` test plugin (tests/plugins/guard), natively: one ConfigMap, a
    /// finalizer, and a `finalize` that refuses with `spec.refuse` or holds until
    /// `spec.release`.
    struct Guard;

    impl Native for Guard {
        fn describe(&self) -> PluginInfo {
            PluginInfo {
                name: "guard".into(),
                version: "0.1.0".into(),
                parent: KindRef::namespaced("test.capstan.dev", "v1", "Guard", "guards"),
                children: vec![KindRef::namespaced("", "v1", "ConfigMap", "configmaps")],
                finalizer: true,
                ..PluginInfo::default()
            }
        }

        fn reconcile(&self, observed: &Observed) -> Result<Desired, PluginError> {
            let name = observed.parent["metadata"]["name"]
                .as_str()
                .unwrap_or_default();
            Ok(Desired {
                children: vec![
                    json!({"apiVersion": "v1", "kind": "ConfigMap",
                           "metadata": {"name": format!("{name}-guarded")}})
                    .to_string(),
                ],
                status: Some(json!({"guarding": true}).to_string()),
                conditions: Vec::new(),
                events: Vec::new(),
                requeue_after_seconds: None,
            })
        }

        fn finalize(&self, observed: &Observed) -> Result<FinalizeResult, PluginError> {
            let spec = &observed.parent["spec"];
            if let Some(why) = spec["refuse"].as_str() {
                return Err(PluginError::Invalid(why.into()));
            }
            Ok(FinalizeResult {
                done: spec["release"] == true,
                requeue_after_seconds: Some(2),
                ..FinalizeResult::default()
            })
        }
    }

    /// The context of the guard plugin, and the caches it reads (their watches stop
    /// when they are dropped).
    async fn context(client: kube::Client) -> (Arc<Context>, ChildCaches, Vec<KindWatch>) {
        let plugin = Plugin::native(Guard);
        let info = plugin.info().clone();
        let metrics = Arc::new(Metrics::default());
        let caches = ChildCaches::new(
            client.clone(),
            Some("ns".into()),
            None,
            metrics.clone(),
            None,
        );
        let watches: Vec<KindWatch> = info
            .children
            .iter()
            .map(|k| caches.watch(k, &info.name))
            .collect();
        let kind_caches = watches.iter().map(|w| w.cache().clone()).collect();
        let ctx = Context::new(
            plugin,
            ClusterWrites::new(client, &info.parent, &info.name, WriteFence::default()),
            ChildKinds::new(&info.children),
            kind_caches,
            Arc::new(OwnWrites::default()),
            metrics,
            Duration::from_secs(300),
        );
        (Arc::new(ctx), caches, watches)
    }

    fn deleting_guard(spec: Value, annotations: Value) -> Arc<CachedParent> {
        let obj: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "test.capstan.dev/v1", "kind": "Guard",
            "metadata": {"name": "g", "namespace": "ns", "uid": "uid-g", "resourceVersion": "2",
                         "generation": 1, "finalizers": [FINALIZER],
                         "deletionTimestamp": "2026-12-04T00:00:00Z", "annotations": annotations},
            "spec": spec,
        }))
        .unwrap();
        Arc::new(CachedParent::new(obj))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_finalize_that_says_invalid_is_reported_and_retried_with_backoff() {
        let (client, calls) = fake_api::client(server);
        let (ctx, _caches, _watches) = context(client).await;
        let parent = deleting_guard(json!({"refuse": "the backup bucket is gone"}), json!({}));
        let action = reconcile(parent, ctx).await.unwrap();
        assert_ne!(
            action,
            Action::await_change(),
            "a deletion has no spec change to wait for"
        );
        let calls = calls.all();
        let status = calls
            .iter()
            .find(|c| c.method == Method::PATCH && c.path.ends_with("/guards/g/status"))
            .expect("the failure is written on the parent");
        let ready = status.ready_condition().expect("a Ready condition");
        assert_eq!(ready["status"], "False");
        assert_eq!(ready["reason"], "FinalizeFailed");
        assert!(
            ready["message"]
                .as_str()
                .unwrap()
                .contains("the backup bucket is gone"),
            "the plugin's message: {ready}"
        );
        let event = calls
            .iter()
            .find(|c| c.path.contains("/events"))
            .expect("an event");
        assert_eq!(event.body["type"], "Warning");
        assert_eq!(event.body["reason"], "FinalizeFailed");
        assert!(
            !calls
                .iter()
                .any(|c| c.method == Method::PATCH && c.path.ends_with("/guards/g")),
            "the finalizer stays"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_annotated_parent_is_let_go_without_finalize() {
        let (client, calls) = fake_api::client(server);
        let (ctx, _caches, _watches) = context(client).await;
        let parent = deleting_guard(
            json!({"refuse": "the backup bucket is gone"}),
            json!({super::super::finalizers::FORCE_RELEASE_ANNOTATION: "true"}),
        );
        reconcile(parent, ctx).await.unwrap();
        let calls = calls.all();
        let release = calls
            .iter()
            .find(|c| c.method == Method::PATCH && c.path.ends_with("/guards/g"))
            .expect("the finalizer is removed");
        assert_eq!(release.body["metadata"]["finalizers"], json!([]));
        let reasons: Vec<&str> = calls
            .iter()
            .filter(|c| c.path.contains("/events"))
            .filter_map(|c| c.body["reason"].as_str())
            .collect();
        assert_eq!(reasons, ["FinalizerForceReleased"], "finalize never ran");
    }
}
