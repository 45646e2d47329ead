//! The errors of the cluster calls, and how the pipeline reacts to each (decided from
//! the HTTP status, never from a message).

use std::time::Duration;

/// Why a request to the API server did not do what the host asked.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The API server answered with an error status, or the request failed on its way.
    #[error("cannot {action}: {}", short(.source))]
    Api {
        /// What the host tried to do.
        action: String,
        /// kube's error, with the status code when the server answered.
        #[source]
        source: kube::Error,
    },
    /// This replica is not, or can no longer prove to be, the leader: nothing is written.
    #[error("cannot {action}: this replica is not the leader")]
    NotLeader {
        /// What the host tried to do.
        action: String,
    },
    /// The request got no answer within [`API_TIMEOUT`].
    #[error("cannot {action}: no answer from the API server within {timeout:?}")]
    Timeout {
        /// What the host tried to do.
        action: String,
        /// The timeout.
        timeout: Duration,
    },
}

/// How the pipeline reacts to an [`Error`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// Retrying the same request gives the same answer (400, 403, 404, 405, 422, …):
    /// report it on the parent and retry only at the resync period.
    Permanent,
    /// Someone else changed the object first (409): retry soon, report nothing.
    Conflict,
    /// The server is busy, failing or unreachable (429, 5xx, timeouts, transport):
    /// back off and retry; it says nothing about the parent, so `Ready` stays.
    Transient,
}

impl Error {
    /// The HTTP status the API server answered with, if it answered.
    pub fn code(&self) -> Option<u16> {
        match self {
            Error::Api {
                source: kube::Error::Api(status),
                ..
            } => Some(status.code),
            _ => None,
        }
    }

    /// How to react; decided from the status code, never from a message.
    pub fn class(&self) -> ErrorClass {
        match self {
            Error::Timeout { .. } | Error::NotLeader { .. } => ErrorClass::Transient,
            Error::Api { .. } => classify(self.code()),
        }
    }
}

/// The class of an API answer with status `code` (`None`: no answer).
pub fn classify(code: Option<u16>) -> ErrorClass {
    match code {
        Some(409) => ErrorClass::Conflict,
        Some(408 | 429) => ErrorClass::Transient,
        Some(400..=499) => ErrorClass::Permanent,
        _ => ErrorClass::Transient,
    }
}

/// Result of cluster calls.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A kube error without the noise of its debug form.
fn short(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(status) => {
            format!("{} ({}, {})", status.message, status.reason, status.code)
        }
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::operator::cluster::API_TIMEOUT;

    #[test]
    fn errors_are_classified_by_status_code() {
        assert_eq!(classify(Some(409)), ErrorClass::Conflict);
        for code in [400, 403, 404, 405, 410, 422] {
            assert_eq!(classify(Some(code)), ErrorClass::Permanent, "{code}");
        }
        for code in [408, 429, 500, 502, 503, 504] {
            assert_eq!(classify(Some(code)), ErrorClass::Transient, "{code}");
        }
        assert_eq!(classify(None), ErrorClass::Transient);
        let timeout = Error::Timeout {
            action: "apply".into(),
            timeout: API_TIMEOUT,
        };
        assert_eq!(timeout.class(), ErrorClass::Transient);
        assert_eq!(timeout.code(), None);
    }
}
