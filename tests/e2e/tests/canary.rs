//! Canary rollout under `capstan run --canary` against the local control plane (no Pod
//! runs: Widgets only make ConfigMaps). A broken new version (`widget-broken`, which
//! puts a child in another namespace on every parent) placed as `widget.next.wasm`
//! serves half of the Widgets, fails on each, and is rolled back automatically: every
//! Widget ends Ready with the serving version's ConfigMap, the parents it served get a
//! `CanaryRolledBack` Warning event, and the rollback is counted and shown. A healthy
//! new version placed next steps up to every parent and is promoted.

use std::time::Duration;

use capstan_e2e::objects::{create_object, events_about, ready_condition, test_kind};
use capstan_e2e::operator::{Operator, test_plugin};
use capstan_e2e::{TestNamespace, client, wait_for};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DynamicObject, ListParams};
use serde_json::json;

const T: Duration = Duration::from_secs(90);
const WIDGETS: usize = 12;

#[tokio::test]
async fn a_failing_canary_is_rolled_back_and_a_healthy_one_is_promoted() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "canary").await;
    let dir = tempfile::tempdir().unwrap();
    let next = dir.path().join("widget.next.wasm");
    std::fs::copy(test_plugin("widget-broken"), &next).unwrap();
    let op = Operator::start(
        &ns.name,
        &[&test_plugin("widget"), &next],
        &[
            "--canary",
            "--canary-steps",
            "50,100",
            "--canary-step-seconds",
            "3",
            "--canary-min-reconciles",
            "3",
        ],
    )
    .await;
    let kind = test_kind("Widget", "widgets");
    let widgets = Api::<DynamicObject>::namespaced_with(client.clone(), &ns.name, &kind);
    let names: Vec<String> = (0..WIDGETS).map(|i| format!("w-{i:02}")).collect();
    for name in &names {
        create_object(&widgets, &kind, name, json!({"count": 1})).await;
    }
    let fail = |e: anyhow::Error| -> ! { panic!("{e}\n{}", op.log_tail()) };

    // Rolled back, and said so.
    let rolled_back = wait_for("the broken candidate to be rolled back", T, || async {
        let canary = op.canary_state("widget").await?;
        Ok((canary["phase"] == "rolled-back").then_some(canary))
    })
    .await
    .unwrap_or_else(|e| fail(e));
    let reason = rolled_back["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("of its reconciles failed") && reason.contains("in namespace"),
        "the rate and the candidate's own error: {rolled_back}"
    );
    assert_eq!(rolled_back["percent"], 0, "{rolled_back}");
    assert!(
        op.counter("capstan_canary_rollbacks_total{plugin=\"widget\"}")
            .await
            .unwrap()
            == 1
    );
    assert!(
        op.log().contains("canary: the candidate is rolled back"),
        "a log line says why"
    );

    // Every Widget is the serving version's: Ready, with its ConfigMap; the parents
    // the candidate served were told.
    let configmaps = Api::<ConfigMap>::namespaced(client.clone(), &ns.name);
    wait_for("every Widget Ready with its ConfigMap", T, || async {
        for name in &names {
            let ready = ready_condition(&widgets.get(name).await?).map(|c| c.0);
            if ready.as_deref() != Some("True")
                || configmaps.get_opt(&format!("{name}-0")).await?.is_none()
            {
                return Ok(None);
            }
        }
        Ok(Some(()))
    })
    .await
    .unwrap_or_else(|e| fail(e));
    // The parents the candidate served: those whose reconcile failed with its answer
    // (a child in another namespace, `-elsewhere`; every answer of the broken build is
    // one), as the host logged them. Each must be told, whether the candidate served it
    // once or, retried, several times before the rollback.
    let served = served_by_the_candidate(&op.log());
    assert!(
        !served.is_empty(),
        "the log names no parent the candidate served"
    );
    let told = wait_for("the parents it served told", T, || async {
        let mut told = Vec::new();
        for name in &names {
            if !events_about(&client, &ns.name, name, "Warning", "CanaryRolledBack")
                .await
                .is_empty()
            {
                told.push(name.clone());
            }
        }
        Ok(served.iter().all(|s| told.contains(s)).then_some(told))
    })
    .await
    .unwrap_or_else(|e| fail(e));
    assert!(told.len() < WIDGETS, "only its share: {told:?}");
    for name in &told {
        let event = &events_about(&client, &ns.name, name, "Warning", "CanaryRolledBack").await[0];
        let note = event.message.as_deref().unwrap_or_default();
        assert!(note.contains("was rolled back"), "{note}");
    }
    let elsewhere = Api::<ConfigMap>::namespaced(client.clone(), "kube-system")
        .list(&ListParams::default())
        .await
        .unwrap();
    assert!(
        !elsewhere.items.iter().any(|c| c
            .metadata
            .name
            .as_deref()
            .unwrap_or_default()
            .ends_with("-elsewhere")),
        "nothing of the candidate's refused answer was written"
    );

    // A healthy version as the next candidate: a canary of its own, from the first
    // step, up to every parent, then promoted.
    let staged = op.plugins.path().join("widget.next.wasm.tmp");
    std::fs::copy(test_plugin("widget"), &staged).unwrap();
    std::fs::rename(&staged, op.plugins.path().join("widget.next.wasm")).unwrap();
    let promoted = wait_for("the healthy candidate promoted", T, || async {
        let canary = op.canary_state("widget").await?;
        let served = canary["candidate"]["ok"].as_u64().unwrap_or_default();
        Ok((canary["phase"] == "promoted" && served >= WIDGETS as u64).then_some(canary))
    })
    .await
    .unwrap_or_else(|e| fail(e));
    assert_eq!(promoted["percent"], 100, "{promoted}");
    assert_eq!(promoted["candidate"]["failed"], 0, "{promoted}");
    assert!(op.log().contains("canary: the candidate is promoted"));
    assert_eq!(
        op.counter("capstan_canary_rollbacks_total{plugin=\"widget\"}")
            .await
            .unwrap(),
        1,
        "no second rollback"
    );
}

/// The Widgets whose reconcile failed with the broken candidate's answer, from the
/// host's log: `reconcile{plugin=widget name="w-02" …}: … reconcile failed: … "w-02-elsewhere"`.
fn served_by_the_candidate(log: &str) -> std::collections::BTreeSet<String> {
    log.lines()
        .filter(|l| {
            l.contains("capstan::operator::reconcile: reconcile failed") && l.contains("-elsewhere")
        })
        .filter_map(|l| {
            let start = l.find("name=\"")? + "name=\"".len();
            let end = start + l[start..].find('"')?;
            Some(l[start..end].to_string())
        })
        .collect()
}
