//! Where the unit tests find what the build made: the workspace, the shipped plugins
//! and the test plugins (`cargo xtask plugins` builds both). The e2e crate has its own
//! helpers for the end-to-end tier; the unit tier does not depend on it.

use std::path::{Path, PathBuf};

/// The workspace's root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `file` in the directory `$env`, else in `default` under the workspace; a clear
/// panic when the plugins were not built.
fn built(env: &str, default: &str, file: &str) -> PathBuf {
    let dir = std::env::var_os(env)
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join(default));
    let path = dir.join(file);
    assert!(
        path.exists(),
        "{} is missing: build the plugins with `cargo xtask plugins` (or run every test with `cargo xtask test`)",
        path.display()
    );
    path
}

/// A shipped plugin, e.g. `plugin("uuid")` (`$CAPSTAN_PLUGIN_DIR`, else target/plugins).
pub fn plugin(name: &str) -> PathBuf {
    built(
        "CAPSTAN_PLUGIN_DIR",
        "target/plugins",
        &format!("{name}.wasm"),
    )
}

/// A test plugin, e.g. `test_plugin("widget")` (`$CAPSTAN_TEST_PLUGIN_DIR`, else
/// target/test-plugins).
pub fn test_plugin(name: &str) -> PathBuf {
    built(
        "CAPSTAN_TEST_PLUGIN_DIR",
        "target/test-plugins",
        &format!("{name}.wasm"),
    )
}

/// The Uuid plugin built by `cargo component build`: other bytes, same behaviour, so
/// it stands in for "a new version".
pub fn uuid_other_build() -> PathBuf {
    std::env::var_os("CAPSTAN_COMPONENT_PLUGIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target/wasm32-wasip1/release/capstan_plugin_uuid.wasm"))
}
