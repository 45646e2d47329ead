//! Test plugin `pass` (test.capstan.dev/v1 Pass): the admission rules of
//! `admission_rules.rs` with failure policy Ignore, so that a `validate` that cannot
//! answer lets the change through with a warning.

use capstan_sdk::prelude::*;
use serde_json::Value;

#[path = "../../admission_rules.rs"]
mod admission_rules;
#[path = "../../test_crd.rs"]
mod test_crd;

/// The plugin.
pub struct Pass;

impl Plugin for Pass {
    fn describe() -> PluginInfo {
        PluginInfo::new(
            "pass",
            env!("CARGO_PKG_VERSION"),
            KindRef::namespaced("test.capstan.dev", "v1", "Pass", "passes"),
        )
        .validates(FailurePolicy::Ignore)
        .crd_json(&test_crd::crd("Pass", "passes"))
    }

    fn reconcile(_ctx: &Context) -> Result<Desired, Error> {
        Ok(Desired::new())
    }

    fn validate(old: Option<&Value>, new: &Value) -> Result<Vec<String>, String> {
        admission_rules::validate(old, new)
    }
}

capstan_sdk::export_plugin!(Pass);
