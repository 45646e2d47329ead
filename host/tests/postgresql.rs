//! The PostgreSQLCluster plugin through the host's render path, with no cluster: golden
//! files for fresh clusters (1 and 3 instances, with and without a backup schedule), a
//! running cluster, and each refused change; the password's life: random, kept when
//! the Secret is observed, and nowhere but in the Secret; the teardown waves through
//! `finalize`; and admission through `validate` and `capstan validate`.
//!
//! Regenerate the golden files with `CAPSTAN_UPDATE_GOLDEN=1`. Passwords and the scripts
//! are masked in them; the scripts are compared with plugins/postgresql/scripts/ here.

mod common;

use std::sync::OnceLock;
use std::time::Duration;

use capstan::contract::{Observed, ObservedChild, RelatedObject};
use capstan::plugin::{Plugin, Sandbox, SandboxConfig};
use capstan::render;
use common::{
    assert_fails_with, assert_golden, capstan, child, kinds_and_names, plugin, root, secret_data,
};
use serde_json::{Value, json};

const NOW: &str = "2026-01-01T00:00:00Z";
const SECRET: &str = "pg-credentials";

/// The plugin, compiled once for all the tests here (each call is a fresh instance).
fn load() -> Plugin {
    static PLUGIN: OnceLock<Plugin> = OnceLock::new();
    PLUGIN
        .get_or_init(|| {
            Sandbox::new(SandboxConfig {
                deadline: Duration::from_secs(2),
                memory_limit: 64 << 20,
                cache_dir: None,
                ..SandboxConfig::default()
            })
            .unwrap()
            .load_file_blocking(&plugin("postgresql"))
            .unwrap()
        })
        .clone()
}

fn parent(spec: Value, status: Value) -> Value {
    json!({
        "apiVersion": "db.example.com/v1alpha1", "kind": "PostgreSQLCluster",
        "metadata": {"name": "pg", "namespace": "prod", "uid": "uid-pg", "generation": 1},
        "spec": spec,
        "status": status,
    })
}

fn spec(replicas: u32, version: &str, storage: &str, schedule: Option<&str>) -> Value {
    let mut spec = json!({"replicas": replicas, "version": version, "storage": storage});
    if let Some(s) = schedule {
        spec["backupSchedule"] = json!(s);
    }
    spec
}

/// What the host would pass the plugin: `parent` and `children` matched to its kinds,
/// and the instance Pods the observed StatefulSet's status implies (its first
/// `readyReplicas` instances, ready).
fn observed(plugin: &Plugin, parent: Value, children: &[Value]) -> Observed {
    let ready = children
        .iter()
        .find(|c| c["kind"] == "StatefulSet")
        .and_then(|s| s["status"]["readyReplicas"].as_u64())
        .unwrap_or(0);
    let related = (0..ready)
        .map(|o| RelatedObject {
            kind_index: 0,
            object: json!({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": format!("pg-{o}"), "namespace": "prod", "uid": format!("uid-pg-{o}"),
                             "labels": {"app.kubernetes.io/name": "postgresql", "app.kubernetes.io/instance": "pg"}},
                "status": {"podIP": format!("10.1.0.{}", o + 10),
                           "conditions": [{"type": "Ready", "status": "True"}]},
            }),
        })
        .collect();
    let children = children
        .iter()
        .map(|c| {
            let (api_version, kind) = (
                c["apiVersion"].as_str().unwrap(),
                c["kind"].as_str().unwrap(),
            );
            let index = plugin
                .info()
                .children
                .iter()
                .position(|k| k.matches(api_version, kind))
                .unwrap_or_else(|| panic!("{kind} is not a declared child kind"));
            ObservedChild {
                kind_index: index as u32,
                object: c.clone(),
            }
        })
        .collect();
    Observed {
        parent,
        children,
        related,
    }
}

/// One reconcile through the host's render path, as JSON.
fn render(plugin: &Plugin, parent: Value, children: &[Value]) -> Value {
    let rendered = render::render(plugin, &observed(plugin, parent, children), NOW)
        .unwrap_or_else(|e| panic!("render failed: {e}"));
    serde_json::to_value(&rendered).unwrap()
}

/// The rendered children as the API server would return them: with a uid, and the
/// StatefulSet with a status saying `ready` pods are ready and the rollout is done.
fn as_observed(rendered: &Value, ready: u32) -> Vec<Value> {
    rendered["children"]
        .as_array()
        .unwrap()
        .iter()
        .cloned()
        .map(|mut c| {
            c["metadata"]["uid"] =
                json!(format!("uid-{}", c["metadata"]["name"].as_str().unwrap()));
            c["metadata"]["resourceVersion"] = json!("7");
            if c["kind"] == "StatefulSet" {
                let replicas = c["spec"]["replicas"].clone();
                c["metadata"]["generation"] = json!(1);
                c["status"] = json!({
                    "replicas": replicas, "readyReplicas": ready, "updatedReplicas": replicas,
                    "currentRevision": "pg-7d4b9c", "updateRevision": "pg-7d4b9c",
                    "observedGeneration": 1,
                });
            }
            c
        })
        .collect()
}

fn secret_value(rendered: &Value, key: &str) -> String {
    secret_data(rendered, SECRET, key)
}

/// Masks the passwords (and the URI holding one) and the scripts, after checking that
/// the scripts are the files in plugins/postgresql/scripts/.
fn masked(rendered: &Value) -> String {
    let mut value = rendered.clone();
    for c in value["children"].as_array_mut().unwrap() {
        match c["kind"].as_str().unwrap() {
            "Secret" => {
                for key in ["password", "replication-password", "uri"] {
                    c["data"][key] = json!(format!("<{key}>"));
                }
            }
            "ConfigMap" if c["metadata"]["name"] == "pg-scripts" => {
                for (file, text) in c["data"].as_object_mut().unwrap() {
                    let shipped = std::fs::read_to_string(
                        root().join("plugins/postgresql/scripts").join(file),
                    )
                    .unwrap_or_else(|e| panic!("{file}: {e}"));
                    assert_eq!(text.as_str().unwrap(), shipped, "ConfigMap key {file}");
                    *text = json!(format!("<plugins/postgresql/scripts/{file}>"));
                }
            }
            _ => {}
        }
    }
    serde_yaml_ng::to_string(&value).unwrap()
}

#[test]
fn fresh_clusters_match_the_golden_files() {
    let plugin = load();
    for (name, replicas, schedule) in [
        ("postgresql-replicas-1", 1, None),
        ("postgresql-replicas-1-backup", 1, Some("0 2 * * *")),
        ("postgresql-replicas-3", 3, None),
        (
            "postgresql-replicas-3-backup",
            3,
            Some("*/30 1-5 * * mon-fri"),
        ),
    ] {
        let out = render(
            &plugin,
            parent(spec(replicas, "16.1", "1Gi", schedule), Value::Null),
            &[],
        );
        let children = kinds_and_names(&out);
        assert_eq!(
            children.contains(&"PodDisruptionBudget/pg".into()),
            replicas > 1,
            "{name}: {children:?}"
        );
        assert_eq!(
            children.contains(&"CronJob/pg-dump".into()),
            schedule.is_some(),
            "{name}"
        );
        assert_eq!(
            children.contains(&"PersistentVolumeClaim/pg-dumps".into()),
            schedule.is_some(),
            "{name}"
        );
        assert_eq!(out["status"]["phase"], "Pending");
        assert_eq!(out["requeueAfter"], "10s");
        assert_golden(name, &masked(&out));
    }
}

#[test]
fn cli_render_of_the_sample_matches_the_golden_file() {
    let out = capstan(&[
        "render",
        "--plugin",
        plugin("postgresql").to_str().unwrap(),
        "--parent",
        root()
            .join("crds/samples/postgresqlcluster.yaml")
            .to_str()
            .unwrap(),
    ]);
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut value: Value = serde_yaml_ng::from_slice(&out.stdout).unwrap();
    // The CLI prints the time it ran at.
    value["status"]["conditions"][0]["lastTransitionTime"] = json!("<time>");
    assert_eq!(child(&value, "StatefulSet", "demo")["spec"]["replicas"], 3);
    let password = {
        let encoded = child(&value, "Secret", "demo-credentials")["data"]["password"].clone();
        let bytes: k8s_openapi::ByteString = serde_json::from_value(encoded).unwrap();
        String::from_utf8(bytes.0).unwrap()
    };
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains(&password),
        "the password is in the log"
    );
    for c in value["children"].as_array_mut().unwrap() {
        if c["kind"] == "Secret" {
            for key in ["password", "replication-password", "uri"] {
                c["data"][key] = json!(format!("<{key}>"));
            }
        }
        // The report ConfigMap has no data of the plugin's own.
        if c["kind"] == "ConfigMap"
            && let Some(data) = c["data"].as_object_mut()
        {
            for text in data.values_mut() {
                *text = json!("<script>");
            }
        }
    }
    assert_golden(
        "postgresql-sample",
        &serde_yaml_ng::to_string(&value).unwrap(),
    );
}

#[test]
fn the_password_is_random_kept_and_never_shown() {
    let plugin = load();
    let p = || parent(spec(3, "16.1", "1Gi", Some("@daily")), Value::Null);
    let first = render(&plugin, p(), &[]);
    let password = secret_value(&first, "password");
    let replication = secret_value(&first, "replication-password");
    for secret in [&password, &replication] {
        assert!(secret.len() >= 24, "{secret}");
        assert!(
            secret.bytes().all(|b| b.is_ascii_alphanumeric()),
            "{secret}"
        );
    }
    assert_ne!(password, replication);
    assert_eq!(
        secret_value(&first, "uri"),
        format!("postgresql://app:{password}@pg-rw.prod.svc:5432/app")
    );
    assert_ne!(
        secret_value(&render(&plugin, p(), &[]), "password"),
        password,
        "a new cluster gets a new password"
    );

    // Observed Secret: the same password, whatever else is observed, however often.
    let observed = as_observed(&first, 3);
    let secret_only = [observed
        .iter()
        .find(|c| c["kind"] == "Secret")
        .unwrap()
        .clone()];
    for children in [&observed[..], &secret_only[..]] {
        for _ in 0..3 {
            let again = render(&plugin, p(), children);
            assert_eq!(secret_value(&again, "password"), password);
            assert_eq!(secret_value(&again, "replication-password"), replication);
            assert_eq!(
                child(&again, "Secret", SECRET),
                child(&first, "Secret", SECRET)
            );
        }
    }

    // Nowhere but in the Secret: not in status, conditions, events or other children.
    for rendered in [&first, &render(&plugin, p(), &observed)] {
        let mut public = rendered.clone();
        public["children"]
            .as_array_mut()
            .unwrap()
            .retain(|c| c["kind"] != "Secret");
        let text = public.to_string();
        for secret in [&password, &replication] {
            assert!(!text.contains(secret.as_str()), "a password leaked: {text}");
        }
    }
}

#[test]
fn a_running_cluster_matches_the_golden_file_and_is_stable() {
    let plugin = load();
    let p = |status| parent(spec(3, "16.1", "1Gi", Some("0 2 * * *")), status);
    let first = render(&plugin, p(Value::Null), &[]);
    let observed = as_observed(&first, 3);
    let running = render(&plugin, p(Value::Null), &observed);
    assert_eq!(running["status"]["phase"], "Running");
    assert_eq!(running["status"]["readyReplicas"], 3);
    assert_eq!(running["status"]["primaryEndpoint"], "pg-rw.prod.svc:5432");
    let unrouted = |rendered: &Value| -> Vec<Value> {
        rendered["children"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["kind"] != "EndpointSlice")
            .map(|c| {
                // The topology is written at the version it was observed at.
                let mut c = c.clone();
                c["metadata"]
                    .as_object_mut()
                    .unwrap()
                    .remove("resourceVersion");
                c
            })
            .collect()
    };
    assert_eq!(
        unrouted(&running),
        unrouted(&first),
        "nothing but the routes changes once created"
    );
    let endpoints = |name: &str| -> Vec<Value> {
        child(&running, "EndpointSlice", name)["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["targetRef"]["name"].clone())
            .collect()
    };
    assert_eq!(endpoints("pg-rw"), [json!("pg-0")]);
    assert_eq!(endpoints("pg-ro"), [json!("pg-1"), json!("pg-2")]);
    assert_eq!(running["status"]["currentPrimary"], "pg-0");
    assert_eq!(
        child(&running, "ConfigMap", "pg-topology")["metadata"]["resourceVersion"],
        "7",
        "a compare-and-swap on the version observed"
    );
    assert_golden("postgresql-running", &masked(&running));

    // With its own status observed: the same status (no write), no new event.
    let steady = render(&plugin, p(running["status"].clone()), &observed);
    assert_eq!(steady["status"], running["status"]);
    assert_eq!(steady["events"], json!([]));
    assert_eq!(steady["children"], running["children"]);
}

#[test]
fn a_minor_version_change_rolls_the_statefulset() {
    let plugin = load();
    let first = render(
        &plugin,
        parent(spec(3, "16.1", "1Gi", None), Value::Null),
        &[],
    );
    let out = render(
        &plugin,
        parent(spec(3, "16.2", "1Gi", None), Value::Null),
        &as_observed(&first, 3),
    );
    let sts = child(&out, "StatefulSet", "pg");
    assert_eq!(
        sts["spec"]["template"]["spec"]["containers"][0]["image"],
        "postgres:16.2"
    );
    assert_eq!(out["status"]["phase"], "Degraded");
    assert_eq!(out["status"]["conditions"][0]["reason"], "RollingOut");
    assert!(
        out["events"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["reason"] == "VersionChanged")
    );
}

/// Each refused change: phase Failed, a Ready condition with the reason, one Warning
/// event, and every child exactly as before, so the host changes and prunes nothing.
#[test]
fn refused_changes_match_the_golden_files_and_change_nothing() {
    let plugin = load();
    let before = spec(3, "16.1", "1Gi", Some("0 2 * * *"));
    let first = render(&plugin, parent(before.clone(), Value::Null), &[]);
    let observed = as_observed(&first, 3);
    let running = render(&plugin, parent(before, Value::Null), &observed);
    for (name, changed, reason, says) in [
        (
            "postgresql-refused-major-version",
            spec(3, "17.2", "1Gi", Some("0 2 * * *")),
            "MajorVersionChange",
            "spec.version 17.2 is a major version change from 16.1",
        ),
        (
            "postgresql-refused-storage",
            spec(3, "16.1", "5Gi", Some("0 2 * * *")),
            "StorageChange",
            "spec.storage 5Gi is larger than 1Gi",
        ),
        (
            "postgresql-refused-storage-shrink",
            spec(3, "16.1", "500Mi", Some("0 2 * * *")),
            "StorageShrink",
            "spec.storage 500Mi is smaller than 1Gi: a volume cannot shrink",
        ),
        (
            "postgresql-refused-schedule",
            spec(3, "16.1", "1Gi", Some("0 2 * *")),
            "InvalidSchedule",
            "spec.backupSchedule is not a valid cron expression",
        ),
    ] {
        let out = render(
            &plugin,
            parent(changed, running["status"].clone()),
            &observed,
        );
        assert_eq!(
            out["children"], running["children"],
            "{name}: the children must stay as they were"
        );
        assert_eq!(out["status"]["phase"], "Failed", "{name}");
        assert_eq!(out["status"]["readyReplicas"], 3, "{name}");
        let ready = &out["status"]["conditions"][0];
        assert_eq!(
            (ready["type"].as_str(), ready["status"].as_str()),
            (Some("Ready"), Some("False"))
        );
        assert_eq!(ready["reason"], reason, "{name}");
        let message = ready["message"].as_str().unwrap();
        assert!(message.contains(says), "{name}: {message}");
        assert!(
            message.ends_with("; nothing was changed"),
            "{name}: {message}"
        );
        assert_eq!(
            out["events"],
            json!([{"type": "Warning", "reason": reason, "message": message}]),
            "{name}"
        );
        assert_golden(name, &masked(&out));
    }
}

#[test]
fn the_shipped_crd_is_what_the_plugin_describes() {
    let out = capstan(&["crd", plugin("postgresql").to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed: Value = serde_yaml_ng::from_slice(&out.stdout).unwrap();
    let shipped: Value = serde_yaml_ng::from_str(
        &std::fs::read_to_string(root().join("crds/postgresqlcluster.yaml")).unwrap(),
    )
    .unwrap();
    assert_eq!(printed, shipped);
    assert_eq!(shipped["spec"]["names"]["shortNames"], json!(["pgc"]));
    let version = &shipped["spec"]["versions"][0];
    let columns: Vec<&str> = version["additionalPrinterColumns"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(columns, ["Phase", "Primary", "Ready", "Endpoint", "Age"]);
    let spec = &version["schema"]["openAPIV3Schema"]["properties"]["spec"];
    assert_eq!(spec["required"], json!(["replicas", "version"]));
    assert_eq!(spec["properties"]["replicas"]["maximum"], 7);
    assert_eq!(spec["properties"]["storage"]["default"], "10Gi");

    let out = capstan(&["inspect", plugin("postgresql").to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let info: Value = serde_yaml_ng::from_slice(&out.stdout).unwrap();
    assert_eq!(info["name"], "postgresql");
    assert_eq!(info["parent"]["kind"], "PostgreSQLCluster");
    assert_eq!(info["finalizer"], true);
    assert_eq!(info["validation"], "Fail");
}

/// `finalize` through the host, from a running cluster to done: each wave names what is
/// left of its kinds, and the next call sees the children without it.
#[test]
fn teardown_goes_in_waves_through_the_host() {
    let plugin = load();
    let p = parent(spec(3, "16.1", "1Gi", Some("0 2 * * *")), Value::Null);
    let mut children = as_observed(&render(&plugin, p.clone(), &[]), 3);
    let mut deleting = p;
    deleting["metadata"]["deletionTimestamp"] = json!(NOW);
    deleting["metadata"]["finalizers"] = json!(["capstan.dev/finalizer"]);
    let mut waves = Vec::new();
    loop {
        let result = plugin
            .finalize_blocking(&observed(&plugin, deleting.clone(), &children))
            .unwrap()
            .unwrap_or_else(|e| panic!("finalize failed: {e}"));
        if result.delete.is_empty() {
            assert!(result.done, "no wave and not done after {waves:?}");
            break;
        }
        let wave: Vec<String> = result
            .delete
            .iter()
            .map(|r| {
                let kind = &plugin.info().children[r.kind_index as usize].kind;
                format!("{kind}/{}", r.name)
            })
            .collect();
        children.retain(|c| {
            let name = format!(
                "{}/{}",
                c["kind"].as_str().unwrap(),
                c["metadata"]["name"].as_str().unwrap()
            );
            !wave.contains(&name)
        });
        waves.push(wave);
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
}

/// Admission through the host's `validate` call: each refusal with its own one-line
/// message, and allowed changes with their warnings.
#[test]
fn admission_refuses_with_one_line_messages() {
    let plugin = load();
    let running = parent(spec(3, "16.1", "1Gi", Some("0 2 * * *")), Value::Null);
    for (old, new, says) in [
        (
            Some(&running),
            spec(3, "17.1", "1Gi", Some("0 2 * * *")),
            "spec.version 17.1 is a major version change from 16.1: that needs pg_upgrade",
        ),
        (
            Some(&running),
            spec(3, "16.1", "500Mi", Some("0 2 * * *")),
            "spec.storage 500Mi is smaller than 1Gi: a volume cannot shrink; set spec.storage back to 1Gi",
        ),
        (
            Some(&running),
            spec(3, "16.1", "2G", Some("0 2 * * *")),
            "spec.storage 2G is larger than 1Gi: a StatefulSet's volume claim templates cannot change",
        ),
        (
            Some(&running),
            spec(3, "16.1", "1Gi", Some("0 2 * *")),
            "spec.backupSchedule is not a valid cron expression: \"0 2 * *\" has 4 fields",
        ),
        (
            None,
            spec(3, "16.1", "1Gi", Some("nightly")),
            "spec.backupSchedule is not a valid cron expression",
        ),
        (
            None,
            spec(9, "16.1", "1Gi", None),
            "spec.replicas is 9; it must be between 1 and 7",
        ),
    ] {
        let refused = plugin
            .validate_blocking(old, &parent(new, Value::Null))
            .unwrap()
            .expect_err(says);
        assert!(refused.starts_with(says), "{refused}");
        assert_eq!(refused.lines().count(), 1, "{refused}");
    }
    let minor = parent(spec(1, "16.2", "1024Mi", None), Value::Null);
    let warnings = plugin
        .validate_blocking(Some(&running), &minor)
        .unwrap()
        .unwrap_or_else(|e| panic!("refused: {e}"));
    assert_eq!(
        warnings,
        [
            "the instances restart one by one to run postgres:16.2 (standbys first, the primary last): writes pause while the primary restarts",
            "spec.replicas 3 -> 1: the highest instances stop; their volumes are kept",
        ]
    );
    assert_eq!(
        plugin.validate_blocking(None, &running).unwrap(),
        Ok(Vec::new())
    );
}

/// `capstan validate` on the sample: allowed as it is, refused on one line shrunk.
#[test]
fn cli_validate_of_the_sample() {
    let sample = root().join("crds/samples/postgresqlcluster.yaml");
    let wasm = plugin("postgresql");
    let out = capstan(&[
        "validate",
        "--plugin",
        wasm.to_str().unwrap(),
        "--new",
        sample.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dir = tempfile::tempdir().unwrap();
    let shrunk = dir.path().join("shrunk.yaml");
    let text = std::fs::read_to_string(&sample).unwrap();
    assert!(text.contains("storage: 1Gi"), "the sample changed: {text}");
    std::fs::write(&shrunk, text.replace("storage: 1Gi", "storage: 512Mi")).unwrap();
    assert_fails_with(
        &[
            "validate",
            "--plugin",
            wasm.to_str().unwrap(),
            "--old",
            sample.to_str().unwrap(),
            "--new",
            shrunk.to_str().unwrap(),
        ],
        "capstan: refused: spec.storage 512Mi is smaller than 1Gi: a volume cannot shrink",
    );
}
