//! The least-privilege ClusterRole `capstan run` needs for a set of plugins, derived
//! from what they declare (`capstan rbac`).

use std::collections::BTreeMap;

use serde_json::{Value, json};

use crate::contract::PluginInfo;

/// Verbs on parents: the controller lists and watches them, and merge-patches
/// `metadata.finalizers` (add, remove, release). Parents are never read one by one,
/// created, replaced or deleted.
const PARENT_VERBS: &[&str] = &["list", "watch", "patch"];
/// Verbs on `<parent>/status`: status and failure conditions are written with
/// server-side apply, a PATCH.
const STATUS_VERBS: &[&str] = &["patch"];
/// Verbs on `<parent>/finalizers`: setting `blockOwnerDeletion` in a child's owner
/// reference needs `update` on the owner's finalizers wherever the
/// OwnerReferencesPermissionEnforcement admission plugin is on. Nothing calls it.
const FINALIZERS_VERBS: &[&str] = &["update"];
/// Verbs on child kinds: list and watch (the shared caches), get (the owner of an
/// object whose name a desired child takes), create and patch (server-side apply, which
/// creates what is absent), delete (prune, with a UID precondition). Never `update`.
const CHILD_VERBS: &[&str] = &["get", "list", "watch", "create", "patch", "delete"];

/// The ClusterRole named `name` for `plugins`. With `install_crds`, it may also apply
/// CustomResourceDefinitions.
pub fn cluster_role(name: &str, plugins: &[PluginInfo], install_crds: bool) -> Value {
    // (apiGroup, verbs) -> resources, so kinds that need the same verbs share a rule.
    let mut rules: BTreeMap<(String, Vec<&str>), Vec<String>> = BTreeMap::new();
    let mut add = |group: &str, resource: String, verbs: &[&'static str]| {
        let list = rules
            .entry((group.to_string(), verbs.to_vec()))
            .or_default();
        if !list.contains(&resource) {
            list.push(resource);
        }
    };
    for info in plugins {
        let parent = &info.parent;
        add(&parent.group, parent.plural.clone(), PARENT_VERBS);
        add(
            &parent.group,
            format!("{}/status", parent.plural),
            STATUS_VERBS,
        );
        add(
            &parent.group,
            format!("{}/finalizers", parent.plural),
            FINALIZERS_VERBS,
        );
        for child in &info.children {
            add(&child.group, child.plural.clone(), CHILD_VERBS);
        }
    }
    add("events.k8s.io", "events".into(), &["create", "patch"]);
    if install_crds {
        add(
            "apiextensions.k8s.io",
            "customresourcedefinitions".into(),
            &["get", "list", "watch", "create", "patch"],
        );
    }
    let rules: Vec<Value> = rules
        .into_iter()
        .map(|((group, verbs), mut resources)| {
            resources.sort();
            json!({"apiGroups": [group], "resources": resources, "verbs": verbs})
        })
        .collect();
    json!({
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "capstan"}},
        "rules": rules,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contract::KindRef;

    fn kind(group: &str, kind: &str, plural: &str) -> KindRef {
        KindRef {
            group: group.into(),
            version: "v1".into(),
            kind: kind.into(),
            plural: plural.into(),
            namespaced: true,
        }
    }

    #[test]
    fn rules_cover_parents_status_children_and_events_only() {
        let info = PluginInfo {
            name: "w".into(),
            version: "1".into(),
            parent: kind("test.capstan.dev", "Widget", "widgets"),
            children: vec![
                kind("", "ConfigMap", "configmaps"),
                kind("", "Service", "services"),
            ],
            finalizer: false,
            resync_seconds: None,
            crd: None,
        };
        let role = cluster_role("capstan", &[info], false);
        let rules = role["rules"].as_array().unwrap();
        let find = |group: &str, resource: &str| {
            rules
                .iter()
                .find(|r| {
                    r["apiGroups"][0] == group
                        && r["resources"]
                            .as_array()
                            .unwrap()
                            .iter()
                            .any(|x| x == resource)
                })
                .map(|r| r["verbs"].clone())
        };
        assert_eq!(
            find("", "configmaps"),
            find("", "services"),
            "same verbs, one rule"
        );
        assert!(
            find("", "configmaps")
                .unwrap()
                .as_array()
                .unwrap()
                .iter()
                .any(|v| v == "delete")
        );
        let parent_verbs = find("test.capstan.dev", "widgets").unwrap();
        assert!(
            !parent_verbs
                .as_array()
                .unwrap()
                .iter()
                .any(|v| v == "delete" || v == "create")
        );
        assert_eq!(parent_verbs, json!(["list", "watch", "patch"]));
        assert_eq!(
            find("test.capstan.dev", "widgets/status"),
            Some(json!(["patch"]))
        );
        assert_eq!(
            find("test.capstan.dev", "widgets/finalizers"),
            Some(json!(["update"])),
            "blockOwnerDeletion needs update on the owner's finalizers, and only that"
        );
        let updates: Vec<&Value> = rules
            .iter()
            .filter(|r| r["verbs"].as_array().unwrap().iter().any(|v| v == "update"))
            .collect();
        assert_eq!(updates.len(), 1, "update only on finalizers: {updates:?}");
        assert!(find("events.k8s.io", "events").is_some());
        assert!(find("apiextensions.k8s.io", "customresourcedefinitions").is_none());
        assert!(find("", "secrets").is_none(), "nothing undeclared");
    }
}
