//! `cargo xtask demo`: the README's first command. Builds the plugins and the host,
//! starts a local control plane, runs `capstan run` with the shipped plugins, applies the
//! samples and shows them reconciled; then keeps running until interrupted (`--once`:
//! stop right after showing). Everything it started is stopped on the way out.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::{TestPlugins, build_host, build_plugins, cluster, root, target_dir};

/// Where the demo's capstan serves its endpoints.
const METRICS_ADDR: &str = "127.0.0.1:18080";

/// Runs the demo.
pub fn main(args: &[String]) -> Result<()> {
    let once = match args {
        [] => false,
        [flag] if flag == "--once" => true,
        _ => bail!("usage: cargo xtask demo [--once]"),
    };
    let interrupted = Arc::new(AtomicBool::new(false));
    let flag = interrupted.clone();
    ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst))
        .context("install Ctrl-C handler")?;

    let built = build_plugins(TestPlugins::None)?;
    build_host()?;
    // A real node where the machine allows it (`cluster up` says in one line why not).
    let cluster = cluster::up(&cluster::UpOptions::default())?;
    let result = match cluster.real_node {
        true => {
            eprintln!(
                "demo: the Pods run for real on node {} (containerd, runc, kubelet)",
                cluster::NODE_NAME
            );
            // The PostgreSQL the samples ask for; capstan itself runs beside the cluster.
            crate::image::build_and_import(&cluster.state_dir, None)
        }
        false => {
            eprintln!("demo: no real node on this machine: kwok simulates the Pods");
            Ok(())
        }
    };
    let result = result.and_then(|()| demo(&cluster, &built.plugins, once, &interrupted));
    eprintln!("demo: stopping the cluster");
    let stopped = cluster::down(&cluster.state_dir);
    result.and(stopped)
}

fn demo(
    cluster: &cluster::Cluster,
    plugins: &Path,
    once: bool,
    interrupted: &AtomicBool,
) -> Result<()> {
    let log_path = target_dir().join("demo-capstan.log");
    let mut capstan = Capstan::start(cluster, plugins, &log_path)?;
    eprintln!("demo: capstan runs (log: {})", log_path.display());
    let kubectl = Kubectl {
        bin: cluster.bin_dir.join("kubectl"),
        kubeconfig: cluster.kubeconfig.clone(),
    };

    let samples = root().join("crds/samples");
    // No MySQL image is built here: on the real node its Pod would wait for one forever.
    let applied: Vec<PathBuf> = ["uuid", "postgresqlcluster", "database", "database-mysql"]
        .iter()
        .filter(|name| !(cluster.real_node && **name == "database-mysql"))
        .map(|name| samples.join(format!("{name}.yaml")))
        .collect();
    if cluster.real_node {
        eprintln!(
            "demo: not applying database-mysql.yaml: no mysql image is built for the real node"
        );
    }
    let mut apply = vec!["apply"];
    for file in &applied {
        apply.extend(["-f", file.to_str().context("a sample's path is not UTF-8")?]);
    }
    wait(
        "the sample resources to be accepted",
        Duration::from_secs(60),
        &mut capstan,
        || Ok(kubectl.run(&apply).is_ok()),
    )?;
    wait(
        "the Uuid to get its UUID",
        Duration::from_secs(60),
        &mut capstan,
        || {
            Ok(!kubectl
                .run(&[
                    "get",
                    "uuid",
                    "-A",
                    "-o",
                    "jsonpath={.items[*].status.uuid}",
                ])?
                .trim()
                .is_empty())
        },
    )?;
    if samples.join("postgresqlcluster.yaml").exists() {
        wait(
            "the PostgreSQLCluster and the Database to be Running",
            Duration::from_secs(300),
            &mut capstan,
            || {
                let mut phases = String::new();
                for kind in ["pgc", "databases"] {
                    let of_kind = kubectl.run(&[
                        "get",
                        kind,
                        "-A",
                        "-o",
                        "jsonpath={.items[*].status.phase}",
                    ])?;
                    if of_kind.trim().is_empty() {
                        return Ok(false);
                    }
                    phases.push_str(&of_kind);
                    phases.push(' ');
                }
                Ok(phases.split_whitespace().all(|p| p == "Running"))
            },
        )?;
    }
    println!(
        "\n$ kubectl get uuid\n{}",
        kubectl.run(&["get", "uuid", "-A"])?
    );
    if samples.join("postgresqlcluster.yaml").exists() {
        println!("$ kubectl get pgc\n{}", kubectl.run(&["get", "pgc", "-A"])?);
        println!(
            "$ kubectl get databases\n{}",
            kubectl.run(&["get", "databases", "-A"])?
        );
        println!(
            "$ kubectl get pods -o wide\n{}",
            kubectl.run(&["get", "pods", "-o", "wide"])?
        );
        if cluster.real_node {
            show_query(&kubectl, &mut capstan)?;
        }
    }
    println!(
        "The cluster: export KUBECONFIG={}\nkubectl: {}\ncapstan's endpoints: http://{METRICS_ADDR}/metrics and /plugins",
        cluster.kubeconfig.display(),
        kubectl.bin.display()
    );
    if once {
        return capstan.stop();
    }
    println!("\nRunning; press Ctrl-C to stop capstan and the cluster.");
    while !interrupted.load(Ordering::SeqCst) {
        if let Some(status) = capstan.child.try_wait()? {
            bail!("capstan exited ({status}); see {}", log_path.display());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    capstan.stop()
}

/// One real query on the sample PostgreSQLCluster's primary, once both standbys stream.
fn show_query(kubectl: &Kubectl, capstan: &mut Capstan) -> Result<()> {
    // Over the local socket `inet_server_addr()` is NULL (and so was the whole line
    // once): the role comes from pg_is_in_recovery() instead.
    const SQL: &str = "select 'PostgreSQL ' || current_setting('server_version') || ', ' \
        || case when pg_is_in_recovery() then 'a standby' else 'the primary' end \
        || ', standbys streaming: ' \
        || (select count(*) from pg_stat_replication where state = 'streaming')";
    let query = [
        "exec", "demo-0", "-c", "postgres", "--", "psql", "-X", "-At", "-U", "postgres", "-c", SQL,
    ];
    let mut answer = String::new();
    wait(
        "both standbys of demo to stream",
        Duration::from_secs(120),
        capstan,
        || {
            // The last answer, or why there was none, for the timeout's message.
            answer = match kubectl.run(&query) {
                Ok(out) => out.trim().to_owned(),
                Err(err) => format!("{err:#}"),
            };
            Ok(answer.ends_with("streaming: 2"))
        },
    )
    .with_context(|| format!("the last answer of demo-0: {answer}"))?;
    println!("$ kubectl exec demo-0 -c postgres -- psql -U postgres -c \"{SQL}\"\n{answer}\n");
    Ok(())
}

/// Polls `check` until it holds, failing after `timeout` or if capstan dies.
fn wait(
    what: &str,
    timeout: Duration,
    capstan: &mut Capstan,
    mut check: impl FnMut() -> Result<bool>,
) -> Result<()> {
    eprintln!("demo: waiting for {what}");
    let start = Instant::now();
    loop {
        if let Some(status) = capstan.child.try_wait()? {
            bail!(
                "capstan exited ({status}) while waiting for {what}; see {}",
                capstan.log.display()
            );
        }
        if check().unwrap_or(false) {
            return Ok(());
        }
        if start.elapsed() > timeout {
            bail!(
                "timed out after {timeout:?} waiting for {what}; capstan's log: {}",
                capstan.log.display()
            );
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

struct Capstan {
    child: Child,
    log: PathBuf,
}

impl Capstan {
    fn start(cluster: &cluster::Cluster, plugins: &Path, log: &Path) -> Result<Self> {
        let file =
            std::fs::File::create(log).with_context(|| format!("create {}", log.display()))?;
        let child = Command::new(target_dir().join("debug/capstan"))
            .args([
                "run",
                "--install-crds",
                "--metrics-addr",
                METRICS_ADDR,
                "--plugins",
            ])
            .arg(plugins)
            .env("KUBECONFIG", &cluster.kubeconfig)
            .env("CAPSTAN_LOG", "info")
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .context("start capstan run")?;
        Ok(Capstan {
            child,
            log: log.to_path_buf(),
        })
    }

    /// SIGTERM (capstan shuts its controllers down on it), then SIGKILL.
    fn stop(&mut self) -> Result<()> {
        let _ = cluster::signal(self.child.id(), "TERM");
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if self.child.try_wait()?.is_some() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        self.child.kill()?;
        self.child.wait()?;
        Ok(())
    }
}

impl Drop for Capstan {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

struct Kubectl {
    bin: PathBuf,
    kubeconfig: PathBuf,
}

impl Kubectl {
    fn run(&self, args: &[&str]) -> Result<String> {
        let out = Command::new(&self.bin)
            .args(args)
            .env("KUBECONFIG", &self.kubeconfig)
            .output()
            .with_context(|| format!("run {}", self.bin.display()))?;
        if !out.status.success() {
            bail!(
                "kubectl {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}
