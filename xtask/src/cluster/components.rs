//! The command line of each control-plane component. Everything listens on 127.0.0.1
//! only, on the ports picked for this cluster.

use std::{path::Path, process::Command};

use super::{
    binaries::control_plane_dir,
    state::{Ports, StateDir},
};

/// The service CIDR; its first address is the `kubernetes` Service's ClusterIP.
pub const SERVICE_CIDR: &str = "10.96.0.0/16";
/// The `kubernetes` Service's ClusterIP, and so a SAN of the apiserver's certificate.
pub const KUBERNETES_SERVICE_IP: &str = "10.96.0.1";
/// Pod IPs that kwok hands out.
const POD_CIDR: &str = "10.244.0.0/16";

/// The API server's audit policy: every write request (who, which user agent, what,
/// when, the response code) at `Metadata` level, so that a test can tell which process
/// wrote what without the log growing with every read and watch; and the reads too in
/// the one namespace `capstan-audit-reads` (`capstan_e2e::AUDIT_READS_NAMESPACE`), for a test that proves who read what.
pub const AUDIT_POLICY: &str = "\
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
    verbs: [create, update, patch, delete, deletecollection]
  - level: Metadata
    verbs: [get, list, watch]
    namespaces: [capstan-audit-reads]
  - level: None
";

/// A single-member etcd with plain HTTP on loopback and no fsync: a test cluster loses
/// nothing worth keeping on a crash, and fsync dominates apiserver latency on small disks.
pub fn etcd(bin: &Path, state: &StateDir, ports: &Ports) -> Command {
    let client = format!("http://127.0.0.1:{}", ports.etcd_client);
    let peer = format!("http://127.0.0.1:{}", ports.etcd_peer);
    let mut cmd = Command::new(bin.join("etcd"));
    cmd.args([
        "--name=capstan".to_owned(),
        format!("--data-dir={}", state.etcd_data().display()),
        format!("--listen-client-urls={client}"),
        format!("--advertise-client-urls={client}"),
        format!("--listen-peer-urls={peer}"),
        format!("--initial-advertise-peer-urls={peer}"),
        format!("--initial-cluster=capstan={peer}"),
        "--initial-cluster-state=new".to_owned(),
        "--unsafe-no-fsync=true".to_owned(),
        "--log-level=warn".to_owned(),
    ]);
    cmd
}

/// kube-apiserver with client-certificate authentication, service-account tokens signed
/// by this cluster's key, real authorization (Node, RBAC), and an audit log of every
/// write ([`AUDIT_POLICY`]; the policy file is written by `up`).
///
/// With a real node at `node_ip`, the API server advertises that address (where the
/// relay listens, inside the node's network) as the `kubernetes` Service's endpoint, and
/// reaches the kubelet by it; without, it advertises 127.0.0.1 and keeps no endpoint.
pub fn apiserver(bin: &Path, state: &StateDir, ports: &Ports, node_ip: Option<&str>) -> Command {
    let pki = |file: &str| state.pki().join(file).display().to_string();
    let mut cmd = Command::new(bin.join("kube-apiserver"));
    match node_ip {
        Some(ip) => cmd.args([
            format!("--advertise-address={ip}"),
            "--kubelet-preferred-address-types=InternalIP,Hostname".to_owned(),
            format!("--kubelet-certificate-authority={}", pki("ca.crt")),
            format!(
                "--kubelet-client-certificate={}",
                pki("apiserver-kubelet-client.crt")
            ),
            format!(
                "--kubelet-client-key={}",
                pki("apiserver-kubelet-client.key")
            ),
        ]),
        // The `kubernetes` Service's endpoint would be 127.0.0.1, which Endpoints
        // validation rejects (loopback); and no pod here could dial it anyway.
        None => cmd.args([
            "--advertise-address=127.0.0.1",
            "--endpoint-reconciler-type=none",
        ]),
    };
    cmd.args([
        format!("--etcd-servers=http://127.0.0.1:{}", ports.etcd_client),
        "--bind-address=127.0.0.1".to_owned(),
        format!("--secure-port={}", ports.apiserver),
        format!("--tls-cert-file={}", pki("apiserver.crt")),
        format!("--tls-private-key-file={}", pki("apiserver.key")),
        format!("--client-ca-file={}", pki("ca.crt")),
        format!("--service-account-key-file={}", pki("sa.pub")),
        format!("--service-account-signing-key-file={}", pki("sa.key")),
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local".to_owned(),
        format!("--service-cluster-ip-range={SERVICE_CIDR}"),
        // Webhooks served by a Pod are called at the Service's endpoints (Pod IPs, which
        // the host routes to the real node) instead of its ClusterIP (which only the
        // node's kube-proxy knows).
        "--enable-aggregator-routing=true".to_owned(),
        // The aggregation layer's front proxy, set up as kubeadm does; without it the
        // controller-manager and scheduler complain forever of a missing requestheader CA.
        format!(
            "--requestheader-client-ca-file={}",
            pki("front-proxy-ca.crt")
        ),
        "--requestheader-allowed-names=front-proxy-client".to_owned(),
        "--requestheader-username-headers=X-Remote-User".to_owned(),
        "--requestheader-group-headers=X-Remote-Group".to_owned(),
        "--requestheader-extra-headers-prefix=X-Remote-Extra-".to_owned(),
        format!("--proxy-client-cert-file={}", pki("front-proxy-client.crt")),
        format!("--proxy-client-key-file={}", pki("front-proxy-client.key")),
        "--authorization-mode=Node,RBAC".to_owned(),
        // PodNodeSelector and PodTolerationRestriction: a namespace's annotations choose
        // kwok's nodes (or the real one) for all its Pods.
        "--enable-admission-plugins=NodeRestriction,PodNodeSelector,PodTolerationRestriction"
            .to_owned(),
        "--allow-privileged=true".to_owned(),
        "--profiling=false".to_owned(),
        // Server-side sharded LIST/WATCH (KEP-5866, alpha since 1.36) for `capstan run
        // --shards`: a `shardSelector` is honoured and echoed in `ListMeta.shardInfo`.
        "--feature-gates=ShardedListAndWatch=true".to_owned(),
        format!("--audit-policy-file={}", state.audit_policy().display()),
        format!("--audit-log-path={}", state.audit_log().display()),
        "--audit-log-format=json".to_owned(),
        // Written before the response is sent: once a client has its answer, the event
        // of its request is in the file.
        "--audit-log-mode=blocking".to_owned(),
        "--audit-log-maxsize=256".to_owned(),
        "--audit-log-maxbackup=1".to_owned(),
    ]);
    cmd
}

/// kube-controller-manager with every default controller (garbage collector, namespace,
/// service accounts and their tokens, Deployment/ReplicaSet, StatefulSet, Job/CronJob,
/// endpoints and EndpointSlices, the PersistentVolume binder, …), each with its own
/// service-account credentials so that RBAC applies to controllers too.
pub fn controller_manager(bin: &Path, state: &StateDir, ports: &Ports) -> Command {
    let pki = |file: &str| state.pki().join(file).display().to_string();
    let kubeconfig = pki("kube-controller-manager.kubeconfig");
    let mut cmd = Command::new(bin.join("kube-controller-manager"));
    cmd.args([
        format!("--kubeconfig={kubeconfig}"),
        format!("--authentication-kubeconfig={kubeconfig}"),
        format!("--authorization-kubeconfig={kubeconfig}"),
        "--bind-address=127.0.0.1".to_owned(),
        format!("--secure-port={}", ports.controller_manager),
        "--controllers=*".to_owned(),
        "--use-service-account-credentials=true".to_owned(),
        format!("--service-account-private-key-file={}", pki("sa.key")),
        format!("--root-ca-file={}", pki("ca.crt")),
        format!("--cluster-signing-cert-file={}", pki("ca.crt")),
        format!("--cluster-signing-key-file={}", pki("ca.key")),
        format!("--service-cluster-ip-range={SERVICE_CIDR}"),
        "--cluster-name=capstan".to_owned(),
        // One instance per cluster: leader election would only delay the start.
        "--leader-elect=false".to_owned(),
    ]);
    cmd
}

/// kube-scheduler with its default profile.
pub fn scheduler(bin: &Path, state: &StateDir, ports: &Ports) -> Command {
    let kubeconfig = state
        .pki()
        .join("kube-scheduler.kubeconfig")
        .display()
        .to_string();
    let mut cmd = Command::new(bin.join("kube-scheduler"));
    cmd.args([
        format!("--kubeconfig={kubeconfig}"),
        format!("--authentication-kubeconfig={kubeconfig}"),
        format!("--authorization-kubeconfig={kubeconfig}"),
        "--bind-address=127.0.0.1".to_owned(),
        format!("--secure-port={}", ports.scheduler),
        "--leader-elect=false".to_owned(),
    ]);
    cmd
}

/// kwok, playing the kubelet of every Node annotated `kwok.x-k8s.io/node: fake`, with the
/// stages kwokctl uses by default (`tests/control-plane/kwok/stages.yaml`) plus one that
/// recycles released static volumes (`tests/control-plane/kwok/volume-recycle.yaml`).
pub fn kwok(bin: &Path, state: &StateDir, ports: &Ports) -> Command {
    let config = |file: &str| {
        control_plane_dir()
            .join("kwok")
            .join(file)
            .display()
            .to_string()
    };
    let mut cmd = Command::new(bin.join("kwok"));
    cmd.args([
        format!(
            "--kubeconfig={}",
            state.pki().join("kwok.kubeconfig").display()
        ),
        format!("--config={}", config("stages.yaml")),
        format!("--config={}", config("volume-recycle.yaml")),
        "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake".to_owned(),
        format!("--server-address=127.0.0.1:{}", ports.kwok),
        format!("--cidr={POD_CIDR}"),
        "--node-lease-duration-seconds=40".to_owned(),
    ]);
    cmd
}

/// `capstan-pki`: the CAs, serving certificate, service-account keys, and a client
/// certificate plus kubeconfig per component (a one-shot command, not a process to keep).
///
/// With a real node (`node`: its name, IP and the API server's URL as it reaches it), also
/// the node's credentials.
pub fn pki(
    bin: &Path,
    state: &StateDir,
    ports: &Ports,
    node: Option<(&str, &str, &str)>,
) -> Command {
    let mut cmd = Command::new(bin.join("capstan-pki"));
    cmd.args([
        format!("-dir={}", state.pki().display()),
        format!("-server=https://127.0.0.1:{}", ports.apiserver),
        "-cluster-name=capstan".to_owned(),
        format!("-service-ip={KUBERNETES_SERVICE_IP}"),
    ]);
    if let Some((name, ip, server)) = node {
        cmd.args([
            format!("-node-name={name}"),
            format!("-node-ip={ip}"),
            format!("-node-server={server}"),
        ]);
    }
    cmd
}
