//! Command-line interface of the `capstan` binary: the clap schema and the dispatch
//! here, each subcommand's body in a module of its own.

mod author;
mod distribute;
mod offline;
mod operator;
mod plan;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};

use capstan::oci::OciOptions;
use capstan::operator::rollout::canary::CanaryPolicy;
use capstan::operator::{Reach, WebhookOptions};
use capstan::plugin::{Plugin, Sandbox, SandboxConfig, limits};
use capstan::signature::VerifyKey;

/// Capstan: a Kubernetes operator host for sandboxed WebAssembly plugins.
#[derive(Debug, Parser)]
#[command(name = "capstan", version, about)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Log filter, as in RUST_LOG (e.g. `info`, `capstan=debug`). The OCI client's
    /// warnings about registries that bend the spec (which it works around) and the TLS
    /// verifier's about CA files it cannot read are left out by default.
    #[arg(
        long,
        global = true,
        env = "CAPSTAN_LOG",
        default_value = "warn,oci_client=error,rustls_platform_verifier=error"
    )]
    log: String,
    /// Log as JSON lines instead of text.
    #[arg(long, global = true)]
    log_json: bool,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the operator: serve every plugin of a directory against a cluster.
    Run(Box<RunArgs>),
    /// Create a plugin project in NAME/: the plugin with one child and a status, its
    /// CRD, a sample parent and the golden file of what it renders, a README and a
    /// capstan.toml naming the build command.
    New {
        /// The project's and the plugin's name (lower case, digits and '-').
        name: String,
        /// The language of the plugin.
        #[arg(long, value_enum)]
        lang: capstan::author::Language,
        /// The parent kind's API group.
        #[arg(long, default_value = "example.com")]
        group: String,
        /// The parent kind's version.
        #[arg(long, default_value = "v1")]
        version: String,
        /// The parent kind (default: NAME in CamelCase).
        #[arg(long)]
        kind: Option<String>,
        /// The directory of SDK packages the project takes its SDK from (`cargo xtask
        /// sdks` writes target/sdks). Required until the SDKs are published: a project
        /// must not name a package that anyone could register.
        #[arg(long)]
        sdks: Option<PathBuf>,
    },
    /// Build the plugin project in DIR with the command of its capstan.toml and the
    /// pinned toolchain (installed once per machine), then print the component's path.
    Build {
        /// The project directory.
        #[arg(default_value = ".")]
        dir: PathBuf,
    },
    /// Render every sample parent of the project in DIR (samples/NAME.yaml, with
    /// NAME.observed.yaml and NAME.related.yaml if present) and compare each result
    /// with its golden file, NAME.golden.yaml. Exits 1 when one differs.
    Test {
        /// The project directory.
        #[arg(default_value = ".")]
        dir: PathBuf,
        /// Write the golden files from what the samples render now.
        #[arg(long)]
        update: bool,
        #[command(flatten)]
        sandbox: SandboxArgs,
    },
    /// Run one reconcile offline and print what would be applied, as YAML.
    Render {
        /// The plugin component (.wasm).
        #[arg(long)]
        plugin: PathBuf,
        /// The parent object (YAML).
        #[arg(long)]
        parent: PathBuf,
        /// Observed children (YAML, several documents or a List).
        #[arg(long)]
        observed: Option<PathBuf>,
        /// Related objects that exist (YAML): the plugin sees those its `customize`
        /// asks for, as `capstan run` would serve them.
        #[arg(long)]
        related: Option<PathBuf>,
        #[command(flatten)]
        sandbox: SandboxArgs,
    },
    /// Show what a new version of a plugin would change, parent by parent, without
    /// writing anything: children created, changed (field by field) and deleted, status
    /// fields, failures; then `N parents: X unchanged, Y changed, Z failing`. Exits 0 when
    /// nothing would change, 1 when something would, 2 on an error (as `kubectl diff`).
    #[command(group(clap::ArgGroup::new("against_what").required(true).args(["against", "live"])))]
    Plan {
        /// The new version of the plugin (.wasm).
        #[arg(long)]
        plugin: PathBuf,
        /// Compare with this version (.wasm) on the same observed state, read from
        /// --parent, --observed and --related files: no cluster.
        #[arg(long, requires = "parents")]
        against: Option<PathBuf>,
        /// Compare with the cluster: every parent of the plugin's kind and the children
        /// it controls, each desired child applied as a dry run (`dryRun=All`).
        #[arg(long)]
        live: bool,
        /// With --live: only the parents of this namespace.
        #[arg(short = 'n', long, requires = "live")]
        namespace: Option<String>,
        /// With --against: a parent (YAML; a file may hold several); repeatable.
        #[arg(long = "parent", requires = "against")]
        parents: Vec<PathBuf>,
        /// With --against: observed children (YAML); each goes to the parent its
        /// controller ownerReference names (to the only parent, when there is one).
        #[arg(long, requires = "against")]
        observed: Option<PathBuf>,
        /// With --against: related objects that exist (YAML).
        #[arg(long, requires = "against")]
        related: Option<PathBuf>,
        /// With --live: path to a kubeconfig (default: $KUBECONFIG, ~/.kube/config).
        #[arg(long)]
        kubeconfig: Option<PathBuf>,
        /// With --live: the kubeconfig context to use.
        #[arg(long)]
        context: Option<String>,
        #[command(flatten)]
        sandbox: SandboxArgs,
    },
    /// Ask a plugin's `validate` whether a parent may change from OLD (none: be
    /// created) to NEW, as its admission webhook would. Exits 0 when allowed (warnings
    /// on stderr), 1 with the plugin's message when refused.
    Validate {
        /// The plugin component (.wasm).
        #[arg(long)]
        plugin: PathBuf,
        /// The object before the change (YAML); omit for a create.
        #[arg(long)]
        old: Option<PathBuf>,
        /// The object after the change (YAML).
        #[arg(long)]
        new: PathBuf,
        #[command(flatten)]
        sandbox: SandboxArgs,
    },
    /// Convert a parent object to another version with the plugin's `convert`, as its
    /// conversion webhook would, and print it as YAML.
    Convert {
        /// The plugin component (.wasm).
        #[arg(long)]
        plugin: PathBuf,
        /// The object (YAML).
        #[arg(long)]
        object: PathBuf,
        /// The version to convert to, such as `v1` (or `group/v1`).
        #[arg(long)]
        to: String,
        #[command(flatten)]
        sandbox: SandboxArgs,
    },
    /// Print the least-privilege ClusterRole `capstan run` needs for a plugin directory.
    Rbac {
        /// Directory of plugin components (*.wasm).
        #[arg(long)]
        plugins: PathBuf,
        /// Name of the ClusterRole.
        #[arg(long, default_value = "capstan")]
        name: String,
        /// Also allow applying CRDs (for `capstan run --install-crds`).
        #[arg(long)]
        install_crds: bool,
        /// The ValidatingWebhookConfiguration `capstan run` owns (its
        /// --webhook-configuration), when a plugin validates.
        #[arg(long, default_value = "capstan")]
        webhook_configuration: String,
        /// For `capstan run --plugin-identities NAMESPACE`: the host's ClusterRole holds
        /// none of the plugins' kinds, and each plugin's own ServiceAccount, ClusterRole
        /// and binding in NAMESPACE follow it, with the Role that lets the host's account
        /// (`--name`, in NAMESPACE) impersonate them.
        #[arg(long, value_name = "NAMESPACE")]
        plugin_identities: Option<String>,
        #[command(flatten)]
        sandbox: SandboxArgs,
    },
    /// Copy the *.wasm files of SRC into DST, each through a temporary file and a rename
    /// (for an init container seeding the plugin directory from the image).
    SeedPlugins {
        /// Where the plugins are.
        src: PathBuf,
        /// The plugin directory to fill.
        dst: PathBuf,
    },
    /// Compile the *.wasm files of PLUGINS into OUT, a directory for `--precompiled-dir`
    /// (for an image that ships its plugins compiled). The code is for this capstan's
    /// wasmtime and this machine's CPU; elsewhere it is not used and plugins compile.
    Precompile {
        /// Where the plugins are.
        plugins: PathBuf,
        /// The directory to write the compiled code to.
        out: PathBuf,
    },
    /// Publish a plugin to an OCI registry as a Wasm artifact (the layout `wkg` and
    /// `oras` use) and print its reference by digest; with --sign-key, also a cosign
    /// signature of that digest.
    Push {
        /// The plugin component (.wasm).
        plugin: PathBuf,
        /// Where to: `oci://REGISTRY/REPOSITORY:TAG`.
        reference: String,
        /// Sign with this private key (unencrypted PEM, ECDSA P-256).
        #[arg(long)]
        sign_key: Option<PathBuf>,
        #[command(flatten)]
        registry_access: RegistryAccessArgs,
    },
    /// Sign a plugin file for `capstan run --verify-key`: writes `FILE.sig`, the
    /// signature `cosign sign-blob` makes, and prints its path.
    Sign {
        /// The plugin component (.wasm).
        plugin: PathBuf,
        /// The private key (unencrypted PEM, ECDSA P-256).
        #[arg(long)]
        key: PathBuf,
    },
    /// Print what a plugin declares.
    Inspect {
        /// The plugin component (.wasm).
        plugin: PathBuf,
        #[command(flatten)]
        sandbox: SandboxArgs,
    },
    /// Print the CustomResourceDefinition a plugin ships, as YAML.
    Crd {
        /// The plugin component (.wasm).
        plugin: PathBuf,
        #[command(flatten)]
        sandbox: SandboxArgs,
    },
}

/// Options of `capstan run`.
#[derive(Debug, Args)]
struct RunArgs {
    /// Directory of plugin components (*.wasm), watched while running.
    #[arg(long, env = "CAPSTAN_PLUGINS")]
    plugins: PathBuf,
    /// Watch only this namespace (default: all namespaces).
    #[arg(long, short = 'n')]
    namespace: Option<String>,
    /// Server-side apply each plugin's CRD when it is loaded.
    #[arg(long)]
    install_crds: bool,
    /// Path to a kubeconfig (default: $KUBECONFIG, ~/.kube/config, or in-cluster).
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// Kubeconfig context to use.
    #[arg(long)]
    context: Option<String>,
    /// Address of the /metrics, /healthz, /readyz and /plugins endpoints.
    #[arg(long, env = "CAPSTAN_METRICS_ADDR", default_value = "127.0.0.1:8080")]
    metrics_addr: std::net::SocketAddr,
    /// Reconcile unchanged parents this often when their plugin sets no period (seconds).
    #[arg(long, default_value_t = 300)]
    resync_seconds: u64,
    /// How often to look for added, changed and removed plugin files (milliseconds).
    #[arg(long, default_value_t = 1000)]
    poll_interval_ms: u64,
    /// Parents of one plugin reconciled at once.
    #[arg(long, default_value_t = 4)]
    concurrency: u16,
    /// Reconcile only while holding a Lease, so that several replicas are safe.
    #[arg(long)]
    leader_elect: bool,
    /// Namespace of the Lease (default: $POD_NAMESPACE, else the service account's
    /// namespace in a cluster, else `default`).
    #[arg(long)]
    leader_election_namespace: Option<String>,
    /// Name of the Lease.
    #[arg(long, default_value = "capstan")]
    leader_election_id: String,
    /// Share the parents with the other replicas of the group: each holds a membership
    /// Lease (in the leader-election namespace) and watches only its range of parent
    /// UIDs, through the API server's sharded watch (feature gate ShardedListAndWatch).
    #[arg(long, conflicts_with = "leader_elect")]
    shards: bool,
    /// The shard group: replicas with the same group share the parents.
    #[arg(long, default_value = "capstan")]
    shard_group: String,
    /// How long the lease lasts without renewal, in seconds.
    #[arg(long, default_value_t = 15)]
    lease_duration_seconds: u64,
    /// Let parents of KIND (`Kind`, `plural`, `Kind.group` or `plural.group`) that are
    /// being deleted go without calling `finalize`: the host's finalizer is removed and
    /// the plugin's cleanup never runs. For a `finalize` that keeps failing, or a plugin
    /// that is gone; one parent at a time: annotate it
    /// `capstan.dev/force-release-finalizer=true`. Repeatable.
    #[arg(long, value_name = "KIND")]
    force_release_finalizers: Vec<String>,
    /// Make every request of a plugin (the watches of its parents, children and related
    /// objects, its writes) as its own ServiceAccount `capstan-plugin-<plugin>` in
    /// NAMESPACE, by impersonation: the API server then bounds each plugin to the RBAC
    /// `capstan rbac --plugin-identities` prints for it (docs/security.md).
    #[arg(long, env = "CAPSTAN_PLUGIN_IDENTITIES", value_name = "NAMESPACE")]
    plugin_identities: Option<String>,
    #[command(flatten)]
    webhook: WebhookArgs,
    #[command(flatten)]
    canary: CanaryArgs,
    /// A plugin in an OCI registry, `oci://REGISTRY/REPOSITORY:TAG` (or `@sha256:…`):
    /// pulled by digest and served beside the directory's (a `NAME.oci` file in the
    /// directory does the same, with a limits file). Repeatable.
    #[arg(long = "plugin", value_name = "oci://REFERENCE")]
    plugin_references: Vec<String>,
    /// Serve only plugins signed with this key (cosign's `cosign.pub`, ECDSA P-256):
    /// a directory file needs `NAME.wasm.sig` (cosign sign-blob), a registry artifact
    /// a cosign signature of its digest. An unsigned or wrongly signed plugin is refused.
    #[arg(long, env = "CAPSTAN_VERIFY_KEY")]
    verify_key: Option<PathBuf>,
    /// Resolve the tags of OCI references again this often (seconds): a new digest is a
    /// new version of that plugin.
    #[arg(long, default_value_t = 60)]
    oci_refresh_seconds: u64,
    #[command(flatten)]
    registry_access: RegistryAccessArgs,
    #[command(flatten)]
    sandbox: SandboxArgs,
}

/// How `capstan` reaches OCI registries (docs/rollout.md).
#[derive(Debug, Args)]
struct RegistryAccessArgs {
    /// Where pulled plugins are kept, by digest (default: $CAPSTAN_CACHE_DIR/oci,
    /// $XDG_CACHE_HOME/capstan/oci or ~/.cache/capstan/oci).
    #[arg(long, env = "CAPSTAN_OCI_CACHE")]
    oci_cache: Option<PathBuf>,
    /// A registry (`HOST:PORT`) spoken to over plain HTTP instead of HTTPS, such as a
    /// test registry on loopback. Repeatable.
    #[arg(long, value_name = "HOST:PORT")]
    oci_plain_http: Vec<String>,
    /// Registry credentials, each sent only to its own registry: a Docker config.json
    /// (`docker login`'s, or the `.dockerconfigjson` of an image pull Secret). A
    /// registry it does not name is spoken to anonymously.
    #[arg(long, env = "CAPSTAN_OCI_AUTH", value_name = "CONFIG_JSON")]
    oci_auth: Option<PathBuf>,
}

impl RegistryAccessArgs {
    fn options(&self, verify_key: Option<VerifyKey>) -> Result<OciOptions> {
        let credentials = match &self.oci_auth {
            Some(file) => capstan::oci::Credentials::from_file(file)?,
            None => capstan::oci::Credentials::default(),
        };
        Ok(OciOptions {
            cache: self
                .oci_cache
                .clone()
                .unwrap_or_else(capstan::oci::default_cache_dir),
            plain_http: self.oci_plain_http.clone(),
            credentials,
            verify_key,
        })
    }
}

/// Canary rollout of a new plugin version (docs/rollout.md).
#[derive(Debug, Args)]
struct CanaryArgs {
    /// A `NAME.next.wasm` beside `NAME.wasm` serves a share of the parents (by a hash of
    /// their UID) that steps up on a schedule, and is rolled back automatically when it
    /// fails more than the serving version (default: it only shadows).
    #[arg(long, env = "CAPSTAN_CANARY")]
    canary: bool,
    /// The shares of parents the candidate serves, in percent, one per step, ending at 100.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "10,25,50,100",
        requires = "canary"
    )]
    canary_steps: Vec<u8>,
    /// How long each step lasts, in seconds.
    #[arg(long, default_value_t = 300, requires = "canary")]
    canary_step_seconds: u64,
    /// How many percentage points the candidate's failure rate may exceed the serving
    /// version's before it is rolled back.
    #[arg(long, default_value_t = 5.0, requires = "canary")]
    canary_max_failure_increase: f64,
    /// The candidate's reconciles needed to judge it within a step (at a step's end, any
    /// number is enough).
    #[arg(long, default_value_t = 20, requires = "canary")]
    canary_min_reconciles: u64,
}

impl CanaryArgs {
    fn policy(&self) -> Result<Option<CanaryPolicy>> {
        if !self.canary {
            return Ok(None);
        }
        CanaryPolicy::new(
            self.canary_steps.clone(),
            Duration::from_secs(self.canary_step_seconds),
            self.canary_max_failure_increase,
            self.canary_min_reconciles,
        )
        .map(Some)
        .map_err(anyhow::Error::msg)
    }
}

/// The admission and conversion webhook, served once a loaded plugin validates or
/// converts (docs/admission.md).
#[derive(Debug, Args)]
struct WebhookArgs {
    /// Where the webhook listens (HTTPS), once a loaded plugin validates or converts.
    #[arg(long, env = "CAPSTAN_WEBHOOK_ADDR", default_value = "127.0.0.1:9443")]
    webhook_addr: std::net::SocketAddr,
    /// The base URL the API server reaches the webhook at, for a host outside the
    /// cluster, such as `https://127.0.0.1:9443` (default: `https://` and
    /// --webhook-addr, unless that listens on every address).
    #[arg(long, env = "CAPSTAN_WEBHOOK_URL", conflicts_with = "webhook_service")]
    webhook_url: Option<String>,
    /// The Service the API server reaches the webhook through, in a cluster:
    /// `[NAMESPACE/]NAME[:PORT]` (default: the host's own namespace, port 443).
    #[arg(long, env = "CAPSTAN_WEBHOOK_SERVICE")]
    webhook_service: Option<String>,
    /// The ValidatingWebhookConfiguration this host owns (one per host, or per group of
    /// replicas).
    #[arg(long, env = "CAPSTAN_WEBHOOK_CONFIGURATION", default_value = "capstan")]
    webhook_configuration: String,
    /// Keep the webhook's CA and certificate in this Secret of the host's namespace, so
    /// that every replica serves the same (default: in memory, made anew at each start).
    #[arg(long, env = "CAPSTAN_WEBHOOK_SECRET")]
    webhook_secret: Option<String>,
    /// The ClusterRole that owns the ValidatingWebhookConfiguration, so that deleting
    /// it (uninstalling) deletes the configuration too; needs `get` on it, which
    /// `capstan rbac` grants on the ClusterRole it makes (default: no owner, the
    /// configuration outlives the host).
    #[arg(long, env = "CAPSTAN_WEBHOOK_OWNER_CLUSTERROLE")]
    webhook_owner_clusterrole: Option<String>,
}

impl WebhookArgs {
    /// The webhook's options; `namespace` is the one the host watches, if only one.
    fn options(&self, namespace: Option<&str>) -> Result<WebhookOptions> {
        let reach = match (&self.webhook_service, &self.webhook_url) {
            (Some(service), _) => parse_service(service)?,
            (None, Some(url)) => Reach::Url(check_url(url)?),
            (None, None) if self.webhook_addr.ip().is_unspecified() => anyhow::bail!(
                "--webhook-addr {} listens on every address: say how the API server reaches the webhook with --webhook-service or --webhook-url",
                self.webhook_addr
            ),
            (None, None) => Reach::Url(format!("https://{}", self.webhook_addr)),
        };
        let mut opts = WebhookOptions::new(self.webhook_addr, reach);
        opts.configuration = self.webhook_configuration.clone();
        opts.secret = self
            .webhook_secret
            .as_ref()
            .map(|name| (operator::own_namespace(), name.clone()));
        opts.namespace = namespace.map(String::from);
        opts.owner = self.webhook_owner_clusterrole.clone();
        Ok(opts)
    }
}

/// `[NAMESPACE/]NAME[:PORT]`.
fn parse_service(service: &str) -> Result<Reach> {
    let usage = || format!("--webhook-service {service:?} is not [NAMESPACE/]NAME[:PORT]");
    let (namespace, rest) = match service.split_once('/') {
        Some((namespace, rest)) => (namespace.to_string(), rest),
        None => (operator::own_namespace(), service),
    };
    let (name, port) = match rest.split_once(':') {
        Some((name, port)) => (name, port.parse().ok().with_context(usage)?),
        None => (rest, 443),
    };
    anyhow::ensure!(!namespace.is_empty() && !name.is_empty(), usage());
    Ok(Reach::Service {
        namespace,
        name: name.into(),
        port,
    })
}

/// An `https://HOST[:PORT]` URL, without a path, query or fragment.
fn check_url(url: &str) -> Result<String> {
    let uri: http::Uri = url
        .parse()
        .with_context(|| format!("--webhook-url {url:?} is not a URL"))?;
    anyhow::ensure!(
        uri.scheme_str() == Some("https") && uri.host().is_some(),
        "--webhook-url {url:?} must be https://HOST[:PORT]"
    );
    anyhow::ensure!(
        matches!(uri.path(), "" | "/") && uri.query().is_none(),
        "--webhook-url {url:?} must have no path: the host adds its own"
    );
    Ok(url.trim_end_matches('/').to_string())
}

/// Limits of the plugin sandbox.
#[derive(Debug, Args)]
struct SandboxArgs {
    /// Wall-clock limit of one plugin call, in milliseconds.
    #[arg(long, env = "CAPSTAN_PLUGIN_TIMEOUT_MS", default_value_t = 2000)]
    plugin_timeout_ms: u64,
    /// Memory limit of one plugin instance, in MiB.
    #[arg(long, env = "CAPSTAN_PLUGIN_MEMORY_MIB", default_value_t = 64)]
    plugin_memory_mib: usize,
    /// Directory of the compiled-code cache (default: ~/.cache/capstan/compiled, or
    /// none without $HOME: compile every time).
    #[arg(long, env = "CAPSTAN_CACHE_DIR")]
    cache_dir: Option<PathBuf>,
    /// The key the compile cache's entries are sealed with: a file of at least 32
    /// bytes that only this user may read (a mounted Secret). Default: `.key` in the
    /// cache directory, made on first use. Compiled code whose seal does not verify is
    /// compiled again, never loaded.
    #[arg(long, env = "CAPSTAN_COMPILE_CACHE_KEY_FILE")]
    compile_cache_key_file: Option<PathBuf>,
    /// A read-only directory of compiled code (`capstan precompile`) behind the cache:
    /// what the cache lacks is copied from there when it has the same plugin compiled
    /// by the same wasmtime for the same CPU.
    #[arg(long, env = "CAPSTAN_PRECOMPILED_DIR")]
    precompiled_dir: Option<PathBuf>,
    /// Plugin instances that may exist at once, across all plugins: the pool reserved
    /// at start (default for `run`: 16 x --concurrency, so that 16 plugins each run
    /// their full concurrency without waiting; otherwise 4).
    #[arg(long, env = "CAPSTAN_PLUGIN_INSTANCES")]
    plugin_instances: Option<u32>,
    /// CPU each plugin's calls may use together, in cores (a plugin's NAME.toml may set
    /// its own); 0: no limit.
    #[arg(long, env = "CAPSTAN_PLUGIN_CPU", default_value_t = 1.0)]
    plugin_cpu: f64,
}

impl SandboxArgs {
    fn sandbox(&self) -> Result<Sandbox> {
        Sandbox::new(SandboxConfig {
            deadline: Duration::from_millis(self.plugin_timeout_ms.max(1)),
            memory_limit: self.plugin_memory_mib.max(1) << 20,
            cache_dir: self.cache_dir.clone().or_else(|| {
                std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/capstan/compiled"))
            }),
            cache_key_file: self.compile_cache_key_file.clone(),
            precompiled_dir: self.precompiled_dir.clone(),
            instances: self.plugin_instances.unwrap_or(4).max(1),
            cpu: (self.plugin_cpu > 0.0).then_some(self.plugin_cpu.max(limits::MIN_CPU)),
        })
        .context("cannot set up the plugin sandbox")
    }

    fn load(&self, path: &Path) -> Result<Plugin> {
        Ok(self.sandbox()?.load_file_blocking(path)?)
    }
}

/// Sets up `tracing` as the command line asks.
pub fn init_tracing(cli: &Cli) {
    let filter = tracing_subscriber::EnvFilter::try_new(&cli.log)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    if cli.log_json {
        builder.json().init();
    } else {
        builder.init();
    }
}

/// Runs the parsed command: each subcommand's body is in the module named for it.
pub fn run(cli: Cli) -> Result<ExitCode> {
    match cli.command {
        Command::Run(args) => operator::run(*args)?,
        Command::New {
            name,
            lang,
            group,
            version,
            kind,
            sdks,
        } => author::new(capstan::author::scaffold::NewOptions {
            name,
            language: lang,
            group,
            version,
            kind,
            sdks,
        })?,
        Command::Build { dir } => author::build(&dir)?,
        Command::Test {
            dir,
            update,
            sandbox,
        } => return author::test(&dir, update, &sandbox),
        Command::Render {
            plugin,
            parent,
            observed,
            related,
            sandbox,
        } => offline::render(
            &sandbox.load(&plugin)?,
            &parent,
            observed.as_deref(),
            related.as_deref(),
        )?,
        Command::Validate {
            plugin,
            old,
            new,
            sandbox,
        } => offline::validate(&sandbox.load(&plugin)?, old.as_deref(), &new)?,
        Command::Convert {
            plugin,
            object,
            to,
            sandbox,
        } => offline::convert(&sandbox.load(&plugin)?, &object, &to)?,
        Command::Inspect { plugin, sandbox } => offline::inspect(&sandbox.load(&plugin)?)?,
        Command::Crd { plugin, sandbox } => offline::crd(&sandbox.load(&plugin)?)?,
        Command::Rbac {
            plugins,
            name,
            install_crds,
            webhook_configuration,
            plugin_identities,
            sandbox,
        } => offline::rbac(
            &sandbox.sandbox()?,
            &plugins,
            &name,
            install_crds,
            &webhook_configuration,
            plugin_identities.as_deref(),
        )?,
        Command::SeedPlugins { src, dst } => distribute::seed_plugins(&src, &dst)?,
        Command::Precompile { plugins, out } => distribute::precompile(&plugins, &out)?,
        Command::Push {
            plugin,
            reference,
            sign_key,
            registry_access,
        } => distribute::push(&plugin, &reference, sign_key.as_deref(), &registry_access)?,
        Command::Sign { plugin, key } => distribute::sign(&plugin, &key)?,
        Command::Plan {
            plugin,
            against,
            live: _,
            namespace,
            parents,
            observed,
            related,
            kubeconfig,
            context,
            sandbox,
        } => {
            let sandbox = sandbox.sandbox()?;
            let new = sandbox.load_file_blocking(&plugin)?;
            let target = match against {
                Some(old) => plan::Target::Files {
                    old: sandbox.load_file_blocking(&old)?,
                    parents,
                    observed,
                    related,
                },
                None => plan::Target::Live {
                    namespace,
                    kubeconfig,
                    context,
                },
            };
            return plan::plan(&new, target);
        }
    }
    Ok(ExitCode::SUCCESS)
}

impl Cli {
    /// The exit status of a command that failed: 2 for `plan` (1 says that something
    /// would change, as for `kubectl diff`), 1 for the others.
    pub fn failure_code(&self) -> u8 {
        match self.command {
            Command::Plan { .. } => 2,
            _ => 1,
        }
    }
}

pub use capstan::one_line;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_webhook_is_reached_by_url_or_service() {
        assert_eq!(
            parse_service("capstan-system/capstan-webhook:8443").unwrap(),
            Reach::Service {
                namespace: "capstan-system".into(),
                name: "capstan-webhook".into(),
                port: 8443,
            }
        );
        match parse_service("capstan-webhook").unwrap() {
            Reach::Service { name, port, .. } => {
                assert_eq!((name.as_str(), port), ("capstan-webhook", 443))
            }
            other => panic!("{other:?}"),
        }
        for bad in ["ns/", "/name", "ns/name:port"] {
            let err = parse_service(bad).unwrap_err().to_string();
            assert!(
                err.contains("is not [NAMESPACE/]NAME[:PORT]"),
                "{bad}: {err}"
            );
        }
        assert_eq!(
            check_url("https://127.0.0.1:9443/").unwrap(),
            "https://127.0.0.1:9443"
        );
        for bad in [
            "http://127.0.0.1:9443",
            "https://127.0.0.1:9443/hooks",
            "https://h?x=1",
            "nonsense",
        ] {
            let err = check_url(bad).unwrap_err().to_string();
            assert!(err.starts_with(&format!("--webhook-url {bad:?}")), "{err}");
        }
    }

    #[test]
    fn a_webhook_on_every_address_needs_to_be_told_how_it_is_reached() {
        let args = |addr: &str, url: Option<&str>| WebhookArgs {
            webhook_addr: addr.parse().unwrap(),
            webhook_url: url.map(String::from),
            webhook_service: None,
            webhook_configuration: "capstan".into(),
            webhook_secret: None,
            webhook_owner_clusterrole: None,
        };
        let err = args("0.0.0.0:9443", None)
            .options(None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("--webhook-service or --webhook-url"), "{err}");
        let local = args("127.0.0.1:9443", None).options(Some("ns")).unwrap();
        assert_eq!(local.reach, Reach::Url("https://127.0.0.1:9443".into()));
        assert_eq!(local.namespace.as_deref(), Some("ns"));
        let told = args("0.0.0.0:9443", Some("https://10.0.0.5:9443"))
            .options(None)
            .unwrap();
        assert_eq!(told.reach, Reach::Url("https://10.0.0.5:9443".into()));
    }
}
