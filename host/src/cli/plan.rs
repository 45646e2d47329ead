//! `capstan plan`: what a plugin version would change, against the live cluster or
//! against another version on files. Exit 0: nothing changes; 1: something would; 2:
//! the plan itself failed.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Result;

use capstan::engine::World;
use capstan::plugin::{Pinned, Plugin};
use capstan::render;

/// What a new version is planned against.
pub enum Target {
    /// The live cluster (`--live`, the default).
    Live {
        /// Only this namespace.
        namespace: Option<String>,
        /// The kubeconfig, as kubectl takes it.
        kubeconfig: Option<PathBuf>,
        /// Its context.
        context: Option<String>,
    },
    /// Another version, on parents, children and related objects from files
    /// (`--against`).
    Files {
        /// The version serving now.
        old: Plugin,
        /// The parents' files.
        parents: Vec<PathBuf>,
        /// The observed children.
        observed: Option<PathBuf>,
        /// The related objects.
        related: Option<PathBuf>,
    },
}

/// Plans `new` against `target` and prints the report.
pub fn plan(new: &Plugin, target: Target) -> Result<ExitCode> {
    let outcomes = match target {
        Target::Files {
            old,
            parents,
            observed,
            related,
        } => plan_against(new, &old, &parents, observed.as_deref(), related.as_deref())?,
        Target::Live {
            namespace,
            kubeconfig,
            context,
        } => {
            let runtime = tokio::runtime::Runtime::new()?;
            runtime.block_on(async {
                let (client, _) = super::operator::kube_client(
                    kubeconfig.as_deref(),
                    context,
                    &super::operator::identity(),
                )
                .await?;
                anyhow::Ok(
                    capstan::operator::preview::plan_live(&client, new, namespace.as_deref(), None)
                        .await?,
                )
            })?
        }
    };
    print!(
        "{}",
        capstan::diff::report(&new.info().parent.kind, &outcomes)
    );
    if capstan::diff::Summary::of(&outcomes).any() {
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}

/// `capstan plan --against`: both versions rendered on each parent of the files, with
/// the observed children and related objects given, and their plans compared.
fn plan_against(
    new: &Plugin,
    old: &Plugin,
    parent_files: &[PathBuf],
    observed: Option<&Path>,
    related: Option<&Path>,
) -> Result<Vec<capstan::diff::ParentOutcome>> {
    let mut parents = Vec::new();
    for path in parent_files {
        for parent in render::read_objects(path)? {
            parents.push((path.display().to_string(), parent));
        }
    }
    let observed = match observed {
        Some(path) => render::read_objects(path)?,
        None => Vec::new(),
    };
    let only = parents.len() == 1;
    // Both versions read the same clock and draw the same random bytes: a value a
    // plugin stamps or draws for an object it has not observed yet (a password, a
    // "since" instant) is the same in both plans unless the new version decides
    // otherwise.
    let pinned = Pinned {
        at: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() as i64),
        seed: fastrand::u64(..),
    };
    // Read once per version: their declared related kinds (and indexes) may differ. A
    // file one version cannot read fails that version's render of every parent.
    let existing = |plugin: &Plugin| -> Result<Vec<_>, String> {
        match related {
            Some(path) => render::read_related(plugin.info(), path).map_err(|e| e.to_string()),
            None => Ok(Vec::new()),
        }
    };
    let (old_existing, new_existing) = (existing(old), existing(new));
    let mut out = Vec::new();
    for (source, parent) in parents {
        let name = |p: &str| parent.pointer(p).and_then(serde_json::Value::as_str);
        let (ns, parent_name) = (
            name("/metadata/namespace").unwrap_or("default"),
            name("/metadata/name").unwrap_or(""),
        );
        let mine: Vec<serde_json::Value> = observed
            .iter()
            .filter(|child| only || render::controlled_by(child, &parent))
            .cloned()
            .collect();
        // Each version renders with its own reading of the inputs: their declared
        // kinds (and so the children's kind indexes) may differ.
        let render_with = |plugin: &Plugin,
                           existing: &Result<Vec<_>, String>|
         -> Result<capstan::plan::Plan, String> {
            let existing = existing.as_ref().map_err(String::clone)?;
            let mut state = render::observed_for(plugin, parent.clone(), &source, mine.clone())
                .map_err(|e| e.to_string())?;
            render::customize_pinned(plugin, &mut state, existing, Some(pinned))
                .map_err(|e| e.to_string())?;
            render::render_world(plugin, &World::pinned(state, pinned))
                .map(|r| r.plan)
                .map_err(|e| e.to_string())
        };
        let (old_plan, new_plan) = (
            render_with(old, &old_existing),
            render_with(new, &new_existing),
        );
        let outcome = capstan::diff::compare_plans(
            old_plan.as_ref().map_err(String::as_str),
            new_plan.as_ref().map_err(String::as_str),
        );
        out.push(capstan::diff::ParentOutcome {
            parent: format!("{ns}/{parent_name}"),
            outcome,
        });
    }
    Ok(out)
}
