//! What a reconcile sees: the parent, the children it controls and the related objects
//! `customize` asked for, with typed access.

use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::bindings::capstan::plugin::types as wit;
use crate::{Error, PluginInfo};

/// The observed state of one parent, as the host read it from the API server.
#[derive(Debug, Clone)]
pub struct Context {
    info: PluginInfo,
    parent: Value,
    /// (kind index, object) pairs.
    children: Vec<(usize, Value)>,
    /// (related kind index, object) pairs.
    related: Vec<(usize, Value)>,
}

impl Context {
    pub(crate) fn from_wit(info: PluginInfo, observed: wit::Observed) -> Result<Self, Error> {
        let parent = serde_json::from_str(&observed.parent)
            .map_err(|e| Error::retry(format!("host sent a parent that is not JSON: {e}")))?;
        let mut children = Vec::with_capacity(observed.children.len());
        for child in observed.children {
            let object = serde_json::from_str(&child.object)
                .map_err(|e| Error::retry(format!("host sent a child that is not JSON: {e}")))?;
            children.push((child.kind_index as usize, object));
        }
        let mut related = Vec::with_capacity(observed.related.len());
        for object in observed.related {
            let value = serde_json::from_str(&object.object).map_err(|e| {
                Error::retry(format!("host sent a related object that is not JSON: {e}"))
            })?;
            related.push((object.kind_index as usize, value));
        }
        Ok(Context {
            info,
            parent,
            children,
            related,
        })
    }

    /// The context `customize` sees: the parent alone.
    pub(crate) fn of_parent(info: PluginInfo, parent: &str) -> Result<Self, Error> {
        let parent = serde_json::from_str(parent)
            .map_err(|e| Error::retry(format!("host sent a parent that is not JSON: {e}")))?;
        Ok(Context::new(info, parent, Vec::new(), Vec::new()))
    }

    pub(crate) fn new(
        info: PluginInfo,
        parent: Value,
        children: Vec<(usize, Value)>,
        related: Vec<(usize, Value)>,
    ) -> Self {
        Context {
            info,
            parent,
            children,
            related,
        }
    }

    /// The parent object as JSON.
    pub fn parent(&self) -> &Value {
        &self.parent
    }

    /// The parent's name.
    pub fn name(&self) -> &str {
        self.str_at("/metadata/name")
    }

    /// The parent's namespace (empty for cluster-scoped parents).
    pub fn namespace(&self) -> &str {
        self.str_at("/metadata/namespace")
    }

    /// The parent's `metadata.generation`.
    pub fn generation(&self) -> i64 {
        self.parent
            .pointer("/metadata/generation")
            .and_then(Value::as_i64)
            .unwrap_or_default()
    }

    /// Whether the parent is being deleted.
    pub fn is_deleting(&self) -> bool {
        self.parent.pointer("/metadata/deletionTimestamp").is_some()
    }

    /// The parent's spec, deserialized. A spec that does not fit `T` is
    /// [`Error::Invalid`], with serde's explanation.
    pub fn spec<T: DeserializeOwned>(&self) -> Result<T, Error> {
        let spec = self
            .parent
            .get("spec")
            .cloned()
            .unwrap_or(Value::Object(Default::default()));
        serde_json::from_value(spec).map_err(|e| Error::invalid(format!("spec: {e}")))
    }

    /// The parent's current status, deserialized; `None` when there is none yet or it
    /// does not fit `T` (a status is the plugin's own output, so it is re-derived).
    pub fn status<T: DeserializeOwned>(&self) -> Option<T> {
        let status = self.parent.get("status")?;
        serde_json::from_value(status.clone()).ok()
    }

    /// Observed children of a k8s-openapi type, such as `ctx.children::<Secret>()`.
    /// Objects that do not deserialize into `K` are skipped.
    pub fn children<K: k8s_openapi::Resource + DeserializeOwned>(&self) -> Vec<K> {
        self.raw_children(K::API_VERSION, K::KIND)
            .filter_map(|v| serde_json::from_value(v.clone()).ok())
            .collect()
    }

    /// The observed child of type `K` named `name`, if any.
    pub fn child<K: k8s_openapi::Resource + DeserializeOwned>(&self, name: &str) -> Option<K> {
        self.raw_children(K::API_VERSION, K::KIND)
            .find(|v| v.pointer("/metadata/name").and_then(Value::as_str) == Some(name))
            .and_then(|v| serde_json::from_value(v.clone()).ok())
    }

    /// Observed children of any declared kind, as JSON, by `apiVersion` and `kind`.
    pub fn raw_children<'a>(
        &'a self,
        api_version: &str,
        kind: &str,
    ) -> impl Iterator<Item = &'a Value> + 'a {
        let index = self.info.child_index(api_version, kind);
        self.children
            .iter()
            .filter(move |(i, _)| Some(*i) == index)
            .map(|(_, v)| v)
    }

    /// Related objects of a k8s-openapi type that `customize` asked for and that exist,
    /// such as `ctx.related::<ConfigMap>()`. Objects that do not deserialize into `K`
    /// are skipped. Empty in `customize` itself.
    pub fn related<K: k8s_openapi::Resource + DeserializeOwned>(&self) -> Vec<K> {
        self.raw_related(K::API_VERSION, K::KIND)
            .filter_map(|v| serde_json::from_value(v.clone()).ok())
            .collect()
    }

    /// The related object of type `K` named `name`, if `customize` asked for it and it
    /// exists.
    pub fn related_named<K: k8s_openapi::Resource + DeserializeOwned>(
        &self,
        name: &str,
    ) -> Option<K> {
        self.raw_related(K::API_VERSION, K::KIND)
            .find(|v| v.pointer("/metadata/name").and_then(Value::as_str) == Some(name))
            .and_then(|v| serde_json::from_value(v.clone()).ok())
    }

    /// Related objects of any declared related kind, as JSON, by `apiVersion` and `kind`.
    pub fn raw_related<'a>(
        &'a self,
        api_version: &str,
        kind: &str,
    ) -> impl Iterator<Item = &'a Value> + 'a {
        let index = self.info.related_index(api_version, kind);
        self.related
            .iter()
            .filter(move |(i, _)| Some(*i) == index)
            .map(|(_, v)| v)
    }

    /// What the plugin declared.
    pub fn info(&self) -> &PluginInfo {
        &self.info
    }

    fn str_at(&self, pointer: &str) -> &str {
        self.parent
            .pointer(pointer)
            .and_then(Value::as_str)
            .unwrap_or_default()
    }
}
