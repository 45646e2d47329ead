//! `cargo xtask demo`: the README's first command.

use std::process::Command;

use anyhow::Result;

use crate::{build_plugins, root, run_cmd};

/// Builds the plugins and renders the sample Uuid offline.
pub fn main(_args: &[String]) -> Result<()> {
    let built = build_plugins()?;
    run_cmd(
        Command::new("cargo")
            .args([
                "run",
                "--quiet",
                "--package",
                "capstan",
                "--",
                "render",
                "--plugin",
            ])
            .arg(built.plugins.join("uuid.wasm"))
            .arg("--parent")
            .arg(root().join("crds/samples/uuid.yaml")),
    )
}
