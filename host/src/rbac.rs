//! The least-privilege ClusterRole `capstan run` needs for a set of plugins, derived
//! from what they declare (`capstan rbac`).

use std::collections::BTreeMap;

use serde_json::{Value, json};

use crate::contract::{KindRef, PluginInfo};

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
/// Verbs on related kinds (contract 0.2.0): read only. The shared caches list and
/// watch them; nothing of a related kind is ever written.
const RELATED_VERBS: &[&str] = &["get", "list", "watch"];

/// The ClusterRole named `name` for `plugins`. With `install_crds`, it may also apply
/// CustomResourceDefinitions. When a plugin validates, it may write the
/// ValidatingWebhookConfiguration `webhook_configuration`; when one converts, the
/// conversion of its CRD (and nothing else of it, nor of any other CRD).
///
/// With `plugin_identities` (`capstan run --plugin-identities`), every request made for
/// a plugin is made as its own account ([`plugin_identity`]), so the host's role holds
/// none of the plugins' kinds: only the webhook's configuration and CRDs, and the CRDs
/// it installs.
pub fn cluster_role(
    name: &str,
    plugins: &[PluginInfo],
    install_crds: bool,
    webhook_configuration: &str,
    plugin_identities: bool,
) -> Value {
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
    for info in plugins.iter().filter(|_| !plugin_identities) {
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
        for related in &info.related {
            add(&related.group, related.plural.clone(), RELATED_VERBS);
        }
    }
    if !plugin_identities {
        add("events.k8s.io", "events".into(), &["create", "patch"]);
    }
    if install_crds {
        add(
            "apiextensions.k8s.io",
            "customresourcedefinitions".into(),
            &["get", "list", "watch", "create", "patch"],
        );
    }
    let mut rules: Vec<Value> = rules
        .into_iter()
        .map(|((group, verbs), mut resources)| {
            resources.sort();
            json!({"apiGroups": [group], "resources": resources, "verbs": verbs})
        })
        .collect();
    rules.extend(webhook_rules(name, plugins, webhook_configuration));
    json!({
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "capstan"}},
        "rules": rules,
    })
}

/// What the admission and conversion webhook writes: its ValidatingWebhookConfiguration
/// (server-side apply: `create` when it is absent, which RBAC cannot restrict to a
/// name; `patch`), and the converting plugins' CRDs (`patch`, by name). To make the
/// ClusterRole `role` (this one) the configuration's owner, so that uninstalling
/// deletes it too (`capstan run --webhook-owner-clusterrole`), `get` on that ClusterRole
/// alone. Nothing when no plugin validates or converts.
fn webhook_rules(role: &str, plugins: &[PluginInfo], configuration: &str) -> Vec<Value> {
    let mut rules = Vec::new();
    if plugins.iter().any(|p| p.validation.is_some()) {
        rules.push(json!({"apiGroups": ["admissionregistration.k8s.io"],
            "resources": ["validatingwebhookconfigurations"], "verbs": ["create"]}));
        rules.push(json!({"apiGroups": ["admissionregistration.k8s.io"],
            "resources": ["validatingwebhookconfigurations"], "resourceNames": [configuration],
            "verbs": ["get", "patch"]}));
        rules.push(json!({"apiGroups": ["rbac.authorization.k8s.io"],
            "resources": ["clusterroles"], "resourceNames": [role], "verbs": ["get"]}));
    }
    let mut crds: Vec<String> = plugins
        .iter()
        .filter(|p| p.conversion)
        .map(|p| format!("{}.{}", p.parent.plural, p.parent.group))
        .collect();
    crds.sort();
    crds.dedup();
    if !crds.is_empty() {
        rules.push(json!({"apiGroups": ["apiextensions.k8s.io"],
            "resources": ["customresourcedefinitions"], "resourceNames": crds,
            "verbs": ["get", "patch"]}));
    }
    rules
}

/// The prefix of a plugin's own ServiceAccount, ClusterRole and ClusterRoleBinding
/// (`capstan run --plugin-identities`).
pub const PLUGIN_ACCOUNT_PREFIX: &str = "capstan-plugin-";

/// The Role and RoleBinding that let the host's ServiceAccount `host` (in
/// `namespace`) make its requests as each of `plugins`' own accounts there
/// (impersonation, by name, in that namespace only).
pub fn impersonation(plugins: &[PluginInfo], namespace: &str, host: &str) -> Vec<Value> {
    let mut accounts: Vec<String> = plugins
        .iter()
        .map(|p| format!("{PLUGIN_ACCOUNT_PREFIX}{}", p.name))
        .collect();
    accounts.sort();
    accounts.dedup();
    let name = format!("{host}-impersonate-plugins");
    let labels = json!({"app.kubernetes.io/name": "capstan"});
    vec![
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
               "metadata": {"name": name, "namespace": namespace, "labels": labels},
               "rules": [{"apiGroups": [""], "resources": ["serviceaccounts"],
                          "resourceNames": accounts, "verbs": ["impersonate"]}]}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": {"name": name, "namespace": namespace, "labels": labels},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
               "subjects": [{"kind": "ServiceAccount", "name": host, "namespace": namespace}]}),
    ]
}

/// A plugin's own identity in `namespace` (`capstan run --plugin-identities`): its
/// ServiceAccount `capstan-plugin-<plugin>`, and a ClusterRole bound to it (both named
/// `<host>-plugin-<plugin>`, after the host's ClusterRole `host`, so that two hosts'
/// plugins do not share cluster-scoped names) that allows what its declarations
/// need and nothing else: its parents (list, watch, patch; their status and
/// finalizers), its child kinds (its own caches' list and watch; get, create, patch,
/// delete), its related kinds (read only) and events.
pub fn plugin_identity(info: &PluginInfo, namespace: &str, host: &str) -> Vec<Value> {
    let name = format!("{PLUGIN_ACCOUNT_PREFIX}{}", info.name);
    let role = format!("{host}-plugin-{}", info.name);
    let labels = json!({"app.kubernetes.io/name": "capstan", "capstan.dev/plugin": info.name});
    let parent = &info.parent;
    let mut rules = vec![
        json!({"apiGroups": [parent.group], "resources": [parent.plural], "verbs": PARENT_VERBS}),
        json!({"apiGroups": [parent.group], "resources": [format!("{}/status", parent.plural)], "verbs": STATUS_VERBS}),
        json!({"apiGroups": [parent.group], "resources": [format!("{}/finalizers", parent.plural)], "verbs": FINALIZERS_VERBS}),
    ];
    rules.extend(rules_by_group(&info.children, CHILD_VERBS));
    rules.extend(rules_by_group(&info.related, RELATED_VERBS));
    rules.push(json!({"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]}));
    vec![
        json!({"apiVersion": "v1", "kind": "ServiceAccount",
               "metadata": {"name": name, "namespace": namespace, "labels": labels},
               "automountServiceAccountToken": false}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
               "metadata": {"name": role, "labels": labels}, "rules": rules}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
               "metadata": {"name": role, "labels": labels},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
               "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]}),
    ]
}

/// One rule a group for `kinds`, with `verbs`: their plurals, sorted and once each.
fn rules_by_group(kinds: &[KindRef], verbs: &[&str]) -> Vec<Value> {
    let mut groups: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for kind in kinds {
        let plurals = groups.entry(kind.group.as_str()).or_default();
        if !plurals.contains(&kind.plural.as_str()) {
            plurals.push(kind.plural.as_str());
        }
    }
    groups
        .into_iter()
        .map(|(group, mut plurals)| {
            plurals.sort();
            json!({"apiGroups": [group], "resources": plurals, "verbs": verbs})
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contract::KindRef;

    #[test]
    fn a_plugins_own_role_allows_its_parents_children_and_events_only() {
        let info = PluginInfo {
            name: "widget".into(),
            parent: kind("test.capstan.dev", "Widget", "widgets"),
            children: vec![
                kind("", "ConfigMap", "configmaps"),
                kind("apps", "StatefulSet", "statefulsets"),
            ],
            related: vec![kind("", "Secret", "secrets")],
            ..PluginInfo::default()
        };
        let objects = plugin_identity(&info, "capstan-system", "capstan");
        assert_eq!(objects[0]["kind"], "ServiceAccount");
        assert_eq!(objects[0]["metadata"]["name"], "capstan-plugin-widget");
        assert_eq!(objects[0]["automountServiceAccountToken"], false);
        let rules = objects[1]["rules"].as_array().unwrap();
        let resources: Vec<String> = rules
            .iter()
            .flat_map(|r| {
                r["resources"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_str().unwrap().to_string())
            })
            .collect();
        assert_eq!(
            resources,
            [
                "widgets",
                "widgets/status",
                "widgets/finalizers",
                "configmaps",
                "statefulsets",
                "secrets",
                "events"
            ]
        );
        // Its related Secrets are read only; no verb hands out more than it declared.
        let secrets = rules
            .iter()
            .find(|r| r["resources"] == json!(["secrets"]))
            .unwrap();
        assert_eq!(secrets["verbs"], json!(["get", "list", "watch"]));
        for rule in rules {
            for verb in rule["verbs"].as_array().unwrap() {
                assert!(
                    !["*", "update", "escalate", "bind", "impersonate"]
                        .contains(&verb.as_str().unwrap())
                        || (verb == "update" && rule["resources"][0] == "widgets/finalizers"),
                    "{rule}"
                );
            }
        }
        assert_eq!(objects[2]["subjects"][0]["namespace"], "capstan-system");
        let host = impersonation(&[info], "capstan-system", "capstan");
        assert_eq!(host[0]["metadata"]["namespace"], "capstan-system");
        assert_eq!(
            host[0]["rules"],
            json!([{"apiGroups": [""], "resources": ["serviceaccounts"],
                    "resourceNames": ["capstan-plugin-widget"], "verbs": ["impersonate"]}])
        );
        assert_eq!(host[1]["subjects"][0]["name"], "capstan");
    }

    #[test]
    fn with_plugin_identities_the_hosts_role_holds_none_of_the_plugins_kinds() {
        let mut info = PluginInfo {
            name: "widget".into(),
            parent: kind("test.capstan.dev", "Widget", "widgets"),
            children: vec![kind("", "Secret", "secrets")],
            related: vec![kind("", "Pod", "pods")],
            ..PluginInfo::default()
        };
        info.validation = Some(crate::contract::FailurePolicy::Fail);
        let role = cluster_role("capstan", &[info], true, "capstan", true);
        let resources: Vec<&str> = role["rules"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|r| r["resources"].as_array().unwrap())
            .map(|v| v.as_str().unwrap())
            .collect();
        assert_eq!(
            resources,
            [
                "customresourcedefinitions",
                "validatingwebhookconfigurations",
                "validatingwebhookconfigurations",
                "clusterroles"
            ],
            "{role}"
        );
    }

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
            ..Default::default()
        };
        let mut reader = info.clone();
        reader.name = "reader".into();
        reader.parent = kind("test.capstan.dev", "Reader", "readers");
        reader.children = vec![];
        reader.related = vec![kind("", "Secret", "secrets"), kind("", "Pod", "pods")];
        let with_related =
            cluster_role("capstan", &[info.clone(), reader], false, "capstan", false);
        let related_rule = with_related["rules"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["resources"] == json!(["pods", "secrets"]))
            .expect("one read-only rule for the related kinds");
        assert_eq!(related_rule["verbs"], json!(["get", "list", "watch"]));
        assert_eq!(related_rule["apiGroups"], json!([""]));
        let role = cluster_role("capstan", &[info], false, "capstan", false);
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

    #[test]
    fn webhook_rights_only_for_plugins_that_validate_or_convert() {
        let plain = PluginInfo {
            name: "w".into(),
            parent: kind("test.capstan.dev", "Widget", "widgets"),
            ..Default::default()
        };
        let none = cluster_role(
            "capstan",
            std::slice::from_ref(&plain),
            false,
            "capstan",
            false,
        );
        let text = none.to_string();
        assert!(!text.contains("validatingwebhookconfigurations"), "{text}");
        assert!(!text.contains("customresourcedefinitions"), "{text}");

        let mut validating = plain.clone();
        validating.parent = kind("test.capstan.dev", "Ticket", "tickets");
        validating.validation = Some(crate::contract::FailurePolicy::Fail);
        validating.conversion = true;
        let role = cluster_role(
            "capstan",
            &[plain, validating],
            false,
            "capstan-hooks",
            false,
        );
        let rules = role["rules"].as_array().unwrap();
        let named = rules
            .iter()
            .find(|r| {
                r["resources"] == json!(["validatingwebhookconfigurations"])
                    && r.get("resourceNames").is_some()
            })
            .expect("get and patch on its own configuration");
        assert_eq!(named["resourceNames"], json!(["capstan-hooks"]));
        assert_eq!(named["verbs"], json!(["get", "patch"]));
        assert!(rules.iter().any(
            |r| r["resources"] == json!(["validatingwebhookconfigurations"])
                && r["verbs"] == json!(["create"])
        ));
        // Its own ClusterRole, to own the configuration with, read by name only.
        let own = rules
            .iter()
            .find(|r| r["resources"] == json!(["clusterroles"]))
            .expect("get on its own ClusterRole");
        assert_eq!(own["resourceNames"], json!(["capstan"]));
        assert_eq!(own["verbs"], json!(["get"]));
        assert!(!none.to_string().contains("clusterroles"));
        let crd = rules
            .iter()
            .find(|r| r["resources"] == json!(["customresourcedefinitions"]))
            .expect("the converting plugin's CRD");
        assert_eq!(crd["resourceNames"], json!(["tickets.test.capstan.dev"]));
        assert_eq!(crd["verbs"], json!(["get", "patch"]));
    }
}
