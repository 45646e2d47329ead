//! Helpers shared by the host's integration tests: finding the built plugins and the
//! binary, golden files, and masking the random parts of rendered output.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Output;

use serde_json::Value;

/// The workspace root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn built(env: &str, default: &str, file: &str) -> PathBuf {
    let dir = std::env::var_os(env)
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join(default));
    let path = dir.join(file);
    assert!(
        path.exists(),
        "{} is missing: build the plugins first with `cargo xtask plugins` (or run every test with `cargo xtask test`)",
        path.display()
    );
    path
}

/// A shipped plugin, built by `cargo xtask plugins`.
pub fn plugin(name: &str) -> PathBuf {
    built(
        "CAPSTAN_PLUGIN_DIR",
        "target/plugins",
        &format!("{name}.wasm"),
    )
}

/// A test plugin, built by `cargo xtask plugins`.
pub fn test_plugin(name: &str) -> PathBuf {
    built(
        "CAPSTAN_TEST_PLUGIN_DIR",
        "target/test-plugins",
        &format!("{name}.wasm"),
    )
}

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
