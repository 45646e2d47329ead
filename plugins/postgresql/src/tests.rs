//! Plugin tests, natively: fresh clusters, observed state read back, allowed and
//! refused changes, the phase judged from the StatefulSet, v1alpha1 parents, and the
//! teardown waves from observed states.

use capstan_sdk::testing::{observe_for, observe_related_for};
use capstan_sdk::{EventType, Plugin};
use serde_json::{Value, json};

use super::*;

fn parent(spec: Value, status: Value) -> Value {
    json!({
        "apiVersion": "db.example.com/v1", "kind": "PostgreSQLCluster",
        "metadata": {"name": "pg", "namespace": "prod", "uid": "uid-1", "generation": 1},
        "spec": spec,
        "status": status,
    })
}

fn spec(instances: i64, version: &str, storage: &str, schedule: Option<&str>) -> Value {
    let mut spec =
        json!({"instances": instances, "version": version, "storage": {"size": storage}});
    if let Some(s) = schedule {
        spec["backupSchedule"] = json!(s);
    }
    spec
}

/// Reconciles with the instance Pods the observed StatefulSet's status implies: its
/// first `readyReplicas` instances, ready.
fn reconcile(parent: Value, children: Vec<Value>) -> Result<Desired, Error> {
    let ready = children
        .iter()
        .find(|c| c["kind"] == "StatefulSet")
        .and_then(|s| s["status"]["readyReplicas"].as_i64())
        .unwrap_or(0);
    let pods = (0..ready).map(|o| pod(&format!("pg-{o}"), true)).collect();
    reconcile_with_pods(parent, children, pods)
}

fn reconcile_with_pods(
    parent: Value,
    children: Vec<Value>,
    pods: Vec<Value>,
) -> Result<Desired, Error> {
    PostgresPlugin::reconcile(&observe_related_for::<PostgresPlugin>(
        parent, children, pods,
    ))
}

/// An instance Pod as the API server returns it.
fn pod(name: &str, ready: bool) -> Value {
    let ordinal: u32 = name.rsplit('-').next().unwrap().parse().unwrap();
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "prod", "uid": format!("uid-{name}"),
                     "labels": {"app.kubernetes.io/name": "postgresql", "app.kubernetes.io/instance": "pg"}},
        "status": {"podIP": format!("10.1.0.{}", ordinal + 10),
                   "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]},
    })
}

fn ok(parent: Value, children: Vec<Value>) -> Desired {
    reconcile(parent, children).unwrap_or_else(|e| panic!("{e}"))
}

fn names(d: &Desired) -> Vec<String> {
    d.children()
        .iter()
        .map(|c| {
            format!(
                "{}/{}",
                c["kind"].as_str().unwrap(),
                c["metadata"]["name"].as_str().unwrap()
            )
        })
        .collect()
}

fn child<'a>(d: &'a Desired, kind: &str, name: &str) -> &'a Value {
    d.children()
        .iter()
        .find(|c| c["kind"] == kind && c["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} in {:?}", names(d)))
}

fn secret_value(d: &Desired, key: &str) -> String {
    let encoded = child(d, "Secret", "pg-credentials")["data"][key]
        .as_str()
        .unwrap()
        .to_string();
    let bytes: k8s_openapi::ByteString = serde_json::from_value(json!(encoded)).unwrap();
    String::from_utf8(bytes.0).unwrap()
}

/// The children of `d` as the API server would return them: the StatefulSet with a
/// status saying `ready` pods are ready and the rollout is done.
fn observed(d: &Desired, ready: i32) -> Vec<Value> {
    d.children()
        .iter()
        .cloned()
        .map(|mut c| {
            if c["kind"] == "StatefulSet" {
                let replicas = c["spec"]["replicas"].clone();
                c["metadata"]["generation"] = json!(1);
                c["status"] = json!({
                    "replicas": replicas, "readyReplicas": ready, "updatedReplicas": replicas,
                    "currentRevision": "pg-1", "updateRevision": "pg-1", "observedGeneration": 1,
                });
            }
            c
        })
        .collect()
}

/// Children but the EndpointSlices, which follow the Pods.
fn without_routes(children: &[Value]) -> Vec<&Value> {
    children
        .iter()
        .filter(|c| c["kind"] != "EndpointSlice")
        .collect()
}

fn phase(d: &Desired) -> &str {
    d.status_value().unwrap()["phase"].as_str().unwrap()
}

fn ready_condition(d: &Desired) -> &Condition {
    d.conditions().iter().find(|c| c.type_ == "Ready").unwrap()
}

#[test]
fn describe_declares_the_parent_children_and_crd() {
    let info = PostgresPlugin::describe();
    assert_eq!(
        info.parent.api_version(),
        "db.example.com/v1",
        "the storage version"
    );
    assert!(info.conversion, "serves the CRD's conversion webhook");
    assert_eq!(info.parent.plural, "postgresqlclusters");
    assert!(info.finalizer, "teardown runs in waves");
    assert_eq!(info.validation, Some(FailurePolicy::Fail));
    let kinds: Vec<String> = info
        .children
        .iter()
        .map(|k| format!("{}.{}", k.kind, k.api_version()))
        .collect();
    assert_eq!(
        kinds,
        [
            "Secret.v1",
            "ConfigMap.v1",
            "Service.v1",
            "StatefulSet.apps/v1",
            "PodDisruptionBudget.policy/v1",
            "CronJob.batch/v1",
            "PersistentVolumeClaim.v1",
            "EndpointSlice.discovery.k8s.io/v1",
            "ServiceAccount.v1",
            "Role.rbac.authorization.k8s.io/v1",
            "RoleBinding.rbac.authorization.k8s.io/v1"
        ]
    );
    let crd: Value = serde_json::from_str(info.crd.as_deref().unwrap()).unwrap();
    assert_eq!(crd["metadata"]["name"], "postgresqlclusters.db.example.com");
    assert_eq!(crd["spec"]["names"]["shortNames"], json!(["pgc"]));
    let versions: Vec<(&str, bool, bool)> = crd["spec"]["versions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| {
            (
                v["name"].as_str().unwrap(),
                v["served"].as_bool().unwrap(),
                v["storage"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(versions, [("v1alpha1", true, false), ("v1", true, true)]);
    let v1_spec = &crd["spec"]["versions"][1]["schema"]["openAPIV3Schema"]["properties"]["spec"];
    assert_eq!(v1_spec["required"], json!(["instances", "version"]));
    assert_eq!(
        v1_spec["properties"]["storage"]["properties"]["size"]["default"],
        "10Gi"
    );
}

#[test]
fn a_new_cluster_gets_every_child_and_is_pending() {
    let d = ok(
        parent(spec(3, "16.1", "1Gi", Some("0 2 * * *")), Value::Null),
        vec![],
    );
    assert_eq!(
        names(&d),
        [
            "ConfigMap/pg-topology",
            "Secret/pg-credentials",
            "ConfigMap/pg-scripts",
            "ServiceAccount/pg-instance",
            "Role/pg-instance",
            "RoleBinding/pg-instance",
            "ConfigMap/pg-report",
            "Service/pg",
            "Service/pg-rw",
            "Service/pg-r",
            "Service/pg-ro",
            "EndpointSlice/pg-rw",
            "EndpointSlice/pg-ro",
            "StatefulSet/pg",
            "PodDisruptionBudget/pg",
            "CronJob/pg-dump",
            "PersistentVolumeClaim/pg-dumps"
        ]
    );
    assert_eq!(
        d.status_value().unwrap(),
        &json!({"phase": "Pending", "readyReplicas": 0, "primaryEndpoint": "pg-rw.prod.svc:5432",
                "targetPrimary": "pg-0", "epoch": 1})
    );
    // The first topology is created, never written over one the cache did not show.
    let topology = child(&d, "ConfigMap", "pg-topology");
    assert_eq!(
        topology["metadata"]["resourceVersion"],
        topology::CREATE_ONLY
    );
    assert!(
        topology["data"]["topology"]
            .as_str()
            .unwrap()
            .contains("epoch=1\nprimary=pg-0\nsynchronous=0\n")
    );
    assert_eq!(child(&d, "EndpointSlice", "pg-rw")["endpoints"], json!([]));
    let ready = ready_condition(&d);
    assert_eq!(
        (ready.status, ready.reason.as_str()),
        (capstan_sdk::ConditionStatus::False, "Creating")
    );
    assert_eq!(d.requeue(), Some(REQUEUE_WHILE_CONVERGING));
    assert!(d.events().iter().any(|e| e.reason == "CredentialsCreated"));

    let sts = child(&d, "StatefulSet", "pg");
    assert_eq!(sts["spec"]["replicas"], 3);
    assert_eq!(
        sts["spec"]["template"]["spec"]["containers"][0]["image"],
        "postgres:16.1"
    );
    assert_eq!(
        sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"],
        "1Gi"
    );
    assert_eq!(
        sts["spec"]["persistentVolumeClaimRetentionPolicy"],
        json!({"whenDeleted": "Retain", "whenScaled": "Retain"})
    );
    // Routed by the plugin: no selector, the EndpointSlice says where.
    assert_eq!(child(&d, "Service", "pg-rw")["spec"].get("selector"), None);
    assert_eq!(child(&d, "Service", "pg-ro")["spec"].get("selector"), None);
    assert_eq!(child(&d, "Service", "pg")["spec"]["clusterIP"], "None");
    assert_eq!(
        child(&d, "CronJob", "pg-dump")["spec"]["schedule"],
        "0 2 * * *"
    );
    assert_eq!(
        child(&d, "ConfigMap", "pg-scripts")["data"]["entrypoint.sh"],
        scripts::ENTRYPOINT
    );
}

#[test]
fn passwords_are_random_and_stay_out_of_status_and_events() {
    let d = ok(parent(spec(1, "16.1", "1Gi", None), Value::Null), vec![]);
    let password = secret_value(&d, "password");
    let replication = secret_value(&d, "replication-password");
    for p in [&password, &replication] {
        assert_eq!(p.len(), credentials::PASSWORD_LENGTH);
        assert!(p.bytes().all(|b| b.is_ascii_alphanumeric()), "{p}");
    }
    assert_ne!(password, replication);
    assert_eq!(
        secret_value(&d, "uri"),
        format!("postgresql://app:{password}@pg-rw.prod.svc:5432/app")
    );
    assert_eq!(secret_value(&d, "host"), "pg-rw.prod.svc");
    let public = format!(
        "{:?} {:?} {:?}",
        d.status_value(),
        d.events(),
        d.conditions()
    );
    assert!(
        !public.contains(&password) && !public.contains(&replication),
        "{public}"
    );
    let other = ok(parent(spec(1, "16.1", "1Gi", None), Value::Null), vec![]);
    assert_ne!(
        secret_value(&other, "password"),
        password,
        "each cluster gets its own"
    );
}

#[test]
fn an_observed_secret_keeps_its_passwords() {
    let first = ok(parent(spec(3, "16.1", "1Gi", None), Value::Null), vec![]);
    let again = ok(
        parent(spec(3, "16.1", "1Gi", None), Value::Null),
        observed(&first, 0),
    );
    assert_eq!(
        secret_value(&again, "password"),
        secret_value(&first, "password")
    );
    assert_eq!(
        child(&again, "Secret", "pg-credentials"),
        child(&first, "Secret", "pg-credentials")
    );
    assert!(
        !again
            .events()
            .iter()
            .any(|e| e.reason == "CredentialsCreated")
    );
    // Same observed state, same answer.
    assert_eq!(again.children(), first.children());
}

#[test]
fn a_secret_without_a_password_is_not_replaced() {
    let first = ok(parent(spec(1, "16.1", "1Gi", None), Value::Null), vec![]);
    let mut children = observed(&first, 1);
    let secret = children.iter_mut().find(|c| c["kind"] == "Secret").unwrap();
    secret["data"].as_object_mut().unwrap().remove("password");
    match reconcile(parent(spec(1, "16.1", "1Gi", None), Value::Null), children) {
        Err(Error::Retry(m)) => assert!(
            m.contains("Secret pg-credentials has no usable \"password\""),
            "{m}"
        ),
        other => panic!("{other:?}"),
    }
}

#[test]
fn one_instance_has_no_disruption_budget() {
    let d = ok(parent(spec(1, "16.1", "1Gi", None), Value::Null), vec![]);
    assert!(
        !names(&d)
            .iter()
            .any(|n| n.starts_with("PodDisruptionBudget"))
    );
    assert!(
        !names(&d)
            .iter()
            .any(|n| n.starts_with("CronJob") || n.starts_with("PersistentVolumeClaim"))
    );
}

#[test]
fn phase_follows_the_statefulset() {
    let p = || parent(spec(3, "16.1", "1Gi", None), Value::Null);
    let first = ok(p(), vec![]);
    let running = ok(p(), observed(&first, 3));
    assert_eq!(phase(&running), "Running");
    assert_eq!(
        ready_condition(&running).status,
        capstan_sdk::ConditionStatus::True
    );
    assert_eq!(running.status_value().unwrap()["readyReplicas"], 3);
    assert_eq!(running.requeue(), None);

    let some = ok(p(), observed(&first, 2));
    assert_eq!(
        (phase(&some), ready_condition(&some).reason.as_str()),
        ("Degraded", "InstancesNotReady")
    );
    assert_eq!(some.requeue(), Some(REQUEUE_WHILE_CONVERGING));

    let none = ok(p(), observed(&first, 0));
    assert_eq!(
        (phase(&none), ready_condition(&none).reason.as_str()),
        ("Pending", "NoInstanceReady")
    );

    let mut rolling = observed(&first, 3);
    for c in &mut rolling {
        if c["kind"] == "StatefulSet" {
            c["status"]["updateRevision"] = json!("pg-2");
            c["status"]["updatedReplicas"] = json!(1);
        }
    }
    let rolling = ok(p(), rolling);
    assert_eq!(
        (phase(&rolling), ready_condition(&rolling).reason.as_str()),
        ("Degraded", "RollingOut")
    );

    // Scaled down from 5 to 3: while the extra pods still exist (and may be ready), the
    // scale-down is a rollout in progress, not Running with too many instances.
    let mut scaling_down = observed(&first, 5);
    for c in &mut scaling_down {
        if c["kind"] == "StatefulSet" {
            c["status"]["replicas"] = json!(5);
        }
    }
    let scaling_down = ok(p(), scaling_down);
    assert_eq!(
        (
            phase(&scaling_down),
            ready_condition(&scaling_down).reason.as_str()
        ),
        ("Degraded", "RollingOut")
    );
}

#[test]
fn events_are_posted_when_the_phase_changes_only() {
    let p = |status| parent(spec(1, "16.1", "1Gi", None), status);
    let first = ok(p(Value::Null), vec![]);
    let running = ok(p(Value::Null), observed(&first, 1));
    assert!(
        running
            .events()
            .iter()
            .any(|e| e.reason == "AllInstancesReady")
    );
    let status = json!({"phase": "Running", "conditions": [{"type": "Ready", "reason": "AllInstancesReady"}]});
    let steady = ok(p(status), observed(&first, 1));
    assert_eq!(steady.events(), &[]);
}

#[test]
fn scaling_and_a_minor_version_change_are_applied() {
    let first = ok(
        parent(spec(3, "16.1", "1Gi", Some("@daily")), Value::Null),
        vec![],
    );
    let d = ok(
        parent(spec(5, "16.2", "1Gi", Some("@daily")), Value::Null),
        observed(&first, 3),
    );
    let sts = child(&d, "StatefulSet", "pg");
    assert_eq!(sts["spec"]["replicas"], 5);
    assert_eq!(
        sts["spec"]["template"]["spec"]["containers"][0]["image"],
        "postgres:16.2"
    );
    assert_eq!(
        sts["metadata"]["annotations"]["db.example.com/version"],
        "16.2"
    );
    assert_eq!(
        child(&d, "CronJob", "pg-dump")["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
            [0]["image"],
        "postgres:16.2"
    );
    assert_eq!(phase(&d), "Degraded", "the rollout has not started");
    let reasons: Vec<&str> = d.events().iter().map(|e| e.reason.as_str()).collect();
    assert!(
        reasons.contains(&"VersionChanged") && reasons.contains(&"Scaled"),
        "{reasons:?}"
    );

    let down = ok(
        parent(spec(1, "16.1", "1Gi", Some("@daily")), Value::Null),
        observed(&first, 3),
    );
    assert_eq!(child(&down, "StatefulSet", "pg")["spec"]["replicas"], 1);
    assert!(
        !names(&down)
            .iter()
            .any(|n| n.starts_with("PodDisruptionBudget"))
    );
}

/// `spec.imageName` replaces `postgres:<version>` in the instances and the dump Job, a
/// refused change keeps the running image, and removing it goes back to the official one.
#[test]
fn an_image_name_replaces_the_official_image_and_is_kept_on_refusal() {
    let with_image = |version: &str, storage: &str, image: &str| {
        let mut spec = spec(3, version, storage, Some("@daily"));
        spec["imageName"] = image.into();
        spec
    };
    let image_of = |d: &Desired| {
        let sts = child(d, "StatefulSet", "pg");
        let cron = child(d, "CronJob", "pg-dump");
        (
            sts["spec"]["template"]["spec"]["containers"][0]["image"].clone(),
            cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]["image"]
                .clone(),
        )
    };
    let first = ok(
        parent(
            with_image("16.15", "1Gi", "registry.example/pg:16.15-a"),
            Value::Null,
        ),
        vec![],
    );
    let want = Value::from("registry.example/pg:16.15-a");
    assert_eq!(image_of(&first), (want.clone(), want.clone()));

    // A storage change is refused: the running image stays, although the spec names
    // another one.
    let refused = ok(
        parent(
            with_image("16.15", "2Gi", "registry.example/pg:16.15-b"),
            Value::Null,
        ),
        observed(&first, 3),
    );
    assert_eq!(phase(&refused), "Failed");
    assert_eq!(image_of(&refused), (want.clone(), want));

    // Without imageName the official image of the version comes back.
    let official = ok(
        parent(spec(3, "16.15", "1Gi", Some("@daily")), Value::Null),
        observed(&first, 3),
    );
    let want = Value::from("postgres:16.15");
    assert_eq!(image_of(&official), (want.clone(), want));

    let spaced = reconcile(
        parent(with_image("16.15", "1Gi", "pg :16"), Value::Null),
        vec![],
    );
    assert!(
        matches!(&spaced, Err(Error::Invalid(m)) if m.contains("spec.imageName")),
        "{spaced:?}"
    );
}

#[test]
fn the_same_size_spelled_differently_changes_nothing() {
    let first = ok(parent(spec(1, "16.1", "1Gi", None), Value::Null), vec![]);
    let d = ok(
        parent(spec(1, "16.1", "1024Mi", None), Value::Null),
        observed(&first, 1),
    );
    assert_eq!(
        child(&d, "StatefulSet", "pg"),
        child(&first, "StatefulSet", "pg")
    );
    assert_eq!(phase(&d), "Running");
}

/// Refused changes: Failed with the reason, one Warning, and every child exactly as
/// the observed ones were built.
#[test]
fn refused_changes_leave_every_child_as_it_was() {
    let first = ok(
        parent(spec(3, "16.1", "1Gi", Some("0 2 * * *")), Value::Null),
        vec![],
    );
    for (changed, reason) in [
        (
            spec(3, "17.0", "1Gi", Some("0 2 * * *")),
            "MajorVersionChange",
        ),
        (spec(3, "16.1", "2Gi", Some("0 2 * * *")), "StorageChange"),
        (spec(3, "16.1", "512Mi", Some("0 2 * * *")), "StorageShrink"),
        (
            spec(3, "16.1", "1Gi", Some("0 2 * * * *")),
            "InvalidSchedule",
        ),
        (
            spec(5, "17.0", "1Gi", Some("@hourly")),
            "MajorVersionChange",
        ),
        (spec(3, "16.1", "lots", Some("0 2 * * *")), "InvalidStorage"),
    ] {
        let d = ok(parent(changed, Value::Null), observed(&first, 3));
        assert_eq!(
            without_routes(d.children()),
            without_routes(first.children()),
            "{reason}"
        );
        assert_eq!(phase(&d), "Failed");
        assert_eq!(d.status_value().unwrap()["readyReplicas"], 3);
        let ready = ready_condition(&d);
        assert_eq!(
            (ready.status, ready.reason.as_str()),
            (capstan_sdk::ConditionStatus::False, reason)
        );
        assert_eq!(d.events().len(), 1, "{:?}", d.events());
        assert_eq!(
            (d.events()[0].type_, d.events()[0].reason.as_str()),
            (EventType::Warning, reason)
        );
        assert_eq!(d.events()[0].message, ready.message);
        assert_eq!(d.requeue(), None);
    }
}

#[test]
fn a_refusal_already_reported_posts_no_new_warning() {
    let first = ok(parent(spec(1, "16.1", "1Gi", None), Value::Null), vec![]);
    let status = json!({"phase": "Failed", "conditions": [{"type": "Ready", "reason": "MajorVersionChange"}]});
    let d = ok(
        parent(spec(1, "17.1", "1Gi", None), status),
        observed(&first, 1),
    );
    assert_eq!(phase(&d), "Failed");
    assert_eq!(d.events(), &[]);
}

#[test]
fn an_invalid_schedule_keeps_the_running_schedule() {
    let first = ok(parent(spec(1, "16.1", "1Gi", None), Value::Null), vec![]);
    let d = ok(
        parent(spec(1, "16.1", "1Gi", Some("nightly")), Value::Null),
        observed(&first, 1),
    );
    assert_eq!(
        without_routes(d.children()),
        without_routes(first.children()),
        "no CronJob was running, none is added"
    );
    assert_eq!(ready_condition(&d).reason, "InvalidSchedule");
}

#[test]
fn an_invalid_new_cluster_creates_nothing() {
    let d = ok(
        parent(spec(3, "16.1", "1Gi", Some("every night")), Value::Null),
        vec![],
    );
    assert_eq!(d.children(), &[] as &[Value]);
    assert_eq!(phase(&d), "Failed");
    assert!(ready_condition(&d).message.contains("spec.backupSchedule"));
    let d = ok(parent(spec(3, "12.1", "1Gi", None), Value::Null), vec![]);
    assert_eq!(ready_condition(&d).reason, "UnsupportedVersion");
}

#[test]
fn removing_the_schedule_keeps_the_dumps() {
    let first = ok(
        parent(spec(1, "16.1", "1Gi", Some("@daily")), Value::Null),
        vec![],
    );
    let d = ok(
        parent(spec(1, "16.1", "1Gi", None), Value::Null),
        observed(&first, 1),
    );
    let n = names(&d);
    assert!(!n.iter().any(|n| n.starts_with("CronJob")), "{n:?}");
    assert_eq!(
        child(&d, "PersistentVolumeClaim", "pg-dumps"),
        child(&first, "PersistentVolumeClaim", "pg-dumps")
    );
}

#[test]
fn specs_the_crd_refuses_are_invalid_errors() {
    for (spec, why) in [
        (
            json!({"instances": 9, "version": "16.1"}),
            "spec.instances is 9",
        ),
        (
            json!({"instances": 1, "version": "16"}),
            "spec.version \"16\"",
        ),
        (json!({"version": "16.1"}), "missing field `instances`"),
    ] {
        match reconcile(parent(spec, Value::Null), vec![]) {
            Err(Error::Invalid(m)) => assert!(m.contains(why), "{m}"),
            other => panic!("{other:?}"),
        }
    }
    let mut p = parent(spec(1, "16.1", "1Gi", None), Value::Null);
    p["metadata"]["name"] = json!("db.prod");
    assert!(matches!(reconcile(p, vec![]), Err(Error::Invalid(_))));
}

/// A v1alpha1 parent is read through the conversion: the same children as its v1 twin,
/// and refusals that name the v1alpha1 fields.
#[test]
fn a_v1alpha1_parent_is_reconciled_as_its_v1_twin() {
    let old = |storage: &str| {
        json!({
            "apiVersion": "db.example.com/v1alpha1", "kind": "PostgreSQLCluster",
            "metadata": {"name": "pg", "namespace": "prod", "uid": "uid-1", "generation": 1},
            "spec": {"replicas": 3, "version": "16.1", "storage": storage, "backupSchedule": "@daily"},
        })
    };
    let first = ok(
        parent(spec(3, "16.1", "1Gi", Some("@daily")), Value::Null),
        vec![],
    );
    let observed = observed(&first, 3);
    let v1 = ok(
        parent(spec(3, "16.1", "1Gi", Some("@daily")), Value::Null),
        observed.clone(),
    );
    let v1alpha1 = ok(old("1Gi"), observed.clone());
    assert_eq!(v1alpha1.children(), v1.children());
    assert_eq!(v1alpha1.status_value(), v1.status_value());
    assert_eq!(phase(&v1alpha1), "Running");

    let shrunk = ok(old("512Mi"), observed);
    assert_eq!(
        ready_condition(&shrunk).message,
        "spec.storage 512Mi is smaller than 1Gi: a volume cannot shrink; set spec.storage back to 1Gi; nothing was changed"
    );
}

/// `validate` and `convert` through the trait, as the export calls them.
#[test]
fn validate_and_convert_are_the_plugin_s() {
    let old = parent(spec(3, "16.1", "1Gi", None), Value::Null);
    let new = parent(spec(3, "17.1", "1Gi", None), Value::Null);
    let refused = PostgresPlugin::validate(Some(&old), &new).unwrap_err();
    assert!(
        refused.starts_with("spec.version 17.1 is a major version change from 16.1"),
        "{refused}"
    );
    assert_eq!(PostgresPlugin::validate(None, &new), Ok(vec![]));
    let converted = PostgresPlugin::convert(old.clone(), "v1alpha1").unwrap();
    assert_eq!(
        converted["spec"],
        json!({"replicas": 3, "version": "16.1", "storage": "1Gi"})
    );
    assert_eq!(
        PostgresPlugin::convert(converted, "db.example.com/v1").unwrap(),
        old
    );
}

/// Observed children as `finalize` sees them.
fn finalize(children: Vec<Value>) -> Finalized {
    let mut p = parent(spec(3, "16.1", "1Gi", Some("@daily")), Value::Null);
    p["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
    PostgresPlugin::finalize(&observe_for::<PostgresPlugin>(p, children)).unwrap()
}

fn wave(f: &Finalized) -> Vec<String> {
    f.deletes()
        .iter()
        .map(|(_, kind, name)| format!("{kind}/{name}"))
        .collect()
}

/// From a full cluster to done: each wave names what is left of its kinds, the host
/// deletes it, and the next call sees the children without it.
#[test]
fn teardown_goes_in_waves_from_what_is_observed() {
    let full = ok(
        parent(spec(3, "16.1", "1Gi", Some("@daily")), Value::Null),
        vec![],
    );
    let mut children = observed(&full, 3);
    let mut waves = Vec::new();
    loop {
        let f = finalize(children.clone());
        if f.is_done() {
            assert_eq!(f.deletes(), &[]);
            break;
        }
        let names = wave(&f);
        assert!(!names.is_empty(), "a wave that is not done names something");
        children.retain(|c| {
            !names.contains(&format!(
                "{}/{}",
                c["kind"].as_str().unwrap(),
                c["metadata"]["name"].as_str().unwrap()
            ))
        });
        waves.push(names);
        assert!(waves.len() <= 3, "{waves:?}");
    }
    assert_eq!(
        waves,
        [
            vec![
                "CronJob/pg-dump",
                "Service/pg",
                "Service/pg-r",
                "Service/pg-ro",
                "Service/pg-rw",
                "EndpointSlice/pg-ro",
                "EndpointSlice/pg-rw"
            ],
            vec!["StatefulSet/pg"],
            vec!["Secret/pg-credentials"],
        ]
    );
    // Never named: garbage-collected once the cluster is gone.
    let left: Vec<String> = children
        .iter()
        .map(|c| {
            format!(
                "{}/{}",
                c["kind"].as_str().unwrap(),
                c["metadata"]["name"].as_str().unwrap()
            )
        })
        .collect();
    assert_eq!(
        left,
        [
            "ConfigMap/pg-topology",
            "ConfigMap/pg-scripts",
            "ServiceAccount/pg-instance",
            "Role/pg-instance",
            "RoleBinding/pg-instance",
            "ConfigMap/pg-report",
            "PodDisruptionBudget/pg",
            "PersistentVolumeClaim/pg-dumps"
        ]
    );
}

#[test]
fn teardown_skips_waves_with_nothing_left() {
    let full = ok(parent(spec(1, "16.1", "1Gi", None), Value::Null), vec![]);
    let children = observed(&full, 1);
    let only = |kinds: &[&str]| -> Vec<Value> {
        children
            .iter()
            .filter(|c| kinds.contains(&c["kind"].as_str().unwrap()))
            .cloned()
            .collect()
    };
    // No schedule: no CronJob, the Services alone.
    assert_eq!(
        wave(&finalize(children.clone())),
        [
            "Service/pg",
            "Service/pg-r",
            "Service/pg-ro",
            "Service/pg-rw",
            "EndpointSlice/pg-ro",
            "EndpointSlice/pg-rw"
        ]
    );
    // Services gone: the StatefulSet, even while the ConfigMap is still there.
    assert_eq!(
        wave(&finalize(only(&["StatefulSet", "Secret", "ConfigMap"]))),
        ["StatefulSet/pg"]
    );
    // One Service left from the first wave: it is named again, nothing else.
    let mut one_service = only(&["StatefulSet", "Secret"]);
    one_service.extend(
        children
            .iter()
            .filter(|c| c["metadata"]["name"] == "pg-rw")
            .cloned(),
    );
    assert_eq!(
        wave(&finalize(one_service)),
        ["Service/pg-rw", "EndpointSlice/pg-rw"]
    );
    // The Secret alone.
    assert_eq!(
        wave(&finalize(only(&["Secret", "ConfigMap"]))),
        ["Secret/pg-credentials"]
    );
    // Nothing the waves delete: done at once.
    assert!(finalize(only(&["ConfigMap", "PersistentVolumeClaim"])).is_done());
    assert!(finalize(vec![]).is_done());
}

/// A StatefulSet being deleted in the foreground is still there: its wave is not over,
/// so the Secret its Pods read is not deleted yet.
#[test]
fn a_child_being_deleted_still_holds_its_wave() {
    let full = ok(parent(spec(3, "16.1", "1Gi", None), Value::Null), vec![]);
    let mut children: Vec<Value> = observed(&full, 3)
        .into_iter()
        .filter(|c| c["kind"] == "StatefulSet" || c["kind"] == "Secret")
        .collect();
    for c in &mut children {
        if c["kind"] == "StatefulSet" {
            c["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:01Z");
            c["metadata"]["finalizers"] = json!(["foregroundDeletion"]);
        }
    }
    assert_eq!(wave(&finalize(children)), ["StatefulSet/pg"]);
}

/// Teardown reads no spec: a parent whose spec reconcile refuses is still deleted.
#[test]
fn teardown_does_not_depend_on_the_spec() {
    let full = ok(parent(spec(1, "16.1", "1Gi", None), Value::Null), vec![]);
    let mut p = parent(json!({"instances": "many"}), Value::Null);
    p["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
    let f =
        PostgresPlugin::finalize(&observe_for::<PostgresPlugin>(p, observed(&full, 1))).unwrap();
    assert_eq!(
        wave(&f),
        [
            "Service/pg",
            "Service/pg-r",
            "Service/pg-ro",
            "Service/pg-rw",
            "EndpointSlice/pg-ro",
            "EndpointSlice/pg-rw"
        ]
    );
}

/// The observed children with the report ConfigMap holding `reports`.
fn with_reports(mut children: Vec<Value>, reports: Value) -> Vec<Value> {
    let report = children
        .iter_mut()
        .find(|c| c["kind"] == "ConfigMap" && c["metadata"]["name"] == "pg-report")
        .expect("the report ConfigMap is a child");
    report["data"] = reports;
    children
}

#[test]
fn the_agents_reports_show_in_the_status_and_a_lagging_standby_degrades_the_cluster() {
    let p = |status: Value| parent(spec(3, "16.1", "1Gi", None), status);
    let first = ok(p(Value::Null), vec![]);
    let running = ok(p(Value::Null), observed(&first, 3));
    assert_eq!(phase(&running), "Running");
    let status = running.status_value().unwrap().clone();
    assert_eq!(status["currentPrimary"], "pg-0");
    assert!(status.get("instances").is_none(), "no report yet: {status}");

    let reports = |pg2_lag: u64| {
        json!({
            "pg-0": format!("epoch=1 role=primary timeline=1 lsn=0/9000000 lag=pg-1:0,pg-2:{pg2_lag}"),
            "pg-1": "epoch=1 role=standby timeline=1 lsn=0/9000000",
            "pg-2": "epoch=1 role=standby timeline=1 lsn=0/7000000",
            // Not an instance of the cluster, and not a report: left out.
            "pg-9": "epoch=1 role=standby timeline=1 lsn=0/1",
            "pg-1x": "garbage",
        })
    };
    let lagging = ok(
        p(status.clone()),
        with_reports(observed(&first, 3), reports(20_000_000)),
    );
    assert_eq!(phase(&lagging), "Degraded");
    let condition = ready_condition(&lagging);
    assert_eq!(condition.reason, "StandbyLagging");
    assert_eq!(
        condition.message,
        "pg-2 replays 19.1 MiB behind pg-0 (more than 16.0 MiB behind)"
    );
    assert_eq!(
        lagging.status_value().unwrap()["instances"],
        json!([
            {"name": "pg-0", "role": "primary", "timeline": 1, "lsn": "0/9000000"},
            {"name": "pg-1", "role": "standby", "timeline": 1, "lsn": "0/9000000", "replayLagBytes": 0},
            {"name": "pg-2", "role": "standby", "timeline": 1, "lsn": "0/7000000", "replayLagBytes": 20_000_000},
        ])
    );
    // Caught up: Running again.
    let caught_up = ok(p(status), with_reports(observed(&first, 3), reports(4096)));
    assert_eq!(phase(&caught_up), "Running");
}

#[test]
fn a_failover_event_names_the_standbys_last_reported_positions() {
    let p = |status: Value| {
        let mut s = spec(3, "16.1", "1Gi", None);
        s["failoverDelay"] = json!(0);
        parent(s, status)
    };
    let first = ok(p(Value::Null), vec![]);
    let running = ok(p(Value::Null), observed(&first, 3));
    let children = with_reports(
        observed(&first, 3),
        json!({
            "pg-0": "epoch=1 role=primary timeline=1 lsn=0/9000000 lag=pg-1:0,pg-2:4096",
            "pg-1": "epoch=1 role=standby timeline=1 lsn=0/9000000",
            "pg-2": "epoch=1 role=standby timeline=1 lsn=0/8FFF000",
        }),
    );
    // pg-0 is not ready: first seen so (the delay starts), then the failover.
    let pods = || vec![pod("pg-0", false), pod("pg-1", true), pod("pg-2", true)];
    let mut status = running.status_value().unwrap().clone();
    let mut failover = None;
    for _ in 0..3 {
        let d = reconcile_with_pods(p(status.clone()), children.clone(), pods()).unwrap();
        status = d.status_value().unwrap().clone();
        if let Some(e) = d.events().iter().find(|e| e.reason == "Failover") {
            failover = Some(e.message.clone());
            break;
        }
    }
    let message = failover.expect("a failover");
    assert!(
        message.ends_with(
            "last reported WAL positions: pg-1 at 0/9000000 (timeline 1), pg-2 at 0/8FFF000 (timeline 1)"
        ),
        "{message}"
    );
}
