//! The real node of a local cluster: containerd, runc, the CNI plugins, the kubelet,
//! kube-proxy and CoreDNS, in a mount and network namespace of their own, so that nothing
//! on the machine outside the cluster's state directory changes.
//!
//! - **Mount namespace** (private propagation): files bind-mounted over the `/proc/sys`
//!   entries the kubelet rewrites absorb its writes; overlays on `/var` and `/run` (upper
//!   layers in the state directory) take what the node writes there; the kubelet's root
//!   directory is bind-mounted on itself and made rshared for volume mounts.
//! - **Network namespace**, joined to the host by a veth pair: the node's IP is on its
//!   end, the host's end has the other address of a /30. iptables rules of kube-proxy and
//!   the CNI bridge exist only in there, pod traffic leaving the node is masqueraded in
//!   there. `capstan-relay` listens on the node's IP inside it and relays to the API
//!   server on the host's 127.0.0.1, which stays the only address the API server binds.
//! - **cgroups**: every process of the node, and every pod (the kubelet's `cgroupRoot`),
//!   is under `/capstan-<id>` ([`NodeCgroup`]), so that `down` kills them all.
//!
//! The namespaces are held by a `sleep` process (`node-namespaces`) and by the node's
//! processes, and have no name in `/run/netns`: they end with the last of them.

use std::{
    env, fs,
    net::{Ipv4Addr, UdpSocket},
    path::{Path, PathBuf},
    process::Command,
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

use super::{
    Startup,
    bootstrap::Kubectl,
    cgroups::NodeCgroup,
    state::{Ports, StateDir},
};
use crate::oci;

/// The real node's name.
pub const NODE_NAME: &str = "capstan-node";
/// The ClusterIP of `kube-dns`, which the kubelet gives pods as their nameserver.
pub const CLUSTER_DNS_IP: &str = "10.96.0.10";
/// The pause image, made from the pinned Kubernetes source: every pod's sandbox.
pub const PAUSE_IMAGE: &str = "capstan.dev/pause:v1.37.2";
/// A tiny static test image (`tests/control-plane/probe`).
pub const PROBE_IMAGE: &str = "capstan.dev/probe:v1";
/// The default StorageClass on a cluster with a real node, served by
/// `capstan-provisioner`.
pub const STORAGE_CLASS: &str = "standard";
/// The `/proc/sys` entries a kubelet writes (its kernel tunables): in the node's mount
/// namespace each is a file of the state directory.
const KUBELET_SYSCTLS: &[&str] = &[
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
];
/// Directories the node writes to that are not its own: overlaid in its namespace.
const OVERLAID: &[&str] = &["/var", "/run"];

/// Which nodes `up` gives a cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeChoice {
    /// A real node where the machine allows one, else kwok's fake nodes only.
    Auto,
    /// A real node, or fail.
    Real,
    /// kwok's fake nodes only.
    Kwok,
}

impl NodeChoice {
    /// `auto`, `real` or `kwok`.
    pub fn parse(text: &str) -> Result<Self> {
        match text {
            "auto" => Ok(Self::Auto),
            "real" => Ok(Self::Real),
            "kwok" => Ok(Self::Kwok),
            other => bail!("unknown node kind `{other}` (auto, real or kwok)"),
        }
    }

    /// `$CAPSTAN_NODE`, else [`NodeChoice::Auto`].
    pub fn from_env() -> Result<Self> {
        match env::var("CAPSTAN_NODE") {
            Ok(text) if !text.is_empty() => Self::parse(&text).context("$CAPSTAN_NODE"),
            _ => Ok(Self::Auto),
        }
    }

    /// Whether the cluster gets a real node: `Auto` says in one line why not when the
    /// machine does not allow one.
    pub fn resolve(self, state: &StateDir) -> Result<bool> {
        match self {
            Self::Kwok => Ok(false),
            Self::Real => match unavailable(state) {
                None => Ok(true),
                Some(why) => bail!("no real node possible here: {why}"),
            },
            Self::Auto => match unavailable(state) {
                None => Ok(true),
                Some(why) => {
                    eprintln!("cluster: no real node ({why}); kwok's fake nodes only");
                    Ok(false)
                }
            },
        }
    }
}

/// Why this machine cannot run a real node, or `None` when it can.
fn unavailable(state: &StateDir) -> Option<String> {
    let status = fs::read_to_string("/proc/self/status").unwrap_or_default();
    let root = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .is_some_and(|uids| uids.split_whitespace().next() == Some("0"));
    if !root {
        return Some("not running as root".into());
    }
    for dir in OVERLAID {
        if state.root().starts_with(dir) {
            return Some(format!(
                "the state directory is under {dir}, which the node overlays"
            ));
        }
    }
    let unshare = Command::new("unshare")
        .args(["--mount", "--net", "true"])
        .output();
    if !unshare.is_ok_and(|o| o.status.success()) {
        return Some("`unshare --mount --net` is not allowed".into());
    }
    let probe = NodeCgroup::new(&format!("probe-{}", std::process::id()));
    match probe.and_then(|cg| {
        let made = cg.create();
        cg.kill_and_remove()?;
        made
    }) {
        Ok(()) => None,
        Err(err) => Some(format!("cgroups are not writable: {err:#}")),
    }
}

/// The network between the host and the node: a /30 whose first address is the host's
/// end of the veth pair and whose second is the node's.
#[derive(Debug, Clone)]
pub struct NodeNet {
    /// The host's end of the veth pair (its name).
    pub veth: String,
    pub host_ip: Ipv4Addr,
    /// The node's IP: the kubelet's, the API server's advertised address (through the
    /// relay), CoreDNS's.
    pub node_ip: Ipv4Addr,
    /// Pod IPs on the node (the CNI bridge's subnet, a /24 in 10.220.0.0/12 that goes
    /// with the /30), routed from the host through the veth pair so that the API server
    /// reaches a webhook served by a Pod (`--enable-aggregator-routing`: it calls the
    /// Service's endpoints). The route goes with the veth at `down`.
    pub pod_subnet: String,
}

impl NodeNet {
    /// A /30 in 10.213.0.0/16 chosen by the cluster's id, moved on while the host has an
    /// address in it (another cluster's).
    pub fn pick(id: &str) -> Result<Self> {
        let addrs = command_output(Command::new("ip").args(["-4", "-o", "addr", "show"]))
            .context("list the host's addresses (`ip`, from iproute2)")?;
        let routes = command_output(Command::new("ip").args(["-4", "route", "show"]))
            .context("list the host's routes (`ip`, from iproute2)")?;
        let seed = u32::from_str_radix(id, 16).unwrap_or(0);
        for step in 0..16384u32 {
            let block = (seed.wrapping_add(step)) % 16384;
            let base = Ipv4Addr::new(10, 213, (block >> 6) as u8, ((block & 63) << 2) as u8);
            let [a, b, c, d] = base.octets();
            let host_ip = Ipv4Addr::new(a, b, c, d + 1);
            let node_ip = Ipv4Addr::new(a, b, c, d + 2);
            let taken = [base, host_ip, node_ip, Ipv4Addr::new(a, b, c, d + 3)]
                .iter()
                .any(|ip| addrs.contains(&format!("inet {ip}/")));
            // 4096 /24s: two clusters share one only if their /30s are 4096 apart.
            let pod_base = 220 * 256 + (block % 4096);
            let pod_prefix = format!("10.{}.{}.", pod_base >> 8, pod_base & 255);
            let pod_taken = addrs.contains(&format!("inet {pod_prefix}"))
                || routes
                    .lines()
                    .any(|r| r.starts_with(&format!("{pod_prefix}0/24")));
            if !taken && !pod_taken {
                return Ok(Self {
                    veth: veth_name(id),
                    host_ip,
                    node_ip,
                    pod_subnet: format!("{pod_prefix}0/24"),
                });
            }
        }
        bail!("no free /30 in 10.213.0.0/16 for the node's veth pair")
    }
}

fn veth_name(id: &str) -> String {
    format!("capstan{id}")[..15].to_owned()
}

/// The id of the cluster in `state`, from its path: it names the node's cgroup and veth,
/// so that the next `up` in the same directory finds what a crashed one left.
pub fn cluster_id(state: &StateDir) -> String {
    // FNV-1a: stable across Rust releases, unlike the std hasher.
    let mut hash: u32 = 0x811c_9dc5;
    for byte in state.root().as_os_str().as_encoded_bytes() {
        hash ^= u32::from(*byte);
        hash = hash.wrapping_mul(0x0100_0193);
    }
    format!("{hash:08x}")
}

/// Paths of the node's files in the state directory.
struct NodeDirs {
    root: PathBuf,
}

impl NodeDirs {
    fn new(state: &StateDir) -> Self {
        Self {
            root: state.root().join("node"),
        }
    }
    fn path(&self, rel: &str) -> PathBuf {
        self.root.join(rel)
    }
    fn containerd_socket(&self) -> PathBuf {
        self.path("containerd/containerd.sock")
    }
    fn kubelet_root(&self) -> PathBuf {
        self.path("kubelet")
    }
}

/// Everything `up` needs to start a real node.
pub struct NodePlan {
    pub net: NodeNet,
    pub cgroup: NodeCgroup,
    /// The node's binaries.
    pub bin: PathBuf,
}

impl NodePlan {
    /// Cleans what an earlier cluster in the same directory left, builds the node's
    /// binaries if needed, installs iptables if missing, and picks the node's network.
    pub fn prepare(state: &StateDir) -> Result<Self> {
        let id = cluster_id(state);
        super::binaries::ensure_debian_package("/usr/sbin/iptables", "iptables")?;
        let bin = super::binaries::ensure_node_binaries()?;
        Ok(Self {
            net: NodeNet::pick(&id)?,
            cgroup: NodeCgroup::new(&id)?,
            bin,
        })
    }

    /// The apiserver URL as the node reaches it: the relay on the node's IP.
    pub fn apiserver_url(&self, ports: &Ports) -> String {
        format!("https://{}:{}", self.net.node_ip, ports.apiserver)
    }
}

/// Kills every process of the node of the cluster with this id (containers and shims
/// included) and removes its cgroups and veth: `down`, and `up` after a crash (or a
/// `kill -9` of the recorded processes). Returns whether there was anything.
pub fn remove_node(id: &str) -> Result<bool> {
    let cgroup = NodeCgroup::new(id)?;
    let found = cgroup.exists();
    cgroup.kill_and_remove()?;
    // The veth pair ends with its network namespace, a moment after the namespace's
    // last process; delete it if it outlives that.
    let veth = veth_name(id);
    let gone = || {
        !Command::new("ip")
            .args(["link", "show", &veth])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while !gone() && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(100));
    }
    if !gone() {
        let _ = Command::new("ip").args(["link", "delete", &veth]).status();
    }
    Ok(found)
}

/// Every process in the node's cgroups (its daemons, shims and containers).
pub fn node_pids(state: &StateDir) -> Result<Vec<u32>> {
    Ok(NodeCgroup::new(&cluster_id(state))?.pids())
}

/// The objects a cluster with a real node starts with, besides kwok's: the default
/// StorageClass of the provisioner, the `kube-dns` Service with CoreDNS's endpoint (the
/// node's IP), and the RBAC of CoreDNS and the provisioner.
pub fn seed_manifest(plan: &NodePlan) -> String {
    let ip = plan.net.node_ip;
    format!(
        "---
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata:
  name: {STORAGE_CLASS}
  annotations:
    storageclass.kubernetes.io/is-default-class: \"true\"
provisioner: capstan.dev/local-path
# The provisioner pins each volume to the node the scheduler chose for its first pod.
volumeBindingMode: WaitForFirstConsumer
reclaimPolicy: Delete
---
apiVersion: v1
kind: Service
metadata:
  name: kube-dns
  namespace: kube-system
  labels:
    k8s-app: kube-dns
spec:
  clusterIP: {CLUSTER_DNS_IP}
  ports:
  - {{name: dns, port: 53, protocol: UDP, targetPort: 53}}
  - {{name: dns-tcp, port: 53, protocol: TCP, targetPort: 53}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: kube-dns-capstan-node
  namespace: kube-system
  labels:
    kubernetes.io/service-name: kube-dns
    endpointslice.kubernetes.io/managed-by: cluster.capstan.dev
addressType: IPv4
endpoints:
- addresses: [\"{ip}\"]
  conditions: {{ready: true}}
  nodeName: {NODE_NAME}
ports:
- {{name: dns, port: 53, protocol: UDP}}
- {{name: dns-tcp, port: 53, protocol: TCP}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: capstan:coredns
rules:
- apiGroups: [\"\"]
  resources: [endpoints, services, pods, namespaces]
  verbs: [list, watch]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: capstan:coredns
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: capstan:coredns}}
subjects:
- {{apiGroup: rbac.authorization.k8s.io, kind: User, name: capstan:coredns}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: capstan:provisioner
rules:
- apiGroups: [\"\"]
  resources: [persistentvolumes]
  verbs: [get, list, watch, create, delete, patch, update]
- apiGroups: [\"\"]
  resources: [persistentvolumeclaims]
  verbs: [get, list, watch, update, patch]
- apiGroups: [storage.k8s.io]
  resources: [storageclasses, csinodes]
  verbs: [get, list, watch]
- apiGroups: [\"\"]
  resources: [nodes]
  verbs: [get, list, watch]
- apiGroups: [\"\", events.k8s.io]
  resources: [events]
  verbs: [create, update, patch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: capstan:provisioner
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: capstan:provisioner}}
subjects:
- {{apiGroup: rbac.authorization.k8s.io, kind: User, name: capstan:provisioner}}
"
    )
}

/// Starts the node's namespaces and processes, and returns once the node is Ready,
/// CoreDNS answers and the provisioner runs.
pub fn start(
    run: &mut Startup<'_>,
    plan: &NodePlan,
    ports: &Ports,
    kubectl: &Kubectl,
) -> Result<()> {
    let state = run.state;
    let dirs = NodeDirs::new(state);
    write_files(state, &dirs, plan)?;
    plan.cgroup.create()?;
    let in_cgroup = |command: Command| join_cgroup(&plan.cgroup, command);

    // The namespaces, held by `sleep` once its shell has mounted what keeps the host clean.
    let setup = dirs.path("namespaces.sh");
    fs::write(&setup, NAMESPACE_SETUP).context("write the namespaces' setup script")?;
    let mut holder = Command::new("unshare");
    holder
        .args(["--mount", "--net", "--propagation", "private", "--", "sh"])
        .arg(&setup)
        .arg(&dirs.root)
        .arg(dirs.kubelet_root())
        .args(KUBELET_SYSCTLS);
    run.spawn("node-namespaces", in_cgroup(holder))?;
    let holder_pid = run.processes.last().map(|p| p.pid).context("no holder")?;
    let ready = dirs.path("namespaces-ready");
    run.wait("node-namespaces", "mounts", || ready.exists())?;
    connect_network(&plan.net, holder_pid)?;

    let in_node = |program: &Path, args: Vec<String>| {
        let mut command = Command::new("nsenter");
        command
            .arg(format!("--target={holder_pid}"))
            .args(["--mount", "--net", "--"])
            .arg(program)
            .args(args);
        command.env("PATH", node_path(&plan.bin));
        in_cgroup(command)
    };
    let bin = |name: &str| plan.bin.join(name);
    let file = |rel: &str| dirs.path(rel).display().to_string();

    let mut relay = Command::new(bin("capstan-relay"));
    relay.args([
        format!("-netns=/proc/{holder_pid}/ns/net"),
        format!("-listen={}:{}", plan.net.node_ip, ports.apiserver),
        format!("-target=127.0.0.1:{}", ports.apiserver),
    ]);
    run.spawn("capstan-relay", in_cgroup(relay))?;

    run.spawn(
        "containerd",
        in_node(
            &bin("containerd"),
            vec![format!("--config={}", file("containerd/config.toml"))],
        ),
    )?;
    let ctr = Ctr::new(&plan.bin, &dirs.containerd_socket());
    run.wait("containerd", "its socket", || ctr.works())?;
    import_node_images(state, &plan.bin, &ctr)?;

    let kubelet_args = vec![
        format!("--config={}", file("kubelet.yaml")),
        format!(
            "--kubeconfig={}",
            state.component_kubeconfig("kubelet").display()
        ),
        format!("--root-dir={}", dirs.kubelet_root().display()),
        format!("--hostname-override={NODE_NAME}"),
        format!("--node-ip={}", plan.net.node_ip),
        "--node-labels=type=real".to_owned(),
        "--v=1".to_owned(),
    ];
    run.spawn("kubelet", in_node(&bin("kubelet"), kubelet_args))?;
    run.spawn(
        "kube-proxy",
        in_node(
            &bin("kube-proxy"),
            vec![format!("--config={}", file("kube-proxy.yaml"))],
        ),
    )?;
    run.spawn(
        "coredns",
        in_node(&bin("coredns"), vec![format!("-conf={}", file("Corefile"))]),
    )?;
    let mut provisioner = Command::new(bin("capstan-provisioner"));
    provisioner.args([
        format!(
            "-kubeconfig={}",
            state.component_kubeconfig("provisioner").display()
        ),
        format!("-root={}", dirs.path("volumes").display()),
        format!("-node={NODE_NAME}"),
    ]);
    run.spawn("capstan-provisioner", in_cgroup(provisioner))?;

    let node = [NODE_NAME.to_owned()];
    run.wait("kubelet", "a Ready node", || kubectl.nodes_ready(&node))?;
    let dns = plan.net.node_ip;
    run.wait("coredns", "an answer for kubernetes.default", || {
        dns_answers(dns, "kubernetes.default.svc.cluster.local")
    })?;
    let log = state.log("capstan-provisioner");
    run.wait("capstan-provisioner", "its controller", || {
        fs::read_to_string(&log).is_ok_and(|l| l.contains("Started provisioner controller"))
    })?;
    Ok(())
}

/// Run by the namespace holder, inside its new mount namespace: `$1` is the node's
/// directory, `$2` the kubelet's root directory, the rest [`KUBELET_SYSCTLS`].
const NAMESPACE_SETUP: &str = r#"set -e
node=$1
kubelet=$2
shift 2
for key in "$@"; do
  file="$node/sysctl/$(echo "$key" | tr / .)"
  cat "/proc/sys/$key" > "$file"
  mount --bind "$file" "/proc/sys/$key"
done
for dir in var run; do
  mkdir -p "$node/overlay/$dir/upper" "$node/overlay/$dir/work"
  mount -t overlay "capstan-$dir" -o "lowerdir=/$dir,upperdir=$node/overlay/$dir/upper,workdir=$node/overlay/$dir/work" "/$dir"
done
mount --bind "$kubelet" "$kubelet"
mount --make-rshared "$kubelet"
: > "$node/namespaces-ready"
exec sleep infinity
"#;

/// `command`, started by a shell that first moves itself into the node's cgroup
/// everywhere, so that it and all it starts belong to the node.
fn join_cgroup(cgroup: &NodeCgroup, command: Command) -> Command {
    let files = cgroup.node_procs_files();
    let mut shell = Command::new("sh");
    shell
        .args([
            "-c",
            r#"n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1"; shift; n=$((n-1)); done; exec "$@""#,
            "sh",
        ])
        .arg(files.len().to_string())
        .args(&files)
        .arg(command.get_program())
        .args(command.get_args());
    for (key, value) in command.get_envs() {
        match value {
            Some(value) => shell.env(key, value),
            None => shell.env_remove(key),
        };
    }
    shell
}

fn node_path(bin: &Path) -> String {
    let host = env::var("PATH").unwrap_or_else(|_| "/usr/sbin:/usr/bin:/sbin:/bin".into());
    format!("{}:{host}", bin.display())
}

/// The veth pair: the host's end with the /30's first address, the node's end (`eth0`)
/// with the second and the default route through the host.
fn connect_network(net: &NodeNet, holder_pid: u32) -> Result<()> {
    let pid = holder_pid.to_string();
    let host = |args: &[&str]| run_ip(Command::new("ip").args(args));
    let node = |args: &[&str]| {
        run_ip(
            Command::new("nsenter")
                .args(["--target", &pid, "--net", "--", "ip"])
                .args(args),
        )
    };
    let veth = net.veth.as_str();
    host(&[
        "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", &pid,
    ])?;
    host(&["addr", "add", &format!("{}/30", net.host_ip), "dev", veth])?;
    host(&["link", "set", veth, "up"])?;
    node(&["link", "set", "lo", "up"])?;
    node(&["addr", "add", &format!("{}/30", net.node_ip), "dev", "eth0"])?;
    node(&["link", "set", "eth0", "up"])?;
    node(&["route", "add", "default", "via", &net.host_ip.to_string()])?;
    host(&[
        "route",
        "add",
        &net.pod_subnet,
        "via",
        &net.node_ip.to_string(),
        "dev",
        veth,
    ])
}

fn run_ip(command: &mut Command) -> Result<()> {
    command_output(command).map(drop)
}

fn command_output(command: &mut Command) -> Result<String> {
    let output = command
        .output()
        .with_context(|| format!("run {:?}", command.get_program()))?;
    if !output.status.success() {
        bail!(
            "`{:?} {}` failed: {}",
            command.get_program(),
            command
                .get_args()
                .map(|a| a.to_string_lossy())
                .collect::<Vec<_>>()
                .join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// `ctr` against the node's containerd, in the `k8s.io` namespace the kubelet uses.
pub struct Ctr {
    program: PathBuf,
    socket: PathBuf,
}

impl Ctr {
    fn new(bin: &Path, socket: &Path) -> Self {
        Self {
            program: bin.join("ctr"),
            socket: socket.to_owned(),
        }
    }

    fn command(&self) -> Command {
        let mut command = Command::new(&self.program);
        command
            .arg(format!("--address={}", self.socket.display()))
            .args(["--namespace=k8s.io"]);
        command
    }

    fn works(&self) -> bool {
        self.socket.exists()
            && self
                .command()
                .arg("version")
                .output()
                .is_ok_and(|o| o.status.success())
    }

    /// `ctr images import`: containerd unpacks it (the transfer service does the work
    /// inside the node's namespaces, not here).
    pub fn import(&self, tar: &Path) -> Result<()> {
        command_output(
            self.command()
                .args(["images", "import", "--all-platforms"])
                .arg(tar),
        )
        .with_context(|| format!("import {} into the node", tar.display()))
        .map(drop)
    }
}

/// Imports an image tar (OCI image layout or `docker save`) into the real node of the
/// cluster in `state_dir`, where Pods find it by the name it carries.
pub fn import_image(state_dir: &Path, tar: &Path) -> Result<()> {
    let state = StateDir::new(state_dir);
    if !state.exists() {
        bail!("no cluster in {}", state_dir.display());
    }
    let dirs = NodeDirs::new(&state);
    if !dirs.containerd_socket().exists() {
        bail!(
            "the cluster in {} has no real node (kwok's nodes run no images)",
            state_dir.display()
        );
    }
    let bin = super::binaries::node_bin_dir()?;
    let tar = std::path::absolute(tar).unwrap_or_else(|_| tar.to_owned());
    Ctr::new(&bin, &dirs.containerd_socket()).import(&tar)
}

/// Makes the pause and probe images (each one static program) and imports them.
fn import_node_images(state: &StateDir, bin: &Path, ctr: &Ctr) -> Result<()> {
    let images = state.root().join("node/images");
    for (name, program, entrypoint) in [
        (PAUSE_IMAGE, "pause", "/pause"),
        (PROBE_IMAGE, "probe", "/probe"),
    ] {
        let rootfs = images.join(program);
        fs::create_dir_all(&rootfs).with_context(|| format!("create {}", rootfs.display()))?;
        fs::copy(bin.join(program), rootfs.join(program))
            .with_context(|| format!("copy {program} into its image"))?;
        let config = oci::ImageConfig {
            name: name.to_owned(),
            entrypoint: vec![entrypoint.to_owned()],
            ..Default::default()
        };
        let tar = images.join(format!("{program}.tar"));
        oci::write_image(&[rootfs.as_path()], &config, &tar)?;
        ctr.import(&tar)?;
    }
    Ok(())
}

/// Whether a DNS server at `server`:53 answers an A query for `name` with an address.
fn dns_answers(server: Ipv4Addr, name: &str) -> bool {
    let ask = || -> std::io::Result<bool> {
        let socket = UdpSocket::bind("0.0.0.0:0")?;
        socket.set_read_timeout(Some(Duration::from_millis(500)))?;
        let mut query = vec![0x43, 0x50, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
        for label in name.split('.') {
            query.push(label.len() as u8);
            query.extend_from_slice(label.as_bytes());
        }
        query.extend_from_slice(&[0, 0, 1, 0, 1]);
        socket.send_to(&query, (server, 53))?;
        let mut answer = [0u8; 512];
        let len = socket.recv(&mut answer)?;
        // Same id, a response, rcode 0, at least one answer.
        Ok(len > 12
            && answer[..2] == query[..2]
            && answer[2] & 0x80 != 0
            && answer[3] & 0x0f == 0
            && u16::from_be_bytes([answer[6], answer[7]]) > 0)
    };
    ask().unwrap_or(false)
}

/// The node's configuration files: containerd's, the CNI network, the kubelet's,
/// kube-proxy's, CoreDNS's, and the pods' resolv.conf for `dnsPolicy: Default`.
fn write_files(state: &StateDir, dirs: &NodeDirs, plan: &NodePlan) -> Result<()> {
    for dir in [
        "containerd",
        "cni/net.d",
        "kubelet",
        "pod-logs",
        "manifests",
        "sysctl",
        "volumes",
        "images",
        "containerd/certs.d",
    ] {
        let path = dirs.path(dir);
        fs::create_dir_all(&path).with_context(|| format!("create {}", path.display()))?;
    }
    let p = |rel: &str| dirs.path(rel).display().to_string();
    let pki = |file: &str| state.pki().join(file).display().to_string();
    let bin = plan.bin.display();
    let ip = plan.net.node_ip;
    let pod_subnet = &plan.net.pod_subnet;

    let containerd = format!(
        r#"version = 3
root = "{root}"
state = "{state_dir}"

[grpc]
  address = "{socket}"
[ttrpc]
  address = "{socket}.ttrpc"
[debug]
  address = "{debug}"

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{PAUSE_IMAGE}"
  [plugins."io.containerd.cri.v1.images".registry]
    config_path = "{certs}"

[plugins."io.containerd.cri.v1.runtime"]
  # CAP_SYS_RESOURCE may be missing from the bounding set: never lower a score.
  restrict_oom_score_adj = true
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = "{bin}/runc"
        Root = "{runc_root}"
        SystemdCgroup = false
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["{bin}"]
    conf_dir = "{cni_conf}"
"#,
        root = p("containerd/root"),
        state_dir = p("containerd/state"),
        socket = dirs.containerd_socket().display(),
        debug = p("containerd/debug.sock"),
        certs = p("containerd/certs.d"),
        runc_root = p("containerd/runc"),
        cni_conf = p("cni/net.d"),
    );
    fs::write(dirs.path("containerd/config.toml"), containerd)?;

    let cni = format!(
        r#"{{
  "cniVersion": "1.0.0",
  "name": "capstan",
  "plugins": [
    {{
      "type": "bridge",
      "bridge": "cni0",
      "isGateway": true,
      "ipMasq": true,
      "hairpinMode": true,
      "ipam": {{
        "type": "host-local",
        "ranges": [[{{"subnet": "{pod_subnet}"}}]],
        "routes": [{{"dst": "0.0.0.0/0"}}],
        "dataDir": "{ipam}"
      }}
    }},
    {{"type": "portmap", "capabilities": {{"portMappings": true}}}}
  ]
}}
"#,
        ipam = p("cni/ipam"),
    );
    fs::write(dirs.path("cni/net.d/10-capstan.conflist"), cni)?;

    let resolv = fs::read_to_string("/etc/resolv.conf").unwrap_or_default();
    fs::write(dirs.path("resolv.conf"), resolv)?;

    let kubelet = format!(
        r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: "{ip}"
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
authentication:
  anonymous: {{enabled: false}}
  webhook: {{enabled: true}}
  x509: {{clientCAFile: "{ca}"}}
authorization: {{mode: Webhook}}
tlsCertFile: "{serving_crt}"
tlsPrivateKeyFile: "{serving_key}"
containerRuntimeEndpoint: "unix://{socket}"
cgroupDriver: cgroupfs
cgroupRoot: "{cgroup_root}"
# This machine's cgroups may be v1 (or hybrid), which the kubelet refuses by default.
failCgroupV1: false
failSwapOn: false
# The default -999 needs CAP_SYS_RESOURCE.
oomScoreAdj: 0
podLogsDir: "{pod_logs}"
staticPodPath: "{manifests}"
resolvConf: "{resolv}"
clusterDNS: ["{CLUSTER_DNS_IP}"]
clusterDomain: cluster.local
# A disk shared with everything else on the machine: neither evict pods nor delete
# images because of what others use.
evictionHard:
  memory.available: "1Mi"
  nodefs.available: "1%"
  nodefs.inodesFree: "1%"
  imagefs.available: "1%"
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
maxPods: 110
# How often each pod is synced, which bounds how soon a ConfigMap volume shows a change
# (the PostgreSQL plugin's topology, docs/postgresql.md): 1m by default.
syncFrequency: 10s
"#,
        ca = pki("ca.crt"),
        serving_crt = pki("kubelet-serving.crt"),
        serving_key = pki("kubelet-serving.key"),
        socket = dirs.containerd_socket().display(),
        cgroup_root = plan.cgroup.root,
        pod_logs = p("pod-logs"),
        manifests = p("manifests"),
        resolv = p("resolv.conf"),
    );
    fs::write(dirs.path("kubelet.yaml"), kubelet)?;

    let proxy = format!(
        r#"apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection:
  kubeconfig: "{kubeconfig}"
hostnameOverride: {NODE_NAME}
mode: iptables
bindAddress: "{ip}"
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
clusterCIDR: "{pod_subnet}"
iptables:
  # Pods on one bridge reach each other through a Service only if the reply comes back
  # through the node, which masquerading makes sure of without br_netfilter's help.
  masqueradeAll: true
# Leave the conntrack table's global settings alone: they are the machine's.
conntrack:
  maxPerCore: 0
  min: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
"#,
        kubeconfig = state.component_kubeconfig("kube-proxy").display(),
    );
    fs::write(dirs.path("kube-proxy.yaml"), proxy)?;

    let corefile = format!(
        r#".:53 {{
    errors
    health 127.0.0.1:8080
    ready 127.0.0.1:8181
    kubernetes cluster.local in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig}
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
    cache 30
    loadbalance
}}
"#,
        kubeconfig = state.component_kubeconfig("coredns").display(),
    );
    fs::write(dirs.path("Corefile"), corefile)?;
    Ok(())
}

/// What `status` says about the node.
pub fn describe(state: &StateDir) -> Option<String> {
    let dirs = NodeDirs::new(state);
    let config = fs::read_to_string(dirs.path("kubelet.yaml")).ok()?;
    let ip = config
        .lines()
        .find_map(|l| l.strip_prefix("address: "))?
        .trim_matches('"')
        .to_owned();
    Some(format!(
        "real node {NODE_NAME} at {ip} (cgroup /capstan-{}); kwok's nodes are tainted",
        cluster_id(state)
    ))
}

/// What a cluster's node could leave on the machine: its mounts, cgroups, veth and
/// processes, and the machine-wide iptables rules and sysctls a kubelet, kube-proxy or
/// CNI plugin would change outside their namespaces. Taken before `up` and after `down`,
/// two snapshots must be equal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostSnapshot {
    /// Mounts whose line names the state directory.
    mounts: Vec<String>,
    /// The node's cgroup directories that exist.
    cgroups: Vec<String>,
    /// Whether the host end of the node's veth pair exists.
    veth: bool,
    /// Processes whose command line names the state directory.
    processes: Vec<String>,
    /// `iptables-save` without counters (`None` when iptables is not installed, as
    /// before the first `up` on a fresh machine: then there is nothing to compare).
    iptables: Option<String>,
    /// The sysctls the node's parts write, with their values.
    sysctls: Vec<(String, String)>,
}

impl HostSnapshot {
    /// Takes the snapshot for the cluster in `state_dir`.
    pub fn take(state_dir: &Path) -> Result<Self> {
        let state = StateDir::new(state_dir);
        let root = state.root().display().to_string();
        let id = cluster_id(&state);
        let mountinfo = fs::read_to_string("/proc/self/mountinfo").context("read mountinfo")?;
        let mounts = mountinfo
            .lines()
            .filter(|l| l.contains(&root))
            .map(str::to_owned)
            .collect();
        let cgroups = NodeCgroup::new(&id)?.existing();
        let veth = Command::new("ip")
            .args(["link", "show", &veth_name(&id)])
            .output()
            .is_ok_and(|o| o.status.success());
        let mut processes = Vec::new();
        for entry in fs::read_dir("/proc").context("read /proc")?.flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            if pid == std::process::id() {
                continue;
            }
            let cmdline = fs::read(entry.path().join("cmdline")).unwrap_or_default();
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            if cmdline.contains(&root) {
                processes.push(format!("{pid} {}", cmdline.trim()));
            }
        }
        let iptables = Command::new("iptables-save").output().ok().and_then(|o| {
            o.status.success().then(|| {
                String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .filter(|l| !l.starts_with('#'))
                    .map(|l| l.split(" [").next().unwrap_or(l).to_owned() + "\n")
                    .collect()
            })
        });
        let mut keys: Vec<String> = KUBELET_SYSCTLS.iter().map(|k| (*k).to_owned()).collect();
        keys.extend(
            [
                "net/ipv4/ip_forward",
                "net/ipv4/conf/all/route_localnet",
                "net/bridge/bridge-nf-call-iptables",
                "net/netfilter/nf_conntrack_max",
                "net/netfilter/nf_conntrack_tcp_timeout_established",
                "net/netfilter/nf_conntrack_tcp_timeout_close_wait",
            ]
            .map(str::to_owned),
        );
        let sysctls = keys
            .into_iter()
            .map(|key| {
                let value = fs::read_to_string(Path::new("/proc/sys").join(&key))
                    .map(|v| v.trim().to_owned())
                    .unwrap_or_else(|_| "(absent)".into());
                (key, value)
            })
            .collect();
        Ok(Self {
            mounts,
            cgroups,
            veth,
            processes,
            iptables,
            sysctls,
        })
    }

    /// What differs from `before`, one line each; empty when nothing does.
    pub fn changes_since(&self, before: &Self) -> Vec<String> {
        let mut out = Vec::new();
        let new = |now: &[String], then: &[String]| -> Vec<String> {
            now.iter().filter(|x| !then.contains(x)).cloned().collect()
        };
        for mount in new(&self.mounts, &before.mounts) {
            out.push(format!("mount left: {mount}"));
        }
        for cgroup in new(&self.cgroups, &before.cgroups) {
            out.push(format!("cgroup left: {cgroup}"));
        }
        if self.veth && !before.veth {
            out.push("the node's veth is still there".into());
        }
        for process in new(&self.processes, &before.processes) {
            out.push(format!("process left: {process}"));
        }
        if let (Some(now), Some(then)) = (&self.iptables, &before.iptables)
            && now != then
        {
            out.push(format!("iptables rules changed:\n{now}"));
        }
        for ((key, now), (_, then)) in self.sysctls.iter().zip(&before.sysctls) {
            if now != then {
                out.push(format!("sysctl {key} changed: {then} → {now}"));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_stable_per_directory_and_names_fit_the_kernel() {
        let a = cluster_id(&StateDir::new("/work/clusters/a"));
        assert_eq!(a, cluster_id(&StateDir::new("/work/clusters/a")));
        assert_ne!(a, cluster_id(&StateDir::new("/work/clusters/b")));
        assert_eq!(a.len(), 8);
        // IFNAMSIZ: 15 characters and the NUL.
        assert_eq!(veth_name(&a).len(), 15);
    }

    #[test]
    fn node_choice_parses_and_refuses_typos() {
        assert_eq!(NodeChoice::parse("kwok").unwrap(), NodeChoice::Kwok);
        assert_eq!(NodeChoice::parse("real").unwrap(), NodeChoice::Real);
        assert!(NodeChoice::parse("fake").is_err());
    }

    #[test]
    fn snapshot_differences_name_what_was_left() {
        let before = HostSnapshot {
            mounts: vec![],
            cgroups: vec![],
            veth: false,
            processes: vec![],
            iptables: Some("*filter\n".into()),
            sysctls: vec![("vm/overcommit_memory".into(), "0".into())],
        };
        assert!(before.changes_since(&before).is_empty());
        let after = HostSnapshot {
            cgroups: vec!["/sys/fs/cgroup/memory/capstan-1".into()],
            iptables: Some("*filter\n-A KUBE-FIREWALL\n".into()),
            sysctls: vec![("vm/overcommit_memory".into(), "1".into())],
            ..before.clone()
        };
        let changes = after.changes_since(&before);
        assert_eq!(changes.len(), 3, "{changes:?}");
        assert!(changes[0].contains("capstan-1"));
        assert!(changes[2].contains("0 → 1"));
    }
}
