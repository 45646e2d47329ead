//! Test plugin `guard` (test.capstan.dev/v1 Guard): keeps one ConfigMap, asks for a
//! finalizer, and lets its parent go only once `spec.release` is true; with
//! `spec.refuse` set, its `finalize` says the spec is invalid, with that message.

use std::time::Duration;

use capstan_sdk::prelude::*;
use serde::Deserialize;
use serde_json::json;

#[path = "../../test_crd.rs"]
mod test_crd;

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct GuardSpec {
    release: bool,
    refuse: Option<String>,
}

/// The plugin.
pub struct Guard;

impl Plugin for Guard {
    fn describe() -> PluginInfo {
        PluginInfo::new(
            "guard",
            env!("CARGO_PKG_VERSION"),
            KindRef::namespaced("test.capstan.dev", "v1", "Guard", "guards"),
        )
        .child(KindRef::namespaced("", "v1", "ConfigMap", "configmaps"))
        .with_finalizer()
        .crd_json(&test_crd::crd("Guard", "guards"))
    }

    fn reconcile(ctx: &Context) -> Result<Desired, Error> {
        let mut desired = Desired::new();
        desired.child(&json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": format!("{}-guarded", ctx.name())}}))?;
        desired.status(&json!({"guarding": true}))?;
        Ok(desired)
    }

    fn finalize(ctx: &Context) -> Result<Finalized, Error> {
        let spec: GuardSpec = ctx.spec()?;
        if let Some(why) = spec.refuse {
            return Err(Error::invalid(why));
        }
        if spec.release {
            Ok(Finalized::done().event(Event::normal("Released", "cleanup finished")))
        } else {
            Ok(Finalized::pending(Duration::from_secs(2))
                .event(Event::normal("Holding", "waiting for spec.release")))
        }
    }
}

capstan_sdk::export_plugin!(Guard);
