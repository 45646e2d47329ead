//! `capstan render`: one reconcile offline, through the same code as `capstan run` up to
//! the apply. For plugin authors and tests.

use std::path::Path;

use serde::Serialize;
use serde_json::{Value, json};

use crate::contract::{
    Observed, ObservedChild, PluginError, PluginInfo, RelatedObject, RelatedRequest,
};
use crate::engine::{self, DecideError, ObserveError, World};
use crate::plan::Plan;
use crate::plugin::{CallError, Pinned, Plugin};
use crate::validate::Violation;

/// Why a render did not produce a plan.
#[derive(Debug, thiserror::Error)]
pub enum RenderError {
    /// An input file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// An input file is not valid YAML, or not the objects expected.
    #[error("{path}: {reason}")]
    Input {
        /// The file.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// The plugin could not be called to the end.
    #[error(transparent)]
    Call(#[from] CallError),
    /// The plugin reported an error.
    #[error("reconcile failed: {0}")]
    Plugin(PluginError),
    /// `customize` reported an error.
    #[error("customize failed: {0}")]
    Customize(PluginError),
    /// The plugin's output was refused.
    #[error("plugin output refused: {0}")]
    Violation(#[from] Violation),
}

impl From<ObserveError> for RenderError {
    fn from(e: ObserveError) -> Self {
        match e {
            ObserveError::Call(e) => RenderError::Call(e),
            ObserveError::Customize(e) => RenderError::Customize(e),
            ObserveError::Refused(v) => RenderError::Violation(v),
            ObserveError::Source(reason) => RenderError::Input {
                path: "related objects".into(),
                reason,
            },
        }
    }
}

impl From<DecideError> for RenderError {
    fn from(e: DecideError) -> Self {
        match e {
            DecideError::Call(e) => RenderError::Call(e),
            DecideError::Plugin(e) => RenderError::Plugin(e),
            DecideError::Refused(v) => RenderError::Violation(v),
        }
    }
}

/// What `capstan render` prints.
#[derive(Debug, Serialize)]
pub struct Rendered {
    /// The plan, as `capstan run` would apply it.
    #[serde(flatten)]
    pub plan: Plan,
}

/// Reads the related objects that exist (YAML) for `capstan render --related`: each of
/// a declared related kind. Which of them the plugin sees is what `customize` asks for.
pub fn read_related(info: &PluginInfo, path: &Path) -> Result<Vec<RelatedObject>, RenderError> {
    let mut out = Vec::new();
    for mut object in read_objects(path)? {
        let index = declared(info, &info.related, "related", &object, path)?;
        if info.related[index].namespaced
            && let Some(meta) = object.get_mut("metadata").and_then(Value::as_object_mut)
        {
            meta.entry("namespace").or_insert_with(|| json!("default"));
        }
        out.push(RelatedObject {
            kind_index: index as u32,
            object,
        });
    }
    Ok(out)
}

/// Calls `customize` for the parent of `observed` and fills `observed.related` with the
/// objects of `existing` its requests select, as `capstan run` does from its caches
/// (the one selection of [`engine::observe`]). Returns the requests.
pub fn customize(
    plugin: &Plugin,
    observed: &mut Observed,
    existing: &[RelatedObject],
) -> Result<Vec<RelatedRequest>, RenderError> {
    customize_pinned(plugin, observed, existing, None)
}

/// [`customize`] with the call's clock and random `pinned`.
pub fn customize_pinned(
    plugin: &Plugin,
    observed: &mut Observed,
    existing: &[RelatedObject],
    pinned: Option<Pinned>,
) -> Result<Vec<RelatedRequest>, RenderError> {
    let selected = engine::blocking(engine::observe::related(
        &plugin.on_this_thread(),
        &observed.parent,
        existing,
        pinned,
    ))?;
    observed.related = selected.objects;
    Ok(selected.requests)
}

/// Reads the parent and the observed children from YAML files. A parent written in
/// another version of the plugin's kind (the same group and kind) is converted by the
/// plugin's `convert`, when it converts, as the API server would before a watch event
/// reaches the host.
pub fn read_observed(
    plugin: &Plugin,
    parent_path: &Path,
    observed_path: Option<&Path>,
) -> Result<Observed, RenderError> {
    let parent = read_one(parent_path)?;
    let name = parent_path.display().to_string();
    let children = match observed_path {
        Some(path) => read_objects(path)?,
        None => Vec::new(),
    };
    let mut observed = observed_for(plugin, parent, &name, Vec::new())?;
    if let Some(path) = observed_path {
        observed.children = observed_children(plugin.info(), children, path)?;
    }
    Ok(observed)
}

/// The observed state of `parent` (read from `source`) with `children` (objects of its
/// declared child kinds), as [`read_observed`] makes it.
pub fn observed_for(
    plugin: &Plugin,
    mut parent: Value,
    source: &str,
    children: Vec<Value>,
) -> Result<Observed, RenderError> {
    let info = plugin.info();
    let (api_version, kind) = type_of(&parent);
    let same_group =
        api_version.rsplit_once('/').map(|(group, _)| group) == Some(&info.parent.group);
    if info.conversion && kind == info.parent.kind && same_group {
        parent = crate::convert::convert(plugin, parent, &info.parent.version).map_err(|e| {
            RenderError::Input {
                path: source.to_string(),
                reason: format!("cannot convert it to {}: {e}", info.parent.api_version()),
            }
        })?;
    }
    let (api_version, kind) = type_of(&parent);
    if !info.parent.matches(&api_version, &kind) {
        return Err(RenderError::Input {
            path: source.to_string(),
            reason: format!(
                "is a {kind}.{api_version}, but plugin {} reconciles {}",
                info.name, info.parent
            ),
        });
    }
    fill_server_fields(&mut parent);
    let children = observed_children(info, children, Path::new(source))?;
    Ok(Observed {
        parent,
        children,
        related: Vec::new(),
    })
}

fn observed_children(
    info: &PluginInfo,
    objects: Vec<Value>,
    path: &Path,
) -> Result<Vec<ObservedChild>, RenderError> {
    let mut children = Vec::new();
    for object in objects {
        let index = declared(info, &info.children, "child", &object, path)?;
        children.push(ObservedChild {
            kind_index: index as u32,
            object,
        });
    }
    Ok(children)
}

/// The index of `object`'s kind among `kinds` (the plugin's declared `what` kinds), or
/// an input error naming `path`.
fn declared(
    info: &PluginInfo,
    kinds: &[crate::contract::KindRef],
    what: &str,
    object: &Value,
    path: &Path,
) -> Result<usize, RenderError> {
    let (api_version, kind) = type_of(object);
    kinds
        .iter()
        .position(|k| k.matches(&api_version, &kind))
        .ok_or_else(|| RenderError::Input {
            path: path.display().to_string(),
            reason: format!(
                "{kind}.{api_version} is not a {what} kind of plugin {}",
                info.name
            ),
        })
}

/// Whether `child`'s controller ownerReference names `parent` (its kind and name, in
/// its namespace): how objects read from one file are matched to parents.
pub fn controlled_by(child: &Value, parent: &Value) -> bool {
    let field = |o: &Value, p: &str| o.pointer(p).and_then(Value::as_str).map(String::from);
    let namespace = |o: &Value| field(o, "/metadata/namespace").unwrap_or_else(|| "default".into());
    let controller = child
        .pointer("/metadata/ownerReferences")
        .and_then(Value::as_array)
        .and_then(|refs| {
            refs.iter()
                .find(|r| r.get("controller").and_then(Value::as_bool) == Some(true))
        });
    controller.is_some_and(|r| {
        field(r, "/kind") == field(parent, "/kind")
            && field(r, "/name") == field(parent, "/metadata/name")
            && namespace(child) == namespace(parent)
    })
}

/// Calls the plugin and plans the result, as `capstan run` does before applying: the
/// engine's [`decide`](engine::decide()), at the clock `now`. It blocks the calling thread
/// for the call: meant for the command line and tests, not for async tasks.
pub fn render(plugin: &Plugin, observed: &Observed, now: &str) -> Result<Rendered, RenderError> {
    render_world(plugin, &World::new(observed.clone(), now))
}

/// [`render`] of a whole [`World`], its clock and random pinned if it pins them.
pub fn render_world(plugin: &Plugin, world: &World) -> Result<Rendered, RenderError> {
    let plan = engine::blocking(engine::decide(&plugin.on_this_thread(), world))?;
    Ok(Rendered { plan })
}

/// The UID a parent read from a file gets when it has none.
pub const SAMPLE_UID: &str = "00000000-0000-0000-0000-000000000000";

/// A parent read from a file lacks what the API server would set; fill in stand-ins so
/// that rendering works on a sample manifest.
fn fill_server_fields(parent: &mut Value) {
    let Some(obj) = parent.as_object_mut() else {
        return;
    };
    let meta = obj.entry("metadata").or_insert_with(|| json!({}));
    if let Some(meta) = meta.as_object_mut() {
        meta.entry("namespace").or_insert_with(|| json!("default"));
        meta.entry("uid").or_insert_with(|| json!(SAMPLE_UID));
        meta.entry("generation").or_insert_with(|| json!(1));
    }
}

fn type_of(object: &Value) -> (String, String) {
    let field = |k: &str| {
        object
            .get(k)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string()
    };
    (field("apiVersion"), field("kind"))
}

/// Reads every YAML document of a file; a `List` contributes its items.
pub fn read_objects(path: &Path) -> Result<Vec<Value>, RenderError> {
    let name = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| RenderError::Read {
        path: name.clone(),
        source,
    })?;
    parse_objects(&text).map_err(|reason| RenderError::Input { path: name, reason })
}

/// Reads a file that must hold exactly one object.
pub fn read_one(path: &Path) -> Result<Value, RenderError> {
    let mut objects = read_objects(path)?;
    if objects.len() != 1 {
        return Err(RenderError::Input {
            path: path.display().to_string(),
            reason: format!("expected exactly one object, found {}", objects.len()),
        });
    }
    Ok(objects.remove(0))
}

/// Parses a multi-document YAML text into JSON objects.
pub fn parse_objects(text: &str) -> Result<Vec<Value>, String> {
    let mut out = Vec::new();
    for doc in serde_yaml_ng::Deserializer::from_str(text) {
        let value: Value =
            serde::Deserialize::deserialize(doc).map_err(|e| format!("invalid YAML: {e}"))?;
        match value {
            Value::Null => continue,
            Value::Object(ref o) if o.get("kind").and_then(Value::as_str) == Some("List") => {
                let items = o
                    .get("items")
                    .and_then(Value::as_array)
                    .cloned()
                    .unwrap_or_default();
                out.extend(items);
            }
            Value::Object(_) => out.push(value),
            other => return Err(format!("expected Kubernetes objects, found {other}")),
        }
    }
    for o in &out {
        if o.get("apiVersion").and_then(Value::as_str).is_none()
            || o.get("kind").and_then(Value::as_str).is_none()
        {
            return Err("every object needs apiVersion and kind".into());
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_documents_and_lists() {
        let objs = parse_objects(
            "apiVersion: v1\nkind: ConfigMap\n---\n---\napiVersion: v1\nkind: List\nitems:\n- {apiVersion: v1, kind: Secret}\n",
        )
        .unwrap();
        assert_eq!(objs.len(), 2);
        assert_eq!(objs[1]["kind"], "Secret");
    }

    #[test]
    fn malformed_yaml_is_one_clear_error() {
        let err = parse_objects("kind: [unclosed").unwrap_err();
        assert!(err.starts_with("invalid YAML:"), "{err}");
        assert!(!err.contains('\n'), "{err}");
        assert_eq!(
            parse_objects("- 1\n- 2").unwrap_err(),
            "expected Kubernetes objects, found [1,2]"
        );
        assert_eq!(
            parse_objects("metadata: {}").unwrap_err(),
            "every object needs apiVersion and kind"
        );
    }
}
