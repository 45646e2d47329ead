//! Parents as the parent caches keep them: metadata typed (the controller keys, filters
//! and schedules by it), everything else as compact JSON text, parsed only when the
//! parent is reconciled.
//!
//! A `DynamicObject` keeps the rest as a `serde_json::Value` tree: a B-tree node of
//! about 600 bytes for every object in it, however small. A converged Uuid took 2.7 KiB
//! that way and takes 1.4 KiB as text; with 5000 of them that is the difference between
//! meeting the memory goal and missing it. The kind is shared too: every reference to a
//! parent (in the controller's queue and schedule, one per parent) clones its kind,
//! which for `DynamicObject` is five strings and here is one reference count.

use std::borrow::Cow;
use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Resource;
use kube::api::{ApiResource, DynamicObject, TypeMeta};
use kube::core::DynamicResourceScope;
use serde::{Deserialize, Deserializer};

/// The kind of a parent, shared by every reference to one.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ParentKind(Arc<ApiResource>);

impl ParentKind {
    /// The kind of `ar`.
    pub fn new(ar: ApiResource) -> Self {
        ParentKind(Arc::new(ar))
    }
}

/// A cached parent (see the module).
#[derive(Debug, Clone)]
pub struct CachedParent {
    metadata: ObjectMeta,
    /// Every field but `apiVersion`, `kind` and `metadata`, as a JSON object.
    rest: Box<str>,
}

impl CachedParent {
    /// `obj` without its managedFields (a plugin never sees them).
    pub fn new(mut obj: DynamicObject) -> Self {
        obj.metadata.managed_fields = None;
        let rest = serde_json::to_string(&obj.data)
            .expect("a JSON value always serializes")
            .into_boxed_str();
        CachedParent {
            metadata: obj.metadata,
            rest,
        }
    }

    /// The parent as a plugin and the writes see it, of kind `kind`.
    pub fn to_dynamic(&self, kind: &ParentKind) -> DynamicObject {
        DynamicObject {
            types: Some(TypeMeta {
                api_version: kind.0.api_version.clone(),
                kind: kind.0.kind.clone(),
            }),
            metadata: self.metadata.clone(),
            data: serde_json::from_str(&self.rest).expect("the text was written from a value"),
        }
    }
}

impl<'de> Deserialize<'de> for CachedParent {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        DynamicObject::deserialize(deserializer).map(CachedParent::new)
    }
}

impl Resource for CachedParent {
    type DynamicType = ParentKind;
    type Scope = DynamicResourceScope;

    fn kind(dt: &ParentKind) -> Cow<'_, str> {
        dt.0.kind.as_str().into()
    }

    fn group(dt: &ParentKind) -> Cow<'_, str> {
        dt.0.group.as_str().into()
    }

    fn version(dt: &ParentKind) -> Cow<'_, str> {
        dt.0.version.as_str().into()
    }

    fn api_version(dt: &ParentKind) -> Cow<'_, str> {
        dt.0.api_version.as_str().into()
    }

    fn plural(dt: &ParentKind) -> Cow<'_, str> {
        dt.0.plural.as_str().into()
    }

    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn kind() -> ParentKind {
        ParentKind::new(ApiResource {
            group: "demo.operator".into(),
            version: "v1".into(),
            api_version: "demo.operator/v1".into(),
            kind: "Uuid".into(),
            plural: "uuids".into(),
        })
    }

    #[test]
    fn a_cached_parent_gives_back_the_object_without_its_managed_fields() {
        let watched = json!({
            "apiVersion": "demo.operator/v1", "kind": "Uuid",
            "metadata": {"name": "u", "namespace": "ns", "uid": "1", "resourceVersion": "7",
                "generation": 2, "labels": {"a": "b"},
                "managedFields": [{"manager": "kubectl", "operation": "Update"}]},
            "spec": {"size": 3, "nested": {"list": [1, "two", null]}},
            "status": {"uuid": "x", "conditions": [{"type": "Ready", "status": "True"}]},
        });
        let cached: CachedParent = serde_json::from_value(watched.clone()).unwrap();
        assert_eq!(cached.meta().resource_version.as_deref(), Some("7"));
        let back = serde_json::to_value(cached.to_dynamic(&kind())).unwrap();
        let mut want = watched;
        want["metadata"]
            .as_object_mut()
            .unwrap()
            .remove("managedFields");
        assert_eq!(back, want);
    }

    #[test]
    fn references_to_a_parent_share_its_kind() {
        let kind = kind();
        let r = kube::runtime::reflector::ObjectRef::<CachedParent>::new_with("u", kind.clone());
        assert!(Arc::ptr_eq(&r.dyntype.0, &kind.0));
        assert_eq!(
            CachedParent::url_path(&kind, Some("ns")),
            "/apis/demo.operator/v1/namespaces/ns/uuids"
        );
    }
}
