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

/// The virtual environment holding componentize-py, made once per machine: built in a
/// temporary directory and renamed into place, so that an interrupted install leaves
/// nothing that looks finished. Returns its Python interpreter.
fn venv_python() -> Result<PathBuf> {
    let tools = crate::cluster::cache_dir()?.join("tools");
    let dir = tools.join(format!("componentize-py-{COMPONENTIZE_PY_VERSION}"));
    let python = dir.join("bin/python");
    if python.exists() {
        return Ok(python);
    }
    eprintln!(
        "installing componentize-py {COMPONENTIZE_PY_VERSION} into {} (once per machine)",
        dir.display()
    );
    std::fs::create_dir_all(&tools)?;
    let tmp = tools.join(format!(
        ".componentize-py-{COMPONENTIZE_PY_VERSION}.{}",
        std::process::id()
    ));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp)?;
    }
    let installed = (|| {
        run_cmd(Command::new(host_python()?).args(["-m", "venv"]).arg(&tmp))?;
        run_cmd(
            Command::new(tmp.join("bin/python"))
                .args([
                    "-m",
                    "pip",
                    "install",
                    "--quiet",
                    "--disable-pip-version-check",
                ])
                .arg(format!("componentize-py=={COMPONENTIZE_PY_VERSION}")),
        )
    })();
    if let Err(e) = installed {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    // The venv is used through `bin/python` only (its scripts' shebangs name the
    // temporary path): the interpreter finds the venv from its pyvenv.cfg wherever it is.
    match std::fs::rename(&tmp, &dir) {
        Ok(()) => {}
        // Another build finished first: use its copy.
        Err(_) if python.exists() => std::fs::remove_dir_all(&tmp)?,
        Err(e) => return Err(e).with_context(|| format!("rename into {}", dir.display())),
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

/// componentize-py, run through the venv's interpreter.
fn componentize_py() -> Result<Command> {
    let mut cmd = Command::new(venv_python()?);
    cmd.args([
        "-c",
        "import sys; from componentize_py import script; sys.argv[0] = 'componentize-py'; sys.exit(script())",
    ]);
    Ok(cmd)
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
