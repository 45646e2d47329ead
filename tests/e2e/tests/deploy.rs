//! deploy/ on the cluster's real node: `kubectl apply -k deploy/` starts the Capstan Pods
//! from the `capstan:0.1.0` image (`cargo xtask image --import`) under their
//! ServiceAccount. They become Ready, the leader reconciles a Uuid and a one-instance
//! PostgreSQLCluster (whose PostgreSQL runs for real), `kubectl rollout restart` leaves
//! no parent unreconciled and none written by two Pods at once, no Pod exceeds the
//! memory limit of its manifest (first start included), the generated ClusterRole is
//! enough and no more, and deploy/sharded runs three real replicas that share the
//! parents. Everything deploy/ and its hosts made, but the CRDs, is removed at the end
//! (the hosts' ValidatingWebhookConfiguration too), also when the test fails: an in-cluster Capstan left running would fight the operators of later
//! tests.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use capstan_e2e::control_plane::ControlPlane;
use capstan_e2e::node::{
    is_ready, kubectl, point_postgresql_conversion_at_the_service, real_node, require_images,
};
use capstan_e2e::objects::{postgres_kind, uuid_kind};
use capstan_e2e::operator::root;
use capstan_e2e::{
    TestNamespace, client, client_with_token, is_forbidden, service_account_token, wait_for,
};
use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Client;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, PostParams};
use serde_json::json;

const T: Duration = Duration::from_secs(180);
const NS: &str = "capstan-system";
const IMAGE: &str = "capstan:0.1.0";
/// The container's memory limit in deploy/base/deployment.yaml.
const MEMORY_LIMIT: u64 = 512 * 1024 * 1024;

/// Removes what deploy/ made but the CRDs (which other tests share), on drop: also when
/// the test panics.
struct Deployed;

impl Drop for Deployed {
    fn drop(&mut self) {
        let _ = kubectl(&[
            "delete",
            "namespace",
            NS,
            "--ignore-not-found",
            "--wait=true",
            "--timeout=120s",
        ]);
        let _ = kubectl(&[
            "delete",
            "clusterrole,clusterrolebinding",
            "-l",
            "app.kubernetes.io/part-of=capstan",
            "--ignore-not-found",
        ]);
        // Written by the hosts, not by deploy/: the garbage collector deletes it with
        // the ClusterRole (checked by the test); here in case the test failed before.
        let _ = kubectl(&[
            "delete",
            "validatingwebhookconfiguration",
            "capstan",
            "--ignore-not-found",
        ]);
    }
}

fn apply(dir: &str) {
    point_postgresql_conversion_at_the_service();
    kubectl(&["apply", "-k", &root().join(dir).to_string_lossy()])
        .unwrap_or_else(|e| panic!("{e}"));
}

async fn capstan_pods(client: &Client) -> Vec<Pod> {
    Api::<Pod>::namespaced(client.clone(), NS)
        .list(&ListParams::default().labels("app.kubernetes.io/name=capstan"))
        .await
        .unwrap()
        .items
}

/// The capstan Pods that are not being deleted: a Pod a rollout is replacing may still
/// be listed, Terminating, after its containers and their cgroups are gone.
async fn live_capstan_pods(client: &Client) -> Vec<Pod> {
    let mut pods = capstan_pods(client).await;
    pods.retain(|p| p.metadata.deletion_timestamp.is_none());
    pods
}

/// Waits until the Deployment has `replicas` updated, available replicas and no old
/// ones, with args satisfying `args_ok`.
async fn await_rolled_out(client: &Client, replicas: i32) {
    let deployments = Api::<Deployment>::namespaced(client.clone(), NS);
    wait_for(
        &format!("the capstan Deployment: {replicas} updated, available replicas"),
        T,
        || {
            let deployments = deployments.clone();
            async move {
                let d = deployments.get("capstan").await?;
                let generation = d.metadata.generation;
                let s = d.status.unwrap_or_default();
                let done = s.observed_generation == generation
                    && s.updated_replicas == Some(replicas)
                    && s.available_replicas == Some(replicas)
                    && s.replicas == Some(replicas);
                Ok(done.then_some(()))
            }
        },
    )
    .await
    .unwrap_or_else(|e| {
        let pods = kubectl(&["get", "pods", "-n", NS, "-o", "wide"]).unwrap_or_default();
        let events = kubectl(&["get", "events", "-n", NS]).unwrap_or_default();
        panic!("{e}\n{pods}\n{events}")
    });
}

/// The memory cgroup directory of the Pod with `uid` on this machine (the node's
/// cgroups are under the cluster's own cgroup root), found by its `pod<uid>` name.
fn pod_memory_cgroup(uid: &str) -> Option<PathBuf> {
    fn find(dir: &Path, name: &str, depth: usize) -> Option<PathBuf> {
        for entry in std::fs::read_dir(dir).ok()?.flatten() {
            let path = entry.path();
            if !path.is_dir() {
                continue;
            }
            let file = entry.file_name();
            let file = file.to_string_lossy();
            if file == name || file.ends_with(&format!("{name}.slice")) {
                return Some(path);
            }
            if depth > 0
                && let Some(found) = find(&path, name, depth - 1)
            {
                return Some(found);
            }
        }
        None
    }
    let name = format!("pod{uid}");
    ["/sys/fs/cgroup/memory", "/sys/fs/cgroup"]
        .iter()
        .find_map(|root| find(Path::new(root), &name, 6))
}

/// The Pod's peak memory so far (cgroup v1 `memory.max_usage_in_bytes`, v2 `memory.peak`).
fn pod_peak_memory(pod: &Pod) -> Option<u64> {
    let uid = pod.metadata.uid.as_deref()?;
    let dir = pod_memory_cgroup(uid)?;
    ["memory.max_usage_in_bytes", "memory.peak"]
        .iter()
        .find_map(|file| std::fs::read_to_string(dir.join(file)).ok())
        .and_then(|text| text.trim().parse().ok())
}

/// Checks that no container of `pod` restarted or was OOM-killed, and returns its peak.
fn check_memory(pod: &Pod) -> u64 {
    let name = pod.metadata.name.clone().unwrap_or_default();
    let statuses = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.clone())
        .unwrap_or_default();
    for status in &statuses {
        let oom = status
            .last_state
            .as_ref()
            .and_then(|s| s.terminated.as_ref())
            .is_some_and(|t| t.reason.as_deref() == Some("OOMKilled"));
        assert!(!oom, "{name}: OOM-killed: {status:?}");
        assert_eq!(status.restart_count, 0, "{name} restarted: {status:?}");
    }
    let peak = pod_peak_memory(pod)
        .unwrap_or_else(|| panic!("{name}: no memory cgroup found for the Pod on this machine"));
    assert!(
        peak < MEMORY_LIMIT,
        "{name} peaked at {peak} bytes, over the 512Mi limit"
    );
    peak
}

/// Checks that each replica's writes in `writes` (identities in audit order) form one
/// run: once another replica has written, the one before never writes again.
fn assert_one_writer_at_a_time(writes: &[String], what: &str) {
    let mut finished = BTreeSet::new();
    let mut current: Option<&str> = None;
    for identity in writes {
        if current != Some(identity.as_str()) {
            if let Some(previous) = current {
                finished.insert(previous);
            }
            assert!(
                !finished.contains(identity.as_str()),
                "{what}: {identity} wrote again after another replica took over: {writes:?}"
            );
            current = Some(identity);
        }
    }
}

fn identity_of(user_agent: &str) -> Option<&str> {
    user_agent
        .strip_prefix("capstan/")?
        .split_once(" (")?
        .1
        .strip_suffix(')')
}

#[tokio::test]
async fn the_host_runs_in_cluster_from_its_image_and_survives_a_rollout_restart() {
    let client = client().await;
    let node = real_node(&client).await.unwrap();
    require_images(&client, &node, &[IMAGE, "postgres:16.15"])
        .await
        .unwrap();
    let control_plane = ControlPlane::from_env();
    let _deployed = Deployed;
    apply("deploy");
    await_rolled_out(&client, 2).await;
    let first_pods = capstan_pods(&client).await;
    assert_eq!(first_pods.len(), 2);
    for pod in &first_pods {
        assert!(is_ready(pod), "{:?} is not Ready", pod.metadata.name);
    }

    // The leader, one of the Pods, reconciles a Uuid and a PostgreSQLCluster.
    let namespace = TestNamespace::new(&client, "incluster").await;
    let ns = namespace.name.clone();
    let uuids = Api::<DynamicObject>::namespaced_with(client.clone(), &ns, &uuid_kind());
    let pgcs = Api::<DynamicObject>::namespaced_with(client.clone(), &ns, &postgres_kind());
    let uuid = |name: &str| -> DynamicObject {
        serde_json::from_value(
            json!({"apiVersion": "demo.operator/v1", "kind": "Uuid", "metadata": {"name": name}}),
        )
        .unwrap()
    };
    uuids
        .create(&PostParams::default(), &uuid("u"))
        .await
        .unwrap();
    let pgc: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "db.example.com/v1alpha1", "kind": "PostgreSQLCluster",
        "metadata": {"name": "pg"}, "spec": {"replicas": 1, "version": "16.15", "storage": "1Gi"},
    }))
    .unwrap();
    pgcs.create(&PostParams::default(), &pgc).await.unwrap();
    let logs = || {
        kubectl(&[
            "logs",
            "-n",
            NS,
            "-l",
            "app.kubernetes.io/name=capstan",
            "--tail=40",
        ])
        .unwrap_or_default()
    };
    wait_for(
        "the Uuid and the PostgreSQLCluster reconciled",
        T,
        || async {
            let u = uuids.get("u").await?;
            let p = pgcs.get("pg").await?;
            let done = u.data.pointer("/status/uuid").is_some()
                && p.data.pointer("/status/phase") == Some(&json!("Running"));
            Ok(done.then_some(()))
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", logs()));
    let lease = Api::<Lease>::namespaced(client.clone(), NS)
        .get("capstan")
        .await
        .unwrap();
    let holder = lease
        .spec
        .and_then(|s| s.holder_identity)
        .unwrap_or_default();
    assert!(
        first_pods
            .iter()
            .any(|p| p.metadata.name.as_deref() == Some(holder.as_str())),
        "the Lease is held by {holder:?}, not one of the Pods"
    );

    // The first Pods' memory, before the restart replaces them.
    let mut peaks = BTreeMap::new();
    for pod in live_capstan_pods(&client).await {
        peaks.insert(
            pod.metadata.name.clone().unwrap_or_default(),
            check_memory(&pod),
        );
    }

    // A rollout restart while parents are being created: every one is reconciled, and
    // the writes of the old and the new leader never interleave.
    let restart_from = chrono_now();
    kubectl(&["rollout", "restart", "deployment/capstan", "-n", NS]).unwrap();
    for i in 0..20 {
        uuids
            .create(&PostParams::default(), &uuid(&format!("during-{i}")))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    await_rolled_out(&client, 2).await;
    wait_for("all 21 Uuids reconciled after the restart", T, || async {
        let list = uuids.list(&ListParams::default()).await?;
        let done = list.items.len() == 21
            && list
                .items
                .iter()
                .all(|u| u.data.pointer("/status/uuid").is_some());
        Ok(done.then_some(()))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", logs()));
    let audited: Vec<_> = control_plane
        .audit_events(&ns)
        .unwrap()
        .into_iter()
        .filter(|e| e.object_ref.resource == "uuid" && e.object_ref.namespace == ns)
        .filter(|e| matches!(e.verb.as_str(), "create" | "update" | "patch"))
        .filter(|e| identity_of(&e.user_agent).is_some())
        .collect();
    // deploy/ runs with plugin identities: every write for the Uuid plugin is made as its
    // own account, impersonated by the host's.
    let account = format!("system:serviceaccount:{NS}:capstan-plugin-uuid");
    for event in &audited {
        assert_eq!(
            event
                .impersonated_user
                .as_ref()
                .map(|u| u.username.as_str()),
            Some(account.as_str()),
            "a write for the Uuid plugin made as {} without its account: {} {}/{}",
            event.user.username,
            event.verb,
            event.object_ref.resource,
            event.object_ref.name
        );
    }
    let writes: Vec<String> = audited
        .iter()
        .filter(|e| e.received().is_some_and(|t| t >= restart_from))
        .filter_map(|e| identity_of(&e.user_agent).map(str::to_owned))
        .collect();
    assert!(
        !writes.is_empty(),
        "no capstan write to the Uuids was audited"
    );
    assert_one_writer_at_a_time(&writes, "the Uuids");

    // Memory: no Pod, old (checked above) or new, restarted or went over its limit.
    for pod in live_capstan_pods(&client).await {
        peaks.insert(
            pod.metadata.name.clone().unwrap_or_default(),
            check_memory(&pod),
        );
    }
    eprintln!("capstan Pods' peak memory (bytes): {peaks:?}");

    // The role is enough (nothing refused in the logs) and no more.
    let all_logs = kubectl(&[
        "logs",
        "-n",
        NS,
        "-l",
        "app.kubernetes.io/name=capstan",
        "--tail=-1",
    ])
    .unwrap();
    assert!(
        !all_logs.contains("Forbidden"),
        "a request of capstan was refused:\n{all_logs}"
    );
    let token = service_account_token(&client, NS, "capstan").await.unwrap();
    let restricted = client_with_token(&token).await.unwrap();
    let err = Api::<CustomResourceDefinition>::all(restricted.clone())
        .delete("uuid.demo.operator", &DeleteParams::default())
        .await
        .unwrap_err();
    assert!(is_forbidden(&err), "{err}");
    let err = Api::<Namespace>::all(restricted.clone())
        .delete(&ns, &DeleteParams::default())
        .await
        .unwrap_err();
    assert!(is_forbidden(&err), "{err}");
    let err = Api::<Deployment>::namespaced(restricted, NS)
        .list(&Default::default())
        .await
        .unwrap_err();
    assert!(is_forbidden(&err), "{err}");

    // deploy/sharded: three real replicas share the parents.
    apply("deploy/sharded");
    await_rolled_out(&client, 3).await;
    let sharded_from = chrono_now();
    for i in 0..30 {
        uuids
            .create(&PostParams::default(), &uuid(&format!("sharded-{i}")))
            .await
            .unwrap();
    }
    wait_for(
        "all 51 Uuids reconciled by the sharded replicas",
        T,
        || async {
            let list = uuids.list(&ListParams::default()).await?;
            let done = list.items.len() == 51
                && list
                    .items
                    .iter()
                    .all(|u| u.data.pointer("/status/uuid").is_some());
            Ok(done.then_some(()))
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", logs()));
    let mut writers: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for event in control_plane.audit_events(&ns).unwrap() {
        let sharded_parent = event.object_ref.name.starts_with("sharded-");
        if event.object_ref.resource == "uuid"
            && sharded_parent
            && event.object_ref.subresource == "status"
            && event.received().is_some_and(|t| t >= sharded_from)
            && let Some(identity) = identity_of(&event.user_agent)
        {
            writers
                .entry(event.object_ref.name.clone())
                .or_default()
                .push(identity.to_owned());
        }
    }
    let replicas: BTreeSet<&String> = writers.values().flatten().collect();
    assert!(
        replicas.len() >= 2,
        "the parents were not shared: written by {replicas:?}"
    );
    // A bucket may move while the replicas join, but a parent never has two writers
    // at once.
    for (parent, by) in &writers {
        assert_one_writer_at_a_time(by, parent);
    }
    for pod in live_capstan_pods(&client).await {
        check_memory(&pod);
    }
    namespace.delete(T).await.unwrap();

    // Uninstalling leaves no webhook behind: the ValidatingWebhookConfiguration the
    // hosts wrote (the PostgreSQL plugin validates) is owned by the ClusterRole, and the
    // garbage collector deletes it with it.
    let webhooks = Api::<ValidatingWebhookConfiguration>::all(client.clone());
    let written = webhooks.get("capstan").await.unwrap();
    let owners = written.metadata.owner_references.unwrap_or_default();
    assert!(
        owners
            .iter()
            .any(|o| o.kind == "ClusterRole" && o.name == "capstan"),
        "the configuration is not owned by the ClusterRole capstan: {owners:?}"
    );
    // deploy/base: the host without the CRDs, which the later tests use.
    kubectl(&[
        "delete",
        "-k",
        &root().join("deploy/base").to_string_lossy(),
        "--wait=true",
        "--timeout=120s",
    ])
    .unwrap_or_else(|e| panic!("{e}"));
    wait_for(
        "the ValidatingWebhookConfiguration deleted with its ClusterRole",
        Duration::from_secs(60),
        || async {
            let left = webhooks.get_opt("capstan").await?;
            Ok(left.is_none().then_some(()))
        },
    )
    .await
    .unwrap();
}

/// Now, as the audit log's timestamps compare.
fn chrono_now() -> k8s_openapi::jiff::Timestamp {
    k8s_openapi::jiff::Timestamp::now()
}
