//! The least-privilege ClusterRole `capstan run` needs for a set of plugins, derived
//! from what they declare (`capstan rbac`).

use std::collections::BTreeMap;

use serde_json::{Value, json};

use crate::contract::PluginInfo;

/// Verbs the host uses on parents: read, watch, patch (finalizers), and nothing else.
const PARENT_VERBS: &[&str] = &["get", "list", "watch", "patch", "update"];
/// Verbs on `<parent>/status` and `<parent>/finalizers`.
const SUBRESOURCE_VERBS: &[&str] = &["get", "patch", "update"];
/// Verbs on child kinds: watch and list them, server-side apply (create/patch), prune.
const CHILD_VERBS: &[&str] = &[
    "get", "list", "watch", "create", "patch", "update", "delete",
];

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
            SUBRESOURCE_VERBS,
        );
        // Setting blockOwnerDeletion on children needs update on the owner's finalizers
        // where the OwnerReferencesPermissionEnforcement admission plugin is on.
        add(
            &parent.group,
            format!("{}/finalizers", parent.plural),
            SUBRESOURCE_VERBS,
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
        assert!(find("test.capstan.dev", "widgets/status").is_some());
        assert!(find("events.k8s.io", "events").is_some());
        assert!(find("apiextensions.k8s.io", "customresourcedefinitions").is_none());
        assert!(find("", "secrets").is_none(), "nothing undeclared");
    }
}
