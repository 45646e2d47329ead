//! Python plugins: componentize-py, in a virtual environment of its own in the cache.
//!
//! The environment is made in place (a venv's scripts name its path in their shebangs,
//! so one built elsewhere and moved has a `bin/componentize-py` that cannot start).

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Result, bail};

use crate::run;

/// The componentize-py release the project is tested with (PyPI).
pub const COMPONENTIZE_PY_VERSION: &str = "0.25.1";

/// The installed environment.
#[derive(Debug, Clone)]
pub struct Componentize {
    /// The environment's directory.
    pub dir: PathBuf,
}

impl Componentize {
    /// `bin/`: `componentize-py`, `python` and `pip` of the environment. On `PATH`,
    /// `componentize-py …` and `python -m pip …` are the pinned ones.
    pub fn bin_dir(&self) -> PathBuf {
        self.dir.join("bin")
    }

    /// The environment's interpreter.
    pub fn python(&self) -> PathBuf {
        self.bin_dir().join("python")
    }

    /// `componentize-py`, the environment's own launcher.
    pub fn componentize_py(&self) -> Command {
        Command::new(self.bin_dir().join("componentize-py"))
    }
}

/// Installs componentize-py into `<tools>/componentize-py-VERSION` (once per machine).
pub fn componentize_py() -> Result<Componentize> {
    let dir = crate::tools_dir()?.join(format!("componentize-py-{COMPONENTIZE_PY_VERSION}"));
    crate::install_once(
        &dir,
        &format!("componentize-py {COMPONENTIZE_PY_VERSION}"),
        |dir| {
            run(Command::new(host_python()?).args(["-m", "venv"]).arg(dir))?;
            run(Command::new(dir.join("bin/python"))
                .args([
                    "-m",
                    "pip",
                    "install",
                    "--quiet",
                    "--disable-pip-version-check",
                ])
                .arg(format!("componentize-py=={COMPONENTIZE_PY_VERSION}")))
        },
    )?;
    Ok(Componentize { dir })
}

/// The machine's Python 3, to make the virtual environment with.
fn host_python() -> Result<PathBuf> {
    for candidate in ["python3", "python"] {
        let ok = Command::new(candidate)
            .args([
                "-c",
                "import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 9))",
            ])
            .output()
            .is_ok_and(|o| o.status.success());
        if ok {
            return Ok(candidate.into());
        }
    }
    bail!(
        "Python plugins need Python 3.9 or later with the venv and ensurepip modules (python3 on PATH; on Debian: apt-get install python3-venv)"
    )
}
