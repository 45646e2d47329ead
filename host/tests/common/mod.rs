//! Helpers shared by the host's integration tests: finding the built plugins and the
//! binary, golden files, and masking the random parts of rendered output.
#![allow(dead_code, unused_imports)] // each test file uses a part

use std::path::Path;
use std::process::Output;

use serde_json::Value;

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
