//! `capstan run --shards` on the real local control plane (which `cargo xtask cluster up`
//! starts with the `ShardedListAndWatch` feature gate): three replicas split the
//! parents, each watching only its range; then one is SIGKILLed in the middle of a batch
//! of spec changes and the two others take its range over.
//!
//! Measured and asserted: every parent converges, before and after the kill (0 lost);
//! each replica's share of the parents, of the reconciles and of the parent-watch bytes
//! is within 15 % of a third; the killed replica's range is served again within the
//! lease duration plus a few retry periods; and no parent is written by two replicas at
//! once. The last is read from the API server's audit log, where every write carries
//! its replica's identity in the user agent: each parent's writes, in order, must come
//! from one replica, then (for the killed one's parents only) from one other.
//!
//! `CAPSTAN_SHARD_UUIDS` and `CAPSTAN_SHARD_WIDGETS` size the batch (default 3000 and
//! 300, as in docs/performance.md).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use capstan_e2e::control_plane::{AuditEvent, ControlPlane};
use capstan_e2e::fleet::{self, Fleet, retried, widget_kind};
use capstan_e2e::objects::uuid_kind;
use capstan_e2e::operator::{Operator, plugin, test_plugin};
use capstan_e2e::{in_test_namespace, wait_for};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

const LEASE_SECONDS: u64 = 6;
/// Widget spec `count`: ConfigMaps `<name>-0` and `<name>-1`.
const CHILDREN: usize = 2;
/// Requests the test's own client has in flight at once.
const IN_FLIGHT: usize = 16;
/// Bound of each wait for every parent to converge.
const CONVERGE: Duration = Duration::from_secs(600);
/// How long one request is retried (the CRD may still be being installed).
const RETRY: Duration = Duration::from_secs(60);
/// The goal: each replica within 15 % of an even split.
const EVEN_WITHIN: f64 = 0.15;
const REPLICAS: [&str; 3] = ["a", "b", "c"];

fn size(var: &str, default: usize) -> usize {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_share_the_parents_and_take_over_a_killed_ones_range() {
    let control_plane = ControlPlane::from_env();
    in_test_namespace("shards", Duration::from_secs(300), async |client, ns| {
        run(&control_plane, &client, &ns).await
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
}

async fn run(control_plane: &ControlPlane, client: &Client, ns: &str) -> Result<()> {
    let uuids = size("CAPSTAN_SHARD_UUIDS", 3000);
    let widgets = size("CAPSTAN_SHARD_WIDGETS", 300);
    let paths = [plugin("uuid"), test_plugin("widget")];
    let paths: Vec<&std::path::Path> = paths.iter().map(|p| p.as_path()).collect();
    let lease = LEASE_SECONDS.to_string();
    let args = [
        "--shards",
        "--leader-election-namespace",
        ns,
        "--lease-duration-seconds",
        &lease,
        "--concurrency",
        "8",
    ];
    let t0 = Instant::now();
    let mut replicas: Vec<Operator> = Vec::new();
    for r in REPLICAS {
        replicas.push(Operator::start_replica(&format!("{ns}-{r}"), ns, &paths, &args).await);
    }
    let split = even_split(&replicas, "the replicas to split the buckets").await?;
    println!("buckets per replica after {:?}: {split:?}", t0.elapsed());

    // Phase 1: every parent, created with the three replicas up.
    let created = Instant::now();
    create_all(client, ns, uuids, widgets).await?;
    let create_time = created.elapsed();
    converge(client, ns, "v1", uuids, widgets)
        .await
        .with_context(|| logs(&replicas))?;
    let converge_time = created.elapsed();
    println!(
        "{uuids} Uuids and {widgets} Widgets: created in {create_time:.1?}, all converged after {converge_time:.1?}"
    );
    let mut reconciles = Vec::new();
    let mut parent_bytes = Vec::new();
    let mut child_bytes = Vec::new();
    for op in &replicas {
        reconciles.push(
            op.counter("capstan_reconciles_total{plugin=\"uuid\",result=\"ok\"}")
                .await?
                + op.counter("capstan_reconciles_total{plugin=\"widget\",result=\"ok\"}")
                    .await?,
        );
        parent_bytes.push(
            op.counter("capstan_watch_bytes_total{watch=\"parents\"}")
                .await?,
        );
        child_bytes.push(
            op.counter("capstan_watch_bytes_total{watch=\"children\"}")
                .await?,
        );
    }
    let writers = parent_writers(control_plane, ns)?;
    let mut parents_of = vec![0u64; REPLICAS.len()];
    for sequence in writers.values() {
        if let Some(i) = replica_index(ns, &sequence[0].1) {
            parents_of[i] += 1;
        }
    }
    println!("parents per replica (first status writer): {parents_of:?}");
    println!("reconciles per replica: {reconciles:?}");
    println!("parent watch bytes per replica: {parent_bytes:?}");
    println!("child watch bytes per replica: {child_bytes:?}");
    ensure!(
        parents_of.iter().sum::<u64>() as usize == uuids + widgets,
        "{} parents had status writes by a replica, {} expected",
        parents_of.iter().sum::<u64>(),
        uuids + widgets
    );
    for (what, shares) in [
        ("parents", &parents_of),
        ("reconciles", &reconciles),
        ("parent watch bytes", &parent_bytes),
    ] {
        check_even(what, shares)?;
    }
    ensure_no_overlap(&writers, None)?;

    // Phase 2: a spec change of every Widget; replica b is killed halfway through.
    let killed = format!("{ns}-b");
    let widgets_api = Api::<DynamicObject>::namespaced_with(client.clone(), ns, &widget_kind());
    let half = widgets / 2;
    patch_widgets(&widgets_api, 0..half, "v2").await?;
    let killed_at = Timestamp::now();
    let kill_instant = Instant::now();
    replicas[1].kill();
    patch_widgets(&widgets_api, half..widgets, "v2").await?;
    let survivors = [&replicas[0], &replicas[2]];
    wait_for(
        "the survivors to take the killed replica's buckets over",
        Duration::from_secs(LEASE_SECONDS * 3),
        || async {
            let mut sum = 0;
            for op in survivors {
                sum += op.counter("capstan_shard_buckets").await?;
            }
            Ok((sum == 64).then_some(()))
        },
    )
    .await
    .with_context(|| logs(&replicas))?;
    let takeover = kill_instant.elapsed();
    println!("the killed replica's range served again {takeover:.1?} after the kill");
    // The goal is a lease duration plus a resync (300 s); the protocol gives a lease
    // duration plus up to three retry periods (0.8 s each) and a restart: 2 leases bound
    // it with room for a loaded machine.
    ensure!(
        takeover <= Duration::from_secs(2 * LEASE_SECONDS),
        "takeover took {takeover:?}, more than twice the lease ({LEASE_SECONDS} s)"
    );
    converge(client, ns, "v2", uuids, widgets)
        .await
        .with_context(|| logs(&replicas))?;
    println!(
        "every parent converged again {:.1?} after the kill",
        kill_instant.elapsed()
    );
    let writers = parent_writers(control_plane, ns)?;
    ensure_no_overlap(&writers, Some((&killed, killed_at)))?;

    // Phase 3: replica b comes back in the middle of another spec change of every
    // Widget; the buckets it is due move to it from a and c, after they let them go.
    let rejoined_at = Timestamp::now();
    let rejoin = Instant::now();
    patch_widgets(&widgets_api, 0..half, "v3").await?;
    replicas[1].restart().await;
    patch_widgets(&widgets_api, half..widgets, "v3").await?;
    let split = even_split(&replicas, "the buckets to split among three again").await?;
    println!(
        "the rejoined replica got its share {:.1?} after its restart began: {split:?}",
        rejoin.elapsed()
    );
    converge(client, ns, "v3", uuids, widgets)
        .await
        .with_context(|| logs(&replicas))?;
    println!(
        "every parent converged again {:.1?} after the rejoin",
        rejoin.elapsed()
    );
    let since: BTreeMap<String, Vec<(Timestamp, String)>> = parent_writers(control_plane, ns)?
        .into_iter()
        .map(|(parent, writes)| {
            let later = writes
                .into_iter()
                .filter(|(at, _)| *at >= rejoined_at)
                .collect();
            (parent, later)
        })
        .collect();
    ensure_handed_only(&since, &[("a", "b"), ("c", "b")], ns)?;

    // Phase 4: replica c stops cleanly (SIGTERM) in the middle of a fourth batch: it
    // deletes its Lease, so a and b take its buckets at their next round, not a lease
    // later. With two members b's share moves up: 21-31 go from b to a, 42-63 from c to b.
    let left_at = Timestamp::now();
    let leave = Instant::now();
    patch_widgets(&widgets_api, 0..half, "v4").await?;
    replicas[2].terminate();
    let stopped = leave.elapsed();
    let remaining = [&replicas[0], &replicas[1]];
    wait_for(
        "a and b to serve every bucket",
        Duration::from_secs(30),
        || async {
            let mut sum = 0;
            for op in remaining {
                sum += op.counter("capstan_shard_buckets").await?;
            }
            Ok((sum == 64).then_some(()))
        },
    )
    .await
    .with_context(|| logs(&replicas))?;
    let handover = leave.elapsed() - stopped;
    println!(
        "after a clean stop ({stopped:.1?}), its buckets were served again {handover:.1?} later"
    );
    ensure!(
        handover < Duration::from_secs(LEASE_SECONDS),
        "a clean stop was handed over after {handover:?}: the lease was not given up"
    );
    patch_widgets(&widgets_api, half..widgets, "v4").await?;
    converge(client, ns, "v4", uuids, widgets)
        .await
        .with_context(|| logs(&replicas))?;
    let since: BTreeMap<String, Vec<(Timestamp, String)>> = parent_writers(control_plane, ns)?
        .into_iter()
        .map(|(parent, writes)| {
            let later = writes
                .into_iter()
                .filter(|(at, _)| *at >= left_at)
                .collect();
            (parent, later)
        })
        .collect();
    ensure_handed_only(&since, &[("b", "a"), ("c", "b")], ns)?;
    Ok(())
}

/// Since a membership change, each parent's writes come from one replica, or from one
/// and then another along one of the `moves` (from, to) that the change implies (the
/// even split of buckets among names sorted a < b < c).
fn ensure_handed_only(
    writers: &BTreeMap<String, Vec<(Timestamp, String)>>,
    moves: &[(&str, &str)],
    ns: &str,
) -> Result<()> {
    let moves: Vec<(String, String)> = moves
        .iter()
        .map(|(from, to)| (format!("{ns}-{from}"), format!("{ns}-{to}")))
        .collect();
    let mut wrong = Vec::new();
    let mut moved = 0;
    for (parent, writes) in writers {
        let mut runs: Vec<&str> = Vec::new();
        for (_, who) in writes {
            if runs.last() != Some(&who.as_str()) {
                runs.push(who);
            }
        }
        match runs.as_slice() {
            [] | [_] => {}
            [first, second]
                if moves
                    .iter()
                    .any(|(from, to)| from.as_str() == *first && to.as_str() == *second) =>
            {
                moved += 1
            }
            _ => wrong.push(format!("{parent}: {runs:?}")),
        }
    }
    println!(
        "since the membership change: {moved} parents handed over, {} written by two replicas at once",
        wrong.len()
    );
    ensure!(
        wrong.is_empty(),
        "parents written by more than one replica since the membership change: {:?}",
        &wrong[..wrong.len().min(20)]
    );
    Ok(())
}

/// Waits until the three replicas serve 21, 21 and 22 buckets, and returns the split.
async fn even_split(replicas: &[Operator], what: &str) -> Result<Vec<u64>> {
    wait_for(what, Duration::from_secs(60), || async {
        let buckets = served_buckets(replicas).await?;
        let even = buckets.iter().sum::<u64>() == 64 && buckets.iter().all(|b| *b >= 21);
        Ok(even.then_some(buckets))
    })
    .await
    .with_context(|| logs(replicas))
}

/// `capstan_shard_buckets` of each replica.
async fn served_buckets(replicas: &[Operator]) -> Result<Vec<u64>> {
    let mut out = Vec::new();
    for op in replicas {
        out.push(op.counter("capstan_shard_buckets").await?);
    }
    Ok(out)
}

fn logs(replicas: &[Operator]) -> String {
    replicas
        .iter()
        .map(|op| format!("--- {:?}\n{}", op.identity(), op.log_tail()))
        .collect::<Vec<_>>()
        .join("\n")
}

fn check_even(what: &str, shares: &[u64]) -> Result<()> {
    let total: u64 = shares.iter().sum();
    ensure!(total > 0, "no {what} at all");
    let even = total as f64 / shares.len() as f64;
    for (i, s) in shares.iter().enumerate() {
        let off = (*s as f64 - even).abs() / even;
        println!(
            "  {what}: replica {} has {:.1} % of the total ({:+.1} % from even)",
            REPLICAS[i],
            100.0 * *s as f64 / total as f64,
            100.0 * (*s as f64 - even) / even
        );
        ensure!(
            off <= EVEN_WITHIN,
            "{what}: replica {} has {s} of {total}, {:.1} % from an even split",
            REPLICAS[i],
            100.0 * off
        );
    }
    Ok(())
}

async fn create_all(client: &Client, ns: &str, uuids: usize, widgets: usize) -> Result<()> {
    let mut objects: Vec<(ApiResource, String, Value)> = (0..uuids)
        .map(|i| (uuid_kind(), format!("u-{i:04}"), json!({})))
        .collect();
    objects.extend((0..widgets).map(|i| {
        let spec = json!({"count": CHILDREN, "message": "v1"});
        (widget_kind(), format!("w-{i:03}"), spec)
    }));
    futures::stream::iter(objects)
        .map(|(ar, name, spec)| {
            let api = Api::<DynamicObject>::namespaced_with(client.clone(), ns, &ar);
            async move {
                let obj: DynamicObject = serde_json::from_value(json!({
                    "apiVersion": ar.api_version, "kind": ar.kind,
                    "metadata": {"name": name}, "spec": spec,
                }))?;
                retried(&format!("create {name}"), RETRY, || async {
                    api.create(&PostParams::default(), &obj).await
                })
                .await
            }
        })
        .buffer_unordered(IN_FLIGHT)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(())
}

async fn patch_widgets(
    api: &Api<DynamicObject>,
    range: std::ops::Range<usize>,
    message: &str,
) -> Result<()> {
    futures::stream::iter(range)
        .map(|i| async move {
            let patch = json!({"spec": {"message": message}});
            retried(&format!("patch w-{i:03}"), RETRY, || async {
                api.patch(
                    &format!("w-{i:03}"),
                    &PatchParams::default(),
                    &Patch::Merge(&patch),
                )
                .await
            })
            .await
        })
        .buffer_unordered(IN_FLIGHT)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(())
}

/// Waits until every Uuid has its UUID and every Widget its `CHILDREN` children with
/// `message`, a Ready condition and a current observedGeneration.
async fn converge(
    client: &Client,
    ns: &str,
    message: &str,
    uuids: usize,
    widgets: usize,
) -> Result<()> {
    let fleet = Fleet {
        uuids,
        widgets,
        postgres: 0,
        children: CHILDREN,
    };
    let survey = fleet::converge(client, ns, message, &fleet, CONVERGE).await;
    ensure!(
        survey.converged(),
        "not converged after {CONVERGE:?}: {}",
        survey.summary()
    );
    Ok(())
}

/// Per parent (`kind/name`), its writes by capstan replicas in the order the API server
/// received them: status writes of the parent, and writes of its children (a Widget's
/// ConfigMaps are `<widget>-<i>`).
fn parent_writers(
    control_plane: &ControlPlane,
    ns: &str,
) -> Result<BTreeMap<String, Vec<(Timestamp, String)>>> {
    let mut out: BTreeMap<String, Vec<(Timestamp, String)>> = BTreeMap::new();
    for e in control_plane.audit_events(ns)? {
        let r = &e.object_ref;
        if r.namespace != ns || !(200..300).contains(&e.code()) {
            continue;
        }
        let Some(identity) = replica_of(&e) else {
            continue;
        };
        let parent = match (r.resource.as_str(), r.subresource.as_str()) {
            ("uuid", "status") => format!("Uuid/{}", r.name),
            ("widgets", "status") => format!("Widget/{}", r.name),
            ("configmaps", "") if r.name.starts_with("w-") => match r.name.rsplit_once('-') {
                Some((widget, _)) => format!("Widget/{widget}"),
                None => continue,
            },
            _ => continue,
        };
        let Some(at) = e.received() else { continue };
        out.entry(parent).or_default().push((at, identity));
    }
    for writes in out.values_mut() {
        writes.sort();
    }
    Ok(out)
}

/// The identity in a capstan user agent, `capstan/<version> (<identity>)`.
fn replica_of(e: &AuditEvent) -> Option<String> {
    let rest = e.user_agent.strip_prefix("capstan/")?;
    let (_, id) = rest.rsplit_once(" (")?;
    Some(id.strip_suffix(')')?.to_string())
}

fn replica_index(ns: &str, identity: &str) -> Option<usize> {
    REPLICAS
        .iter()
        .position(|r| identity == format!("{ns}-{r}"))
}

/// Each parent's writers must form one run per replica, at most two runs: the second
/// only after `killed` died, taking over from it.
fn ensure_no_overlap(
    writers: &BTreeMap<String, Vec<(Timestamp, String)>>,
    killed: Option<(&str, Timestamp)>,
) -> Result<()> {
    let mut overlaps = Vec::new();
    let mut taken_over = 0;
    for (parent, writes) in writers {
        let mut runs: Vec<&str> = Vec::new();
        for (_, who) in writes {
            if runs.last() != Some(&who.as_str()) {
                runs.push(who);
            }
        }
        let fine = match (runs.as_slice(), killed) {
            ([_], _) => true,
            ([first, second], Some((dead, died))) => {
                let after = writes
                    .iter()
                    .filter(|(_, w)| w == second)
                    .all(|(at, _)| *at >= died);
                taken_over += 1;
                *first == dead && *second != dead && after
            }
            _ => false,
        };
        if !fine {
            overlaps.push(format!("{parent}: {runs:?}"));
        }
    }
    if killed.is_some() {
        println!("parents taken over from the killed replica: {taken_over}");
    }
    println!(
        "parents written by two replicas at once: {} (of {})",
        overlaps.len(),
        writers.len()
    );
    ensure!(
        overlaps.is_empty(),
        "parents written by more than one replica: {:?}",
        &overlaps[..overlaps.len().min(20)]
    );
    Ok(())
}

/// A child applied by a version before sharding has no `capstan.dev/shard-bucket`
/// label, so no sharded child watch would show it, and its parent's reconcile would
/// take it for absent (a plugin that generates a password when its Secret is absent
/// would generate a new one). A sharded replica labels the children of its buckets
/// before its watch starts: from the first reconcile on, the plugin observes them.
#[tokio::test]
async fn children_applied_before_sharding_are_labelled_and_observed() {
    in_test_namespace(
        "shards-legacy",
        Duration::from_secs(120),
        async |client, ns| {
            let widgets =
                Api::<DynamicObject>::namespaced_with(client.clone(), &ns, &widget_kind());
            let cms = Api::<ConfigMap>::namespaced(client.clone(), &ns);
            let paths = [test_plugin("widget")];
            let paths: Vec<&std::path::Path> = paths.iter().map(|p| p.as_path()).collect();
            // An unsharded run makes the children, then they lose the label, as if an
            // older version had applied them.
            let mut op = Operator::start(&ns, &paths, &[]).await;
            create_all(&client, &ns, 0, 1).await?;
            converge(&client, &ns, "v1", 0, 1).await?;
            // Stopped, not dropped: a dropped Operator deletes its parents.
            op.terminate();
            let unlabel = json!({"metadata": {"labels": {"capstan.dev/shard-bucket": null}}});
            let mut uids = Vec::new();
            for name in ["w-000-0", "w-000-1"] {
                let cm = cms
                    .patch(name, &PatchParams::default(), &Patch::Merge(&unlabel))
                    .await?;
                ensure!(!cm.labels().contains_key("capstan.dev/shard-bucket"));
                uids.push(cm.metadata.uid);
            }
            // Every status the widget gets from now on.
            let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::<Value>::new()));
            let record = seen.clone();
            let api = widgets.clone();
            let statuses = tokio::spawn(async move {
                use kube::runtime::{WatchStreamExt, watcher};
                let mut events = watcher(api, watcher::Config::default())
                    .applied_objects()
                    .boxed();
                while let Some(Ok(w)) = events.next().await {
                    if let Some(observed) = w.data.pointer("/status/observedConfigMaps") {
                        record.lock().unwrap().push(observed.clone());
                    }
                }
            });
            // A spec change while no replica runs: the first sharded reconcile writes.
            widgets
                .patch(
                    "w-000",
                    &PatchParams::default(),
                    &Patch::Merge(&json!({"spec": {"message": "v2"}})),
                )
                .await?;
            let lease = LEASE_SECONDS.to_string();
            let args = [
                "--shards",
                "--leader-election-namespace",
                ns.as_str(),
                "--lease-duration-seconds",
                &lease,
            ];
            let mut replicas = Vec::new();
            for r in ["a", "b"] {
                replicas
                    .push(Operator::start_replica(&format!("{ns}-{r}"), &ns, &paths, &args).await);
            }
            converge(&client, &ns, "v2", 0, 1)
                .await
                .with_context(|| logs(&replicas))?;
            for (name, uid) in ["w-000-0", "w-000-1"].iter().zip(&uids) {
                let cm = cms.get(name).await?;
                ensure!(
                    cm.labels().contains_key("capstan.dev/shard-bucket"),
                    "{name} was not labelled"
                );
                ensure!(&cm.metadata.uid == uid, "{name} was replaced");
            }
            statuses.abort();
            let seen = seen.lock().unwrap().clone();
            println!("observedConfigMaps in each status since: {seen:?}");
            ensure!(
                !seen.is_empty(),
                "no status was written since sharding started: nothing to check"
            );
            ensure!(
                seen.iter().all(|o| *o == json!(["w-000-0", "w-000-1"])),
                "a reconcile did not observe a child applied before sharding: {seen:?}"
            );
            Ok(())
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
}
