//! What the host holds of a plugin: a [`Plugin`], cheap to clone, whose exports are a
//! [`Guest`]. In production the guest is a sandboxed wasm component ([`WasmPlugin`],
//! loaded by a [`Sandbox`](super::Sandbox)); in tests it may be a [`Native`] plugin
//! written in Rust, so that the pipeline's rules run without building any wasm.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use futures::future::{BoxFuture, FutureExt};
use serde_json::Value;

use super::bindings::CONTRACT_VERSION;
use super::call::WasmPlugin;
use super::error::CallError;
use super::limits::LimitsFile;
use super::state::Pinned;
use crate::contract::{Desired, FinalizeResult, Observed, PluginError, PluginInfo, RelatedRequest};

/// A plugin's answer to one call: `Err` when it could not be called to the end
/// (deadline, memory cap, trap), else what it answered.
pub type Answer<T, E = PluginError> = Result<Result<T, E>, CallError>;

/// The exports of a plugin as the host calls them (the contract's `reconciler`).
pub trait Guest: Send + Sync + 'static {
    /// What the plugin declared (`describe`).
    fn info(&self) -> &PluginInfo;

    /// `customize`: which related objects `parent` needs.
    fn customize<'a>(
        &'a self,
        parent: &'a Value,
        pinned: Option<Pinned>,
    ) -> BoxFuture<'a, Answer<Vec<RelatedRequest>>>;

    /// `reconcile`: the desired state for `observed`.
    fn reconcile<'a>(
        &'a self,
        observed: &'a Observed,
        pinned: Option<Pinned>,
    ) -> BoxFuture<'a, Answer<Desired>>;

    /// `finalize`: the teardown of a parent being deleted.
    fn finalize<'a>(
        &'a self,
        observed: &'a Observed,
        pinned: Option<Pinned>,
    ) -> BoxFuture<'a, Answer<FinalizeResult>>;

    /// `validate`: the warnings of an allowed change from `old` to `new`, or why not.
    fn validate<'a>(
        &'a self,
        old: Option<&'a Value>,
        new: &'a Value,
    ) -> BoxFuture<'a, Answer<Vec<String>, String>>;

    /// `convert`: `object` as `to_version`, or why not.
    fn convert<'a>(
        &'a self,
        object: &'a Value,
        to_version: &'a str,
    ) -> BoxFuture<'a, Answer<String, String>>;
}

/// A plugin written in Rust and run in the host's own process, for tests: no sandbox,
/// no deadline, no memory cap, and no clock or random but its own. Only `describe`
/// and `reconcile` are required; the other exports default to what a plugin that
/// does not declare them answers.
pub trait Native: Send + Sync + 'static {
    /// What it declares.
    fn describe(&self) -> PluginInfo;

    /// The desired state for `observed`.
    fn reconcile(&self, observed: &Observed) -> Result<Desired, PluginError>;

    /// The related objects `parent` needs: none.
    fn customize(&self, _parent: &Value) -> Result<Vec<RelatedRequest>, PluginError> {
        Ok(Vec::new())
    }

    /// The teardown of a parent being deleted: done at once.
    fn finalize(&self, _observed: &Observed) -> Result<FinalizeResult, PluginError> {
        Ok(FinalizeResult {
            done: true,
            ..FinalizeResult::default()
        })
    }

    /// Whether a change is allowed: always, without warnings.
    fn validate(&self, _old: Option<&Value>, _new: &Value) -> Result<Vec<String>, String> {
        Ok(Vec::new())
    }

    /// A conversion: refused.
    fn convert(&self, _object: &Value, _to_version: &str) -> Result<String, String> {
        Err("this plugin does not convert between versions".into())
    }
}

/// A [`Native`] plugin with its declaration taken once.
struct NativeGuest<N> {
    info: PluginInfo,
    native: N,
}

impl<N: Native> Guest for NativeGuest<N> {
    fn info(&self) -> &PluginInfo {
        &self.info
    }

    fn customize<'a>(
        &'a self,
        parent: &'a Value,
        _pinned: Option<Pinned>,
    ) -> BoxFuture<'a, Answer<Vec<RelatedRequest>>> {
        futures::future::ready(Ok(self.native.customize(parent))).boxed()
    }

    fn reconcile<'a>(
        &'a self,
        observed: &'a Observed,
        _pinned: Option<Pinned>,
    ) -> BoxFuture<'a, Answer<Desired>> {
        futures::future::ready(Ok(self.native.reconcile(observed))).boxed()
    }

    fn finalize<'a>(
        &'a self,
        observed: &'a Observed,
        _pinned: Option<Pinned>,
    ) -> BoxFuture<'a, Answer<FinalizeResult>> {
        futures::future::ready(Ok(self.native.finalize(observed))).boxed()
    }

    fn validate<'a>(
        &'a self,
        old: Option<&'a Value>,
        new: &'a Value,
    ) -> BoxFuture<'a, Answer<Vec<String>, String>> {
        futures::future::ready(Ok(self.native.validate(old, new))).boxed()
    }

    fn convert<'a>(
        &'a self,
        object: &'a Value,
        to_version: &'a str,
    ) -> BoxFuture<'a, Answer<String, String>> {
        futures::future::ready(Ok(self.native.convert(object, to_version))).boxed()
    }
}

impl Guest for WasmPlugin {
    fn info(&self) -> &PluginInfo {
        WasmPlugin::info(self)
    }

    fn customize<'a>(
        &'a self,
        parent: &'a Value,
        pinned: Option<Pinned>,
    ) -> BoxFuture<'a, Answer<Vec<RelatedRequest>>> {
        self.customize_pinned(parent, pinned).boxed()
    }

    fn reconcile<'a>(
        &'a self,
        observed: &'a Observed,
        pinned: Option<Pinned>,
    ) -> BoxFuture<'a, Answer<Desired>> {
        self.reconcile_pinned(observed, pinned).boxed()
    }

    fn finalize<'a>(
        &'a self,
        observed: &'a Observed,
        pinned: Option<Pinned>,
    ) -> BoxFuture<'a, Answer<FinalizeResult>> {
        self.finalize_pinned(observed, pinned).boxed()
    }

    fn validate<'a>(
        &'a self,
        old: Option<&'a Value>,
        new: &'a Value,
    ) -> BoxFuture<'a, Answer<Vec<String>, String>> {
        self.validate_async(old, new).boxed()
    }

    fn convert<'a>(
        &'a self,
        object: &'a Value,
        to_version: &'a str,
    ) -> BoxFuture<'a, Answer<String, String>> {
        self.convert_async(object, to_version).boxed()
    }
}

/// A loaded, described plugin: its exports ([`Guest`]) and, for a wasm component, the
/// file, digest and limits it runs under. Cheap to clone.
#[derive(Clone)]
pub struct Plugin {
    guest: Arc<dyn Guest>,
    /// The component, when the guest is one (the blocking calls and what only a
    /// component has go to it directly).
    wasm: Option<WasmPlugin>,
    /// Whether its async calls are made as the blocking ones ([`Plugin::on_this_thread`]).
    on_this_thread: bool,
    /// A native plugin's limits file (a component keeps its own): only its grant
    /// applies, a native plugin runs without a sandbox's limits.
    native_limits: Arc<std::sync::RwLock<LimitsFile>>,
}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.wasm {
            Some(wasm) => wasm.fmt(f),
            None => f
                .debug_struct("NativePlugin")
                .field("name", &self.info().name)
                .finish(),
        }
    }
}

/// The deadline a native plugin reports (it runs without one).
const NATIVE_DEADLINE: Duration = Duration::from_secs(10);

impl Plugin {
    /// The plugin of a loaded component.
    pub(super) fn from_wasm(wasm: WasmPlugin) -> Self {
        Plugin {
            guest: Arc::new(wasm.clone()),
            wasm: Some(wasm),
            on_this_thread: false,
            native_limits: Arc::default(),
        }
    }

    /// A plugin whose exports are `native`, run in this process (tests).
    pub fn native(native: impl Native) -> Self {
        let info = native.describe();
        Plugin {
            guest: Arc::new(NativeGuest { info, native }),
            wasm: None,
            on_this_thread: false,
            native_limits: Arc::default(),
        }
    }

    /// The same plugin, its `customize`, `reconcile` and `finalize` made as the blocking
    /// calls are, whole on the calling thread, also when the async engine calls them:
    /// for a thread that runs no async code and drives the engine with
    /// [`crate::engine::blocking`] (the command line, `capstan test`). An async call
    /// would move to the sandbox's runtime after its first epoch tick, whose threads
    /// yield to the host's own work.
    pub fn on_this_thread(&self) -> Plugin {
        Plugin {
            on_this_thread: true,
            ..self.clone()
        }
    }

    /// The component, when calls are to be made on this thread.
    fn here(&self) -> Option<&WasmPlugin> {
        self.wasm.as_ref().filter(|_| self.on_this_thread)
    }

    /// What the plugin declared.
    pub fn info(&self) -> &PluginInfo {
        self.guest.info()
    }

    /// The file it was loaded from (a native plugin: `native`).
    pub fn path(&self) -> &Path {
        match &self.wasm {
            Some(wasm) => wasm.path(),
            None => Path::new("native"),
        }
    }

    /// sha256 of the component's bytes, hex (a native plugin: `native`).
    pub fn sha256(&self) -> &str {
        match &self.wasm {
            Some(wasm) => wasm.sha256(),
            None => "native",
        }
    }

    /// Sets the plugin's own limits over the sandbox's (a native plugin keeps the file,
    /// whose grant applies, and runs without limits).
    pub fn set_limits(&self, file: LimitsFile) {
        match &self.wasm {
            Some(wasm) => wasm.set_limits(file),
            None => {
                *self
                    .native_limits
                    .write()
                    .unwrap_or_else(|poisoned| poisoned.into_inner()) = file
            }
        }
    }

    /// What the plugin's limits file set (empty: the sandbox's limits throughout).
    pub fn limits_file(&self) -> LimitsFile {
        match &self.wasm {
            Some(wasm) => wasm.limits_file(),
            None => self
                .native_limits
                .read()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .clone(),
        }
    }

    /// The wall-clock limit of its calls, as they start now.
    pub fn deadline(&self) -> Duration {
        self.wasm
            .as_ref()
            .map_or(NATIVE_DEADLINE, WasmPlugin::deadline)
    }

    /// The contract release the plugin was built for (a native plugin: the current).
    pub fn contract(&self) -> &'static str {
        self.wasm
            .as_ref()
            .map_or(CONTRACT_VERSION, WasmPlugin::contract)
    }

    /// Calls `customize`: which related objects `parent` needs.
    pub async fn customize_async(&self, parent: &Value) -> Answer<Vec<RelatedRequest>> {
        self.guest.customize(parent, None).await
    }

    /// [`Plugin::customize_async`] with the call's clock and random `pinned`.
    pub async fn customize_pinned(
        &self,
        parent: &Value,
        pinned: Option<Pinned>,
    ) -> Answer<Vec<RelatedRequest>> {
        match self.here() {
            Some(wasm) => wasm.customize_blocking(parent, pinned),
            None => self.guest.customize(parent, pinned).await,
        }
    }

    /// [`Plugin::customize_async`] for a thread that runs no async code.
    pub fn customize_blocking(&self, parent: &Value) -> Answer<Vec<RelatedRequest>> {
        match &self.wasm {
            Some(wasm) => wasm.customize_blocking(parent, None),
            None => futures::executor::block_on(self.guest.customize(parent, None)),
        }
    }

    /// Calls `reconcile`.
    pub async fn reconcile_async(&self, observed: &Observed) -> Answer<Desired> {
        self.guest.reconcile(observed, None).await
    }

    /// [`Plugin::reconcile_async`] with the call's clock and random `pinned`.
    pub async fn reconcile_pinned(
        &self,
        observed: &Observed,
        pinned: Option<Pinned>,
    ) -> Answer<Desired> {
        match self.here() {
            Some(wasm) => wasm.reconcile_blocking(observed, pinned),
            None => self.guest.reconcile(observed, pinned).await,
        }
    }

    /// [`Plugin::reconcile_async`] for a thread that runs no async code (the command
    /// line, tests): blocks it until the call is done.
    pub fn reconcile_blocking(&self, observed: &Observed) -> Answer<Desired> {
        match &self.wasm {
            Some(wasm) => wasm.reconcile_blocking(observed, None),
            None => futures::executor::block_on(self.guest.reconcile(observed, None)),
        }
    }

    /// Calls `finalize`.
    pub async fn finalize_async(&self, observed: &Observed) -> Answer<FinalizeResult> {
        self.guest.finalize(observed, None).await
    }

    /// [`Plugin::finalize_async`] with the call's clock and random `pinned`.
    pub async fn finalize_pinned(
        &self,
        observed: &Observed,
        pinned: Option<Pinned>,
    ) -> Answer<FinalizeResult> {
        match self.here() {
            Some(wasm) => wasm.finalize_blocking(observed, pinned),
            None => self.guest.finalize(observed, pinned).await,
        }
    }

    /// [`Plugin::finalize_async`] for a thread that runs no async code.
    pub fn finalize_blocking(&self, observed: &Observed) -> Answer<FinalizeResult> {
        match &self.wasm {
            Some(wasm) => wasm.finalize_blocking(observed, None),
            None => futures::executor::block_on(self.guest.finalize(observed, None)),
        }
    }

    /// Calls `validate`: `Ok` with the warnings when the change from `old` (none: a
    /// create) to `new` is allowed, `Err` with the plugin's message when it is refused.
    pub async fn validate_async(
        &self,
        old: Option<&Value>,
        new: &Value,
    ) -> Answer<Vec<String>, String> {
        self.guest.validate(old, new).await
    }

    /// [`Plugin::validate_async`] for a thread that runs no async code.
    pub fn validate_blocking(
        &self,
        old: Option<&Value>,
        new: &Value,
    ) -> Answer<Vec<String>, String> {
        match &self.wasm {
            Some(wasm) => wasm.validate_blocking(old, new),
            None => futures::executor::block_on(self.guest.validate(old, new)),
        }
    }

    /// Calls `convert`: `object` as `to_version`, or the plugin's reason why not.
    pub async fn convert_async(&self, object: &Value, to_version: &str) -> Answer<String, String> {
        self.guest.convert(object, to_version).await
    }

    /// [`Plugin::convert_async`] for a thread that runs no async code.
    pub fn convert_blocking(&self, object: &Value, to_version: &str) -> Answer<String, String> {
        match &self.wasm {
            Some(wasm) => wasm.convert_blocking(object, to_version),
            None => futures::executor::block_on(self.guest.convert(object, to_version)),
        }
    }
}
