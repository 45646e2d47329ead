//! The sandbox every plugin call runs in: what it admits at load, deadlines and memory
//! caps, where async calls run (never holding the caller's threads), the compile cache,
//! the rules for `describe`, and the instance pool.

mod common;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use capstan::contract::Observed;
use capstan::plugin::{CallError, Sandbox, SandboxConfig};
use capstan::render;
use common::{
    assert_fails_with, capstan, plugin, sandbox, test_plugin, thread_cpu, widget_observed,
    widget_parent, widget_with_deadline,
};
use serde_json::{Value, json};

/// The Uuid plugin with every `from` in its bytes replaced by `to` (of the same length),
/// written as `name` in `dir`.
fn patched_uuid(dir: &tempfile::TempDir, name: &str, from: &[u8], to: &[u8]) -> PathBuf {
    assert_eq!(from.len(), to.len(), "a patch keeps the component's layout");
    let mut bytes = std::fs::read(plugin("uuid")).unwrap();
    let mut replaced = 0;
    for i in 0..bytes.len().saturating_sub(from.len()) {
        if &bytes[i..i + from.len()] == from {
            bytes[i..i + to.len()].copy_from_slice(to);
            replaced += 1;
        }
    }
    assert!(
        replaced > 0,
        "{} must be in the component",
        String::from_utf8_lossy(from)
    );
    let path = dir.path().join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

#[test]
fn a_component_built_for_another_contract_version_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = patched_uuid(
        &dir,
        "future.wasm",
        b"capstan:plugin/reconciler@0.2.0",
        b"capstan:plugin/reconciler@2.0.0",
    );
    assert_fails_with(
        &["inspect", path.to_str().unwrap()],
        "it was built for capstan:plugin@2.0.0",
    );
}

#[test]
fn a_component_importing_what_the_host_does_not_provide_is_refused_by_name() {
    // The Uuid plugin with its `wasi:random/random` import renamed (same length) to an
    // interface of wasi:http, as JavaScript toolchains import by default.
    let dir = tempfile::tempdir().unwrap();
    let path = patched_uuid(
        &dir,
        "http.wasm",
        b"wasi:random/random@",
        b"wasi:http/handlers@",
    );
    assert_fails_with(
        &["inspect", path.to_str().unwrap()],
        "imports wasi:http/handlers@0.2",
    );
    assert_fails_with(
        &["inspect", path.to_str().unwrap()],
        "which Capstan does not provide; build the plugin without wasi:http",
    );
}

#[test]
fn misbehaving_plugins_are_stopped_with_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let widget = test_plugin("widget");
    let widget = widget.to_str().unwrap();
    let cases = [
        (
            "trap",
            "plugin widget crashed: wasm trap: wasm `unreachable` instruction executed",
        ),
        ("panic", "plugin widget panicked: widget asked to panic"),
        (
            "loop",
            "plugin widget ran past its deadline of 300ms and was stopped",
        ),
        (
            "oom",
            "plugin widget exceeded its memory cap of 16 MiB and was stopped",
        ),
        (
            "invalid",
            "reconcile failed: invalid spec: spec.mode says this spec is invalid",
        ),
        (
            "undeclared-kind",
            "plugin output refused: child Secret.v1 \"w-secret\" is of a kind the plugin did not declare",
        ),
        (
            "other-namespace",
            "plugin output refused: child ConfigMap.v1 \"w-elsewhere\" is in namespace \"kube-system\"",
        ),
        (
            "bad-status",
            "plugin output refused: status must be a JSON object: got an array",
        ),
        // The hostile-plugin suite: time spent outside wasm code is bounded too.
        (
            "sleep",
            "plugin widget ran past its deadline of 300ms and was stopped",
        ),
        (
            "clock-poll",
            "plugin widget ran past its deadline of 300ms and was stopped",
        ),
        (
            "huge-alloc",
            "plugin widget exceeded its memory cap of 16 MiB and was stopped",
        ),
        ("stack", "plugin widget crashed: wasm trap"),
        (
            "nested-json",
            "plugin output refused: status must be a JSON object: not valid JSON: recursion limit exceeded",
        ),
        (
            "foreign-owner",
            "plugin output refused: child ConfigMap.v1 \"w-owned\" has an ownerReference to Secret someone-else, not to the parent",
        ),
        // Nothing is granted: each attempt fails inside the plugin, which says so.
        ("file", "file read: refused"),
        ("socket", "socket connect: refused"),
        ("env", "environment: 0 variables, 0 arguments"),
    ];
    for (mode, expected) in cases {
        let parent = widget_parent(&dir, mode);
        assert_fails_with(
            &[
                "render",
                "--plugin",
                widget,
                "--parent",
                &parent,
                "--plugin-timeout-ms",
                "300",
                "--plugin-memory-mib",
                "16",
            ],
            expected,
        );
    }
}

#[test]
fn a_plugin_that_sleeps_or_polls_is_stopped_at_its_deadline_not_when_it_wakes() {
    // The guest sleeps for 30 s, or polls the clock or spins for ever: a deadline that
    // did not hold would end these calls 30 deadlines late, or never. Ten deadlines is
    // far from both, and far above what a busy machine adds to a call that is stopped on
    // time (it is late by scheduling delays, not by a multiple of the deadline).
    let deadline = Duration::from_secs(1);
    let plugin = widget_with_deadline(deadline);
    for mode in ["sleep", "clock-poll", "loop"] {
        let started = Instant::now();
        let result = plugin.reconcile_blocking(&widget_observed(mode));
        let took = started.elapsed();
        eprintln!("{mode}: stopped after {took:?} (deadline {deadline:?})");
        assert!(
            matches!(result, Err(CallError::Deadline { .. })),
            "{mode}: {result:?}"
        );
        assert!(took < deadline * 10, "{mode}: stopped after {took:?}");
    }
    // A flood of output is cut, never fatal: the call succeeds.
    let flood = plugin.reconcile_blocking(&widget_observed("flood"));
    assert!(
        matches!(flood, Ok(Ok(ref answer)) if answer.children.len() == 1),
        "{flood:?}"
    );
}

/// A runtime like the operator's, with one worker: whatever holds it is seen.
fn one_worker_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap()
}

/// Counts in `ticks` the 1 ms timers the current runtime fires, for ever: as the watches
/// and the lease renewal would, it needs its thread for a moment every tick.
async fn count_ticks(ticks: Arc<AtomicU64>) {
    loop {
        tokio::time::sleep(Duration::from_millis(1)).await;
        ticks.fetch_add(1, Ordering::Relaxed);
    }
}

/// A ticker like [`count_ticks`] on a thread and runtime of its own, which no plugin call
/// can hold: the reference that the operator's ticker is compared with. It stops when
/// the returned sender is dropped.
fn reference_ticker(ticks: Arc<AtomicU64>) -> tokio::sync::oneshot::Sender<()> {
    let (stop, stopped) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(async {
                tokio::select! {
                    _ = count_ticks(ticks) => {}
                    _ = stopped => {}
                }
            })
    });
    stop
}

#[test]
fn busy_plugins_called_from_the_operator_do_not_hold_its_threads() {
    // Async calls start on the caller's thread and move to the sandbox's runtime when
    // the guest is still running at an epoch tick (10 ms); for a second after a call
    // ran that long, the plugin's calls start on the sandbox's runtime. Eight guests
    // spinning until their deadline, twice over, must leave the caller's only worker
    // free for a ticker in the second round. Its ticks are counted over the round's
    // first ten epoch ticks: longer than the eight ticks the guests would hold the
    // worker if each started there, shorter than the deadline they run to.
    let deadline = Duration::from_millis(500);
    let window = Duration::from_millis(100);
    let plugin = widget_with_deadline(deadline);
    let operator = one_worker_runtime();
    let reference = Arc::new(AtomicU64::new(0));
    let _reference_ticker = reference_ticker(reference.clone());
    let ticks = Arc::new(AtomicU64::new(0));
    // Both counts are read at the same moment, so a window that ends late (its timer is
    // the operator runtime's) is a longer window for both tickers.
    let (rounds, after, counted) = operator.block_on(async move {
        tokio::spawn(count_ticks(ticks.clone()));
        let counts = || {
            (
                ticks.load(Ordering::Relaxed),
                reference.load(Ordering::Relaxed),
            )
        };
        let mut rounds = Vec::new();
        let mut counted = (0, 0);
        for _ in 0..2 {
            let before = counts();
            let calls: Vec<_> = (0..8)
                .map(|_| {
                    let plugin = plugin.clone();
                    let observed = widget_observed("loop");
                    tokio::spawn(async move {
                        let result = plugin.reconcile_async(&observed).await;
                        result.map(|r| r.map(|d| d.children.len()))
                    })
                })
                .collect();
            tokio::time::sleep(window).await;
            let after = counts();
            counted = (after.0 - before.0, after.1 - before.1);
            rounds.push(futures::future::join_all(calls).await);
        }
        let after = plugin.reconcile_async(&widget_observed("")).await;
        (rounds, after.map(|r| r.map(|d| d.children.len())), counted)
    });
    for (round, calls) in rounds.iter().enumerate() {
        for call in calls {
            let result = call.as_ref().expect("the call's task");
            assert!(
                matches!(result, Err(CallError::Deadline { .. })),
                "round {round}: {result:?}"
            );
        }
    }
    assert!(
        matches!(after, Ok(Ok(1))),
        "a good call after them: {after:?}"
    );
    let (operator_ticks, reference_ticks) = counted;
    eprintln!(
        "second round, first {window:?}: the operator's ticker ticked {operator_ticks} times, the reference {reference_ticks}"
    );
    // Both tickers run the same loop on threads of the same priority, so a busy machine
    // slows both alike and a free worker keeps up with the reference. Guests run on that
    // worker, or started there, hold it for most of the window, and the ticker gets a
    // small fraction of the reference's ticks: half is far from both.
    assert!(reference_ticks > 0, "the reference ticker never ticked");
    assert!(
        operator_ticks * 2 >= reference_ticks,
        "the operator's ticker ticked {operator_ticks} times, the reference {reference_ticks}"
    );
}

#[test]
fn fast_calls_do_not_send_a_busy_plugin_back_to_the_callers_thread() {
    // A plugin that spins on some calls and answers at once on others: each spinning
    // call that started on the caller's thread would spin there until the next epoch
    // tick (0-10 ms), and a fast call's end used to send the next one there again. Here
    // each spinning call is started on the caller's only worker right after a fast call
    // ended, and the worker's CPU time is read around the start of each.
    let deadline = Duration::from_millis(300);
    let plugin = widget_with_deadline(deadline);
    let operator = one_worker_runtime();
    let runs = 12;
    let task = operator.spawn(async move {
        // A first spinning call marks the plugin busy.
        let first = plugin.reconcile_async(&widget_observed("loop")).await;
        assert!(
            matches!(first, Err(CallError::Deadline { .. })),
            "{first:?}"
        );
        let mut spun = Duration::ZERO;
        let mut spinning = Vec::new();
        for _ in 0..runs {
            let fast = plugin.reconcile_async(&widget_observed("")).await;
            assert!(
                matches!(fast, Ok(Ok(ref d)) if d.children.len() == 1),
                "{fast:?}"
            );
            // This task and the spinning call's first poll share the only worker: the
            // timer lets that poll run before this task reads the clock again.
            let before = thread_cpu();
            let busy = plugin.clone();
            let loop_observed = widget_observed("loop");
            spinning.push(tokio::spawn(async move {
                busy.reconcile_async(&loop_observed).await
            }));
            tokio::time::sleep(Duration::from_millis(1)).await;
            spun += thread_cpu() - before;
        }
        (spun, futures::future::join_all(spinning).await)
    });
    let (spun, spinning) = operator.block_on(task).expect("the test's task");
    for call in spinning {
        let result = call.expect("the call's task");
        assert!(
            matches!(result, Err(CallError::Deadline { .. })),
            "{result:?}"
        );
    }
    eprintln!("starting {runs} spinning calls cost the caller's worker {spun:?} of CPU");
    // CPU time, unlike wall-clock time, does not grow when the machine is busy. Started
    // here, each spinning call would spin for half a tick on average, a dozen of them
    // several ticks in all; handed off, a start costs the worker a spawn. One tick in
    // all is far from both.
    assert!(
        spun < Duration::from_millis(10),
        "starting {runs} spinning calls cost the caller's worker {spun:?} of CPU"
    );
}

#[test]
fn calls_are_independent_and_a_failed_call_does_not_poison_the_plugin() {
    let plugin = sandbox()
        .load_file_blocking(&test_plugin("widget"))
        .unwrap();
    assert!(matches!(
        plugin.reconcile_blocking(&widget_observed("loop")),
        Err(CallError::Deadline { .. })
    ));
    assert!(matches!(
        plugin.reconcile_blocking(&widget_observed("oom")),
        Err(CallError::MemoryCap { .. })
    ));
    let ok = plugin
        .reconcile_blocking(&widget_observed(""))
        .unwrap()
        .unwrap();
    assert_eq!(ok.children.len(), 1);
}

#[test]
fn compiled_code_is_cached_on_disk() {
    let dir = tempfile::tempdir().unwrap();
    let config = SandboxConfig {
        cache_dir: Some(dir.path().to_path_buf()),
        ..SandboxConfig::default()
    };
    let first = Sandbox::new(config.clone())
        .unwrap()
        .load_file_blocking(&plugin("uuid"))
        .unwrap();
    let entries = cache_entries(dir.path());
    assert_eq!(entries.len(), 1, "{entries:?}");
    let name = entries[0]
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    assert!(
        name.starts_with(first.sha256()) && name.ends_with(".cwasm"),
        "{name}"
    );
    // A second engine with the same settings loads from the cache and still works.
    let second = Sandbox::new(config)
        .unwrap()
        .load_file_blocking(&plugin("uuid"))
        .unwrap();
    assert_eq!(second.info(), first.info());
    // The code is mapped from a private copy: the entry truncated in place under a
    // loaded plugin (by someone else) neither crashes the host nor stops its calls.
    std::fs::File::create(dir.path().join(&name)).unwrap();
    let observed = Observed {
        parent: json!({"apiVersion": "demo.operator/v1", "kind": "Uuid",
            "metadata": {"name": "u", "namespace": "default", "uid": "uid-1", "generation": 1}}),
        children: vec![],
        related: Vec::new(),
    };
    let answer = second.reconcile_blocking(&observed).unwrap().unwrap();
    assert!(answer.status.is_some(), "{answer:?}");
    // A corrupt entry is ignored, not fatal.
    std::fs::write(dir.path().join(&name), b"garbage").unwrap();
    let config = SandboxConfig {
        cache_dir: Some(dir.path().to_path_buf()),
        ..SandboxConfig::default()
    };
    assert!(
        Sandbox::new(config)
            .unwrap()
            .load_file_blocking(&plugin("uuid"))
            .is_ok()
    );
}

/// Hostile: compiled code planted in the compile cache runs in the host, outside the
/// sandbox and past `--verify-key`. Each entry is sealed with a key the cache's writer
/// holds; code that does not carry that seal is compiled again, never loaded.
#[test]
fn code_planted_in_the_compile_cache_is_not_loaded() {
    let dir = tempfile::tempdir().unwrap();
    let config = SandboxConfig {
        cache_dir: Some(dir.path().to_path_buf()),
        ..SandboxConfig::default()
    };
    let load = |name: &str| {
        Sandbox::new(config.clone())
            .unwrap()
            .load_file_blocking(&test_plugin(name))
            .unwrap()
    };
    let widget = load("widget");
    let guard = load("guard");
    let entry_of = |sha: &str| {
        cache_entries(dir.path())
            .into_iter()
            .find(|e| e.file_name().unwrap().to_string_lossy().starts_with(sha))
            .unwrap()
    };
    let (widget_entry, guard_entry) = (entry_of(widget.sha256()), entry_of(guard.sha256()));
    // Sealed for another component: the guard's code under the widget's name.
    std::fs::copy(&guard_entry, &widget_entry).unwrap();
    assert_eq!(load("widget").info().name, "widget", "the planted code ran");
    // Unsealed code, as anyone with wasmtime can compile it.
    let guard_code = std::fs::read(&guard_entry).unwrap();
    std::fs::write(&widget_entry, &guard_code[..guard_code.len() - 40]).unwrap();
    assert_eq!(load("widget").info().name, "widget", "the planted code ran");
    // Sealed with another key: the guard's entry of another cache.
    let other = tempfile::tempdir().unwrap();
    let guard_elsewhere = Sandbox::new(SandboxConfig {
        cache_dir: Some(other.path().to_path_buf()),
        ..SandboxConfig::default()
    })
    .unwrap()
    .load_file_blocking(&test_plugin("guard"))
    .unwrap();
    let foreign = cache_entries(other.path())
        .into_iter()
        .find(|e| {
            e.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with(guard_elsewhere.sha256())
        })
        .unwrap();
    std::fs::copy(&foreign, &guard_entry).unwrap();
    assert_eq!(load("guard").info().name, "guard");
    assert_ne!(
        std::fs::read(&guard_entry).unwrap(),
        std::fs::read(&foreign).unwrap(),
        "the foreign entry was compiled over"
    );
    // And a well-sealed entry is loaded as it is: not compiled again.
    let sealed = std::fs::read(&guard_entry).unwrap();
    load("guard");
    assert_eq!(std::fs::read(&guard_entry).unwrap(), sealed);
}

/// A cache that others may write to, or whose key others may read, is not used: every
/// plugin compiles, and nothing is written to it.
#[test]
fn a_compile_cache_others_may_write_or_read_is_not_used() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = tempfile::tempdir().unwrap();
    let config = SandboxConfig {
        cache_dir: Some(dir.path().to_path_buf()),
        ..SandboxConfig::default()
    };
    let load = || {
        Sandbox::new(config.clone())
            .unwrap()
            .load_file_blocking(&test_plugin("widget"))
            .unwrap()
    };
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    load();
    assert!(
        cache_entries(dir.path()).is_empty(),
        "a world-writable cache was written"
    );
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    load();
    assert_eq!(cache_entries(dir.path()).len(), 1);
    let key = dir.path().join(".key");
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
    for entry in cache_entries(dir.path()) {
        std::fs::remove_file(entry).unwrap();
    }
    load();
    assert!(
        cache_entries(dir.path()).is_empty(),
        "a cache with a readable key was written"
    );
}

/// The `*.cwasm` entries of a compile cache directory.
fn cache_entries(dir: &std::path::Path) -> Vec<PathBuf> {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "cwasm"))
        .collect();
    entries.sort();
    entries
}

#[test]
fn precompiled_code_is_used_only_by_an_engine_it_was_compiled_for() {
    let plugins = tempfile::tempdir().unwrap();
    std::fs::copy(plugin("uuid"), plugins.path().join("uuid.wasm")).unwrap();
    std::fs::copy(plugin("postgresql"), plugins.path().join("postgresql.wasm")).unwrap();
    let precompiled = tempfile::tempdir().unwrap();
    let out = capstan(&[
        "precompile",
        plugins.path().to_str().unwrap(),
        precompiled.path().to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{out:?}");
    let entries = cache_entries(precompiled.path());
    assert_eq!(entries.len(), 2, "{entries:?}");
    let uuid = Sandbox::new(SandboxConfig::default())
        .unwrap()
        .load_file_blocking(&plugin("uuid"))
        .unwrap();
    let (uuid_entry, postgresql_entry) = match entries[0]
        .file_name()
        .unwrap()
        .to_string_lossy()
        .starts_with(uuid.sha256())
    {
        true => (entries[0].clone(), entries[1].clone()),
        false => (entries[1].clone(), entries[0].clone()),
    };
    // The PostgreSQL plugin's code under the Uuid plugin's name: a load of uuid.wasm
    // that answers as the PostgreSQL plugin took its code from the directory.
    std::fs::copy(&postgresql_entry, &uuid_entry).unwrap();
    let load = |cache: Option<&std::path::Path>, precompiled: &std::path::Path| {
        Sandbox::new(SandboxConfig {
            cache_dir: cache.map(|c| c.to_path_buf()),
            precompiled_dir: Some(precompiled.to_path_buf()),
            ..SandboxConfig::default()
        })
        .unwrap()
        .load_file_blocking(&plugin("uuid"))
        .unwrap()
    };
    let cache = tempfile::tempdir().unwrap();
    let seeded = load(Some(cache.path()), precompiled.path());
    assert_eq!(
        seeded.info().name,
        "postgresql",
        "taken from the precompiled dir"
    );
    // Copied into the cache, sealed with the cache's key (the seal is the last 40
    // bytes: an HMAC-SHA256 and the magic).
    let unsealed = |bytes: Vec<u8>| bytes[..bytes.len() - 40].to_vec();
    assert_eq!(
        unsealed(std::fs::read(cache.path().join(uuid_entry.file_name().unwrap())).unwrap()),
        unsealed(std::fs::read(&postgresql_entry).unwrap()),
        "copied into the cache"
    );
    // Without a cache, the code is read from the directory.
    assert_eq!(load(None, precompiled.path()).info().name, "postgresql");
    // Code of another engine (another wasmtime, compiler setting or CPU) has another
    // compatibility hash in its name: it is not found, and the plugin compiles.
    let other_engine = uuid_entry.to_string_lossy().replace(
        &format!("{}-", uuid.sha256()),
        &format!("{}-0", uuid.sha256()),
    );
    std::fs::rename(&uuid_entry, &other_engine).unwrap();
    let cache = tempfile::tempdir().unwrap();
    assert_eq!(
        load(Some(cache.path()), precompiled.path()).info(),
        uuid.info()
    );
    // Code that wasmtime refuses under the right name is ignored too.
    std::fs::write(&uuid_entry, b"garbage").unwrap();
    let cache = tempfile::tempdir().unwrap();
    assert_eq!(
        load(Some(cache.path()), precompiled.path()).info(),
        uuid.info()
    );
    assert_eq!(load(None, precompiled.path()).info(), uuid.info());
}

#[test]
fn a_describe_that_never_returns_is_refused_at_its_deadline() {
    let stall = test_plugin("stall");
    let started = std::time::Instant::now();
    assert_fails_with(
        &[
            "inspect",
            stall.to_str().unwrap(),
            "--plugin-timeout-ms",
            "300",
        ],
        "describe failed: plugin stall ran past its deadline of 300ms and was stopped",
    );
    let took = started.elapsed();
    eprintln!("a describe that sleeps for an hour was refused after {took:?}");
    // The guest sleeps for an hour. A minute is sixty times below that, and far above a
    // process start, a compile and a deadline, however busy the machine.
    assert!(took < Duration::from_secs(60), "refused after {took:?}");
}

#[test]
fn a_describe_that_changes_between_calls_is_taken_once_per_load() {
    // The plugin really is fickle: two loads see two answers.
    let versions: Vec<String> = (0..2)
        .map(|_| {
            let out = capstan(&["inspect", test_plugin("fickle").to_str().unwrap()]);
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            let info: Value = serde_yaml_ng::from_slice(&out.stdout).unwrap();
            info["version"].as_str().unwrap().to_string()
        })
        .collect();
    assert_ne!(versions[0], versions[1], "describe should vary");
    // One load is one answer: every call of that loaded version is held to it.
    let plugin = sandbox()
        .load_file_blocking(&test_plugin("fickle"))
        .unwrap();
    let declared_secrets = plugin.info().children.iter().any(|k| k.kind == "Secret");
    let parent = json!({"apiVersion": "test.capstan.dev/v1", "kind": "Fickle",
        "metadata": {"name": "f", "namespace": "ns", "uid": "u", "generation": 1}});
    for _ in 0..5 {
        let rendered = render::render(
            &plugin,
            &Observed {
                parent: parent.clone(),
                children: vec![],
                related: Vec::new(),
            },
            "t",
        );
        match (&rendered, declared_secrets) {
            (Ok(r), true) => assert_eq!(r.plan.children.len(), 2),
            (Err(e), false) => assert!(
                e.to_string().contains(
                    "child Secret.v1 \"f-secret\" is of a kind the plugin did not declare"
                ),
                "{e}"
            ),
            _ => panic!(
                "declared Secrets at load: {declared_secrets}, yet render gave {:?}",
                rendered.map(|r| r.plan.children.len())
            ),
        }
    }
}

#[test]
fn a_pool_no_larger_than_one_plugins_concurrency_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    assert_fails_with(
        &[
            "run",
            "--plugins",
            dir.path().to_str().unwrap(),
            "--concurrency",
            "8",
            "--plugin-instances",
            "8",
        ],
        "--plugin-instances 8 must be larger than --concurrency 8",
    );
}

/// The blocking calls, made from async code (where running a runtime in place panics),
/// answer like the async ones; the async load gives the same plugin as the blocking one.
#[tokio::test]
async fn blocking_calls_from_async_code_answer_instead_of_panicking() {
    let sandbox = sandbox();
    let blocking = sandbox
        .load_file_blocking(&test_plugin("widget"))
        .expect("a blocking load from a runtime's thread");
    let loaded = sandbox.load_file(&test_plugin("widget")).await.unwrap();
    assert_eq!(loaded.sha256(), blocking.sha256());
    assert_eq!(loaded.info(), blocking.info());
    let observed = widget_observed("");
    let from_blocking = blocking.reconcile_blocking(&observed).unwrap().unwrap();
    let from_async = loaded.reconcile_async(&observed).await.unwrap().unwrap();
    assert_eq!(from_blocking.children.len(), 1);
    assert_eq!(from_blocking.children, from_async.children);
    let finalized = blocking.finalize_blocking(&observed);
    assert!(finalized.is_ok(), "{finalized:?}");
    assert_eq!(finalized, loaded.finalize_async(&observed).await);
}
