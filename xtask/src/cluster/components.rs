//! The command line of each control-plane component. Everything listens on 127.0.0.1
//! only, on the ports picked for this cluster.

use std::{path::Path, process::Command};

use super::{
    binaries::control_plane_dir,
    state::{Ports, StateDir},
};

/// The first address of the service CIDR: the `kubernetes` Service's ClusterIP, and so a
/// SAN of the apiserver's serving certificate.
pub const SERVICE_CIDR: &str = "10.96.0.0/16";
/// See [`SERVICE_CIDR`].
pub const KUBERNETES_SERVICE_IP: &str = "10.96.0.1";
/// Pod IPs that kwok hands out.
const POD_CIDR: &str = "10.244.0.0/16";

/// A single-member etcd with plain HTTP on loopback, no fsync (a test cluster loses
/// nothing worth keeping on a crash, and fsync dominates apiserver latency on small disks).
pub fn etcd(bin: &Path, state: &StateDir, ports: &Ports) -> Command {
    let client = format!("http://127.0.0.1:{}", ports.etcd_client);
    let peer = format!("http://127.0.0.1:{}", ports.etcd_peer);
    let mut cmd = Command::new(bin.join("etcd"));
    cmd.arg("--name=capstan")
        .arg(format!("--data-dir={}", state.etcd_data().display()))
        .arg(format!("--listen-client-urls={client}"))
        .arg(format!("--advertise-client-urls={client}"))
        .arg(format!("--listen-peer-urls={peer}"))
        .arg(format!("--initial-advertise-peer-urls={peer}"))
        .arg(format!("--initial-cluster=capstan={peer}"))
        .arg("--initial-cluster-state=new")
        .arg("--unsafe-no-fsync=true")
        .arg("--log-level=warn");
    cmd
}

/// kube-apiserver with client-certificate authentication, service-account tokens signed by
/// this cluster's key, and real authorization (Node, RBAC).
pub fn apiserver(bin: &Path, state: &StateDir, ports: &Ports) -> Command {
    let pki = state.pki();
    let pki = |file: &str| pki.join(file).display().to_string();
    let mut cmd = Command::new(bin.join("kube-apiserver"));
    cmd.arg(format!(
        "--etcd-servers=http://127.0.0.1:{}",
        ports.etcd_client
    ))
    .arg("--bind-address=127.0.0.1")
    .arg("--advertise-address=127.0.0.1")
    .arg(format!("--secure-port={}", ports.apiserver))
    .arg(format!("--tls-cert-file={}", pki("apiserver.crt")))
    .arg(format!("--tls-private-key-file={}", pki("apiserver.key")))
    .arg(format!("--client-ca-file={}", pki("ca.crt")))
    .arg(format!("--service-account-key-file={}", pki("sa.pub")))
    .arg(format!(
        "--service-account-signing-key-file={}",
        pki("sa.key")
    ))
    .arg("--service-account-issuer=https://kubernetes.default.svc.cluster.local")
    .arg(format!("--service-cluster-ip-range={SERVICE_CIDR}"))
    .arg("--authorization-mode=Node,RBAC")
    .arg("--enable-admission-plugins=NodeRestriction")
    .arg("--allow-privileged=true")
    // The `kubernetes` Service's endpoints would be 127.0.0.1, which Endpoints
    // validation rejects (loopback); no pod here could dial the apiserver anyway.
    .arg("--endpoint-reconciler-type=none")
    .arg("--profiling=false");
    cmd
}

/// kube-controller-manager with every default controller (garbage collector, namespace,
/// service accounts and their tokens, Deployment/ReplicaSet, StatefulSet, Job/CronJob,
/// endpoints and EndpointSlices, the PersistentVolume binder, …), each with its own
/// service-account credentials so that RBAC applies to controllers too.
pub fn controller_manager(bin: &Path, state: &StateDir, ports: &Ports) -> Command {
    let kubeconfig = state
        .component_kubeconfig("kube-controller-manager")
        .display()
        .to_string();
    let pki = state.pki();
    let pki = |file: &str| pki.join(file).display().to_string();
    let mut cmd = Command::new(bin.join("kube-controller-manager"));
    cmd.arg(format!("--kubeconfig={kubeconfig}"))
        .arg(format!("--authentication-kubeconfig={kubeconfig}"))
        .arg(format!("--authorization-kubeconfig={kubeconfig}"))
        .arg("--bind-address=127.0.0.1")
        .arg(format!("--secure-port={}", ports.controller_manager))
        .arg("--controllers=*")
        .arg("--use-service-account-credentials=true")
        .arg(format!(
            "--service-account-private-key-file={}",
            pki("sa.key")
        ))
        .arg(format!("--root-ca-file={}", pki("ca.crt")))
        .arg(format!("--cluster-signing-cert-file={}", pki("ca.crt")))
        .arg(format!("--cluster-signing-key-file={}", pki("ca.key")))
        .arg(format!("--service-cluster-ip-range={SERVICE_CIDR}"))
        .arg("--cluster-name=capstan")
        // One instance per cluster: leader election would only delay the start.
        .arg("--leader-elect=false");
    cmd
}

/// kube-scheduler with its default profile.
pub fn scheduler(bin: &Path, state: &StateDir, ports: &Ports) -> Command {
    let kubeconfig = state
        .component_kubeconfig("kube-scheduler")
        .display()
        .to_string();
    let mut cmd = Command::new(bin.join("kube-scheduler"));
    cmd.arg(format!("--kubeconfig={kubeconfig}"))
        .arg(format!("--authentication-kubeconfig={kubeconfig}"))
        .arg(format!("--authorization-kubeconfig={kubeconfig}"))
        .arg("--bind-address=127.0.0.1")
        .arg(format!("--secure-port={}", ports.scheduler))
        .arg("--leader-elect=false");
    cmd
}

/// kwok, playing the kubelet of every Node annotated `kwok.x-k8s.io/node: fake`, with the
/// stages kwokctl uses by default (`tests/control-plane/kwok/stages.yaml`) plus one that
/// recycles released static volumes (`tests/control-plane/kwok/volume-recycle.yaml`).
pub fn kwok(bin: &Path, state: &StateDir, ports: &Ports) -> Command {
    let stages = control_plane_dir().join("kwok");
    let mut cmd = Command::new(bin.join("kwok"));
    cmd.arg(format!(
        "--kubeconfig={}",
        state.component_kubeconfig("kwok").display()
    ))
    .arg(format!("--config={}", stages.join("stages.yaml").display()))
    .arg(format!(
        "--config={}",
        stages.join("volume-recycle.yaml").display()
    ))
    .arg("--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake")
    .arg(format!("--server-address=127.0.0.1:{}", ports.kwok))
    .arg(format!("--cidr={POD_CIDR}"))
    .arg("--node-lease-duration-seconds=40");
    cmd
}

/// `capstan-pki`: the CA, serving certificate, service-account keys, and a client
/// certificate plus kubeconfig per component (a one-shot command, not a process to keep).
pub fn pki(bin: &Path, state: &StateDir, ports: &Ports) -> Command {
    let mut cmd = Command::new(bin.join("capstan-pki"));
    cmd.arg(format!("-dir={}", state.pki().display()))
        .arg(format!("-server=https://127.0.0.1:{}", ports.apiserver))
        .arg("-cluster-name=capstan")
        .arg(format!("-service-ip={KUBERNETES_SERVICE_IP}"));
    cmd
}
