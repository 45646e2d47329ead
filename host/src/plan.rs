//! From a plugin's answer to what the host will write: the decorated child manifests,
//! the parent's full status (with `observedGeneration` and conditions), events and the
//! requeue delay. Pure functions: `capstan render` and `capstan run` share them.

use std::time::Duration;

use serde::Serialize;
use serde_json::{Map, Value, json};

use crate::contract::{Condition, ConditionStatus, Desired, Event, EventType, PluginInfo};
use crate::grant::Grant;
use crate::shard::{SHARD_BUCKET_LABEL, bucket_of};
use crate::validate::{self, Violation};

/// Field manager of the host's own writes that belong to no plugin (CRDs).
pub const HOST_FIELD_MANAGER: &str = "capstan";
/// Value of [`MANAGED_BY_LABEL`] on every child: the children's watch caches select it.
pub const MANAGED_BY: &str = "capstan";
/// Label the host sets on every child.
pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";
/// Label naming the plugin that produced a child.
pub const PLUGIN_LABEL: &str = "capstan.dev/plugin";

/// Field manager of a plugin's children and status: one per plugin, so that two plugins
/// (or a plugin and a person) never silently share ownership of a field.
pub fn field_manager(plugin: &str) -> String {
    format!("capstan/{plugin}")
}

/// Field manager of the failure reports on a plugin's parents. It owns only
/// `status.conditions`, so a report can never remove or regress the plugin's fields.
pub fn report_field_manager(plugin: &str) -> String {
    format!("capstan/{plugin}/report")
}

/// Everything one successful reconcile will write.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Plan {
    /// Child manifests, ready for server-side apply.
    pub children: Vec<PlannedChild>,
    /// The parent's complete status as the host will write it.
    pub status: Value,
    /// Events to post on the parent, at most [`MAX_EVENTS`].
    pub events: Vec<Event>,
    /// How many events the plugin asked for beyond [`MAX_EVENTS`], dropped.
    #[serde(skip)]
    pub dropped_events: usize,
    /// When to reconcile again, if the plugin asked.
    #[serde(skip_serializing_if = "Option::is_none", with = "seconds")]
    pub requeue_after: Option<Duration>,
}

/// One child to apply.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PlannedChild {
    /// Index of its kind in [`PluginInfo::children`].
    #[serde(skip)]
    pub kind_index: usize,
    /// Its name.
    #[serde(skip)]
    pub name: String,
    /// The manifest to apply.
    #[serde(flatten)]
    pub manifest: Value,
}

/// Events one reconcile may post: the first this many are posted, the rest dropped and
/// counted (`capstan_events_dropped_total`). Events are for people reading `kubectl
/// describe`; a plugin that emits hundreds per reconcile floods the API server and
/// etcd for every parent it owns.
pub const MAX_EVENTS: usize = 16;

/// Turns a plugin's answer into a [`Plan`], or says why it is refused.
pub fn plan(
    info: &PluginInfo,
    parent: &Value,
    desired: Desired,
    now: &str,
    grant: &Grant,
) -> Result<Plan, Violation> {
    let children = validate::children(info, parent, &desired.children, grant)?;
    let plugin_status = validate::status(desired.status.as_deref())?;
    validate::conditions(&desired.conditions)?;
    let ready = Condition {
        type_: "Ready".into(),
        status: ConditionStatus::True,
        reason: "Reconciled".into(),
        message: match children.len() {
            1 => "1 child applied".into(),
            n => format!("{n} children applied"),
        },
    };
    let mut conditions = vec![ready];
    for c in desired.conditions {
        match conditions.iter_mut().find(|have| have.type_ == c.type_) {
            Some(have) => *have = c,
            None => conditions.push(c),
        }
    }
    let children = children
        .into_iter()
        .map(|c| PlannedChild {
            manifest: decorate(info, parent, c.kind_index, c.manifest),
            kind_index: c.kind_index,
            name: c.name,
        })
        .collect();
    Ok(Plan {
        children,
        status: compose_status(parent, plugin_status, &conditions, now),
        dropped_events: desired.events.len().saturating_sub(MAX_EVENTS),
        events: desired
            .events
            .into_iter()
            .take(MAX_EVENTS)
            .map(bounded_event)
            .collect(),
        requeue_after: desired
            .requeue_after_seconds
            .map(|s| Duration::from_secs(u64::from(s.max(1)))),
    })
}

/// The conditions to write when a reconcile failed: the parent's conditions with
/// `Ready` turned False with `reason` and `message`. Only `status.conditions` is
/// written for a failure (by [`report_field_manager`]): the plugin's fields stay.
pub fn failed_conditions(parent: &Value, reason: &str, message: &str, now: &str) -> Value {
    let ready = not_ready(reason, message);
    Value::Array(merge_conditions(parent, &[ready], now))
}

/// A `Ready=False` condition.
pub fn not_ready(reason: &str, message: &str) -> Condition {
    Condition {
        type_: "Ready".into(),
        status: ConditionStatus::False,
        reason: reason.into(),
        message: message.into(),
    }
}

/// Replaces condition `c` in a planned `status` (computed for `parent`); it keeps the
/// transition time the parent has for it if the status did not change.
pub fn set_condition(status: &mut Value, parent: &Value, c: &Condition, now: &str) {
    let merged = merge_conditions(parent, std::slice::from_ref(c), now);
    let Some(new) = merged
        .into_iter()
        .find(|m| m.get("type").and_then(Value::as_str) == Some(c.type_.as_str()))
    else {
        return;
    };
    let Some(list) = status.get_mut("conditions").and_then(Value::as_array_mut) else {
        return;
    };
    match list
        .iter_mut()
        .find(|m| m.get("type").and_then(Value::as_str) == Some(c.type_.as_str()))
    {
        Some(slot) => *slot = new,
        None => list.push(new),
    }
}

/// Sets namespace, the controller ownerReference and the host's labels on a child.
fn decorate(info: &PluginInfo, parent: &Value, kind_index: usize, mut manifest: Value) -> Value {
    let meta = manifest
        .as_object_mut()
        .expect("validated child is an object")
        .entry("metadata")
        .or_insert_with(|| json!({}));
    let meta = meta
        .as_object_mut()
        .expect("validated metadata is an object");
    if info.children[kind_index].namespaced
        && let Some(ns) = parent
            .pointer("/metadata/namespace")
            .and_then(Value::as_str)
    {
        meta.insert("namespace".into(), json!(ns));
    }
    let labels = meta.entry("labels").or_insert_with(|| json!({}));
    if let Some(labels) = labels.as_object_mut() {
        labels.insert(MANAGED_BY_LABEL.into(), json!(MANAGED_BY));
        labels.insert(PLUGIN_LABEL.into(), json!(info.name));
        // Sharded replicas watch only the children of their buckets' parents.
        if let Some(uid) = parent.pointer("/metadata/uid").and_then(Value::as_str) {
            labels.insert(SHARD_BUCKET_LABEL.into(), json!(bucket_of(uid).to_string()));
        }
    }
    meta.insert(
        "ownerReferences".into(),
        json!([owner_reference(info, parent)]),
    );
    manifest
}

/// The controller ownerReference pointing at `parent`.
pub fn owner_reference(info: &PluginInfo, parent: &Value) -> Value {
    let field = |p: &str| parent.pointer(p).cloned().unwrap_or(Value::Null);
    json!({
        "apiVersion": info.parent.api_version(),
        "kind": info.parent.kind,
        "name": field("/metadata/name"),
        "uid": field("/metadata/uid"),
        "controller": true,
        "blockOwnerDeletion": true,
    })
}

/// The plugin's status fields (or, if it returned none, the ones already there), plus
/// `observedGeneration` and conditions. A condition keeps its `lastTransitionTime`
/// while its status does not change, so an unchanged reconcile gives an equal status.
fn compose_status(
    parent: &Value,
    plugin_status: Option<Map<String, Value>>,
    conditions: &[Condition],
    now: &str,
) -> Value {
    let current = parent.get("status").and_then(Value::as_object);
    let mut status = plugin_status
        .or_else(|| current.cloned())
        .unwrap_or_default();
    let generation = parent.pointer("/metadata/generation").cloned();
    let merged = merge_conditions(parent, conditions, now);
    if let Some(g) = generation {
        status.insert("observedGeneration".into(), g);
    }
    status.insert("conditions".into(), Value::Array(merged));
    Value::Object(status)
}

/// The parent's conditions with `conditions` set: others kept as they are, each set one
/// keeping its `lastTransitionTime` while its status does not change, sorted by type.
fn merge_conditions(parent: &Value, conditions: &[Condition], now: &str) -> Vec<Value> {
    let current = parent.get("status").and_then(Value::as_object);
    let generation = parent.pointer("/metadata/generation").cloned();
    let previous: Vec<Value> = current
        .and_then(|s| s.get("conditions"))
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let mut merged: Vec<Value> = previous
        .iter()
        .filter(|p| {
            let t = p.get("type").and_then(Value::as_str);
            !conditions.iter().any(|c| Some(c.type_.as_str()) == t)
        })
        .cloned()
        .collect();
    for c in conditions {
        let old = previous
            .iter()
            .find(|p| p.get("type").and_then(Value::as_str) == Some(c.type_.as_str()));
        let since = match old {
            Some(old) if old.get("status").and_then(Value::as_str) == Some(c.status.as_str()) => {
                old.get("lastTransitionTime")
                    .cloned()
                    .unwrap_or_else(|| json!(now))
            }
            _ => json!(now),
        };
        let mut cond = json!({
            "type": c.type_,
            "status": c.status.as_str(),
            "reason": c.reason,
            "message": c.message,
            "lastTransitionTime": since,
        });
        if let Some(g) = &generation {
            cond["observedGeneration"] = g.clone();
        }
        merged.push(cond);
    }
    merged.sort_by(|a, b| {
        let t = |v: &Value| {
            v.get("type")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string()
        };
        t(a).cmp(&t(b))
    });
    merged
}

/// Kubernetes caps event messages at 1 KiB; trim rather than fail the whole reconcile.
fn bounded_event(mut e: Event) -> Event {
    const MAX: usize = 1024;
    if e.message.len() > MAX {
        let mut cut = MAX - 3;
        while !e.message.is_char_boundary(cut) {
            cut -= 1;
        }
        e.message.truncate(cut);
        e.message.push_str("...");
    }
    if !validate::is_reason(&e.reason) {
        e.reason = "PluginEvent".into();
    }
    e
}

/// Current time as Kubernetes writes it (RFC 3339, seconds, UTC).
pub fn now() -> String {
    k8s_openapi::jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

/// A Normal event the host posts.
pub fn normal(reason: &str, message: impl Into<String>) -> Event {
    bounded_event(Event {
        type_: EventType::Normal,
        reason: reason.into(),
        message: message.into(),
    })
}

/// A Warning event the host posts for a failure.
pub fn warning(reason: &str, message: impl Into<String>) -> Event {
    bounded_event(Event {
        type_: EventType::Warning,
        reason: reason.into(),
        message: message.into(),
    })
}

mod seconds {
    use std::time::Duration;

    pub fn serialize<S: serde::Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.serialize_str(&format!("{}s", d.as_secs())),
            None => s.serialize_none(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contract::KindRef;

    fn info() -> PluginInfo {
        PluginInfo {
            name: "widget".into(),
            version: "0.1.0".into(),
            parent: KindRef {
                group: "test.capstan.dev".into(),
                version: "v1".into(),
                kind: "Widget".into(),
                plural: "widgets".into(),
                namespaced: true,
            },
            children: vec![KindRef {
                group: String::new(),
                version: "v1".into(),
                kind: "ConfigMap".into(),
                plural: "configmaps".into(),
                namespaced: true,
            }],
            finalizer: false,
            resync_seconds: None,
            crd: None,
            ..Default::default()
        }
    }

    fn parent(status: Value) -> Value {
        json!({"metadata": {"name": "w", "namespace": "ns1", "uid": "u-1", "generation": 3}, "status": status})
    }

    fn desired(children: Vec<Value>, status: Option<Value>) -> Desired {
        Desired {
            children: children.iter().map(Value::to_string).collect(),
            status: status.map(|s| s.to_string()),
            conditions: vec![],
            events: vec![],
            requeue_after_seconds: None,
        }
    }

    #[test]
    fn children_get_namespace_owner_and_labels() {
        let d = desired(
            vec![json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}})],
            None,
        );
        let plan = plan(&info(), &parent(json!({})), d, "T0", &Grant::default()).unwrap();
        let m = &plan.children[0].manifest;
        assert_eq!(m["metadata"]["namespace"], "ns1");
        assert_eq!(m["metadata"]["labels"][MANAGED_BY_LABEL], "capstan");
        assert_eq!(m["metadata"]["labels"][PLUGIN_LABEL], "widget");
        assert_eq!(
            m["metadata"]["labels"][SHARD_BUCKET_LABEL],
            bucket_of("u-1").to_string()
        );
        assert_eq!(m["metadata"]["ownerReferences"][0]["uid"], "u-1");
        assert_eq!(m["metadata"]["ownerReferences"][0]["controller"], true);
        assert_eq!(
            m["metadata"]["ownerReferences"][0]["apiVersion"],
            "test.capstan.dev/v1"
        );
    }

    #[test]
    fn status_gets_generation_and_ready_and_is_stable_across_reconciles() {
        let first = plan(
            &info(),
            &parent(json!({})),
            desired(vec![], Some(json!({"state": "Ok"}))),
            "T0",
            &Grant::default(),
        )
        .unwrap();
        assert_eq!(first.status["state"], "Ok");
        assert_eq!(first.status["observedGeneration"], 3);
        assert_eq!(first.status["conditions"][0]["type"], "Ready");
        assert_eq!(first.status["conditions"][0]["status"], "True");
        assert_eq!(first.status["conditions"][0]["lastTransitionTime"], "T0");
        // Same answer later: the transition time is kept, so the status is equal.
        let again = plan(
            &info(),
            &parent(first.status.clone()),
            desired(vec![], Some(json!({"state": "Ok"}))),
            "T1",
            &Grant::default(),
        )
        .unwrap();
        assert_eq!(again.status, first.status);
    }

    #[test]
    fn failure_reports_only_conditions_and_flips_ready() {
        let ok = plan(
            &info(),
            &parent(json!({})),
            desired(vec![], Some(json!({"uuid": "x"}))),
            "T0",
            &Grant::default(),
        )
        .unwrap();
        let failed = failed_conditions(&parent(ok.status), "InvalidSpec", "bad", "T1");
        // Only the conditions are written for a failure: the plugin's fields are not
        // part of the report at all, so it cannot remove or regress them.
        assert_eq!(failed.as_array().unwrap().len(), 1);
        assert_eq!(failed[0]["status"], "False");
        assert_eq!(failed[0]["reason"], "InvalidSpec");
        assert_eq!(failed[0]["lastTransitionTime"], "T1");
    }

    #[test]
    fn plugin_conditions_override_the_host_ready() {
        let mut d = desired(vec![], None);
        d.conditions.push(Condition {
            type_: "Ready".into(),
            status: ConditionStatus::False,
            reason: "Pending".into(),
            message: "waiting for pods".into(),
        });
        let plan = plan(&info(), &parent(json!({})), d, "T0", &Grant::default()).unwrap();
        let conds = plan.status["conditions"].as_array().unwrap();
        assert_eq!(conds.len(), 1);
        assert_eq!(conds[0]["reason"], "Pending");
    }

    #[test]
    fn a_conflict_turns_the_planned_ready_false_and_keeps_other_conditions() {
        let mut d = desired(vec![], Some(json!({"uuid": "x"})));
        d.conditions.push(Condition {
            type_: "Available".into(),
            status: ConditionStatus::True,
            reason: "Up".into(),
            message: String::new(),
        });
        let ok = plan(
            &info(),
            &parent(json!({})),
            d.clone(),
            "T0",
            &Grant::default(),
        )
        .unwrap();
        let mut status = ok.status.clone();
        let p = parent(ok.status.clone());
        set_condition(
            &mut status,
            &p,
            &not_ready("ChildConflict", "ConfigMap c"),
            "T1",
        );
        let conds = status["conditions"].as_array().unwrap();
        assert_eq!(conds.len(), 2);
        let ready = conds.iter().find(|c| c["type"] == "Ready").unwrap();
        assert_eq!(ready["status"], "False");
        assert_eq!(ready["reason"], "ChildConflict");
        assert_eq!(ready["lastTransitionTime"], "T1");
        assert_eq!(status["uuid"], "x");
        // Reported again with the same status: the transition time stays.
        let mut again = plan(&info(), &parent(status.clone()), d, "T2", &Grant::default())
            .unwrap()
            .status;
        set_condition(
            &mut again,
            &parent(status.clone()),
            &not_ready("ChildConflict", "ConfigMap c"),
            "T2",
        );
        assert_eq!(again, status);
    }

    #[test]
    fn each_plugin_has_its_own_field_managers() {
        assert_eq!(field_manager("widget"), "capstan/widget");
        assert_ne!(field_manager("a"), field_manager("b"));
        assert_ne!(report_field_manager("widget"), field_manager("widget"));
    }

    #[test]
    fn long_event_messages_are_trimmed() {
        let e = warning("Failed", "é".repeat(2000));
        assert!(e.message.len() <= 1024 && e.message.ends_with("..."));
        assert_eq!(warning("not a reason", "m").reason, "PluginEvent");
    }

    #[test]
    fn events_beyond_the_cap_are_dropped_and_counted() {
        let mut d = desired(vec![], None);
        d.events = (0..MAX_EVENTS + 40)
            .map(|i| Event {
                type_: EventType::Normal,
                reason: "Flood".into(),
                message: format!("event {i}"),
            })
            .collect();
        let plan = plan(&info(), &parent(json!({})), d, "T0", &Grant::default()).unwrap();
        assert_eq!(plan.events.len(), MAX_EVENTS);
        assert_eq!(plan.dropped_events, 40);
        assert_eq!(plan.events[0].message, "event 0", "the first are kept");
        let mut few = desired(vec![], None);
        few.events = plan.events[..3].to_vec();
        let plan = super::plan(&info(), &parent(json!({})), few, "T0", &Grant::default()).unwrap();
        assert_eq!((plan.events.len(), plan.dropped_events), (3, 0));
    }

    #[test]
    fn more_conditions_than_the_bound_are_refused() {
        let mut d = desired(vec![], None);
        d.conditions = (0..=validate::MAX_CONDITIONS)
            .map(|i| Condition {
                type_: format!("C{i}"),
                status: ConditionStatus::True,
                reason: "Set".into(),
                message: String::new(),
            })
            .collect();
        let err = plan(&info(), &parent(json!({})), d, "T0", &Grant::default()).unwrap_err();
        assert!(
            matches!(err, Violation::TooLarge { ref what, .. } if what == "the list of conditions"),
            "{err}"
        );
    }
}
