//! The wasmtime engine every plugin runs in: its configuration (component model, epoch
//! interruption, pooling allocator), the compiler's, the epoch ticker and the runtime
//! calls run on.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use wasmtime::Engine;
use wasmtime::component::Linker;

use super::cache;
use super::error::SandboxError;
use super::error::one_line;
use super::state::CallState;
use super::stats::SandboxMetrics;
use super::{bindings, cpu};

/// How often the engine's epoch advances: a running guest yields at every tick.
pub(super) const EPOCH_TICK: Duration = Duration::from_millis(10);
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
    /// The key the cache's entries are sealed with (at least 32 bytes, this user's
    /// alone); `None`: `.key` in the cache directory, made on first use.
    pub cache_key_file: Option<PathBuf>,
    /// A read-only directory of precompiled code (`capstan precompile`), behind the
    /// cache: an entry the cache lacks is copied from there when it has one.
    pub precompiled_dir: Option<PathBuf>,
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
            cache_key_file: None,
            precompiled_dir: None,
            instances: DEFAULT_INSTANCES,
            cpu: None,
        }
    }
}

/// The wasmtime engine, linker, compile cache and call runtime shared by every loaded
/// plugin.
#[derive(Clone)]
pub struct Sandbox {
    pub(super) engine: Engine,
    /// The configuration plugins are compiled with, in an engine of their own.
    pub(super) compiler: Arc<wasmtime::Config>,
    pub(super) linker: Arc<Linker<CallState>>,
    pub(super) config: Arc<SandboxConfig>,
    /// The compile cache and its key, when there is a cache this host may use.
    pub(super) cache: Option<(PathBuf, cache::CacheKey)>,
    pub(super) runtime: Arc<CallRuntime>,
    /// One permit per pooled instance slot.
    pub(super) slots: Arc<tokio::sync::Semaphore>,
    pub(super) metrics: SandboxMetrics,
    _ticker: Arc<EpochTicker>,
}

/// The tokio runtime plugin calls run on. Shut down in the background when dropped, so
/// that dropping the last `Sandbox` is fine also inside an async context.
pub(super) struct CallRuntime(Option<tokio::runtime::Runtime>);

impl CallRuntime {
    pub(super) fn handle(&self) -> &tokio::runtime::Handle {
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
        // Each release's `log` (and types): plugins of every release link.
        bindings::v0_2::Plugin::add_to_linker::<_, wasmtime::component::HasSelf<_>>(
            &mut linker,
            |s| s,
        )
        .map_err(link)?;
        bindings::v0_1::Plugin::add_to_linker::<_, wasmtime::component::HasSelf<_>>(
            &mut linker,
            |s| s,
        )
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
        let cache = config.cache_dir.as_ref().and_then(|dir| {
            let usable = cache::check_dir(dir).and_then(|()| match &config.cache_key_file {
                Some(file) => cache::CacheKey::from_file(file, false),
                None => {
                    std::fs::create_dir_all(dir).map_err(|e| cache::CacheRefused::Key {
                        path: dir.join(".key"),
                        reason: format!("cannot create the cache directory: {e}"),
                    })?;
                    cache::CacheKey::from_file(&dir.join(".key"), true)
                }
            });
            match usable {
                Ok(key) => Some((dir.clone(), key)),
                Err(refused) => {
                    tracing::warn!(dir = %dir.display(), "the compile cache is not used, every plugin is compiled: {refused}");
                    None
                }
            }
        });
        Ok(Sandbox {
            cache,
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
    use crate::plugin::cache;

    #[test]
    fn code_compiled_without_the_pool_is_compatible_with_the_serving_engine() {
        let hash = |config: &wasmtime::Config| cache::compatibility(&Engine::new(config).unwrap());
        let serving = engine_config(&SandboxConfig::default());
        assert_eq!(hash(&serving), hash(&compiler_config(serving.clone())));
    }
}
