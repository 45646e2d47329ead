//! One reconcile of one parent, step by step (design sketch section 3): finalizer,
//! observed children, the plugin call, validation, apply, prune, status, events, requeue.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasher, Hasher};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kube::api::DynamicObject;
use kube::runtime::controller::Action;
use serde_json::Value;
use tracing::{info, instrument, warn};

use super::cluster::{ChildKinds, ClusterWrites};
use super::metrics::Metrics;
use crate::contract::{Observed, PluginError};
use crate::plan::{self, Plan};
use crate::plugin::{CallError, Plugin};
use crate::validate::Violation;

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
    /// Counters and timings.
    pub metrics: Arc<Metrics>,
    /// Resync period when the plugin sets none.
    pub default_resync: Duration,
    /// Consecutive transient failures per parent UID, for backoff.
    failures: Mutex<HashMap<String, u32>>,
}

impl Context {
    /// A context for `plugin`.
    pub fn new(
        plugin: Plugin,
        cluster: ClusterWrites,
        children: ChildKinds,
        metrics: Arc<Metrics>,
        default_resync: Duration,
    ) -> Self {
        Context {
            plugin,
            cluster,
            children,
            metrics,
            default_resync,
            failures: Mutex::new(HashMap::new()),
        }
    }

    fn resync(&self) -> Duration {
        self.plugin
            .info()
            .resync_seconds
            .map(|s| Duration::from_secs(u64::from(s.max(1))))
            .unwrap_or(self.default_resync)
    }

    /// Exponential backoff with jitter: 1 s, 2 s, 4 s … up to 5 min, times 0.5–1.0.
    fn backoff(&self, uid: &str) -> Duration {
        let mut failures = self.failures.lock().expect("failures lock");
        let n = failures.entry(uid.to_string()).or_insert(0);
        *n = n.saturating_add(1);
        let base = Duration::from_secs(1u64 << (*n - 1).min(8)).min(Duration::from_secs(300));
        let jitter = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish()
            % 500;
        base.mul_f64(0.5 + jitter as f64 / 1000.0)
    }

    fn succeeded(&self, uid: &str) {
        self.failures.lock().expect("failures lock").remove(uid);
    }
}

/// A reconcile that did not complete, and how the host reacts to it.
#[derive(Debug, thiserror::Error)]
pub enum Failure {
    /// The plugin said the spec is invalid: wait for a new generation.
    #[error("{0}")]
    InvalidSpec(String),
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
    #[error("{0}")]
    Api(String),
}

impl Failure {
    /// CamelCase reason for the condition and the event.
    pub fn reason(&self) -> &'static str {
        match self {
            Failure::InvalidSpec(_) => "InvalidSpec",
            Failure::Retry(_) => "RetryRequested",
            Failure::Plugin(_) => "PluginFailed",
            Failure::InvalidOutput(_) => "InvalidPluginOutput",
            Failure::Api(_) => "ApplyFailed",
        }
    }

    /// Whether retrying without a change can help.
    fn is_transient(&self) -> bool {
        matches!(
            self,
            Failure::Retry(_) | Failure::Plugin(_) | Failure::Api(_)
        )
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
#[instrument(skip_all, fields(plugin = %ctx.plugin.info().name, name = obj.metadata.name.as_deref().unwrap_or_default(), namespace = obj.metadata.namespace.as_deref().unwrap_or_default()))]
pub async fn reconcile(obj: Arc<DynamicObject>, ctx: Arc<Context>) -> Result<Action, ReportError> {
    let _timer = ctx.metrics.reconcile_timer(&ctx.plugin.info().name);
    let uid = obj.metadata.uid.clone().unwrap_or_default();
    let parent = serde_json::to_value(&*obj).map_err(|e| ReportError(e.to_string()))?;
    match reconcile_parent(&obj, &parent, &ctx).await {
        Ok(action) => {
            ctx.succeeded(&uid);
            ctx.metrics.reconciled(&ctx.plugin.info().name, "ok");
            Ok(action)
        }
        Err(failure) => {
            ctx.metrics
                .reconciled(&ctx.plugin.info().name, failure.reason());
            warn!(reason = failure.reason(), "reconcile failed: {failure}");
            report_failure(&obj, &parent, &ctx, &failure).await;
            Ok(if failure.is_transient() {
                Action::requeue(ctx.backoff(&uid))
            } else {
                // Permanent until the spec changes (a new generation triggers a
                // reconcile) or a new plugin version is loaded (its controller starts
                // over); retrying the same input would give the same answer.
                Action::await_change()
            })
        }
    }
}

/// The controller's error policy: only reached when a failure could not be reported.
pub fn error_policy(_obj: Arc<DynamicObject>, err: &ReportError, ctx: Arc<Context>) -> Action {
    warn!(plugin = %ctx.plugin.info().name, "reconcile error: {err}");
    Action::requeue(Duration::from_secs(5))
}

async fn reconcile_parent(
    obj: &DynamicObject,
    parent: &Value,
    ctx: &Context,
) -> Result<Action, Failure> {
    let info = ctx.plugin.info();
    let has_finalizer = obj
        .metadata
        .finalizers
        .iter()
        .flatten()
        .any(|f| f == FINALIZER);
    if obj.metadata.deletion_timestamp.is_some() {
        if info.finalizer && has_finalizer {
            return finalize(obj, parent, ctx).await;
        }
        // Kubernetes garbage-collects the children through their ownerReferences.
        return Ok(Action::await_change());
    }
    if info.finalizer && !has_finalizer {
        ctx.cluster.add_finalizer(obj, FINALIZER).await?;
    }

    let observed = Observed {
        parent: parent.clone(),
        children: ctx.cluster.observed_children(obj, &ctx.children).await?,
    };
    let plugin = ctx.plugin.clone();
    let call_input = observed.clone();
    let desired = tokio::task::spawn_blocking(move || plugin.reconcile(&call_input))
        .await
        .map_err(|e| Failure::Api(format!("plugin call did not complete: {e}")))???;
    let plan = plan::plan(info, parent, desired, &plan::now())?;
    apply_plan(obj, &observed, plan, ctx).await
}

async fn apply_plan(
    obj: &DynamicObject,
    observed: &Observed,
    plan: Plan,
    ctx: &Context,
) -> Result<Action, Failure> {
    for child in &plan.children {
        ctx.cluster.apply_child(&ctx.children, child).await?;
    }
    // Prune only after every apply succeeded.
    let wanted: HashSet<(usize, &str)> = plan
        .children
        .iter()
        .map(|c| (c.kind_index, c.name.as_str()))
        .collect();
    for child in &observed.children {
        let name = child
            .object
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or_default();
        if !wanted.contains(&(child.kind_index as usize, name)) {
            ctx.cluster.prune_child(&ctx.children, child).await?;
            info!(kind = %ctx.children.kind(child.kind_index as usize), child = name, "pruned");
        }
    }
    if obj.data.get("status") != Some(&plan.status) {
        ctx.cluster.write_status(obj, &plan.status).await?;
        ctx.metrics.status_written(&ctx.plugin.info().name);
    }
    for event in &plan.events {
        ctx.cluster.publish(obj, event).await;
    }
    Ok(Action::requeue(
        plan.requeue_after.unwrap_or_else(|| ctx.resync()),
    ))
}

async fn finalize(obj: &DynamicObject, parent: &Value, ctx: &Context) -> Result<Action, Failure> {
    let observed = Observed {
        parent: parent.clone(),
        children: ctx.cluster.observed_children(obj, &ctx.children).await?,
    };
    let plugin = ctx.plugin.clone();
    let result = tokio::task::spawn_blocking(move || plugin.finalize(&observed))
        .await
        .map_err(|e| Failure::Api(format!("plugin call did not complete: {e}")))???;
    for event in &result.events {
        ctx.cluster.publish(obj, event).await;
    }
    if result.done {
        ctx.cluster.remove_finalizer(obj, FINALIZER).await?;
        info!("finalized; finalizer removed");
        Ok(Action::await_change())
    } else {
        let delay = result.requeue_after_seconds.unwrap_or(5).max(1);
        Ok(Action::requeue(Duration::from_secs(u64::from(delay))))
    }
}

/// Puts a failure on the parent: `Ready=False` with the reason (the plugin's own status
/// fields stay) and a Warning event. Best effort: a failure to report is logged.
async fn report_failure(obj: &DynamicObject, parent: &Value, ctx: &Context, failure: &Failure) {
    if obj.metadata.deletion_timestamp.is_none() {
        let status =
            plan::failed_status(parent, failure.reason(), &failure.to_string(), &plan::now());
        if obj.data.get("status") != Some(&status) {
            match ctx.cluster.write_status(obj, &status).await {
                Ok(()) => ctx.metrics.status_written(&ctx.plugin.info().name),
                Err(e) => warn!("cannot write the failure to the status: {e}"),
            }
        }
    }
    let event = plan::warning(failure.reason(), failure.to_string());
    ctx.cluster.publish(obj, &event).await;
}
