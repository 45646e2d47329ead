//! `capstan plan --live`: what a plugin version would change in the cluster, parent by
//! parent, without writing anything. The observed state is read the way `capstan run`'s
//! caches hold it (the children a parent controls among the objects labelled
//! `app.kubernetes.io/managed-by=capstan`, the related objects its `customize` selects);
//! the plugin is called and its answer planned by the same engine as a reconcile; each
//! child goes through the reconcile's own apply under the ownership rules as a dry run
//! (`dryRun=All`), so the differences shown are the API server's, defaults and
//! admission included; the children the answer drops are the ones a reconcile prunes.

use std::collections::BTreeMap;

use kube::api::{Api, DynamicObject, ListParams};
use kube::{Client, ResourceExt};
use serde_json::Value;

use super::children::{controller_uid, with_type};
use super::cluster::{ChildKinds, ChildOutcome, ClusterWrites};
use super::kinds::api_resource;
use super::leader::WriteFence;
use crate::contract::{Observed, ObservedChild, RelatedObject};
use crate::diff::{self, ChildChange, Outcome, ParentOutcome};
use crate::engine::{self, World};
use crate::plan::{MANAGED_BY, MANAGED_BY_LABEL};
use crate::plugin::{Pinned, Plugin};

/// Why the cluster could not be read (a parent that fails is an [`Outcome::Failing`]).
#[derive(Debug, thiserror::Error)]
#[error("cannot list {what}: {source}")]
pub struct ListError {
    /// What was listed.
    what: String,
    /// kube's error.
    #[source]
    source: kube::Error,
}

/// What `plugin` would change for every parent of its kind (in `namespace`, or in all),
/// in (namespace, name) order. Parents being deleted are left out: a reconcile tears
/// them down instead. Nothing is written.
/// `pinned`: every call's clock and random (none: the host's).
pub async fn plan_live(
    client: &Client,
    plugin: &Plugin,
    namespace: Option<&str>,
    pinned: Option<Pinned>,
) -> Result<Vec<ParentOutcome>, ListError> {
    let info = plugin.info();
    let list = |kind: &crate::contract::KindRef, labels: Option<&str>| {
        let ar = api_resource(kind);
        let api: Api<DynamicObject> = match (kind.namespaced, namespace) {
            (true, Some(ns)) => Api::namespaced_with(client.clone(), ns, &ar),
            _ => Api::all_with(client.clone(), &ar),
        };
        let params = match labels {
            Some(labels) => ListParams::default().labels(labels),
            None => ListParams::default(),
        };
        let what = format!("{} ({})", kind.plural, kind.api_version());
        async move {
            let listed = api
                .list(&params)
                .await
                .map_err(|source| ListError { what, source })?;
            Ok::<_, ListError>(
                listed
                    .items
                    .into_iter()
                    .map(|o| with_type(o, &ar))
                    .collect::<Vec<_>>(),
            )
        }
    };
    let mut parents = list(&info.parent, None).await?;
    parents.retain(|p| p.metadata.deletion_timestamp.is_none());
    parents.sort_by_key(|p| (p.namespace(), p.name_any()));
    let managed = format!("{MANAGED_BY_LABEL}={MANAGED_BY}");
    let mut children = Vec::new();
    for kind in &info.children {
        children.push(list(kind, Some(&managed)).await?);
    }
    let mut related = Vec::new();
    for (index, kind) in info.related.iter().enumerate() {
        for object in list(kind, None).await? {
            related.push(RelatedObject {
                kind_index: index as u32,
                object: serde_json::to_value(&object).unwrap_or_default(),
            });
        }
    }
    let kinds = ChildKinds::new(&info.children);
    let writes = ClusterWrites::new(
        client.clone(),
        &info.parent,
        &info.name,
        WriteFence::default(),
    );
    let mut out = Vec::with_capacity(parents.len());
    for parent in &parents {
        let name = match parent.namespace() {
            Some(ns) => format!("{ns}/{}", parent.name_any()),
            None => parent.name_any(),
        };
        let planned = plan_parent(plugin, &writes, &kinds, parent, &children, &related, pinned);
        let outcome = match planned.await {
            Ok(outcome) => outcome,
            Err(why) => Outcome::Failing(why),
        };
        out.push(ParentOutcome {
            parent: name,
            outcome,
        });
    }
    Ok(out)
}

/// One parent: its observed state, the plugin's answer planned, each child dry-run
/// applied and compared with the live one. `Err`: why the reconcile would fail.
async fn plan_parent(
    plugin: &Plugin,
    writes: &ClusterWrites,
    kinds: &ChildKinds,
    parent: &DynamicObject,
    children: &[Vec<DynamicObject>],
    related: &[RelatedObject],
    pinned: Option<Pinned>,
) -> Result<Outcome, String> {
    let info = plugin.info();
    let uid = parent.metadata.uid.clone().unwrap_or_default();
    let ns = parent.namespace();
    let parent_json = serde_json::to_value(parent).map_err(|e| e.to_string())?;
    // Its children, as the caches show them, by (kind index, name).
    let mut live: BTreeMap<(usize, String), &DynamicObject> = BTreeMap::new();
    for (index, objects) in children.iter().enumerate() {
        for object in objects {
            let same_namespace = !info.children[index].namespaced || object.namespace() == ns;
            if same_namespace && controller_uid(object).as_deref() == Some(uid.as_str()) {
                live.insert((index, object.name_any()), object);
            }
        }
    }
    let mut observed = Observed {
        parent: parent_json.clone(),
        children: live
            .iter()
            .map(|((index, _), object)| ObservedChild {
                kind_index: *index as u32,
                object: serde_json::to_value(object).unwrap_or_default(),
            })
            .collect(),
        related: Vec::new(),
    };
    observed.related = engine::observe::related(plugin, &parent_json, related, pinned)
        .await
        .map_err(|e| e.to_string())?
        .objects;
    let world = match pinned {
        Some(pinned) => World::pinned(observed, pinned),
        None => World::at_present(observed),
    };
    let planned = engine::decide(plugin, &world)
        .await
        .map_err(|e| e.to_string())?;
    let mut changes = Vec::new();
    for child in &planned.children {
        let key = (child.kind_index, child.name.clone());
        let before = live.get(&key);
        let (outcome, after) = writes
            .dry_run_child(kinds, parent, child, before.is_some())
            .await
            .map_err(|e| e.to_string())?;
        let kind = info.children[child.kind_index].kind.clone();
        let name = diff::qualified_name(&child.manifest);
        let change = match (outcome, before, after) {
            (ChildOutcome::Conflict(conflict), _, _) => ChildChange::Conflict(conflict.to_string()),
            (_, Some(before), Some(after)) => {
                let fields = diff::diff(&comparable(before), &comparable(&after));
                if fields.is_empty() {
                    continue;
                }
                ChildChange::Changed(fields)
            }
            _ => ChildChange::Created,
        };
        changes.push(diff::ChildOutcome { kind, name, change });
    }
    for ((index, name), object) in &live {
        if !planned
            .children
            .iter()
            .any(|c| c.kind_index == *index && &c.name == name)
        {
            changes.push(diff::ChildOutcome {
                kind: info.children[*index].kind.clone(),
                name: diff::qualified_name(&serde_json::to_value(object).unwrap_or_default()),
                change: ChildChange::Deleted,
            });
        }
    }
    let status_before = parent_json
        .get("status")
        .cloned()
        .unwrap_or_else(diff::empty);
    let status = diff::diff(
        &diff::comparable_status(&status_before),
        &diff::comparable_status(&planned.status),
    )
    .into_iter()
    .map(|mut f| {
        f.path = format!("status.{}", f.path);
        f
    })
    .collect();
    Ok(Outcome::Changes {
        children: changes,
        status,
    })
}

/// An object as JSON without what the API server sets on every write.
fn comparable(object: &DynamicObject) -> Value {
    diff::without_server_fields(serde_json::to_value(object).unwrap_or_default())
}
