//! The two versions of PostgreSQLCluster and the conversion between them.
//!
//! `v1alpha1` is seed 004's resource: `spec.replicas` and `spec.storage: "10Gi"`. `v1`
//! speaks CloudNativePG's words: `spec.instances` and `spec.storage.size`, an object
//! with room for more volume settings later. Everything else (`version`, `imageName`,
//! `backupSchedule`, unknown fields, the metadata, the whole status) is the same in both
//! and passes through untouched.
//!
//! Conversion is lossless both ways: what the target version has no room for (today only
//! fields the CRD schemas would prune anyway: an extra `instances` in a v1alpha1 spec, an
//! extra `replicas` or anything but `size` under a v1 `spec.storage`) is kept, as JSON,
//! in the annotation [`stash_annotation`] of the source version, and put back by the
//! conversion to that version, which removes the annotation. Field by field, so that an
//! object read in one version, edited and written back keeps both the edit and what its
//! version could not show.

use serde_json::{Map, Value, json};

/// The API group of PostgreSQLCluster.
pub const GROUP: &str = "db.example.com";

/// Prefix of the annotations that keep what a version could not hold:
/// `conversion.db.example.com/<version>`. Reserved: a conversion replaces or removes it.
pub const STASH_PREFIX: &str = "conversion.db.example.com/";

/// A served version of PostgreSQLCluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    /// Seed 004's: `replicas`, `storage` as a quantity.
    V1alpha1,
    /// The storage version, reconciled by the plugin: `instances`, `storage.size`.
    V1,
}

impl Version {
    /// Every served version, oldest first.
    pub const ALL: [Version; 2] = [Version::V1alpha1, Version::V1];

    /// The version's name, such as `v1`.
    pub fn name(self) -> &'static str {
        match self {
            Version::V1alpha1 => "v1alpha1",
            Version::V1 => "v1",
        }
    }

    /// `apiVersion` as written in manifests, such as `db.example.com/v1`.
    pub fn api_version(self) -> String {
        format!("{GROUP}/{}", self.name())
    }

    /// A version named as the conversion webhook may name it: `v1` or `db.example.com/v1`.
    pub fn parse(text: &str) -> Option<Self> {
        let name = match text.split_once('/') {
            Some((group, name)) if group == GROUP => name,
            Some(_) => return None,
            None => text,
        };
        Version::ALL.into_iter().find(|v| v.name() == name)
    }

    /// The version of an object, from its `apiVersion`.
    pub fn of(object: &Value) -> Result<Self, String> {
        let api_version = object
            .get("apiVersion")
            .and_then(Value::as_str)
            .unwrap_or_default();
        match api_version.split_once('/') {
            Some((GROUP, _)) => Version::parse(api_version),
            _ => None,
        }
        .ok_or_else(|| {
            format!(
                "apiVersion {api_version:?} is not a version of PostgreSQLCluster ({} or {})",
                Version::V1alpha1.api_version(),
                Version::V1.api_version()
            )
        })
    }
}

/// The annotation that keeps what `version` had and the other version could not hold.
pub fn stash_annotation(version: Version) -> String {
    format!("{STASH_PREFIX}{}", version.name())
}

/// `object` (either version) as version `to` (`v1` or `db.example.com/v1`); the same
/// object when it already is. Errors are one line.
pub fn convert(mut object: Value, to: &str) -> Result<Value, String> {
    let target = Version::parse(to).ok_or_else(|| {
        format!(
            "cannot convert to {to:?}: PostgreSQLCluster has the versions {} and {}",
            Version::V1alpha1.name(),
            Version::V1.name()
        )
    })?;
    let source = Version::of(&object)?;
    if source == target {
        return Ok(object);
    }
    object["apiVersion"] = json!(target.api_version());
    let restore = take_stash(&mut object, target);
    let lost = match object.get_mut("spec") {
        Some(Value::Object(spec)) => map_spec(spec, source, restore),
        // No spec (or not an object, which the schema refuses): nothing to map, but a
        // stash taken from an object whose spec was removed since still comes back.
        Some(_) => Map::new(),
        None if restore.is_empty() => Map::new(),
        None => {
            let mut spec = Map::new();
            let lost = map_spec(&mut spec, source, restore);
            object["spec"] = Value::Object(spec);
            lost
        }
    };
    if !lost.is_empty() {
        put_stash(&mut object, source, lost)?;
    }
    Ok(object)
}

/// Rewrites `spec` from `source` into the other version, puts back `restore` (what the
/// other version had that `source` could not hold), and returns what `source` had that
/// the other version cannot hold.
fn map_spec(spec: &mut Map<String, Value>, source: Version, restore: Map<String, Value>) -> Lost {
    match source {
        Version::V1alpha1 => up(spec, restore),
        Version::V1 => down(spec, restore),
    }
}

type Lost = Map<String, Value>;

/// v1alpha1 → v1: `replicas` → `instances`, `storage: X` → `storage: {size: X}`.
fn up(spec: &mut Map<String, Value>, mut restore: Map<String, Value>) -> Lost {
    let mut lost = Map::new();
    // A v1alpha1 spec's own `instances` (unknown there) would collide with the renamed
    // `replicas`.
    if let Some(extra) = spec.remove("instances") {
        lost.insert("instances".into(), extra);
    }
    if let Some(replicas) = spec.remove("replicas") {
        spec.insert("instances".into(), replicas);
    }
    let size = spec.remove("storage");
    match (size, restore.remove("storage")) {
        // What v1 had beside the size comes back around the (possibly edited) size.
        (size, Some(Value::Object(mut rest))) => {
            if let Some(size) = size {
                rest.insert("size".into(), size);
            }
            spec.insert("storage".into(), Value::Object(rest));
        }
        // v1 had a storage v1alpha1 could not show at all; a size set since wins.
        (None, Some(other)) => {
            spec.insert("storage".into(), other);
        }
        (Some(size), _) => {
            spec.insert("storage".into(), json!({ "size": size }));
        }
        (None, None) => {}
    }
    spec.extend(restore);
    lost
}

/// v1 → v1alpha1: `instances` → `replicas`, `storage: {size: X}` → `storage: X`.
fn down(spec: &mut Map<String, Value>, restore: Map<String, Value>) -> Lost {
    let mut lost = Map::new();
    if let Some(extra) = spec.remove("replicas") {
        lost.insert("replicas".into(), extra);
    }
    if let Some(instances) = spec.remove("instances") {
        spec.insert("replicas".into(), instances);
    }
    match spec.remove("storage") {
        Some(Value::Object(mut storage)) => {
            let size = storage.remove("size");
            let only_size = size.is_some() && storage.is_empty();
            if let Some(size) = size {
                spec.insert("storage".into(), size);
            }
            if !only_size {
                lost.insert("storage".into(), Value::Object(storage));
            }
        }
        Some(other) => {
            lost.insert("storage".into(), other);
        }
        None => {}
    }
    spec.extend(restore);
    lost
}

/// What a stash records besides the spec fields: how the annotations were before it was
/// added, so that removing it leaves them exactly so.
const ANNOTATIONS_WERE: &str = "annotationsWere";

/// Adds the stash of `source` to the metadata's annotations.
fn put_stash(object: &mut Value, source: Version, lost: Lost) -> Result<(), String> {
    let Some(object) = object.as_object_mut() else {
        return Err("the object is not a JSON object".into());
    };
    let mut stash = json!({ "spec": lost });
    let were = match object.get("metadata") {
        None => Some("noMetadata"),
        Some(metadata) => match metadata.get("annotations") {
            Some(Value::Object(a)) if a.is_empty() => Some("empty"),
            _ => None,
        },
    };
    if let Some(were) = were {
        stash[ANNOTATIONS_WERE] = json!(were);
    }
    let metadata = object.entry("metadata").or_insert_with(|| json!({}));
    let Some(metadata) = metadata.as_object_mut() else {
        return Err("metadata is not an object".into());
    };
    let annotations = metadata.entry("annotations").or_insert_with(|| json!({}));
    let Some(annotations) = annotations.as_object_mut() else {
        return Err("metadata.annotations is not an object".into());
    };
    annotations.insert(stash_annotation(source), json!(stash.to_string()));
    Ok(())
}

/// Removes the stash kept for `target` and returns its spec fields (none: empty). A
/// stash that is not what a conversion writes (edited by hand) is left where it is, as
/// any other annotation, rather than failing every read of the object in `target`.
fn take_stash(object: &mut Value, target: Version) -> Map<String, Value> {
    let key = stash_annotation(target);
    let Some(metadata) = object.get_mut("metadata").and_then(Value::as_object_mut) else {
        return Map::new();
    };
    let Some(annotations) = metadata
        .get_mut("annotations")
        .and_then(Value::as_object_mut)
    else {
        return Map::new();
    };
    let stash = annotations
        .get(&key)
        .and_then(Value::as_str)
        .and_then(|text| serde_json::from_str::<Value>(text).ok());
    let Some(Value::Object(mut stash)) = stash else {
        return Map::new();
    };
    let Some(Value::Object(fields)) = stash.remove("spec") else {
        return Map::new();
    };
    annotations.remove(&key);
    let were = stash.get(ANNOTATIONS_WERE).and_then(Value::as_str);
    if annotations.is_empty() && were != Some("empty") {
        metadata.remove("annotations");
        if metadata.is_empty()
            && were == Some("noMetadata")
            && let Some(object) = object.as_object_mut()
        {
            object.remove("metadata");
        }
    }
    fields
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small deterministic generator (xorshift), so that the property tests need no
    /// extra dependency and fail the same way every run.
    struct Gen(u64);

    impl Gen {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }

        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }

        fn chance(&mut self, percent: u64) -> bool {
            self.below(100) < percent
        }

        fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
            &items[self.below(items.len() as u64) as usize]
        }

        /// Some JSON value an unknown field could hold.
        fn any_value(&mut self, depth: u32) -> Value {
            match self.below(if depth == 0 { 5 } else { 7 }) {
                0 => Value::Null,
                1 => json!(self.chance(50)),
                2 => json!(self.below(1000) as i64 - 500),
                3 => json!(*self.pick(&["", "x", "16.1", "1Gi", "é ü", "{\"a\":1}"])),
                4 => json!(1.5),
                5 => Value::Array(
                    (0..self.below(3))
                        .map(|_| self.any_value(depth - 1))
                        .collect(),
                ),
                _ => {
                    let mut map = Map::new();
                    for _ in 0..self.below(3) {
                        let key =
                            (*self.pick(&["a", "size", "replicas", "instances", "k"])).to_string();
                        map.insert(key, self.any_value(depth - 1));
                    }
                    Value::Object(map)
                }
            }
        }

        fn metadata(&mut self) -> Value {
            let mut metadata = json!({"name": "pg", "namespace": "prod", "uid": "u-1"});
            match self.below(4) {
                0 => {}
                1 => metadata["annotations"] = json!({}),
                2 => metadata["annotations"] = json!({"team": "db", "note": "{\"spec\":{}}"}),
                _ => metadata["labels"] = json!({"app": "x"}),
            }
            if self.chance(20) {
                metadata["finalizers"] = json!(["capstan.dev/finalizer"]);
            }
            metadata
        }

        fn status(&mut self) -> Option<Value> {
            match self.below(3) {
                0 => None,
                1 => Some(json!({"phase": "Running", "readyReplicas": 3,
                    "primaryEndpoint": "pg-rw.prod.svc:5432", "observedGeneration": 2,
                    "conditions": [{"type": "Ready", "status": "True", "reason": "AllInstancesReady",
                        "message": "m", "lastTransitionTime": "2026-01-01T00:00:00Z"}]})),
                _ => Some(json!({"phase": "Failed", "somethingNew": self.any_value(2)})),
            }
        }

        /// Fields both versions share, and unknown ones.
        fn common_spec(&mut self, spec: &mut Map<String, Value>) {
            if self.chance(90) {
                spec.insert(
                    "version".into(),
                    json!(*self.pick(&["16.1", "15.4", "17.0"])),
                );
            }
            if self.chance(40) {
                spec.insert(
                    "backupSchedule".into(),
                    json!(*self.pick(&["0 2 * * *", "@daily", "bad"])),
                );
            }
            if self.chance(20) {
                spec.insert("imageName".into(), json!("registry.example/pg:16.1"));
            }
            for _ in 0..self.below(3) {
                let key = *self.pick(&["unknown", "postgresql", "monitoring", "x-y"]);
                spec.insert(key.into(), self.any_value(2));
            }
        }

        fn v1alpha1(&mut self) -> Value {
            let mut spec = Map::new();
            if self.chance(90) {
                spec.insert("replicas".into(), json!(self.below(9)));
            }
            match self.below(5) {
                0 => {}
                1 => {
                    spec.insert("storage".into(), self.any_value(2));
                }
                _ => {
                    spec.insert(
                        "storage".into(),
                        json!(*self.pick(&["1Gi", "500Mi", "2G", "10Gi"])),
                    );
                }
            }
            if self.chance(15) {
                spec.insert("instances".into(), self.any_value(1));
            }
            self.common_spec(&mut spec);
            self.object(Version::V1alpha1, spec)
        }

        fn v1(&mut self) -> Value {
            let mut spec = Map::new();
            if self.chance(90) {
                spec.insert("instances".into(), json!(self.below(9)));
            }
            match self.below(6) {
                0 => {}
                1 => {
                    spec.insert("storage".into(), self.any_value(2));
                }
                2 => {
                    let mut storage = Map::new();
                    if self.chance(50) {
                        storage.insert("size".into(), json!("1Gi"));
                    }
                    storage.insert("storageClass".into(), json!("fast"));
                    spec.insert("storage".into(), Value::Object(storage));
                }
                _ => {
                    spec.insert(
                        "storage".into(),
                        json!({"size": *self.pick(&["1Gi", "500Mi", "2G"])}),
                    );
                }
            }
            if self.chance(15) {
                spec.insert("replicas".into(), self.any_value(1));
            }
            self.common_spec(&mut spec);
            self.object(Version::V1, spec)
        }

        fn object(&mut self, version: Version, spec: Map<String, Value>) -> Value {
            let mut object = json!({
                "apiVersion": version.api_version(),
                "kind": "PostgreSQLCluster",
                "metadata": self.metadata(),
            });
            if self.chance(95) {
                object["spec"] = Value::Object(spec);
            }
            if let Some(status) = self.status() {
                object["status"] = status;
            }
            object
        }
    }

    fn to(object: &Value, version: &str) -> Value {
        convert(object.clone(), version).unwrap_or_else(|e| panic!("{e}: {object}"))
    }

    const CASES: usize = 2000;

    #[test]
    fn v1alpha1_to_v1_and_back_is_the_original() {
        let mut g = Gen(0x9e37_79b9_7f4a_7c15);
        let mut lossy = 0;
        for _ in 0..CASES {
            let original = g.v1alpha1();
            let v1 = to(&original, "v1");
            assert_eq!(v1["apiVersion"], "db.example.com/v1");
            if v1
                .pointer("/metadata/annotations/conversion.db.example.com~1v1alpha1")
                .is_some()
            {
                lossy += 1;
            }
            assert_eq!(to(&v1, "v1alpha1"), original, "through {v1}");
        }
        assert!(lossy > 0, "the generator never made a spec v1 cannot hold");
    }

    #[test]
    fn v1_to_v1alpha1_and_back_is_the_original() {
        let mut g = Gen(0x2545_f491_4f6c_dd1d);
        let mut lossy = 0;
        for _ in 0..CASES {
            let original = g.v1();
            let old = to(&original, "db.example.com/v1alpha1");
            assert_eq!(old["apiVersion"], "db.example.com/v1alpha1");
            if old
                .pointer("/metadata/annotations/conversion.db.example.com~1v1")
                .is_some()
            {
                lossy += 1;
            }
            assert_eq!(to(&old, "db.example.com/v1"), original, "through {old}");
        }
        assert!(
            lossy > 0,
            "the generator never made a spec v1alpha1 cannot hold"
        );
    }

    /// An object converted down and back up twice: the stash is written and consumed
    /// the same way each time.
    #[test]
    fn repeated_round_trips_are_stable() {
        let mut g = Gen(0xdead_beef_cafe_f00d);
        for _ in 0..CASES / 4 {
            let original = g.v1();
            let once = to(&original, "v1alpha1");
            let twice = to(&to(&once, "v1"), "v1alpha1");
            assert_eq!(twice, once);
            assert_eq!(to(&twice, "v1"), original);
        }
    }

    #[test]
    fn the_fields_are_renamed_and_nothing_else_changes() {
        let old = json!({
            "apiVersion": "db.example.com/v1alpha1", "kind": "PostgreSQLCluster",
            "metadata": {"name": "demo", "namespace": "default", "uid": "u"},
            "spec": {"replicas": 3, "version": "16.15", "storage": "1Gi",
                     "backupSchedule": "0 2 * * *", "imageName": "pg:16.15"},
            "status": {"phase": "Running", "readyReplicas": 3},
        });
        let new = json!({
            "apiVersion": "db.example.com/v1", "kind": "PostgreSQLCluster",
            "metadata": {"name": "demo", "namespace": "default", "uid": "u"},
            "spec": {"instances": 3, "version": "16.15", "storage": {"size": "1Gi"},
                     "backupSchedule": "0 2 * * *", "imageName": "pg:16.15"},
            "status": {"phase": "Running", "readyReplicas": 3},
        });
        assert_eq!(to(&old, "v1"), new, "no annotation when nothing is lost");
        assert_eq!(to(&new, "v1alpha1"), old);
        assert_eq!(to(&new, "v1"), new, "already v1");
        assert_eq!(to(&old, "db.example.com/v1alpha1"), old, "already v1alpha1");
    }

    /// Read in v1alpha1, edited, written back: the edit and what v1alpha1 could not
    /// show both survive.
    #[test]
    fn an_edit_through_the_old_version_keeps_what_it_could_not_show() {
        let v1 = json!({
            "apiVersion": "db.example.com/v1", "kind": "PostgreSQLCluster",
            "metadata": {"name": "demo", "annotations": {"team": "db"}},
            "spec": {"instances": 3, "version": "16.1",
                     "storage": {"size": "1Gi", "storageClass": "fast"}},
        });
        let mut old = to(&v1, "v1alpha1");
        assert_eq!(
            old["spec"],
            json!({"replicas": 3, "version": "16.1", "storage": "1Gi"})
        );
        assert_eq!(
            old["metadata"]["annotations"]["conversion.db.example.com/v1"],
            r#"{"spec":{"storage":{"storageClass":"fast"}}}"#
        );
        old["spec"]["replicas"] = json!(5);
        old["spec"]["storage"] = json!("2Gi");
        assert_eq!(
            to(&old, "v1"),
            json!({
                "apiVersion": "db.example.com/v1", "kind": "PostgreSQLCluster",
                "metadata": {"name": "demo", "annotations": {"team": "db"}},
                "spec": {"instances": 5, "version": "16.1",
                         "storage": {"size": "2Gi", "storageClass": "fast"}},
            })
        );
    }

    #[test]
    fn a_stash_edited_by_hand_is_left_as_an_annotation() {
        let old = json!({
            "apiVersion": "db.example.com/v1alpha1", "kind": "PostgreSQLCluster",
            "metadata": {"name": "demo", "annotations": {"conversion.db.example.com/v1": "oops"}},
            "spec": {"replicas": 1, "version": "16.1"},
        });
        let v1 = to(&old, "v1");
        assert_eq!(
            v1["metadata"]["annotations"]["conversion.db.example.com/v1"],
            "oops"
        );
        assert_eq!(v1["spec"], json!({"instances": 1, "version": "16.1"}));
        assert_eq!(to(&v1, "v1alpha1"), old);
    }

    #[test]
    fn unknown_versions_are_refused_in_one_line() {
        let v1 = json!({"apiVersion": "db.example.com/v1", "kind": "PostgreSQLCluster",
                        "metadata": {"name": "x"}, "spec": {}});
        for (object, to, says) in [
            (
                &v1,
                "v2",
                "cannot convert to \"v2\": PostgreSQLCluster has the versions v1alpha1 and v1",
            ),
            (
                &v1,
                "other.example.com/v1",
                "cannot convert to \"other.example.com/v1\"",
            ),
            (
                &v1,
                "db.example.com/v2",
                "cannot convert to \"db.example.com/v2\"",
            ),
            (
                &json!({"apiVersion": "db.example.com/v0", "kind": "PostgreSQLCluster"}),
                "v1",
                "apiVersion \"db.example.com/v0\" is not a version of PostgreSQLCluster",
            ),
            (
                &json!({"kind": "PostgreSQLCluster"}),
                "v1",
                "apiVersion \"\" is not a version",
            ),
        ] {
            let err = convert(object.clone(), to).expect_err(to);
            assert!(err.starts_with(says), "{err}");
            assert!(!err.contains('\n'), "{err}");
        }
    }

    #[test]
    fn versions_parse_with_or_without_the_group() {
        assert_eq!(Version::parse("v1"), Some(Version::V1));
        assert_eq!(
            Version::parse("db.example.com/v1alpha1"),
            Some(Version::V1alpha1)
        );
        assert_eq!(Version::parse("apps/v1"), None);
        assert_eq!(Version::parse("v1beta1"), None);
        assert_eq!(
            stash_annotation(Version::V1),
            "conversion.db.example.com/v1"
        );
    }
}
