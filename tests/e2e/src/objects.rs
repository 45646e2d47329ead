//! Custom objects the tests create and read: their API resources, creation while the
//! operator is still installing the CRD, the `Ready` condition, and events.

use std::time::Duration;

use k8s_openapi::api::core::v1::Event;
use kube::Client;
use kube::api::{Api, ApiResource, DynamicObject, ListParams, PostParams};
use serde_json::{Value, json};

use crate::wait_for;

/// The `ApiResource` of a kind in `test.capstan.dev/v1` (the test plugins' group).
pub fn test_kind(kind: &str, plural: &str) -> ApiResource {
    ApiResource {
        group: "test.capstan.dev".into(),
        version: "v1".into(),
        api_version: "test.capstan.dev/v1".into(),
        kind: kind.into(),
        plural: plural.into(),
    }
}

/// The Uuid kind of the shipped plugin.
pub fn uuid_kind() -> ApiResource {
    ApiResource {
        group: "demo.operator".into(),
        version: "v1".into(),
        api_version: "demo.operator/v1".into(),
        kind: "Uuid".into(),
        plural: "uuid".into(),
    }
}

/// The PostgreSQLCluster kind of the shipped plugin.
pub fn postgres_kind() -> ApiResource {
    ApiResource {
        group: "db.example.com".into(),
        version: "v1alpha1".into(),
        api_version: "db.example.com/v1alpha1".into(),
        kind: "PostgreSQLCluster".into(),
        plural: "postgresqlclusters".into(),
    }
}

/// Creates an object of kind `ar` with `spec`, retrying for up to a minute while its
/// CRD is still being installed by the operator.
pub async fn create_object(
    api: &Api<DynamicObject>,
    ar: &ApiResource,
    name: &str,
    spec: Value,
) -> DynamicObject {
    let obj: DynamicObject = serde_json::from_value(json!({
        "apiVersion": ar.api_version, "kind": ar.kind,
        "metadata": {"name": name}, "spec": spec,
    }))
    .expect("a valid object");
    wait_for(
        &format!("create {} {name}", ar.kind),
        Duration::from_secs(60),
        || async { Ok(Some(api.create(&PostParams::default(), &obj).await?)) },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

/// The `Ready` condition of an object's status: (status, reason, message).
pub fn ready_condition(obj: &DynamicObject) -> Option<(String, String, String)> {
    let conds = obj.data.pointer("/status/conditions")?.as_array()?;
    let c = conds.iter().find(|c| c["type"] == "Ready")?;
    let s = |k: &str| c[k].as_str().unwrap_or_default().to_string();
    Some((s("status"), s("reason"), s("message")))
}

/// Events of `type_` (`Normal`, `Warning`) and `reason` about the object `name` in `ns`.
pub async fn events_about(
    client: &Client,
    ns: &str,
    name: &str,
    type_: &str,
    reason: &str,
) -> Vec<Event> {
    Api::<Event>::namespaced(client.clone(), ns)
        .list(&ListParams::default())
        .await
        .expect("list events")
        .items
        .into_iter()
        .filter(|e| {
            e.involved_object.name.as_deref() == Some(name)
                && e.type_.as_deref() == Some(type_)
                && e.reason.as_deref() == Some(reason)
        })
        .collect()
}
