//! Python plugins: componentize-py, installed once per machine into a virtual
//! environment in the tool cache, builds `plugins/database` into a component; and the
//! Python SDK's and plugins' unit tests (stdlib `unittest`, no wasm).

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result};

use crate::{root, run_cmd};

/// Python plugins: (directory under plugins/, file name under target/plugins/).
const PLUGINS: &[(&str, &str)] = &[("database", "database.wasm")];

/// Directories of Python unit tests, each run with the SDK and its own directory on the
/// import path.
const TESTED: &[&str] = &["plugins/sdk-python", "plugins/database"];

/// The Python SDK, on the import path of every Python plugin.
const SDK: &str = "plugins/sdk-python";

/// componentize-py, installed once per machine by the installer `capstan build` uses
/// too (capstan-toolchain).
fn componentize_py() -> Result<Command> {
    Ok(capstan_toolchain::python::componentize_py()?.componentize_py())
}

/// Builds every Python plugin into `out` (target/plugins), each through a temporary
/// file and a rename, so that a running `capstan run` never loads half a file.
pub fn build_plugins(out: &Path) -> Result<()> {
    let root = root();
    for (dir, file) in PLUGINS {
        let target = out.join(file);
        let tmp = out.join(format!(".{file}.tmp"));
        run_cmd(
            componentize_py()?
                // The contract is the repository's one WIT file, not a copy.
                .arg("-d")
                .arg(root.join("wit"))
                .args(["-w", "plugin", "componentize"])
                .arg("-p")
                .arg(root.join("plugins").join(dir))
                .arg("-p")
                .arg(root.join(SDK))
                .args(["app", "-o"])
                .arg(&tmp)
                // No __pycache__ directories in the source tree.
                .env("PYTHONDONTWRITEBYTECODE", "1"),
        )?;
        std::fs::rename(&tmp, &target).with_context(|| format!("rename {}", tmp.display()))?;
    }
    Ok(())
}

/// Runs the unit tests of the Python SDK and of every Python plugin with the venv's
/// interpreter (stdlib `unittest`: nothing else to install).
pub fn unit_tests() -> Result<()> {
    let python = capstan_toolchain::python::componentize_py()?.python();
    let root = root();
    for dir in TESTED {
        let path = std::env::join_paths([root.join(dir), root.join(SDK)])?;
        run_cmd(
            Command::new(&python)
                .args(["-m", "unittest", "discover", "--start-directory"])
                .arg(root.join(dir).join("tests"))
                .arg("--top-level-directory")
                .arg(root.join(dir))
                .env("PYTHONPATH", path)
                .env("PYTHONDONTWRITEBYTECODE", "1"),
        )?;
    }
    Ok(())
}
