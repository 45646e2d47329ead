//! Rust plugins: the wasm targets of the rustup toolchain, and cargo-component.
//!
//! A plain `cargo build --release --target wasm32-wasip2` needs only the target;
//! cargo-component is the other documented way to build (`cargo component build`), and
//! is installed on demand.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};

use crate::run;

/// The cargo-component release the project is tested with.
pub const CARGO_COMPONENT_VERSION: &str = "0.21.1";

/// The targets Rust plugins are built for: preview 2 natively, preview 1 for
/// cargo-component (which adapts it to a preview-2 component).
pub const WASM_TARGETS: [&str; 2] = ["wasm32-wasip2", "wasm32-wasip1"];

/// Makes sure the rustup toolchain that applies in `dir` (its `rust-toolchain.toml`, if
/// any) has the wasm targets: rustup does not always add a toolchain file's targets to
/// a toolchain that is already installed.
pub fn ensure_wasm_targets(dir: &Path) -> Result<()> {
    let installed = Command::new("rustup")
        .args(["target", "list", "--installed"])
        .current_dir(dir)
        .output()
        .context("cannot run rustup: Capstan builds Rust plugins with a rustup toolchain (https://rustup.rs)")?;
    let installed = String::from_utf8_lossy(&installed.stdout);
    let missing: Vec<&str> = WASM_TARGETS
        .into_iter()
        .filter(|t| !installed.lines().any(|l| l.trim() == *t))
        .collect();
    if !missing.is_empty() {
        run(Command::new("rustup")
            .args(["target", "add"])
            .args(&missing)
            .current_dir(dir))?;
    }
    Ok(())
}

/// The directory cargo-component is installed into: `<tools>/cargo-component-VERSION`.
/// Its `bin` on `PATH` is what makes `cargo component` work.
pub fn cargo_component_dir() -> Result<PathBuf> {
    Ok(crate::tools_dir()?.join(format!("cargo-component-{CARGO_COMPONENT_VERSION}")))
}

/// Installs cargo-component into the cache (once per machine, several minutes) and
/// returns the path of its binary.
pub fn cargo_component() -> Result<PathBuf> {
    let dir = cargo_component_dir()?;
    let bin = dir.join("bin/cargo-component");
    // `cargo install` puts the binary in place last: there is no half-installed one.
    if bin.exists() {
        return Ok(bin);
    }
    crate::install_once(
        &dir,
        &format!("cargo-component {CARGO_COMPONENT_VERSION} (several minutes)"),
        |dir| {
            // A debug build without debug info (`--debug`, the environment overriding
            // the dev profile): the tool only drives cargo and encodes a component, in
            // about a second either way, and its install is the longest single step of
            // a cold CI run. Two idle cores: 10m28s with the package's release profile,
            // 6m19s without its LTO, 5m20s at opt-level 1, 2m12s so.
            run(Command::new("cargo")
                .env("CARGO_PROFILE_DEV_DEBUG", "false")
                .args([
                    "install",
                    "cargo-component",
                    "--locked",
                    "--debug",
                    "--version",
                    CARGO_COMPONENT_VERSION,
                    "--root",
                ])
                .arg(dir))
        },
    )?;
    Ok(bin)
}
