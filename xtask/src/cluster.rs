//! `cargo xtask cluster`: a real local Kubernetes control plane for tests and the demo.
//!
//! etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok (fake kubelets)
//! are built from pinned Go modules (see [`binaries`]) and run as detached processes on
//! 127.0.0.1 only, with one state directory per cluster holding credentials, etcd data,
//! logs, ports and PIDs. Where the machine allows it, a real node runs beside them in
//! namespaces of its own ([`node`]). Two clusters with different state directories run
//! side by side. `docs/control-plane.md` is the user's guide.

mod binaries;
mod bootstrap;
mod cgroups;
mod components;
mod node;
mod process;
mod state;

use std::{
    env, fs,
    path::{Path, PathBuf},
    process::Command,
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

pub use binaries::{cache_dir, ensure_binaries, ensure_crane, ensure_debian_package, ensure_helm};
use bootstrap::Kubectl;
use node::NodePlan;
pub use node::{HostSnapshot, NODE_NAME, NodeChoice, import_image};
use process::Process;
pub use process::signal;
use state::{Ports, StateDir};

const USAGE: &str =
    "usage: cargo xtask cluster <command> [--state-dir DIR] [--nodes N] [--node KIND]

commands:
  up       build or reuse the binaries, start a cluster, print `export KUBECONFIG=…`
  down     stop the cluster's processes and remove its state directory
  status   say what runs
  restart COMPONENT
           stop one component (SIGTERM, then SIGKILL) and start it again with the
           command line it had; returns once it works again (kube-apiserver: /readyz)
  build    build the binaries (control plane and node) into the cache if missing, and
           print the two bin directories
  import FILE.tar
           import an image tar (OCI layout or `docker save`) into the real node
  pin      regenerate tests/control-plane's Go modules from the pinned versions
  selftest start a cluster with a real node, kill -9 all its recorded processes (a
           crash), start it again (which must clean up and work), stop it, and check
           that the machine is as it was: no mount, cgroup, veth, process, iptables rule
           or sysctl change left

options:
  --state-dir DIR   the cluster's state directory (default: $CAPSTAN_CLUSTER_DIR, else
                    target/cluster in the workspace)
  --nodes N         fake nodes to start with (up only; default 1)
  --node KIND       up only: `real` (a kubelet, containerd, kube-proxy and CoreDNS in
                    namespaces of their own, beside the fake nodes), `kwok` (fake nodes
                    only), or `auto` (default: real where the machine allows it, else kwok,
                    saying why); default $CAPSTAN_NODE, else auto
";

/// How long SIGTERM gets before SIGKILL on `down`.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// What `up` starts.
#[derive(Debug, Clone)]
pub struct UpOptions {
    /// The state directory; see [`default_state_dir`].
    pub state_dir: PathBuf,
    /// Number of fake kwok nodes (`kwok-node-0`, …), each 32 CPUs, 256Gi, 110 pods.
    pub nodes: usize,
    /// How long each readiness step may take before `up` gives up.
    pub step_timeout: Duration,
    /// Whether to run a real node; `None`: `$CAPSTAN_NODE`, else [`NodeChoice::Auto`].
    pub node: Option<NodeChoice>,
}

impl Default for UpOptions {
    fn default() -> Self {
        Self {
            state_dir: default_state_dir(),
            nodes: 1,
            step_timeout: Duration::from_secs(90),
            node: None,
        }
    }
}

impl UpOptions {
    /// The cluster of `cargo xtask test`: `$CAPSTAN_TEST_CLUSTER_DIR`, else
    /// `target/test-cluster`, apart from the one started by hand (`target/cluster`), so a
    /// test run never stops the cluster someone is using. A fixed directory, so that a
    /// test run that died without `down` is found, reused and stopped by the next one.
    pub fn for_tests() -> Self {
        let dir = env::var_os("CAPSTAN_TEST_CLUSTER_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| workspace_dir().join("target/test-cluster"));
        Self::default().state_dir(dir)
    }

    /// Uses `dir` as the state directory.
    pub fn state_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.state_dir = dir.into();
        self
    }

    /// Starts `nodes` fake nodes (at least one).
    pub fn nodes(mut self, nodes: usize) -> Self {
        self.nodes = nodes.max(1);
        self
    }

    /// Chooses whether to run a real node.
    pub fn node(mut self, node: NodeChoice) -> Self {
        self.node = Some(node);
        self
    }
}

/// A running cluster.
#[derive(Debug, Clone)]
pub struct Cluster {
    /// Admin kubeconfig (client certificate in `system:masters`): set `KUBECONFIG` to it.
    pub kubeconfig: PathBuf,
    /// The state directory: pass it to [`down`].
    pub state_dir: PathBuf,
    /// The control-plane binaries, `kubectl` among them.
    pub bin_dir: PathBuf,
    /// Whether the cluster has a real node ([`node::NODE_NAME`]) besides kwok's.
    pub real_node: bool,
}

/// `$CAPSTAN_CLUSTER_DIR`, else `target/cluster` in the workspace.
pub fn default_state_dir() -> PathBuf {
    env::var_os("CAPSTAN_CLUSTER_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_dir().join("target/cluster"))
}

fn workspace_dir() -> PathBuf {
    let xtask = Path::new(env!("CARGO_MANIFEST_DIR"));
    xtask.parent().unwrap_or(xtask).to_path_buf()
}

/// Starts a cluster in `opts.state_dir` and returns once it is usable: `/readyz` is ok,
/// every fake node is Ready, and the controller-manager has made the `default`
/// ServiceAccount in `default`; with a real node, also that node is Ready, CoreDNS
/// answers and the volume provisioner runs.
///
/// If that directory already holds a running cluster, returns it as it is. If it holds
/// a dead one, replaces it. On failure, stops whatever it started, keeps the logs, and
/// the error names the failing component and its log (whose tail goes to stderr).
pub fn up(opts: &UpOptions) -> Result<Cluster> {
    let bin_dir = ensure_binaries()?;
    let state = StateDir::new(&opts.state_dir);
    let mut cluster = Cluster {
        kubeconfig: state.kubeconfig(),
        state_dir: state.root().to_path_buf(),
        bin_dir: bin_dir.clone(),
        real_node: node::describe(&state).is_some(),
    };
    if state.exists() {
        let processes = state.processes()?;
        let running = processes.iter().filter(|p| p.is_running()).count();
        if running > 0 && running == processes.len() {
            eprintln!("cluster: already running in {}", state.root().display());
            return Ok(cluster);
        }
        if running > 0 {
            bail!(
                "the cluster in {dir} is only partly running; run `cargo xtask cluster down \
                 --state-dir {dir}` first",
                dir = state.root().display()
            );
        }
    }
    let started = Instant::now();
    let choice = match opts.node {
        Some(choice) => choice,
        None => NodeChoice::from_env()?,
    };
    // Before the old state goes: what a crashed node left is found by its directory.
    if node::remove_node(&node::cluster_id(&state))? {
        eprintln!("cluster: removed the processes and cgroups an earlier node left");
    }
    let plan = match choice.resolve(&state)? {
        true => Some(NodePlan::prepare(&state)?),
        false => None,
    };
    cluster.real_node = plan.is_some();
    state.create()?;
    if let Err(err) = start(&bin_dir, &state, opts, plan.as_ref()) {
        stop_all(&state);
        return Err(err.context(format!(
            "cluster up failed; logs kept in {} (`cargo xtask cluster down{}` removes them)",
            state.logs().display(),
            state_dir_flag(state.root())
        )));
    }
    eprintln!("cluster: up in {:.1?}", started.elapsed());
    Ok(cluster)
}

/// Builds what [`up`] with a cluster in `state_dir` will need and is not Rust: the
/// control plane's binaries, helm and, where `$CAPSTAN_NODE` and the machine give the
/// cluster a real node, the node's binaries and iptables. Returns whether it will have
/// a real node. `cargo xtask test` runs it beside the Rust builds.
pub fn prebuild(state_dir: &Path) -> Result<bool> {
    ensure_binaries()?;
    ensure_helm()?;
    ensure_crane()?;
    let real = NodeChoice::from_env()?.resolve(&StateDir::new(state_dir))?;
    if real {
        binaries::ensure_debian_package("/usr/sbin/iptables", "iptables")?;
        binaries::ensure_node_binaries()?;
    }
    Ok(real)
}

fn start(bin: &Path, state: &StateDir, opts: &UpOptions, plan: Option<&NodePlan>) -> Result<()> {
    let ports = Ports::pick()?;
    state.write_ports(&ports)?;
    fs::write(state.audit_policy(), components::AUDIT_POLICY).context("write the audit policy")?;
    let node_ip = plan.map(|p| p.net.node_ip.to_string());
    let node_server = plan.map(|p| p.apiserver_url(&ports));
    let node_credentials = node_ip
        .as_deref()
        .zip(node_server.as_deref())
        .map(|(ip, server)| (node::NODE_NAME, ip, server));
    run_once(
        "capstan-pki",
        components::pki(bin, state, &ports, node_credentials),
    )?;
    fs::copy(state.component_kubeconfig("admin"), state.kubeconfig())
        .context("copy the admin kubeconfig")?;
    let kubectl = Kubectl::new(bin, &state.kubeconfig());
    let mut run = Startup {
        state,
        processes: Vec::new(),
        timeout: opts.step_timeout,
    };

    run.spawn("etcd", components::etcd(bin, state, &ports))?;
    run.wait("etcd", "/health", || {
        bootstrap::etcd_healthy(ports.etcd_client)
    })?;
    run.spawn(
        "kube-apiserver",
        components::apiserver(bin, state, &ports, node_ip.as_deref()),
    )?;
    run.wait("kube-apiserver", "/readyz", || kubectl.apiserver_ready())?;

    run.spawn(
        "kube-controller-manager",
        components::controller_manager(bin, state, &ports),
    )?;
    run.spawn("kube-scheduler", components::scheduler(bin, state, &ports))?;
    run.spawn("kwok", components::kwok(bin, state, &ports))?;
    kubectl.create(&bootstrap::seed_manifest(opts.nodes, state, plan.is_some()))?;
    if let Some(plan) = plan {
        kubectl.create(&node::seed_manifest(plan))?;
    }

    let nodes: Vec<String> = (0..opts.nodes).map(bootstrap::node_name).collect();
    run.wait("kwok", "Ready nodes", || kubectl.nodes_ready(&nodes))?;
    run.wait(
        "kube-controller-manager",
        "the default ServiceAccount",
        || kubectl.service_account_exists("default", "default"),
    )?;
    for (component, port) in [
        ("kube-controller-manager", ports.controller_manager),
        ("kube-scheduler", ports.scheduler),
        ("kwok", ports.kwok),
    ] {
        run.wait(component, "its port", || bootstrap::listening(port))?;
    }
    if let Some(plan) = plan {
        let started = Instant::now();
        node::start(&mut run, plan, &ports, &kubectl)?;
        eprintln!(
            "cluster: real node {} ready after {:.1?}",
            node::NODE_NAME,
            started.elapsed()
        );
    }
    Ok(())
}

/// The processes started so far by one `up`, watched while waiting for readiness.
struct Startup<'a> {
    state: &'a StateDir,
    processes: Vec<Process>,
    timeout: Duration,
}

impl Startup<'_> {
    fn spawn(&mut self, component: &str, command: Command) -> Result<()> {
        self.state.record_command(component, &command)?;
        let process = process::spawn_detached(component, command, &self.state.log(component))?;
        self.state.record(&process)?;
        self.processes.push(process);
        Ok(())
    }

    /// Polls `ready`, the sign that `component` works, until it holds. Fails early,
    /// naming the process, when any started process exits, and names `component` when
    /// the sign does not come in time.
    fn wait(&self, component: &str, what: &str, mut ready: impl FnMut() -> bool) -> Result<()> {
        let started = Instant::now();
        loop {
            if ready() {
                eprintln!(
                    "cluster: {component}: {what} ok after {:.1?}",
                    started.elapsed()
                );
                return Ok(());
            }
            if let Some(dead) = self.processes.iter().find(|p| !p.is_running()) {
                let reason = format!("exited while waiting for {component}'s {what}");
                return Err(component_error(self.state, &dead.component, &reason));
            }
            if started.elapsed() > self.timeout {
                let reason = format!("gave no {what} within {:.0?}", self.timeout);
                return Err(component_error(self.state, component, &reason));
            }
            thread::sleep(Duration::from_millis(250));
        }
    }
}

/// An error naming `component` and its log, whose last lines go to stderr.
fn component_error(state: &StateDir, component: &str, reason: &str) -> anyhow::Error {
    let log = state.log(component);
    let text = fs::read_to_string(&log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    eprintln!("--- last lines of {} ---", log.display());
    for line in &lines[lines.len().saturating_sub(25)..] {
        eprintln!("{line}");
    }
    eprintln!("---");
    anyhow::anyhow!("{component} {reason} (log: {})", log.display())
}

fn run_once(what: &str, mut command: Command) -> Result<()> {
    let output = command.output().with_context(|| format!("run {what}"))?;
    if !output.status.success() {
        bail!(
            "{what} failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(())
}

/// Stops the cluster whose state is in `state_dir` (exactly the recorded processes:
/// SIGTERM, then SIGKILL after a grace period) and removes the directory. Nothing to do
/// when there is no cluster there.
pub fn down(state_dir: &Path) -> Result<()> {
    let state = StateDir::new(state_dir);
    if !state.exists() {
        if state_dir.exists() {
            bail!(
                "{} is not a cluster state directory; not touching it",
                state_dir.display()
            );
        }
        eprintln!("cluster: nothing in {}", state_dir.display());
        return Ok(());
    }
    // The node first, all at once by its cgroup (containers and shims included): it
    // keeps nothing worth a graceful stop.
    node::remove_node(&node::cluster_id(&state))?;
    for process in state.processes()?.iter().rev() {
        process.stop(STOP_GRACE)?;
    }
    state.remove()?;
    eprintln!("cluster: stopped and removed {}", state_dir.display());
    Ok(())
}

/// Stops `component` of the cluster in `state_dir` (SIGTERM, SIGKILL after a grace
/// period; nothing if it is not running) and starts it again with its recorded command
/// line, appending to the same log. Returns once it works again: etcd `/health`,
/// kube-apiserver `/readyz`, the others listening on their port. Every other component
/// is left alone; clients see the restart as a real one (connections dropped, watches
/// ended).
pub fn restart(state_dir: &Path, component: &str, timeout: Duration) -> Result<()> {
    let state = StateDir::new(state_dir);
    if !state.exists() {
        bail!("no cluster in {}", state_dir.display());
    }
    // One restart at a time (two tests of one binary may restart the API server at
    // once), each finding the component as the one before left it.
    let _lock = state.lock_processes()?;
    let Some(old) = state
        .processes()?
        .into_iter()
        .find(|p| p.component == component)
    else {
        bail!(
            "the cluster in {} has no component `{component}`",
            state_dir.display()
        );
    };
    let command = state.command(component)?;
    let kubectl = Kubectl::new(
        Path::new(command.get_program())
            .parent()
            .context("the component's program has no directory")?,
        &state.kubeconfig(),
    );
    let port = |name: &str| {
        state
            .ports()
            .into_iter()
            .find_map(|(n, port)| (n == name).then_some(port))
            .with_context(|| {
                format!(
                    "{name} has no port to tell that it works again: `restart` is for the \
                     control plane (the real node restarts with `down` and `up`)"
                )
            })
    };
    let ready: Box<dyn Fn() -> bool> = match component {
        "etcd" => {
            let port = port("etcd-client")?;
            Box::new(move || bootstrap::etcd_healthy(port))
        }
        "kube-apiserver" => Box::new(|| kubectl.apiserver_ready()),
        other => {
            let port = port(other)?;
            Box::new(move || bootstrap::listening(port))
        }
    };
    let started = Instant::now();
    old.stop(STOP_GRACE)?;
    let stopped = started.elapsed();
    let process = process::spawn_detached(component, command, &state.log(component))?;
    state.replace(&process)?;
    loop {
        if ready() {
            break;
        }
        if !process.is_running() {
            return Err(component_error(
                &state,
                component,
                "exited after its restart",
            ));
        }
        if started.elapsed() > timeout {
            let reason = format!("did not work again within {timeout:.0?} of its restart");
            return Err(component_error(&state, component, &reason));
        }
        thread::sleep(Duration::from_millis(100));
    }
    eprintln!(
        "cluster: {component} restarted (pid {} → {}): stopped in {stopped:.1?}, working again after {:.1?}",
        old.pid,
        process.pid,
        started.elapsed()
    );
    Ok(())
}

/// Best effort after a failed start: stop what was started, keep the logs.
fn stop_all(state: &StateDir) {
    if let Err(err) = node::remove_node(&node::cluster_id(state)) {
        eprintln!("cluster: {err:#}");
    }
    for process in state.processes().unwrap_or_default().iter().rev() {
        if let Err(err) = process.stop(STOP_GRACE) {
            eprintln!("cluster: {err:#}");
        }
    }
}

/// Prints which of the cluster's processes run, on which ports, and its kubeconfig.
pub fn status(state_dir: &Path) -> Result<()> {
    let state = StateDir::new(state_dir);
    if !state.exists() {
        println!("no cluster in {}", state_dir.display());
        return Ok(());
    }
    let ports = state.ports();
    let processes = state.processes()?;
    println!("cluster in {}", state_dir.display());
    for process in &processes {
        let running = if process.is_running() {
            "running"
        } else {
            "stopped"
        };
        // etcd has two ports (etcd-client, etcd-peer), the others one each.
        let listens: Vec<String> = ports
            .iter()
            .filter(|(name, _)| {
                let rest = name.strip_prefix(&process.component);
                rest.is_some_and(|rest| rest.is_empty() || rest.starts_with('-'))
            })
            .map(|(name, port)| format!("{name}=127.0.0.1:{port}"))
            .collect();
        println!(
            "  {:<24} pid {:<8} {running:<8} {}",
            process.component,
            process.pid,
            listens.join(" ")
        );
    }
    let running = processes.iter().filter(|p| p.is_running()).count();
    if let Some(node) = node::describe(&state) {
        println!("  {node}");
    }
    println!(
        "  {running}/{} processes running; logs in {}",
        processes.len(),
        state.logs().display()
    );
    println!("  export KUBECONFIG={}", state.kubeconfig().display());
    Ok(())
}

/// `cluster selftest`: up with a real node, a crash (SIGKILL to every recorded process),
/// up again, down; then the machine must be as before.
fn selftest(opts: &UpOptions) -> Result<()> {
    let state_dir = &opts.state_dir;
    if StateDir::new(state_dir).exists() {
        bail!(
            "{} holds a cluster; selftest wants a directory of its own",
            state_dir.display()
        );
    }
    let before = HostSnapshot::take(state_dir)?;
    let opts = opts.clone().node(NodeChoice::Real);
    let cluster = up(&opts)?;
    // A running container, so that the crash leaves a shim and a container process
    // behind, which no PID file names.
    let kubectl = Kubectl::new(&cluster.bin_dir, &cluster.kubeconfig);
    kubectl.run(&[
        "run",
        "selftest",
        &format!("--image={}", node::PROBE_IMAGE),
        "--image-pull-policy=Never",
        "--restart=Never",
    ])?;
    kubectl.run(&[
        "wait",
        "pod/selftest",
        "--for=condition=Ready",
        "--timeout=60s",
    ])?;
    let state = StateDir::new(state_dir);
    let processes = state.processes()?;
    eprintln!(
        "cluster selftest: killing all {} recorded processes (SIGKILL)",
        processes.len()
    );
    let pids: Vec<u32> = processes.iter().map(|p| p.pid).collect();
    process::signal_all(&pids, "KILL")?;
    let started = Instant::now();
    while processes.iter().any(Process::is_running) {
        if started.elapsed() > Duration::from_secs(10) {
            bail!("recorded processes survived SIGKILL");
        }
        thread::sleep(Duration::from_millis(50));
    }
    let survivors: Vec<Process> = node::node_pids(&state)?
        .into_iter()
        .filter_map(|pid| Process::observe("node", pid))
        .collect();
    eprintln!(
        "cluster selftest: after the crash, {} processes of the node live on (shims, \
         containers, the pause and the probe)",
        survivors.len()
    );
    up(&opts).context("up after a crash")?;
    if let Some(survivor) = survivors.iter().find(|p| p.is_running()) {
        bail!(
            "process {} of the crashed node survived the next `up`",
            survivor.pid
        );
    }
    down(state_dir)?;
    let changes = HostSnapshot::take(state_dir)?.changes_since(&before);
    if !changes.is_empty() {
        bail!("`down` left the machine changed:\n{}", changes.join("\n"));
    }
    eprintln!("cluster selftest: ok, the machine is as it was");
    Ok(())
}

/// Entry point for `cargo xtask cluster …`.
pub fn main(args: &[String]) -> Result<()> {
    let (command, operand, opts) = parse(args)?;
    match command.as_str() {
        "up" => {
            let cluster = up(&opts)?;
            // Only shell on stdout: `eval "$(cargo xtask cluster up)"` works.
            println!("export KUBECONFIG={}", cluster.kubeconfig.display());
            println!("export PATH={}:$PATH", cluster.bin_dir.display());
            eprintln!(
                "cluster: state in {}; kubectl is {}; stop with `cargo xtask cluster down{}`",
                cluster.state_dir.display(),
                cluster.bin_dir.join("kubectl").display(),
                state_dir_flag(&cluster.state_dir)
            );
            Ok(())
        }
        "down" => down(&opts.state_dir),
        "status" => status(&opts.state_dir),
        "restart" => {
            let component = operand
                .as_deref()
                .context("restart needs a component, e.g. `cluster restart kube-apiserver`")?;
            restart(&opts.state_dir, component, opts.step_timeout)
        }
        "build" => {
            println!("{}", ensure_binaries()?.display());
            println!("{}", binaries::ensure_node_binaries()?.display());
            println!("{}", binaries::ensure_helm()?.display());
            println!("{}", binaries::ensure_crane()?.display());
            Ok(())
        }
        "pin" => binaries::pin(),
        "selftest" => selftest(&opts),
        "import" => {
            let tar = operand
                .as_deref()
                .context("import needs an image tar, e.g. `cluster import image.tar`")?;
            import_image(&opts.state_dir, Path::new(tar))?;
            eprintln!("cluster: imported {tar} into {}", node::NODE_NAME);
            Ok(())
        }
        "-h" | "--help" | "help" => {
            print!("{USAGE}");
            Ok(())
        }
        other => bail!("unknown cluster command `{other}`\n\n{USAGE}"),
    }
}

/// The command, its operand (`restart`'s component), and the options.
fn parse(args: &[String]) -> Result<(String, Option<String>, UpOptions)> {
    let mut opts = UpOptions::default();
    let mut command = None;
    let mut operand = None;
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        let mut value = |flag: &str| {
            args.next()
                .cloned()
                .with_context(|| format!("{flag} needs a value"))
        };
        match arg.as_str() {
            "--state-dir" => opts = opts.state_dir(value("--state-dir")?),
            "--nodes" => {
                let n = value("--nodes")?;
                opts = opts.nodes(
                    n.parse()
                        .with_context(|| format!("--nodes {n}: not a number"))?,
                );
            }
            "--node" => opts = opts.node(NodeChoice::parse(&value("--node")?)?),
            flag if flag.starts_with("--state-dir=") => {
                opts = opts.state_dir(&flag["--state-dir=".len()..]);
            }
            flag if flag.starts_with('-') && flag != "-h" && flag != "--help" => {
                bail!("unknown option `{flag}`\n\n{USAGE}")
            }
            _ if command.is_none() => command = Some(arg.clone()),
            _ if matches!(command.as_deref(), Some("restart" | "import")) && operand.is_none() => {
                operand = Some(arg.clone());
            }
            _ => bail!("unexpected argument `{arg}`\n\n{USAGE}"),
        }
    }
    Ok((command.unwrap_or_else(|| "--help".into()), operand, opts))
}

fn state_dir_flag(dir: &Path) -> String {
    if dir == default_state_dir() {
        String::new()
    } else {
        format!(" --state-dir {}", dir.display())
    }
}
