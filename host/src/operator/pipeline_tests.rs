//! The middle test tier: the rules of one reconcile ([`super::reconcile`]) with a real
//! test plugin, against the in-memory API server of [`super::fake_api`], with child
//! caches the test feeds as a watch would. Each test is a scenario of a few reconciles;
//! none needs a cluster, and the whole set runs in seconds.
//!
//! The test plugins are built into target/test-plugins by `cargo xtask plugins`.

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kube::api::DynamicObject;
use kube::runtime::controller::Action;
use serde_json::{Value, json};

use super::children::Feed;
use super::cluster::{ChildKinds, ClusterWrites};
use super::controller::{Caches, ControllerOptions, RunningController};
use super::fake_api::{self, Call, Calls, Store};
use super::finalizers::FINALIZER;
use super::freshness::OwnWrites;
use super::leader::WriteFence;
use super::metrics::Metrics;
use super::parent::CachedParent;
use super::reconcile::{self, Context, Tracked};
use super::rollout::canary::{Canary, CanaryPolicy};
use super::rollout::slot::ShadowSlot;
use crate::plugin::{Plugin, Sandbox, SandboxConfig};

pub(super) const NS: &str = "ns";
/// The file a scenario's plugin is served from, as `/plugins` names it.
const SERVING_FILE: &str = "/plugins/serving.wasm";

/// The compile cache of these tests, shared by every test and every run (the cache
/// evicts what it no longer needs): each plugin is compiled once, and each test loads
/// it into a sandbox of its own (whose call counts are its own).
fn cache_dir() -> PathBuf {
    crate::fixtures::root().join("target/test-compile-cache")
}

/// Loads the test plugin `name` in a sandbox of its own. On a thread of its own too:
/// loading blocks on the sandbox's runtime, which a test's runtime may not do.
fn load(name: &str) -> (Sandbox, Plugin) {
    load_file(crate::fixtures::test_plugin(name))
}

pub(super) fn load_file(file: PathBuf) -> (Sandbox, Plugin) {
    std::thread::spawn(move || load_here(&file))
        .join()
        .expect("the plugin loads")
}

fn load_here(file: &std::path::Path) -> (Sandbox, Plugin) {
    let sandbox = Sandbox::new(SandboxConfig {
        deadline: Duration::from_secs(5),
        memory_limit: 64 << 20,
        cache_dir: Some(cache_dir()),
        instances: 4,
        ..SandboxConfig::default()
    })
    .unwrap();
    let plugin = sandbox
        .load_file_blocking(file)
        .unwrap_or_else(|e| panic!("{e} (build the plugins: cargo xtask plugins)"));
    (sandbox, plugin)
}

/// One plugin's context against a fake API server, with caches fed by the test.
pub(super) struct Scenario {
    pub(super) store: Store,
    pub(super) calls: Calls,
    ctx: Arc<Context>,
    sandbox: Sandbox,
    pub(super) plugin: Plugin,
    /// The caches of the child kinds, in the plugin's order, and the collections
    /// (paths) they show.
    feeds: Vec<(Feed, String)>,
    /// What the feeds showed last, by path: the objects, to send their deletion.
    shown: HashMap<String, Value>,
    own_writes: Arc<OwnWrites>,
    /// The collection of the parent kind in [`NS`].
    pub(super) parents: String,
    /// The shadow version's slot (empty unless a test fills it).
    shadow: ShadowSlot,
}

impl Scenario {
    fn new(plugin: &str) -> Self {
        Self::with(load(plugin), None)
    }

    /// A scenario whose plugin also reads objects of its related kind (one), from
    /// `related`, a cache the test feeds.
    pub(super) fn with(
        (sandbox, plugin): (Sandbox, Plugin),
        related: Option<&super::related::Feed>,
    ) -> Self {
        Self::configured((sandbox, plugin), related, |ctx| ctx)
    }

    /// [`Scenario::with`], its context changed by `configure` before it serves.
    pub(super) fn configured(
        (sandbox, plugin): (Sandbox, Plugin),
        related: Option<&super::related::Feed>,
        configure: impl FnOnce(Context) -> Context,
    ) -> Self {
        let store = Store::new();
        let (client, calls) = store.client();
        let info = plugin.info().clone();
        let mut feeds: Vec<(Feed, String)> = info
            .children
            .iter()
            .map(|k| {
                let collection = fake_api::path(&k.api_version(), &k.plural, Some(NS), "");
                (Feed::new(k), collection)
            })
            .collect();
        for (feed, _) in &mut feeds {
            feed.list([]);
        }
        let own_writes = Arc::new(OwnWrites::default());
        let mut ctx = Context::new(
            plugin.clone(),
            ClusterWrites::new(client, &info.parent, &info.name, WriteFence::default()),
            ChildKinds::new(&info.children),
            feeds.iter().map(|(f, _)| f.cache()).collect(),
            own_writes.clone(),
            Arc::new(Metrics::with_sandbox(sandbox.metrics())),
            Duration::from_secs(600),
        );
        if let Some(feed) = related {
            let (subscriber, changes) = feed.subscribe();
            std::mem::forget(changes);
            ctx = ctx.with_related(vec![(feed.cache(), subscriber)]);
        }
        let shadow = ShadowSlot::new(std::path::Path::new(SERVING_FILE));
        ctx = configure(ctx.with_shadow(shadow.clone()));
        let parents = fake_api::path(
            &info.parent.api_version(),
            &info.parent.plural,
            Some(NS),
            "",
        );
        Scenario {
            store,
            calls,
            ctx: Arc::new(ctx),
            sandbox,
            plugin,
            feeds,
            shown: HashMap::new(),
            own_writes,
            parents,
            shadow,
        }
    }

    /// Creates a parent named `name` with `spec`; returns its path.
    fn create(&self, name: &str, spec: Value) -> String {
        let info = self.plugin.info();
        self.store.create(
            &self.parents,
            json!({"apiVersion": info.parent.api_version(), "kind": info.parent.kind,
                   "metadata": {"name": name}, "spec": spec}),
        );
        format!("{}/{name}", self.parents)
    }

    /// One reconcile of the parent at `path`, as the parent cache holds it now (the
    /// store's copy: the parent watch is taken to be current).
    pub(super) async fn reconcile(&self, path: &str) -> Action {
        let parent = self.store.get(path).expect("the parent exists");
        let parent: DynamicObject = serde_json::from_value(parent).unwrap();
        let cached = Arc::new(CachedParent::new(parent));
        self.own_writes.seen(&cached);
        reconcile::reconcile(cached, self.ctx.clone())
            .await
            .expect("every failure is reported")
    }

    /// The child caches catch up with the store, by watch events.
    fn catch_up(&mut self) {
        let revision = self.store.revision().to_string();
        for (feed, collection) in &mut self.feeds {
            let now: HashMap<String, Value> = self
                .store
                .names(collection)
                .into_iter()
                .map(|name| {
                    let path = format!("{collection}/{name}");
                    let obj = self.store.get(&path).unwrap();
                    (path, obj)
                })
                .collect();
            for (path, obj) in &now {
                if self.shown.get(path) != Some(obj) {
                    feed.applied(serde_json::from_value(obj.clone()).unwrap());
                    self.shown.insert(path.clone(), obj.clone());
                }
            }
            let gone: Vec<String> = self
                .shown
                .keys()
                .filter(|p| p.starts_with(collection.as_str()) && !now.contains_key(*p))
                .cloned()
                .collect();
            for path in gone {
                let mut obj = self.shown.remove(&path).unwrap();
                obj["metadata"]["resourceVersion"] = json!(revision);
                feed.deleted(serde_json::from_value(obj).unwrap());
            }
        }
    }

    /// The child caches re-list (after their watch broke): they show the store as it is
    /// now, without a deletion event for what went meanwhile.
    fn relist(&mut self) {
        self.shown.clear();
        for (feed, collection) in &mut self.feeds {
            let objects: Vec<DynamicObject> = self
                .store
                .names(collection)
                .into_iter()
                .map(|name| {
                    let path = format!("{collection}/{name}");
                    let obj = self.store.get(&path).unwrap();
                    self.shown.insert(path, obj.clone());
                    serde_json::from_value(obj).unwrap()
                })
                .collect();
            feed.list(objects);
        }
    }

    /// The scenario's metrics, with its plugin listed in `/plugins` as serving from
    /// [`SERVING_FILE`] (where shadows and canaries are shown).
    fn served_as_a_file(&self) -> Arc<Metrics> {
        let metrics = self.ctx.metrics.clone();
        metrics.set_plugin(super::metrics::PluginState::of(
            std::path::Path::new(SERVING_FILE),
            Some(&self.plugin),
            None,
        ));
        metrics
    }

    /// A mark in the request log, for [`Scenario::writes_since`].
    pub(super) fn mark(&self) -> usize {
        self.calls.all().len()
    }

    /// The writes since `mark`, as `verb kind/name`: `write` (a child applied or
    /// created), `delete`, `status`, `patch` (the parent's metadata: finalizers).
    fn writes_since(&self, mark: usize) -> Vec<String> {
        self.calls.all()[mark..]
            .iter()
            .filter_map(describe_write)
            .collect()
    }

    /// The plugin calls made so far (reconcile and finalize).
    fn plugin_calls(&self) -> u64 {
        let summary = self.sandbox.metrics().summary(&self.plugin.info().name);
        summary.calls.values().copied().sum()
    }

    fn tracked(&self) -> Tracked {
        self.ctx.tracked()
    }
}

/// `verb plural/name` of a write request; none for reads and events.
fn describe_write(call: &Call) -> Option<String> {
    if call.path.contains("/events") {
        return None;
    }
    let segments: Vec<&str> = call.path.split('/').collect();
    let object = |plural_at: usize| format!("{}/{}", segments[plural_at], segments[plural_at + 1]);
    let n = segments.len();
    Some(match call.method {
        http::Method::GET => return None,
        http::Method::POST => format!(
            "write {}/{}",
            segments[n - 1],
            call.body["metadata"]["name"].as_str().unwrap_or_default()
        ),
        http::Method::DELETE => format!("delete {}", object(n - 2)),
        http::Method::PATCH if call.path.ends_with("/status") => {
            format!("status {}", object(n - 3))
        }
        http::Method::PATCH if call.query.contains("fieldManager=") => {
            format!("write {}", object(n - 2))
        }
        _ => format!("patch {}", object(n - 2)),
    })
}

fn configmaps() -> String {
    fake_api::path("v1", "configmaps", Some(NS), "")
}

fn cm(parent: &str, i: u32) -> String {
    format!("{}/{parent}-{i}", configmaps())
}

/// The resync a converged parent waits for: anything but the short requeues of a
/// reconcile that could not finish.
fn is_resync(action: &Action) -> bool {
    *action != Action::requeue(Duration::from_millis(200)) && *action != Action::await_change()
}

#[tokio::test]
async fn children_are_written_before_the_status_and_an_unchanged_status_is_not_written() {
    let mut s = Scenario::new("widget");
    let w = s.create("w", json!({"count": 2, "message": "hi"}));
    let mark = s.mark();
    assert!(is_resync(&s.reconcile(&w).await));
    assert_eq!(
        s.writes_since(mark),
        [
            "write configmaps/w-0",
            "write configmaps/w-1",
            "status widgets/w"
        ]
    );
    let status = s.store.get(&w).unwrap()["status"].clone();
    assert_eq!(status["configMaps"], 2, "{status}");
    assert_eq!(status["conditions"][0]["type"], "Ready", "{status}");

    // The caches show the children: the plugin reports them in its status.
    s.catch_up();
    let mark = s.mark();
    s.reconcile(&w).await;
    assert_eq!(s.writes_since(mark), ["status widgets/w"]);
    assert_eq!(
        s.store.get(&w).unwrap()["status"]["observedConfigMaps"],
        json!(["w-0", "w-1"])
    );

    // Nothing changed since: nothing is written, neither children nor status.
    s.catch_up();
    let (mark, calls) = (s.mark(), s.plugin_calls());
    assert!(is_resync(&s.reconcile(&w).await));
    assert_eq!(s.writes_since(mark), Vec::<String>::new());
    assert_eq!(s.plugin_calls(), calls + 1, "the plugin was asked");
}

/// A native plugin (no wasm) whose answer names a child in another namespace.
struct Escapes;

impl crate::plugin::Native for Escapes {
    fn describe(&self) -> crate::contract::PluginInfo {
        use crate::contract::KindRef;
        crate::contract::PluginInfo {
            name: "escapes".into(),
            version: "0.1.0".into(),
            parent: KindRef::namespaced("test.capstan.dev", "v1", "Widget", "widgets"),
            children: vec![KindRef::namespaced("", "v1", "ConfigMap", "configmaps")],
            ..crate::contract::PluginInfo::default()
        }
    }

    fn reconcile(
        &self,
        _observed: &crate::contract::Observed,
    ) -> Result<crate::contract::Desired, crate::contract::PluginError> {
        Ok(crate::contract::Desired {
            children: vec![
                json!({"apiVersion": "v1", "kind": "ConfigMap",
                       "metadata": {"name": "loot", "namespace": "kube-system"}})
                .to_string(),
            ],
            status: None,
            conditions: Vec::new(),
            events: Vec::new(),
            requeue_after_seconds: None,
        })
    }
}

#[tokio::test]
async fn a_native_plugin_goes_through_the_same_rules_without_any_wasm() {
    let sandbox = Sandbox::new(SandboxConfig::default()).unwrap();
    let s = Scenario::with((sandbox, Plugin::native(Escapes)), None);
    let w = s.create("w", json!({}));
    let mark = s.mark();
    s.reconcile(&w).await;
    assert_eq!(
        s.writes_since(mark),
        ["status widgets/w"],
        "nothing but the refusal is written"
    );
    let ready = s.store.get(&w).unwrap()["status"]["conditions"][0].clone();
    assert_eq!(ready["reason"], "InvalidPluginOutput", "{ready}");
    assert!(
        ready["message"].as_str().unwrap().contains("kube-system"),
        "{ready}"
    );
    assert_eq!(s.store.event_reasons(), ["InvalidPluginOutput"]);
}

/// Converges a widget `name` with `count` ConfigMaps; the caches show them.
async fn converged(s: &mut Scenario, name: &str, count: u32) -> String {
    let w = s.create(name, json!({"count": count, "message": "one"}));
    for _ in 0..3 {
        s.reconcile(&w).await;
        s.catch_up();
    }
    let mark = s.mark();
    s.reconcile(&w).await;
    assert_eq!(s.writes_since(mark), Vec::<String>::new(), "converged");
    w
}

#[tokio::test]
async fn children_no_longer_desired_are_pruned_after_every_apply_with_their_uid() {
    let mut s = Scenario::new("widget");
    let w = converged(&mut s, "w", 3).await;
    let uids: BTreeSet<String> = (1..3)
        .map(|i| s.store.get(&cm("w", i)).unwrap()["metadata"]["uid"].to_string())
        .collect();
    s.store.update(&w, |o| {
        o["spec"] = json!({"count": 1, "message": "two"});
    });
    let mark = s.mark();
    s.reconcile(&w).await;
    let writes = s.writes_since(mark);
    assert_eq!(writes.len(), 4, "{writes:?}");
    assert_eq!(writes[0], "write configmaps/w-0");
    assert_eq!(
        writes[1..3].iter().collect::<BTreeSet<_>>(),
        BTreeSet::from([
            &"delete configmaps/w-1".to_string(),
            &"delete configmaps/w-2".to_string()
        ])
    );
    assert_eq!(writes[3], "status widgets/w");
    let deletes: BTreeSet<String> = s.calls.all()[mark..]
        .iter()
        .filter(|c| c.method == http::Method::DELETE)
        .map(|c| c.body["preconditions"]["uid"].to_string())
        .collect();
    assert_eq!(deletes, uids, "each delete is of the very object observed");
    assert_eq!(s.store.names(&configmaps()), ["w-0"]);
}

#[tokio::test]
async fn nothing_is_pruned_before_every_apply_succeeded() {
    let mut s = Scenario::new("widget");
    let w = converged(&mut s, "w", 3).await;
    s.store.update(&w, |o| {
        o["spec"] = json!({"count": 2, "message": "two"});
    });
    // The API server fails the second apply.
    s.store.inject(|call: &Call| {
        let second = call.method != http::Method::GET
            && (call.path.ends_with("/configmaps/w-1") || call.body["metadata"]["name"] == "w-1");
        second.then(|| fake_api::status(500, "InternalError", "etcd is unwell"))
    });
    let mark = s.mark();
    s.reconcile(&w).await;
    assert_eq!(
        s.writes_since(mark),
        ["write configmaps/w-0", "write configmaps/w-1"],
        "no prune (of w-2) and no status after a failed apply"
    );
    assert!(s.store.get(&cm("w", 2)).is_some());

    // Once the apply goes through, w-2 is pruned.
    s.store.heal();
    s.catch_up();
    let mark = s.mark();
    s.reconcile(&w).await;
    let writes = s.writes_since(mark);
    assert!(
        writes.contains(&"delete configmaps/w-2".to_string()),
        "{writes:?}"
    );
    let delete = writes.iter().position(|w| w.starts_with("delete")).unwrap();
    assert!(
        writes[..delete].contains(&"write configmaps/w-1".to_string()),
        "{writes:?}"
    );
}

#[tokio::test]
async fn a_prune_never_deletes_an_object_another_parent_controls() {
    let mut s = Scenario::new("widget");
    let w = converged(&mut s, "w", 2).await;
    let other = s.create("other", json!({"count": 0}));
    let other_uid = s.store.get(&other).unwrap()["metadata"]["uid"].clone();
    let foreign = |name: &str| {
        json!({"apiVersion": "v1", "kind": "ConfigMap",
               "metadata": {"name": name, "labels": {"app.kubernetes.io/managed-by": "capstan"},
                   "ownerReferences": [{"apiVersion": "test.capstan.dev/v1", "kind": "Widget",
                       "name": "other", "uid": other_uid, "controller": true}]}})
    };
    let configmaps = configmaps();
    // w-1 is deleted and made again by another controller; the cache has not seen it.
    s.store.delete(&cm("w", 1));
    s.store.create(&configmaps, foreign("w-1"));
    // And another parent's object with a name of the same pattern, which the cache shows.
    s.store.create(&configmaps, foreign("w-5"));
    s.catch_up_only(&cm("w", 5));
    s.store.update(&w, |o| {
        o["spec"]["count"] = json!(1);
    });
    let mark = s.mark();
    s.reconcile(&w).await;
    let writes = s.writes_since(mark);
    assert!(
        writes.contains(&"delete configmaps/w-1".to_string()),
        "{writes:?}"
    );
    assert!(!writes.contains(&"delete configmaps/w-5".to_string()));
    for name in ["w-1", "w-5"] {
        let survivor = s.store.get(&format!("{configmaps}/{name}")).unwrap();
        assert_eq!(
            survivor["metadata"]["ownerReferences"][0]["uid"], other_uid,
            "{name} was not deleted: the UID precondition failed"
        );
    }
}

impl Scenario {
    /// The caches see the object at `path` (and nothing else) as it is now.
    fn catch_up_only(&mut self, path: &str) {
        let obj = self.store.get(path).unwrap();
        let (feed, _) = self
            .feeds
            .iter_mut()
            .find(|(_, c)| path.starts_with(c.as_str()))
            .unwrap();
        feed.applied(serde_json::from_value(obj.clone()).unwrap());
        self.shown.insert(path.to_string(), obj);
    }
}

#[tokio::test]
async fn a_cache_that_has_not_shown_the_last_writes_holds_the_reconcile() {
    let mut s = Scenario::new("widget");
    let w = s.create("w", json!({"count": 2}));
    s.reconcile(&w).await;
    let (mark, calls) = (s.mark(), s.plugin_calls());
    // The caches do not show w-0 and w-1 yet.
    let action = s.reconcile(&w).await;
    assert_eq!(action, Action::requeue(Duration::from_millis(200)));
    assert_eq!(s.plugin_calls(), calls, "the plugin is not asked");
    assert!(s.calls.all()[mark..].is_empty(), "no request at all");
    // One of them shows: still behind.
    s.catch_up_only(&cm("w", 0));
    s.reconcile(&w).await;
    assert_eq!(s.plugin_calls(), calls);
    // Both: the reconcile goes on, and sees both.
    s.catch_up();
    s.reconcile(&w).await;
    assert_eq!(s.plugin_calls(), calls + 1);
    assert_eq!(
        s.store.get(&w).unwrap()["status"]["observedConfigMaps"],
        json!(["w-0", "w-1"])
    );
}

#[tokio::test]
async fn a_child_deleted_while_the_watch_was_down_is_made_again_at_once() {
    let mut s = Scenario::new("widget");
    let w = s.create("w", json!({"count": 2}));
    s.reconcile(&w).await;
    // The watch breaks before it shows the children; w-1 is deleted meanwhile (by
    // hand); the re-list shows w-0 only.
    s.store.delete(&cm("w", 1));
    s.relist();
    let (mark, calls) = (s.mark(), s.plugin_calls());
    s.reconcile(&w).await;
    assert_eq!(s.plugin_calls(), calls + 1, "the caches are current");
    assert!(
        s.writes_since(mark)
            .contains(&"write configmaps/w-1".to_string())
    );
    assert!(s.store.get(&cm("w", 1)).is_some());
}

#[tokio::test]
async fn the_finalizer_is_added_held_until_finalize_is_done_then_released() {
    let mut s = Scenario::new("guard");
    let g = s.create("g", json!({}));
    let mark = s.mark();
    s.reconcile(&g).await;
    assert_eq!(
        s.writes_since(mark),
        [
            "patch guards/g",
            "write configmaps/g-guarded",
            "status guards/g"
        ],
        "the finalizer first, then the reconcile from the parent as written"
    );
    assert_eq!(
        s.store.get(&g).unwrap()["metadata"]["finalizers"],
        json!([FINALIZER])
    );
    s.catch_up();

    // Deleted: finalize says "not yet"; the finalizer stays; look again later.
    s.store.delete(&g);
    let (mark, calls) = (s.mark(), s.plugin_calls());
    let action = s.reconcile(&g).await;
    assert_eq!(action, Action::requeue(Duration::from_secs(2)));
    assert_eq!(s.plugin_calls(), calls + 1);
    assert_eq!(s.writes_since(mark), Vec::<String>::new());
    assert!(s.store.event_reasons().contains(&"Holding".to_string()));

    // Done: the finalizer goes, and with it the parent.
    s.store.update(&g, |o| o["spec"]["release"] = json!(true));
    let mark = s.mark();
    s.reconcile(&g).await;
    assert_eq!(s.writes_since(mark), ["patch guards/g"]);
    assert!(s.store.get(&g).is_none(), "deleted once released");
    assert!(s.store.event_reasons().contains(&"Released".to_string()));
    assert_eq!(s.tracked().expectations, 0);
}

#[tokio::test]
async fn a_finalize_that_fails_as_invalid_keeps_the_finalizer_and_says_so() {
    let mut s = Scenario::new("guard");
    let g = s.create("g", json!({}));
    s.reconcile(&g).await;
    s.catch_up();
    s.store
        .update(&g, |o| o["spec"]["release"] = json!("not a boolean"));
    s.store.delete(&g);
    let mark = s.mark();
    s.reconcile(&g).await;
    assert!(
        !s.writes_since(mark).contains(&"patch guards/g".to_string()),
        "the finalizer is not removed on an invalid answer"
    );
    assert_eq!(
        s.store.get(&g).unwrap()["metadata"]["finalizers"],
        json!([FINALIZER])
    );
    let warnings: Vec<Value> = s
        .store
        .events()
        .into_iter()
        .filter(|e| e["type"] == "Warning")
        .collect();
    assert!(
        warnings
            .iter()
            .any(|e| e["note"].as_str().is_some_and(|n| n.contains("spec"))),
        "a Warning event with the plugin's message: {warnings:?}"
    );
}

#[tokio::test]
async fn a_plugin_that_declares_no_finalizer_releases_the_hosts() {
    let s = Scenario::new("widget");
    let w = s.create("w", json!({"count": 1}));
    s.store
        .update(&w, |o| o["metadata"]["finalizers"] = json!([FINALIZER]));
    let mark = s.mark();
    assert_eq!(s.reconcile(&w).await, Action::await_change());
    assert_eq!(s.writes_since(mark), ["patch widgets/w"]);
    let finalizers = s.store.get(&w).unwrap()["metadata"]["finalizers"].clone();
    assert!(
        finalizers.as_array().is_none_or(|f| f.is_empty()),
        "{finalizers}"
    );
}

#[tokio::test]
async fn parents_that_come_and_go_leave_nothing_behind() {
    // 300 by default, to stay within seconds; CAPSTAN_CHURN_PARENTS for a longer run.
    let parents: usize = std::env::var("CAPSTAN_CHURN_PARENTS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(300);
    let mut s = Scenario::new("widget");
    for i in 0..parents {
        let w = s.create(&format!("w{i}"), json!({"count": 2}));
        s.reconcile(&w).await;
        s.catch_up();
        s.reconcile(&w).await;
        // Deleted by its user: no finalizer, so no reconcile sees it go; the garbage
        // collector deletes its children, the watches tell the caches.
        let uid = s.store.get(&w).unwrap()["metadata"]["uid"].clone();
        s.store.delete(&w);
        assert_eq!(s.store.collect_garbage(), 2);
        s.catch_up();
        s.own_writes.forget(uid.as_str().unwrap());
    }
    assert_eq!(s.store.object_count(), 0);
    assert_eq!(s.own_writes.len(), 0);
    assert_eq!(s.feeds.iter().map(|(f, _)| f.objects()).sum::<usize>(), 0);
    let tracked = s.tracked();
    assert_eq!(
        (tracked.expectations, tracked.failures),
        (0, 0),
        "{tracked:?}"
    );
    // What the host applied to children that are gone is forgotten by the next sweep,
    // once its period has passed.
    assert!(tracked.applied <= 2 * parents, "{tracked:?}");
    s.ctx.make_sweeps_due();
    let last = s.create("last", json!({"count": 2}));
    s.reconcile(&last).await;
    assert_eq!(
        s.tracked(),
        Tracked {
            expectations: 1,
            applied: 2,
            failures: 0
        },
        "only what the one parent left has written"
    );
}

#[tokio::test]
async fn a_child_kind_is_watched_while_a_running_plugin_declares_it() {
    let store = Store::new();
    let (client, _) = store.client();
    let metrics = Arc::new(Metrics::default());
    let caches = Caches::new(client.clone(), None, None, metrics.clone(), None);
    let opts = ControllerOptions {
        identities: None,
        namespace: None,
        default_resync: Duration::from_secs(600),
        concurrency: 1,
        fence: WriteFence::default(),
        shard: None,
        force_release: Default::default(),
        instance: None,
    };
    let (_widget_sandbox, widget) = load("widget"); // ConfigMap, Service
    let (_guard_sandbox, guard) = load("guard"); // ConfigMap
    let start = |p: &Plugin| {
        RunningController::start(
            client.clone(),
            p.clone(),
            metrics.clone(),
            &caches,
            &opts,
            Default::default(),
        )
    };
    for _ in 0..50 {
        let w = start(&widget);
        let g = start(&guard);
        assert_eq!(caches.children.watched(), ["v1/ConfigMap", "v1/Service"]);
        w.stop().await;
        assert_eq!(
            caches.children.watched(),
            ["v1/ConfigMap"],
            "guard still declares it"
        );
        // A new version of the widget plugin, while the guard runs.
        let w = start(&widget);
        assert_eq!(caches.children.watched(), ["v1/ConfigMap", "v1/Service"]);
        g.stop().await;
        w.stop().await;
        assert!(caches.children.watched().is_empty());
    }
}

/// A PostgreSQL instance Pod as the related cache shows it.
fn instance_pod(name: &str, ready: bool) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "uid": format!("uid-{name}"), "resourceVersion": "1",
                     "labels": {"app.kubernetes.io/name": "postgresql", "app.kubernetes.io/instance": "pg"}},
        "status": {"podIP": "10.1.0.1",
                   "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]},
    }))
    .unwrap()
}

fn topology_of(s: &Scenario) -> String {
    let path = fake_api::path("v1", "configmaps", Some(NS), "pg-topology");
    let cm = s.store.get(&path).expect("the topology ConfigMap");
    cm["data"]["topology"]
        .as_str()
        .unwrap()
        .lines()
        .filter(|l| l.starts_with("epoch=") || l.starts_with("primary="))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The PostgreSQL plugin's failover decision, taken on caches that lag: another host
/// (a leader before this one) already promoted pg-1 in epoch 2, which this host's
/// ConfigMap cache does not show yet. Its own decision from the stale view (epoch 2,
/// pg-2) is refused by the API server, since it carries the version it observed, and
/// nothing else is written; on the caught-up view it takes no decision at all.
#[tokio::test]
async fn a_failover_decision_is_never_taken_on_a_stale_cache() {
    let kind = crate::contract::KindRef {
        group: String::new(),
        version: "v1".into(),
        kind: "Pod".into(),
        plural: "pods".into(),
        namespaced: true,
    };
    let mut pods = super::related::Feed::new(&kind);
    pods.list(["pg-0", "pg-1", "pg-2"].map(|n| instance_pod(n, true)));
    let mut s = Scenario::with(
        load_file(crate::fixtures::plugin("postgresql")),
        Some(&pods),
    );
    let pg = s.create(
        "pg",
        json!({"instances": 3, "version": "16.15", "storage": {"size": "1Gi"},
               "synchronous": true, "failoverDelay": 0}),
    );
    for _ in 0..3 {
        s.reconcile(&pg).await;
        s.catch_up();
    }
    assert_eq!(topology_of(&s), "epoch=1 primary=pg-0");
    assert_eq!(
        s.store.get(&pg).unwrap()["status"]["currentPrimary"],
        "pg-0"
    );

    // Meanwhile, elsewhere: pg-0 was lost and another host named pg-1 (epoch 2). This
    // host's ConfigMap cache still shows epoch 1; its Pod cache shows pg-0 and pg-1 not
    // ready, pg-2 ready (pg-1 is being promoted).
    let topology = fake_api::path("v1", "configmaps", Some(NS), "pg-topology");
    s.store.update(&topology, |cm| {
        let text = cm["data"]["topology"]
            .as_str()
            .unwrap()
            .replace("epoch=1\nprimary=pg-0\n", "epoch=2\nprimary=pg-1\n");
        cm["data"]["topology"] = json!(text);
    });
    pods.applied(instance_pod("pg-0", false));
    pods.applied(instance_pod("pg-1", false));
    let mark = s.mark();
    s.reconcile(&pg).await;
    s.reconcile(&pg).await;
    assert_eq!(
        topology_of(&s),
        "epoch=2 primary=pg-1",
        "the other host's decision stands"
    );
    let writes = s.writes_since(mark);
    assert!(
        writes.iter().all(|w| w == "write configmaps/pg-topology"),
        "a refused decision writes nothing else: {writes:?}"
    );
    assert!(
        !writes.is_empty(),
        "the stale decision was sent, and refused (the store is unchanged)"
    );

    // Caught up: epoch 2 names pg-1, which is being promoted; nothing to decide (the
    // ConfigMap may be applied once more, unchanged, at the version now observed).
    s.catch_up();
    s.reconcile(&pg).await;
    assert_eq!(topology_of(&s), "epoch=2 primary=pg-1");
    assert_eq!(s.store.get(&pg).unwrap()["status"]["targetPrimary"], "pg-1");
    assert_eq!(s.store.get(&pg).unwrap()["status"]["epoch"], 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shadow_version_is_compared_on_every_reconcile_and_never_applied() {
    use crate::fixtures::{plugin, uuid_other_build};
    let s = Scenario::with(load_file(plugin("uuid")), None);
    let metrics = s.served_as_a_file();
    // 100 Uuids; 99 reconciled by the serving version (they hold their UUID in the
    // status), one not yet.
    let names: Vec<String> = (0..100).map(|i| format!("u-{i:03}")).collect();
    let paths: Vec<String> = names.iter().map(|n| s.create(n, json!({}))).collect();
    for path in paths.iter().filter(|p| !p.ends_with("u-042")) {
        s.reconcile(path).await;
    }
    // The same plugin built another way, as the shadow: it agrees wherever the status
    // holds a UUID, and draws another one where it does not (on u-042).
    let (_shadow_sandbox, shadow) = load_file(uuid_other_build());
    assert_ne!(shadow.sha256(), s.plugin.sha256());
    metrics.set_shadow(
        SERVING_FILE,
        "/plugins/serving.next.wasm",
        shadow.sha256(),
        None,
    );
    s.shadow.set(Some(shadow), None);
    let mark = s.mark();
    for path in &paths {
        s.reconcile(path).await;
    }
    // Written: only the serving version's status of u-042.
    let writes = s.writes_since(mark);
    assert_eq!(writes.len(), 1, "{writes:?}");
    assert!(writes[0].contains("u-042"), "{writes:?}");
    let text = metrics.render();
    for (result, count) in [("agreed", 99), ("diverged", 1)] {
        let line = format!(
            "capstan_shadow_reconciles_total{{plugin=\"uuid\",result=\"{result}\"}} {count}\n"
        );
        assert!(text.contains(&line), "{line} missing:\n{text}");
    }
    let plugins: Value = serde_json::from_str(&metrics.plugins_json()).unwrap();
    let report = &plugins[0]["shadow"];
    assert_eq!(report["file"], "/plugins/serving.next.wasm", "{plugins}");
    assert_eq!(report["diverged"], 1, "{plugins}");
    assert_eq!(
        report["divergent"],
        json!({"ns/u-042": "status.uuid"}),
        "exactly that parent, with its first difference"
    );
    // Without the shadow: nothing is called or counted any more.
    s.shadow.set(None, None);
    for path in &paths[..3] {
        s.reconcile(path).await;
    }
    assert!(
        metrics
            .render()
            .contains("capstan_shadow_reconciles_total{plugin=\"uuid\",result=\"agreed\"} 99\n")
    );
}

/// A canary candidate on half the parents (by their UID), judged on 5 reconciles.
fn canary_of(candidate: &Plugin, steps: Vec<u8>, step: Duration) -> Arc<Canary> {
    let policy = CanaryPolicy::new(steps, step, 5.0, 5).unwrap();
    Arc::new(Canary::new(
        policy,
        "/plugins/serving.next.wasm",
        candidate.sha256(),
    ))
}

fn uid_of(s: &Scenario, path: &str) -> String {
    s.store.get(path).unwrap()["metadata"]["uid"]
        .as_str()
        .unwrap()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_canary_that_fails_more_than_the_serving_version_is_rolled_back_and_says_so() {
    let mut s = Scenario::new("widget");
    let metrics = s.served_as_a_file();
    let names: Vec<String> = (0..40).map(|i| format!("w-{i:02}")).collect();
    let paths: Vec<String> = names
        .iter()
        .map(|n| s.create(n, json!({"count": 1})))
        .collect();
    // The new version refuses itself on every parent (a child in another namespace).
    let (_candidate_sandbox, candidate) = load_file(crate::fixtures::test_plugin("widget-broken"));
    let canary = canary_of(&candidate, vec![50, 100], Duration::from_secs(3600));
    metrics.set_shadow(
        SERVING_FILE,
        "/plugins/serving.next.wasm",
        candidate.sha256(),
        Some(canary.clone() as Arc<dyn super::metrics::Report>),
    );
    s.shadow.set(Some(candidate), Some(canary.clone()));
    let in_share: Vec<&String> = paths
        .iter()
        .filter(|p| super::rollout::canary::in_share(&uid_of(&s, p), 50))
        .collect();
    assert!(
        (10..=30).contains(&in_share.len()),
        "about half of 40: {}",
        in_share.len()
    );

    // The serving version's parents first, then the candidate's: the fifth of its
    // reconciles, all failed, rolls it back.
    for path in paths.iter().filter(|p| !in_share.contains(p)) {
        s.reconcile(path).await;
    }
    for path in &in_share[..4] {
        s.reconcile(path).await;
    }
    assert_eq!(canary.percent(), 50, "four reconciles do not judge it");
    s.reconcile(in_share[4]).await;
    assert_eq!(canary.percent(), 0, "rolled back on the fifth");
    let report = canary.report();
    let super::rollout::canary::Phase::RolledBack { reason } = &report.phase else {
        panic!("{report:?}");
    };
    assert!(reason.contains("(5 of 5)"), "{reason}");
    assert!(
        reason.contains("in namespace"),
        "the candidate's error: {reason}"
    );
    for (name, line) in [
        (
            "rollbacks",
            "capstan_canary_rollbacks_total{plugin=\"widget\"} 1\n",
        ),
        (
            "share",
            "capstan_canary_share_percent{plugin=\"widget\"} 0\n",
        ),
        (
            "candidate failures",
            "capstan_canary_reconciles_total{plugin=\"widget\",version=\"candidate\",result=\"failed\"} 5\n",
        ),
    ] {
        let text = metrics.render();
        assert!(text.contains(line), "{name}: {line} missing:\n{text}");
    }
    let plugins: Value = serde_json::from_str(&metrics.plugins_json()).unwrap();
    assert_eq!(plugins[0]["canary"]["phase"], "rolled-back", "{plugins}");
    assert_eq!(plugins[0]["canary"]["candidate"]["failed"], 5, "{plugins}");

    // Every parent is the serving version's again: its children written, the five the
    // candidate failed on told why, the others not.
    s.catch_up();
    for path in &paths {
        s.reconcile(path).await;
    }
    s.catch_up();
    for (name, path) in names.iter().zip(&paths) {
        assert!(
            s.store.get(&cm(name, 0)).is_some(),
            "{name}: its ConfigMap, by the serving version"
        );
        let ready = s.store.get(path).unwrap()["status"]["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c["type"] == "Ready" && c["status"] == "True");
        assert!(ready, "{name} is Ready again");
    }
    let told: BTreeSet<String> = s
        .store
        .events()
        .into_iter()
        .filter(|e| e["reason"] == "CanaryRolledBack")
        .map(|e| {
            assert_eq!(e["type"], "Warning");
            assert!(e["note"].as_str().unwrap().contains("rolled back"), "{e}");
            e["regarding"]["name"].as_str().unwrap().to_string()
        })
        .collect();
    let failed: BTreeSet<String> = in_share[..5]
        .iter()
        .map(|p| p.rsplit('/').next().unwrap().to_string())
        .collect();
    assert_eq!(told, failed, "exactly the parents the candidate served");
}

/// A parent store of `n` Widgets `w-<i>` with UIDs `uid-<i>`, as the controller's
/// reflector holds them.
fn widget_store(
    serving: &Plugin,
    n: usize,
) -> (
    kube::runtime::reflector::Store<CachedParent>,
    super::parent::ParentKind,
    Vec<String>,
) {
    use kube::runtime::reflector::store::Writer;
    use kube::runtime::watcher;
    let resource = super::kinds::api_resource(&serving.info().parent);
    let kind = super::parent::ParentKind::new(resource.clone());
    let mut writer = Writer::new(kind.clone());
    let uids: Vec<String> = (0..n).map(|i| format!("uid-{i}")).collect();
    for (i, uid) in uids.iter().enumerate() {
        let mut obj = DynamicObject::new(&format!("w-{i}"), &resource).within(NS);
        obj.metadata.uid = Some(uid.clone());
        writer.apply_watcher_event(&watcher::Event::Apply(CachedParent::new(obj)));
    }
    (writer.as_reader(), kind, uids)
}

/// The names sent on `rx` within `within`.
async fn sent(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<
        kube::runtime::reflector::ObjectRef<CachedParent>,
    >,
    within: Duration,
) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let deadline = tokio::time::Instant::now() + within;
    while let Ok(Some(r)) = tokio::time::timeout_at(deadline, rx.recv()).await {
        names.insert(r.name.clone());
    }
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_canary_rolled_back_before_the_driver_looked_still_sends_its_parents_back() {
    let (_sandbox, serving) = load("widget");
    let (_candidate_sandbox, candidate) = load("widget-broken");
    let (store, kind, uids) = widget_store(&serving, 20);
    let slot = ShadowSlot::new(std::path::Path::new(SERVING_FILE));
    let canary = canary_of(&candidate, vec![50, 100], Duration::from_secs(3600));
    // As a reconcile does before it asks whom a parent goes to.
    canary.check(&serving, candidate.info());
    slot.set(Some(candidate), Some(canary.clone()));
    // Its first reconciles fail and roll it back at once, before any look.
    let served: Vec<&String> = uids
        .iter()
        .filter(|u| super::rollout::canary::in_share(u, 50))
        .take(5)
        .collect();
    assert_eq!(served.len(), 5);
    for uid in &served {
        canary.record(
            super::rollout::canary::Version::Candidate,
            uid,
            Some("refused"),
        );
    }
    assert_eq!(canary.percent(), 0);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let driver = tokio::spawn(super::rollout::driver::drive(
        slot.clone(),
        serving,
        store,
        kind,
        tx,
        Arc::new(Metrics::default()),
    ));
    let expected: BTreeSet<String> = served
        .iter()
        .map(|u| format!("w-{}", u.trim_start_matches("uid-")))
        .collect();
    assert_eq!(sent(&mut rx, Duration::from_millis(1500)).await, expected);
    // Once: not again at every look.
    assert_eq!(
        sent(&mut rx, Duration::from_millis(1500)).await,
        BTreeSet::new()
    );
    driver.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_canary_steps_up_on_its_schedule_and_each_step_reconciles_the_parents_it_moves() {
    let (_sandbox, serving) = load("widget");
    let (_candidate_sandbox, candidate) = load("widget");
    let (store, kind, uids) = widget_store(&serving, 20);
    let name_of = |uid: &str| format!("w-{}", uid.trim_start_matches("uid-"));
    let half: BTreeSet<String> = uids
        .iter()
        .filter(|u| super::rollout::canary::in_share(u, 50))
        .map(|u| name_of(u))
        .collect();
    assert!(!half.is_empty() && half.len() < 20, "{half:?}");
    let rest: BTreeSet<String> = uids
        .iter()
        .map(|u| name_of(u))
        .filter(|n| !half.contains(n))
        .collect();

    let slot = ShadowSlot::new(std::path::Path::new(SERVING_FILE));
    let canary = canary_of(&candidate, vec![50, 100], Duration::from_millis(400));
    slot.set(Some(candidate), Some(canary.clone()));
    let metrics = Arc::new(Metrics::default());
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let driver = tokio::spawn(super::rollout::driver::drive(
        slot.clone(),
        serving,
        store,
        kind,
        tx,
        metrics.clone(),
    ));
    let mut sent = async |within: Duration| sent(&mut rx, within).await;
    // The first step: the half, at once.
    assert_eq!(sent(Duration::from_millis(300)).await, half);
    assert_eq!(canary.percent(), 50);
    // The step ends (a healthy candidate, nothing failed): the other half moves.
    assert_eq!(sent(Duration::from_millis(400)).await, rest);
    assert_eq!(canary.percent(), 100);
    // Past the last step: promoted, nobody moves.
    assert_eq!(sent(Duration::from_millis(500)).await, BTreeSet::new());
    assert_eq!(
        canary.report().phase,
        super::rollout::canary::Phase::Promoted
    );
    assert!(
        metrics
            .render()
            .contains("capstan_canary_share_percent{plugin=\"widget\"} 100\n")
    );
    // The file is removed: every parent goes back to the serving version, at once.
    slot.set(None, None);
    let all: BTreeSet<String> = half.union(&rest).cloned().collect();
    assert_eq!(sent(Duration::from_millis(400)).await, all);
    driver.abort();
}

#[tokio::test]
async fn a_child_forged_with_the_parents_owner_reference_is_a_conflict_never_used() {
    let mut s = Scenario::new("widget");
    let w = s.create("w", json!({"count": 1, "message": "hi"}));
    let uid = s.store.get(&w).unwrap()["metadata"]["uid"].clone();
    // Before the parent's first reconcile, a user who may create ConfigMaps (or Secrets)
    // writes its first child, naming the parent as its controller.
    s.store.create(
        &configmaps(),
        json!({"apiVersion": "v1", "kind": "ConfigMap",
               "metadata": {"name": "w-0", "labels": {"app.kubernetes.io/managed-by": "capstan"},
                   "ownerReferences": [{"apiVersion": "test.capstan.dev/v1", "kind": "Widget",
                       "name": "w", "uid": uid, "controller": true}]},
               "data": {"password": "chosen-by-the-user"}}),
    );
    s.catch_up_only(&cm("w", 0));
    s.reconcile(&w).await;
    let forged = s.store.get(&cm("w", 0)).unwrap();
    assert_eq!(
        forged["data"],
        json!({"password": "chosen-by-the-user"}),
        "the forged child was written to"
    );
    assert!(
        forged["metadata"].get("managedFields").is_none(),
        "no apply of the host's reached it: {forged}"
    );
    let status = s.store.get(&w).unwrap()["status"].clone();
    let ready = &status["conditions"][0];
    assert_eq!(ready["type"], "Ready", "{status}");
    assert_eq!(ready["status"], "False", "{status}");
    assert_eq!(ready["reason"], "ChildConflict", "{status}");
    assert!(
        ready["message"]
            .as_str()
            .is_some_and(|m| m.contains("though Capstan never wrote it")),
        "{status}"
    );
    assert!(
        s.store
            .event_reasons()
            .contains(&"ChildConflict".to_string())
    );
}
