//! The TypeScript example plugin (plugins/greeting-ts, a componentize-js component)
//! through `capstan render`, `inspect` and `crd`, as its authors use them: golden files
//! for a new and a ready Greeting, and a wrong spec giving one clear error line.
//!
//! Regenerate the golden files with `CAPSTAN_UPDATE_GOLDEN=1`.

mod common;

use std::path::PathBuf;
use std::process::Output;
use std::sync::OnceLock;

use common::{assert_golden, capstan, mask, root, test_plugin};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use serde_json::Value;

/// The plugin's sample manifests.
fn sample(name: &str) -> String {
    root()
        .join("plugins/greeting-ts/samples")
        .join(name)
        .display()
        .to_string()
}

/// `capstan <command> <args> --cache-dir …`: compiling the 12 MB component takes seconds,
/// so the first call here fills a compile cache and every later one loads from it.
fn capstan_cached(command: &str, args: &[&str]) -> Output {
    static CACHE: OnceLock<PathBuf> = OnceLock::new();
    let wasm = test_plugin("greeting-ts");
    let cache = CACHE.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("greeting-ts-cache");
        let out = capstan(&[
            "inspect",
            "--cache-dir",
            dir.to_str().unwrap(),
            wasm.to_str().unwrap(),
        ]);
        assert!(out.status.success(), "{}", stderr(&out));
        dir
    });
    let mut all = vec![command, "--cache-dir", cache.to_str().unwrap()];
    if command == "render" {
        all.extend(["--plugin", wasm.to_str().unwrap()]);
    } else {
        all.push(wasm.to_str().unwrap());
    }
    all.extend(args);
    capstan(&all)
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn yaml(out: &Output) -> Value {
    assert!(out.status.success(), "stderr: {}", stderr(out));
    serde_yaml_ng::from_slice(&out.stdout).unwrap()
}

#[test]
fn a_new_greeting_matches_the_golden_file() {
    let mut value = yaml(&capstan_cached(
        "render",
        &["--parent", &sample("greeting.yaml")],
    ));
    assert_eq!(value["status"]["phase"], "Pending");
    assert_eq!(value["requeueAfter"], "5s");
    mask(&mut value);
    assert_golden(
        "greeting-ts-new",
        &serde_yaml_ng::to_string(&value).unwrap(),
    );
}

#[test]
fn a_greeting_with_its_config_map_observed_matches_the_golden_file() {
    let mut value = yaml(&capstan_cached(
        "render",
        &[
            "--parent",
            &sample("greeting.yaml"),
            "--observed",
            &sample("observed.yaml"),
        ],
    ));
    assert_eq!(value["status"]["phase"], "Ready");
    mask(&mut value);
    assert_golden(
        "greeting-ts-ready",
        &serde_yaml_ng::to_string(&value).unwrap(),
    );
}

#[test]
fn a_wrong_spec_is_one_clear_line() {
    let out = capstan_cached("render", &["--parent", &sample("invalid.yaml")]);
    assert!(!out.status.success());
    assert_eq!(
        stderr(&out),
        "capstan: reconcile failed: invalid spec: spec.message: a non-empty string is required\n"
    );
}

#[test]
fn inspect_and_crd_print_what_the_plugin_declares() {
    let info = yaml(&capstan_cached("inspect", &[]));
    assert_eq!(info["name"], "greeting");
    assert_eq!(info["parent"]["group"], "example.com");
    assert_eq!(info["children"][0]["kind"], "ConfigMap");
    assert_eq!(info["crd"], true);

    let crd = capstan_cached("crd", &[]);
    assert!(crd.status.success(), "{}", stderr(&crd));
    let typed: CustomResourceDefinition = serde_yaml_ng::from_slice(&crd.stdout).unwrap();
    assert_eq!(typed.spec.names.kind, "Greeting");
    assert_golden("greeting-ts-crd", &String::from_utf8(crd.stdout).unwrap());
}
