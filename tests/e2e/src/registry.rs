//! A real OCI registry for the tests: go-containerregistry's `crane registry serve`
//! (in memory, plain HTTP on loopback), which `cargo xtask test` builds at a pinned
//! version and names in `CAPSTAN_CRANE`. Its log has one line per request, which the
//! tests read to check what was asked of it.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::operator::free_port;

/// A running registry, stopped (by its PID) when dropped.
pub struct Registry {
    child: Child,
    /// `127.0.0.1:PORT`.
    pub address: String,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Registry {
    /// Starts a registry on a free loopback port and waits until it serves.
    pub fn start() -> Result<Registry> {
        let crane = std::env::var_os("CAPSTAN_CRANE")
            .map(PathBuf::from)
            .context(
                "CAPSTAN_CRANE is not set: run the tests with `cargo xtask test`, which builds \
             crane (go-containerregistry) and names it",
            )?;
        let dir = tempfile::tempdir()?;
        let log = dir.path().join("registry.log");
        let address = format!("127.0.0.1:{}", free_port());
        let child = Command::new(&crane)
            .args(["registry", "serve", "--address", &address])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?)
            .spawn()
            .with_context(|| format!("start {}", crane.display()))?;
        let mut registry = Registry {
            child,
            address,
            log,
            _dir: dir,
        };
        let start = Instant::now();
        while !registry.log().contains("serving on port") {
            if let Ok(Some(status)) = registry.child.try_wait() {
                bail!("crane registry serve exited ({status}): {}", registry.log());
            }
            if start.elapsed() > Duration::from_secs(20) {
                bail!(
                    "crane registry serve did not start in 20 s: {}",
                    registry.log()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(registry)
    }

    /// `oci://ADDRESS/REPOSITORY` (append `:TAG`).
    pub fn reference(&self, repository: &str) -> String {
        format!("oci://{}/{repository}", self.address)
    }

    /// What the registry logged: one line per request (`METHOD PATH [STATUS …]`).
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The requests logged from now on are those after the current end of the log.
    pub fn mark(&self) -> usize {
        self.log().len()
    }

    /// The requests logged since `mark`, as `METHOD PATH`.
    pub fn requests_since(&self, mark: usize) -> Vec<String> {
        let log = self.log();
        log.get(mark..)
            .unwrap_or_default()
            .lines()
            .filter_map(|line| {
                // `2026/12/06 20:00:55 GET /v2/… [status…]`
                let mut words = line.split_whitespace().skip(2);
                let method = words.next()?;
                let path = words.next()?;
                Some(format!("{method} {path}"))
            })
            .collect()
    }

    /// [`Registry::requests_since`], once `request` is among them (or after 10 s
    /// without it): the registry logs a request after answering it, so a client can be
    /// done before its last requests are in the log.
    pub fn requests_since_including(&self, mark: usize, request: &str) -> Vec<String> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let requests = self.requests_since(mark);
            if requests.iter().any(|r| r == request) || Instant::now() >= deadline {
                return requests;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops the registry now (a test of what happens without it).
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        self.stop();
    }
}
