//! Leader election on the real control plane: a leader frozen (SIGSTOP) across its lease
//! expiry while it writes, then woken (SIGCONT), sends no write after the new leader's
//! first, not even one that had passed its checks when it froze: the controllers' client
//! asks the write fence again just before a request leaves (`operator::fenced_client`).
//! Writes are attributed to a replica through the API server's audit log (each replica's
//! user agent names it).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use capstan_e2e::control_plane::{AuditEvent, ControlPlane};
use capstan_e2e::objects::{create_object, test_kind};
use capstan_e2e::operator::{Operator, test_plugin};
use capstan_e2e::{in_test_namespace, wait_for};
use futures::StreamExt;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use serde_json::json;

const LEASE_SECONDS: u64 = 3;
const WIDGETS: usize = 60;
const WRITE_VERBS: [&str; 5] = ["create", "update", "patch", "delete", "deletecollection"];

#[tokio::test]
async fn a_leader_frozen_across_its_lease_expiry_writes_nothing_after_the_takeover() {
    in_test_namespace("leader", Duration::from_secs(120), async |client, ns| {
        run(&client, &ns).await
    })
    .await
    .unwrap();
}

async fn run(client: &Client, ns: &str) -> Result<()> {
    let control_plane = ControlPlane::from_env();
    let widget = test_plugin("widget");
    let plugins = [widget.as_path()];
    let election = [
        "--leader-elect",
        "--leader-election-namespace",
        ns,
        "--lease-duration-seconds",
        &LEASE_SECONDS.to_string(),
        "--concurrency",
        "8",
    ];
    let (id_a, id_b) = (format!("{ns}-a"), format!("{ns}-b"));
    let mut leader = Operator::start_replica(&id_a, ns, &plugins, &election).await;
    await_leader(&leader, "the first replica to lead").await?;
    let standby = Operator::start_replica(&id_b, ns, &plugins, &election).await;

    // The leader is kept busy: widgets are created, then patched round after round.
    let kind = test_kind("Widget", "widgets");
    let api = Api::<DynamicObject>::namespaced_with(client.clone(), ns, &kind);
    for w in 0..WIDGETS {
        let spec = json!({"count": 2, "message": "v0"});
        create_object(&api, &kind, &format!("w-{w:03}"), spec).await;
    }
    let stop = Arc::new(AtomicBool::new(false));
    let patched = Arc::new(AtomicUsize::new(0));
    let patching = tokio::spawn(patch_rounds(api.clone(), stop.clone(), patched.clone()));
    wait_for("a round of patches", Duration::from_secs(60), || {
        let n = patched.load(Ordering::SeqCst);
        async move { Ok((n >= WIDGETS).then_some(())) }
    })
    .await?;

    let paused_at = Timestamp::now();
    leader.pause();
    await_leader(&standby, "the standby to take over").await?;
    // The new leader writes while the old one is still frozen; then the old one wakes.
    let first_write = wait_for(
        "the new leader's first write",
        Duration::from_secs(60),
        || async {
            let events = control_plane.audit_events(ns)?;
            Ok(first_write_after_takeover(&events, ns, &id_b, paused_at))
        },
    )
    .await?;
    leader.resume();
    let exited = wait_for(
        "the deposed leader to exit",
        Duration::from_secs(30),
        || {
            let status = leader.exit_status();
            async move { Ok(status) }
        },
    )
    .await
    .with_context(|| leader.log_tail())?;
    stop.store(true, Ordering::SeqCst);
    patching.await??;
    // The new leader keeps writing after the old one woke and left.
    let rounds_after = patched.load(Ordering::SeqCst);
    wait_for(
        "the new leader to write again",
        Duration::from_secs(60),
        || async {
            let events = control_plane.audit_events(ns)?;
            let after = events
                .iter()
                .filter(|e| is_write(e) && e.by_replica(&id_b) && !is_lease(e, ns))
                .filter(|e| e.received().is_some_and(|t| t > first_write))
                .count();
            Ok((after > 0).then_some(()))
        },
    )
    .await?;

    let events = control_plane.audit_events(ns)?;
    let before_pause = events
        .iter()
        .filter(|e| is_write(e) && e.by_replica(&id_a) && !is_lease(e, ns))
        .filter(|e| e.received().is_some_and(|t| t < paused_at))
        .count();
    let deposed: Vec<String> = events
        .iter()
        .filter(|e| is_write(e) && e.by_replica(&id_a))
        .filter(|e| e.received().is_some_and(|t| t >= first_write))
        // A Lease update refused with 409 is a lost compare-and-swap: it wrote nothing.
        .filter(|e| !(is_lease(e, ns) && e.code() == 409))
        .map(|e| {
            let r = &e.object_ref;
            format!(
                "{} {}/{} {} -> {} at {}",
                e.verb,
                r.resource,
                r.name,
                r.subresource,
                e.code(),
                e.request_received_timestamp
            )
        })
        .collect();
    // Writes the client's fence refused on waking (logged when a reconcile fails): how
    // often this run froze a write between the pipeline's check and the wire.
    let refused = leader
        .log()
        .lines()
        .filter(|l| l.contains("no longer holds its lease"))
        .count();
    println!(
        "leader {id_a}: {before_pause} writes before its pause, exited ({exited}) after waking, \
         {refused} log lines of writes refused by the client's fence; new leader's first write \
         at {first_write}; {rounds_after} widget patches by the test; writes of the deposed \
         leader after it: {}",
        deposed.len()
    );
    ensure!(
        before_pause > 0,
        "the frozen leader wrote nothing before its pause: the check proves nothing"
    );
    ensure!(
        deposed.is_empty(),
        "the deposed leader wrote after the new leader's first write:\n{}",
        deposed.join("\n")
    );
    drop(standby);
    Ok(())
}

/// Sets every widget's `spec.message` to a new value, round after round, until `stop`.
async fn patch_rounds(
    api: Api<DynamicObject>,
    stop: Arc<AtomicBool>,
    patched: Arc<AtomicUsize>,
) -> Result<()> {
    let mut round = 0;
    while !stop.load(Ordering::SeqCst) {
        round += 1;
        futures::stream::iter(0..WIDGETS)
            .for_each_concurrent(4, |w| {
                let (api, patched) = (api.clone(), patched.clone());
                async move {
                    let patch = Patch::Merge(json!({"spec": {"message": format!("v{round}")}}));
                    // A refused patch (an API server busy with two replicas) is skipped:
                    // the next round writes the widget again.
                    if api
                        .patch(&format!("w-{w:03}"), &PatchParams::default(), &patch)
                        .await
                        .is_ok()
                    {
                        patched.fetch_add(1, Ordering::SeqCst);
                    }
                }
            })
            .await;
    }
    Ok(())
}

/// Waits until `op` says it leads (`capstan_leader 1`).
async fn await_leader(op: &Operator, what: &str) -> Result<()> {
    wait_for(
        what,
        Duration::from_secs(LEASE_SECONDS * 5 + 30),
        || async { Ok((op.counter("capstan_leader").await? == 1).then_some(())) },
    )
    .await
    .with_context(|| op.log_tail())
}

fn is_write(e: &AuditEvent) -> bool {
    WRITE_VERBS.contains(&e.verb.as_str())
}

fn is_lease(e: &AuditEvent, ns: &str) -> bool {
    e.object_ref.resource == "leases" && e.object_ref.namespace == ns
}

/// When the API server received the first successful non-Lease write of `new_leader`
/// after its first successful Lease write after `paused_at` (the takeover).
fn first_write_after_takeover(
    events: &[AuditEvent],
    ns: &str,
    new_leader: &str,
    paused_at: Timestamp,
) -> Option<Timestamp> {
    let ok = |e: &&AuditEvent| (200..300).contains(&e.code());
    let takeover = events
        .iter()
        .filter(|e| is_write(e) && e.by_replica(new_leader) && is_lease(e, ns))
        .filter(ok)
        .filter_map(AuditEvent::received)
        .find(|t| *t >= paused_at)?;
    events
        .iter()
        .filter(|e| is_write(e) && e.by_replica(new_leader) && !is_lease(e, ns))
        .filter(ok)
        .filter_map(AuditEvent::received)
        .find(|t| *t >= takeover)
}
