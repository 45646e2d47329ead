//! The cluster's credentials: generated once from the sandbox's random source when the
//! Secret is not among the observed children, and read back from the observed Secret on
//! every later reconcile, so that they never change.
//!
//! The passwords go into the Secret only: never into a log line, an event or the status.

use std::collections::BTreeMap;
use std::fmt;

use capstan_sdk::{Context, Error};
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::cluster::{Cluster, PORT};
use crate::observed;

/// The application role; it owns the application database.
pub const APP_USER: &str = "app";
/// The application database.
pub const APP_DATABASE: &str = "app";
/// The role standbys replicate as.
pub const REPLICATION_USER: &str = "replicator";
/// Length of generated passwords: 32 of [A-Za-z0-9], about 190 bits.
pub const PASSWORD_LENGTH: usize = 32;

/// Keys of the Secret.
pub mod keys {
    /// The application role.
    pub const USERNAME: &str = "username";
    /// Its password.
    pub const PASSWORD: &str = "password";
    /// The read-write Service's host name.
    pub const HOST: &str = "host";
    /// The port.
    pub const PORT: &str = "port";
    /// The application database.
    pub const DBNAME: &str = "dbname";
    /// `postgresql://user:password@host:port/dbname`.
    pub const URI: &str = "uri";
    /// The replication role.
    pub const REPLICATION_USERNAME: &str = "replication-username";
    /// Its password.
    pub const REPLICATION_PASSWORD: &str = "replication-password";
}

/// The two passwords. `Debug` does not show them.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    password: String,
    replication_password: String,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Credentials { .. }")
    }
}

impl Credentials {
    /// New random passwords.
    pub fn generate() -> Result<Self, Error> {
        Ok(Credentials {
            password: capstan_sdk::random::alphanumeric(PASSWORD_LENGTH)?,
            replication_password: capstan_sdk::random::alphanumeric(PASSWORD_LENGTH)?,
        })
    }

    /// The credentials in the observed Secret, or `None` when there is no such Secret.
    /// A Secret that is there but lacks a password is [`Error::Retry`]: generating new
    /// passwords would lock the application out, so a human has to look.
    pub fn observed(ctx: &Context, cluster: &Cluster) -> Result<Option<Self>, Error> {
        let name = cluster.credentials();
        let Some(secret) = observed::child::<Secret>(ctx, &name)? else {
            return Ok(None);
        };
        let data = secret.data.unwrap_or_default();
        let read = |key: &str| {
            data.get(key)
                .and_then(|v| String::from_utf8(v.0.clone()).ok())
                .filter(|v| !v.is_empty())
                .ok_or_else(|| {
                    Error::retry(format!(
                        "Secret {name} has no usable {key:?}: restore it, or delete the Secret to generate new credentials"
                    ))
                })
        };
        Ok(Some(Credentials {
            password: read(keys::PASSWORD)?,
            replication_password: read(keys::REPLICATION_PASSWORD)?,
        }))
    }

    /// The application role's password.
    pub fn password(&self) -> &str {
        &self.password
    }

    /// The Secret `<name>-credentials`. It carries `data` (base64), as the API server
    /// returns it, so that applying it again changes nothing.
    pub fn secret(&self, cluster: &Cluster) -> Secret {
        let host = cluster.read_write_host();
        let uri = format!(
            "postgresql://{APP_USER}:{}@{host}:{PORT}/{APP_DATABASE}",
            self.password
        );
        let data = [
            (keys::USERNAME, APP_USER.to_string()),
            (keys::PASSWORD, self.password.clone()),
            (keys::HOST, host),
            (keys::PORT, PORT.to_string()),
            (keys::DBNAME, APP_DATABASE.to_string()),
            (keys::URI, uri),
            (keys::REPLICATION_USERNAME, REPLICATION_USER.to_string()),
            (
                keys::REPLICATION_PASSWORD,
                self.replication_password.clone(),
            ),
        ];
        Secret {
            metadata: ObjectMeta {
                name: Some(cluster.credentials()),
                labels: Some(cluster.instance_labels()),
                ..Default::default()
            },
            type_: Some("Opaque".into()),
            data: Some(
                data.into_iter()
                    .map(|(k, v)| (k.to_string(), ByteString(v.into_bytes())))
                    .collect::<BTreeMap<_, _>>(),
            ),
            ..Default::default()
        }
    }
}
