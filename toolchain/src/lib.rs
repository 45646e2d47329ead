//! The plugin toolchain at the project's pins, installed once per machine into the
//! user's cache (`$CAPSTAN_CACHE_DIR`, else `$XDG_CACHE_HOME/capstan`, else
//! `~/.cache/capstan`) and found there again on later runs.
//!
//! `cargo xtask` (the repository's plugins and tests) and `capstan build` (plugin
//! projects anywhere) both install through this crate, so they share one copy of each
//! tool at one version: [`rust`] (the wasm targets, cargo-component), [`python`]
//! (componentize-py in a virtual environment) and [`js`] (componentize-js, jco,
//! esbuild and TypeScript from the TypeScript SDK's lock file).
//!
//! Every install happens under a lock file (two builds never install the same tool at
//! once) and is marked complete last, so an interrupted one is redone, never used.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

pub mod js;
pub mod python;
pub mod rust;

/// The cache directory: `$CAPSTAN_CACHE_DIR`, else `$XDG_CACHE_HOME/capstan`, else
/// `$HOME/.cache/capstan`.
pub fn cache_dir() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("CAPSTAN_CACHE_DIR") {
        return Ok(PathBuf::from(dir));
    }
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(dir).join("capstan"));
    }
    let home = std::env::var_os("HOME").context("neither CAPSTAN_CACHE_DIR nor HOME is set")?;
    Ok(PathBuf::from(home).join(".cache/capstan"))
}

/// Where the tools live: `<cache>/tools`.
pub fn tools_dir() -> Result<PathBuf> {
    Ok(cache_dir()?.join("tools"))
}

/// Runs a command to completion; a failure names the command and its exit status.
pub fn run(cmd: &mut Command) -> Result<()> {
    let shown = shown(cmd);
    let status = cmd
        .status()
        .with_context(|| format!("cannot start {shown}"))?;
    if !status.success() {
        bail!("{shown} failed ({status})");
    }
    Ok(())
}

/// A command as a user would type it (program and arguments, no environment).
fn shown(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

/// Installs `what` into `dir` once: under the lock `<tools>/.<name>.lock`, unless
/// `<dir>/.complete` exists. `install` fills `dir` (which it finds empty); the marker is
/// written after it returns, and a failed install's directory is removed.
fn install_once(dir: &Path, what: &str, install: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let complete = dir.join(".complete");
    if complete.exists() {
        return Ok(());
    }
    let parent = dir.parent().context("a tool directory has a parent")?;
    std::fs::create_dir_all(parent).with_context(|| format!("create {}", parent.display()))?;
    let name = dir
        .file_name()
        .context("a tool directory has a name")?
        .to_string_lossy();
    let lock = File::create(parent.join(format!(".{name}.lock")))
        .with_context(|| format!("create a lock file in {}", parent.display()))?;
    lock.lock()
        .with_context(|| format!("lock the install of {what} in {}", parent.display()))?;
    // Another build may have finished it while this one waited for the lock.
    if complete.exists() {
        return Ok(());
    }
    eprintln!(
        "installing {what} into {} (once per machine)",
        dir.display()
    );
    if dir.exists() {
        std::fs::remove_dir_all(dir).with_context(|| format!("remove {}", dir.display()))?;
    }
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    match install(dir) {
        Ok(()) => {
            std::fs::write(&complete, "").with_context(|| format!("write {}", complete.display()))
        }
        Err(e) => {
            let _ = std::fs::remove_dir_all(dir);
            Err(e.context(format!("install {what}")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_install_that_fails_leaves_nothing_and_a_finished_one_is_not_redone() {
        let base = std::env::temp_dir().join(format!("capstan-toolchain-{}", std::process::id()));
        let dir = base.join("tool-1");
        let failed = install_once(&dir, "tool", |d| {
            std::fs::write(d.join("half"), "")?;
            bail!("the registry refused")
        });
        let err = format!("{:#}", failed.unwrap_err());
        assert!(
            err.contains("install tool") && err.contains("refused"),
            "{err}"
        );
        assert!(!dir.exists(), "a failed install left {}", dir.display());

        install_once(&dir, "tool", |d| Ok(std::fs::write(d.join("bin"), "1")?)).unwrap();
        // Complete: the second install closure is never called.
        install_once(&dir, "tool", |_| bail!("installed twice")).unwrap();
        assert_eq!(std::fs::read_to_string(dir.join("bin")).unwrap(), "1");
        std::fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn commands_are_shown_as_typed() {
        let mut cmd = Command::new("npm");
        cmd.args(["ci", "--prefix", "/x"]);
        assert_eq!(shown(&cmd), "npm ci --prefix /x");
    }
}
