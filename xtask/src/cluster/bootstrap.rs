//! What a fresh control plane gets before it is handed out: fake Nodes for kwok, a
//! default StorageClass with a pool of static PersistentVolumes, and the readiness
//! checks, all through the kubectl built alongside the control plane.

use std::{
    fmt::Write as _,
    io::{Read as _, Write as _},
    net::TcpStream,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use anyhow::{Context, Result, bail};

use super::state::StateDir;

/// How many static volumes the pool has, and how big each is.
pub const VOLUMES: usize = 64;
const VOLUME_SIZE: &str = "10Gi";
/// The default StorageClass's name.
pub const STORAGE_CLASS: &str = "local";

/// The name of the `index`th fake node.
pub fn node_name(index: usize) -> String {
    format!("kwok-node-{index}")
}

/// kubectl (the one built with the control plane) against one cluster as its admin.
pub struct Kubectl {
    program: PathBuf,
    kubeconfig: PathBuf,
}

impl Kubectl {
    /// kubectl from `bin` with `kubeconfig`.
    pub fn new(bin: &Path, kubeconfig: &Path) -> Self {
        Self {
            program: bin.join("kubectl"),
            kubeconfig: kubeconfig.to_owned(),
        }
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(&self.program);
        cmd.arg(format!("--kubeconfig={}", self.kubeconfig.display()))
            .arg("--request-timeout=5s")
            .args(args)
            .stdin(Stdio::null());
        cmd
    }

    /// Runs kubectl and returns its stdout; a failure carries its stderr.
    pub fn run(&self, args: &[&str]) -> Result<String> {
        let output = self
            .command(args)
            .output()
            .with_context(|| format!("run {}", self.program.display()))?;
        if !output.status.success() {
            bail!(
                "`kubectl {}` failed: {}",
                args.join(" "),
                String::from_utf8_lossy(&output.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    }

    /// `kubectl create -f -` with `manifest` on stdin. (Not a server-side apply: that
    /// would drop a Node's `status`, which carries its capacity.)
    pub fn create(&self, manifest: &str) -> Result<()> {
        let mut child = self
            .command(&["create", "-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("run {}", self.program.display()))?;
        child
            .stdin
            .take()
            .context("kubectl stdin")?
            .write_all(manifest.as_bytes())?;
        let output = child.wait_with_output()?;
        if !output.status.success() {
            bail!(
                "`kubectl create` failed: {}",
                String::from_utf8_lossy(&output.stderr).trim()
            );
        }
        Ok(())
    }

    /// Whether the apiserver's `/readyz` says ok.
    pub fn apiserver_ready(&self) -> bool {
        self.run(&["get", "--raw=/readyz"])
            .is_ok_and(|body| body.trim() == "ok")
    }

    /// Whether every node in `names` has condition Ready=True.
    pub fn nodes_ready(&self, names: &[String]) -> bool {
        names.iter().all(|name| {
            let jsonpath = "-o=jsonpath={.status.conditions[?(@.type==\"Ready\")].status}";
            self.run(&["get", "node", name, jsonpath])
                .is_ok_and(|s| s.trim() == "True")
        })
    }

    /// Whether the ServiceAccount `name` exists in `namespace` (the controller-manager
    /// makes `default` in every namespace: the sign that it works).
    pub fn service_account_exists(&self, namespace: &str, name: &str) -> bool {
        self.run(&["get", "serviceaccount", name, "-n", namespace, "-o=name"])
            .is_ok()
    }
}

/// Whether etcd answers `/health` healthy on its plain-HTTP loopback client port.
pub fn etcd_healthy(port: u16) -> bool {
    let probe = || -> std::io::Result<String> {
        let addr = ([127, 0, 0, 1], port).into();
        let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(1))?;
        stream.set_read_timeout(Some(Duration::from_secs(2)))?;
        stream.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
        let mut response = String::new();
        stream.read_to_string(&mut response)?;
        Ok(response)
    };
    probe().is_ok_and(|r| r.contains("\"health\":\"true\""))
}

/// Whether something accepts connections on 127.0.0.1:`port`.
pub fn listening(port: u16) -> bool {
    TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_secs(1)).is_ok()
}

/// The objects every cluster starts with: `nodes` fake Nodes of a realistic size that
/// kwok adopts (annotation `kwok.x-k8s.io/node: fake`, label `type: kwok`), the
/// StorageClass `local` and [`VOLUMES`] static PersistentVolumes it binds claims to.
///
/// With a real node (`real_node`), kwok's nodes carry the taint
/// `kwok.x-k8s.io/node=fake:NoSchedule`, so that a Pod lands on them only if its
/// namespace chooses kwok (`docs/control-plane.md`), and `local` is not the default
/// class (the real node's provisioner has that).
pub fn seed_manifest(nodes: usize, state: &StateDir, real_node: bool) -> String {
    let mut out = String::new();
    for index in 0..nodes {
        out.push_str(&node(&node_name(index), real_node));
    }
    let _ = write!(
        out,
        "---
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata:
  name: {STORAGE_CLASS}
  annotations:
    storageclass.kubernetes.io/is-default-class: \"{default}\"
provisioner: kubernetes.io/no-provisioner
# Claims bind as soon as they are made: the pool's volumes fit any node.
volumeBindingMode: Immediate
reclaimPolicy: Retain
",
        default = !real_node
    );
    for index in 0..VOLUMES {
        let path = state.volumes().join(format!("pv-{index:02}"));
        let _ = write!(
            out,
            "---
apiVersion: v1
kind: PersistentVolume
metadata:
  name: capstan-pv-{index:02}
  labels:
    capstan.dev/volume-pool: static
spec:
  storageClassName: {STORAGE_CLASS}
  capacity:
    storage: {VOLUME_SIZE}
  accessModes: [ReadWriteOnce, ReadOnlyMany, ReadWriteMany]
  persistentVolumeReclaimPolicy: Retain
  hostPath:
    path: {path}
    type: DirectoryOrCreate
",
            path = path.display()
        );
    }
    out
}

/// A Node whose status (capacity, nodeInfo) kwok keeps and reports Ready.
fn node(name: &str, tainted: bool) -> String {
    let taints = match tainted {
        true => {
            "spec:\n  taints:\n  - {key: kwok.x-k8s.io/node, value: fake, effect: NoSchedule}\n"
        }
        false => "",
    };
    format!(
        "---
apiVersion: v1
kind: Node
metadata:
  name: {name}
  annotations:
    kwok.x-k8s.io/node: fake
    node.alpha.kubernetes.io/ttl: \"0\"
  labels:
    type: kwok
    kubernetes.io/arch: amd64
    kubernetes.io/os: linux
    kubernetes.io/hostname: {name}
    node-role.kubernetes.io/agent: \"\"
{taints}status:
  capacity:
    cpu: \"32\"
    memory: 256Gi
    pods: \"110\"
    ephemeral-storage: 1Ti
  allocatable:
    cpu: \"32\"
    memory: 256Gi
    pods: \"110\"
    ephemeral-storage: 1Ti
  nodeInfo:
    architecture: amd64
    operatingSystem: linux
    osImage: kwok
"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_has_nodes_class_and_pool() {
        let manifest = seed_manifest(2, &StateDir::new("/tmp/state"), false);
        assert_eq!(manifest.matches("kind: Node\n").count(), 2);
        assert_eq!(manifest.matches("kind: StorageClass\n").count(), 1);
        assert_eq!(
            manifest.matches("kind: PersistentVolume\n").count(),
            VOLUMES
        );
        assert!(manifest.contains("path: /tmp/state/volumes/pv-63"));
        assert!(manifest.contains("is-default-class: \"true\""));
        assert!(!manifest.contains("taints"));
    }

    #[test]
    fn kwok_nodes_are_tainted_beside_a_real_node() {
        let manifest = seed_manifest(2, &StateDir::new("/tmp/state"), true);
        assert_eq!(manifest.matches("effect: NoSchedule").count(), 2);
        assert!(manifest.contains("is-default-class: \"false\""));
    }
}
