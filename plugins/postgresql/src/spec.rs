//! The PostgreSQLCluster spec, checked: the configuration the children are built from,
//! and the changes the plugin refuses to make to a running cluster.

use std::fmt;

use capstan_sdk::Error;
use serde::Deserialize;

use crate::cron;
use crate::quantity::Quantity;

/// Fewest instances.
pub const MIN_REPLICAS: i64 = 1;
/// Most instances.
pub const MAX_REPLICAS: i64 = 7;
/// Oldest PostgreSQL major version the scripts support (they set `wal_keep_size`).
pub const MIN_MAJOR: u32 = 13;
/// `spec.storage` when absent (the CRD defaults it too).
pub const DEFAULT_STORAGE: &str = "10Gi";

/// `spec` as users write it.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterSpec {
    /// Number of instances, 1–7.
    pub replicas: i64,
    /// PostgreSQL version, `major.minor`.
    pub version: String,
    /// Size of each instance's volume.
    #[serde(default = "default_storage")]
    pub storage: String,
    /// Cron schedule of the logical dump.
    #[serde(default)]
    pub backup_schedule: Option<String>,
}

fn default_storage() -> String {
    DEFAULT_STORAGE.into()
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
}

impl Config {
    /// The configuration the spec asks for. A spec the CRD would have refused (replicas
    /// out of range, a malformed version) is [`Error::Invalid`]; everything else is
    /// checked by [`check`], which explains refusals in the status.
    pub fn from_spec(spec: &ClusterSpec) -> Result<Self, Error> {
        if !(MIN_REPLICAS..=MAX_REPLICAS).contains(&spec.replicas) {
            return Err(Error::invalid(format!(
                "spec.replicas is {}; it must be between {MIN_REPLICAS} and {MAX_REPLICAS}",
                spec.replicas
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
        Ok(Config {
            replicas: spec.replicas as i32,
            version,
            storage: spec.storage.trim().into(),
            schedule,
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
        Refusal {
            reason,
            message: format!("{message}; nothing was changed"),
        }
    }
}

/// Checks that `wanted` can be applied over what is `running` (none: a new cluster).
pub fn check(wanted: &Config, running: Option<&Config>) -> Result<(), Refusal> {
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
            format!("spec.storage is not a valid size: {why}"),
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
    let Some(running) = running else {
        return Ok(());
    };
    if wanted.version.major() != running.version.major() {
        return Err(Refusal::new(
            "MajorVersionChange",
            format!(
                "spec.version {} is a major version change from the running {}: that needs pg_upgrade or a dump and restore, which this plugin does not do; set spec.version back to {}.x",
                wanted.version,
                running.version,
                running.version.major()
            ),
        ));
    }
    // What is running was accepted before, so it parses; a failure here means the
    // StatefulSet was edited by hand, and it then counts as a change.
    if Quantity::parse(&running.storage).ok() != Some(storage) {
        return Err(Refusal::new(
            "StorageChange",
            format!(
                "spec.storage {} differs from the {} the cluster was created with: a StatefulSet's volume claim templates cannot change; set spec.storage back to {}",
                wanted.storage, running.storage, running.storage
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(replicas: i32, version: &str, storage: &str, schedule: Option<&str>) -> Config {
        Config {
            replicas,
            version: Version::parse(version).unwrap(),
            storage: storage.into(),
            schedule: schedule.map(String::from),
        }
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
        let spec: ClusterSpec =
            serde_json::from_value(serde_json::json!({"replicas": 3, "version": "16.1"})).unwrap();
        let c = Config::from_spec(&spec).unwrap();
        assert_eq!(c, config(3, "16.1", "10Gi", None));
        let spec = ClusterSpec {
            backup_schedule: Some("  ".into()),
            ..spec
        };
        assert_eq!(Config::from_spec(&spec).unwrap().schedule, None);
    }

    #[test]
    fn specs_the_crd_refuses_are_invalid() {
        for (replicas, version, why) in [
            (0, "16.1", "spec.replicas is 0; it must be between 1 and 7"),
            (8, "16.1", "spec.replicas is 8"),
            (3, "16", "spec.version \"16\" is not major.minor"),
        ] {
            let spec = ClusterSpec {
                replicas,
                version: version.into(),
                storage: "1Gi".into(),
                backup_schedule: None,
            };
            match Config::from_spec(&spec) {
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
            assert_eq!(check(&wanted, Some(&running)), Ok(()), "{wanted:?}");
        }
        assert_eq!(check(&config(3, "17.0", "1Gi", None), None), Ok(()));
    }

    #[test]
    fn refused_changes_say_why() {
        let running = config(3, "16.1", "10Gi", None);
        for (wanted, reason, why) in [
            (
                config(3, "17.0", "10Gi", None),
                "MajorVersionChange",
                "spec.version 17.0 is a major version change from the running 16.1",
            ),
            (
                config(3, "15.4", "10Gi", None),
                "MajorVersionChange",
                "set spec.version back to 16.x",
            ),
            (
                config(3, "16.1", "20Gi", None),
                "StorageChange",
                "spec.storage 20Gi differs from the 10Gi",
            ),
            (
                config(3, "16.1", "10Gi", Some("0 25 * * *")),
                "InvalidSchedule",
                "hour field \"25\": 25 is out of range 0-23",
            ),
            (
                config(3, "16.1", "ten", None),
                "InvalidStorage",
                "spec.storage is not a valid size",
            ),
            (
                config(3, "12.4", "10Gi", None),
                "UnsupportedVersion",
                "PostgreSQL 13 and later",
            ),
        ] {
            let refusal = check(&wanted, Some(&running)).expect_err(reason);
            assert_eq!(refusal.reason, reason);
            assert!(refusal.message.contains(why), "{}", refusal.message);
            assert!(
                refusal.message.ends_with("; nothing was changed"),
                "{}",
                refusal.message
            );
        }
    }
}
