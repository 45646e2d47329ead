//! Shadow mode: a new version of a plugin, placed beside the serving one as
//! `NAME.next.wasm` next to `NAME.wasm`, is called on every reconcile of the serving
//! version with the same observed state. Its answer is planned by the same code and
//! compared with the serving version's plan ([`crate::diff::compare_plans`]), never
//! applied: a divergence is counted (`capstan_shadow_reconciles_total`), listed in
//! `/plugins` and logged with the parent and the first difference. It costs plugin CPU
//! (one more call per reconcile), never an API request.

use tracing::{info, warn};

use crate::diff::{self, ChildChange, Outcome};
use crate::engine::{self, World};
use crate::plan::Plan;
use crate::plugin::Plugin;

use super::slot::ShadowSlot;
use crate::operator::metrics::{Metrics, ShadowVerdict};

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

impl Verdict {
    /// The verdict as the metrics count it.
    fn counted(&self) -> ShadowVerdict<'_> {
        match self {
            Verdict::Agreed => ShadowVerdict::Agreed,
            Verdict::Diverged(first) => ShadowVerdict::Diverged(first),
            Verdict::Failed(why) => ShadowVerdict::Failed(why),
        }
    }
}

/// Calls `shadow` on `world` (the state the serving version decided on, at its clock)
/// and compares its plan with `served` (the serving version's plan).
pub async fn judge(shadow: &Plugin, world: &World, served: &Plan) -> Verdict {
    let planned = match engine::decide(shadow, world).await {
        Ok(planned) => planned,
        Err(why) => return Verdict::Failed(why.to_string()),
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
    world: &World,
    served: &Plan,
    serving: &Plugin,
    metrics: &Metrics,
) {
    let Some(shadow) = slot.get() else {
        return;
    };
    let parent = diff::qualified_name(&world.observed.parent);
    let (kind, shadow_kind) = (&serving.info().parent, &shadow.info().parent);
    let verdict = if (&kind.group, &kind.kind) != (&shadow_kind.group, &shadow_kind.kind) {
        Verdict::Failed(format!("it reconciles {shadow_kind}, not {kind}"))
    } else {
        judge(&shadow, world, served).await
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
    metrics.shadow_judged(slot.file(), serving, &parent, verdict.counted());
}
