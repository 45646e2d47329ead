//! The cluster's status: its phase and the `Ready` condition, judged from the observed
//! StatefulSet.

use k8s_openapi::api::apps::v1::StatefulSet;
use serde::{Deserialize, Serialize};

use crate::spec::Config;

/// `status.phase`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Phase {
    /// No instance is ready yet.
    Pending,
    /// Every instance is ready and the last rollout finished.
    Running,
    /// Some instances are ready, or a rollout is under way.
    Degraded,
    /// The spec cannot be applied; the cluster is left as it was.
    Failed,
}

impl Phase {
    /// The phase as written in the status.
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Pending => "Pending",
            Phase::Running => "Running",
            Phase::Degraded => "Degraded",
            Phase::Failed => "Failed",
        }
    }
}

/// The plugin's status fields; the host adds `observedGeneration` and `conditions`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterStatus {
    /// The phase.
    pub phase: Phase,
    /// Instances passing their readiness probe, from the StatefulSet.
    pub ready_replicas: i32,
    /// `<name>-rw.<namespace>.svc:5432`.
    pub primary_endpoint: String,
    /// The instance serving as primary, as far as readiness tells.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_primary: Option<String>,
    /// The primary of the topology's epoch: the instance that is or becomes primary.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_primary: Option<String>,
    /// The topology's epoch: each failover or switchover starts a new one (and the new
    /// primary a new PostgreSQL timeline).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch: Option<u64>,
    /// Since when the target primary has been seen not ready (the failover delay runs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub primary_not_ready_since: Option<String>,
    /// A former primary kept out of `-ro` until it is seen stepping down.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fencing: Option<String>,
    /// The target's `Ready` transition time when it was named: it serves as primary once
    /// its readiness has changed since (it was ready as a standby then).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_ready_transition: Option<String>,
    /// What each instance's agent last reported: role, timeline, WAL position and a
    /// standby's replay lag ([`crate::report`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub instances: Vec<crate::report::InstanceStatus>,
}

/// A judgement of the cluster: its phase and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assessment {
    /// The phase.
    pub phase: Phase,
    /// Ready instances.
    pub ready: i32,
    /// CamelCase reason of the `Ready` condition.
    pub reason: &'static str,
    /// Its message.
    pub message: String,
}

/// Ready instances of an observed StatefulSet.
pub fn ready_replicas(sts: Option<&StatefulSet>) -> i32 {
    sts.and_then(|s| s.status.as_ref())
        .and_then(|s| s.ready_replicas)
        .unwrap_or(0)
}

/// Judges a cluster whose spec is being applied. `running` is the configuration the
/// observed StatefulSet was built from: when it differs from `wanted`, the rollout of
/// `wanted` has not even started.
pub fn assess(sts: Option<&StatefulSet>, wanted: &Config, running: Option<&Config>) -> Assessment {
    let ready = ready_replicas(sts);
    let want = wanted.replicas;
    let Some(sts) = sts else {
        return Assessment {
            phase: Phase::Pending,
            ready,
            reason: "Creating",
            message: format!(
                "creating {want} instance(s) of PostgreSQL {}",
                wanted.version
            ),
        };
    };
    let up_to_date = running.is_some_and(|r| r.version == wanted.version && r.replicas == want);
    let rolled_out = up_to_date && rollout_finished(sts, want);
    if ready == 0 {
        return Assessment {
            phase: Phase::Pending,
            ready,
            reason: "NoInstanceReady",
            message: format!("0 of {want} instances ready"),
        };
    }
    if rolled_out && ready == want {
        return Assessment {
            phase: Phase::Running,
            ready,
            reason: "AllInstancesReady",
            message: format!(
                "{want} of {want} instances of PostgreSQL {} ready",
                wanted.version
            ),
        };
    }
    if !rolled_out {
        return Assessment {
            phase: Phase::Degraded,
            ready,
            reason: "RollingOut",
            message: format!(
                "rolling out {want} instance(s) of PostgreSQL {}; {ready} ready",
                wanted.version
            ),
        };
    }
    Assessment {
        phase: Phase::Degraded,
        ready,
        reason: "InstancesNotReady",
        message: format!("{ready} of {want} instances ready"),
    }
}

/// Whether the StatefulSet controller has seen the latest spec, has exactly `replicas`
/// pods (a scale-down is over) and every pod runs the latest revision.
fn rollout_finished(sts: &StatefulSet, replicas: i32) -> bool {
    let Some(status) = &sts.status else {
        return false;
    };
    let generation = sts.metadata.generation.unwrap_or(0);
    status.observed_generation.unwrap_or(0) >= generation
        && status.replicas == replicas
        && status.updated_replicas == Some(replicas)
        && status.current_revision.is_some()
        && status.current_revision == status.update_revision
}
