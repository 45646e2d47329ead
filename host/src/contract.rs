//! Plain Rust types of the plugin contract (`wit/capstan.wit`), as the rest of the host sees them.
//!
//! The generated bindings stay private to [`crate::plugin`]; these types carry no wasmtime
//! types and serialize the way `capstan inspect` and `capstan render` print them.

use serde::Serialize;

/// A Kubernetes resource kind a plugin declares (its parent, or a child kind).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct KindRef {
    /// API group, empty for the core group.
    pub group: String,
    /// Version within the group.
    pub version: String,
    /// CamelCase kind.
    pub kind: String,
    /// Lower-case plural used in URLs.
    pub plural: String,
    /// Whether the kind is namespaced.
    pub namespaced: bool,
}

impl KindRef {
    /// A namespaced kind (`group` empty: the core group).
    pub fn namespaced(group: &str, version: &str, kind: &str, plural: &str) -> Self {
        KindRef {
            group: group.into(),
            version: version.into(),
            kind: kind.into(),
            plural: plural.into(),
            namespaced: true,
        }
    }

    /// `apiVersion` as written in manifests: `v1` for the core group, else `group/version`.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.clone()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// Whether a manifest's `apiVersion` and `kind` name this kind.
    pub fn matches(&self, api_version: &str, kind: &str) -> bool {
        self.kind == kind && self.api_version() == api_version
    }
}

impl std::fmt::Display for KindRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.kind, self.api_version())
    }
}

/// What a plugin declares about itself (`describe`).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PluginInfo {
    /// Plugin name.
    pub name: String,
    /// The plugin's own version.
    pub version: String,
    /// The kind it reconciles.
    pub parent: KindRef,
    /// The kinds it may create.
    pub children: Vec<KindRef>,
    /// Whether it asks for a finalizer on each parent.
    pub finalizer: bool,
    /// Its resync period, if it sets one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resync_seconds: Option<u32>,
    /// The parent kind's CRD as JSON, if the plugin ships it.
    #[serde(skip)]
    pub crd: Option<String>,
    /// Kinds it reads but never writes (contract 0.2.0).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub related: Vec<KindRef>,
    /// Whether it validates its parents at admission time, and what the API server
    /// does when it cannot answer (contract 0.2.0).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub validation: Option<FailurePolicy>,
    /// Whether it converts its parents between the CRD's versions (contract 0.2.0).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub conversion: bool,
    /// The contract release the plugin was built for, such as `0.2.0`.
    pub contract: String,
}

/// What the API server does with a change when `validate` cannot answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum FailurePolicy {
    /// Refuse the change.
    Fail,
    /// Store it as if allowed.
    Ignore,
}

impl FailurePolicy {
    /// The string of `ValidatingWebhookConfiguration.webhooks[].failurePolicy`.
    pub fn as_str(self) -> &'static str {
        match self {
            FailurePolicy::Fail => "Fail",
            FailurePolicy::Ignore => "Ignore",
        }
    }
}

/// A related object as observed, tagged with the index of its kind in
/// [`PluginInfo::related`].
#[derive(Debug, Clone, PartialEq)]
pub struct RelatedObject {
    /// Index into [`PluginInfo::related`].
    pub kind_index: u32,
    /// The object as JSON.
    pub object: serde_json::Value,
}

/// Which objects of a related kind a parent needs.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Selector {
    /// The object of this name.
    Name(String),
    /// Every object of the namespace carrying all these labels (`matchLabels`).
    Labels(Vec<(String, String)>),
}

/// One answer of `customize`: objects of the related kind at `kind_index`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RelatedRequest {
    /// Index into [`PluginInfo::related`].
    pub kind_index: u32,
    /// Which of them.
    pub selector: Selector,
}

/// A child named for deletion in a teardown wave.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChildRef {
    /// Index into [`PluginInfo::children`].
    pub kind_index: u32,
    /// Its name.
    pub name: String,
}

/// A child object as observed, tagged with the index of its kind in [`PluginInfo::children`].
#[derive(Debug, Clone, PartialEq)]
pub struct ObservedChild {
    /// Index into [`PluginInfo::children`].
    pub kind_index: u32,
    /// The object as JSON.
    pub object: serde_json::Value,
}

/// The observed state handed to `reconcile` and `finalize`.
#[derive(Debug, Clone, PartialEq)]
pub struct Observed {
    /// The parent object.
    pub parent: serde_json::Value,
    /// The children the parent controls.
    pub children: Vec<ObservedChild>,
    /// The related objects `customize` asked for.
    pub related: Vec<RelatedObject>,
}

/// Status of a condition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum ConditionStatus {
    /// The condition holds.
    True,
    /// The condition does not hold.
    False,
    /// Not known.
    Unknown,
}

impl ConditionStatus {
    /// The string Kubernetes uses.
    pub fn as_str(self) -> &'static str {
        match self {
            ConditionStatus::True => "True",
            ConditionStatus::False => "False",
            ConditionStatus::Unknown => "Unknown",
        }
    }
}

/// A condition a plugin wants on its parent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Condition {
    /// Condition type.
    #[serde(rename = "type")]
    pub type_: String,
    /// Its status.
    pub status: ConditionStatus,
    /// CamelCase reason.
    pub reason: String,
    /// Human-readable message.
    pub message: String,
}

/// Normal or Warning.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum EventType {
    /// Something expected happened.
    Normal,
    /// Something went wrong.
    Warning,
}

impl EventType {
    /// The string Kubernetes uses.
    pub fn as_str(self) -> &'static str {
        match self {
            EventType::Normal => "Normal",
            EventType::Warning => "Warning",
        }
    }
}

/// An event to post on the parent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Event {
    /// Normal or Warning.
    #[serde(rename = "type")]
    pub type_: EventType,
    /// CamelCase reason.
    pub reason: String,
    /// Human-readable message.
    pub message: String,
}

/// What `reconcile` returned, parsed but not yet validated.
#[derive(Debug, Clone, PartialEq)]
pub struct Desired {
    /// Child manifests (raw JSON text, parsed during validation).
    pub children: Vec<String>,
    /// The plugin's status fields (raw JSON text).
    pub status: Option<String>,
    /// Extra conditions.
    pub conditions: Vec<Condition>,
    /// Events to post.
    pub events: Vec<Event>,
    /// Requeue delay in seconds.
    pub requeue_after_seconds: Option<u32>,
}

/// What `finalize` returned.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FinalizeResult {
    /// Cleanup is complete.
    pub done: bool,
    /// Events to post.
    pub events: Vec<Event>,
    /// When not done, retry after this many seconds.
    pub requeue_after_seconds: Option<u32>,
    /// A teardown wave: children to delete before `finalize` is called again.
    pub delete: Vec<ChildRef>,
}

/// A failure the plugin reported itself.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PluginError {
    /// The spec is invalid; retrying will not help until it changes.
    #[error("invalid spec: {0}")]
    Invalid(String),
    /// A transient failure; retry with backoff.
    #[error("transient failure: {0}")]
    Retry(String),
}
