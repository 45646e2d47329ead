//! Shared watch caches of the related kinds (contract 0.2.0): objects a plugin reads but
//! never writes, such as a ConfigMap its parent names or the Pods of its StatefulSet.
//!
//! One watch per related kind for the whole host, whichever plugins declare it, with
//! `managedFields` stripped. Unlike the child caches, a related cache is not filtered by
//! label (the objects are the user's or another controller's), so a kind is only watched
//! while a loaded plugin declares it: Secrets are cached only when a plugin declares
//! them related.
//!
//! **Who needs what.** Before each reconcile, `customize` tells which related objects one
//! parent needs (by name, or by labels in its namespace); the host records that in the
//! cache's [`Interests`] and reads the objects from the cache's [`Objects`]. When an
//! object changes, the interests tell which parents it concerns, through indexes (by
//! name, by each label pair, by namespace for "every object"), so that an event costs
//! O(parents it concerns), never a scan of every parent. Those parents are sent to
//! their controller, which reconciles them.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use futures::StreamExt;
use kube::api::{Api, ApiResource, DynamicObject};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use super::identity::PluginIdentities;
use super::kinds::api_resource;
use super::metrics::Metrics;
use super::watch_client::watch_client;
use super::watch_pool::{Hold, WatchPool, reader};
use crate::contract::{KindRef, Selector};

/// (namespace, name) of an object.
pub type Key = (Option<String>, String);

/// A parent that asked for related objects: the subscriber (one per controller and
/// kind) it belongs to, and its (namespace, name).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Interested {
    /// The controller's subscription.
    pub subscriber: u64,
    /// The parent.
    pub parent: Key,
}

/// Every related cache of the host, by kind, in one [`WatchPool`]: a kind's cache
/// starts with the first [`RelatedWatch`] of it and stops with the last.
pub struct RelatedCaches {
    client: Client,
    /// With `--plugin-identities`: each plugin's caches are its own, read as its
    /// ServiceAccount; none: one cache per kind (and label selector) for every plugin,
    /// read as the host.
    identities: Option<PluginIdentities>,
    namespace: Option<String>,
    metrics: Arc<Metrics>,
    pool: WatchPool<RelatedCache>,
}

/// A controller's hold on the cache of one related kind: the kind is watched while any
/// of its `RelatedWatch`es lives. Dropping it forgets what its parents asked for.
pub struct RelatedWatch {
    /// Dropped after the subscription is ended ([`Drop`] runs before the fields').
    hold: Hold<RelatedCache>,
    subscriber: u64,
}

impl RelatedWatch {
    /// The cache.
    pub fn cache(&self) -> &Arc<RelatedCache> {
        self.hold.cache()
    }

    /// This controller's subscription to the cache.
    pub fn subscriber(&self) -> u64 {
        self.subscriber
    }
}

impl Drop for RelatedWatch {
    fn drop(&mut self) {
        self.hold.cache().unsubscribe(self.subscriber);
    }
}

impl RelatedCaches {
    /// No cache yet; `namespace` limits namespaced kinds to one namespace; with
    /// `identities`, every plugin reads its related objects as itself.
    pub fn new(
        client: Client,
        namespace: Option<String>,
        metrics: Arc<Metrics>,
        identities: Option<PluginIdentities>,
    ) -> Self {
        RelatedCaches {
            client: watch_client(&client, None, metrics.watch_bytes("related")),
            identities,
            namespace,
            metrics,
            pool: WatchPool::new("related"),
        }
    }

    /// A hold on the cache of `kind` for `plugin`'s controller (its watch starts if it
    /// is not running yet), with a subscription: the parents this subscription's
    /// interests concern are sent to `changes` when a related object changes.
    ///
    /// With `labels` (what a grant of Secrets allows), the API server sends only the
    /// objects that carry them: the host holds no Secret that no grant names. The
    /// cache is the host's for every plugin with the same labels, or with
    /// `--plugin-identities` the plugin's own, read as its ServiceAccount.
    pub fn watch(
        &self,
        kind: &KindRef,
        plugin: &str,
        labels: Option<&BTreeMap<String, String>>,
        changes: mpsc::UnboundedSender<Key>,
    ) -> RelatedWatch {
        let (key, client) = reader(&self.client, self.identities.as_ref(), plugin, kind);
        let selector = labels.map(|labels| {
            labels
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(",")
        });
        let key = match &selector {
            Some(selector) => format!("{key} {{{selector}}}"),
            None => key,
        };
        let hold = self.pool.hold(key, || {
            RelatedCache::start(
                &client,
                kind,
                self.namespace.as_deref(),
                selector.as_deref(),
                self.metrics.clone(),
            )
        });
        let subscriber = hold.cache().subscribe(changes);
        RelatedWatch { hold, subscriber }
    }

    /// The caches running now (`apiVersion/kind`, with their label selector), sorted.
    #[cfg(test)]
    pub(super) fn watched(&self) -> Vec<String> {
        self.pool.keys()
    }
}

/// The cache of one related kind: its objects, who needs which, and where to tell them.
pub struct RelatedCache {
    kind: KindRef,
    objects: RwLock<Objects>,
    interests: Mutex<Interests>,
    synced: watch::Sender<bool>,
    subscribers: Mutex<HashMap<u64, mpsc::UnboundedSender<Key>>>,
}

/// Subscriptions are numbered host-wide.
static NEXT_SUBSCRIBER: AtomicU64 = AtomicU64::new(1);

impl RelatedCache {
    fn new(kind: &KindRef) -> Self {
        let (synced, _) = watch::channel(false);
        RelatedCache {
            kind: kind.clone(),
            objects: RwLock::new(Objects::default()),
            interests: Mutex::new(Interests::default()),
            synced,
            subscribers: Mutex::new(HashMap::new()),
        }
    }

    fn start(
        client: &Client,
        kind: &KindRef,
        namespace: Option<&str>,
        selector: Option<&str>,
        metrics: Arc<Metrics>,
    ) -> (Arc<Self>, JoinHandle<()>) {
        let ar = api_resource(kind);
        let api: Api<DynamicObject> = match (namespace, kind.namespaced) {
            (Some(ns), true) => Api::namespaced_with(client.clone(), ns, &ar),
            _ => Api::all_with(client.clone(), &ar),
        };
        let cache = Arc::new(RelatedCache::new(kind));
        let fed = cache.clone();
        let name = kind.to_string();
        let config = match selector {
            Some(selector) => watcher::Config::default().labels(selector),
            None => watcher::Config::default(),
        };
        let task = tokio::spawn(async move {
            let mut events = watcher(api, config)
                .default_backoff()
                .modify(|o: &mut DynamicObject| o.managed_fields_mut().clear())
                .boxed();
            let mut relist: Option<Objects> = None;
            while let Some(event) = events.next().await {
                match event {
                    Ok(event) => fed.apply(event, &mut relist, &ar),
                    Err(e) => {
                        tracing::warn!(kind = %name, "watch of related {name} failed: {e}");
                        metrics.watch_failed(&name, None);
                    }
                }
            }
        });
        (cache, task)
    }

    fn apply(
        &self,
        event: watcher::Event<DynamicObject>,
        relist: &mut Option<Objects>,
        ar: &ApiResource,
    ) {
        match event {
            watcher::Event::Init => *relist = Some(Objects::default()),
            watcher::Event::InitApply(obj) => {
                if let Some(next) = relist.as_mut() {
                    next.insert(with_type(obj, ar));
                }
            }
            watcher::Event::InitDone => {
                let Some(next) = relist.take() else {
                    return;
                };
                let mut objects = self.objects.write().expect("related objects lock");
                // After a re-list, what changed while the watch was down concerns the
                // parents as much as a watch event (the first list concerns none: every
                // parent is reconciled when its controller starts).
                let changed = if *self.synced.borrow() {
                    objects.differences(&next)
                } else {
                    Vec::new()
                };
                *objects = next;
                drop(objects);
                self.synced.send_replace(true);
                for obj in changed {
                    self.tell(&obj);
                }
            }
            watcher::Event::Apply(obj) => {
                let obj = Arc::new(with_type(obj, ar));
                let old = self
                    .objects
                    .write()
                    .expect("related objects lock")
                    .insert_arc(obj.clone());
                // A parent that selected the object by its old labels must see it go.
                if let Some(old) = old {
                    self.tell(&old);
                }
                self.tell(&obj);
            }
            watcher::Event::Delete(obj) => {
                let old = self
                    .objects
                    .write()
                    .expect("related objects lock")
                    .remove(&key_of(&obj));
                self.tell(old.as_deref().unwrap_or(&obj));
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

    /// Records that `parent` (of `subscriber`) needs the objects `selectors` select,
    /// replacing what it needed before, and returns them as the cache holds them now.
    /// Recording comes first: a change after it reaches the parent as an event, a
    /// change before it is in what is returned.
    pub fn select_for(
        &self,
        subscriber: u64,
        parent: &Key,
        selectors: &[Selector],
    ) -> Vec<Arc<DynamicObject>> {
        let who = Interested {
            subscriber,
            parent: parent.clone(),
        };
        let ns = if self.kind.namespaced {
            parent.0.clone()
        } else {
            None
        };
        self.interests
            .lock()
            .expect("interests lock")
            .set(&who, ns.clone(), selectors);
        let objects = self.objects.read().expect("related objects lock");
        let mut seen = BTreeSet::new();
        let mut out = Vec::new();
        for selector in selectors {
            for obj in objects.select(&ns, selector) {
                if seen.insert(key_of(&obj)) {
                    out.push(obj);
                }
            }
        }
        out
    }

    /// Forgets what `parent` of `subscriber` asked for (it is gone).
    pub fn forget(&self, subscriber: u64, parent: &Key) {
        self.interests.lock().expect("interests lock").set(
            &Interested {
                subscriber,
                parent: parent.clone(),
            },
            None,
            &[],
        );
    }

    fn subscribe(&self, changes: mpsc::UnboundedSender<Key>) -> u64 {
        let id = NEXT_SUBSCRIBER.fetch_add(1, Ordering::Relaxed);
        self.subscribers
            .lock()
            .expect("subscribers lock")
            .insert(id, changes);
        id
    }

    fn unsubscribe(&self, subscriber: u64) {
        self.subscribers
            .lock()
            .expect("subscribers lock")
            .remove(&subscriber);
        self.interests
            .lock()
            .expect("interests lock")
            .forget_subscriber(subscriber);
    }

    /// Sends the parents `obj` concerns to their controllers.
    fn tell(&self, obj: &DynamicObject) {
        let concerned = self
            .interests
            .lock()
            .expect("interests lock")
            .concerned(obj);
        if concerned.is_empty() {
            return;
        }
        let subscribers = self.subscribers.lock().expect("subscribers lock");
        for who in concerned {
            if let Some(changes) = subscribers.get(&who.subscriber) {
                let _ = changes.send(who.parent);
            }
        }
    }

    /// How many parents have interests recorded, for tests.
    #[cfg(test)]
    pub(super) fn interested_parents(&self) -> usize {
        self.interests.lock().unwrap().by_parent.len()
    }
}

/// A cache that a test feeds with watch events instead of a watch.
#[cfg(test)]
pub(super) struct Feed {
    cache: Arc<RelatedCache>,
    relist: Option<Objects>,
    ar: ApiResource,
}

#[cfg(test)]
impl Feed {
    /// An empty cache of `kind` that has not listed yet.
    pub(super) fn new(kind: &KindRef) -> Self {
        Feed {
            cache: Arc::new(RelatedCache::new(kind)),
            relist: None,
            ar: api_resource(kind),
        }
    }

    /// The cache.
    pub(super) fn cache(&self) -> Arc<RelatedCache> {
        self.cache.clone()
    }

    /// A subscription that receives the parents concerned by changes.
    pub(super) fn subscribe(&self) -> (u64, mpsc::UnboundedReceiver<Key>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (self.cache.subscribe(tx), rx)
    }

    /// A whole (re-)list that showed `objects`.
    pub(super) fn list(&mut self, objects: impl IntoIterator<Item = DynamicObject>) {
        self.event(watcher::Event::Init);
        for obj in objects {
            self.event(watcher::Event::InitApply(obj));
        }
        self.event(watcher::Event::InitDone);
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
        self.cache.apply(event, &mut self.relist, &self.ar);
    }
}

/// (namespace, name) of `obj`.
fn key_of(obj: &DynamicObject) -> Key {
    (obj.metadata.namespace.clone(), obj.name_any())
}

/// A watch event's object lacks `apiVersion` and `kind` only when the server omits
/// them; a plugin always sees both.
fn with_type(mut obj: DynamicObject, ar: &ApiResource) -> DynamicObject {
    if obj.types.is_none() {
        obj.types = Some(kube::api::TypeMeta {
            api_version: ar.api_version.clone(),
            kind: ar.kind.clone(),
        });
    }
    obj
}

/// (namespace, label key, label value).
type LabelKey = (Option<String>, String, String);

fn labels_of(obj: &DynamicObject) -> impl Iterator<Item = (&String, &String)> {
    obj.metadata.labels.iter().flatten()
}

fn has_labels(obj: &DynamicObject, wanted: &[(String, String)]) -> bool {
    let labels = obj.metadata.labels.as_ref();
    wanted
        .iter()
        .all(|(k, v)| labels.and_then(|l| l.get(k)) == Some(v))
}

/// The objects of one related kind, by key and by label.
#[derive(Default)]
struct Objects {
    /// Sorted by (namespace, name): the objects of one namespace are a range.
    by_key: BTreeMap<Key, Arc<DynamicObject>>,
    by_label: HashMap<LabelKey, BTreeSet<String>>,
}

impl Objects {
    fn insert(&mut self, obj: DynamicObject) {
        self.insert_arc(Arc::new(obj));
    }

    /// Inserts `obj`; returns the object it replaced.
    fn insert_arc(&mut self, obj: Arc<DynamicObject>) -> Option<Arc<DynamicObject>> {
        let key = key_of(&obj);
        let old = self.remove(&key);
        for (k, v) in labels_of(&obj) {
            self.by_label
                .entry((key.0.clone(), k.clone(), v.clone()))
                .or_default()
                .insert(key.1.clone());
        }
        self.by_key.insert(key, obj);
        old
    }

    fn remove(&mut self, key: &Key) -> Option<Arc<DynamicObject>> {
        let old = self.by_key.remove(key)?;
        for (k, v) in labels_of(&old) {
            let label = (key.0.clone(), k.clone(), v.clone());
            if let Some(names) = self.by_label.get_mut(&label) {
                names.remove(&key.1);
                if names.is_empty() {
                    self.by_label.remove(&label);
                }
            }
        }
        Some(old)
    }

    /// The objects `selector` selects in `ns`: by name, through the index of its first
    /// label, or every object of the namespace for an empty label list.
    fn select(&self, ns: &Option<String>, selector: &Selector) -> Vec<Arc<DynamicObject>> {
        match selector {
            Selector::Name(name) => self
                .by_key
                .get(&(ns.clone(), name.clone()))
                .cloned()
                .into_iter()
                .collect(),
            Selector::Labels(labels) => match labels.first() {
                Some((k, v)) => self
                    .by_label
                    .get(&(ns.clone(), k.clone(), v.clone()))
                    .into_iter()
                    .flatten()
                    .filter_map(|name| self.by_key.get(&(ns.clone(), name.clone())))
                    .filter(|o| has_labels(o, labels))
                    .cloned()
                    .collect(),
                None => self
                    .by_key
                    .range((ns.clone(), String::new())..)
                    .take_while(|((n, _), _)| n == ns)
                    .map(|(_, o)| o.clone())
                    .collect(),
            },
        }
    }

    /// The objects that differ between `self` and `next` (added, removed, or at
    /// another resourceVersion), as either holds them.
    fn differences(&self, next: &Objects) -> Vec<Arc<DynamicObject>> {
        let changed = |a: &Objects, b: &Objects| -> Vec<Arc<DynamicObject>> {
            a.by_key
                .iter()
                .filter(|(key, obj)| {
                    b.by_key.get(*key).is_none_or(|other| {
                        other.metadata.resource_version != obj.metadata.resource_version
                    })
                })
                .map(|(_, obj)| obj.clone())
                .collect()
        };
        let mut out = changed(next, self);
        out.extend(changed(self, next));
        out
    }
}

/// Which parents need which objects of one related kind, indexed both ways.
#[derive(Default)]
struct Interests {
    /// What each parent asked for, in its namespace (none: a cluster-scoped kind).
    by_parent: HashMap<Interested, (Option<String>, Vec<Selector>)>,
    /// Parents that asked for an object by name.
    by_name: HashMap<Key, HashSet<Interested>>,
    /// Parents with a label selector, under the selector's first label.
    by_label: HashMap<LabelKey, HashSet<Interested>>,
    /// Parents that asked for every object of a namespace.
    by_namespace: HashMap<Option<String>, HashSet<Interested>>,
}

impl Interests {
    /// Replaces what `who` asked for with `selectors` in `ns` (none: forget it). Costs
    /// O(its selectors), whatever the number of parents.
    fn set(&mut self, who: &Interested, ns: Option<String>, selectors: &[Selector]) {
        if let Some((old_ns, old)) = self.by_parent.remove(who) {
            for selector in &old {
                self.unindex(who, &old_ns, selector);
            }
        }
        if selectors.is_empty() {
            return;
        }
        for selector in selectors {
            let slot = match selector {
                Selector::Name(name) => self.by_name.entry((ns.clone(), name.clone())).or_default(),
                Selector::Labels(labels) => match labels.first() {
                    Some((k, v)) => self
                        .by_label
                        .entry((ns.clone(), k.clone(), v.clone()))
                        .or_default(),
                    // An empty list selects the whole namespace.
                    None => self.by_namespace.entry(ns.clone()).or_default(),
                },
            };
            slot.insert(who.clone());
        }
        self.by_parent.insert(who.clone(), (ns, selectors.to_vec()));
    }

    /// Removes `who` from the index entry of `selector` in `ns`, and the entry once empty.
    fn unindex(&mut self, who: &Interested, ns: &Option<String>, selector: &Selector) {
        fn drop_from<K: std::hash::Hash + Eq>(
            map: &mut HashMap<K, HashSet<Interested>>,
            key: K,
            who: &Interested,
        ) {
            if let Some(set) = map.get_mut(&key) {
                set.remove(who);
                if set.is_empty() {
                    map.remove(&key);
                }
            }
        }
        match selector {
            Selector::Name(name) => drop_from(&mut self.by_name, (ns.clone(), name.clone()), who),
            Selector::Labels(labels) => match labels.first() {
                Some((k, v)) => {
                    drop_from(&mut self.by_label, (ns.clone(), k.clone(), v.clone()), who)
                }
                None => drop_from(&mut self.by_namespace, ns.clone(), who),
            },
        }
    }

    /// Forgets every parent of `subscriber` (its controller stopped).
    fn forget_subscriber(&mut self, subscriber: u64) {
        let gone: Vec<Interested> = self
            .by_parent
            .keys()
            .filter(|w| w.subscriber == subscriber)
            .cloned()
            .collect();
        for who in gone {
            self.set(&who, None, &[]);
        }
    }

    /// The parents whose requests select `obj`: candidates from the indexes, each
    /// checked against its whole selector.
    fn concerned(&self, obj: &DynamicObject) -> HashSet<Interested> {
        let (ns, name) = key_of(obj);
        let mut out: HashSet<Interested> = HashSet::new();
        if let Some(set) = self.by_name.get(&(ns.clone(), name)) {
            out.extend(set.iter().cloned());
        }
        if let Some(set) = self.by_namespace.get(&ns) {
            out.extend(set.iter().cloned());
        }
        for (k, v) in labels_of(obj) {
            let Some(set) = self.by_label.get(&(ns.clone(), k.clone(), v.clone())) else {
                continue;
            };
            for who in set {
                let selects = self.by_parent.get(who).is_some_and(|(_, selectors)| {
                    selectors.iter().any(|s| match s {
                        Selector::Labels(l) => has_labels(obj, l),
                        Selector::Name(_) => false,
                    })
                });
                if selects {
                    out.insert(who.clone());
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn kind() -> KindRef {
        KindRef {
            group: String::new(),
            version: "v1".into(),
            kind: "ConfigMap".into(),
            plural: "configmaps".into(),
            namespaced: true,
        }
    }

    fn cm(ns: &str, name: &str, labels: serde_json::Value, rv: &str) -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": ns, "labels": labels,
                         "resourceVersion": rv, "uid": format!("uid-{ns}-{name}")},
            "data": {"value": rv},
        }))
        .unwrap()
    }

    fn parent(name: &str) -> Key {
        (Some("ns".into()), name.into())
    }

    fn labels(pairs: &[(&str, &str)]) -> Selector {
        Selector::Labels(
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    }

    fn names(objs: &[Arc<DynamicObject>]) -> Vec<String> {
        let mut n: Vec<String> = objs.iter().map(|o| o.name_any()).collect();
        n.sort();
        n
    }

    fn drain(rx: &mut mpsc::UnboundedReceiver<Key>) -> Vec<String> {
        let mut out = Vec::new();
        while let Ok((_, name)) = rx.try_recv() {
            out.push(name);
        }
        out.sort();
        out.dedup();
        out
    }

    #[test]
    fn a_parent_gets_what_it_selects_in_its_own_namespace_only() {
        let mut feed = Feed::new(&kind());
        feed.list([
            cm("ns", "config", json!({}), "1"),
            cm("other", "config", json!({}), "1"),
            cm("ns", "pod-a", json!({"app": "pg", "role": "db"}), "1"),
            cm("ns", "pod-b", json!({"app": "pg"}), "1"),
            cm("other", "pod-c", json!({"app": "pg", "role": "db"}), "1"),
        ]);
        let cache = feed.cache();
        let (sub, _rx) = feed.subscribe();
        let by_name = cache.select_for(sub, &parent("p"), &[Selector::Name("config".into())]);
        assert_eq!(names(&by_name), ["config"]);
        assert_eq!(by_name[0].metadata.namespace.as_deref(), Some("ns"));
        let by_labels = cache.select_for(
            sub,
            &parent("p"),
            &[labels(&[("app", "pg"), ("role", "db")])],
        );
        assert_eq!(names(&by_labels), ["pod-a"], "both labels, own namespace");
        let all = cache.select_for(sub, &parent("p"), &[labels(&[])]);
        assert_eq!(names(&all), ["config", "pod-a", "pod-b"]);
        let missing = cache.select_for(sub, &parent("p"), &[Selector::Name("nope".into())]);
        assert!(missing.is_empty());
    }

    #[test]
    fn a_change_reaches_exactly_the_parents_whose_requests_select_it() {
        let mut feed = Feed::new(&kind());
        feed.list([cm("ns", "config", json!({}), "1")]);
        let cache = feed.cache();
        let (sub, mut rx) = feed.subscribe();
        cache.select_for(sub, &parent("by-name"), &[Selector::Name("config".into())]);
        cache.select_for(
            sub,
            &parent("by-labels"),
            &[labels(&[("app", "pg"), ("role", "db")])],
        );
        cache.select_for(sub, &parent("everything"), &[labels(&[])]);
        cache.select_for(
            sub,
            &parent("other-name"),
            &[Selector::Name("unrelated".into())],
        );

        feed.applied(cm("ns", "config", json!({}), "2"));
        assert_eq!(drain(&mut rx), ["by-name", "everything"]);

        // Only one of the two labels: not selected.
        feed.applied(cm("ns", "pod", json!({"app": "pg"}), "1"));
        assert_eq!(drain(&mut rx), ["everything"]);
        feed.applied(cm("ns", "pod", json!({"app": "pg", "role": "db"}), "2"));
        assert_eq!(drain(&mut rx), ["by-labels", "everything"]);
        // Losing a label concerns the parent that selected it by that label.
        feed.applied(cm("ns", "pod", json!({"app": "pg"}), "3"));
        assert_eq!(drain(&mut rx), ["by-labels", "everything"]);
        feed.deleted(cm("ns", "config", json!({}), "4"));
        assert_eq!(drain(&mut rx), ["by-name", "everything"]);

        // Another namespace concerns nobody here.
        feed.applied(cm(
            "other",
            "config",
            json!({"app": "pg", "role": "db"}),
            "1",
        ));
        assert!(drain(&mut rx).is_empty());
    }

    #[test]
    fn new_requests_replace_old_ones_and_forgotten_parents_hear_nothing() {
        let mut feed = Feed::new(&kind());
        feed.list([]);
        let cache = feed.cache();
        let (sub, mut rx) = feed.subscribe();
        cache.select_for(sub, &parent("p"), &[Selector::Name("a".into())]);
        cache.select_for(sub, &parent("p"), &[Selector::Name("b".into())]);
        feed.applied(cm("ns", "a", json!({}), "1"));
        assert!(drain(&mut rx).is_empty(), "p no longer asks for a");
        feed.applied(cm("ns", "b", json!({}), "1"));
        assert_eq!(drain(&mut rx), ["p"]);
        cache.forget(sub, &parent("p"));
        assert_eq!(cache.interested_parents(), 0);
        feed.applied(cm("ns", "b", json!({}), "2"));
        assert!(drain(&mut rx).is_empty());
        let inner = cache.interests.lock().unwrap();
        assert!(inner.by_name.is_empty() && inner.by_label.is_empty());
    }

    #[test]
    fn a_stopped_controllers_parents_are_forgotten() {
        let mut feed = Feed::new(&kind());
        feed.list([]);
        let cache = feed.cache();
        let (sub, _rx) = feed.subscribe();
        let (other, mut other_rx) = feed.subscribe();
        for i in 0..100 {
            cache.select_for(sub, &parent(&format!("p{i}")), &[labels(&[("app", "pg")])]);
        }
        cache.select_for(other, &parent("q"), &[labels(&[("app", "pg")])]);
        cache.unsubscribe(sub);
        assert_eq!(cache.interested_parents(), 1);
        feed.applied(cm("ns", "x", json!({"app": "pg"}), "1"));
        assert_eq!(drain(&mut other_rx), ["q"]);
    }

    #[test]
    fn a_relist_tells_the_parents_of_what_changed_while_the_watch_was_down() {
        let mut feed = Feed::new(&kind());
        feed.list([cm("ns", "a", json!({}), "1"), cm("ns", "b", json!({}), "1")]);
        let cache = feed.cache();
        let (sub, mut rx) = feed.subscribe();
        cache.select_for(sub, &parent("pa"), &[Selector::Name("a".into())]);
        cache.select_for(sub, &parent("pb"), &[Selector::Name("b".into())]);
        cache.select_for(sub, &parent("pc"), &[Selector::Name("c".into())]);
        // a changed, b unchanged, c created.
        feed.list([
            cm("ns", "a", json!({}), "2"),
            cm("ns", "b", json!({}), "1"),
            cm("ns", "c", json!({}), "1"),
        ]);
        assert_eq!(drain(&mut rx), ["pa", "pc"]);
    }

    #[test]
    fn cluster_scoped_objects_are_found_by_name_whatever_the_parents_namespace() {
        let ns_kind = KindRef {
            group: String::new(),
            version: "v1".into(),
            kind: "Namespace".into(),
            plural: "namespaces".into(),
            namespaced: false,
        };
        let mut feed = Feed::new(&ns_kind);
        let obj: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": "team-a", "resourceVersion": "1"},
        }))
        .unwrap();
        feed.list([obj.clone()]);
        let cache = feed.cache();
        let (sub, mut rx) = feed.subscribe();
        let got = cache.select_for(sub, &parent("p"), &[Selector::Name("team-a".into())]);
        assert_eq!(names(&got), ["team-a"]);
        feed.applied(obj);
        assert_eq!(drain(&mut rx), ["p"]);
    }

    fn secrets() -> KindRef {
        KindRef {
            kind: "Secret".into(),
            plural: "secrets".into(),
            ..kind()
        }
    }

    /// The list requests made of `/api/v1/secrets`: (who, labelSelector).
    fn secret_lists(calls: &super::super::fake_api::Calls) -> BTreeSet<(String, String)> {
        calls
            .all()
            .iter()
            .filter(|c| c.path == "/api/v1/secrets" && !c.has_query("watch=true"))
            .map(|c| {
                let who = c
                    .headers
                    .get("impersonate-user")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("the host")
                    .to_string();
                let selector = c
                    .query
                    .split('&')
                    .find_map(|p| p.strip_prefix("labelSelector="))
                    .unwrap_or_default()
                    .to_string();
                (who, selector)
            })
            .collect()
    }

    #[tokio::test]
    async fn granted_secrets_are_watched_with_the_grants_labels_only() {
        let store = super::super::fake_api::Store::new();
        let (client, calls) = store.client();
        let caches = RelatedCaches::new(client, None, Arc::new(Metrics::default()), None);
        let granted = BTreeMap::from([("capstan.dev/share".to_string(), "db".to_string())]);
        let (tx, _rx) = mpsc::unbounded_channel();
        let a = caches.watch(&secrets(), "a", Some(&granted), tx.clone());
        let b = caches.watch(&secrets(), "b", Some(&granted), tx.clone());
        assert!(
            Arc::ptr_eq(a.cache(), b.cache()),
            "the same labels share one cache"
        );
        assert!(a.cache().synced(Duration::from_secs(10)).await);
        assert_eq!(
            secret_lists(&calls),
            BTreeSet::from([("the host".into(), "capstan.dev%2Fshare%3Ddb".into())]),
            "the API server is asked only for the granted Secrets"
        );
    }

    #[tokio::test]
    async fn with_plugin_identities_each_plugin_reads_its_related_objects_as_itself() {
        let store = super::super::fake_api::Store::new();
        let (client, calls) = store.client();
        let identities = super::super::identity::PluginIdentities::new("capstan-system");
        let caches = RelatedCaches::new(
            client,
            None,
            Arc::new(Metrics::default()),
            Some(identities.clone()),
        );
        let granted = BTreeMap::from([("capstan.dev/share".to_string(), "db".to_string())]);
        let (tx, _rx) = mpsc::unbounded_channel();
        let a = caches.watch(&secrets(), "a", Some(&granted), tx.clone());
        let b = caches.watch(&secrets(), "b", Some(&granted), tx.clone());
        assert!(!Arc::ptr_eq(a.cache(), b.cache()), "no cache shared");
        assert!(a.cache().synced(Duration::from_secs(10)).await);
        assert!(b.cache().synced(Duration::from_secs(10)).await);
        let selector = "capstan.dev%2Fshare%3Ddb".to_string();
        assert_eq!(
            secret_lists(&calls),
            BTreeSet::from([
                (identities.user("a"), selector.clone()),
                (identities.user("b"), selector),
            ])
        );
    }
}
