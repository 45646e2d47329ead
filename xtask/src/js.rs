//! TypeScript plugins: the pinned npm toolchain (componentize-js, jco, TypeScript,
//! esbuild), the SDK's unit tests, and the example plugin built into target/test-plugins/.

use std::hash::{DefaultHasher, Hasher};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::SystemTime;

use anyhow::{Context, Result};

use crate::{root, run_cmd, target_dir};

/// The SDK: its package.json and package-lock.json pin the whole toolchain.
const SDK: &str = "plugins/sdk-js";
/// TypeScript plugins: (project directory, file name in the output directory).
const PLUGINS: &[(&str, &str)] = &[("plugins/greeting-ts", "greeting-ts.wasm")];

/// Builds every TypeScript plugin into `out` (target/test-plugins), skipping one whose
/// component is newer than all of its inputs: componentizing takes most of a minute.
pub fn build_plugins(out: &Path) -> Result<()> {
    let tools = prepare()?;
    for (project, file) in PLUGINS {
        let wasm = out.join(file);
        let inputs = [
            root().join(project).join("src"),
            root().join(SDK).join("src"),
            root().join(SDK).join("tools"),
            root().join(SDK).join("package-lock.json"),
            root().join("wit"),
        ];
        if is_up_to_date(&wasm, &inputs)? {
            continue;
        }
        run_cmd(
            tools
                .build_script()
                .arg("component")
                .arg(project)
                .arg(&wasm),
        )?;
    }
    Ok(())
}

/// The unit tests of the SDK and of every TypeScript plugin, in Node's test runner: no
/// cluster, no component.
pub fn test() -> Result<()> {
    let tools = prepare()?;
    let out = target_dir().join("js/tests");
    let projects = std::iter::once(SDK).chain(PLUGINS.iter().map(|(p, _)| *p));
    run_cmd(tools.build_script().arg("tests").args(projects).arg(&out))?;
    run_cmd(Command::new("node").arg("--test").arg(&out))
}

/// Installs the toolchain, generates the contract's types and type-checks every project.
fn prepare() -> Result<Tools> {
    let tools = Tools::install()?;
    run_cmd(tools.build_script().arg("types"))?;
    for project in std::iter::once(SDK).chain(PLUGINS.iter().map(|(p, _)| *p)) {
        run_cmd(
            Command::new("node")
                .arg(tools.node_modules.join("typescript/bin/tsc"))
                .args(["--pretty", "false", "-p", project]),
        )?;
    }
    Ok(tools)
}

/// The npm packages of the SDK's lock file, installed once per machine.
struct Tools {
    node_modules: PathBuf,
}

impl Tools {
    /// `npm ci` of the SDK's lock file into the cache, keyed by the lock file's contents:
    /// built in a temporary directory and renamed into place, so an interrupted install
    /// is never mistaken for a finished one. Then `plugins/sdk-js/node_modules` is made a
    /// link to it, where Node, TypeScript and editors look; a real directory there (the
    /// author ran `npm ci` by hand) is left as it is and used.
    fn install() -> Result<Tools> {
        let sdk = root().join(SDK);
        let lock =
            std::fs::read(sdk.join("package-lock.json")).context("read the SDK's lock file")?;
        let mut hash = DefaultHasher::new();
        hash.write(&lock);
        let dir = crate::cluster::cache_dir()?.join(format!("tools/js-{:016x}", hash.finish()));
        if !dir.join("node_modules").is_dir() {
            eprintln!(
                "installing the TypeScript plugin toolchain into {} (once per machine)",
                dir.display()
            );
            let tmp = dir.with_extension("tmp");
            let _ = std::fs::remove_dir_all(&tmp);
            std::fs::create_dir_all(&tmp)?;
            for file in ["package.json", "package-lock.json"] {
                std::fs::copy(sdk.join(file), tmp.join(file))?;
            }
            // No install scripts: every package here works without them (esbuild finds
            // its binary in its platform package), and none is run unreviewed.
            run_cmd(
                Command::new("npm")
                    .args(["ci", "--ignore-scripts", "--no-audit", "--no-fund"])
                    .arg("--prefix")
                    .arg(&tmp),
            )
            .context("npm ci of plugins/sdk-js/package-lock.json")?;
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::rename(&tmp, &dir)?;
        }
        let node_modules = dir.join("node_modules");
        link_node_modules(&sdk.join("node_modules"), &node_modules)?;
        Ok(Tools {
            node_modules: sdk.join("node_modules"),
        })
    }

    /// `node plugins/sdk-js/tools/build.mjs`.
    fn build_script(&self) -> Command {
        let mut cmd = Command::new("node");
        cmd.arg(root().join(SDK).join("tools/build.mjs"));
        cmd
    }
}

fn link_node_modules(link: &Path, target: &Path) -> Result<()> {
    match std::fs::symlink_metadata(link) {
        Ok(meta) if !meta.file_type().is_symlink() => return Ok(()),
        Ok(_) if std::fs::read_link(link)? == target => return Ok(()),
        Ok(_) => std::fs::remove_file(link)?,
        Err(_) => {}
    }
    #[cfg(unix)]
    std::os::unix::fs::symlink(target, link)
        .with_context(|| format!("link {} to {}", link.display(), target.display()))?;
    #[cfg(not(unix))]
    anyhow::bail!(
        "run `npm ci` in {} first: linking the cached toolchain needs a Unix system",
        link.parent().unwrap_or(link).display()
    );
    Ok(())
}

/// Whether `output` exists and is newer than every file under `inputs`.
fn is_up_to_date(output: &Path, inputs: &[PathBuf]) -> Result<bool> {
    let Ok(built) = std::fs::metadata(output).and_then(|m| m.modified()) else {
        return Ok(false);
    };
    for input in inputs {
        if newest(input)? > built {
            return Ok(false);
        }
    }
    Ok(true)
}

fn newest(path: &Path) -> Result<SystemTime> {
    let meta = std::fs::metadata(path).with_context(|| format!("read {}", path.display()))?;
    if !meta.is_dir() {
        return Ok(meta.modified()?);
    }
    let mut newest = meta.modified()?;
    for entry in std::fs::read_dir(path)? {
        newest = newest.max(self::newest(&entry?.path())?);
    }
    Ok(newest)
}
