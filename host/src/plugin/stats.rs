//! Per-plugin sandbox metrics: calls by outcome, their duration, the peak linear memory
//! of an instance, the output dropped, and the time calls waited for a free instance
//! slot (never the plugin's fault). Registered into the operator's Prometheus registry
//! and summarised per plugin in `/plugins`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use serde::Serialize;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PluginLabel {
    plugin: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabels {
    plugin: String,
    outcome: String,
}

/// How a call into a plugin ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// It returned a value.
    Ok,
    /// It returned `invalid`.
    Invalid,
    /// It returned `retry`.
    Retry,
    /// It ran past its deadline.
    Deadline,
    /// It hit its memory cap.
    Memory,
    /// It trapped.
    Trap,
    /// It panicked.
    Panic,
}

impl Outcome {
    fn label(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Invalid => "invalid",
            Outcome::Retry => "retry",
            Outcome::Deadline => "deadline",
            Outcome::Memory => "memory",
            Outcome::Trap => "trap",
            Outcome::Panic => "panic",
        }
    }
}

/// One plugin's sandbox figures, as `/plugins` shows them.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct SandboxSummary {
    /// Calls, by outcome.
    pub calls: BTreeMap<String, u64>,
    /// Largest linear memory an instance grew to, in bytes.
    pub peak_memory_bytes: u64,
    /// Output bytes dropped past the per-call capacity.
    pub output_dropped_bytes: u64,
}

/// The sandbox's metrics; cheap to clone (shared).
#[derive(Clone)]
pub struct SandboxMetrics {
    calls: Family<CallLabels, Counter>,
    duration: Family<PluginLabel, Histogram>,
    peak_memory: Family<PluginLabel, Gauge>,
    dropped: Family<PluginLabel, Counter>,
    running: Family<PluginLabel, Gauge>,
    slot_wait: Histogram,
    summaries: Arc<Mutex<BTreeMap<String, SandboxSummary>>>,
}

impl Default for SandboxMetrics {
    fn default() -> Self {
        SandboxMetrics {
            calls: Family::default(),
            // 50 µs … ~26 s: a call is tens of microseconds, a hostile one the deadline.
            duration: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.000_05, 2.0, 20))
            }),
            peak_memory: Family::default(),
            dropped: Family::default(),
            running: Family::default(),
            slot_wait: Histogram::new(exponential_buckets(0.000_1, 4.0, 10)),
            summaries: Arc::default(),
        }
    }
}

impl SandboxMetrics {
    /// Registers every series into `registry`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "capstan_plugin_calls",
            "Calls into plugins by outcome (ok, invalid, retry, deadline, memory, trap, panic)",
            self.calls.clone(),
        );
        registry.register(
            "capstan_plugin_call_duration_seconds",
            "Duration of one plugin call in a fresh instance, instantiation included",
            self.duration.clone(),
        );
        registry.register(
            "capstan_plugin_peak_memory_bytes",
            "Largest linear memory an instance of the plugin grew to",
            self.peak_memory.clone(),
        );
        registry.register(
            "capstan_plugin_output_dropped_bytes",
            "Bytes a plugin printed past the per-call capacity, dropped",
            self.dropped.clone(),
        );
        registry.register(
            "capstan_plugin_calls_running",
            "Calls of the plugin running now (in an instance, including time held back by its CPU share)",
            self.running.clone(),
        );
        registry.register(
            "capstan_sandbox_slot_wait_seconds",
            "Time calls waited for a free instance slot of the pool",
            self.slot_wait.clone(),
        );
    }

    /// Records one finished call of `plugin`.
    pub fn record(
        &self,
        plugin: &str,
        outcome: Outcome,
        took: Duration,
        peak_memory: u64,
        dropped: u64,
    ) {
        let label = PluginLabel {
            plugin: plugin.into(),
        };
        self.calls
            .get_or_create(&CallLabels {
                plugin: plugin.into(),
                outcome: outcome.label().into(),
            })
            .inc();
        self.duration
            .get_or_create(&label)
            .observe(took.as_secs_f64());
        let peak = self.peak_memory.get_or_create(&label);
        if peak_memory as i64 > peak.get() {
            peak.set(peak_memory as i64);
        }
        if dropped > 0 {
            self.dropped.get_or_create(&label).inc_by(dropped);
        }
        let mut summaries = self.summaries.lock().expect("summaries lock");
        let s = summaries.entry(plugin.to_string()).or_default();
        *s.calls.entry(outcome.label().to_string()).or_default() += 1;
        s.peak_memory_bytes = s.peak_memory_bytes.max(peak_memory);
        s.output_dropped_bytes += dropped;
    }

    /// Counts a call of `plugin` as running until the guard is dropped.
    pub fn running(&self, plugin: &str) -> Running {
        let gauge = self
            .running
            .get_or_create(&PluginLabel {
                plugin: plugin.into(),
            })
            .clone();
        gauge.inc();
        Running(gauge)
    }

    /// Records how long a call waited for an instance slot.
    pub fn waited_for_slot(&self, waited: Duration) {
        self.slot_wait.observe(waited.as_secs_f64());
    }

    /// The summary of `plugin` (empty before its first call).
    pub fn summary(&self, plugin: &str) -> SandboxSummary {
        self.summaries
            .lock()
            .expect("summaries lock")
            .get(plugin)
            .cloned()
            .unwrap_or_default()
    }
}

/// A running call, counted in `capstan_plugin_calls_running` while it lives.
pub struct Running(Gauge);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_are_counted_by_outcome_with_peaks_and_drops() {
        let m = SandboxMetrics::default();
        m.record("w", Outcome::Ok, Duration::from_micros(80), 1 << 20, 0);
        m.record("w", Outcome::Deadline, Duration::from_secs(2), 3 << 20, 0);
        m.record("w", Outcome::Ok, Duration::from_micros(90), 2 << 20, 500);
        let (a, b) = (m.running("w"), m.running("w"));
        drop(a);
        let s = m.summary("w");
        assert_eq!(s.calls["ok"], 2);
        assert_eq!(s.calls["deadline"], 1);
        assert_eq!(s.peak_memory_bytes, 3 << 20);
        assert_eq!(s.output_dropped_bytes, 500);
        let mut registry = Registry::default();
        m.register(&mut registry);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(
            text.contains("capstan_plugin_calls_total{plugin=\"w\",outcome=\"ok\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("capstan_plugin_peak_memory_bytes{plugin=\"w\"} 3145728"),
            "{text}"
        );
        assert!(
            text.contains("capstan_plugin_output_dropped_bytes_total{plugin=\"w\"} 500"),
            "{text}"
        );
        assert!(
            text.contains("capstan_plugin_calls_running{plugin=\"w\"} 1"),
            "{text}"
        );
        drop(b);
    }
}
