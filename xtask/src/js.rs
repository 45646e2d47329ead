//! TypeScript plugins: the pinned npm toolchain (componentize-js, jco, TypeScript,
//! esbuild), the SDK's unit tests, and the example plugin built into target/test-plugins/.

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
                .arg(&wasm)
                // The contract's one WIT file, not the copy a packaged SDK ships.
                .arg(root().join("wit")),
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

/// Installs the toolchain and generates the contract's declarations into
/// plugins/sdk-js/generated (ignored by git).
pub fn generate_types() -> Result<()> {
    types(&Tools::install()?)
}

fn types(tools: &Tools) -> Result<()> {
    run_cmd(
        tools
            .build_script()
            .arg("types")
            .arg(root().join("wit"))
            .arg(root().join(SDK).join("generated")),
    )
}

/// Installs the toolchain, generates the contract's types and type-checks every project.
fn prepare() -> Result<Tools> {
    let tools = Tools::install()?;
    types(&tools)?;
    run_cmd(
        tools
            .build_script()
            .arg("check")
            .args(std::iter::once(SDK).chain(PLUGINS.iter().map(|(p, _)| *p))),
    )?;
    Ok(tools)
}

/// The pinned toolchain, installed once per machine by the installer `capstan build`
/// uses too (capstan-toolchain).
struct Tools {
    toolchain: capstan_toolchain::js::JsToolchain,
}

impl Tools {
    /// Installs the toolchain, then makes `plugins/sdk-js/node_modules` a link to its
    /// packages, where TypeScript and editors look for this repository's projects; a
    /// real directory there (the author ran `npm ci` by hand) is left as it is.
    fn install() -> Result<Tools> {
        let toolchain = capstan_toolchain::js::install()?;
        link_node_modules(
            &root().join(SDK).join("node_modules"),
            &toolchain.node_modules(),
        )?;
        Ok(Tools { toolchain })
    }

    /// `node <toolchain>/build.mjs`: the same script as plugins/sdk-js/tools/build.mjs.
    fn build_script(&self) -> Command {
        self.toolchain.build_script()
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
