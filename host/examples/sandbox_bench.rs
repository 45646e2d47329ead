//! Measures the plugin sandbox: compiling a component (cold and from the on-disk cache)
//! and one `reconcile` call in a fresh instance, for each shipped plugin.
//!
//! `cargo xtask bench` (builds the plugins first). Prints medians and 90th percentiles;
//! nothing here asserts a speed: machines are noisy.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use capstan::contract::{Observed, ObservedChild};
use capstan::plugin::{Sandbox, SandboxConfig};
use serde_json::json;

fn main() -> anyhow::Result<()> {
    let dir = std::env::args()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| "target/plugins".into());
    let cache = tempfile::tempdir()?;
    let config = SandboxConfig {
        cache_dir: Some(cache.path().to_path_buf()),
        ..SandboxConfig::default()
    };
    println!(
        "{:<12} {:>14} {:>14} {:>16} {:>16}",
        "plugin", "compile", "cached load", "reconcile p50", "reconcile p90"
    );
    for (name, parent, children) in cases() {
        let path = dir.join(format!("{name}.wasm"));
        let compile = time_once(|| {
            Sandbox::new(SandboxConfig {
                cache_dir: None,
                ..config.clone()
            })?
            .load_file(&path)
            .map(|_| ())
            .map_err(Into::into)
        })?;
        Sandbox::new(config.clone())?.load_file(&path)?; // fill the cache
        let cached = time_once(|| {
            Sandbox::new(config.clone())?
                .load_file(&path)
                .map(|_| ())
                .map_err(Into::into)
        })?;
        let plugin = Sandbox::new(config.clone())?.load_file(&path)?;
        let observed = Observed { parent, children };
        let mut calls: Vec<Duration> = (0..200)
            .map(|_| {
                let start = Instant::now();
                plugin
                    .reconcile(&observed)
                    .expect("call")
                    .expect("reconcile");
                start.elapsed()
            })
            .collect();
        calls.sort();
        println!(
            "{name:<12} {:>14?} {:>14?} {:>16?} {:>16?}",
            compile,
            cached,
            calls[calls.len() / 2],
            calls[calls.len() * 9 / 10]
        );
    }
    Ok(())
}

fn time_once(f: impl FnOnce() -> anyhow::Result<()>) -> anyhow::Result<Duration> {
    let start = Instant::now();
    f()?;
    Ok(start.elapsed())
}

/// A fresh Uuid, and a fresh three-instance PostgreSQLCluster.
fn cases() -> Vec<(&'static str, serde_json::Value, Vec<ObservedChild>)> {
    let meta =
        |name: &str| json!({"name": name, "namespace": "default", "uid": "u-1", "generation": 1});
    vec![
        (
            "uuid",
            json!({"apiVersion": "demo.operator/v1", "kind": "Uuid", "metadata": meta("u")}),
            vec![],
        ),
        (
            "postgresql",
            json!({"apiVersion": "db.example.com/v1alpha1", "kind": "PostgreSQLCluster", "metadata": meta("pg"),
                   "spec": {"replicas": 3, "version": "16.1", "storage": "1Gi"}}),
            vec![],
        ),
    ]
}
