//! Leader election on a `coordination.k8s.io` Lease, so that several replicas are safe:
//! only the holder of the lease runs controllers. Every write carries the Lease's
//! resourceVersion, so two candidates can never both believe they took it.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::Client;
use kube::api::{Api, PostParams};

/// Options of leader election.
#[derive(Debug, Clone)]
pub struct LeaderElectionOptions {
    /// Namespace of the Lease.
    pub namespace: String,
    /// Name of the Lease.
    pub name: String,
    /// This candidate's identity (the Pod's name in a cluster).
    pub identity: String,
    /// How long a lease lasts without renewal; the holder renews every third of it.
    pub lease_duration: Duration,
}

/// One candidate for the lease.
pub struct LeaseLock {
    api: Api<Lease>,
    opts: LeaderElectionOptions,
}

impl LeaseLock {
    /// A candidate with `opts`.
    pub fn new(client: Client, opts: LeaderElectionOptions) -> Self {
        LeaseLock {
            api: Api::namespaced(client, &opts.namespace),
            opts,
        }
    }

    /// The options.
    pub fn options(&self) -> &LeaderElectionOptions {
        &self.opts
    }

    /// Takes the lease if it is free or expired, renews it if held: returns whether this
    /// candidate holds it now. A conflicting write by another candidate is `Ok(false)`.
    pub async fn try_acquire_or_renew(&self) -> Result<bool, kube::Error> {
        let now = Timestamp::now();
        let duration_s = self.opts.lease_duration.as_secs().max(1) as i32;
        let Some(mut lease) = self.api.get_opt(&self.opts.name).await? else {
            let lease = Lease {
                metadata: kube::api::ObjectMeta {
                    name: Some(self.opts.name.clone()),
                    ..Default::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(self.opts.identity.clone()),
                    lease_duration_seconds: Some(duration_s),
                    acquire_time: Some(MicroTime(now)),
                    renew_time: Some(MicroTime(now)),
                    lease_transitions: Some(0),
                    ..Default::default()
                }),
            };
            return conflict_is_false(self.api.create(&PostParams::default(), &lease).await);
        };
        let spec = lease.spec.clone().unwrap_or_default();
        let mine = spec.holder_identity.as_deref() == Some(self.opts.identity.as_str());
        if !mine && !expired(&spec, now) {
            return Ok(false);
        }
        let transitions = spec.lease_transitions.unwrap_or(0) + i32::from(!mine);
        lease.spec = Some(LeaseSpec {
            holder_identity: Some(self.opts.identity.clone()),
            lease_duration_seconds: Some(duration_s),
            acquire_time: if mine {
                spec.acquire_time
            } else {
                Some(MicroTime(now))
            },
            renew_time: Some(MicroTime(now)),
            lease_transitions: Some(transitions),
            ..spec
        });
        conflict_is_false(
            self.api
                .replace(&self.opts.name, &PostParams::default(), &lease)
                .await,
        )
    }

    /// Gives the lease up (on shutdown), so another candidate takes over at once.
    pub async fn release(&self) -> Result<(), kube::Error> {
        let Some(mut lease) = self.api.get_opt(&self.opts.name).await? else {
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
    }
}

/// A lease is expired when no holder renewed it within its duration.
fn expired(spec: &LeaseSpec, now: Timestamp) -> bool {
    let (Some(holder), Some(renewed)) = (&spec.holder_identity, &spec.renew_time) else {
        return true;
    };
    if holder.is_empty() {
        return true;
    }
    let duration = SignedDuration::from_secs(i64::from(spec.lease_duration_seconds.unwrap_or(15)));
    renewed.0 + duration < now
}

fn conflict_is_false<T>(result: Result<T, kube::Error>) -> Result<bool, kube::Error> {
    match result {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_expires_after_its_duration_without_renewal() {
        let now = Timestamp::now();
        let spec = |holder: Option<&str>, ago: i64| LeaseSpec {
            holder_identity: holder.map(String::from),
            renew_time: Some(MicroTime(now - SignedDuration::from_secs(ago))),
            lease_duration_seconds: Some(10),
            ..Default::default()
        };
        assert!(!expired(&spec(Some("a"), 5), now));
        assert!(expired(&spec(Some("a"), 11), now));
        assert!(expired(&spec(None, 0), now), "released");
        assert!(expired(&spec(Some(""), 0), now), "released");
    }
}
