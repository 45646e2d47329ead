//! Plugin projects outside this repository: `capstan new` makes one from a template
//! ([`scaffold`]), `capstan build` runs the build command its `capstan.toml` names with
//! the pinned toolchain ([`project`]), and `capstan test` renders its sample parents and
//! compares each result with a golden file ([`samples`]).
//!
//! The same three steps work for Rust, Python and TypeScript; the templates depend on
//! the SDKs by name and version, as on the public registries, or on local packages
//! (`capstan new --sdks DIR`, the directory `cargo xtask sdks` writes).

pub mod project;
pub mod samples;
pub mod scaffold;

/// The SDKs' version: the contract release the templates build for.
pub const SDK_VERSION: &str = "0.2.0";

/// The languages a plugin project can be in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Language {
    /// `cargo build --target wasm32-wasip2` with the Rust SDK (crate `capstan-sdk`).
    Rust,
    /// componentize-py with the Python SDK (package `capstan-sdk`, module `capstan`).
    Python,
    /// componentize-js with the TypeScript SDK (`@capstan/sdk`).
    Typescript,
}

impl Language {
    /// The name in `capstan.toml` and `--lang`.
    pub fn id(self) -> &'static str {
        match self {
            Language::Rust => "rust",
            Language::Python => "python",
            Language::Typescript => "typescript",
        }
    }

    /// The name in prose.
    pub fn display_name(self) -> &'static str {
        match self {
            Language::Rust => "Rust",
            Language::Python => "Python",
            Language::Typescript => "TypeScript",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The templates ask for the SDKs at this version; each SDK's own manifest must say
    /// the same, or `capstan new --sdks` would point at a package that is not there.
    #[test]
    fn every_sdk_is_at_the_templates_version() {
        let rust = include_str!("../../plugins/sdk/Cargo.toml");
        let python = include_str!("../../plugins/sdk-python/pyproject.toml");
        let js = include_str!("../../plugins/sdk-js/package.json");
        let line = format!("version = \"{SDK_VERSION}\"");
        assert!(rust.lines().any(|l| l == line), "plugins/sdk/Cargo.toml");
        assert!(
            python.lines().any(|l| l == line),
            "plugins/sdk-python/pyproject.toml"
        );
        let js: serde_json::Value = serde_json::from_str(js).unwrap();
        assert_eq!(js["version"], SDK_VERSION, "plugins/sdk-js/package.json");
    }
}
