//! Calling a loaded plugin: each call in a fresh instance under its deadline, memory
//! cap and CPU share, for async and for blocking callers.
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

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, RwLock};
use std::time::{Duration, Instant};

use wasmtime::{Store, Trap};

use super::bindings::{Pre, from_v0_1, from_v0_2};
use super::engine::EPOCH_TICK;
use super::engine::Sandbox;
use super::error::CallError;
use super::error::one_line;
use super::limits::Limits;
use super::limits::LimitsFile;
use super::state::{self, CallState, LogRate, Pinned};
use super::stats::Outcome;
use super::{cache, cpu};
use crate::contract::{Desired, FinalizeResult, Observed, PluginError, PluginInfo, RelatedRequest};

/// A loaded, described component: the wasm implementation of a [`Plugin`]. Cheap to
/// clone; every call runs in a fresh instance.
#[derive(Clone)]
pub struct WasmPlugin {
    pub(super) inner: Arc<PluginInner>,
}

pub(super) struct PluginInner {
    pub(super) info: PluginInfo,
    pub(super) pre: Pre<CallState>,
    pub(super) sandbox: Sandbox,
    pub(super) sha256: String,
    pub(super) path: PathBuf,
    /// Set by a call that ran for an epoch tick or more: until then, its async calls go
    /// straight to the sandbox's runtime (see [`WasmPlugin::spawn`]).
    pub(super) slow: SlowUntil,
    /// Keeps the compiled code's cache entry from eviction while the plugin is loaded.
    pub(super) _cache_entry: Option<cache::CacheEntry>,
    /// The limits its calls run under; a call takes them as they are when it starts.
    pub(super) limits: RwLock<Arc<Limits>>,
    /// Its log budget across calls.
    pub(super) log_rate: Arc<LogRate>,
}

/// How long after a call that ran an epoch tick or more a plugin's async calls start on
/// the sandbox's runtime. A fast call does not end it early: a plugin that mixes fast
/// and busy calls (or is made to) would otherwise take the caller's thread for a tick
/// with every busy call that follows a fast one.
const SLOW_FOR: Duration = Duration::from_secs(1);

/// Until when a plugin counts as slow (see [`SLOW_FOR`]), in nanoseconds of the
/// process's monotonic clock.
#[derive(Default)]
pub(super) struct SlowUntil(AtomicU64);

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

impl std::fmt::Debug for WasmPlugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WasmPlugin")
            .field("name", &self.inner.info.name)
            .field("path", &self.inner.path)
            .field("sha256", &self.inner.sha256)
            .finish()
    }
}

impl WasmPlugin {
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

    /// Sets the plugin's own limits (from its limits file, [`limits`](super::limits)) over the
    /// sandbox's; calls that start from now on run under them.
    pub fn set_limits(&self, file: LimitsFile) {
        let resolved = Arc::new(Limits::resolve(&self.inner.sandbox.config, file));
        *self.inner.limits.write().expect("limits lock") = resolved;
    }

    /// What the plugin's limits file set (empty: the sandbox's limits throughout).
    pub fn limits_file(&self) -> LimitsFile {
        self.limits().file.clone()
    }

    /// The wall-clock limit of its calls, as they start now (its limits file's, else
    /// the sandbox's).
    pub fn deadline(&self) -> Duration {
        self.limits().deadline
    }

    fn limits(&self) -> Arc<Limits> {
        self.inner.limits.read().expect("limits lock").clone()
    }

    /// The contract release the plugin was built for.
    pub fn contract(&self) -> &'static str {
        self.inner.pre.version()
    }

    pub(super) fn describe(&self) -> Result<PluginInfo, CallError> {
        self.blocking(|plugin| async move {
            plugin
                .call(
                    async |pre, store| match pre {
                        Pre::V0_1(pre) => {
                            let instance = pre.instantiate_async(&mut *store).await?;
                            let guest = instance.capstan_plugin_reconciler();
                            guest.call_describe(&mut *store).await.map(Into::into)
                        }
                        Pre::V0_2(pre) => {
                            let instance = pre.instantiate_async(&mut *store).await?;
                            let guest = instance.capstan_plugin_reconciler();
                            guest.call_describe(&mut *store).await.map(Into::into)
                        }
                    },
                    |_| Outcome::Ok,
                    None,
                )
                .await
        })
    }

    /// Calls `customize` in a fresh instance, on the sandbox's runtime: which related
    /// objects `parent` needs, the call's clock and random `pinned`. A plugin that
    /// declares no related kind (every 0.1.0 plugin) needs none, and is not called.
    pub async fn customize_pinned(
        &self,
        parent: &serde_json::Value,
        pinned: Option<Pinned>,
    ) -> Result<Result<Vec<RelatedRequest>, PluginError>, CallError> {
        if self.inner.info.related.is_empty() {
            return Ok(Ok(Vec::new()));
        }
        let parent = parent.to_string();
        self.spawn(|plugin| plugin.customize_call(parent, pinned))
            .await
    }

    /// [`WasmPlugin::customize_pinned`] for a thread that runs no async code.
    pub fn customize_blocking(
        &self,
        parent: &serde_json::Value,
        pinned: Option<Pinned>,
    ) -> Result<Result<Vec<RelatedRequest>, PluginError>, CallError> {
        if self.inner.info.related.is_empty() {
            return Ok(Ok(Vec::new()));
        }
        let parent = parent.to_string();
        self.blocking(|plugin| plugin.customize_call(parent, pinned))
    }

    /// Calls `reconcile` in a fresh instance, on the sandbox's runtime, the call's clock
    /// and random `pinned`.
    pub async fn reconcile_pinned(
        &self,
        observed: &Observed,
        pinned: Option<Pinned>,
    ) -> Result<Result<Desired, PluginError>, CallError> {
        let observed = self.observed(observed);
        self.spawn(|plugin| plugin.reconcile_call(observed, pinned))
            .await
    }

    /// Calls `finalize` in a fresh instance, on the sandbox's runtime, the call's clock
    /// and random `pinned`.
    pub async fn finalize_pinned(
        &self,
        observed: &Observed,
        pinned: Option<Pinned>,
    ) -> Result<Result<FinalizeResult, PluginError>, CallError> {
        let observed = self.observed(observed);
        self.spawn(|plugin| plugin.finalize_call(observed, pinned))
            .await
    }

    /// [`WasmPlugin::reconcile_pinned`] for a thread that runs no async code (the command
    /// line, tests): blocks it until the call is done.
    pub fn reconcile_blocking(
        &self,
        observed: &Observed,
        pinned: Option<Pinned>,
    ) -> Result<Result<Desired, PluginError>, CallError> {
        let observed = self.observed(observed);
        self.blocking(|plugin| plugin.reconcile_call(observed, pinned))
    }

    /// [`WasmPlugin::finalize_pinned`] for a thread that runs no async code.
    pub fn finalize_blocking(
        &self,
        observed: &Observed,
        pinned: Option<Pinned>,
    ) -> Result<Result<FinalizeResult, PluginError>, CallError> {
        let observed = self.observed(observed);
        self.blocking(|plugin| plugin.finalize_call(observed, pinned))
    }

    /// Calls `validate` in a fresh instance, on the sandbox's runtime: `Ok` with the
    /// warnings when the change from `old` (none: a create) to `new` is allowed, `Err`
    /// with the plugin's message when it is refused. A plugin that does not validate
    /// ([`PluginInfo::validation`] unset) allows everything without a call.
    pub async fn validate_async(
        &self,
        old: Option<&serde_json::Value>,
        new: &serde_json::Value,
    ) -> Result<Result<Vec<String>, String>, CallError> {
        if self.inner.info.validation.is_none() {
            return Ok(Ok(Vec::new()));
        }
        let (old, new) = (old.map(ToString::to_string), new.to_string());
        self.spawn(|plugin| plugin.validate_call(old, new)).await
    }

    /// [`WasmPlugin::validate_async`] for a thread that runs no async code.
    pub fn validate_blocking(
        &self,
        old: Option<&serde_json::Value>,
        new: &serde_json::Value,
    ) -> Result<Result<Vec<String>, String>, CallError> {
        if self.inner.info.validation.is_none() {
            return Ok(Ok(Vec::new()));
        }
        let (old, new) = (old.map(ToString::to_string), new.to_string());
        self.blocking(|plugin| plugin.validate_call(old, new))
    }

    /// Calls `convert` in a fresh instance, on the sandbox's runtime: `object` as
    /// `to_version`, or the plugin's reason why not. The host checks the answer
    /// (see [`crate::validate::converted`]).
    pub async fn convert_async(
        &self,
        object: &serde_json::Value,
        to_version: &str,
    ) -> Result<Result<String, String>, CallError> {
        if !self.inner.info.conversion {
            return Ok(Err(self.no_conversion()));
        }
        let (object, to) = (object.to_string(), to_version.to_string());
        self.spawn(|plugin| plugin.convert_call(object, to)).await
    }

    /// [`WasmPlugin::convert_async`] for a thread that runs no async code.
    pub fn convert_blocking(
        &self,
        object: &serde_json::Value,
        to_version: &str,
    ) -> Result<Result<String, String>, CallError> {
        if !self.inner.info.conversion {
            return Ok(Err(self.no_conversion()));
        }
        let (object, to) = (object.to_string(), to_version.to_string());
        self.blocking(|plugin| plugin.convert_call(object, to))
    }

    fn no_conversion(&self) -> String {
        format!(
            "plugin {} does not convert between versions (it does not declare conversion)",
            self.inner.info.name
        )
    }

    /// The observed state in the bindings of the plugin's release.
    fn observed(&self, observed: &Observed) -> WitObserved {
        match &self.inner.pre {
            Pre::V0_1(_) => WitObserved::V0_1(from_v0_1::observed(observed)),
            Pre::V0_2(_) => WitObserved::V0_2(from_v0_2::observed(observed)),
        }
    }

    async fn customize_call(
        self,
        parent: String,
        pinned: Option<Pinned>,
    ) -> Result<Result<Vec<RelatedRequest>, PluginError>, CallError> {
        self.call(
            async |pre, store| match pre {
                Pre::V0_1(_) => Ok(Ok(Vec::new())),
                Pre::V0_2(pre) => {
                    let instance = pre.instantiate_async(&mut *store).await?;
                    let guest = instance.capstan_plugin_reconciler();
                    let answer = guest.call_customize(&mut *store, &parent).await?;
                    Ok(answer
                        .map(|r| r.into_iter().map(Into::into).collect())
                        .map_err(Into::into))
                }
            },
            answer_outcome,
            pinned,
        )
        .await
    }

    /// One `reconcile` call, its answer in the host's types; [`WasmPlugin::spawn`] or
    /// [`WasmPlugin::blocking`] decides where it runs.
    async fn reconcile_call(
        self,
        observed: WitObserved,
        pinned: Option<Pinned>,
    ) -> Result<Result<Desired, PluginError>, CallError> {
        self.call(
            async |pre, store| match (pre, &observed) {
                (Pre::V0_1(pre), WitObserved::V0_1(observed)) => {
                    let instance = pre.instantiate_async(&mut *store).await?;
                    let guest = instance.capstan_plugin_reconciler();
                    let answer = guest.call_reconcile(&mut *store, observed).await?;
                    Ok(answer.map(Into::into).map_err(Into::into))
                }
                (Pre::V0_2(pre), WitObserved::V0_2(observed)) => {
                    let instance = pre.instantiate_async(&mut *store).await?;
                    let guest = instance.capstan_plugin_reconciler();
                    let answer = guest.call_reconcile(&mut *store, observed).await?;
                    Ok(answer.map(Into::into).map_err(Into::into))
                }
                _ => unreachable!("the observed state is made for the plugin's release"),
            },
            answer_outcome,
            pinned,
        )
        .await
    }

    /// One `finalize` call, its answer in the host's types.
    async fn finalize_call(
        self,
        observed: WitObserved,
        pinned: Option<Pinned>,
    ) -> Result<Result<FinalizeResult, PluginError>, CallError> {
        self.call(
            async |pre, store| match (pre, &observed) {
                (Pre::V0_1(pre), WitObserved::V0_1(observed)) => {
                    let instance = pre.instantiate_async(&mut *store).await?;
                    let guest = instance.capstan_plugin_reconciler();
                    let answer = guest.call_finalize(&mut *store, observed).await?;
                    Ok(answer.map(Into::into).map_err(Into::into))
                }
                (Pre::V0_2(pre), WitObserved::V0_2(observed)) => {
                    let instance = pre.instantiate_async(&mut *store).await?;
                    let guest = instance.capstan_plugin_reconciler();
                    let answer = guest.call_finalize(&mut *store, observed).await?;
                    Ok(answer.map(Into::into).map_err(Into::into))
                }
                _ => unreachable!("the observed state is made for the plugin's release"),
            },
            answer_outcome,
            pinned,
        )
        .await
    }

    async fn validate_call(
        self,
        old: Option<String>,
        new: String,
    ) -> Result<Result<Vec<String>, String>, CallError> {
        self.call(
            async |pre, store| match pre {
                Pre::V0_1(_) => Ok(Ok(Vec::new())),
                Pre::V0_2(pre) => {
                    let instance = pre.instantiate_async(&mut *store).await?;
                    let guest = instance.capstan_plugin_reconciler();
                    guest.call_validate(&mut *store, old.as_deref(), &new).await
                }
            },
            refusal_outcome,
            None,
        )
        .await
    }

    async fn convert_call(
        self,
        object: String,
        to: String,
    ) -> Result<Result<String, String>, CallError> {
        let refused = self.no_conversion();
        self.call(
            async |pre, store| match pre {
                Pre::V0_1(_) => Ok(Err(refused)),
                Pre::V0_2(pre) => {
                    let instance = pre.instantiate_async(&mut *store).await?;
                    let guest = instance.capstan_plugin_reconciler();
                    guest.call_convert(&mut *store, &object, &to).await
                }
            },
            refusal_outcome,
            None,
        )
        .await
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
    async fn spawn<R, F>(&self, call: impl FnOnce(WasmPlugin) -> F) -> Result<R, CallError>
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
    fn blocking<R, F>(&self, call: impl FnOnce(WasmPlugin) -> F) -> Result<R, CallError>
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
        f: impl AsyncFnOnce(&Pre<CallState>, &mut Store<CallState>) -> wasmtime::Result<R>,
        outcome_of: impl Fn(&R) -> Outcome,
        pinned: Option<Pinned>,
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
        let mut store = Store::new(
            &sandbox.engine,
            CallState::new(
                name,
                limits.memory_limit,
                pinned,
                self.inner.log_rate.clone(),
            ),
        );
        store.limiter(|s| &mut s.limits);
        // Yield at the next epoch tick, then at every tick (a new store's deadline is
        // the epoch already passed: without this, every call yields at its first
        // check, which costs an async call its run on the caller's thread).
        store.set_epoch_deadline(1);
        store.epoch_deadline_async_yield_and_update(1);
        let started = Instant::now();
        // `f` instantiates the component and calls it: both within the deadline.
        let run = f(&self.inner.pre, &mut store);
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
        let mut output = store.data_mut().take_output();
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
fn answer_outcome<T>(answer: &Result<T, PluginError>) -> Outcome {
    match answer {
        Ok(_) => Outcome::Ok,
        Err(PluginError::Invalid(_)) => Outcome::Invalid,
        Err(PluginError::Retry(_)) => Outcome::Retry,
    }
}

/// The outcome of a `validate` or `convert` call: a refusal counts as invalid.
fn refusal_outcome<T>(answer: &Result<T, String>) -> Outcome {
    match answer {
        Ok(_) => Outcome::Ok,
        Err(_) => Outcome::Invalid,
    }
}

/// The observed state in the bindings of one release.
enum WitObserved {
    V0_1(super::bindings::v0_1::capstan::plugin::types::Observed),
    V0_2(super::bindings::v0_2::capstan::plugin::types::Observed),
}
