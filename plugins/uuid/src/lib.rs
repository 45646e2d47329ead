//! The Uuid plugin: gives every `Uuid` (demo.operator/v1) a random v4 UUID, once.
//!
//! This is the kopf operator of seed 001 as a Capstan plugin. The status is
//! `{state: "Ok", message, uuid}`. The UUID is generated only when `status.uuid` is
//! absent, and read back from the status on every later reconcile, so restarts, resyncs
//! and plugin reloads never change it.

use capstan_sdk::prelude::*;
use serde::{Deserialize, Serialize};

/// The CRD of `Uuid`, from `crds/uuid.yaml`.
pub const CRD_JSON: &str = include_str!(concat!(env!("OUT_DIR"), "/crd.json"));

/// The status the plugin writes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UuidStatus {
    /// `Ok` once the UUID exists.
    pub state: String,
    /// Human-readable outcome.
    pub message: String,
    /// The UUID, generated once.
    pub uuid: String,
}

/// The plugin.
pub struct UuidPlugin;

impl Plugin for UuidPlugin {
    fn describe() -> PluginInfo {
        PluginInfo::new(
            "uuid",
            env!("CARGO_PKG_VERSION"),
            KindRef::namespaced("demo.operator", "v1", "Uuid", "uuid"),
        )
        .crd_json(CRD_JSON)
    }

    fn reconcile(ctx: &Context) -> Result<Desired, Error> {
        let uuid = match existing_uuid(ctx) {
            Some(uuid) => uuid,
            None => {
                let uuid = capstan_sdk::random::uuid_v4()?;
                capstan_sdk::info!(
                    "generated UUID {uuid} for {}/{}",
                    ctx.namespace(),
                    ctx.name()
                );
                uuid
            }
        };
        let mut desired = Desired::new();
        desired.status(&UuidStatus {
            state: "Ok".into(),
            message: "UUID generated".into(),
            uuid,
        })?;
        Ok(desired)
    }
}

/// The UUID already recorded in the status, if it is a well-formed one.
fn existing_uuid(ctx: &Context) -> Option<String> {
    let status: serde_json::Value = ctx.status()?;
    let uuid = status.get("uuid")?.as_str()?;
    is_uuid(uuid).then(|| uuid.to_string())
}

fn is_uuid(s: &str) -> bool {
    s.len() == 36
        && s.char_indices().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => c == '-',
            _ => c.is_ascii_hexdigit(),
        })
}

capstan_sdk::export_plugin!(UuidPlugin);

#[cfg(test)]
mod tests {
    use super::*;
    use capstan_sdk::testing::observe_for;
    use serde_json::json;

    fn parent(status: serde_json::Value) -> serde_json::Value {
        json!({"apiVersion": "demo.operator/v1", "kind": "Uuid",
               "metadata": {"name": "u", "namespace": "default"}, "status": status})
    }

    #[test]
    fn fresh_uuid_gets_a_v4_and_state_ok() {
        let d =
            UuidPlugin::reconcile(&observe_for::<UuidPlugin>(parent(json!(null)), vec![])).unwrap();
        let s: UuidStatus = serde_json::from_value(d.status_value().unwrap().clone()).unwrap();
        assert_eq!(s.state, "Ok");
        assert!(is_uuid(&s.uuid) && &s.uuid[14..15] == "4", "{}", s.uuid);
        assert!(d.children().is_empty());
    }

    #[test]
    fn existing_uuid_is_kept() {
        let kept = "0b3d4a39-6f64-4d2a-9f62-2b8d3c1e5a77";
        let d = UuidPlugin::reconcile(&observe_for::<UuidPlugin>(
            parent(json!({"uuid": kept, "state": "Ok"})),
            vec![],
        ))
        .unwrap();
        assert_eq!(d.status_value().unwrap()["uuid"], kept);
    }

    #[test]
    fn a_malformed_uuid_is_replaced() {
        let d = UuidPlugin::reconcile(&observe_for::<UuidPlugin>(
            parent(json!({"uuid": "NA"})),
            vec![],
        ))
        .unwrap();
        assert_ne!(d.status_value().unwrap()["uuid"], "NA");
    }
}
