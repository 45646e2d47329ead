//! Objects and a fake API server shared by the cluster calls' tests.

use kube::api::DynamicObject;
use serde_json::{Value, json};

use super::{ChildKinds, ClusterWrites};
use crate::contract::KindRef;
use crate::operator::fake_api::{self, Call};
use crate::operator::leader::WriteFence;
use crate::plan::PlannedChild;

pub(super) fn configmaps() -> ChildKinds {
    ChildKinds::new(&[KindRef {
        group: String::new(),
        version: "v1".into(),
        kind: "ConfigMap".into(),
        plural: "configmaps".into(),
        namespaced: true,
    }])
}

pub(super) fn widget_kind() -> KindRef {
    KindRef {
        group: "test.capstan.dev".into(),
        version: "v1".into(),
        kind: "Widget".into(),
        plural: "widgets".into(),
        namespaced: true,
    }
}

pub(super) fn parent() -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": "test.capstan.dev/v1", "kind": "Widget",
        "metadata": {"name": "w", "namespace": "ns", "uid": "uid-w", "resourceVersion": "42"},
        "spec": {}, "status": {"uuid": "x"},
    }))
    .unwrap()
}

pub(super) fn child(name: &str) -> PlannedChild {
    PlannedChild {
        kind_index: 0,
        name: name.into(),
        manifest: json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": "ns",
                "ownerReferences": [{"apiVersion": "test.capstan.dev/v1", "kind": "Widget",
                    "name": "w", "uid": "uid-w", "controller": true}]},
            "data": {"message": "hello"},
        }),
    }
}

pub(super) fn fake(
    handler: impl Fn(&Call) -> (u16, Value) + Send + Sync + 'static,
) -> (ClusterWrites, fake_api::Calls) {
    let (client, calls) = fake_api::client(handler);
    (
        ClusterWrites::new(client, &widget_kind(), "widget", WriteFence::default()),
        calls,
    )
}
