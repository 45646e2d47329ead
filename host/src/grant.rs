//! What a plugin may touch in the cluster: the safe defaults every plugin gets, and the
//! grant an administrator writes to allow more.
//!
//! A plugin's declarations (its parent, children and related kinds, its webhooks) decide
//! what the host watches, reads and writes for it; the grant decides which declarations
//! the host accepts. It lives outside the plugin, in the `[grant]` table of the plugin's
//! `NAME.toml` beside `NAME.wasm` (or `NAME.oci`), a file only whoever administers the
//! plugin directory writes: a plugin has no file access and cannot write its own.
//!
//! Without a grant, a plugin:
//! - reconciles a custom resource kind, never one built into Kubernetes (no Secrets,
//!   Leases or Pods as parents, so no webhook and no finalizer on them);
//! - owns children of namespaced kinds only, in its parent's namespace (the host puts
//!   them there);
//! - reads no Secrets, except the children it owns;
//! - validates and converts its own parent kind only (the webhook is registered for the
//!   parent kind, which is a custom one).
//!
//! A plugin whose declarations exceed its grant is refused at load, in one line that
//! names the kind and the grant that would allow it (docs/security.md).

use std::collections::BTreeMap;

use serde::Deserialize;

use crate::contract::{KindRef, PluginInfo};

/// What an administrator allows a plugin beyond the defaults: the `[grant]` table of its
/// `NAME.toml`. Kinds are written `Kind.group` as `kubectl` writes them
/// (`Lease.coordination.k8s.io`), a core kind by its name alone (`Secret`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Grant {
    /// Built-in kinds the plugin may reconcile as its parent.
    #[serde(default)]
    pub parents: Vec<String>,
    /// Whether the plugin may validate or convert a built-in parent kind it was granted
    /// (a webhook on a built-in kind sees every write of it in the cluster).
    #[serde(default)]
    pub admission: bool,
    /// Cluster-scoped kinds the plugin may own as children.
    #[serde(default)]
    pub cluster_children: Vec<String>,
    /// Secrets the plugin may read as related objects: only those that carry all these
    /// labels reach it, whatever its own selector says.
    #[serde(default)]
    pub secrets: Option<SecretGrant>,
    /// What the Pods of its children may be beyond the defaults (none: its own
    /// ServiceAccounts, unprivileged, no host namespace, path or added capability).
    #[serde(default)]
    pub pods: Option<PodGrant>,
}

/// What the Pods a plugin runs may be, beyond the defaults.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct PodGrant {
    /// ServiceAccounts of the namespace, not children of the answer, its Pods may run as.
    #[serde(default)]
    pub service_accounts: Vec<String>,
    /// Privileged containers.
    #[serde(default)]
    pub privileged: bool,
    /// `hostNetwork`, `hostPID`, `hostIPC`.
    #[serde(default)]
    pub host_namespaces: bool,
    /// `hostPath` volumes.
    #[serde(default)]
    pub host_path: bool,
    /// Capabilities its containers may add.
    #[serde(default)]
    pub capabilities: Vec<String>,
    /// Secret children of type `kubernetes.io/service-account-token`.
    #[serde(default)]
    pub service_account_tokens: bool,
}

/// The Secrets a plugin may read.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct SecretGrant {
    /// The labels (all of them) a Secret must carry to reach the plugin; at least one.
    pub labels: BTreeMap<String, String>,
}

/// A declaration the grant does not allow: one line, naming the kind and how to grant
/// it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("plugin {plugin} is refused: {what}; {how}")]
pub struct Refused {
    /// The plugin.
    pub plugin: String,
    /// What it declared.
    pub what: String,
    /// How an administrator would allow it.
    pub how: String,
}

/// Whether `kind` is built into Kubernetes (or an aggregated API of its project):
/// the core group, a group without a dot (`apps`, `batch`, `policy`…), or one under
/// `k8s.io`, which a CustomResourceDefinition may not use without the API review's
/// approval.
pub fn built_in(kind: &KindRef) -> bool {
    let group = kind.group.as_str();
    group.is_empty() || !group.contains('.') || group == "k8s.io" || group.ends_with(".k8s.io")
}

/// `kind` as a grant names it: `Kind.group`, or `Kind` for the core group.
pub fn grant_name(kind: &KindRef) -> String {
    if kind.group.is_empty() {
        kind.kind.clone()
    } else {
        format!("{}.{}", kind.kind, kind.group)
    }
}

/// Whether `kind` is the core Secret kind.
fn is_secret(kind: &KindRef) -> bool {
    kind.group.is_empty() && kind.kind == "Secret"
}

impl Grant {
    /// Whether the grant names `kind` in `list`.
    fn names(list: &[String], kind: &KindRef) -> bool {
        let name = grant_name(kind);
        list.contains(&name)
    }

    /// The labels a related `kind` must carry to reach the plugin, when the grant
    /// narrows what it reads (Secrets): none, every object its selector selects.
    pub fn related_labels(&self, kind: &KindRef) -> Option<&BTreeMap<String, String>> {
        if is_secret(kind) {
            self.secrets.as_ref().map(|s| &s.labels)
        } else {
            None
        }
    }

    /// Checks what `info` declares against this grant (the defaults when empty): the
    /// first declaration it does not allow.
    pub fn check(&self, info: &PluginInfo, file: &str) -> Result<(), Refused> {
        let refuse = |what: String, how: String| {
            Err(Refused {
                plugin: info.name.clone(),
                what,
                how,
            })
        };
        let parent = &info.parent;
        if built_in(parent) && !Self::names(&self.parents, parent) {
            return refuse(
                format!("its parent kind {parent} is built into Kubernetes"),
                format!(
                    "a plugin reconciles a custom resource kind unless its grant names the \
                     kind: parents = [\"{}\"] in the [grant] of {file}",
                    grant_name(parent)
                ),
            );
        }
        if built_in(parent) && (info.validation.is_some() || info.conversion) && !self.admission {
            return refuse(
                format!("it validates or converts {parent}, a kind built into Kubernetes"),
                format!(
                    "a webhook on a built-in kind sees every write of it in the cluster: \
                     admission = true in the [grant] of {file}"
                ),
            );
        }
        for child in &info.children {
            if !child.namespaced && !Self::names(&self.cluster_children, child) {
                return refuse(
                    format!("its child kind {child} is cluster-scoped"),
                    format!(
                        "a plugin owns namespaced children in its parent's namespace unless \
                         its grant names the kind: cluster-children = [\"{}\"] in the [grant] \
                         of {file}",
                        grant_name(child)
                    ),
                );
            }
        }
        for related in &info.related {
            if is_secret(related) && self.secrets.is_none() {
                return refuse(
                    format!("it reads {related} objects"),
                    format!(
                        "a plugin reads no Secrets but the children it owns, unless its grant \
                         says which: [grant.secrets] labels = {{ ... }} in {file}"
                    ),
                );
            }
        }
        if let Some(secrets) = &self.secrets
            && secrets.labels.is_empty()
        {
            return refuse(
                "its grant lets it read Secrets with no label".into(),
                format!("name at least one label in [grant.secrets] labels of {file}"),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contract::FailurePolicy;

    fn kind(group: &str, kind: &str, namespaced: bool) -> KindRef {
        KindRef {
            group: group.into(),
            version: "v1".into(),
            kind: kind.into(),
            plural: format!("{}s", kind.to_lowercase()),
            namespaced,
        }
    }

    fn info(parent: KindRef) -> PluginInfo {
        PluginInfo {
            name: "hostile".into(),
            version: "1".into(),
            parent,
            children: vec![kind("", "ConfigMap", true)],
            finalizer: false,
            resync_seconds: None,
            crd: None,
            related: vec![],
            validation: None,
            conversion: false,
            contract: "0.2.0".into(),
        }
    }

    fn refused(grant: &Grant, info: &PluginInfo) -> String {
        grant
            .check(info, "hostile.toml")
            .expect_err("refused")
            .to_string()
    }

    #[test]
    fn built_in_groups_are_told_from_custom_ones() {
        for group in [
            "",
            "apps",
            "batch",
            "policy",
            "coordination.k8s.io",
            "rbac.authorization.k8s.io",
        ] {
            assert!(built_in(&kind(group, "X", true)), "{group:?}");
        }
        for group in [
            "demo.operator",
            "db.example.com",
            "mycompany.com",
            "test.capstan.dev",
        ] {
            assert!(!built_in(&kind(group, "X", true)), "{group:?}");
        }
    }

    #[test]
    fn by_default_a_custom_parent_with_namespaced_children_is_allowed() {
        let info = info(kind("db.example.com", "PostgreSQLCluster", true));
        assert_eq!(Grant::default().check(&info, "pg.toml"), Ok(()));
    }

    #[test]
    fn a_built_in_parent_is_refused_and_the_line_says_how_to_grant_it() {
        let lease = info(kind("coordination.k8s.io", "Lease", true));
        let line = refused(&Grant::default(), &lease);
        assert!(
            line.contains("parent kind Lease.coordination.k8s.io/v1 is built into"),
            "{line}"
        );
        assert!(
            line.contains("parents = [\"Lease.coordination.k8s.io\"]"),
            "{line}"
        );
        assert!(!line.contains('\n'), "one line: {line}");
        let secret = info(kind("", "Secret", true));
        assert!(refused(&Grant::default(), &secret).contains("parents = [\"Secret\"]"));
        let granted = Grant {
            parents: vec!["Lease.coordination.k8s.io".into()],
            ..Grant::default()
        };
        assert_eq!(granted.check(&lease, "hostile.toml"), Ok(()));
    }

    #[test]
    fn a_webhook_on_a_granted_built_in_parent_needs_admission_too() {
        let mut lease = info(kind("coordination.k8s.io", "Lease", true));
        lease.validation = Some(FailurePolicy::Fail);
        let parent_only = Grant {
            parents: vec!["Lease.coordination.k8s.io".into()],
            ..Grant::default()
        };
        assert!(refused(&parent_only, &lease).contains("admission = true"));
        let with_admission = Grant {
            admission: true,
            ..parent_only
        };
        assert_eq!(with_admission.check(&lease, "hostile.toml"), Ok(()));
    }

    #[test]
    fn a_cluster_scoped_child_needs_a_grant() {
        let mut info = info(kind("example.com", "Tenant", false));
        info.children = vec![kind(
            "rbac.authorization.k8s.io",
            "ClusterRoleBinding",
            false,
        )];
        let line = refused(&Grant::default(), &info);
        assert!(
            line.contains("cluster-children = [\"ClusterRoleBinding.rbac.authorization.k8s.io\"]"),
            "{line}"
        );
        let granted = Grant {
            cluster_children: vec!["ClusterRoleBinding.rbac.authorization.k8s.io".into()],
            ..Grant::default()
        };
        assert_eq!(granted.check(&info, "hostile.toml"), Ok(()));
    }

    #[test]
    fn reading_secrets_needs_a_grant_with_labels() {
        let mut info = info(kind("example.com", "App", true));
        info.related = vec![kind("", "Secret", true)];
        assert!(refused(&Grant::default(), &info).contains("[grant.secrets]"));
        let no_labels = Grant {
            secrets: Some(SecretGrant::default()),
            ..Grant::default()
        };
        assert!(refused(&no_labels, &info).contains("no label"));
        let labelled = Grant {
            secrets: Some(SecretGrant {
                labels: [("app".to_string(), "shop".to_string())].into(),
            }),
            ..Grant::default()
        };
        assert_eq!(labelled.check(&info, "hostile.toml"), Ok(()));
        let secret = kind("", "Secret", true);
        assert_eq!(
            labelled.related_labels(&secret).map(|l| l.len()),
            Some(1),
            "the grant's labels narrow the Secrets read"
        );
        assert_eq!(labelled.related_labels(&kind("", "ConfigMap", true)), None);
    }

    #[test]
    fn a_grant_is_read_from_toml_and_refuses_unknown_fields() {
        let grant: Grant = toml::from_str(
            "parents = [\"Lease.coordination.k8s.io\"]\nadmission = true\n[secrets]\nlabels = { app = \"shop\" }\n",
        )
        .unwrap();
        assert_eq!(grant.parents, vec!["Lease.coordination.k8s.io"]);
        assert!(grant.admission);
        let unknown = toml::from_str::<Grant>("everything = true\n").unwrap_err();
        assert!(
            unknown.message().contains("unknown field `everything`"),
            "{unknown}"
        );
    }
}
