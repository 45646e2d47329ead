//! The native controller does the same work as Capstan's Uuid plugin: for the same
//! parent it writes exactly the status Capstan's `plan` composes from the plugin's answer.

use capstan::contract::{Desired, KindRef, PluginInfo};
use capstan_bench::native;
use serde_json::{Value, json};

fn uuid_info() -> PluginInfo {
    PluginInfo {
        name: "uuid".into(),
        version: "0.1.0".into(),
        parent: KindRef {
            group: "demo.operator".into(),
            version: "v1".into(),
            kind: "Uuid".into(),
            plural: "uuid".into(),
            namespaced: true,
        },
        children: vec![],
        finalizer: false,
        resync_seconds: None,
        crd: None,
        ..Default::default()
    }
}

/// What Capstan writes when the plugin answers with `uuid`.
fn capstan_status(parent: &Value, uuid: &str, now: &str) -> Value {
    let desired = Desired {
        children: vec![],
        status: Some(json!({"state": "Ok", "message": "UUID generated", "uuid": uuid}).to_string()),
        conditions: vec![],
        events: vec![],
        requeue_after_seconds: None,
    };
    capstan::plan::plan(
        &uuid_info(),
        parent,
        desired,
        now,
        &capstan::grant::Grant::default(),
    )
    .expect("a valid answer")
    .status
}

#[test]
fn a_fresh_parent_gets_the_same_status() {
    let parent = json!({"apiVersion": "demo.operator/v1", "kind": "Uuid",
        "metadata": {"name": "u", "namespace": "ns", "uid": "1", "generation": 1}});
    let uuid = "0b3d4a39-6f64-4d2a-9f62-2b8d3c1e5a77";
    let now = "2026-01-01T00:00:00Z";
    assert_eq!(
        native::uuid_status(&parent, || uuid.to_string(), now),
        capstan_status(&parent, uuid, now)
    );
}

#[test]
fn a_reconciled_parent_is_left_as_it_is() {
    let uuid = "0b3d4a39-6f64-4d2a-9f62-2b8d3c1e5a77";
    let fresh = json!({"metadata": {"name": "u", "namespace": "ns", "generation": 3}});
    let mut parent = fresh.clone();
    parent["status"] = capstan_status(&fresh, uuid, "2026-01-01T00:00:00Z");
    // A failure report's condition of another type stays; Ready keeps its time.
    parent["status"]["conditions"]
        .as_array_mut()
        .unwrap()
        .insert(0, json!({"type": "Custom", "status": "True", "reason": "R", "message": "m", "lastTransitionTime": "2025-01-01T00:00:00Z"}));
    let later = "2026-06-01T00:00:00Z";
    let native = native::uuid_status(&parent, || unreachable!("the UUID is kept"), later);
    assert_eq!(native, capstan_status(&parent, uuid, later));
    assert_eq!(
        native["conditions"][1]["lastTransitionTime"],
        "2026-01-01T00:00:00Z"
    );
}
