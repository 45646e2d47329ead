//! Helpers for tests whose containers run for real on the cluster's kubelet node:
//! `kubectl`, finding the real node, running SQL in a Pod, and waiting for Pods.
//!
//! These tests need `cargo xtask cluster up` with its real node (the default where the
//! machine allows it) and the images `cargo xtask image --import` puts on it. Without
//! them they fail, naming what is missing; they never skip.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Client;
use kube::api::{Api, ListParams};

use crate::wait_for;

/// The kubectl of the test cluster (`CAPSTAN_KUBECTL`, set by `cargo xtask test`).
pub fn kubectl_path() -> PathBuf {
    std::env::var_os("CAPSTAN_KUBECTL")
        .map(PathBuf::from)
        .expect("CAPSTAN_KUBECTL is not set: run the tests with `cargo xtask test`")
}

/// Runs kubectl with `args`; its stdout, or an error with its stderr.
pub fn kubectl(args: &[&str]) -> Result<String> {
    kubectl_with_input(args, None)
}

/// Runs kubectl with `args` and `input` on its stdin.
pub fn kubectl_with_input(args: &[&str], input: Option<&str>) -> Result<String> {
    use std::io::Write as _;
    use std::process::Stdio;
    let mut child = Command::new(kubectl_path())
        .args(args)
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("run kubectl")?;
    if let Some(input) = input {
        child
            .stdin
            .take()
            .context("kubectl's stdin")?
            .write_all(input.as_bytes())?;
    }
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "kubectl {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The name of the cluster's real (kubelet) node, once it is Ready: a node that kwok
/// does not simulate. Fails, saying how to get one, when the cluster has none.
pub async fn real_node(client: &Client) -> Result<String> {
    let nodes = Api::<Node>::all(client.clone());
    let list = nodes.list(&ListParams::default()).await?;
    let real: Vec<&Node> = list
        .items
        .iter()
        .filter(|n| {
            let annotated = n
                .metadata
                .annotations
                .as_ref()
                .is_some_and(|a| a.contains_key("kwok.x-k8s.io/node"));
            let labelled = n
                .metadata
                .labels
                .as_ref()
                .is_some_and(|l| l.get("type").map(String::as_str) == Some("kwok"));
            !annotated && !labelled
        })
        .collect();
    let Some(node) = real.first() else {
        bail!(
            "the cluster has no real node, only kwok's: this test runs containers for real. \
             Start the cluster with `cargo xtask cluster up` on a machine that allows a real \
             node (root, namespaces, cgroups; see docs/control-plane.md)"
        );
    };
    let name = node.metadata.name.clone().unwrap_or_default();
    wait_for(
        &format!("node {name} to be Ready"),
        Duration::from_secs(60),
        || {
            let (nodes, name) = (nodes.clone(), name.clone());
            async move {
                let node = nodes.get(&name).await?;
                let ready = node
                    .status
                    .and_then(|s| s.conditions)
                    .unwrap_or_default()
                    .iter()
                    .any(|c| c.type_ == "Ready" && c.status == "True");
                Ok(ready.then_some(()))
            }
        },
    )
    .await?;
    Ok(name)
}

/// Whether the node's container runtime has `image` (`postgres:16.15`): the kubelet
/// reports the images it has in the node's status.
pub async fn node_has_image(client: &Client, node: &str, image: &str) -> Result<bool> {
    let full = match image.split('/').count() {
        1 => format!("docker.io/library/{image}"),
        2 if !image.split('/').next().unwrap_or_default().contains('.') => {
            format!("docker.io/{image}")
        }
        _ => image.to_owned(),
    };
    let node = Api::<Node>::all(client.clone()).get(node).await?;
    let images = node.status.and_then(|s| s.images).unwrap_or_default();
    Ok(images
        .iter()
        .flat_map(|i| i.names.iter().flatten())
        .any(|n| *n == full || n == image))
}

/// Fails, naming the command that imports them, unless the node has every one of
/// `images`. The kubelet reports images every few seconds, so this waits a little.
pub async fn require_images(client: &Client, node: &str, images: &[&str]) -> Result<()> {
    wait_for(
        &format!("images {images:?} on node {node} (`cargo xtask image --import` puts them there; `cargo xtask test` runs it)"),
        Duration::from_secs(30),
        || async {
            for image in images {
                if !node_has_image(client, node, image).await? {
                    return Ok(None);
                }
            }
            Ok(Some(()))
        },
    )
    .await
}

/// Runs `command` in `container` of `pod`; its stdout, trimmed.
pub fn exec(ns: &str, pod: &str, container: &str, command: &[&str]) -> Result<String> {
    let mut args = vec!["exec", "-n", ns, pod, "-c", container, "--"];
    args.extend_from_slice(command);
    Ok(kubectl(&args)?.trim().to_owned())
}

/// Runs `sql` in `pod`'s container as the `postgres` superuser over the local socket,
/// unaligned and tuples only: `a|b` lines.
pub fn superuser_sql(ns: &str, pod: &str, container: &str, db: &str, sql: &str) -> Result<String> {
    exec(
        ns,
        pod,
        container,
        &[
            "psql",
            "-X",
            "-q",
            "-At",
            "-v",
            "ON_ERROR_STOP=1",
            "-U",
            "postgres",
            "-d",
            db,
            "-c",
            sql,
        ],
    )
}

/// Waits until the Pods matching `selector` in `ns` are exactly `names`, each Running
/// and Ready, and returns them.
pub async fn await_ready_pods(
    client: &Client,
    ns: &str,
    selector: &str,
    names: &[String],
    timeout: Duration,
) -> Result<Vec<Pod>> {
    let pods = Api::<Pod>::namespaced(client.clone(), ns);
    let mut want = names.to_vec();
    want.sort();
    wait_for(
        &format!("pods {want:?} ({selector}) to be Ready"),
        timeout,
        || {
            let (pods, want) = (pods.clone(), want.clone());
            async move {
                let list = pods.list(&ListParams::default().labels(selector)).await?;
                let mut seen: Vec<String> = list
                    .items
                    .iter()
                    .filter(|p| p.metadata.deletion_timestamp.is_none())
                    .filter(|p| is_ready(p))
                    .filter_map(|p| p.metadata.name.clone())
                    .collect();
                seen.sort();
                let all: usize = list.items.len();
                Ok((seen == want && all == want.len()).then_some(list.items))
            }
        },
    )
    .await
}

/// Whether `pod` is Running with its Ready condition true.
pub fn is_ready(pod: &Pod) -> bool {
    let status = pod.status.as_ref();
    status.and_then(|s| s.phase.as_deref()) == Some("Running")
        && status
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The image of `pod`'s first container.
pub fn image_of(pod: &Pod) -> String {
    pod.spec
        .as_ref()
        .and_then(|s| s.containers.first())
        .and_then(|c| c.image.clone())
        .unwrap_or_default()
}

/// The earlier tests' hosts ran outside the cluster and pointed the PostgreSQLCluster
/// CRD's conversion webhook at their URL; deploy/'s CRD names the Service instead, and
/// the API server refuses a webhook with both, so a `kubectl apply` or Helm install of
/// that CRD fails. What someone who moves from `capstan run` on a laptop to deploy/ or
/// the chart does too (docs/deploy.md).
pub fn point_postgresql_conversion_at_the_service() {
    let service = serde_json::json!({"spec": {"conversion": {"strategy": "Webhook", "webhook": {
        "conversionReviewVersions": ["v1"],
        "clientConfig": {"url": null, "caBundle": null, "service": {
            "namespace": "capstan-system", "name": "capstan-webhook", "port": 443,
            "path": "/convert/postgresqlclusters.db.example.com"}}}}}});
    let exists = kubectl(&[
        "get",
        "crd",
        "postgresqlclusters.db.example.com",
        "--ignore-not-found",
        "-o",
        "name",
    ])
    .unwrap_or_else(|e| panic!("{e}"));
    if !exists.trim().is_empty() {
        kubectl(&[
            "patch",
            "crd",
            "postgresqlclusters.db.example.com",
            "--type",
            "merge",
            "-p",
            &service.to_string(),
        ])
        .unwrap_or_else(|e| panic!("{e}"));
    }
}
