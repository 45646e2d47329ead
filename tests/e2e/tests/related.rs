//! Contract 0.2.0 under `capstan run` on the real local control plane: a plugin that reads
//! a user's ConfigMap and the Pods of its StatefulSet (related objects) is reconciled again
//! when they change; a `customize` that asks for too much or for another namespace is
//! refused (and a parent deleted then waits, FinalizeFailed, until the user lets it go
//! without its cleanup); `finalize` tears down in waves; and a plugin built for 0.1.0 runs beside a
//! 0.2.0 one in one host.

use std::time::{Duration, Instant};

use capstan_e2e::objects::{create_object, events_about, ready_condition, test_kind};
use capstan_e2e::operator::{Operator, test_plugin};
use capstan_e2e::{TestNamespace, client, wait_for};
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{ConfigMap, Service};
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(60);

fn configmap(name: &str, value: &str) -> ConfigMap {
    serde_json::from_value(json!({"metadata": {"name": name}, "data": {"value": value}})).unwrap()
}

async fn status_of(api: &Api<DynamicObject>, name: &str, field: &str) -> anyhow::Result<Value> {
    let obj = api.get(name).await?;
    Ok(obj
        .data
        .pointer(&format!("/status/{field}"))
        .cloned()
        .unwrap_or(Value::Null))
}

#[tokio::test]
async fn a_status_follows_the_users_configmap_as_soon_as_it_changes() {
    let client = client().await;
    let ns = TestNamespace::kwok(&client, "related").await;
    let op = Operator::start(&ns.name, &[&test_plugin("mirror")], &[]).await;
    let cms = Api::<ConfigMap>::namespaced(client.clone(), &ns.name);
    cms.create(&PostParams::default(), &configmap("app", "one"))
        .await
        .unwrap();
    let mirrors = test_kind("Mirror", "mirrors");
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns.name, &mirrors);
    create_object(&api, &mirrors, "m", json!({"configMap": "app"})).await;
    let value = |want: Value| {
        let api = api.clone();
        async move {
            wait_for(&format!("status.value {want}"), T, || async {
                Ok((status_of(&api, "m", "value").await? == want).then_some(()))
            })
            .await
        }
    };
    value(json!("one"))
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));

    // The resync period is minutes: only the change itself can bring the new value.
    let changed = Instant::now();
    cms.patch(
        "app",
        &PatchParams::default(),
        &Patch::Merge(json!({"data": {"value": "two"}})),
    )
    .await
    .unwrap();
    value(json!("two"))
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
    let took = changed.elapsed();
    eprintln!("status followed the ConfigMap in {took:?}");
    assert!(took < Duration::from_secs(5), "{took:?}: not event-driven");

    // A ConfigMap of the same name in another namespace is none of its business.
    let other = TestNamespace::kwok(&client, "related-other").await;
    Api::<ConfigMap>::namespaced(client.clone(), &other.name)
        .create(&PostParams::default(), &configmap("app", "elsewhere"))
        .await
        .unwrap();
    // Gone: the status says so.
    cms.delete("app", &DeleteParams::default()).await.unwrap();
    value(Value::Null)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
    cms.create(&PostParams::default(), &configmap("app", "three"))
        .await
        .unwrap();
    value(json!("three"))
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
}

#[tokio::test]
async fn a_plugin_that_declares_pods_sees_the_pods_of_its_statefulset_and_tears_down_in_waves() {
    let client = client().await;
    let ns = TestNamespace::kwok(&client, "waves").await;
    let op = Operator::start(&ns.name, &[&test_plugin("mirror")], &[]).await;
    let mirrors = test_kind("Mirror", "mirrors");
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns.name, &mirrors);
    create_object(&api, &mirrors, "m", json!({"replicas": 2})).await;
    let pods = |want: Value| {
        let api = api.clone();
        async move {
            wait_for(&format!("status.pods {want}"), T, || async {
                Ok((status_of(&api, "m", "pods").await? == want).then_some(()))
            })
            .await
        }
    };
    pods(json!(["m-0", "m-1"]))
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
    api.patch(
        "m",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"replicas": 3}})),
    )
    .await
    .unwrap();
    pods(json!(["m-0", "m-1", "m-2"]))
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));

    // Teardown: the Service first, then the StatefulSet (with its Pods), then done.
    api.delete("m", &DeleteParams::default()).await.unwrap();
    wait_for("the Mirror to be gone", T, || async {
        Ok(api.get_opt("m").await?.is_none().then_some(()))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
    let mut waves = events_about(&client, &ns.name, "m", "Normal", "TeardownWave").await;
    waves.sort_by_key(|e| e.metadata.creation_timestamp.clone());
    let messages: Vec<String> = waves.iter().filter_map(|e| e.message.clone()).collect();
    assert_eq!(
        messages,
        [
            "teardown wave: deleting Service \"m\"",
            "teardown wave: deleting StatefulSet \"m\""
        ],
        "{}",
        op.log_tail()
    );
    let services = Api::<Service>::namespaced(client.clone(), &ns.name);
    let statefulsets = Api::<StatefulSet>::namespaced(client.clone(), &ns.name);
    assert!(services.get_opt("m").await.unwrap().is_none());
    assert!(statefulsets.get_opt("m").await.unwrap().is_none());
}

#[tokio::test]
async fn a_customize_that_asks_for_too_much_or_another_namespace_is_refused_on_the_parent() {
    let client = client().await;
    let ns = TestNamespace::kwok(&client, "related-hostile").await;
    let op = Operator::start(&ns.name, &[&test_plugin("mirror")], &[]).await;
    let mirrors = test_kind("Mirror", "mirrors");
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns.name, &mirrors);
    for (name, mode, says) in [
        ("many", "too-many", "100000"),
        (
            "escape",
            "other-namespace",
            "kube-system/extension-apiserver-authentication",
        ),
    ] {
        create_object(&api, &mirrors, name, json!({"mode": mode})).await;
        let message = wait_for(
            &format!("{name}: Ready=False InvalidPluginOutput"),
            T,
            || async {
                let obj = api.get(name).await?;
                Ok(ready_condition(&obj)
                    .filter(|c| c.0 == "False" && c.1 == "InvalidPluginOutput")
                    .map(|c| c.2))
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
        assert!(message.contains(says), "{message}");
        assert_eq!(status_of(&api, name, "value").await.unwrap(), Value::Null);
        assert!(
            !events_about(&client, &ns.name, name, "Warning", "InvalidPluginOutput")
                .await
                .is_empty()
        );
    }

    // Deleting them: `finalize` needs what `customize` selects, so it cannot run, and the
    // host holds the deletion (FinalizeFailed) rather than skip the plugin's cleanup,
    // until the user lets each go without it.
    for name in ["many", "escape"] {
        api.delete(name, &DeleteParams::default()).await.unwrap();
    }
    for name in ["many", "escape"] {
        let message = wait_for(
            &format!("{name}: Ready=False FinalizeFailed"),
            T,
            || async {
                let obj = api.get(name).await?;
                Ok(ready_condition(&obj)
                    .filter(|c| c.0 == "False" && c.1 == "FinalizeFailed")
                    .map(|c| c.2))
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
        assert!(message.contains("customize"), "{message}");
        assert!(
            message.contains("capstan.dev/force-release-finalizer=true"),
            "the condition says how to let it go: {message}"
        );
        assert!(
            api.get(name)
                .await
                .unwrap()
                .metadata
                .deletion_timestamp
                .is_some()
        );
        api.patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {
                "capstan.dev/force-release-finalizer": "true"
            }}})),
        )
        .await
        .unwrap();
    }
    wait_for("both to be gone once released", T, || async {
        let mut gone = true;
        for name in ["many", "escape"] {
            gone &= api.get_opt(name).await?.is_none();
        }
        Ok(gone.then_some(()))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
    for name in ["many", "escape"] {
        assert!(
            !events_about(&client, &ns.name, name, "Warning", "FinalizerForceReleased")
                .await
                .is_empty(),
            "{name}: no FinalizerForceReleased event"
        );
    }
}

#[tokio::test]
async fn a_plugin_built_for_0_1_0_runs_beside_a_0_2_0_one_in_one_host() {
    let client = client().await;
    let ns = TestNamespace::kwok(&client, "releases").await;
    let op = Operator::start(
        &ns.name,
        &[&test_plugin("contract-0.1.0/uuid"), &test_plugin("mirror")],
        &[],
    )
    .await;
    let uuids = capstan_e2e::objects::uuid_kind();
    let uuid_api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns.name, &uuids);
    create_object(&uuid_api, &uuids, "u", json!({})).await;
    let mirrors = test_kind("Mirror", "mirrors");
    let mirror_api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns.name, &mirrors);
    Api::<ConfigMap>::namespaced(client.clone(), &ns.name)
        .create(&PostParams::default(), &configmap("app", "v"))
        .await
        .unwrap();
    create_object(&mirror_api, &mirrors, "m", json!({"configMap": "app"})).await;
    wait_for("both reconciled", T, || async {
        let uuid = status_of(&uuid_api, "u", "uuid").await?;
        let value = status_of(&mirror_api, "m", "value").await?;
        Ok((uuid.is_string() && value == json!("v")).then_some(()))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_tail()));
    let states = op.plugin_states().await.unwrap();
    let mut contracts: Vec<String> = states
        .iter()
        .filter_map(|s| s.get("contract"))
        .filter_map(Value::as_str)
        .map(String::from)
        .collect();
    contracts.sort();
    assert_eq!(contracts, ["0.1.0", "0.2.0"], "{states:?}");
}
