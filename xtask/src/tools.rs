//! Toolchain pieces the build needs beyond cargo itself: the wasm targets and
//! `cargo-component`, installed on first use by capstan-toolchain (the installer
//! `capstan build` uses too) and found again on later runs.

use std::path::PathBuf;
use std::process::Command;

use anyhow::Result;

use crate::{root, run_cmd, target_dir};

/// Makes sure the toolchain of rust-toolchain.toml has the wasm targets.
pub fn ensure_wasm_targets() -> Result<()> {
    capstan_toolchain::rust::ensure_wasm_targets(&root())
}

/// Builds the Uuid plugin the way `cargo component build` users do (its default
/// target, wasm32-wasip1 plus the preview-2 adapter), and returns the component's path.
/// The tests use it as "another version" of the shipped Uuid plugin: other bytes, the
/// same behaviour. Its release profile is lightened (opt-level 1, no LTO, parallel
/// codegen units) as the other test fixtures are, since its wasm32-wasip1 dependencies
/// are compiled for it alone.
pub fn build_with_cargo_component() -> Result<PathBuf> {
    let bin = capstan_toolchain::rust::cargo_component()?;
    run_cmd(
        Command::new(&bin)
            .env("CARGO_PROFILE_RELEASE_OPT_LEVEL", "1")
            .env("CARGO_PROFILE_RELEASE_LTO", "false")
            .env("CARGO_PROFILE_RELEASE_CODEGEN_UNITS", "16")
            .args([
                "component",
                "build",
                "--release",
                "--package",
                "capstan-plugin-uuid",
            ]),
    )?;
    let out = target_dir().join("wasm32-wasip1/release/capstan_plugin_uuid.wasm");
    anyhow::ensure!(
        out.exists(),
        "cargo component build produced no {}",
        out.display()
    );
    Ok(out)
}
