//! Letting parents go when the plugin that put `capstan.dev/finalizer` on them is gone:
//! a removed plugin file, or a reloaded one that reconciles another kind now. Nothing
//! would ever remove the host's finalizer, and deleting those parents would hang.
//!
//! A [`FinalizerRelease`] lists the parents of the kind page by page (only this
//! replica's buckets with `--shards`), removes the finalizer from every one that is not
//! being deleted, and does it again with backoff until a whole pass leaves none behind.
//! A parent already being deleted keeps it (its cleanup never ran) unless an
//! administrator lets it go with [`FORCE_RELEASE_ANNOTATION`] or
//! `capstan run --force-release-finalizers KIND`. What is still held shows in
//! `capstan_orphaned_finalizers`.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use kube::api::{Api, DynamicObject, ListParams};
use kube::{Client, ResourceExt};
use tracing::{info, warn};

use super::cluster::{self, ClusterWrites, ErrorClass};
use super::identity::PluginIdentities;
use super::kinds::api_resource;
use super::leader::WriteFence;
use super::metrics::Metrics;
use super::shard::{Buckets, bucket_of};
use super::watch_client::watch_client;
use crate::contract::KindRef;

/// Finalizer the host puts on parents whose plugin asks for one.
pub const FINALIZER: &str = "capstan.dev/finalizer";

/// Set to `"true"` on a parent being deleted, it makes the host remove its finalizer
/// without running the plugin's `finalize` (whose cleanup then never happens): the way
/// out for a `finalize` that keeps failing, or a plugin that is gone.
pub const FORCE_RELEASE_ANNOTATION: &str = "capstan.dev/force-release-finalizer";

/// The label of `kind` in `capstan_orphaned_finalizers`: `Kind.group`, as claims go
/// by group and kind whatever the version.
pub fn kind_label(kind: &KindRef) -> String {
    if kind.group.is_empty() {
        kind.kind.clone()
    } else {
        format!("{}.{}", kind.kind, kind.group)
    }
}

/// How many parents one LIST page holds.
const PAGE: u32 = 500;
/// How soon parents held only because they are being deleted are looked at again (an
/// administrator may have let them go, or removed the finalizer by hand).
const HELD_RECHECK: Duration = Duration::from_secs(30);
/// First and longest wait after a pass that failed.
const MIN_RETRY: Duration = Duration::from_millis(500);
const MAX_RETRY: Duration = Duration::from_secs(60);

/// Which parents an administrator lets go without their `finalize`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ForceRelease {
    /// Kinds named by `--force-release-finalizers`: `Kind`, `Kind.group`, `plural` or
    /// `plural.group`, case-insensitive.
    kinds: Vec<String>,
}

impl ForceRelease {
    /// Lets go every parent of the named kinds.
    pub fn kinds(kinds: impl IntoIterator<Item = String>) -> Self {
        ForceRelease {
            kinds: kinds.into_iter().map(|k| k.to_ascii_lowercase()).collect(),
        }
    }

    /// Whether `parent`, of kind `kind`, being deleted, may lose the host's finalizer
    /// without `finalize`: it carries [`FORCE_RELEASE_ANNOTATION`], or its kind was named.
    pub fn applies(&self, kind: &KindRef, parent: &DynamicObject) -> bool {
        let annotated = parent
            .annotations()
            .get(FORCE_RELEASE_ANNOTATION)
            .is_some_and(|v| v == "true");
        annotated || self.names(kind)
    }

    fn names(&self, kind: &KindRef) -> bool {
        let dotted = |name: &str| {
            if kind.group.is_empty() {
                name.to_ascii_lowercase()
            } else {
                format!("{name}.{}", kind.group).to_ascii_lowercase()
            }
        };
        let names = [
            kind.kind.to_ascii_lowercase(),
            kind.plural.to_ascii_lowercase(),
            dotted(&kind.kind),
            dotted(&kind.plural),
        ];
        self.kinds.iter().any(|k| names.contains(k))
    }
}

/// What one pass over the parents did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Pass {
    /// Finalizers removed.
    pub released: usize,
    /// Parents being deleted that keep the finalizer (no force release for them).
    pub held: usize,
    /// Removals that failed (the parent changed meanwhile, the server failed).
    pub failed: usize,
    /// Whether every page was listed (else more parents may hold the finalizer).
    pub complete: bool,
}

impl Pass {
    /// Whether nothing is left to do.
    pub fn done(&self) -> bool {
        self.complete && self.failed == 0 && self.held == 0
    }

    /// Parents known to hold the finalizer still: exact after a complete pass, a lower
    /// bound (at least one) after an interrupted one.
    fn still_held(&self) -> usize {
        let known = self.held + self.failed;
        if self.complete { known } else { known + 1 }
    }
}

/// Where a [`FinalizerRelease`] looks and how it writes: the scope of the controllers
/// that served the kind.
#[derive(Debug, Clone, Default)]
pub struct ReleaseScope {
    /// Only this namespace (for a namespaced kind); none: every namespace.
    pub namespace: Option<String>,
    /// With `--shards`: only the parents of these buckets.
    pub shard: Option<Buckets>,
    /// The write fence of this replica's leadership.
    pub fence: WriteFence,
    /// Parents being deleted that an administrator lets go without `finalize`.
    pub force_release: ForceRelease,
    /// This replica's name in the events it posts.
    pub instance: Option<String>,
    /// With `--plugin-identities`: a gone plugin's finalizers are released as its own
    /// ServiceAccount, as its controller wrote them.
    pub identities: Option<PluginIdentities>,
}

/// The release of the host's finalizer from the parents of one kind whose plugin is gone.
pub struct FinalizerRelease {
    kind: KindRef,
    plugin: String,
    /// Lists the parents (only this replica's buckets with `--shards`).
    parents: Api<DynamicObject>,
    /// Removes the finalizers and posts events, through the write fence.
    writes: ClusterWrites,
    shard: Option<Buckets>,
    force: ForceRelease,
    metrics: Arc<Metrics>,
    /// Parents told (by a Warning event) why they keep the finalizer.
    warned: HashSet<String>,
    /// First and longest wait after a failed pass.
    retry: (Duration, Duration),
}

impl FinalizerRelease {
    /// A release of the parents of `kind` that plugin `plugin` no longer serves, in the
    /// controllers' scope (namespace, buckets), writing through their fence.
    pub fn new(
        client: Client,
        kind: &KindRef,
        plugin: &str,
        scope: &ReleaseScope,
        metrics: Arc<Metrics>,
    ) -> Self {
        let client = match &scope.identities {
            Some(identities) => identities.client_of(&client, plugin),
            None => client,
        };
        let shard = scope.shard;
        // The same shardSelector as the parent watch: the API server sends only this
        // replica's buckets (and the check below drops any other).
        let list_client = watch_client(
            &client,
            shard.and_then(Buckets::shard_selector),
            metrics.watch_bytes("finalizers"),
        );
        let ar = api_resource(kind);
        let parents = match (scope.namespace.as_deref(), kind.namespaced) {
            (Some(ns), true) => Api::namespaced_with(list_client, ns, &ar),
            _ => Api::all_with(list_client, &ar),
        };
        FinalizerRelease {
            kind: kind.clone(),
            plugin: plugin.to_string(),
            parents,
            writes: ClusterWrites::new(client, kind, plugin, scope.fence.clone())
                .reporting_as(scope.instance.as_deref()),
            shard,
            force: scope.force_release.clone(),
            metrics,
            warned: HashSet::new(),
            retry: (MIN_RETRY, MAX_RETRY),
        }
    }

    /// Passes over the parents until one leaves no finalizer behind: with backoff after
    /// a failed pass, every [`HELD_RECHECK`] while parents being deleted still hold it.
    /// Ends only when done, or when its task is aborted (the registry stops, or a plugin
    /// for this kind is loaded again).
    pub async fn run(mut self) {
        let label = kind_label(&self.kind);
        let mut retries = retry_delays(self.retry);
        let mut last = 0;
        loop {
            let pass = self.pass().await;
            let held = if pass.complete {
                pass.still_held()
            } else {
                pass.still_held().max(last)
            };
            last = held;
            self.metrics.set_orphaned_finalizers(&label, held as i64);
            if pass.done() {
                info!(plugin = %self.plugin, kind = %label, "every finalizer of the removed plugin released");
                return;
            }
            let wait = if pass.complete && pass.failed == 0 {
                retries = retry_delays(self.retry);
                HELD_RECHECK
            } else {
                retries.next().unwrap_or(self.retry.1)
            };
            tokio::time::sleep(wait).await;
        }
    }

    /// One pass over every page of parents. Stops early on an error that says the API
    /// server is unwell (5xx, timeouts); a parent changed meanwhile (409) is left for
    /// the next pass, with fresh data.
    pub async fn pass(&mut self) -> Pass {
        let mut pass = Pass::default();
        let mut params = ListParams::default().limit(PAGE);
        loop {
            let page = match tokio::time::timeout(cluster::API_TIMEOUT, self.parents.list(&params))
                .await
            {
                Ok(Ok(page)) => page,
                Ok(Err(e)) => {
                    warn!(plugin = %self.plugin, kind = %self.kind, "cannot list the parents to release their finalizers, will retry: {e}");
                    return pass;
                }
                Err(_) => {
                    warn!(plugin = %self.plugin, kind = %self.kind, "no answer listing the parents to release their finalizers, will retry");
                    return pass;
                }
            };
            for parent in &page.items {
                if !self.release(parent, &mut pass).await {
                    return pass;
                }
            }
            match page.metadata.continue_.as_deref() {
                Some(token) if !token.is_empty() => params = params.continue_token(token),
                _ => break,
            }
        }
        pass.complete = true;
        info!(plugin = %self.plugin, kind = %self.kind, released = pass.released, held = pass.held, failed = pass.failed, "finalizers of a removed plugin: one pass");
        pass
    }

    /// Releases one parent if it holds the finalizer; false if the pass should stop.
    async fn release(&mut self, parent: &DynamicObject, pass: &mut Pass) -> bool {
        let uid = parent.metadata.uid.as_deref().unwrap_or_default();
        let mine = self.shard.is_none_or(|b| b.contains(bucket_of(uid)));
        if !mine || !parent.finalizers().iter().any(|f| f == FINALIZER) {
            return true;
        }
        let deleting = parent.metadata.deletion_timestamp.is_some();
        let forced = deleting && self.force.applies(&self.kind, parent);
        if deleting && !forced {
            pass.held += 1;
            if self.warned.insert(uid.to_string()) {
                let message = format!(
                    "plugin {} was removed before this object was finalized; it stays until the plugin is loaded again, or until it is annotated {FORCE_RELEASE_ANNOTATION}=true (its cleanup then never runs)",
                    self.plugin
                );
                let event = crate::plan::warning("FinalizerPending", message);
                self.writes.publish(parent, &event).await;
            }
            return true;
        }
        match self.writes.remove_finalizer(parent, FINALIZER).await {
            Ok(_) => {
                pass.released += 1;
                if forced {
                    let event = crate::plan::warning(
                        "FinalizerForceReleased",
                        format!(
                            "{FINALIZER} removed without finalize: an administrator let this object go"
                        ),
                    );
                    self.writes.publish(parent, &event).await;
                }
                true
            }
            Err(e) => {
                pass.failed += 1;
                warn!(plugin = %self.plugin, parent = %parent.name_any(), "cannot release the finalizer, will retry: {e}");
                e.class() != ErrorClass::Transient
            }
        }
    }
}

/// `min`, twice that, four times … up to `max`, with jitter, for as long as it takes.
fn retry_delays((min, max): (Duration, Duration)) -> impl Iterator<Item = Duration> {
    super::retry::delays(min, max, true)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Mutex;

    use http::Method;
    use serde_json::{Value, json};

    use super::super::fake_api::{self, Call};
    use super::*;

    fn guard_kind() -> KindRef {
        KindRef {
            group: "test.capstan.dev".into(),
            version: "v1".into(),
            kind: "Guard".into(),
            plural: "guards".into(),
            namespaced: true,
        }
    }

    fn parent(name: &str, deleting: bool, annotations: Value) -> Value {
        let mut obj = json!({
            "apiVersion": "test.capstan.dev/v1", "kind": "Guard",
            "metadata": {"name": name, "namespace": "ns", "uid": format!("uid-{name}"),
                         "resourceVersion": "1", "finalizers": [FINALIZER, "other.io/keep"],
                         "annotations": annotations},
        });
        if deleting {
            obj["metadata"]["deletionTimestamp"] = json!("2026-12-04T00:00:00Z");
        }
        obj
    }

    fn list(items: Vec<Value>, next: Option<&str>) -> (u16, Value) {
        let mut metadata = json!({"resourceVersion": "9"});
        if let Some(token) = next {
            metadata["continue"] = json!(token);
        }
        (
            200,
            json!({"apiVersion": "test.capstan.dev/v1", "kind": "GuardList",
                   "metadata": metadata, "items": items}),
        )
    }

    /// A server of `parents` (by name) that serves LISTs in pages of two, applies
    /// finalizer patches, answers events, and first asks `fault` about every request.
    fn server(
        parents: Vec<Value>,
        fault: impl Fn(&Call) -> Option<(u16, Value)> + Send + Sync + 'static,
    ) -> (Client, fake_api::Calls, Arc<Mutex<BTreeMap<String, Value>>>) {
        let store: BTreeMap<String, Value> = parents
            .into_iter()
            .map(|p| (p["metadata"]["name"].as_str().unwrap().to_string(), p))
            .collect();
        let store = Arc::new(Mutex::new(store));
        let state = store.clone();
        let (client, calls) = fake_api::client(move |call: &Call| {
            if let Some(answer) = fault(call) {
                return answer;
            }
            let mut store = state.lock().unwrap();
            if call.path.contains("/events") {
                return (201, call.body.clone());
            }
            match call.method {
                Method::GET => {
                    let start: usize = call
                        .query
                        .split('&')
                        .find_map(|p| p.strip_prefix("continue="))
                        .map_or(0, |t| t.parse().unwrap());
                    let items: Vec<Value> = store.values().skip(start).take(2).cloned().collect();
                    let next = (start + 2 < store.len()).then(|| (start + 2).to_string());
                    list(items, next.as_deref())
                }
                Method::PATCH => {
                    let name = call.path.rsplit('/').next().unwrap().to_string();
                    let obj = store.get_mut(&name).unwrap();
                    obj["metadata"]["finalizers"] = call.body["metadata"]["finalizers"].clone();
                    (200, obj.clone())
                }
                _ => fake_api::status(405, "MethodNotAllowed", "unexpected"),
            }
        });
        (client, calls, store)
    }

    fn release(client: Client, shard: Option<Buckets>, metrics: Arc<Metrics>) -> FinalizerRelease {
        let scope = ReleaseScope {
            namespace: Some("ns".into()),
            shard,
            ..ReleaseScope::default()
        };
        FinalizerRelease::new(client, &guard_kind(), "guard", &scope, metrics)
    }

    fn holding(store: &Mutex<BTreeMap<String, Value>>) -> Vec<String> {
        store
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, p)| {
                p["metadata"]["finalizers"]
                    .as_array()
                    .unwrap()
                    .contains(&json!(FINALIZER))
            })
            .map(|(n, _)| n.clone())
            .collect()
    }

    #[tokio::test]
    async fn every_page_is_listed_and_every_parent_released() {
        let parents: Vec<Value> = (0..5)
            .map(|i| parent(&format!("p{i}"), false, json!({})))
            .collect();
        let (client, calls, store) = server(parents, |_| None);
        let metrics = Arc::new(Metrics::default());
        let pass = release(client, None, metrics).pass().await;
        assert_eq!(
            pass,
            Pass {
                released: 5,
                complete: true,
                ..Pass::default()
            }
        );
        assert!(holding(&store).is_empty());
        let lists: Vec<Call> = calls
            .all()
            .into_iter()
            .filter(|c| c.method == Method::GET)
            .collect();
        assert_eq!(lists.len(), 3, "three pages of two");
        assert!(lists.iter().all(|c| c.has_query("limit=500")));
        assert!(lists[1].has_query("continue=2") && lists[2].has_query("continue=4"));
        // Only ours goes: the other finalizer stays.
        let kept = store.lock().unwrap()["p0"]["metadata"]["finalizers"].clone();
        assert_eq!(kept, json!(["other.io/keep"]));
    }

    #[tokio::test]
    async fn conflicts_and_server_errors_mid_release_are_retried_until_every_parent_is_released() {
        let parents: Vec<Value> = (0..6)
            .map(|i| parent(&format!("p{i}"), false, json!({})))
            .collect();
        let requests = Arc::new(Mutex::new(0u32));
        let counter = requests.clone();
        let (client, calls, store) = server(parents, move |call: &Call| {
            let mut n = counter.lock().unwrap();
            *n += 1;
            match (*n, &call.method) {
                // The first removal raced a change; then the API server fails a page
                // and a removal, and is unreachable for a while.
                (2, &Method::PATCH) => Some(fake_api::status(409, "Conflict", "modified")),
                (4, &Method::GET) | (5..=7, _) => {
                    Some(fake_api::status(503, "ServiceUnavailable", "restarting"))
                }
                _ => None,
            }
        });
        let metrics = Arc::new(Metrics::default());
        let mut release = release(client, None, metrics.clone());
        release.retry = (Duration::from_millis(1), Duration::from_millis(10));
        release.run().await;
        assert!(holding(&store).is_empty(), "every parent let go");
        assert_eq!(
            metrics.orphaned_finalizers("Guard.test.capstan.dev"),
            Some(0)
        );
        let codes: Vec<String> = calls.summary();
        assert!(
            codes.len() > 9,
            "the faults were met and retried: {codes:?}"
        );
    }

    #[tokio::test]
    async fn only_the_parents_of_this_replicas_buckets_are_released() {
        let mine = Buckets::NONE.with(bucket_of("uid-a"));
        let other = (0..)
            .map(|i| format!("b{i}"))
            .find(|name| !mine.contains(bucket_of(&format!("uid-{name}"))))
            .unwrap();
        let (a, b) = (
            parent("a", false, json!({})),
            parent(&other, false, json!({})),
        );
        // The server ignores the selector and sends both.
        let (client, calls, store) = server(vec![a, b], |_| None);
        let metrics = Arc::new(Metrics::default());
        let pass = release(client, Some(mine), metrics).pass().await;
        assert_eq!(pass.released, 1);
        assert_eq!(holding(&store), [other]);
        let list = &calls.all()[0];
        assert!(
            list.query.contains("shardSelector=shardRange"),
            "the list asks for this replica's buckets: {}",
            list.query
        );
    }

    #[tokio::test]
    async fn parents_being_deleted_keep_the_finalizer_unless_let_go() {
        let parents = vec![
            parent("held", true, json!({})),
            parent("forced", true, json!({FORCE_RELEASE_ANNOTATION: "true"})),
            parent("live", false, json!({})),
        ];
        let (client, calls, store) = server(parents, |_| None);
        let metrics = Arc::new(Metrics::default());
        let mut release = release(client, None, metrics);
        let pass = release.pass().await;
        assert_eq!((pass.released, pass.held, pass.done()), (2, 1, false));
        assert_eq!(holding(&store), ["held"]);
        let events = |calls: &fake_api::Calls| {
            calls
                .all()
                .iter()
                .filter(|c| c.path.contains("/events"))
                .map(|c| c.body["reason"].as_str().unwrap_or_default().to_string())
                .collect::<Vec<_>>()
        };
        let mut reasons = events(&calls);
        reasons.sort();
        assert_eq!(reasons, ["FinalizerForceReleased", "FinalizerPending"]);
        // Told once, not at every pass.
        release.pass().await;
        assert_eq!(events(&calls).len(), 2);
    }

    #[test]
    fn a_kind_is_named_as_kubectl_names_it() {
        let p: DynamicObject = serde_json::from_value(parent("p", true, json!({}))).unwrap();
        for name in [
            "Guard",
            "guards",
            "guards.test.capstan.dev",
            "Guard.test.capstan.dev",
        ] {
            assert!(
                ForceRelease::kinds([name.to_string()]).applies(&guard_kind(), &p),
                "{name}"
            );
        }
        assert!(!ForceRelease::kinds(["widgets".to_string()]).applies(&guard_kind(), &p));
        assert!(!ForceRelease::default().applies(&guard_kind(), &p));
    }
}
