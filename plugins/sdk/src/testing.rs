//! Helpers for unit-testing a plugin natively, without the host.

use serde_json::Value;

use crate::{Context, Plugin};

/// A [`Context`] for `P` from a parent and observed children (JSON objects). Children
/// are matched to `P`'s declared kinds by `apiVersion` and `kind`; undeclared ones are
/// dropped, as the host would never pass them.
pub fn observe_for<P: Plugin>(parent: Value, children: Vec<Value>) -> Context {
    let info = P::describe();
    let children = children
        .into_iter()
        .filter_map(|c| {
            let api_version = c.get("apiVersion")?.as_str()?.to_string();
            let kind = c.get("kind")?.as_str()?.to_string();
            Some((info.child_index(&api_version, &kind)?, c))
        })
        .collect();
    Context::new(info, parent, children)
}

/// A [`Context`] with no declared child kinds, for plugins that only set status.
pub fn observe(parent: Value, children: Vec<Value>) -> Context {
    let _ = children;
    let info = crate::PluginInfo::new(
        "test",
        "0.0.0",
        crate::KindRef::namespaced("", "v1", "Test", "tests"),
    );
    Context::new(info, parent, Vec::new())
}
