//! The children of a cluster, built from a [`Config`]: pure functions, so the same
//! configuration always gives byte-for-byte the same manifests.
//!
//! Names and namespaces of the children and their ownerReferences are left to the host.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{
    StatefulSet, StatefulSetPersistentVolumeClaimRetentionPolicy, StatefulSetSpec,
};
use k8s_openapi::api::batch::v1::{CronJob, CronJobSpec, JobSpec, JobTemplateSpec};
use k8s_openapi::api::core::v1::{
    Affinity, Capabilities, ConfigMap, ConfigMapVolumeSource, Container, ContainerPort,
    EmptyDirVolumeSource, EnvVar, EnvVarSource, ExecAction, Lifecycle, LifecycleHandler,
    ObjectFieldSelector, ObjectReference, PersistentVolumeClaim, PersistentVolumeClaimSpec,
    PersistentVolumeClaimVolumeSource, PodAffinityTerm, PodAntiAffinity, PodSecurityContext,
    PodSpec, PodTemplateSpec, Probe, SeccompProfile, SecretKeySelector, SecurityContext, Service,
    ServiceAccount, ServicePort, ServiceSpec, Volume, VolumeMount, VolumeResourceRequirements,
    WeightedPodAffinityTerm,
};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use crate::cluster::{Cluster, PORT};
use crate::credentials::keys;
use crate::observed::{DATA_VOLUME, STORAGE_ANNOTATION, VERSION_ANNOTATION};
use crate::scripts;
use crate::spec::Config;
use crate::topology::{self, Decision, Instances};

/// User and group of `postgres` in the official (Debian-based) `postgres` images.
pub const POSTGRES_UID: i64 = 999;
/// Where each instance's volume is mounted.
pub const DATA_MOUNT: &str = "/var/lib/postgresql/data";
/// PGDATA: a subdirectory of the volume, so that initdb finds it empty and owns it
/// even when the volume's root holds `lost+found` or has other permissions.
pub const PGDATA: &str = "/var/lib/postgresql/data/pgdata";
/// Where the scripts ConfigMap is mounted.
pub const SCRIPTS_MOUNT: &str = "/scripts";
/// Where the topology ConfigMap is mounted.
pub const TOPOLOGY_MOUNT: &str = "/topology";
/// Seconds between two readiness probes of an instance.
pub const READINESS_PERIOD: i32 = 1;
/// Failed readiness probes before an instance is not ready.
pub const READINESS_FAILURES: i32 = 2;
/// Who manages the EndpointSlices of the read-write and read-only Services.
pub const SLICE_MANAGER: &str = "postgresql.capstan.dev";
/// Where the dumps claim is mounted in the dump job.
pub const DUMPS_MOUNT: &str = "/dumps";
/// How many dumps the dump job keeps.
pub const DUMPS_KEPT: u32 = 7;

/// Every child of a cluster that runs `config`, in the order they are applied.
/// `dumps_storage` is the size of an existing dumps claim, kept as it is.
pub struct Children {
    /// The topology ConfigMap: first, so that a stale decision (refused with 409)
    /// writes nothing at all.
    pub topology: ConfigMap,
    /// The credentials Secret, built by the caller.
    pub secret: k8s_openapi::api::core::v1::Secret,
    /// The scripts ConfigMap.
    pub scripts: ConfigMap,
    /// The instances' ServiceAccount, the Role that lets it patch the report
    /// ConfigMap (and nothing else), and their RoleBinding.
    pub agent: (ServiceAccount, Role, RoleBinding),
    /// The ConfigMap the agents report to: no data of the plugin's own, each agent
    /// patches its key.
    pub reports: ConfigMap,
    /// Headless, read-write, read and read-only Services.
    pub services: [Service; 4],
    /// The endpoints of the read-write and read-only Services.
    pub endpoint_slices: [EndpointSlice; 2],
    /// The instances.
    pub statefulset: StatefulSet,
    /// With more than one instance.
    pub disruption_budget: Option<PodDisruptionBudget>,
    /// With a backup schedule.
    pub dump_job: Option<CronJob>,
    /// With a backup schedule, or when it already exists.
    pub dumps: Option<PersistentVolumeClaim>,
}

impl Children {
    /// Builds them. The StatefulSet runs `decision.members` instances, which may be more
    /// than `config` asks while the primary is beyond them.
    pub fn build(
        cluster: &Cluster,
        config: &Config,
        secret: k8s_openapi::api::core::v1::Secret,
        dumps_storage: Option<&str>,
        decision: &Decision,
        instances: &Instances,
    ) -> Self {
        let dumps = match (dumps_storage, &config.schedule) {
            (Some(size), _) => Some(dumps_claim(cluster, size)),
            (None, Some(_)) => Some(dumps_claim(cluster, &config.storage)),
            (None, None) => None,
        };
        let running = Config {
            replicas: decision.members,
            ..config.clone()
        };
        let standbys: Vec<&str> = instances
            .iter()
            .filter(|(name, i)| {
                i.serving()
                    && **name != decision.primary
                    && decision.fencing.as_deref() != Some(name.as_str())
            })
            .map(|(name, _)| name.as_str())
            .collect();
        // The primary, once it serves as one (not while it is being promoted).
        let primary: Vec<&str> = match decision.current_primary.as_deref() {
            Some(current) if current == decision.primary => vec![current],
            _ => Vec::new(),
        };
        Children {
            topology: topology_config_map(cluster, decision),
            secret,
            scripts: scripts_config_map(cluster),
            agent: agent_rights(cluster),
            reports: ConfigMap {
                metadata: meta(cluster.reports(), cluster),
                ..Default::default()
            },
            services: [
                headless_service(cluster),
                routed_service(cluster, cluster.read_write()),
                read_service(cluster),
                routed_service(cluster, cluster.read_only()),
            ],
            endpoint_slices: [
                endpoint_slice(cluster, cluster.read_write(), &primary, instances),
                endpoint_slice(cluster, cluster.read_only(), &standbys, instances),
            ],
            statefulset: statefulset(cluster, &running),
            disruption_budget: (running.replicas > 1).then(|| disruption_budget(cluster)),
            dump_job: config
                .schedule
                .as_deref()
                .map(|s| dump_job(cluster, config, s)),
            dumps,
        }
    }

    /// Adds every child to `desired`.
    pub fn add_to(self, desired: &mut capstan_sdk::Desired) -> Result<(), capstan_sdk::Error> {
        desired
            .child(&self.topology)?
            .child(&self.secret)?
            .child(&self.scripts)?
            .child(&self.agent.0)?
            .child(&self.agent.1)?
            .child(&self.agent.2)?
            .child(&self.reports)?;
        for service in &self.services {
            desired.child(service)?;
        }
        for slice in &self.endpoint_slices {
            desired.child(slice)?;
        }
        desired.child(&self.statefulset)?;
        if let Some(pdb) = &self.disruption_budget {
            desired.child(pdb)?;
        }
        if let Some(job) = &self.dump_job {
            desired.child(job)?;
        }
        if let Some(claim) = &self.dumps {
            desired.child(claim)?;
        }
        Ok(())
    }
}

/// The rights of the instances' Pods: `get` and `patch` on the report ConfigMap, by
/// name, through a ServiceAccount of their own (docs/postgresql.md, Reports).
fn agent_rights(cluster: &Cluster) -> (ServiceAccount, Role, RoleBinding) {
    let account = ServiceAccount {
        metadata: meta(cluster.agent(), cluster),
        ..Default::default()
    };
    let role = Role {
        metadata: meta(cluster.agent(), cluster),
        rules: Some(vec![PolicyRule {
            api_groups: Some(vec![String::new()]),
            resources: Some(vec!["configmaps".into()]),
            resource_names: Some(vec![cluster.reports()]),
            verbs: vec!["get".into(), "patch".into()],
            ..Default::default()
        }]),
    };
    let binding = RoleBinding {
        metadata: meta(cluster.agent(), cluster),
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "Role".into(),
            name: cluster.agent(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: cluster.agent(),
            namespace: Some(cluster.namespace().into()),
            ..Default::default()
        }]),
    };
    (account, role, binding)
}

fn meta(name: String, cluster: &Cluster) -> ObjectMeta {
    ObjectMeta {
        name: Some(name),
        labels: Some(cluster.instance_labels()),
        ..Default::default()
    }
}

fn selector(labels: BTreeMap<String, String>) -> LabelSelector {
    LabelSelector {
        match_labels: Some(labels),
        ..Default::default()
    }
}

fn env(name: &str, value: impl Into<String>) -> EnvVar {
    EnvVar {
        name: name.into(),
        value: Some(value.into()),
        ..Default::default()
    }
}

fn secret_env(cluster: &Cluster, name: &str, key: &str) -> EnvVar {
    EnvVar {
        name: name.into(),
        value_from: Some(EnvVarSource {
            secret_key_ref: Some(SecretKeySelector {
                name: cluster.credentials(),
                key: key.into(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// `APP_*` for both scripts, from the Secret.
fn app_env(cluster: &Cluster) -> Vec<EnvVar> {
    vec![
        secret_env(cluster, "APP_USER", keys::USERNAME),
        secret_env(cluster, "APP_PASSWORD", keys::PASSWORD),
        secret_env(cluster, "APP_DATABASE", keys::DBNAME),
    ]
}

fn port() -> ServicePort {
    ServicePort {
        name: Some("postgresql".into()),
        port: i32::from(PORT),
        target_port: Some(IntOrString::String("postgresql".into())),
        ..Default::default()
    }
}

fn bash(script: &str) -> Vec<String> {
    vec!["bash".into(), format!("{SCRIPTS_MOUNT}/{script}")]
}

/// `bash /scripts/entrypoint.sh <command>`: a probe of the instance's agent.
fn entrypoint_command(command: &str) -> Vec<String> {
    let mut argv = bash(scripts::ENTRYPOINT_FILE);
    argv.push(command.into());
    argv
}

fn scripts_config_map(cluster: &Cluster) -> ConfigMap {
    ConfigMap {
        metadata: meta(cluster.scripts(), cluster),
        data: Some(BTreeMap::from([
            (scripts::ENTRYPOINT_FILE.into(), scripts::ENTRYPOINT.into()),
            (scripts::DUMP_FILE.into(), scripts::DUMP.into()),
        ])),
        ..Default::default()
    }
}

/// Governs the StatefulSet: gives each pod a DNS name (`<name>-0.<name>`), also before
/// it is ready, so a restarting standby can reach its primary.
fn headless_service(cluster: &Cluster) -> Service {
    Service {
        metadata: meta(cluster.name().into(), cluster),
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".into()),
            publish_not_ready_addresses: Some(true),
            selector: Some(cluster.instance_labels()),
            ports: Some(vec![port()]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// What the agents follow. Written with the resourceVersion it was observed at (or
/// create-only), so that a decision taken on a stale cache is refused, never applied.
fn topology_config_map(cluster: &Cluster, decision: &Decision) -> ConfigMap {
    let mut metadata = meta(cluster.topology(), cluster);
    metadata.resource_version = Some(decision.precondition.clone());
    ConfigMap {
        metadata,
        data: Some(BTreeMap::from([(
            topology::TOPOLOGY_KEY.into(),
            topology::text(cluster, decision),
        )])),
        ..Default::default()
    }
}

/// A Service without a selector, whose endpoints the plugin decides: `-rw`, the
/// primary of the topology; `-ro`, the standbys. Labelling Pods would mean writing to
/// objects the StatefulSet owns.
fn routed_service(cluster: &Cluster, name: String) -> Service {
    Service {
        metadata: meta(name, cluster),
        spec: Some(ServiceSpec {
            ports: Some(vec![ServicePort {
                name: Some("postgresql".into()),
                port: i32::from(PORT),
                target_port: Some(IntOrString::Int(i32::from(PORT))),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The endpoints of a routed Service: the Pods `names`, ready.
fn endpoint_slice(
    cluster: &Cluster,
    service: String,
    names: &[&str],
    instances: &Instances,
) -> EndpointSlice {
    let mut metadata = meta(service.clone(), cluster);
    let labels = metadata.labels.get_or_insert_with(BTreeMap::new);
    labels.insert("kubernetes.io/service-name".into(), service);
    labels.insert(
        "endpointslice.kubernetes.io/managed-by".into(),
        SLICE_MANAGER.into(),
    );
    let endpoints: Vec<Endpoint> = names
        .iter()
        .filter_map(|name| {
            let instance = instances.get(*name)?;
            Some(Endpoint {
                addresses: vec![instance.ip.clone()?],
                conditions: Some(EndpointConditions {
                    ready: Some(true),
                    serving: Some(true),
                    terminating: Some(false),
                }),
                target_ref: Some(ObjectReference {
                    kind: Some("Pod".into()),
                    name: Some((*name).into()),
                    namespace: Some(cluster.namespace().into()),
                    uid: instance.uid.clone(),
                    ..Default::default()
                }),
                ..Default::default()
            })
        })
        .collect();
    EndpointSlice {
        metadata,
        address_type: "IPv4".into(),
        endpoints: Some(endpoints),
        ports: Some(vec![EndpointPort {
            name: Some("postgresql".into()),
            port: Some(i32::from(PORT)),
            protocol: Some("TCP".into()),
            ..Default::default()
        }]),
    }
}

/// Reads: every ready instance, the primary included.
fn read_service(cluster: &Cluster) -> Service {
    Service {
        metadata: meta(cluster.read(), cluster),
        spec: Some(ServiceSpec {
            selector: Some(cluster.instance_labels()),
            ports: Some(vec![port()]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn statefulset(cluster: &Cluster, config: &Config) -> StatefulSet {
    let mut metadata = meta(cluster.name().into(), cluster);
    metadata.annotations = Some(BTreeMap::from([
        (VERSION_ANNOTATION.into(), config.version.to_string()),
        (STORAGE_ANNOTATION.into(), config.storage.clone()),
    ]));
    StatefulSet {
        metadata,
        spec: StatefulSetSpec {
            replicas: Some(config.replicas),
            service_name: Some(cluster.name().into()),
            selector: selector(cluster.instance_labels()),
            // Pod n+1 starts once pod n is ready: a standby copies a running primary.
            pod_management_policy: Some("OrderedReady".into()),
            persistent_volume_claim_retention_policy: Some(
                StatefulSetPersistentVolumeClaimRetentionPolicy {
                    when_deleted: Some("Retain".into()),
                    when_scaled: Some("Retain".into()),
                },
            ),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(cluster.instance_labels()),
                    ..Default::default()
                }),
                spec: Some(instance_pod(cluster, config)),
            },
            volume_claim_templates: Some(vec![PersistentVolumeClaim {
                metadata: ObjectMeta {
                    name: Some(DATA_VOLUME.into()),
                    labels: Some(cluster.instance_labels()),
                    ..Default::default()
                },
                spec: Some(claim_spec(&config.storage)),
                ..Default::default()
            }]),
            ..Default::default()
        },
        ..Default::default()
    }
}

fn instance_pod(cluster: &Cluster, config: &Config) -> PodSpec {
    let mut env = vec![
        EnvVar {
            name: "POD_NAME".into(),
            value_from: Some(EnvVarSource {
                field_ref: Some(ObjectFieldSelector {
                    field_path: "metadata.name".into(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        },
        EnvVar {
            name: "POD_NAMESPACE".into(),
            value_from: Some(EnvVarSource {
                field_ref: Some(ObjectFieldSelector {
                    field_path: "metadata.namespace".into(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        },
        env("PGDATA", PGDATA),
        env("PG_PORT", PORT.to_string()),
        env("REPORT_CONFIGMAP", cluster.reports()),
        env(
            "TOPOLOGY_FILE",
            format!("{TOPOLOGY_MOUNT}/{}", topology::TOPOLOGY_KEY),
        ),
        // Long enough for the kubelet to see a standby being promoted not ready.
        env(
            "PROMOTE_HOLD",
            (READINESS_PERIOD * READINESS_FAILURES + 1).to_string(),
        ),
    ];
    env.extend(app_env(cluster));
    env.extend([
        secret_env(cluster, "REPLICATION_USER", keys::REPLICATION_USERNAME),
        secret_env(cluster, "REPLICATION_PASSWORD", keys::REPLICATION_PASSWORD),
    ]);
    let container = Container {
        name: "postgres".into(),
        image: Some(config.image()),
        command: Some(bash(scripts::ENTRYPOINT_FILE)),
        ports: Some(vec![ContainerPort {
            name: Some("postgresql".into()),
            container_port: i32::from(PORT),
            ..Default::default()
        }]),
        env: Some(env),
        // Ready: postgres answers, in the role of the epoch its agent adopted. The
        // plugin reads it to route `-rw` and `-ro` and to decide a failover.
        readiness_probe: Some(Probe {
            exec: Some(ExecAction {
                command: Some(entrypoint_command("ready")),
            }),
            period_seconds: Some(READINESS_PERIOD),
            timeout_seconds: Some(5),
            failure_threshold: Some(READINESS_FAILURES),
            ..Default::default()
        }),
        // Alive unless the server hangs, or serves as a primary that a newer topology
        // deposed while its agent failed to stop it: then the kubelet restarts it.
        liveness_probe: Some(Probe {
            exec: Some(ExecAction {
                command: Some(entrypoint_command("live")),
            }),
            period_seconds: Some(5),
            timeout_seconds: Some(5),
            failure_threshold: Some(3),
            ..Default::default()
        }),
        // A fast shutdown (abort transactions, checkpoint) rather than waiting for
        // every client to leave, so restarts and rollouts do not run into SIGKILL.
        lifecycle: Some(Lifecycle {
            pre_stop: Some(LifecycleHandler {
                exec: Some(ExecAction {
                    command: Some(vec![
                        "bash".into(),
                        "-c".into(),
                        "pg_ctl -D \"$PGDATA\" -m fast -w -t 50 stop || true".into(),
                    ]),
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
        volume_mounts: Some(vec![
            mount(DATA_VOLUME, DATA_MOUNT, false),
            mount("scripts", SCRIPTS_MOUNT, true),
            mount("topology", TOPOLOGY_MOUNT, true),
            mount("shm", "/dev/shm", false),
        ]),
        security_context: Some(container_security()),
        ..Default::default()
    };
    PodSpec {
        containers: vec![container],
        security_context: Some(pod_security()),
        // Its token lets the agent patch the report ConfigMap, and nothing else.
        service_account_name: Some(cluster.agent()),
        automount_service_account_token: Some(true),
        termination_grace_period_seconds: Some(60),
        affinity: Some(spread_across_nodes(cluster)),
        volumes: Some(vec![
            scripts_volume(cluster),
            Volume {
                name: "topology".into(),
                config_map: Some(ConfigMapVolumeSource {
                    name: cluster.topology(),
                    default_mode: Some(0o444),
                    ..Default::default()
                }),
                ..Default::default()
            },
            Volume {
                name: "shm".into(),
                empty_dir: Some(EmptyDirVolumeSource {
                    medium: Some("Memory".into()),
                    size_limit: Some(Quantity("256Mi".into())),
                    ..Default::default()
                }),
                ..Default::default()
            },
        ]),
        ..Default::default()
    }
}

fn mount(name: &str, path: &str, read_only: bool) -> VolumeMount {
    VolumeMount {
        name: name.into(),
        mount_path: path.into(),
        read_only: read_only.then_some(true),
        ..Default::default()
    }
}

fn scripts_volume(cluster: &Cluster) -> Volume {
    Volume {
        name: "scripts".into(),
        config_map: Some(ConfigMapVolumeSource {
            name: cluster.scripts(),
            default_mode: Some(0o555),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Runs as `postgres`, never as root; the volume is group-owned by it.
fn pod_security() -> PodSecurityContext {
    PodSecurityContext {
        run_as_user: Some(POSTGRES_UID),
        run_as_group: Some(POSTGRES_UID),
        fs_group: Some(POSTGRES_UID),
        // Ownership and mode are changed on mount only when the volume's root does not
        // match already, not recursively on every start.
        fs_group_change_policy: Some("OnRootMismatch".into()),
        run_as_non_root: Some(true),
        seccomp_profile: Some(SeccompProfile {
            type_: "RuntimeDefault".into(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn container_security() -> SecurityContext {
    SecurityContext {
        allow_privilege_escalation: Some(false),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".into()]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Prefer one instance per node, so that losing a node loses one instance; when there
/// are fewer nodes than instances they share.
fn spread_across_nodes(cluster: &Cluster) -> Affinity {
    Affinity {
        pod_anti_affinity: Some(PodAntiAffinity {
            preferred_during_scheduling_ignored_during_execution: Some(vec![
                WeightedPodAffinityTerm {
                    weight: 100,
                    pod_affinity_term: PodAffinityTerm {
                        label_selector: Some(selector(cluster.instance_labels())),
                        topology_key: "kubernetes.io/hostname".into(),
                        ..Default::default()
                    },
                },
            ]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn claim_spec(storage: &str) -> PersistentVolumeClaimSpec {
    PersistentVolumeClaimSpec {
        access_modes: Some(vec!["ReadWriteOnce".into()]),
        resources: Some(VolumeResourceRequirements {
            requests: Some(BTreeMap::from([(
                "storage".into(),
                Quantity(storage.into()),
            )])),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn disruption_budget(cluster: &Cluster) -> PodDisruptionBudget {
    PodDisruptionBudget {
        metadata: meta(cluster.name().into(), cluster),
        spec: Some(PodDisruptionBudgetSpec {
            max_unavailable: Some(IntOrString::Int(1)),
            selector: Some(selector(cluster.instance_labels())),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The claim the dumps go to, of `storage` (an instance's volume size when new).
pub fn dumps_claim(cluster: &Cluster, storage: &str) -> PersistentVolumeClaim {
    PersistentVolumeClaim {
        metadata: meta(cluster.dumps(), cluster),
        spec: Some(claim_spec(storage)),
        ..Default::default()
    }
}

/// `pg_dump` of the application database through the read-write Service, on schedule.
fn dump_job(cluster: &Cluster, config: &Config, schedule: &str) -> CronJob {
    let mut env = vec![
        env("DUMP_HOST", cluster.read_write()),
        env("DUMP_PORT", PORT.to_string()),
        env("DUMP_DIR", DUMPS_MOUNT),
        env("DUMP_PREFIX", cluster.name()),
        env("DUMP_KEEP", DUMPS_KEPT.to_string()),
    ];
    env.extend(app_env(cluster));
    let container = Container {
        name: "dump".into(),
        // The instances' image: pg_dump of the server's own version.
        image: Some(config.image()),
        command: Some(bash(scripts::DUMP_FILE)),
        env: Some(env),
        volume_mounts: Some(vec![
            mount("dumps", DUMPS_MOUNT, false),
            mount("scripts", SCRIPTS_MOUNT, true),
        ]),
        security_context: Some(container_security()),
        ..Default::default()
    };
    let pod = PodSpec {
        containers: vec![container],
        restart_policy: Some("Never".into()),
        security_context: Some(pod_security()),
        volumes: Some(vec![
            Volume {
                name: "dumps".into(),
                persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                    claim_name: cluster.dumps(),
                    ..Default::default()
                }),
                ..Default::default()
            },
            scripts_volume(cluster),
        ]),
        ..Default::default()
    };
    CronJob {
        metadata: meta(cluster.dump_job(), cluster),
        spec: CronJobSpec {
            schedule: schedule.into(),
            concurrency_policy: Some("Forbid".into()),
            successful_jobs_history_limit: Some(3),
            failed_jobs_history_limit: Some(3),
            job_template: JobTemplateSpec {
                metadata: None,
                spec: Some(JobSpec {
                    backoff_limit: Some(2),
                    template: PodTemplateSpec {
                        metadata: Some(ObjectMeta {
                            labels: Some(cluster.dump_labels()),
                            ..Default::default()
                        }),
                        spec: Some(pod),
                    },
                    ..Default::default()
                }),
            },
            ..Default::default()
        },
        ..Default::default()
    }
}
