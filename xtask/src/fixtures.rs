//! Test fixtures: the plugins only tests use, built in one target directory of their own
//! (`target/fixtures`) with a light profile ([`fixture_build`]), so that their wasm
//! dependencies (k8s-openapi above all) are compiled once for all of them:
//!
//! - the test plugins (Widget, Guard, Stall, …);
//! - variants of a plugin built with a variable set (a PostgreSQL plugin naming its
//!   images from a mirror, a broken and a rebuilt Widget);
//! - the shipped plugins as they were built for contract 0.1.0, for the tests that prove
//!   the host still runs them unchanged. They are built from the project's own history
//!   (the last commit that shipped 0.1.0), never checked in as binaries: `git archive`
//!   extracts the SDK, the plugins, the WIT and the CRDs of that commit into
//!   `target/contract-0.1.0/src`, and they build there in a workspace of their own.
//!
//! Several of these have the same package name (today's PostgreSQL plugin and 0.1.0's,
//! the Widget and its variants), so cargo's output file of one is overwritten by the
//! next: each build is copied to its stable name right after it, one after the other.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::{cargo, copy_built, root, target_dir};

/// The target directory of every fixture.
fn dir() -> PathBuf {
    target_dir().join("fixtures")
}

/// Where cargo leaves the fixtures' wasm files.
fn out_dir() -> PathBuf {
    dir().join("wasm32-wasip2/plugin")
}

/// Builds the test plugins `packages` (package, file name) into `out`
/// (target/test-plugins).
pub fn build_test_plugins(packages: &[(&str, &str)], out: &Path) -> Result<()> {
    let status = fixture_build()
        .args(packages.iter().flat_map(|(p, _)| ["--package", p]))
        .current_dir(root())
        .status()
        .context("cannot start cargo for the test plugins")?;
    if !status.success() {
        bail!("building the test plugins failed ({status})");
    }
    copy_built(&out_dir(), packages, out)
}

/// The last commit whose plugins were built for `capstan:plugin@0.1.0`.
pub const CONTRACT_0_1_COMMIT: &str = "0c783e060711234ff12d921649b67e51509bcba7";

/// What is taken from that commit.
const PATHS: &[&str] = &[
    "Cargo.toml",
    "Cargo.lock",
    "rust-toolchain.toml",
    "wit",
    "crds",
    "plugins/sdk",
    "plugins/uuid",
    "plugins/postgresql",
];

/// The 0.1.0 plugins: (package, file name under `<out>/contract-0.1.0/`).
const PLUGINS: &[(&str, &str)] = &[
    ("capstan-plugin-uuid", "uuid.wasm"),
    ("capstan-plugin-postgresql", "postgresql.wasm"),
];

/// Builds the 0.1.0 plugins into `out/contract-0.1.0/` (`out` is target/test-plugins).
pub fn build_contract_0_1(out: &Path) -> Result<()> {
    let src = target_dir().join("contract-0.1.0/src");
    let stamp = src.join(".commit");
    if std::fs::read_to_string(&stamp).ok().as_deref() != Some(CONTRACT_0_1_COMMIT) {
        extract(&src)?;
        std::fs::write(&stamp, CONTRACT_0_1_COMMIT)?;
    }
    let status = fixture_build()
        .args(PLUGINS.iter().flat_map(|(p, _)| ["--package", p]))
        .current_dir(&src)
        .status()
        .context("cannot start cargo for the contract 0.1.0 plugins")?;
    if !status.success() {
        bail!(
            "building the contract 0.1.0 plugins in {} failed ({status})",
            src.display()
        );
    }
    let to = out.join("contract-0.1.0");
    copy_built(&out_dir(), PLUGINS, &to)?;
    println!("contract 0.1.0 plugins: {}", to.display());
    Ok(())
}

/// Extracts [`PATHS`] of [`CONTRACT_0_1_COMMIT`] into `src`, as a workspace of the SDK
/// and the two plugins alone.
fn extract(src: &Path) -> Result<()> {
    let has_commit = Command::new("git")
        .args([
            "cat-file",
            "-e",
            &format!("{CONTRACT_0_1_COMMIT}^{{commit}}"),
        ])
        .current_dir(root())
        .status()
        .context("cannot run git")?;
    if !has_commit.success() {
        bail!(
            "the contract 0.1.0 test plugins are built from commit {CONTRACT_0_1_COMMIT}, which this clone does not have (a shallow clone?): run `git fetch --unshallow`"
        );
    }
    if src.exists() {
        std::fs::remove_dir_all(src)?;
    }
    std::fs::create_dir_all(src)?;
    let archive = Command::new("git")
        .args(["archive", "--format=tar", CONTRACT_0_1_COMMIT])
        .args(PATHS)
        .current_dir(root())
        .output()
        .context("cannot run git archive")?;
    if !archive.status.success() {
        bail!(
            "git archive {CONTRACT_0_1_COMMIT} failed: {}",
            String::from_utf8_lossy(&archive.stderr).trim()
        );
    }
    tar::Archive::new(archive.stdout.as_slice())
        .unpack(src)
        .context("cannot unpack the contract 0.1.0 sources")?;
    // Only the SDK and the plugins are members here.
    let manifest = src.join("Cargo.toml");
    let text = std::fs::read_to_string(&manifest)?;
    let start = text
        .find("members = [")
        .context("no workspace members in Cargo.toml")?;
    let end = start
        + text[start..]
            .find(']')
            .context("unterminated members list")?
        + 1;
    let members = r#"members = ["plugins/sdk", "plugins/uuid", "plugins/postgresql"]"#;
    std::fs::write(
        &manifest,
        format!("{}{members}{}", &text[..start], &text[end..]),
    )?;
    Ok(())
}

/// The repository the PostgreSQL plugin's variant names its images from.
pub const POSTGRES_MIRROR: &str = "mirror.example.com/library/postgres";

/// Builds `out/postgresql-mirror.wasm`: today's PostgreSQL plugin with its images taken
/// from [`POSTGRES_MIRROR`] (`CAPSTAN_POSTGRES_REPOSITORY`), the "new version" whose
/// changes the tests of `capstan plan` show.
pub fn build_postgres_mirror(out: &Path) -> Result<()> {
    build_variant(
        "capstan-plugin-postgresql",
        ("CAPSTAN_POSTGRES_REPOSITORY", POSTGRES_MIRROR),
        &out.join("postgresql-mirror.wasm"),
    )
}

/// What the broken Widget build does on every parent (`CAPSTAN_WIDGET_MODE`): a child in
/// another namespace, which the host refuses.
pub const WIDGET_BROKEN_MODE: &str = "other-namespace";

/// Builds `out/widget-broken.wasm`: the Widget test plugin that misbehaves
/// ([`WIDGET_BROKEN_MODE`]) on every parent, the regressed "new version" of the canary
/// tests.
pub fn build_widget_broken(out: &Path) -> Result<()> {
    build_variant(
        "capstan-test-widget",
        ("CAPSTAN_WIDGET_MODE", WIDGET_BROKEN_MODE),
        &out.join("widget-broken.wasm"),
    )
}

/// Builds `out/widget-rebuilt.wasm`: the Widget test plugin, healthy, in other bytes
/// (`CAPSTAN_WIDGET_MODE=rebuilt`): a new version that should be promoted.
pub fn build_widget_rebuilt(out: &Path) -> Result<()> {
    build_variant(
        "capstan-test-widget",
        ("CAPSTAN_WIDGET_MODE", "rebuilt"),
        &out.join("widget-rebuilt.wasm"),
    )
}

/// `cargo build --profile plugin --target wasm32-wasip2` for a test fixture, in the
/// fixtures' target directory ([`dir`]): optimized lightly, without LTO and in parallel
/// codegen units (the environment overrides the workspace's `plugin` profile), since the
/// fixtures' directory compiles every dependency once more. A fixture has to behave
/// like the plugin, not to be small or fast; on a cold two-core machine two fixture
/// directories took 10 minutes with the shipped plugins' profile.
fn fixture_build() -> Command {
    let mut cmd = cargo();
    cmd.args(["build", "--profile", "plugin", "--target", "wasm32-wasip2"])
        .env("CARGO_TARGET_DIR", dir())
        .env("CARGO_PROFILE_PLUGIN_OPT_LEVEL", "1")
        .env("CARGO_PROFILE_PLUGIN_LTO", "false")
        .env("CARGO_PROFILE_PLUGIN_CODEGEN_UNITS", "16");
    cmd
}

/// Builds `package` with the variable `name` set to `value`, into `to`.
fn build_variant(package: &str, (name, value): (&str, &str), to: &Path) -> Result<()> {
    let status = fixture_build()
        .args(["--package", package])
        .env(name, value)
        .current_dir(root())
        .status()
        .with_context(|| format!("cannot start cargo for {package} with {name}={value}"))?;
    if !status.success() {
        bail!("building {package} with {name}={value} failed ({status})");
    }
    let from = out_dir().join(format!("{}.wasm", package.replace('-', "_")));
    std::fs::copy(&from, to).with_context(|| format!("copy {}", from.display()))?;
    Ok(())
}
