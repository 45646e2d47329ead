//! Helpers shared by the host's integration tests: finding the built plugins and the
//! binary, golden files, masking the random parts of rendered output, the CLI's
//! one-line errors, and a thread's CPU time.
#![allow(dead_code, unused_imports)] // each test file uses a part

use std::path::Path;
use std::process::Output;
use std::time::Duration;

use capstan::contract::Observed;
use capstan::plugin::{Plugin, Sandbox, SandboxConfig};

use serde_json::{Value, json};

/// Where the built plugins and the workspace are: shared with the end-to-end tests.
pub use capstan_e2e::operator::{plugin, root, test_plugin, uuid_other_build};

/// Runs the `capstan` binary.
pub fn capstan(args: &[&str]) -> Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_capstan"))
        .args(args)
        .env_remove("CAPSTAN_LOG")
        .output()
        .expect("run capstan")
}

/// Replaces values that change on every run with stable placeholders.
pub fn mask(value: &mut Value) {
    match value {
        Value::Object(map) => {
            for (key, v) in map.iter_mut() {
                match (key.as_str(), &v) {
                    ("lastTransitionTime", Value::String(_)) => *v = Value::String("<time>".into()),
                    (_, Value::String(s)) if is_uuid(s) => *v = Value::String("<uuid>".into()),
                    _ => mask(v),
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(mask),
        _ => {}
    }
}

/// Whether `s` is a hyphenated UUID.
pub fn is_uuid(s: &str) -> bool {
    s.len() == 36
        && s.char_indices().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => c == '-',
            _ => c.is_ascii_hexdigit(),
        })
}

/// Compares `actual` with the golden file `tests/golden/<name>.yaml`. With
/// `CAPSTAN_UPDATE_GOLDEN=1`, writes it instead (and the test still reads it back).
pub fn assert_golden(name: &str, actual: &str) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(format!("{name}.yaml"));
    if std::env::var_os("CAPSTAN_UPDATE_GOLDEN").is_some() {
        std::fs::write(&path, actual).unwrap();
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (write it with CAPSTAN_UPDATE_GOLDEN=1)",
            path.display()
        )
    });
    assert_eq!(
        actual,
        expected,
        "rendered output differs from {}",
        path.display()
    );
}

/// The rendered child of `kind` named `name`.
pub fn child<'a>(rendered: &'a Value, kind: &str, name: &str) -> &'a Value {
    rendered["children"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["kind"] == kind && c["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} in {rendered}"))
}

/// The decoded value of `key` in the rendered Secret `secret`.
pub fn secret_data(rendered: &Value, secret: &str, key: &str) -> String {
    let encoded = child(rendered, "Secret", secret)["data"][key].clone();
    let bytes: k8s_openapi::ByteString = serde_json::from_value(encoded).unwrap();
    String::from_utf8(bytes.0).unwrap()
}

/// `Kind/name` of every rendered child, in order.
pub fn kinds_and_names(rendered: &Value) -> Vec<String> {
    rendered["children"]
        .as_array()
        .unwrap()
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

/// A sandbox for the render and sandbox tests: calls stopped at 500 ms, 32 MiB each.
pub fn sandbox() -> Sandbox {
    Sandbox::new(SandboxConfig {
        deadline: Duration::from_millis(500),
        memory_limit: 32 << 20,
        cache_dir: None,
        ..SandboxConfig::default()
    })
    .unwrap()
}

/// Runs `capstan` and checks that it failed with exactly one line containing `expected`.
pub fn assert_fails_with(args: &[&str], expected: &str) {
    let out = capstan(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(1),
        "exit code for {args:?}; stderr: {stderr}"
    );
    assert_eq!(
        stderr.lines().count(),
        1,
        "one line for {args:?}, got:\n{stderr}"
    );
    assert!(stderr.starts_with("capstan: "), "{stderr}");
    assert!(
        stderr.contains(expected),
        "{stderr:?} should contain {expected:?}"
    );
    // The paths the command was given may contain anything (a temporary directory's
    // random name can hold "0x"): only what capstan wrote around them is checked.
    let said = args
        .iter()
        .fold(stderr.to_string(), |said, arg| said.replace(arg, "<arg>"));
    for noise in [
        "backtrace",
        "RUST_BACKTRACE",
        "panicked at",
        "wasm function",
        "0x",
    ] {
        assert!(!said.contains(noise), "{stderr:?} contains {noise:?}");
    }
    assert!(out.stdout.is_empty(), "nothing on stdout for a failure");
}

/// Writes a Widget parent whose spec asks the test plugin for `mode`; returns its path.
pub fn widget_parent(dir: &tempfile::TempDir, mode: &str) -> String {
    let path = dir.path().join(format!("{mode}.yaml"));
    std::fs::write(
        &path,
        format!("apiVersion: test.capstan.dev/v1\nkind: Widget\nmetadata:\n  name: w\nspec:\n  mode: {mode}\n"),
    )
    .unwrap();
    path.to_string_lossy().into_owned()
}

/// CPU time (user and system) the calling thread has used so far, to the nanosecond:
/// unlike wall-clock time, it does not stretch when the machine is busy.
pub fn thread_cpu() -> Duration {
    let stat = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap();
    let nanos = stat.split_whitespace().next().unwrap().parse().unwrap();
    Duration::from_nanos(nanos)
}

/// The test `widget` plugin in a sandbox of default size, with calls stopped at `deadline`.
pub fn widget_with_deadline(deadline: Duration) -> Plugin {
    Sandbox::new(SandboxConfig {
        deadline,
        ..SandboxConfig::default()
    })
    .unwrap()
    .load_file_blocking(&test_plugin("widget"))
    .unwrap()
}

/// A Widget parent whose spec asks the test plugin for `mode`, with no children.
pub fn widget_observed(mode: &str) -> Observed {
    Observed {
        parent: json!({"apiVersion": "test.capstan.dev/v1", "kind": "Widget",
            "metadata": {"name": "w", "namespace": "ns", "uid": "u", "generation": 1},
            "spec": {"mode": mode, "count": 1}}),
        children: vec![],
        related: Vec::new(),
    }
}
