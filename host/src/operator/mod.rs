//! `capstan run`: the operator host. It serves every plugin of a directory, one
//! `kube::runtime::Controller` per plugin, and exposes health, metrics and plugin state.

mod cluster;
mod controller;
mod metrics;
mod reconcile;
mod registry;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use kube::Client;

pub use controller::ControllerOptions;
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
    let metrics = Arc::new(Metrics::default());
    let listener = metrics::bind(opts.metrics_addr)
        .await
        .with_context(|| format!("cannot listen on {}", opts.metrics_addr))?;
    tracing::info!(addr = %listener.local_addr()?, "serving /metrics, /healthz, /readyz, /plugins");
    let server = tokio::spawn(metrics::serve(listener, metrics.clone()));
    let registry = PluginRegistry::new(client, sandbox, metrics, opts.registry);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let registry_task = tokio::spawn(registry.run_until(stop_rx));
    shutdown.await;
    tracing::info!("shutting down");
    let _ = stop_tx.send(());
    let _ = tokio::time::timeout(Duration::from_secs(10), registry_task).await;
    server.abort();
    Ok(())
}
