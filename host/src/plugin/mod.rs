//! Loading plugin components and calling them in the sandbox.
//!
//! A [`Sandbox`] owns the wasmtime engine (component model, epoch interruption, pooling
//! allocator), the linker (WASI with nothing granted, plus the `log` import) and the
//! on-disk cache of compiled code. [`Sandbox::load_file`] turns a `.wasm` file into a
//! [`Plugin`]: compiled, linked, pre-instantiated and described. Every call on a
//! [`Plugin`] runs in a fresh instance with its own deadline and memory cap.

mod bindings;
mod cache;
mod state;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use sha2::{Digest, Sha256};
use wasmtime::component::{Component, Linker};
use wasmtime::{Engine, Store, Trap};

use crate::contract::{Desired, FinalizeResult, Observed, PluginError, PluginInfo};
use bindings::PluginPre;
use state::CallState;

/// The contract version this host speaks, as in `wit/capstan.wit`.
pub const CONTRACT_VERSION: &str = "0.1.0";
const EXPORT_PREFIX: &str = "capstan:plugin/reconciler@";
/// How often the engine's epoch advances; deadlines are counted in these ticks.
const EPOCH_TICK: Duration = Duration::from_millis(10);

/// Limits and options of the sandbox every plugin call runs in.
#[derive(Debug, Clone)]
pub struct SandboxConfig {
    /// Wall-clock limit of one call (`describe`, `reconcile`, `finalize`).
    pub deadline: Duration,
    /// Linear-memory limit of one instance, in bytes.
    pub memory_limit: usize,
    /// Where compiled code is cached; `None` compiles every time.
    pub cache_dir: Option<PathBuf>,
}

impl Default for SandboxConfig {
    fn default() -> Self {
        SandboxConfig {
            deadline: Duration::from_secs(2),
            memory_limit: 64 << 20,
            cache_dir: None,
        }
    }
}

/// Why a plugin file could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not a WebAssembly component (a core module, or not wasm at all).
    #[error("{path} is not a WebAssembly component: {reason}")]
    NotComponent {
        /// The file.
        path: PathBuf,
        /// What it is instead.
        reason: String,
    },
    /// The component does not implement the contract this host speaks.
    #[error("{path} does not implement capstan:plugin@{CONTRACT_VERSION}: {reason}")]
    Contract {
        /// The file.
        path: PathBuf,
        /// What does not match.
        reason: String,
    },
    /// The component failed to compile or link.
    #[error("cannot compile {path}: {reason}")]
    Compile {
        /// The file.
        path: PathBuf,
        /// The compiler's message.
        reason: String,
    },
    /// `describe` failed or returned an invalid declaration.
    #[error("{path}: describe failed: {reason}")]
    Describe {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
}

/// Why a call into a plugin did not return a value. (A plugin's own `error` result is
/// not a `CallError`: it is returned as `Ok(Err(PluginError))`.)
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CallError {
    /// The call ran past the configured deadline and was interrupted.
    #[error("plugin {plugin} ran past its deadline of {deadline:?} and was stopped")]
    Deadline {
        /// Plugin name.
        plugin: String,
        /// The deadline.
        deadline: Duration,
    },
    /// The instance tried to grow its memory beyond the configured cap.
    #[error("plugin {plugin} exceeded its memory cap of {limit_mib} MiB and was stopped")]
    MemoryCap {
        /// Plugin name.
        plugin: String,
        /// The cap in MiB.
        limit_mib: usize,
    },
    /// The plugin panicked (the panic message is what it printed).
    #[error("plugin {plugin} panicked: {message}")]
    Panic {
        /// Plugin name.
        plugin: String,
        /// The panic message.
        message: String,
    },
    /// The plugin trapped for another reason.
    #[error("plugin {plugin} crashed: {message}")]
    Trap {
        /// Plugin name.
        plugin: String,
        /// The trap, without a backtrace.
        message: String,
    },
}

/// The wasmtime engine, linker and compile cache shared by every loaded plugin.
#[derive(Clone)]
pub struct Sandbox {
    engine: Engine,
    linker: Arc<Linker<CallState>>,
    config: Arc<SandboxConfig>,
    _ticker: Arc<EpochTicker>,
}

impl Sandbox {
    /// Creates the engine and starts the epoch ticker that enforces deadlines.
    pub fn new(config: SandboxConfig) -> anyhow::Result<Self> {
        let engine = Engine::new(&engine_config(&config))?;
        let mut linker = Linker::new(&engine);
        wasmtime_wasi::p2::add_to_linker_sync(&mut linker)?;
        bindings::Plugin::add_to_linker::<_, wasmtime::component::HasSelf<_>>(&mut linker, |s| s)?;
        let ticker = EpochTicker::start(engine.clone());
        Ok(Sandbox {
            engine,
            linker: Arc::new(linker),
            config: Arc::new(config),
            _ticker: Arc::new(ticker),
        })
    }

    /// The configuration the sandbox was made with.
    pub fn config(&self) -> &SandboxConfig {
        &self.config
    }

    /// Reads, compiles (or takes from the cache), links and describes a plugin file.
    pub fn load_file(&self, path: &Path) -> Result<Plugin, LoadError> {
        let bytes = std::fs::read(path).map_err(|source| LoadError::Read {
            path: path.to_owned(),
            source,
        })?;
        self.load_bytes(&bytes, path)
    }

    /// Like [`Sandbox::load_file`], for bytes already read; `path` names them in errors.
    pub fn load_bytes(&self, bytes: &[u8], path: &Path) -> Result<Plugin, LoadError> {
        check_component_header(bytes).map_err(|reason| LoadError::NotComponent {
            path: path.to_owned(),
            reason,
        })?;
        let sha256 = sha256_hex(bytes);
        let component = cache::compile(
            &self.engine,
            self.config.cache_dir.as_deref(),
            bytes,
            &sha256,
        )
        .map_err(|e| LoadError::Compile {
            path: path.to_owned(),
            reason: one_line(&e),
        })?;
        check_contract_version(&self.engine, &component).map_err(|reason| LoadError::Contract {
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
        let pre = PluginPre::new(instance_pre).map_err(|e| LoadError::Contract {
            path: path.to_owned(),
            reason: one_line(&e),
        })?;
        let file_name = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "plugin".into());
        let mut plugin = Plugin {
            inner: Arc::new(PluginInner {
                info: placeholder_info(&file_name),
                pre,
                sandbox: self.clone(),
                sha256,
                path: path.to_owned(),
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
        Arc::get_mut(&mut plugin.inner)
            .expect("plugin not shared yet")
            .info = info;
        Ok(plugin)
    }
}

fn engine_config(config: &SandboxConfig) -> wasmtime::Config {
    let mut c = wasmtime::Config::new();
    c.wasm_component_model(true);
    c.epoch_interruption(true);
    let mut pool = wasmtime::PoolingAllocationConfig::default();
    // Bounded pool: up to 64 concurrent instances, each memory capped at the sandbox's
    // limit, so address-space reservations stay modest.
    pool.total_component_instances(64)
        .total_core_instances(64 * 4)
        .total_memories(64 * 2)
        .total_tables(64 * 4)
        .total_stacks(64)
        .max_memory_size(config.memory_limit);
    c.allocation_strategy(wasmtime::InstanceAllocationStrategy::Pooling(pool));
    c.memory_reservation(config.memory_limit as u64);
    c.memory_guard_size(64 << 10);
    c
}

/// A loaded, described plugin. Cheap to clone; every call runs in a fresh instance.
#[derive(Clone)]
pub struct Plugin {
    inner: Arc<PluginInner>,
}

struct PluginInner {
    info: PluginInfo,
    pre: PluginPre<CallState>,
    sandbox: Sandbox,
    sha256: String,
    path: PathBuf,
}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plugin")
            .field("name", &self.inner.info.name)
            .field("path", &self.inner.path)
            .field("sha256", &self.inner.sha256)
            .finish()
    }
}

impl Plugin {
    /// What the plugin declared.
    pub fn info(&self) -> &PluginInfo {
        &self.inner.info
    }

    /// The file it was loaded from.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// sha256 of the component's bytes, hex.
    pub fn sha256(&self) -> &str {
        &self.inner.sha256
    }

    fn describe(&self) -> Result<PluginInfo, CallError> {
        self.call(|plugin, store| plugin.call_describe(store))
            .map(Into::into)
    }

    /// Calls `reconcile` in a fresh instance.
    pub fn reconcile(
        &self,
        observed: &Observed,
    ) -> Result<Result<Desired, PluginError>, CallError> {
        let observed = bindings::observed_to_wit(observed);
        self.call(|plugin, store| plugin.call_reconcile(store, &observed))
            .map(|r| r.map(Into::into).map_err(Into::into))
    }

    /// Calls `finalize` in a fresh instance.
    pub fn finalize(
        &self,
        observed: &Observed,
    ) -> Result<Result<FinalizeResult, PluginError>, CallError> {
        let observed = bindings::observed_to_wit(observed);
        self.call(|plugin, store| plugin.call_finalize(store, &observed))
            .map(|r| r.map(Into::into).map_err(Into::into))
    }

    /// Runs `f` against a fresh instance under the deadline and memory cap, then logs
    /// what the plugin printed.
    fn call<R>(
        &self,
        f: impl FnOnce(
            &bindings::exports::capstan::plugin::reconciler::Guest,
            &mut Store<CallState>,
        ) -> wasmtime::Result<R>,
    ) -> Result<R, CallError> {
        let sandbox = &self.inner.sandbox;
        let name = &self.inner.info.name;
        let mut store = Store::new(
            &sandbox.engine,
            CallState::new(name, sandbox.config.memory_limit),
        );
        store.limiter(|s| &mut s.limits);
        let ticks = (sandbox.config.deadline.as_millis() / EPOCH_TICK.as_millis()).max(1) as u64;
        store.set_epoch_deadline(ticks);
        store.epoch_deadline_trap();
        let result = self
            .inner
            .pre
            .instantiate(&mut store)
            .and_then(|instance| f(instance.capstan_plugin_reconciler(), &mut store));
        let output = store.data_mut().take_output();
        output.log(name);
        result.map_err(|err| self.classify(err, store.data(), &output))
    }

    fn classify(
        &self,
        err: wasmtime::Error,
        state: &CallState,
        output: &state::Output,
    ) -> CallError {
        let plugin = self.inner.info.name.clone();
        if state.memory_exceeded() {
            return CallError::MemoryCap {
                plugin,
                limit_mib: self.inner.sandbox.config.memory_limit >> 20,
            };
        }
        if err.downcast_ref::<Trap>() == Some(&Trap::Interrupt) {
            return CallError::Deadline {
                plugin,
                deadline: self.inner.sandbox.config.deadline,
            };
        }
        if let Some(message) = output.panic_message() {
            return CallError::Panic { plugin, message };
        }
        let message = match err.downcast_ref::<Trap>() {
            Some(trap) => trap.to_string(),
            None => one_line(&err),
        };
        CallError::Trap { plugin, message }
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

/// Finds the versioned `reconciler` export and compares its version with ours before
/// linking, so a plugin built for another contract gets a message that says so.
fn check_contract_version(engine: &Engine, component: &Component) -> Result<(), String> {
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
    if !semver_compatible(found, CONTRACT_VERSION) {
        return Err(format!(
            "it was built for capstan:plugin@{found}, which this host cannot run; rebuild it against capstan-sdk for {CONTRACT_VERSION}"
        ));
    }
    Ok(())
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
    }
}

/// The first line of an error chain, without wasm backtraces.
fn one_line(err: &wasmtime::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in err.chain() {
        let text = cause.to_string();
        let first = text.lines().next().unwrap_or_default().trim().to_string();
        if first.is_empty() || first.starts_with("error while executing at wasm backtrace") {
            continue;
        }
        if !parts.contains(&first) {
            parts.push(first);
        }
    }
    parts.join(": ")
}

/// sha256 of `bytes`, as lower-case hex: the identity of a plugin version.
pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Advances the engine's epoch every [`EPOCH_TICK`] until dropped.
struct EpochTicker {
    stop: Arc<AtomicBool>,
}

impl EpochTicker {
    fn start(engine: Engine) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        std::thread::Builder::new()
            .name("capstan-epoch".into())
            .spawn(move || {
                while !flag.load(Ordering::Relaxed) {
                    std::thread::sleep(EPOCH_TICK);
                    engine.increment_epoch();
                }
            })
            .expect("spawn epoch thread");
        EpochTicker { stop }
    }
}

impl Drop for EpochTicker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
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
        assert!(!semver_compatible("1.0.0", "0.1.0"));
        assert!(semver_compatible("1.4.0", "1.0.0"));
        assert!(!semver_compatible("garbage", "0.1.0"));
    }
}
