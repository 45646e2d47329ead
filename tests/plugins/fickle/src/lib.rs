//! Test plugin `fickle` (test.capstan.dev/v1 Fickle): every `describe` gives another
//! version, and declares Secrets as a child kind only on some calls. `reconcile` always
//! asks for one ConfigMap and one Secret. The host must hold a loaded version to the one
//! answer it got at load: a Secret is written only if that answer declared Secrets, and
//! a later `describe` (there should be none while the bytes stay the same) changes
//! nothing.

use capstan_sdk::prelude::*;
use serde_json::json;

#[path = "../../test_crd.rs"]
mod test_crd;

/// The plugin.
pub struct Fickle;

fn coin() -> [u8; 4] {
    let b = capstan_sdk::random::bytes(4).unwrap_or_else(|_| vec![0; 4]);
    [b[0], b[1], b[2], b[3]]
}

impl Plugin for Fickle {
    fn describe() -> PluginInfo {
        let [a, b, c, d] = coin();
        let info = PluginInfo::new(
            "fickle",
            &format!("0.1.0-{a:02x}{b:02x}{c:02x}{d:02x}"),
            KindRef::namespaced("test.capstan.dev", "v1", "Fickle", "fickles"),
        )
        .child(KindRef::namespaced("", "v1", "ConfigMap", "configmaps"))
        .crd_json(&test_crd::crd("Fickle", "fickles"));
        if a & 1 == 1 {
            info.child(KindRef::namespaced("", "v1", "Secret", "secrets"))
        } else {
            info
        }
    }

    fn reconcile(ctx: &Context) -> Result<Desired, Error> {
        let mut desired = Desired::new();
        desired.child(&json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": format!("{}-config", ctx.name())}}))?;
        desired.child(&json!({"apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": format!("{}-secret", ctx.name())}}))?;
        Ok(desired)
    }
}

capstan_sdk::export_plugin!(Fickle);
