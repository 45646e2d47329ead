//! `capstan run`: the operator, with its client, leader election, webhooks and
//! shutdown.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};

use capstan::oci::OciStore;
use capstan::operator::source::PluginSource;
use capstan::operator::{
    self, ControllerOptions, ForceRelease, LeaderElectionOptions, OperatorOptions, PendingReleases,
    RegistryOptions, ShardOptions, WriteFence,
};
use capstan::signature::VerifyKey;

use super::RunArgs;

pub fn run(args: RunArgs) -> Result<()> {
    let mut sandbox = args.sandbox;
    let concurrency = args.concurrency.max(1);
    let instances = *sandbox
        .plugin_instances
        .get_or_insert(16 * u32::from(concurrency));
    // A plugin runs up to --concurrency calls at once; a pool smaller than that would
    // let one plugin's calls take every slot from all the others.
    anyhow::ensure!(
        instances > u32::from(concurrency),
        "--plugin-instances {instances} must be larger than --concurrency {concurrency}: one plugin's calls could take every instance slot"
    );
    let sandbox = sandbox.sandbox()?;
    let webhooks = args.webhook.options(args.namespace.as_deref())?;
    let canary = args.canary.policy()?;
    let verify_key = args
        .verify_key
        .as_deref()
        .map(VerifyKey::from_pem_file)
        .transpose()?;
    let source = PluginSource::new(
        OciStore::new(args.registry_access.options(verify_key.clone())?),
        verify_key,
        args.plugin_references.clone(),
        Duration::from_secs(args.oci_refresh_seconds.max(1)),
    );
    source.check_references()?;
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let identity = identity();
        let (client, config) =
            kube_client(args.kubeconfig.as_deref(), args.context.clone(), &identity).await?;
        let opts = OperatorOptions {
            write_config: Some(config),
            registry: RegistryOptions {
                dir: args.plugins,
                poll_interval: Duration::from_millis(args.poll_interval_ms.max(50)),
                install_crds: args.install_crds,
                pending_releases: PendingReleases::default(),
                webhooks: None,
                canary,
                source,
                controller: ControllerOptions {
                    namespace: args.namespace,
                    default_resync: Duration::from_secs(args.resync_seconds.max(1)),
                    concurrency,
                    shard: None,
                    force_release: ForceRelease::kinds(args.force_release_finalizers),
                    // The Pod's name (the Deployment sets it from the downward API).
                    instance: std::env::var("POD_NAME").ok(),
                    identities: args
                        .plugin_identities
                        .as_deref()
                        .map(capstan::operator::identity::PluginIdentities::new),
                    fence: if args.leader_elect || args.shards {
                        WriteFence::for_leader_election()
                    } else {
                        WriteFence::default()
                    },
                },
            },
            metrics_addr: args.metrics_addr,
            webhooks: Some(webhooks),
            shards: args.shards.then(|| {
                ShardOptions::new(
                    &args
                        .leader_election_namespace
                        .clone()
                        .unwrap_or_else(own_namespace),
                    &args.shard_group,
                    &identity,
                    Duration::from_secs(args.lease_duration_seconds.max(1)),
                )
            }),
            leader_election: args.leader_elect.then(|| {
                LeaderElectionOptions::new(
                    &args
                        .leader_election_namespace
                        .clone()
                        .unwrap_or_else(own_namespace),
                    &args.leader_election_id,
                    &identity,
                    Duration::from_secs(args.lease_duration_seconds.max(1)),
                )
            }),
        };
        Ok(operator::run(client, sandbox, opts, shutdown_signal()).await?)
    })
}

/// The namespace this process runs in, for its Lease.
pub fn own_namespace() -> String {
    std::env::var("POD_NAMESPACE")
        .ok()
        .or_else(|| {
            std::fs::read_to_string("/var/run/secrets/kubernetes.io/serviceaccount/namespace").ok()
        })
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "default".into())
}

/// This replica's name in leader election: the Pod's name, else host and PID.
pub fn identity() -> String {
    std::env::var("POD_NAME").unwrap_or_else(|_| {
        let host = std::fs::read_to_string("/etc/hostname").unwrap_or_else(|_| "localhost".into());
        format!("{}-{}", host.trim(), std::process::id())
    })
}

/// A client as kubectl would configure it, whose requests carry the user agent
/// `capstan/<version> (<identity>)`: the API server's audit log then says which replica
/// made each request.
pub async fn kube_client(
    kubeconfig: Option<&Path>,
    context: Option<String>,
    identity: &str,
) -> Result<(kube::Client, kube::Config)> {
    let options = kube::config::KubeConfigOptions {
        context,
        ..Default::default()
    };
    let mut config = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("cannot read kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &options).await?
        }
        None if options.context.is_some() => kube::Config::from_kubeconfig(&options).await?,
        None => kube::Config::infer()
            .await
            .context("no Kubernetes configuration found (set KUBECONFIG or --kubeconfig)")?,
    };
    let user_agent = format!("capstan/{} ({identity})", env!("CARGO_PKG_VERSION"));
    config.headers.push((
        "user-agent".parse()?,
        user_agent
            .parse()
            .with_context(|| format!("{user_agent:?} is not a valid user agent"))?,
    ));
    let client = kube::Client::try_from(config.clone())?;
    let version = reach_api_server(&client).await?;
    tracing::info!(version = %version.git_version, "connected to the API server");
    Ok((client, config))
}

/// How long `capstan run` keeps trying to reach the API server at start.
const API_SERVER_WAIT: Duration = Duration::from_secs(60);

/// The API server's version, asked again with backoff while it cannot be reached, for
/// up to [`API_SERVER_WAIT`]: a host started while the control plane restarts (an
/// upgrade, a node drain) waits for it instead of exiting into a crash loop.
async fn reach_api_server(
    client: &kube::Client,
) -> Result<k8s_openapi::apimachinery::pkg::version::Info> {
    let started = std::time::Instant::now();
    let mut wait = Duration::from_millis(250);
    loop {
        match client.apiserver_version().await {
            Ok(version) => return Ok(version),
            Err(e) if started.elapsed() + wait < API_SERVER_WAIT => {
                tracing::warn!("cannot reach the API server yet, retrying in {wait:?}: {e}");
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(5));
            }
            Err(e) => {
                return Err(anyhow::Error::new(e).context(format!(
                    "cannot reach the API server (tried for {}s)",
                    started.elapsed().as_secs()
                )));
            }
        }
    }
}

/// Resolves on SIGINT or SIGTERM.
async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("install SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
