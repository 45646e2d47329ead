//! Kind claims and what follows when a kind loses its plugin: one plugin file
//! reconciles a parent kind (by group and kind, whatever the version), and a kind no
//! plugin serves any more has the finalizers its plugin asked for released.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kube::Client;
use tokio::task::JoinHandle;
use tracing::info;

use super::super::finalizers::{FinalizerRelease, ReleaseScope, kind_label};
use super::super::metrics::Metrics;
use crate::contract::KindRef;
use crate::plugin::Plugin;

/// A kind claim: group and kind, whatever the version. Two plugins for `Foo/v1` and
/// `Foo/v1beta1` would reconcile the very same objects and fight over them.
pub(super) type ClaimKey = (String, String);

/// The key of `kind`'s claim.
pub(super) fn claim_key(kind: &KindRef) -> ClaimKey {
    (kind.group.clone(), kind.kind.clone())
}

/// Another file, among `serving` (each file with the plugin it serves), whose plugin
/// reconciles the same parent kind as `plugin`, loaded from `path`.
pub(super) fn claimant<'a>(
    serving: impl IntoIterator<Item = (&'a PathBuf, &'a Plugin)>,
    plugin: &Plugin,
    path: &Path,
) -> Option<PathBuf> {
    let key = claim_key(&plugin.info().parent);
    serving
        .into_iter()
        .find(|(p, other)| p.as_path() != path && claim_key(&other.info().parent) == key)
        .map(|(p, _)| p.clone())
}

/// The parent kinds whose finalizers are still to be released (with the name of the
/// plugin that is gone), shared by the registries a process runs one after another:
/// with `--shards`, every change of buckets stops the registry and starts a new one,
/// which resumes these releases for its own buckets.
#[derive(Debug, Clone, Default)]
pub struct PendingReleases(Arc<std::sync::Mutex<BTreeMap<ClaimKey, (KindRef, String)>>>);

impl PendingReleases {
    fn pending(&self) -> std::sync::MutexGuard<'_, BTreeMap<ClaimKey, (KindRef, String)>> {
        // The map is whole after any panic (one insert or remove), so a poisoned lock
        // still holds the truth.
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub(super) fn insert(&self, kind: &KindRef, plugin: &str) {
        self.pending()
            .insert(claim_key(kind), (kind.clone(), plugin.to_string()));
    }

    fn remove(&self, kind: &KindRef) {
        self.pending().remove(&claim_key(kind));
    }

    pub(super) fn all(&self) -> Vec<(KindRef, String)> {
        self.pending().values().cloned().collect()
    }
}

/// The releases of finalizers under way, one task per kind.
pub(super) struct Releases {
    client: Client,
    scope: ReleaseScope,
    metrics: Arc<Metrics>,
    pending: PendingReleases,
    running: HashMap<ClaimKey, JoinHandle<()>>,
}

impl Releases {
    /// None under way; `pending` holds those an earlier registry left undone.
    pub(super) fn new(
        client: Client,
        scope: ReleaseScope,
        metrics: Arc<Metrics>,
        pending: PendingReleases,
    ) -> Self {
        Releases {
            client,
            scope,
            metrics,
            pending,
            running: HashMap::new(),
        }
    }

    /// Resumes the releases an earlier registry of this process left undone, except of
    /// kinds served again (which cancelled theirs).
    pub(super) fn resume(&mut self) {
        for (kind, plugin) in self.pending.all() {
            if !self.running.contains_key(&claim_key(&kind)) {
                self.start(&kind, &plugin);
            }
        }
    }

    /// Forgets the releases that are done.
    pub(super) fn forget_finished(&mut self) {
        self.running.retain(|_, release| !release.is_finished());
    }

    /// Starts releasing the finalizers of `plugin`'s parent kind, which no plugin serves
    /// any more (if it asked for them).
    pub(super) fn after(&mut self, plugin: &Plugin) {
        let info = plugin.info();
        if info.finalizer {
            self.start(&info.parent, &info.name);
        }
    }

    /// Starts releasing the finalizers of `kind`, whose plugin `plugin` is gone; it stays
    /// pending until done, or until a plugin serves the kind again.
    fn start(&mut self, kind: &KindRef, plugin: &str) {
        let release = FinalizerRelease::new(
            self.client.clone(),
            kind,
            plugin,
            &self.scope,
            self.metrics.clone(),
        );
        let pending = self.pending.clone();
        pending.insert(kind, plugin);
        let done = kind.clone();
        let task = tokio::spawn(async move {
            release.run().await;
            pending.remove(&done);
        });
        if let Some(previous) = self.running.insert(claim_key(kind), task) {
            previous.abort();
        }
    }

    /// Stops releasing the finalizers of `kind`: a plugin serves it again.
    pub(super) fn cancel(&mut self, kind: &KindRef) {
        self.pending.remove(kind);
        if let Some(release) = self.running.remove(&claim_key(kind)) {
            release.abort();
            info!(%kind, "a plugin serves the kind again: its finalizers are no longer released");
        }
        self.metrics.clear_orphaned_finalizers(&kind_label(kind));
    }

    /// Stops the releases under way; they stay pending, for the next registry of this
    /// process to resume.
    pub(super) fn abort_all(self) {
        for (_, release) in self.running {
            release.abort();
        }
    }
}
