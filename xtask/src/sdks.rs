//! `cargo xtask sdks`: the three SDKs packaged as their registries take them, into
//! target/sdks/ — the Rust crate (`cargo package`, also unpacked beside it, which a
//! `[patch]` can point at), the Python wheel (`pip wheel`, flit_core) and the npm tarball
//! (`npm pack`). `capstan new --sdks target/sdks` makes projects that depend on these by
//! name and version, as they would on published ones; the tests of `capstan new`, `build`
//! and `test` use them so.
//!
//! Each package carries the contract's WIT (the one in wit/, copied in): a project
//! outside the repository builds against what its SDK ships.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};

use crate::{cargo, js, root, run_cmd, target_dir};

/// The SDKs' version (each manifest says it too; `capstan new` asks for it).
const VERSION: &str = "0.2.0";

/// Writes the three packages into target/sdks/ and returns that directory.
pub fn build() -> Result<PathBuf> {
    let out = target_dir().join("sdks");
    let stage = target_dir().join("sdks-stage");
    for dir in [&out, &stage] {
        if dir.exists() {
            std::fs::remove_dir_all(dir).with_context(|| format!("remove {}", dir.display()))?;
        }
        std::fs::create_dir_all(dir)?;
    }
    rust(&out)?;
    python(&out, &stage.join("python"))?;
    typescript(&out, &stage.join("typescript"))?;
    for file in [
        format!("capstan-sdk-{VERSION}.crate"),
        format!("capstan-sdk-{VERSION}/Cargo.toml"),
        format!("capstan_sdk-{VERSION}-py3-none-any.whl"),
        format!("capstan-sdk-{VERSION}.tgz"),
    ] {
        anyhow::ensure!(out.join(&file).is_file(), "the SDK packages lack {file}");
    }
    eprintln!(
        "sdks: the Rust, Python and TypeScript SDKs {VERSION} in {}",
        out.display()
    );
    Ok(out)
}

/// `cargo package` (without its verification build: the tests build a project against
/// the packaged crate for the target that matters, wasm32-wasip2), then unpacked.
fn rust(out: &Path) -> Result<()> {
    run_cmd(cargo().args([
        "package",
        "--package",
        "capstan-sdk",
        "--no-verify",
        "--allow-dirty",
        "--quiet",
    ]))?;
    let name = format!("capstan-sdk-{VERSION}.crate");
    let krate = out.join(&name);
    std::fs::copy(target_dir().join("package").join(&name), &krate)
        .with_context(|| format!("copy {name}"))?;
    let file = std::fs::File::open(&krate)?;
    tar::Archive::new(flate2::read::GzDecoder::new(file))
        .unpack(out)
        .with_context(|| format!("unpack {name}"))
}

/// `pip wheel` of a copy of plugins/sdk-python with the WIT in the package.
fn python(out: &Path, stage: &Path) -> Result<()> {
    let sdk = root().join("plugins/sdk-python");
    copy_tree(&sdk.join("capstan"), &stage.join("capstan"))?;
    copy_tree(&root().join("wit"), &stage.join("capstan/wit"))?;
    for file in ["pyproject.toml", "README.md"] {
        std::fs::copy(sdk.join(file), stage.join(file))?;
    }
    let python = capstan_toolchain::python::componentize_py()?.python();
    run_cmd(
        Command::new(python)
            .args([
                "-m",
                "pip",
                "wheel",
                "--quiet",
                "--disable-pip-version-check",
                "--no-deps",
                "--wheel-dir",
            ])
            .arg(out)
            .arg(stage)
            .env("PYTHONDONTWRITEBYTECODE", "1"),
    )
}

/// `npm pack` of a copy of plugins/sdk-js with the contract's generated declarations
/// and its WIT.
fn typescript(out: &Path, stage: &Path) -> Result<()> {
    let sdk = root().join("plugins/sdk-js");
    js::generate_types()?;
    for dir in ["src", "generated"] {
        copy_tree(&sdk.join(dir), &stage.join(dir))?;
    }
    copy_tree(&root().join("wit"), &stage.join("wit"))?;
    for file in ["package.json", "README.md"] {
        std::fs::copy(sdk.join(file), stage.join(file))?;
    }
    run_cmd(
        Command::new("npm")
            .args(["pack", "--silent", "--pack-destination"])
            .arg(out)
            .arg(stage),
    )
}

/// Copies a directory, without `__pycache__` and following symbolic links.
fn copy_tree(from: &Path, to: &Path) -> Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from).with_context(|| format!("read {}", from.display()))? {
        let entry = entry?;
        let (src, dst) = (entry.path(), to.join(entry.file_name()));
        if entry.file_name() == "__pycache__" {
            continue;
        }
        if std::fs::metadata(&src)?.is_dir() {
            copy_tree(&src, &dst)?;
        } else {
            std::fs::copy(&src, &dst).with_context(|| format!("copy {}", src.display()))?;
        }
    }
    Ok(())
}
