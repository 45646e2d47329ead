//! The Database plugin (Python) on the real local control plane, next to the PostgreSQL
//! plugin: a postgresql Database becomes a PostgreSQLCluster, then (through the
//! PostgreSQL plugin) a StatefulSet whose pods kwok runs, and `kubectl get databases`
//! shows it Running with its endpoint; a mysql Database gets its StatefulSet, Service and
//! Secret; an engine change on a live Database is refused at `kubectl apply` time by the
//! plugin's validate and changes nothing.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use capstan_e2e::operator::{Operator, plugin};
use capstan_e2e::{TestNamespace, client, wait_for};
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{Secret, Service};
use kube::Client;
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(180);

fn kind(group: &str, version: &str, kind: &str, plural: &str) -> ApiResource {
    ApiResource {
        group: group.into(),
        version: version.into(),
        api_version: format!("{group}/{version}"),
        kind: kind.into(),
        plural: plural.into(),
    }
}

fn databases(client: &Client, ns: &str) -> Api<DynamicObject> {
    let ar = kind("mycompany.com", "v1", "Database", "databases");
    Api::namespaced_with(client.clone(), ns, &ar)
}

fn clusters(client: &Client, ns: &str) -> Api<DynamicObject> {
    let ar = kind(
        "db.example.com",
        "v1alpha1",
        "PostgreSQLCluster",
        "postgresqlclusters",
    );
    Api::namespaced_with(client.clone(), ns, &ar)
}

fn kubectl(args: &[&str]) -> String {
    let bin = std::env::var_os("CAPSTAN_KUBECTL")
        .map(PathBuf::from)
        .expect("CAPSTAN_KUBECTL is not set: run the tests with `cargo xtask test`");
    let out = Command::new(&bin).args(args).output().expect("run kubectl");
    assert!(
        out.status.success(),
        "kubectl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn status<'a>(obj: &'a DynamicObject, field: &str) -> &'a Value {
    obj.data
        .pointer(&format!("/status/{field}"))
        .unwrap_or(&Value::Null)
}

/// Waits until Database `name` reports `phase` for its current generation.
async fn await_phase(
    client: &Client,
    ns: &str,
    name: &str,
    phase: &str,
    op: &Operator,
) -> DynamicObject {
    let api = databases(client, ns);
    wait_for(&format!("Database {name} {phase}"), T, || {
        let api = api.clone();
        async move {
            let obj = api.get(name).await?;
            let current = status(&obj, "observedGeneration").as_i64() == obj.metadata.generation;
            Ok((current && status(&obj, "phase") == phase).then_some(obj))
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()))
}

async fn create(client: &Client, ns: &str, name: &str, spec: Value) -> DynamicObject {
    let db: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "mycompany.com/v1", "kind": "Database",
        "metadata": {"name": name}, "spec": spec,
    }))
    .unwrap();
    let api = databases(client, ns);
    // The CRD is installed by capstan at start; it may take a moment to be served.
    wait_for(&format!("Database {name} to be created"), T, || {
        let (api, db) = (api.clone(), db.clone());
        async move { Ok(Some(api.create(&PostParams::default(), &db).await?)) }
    })
    .await
    .unwrap()
}

async fn get<K>(client: &Client, ns: &str, name: &str, op: &Operator) -> K
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    let api = Api::<K>::namespaced(client.clone(), ns);
    wait_for(&format!("{name} to exist"), T, || {
        let api = api.clone();
        async move { Ok(api.get_opt(name).await?) }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()))
}

#[tokio::test]
async fn databases_of_both_engines_run_and_an_engine_change_is_refused() {
    let client = client().await;
    let ns = TestNamespace::kwok(&client, "database").await;
    let op = Operator::start(&ns.name, &[&plugin("postgresql"), &plugin("database")], &[]).await;
    let pg = create(
        &client,
        &ns.name,
        "pg",
        json!({"engine": "postgresql", "version": "16", "storage": "1Gi", "replicas": 3}),
    )
    .await;
    create(
        &client,
        &ns.name,
        "my",
        json!({"engine": "mysql", "version": "8.4", "storage": "1Gi", "replicas": 1}),
    )
    .await;

    // postgresql: a PostgreSQLCluster controlled by the Database, at the pinned minor…
    let cluster = wait_for("the PostgreSQLCluster", T, || {
        let api = clusters(&client, &ns.name);
        async move { Ok(api.get_opt("pg").await?) }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
    assert_eq!(
        cluster.data["spec"],
        json!({"replicas": 3, "version": "16.15", "storage": "1Gi"})
    );
    let owner = &cluster.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.uid.as_str(), owner.controller),
        ("Database", pg.metadata.uid.as_deref().unwrap(), Some(true))
    );
    // …which the PostgreSQL plugin turns into a StatefulSet, whose pods kwok runs.
    let sts: StatefulSet = get(&client, &ns.name, "pg", &op).await;
    assert_eq!(sts.spec.replicas, Some(3));
    let running = await_phase(&client, &ns.name, "pg", "Running", &op).await;
    assert_eq!(status(&running, "readyReplicas"), 3);
    assert_eq!(status(&running, "version"), "16.15");
    let endpoint = format!("pg-rw.{}.svc:5432", ns.name);
    assert_eq!(status(&running, "endpoint"), &json!(endpoint));

    // `kubectl get databases` shows it, through the CRD's printer columns.
    let table = kubectl(&["get", "databases", "-n", &ns.name]);
    let header = table.lines().next().unwrap_or_default();
    for column in [
        "NAME", "ENGINE", "VERSION", "PHASE", "READY", "ENDPOINT", "AGE",
    ] {
        assert!(header.contains(column), "{table}");
    }
    let row: Vec<&str> = table
        .lines()
        .find(|l| l.starts_with("pg "))
        .unwrap_or_else(|| panic!("no row for pg:\n{table}"))
        .split_whitespace()
        .collect();
    assert_eq!(
        &row[..6],
        [
            "pg",
            "postgresql",
            "16.15",
            "Running",
            "3",
            endpoint.as_str()
        ],
        "{table}"
    );

    // mysql: StatefulSet, Service and Secret, and Running once kwok readies the pod.
    let sts: StatefulSet = get(&client, &ns.name, "my", &op).await;
    let spec = &sts.spec;
    assert_eq!(spec.replicas, Some(1));
    assert_eq!(
        spec.template.spec.as_ref().unwrap().containers[0]
            .image
            .as_deref(),
        Some("mysql:8.4")
    );
    let svc: Service = get(&client, &ns.name, "my", &op).await;
    assert_eq!(
        svc.spec.as_ref().unwrap().cluster_ip.as_deref(),
        Some("None")
    );
    let secret: Secret = get(&client, &ns.name, "my-credentials", &op).await;
    let password = secret.data.as_ref().unwrap()["password"].0.clone();
    assert_eq!(password.len(), 24);
    let running = await_phase(&client, &ns.name, "my", "Running", &op).await;
    assert_eq!(
        status(&running, "endpoint"),
        &json!(format!("my.{}.svc.cluster.local", ns.name))
    );
    assert_eq!(status(&running, "readyReplicas"), 1);

    // An engine change is refused at admission (the plugin's validate, failure policy
    // Fail) with its message: nothing is stored, the Database stays Running, and the
    // MySQL children stay exactly as they were.
    let refused = databases(&client, &ns.name)
        .patch(
            "my",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"engine": "postgresql"}})),
        )
        .await
        .expect_err("an engine change is refused");
    assert!(
        refused
            .to_string()
            .contains("spec.engine is postgresql, but this Database runs mysql"),
        "{refused}"
    );
    let still = await_phase(&client, &ns.name, "my", "Running", &op).await;
    assert_eq!(still.data["spec"]["engine"], "mysql", "nothing stored");
    assert_eq!(status(&still, "engine"), "mysql");
    let after: StatefulSet = get(&client, &ns.name, "my", &op).await;
    assert_eq!(after.metadata.uid, sts.metadata.uid);
    assert_eq!(after.metadata.generation, sts.metadata.generation);
    let secret_after: Secret = get(&client, &ns.name, "my-credentials", &op).await;
    assert_eq!(secret_after.data.unwrap()["password"].0, password);
    assert!(
        clusters(&client, &ns.name)
            .get_opt("my")
            .await
            .unwrap()
            .is_none(),
        "no PostgreSQLCluster for a refused engine change"
    );
    ns.delete(T).await.unwrap();
}
