//! One reconcile of one parent, step by step (design sketch section 3): finalizer,
//! observed children, the plugin call, validation, apply, prune, status, events, requeue.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ObjectReference;
use kube::api::{DynamicObject, PropagationPolicy};
use kube::runtime::controller::Action;
use kube::{Resource, ResourceExt};
use serde_json::Value;
use tracing::{debug, info, instrument, warn};

use super::canary::{self, Canary, Transition, Version};
use super::children::{Cached, Key, KindCache};
use super::cluster::{
    self, ChildKinds, ChildOutcome, ClusterWrites, ErrorClass, OwnershipConflict,
};
use super::finalizers::ForceRelease;
use super::freshness::{AppliedChildren, CacheState, Expectations, OwnWrites, Written};
use super::metrics::Metrics;
use super::parent::{CachedParent, ParentKind};
use super::related::RelatedCache;
use super::shadow::{self, ShadowSlot};
use crate::contract::{ChildRef, Observed, ObservedChild, PluginError, RelatedObject, Selector};
use crate::plan::{self, Plan};
use crate::plugin::{CallError, Plugin};
use crate::validate::{self, Violation};

/// Finalizer the host puts on parents whose plugin asks for one.
pub const FINALIZER: &str = "capstan.dev/finalizer";

/// Everything a reconcile needs, shared by every reconcile of one plugin's controller.
pub struct Context {
    /// The plugin.
    pub plugin: Plugin,
    /// Reads and writes against the cluster.
    pub cluster: ClusterWrites,
    /// The child kinds, resolved.
    pub children: ChildKinds,
    /// The shared caches of the child kinds, in the same order.
    caches: Vec<Arc<KindCache>>,
    /// The parent kind, as the parent cache keys it.
    parent_kind: ParentKind,
    /// Writes the caches have not shown yet, per parent.
    expectations: Expectations,
    /// The parents as the host last wrote them, until the parent cache shows it.
    own_writes: Arc<OwnWrites>,
    /// What the host last applied to each child, to skip applies that change nothing.
    applied: AppliedChildren,
    /// Counters and timings.
    pub metrics: Arc<Metrics>,
    /// Resync period when the plugin sets none.
    pub default_resync: Duration,
    /// Consecutive failures per parent UID, with the time of the last one, for backoff.
    failures: Mutex<HashMap<String, (u32, Instant)>>,
    /// Parents being deleted that an administrator lets go without `finalize`.
    force_release: ForceRelease,
    /// The caches of the related kinds, in the order of `PluginInfo::related`, each
    /// with this controller's subscription to it.
    related: Vec<(Arc<RelatedCache>, u64)>,
    /// The plugin's shadow version, called with the same observed state and compared,
    /// never applied (shadow mode).
    shadow: ShadowSlot,
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
        let parent_kind = ParentKind::new(cluster::api_resource(&plugin.info().parent));
        Context {
            plugin,
            cluster,
            children,
            parent_kind,
            caches,
            expectations: Expectations::default(),
            own_writes,
            applied: AppliedChildren::default(),
            metrics,
            default_resync,
            failures: Mutex::new(HashMap::new()),
            force_release: ForceRelease::default(),
            related: Vec::new(),
            shadow: ShadowSlot::default(),
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
        for (index, cache) in self.caches.iter().enumerate() {
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
        let requests = plugin.customize_async(parent).await??;
        validate::related_requests(plugin.info(), &requests)?;
        let key = (obj.metadata.namespace.clone(), obj.name_any());
        let mut observed = Vec::new();
        for (index, (cache, subscriber)) in self.related.iter().enumerate() {
            let selectors: Vec<Selector> = requests
                .iter()
                .filter(|r| r.kind_index as usize == index)
                .map(|r| r.selector.clone())
                .collect();
            for object in cache.select_for(*subscriber, &key, &selectors) {
                if observed.len() == validate::MAX_RELATED_OBJECTS {
                    return Err(Violation::TooLarge {
                        what: "the related objects customize selected".into(),
                        size: observed.len() + 1,
                        limit: validate::MAX_RELATED_OBJECTS,
                    }
                    .into());
                }
                let object = serde_json::to_value(&*object).map_err(|e| {
                    Failure::Retry(format!("cannot read a cached related object: {e}"))
                })?;
                observed.push(RelatedObject {
                    kind_index: index as u32,
                    object,
                });
            }
        }
        Ok(observed)
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
        for cache in &self.caches {
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

    /// Exponential backoff with jitter: 1 s, 2 s, 4 s … up to 5 min, times 0.5–1.0.
    fn backoff(&self, uid: &str) -> Duration {
        let mut failures = self.failures.lock().expect("failures lock");
        forget_stale(&mut failures, Instant::now());
        let (n, last) = failures
            .entry(uid.to_string())
            .or_insert((0, Instant::now()));
        *n = n.saturating_add(1);
        *last = Instant::now();
        let base = Duration::from_secs(1u64 << (*n - 1).min(8)).min(MAX_BACKOFF);
        base.mul_f64(0.5 + random_fraction() * 0.5)
    }

    fn succeeded(&self, uid: &str) {
        self.failures.lock().expect("failures lock").remove(uid);
    }
}

/// How long a reconcile waits for the child caches' first list.
const CACHE_SYNC_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a parent waits for the caches to show the host's own writes before it
/// trusts them anyway.
const EXPECTATION_LIMIT: Duration = Duration::from_secs(30);
/// How soon a parent whose caches are behind is looked at again.
const CACHE_BEHIND_RETRY: Duration = Duration::from_millis(200);

/// A uniformly random number in [0, 1), for jitter (not for anything secret).
fn random_fraction() -> f64 {
    fastrand::f64()
}

/// Longest backoff between two attempts of a failing parent.
const MAX_BACKOFF: Duration = Duration::from_secs(300);

/// Drops the failure counts of parents that have not failed for twice the longest
/// backoff: they succeeded since, or were deleted (the controller never reconciles a
/// parent that is gone, so nothing else would ever remove its entry).
fn forget_stale(failures: &mut HashMap<String, (u32, Instant)>, now: Instant) {
    failures.retain(|_, (_, last)| now.duration_since(*last) < MAX_BACKOFF * 2);
}

/// A reconcile that did not complete, and how the host reacts to it.
#[derive(Debug, thiserror::Error)]
pub enum Failure {
    /// The plugin said the spec is invalid: wait for a new generation.
    #[error("{0}")]
    InvalidSpec(String),
    /// `finalize` of a parent being deleted failed (the plugin said invalid or retry, or
    /// could not be called to the end). Nothing else would ever wake the parent up
    /// (its spec cannot change any more), so it is retried with backoff.
    #[error(
        "finalize failed: {0}; the deletion waits for it (annotate the parent \
         capstan.dev/force-release-finalizer=true to let it go without its cleanup)"
    )]
    FinalizeFailed(String),
    /// The plugin asked for a retry.
    #[error("{0}")]
    Retry(String),
    /// The plugin could not be called to the end (deadline, memory cap, trap).
    #[error(transparent)]
    Plugin(#[from] CallError),
    /// The plugin's output was refused; nothing was applied.
    #[error("plugin output refused: {0}")]
    InvalidOutput(#[from] Violation),
    /// The API server refused or failed a request.
    #[error(transparent)]
    Api(#[from] cluster::Error),
    /// A child kind's cache did not complete its first list in time.
    #[error("the cache of {0} is not synced yet")]
    CacheNotSynced(String),
}

/// What the host does after a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reaction {
    /// Report it on the parent; wait for a change of the spec or of the plugin.
    ReportAndWait,
    /// Report it on the parent; retry with backoff.
    ReportAndBackoff,
    /// Report it on the parent; retry at the resync period (a permanent API answer,
    /// which a change elsewhere, such as RBAC, may still fix).
    ReportAndResync,
    /// Another writer was first: retry soon, the parent's condition stays as it is.
    RetrySoon,
    /// The API server is unwell: back off; the parent's condition stays as it is.
    Backoff,
}

impl Failure {
    /// CamelCase reason for the condition and the event.
    pub fn reason(&self) -> &'static str {
        match self {
            Failure::InvalidSpec(_) => "InvalidSpec",
            Failure::FinalizeFailed(_) => "FinalizeFailed",
            Failure::Retry(_) => "RetryRequested",
            Failure::Plugin(_) => "PluginFailed",
            Failure::InvalidOutput(_) => "InvalidPluginOutput",
            Failure::CacheNotSynced(_) => "CacheNotSynced",
            Failure::Api(e) => match e.class() {
                ErrorClass::Conflict => "Conflict",
                ErrorClass::Permanent => "ApplyFailed",
                ErrorClass::Transient => "ApiUnavailable",
            },
        }
    }

    fn reaction(&self) -> Reaction {
        match self {
            Failure::InvalidSpec(_) | Failure::InvalidOutput(_) => Reaction::ReportAndWait,
            Failure::Retry(_) | Failure::Plugin(_) | Failure::FinalizeFailed(_) => {
                Reaction::ReportAndBackoff
            }
            Failure::CacheNotSynced(_) => Reaction::Backoff,
            Failure::Api(e) => match e.class() {
                ErrorClass::Permanent => Reaction::ReportAndResync,
                ErrorClass::Conflict => Reaction::RetrySoon,
                ErrorClass::Transient => Reaction::Backoff,
            },
        }
    }
}

impl From<PluginError> for Failure {
    fn from(e: PluginError) -> Self {
        match e {
            PluginError::Invalid(m) => Failure::InvalidSpec(m),
            PluginError::Retry(m) => Failure::Retry(m),
        }
    }
}

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
    let obj = ctx.own_writes.freshest(&cached, &ctx.parent_kind);
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
            ctx.succeeded(&uid);
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
            Ok(Action::requeue(ctx.backoff(&uid)))
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
                    return Ok(Action::requeue(ctx.backoff(&uid)));
                }
                _ => {}
            }
            warn!(reason = failure.reason(), code = ?api_code(&failure), "reconcile failed: {failure}");
            // The reconcile may have written the parent (its finalizer) before failing:
            // the report goes on that version, else it is refused as a conflict.
            let obj = ctx.own_writes.freshest(&cached, &ctx.parent_kind);
            let parent = serde_json::to_value(&*obj).map_err(|e| ReportError(e.to_string()))?;
            if !report_failure(&obj, &parent, &ctx, &failure).await {
                // Not on the parent yet (another writer was first): report again soon,
                // or a failure that waits for a new spec would never show.
                return Ok(Action::requeue(jittered(CONFLICT_RETRY)));
            }
            Ok(match reaction {
                Reaction::ReportAndBackoff => Action::requeue(ctx.backoff(&uid)),
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
        .canary_reconciled(plugin, version, failure.is_some());
    if let Some(reason) = canary.record(version, uid, failure.as_deref()) {
        canary::announce(
            &ctx.metrics,
            plugin,
            canary,
            &Transition::RolledBack(reason),
        );
    }
}

/// How soon a reconcile that raced another writer (409) runs again.
const CONFLICT_RETRY: Duration = Duration::from_millis(500);

/// `d` stretched by a random 0–50 %, so that retries of many parents spread out.
fn jittered(d: Duration) -> Duration {
    d.mul_f64(1.0 + random_fraction() * 0.5)
}

fn api_code(failure: &Failure) -> Option<u16> {
    match failure {
        Failure::Api(e) => e.code(),
        _ => None,
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

async fn reconcile_parent(
    obj: &DynamicObject,
    parent: &Value,
    ctx: &Context,
    by: &Serve<'_>,
) -> Result<Reconciled, Failure> {
    let info = ctx.plugin.info();
    let has_finalizer = obj
        .metadata
        .finalizers
        .iter()
        .flatten()
        .any(|f| f == FINALIZER);
    if !info.finalizer && has_finalizer {
        // This plugin version no longer asks for a finalizer: nothing would ever remove
        // ours, and a deletion would hang forever.
        if let Some(written) = ctx.cluster.remove_finalizer(obj, FINALIZER).await? {
            ctx.own_writes.remember(written);
        }
        info!("the plugin no longer declares a finalizer; {FINALIZER} removed");
        return Ok(Reconciled::Done(Action::await_change()));
    }
    let uid = obj.metadata.uid.as_deref().unwrap_or_default();
    if obj.metadata.deletion_timestamp.is_some() {
        if info.finalizer && has_finalizer && !ctx.force_release.applies(&info.parent, obj) {
            // The expectations of a teardown wave stay until finalize is done.
            return finalize(obj, parent, ctx).await;
        }
        ctx.expectations.forget(uid);
        ctx.own_writes.forget(uid);
        ctx.forget_related(obj);
        if has_finalizer && ctx.force_release.applies(&info.parent, obj) {
            return force_release(obj, ctx).await.map(Reconciled::Done);
        }
        // Kubernetes garbage-collects the children through their ownerReferences.
        return Ok(Reconciled::Done(Action::await_change()));
    }
    if info.finalizer && !has_finalizer {
        let Some(written) = ctx.cluster.add_finalizer(obj, FINALIZER).await? else {
            return Ok(Reconciled::Done(Action::await_change()));
        };
        // Go on from the parent as written: the status write carries the version it
        // was computed from, and the one before the finalizer would be refused (409).
        let written = ctx.own_writes.remember(written);
        let parent = serde_json::to_value(&*written)
            .map_err(|e| Failure::Retry(format!("cannot read the parent: {e}")))?;
        return reconcile_live(&written, &parent, ctx, by).await;
    }
    reconcile_live(obj, parent, ctx, by).await
}

/// The reconcile of a parent that is not being deleted and has the finalizer it needs.
async fn reconcile_live(
    obj: &DynamicObject,
    parent: &Value,
    ctx: &Context,
    by: &Serve<'_>,
) -> Result<Reconciled, Failure> {
    let plugin = by.candidate.unwrap_or(&ctx.plugin);
    let info = plugin.info();
    let uid = obj.metadata.uid.as_deref().unwrap_or_default();
    ctx.caches_synced().await?;
    let seen = |index: usize, key: &Key| {
        ctx.caches
            .get(index)
            .map_or(Cached::Absent, |c| c.lookup(key))
    };
    match ctx.expectations.check(uid, seen, EXPECTATION_LIMIT) {
        CacheState::Current => {}
        CacheState::Behind => return Ok(Reconciled::CacheBehind),
        CacheState::GaveUp => warn!(
            "the child caches did not show this parent's last writes within {EXPECTATION_LIMIT:?}; trusting them"
        ),
    }
    let observed = Observed {
        parent: parent.clone(),
        children: ctx.observed_children(obj)?,
        related: ctx.observed_related(plugin, obj, parent).await?,
    };
    let desired = plugin.reconcile_async(&observed).await??;
    let mut plan = plan::plan(info, parent, desired, &plan::now())?;
    if by.candidate.is_none()
        && let Some(notice) = by.canary.and_then(|c| c.rolled_back_notice(uid))
    {
        plan.events.push(plan::warning("CanaryRolledBack", notice));
    }
    // The shadow's answer to the same state is compared with this plan, whatever the
    // writes do: it judges the plugin's logic, not the API server's answers. A parent
    // the canary candidate serves is not shadowed (the shadow is the candidate).
    let served = (by.candidate.is_none() && ctx.shadow.get().is_some()).then(|| plan.clone());
    let applied = apply_plan(obj, parent, &observed, plan, ctx).await;
    if let Some(served) = served {
        shadow::shadow_reconcile(&ctx.shadow, &observed, &served, &ctx.plugin, &ctx.metrics).await;
    }
    applied
}

async fn apply_plan(
    obj: &DynamicObject,
    parent: &Value,
    observed: &Observed,
    mut plan: Plan,
    ctx: &Context,
) -> Result<Reconciled, Failure> {
    let mut written = Written::default();
    let result = write_children(obj, observed, &plan, ctx, &mut written).await;
    // Also after a failure: what was written must be seen before the next reconcile.
    ctx.expectations
        .expect(obj.metadata.uid.as_deref().unwrap_or_default(), written);
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
            let event = plan::warning("ChildConflict", conflict.to_string());
            plan.events.push(event);
        }
    }
    if obj.data.get("status") != Some(&plan.status) {
        let written = ctx.cluster.write_status(obj, &plan.status).await?;
        ctx.own_writes.remember(written);
        ctx.metrics.status_written(&ctx.plugin.info().name);
    }
    for event in &plan.events {
        ctx.cluster.publish(obj, event).await;
    }
    if conflicts.is_empty() {
        Ok(Reconciled::Done(Action::requeue(
            plan.requeue_after.unwrap_or_else(|| ctx.resync()),
        )))
    } else {
        Ok(Reconciled::WithConflicts)
    }
}

/// Applies every desired child under the ownership rules, then prunes the observed
/// children no longer desired — only after every apply succeeded. Records in `written`
/// what it wrote, also when it fails half-way. Returns the ownership conflicts.
async fn write_children(
    obj: &DynamicObject,
    observed: &Observed,
    plan: &Plan,
    ctx: &Context,
    written: &mut Written,
) -> Result<Vec<OwnershipConflict>, Failure> {
    let name_of = |c: &ObservedChild| {
        c.object
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string()
    };
    // Each observed child's version, by (kind index, name).
    let observed_versions: HashMap<(usize, String), Option<&str>> = observed
        .children
        .iter()
        .map(|c| {
            let rv = c
                .object
                .pointer("/metadata/resourceVersion")
                .and_then(Value::as_str);
            ((c.kind_index as usize, name_of(c)), rv)
        })
        .collect();
    let plugin = &ctx.plugin.info().name;
    let mut conflicts = Vec::new();
    for child in &plan.children {
        let cached_rv = observed_versions.get(&(child.kind_index, child.name.clone()));
        let known = cached_rv.is_some();
        let key = (
            child
                .manifest
                .pointer("/metadata/namespace")
                .and_then(Value::as_str)
                .map(String::from),
            child.name.clone(),
        );
        if let Some(&cached_rv) = cached_rv
            && ctx
                .applied
                .unchanged(child.kind_index, &key, &child.manifest, cached_rv)
        {
            ctx.metrics.child_written(plugin, "unchanged");
            continue;
        }
        match ctx
            .cluster
            .apply_child(&ctx.children, obj, child, known)
            .await?
        {
            ChildOutcome::Applied { resource_version } => {
                ctx.metrics.child_written(plugin, "applied");
                let live = |index: usize, key: &Key| {
                    ctx.caches
                        .get(index)
                        .is_some_and(|c| matches!(c.lookup(key), Cached::Present(_)))
                };
                ctx.applied.record(
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
                ctx.metrics.child_written(plugin, "applied");
                ctx.applied.forget(child.kind_index, &key);
                written.applied.push((child.kind_index, key, None));
                info!(kind = %ctx.children.kind(child.kind_index), child = %child.name, "adopted");
                let event = plan::normal(
                    "Adopted",
                    format!(
                        "{} {:?} consented to adoption and is now controlled by this object",
                        ctx.children.kind(child.kind_index).kind,
                        child.name
                    ),
                );
                ctx.cluster.publish(obj, &event).await;
            }
            ChildOutcome::Conflict(conflict) => {
                warn!(kind = %conflict.kind, child = %conflict.name, "ownership conflict: {conflict}");
                conflicts.push(conflict);
            }
        }
    }
    // A conflict is not a failed apply (nothing was written): the children this parent
    // controls stay in step with the plugin.
    let wanted: HashSet<(usize, &str)> = plan
        .children
        .iter()
        .map(|c| (c.kind_index, c.name.as_str()))
        .collect();
    for child in &observed.children {
        let name = name_of(child);
        if !wanted.contains(&(child.kind_index as usize, name.as_str())) {
            ctx.cluster.prune_child(&ctx.children, child).await?;
            ctx.metrics.child_written(plugin, "pruned");
            let field = |p: &str| {
                child
                    .object
                    .pointer(p)
                    .and_then(Value::as_str)
                    .map(String::from)
            };
            ctx.applied.forget(
                child.kind_index as usize,
                &(field("/metadata/namespace"), name.clone()),
            );
            written.pruned.push((
                child.kind_index as usize,
                (field("/metadata/namespace"), name.clone()),
                field("/metadata/uid"),
            ));
            info!(kind = %ctx.children.kind(child.kind_index as usize), child = %name, "pruned");
        }
    }
    Ok(conflicts)
}

/// One step of a parent's teardown: calls `finalize` once the caches show the last
/// wave gone, deletes the next wave it names, or removes the finalizer when it is done.
async fn finalize(
    obj: &DynamicObject,
    parent: &Value,
    ctx: &Context,
) -> Result<Reconciled, Failure> {
    ctx.caches_synced().await?;
    let uid = obj.metadata.uid.as_deref().unwrap_or_default();
    let seen = |index: usize, key: &Key| {
        ctx.caches
            .get(index)
            .map_or(Cached::Absent, |c| c.lookup(key))
    };
    match ctx.expectations.check(uid, seen, WAVE_LIMIT) {
        CacheState::Current => {}
        CacheState::Behind => return Ok(Reconciled::CacheBehind),
        CacheState::GaveUp => {
            let message = format!(
                "children of the last teardown wave are still there after {}s; finalize runs again",
                WAVE_LIMIT.as_secs()
            );
            warn!("{message}");
            ctx.cluster
                .publish(obj, &plan::warning("TeardownWaveSlow", message))
                .await;
        }
    }
    let observed = Observed {
        parent: parent.clone(),
        children: ctx.observed_children(obj)?,
        related: ctx
            .observed_related(&ctx.plugin, obj, parent)
            .await
            .map_err(|e| Failure::FinalizeFailed(e.to_string()))?,
    };
    let result = match ctx.plugin.finalize_async(&observed).await {
        Ok(Ok(result)) => result,
        Ok(Err(e)) => return Err(Failure::FinalizeFailed(e.to_string())),
        Err(e) => return Err(Failure::FinalizeFailed(e.to_string())),
    };
    for event in &result.events {
        ctx.cluster.publish(obj, event).await;
    }
    if !result.delete.is_empty() {
        return teardown_wave(obj, &observed, &result.delete, ctx).await;
    }
    if result.done {
        ctx.cluster.remove_finalizer(obj, FINALIZER).await?;
        ctx.expectations.forget(uid);
        ctx.own_writes.forget(uid);
        ctx.forget_related(obj);
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

/// Deletes the children a `finalize` named (those observed: the ones this parent
/// controls), in the foreground and with their UID as precondition, and records them,
/// so that `finalize` is called again only once the caches show them gone.
async fn teardown_wave(
    obj: &DynamicObject,
    observed: &Observed,
    wave: &[ChildRef],
    ctx: &Context,
) -> Result<Reconciled, Failure> {
    let mut written = Written::default();
    let mut deleted = Vec::new();
    let mut first: Option<ObjectReference> = None;
    for named in wave {
        let index = named.kind_index as usize;
        if index >= ctx.children.count() {
            let violation = Violation::Teardown(format!(
                "child kind index {index} to delete is not a declared child kind"
            ));
            return Err(Failure::FinalizeFailed(violation.to_string()));
        }
        let Some(child) = observed.children.iter().find(|c| {
            c.kind_index == named.kind_index
                && c.object.pointer("/metadata/name").and_then(Value::as_str)
                    == Some(named.name.as_str())
        }) else {
            // Gone already, or never this parent's: nothing to delete.
            continue;
        };
        let result = ctx
            .cluster
            .delete_child(&ctx.children, child, PropagationPolicy::Foreground)
            .await;
        if let Err(e) = result {
            ctx.expectations
                .expect(obj.metadata.uid.as_deref().unwrap_or_default(), written);
            return Err(e.into());
        }
        let field = |p: &str| {
            child
                .object
                .pointer(p)
                .and_then(Value::as_str)
                .map(String::from)
        };
        written.pruned.push((
            index,
            (field("/metadata/namespace"), named.name.clone()),
            field("/metadata/uid"),
        ));
        let kind = ctx.children.kind(index);
        deleted.push(format!("{} {:?}", kind.kind, named.name));
        first.get_or_insert_with(|| ObjectReference {
            api_version: Some(kind.api_version()),
            kind: Some(kind.kind.clone()),
            name: Some(named.name.clone()),
            namespace: field("/metadata/namespace"),
            uid: field("/metadata/uid"),
            ..ObjectReference::default()
        });
    }
    if deleted.is_empty() {
        // The whole wave is gone: finalize again now.
        return Ok(Reconciled::Done(Action::requeue(Duration::from_millis(1))));
    }
    ctx.expectations
        .expect(obj.metadata.uid.as_deref().unwrap_or_default(), written);
    let message = format!("teardown wave: deleting {}", deleted.join(", "));
    info!("{message}");
    ctx.cluster
        .publish_about(obj, &plan::normal("TeardownWave", message), "Delete", first)
        .await;
    // The deletions reach this parent as child events; this is in case one is missed.
    Ok(Reconciled::CacheBehind)
}

/// Removes the host's finalizer from a parent being deleted without calling
/// `finalize`, because an administrator said so ([`ForceRelease`]); says so in a
/// Warning event.
async fn force_release(obj: &DynamicObject, ctx: &Context) -> Result<Action, Failure> {
    ctx.cluster.remove_finalizer(obj, FINALIZER).await?;
    warn!("{FINALIZER} removed without finalize: force release");
    let event = plan::warning(
        "FinalizerForceReleased",
        format!("{FINALIZER} removed without finalize: an administrator let this object go"),
    );
    ctx.cluster.publish(obj, &event).await;
    Ok(Action::await_change())
}

/// Puts a failure on the parent: `Ready=False` with the reason, written as conditions
/// only (the plugin's status fields are not touched), and a Warning event. Best effort:
/// a failure to report is logged. A parent being deleted gets them too: it is how a
/// `finalize` that keeps failing shows on it.
///
/// Returns false when the conditions could not be written because the parent changed
/// under them (409): the caller reports again soon.
async fn report_failure(
    obj: &DynamicObject,
    parent: &Value,
    ctx: &Context,
    failure: &Failure,
) -> bool {
    let conditions =
        plan::failed_conditions(parent, failure.reason(), &failure.to_string(), &plan::now());
    let mut reported = true;
    if obj.data.pointer("/status/conditions") != Some(&conditions) {
        match ctx.cluster.write_conditions(obj, &conditions).await {
            Ok(written) => {
                ctx.own_writes.remember(written);
                ctx.metrics.status_written(&ctx.plugin.info().name);
            }
            Err(e) => {
                warn!("cannot write the failure to the status: {e}");
                reported = e.class() != ErrorClass::Conflict;
            }
        }
    }
    let event = plan::warning(failure.reason(), failure.to_string());
    ctx.cluster.publish(obj, &event).await;
    reported
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
        Tracked {
            expectations: self.expectations.len(),
            applied: self.applied.len(),
            failures: self.failures.lock().unwrap().len(),
        }
    }

    /// Makes the next use of each map sweep it, as if its period had passed.
    pub(super) fn make_sweeps_due(&self) {
        self.expectations.make_sweep_due();
        self.applied.make_sweep_due();
        self.own_writes.make_sweep_due();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failure_counts_of_parents_quiet_for_long_are_forgotten() {
        let now = Instant::now();
        let mut failures = HashMap::from([
            ("recent".to_string(), (3, now - Duration::from_secs(60))),
            (
                "gone".to_string(),
                (9, now - MAX_BACKOFF * 2 - Duration::from_secs(1)),
            ),
        ]);
        forget_stale(&mut failures, now);
        assert_eq!(failures.keys().collect::<Vec<_>>(), ["recent"]);
    }

    #[test]
    fn api_failures_react_by_status_class() {
        let api = |code: u16| {
            Failure::Api(cluster::Error::Api {
                action: "apply".into(),
                source: kube::Error::Api(Box::new(
                    kube::core::Status::failure("m", "r").with_code(code),
                )),
            })
        };
        assert_eq!(api(422).reaction(), Reaction::ReportAndResync);
        assert_eq!(api(403).reaction(), Reaction::ReportAndResync);
        assert_eq!(api(409).reaction(), Reaction::RetrySoon);
        assert_eq!(api(429).reaction(), Reaction::Backoff);
        assert_eq!(api(503).reaction(), Reaction::Backoff);
        assert_eq!(api(409).reason(), "Conflict");
        assert_eq!(api(422).reason(), "ApplyFailed");
        assert_eq!(
            Failure::InvalidSpec("x".into()).reaction(),
            Reaction::ReportAndWait
        );
        assert_eq!(
            Failure::Retry("x".into()).reaction(),
            Reaction::ReportAndBackoff
        );
        // A parent being deleted has no spec change to wait for.
        let finalize = Failure::FinalizeFailed("invalid spec: no".into());
        assert_eq!(finalize.reaction(), Reaction::ReportAndBackoff);
        assert_eq!(finalize.reason(), "FinalizeFailed");
    }
}

/// The finalize path against a fake API server, with the `guard` test plugin.
#[cfg(test)]
mod finalize_tests {
    use http::Method;
    use serde_json::json;

    use super::super::children::{ChildCaches, KindWatch};
    use super::super::fake_api::{self, Call};
    use super::super::leader::WriteFence;
    use super::*;
    use crate::plugin::{Sandbox, SandboxConfig};

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

    /// The context of the guard plugin, and the caches it reads (their watches stop
    /// when they are dropped).
    async fn context(client: kube::Client) -> (Arc<Context>, ChildCaches, Vec<KindWatch>) {
        let sandbox = Sandbox::new(SandboxConfig::default()).unwrap();
        let path = capstan_e2e::operator::test_plugin("guard");
        let plugin = tokio::task::spawn_blocking(move || sandbox.load_file_blocking(&path))
            .await
            .unwrap()
            .unwrap();
        let info = plugin.info().clone();
        let metrics = Arc::new(Metrics::default());
        let caches = ChildCaches::new(client.clone(), Some("ns".into()), None, metrics.clone());
        let watches: Vec<KindWatch> = info.children.iter().map(|k| caches.watch(k)).collect();
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
        let ready = status.body["status"]["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == "Ready")
            .unwrap()
            .clone();
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
