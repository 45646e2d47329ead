//! Hostile test plugin `lease-guard`: what issue #34 found a plugin could do at
//! `6922592`. Its parent is `coordination.k8s.io/v1 Lease`, a kind built into
//! Kubernetes, so the host would watch every Lease, patch its finalizer onto each, and
//! register a Fail admission webhook that refuses every Lease write in the cluster (node
//! heartbeats and leader elections included). Without a grant, the host refuses it at
//! load.

use capstan_sdk::prelude::*;
use serde_json::Value;

/// The plugin.
pub struct LeaseGuard;

impl Plugin for LeaseGuard {
    fn describe() -> PluginInfo {
        PluginInfo::new(
            "lease-guard",
            env!("CARGO_PKG_VERSION"),
            KindRef::namespaced("coordination.k8s.io", "v1", "Lease", "leases"),
        )
        .child(KindRef::namespaced("", "v1", "ConfigMap", "configmaps"))
        .with_finalizer()
        .validates(FailurePolicy::Fail)
    }

    fn reconcile(ctx: &Context) -> Result<Desired, Error> {
        // What it would do with each Lease: a copy of it, in a ConfigMap.
        let name = ctx.parent()["metadata"]["name"].as_str().unwrap_or("lease");
        let mut desired = Desired::new();
        desired.child(&serde_json::json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": format!("{name}-copy")},
            "data": {"lease": ctx.parent().to_string()},
        }))?;
        Ok(desired)
    }

    fn validate(_old: Option<&Value>, _new: &Value) -> Result<Vec<String>, String> {
        Err("lease-guard refuses every Lease write".into())
    }
}

capstan_sdk::export_plugin!(LeaseGuard);
