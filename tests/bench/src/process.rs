//! The operator under test: `capstan run` or `native-uuid`, started with its log in a
//! file, measured through `/proc`, and killed by PID when dropped (also on failure).

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::procfs::{self, Usage};
use crate::{Error, Result};

/// A running operator.
pub struct Operator {
    child: Child,
    /// When it was started.
    pub started: Instant,
    /// Its log (stderr).
    pub log: PathBuf,
    /// The port of capstan's endpoints (none for the native controller).
    port: Option<u16>,
}

/// How to start `capstan run`.
#[derive(Debug, Clone)]
pub struct CapstanRun<'a> {
    /// The binary.
    pub bin: &'a Path,
    /// `--plugins`.
    pub plugins: &'a Path,
    /// `--namespace`.
    pub namespace: &'a str,
    /// `CAPSTAN_CACHE_DIR`: the compiled-code cache.
    pub cache_dir: &'a Path,
    /// `--poll-interval-ms`, if not the default.
    pub poll_interval_ms: Option<u64>,
    /// Where its log goes.
    pub log: &'a Path,
    /// More arguments (e.g. `--shards`).
    pub extra: &'a [String],
    /// `POD_NAME`: its identity as a replica, if not capstan's default.
    pub identity: Option<&'a str>,
}

impl Operator {
    /// Starts `capstan run` as configured, on a free loopback port, with the host's
    /// defaults otherwise (log level `warn`, concurrency 4).
    pub fn capstan(run: &CapstanRun<'_>) -> Result<Self> {
        let port = free_port()?;
        let mut cmd = Command::new(run.bin);
        cmd.arg("run")
            .args(["--namespace", run.namespace])
            .arg("--plugins")
            .arg(run.plugins)
            .args(["--metrics-addr", &format!("127.0.0.1:{port}")])
            .env("CAPSTAN_CACHE_DIR", run.cache_dir)
            .env_remove("CAPSTAN_LOG");
        if let Some(ms) = run.poll_interval_ms {
            cmd.args(["--poll-interval-ms", &ms.to_string()]);
        }
        cmd.args(run.extra);
        if let Some(identity) = run.identity {
            cmd.env("POD_NAME", identity);
        }
        Self::spawn(cmd, run.log, Some(port))
    }

    /// Starts the native controller on `namespace`.
    pub fn native(bin: &Path, namespace: &str, log: &Path) -> Result<Self> {
        let mut cmd = Command::new(bin);
        cmd.args(["--namespace", namespace]);
        Self::spawn(cmd, log, None)
    }

    fn spawn(mut cmd: Command, log: &Path, port: Option<u16>) -> Result<Self> {
        let file = std::fs::File::create(log)
            .map_err(|e| Error::Setup(format!("create {}: {e}", log.display())))?;
        let shown = format!("{cmd:?}");
        let started = Instant::now();
        let child = cmd
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .map_err(|e| Error::Setup(format!("start {shown}: {e}")))?;
        Ok(Operator {
            child,
            started,
            log: log.to_path_buf(),
            port,
        })
    }

    /// Its PID.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// What it has cost so far.
    pub fn usage(&self) -> Usage {
        procfs::usage(self.pid()).unwrap_or_default()
    }

    /// Fails, with the end of its log, if it exited.
    pub fn alive(&mut self) -> Result<()> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => Err(Error::Exited {
                status: status.to_string(),
                log: self.log.clone(),
                tail: tail(&self.log),
            }),
            Err(e) => Err(Error::Setup(format!("wait for the operator: {e}"))),
        }
    }

    /// Waits until `/readyz` answers ok; returns the time since the start.
    pub async fn ready(&mut self, timeout: Duration) -> Result<Duration> {
        let port = self
            .port
            .ok_or_else(|| Error::Setup("only capstan has /readyz".into()))?;
        let deadline = self.started + timeout;
        loop {
            if get(port, "/readyz")
                .await
                .is_ok_and(|body| body.starts_with("ok"))
            {
                return Ok(self.started.elapsed());
            }
            self.alive()?;
            if Instant::now() > deadline {
                return Err(Error::Timeout {
                    what: "/readyz".into(),
                    after: timeout,
                    reached: 0,
                });
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// `GET /metrics` of capstan.
    pub async fn metrics(&self) -> Result<String> {
        let port = self
            .port
            .ok_or_else(|| Error::Setup("only capstan has /metrics".into()))?;
        get(port, "/metrics").await
    }

    /// Kills it (SIGKILL, as a crash) and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        self.kill();
    }
}

fn free_port() -> Result<u16> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| Error::Setup(format!("no free port: {e}")))
}

/// The last lines of a log, for error messages.
pub fn tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

/// A plain HTTP GET on loopback, returning the body of a 200.
async fn get(port: u16, path: &str) -> Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let failed = |e: std::io::Error| Error::Setup(format!("GET {path}: {e}"));
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(failed)?;
    let request = format!("GET {path} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.map_err(failed)?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await.map_err(failed)?;
    match response.split_once("\r\n\r\n") {
        Some((head, body)) if head.starts_with("HTTP/1.1 200") => Ok(body.to_string()),
        _ => Err(Error::Setup(format!(
            "GET {path}: {}",
            response.lines().next().unwrap_or_default()
        ))),
    }
}
