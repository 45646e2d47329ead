//! A declared kind as kube addresses it: a leaf that the caches, the writer and the
//! registry all use.

use kube::api::ApiResource;

use crate::contract::KindRef;

/// The `ApiResource` of a declared kind.
pub fn api_resource(kind: &KindRef) -> ApiResource {
    ApiResource {
        group: kind.group.clone(),
        version: kind.version.clone(),
        api_version: kind.api_version(),
        kind: kind.kind.clone(),
        plural: kind.plural.clone(),
    }
}
