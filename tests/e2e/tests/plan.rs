//! `capstan plan --live` and shadow mode against the local control plane (kwok makes the
//! pods Running and Ready). Plan: three PostgreSQL clusters reconciled by the shipped
//! plugin; the same version plans no change, a version whose images come from a mirror
//! lists every cluster with exactly its image fields, and nothing is written by either.
//! Shadow: the mirror version as `postgresql.next.wasm` diverges on every cluster, on
//! the image, and none of its images reaches the cluster.

use std::collections::BTreeMap;
use std::process::Command;
use std::time::Duration;

use capstan_e2e::objects::postgres_kind;
use capstan_e2e::operator::{Operator, capstan_bin, plugin, test_plugin};
use capstan_e2e::{TestNamespace, client, wait_for};
use kube::Client;
use kube::api::{Api, DynamicObject, ListParams, PostParams};
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(120);
const CLUSTERS: [&str; 3] = ["a", "b", "c"];

/// The tests take turns: each runs a host that points the PostgreSQLCluster CRD's
/// conversion webhook at itself, and the v1alpha1 objects they create are converted
/// through it; a host that stopped first would leave the other's creates failing until
/// its host set the webhook again (within a minute).
static TURNS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Runs `capstan plan --live -n NS --plugin PLUGIN`: (exit status, stdout).
fn plan_live(ns: &str, plugin: &std::path::Path) -> (Option<i32>, String) {
    let out = Command::new(capstan_bin())
        .args(["plan", "--live", "-n", ns, "--plugin"])
        .arg(plugin)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.trim().is_empty() || out.status.code() != Some(2),
        "{stderr}"
    );
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// The resourceVersion of every object of the namespace the host writes, by kind/name:
/// a plan that wrote anything changes one.
async fn versions(client: &Client, ns: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for (api_version, kind, plural) in [
        ("apps/v1", "StatefulSet", "statefulsets"),
        ("v1", "Service", "services"),
        ("v1", "Secret", "secrets"),
        ("v1", "ConfigMap", "configmaps"),
        (
            "db.example.com/v1",
            "PostgreSQLCluster",
            "postgresqlclusters",
        ),
    ] {
        let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
        let ar = kube::api::ApiResource {
            group: group.into(),
            version: version.into(),
            api_version: api_version.into(),
            kind: kind.into(),
            plural: plural.into(),
        };
        let api = Api::<DynamicObject>::namespaced_with(client.clone(), ns, &ar);
        for o in api.list(&ListParams::default()).await.unwrap().items {
            out.insert(
                format!("{kind}/{}", o.metadata.name.unwrap_or_default()),
                o.metadata.resource_version.unwrap_or_default(),
            );
        }
    }
    out
}

/// Creates a one-instance PostgreSQL 16.15 cluster of each name.
async fn create_clusters(api: &Api<DynamicObject>, names: &[&str]) {
    for name in names {
        let pgc: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "db.example.com/v1alpha1", "kind": "PostgreSQLCluster",
            "metadata": {"name": name},
            "spec": {"replicas": 1, "version": "16.15", "storage": "1Gi"},
        }))
        .unwrap();
        wait_for("the PostgreSQLCluster to be created", T, || {
            let (api, pgc) = (api.clone(), pgc.clone());
            async move { Ok(Some(api.create(&PostParams::default(), &pgc).await?)) }
        })
        .await
        .unwrap();
    }
}

#[tokio::test]
async fn plan_live_lists_every_cluster_a_new_image_would_touch_and_writes_nothing() {
    let _turn = TURNS.lock().await;
    let client = client().await;
    let ns = TestNamespace::kwok(&client, "plan").await;
    let op = Operator::start(&ns.name, &[&plugin("postgresql")], &[]).await;
    let api = Api::<DynamicObject>::namespaced_with(client.clone(), &ns.name, &postgres_kind());
    create_clusters(&api, &CLUSTERS).await;
    wait_for("every cluster Running", T, || {
        let api = api.clone();
        async move {
            let list = api.list(&ListParams::default()).await?;
            let running = list.items.iter().filter(|o| {
                let current = o
                    .data
                    .pointer("/status/observedGeneration")
                    .and_then(Value::as_i64)
                    == o.metadata.generation;
                current && o.data.pointer("/status/phase") == Some(&json!("Running"))
            });
            Ok((running.count() == CLUSTERS.len()).then_some(()))
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
    // The host stops (its parents kept), so that no reconcile writes while the plans
    // run: any change to a resourceVersion from here on would be a plan's.
    let mut op = op;
    op.terminate();
    let before = versions(&client, &ns.name).await;

    // The version that runs: nothing to change.
    let (code, out) = plan_live(&ns.name, &plugin("postgresql"));
    assert_eq!(out, "3 parents: 3 unchanged, 0 changed, 0 failing\n");
    assert_eq!(code, Some(0), "{out}");

    // Images from a mirror: every cluster, its StatefulSet, exactly the image fields.
    let (code, out) = plan_live(&ns.name, &test_plugin("postgresql-mirror"));
    assert_eq!(code, Some(1), "{out}");
    for name in CLUSTERS {
        let header = format!("PostgreSQLCluster {}/{name}: changed", ns.name);
        assert!(out.contains(&header), "{header} missing:\n{out}");
        let sts = format!("  ~ StatefulSet {}/{name} (changed)", ns.name);
        assert!(out.contains(&sts), "{sts} missing:\n{out}");
    }
    let fields: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("      "))
        .map(str::trim)
        .collect();
    assert!(!fields.is_empty(), "{out}");
    for field in fields {
        assert!(
            field.starts_with("spec.template.spec.")
                && field.ends_with(
                    ".image: \"postgres:16.15\" -> \"mirror.example.com/library/postgres:16.15\""
                ),
            "{field} is not an image change:\n{out}"
        );
    }
    assert!(
        out.ends_with("3 parents: 0 unchanged, 3 changed, 0 failing\n"),
        "{out}"
    );
    assert_eq!(
        versions(&client, &ns.name).await,
        before,
        "a plan wrote to the cluster"
    );
    // The host again, whose drop deletes the clusters through their teardown.
    op.restart().await;
}

#[tokio::test]
async fn a_shadow_version_diverges_on_every_cluster_and_none_of_it_is_applied() {
    let _turn = TURNS.lock().await;
    let client = client().await;
    let ns = TestNamespace::kwok(&client, "shadow").await;
    let dir = tempfile::tempdir().unwrap();
    let next = dir.path().join("postgresql.next.wasm");
    std::fs::copy(test_plugin("postgresql-mirror"), &next).unwrap();
    let op = Operator::start(&ns.name, &[&plugin("postgresql"), &next], &[]).await;
    let api = Api::<DynamicObject>::namespaced_with(client.clone(), &ns.name, &postgres_kind());
    let clusters = ["x", "y"];
    create_clusters(&api, &clusters).await;
    // On a cluster's first reconcile the two versions also draw different passwords
    // for the Secret neither has observed yet; from the next one on, once the Secret
    // is observed, the image is the only difference, on every cluster.
    let image = |name: &str| {
        format!(
            "StatefulSet {}/{name}: spec.template.spec.containers[name=postgres].image",
            ns.name
        )
    };
    let shadow = wait_for(
        "the shadow to diverge on the image of both clusters",
        T,
        || {
            let (op, image, ns) = (&op, &image, &ns.name);
            async move {
                let states = op.plugin_states().await?;
                let shadow = states
                    .iter()
                    .find(|p| p["name"] == "postgresql")
                    .map(|p| p["shadow"].clone())
                    .unwrap_or_default();
                let on_image = clusters.iter().all(|name| {
                    shadow["divergent"][format!("{ns}/{name}")] == image(name).as_str()
                });
                Ok(on_image.then_some(shadow))
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
    assert!(
        shadow["file"]
            .as_str()
            .unwrap()
            .ends_with("postgresql.next.wasm"),
        "{shadow}"
    );
    assert_eq!(
        shadow["divergent"].as_object().map(|d| d.len()),
        Some(clusters.len()),
        "{shadow}"
    );
    assert_eq!(shadow["failed"], 0, "{shadow}");
    assert!(
        op.counter("capstan_shadow_reconciles_total{plugin=\"postgresql\",result=\"diverged\"}")
            .await
            .unwrap()
            >= 2
    );
    // The serving version's images only.
    let statefulsets =
        Api::<k8s_openapi::api::apps::v1::StatefulSet>::namespaced(client.clone(), &ns.name);
    for sts in statefulsets
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
    {
        let spec = sts.spec.template.spec.unwrap();
        for container in spec
            .containers
            .iter()
            .chain(spec.init_containers.iter().flatten())
        {
            assert_eq!(
                container.image.as_deref(),
                Some("postgres:16.15"),
                "{:?}",
                sts.metadata.name
            );
        }
    }
}
