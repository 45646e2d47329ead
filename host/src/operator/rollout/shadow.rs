//! Shadow mode: a new version of a plugin, placed beside the serving one as
//! `NAME.next.wasm` next to `NAME.wasm`, is called on every reconcile of the serving
//! version with the same observed state. Its answer is planned by the same code and
//! compared with the serving version's plan ([`crate::diff::compare_plans`]), never
//! applied: a divergence is counted (`capstan_shadow_reconciles_total`), listed in
//! `/plugins` and logged with the parent and the first difference. It costs plugin CPU
//! (one more call per reconcile), never an API request.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use tracing::{info, warn};

use crate::contract::Observed;
use crate::diff::{self, ChildChange, Outcome};
use crate::plan::{self, Plan};
use crate::plugin::Plugin;

use super::canary::Canary;
use super::metrics::Metrics;

/// How a shadow file is named: `NAME.next.wasm` (or `NAME.next.oci`, a reference to a
/// registry) shadows `NAME.wasm` (or `NAME.oci`).
pub const SHADOW_SUFFIX: &str = ".next.wasm";
/// The shadow suffix of an OCI reference file.
pub const SHADOW_OCI_SUFFIX: &str = ".next.oci";

/// The serving files `path` may shadow, if it is a shadow file: `NAME.wasm` then
/// `NAME.oci` (the registry takes the one present).
pub fn shadowed_by(path: &Path) -> Option<[PathBuf; 2]> {
    let name = path.file_name()?.to_str()?;
    let stem = name
        .strip_suffix(SHADOW_SUFFIX)
        .or_else(|| name.strip_suffix(SHADOW_OCI_SUFFIX))?;
    (!stem.is_empty()).then(|| {
        [
            path.with_file_name(format!("{stem}.wasm")),
            path.with_file_name(format!("{stem}.oci")),
        ]
    })
}

/// The shadow of one serving file, shared by the registry (which loads and unloads it)
/// and the file's controller (which calls it): empty while there is none.
#[derive(Clone, Default)]
pub struct ShadowSlot {
    /// The serving file, as `/plugins` names it.
    file: String,
    plugin: Arc<RwLock<Option<Plugin>>>,
    /// With `--canary`: the shadow's canary, which lets it serve a share of parents.
    canary: Arc<RwLock<Option<Arc<Canary>>>>,
}

impl ShadowSlot {
    /// An empty slot for the serving file `file`.
    pub fn new(file: &Path) -> Self {
        ShadowSlot {
            file: file.display().to_string(),
            plugin: Arc::default(),
            canary: Arc::default(),
        }
    }

    /// The shadow now, if any.
    pub fn get(&self) -> Option<Plugin> {
        self.plugin.read().expect("shadow lock").clone()
    }

    /// Puts `plugin` in (none: takes the shadow out), with its canary if it is one.
    pub fn set(&self, plugin: Option<Plugin>, canary: Option<Arc<Canary>>) {
        let mut slot = self.plugin.write().expect("shadow lock");
        *self.canary.write().expect("shadow lock") = canary.filter(|_| plugin.is_some());
        *slot = plugin;
    }

    /// The shadow and its canary, if it is one (`--canary`).
    pub fn canary(&self) -> Option<(Plugin, Arc<Canary>)> {
        let plugin = self.plugin.read().expect("shadow lock");
        let canary = self.canary.read().expect("shadow lock");
        Some((plugin.clone()?, canary.clone()?))
    }

    /// The serving file.
    pub fn file(&self) -> &str {
        &self.file
    }
}

/// What the shadow made of one reconcile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The same children and status as the serving version.
    Agreed,
    /// Something differs: the first difference, in one line.
    Diverged(String),
    /// The shadow's reconcile failed where the serving version's did not: why.
    Failed(String),
}

/// Calls `shadow` on `observed` and compares its plan with `served` (the serving
/// version's plan for the same state).
pub async fn judge(shadow: &Plugin, observed: &Observed, served: &Plan) -> Verdict {
    let planned = match shadow.reconcile_async(observed).await {
        Ok(Ok(desired)) => plan::plan(shadow.info(), &observed.parent, desired, &plan::now())
            .map_err(|e| format!("plugin output refused: {e}")),
        Ok(Err(e)) => Err(format!("reconcile failed: {e}")),
        Err(e) => Err(e.to_string()),
    };
    let planned = match planned {
        Ok(planned) => planned,
        Err(why) => return Verdict::Failed(why),
    };
    match diff::compare_plans(Ok(served), Ok(&planned)) {
        Outcome::Failing(why) => Verdict::Failed(why),
        outcome if outcome.is_unchanged() => Verdict::Agreed,
        Outcome::Changes { children, status } => {
            Verdict::Diverged(first_difference(&children, &status))
        }
    }
}

/// The first difference of a comparison, in one line: a child the shadow adds or drops,
/// or the path of the first field that differs.
fn first_difference(children: &[diff::ChildOutcome], status: &[diff::FieldChange]) -> String {
    if let Some(child) = children.first() {
        let what = format!("{} {}", child.kind, child.name);
        return match &child.change {
            ChildChange::Created => format!("{what}: only the shadow writes it"),
            ChildChange::Deleted => format!("{what}: only the serving version writes it"),
            ChildChange::Changed(fields) => match fields.first() {
                Some(f) => format!("{what}: {}", f.path),
                None => what,
            },
            ChildChange::Conflict(why) => format!("{what}: {why}"),
        };
    }
    match status.first() {
        Some(f) => f.path.clone(),
        None => "no difference".into(),
    }
}

/// Runs the shadow of `slot`, if any, on the state the serving version was called
/// with, and records the verdict for `parent` (`namespace/name`).
pub async fn shadow_reconcile(
    slot: &ShadowSlot,
    observed: &Observed,
    served: &Plan,
    serving: &Plugin,
    metrics: &Metrics,
) {
    let Some(shadow) = slot.get() else {
        return;
    };
    let parent = diff::qualified_name(&observed.parent);
    let (kind, shadow_kind) = (&serving.info().parent, &shadow.info().parent);
    let verdict = if (&kind.group, &kind.kind) != (&shadow_kind.group, &shadow_kind.kind) {
        Verdict::Failed(format!("it reconciles {shadow_kind}, not {kind}"))
    } else {
        judge(&shadow, observed, served).await
    };
    let serving = &serving.info().name;
    match &verdict {
        Verdict::Agreed => {}
        Verdict::Diverged(first) => {
            info!(plugin = %serving, shadow = %shadow.sha256(), %parent, difference = %first, "the shadow version diverges");
        }
        Verdict::Failed(why) => {
            warn!(plugin = %serving, shadow = %shadow.sha256(), %parent, "the shadow version fails: {why}");
        }
    }
    metrics.shadow_judged(slot.file(), serving, &parent, &verdict);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shadow_file_names_the_file_it_shadows() {
        let both = Some([PathBuf::from("/p/uuid.wasm"), PathBuf::from("/p/uuid.oci")]);
        assert_eq!(shadowed_by(Path::new("/p/uuid.next.wasm")), both);
        assert_eq!(shadowed_by(Path::new("/p/uuid.next.oci")), both);
        assert_eq!(shadowed_by(Path::new("/p/uuid.oci")), None);
        assert_eq!(shadowed_by(Path::new("/p/uuid.wasm")), None);
        assert_eq!(shadowed_by(Path::new("/p/.next.wasm")), None);
    }
}
