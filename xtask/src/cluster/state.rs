//! One cluster's state directory: its layout, the processes and ports it records, and
//! free loopback ports for a new cluster.

use std::{
    ffi::OsString,
    fmt::Write as _,
    fs,
    io::Write as _,
    net::TcpListener,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};

use super::process::Process;

/// A file whose presence says "this directory is a cluster's state": `down` removes only
/// directories that have it.
const MARKER: &str = ".capstan-cluster";

/// The state directory of one cluster: credentials, etcd data, logs, processes, ports.
#[derive(Debug, Clone)]
pub struct StateDir {
    root: PathBuf,
}

impl StateDir {
    /// The state directory at `root` (which may not exist yet), made absolute: the
    /// components get its paths, and `down` may run from another directory.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        let root = root.into();
        Self {
            root: std::path::absolute(&root).unwrap_or(root),
        }
    }

    /// The directory itself.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Whether the directory holds a cluster's state.
    pub fn exists(&self) -> bool {
        self.root.join(MARKER).is_file()
    }

    /// Creates a fresh, empty state directory; refuses to reuse a directory that holds
    /// anything but an earlier cluster's state.
    pub fn create(&self) -> Result<()> {
        self.remove()?;
        if self.root.exists() && fs::read_dir(&self.root)?.next().is_some() {
            bail!(
                "{} exists and is not a cluster state directory; choose another --state-dir",
                self.root.display()
            );
        }
        // Not etcd's data directory: etcd makes it itself, private (0700).
        for dir in [self.pki(), self.logs(), self.volumes(), self.commands()] {
            fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
        }
        fs::write(self.root.join(MARKER), "").context("write the state marker")
    }

    /// Removes the directory if it is a cluster state directory.
    pub fn remove(&self) -> Result<()> {
        if self.exists() {
            fs::remove_dir_all(&self.root)
                .with_context(|| format!("remove {}", self.root.display()))?;
        }
        Ok(())
    }

    /// Waits until no other process changes the cluster's processes (a `restart`), and
    /// holds that until the returned file is dropped: two restarts of one component at
    /// once would start two of it, of which one fails to bind its port and the state
    /// may record the one that exited.
    pub fn lock_processes(&self) -> Result<fs::File> {
        let path = self.root.join("processes.lock");
        let file = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .with_context(|| format!("open {}", path.display()))?;
        file.lock()
            .with_context(|| format!("lock {}", path.display()))?;
        Ok(file)
    }

    /// Credentials made by `capstan-pki`.
    pub fn pki(&self) -> PathBuf {
        self.root.join("pki")
    }

    /// The admin kubeconfig: what `KUBECONFIG` should point at.
    pub fn kubeconfig(&self) -> PathBuf {
        self.root.join("kubeconfig")
    }

    /// The kubeconfig a component uses to reach the apiserver.
    pub fn component_kubeconfig(&self, component: &str) -> PathBuf {
        self.pki().join(format!("{component}.kubeconfig"))
    }

    /// `logs/`, one file per component.
    pub fn logs(&self) -> PathBuf {
        self.root.join("logs")
    }

    /// A component's log file.
    pub fn log(&self, component: &str) -> PathBuf {
        self.logs().join(format!("{component}.log"))
    }

    /// etcd's data directory.
    pub fn etcd_data(&self) -> PathBuf {
        self.root.join("etcd")
    }

    /// Host paths of the static PersistentVolumes.
    pub fn volumes(&self) -> PathBuf {
        self.root.join("volumes")
    }

    /// The API server's audit policy (written by `up`).
    pub fn audit_policy(&self) -> PathBuf {
        self.root.join("audit-policy.yaml")
    }

    /// The API server's audit log: one JSON event per line, one per write request.
    pub fn audit_log(&self) -> PathBuf {
        self.logs().join("kube-apiserver-audit.log")
    }

    /// `commands/`, the command line of each component, so it can be restarted as it was.
    fn commands(&self) -> PathBuf {
        self.root.join("commands")
    }

    /// Records how `component` was started: its program and arguments, one per line.
    pub fn record_command(&self, component: &str, command: &Command) -> Result<()> {
        let mut text = String::new();
        for arg in std::iter::once(command.get_program()).chain(command.get_args()) {
            let arg = arg
                .to_str()
                .with_context(|| format!("{component}: an argument is not UTF-8: {arg:?}"))?;
            if arg.contains('\n') {
                bail!("{component}: an argument holds a line break: {arg:?}");
            }
            let _ = writeln!(text, "{arg}");
        }
        let path = self.commands().join(component);
        fs::write(&path, text).with_context(|| format!("write {}", path.display()))
    }

    /// The command `component` was started with (see [`StateDir::record_command`]).
    pub fn command(&self, component: &str) -> Result<Command> {
        let path = self.commands().join(component);
        let text = fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))?;
        let mut argv = text.lines().map(OsString::from);
        let program = argv
            .next()
            .with_context(|| format!("{} is empty", path.display()))?;
        let mut command = Command::new(program);
        command.args(argv);
        Ok(command)
    }

    fn processes_file(&self) -> PathBuf {
        self.root.join("processes")
    }

    fn ports_file(&self) -> PathBuf {
        self.root.join("ports")
    }

    /// Appends a started process, at once, so that a failed `up` or a later `down`
    /// finds every process that was started.
    pub fn record(&self, process: &Process) -> Result<()> {
        fs::File::options()
            .create(true)
            .append(true)
            .open(self.processes_file())
            .and_then(|mut f| f.write_all(process.to_record().as_bytes()))
            .context("record the process in the state directory")
    }

    /// Replaces the record of `process.component` with `process` (a restart), atomically:
    /// `down` must find the new process whatever happens meanwhile.
    pub fn replace(&self, process: &Process) -> Result<()> {
        let text: String = self
            .processes()?
            .into_iter()
            .map(|p| {
                if p.component == process.component {
                    process.to_record()
                } else {
                    p.to_record()
                }
            })
            .collect();
        let path = self.processes_file();
        let partial = path.with_extension("partial");
        fs::write(&partial, text)
            .and_then(|()| fs::rename(&partial, &path))
            .with_context(|| format!("rewrite {}", path.display()))
    }

    /// The processes started for this cluster, in start order.
    pub fn processes(&self) -> Result<Vec<Process>> {
        let path = self.processes_file();
        let text = match fs::read_to_string(&path) {
            Ok(text) => text,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(err) => return Err(err).with_context(|| format!("read {}", path.display())),
        };
        text.lines()
            .filter(|line| !line.trim().is_empty())
            .map(|line| {
                Process::from_record(line)
                    .with_context(|| format!("{}: bad line {line:?}", path.display()))
            })
            .collect()
    }

    /// Writes the ports a cluster listens on.
    pub fn write_ports(&self, ports: &Ports) -> Result<()> {
        let mut text = String::new();
        for (name, port) in ports.named() {
            let _ = writeln!(text, "{name} {port}");
        }
        fs::write(self.ports_file(), text).context("write the ports file")
    }

    /// The ports recorded by [`StateDir::write_ports`], by name.
    pub fn ports(&self) -> Vec<(String, u16)> {
        let text = fs::read_to_string(self.ports_file()).unwrap_or_default();
        text.lines()
            .filter_map(|line| {
                let (name, port) = line.split_once(' ')?;
                Some((name.to_owned(), port.trim().parse().ok()?))
            })
            .collect()
    }
}

/// The loopback ports one cluster listens on.
#[derive(Debug, Clone, Copy)]
pub struct Ports {
    /// etcd client URL.
    pub etcd_client: u16,
    /// etcd peer URL (a one-member cluster, but etcd always listens on one).
    pub etcd_peer: u16,
    /// kube-apiserver's HTTPS port.
    pub apiserver: u16,
    /// kube-controller-manager's secure (health, metrics) port.
    pub controller_manager: u16,
    /// kube-scheduler's secure (health, metrics) port.
    pub scheduler: u16,
    /// kwok's server (health, metrics).
    pub kwok: u16,
}

impl Ports {
    /// Asks the kernel for six distinct free ports on 127.0.0.1. They are free when
    /// picked; a component started right after takes its port before anyone else
    /// usually does, and if not, it fails with "address in use" in its log.
    pub fn pick() -> Result<Self> {
        let listeners = (0..6)
            .map(|_| TcpListener::bind("127.0.0.1:0"))
            .collect::<std::io::Result<Vec<_>>>()
            .context("find free ports on 127.0.0.1")?;
        let port = |i: usize| listeners[i].local_addr().map(|a| a.port());
        Ok(Self {
            etcd_client: port(0)?,
            etcd_peer: port(1)?,
            apiserver: port(2)?,
            controller_manager: port(3)?,
            scheduler: port(4)?,
            kwok: port(5)?,
        })
    }

    fn named(&self) -> [(&'static str, u16); 6] {
        [
            ("etcd-client", self.etcd_client),
            ("etcd-peer", self.etcd_peer),
            ("kube-apiserver", self.apiserver),
            ("kube-controller-manager", self.controller_manager),
            ("kube-scheduler", self.scheduler),
            ("kwok", self.kwok),
        ]
    }
}
