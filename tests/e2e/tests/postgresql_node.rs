//! The PostgreSQLCluster plugin on the cluster's real node: the instances run
//! PostgreSQL for real (the `postgres:16.14` and `postgres:16.15` images `cargo xtask
//! image` builds), and every claim is checked with a query, never with a Pod phase:
//! writes through `<name>-rw` land on instance 0, both standbys stream (in
//! `pg_stat_replication`) and serve what the primary wrote through `<name>-r`, scaling
//! 3 → 1 → 3 brings the standbys back, a minor version change rolls the instances with
//! the data intact, a deleted instance 0 comes back as the primary with its data, and
//! the dump CronJob, run once by hand, writes a dump that restores into a fresh
//! database. A `Database` with `engine: postgresql` reaches a working database too.

use std::time::Duration;

use capstan_e2e::node::{
    await_ready_pods, exec, image_of, kubectl, kubectl_with_input, real_node, require_images,
    superuser_sql,
};
use capstan_e2e::objects::postgres_kind;
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

async fn patch_spec(client: &Client, ns: &str, spec: Value) {
    Api::<DynamicObject>::namespaced_with(client.clone(), ns, &postgres_kind())
        .patch(
            "pg",
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

    // Three instances of the older minor, with a dump schedule.
    let pgc: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "db.example.com/v1alpha1", "kind": "PostgreSQLCluster",
        "metadata": {"name": "pg"},
        "spec": {"replicas": 3, "version": OLD, "storage": "1Gi", "backupSchedule": "0 3 * * *"},
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
    let served_by = client_sql(
        &ns,
        None,
        "create table t (id int primary key, v text); \
         insert into t values (1, 'before'); \
         select host(inet_server_addr())",
    )
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
    patch_spec(&client, &ns, json!({"replicas": 1})).await;
    await_ready_pods(&client, &ns, INSTANCES, &instance_names(1), T)
        .await
        .unwrap_or_else(|e| fail(e));
    await_streaming(&ns, 0).await.unwrap_or_else(|e| fail(e));
    client_sql_retried(&ns, None, "insert into t values (2, 'while alone')")
        .await
        .unwrap_or_else(|e| fail(e));
    patch_spec(&client, &ns, json!({"replicas": 3})).await;
    await_ready_pods(&client, &ns, INSTANCES, &instance_names(3), T)
        .await
        .unwrap_or_else(|e| fail(e));
    await_streaming(&ns, 2).await.unwrap_or_else(|e| fail(e));
    await_read_from_standby(&ns, "select v from t where id = 2", "while alone")
        .await
        .unwrap_or_else(|e| fail(e));

    // A minor version change rolls every instance onto the new image; the data stays.
    patch_spec(&client, &ns, json!({"version": NEW})).await;
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
