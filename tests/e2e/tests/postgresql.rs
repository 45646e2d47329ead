//! The PostgreSQLCluster plugin on the real local control plane (kwok makes the pods
//! Running and Ready): phases, scaling, a minor upgrade, a major upgrade refused at
//! admission, the password across a host restart, and deletion; the two versions of the
//! CRD read back through the plugin's conversion, and the changes `kubectl apply` is
//! refused with the plugin's own message.

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

/// The tests take turns: each runs a host that points the CRD's conversion webhook at
/// itself, and the v1alpha1 objects they write are converted through it; a host that
/// stopped first would leave the other's conversions failing until it set them again.
static TURNS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

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
    let _turn = TURNS.lock().await;
    let client = client().await;
    let ns = TestNamespace::kwok(&client, "pg").await;
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

    // A major version change is refused at admission, with the plugin's message: the
    // API server stores nothing, the cluster stays Running, the StatefulSet untouched.
    // (Reconcile's own refusal, for a change that got past a webhook that was down, is
    // tested in host/tests/postgresql.rs.)
    let before = sts(&client, &ns.name).await;
    let refused = api
        .patch(
            "pg",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"version": "17.0"}})),
        )
        .await
        .expect_err("a major version change is refused");
    assert!(
        refused
            .to_string()
            .contains("spec.version 17.0 is a major version change from 16.2"),
        "{refused}"
    );
    assert_eq!(
        api.get("pg").await.unwrap().data["spec"]["version"],
        "16.2",
        "nothing stored"
    );
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
    patch_spec(&client, &ns.name, json!({"replicas": 3})).await;
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

fn pgc_v1_api(client: &Client, ns: &str) -> Api<DynamicObject> {
    let mut kind = postgres_kind();
    kind.version = "v1".into();
    kind.api_version = "db.example.com/v1".into();
    Api::namespaced_with(client.clone(), ns, &kind)
}

/// The API server's refusal of a merge patch of `name`'s spec, as the client sees it.
async fn refused_patch(api: &Api<DynamicObject>, name: &str, spec: Value) -> String {
    api.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": spec})),
    )
    .await
    .map(|o| panic!("{spec} was allowed: {:?}", o.data["spec"]))
    .unwrap_err()
    .to_string()
}

#[tokio::test]
async fn both_versions_read_back_through_the_plugin_and_bad_changes_are_refused_at_admission() {
    let _turn = TURNS.lock().await;
    let client = client().await;
    let ns = TestNamespace::kwok(&client, "pgconv").await;
    let op = Operator::start(&ns.name, &[&plugin("postgresql")], &[]).await;
    let (alpha, v1) = (pgc_api(&client, &ns.name), pgc_v1_api(&client, &ns.name));

    // Created as v1alpha1 (the seed's), read back as v1 (CloudNativePG's words).
    let old: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "db.example.com/v1alpha1", "kind": "PostgreSQLCluster",
        "metadata": {"name": "old"},
        "spec": {"replicas": 2, "version": "16.15", "storage": "1Gi",
                 "backupSchedule": "0 3 * * *"},
    }))
    .unwrap();
    wait_for("the v1alpha1 PostgreSQLCluster to be created", T, || {
        let (api, old) = (alpha.clone(), old.clone());
        async move { Ok(Some(api.create(&PostParams::default(), &old).await?)) }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
    let as_v1 = v1.get("old").await.unwrap();
    assert_eq!(
        as_v1.types.as_ref().unwrap().api_version,
        "db.example.com/v1"
    );
    assert_eq!(
        as_v1.data["spec"],
        json!({"instances": 2, "version": "16.15", "storage": {"size": "1Gi"},
               "backupSchedule": "0 3 * * *"})
    );

    // Created as v1, read back as v1alpha1.
    let new: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "db.example.com/v1", "kind": "PostgreSQLCluster",
        "metadata": {"name": "new"},
        "spec": {"instances": 1, "version": "16.15", "storage": {"size": "2Gi"}},
    }))
    .unwrap();
    v1.create(&PostParams::default(), &new).await.unwrap();
    let as_alpha = alpha.get("new").await.unwrap();
    assert_eq!(
        as_alpha.data["spec"],
        json!({"replicas": 1, "version": "16.15", "storage": "2Gi"})
    );
    assert!(
        as_alpha
            .metadata
            .annotations
            .is_none_or(|a| a.keys().all(|k| !k.starts_with("conversion."))),
        "nothing to keep aside for a spec both versions hold"
    );

    // The plugin reconciles both (it sees v1); the status reads the same in either.
    for name in ["old", "new"] {
        let running = wait_for(&format!("{name} Running"), T, || {
            let api = v1.clone();
            async move {
                let o = api.get(name).await?;
                Ok((o.data.pointer("/status/phase") == Some(&json!("Running"))).then_some(o))
            }
        })
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
        let alpha_status = alpha.get(name).await.unwrap().data["status"].clone();
        assert_eq!(alpha_status, running.data["status"], "{name}");
    }
    let sts = Api::<StatefulSet>::namespaced(client.clone(), &ns.name);
    assert_eq!(sts.get("old").await.unwrap().spec.replicas, Some(2));
    assert_eq!(sts.get("new").await.unwrap().spec.replicas, Some(1));

    // Edited through v1alpha1, the v1 object follows.
    patch_spec_of(&alpha, "new", json!({"replicas": 3})).await;
    assert_eq!(v1.get("new").await.unwrap().data["spec"]["instances"], 3);

    // Refused at admission with the plugin's message, in either version; nothing is
    // stored. The API server converts a v1alpha1 change to v1 before it asks the
    // plugin, so the message names the v1 fields.
    let shrink = refused_patch(&alpha, "old", json!({"storage": "500Mi"})).await;
    assert!(
        shrink.contains("spec.storage.size 500Mi is smaller than 1Gi"),
        "{shrink}"
    );
    let shrink_v1 = refused_patch(&v1, "old", json!({"storage": {"size": "500Mi"}})).await;
    assert!(
        shrink_v1.contains("spec.storage.size 500Mi is smaller than 1Gi"),
        "{shrink_v1}"
    );
    let schedule = refused_patch(&alpha, "old", json!({"backupSchedule": "every night"})).await;
    assert!(
        schedule.contains("spec.backupSchedule is not a valid cron expression"),
        "{schedule}"
    );
    let major = refused_patch(&v1, "new", json!({"version": "17.2"})).await;
    assert!(
        major.contains("is a major version change from 16.15"),
        "{major}"
    );
    assert!(
        shrink.contains("denied the request"),
        "an admission webhook's answer: {shrink}"
    );
    assert_eq!(
        v1.get("old").await.unwrap().data["spec"]["storage"],
        json!({"size": "1Gi"})
    );
    drop(op);
    ns.delete(T).await.unwrap();
}

async fn patch_spec_of(api: &Api<DynamicObject>, name: &str, spec: Value) {
    api.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": spec})),
    )
    .await
    .unwrap();
}
