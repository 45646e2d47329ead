//! `capstan run`: the operator host. It serves every plugin of a directory, one
//! `kube::runtime::Controller` per plugin, and exposes health, metrics and plugin state.

mod children;
mod cluster;
mod controller;
#[cfg(test)]
mod fake_api;
mod freshness;
mod http;
mod leader;
mod metrics;
mod parent;
mod reconcile;
mod registry;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use kube::Client;

pub use controller::ControllerOptions;
pub use leader::{LeaderElectionOptions, LeaseLock, WriteFence};
pub use metrics::{Metrics, PluginState};
pub use reconcile::FINALIZER;
pub use registry::{PluginRegistry, RegistryOptions};

use crate::plugin::Sandbox;

/// Everything `capstan run` needs.
#[derive(Debug, Clone)]
pub struct OperatorOptions {
    /// The plugin directory and controller options.
    pub registry: RegistryOptions,
    /// Where to serve `/metrics`, `/healthz`, `/readyz` and `/plugins`.
    pub metrics_addr: SocketAddr,
    /// Run controllers only while holding this Lease; none: always.
    pub leader_election: Option<LeaderElectionOptions>,
}

/// Runs the operator until `shutdown` resolves, then stops every controller.
pub async fn run(
    client: Client,
    sandbox: Sandbox,
    opts: OperatorOptions,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    let dir: PathBuf = opts.registry.dir.clone();
    anyhow::ensure!(
        dir.is_dir(),
        "plugin directory {} does not exist",
        dir.display()
    );
    let metrics = Arc::new(Metrics::with_sandbox(sandbox.metrics()));
    let listener = http::bind(opts.metrics_addr)
        .await
        .with_context(|| format!("cannot listen on {}", opts.metrics_addr))?;
    tracing::info!(addr = %listener.local_addr()?, "serving /metrics, /healthz, /readyz, /plugins");
    let server = tokio::spawn(http::serve(listener, metrics.clone()));
    tokio::pin!(shutdown);
    let lock = opts
        .leader_election
        .map(|le| LeaseLock::new(client.clone(), le, opts.registry.controller.fence.clone()));
    if let Some(lock) = &lock {
        // A standby is a healthy, ready process: it just does not reconcile.
        metrics.set_ready();
        tokio::select! {
            _ = lock.acquire() => {}
            _ = &mut shutdown => {
                server.abort();
                return Ok(());
            }
        }
    }
    metrics.set_leader(true);
    let registry = PluginRegistry::new(client, sandbox, metrics.clone(), opts.registry);
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
        err = lost => Err(err),
        // The registry runs until told to stop: ending by itself (a panic) leaves
        // nothing to load, reload or supervise plugins, so the process must go.
        ended = &mut registry_task => {
            let why = match ended {
                Err(e) if e.is_panic() => "the plugin registry panicked".to_string(),
                _ => "the plugin registry stopped".to_string(),
            };
            metrics.set_failed("registry", why.clone());
            Err(anyhow::anyhow!(why))
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
