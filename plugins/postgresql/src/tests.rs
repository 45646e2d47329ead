//! Reconcile tests, natively: fresh clusters, observed state read back, allowed and
//! refused changes, and the phase judged from the StatefulSet.

use capstan_sdk::testing::observe_for;
use capstan_sdk::{EventType, Plugin};
use serde_json::{Value, json};

use super::*;

fn parent(spec: Value, status: Value) -> Value {
    json!({
        "apiVersion": "db.example.com/v1alpha1", "kind": "PostgreSQLCluster",
        "metadata": {"name": "pg", "namespace": "prod", "uid": "uid-1", "generation": 1},
        "spec": spec,
        "status": status,
    })
}

fn spec(replicas: i64, version: &str, storage: &str, schedule: Option<&str>) -> Value {
    let mut spec = json!({"replicas": replicas, "version": version, "storage": storage});
    if let Some(s) = schedule {
        spec["backupSchedule"] = json!(s);
    }
    spec
}

fn reconcile(parent: Value, children: Vec<Value>) -> Result<Desired, Error> {
    PostgresPlugin::reconcile(&observe_for::<PostgresPlugin>(parent, children))
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

fn phase(d: &Desired) -> &str {
    d.status_value().unwrap()["phase"].as_str().unwrap()
}

fn ready_condition(d: &Desired) -> &Condition {
    d.conditions().iter().find(|c| c.type_ == "Ready").unwrap()
}

#[test]
fn describe_declares_the_parent_children_and_crd() {
    let info = PostgresPlugin::describe();
    assert_eq!(info.parent.api_version(), "db.example.com/v1alpha1");
    assert_eq!(info.parent.plural, "postgresqlclusters");
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
            "PersistentVolumeClaim.v1"
        ]
    );
    let crd: Value = serde_json::from_str(info.crd.as_deref().unwrap()).unwrap();
    assert_eq!(crd["metadata"]["name"], "postgresqlclusters.db.example.com");
    assert_eq!(crd["spec"]["names"]["shortNames"], json!(["pgc"]));
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
            "Secret/pg-credentials",
            "ConfigMap/pg-scripts",
            "Service/pg",
            "Service/pg-rw",
            "Service/pg-r",
            "StatefulSet/pg",
            "PodDisruptionBudget/pg",
            "CronJob/pg-dump",
            "PersistentVolumeClaim/pg-dumps"
        ]
    );
    assert_eq!(
        d.status_value().unwrap(),
        &json!({"phase": "Pending", "readyReplicas": 0, "primaryEndpoint": "pg-rw.prod.svc:5432"})
    );
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
    assert_eq!(
        child(&d, "Service", "pg-rw")["spec"]["selector"]["statefulset.kubernetes.io/pod-name"],
        "pg-0"
    );
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
    children[0]["data"]
        .as_object_mut()
        .unwrap()
        .remove("password");
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
        assert_eq!(d.children(), first.children(), "{reason}");
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
        d.children(),
        first.children(),
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
            json!({"replicas": 9, "version": "16.1"}),
            "spec.replicas is 9",
        ),
        (
            json!({"replicas": 1, "version": "16"}),
            "spec.version \"16\"",
        ),
        (json!({"version": "16.1"}), "missing field `replicas`"),
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
