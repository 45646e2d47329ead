//! One `kube::runtime::Controller` per loaded plugin: it watches the parent kind (spec
//! and deletion changes only, never status-only changes) and is told of changes to its
//! children by the shared child caches ([`super::children`], mapped to parents through
//! their controller references), and runs [`reconcile`] for each.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use kube::api::Api;
use kube::runtime::controller::{Config as ControllerConfig, Controller};
use kube::runtime::reflector::{self, ObjectRef, store::Writer};
use kube::runtime::{PredicateConfig, WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use tokio::task::JoinHandle;

use super::children::{ChildCaches, ControllerRef, KindCache, KindWatch};
use super::cluster::{ChildKinds, ClusterWrites};
use super::finalizers::{FORCE_RELEASE_ANNOTATION, ForceRelease, ReleaseScope};
use super::freshness::OwnWrites;
use super::identity::PluginIdentities;
use super::kinds::api_resource;
use super::leader::WriteFence;
use super::metrics::Metrics;
use super::parent::{CachedParent, ParentKind};
use super::reconcile::{self, Context};
use super::related::{Key as RelatedKey, RelatedCache, RelatedCaches, RelatedWatch};
use super::rollout::driver;
use super::rollout::slot::ShadowSlot;
use super::watch_client::watch_client;
use crate::contract::KindRef;
use crate::plugin::Plugin;
use crate::shard::{Buckets, bucket_of};

/// Options shared by every controller.
#[derive(Debug, Clone)]
pub struct ControllerOptions {
    /// Watch only this namespace.
    pub namespace: Option<String>,
    /// Resync period when the plugin sets none.
    pub default_resync: Duration,
    /// How many parents of one plugin may be reconciled at once.
    pub concurrency: u16,
    /// Shut while this replica is not (or can no longer prove to be) the leader: every
    /// write of a reconcile asks it first.
    pub fence: WriteFence,
    /// With `--shards`: watch only the parents of these buckets, and their children.
    pub shard: Option<Buckets>,
    /// Parents being deleted that lose the host's finalizer without `finalize`
    /// (`--force-release-finalizers`, or annotated).
    pub force_release: ForceRelease,
    /// This replica's name in the events it posts (the Pod's name in a cluster).
    pub instance: Option<String>,
    /// With `--plugin-identities`: each plugin's requests are made as its own
    /// ServiceAccount ([`super::identity`]); none: as the host.
    pub identities: Option<PluginIdentities>,
}

impl ControllerOptions {
    /// The scope in which the finalizers of a kind these controllers served are released.
    pub fn release_scope(&self) -> ReleaseScope {
        ReleaseScope {
            namespace: self.namespace.clone(),
            shard: self.shard,
            fence: self.fence.clone(),
            force_release: self.force_release.clone(),
            instance: self.instance.clone(),
            identities: self.identities.clone(),
        }
    }
}

/// The caches every controller shares: of the child kinds and of the related kinds.
pub struct Caches {
    /// Children, filtered to what Capstan manages, indexed by controller.
    pub children: ChildCaches,
    /// Related objects, by name and label, with who needs them.
    pub related: RelatedCaches,
}

impl Caches {
    /// No cache yet; `namespace` limits namespaced kinds to one namespace, `shard` the
    /// children to those of its buckets' parents (related objects are not sharded: a
    /// replica's parents may name any of them).
    pub fn new(
        client: Client,
        namespace: Option<String>,
        shard: Option<Buckets>,
        metrics: Arc<Metrics>,
        identities: Option<PluginIdentities>,
    ) -> Self {
        Caches {
            children: ChildCaches::new(
                client.clone(),
                namespace.clone(),
                shard,
                metrics.clone(),
                identities.clone(),
            ),
            related: RelatedCaches::new(client, namespace, metrics, identities),
        }
    }
}

/// A running controller; stopping it aborts its task and lets go of its child and
/// related kinds' watches (a kind no other controller declares is no longer watched).
pub struct RunningController {
    task: JoinHandle<()>,
    /// Steps a canary of this plugin up on its schedule.
    canary_driver: JoinHandle<()>,
    /// Held for as long as the controller runs.
    watches: Vec<KindWatch>,
    /// Held for as long as the controller runs; dropping one forgets its parents'
    /// requests.
    related: Vec<RelatedWatch>,
}

impl RunningController {
    /// Starts the controller of `plugin`; its children come from `caches`.
    pub fn start(
        client: Client,
        plugin: Plugin,
        metrics: Arc<Metrics>,
        caches: &Caches,
        opts: &ControllerOptions,
        shadow: ShadowSlot,
    ) -> Self {
        let info = plugin.info().clone();
        // The parents' watch and every write of the plugin's reconciles, as the plugin.
        let client = match &opts.identities {
            Some(identities) => identities.client_of(&client, &info.name),
            None => client,
        };
        // The related kinds first: a parent that goes away forgets its requests. Secrets
        // are watched only with the labels the plugin's grant names.
        let grant = plugin.limits_file().grant.unwrap_or_default();
        let (related_changes, related_rx) = tokio::sync::mpsc::unbounded_channel();
        let related: Vec<RelatedWatch> = info
            .related
            .iter()
            .map(|k| {
                caches.related.watch(
                    k,
                    &info.name,
                    grant.related_labels(k),
                    related_changes.clone(),
                )
            })
            .collect();
        drop(related_changes);
        let related_caches: Vec<(Arc<RelatedCache>, u64)> = related
            .iter()
            .map(|w| (w.cache().clone(), w.subscriber()))
            .collect();
        let forget = related_caches.clone();
        let parent_kind = ParentKind::new(api_resource(&info.parent));
        let shard = opts.shard;
        let watch = watch_client(
            &client,
            opts.shard.and_then(Buckets::shard_selector),
            metrics.watch_bytes("parents"),
        );
        let api = match (&opts.namespace, info.parent.namespaced) {
            (Some(ns), true) => Api::<CachedParent>::namespaced_with(watch, ns, &parent_kind),
            _ => Api::<CachedParent>::all_with(watch, &parent_kind),
        };
        let writer = Writer::new(parent_kind.clone());
        let reader = writer.as_reader();
        let kind_name = info.parent.to_string();
        let watch_metrics = metrics.clone();
        // The host's own parent writes, until this watch delivers them.
        let own_writes = Arc::new(OwnWrites::default());
        let delivered = own_writes.clone();
        let parents = reflector::reflector(
            writer,
            // CachedParent drops the managedFields: a plugin never sees them.
            watcher(api, watcher::Config::default())
                .default_backoff()
                // The API server sends only this replica's buckets; should it stop
                // honouring the selector (restarted without the feature gate, a watch
                // resumed there), the others' parents still go no further.
                .try_filter(move |event| std::future::ready(in_shard(shard, event)))
                .inspect_ok(move |event| match event {
                    watcher::Event::Apply(o) | watcher::Event::InitApply(o) => delivered.seen(o),
                    watcher::Event::Delete(o) => {
                        delivered.forget(o.meta().uid.as_deref().unwrap_or_default());
                        let key = (
                            o.meta().namespace.clone(),
                            o.meta().name.clone().unwrap_or_default(),
                        );
                        for (cache, subscriber) in &forget {
                            cache.forget(*subscriber, &key);
                        }
                    }
                    watcher::Event::Init | watcher::Event::InitDone => {}
                })
                .inspect_err(move |e| {
                    tracing::warn!(kind = %kind_name, "watch of {kind_name} failed: {e}");
                    watch_metrics.watch_failed(&kind_name, None);
                }),
        );
        let parents = parent_changes(parents, reader.clone(), parent_kind.clone());

        let children = ChildKinds::new(&info.children);
        let watches: Vec<KindWatch> = info
            .children
            .iter()
            .map(|k| caches.children.watch(k, &info.name))
            .collect();
        let kind_caches: Vec<Arc<KindCache>> = watches.iter().map(|w| w.cache().clone()).collect();
        let mut triggers: Vec<futures::stream::BoxStream<'static, ObjectRef<CachedParent>>> =
            kind_caches
                .iter()
                .map(|cache| parents_of_changes(cache, &info.parent, parent_kind.clone()))
                .collect();
        let related_kind = parent_kind.clone();
        triggers.push(
            tokio_stream_of(related_rx)
                .map(move |(ns, name): RelatedKey| {
                    let r = ObjectRef::new_with(&name, related_kind.clone());
                    match ns {
                        Some(ns) => r.within(&ns),
                        None => r,
                    }
                })
                .boxed(),
        );
        // The parents whose version a canary changes (a step, a rollback).
        let (canary_changes, canary_rx) = tokio::sync::mpsc::unbounded_channel();
        triggers.push(tokio_stream_of(canary_rx).boxed());
        let triggers = futures::stream::select_all(triggers);
        let canary_driver = tokio::spawn(driver::drive(
            shadow.clone(),
            plugin.clone(),
            reader.clone(),
            parent_kind.clone(),
            canary_changes,
            metrics.clone(),
        ));
        let controller = Controller::for_stream_with(parents, reader, parent_kind.clone())
            .with_config(ControllerConfig::default().concurrency(opts.concurrency))
            .reconcile_on(triggers);
        let ctx = Arc::new(
            Context::new(
                plugin.clone(),
                ClusterWrites::new(client.clone(), &info.parent, &info.name, opts.fence.clone())
                    .reporting_as(opts.instance.as_deref()),
                children,
                kind_caches,
                own_writes,
                metrics,
                opts.default_resync,
            )
            .with_force_release(opts.force_release.clone())
            .with_related(related_caches)
            .with_shadow(shadow),
        );
        let name = info.name.clone();
        let task = tokio::spawn(async move {
            tracing::info!(plugin = %name, kind = %info.parent, "controller started");
            controller
                .run(reconcile::reconcile, reconcile::error_policy, ctx)
                .for_each(|result| async move {
                    if let Err(err) = result {
                        tracing::debug!("controller: {err}");
                    }
                })
                .await;
        });
        RunningController {
            task,
            canary_driver,
            watches,
            related,
        }
    }

    /// Whether the controller's task ended (it only ends when stopped, or on a panic).
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Stops the controller and waits until its task is gone, so that no reconcile of
    /// the old version overlaps one of a new version.
    pub async fn stop(self) {
        self.canary_driver.abort();
        self.task.abort();
        let _ = self.task.await;
        let _ = self.canary_driver.await;
        drop(self.watches);
        drop(self.related);
    }
}

/// The parents (of kind `parent`) whose children changed in `cache`.
fn parents_of_changes(
    cache: &KindCache,
    parent: &KindRef,
    parent_kind: ParentKind,
) -> futures::stream::BoxStream<'static, ObjectRef<CachedParent>> {
    let changes = tokio_stream_of(cache.subscribe(parent));
    changes
        .map(move |owner: ControllerRef| {
            let r = ObjectRef::new_with(&owner.name, parent_kind.clone());
            match owner.namespace {
                Some(ns) => r.within(&ns),
                None => r,
            }
        })
        .boxed()
}

/// The messages of `rx` as a stream, until it closes.
fn tokio_stream_of<T: Send + 'static>(
    rx: tokio::sync::mpsc::UnboundedReceiver<T>,
) -> impl futures::Stream<Item = T> + Send {
    futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) })
}

/// The parents to reconcile, from the parent watch's events once the reflector's store
/// took them in: a new parent, a new generation, the start of a deletion
/// ([`spec_or_deletion`]).
///
/// Not kube's `applied_objects`: it yields a re-list's objects as they arrive, while the
/// store swaps them in only when the re-list ends. A reconcile the controller starts in
/// between finds nothing in the store and is dropped (`ObjectNotFound`), and the
/// predicate, having seen the object, never lets it through again: a parent created
/// while the watch was down (an API server restart) was never reconciled. Here a
/// re-list's parents are passed on when it ends, as `store` then holds them: only their
/// names are kept meanwhile, and each is taken from the store as the controller asks
/// for the next one, so no second copy of every parent is held.
fn parent_changes<E>(
    events: impl futures::Stream<Item = Result<watcher::Event<CachedParent>, E>> + Send,
    store: reflector::Store<CachedParent>,
    kind: ParentKind,
) -> impl futures::Stream<Item = Result<CachedParent, watcher::Error>> + Send
where
    E: Into<watcher::Error>,
{
    use futures::future::Either;
    let none = || Either::Left(futures::stream::iter(None));
    let one = |change| Either::Left(futures::stream::iter(Some(change)));
    events
        .scan(Vec::new(), move |relisted, event| {
            let changes = match event {
                Ok(watcher::Event::Apply(o)) => one(Ok(o)),
                Ok(watcher::Event::Init) => {
                    relisted.clear();
                    none()
                }
                Ok(watcher::Event::InitApply(o)) => {
                    let r = ObjectRef::new_with(&o.name_any(), kind.clone());
                    relisted.push(match o.namespace() {
                        Some(ns) => r.within(&ns),
                        None => r,
                    });
                    none()
                }
                Ok(watcher::Event::InitDone) => {
                    let store = store.clone();
                    Either::Right(futures::stream::iter(std::mem::take(relisted)).filter_map(
                        move |r| std::future::ready(store.get(&r).map(|p| Ok((*p).clone()))),
                    ))
                }
                Ok(watcher::Event::Delete(_)) => none(),
                Err(e) => one(Err(e.into())),
            };
            std::future::ready(Some(changes))
        })
        .flatten()
        .predicate_filter(spec_or_deletion, PredicateConfig::default())
}

/// Whether a parent watch event is of a parent in `shard` (always, unsharded). Only
/// events that carry an object can fall outside.
fn in_shard(shard: Option<Buckets>, event: &watcher::Event<CachedParent>) -> bool {
    let (
        Some(buckets),
        watcher::Event::Apply(o) | watcher::Event::InitApply(o) | watcher::Event::Delete(o),
    ) = (shard, event)
    else {
        return true;
    };
    buckets.contains(bucket_of(o.meta().uid.as_deref().unwrap_or_default()))
}

/// Reconcile on a new object, a new generation (spec change), the start of deletion or
/// the force-release annotation; status-only changes do not pass, so status writes
/// never trigger reconciles.
fn spec_or_deletion(obj: &CachedParent) -> Option<u64> {
    let obj = obj.meta();
    let mut h = DefaultHasher::new();
    obj.uid.hash(&mut h);
    obj.generation.hash(&mut h);
    obj.deletion_timestamp.is_some().hash(&mut h);
    // An administrator letting a parent being deleted go acts at once.
    obj.annotations
        .as_ref()
        .and_then(|a| a.get(FORCE_RELEASE_ANNOTATION))
        .hash(&mut h);
    Some(h.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    use kube::api::{ApiResource, DynamicObject};

    /// The test parents' kind (any will do).
    fn config_maps() -> ApiResource {
        ApiResource::erase::<k8s_openapi::api::core::v1::ConfigMap>(&())
    }

    fn parent(uid: &str) -> CachedParent {
        let mut o = DynamicObject::new("p", &config_maps());
        o.metadata.uid = Some(uid.into());
        CachedParent::new(o)
    }

    /// Parent `name` of namespace `ns`, at `generation`.
    fn named(name: &str, generation: i64) -> CachedParent {
        let mut o = parent(&format!("uid-{name}")).to_dynamic(&ParentKind::new(config_maps()));
        o.metadata.name = Some(name.into());
        o.metadata.namespace = Some("ns".into());
        o.metadata.generation = Some(generation);
        CachedParent::new(o)
    }

    /// The parent watch's events go through the reflector and [`parent_changes`] into a
    /// controller, as in [`RunningController::start`]; the API server is the test's
    /// channel. A re-list that takes a while (a page after another) shows a parent the
    /// watch never delivered, and a new generation of one it did: both are reconciled,
    /// from the store's new content, once the re-list ends.
    #[tokio::test]
    async fn a_parent_first_seen_in_a_relist_is_reconciled_once_the_relist_ends() {
        let kind = ParentKind::new(config_maps());
        let (server, events) = futures::channel::mpsc::unbounded();
        let writer = Writer::new(kind.clone());
        let reader = writer.as_reader();
        let changes = parent_changes(
            reflector::reflector(writer, events.map(Ok::<_, watcher::Error>)),
            reader.clone(),
            kind.clone(),
        );
        let (seen, mut reconciled) = tokio::sync::mpsc::unbounded_channel::<(String, i64)>();
        let controller = Controller::for_stream_with(changes, reader, kind).run(
            |parent: Arc<CachedParent>, seen: Arc<tokio::sync::mpsc::UnboundedSender<_>>| async move {
                let meta = parent.meta();
                let _ = seen.send((meta.name.clone().unwrap_or_default(), meta.generation.unwrap_or_default()));
                Ok::<_, std::io::Error>(kube::runtime::controller::Action::await_change())
            },
            |_, _, _| kube::runtime::controller::Action::await_change(),
            Arc::new(seen),
        );
        let running = tokio::spawn(controller.for_each(|_| async {}));
        let send = |e| server.unbounded_send(e).expect("the controller listens");
        let next = async |reconciled: &mut tokio::sync::mpsc::UnboundedReceiver<_>| {
            tokio::time::timeout(Duration::from_secs(5), reconciled.recv())
                .await
                .expect("a reconcile within 5 s")
                .expect("the controller runs")
        };

        send(watcher::Event::Init);
        send(watcher::Event::InitApply(named("a", 1)));
        send(watcher::Event::InitDone);
        assert_eq!(next(&mut reconciled).await, ("a".to_string(), 1));

        // The watch ends (the API server restarts); "b" was created meanwhile and "a"
        // changed. The re-list's last page comes later.
        send(watcher::Event::Init);
        send(watcher::Event::InitApply(named("a", 2)));
        send(watcher::Event::InitApply(named("b", 1)));
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            reconciled.try_recv().is_err(),
            "nothing is reconciled from a store the re-list has not replaced yet"
        );
        send(watcher::Event::InitDone);
        let mut after = vec![next(&mut reconciled).await, next(&mut reconciled).await];
        after.sort();
        assert_eq!(after, [("a".to_string(), 2), ("b".to_string(), 1)]);

        // A watch event after the re-list: as before.
        send(watcher::Event::Apply(named("c", 1)));
        assert_eq!(next(&mut reconciled).await, ("c".to_string(), 1));
        running.abort();
    }

    #[test]
    fn events_of_other_buckets_are_dropped_whatever_the_server_sends() {
        let uid = "5f362ddd-9692-4340-be0c-be76df9a45cd";
        let mine = Buckets::NONE.with(bucket_of(uid));
        let other = Buckets::ALL.minus(mine);
        for event in [
            watcher::Event::Apply(parent(uid)),
            watcher::Event::InitApply(parent(uid)),
            watcher::Event::Delete(parent(uid)),
        ] {
            assert!(in_shard(Some(mine), &event));
            assert!(!in_shard(Some(other), &event));
            assert!(in_shard(None, &event), "unsharded: everything");
        }
        assert!(in_shard(Some(other), &watcher::Event::Init));
        assert!(in_shard(Some(other), &watcher::Event::InitDone));
    }

    #[test]
    fn the_force_release_annotation_triggers_a_reconcile_other_annotations_do_not() {
        let before = parent("5f362ddd");
        let with = |key: &str| {
            let mut o = before.to_dynamic(&ParentKind::new(config_maps()));
            o.metadata.annotations = Some([(key.to_string(), "true".to_string())].into());
            CachedParent::new(o)
        };
        assert_eq!(
            spec_or_deletion(&before),
            spec_or_deletion(&with("example.com/note"))
        );
        assert_ne!(
            spec_or_deletion(&before),
            spec_or_deletion(&with(FORCE_RELEASE_ANNOTATION))
        );
    }
}
