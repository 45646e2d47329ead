//! Leader election on a `coordination.k8s.io` Lease, so that several replicas are safe:
//! only the holder of the lease runs controllers, and a holder that cannot prove it
//! still holds the lease stops writing before anyone else may take it.
//!
//! The rules are client-go's:
//! - A candidate never compares the holder's `renewTime` with its own clock (clocks
//!   skew). It remembers when *it* last saw the record change, on its monotonic clock,
//!   and takes the lease over only when the record has not changed for a whole
//!   `lease_duration` since.
//! - The holder renews every `retry_period`; each attempt is bounded by the time left
//!   before its `renew_deadline` (shorter than the lease), so a half-open connection
//!   cannot keep it waiting. Past the deadline it is no longer leader.
//! - Every write of the reconcile pipeline first asks the [`WriteFence`]: it is open
//!   only until `renew_deadline` after the start of the last successful renewal. A
//!   process that was paused (SIGSTOP, a long GC-like stall) wakes up with the fence
//!   shut, whatever its tasks try first, because the fence reads the monotonic clock.
//!
//! Lease writes carry the resourceVersion read, so two candidates can never both
//! believe they took it.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, PostParams};
use tokio::time::Instant;

/// Options of leader election.
#[derive(Debug, Clone)]
pub struct LeaderElectionOptions {
    /// Namespace of the Lease.
    pub namespace: String,
    /// Name of the Lease.
    pub name: String,
    /// This candidate's identity (the Pod's name in a cluster).
    pub identity: String,
    /// How long other candidates wait, after they last saw the record change, before
    /// they take the lease over.
    pub lease_duration: Duration,
    /// How long the holder keeps leading without a successful renewal; shorter than
    /// `lease_duration`, so it stops before anyone else may start.
    pub renew_deadline: Duration,
    /// How often the holder renews and candidates try.
    pub retry_period: Duration,
}

impl LeaderElectionOptions {
    /// Options with client-go's proportions for a lease of `lease_duration`: renew
    /// deadline two thirds of it, retry period a seventh-and-a-half (15 s, 10 s, 2 s).
    pub fn new(namespace: &str, name: &str, identity: &str, lease_duration: Duration) -> Self {
        LeaderElectionOptions {
            namespace: namespace.into(),
            name: name.into(),
            identity: identity.into(),
            lease_duration,
            renew_deadline: lease_duration * 2 / 3,
            retry_period: (lease_duration * 2 / 15).max(Duration::from_millis(100)),
        }
    }
}

/// Whether this process may write: always without leader election; with it, only
/// until the renew deadline after the last successful renewal.
#[derive(Debug, Clone, Default)]
pub struct WriteFence {
    /// `None`: no leader election, always open. Else: open until this instant.
    until: Option<Arc<Mutex<Instant>>>,
}

impl WriteFence {
    /// A fence that starts shut and opens with each successful renewal of the lease.
    pub fn for_leader_election() -> Self {
        WriteFence {
            until: Some(Arc::new(Mutex::new(Instant::now()))),
        }
    }

    /// Whether writes are allowed now.
    pub fn is_open(&self) -> bool {
        match &self.until {
            None => true,
            Some(until) => Instant::now() < *until.lock().expect("fence lock"),
        }
    }

    /// Records a successful renewal that started at `started`.
    pub(super) fn renewed(&self, started: Instant, renew_deadline: Duration) {
        if let Some(until) = &self.until {
            *until.lock().expect("fence lock") = started + renew_deadline;
        }
    }

    /// The instant the fence shuts, if it can.
    pub(super) fn deadline(&self) -> Option<Instant> {
        self.until
            .as_ref()
            .map(|until| *until.lock().expect("fence lock"))
    }

    /// Whether the fence can shut at all (leader election or shard membership).
    pub fn can_shut(&self) -> bool {
        self.until.is_some()
    }

    /// Shuts the fence now (the lease was lost or given up).
    pub fn shut(&self) {
        if let Some(until) = &self.until {
            *until.lock().expect("fence lock") = Instant::now();
        }
    }
}

/// What a candidate remembers of the lease record: the record and when (on this
/// process's monotonic clock) it last saw it change.
#[derive(Debug, Clone)]
struct Observed {
    record: (Option<String>, Option<MicroTime>, Option<i32>),
    at: Instant,
}

/// One candidate for the lease.
pub struct LeaseLock {
    api: Api<Lease>,
    opts: LeaderElectionOptions,
    observed: Mutex<Option<Observed>>,
    fence: WriteFence,
}

/// Why a lease operation failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The API server refused or failed the request.
    #[error("lease request failed: {0}")]
    Api(#[source] kube::Error),
    /// The request got no answer in time.
    #[error("lease request got no answer within {0:?}")]
    Timeout(Duration),
}

impl LeaseLock {
    /// A candidate with `opts`, guarding writes through `fence`.
    pub fn new(client: Client, opts: LeaderElectionOptions, fence: WriteFence) -> Self {
        LeaseLock {
            api: Api::namespaced(client, &opts.namespace),
            opts,
            observed: Mutex::new(None),
            fence,
        }
    }

    /// The options.
    pub fn options(&self) -> &LeaderElectionOptions {
        &self.opts
    }

    /// Takes the lease if it is free or expired, renews it if held: returns whether this
    /// candidate holds it now. A conflicting write by another candidate is `Ok(false)`.
    /// The whole attempt is bounded by `timeout`.
    pub async fn try_acquire_or_renew(&self, timeout: Duration) -> Result<bool, Error> {
        let started = Instant::now();
        let held = tokio::time::timeout(timeout, self.attempt())
            .await
            .map_err(|_| Error::Timeout(timeout))??;
        if held {
            self.fence.renewed(started, self.opts.renew_deadline);
        }
        Ok(held)
    }

    async fn attempt(&self) -> Result<bool, Error> {
        let now = Timestamp::now();
        let duration_s = self.opts.lease_duration.as_secs().max(1) as i32;
        let Some(mut lease) = self
            .api
            .get_opt(&self.opts.name)
            .await
            .map_err(Error::Api)?
        else {
            let spec = LeaseSpec {
                holder_identity: Some(self.opts.identity.clone()),
                lease_duration_seconds: Some(duration_s),
                acquire_time: Some(MicroTime(now)),
                renew_time: Some(MicroTime(now)),
                lease_transitions: Some(0),
                ..Default::default()
            };
            let lease = Lease {
                metadata: kube::api::ObjectMeta {
                    name: Some(self.opts.name.clone()),
                    ..Default::default()
                },
                spec: Some(spec.clone()),
            };
            let created = conflict_is_false(self.api.create(&PostParams::default(), &lease).await)?;
            if created {
                self.observe(&spec, Instant::now());
            }
            return Ok(created);
        };
        let spec = lease.spec.clone().unwrap_or_default();
        let seen_at = self.observe(&spec, Instant::now());
        let mine = spec.holder_identity.as_deref() == Some(self.opts.identity.as_str());
        let free = spec.holder_identity.as_deref().is_none_or(str::is_empty);
        if !mine && !free && seen_at.elapsed() < self.opts.lease_duration {
            return Ok(false);
        }
        let transitions = spec.lease_transitions.unwrap_or(0) + i32::from(!mine);
        let next = LeaseSpec {
            holder_identity: Some(self.opts.identity.clone()),
            lease_duration_seconds: Some(duration_s),
            acquire_time: if mine {
                spec.acquire_time.clone()
            } else {
                Some(MicroTime(now))
            },
            renew_time: Some(MicroTime(now)),
            lease_transitions: Some(transitions),
            ..spec
        };
        lease.spec = Some(next.clone());
        let written = conflict_is_false(
            self.api
                .replace(&self.opts.name, &PostParams::default(), &lease)
                .await,
        )?;
        if written {
            self.observe(&next, Instant::now());
        }
        Ok(written)
    }

    fn observe(&self, spec: &LeaseSpec, now: Instant) -> Instant {
        observe(&self.observed, spec, now)
    }

    /// Gives the lease up (on shutdown), so another candidate takes over at once. The
    /// fence shuts first: nothing is written after the lease is released.
    pub async fn release(&self) -> Result<(), Error> {
        self.fence.shut();
        let timeout = self.opts.renew_deadline;
        tokio::time::timeout(timeout, async {
            let Some(mut lease) = self
                .api
                .get_opt(&self.opts.name)
                .await
                .map_err(Error::Api)?
            else {
                return Ok(());
            };
            let Some(spec) = lease.spec.as_mut() else {
                return Ok(());
            };
            if spec.holder_identity.as_deref() != Some(self.opts.identity.as_str()) {
                return Ok(());
            }
            spec.holder_identity = None;
            spec.renew_time = None;
            conflict_is_false(
                self.api
                    .replace(&self.opts.name, &PostParams::default(), &lease)
                    .await,
            )
            .map(|_| ())
        })
        .await
        .map_err(|_| Error::Timeout(timeout))?
    }

    /// Waits until this candidate holds the lease.
    pub async fn acquire(&self) {
        let o = &self.opts;
        tracing::info!(lease = %format!("{}/{}", o.namespace, o.name), identity = %o.identity, "waiting for the leader lease");
        loop {
            match self
                .try_acquire_or_renew(o.retry_period.max(o.renew_deadline / 2))
                .await
            {
                Ok(true) => break,
                Ok(false) => {}
                Err(e) => tracing::warn!("leader election: {e}"),
            }
            // Up to a fifth longer, so that standbys started together do not ask in step.
            tokio::time::sleep(o.retry_period.mul_f64(1.0 + fastrand::f64() * 0.2)).await;
        }
        tracing::info!(identity = %o.identity, "became the leader");
    }

    /// Renews the lease every retry period; returns (with the fence shut) once the lease
    /// went to another candidate or could not be renewed before the renew deadline.
    pub async fn hold(&self) -> Deposed {
        loop {
            tokio::time::sleep(self.opts.retry_period).await;
            let Some(deadline) = self.fence.deadline() else {
                return Deposed::NoFence;
            };
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                self.fence.shut();
                return Deposed::NotRenewed(self.opts.renew_deadline);
            }
            match self.try_acquire_or_renew(left).await {
                Ok(true) => {}
                Ok(false) => {
                    self.fence.shut();
                    return Deposed::TakenOver;
                }
                Err(e) => tracing::warn!("cannot renew the leader lease: {e}"),
            }
        }
    }
}

/// Why [`LeaseLock::hold`] stopped leading.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Deposed {
    /// The lock was made with a fence that never shuts ([`WriteFence::default`]): it
    /// could not keep anyone from writing, so it refuses to lead.
    #[error("leader election without a fence")]
    NoFence,
    /// No renewal succeeded within the renew deadline (the API server was unreachable,
    /// or this process was paused).
    #[error("could not renew the leader lease within {0:?}")]
    NotRenewed(Duration),
    /// Another candidate holds the lease now.
    #[error("lost the leader lease to another replica")]
    TakenOver,
}

/// Remembers `spec` in `observed` and returns when it was first seen as it is now.
fn observe(observed: &Mutex<Option<Observed>>, spec: &LeaseSpec, now: Instant) -> Instant {
    let record = (
        spec.holder_identity.clone(),
        spec.renew_time.clone(),
        spec.lease_transitions,
    );
    let mut observed = observed.lock().expect("observed lock");
    match observed.as_ref() {
        Some(o) if o.record == record => o.at,
        _ => {
            *observed = Some(Observed { record, at: now });
            now
        }
    }
}

fn conflict_is_false<T>(result: Result<T, kube::Error>) -> Result<bool, Error> {
    match result {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
        Err(e) => Err(Error::Api(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_go_proportions() {
        let o = LeaderElectionOptions::new("ns", "l", "me", Duration::from_secs(15));
        assert_eq!(o.renew_deadline, Duration::from_secs(10));
        assert_eq!(o.retry_period, Duration::from_secs(2));
        assert!(o.renew_deadline < o.lease_duration);
    }

    /// An instant `d` before now, as a process paused for `d` would see its last renewal.
    fn ago(d: Duration) -> Instant {
        Instant::now()
            .checked_sub(d)
            .expect("the monotonic clock is older than that")
    }

    #[test]
    fn the_fence_opens_on_renewal_and_shuts_at_the_renew_deadline() {
        let fence = WriteFence::for_leader_election();
        assert!(
            !fence.is_open(),
            "a candidate that never renewed may not write"
        );
        fence.renewed(ago(Duration::from_secs(9)), Duration::from_secs(10));
        assert!(fence.is_open());
        // Paused past the deadline (SIGSTOP): shut on waking, before any renewal.
        fence.renewed(ago(Duration::from_secs(11)), Duration::from_secs(10));
        assert!(!fence.is_open());
        fence.renewed(Instant::now(), Duration::from_secs(10));
        fence.shut();
        assert!(!fence.is_open());
        assert!(
            WriteFence::default().is_open(),
            "no leader election: always open"
        );
    }

    #[test]
    fn takeover_waits_a_lease_duration_from_when_the_record_last_changed() {
        // Only the local observation time counts, never the holder's renewTime: a
        // renewTime far in the future (a holder with a skewed clock) changes nothing.
        let seen = Mutex::new(None::<Observed>);
        let skewed = LeaseSpec {
            holder_identity: Some("other".into()),
            renew_time: Some(MicroTime(
                Timestamp::now() + k8s_openapi::jiff::SignedDuration::from_hours(5),
            )),
            lease_transitions: Some(1),
            ..Default::default()
        };
        let first = observe(&seen, &skewed, ago(Duration::from_secs(16)));
        let later = observe(&seen, &skewed, Instant::now());
        assert_eq!(
            later, first,
            "an unchanged record keeps its first observation time"
        );
        assert!(
            later.elapsed() >= Duration::from_secs(15),
            "expired by the local clock"
        );
        let renewed = LeaseSpec {
            renew_time: Some(MicroTime(Timestamp::now())),
            ..skewed
        };
        let again = observe(&seen, &renewed, Instant::now());
        assert!(
            again.elapsed() < Duration::from_secs(1),
            "a renewal restarts the wait"
        );
    }
}

/// `LeaseLock` against the fake API server (no control plane). Time is not waited for:
/// a candidate's memory of when it saw the record change is aged instead, as if that much
/// time had passed.
#[cfg(test)]
mod fake_api_tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use http::Method;
    use serde_json::{Value, json};

    use super::super::fake_api::{self, Call, Calls};
    use super::*;

    /// One Lease kept as the API server keeps it: a create of an existing one and a
    /// replace with a stale resourceVersion fail with 409.
    #[derive(Clone, Default)]
    struct LeaseServer {
        lease: Arc<Mutex<Option<Value>>>,
        /// Every request fails with 503.
        down: Arc<AtomicBool>,
        /// Another writer changes the Lease just before the next replace.
        race_next_replace: Arc<AtomicBool>,
    }

    impl LeaseServer {
        fn answer(&self, call: &Call) -> (u16, Value) {
            if self.down.load(Ordering::SeqCst) {
                return fake_api::status(503, "ServiceUnavailable", "down");
            }
            let mut lease = self.lease.lock().unwrap();
            let version = |l: &Value| l["metadata"]["resourceVersion"].clone();
            match (&call.method, lease.as_mut()) {
                (&Method::GET, Some(l)) => (200, l.clone()),
                (&Method::GET, None) => fake_api::status(404, "NotFound", "no lease"),
                (&Method::POST, Some(_)) => fake_api::status(409, "AlreadyExists", "exists"),
                (&Method::POST, None) => {
                    let mut created = call.body.clone();
                    created["metadata"]["resourceVersion"] = json!("1");
                    *lease = Some(created.clone());
                    (201, created)
                }
                (&Method::PUT, Some(current)) => {
                    if self.race_next_replace.swap(false, Ordering::SeqCst) {
                        current["metadata"]["resourceVersion"] = json!("100");
                    }
                    if version(&call.body) != version(current) {
                        return fake_api::status(409, "Conflict", "the object has been modified");
                    }
                    let next: u64 = current["metadata"]["resourceVersion"]
                        .as_str()
                        .and_then(|v| v.parse().ok())
                        .expect("a numeric resourceVersion");
                    let mut replaced = call.body.clone();
                    replaced["metadata"]["resourceVersion"] = json!((next + 1).to_string());
                    *current = replaced.clone();
                    (200, replaced)
                }
                _ => fake_api::status(405, "MethodNotAllowed", "unexpected"),
            }
        }

        fn spec(&self, field: &str) -> Value {
            let lease = self.lease.lock().unwrap();
            lease.as_ref().expect("a lease")["spec"][field].clone()
        }

        fn holder(&self) -> Option<String> {
            self.spec("holderIdentity").as_str().map(str::to_owned)
        }

        /// A candidate named `identity` talking to this server, retrying every 10 ms.
        fn candidate(&self, identity: &str) -> (LeaseLock, WriteFence, Calls) {
            let server = self.clone();
            let (client, calls) = fake_api::client(move |call| server.answer(call));
            let fence = WriteFence::for_leader_election();
            let mut opts = LeaderElectionOptions::new("ns", "capstan", identity, LEASE);
            opts.retry_period = Duration::from_millis(10);
            (LeaseLock::new(client, opts, fence.clone()), fence, calls)
        }
    }

    const LEASE: Duration = Duration::from_secs(15);
    const TIMEOUT: Duration = Duration::from_secs(5);

    /// As if `by` had passed since `lock` last saw the record change.
    fn age(lock: &LeaseLock, by: Duration) {
        let mut observed = lock.observed.lock().unwrap();
        let o = observed.as_mut().expect("an observation");
        o.at = o.at.checked_sub(by).expect("the monotonic clock is older");
    }

    fn writes(calls: &Calls) -> Vec<Call> {
        calls
            .all()
            .into_iter()
            .filter(|c| c.method != Method::GET)
            .collect()
    }

    #[tokio::test]
    async fn a_free_lease_is_created_then_renewed_and_the_fence_follows() {
        let server = LeaseServer::default();
        let (a, fence, calls) = server.candidate("a");
        let deadline = a.options().renew_deadline;
        assert!(!fence.is_open());
        let before = Instant::now();
        assert!(a.try_acquire_or_renew(TIMEOUT).await.unwrap());
        assert_eq!(
            calls.summary(),
            [
                "GET /apis/coordination.k8s.io/v1/namespaces/ns/leases/capstan",
                "POST /apis/coordination.k8s.io/v1/namespaces/ns/leases",
            ]
        );
        assert_eq!(server.holder().as_deref(), Some("a"));
        assert_eq!(server.spec("leaseTransitions"), 0);
        assert_eq!(server.spec("leaseDurationSeconds"), 15);
        assert!(fence.is_open());
        let opened = fence.deadline().unwrap();
        assert!(opened >= before + deadline && opened <= Instant::now() + deadline);

        let before = Instant::now();
        assert!(a.try_acquire_or_renew(TIMEOUT).await.unwrap(), "renewed");
        let renewal = writes(&calls).pop().unwrap();
        assert_eq!(renewal.method, Method::PUT);
        assert_eq!(
            renewal.body["metadata"]["resourceVersion"], "1",
            "a compare-and-swap on the version read"
        );
        assert_eq!(renewal.body["spec"]["holderIdentity"], "a");
        assert_eq!(
            server.spec("leaseTransitions"),
            0,
            "a renewal is no transition"
        );
        let moved = fence.deadline().unwrap();
        assert!(
            moved >= before + deadline && moved >= opened,
            "each renewal moves the fence to the renew deadline after its start"
        );
    }

    #[tokio::test]
    async fn another_candidate_takes_over_only_a_lease_duration_after_the_last_change() {
        let server = LeaseServer::default();
        let (a, _, _) = server.candidate("a");
        let (b, b_fence, b_calls) = server.candidate("b");
        assert!(a.try_acquire_or_renew(TIMEOUT).await.unwrap());
        assert!(!b.try_acquire_or_renew(TIMEOUT).await.unwrap(), "held by a");
        // b saw the record long ago; a renews just before b looks again.
        age(&b, LEASE * 2);
        assert!(a.try_acquire_or_renew(TIMEOUT).await.unwrap());
        assert!(
            !b.try_acquire_or_renew(TIMEOUT).await.unwrap(),
            "a renewal restarts the wait, whatever b saw before"
        );
        age(&b, LEASE - Duration::from_secs(1));
        assert!(!b.try_acquire_or_renew(TIMEOUT).await.unwrap(), "not yet");
        assert!(
            writes(&b_calls).is_empty(),
            "b wrote nothing while a held the lease"
        );
        assert!(!b_fence.is_open());

        // a stops renewing (paused, partitioned): b takes over a lease duration later.
        age(&b, Duration::from_secs(1));
        assert!(
            b.try_acquire_or_renew(TIMEOUT).await.unwrap(),
            "b takes over"
        );
        assert_eq!(server.holder().as_deref(), Some("b"));
        assert_eq!(server.spec("leaseTransitions"), 1);
        assert!(b_fence.is_open());
        let takeover = writes(&b_calls).pop().unwrap();
        assert_eq!(
            takeover.method,
            Method::PUT,
            "a compare-and-swap, not a create"
        );

        // a, back, sees b's fresh record and writes nothing.
        let before = server.lease.lock().unwrap().clone();
        assert!(!a.try_acquire_or_renew(TIMEOUT).await.unwrap());
        assert_eq!(*server.lease.lock().unwrap(), before, "a changed nothing");
    }

    #[tokio::test]
    async fn a_holder_that_finds_another_holder_stops_at_once() {
        let server = LeaseServer::default();
        let (a, fence, _) = server.candidate("a");
        assert!(a.try_acquire_or_renew(TIMEOUT).await.unwrap());
        // Handed to b by someone else (say, an administrator's edit) while a's fence is
        // open: a stops leading at its next renewal, long before its renew deadline.
        server.lease.lock().unwrap().as_mut().unwrap()["spec"]["holderIdentity"] = json!("b");
        assert!(fence.is_open());
        assert_eq!(a.hold().await, Deposed::TakenOver);
        assert!(!fence.is_open());
        assert_eq!(server.holder().as_deref(), Some("b"), "and left it to b");
    }

    #[tokio::test]
    async fn a_write_that_races_another_loses_the_lease_instead_of_taking_it() {
        let server = LeaseServer::default();
        let (a, fence, _) = server.candidate("a");
        assert!(a.try_acquire_or_renew(TIMEOUT).await.unwrap());
        let opened_until = fence.deadline();
        server.race_next_replace.store(true, Ordering::SeqCst);
        assert!(
            !a.try_acquire_or_renew(TIMEOUT).await.unwrap(),
            "409: not held"
        );
        assert_eq!(
            fence.deadline(),
            opened_until,
            "a lost race does not move the fence"
        );
    }

    #[tokio::test]
    async fn the_holder_stops_at_the_renew_deadline_when_it_cannot_renew() {
        let server = LeaseServer::default();
        let (mut a, fence, calls) = server.candidate("a");
        // A short lease, so that the renew deadline passes in this test.
        a.opts.renew_deadline = Duration::from_millis(100);
        assert!(a.try_acquire_or_renew(TIMEOUT).await.unwrap());
        let until = fence.deadline().unwrap();
        server.down.store(true, Ordering::SeqCst);
        let deposed = a.hold().await;
        assert_eq!(deposed, Deposed::NotRenewed(a.options().renew_deadline));
        assert!(!fence.is_open());
        assert!(
            Instant::now() >= until,
            "led until the renew deadline, not less"
        );
        assert!(
            calls.all().len() > 3,
            "it kept trying to renew until then: {:?}",
            calls.summary()
        );
    }

    #[tokio::test]
    async fn a_released_lease_is_taken_at_once_and_the_fence_shuts_first() {
        let server = LeaseServer::default();
        let (a, a_fence, _) = server.candidate("a");
        let (b, _, _) = server.candidate("b");
        assert!(a.try_acquire_or_renew(TIMEOUT).await.unwrap());
        assert!(!b.try_acquire_or_renew(TIMEOUT).await.unwrap());
        a.release().await.unwrap();
        assert!(!a_fence.is_open());
        assert_eq!(server.holder(), None);
        assert!(
            b.try_acquire_or_renew(TIMEOUT).await.unwrap(),
            "a free lease needs no wait"
        );
        assert_eq!(server.holder().as_deref(), Some("b"));
    }
}
