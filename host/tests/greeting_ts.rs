//! The TypeScript example plugin (plugins/greeting-ts, a componentize-js component)
//! through `capstan test`, `inspect` and `crd`, as its authors use them: the golden
//! files of its samples (a new and a ready Greeting, a wrong spec giving one clear error
//! line) and of its CRD.
//!
//! Regenerate the samples' golden files with `capstan test --update plugins/greeting-ts`,
//! the CRD's with `CAPSTAN_UPDATE_GOLDEN=1`.

mod common;

use std::path::PathBuf;
use std::process::Output;
use std::sync::OnceLock;

use common::{assert_golden, capstan, root, test_plugin};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use serde_json::Value;

/// `capstan <command> <args> --cache-dir …`: compiling the 12 MB component takes seconds,
/// so the first call here fills a compile cache and every later one loads from it.
/// The compile cache the first call fills.
static CACHE: OnceLock<PathBuf> = OnceLock::new();

fn capstan_cached(command: &str, args: &[&str]) -> Output {
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

/// The example's golden tests are `capstan test plugins/greeting-ts`, as an author runs
/// them: its samples (a new Greeting, one whose ConfigMap exists, a wrong spec) against
/// their golden files. What each golden file must say is checked here too, so that a
/// wrong one accepted by `--update` cannot pass.
#[test]
fn capstan_test_passes_on_the_example_and_its_golden_files_say_what_they_should() {
    let cache = capstan_cached("inspect", &[]);
    assert!(cache.status.success(), "{}", stderr(&cache));
    let project = root().join("plugins/greeting-ts");
    let out = capstan(&[
        "test",
        project.to_str().unwrap(),
        "--cache-dir",
        CACHE.get().unwrap().to_str().unwrap(),
    ]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{said}{}", stderr(&out));
    assert!(
        said.contains("3 samples: all match their golden files"),
        "{said}"
    );

    let golden = |name: &str| -> Value {
        let path = project.join(format!("samples/{name}.golden.yaml"));
        serde_yaml_ng::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
    };
    let new = golden("greeting");
    assert_eq!(new["status"]["phase"], "Pending");
    assert_eq!(new["requeueAfter"], "5s");
    assert_eq!(
        new["children"][0]["data"]["greeting.txt"],
        "Hello, Alice!\nHello, Bob!\n"
    );
    assert_eq!(golden("ready")["status"]["phase"], "Ready");
    assert_eq!(
        golden("invalid")["error"],
        "reconcile failed: invalid spec: spec.message: a non-empty string is required"
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
