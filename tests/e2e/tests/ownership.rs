//! The ownership rules under `capstan run` on the real local control plane: an object the
//! parent does not control is never written, adopted or deleted on a plugin's word; an
//! object adopts only with its own consent; a removed plugin leaves no finalizer that nothing will remove.

use std::time::Duration;

use capstan_e2e::objects::{create_object, events_about, ready_condition, test_kind};
use capstan_e2e::operator::{Operator, test_plugin};
use capstan_e2e::{TestNamespace, client, holds_for, wait_for};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(60);
const ADOPT: &str = "capstan.dev/allow-adoption-by";

fn parents(client: &Client, ns: &str, ar: &ApiResource) -> Api<DynamicObject> {
    Api::namespaced_with(client.clone(), ns, ar)
}

fn user_configmap(name: &str, annotations: Value) -> ConfigMap {
    serde_json::from_value(json!({
        "metadata": {"name": name, "annotations": annotations},
        "data": {"k": "mine"},
    }))
    .unwrap()
}

fn managers(cm: &ConfigMap) -> Vec<String> {
    cm.metadata
        .managed_fields
        .iter()
        .flatten()
        .filter_map(|m| m.manager.clone())
        .collect()
}

#[tokio::test]
async fn a_user_object_with_a_child_name_is_never_taken_and_adopts_only_by_consent() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "ownership").await;
    let cms = Api::<ConfigMap>::namespaced(client.clone(), &ns.name);
    // The user's objects exist first; the widget plugin will want `w-0` and `v-0`.
    for name in ["w-0", "v-0"] {
        cms.create(&PostParams::default(), &user_configmap(name, json!({})))
            .await
            .unwrap();
    }
    let op = Operator::start(&ns.name, &[&test_plugin("widget")], &[]).await;
    let widgets = test_kind("Widget", "widgets");
    let api = parents(&client, &ns.name, &widgets);
    for name in ["w", "v"] {
        create_object(
            &api,
            &widgets,
            name,
            json!({"count": 2, "message": "hello"}),
        )
        .await;
    }

    // The parent says which object is in the way and why, in its condition and an event.
    for name in ["w", "v"] {
        let obj = wait_for(&format!("{name}: Ready=False ChildConflict"), T, || async {
            let o = api.get(name).await?;
            Ok(ready_condition(&o)
                .filter(|r| r.0 == "False" && r.1 == "ChildConflict")
                .map(|r| r.2))
        })
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
        assert!(
            obj.contains(&format!("ConfigMap \"{name}-0\" already exists")),
            "{obj}"
        );
        assert!(
            obj.contains(ADOPT),
            "the message says how to hand the object over: {obj}"
        );
        wait_for("a ChildConflict Warning event", T, || async {
            Ok(
                (!events_about(&client, &ns.name, name, "Warning", "ChildConflict")
                    .await
                    .is_empty())
                .then_some(()),
            )
        })
        .await
        .unwrap();
    }
    // The other child proceeds.
    let w1 = wait_for("w-1 created", T, || async { Ok(cms.get_opt("w-1").await?) })
        .await
        .unwrap();
    assert_eq!(w1.data.unwrap()["message"], "hello");

    // The user's object is untouched: same data, no owner, no field of ours.
    let w0 = cms.get("w-0").await.unwrap();
    assert_eq!(
        w0.data.as_ref().unwrap(),
        &[("k".to_string(), "mine".to_string())].into()
    );
    assert!(
        w0.metadata.owner_references.is_none(),
        "{:?}",
        w0.metadata.owner_references
    );
    assert!(
        managers(&w0).iter().all(|m| !m.starts_with("capstan")),
        "{:?}",
        managers(&w0)
    );

    // Consent: the owner of `v-0` hands it to `v`; it is adopted and written.
    let consent = json!({"metadata": {"annotations": {ADOPT: "widgets.test.capstan.dev/v"}}});
    cms.patch("v-0", &PatchParams::default(), &Patch::Merge(&consent))
        .await
        .unwrap();
    let v_uid = api.get("v").await.unwrap().metadata.uid.unwrap();
    wait_for("v-0 adopted", T, || async {
        let cm = cms.get("v-0").await?;
        let controlled = cm
            .metadata
            .owner_references
            .iter()
            .flatten()
            .any(|o| o.controller == Some(true) && o.uid == v_uid);
        Ok((controlled
            && cm
                .data
                .unwrap_or_default()
                .get("message")
                .map(String::as_str)
                == Some("hello"))
        .then_some(()))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
    wait_for("v: Ready=True", T, || async {
        Ok(
            (ready_condition(&api.get("v").await?).map(|r| r.0) == Some("True".into()))
                .then_some(()),
        )
    })
    .await
    .unwrap();
    assert!(
        !events_about(&client, &ns.name, "v", "Normal", "Adopted")
            .await
            .is_empty()
    );

    // Deleting `w` garbage-collects its own child, never the user's object.
    api.delete("w", &DeleteParams::foreground()).await.unwrap();
    wait_for("w-1 garbage-collected", T, || async {
        Ok(cms.get_opt("w-1").await?.is_none().then_some(()))
    })
    .await
    .unwrap();
    holds_for(
        "the user's w-0 to stay as it was",
        Duration::from_secs(3),
        || async {
            let cm = cms.get("w-0").await?;
            Ok(cm.data.unwrap_or_default().get("k").map(String::as_str) == Some("mine"))
        },
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn a_removed_plugin_leaves_no_finalizer_that_nothing_would_remove() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "finalizers").await;
    let guards = test_kind("Guard", "guards");
    let op = Operator::start(
        &ns.name,
        &[&test_plugin("guard"), &test_plugin("widget")],
        &[],
    )
    .await;
    let api = parents(&client, &ns.name, &guards);
    for name in ["kept", "leaving"] {
        create_object(&api, &guards, name, json!({"release": false})).await;
    }
    let has_finalizer =
        |o: &DynamicObject| o.finalizers().iter().any(|f| f == "capstan.dev/finalizer");
    for name in ["kept", "leaving"] {
        wait_for(&format!("{name} gets the finalizer"), T, || async {
            Ok(has_finalizer(&api.get(name).await?).then_some(()))
        })
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
    }
    // `leaving` is being deleted and held: its cleanup has not run.
    api.delete("leaving", &DeleteParams::default())
        .await
        .unwrap();
    wait_for("leaving marked for deletion", T, || async {
        Ok(api
            .get("leaving")
            .await?
            .metadata
            .deletion_timestamp
            .map(|_| ()))
    })
    .await
    .unwrap();

    std::fs::remove_file(op.plugins.path().join("guard.wasm")).unwrap();
    // A parent not being deleted loses the finalizer: deleting it later cannot hang.
    wait_for("kept released", T, || async {
        Ok((!has_finalizer(&api.get("kept").await?)).then_some(()))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
    // A parent whose cleanup is pending keeps it, and says how to let it go.
    wait_for("a FinalizerPending event", T, || async {
        Ok(
            (!events_about(&client, &ns.name, "leaving", "Warning", "FinalizerPending")
                .await
                .is_empty())
            .then_some(()),
        )
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
    assert!(has_finalizer(&api.get("leaving").await.unwrap()));
    api.delete("kept", &DeleteParams::default()).await.unwrap();
    wait_for("kept deleted at once", T, || async {
        Ok(api.get_opt("kept").await?.is_none().then_some(()))
    })
    .await
    .unwrap();

    // A plugin version that does not declare a finalizer (widget) never leaves the
    // host's finalizer on its parents, also one being deleted: it would never go.
    let widgets = test_kind("Widget", "widgets");
    let wapi = parents(&client, &ns.name, &widgets);
    let obj: DynamicObject = serde_json::from_value(json!({
        "apiVersion": widgets.api_version, "kind": "Widget",
        "metadata": {"name": "was-guarded", "finalizers": ["capstan.dev/finalizer"]},
        "spec": {"count": 0},
    }))
    .unwrap();
    wapi.create(&PostParams::default(), &obj).await.unwrap();
    wapi.delete("was-guarded", &DeleteParams::default())
        .await
        .unwrap();
    wait_for("the widget released and deleted", T, || async {
        Ok(wapi.get_opt("was-guarded").await?.is_none().then_some(()))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));

    // Let the namespace go: release by hand, as the event says.
    api.patch(
        "leaving",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": null}})),
    )
    .await
    .unwrap();
}

/// The host's status writes carry the resourceVersion of the parent they were computed
/// from; this checks the API server contract that makes that a guard: a server-side
/// apply to `/status` with an old resourceVersion is refused with 409, so a status
/// computed from a stale cache can never overwrite a newer one.
#[tokio::test]
async fn a_status_apply_with_a_stale_resource_version_is_refused() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "stale").await;
    let widgets = test_kind("Widget", "widgets");
    let _op = Operator::start(&ns.name, &[&test_plugin("widget")], &[]).await;
    let api = parents(&client, &ns.name, &widgets);
    let created = create_object(&api, &widgets, "s", json!({"count": 0})).await;
    let stale = created.metadata.resource_version.clone().unwrap();
    // The operator writes the status (a newer resourceVersion).
    wait_for("s reconciled", T, || async {
        Ok(ready_condition(&api.get("s").await?).map(|_| ()))
    })
    .await
    .unwrap();
    let patch = |rv: &str| {
        json!({"apiVersion": "test.capstan.dev/v1", "kind": "Widget",
               "metadata": {"name": "s", "resourceVersion": rv},
               "status": {"regressed": true}})
    };
    let err = api
        .patch_status(
            "s",
            &PatchParams::apply("capstan/widget").force(),
            &Patch::Apply(&patch(&stale)),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 409),
        "{err}"
    );
    assert!(
        api.get("s")
            .await
            .unwrap()
            .data
            .pointer("/status/regressed")
            .is_none()
    );
    // With the current resourceVersion the same apply goes through.
    let current = api
        .get("s")
        .await
        .unwrap()
        .metadata
        .resource_version
        .unwrap();
    api.patch_status(
        "s",
        &PatchParams::apply("test").force(),
        &Patch::Apply(&patch(&current)),
    )
    .await
    .unwrap();
}
