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
    Context::new(info, parent, children, Vec::new())
}

/// A [`Context`] for `P` with related objects too (JSON objects, matched to `P`'s
/// declared related kinds by `apiVersion` and `kind`; undeclared ones are dropped).
pub fn observe_related_for<P: Plugin>(
    parent: Value,
    children: Vec<Value>,
    related: Vec<Value>,
) -> Context {
    let info = P::describe();
    let index = |objects: Vec<Value>, find: &dyn Fn(&str, &str) -> Option<usize>| {
        objects
            .into_iter()
            .filter_map(|o| {
                let api_version = o.get("apiVersion")?.as_str()?.to_string();
                let kind = o.get("kind")?.as_str()?.to_string();
                Some((find(&api_version, &kind)?, o))
            })
            .collect::<Vec<_>>()
    };
    let children = index(children, &|a, k| info.child_index(a, k));
    let related = index(related, &|a, k| info.related_index(a, k));
    Context::new(info, parent, children, related)
}

/// A [`Context`] with no declared child kinds, for plugins that only set status.
///
/// `children` are dropped: without a plugin's declaration no child kind is known. To
/// test a plugin that sees its children, use [`observe_for`] (or
/// [`observe_related_for`]) with the plugin's type.
pub fn observe(parent: Value, children: Vec<Value>) -> Context {
    let _ = children;
    let info = crate::PluginInfo::new(
        "test",
        "0.0.0",
        crate::KindRef::namespaced("", "v1", "Test", "tests"),
    );
    Context::new(info, parent, Vec::new(), Vec::new())
}
