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
//! **The regression guard.** With `--reference PATH` (a guest whose call does almost
//! nothing: the test plugin `pass`), each plugin's calls alternate with the reference's
//! in the same process, and the ratio of their p50s is the plugin's cost in units of the
//! reference: absolute times move with the machine and its load, the ratio much less.
//! With `--guard FILE`, the ratios are checked against those recorded in FILE for this
//! build's profile (debug or release): one grown by more than the file's `limit` (1.5×)
//! fails the run. `--record FILE` writes the ratios measured instead.
//!
//! `sandbox_bench [PLUGIN_DIR] [--calls N] [--json PATH] [--reference WASM]
//! [--guard FILE | --record FILE]`

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
    reference: Option<PathBuf>,
    guard: Option<PathBuf>,
    record: Option<PathBuf>,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut args = Args {
        dir: "target/plugins".into(),
        calls: 2000,
        json: None,
        reference: None,
        guard: None,
        record: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || it.next().with_context(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--calls" => args.calls = value()?.parse().context("--calls")?,
            "--json" => args.json = Some(value()?.into()),
            "--reference" => args.reference = Some(value()?.into()),
            "--guard" => args.guard = Some(value()?.into()),
            "--record" => args.record = Some(value()?.into()),
            flag if flag.starts_with('-') => {
                bail!(
                    "usage: sandbox_bench [PLUGIN_DIR] [--calls N] [--json PATH] [--reference WASM] [--guard FILE | --record FILE]"
                )
            }
            dir => args.dir = dir.into(),
        }
    }
    args.calls = args.calls.max(1);
    if (args.guard.is_some() || args.record.is_some()) && args.reference.is_none() {
        bail!("--guard and --record need --reference");
    }
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
    let ratios = match &args.reference {
        Some(reference) => Some(ratios(&args, &config, reference)?),
        None => None,
    };
    if let Some(path) = &args.json {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let doc = json!({
            "scenario": "sandbox",
            "calls": args.calls,
            "machine": {"cpus": std::thread::available_parallelism().map_or(1, |n| n.get())},
            "results": results,
            "ratios_to_reference": ratios,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")
            .with_context(|| format!("write {}", path.display()))?;
    }
    if let Some(ratios) = &ratios {
        if let Some(file) = &args.record {
            record(file, ratios)?;
        }
        if let Some(file) = &args.guard {
            guard(file, ratios)?;
        }
    }
    Ok(())
}

/// The profile of this build: ratios differ between debug and release hosts (the host's
/// share of a call is larger in debug), so each has its own.
const PROFILE: &str = if cfg!(debug_assertions) {
    "debug"
} else {
    "release"
};

/// Each plugin's p50 call over the reference guest's p50, their calls alternating in
/// this process (so that a burst of load slows both alike).
fn ratios(
    args: &Args,
    config: &SandboxConfig,
    reference: &Path,
) -> anyhow::Result<serde_json::Map<String, Value>> {
    let sandbox = Sandbox::new(config.clone())?;
    let base = sandbox.load_file_blocking(reference)?;
    let base_input = Observed {
        parent: json!({"apiVersion": "test.capstan.dev/v1", "kind": "Pass",
                       "metadata": {"name": "p", "namespace": "default", "uid": "u-1", "generation": 1}}),
        children: Vec::new(),
        related: Vec::new(),
    };
    let call = |plugin: &capstan::plugin::Plugin, input: &Observed| -> anyhow::Result<Duration> {
        let start = Instant::now();
        plugin
            .reconcile_blocking(input)
            .context("call")?
            .map_err(|e| anyhow::anyhow!("reconcile: {e:?}"))?;
        Ok(start.elapsed())
    };
    let mut out = serde_json::Map::new();
    println!("\n### Each plugin's call over the reference guest's ({PROFILE} build)\n");
    println!("| plugin | p50 | reference p50 | ratio |\n|---|---|---|---|");
    for case in cases() {
        let plugin = sandbox.load_file_blocking(&args.dir.join(format!("{}.wasm", case.name)))?;
        let input = Observed {
            parent: case.parent,
            children: case.children,
            related: Vec::new(),
        };
        let (mut mine, mut theirs) = (Vec::new(), Vec::new());
        for i in 0..WARMUP_CALLS + args.calls {
            let (a, b) = (call(&plugin, &input)?, call(&base, &base_input)?);
            if i >= WARMUP_CALLS {
                mine.push(a);
                theirs.push(b);
            }
        }
        mine.sort();
        theirs.sort();
        let (p50, base_p50) = (mine[mine.len() / 2], theirs[theirs.len() / 2]);
        let ratio = p50.as_secs_f64() / base_p50.as_secs_f64();
        println!(
            "| {} | {:.0} µs | {:.0} µs | {ratio:.2} |",
            case.name,
            p50.as_secs_f64() * 1e6,
            base_p50.as_secs_f64() * 1e6
        );
        out.insert(
            case.name.to_string(),
            json!((ratio * 100.0).round() / 100.0),
        );
    }
    Ok(out)
}

/// Writes `ratios` into `file` for this build's profile, keeping the rest of it.
fn record(file: &Path, ratios: &serde_json::Map<String, Value>) -> anyhow::Result<()> {
    let mut doc: Value = match std::fs::read_to_string(file) {
        Ok(text) => serde_json::from_str(&text).with_context(|| file.display().to_string())?,
        Err(_) => json!({"limit": 1.5}),
    };
    doc[PROFILE] = Value::Object(ratios.clone());
    std::fs::write(file, serde_json::to_string_pretty(&doc)? + "\n")
        .with_context(|| format!("write {}", file.display()))?;
    println!("recorded the {PROFILE} ratios in {}", file.display());
    Ok(())
}

/// Fails when a plugin's ratio grew past the recorded one times the file's limit.
fn guard(file: &Path, ratios: &serde_json::Map<String, Value>) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(file).with_context(|| format!("read {}", file.display()))?;
    let doc: Value = serde_json::from_str(&text).with_context(|| file.display().to_string())?;
    let limit = doc["limit"]
        .as_f64()
        .context("no limit in the guard file")?;
    let recorded = doc[PROFILE]
        .as_object()
        .with_context(|| format!("no {PROFILE} ratios in {}", file.display()))?;
    let mut grown = Vec::new();
    for (plugin, was) in recorded {
        let was = was.as_f64().context("a ratio")?;
        let Some(now) = ratios.get(plugin).and_then(Value::as_f64) else {
            bail!("{plugin} has a recorded ratio but was not measured");
        };
        if now > was * limit {
            grown.push(format!(
                "{plugin}: {now:.2}× the reference, recorded {was:.2}× (limit {limit}×)"
            ));
        } else if now * limit < was {
            println!(
                "guard: {plugin} is now {now:.2}× the reference, recorded {was:.2}×: record the new ratio (--record {})",
                file.display()
            );
        }
    }
    if !grown.is_empty() {
        bail!(
            "a plugin's call cost grew against the reference guest: {}",
            grown.join("; ")
        );
    }
    println!(
        "guard: every plugin's ratio is within {limit}× of {}",
        file.display()
    );
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
