//! Decide: one function from a plugin and a parent's world to the plan of what to write.
//! `capstan run` acts on the plan; `render`, `plan`, `test`, shadow and canary read it.

use crate::contract::{FinalizeResult, PluginError};
use crate::plan::{self, Plan};
use crate::plugin::{CallError, Plugin};
use crate::validate::Violation;

use super::observe::World;

/// Why a plugin's answer gives no plan.
#[derive(Debug, thiserror::Error)]
pub enum DecideError {
    /// The plugin could not be called to the end (deadline, memory cap, trap).
    #[error(transparent)]
    Call(#[from] CallError),
    /// The plugin answered with an error: the spec is invalid, or it asks for a retry.
    #[error("reconcile failed: {0}")]
    Plugin(PluginError),
    /// The plugin's answer breaks the contract; nothing of it is to be written.
    #[error("plugin output refused: {0}")]
    Refused(#[from] Violation),
}

/// Calls `reconcile` on `world` and plans the answer: validated (declared kinds, the
/// parent's namespace, names, sizes, no foreign owners) and turned into the children to
/// apply, the status with its conditions, the events and the requeue.
pub async fn decide(plugin: &Plugin, world: &World) -> Result<Plan, DecideError> {
    let desired = plugin
        .reconcile_pinned(&world.observed, world.pinned)
        .await?
        .map_err(DecideError::Plugin)?;
    // What the administrator granted bounds the answer too (the Pods it runs).
    let grant = plugin.limits_file().grant.unwrap_or_default();
    Ok(plan::plan(
        plugin.info(),
        &world.observed.parent,
        desired,
        &world.now,
        &grant,
    )?)
}

/// Calls `finalize` on `world` (a parent being deleted): done, a teardown wave to
/// delete, or a wait. A wave may name only declared child kinds; which of its children
/// the parent controls is the writer's to find among what it observed.
pub async fn finalize(plugin: &Plugin, world: &World) -> Result<FinalizeResult, DecideError> {
    let result = plugin
        .finalize_pinned(&world.observed, world.pinned)
        .await?
        .map_err(DecideError::Plugin)?;
    let declared = plugin.info().children.len();
    if let Some(named) = result
        .delete
        .iter()
        .find(|c| c.kind_index as usize >= declared)
    {
        return Err(Violation::Teardown(format!(
            "child kind index {} to delete is not a declared child kind",
            named.kind_index
        ))
        .into());
    }
    Ok(result)
}
