//! The parents of a refused plugin's kind are told why nothing reconciles them: a
//! plugin refused at load (its grant, its account's rights) leaves its parents
//! without a controller, and a user who runs `kubectl get` on one sees, instead of a
//! stale status, `Ready=False` with reason `PluginRefused` and the refusal's one line,
//! and a Warning event. Only custom resource kinds are told: the host writes nothing on
//! a built-in object for a plugin that was refused it.

use kube::api::{Api, DynamicObject, ListParams};
use kube::{Client, ResourceExt};
use tokio::task::JoinHandle;
use tracing::debug;

use super::super::cluster::{self, ClusterWrites};
use super::super::finalizers::ReleaseScope;
use super::super::kinds::api_resource;
use crate::contract::PluginInfo;
use crate::grant::built_in;
use crate::plan;
use crate::shard::bucket_of;

/// The reason of the condition and the event.
pub const REASON: &str = "PluginRefused";
/// At most this many parents are told per refusal (one page).
const MAX_TOLD: u32 = 500;

/// Tells the parents of `info`'s kind in `scope` that its plugin is refused with
/// `message`, in the background (as the plugin's account with `--plugin-identities`):
/// each parent not told the same already gets the condition and an event. None for a
/// built-in kind.
pub(super) fn tell_refused(
    client: &Client,
    info: &PluginInfo,
    message: &str,
    scope: &ReleaseScope,
) -> Option<JoinHandle<()>> {
    if built_in(&info.parent) {
        return None;
    }
    let client = match &scope.identities {
        Some(identities) => identities.client_of(client, &info.name),
        None => client.clone(),
    };
    let ar = api_resource(&info.parent);
    let parents: Api<DynamicObject> = match (scope.namespace.as_deref(), info.parent.namespaced) {
        (Some(ns), true) => Api::namespaced_with(client.clone(), ns, &ar),
        _ => Api::all_with(client.clone(), &ar),
    };
    let writes = ClusterWrites::new(client, &info.parent, &info.name, scope.fence.clone())
        .reporting_as(scope.instance.as_deref());
    let shard = scope.shard;
    let plugin = info.name.clone();
    let message = message.to_string();
    Some(tokio::spawn(async move {
        let listed = tokio::time::timeout(
            cluster::API_TIMEOUT,
            parents.list(&ListParams::default().limit(MAX_TOLD)),
        )
        .await;
        let list = match listed {
            Ok(Ok(list)) => list,
            Ok(Err(e)) => {
                debug!(%plugin, "cannot list the parents to tell them of the refusal: {e}");
                return;
            }
            Err(_) => return,
        };
        for parent in list.items {
            let uid = parent.metadata.uid.as_deref().unwrap_or_default();
            if shard.is_some_and(|b| !b.contains(bucket_of(uid))) || told(&parent, &message) {
                continue;
            }
            let object = serde_json::to_value(&parent).unwrap_or_default();
            let conditions = plan::failed_conditions(&object, REASON, &message, &plan::now());
            if let Err(e) = writes.write_conditions(&parent, &conditions).await {
                debug!(%plugin, parent = %parent.name_any(), "cannot tell the parent of the refusal: {e}");
                continue;
            }
            writes
                .publish(&parent, &plan::warning(REASON, message.clone()))
                .await;
        }
    }))
}

/// Whether `parent` already says that its plugin is refused with `message`.
fn told(parent: &DynamicObject, message: &str) -> bool {
    parent
        .data
        .pointer("/status/conditions")
        .and_then(|c| c.as_array())
        .into_iter()
        .flatten()
        .any(|c| c["type"] == "Ready" && c["reason"] == REASON && c["message"] == message)
}
