//! The hostile-plugin suite under `capstan run` on the real local control plane: one
//! parent per misbehaviour of the test plugin `widget`, all at once, beside a
//! well-behaved neighbour plugin. For each: the host keeps serving, the parent says in
//! one line what happened (a `Ready` condition and a Warning event), nothing is written
//! for refused output, and the neighbour's reconciles are not starved: the ratio of its
//! median latency beside the hostile plugin to its median alone is printed against the
//! goal of 1.5 (the plugins' CPU shares and the sandbox's lower priority), and bounded. Plugins whose
//! `describe` misbehaves are loaded beside them. And a plugin's own limits file sets its
//! limits, and reloads with it.

use std::time::{Duration, Instant};

use capstan_e2e::objects::{create_object, events_about, ready_condition, test_kind, uuid_kind};
use capstan_e2e::operator::{Operator, plugin, test_plugin};
use capstan_e2e::{TestNamespace, client, holds_for, wait_for};
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::{Api, DynamicObject};
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(90);
const DEADLINE: &str = "plugin widget ran past its deadline of 1s and was stopped";
const MEMORY: &str = "plugin widget exceeded its memory cap of 32 MiB and was stopped";
/// The goal for the neighbour's median latency beside the hostile plugin over its median
/// alone (docs/sandbox.md, "CPU"): printed against the measure, not asserted.
const NEIGHBOUR_GOAL: f64 = 1.5;
/// The bound asserted: a starved neighbour (seconds) is far above it, and no burst of
/// outside load on a shared machine reaches it (see the assertion).
const NEIGHBOUR_BOUND: f64 = 4.0;

/// What a parent in `mode` must end up saying: `Ready` status, then the (reason,
/// message fragment) pairs it may show — more than one where two limits race (a huge
/// output may hit the memory cap before the host's output limit sees it).
struct Case {
    mode: &'static str,
    ready: &'static str,
    outcomes: &'static [(&'static str, &'static str)],
}

const CASES: &[Case] = &[
    // Time: stopped at the deadline whatever the guest does.
    Case {
        mode: "loop",
        ready: "False",
        outcomes: &[("PluginFailed", DEADLINE)],
    },
    Case {
        mode: "sleep",
        ready: "False",
        outcomes: &[("PluginFailed", DEADLINE)],
    },
    Case {
        mode: "clock-poll",
        ready: "False",
        outcomes: &[("PluginFailed", DEADLINE)],
    },
    // Memory and stack.
    Case {
        mode: "oom",
        ready: "False",
        outcomes: &[("PluginFailed", MEMORY)],
    },
    Case {
        mode: "huge-alloc",
        ready: "False",
        outcomes: &[("PluginFailed", MEMORY)],
    },
    Case {
        mode: "stack",
        ready: "False",
        outcomes: &[("PluginFailed", "plugin widget crashed: wasm trap")],
    },
    Case {
        mode: "trap",
        ready: "False",
        outcomes: &[(
            "PluginFailed",
            "plugin widget crashed: wasm trap: wasm `unreachable`",
        )],
    },
    Case {
        mode: "panic",
        ready: "False",
        outcomes: &[(
            "PluginFailed",
            "plugin widget panicked: widget asked to panic",
        )],
    },
    // Output the host refuses before writing anything.
    Case {
        mode: "many-children",
        ready: "False",
        outcomes: &[
            ("InvalidPluginOutput", "over the limit of 256"),
            ("PluginFailed", MEMORY),
        ],
    },
    Case {
        mode: "big-status",
        ready: "False",
        outcomes: &[
            ("InvalidPluginOutput", "over the limit of 262144"),
            ("PluginFailed", MEMORY),
        ],
    },
    Case {
        mode: "nested-json",
        ready: "False",
        outcomes: &[("InvalidPluginOutput", "recursion limit exceeded")],
    },
    Case {
        mode: "undeclared-kind",
        ready: "False",
        outcomes: &[(
            "InvalidPluginOutput",
            "is of a kind the plugin did not declare",
        )],
    },
    Case {
        mode: "other-namespace",
        ready: "False",
        outcomes: &[("InvalidPluginOutput", "is in namespace \"kube-system\"")],
    },
    Case {
        mode: "foreign-owner",
        ready: "False",
        outcomes: &[(
            "InvalidPluginOutput",
            "has an ownerReference to Secret someone-else",
        )],
    },
    // What the sandbox grants nothing of: each attempt fails inside the plugin, which
    // reports it as an invalid spec.
    Case {
        mode: "file",
        ready: "False",
        outcomes: &[("InvalidSpec", "file read: refused")],
    },
    Case {
        mode: "socket",
        ready: "False",
        outcomes: &[("InvalidSpec", "socket connect: refused")],
    },
    Case {
        mode: "env",
        ready: "False",
        outcomes: &[("InvalidSpec", "environment: 0 variables, 0 arguments")],
    },
    // Harmless once bounded: the call goes on and succeeds.
    Case {
        mode: "stdin",
        ready: "True",
        outcomes: &[("Reconciled", "")],
    },
    Case {
        mode: "flood",
        ready: "True",
        outcomes: &[("Reconciled", "")],
    },
];

/// Creates `n` Uuid parents one after the other and returns, for each, the time from
/// its creation until its UUID is set (polled every 5 ms: against latencies of 20-40 ms,
/// a coarser poll would make the ratio below mostly a count of poll steps).
async fn uuid_latencies(api: &Api<DynamicObject>, prefix: &str, n: usize) -> Vec<Duration> {
    let mut latencies = Vec::new();
    for i in 0..n {
        let name = format!("{prefix}-{i}");
        let started = Instant::now();
        create_object(api, &uuid_kind(), &name, json!({})).await;
        loop {
            let obj = api.get(&name).await.unwrap();
            if obj.data.pointer("/status/uuid").is_some() {
                break;
            }
            assert!(started.elapsed() < T, "{name} never got a UUID");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        latencies.push(started.elapsed());
    }
    latencies
}

/// CPU time (user and system) the operator's process has used so far.
fn process_cpu(op: &Operator) -> Duration {
    let pid = op.pid().expect("the operator runs");
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name (which may hold spaces): utime and stime are the
    // 14th and 15th of the line, in clock ticks (100 per second on Linux).
    let after_name = stat.rsplit_once(')').unwrap().1;
    let fields: Vec<u64> = after_name
        .split_whitespace()
        .skip(11)
        .take(2)
        .map(|f| f.parse().unwrap())
        .collect();
    Duration::from_millis((fields[0] + fields[1]) * 10)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn plugin_state<'a>(states: &'a [Value], file: &str) -> &'a Value {
    states
        .iter()
        .find(|s| s["file"].as_str().is_some_and(|f| f.ends_with(file)))
        .unwrap_or_else(|| panic!("{file} is not in /plugins: {states:?}"))
}

#[tokio::test]
async fn every_hostile_plugin_is_stopped_reported_and_does_not_slow_its_neighbour() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "hostile").await;
    let op = Operator::start(
        &ns.name,
        &[
            &plugin("uuid"),
            &test_plugin("widget"),
            &test_plugin("stall"),
            &test_plugin("fickle"),
        ],
        &["--plugin-timeout-ms", "1000", "--plugin-memory-mib", "32"],
    )
    .await;
    let uuids = Api::<DynamicObject>::namespaced_with(client.clone(), &ns.name, &uuid_kind());
    let widgets_kind = test_kind("Widget", "widgets");
    let widgets = Api::<DynamicObject>::namespaced_with(client.clone(), &ns.name, &widgets_kind);
    let config_maps = Api::<ConfigMap>::namespaced(client.clone(), &ns.name);
    // Warm up (CRDs installed, caches synced), then the neighbour's baseline.
    uuid_latencies(&uuids, "warm", 2).await;
    let before = median(uuid_latencies(&uuids, "before", 15).await);

    // One parent per misbehaviour, and more that sleep or spin than the plugin's
    // concurrency, so that all its slots are taken again and again.
    let mut stallers = Vec::new();
    for i in 1..4 {
        stallers.push((format!("sleep-{i}"), "sleep"));
        stallers.push((format!("loop-{i}"), "loop"));
    }
    let cases = CASES.iter().map(|case| (case.mode.to_string(), case.mode));
    for (name, mode) in cases.chain(stallers.iter().cloned()) {
        create_object(
            &widgets,
            &widgets_kind,
            &name,
            json!({"mode": mode, "count": 1}),
        )
        .await;
    }
    // A well-behaved parent of the same plugin, queued behind the sleepers.
    let queued_at = Instant::now();
    create_object(&widgets, &widgets_kind, "patient", json!({"count": 1})).await;
    // The hostile calls are running: every one of the plugin's 4 (--concurrency) at once.
    let running = "capstan_plugin_calls_running{plugin=\"widget\"}";
    wait_for("4 hostile calls running at once", T, || async {
        Ok((op.counter(running).await? >= 4).then_some(()))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
    let (cpu_before, window) = (process_cpu(&op), Instant::now());
    let during = median(uuid_latencies(&uuids, "during", 15).await);
    let hostile_cores =
        (process_cpu(&op) - cpu_before).as_secs_f64() / window.elapsed().as_secs_f64();
    let still_running = op.counter(running).await.unwrap();
    let ratio = during.as_secs_f64() / before.as_secs_f64();
    let verdict = if ratio <= NEIGHBOUR_GOAL {
        "ok"
    } else {
        "OVER"
    };
    eprintln!(
        "neighbour median reconcile latency: {before:?} alone, {during:?} beside the hostile plugin (ratio {ratio:.2}, goal {NEIGHBOUR_GOAL}: {verdict}); the host used {hostile_cores:.2} cores meanwhile, {still_running} hostile calls still running at the end"
    );
    assert!(
        still_running >= 1,
        "the hostile load stopped during the measurement"
    );
    // Two medians of 15 latencies of 10-30 ms, a few seconds apart, on a machine whose
    // other load may change in between: measured with and without the CPU shares on two
    // cores shared with other builds, every ratio was 0.57-1.34, and the two could not
    // be told apart there; the goal is printed above, the bound asserted is loose.
    assert!(
        ratio <= NEIGHBOUR_BOUND,
        "the neighbour slowed from {before:?} to {during:?} (ratio {ratio:.2})\n{}",
        op.log_tail()
    );
    // The sleepers hold a slot for one deadline each, then back off: the patient parent
    // is served within a few deadlines, not after the sleepers wake (30 s).
    wait_for("the patient widget to be Ready", T, || async {
        let o = widgets.get("patient").await?;
        Ok(ready_condition(&o).filter(|r| r.0 == "True"))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
    let waited = queued_at.elapsed();
    eprintln!("a good parent queued behind 7 sleeping or spinning ones was Ready after {waited:?}");
    assert!(
        waited < Duration::from_secs(15),
        "the good parent waited {waited:?}"
    );

    // Each hostile parent says, in one line, what happened, and gets a Warning event.
    for case in CASES {
        let name = case.mode;
        let (status, reason, message) =
            wait_for(&format!("{name}: Ready={}", case.ready), T, || async {
                let o = widgets.get(name).await?;
                Ok(ready_condition(&o).filter(|r| r.0 == case.ready))
            })
            .await
            .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
        assert!(
            case.outcomes
                .iter()
                .any(|(r, m)| reason == *r && message.contains(m)),
            "{name}: Ready={status} {reason}: {message:?}, expected one of {:?}",
            case.outcomes
        );
        assert_eq!(message.lines().count().max(1), 1, "{name}: {message:?}");
        for noise in ["backtrace", "wasm function", "panicked at"] {
            assert!(!message.contains(noise), "{name}: {message:?}");
        }
        let child = config_maps.get_opt(&format!("{name}-0")).await.unwrap();
        if case.ready == "True" {
            assert!(child.is_some(), "{name}: its ConfigMap was not applied");
            continue;
        }
        // The event is posted after the condition is written: give it a moment.
        let mut warned = false;
        for _ in 0..100 {
            warned = !events_about(&client, &ns.name, name, "Warning", &reason)
                .await
                .is_empty();
            if warned {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(warned, "{name}: no Warning event {reason} within 10 s");
        // Refused or failed: nothing at all was written for it.
        assert!(child.is_none(), "{name}: a child was written: {child:?}");
    }
    // The extra sleepers and spinners are stopped at the deadline too, each of them:
    // every one that waited for a slot is called and stopped in its turn.
    for (name, mode) in &stallers {
        let (_, reason, message) = wait_for(&format!("{name}: Ready=False"), T, || async {
            let o = widgets.get(name).await?;
            Ok(ready_condition(&o).filter(|r| r.0 == "False"))
        })
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
        assert!(
            reason == "PluginFailed" && message.contains(DEADLINE),
            "{name} ({mode}): {reason}: {message:?}"
        );
    }
    // The refused children were not written anywhere else either.
    let secrets = Api::<Secret>::namespaced(client.clone(), &ns.name);
    assert!(
        secrets
            .get_opt("undeclared-kind-secret")
            .await
            .unwrap()
            .is_none()
    );
    assert!(
        config_maps
            .get_opt("foreign-owner-owned")
            .await
            .unwrap()
            .is_none()
    );
    let kube_system = Api::<ConfigMap>::namespaced(client.clone(), "kube-system");
    assert!(
        kube_system
            .get_opt("other-namespace-elsewhere")
            .await
            .unwrap()
            .is_none()
    );

    // The host kept serving throughout, and counted what happened.
    let states = op.plugin_states().await.unwrap();
    let widget = plugin_state(&states, "widget.wasm");
    let calls = &widget["sandbox"]["calls"];
    // One stopped call at least for each parent that sleeps, spins or polls the clock
    // (every one has said so above, after its call was counted).
    let stalling = CASES
        .iter()
        .filter(|c| c.outcomes == [("PluginFailed", DEADLINE)])
        .count()
        + stallers.len();
    assert!(
        calls["deadline"].as_u64().unwrap_or(0) >= stalling as u64,
        "{widget}"
    );
    assert!(calls["memory"].as_u64().unwrap_or(0) >= 2, "{widget}");
    assert!(
        widget["sandbox"]["outputDroppedBytes"]
            .as_u64()
            .unwrap_or(0)
            > 9 << 20,
        "the flood's excess is dropped and counted: {widget}"
    );
    assert!(
        op.metrics()
            .await
            .unwrap()
            .contains("capstan_plugin_output_dropped_bytes_total{plugin=\"widget\"}"),
        "the drop shows in /metrics"
    );
    uuid_latencies(&uuids, "after", 1).await;

    // A describe that never returns: refused at load within its deadline, not serving.
    let stall = plugin_state(&states, "stall.wasm");
    assert_eq!(stall["serving"], false, "{stall}");
    assert!(
        stall["error"].as_str().is_some_and(
            |e| e.contains("describe failed: plugin stall ran past its deadline of 1s")
        ),
        "{stall}"
    );

    // A describe that changes between calls: the host asked once, and holds the loaded
    // version to that answer for as long as its bytes stay the same.
    let fickle = plugin_state(&states, "fickle.wasm").clone();
    let declared_secrets = fickle["children"]
        .as_array()
        .unwrap()
        .iter()
        .any(|k| k.as_str().is_some_and(|k| k.starts_with("Secret.")));
    let fickles_kind = test_kind("Fickle", "fickles");
    let fickles = Api::<DynamicObject>::namespaced_with(client.clone(), &ns.name, &fickles_kind);
    create_object(&fickles, &fickles_kind, "f", json!({})).await;
    let expected = if declared_secrets { "True" } else { "False" };
    let (_, reason, message) = wait_for(&format!("fickle: Ready={expected}"), T, || async {
        let o = fickles.get("f").await?;
        Ok(ready_condition(&o).filter(|r| r.0 == expected))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
    let config = config_maps.get_opt("f-config").await.unwrap();
    let secret = secrets.get_opt("f-secret").await.unwrap();
    if declared_secrets {
        assert!(config.is_some() && secret.is_some());
    } else {
        assert_eq!(reason, "InvalidPluginOutput", "{message}");
        assert!(message.contains("did not declare"), "{message}");
        assert!(config.is_none() && secret.is_none(), "nothing written");
    }
    holds_for(
        "fickle's loaded version to stay",
        Duration::from_secs(3),
        || async {
            let states = op.plugin_states().await?;
            Ok(plugin_state(&states, "fickle.wasm")["version"] == fickle["version"])
        },
    )
    .await
    .unwrap();
}

/// Writes `text` as the limits file of the widget plugin in `op`'s directory, atomically.
fn write_limits(op: &Operator, text: &str) {
    let tmp = op.plugins.path().join(".widget.toml.tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, op.plugins.path().join("widget.toml")).unwrap();
}

/// Waits until the operator logged that it set a plugin's limits `n` times.
async fn limits_set(op: &Operator, n: usize) {
    wait_for(&format!("limits set {n} times"), T, || async {
        Ok((op.log().matches("plugin limits set").count() >= n).then_some(()))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
}

/// Creates a widget that sleeps in every call, and returns the message of its `Ready`
/// condition once it says the call ran past a deadline of `deadline`.
async fn sleeper_stopped_at(
    op: &Operator,
    widgets: &Api<DynamicObject>,
    name: &str,
    deadline: &str,
) -> String {
    let kind = test_kind("Widget", "widgets");
    create_object(widgets, &kind, name, json!({"mode": "sleep", "count": 1})).await;
    let expected = format!("plugin widget ran past its deadline of {deadline} and was stopped");
    wait_for(&format!("{name}: {expected}"), T, || async {
        let o = widgets.get(name).await?;
        Ok(ready_condition(&o)
            .filter(|(status, _, message)| status == "False" && message.contains(&expected)))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
    expected
}

#[tokio::test]
async fn a_plugins_limits_file_sets_its_limits_and_reloads_with_it() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "limits").await;
    // The flags' deadline is 5 s; the plugin's own file asks for less.
    let op = Operator::start(
        &ns.name,
        &[&test_plugin("widget")],
        &["--plugin-timeout-ms", "5000"],
    )
    .await;
    let widgets_kind = test_kind("Widget", "widgets");
    let widgets = Api::<DynamicObject>::namespaced_with(client.clone(), &ns.name, &widgets_kind);

    write_limits(
        &op,
        "# the widget answers fast, or not at all\ntimeout-ms = 300\n",
    );
    limits_set(&op, 1).await;
    sleeper_stopped_at(&op, &widgets, "sleeper-1", "300ms").await;

    // A bad file: one readable error in /plugins, the plugin serving under the limits
    // it had.
    write_limits(&op, "timeout-ms = \"soon\"\n");
    let error = wait_for("the bad limits file to be reported", T, || async {
        let states = op.plugin_states().await?;
        let widget = plugin_state(&states, "widget.wasm");
        Ok(widget["error"]
            .as_str()
            .map(String::from)
            .filter(|_| widget["serving"] == true))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
    assert!(error.starts_with("limits not changed: "), "{error}");
    assert!(
        error.contains(
            "widget.toml is not a limits file: invalid type: string \"soon\", expected u64"
        ),
        "{error}"
    );
    assert_eq!(error.lines().count(), 1, "{error}");
    sleeper_stopped_at(&op, &widgets, "sleeper-2", "300ms").await;

    // Fixed: the new limits apply, and the error is gone.
    write_limits(&op, "timeout-ms = 700\n");
    limits_set(&op, 2).await;
    let states = op.plugin_states().await.unwrap();
    assert!(
        plugin_state(&states, "widget.wasm")["error"].is_null(),
        "{states:?}"
    );
    sleeper_stopped_at(&op, &widgets, "sleeper-3", "700ms").await;
}
