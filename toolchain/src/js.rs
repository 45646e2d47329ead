//! TypeScript plugins: the npm packages of the TypeScript SDK's lock file
//! (componentize-js, jco, esbuild, TypeScript) and the SDK's build script, installed
//! together into `<tools>/js-KEY`, where KEY hashes the three files. Both are compiled
//! into this crate from `plugins/sdk-js`, so `cargo xtask` and `capstan build` install
//! the same bytes into the same directory.
//!
//! The script's imports resolve from the directory it is installed in, so a plugin
//! project needs none of these packages in its own `node_modules`: only `@capstan/sdk`.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result};
use sha2::{Digest, Sha256};

use crate::run;

/// The SDK's package.json (its devDependencies are the toolchain).
pub const PACKAGE_JSON: &str = include_str!("../../plugins/sdk-js/package.json");
/// Its lock file: every package at an exact version and hash.
pub const PACKAGE_LOCK: &str = include_str!("../../plugins/sdk-js/package-lock.json");
/// The build script (`types`, `check`, `component`, `tests`).
pub const BUILD_SCRIPT: &str = include_str!("../../plugins/sdk-js/tools/build.mjs");

/// The installed toolchain.
#[derive(Debug, Clone)]
pub struct JsToolchain {
    /// `<tools>/js-KEY`.
    pub dir: PathBuf,
}

impl JsToolchain {
    /// The packages.
    pub fn node_modules(&self) -> PathBuf {
        self.dir.join("node_modules")
    }

    /// `bin/`, holding `capstan-js` (the build script: `capstan-js check .`,
    /// `capstan-js component . out.wasm`).
    pub fn bin_dir(&self) -> PathBuf {
        self.dir.join("bin")
    }

    /// `node <dir>/build.mjs`.
    pub fn build_script(&self) -> Command {
        let mut cmd = Command::new("node");
        cmd.arg(self.dir.join("build.mjs"));
        cmd
    }
}

/// The directory's key: the first 16 hex digits of the SHA-256 of the three files.
fn key() -> String {
    let mut hash = Sha256::new();
    for file in [PACKAGE_JSON, PACKAGE_LOCK, BUILD_SCRIPT] {
        hash.update((file.len() as u64).to_le_bytes());
        hash.update(file.as_bytes());
    }
    hash.finalize()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Installs the toolchain (once per machine): `npm ci` of the lock file, then the build
/// script and its launcher.
pub fn install() -> Result<JsToolchain> {
    let dir = crate::tools_dir()?.join(format!("js-{}", key()));
    crate::install_once(
        &dir,
        "the TypeScript plugin toolchain (componentize-js, jco, esbuild, TypeScript)",
        |dir| {
            node_version()?;
            std::fs::write(dir.join("package.json"), PACKAGE_JSON)?;
            std::fs::write(dir.join("package-lock.json"), PACKAGE_LOCK)?;
            // No install scripts: every package here works without them (esbuild finds
            // its binary in its platform package), and none is run unreviewed.
            run(Command::new("npm")
                .args([
                    "ci",
                    "--ignore-scripts",
                    "--no-audit",
                    "--no-fund",
                    "--silent",
                ])
                .arg("--prefix")
                .arg(dir))
            .context("npm ci of the TypeScript SDK's lock file")?;
            std::fs::write(dir.join("build.mjs"), BUILD_SCRIPT)?;
            let bin = dir.join("bin");
            std::fs::create_dir_all(&bin)?;
            let launcher = bin.join("capstan-js");
            std::fs::write(
                &launcher,
                format!(
                    "#!/bin/sh\n# The TypeScript plugin build script of Capstan's pinned toolchain.\nexec node '{}' \"$@\"\n",
                    dir.join("build.mjs").display()
                ),
            )?;
            make_executable(&launcher)
        },
    )?;
    Ok(JsToolchain { dir })
}

/// Node.js must be there (20 or newer, which the pinned packages need).
fn node_version() -> Result<()> {
    let out = Command::new("node")
        .arg("--version")
        .output()
        .context("TypeScript plugins need Node.js 20 or newer with npm (node on PATH)")?;
    let version = String::from_utf8_lossy(&out.stdout);
    let major: u32 = version
        .trim()
        .trim_start_matches('v')
        .split('.')
        .next()
        .and_then(|m| m.parse().ok())
        .unwrap_or(0);
    anyhow::ensure!(
        major >= 20,
        "TypeScript plugins need Node.js 20 or newer, found {}",
        version.trim()
    );
    Ok(())
}

#[cfg(unix)]
fn make_executable(path: &std::path::Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))?;
    Ok(())
}

#[cfg(not(unix))]
fn make_executable(_: &std::path::Path) -> Result<()> {
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_follows_every_file_and_is_stable_within_a_build() {
        assert_eq!(key(), key());
        assert_eq!(key().len(), 16);
        assert!(
            BUILD_SCRIPT.contains("component"),
            "the build script is embedded"
        );
        assert!(
            PACKAGE_LOCK.contains("componentize-js"),
            "the lock file is embedded"
        );
    }
}
