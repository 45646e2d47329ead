//! Checks on what plugins declare and return, before anything touches the cluster.
//!
//! A violation is the plugin's bug: nothing is applied, and the parent gets a condition
//! and a Warning event that say what was wrong.

use serde_json::Value;

use crate::contract::{Condition, KindRef, PluginInfo, RelatedRequest, Selector};
use crate::grant::Grant;

/// Largest child manifest accepted, in bytes of JSON (etcd refuses objects above ~1.5 MiB).
pub const MAX_CHILD_BYTES: usize = 1 << 20;
/// Largest number of children one parent may have.
pub const MAX_CHILDREN: usize = 256;
/// Largest status object accepted, in bytes of JSON.
pub const MAX_STATUS_BYTES: usize = 256 << 10;

/// Something a plugin declared or returned that the host refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Violation {
    /// `describe` returned something unusable.
    #[error("{0}")]
    Info(String),
    /// A desired child is not a JSON object with `apiVersion`, `kind` and `metadata.name`.
    #[error("child #{index}: {reason}")]
    Malformed {
        /// Position in the plugin's list.
        index: usize,
        /// What is wrong.
        reason: String,
    },
    /// A desired child has a kind the plugin did not declare.
    #[error("child {kind} {name:?} is of a kind the plugin did not declare (declared: {declared})")]
    UndeclaredKind {
        /// `kind.apiVersion` of the child.
        kind: String,
        /// Its name.
        name: String,
        /// The declared kinds.
        declared: String,
    },
    /// A desired child names a namespace other than the parent's.
    #[error(
        "child {kind} {name:?} is in namespace {namespace:?}, but children must live in the parent's namespace {parent_namespace:?}"
    )]
    ForeignNamespace {
        /// Kind of the child.
        kind: String,
        /// Its name.
        name: String,
        /// The namespace it asked for.
        namespace: String,
        /// The parent's.
        parent_namespace: String,
    },
    /// A name is not a valid Kubernetes object name.
    #[error("child {kind} has an invalid name {name:?}: {reason}")]
    InvalidName {
        /// Kind of the child.
        kind: String,
        /// The name.
        name: String,
        /// Why.
        reason: String,
    },
    /// A desired child carries an ownerReference to something other than the parent.
    #[error("child {kind} {name:?} has an ownerReference to {owner}, not to the parent")]
    ForeignOwner {
        /// Kind of the child.
        kind: String,
        /// Its name.
        name: String,
        /// The owner it named.
        owner: String,
    },
    /// Two desired children have the same kind and name.
    #[error("child {kind} {name:?} is desired twice")]
    Duplicate {
        /// Kind of the child.
        kind: String,
        /// Its name.
        name: String,
    },
    /// Something is larger than the host accepts.
    #[error("{what} is {size} bytes or items, over the limit of {limit}")]
    TooLarge {
        /// What.
        what: String,
        /// How large it is.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// The status is not a JSON object.
    #[error("status must be a JSON object: {0}")]
    Status(String),
    /// A condition is malformed.
    #[error("condition {type_:?}: {reason}")]
    Condition {
        /// Its type.
        type_: String,
        /// What is wrong.
        reason: String,
    },
    /// A Role, RoleBinding, ClusterRole or ClusterRoleBinding child grants more than a
    /// plugin may grant.
    #[error("child {kind} {name:?} grants too much: {reason}")]
    Rights {
        /// Kind of the child.
        kind: String,
        /// Its name.
        name: String,
        /// What, and what is allowed.
        reason: String,
    },
    /// A child that runs Pods (or a Secret) would give them more than the plugin's
    /// grant allows: another account, the node's namespaces or files, privileges.
    #[error("child {kind} {name:?} is refused: {reason}")]
    Pods {
        /// Kind of the child.
        kind: String,
        /// Its name.
        name: String,
        /// What, and how to grant it.
        reason: String,
    },
    /// `customize` asked for something the host does not serve.
    #[error("customize: {0}")]
    Related(String),
    /// `finalize` named a child to delete that is not a declared kind.
    #[error("finalize: {0}")]
    Teardown(String),
}

/// How many conditions one answer may set (besides the host's `Ready`).
pub const MAX_CONDITIONS: usize = 32;

/// How many requests `customize` may return (the contract says so).
pub const MAX_RELATED_REQUESTS: usize = 64;

/// How many related objects one call may receive, all requests together.
pub const MAX_RELATED_OBJECTS: usize = 1000;

/// Checks what `customize` returned against what the plugin declared: declared related
/// kinds only, names that cannot reach another namespace, labels that are labels,
/// label selectors only on namespaced kinds, and at most [`MAX_RELATED_REQUESTS`].
pub fn related_requests(info: &PluginInfo, requests: &[RelatedRequest]) -> Result<(), Violation> {
    let bad = |m: String| Err(Violation::Related(m));
    if requests.len() > MAX_RELATED_REQUESTS {
        return Err(Violation::TooLarge {
            what: "the requests of customize".into(),
            size: requests.len(),
            limit: MAX_RELATED_REQUESTS,
        });
    }
    for request in requests {
        let Some(kind) = info.related.get(request.kind_index as usize) else {
            return bad(format!(
                "kind index {} is not a declared related kind (the plugin declares {})",
                request.kind_index,
                info.related.len()
            ));
        };
        match &request.selector {
            // A name with a '/' or '..' could reach another namespace in a URL; names are
            // DNS subdomains, which have neither.
            Selector::Name(name) => {
                if let Err(reason) = dns_subdomain(name) {
                    return bad(format!("{} name {name:?}: {reason}", kind.kind));
                }
            }
            Selector::Labels(labels) => {
                if !kind.namespaced {
                    return bad(format!(
                        "{} is cluster-scoped: ask for its objects by name, not by labels",
                        kind.kind
                    ));
                }
                for (key, value) in labels {
                    if key.is_empty()
                        || key.len() > 317
                        || value.len() > 63
                        || !key.bytes().all(|b| {
                            b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'/')
                        })
                        || !value
                            .bytes()
                            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
                    {
                        return bad(format!(
                            "{} label {key:?}={value:?} is not a valid label",
                            kind.kind
                        ));
                    }
                }
            }
        }
    }
    Ok(())
}

/// Checks a plugin's declaration.
pub fn plugin_info(info: &PluginInfo) -> Result<(), Violation> {
    let bad = |m: String| Err(Violation::Info(m));
    if info.name.is_empty()
        || info.name.len() > 63
        || !info
            .name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    {
        return bad(format!(
            "plugin name {:?} must be 1-63 lower-case letters, digits or '-'",
            info.name
        ));
    }
    kind_ref(&info.parent).map_err(|m| Violation::Info(format!("parent kind: {m}")))?;
    for child in &info.children {
        kind_ref(child).map_err(|m| Violation::Info(format!("child kind {}: {m}", child.kind)))?;
        if info.parent.namespaced && !child.namespaced {
            return bad(format!(
                "child kind {child} is cluster-scoped; a namespaced parent can only own namespaced children"
            ));
        }
        if !info.parent.namespaced && child.namespaced {
            // The host puts children in their parent's namespace, and a cluster-scoped
            // parent has none: such a plugin could never apply a single child.
            return bad(format!(
                "child kind {child} is namespaced; a cluster-scoped parent can only own cluster-scoped children"
            ));
        }
    }
    for related in &info.related {
        kind_ref(related)
            .map_err(|m| Violation::Info(format!("related kind {}: {m}", related.kind)))?;
        if related == &info.parent || info.children.contains(related) {
            return bad(format!(
                "related kind {related} is also the parent or a child kind; a related kind is only read"
            ));
        }
        if !info.parent.namespaced && related.namespaced {
            return bad(format!(
                "related kind {related} is namespaced; a cluster-scoped parent has no namespace to read it in"
            ));
        }
    }
    if info.conversion && info.crd.is_none() {
        return bad("the plugin converts between versions but ships no CRD to serve them".into());
    }
    if let Some(crd) = &info.crd {
        let crd: Value = serde_json::from_str(crd)
            .map_err(|e| Violation::Info(format!("the embedded CRD is not valid JSON: {e}")))?;
        let expected = format!("{}.{}", info.parent.plural, info.parent.group);
        if crd.pointer("/metadata/name").and_then(Value::as_str) != Some(expected.as_str()) {
            return bad(format!("the embedded CRD must be named {expected:?}"));
        }
    }
    Ok(())
}

fn kind_ref(k: &KindRef) -> Result<(), String> {
    if k.kind.is_empty() || !k.kind.starts_with(|c: char| c.is_ascii_uppercase()) {
        return Err(format!("kind {:?} must be CamelCase", k.kind));
    }
    if k.version.is_empty() || k.plural.is_empty() {
        return Err("version and plural are required".into());
    }
    if k.plural != k.plural.to_ascii_lowercase() {
        return Err(format!("plural {:?} must be lower-case", k.plural));
    }
    Ok(())
}

/// Whether `name` is a valid DNS subdomain (RFC 1123), the rule for most object names.
pub fn dns_subdomain(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > 253 {
        return Err("must be 1 to 253 characters".into());
    }
    let ok_chars = name
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.');
    let alnum = |c: Option<u8>| c.is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    if !ok_chars || !alnum(name.bytes().next()) || !alnum(name.bytes().last()) {
        return Err(
            "must consist of lower-case letters, digits, '-' or '.', and start and end with a letter or digit"
                .into(),
        );
    }
    Ok(())
}

/// A desired child that passed validation, with the declared kind it belongs to.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidChild {
    /// Index of its kind in [`PluginInfo::children`].
    pub kind_index: usize,
    /// Its name.
    pub name: String,
    /// The manifest as the plugin returned it.
    pub manifest: Value,
}

/// Parses and checks the children a plugin returned for `parent`.
pub fn children(
    info: &PluginInfo,
    parent: &Value,
    raw: &[String],
    grant: &Grant,
) -> Result<Vec<ValidChild>, Violation> {
    if raw.len() > MAX_CHILDREN {
        return Err(Violation::TooLarge {
            what: "the list of children".into(),
            size: raw.len(),
            limit: MAX_CHILDREN,
        });
    }
    let parent_ns = parent
        .pointer("/metadata/namespace")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let parent_uid = parent.pointer("/metadata/uid").and_then(Value::as_str);
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::with_capacity(raw.len());
    for (index, text) in raw.iter().enumerate() {
        if text.len() > MAX_CHILD_BYTES {
            return Err(Violation::TooLarge {
                what: format!("child #{index}"),
                size: text.len(),
                limit: MAX_CHILD_BYTES,
            });
        }
        let malformed = |reason: String| Violation::Malformed { index, reason };
        let manifest: Value =
            serde_json::from_str(text).map_err(|e| malformed(format!("not valid JSON: {e}")))?;
        let field = |p: &str| manifest.pointer(p).and_then(Value::as_str);
        let (Some(api_version), Some(kind)) = (field("/apiVersion"), field("/kind")) else {
            return Err(malformed("apiVersion and kind are required".into()));
        };
        let kind_label = format!("{kind}.{api_version}");
        let Some(name) = field("/metadata/name") else {
            return Err(malformed(format!(
                "{kind_label}: metadata.name is required"
            )));
        };
        let Some(kind_index) = info
            .children
            .iter()
            .position(|k| k.matches(api_version, kind))
        else {
            return Err(Violation::UndeclaredKind {
                kind: kind_label,
                name: name.into(),
                declared: declared(info),
            });
        };
        dns_subdomain(name).map_err(|reason| Violation::InvalidName {
            kind: kind_label.clone(),
            name: name.into(),
            reason,
        })?;
        if let Some(ns) = field("/metadata/namespace")
            && !ns.is_empty()
            && ns != parent_ns
        {
            return Err(Violation::ForeignNamespace {
                kind: kind_label,
                name: name.into(),
                namespace: ns.into(),
                parent_namespace: parent_ns.into(),
            });
        }
        if let Some(owners) = manifest
            .pointer("/metadata/ownerReferences")
            .and_then(Value::as_array)
        {
            for owner in owners {
                if owner.get("uid").and_then(Value::as_str) != parent_uid {
                    return Err(Violation::ForeignOwner {
                        kind: kind_label,
                        name: name.into(),
                        owner: format!(
                            "{} {}",
                            owner.get("kind").and_then(Value::as_str).unwrap_or("?"),
                            owner.get("name").and_then(Value::as_str).unwrap_or("?")
                        ),
                    });
                }
            }
        }
        if !seen.insert((kind_index, name.to_string())) {
            return Err(Violation::Duplicate {
                kind: kind_label,
                name: name.into(),
            });
        }
        out.push(ValidChild {
            kind_index,
            name: name.into(),
            manifest,
        });
    }
    rights(info, parent_ns, &out)?;
    pods(info, &out, grant)?;
    Ok(out)
}

/// Where each kind that runs Pods keeps their spec.
fn pod_spec_of<'v>(kind: &KindRef, manifest: &'v Value) -> Option<&'v Value> {
    let path = match (kind.group.as_str(), kind.kind.as_str()) {
        ("", "Pod") => "/spec",
        ("", "ReplicationController")
        | ("apps", "Deployment" | "StatefulSet" | "DaemonSet" | "ReplicaSet")
        | ("batch", "Job") => "/spec/template/spec",
        ("batch", "CronJob") => "/spec/jobTemplate/spec/template/spec",
        _ => return None,
    };
    manifest.pointer(path)
}

/// What the Pods a plugin runs may be, and which Secrets it may create: a Pod runs as a
/// ServiceAccount of this same answer (or the namespace's `default`, as any Pod without
/// one does), unless the grant names others; it is not privileged, shares no host
/// namespace, mounts no hostPath and adds no capability, unless the grant allows it. A
/// Secret of type `kubernetes.io/service-account-token` (which mints a token for any
/// account of the namespace) is refused unless granted. Without these, a plugin could
/// run as whichever account of the namespace holds the most rights, or as the node.
fn pods(info: &PluginInfo, children: &[ValidChild], grant: &Grant) -> Result<(), Violation> {
    let pods_grant = grant.pods.clone().unwrap_or_default();
    let accounts: Vec<&str> = children
        .iter()
        .filter(|c| {
            let k = &info.children[c.kind_index];
            k.group.is_empty() && k.kind == "ServiceAccount"
        })
        .map(|c| c.name.as_str())
        .collect();
    for child in children {
        let kind = &info.children[child.kind_index];
        let refuse = |reason: String| Violation::Pods {
            kind: format!("{}.{}", kind.kind, kind.api_version()),
            name: child.name.clone(),
            reason,
        };
        if kind.group.is_empty()
            && kind.kind == "Secret"
            && child.manifest.get("type").and_then(Value::as_str)
                == Some("kubernetes.io/service-account-token")
            && !pods_grant.service_account_tokens
        {
            return Err(refuse(
                "a Secret of type kubernetes.io/service-account-token mints a token for an account of the namespace; granted by service-account-tokens = true in [grant.pods]".into(),
            ));
        }
        let Some(spec) = pod_spec_of(kind, &child.manifest) else {
            continue;
        };
        let text = |key: &str| spec.get(key).and_then(Value::as_str);
        for key in ["serviceAccountName", "serviceAccount"] {
            if let Some(account) = text(key)
                && account != "default"
                && !accounts.contains(&account)
                && !pods_grant.service_accounts.iter().any(|a| a == account)
            {
                return Err(refuse(format!(
                    "its Pods run as ServiceAccount {account:?}, which is not a child of this answer; a plugin's Pods run as its own accounts unless service-accounts = [{account:?}] in [grant.pods]"
                )));
            }
        }
        for key in ["hostNetwork", "hostPID", "hostIPC"] {
            let shares = spec.get(key).and_then(Value::as_bool) == Some(true);
            if shares && !pods_grant.host_namespaces {
                return Err(refuse(format!(
                    "its Pods set {key}: true; granted by host-namespaces = true in [grant.pods]"
                )));
            }
        }
        for volume in array(spec, "volumes") {
            if volume.get("hostPath").is_some() && !pods_grant.host_path {
                let name = volume.get("name").and_then(Value::as_str).unwrap_or("?");
                return Err(refuse(format!(
                    "its Pods mount the node's files (hostPath volume {name:?}); granted by host-path = true in [grant.pods]"
                )));
            }
        }
        let containers = ["containers", "initContainers", "ephemeralContainers"]
            .into_iter()
            .flat_map(|key| array(spec, key));
        for container in containers {
            let name = container.get("name").and_then(Value::as_str).unwrap_or("?");
            let security = container.get("securityContext").unwrap_or(&Value::Null);
            if security.get("privileged").and_then(Value::as_bool) == Some(true)
                && !pods_grant.privileged
            {
                return Err(refuse(format!(
                    "container {name:?} is privileged; granted by privileged = true in [grant.pods]"
                )));
            }
            let added = security
                .pointer("/capabilities/add")
                .and_then(Value::as_array)
                .map(Vec::as_slice)
                .unwrap_or_default();
            for capability in added {
                let capability = capability.as_str().unwrap_or("?");
                if !pods_grant.capabilities.iter().any(|c| c == capability) {
                    return Err(refuse(format!(
                        "container {name:?} adds capability {capability}; granted by capabilities = [{capability:?}] in [grant.pods]"
                    )));
                }
            }
        }
    }
    Ok(())
}

/// The RBAC API group.
const RBAC_GROUP: &str = "rbac.authorization.k8s.io";

/// What a plugin's Role may let a Pod do to one of the same parent's children, by name:
/// read it and patch it. The host holds these verbs on every child kind, so the API
/// server's own escalation check lets it create such a Role; nothing that creates,
/// deletes or lists.
pub const GRANTABLE_VERBS: &[&str] = &["get", "watch", "patch"];

/// Rights a plugin hands out through its children: a plugin may let the Pods it runs
/// (a ServiceAccount child) read and patch other children of the same parent, by name,
/// and nothing else. A Role child's rules name declared child kinds (never an RBAC kind),
/// the children of this answer by `resourceNames`, and [`GRANTABLE_VERBS`]; a RoleBinding
/// child binds a Role child of this answer to ServiceAccount children of this answer.
/// ClusterRoles and ClusterRoleBindings are refused: they reach beyond the namespace.
fn rights(info: &PluginInfo, namespace: &str, children: &[ValidChild]) -> Result<(), Violation> {
    let names_of = |group: &str, plural: &str| -> Vec<&str> {
        children
            .iter()
            .filter(|c| {
                let k = &info.children[c.kind_index];
                k.group == group && k.plural == plural
            })
            .map(|c| c.name.as_str())
            .collect()
    };
    for child in children {
        let kind = &info.children[child.kind_index];
        if kind.group != RBAC_GROUP {
            continue;
        }
        let refuse = |reason: String| Violation::Rights {
            kind: format!("{}.{}", kind.kind, kind.api_version()),
            name: child.name.clone(),
            reason,
        };
        match kind.kind.as_str() {
            "Role" => {
                for (i, rule) in array(&child.manifest, "rules").iter().enumerate() {
                    role_rule(info, rule, &names_of)
                        .map_err(|r| refuse(format!("rule {i}: {r}")))?;
                }
            }
            "RoleBinding" => {
                let role_ref = child.manifest.get("roleRef").unwrap_or(&Value::Null);
                let field = |v: &Value, k: &str| {
                    v.get(k)
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .to_string()
                };
                let role = field(role_ref, "name");
                if field(role_ref, "apiGroup") != RBAC_GROUP
                    || field(role_ref, "kind") != "Role"
                    || !names_of(RBAC_GROUP, "roles").contains(&role.as_str())
                {
                    return Err(refuse(format!(
                        "roleRef {} {role:?} is not a Role this parent desires",
                        field(role_ref, "kind")
                    )));
                }
                let accounts = names_of("", "serviceaccounts");
                for subject in array(&child.manifest, "subjects") {
                    let (kind, name) = (field(subject, "kind"), field(subject, "name"));
                    let ns = field(subject, "namespace");
                    if kind != "ServiceAccount"
                        || !accounts.contains(&name.as_str())
                        || (!ns.is_empty() && ns != namespace)
                    {
                        return Err(refuse(format!(
                            "subject {kind} {name:?} is not a ServiceAccount this parent desires in its namespace"
                        )));
                    }
                }
            }
            other => {
                return Err(refuse(format!(
                    "a plugin grants rights only through a Role and a RoleBinding in its parent's namespace, not a {other}"
                )));
            }
        }
    }
    Ok(())
}

/// The array `key` of `v`, empty when there is none.
fn array<'v>(v: &'v Value, key: &str) -> &'v [Value] {
    v.get(key)
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default()
}

/// Checks one rule of a Role child (see [`rights`]).
fn role_rule<'a>(
    info: &PluginInfo,
    rule: &Value,
    names_of: &dyn Fn(&str, &str) -> Vec<&'a str>,
) -> Result<(), String> {
    let strings = |key: &str| -> Vec<&str> {
        rule.get(key)
            .and_then(Value::as_array)
            .map(|a| a.iter().map(|v| v.as_str().unwrap_or("*")).collect())
            .unwrap_or_default()
    };
    if !strings("nonResourceURLs").is_empty() {
        return Err("nonResourceURLs are not a child's".into());
    }
    let (groups, resources, names, verbs) = (
        strings("apiGroups"),
        strings("resources"),
        strings("resourceNames"),
        strings("verbs"),
    );
    if names.is_empty() {
        return Err("no resourceNames: a Role may only name the children it grants".into());
    }
    if let Some(verb) = verbs.iter().find(|v| !GRANTABLE_VERBS.contains(v)) {
        return Err(format!(
            "verb {verb:?}; a plugin may grant only {}",
            GRANTABLE_VERBS.join(", ")
        ));
    }
    if groups.is_empty() || resources.is_empty() || verbs.is_empty() {
        return Err("apiGroups, resources and verbs are required".into());
    }
    for group in &groups {
        for resource in &resources {
            let declared = info
                .children
                .iter()
                .any(|k| k.group == *group && k.plural == *resource && k.group != RBAC_GROUP);
            if !declared {
                return Err(format!(
                    "{resource:?} in group {group:?} is not a child kind of the plugin (RBAC kinds never are grantable)"
                ));
            }
            let children = names_of(group, resource);
            if let Some(name) = names.iter().find(|n| !children.contains(n)) {
                return Err(format!(
                    "resourceName {name:?} is not a {resource} this parent desires"
                ));
            }
        }
    }
    Ok(())
}

/// Parses and checks the status object a plugin returned.
pub fn status(raw: Option<&str>) -> Result<Option<serde_json::Map<String, Value>>, Violation> {
    let Some(text) = raw else { return Ok(None) };
    if text.len() > MAX_STATUS_BYTES {
        return Err(Violation::TooLarge {
            what: "status".into(),
            size: text.len(),
            limit: MAX_STATUS_BYTES,
        });
    }
    match serde_json::from_str(text) {
        Ok(Value::Object(map)) => Ok(Some(map)),
        Ok(other) => Err(Violation::Status(format!("got {}", type_name(&other)))),
        Err(e) => Err(Violation::Status(format!("not valid JSON: {e}"))),
    }
}

/// Checks the conditions a plugin returned.
pub fn conditions(conditions: &[Condition]) -> Result<(), Violation> {
    if conditions.len() > MAX_CONDITIONS {
        return Err(Violation::TooLarge {
            what: "the list of conditions".into(),
            size: conditions.len(),
            limit: MAX_CONDITIONS,
        });
    }
    for c in conditions {
        let bad = |reason: &str| Violation::Condition {
            type_: c.type_.clone(),
            reason: reason.into(),
        };
        if c.type_.is_empty()
            || c.type_.len() > 316
            || !c.type_.starts_with(|ch: char| ch.is_ascii_alphabetic())
        {
            return Err(bad(
                "type must start with a letter and be at most 316 characters",
            ));
        }
        if !is_reason(&c.reason) {
            return Err(bad(
                "reason must be CamelCase: a letter, then letters, digits, '_', ',' or ':'",
            ));
        }
        if c.message.len() > 32768 {
            return Err(bad("message is over 32768 bytes"));
        }
    }
    Ok(())
}

/// The rule of `metav1.Condition.reason`.
pub fn is_reason(reason: &str) -> bool {
    !reason.is_empty()
        && reason.len() <= 1024
        && reason.starts_with(|c: char| c.is_ascii_alphabetic())
        && reason
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b',' || b == b':')
        && !reason.ends_with([',', ':'])
}

fn declared(info: &PluginInfo) -> String {
    if info.children.is_empty() {
        return "none".into();
    }
    info.children
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A namespaced kind of version v1.
    fn k(group: &str, kind: &str, plural: &str) -> KindRef {
        KindRef {
            group: group.into(),
            version: "v1".into(),
            kind: kind.into(),
            plural: plural.into(),
            namespaced: true,
        }
    }

    fn info() -> PluginInfo {
        PluginInfo {
            name: "widget".into(),
            version: "0.1.0".into(),
            parent: k("test.capstan.dev", "Widget", "widgets"),
            children: vec![
                k("", "ConfigMap", "configmaps"),
                k("apps", "StatefulSet", "statefulsets"),
            ],
            finalizer: false,
            resync_seconds: None,
            crd: None,
            ..Default::default()
        }
    }

    fn parent() -> Value {
        json!({"metadata": {"name": "w", "namespace": "ns1", "uid": "u-1"}})
    }

    fn child(v: Value) -> String {
        v.to_string()
    }

    #[test]
    fn accepts_declared_children_in_the_parent_namespace() {
        let raw = vec![
            child(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "a"}})),
            child(
                json!({"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "a", "namespace": "ns1"}}),
            ),
        ];
        let out = children(&info(), &parent(), &raw, &Grant::default()).unwrap();
        assert_eq!(
            out.iter().map(|c| c.kind_index).collect::<Vec<_>>(),
            vec![0, 1]
        );
    }

    /// A plugin that lets its Pods report through a ConfigMap of the same parent: a
    /// ServiceAccount, a Role and a RoleBinding among its children.
    fn reporting_info() -> PluginInfo {
        let mut info = info();
        info.children.extend([
            k("", "ServiceAccount", "serviceaccounts"),
            k(RBAC_GROUP, "Role", "roles"),
            k(RBAC_GROUP, "RoleBinding", "rolebindings"),
            k(RBAC_GROUP, "ClusterRole", "clusterroles"),
            k("", "Secret", "secrets"),
        ]);
        info
    }

    /// The children of a well-behaved reporting plugin, with `rule` as the Role's only
    /// rule and `binding` as the RoleBinding's roleRef and subjects.
    fn reporting(rule: Value, binding: Value) -> Vec<String> {
        let mut rb = json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": "w-agent"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "w-agent"},
            "subjects": [{"kind": "ServiceAccount", "name": "w-agent", "namespace": "ns1"}]});
        if let Value::Object(fields) = binding {
            for (k, v) in fields {
                rb[k] = v;
            }
        }
        vec![
            child(
                json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "w-report"}}),
            ),
            child(json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "w-secret"}})),
            child(
                json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "w-agent"}}),
            ),
            child(
                json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                "metadata": {"name": "w-agent"}, "rules": [rule]}),
            ),
            child(rb),
        ]
    }

    fn report_rule() -> Value {
        json!({"apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["w-report"],
               "verbs": ["get", "patch"]})
    }

    #[test]
    fn a_role_may_let_the_pods_patch_a_child_of_the_same_parent_by_name() {
        let out = children(
            &reporting_info(),
            &parent(),
            &reporting(report_rule(), json!({})),
            &Grant::default(),
        );
        assert!(out.is_ok(), "{out:?}");
    }

    #[test]
    fn a_plugin_that_tries_to_grant_more_is_refused_with_what_it_tried() {
        let rule = |patch: Value| {
            let mut r = report_rule();
            for (k, v) in patch.as_object().unwrap() {
                r[k] = v.clone();
            }
            r
        };
        let cases = [
            // Every ConfigMap of the namespace, not one by name.
            (
                rule(json!({"resourceNames": null})),
                json!({}),
                "no resourceNames",
            ),
            // A ConfigMap this parent does not have (another tenant's).
            (
                rule(json!({"resourceNames": ["kube-root-ca.crt"]})),
                json!({}),
                "resourceName \"kube-root-ca.crt\" is not a configmaps this parent desires",
            ),
            // Delete, create, list, escalate, a wildcard.
            (
                rule(json!({"verbs": ["get", "delete"]})),
                json!({}),
                "verb \"delete\"",
            ),
            (rule(json!({"verbs": ["list"]})), json!({}), "verb \"list\""),
            (rule(json!({"verbs": ["*"]})), json!({}), "verb \"*\""),
            (
                rule(json!({"verbs": ["escalate"]})),
                json!({}),
                "verb \"escalate\"",
            ),
            // Its own Secret is a child, but the wildcard group is not.
            (
                rule(
                    json!({"apiGroups": ["*"], "resources": ["secrets"], "resourceNames": ["w-secret"]}),
                ),
                json!({}),
                "\"secrets\" in group \"*\"",
            ),
            // Pods are no child of it.
            (
                rule(json!({"resources": ["pods"], "resourceNames": ["w-0"]})),
                json!({}),
                "\"pods\" in group \"\" is not a child kind",
            ),
            // Rights over RBAC objects, even its own.
            (
                rule(
                    json!({"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["roles"], "resourceNames": ["w-agent"]}),
                ),
                json!({}),
                "RBAC kinds never are grantable",
            ),
            // Subresources.
            (
                rule(json!({"resources": ["configmaps/status"]})),
                json!({}),
                "not a child kind",
            ),
            (
                rule(json!({"nonResourceURLs": ["/metrics"]})),
                json!({}),
                "nonResourceURLs",
            ),
            // Bindings: to a ClusterRole (cluster-admin), to a user, to another namespace's
            // service account, to an account it does not make.
            (
                report_rule(),
                json!({"roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"}}),
                "roleRef ClusterRole \"cluster-admin\"",
            ),
            (
                report_rule(),
                json!({"roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "admin"}}),
                "roleRef Role \"admin\"",
            ),
            (
                report_rule(),
                json!({"subjects": [{"kind": "User", "name": "alice"}]}),
                "subject User \"alice\"",
            ),
            (
                report_rule(),
                json!({"subjects": [{"kind": "ServiceAccount", "name": "w-agent", "namespace": "kube-system"}]}),
                "in its namespace",
            ),
            (
                report_rule(),
                json!({"subjects": [{"kind": "ServiceAccount", "name": "default"}]}),
                "subject ServiceAccount \"default\"",
            ),
        ];
        for (rule, binding, says) in cases {
            let err = children(
                &reporting_info(),
                &parent(),
                &reporting(rule.clone(), binding.clone()),
                &Grant::default(),
            )
            .expect_err(&format!("{rule} {binding} was accepted"));
            assert!(matches!(err, Violation::Rights { .. }), "{err}");
            assert!(err.to_string().contains(says), "{says:?} not in: {err}");
        }
        // A ClusterRole, even declared, is never a child one may hand out.
        let mut raw = reporting(report_rule(), json!({}));
        raw.push(child(
            json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": {"name": "w"}, "rules": []}),
        ));
        let err = children(&reporting_info(), &parent(), &raw, &Grant::default()).unwrap_err();
        assert!(err.to_string().contains("not a ClusterRole"), "{err}");
    }

    #[test]
    fn refuses_undeclared_kinds_naming_what_was_declared() {
        let raw = vec![child(
            json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}}),
        )];
        let err = children(&info(), &parent(), &raw, &Grant::default()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "child Secret.v1 \"s\" is of a kind the plugin did not declare (declared: ConfigMap.v1, StatefulSet.apps/v1)"
        );
    }

    #[test]
    fn refuses_other_namespaces_bad_names_foreign_owners_and_duplicates() {
        let cases = [
            (
                json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "a", "namespace": "kube-system"}}),
                "namespace \"kube-system\"",
            ),
            (
                json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "Bad_Name"}}),
                "invalid name",
            ),
            (
                json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "a", "ownerReferences": [{"kind": "Pod", "name": "p", "uid": "other"}]}}),
                "ownerReference to Pod p",
            ),
            (
                json!({"apiVersion": "v1", "kind": "ConfigMap"}),
                "metadata.name is required",
            ),
            (
                json!(["not", "an", "object"]),
                "apiVersion and kind are required",
            ),
        ];
        for (manifest, expected) in cases {
            let err = children(&info(), &parent(), &[child(manifest)], &Grant::default())
                .unwrap_err()
                .to_string();
            assert!(
                err.contains(expected),
                "{err:?} should contain {expected:?}"
            );
        }
        let twice =
            child(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "a"}}));
        let err = children(
            &info(),
            &parent(),
            &[twice.clone(), twice],
            &Grant::default(),
        )
        .unwrap_err();
        assert!(matches!(err, Violation::Duplicate { .. }));
        let err = children(
            &info(),
            &parent(),
            &["{not json".to_string()],
            &Grant::default(),
        )
        .unwrap_err();
        assert!(
            err.to_string().starts_with("child #0: not valid JSON"),
            "{err}"
        );
    }

    #[test]
    fn size_limits_are_enforced() {
        let big = child(
            json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "a"}, "data": {"x": "y".repeat(MAX_CHILD_BYTES)}}),
        );
        assert!(matches!(
            children(&info(), &parent(), &[big], &Grant::default()),
            Err(Violation::TooLarge { .. })
        ));
        let many = vec![child(json!({})); MAX_CHILDREN + 1];
        assert!(matches!(
            children(&info(), &parent(), &many, &Grant::default()),
            Err(Violation::TooLarge { .. })
        ));
    }

    #[test]
    fn status_must_be_an_object() {
        assert_eq!(status(None).unwrap(), None);
        assert!(status(Some(r#"{"state":"Ok"}"#)).unwrap().is_some());
        assert_eq!(
            status(Some("[1]")).unwrap_err().to_string(),
            "status must be a JSON object: got an array"
        );
    }

    #[test]
    fn names_and_reasons_follow_kubernetes_rules() {
        assert!(dns_subdomain("pg-0.example").is_ok());
        for bad in ["", "-a", "a-", "A", "a_b", &"a".repeat(254)] {
            let err = dns_subdomain(bad).unwrap_err();
            assert!(err.starts_with("must "), "{bad:?}: {err}");
        }
        assert!(is_reason("MajorVersionChange"));
        assert!(!is_reason("has space"));
        assert!(!is_reason("1Starts"));
    }

    #[test]
    fn plugin_info_is_checked() {
        assert!(plugin_info(&info()).is_ok());
        let mut bad = info();
        bad.name = "Not Valid".into();
        let err = plugin_info(&bad).unwrap_err().to_string();
        assert!(err.contains("\"Not Valid\" must be 1-63"), "{err}");
        let mut cluster_child = info();
        cluster_child.children[0].namespaced = false;
        assert!(
            plugin_info(&cluster_child)
                .unwrap_err()
                .to_string()
                .contains("cluster-scoped")
        );
        let mut cluster_parent = info();
        cluster_parent.parent.namespaced = false;
        let refused = plugin_info(&cluster_parent).unwrap_err().to_string();
        assert!(
            refused.contains("a cluster-scoped parent can only own cluster-scoped children"),
            "{refused}"
        );
        let mut crd = info();
        crd.crd = Some(r#"{"metadata":{"name":"other.example.com"}}"#.into());
        assert!(
            plugin_info(&crd)
                .unwrap_err()
                .to_string()
                .contains("widgets.test.capstan.dev")
        );
    }

    /// The widget plugin with every kind that runs Pods, ServiceAccounts and Secrets
    /// among its children.
    fn pods_info() -> PluginInfo {
        let mut info = info();
        info.children.extend([
            k("", "ServiceAccount", "serviceaccounts"),
            k("", "Secret", "secrets"),
            k("", "Pod", "pods"),
            k("apps", "Deployment", "deployments"),
            k("batch", "Job", "jobs"),
            k("batch", "CronJob", "cronjobs"),
        ]);
        info
    }

    /// A child of `kind` whose Pod spec is `spec`, beside the ServiceAccount `w-agent`.
    fn running(kind: &str, spec: Value) -> Vec<String> {
        let template = json!({"spec": spec});
        let (api_version, body) = match kind {
            "Pod" => ("v1", json!({"spec": spec})),
            "StatefulSet" | "Deployment" => ("apps/v1", json!({"spec": {"template": template}})),
            "Job" => ("batch/v1", json!({"spec": {"template": template}})),
            "CronJob" => (
                "batch/v1",
                json!({"spec": {"jobTemplate": {"spec": {"template": template}}}}),
            ),
            other => panic!("{other}"),
        };
        let mut object = body;
        object["apiVersion"] = json!(api_version);
        object["kind"] = json!(kind);
        object["metadata"] = json!({"name": "w"});
        vec![
            child(
                json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "w-agent"}}),
            ),
            child(object),
        ]
    }

    #[test]
    fn pods_run_as_the_answers_own_accounts_unprivileged() {
        let container = json!({"name": "app", "image": "app",
            "securityContext": {"allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}}});
        for kind in ["Pod", "StatefulSet", "Deployment", "Job", "CronJob"] {
            for account in [json!("w-agent"), json!("default"), Value::Null] {
                let spec =
                    json!({"serviceAccountName": account, "containers": [container.clone()]});
                children(
                    &pods_info(),
                    &parent(),
                    &running(kind, spec),
                    &Grant::default(),
                )
                .unwrap_or_else(|e| panic!("{kind} as {account}: {e}"));
            }
        }
    }

    #[test]
    fn a_pod_template_that_reaches_beyond_its_grant_is_refused() {
        let app =
            |security: Value| json!({"name": "app", "image": "app", "securityContext": security});
        // (what the hostile plugin tries, what the refusal says, the grant that allows it)
        let cases = [
            (
                json!({"serviceAccountName": "cluster-admin-sa", "containers": [app(json!({}))]}),
                "run as ServiceAccount \"cluster-admin-sa\"",
                "[pods]\nservice-accounts = [\"cluster-admin-sa\"]",
            ),
            (
                json!({"serviceAccount": "builder", "containers": [app(json!({}))]}),
                "ServiceAccount \"builder\"",
                "[pods]\nservice-accounts = [\"builder\"]",
            ),
            (
                json!({"containers": [app(json!({"privileged": true}))]}),
                "container \"app\" is privileged",
                "[pods]\nprivileged = true",
            ),
            (
                json!({"initContainers": [app(json!({"privileged": true}))], "containers": []}),
                "is privileged",
                "[pods]\nprivileged = true",
            ),
            (
                json!({"hostNetwork": true, "containers": [app(json!({}))]}),
                "hostNetwork: true",
                "[pods]\nhost-namespaces = true",
            ),
            (
                json!({"hostPID": true, "containers": [app(json!({}))]}),
                "hostPID: true",
                "[pods]\nhost-namespaces = true",
            ),
            (
                json!({"volumes": [{"name": "root", "hostPath": {"path": "/"}}], "containers": [app(json!({}))]}),
                "hostPath volume \"root\"",
                "[pods]\nhost-path = true",
            ),
            (
                json!({"containers": [app(json!({"capabilities": {"add": ["SYS_ADMIN"]}}))]}),
                "adds capability SYS_ADMIN",
                "[pods]\ncapabilities = [\"SYS_ADMIN\"]",
            ),
        ];
        for (spec, says, granted) in cases {
            for kind in ["Pod", "StatefulSet", "CronJob"] {
                let raw = running(kind, spec.clone());
                let err = children(&pods_info(), &parent(), &raw, &Grant::default())
                    .expect_err(&format!("{kind} {spec} is refused"));
                assert!(matches!(err, Violation::Pods { .. }), "{err}");
                let line = err.to_string();
                assert!(
                    line.contains(says) && line.contains("[grant.pods]"),
                    "{line}"
                );
                let grant: Grant = toml::from_str(granted).unwrap();
                children(&pods_info(), &parent(), &raw, &grant)
                    .unwrap_or_else(|e| panic!("{kind} {spec} under {granted:?}: {e}"));
            }
        }
    }

    #[test]
    fn a_service_account_token_secret_is_refused_unless_granted() {
        let raw = vec![child(json!({"apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": "token", "annotations": {"kubernetes.io/service-account.name": "admin"}},
            "type": "kubernetes.io/service-account-token"}))];
        let err = children(&pods_info(), &parent(), &raw, &Grant::default()).unwrap_err();
        assert!(
            matches!(err, Violation::Pods { .. }) && err.to_string().contains("mints a token"),
            "{err}"
        );
        let grant: Grant = toml::from_str("[pods]\nservice-account-tokens = true").unwrap();
        children(&pods_info(), &parent(), &raw, &grant).unwrap();
        // Any other Secret is the plugin's own business.
        let opaque = vec![child(json!({"apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": "password"}, "type": "Opaque"}))];
        children(&pods_info(), &parent(), &opaque, &Grant::default()).unwrap();
    }
}
