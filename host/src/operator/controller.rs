//! One `kube::runtime::Controller` per loaded plugin: it watches the parent kind (spec
//! and deletion changes only, never status-only changes) and every declared child kind
//! (mapped to parents through their ownerReferences), and runs [`reconcile`] for each.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kube::Client;
use kube::api::{Api, DynamicObject};
use kube::runtime::controller::{Config as ControllerConfig, Controller};
use kube::runtime::reflector::{self, store::Writer};
use kube::runtime::{PredicateConfig, WatchStreamExt, watcher};
use tokio::task::JoinHandle;

use super::cluster::{ChildKinds, ClusterWrites, api_resource};
use super::leader::WriteFence;
use super::metrics::Metrics;
use super::reconcile::{self, Context};
use crate::plugin::Plugin;

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
}

/// A running controller; stopping it aborts its task.
pub struct RunningController {
    task: JoinHandle<()>,
}

impl RunningController {
    /// Starts the controller of `plugin`.
    pub fn start(
        client: Client,
        plugin: Plugin,
        metrics: Arc<Metrics>,
        opts: &ControllerOptions,
    ) -> Self {
        let info = plugin.info().clone();
        let parent_ar = api_resource(&info.parent);
        let api =
            |ar: &kube::api::ApiResource, namespaced: bool| match (&opts.namespace, namespaced) {
                (Some(ns), true) => Api::<DynamicObject>::namespaced_with(client.clone(), ns, ar),
                _ => Api::<DynamicObject>::all_with(client.clone(), ar),
            };
        let writer = Writer::new(parent_ar.clone());
        let reader = writer.as_reader();
        let parents = reflector::reflector(
            writer,
            watcher(
                api(&parent_ar, info.parent.namespaced),
                watcher::Config::default(),
            ),
        )
        .default_backoff()
        .applied_objects()
        .predicate_filter(spec_or_deletion, PredicateConfig::default());

        let children = ChildKinds::new(&info.children);
        let mut controller = Controller::for_stream_with(parents, reader, parent_ar.clone())
            .with_config(ControllerConfig::default().concurrency(opts.concurrency));
        for (kind, ar) in children.iter() {
            controller = controller.owns_with(
                api(ar, kind.namespaced),
                ar.clone(),
                watcher::Config::default(),
            );
        }
        let ctx = Arc::new(Context::new(
            plugin.clone(),
            ClusterWrites::new(client.clone(), &info.parent, &info.name, opts.fence.clone()),
            children,
            metrics,
            opts.default_resync,
        ));
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
        RunningController { task }
    }

    /// Whether the controller's task ended (it only ends when stopped, or on a panic).
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Stops the controller and waits until its task is gone, so that no reconcile of
    /// the old version overlaps one of a new version.
    pub async fn stop(self) {
        self.task.abort();
        let _ = self.task.await;
    }
}

/// Reconcile on a new object, a new generation (spec change) or the start of deletion;
/// status-only changes do not pass, so status writes never trigger reconciles.
fn spec_or_deletion(obj: &DynamicObject) -> Option<u64> {
    let mut h = DefaultHasher::new();
    obj.metadata.uid.hash(&mut h);
    obj.metadata.generation.hash(&mut h);
    obj.metadata.deletion_timestamp.is_some().hash(&mut h);
    Some(h.finish())
}
