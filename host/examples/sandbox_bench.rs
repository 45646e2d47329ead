//! Measures the plugin sandbox for each shipped plugin: compiling the component (no
//! cache), loading it from the on-disk compile cache, and `reconcile` calls, each in a
//! fresh instance (p50 and p99): blocking calls (as `capstan render` makes them, on the
//! caller's thread), and async calls awaited from another tokio runtime (as the
//! operator makes them: the call hops to the sandbox's runtime and back).
//!
//! `cargo xtask bench` runs it (release build) and keeps its JSON in
//! `target/bench/sandbox.json`; `docs/performance.md` has the figures. Nothing here
//! asserts a speed: machines are noisy.
//!
//! `sandbox_bench [PLUGIN_DIR] [--calls N] [--json PATH]`

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use capstan::contract::{Observed, ObservedChild};
use capstan::plugin::{Sandbox, SandboxConfig};
use serde_json::{Value, json};

/// Calls made before measuring: the first calls of a fresh pool fault in its memory.
const WARMUP_CALLS: usize = 20;

struct Args {
    dir: PathBuf,
    calls: usize,
    json: Option<PathBuf>,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut args = Args {
        dir: "target/plugins".into(),
        calls: 2000,
        json: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || it.next().with_context(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--calls" => args.calls = value()?.parse().context("--calls")?,
            "--json" => args.json = Some(value()?.into()),
            flag if flag.starts_with('-') => {
                bail!("usage: sandbox_bench [PLUGIN_DIR] [--calls N] [--json PATH]")
            }
            dir => args.dir = dir.into(),
        }
    }
    args.calls = args.calls.max(1);
    Ok(args)
}

fn main() -> anyhow::Result<()> {
    let args = parse_args()?;
    let cache = tempfile::tempdir()?;
    let config = SandboxConfig {
        cache_dir: Some(cache.path().to_path_buf()),
        ..SandboxConfig::default()
    };
    let mut results = Vec::new();
    for case in cases() {
        results.push(measure(&args, &config, case)?);
    }
    print_table(&results, args.calls);
    if let Some(path) = &args.json {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let doc = json!({
            "scenario": "sandbox",
            "calls": args.calls,
            "machine": {"cpus": std::thread::available_parallelism().map_or(1, |n| n.get())},
            "results": results,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")
            .with_context(|| format!("write {}", path.display()))?;
    }
    Ok(())
}

/// One plugin and the input of its calls, with the p50 goal of its calls (none: the
/// figure is reported beside the others, without a goal).
struct Case {
    name: &'static str,
    parent: Value,
    children: Vec<ObservedChild>,
    goal_p50: Option<Duration>,
}

fn measure(args: &Args, config: &SandboxConfig, case: Case) -> anyhow::Result<Value> {
    let path = args.dir.join(format!("{}.wasm", case.name));
    // The cache starts empty: the first load compiles (and fills it), the second reads it.
    let compile = time_once(|| load(config, &path))?;
    let cached = time_once(|| load(config, &path))?;
    let plugin = Sandbox::new(config.clone())?.load_file_blocking(&path)?;
    let observed = Observed {
        parent: case.parent,
        children: case.children,
        related: Vec::new(),
    };
    let mut calls = Vec::with_capacity(args.calls);
    for i in 0..WARMUP_CALLS + args.calls {
        let start = Instant::now();
        plugin
            .reconcile_blocking(&observed)
            .context("call")?
            .map_err(|e| anyhow::anyhow!("reconcile: {e:?}"))?;
        if i >= WARMUP_CALLS {
            calls.push(start.elapsed());
        }
    }
    calls.sort();
    // The operator's way: from a runtime of its own, awaiting the sandbox's runtime.
    let operator = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let mut hops = operator.block_on(async {
        let mut hops = Vec::with_capacity(args.calls);
        for i in 0..WARMUP_CALLS + args.calls {
            let start = Instant::now();
            plugin
                .reconcile_async(&observed)
                .await
                .context("call")?
                .map_err(|e| anyhow::anyhow!("reconcile: {e:?}"))?;
            if i >= WARMUP_CALLS {
                hops.push(start.elapsed());
            }
        }
        anyhow::Ok(hops)
    })?;
    hops.sort();
    let at = |q: f64| calls[((calls.len() - 1) as f64 * q).round() as usize];
    let async_at = |q: f64| hops[((hops.len() - 1) as f64 * q).round() as usize];
    let micros = |d: Duration| d.as_secs_f64() * 1e6;
    Ok(json!({
        "plugin": case.name,
        "wasm_bytes": std::fs::metadata(&path)?.len(),
        "compile_ms": compile.as_secs_f64() * 1e3,
        "cached_load_ms": cached.as_secs_f64() * 1e3,
        "reconcile_p50_us": micros(at(0.5)),
        "reconcile_p99_us": micros(at(0.99)),
        "async_p50_us": micros(async_at(0.5)),
        "async_p99_us": micros(async_at(0.99)),
        "goal_p50_us": case.goal_p50.map(micros),
    }))
}

fn load(config: &SandboxConfig, path: &Path) -> anyhow::Result<()> {
    Sandbox::new(config.clone())?.load_file_blocking(path)?;
    Ok(())
}

fn print_table(results: &[Value], calls: usize) {
    println!("\n### Sandbox: one plugin call in a fresh instance ({calls} calls)\n");
    println!(
        "| {:<10} | {:>10} | {:>11} | {:>13} | {:>13} | {:>13} | {:>9} | {:>9} |",
        "plugin",
        "compile",
        "cached load",
        "reconcile p50",
        "reconcile p99",
        "goal (p50)",
        "async p50",
        "async p99"
    );
    println!(
        "| {:-<10} | {:->10} | {:->11} | {:->13} | {:->13} | {:->13} | {:->9} | {:->9} |",
        "", "", "", "", "", "", "", ""
    );
    for r in results {
        let f = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
        let goal = match r["goal_p50_us"].as_f64() {
            Some(goal) if f("reconcile_p50_us") <= goal => format!("≤ {goal:.0} µs ok"),
            Some(goal) => format!("≤ {goal:.0} µs over"),
            None => "-".to_string(),
        };
        println!(
            "| {:<10} | {:>7.0} ms | {:>8.1} ms | {:>10.0} µs | {:>10.0} µs | {:>13} | {:>6.0} µs | {:>6.0} µs |",
            r["plugin"].as_str().unwrap_or_default(),
            f("compile_ms"),
            f("cached_load_ms"),
            f("reconcile_p50_us"),
            f("reconcile_p99_us"),
            goal,
            f("async_p50_us"),
            f("async_p99_us"),
        );
    }
}

fn time_once(f: impl FnOnce() -> anyhow::Result<()>) -> anyhow::Result<Duration> {
    let start = Instant::now();
    f()?;
    Ok(start.elapsed())
}

/// A fresh Uuid, and a fresh three-instance PostgreSQLCluster.
fn cases() -> Vec<Case> {
    let meta =
        |name: &str| json!({"name": name, "namespace": "default", "uid": "u-1", "generation": 1});
    vec![
        Case {
            name: "uuid",
            parent: json!({"apiVersion": "demo.operator/v1", "kind": "Uuid", "metadata": meta("u")}),
            children: vec![],
            goal_p50: Some(Duration::from_micros(60)),
        },
        Case {
            name: "postgresql",
            parent: json!({"apiVersion": "db.example.com/v1alpha1", "kind": "PostgreSQLCluster", "metadata": meta("pg"),
                   "spec": {"replicas": 3, "version": "16.1", "storage": "1Gi"}}),
            children: vec![],
            goal_p50: Some(Duration::from_micros(250)),
        },
        // The Python plugin (componentize-py: CPython in the component), for comparison.
        Case {
            name: "database",
            parent: json!({"apiVersion": "mycompany.com/v1", "kind": "Database", "metadata": meta("db"),
                   "spec": {"engine": "postgresql", "version": "16", "storage": "1Gi", "replicas": 3}}),
            children: vec![],
            goal_p50: None,
        },
    ]
}
