//! Loading plugin components and calling them in the sandbox.
//!
//! A [`Sandbox`] owns the wasmtime engine (component model, epoch interruption, pooling
//! allocator), the linker (WASI with nothing granted, plus the `log` import) and the
//! on-disk cache of compiled code. [`Sandbox::load_file`] turns a `.wasm` file into a
//! [`Plugin`]: compiled, linked, pre-instantiated and described. Every call on a
//! [`Plugin`] runs in a fresh instance with its own deadline and memory cap.
//!
//! **Async and blocking callers.** Each operation comes twice: `load_file`,
//! `reconcile_async`, `finalize_async` for async code, and `load_file_blocking`,
//! `reconcile_blocking`, `finalize_blocking` for threads that run no async code (the
//! command line, tests, `spawn_blocking`). None of them panics wherever it is called: a
//! blocking call made on a thread of a tokio runtime runs on the sandbox's runtime while
//! the caller's thread waits, which is correct but holds that thread for the call.
//!
//! **Why the deadline holds whatever the guest does.** Calls are async (wasmtime's
//! `async_support`): the guest runs on a fiber and, through `epoch_deadline_async_yield_
//! and_update`, yields back to the executor at every epoch tick (10 ms); WASI's clocks
//! and polls are async host functions, so a guest that sleeps or polls is a pending
//! future, not a blocked thread. The whole call (instantiation included) sits inside a
//! `tokio::time::timeout`: when the deadline passes, the call's future is dropped at its
//! next yield or wake-up — the fiber is torn down, the `Store` dropped and the instance's
//! pool slot freed — whether the guest was computing, sleeping, polling a clock or
//! waiting on a stream. An epoch *trap* alone (the previous design) only fires while wasm
//! code runs, so a guest blocked in a host call could overrun its deadline without bound.
//!
//! Calls run on a runtime of their own (one worker thread per core), so busy guests take
//! turns with each other in 10 ms slices there and never occupy the threads that serve
//! the operator's watches and API requests.

mod bindings;
mod cache;
mod cpu;
pub mod limits;
mod state;
mod stats;

pub use limits::{LimitsError, LimitsFile};
pub use stats::{Outcome, SandboxMetrics, SandboxSummary};

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, RwLock};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use wasmtime::component::{Component, Linker};
use wasmtime::{Engine, Store, Trap};

use crate::contract::{Desired, FinalizeResult, Observed, PluginError, PluginInfo};
use bindings::PluginPre;
use limits::Limits;
use state::CallState;

/// The contract version this host speaks, as in `wit/capstan.wit`.
pub const CONTRACT_VERSION: &str = "0.1.0";
const EXPORT_PREFIX: &str = "capstan:plugin/reconciler@";
/// How often the engine's epoch advances: a running guest yields at every tick.
const EPOCH_TICK: Duration = Duration::from_millis(10);
/// Instances that may exist at once across all plugins, unless configured: the
/// pooling allocator reserves this many slots up front. A call waits for a free slot
/// (outside its deadline) rather than fail.
pub const DEFAULT_INSTANCES: u32 = 64;

/// Limits and options of the sandbox every plugin call runs in.
#[derive(Debug, Clone)]
pub struct SandboxConfig {
    /// Wall-clock limit of one call (`describe`, `reconcile`, `finalize`).
    pub deadline: Duration,
    /// Linear-memory limit of one instance, in bytes.
    pub memory_limit: usize,
    /// Where compiled code is cached; `None` compiles every time.
    pub cache_dir: Option<PathBuf>,
    /// Instances that may exist at once, across all plugins (the pool's size).
    pub instances: u32,
    /// CPU each plugin's calls may use together, in cores; `None`: no share.
    pub cpu: Option<f64>,
}

impl Default for SandboxConfig {
    fn default() -> Self {
        SandboxConfig {
            deadline: Duration::from_secs(2),
            memory_limit: 64 << 20,
            cache_dir: None,
            instances: DEFAULT_INSTANCES,
            cpu: None,
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

/// Why the sandbox could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// The pooling allocator could not reserve its instance slots (address space or
    /// memory limits of the process).
    #[error(
        "cannot reserve the plugin instance pool ({instances} instances of up to {memory_mib} MiB): {reason}"
    )]
    Pool {
        /// Instances asked for.
        instances: u32,
        /// Memory cap of one instance, in MiB.
        memory_mib: usize,
        /// The engine's message.
        reason: String,
    },
    /// WASI or the `log` import could not be added to the linker.
    #[error("cannot link the host's imports: {0}")]
    Link(String),
    /// The threads of the call runtime could not be started.
    #[error("cannot start the plugin call runtime")]
    Runtime(#[source] std::io::Error),
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

/// The wasmtime engine, linker, compile cache and call runtime shared by every loaded
/// plugin.
#[derive(Clone)]
pub struct Sandbox {
    engine: Engine,
    /// The configuration plugins are compiled with, in an engine of their own.
    compiler: Arc<wasmtime::Config>,
    linker: Arc<Linker<CallState>>,
    config: Arc<SandboxConfig>,
    runtime: Arc<CallRuntime>,
    /// One permit per pooled instance slot.
    slots: Arc<tokio::sync::Semaphore>,
    metrics: SandboxMetrics,
    _ticker: Arc<EpochTicker>,
}

/// The tokio runtime plugin calls run on. Shut down in the background when dropped, so
/// that dropping the last `Sandbox` is fine also inside an async context.
struct CallRuntime(Option<tokio::runtime::Runtime>);

impl CallRuntime {
    fn handle(&self) -> &tokio::runtime::Handle {
        self.0
            .as_ref()
            .expect("the runtime lives until dropped")
            .handle()
    }
}

impl Drop for CallRuntime {
    fn drop(&mut self) {
        if let Some(runtime) = self.0.take() {
            runtime.shutdown_background();
        }
    }
}

impl Sandbox {
    /// Creates the engine and starts the epoch ticker that enforces deadlines.
    pub fn new(config: SandboxConfig) -> Result<Self, SandboxError> {
        let serving = engine_config(&config);
        let engine = Engine::new(&serving).map_err(|e| SandboxError::Pool {
            instances: config.instances,
            memory_mib: config.memory_limit >> 20,
            reason: one_line(&e),
        })?;
        let mut linker = Linker::new(&engine);
        let link = |e: wasmtime::Error| SandboxError::Link(one_line(&e));
        wasmtime_wasi::p2::add_to_linker_async(&mut linker).map_err(link)?;
        bindings::Plugin::add_to_linker::<_, wasmtime::component::HasSelf<_>>(&mut linker, |s| s)
            .map_err(link)?;
        let workers = std::thread::available_parallelism().map_or(2, |n| n.get());
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers)
            .thread_name("capstan-sandbox")
            .on_thread_start(cpu::lower_this_threads_priority)
            .enable_time()
            .build()
            .map_err(SandboxError::Runtime)?;
        let ticker = EpochTicker::start(engine.clone());
        let slots = Arc::new(tokio::sync::Semaphore::new(config.instances.max(1) as usize));
        Ok(Sandbox {
            engine,
            compiler: Arc::new(compiler_config(serving)),
            linker: Arc::new(linker),
            config: Arc::new(config),
            runtime: Arc::new(CallRuntime(Some(runtime))),
            slots,
            metrics: SandboxMetrics::default(),
            _ticker: Arc::new(ticker),
        })
    }

    /// Per-plugin call metrics.
    pub fn metrics(&self) -> &SandboxMetrics {
        &self.metrics
    }

    /// The configuration the sandbox was made with.
    pub fn config(&self) -> &SandboxConfig {
        &self.config
    }

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
    /// plugin is compiled and described.
    pub fn load_file_blocking(&self, path: &Path) -> Result<Plugin, LoadError> {
        let bytes = std::fs::read(path).map_err(|source| LoadError::Read {
            path: path.to_owned(),
            source,
        })?;
        self.load_bytes_blocking(&bytes, path)
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
        let pre = PluginPre::new(instance_pre).map_err(|e| LoadError::Contract {
            path: path.to_owned(),
            reason: one_line(&e),
        })?;
        let file_name = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "plugin".into());
        let plugin = Plugin {
            inner: Arc::new(PluginInner {
                info: placeholder_info(&file_name),
                pre,
                sandbox: self.clone(),
                sha256,
                path: path.to_owned(),
                slow: SlowUntil::default(),
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
        Ok(Plugin {
            inner: Arc::new(PluginInner {
                info,
                pre: inner.pre.clone(),
                sandbox: self.clone(),
                sha256: inner.sha256.clone(),
                path: inner.path.clone(),
                slow: SlowUntil::default(),
                _cache_entry: cached,
                limits: RwLock::new(Arc::new(Limits::resolve(
                    &self.config,
                    LimitsFile::default(),
                ))),
            }),
        })
    }
}

/// Bytes of each linear memory and table kept resident in a pool slot between calls.
const KEEP_RESIDENT: usize = 2 << 20;
/// Unused slots kept warm (their pages resident) for the next calls.
const WARM_SLOTS: u32 = 8;

fn engine_config(config: &SandboxConfig) -> wasmtime::Config {
    let mut c = wasmtime::Config::new();
    c.wasm_component_model(true);
    c.epoch_interruption(true);
    let mut pool = wasmtime::PoolingAllocationConfig::default();
    // Bounded pool: up to `instances` concurrent instances, each memory capped at the
    // sandbox's limit.
    let n = config.instances.max(1);
    pool.total_component_instances(n)
        .total_core_instances(n * 4)
        .total_memories(n * 2)
        .total_tables(n * 4)
        .total_stacks(n)
        .max_memory_size(config.memory_limit);
    // A call's instance is fresh, but its slot is not: the pages a call dirtied are
    // reset in place (found with the kernel's PAGEMAP_SCAN where it has it, else by
    // memset), up to this much, instead of being unmapped and faulted in again by the
    // next call. This is most of a small plugin's per-call cost otherwise, and keeps at
    // most this much resident per warm slot.
    pool.linear_memory_keep_resident(KEEP_RESIDENT)
        .table_keep_resident(KEEP_RESIDENT)
        .pagemap_scan(wasmtime::Enabled::Auto)
        // Warm slots left unused keep their resident pages: bound how many, so that a
        // burst of concurrent calls does not leave every slot of the pool resident.
        .max_unused_warm_slots(WARM_SLOTS);
    // No decommit batching: a slot waiting in a batch cannot be reused, so the next call
    // would take a cold slot and fault its pages in.
    c.allocation_strategy(wasmtime::InstanceAllocationStrategy::Pooling(pool));
    // 4 GiB of address space per memory plus a guard region (address space only, never
    // committed): the compiled code then needs no bounds checks. The memory cap is
    // enforced by the pool's `max_memory_size` and the store's limiter, not by this.
    c.memory_reservation(4 << 30);
    c.memory_guard_size(2 << 30);
    c
}

/// The serving engine's configuration without its instance pool: compiled code does not
/// depend on how instances are allocated, and a compile needs no pool.
fn compiler_config(mut serving: wasmtime::Config) -> wasmtime::Config {
    serving.allocation_strategy(wasmtime::InstanceAllocationStrategy::OnDemand);
    serving
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
    /// Set by a call that ran for an epoch tick or more: until then, its async calls go
    /// straight to the sandbox's runtime (see [`Plugin::spawn`]).
    slow: SlowUntil,
    /// Keeps the compiled code's cache entry from eviction while the plugin is loaded.
    _cache_entry: Option<cache::CacheEntry>,
    /// The limits its calls run under; a call takes them as they are when it starts.
    limits: RwLock<Arc<Limits>>,
}

/// How long after a call that ran an epoch tick or more a plugin's async calls start on
/// the sandbox's runtime. A fast call does not end it early: a plugin that mixes fast
/// and busy calls (or is made to) would otherwise take the caller's thread for a tick
/// with every busy call that follows a fast one.
const SLOW_FOR: Duration = Duration::from_secs(1);

/// Until when a plugin counts as slow (see [`SLOW_FOR`]), in nanoseconds of the
/// process's monotonic clock.
#[derive(Default)]
struct SlowUntil(AtomicU64);

impl SlowUntil {
    fn now() -> u64 {
        static START: OnceLock<Instant> = OnceLock::new();
        START.get_or_init(Instant::now).elapsed().as_nanos() as u64
    }

    fn is_slow(&self) -> bool {
        Self::now() < self.0.load(Ordering::Relaxed)
    }

    fn mark(&self) {
        let until = Self::now() + SLOW_FOR.as_nanos() as u64;
        self.0.fetch_max(until, Ordering::Relaxed);
    }
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

    /// Sets the plugin's own limits (from its limits file, [`limits`]) over the
    /// sandbox's; calls that start from now on run under them.
    pub fn set_limits(&self, file: LimitsFile) {
        let resolved = Arc::new(Limits::resolve(&self.inner.sandbox.config, file));
        *self.inner.limits.write().expect("limits lock") = resolved;
    }

    /// What the plugin's limits file set (empty: the sandbox's limits throughout).
    pub fn limits_file(&self) -> LimitsFile {
        self.limits().file.clone()
    }

    fn limits(&self) -> Arc<Limits> {
        self.inner.limits.read().expect("limits lock").clone()
    }

    fn describe(&self) -> Result<PluginInfo, CallError> {
        self.blocking(|plugin| async move {
            plugin
                .call(
                    async |guest, store| guest.call_describe(store).await,
                    |_| Outcome::Ok,
                )
                .await
                .map(Into::into)
        })
    }

    /// Calls `reconcile` in a fresh instance, on the sandbox's runtime.
    pub async fn reconcile_async(
        &self,
        observed: &Observed,
    ) -> Result<Result<Desired, PluginError>, CallError> {
        let observed = bindings::observed_to_wit(observed);
        self.spawn(|plugin| async move {
            plugin
                .call(
                    async |guest, store| guest.call_reconcile(store, &observed).await,
                    answer_outcome,
                )
                .await
                .map(|r| r.map(Into::into).map_err(Into::into))
        })
        .await
    }

    /// Calls `finalize` in a fresh instance, on the sandbox's runtime.
    pub async fn finalize_async(
        &self,
        observed: &Observed,
    ) -> Result<Result<FinalizeResult, PluginError>, CallError> {
        let observed = bindings::observed_to_wit(observed);
        self.spawn(|plugin| async move {
            plugin
                .call(
                    async |guest, store| guest.call_finalize(store, &observed).await,
                    answer_outcome,
                )
                .await
                .map(|r| r.map(Into::into).map_err(Into::into))
        })
        .await
    }

    /// [`Plugin::reconcile_async`] for a thread that runs no async code (the command
    /// line, tests): blocks it until the call is done.
    pub fn reconcile_blocking(
        &self,
        observed: &Observed,
    ) -> Result<Result<Desired, PluginError>, CallError> {
        let observed = bindings::observed_to_wit(observed);
        self.blocking(|plugin| async move {
            plugin
                .call(
                    async |guest, store| guest.call_reconcile(store, &observed).await,
                    answer_outcome,
                )
                .await
                .map(|r| r.map(Into::into).map_err(Into::into))
        })
    }

    /// [`Plugin::finalize_async`] for a thread that runs no async code.
    pub fn finalize_blocking(
        &self,
        observed: &Observed,
    ) -> Result<Result<FinalizeResult, PluginError>, CallError> {
        let observed = bindings::observed_to_wit(observed);
        self.blocking(|plugin| async move {
            plugin
                .call(
                    async |guest, store| guest.call_finalize(store, &observed).await,
                    answer_outcome,
                )
                .await
                .map(|r| r.map(Into::into).map_err(Into::into))
        })
    }

    /// Runs `call` for an async caller and awaits it. Should the caller stop waiting,
    /// the call still ends at its deadline.
    ///
    /// A call starts on the caller's thread, polled once there in the sandbox runtime's
    /// context (its timers and WASI are the sandbox's): most calls end within that
    /// poll, with no thread hand-off (a hand-off is two wake-ups, tens of microseconds,
    /// more than a small call itself). A call that does not end there (a guest still
    /// running at the next epoch tick yields; or it waits for a slot or a timer) moves,
    /// as it stands, to the sandbox's runtime and is awaited there, so a busy guest
    /// holds the caller's thread for at most one tick. For [`SLOW_FOR`] after a call of
    /// a tick or more, the plugin's calls start on the sandbox's runtime right away: a
    /// guest that burns CPU on every call, or on some calls among fast ones, costs the
    /// caller's threads a tick once in a while, not once per call.
    async fn spawn<R, F>(&self, call: impl FnOnce(Plugin) -> F) -> Result<R, CallError>
    where
        F: std::future::Future<Output = Result<R, CallError>> + Send + 'static,
        R: Send + 'static,
    {
        let runtime = self.inner.sandbox.runtime.handle();
        let mut call = Box::pin(call(self.clone()));
        if !self.inner.slow.is_slow() {
            let first = std::future::poll_fn(|cx| {
                let _context = runtime.enter();
                std::task::Poll::Ready(call.as_mut().poll(cx))
            })
            .await;
            if let std::task::Poll::Ready(result) = first {
                return result;
            }
        }
        // Polled again from the spawned task, the call wakes that task from now on.
        let task = runtime.spawn(call);
        task.await.unwrap_or_else(|e| Err(self.lost(e)))
    }

    /// Runs `call` and blocks this thread until it is done. On a thread that runs no
    /// runtime, the call runs here, with the sandbox's runtime for its timers: that saves
    /// two thread wake-ups (to start it and to hand back the answer), a fifth of a small
    /// call. On a thread of a runtime (an async task, `spawn_blocking`) that would panic
    /// ("cannot start a runtime from within a runtime"): the call runs on the sandbox's
    /// runtime instead and this thread waits for its answer.
    fn blocking<R, F>(&self, call: impl FnOnce(Plugin) -> F) -> Result<R, CallError>
    where
        F: std::future::Future<Output = Result<R, CallError>> + Send + 'static,
        R: Send + 'static,
    {
        let runtime = self.inner.sandbox.runtime.handle();
        if tokio::runtime::Handle::try_current().is_err() {
            return runtime.block_on(call(self.clone()));
        }
        let (answer, answered) = std::sync::mpsc::sync_channel(1);
        let call = call(self.clone());
        runtime.spawn(async move {
            let _ = answer.send(call.await);
        });
        answered.recv().unwrap_or_else(|_| {
            Err(CallError::Trap {
                plugin: self.inner.info.name.clone(),
                message: "the call did not complete: the sandbox's runtime stopped".into(),
            })
        })
    }

    fn lost(&self, e: tokio::task::JoinError) -> CallError {
        CallError::Trap {
            plugin: self.inner.info.name.clone(),
            message: format!("the call did not complete: {e}"),
        }
    }

    /// Runs `f` against a fresh instance under the deadline and memory cap, then logs
    /// what the plugin printed. The deadline covers instantiation and the call; waiting
    /// for a free instance slot comes before it and is never the plugin's fault.
    async fn call<R>(
        &self,
        f: impl AsyncFnOnce(
            &bindings::exports::capstan::plugin::reconciler::Guest,
            &mut Store<CallState>,
        ) -> wasmtime::Result<R>,
        outcome_of: impl Fn(&R) -> Outcome,
    ) -> Result<R, CallError> {
        let sandbox = &self.inner.sandbox;
        let name = &self.inner.info.name;
        let limits = self.limits();
        let waiting = Instant::now();
        let _turn = match &limits.concurrency {
            Some(calls) => Some(
                calls
                    .clone()
                    .acquire_owned()
                    .await
                    .expect("a plugin's call semaphore is never closed"),
            ),
            None => None,
        };
        let _slot = sandbox
            .slots
            .acquire()
            .await
            .expect("the slot semaphore is never closed");
        sandbox.metrics.waited_for_slot(waiting.elapsed());
        let _running = sandbox.metrics.running(name);
        let mut store = Store::new(&sandbox.engine, CallState::new(name, limits.memory_limit));
        store.limiter(|s| &mut s.limits);
        // Yield at the next epoch tick, then at every tick (a new store's deadline is
        // the epoch already passed: without this, every call yields at its first
        // check, which costs an async call its run on the caller's thread).
        store.set_epoch_deadline(1);
        store.epoch_deadline_async_yield_and_update(1);
        let started = Instant::now();
        let run = async {
            let instance = self.inner.pre.instantiate_async(&mut store).await?;
            f(instance.capstan_plugin_reconciler(), &mut store).await
        };
        // Time held back by the plugin's CPU share counts against its deadline.
        let outcome = match &limits.cpu {
            Some(budget) => {
                tokio::time::timeout(limits.deadline, cpu::metered(budget.clone(), run)).await
            }
            None => tokio::time::timeout(limits.deadline, run).await,
        };
        let took = started.elapsed();
        if took >= EPOCH_TICK {
            self.inner.slow.mark();
        }
        let output = store.data_mut().take_output();
        output.log(name);
        let result = match outcome {
            Ok(result) => result.map_err(|err| self.classify(err, store.data(), &output, &limits)),
            Err(_) => {
                tracing::debug!(plugin = %name, elapsed = ?took, "call stopped at its deadline");
                Err(CallError::Deadline {
                    plugin: name.clone(),
                    deadline: limits.deadline,
                })
            }
        };
        let outcome = match &result {
            Ok(answer) => outcome_of(answer),
            Err(CallError::Deadline { .. }) => Outcome::Deadline,
            Err(CallError::MemoryCap { .. }) => Outcome::Memory,
            Err(CallError::Panic { .. }) => Outcome::Panic,
            Err(CallError::Trap { .. }) => Outcome::Trap,
        };
        sandbox.metrics.record(
            name,
            outcome,
            took,
            store.data().peak_memory() as u64,
            output.dropped(),
        );
        result
    }

    fn classify(
        &self,
        err: wasmtime::Error,
        state: &CallState,
        output: &state::Output,
        limits: &Limits,
    ) -> CallError {
        let plugin = self.inner.info.name.clone();
        if state.memory_exceeded() {
            return CallError::MemoryCap {
                plugin,
                limit_mib: limits.memory_limit >> 20,
            };
        }
        if err.downcast_ref::<Trap>() == Some(&Trap::Interrupt) {
            return CallError::Deadline {
                plugin,
                deadline: limits.deadline,
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

/// The outcome of a call that returned the plugin's own `result<_, error>`.
fn answer_outcome<T>(answer: &Result<T, bindings::capstan::plugin::types::Error>) -> Outcome {
    use bindings::capstan::plugin::types::Error;
    match answer {
        Ok(_) => Outcome::Ok,
        Err(Error::Invalid(_)) => Outcome::Invalid,
        Err(Error::Retry(_)) => Outcome::Retry,
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
    fn code_compiled_without_the_pool_is_compatible_with_the_serving_engine() {
        let hash = |config: &wasmtime::Config| cache::compatibility(&Engine::new(config).unwrap());
        let serving = engine_config(&SandboxConfig::default());
        assert_eq!(hash(&serving), hash(&compiler_config(serving.clone())));
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
