//! The live plugin directory: every `*.wasm` file in it is loaded and gets a controller;
//! files added, changed or removed while the host runs are picked up.
//!
//! The directory is watched (inotify, through `notify`) and also polled (default every
//! second): a change is seen within milliseconds where the watch works, and by the next
//! poll wherever it does not (a network file system, a watch that could not be set up,
//! events lost). Both lead to the same scan, which sees every kind of update, including
//! the symlink swaps of a Kubernetes ConfigMap or volume mount, and costs one `stat`
//! per file. A file is re-read only when its size or modification time changes, and
//! reloaded only when its sha256 does.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Client;
use kube::ResourceExt;
use kube::api::{Api, DynamicObject, ListParams, Patch, PatchParams};
use tracing::{error, info, warn};

use super::children::ChildCaches;
use super::cluster::ClusterWrites;
use super::controller::{ControllerOptions, RunningController};
use super::leader::WriteFence;
use super::metrics::{Metrics, PluginState};
use super::reconcile::FINALIZER;
use crate::plan::HOST_FIELD_MANAGER;
use crate::plugin::{Plugin, Sandbox, limits, sha256_hex};

/// Options of the registry.
#[derive(Debug, Clone)]
pub struct RegistryOptions {
    /// The plugin directory.
    pub dir: PathBuf,
    /// How often to look at it.
    pub poll_interval: Duration,
    /// Server-side apply each plugin's CRD before starting its controller.
    pub install_crds: bool,
    /// Options for every controller.
    pub controller: ControllerOptions,
}

/// The plugins the host serves, by file.
pub struct PluginRegistry {
    client: Client,
    sandbox: Sandbox,
    metrics: Arc<Metrics>,
    opts: RegistryOptions,
    files: BTreeMap<PathBuf, FileState>,
    /// The child caches, shared by every plugin's controller.
    caches: ChildCaches,
}

/// A file whose modification time is younger than this may still be being written: it
/// is loaded once it is this old, or once it kept its size and time for a poll interval.
const SETTLE: Duration = Duration::from_millis(500);
/// How soon the directory is scanned again while a file is settling or the caches are
/// not synced yet (when the poll interval is longer).
const RECHECK: Duration = Duration::from_millis(100);
/// How long a burst of directory events is collected before one scan.
const DEBOUNCE: Duration = Duration::from_millis(20);
/// Longest wait between two attempts to load a file refused for a temporary reason.
const MAX_RETRY: Duration = Duration::from_secs(60);

#[derive(Default)]
struct FileState {
    /// (size, mtime) when last read.
    stamp: Option<(u64, SystemTime)>,
    /// (size, mtime) seen by the last scan while the file was still young.
    settling: Option<(u64, SystemTime)>,
    /// A load refused for a reason that can go away (the kind claimed by another file,
    /// the CRD not installed yet): when to try the same bytes again, and how many
    /// attempts were made.
    retry: Option<(Instant, u32)>,
    /// sha256 of the bytes last tried.
    tried_sha: Option<String>,
    /// The version serving, with its controller.
    serving: Option<(Plugin, RunningController)>,
    /// Why the last load failed.
    error: Option<String>,
    /// (size, mtime) of the plugin's limits file when last read (inner `None`: none).
    limits_stamp: Option<Option<(u64, SystemTime)>>,
}

impl PluginRegistry {
    /// An empty registry; [`PluginRegistry::run`] fills it.
    pub fn new(
        client: Client,
        sandbox: Sandbox,
        metrics: Arc<Metrics>,
        opts: RegistryOptions,
    ) -> Self {
        PluginRegistry {
            caches: ChildCaches::new(
                client.clone(),
                opts.controller.namespace.clone(),
                opts.controller.shard,
                metrics.clone(),
            ),
            client,
            sandbox,
            metrics,
            opts,
            files: BTreeMap::new(),
        }
    }

    /// Scans the directory now and at every poll interval until `stop` fires, then
    /// stops every controller.
    pub async fn run_until(mut self, mut stop: tokio::sync::oneshot::Receiver<()>) {
        let (changed, mut changes) = tokio::sync::mpsc::unbounded_channel();
        // Kept alive for the loop; without it, polling alone finds every change.
        let _watch = watch_dir(&self.opts.dir, changed);
        loop {
            let settling = self.scan().await;
            // Ready once every file of the directory was loaded (or refused), none left
            // to settle, and the caches of every loaded plugin's children hold their
            // first list: before that, reconciles wait. Files just written (by an init
            // container seeding the directory) settle first: ready before they are
            // loaded, a rollout would go on to stop the previous Pod while this one
            // still serves nothing.
            let ready = !settling && self.caches.all_synced();
            if ready {
                self.metrics.set_ready();
            }
            let next = if settling || !ready {
                RECHECK.min(self.opts.poll_interval)
            } else {
                self.opts.poll_interval
            };
            tokio::select! {
                _ = tokio::time::sleep(next) => {}
                Some(()) = changes.recv() => {
                    tokio::time::sleep(DEBOUNCE).await;
                    while changes.try_recv().is_ok() {}
                }
                _ = &mut stop => break,
            }
        }
        self.shutdown().await;
    }

    /// Stops every controller.
    async fn shutdown(self) {
        for (_, state) in self.files {
            if let Some((_, controller)) = state.serving {
                controller.stop().await;
            }
        }
    }

    /// One pass over the directory. Returns whether a file was left to settle (it may
    /// still be being written, and is looked at again soon).
    pub async fn scan(&mut self) -> bool {
        for (path, state) in &self.files {
            if let Some((plugin, controller)) = &state.serving
                && controller.is_finished()
            {
                self.metrics.set_failed(
                    &format!("controller {}", plugin.info().name),
                    format!(
                        "the controller of {} ({}) stopped",
                        plugin.info().name,
                        path.display()
                    ),
                );
            }
        }
        let present = match wasm_files(&self.opts.dir) {
            Ok(files) => files,
            Err(e) => {
                warn!(dir = %self.opts.dir.display(), "cannot read the plugin directory: {e}");
                return false;
            }
        };
        let gone: Vec<PathBuf> = self
            .files
            .keys()
            .filter(|p| !present.contains_key(*p))
            .cloned()
            .collect();
        if !gone.is_empty() {
            // A removed file may have held the claim that refused another one.
            for state in self.files.values_mut() {
                if let Some((at, _)) = &mut state.retry {
                    *at = Instant::now();
                }
            }
        }
        for path in gone {
            if let Some(state) = self.files.remove(&path)
                && let Some((plugin, controller)) = state.serving
            {
                controller.stop().await;
                info!(file = %path.display(), plugin = %plugin.info().name, "plugin file removed: controller stopped, its resources left alone");
                if plugin.info().finalizer {
                    let client = self.client.clone();
                    let namespace = self.opts.controller.namespace.clone();
                    let fence = self.opts.controller.fence.clone();
                    tokio::spawn(async move {
                        if let Err(e) = release_finalizers(client, &plugin, namespace, fence).await
                        {
                            warn!(plugin = %plugin.info().name, "cannot release the finalizers of a removed plugin: {e}");
                        }
                    });
                }
            }
            self.metrics.remove_plugin(&path.display().to_string());
        }
        let mut settling = false;
        for (path, stamp) in present {
            self.refresh_limits(&path);
            let state = self.files.entry(path.clone()).or_default();
            if state.stamp == Some(stamp) {
                if state.retry.is_some_and(|(at, _)| at <= Instant::now()) {
                    self.consider(&path).await;
                }
                continue;
            }
            let young = stamp.1.elapsed().is_ok_and(|age| age < SETTLE);
            if young && state.settling != Some(stamp) {
                // Still being written, perhaps: look again at the next scan.
                state.settling = Some(stamp);
                settling = true;
                continue;
            }
            state.settling = None;
            state.stamp = Some(stamp);
            self.consider(&path).await;
        }
        settling
    }

    /// Loads a new or changed file and, if it is good, swaps it in.
    async fn consider(&mut self, path: &Path) {
        let bytes = match tokio::fs::read(path).await {
            Ok(b) => b,
            Err(e) => return self.failed(path, format!("cannot read {}: {e}", path.display())),
        };
        let sha = sha256_hex(&bytes);
        let state = self.files.get_mut(path).expect("state exists");
        let retry_due = state.retry.is_some_and(|(at, _)| at <= Instant::now());
        if state.tried_sha.as_deref() == Some(sha.as_str()) && !retry_due {
            return;
        }
        if state.tried_sha.as_deref() != Some(sha.as_str()) {
            state.retry = None;
        }
        state.tried_sha = Some(sha);
        let sandbox = self.sandbox.clone();
        let owned_path = path.to_path_buf();
        let loaded =
            tokio::task::spawn_blocking(move || sandbox.load_bytes_blocking(&bytes, &owned_path))
                .await;
        let plugin = match loaded {
            Ok(Ok(plugin)) => plugin,
            Ok(Err(e)) => return self.failed(path, e.to_string()),
            Err(e) => {
                return self.failed(
                    path,
                    format!("loading {} did not complete: {e}", path.display()),
                );
            }
        };
        if let Some(other) = self.claimant(&plugin, path) {
            return self.failed_for_now(
                path,
                format!(
                    "{} and {} both reconcile {}: keeping {}, refusing {}",
                    other.display(),
                    path.display(),
                    plugin.info().parent,
                    other.display(),
                    path.display()
                ),
            );
        }
        if self.opts.install_crds
            && let Err(e) = install_crd(&self.client, &plugin).await
        {
            return self.failed_for_now(
                path,
                format!("{}: cannot install the CRD: {e}", path.display()),
            );
        }
        let previous = self.files[path]
            .serving
            .as_ref()
            .map(|(p, _)| p.limits_file());
        let limits_error = self.apply_limits(path, &plugin, previous.unwrap_or_default());
        let state = self.files.get_mut(path).expect("state exists");
        if let Some((old, controller)) = state.serving.take() {
            controller.stop().await;
            info!(file = %path.display(), old = %old.sha256(), new = %plugin.sha256(), "plugin replaced");
        } else {
            info!(file = %path.display(), plugin = %plugin.info().name, kind = %plugin.info().parent, "plugin loaded");
        }
        let controller = RunningController::start(
            self.client.clone(),
            plugin.clone(),
            self.metrics.clone(),
            &self.caches,
            &self.opts.controller,
        );
        state.error = limits_error.clone();
        state.retry = None;
        self.metrics
            .set_plugin(PluginState::of(path, Some(&plugin), limits_error));
        state.serving = Some((plugin, controller));
    }

    /// Hands the serving version of `path` its limits file again when that file was
    /// added, changed or removed since it was last read.
    fn refresh_limits(&mut self, path: &Path) {
        let Some(state) = self.files.get_mut(path) else {
            return;
        };
        let stamp = file_stamp(&limits::file_of(path));
        if state.limits_stamp == Some(stamp) {
            return;
        }
        let Some((plugin, _)) = &state.serving else {
            return;
        };
        let plugin = plugin.clone();
        let error = self.apply_limits(path, &plugin, plugin.limits_file());
        let state = self.files.get_mut(path).expect("state exists");
        state.error = error.clone();
        self.metrics
            .set_plugin(PluginState::of(path, Some(&plugin), error));
    }

    /// Reads the limits file of `path` and sets it on `plugin`; a bad file is reported
    /// (the message is returned) and `plugin` gets `fallback`, the limits it had.
    fn apply_limits(
        &mut self,
        path: &Path,
        plugin: &Plugin,
        fallback: limits::LimitsFile,
    ) -> Option<String> {
        let file = limits::file_of(path);
        let stamp = file_stamp(&file);
        if let Some(state) = self.files.get_mut(path) {
            state.limits_stamp = Some(stamp);
        }
        match limits::read(path, self.sandbox.config()) {
            Ok(limits) => {
                let limits = limits.unwrap_or_default();
                if stamp.is_some() {
                    info!(file = %file.display(), plugin = %plugin.info().name, ?limits, "plugin limits set");
                }
                plugin.set_limits(limits);
                None
            }
            Err(e) => {
                let message = format!("limits not changed: {e}");
                error!(plugin = %plugin.info().name, "{message}");
                plugin.set_limits(fallback);
                Some(message)
            }
        }
    }

    /// Another file whose serving plugin reconciles the same parent kind. Claims are
    /// by group and kind, whatever the version: two plugins for `Foo/v1` and
    /// `Foo/v1beta1` would reconcile the very same objects and fight over them.
    fn claimant(&self, plugin: &Plugin, path: &Path) -> Option<PathBuf> {
        let kind = &plugin.info().parent;
        self.files.iter().find_map(|(p, s)| {
            let (other, _) = s.serving.as_ref()?;
            let theirs = &other.info().parent;
            (p != path && theirs.group == kind.group && theirs.kind == kind.kind).then(|| p.clone())
        })
    }

    /// Records a failed load whose reason may go away; the same bytes are tried again
    /// with exponential backoff (1 s, 2 s, 4 s … up to a minute).
    fn failed_for_now(&mut self, path: &Path, message: String) {
        self.failed(path, message);
        let state = self.files.get_mut(path).expect("state exists");
        let attempts = state.retry.map_or(0, |(_, n)| n) + 1;
        let wait = Duration::from_secs(1u64 << (attempts - 1).min(6)).min(MAX_RETRY);
        state.retry = Some((Instant::now() + wait, attempts));
    }

    /// Records a failed load; whatever version was serving keeps serving.
    fn failed(&mut self, path: &Path, message: String) {
        error!(file = %path.display(), "plugin not loaded: {message}");
        self.metrics.load_failed();
        let state = self.files.entry(path.to_path_buf()).or_default();
        state.error = Some(message.clone());
        let serving = state.serving.as_ref().map(|(p, _)| p);
        self.metrics
            .set_plugin(PluginState::of(path, serving, Some(message)));
    }
}

/// Watches `dir` for changes (inotify on Linux); each event sends `()` on `changed`.
/// None, with a warning, when the watch cannot be set up: polling still finds every
/// change, only later.
fn watch_dir(
    dir: &Path,
    changed: tokio::sync::mpsc::UnboundedSender<()>,
) -> Option<notify::RecommendedWatcher> {
    use notify::Watcher;
    let handler = move |event: notify::Result<notify::Event>| {
        if event.is_ok() {
            let _ = changed.send(());
        }
    };
    let watched = notify::recommended_watcher(handler).and_then(|mut w| {
        w.watch(dir, notify::RecursiveMode::NonRecursive)
            .map(|()| w)
    });
    match watched {
        Ok(w) => Some(w),
        Err(e) => {
            warn!(dir = %dir.display(), "cannot watch the plugin directory, polling only: {e}");
            None
        }
    }
}

/// (size, mtime) of `path`, following symlinks; `None` when it is not a file.
fn file_stamp(path: &Path) -> Option<(u64, SystemTime)> {
    let meta = std::fs::metadata(path).ok().filter(|m| m.is_file())?;
    Some((
        meta.len(),
        meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
    ))
}

/// `*.wasm` files in `dir` with their (size, mtime), sorted by name so that the first
/// file claiming a kind wins deterministically.
fn wasm_files(dir: &Path) -> std::io::Result<BTreeMap<PathBuf, (u64, SystemTime)>> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.extension().is_none_or(|e| e != "wasm") {
            continue;
        }
        // Follow symlinks: mounted volumes swap them.
        if let Ok(meta) = std::fs::metadata(&path)
            && meta.is_file()
        {
            let mtime = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
            out.insert(path, (meta.len(), mtime));
        }
    }
    Ok(out)
}

/// A removed plugin can no longer finalize anything, so the host's finalizer must not
/// outlive it: it is removed from every parent of the plugin's kind that is not being
/// deleted (loading the plugin again puts it back). Parents already being deleted keep
/// it, since their cleanup has not run: they get a Warning event saying how to let them
/// go (load the plugin again, or remove the finalizer by hand).
async fn release_finalizers(
    client: Client,
    plugin: &Plugin,
    namespace: Option<String>,
    fence: WriteFence,
) -> anyhow::Result<()> {
    let info = plugin.info();
    let ar = super::cluster::api_resource(&info.parent);
    let api: Api<DynamicObject> = match (&namespace, info.parent.namespaced) {
        (Some(ns), true) => Api::namespaced_with(client.clone(), ns, &ar),
        _ => Api::all_with(client.clone(), &ar),
    };
    let writes = ClusterWrites::new(client, &info.parent, &info.name, fence);
    let parents = api.list(&ListParams::default()).await?;
    let (mut released, mut pending) = (0, 0);
    for parent in parents.items {
        if !parent.finalizers().iter().any(|f| f == FINALIZER) {
            continue;
        }
        if parent.metadata.deletion_timestamp.is_some() {
            pending += 1;
            let message = format!(
                "plugin {} was removed before this object was finalized; it stays until the plugin is loaded again, or until {FINALIZER} is removed from metadata.finalizers by hand (its cleanup then never runs)",
                info.name
            );
            writes
                .publish(&parent, &crate::plan::warning("FinalizerPending", message))
                .await;
        } else {
            writes.remove_finalizer(&parent, FINALIZER).await?;
            released += 1;
        }
    }
    info!(plugin = %info.name, released, pending, "finalizers of a removed plugin released");
    Ok(())
}

/// Applies the plugin's CRD and waits until the API server serves it.
async fn install_crd(client: &Client, plugin: &Plugin) -> anyhow::Result<()> {
    let Some(crd) = &plugin.info().crd else {
        anyhow::bail!("plugin {} ships no CRD", plugin.info().name);
    };
    let crd: serde_json::Value = serde_json::from_str(crd)?;
    let name = crd
        .pointer("/metadata/name")
        .and_then(|v| v.as_str())
        .unwrap_or_default()
        .to_string();
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    api.patch(
        &name,
        &PatchParams::apply(HOST_FIELD_MANAGER).force(),
        &Patch::Apply(&crd),
    )
    .await?;
    let established = kube::runtime::wait::await_condition(
        api,
        &name,
        kube::runtime::wait::conditions::is_crd_established(),
    );
    tokio::time::timeout(Duration::from_secs(30), established)
        .await
        .map_err(|_| anyhow::anyhow!("CRD {name} not established after 30s"))??;
    info!(crd = %name, "CRD installed");
    Ok(())
}
