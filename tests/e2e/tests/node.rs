//! The real node of `cargo xtask cluster up` (`capstan-node`): Pods run there for real.
//!
//! One Pod serves HTTP behind a Service, another runs the probe image's commands through
//! `kubectl exec`: its memory limit is its cgroup's, its ServiceAccount token reaches the
//! API server through `https://kubernetes.default.svc`, CoreDNS resolves the Service's
//! name and the Service routes to the server, and its PersistentVolumeClaim is bound by
//! the provisioner to a directory it can write.
//!
//! It needs a cluster with a real node (`cargo xtask test` starts one where the machine
//! allows it) and fails, never skips, without one.

use std::{path::PathBuf, process::Command, time::Duration};

use anyhow::{Context, Result, bail, ensure};
use capstan_e2e::{client, in_test_namespace, wait_for};
use k8s_openapi::api::core::v1::{Node, PersistentVolume, PersistentVolumeClaim, Pod, Service};
use kube::api::{Api, PostParams};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

/// The real node's name (`xtask/src/cluster/node.rs`).
const NODE: &str = "capstan-node";
/// The test image `cluster up` imports into the real node: one static program, `/probe`.
const PROBE: &str = "capstan.dev/probe:v1";
const CONVERGE: Duration = Duration::from_secs(90);
const CLEANUP: Duration = Duration::from_secs(90);
/// How long a ready Pod may take to be reachable through its Service's ClusterIP.
const ROUTE: Duration = Duration::from_secs(30);
/// The client Pod's memory limit.
const MEMORY_LIMIT: u64 = 48 * 1024 * 1024;

fn kubectl(args: &[&str]) -> Result<String> {
    let bin = std::env::var_os("CAPSTAN_KUBECTL")
        .map(PathBuf::from)
        .context("CAPSTAN_KUBECTL is not set: run the tests with `cargo xtask test`")?;
    let out = Command::new(&bin)
        .args(args)
        .output()
        .context("run kubectl")?;
    if !out.status.success() {
        bail!(
            "kubectl {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn from_json<T: DeserializeOwned>(value: Value) -> Result<T> {
    serde_json::from_value(value).context("build the object")
}

#[tokio::test]
async fn pods_run_for_real_on_the_real_node() -> Result<()> {
    let nodes: Api<Node> = Api::all(client().await);
    let Some(node) = nodes.get_opt(NODE).await? else {
        bail!(
            "the cluster has no real node `{NODE}`: `cargo xtask cluster up` starts one where \
             the machine allows it (root, namespaces, writable cgroups) and says why not"
        );
    };
    let labels = node.metadata.labels.unwrap_or_default();
    ensure!(
        labels.get("type").map(String::as_str) == Some("real"),
        "node {NODE} has labels {labels:?}"
    );

    in_test_namespace("node", CLEANUP, async |client, ns| {
        let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
        let services: Api<Service> = Api::namespaced(client.clone(), &ns);
        let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), &ns);
        let pp = PostParams::default();

        services.create(&pp, &from_json(service())?).await?;
        claims.create(&pp, &from_json(claim())?).await?;
        pods.create(&pp, &from_json(server_pod())?).await?;
        pods.create(&pp, &from_json(client_pod())?).await?;
        for name in ["server", "client"] {
            wait_for(
                &format!("pod {name} running and ready"),
                CONVERGE,
                || async {
                    let pod = pods.get(name).await?;
                    let status = pod.status.unwrap_or_default();
                    let ready = status
                        .conditions
                        .unwrap_or_default()
                        .iter()
                        .any(|c| c.type_ == "Ready" && c.status == "True");
                    Ok((status.phase.as_deref() == Some("Running") && ready).then_some(()))
                },
            )
            .await?;
            let pod = pods.get(name).await?;
            let on = pod.spec.and_then(|s| s.node_name).unwrap_or_default();
            ensure!(on == NODE, "pod {name} runs on {on:?}, not {NODE}");
        }
        let exec = |args: &[&str]| {
            let mut all = vec!["exec", "-n", &ns, "client", "--", "/probe"];
            all.extend_from_slice(args);
            kubectl(&all)
        };

        // A real process: the server's own log line, and an exec answered by the client.
        let log = kubectl(&["logs", "-n", &ns, "server"])?;
        ensure!(log.contains("serving on :8080"), "server log: {log:?}");

        // The memory limit is the container's cgroup's (v1, else v2).
        let limit = exec(&["cat", "/sys/fs/cgroup/memory/memory.limit_in_bytes"])
            .or_else(|_| exec(&["cat", "/sys/fs/cgroup/memory.max"]))?;
        ensure!(
            limit.trim() == MEMORY_LIMIT.to_string(),
            "the client's cgroup memory limit is {limit:?}, not {MEMORY_LIMIT}"
        );

        // The ServiceAccount token, through the `kubernetes` Service, authenticates.
        let review = exec(&["whoami"])?;
        let user = format!("system:serviceaccount:{ns}:default");
        ensure!(review.contains(&user), "SelfSubjectReview: {review}");

        // CoreDNS resolves the Service (by its short name, through the search path, and
        // by its full one) to its ClusterIP, and the Service routes to the server.
        let cluster_ip = services
            .get("web")
            .await?
            .spec
            .and_then(|s| s.cluster_ip)
            .context("Service web has no ClusterIP")?;
        for name in ["web".to_owned(), format!("web.{ns}.svc.cluster.local")] {
            let resolved = exec(&["resolve", &name])?;
            ensure!(
                resolved.lines().any(|l| l.trim() == cluster_ip),
                "{name} resolved to {resolved:?}, not {cluster_ip}"
            );
        }
        // The server is Ready, but the EndpointSlice controller and then kube-proxy each
        // take their turn before the ClusterIP routes to it (until then kube-proxy rejects:
        // "connection refused"), as for any client of a new Service: it retries.
        let answer = wait_for("GET http://web/ through the Service", ROUTE, || async {
            exec(&["get", "http://web/"]).map(Some)
        })
        .await?;
        ensure!(
            answer.trim() == "probe server",
            "GET http://web/: {answer:?}"
        );

        // The claim is bound by the provisioner to a local volume on this node, and what
        // the Pod writes lands in the volume's directory.
        exec(&["write", "/data/hello", "written in a pod"])?;
        ensure!(exec(&["cat", "/data/hello"])? == "written in a pod");
        let claim = claims.get("data").await?;
        ensure!(
            claim.status.and_then(|s| s.phase).as_deref() == Some("Bound"),
            "claim data is not Bound"
        );
        let volume = claim.spec.and_then(|s| s.volume_name).unwrap_or_default();
        let pv = Api::<PersistentVolume>::all(client.clone())
            .get(&volume)
            .await?;
        let path = pv
            .spec
            .and_then(|s| s.local)
            .map(|l| l.path)
            .with_context(|| format!("volume {volume} is not a local volume"))?;
        let on_host = std::fs::read_to_string(PathBuf::from(&path).join("hello"))
            .with_context(|| format!("read {path}/hello on the host"))?;
        ensure!(on_host == "written in a pod", "{path}/hello: {on_host:?}");
        Ok(())
    })
    .await
}

fn server_pod() -> Value {
    json!({
        "metadata": {"name": "server", "labels": {"app": "web"}},
        "spec": {
            "containers": [{
                "name": "probe",
                "image": PROBE,
                "imagePullPolicy": "Never",
                "args": ["serve", ":8080"],
                "ports": [{"containerPort": 8080}],
                "readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1},
                "resources": {"limits": {"memory": "32Mi", "cpu": "100m"}},
            }],
        },
    })
}

fn client_pod() -> Value {
    json!({
        "metadata": {"name": "client"},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "containers": [{
                "name": "probe",
                "image": PROBE,
                "imagePullPolicy": "Never",
                "args": ["sleep"],
                "resources": {"limits": {"memory": MEMORY_LIMIT.to_string(), "cpu": "100m"}},
                "volumeMounts": [{"name": "data", "mountPath": "/data"}],
            }],
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}],
        },
    })
}

fn service() -> Value {
    json!({
        "metadata": {"name": "web"},
        "spec": {
            "selector": {"app": "web"},
            "ports": [{"port": 80, "targetPort": 8080}],
        },
    })
}

/// No storageClassName: the default class, the real node's provisioner's.
fn claim() -> Value {
    json!({
        "metadata": {"name": "data"},
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": "1Gi"}},
        },
    })
}
