//! Where the registry stages next versions: the shadow files (`NAME.next.wasm`,
//! `NAME.next.oci`) it loads into the slots of the files they shadow, and, under
//! `--canary`, the new digest of a reference whose tag moved, which waits as the
//! candidate until its canary promotes it.
//!
//! The registry asks three things of it: load the shadows a scan found
//! ([`Staging::scan`]), whether a new version of a serving file is a candidate rather
//! than a replacement ([`Staging::stages`] then [`Staging::stage`]), and which
//! candidates were promoted ([`Staging::promoted`]), which it then serves.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use tracing::{error, info, warn};

use super::canary::{Canary, CanaryPolicy, Phase};
use super::slot::{self, ShadowSlot};
use crate::operator::metrics::{Metrics, Report};
use crate::operator::source::{Listed, Loader, PluginSource, SETTLE, Stamp, read_limits};
use crate::plugin::{Plugin, SandboxConfig, sha256_hex};

/// A shadow file as last read: its stamp, the sha256 of its bytes, and when (a reference
/// is resolved again on the schedule).
type Seen = (Stamp, String, Instant);

/// The next versions of the serving files.
pub struct Staging {
    /// With `--canary`: a next version serves a share of the parents on this schedule;
    /// none: it only shadows.
    canary: Option<CanaryPolicy>,
    source: PluginSource,
    load: Loader,
    /// The sandbox's configuration, which a plugin's limits file completes.
    config: SandboxConfig,
    metrics: Arc<Metrics>,
    /// Shadow files, as last read.
    files: BTreeMap<PathBuf, Seen>,
    /// The shadow of each serving file, shared with its controller.
    slots: BTreeMap<PathBuf, ShadowSlot>,
    /// References whose tag moved to a new digest under `--canary`: the new version is
    /// their slot's candidate (in any phase), and serves once promoted.
    staged: BTreeSet<PathBuf>,
}

impl Staging {
    /// Nothing staged yet.
    pub fn new(
        canary: Option<CanaryPolicy>,
        source: PluginSource,
        load: Loader,
        config: SandboxConfig,
        metrics: Arc<Metrics>,
    ) -> Self {
        Staging {
            canary,
            source,
            load,
            config,
            metrics,
            files: BTreeMap::new(),
            slots: BTreeMap::new(),
            staged: BTreeSet::new(),
        }
    }

    /// The compiler of plugin files, for tests that hold one back.
    #[cfg(test)]
    pub fn set_loader(&mut self, load: Loader) {
        self.load = load;
    }

    /// The shadow of the serving file `file`, shared with its controller.
    pub fn slot(&mut self, file: &Path) -> ShadowSlot {
        self.slots
            .entry(file.to_path_buf())
            .or_insert_with(|| ShadowSlot::new(file))
            .clone()
    }

    /// Whether `new`, just loaded for `path`, is a candidate rather than a replacement
    /// of `serving`: under `--canary`, a reference (its tag moved to a new digest) whose
    /// slot holds no `NAME.next.*` of its own.
    pub fn stages(&self, path: &Path, new: &Plugin, serving: Option<&Plugin>) -> bool {
        self.canary.is_some()
            && PluginSource::is_remote(path)
            && serving.is_some_and(|serving| serving.sha256() != new.sha256())
            && !self.files.keys().any(|shadow| {
                slot::shadowed_by(shadow).is_some_and(|files| files.contains(&path.to_path_buf()))
            })
    }

    /// Drops the candidate of the reference `path`, if it has one: the tag names the
    /// serving version again.
    pub fn drop_candidate(&mut self, path: &Path) {
        if self.staged.remove(path) {
            self.slot(path).set(None, None);
            self.metrics.remove_shadow(&path.display().to_string());
            info!(file = %path.display(), "the reference names the serving version again: its candidate is dropped");
        }
    }

    /// Makes the new version of the reference `path` its canary candidate: it serves a
    /// share of the parents on the schedule, and the version serving stays until the
    /// candidate is promoted ([`Staging::promoted`]).
    pub async fn stage(&mut self, path: &Path, plugin: Plugin) {
        let policy = self.canary.clone().expect("staged only under --canary");
        if !self.granted(path, &plugin).await {
            return;
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
        self.slot(path).set(Some(plugin), Some(canary));
        self.staged.insert(path.to_path_buf());
    }

    /// The staged candidates that were promoted, taken out of their slots for the
    /// registry to serve in place of their reference's old version. A candidate whose
    /// file is gone (`present` says no) is dropped. One rolled back stays in its slot
    /// (shown in `/plugins`, serving no parent) and its digest is not tried again until
    /// the tag moves on.
    pub fn promoted(&mut self, present: impl Fn(&Path) -> bool) -> Vec<(PathBuf, Plugin)> {
        let mut promoted = Vec::new();
        for path in self.staged.clone() {
            let slot = self.slot(&path);
            let Some((plugin, canary)) = slot.canary() else {
                self.staged.remove(&path);
                continue;
            };
            if !present(&path) {
                slot.set(None, None);
                self.metrics.remove_shadow(&path.display().to_string());
                self.staged.remove(&path);
                continue;
            }
            if canary.report().phase == Phase::Promoted {
                info!(file = %path.display(), sha256 = %plugin.sha256(), "the promoted candidate now serves the reference");
                slot.set(None, None);
                self.metrics.remove_shadow(&path.display().to_string());
                self.staged.remove(&path);
                promoted.push((path, plugin));
            }
        }
        promoted
    }

    /// Sets on `plugin`, a next version of the serving `file`, the limits of that file,
    /// and says whether its grant allows what `plugin` declares: a shadow or a canary
    /// candidate is called on the serving version's parents, and a candidate writes for
    /// them, so it gets no more than the file it would replace. A refused one is logged.
    async fn granted(&self, file: &Path, plugin: &Plugin) -> bool {
        let limits = read_limits(file, &self.config).await.unwrap_or_default();
        let grant = limits.grant.clone().unwrap_or_default();
        plugin.set_limits(limits);
        let limits_file = crate::plugin::limits::file_of(file);
        match grant.check(plugin.info(), &limits_file.display().to_string()) {
            Ok(()) => true,
            Err(refused) => {
                warn!(file = %file.display(), "next version not loaded: {refused}");
                false
            }
        }
    }

    /// Loads new or changed shadow files (`present`) into the slots of the files they
    /// shadow (`serving` lists the files present), with the limits of those files, and
    /// empties the slots of removed ones. Returns whether a file is still settling. A
    /// shadow that does not load is logged and left out.
    pub async fn scan(
        &mut self,
        present: BTreeMap<PathBuf, Listed>,
        serving: &BTreeMap<PathBuf, Listed>,
    ) -> bool {
        // `NAME.next.*` shadows `NAME.wasm`, or `NAME.oci` when that is the one present.
        let file_of = |path: &Path| {
            slot::shadowed_by(path).map(|[wasm, oci]| {
                if !serving.contains_key(&wasm) && serving.contains_key(&oci) {
                    oci
                } else {
                    wasm
                }
            })
        };
        let gone = crate::operator::source::gone(&self.files, &present);
        for path in gone {
            self.files.remove(&path);
            if let Some(file) = file_of(&path) {
                self.slot(&file).set(None, None);
                self.metrics.remove_shadow(&file.display().to_string());
                info!(shadow = %path.display(), "shadow version removed");
            }
        }
        let mut settling = false;
        let refresh = self.source.refresh();
        for (path, Listed { stamp, .. }) in present {
            let known = self.files.get(&path).cloned();
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
            let bytes = match self.source.read(&path).await {
                Ok(bytes) => bytes,
                Err(e) => {
                    warn!(shadow = %path.display(), "cannot read the shadow version: {e}");
                    // Tried again on the schedule (a reference) or when it changes.
                    let sha = known.map(|(_, sha, _)| sha).unwrap_or_default();
                    self.files
                        .insert(path.clone(), (stamp, sha, Instant::now()));
                    continue;
                }
            };
            let sha = sha256_hex(&bytes);
            self.files
                .insert(path.clone(), (stamp, sha.clone(), Instant::now()));
            if known.is_some_and(|(_, s, _)| s == sha) {
                continue;
            }
            self.load_into_slot(path, file, bytes).await;
        }
        settling
    }

    /// Compiles the shadow file `path` and puts it in the slot of `file`, as a canary
    /// candidate under `--canary`; empties the slot when it does not load.
    async fn load_into_slot(&mut self, path: PathBuf, file: PathBuf, bytes: Vec<u8>) {
        let (load, shadow_file) = (self.load.clone(), path.clone());
        let loaded = tokio::task::spawn_blocking(move || load(&bytes, &shadow_file)).await;
        let slot = self.slot(&file);
        self.staged.remove(&file);
        match loaded {
            Ok(Ok(plugin)) => {
                if !self.granted(&file, &plugin).await {
                    slot.set(None, None);
                    self.metrics.remove_shadow(&file.display().to_string());
                    return;
                }
                let canary = self.canary.clone().map(|policy| {
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
}
