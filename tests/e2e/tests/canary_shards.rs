//! Canary with `--shards`: two replicas share the Widgets through the API server's
//! sharded watch, and each runs the canary of `widget.next.wasm` on its own range. The
//! split is the same on both: a parent is the candidate's when the hash of its UID falls
//! in the share (docs/rollout.md), whichever replica serves it. The broken build is
//! rolled back by both replicas (each judging its own reconciles), every parent either
//! one told lies in the share, nothing of its answers is written, and every Widget ends
//! the serving version's; a healthy build is then promoted by both.

use std::time::Duration;

use capstan_e2e::objects::{create_object, events_about, ready_condition, test_kind};
use capstan_e2e::operator::{Operator, test_plugin};
use capstan_e2e::{TestNamespace, client, wait_for};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DynamicObject, ListParams};
use serde_json::json;
use sha2::{Digest, Sha256};

const T: Duration = Duration::from_secs(120);
const WIDGETS: usize = 40;
const SHARE: u64 = 50;

/// The canary's split, as docs/rollout.md gives it: the first 8 bytes of
/// SHA-256("capstan canary\0" UID), big-endian, modulo 10 000, below the share in
/// basis points. Written here from the docs, not taken from the host.
fn in_share(uid: &str, percent: u64) -> bool {
    let digest = Sha256::new()
        .chain_update(b"capstan canary\0")
        .chain_update(uid.as_bytes())
        .finalize();
    let position = u64::from_be_bytes(digest[..8].try_into().unwrap()) % 10_000;
    position < percent * 100
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sharded_replicas_apply_the_same_split_and_each_rolls_back_or_promotes() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "canary-shards").await;
    let args = [
        "--shards",
        "--leader-election-namespace",
        &ns.name,
        "--lease-duration-seconds",
        "6",
        "--canary",
        "--canary-steps",
        "50,100",
        "--canary-step-seconds",
        "4",
        "--canary-min-reconciles",
        "3",
    ];
    let mut replicas = Vec::new();
    for r in ["a", "b"] {
        let dir = tempfile::tempdir().unwrap();
        let next = dir.path().join("widget.next.wasm");
        std::fs::copy(test_plugin("widget-broken"), &next).unwrap();
        replicas.push(
            Operator::start_replica(
                &format!("{}-{r}", ns.name),
                &ns.name,
                &[&test_plugin("widget"), &next],
                &args,
            )
            .await,
        );
    }
    let logs = || {
        replicas
            .iter()
            .map(|op| format!("--- {:?}\n{}", op.identity(), op.log_tail()))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let fail = |e: anyhow::Error| -> ! { panic!("{e}\n{}", logs()) };
    // Both hold a part of the buckets before the parents come.
    wait_for("the two replicas to split the buckets", T, || async {
        let mut held = Vec::new();
        for op in &replicas {
            held.push(op.counter("capstan_shard_buckets").await?);
        }
        Ok((held.iter().sum::<u64>() == 64 && held.iter().all(|b| *b > 0)).then_some(()))
    })
    .await
    .unwrap_or_else(|e| fail(e));

    let kind = test_kind("Widget", "widgets");
    let widgets = Api::<DynamicObject>::namespaced_with(client.clone(), &ns.name, &kind);
    let mut uids = Vec::new();
    for i in 0..WIDGETS {
        let created =
            create_object(&widgets, &kind, &format!("w-{i:02}"), json!({"count": 1})).await;
        uids.push((
            created.metadata.name.unwrap(),
            created.metadata.uid.unwrap(),
        ));
    }
    let in_share_count = uids.iter().filter(|(_, uid)| in_share(uid, SHARE)).count();
    assert!(
        (5..WIDGETS - 5).contains(&in_share_count),
        "a share of 40 parents: {in_share_count}"
    );

    // Each replica rolls the candidate back, having failed on parents of its own.
    for op in &replicas {
        wait_for("the broken candidate rolled back", T, || async {
            Ok((op.canary_state("widget").await?["phase"] == "rolled-back").then_some(()))
        })
        .await
        .unwrap_or_else(|e| fail(e));
        let failed = op
            .counter(
                "capstan_canary_reconciles_total{plugin=\"widget\",version=\"candidate\",result=\"failed\"}",
            )
            .await
            .unwrap();
        assert!(
            failed > 0,
            "{:?} ran the candidate on its range",
            op.identity()
        );
    }

    // Every Widget is the serving version's.
    let configmaps = Api::<ConfigMap>::namespaced(client.clone(), &ns.name);
    wait_for("every Widget Ready with its ConfigMap", T, || async {
        for (name, _) in &uids {
            let ready = ready_condition(&widgets.get(name).await?);
            let configmap = configmaps.get_opt(&format!("{name}-0")).await?.is_some();
            if ready.as_ref().map(|c| c.0.as_str()) != Some("True") || !configmap {
                // Said by the timeout: which one, and how it stands.
                anyhow::bail!("{name}: Ready {ready:?}, ConfigMap {name}-0 there: {configmap}");
            }
        }
        Ok(Some(()))
    })
    .await
    .unwrap_or_else(|e| fail(e));

    // Whoever told a parent, it was in the share: the same split on both replicas.
    let mut told = Vec::new();
    for (name, uid) in &uids {
        if !events_about(&client, &ns.name, name, "Warning", "CanaryRolledBack")
            .await
            .is_empty()
        {
            assert!(
                in_share(uid, SHARE),
                "{name} ({uid}) was the candidate's, outside the share\n{}",
                logs()
            );
            told.push(name.clone());
        }
    }
    assert!(told.len() >= 2, "both replicas told theirs: {told:?}");
    let elsewhere = Api::<ConfigMap>::namespaced(client.clone(), "kube-system")
        .list(&ListParams::default())
        .await
        .unwrap();
    assert!(
        !elsewhere.items.iter().any(|c| c
            .metadata
            .name
            .as_deref()
            .is_some_and(|n| n.starts_with("w-") && n.ends_with("-elsewhere"))),
        "nothing of the candidate's refused answers was written"
    );

    // A healthy candidate on both: promoted by both.
    for op in &replicas {
        let staged = op.plugins.path().join("widget.next.wasm.tmp");
        std::fs::copy(test_plugin("widget-rebuilt"), &staged).unwrap();
        std::fs::rename(&staged, op.plugins.path().join("widget.next.wasm")).unwrap();
    }
    for op in &replicas {
        wait_for("the healthy candidate promoted", T, || async {
            let canary = op.canary_state("widget").await?;
            Ok((canary["phase"] == "promoted" && canary["candidate"]["failed"] == 0).then_some(()))
        })
        .await
        .unwrap_or_else(|e| fail(e));
    }
}
