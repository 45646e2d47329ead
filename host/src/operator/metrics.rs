//! Counters and timings of the operator, its health, and the state of every plugin
//! file: what `/metrics`, `/healthz`, `/readyz` and `/plugins` show (served by
//! [`super::http`]).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use serde::Serialize;

use crate::plugin::{Plugin, SandboxMetrics};

/// The state of one plugin file, as `/plugins` reports it.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct PluginState {
    /// The file.
    pub file: String,
    /// Plugin name (of the version serving, if any).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Parent kind it reconciles.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// The version serving, as its `describe` said at load.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// The child kinds that version declared at load: the only kinds the host writes
    /// for it, whatever a later `describe` might say.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub children: Vec<String>,
    /// The related kinds that version declared (contract 0.2.0): read, never written.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub related: Vec<String>,
    /// The contract release the version serving was built for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub contract: Option<String>,
    /// sha256 of the version serving.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    /// Whether a controller runs for it.
    pub serving: bool,
    /// Why the last load of this file failed, if it did (the old version may still serve).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl PluginState {
    /// The state of `file`: `serving` is the version with a running controller, if any;
    /// `error` why its last load failed, if it did.
    pub fn of(file: &std::path::Path, serving: Option<&Plugin>, error: Option<String>) -> Self {
        let info = serving.map(Plugin::info);
        PluginState {
            file: file.display().to_string(),
            name: info.map(|i| i.name.clone()),
            kind: info.map(|i| i.parent.to_string()),
            version: info.map(|i| i.version.clone()),
            children: info
                .map(|i| i.children.iter().map(ToString::to_string).collect())
                .unwrap_or_default(),
            related: info
                .map(|i| i.related.iter().map(ToString::to_string).collect())
                .unwrap_or_default(),
            contract: serving.map(|p| p.contract().to_string()),
            sha256: serving.map(|p| p.sha256().to_string()),
            serving: serving.is_some(),
            error,
        }
    }
}

/// Labels of a per-plugin series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PluginLabel {
    plugin: String,
}

/// Labels of a per-plugin series with a result.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PluginResult {
    plugin: String,
    result: String,
}

/// Labels of a canary's reconciles: the plugin, the version that reconciled and how it
/// ended.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CanaryLabel {
    plugin: String,
    version: String,
    result: String,
}

/// Labels of a watch error.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WatchError {
    kind: String,
    code: String,
}

/// The parents `/plugins` lists per shadow (the first ones that diverge).
const MAX_DIVERGENT: usize = 100;

/// A shadow version and what it made of the reconciles it was called for.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ShadowReport {
    /// Its file (`NAME.next.wasm`).
    pub file: String,
    /// Its sha256.
    pub sha256: String,
    /// Reconciles it answered as the serving version did.
    pub agreed: u64,
    /// Reconciles it answered otherwise.
    pub diverged: u64,
    /// Reconciles it failed (where the serving version did not).
    pub failed: u64,
    /// The parents whose last reconcile it answered otherwise, with the first difference
    /// (at most 100; a parent it agrees on again leaves the list).
    pub divergent: BTreeMap<String, String>,
}

/// Labels of a per-parent-kind series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: String,
}

/// Labels of the watch traffic series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WatchLabel {
    watch: String,
}

/// What a shadow made of one reconcile, as the metrics count it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShadowVerdict<'a> {
    /// The same plan as the serving version's.
    Agreed,
    /// The first difference, in one line.
    Diverged(&'a str),
    /// Why the shadow failed where the serving version did not.
    Failed(&'a str),
}

/// Something `/plugins` shows beside a plugin file, as JSON it renders when asked (a
/// canary's phase and counts): the metrics hold it without knowing what it is.
pub trait Report: Send + Sync {
    /// Its state now.
    fn report(&self) -> serde_json::Value;
}

/// The operator's metrics (a Prometheus registry), its health and its plugin files.
pub struct Metrics {
    registry: Registry,
    reconciles: Family<PluginResult, Counter>,
    status_writes: Family<PluginLabel, Counter>,
    events_dropped: Family<PluginLabel, Counter>,
    child_writes: Family<PluginResult, Counter>,
    reconcile_duration: Family<PluginLabel, Histogram>,
    load_failures: Counter,
    watch_errors: Family<WatchError, Counter>,
    plugins_serving: Gauge,
    leader_gauge: Gauge,
    watch_bytes: Family<WatchLabel, Counter>,
    shard_buckets: Gauge,
    orphaned_finalizers: Family<KindLabel, Gauge>,
    shadow_reconciles: Family<PluginResult, Counter>,
    canary_reconciles: Family<CanaryLabel, Counter>,
    canary_share: Family<PluginLabel, Gauge>,
    canary_rollbacks: Family<PluginLabel, Counter>,
    plugins: Mutex<BTreeMap<String, PluginState>>,
    /// The shadow of each serving file that has one, for `/plugins`.
    shadows: Mutex<BTreeMap<String, ShadowReport>>,
    /// The canary of each serving file whose shadow is one (`--canary`).
    canaries: Mutex<BTreeMap<String, Arc<dyn Report>>>,
    ready: AtomicBool,
    /// Parts of the host that stopped and will not come back by themselves.
    failed: Mutex<BTreeMap<String, String>>,
    /// The sandbox's per-plugin figures, for `/plugins`.
    sandbox: Option<SandboxMetrics>,
}

impl Metrics {
    /// The operator's metrics together with the sandbox's per-plugin series.
    pub fn with_sandbox(sandbox: &SandboxMetrics) -> Self {
        let mut metrics = Metrics::default();
        sandbox.register(&mut metrics.registry);
        metrics.sandbox = Some(sandbox.clone());
        metrics
    }
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::default();
        let reconciles = Family::<PluginResult, Counter>::default();
        registry.register(
            "capstan_reconciles",
            "Finished reconciles by plugin and result (ok, or the failure reason)",
            reconciles.clone(),
        );
        let status_writes = Family::<PluginLabel, Counter>::default();
        registry.register(
            "capstan_status_writes",
            "Status writes by plugin (skipped when the status did not change)",
            status_writes.clone(),
        );
        let events_dropped = Family::<PluginLabel, Counter>::default();
        registry.register(
            "capstan_events_dropped",
            "Events a plugin asked for beyond the cap of one reconcile, dropped",
            events_dropped.clone(),
        );
        let child_writes = Family::<PluginResult, Counter>::default();
        registry.register(
            "capstan_child_writes",
            "Desired children by plugin and what was done: applied, unchanged (the cached \
             child is the host's last apply of the same manifest, so no request), pruned",
            child_writes.clone(),
        );
        let reconcile_duration =
            Family::<PluginLabel, Histogram>::new_with_constructor(reconcile_buckets);
        registry.register(
            "capstan_reconcile_duration_seconds",
            "Duration of one reconcile, plugin call and API requests included",
            reconcile_duration.clone(),
        );
        let load_failures = Counter::default();
        registry.register(
            "capstan_plugin_load_failures",
            "Plugin files that could not be loaded",
            load_failures.clone(),
        );
        let watch_errors = Family::<WatchError, Counter>::default();
        registry.register(
            "capstan_watch_errors",
            "Errors of the watches by kind and HTTP status (none: no answer)",
            watch_errors.clone(),
        );
        let plugins_serving = Gauge::default();
        registry.register(
            "capstan_plugins_serving",
            "Plugin files with a running controller",
            plugins_serving.clone(),
        );
        let leader_gauge = Gauge::default();
        registry.register(
            "capstan_leader",
            "1 while this replica holds the leader lease (always without leader election)",
            leader_gauge.clone(),
        );
        let watch_bytes = Family::<WatchLabel, Counter>::default();
        registry.register(
            "capstan_watch_bytes",
            "Bytes received by the LISTs and WATCHes of the parents and of the children",
            watch_bytes.clone(),
        );
        let shard_buckets = Gauge::default();
        registry.register(
            "capstan_shard_buckets",
            "Hash buckets (of 64) whose parents this replica serves (64 without --shards)",
            shard_buckets.clone(),
        );
        let orphaned_finalizers = Family::<KindLabel, Gauge>::default();
        registry.register(
            "capstan_orphaned_finalizers",
            "Parents (of this replica's buckets) that still hold capstan.dev/finalizer after \
             their plugin was removed or moved to another kind; exact after a complete pass of \
             the release, a lower bound while it is retried, 0 once every one was released",
            orphaned_finalizers.clone(),
        );
        let shadow_reconciles = Family::<PluginResult, Counter>::default();
        registry.register(
            "capstan_shadow_reconciles",
            "Reconciles a shadow version (NAME.next.wasm) was also called for, by serving \
             plugin and verdict: agreed (the same children and status), diverged, failed",
            shadow_reconciles.clone(),
        );
        let canary_reconciles = Family::<CanaryLabel, Counter>::default();
        registry.register(
            "capstan_canary_reconciles",
            "Reconciles while a canary runs (--canary), by plugin, version (serving, \
             candidate) and result (ok, failed); transient API trouble is not counted",
            canary_reconciles.clone(),
        );
        let canary_share = Family::<PluginLabel, Gauge>::default();
        registry.register(
            "capstan_canary_share_percent",
            "The share of parents a canary candidate (NAME.next.wasm) serves now, by plugin",
            canary_share.clone(),
        );
        let canary_rollbacks = Family::<PluginLabel, Counter>::default();
        registry.register(
            "capstan_canary_rollbacks",
            "Canary candidates rolled back because their failure rate exceeded the bound",
            canary_rollbacks.clone(),
        );
        Metrics {
            registry,
            reconciles,
            status_writes,
            events_dropped,
            child_writes,
            reconcile_duration,
            load_failures,
            watch_errors,
            plugins_serving,
            leader_gauge,
            watch_bytes,
            shard_buckets,
            orphaned_finalizers,
            shadow_reconciles,
            canary_reconciles,
            canary_share,
            canary_rollbacks,
            plugins: Mutex::default(),
            shadows: Mutex::default(),
            canaries: Mutex::default(),
            ready: AtomicBool::new(false),
            failed: Mutex::default(),
            sandbox: None,
        }
    }
}

/// 1 ms … ~33 s: a reconcile is a plugin call (µs to the deadline) plus API requests.
fn reconcile_buckets() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 16))
}

impl Metrics {
    /// Counts one finished reconcile with its result (`ok` or a failure reason).
    pub fn reconciled(&self, plugin: &str, result: &str) {
        self.reconciles
            .get_or_create(&PluginResult {
                plugin: plugin.into(),
                result: result.into(),
            })
            .inc();
    }

    /// Counts `n` events dropped beyond the cap of one reconcile; whether they are the
    /// plugin's first (to say so once).
    pub fn events_dropped(&self, plugin: &str, n: usize) -> bool {
        let counter = self.events_dropped.get_or_create(&PluginLabel {
            plugin: plugin.into(),
        });
        counter.inc_by(n as u64) == 0
    }

    /// Counts one status write.
    pub fn status_written(&self, plugin: &str) {
        self.status_writes
            .get_or_create(&PluginLabel {
                plugin: plugin.into(),
            })
            .inc();
    }

    /// Counts one desired or pruned child, by what was done (`applied`, `unchanged`,
    /// `pruned`).
    pub fn child_written(&self, plugin: &str, done: &str) {
        self.child_writes
            .get_or_create(&PluginResult {
                plugin: plugin.into(),
                result: done.into(),
            })
            .inc();
    }

    /// Counts one failed plugin load.
    pub fn load_failed(&self) {
        self.load_failures.inc();
    }

    /// Counts one error of the watch of `kind` (`code`: the HTTP status, if any).
    pub fn watch_failed(&self, kind: &str, code: Option<u16>) {
        self.watch_errors
            .get_or_create(&WatchError {
                kind: kind.into(),
                code: code.map_or_else(|| "none".into(), |c| c.to_string()),
            })
            .inc();
    }

    /// Times a reconcile until the returned guard drops.
    pub fn reconcile_timer<'a>(&'a self, plugin: &str) -> impl Drop + 'a {
        ReconcileTimer {
            metrics: self,
            plugin: plugin.to_string(),
            start: Instant::now(),
        }
    }

    /// Records the state of a plugin file.
    pub fn set_plugin(&self, state: PluginState) {
        self.plugins
            .lock()
            .expect("metrics lock")
            .insert(state.file.clone(), state);
    }

    /// Forgets a plugin file that was removed.
    pub fn remove_plugin(&self, file: &str) {
        self.plugins.lock().expect("metrics lock").remove(file);
    }

    /// Marks the operator ready (the plugin directory was scanned once).
    pub fn set_ready(&self) {
        self.ready.store(true, Ordering::Relaxed);
    }

    /// Whether the operator is ready.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }

    /// Records that a part of the host (`what`: e.g. `controller widget`) stopped for
    /// good; `/healthz` fails from then on, so that the kubelet restarts the process.
    pub fn set_failed(&self, what: &str, why: String) {
        tracing::error!(part = what, "{why}");
        self.failed
            .lock()
            .expect("metrics lock")
            .insert(what.to_string(), why);
    }

    /// `Ok` while every part of the host runs; else what stopped and why.
    pub fn health(&self) -> Result<(), String> {
        let failed = self.failed.lock().expect("metrics lock");
        if failed.is_empty() {
            return Ok(());
        }
        Err(failed
            .iter()
            .map(|(what, why)| format!("{what}: {why}"))
            .collect::<Vec<_>>()
            .join("\n"))
    }

    /// Records whether this replica holds the leader lease (always, without election).
    pub fn set_leader(&self, leader: bool) {
        self.leader_gauge.set(i64::from(leader));
    }

    /// The counter of bytes received by the `watch` watches ("parents" or "children").
    pub fn watch_bytes(&self, watch: &str) -> Counter {
        self.watch_bytes
            .get_or_create(&WatchLabel {
                watch: watch.into(),
            })
            .clone()
    }

    /// Records how many hash buckets this replica serves.
    pub fn set_shard_buckets(&self, buckets: u32) {
        self.shard_buckets.set(i64::from(buckets));
    }

    /// Records how many parents of `kind` still hold the host's finalizer for a plugin
    /// that is gone.
    pub fn set_orphaned_finalizers(&self, kind: &str, held: i64) {
        self.orphaned_finalizers
            .get_or_create(&KindLabel { kind: kind.into() })
            .set(held);
    }

    /// Drops the series of `kind`: a plugin serves it again.
    pub fn clear_orphaned_finalizers(&self, kind: &str) {
        self.orphaned_finalizers
            .remove(&KindLabel { kind: kind.into() });
    }

    /// The last count of [`Metrics::set_orphaned_finalizers`] for `kind`, if any.
    pub fn orphaned_finalizers(&self, kind: &str) -> Option<i64> {
        let label = KindLabel { kind: kind.into() };
        // `get_or_create` would add a series: look at the rendered text instead.
        let text = self.render();
        let line = format!("capstan_orphaned_finalizers{{kind=\"{}\"}} ", label.kind);
        text.lines()
            .find_map(|l| l.strip_prefix(&line))
            .and_then(|v| v.parse().ok())
    }

    /// The OpenMetrics text exposition.
    pub fn render(&self) -> String {
        let serving = self
            .plugins
            .lock()
            .expect("metrics lock")
            .values()
            .filter(|p| p.serving)
            .count();
        self.plugins_serving.set(serving as i64);
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }

    /// Records that `shadow` (its file and sha256) now shadows the serving `file`.
    /// With `canary`, the shadow serves a share of the parents (`--canary`).
    pub fn set_shadow(
        &self,
        file: &str,
        shadow: &str,
        sha256: &str,
        canary: Option<Arc<dyn Report>>,
    ) {
        let mut canaries = self.canaries.lock().expect("metrics lock");
        match canary {
            Some(canary) => canaries.insert(file.to_string(), canary),
            None => canaries.remove(file),
        };
        self.shadows.lock().expect("metrics lock").insert(
            file.to_string(),
            ShadowReport {
                file: shadow.to_string(),
                sha256: sha256.to_string(),
                ..ShadowReport::default()
            },
        );
    }

    /// Forgets the shadow of `file`.
    pub fn remove_shadow(&self, file: &str) {
        self.canaries.lock().expect("metrics lock").remove(file);
        self.shadows.lock().expect("metrics lock").remove(file);
    }

    /// Counts the verdict of the shadow of `file` (serving `plugin`) on `parent`: agreed
    /// (no difference), or the first difference (`diverged`) or why it failed (`failed`).
    pub fn shadow_judged(
        &self,
        file: &str,
        plugin: &str,
        parent: &str,
        verdict: ShadowVerdict<'_>,
    ) {
        let result = match verdict {
            ShadowVerdict::Agreed => "agreed",
            ShadowVerdict::Diverged(_) => "diverged",
            ShadowVerdict::Failed(_) => "failed",
        };
        self.shadow_reconciles
            .get_or_create(&PluginResult {
                plugin: plugin.into(),
                result: result.into(),
            })
            .inc();
        let mut shadows = self.shadows.lock().expect("metrics lock");
        let Some(report) = shadows.get_mut(file) else {
            return;
        };
        let difference = match verdict {
            ShadowVerdict::Agreed => {
                report.agreed += 1;
                report.divergent.remove(parent);
                return;
            }
            ShadowVerdict::Diverged(first) => {
                report.diverged += 1;
                first.to_string()
            }
            ShadowVerdict::Failed(why) => {
                report.failed += 1;
                format!("fails: {why}")
            }
        };
        if report.divergent.len() < MAX_DIVERGENT || report.divergent.contains_key(parent) {
            report.divergent.insert(parent.to_string(), difference);
        }
    }

    /// Counts a reconcile of `plugin` by `version` while a canary runs.
    /// `version` is the label of the version that reconciled: `serving` or `candidate`.
    pub fn canary_reconciled(&self, plugin: &str, version: &str, failed: bool) {
        self.canary_reconciles
            .get_or_create(&CanaryLabel {
                plugin: plugin.into(),
                version: version.into(),
                result: if failed { "failed" } else { "ok" }.into(),
            })
            .inc();
    }

    /// The share of parents the canary candidate of `plugin` serves now.
    pub fn canary_share(&self, plugin: &str, percent: u8) {
        self.canary_share
            .get_or_create(&PluginLabel {
                plugin: plugin.into(),
            })
            .set(i64::from(percent));
    }

    /// Counts a rollback of a canary candidate of `plugin`.
    pub fn canary_rolled_back(&self, plugin: &str) {
        self.canary_rollbacks
            .get_or_create(&PluginLabel {
                plugin: plugin.into(),
            })
            .inc();
    }

    /// `/plugins` as JSON: every plugin file's state and, for a plugin serving, its
    /// sandbox figures (calls by outcome, peak memory, output dropped) and its shadow.
    pub fn plugins_json(&self) -> String {
        let plugins = self.plugins.lock().expect("metrics lock");
        let shadows = self.shadows.lock().expect("metrics lock");
        let canaries = self.canaries.lock().expect("metrics lock");
        let list: Vec<serde_json::Value> = plugins
            .values()
            .map(|state| {
                let mut value = serde_json::to_value(state).unwrap_or_default();
                if let (Some(sandbox), Some(name)) = (&self.sandbox, &state.name) {
                    value["sandbox"] =
                        serde_json::to_value(sandbox.summary(name)).unwrap_or_default();
                }
                if let Some(shadow) = shadows.get(&state.file) {
                    value["shadow"] = serde_json::to_value(shadow).unwrap_or_default();
                }
                if let Some(canary) = canaries.get(&state.file) {
                    value["canary"] = canary.report();
                }
                value
            })
            .collect();
        serde_json::to_string(&list).unwrap_or_else(|_| "[]".into())
    }
}

struct ReconcileTimer<'a> {
    metrics: &'a Metrics,
    plugin: String,
    start: Instant,
}

impl Drop for ReconcileTimer<'_> {
    fn drop(&mut self) {
        self.metrics
            .reconcile_duration
            .get_or_create(&PluginLabel {
                plugin: std::mem::take(&mut self.plugin),
            })
            .observe(self.start.elapsed().as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropped_events_are_counted_and_said_once_per_plugin() {
        let m = Metrics::default();
        assert!(m.events_dropped("flood", 40), "the first drop is said");
        assert!(!m.events_dropped("flood", 2), "and only the first");
        assert!(m.events_dropped("other", 1), "each plugin's first is said");
        let text = m.render();
        assert!(
            text.contains("capstan_events_dropped_total{plugin=\"flood\"} 42\n"),
            "{text}"
        );
    }

    #[test]
    fn counters_render_as_prometheus_text() {
        let m = Metrics::default();
        m.reconciled("uuid", "ok");
        m.reconciled("uuid", "ok");
        m.status_written("uuid");
        m.child_written("widget", "unchanged");
        drop(m.reconcile_timer("uuid"));
        let text = m.render();
        assert!(
            text.contains("capstan_child_writes_total{plugin=\"widget\",result=\"unchanged\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("capstan_reconciles_total{plugin=\"uuid\",result=\"ok\"} 2\n"),
            "{text}"
        );
        assert!(
            text.contains("capstan_status_writes_total{plugin=\"uuid\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("capstan_reconcile_duration_seconds_count{plugin=\"uuid\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("# HELP capstan_reconciles Finished reconciles"),
            "{text}"
        );
        m.watch_failed("ConfigMap.v1", Some(403));
        m.set_leader(true);
        let text = m.render();
        assert!(
            text.contains("capstan_watch_errors_total{kind=\"ConfigMap.v1\",code=\"403\"} 1\n"),
            "{text}"
        );
        assert!(text.contains("capstan_leader 1\n"), "{text}");
    }
}
