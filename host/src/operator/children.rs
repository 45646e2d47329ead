//! Shared watch caches of the children: one watch per child kind for the whole host,
//! whichever plugins declare the kind, filtered by the API server to the objects Capstan
//! manages (label `app.kubernetes.io/managed-by=capstan`) and indexed by controller UID,
//! so that finding a parent's children costs O(its children) instead of a LIST of the
//! namespace per reconcile (which makes a sweep over N parents cost O(N²)).
//!
//! Each cache also tells the controllers which parents a change concerns: every applied
//! or deleted child is sent, as its controller reference, to the controllers of that
//! controller's kind. The channels are unbounded: they hold only what a controller has
//! not taken yet (a fixed ring per kind sized for bursts cost 2 MiB a kind whether used
//! or not), and a slow controller never misses a change.
//!
//! A cache lags the writes the host just made; [`Expectations`] keep a reconcile from
//! acting on a cache that has not yet seen them.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use futures::StreamExt;
use kube::api::{Api, ApiResource, DynamicObject, ListParams, Patch, PatchParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use super::cluster::api_resource;
use super::metrics::Metrics;
use crate::shard::{Buckets, SHARD_BUCKET_LABEL, bucket_of};
use super::watch_client::watch_client;
use crate::contract::KindRef;
use crate::plan::{MANAGED_BY, MANAGED_BY_LABEL};

/// (namespace, name) of a cached object.
pub type Key = (Option<String>, String);

/// The controller of a changed child: which parent to reconcile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControllerRef {
    /// `apiVersion` of the controller.
    pub api_version: String,
    /// Its kind.
    pub kind: String,
    /// Its name.
    pub name: String,
    /// The child's namespace (the controller's, for namespaced parents).
    pub namespace: Option<String>,
}

/// Every cache of the host, by child kind; a cache starts on first use.
pub struct ChildCaches {
    client: Client,
    namespace: Option<String>,
    /// With `--shards`: only the children of these buckets' parents.
    shard: Option<Buckets>,
    metrics: Arc<Metrics>,
    /// Each cache with the task that feeds it.
    kinds: Mutex<HashMap<String, FedCache>>,
}

/// A cache and the task that feeds it from its watch.
type FedCache = (Arc<KindCache>, JoinHandle<()>);

impl ChildCaches {
    /// No cache yet; `namespace` limits namespaced kinds to one namespace, `shard` the
    /// children to those of its buckets' parents.
    pub fn new(
        client: Client,
        namespace: Option<String>,
        shard: Option<Buckets>,
        metrics: Arc<Metrics>,
    ) -> Self {
        ChildCaches {
            client: watch_client(&client, None, metrics.watch_bytes("children")),
            namespace,
            shard,
            metrics,
            kinds: Mutex::new(HashMap::new()),
        }
    }

    /// The cache of `kind`, started if it is not running yet.
    pub fn get(&self, kind: &KindRef) -> Arc<KindCache> {
        let key = format!("{}/{}", kind.api_version(), kind.kind);
        let mut kinds = self.kinds.lock().expect("caches lock");
        kinds
            .entry(key)
            .or_insert_with(|| {
                KindCache::start(
                    &self.client,
                    kind,
                    self.namespace.as_deref(),
                    self.shard,
                    self.metrics.clone(),
                )
            })
            .0
            .clone()
    }
}

impl ChildCaches {
    /// Whether every cache started so far completed its first list.
    pub fn all_synced(&self) -> bool {
        self.kinds
            .lock()
            .expect("caches lock")
            .values()
            .all(|(c, _)| *c.synced.borrow())
    }
}

impl Drop for ChildCaches {
    fn drop(&mut self) {
        for (_, task) in self.kinds.lock().expect("caches lock").values() {
            task.abort();
        }
    }
}

/// The cache of one child kind.
pub struct KindCache {
    kind: KindRef,
    index: RwLock<Index>,
    synced: watch::Sender<bool>,
    subscribers: Mutex<Vec<Subscriber>>,
}

/// A controller told of the changes of children whose controller is of its kind.
struct Subscriber {
    api_version: String,
    kind: String,
    changes: mpsc::UnboundedSender<ControllerRef>,
}

impl KindCache {
    /// The cache of `kind` and the task that feeds it from a watch.
    fn start(
        client: &Client,
        kind: &KindRef,
        namespace: Option<&str>,
        shard: Option<Buckets>,
        metrics: Arc<Metrics>,
    ) -> (Arc<Self>, JoinHandle<()>) {
        let ar = api_resource(kind);
        let api: Api<DynamicObject> = match (namespace, kind.namespaced) {
            (Some(ns), true) => Api::namespaced_with(client.clone(), ns, &ar),
            _ => Api::all_with(client.clone(), &ar),
        };
        let (synced, _) = watch::channel(false);
        let cache = Arc::new(KindCache {
            kind: kind.clone(),
            index: RwLock::new(Index::default()),
            synced,
            subscribers: Mutex::new(Vec::new()),
        });
        let managed = format!("{MANAGED_BY_LABEL}={MANAGED_BY}");
        let labels = match shard {
            Some(buckets) => buckets.child_label_selector(&managed),
            None => managed.clone(),
        };
        let config = watcher::Config::default().labels(&labels);
        let name = kind.to_string();
        let fed = cache.clone();
        let legacy = shard.map(|buckets| (format!("{managed},!{SHARD_BUCKET_LABEL}"), buckets));
        let task = tokio::spawn(async move {
            if let Some((selector, buckets)) = legacy {
                label_legacy_children(&api, &selector, buckets, &name).await;
            }
            let mut events = watcher(api, config)
                .default_backoff()
                .modify(|o: &mut DynamicObject| o.managed_fields_mut().clear())
                .boxed();
            let mut relist: Option<Index> = None;
            while let Some(event) = events.next().await {
                match event {
                    Ok(event) => fed.apply(event, &mut relist, &ar),
                    Err(e) => {
                        let code = watch_error_code(&e);
                        tracing::warn!(kind = %name, code, "watch of {name} failed: {e}");
                        metrics.watch_failed(&name, code);
                    }
                }
            }
        });
        (cache, task)
    }

    fn apply(
        &self,
        event: watcher::Event<DynamicObject>,
        relist: &mut Option<Index>,
        ar: &ApiResource,
    ) {
        match event {
            watcher::Event::Init => *relist = Some(Index::default()),
            watcher::Event::InitApply(obj) => {
                if let Some(next) = relist.as_mut() {
                    next.insert(with_type(obj, ar));
                }
            }
            watcher::Event::InitDone => {
                let Some(next) = relist.take() else { return };
                let mut index = self.index.write().expect("index lock");
                // After a re-list, what changed while the watch was down concerns
                // parents just as much as a watch event (the first list concerns none:
                // every parent is reconciled when its controller starts).
                if *self.synced.borrow() {
                    for owner in index.differences(&next) {
                        self.tell(owner);
                    }
                }
                *index = next;
                drop(index);
                self.synced.send_replace(true);
            }
            watcher::Event::Apply(obj) => {
                let owner = controller_of(&obj);
                self.index
                    .write()
                    .expect("index lock")
                    .insert(with_type(obj, ar));
                if let Some(owner) = owner {
                    self.tell(owner);
                }
            }
            watcher::Event::Delete(obj) => {
                let owner = controller_of(&obj);
                self.index.write().expect("index lock").delete(&obj);
                if let Some(owner) = owner {
                    self.tell(owner);
                }
            }
        }
    }

    /// The kind cached.
    pub fn kind(&self) -> &KindRef {
        &self.kind
    }

    /// Waits until the first list is complete, at most `timeout`; whether it is.
    pub async fn synced(&self, timeout: Duration) -> bool {
        let mut rx = self.synced.subscribe();
        tokio::time::timeout(timeout, rx.wait_for(|s| *s))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// The cached objects whose controller reference carries `uid`, in `namespace`.
    pub fn children_of(&self, uid: &str, namespace: Option<&str>) -> Vec<Arc<DynamicObject>> {
        self.index
            .read()
            .expect("index lock")
            .children_of(uid)
            .filter(|o| !self.kind.namespaced || o.metadata.namespace.as_deref() == namespace)
            .collect()
    }

    /// What the cache shows at `key`: the object, its deletion, or nothing.
    pub fn lookup(&self, key: &Key) -> Cached {
        self.index.read().expect("index lock").lookup(key)
    }

    /// From now on, the changes of children whose controller is of kind `parent`; the
    /// channel closes when the cache stops.
    pub fn subscribe(&self, parent: &KindRef) -> mpsc::UnboundedReceiver<ControllerRef> {
        let (changes, rx) = mpsc::unbounded_channel();
        self.subscribers
            .lock()
            .expect("subscribers lock")
            .push(Subscriber {
                api_version: parent.api_version(),
                kind: parent.kind.clone(),
                changes,
            });
        rx
    }

    /// Sends `owner` to the controllers of its kind, and forgets controllers that stopped.
    fn tell(&self, owner: ControllerRef) {
        let mut subscribers = self.subscribers.lock().expect("subscribers lock");
        subscribers.retain(|s| {
            if s.api_version != owner.api_version || s.kind != owner.kind {
                return !s.changes.is_closed();
            }
            s.changes.send(owner.clone()).is_ok()
        });
    }
}

/// Gives the children of `buckets`' parents that a version before sharding applied
/// (managed, without [`SHARD_BUCKET_LABEL`]) their bucket label, so that the sharded
/// watch shows them: else their parent's reconcile would take them for absent. Each
/// replica labels the children of its own buckets, once, before its watch starts; the
/// label is a pure function of the controller's UID, so two replicas writing it agree.
async fn label_legacy_children(
    api: &Api<DynamicObject>,
    selector: &str,
    buckets: Buckets,
    kind: &str,
) {
    let legacy = loop {
        match api.list(&ListParams::default().labels(selector)).await {
            Ok(list) => break list.items,
            Err(e) => {
                tracing::warn!(%kind, "cannot list the children without a shard label: {e}");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    };
    for child in legacy {
        let Some(uid) = controller_uid(&child) else {
            continue;
        };
        let bucket = bucket_of(&uid);
        if !buckets.contains(bucket) {
            continue;
        }
        let patch = serde_json::json!({
            "metadata": { "labels": { SHARD_BUCKET_LABEL: bucket.to_string() } }
        });
        let name = child.name_any();
        match api
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => {
                tracing::info!(%kind, %name, bucket, "labelled a child applied before sharding")
            }
            Err(e) => {
                tracing::warn!(%kind, %name, "cannot label a child applied before sharding: {e}")
            }
        }
    }
}

/// The watch's error's HTTP status, if the API server answered.
fn watch_error_code(e: &watcher::Error) -> Option<u16> {
    match e {
        watcher::Error::InitialListFailed(kube::Error::Api(s))
        | watcher::Error::WatchStartFailed(kube::Error::Api(s))
        | watcher::Error::WatchFailed(kube::Error::Api(s)) => Some(s.code),
        watcher::Error::WatchError(s) => Some(s.code),
        _ => None,
    }
}

/// Watch events of dynamic objects lack `apiVersion` and `kind` only when the server
/// omits them; a plugin always sees both.
fn with_type(mut obj: DynamicObject, ar: &ApiResource) -> DynamicObject {
    if obj.types.is_none() {
        obj.types = Some(kube::api::TypeMeta {
            api_version: ar.api_version.clone(),
            kind: ar.kind.clone(),
        });
    }
    obj
}

/// (namespace, name) of `obj`.
pub fn key_of(obj: &DynamicObject) -> Key {
    (obj.metadata.namespace.clone(), obj.name_any())
}

/// The controller ownerReference of `obj`, if any.
fn controller_of(obj: &DynamicObject) -> Option<ControllerRef> {
    obj.metadata
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true))
        .map(|o| ControllerRef {
            api_version: o.api_version.clone(),
            kind: o.kind.clone(),
            name: o.name.clone(),
            namespace: obj.metadata.namespace.clone(),
        })
}

fn controller_uid(obj: &DynamicObject) -> Option<String> {
    obj.metadata
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true))
        .map(|o| o.uid.clone())
}

/// Objects by key, and the keys of each controller UID's objects.
#[derive(Default)]
struct Index {
    objects: HashMap<Key, Arc<DynamicObject>>,
    by_controller: HashMap<String, HashSet<Key>>,
    /// Objects seen deleted (and not seen again), with the deletion's resourceVersion:
    /// a write that the object's deletion followed is shown by the cache too.
    deleted: HashMap<Key, Option<String>>,
}

/// Tombstones kept at most; past that they are dropped, and an expectation on a
/// deleted object waits for its limit instead.
const MAX_TOMBSTONES: usize = 10_000;

/// What a cache shows at one key.
#[derive(Debug, Clone)]
pub enum Cached {
    /// The object, as last seen.
    Present(Arc<DynamicObject>),
    /// Its deletion, at this resourceVersion.
    Deleted(Option<String>),
    /// Nothing known.
    Absent,
}

impl Index {
    fn lookup(&self, key: &Key) -> Cached {
        match (self.objects.get(key), self.deleted.get(key)) {
            (Some(obj), _) => Cached::Present(obj.clone()),
            (None, Some(rv)) => Cached::Deleted(rv.clone()),
            (None, None) => Cached::Absent,
        }
    }

    /// Removes a deleted object and remembers its deletion.
    fn delete(&mut self, obj: &DynamicObject) {
        let key = key_of(obj);
        self.remove(&key);
        if self.deleted.len() >= MAX_TOMBSTONES {
            self.deleted.clear();
        }
        self.deleted
            .insert(key, obj.metadata.resource_version.clone());
    }

    fn insert(&mut self, obj: DynamicObject) {
        let key = key_of(&obj);
        self.remove(&key);
        self.deleted.remove(&key);
        if let Some(uid) = controller_uid(&obj) {
            self.by_controller
                .entry(uid)
                .or_default()
                .insert(key.clone());
        }
        self.objects.insert(key, Arc::new(obj));
    }

    fn remove(&mut self, key: &Key) {
        let Some(old) = self.objects.remove(key) else {
            return;
        };
        if let Some(uid) = controller_uid(&old)
            && let Some(keys) = self.by_controller.get_mut(&uid)
        {
            keys.remove(key);
            if keys.is_empty() {
                self.by_controller.remove(&uid);
            }
        }
    }

    fn children_of<'a>(&'a self, uid: &str) -> impl Iterator<Item = Arc<DynamicObject>> + 'a {
        self.by_controller
            .get(uid)
            .into_iter()
            .flatten()
            .filter_map(|key| self.objects.get(key).cloned())
    }

    /// Controllers of the objects that differ between `self` and `next` (added,
    /// removed, or at another resourceVersion).
    fn differences(&self, next: &Index) -> Vec<ControllerRef> {
        let changed = |a: &Index, b: &Index| -> Vec<ControllerRef> {
            a.objects
                .iter()
                .filter(|(key, obj)| {
                    b.objects.get(*key).is_none_or(|other| {
                        other.metadata.resource_version != obj.metadata.resource_version
                    })
                })
                .filter_map(|(_, obj)| controller_of(obj))
                .collect()
        };
        let mut out = changed(next, self);
        out.extend(changed(self, next));
        out
    }
}

/// What the host wrote for one parent, which the caches must show before the parent's
/// next reconcile may trust them (controller-runtime's "expectations").
#[derive(Debug, Clone, Default)]
pub struct Written {
    /// Children applied: (kind index, key, resourceVersion returned by the write).
    pub applied: Vec<(usize, Key, Option<String>)>,
    /// Children pruned: (kind index, key, UID deleted).
    pub pruned: Vec<(usize, Key, Option<String>)>,
}

impl Written {
    /// Whether nothing was written.
    pub fn is_empty(&self) -> bool {
        self.applied.is_empty() && self.pruned.is_empty()
    }
}

/// Per parent UID, the writes the caches have not shown yet.
#[derive(Default)]
pub struct Expectations {
    pending: Mutex<HashMap<String, (Written, Instant)>>,
}

/// Whether a parent's caches caught up with what was written for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheState {
    /// Nothing pending: the caches can be trusted.
    Current,
    /// Some writes are not in the caches yet: wait.
    Behind,
    /// Waited longer than the limit: trust the caches anyway (logged).
    GaveUp,
}

impl Expectations {
    /// Records what was written for the parent `uid` (nothing: forgets it).
    pub fn expect(&self, uid: &str, written: Written) {
        let mut pending = self.pending.lock().expect("expectations lock");
        if written.is_empty() {
            pending.remove(uid);
        } else {
            pending.insert(uid.to_string(), (written, Instant::now()));
        }
    }

    /// Forgets the parent `uid` (deleted).
    pub fn forget(&self, uid: &str) {
        self.pending.lock().expect("expectations lock").remove(uid);
    }

    /// Whether the caches show everything written for `uid` (`seen` looks a key up by
    /// kind index); waits at most `limit` from the write. An applied child is shown by
    /// its written version or a later one, or by a deletion after the write (deleted by
    /// hand or by someone else: waiting for the written version would wait forever).
    pub fn check(
        &self,
        uid: &str,
        seen: impl Fn(usize, &Key) -> Cached,
        limit: Duration,
    ) -> CacheState {
        let mut pending = self.pending.lock().expect("expectations lock");
        let Some((written, since)) = pending.get(uid) else {
            return CacheState::Current;
        };
        let applied = written
            .applied
            .iter()
            .all(|(index, key, rv)| match seen(*index, key) {
                Cached::Present(obj) => {
                    is_at_least(obj.metadata.resource_version.as_deref(), rv.as_deref())
                }
                Cached::Deleted(at) => is_at_least(at.as_deref(), rv.as_deref()),
                Cached::Absent => false,
            });
        let pruned = written
            .pruned
            .iter()
            .all(|(index, key, uid)| match seen(*index, key) {
                Cached::Present(obj) => obj.metadata.uid != *uid,
                Cached::Deleted(_) | Cached::Absent => true,
            });
        if applied && pruned {
            pending.remove(uid);
            CacheState::Current
        } else if since.elapsed() > limit {
            pending.remove(uid);
            CacheState::GaveUp
        } else {
            CacheState::Behind
        }
    }
}

/// Whether the cached resourceVersion `have` is the written one `want` or a later one.
/// resourceVersions are opaque to clients, but the API server's are etcd revisions:
/// compared as numbers when both are, else only equality counts.
pub fn is_at_least(have: Option<&str>, want: Option<&str>) -> bool {
    match (have, want) {
        (_, None) => true,
        (None, Some(_)) => false,
        (Some(h), Some(w)) => match (h.parse::<u64>(), w.parse::<u64>()) {
            (Ok(h), Ok(w)) => h >= w,
            _ => h == w,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn cm(name: &str, controller: Option<&str>, rv: &str) -> DynamicObject {
        let owners = controller.map(|uid| {
            json!([{"apiVersion": "test.capstan.dev/v1", "kind": "Widget", "name": "w",
                    "uid": uid, "controller": true}])
        });
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": "ns", "uid": format!("uid-{name}"),
                         "resourceVersion": rv, "ownerReferences": owners},
        }))
        .unwrap()
    }

    fn key(name: &str) -> Key {
        (Some("ns".into()), name.into())
    }

    fn names(objs: impl Iterator<Item = Arc<DynamicObject>>) -> Vec<String> {
        let mut n: Vec<String> = objs.map(|o| o.name_any()).collect();
        n.sort();
        n
    }

    #[test]
    fn the_index_finds_a_parents_children_by_controller_uid() {
        let mut index = Index::default();
        index.insert(cm("a-0", Some("uid-a"), "1"));
        index.insert(cm("a-1", Some("uid-a"), "2"));
        index.insert(cm("b-0", Some("uid-b"), "3"));
        index.insert(cm("loose", None, "4"));
        assert_eq!(names(index.children_of("uid-a")), ["a-0", "a-1"]);
        assert_eq!(names(index.children_of("uid-b")), ["b-0"]);
        // A child handed to another controller moves; a deleted one leaves.
        index.insert(cm("a-1", Some("uid-b"), "5"));
        assert_eq!(names(index.children_of("uid-a")), ["a-0"]);
        assert_eq!(names(index.children_of("uid-b")), ["a-1", "b-0"]);
        index.remove(&key("a-0"));
        assert!(index.children_of("uid-a").next().is_none());
        assert!(
            !index.by_controller.contains_key("uid-a"),
            "no empty sets left behind"
        );
    }

    #[test]
    fn a_relist_reports_the_parents_of_what_changed_meanwhile() {
        let mut before = Index::default();
        before.insert(cm("a-0", Some("uid-a"), "1"));
        before.insert(cm("b-0", Some("uid-b"), "2"));
        before.insert(cm("c-0", Some("uid-c"), "3"));
        let mut after = Index::default();
        after.insert(cm("a-0", Some("uid-a"), "1")); // unchanged
        after.insert(cm("b-0", Some("uid-b"), "9")); // edited
        after.insert(cm("d-0", Some("uid-d"), "4")); // added; c-0 deleted
        let mut owners: Vec<String> = before
            .differences(&after)
            .into_iter()
            .map(|o| o.name)
            .collect();
        owners.sort();
        owners.dedup();
        assert_eq!(
            owners.len(),
            1,
            "all four children name parent w: {owners:?}"
        );
        assert_eq!(
            before.differences(&after).len(),
            4,
            "b edited counted twice, c, d"
        );
    }

    #[test]
    fn expectations_hold_until_the_cache_shows_every_write() {
        let expectations = Expectations::default();
        let limit = Duration::from_secs(30);
        let mut cache = Index::default();
        let lookup = |index: &Index| {
            let shown: HashMap<Key, Cached> = index
                .objects
                .keys()
                .chain(index.deleted.keys())
                .map(|k| (k.clone(), index.lookup(k)))
                .collect();
            move |_: usize, key: &Key| shown.get(key).cloned().unwrap_or(Cached::Absent)
        };
        assert_eq!(
            expectations.check("uid-a", lookup(&cache), limit),
            CacheState::Current
        );
        cache.insert(cm("a-1", Some("uid-a"), "5"));
        expectations.expect(
            "uid-a",
            Written {
                applied: vec![(0, key("a-0"), Some("7".into()))],
                pruned: vec![(0, key("a-1"), Some("uid-a-1".into()))],
            },
        );
        // Neither the new child nor the deletion is in the cache yet.
        assert_eq!(
            expectations.check("uid-a", lookup(&cache), limit),
            CacheState::Behind
        );
        cache.insert(cm("a-0", Some("uid-a"), "6"));
        assert_eq!(
            expectations.check("uid-a", lookup(&cache), limit),
            CacheState::Behind,
            "an older version"
        );
        cache.insert(cm("a-0", Some("uid-a"), "7"));
        assert_eq!(
            expectations.check("uid-a", lookup(&cache), limit),
            CacheState::Behind,
            "a-1 still there"
        );
        cache.remove(&key("a-1"));
        assert_eq!(
            expectations.check("uid-a", lookup(&cache), limit),
            CacheState::Current
        );
        // Once met, forgotten: the next check does not look again.
        assert_eq!(
            expectations.check("uid-a", |_, _| Cached::Absent, limit),
            CacheState::Current
        );
        // A cache that never catches up is trusted again after the limit.
        expectations.expect(
            "uid-b",
            Written {
                applied: vec![(0, key("b-0"), Some("1".into()))],
                pruned: vec![],
            },
        );
        assert_eq!(
            expectations.check("uid-b", |_, _| Cached::Absent, Duration::ZERO),
            CacheState::GaveUp
        );
        assert_eq!(
            expectations.check("uid-b", |_, _| Cached::Absent, limit),
            CacheState::Current
        );
    }

    #[test]
    fn a_child_deleted_after_the_write_meets_its_expectation() {
        let expectations = Expectations::default();
        let limit = Duration::from_secs(30);
        let mut cache = Index::default();
        cache.insert(cm("a-0", Some("uid-a"), "5"));
        expectations.expect(
            "uid-a",
            Written {
                applied: vec![(0, key("a-0"), Some("7".into()))],
                pruned: vec![],
            },
        );
        // Deleted (by hand) before the watch showed the write: an older deletion...
        let mut gone = cm("a-0", Some("uid-a"), "6");
        cache.delete(&gone);
        assert_eq!(
            expectations.check("uid-a", |_, k| cache.lookup(k), limit),
            CacheState::Behind,
            "a deletion before the write says nothing about it"
        );
        // ...and one after it: the cache is current, the child is re-created at once.
        gone.metadata.resource_version = Some("8".into());
        cache.delete(&gone);
        assert_eq!(
            expectations.check("uid-a", |_, k| cache.lookup(k), limit),
            CacheState::Current
        );
        // Seen again: no tombstone.
        cache.insert(cm("a-0", Some("uid-a"), "9"));
        assert!(matches!(cache.lookup(&key("a-0")), Cached::Present(_)));
    }

    #[test]
    fn resource_versions_compare_as_revisions() {
        assert!(is_at_least(Some("12"), Some("9")));
        assert!(is_at_least(Some("9"), Some("9")));
        assert!(!is_at_least(Some("8"), Some("9")));
        assert!(!is_at_least(None, Some("9")));
        assert!(is_at_least(Some("x"), Some("x")));
        assert!(!is_at_least(Some("y"), Some("x")));
        assert!(is_at_least(None, None));
    }
}
