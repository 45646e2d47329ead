//! Per-plugin limits through the library: what a plugin's limits file sets (its
//! deadline, memory cap, concurrency and CPU share) holds its calls, with the test plugin
//! `widget` misbehaving on purpose.

mod common;

use std::time::{Duration, Instant};

use capstan::plugin::{CallError, LimitsFile};
use common::{thread_cpu, widget_observed, widget_with_deadline};

#[test]
fn a_plugins_own_deadline_and_memory_cap_hold_its_calls() {
    let plugin = widget_with_deadline(Duration::from_secs(5));
    plugin.set_limits(LimitsFile {
        timeout_ms: Some(300),
        memory_mib: Some(16),
        ..LimitsFile::default()
    });
    match plugin.reconcile_blocking(&widget_observed("loop")) {
        Err(CallError::Deadline { deadline, .. }) => {
            assert_eq!(deadline, Duration::from_millis(300))
        }
        other => panic!("{other:?}"),
    }
    match plugin.reconcile_blocking(&widget_observed("oom")) {
        Err(CallError::MemoryCap { limit_mib, .. }) => assert_eq!(limit_mib, 16),
        other => panic!("{other:?}"),
    }
    // Back to the flags' limits.
    plugin.set_limits(LimitsFile::default());
    match plugin.reconcile_blocking(&widget_observed("oom")) {
        Err(CallError::MemoryCap { limit_mib, .. }) => assert_eq!(limit_mib, 64),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_plugins_concurrency_makes_its_calls_take_turns() {
    let plugin = widget_with_deadline(Duration::from_millis(300));
    plugin.set_limits(LimitsFile {
        concurrency: Some(1),
        ..LimitsFile::default()
    });
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let started = Instant::now();
    let (a, b) = runtime.block_on(async {
        let sleep = widget_observed("sleep");
        tokio::join!(
            plugin.reconcile_async(&sleep),
            plugin.reconcile_async(&sleep)
        )
    });
    let took = started.elapsed();
    assert!(matches!(a, Err(CallError::Deadline { .. })), "{a:?}");
    assert!(matches!(b, Err(CallError::Deadline { .. })), "{b:?}");
    // One after the other, each to its deadline (waiting for the turn is outside it):
    // at least two deadlines, whatever the machine's load. At once, one deadline.
    assert!(
        took >= Duration::from_millis(600),
        "both ended after {took:?}"
    );
}

#[test]
fn a_cpu_share_holds_a_spinning_plugin_to_its_share() {
    let deadline = Duration::from_secs(1);
    let plugin = widget_with_deadline(deadline);
    plugin.set_limits(LimitsFile {
        cpu: Some(0.02),
        ..LimitsFile::default()
    });
    let before = thread_cpu();
    let result = plugin.reconcile_blocking(&widget_observed("loop"));
    let used = thread_cpu() - before;
    assert!(
        matches!(result, Err(CallError::Deadline { .. })),
        "{result:?}"
    );
    // A fiftieth of a core for one second, plus the 2 ms it had banked and the slice
    // that overdrew it (an epoch tick, 10 ms): some 35 ms of CPU. Unshared, it spins
    // for the whole second.
    eprintln!("a call spinning for {deadline:?} at a share of 0.02 cores used {used:?} of CPU");
    assert!(used < Duration::from_millis(300), "it used {used:?}");
}
