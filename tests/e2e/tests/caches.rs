//! Observed children come from shared, label-filtered watch caches, which lag the host's
//! own writes: under `capstan run` on the real local control plane, a burst of spec
//! changes never deletes a child the parent still wants, and objects the host does not
//! manage are never shown to a plugin.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use capstan_e2e::objects::{create_object, ready_condition, test_kind};
use capstan_e2e::operator::{Operator, test_plugin};
use capstan_e2e::{TestNamespace, client, holds_for, wait_for};
use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(60);

fn names(cms: &[ConfigMap]) -> Vec<String> {
    let mut n: Vec<String> = cms.iter().filter_map(|c| c.metadata.name.clone()).collect();
    n.sort();
    n
}

#[tokio::test]
async fn a_burst_of_spec_changes_never_deletes_a_child_still_wanted() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "burst").await;
    let op = Operator::start(&ns.name, &[&test_plugin("widget")], &[]).await;
    let widgets = test_kind("Widget", "widgets");
    let api = Api::<DynamicObject>::namespaced_with(client.clone(), &ns.name, &widgets);
    let cms = Api::<ConfigMap>::namespaced(client.clone(), &ns.name);
    let mine = ListParams::default().labels("capstan.dev/plugin=widget");
    create_object(&api, &widgets, "b", json!({"count": 3, "message": "m"})).await;
    wait_for("three children", T, || async {
        Ok((names(&cms.list(&mine).await?.items) == ["b-0", "b-1", "b-2"]).then_some(()))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
    let first_uid = cms.get("b-0").await.unwrap().metadata.uid;

    // Every deletion of a child, as the API server reports it, from a watch that has
    // completed its first list before the burst starts.
    let deleted = Arc::new(Mutex::new(Vec::<String>::new()));
    let seen = deleted.clone();
    let (listed, watching) = tokio::sync::oneshot::channel::<()>();
    let deletions = tokio::spawn({
        let cms = cms.clone();
        async move {
            let mut listed = Some(listed);
            let mut events = watcher(
                cms,
                watcher::Config::default().labels("capstan.dev/plugin=widget"),
            )
            .boxed();
            while let Some(Ok(event)) = events.next().await {
                match event {
                    watcher::Event::InitDone => {
                        if let Some(listed) = listed.take() {
                            let _ = listed.send(());
                        }
                    }
                    watcher::Event::Delete(cm) => seen
                        .lock()
                        .unwrap()
                        .push(cm.metadata.name.unwrap_or_default()),
                    _ => {}
                }
            }
        }
    });
    tokio::time::timeout(T, watching)
        .await
        .expect("the deletion watch listed within the timeout")
        .expect("the deletion watch is running");

    // Back to back, without waiting for the host: 3 → 1 → 3 → 2 → 3 → 2.
    for count in [1, 3, 2, 3, 2] {
        api.patch(
            "b",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"count": count}})),
        )
        .await
        .unwrap();
    }
    // The last spec reconciled (its generation observed, the children it saw listed in
    // its status), not a moment of the burst whose children happen to match.
    wait_for(
        "the children of count 2, the last spec reconciled",
        T,
        || async {
            let parent = api.get("b").await?;
            let reconciled = parent.data.pointer("/status/observedGeneration")
                == parent.metadata.generation.map(Value::from).as_ref()
                && parent.data.pointer("/status/observedConfigMaps")
                    == Some(&json!(["b-0", "b-1"]));
            let children = names(&cms.list(&mine).await?.items) == ["b-0", "b-1"];
            Ok((reconciled && children).then_some(()))
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
    holds_for(
        "the children to stay as desired",
        Duration::from_secs(3),
        || async { Ok(names(&cms.list(&mine).await?.items) == ["b-0", "b-1"]) },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
    deletions.abort();

    // b-0 was wanted by every spec of the burst: never deleted, never replaced.
    let deleted = deleted.lock().unwrap().clone();
    assert!(
        !deleted.contains(&"b-0".to_string()),
        "deletions: {deleted:?}"
    );
    assert_eq!(cms.get("b-0").await.unwrap().metadata.uid, first_uid);
    // b-2 existed before the burst and is not wanted at its end: its deletion was seen,
    // so the watch did see the burst.
    assert!(
        deleted.contains(&"b-2".to_string()),
        "deletions: {deleted:?}"
    );
    // Only children that some spec of the burst did not want were deleted.
    assert!(
        deleted.iter().all(|n| n == "b-1" || n == "b-2"),
        "deletions: {deleted:?}"
    );
    let parent = api.get("b").await.unwrap();
    assert_eq!(
        ready_condition(&parent).map(|r| r.0).as_deref(),
        Some("True")
    );
}

#[tokio::test]
async fn objects_the_host_does_not_manage_are_never_shown_to_a_plugin() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "unmanaged").await;
    let cms = Api::<ConfigMap>::namespaced(client.clone(), &ns.name);
    // A user's ConfigMap that even names the parent as its controller, but was not
    // made by Capstan (no managed-by label): not a child the plugin should see.
    let _op = Operator::start(&ns.name, &[&test_plugin("widget")], &[]).await;
    let widgets = test_kind("Widget", "widgets");
    let api = Api::<DynamicObject>::namespaced_with(client.clone(), &ns.name, &widgets);
    let parent = create_object(&api, &widgets, "u", json!({"count": 1})).await;
    let stray: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": "stray", "ownerReferences": [{
            "apiVersion": "test.capstan.dev/v1", "kind": "Widget", "name": "u",
            "uid": parent.metadata.uid, "controller": true}]},
        "data": {"k": "v"},
    }))
    .unwrap();
    cms.create(&PostParams::default(), &stray).await.unwrap();
    // A spec change makes the plugin report what it observed.
    api.patch(
        "u",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"count": 2}})),
    )
    .await
    .unwrap();
    let observed = wait_for("u observes its two children", T, || async {
        let o = api.get("u").await?;
        let seen = o
            .data
            .pointer("/status/observedConfigMaps")
            .cloned()
            .unwrap_or(Value::Null);
        Ok((seen.as_array().map(Vec::len) == Some(2)).then_some(seen))
    })
    .await
    .unwrap();
    assert_eq!(observed, json!(["u-0", "u-1"]));
    // And the host does not prune what it does not manage either.
    assert!(cms.get_opt("stray").await.unwrap().is_some());
}
