//! One PostgreSQLCluster's identity: its name and namespace, and the names and labels
//! of everything made for it.

use std::collections::BTreeMap;

use capstan_sdk::Error;

/// The port PostgreSQL listens on, in every pod and Service.
pub const PORT: u16 = 5432;

/// Longest cluster name: a CronJob's name (`<name>-dump`) may have 52 characters, and
/// `<name>-dumps` and the StatefulSet's revision labels must fit too.
pub const MAX_NAME: usize = 46;

/// The cluster's name and namespace, and the names derived from them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cluster {
    name: String,
    namespace: String,
}

impl Cluster {
    /// A cluster named `name` in `namespace`. The name becomes part of Service and
    /// StatefulSet names, hence a DNS label of at most [`MAX_NAME`] characters; another
    /// name is [`Error::Invalid`] (names cannot change, so the resource must be recreated).
    pub fn new(name: &str, namespace: &str) -> Result<Self, Error> {
        let label = name.len() <= MAX_NAME
            && name.starts_with(|c: char| c.is_ascii_lowercase())
            && !name.ends_with('-')
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        if !label {
            return Err(Error::invalid(format!(
                "metadata.name {name:?} cannot name the cluster's Services: use at most {MAX_NAME} lower-case letters, digits and '-', starting with a letter"
            )));
        }
        Ok(Cluster {
            name: name.into(),
            namespace: namespace.into(),
        })
    }

    /// The cluster's name; also the StatefulSet's, the headless Service's and the PDB's.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The cluster's namespace.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The Secret with the credentials.
    pub fn credentials(&self) -> String {
        format!("{}-credentials", self.name)
    }

    /// The ConfigMap with the scripts.
    pub fn scripts(&self) -> String {
        format!("{}-scripts", self.name)
    }

    /// The Service selecting the primary.
    pub fn read_write(&self) -> String {
        format!("{}-rw", self.name)
    }

    /// The Service selecting every ready instance.
    pub fn read(&self) -> String {
        format!("{}-r", self.name)
    }

    /// The CronJob of the logical dump.
    pub fn dump_job(&self) -> String {
        format!("{}-dump", self.name)
    }

    /// The PersistentVolumeClaim holding the dumps.
    pub fn dumps(&self) -> String {
        format!("{}-dumps", self.name)
    }

    /// The read-only Service: the standbys.
    pub fn read_only(&self) -> String {
        format!("{}-ro", self.name)
    }

    /// The ConfigMap the instances' agents follow: which one is the primary.
    pub fn topology(&self) -> String {
        format!("{}-topology", self.name)
    }

    /// The ConfigMap the instances' agents report to (see [`crate::report`]).
    pub fn reports(&self) -> String {
        format!("{}-report", self.name)
    }

    /// The instances' ServiceAccount, and the Role and RoleBinding that let it patch
    /// [`Cluster::reports`] and nothing else.
    pub fn agent(&self) -> String {
        format!("{}-instance", self.name)
    }

    /// The first primary: ordinal 0 of the StatefulSet.
    pub fn first_primary(&self) -> String {
        format!("{}-0", self.name)
    }

    /// The read-write Service's host name, valid from any namespace.
    pub fn read_write_host(&self) -> String {
        format!("{}.{}.svc", self.read_write(), self.namespace)
    }

    /// `host:port` of the read-write Service: `status.primaryEndpoint`.
    pub fn primary_endpoint(&self) -> String {
        format!("{}:{PORT}", self.read_write_host())
    }

    /// Labels of the instances' pods; also the StatefulSet's selector (immutable).
    pub fn instance_labels(&self) -> BTreeMap<String, String> {
        self.labels("postgresql")
    }

    /// Labels of the dump jobs' pods: distinct from the instances', so that no Service
    /// or disruption budget selects them.
    pub fn dump_labels(&self) -> BTreeMap<String, String> {
        self.labels("postgresql-dump")
    }

    fn labels(&self, app: &str) -> BTreeMap<String, String> {
        BTreeMap::from([
            ("app.kubernetes.io/name".into(), app.into()),
            ("app.kubernetes.io/instance".into(), self.name.clone()),
        ])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_derived_from_the_cluster() {
        let c = Cluster::new("pg", "prod").unwrap();
        assert_eq!(c.credentials(), "pg-credentials");
        assert_eq!(c.primary_endpoint(), "pg-rw.prod.svc:5432");
        assert_eq!(c.first_primary(), "pg-0");
        assert_eq!(c.topology(), "pg-topology");
        assert_eq!(c.read_only(), "pg-ro");
        assert_eq!(c.dump_job(), "pg-dump");
    }

    #[test]
    fn names_that_cannot_name_a_service_are_invalid() {
        assert!(Cluster::new(&"a".repeat(MAX_NAME), "ns").is_ok());
        for bad in ["", "1db", "db.prod", "DB", "db-", &"a".repeat(MAX_NAME + 1)] {
            match Cluster::new(bad, "ns") {
                Err(Error::Invalid(m)) => assert!(m.starts_with("metadata.name"), "{m}"),
                other => panic!("{bad:?}: {other:?}"),
            }
        }
    }
}
