//! The PostgreSQLCluster plugin: reconciles seed 004's `PostgreSQLCluster`
//! (`db.example.com`, short name `pgc`) into a primary and streaming standbys.
//!
//! Each cluster gets a credentials Secret (passwords generated once), a ConfigMap with
//! the instances' scripts, a topology ConfigMap naming the primary ([`topology`]), a
//! headless Service, a read-write Service (the primary) and a read-only one (the
//! standbys) whose EndpointSlices the plugin writes, a read Service (every ready
//! instance), a StatefulSet, a PodDisruptionBudget with more than one instance, and with
//! `backupSchedule` a CronJob writing logical dumps to the claim `<name>-dumps`. It
//! watches the instance Pods (related objects) and fails over when the primary stays
//! not ready. See docs/postgresql.md.
//!
//! Two versions: seed 004's `v1alpha1` and `v1` (CloudNativePG's `instances` and
//! `storage.size`); [`convert`] converts between them losslessly and reconcile reads
//! either through it. It reconciles `v1`, the CRD's storage version, and serves the CRD's
//! conversion webhook through the host with [`convert`].
//!
//! A change the plugin cannot make to a running cluster (a major version, the storage
//! size, an invalid schedule) is refused at admission ([`admission`]) and, should one
//! get through, by reconcile: the phase turns Failed with a reason, a Warning event is
//! posted, and every child is returned exactly as the observed ones were built, so the
//! host changes nothing and prunes nothing. Deletion tears the cluster down in waves
//! ([`teardown`]).

#![forbid(unsafe_code)]

pub mod admission;
pub mod cluster;
pub mod convert;
pub mod credentials;
pub mod cron;
pub mod manifests;
pub mod observed;
pub mod quantity;
pub mod report;
pub mod spec;
pub mod status;
pub mod teardown;
pub mod topology;

use std::time::{Duration, SystemTime};

use capstan_sdk::prelude::*;
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::batch::v1::CronJob;
use k8s_openapi::api::core::v1::{
    ConfigMap, PersistentVolumeClaim, Pod, Secret, Service, ServiceAccount,
};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::jiff::Timestamp;
use serde_json::Value;

use crate::cluster::Cluster;
use crate::convert::Version as ApiVersion;
use crate::credentials::Credentials;
use crate::manifests::Children;
use crate::observed::Running;
use crate::report::Reports;
use crate::spec::{ClusterSpec, Config, Refusal};
use crate::status::{Assessment, ClusterStatus, Phase};
use crate::topology::{Change, Decision, Instance, Instances, Published, Recorded};

/// The CRD of `PostgreSQLCluster`, from `crds/postgresqlcluster.yaml`.
pub const CRD_JSON: &str = include_str!(concat!(env!("OUT_DIR"), "/crd.json"));

/// How soon to look again while the cluster is not Running, so the phase converges
/// even when no child changes.
pub const REQUEUE_WHILE_CONVERGING: Duration = Duration::from_secs(10);

/// The scripts the instances and the dump job run, shipped in the ConfigMap
/// `<name>-scripts`. They read everything from the environment, so the plugin's tests
/// run the very same text against PostgreSQL on loopback.
pub mod scripts {
    /// File name of the instances' entrypoint.
    pub const ENTRYPOINT_FILE: &str = "entrypoint.sh";
    /// The instances' entrypoint: initdb or pg_basebackup, then postgres.
    pub const ENTRYPOINT: &str = include_str!("../scripts/entrypoint.sh");
    /// File name of the dump script.
    pub const DUMP_FILE: &str = "dump.sh";
    /// The dump job's script: pg_dump, then keep the newest dumps.
    pub const DUMP: &str = include_str!("../scripts/dump.sh");
}

/// The plugin.
pub struct PostgresPlugin;

impl Plugin for PostgresPlugin {
    fn describe() -> PluginInfo {
        PluginInfo::new(
            "postgresql",
            env!("CARGO_PKG_VERSION"),
            KindRef::namespaced(
                convert::GROUP,
                ApiVersion::V1.name(),
                "PostgreSQLCluster",
                "postgresqlclusters",
            ),
        )
        .child(KindRef::of::<Secret>())
        .child(KindRef::of::<ConfigMap>())
        .child(KindRef::of::<Service>())
        .child(KindRef::of::<StatefulSet>())
        .child(KindRef::of::<PodDisruptionBudget>())
        .child(KindRef::of::<CronJob>())
        .child(KindRef::of::<PersistentVolumeClaim>())
        .child(KindRef::of::<EndpointSlice>())
        .child(KindRef::of::<ServiceAccount>())
        .child(KindRef::of::<Role>())
        .child(KindRef::of::<RoleBinding>())
        .related(KindRef::of::<Pod>())
        .crd_json(CRD_JSON)
        .with_finalizer()
        .validates(FailurePolicy::Fail)
        .converts()
    }

    fn customize(ctx: &Context) -> Result<Vec<Related>, Error> {
        let cluster = Cluster::new(ctx.name(), ctx.namespace())?;
        Ok(vec![Related::labelled::<Pod>(cluster.instance_labels())])
    }

    fn reconcile(ctx: &Context) -> Result<Desired, Error> {
        let cluster = Cluster::new(ctx.name(), ctx.namespace())?;
        // Either version, read as v1 through the same conversion as the webhook's.
        let (spec, fields) = ClusterSpec::of(ctx.parent())?;
        let wanted = Config::from_spec(&spec, fields)?;
        let running = Running::observe(ctx, &cluster)?;
        let checked = spec::check(&wanted, running.config.as_ref(), fields);
        // The instances the topology spans: what the spec asks, or what runs while a
        // refused spec is kept from it.
        let instances = match (&running.config, &checked) {
            (Some(running), Err(_)) => running.replicas,
            _ => wanted.replicas,
        };
        let topology = Topology::observe(ctx, &cluster, &spec, instances)?;
        match checked {
            Ok(()) => {
                // The size is the same (checked), but keep the spelling it was created
                // with: the claim template stays byte-for-byte as it is.
                let wanted = match &running.config {
                    Some(before) => Config {
                        storage: before.storage.clone(),
                        ..wanted
                    },
                    None => wanted,
                };
                apply(ctx, &cluster, &wanted, &running, &topology)
            }
            Err(refusal) => refuse(ctx, &cluster, refusal, &running, &topology),
        }
    }

    fn finalize(ctx: &Context) -> Result<Finalized, Error> {
        Ok(teardown::next_wave(ctx))
    }

    fn validate(old: Option<&Value>, new: &Value) -> Result<Vec<String>, String> {
        admission::validate(old, new)
    }

    fn convert(object: Value, to_version: &str) -> Result<Value, String> {
        convert::convert(object, to_version)
    }
}

/// The spec can be applied: every child built from it, and the phase it has reached.
fn apply(
    ctx: &Context,
    cluster: &Cluster,
    wanted: &Config,
    running: &Running,
    topology: &Topology,
) -> Result<Desired, Error> {
    let mut desired = Desired::new();
    let credentials = credentials_for(ctx, cluster, &mut desired)?;
    Children::build(
        cluster,
        wanted,
        credentials.secret(cluster),
        running.dumps_storage.as_deref(),
        &topology.decision,
        &topology.instances,
    )
    .add_to(&mut desired)?;
    topology.announce(&mut desired);

    if let Some(before) = &running.config {
        if before.version != wanted.version {
            desired.event(Event::normal(
                "VersionChanged",
                format!(
                    "rolling the instances from PostgreSQL {} to {}",
                    before.version, wanted.version
                ),
            ));
        }
        if before.replicas != wanted.replicas {
            desired.event(Event::normal(
                "Scaled",
                format!(
                    "scaling from {} to {} instance(s)",
                    before.replicas, wanted.replicas
                ),
            ));
        }
    }
    let assessment = topology.assess(status::assess(
        running.statefulset.as_ref(),
        wanted,
        running.config.as_ref(),
    ));
    report(ctx, cluster, &assessment, topology, &mut desired)?;
    let converging = (assessment.phase != Phase::Running).then_some(REQUEUE_WHILE_CONVERGING);
    if let Some(after) = [converging, topology.decision.requeue]
        .into_iter()
        .flatten()
        .min()
    {
        desired.requeue_after(after);
    }
    Ok(desired)
}

/// The spec cannot be applied: every child as it was, phase Failed, and a Warning.
fn refuse(
    ctx: &Context,
    cluster: &Cluster,
    refusal: Refusal,
    running: &Running,
    topology: &Topology,
) -> Result<Desired, Error> {
    let mut desired = Desired::new();
    match &running.config {
        Some(config) => {
            // What runs goes on running, failovers included.
            let credentials = credentials_for(ctx, cluster, &mut desired)?;
            Children::build(
                cluster,
                config,
                credentials.secret(cluster),
                running.dumps_storage.as_deref(),
                &topology.decision,
                &topology.instances,
            )
            .add_to(&mut desired)?;
            topology.announce(&mut desired);
        }
        None => {
            // Nothing runs yet, so nothing is created; what holds data stays.
            if let Some(credentials) = Credentials::observed(ctx, cluster)? {
                desired.child(&credentials.secret(cluster))?;
            }
            if let Some(size) = &running.dumps_storage {
                desired.child(&manifests::dumps_claim(cluster, size))?;
            }
        }
    }
    let assessment = Assessment {
        phase: Phase::Failed,
        ready: status::ready_replicas(running.statefulset.as_ref()),
        reason: refusal.reason,
        message: format!("{}; nothing was changed", refusal.message),
    };
    report(ctx, cluster, &assessment, topology, &mut desired)?;
    if let Some(after) = topology.decision.requeue {
        desired.requeue_after(after);
    }
    Ok(desired)
}

/// The topology decided for this reconcile, the instance Pods it was decided from, and
/// what the instances last reported.
pub struct Topology {
    /// What to publish.
    pub decision: Decision,
    /// The instance Pods, by name.
    pub instances: Instances,
    /// The agents' reports (shown, never decided on).
    pub reports: Reports,
}

impl Topology {
    /// Decides from the observed topology ConfigMap, the instance Pods and the status.
    /// The instances are those the spec asks for, or those that run while a refused
    /// spec is kept from them.
    fn observe(
        ctx: &Context,
        cluster: &Cluster,
        spec: &ClusterSpec,
        replicas: i32,
    ) -> Result<Self, Error> {
        let instances: Instances = ctx
            .related::<Pod>()
            .iter()
            .filter_map(|pod| {
                let name = pod.metadata.name.clone()?;
                topology::ordinal(cluster, &name)?;
                Some((name, Instance::of(pod)))
            })
            .collect();
        let published = observed::child::<ConfigMap>(ctx, &cluster.topology())?
            .as_ref()
            .and_then(Published::of);
        let primary = spec
            .primary
            .as_deref()
            .map(str::trim)
            .filter(|p| !p.is_empty());
        if let Some(p) = primary
            && topology::ordinal(cluster, p).is_none_or(|o| o >= replicas)
        {
            return Err(Error::invalid(format!(
                "spec.primary {p:?} is not an instance of this cluster: name one of {}-0 to {}-{}",
                cluster.name(),
                cluster.name(),
                replicas - 1
            )));
        }
        let wanted = topology::Wanted {
            instances: replicas,
            failover_delay: spec
                .failover_delay
                .map_or(topology::DEFAULT_FAILOVER_DELAY, Duration::from_secs),
            synchronous: spec.synchronous,
            primary: primary.map(String::from),
        };
        let decision = topology::decide(
            cluster,
            &wanted,
            published.as_ref(),
            &recorded(ctx.parent()),
            &instances,
            now(),
        );
        Ok(Topology {
            decision,
            instances,
            reports: Reports::observe(ctx, cluster, replicas)?,
        })
    }

    /// Events for a new epoch.
    fn announce(&self, desired: &mut Desired) {
        let d = &self.decision;
        match &d.change {
            Some(Change::Failover {
                from,
                to,
                not_ready_for,
            }) => {
                let standbys: Vec<&str> = self
                    .instances
                    .keys()
                    .map(String::as_str)
                    .filter(|name| name != from)
                    .collect();
                desired.event(Event::warning(
                    "Failover",
                    format!(
                        "primary {from} not ready for {}s: promoting {to} (epoch {}); it catches up with the most advanced standby first; {}",
                        not_ready_for.as_secs(),
                        d.epoch,
                        self.reports.positions(&standbys)
                    ),
                ));
            }
            Some(Change::Switchover {
                from,
                to,
                requested,
            }) => {
                let why = if *requested {
                    "spec.primary names it"
                } else {
                    "the primary is beyond spec.instances"
                };
                desired.event(Event::normal(
                    "Switchover",
                    format!(
                        "handing the primary role from {from} to {to} (epoch {}): {why}; {}",
                        d.epoch,
                        self.reports.positions(&[from.as_str(), to.as_str()])
                    ),
                ));
            }
            Some(Change::Republished) => {
                desired.event(Event::warning(
                    "TopologyRepublished",
                    format!(
                        "the topology ConfigMap was missing: published again with primary {} (epoch {})",
                        d.primary, d.epoch
                    ),
                ));
            }
            Some(Change::Created) | None => {}
        }
    }

    /// The ready standbys the serving primary reports more than
    /// [`report::LAG_LIMIT`] behind, in one line, if any.
    fn lagging(&self) -> Option<String> {
        let d = &self.decision;
        let primary = d.current_primary.as_deref().filter(|p| *p == d.primary)?;
        let lagging: Vec<String> = self
            .reports
            .lagging(primary)
            .into_iter()
            .filter(|(name, _)| self.instances.get(name).is_some_and(Instance::serving))
            .map(|(name, lag)| format!("{name} replays {} behind {primary}", report::bytes(lag)))
            .collect();
        (!lagging.is_empty()).then(|| {
            format!(
                "{} (more than {} behind)",
                lagging.join(", "),
                report::bytes(report::LAG_LIMIT)
            )
        })
    }

    /// The phase, corrected by the topology: no primary serving, or one becoming primary,
    /// is not Running.
    fn assess(&self, assessment: Assessment) -> Assessment {
        let d = &self.decision;
        if assessment.phase == Phase::Pending {
            return assessment;
        }
        let (reason, message) = if let Some(waiting) = &d.waiting {
            ("PrimaryNotReady", waiting.clone())
        } else if d.current_primary.as_deref() != Some(d.primary.as_str()) {
            (
                "Promoting",
                format!("{} becomes primary (epoch {})", d.primary, d.epoch),
            )
        } else if let Some(since) = d.not_ready_since {
            (
                "PrimaryNotReady",
                format!("primary {} not ready since {since}", d.primary),
            )
        } else if let Some(lagging) = self.lagging() {
            ("StandbyLagging", lagging)
        } else {
            return assessment;
        };
        Assessment {
            phase: Phase::Degraded,
            reason,
            message,
            ..assessment
        }
    }
}

/// What the last reconcile recorded in the status.
fn recorded(parent: &Value) -> Recorded {
    let field = |name: &str| {
        parent
            .pointer(&format!("/status/{name}"))
            .and_then(Value::as_str)
            .map(String::from)
    };
    Recorded {
        epoch: parent.pointer("/status/epoch").and_then(Value::as_u64),
        current_primary: field("currentPrimary"),
        not_ready_since: field("primaryNotReadySince").and_then(|t| t.parse().ok()),
        target_primary: field("targetPrimary"),
        fencing: field("fencing"),
        target_ready_transition: field("targetReadyTransition"),
    }
}

/// The host's clock, to the second.
fn now() -> Timestamp {
    let seconds = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    Timestamp::from_second(i64::try_from(seconds).unwrap_or(i64::MAX))
        .unwrap_or(Timestamp::UNIX_EPOCH)
}

/// The observed credentials, or new ones (with an event) when the Secret is absent.
fn credentials_for(
    ctx: &Context,
    cluster: &Cluster,
    desired: &mut Desired,
) -> Result<Credentials, Error> {
    if let Some(credentials) = Credentials::observed(ctx, cluster)? {
        return Ok(credentials);
    }
    let credentials = Credentials::generate()?;
    capstan_sdk::info!(
        "generated credentials for {}/{}",
        cluster.namespace(),
        cluster.name()
    );
    desired.event(Event::normal(
        "CredentialsCreated",
        format!("generated passwords in Secret {}", cluster.credentials()),
    ));
    Ok(credentials)
}

/// Status, the `Ready` condition, and an event when the phase or its reason changes.
fn report(
    ctx: &Context,
    cluster: &Cluster,
    assessment: &Assessment,
    topology: &Topology,
    desired: &mut Desired,
) -> Result<(), Error> {
    let d = &topology.decision;
    desired.status(&ClusterStatus {
        phase: assessment.phase,
        ready_replicas: assessment.ready,
        primary_endpoint: cluster.primary_endpoint(),
        current_primary: d.current_primary.clone(),
        target_primary: Some(d.primary.clone()),
        epoch: Some(d.epoch),
        primary_not_ready_since: d.not_ready_since.map(|t| t.to_string()),
        fencing: d.fencing.clone(),
        target_ready_transition: d.target_ready_transition.clone(),
        instances: topology.reports.status(&d.primary),
    })?;
    desired.condition(Condition::new(
        "Ready",
        assessment.phase == Phase::Running,
        assessment.reason,
        assessment.message.clone(),
    ));
    let (phase_before, reason_before) = previous(ctx);
    let phase = assessment.phase.as_str();
    if phase_before.as_deref() != Some(phase) || reason_before.as_deref() != Some(assessment.reason)
    {
        desired.event(if assessment.phase == Phase::Failed {
            Event::warning(assessment.reason, assessment.message.clone())
        } else {
            Event::normal(
                assessment.reason,
                format!("{phase}: {}", assessment.message),
            )
        });
    }
    Ok(())
}

/// The phase and `Ready` reason in the parent's current status.
fn previous(ctx: &Context) -> (Option<String>, Option<String>) {
    let status = ctx.parent().get("status");
    let phase = status
        .and_then(|s| s.get("phase"))
        .and_then(Value::as_str)
        .map(String::from);
    let reason = status
        .and_then(|s| s.get("conditions"))
        .and_then(Value::as_array)
        .and_then(|cs| {
            cs.iter()
                .find(|c| c.get("type").and_then(Value::as_str) == Some("Ready"))
        })
        .and_then(|c| c.get("reason"))
        .and_then(Value::as_str)
        .map(String::from);
    (phase, reason)
}

capstan_sdk::export_plugin!(PostgresPlugin);

#[cfg(test)]
mod tests;
