//! Loading a plugin file: the checks that name what is wrong with it (not a component,
//! another contract version, an import the host does not provide), compiling it (or
//! taking it from the cache), linking and describing it.

use std::path::Path;
use std::sync::{Arc, RwLock};

use sha2::{Digest, Sha256};
use wasmtime::Engine;
use wasmtime::component::Component;

use super::bindings::{CONTRACT_VERSION, CONTRACT_VERSIONS, Pre, v0_1, v0_2};
use super::cache;
use super::call::WasmPlugin;
use super::call::{PluginInner, SlowUntil};
use super::engine::Sandbox;
use super::error::LoadError;
use super::error::one_line;
use super::handle::Plugin;
use super::limits::Limits;
use super::limits::LimitsFile;
use crate::contract::PluginInfo;

const EXPORT_PREFIX: &str = "capstan:plugin/reconciler@";

impl Sandbox {
    /// Reads, compiles (or takes from the cache), links and describes a plugin file, for
    /// async callers: the file is read with `tokio::fs` and compiled on the blocking
    /// pool, so no runtime worker waits for the compiler (seconds for a large plugin).
    pub async fn load_file(&self, path: &Path) -> Result<Plugin, LoadError> {
        let bytes = tokio::fs::read(path)
            .await
            .map_err(|source| LoadError::Read {
                path: path.to_owned(),
                source,
            })?;
        self.load_bytes(bytes, path).await
    }

    /// Like [`Sandbox::load_file`], for bytes already read; `path` names them in errors.
    pub async fn load_bytes(&self, bytes: Vec<u8>, path: &Path) -> Result<Plugin, LoadError> {
        let sandbox = self.clone();
        let owned = path.to_owned();
        tokio::task::spawn_blocking(move || sandbox.load_bytes_blocking(&bytes, &owned))
            .await
            .unwrap_or_else(|e| {
                Err(LoadError::Compile {
                    path: path.to_owned(),
                    reason: format!("the load did not complete: {e}"),
                })
            })
    }

    /// [`Sandbox::load_file`] for a thread that runs no async code: blocks it until the
    /// plugin is compiled and described; the limits file beside it (`NAME.toml`) is
    /// applied when there is a valid one.
    pub fn load_file_blocking(&self, path: &Path) -> Result<Plugin, LoadError> {
        let bytes = std::fs::read(path).map_err(|source| LoadError::Read {
            path: path.to_owned(),
            source,
        })?;
        let plugin = self.load_bytes_blocking(&bytes, path)?;
        // The limits file beside it, its grant included, as the registry applies it: the
        // offline commands (render, test, plan) decide as `capstan run` would. A bad
        // file is the registry's to report; here the sandbox's limits stand.
        if let Ok(Some(limits)) = super::limits::read(path, &self.config) {
            plugin.set_limits(limits);
        }
        Ok(plugin)
    }

    /// [`Sandbox::load_bytes`] for a thread that runs no async code.
    pub fn load_bytes_blocking(&self, bytes: &[u8], path: &Path) -> Result<Plugin, LoadError> {
        check_component_header(bytes).map_err(|reason| LoadError::NotComponent {
            path: path.to_owned(),
            reason,
        })?;
        let sha256 = sha256_hex(bytes);
        let (component, cached) = cache::compile(
            &self.engine,
            &self.compiler,
            cache::CacheDirs {
                cache: self.cache.as_ref().map(|(dir, key)| (dir.as_path(), key)),
                precompiled: self.config.precompiled_dir.as_deref(),
            },
            bytes,
            &sha256,
        )
        .map_err(|e| LoadError::Compile {
            path: path.to_owned(),
            reason: one_line(&e),
        })?;
        let release =
            contract_release(&self.engine, &component).map_err(|reason| LoadError::Contract {
                path: path.to_owned(),
                reason,
            })?;
        check_imports(&self.engine, &component).map_err(|reason| LoadError::Contract {
            path: path.to_owned(),
            reason,
        })?;
        let instance_pre =
            self.linker
                .instantiate_pre(&component)
                .map_err(|e| LoadError::Contract {
                    path: path.to_owned(),
                    reason: one_line(&e),
                })?;
        let pre = match release {
            v0_1::VERSION => v0_1::PluginPre::new(instance_pre).map(Pre::V0_1),
            _ => v0_2::PluginPre::new(instance_pre).map(Pre::V0_2),
        }
        .map_err(|e| LoadError::Contract {
            path: path.to_owned(),
            reason: one_line(&e),
        })?;
        let file_name = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "plugin".into());
        let plugin = WasmPlugin {
            inner: Arc::new(PluginInner {
                info: placeholder_info(&file_name),
                pre,
                sandbox: self.clone(),
                sha256,
                path: path.to_owned(),
                slow: SlowUntil::default(),
                log_rate: Arc::default(),
                _cache_entry: None,
                limits: RwLock::new(Arc::new(Limits::resolve(
                    &self.config,
                    LimitsFile::default(),
                ))),
            }),
        };
        let info = plugin.describe().map_err(|e| LoadError::Describe {
            path: path.to_owned(),
            reason: e.to_string(),
        })?;
        crate::validate::plugin_info(&info).map_err(|e| LoadError::Describe {
            path: path.to_owned(),
            reason: e.to_string(),
        })?;
        // The describing call may still hold a clone of the placeholder for a moment.
        let inner = &plugin.inner;
        Ok(Plugin::from_wasm(WasmPlugin {
            inner: Arc::new(PluginInner {
                info,
                pre: inner.pre.clone(),
                sandbox: self.clone(),
                sha256: inner.sha256.clone(),
                path: inner.path.clone(),
                slow: SlowUntil::default(),
                log_rate: Arc::default(),
                _cache_entry: cached,
                limits: RwLock::new(Arc::new(Limits::resolve(
                    &self.config,
                    LimitsFile::default(),
                ))),
            }),
        }))
    }
}

/// Checks the 8-byte preamble: `\0asm` followed by the component layer's version.
fn check_component_header(bytes: &[u8]) -> Result<(), String> {
    match bytes {
        [0, b'a', b's', b'm', 1, 0, 0, 0, ..] => Err(
            "it is a core wasm module; build the plugin with `cargo build --target wasm32-wasip2` or `cargo component build`"
                .into(),
        ),
        [0, b'a', b's', b'm', _, _, 1, 0, ..] => Ok(()),
        [0, b'a', b's', b'm', ..] => Err("unknown WebAssembly binary version".into()),
        _ => Err("not a WebAssembly binary (no \\0asm header)".into()),
    }
}

/// Finds the versioned `reconciler` export and tells which release of the contract
/// the plugin was built for, before linking, so a plugin built for a release this host
/// does not run gets a message that says so.
fn contract_release(engine: &Engine, component: &Component) -> Result<&'static str, String> {
    let ty = component.component_type();
    let exported: Vec<String> = ty
        .exports(engine)
        .map(|(name, _)| name.to_string())
        .collect();
    let Some(found) = exported.iter().find_map(|n| n.strip_prefix(EXPORT_PREFIX)) else {
        return Err(format!(
            "it does not export `{EXPORT_PREFIX}{CONTRACT_VERSION}` (exports: {})",
            if exported.is_empty() {
                "none".to_string()
            } else {
                exported.join(", ")
            }
        ));
    };
    CONTRACT_VERSIONS
        .iter()
        .find(|ours| semver_compatible(found, ours))
        .copied()
        .ok_or_else(|| {
            format!(
                "it was built for capstan:plugin@{found}, which this host cannot run (it runs {}); rebuild it against capstan-sdk for {CONTRACT_VERSION}",
                CONTRACT_VERSIONS.join(" and ")
            )
        })
}

/// Interface packages the host provides: WASI with nothing granted, and the contract.
const PROVIDED_PACKAGES: &[&str] = &[
    "wasi:cli/",
    "wasi:clocks/",
    "wasi:filesystem/",
    "wasi:io/",
    "wasi:random/",
    "wasi:sockets/",
    "capstan:plugin/",
];

/// Refuses a component that imports an interface the host does not provide, naming it
/// and the fix (linking would fail later with an opaque "implementation is missing").
fn check_imports(engine: &Engine, component: &Component) -> Result<(), String> {
    let missing: Vec<String> = component
        .component_type()
        .imports(engine)
        .map(|(name, _)| name.to_string())
        .filter(|name| !PROVIDED_PACKAGES.iter().any(|p| name.starts_with(p)))
        .collect();
    let Some(first) = missing.first() else {
        return Ok(());
    };
    let package = first.split('/').next().unwrap_or(first);
    let hint = if package == "wasi:http" {
        " (JavaScript: componentize with http and fetch-event disabled)"
    } else {
        ""
    };
    Err(format!(
        "it imports {}, which Capstan does not provide; build the plugin without {package}{hint}",
        missing.join(", ")
    ))
}

/// Component-model semver compatibility: same major, or for `0.x`, the same minor.
fn semver_compatible(a: &str, b: &str) -> bool {
    let parts = |v: &str| -> Vec<u64> {
        v.split(['.', '-', '+'])
            .take(3)
            .map(|p| p.parse().unwrap_or(u64::MAX))
            .collect()
    };
    let (a, b) = (parts(a), parts(b));
    if a.len() < 2 || b.len() < 2 {
        return false;
    }
    if a[0] == 0 {
        a[0] == b[0] && a[1] == b[1]
    } else {
        a[0] == b[0]
    }
}

fn placeholder_info(name: &str) -> PluginInfo {
    PluginInfo {
        name: name.to_string(),
        version: String::new(),
        parent: crate::contract::KindRef {
            group: String::new(),
            version: String::new(),
            kind: String::new(),
            plural: String::new(),
            namespaced: true,
        },
        children: Vec::new(),
        finalizer: false,
        resync_seconds: None,
        crd: None,
        related: Vec::new(),
        validation: None,
        conversion: false,
        contract: String::new(),
    }
}

/// sha256 of `bytes`, as lower-case hex: the identity of a plugin version.
pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_check_tells_modules_from_components() {
        assert!(check_component_header(b"\0asm\x0d\0\x01\0rest").is_ok());
        let module = check_component_header(b"\0asm\x01\0\0\0").unwrap_err();
        assert!(module.contains("core wasm module"), "{module}");
        let text = check_component_header(b"apiVersion: v1").unwrap_err();
        assert!(text.contains("not a WebAssembly binary"), "{text}");
    }

    #[test]
    fn semver_compatibility_follows_the_component_model() {
        assert!(semver_compatible("0.1.0", "0.1.0"));
        assert!(semver_compatible("0.1.3", "0.1.0"));
        assert!(!semver_compatible("0.2.0", "0.1.0"));
        assert!(semver_compatible("0.2.0", "0.2.0"));
        assert!(!semver_compatible("1.0.0", "0.1.0"));
        assert!(semver_compatible("1.4.0", "1.0.0"));
        assert!(!semver_compatible("garbage", "0.1.0"));
    }
}
