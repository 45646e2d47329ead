//! Observe: a parent's world, as one call of a plugin is given it. The sources differ
//! (the operator's caches, files for `capstan render` and `capstan test`, a LIST for
//! `capstan plan --live`); what the plugin sees of the related objects is selected here
//! for all of them, so that no front door can select otherwise than `capstan run`.

use serde_json::Value;

use crate::contract::{KindRef, Observed, PluginError, RelatedObject, RelatedRequest, Selector};
use crate::plugin::{CallError, Pinned, Plugin};
use crate::validate::{self, Violation};

/// What one decision is made on: the observed state, the instant (RFC 3339) the host
/// stamps on what it writes (conditions' transition times) and, when pinned, the clock
/// and random bytes the plugin reads: a pinned world decides the same plan every time.
#[derive(Debug, Clone, PartialEq)]
pub struct World {
    /// The parent, its children and the related objects selected for it.
    pub observed: Observed,
    /// The clock of the decision.
    pub now: String,
    /// The plugin's clock and random, if pinned; else it reads the host's.
    pub pinned: Option<Pinned>,
}

impl World {
    /// The world of `observed` at `now`; the plugin reads the host's clock and random.
    pub fn new(observed: Observed, now: impl Into<String>) -> Self {
        World {
            observed,
            now: now.into(),
            pinned: None,
        }
    }

    /// The world of `observed` now, by the host's clock.
    pub fn at_present(observed: Observed) -> Self {
        World::new(observed, crate::plan::now())
    }

    /// The world of `observed` with the clock and random of every call `pinned`, the
    /// host's stamps at the same instant.
    pub fn pinned(observed: Observed, pinned: Pinned) -> Self {
        let now = k8s_openapi::jiff::Timestamp::from_second(pinned.at)
            .map(|t| t.strftime("%Y-%m-%dT%H:%M:%SZ").to_string())
            .unwrap_or_else(|_| crate::plan::now());
        World {
            observed,
            now,
            pinned: Some(pinned),
        }
    }
}

/// Why a parent's world could not be observed.
#[derive(Debug, thiserror::Error)]
pub enum ObserveError {
    /// `customize` could not be called to the end (deadline, memory cap, trap).
    #[error(transparent)]
    Call(#[from] CallError),
    /// `customize` answered with an error.
    #[error("customize failed: {0}")]
    Customize(PluginError),
    /// `customize` asked for what a plugin may not, or selected too much.
    #[error("plugin output refused: {0}")]
    Refused(#[from] Violation),
    /// The source could not give what it holds (an object that does not serialize).
    #[error("{0}")]
    Source(String),
}

/// Where the objects of a plugin's related kinds are looked up.
pub trait RelatedSource {
    /// The objects of related kind `kind` (at `index` in the plugin's declaration) that
    /// any of `selectors` selects for `parent`. `selectors` may be empty: the parent
    /// asks for nothing of that kind now (a source that remembers requests forgets its
    /// earlier ones).
    fn select(
        &self,
        index: usize,
        kind: &KindRef,
        parent: &Value,
        selectors: &[Selector],
    ) -> Result<Vec<Value>, ObserveError>;
}

/// Objects read from files or listed from the API server: selected as the operator's
/// caches select them ([`Selector::selects`]).
impl RelatedSource for [RelatedObject] {
    fn select(
        &self,
        index: usize,
        kind: &KindRef,
        parent: &Value,
        selectors: &[Selector],
    ) -> Result<Vec<Value>, ObserveError> {
        let namespace = kind
            .namespaced
            .then(|| {
                parent
                    .pointer("/metadata/namespace")
                    .and_then(Value::as_str)
            })
            .flatten();
        Ok(self
            .iter()
            .filter(|o| o.kind_index as usize == index)
            .filter(|o| selectors.iter().any(|s| s.selects(&o.object, namespace)))
            .map(|o| o.object.clone())
            .collect())
    }
}

/// What `customize` asked for one parent, and what it selected.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Selected {
    /// The requests, as `customize` answered them (checked).
    pub requests: Vec<RelatedRequest>,
    /// The objects they select, in the order of the plugin's related kinds.
    pub objects: Vec<RelatedObject>,
}

/// Calls `customize` for `parent` and selects from `source` what it asks for: in the
/// parent's namespace (for a namespaced kind), by name or by labels, at most
/// [`validate::MAX_RELATED_OBJECTS`] objects, and only those its grant lets it read
/// ([`crate::grant::Grant::related_labels`]). A plugin that declares no related kind is
/// not called and sees none. `pinned`: the call's clock and random, as the world's.
pub async fn related<S: RelatedSource + ?Sized>(
    plugin: &Plugin,
    parent: &Value,
    source: &S,
    pinned: Option<Pinned>,
) -> Result<Selected, ObserveError> {
    let info = plugin.info();
    if info.related.is_empty() {
        return Ok(Selected::default());
    }
    let requests = plugin
        .customize_pinned(parent, pinned)
        .await?
        .map_err(ObserveError::Customize)?;
    validate::related_requests(info, &requests)?;
    let grant = plugin.limits_file().grant.unwrap_or_default();
    let mut objects = Vec::new();
    for (index, kind) in info.related.iter().enumerate() {
        let selectors: Vec<Selector> = requests
            .iter()
            .filter(|r| r.kind_index as usize == index)
            .map(|r| r.selector.clone())
            .collect();
        let mut selected = source.select(index, kind, parent, &selectors)?;
        // What the administrator granted bounds what the plugin's selectors reach
        // (Secrets only with the grant's labels).
        if let Some(labels) = grant.related_labels(kind) {
            selected.retain(|object| {
                labels.iter().all(|(key, value)| {
                    object
                        .pointer("/metadata/labels")
                        .and_then(|l| l.get(key))
                        .and_then(Value::as_str)
                        == Some(value.as_str())
                })
            });
        }
        // In one order whatever the source: a cache answers selector by selector, a
        // file in its own order.
        selected.sort_by_cached_key(|o| {
            let field = |p: &str| o.pointer(p).and_then(Value::as_str).map(String::from);
            (field("/metadata/namespace"), field("/metadata/name"))
        });
        for object in selected {
            if objects.len() == validate::MAX_RELATED_OBJECTS {
                return Err(Violation::TooLarge {
                    what: "the related objects customize selected".into(),
                    size: objects.len() + 1,
                    limit: validate::MAX_RELATED_OBJECTS,
                }
                .into());
            }
            objects.push(RelatedObject {
                kind_index: index as u32,
                object,
            });
        }
    }
    Ok(Selected { requests, objects })
}

impl Selector {
    /// Whether this selects `object` for a parent in `namespace` (none: the kind is
    /// cluster-scoped): the one rule every source selects by.
    pub fn selects(&self, object: &Value, namespace: Option<&str>) -> bool {
        if object
            .pointer("/metadata/namespace")
            .and_then(Value::as_str)
            != namespace
        {
            return false;
        }
        match self {
            Selector::Name(name) => {
                object.pointer("/metadata/name").and_then(Value::as_str) == Some(name)
            }
            Selector::Labels(labels) => labels.iter().all(|(k, v)| {
                object
                    .pointer("/metadata/labels")
                    .and_then(|l| l.get(k))
                    .and_then(Value::as_str)
                    == Some(v)
            }),
        }
    }
}
