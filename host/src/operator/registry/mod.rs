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

mod claims;
mod crd;
mod limits;
mod notice;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use kube::Client;
use tokio::sync::Semaphore;
use tracing::{error, info, warn};

use super::controller::{Caches, ControllerOptions, RunningController};
use super::metrics::{Metrics, PluginState};
use super::rollout::canary::CanaryPolicy;
use super::rollout::slot as shadow;
use super::rollout::staging::Staging;
use super::source::{ListError, Listed, Loader, PluginSource, SETTLE, Stamp};
use super::webhook::Webhooks;
use crate::plugin::{LoadError, Plugin, Sandbox, sha256_hex};
pub use claims::PendingReleases;
use claims::{Releases, claim_key, claimant};
pub use crd::CrdError;

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
    /// `--install-crds` is on and the plugin's CRD could not be installed.
    #[error(transparent)]
    Crd(#[from] CrdError),
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
    /// Releases of the finalizers of kinds no plugin serves any more.
    releases: Releases,
    /// The next versions of the serving files (shadows, canary candidates).
    staging: Staging,
    /// The tasks telling the parents of a refused plugin's kind why, by file.
    notices: BTreeMap<PathBuf, tokio::task::JoinHandle<()>>,
}

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
        let load: Loader = {
            let sandbox = sandbox.clone();
            Arc::new(move |bytes: &[u8], path: &Path| sandbox.load_bytes_blocking(bytes, path))
        };
        PluginRegistry {
            caches: Caches::new(
                client.clone(),
                opts.controller.namespace.clone(),
                opts.controller.shard,
                metrics.clone(),
                opts.controller.identities.clone(),
            ),
            releases: Releases::new(
                client.clone(),
                opts.controller.release_scope(),
                metrics.clone(),
                opts.pending_releases.clone(),
            ),
            notices: BTreeMap::new(),
            staging: Staging::new(
                opts.canary.clone(),
                opts.source.clone(),
                load.clone(),
                sandbox.config().clone(),
                metrics.clone(),
            ),
            client,
            load,
            sandbox,
            metrics,
            opts,
            files: BTreeMap::new(),
            compiles: Arc::new(Semaphore::new(
                std::thread::available_parallelism().map_or(2, |n| n.get()),
            )),
        }
    }

    /// The same registry, compiling with `load` instead of the sandbox.
    #[cfg(test)]
    fn with_loader(mut self, load: Loader) -> Self {
        self.staging.set_loader(load.clone());
        self.load = load;
        self
    }

    /// The same registry against the API server of `client`.
    #[cfg(test)]
    fn with_client(mut self, client: Client) -> Self {
        self.releases = Releases::new(
            client.clone(),
            self.opts.controller.release_scope(),
            self.metrics.clone(),
            self.opts.pending_releases.clone(),
        );
        self.client = client;
        self
    }

    /// The same registry, its next versions canaries on `policy`'s schedule.
    #[cfg(test)]
    fn with_canary(mut self, policy: CanaryPolicy) -> Self {
        self.opts.canary = Some(policy.clone());
        self.staging = Staging::new(
            Some(policy),
            self.opts.source.clone(),
            self.load.clone(),
            self.sandbox.config().clone(),
            self.metrics.clone(),
        );
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
                self.releases.resume();
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
        self.releases.abort_all();
        for notice in self.notices.values() {
            notice.abort();
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
        self.releases.forget_finished();
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
        let shadows_settling = self.staging.scan(shadows, &present).await;
        let gone = super::source::gone(&self.files, &present);
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
                self.releases.after(&plugin);
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
        for (path, plugin) in self.staging.promoted(|path| self.files.contains_key(path)) {
            self.serve(&path, plugin, &mut BTreeSet::new()).await;
        }
        settling || shadows_settling
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
        self.staging.drop_candidate(path);
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
                Ok((path, Ok(plugin)))
                    if self.staging.stages(&path, &plugin, self.serving(&path)) =>
                {
                    self.staging.stage(&path, plugin).await;
                    if let Some(state) = self.files.get_mut(&path) {
                        state.retry = None;
                    }
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

    /// Swaps a plugin that loaded in for its file, if its grant allows what it declares,
    /// its kind is free (or held by a later-named file `started` in this pass) and its
    /// CRD installs.
    async fn serve(&mut self, path: &Path, plugin: Plugin, started: &mut BTreeSet<PathBuf>) {
        let (limits_stamp, grant) = self.grant_of(path).await;
        let limits_file = crate::plugin::limits::file_of(path);
        if let Err(refused) = grant.check(plugin.info(), &limits_file.display().to_string()) {
            // Tried again when the file holding the grant changes (refresh_limits).
            if let Some(state) = self.files.get_mut(path) {
                state.limits_stamp = Some(limits_stamp);
            }
            self.failed(path, refused.to_string());
            return self.tell_refused(path, &plugin, &refused.to_string());
        }
        // With --plugin-identities, the plugin's account must hold what its controller
        // asks as it (tried again later: the administrator may grant it meanwhile).
        if let Some(identities) = &self.opts.controller.identities
            && let Err(refused) = identities
                .check_access(
                    &self.client,
                    plugin.info(),
                    self.opts.controller.namespace.as_deref(),
                )
                .await
        {
            self.failed_for_now(path, format!("{}: {refused}", path.display()));
            return self.tell_refused(path, &plugin, &refused);
        }
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
            // With --install-crds, the install's one read of the CRD decides it.
            (Some(_), true)
                if !self.opts.install_crds
                    && let Err(e) = crd::may_convert(&self.client, &plugin).await =>
            {
                return self.failed_for_now(path, format!("{}: {e}", path.display()));
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
            && let Err(e) = crd::install(&self.client, &plugin, conversion).await
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
        self.releases.cancel(&plugin.info().parent);
        let state = self.files.get_mut(path).expect("state exists");
        let replaced = state.serving.take();
        if let Some((old, controller)) = replaced {
            controller.stop().await;
            info!(file = %path.display(), old = %old.sha256(), new = %plugin.sha256(), "plugin replaced");
            if claim_key(&old.info().parent) != claim_key(&plugin.info().parent) {
                // The old kind lost its plugin as surely as if the file were removed.
                info!(file = %path.display(), old = %old.info().parent, new = %plugin.info().parent, "the new version reconciles another kind");
                self.releases.after(&old);
            }
        } else {
            info!(file = %path.display(), plugin = %plugin.info().name, kind = %plugin.info().parent, "plugin loaded");
        }
        let controller = self.start_controller(path, &plugin);
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

    /// The version `path` serves, if any.
    fn serving(&self, path: &Path) -> Option<&Plugin> {
        self.files
            .get(path)?
            .serving
            .as_ref()
            .map(|(plugin, _)| plugin)
    }

    /// Another file whose serving plugin reconciles the same parent kind as `plugin`.
    fn claimant(&self, plugin: &Plugin, path: &Path) -> Option<PathBuf> {
        let serving = self
            .files
            .iter()
            .filter_map(|(p, s)| Some((p, &s.serving.as_ref()?.0)));
        claimant(serving, plugin, path)
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

    /// Starts the controller of `plugin`, the serving version of `path`.
    fn start_controller(&mut self, path: &Path, plugin: &Plugin) -> RunningController {
        RunningController::start(
            self.client.clone(),
            plugin.clone(),
            self.metrics.clone(),
            &self.caches,
            &self.opts.controller,
            self.staging.slot(path),
        )
    }

    /// Tells the parents of `plugin`'s kind that it is refused with `message`
    /// ([`notice`]), unless a version of its file, or another file, serves the kind.
    fn tell_refused(&mut self, path: &Path, plugin: &Plugin, message: &str) {
        let serving = self.files.get(path).is_some_and(|s| s.serving.is_some());
        if serving || self.claimant(plugin, path).is_some() {
            return;
        }
        let scope = self.opts.controller.release_scope();
        if let Some(task) = notice::tell_refused(&self.client, plugin.info(), message, &scope)
            && let Some(previous) = self.notices.insert(path.to_path_buf(), task)
        {
            previous.abort();
        }
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
/// the first claiming a kind wins deterministically.
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
