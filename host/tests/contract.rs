//! Contract releases side by side: the shipped plugins as built for 0.1.0 (from the
//! project's history, by `cargo xtask plugins`) load and run unchanged next to today's
//! 0.2.0 plugins, in one sandbox; and the 0.2.0 additions work offline — related objects
//! through `customize` (with the hostile cases: too many requests, a name that reaches
//! into another namespace, too many objects, a `customize` that never returns), and the
//! `validate` and `convert` commands on a plugin that declares neither.

mod common;

use std::time::Duration;

use capstan::contract::{Observed, RelatedObject};
use capstan::plugin::{CallError, Sandbox, SandboxConfig};
use capstan::render::{self, RenderError};
use common::{assert_fails_with, capstan, is_uuid, plugin, sandbox, test_plugin};
use serde_json::{Value, json};

fn uuid_parent() -> Value {
    json!({"apiVersion": "demo.operator/v1", "kind": "Uuid",
        "metadata": {"name": "u", "namespace": "default", "uid": "uid-1", "generation": 1}})
}

fn observed(parent: Value) -> Observed {
    Observed {
        parent,
        children: vec![],
        related: vec![],
    }
}

#[test]
fn plugins_built_for_0_1_0_run_unchanged_beside_0_2_0_ones_in_one_sandbox() {
    let sandbox = sandbox();
    let old_uuid = sandbox
        .load_file_blocking(&test_plugin("contract-0.1.0/uuid"))
        .unwrap();
    let old_pg = sandbox
        .load_file_blocking(&test_plugin("contract-0.1.0/postgresql"))
        .unwrap();
    let new_uuid = sandbox.load_file_blocking(&plugin("uuid")).unwrap();
    let mirror = sandbox.load_file_blocking(&test_plugin("mirror")).unwrap();
    assert_eq!(old_uuid.contract(), "0.1.0");
    assert_eq!(old_pg.contract(), "0.1.0");
    assert_eq!(new_uuid.contract(), "0.2.0");
    assert_eq!(mirror.contract(), "0.2.0");
    assert_eq!(old_uuid.info().contract, "0.1.0");
    // Same plugin, two releases: the same declaration but for the release.
    assert_eq!(old_uuid.info().parent, new_uuid.info().parent);
    assert!(old_uuid.info().related.is_empty() && old_uuid.info().validation.is_none());

    for uuid in [&old_uuid, &new_uuid] {
        let rendered = render::render(uuid, &observed(uuid_parent()), "t").unwrap();
        let status = serde_json::to_value(&rendered).unwrap()["status"].clone();
        assert!(
            is_uuid(status["uuid"].as_str().unwrap_or_default()),
            "{}: {status}",
            uuid.contract()
        );
    }
    let pg_parent = json!({"apiVersion": "db.example.com/v1alpha1", "kind": "PostgreSQLCluster",
        "metadata": {"name": "pg", "namespace": "default", "uid": "uid-2", "generation": 1},
        "spec": {"replicas": 2, "version": "16.15", "storage": "1Gi"}});
    let rendered = render::render(&old_pg, &observed(pg_parent), "t").unwrap();
    let rendered = serde_json::to_value(&rendered).unwrap();
    assert!(
        rendered["children"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c["kind"] == "StatefulSet"),
        "{rendered}"
    );

    // What 0.1.0 lacks is empty, without a call: no related objects, every change
    // allowed, no conversion.
    assert_eq!(
        old_uuid
            .customize_blocking(&uuid_parent())
            .unwrap()
            .unwrap(),
        []
    );
    assert_eq!(
        old_uuid
            .validate_blocking(None, &uuid_parent())
            .unwrap()
            .unwrap(),
        Vec::<String>::new()
    );
    let refused = old_uuid
        .convert_blocking(&uuid_parent(), "v2")
        .unwrap()
        .unwrap_err();
    assert!(refused.contains("does not convert"), "{refused}");
}

#[test]
fn inspect_names_the_release_a_plugin_was_built_for() {
    let out = capstan(&[
        "inspect",
        test_plugin("contract-0.1.0/uuid").to_str().unwrap(),
    ]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("contract: 0.1.0"));
    let out = capstan(&["inspect", test_plugin("mirror").to_str().unwrap()]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("contract: 0.2.0"), "{text}");
    assert!(text.contains("related:"), "{text}");
}

fn mirror_parent(spec: Value) -> Value {
    json!({"apiVersion": "test.capstan.dev/v1", "kind": "Mirror",
        "metadata": {"name": "m", "namespace": "team-a", "uid": "uid-m", "generation": 1},
        "spec": spec})
}

fn configmap(ns: &str, name: &str, value: &str) -> RelatedObject {
    RelatedObject {
        kind_index: 0,
        object: json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": ns}, "data": {"value": value}}),
    }
}

fn pod(ns: &str, name: &str, instance: &str) -> RelatedObject {
    RelatedObject {
        kind_index: 1,
        object: json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns,
                "labels": {"mirror.test.capstan.dev/instance": instance}}}),
    }
}

#[test]
fn a_plugin_sees_exactly_the_related_objects_its_requests_select_in_its_namespace() {
    let mirror = sandbox()
        .load_file_blocking(&test_plugin("mirror"))
        .unwrap();
    let existing = vec![
        configmap("team-a", "app", "from team-a"),
        configmap("team-b", "app", "from team-b"),
        configmap("team-a", "unasked", "x"),
        pod("team-a", "m-0", "m"),
        pod("team-a", "m-1", "m"),
        pod("team-a", "other-0", "other"),
        pod("team-b", "m-0", "m"),
    ];
    let mut observed = observed(mirror_parent(json!({"configMap": "app"})));
    let requests = render::customize(&mirror, &mut observed, &existing).unwrap();
    assert_eq!(requests.len(), 2);
    let seen: Vec<(String, String)> = observed
        .related
        .iter()
        .map(|r| {
            let m = &r.object["metadata"];
            (
                m["namespace"].as_str().unwrap().into(),
                m["name"].as_str().unwrap().into(),
            )
        })
        .collect();
    assert_eq!(
        seen,
        [
            ("team-a".into(), "app".into()),
            ("team-a".into(), "m-0".into()),
            ("team-a".into(), "m-1".into())
        ]
    );
    let rendered = render::render(&mirror, &observed, "t").unwrap();
    let status = serde_json::to_value(&rendered).unwrap()["status"].clone();
    assert_eq!(status["value"], "from team-a");
    assert_eq!(status["pods"], json!(["m-0", "m-1"]));
}

#[test]
fn hostile_customize_requests_are_refused_with_a_clear_reason() {
    let mirror = sandbox()
        .load_file_blocking(&test_plugin("mirror"))
        .unwrap();
    let refused = |mode: &str, existing: &[RelatedObject]| -> String {
        let mut observed = observed(mirror_parent(json!({"mode": mode})));
        let err = render::customize(&mirror, &mut observed, existing).unwrap_err();
        assert!(observed.related.is_empty(), "{mode}: nothing is passed on");
        err.to_string()
    };
    let err = refused("too-many", &[]);
    assert!(err.contains("100000") && err.contains("64"), "{err}");
    let err = refused(
        "other-namespace",
        &[configmap(
            "kube-system",
            "extension-apiserver-authentication",
            "secret",
        )],
    );
    assert!(
        err.contains("kube-system/extension-apiserver-authentication"),
        "{err}"
    );
    assert!(!err.contains('\n'), "{err}");

    // 1001 Pods selected: over the 1000 objects a call may receive.
    let pods: Vec<RelatedObject> = (0..1001)
        .map(|i| pod("team-a", &format!("m-{i}"), "m"))
        .collect();
    let mut observed = observed(mirror_parent(json!({})));
    let err = render::customize(&mirror, &mut observed, &pods).unwrap_err();
    assert!(matches!(err, RenderError::Violation(_)), "{err}");
    assert!(err.to_string().contains("1000"), "{err}");
}

#[test]
fn a_customize_that_never_returns_is_stopped_at_its_deadline() {
    let sandbox = Sandbox::new(SandboxConfig {
        deadline: Duration::from_millis(300),
        ..SandboxConfig::default()
    })
    .unwrap();
    let mirror = sandbox.load_file_blocking(&test_plugin("mirror")).unwrap();
    let started = std::time::Instant::now();
    let err = mirror
        .customize_blocking(&mirror_parent(json!({"mode": "loop"})))
        .unwrap_err();
    assert!(matches!(err, CallError::Deadline { .. }), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn render_related_reads_the_objects_that_exist_from_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let parent = dir.path().join("mirror.yaml");
    std::fs::write(
        &parent,
        "apiVersion: test.capstan.dev/v1\nkind: Mirror\nmetadata: {name: m}\nspec: {configMap: app}\n",
    )
    .unwrap();
    let related = dir.path().join("related.yaml");
    std::fs::write(
        &related,
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: app}\ndata: {value: hello}\n---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: app, namespace: elsewhere}\ndata: {value: not this one}\n",
    )
    .unwrap();
    let mirror = test_plugin("mirror");
    let args = |extra: &[&str]| {
        let mut a = vec![
            "render",
            "--plugin",
            mirror.to_str().unwrap(),
            "--parent",
            parent.to_str().unwrap(),
        ];
        a.extend_from_slice(extra);
        a.into_iter().map(String::from).collect::<Vec<_>>()
    };
    let run = |a: Vec<String>| capstan(&a.iter().map(String::as_str).collect::<Vec<_>>());
    let out = run(args(&["--related", related.to_str().unwrap()]));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed: Value = serde_yaml_ng::from_slice(&out.stdout).unwrap();
    assert_eq!(printed["status"]["value"], "hello");
    let out = run(args(&[]));
    let printed: Value = serde_yaml_ng::from_slice(&out.stdout).unwrap();
    assert_eq!(
        printed["status"]["value"],
        Value::Null,
        "nothing exists without --related"
    );

    // A related object of a kind the plugin does not declare: one clear line.
    let secret = dir.path().join("secret.yaml");
    std::fs::write(
        &secret,
        "apiVersion: v1\nkind: Secret\nmetadata: {name: s}\n",
    )
    .unwrap();
    let a = args(&["--related", secret.to_str().unwrap()]);
    assert_fails_with(
        &a.iter().map(String::as_str).collect::<Vec<_>>(),
        "Secret.v1 is not a related kind of plugin mirror",
    );
}

#[test]
fn validate_and_convert_refuse_a_plugin_that_declares_neither() {
    let dir = tempfile::tempdir().unwrap();
    let obj = dir.path().join("u.yaml");
    std::fs::write(&obj, serde_yaml_ng::to_string(&uuid_parent()).unwrap()).unwrap();
    let uuid = plugin("uuid");
    assert_fails_with(
        &[
            "validate",
            "--plugin",
            uuid.to_str().unwrap(),
            "--new",
            obj.to_str().unwrap(),
        ],
        "plugin uuid does not validate",
    );
    assert_fails_with(
        &[
            "convert",
            "--plugin",
            uuid.to_str().unwrap(),
            "--object",
            obj.to_str().unwrap(),
            "--to",
            "v2",
        ],
        "does not convert",
    );
}
