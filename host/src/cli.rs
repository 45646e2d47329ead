//! Command-line interface of the `capstan` binary.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};

use capstan::oci::{OciOptions, OciStore};
use capstan::operator::rollout::canary::CanaryPolicy;
use capstan::operator::source::PluginSource;
use capstan::operator::{
    self, ControllerOptions, ForceRelease, LeaderElectionOptions, OperatorOptions, PendingReleases,
    Reach, RegistryOptions, ShardOptions, WebhookOptions, WriteFence,
};
use capstan::plugin::{Plugin, Sandbox, SandboxConfig, limits};
use capstan::render;
use capstan::signature::{SigningKey, VerifyKey};

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
        /// Take the SDK from this directory of packages (`cargo xtask sdks` writes
        /// target/sdks) instead of the public registry.
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
    /// The user name for the registries (with $CAPSTAN_OCI_PASSWORD); anonymous without.
    #[arg(long, env = "CAPSTAN_OCI_USERNAME")]
    oci_username: Option<String>,
}

impl RegistryAccessArgs {
    fn options(&self, verify_key: Option<VerifyKey>) -> Result<OciOptions> {
        let basic_auth = match &self.oci_username {
            Some(user) => {
                let password = std::env::var("CAPSTAN_OCI_PASSWORD")
                    .context("--oci-username needs the password in $CAPSTAN_OCI_PASSWORD")?;
                Some((user.clone(), password))
            }
            None => None,
        };
        Ok(OciOptions {
            cache: self
                .oci_cache
                .clone()
                .unwrap_or_else(capstan::oci::default_cache_dir),
            plain_http: self.oci_plain_http.clone(),
            basic_auth,
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
            .map(|name| (own_namespace(), name.clone()));
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
        None => (own_namespace(), service),
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

/// Runs the parsed command.
pub fn run(cli: Cli) -> Result<ExitCode> {
    match cli.command {
        Command::Run(args) => run_operator(*args)?,
        Command::New {
            name,
            lang,
            group,
            version,
            kind,
            sdks,
        } => {
            let options = capstan::author::scaffold::NewOptions {
                name,
                language: lang,
                group,
                version,
                kind,
                sdks,
            };
            let dir = capstan::author::scaffold::create(Path::new("."), &options)?;
            println!(
                "created {}: `cd {0} && capstan build && capstan test`",
                dir.display()
            );
        }
        Command::Build { dir } => {
            let project = capstan::author::project::Project::open(&dir)?;
            let built = project.build()?;
            println!("{}", built.display());
        }
        Command::Test {
            dir,
            update,
            sandbox,
        } => return test_samples(&dir, update, &sandbox),
        Command::Render {
            plugin,
            parent,
            observed,
            related,
            sandbox,
        } => {
            let plugin = sandbox.load(&plugin)?;
            let mut observed = render::read_observed(&plugin, &parent, observed.as_deref())?;
            let existing = match &related {
                Some(path) => render::read_related(plugin.info(), path)?,
                None => Vec::new(),
            };
            render::customize(&plugin, &mut observed, &existing)?;
            let rendered = render::render(&plugin, &observed, &capstan::plan::now())?;
            print!("{}", serde_yaml_ng::to_string(&rendered)?);
        }
        Command::Validate {
            plugin,
            old,
            new,
            sandbox,
        } => {
            let plugin = sandbox.load(&plugin)?;
            let old = old.as_deref().map(render::read_one).transpose()?;
            let new = render::read_one(&new)?;
            anyhow::ensure!(
                plugin.info().validation.is_some(),
                "plugin {} does not validate (it does not declare validation)",
                plugin.info().name
            );
            match plugin.validate_blocking(old.as_ref(), &new)? {
                Ok(warnings) => {
                    for warning in warnings {
                        eprintln!("warning: {}", warning.replace('\n', " "));
                    }
                }
                Err(refusal) => anyhow::bail!("refused: {refusal}"),
            }
        }
        Command::Convert {
            plugin,
            object,
            to,
            sandbox,
        } => {
            let plugin = sandbox.load(&plugin)?;
            let converted = capstan::convert::convert(&plugin, render::read_one(&object)?, &to)?;
            print!("{}", serde_yaml_ng::to_string(&converted)?);
        }
        Command::Rbac {
            plugins,
            name,
            install_crds,
            webhook_configuration,
            sandbox,
        } => {
            let sandbox = sandbox.sandbox()?;
            let infos = wasm_files(&plugins)?
                .iter()
                .map(|f| Ok(sandbox.load_file_blocking(f)?.info().clone()))
                .collect::<Result<Vec<_>>>()?;
            let role =
                capstan::rbac::cluster_role(&name, &infos, install_crds, &webhook_configuration);
            print!("{}", serde_yaml_ng::to_string(&role)?);
        }
        Command::SeedPlugins { src, dst } => {
            for file in wasm_files(&src)? {
                let name = file.file_name().expect("a file name");
                let tmp = dst.join(format!(".{}.tmp", name.to_string_lossy()));
                std::fs::copy(&file, &tmp)
                    .with_context(|| format!("cannot copy {}", file.display()))?;
                std::fs::rename(&tmp, dst.join(name))?;
                println!("{}", dst.join(name).display());
            }
        }
        Command::Precompile { plugins, out } => precompile(&plugins, &out)?,
        Command::Push {
            plugin,
            reference,
            sign_key,
            registry_access,
        } => push(&plugin, &reference, sign_key.as_deref(), &registry_access)?,
        Command::Sign { plugin, key } => {
            let key = SigningKey::from_pem_file(&key)?;
            let bytes = std::fs::read(&plugin)
                .with_context(|| format!("cannot read {}", plugin.display()))?;
            let sig = capstan::signature::sig_file_of(&plugin);
            std::fs::write(&sig, key.sign(&bytes))
                .with_context(|| format!("cannot write {}", sig.display()))?;
            println!("{}", sig.display());
        }
        Command::Inspect { plugin, sandbox } => {
            let plugin = sandbox.load(&plugin)?;
            let mut info = serde_json::to_value(plugin.info())?;
            info["sha256"] = plugin.sha256().into();
            info["crd"] = plugin.info().crd.is_some().into();
            print!("{}", serde_yaml_ng::to_string(&info)?);
        }
        Command::Crd { plugin, sandbox } => {
            let plugin = sandbox.load(&plugin)?;
            let Some(crd) = &plugin.info().crd else {
                anyhow::bail!("plugin {} ships no CRD", plugin.info().name);
            };
            let crd: serde_json::Value = serde_json::from_str(crd)?;
            print!("{}", serde_yaml_ng::to_string(&crd)?);
        }
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
            let outcomes = match against {
                Some(old) => {
                    let old = sandbox.load_file_blocking(&old)?;
                    plan_against(
                        &new,
                        &old,
                        &parents,
                        observed.as_deref(),
                        related.as_deref(),
                    )?
                }
                None => {
                    let runtime = tokio::runtime::Runtime::new()?;
                    runtime.block_on(async {
                        let (client, _) =
                            kube_client(kubeconfig.as_deref(), context, &identity()).await?;
                        anyhow::Ok(
                            capstan::operator::preview::plan_live(
                                &client,
                                &new,
                                namespace.as_deref(),
                                None,
                            )
                            .await?,
                        )
                    })?
                }
            };
            print!(
                "{}",
                capstan::diff::report(&new.info().parent.kind, &outcomes)
            );
            if capstan::diff::Summary::of(&outcomes).any() {
                return Ok(ExitCode::from(1));
            }
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

/// `capstan test`: every sample rendered and compared with its golden file (or written
/// into it with `--update`); one line per sample, the differing fields under a failing
/// one, then a summary. Exit 1 when a sample differs or has no golden file.
fn test_samples(dir: &Path, update: bool, sandbox: &SandboxArgs) -> Result<ExitCode> {
    use capstan::author::samples::{self, Verdict};
    let project = capstan::author::project::Project::open(dir)?;
    let plugin = sandbox.load(&project.built_output()?)?;
    let found = samples::find(&project.dir.join("samples"))?;
    let (mut failed, mut written) = (0, 0);
    for sample in &found {
        let rendered = samples::render_sample(&plugin, sample)?;
        let golden = match std::fs::read_to_string(&sample.golden) {
            Ok(text) => Some(text),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(e).with_context(|| format!("read {}", sample.golden.display())),
        };
        let verdict = samples::compare(golden.as_deref(), &rendered);
        let shown = sample.parent.display();
        match (verdict, update) {
            (Verdict::Same, _) => println!("ok      {shown}"),
            (_, true) => {
                std::fs::write(&sample.golden, &rendered)
                    .with_context(|| format!("write {}", sample.golden.display()))?;
                written += 1;
                println!("updated {}", sample.golden.display());
            }
            (Verdict::NoGolden, false) => {
                failed += 1;
                println!(
                    "FAILED  {shown}: no golden file {} (`capstan test --update` writes it)",
                    sample.golden.display()
                );
            }
            (Verdict::Differs(fields), false) => {
                failed += 1;
                println!(
                    "FAILED  {shown}: differs from {} (golden -> rendered):",
                    sample.golden.display()
                );
                print!("{fields}");
            }
        }
    }
    let total = found.len();
    match (failed, written) {
        (0, 0) => println!("{total} samples: all match their golden files"),
        (0, n) => println!("{total} samples: {n} golden files written"),
        (n, _) => {
            println!(
                "{total} samples: {n} failed (`capstan test --update` accepts what they render now)"
            );
            return Ok(ExitCode::from(1));
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `capstan plan --against`: both versions rendered on each parent of the files, with
/// the observed children and related objects given, and their plans compared.
fn plan_against(
    new: &Plugin,
    old: &Plugin,
    parent_files: &[PathBuf],
    observed: Option<&Path>,
    related: Option<&Path>,
) -> Result<Vec<capstan::diff::ParentOutcome>> {
    let mut parents = Vec::new();
    for path in parent_files {
        for parent in render::read_objects(path)? {
            parents.push((path.display().to_string(), parent));
        }
    }
    let observed = match observed {
        Some(path) => render::read_objects(path)?,
        None => Vec::new(),
    };
    let only = parents.len() == 1;
    let now = capstan::plan::now();
    // Read once per version: their declared related kinds (and indexes) may differ. A
    // file one version cannot read fails that version's render of every parent.
    let existing = |plugin: &Plugin| -> Result<Vec<_>, String> {
        match related {
            Some(path) => render::read_related(plugin.info(), path).map_err(|e| e.to_string()),
            None => Ok(Vec::new()),
        }
    };
    let (old_existing, new_existing) = (existing(old), existing(new));
    let mut out = Vec::new();
    for (source, parent) in parents {
        let name = |p: &str| parent.pointer(p).and_then(serde_json::Value::as_str);
        let (ns, parent_name) = (
            name("/metadata/namespace").unwrap_or("default"),
            name("/metadata/name").unwrap_or(""),
        );
        let mine: Vec<serde_json::Value> = observed
            .iter()
            .filter(|child| only || render::controlled_by(child, &parent))
            .cloned()
            .collect();
        // Each version renders with its own reading of the inputs: their declared
        // kinds (and so the children's kind indexes) may differ.
        let render_with = |plugin: &Plugin,
                           existing: &Result<Vec<_>, String>|
         -> Result<capstan::plan::Plan, String> {
            let existing = existing.as_ref().map_err(String::clone)?;
            let mut state = render::observed_for(plugin, parent.clone(), &source, mine.clone())
                .map_err(|e| e.to_string())?;
            render::customize(plugin, &mut state, existing).map_err(|e| e.to_string())?;
            render::render(plugin, &state, &now)
                .map(|r| r.plan)
                .map_err(|e| e.to_string())
        };
        let (old_plan, new_plan) = (
            render_with(old, &old_existing),
            render_with(new, &new_existing),
        );
        let outcome = capstan::diff::compare_plans(
            old_plan.as_ref().map_err(String::as_str),
            new_plan.as_ref().map_err(String::as_str),
        );
        out.push(capstan::diff::ParentOutcome {
            parent: format!("{ns}/{parent_name}"),
            outcome,
        });
    }
    Ok(out)
}

/// `capstan precompile`: loads every plugin of `plugins` with `out` as the compile
/// cache, keeping each loaded until all are, so that none is evicted by the others.
fn precompile(plugins: &Path, out: &Path) -> Result<()> {
    let sandbox = Sandbox::new(SandboxConfig {
        cache_dir: Some(out.to_path_buf()),
        // As the other commands that load plugins: a plugin may run several core
        // instances (the Python plugin does), the pool's bound is per instance.
        instances: 4,
        ..SandboxConfig::default()
    })
    .context("cannot set up the plugin sandbox")?;
    let mut loaded = Vec::new();
    for file in wasm_files(plugins)? {
        let plugin = sandbox.load_file_blocking(&file)?;
        println!("{} {}", plugin.sha256(), file.display());
        loaded.push(plugin);
    }
    Ok(())
}

/// The `*.wasm` files of `dir`, sorted; none is an error.
fn wasm_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("cannot read {}", dir.display()))?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    files.retain(|p| p.extension().is_some_and(|e| e == "wasm"));
    files.sort();
    anyhow::ensure!(!files.is_empty(), "no *.wasm plugin in {}", dir.display());
    Ok(files)
}

fn run_operator(args: RunArgs) -> Result<()> {
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
fn own_namespace() -> String {
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
fn identity() -> String {
    std::env::var("POD_NAME").unwrap_or_else(|_| {
        let host = std::fs::read_to_string("/etc/hostname").unwrap_or_else(|_| "localhost".into());
        format!("{}-{}", host.trim(), std::process::id())
    })
}

/// A client as kubectl would configure it, whose requests carry the user agent
/// `capstan/<version> (<identity>)`: the API server's audit log then says which replica
/// made each request.
async fn kube_client(
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

pub use capstan::one_line;

/// `capstan push`: the component to a tag (signed with a key), its digest printed.
fn push(
    plugin: &Path,
    reference: &str,
    sign_key: Option<&Path>,
    access: &RegistryAccessArgs,
) -> Result<()> {
    let bytes =
        std::fs::read(plugin).with_context(|| format!("cannot read {}", plugin.display()))?;
    // A component's preamble: `\0asm`, then version 0x0d and layer 1.
    anyhow::ensure!(
        bytes.starts_with(b"\0asm\x0d\x00\x01\x00"),
        "{} is not a WebAssembly component (a plugin is one: cargo component build, or \
         cargo build --target wasm32-wasip2)",
        plugin.display()
    );
    let parsed = capstan::oci::parse_reference(reference)?;
    anyhow::ensure!(
        parsed.digest().is_none(),
        "{reference}: push to a tag; the digest is what the push prints"
    );
    let key = sign_key.map(SigningKey::from_pem_file).transpose()?;
    let store = OciStore::new(access.options(None)?);
    let runtime = tokio::runtime::Runtime::new()?;
    let digest = runtime.block_on(store.push(&parsed, &bytes, key.as_ref()))?;
    println!(
        "{}{}/{}@{digest}",
        capstan::oci::SCHEME,
        parsed.registry(),
        parsed.repository()
    );
    Ok(())
}

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
