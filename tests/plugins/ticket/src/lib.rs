//! Test plugin `ticket` (test.capstan.dev Ticket, v1 and v2): the admission rules of
//! `admission_rules.rs` with failure policy Fail, and conversion between v1 and v2,
//! which renames `spec.owner` (v1) to `spec.holder` (v2). The annotation
//! `test.capstan.dev/convert` makes `convert` misbehave: `sleep` (for ever), `panic`,
//! or `refuse`.

use capstan_sdk::prelude::*;
use serde_json::{Value, json};

#[path = "../../admission_rules.rs"]
mod admission_rules;

const GROUP: &str = "test.capstan.dev";

/// The plugin.
pub struct Ticket;

impl Plugin for Ticket {
    fn describe() -> PluginInfo {
        PluginInfo::new(
            "ticket",
            env!("CARGO_PKG_VERSION"),
            KindRef::namespaced(GROUP, "v1", "Ticket", "tickets"),
        )
        .validates(FailurePolicy::Fail)
        .converts()
        .crd_json(&crd())
    }

    fn reconcile(_ctx: &Context) -> Result<Desired, Error> {
        Ok(Desired::new())
    }

    fn validate(old: Option<&Value>, new: &Value) -> Result<Vec<String>, String> {
        admission_rules::validate(old, new)
    }

    fn convert(mut object: Value, to_version: &str) -> Result<Value, String> {
        match object
            .pointer("/metadata/annotations/test.capstan.dev~1convert")
            .and_then(Value::as_str)
        {
            Some("sleep") => {
                std::thread::sleep(std::time::Duration::from_secs(3600));
                loop {
                    std::hint::black_box(0);
                }
            }
            Some("panic") => panic!("asked to panic in convert"),
            Some("refuse") => return Err("asked to refuse the conversion".into()),
            _ => {}
        }
        let (from, to) = match to_version.rsplit('/').next() {
            Some("v1") => ("holder", "owner"),
            Some("v2") => ("owner", "holder"),
            _ => return Err(format!("no version {to_version} (v1 or v2)")),
        };
        if let Some(spec) = object.get_mut("spec").and_then(Value::as_object_mut)
            && let Some(value) = spec.remove(from)
        {
            spec.insert(to.into(), value);
        }
        object["apiVersion"] = json!(format!(
            "{GROUP}/{}",
            to_version.rsplit('/').next().unwrap_or_default()
        ));
        Ok(object)
    }
}

/// The CRD: v1 (stored) and v2, both served, with the same open schema.
fn crd() -> String {
    let version = |name: &str, storage: bool| {
        json!({
            "name": name, "served": true, "storage": storage,
            "subresources": {"status": {}},
            "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                "spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": true},
                "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": true},
            }}},
        })
    };
    json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": format!("tickets.{GROUP}")},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": "Ticket", "plural": "tickets", "singular": "ticket", "listKind": "TicketList"},
            "versions": [version("v1", true), version("v2", false)],
        },
    })
    .to_string()
}

capstan_sdk::export_plugin!(Ticket);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversion_renames_the_owner_both_ways() {
        let v1 = json!({"apiVersion": "test.capstan.dev/v1", "kind": "Ticket",
            "metadata": {"name": "t"}, "spec": {"owner": "ana", "seat": 3}});
        let v2 = Ticket::convert(v1.clone(), "test.capstan.dev/v2").unwrap();
        assert_eq!(v2["apiVersion"], "test.capstan.dev/v2");
        assert_eq!(v2["spec"], json!({"holder": "ana", "seat": 3}));
        assert_eq!(Ticket::convert(v2, "v1").unwrap(), v1);
        assert!(Ticket::convert(v1, "v3").is_err());
    }

    #[test]
    fn validation_refuses_warns_and_keeps_the_owner() {
        let obj = |spec: Value| json!({"spec": spec});
        assert_eq!(
            Ticket::validate(None, &obj(json!({"owner": "a"}))),
            Ok(vec![])
        );
        assert_eq!(
            Ticket::validate(None, &obj(json!({"warn": "careful"}))),
            Ok(vec!["careful".to_string()])
        );
        assert_eq!(
            Ticket::validate(None, &obj(json!({"refuse": "no"}))),
            Err("no".to_string())
        );
        let changed = Ticket::validate(
            Some(&obj(json!({"owner": "a"}))),
            &obj(json!({"owner": "b"})),
        );
        assert!(changed.unwrap_err().contains("cannot change"));
    }
}
