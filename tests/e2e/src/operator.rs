//! The `capstan run` process under test: started with a plugin directory of its own,
//! restricted to the test's namespace, killed by PID when dropped (also on failure).

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::Value;

use crate::wait_for;

/// The workspace root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn built(env: &str, default: &str, file: &str) -> PathBuf {
    let dir = std::env::var_os(env)
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join(default));
    let path = dir.join(file);
    assert!(
        path.exists(),
        "{} is missing: build the plugins with `cargo xtask plugins` (or run every test with `cargo xtask test`)",
        path.display()
    );
    path
}

/// A shipped plugin, e.g. `plugin("uuid")`.
pub fn plugin(name: &str) -> PathBuf {
    built(
        "CAPSTAN_PLUGIN_DIR",
        "target/plugins",
        &format!("{name}.wasm"),
    )
}

/// The `capstan` binary the tests run (`$CAPSTAN_BIN`, else target/debug/capstan).
pub fn capstan_bin() -> PathBuf {
    let bin = std::env::var_os("CAPSTAN_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target/debug/capstan"));
    assert!(
        bin.exists(),
        "{} is missing: run the tests with `cargo xtask test`",
        bin.display()
    );
    bin
}

/// A test plugin, e.g. `test_plugin("widget")`.
pub fn test_plugin(name: &str) -> PathBuf {
    built(
        "CAPSTAN_TEST_PLUGIN_DIR",
        "target/test-plugins",
        &format!("{name}.wasm"),
    )
}

/// The same Uuid plugin built by `cargo component build`: other bytes, same behaviour,
/// so it stands in for "a new version" in hot-reload tests.
pub fn uuid_other_build() -> PathBuf {
    std::env::var_os("CAPSTAN_COMPONENT_PLUGIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target/wasm32-wasip1/release/capstan_plugin_uuid.wasm"))
}

/// A loopback port nobody listens on now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A running `capstan run`.
pub struct Operator {
    child: Option<Child>,
    /// The plugin directory it serves.
    pub plugins: tempfile::TempDir,
    namespace: String,
    port: u16,
    extra: Vec<String>,
    log: PathBuf,
    /// `--kubeconfig` to pass; none: `KUBECONFIG` (the admin) and `--install-crds`.
    kubeconfig: Option<PathBuf>,
    /// `POD_NAME`, the replica's identity; none: capstan's default (host and PID).
    identity: Option<String>,
}

impl Operator {
    /// Starts `capstan run` on a fresh plugin directory holding `plugins` (copied in
    /// under their file names), watching only `namespace`.
    pub async fn start(namespace: &str, plugins: &[&Path], extra: &[&str]) -> Operator {
        Self::start_with(namespace, plugins, extra, None, None).await
    }

    /// Like [`Operator::start`], as the replica `identity` (its `POD_NAME`): that names
    /// it in the leader Lease and in its user agent, `capstan/<version> (<identity>)`,
    /// hence in the API server's audit log. It logs to a file of its own.
    pub async fn start_replica(
        identity: &str,
        namespace: &str,
        plugins: &[&Path],
        extra: &[&str],
    ) -> Operator {
        Self::start_with(namespace, plugins, extra, None, Some(identity.into())).await
    }

    /// Like [`Operator::start`], but as the identity of `kubeconfig`, and without
    /// `--install-crds` (the CRDs must be installed already).
    pub async fn start_as(kubeconfig: &Path, namespace: &str, plugins: &[&Path]) -> Operator {
        Self::start_with(
            namespace,
            plugins,
            &[],
            Some(kubeconfig.to_path_buf()),
            None,
        )
        .await
    }

    /// Like [`Operator::start_as`], with more arguments.
    pub async fn start_as_with(
        kubeconfig: &Path,
        namespace: &str,
        plugins: &[&Path],
        extra: &[&str],
    ) -> Operator {
        Self::start_with(
            namespace,
            plugins,
            extra,
            Some(kubeconfig.to_path_buf()),
            None,
        )
        .await
    }

    async fn start_with(
        namespace: &str,
        plugins: &[&Path],
        extra: &[&str],
        kubeconfig: Option<PathBuf>,
        identity: Option<String>,
    ) -> Operator {
        let dir = tempfile::tempdir().unwrap();
        for p in plugins {
            std::fs::copy(p, dir.path().join(p.file_name().unwrap())).unwrap();
        }
        let log = match &identity {
            Some(id) => format!("capstan-e2e-{namespace}-{id}.log"),
            None => format!("capstan-e2e-{namespace}.log"),
        };
        let log = std::env::temp_dir().join(log);
        let mut extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        // Each host its own webhook port and configuration (scoped to its namespace), so
        // that tests running side by side never share either; a restart keeps both.
        if !extra.iter().any(|a| a.starts_with("--webhook-addr")) {
            extra.extend([
                "--webhook-addr".into(),
                format!("127.0.0.1:{}", free_port()),
            ]);
        }
        if !extra
            .iter()
            .any(|a| a.starts_with("--webhook-configuration"))
        {
            let name = match &identity {
                Some(id) => format!("capstan-e2e-{namespace}-{id}"),
                None => format!("capstan-e2e-{namespace}"),
            };
            extra.extend(["--webhook-configuration".into(), name]);
        }
        let mut op = Operator {
            child: None,
            plugins: dir,
            namespace: namespace.into(),
            port: free_port(),
            extra,
            log,
            kubeconfig,
            identity,
        };
        op.spawn().await;
        op
    }

    async fn spawn(&mut self) {
        let bin = capstan_bin();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let mut cmd = Command::new(bin);
        cmd.arg("run");
        match &self.kubeconfig {
            // Only that identity: no admin KUBECONFIG to fall back on.
            Some(path) => cmd.env_remove("KUBECONFIG").arg("--kubeconfig").arg(path),
            None => cmd.arg("--install-crds"),
        };
        if let Some(identity) = &self.identity {
            cmd.env("POD_NAME", identity);
        }
        let child = cmd
            .args(["--poll-interval-ms", "200", "--namespace", &self.namespace])
            .arg("--plugins")
            .arg(self.plugins.path())
            .args(["--metrics-addr", &format!("127.0.0.1:{}", self.port)])
            .args(&self.extra)
            .env("CAPSTAN_LOG", "info,capstan=debug")
            .env(
                "CAPSTAN_CACHE_DIR",
                std::env::temp_dir().join("capstan-e2e-cache"),
            )
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start capstan run");
        self.child = Some(child);
        let port = self.port;
        wait_for(
            "capstan run to be ready",
            Duration::from_secs(60),
            || async move {
                Ok(http_get(port, "/readyz")
                    .await
                    .ok()
                    .filter(|b| b.starts_with("ok")))
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}; log: {}", self.log_tail()));
    }

    /// Stops the process and starts it again with the same directory and port.
    pub async fn restart(&mut self) {
        self.kill();
        self.spawn().await;
    }

    /// Kills the process (SIGKILL: a crash is the harder case for state on restart).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM, and waits until the process has exited (a clean stop, as on a Pod's
    /// deletion).
    pub fn terminate(&mut self) {
        self.signal("TERM");
        if let Some(mut child) = self.child.take() {
            let _ = child.wait();
        }
    }

    /// The port of its /metrics, /healthz, /readyz and /plugins (on 127.0.0.1).
    pub fn metrics_port(&self) -> u16 {
        self.port
    }

    /// The process id, while the process is ours (not yet killed and reaped).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// SIGSTOP: the process freezes, as on a node stall; its connections stay open and
    /// its clocks run on.
    pub fn pause(&mut self) {
        self.signal("STOP");
    }

    /// SIGCONT after [`Operator::pause`].
    pub fn resume(&mut self) {
        self.signal("CONT");
    }

    /// Signals the child by PID, which is safe only while it is not reaped: an exited
    /// child is reaped here first, and then not signalled.
    fn signal(&mut self, signal: &str) {
        if self.exit_status().is_some() {
            return;
        }
        if let Some(pid) = self.pid() {
            let status = Command::new("kill")
                .args(["-s", signal, &pid.to_string()])
                .status()
                .expect("run kill");
            assert!(status.success(), "kill -s {signal} {pid} failed");
        }
    }

    /// The exit status, once the process has ended by itself; `None` while it runs.
    pub fn exit_status(&mut self) -> Option<ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// The identity it was started with ([`Operator::start_replica`]).
    pub fn identity(&self) -> Option<&str> {
        self.identity.as_deref()
    }

    /// `GET /metrics`.
    pub async fn metrics(&self) -> Result<String> {
        http_get(self.port, "/metrics").await
    }

    /// A counter's value from `/metrics` (0 when absent).
    pub async fn counter(&self, series: &str) -> Result<u64> {
        let text = self.metrics().await?;
        Ok(text
            .lines()
            .find_map(|l| {
                l.strip_prefix(series)
                    .and_then(|rest| rest.trim().parse().ok())
            })
            .unwrap_or(0))
    }

    /// `GET /plugins`: the state of every plugin file.
    pub async fn plugin_states(&self) -> Result<Vec<Value>> {
        let body = http_get(self.port, "/plugins").await?;
        serde_json::from_str(&body).context("parse /plugins")
    }

    /// The `canary` entry of the plugin `name` in `/plugins` (null without a candidate).
    pub async fn canary_state(&self, name: &str) -> Result<Value> {
        Ok(self
            .plugin_states()
            .await?
            .into_iter()
            .find(|p| p["name"] == name)
            .map(|p| p["canary"].clone())
            .unwrap_or_default())
    }

    /// The end of the operator's log, for failure messages.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    /// The whole log.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Operator {
    /// Deletes the parents of the plugins it serves and waits until they are gone, then
    /// kills the process: as a user removes what an operator manages before removing
    /// the operator. A parent with a finalizer (PostgreSQLCluster's teardown) would
    /// otherwise keep the test's namespace from going. An operator already killed by
    /// the test leaves its parents as they are.
    fn drop(&mut self) {
        if self.exit_status().is_none() && self.child.is_some() {
            self.delete_parents();
        }
        self.kill();
    }
}

impl Operator {
    /// `kubectl delete --all` of every kind this host serves, in its namespace, then
    /// waits (up to two minutes in all) until none is left; failures are printed, not
    /// raised (the namespace's deletion reports what stays). The wait lists each kind
    /// rather than `--wait`, which watches the deleted objects one after another (a
    /// round trip each: minutes for the thousands of parents of the sharding tests).
    fn delete_parents(&self) {
        let Some(kubectl) = std::env::var_os("CAPSTAN_KUBECTL") else {
            return;
        };
        let kinds = match blocking_get(self.port, "/plugins")
            .and_then(|body| Ok(serde_json::from_str::<Value>(&body)?))
        {
            Ok(Value::Array(plugins)) => plugins
                .iter()
                .filter(|p| p["serving"] == true)
                .filter_map(|p| p["kind"].as_str().and_then(kubectl_resource))
                .collect::<Vec<_>>(),
            _ => return,
        };
        let kubectl = |args: &[&str]| {
            Command::new(&kubectl)
                .args(args)
                .args(["-n", &self.namespace])
                .stdin(Stdio::null())
                .output()
        };
        for kind in &kinds {
            match kubectl(&[
                "delete",
                "--all",
                "--wait=false",
                "--ignore-not-found",
                kind,
            ]) {
                Ok(out) if !out.status.success() => eprintln!(
                    "operator teardown: kubectl delete --all {kind} -n {}: {}",
                    self.namespace,
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
                Err(e) => eprintln!("operator teardown: kubectl: {e}"),
                Ok(_) => {}
            }
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        for kind in &kinds {
            loop {
                let left = match kubectl(&["get", kind, "-o", "name"]) {
                    Ok(out) if out.status.success() => {
                        String::from_utf8_lossy(&out.stdout).lines().count()
                    }
                    Ok(out) => {
                        eprintln!(
                            "operator teardown: kubectl get {kind} -n {}: {}",
                            self.namespace,
                            String::from_utf8_lossy(&out.stderr).trim()
                        );
                        break;
                    }
                    Err(e) => {
                        eprintln!("operator teardown: kubectl: {e}");
                        break;
                    }
                };
                if left == 0 {
                    break;
                }
                if std::time::Instant::now() >= deadline {
                    eprintln!(
                        "operator teardown: {left} {kind} in {} still there after 120 s",
                        self.namespace
                    );
                    break;
                }
                std::thread::sleep(Duration::from_millis(250));
            }
        }
    }
}

/// `Kind.group/version` (how `/plugins` names a kind) as kubectl names its resource,
/// `Kind.version.group`.
fn kubectl_resource(kind: &str) -> Option<String> {
    let (kind, api_version) = kind.split_once('.')?;
    Some(match api_version.split_once('/') {
        Some((group, version)) => format!("{kind}.{version}.{group}"),
        None => format!("{kind}.{api_version}"),
    })
}

/// A plain HTTP GET on loopback without a runtime (for `Drop`), returning the body.
fn blocking_get(port: u16, path: &str) -> Result<String> {
    use std::io::{Read as _, Write as _};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n"
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let (_, body) = response
        .split_once("\r\n\r\n")
        .context("malformed HTTP response")?;
    Ok(body.to_string())
}

/// A plain HTTP GET on loopback, returning the body.
pub async fn http_get(port: u16, path: &str) -> Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .context("malformed HTTP response")?;
    anyhow::ensure!(
        head.starts_with("HTTP/1.1 200"),
        "{path}: {}",
        head.lines().next().unwrap_or_default()
    );
    Ok(body.to_string())
}
