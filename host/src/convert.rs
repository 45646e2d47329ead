//! Converting a parent between the versions of its CRD with the plugin's `convert`, and
//! checking the answer the way the API server would, before anything relies on it.

use serde_json::Value;

use crate::contract::PluginInfo;
use crate::plugin::{CallError, Plugin};

/// Why an object was not converted.
#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    /// The plugin could not be called to the end.
    #[error(transparent)]
    Call(#[from] CallError),
    /// The plugin refused, with its reason.
    #[error("plugin {plugin} refused the conversion: {reason}")]
    Refused {
        /// The plugin.
        plugin: String,
        /// Its message.
        reason: String,
    },
    /// The plugin's answer is not a valid conversion.
    #[error("plugin {plugin} returned an invalid conversion: {reason}")]
    Invalid {
        /// The plugin.
        plugin: String,
        /// What is wrong.
        reason: String,
    },
}

/// The `apiVersion` `to` names for the plugin's parent group: `to` itself when it has a
/// group (`db.example.com/v1`), else `group/to`.
pub fn target_api_version(info: &PluginInfo, to: &str) -> String {
    if to.contains('/') || info.parent.group.is_empty() {
        to.to_string()
    } else {
        format!("{}/{to}", info.parent.group)
    }
}

/// Checks a converted object as the API server does: a JSON object of the asked
/// `apiVersion`, of the same kind, with the same name, namespace and UID (a conversion
/// may change labels and annotations, nothing else of the metadata).
pub fn check(original: &Value, converted: &str, api_version: &str) -> Result<Value, String> {
    let converted: Value = serde_json::from_str(converted).map_err(|e| format!("not JSON: {e}"))?;
    if !converted.is_object() {
        return Err("not a JSON object".into());
    }
    let field = |v: &Value, p: &str| v.pointer(p).cloned().unwrap_or(Value::Null);
    if converted.get("apiVersion").and_then(Value::as_str) != Some(api_version) {
        return Err(format!(
            "apiVersion is {}, not {api_version}",
            field(&converted, "/apiVersion")
        ));
    }
    for pointer in [
        "/kind",
        "/metadata/name",
        "/metadata/namespace",
        "/metadata/uid",
    ] {
        if field(&converted, pointer) != field(original, pointer) {
            return Err(format!(
                "{pointer} changed from {} to {}",
                field(original, pointer),
                field(&converted, pointer)
            ));
        }
    }
    Ok(converted)
}

/// Converts `object` to `to` with `plugin`, checked; an object already at that version
/// comes back as it is, without a call. Blocks the calling thread for the call.
pub fn convert(plugin: &Plugin, object: Value, to: &str) -> Result<Value, ConvertError> {
    let api_version = target_api_version(plugin.info(), to);
    if object.get("apiVersion").and_then(Value::as_str) == Some(api_version.as_str()) {
        return Ok(object);
    }
    let answer = plugin.convert_blocking(&object, version_of(&api_version))?;
    finish(plugin, &object, answer, &api_version)
}

/// [`convert`] for async callers (the conversion webhook).
pub async fn convert_async(
    plugin: &Plugin,
    object: Value,
    to: &str,
) -> Result<Value, ConvertError> {
    let api_version = target_api_version(plugin.info(), to);
    if object.get("apiVersion").and_then(Value::as_str) == Some(api_version.as_str()) {
        return Ok(object);
    }
    let answer = plugin
        .convert_async(&object, version_of(&api_version))
        .await?;
    finish(plugin, &object, answer, &api_version)
}

/// The version part of an `apiVersion` (`v1` of `db.example.com/v1`): what the
/// contract's `convert` takes as `to-version`.
pub fn version_of(api_version: &str) -> &str {
    api_version.rsplit('/').next().unwrap_or(api_version)
}

fn finish(
    plugin: &Plugin,
    original: &Value,
    answer: Result<String, String>,
    api_version: &str,
) -> Result<Value, ConvertError> {
    let plugin = plugin.info().name.clone();
    let converted = answer.map_err(|reason| ConvertError::Refused {
        plugin: plugin.clone(),
        reason: reason.replace('\n', " "),
    })?;
    check(original, &converted, api_version)
        .map_err(|reason| ConvertError::Invalid { plugin, reason })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_conversion_may_change_the_version_and_spec_but_not_the_identity() {
        let original = json!({"apiVersion": "db.example.com/v1alpha1", "kind": "PostgreSQLCluster",
            "metadata": {"name": "pg", "namespace": "ns", "uid": "u1"}, "spec": {"replicas": 3}});
        let good = json!({"apiVersion": "db.example.com/v1", "kind": "PostgreSQLCluster",
            "metadata": {"name": "pg", "namespace": "ns", "uid": "u1",
                         "annotations": {"x": "y"}}, "spec": {"instances": 3}});
        assert_eq!(
            check(&original, &good.to_string(), "db.example.com/v1").unwrap(),
            good
        );
        let mut renamed = good.clone();
        renamed["metadata"]["name"] = json!("other");
        let err = check(&original, &renamed.to_string(), "db.example.com/v1").unwrap_err();
        assert!(err.contains("/metadata/name"), "{err}");
        let err = check(&original, &good.to_string(), "db.example.com/v2").unwrap_err();
        assert!(err.contains("apiVersion"), "{err}");
        let err = check(&original, "[1]", "db.example.com/v1").unwrap_err();
        assert_eq!(err, "not a JSON object");
        let err = check(&original, "{", "db.example.com/v1").unwrap_err();
        assert!(err.starts_with("not JSON: "), "{err}");
    }
}
