//! Which instance is the primary: decided here from what the host observed, published
//! in the ConfigMap `<name>-topology` that every instance's agent follows
//! (`scripts/entrypoint.sh`).
//!
//! The topology has an **epoch**. Each new decision (a failover, a switchover) is a new
//! epoch, and an epoch's primary never changes once published:
//! - the ConfigMap is written with the `resourceVersion` it was observed at, so a
//!   decision taken on a stale cache fails (409) instead of overwriting a newer one, and
//!   when it was not observed at all it can only be created, never overwrite one;
//! - the agents adopt epochs in increasing order only, and keep the primary of an epoch
//!   they adopted, whatever a later file says.
//!
//! The primary is decided from the instance Pods' readiness, which the agent's readiness
//! probe ties to its role: a Pod is ready when postgres answers in the role of the epoch
//! it adopted. A standby named primary was ready as a standby; it is taken to serve as
//! the primary only once its `Ready` condition has changed since it was named (the agent
//! holds the promotion until its kubelet has seen it not ready). The agents do the rest
//! (fencing, catching up, promoting); see the script.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use k8s_openapi::jiff::Timestamp;

use crate::cluster::{Cluster, PORT};

/// The key of the ConfigMap, and the file the agents read.
pub const TOPOLOGY_KEY: &str = "topology";
/// How long the primary may be not ready before a standby is promoted, when the spec
/// does not say (`spec.failoverDelay`, seconds).
pub const DEFAULT_FAILOVER_DELAY: Duration = Duration::from_secs(10);
/// A resourceVersion no object has: an apply that carries it can only create.
pub const CREATE_ONLY: &str = "18446744073709551615";
/// How soon to look again while a decision waits for a standby to become ready.
pub const RETRY_WITHOUT_CANDIDATE: Duration = Duration::from_secs(5);
/// How much longer than the failover delay a primary that was never seen serving in its
/// epoch (a standby being promoted, or the first primary initializing) may take before
/// another is named: the kubelet must bring the new topology to every instance (within
/// its `syncFrequency`, one minute by default), and the standby must catch up first.
pub const PROMOTION_GRACE: Duration = Duration::from_secs(90);

/// The topology as the ConfigMap publishes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    /// The epoch.
    pub epoch: u64,
    /// The primary of the epoch, an instance (Pod) name.
    pub primary: String,
    /// The ConfigMap's resourceVersion.
    pub resource_version: Option<String>,
}

impl Published {
    /// Reads an observed ConfigMap; none when it holds no usable topology.
    pub fn of(config_map: &ConfigMap) -> Option<Self> {
        let text = config_map.data.as_ref()?.get(TOPOLOGY_KEY)?;
        let mut epoch = None;
        let mut primary = None;
        for line in text.lines() {
            match line.split_once('=') {
                Some(("epoch", v)) => epoch = v.trim().parse().ok(),
                Some(("primary", v)) => primary = Some(v.trim().to_string()),
                _ => {}
            }
        }
        Some(Published {
            epoch: epoch?,
            primary: primary.filter(|p| !p.is_empty())?,
            resource_version: config_map.metadata.resource_version.clone(),
        })
    }
}

/// An instance Pod as observed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Instance {
    /// Its `Ready` condition is `True`.
    pub ready: bool,
    /// Being deleted.
    pub terminating: bool,
    /// Its IP, once it has one.
    pub ip: Option<String>,
    /// Its UID.
    pub uid: Option<String>,
    /// The `lastTransitionTime` of its `Ready` condition, compared for equality only.
    pub ready_since: Option<String>,
}

impl Instance {
    /// Reads an observed Pod.
    pub fn of(pod: &Pod) -> Self {
        let status = pod.status.as_ref();
        let condition = status
            .and_then(|s| s.conditions.as_ref())
            .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"));
        Instance {
            ready: condition.is_some_and(|c| c.status == "True"),
            ready_since: condition
                .and_then(|c| c.last_transition_time.as_ref())
                .map(|t| t.0.to_string()),
            terminating: pod.metadata.deletion_timestamp.is_some(),
            ip: status
                .and_then(|s| s.pod_ip.clone())
                .filter(|ip| !ip.is_empty()),
            uid: pod.metadata.uid.clone(),
        }
    }

    /// Ready and not going away: it can serve, and be promoted. (Routed only once it
    /// has an IP.)
    pub fn serving(&self) -> bool {
        self.ready && !self.terminating
    }
}

/// The observed instance Pods, by name.
pub type Instances = BTreeMap<String, Instance>;

/// What the last reconcile recorded in the status.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Recorded {
    /// `status.epoch`.
    pub epoch: Option<u64>,
    /// `status.currentPrimary`.
    pub current_primary: Option<String>,
    /// `status.primaryNotReadySince`: since when `status.targetPrimary` was seen not ready.
    pub not_ready_since: Option<Timestamp>,
    /// `status.targetPrimary`, which `not_ready_since` is about.
    pub target_primary: Option<String>,
    /// `status.fencing`: a former primary kept out of the read Services until it is seen
    /// stepping down.
    pub fencing: Option<String>,
    /// `status.targetReadyTransition`: the target's `Ready` transition time when it was
    /// named; it serves as primary once that has changed.
    pub target_ready_transition: Option<String>,
}

/// What the spec asks of the topology.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wanted {
    /// `spec.instances`.
    pub instances: i32,
    /// `spec.failoverDelay`.
    pub failover_delay: Duration,
    /// `spec.synchronous`.
    pub synchronous: bool,
    /// `spec.primary`: the instance that should be primary (a switchover).
    pub primary: Option<String>,
}

/// Why the epoch changes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// The first topology of a cluster: instance 0.
    Created,
    /// The status has an epoch but no ConfigMap was observed: published again, under a
    /// new epoch and create-only, with the primary the status names.
    Republished,
    /// The primary was not ready for `not_ready_for`.
    Failover {
        /// The primary that was lost.
        from: String,
        /// The standby promoted.
        to: String,
        /// How long `from` was seen not ready.
        not_ready_for: Duration,
    },
    /// A planned handover.
    Switchover {
        /// The primary that steps down.
        from: String,
        /// The standby promoted.
        to: String,
        /// Why: `spec.primary` names `to`, or the primary is beyond `spec.instances`.
        requested: bool,
    },
}

/// The topology to publish, and what to tell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// The epoch to publish.
    pub epoch: u64,
    /// Its primary.
    pub primary: String,
    /// The resourceVersion the ConfigMap's write must find (see the module's doc).
    pub precondition: String,
    /// Why the epoch changed, when it did.
    pub change: Option<Change>,
    /// How many instances run: `spec.instances`, or more while the primary is beyond it.
    pub members: i32,
    /// Standbys that confirm each commit.
    pub synchronous: u32,
    /// Since when the primary has been seen not ready.
    pub not_ready_since: Option<Timestamp>,
    /// The instance serving as primary, as far as readiness tells.
    pub current_primary: Option<String>,
    /// A former primary kept out of the read Services.
    pub fencing: Option<String>,
    /// The target's `Ready` transition time when it was named, until it serves.
    pub target_ready_transition: Option<String>,
    /// When to look again, for a failover that may come.
    pub requeue: Option<Duration>,
    /// What the topology waits for, when it cannot do what it should.
    pub waiting: Option<String>,
}

/// The ordinal of an instance named `<cluster>-<n>`.
pub fn ordinal(cluster: &Cluster, name: &str) -> Option<i32> {
    name.strip_prefix(cluster.name())?
        .strip_prefix('-')?
        .parse()
        .ok()
}

/// Decides the topology. `now` is the host's clock; it is compared only with times this
/// function recorded itself (the status), never with another machine's.
pub fn decide(
    cluster: &Cluster,
    wanted: &Wanted,
    published: Option<&Published>,
    recorded: &Recorded,
    instances: &Instances,
    now: Timestamp,
) -> Decision {
    let Some(published) = published else {
        return unpublished(cluster, wanted, recorded);
    };
    let epoch = published.epoch;
    let primary = &published.primary;
    // Every write of an observed topology is a compare-and-swap on the version seen.
    let precondition = published
        .resource_version
        .clone()
        .unwrap_or_else(|| CREATE_ONLY.into());
    let serving = |name: &str| instances.get(name).is_some_and(Instance::serving);
    let within = |name: &str, count: i32| ordinal(cluster, name).is_some_and(|o| o < count);
    let members_for = |primary: &str| {
        let beyond = ordinal(cluster, primary).map_or(0, |o| o + 1);
        wanted.instances.max(beyond)
    };
    let fencing = recorded
        .fencing
        .clone()
        .filter(|f| f != primary && serving(f));
    // The primary serves once it was seen serving in this epoch, or once its readiness
    // changed since it was named (it was ready as a standby then).
    let confirmed = recorded.current_primary.as_deref() == Some(primary.as_str())
        || instances.get(primary).is_some_and(|i| {
            recorded.target_ready_transition.is_none()
                || i.ready_since != recorded.target_ready_transition
        });
    let primary_serving = serving(primary) && confirmed;
    let mut decision = Decision {
        epoch,
        primary: primary.clone(),
        precondition,
        change: None,
        members: members_for(primary),
        synchronous: 0,
        not_ready_since: None,
        current_primary: if primary_serving {
            Some(primary.clone())
        } else {
            recorded.current_primary.clone()
        },
        fencing,
        target_ready_transition: if primary_serving {
            None
        } else {
            recorded.target_ready_transition.clone()
        },
        requeue: None,
        waiting: None,
    };
    // A standby to promote: the one spec.primary names when it can serve, else the
    // lowest ordinal that serves, within the instances that stay.
    let candidate = |keep: i32| -> Option<String> {
        let named = wanted
            .primary
            .clone()
            .filter(|p| p != primary && within(p, keep) && serving(p));
        named.or_else(|| {
            (0..keep)
                .map(|o| format!("{}-{o}", cluster.name()))
                .find(|n| n != primary && serving(n))
        })
    };
    let promote = |decision: &mut Decision, to: String, change: Change| {
        decision.epoch = epoch + 1;
        decision.primary = to.clone();
        decision.members = members_for(&to).max(members_for(primary));
        decision.change = Some(change);
        decision.fencing = Some(primary.clone());
        decision.not_ready_since = None;
        decision.current_primary = recorded.current_primary.clone();
        decision.target_ready_transition = instances.get(&to).and_then(|i| i.ready_since.clone());
    };

    if primary_serving {
        // A planned handover: spec.primary, or a primary that scaling would remove.
        let requested = wanted.primary.as_ref().filter(|p| *p != primary);
        let leaving = !within(primary, wanted.instances);
        if requested.is_some() || leaving {
            match candidate(wanted.instances) {
                Some(to) if requested.is_none_or(|r| *r == to) => {
                    let change = Change::Switchover {
                        from: primary.clone(),
                        to: to.clone(),
                        requested: requested.is_some(),
                    };
                    promote(&mut decision, to, change);
                }
                _ => {
                    let to = requested.cloned().unwrap_or_else(|| "a standby".into());
                    decision.waiting = Some(format!(
                        "the switchover from {primary} to {to} waits for {to} to be ready"
                    ));
                    decision.requeue = Some(RETRY_WITHOUT_CANDIDATE);
                }
            }
        }
    } else {
        let since = match (&recorded.not_ready_since, &recorded.target_primary) {
            (Some(since), Some(target))
                if target == primary && recorded.epoch == Some(epoch) && *since <= now =>
            {
                *since
            }
            _ => now,
        };
        let not_ready_for = now.duration_since(since).unsigned_abs();
        // A primary not yet seen serving in this epoch is being promoted (or created).
        let promoting = recorded.current_primary.as_deref() != Some(primary.as_str());
        let delay = match promoting {
            true => wanted.failover_delay + PROMOTION_GRACE,
            false => wanted.failover_delay,
        };
        if not_ready_for >= delay {
            match candidate(decision.members) {
                Some(to) => {
                    let change = Change::Failover {
                        from: primary.clone(),
                        to: to.clone(),
                        not_ready_for,
                    };
                    promote(&mut decision, to, change);
                }
                None => {
                    decision.not_ready_since = Some(since);
                    decision.waiting = Some(format!(
                        "primary {primary} not ready for {}s and no standby is ready to take over",
                        not_ready_for.as_secs()
                    ));
                    decision.requeue = Some(RETRY_WITHOUT_CANDIDATE);
                }
            }
        } else {
            decision.not_ready_since = Some(since);
            decision.requeue = Some(delay - not_ready_for);
        }
    }
    decision.synchronous = synchronous_count(wanted.synchronous, decision.members);
    decision
}

/// No topology was observed: a new cluster gets epoch 1 with instance 0; a cluster whose
/// status has an epoch gets the status's primary under the next epoch. Either is
/// create-only, so an existing ConfigMap the cache did not show is never overwritten.
fn unpublished(cluster: &Cluster, wanted: &Wanted, recorded: &Recorded) -> Decision {
    let (epoch, primary, change) = match (recorded.epoch, &recorded.current_primary) {
        (Some(epoch), Some(primary)) if epoch > 0 => {
            (epoch + 1, primary.clone(), Change::Republished)
        }
        _ => (1, format!("{}-0", cluster.name()), Change::Created),
    };
    let members = wanted
        .instances
        .max(ordinal(cluster, &primary).map_or(0, |o| o + 1));
    Decision {
        epoch,
        primary,
        precondition: CREATE_ONLY.into(),
        change: Some(change),
        members,
        synchronous: synchronous_count(wanted.synchronous, members),
        not_ready_since: None,
        current_primary: recorded.current_primary.clone(),
        fencing: None,
        target_ready_transition: None,
        requeue: None,
        waiting: None,
    }
}

/// Standbys that must confirm each commit: a majority of the instances holds every
/// acknowledged commit (⌊n/2⌋ standbys and the primary), so that the agents can always
/// find it among the instances a failover leaves.
pub fn synchronous_count(synchronous: bool, members: i32) -> u32 {
    if synchronous {
        (members.max(0) / 2) as u32
    } else {
        0
    }
}

/// The text of the ConfigMap: what the agents read.
pub fn text(cluster: &Cluster, decision: &Decision) -> String {
    let mut text = format!(
        "# Written by the PostgreSQL plugin: the instances follow it. Do not edit.\n\
         epoch={}\nprimary={}\nsynchronous={}\n",
        decision.epoch, decision.primary, decision.synchronous
    );
    for o in 0..decision.members {
        let name = format!("{}-{o}", cluster.name());
        text.push_str(&format!("member={name} {name}.{} {PORT}\n", cluster.name()));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cluster() -> Cluster {
        Cluster::new("pg", "prod").unwrap()
    }

    fn wanted(instances: i32) -> Wanted {
        Wanted {
            instances,
            failover_delay: Duration::from_secs(10),
            synchronous: false,
            primary: None,
        }
    }

    fn published(epoch: u64, primary: &str) -> Published {
        Published {
            epoch,
            primary: primary.into(),
            resource_version: Some("42".into()),
        }
    }

    fn pods(ready: &[&str], not_ready: &[&str]) -> Instances {
        let pod = |name: &&str, ready: bool| {
            (
                name.to_string(),
                Instance {
                    ready,
                    terminating: false,
                    ip: Some(format!("10.0.0.{}", name.len())),
                    uid: Some(format!("uid-{name}")),
                    ready_since: Some("2026-01-01T00:00:00Z".into()),
                },
            )
        };
        ready
            .iter()
            .map(|n| pod(n, true))
            .chain(not_ready.iter().map(|n| pod(n, false)))
            .collect()
    }

    fn at(seconds: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + seconds).unwrap()
    }

    #[test]
    fn a_new_cluster_starts_with_instance_0_create_only() {
        let d = decide(
            &cluster(),
            &wanted(3),
            None,
            &Recorded::default(),
            &Instances::new(),
            at(0),
        );
        assert_eq!((d.epoch, d.primary.as_str()), (1, "pg-0"));
        assert_eq!(d.precondition, CREATE_ONLY);
        assert_eq!(d.change, Some(Change::Created));
        assert_eq!(d.members, 3);
        assert_eq!(
            text(&cluster(), &d),
            "# Written by the PostgreSQL plugin: the instances follow it. Do not edit.\n\
             epoch=1\nprimary=pg-0\nsynchronous=0\n\
             member=pg-0 pg-0.pg 5432\nmember=pg-1 pg-1.pg 5432\nmember=pg-2 pg-2.pg 5432\n"
        );
    }

    #[test]
    fn a_lost_config_map_is_republished_under_a_new_epoch_never_overwritten() {
        let recorded = Recorded {
            epoch: Some(4),
            current_primary: Some("pg-2".into()),
            ..Recorded::default()
        };
        let d = decide(
            &cluster(),
            &wanted(3),
            None,
            &recorded,
            &pods(&["pg-2"], &[]),
            at(0),
        );
        assert_eq!((d.epoch, d.primary.as_str()), (5, "pg-2"));
        assert_eq!(d.precondition, CREATE_ONLY);
        assert_eq!(d.change, Some(Change::Republished));
    }

    #[test]
    fn a_ready_primary_keeps_its_epoch_and_every_write_carries_the_observed_version() {
        let d = decide(
            &cluster(),
            &wanted(3),
            Some(&published(3, "pg-1")),
            &Recorded::default(),
            &pods(&["pg-0", "pg-1", "pg-2"], &[]),
            at(0),
        );
        assert_eq!((d.epoch, d.primary.as_str(), d.change), (3, "pg-1", None));
        assert_eq!(d.precondition, "42");
        assert_eq!(d.current_primary.as_deref(), Some("pg-1"));
        assert_eq!(d.requeue, None);
    }

    #[test]
    fn failover_waits_for_the_delay_measured_from_the_first_sighting() {
        let p = published(1, "pg-0");
        let all = pods(&["pg-1", "pg-2"], &["pg-0"]);
        // First seen not ready: the clock starts, and the plugin looks again in 10 s.
        let first = decide(
            &cluster(),
            &wanted(3),
            Some(&p),
            &Recorded {
                epoch: Some(1),
                current_primary: Some("pg-0".into()),
                ..Recorded::default()
            },
            &all,
            at(100),
        );
        assert_eq!(first.change, None);
        assert_eq!(first.not_ready_since, Some(at(100)));
        assert_eq!(first.requeue, Some(Duration::from_secs(10)));
        let recorded = Recorded {
            epoch: Some(1),
            current_primary: Some("pg-0".into()),
            not_ready_since: first.not_ready_since,
            target_primary: Some("pg-0".into()),
            ..Recorded::default()
        };
        let early = decide(&cluster(), &wanted(3), Some(&p), &recorded, &all, at(104));
        assert_eq!(early.change, None);
        assert_eq!(early.requeue, Some(Duration::from_secs(6)));
        // After the delay: the lowest ready standby, epoch 2, compare-and-swap.
        let late = decide(&cluster(), &wanted(3), Some(&p), &recorded, &all, at(110));
        assert_eq!(
            late.change,
            Some(Change::Failover {
                from: "pg-0".into(),
                to: "pg-1".into(),
                not_ready_for: Duration::from_secs(10)
            })
        );
        assert_eq!((late.epoch, late.primary.as_str()), (2, "pg-1"));
        assert_eq!(late.precondition, "42");
        assert_eq!(late.fencing.as_deref(), Some("pg-0"));
        assert_eq!(
            late.current_primary.as_deref(),
            Some("pg-0"),
            "until pg-1 is ready"
        );
    }

    #[test]
    fn a_primary_being_promoted_gets_the_grace_before_another_is_named() {
        let p = published(2, "pg-1");
        let all = pods(&["pg-2"], &["pg-0", "pg-1"]);
        // pg-1 was named (epoch 2) and has not been seen serving: current is still pg-0.
        let recorded = Recorded {
            epoch: Some(2),
            current_primary: Some("pg-0".into()),
            not_ready_since: Some(at(0)),
            target_primary: Some("pg-1".into()),
            fencing: Some("pg-0".into()),
            target_ready_transition: Some("2026-01-01T00:00:00Z".into()),
        };
        let d = decide(&cluster(), &wanted(3), Some(&p), &recorded, &all, at(30));
        assert_eq!(d.change, None);
        assert_eq!(
            d.requeue,
            Some(Duration::from_secs(10) + PROMOTION_GRACE - Duration::from_secs(30))
        );
        let d = decide(&cluster(), &wanted(3), Some(&p), &recorded, &all, at(100));
        assert_eq!(d.primary, "pg-2", "pg-1 never promoted: another is named");
        // Once seen serving, the plain delay applies.
        let serving = Recorded {
            current_primary: Some("pg-1".into()),
            ..recorded
        };
        let d = decide(&cluster(), &wanted(3), Some(&p), &serving, &all, at(10));
        assert_eq!(d.primary, "pg-2");
    }

    #[test]
    fn a_named_standby_serves_as_primary_once_its_readiness_changed() {
        let p = published(1, "pg-0");
        let recorded = Recorded {
            epoch: Some(1),
            current_primary: Some("pg-0".into()),
            not_ready_since: Some(at(0)),
            target_primary: Some("pg-0".into()),
            ..Recorded::default()
        };
        let all = pods(&["pg-1", "pg-2"], &["pg-0"]);
        let named = decide(&cluster(), &wanted(3), Some(&p), &recorded, &all, at(60));
        assert_eq!(named.primary, "pg-1");
        assert_eq!(
            named.target_ready_transition.as_deref(),
            Some("2026-01-01T00:00:00Z"),
            "pg-1's readiness as a standby"
        );
        let recorded = Recorded {
            epoch: Some(2),
            current_primary: named.current_primary.clone(),
            not_ready_since: None,
            target_primary: Some("pg-1".into()),
            fencing: named.fencing.clone(),
            target_ready_transition: named.target_ready_transition.clone(),
        };
        // Still ready since then: a standby that has not promoted; not the primary yet.
        let d = decide(
            &cluster(),
            &wanted(3),
            Some(&published(2, "pg-1")),
            &recorded,
            &all,
            at(61),
        );
        assert_eq!(d.current_primary.as_deref(), Some("pg-0"));
        assert_eq!(d.change, None, "it gets the promotion grace");
        assert!(d.not_ready_since.is_some());
        // Ready again after a change (it was not ready while it promoted): the primary.
        let mut promoted = all.clone();
        promoted.get_mut("pg-1").unwrap().ready_since = Some("2026-01-01T00:01:05Z".into());
        let d = decide(
            &cluster(),
            &wanted(3),
            Some(&published(2, "pg-1")),
            &recorded,
            &promoted,
            at(70),
        );
        assert_eq!(d.current_primary.as_deref(), Some("pg-1"));
        assert_eq!((d.target_ready_transition, d.not_ready_since), (None, None));
    }

    #[test]
    fn a_sighting_from_another_epoch_or_primary_does_not_count() {
        let p = published(2, "pg-1");
        let all = pods(&["pg-0", "pg-2"], &["pg-1"]);
        for recorded in [
            Recorded {
                epoch: Some(1),
                not_ready_since: Some(at(0)),
                target_primary: Some("pg-1".into()),
                ..Recorded::default()
            },
            Recorded {
                epoch: Some(2),
                not_ready_since: Some(at(0)),
                target_primary: Some("pg-0".into()),
                ..Recorded::default()
            },
            // A time after now (a clock that went back): starts again.
            Recorded {
                epoch: Some(2),
                not_ready_since: Some(at(500)),
                target_primary: Some("pg-1".into()),
                ..Recorded::default()
            },
        ] {
            let d = decide(&cluster(), &wanted(3), Some(&p), &recorded, &all, at(100));
            assert_eq!(d.change, None, "{recorded:?}");
            assert_eq!(d.not_ready_since, Some(at(100)));
        }
    }

    #[test]
    fn without_a_ready_standby_nothing_is_promoted() {
        let p = published(1, "pg-0");
        let recorded = Recorded {
            epoch: Some(1),
            current_primary: Some("pg-0".into()),
            not_ready_since: Some(at(0)),
            target_primary: Some("pg-0".into()),
            ..Recorded::default()
        };
        let mut terminating = pods(&["pg-1"], &["pg-0", "pg-2"]);
        terminating.get_mut("pg-1").unwrap().terminating = true;
        for instances in [
            pods(&[], &["pg-0", "pg-1", "pg-2"]),
            terminating,
            pods(&["pg-5"], &["pg-0"]),
        ] {
            let d = decide(
                &cluster(),
                &wanted(3),
                Some(&p),
                &recorded,
                &instances,
                at(60),
            );
            assert_eq!(d.change, None, "{instances:?}");
            assert_eq!(d.epoch, 1);
            assert!(
                d.waiting
                    .as_deref()
                    .unwrap()
                    .contains("no standby is ready"),
                "{d:?}"
            );
            assert_eq!(d.requeue, Some(RETRY_WITHOUT_CANDIDATE));
        }
    }

    #[test]
    fn spec_primary_is_preferred_for_a_failover_and_asks_for_a_switchover() {
        let mut w = wanted(3);
        w.primary = Some("pg-2".into());
        let recorded = Recorded {
            epoch: Some(1),
            current_primary: Some("pg-0".into()),
            not_ready_since: Some(at(0)),
            target_primary: Some("pg-0".into()),
            ..Recorded::default()
        };
        let lost = pods(&["pg-1", "pg-2"], &["pg-0"]);
        let d = decide(
            &cluster(),
            &w,
            Some(&published(1, "pg-0")),
            &recorded,
            &lost,
            at(60),
        );
        assert_eq!(d.primary, "pg-2");
        // With every instance ready, it is a switchover.
        let all = pods(&["pg-0", "pg-1", "pg-2"], &[]);
        let d = decide(
            &cluster(),
            &w,
            Some(&published(1, "pg-0")),
            &Recorded::default(),
            &all,
            at(0),
        );
        assert_eq!(
            d.change,
            Some(Change::Switchover {
                from: "pg-0".into(),
                to: "pg-2".into(),
                requested: true
            })
        );
        assert_eq!(d.epoch, 2);
        // Not before the target is ready.
        let d = decide(
            &cluster(),
            &w,
            Some(&published(1, "pg-0")),
            &Recorded::default(),
            &pods(&["pg-0", "pg-1"], &["pg-2"]),
            at(0),
        );
        assert_eq!(d.change, None);
        assert!(d.waiting.unwrap().contains("waits for pg-2"));
        // Once done, spec.primary is where the primary is: nothing more.
        let d = decide(
            &cluster(),
            &w,
            Some(&published(2, "pg-2")),
            &Recorded::default(),
            &all,
            at(0),
        );
        assert_eq!(d.change, None);
    }

    #[test]
    fn scaling_below_the_primary_hands_over_first_and_keeps_it_running_meanwhile() {
        let all = pods(&["pg-0", "pg-1", "pg-2"], &[]);
        let d = decide(
            &cluster(),
            &wanted(1),
            Some(&published(3, "pg-2")),
            &Recorded::default(),
            &all,
            at(0),
        );
        assert_eq!(
            d.change,
            Some(Change::Switchover {
                from: "pg-2".into(),
                to: "pg-0".into(),
                requested: false
            })
        );
        assert_eq!(d.members, 3, "pg-2 runs until it has stepped down");
        // pg-0 not ready: wait, all three kept.
        let d = decide(
            &cluster(),
            &wanted(1),
            Some(&published(3, "pg-2")),
            &Recorded::default(),
            &pods(&["pg-1", "pg-2"], &["pg-0"]),
            at(0),
        );
        assert_eq!(d.change, None);
        assert_eq!(d.members, 3);
        // Once pg-0 is primary, the others go.
        let d = decide(
            &cluster(),
            &wanted(1),
            Some(&published(4, "pg-0")),
            &Recorded::default(),
            &all,
            at(0),
        );
        assert_eq!((d.change, d.members), (None, 1));
    }

    #[test]
    fn synchronous_replication_asks_a_majority() {
        assert_eq!(
            (1..=7)
                .map(|n| synchronous_count(true, n))
                .collect::<Vec<_>>(),
            [0, 1, 1, 2, 2, 3, 3]
        );
        assert_eq!(synchronous_count(false, 3), 0);
    }

    #[test]
    fn a_former_primary_is_fenced_until_seen_stepping_down() {
        let recorded = Recorded {
            epoch: Some(2),
            fencing: Some("pg-0".into()),
            ..Recorded::default()
        };
        let p = published(2, "pg-1");
        let d = decide(
            &cluster(),
            &wanted(3),
            Some(&p),
            &recorded,
            &pods(&["pg-0", "pg-1"], &[]),
            at(0),
        );
        assert_eq!(d.fencing.as_deref(), Some("pg-0"));
        let d = decide(
            &cluster(),
            &wanted(3),
            Some(&p),
            &recorded,
            &pods(&["pg-1"], &["pg-0"]),
            at(0),
        );
        assert_eq!(d.fencing, None, "seen not ready: it stepped down");
    }

    #[test]
    fn published_topology_reads_back() {
        let cm: ConfigMap = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "pg-topology", "resourceVersion": "7"},
            "data": {"topology": "# x\nepoch=3\nprimary=pg-1\nsynchronous=1\nmember=pg-0 pg-0.pg 5432\n"},
        }))
        .unwrap();
        assert_eq!(
            Published::of(&cm),
            Some(Published {
                epoch: 3,
                primary: "pg-1".into(),
                resource_version: Some("7".into())
            })
        );
        let broken: ConfigMap = serde_json::from_value(
            serde_json::json!({"data": {"topology": "epoch=x\nprimary=pg-1\n"}}),
        )
        .unwrap();
        assert_eq!(Published::of(&broken), None);
    }
}
