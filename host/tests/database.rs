//! The Database plugin (Python, built with componentize-py) through the host's render
//! path, with no cluster: golden files for fresh PostgreSQL Databases (1 and 3
//! instances) and a fresh MySQL one, the refusals (mysql with 3 replicas, an engine
//! change, specs the CRD would refuse), the mirrored PostgreSQLCluster status, the
//! password's life, and the shipped CRD.
//!
//! Regenerate the golden files with `CAPSTAN_UPDATE_GOLDEN=1`; passwords are masked.

mod common;

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use capstan::contract::{Observed, ObservedChild, PluginError};
use capstan::plugin::{Plugin, Sandbox, SandboxConfig};
use capstan::render::{self, RenderError};
use common::{assert_golden, capstan, child, kinds_and_names, plugin, root, secret_data};
use serde_json::{Value, json};

const NOW: &str = "2026-01-01T00:00:00Z";

fn sandbox() -> Sandbox {
    Sandbox::new(SandboxConfig {
        deadline: Duration::from_secs(2),
        memory_limit: 64 << 20,
        cache_dir: None,
        ..SandboxConfig::default()
    })
    .unwrap()
}

/// The plugin, compiled once for all the tests here (each call is a fresh instance).
fn load() -> Plugin {
    static PLUGIN: OnceLock<Plugin> = OnceLock::new();
    PLUGIN
        .get_or_init(|| {
            let started = Instant::now();
            let plugin = sandbox().load_file_blocking(&plugin("database")).unwrap();
            eprintln!("compiled database.wasm in {:?}", started.elapsed());
            plugin
        })
        .clone()
}

fn database(spec: Value, status: Value) -> Value {
    json!({
        "apiVersion": "mycompany.com/v1", "kind": "Database",
        "metadata": {"name": "app", "namespace": "prod", "uid": "uid-app", "generation": 1},
        "spec": spec,
        "status": status,
    })
}

fn spec(engine: &str, version: &str, storage: &str, replicas: u32) -> Value {
    json!({"engine": engine, "version": version, "storage": storage, "replicas": replicas})
}

fn observed(plugin: &Plugin, parent: Value, children: &[Value]) -> Observed {
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
        related: Vec::new(),
    }
}

/// `capstan` with a compile cache shared by this file's tests: the component takes
/// seconds to compile, the cached code milliseconds to load.
fn cli(args: &[&str]) -> std::process::Output {
    let cache = std::env::temp_dir().join("capstan-test-database-cache");
    let mut args = args.to_vec();
    args.extend(["--cache-dir", cache.to_str().unwrap()]);
    capstan(&args)
}

/// One reconcile through the host's render path, as JSON.
fn render(plugin: &Plugin, parent: Value, children: &[Value]) -> Value {
    let rendered = render::render(plugin, &observed(plugin, parent, children), NOW)
        .unwrap_or_else(|e| panic!("render failed: {e}"));
    serde_json::to_value(&rendered).unwrap()
}

/// The message of the `invalid` error a render must end with.
fn invalid(plugin: &Plugin, parent: Value, children: &[Value]) -> String {
    match render::render(plugin, &observed(plugin, parent, children), NOW) {
        Err(RenderError::Plugin(PluginError::Invalid(m))) => m,
        Err(e) => panic!("expected an invalid error, got {e}"),
        Ok(r) => panic!(
            "expected an invalid error, got {}",
            serde_json::to_string(&r).unwrap()
        ),
    }
}

/// The rendered children as the API server returns them: with a uid and a generation.
fn as_observed(rendered: &Value) -> Vec<Value> {
    rendered["children"]
        .as_array()
        .unwrap()
        .iter()
        .cloned()
        .map(|mut c| {
            c["metadata"]["uid"] =
                json!(format!("uid-{}", c["metadata"]["name"].as_str().unwrap()));
            c["metadata"]["generation"] = json!(1);
            c
        })
        .collect()
}

fn secret_value(rendered: &Value, key: &str) -> String {
    secret_data(rendered, "app-credentials", key)
}

/// The rendered output as YAML, passwords masked.
fn masked(rendered: &Value) -> String {
    let mut value = rendered.clone();
    for c in value["children"].as_array_mut().unwrap() {
        if c["kind"] == "Secret" {
            for key in ["password", "root-password"] {
                c["data"][key] = json!(format!("<{key}>"));
            }
        }
    }
    serde_yaml_ng::to_string(&value).unwrap()
}

#[test]
fn postgresql_databases_become_one_cluster_and_match_the_golden_files() {
    let plugin = load();
    for (name, version, replicas, cluster_version) in [
        ("database-postgresql-replicas-1", "16", 1, "16.15"),
        ("database-postgresql-replicas-3", "17.2", 3, "17.2"),
    ] {
        let out = render(
            &plugin,
            database(spec("postgresql", version, "5Gi", replicas), Value::Null),
            &[],
        );
        assert_eq!(kinds_and_names(&out), ["PostgreSQLCluster/app"], "{name}");
        assert_eq!(
            child(&out, "PostgreSQLCluster", "app")["spec"],
            json!({"replicas": replicas, "version": cluster_version, "storage": "5Gi"}),
            "{name}"
        );
        assert_eq!(out["status"]["phase"], "Pending", "{name}");
        assert_eq!(out["status"]["version"], cluster_version, "{name}");
        assert_eq!(out["requeueAfter"], "10s", "{name}");
        assert_golden(name, &masked(&out));
    }
}

/// The PostgreSQLCluster the Database plugin writes is one the PostgreSQL plugin
/// accepts: its version rule gives major.minor, as that CRD's pattern wants.
#[test]
fn the_cluster_it_writes_is_accepted_by_the_postgresql_plugin() {
    let out = render(
        &load(),
        database(spec("postgresql", "16", "1Gi", 3), Value::Null),
        &[],
    );
    let mut cluster = child(&out, "PostgreSQLCluster", "app").clone();
    cluster["metadata"]["uid"] = json!("uid-pgc");
    cluster["metadata"]["generation"] = json!(1);
    let pg = sandbox().load_file_blocking(&plugin("postgresql")).unwrap();
    let rendered = render::render(
        &pg,
        &Observed {
            parent: cluster,
            children: vec![],
            related: Vec::new(),
        },
        NOW,
    )
    .unwrap_or_else(|e| panic!("the PostgreSQL plugin refused the cluster: {e}"));
    let rendered = serde_json::to_value(&rendered).unwrap();
    let sts = child(&rendered, "StatefulSet", "app");
    assert_eq!(sts["spec"]["replicas"], 3);
    assert_eq!(
        sts["spec"]["template"]["spec"]["containers"][0]["image"],
        "postgres:16.15"
    );
}

#[test]
fn the_database_mirrors_the_cluster_s_status() {
    let plugin = load();
    let p = |status| database(spec("postgresql", "16", "1Gi", 3), status);
    let first = render(&plugin, p(Value::Null), &[]);
    let mut observed = as_observed(&first);
    observed[0]["status"] = json!({
        "phase": "Running", "readyReplicas": 3, "primaryEndpoint": "app-rw.prod.svc:5432",
        "observedGeneration": 1,
        "conditions": [{"type": "Ready", "status": "True", "reason": "AllInstancesReady",
            "message": "3 of 3 instances of PostgreSQL 16.10 ready",
            "lastTransitionTime": NOW}],
    });
    let running = render(&plugin, p(Value::Null), &observed);
    assert_eq!(running["status"]["phase"], "Running");
    assert_eq!(running["status"]["readyReplicas"], 3);
    assert_eq!(running["status"]["endpoint"], "app-rw.prod.svc:5432");
    let ready = &running["status"]["conditions"][0];
    assert_eq!(
        (&ready["status"], &ready["reason"]),
        (&json!("True"), &json!("AllInstancesReady"))
    );
    assert_eq!(running["children"], first["children"]);
    assert!(running.get("requeueAfter").is_none_or(Value::is_null));
    // With its own status observed: the same status (no write), no new event.
    let steady = render(&plugin, p(running["status"].clone()), &observed);
    assert_eq!(steady["status"], running["status"]);
    assert_eq!(steady["events"], json!([]));

    // The cluster refuses a change (its phase Failed): so does the Database.
    observed[0]["status"]["phase"] = json!("Failed");
    observed[0]["status"]["conditions"][0]["reason"] = json!("StorageChange");
    let failed = render(&plugin, p(running["status"].clone()), &observed);
    assert_eq!(failed["status"]["phase"], "Failed");
    assert_eq!(failed["status"]["conditions"][0]["reason"], "StorageChange");
    assert_eq!(failed["events"][0]["type"], "Warning");
}

#[test]
fn a_mysql_database_matches_the_golden_file() {
    let plugin = load();
    let out = render(
        &plugin,
        database(spec("mysql", "8.4", "2Gi", 1), Value::Null),
        &[],
    );
    assert_eq!(
        kinds_and_names(&out),
        ["Secret/app-credentials", "Service/app", "StatefulSet/app"]
    );
    let sts = child(&out, "StatefulSet", "app");
    assert_eq!(sts["spec"]["replicas"], 1);
    assert_eq!(
        sts["spec"]["template"]["spec"]["containers"][0]["image"],
        "mysql:8.4"
    );
    assert_eq!(out["status"]["endpoint"], "app.prod.svc.cluster.local");
    assert_eq!(out["status"]["phase"], "Pending");
    assert_golden("database-mysql-replicas-1", &masked(&out));

    // Ready and rolled out: Running.
    let mut observed = as_observed(&out);
    for c in &mut observed {
        if c["kind"] == "StatefulSet" {
            c["status"] = json!({"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1,
                "currentRevision": "app-1", "updateRevision": "app-1", "observedGeneration": 1});
        }
    }
    let running = render(
        &plugin,
        database(spec("mysql", "8.4", "2Gi", 1), Value::Null),
        &observed,
    );
    assert_eq!(running["status"]["phase"], "Running");
    assert_eq!(running["status"]["readyReplicas"], 1);
    assert_eq!(running["children"], out["children"]);
}

#[test]
fn the_mysql_password_is_random_kept_and_never_shown() {
    let plugin = load();
    let p = || database(spec("mysql", "8.4", "2Gi", 1), Value::Null);
    let first = render(&plugin, p(), &[]);
    let password = secret_value(&first, "password");
    let root_password = secret_value(&first, "root-password");
    for secret in [&password, &root_password] {
        assert_eq!(secret.len(), 24, "{secret}");
        assert!(
            secret.bytes().all(|b| b.is_ascii_alphanumeric()),
            "{secret}"
        );
    }
    assert_ne!(password, root_password);
    assert_ne!(
        secret_value(&render(&plugin, p(), &[]), "password"),
        password,
        "a new Database gets a new password"
    );
    let observed = as_observed(&first);
    for _ in 0..3 {
        let again = render(&plugin, p(), &observed);
        assert_eq!(
            child(&again, "Secret", "app-credentials"),
            child(&first, "Secret", "app-credentials")
        );
    }
    for rendered in [&first, &render(&plugin, p(), &observed)] {
        let mut public = rendered.clone();
        public["children"]
            .as_array_mut()
            .unwrap()
            .retain(|c| c["kind"] != "Secret");
        let text = public.to_string();
        for secret in [&password, &root_password] {
            assert!(!text.contains(secret.as_str()), "a password leaked: {text}");
        }
    }
}

#[test]
fn mysql_with_three_replicas_is_refused() {
    let message = invalid(
        &load(),
        database(spec("mysql", "8.4", "2Gi", 3), Value::Null),
        &[],
    );
    assert!(
        message.contains("MySQL replication is not implemented"),
        "{message}"
    );
    assert_golden(
        "database-mysql-replicas-3-refused",
        &serde_yaml_ng::to_string(&json!({"invalid": message})).unwrap(),
    );
}

/// An engine change on a live Database: phase Failed, a Warning, and every child
/// returned exactly as before, so the host changes and prunes nothing.
#[test]
fn an_engine_change_is_refused_and_changes_nothing() {
    let plugin = load();
    let mysql = spec("mysql", "8.4", "2Gi", 1);
    let first = render(&plugin, database(mysql.clone(), Value::Null), &[]);
    let observed = as_observed(&first);
    let running = render(&plugin, database(mysql, Value::Null), &observed);
    let out = render(
        &plugin,
        database(
            spec("postgresql", "16", "2Gi", 1),
            running["status"].clone(),
        ),
        &observed,
    );
    assert_eq!(
        out["children"], first["children"],
        "the children must stay as they were"
    );
    assert_eq!(out["status"]["phase"], "Failed");
    assert_eq!(out["status"]["engine"], "mysql");
    let ready = &out["status"]["conditions"][0];
    assert_eq!(
        (&ready["status"], &ready["reason"]),
        (&json!("False"), &json!("EngineChange"))
    );
    let message = ready["message"].as_str().unwrap();
    assert!(
        message.contains("set spec.engine back to mysql"),
        "{message}"
    );
    assert_eq!(
        out["events"],
        json!([{"type": "Warning", "reason": "EngineChange", "message": message}])
    );
    assert_golden("database-engine-change-refused", &masked(&out));

    // The other way round: the PostgreSQLCluster stays as it was.
    let pg = render(
        &plugin,
        database(spec("postgresql", "16", "2Gi", 3), Value::Null),
        &[],
    );
    let out = render(
        &plugin,
        database(spec("mysql", "8.4", "2Gi", 1), pg["status"].clone()),
        &as_observed(&pg),
    );
    assert_eq!(out["children"], pg["children"]);
    assert_eq!(out["status"]["phase"], "Failed");
    assert_eq!(out["status"]["conditions"][0]["reason"], "EngineChange");
}

/// What the CRD refuses (a bad enum, out-of-bounds replicas) never reaches the plugin in
/// a cluster, but `capstan render` can send it: each is an `invalid` error that says why.
#[test]
fn invalid_specs_say_why() {
    let plugin = load();
    let mut messages = serde_json::Map::new();
    for (case, spec, says) in [
        (
            "engine-missing",
            json!({"version": "16"}),
            "spec.engine is required",
        ),
        (
            "engine-oracle",
            json!({"engine": "oracle"}),
            "\"oracle\" is not one of postgresql, mysql",
        ),
        (
            "replicas-0",
            json!({"engine": "postgresql", "replicas": 0}),
            "between 1 and 5",
        ),
        (
            "replicas-6",
            json!({"engine": "postgresql", "replicas": 6}),
            "between 1 and 5",
        ),
        (
            "storage-lots",
            json!({"engine": "mysql", "storage": "lots"}),
            "not a Kubernetes quantity",
        ),
        (
            "postgresql-12",
            json!({"engine": "postgresql", "version": "12"}),
            "runs PostgreSQL 13 to 18",
        ),
        (
            "postgresql-16.x",
            json!({"engine": "postgresql", "version": "16.x"}),
            "is not a PostgreSQL major",
        ),
        (
            "mysql-5.7",
            json!({"engine": "mysql", "version": "5.7"}),
            "MySQL 8.0 and later",
        ),
    ] {
        let message = invalid(&plugin, database(spec, Value::Null), &[]);
        assert!(message.contains(says), "{case}: {message}");
        messages.insert(case.into(), json!(message));
    }
    assert_golden(
        "database-invalid-spec",
        &serde_yaml_ng::to_string(&Value::Object(messages)).unwrap(),
    );
}

#[test]
fn cli_render_of_the_samples_succeeds() {
    for (sample, kinds) in [
        ("database.yaml", vec!["PostgreSQLCluster"]),
        (
            "database-mysql.yaml",
            vec!["Secret", "Service", "StatefulSet"],
        ),
    ] {
        let out = cli(&[
            "render",
            "--plugin",
            plugin("database").to_str().unwrap(),
            "--parent",
            root().join("crds/samples").join(sample).to_str().unwrap(),
        ]);
        assert!(
            out.status.success(),
            "{sample}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let value: Value = serde_yaml_ng::from_slice(&out.stdout).unwrap();
        let rendered: Vec<&str> = value["children"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["kind"].as_str().unwrap())
            .collect();
        assert_eq!(rendered, kinds, "{sample}");
    }
}

/// The CRD is seed 000's: group, version, names, scope, the four spec fields with their
/// enum and bounds; plus status, printer columns and a short name.
#[test]
fn the_shipped_crd_is_the_seed_s_and_what_the_plugin_describes() {
    let out = cli(&["crd", plugin("database").to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed: Value = serde_yaml_ng::from_slice(&out.stdout).unwrap();
    let shipped: Value = serde_yaml_ng::from_str(
        &std::fs::read_to_string(root().join("crds/database.yaml")).unwrap(),
    )
    .unwrap();
    assert_eq!(printed, shipped, "crds/database.yaml is stale");
    assert_eq!(shipped["metadata"]["name"], "databases.mycompany.com");
    assert_eq!(shipped["spec"]["group"], "mycompany.com");
    assert_eq!(shipped["spec"]["scope"], "Namespaced");
    let names = &shipped["spec"]["names"];
    assert_eq!(
        (&names["plural"], &names["singular"], &names["kind"]),
        (&json!("databases"), &json!("database"), &json!("Database"))
    );
    assert_eq!(names["shortNames"], json!(["db"]));
    let version = &shipped["spec"]["versions"][0];
    assert_eq!(version["name"], "v1");
    assert_eq!(version["subresources"]["status"], json!({}));
    let spec = &version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"];
    let fields: Vec<&String> = spec.as_object().unwrap().keys().collect();
    assert_eq!(fields, ["engine", "replicas", "storage", "version"]);
    assert_eq!(spec["engine"]["enum"], json!(["postgresql", "mysql"]));
    assert_eq!(
        (&spec["replicas"]["minimum"], &spec["replicas"]["maximum"]),
        (&json!(1), &json!(5))
    );
    assert_eq!(spec["replicas"]["type"], "integer");
    assert_eq!(
        (&spec["version"]["type"], &spec["storage"]["type"]),
        (&json!("string"), &json!("string"))
    );
    let columns: Vec<&str> = version["additionalPrinterColumns"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        columns,
        ["Engine", "Version", "Phase", "Ready", "Endpoint", "Age"]
    );
}
