//! `capstan run`: the operator host. It serves every plugin of a directory, one
//! `kube::runtime::Controller` per plugin, and exposes health, metrics and plugin state.

#[cfg(test)]
mod agreement_tests;
mod children;
mod cluster;
mod controller;
mod failure;
#[cfg(test)]
mod fake_api;
mod fenced_client;
mod finalizers;
mod freshness;
mod http;
pub mod identity;
mod kinds;
mod leader;
mod membership;
mod metrics;
mod parent;
#[cfg(test)]
mod pipeline_tests;
pub mod preview;
mod reconcile;
mod registry;
mod related;
mod retry;
pub mod rollout;
pub mod source;
mod watch_client;
mod watch_pool;
pub mod webhook;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kube::Client;

pub use controller::ControllerOptions;
pub use fenced_client::{
    FenceLayer, FenceShut, Fenced, FencedStream, fenced_client, fenced_client_with_connections,
};
pub use finalizers::{FINALIZER, FORCE_RELEASE_ANNOTATION, ForceRelease};
pub use leader::{Deposed, LeaderElectionOptions, LeaseLock, WriteFence};
pub use membership::ShardOptions;
pub use metrics::{Metrics, PluginState};
pub use registry::{PendingReleases, PluginRegistry, RegistryOptions};
pub use webhook::{Reach, WebhookOptions, Webhooks};

use crate::plugin::Sandbox;
use crate::shard::{self, Buckets};
use membership::{Membership, after_renewal, before_renewal};

/// Everything `capstan run` needs.
#[derive(Debug, Clone)]
pub struct OperatorOptions {
    /// The plugin directory and controller options.
    pub registry: RegistryOptions,
    /// Where to serve `/metrics`, `/healthz`, `/readyz` and `/plugins`.
    pub metrics_addr: SocketAddr,
    /// Run controllers only while holding this Lease; none: always.
    pub leader_election: Option<LeaderElectionOptions>,
    /// Share the parents with the other replicas of a shard group (`--shards`); the
    /// registry's fence must then be one for leader election, opened by membership.
    pub shards: Option<ShardOptions>,
    /// The admission and conversion webhook for plugins that validate or convert; none:
    /// such plugins are refused.
    pub webhooks: Option<WebhookOptions>,
    /// With leader election or `--shards`: the configuration writes open connections
    /// of their own with, each write to their sockets checked against the fence
    /// ([`fenced_client_with_connections`]). None: writes share the client's
    /// connections and are checked once, before they queue for one.
    pub write_config: Option<kube::Config>,
}

/// Why the operator stopped, or could not start.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The plugin directory is missing (or not a directory).
    #[error("plugin directory {} does not exist", .0.display())]
    NoPluginDir(PathBuf),
    /// The `/metrics` and probes address could not be bound.
    #[error("cannot listen on {addr}")]
    Listen {
        /// The address asked for.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// This replica was leading and is no longer: it stops so that it restarts as a
    /// standby with fresh caches.
    #[error(transparent)]
    Deposed(#[from] Deposed),
    /// The plugin registry ended by itself (it panicked): nothing would load, reload or
    /// supervise plugins any more.
    #[error("{0}")]
    RegistryStopped(String),
    /// `--shards` could not check that the API server shards lists.
    #[error("cannot list Leases to check that the API server shards lists")]
    ShardProbe(#[source] kube::Error),
    /// The writes' own client could not be made from the configuration.
    #[error("cannot make the writes' client")]
    WriteClient(#[source] kube::Error),
    /// `--shards` against an API server that ignores `shardSelector`.
    #[error(
        "--shards needs an API server with the ShardedListAndWatch feature gate (Kubernetes 1.36+, alpha): \
         this one ignored the shardSelector of a LIST (no shardInfo in its answer), so every replica would \
         serve every parent; enable the gate on kube-apiserver or run with --leader-elect instead"
    )]
    ShardingUnsupported,
}

/// Runs the operator until `shutdown` resolves, then stops every controller.
pub async fn run(
    client: Client,
    sandbox: Sandbox,
    mut opts: OperatorOptions,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), Error> {
    let dir: PathBuf = opts.registry.dir.clone();
    if !dir.is_dir() {
        return Err(Error::NoPluginDir(dir));
    }
    let metrics = Arc::new(Metrics::with_sandbox(sandbox.metrics()));
    let addr = opts.metrics_addr;
    let listener = http::bind(addr)
        .await
        .map_err(|source| Error::Listen { addr, source })?;
    let local = listener
        .local_addr()
        .map_err(|source| Error::Listen { addr, source })?;
    tracing::info!(addr = %local, "serving /metrics, /healthz, /readyz, /plugins");
    let server = tokio::spawn(http::serve(listener, metrics.clone()));
    // The controllers write through a client that asks the fence again just before each
    // write leaves (fenced_client); the Leases are renewed through the plain one.
    let fence = opts.registry.controller.fence.clone();
    let writer = match (fence.can_shut(), &opts.write_config) {
        (true, Some(config)) => {
            fenced_client_with_connections(&client, config, fence).map_err(Error::WriteClient)?
        }
        (true, None) => fenced_client(&client, fence),
        (false, _) => client.clone(),
    };
    let webhooks = opts
        .webhooks
        .take()
        .map(|w| Webhooks::new(client.clone(), writer.clone(), w));
    opts.registry.webhooks = webhooks.clone();
    let result = run_with(client, writer, sandbox, opts, metrics, shutdown, server).await;
    if let Some(webhooks) = webhooks {
        webhooks.stop().await;
    }
    result
}

/// [`run`] once the endpoints serve and the webhook is set up.
async fn run_with(
    client: Client,
    writer: Client,
    sandbox: Sandbox,
    opts: OperatorOptions,
    metrics: Arc<Metrics>,
    shutdown: impl std::future::Future<Output = ()>,
    server: tokio::task::JoinHandle<()>,
) -> Result<(), Error> {
    tokio::pin!(shutdown);
    if let Some(shards) = opts.shards {
        let result = run_sharded(
            client,
            writer,
            sandbox,
            metrics,
            opts.registry,
            shards,
            shutdown,
        )
        .await;
        server.abort();
        return result;
    }
    metrics.set_shard_buckets(shard::BUCKETS);
    let lock = opts
        .leader_election
        .map(|le| LeaseLock::new(client.clone(), le, opts.registry.controller.fence.clone()));
    if let Some(lock) = &lock {
        // A standby is a healthy, ready process: it just does not reconcile. It serves
        // the webhook, when its certificate is shared, since the webhook's Service sends
        // requests to every ready replica: then it is ready once it serves the plugins
        // of the directory. The leader is ready once its registry has loaded them and
        // told the API server about the webhook, so a finished rollout means that
        // conversions and validations are answered.
        let standby = opts
            .registry
            .webhooks
            .clone()
            .filter(Webhooks::shares_certificate)
            .map(|w| {
                let metrics = metrics.clone();
                tokio::spawn(w.serve_standby(
                    opts.registry.dir.clone(),
                    opts.registry.source.clone(),
                    sandbox.clone(),
                    opts.registry.poll_interval,
                    move || metrics.set_ready(),
                ))
            });
        if standby.is_none() {
            metrics.set_ready();
        }
        let acquired = tokio::select! {
            _ = lock.acquire() => true,
            _ = &mut shutdown => false,
        };
        if let Some(standby) = standby {
            standby.abort();
        }
        if !acquired {
            server.abort();
            return Ok(());
        }
        if let Some(webhooks) = &opts.registry.webhooks {
            webhooks.leading().await;
        }
    }
    metrics.set_leader(true);
    let registry = PluginRegistry::new(writer, sandbox, metrics.clone(), opts.registry);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let mut registry_task = tokio::spawn(registry.run_until(stop_rx));
    let lost = async {
        match &lock {
            Some(lock) => lock.hold().await,
            None => std::future::pending().await,
        }
    };
    let result = tokio::select! {
        _ = &mut shutdown => Ok(()),
        deposed = lost => Err(Error::Deposed(deposed)),
        // The registry runs until told to stop: ending by itself (a panic) leaves
        // nothing to load, reload or supervise plugins, so the process must go.
        ended = &mut registry_task => {
            let why = match ended {
                Err(e) if e.is_panic() => "the plugin registry panicked".to_string(),
                _ => "the plugin registry stopped".to_string(),
            };
            metrics.set_failed("registry", why.clone());
            Err(Error::RegistryStopped(why))
        }
    };
    tracing::info!("shutting down");
    let _ = stop_tx.send(());
    if !registry_task.is_finished() {
        let _ = tokio::time::timeout(Duration::from_secs(10), registry_task).await;
    }
    if let Some(lock) = &lock
        && result.is_ok()
        && let Err(e) = lock.release().await
    {
        tracing::warn!("cannot release the leader lease: {e}");
    }
    server.abort();
    result
}

/// A registry serving some buckets, and how to stop it.
struct ServingRegistry {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl ServingRegistry {
    fn start(
        client: &Client,
        sandbox: &Sandbox,
        metrics: &Arc<Metrics>,
        opts: &RegistryOptions,
        buckets: Buckets,
    ) -> Option<Self> {
        metrics.set_shard_buckets(buckets.len());
        metrics.set_leader(!buckets.is_empty());
        if buckets.is_empty() {
            return None;
        }
        tracing::info!(%buckets, "serving the parents of these buckets");
        let mut opts = opts.clone();
        opts.controller.shard = Some(buckets);
        let registry = PluginRegistry::new(client.clone(), sandbox.clone(), metrics.clone(), opts);
        let (stop, stop_rx) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(registry.run_until(stop_rx));
        Some(ServingRegistry { stop, task })
    }

    /// Stops every controller and waits until they are gone.
    async fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.task.await;
    }
}

/// `capstan run --shards`: membership rounds every retry period ([`membership`]); the
/// registry serves the buckets membership grants, and is restarted with the new set
/// whenever it changes. Membership renews through `client`, the registry writes through
/// `writer`.
async fn run_sharded(
    client: Client,
    writer: Client,
    sandbox: Sandbox,
    metrics: Arc<Metrics>,
    opts: RegistryOptions,
    shards: ShardOptions,
    mut shutdown: std::pin::Pin<&mut impl std::future::Future<Output = ()>>,
) -> Result<(), Error> {
    probe_sharded_list(&client, &shards.namespace).await?;
    let fence = opts.controller.fence.clone();
    let membership = Membership::new(client.clone(), shards, fence);
    // A replica with no bucket yet is healthy and ready: it just serves nothing.
    metrics.set_ready();
    metrics.set_shard_buckets(0);
    // Announce this member with an empty claim and let one retry period pass before the
    // first round: replicas started together (a Deployment's rollout) then see each
    // other at once, instead of the first one taking every bucket, listing every
    // parent and handing two thirds back a round later.
    loop {
        let o = membership.options();
        match membership.renew(Buckets::NONE, o.renew_deadline).await {
            Ok(()) => break,
            Err(e) => tracing::warn!("cannot create the membership lease: {e}"),
        }
        tokio::select! {
            _ = tokio::time::sleep(o.retry_period) => {}
            _ = &mut shutdown => return Ok(()),
        }
    }
    tokio::select! {
        _ = tokio::time::sleep(membership.options().retry_period) => {}
        _ = &mut shutdown => {
            let _ = membership.leave().await;
            return Ok(());
        }
    }
    let mut serving = Buckets::NONE;
    let mut registry: Option<ServingRegistry> = None;
    let mut rounds: u64 = 0;
    let result = loop {
        if registry.as_ref().is_some_and(|r| r.task.is_finished()) {
            let why = "the plugin registry stopped".to_string();
            metrics.set_failed("registry", why.clone());
            break Err(Error::RegistryStopped(why));
        }
        let next = membership_round(&membership, serving, &mut registry, |b| {
            ServingRegistry::start(&writer, &sandbox, &metrics, &opts, b)
        })
        .await;
        serving = next;
        rounds += 1;
        if rounds.is_multiple_of(50)
            && let Ok(view) = membership.view(membership.options().renew_deadline).await
        {
            membership.forget_the_long_gone(&view).await;
        }
        tokio::select! {
            _ = tokio::time::sleep(membership.options().retry_period) => {}
            _ = &mut shutdown => break Ok(()),
        }
    };
    tracing::info!("shutting down");
    if let Some(r) = registry.take() {
        r.stop().await;
    }
    if let Err(e) = membership.leave().await {
        tracing::warn!("cannot delete the membership lease: {e}");
    }
    result
}

/// One membership round; returns the buckets served now. A bucket stops being served
/// before the renewal that withdraws it, and starts only after the renewal that claims
/// it and a second look at the others' claims.
async fn membership_round(
    membership: &Membership,
    mut serving: Buckets,
    registry: &mut Option<ServingRegistry>,
    start: impl Fn(Buckets) -> Option<ServingRegistry>,
) -> Buckets {
    let o = membership.options();
    let request_timeout = o.retry_period.max(o.renew_deadline / 2);
    let restart = |registry: &mut Option<ServingRegistry>, buckets: Buckets| {
        let old = registry.take();
        let start = &start;
        async move {
            if let Some(r) = old {
                r.stop().await;
            }
            start(buckets)
        }
    };
    // A fence that shut (no renewal within the renew deadline) may have let another
    // member take our buckets: stop everything before a renewal could reopen it.
    if !membership.fence().is_open() && !serving.is_empty() {
        tracing::warn!(
            "no membership renewal within the renew deadline: serving nothing until the buckets are claimed again"
        );
        *registry = restart(registry, Buckets::NONE).await;
        serving = Buckets::NONE;
    }
    let view = match membership.view(request_timeout).await {
        Ok(view) => view,
        Err(e) => {
            tracing::warn!("shard membership: {e}");
            return serving;
        }
    };
    let round = before_renewal(serving, &view);
    if round.serve != serving {
        *registry = restart(registry, round.serve).await;
        serving = round.serve;
    }
    let timeout = match membership.fence().deadline() {
        Some(deadline) if membership.fence().is_open() => {
            deadline.saturating_duration_since(tokio::time::Instant::now())
        }
        _ => request_timeout,
    };
    if let Err(e) = membership.renew(round.claim, timeout).await {
        tracing::warn!("cannot renew the membership lease: {e}");
        return serving;
    }
    if round.claim == serving {
        return serving;
    }
    let second = match membership.view(request_timeout).await {
        Ok(view) => view,
        Err(e) => {
            tracing::warn!("shard membership: {e}");
            return serving;
        }
    };
    let next = after_renewal(serving, round.claim, &second);
    if next != serving {
        tracing::info!(members = ?second.live_members(), "buckets change: {serving} -> {next}");
        *registry = restart(registry, next).await;
    }
    next
}

/// Refuses `--shards` unless the API server applies `shardSelector`: an API server
/// without the `ShardedListAndWatch` feature ignores the parameter, and every replica
/// would then serve every parent. It echoes the selector in `ListMeta.shardInfo`.
async fn probe_sharded_list(client: &Client, namespace: &str) -> Result<(), Error> {
    let selector = "shardRange(object.metadata.uid, '0x0000000000000000', '0x10000000000000000')";
    let probe = watch_client::watch_client(
        client,
        Some(selector.to_string()),
        prometheus_client::metrics::counter::Counter::default(),
    );
    let leases: kube::Api<k8s_openapi::api::coordination::v1::Lease> =
        kube::Api::namespaced(probe, namespace);
    let list = leases
        .list(&kube::api::ListParams::default().limit(1))
        .await
        .map_err(Error::ShardProbe)?;
    let echoed = list.metadata.shard_info.map(|i| i.selector);
    if echoed.as_deref() != Some(selector) {
        return Err(Error::ShardingUnsupported);
    }
    tracing::info!("the API server shards lists and watches (ShardedListAndWatch)");
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn lease_list(shard_info: Option<&str>) -> serde_json::Value {
        let mut metadata = json!({"resourceVersion": "7"});
        if let Some(selector) = shard_info {
            metadata["shardInfo"] = json!({ "selector": selector });
        }
        json!({"apiVersion": "coordination.k8s.io/v1", "kind": "LeaseList", "metadata": metadata, "items": []})
    }

    #[tokio::test]
    async fn sharded_mode_is_refused_by_an_api_server_that_ignores_the_selector() {
        // An API server without ShardedListAndWatch answers as if no selector was sent.
        let (client, calls) = fake_api::client(|_| (200, lease_list(None)));
        let err = probe_sharded_list(&client, "ns").await.unwrap_err();
        assert!(matches!(err, Error::ShardingUnsupported), "{err}");
        assert!(
            err.to_string().contains("ShardedListAndWatch"),
            "a clear reason: {err}"
        );
        let call = &calls.all()[0];
        assert_eq!(
            call.path,
            "/apis/coordination.k8s.io/v1/namespaces/ns/leases"
        );
        assert!(
            call.query
                .contains("shardSelector=shardRange%28object.metadata.uid")
        );
    }

    #[tokio::test]
    async fn sharded_mode_starts_when_the_selector_is_echoed() {
        let (client, _) = fake_api::client(|call| {
            let echoed = call.query.contains("shardSelector=").then_some(
                "shardRange(object.metadata.uid, '0x0000000000000000', '0x10000000000000000')",
            );
            (200, lease_list(echoed))
        });
        probe_sharded_list(&client, "ns").await.unwrap();
        // An echo of another selector is no proof either.
        let (client, _) = fake_api::client(|_| {
            (
                200,
                lease_list(Some(
                    "shardRange(object.metadata.uid, '0x0000000000000000', '0x0000000000000001')",
                )),
            )
        });
        let err = probe_sharded_list(&client, "ns").await.unwrap_err();
        assert!(matches!(err, Error::ShardingUnsupported), "{err}");
    }
}
