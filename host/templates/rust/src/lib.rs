//! The `{{kind}}` plugin ({{group}}/{{version}}): each {{kind}} gets a ConfigMap holding
//! its `spec.message`, and reports in its status whether the ConfigMap exists yet.

use capstan_sdk::prelude::*;
use serde::{Deserialize, Serialize};
use serde_json::json;

/// The CustomResourceDefinition of {{kind}}, shipped in `describe`: `capstan crd` prints
/// it and `capstan run --install-crds` applies it.
const CRD_JSON: &str = include_str!("crd.json");

/// The spec.
#[derive(Debug, Deserialize)]
pub struct Spec {
    /// What the ConfigMap holds.
    #[serde(default)]
    pub message: String,
}

/// What the plugin writes to the status (the host adds observedGeneration and the
/// conditions).
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Status {
    /// `Pending` until the ConfigMap is observed, then `Ready`.
    pub phase: &'static str,
    /// The ConfigMap's name.
    pub config_map: String,
}

/// The plugin.
pub struct {{kind}}Plugin;

impl Plugin for {{kind}}Plugin {
    fn describe() -> PluginInfo {
        PluginInfo::new(
            "{{name}}",
            env!("CARGO_PKG_VERSION"),
            KindRef::namespaced("{{group}}", "{{version}}", "{{kind}}", "{{plural}}"),
        )
        .child(KindRef::namespaced("", "v1", "ConfigMap", "configmaps"))
        .crd_json(CRD_JSON)
    }

    fn reconcile(ctx: &Context) -> Result<Desired, Error> {
        let spec: Spec = ctx.spec()?;
        if spec.message.trim().is_empty() {
            return Err(Error::invalid("spec.message: a non-empty string is required"));
        }
        let name = format!("{}-{{singular}}", ctx.name());
        let exists = ctx
            .raw_children("v1", "ConfigMap")
            .any(|c| c["metadata"]["name"] == name.as_str());

        let mut desired = Desired::new();
        desired.child(&json!({
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": ctx.name()}},
            "data": {"message": spec.message},
        }))?;
        desired.status(&Status {
            phase: if exists { "Ready" } else { "Pending" },
            config_map: name.clone(),
        })?;
        desired.condition(if exists {
            Condition::new("ConfigMapReady", true, "Observed", format!("ConfigMap {name} exists"))
        } else {
            Condition::new("ConfigMapReady", false, "Created", format!("ConfigMap {name} was asked for"))
        });
        Ok(desired)
    }
}

capstan_sdk::export_plugin!({{kind}}Plugin);
