//! Admission (`validate`): the changes refused before they are stored, so that
//! `kubectl apply` says why at once instead of a `Failed` phase later. The checks are
//! reconcile's own ([`spec::check`]), with the old spec standing for what runs.

use serde_json::Value;

use crate::cluster::Cluster;
use crate::convert::{self, Version as ApiVersion};
use crate::spec::{self, ClusterSpec, Config, reasons};

/// Whether a PostgreSQLCluster may become `new` (`old` is none on create): the warnings
/// `kubectl` prints, or the one-line reason it is refused.
///
/// A change that leaves the spec as it was (metadata, finalizers, status) is always
/// allowed, so that a parent stored before this check existed can still be deleted.
pub fn validate(old: Option<&Value>, new: &Value) -> Result<Vec<String>, String> {
    let (spec, fields) = ClusterSpec::of(new).map_err(message)?;
    // An old object that does not read (stored before admission checked anything) is
    // no baseline: the change is judged as a create.
    let old = old.and_then(|o| Some((o, ClusterSpec::of(o).ok()?.0)));
    if let Some((old, _)) = old
        && v1_spec(old) == v1_spec(new)
    {
        return Ok(Vec::new());
    }
    if old.is_none() {
        let name = new
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or_default();
        // Empty with generateName: the API server names it after admission.
        if !name.is_empty() {
            Cluster::new(name, "").map_err(message)?;
        }
    }
    let wanted = Config::from_spec(&spec, fields).map_err(message)?;
    let before = old.and_then(|(object, spec)| baseline(object, &spec, &wanted));
    spec::check(&wanted, before.as_ref(), fields).map_err(|refusal| refusal.message)?;
    Ok(warnings(&wanted, before.as_ref(), fields))
}

/// The old spec as the baseline of the checks. When reconcile already refused it for a
/// version or size (the `Ready` condition says so), the old spec is not what runs:
/// that field is left to reconcile, which compares with what does, so that setting it
/// back is never refused here.
fn baseline(old: &Value, spec: &ClusterSpec, wanted: &Config) -> Option<Config> {
    let fields = spec::Fields::of(ApiVersion::V1);
    let mut before = Config::from_spec(spec, fields).ok()?;
    match ready_reason(old) {
        Some(reasons::MAJOR_VERSION_CHANGE) => before.version = wanted.version.clone(),
        Some(reasons::STORAGE_SHRINK | reasons::STORAGE_CHANGE) => {
            before.storage = wanted.storage.clone()
        }
        _ => {}
    }
    Some(before)
}

/// What the user should know about an allowed change.
fn warnings(wanted: &Config, before: Option<&Config>, fields: spec::Fields) -> Vec<String> {
    let Some(before) = before else {
        return Vec::new();
    };
    let mut warnings = Vec::new();
    if before.version != wanted.version || before.image() != wanted.image() {
        warnings.push(format!(
            "the instances restart one by one to run {} (standbys first, the primary last): writes pause while the primary restarts",
            wanted.image()
        ));
    }
    if wanted.replicas < before.replicas {
        warnings.push(format!(
            "{} {} -> {}: the highest instances stop; their volumes are kept",
            fields.instances, before.replicas, wanted.replicas
        ));
    }
    warnings
}

/// The spec in v1 terms, to tell whether a change touches it.
fn v1_spec(object: &Value) -> Option<Value> {
    convert::convert(object.clone(), ApiVersion::V1.name())
        .ok()?
        .get("spec")
        .cloned()
}

/// The reason of the `Ready` condition in an object's status.
fn ready_reason(object: &Value) -> Option<&str> {
    object
        .pointer("/status/conditions")?
        .as_array()?
        .iter()
        .find(|c| c.get("type").and_then(Value::as_str) == Some("Ready"))?
        .get("reason")?
        .as_str()
}

fn message(error: capstan_sdk::Error) -> String {
    match error {
        capstan_sdk::Error::Invalid(m) | capstan_sdk::Error::Retry(m) => m,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn v1(spec: Value) -> Value {
        json!({"apiVersion": "db.example.com/v1", "kind": "PostgreSQLCluster",
               "metadata": {"name": "pg", "namespace": "prod"}, "spec": spec})
    }

    fn v1alpha1(spec: Value) -> Value {
        json!({"apiVersion": "db.example.com/v1alpha1", "kind": "PostgreSQLCluster",
               "metadata": {"name": "pg", "namespace": "prod"}, "spec": spec})
    }

    fn spec(version: &str, size: &str, schedule: Option<&str>) -> Value {
        let mut spec = json!({"instances": 3, "version": version, "storage": {"size": size}});
        if let Some(s) = schedule {
            spec["backupSchedule"] = json!(s);
        }
        spec
    }

    fn refused(old: Option<&Value>, new: &Value) -> String {
        let message = validate(old, new).expect_err("should be refused");
        assert!(!message.contains('\n'), "{message}");
        message
    }

    #[test]
    fn a_major_version_change_is_refused() {
        for (from, to) in [("15.4", "16.1"), ("16.1", "15.4"), ("16.15", "17.0")] {
            let message = refused(
                Some(&v1(spec(from, "1Gi", None))),
                &v1(spec(to, "1Gi", None)),
            );
            assert!(
                message.starts_with(&format!(
                    "spec.version {to} is a major version change from {from}:"
                )),
                "{message}"
            );
        }
    }

    #[test]
    fn a_storage_shrink_is_refused_with_quantities_compared() {
        for (from, to) in [
            ("1Gi", "500Mi"),
            ("2G", "1Gi"),
            ("1Gi", "1000Mi"),
            ("1.5Gi", "1G"),
        ] {
            let message = refused(
                Some(&v1(spec("16.1", from, None))),
                &v1(spec("16.1", to, None)),
            );
            assert_eq!(
                message,
                format!(
                    "spec.storage.size {to} is smaller than {from}: a volume cannot shrink; set spec.storage.size back to {from}"
                )
            );
        }
    }

    #[test]
    fn growing_the_storage_is_refused_with_its_own_message() {
        let message = refused(
            Some(&v1(spec("16.1", "1Gi", None))),
            &v1(spec("16.1", "2G", None)),
        );
        assert!(
            message.starts_with("spec.storage.size 2G is larger than 1Gi: a StatefulSet's volume claim templates cannot change"),
            "{message}"
        );
    }

    #[test]
    fn a_bad_schedule_is_refused_on_create_and_on_update() {
        let bad = v1(spec("16.1", "1Gi", Some("0 25 * * *")));
        for old in [None, Some(v1(spec("16.1", "1Gi", None)))] {
            assert_eq!(
                refused(old.as_ref(), &bad),
                "spec.backupSchedule is not a valid cron expression: hour field \"25\": 25 is out of range 0-23"
            );
        }
        assert!(
            refused(None, &v1(spec("16.1", "1Gi", Some("@every 1h"))))
                .contains("not a known macro")
        );
    }

    #[test]
    fn on_create_everything_reconcile_calls_invalid_is_refused() {
        for (new, says) in [
            (
                v1(json!({"instances": 9, "version": "16.1"})),
                "spec.instances is 9; it must be between 1 and 7",
            ),
            (
                v1(json!({"instances": 1, "version": "16"})),
                "spec.version \"16\" is not major.minor",
            ),
            (
                v1(json!({"version": "16.1"})),
                "spec: missing field `instances`",
            ),
            (
                v1(spec("12.4", "1Gi", None)),
                "spec.version 12.4 is not supported",
            ),
            (
                v1(spec("16.1", "lots", None)),
                "spec.storage.size is not a valid size",
            ),
            (
                v1alpha1(json!({"replicas": 1, "version": "16.1", "storage": "0Gi"})),
                "spec.storage is not a valid size",
            ),
            (
                v1(json!({"instances": 1, "version": "16.1", "imageName": "pg :16"})),
                "spec.imageName \"pg :16\" is not an image reference",
            ),
        ] {
            let message = refused(None, &new);
            assert!(message.starts_with(says), "{message}");
        }
        let mut dotted = v1(spec("16.1", "1Gi", None));
        dotted["metadata"]["name"] = json!("db.prod");
        assert!(refused(None, &dotted).starts_with("metadata.name \"db.prod\" cannot name"));
    }

    #[test]
    fn allowed_changes_pass_with_warnings_where_useful() {
        let old = v1(spec("16.1", "1Gi", Some("@daily")));
        for (new, warns) in [
            (
                v1(spec("16.2", "1Gi", Some("@daily"))),
                Some("the instances restart one by one to run postgres:16.2"),
            ),
            (v1(spec("16.1", "1024Mi", Some("@daily"))), None),
            (v1(spec("16.1", "1Gi", Some("0 3 * * *"))), None),
            (v1(spec("16.1", "1Gi", None)), None),
            (
                v1(json!({"instances": 5, "version": "16.1", "storage": {"size": "1Gi"}})),
                None,
            ),
            (
                v1(json!({"instances": 1, "version": "16.1", "storage": {"size": "1Gi"}})),
                Some("spec.instances 3 -> 1: the highest instances stop"),
            ),
        ] {
            let warnings = validate(Some(&old), &new).unwrap_or_else(|e| panic!("{e}: {new}"));
            match warns {
                Some(w) => assert!(warnings.iter().any(|x| x.starts_with(w)), "{warnings:?}"),
                None => assert_eq!(warnings, Vec::<String>::new()),
            }
        }
        assert_eq!(
            validate(None, &v1(spec("17.0", "2G", Some("0 2 * * *")))),
            Ok(vec![])
        );
    }

    /// The v1alpha1 fields are checked as well, and named as v1alpha1 names them.
    #[test]
    fn v1alpha1_objects_are_checked_with_their_own_field_names() {
        let old = v1alpha1(json!({"replicas": 3, "version": "16.1", "storage": "2Gi"}));
        let new = v1alpha1(json!({"replicas": 3, "version": "16.1", "storage": "1Gi"}));
        assert_eq!(
            refused(Some(&old), &new),
            "spec.storage 1Gi is smaller than 2Gi: a volume cannot shrink; set spec.storage back to 2Gi"
        );
        let scaled = v1alpha1(json!({"replicas": 1, "version": "16.1", "storage": "2Gi"}));
        assert_eq!(
            validate(Some(&old), &scaled).unwrap(),
            ["spec.replicas 3 -> 1: the highest instances stop; their volumes are kept"]
        );
        // Old and new in different versions compare by meaning.
        let same = v1(spec("16.1", "2Gi", None));
        assert_eq!(validate(Some(&old), &same), Ok(vec![]));
    }

    /// A parent stored before this check (or while no webhook answered) can still get
    /// and lose its finalizer, and be deleted.
    #[test]
    fn a_change_that_leaves_the_spec_alone_is_allowed() {
        let stored = v1(spec("16.1", "1Gi", Some("not cron")));
        let mut deleting = stored.clone();
        deleting["metadata"]["finalizers"] = json!([]);
        deleting["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
        deleting["status"] = json!({"phase": "Failed"});
        assert_eq!(validate(Some(&stored), &deleting), Ok(vec![]));
    }

    /// The old spec was already refused by reconcile for its version or size: setting
    /// the field back to what runs (which admission cannot see) is not refused.
    #[test]
    fn a_spec_refused_by_reconcile_can_be_set_back() {
        let mut old = v1(spec("17.0", "1Gi", None));
        old["status"] = json!({"phase": "Failed", "conditions": [
            {"type": "Ready", "status": "False", "reason": "MajorVersionChange"}]});
        assert_eq!(
            validate(Some(&old), &v1(spec("16.1", "1Gi", None))),
            Ok(vec![])
        );
        // Other checks still hold.
        assert!(refused(Some(&old), &v1(spec("16.1", "500Mi", None))).contains("cannot shrink"));

        let mut old = v1(spec("16.1", "5Gi", None));
        old["status"] = json!({"conditions": [{"type": "Ready", "reason": "StorageChange"}]});
        assert_eq!(
            validate(Some(&old), &v1(spec("16.1", "1Gi", None))),
            Ok(vec![])
        );
        assert!(refused(Some(&old), &v1(spec("17.1", "1Gi", None))).contains("major version"));
    }

    #[test]
    fn an_old_object_that_does_not_read_is_no_baseline() {
        let old = v1(json!({"instances": "three"}));
        assert_eq!(
            validate(Some(&old), &v1(spec("16.1", "1Gi", None))),
            Ok(vec![])
        );
        assert!(
            refused(Some(&old), &v1(spec("16.1", "1Gi", Some("bad")))).contains("backupSchedule")
        );
    }
}
