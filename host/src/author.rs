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

/// Why `capstan new`, `build` or `test` could not do what was asked, in one line.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// What the author gave or the project holds is not usable; the message says what,
    /// and how to fix it.
    #[error("{0}")]
    Invalid(String),
    /// A file or directory could not be read or written, or a program started.
    #[error("{what}: {source}")]
    Io {
        /// What was done, and to which path.
        what: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The pinned toolchain of the project's language could not be installed.
    #[error("cannot install the toolchain: {0}")]
    Toolchain(String),
    /// A sample or its golden file could not be read or rendered.
    #[error(transparent)]
    Render(#[from] crate::render::RenderError),
    /// A value could not be written as JSON or YAML (a bug in a template).
    #[error("cannot serialize: {0}")]
    Serialize(String),
}

/// A result of the author commands.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Returns an [`Error::Invalid`] made of the format arguments.
macro_rules! invalid {
    ($($arg:tt)*) => {
        return Err($crate::author::Error::Invalid(format!($($arg)*)))
    };
}
pub(crate) use invalid;

/// An I/O result with what was being done attached.
trait IoContext<T> {
    /// `what` (made only on failure) names the action and its path.
    fn doing(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T> IoContext<T> for std::io::Result<T> {
    fn doing(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|source| Error::Io {
            what: what(),
            source,
        })
    }
}

impl From<serde_json::Error> for Error {
    fn from(e: serde_json::Error) -> Self {
        Error::Serialize(e.to_string())
    }
}

impl From<serde_yaml_ng::Error> for Error {
    fn from(e: serde_yaml_ng::Error) -> Self {
        Error::Serialize(e.to_string())
    }
}

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
