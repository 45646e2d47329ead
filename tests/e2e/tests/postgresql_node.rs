//! The PostgreSQLCluster plugin on the cluster's real node: the instances run
//! PostgreSQL for real (the `postgres:16.14` and `postgres:16.15` images `cargo xtask
//! image` builds), and every claim is checked with a query, never with a Pod phase:
//! writes through `<name>-rw` land on instance 0, both standbys stream (in
//! `pg_stat_replication`) and serve what the primary wrote through `<name>-r`, scaling
//! 3 → 1 → 3 brings the standbys back, a minor version change rolls the instances with
//! the data intact, a deleted instance 0 comes back as the primary with its data, and
//! the dump CronJob, run once by hand, writes a dump that restores into a fresh
//! database. A `Database` with `engine: postgresql` reaches a working database too.
//!
//! High availability, under a client that writes numbered rows through `<name>-rw` and
//! records each commit it got acknowledged, with synchronous replication: the primary's
//! node is cordoned and its Pod deleted, a standby is primary and takes writes within
//! 30 s, every acknowledged row is on it, the old instance rejoins as a streaming
//! standby once the node takes Pods again, and a switchover through `spec.primary`
//! hands the role back, again without losing an acknowledged row. The write outages
//! are printed (docs/performance.md keeps them).

use std::time::Duration;

use capstan_e2e::node::{
    await_ready_pods, exec, image_of, kubectl, kubectl_with_input, real_node, require_images,
    superuser_sql,
};
use capstan_e2e::objects::{events_about, postgres_kind};
use capstan_e2e::operator::{Operator, plugin};
use capstan_e2e::{TestNamespace, client, wait_for};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

/// Pods start in seconds; PostgreSQL's initdb and a base backup take a few more.
const T: Duration = Duration::from_secs(240);
const OLD: &str = "16.14";
const NEW: &str = "16.15";

fn instance_names(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("pg-{i}")).collect()
}

const INSTANCES: &str = "app.kubernetes.io/name=postgresql,app.kubernetes.io/instance=pg";

/// The tests take turns: each runs a host that points the PostgreSQLCluster CRD's
/// conversion webhook at itself, and the objects they write as v1alpha1 are converted
/// through it; a host that stops first would leave the other's conversions failing.
static TURNS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn patch_spec(client: &Client, ns: &str, name: &str, spec: Value) {
    Api::<DynamicObject>::namespaced_with(client.clone(), ns, &postgres_kind())
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": spec})),
        )
        .await
        .unwrap();
}

/// A Pod that stays up to run `psql` from, with the credentials Secret's keys as libpq's
/// environment (PGHOST is the Secret's `host`: the `-rw` Service's DNS name).
fn client_pod(secret: &str) -> Value {
    let from_secret = |name: &str, key: &str| json!({"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}});
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "client"},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "securityContext": {"runAsUser": 999, "runAsGroup": 999, "runAsNonRoot": true},
            "containers": [{
                "name": "client", "image": format!("postgres:{NEW}"),
                "command": ["sleep", "infinity"],
                "env": [
                    from_secret("PGHOST", "host"), from_secret("PGPORT", "port"),
                    from_secret("PGUSER", "username"), from_secret("PGPASSWORD", "password"),
                    from_secret("PGDATABASE", "dbname"),
                ],
            }],
        },
    })
}

/// `sql` through libpq from the client Pod, with `host` (default: PGHOST, the `-rw`
/// Service from the Secret).
fn client_sql(ns: &str, host: Option<&str>, sql: &str) -> anyhow::Result<String> {
    let mut command = vec!["psql", "-X", "-q", "-At", "-v", "ON_ERROR_STOP=1"];
    if let Some(host) = host {
        command.extend(["-h", host]);
    }
    command.extend(["-c", sql]);
    exec(ns, "client", "client", &command)
}

/// [`client_sql`], retried until it connects: after a rollout or a restart the Service's
/// endpoints and kube-proxy's rules follow the new Pod a moment later, as real clients
/// see it.
async fn client_sql_retried(ns: &str, host: Option<&str>, sql: &str) -> anyhow::Result<String> {
    wait_for(&format!("an answer to {sql:?}"), T, || async {
        client_sql(ns, host, sql).map(Some)
    })
    .await
}

/// Waits until the primary `pg-0` reports `n` standbys streaming.
async fn await_streaming(ns: &str, n: usize) -> anyhow::Result<()> {
    wait_for(&format!("{n} standbys streaming"), T, || async {
        let count = superuser_sql(
            ns,
            "pg-0",
            "postgres",
            "postgres",
            "select count(*) from pg_stat_replication where state = 'streaming'",
        )?;
        Ok((count == n.to_string()).then_some(()))
    })
    .await
}

/// Waits until a query through the `-r` Service is answered by a standby with `want`.
async fn await_read_from_standby(ns: &str, sql: &str, want: &str) -> anyhow::Result<()> {
    let host = format!("pg-r.{ns}.svc");
    wait_for(
        &format!("{want:?} read from a standby through {host}"),
        T,
        || async {
            let sql = format!("select pg_is_in_recovery(), ({sql})");
            let got = client_sql(ns, Some(&host), &sql)?;
            Ok((got == format!("t|{want}")).then_some(()))
        },
    )
    .await
}

fn pod_ip(pod: &Pod) -> String {
    pod.status
        .as_ref()
        .and_then(|s| s.pod_ip.clone())
        .unwrap_or_default()
}

#[tokio::test]
async fn a_postgresql_cluster_replicates_scales_upgrades_restarts_and_restores_for_real() {
    let _turn = TURNS.lock().await;
    let client = client().await;
    let node = real_node(&client).await.unwrap();
    require_images(
        &client,
        &node,
        &[&format!("postgres:{OLD}"), &format!("postgres:{NEW}")],
    )
    .await
    .unwrap();
    let namespace = TestNamespace::new(&client, "pgnode").await;
    let ns = namespace.name.clone();
    let op = Operator::start(&ns, &[&plugin("postgresql")], &[]).await;
    let fail = |e: anyhow::Error| -> ! {
        let pods = kubectl(&["get", "pods", "-n", &ns, "-o", "wide"]).unwrap_or_default();
        let events = kubectl(&["get", "events", "-n", &ns]).unwrap_or_default();
        panic!("{e:#}\n{pods}\n{events}\n{}", op.log_tail())
    };

    // Three instances of the older minor, with a dump schedule. No failover here (the
    // delay is longer than the test): pg-0 stays the primary through its restarts, and
    // this test checks that path; the next one fails over.
    let pgc: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "db.example.com/v1alpha1", "kind": "PostgreSQLCluster",
        "metadata": {"name": "pg"},
        "spec": {"replicas": 3, "version": OLD, "storage": "1Gi", "backupSchedule": "0 3 * * *",
                 "failoverDelay": 3600},
    }))
    .unwrap();
    Api::<DynamicObject>::namespaced_with(client.clone(), &ns, &postgres_kind())
        .create(&PostParams::default(), &pgc)
        .await
        .unwrap();
    let pods = await_ready_pods(&client, &ns, INSTANCES, &instance_names(3), T)
        .await
        .unwrap_or_else(|e| fail(e));
    for pod in &pods {
        assert_eq!(image_of(pod), format!("postgres:{OLD}"));
    }
    let version = superuser_sql(&ns, "pg-0", "postgres", "postgres", "show server_version")
        .unwrap_or_else(|e| fail(e));
    assert!(version.starts_with(OLD), "server_version {version}");

    // The credentials Secret from a client Pod: writes through pg-rw land on pg-0.
    let client_pod: Pod = serde_json::from_value(client_pod("pg-credentials")).unwrap();
    let pods_api = Api::<Pod>::namespaced(client.clone(), &ns);
    pods_api
        .create(&PostParams::default(), &client_pod)
        .await
        .unwrap();
    await_ready_pods(
        &client,
        &ns,
        "",
        &{
            let mut all = instance_names(3);
            all.push("client".into());
            all
        },
        T,
    )
    .await
    .unwrap_or_else(|e| fail(e));
    let primary_ip = pod_ip(&pods_api.get("pg-0").await.unwrap());
    // Retried: the Pods are Ready, but pg-rw's endpoints and kube-proxy's rules follow a
    // moment later (a refused connection ran nothing, so the retry is safe).
    let served_by = client_sql_retried(
        &ns,
        None,
        "create table t (id int primary key, v text); \
         insert into t values (1, 'before'); \
         select host(inet_server_addr())",
    )
    .await
    .unwrap_or_else(|e| fail(e));
    assert_eq!(
        served_by, primary_ip,
        "the write went to pg-0 ({primary_ip})"
    );

    // Both standbys stream, and a standby serves the row through pg-r.
    await_streaming(&ns, 2).await.unwrap_or_else(|e| fail(e));
    await_read_from_standby(&ns, "select v from t where id = 1", "before")
        .await
        .unwrap_or_else(|e| fail(e));

    // 3 → 1 → 3: the standbys come back, copy the primary again and stream.
    patch_spec(&client, &ns, "pg", json!({"replicas": 1})).await;
    await_ready_pods(&client, &ns, INSTANCES, &instance_names(1), T)
        .await
        .unwrap_or_else(|e| fail(e));
    await_streaming(&ns, 0).await.unwrap_or_else(|e| fail(e));
    client_sql_retried(&ns, None, "insert into t values (2, 'while alone')")
        .await
        .unwrap_or_else(|e| fail(e));
    patch_spec(&client, &ns, "pg", json!({"replicas": 3})).await;
    await_ready_pods(&client, &ns, INSTANCES, &instance_names(3), T)
        .await
        .unwrap_or_else(|e| fail(e));
    await_streaming(&ns, 2).await.unwrap_or_else(|e| fail(e));
    await_read_from_standby(&ns, "select v from t where id = 2", "while alone")
        .await
        .unwrap_or_else(|e| fail(e));

    // A minor version change rolls every instance onto the new image; the data stays.
    patch_spec(&client, &ns, "pg", json!({"version": NEW})).await;
    wait_for(&format!("every instance on postgres:{NEW}"), T, || async {
        let pods = await_ready_pods(
            &client,
            &ns,
            INSTANCES,
            &instance_names(3),
            Duration::from_secs(5),
        )
        .await;
        Ok(pods
            .ok()
            .filter(|pods| {
                pods.iter()
                    .all(|p| image_of(p) == format!("postgres:{NEW}"))
            })
            .map(drop))
    })
    .await
    .unwrap_or_else(|e| fail(e));
    let version = superuser_sql(&ns, "pg-0", "postgres", "postgres", "show server_version")
        .unwrap_or_else(|e| fail(e));
    assert!(version.starts_with(NEW), "server_version {version}");
    let rows = client_sql_retried(&ns, None, "select string_agg(v, ',' order by id) from t")
        .await
        .unwrap_or_else(|e| fail(e));
    assert_eq!(
        rows, "before,while alone",
        "the data survived the minor upgrade"
    );
    await_streaming(&ns, 2).await.unwrap_or_else(|e| fail(e));

    // pg-0 deleted: it comes back as the primary, with its data, and is written to.
    let old_uid = pods_api.get("pg-0").await.unwrap().metadata.uid;
    pods_api
        .delete("pg-0", &DeleteParams::default())
        .await
        .unwrap();
    wait_for("a new pg-0, Ready", T, || async {
        let pod = pods_api.get_opt("pg-0").await?;
        Ok(pod
            .filter(|p| p.metadata.uid != old_uid && capstan_e2e::node::is_ready(p))
            .map(drop))
    })
    .await
    .unwrap_or_else(|e| fail(e));
    let recovery = superuser_sql(
        &ns,
        "pg-0",
        "postgres",
        "postgres",
        "select pg_is_in_recovery()",
    )
    .unwrap_or_else(|e| fail(e));
    assert_eq!(recovery, "f", "pg-0 came back as the primary");
    client_sql_retried(
        &ns,
        None,
        "insert into t values (3, 'after') on conflict do nothing",
    )
    .await
    .unwrap_or_else(|e| fail(e));
    let rows = client_sql_retried(&ns, None, "select string_agg(v, ',' order by id) from t")
        .await
        .unwrap_or_else(|e| fail(e));
    assert_eq!(rows, "before,while alone,after");
    await_streaming(&ns, 2).await.unwrap_or_else(|e| fail(e));

    // The dump CronJob, triggered by hand, writes a dump that restores elsewhere.
    kubectl(&[
        "create",
        "job",
        "-n",
        &ns,
        "--from=cronjob/pg-dump",
        "pg-dump-now",
    ])
    .unwrap_or_else(|e| fail(e));
    let jobs = Api::<Job>::namespaced(client.clone(), &ns);
    wait_for("the dump Job to succeed", T, || async {
        let job = jobs.get("pg-dump-now").await?;
        let status = job.status.unwrap_or_default();
        if status.failed.unwrap_or(0) > 0 {
            anyhow::bail!("the dump Job failed: {status:?}");
        }
        Ok((status.succeeded == Some(1)).then_some(()))
    })
    .await
    .unwrap_or_else(|e| fail(e));
    superuser_sql(
        &ns,
        "pg-0",
        "postgres",
        "postgres",
        "create database restored owner app",
    )
    .unwrap_or_else(|e| fail(e));
    let restore = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "restore"},
        "spec": {
            "restartPolicy": "Never",
            "securityContext": {"runAsUser": 999, "runAsGroup": 999, "fsGroup": 999},
            "containers": [{
                "name": "restore", "image": format!("postgres:{NEW}"),
                "command": ["bash", "-ec",
                    "dump=$(ls /dumps/pg-*.dump | tail -n 1); echo \"restoring $dump\"; \
                     pg_restore --no-owner --exit-on-error -d restored \"$dump\""],
                "env": [
                    {"name": "PGHOST", "valueFrom": {"secretKeyRef": {"name": "pg-credentials", "key": "host"}}},
                    {"name": "PGUSER", "valueFrom": {"secretKeyRef": {"name": "pg-credentials", "key": "username"}}},
                    {"name": "PGPASSWORD", "valueFrom": {"secretKeyRef": {"name": "pg-credentials", "key": "password"}}},
                ],
                "volumeMounts": [{"name": "dumps", "mountPath": "/dumps", "readOnly": true}],
            }],
            "volumes": [{"name": "dumps", "persistentVolumeClaim": {"claimName": "pg-dumps"}}],
        },
    });
    kubectl_with_input(&["apply", "-n", &ns, "-f", "-"], Some(&restore.to_string()))
        .unwrap_or_else(|e| fail(e));
    wait_for("the restore Pod to succeed", T, || async {
        let pod = pods_api.get("restore").await?;
        match pod.status.and_then(|s| s.phase).as_deref() {
            Some("Succeeded") => Ok(Some(())),
            Some("Failed") => anyhow::bail!(
                "the restore failed: {}",
                kubectl(&["logs", "-n", &ns, "restore"]).unwrap_or_default()
            ),
            _ => Ok(None),
        }
    })
    .await
    .unwrap_or_else(|e| fail(e));
    let restored = superuser_sql(
        &ns,
        "pg-0",
        "postgres",
        "restored",
        "select string_agg(v, ',' order by id) from t",
    )
    .unwrap_or_else(|e| fail(e));
    assert_eq!(restored, "before,while alone,after", "the dump restored");

    drop(op);
    namespace.delete(T).await.unwrap();
}

/// Seed 000's Database with `engine: postgresql`, through the Database plugin and the
/// PostgreSQL plugin it composes: a working database, reached with its credentials.
#[tokio::test]
async fn a_postgresql_database_is_a_working_database() {
    let _turn = TURNS.lock().await;
    let client = client().await;
    let node = real_node(&client).await.unwrap();
    require_images(&client, &node, &[&format!("postgres:{NEW}")])
        .await
        .unwrap();
    let namespace = TestNamespace::new(&client, "dbnode").await;
    let ns = namespace.name.clone();
    let op = Operator::start(&ns, &[&plugin("postgresql"), &plugin("database")], &[]).await;
    let fail = |e: anyhow::Error| -> ! {
        let pods = kubectl(&["get", "pods", "-n", &ns, "-o", "wide"]).unwrap_or_default();
        panic!("{e:#}\n{pods}\n{}", op.log_tail())
    };
    let databases = Api::<DynamicObject>::namespaced_with(
        client.clone(),
        &ns,
        &ApiResource {
            group: "mycompany.com".into(),
            version: "v1".into(),
            api_version: "mycompany.com/v1".into(),
            kind: "Database".into(),
            plural: "databases".into(),
        },
    );
    let db: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "mycompany.com/v1", "kind": "Database",
        "metadata": {"name": "app"},
        "spec": {"engine": "postgresql", "version": "16", "storage": "1Gi", "replicas": 1},
    }))
    .unwrap();
    databases.create(&PostParams::default(), &db).await.unwrap();
    let db = wait_for("the Database to be Running", T, || async {
        let db = databases.get("app").await?;
        let running = db.data.pointer("/status/phase") == Some(&json!("Running"));
        Ok(running.then_some(db))
    })
    .await
    .unwrap_or_else(|e| fail(e));
    assert_eq!(db.data.pointer("/status/version"), Some(&json!(NEW)));

    let client_pod: Pod = serde_json::from_value(client_pod("app-credentials")).unwrap();
    Api::<Pod>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &client_pod)
        .await
        .unwrap();
    await_ready_pods(
        &client,
        &ns,
        "",
        &["app-0".to_string(), "client".to_string()],
        T,
    )
    .await
    .unwrap_or_else(|e| fail(e));
    // A new Service: its endpoints and kube-proxy's rules follow the ready Pod a moment
    // later (the statements run in one transaction: a refused connection ran none).
    let answer = client_sql_retried(
        &ns,
        None,
        "create table greeting (text text); insert into greeting values ('hello'); \
         select text || ' from ' || current_database() || ' on ' || current_setting('server_version') from greeting",
    )
    .await
    .unwrap_or_else(|e| fail(e));
    assert!(
        answer.starts_with(&format!("hello from app on {NEW}")),
        "{answer}"
    );
    drop(op);
    namespace.delete(T).await.unwrap();
}

/// A Pod that writes numbered rows through `<name>-rw` (the Secret's `host`) in a loop,
/// one connection and one commit each, and appends `id unix-time` to /tmp/acked for each
/// commit acknowledged within 5 s. A commit still waiting then is abandoned (its psql is
/// killed): it was never acknowledged.
fn writer_pod(secret: &str) -> Value {
    let mut pod = client_pod(secret);
    pod["metadata"]["name"] = json!("writer");
    pod["spec"]["containers"][0]["name"] = json!("writer");
    pod["spec"]["containers"][0]["command"] = json!([
        "bash",
        "-c",
        r#"
export PGCONNECT_TIMEOUT=2
until psql -X -q -c 'create table if not exists acked (id int primary key)' 2>/dev/null; do sleep 1; done
: >/tmp/acked
i=0
while :; do
  i=$((i + 1))
  if timeout 5 psql -X -q -v ON_ERROR_STOP=1 -c "insert into acked values ($i)" >/dev/null 2>&1; then
    echo "$i $(date +%s.%N)" >>/tmp/acked
  fi
  sleep 0.05
done
"#
    ]);
    pod
}

/// The acknowledged commits so far: (id, unix time).
fn acknowledged(ns: &str) -> anyhow::Result<Vec<(i64, f64)>> {
    let text = exec(ns, "writer", "writer", &["cat", "/tmp/acked"])?;
    Ok(text
        .lines()
        .filter_map(|l| {
            let (id, at) = l.split_once(' ')?;
            Some((id.parse().ok()?, at.parse().ok()?))
        })
        .collect())
}

/// Waits until the writer has `more` commits acknowledged after `since` (unix time);
/// returns the time of the first.
async fn acknowledged_after(
    ns: &str,
    since: f64,
    more: usize,
    within: Duration,
) -> anyhow::Result<f64> {
    wait_for(&format!("{more} commits acknowledged"), within, || async {
        let after: Vec<f64> = acknowledged(ns)?
            .into_iter()
            .map(|(_, at)| at)
            .filter(|at| *at > since)
            .collect();
        Ok((after.len() >= more).then(|| after[0]))
    })
    .await
}

/// The longest time without an acknowledged commit after `since`.
fn longest_gap(acked: &[(i64, f64)], since: f64) -> f64 {
    let times: Vec<f64> = acked
        .iter()
        .map(|(_, at)| *at)
        .filter(|at| *at >= since)
        .collect();
    times.windows(2).map(|w| w[1] - w[0]).fold(0.0, f64::max)
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// Every acknowledged id is in `acked` on the primary behind `<name>-rw`.
async fn assert_none_lost(ns: &str, what: &str) {
    let acked = acknowledged(ns).unwrap();
    assert!(!acked.is_empty(), "{what}: nothing was acknowledged");
    let sql = "select string_agg(id::text, ',') from acked";
    let stored = wait_for("the stored ids through -rw", T, || async {
        exec(
            ns,
            "writer",
            "writer",
            &["psql", "-X", "-q", "-At", "-c", sql],
        )
        .map(Some)
    })
    .await
    .unwrap();
    let stored: std::collections::HashSet<i64> =
        stored.split(',').filter_map(|i| i.parse().ok()).collect();
    let lost: Vec<i64> = acked
        .iter()
        .map(|(id, _)| *id)
        .filter(|id| !stored.contains(id))
        .collect();
    assert!(
        lost.is_empty(),
        "{what}: {} acknowledged commits are missing: {lost:?}",
        lost.len()
    );
}

/// The status field `field` of the PostgreSQLCluster `ha`.
async fn status_of(client: &Client, ns: &str, field: &str) -> Value {
    Api::<DynamicObject>::namespaced_with(client.clone(), ns, &postgres_kind())
        .get("ha")
        .await
        .map(|o| o.data["status"][field].clone())
        .unwrap_or(Value::Null)
}

/// Uncordons the node when dropped, also when the test fails.
struct Cordoned(String);

impl Cordoned {
    fn new(node: &str) -> Self {
        kubectl(&["cordon", node]).unwrap();
        Cordoned(node.to_owned())
    }
}

impl Drop for Cordoned {
    fn drop(&mut self) {
        let _ = kubectl(&["uncordon", &self.0]);
    }
}

#[tokio::test]
async fn failover_and_switchover_under_load_lose_no_acknowledged_commit() {
    let _turn = TURNS.lock().await;
    let client = client().await;
    let node = real_node(&client).await.unwrap();
    require_images(&client, &node, &[&format!("postgres:{NEW}")])
        .await
        .unwrap();
    let namespace = TestNamespace::new(&client, "pgha").await;
    let ns = namespace.name.clone();
    // In a cell: the failure report reads its log, and the test restarts it.
    let op = std::cell::RefCell::new(Some(
        Operator::start(&ns, &[&plugin("postgresql")], &[]).await,
    ));
    let log = |op: &std::cell::RefCell<Option<Operator>>| {
        op.borrow().as_ref().map(Operator::log).unwrap_or_default()
    };
    let log_tail = |op: &std::cell::RefCell<Option<Operator>>| {
        op.borrow()
            .as_ref()
            .map(Operator::log_tail)
            .unwrap_or_default()
    };
    let fail = |e: anyhow::Error| -> ! {
        let pods = kubectl(&["get", "pods", "-n", &ns, "-o", "wide"]).unwrap_or_default();
        let events = kubectl(&["get", "events", "-n", &ns]).unwrap_or_default();
        let pgc = kubectl(&["get", "pgc", "-n", &ns, "-o", "yaml"]).unwrap_or_default();
        let logs: String = (0..3)
            .map(|i| {
                let pod = format!("ha-{i}");
                let log = kubectl(&["logs", "-n", &ns, &pod, "--tail", "40"]).unwrap_or_default();
                format!("--- {pod}\n{log}\n")
            })
            .collect();
        panic!("{e:#}\n{pods}\n{events}\n{pgc}\n{logs}\n{}", log_tail(&op))
    };
    let instances = "app.kubernetes.io/name=postgresql,app.kubernetes.io/instance=ha";
    let names = |n: usize| -> Vec<String> { (0..n).map(|i| format!("ha-{i}")).collect() };

    let pgc: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "db.example.com/v1alpha1", "kind": "PostgreSQLCluster",
        "metadata": {"name": "ha"},
        "spec": {"replicas": 3, "version": NEW, "storage": "1Gi",
                 "synchronous": true, "failoverDelay": 5},
    }))
    .unwrap();
    Api::<DynamicObject>::namespaced_with(client.clone(), &ns, &postgres_kind())
        .create(&PostParams::default(), &pgc)
        .await
        .unwrap();
    await_ready_pods(&client, &ns, instances, &names(3), T)
        .await
        .unwrap_or_else(|e| fail(e));
    wait_for("both standbys confirming commits as a quorum", T, || async {
        let rows = superuser_sql(
            &ns,
            "ha-0",
            "postgres",
            "postgres",
            "select string_agg(application_name || ':' || state || ':' || sync_state, ',' order by application_name) from pg_stat_replication",
        )?;
        Ok((rows == "ha-1:streaming:quorum,ha-2:streaming:quorum").then_some(()))
    })
    .await
    .unwrap_or_else(|e| fail(e));
    // The agents report through the API server, with nothing but the right to patch
    // the report ConfigMap: every instance in the status, ha-0 as the primary.
    wait_for("every instance's report in the status", T, || async {
        let reported = status_of(&client, &ns, "instances").await;
        let roles: Vec<String> = reported
            .as_array()
            .into_iter()
            .flatten()
            .map(|i| {
                format!(
                    "{}:{}:{}",
                    i["name"].as_str().unwrap_or("?"),
                    i["role"].as_str().unwrap_or("?"),
                    i["timeline"]
                )
            })
            .collect();
        Ok((roles == ["ha-0:primary:1", "ha-1:standby:1", "ha-2:standby:1"]).then_some(()))
    })
    .await
    .unwrap_or_else(|e| fail(e));

    let pods_api = Api::<Pod>::namespaced(client.clone(), &ns);
    let writer: Pod = serde_json::from_value(writer_pod("ha-credentials")).unwrap();
    pods_api
        .create(&PostParams::default(), &writer)
        .await
        .unwrap();
    acknowledged_after(&ns, 0.0, 20, T)
        .await
        .unwrap_or_else(|e| fail(e));

    // Failover: the node takes no new Pod, and the primary's Pod is deleted.
    let cordoned = Cordoned::new(&node);
    let lost_at = unix_now();
    pods_api
        .delete("ha-0", &DeleteParams::default())
        .await
        .unwrap();
    // Mid-failover, once the decision is taken: the host restarts, and the plugin is
    // reloaded (a build with other bytes). Neither makes a second primary.
    wait_for("the failover decided", T, || async {
        Ok((status_of(&client, &ns, "epoch").await == 2).then_some(()))
    })
    .await
    .unwrap_or_else(|e| fail(e));
    let mut host = op.borrow_mut().take().unwrap();
    host.restart().await;
    let plugins = host.plugins.path().to_path_buf();
    *op.borrow_mut() = Some(host);
    std::fs::write(
        plugins.join("postgresql.wasm"),
        with_custom_section(&std::fs::read(plugin("postgresql")).unwrap()),
    )
    .unwrap();
    wait_for("the plugin reloaded", T, || async {
        Ok(log(&op).contains("plugin replaced").then_some(()))
    })
    .await
    .unwrap_or_else(|e| fail(e));
    let primary = wait_for("a standby promoted", Duration::from_secs(120), || async {
        let target = status_of(&client, &ns, "targetPrimary").await;
        let Some(target) = target.as_str().filter(|t| *t != "ha-0") else {
            return Ok(None);
        };
        let recovery = superuser_sql(
            &ns,
            target,
            "postgres",
            "postgres",
            "select pg_is_in_recovery()",
        )?;
        Ok((recovery == "f").then(|| target.to_owned()))
    })
    .await
    .unwrap_or_else(|e| fail(e));
    let promoted = unix_now() - lost_at;
    let primaries = || async {
        let mut serving = Vec::new();
        for pod in ["ha-1", "ha-2"] {
            if superuser_sql(
                &ns,
                pod,
                "postgres",
                "postgres",
                "select pg_is_in_recovery()",
            )
            .is_ok_and(|r| r == "f")
            {
                serving.push(pod);
            }
        }
        serving
    };
    capstan_e2e::holds_for(
        &format!("{primary} the only primary"),
        Duration::from_secs(10),
        || async { Ok(primaries().await == [primary.as_str()]) },
    )
    .await
    .unwrap_or_else(|e| fail(e));
    acknowledged_after(&ns, unix_now(), 20, T)
        .await
        .unwrap_or_else(|e| fail(e));
    assert_none_lost(&ns, "after the failover").await;
    // The outage: the longest time without an acknowledged commit since the loss.
    let failover_gap = longest_gap(&acknowledged(&ns).unwrap(), lost_at - 1.0);
    assert!(
        promoted < 30.0 && failover_gap < 30.0,
        "{primary} was primary {promoted:.1} s after the primary was lost, and writes stopped for {failover_gap:.1} s: not within 30 s"
    );

    // The node takes Pods again: the old primary comes back, rewinds, and streams.
    drop(cordoned);
    await_ready_pods(&client, &ns, instances, &names(3), T)
        .await
        .unwrap_or_else(|e| fail(e));
    wait_for(
        "both other instances streaming from the new primary",
        T,
        || async {
            let rows = superuser_sql(
                &ns,
                &primary,
                "postgres",
                "postgres",
                "select count(*) from pg_stat_replication where state = 'streaming'",
            )?;
            Ok((rows == "2").then_some(()))
        },
    )
    .await
    .unwrap_or_else(|e| fail(e));
    assert_eq!(
        superuser_sql(
            &ns,
            "ha-0",
            "postgres",
            "postgres",
            "select pg_is_in_recovery()"
        )
        .unwrap_or_else(|e| fail(e)),
        "t",
        "the old primary is a standby"
    );

    // Switchover back to ha-0 through spec.primary.
    let asked = unix_now();
    patch_spec(&client, &ns, "ha", json!({"primary": "ha-0"})).await;
    wait_for("ha-0 primary", T, || async {
        let current = status_of(&client, &ns, "currentPrimary").await;
        let recovery = superuser_sql(
            &ns,
            "ha-0",
            "postgres",
            "postgres",
            "select pg_is_in_recovery()",
        )?;
        Ok((current == "ha-0" && recovery == "f").then_some(()))
    })
    .await
    .unwrap_or_else(|e| fail(e));
    let after = acknowledged_after(&ns, unix_now(), 20, T)
        .await
        .unwrap_or_else(|e| fail(e));
    assert_none_lost(&ns, "after the switchover").await;
    let switchover_gap = longest_gap(&acknowledged(&ns).unwrap(), asked);
    assert!(after > asked);
    let events = kubectl(&[
        "get",
        "events",
        "-n",
        &ns,
        "--field-selector",
        "involvedObject.name=ha",
    ])
    .unwrap_or_default();
    assert!(events.contains("Failover"), "{events}");
    assert!(events.contains("Switchover"), "{events}");
    // With the positions the agents last reported.
    let first_note = |events: Vec<k8s_openapi::api::core::v1::Event>| {
        events
            .into_iter()
            .next()
            .and_then(|e| e.message)
            .unwrap_or_default()
    };
    let note = first_note(events_about(&client, &ns, "ha", "Warning", "Failover").await);
    assert!(
        note.contains("last reported WAL positions: ha-1 at ")
            && note.contains("(timeline 1), ha-2 at "),
        "{note}"
    );
    let note = first_note(events_about(&client, &ns, "ha", "Normal", "Switchover").await);
    assert!(
        note.contains(&format!("last reported WAL positions: {primary} at "))
            && note.contains("ha-0 at "),
        "{note}"
    );

    // A standby that stops replaying while the primary writes lags: Degraded, with the
    // lag, until it replays again.
    let lagging = if primary == "ha-1" { "ha-2" } else { "ha-1" };
    superuser_sql(
        &ns,
        lagging,
        "postgres",
        "postgres",
        "select pg_wal_replay_pause()",
    )
    .unwrap_or_else(|e| fail(e));
    superuser_sql(
        &ns,
        "ha-0",
        "postgres",
        "postgres",
        "create table wal_filler as select repeat('x', 1000) as filler from generate_series(1, 30000)",
    )
    .unwrap_or_else(|e| fail(e));
    let reason = |client: Client, ns: String| async move {
        Api::<DynamicObject>::namespaced_with(client, &ns, &postgres_kind())
            .get("ha")
            .await
            .ok()
            .and_then(|o| capstan_e2e::objects::ready_condition(&o))
    };
    let degraded = wait_for("Degraded with the lagging standby", T, || async {
        Ok(reason(client.clone(), ns.clone())
            .await
            .filter(|(_, reason, _)| reason == "StandbyLagging"))
    })
    .await
    .unwrap_or_else(|e| fail(e));
    assert!(
        degraded.2.starts_with(&format!("{lagging} replays ")),
        "{degraded:?}"
    );
    assert_eq!(status_of(&client, &ns, "phase").await, "Degraded");
    superuser_sql(
        &ns,
        lagging,
        "postgres",
        "postgres",
        "select pg_wal_replay_resume()",
    )
    .unwrap_or_else(|e| fail(e));
    wait_for("Running again once it replayed", T, || async {
        Ok((status_of(&client, &ns, "phase").await == "Running").then_some(()))
    })
    .await
    .unwrap_or_else(|e| fail(e));
    eprintln!(
        "write outage: failover {failover_gap:.1} s ({primary} primary {promoted:.1} s after the primary's Pod was deleted; the host restarted and the plugin reloaded meanwhile), switchover {switchover_gap:.1} s; {} commits acknowledged, none lost",
        acknowledged(&ns).unwrap().len()
    );
    drop(op);
    namespace.delete(T).await.unwrap();
}

/// `wasm` with a custom section appended: other bytes (so the host loads it as a new
/// version), the same behaviour.
fn with_custom_section(wasm: &[u8]) -> Vec<u8> {
    let name = b"capstan-e2e-reload";
    let mut payload = vec![name.len() as u8];
    payload.extend_from_slice(name);
    payload.extend_from_slice(&unix_now().to_le_bytes());
    let mut out = wasm.to_vec();
    out.push(0); // a custom section
    out.push(payload.len() as u8); // its size, one LEB128 byte (< 128)
    out.extend(payload);
    out
}
