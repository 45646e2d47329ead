//! Fault injection on the real local control plane. 2000 Uuid parents, 200 Widget parents
//! with two ConfigMaps each and a few PostgreSQLClusters are created while capstan is
//! SIGKILLed three times and the API server is restarted; then two replicas run under
//! leader election and the leader is SIGSTOPped past its lease, while it works, and
//! resumed; then children are edited and deleted by hand. The guarantees are counted
//! (parents lost, generated values changed, duplicate or replaced children, writes by the
//! deposed leader, hand-made changes not undone), printed as a table and asserted zero.
//!
//! Writes are attributed to a process through the API server's audit log: each replica
//! has its own identity, which its user agent carries. See docs/operator.md#faults.

use std::collections::{BTreeSet, HashMap};
use std::fmt::Debug;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use capstan_e2e::control_plane::{AuditEvent, ControlPlane, await_api_ready};
use capstan_e2e::fleet::{self, Fleet, Survey, WIDGET_LABEL, retried, widget_kind};
use capstan_e2e::objects::{postgres_kind, test_kind, uuid_kind};
use capstan_e2e::operator::{Operator, plugin, test_plugin};
use capstan_e2e::{in_kwok_namespace, in_test_namespace, wait_for};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use k8s_openapi::jiff::Timestamp;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams,
};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tokio::task::JoinHandle;

const UUIDS: usize = 2000;
const WIDGETS: usize = 200;
const POSTGRES: usize = 4;
/// Widget spec `count`: ConfigMaps `<name>-0` and `<name>-1`.
const CHILDREN: usize = 2;
/// When, as a share of the batch created, capstan is killed; the API server restarts last.
const KILLS_AT: [f64; 3] = [0.15, 0.35, 0.55];
const API_RESTART_AT: f64 = 0.75;
const LEASE_SECONDS: u64 = 4;
/// Widgets whose `-0` child is edited and whose `-1` child is deleted by hand.
const HAND_EDITS: usize = 10;
/// Requests the test's own client has in flight at once.
const IN_FLIGHT: usize = 8;
/// Bound of each wait for every parent to converge.
const CONVERGE: Duration = Duration::from_secs(300);
/// How long one request is retried through restarts.
const RETRY: Duration = Duration::from_secs(120);
/// Bound of the wait for one hand-made change to be undone.
const RESTORE: Duration = Duration::from_secs(30);

fn plugins() -> Vec<std::path::PathBuf> {
    vec![plugin("uuid"), test_plugin("widget"), plugin("postgresql")]
}

#[tokio::test]
async fn parents_survive_kills_restarts_and_a_paused_leader() {
    let started = Instant::now();
    let control_plane = ControlPlane::from_env();
    let report = in_kwok_namespace("faults", Duration::from_secs(300), async |client, ns| {
        run(&control_plane, &client, &ns).await
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    let client = capstan_e2e::client().await;
    await_api_ready(&client, Duration::from_secs(60))
        .await
        .expect("the API server is left healthy");
    report.print(started.elapsed());
    report.assert_all_zero();
}

/// Guard parents of the finalizer release case.
const GUARDS: usize = 200;
/// The host's finalizer.
const FINALIZER: &str = "capstan.dev/finalizer";

/// A finalizer plugin's file is removed while the API server restarts, so that the
/// release of its finalizers is interrupted; then every one of its parents is deleted,
/// and every deletion completes (none waits for a finalizer nobody will remove).
#[tokio::test]
async fn deletions_complete_after_a_finalizer_plugin_is_removed_during_an_api_restart() {
    let control_plane = ControlPlane::from_env();
    in_test_namespace(
        "finalizers",
        Duration::from_secs(300),
        async |client, ns| release_during_restart(&control_plane, &client, &ns).await,
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    let client = capstan_e2e::client().await;
    await_api_ready(&client, Duration::from_secs(60))
        .await
        .expect("the API server is left healthy");
}

async fn release_during_restart(
    control_plane: &ControlPlane,
    client: &Client,
    ns: &str,
) -> Result<()> {
    let guard = test_plugin("guard");
    let op = Operator::start(ns, &[guard.as_path()], &["--concurrency", "8"]).await;
    let api = Api::<DynamicObject>::namespaced_with(client.clone(), ns, &guard_kind());
    let parents = (0..GUARDS)
        .map(|i| (guard_kind(), format!("g-{i:03}"), json!({})))
        .collect();
    create_all(
        client.clone(),
        ns.to_string(),
        parents,
        Arc::new(AtomicUsize::new(0)),
    )
    .await?;
    let holding = |list: &[DynamicObject]| {
        list.iter()
            .filter(|g| g.finalizers().iter().any(|f| f == FINALIZER))
            .count()
    };
    wait_for(
        &format!("{FINALIZER} on all {GUARDS} Guards"),
        CONVERGE,
        || async {
            let list = api.list(&ListParams::default()).await?.items;
            Ok((list.len() == GUARDS && holding(&list) == GUARDS).then_some(()))
        },
    )
    .await?;

    // The release starts within milliseconds of the removal (inotify), and the API
    // server goes down while it runs.
    std::fs::remove_file(op.plugins.path().join("guard.wasm"))?;
    control_plane.restart("kube-apiserver").await?;
    await_api_ready(client, Duration::from_secs(120)).await?;
    let kind = "capstan_orphaned_finalizers{kind=\"Guard.test.capstan.dev\"}";
    wait_for("every finalizer released", CONVERGE, || async {
        let list = api.list(&ListParams::default()).await?.items;
        let metric = op.metrics().await?;
        let released = metric.lines().any(|l| l == format!("{kind} 0"));
        Ok((list.len() == GUARDS && holding(&list) == 0 && released).then_some(()))
    })
    .await?;
    let retries = op.log().matches("will retry").count();
    println!("release retried {retries} times across the API server restart");

    let names: Vec<String> = api
        .list(&ListParams::default())
        .await?
        .items
        .iter()
        .map(|g| g.name_any())
        .collect();
    assert_eq!(names.len(), GUARDS, "every Guard is there to delete");
    for name in &names {
        retried(&format!("delete Guard {name}"), RETRY, || async {
            match api.delete(name, &DeleteParams::default()).await {
                Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
                other => other.map(|_| ()),
            }
        })
        .await?;
    }
    wait_for("every Guard deletion to complete", CONVERGE, || async {
        let left = api.list(&ListParams::default()).await?.items.len();
        Ok((left == 0).then_some(()))
    })
    .await?;
    Ok(())
}

fn guard_kind() -> ApiResource {
    test_kind("Guard", "guards")
}

/// What the suite measured.
#[derive(Debug, Default)]
struct Report {
    parents: usize,
    lost: Vec<String>,
    uuids_changed: Vec<String>,
    passwords_changed: Vec<String>,
    duplicate_children: usize,
    children_replaced: Vec<String>,
    deposed_writes: Vec<String>,
    /// Lease updates of the deposed leader refused with 409: a lost compare-and-swap,
    /// which changes nothing (reported, not counted as writes).
    deposed_lease_conflicts: usize,
    /// Writes of the leader before its pause and of the new leader after the takeover:
    /// both must be non-zero, or the leader check proves nothing.
    leader_writes_before_pause: usize,
    new_leader_writes: usize,
    edits_not_restored: Vec<String>,
    edit_restore: Vec<Duration>,
    delete_restore: Vec<Duration>,
    /// (what, when, how long), in order.
    timeline: Vec<(String, Duration)>,
}

impl Report {
    fn print(&self, total: Duration) {
        let times = |d: &[Duration]| match (median(d), d.iter().max()) {
            (Some(m), Some(max)) => format!("{m:.2?} / {max:.2?} (n={})", d.len()),
            _ => "-".into(),
        };
        let rows = [
            (
                "parents lost (never converged)",
                self.lost.len().to_string(),
                "0",
            ),
            ("UUIDs changed", self.uuids_changed.len().to_string(), "0"),
            (
                "passwords changed",
                self.passwords_changed.len().to_string(),
                "0",
            ),
            (
                "duplicate children",
                self.duplicate_children.to_string(),
                "0",
            ),
            (
                "children replaced (not deleted by the test)",
                self.children_replaced.len().to_string(),
                "0",
            ),
            (
                "writes by the deposed leader after the takeover",
                self.deposed_writes.len().to_string(),
                "0",
            ),
            (
                "hand-made changes not undone",
                self.edits_not_restored.len().to_string(),
                "0",
            ),
            (
                "restore of an edited child (median / max)",
                times(&self.edit_restore),
                "< 30s",
            ),
            (
                "restore of a deleted child (median / max)",
                times(&self.delete_restore),
                "< 30s",
            ),
        ];
        eprintln!(
            "\nfault injection: {} parents ({UUIDS} Uuid, {WIDGETS} Widget x {CHILDREN} ConfigMaps, {POSTGRES} PostgreSQLCluster)",
            self.parents
        );
        eprintln!("| {:<50} | {:<28} | {:<6} |", "measure", "value", "target");
        eprintln!("|{:-<52}|{:-<30}|{:-<8}|", "", "", "");
        for (what, value, target) in rows {
            eprintln!("| {what:<50} | {value:<28} | {target:<6} |");
        }
        eprintln!(
            "deposed leader: {} lease update(s) refused with 409 after the takeover (a lost compare-and-swap writes nothing); writes before its pause: {}; new leader's writes after the takeover: {}",
            self.deposed_lease_conflicts, self.leader_writes_before_pause, self.new_leader_writes
        );
        eprintln!("timeline:");
        for (what, at) in &self.timeline {
            eprintln!("  {:>7.1?}  {what}", at);
        }
        eprintln!("suite runtime: {total:.1?}\n");
    }

    fn assert_all_zero(&self) {
        let failures: Vec<String> = [
            ("parents lost", &self.lost),
            ("UUIDs changed", &self.uuids_changed),
            ("passwords changed", &self.passwords_changed),
            ("children replaced", &self.children_replaced),
            ("writes by the deposed leader", &self.deposed_writes),
            ("hand-made changes not undone", &self.edits_not_restored),
        ]
        .into_iter()
        .filter(|(_, v)| !v.is_empty())
        .map(|(what, v)| format!("{what}: {} (first: {:?})", v.len(), &v[..v.len().min(5)]))
        .collect();
        assert!(failures.is_empty(), "{}", failures.join("\n"));
        assert_eq!(self.duplicate_children, 0, "duplicate children");
        // A restore must come from the watch, not from the host giving up on a cache
        // that never shows its write (the expectation limit is 30 s).
        for (what, times) in [
            ("edited", &self.edit_restore),
            ("deleted", &self.delete_restore),
        ] {
            let slowest = times.iter().max().copied().unwrap_or_default();
            assert!(
                slowest < Duration::from_secs(25),
                "a hand-{what} child took {slowest:?} to be restored"
            );
        }
        assert!(
            self.leader_writes_before_pause > 0 && self.new_leader_writes > 0,
            "the leader check proves nothing: the paused leader wrote {} times before its pause, the new leader {} times after the takeover",
            self.leader_writes_before_pause,
            self.new_leader_writes
        );
    }
}

fn median(d: &[Duration]) -> Option<Duration> {
    let mut d = d.to_vec();
    d.sort();
    d.get(d.len() / 2).copied()
}

async fn run(control_plane: &ControlPlane, client: &Client, ns: &str) -> Result<Report> {
    let t0 = Instant::now();
    let mut report = Report::default();
    let mark = |report: &mut Report, what: String| report.timeline.push((what, t0.elapsed()));

    // (a), (b): the batch, with capstan killed three times and the API server restarted.
    let parents = batch();
    report.parents = parents.len();
    let paths = plugins();
    let paths: Vec<&std::path::Path> = paths.iter().map(|p| p.as_path()).collect();
    // Ready once its plugins are loaded, their CRDs installed.
    let mut op = Operator::start(ns, &paths, &["--concurrency", "8"]).await;
    // Every generated value (across kills too) and every child, as first seen, for the whole run.
    let uuids = FirstSeen::record(
        Api::<DynamicObject>::namespaced_with(client.clone(), ns, &uuid_kind()),
        None,
        |o: &DynamicObject| {
            let uuid = o.data.pointer("/status/uuid")?.as_str()?;
            (!uuid.is_empty()).then(|| uuid.to_string())
        },
    )
    .await;
    let passwords = FirstSeen::record(
        Api::<Secret>::namespaced(client.clone(), ns),
        Some("capstan.dev/plugin=postgresql"),
        |s: &Secret| {
            let data = s.data.as_ref()?;
            let mut digest = Sha256::new();
            for key in ["password", "replication-password"] {
                digest.update(&data.get(key)?.0);
            }
            Some(format!("{:x}", digest.finalize()))
        },
    )
    .await;
    let children = FirstSeen::record(
        Api::<ConfigMap>::namespaced(client.clone(), ns),
        Some(WIDGET_LABEL),
        |c: &ConfigMap| c.metadata.uid.clone(),
    )
    .await;

    mark(&mut report, "capstan started; creating the batch".into());
    let created = Arc::new(AtomicUsize::new(0));
    let creating = tokio::spawn(create_all(
        client.clone(),
        ns.to_string(),
        parents,
        created.clone(),
    ));
    let total = report.parents;
    let faults = KILLS_AT
        .iter()
        .map(|&at| (at, "SIGKILL capstan"))
        .chain([(API_RESTART_AT, "restart kube-apiserver")]);
    for (at, fault) in faults {
        let threshold = (total as f64 * at) as usize;
        wait_for(
            &format!("{threshold} parents created"),
            Duration::from_secs(300),
            || {
                let created = created.clone();
                let finished = creating.is_finished();
                async move {
                    if finished && created.load(Ordering::SeqCst) < threshold {
                        bail!("the batch stopped early");
                    }
                    Ok((created.load(Ordering::SeqCst) >= threshold).then_some(()))
                }
            },
        )
        .await?;
        let at_count = created.load(Ordering::SeqCst);
        let took = Instant::now();
        if fault == "SIGKILL capstan" {
            op.restart().await;
        } else {
            control_plane.restart("kube-apiserver").await?;
        }
        mark(
            &mut report,
            format!(
                "{fault} at {at_count}/{total} created; working again after {:.1?}",
                took.elapsed()
            ),
        );
    }
    creating.await.context("the batch task")??;
    mark(&mut report, format!("all {total} parents created"));
    let survey = converge(client, ns, "v1").await;
    mark(
        &mut report,
        format!("after the batch: {}", survey.summary()),
    );
    if !survey.converged() {
        bail!(
            "the batch did not converge within {CONVERGE:?}: {}; first: {:?}\n{}",
            survey.summary(),
            &survey.not_converged[..survey.not_converged.len().min(10)],
            op.log_tail()
        );
    }
    // Stopped, not dropped: a dropped Operator deletes its parents, which (c) goes on with.
    op.terminate();

    // (c): two replicas under leader election; the leader is paused while it works.
    let id_leader = format!("{ns}-a");
    let id_standby = format!("{ns}-b");
    let election = [
        "--leader-elect",
        "--leader-election-namespace",
        ns,
        "--lease-duration-seconds",
        &LEASE_SECONDS.to_string(),
        "--concurrency",
        "8",
    ];
    let mut leader = Operator::start_replica(&id_leader, ns, &paths, &election).await;
    await_leader(&leader, "the first replica to lead").await?;
    let standby = Operator::start_replica(&id_standby, ns, &paths, &election).await;
    mark(
        &mut report,
        format!("{id_leader} leads, {id_standby} stands by"),
    );
    let patched = Arc::new(AtomicUsize::new(0));
    let patching = tokio::spawn(patch_widgets(
        client.clone(),
        ns.to_string(),
        "v2",
        patched.clone(),
    ));
    wait_for(
        "a quarter of the widgets patched",
        Duration::from_secs(120),
        || {
            let n = patched.load(Ordering::SeqCst);
            async move { Ok((n >= WIDGETS / 4).then_some(())) }
        },
    )
    .await?;
    let paused_at = Timestamp::now();
    let paused = Instant::now();
    leader.pause();
    mark(
        &mut report,
        format!(
            "SIGSTOP {id_leader} with {}/{WIDGETS} widgets patched",
            patched.load(Ordering::SeqCst)
        ),
    );
    let takeover = await_leader(&standby, "the standby to take over").await;
    mark(
        &mut report,
        format!(
            "{id_standby} leads, {:.1?} after the pause",
            paused.elapsed()
        ),
    );
    // The new leader writes while the old one is still frozen, then it wakes.
    tokio::time::sleep(Duration::from_secs(2)).await;
    leader.resume();
    mark(&mut report, format!("SIGCONT {id_leader}"));
    let woke = Instant::now();
    let exited = wait_for(
        "the deposed leader to exit",
        Duration::from_secs(30),
        || {
            let status = leader.exit_status();
            async move { Ok(status) }
        },
    )
    .await;
    mark(
        &mut report,
        match &exited {
            Ok(status) => format!(
                "{id_leader} exited ({status}) {:.1?} after waking",
                woke.elapsed()
            ),
            Err(e) => format!("{id_leader} did not exit: {e}"),
        },
    );
    takeover?;
    patching.await.context("the patch task")??;
    let survey = converge(client, ns, "v2").await;
    mark(
        &mut report,
        format!("after the takeover: {}", survey.summary()),
    );
    attribute_writes(
        control_plane,
        ns,
        &id_leader,
        &id_standby,
        paused_at,
        &mut report,
    )?;

    // (d): children edited and deleted by hand, restored by the new leader.
    let deleted = undo_hand_edits(client, ns, &mut report).await?;
    mark(
        &mut report,
        format!("{HAND_EDITS} children edited and {HAND_EDITS} deleted by hand"),
    );
    let survey = converge(client, ns, "v2").await;
    mark(&mut report, format!("at the end: {}", survey.summary()));
    report.lost = survey.not_converged;
    report.duplicate_children = survey.duplicate_children;

    report.uuids_changed = uuids.changed(&BTreeSet::new());
    report.passwords_changed = passwords.changed(&BTreeSet::new());
    report.children_replaced = children.changed(&deleted);
    drop(standby);
    drop(leader);
    Ok(report)
}

/// The parents: the PostgreSQLClusters first (they take longest), then the Uuids with a
/// Widget after every tenth.
fn batch() -> Vec<(ApiResource, String, Value)> {
    let mut parents: Vec<(ApiResource, String, Value)> = (0..POSTGRES)
        .map(|i| {
            let spec = json!({"replicas": 1, "version": "16.1", "storage": "1Gi"});
            (postgres_kind(), format!("pg-{i}"), spec)
        })
        .collect();
    for i in 0..UUIDS {
        parents.push((uuid_kind(), format!("u-{i:04}"), json!({})));
        if i % (UUIDS / WIDGETS) == 0 {
            let w = i / (UUIDS / WIDGETS);
            let spec = json!({"count": CHILDREN, "message": "v1"});
            parents.push((widget_kind(), format!("w-{w:03}"), spec));
        }
    }
    parents
}

/// Creates every parent, `IN_FLIGHT` at a time, each retried through API server restarts
/// and CRD installation for up to two minutes; `created` counts them.
async fn create_all(
    client: Client,
    ns: String,
    parents: Vec<(ApiResource, String, Value)>,
    created: Arc<AtomicUsize>,
) -> Result<()> {
    futures::stream::iter(parents)
        .map(|(ar, name, spec)| {
            let api = Api::<DynamicObject>::namespaced_with(client.clone(), &ns, &ar);
            let created = created.clone();
            async move {
                let obj: DynamicObject = serde_json::from_value(json!({
                    "apiVersion": ar.api_version, "kind": ar.kind,
                    "metadata": {"name": name}, "spec": spec,
                }))?;
                retried(&format!("create {} {name}", ar.kind), RETRY, || async {
                    match api.create(&PostParams::default(), &obj).await {
                        // Created by an attempt whose answer was lost in a restart.
                        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
                        other => other.map(|_| ()),
                    }
                })
                .await?;
                created.fetch_add(1, Ordering::SeqCst);
                Ok::<_, anyhow::Error>(())
            }
        })
        .buffer_unordered(IN_FLIGHT)
        .try_collect()
        .await
}

/// Sets every widget's `spec.message` to `message`, four at a time.
async fn patch_widgets(
    client: Client,
    ns: String,
    message: &'static str,
    patched: Arc<AtomicUsize>,
) -> Result<()> {
    let api = Api::<DynamicObject>::namespaced_with(client, &ns, &widget_kind());
    futures::stream::iter(0..WIDGETS)
        .map(|w| {
            let (api, patched) = (api.clone(), patched.clone());
            async move {
                let name = format!("w-{w:03}");
                let patch = Patch::Merge(json!({"spec": {"message": message}}));
                retried(&format!("patch Widget {name}"), RETRY, || async {
                    api.patch(&name, &PatchParams::default(), &patch)
                        .await
                        .map(|_| ())
                })
                .await?;
                patched.fetch_add(1, Ordering::SeqCst);
                Ok::<_, anyhow::Error>(())
            }
        })
        .buffer_unordered(4)
        .try_collect()
        .await
}

/// Waits until `op` says it leads (`capstan_leader 1`).
async fn await_leader(op: &Operator, what: &str) -> Result<()> {
    let bound = Duration::from_secs(LEASE_SECONDS * 5 + 30);
    wait_for(what, bound, || async {
        Ok((op.counter("capstan_leader").await? == 1).then_some(()))
    })
    .await
    .with_context(|| op.log_tail())
}

/// Counts, from the audit log, the writes of the paused leader after the standby took
/// the lease over (its first successful Lease write after `paused_at`): none may exist.
fn attribute_writes(
    control_plane: &ControlPlane,
    ns: &str,
    paused_leader: &str,
    new_leader: &str,
    paused_at: Timestamp,
    report: &mut Report,
) -> Result<()> {
    // Both identities start with the namespace: every line of either names it.
    let events = control_plane.audit_events(ns)?;
    let is_lease = |e: &AuditEvent| {
        e.object_ref.resource == "leases"
            && e.object_ref.namespace == ns
            && e.object_ref.name == "capstan"
    };
    let takeover = events
        .iter()
        .filter(|e| e.by_replica(new_leader) && is_lease(e) && (200..300).contains(&e.code()))
        .filter_map(AuditEvent::received)
        .find(|t| *t >= paused_at)
        .context("no Lease write of the new leader in the audit log")?;
    for e in &events {
        let Some(at) = e.received() else { continue };
        if e.by_replica(paused_leader) {
            if at < paused_at {
                report.leader_writes_before_pause += 1;
            } else if at >= takeover {
                if is_lease(e) && e.code() == 409 {
                    report.deposed_lease_conflicts += 1;
                } else {
                    let r = &e.object_ref;
                    report.deposed_writes.push(format!(
                        "{} {}/{} {} -> {} at {at}",
                        e.verb,
                        r.resource,
                        r.name,
                        r.subresource,
                        e.code()
                    ));
                }
            }
        } else if e.by_replica(new_leader) && at >= takeover && !is_lease(e) {
            report.new_leader_writes += 1;
        }
    }
    Ok(())
}

/// Edits the data of `w-NNN-0` and deletes `w-NNN-1` for the first `HAND_EDITS` widgets
/// and measures, from a watch, how long until each is as the plugin wants it again.
/// Returns the names deleted (their replacement is expected).
async fn undo_hand_edits(
    client: &Client,
    ns: &str,
    report: &mut Report,
) -> Result<BTreeSet<String>> {
    let cms = Api::<ConfigMap>::namespaced(client.clone(), ns);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(ConfigMap, Instant)>();
    let (synced_tx, synced_rx) = tokio::sync::oneshot::channel();
    let watch = AbortOnDrop(tokio::spawn({
        let cms = cms.clone();
        async move {
            let mut synced = Some(synced_tx);
            let config = watcher::Config::default().labels(WIDGET_LABEL);
            let mut events = watcher(cms, config).default_backoff().boxed();
            while let Some(event) = events.next().await {
                match event {
                    Ok(watcher::Event::InitDone) => {
                        if let Some(s) = synced.take() {
                            let _ = s.send(());
                        }
                    }
                    Ok(watcher::Event::Apply(cm)) => {
                        let _ = tx.send((cm, Instant::now()));
                    }
                    _ => {}
                }
            }
        }
    }));
    synced_rx.await.context("the ConfigMap watch lists")?;

    /// What undoes a hand-made change: the edit seen, then the plugin's data again; or
    /// a new object of the same name.
    enum Pending {
        Edited { seen_edit: bool, at: Instant },
        Deleted { uid: String, at: Instant },
    }
    let mut pending: HashMap<String, Pending> = HashMap::new();
    let mut deleted = BTreeSet::new();
    for w in 0..HAND_EDITS {
        let edited = format!("w-{w:03}-0");
        let patch = Patch::Merge(json!({"data": {"message": "edited by hand"}}));
        cms.patch(&edited, &PatchParams::default(), &patch).await?;
        pending.insert(
            edited,
            Pending::Edited {
                seen_edit: false,
                at: Instant::now(),
            },
        );
        let gone = format!("w-{w:03}-1");
        let uid = cms.get(&gone).await?.metadata.uid.unwrap_or_default();
        cms.delete(&gone, &DeleteParams::default()).await?;
        pending.insert(
            gone.clone(),
            Pending::Deleted {
                uid,
                at: Instant::now(),
            },
        );
        deleted.insert(gone);
    }
    let deadline = tokio::time::Instant::now() + RESTORE;
    while !pending.is_empty() {
        let Ok(Some((cm, seen))) = tokio::time::timeout_at(deadline, rx.recv()).await else {
            break;
        };
        let name = cm.name_any();
        let message = cm
            .data
            .as_ref()
            .and_then(|d| d.get("message"))
            .map(String::as_str);
        match pending.get_mut(&name) {
            Some(Pending::Edited { seen_edit, .. }) if message == Some("edited by hand") => {
                *seen_edit = true;
            }
            Some(Pending::Edited {
                seen_edit: true,
                at,
            }) if message == Some("v2") => {
                report.edit_restore.push(seen - *at);
                pending.remove(&name);
            }
            Some(Pending::Deleted { uid, at })
                if cm.metadata.uid.as_deref() != Some(uid.as_str()) =>
            {
                report.delete_restore.push(seen - *at);
                pending.remove(&name);
            }
            _ => {}
        }
    }
    drop(watch);
    report.edits_not_restored = pending.into_keys().collect();
    Ok(deleted)
}

/// Waits, for up to [`CONVERGE`], until every parent of the suite converged with
/// `message`; returns the last survey either way.
async fn converge(client: &Client, ns: &str, message: &str) -> Survey {
    let fleet = Fleet {
        uuids: UUIDS,
        widgets: WIDGETS,
        postgres: POSTGRES,
        children: CHILDREN,
    };
    fleet::converge(client, ns, message, &fleet, CONVERGE).await
}

/// Each object's first value, and the names of those seen with another one later.
type Values = (HashMap<String, String>, Vec<String>);

/// A value per object as first seen by a watch (e.g. a Uuid's `status.uuid`), and every
/// later value that differs from it.
struct FirstSeen {
    seen: Arc<Mutex<Values>>,
    _watch: AbortOnDrop,
}

impl FirstSeen {
    /// Watches `api` (filtered by `labels`) for the rest of the test; returns once the
    /// watch has listed, so nothing after that is missed. Restarts of the API server end
    /// the watch, which then lists again (kube's backoff).
    async fn record<K>(
        api: Api<K>,
        labels: Option<&str>,
        value: impl Fn(&K) -> Option<String> + Send + 'static,
    ) -> Self
    where
        K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
    {
        let seen = Arc::new(Mutex::new((HashMap::new(), Vec::new())));
        let sink = seen.clone();
        let (synced_tx, synced_rx) = tokio::sync::oneshot::channel();
        let mut config = watcher::Config::default();
        if let Some(labels) = labels {
            config = config.labels(labels);
        }
        let watch = tokio::spawn(async move {
            let mut synced = Some(synced_tx);
            let mut events = watcher(api, config).default_backoff().boxed();
            while let Some(event) = events.next().await {
                let obj = match event {
                    Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) => o,
                    Ok(watcher::Event::InitDone) => {
                        if let Some(s) = synced.take() {
                            let _ = s.send(());
                        }
                        continue;
                    }
                    _ => continue,
                };
                let Some(v) = value(&obj) else { continue };
                let name = obj.name_any();
                let mut seen = sink.lock().unwrap();
                let (first, changes) = &mut *seen;
                match first.get(&name) {
                    None => {
                        first.insert(name, v);
                    }
                    Some(old) if *old != v => changes.push(name),
                    Some(_) => {}
                }
            }
        });
        synced_rx.await.expect("the watch lists");
        FirstSeen {
            seen,
            _watch: AbortOnDrop(watch),
        }
    }

    /// The objects whose value changed, but for those in `expected`.
    fn changed(&self, expected: &BTreeSet<String>) -> Vec<String> {
        let seen = self.seen.lock().unwrap();
        let names: BTreeSet<&String> = seen.1.iter().filter(|n| !expected.contains(*n)).collect();
        names.into_iter().cloned().collect()
    }
}

/// A task that ends with its owner.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
