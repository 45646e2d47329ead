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

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tracing::{error, info, warn};

use super::controller::{Caches, ControllerOptions, RunningController};
use super::finalizers::{FinalizerRelease, kind_label};
use super::metrics::Report;
use super::metrics::{Metrics, PluginState};
use super::rollout::canary::{Canary, CanaryPolicy};
use super::rollout::slot::{self as shadow, ShadowSlot};
use super::source::{ListError, Listed, PluginSource, Stamp, file_stamp};
use super::webhook::Webhooks;
use crate::contract::KindRef;
use crate::plan::HOST_FIELD_MANAGER;
use crate::plugin::{LoadError, Plugin, Sandbox, limits, sha256_hex};

/// Why the registry could not load a plugin file, or read its directory.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The plugin directory could not be listed.
    #[error(transparent)]
    List(#[from] ListError),
    /// The file is not a plugin this host can load (not a component, another contract,
    /// does not compile or describe itself).
    #[error(transparent)]
    Load(#[from] LoadError),
    /// The blocking task that compiles the file did not complete (it panicked).
    #[error("loading {} did not complete: {source}", path.display())]
    LoadAborted {
        /// The file.
        path: PathBuf,
        /// Why the task ended.
        #[source]
        source: tokio::task::JoinError,
    },
    /// Another file's plugin already reconciles the same parent kind.
    #[error("{} and {} both reconcile {kind}: keeping {}, refusing {}", kept.display(), refused.display(), kept.display(), refused.display())]
    KindClaimed {
        /// The file that keeps the kind.
        kept: PathBuf,
        /// The file refused.
        refused: PathBuf,
        /// The kind.
        kind: String,
    },
    /// `--install-crds` is on and the plugin ships no CRD.
    #[error("plugin {plugin} ships no CRD")]
    NoCrd {
        /// The plugin.
        plugin: String,
    },
    /// The CRD the plugin ships is not JSON.
    #[error("the CRD of plugin {plugin} is not JSON: {source}")]
    CrdJson {
        /// The plugin.
        plugin: String,
        /// The parse error.
        #[source]
        source: serde_json::Error,
    },
    /// The API server refused or failed the CRD's apply.
    #[error("cannot apply CRD {name}: {source}")]
    CrdApply {
        /// The CRD's name.
        name: String,
        /// kube's error, with the status code when the server answered.
        #[source]
        source: kube::Error,
    },
    /// Waiting for the CRD to be established failed.
    #[error("cannot wait for CRD {name}: {source}")]
    CrdWait {
        /// The CRD's name.
        name: String,
        /// What went wrong.
        #[source]
        source: kube::runtime::wait::Error,
    },
    /// The CRD was applied but not established in time.
    #[error("CRD {name} not established after {timeout:?}")]
    CrdNotEstablished {
        /// The CRD's name.
        name: String,
        /// How long the host waited.
        timeout: Duration,
    },
}

/// Result of the registry's operations.
pub type Result<T, E = Error> = std::result::Result<T, E>;

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
    /// The releases of finalizers still to do, shared by the registries the process
    /// runs one after another (see [`PendingReleases`]).
    pub pending_releases: PendingReleases,
    /// The admission and conversion webhook that serves the plugins which validate or
    /// convert; none: such plugins are refused.
    pub webhooks: Option<Webhooks>,
    /// With `--canary`: a `NAME.next.wasm` serves a share of the parents on this
    /// schedule; none: it only shadows.
    pub canary: Option<CanaryPolicy>,
    /// Where plugins come from (files, OCI references) and the key they are verified
    /// with.
    pub source: PluginSource,
}

/// The parent kinds whose finalizers are still to be released (with the name of the
/// plugin that is gone), shared by the registries a process runs one after another:
/// with `--shards`, every change of buckets stops the registry and starts a new one,
/// which resumes these releases for its own buckets.
#[derive(Debug, Clone, Default)]
pub struct PendingReleases(Arc<std::sync::Mutex<BTreeMap<ClaimKey, (KindRef, String)>>>);

/// A kind claim: group and kind, whatever the version.
type ClaimKey = (String, String);

impl PendingReleases {
    fn insert(&self, kind: &KindRef, plugin: &str) {
        self.0
            .lock()
            .expect("pending releases lock")
            .insert(claim_key(kind), (kind.clone(), plugin.to_string()));
    }

    fn remove(&self, kind: &KindRef) {
        self.0
            .lock()
            .expect("pending releases lock")
            .remove(&claim_key(kind));
    }

    fn all(&self) -> Vec<(KindRef, String)> {
        let pending = self.0.lock().expect("pending releases lock");
        pending.values().cloned().collect()
    }
}

/// The plugins the host serves, by file.
pub struct PluginRegistry {
    client: Client,
    metrics: Arc<Metrics>,
    opts: RegistryOptions,
    files: BTreeMap<PathBuf, FileState>,
    /// The child and related caches, shared by every plugin's controller.
    caches: Caches,
    /// How many files compile at once: one per core (compiling is CPU bound).
    compiles: Arc<Semaphore>,
    /// Compiles a plugin file's bytes (the sandbox's, but for tests).
    load: Loader,
    /// The sandbox, whose configuration a plugin's limits file completes.
    sandbox: Sandbox,
    /// Releases of the finalizers of kinds no plugin serves any more, by group and kind.
    releases: HashMap<ClaimKey, JoinHandle<()>>,
    /// Shadow files (`NAME.next.wasm`, `NAME.next.oci`): stamp and sha256 when last
    /// read, and when (to resolve a reference again on the schedule).
    shadow_files: BTreeMap<PathBuf, (Stamp, String, Instant)>,
    /// The shadow of each serving file, shared with its controller.
    shadow_slots: BTreeMap<PathBuf, ShadowSlot>,
    /// References whose tag moved to a new digest under `--canary`: the new version is
    /// their slot's candidate (in any phase), and serves once promoted.
    staged: BTreeSet<PathBuf>,
}

/// Compiles, links and describes a plugin from its bytes; `path` names them.
type Loader = Arc<dyn Fn(&[u8], &Path) -> std::result::Result<Plugin, LoadError> + Send + Sync>;

/// The key of a kind claim: group and kind, whatever the version.
fn claim_key(kind: &KindRef) -> ClaimKey {
    (kind.group.clone(), kind.kind.clone())
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
    /// The stamp when last read.
    stamp: Option<Stamp>,
    /// The stamp seen by the last scan while the file was still young.
    settling: Option<Stamp>,
    /// When the plugin was last read (a reference is resolved again on the schedule).
    read_at: Option<Instant>,
    /// The message of the last failure to read or trust it (cleared by a read that
    /// works, even when its bytes are those already tried).
    read_error: Option<String>,
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
    /// An empty registry; [`PluginRegistry::run_until`] fills it.
    pub fn new(
        client: Client,
        sandbox: Sandbox,
        metrics: Arc<Metrics>,
        opts: RegistryOptions,
    ) -> Self {
        PluginRegistry {
            caches: Caches::new(
                client.clone(),
                opts.controller.namespace.clone(),
                opts.controller.shard,
                metrics.clone(),
            ),
            client,
            load: {
                let sandbox = sandbox.clone();
                Arc::new(move |bytes: &[u8], path: &Path| sandbox.load_bytes_blocking(bytes, path))
            },
            sandbox,
            metrics,
            opts,
            files: BTreeMap::new(),
            compiles: Arc::new(Semaphore::new(
                std::thread::available_parallelism().map_or(2, |n| n.get()),
            )),
            releases: HashMap::new(),
            shadow_files: BTreeMap::new(),
            shadow_slots: BTreeMap::new(),
            staged: BTreeSet::new(),
        }
    }

    /// The same registry, compiling with `load` instead of the sandbox.
    #[cfg(test)]
    fn with_loader(mut self, load: Loader) -> Self {
        self.load = load;
        self
    }

    /// Scans the directory now and at every poll interval until `stop` fires, then
    /// stops every controller.
    pub async fn run_until(mut self, mut stop: tokio::sync::oneshot::Receiver<()>) {
        let (changed, mut changes) = tokio::sync::mpsc::unbounded_channel();
        // Kept alive for the loop; without it, polling alone finds every change.
        let _watch = watch_dir(&self.opts.dir, changed);
        let mut first = true;
        loop {
            let settling = self.scan().await;
            if first {
                // The plugins of the directory are loaded (a kind served again is no
                // longer pending): resume what an earlier registry left undone.
                for (kind, plugin) in self.opts.pending_releases.all() {
                    if !self.releases.contains_key(&claim_key(&kind)) {
                        self.start_release(&kind, &plugin);
                    }
                }
                first = false;
            }
            // Ready once every file of the directory was loaded (or refused), none left
            // to settle, and the caches of every loaded plugin's children hold their
            // first list: before that, reconciles wait. Files just written (by an init
            // container seeding the directory) settle first: ready before they are
            // loaded, a rollout would go on to stop the previous Pod while this one
            // still serves nothing.
            let ready = !settling && self.caches.children.all_synced();
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

    /// Stops every controller, and the releases of finalizers still under way (they stay
    /// in [`PendingReleases`], for the next registry of this process to resume).
    async fn shutdown(self) {
        for (_, release) in self.releases {
            release.abort();
        }
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
        self.releases.retain(|_, release| !release.is_finished());
        let present = match list(self.opts.source.clone(), self.opts.dir.clone()).await {
            Ok(files) => files,
            Err(e) => {
                warn!("{e}");
                return false;
            }
        };
        let (shadows, present): (BTreeMap<_, _>, BTreeMap<_, _>) = present
            .into_iter()
            .partition(|(path, _)| shadow::shadowed_by(path).is_some());
        let shadows_settling = self.scan_shadows(shadows, &present).await;
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
                self.release_finalizers(&plugin);
                self.withdraw_webhook(&path).await;
            }
            self.metrics.remove_plugin(&path.display().to_string());
        }
        let mut settling = false;
        let mut due = Vec::new();
        for (path, Listed { stamp, limits }) in present {
            self.refresh_limits(&path, limits).await;
            let refresh = self.opts.source.refresh();
            let state = self.files.entry(path.clone()).or_default();
            if state.stamp == Some(stamp) {
                let retry = state.retry.is_some_and(|(at, _)| at <= Instant::now());
                // A reference is resolved again on the schedule (its tag may have moved).
                let resolve = PluginSource::is_remote(&path)
                    && state.read_at.is_none_or(|at| at.elapsed() >= refresh);
                if retry || resolve {
                    due.push(path);
                }
                continue;
            }
            let young = stamp.young(SETTLE);
            if young && state.settling != Some(stamp) {
                // Still being written, perhaps: look again at the next scan.
                state.settling = Some(stamp);
                settling = true;
                continue;
            }
            state.settling = None;
            state.stamp = Some(stamp);
            due.push(path);
        }
        self.load_all(due).await;
        self.promote_staged().await;
        settling || shadows_settling
    }

    /// Whether a new version of `path` is a candidate rather than a replacement: under
    /// `--canary`, a reference (its tag moved to a new digest) whose slot holds no
    /// `NAME.next.*` of its own.
    fn stages(&self, path: &Path, plugin: &Plugin) -> bool {
        self.opts.canary.is_some()
            && PluginSource::is_remote(path)
            && self.files.get(path).is_some_and(|state| {
                state
                    .serving
                    .as_ref()
                    .is_some_and(|(serving, _)| serving.sha256() != plugin.sha256())
            })
            && !self.shadow_files.keys().any(|shadow| {
                shadow::shadowed_by(shadow).is_some_and(|files| files.contains(&path.to_path_buf()))
            })
    }

    /// Whether `plugin` is the very version the reference `path` serves (its tag back
    /// on it after naming another).
    fn serves_already(&self, path: &Path, plugin: &Plugin) -> bool {
        PluginSource::is_remote(path)
            && self.files.get(path).is_some_and(|state| {
                state
                    .serving
                    .as_ref()
                    .is_some_and(|(serving, _)| serving.sha256() == plugin.sha256())
            })
    }

    /// The reference `path` names the version serving again: its candidate (if the tag
    /// had moved under `--canary`) goes, and so does the failure of any version it named
    /// in between; the controller runs on untouched.
    async fn back_on_serving(&mut self, path: &Path) {
        if self.staged.remove(path) {
            self.shadow_slot(path).set(None, None);
            self.metrics.remove_shadow(&path.display().to_string());
            info!(file = %path.display(), "the reference names the serving version again: its candidate is dropped");
        }
        let Some(plugin) = self.files[path].serving.as_ref().map(|(p, _)| p.clone()) else {
            return;
        };
        let error = self.apply_limits(path, &plugin, plugin.limits_file()).await;
        let state = self.files.get_mut(path).expect("state exists");
        state.retry = None;
        state.error = error.clone();
        self.metrics
            .set_plugin(PluginState::of(path, Some(&plugin), error));
    }

    /// Makes the new version of the reference `path` its canary candidate: it serves a
    /// share of the parents on the schedule, and the version serving stays until the
    /// candidate is promoted ([`PluginRegistry::promote_staged`]).
    async fn stage(&mut self, path: &Path, plugin: Plugin) {
        let policy = self
            .opts
            .canary
            .clone()
            .expect("staged only under --canary");
        if let Some(limits) = read_limits(path, self.sandbox.config()).await {
            plugin.set_limits(limits);
        }
        let label = format!("{} (new digest)", path.display());
        let canary = Arc::new(Canary::new(policy, &label, plugin.sha256()));
        info!(file = %path.display(), sha256 = %plugin.sha256(), "the reference names a new version: it is the candidate (--canary), and serves every parent once promoted");
        self.metrics.set_shadow(
            &path.display().to_string(),
            &label,
            plugin.sha256(),
            Some(canary.clone() as Arc<dyn Report>),
        );
        self.shadow_slot(path).set(Some(plugin), Some(canary));
        self.staged.insert(path.to_path_buf());
        if let Some(state) = self.files.get_mut(path) {
            state.retry = None;
        }
    }

    /// Serves each staged candidate that was promoted in place of its reference's old
    /// version. One rolled back stays in its slot (shown in `/plugins`, serving no
    /// parent) and its digest is not tried again until the tag moves on.
    async fn promote_staged(&mut self) {
        for path in self.staged.clone() {
            let slot = self.shadow_slot(&path);
            let Some((plugin, canary)) = slot.canary() else {
                self.staged.remove(&path);
                continue;
            };
            if !self.files.contains_key(&path) {
                slot.set(None, None);
                self.metrics.remove_shadow(&path.display().to_string());
                self.staged.remove(&path);
                continue;
            }
            if canary.report().phase == super::rollout::canary::Phase::Promoted {
                info!(file = %path.display(), sha256 = %plugin.sha256(), "the promoted candidate now serves the reference");
                slot.set(None, None);
                self.metrics.remove_shadow(&path.display().to_string());
                self.staged.remove(&path);
                self.serve(&path, plugin, &mut BTreeSet::new()).await;
            }
        }
    }

    /// The shadow of the serving file `file`, shared with its controller.
    fn shadow_slot(&mut self, file: &Path) -> ShadowSlot {
        self.shadow_slots
            .entry(file.to_path_buf())
            .or_insert_with(|| ShadowSlot::new(file))
            .clone()
    }

    /// Loads new or changed shadow files into the slots of the files they shadow, with
    /// the limits of those files, and empties the slots of removed ones. Returns whether
    /// a file is still settling. A shadow that does not load is logged and left out.
    async fn scan_shadows(
        &mut self,
        present: BTreeMap<PathBuf, Listed>,
        serving: &BTreeMap<PathBuf, Listed>,
    ) -> bool {
        // `NAME.next.*` shadows `NAME.wasm`, or `NAME.oci` when that is the one present.
        let file_of = |path: &Path| {
            shadow::shadowed_by(path).map(|[wasm, oci]| {
                if !serving.contains_key(&wasm) && serving.contains_key(&oci) {
                    oci
                } else {
                    wasm
                }
            })
        };
        let gone: Vec<PathBuf> = self
            .shadow_files
            .keys()
            .filter(|p| !present.contains_key(*p))
            .cloned()
            .collect();
        for path in gone {
            self.shadow_files.remove(&path);
            if let Some(file) = file_of(&path) {
                self.shadow_slot(&file).set(None, None);
                self.metrics.remove_shadow(&file.display().to_string());
                info!(shadow = %path.display(), "shadow version removed");
            }
        }
        let mut settling = false;
        let refresh = self.opts.source.refresh();
        for (path, Listed { stamp, .. }) in present {
            let known = self.shadow_files.get(&path).cloned();
            let resolve = PluginSource::is_remote(&path)
                && known
                    .as_ref()
                    .is_some_and(|(_, _, at)| at.elapsed() >= refresh);
            if known.as_ref().is_some_and(|(s, _, _)| *s == stamp) && !resolve {
                continue;
            }
            if stamp.young(SETTLE) {
                settling = true;
                continue;
            }
            let Some(file) = file_of(&path) else {
                continue;
            };
            let bytes = match self.opts.source.read(&path).await {
                Ok(bytes) => bytes,
                Err(e) => {
                    warn!(shadow = %path.display(), "cannot read the shadow version: {e}");
                    // Tried again on the schedule (a reference) or when it changes.
                    let sha = known.map(|(_, sha, _)| sha).unwrap_or_default();
                    self.shadow_files
                        .insert(path.clone(), (stamp, sha, Instant::now()));
                    continue;
                }
            };
            let sha = sha256_hex(&bytes);
            self.shadow_files
                .insert(path.clone(), (stamp, sha.clone(), Instant::now()));
            if known.is_some_and(|(_, s, _)| s == sha) {
                continue;
            }
            let (load, shadow_file) = (self.load.clone(), path.clone());
            let loaded = tokio::task::spawn_blocking(move || load(&bytes, &shadow_file)).await;
            let slot = self.shadow_slot(&file);
            self.staged.remove(&file);
            match loaded {
                Ok(Ok(plugin)) => {
                    if let Some(limits) = read_limits(&file, self.sandbox.config()).await {
                        plugin.set_limits(limits);
                    }
                    let canary = self.opts.canary.clone().map(|policy| {
                        Arc::new(Canary::new(
                            policy,
                            &path.display().to_string(),
                            plugin.sha256(),
                        ))
                    });
                    if canary.is_some() {
                        info!(candidate = %path.display(), file = %file.display(), sha256 = %plugin.sha256(), "candidate version loaded (--canary): serves a share of the parents that steps up on the schedule, shadows the others");
                    } else {
                        info!(shadow = %path.display(), file = %file.display(), sha256 = %plugin.sha256(), "shadow version loaded: called on every reconcile of the serving version, never applied");
                    }
                    self.metrics.set_shadow(
                        &file.display().to_string(),
                        &path.display().to_string(),
                        plugin.sha256(),
                        canary.clone().map(|c| c as Arc<dyn Report>),
                    );
                    slot.set(Some(plugin), canary);
                }
                Ok(Err(e)) => {
                    warn!(shadow = %path.display(), "shadow version not loaded: {e}");
                    slot.set(None, None);
                    self.metrics.remove_shadow(&file.display().to_string());
                }
                Err(e) => {
                    error!(shadow = %path.display(), "a shadow load task did not complete: {e}")
                }
            }
        }
        settling
    }

    /// Loads new or changed files, compiling them in parallel (one per core) and
    /// starting each as soon as it is ready: a slow compile (a Python plugin takes tens
    /// of seconds) delays no other plugin. Claims stay decided by file name: a file
    /// that finishes compiling after a later-named one of the same kind, started in
    /// this same pass, takes the kind from it.
    async fn load_all(&mut self, due: Vec<PathBuf>) {
        let mut compiling = FuturesUnordered::new();
        for path in due {
            if let Some(bytes) = self.read_if_new(&path).await {
                let (load, compiles) = (self.load.clone(), self.compiles.clone());
                let task = tokio::spawn(async move {
                    let _permit = compiles.acquire_owned().await;
                    let file = path.clone();
                    let loaded = tokio::task::spawn_blocking(move || load(&bytes, &file))
                        .await
                        .map_err(|source| Error::LoadAborted {
                            path: path.clone(),
                            source,
                        })
                        .and_then(|loaded| loaded.map_err(Error::from));
                    (path, loaded)
                });
                compiling.push(task);
            }
        }
        let mut started = BTreeSet::new();
        while let Some(done) = compiling.next().await {
            match done {
                Ok((path, Ok(plugin))) if self.stages(&path, &plugin) => {
                    self.stage(&path, plugin).await
                }
                Ok((path, Ok(plugin))) if self.serves_already(&path, &plugin) => {
                    self.back_on_serving(&path).await
                }
                Ok((path, Ok(plugin))) => self.serve(&path, plugin, &mut started).await,
                Ok((path, Err(e))) => self.failed(&path, e.to_string()),
                // Only a panic of the task itself, which holds no path.
                Err(e) => error!("a plugin load task did not complete: {e}"),
            }
        }
    }

    /// The bytes of `path` if they are worth loading: new bytes, or the same bytes
    /// whose retry is due.
    async fn read_if_new(&mut self, path: &Path) -> Option<Vec<u8>> {
        let read = self.opts.source.read(path).await;
        let state = self.files.get_mut(path).expect("state exists");
        state.read_at = Some(Instant::now());
        let bytes = match read {
            Ok(b) => b,
            Err(message) => {
                // Whatever version serves keeps serving (a registry down, a file being
                // replaced, a signature not there yet).
                state.read_error = Some(message.clone());
                self.failed(path, message);
                return None;
            }
        };
        if let Some(message) = state.read_error.take()
            && state.error.as_ref() == Some(&message)
        {
            // Readable again: what stood was only the read's failure.
            state.error = None;
            let serving = state.serving.as_ref().map(|(p, _)| p);
            self.metrics
                .set_plugin(PluginState::of(path, serving, None));
        }
        let sha = sha256_hex(&bytes);
        let state = self.files.get_mut(path).expect("state exists");
        let retry_due = state.retry.is_some_and(|(at, _)| at <= Instant::now());
        if state.tried_sha.as_deref() == Some(sha.as_str()) && !retry_due {
            return None;
        }
        if state.tried_sha.as_deref() != Some(sha.as_str()) {
            state.retry = None;
        }
        state.tried_sha = Some(sha);
        Some(bytes)
    }

    /// Swaps a plugin that loaded in for its file, if its kind is free (or held by a
    /// later-named file `started` in this pass) and its CRD installs.
    async fn serve(&mut self, path: &Path, plugin: Plugin, started: &mut BTreeSet<PathBuf>) {
        if let Some(other) = self.claimant(&plugin, path) {
            let claimed = |kept: &Path, refused: &Path| Error::KindClaimed {
                kept: kept.to_path_buf(),
                refused: refused.to_path_buf(),
                kind: plugin.info().parent.to_string(),
            };
            if !(started.contains(&other) && path < other.as_path()) {
                return self.failed_for_now(path, claimed(&other, path).to_string());
            }
            // The later-named file only won by compiling first.
            if let Some((_, controller)) = self
                .files
                .get_mut(&other)
                .and_then(|state| state.serving.take())
            {
                controller.stop().await;
                self.withdraw_webhook(&other).await;
            }
            started.remove(&other);
            self.failed_for_now(&other, claimed(path, &other).to_string());
        }
        // A plugin that converts: its CRD is created with the conversion webhook in
        // place, and never without one (its versions would be served unconverted).
        let conversion = match (&self.opts.webhooks, plugin.info().conversion) {
            (_, false) => None,
            (None, true) => {
                return self.failed_for_now(path, no_webhook_to_convert(path, &plugin));
            }
            (Some(webhooks), true) => match webhooks.conversion_for(&plugin).await {
                Ok(conversion) => Some(conversion),
                Err(e) => {
                    return self.failed_for_now(
                        path,
                        format!(
                            "{}: cannot serve its conversion webhook: {e}",
                            path.display()
                        ),
                    );
                }
            },
        };
        if self.opts.install_crds
            && let Err(e) = install_crd(&self.client, &plugin, conversion).await
        {
            return self.failed_for_now(
                path,
                format!("{}: cannot install the CRD: {e}", path.display()),
            );
        }
        if let Err(e) = self.announce_webhook(path, &plugin).await {
            return self.failed_for_now(path, e);
        }
        let previous = self.files[path]
            .serving
            .as_ref()
            .map(|(p, _)| p.limits_file());
        let limits_error = self
            .apply_limits(path, &plugin, previous.unwrap_or_default())
            .await;
        self.cancel_release(&plugin.info().parent);
        let state = self.files.get_mut(path).expect("state exists");
        let replaced = state.serving.take();
        if let Some((old, controller)) = replaced {
            controller.stop().await;
            info!(file = %path.display(), old = %old.sha256(), new = %plugin.sha256(), "plugin replaced");
            if claim_key(&old.info().parent) != claim_key(&plugin.info().parent) {
                // The old kind lost its plugin as surely as if the file were removed.
                info!(file = %path.display(), old = %old.info().parent, new = %plugin.info().parent, "the new version reconciles another kind");
                self.release_finalizers(&old);
            }
        } else {
            info!(file = %path.display(), plugin = %plugin.info().name, kind = %plugin.info().parent, "plugin loaded");
        }
        let shadow = self.shadow_slot(path);
        let controller = RunningController::start(
            self.client.clone(),
            plugin.clone(),
            self.metrics.clone(),
            &self.caches,
            &self.opts.controller,
            shadow,
        );
        let state = self.files.get_mut(path).expect("state exists");
        state.error = limits_error.clone();
        state.retry = None;
        self.metrics
            .set_plugin(PluginState::of(path, Some(&plugin), limits_error));
        state.serving = Some((plugin, controller));
        started.insert(path.to_path_buf());
    }

    /// Hands `plugin` to the webhook, which serves its `validate` and `convert` (if it
    /// declares them) and tells the API server; the message when that failed. Before the
    /// limits file is read: the webhook's timeout follows the deadline and is told
    /// again when the file changes ([`PluginRegistry::refresh_limits`]).
    ///
    /// Without a webhook, a plugin that converts is refused: the API server would store
    /// and serve its versions unconverted, pruning what one version has no field for. A
    /// plugin that only validates is served, as a controller-runtime manager runs its
    /// controllers without its webhook server: admission is the early answer, and
    /// reconcile refuses the same changes once they are stored (docs/admission.md).
    async fn announce_webhook(&self, path: &Path, plugin: &Plugin) -> Result<(), String> {
        match &self.opts.webhooks {
            Some(webhooks) => webhooks.update(path, Some(plugin)).await.map_err(|e| {
                format!(
                    "{}: cannot serve its admission webhook: {e}",
                    path.display()
                )
            }),
            None if plugin.info().conversion => Err(no_webhook_to_convert(path, plugin)),
            None => {
                if plugin.info().validation.is_some() {
                    warn!(file = %path.display(), plugin = %plugin.info().name, "the plugin validates, and this host serves no webhook (--webhook-addr): changes are not checked at admission, only refused by reconcile once stored");
                }
                Ok(())
            }
        }
    }

    /// Takes the plugin of `path`, which serves no more, from the webhook.
    async fn withdraw_webhook(&self, path: &Path) {
        if let Some(webhooks) = &self.opts.webhooks
            && let Err(e) = webhooks.update(path, None).await
        {
            warn!(file = %path.display(), "the webhook still names a plugin that is gone (told again later): {e}");
        }
    }

    /// Starts releasing the finalizers of `plugin`'s parent kind, which no plugin serves
    /// any more (if it asked for them).
    fn release_finalizers(&mut self, plugin: &Plugin) {
        let info = plugin.info();
        if info.finalizer {
            self.start_release(&info.parent, &info.name);
        }
    }

    /// Starts releasing the finalizers of `kind`, whose plugin `plugin` is gone; it stays
    /// pending until done, or until a plugin serves the kind again.
    fn start_release(&mut self, kind: &KindRef, plugin: &str) {
        let release = FinalizerRelease::new(
            self.client.clone(),
            kind,
            plugin,
            &self.opts.controller.release_scope(),
            self.metrics.clone(),
        );
        let pending = self.opts.pending_releases.clone();
        pending.insert(kind, plugin);
        let done = kind.clone();
        let task = tokio::spawn(async move {
            release.run().await;
            pending.remove(&done);
        });
        if let Some(previous) = self.releases.insert(claim_key(kind), task) {
            previous.abort();
        }
    }

    /// Stops releasing the finalizers of `kind`: a plugin serves it again.
    fn cancel_release(&mut self, kind: &KindRef) {
        self.opts.pending_releases.remove(kind);
        if let Some(release) = self.releases.remove(&claim_key(kind)) {
            release.abort();
            info!(%kind, "a plugin serves the kind again: its finalizers are no longer released");
        }
        self.metrics.clear_orphaned_finalizers(&kind_label(kind));
    }

    /// Hands the serving version of `path` its limits file again when that file was
    /// added, changed or removed since it was last read.
    async fn refresh_limits(&mut self, path: &Path, stamp: Option<(u64, SystemTime)>) {
        let Some(state) = self.files.get_mut(path) else {
            return;
        };
        if state.limits_stamp == Some(stamp) {
            return;
        }
        let Some((plugin, _)) = &state.serving else {
            return;
        };
        let plugin = plugin.clone();
        let error = self.apply_limits(path, &plugin, plugin.limits_file()).await;
        // The deadline may have changed, and the webhook's timeout with it.
        if let Some(webhooks) = &self.opts.webhooks
            && let Err(e) = webhooks.update(path, Some(&plugin)).await
        {
            warn!(file = %path.display(), "cannot tell the API server the webhook's new timeout: {e}");
        }
        let state = self.files.get_mut(path).expect("state exists");
        state.error = error.clone();
        self.metrics
            .set_plugin(PluginState::of(path, Some(&plugin), error));
    }

    /// Reads the limits file of `path` and sets it on `plugin`; a bad file is reported
    /// (the message is returned) and `plugin` gets `fallback`, the limits it had.
    async fn apply_limits(
        &mut self,
        path: &Path,
        plugin: &Plugin,
        fallback: limits::LimitsFile,
    ) -> Option<String> {
        let file = limits::file_of(path);
        // Read on a blocking thread, like the directory: a slow volume must not hold a
        // runtime worker.
        let (wasm, config) = (path.to_path_buf(), self.sandbox.config().clone());
        let read = tokio::task::spawn_blocking(move || {
            let stamp = file_stamp(&limits::file_of(&wasm));
            (stamp, limits::read(&wasm, &config))
        })
        .await;
        let (stamp, read) = match read {
            Ok(done) => done,
            Err(e) => {
                return Some(format!(
                    "limits not changed: reading them did not complete: {e}"
                ));
            }
        };
        if let Some(state) = self.files.get_mut(path) {
            state.limits_stamp = Some(stamp);
        }
        match read {
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
        let wait = super::retry::nth(attempts, Duration::from_secs(1), MAX_RETRY);
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

/// The plugin entries of `dir` and the `--plugin` references, sorted by name so that
/// the first claiming a kind wins deterministically. The directory is read on a
/// blocking thread: a slow volume must not hold a runtime worker.
/// The limits file of the plugin `path`, if there is a valid one, read on a blocking
/// thread (a slow volume must not hold a runtime worker). A bad one is reported when
/// the serving version's limits are applied ([`PluginRegistry::apply_limits`]).
async fn read_limits(
    path: &Path,
    config: &crate::plugin::SandboxConfig,
) -> Option<limits::LimitsFile> {
    let (path, config) = (path.to_path_buf(), config.clone());
    tokio::task::spawn_blocking(move || limits::read(&path, &config))
        .await
        .ok()?
        .ok()
        .flatten()
}

async fn list(source: PluginSource, dir: PathBuf) -> Result<BTreeMap<PathBuf, Listed>> {
    Ok(source.list(&dir).await?)
}

/// Why a plugin that converts is not served by a host without a webhook.
fn no_webhook_to_convert(path: &Path, plugin: &Plugin) -> String {
    format!(
        "{}: plugin {} converts between versions of {}, and this host serves no webhook \
         (--webhook-addr): its CRD's other versions would be served unconverted",
        path.display(),
        plugin.info().name,
        plugin.info().parent
    )
}

/// How long the host waits for an installed CRD to be served.
const CRD_ESTABLISHED: Duration = Duration::from_secs(30);

/// Applies the plugin's CRD and waits until the API server serves it. A CRD that does
/// not exist yet is created with `conversion` (the webhook's, for a plugin that
/// converts); one that exists keeps the conversion the webhook keeps up to date, whatever
/// the shipped manifest says.
async fn install_crd(
    client: &Client,
    plugin: &Plugin,
    conversion: Option<serde_json::Value>,
) -> Result<()> {
    let info = plugin.info();
    let Some(crd) = &info.crd else {
        return Err(Error::NoCrd {
            plugin: info.name.clone(),
        });
    };
    let mut crd: serde_json::Value =
        serde_json::from_str(crd).map_err(|source| Error::CrdJson {
            plugin: info.name.clone(),
            source,
        })?;
    let name = crd
        .pointer("/metadata/name")
        .and_then(|v| v.as_str())
        .unwrap_or_default()
        .to_string();
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    if let Some(conversion) = conversion {
        let exists = api.get_opt(&name).await.map_err(|source| Error::CrdApply {
            name: name.clone(),
            source,
        })?;
        match (exists, crd["spec"].as_object_mut()) {
            (None, _) => crd["spec"]["conversion"] = conversion,
            // The webhook's (its URL or Service and CA), not the shipped manifest's.
            (Some(_), Some(spec)) => drop(spec.remove("conversion")),
            (Some(_), None) => {}
        }
    }
    api.patch(
        &name,
        &PatchParams::apply(HOST_FIELD_MANAGER).force(),
        &Patch::Apply(&crd),
    )
    .await
    .map_err(|source| Error::CrdApply {
        name: name.clone(),
        source,
    })?;
    let established = kube::runtime::wait::await_condition(
        api,
        &name,
        kube::runtime::wait::conditions::is_crd_established(),
    );
    match tokio::time::timeout(CRD_ESTABLISHED, established).await {
        Ok(Ok(_)) => {}
        Ok(Err(source)) => return Err(Error::CrdWait { name, source }),
        Err(_) => {
            return Err(Error::CrdNotEstablished {
                name,
                timeout: CRD_ESTABLISHED,
            });
        }
    }
    info!(crd = %name, "CRD installed");
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::super::fake_api;
    use super::super::finalizers::ForceRelease;
    use super::super::leader::WriteFence;
    use super::*;
    use crate::plugin::SandboxConfig;
    use serde_json::json;

    /// A registry of `dir` against an API server that knows nothing (the controllers'
    /// watches fail and retry; nothing here needs them).
    fn registry(dir: &Path, metrics: Arc<Metrics>, sandbox: Sandbox) -> PluginRegistry {
        let (client, _) = fake_api::client(|_| fake_api::status(404, "NotFound", "none"));
        PluginRegistry::new(
            client,
            sandbox,
            metrics,
            RegistryOptions {
                dir: dir.to_path_buf(),
                poll_interval: Duration::from_secs(1),
                install_crds: false,
                controller: ControllerOptions {
                    namespace: Some("ns".into()),
                    default_resync: Duration::from_secs(300),
                    concurrency: 1,
                    fence: WriteFence::default(),
                    shard: None,
                    force_release: ForceRelease::default(),
                    instance: None,
                },
                pending_releases: PendingReleases::default(),
                webhooks: None,
                canary: None,
                source: PluginSource::files_only(),
            },
        )
    }

    /// Copies `plugin` into `dir` as `name`, old enough to load at the first scan.
    fn install(dir: &Path, name: &str, plugin: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::copy(capstan_e2e::operator::test_plugin(plugin), &path).unwrap();
        let old = SystemTime::now() - Duration::from_secs(60);
        std::fs::File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_modified(old)
            .unwrap();
        path
    }

    /// Whether `file` serves, and its last error, as `/plugins` says.
    fn state(metrics: &Metrics, file: &Path) -> (bool, Option<String>) {
        let plugins: serde_json::Value = serde_json::from_str(&metrics.plugins_json()).unwrap();
        plugins
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["file"] == file.display().to_string())
            .map_or((false, None), |p| {
                (p["serving"] == true, p["error"].as_str().map(String::from))
            })
    }

    /// A loader that compiles `slow` only once `first` serves (or gives up after a
    /// minute: then `waited` stays false), and every other file at once.
    fn held_back(
        sandbox: Sandbox,
        metrics: Arc<Metrics>,
        slow: PathBuf,
        first: PathBuf,
        waited: Arc<AtomicBool>,
    ) -> Loader {
        Arc::new(move |bytes: &[u8], path: &Path| {
            if path == slow {
                let until = Instant::now() + Duration::from_secs(60);
                while Instant::now() < until {
                    if state(&metrics, &first).0 {
                        waited.store(true, Ordering::SeqCst);
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
            sandbox.load_bytes_blocking(bytes, path)
        })
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_slow_compile_does_not_hold_back_another_plugin() {
        let dir = tempfile::tempdir().unwrap();
        let slow = install(dir.path(), "a-slow.wasm", "guard");
        let fast = install(dir.path(), "b-fast.wasm", "widget");
        let sandbox = Sandbox::new(SandboxConfig::default()).unwrap();
        let metrics = Arc::new(Metrics::default());
        let waited = Arc::new(AtomicBool::new(false));
        let load = held_back(
            sandbox.clone(),
            metrics.clone(),
            slow.clone(),
            fast.clone(),
            waited.clone(),
        );
        let mut registry = registry(dir.path(), metrics.clone(), sandbox).with_loader(load);
        registry.scan().await;
        assert!(
            waited.load(Ordering::SeqCst),
            "b-fast served while a-slow was still compiling"
        );
        assert_eq!(state(&metrics, &slow), (true, None));
        assert_eq!(state(&metrics, &fast), (true, None));
        registry.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_next_file_is_the_shadow_of_its_namesake_not_a_second_claimant() {
        let dir = tempfile::tempdir().unwrap();
        let serving = install(dir.path(), "widget.wasm", "widget");
        let next = install(dir.path(), "widget.next.wasm", "widget");
        let sandbox = Sandbox::new(SandboxConfig::default()).unwrap();
        let metrics = Arc::new(Metrics::default());
        let mut registry = registry(dir.path(), metrics.clone(), sandbox);
        registry.scan().await;
        assert_eq!(state(&metrics, &serving), (true, None));
        let plugins: serde_json::Value = serde_json::from_str(&metrics.plugins_json()).unwrap();
        assert_eq!(
            plugins.as_array().unwrap().len(),
            1,
            "the shadow is no plugin file of its own: {plugins}"
        );
        assert_eq!(
            plugins[0]["shadow"]["file"],
            next.display().to_string(),
            "{plugins}"
        );
        let slot = registry.shadow_slot(&serving);
        assert!(slot.get().is_some(), "its controller calls it");
        // Removed: the slot empties and /plugins no longer lists it.
        std::fs::remove_file(&next).unwrap();
        registry.scan().await;
        assert!(slot.get().is_none());
        let plugins: serde_json::Value = serde_json::from_str(&metrics.plugins_json()).unwrap();
        assert!(plugins[0].get("shadow").is_none(), "{plugins}");
        registry.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn with_canary_a_next_file_is_a_candidate_and_a_new_one_starts_afresh() {
        let dir = tempfile::tempdir().unwrap();
        let serving = install(dir.path(), "widget.wasm", "widget");
        let next = install(dir.path(), "widget.next.wasm", "widget-broken");
        let sandbox = Sandbox::new(SandboxConfig::default()).unwrap();
        let metrics = Arc::new(Metrics::default());
        let mut registry = registry(dir.path(), metrics.clone(), sandbox);
        let policy = CanaryPolicy::new(vec![10, 100], Duration::from_secs(60), 5.0, 1).unwrap();
        registry.opts.canary = Some(policy);
        registry.scan().await;
        let slot = registry.shadow_slot(&serving);
        let (_, canary) = slot.canary().expect("a candidate, with its canary");
        assert_eq!(canary.percent(), 10);
        let plugins: serde_json::Value = serde_json::from_str(&metrics.plugins_json()).unwrap();
        assert_eq!(plugins[0]["canary"]["phase"], "stepping", "{plugins}");
        assert_eq!(plugins[0]["canary"]["file"], next.display().to_string());
        // Rolled back; a new file is a new candidate, from its first step.
        canary.record(
            super::super::rollout::canary::Version::Candidate,
            "u",
            Some("x"),
        );
        assert_eq!(canary.percent(), 0);
        install(dir.path(), "widget.next.wasm", "widget");
        registry.scan().await;
        let (_, fresh) = slot.canary().unwrap();
        assert_ne!(fresh.sha256(), canary.sha256());
        assert_eq!(fresh.percent(), 10);
        // Removed: no candidate, nothing in /plugins.
        std::fs::remove_file(&next).unwrap();
        registry.scan().await;
        assert!(slot.canary().is_none());
        let plugins: serde_json::Value = serde_json::from_str(&metrics.plugins_json()).unwrap();
        assert!(plugins[0].get("canary").is_none(), "{plugins}");
        registry.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_first_file_by_name_wins_a_kind_even_when_it_compiles_last() {
        let dir = tempfile::tempdir().unwrap();
        let first = install(dir.path(), "a-widget.wasm", "widget");
        let second = install(dir.path(), "b-widget.wasm", "widget");
        let sandbox = Sandbox::new(SandboxConfig::default()).unwrap();
        let metrics = Arc::new(Metrics::default());
        let waited = Arc::new(AtomicBool::new(false));
        let load = held_back(
            sandbox.clone(),
            metrics.clone(),
            first.clone(),
            second.clone(),
            waited.clone(),
        );
        let mut registry = registry(dir.path(), metrics.clone(), sandbox).with_loader(load);
        registry.scan().await;
        assert!(waited.load(Ordering::SeqCst), "b-widget was serving first");
        assert_eq!(state(&metrics, &first), (true, None));
        let (serving, error) = state(&metrics, &second);
        assert!(!serving, "the later file gives the kind up");
        assert!(
            error.is_some_and(|e| e.contains("keeping") && e.contains("a-widget.wasm, refusing")),
            "and says why"
        );
        registry.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_new_version_of_another_kind_releases_the_finalizers_of_the_old_kind() {
        let guard = json!({
            "apiVersion": "test.capstan.dev/v1", "kind": "Guard",
            "metadata": {"name": "g", "namespace": "ns", "uid": "uid-g", "resourceVersion": "2",
                         "finalizers": [super::super::finalizers::FINALIZER]},
        });
        let (client, calls) = fake_api::client(move |call: &fake_api::Call| {
            match (&call.method, call.path.as_str()) {
                (&http::Method::GET, "/apis/test.capstan.dev/v1/namespaces/ns/guards") => (
                    200,
                    json!({"apiVersion": "test.capstan.dev/v1", "kind": "GuardList",
                           "metadata": {"resourceVersion": "2"}, "items": [guard.clone()]}),
                ),
                (&http::Method::PATCH, "/apis/test.capstan.dev/v1/namespaces/ns/guards/g") => {
                    let mut written = guard.clone();
                    written["metadata"]["finalizers"] = call.body["metadata"]["finalizers"].clone();
                    (200, written)
                }
                _ => fake_api::status(404, "NotFound", "none"),
            }
        });
        let dir = tempfile::tempdir().unwrap();
        let file = install(dir.path(), "p.wasm", "guard");
        let sandbox = Sandbox::new(SandboxConfig::default()).unwrap();
        let metrics = Arc::new(Metrics::default());
        let mut registry = registry(dir.path(), metrics.clone(), sandbox);
        registry.client = client;
        registry.scan().await;
        assert_eq!(state(&metrics, &file), (true, None));
        // The same file, now the widget plugin: it reconciles Widgets, no Guard any more.
        std::fs::remove_file(&file).unwrap();
        install(dir.path(), "p.wasm", "widget");
        registry.scan().await;
        let released = |calls: &fake_api::Calls| {
            calls.all().iter().any(|c| {
                c.method == http::Method::PATCH
                    && c.path.ends_with("/guards/g")
                    && c.body["metadata"]["finalizers"] == json!([])
            })
        };
        let until = Instant::now() + Duration::from_secs(30);
        while !(released(&calls)
            && metrics.orphaned_finalizers("Guard.test.capstan.dev") == Some(0))
            && Instant::now() < until
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(released(&calls), "the Guard's finalizer is released");
        assert_eq!(
            metrics.orphaned_finalizers("Guard.test.capstan.dev"),
            Some(0)
        );
        registry.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_new_registry_resumes_the_releases_an_earlier_one_left_undone() {
        let guard = json!({
            "apiVersion": "test.capstan.dev/v1", "kind": "Guard",
            "metadata": {"name": "g", "namespace": "ns", "uid": "uid-g", "resourceVersion": "2",
                         "finalizers": [super::super::finalizers::FINALIZER]},
        });
        let (client, calls) = fake_api::client(move |call: &fake_api::Call| {
            match (&call.method, call.path.as_str()) {
                (&http::Method::GET, "/apis/test.capstan.dev/v1/namespaces/ns/guards") => (
                    200,
                    json!({"apiVersion": "test.capstan.dev/v1", "kind": "GuardList",
                           "metadata": {"resourceVersion": "2"}, "items": [guard.clone()]}),
                ),
                (&http::Method::PATCH, "/apis/test.capstan.dev/v1/namespaces/ns/guards/g") => {
                    let mut written = guard.clone();
                    written["metadata"]["finalizers"] = call.body["metadata"]["finalizers"].clone();
                    (200, written)
                }
                _ => fake_api::status(404, "NotFound", "none"),
            }
        });
        let dir = tempfile::tempdir().unwrap();
        let sandbox = Sandbox::new(SandboxConfig::default()).unwrap();
        let metrics = Arc::new(Metrics::default());
        let mut registry = registry(dir.path(), metrics.clone(), sandbox);
        registry.client = client;
        // What a registry stopped for a change of buckets left undone.
        let guard_kind = KindRef {
            group: "test.capstan.dev".into(),
            version: "v1".into(),
            kind: "Guard".into(),
            plural: "guards".into(),
            namespaced: true,
        };
        let pending = registry.opts.pending_releases.clone();
        pending.insert(&guard_kind, "guard");
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let running = tokio::spawn(registry.run_until(stopped));
        let until = Instant::now() + Duration::from_secs(30);
        while !pending.all().is_empty() && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let _ = stop.send(());
        running.await.unwrap();
        assert!(pending.all().is_empty(), "the release was resumed and done");
        assert!(
            calls.all().iter().any(|c| c.method == http::Method::PATCH
                && c.body["metadata"]["finalizers"] == json!([])),
            "the Guard's finalizer is released"
        );
    }
}
