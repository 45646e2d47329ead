//! Python plugins: componentize-py, installed once per machine into a virtual
//! environment in the tool cache, builds `plugins/database` into a component; and the
//! Python SDK's and plugins' unit tests (stdlib `unittest`, no wasm).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::{root, run_cmd};

/// The componentize-py release the project is tested with (PyPI).
const COMPONENTIZE_PY_VERSION: &str = "0.25.1";

/// Python plugins: (directory under plugins/, file name under target/plugins/).
const PLUGINS: &[(&str, &str)] = &[("database", "database.wasm")];

/// Directories of Python unit tests, each run with the SDK and its own directory on the
/// import path.
const TESTED: &[&str] = &["plugins/sdk-python", "plugins/database"];

/// The Python SDK, on the import path of every Python plugin.
const SDK: &str = "plugins/sdk-python";

/// The virtual environment holding componentize-py, made once per machine, in place
/// (a venv's scripts name its path in their shebangs, so one built elsewhere and moved
/// has a `bin/componentize-py` that cannot start) and marked complete last, under a
/// lock, so that an interrupted install is redone and two builds never install at once.
/// Returns its Python interpreter.
fn venv_python() -> Result<PathBuf> {
    let tools = crate::cluster::cache_dir()?.join("tools");
    let dir = tools.join(format!("componentize-py-{COMPONENTIZE_PY_VERSION}"));
    let python = dir.join("bin/python");
    let complete = dir.join(".complete");
    if complete.exists() {
        return Ok(python);
    }
    std::fs::create_dir_all(&tools)?;
    let lock = std::fs::File::create(
        tools.join(format!(".componentize-py-{COMPONENTIZE_PY_VERSION}.lock")),
    )?;
    lock.lock()
        .with_context(|| format!("lock the install of componentize-py in {}", tools.display()))?;
    // Another build may have finished it while this one waited for the lock.
    if complete.exists() {
        return Ok(python);
    }
    eprintln!(
        "installing componentize-py {COMPONENTIZE_PY_VERSION} into {} (once per machine)",
        dir.display()
    );
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    let installed = (|| {
        run_cmd(Command::new(host_python()?).args(["-m", "venv"]).arg(&dir))?;
        run_cmd(
            Command::new(&python)
                .args([
                    "-m",
                    "pip",
                    "install",
                    "--quiet",
                    "--disable-pip-version-check",
                ])
                .arg(format!("componentize-py=={COMPONENTIZE_PY_VERSION}")),
        )?;
        std::fs::write(&complete, "")?;
        Ok(())
    })();
    if let Err(e) = installed {
        let _ = std::fs::remove_dir_all(&dir);
        return Err(e);
    }
    Ok(python)
}

/// The machine's Python 3, to make the virtual environment with.
fn host_python() -> Result<PathBuf> {
    for candidate in ["python3", "python"] {
        let ok = Command::new(candidate)
            .args([
                "-c",
                "import sys, venv; sys.exit(sys.version_info < (3, 9))",
            ])
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            return Ok(candidate.into());
        }
    }
    bail!("Python plugins need Python 3.9 or later with the venv module (python3 on PATH)")
}

/// componentize-py, the venv's own script: what docs/plugins.md tells authors to run.
fn componentize_py() -> Result<Command> {
    let python = venv_python()?;
    Ok(Command::new(python.with_file_name("componentize-py")))
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
    let python = venv_python()?;
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
