//! What `customize` answers: which related objects one parent needs.

use crate::bindings::capstan::plugin::types as wit;
use crate::{Error, KindRef, PluginInfo};

/// A request for related objects of one declared related kind: by name, or by labels
/// in the parent's namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Related {
    api_version: String,
    kind: String,
    selector: Selector,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Selector {
    Name(String),
    Labels(Vec<(String, String)>),
}

impl Related {
    /// The object of type `K` named `name` (in the parent's namespace when `K` is
    /// namespaced), such as `Related::named::<ConfigMap>(&spec.config)`.
    pub fn named<K: k8s_openapi::Resource>(name: &str) -> Self {
        Related {
            api_version: K::API_VERSION.into(),
            kind: K::KIND.into(),
            selector: Selector::Name(name.into()),
        }
    }

    /// Every object of type `K` in the parent's namespace that carries all of `labels`
    /// (Kubernetes' `matchLabels`), such as the Pods of a StatefulSet.
    pub fn labelled<K: k8s_openapi::Resource>(
        labels: impl IntoIterator<Item = (impl Into<String>, impl Into<String>)>,
    ) -> Self {
        Related {
            api_version: K::API_VERSION.into(),
            kind: K::KIND.into(),
            selector: Selector::Labels(
                labels
                    .into_iter()
                    .map(|(k, v)| (k.into(), v.into()))
                    .collect(),
            ),
        }
    }

    /// [`Related::named`] for a kind without a k8s-openapi type (a custom resource).
    pub fn named_kind(kind: &KindRef, name: &str) -> Self {
        Related {
            api_version: kind.api_version(),
            kind: kind.kind.clone(),
            selector: Selector::Name(name.into()),
        }
    }

    pub(crate) fn into_wit(self, info: &PluginInfo) -> Result<wit::RelatedRequest, Error> {
        let index = info
            .related_index(&self.api_version, &self.kind)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "customize asks for {} ({}), which the plugin does not declare as related",
                    self.kind, self.api_version
                ))
            })?;
        Ok(wit::RelatedRequest {
            kind_index: index as u32,
            selector: match self.selector {
                Selector::Name(name) => wit::Selector::Name(name),
                Selector::Labels(labels) => wit::Selector::Labels(labels),
            },
        })
    }
}
