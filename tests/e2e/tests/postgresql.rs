//! The PostgreSQLCluster plugin on the real local control plane (kwok makes the pods
//! Running and Ready): phases, scaling, a minor upgrade, a refused major upgrade, the
//! password across a host restart, and deletion.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use kube::runtime::watcher;

use capstan_e2e::objects::postgres_kind;
use capstan_e2e::operator::{Operator, plugin};
use capstan_e2e::{TestNamespace, client, holds_for, wait_for};
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod, Secret, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::Client;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(120);

fn pgc_api(client: &Client, ns: &str) -> Api<DynamicObject> {
    Api::namespaced_with(client.clone(), ns, &postgres_kind())
}

async fn patch_spec(client: &Client, ns: &str, spec: Value) {
    pgc_api(client, ns)
        .patch(
            "pg",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": spec})),
        )
        .await
        .unwrap();
}

fn status<'a>(obj: &'a DynamicObject, field: &str) -> &'a Value {
    obj.data
        .pointer(&format!("/status/{field}"))
        .unwrap_or(&Value::Null)
}

/// Waits until the cluster reports `phase` for its current generation.
async fn await_phase(client: &Client, ns: &str, phase: &str, op: &Operator) -> DynamicObject {
    let api = pgc_api(client, ns);
    wait_for(&format!("phase {phase}"), T, || {
        let api = api.clone();
        async move {
            let obj = api.get("pg").await?;
            let current = status(&obj, "observedGeneration").as_i64() == obj.metadata.generation;
            Ok((current && status(&obj, "phase") == phase).then_some(obj))
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()))
}

async fn sts(client: &Client, ns: &str) -> StatefulSet {
    Api::<StatefulSet>::namespaced(client.clone(), ns)
        .get("pg")
        .await
        .unwrap()
}

async fn password(client: &Client, ns: &str) -> Vec<u8> {
    let secret = Api::<Secret>::namespaced(client.clone(), ns)
        .get("pg-credentials")
        .await
        .unwrap();
    secret.data.unwrap()["password"].0.clone()
}

/// Records every distinct `status.phase` of `pg`, in order, from a watch; returns once
/// the watch has listed, so that nothing that happens afterwards can be missed.
async fn record_phases(api: Api<DynamicObject>) -> Arc<Mutex<Vec<String>>> {
    let phases = Arc::new(Mutex::new(Vec::<String>::new()));
    let sink = phases.clone();
    let (synced_tx, synced_rx) = tokio::sync::oneshot::channel();
    let config = watcher::Config::default().fields("metadata.name=pg");
    tokio::spawn(async move {
        let mut synced = Some(synced_tx);
        let mut stream = std::pin::pin!(watcher(api, config));
        while let Some(Ok(event)) = stream.next().await {
            let obj = match event {
                watcher::Event::InitDone => {
                    if let Some(tx) = synced.take() {
                        let _ = tx.send(());
                    }
                    continue;
                }
                watcher::Event::Apply(obj) | watcher::Event::InitApply(obj) => obj,
                _ => continue,
            };
            if let Some(phase) = obj.data.pointer("/status/phase").and_then(Value::as_str) {
                let mut seen = sink.lock().unwrap();
                if seen.last().map(String::as_str) != Some(phase) {
                    seen.push(phase.to_string());
                }
            }
        }
    });
    synced_rx.await.expect("the watch lists");
    phases
}

#[tokio::test]
async fn a_cluster_runs_scales_upgrades_refuses_and_is_deleted() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "pg").await;
    let mut op = Operator::start(&ns.name, &[&plugin("postgresql")], &[]).await;
    let pgc: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "db.example.com/v1alpha1", "kind": "PostgreSQLCluster",
        "metadata": {"name": "pg"},
        "spec": {"replicas": 3, "version": "16.1", "storage": "1Gi"},
    }))
    .unwrap();
    let api = pgc_api(&client, &ns.name);
    let phases = record_phases(api.clone()).await;
    wait_for("the PostgreSQLCluster to be created", T, || {
        let (api, pgc) = (api.clone(), pgc.clone());
        async move { Ok(Some(api.create(&PostParams::default(), &pgc).await?)) }
    })
    .await
    .unwrap();

    // Pending first (nothing ready yet), then Running with every replica ready: every
    // phase the cluster goes through is recorded from a watch, so no step is missed.
    let running = await_phase(&client, &ns.name, "Running", &op).await;
    assert_eq!(status(&running, "readyReplicas"), 3);
    let seen = phases.lock().unwrap().clone();
    assert_eq!(
        seen.first().map(String::as_str),
        Some("Pending"),
        "phases: {seen:?}"
    );
    assert!(
        seen.iter()
            .all(|p| ["Pending", "Degraded", "Running"].contains(&p.as_str())),
        "phases: {seen:?}"
    );
    assert_eq!(
        status(&running, "primaryEndpoint"),
        &json!(format!("pg-rw.{}.svc:5432", ns.name))
    );
    let svcs = Api::<Service>::namespaced(client.clone(), &ns.name);
    for name in ["pg", "pg-rw", "pg-r"] {
        svcs.get(name)
            .await
            .unwrap_or_else(|e| panic!("Service {name}: {e}"));
    }
    let pw = password(&client, &ns.name).await;
    assert!(pw.len() >= 24, "password length {}", pw.len());
    let claims = Api::<PersistentVolumeClaim>::namespaced(client.clone(), &ns.name);
    let bound = claims.list(&ListParams::default()).await.unwrap().items;
    assert!(
        bound
            .iter()
            .filter(|c| c.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound"))
            .count()
            >= 3
    );

    // Scale to 5, then back to 2: the StatefulSet and the PDB follow, and it ends Running.
    patch_spec(&client, &ns.name, json!({"replicas": 5})).await;
    let five = await_phase(&client, &ns.name, "Running", &op).await;
    assert_eq!(status(&five, "readyReplicas"), 5);
    assert_eq!(sts(&client, &ns.name).await.spec.replicas, Some(5));
    patch_spec(&client, &ns.name, json!({"replicas": 2})).await;
    let two = await_phase(&client, &ns.name, "Running", &op).await;
    assert_eq!(status(&two, "readyReplicas"), 2);
    assert_eq!(sts(&client, &ns.name).await.spec.replicas, Some(2));
    let pdb = Api::<PodDisruptionBudget>::namespaced(client.clone(), &ns.name)
        .get("pg")
        .await
        .unwrap();
    assert_eq!(
        pdb.spec
            .unwrap()
            .max_unavailable
            .map(|m| serde_json::to_value(m).unwrap()),
        Some(json!(1))
    );

    // A minor version change rolls the pods to the new image and ends Running.
    patch_spec(&client, &ns.name, json!({"version": "16.2"})).await;
    await_phase(&client, &ns.name, "Running", &op).await;
    let pods = Api::<Pod>::namespaced(client.clone(), &ns.name);
    wait_for("pods on postgres:16.2", T, || {
        let pods = pods.clone();
        async move {
            let list = pods.list(&ListParams::default()).await?.items;
            let images: Vec<String> = list
                .iter()
                .filter(|p| {
                    p.metadata
                        .name
                        .as_deref()
                        .is_some_and(|n| n.starts_with("pg-"))
                })
                .filter_map(|p| p.spec.as_ref()?.containers.first()?.image.clone())
                .collect();
            Ok((images.len() == 2 && images.iter().all(|i| i == "postgres:16.2")).then_some(()))
        }
    })
    .await
    .unwrap();

    // A major version change is refused: Failed, a reason, a Warning, the StatefulSet untouched.
    let before = sts(&client, &ns.name).await;
    patch_spec(&client, &ns.name, json!({"version": "17.0"})).await;
    let failed = await_phase(&client, &ns.name, "Failed", &op).await;
    let conditions = status(&failed, "conditions")
        .as_array()
        .cloned()
        .unwrap_or_default();
    let ready = conditions.iter().find(|c| c["type"] == "Ready").unwrap();
    assert_eq!(ready["status"], "False");
    assert_eq!(ready["reason"], "MajorVersionChange");
    holds_for(
        "the StatefulSet to stay as it was",
        Duration::from_secs(3),
        || {
            let (client, ns, before) = (client.clone(), ns.name.clone(), before.clone());
            async move {
                let now = sts(&client, &ns).await;
                Ok(
                    now.metadata.generation == before.metadata.generation
                        && now.spec == before.spec,
                )
            }
        },
    )
    .await
    .unwrap();

    // The password survives a host restart.
    op.restart().await;
    patch_spec(&client, &ns.name, json!({"version": "16.2"})).await;
    await_phase(&client, &ns.name, "Running", &op).await;
    assert_eq!(
        password(&client, &ns.name).await,
        pw,
        "the password never changes"
    );

    // Deleting the cluster garbage-collects everything but the claims.
    api.delete("pg", &DeleteParams::foreground()).await.unwrap();
    wait_for("the owned objects to be gone", T, || {
        let client = client.clone();
        let ns = ns.name.clone();
        async move {
            let sts = Api::<StatefulSet>::namespaced(client.clone(), &ns)
                .get_opt("pg")
                .await?;
            let secret = Api::<Secret>::namespaced(client.clone(), &ns)
                .get_opt("pg-credentials")
                .await?;
            let svc = Api::<Service>::namespaced(client.clone(), &ns)
                .get_opt("pg-rw")
                .await?;
            Ok((sts.is_none() && secret.is_none() && svc.is_none()).then_some(()))
        }
    })
    .await
    .unwrap();
    let left = claims.list(&ListParams::default()).await.unwrap().items;
    assert!(
        left.iter()
            .filter(|c| c
                .metadata
                .name
                .as_deref()
                .is_some_and(|n| n.starts_with("data-pg-") || n.contains("-pg-")))
            .count()
            >= 2,
        "the data claims are kept: {:?}",
        left.iter()
            .map(|c| c.metadata.name.clone())
            .collect::<Vec<_>>()
    );
}
