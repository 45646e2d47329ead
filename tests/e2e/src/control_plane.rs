//! The local control plane itself, for tests that inject faults into it: restarting a
//! component (through `cargo xtask cluster restart`, which knows each component's
//! command line from the state directory), the API server's `/readyz`, and its audit log
//! of write requests, which says which process wrote what and when.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use serde::Deserialize;

use crate::operator::root;
use crate::wait_for;

/// The cluster of `KUBECONFIG`, as its state directory describes it.
#[derive(Debug, Clone)]
pub struct ControlPlane {
    state_dir: PathBuf,
    xtask: PathBuf,
}

impl ControlPlane {
    /// The cluster in `$CAPSTAN_CLUSTER_DIR` (set by `cargo xtask test`), controlled
    /// through the xtask binary `$CAPSTAN_XTASK` (else `target/debug/xtask`). Panics,
    /// saying how to run the tests, when either is missing: fault tests never skip.
    pub fn from_env() -> Self {
        let Some(state_dir) = std::env::var_os("CAPSTAN_CLUSTER_DIR").map(PathBuf::from) else {
            panic!(
                "no cluster state directory: CAPSTAN_CLUSTER_DIR is not set. Run the fault tests with `cargo xtask test`, or set it to the --state-dir of `cargo xtask cluster up`"
            );
        };
        assert!(
            state_dir.join(".capstan-cluster").is_file(),
            "CAPSTAN_CLUSTER_DIR={} is not a cluster's state directory",
            state_dir.display()
        );
        let xtask = std::env::var_os("CAPSTAN_XTASK")
            .map(PathBuf::from)
            .unwrap_or_else(|| root().join("target/debug/xtask"));
        assert!(
            xtask.exists(),
            "{} is missing: run `cargo xtask cluster up` once (it builds the xtask), or set CAPSTAN_XTASK",
            xtask.display()
        );
        ControlPlane { state_dir, xtask }
    }

    /// The state directory.
    pub fn state_dir(&self) -> &Path {
        &self.state_dir
    }

    /// Restarts `component` (e.g. `kube-apiserver`): SIGTERM, SIGKILL after 10 s, then
    /// the same command line again. Returns how long it took, once the component works
    /// again (kube-apiserver: `/readyz` is ok). Fails with xtask's output otherwise.
    pub async fn restart(&self, component: &str) -> Result<Duration> {
        let started = Instant::now();
        let output = tokio::process::Command::new(&self.xtask)
            .args(["cluster", "restart", component, "--state-dir"])
            .arg(&self.state_dir)
            .output()
            .await
            .with_context(|| format!("run {}", self.xtask.display()))?;
        if !output.status.success() {
            bail!(
                "restart of {component} failed ({}): {}",
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            );
        }
        Ok(started.elapsed())
    }

    /// Every event of the API server's audit log (one per write request: see the
    /// policy in `xtask/src/cluster/components.rs`), from the rotated file too, whose
    /// line contains `filter` (a cheap pre-filter, e.g. a namespace), in log order.
    pub fn audit_events(&self, filter: &str) -> Result<Vec<AuditEvent>> {
        let logs = self.state_dir.join("logs");
        let mut files: Vec<PathBuf> = std::fs::read_dir(&logs)
            .with_context(|| format!("read {}", logs.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("kube-apiserver-audit") && n.ends_with(".log"))
            })
            .collect();
        anyhow::ensure!(
            !files.is_empty(),
            "no audit log in {}: the cluster was started before audit logging existed; restart it with `cargo xtask cluster down` and `up`",
            logs.display()
        );
        // Rotated files carry a timestamp in their names and come before the live one.
        files.sort_by_key(|p| p.file_name().map(|n| n != "kube-apiserver-audit.log"));
        let mut events = Vec::new();
        for file in files {
            let text = std::fs::read_to_string(&file)
                .with_context(|| format!("read {}", file.display()))?;
            // A line being written right now may be incomplete: it is skipped.
            events.extend(
                text.lines()
                    .filter(|l| l.contains(filter))
                    .filter_map(|l| serde_json::from_str::<AuditEvent>(l).ok()),
            );
        }
        Ok(events)
    }
}

/// One audit event, at `Metadata` level: who, with which user agent, did what to which
/// object, when the API server received it, and its answer.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AuditEvent {
    /// `create`, `update`, `patch`, `delete`, …
    pub verb: String,
    /// The client's `User-Agent` header (capstan: `capstan/<version> (<identity>)`).
    #[serde(default)]
    pub user_agent: String,
    /// Who authenticated.
    #[serde(default)]
    pub user: AuditUser,
    /// Whom the request was made as, when it impersonated someone.
    #[serde(default)]
    pub impersonated_user: Option<AuditUser>,
    /// The object of the request.
    #[serde(default)]
    pub object_ref: AuditObjectRef,
    /// The answer; absent when the request never got one (a panic).
    pub response_status: Option<AuditResponse>,
    /// When the API server received the request, RFC 3339 with microseconds.
    pub request_received_timestamp: String,
}

/// The object an audited request is about.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AuditObjectRef {
    /// The resource's plural, e.g. `configmaps`, `leases`.
    #[serde(default)]
    pub resource: String,
    /// Its namespace, if namespaced.
    #[serde(default)]
    pub namespace: String,
    /// Its name (absent for a create by POST).
    #[serde(default)]
    pub name: String,
    /// `status` for a write to `/status`.
    #[serde(default)]
    pub subresource: String,
}

/// A user of an audited request.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct AuditUser {
    /// The user name, e.g. `system:serviceaccount:NS:NAME`.
    #[serde(default)]
    pub username: String,
}

/// The answer to an audited request.
#[derive(Debug, Clone, Deserialize)]
pub struct AuditResponse {
    /// The HTTP status code.
    #[serde(default)]
    pub code: u16,
}

impl AuditEvent {
    /// When the API server received the request.
    pub fn received(&self) -> Option<Timestamp> {
        self.request_received_timestamp.parse().ok()
    }

    /// The HTTP status code of the answer (0: none).
    pub fn code(&self) -> u16 {
        self.response_status.as_ref().map_or(0, |s| s.code)
    }

    /// Whether the request was made by the capstan replica `identity`.
    pub fn by_replica(&self, identity: &str) -> bool {
        self.user_agent.starts_with("capstan/")
            && self.user_agent.ends_with(&format!("({identity})"))
    }
}

/// Whether the API server says `/readyz` is ok.
pub async fn api_ready(client: &Client) -> bool {
    let request = http::Request::get("/readyz")
        .body(Vec::new())
        .expect("a GET request");
    client
        .request_text(request)
        .await
        .is_ok_and(|body| body.trim() == "ok")
}

/// Waits until `/readyz` is ok, for up to `timeout`.
pub async fn await_api_ready(client: &Client, timeout: Duration) -> Result<()> {
    wait_for("the API server's /readyz", timeout, || async {
        Ok(api_ready(client).await.then_some(()))
    })
    .await
}
