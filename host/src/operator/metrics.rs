//! Counters and timings of the operator, its health, and the state of every plugin
//! file: what `/metrics`, `/healthz`, `/readyz` and `/plugins` show (served by
//! [`super::http`]).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use serde::Serialize;

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
    /// sha256 of the version serving.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    /// Whether a controller runs for it.
    pub serving: bool,
    /// Why the last load of this file failed, if it did (the old version may still serve).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Operator-wide counters.
#[derive(Default)]
pub struct Metrics {
    counters: Mutex<BTreeMap<String, u64>>,
    durations: Mutex<BTreeMap<String, (f64, u64)>>,
    plugins: Mutex<BTreeMap<String, PluginState>>,
    ready: AtomicBool,
    leader: AtomicBool,
    /// Parts of the host that stopped and will not come back by themselves.
    failed: Mutex<BTreeMap<String, String>>,
}

impl Metrics {
    fn add(&self, key: String) {
        *self
            .counters
            .lock()
            .expect("metrics lock")
            .entry(key)
            .or_default() += 1;
    }

    /// Counts one finished reconcile with its result (`ok` or a failure reason).
    pub fn reconciled(&self, plugin: &str, result: &str) {
        self.add(format!(
            "capstan_reconciles_total{{plugin=\"{plugin}\",result=\"{result}\"}}"
        ));
    }

    /// Counts one status write.
    pub fn status_written(&self, plugin: &str) {
        self.add(format!(
            "capstan_status_writes_total{{plugin=\"{plugin}\"}}"
        ));
    }

    /// Counts one failed plugin load.
    pub fn load_failed(&self) {
        self.add("capstan_plugin_load_failures_total".into());
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
        self.leader.store(leader, Ordering::Relaxed);
    }

    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        out.push_str("# TYPE capstan_reconciles_total counter\n# TYPE capstan_status_writes_total counter\n# TYPE capstan_plugin_load_failures_total counter\n");
        for (key, value) in self.counters.lock().expect("metrics lock").iter() {
            let _ = writeln!(out, "{key} {value}");
        }
        out.push_str("# TYPE capstan_reconcile_duration_seconds summary\n");
        for (plugin, (sum, count)) in self.durations.lock().expect("metrics lock").iter() {
            let _ = writeln!(
                out,
                "capstan_reconcile_duration_seconds_sum{{plugin=\"{plugin}\"}} {sum}"
            );
            let _ = writeln!(
                out,
                "capstan_reconcile_duration_seconds_count{{plugin=\"{plugin}\"}} {count}"
            );
        }
        out.push_str("# TYPE capstan_leader gauge\n");
        let _ = writeln!(
            out,
            "capstan_leader {}",
            u8::from(self.leader.load(Ordering::Relaxed))
        );
        let plugins = self.plugins.lock().expect("metrics lock");
        out.push_str("# TYPE capstan_plugins_serving gauge\n");
        let _ = writeln!(
            out,
            "capstan_plugins_serving {}",
            plugins.values().filter(|p| p.serving).count()
        );
        out
    }

    /// `/plugins` as JSON.
    pub fn plugins_json(&self) -> String {
        let plugins = self.plugins.lock().expect("metrics lock");
        serde_json::to_string(&plugins.values().collect::<Vec<_>>()).unwrap_or_else(|_| "[]".into())
    }
}

struct ReconcileTimer<'a> {
    metrics: &'a Metrics,
    plugin: String,
    start: Instant,
}

impl Drop for ReconcileTimer<'_> {
    fn drop(&mut self) {
        let mut d = self.metrics.durations.lock().expect("metrics lock");
        let entry = d.entry(std::mem::take(&mut self.plugin)).or_default();
        entry.0 += self.start.elapsed().as_secs_f64();
        entry.1 += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_render_as_prometheus_text() {
        let m = Metrics::default();
        m.reconciled("uuid", "ok");
        m.reconciled("uuid", "ok");
        m.status_written("uuid");
        drop(m.reconcile_timer("uuid"));
        let text = m.render();
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
    }
}
