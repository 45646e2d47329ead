//! The PostgreSQLCluster spec, checked: the configuration the children are built from,
//! and the changes the plugin refuses to make. The same checks run at admission
//! (`validate`, against the old spec) and in `reconcile` (against what runs).

use std::fmt;

use capstan_sdk::Error;
use serde::Deserialize;
use serde_json::Value;

use crate::convert::{self, Version as ApiVersion};
use crate::cron;
use crate::quantity::Quantity;

/// Fewest instances.
pub const MIN_REPLICAS: i64 = 1;
/// Most instances.
pub const MAX_REPLICAS: i64 = 7;
/// Oldest PostgreSQL major version the scripts support (they set `wal_keep_size`).
pub const MIN_MAJOR: u32 = 13;
/// The volume size when the spec has none (the CRD defaults it too).
pub const DEFAULT_STORAGE: &str = "10Gi";

/// `spec` of the version the plugin reconciles, v1 (see [`crate::convert`] for v1alpha1).
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterSpec {
    /// Number of instances, 1–7 (v1alpha1: `replicas`).
    pub instances: i64,
    /// PostgreSQL version, `major.minor`.
    pub version: String,
    /// The instances' volumes (v1alpha1: `storage` is the size).
    #[serde(default)]
    pub storage: StorageSpec,
    /// Cron schedule of the logical dump.
    #[serde(default)]
    pub backup_schedule: Option<String>,
    /// The instances' image, when not `postgres:<version>` (CloudNativePG's field of the
    /// same name). It must run the PostgreSQL of `version`.
    #[serde(default)]
    pub image_name: Option<String>,
    /// Seconds the primary may be not ready before a standby is promoted.
    #[serde(default)]
    pub failover_delay: Option<u64>,
    /// Whether a commit waits for standbys to have it (a majority of the instances).
    #[serde(default)]
    pub synchronous: bool,
    /// The instance that should be the primary (`<name>-<n>`): setting it to another
    /// instance is a switchover.
    #[serde(default)]
    pub primary: Option<String>,
}

/// `spec.storage` in v1, as CloudNativePG's.
#[derive(Debug, Clone, Deserialize)]
pub struct StorageSpec {
    /// Size of each instance's volume, a Kubernetes quantity.
    #[serde(default = "default_storage")]
    pub size: String,
}

impl Default for StorageSpec {
    fn default() -> Self {
        StorageSpec {
            size: default_storage(),
        }
    }
}

fn default_storage() -> String {
    DEFAULT_STORAGE.into()
}

/// How the fields are called in the version a user wrote, for messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fields {
    /// The number of instances.
    pub instances: &'static str,
    /// The volume size.
    pub storage: &'static str,
}

impl Fields {
    /// The names in `version`.
    pub fn of(version: ApiVersion) -> Self {
        match version {
            ApiVersion::V1 => Fields {
                instances: "spec.instances",
                storage: "spec.storage.size",
            },
            ApiVersion::V1alpha1 => Fields {
                instances: "spec.replicas",
                storage: "spec.storage",
            },
        }
    }
}

impl ClusterSpec {
    /// The spec of a PostgreSQLCluster of either version (v1alpha1 is converted first),
    /// with the field names of the version it is written in. A spec that does not
    /// deserialize is [`Error::Invalid`], with serde's explanation.
    pub fn of(object: &Value) -> Result<(Self, Fields), Error> {
        let version = ApiVersion::of(object).map_err(Error::invalid)?;
        let v1 = match version {
            ApiVersion::V1 => None,
            ApiVersion::V1alpha1 => Some(
                convert::convert(object.clone(), ApiVersion::V1.name()).map_err(Error::invalid)?,
            ),
        };
        let spec = v1
            .as_ref()
            .unwrap_or(object)
            .get("spec")
            .cloned()
            .unwrap_or_else(|| Value::Object(Default::default()));
        let spec =
            serde_json::from_value(spec).map_err(|e| Error::invalid(format!("spec: {e}")))?;
        Ok((spec, Fields::of(version)))
    }
}

/// A PostgreSQL version as `spec.version` spells it: `major.minor`, also the image tag.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Version {
    text: String,
    major: u32,
}

impl Version {
    /// Parses `^\d+\.\d+$`, the CRD's pattern.
    pub fn parse(text: &str) -> Option<Self> {
        let (major, minor) = text.split_once('.')?;
        let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        if !digits(major) || !digits(minor) {
            return None;
        }
        Some(Version {
            text: text.into(),
            major: major.parse().ok()?,
        })
    }

    /// The major version.
    pub fn major(&self) -> u32 {
        self.major
    }

    /// The version as written, such as `16.1`.
    pub fn as_str(&self) -> &str {
        &self.text
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// What the children are built from: the spec once checked, or what is running.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Number of instances.
    pub replicas: i32,
    /// PostgreSQL version.
    pub version: Version,
    /// Size of each instance's volume, as written in the spec.
    pub storage: String,
    /// Cron schedule of the logical dump, if any.
    pub schedule: Option<String>,
    /// The instances' image; `None` is the official `postgres:<version>`.
    pub image: Option<String>,
}

impl Config {
    /// The image the instances and the dump Job run.
    pub fn image(&self) -> String {
        self.image
            .clone()
            .unwrap_or_else(|| official_image(&self.version))
    }
}

/// The repository of the official images: `postgres` (Docker Hub's), or the mirror named
/// by `CAPSTAN_POSTGRES_REPOSITORY` when the plugin is built (the tests of `capstan plan`
/// build a version of the plugin that differs by this alone).
const REPOSITORY: &str = match option_env!("CAPSTAN_POSTGRES_REPOSITORY") {
    Some(repository) => repository,
    None => "postgres",
};

/// The official image of `version`, such as `postgres:16.15`.
pub fn official_image(version: &Version) -> String {
    format!("{REPOSITORY}:{version}")
}

impl Config {
    /// The configuration the spec asks for, named as `fields`. A spec the CRD would
    /// have refused (instances out of range, a malformed version) is [`Error::Invalid`];
    /// everything else is checked by [`check`], which explains refusals.
    pub fn from_spec(spec: &ClusterSpec, fields: Fields) -> Result<Self, Error> {
        if !(MIN_REPLICAS..=MAX_REPLICAS).contains(&spec.instances) {
            return Err(Error::invalid(format!(
                "{} is {}; it must be between {MIN_REPLICAS} and {MAX_REPLICAS}",
                fields.instances, spec.instances
            )));
        }
        let version = Version::parse(&spec.version).ok_or_else(|| {
            Error::invalid(format!(
                "spec.version {:?} is not major.minor, such as \"16.1\"",
                spec.version
            ))
        })?;
        let schedule = spec
            .backup_schedule
            .as_deref()
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(String::from);
        let image = match spec.image_name.as_deref().map(str::trim) {
            None | Some("") => None,
            Some(name) if name.chars().any(char::is_whitespace) => {
                return Err(Error::invalid(format!(
                    "spec.imageName {name:?} is not an image reference: it has spaces"
                )));
            }
            Some(name) => Some(name.to_owned()),
        };
        Ok(Config {
            replicas: spec.instances as i32,
            version,
            storage: spec.storage.size.trim().into(),
            schedule,
            image,
        })
    }
}

/// Why the spec cannot be applied; the cluster is left as it was.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// CamelCase reason, for the `Ready` condition and the Warning event.
    pub reason: &'static str,
    /// One line for humans.
    pub message: String,
}

impl Refusal {
    fn new(reason: &'static str, message: String) -> Self {
        Refusal { reason, message }
    }
}

/// The reasons of refusals that compare the spec with what it was.
pub mod reasons {
    /// A major version change.
    pub const MAJOR_VERSION_CHANGE: &str = "MajorVersionChange";
    /// A smaller volume size.
    pub const STORAGE_SHRINK: &str = "StorageShrink";
    /// A larger volume size.
    pub const STORAGE_CHANGE: &str = "StorageChange";
}

/// Checks that `wanted` can be applied over `before` (what runs, or the old spec at
/// admission; none: a new cluster), naming the fields as `fields`.
pub fn check(wanted: &Config, before: Option<&Config>, fields: Fields) -> Result<(), Refusal> {
    if let Some(schedule) = &wanted.schedule {
        cron::validate(schedule).map_err(|why| {
            Refusal::new(
                "InvalidSchedule",
                format!("spec.backupSchedule is not a valid cron expression: {why}"),
            )
        })?;
    }
    let storage = Quantity::parse(&wanted.storage).map_err(|why| {
        Refusal::new(
            "InvalidStorage",
            format!("{} is not a valid size: {why}", fields.storage),
        )
    })?;
    if wanted.version.major() < MIN_MAJOR {
        return Err(Refusal::new(
            "UnsupportedVersion",
            format!(
                "spec.version {} is not supported: this plugin runs PostgreSQL {MIN_MAJOR} and later",
                wanted.version
            ),
        ));
    }
    let Some(before) = before else {
        return Ok(());
    };
    if wanted.version.major() != before.version.major() {
        return Err(Refusal::new(
            reasons::MAJOR_VERSION_CHANGE,
            format!(
                "spec.version {} is a major version change from {}: that needs pg_upgrade or a dump and restore, which this plugin does not do; set spec.version back to {}.x",
                wanted.version,
                before.version,
                before.version.major()
            ),
        ));
    }
    // What ran or was admitted before parses; if it does not (a StatefulSet edited by
    // hand), any size counts as a change.
    let Ok(size_before) = Quantity::parse(&before.storage) else {
        return Err(storage_change(wanted, before, fields, "differs from"));
    };
    if storage < size_before {
        return Err(Refusal::new(
            reasons::STORAGE_SHRINK,
            format!(
                "{} {} is smaller than {}: a volume cannot shrink; set {} back to {}",
                fields.storage, wanted.storage, before.storage, fields.storage, before.storage
            ),
        ));
    }
    if storage > size_before {
        return Err(storage_change(wanted, before, fields, "is larger than"));
    }
    Ok(())
}

fn storage_change(wanted: &Config, before: &Config, fields: Fields, how: &str) -> Refusal {
    Refusal::new(
        reasons::STORAGE_CHANGE,
        format!(
            "{} {} {how} {}: a StatefulSet's volume claim templates cannot change, so the plugin does not resize volumes (expand each claim by hand, see docs/postgresql.md); set {} back to {}",
            fields.storage, wanted.storage, before.storage, fields.storage, before.storage
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const V1: Fields = Fields {
        instances: "spec.instances",
        storage: "spec.storage.size",
    };

    fn config(replicas: i32, version: &str, storage: &str, schedule: Option<&str>) -> Config {
        Config {
            replicas,
            version: Version::parse(version).unwrap(),
            storage: storage.into(),
            schedule: schedule.map(String::from),
            image: None,
        }
    }

    fn v1_spec(spec: Value) -> ClusterSpec {
        let object =
            json!({"apiVersion": "db.example.com/v1", "kind": "PostgreSQLCluster", "spec": spec});
        ClusterSpec::of(&object).unwrap().0
    }

    #[test]
    fn versions_follow_the_crd_pattern() {
        let v = Version::parse("16.1").unwrap();
        assert_eq!((v.major(), v.as_str()), (16, "16.1"));
        for bad in ["16", "16.", ".1", "16.1.2", "v16.1", "16.x", "", "16.-1"] {
            assert_eq!(Version::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn the_spec_is_read_with_defaults() {
        let spec = v1_spec(json!({"instances": 3, "version": "16.1"}));
        let c = Config::from_spec(&spec, V1).unwrap();
        assert_eq!(c, config(3, "16.1", "10Gi", None));
        let spec = v1_spec(json!({"instances": 3, "version": "16.1", "storage": {}}));
        assert_eq!(Config::from_spec(&spec, V1).unwrap().storage, "10Gi");
        let spec = ClusterSpec {
            backup_schedule: Some("  ".into()),
            ..spec
        };
        assert_eq!(Config::from_spec(&spec, V1).unwrap().schedule, None);
    }

    #[test]
    fn both_versions_read_to_the_same_config_with_their_own_names() {
        let old = json!({"apiVersion": "db.example.com/v1alpha1", "kind": "PostgreSQLCluster",
            "spec": {"replicas": 2, "version": "16.2", "storage": "5Gi", "backupSchedule": "@daily"}});
        let new = json!({"apiVersion": "db.example.com/v1", "kind": "PostgreSQLCluster",
            "spec": {"instances": 2, "version": "16.2", "storage": {"size": "5Gi"}, "backupSchedule": "@daily"}});
        let (old_spec, old_fields) = ClusterSpec::of(&old).unwrap();
        let (new_spec, new_fields) = ClusterSpec::of(&new).unwrap();
        assert_eq!(
            Config::from_spec(&old_spec, old_fields).unwrap(),
            Config::from_spec(&new_spec, new_fields).unwrap()
        );
        assert_eq!(
            (old_fields.instances, old_fields.storage),
            ("spec.replicas", "spec.storage")
        );
        assert_eq!(new_fields, V1);
        let other = json!({"apiVersion": "db.example.com/v9", "spec": {}});
        assert!(matches!(ClusterSpec::of(&other), Err(Error::Invalid(m)) if m.contains("v9")));
    }

    #[test]
    fn specs_the_crd_refuses_are_invalid() {
        for (instances, version, fields, why) in [
            (
                0,
                "16.1",
                V1,
                "spec.instances is 0; it must be between 1 and 7",
            ),
            (
                8,
                "16.1",
                Fields::of(ApiVersion::V1alpha1),
                "spec.replicas is 8",
            ),
            (3, "16", V1, "spec.version \"16\" is not major.minor"),
        ] {
            let spec = ClusterSpec {
                instances,
                version: version.into(),
                storage: StorageSpec { size: "1Gi".into() },
                backup_schedule: None,
                image_name: None,
                failover_delay: None,
                synchronous: false,
                primary: None,
            };
            match Config::from_spec(&spec, fields) {
                Err(Error::Invalid(m)) => assert!(m.contains(why), "{m}"),
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn allowed_changes() {
        let running = config(3, "16.1", "10Gi", Some("0 2 * * *"));
        for wanted in [
            config(1, "16.1", "10Gi", None),
            config(7, "16.2", "10Gi", Some("@daily")),
            config(3, "16.0", "10240Mi", None),
        ] {
            assert_eq!(check(&wanted, Some(&running), V1), Ok(()), "{wanted:?}");
        }
        assert_eq!(check(&config(3, "17.0", "1Gi", None), None, V1), Ok(()));
    }

    #[test]
    fn refused_changes_say_why() {
        let running = config(3, "16.1", "1Gi", None);
        for (wanted, reason, why) in [
            (
                config(3, "17.0", "1Gi", None),
                "MajorVersionChange",
                "spec.version 17.0 is a major version change from 16.1",
            ),
            (
                config(3, "15.4", "1Gi", None),
                "MajorVersionChange",
                "set spec.version back to 16.x",
            ),
            (
                config(3, "16.1", "500Mi", None),
                "StorageShrink",
                "spec.storage.size 500Mi is smaller than 1Gi: a volume cannot shrink; set spec.storage.size back to 1Gi",
            ),
            (
                config(3, "16.1", "1000Mi", None),
                "StorageShrink",
                "spec.storage.size 1000Mi is smaller than 1Gi",
            ),
            (
                config(3, "16.1", "2G", None),
                "StorageChange",
                "spec.storage.size 2G is larger than 1Gi: a StatefulSet's volume claim templates cannot change",
            ),
            (
                config(3, "16.1", "1Gi", Some("0 25 * * *")),
                "InvalidSchedule",
                "hour field \"25\": 25 is out of range 0-23",
            ),
            (
                config(3, "16.1", "ten", None),
                "InvalidStorage",
                "spec.storage.size is not a valid size",
            ),
            (
                config(3, "12.4", "1Gi", None),
                "UnsupportedVersion",
                "PostgreSQL 13 and later",
            ),
        ] {
            let refusal = check(&wanted, Some(&running), V1).expect_err(reason);
            assert_eq!(refusal.reason, reason);
            assert!(refusal.message.contains(why), "{}", refusal.message);
            assert!(!refusal.message.contains('\n'), "{}", refusal.message);
        }
    }

    #[test]
    fn a_size_that_does_not_parse_before_counts_as_a_change() {
        let before = config(3, "16.1", "lots", None);
        let refusal = check(&config(3, "16.1", "1Gi", None), Some(&before), V1).unwrap_err();
        assert_eq!(refusal.reason, "StorageChange");
        assert!(
            refusal.message.contains("1Gi differs from lots"),
            "{}",
            refusal.message
        );
    }
}
