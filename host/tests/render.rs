//! What `capstan render`, `inspect` and `crd` print for the real plugins, as plugin
//! authors use them: the goldens, and every bad input giving one clear error line.

mod common;

use capstan::contract::Observed;
use capstan::render;
use common::{
    assert_fails_with, assert_golden, capstan, is_uuid, mask, plugin, root, sandbox, test_plugin,
    uuid_other_build, widget_parent,
};
use serde_json::{Value, json};

fn render_uuid(status: Value) -> Value {
    let plugin = sandbox().load_file_blocking(&plugin("uuid")).unwrap();
    let parent = json!({
        "apiVersion": "demo.operator/v1", "kind": "Uuid",
        "metadata": {"name": "u", "namespace": "default", "uid": "uid-1", "generation": 1},
        "status": status,
    });
    let rendered = render::render(
        &plugin,
        &Observed {
            parent,
            children: vec![],
            related: Vec::new(),
        },
        "2026-01-01T00:00:00Z",
    )
    .unwrap();
    serde_json::to_value(&rendered).unwrap()
}

#[test]
fn fresh_uuid_gets_a_v4_uuid_and_state_ok() {
    let out = render_uuid(Value::Null);
    let uuid = out["status"]["uuid"].as_str().unwrap();
    assert!(is_uuid(uuid), "{uuid}");
    assert_eq!(&uuid[14..15], "4", "version nibble of {uuid}");
    assert!(
        matches!(&uuid[19..20], "8" | "9" | "a" | "b"),
        "variant of {uuid}"
    );
    assert_eq!(out["status"]["state"], "Ok");
    assert_eq!(out["status"]["observedGeneration"], 1);
    assert_eq!(out["status"]["conditions"][0]["type"], "Ready");
    assert_eq!(out["status"]["conditions"][0]["status"], "True");
    assert_eq!(out["children"], json!([]));
}

#[test]
fn rendering_with_the_status_observed_keeps_the_uuid() {
    let first = render_uuid(Value::Null);
    let second = render_uuid(first["status"].clone());
    assert_eq!(second["status"]["uuid"], first["status"]["uuid"]);
    // Unchanged status means no write: the host compares exactly this value.
    assert_eq!(second["status"], first["status"]);
    let third = render_uuid(Value::Null);
    assert_ne!(
        third["status"]["uuid"], first["status"]["uuid"],
        "each new Uuid gets its own"
    );
}

#[test]
fn cli_render_of_the_sample_matches_the_golden_file() {
    let out = capstan(&[
        "render",
        "--plugin",
        plugin("uuid").to_str().unwrap(),
        "--parent",
        root().join("crds/samples/uuid.yaml").to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut value: Value = serde_yaml_ng::from_slice(&out.stdout).unwrap();
    assert!(is_uuid(value["status"]["uuid"].as_str().unwrap()));
    mask(&mut value);
    assert_golden("uuid-sample", &serde_yaml_ng::to_string(&value).unwrap());
}

#[test]
fn widget_children_are_decorated_by_the_host() {
    let p = sandbox()
        .load_file_blocking(&test_plugin("widget"))
        .unwrap();
    let parent = json!({"apiVersion": "test.capstan.dev/v1", "kind": "Widget",
        "metadata": {"name": "w", "namespace": "team-a", "uid": "uid-w", "generation": 4},
        "spec": {"count": 2, "service": true, "message": "hi"}});
    let rendered = render::render(
        &p,
        &Observed {
            parent,
            children: vec![],
            related: Vec::new(),
        },
        "2026-01-01T00:00:00Z",
    )
    .unwrap();
    let value = serde_json::to_value(&rendered).unwrap();
    assert_golden("widget-count-2", &serde_yaml_ng::to_string(&value).unwrap());
}

#[test]
fn inspect_and_crd_print_what_the_plugin_declares() {
    let out = capstan(&["inspect", plugin("uuid").to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let info: Value = serde_yaml_ng::from_slice(&out.stdout).unwrap();
    assert_eq!(info["name"], "uuid");
    assert_eq!(info["parent"]["group"], "demo.operator");
    assert_eq!(info["parent"]["plural"], "uuid");
    assert_eq!(info["crd"], true);
    assert_eq!(info["sha256"].as_str().unwrap().len(), 64);

    let out = capstan(&["crd", plugin("uuid").to_str().unwrap()]);
    assert!(out.status.success());
    let printed: Value = serde_yaml_ng::from_slice(&out.stdout).unwrap();
    let shipped: Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(root().join("crds/uuid.yaml")).unwrap())
            .unwrap();
    assert_eq!(
        printed, shipped,
        "the CRD the plugin ships must be crds/uuid.yaml"
    );
}

#[test]
fn a_plugin_built_with_cargo_component_renders_too() {
    let path = uuid_other_build();
    assert!(
        path.exists(),
        "{} is missing: run `cargo xtask test` (it builds it with cargo component)",
        path.display()
    );
    let plugin = sandbox().load_file_blocking(&path).unwrap();
    let parent = json!({"apiVersion": "demo.operator/v1", "kind": "Uuid",
        "metadata": {"name": "u", "namespace": "default", "uid": "x", "generation": 1}});
    let rendered = render::render(
        &plugin,
        &Observed {
            parent,
            children: vec![],
            related: Vec::new(),
        },
        "t",
    )
    .unwrap();
    let status = &serde_json::to_value(&rendered).unwrap()["status"];
    assert!(is_uuid(status["uuid"].as_str().unwrap()));
}

#[test]
fn bad_files_give_one_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let sample = root().join("crds/samples/uuid.yaml");
    let sample = sample.to_str().unwrap();

    assert_fails_with(
        &[
            "render",
            "--plugin",
            "/nonexistent/p.wasm",
            "--parent",
            sample,
        ],
        "cannot read /nonexistent/p.wasm",
    );

    let text = dir.path().join("text.wasm");
    std::fs::write(&text, "apiVersion: v1\n").unwrap();
    assert_fails_with(
        &["inspect", text.to_str().unwrap()],
        "is not a WebAssembly component: not a WebAssembly binary",
    );

    let module = dir.path().join("module.wasm");
    std::fs::write(&module, b"\0asm\x01\0\0\0").unwrap();
    assert_fails_with(
        &["inspect", module.to_str().unwrap()],
        "it is a core wasm module",
    );

    let uuid = plugin("uuid");
    let uuid = uuid.to_str().unwrap();
    assert_fails_with(
        &[
            "render",
            "--plugin",
            uuid,
            "--parent",
            "/nonexistent/cr.yaml",
        ],
        "cannot read /nonexistent/cr.yaml",
    );

    let bad_yaml = dir.path().join("bad.yaml");
    std::fs::write(&bad_yaml, "apiVersion: demo.operator/v1\nkind: [Uuid\n").unwrap();
    assert_fails_with(
        &[
            "render",
            "--plugin",
            uuid,
            "--parent",
            bad_yaml.to_str().unwrap(),
        ],
        "invalid YAML",
    );

    let wrong_kind = dir.path().join("cm.yaml");
    std::fs::write(
        &wrong_kind,
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n",
    )
    .unwrap();
    assert_fails_with(
        &[
            "render",
            "--plugin",
            uuid,
            "--parent",
            wrong_kind.to_str().unwrap(),
        ],
        "plugin uuid reconciles Uuid.demo.operator/v1",
    );
}

#[test]
fn oversized_output_is_refused_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let widget = test_plugin("widget");
    // Memory enough for the plugin to build it: the host's limits must refuse it.
    for (mode, expected) in [
        (
            "big-status",
            "plugin output refused: status is 20971531 bytes or items, over the limit of 262144",
        ),
        (
            "many-children",
            "plugin output refused: the list of children is 100000 bytes or items, over the limit of 256",
        ),
    ] {
        let parent = widget_parent(&dir, mode);
        assert_fails_with(
            &[
                "render",
                "--plugin",
                widget.to_str().unwrap(),
                "--parent",
                &parent,
                "--plugin-memory-mib",
                "512",
                "--plugin-timeout-ms",
                "10000",
            ],
            expected,
        );
    }
}
