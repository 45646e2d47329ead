//! How a reconcile fails and how the host reacts: the failure's reason (the condition's
//! and the event's), whether it waits for a new spec, backs off or retries soon, and
//! the per-parent backoff.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::cluster::{self, ErrorClass};
use crate::contract::PluginError;
use crate::engine::{DecideError, ObserveError};
use crate::plugin::CallError;
use crate::validate::Violation;

/// A uniformly random number in [0, 1), for jitter (not for anything secret).
pub(super) fn random_fraction() -> f64 {
    fastrand::f64()
}

/// Longest backoff between two attempts of a failing parent.
const MAX_BACKOFF: Duration = Duration::from_secs(300);

/// Drops the failure counts of parents that have not failed for twice the longest
/// backoff: they succeeded since, or were deleted (the controller never reconciles a
/// parent that is gone, so nothing else would ever remove its entry).
fn forget_stale(failures: &mut HashMap<String, (u32, Instant)>, now: Instant) {
    failures.retain(|_, (_, last)| now.duration_since(*last) < MAX_BACKOFF * 2);
}

/// A reconcile that did not complete, and how the host reacts to it.
#[derive(Debug, thiserror::Error)]
pub enum Failure {
    /// The plugin said the spec is invalid: wait for a new generation.
    #[error("{0}")]
    InvalidSpec(String),
    /// `finalize` of a parent being deleted failed (the plugin said invalid or retry, or
    /// could not be called to the end). Nothing else would ever wake the parent up
    /// (its spec cannot change any more), so it is retried with backoff.
    #[error(
        "finalize failed: {0}; the deletion waits for it (annotate the parent \
         capstan.dev/force-release-finalizer=true to let it go without its cleanup)"
    )]
    FinalizeFailed(String),
    /// The plugin asked for a retry.
    #[error("{0}")]
    Retry(String),
    /// The plugin could not be called to the end (deadline, memory cap, trap).
    #[error(transparent)]
    Plugin(#[from] CallError),
    /// The plugin's output was refused; nothing was applied.
    #[error("plugin output refused: {0}")]
    InvalidOutput(#[from] Violation),
    /// The API server refused or failed a request.
    #[error(transparent)]
    Api(#[from] cluster::Error),
    /// A child kind's cache did not complete its first list in time.
    #[error("the cache of {0} is not synced yet")]
    CacheNotSynced(String),
}

/// What the host does after a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Reaction {
    /// Report it on the parent; wait for a change of the spec or of the plugin.
    ReportAndWait,
    /// Report it on the parent; retry with backoff.
    ReportAndBackoff,
    /// Report it on the parent; retry at the resync period (a permanent API answer,
    /// which a change elsewhere, such as RBAC, may still fix).
    ReportAndResync,
    /// Another writer was first: retry soon, the parent's condition stays as it is.
    RetrySoon,
    /// The API server is unwell: back off; the parent's condition stays as it is.
    Backoff,
}

impl Failure {
    /// CamelCase reason for the condition and the event.
    pub fn reason(&self) -> &'static str {
        match self {
            Failure::InvalidSpec(_) => "InvalidSpec",
            Failure::FinalizeFailed(_) => "FinalizeFailed",
            Failure::Retry(_) => "RetryRequested",
            Failure::Plugin(_) => "PluginFailed",
            Failure::InvalidOutput(_) => "InvalidPluginOutput",
            Failure::CacheNotSynced(_) => "CacheNotSynced",
            Failure::Api(e) => match e.class() {
                ErrorClass::Conflict => "Conflict",
                ErrorClass::Permanent => "ApplyFailed",
                ErrorClass::Transient => "ApiUnavailable",
            },
        }
    }

    pub(super) fn reaction(&self) -> Reaction {
        match self {
            Failure::InvalidSpec(_) | Failure::InvalidOutput(_) => Reaction::ReportAndWait,
            Failure::Retry(_) | Failure::Plugin(_) | Failure::FinalizeFailed(_) => {
                Reaction::ReportAndBackoff
            }
            Failure::CacheNotSynced(_) => Reaction::Backoff,
            Failure::Api(e) => match e.class() {
                ErrorClass::Permanent => Reaction::ReportAndResync,
                ErrorClass::Conflict => Reaction::RetrySoon,
                ErrorClass::Transient => Reaction::Backoff,
            },
        }
    }
}

impl From<ObserveError> for Failure {
    fn from(e: ObserveError) -> Self {
        match e {
            ObserveError::Call(e) => Failure::Plugin(e),
            ObserveError::Customize(e) => e.into(),
            ObserveError::Refused(v) => Failure::InvalidOutput(v),
            ObserveError::Source(m) => Failure::Retry(m),
        }
    }
}

impl From<DecideError> for Failure {
    fn from(e: DecideError) -> Self {
        match e {
            DecideError::Call(e) => Failure::Plugin(e),
            DecideError::Plugin(e) => e.into(),
            DecideError::Refused(v) => Failure::InvalidOutput(v),
        }
    }
}

impl From<PluginError> for Failure {
    fn from(e: PluginError) -> Self {
        match e {
            PluginError::Invalid(m) => Failure::InvalidSpec(m),
            PluginError::Retry(m) => Failure::Retry(m),
        }
    }
}

/// Consecutive failures per parent UID, with the time of the last one: exponential
/// backoff with jitter.
#[derive(Default)]
pub(super) struct Backoff(Mutex<HashMap<String, (u32, Instant)>>);

impl Backoff {
    /// Exponential backoff with jitter: 1 s, 2 s, 4 s … up to 5 min, times 0.5–1.0.
    pub(super) fn backoff(&self, uid: &str) -> Duration {
        let mut failures = self.0.lock().expect("failures lock");
        forget_stale(&mut failures, Instant::now());
        let (n, last) = failures
            .entry(uid.to_string())
            .or_insert((0, Instant::now()));
        *n = n.saturating_add(1);
        *last = Instant::now();
        let base = super::retry::nth(*n, Duration::from_secs(1), MAX_BACKOFF);
        base.mul_f64(0.5 + random_fraction() * 0.5)
    }

    /// Forgets the failures of `uid`: it succeeded.
    pub(super) fn succeeded(&self, uid: &str) {
        self.0.lock().expect("failures lock").remove(uid);
    }

    /// How many parents it counts failures for.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }
}

/// How soon a reconcile that raced another writer (409) runs again.
pub(super) const CONFLICT_RETRY: Duration = Duration::from_millis(500);

/// `d` stretched by a random 0–50 %, so that retries of many parents spread out.
pub(super) fn jittered(d: Duration) -> Duration {
    d.mul_f64(1.0 + random_fraction() * 0.5)
}

/// The HTTP status of an API failure, for the log.
pub(super) fn api_code(failure: &Failure) -> Option<u16> {
    match failure {
        Failure::Api(e) => e.code(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failure_counts_of_parents_quiet_for_long_are_forgotten() {
        let now = Instant::now();
        let mut failures = HashMap::from([
            ("recent".to_string(), (3, now - Duration::from_secs(60))),
            (
                "gone".to_string(),
                (9, now - MAX_BACKOFF * 2 - Duration::from_secs(1)),
            ),
        ]);
        forget_stale(&mut failures, now);
        assert_eq!(failures.keys().collect::<Vec<_>>(), ["recent"]);
    }

    #[test]
    fn api_failures_react_by_status_class() {
        let api = |code: u16| {
            Failure::Api(cluster::Error::Api {
                action: "apply".into(),
                source: kube::Error::Api(Box::new(
                    kube::core::Status::failure("m", "r").with_code(code),
                )),
            })
        };
        assert_eq!(api(422).reaction(), Reaction::ReportAndResync);
        assert_eq!(api(403).reaction(), Reaction::ReportAndResync);
        assert_eq!(api(409).reaction(), Reaction::RetrySoon);
        assert_eq!(api(429).reaction(), Reaction::Backoff);
        assert_eq!(api(503).reaction(), Reaction::Backoff);
        assert_eq!(api(409).reason(), "Conflict");
        assert_eq!(api(422).reason(), "ApplyFailed");
        assert_eq!(
            Failure::InvalidSpec("x".into()).reaction(),
            Reaction::ReportAndWait
        );
        assert_eq!(
            Failure::Retry("x".into()).reaction(),
            Reaction::ReportAndBackoff
        );
        // A parent being deleted has no spec change to wait for.
        let finalize = Failure::FinalizeFailed("invalid spec: no".into());
        assert_eq!(finalize.reaction(), Reaction::ReportAndBackoff);
        assert_eq!(finalize.reason(), "FinalizeFailed");
    }
}
