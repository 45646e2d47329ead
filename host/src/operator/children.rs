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
//! A cache lags the writes the host just made; [`super::freshness::Expectations`] keep
//! a reconcile from acting on a cache that has not yet seen them.
//!
//! A kind is watched while a running controller holds a [`KindWatch`] of it: the watch
//! stops when the last controller that declares the kind stops.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use futures::StreamExt;
use kube::api::{Api, ApiResource, DynamicObject, ListParams, Patch, PatchParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use super::identity::PluginIdentities;
use super::kinds::api_resource;
use super::metrics::Metrics;
use super::watch_client::watch_client;
use super::watch_pool::{Hold, WatchPool, reader};
use crate::contract::KindRef;
use crate::plan::{MANAGED_BY, MANAGED_BY_LABEL};
use crate::shard::{Buckets, SHARD_BUCKET_LABEL, bucket_of};

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

/// Every cache of the host, by child kind. A kind's cache starts with the first
/// [`KindWatch`] of it and stops with the last (one [`WatchPool`], as the related
/// caches keep theirs).
pub struct ChildCaches {
    client: Client,
    /// With `--plugin-identities`: each plugin's caches are its own, read as its
    /// ServiceAccount; none: one cache per kind for every plugin, read as the host.
    identities: Option<PluginIdentities>,
    namespace: Option<String>,
    /// With `--shards`: only the children of these buckets' parents.
    shard: Option<Buckets>,
    metrics: Arc<Metrics>,
    pool: WatchPool<KindCache>,
}

/// A controller's hold on the cache of one child kind: the kind is watched while any
/// of its `KindWatch`es lives.
pub type KindWatch = Hold<KindCache>;

impl ChildCaches {
    /// No cache yet; `namespace` limits namespaced kinds to one namespace, `shard` the
    /// children to those of its buckets' parents; with `identities`, every plugin reads
    /// its own children as itself.
    pub fn new(
        client: Client,
        namespace: Option<String>,
        shard: Option<Buckets>,
        metrics: Arc<Metrics>,
        identities: Option<PluginIdentities>,
    ) -> Self {
        ChildCaches {
            client: watch_client(&client, None, metrics.watch_bytes("children")),
            identities,
            namespace,
            shard,
            metrics,
            pool: WatchPool::new("child"),
        }
    }

    /// A hold on the cache of `kind` for `plugin`'s controller, whose watch starts if it
    /// is not running yet: the host's cache of the kind, or with `--plugin-identities`
    /// the plugin's own, read as its ServiceAccount.
    pub fn watch(&self, kind: &KindRef, plugin: &str) -> KindWatch {
        let (key, client) = reader(&self.client, self.identities.as_ref(), plugin, kind);
        self.pool.hold(key, || {
            KindCache::start(
                &client,
                kind,
                self.namespace.as_deref(),
                self.shard,
                self.metrics.clone(),
            )
        })
    }

    /// Whether every cache running completed its first list.
    pub fn all_synced(&self) -> bool {
        self.pool.all(|cache| *cache.synced.borrow())
    }

    /// The kinds watched now (`apiVersion/kind`), sorted.
    #[cfg(test)]
    pub(super) fn watched(&self) -> Vec<String> {
        self.pool.keys()
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
        // A consistent list (not resourceVersion=0, which the API server may answer from
        // an older cache): what was written before the list was asked for is in it, which
        // lets an expectation be met by a child's absence from a re-list.
        let config = watcher::Config::default()
            .labels(&labels)
            .list_semantic(watcher::ListSemantic::MostRecent);
        let name = kind.to_string();
        let fed = cache.clone();
        let legacy = shard.map(|buckets| (format!("{managed},!{SHARD_BUCKET_LABEL}"), buckets));
        let task = tokio::spawn(async move {
            if let Some((selector, buckets)) = legacy {
                label_legacy_children(&api, &selector, buckets, &name).await;
            }
            let mut events = watcher(api, config)
                .default_backoff()
                .modify(as_cached)
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
            // The list request is sent after this event is taken: whatever was written
            // before now is in it (the list is a consistent read, see `start`).
            watcher::Event::Init => *relist = Some(Index::listed(Instant::now())),
            watcher::Event::InitApply(obj) => {
                if let Some(next) = relist.as_mut() {
                    next.insert(with_type(obj, ar));
                }
            }
            watcher::Event::InitDone => {
                let Some(mut next) = relist.take() else {
                    return;
                };
                let mut index = self.index.write().expect("index lock");
                // After a re-list, what changed while the watch was down concerns
                // parents just as much as a watch event (the first list concerns none:
                // every parent is reconciled when its controller starts).
                if *self.synced.borrow() {
                    for owner in index.differences(&next) {
                        self.tell(owner);
                    }
                }
                next.keep_tombstones(&mut index);
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
            // By group and kind, not version: an owner reference may name any version
            // the parent's CRD serves (one written before the plugin moved to v1 names
            // v1alpha1), and it is the same parent.
            if group_of(&s.api_version) != group_of(&owner.api_version) || s.kind != owner.kind {
                return !s.changes.is_closed();
            }
            s.changes.send(owner.clone()).is_ok()
        });
    }
}

/// The group of an `apiVersion` (`db.example.com` of `db.example.com/v1`; `""` for the
/// core group's `v1`).
fn group_of(api_version: &str) -> &str {
    api_version.rsplit_once('/').map_or("", |(group, _)| group)
}

/// What the cache keeps of a watched object. A child is a parent's only if Capstan
/// wrote it ([`crate::ownership::written_by_capstan`]): an object that merely names a
/// parent in its owner references (anyone who may create one can, before the parent's
/// first reconcile) is kept out of every parent's children, so no plugin is shown it
/// and no prune touches it; a write of that name is then a conflict. Its managed
/// fields are dropped after that: nothing else reads them, and they are a good part of
/// an object's size.
fn as_cached(object: &mut DynamicObject) {
    if !crate::ownership::written_by_capstan(&object.metadata) {
        object.metadata.owner_references = None;
    }
    object.managed_fields_mut().clear();
}

/// A cache that a test feeds with watch events instead of a watch, each object kept as
/// a watch keeps it ([`as_cached`]).
#[cfg(test)]
pub(super) struct Feed {
    cache: Arc<KindCache>,
    relist: Option<Index>,
    ar: ApiResource,
}

#[cfg(test)]
impl Feed {
    /// An empty cache of `kind` that has not listed yet.
    pub(super) fn new(kind: &KindRef) -> Self {
        let (synced, _) = watch::channel(false);
        Feed {
            cache: Arc::new(KindCache {
                kind: kind.clone(),
                index: RwLock::new(Index::default()),
                synced,
                subscribers: Mutex::new(Vec::new()),
            }),
            relist: None,
            ar: api_resource(kind),
        }
    }

    /// The cache.
    pub(super) fn cache(&self) -> Arc<KindCache> {
        self.cache.clone()
    }

    /// How many objects the cache holds.
    pub(super) fn objects(&self) -> usize {
        self.cache.index.read().unwrap().objects.len()
    }

    /// Starts a (re-)list: what the cache holds stays until [`Feed::list_done`].
    pub(super) fn list_start(&mut self) {
        self.event(watcher::Event::Init);
    }

    /// Ends the list started with [`Feed::list_start`], which showed `objects`.
    pub(super) fn list_done(&mut self, objects: impl IntoIterator<Item = DynamicObject>) {
        for obj in objects {
            self.event(watcher::Event::InitApply(obj));
        }
        self.event(watcher::Event::InitDone);
    }

    /// A whole (re-)list that showed `objects`.
    pub(super) fn list(&mut self, objects: impl IntoIterator<Item = DynamicObject>) {
        self.list_start();
        self.list_done(objects);
    }

    /// A watch event: `obj` added or changed.
    pub(super) fn applied(&mut self, obj: DynamicObject) {
        self.event(watcher::Event::Apply(obj));
    }

    /// A watch event: `obj` deleted.
    pub(super) fn deleted(&mut self, obj: DynamicObject) {
        self.event(watcher::Event::Delete(obj));
    }

    fn event(&mut self, event: watcher::Event<DynamicObject>) {
        let event = event.modify(as_cached);
        self.cache.apply(event, &mut self.relist, &self.ar);
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
pub(super) fn with_type(mut obj: DynamicObject, ar: &ApiResource) -> DynamicObject {
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

pub(super) fn controller_uid(obj: &DynamicObject) -> Option<String> {
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
    /// When the list this index was built from was asked for (none: not listed).
    listed_at: Option<Instant>,
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
    /// No object: the cache listed the kind, with a list request started at
    /// `listed_at`, and has not seen it since. It did not exist then, or its deletion
    /// was not seen (made while the watch was down: a re-list has no tombstones).
    Unlisted {
        /// When the list the cache holds was asked for.
        listed_at: Instant,
    },
    /// Nothing known (the cache has not listed the kind yet).
    Absent,
}

impl Index {
    /// An empty index for a list asked for at `listed_at`.
    fn listed(listed_at: Instant) -> Self {
        Index {
            listed_at: Some(listed_at),
            ..Index::default()
        }
    }

    fn lookup(&self, key: &Key) -> Cached {
        match (self.objects.get(key), self.deleted.get(key), self.listed_at) {
            (Some(obj), _, _) => Cached::Present(obj.clone()),
            (None, Some(rv), _) => Cached::Deleted(rv.clone()),
            (None, None, Some(listed_at)) => Cached::Unlisted { listed_at },
            (None, None, None) => Cached::Absent,
        }
    }

    /// Takes over the tombstones of `old` (the index a re-list replaces) of objects the
    /// list does not show: they are still deleted, and their deletion's version says
    /// more than the list's absence.
    fn keep_tombstones(&mut self, old: &mut Index) {
        for (key, rv) in old.deleted.drain() {
            if !self.objects.contains_key(&key) && self.deleted.len() < MAX_TOMBSTONES {
                self.deleted.insert(key, rv);
            }
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

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::super::fake_api;
    use super::super::freshness::{CacheState, Expectations, Written};
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

    fn configmaps() -> KindRef {
        KindRef {
            group: String::new(),
            version: "v1".into(),
            kind: "ConfigMap".into(),
            plural: "configmaps".into(),
            namespaced: true,
        }
    }

    fn applied_a0_at(rv: &str) -> Written {
        Written {
            applied: vec![(0, key("a-0"), Some(rv.into()))],
            pruned: vec![],
        }
    }

    #[test]
    fn a_child_deleted_while_the_watch_was_down_meets_its_expectation_after_the_relist() {
        let limit = Duration::from_secs(30);
        let mut feed = Feed::new(&configmaps());
        let cache = feed.cache();
        let seen = |_: usize, k: &Key| cache.lookup(k);
        feed.list([cm("a-0", Some("uid-a"), "5")]);
        let expectations = Expectations::default();
        expectations.expect("uid-a", applied_a0_at("7"));
        assert_eq!(expectations.check("uid-a", seen, limit), CacheState::Behind);
        // The watch breaks; a-0 is deleted meanwhile, and the re-list does not show it.
        feed.list([cm("b-0", Some("uid-b"), "9")]);
        assert_eq!(
            expectations.check("uid-a", seen, limit),
            CacheState::Current,
            "a list made after the write shows its deletion by the absence of a-0"
        );
        // A re-list asked for before the write completed says nothing about it.
        feed.list_start();
        expectations.expect("uid-a", applied_a0_at("11"));
        feed.list_done([cm("b-0", Some("uid-b"), "9")]);
        assert_eq!(expectations.check("uid-a", seen, limit), CacheState::Behind);
        // A cache that has not listed yet knows nothing either.
        let unlisted = Feed::new(&configmaps()).cache();
        expectations.expect("uid-a", applied_a0_at("11"));
        assert_eq!(
            expectations.check("uid-a", |_, k| unlisted.lookup(k), limit),
            CacheState::Behind
        );
    }

    #[test]
    fn a_relist_keeps_the_tombstones_of_what_it_does_not_show() {
        let mut feed = Feed::new(&configmaps());
        let cache = feed.cache();
        feed.list([cm("a-0", Some("uid-a"), "5"), cm("b-0", Some("uid-b"), "6")]);
        feed.deleted(cm("a-0", Some("uid-a"), "8"));
        feed.deleted(cm("b-0", Some("uid-b"), "9"));
        // b-0 is re-created while the watch is down: the re-list shows it.
        feed.list([cm("b-0", Some("uid-b"), "12")]);
        assert!(matches!(cache.lookup(&key("a-0")), Cached::Deleted(Some(rv)) if rv == "8"));
        assert!(matches!(cache.lookup(&key("b-0")), Cached::Present(_)));
        assert!(matches!(cache.lookup(&key("c-0")), Cached::Unlisted { .. }));
    }

    fn caches(store: &fake_api::Store) -> (ChildCaches, fake_api::Calls) {
        let (client, calls) = store.client();
        let caches = ChildCaches::new(client, None, None, Arc::new(Metrics::default()), None);
        (caches, calls)
    }

    fn services() -> KindRef {
        KindRef {
            kind: "Service".into(),
            plural: "services".into(),
            ..configmaps()
        }
    }

    #[tokio::test]
    async fn a_kind_is_watched_while_a_controller_declares_it() {
        let store = fake_api::Store::new();
        let (caches, calls) = caches(&store);
        // Two plugins' controllers: one cache of the kind, read as the host.
        let first = caches.watch(&configmaps(), "a");
        let second = caches.watch(&configmaps(), "b");
        let service = caches.watch(&services(), "a");
        assert_eq!(caches.watched(), ["v1/ConfigMap", "v1/Service"]);
        assert!(
            Arc::ptr_eq(first.cache(), second.cache()),
            "one cache a kind"
        );
        assert!(first.cache().synced(Duration::from_secs(10)).await);
        // The list is a consistent read (no resourceVersion=0, which the API server
        // may answer from a cache older than the host's last write).
        let lists: Vec<_> = calls
            .all()
            .into_iter()
            .filter(|c| c.path == "/api/v1/configmaps" && !c.has_query("watch=true"))
            .collect();
        assert!(!lists.is_empty());
        assert!(
            lists.iter().all(|c| !c.has_query("resourceVersion=0")),
            "{:?}",
            lists.iter().map(|c| &c.query).collect::<Vec<_>>()
        );
        drop(first);
        assert_eq!(caches.watched(), ["v1/ConfigMap", "v1/Service"]);
        drop(second);
        assert_eq!(caches.watched(), ["v1/Service"]);
        drop(service);
        assert!(caches.watched().is_empty());
        // Watched again: a new watch, which lists again.
        let again = caches.watch(&configmaps(), "a");
        assert!(again.cache().synced(Duration::from_secs(10)).await);
        assert_eq!(caches.watched(), ["v1/ConfigMap"]);
        assert!(
            calls
                .all()
                .iter()
                .all(|c| !c.headers.contains_key("impersonate-user")),
            "the host's caches read as the host"
        );
    }

    #[tokio::test]
    async fn with_plugin_identities_each_plugin_reads_its_children_as_itself() {
        let store = fake_api::Store::new();
        let (client, calls) = store.client();
        let identities = PluginIdentities::new("capstan-system");
        let caches = ChildCaches::new(
            client,
            None,
            None,
            Arc::new(Metrics::default()),
            Some(identities.clone()),
        );
        let a = caches.watch(&configmaps(), "a");
        let b = caches.watch(&configmaps(), "b");
        assert_eq!(caches.watched(), ["a v1/ConfigMap", "b v1/ConfigMap"]);
        assert!(!Arc::ptr_eq(a.cache(), b.cache()), "no cache shared");
        assert!(a.cache().synced(Duration::from_secs(10)).await);
        assert!(b.cache().synced(Duration::from_secs(10)).await);
        let users: BTreeSet<String> = calls
            .all()
            .iter()
            .filter(|c| c.path == "/api/v1/configmaps")
            .map(|c| {
                c.headers
                    .get("impersonate-user")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("the host")
                    .to_string()
            })
            .collect();
        assert_eq!(
            users,
            BTreeSet::from([identities.user("a"), identities.user("b")]),
            "every list and watch of a plugin's children is made as that plugin"
        );
    }

    #[test]
    fn a_child_tells_its_parent_whatever_version_its_owner_reference_names() {
        let feed = Feed::new(&configmaps());
        let v1 = KindRef {
            group: "db.example.com".into(),
            version: "v1".into(),
            kind: "PostgreSQLCluster".into(),
            plural: "postgresqlclusters".into(),
            namespaced: true,
        };
        let mut changes = feed.cache().subscribe(&v1);
        let owner = |api_version: &str, kind: &str| ControllerRef {
            api_version: api_version.into(),
            kind: kind.into(),
            name: "pg".into(),
            namespace: Some("prod".into()),
        };
        feed.cache()
            .tell(owner("db.example.com/v1alpha1", "PostgreSQLCluster"));
        feed.cache()
            .tell(owner("other.example.com/v1", "PostgreSQLCluster"));
        feed.cache().tell(owner("db.example.com/v1", "Database"));
        feed.cache()
            .tell(owner("db.example.com/v1", "PostgreSQLCluster"));
        let told: Vec<String> = std::iter::from_fn(|| changes.try_recv().ok())
            .map(|c| c.api_version)
            .collect();
        assert_eq!(told, ["db.example.com/v1alpha1", "db.example.com/v1"]);
        assert_eq!(group_of("v1"), "");
    }
}
