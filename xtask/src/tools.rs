//! Toolchain pieces the build needs beyond cargo itself: the wasm targets and
//! `cargo-component`, installed on first use and found again on later runs.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result};

use crate::{root, run_cmd, target_dir};

/// The cargo-component release the project is tested with.
const CARGO_COMPONENT_VERSION: &str = "0.21.1";

/// Makes sure the toolchain of rust-toolchain.toml has the wasm targets (rustup does
/// not always add a toolchain file's targets to a toolchain that is already installed).
pub fn ensure_wasm_targets() -> Result<()> {
    let installed = Command::new("rustup")
        .args(["target", "list", "--installed"])
        .current_dir(root())
        .output()
        .context("cannot run rustup: Capstan builds its plugins with a rustup toolchain")?;
    let installed = String::from_utf8_lossy(&installed.stdout);
    let missing: Vec<&str> = ["wasm32-wasip2", "wasm32-wasip1"]
        .into_iter()
        .filter(|t| !installed.lines().any(|l| l.trim() == *t))
        .collect();
    if !missing.is_empty() {
        run_cmd(
            Command::new("rustup")
                .args(["target", "add"])
                .args(&missing),
        )?;
    }
    Ok(())
}

/// Installs cargo-component into the cache (once per machine) and returns its path.
pub fn cargo_component() -> Result<PathBuf> {
    let root_dir = crate::cluster::cache_dir()?
        .join(format!("tools/cargo-component-{CARGO_COMPONENT_VERSION}"));
    let bin = root_dir.join("bin/cargo-component");
    if !bin.exists() {
        eprintln!(
            "installing cargo-component {CARGO_COMPONENT_VERSION} into {} (once per machine, several minutes)",
            root_dir.display()
        );
        // Without its release profile's fat LTO and single codegen unit (the config's
        // profile overrides the package's): the tool builds a component in about a
        // second either way, and its install was the longest single step of a cold CI
        // run (10m28s on two cores).
        run_cmd(
            Command::new("cargo")
                .env("CARGO_PROFILE_RELEASE_LTO", "false")
                .env("CARGO_PROFILE_RELEASE_CODEGEN_UNITS", "16")
                .args([
                    "install",
                    "cargo-component",
                    "--locked",
                    "--version",
                    CARGO_COMPONENT_VERSION,
                    "--root",
                ])
                .arg(&root_dir),
        )?;
    }
    Ok(bin)
}

/// Builds the Uuid plugin the way `cargo component build` users do (its default
/// target, wasm32-wasip1 plus the preview-2 adapter), and returns the component's path.
pub fn build_with_cargo_component() -> Result<PathBuf> {
    let bin = cargo_component()?;
    run_cmd(Command::new(&bin).args([
        "component",
        "build",
        "--release",
        "--package",
        "capstan-plugin-uuid",
    ]))?;
    let out = target_dir().join("wasm32-wasip1/release/capstan_plugin_uuid.wasm");
    anyhow::ensure!(
        out.exists(),
        "cargo component build produced no {}",
        out.display()
    );
    Ok(out)
}
