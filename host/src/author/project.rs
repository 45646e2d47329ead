//! A plugin project: its `capstan.toml` and `capstan build`.
//!
//! ```toml
//! [plugin]
//! name = "banner"
//! language = "rust"          # rust | python | typescript
//!
//! [build]
//! command = "cargo build --release --target wasm32-wasip2"
//! output = "target/wasm32-wasip2/release/banner.wasm"
//! ```
//!
//! The command runs through `sh -c` in the project's directory, with the pinned
//! toolchain of its language installed (once per machine, by capstan-toolchain, the
//! installer `cargo xtask` uses too) and first on `PATH`: `componentize-py` and
//! `python` for Python, `capstan-js` for TypeScript; for Rust, the wasm targets of the
//! project's rustup toolchain.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde::Deserialize;

use super::{Error, IoContext, Language, Result, invalid};

/// The manifest's file name.
pub const MANIFEST: &str = "capstan.toml";

/// `capstan.toml`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// `[plugin]`.
    pub plugin: PluginSection,
    /// `[build]`.
    pub build: BuildSection,
}

/// `[plugin]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PluginSection {
    /// The plugin's name.
    pub name: String,
    /// Which toolchain the build needs.
    pub language: Language,
}

/// `[build]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BuildSection {
    /// The shell command that builds the component.
    pub command: String,
    /// Where it writes it, relative to the project.
    pub output: PathBuf,
}

/// A project directory and its manifest.
#[derive(Debug, Clone)]
pub struct Project {
    /// The directory holding `capstan.toml`.
    pub dir: PathBuf,
    /// Its contents.
    pub manifest: Manifest,
}

impl Project {
    /// Reads `<dir>/capstan.toml`.
    pub fn open(dir: &Path) -> Result<Project> {
        let path = dir.join(MANIFEST);
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => invalid!(
                "{} has no {MANIFEST}: not a plugin project (`capstan new` makes one)",
                display(dir)
            ),
            Err(e) => return Err(e).doing(|| format!("read {}", path.display())),
        };
        let manifest: Manifest = toml::from_str(&text).map_err(|e| {
            let message = e.message().trim().replace('\n', "; ");
            let line = e
                .span()
                .map(|span| text[..span.start.min(text.len())].lines().count().max(1));
            match line {
                Some(line) => Error::Invalid(format!("{}:{line}: {message}", path.display())),
                None => Error::Invalid(format!("{}: {message}", path.display())),
            }
        })?;
        Ok(Project {
            dir: dir.to_path_buf(),
            manifest,
        })
    }

    /// The component's path.
    pub fn output(&self) -> PathBuf {
        self.dir.join(&self.manifest.build.output)
    }

    /// The component, which must have been built.
    pub fn built_output(&self) -> Result<PathBuf> {
        let output = self.output();
        if !output.is_file() {
            invalid!(
                "{} is not built yet: run `capstan build` first",
                display(&output)
            );
        }
        Ok(output)
    }

    /// Installs the toolchain if needed, runs the build command (its output goes to
    /// stderr) and returns the component's path.
    pub fn build(&self) -> Result<PathBuf> {
        let path = toolchain_path(self.manifest.plugin.language, &self.dir)?;
        let command = &self.manifest.build.command;
        let status = Command::new("sh")
            .arg("-c")
            .arg(command)
            .current_dir(&self.dir)
            .env("PATH", path)
            .stdin(Stdio::null())
            .stdout(stderr()?)
            .status()
            .doing(|| "cannot start sh to run the build command".into())?;
        if !status.success() {
            invalid!("the build command failed ({status}): {command}");
        }
        let output = self.output();
        if !output.is_file() {
            invalid!(
                "the build command succeeded but wrote no {} (the `output` of {MANIFEST})",
                display(&output)
            );
        }
        Ok(output)
    }
}

/// `PATH` with the language's pinned tools first, installing them if needed.
fn toolchain_path(language: Language, dir: &Path) -> Result<OsString> {
    let mut first = Vec::new();
    let toolchain = |e| Error::Toolchain(format!("{e:#}"));
    match language {
        Language::Rust => capstan_toolchain::rust::ensure_wasm_targets(dir).map_err(toolchain)?,
        Language::Python => first.push(
            capstan_toolchain::python::componentize_py()
                .map_err(toolchain)?
                .bin_dir(),
        ),
        Language::Typescript => first.push(
            capstan_toolchain::js::install()
                .map_err(toolchain)?
                .bin_dir(),
        ),
    }
    let rest = std::env::var_os("PATH").unwrap_or_default();
    std::env::join_paths(first.into_iter().chain(std::env::split_paths(&rest)))
        .map_err(|e| Error::Invalid(format!("cannot put the toolchain on PATH: {e}")))
}

/// Our stderr, for the build's output: stdout is only the component's path.
fn stderr() -> Result<Stdio> {
    use std::os::fd::AsFd;
    let fd = std::io::stderr()
        .as_fd()
        .try_clone_to_owned()
        .doing(|| "duplicate stderr for the build's output".into())?;
    Ok(Stdio::from(fd))
}

/// A path as the user gave it (`.` for the current directory).
fn display(path: &Path) -> String {
    match path.as_os_str().is_empty() {
        true => ".".into(),
        false => path.display().to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, text: &str) {
        std::fs::write(dir.join(MANIFEST), text).unwrap();
    }

    #[test]
    fn a_manifest_reads_and_its_mistakes_are_one_line_each() {
        let dir = tempfile::tempdir().unwrap();
        let err = Project::open(dir.path()).unwrap_err().to_string();
        assert!(err.contains("has no capstan.toml"), "{err}");

        write(
            dir.path(),
            "[plugin]\nname = \"b\"\nlanguage = \"python\"\n[build]\ncommand = \"true\"\noutput = \"b.wasm\"\n",
        );
        let project = Project::open(dir.path()).unwrap();
        assert_eq!(project.manifest.plugin.language, Language::Python);
        assert_eq!(project.output(), dir.path().join("b.wasm"));
        let err = project.built_output().unwrap_err().to_string();
        assert!(err.contains("run `capstan build` first"), "{err}");

        for (text, says) in [
            (
                "[plugin]\nname = \"b\"\nlanguage = \"cobol\"\n[build]\ncommand = \"x\"\noutput = \"o\"\n",
                "unknown variant `cobol`",
            ),
            (
                "[plugin]\nname = \"b\"\nlanguage = \"rust\"\n",
                "missing field `build`",
            ),
            (
                "[plugin]\nname = \"b\"\nlanguage = \"rust\"\nextra = 1\n[build]\ncommand = \"x\"\noutput = \"o\"\n",
                "unknown field `extra`",
            ),
            ("[plugin\n", "invalid table header"),
        ] {
            write(dir.path(), text);
            let err = Project::open(dir.path()).unwrap_err().to_string();
            assert!(err.contains(says) && !err.contains('\n'), "{text:?}: {err}");
        }
    }

    #[test]
    fn a_failing_build_command_and_a_missing_output_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        // Rust, at the repository's toolchain: no tool to install beyond the wasm
        // targets, which it has.
        std::fs::write(
            dir.path().join("rust-toolchain.toml"),
            include_str!("../../../rust-toolchain.toml"),
        )
        .unwrap();
        write(
            dir.path(),
            "[plugin]\nname = \"b\"\nlanguage = \"rust\"\n[build]\ncommand = \"exit 3\"\noutput = \"b.wasm\"\n",
        );
        let err = Project::open(dir.path())
            .unwrap()
            .build()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("the build command failed") && err.contains("exit 3"),
            "{err}"
        );

        write(
            dir.path(),
            "[plugin]\nname = \"b\"\nlanguage = \"rust\"\n[build]\ncommand = \"echo built\"\noutput = \"b.wasm\"\n",
        );
        let err = Project::open(dir.path())
            .unwrap()
            .build()
            .unwrap_err()
            .to_string();
        assert!(err.contains("wrote no") && err.contains("b.wasm"), "{err}");

        write(
            dir.path(),
            "[plugin]\nname = \"b\"\nlanguage = \"rust\"\n[build]\ncommand = \"mkdir -p out && echo x > out/b.wasm\"\noutput = \"out/b.wasm\"\n",
        );
        let built = Project::open(dir.path()).unwrap().build().unwrap();
        assert_eq!(built, dir.path().join("out/b.wasm"));
    }
}
