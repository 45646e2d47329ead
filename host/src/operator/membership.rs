//! Membership of `capstan run --shards`: each replica holds its own Lease in the shard
//! group, renews it, and publishes on it the buckets it claims ([`Buckets`]). The live
//! members split the buckets evenly ([`fair_share`]); a replica starts serving a bucket
//! only once no other live member claims it, and stops serving a bucket before it
//! withdraws its claim. docs/deploy.md gives the timing argument; in short:
//!
//! - *Claim, then look*: to take buckets, a replica writes its claim (with the renewal)
//!   and then lists the group's Leases again (a quorum read); it serves only the
//!   buckets nobody else claims in that second list. Of two replicas claiming the same
//!   bucket, the one that writes second reads after the first one's write, so at most
//!   one of them serves it (both may back off; they try again on the next round).
//! - *Stop, then withdraw*: a bucket leaves the claim only after its controllers have
//!   stopped, so a claim always covers what a replica serves.
//! - *Expiry as in leader election*: a Lease whose record has not changed for a whole
//!   `lease_duration` on the observer's monotonic clock is dead and its claim void. Its
//!   owner's [`WriteFence`] shut `renew_deadline` (< `lease_duration`) after the start of
//!   its last successful renewal, and a replica whose fence shut stops serving
//!   everything before it renews again, so it claims afresh like a newcomer.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, Preconditions};
use serde_json::json;
use tokio::time::Instant;

use super::leader::WriteFence;
use crate::shard::{Buckets, fair_share};

/// The label that makes a Lease a member of a shard group.
pub const SHARD_GROUP_LABEL: &str = "capstan.dev/shard-group";
/// The annotation with a member's claimed buckets ([`Buckets::to_hex`]).
pub const SHARD_CLAIM_ANNOTATION: &str = "capstan.dev/shard-claim";
/// The field manager of membership Leases.
const FIELD_MANAGER: &str = "capstan-shards";

/// Options of shard membership.
#[derive(Debug, Clone)]
pub struct ShardOptions {
    /// Namespace of the membership Leases.
    pub namespace: String,
    /// The group: replicas of one group share the parents.
    pub group: String,
    /// This replica's identity (the Pod's name in a cluster).
    pub identity: String,
    /// How long after a member's Lease last changed the others consider it gone.
    pub lease_duration: Duration,
    /// How long a member keeps writing without a successful renewal; shorter than
    /// `lease_duration`.
    pub renew_deadline: Duration,
    /// How often members renew and rebalance.
    pub retry_period: Duration,
}

impl ShardOptions {
    /// Options with client-go's proportions for a lease of `lease_duration` (as
    /// [`super::LeaderElectionOptions::new`]).
    pub fn new(namespace: &str, group: &str, identity: &str, lease_duration: Duration) -> Self {
        ShardOptions {
            namespace: namespace.into(),
            group: group.into(),
            identity: identity.into(),
            lease_duration,
            renew_deadline: lease_duration * 2 / 3,
            retry_period: (lease_duration * 2 / 15).max(Duration::from_millis(100)),
        }
    }

    /// The name of this member's Lease: group and identity, as a DNS subdomain.
    pub fn lease_name(&self) -> String {
        let raw = format!("{}-{}", self.group, self.identity).to_ascii_lowercase();
        let name: String = raw
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                    c
                } else {
                    '-'
                }
            })
            .collect();
        name.trim_matches(|c: char| !c.is_ascii_alphanumeric())
            .chars()
            .take(253)
            .collect()
    }
}

/// Why a membership request failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The API server refused or failed the request.
    #[error("membership request failed: {0}")]
    Api(#[source] kube::Error),
    /// The request got no answer in time.
    #[error("membership request got no answer within {0:?}")]
    Timeout(Duration),
}

/// One member as the last list showed it.
#[derive(Debug, Clone)]
pub struct Member {
    /// Its identity (holder of its Lease).
    pub identity: String,
    /// The buckets it claims.
    pub claim: Buckets,
    /// Whether it counts: this replica, or a Lease that changed within a lease duration.
    pub live: bool,
    /// Its Lease's name and resourceVersion.
    lease: (String, Option<String>),
    /// How long its Lease has been unchanged, on this process's clock.
    unchanged_for: Duration,
}

/// The group as one list of its Leases showed it.
#[derive(Debug, Clone)]
pub struct View {
    me: String,
    members: Vec<Member>,
}

impl View {
    /// The live members' identities, this replica's always among them.
    pub fn live_members(&self) -> Vec<&str> {
        let mut live: Vec<&str> = self
            .members
            .iter()
            .filter(|m| m.live)
            .map(|m| m.identity.as_str())
            .collect();
        live.push(self.me.as_str());
        live.sort_unstable();
        live.dedup();
        live
    }

    /// The buckets due to this replica among the live members.
    pub fn fair_share(&self) -> Buckets {
        fair_share(&self.live_members(), &self.me)
    }

    /// What the other live members claim.
    pub fn claimed_by_others(&self) -> Buckets {
        self.members
            .iter()
            .filter(|m| m.live && m.identity != self.me)
            .fold(Buckets::NONE, |all, m| all.or(m.claim))
    }
}

/// What a member remembers of another's Lease: the record and when it last changed.
#[derive(Debug, Clone)]
struct Observed {
    record: (Option<String>, Option<MicroTime>, Option<String>),
    at: Instant,
}

/// This replica's membership in its shard group.
pub struct Membership {
    api: Api<Lease>,
    opts: ShardOptions,
    lease_name: String,
    observed: Mutex<HashMap<String, Observed>>,
    fence: WriteFence,
}

impl Membership {
    /// The membership of `opts.identity`; its renewals open `fence`.
    pub fn new(client: Client, opts: ShardOptions, fence: WriteFence) -> Self {
        Membership {
            api: Api::namespaced(client, &opts.namespace),
            lease_name: opts.lease_name(),
            opts,
            observed: Mutex::new(HashMap::new()),
            fence,
        }
    }

    /// The options.
    pub fn options(&self) -> &ShardOptions {
        &self.opts
    }

    /// The fence this membership opens.
    pub fn fence(&self) -> &WriteFence {
        &self.fence
    }

    /// Lists the group's Leases (a quorum read) and judges which members are live.
    pub async fn view(&self, timeout: Duration) -> Result<View, Error> {
        let lp = ListParams::default().labels(&format!("{SHARD_GROUP_LABEL}={}", self.opts.group));
        let leases = tokio::time::timeout(timeout, self.api.list(&lp))
            .await
            .map_err(|_| Error::Timeout(timeout))?
            .map_err(Error::Api)?;
        let now = Instant::now();
        let mut observed = self.observed.lock().expect("observed lock");
        let mut seen = HashMap::new();
        let mut members = Vec::new();
        for lease in leases {
            let name = lease.metadata.name.clone().unwrap_or_default();
            let spec = lease.spec.clone().unwrap_or_default();
            let claim_text = lease
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(SHARD_CLAIM_ANNOTATION))
                .cloned();
            let record = (
                spec.holder_identity.clone(),
                spec.renew_time.clone(),
                claim_text.clone(),
            );
            let at = match observed.get(&name) {
                Some(o) if o.record == record => o.at,
                _ => now,
            };
            seen.insert(name.clone(), Observed { record, at });
            let Some(identity) = spec.holder_identity.filter(|h| !h.is_empty()) else {
                continue;
            };
            let unchanged_for = now.saturating_duration_since(at);
            members.push(Member {
                live: identity == self.opts.identity || unchanged_for < self.opts.lease_duration,
                identity,
                // A claim this version cannot read is taken as everything: safe.
                claim: claim_text
                    .as_deref()
                    .map_or(Some(Buckets::NONE), Buckets::from_hex)
                    .unwrap_or(Buckets::ALL),
                lease: (name, lease.metadata.resource_version.clone()),
                unchanged_for,
            });
        }
        *observed = seen;
        Ok(View {
            me: self.opts.identity.clone(),
            members,
        })
    }

    /// Renews this member's Lease with `claim`, within `timeout`; on success the fence
    /// stays open until `renew_deadline` after the start of this renewal.
    pub async fn renew(&self, claim: Buckets, timeout: Duration) -> Result<(), Error> {
        let started = Instant::now();
        let lease = json!({
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": self.lease_name,
                "labels": { SHARD_GROUP_LABEL: self.opts.group },
                "annotations": { SHARD_CLAIM_ANNOTATION: claim.to_hex() },
            },
            "spec": {
                "holderIdentity": self.opts.identity,
                "leaseDurationSeconds": self.opts.lease_duration.as_secs().max(1),
                "renewTime": MicroTime(Timestamp::now()),
            },
        });
        let params = PatchParams::apply(FIELD_MANAGER).force();
        tokio::time::timeout(
            timeout,
            self.api
                .patch(&self.lease_name, &params, &Patch::Apply(&lease)),
        )
        .await
        .map_err(|_| Error::Timeout(timeout))?
        .map_err(Error::Api)?;
        self.fence.renewed(started, self.opts.renew_deadline);
        Ok(())
    }

    /// Leaves the group (on shutdown, after every controller stopped): the fence shuts
    /// and the Lease is deleted, so that the others take the buckets over at once.
    pub async fn leave(&self) -> Result<(), Error> {
        self.fence.shut();
        let timeout = self.opts.renew_deadline;
        match tokio::time::timeout(
            timeout,
            self.api.delete(&self.lease_name, &DeleteParams::default()),
        )
        .await
        {
            Err(_) => Err(Error::Timeout(timeout)),
            Ok(Ok(_)) => Ok(()),
            Ok(Err(kube::Error::Api(s))) if s.code == 404 => Ok(()),
            Ok(Err(e)) => Err(Error::Api(e)),
        }
    }

    /// Deletes the Leases of members gone for ten lease durations (replicas that were
    /// killed and replaced leave one each), each only at the version judged dead.
    pub async fn forget_the_long_gone(&self, view: &View) {
        for m in &view.members {
            if m.live || m.unchanged_for < self.opts.lease_duration * 10 {
                continue;
            }
            let dp = DeleteParams {
                preconditions: Some(Preconditions {
                    resource_version: m.lease.1.clone(),
                    uid: None,
                }),
                ..DeleteParams::default()
            };
            match self.api.delete(&m.lease.0, &dp).await {
                Ok(_) => {
                    tracing::info!(member = %m.identity, "deleted the Lease of a member long gone")
                }
                Err(e) => tracing::debug!(member = %m.identity, "cannot delete its Lease: {e}"),
            }
        }
    }
}

/// What one round of membership decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Round {
    /// The buckets to serve from now on.
    pub serve: Buckets,
    /// The buckets to claim with the next renewal.
    pub claim: Buckets,
}

/// Before the renewal: what to keep serving (the fair share of what is served) and what
/// to claim (that, plus the rest of the fair share that no other live member claims).
pub fn before_renewal(serving: Buckets, view: &View) -> Round {
    let share = view.fair_share();
    let keep = serving.and(share);
    let free = share.minus(view.claimed_by_others());
    Round {
        serve: keep,
        claim: keep.or(free),
    }
}

/// After the renewal published `claim`, and a second list: what to serve, the claimed
/// buckets no other live member claims now.
pub fn after_renewal(serving: Buckets, claim: Buckets, second: &View) -> Buckets {
    serving.or(claim.minus(second.claimed_by_others()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(me: &str, members: &[(&str, Buckets, bool)]) -> View {
        View {
            me: me.into(),
            members: members
                .iter()
                .map(|(id, claim, live)| Member {
                    identity: (*id).into(),
                    claim: *claim,
                    live: *live,
                    lease: (format!("g-{id}"), None),
                    unchanged_for: Duration::ZERO,
                })
                .collect(),
        }
    }

    #[test]
    fn a_lone_member_takes_everything() {
        let v = view("a", &[]);
        let r = before_renewal(Buckets::NONE, &v);
        assert_eq!(r.serve, Buckets::NONE, "nothing is served before the claim");
        assert_eq!(r.claim, Buckets::ALL);
        assert_eq!(after_renewal(r.serve, r.claim, &v), Buckets::ALL);
    }

    #[test]
    fn a_member_waits_for_the_holder_to_withdraw() {
        // b joins while a serves everything: b claims its half but serves none of it
        // while a's claim covers it.
        let a_all = view("b", &[("a", Buckets::ALL, true)]);
        let r = before_renewal(Buckets::NONE, &a_all);
        assert_eq!(r.claim, Buckets::NONE);
        // a sees b: it stops serving b's half before it withdraws its claim.
        let a_view = view("a", &[("b", Buckets::NONE, true)]);
        let ra = before_renewal(Buckets::ALL, &a_view);
        assert_eq!(ra.serve, Buckets::range(0, 32));
        assert_eq!(ra.claim, Buckets::range(0, 32));
        // Then b claims and serves its half.
        let withdrawn = view("b", &[("a", Buckets::range(0, 32), true)]);
        let rb = before_renewal(Buckets::NONE, &withdrawn);
        assert_eq!(rb.claim, Buckets::range(32, 64));
        assert_eq!(
            after_renewal(rb.serve, rb.claim, &withdrawn),
            Buckets::range(32, 64)
        );
    }

    #[test]
    fn two_claims_of_one_bucket_never_both_serve() {
        // a and b disagree on the membership (c is seen by a only), so their shares
        // overlap; each published its claim, then listed: whoever lists second sees
        // the other's claim, and the first may see it too. In no order do both serve.
        let a_claim = Buckets::range(0, 21);
        let b_claim = Buckets::range(0, 32);
        let b_saw_a = view("b", &[("a", a_claim, true)]);
        let a_saw_b = view("a", &[("b", b_claim, true)]);
        let a_saw_nothing = view("a", &[("b", Buckets::NONE, true)]);
        let b_serves = after_renewal(Buckets::NONE, b_claim, &b_saw_a);
        let a_serves = after_renewal(Buckets::NONE, a_claim, &a_saw_b);
        assert!(a_serves.and(b_serves).is_empty());
        let a_first = after_renewal(Buckets::NONE, a_claim, &a_saw_nothing);
        assert!(a_first.and(b_serves).is_empty());
    }

    #[test]
    fn a_dead_members_claim_is_void() {
        let v = view(
            "b",
            &[("a", Buckets::ALL, false), ("c", Buckets::NONE, true)],
        );
        assert_eq!(v.live_members(), vec!["b", "c"]);
        let r = before_renewal(Buckets::NONE, &v);
        assert_eq!(r.claim, Buckets::range(0, 32));
    }

    #[test]
    fn lease_names_are_dns_subdomains() {
        let o = ShardOptions::new("ns", "capstan", "Host_1:42", Duration::from_secs(15));
        assert_eq!(o.lease_name(), "capstan-host-1-42");
        assert_eq!(o.renew_deadline, Duration::from_secs(10));
    }
}
