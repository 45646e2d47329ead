//! The admission and conversion webhook of `capstan run` (contract 0.2.0): one HTTPS
//! server, started once a loaded plugin validates or converts, that answers the API
//! server's `AdmissionReview`s with the plugins' `validate` and its `ConversionReview`s
//! with their `convert`, under the same sandbox limits as every other call.
//!
//! The host makes its own CA and serving certificate ([`tls`]), keeps them in memory or,
//! with `--webhook-secret`, in a Secret its replicas share, renews them before they
//! expire, and tells the API server where the webhook is and which CA to trust
//! ([`config`]): one `ValidatingWebhookConfiguration` it owns, and the `spec.conversion`
//! of each converting plugin's CRD.
//!
//! Paths: `/validate/{fail|ignore}/<plural>.<group>` and `/convert/<plural>.<group>`.

mod config;
mod review;
#[cfg(test)]
mod tests;
mod tls;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock, Weak};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::Client;
use kube::api::{Api, PostParams};
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;
use tracing::{info, warn};

pub use config::{FIELD_MANAGER, Reach};
pub use tls::Lifetimes;

use crate::contract::FailurePolicy;
use crate::plugin::Plugin;
use config::ConfigError;
use tls::{Material, ServingCert, TlsError};

/// Everything the webhook needs to know.
#[derive(Debug, Clone)]
pub struct WebhookOptions {
    /// Where the HTTPS server listens.
    pub addr: SocketAddr,
    /// How the API server reaches it.
    pub reach: Reach,
    /// The name of the ValidatingWebhookConfiguration the host owns.
    pub configuration: String,
    /// The Secret (namespace, name) that keeps the CA and the serving certificate for
    /// every replica; none: kept in memory, made anew at each start.
    pub secret: Option<(String, String)>,
    /// Only parents of this namespace are validated (the host's `--namespace`).
    pub namespace: Option<String>,
    /// How long certificates are valid.
    pub lifetimes: Lifetimes,
    /// How often certificates are checked for renewal (and a failed configuration
    /// applied again).
    pub check_every: Duration,
    /// The ClusterRole that owns the ValidatingWebhookConfiguration, so that deleting
    /// it (uninstalling deploy/ or the chart) has the garbage collector delete the
    /// configuration too; none: the configuration outlives the host.
    pub owner: Option<String>,
}

impl WebhookOptions {
    /// Options for a webhook listening on `addr`, reached as `reach`.
    pub fn new(addr: SocketAddr, reach: Reach) -> Self {
        WebhookOptions {
            addr,
            reach,
            configuration: "capstan".into(),
            secret: None,
            namespace: None,
            lifetimes: Lifetimes::default(),
            check_every: Duration::from_secs(60),
            owner: None,
        }
    }
}

/// Why the webhook could not be served or announced.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        /// The address asked for.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Certificates could not be made or loaded.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// The Secret that keeps the certificates could not be read or written.
    #[error("cannot keep the webhook certificate in Secret {namespace}/{name}: {source}")]
    Secret {
        /// Its namespace.
        namespace: String,
        /// Its name.
        name: String,
        /// kube's error.
        #[source]
        source: kube::Error,
    },
    /// Other replicas kept changing the Secret while this one wrote it.
    #[error("Secret {namespace}/{name} kept changing while this replica wrote it")]
    SecretContended {
        /// Its namespace.
        namespace: String,
        /// Its name.
        name: String,
    },
    /// The API server was not told about the webhook.
    #[error(transparent)]
    Config(#[from] ConfigError),
}

/// Plugins served by the webhook, by the name of their parent's CRD.
type Served = Arc<RwLock<BTreeMap<String, Plugin>>>;

/// The webhook of one `capstan run`: cheap to clone, shared by the registries the
/// process runs one after another.
#[derive(Clone)]
pub struct Webhooks {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Webhooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Webhooks")
            .field("opts", &self.inner.opts)
            .finish_non_exhaustive()
    }
}

struct Inner {
    /// Reads and writes the Secret: replicas share it whether they lead or not.
    client: Client,
    /// Writes the configuration and the CRDs: only while leading (a fenced client).
    writer: Client,
    /// Whether this replica tells the API server about the webhook (and renews the
    /// certificates): set by [`Webhooks::update`], which a serving registry calls. A
    /// standby only serves ([`Webhooks::serve_standby`]).
    announcing: AtomicBool,
    opts: WebhookOptions,
    served: Served,
    /// One change at a time: the plugins of the files, and what was applied.
    state: tokio::sync::Mutex<State>,
}

#[derive(Default)]
struct State {
    /// The plugin each file serves.
    files: BTreeMap<PathBuf, Plugin>,
    /// The server, once a plugin needed it.
    server: Option<Server>,
    /// The ValidatingWebhookConfiguration last applied.
    validating: Option<Value>,
    /// The conversions last applied, by CRD name.
    conversions: BTreeMap<String, Value>,
    /// The last attempt to tell the API server failed: the maintenance tries again.
    stale: bool,
    /// The owner reference to [`WebhookOptions::owner`], once read.
    owner: Option<Value>,
}

struct Server {
    addr: SocketAddr,
    material: Material,
    cert: Arc<ServingCert>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// Whether a plugin needs the webhook.
fn needs_webhook(plugin: &Plugin) -> bool {
    plugin.info().validation.is_some() || plugin.info().conversion
}

impl Webhooks {
    /// A webhook that keeps its Secret through `client` and writes the configuration
    /// and CRDs through `writer`; nothing listens until a plugin needs it.
    pub fn new(client: Client, writer: Client, opts: WebhookOptions) -> Self {
        Webhooks {
            inner: Arc::new(Inner {
                client,
                writer,
                announcing: AtomicBool::new(false),
                opts,
                served: Served::default(),
                state: tokio::sync::Mutex::new(State::default()),
            }),
        }
    }

    /// The address the server listens on, once it does.
    pub async fn local_addr(&self) -> Option<SocketAddr> {
        self.inner
            .state
            .lock()
            .await
            .server
            .as_ref()
            .map(|s| s.addr)
    }

    /// The CAs the API server is told to trust (PEM), once the server runs.
    pub async fn ca_bundle(&self) -> Option<String> {
        let state = self.inner.state.lock().await;
        state.server.as_ref().map(|s| s.material.ca_bundle())
    }

    /// Records that `file` now serves `plugin` (none: nothing any more), starts the
    /// server if a plugin needs it, and tells the API server. On an error a new plugin
    /// is not recorded (the file's previous one stays), and the caller should not serve
    /// it; a removal is always recorded, and told again later.
    pub async fn update(&self, file: &Path, plugin: Option<&Plugin>) -> Result<(), Error> {
        self.inner.announcing.store(true, Ordering::SeqCst);
        let mut state = self.inner.state.lock().await;
        let previous = match plugin {
            Some(plugin) => state.files.insert(file.to_path_buf(), plugin.clone()),
            None => state.files.remove(file),
        };
        let changed = previous.is_some() || plugin.is_some_and(needs_webhook);
        if !changed && state.server.is_none() {
            return Ok(());
        }
        let result = self.sync(&mut state).await;
        if result.is_err() && plugin.is_some() {
            match previous {
                Some(previous) => state.files.insert(file.to_path_buf(), previous),
                None => state.files.remove(file),
            };
            self.publish(&state);
        }
        if result.is_err() {
            state.stale = true;
        }
        result
    }

    /// The `spec.conversion` that sends the API server to this webhook for `plugin`'s
    /// CRD, starting the server if it does not run yet: for a CRD created with its
    /// conversion in place, so that no version of it is ever served unconverted.
    pub async fn conversion_for(&self, plugin: &Plugin) -> Result<Value, Error> {
        let mut state = self.inner.state.lock().await;
        if state.server.is_none() {
            state.server = Some(self.start().await?);
        }
        let bundle = match &state.server {
            Some(server) => server.material.ca_bundle(),
            None => unreachable!("started above"),
        };
        let crd = config::conversion(plugin.info(), &self.inner.opts.reach, &bundle);
        Ok(crd["spec"]["conversion"].clone())
    }

    /// Whether replicas share the certificate (`--webhook-secret`): only then can a
    /// standby serve the webhook, with the certificate the API server was told about.
    pub fn shares_certificate(&self) -> bool {
        self.inner.opts.secret.is_some()
    }

    /// Records that `file` serves `plugin` (none: nothing) and serves it, without
    /// telling the API server anything: a standby's part.
    pub async fn serve_only(&self, file: &Path, plugin: Option<&Plugin>) -> Result<(), Error> {
        let mut state = self.inner.state.lock().await;
        match plugin {
            Some(plugin) => state.files.insert(file.to_path_buf(), plugin.clone()),
            None => state.files.remove(file),
        };
        if state.server.is_none() && state.files.values().any(needs_webhook) {
            state.server = Some(self.start().await?);
        }
        self.publish(&state);
        Ok(())
    }

    /// This replica starts leading: the plugins its standby loaded are forgotten (still
    /// served until the registry records its own), and from the registry's first
    /// [`Webhooks::update`] on it tells the API server.
    pub async fn leading(&self) {
        self.inner.state.lock().await.files.clear();
    }

    /// A standby's loop, until the task is dropped: loads the plugins of `dir` that
    /// validate or convert (with their limits files) every `poll`, and serves them, so
    /// that the requests the Service sends to a standby are answered as the leader
    /// would. Calls `ready` once, after the first pass that served every such plugin
    /// of the directory: a replica is not Ready (in the Service's endpoints) before it
    /// can answer. Never writes to the cluster but the Secret, when it is missing.
    pub async fn serve_standby(
        self,
        dir: PathBuf,
        source: super::source::PluginSource,
        sandbox: crate::plugin::Sandbox,
        poll: Duration,
        ready: impl FnOnce() + Send + 'static,
    ) {
        let mut ready = Some(ready);
        let mut seen: BTreeMap<PathBuf, (super::source::Stamp, Instant)> = BTreeMap::new();
        loop {
            let mut served_all = true;
            let listed = list_plugins(&source, &dir).await;
            for gone in seen
                .keys()
                .filter(|p| !listed.contains_key(*p))
                .cloned()
                .collect::<Vec<_>>()
            {
                seen.remove(&gone);
                if let Err(e) = self.serve_only(&gone, None).await {
                    warn!(file = %gone.display(), "standby webhook: {e}");
                }
            }
            for (path, stamp) in listed {
                // The same files as the registry, trusted as it trusts them: signatures
                // checked, references pulled by digest (and resolved again on its
                // schedule).
                let resolve = super::source::PluginSource::is_remote(&path)
                    && seen
                        .get(&path)
                        .is_some_and(|(_, at)| at.elapsed() >= source.refresh());
                if seen.get(&path).is_some_and(|(s, _)| *s == stamp) && !resolve {
                    continue;
                }
                seen.insert(path.clone(), (stamp, Instant::now()));
                let bytes = match source.read(&path).await {
                    Ok(bytes) => bytes,
                    Err(e) => {
                        warn!("standby webhook: {e}");
                        continue;
                    }
                };
                let (file, sandbox) = (path.clone(), sandbox.clone());
                let loaded = tokio::task::spawn_blocking(move || {
                    let plugin = sandbox.load_bytes_blocking(&bytes, &file).ok()?;
                    if let Ok(Some(limits)) = crate::plugin::limits::read(&file, sandbox.config()) {
                        plugin.set_limits(limits);
                    }
                    Some(plugin)
                })
                .await
                .ok()
                .flatten();
                if let Some(plugin) = loaded.filter(needs_webhook)
                    && let Err(e) = self.serve_only(&path, Some(&plugin)).await
                {
                    warn!(file = %path.display(), "standby webhook: {e}");
                    // Tried again at the next pass.
                    seen.remove(&path);
                    served_all = false;
                }
            }
            if served_all && let Some(ready) = ready.take() {
                ready();
            }
            tokio::time::sleep(poll).await;
        }
    }

    /// Stops the server and its maintenance.
    pub async fn stop(&self) {
        self.inner.state.lock().await.server = None;
    }

    /// Serves the recorded plugins and tells the API server about them.
    async fn sync(&self, state: &mut State) -> Result<(), Error> {
        if state.server.is_none() {
            if !state.files.values().any(needs_webhook) {
                self.publish(state);
                return Ok(());
            }
            state.server = Some(self.start().await?);
        }
        self.publish(state);
        self.announce(state).await?;
        state.stale = false;
        Ok(())
    }

    /// Lets the server answer for the recorded plugins.
    fn publish(&self, state: &State) {
        let served: BTreeMap<String, Plugin> = state
            .files
            .values()
            .filter(|p| needs_webhook(p))
            .map(|p| (config::resource_name(p.info()), p.clone()))
            .collect();
        *self.inner.served.write().expect("served plugins lock") = served;
    }

    /// Applies what changed of the ValidatingWebhookConfiguration and the conversions.
    async fn announce(&self, state: &mut State) -> Result<(), Error> {
        let Some(server) = &state.server else {
            return Ok(());
        };
        let opts = &self.inner.opts;
        let client = &self.inner.writer;
        let bundle = server.material.ca_bundle();
        let webhooks: Vec<Value> = state
            .files
            .values()
            .filter_map(|p| {
                let policy = p.info().validation?;
                Some(config::validating_webhook(
                    p.info(),
                    policy,
                    p.deadline(),
                    &opts.reach,
                    &bundle,
                    opts.namespace.as_deref(),
                ))
            })
            .collect();
        // No configuration is made while no plugin validates; one that was is kept
        // (emptied), so that its entries go away.
        if !webhooks.is_empty() || state.validating.is_some() {
            if let (Some(name), None) = (&opts.owner, &state.owner) {
                match config::owner_reference(&self.inner.client, name).await {
                    Ok(owner) => state.owner = Some(owner),
                    // Applied without an owner meanwhile (the webhook works; only the
                    // clean-up on uninstall waits), and asked again by the maintenance.
                    Err(err) => {
                        warn!(clusterrole = %name, "cannot read the ClusterRole that owns the validating webhooks, applying them without an owner for now: {err}");
                    }
                }
            }
            let body = config::validating_configuration(
                &opts.configuration,
                webhooks,
                state.owner.as_ref(),
            );
            if state.validating.as_ref() != Some(&body) {
                config::apply_validating(client, &body).await?;
                info!(configuration = %opts.configuration, webhooks = body["webhooks"].as_array().map_or(0, Vec::len), "validating webhooks applied");
                state.validating = Some(body);
            }
        }
        let converting: BTreeMap<String, Value> = state
            .files
            .values()
            .filter(|p| p.info().conversion)
            .map(|p| {
                (
                    config::resource_name(p.info()),
                    config::conversion(p.info(), &opts.reach, &bundle),
                )
            })
            .collect();
        for (crd, body) in &converting {
            if state.conversions.get(crd) != Some(body) {
                config::apply_conversion(client, body).await?;
                info!(%crd, "conversion webhook set");
                state.conversions.insert(crd.clone(), body.clone());
            }
        }
        // A CRD whose plugin no longer converts goes back to no conversion. One whose
        // plugin is gone keeps the webhook: reading its other versions fails (this host
        // says why) rather than returning objects that were never converted.
        let served_kinds: Vec<String> = state
            .files
            .values()
            .map(|p| config::resource_name(p.info()))
            .collect();
        let released: Vec<String> = state
            .conversions
            .keys()
            .filter(|crd| !converting.contains_key(*crd) && served_kinds.contains(crd))
            .cloned()
            .collect();
        for crd in released {
            config::release_conversion(client, &crd).await?;
            info!(%crd, "conversion webhook released: its plugin no longer converts");
            state.conversions.remove(&crd);
        }
        Ok(())
    }

    /// Loads or makes the certificates, binds the address and starts serving, and the
    /// maintenance that renews the certificates.
    async fn start(&self) -> Result<Server, Error> {
        let opts = &self.inner.opts;
        let material = self.current_material(None).await?;
        let cert = Arc::new(ServingCert::new(material.certified_key()?));
        let acceptor = TlsAcceptor::from(Arc::new(tls::server_config(cert.clone())?));
        let listener = TcpListener::bind(opts.addr)
            .await
            .map_err(|source| Error::Listen {
                addr: opts.addr,
                source,
            })?;
        let addr = listener.local_addr().map_err(|source| Error::Listen {
            addr: opts.addr,
            source,
        })?;
        info!(%addr, reach = ?opts.reach, "serving the admission and conversion webhook");
        let serve = tokio::spawn(serve(listener, acceptor, self.inner.served.clone()));
        let maintain = tokio::spawn(maintain(Arc::downgrade(&self.inner)));
        Ok(Server {
            addr,
            material,
            cert,
            tasks: vec![serve, maintain],
        })
    }

    /// The certificates to serve now: `current` renewed if due, or those of the Secret
    /// (renewed there if due), or new ones.
    async fn current_material(&self, current: Option<&Material>) -> Result<Material, Error> {
        let opts = &self.inner.opts;
        let names = opts.reach.names();
        match &opts.secret {
            Some((namespace, name)) => {
                let renew = self.inner.announcing.load(Ordering::SeqCst);
                let client = &self.inner.client;
                stored_material(client, namespace, name, &names, opts.lifetimes, renew).await
            }
            None => {
                let now = SystemTime::now();
                match current {
                    Some(current) => Ok(current
                        .renewed(&names, opts.lifetimes, now)?
                        .unwrap_or_else(|| current.clone())),
                    None => Ok(Material::generate(&names, opts.lifetimes, now)?),
                }
            }
        }
    }
}

/// The plugin entries of `dir` and the `--plugin` references with their stamps, less
/// the shadow versions (never served: they only answer beside a reconcile); empty when
/// the directory cannot be read.
async fn list_plugins(
    source: &super::source::PluginSource,
    dir: &Path,
) -> BTreeMap<PathBuf, super::source::Stamp> {
    let listed = match source.list(dir).await {
        Ok(listed) => listed,
        Err(e) => {
            warn!("standby webhook: cannot list {}: {e}", dir.display());
            BTreeMap::new()
        }
    };
    listed
        .into_iter()
        .filter(|(p, _)| super::rollout::slot::shadowed_by(p).is_none())
        .map(|(p, listed)| (p, listed.stamp))
        .collect()
}

/// Every `check_every`: renews the certificates when due (or takes those another
/// replica renewed), tells the API server the new CA bundle, then serves the new
/// certificate; tells the API server again what it was not told; and sets each CRD's
/// conversion webhook again (someone may have changed it). Ends with the webhook.
async fn maintain(inner: Weak<Inner>) {
    let every = match inner.upgrade() {
        Some(inner) => inner.opts.check_every,
        None => return,
    };
    loop {
        tokio::time::sleep(every).await;
        let Some(inner) = inner.upgrade() else {
            return;
        };
        let webhooks = Webhooks { inner };
        let mut state = webhooks.inner.state.lock().await;
        let Some(server) = &state.server else {
            return;
        };
        let current = server.material.clone();
        match webhooks.current_material(Some(&current)).await {
            Ok(next) if next != current => {
                let key = match next.certified_key() {
                    Ok(key) => key,
                    Err(e) => {
                        warn!("cannot serve the renewed webhook certificate: {e}");
                        continue;
                    }
                };
                let server = state.server.as_mut().expect("checked above");
                server.material = next;
                // The bundle first: the API server must trust the new CA before it
                // meets a certificate it signed (the old CA stays in the bundle).
                if webhooks.inner.announcing.load(Ordering::SeqCst)
                    && let Err(e) = webhooks.announce(&mut state).await
                {
                    warn!("cannot tell the API server the renewed webhook CA: {e}");
                    state.stale = true;
                }
                if let Some(server) = &state.server {
                    server.cert.set(key);
                    info!(not_after = ?server.material.serving.not_after, "webhook certificate renewed");
                }
            }
            Ok(_) => {}
            Err(e) => warn!("cannot renew the webhook certificate: {e}"),
        }
        // An owner that could not be read yet is asked for again.
        let unowned = webhooks.inner.opts.owner.is_some()
            && state.owner.is_none()
            && state.validating.is_some();
        if state.stale || (unowned && webhooks.inner.announcing.load(Ordering::SeqCst)) {
            match webhooks.announce(&mut state).await {
                Ok(()) => state.stale = false,
                Err(e) => warn!("cannot tell the API server about the webhook: {e}"),
            }
        } else if webhooks.inner.announcing.load(Ordering::SeqCst) {
            // The conversions again, as applied: a CRD applied anew from its manifest
            // by a user (with no `conversion`), or pointed at another host that has
            // stopped since, would leave its stored version unconverted for the other
            // versions' readers. An apply that changes nothing writes nothing.
            for (crd, body) in &state.conversions {
                if let Err(e) = config::apply_conversion(&webhooks.inner.writer, body).await {
                    warn!(%crd, "cannot set the conversion webhook again: {e}");
                }
            }
        }
    }
}

/// How often the Secret is written again after a conflict before giving up (until the
/// next check).
const SECRET_ATTEMPTS: usize = 5;

/// The material kept in Secret `namespace/name`, created if absent and renewed if due,
/// with the Secret's `resourceVersion` as precondition: replicas that race each write
/// theirs, one wins, the others read it back and use it.
async fn stored_material(
    client: &Client,
    namespace: &str,
    name: &str,
    names: &[String],
    lifetimes: Lifetimes,
    renew: bool,
) -> Result<Material, Error> {
    let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let failed = |source| Error::Secret {
        namespace: namespace.into(),
        name: name.into(),
        source,
    };
    for _ in 0..SECRET_ATTEMPTS {
        let now = SystemTime::now();
        let existing = api.get_opt(name).await.map_err(failed)?;
        let stored = existing.as_ref().and_then(|secret| {
            let data = secret.data.as_ref()?;
            Material::from_secret_data(|key| {
                data.get(key)
                    .and_then(|v| String::from_utf8(v.0.clone()).ok())
            })
        });
        let next = match &stored {
            // A standby takes what is stored: the replica that announces renews, and
            // tells the API server the new CA before anyone serves a certificate it
            // signed.
            Some(stored) if !renew => return Ok(stored.clone()),
            Some(stored) => match stored.renewed(names, lifetimes, now)? {
                Some(next) => next,
                None => return Ok(stored.clone()),
            },
            None => Material::generate(names, lifetimes, now)?,
        };
        let mut secret = Secret {
            metadata: kube::api::ObjectMeta {
                name: Some(name.into()),
                namespace: Some(namespace.into()),
                labels: Some(
                    [(
                        "app.kubernetes.io/managed-by".to_string(),
                        "capstan".to_string(),
                    )]
                    .into(),
                ),
                ..Default::default()
            },
            type_: Some("Opaque".into()),
            data: Some(
                next.to_secret_data()
                    .into_iter()
                    .map(|(k, v)| (k.to_string(), ByteString(v.into_bytes())))
                    .collect(),
            ),
            ..Default::default()
        };
        let written = match existing {
            None => api.create(&PostParams::default(), &secret).await,
            Some(existing) => {
                secret.metadata.resource_version = existing.metadata.resource_version;
                api.replace(name, &PostParams::default(), &secret).await
            }
        };
        match written {
            Ok(_) => {
                info!(secret = %format!("{namespace}/{name}"), "webhook certificate stored");
                return Ok(next);
            }
            // Another replica wrote it first (created it, or changed it since it was
            // read): read theirs.
            Err(kube::Error::Api(status)) if status.code == 409 => continue,
            Err(e) => return Err(failed(e)),
        }
    }
    Err(Error::SecretContended {
        namespace: namespace.into(),
        name: name.into(),
    })
}

/// How long a TLS handshake may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a client may take to send request headers (also how long an idle kept-alive
/// connection stays open).
const HEADER_TIMEOUT: Duration = Duration::from_secs(30);
/// How long one connection serves before it is closed (gracefully: the request under
/// way is answered first).
const CONNECTION_LIMIT: Duration = Duration::from_secs(300);
/// The largest AdmissionReview body: the object and its old version, each at most what
/// etcd stores (1.5 MiB), with room for JSON escaping and the request's own fields.
const MAX_ADMISSION_BODY: usize = 8 << 20;
/// The largest ConversionReview body: the objects of a list converted at once.
const MAX_CONVERSION_BODY: usize = 32 << 20;
/// The bytes of request bodies the webhook holds at once, all clients together: a
/// request waits (up to [`BODY_TIMEOUT`]) until its declared length fits, so many
/// large uploads at once cost this much memory, not their sum.
const BODY_BUDGET: usize = 64 << 20;
/// How long a request may wait for room in the budget, then send its body.
const BODY_TIMEOUT: Duration = Duration::from_secs(10);

/// What every request of the webhook shares: the plugins it serves, and the budget of
/// request bytes in memory.
#[derive(Clone)]
struct Shared {
    served: Served,
    /// Permits of 1 KiB each, [`BODY_BUDGET`] in all.
    budget: Arc<tokio::sync::Semaphore>,
}

async fn serve(listener: TcpListener, acceptor: TlsAcceptor, served: Served) {
    let shared = Shared {
        served,
        budget: Arc::new(tokio::sync::Semaphore::new(BODY_BUDGET >> 10)),
    };
    super::http::accept_tcp(&listener, "webhook", move |stream| {
        connection(stream, acceptor.clone(), shared.clone())
    })
    .await
}

async fn connection(stream: tokio::net::TcpStream, acceptor: TlsAcceptor, shared: Shared) {
    let stream = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
        Ok(Ok(stream)) => stream,
        Ok(Err(e)) => {
            tracing::debug!("webhook TLS handshake failed: {e}");
            return;
        }
        Err(_) => return,
    };
    let service = hyper::service::service_fn(move |request: Request<Incoming>| {
        let shared = shared.clone();
        async move { Ok::<_, Infallible>(handle(request, &shared).await) }
    });
    let connection = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .serve_connection(TokioIo::new(stream), service);
    tokio::pin!(connection);
    tokio::select! {
        result = connection.as_mut() => {
            if let Err(e) = result {
                tracing::debug!("webhook connection: {e}");
            }
        }
        _ = tokio::time::sleep(CONNECTION_LIMIT) => {
            connection.as_mut().graceful_shutdown();
            let _ = tokio::time::timeout(HEADER_TIMEOUT, connection).await;
        }
    }
}

/// What a path asks for.
#[derive(Debug, PartialEq, Eq)]
enum Route<'a> {
    Validate(FailurePolicy, &'a str),
    Convert(&'a str),
}

fn route(path: &str) -> Option<Route<'_>> {
    let mut parts = path.strip_prefix('/')?.split('/');
    let route = match (parts.next()?, parts.next()?, parts.next()) {
        ("validate", "fail", Some(name)) => Route::Validate(FailurePolicy::Fail, name),
        ("validate", "ignore", Some(name)) => Route::Validate(FailurePolicy::Ignore, name),
        ("convert", name, None) => Route::Convert(name),
        _ => return None,
    };
    parts.next().is_none().then_some(route)
}

async fn handle(request: Request<Incoming>, shared: &Shared) -> Response<Full<Bytes>> {
    let path = request.uri().path().to_string();
    let Some(route) = route(&path) else {
        return text(StatusCode::NOT_FOUND, "not found");
    };
    if request.method() != Method::POST {
        return text(StatusCode::METHOD_NOT_ALLOWED, "POST a review");
    }
    let limit = match route {
        Route::Validate(..) => MAX_ADMISSION_BODY,
        Route::Convert(_) => MAX_CONVERSION_BODY,
    };
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<usize>().ok());
    if let Some(length) = declared
        && length > limit
    {
        // Refused before a byte of it is read.
        return text(
            StatusCode::PAYLOAD_TOO_LARGE,
            &format!("a review of {length} bytes is over this webhook's limit of {limit}"),
        );
    }
    // Room for the whole body (its declared length, else the limit) before reading it.
    let kib = declared.unwrap_or(limit).div_ceil(1024).max(1) as u32;
    let room = tokio::time::timeout(BODY_TIMEOUT, shared.budget.clone().acquire_many_owned(kib));
    let Ok(Ok(_room)) = room.await else {
        return text(
            StatusCode::SERVICE_UNAVAILABLE,
            "too many reviews at once: try again",
        );
    };
    let read = Limited::new(request.into_body(), limit).collect();
    let body = match tokio::time::timeout(BODY_TIMEOUT, read).await {
        Ok(Ok(body)) => body.to_bytes(),
        Ok(Err(e)) => return text(StatusCode::PAYLOAD_TOO_LARGE, &e.to_string()),
        Err(_) => {
            return text(
                StatusCode::REQUEST_TIMEOUT,
                &format!("the review's body was not sent within {BODY_TIMEOUT:?}"),
            );
        }
    };
    let served = &shared.served;
    let plugin = |name: &str| {
        served
            .read()
            .expect("served plugins lock")
            .get(name)
            .cloned()
    };
    let answer = match route {
        Route::Validate(policy, name) => {
            let plugin = plugin(name);
            let within = config::answer_within(config::timeout_seconds(
                plugin.as_ref().map_or(Duration::ZERO, Plugin::deadline),
            ));
            review::admission(&body, plugin.as_ref(), policy, within).await
        }
        Route::Convert(name) => {
            let within = config::answer_within(config::CONVERSION_TIMEOUT_SECONDS);
            review::conversion(&body, plugin(name).as_ref(), within).await
        }
    };
    match answer {
        Ok(review) => Response::builder()
            .status(StatusCode::OK)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(review.to_string())))
            .expect("a static status and content type make a valid response"),
        Err(bad) => text(StatusCode::BAD_REQUEST, &bad.to_string()),
    }
}

fn text(status: StatusCode, message: &str) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "text/plain")
        .body(Full::new(Bytes::from(format!("{message}\n"))))
        .expect("a static status and content type make a valid response")
}
