//! What a plugin declares: its parent kind, child and related kinds, finalizer, resync,
//! CRD, admission validation and conversion.

use k8s_openapi::Resource;

use crate::bindings::capstan::plugin::types as wit;

/// A Kubernetes resource kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KindRef {
    /// API group, empty for the core group.
    pub group: String,
    /// Version within the group.
    pub version: String,
    /// CamelCase kind.
    pub kind: String,
    /// Lower-case plural, as in URLs.
    pub plural: String,
    /// Whether objects of the kind live in a namespace.
    pub namespaced: bool,
}

impl KindRef {
    /// A namespaced kind.
    pub fn namespaced(group: &str, version: &str, kind: &str, plural: &str) -> Self {
        KindRef {
            group: group.into(),
            version: version.into(),
            kind: kind.into(),
            plural: plural.into(),
            namespaced: true,
        }
    }

    /// The kind of a k8s-openapi type, such as `KindRef::of::<Secret>()`.
    pub fn of<K: Resource>() -> Self {
        KindRef {
            group: K::GROUP.into(),
            version: K::VERSION.into(),
            kind: K::KIND.into(),
            plural: K::URL_PATH_SEGMENT.into(),
            // The scope is a marker type; its name is the only thing to compare without
            // a 'static bound on every resource type.
            namespaced: std::any::type_name::<K::Scope>().ends_with("::NamespaceResourceScope"),
        }
    }

    /// `apiVersion` as written in manifests.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.clone()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    pub(crate) fn into_wit(self) -> wit::KindRef {
        wit::KindRef {
            group: self.group,
            version: self.version,
            kind: self.kind,
            plural: self.plural,
            namespaced: self.namespaced,
        }
    }
}

/// A plugin's declaration, built with small consuming setters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginInfo {
    /// Plugin name: lower-case letters, digits and `-`.
    pub name: String,
    /// The plugin's version.
    pub version: String,
    /// The kind it reconciles.
    pub parent: KindRef,
    /// The kinds it may create.
    pub children: Vec<KindRef>,
    /// Whether the host adds a finalizer and calls `finalize` on deletion.
    pub finalizer: bool,
    /// Resync period in seconds.
    pub resync_seconds: Option<u32>,
    /// The parent kind's CRD as JSON.
    pub crd: Option<String>,
    /// Kinds it reads but never writes; `customize` asks for objects of them.
    pub related: Vec<KindRef>,
    /// Whether `validate` runs at admission time, and what the API server does when it
    /// cannot answer.
    pub validation: Option<FailurePolicy>,
    /// Whether `convert` serves the CRD's conversion webhook.
    pub conversion: bool,
}

/// What the API server does with a change when `validate` cannot answer (it trapped,
/// ran out of time or memory, or no host serves the webhook).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailurePolicy {
    /// Refuse the change: nothing invalid gets in, but while no host answers, no parent
    /// of the kind can be created or changed.
    Fail,
    /// Store the change as if allowed; `reconcile` still sees it.
    Ignore,
}

impl PluginInfo {
    /// A plugin named `name` reconciling `parent`, with no children yet.
    pub fn new(name: &str, version: &str, parent: KindRef) -> Self {
        PluginInfo {
            name: name.into(),
            version: version.into(),
            parent,
            children: Vec::new(),
            finalizer: false,
            resync_seconds: None,
            crd: None,
            related: Vec::new(),
            validation: None,
            conversion: false,
        }
    }

    /// Declares a child kind.
    pub fn child(mut self, kind: KindRef) -> Self {
        self.children.push(kind);
        self
    }

    /// Declares a related kind: one the plugin reads (objects `customize` asks for)
    /// but never writes.
    pub fn related(mut self, kind: KindRef) -> Self {
        self.related.push(kind);
        self
    }

    /// Asks the host to call `validate` at admission time, with `policy` for when it
    /// cannot answer.
    pub fn validates(mut self, policy: FailurePolicy) -> Self {
        self.validation = Some(policy);
        self
    }

    /// Asks the host to serve the CRD's conversion webhook with `convert`.
    pub fn converts(mut self) -> Self {
        self.conversion = true;
        self
    }

    /// Asks for a finalizer: `finalize` runs before the parent goes away.
    pub fn with_finalizer(mut self) -> Self {
        self.finalizer = true;
        self
    }

    /// Sets the resync period.
    pub fn resync_every(mut self, seconds: u32) -> Self {
        self.resync_seconds = Some(seconds);
        self
    }

    /// Ships the parent kind's CRD, as JSON text. The shipped plugins keep their CRD as
    /// YAML under `crds/` and convert it to JSON in a build script, then
    /// `include_str!` the result, so the sandbox never parses YAML.
    pub fn crd_json(mut self, json: &str) -> Self {
        self.crd = Some(json.into());
        self
    }

    /// Index of a child kind in [`PluginInfo::children`], by `apiVersion` and `kind`.
    pub fn child_index(&self, api_version: &str, kind: &str) -> Option<usize> {
        self.children
            .iter()
            .position(|k| k.kind == kind && k.api_version() == api_version)
    }

    /// Index of a related kind in [`PluginInfo::related`], by `apiVersion` and `kind`.
    pub fn related_index(&self, api_version: &str, kind: &str) -> Option<usize> {
        self.related
            .iter()
            .position(|k| k.kind == kind && k.api_version() == api_version)
    }

    pub(crate) fn into_wit(self) -> wit::PluginInfo {
        wit::PluginInfo {
            name: self.name,
            version: self.version,
            parent: self.parent.into_wit(),
            children: self.children.into_iter().map(KindRef::into_wit).collect(),
            finalizer: self.finalizer,
            resync_seconds: self.resync_seconds,
            crd: self.crd,
            related: self.related.into_iter().map(KindRef::into_wit).collect(),
            validation: self.validation.map(|p| match p {
                FailurePolicy::Fail => wit::FailurePolicy::Fail,
                FailurePolicy::Ignore => wit::FailurePolicy::Ignore,
            }),
            conversion: self.conversion,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::apps::v1::StatefulSet;
    use k8s_openapi::api::core::v1::{Namespace, Secret};

    #[test]
    fn kinds_of_k8s_openapi_types() {
        let s = KindRef::of::<StatefulSet>();
        assert_eq!(
            (s.group.as_str(), s.plural.as_str(), s.namespaced),
            ("apps", "statefulsets", true)
        );
        assert_eq!(s.api_version(), "apps/v1");
        assert_eq!(KindRef::of::<Secret>().api_version(), "v1");
        assert!(!KindRef::of::<Namespace>().namespaced);
    }
}
