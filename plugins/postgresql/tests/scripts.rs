//! The plugin's own scripts, run for real outside Kubernetes: PostgreSQL from Debian's
//! packages on loopback. A primary and a standby are bootstrapped by the entrypoint the
//! ConfigMap ships; a row written on the primary is read on the standby; the standby
//! refuses writes; a restarted primary takes its passwords from the environment and the
//! standby streams again; the dump script's output restores into an empty server.
//!
//! Needs the Debian package `postgresql` (server binaries under
//! /usr/lib/postgresql/<major>/bin). PostgreSQL refuses to run as root, so when the test
//! runs as root the servers run as `nobody`, through `setpriv` (util-linux). Every
//! process the test starts is stopped by its process group when the test ends, also
//! when it fails.

use std::fs;
use std::net::TcpListener;
use std::os::unix::fs::{MetadataExt, chown};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use capstan_plugin_postgresql::scripts;

const APP_PASSWORD: &str = "AppPassw0rdFromTheSecret1234567";
const NEW_APP_PASSWORD: &str = "RotatedPassw0rdFromTheSecret999";
const REPLICATION_PASSWORD: &str = "Repl1cationPassw0rdFromTheSecre";
const WAIT: Duration = Duration::from_secs(60);

/// Where the PostgreSQL binaries are and who runs the servers.
struct Toolbox {
    bin: PathBuf,
    /// `uid:gid` to run servers as, when the test runs as root.
    run_as: Option<(u32, u32)>,
}

impl Toolbox {
    fn find() -> Self {
        let bin = newest_postgres_bin().unwrap_or_else(|| {
            panic!(
                "PostgreSQL server binaries not found under /usr/lib/postgresql/<major>/bin \
                 (initdb, postgres, pg_ctl, pg_basebackup, psql, pg_dump, pg_restore, pg_isready): \
                 install the Debian package `postgresql` (apt-get install postgresql)"
            )
        });
        let root = fs::metadata("/proc/self").map(|m| m.uid()).unwrap_or(0) == 0;
        let run_as = root.then(|| {
            let id = |flag: &str| -> u32 {
                let out = Command::new("id").args([flag, "nobody"]).output();
                let out = out.unwrap_or_else(|e| panic!("cannot run `id`: {e}"));
                assert!(out.status.success(), "the test runs as root and needs the user `nobody` to run PostgreSQL");
                String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
            };
            let status = Command::new("setpriv").arg("--version").output();
            assert!(
                status.is_ok_and(|o| o.status.success()),
                "the test runs as root and needs `setpriv` (Debian package util-linux) to run PostgreSQL as nobody"
            );
            (id("-u"), id("-g"))
        });
        Toolbox { bin, run_as }
    }

    /// A command with a clean environment whose PATH starts with the PostgreSQL binaries.
    fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(program);
        cmd.env_clear()
            .env("PATH", format!("{}:/usr/bin:/bin", self.bin.display()));
        cmd
    }

    /// Like [`command`](Self::command), run as the unprivileged user when we are root.
    fn unprivileged(&self, program: &str) -> Command {
        match self.run_as {
            Some((uid, gid)) => {
                let mut cmd = self.command("setpriv");
                cmd.args([
                    format!("--reuid={uid}"),
                    format!("--regid={gid}"),
                    "--clear-groups".into(),
                    "--".into(),
                    program.into(),
                ]);
                cmd
            }
            None => self.command(program),
        }
    }

    /// Makes `dir` and hands it to the user the servers run as.
    fn dir(&self, dir: &Path) -> PathBuf {
        fs::create_dir_all(dir).unwrap();
        if let Some((uid, gid)) = self.run_as {
            chown(dir, Some(uid), Some(gid)).unwrap();
        }
        dir.to_path_buf()
    }

    fn psql(&self, port: u16, user: &str, password: &str, sql: &str) -> Result<String, String> {
        let out = self
            .command("psql")
            .args([
                "-X",
                "-q",
                "-A",
                "-t",
                "-v",
                "ON_ERROR_STOP=1",
                "-h",
                "127.0.0.1",
            ])
            .args(["-p", &port.to_string(), "-U", user, "-d", "app", "-c", sql])
            .env("PGPASSWORD", password)
            .env("PGCONNECT_TIMEOUT", "5")
            .output()
            .unwrap();
        result(out)
    }

    /// As the superuser, through the Unix socket (trust), like the entrypoint does.
    fn psql_superuser(
        &self,
        socket: &Path,
        port: u16,
        db: &str,
        sql: &str,
    ) -> Result<String, String> {
        let out = self
            .command("psql")
            .args(["-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1"])
            .arg("-h")
            .arg(socket)
            .args([
                "-p",
                &port.to_string(),
                "-U",
                "postgres",
                "-d",
                db,
                "-c",
                sql,
            ])
            .output()
            .unwrap();
        result(out)
    }
}

fn result(out: Output) -> Result<String, String> {
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
    }
}

fn newest_postgres_bin() -> Option<PathBuf> {
    let needed = [
        "initdb",
        "postgres",
        "pg_ctl",
        "pg_basebackup",
        "psql",
        "pg_dump",
        "pg_restore",
        "pg_isready",
    ];
    let mut found: Vec<(u32, PathBuf)> = fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| {
            let e = e.ok()?;
            let major: u32 = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            needed
                .iter()
                .all(|b| bin.join(b).exists())
                .then_some((major, bin))
        })
        .collect();
    found.sort();
    found.pop().map(|(_, bin)| bin)
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A server process (the entrypoint, which execs postgres, or postgres itself) in its
/// own process group. Dropping it stops the group, then anything still recorded in
/// the data directories' postmaster.pid.
struct Server {
    name: &'static str,
    child: Child,
    port: u16,
    socket: PathBuf,
    data_dirs: Vec<PathBuf>,
    log: PathBuf,
    stopped: bool,
    /// For an instance under a restart loop: created before stopping it, so that the
    /// loop starts nothing again (whatever the entrypoint's exit status).
    stop_file: Option<PathBuf>,
}

impl Server {
    fn spawn(
        name: &'static str,
        mut cmd: Command,
        port: u16,
        socket: PathBuf,
        pgdata: &Path,
        log: PathBuf,
    ) -> Self {
        let out = fs::File::create(&log).unwrap();
        let err = out.try_clone().unwrap();
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start the {name}: {e}"));
        let staging = PathBuf::from(format!("{}.staging", pgdata.display()));
        Server {
            name,
            child,
            port,
            socket,
            data_dirs: vec![pgdata.to_path_buf(), staging],
            log,
            stopped: false,
            stop_file: None,
        }
    }

    fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until the server accepts connections; fails with its log if it exits.
    fn wait_ready(&mut self, tools: &Toolbox) {
        let deadline = Instant::now() + WAIT;
        loop {
            let ready = tools
                .command("pg_isready")
                .args(["-q", "-h", "127.0.0.1", "-p", &self.port.to_string()])
                .status()
                .unwrap()
                .success();
            if ready {
                return;
            }
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!(
                    "the {} exited ({status}) before it was ready; its log:\n{}",
                    self.name,
                    self.log()
                );
            }
            assert!(
                Instant::now() < deadline,
                "the {} was not ready within {WAIT:?}; its log:\n{}",
                self.name,
                self.log()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// SIGKILL to the process group at once: a crash, or a node that is gone.
    fn crash(&mut self) {
        signal("KILL", &format!("-{}", self.child.id()));
        self.stop();
    }

    /// Fast shutdown (SIGINT) of the process group, then SIGKILL if it lingers.
    fn stop(&mut self) {
        if std::mem::replace(&mut self.stopped, true) {
            return;
        }
        if let Some(file) = &self.stop_file {
            fs::write(file, "").unwrap();
        }
        let group = format!("-{}", self.child.id());
        if self.child.try_wait().ok().flatten().is_none() {
            signal("INT", &group);
            let deadline = Instant::now() + Duration::from_secs(20);
            while self.child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        signal("KILL", &group);
        let _ = self.child.wait();
        // pg_ctl starts setup servers in their own session; they record their PID.
        for dir in &self.data_dirs {
            let Ok(pidfile) = fs::read_to_string(dir.join("postmaster.pid")) else {
                continue;
            };
            if let Some(pid) = pidfile
                .lines()
                .next()
                .and_then(|l| l.trim().parse::<u32>().ok())
            {
                let cmdline =
                    fs::read_to_string(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                if cmdline.contains("postgres") {
                    signal("KILL", &pid.to_string());
                }
            }
        }
    }
}

/// Sends `signal` to a process (`pid`) or a process group (`-pgid`), with bash's
/// builtin `kill`: bash is needed anyway, /usr/bin/kill (procps) may not be installed.
fn signal(signal: &str, target: &str) {
    let _ = Command::new("bash")
        .args(["-c", "kill -s \"$1\" -- \"$2\"", "kill", signal, target])
        .stderr(Stdio::null())
        .status();
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// What the plugin writes to the ConfigMap `<name>-topology`: the epoch, its primary,
/// how many standbys confirm a commit, and the members (name, port on loopback).
#[derive(Clone)]
struct Topology {
    epoch: u64,
    primary: &'static str,
    synchronous: u32,
    members: Vec<(&'static str, u16)>,
}

impl Topology {
    fn text(&self) -> String {
        let mut text = format!(
            "epoch={}\nprimary={}\nsynchronous={}\n",
            self.epoch, self.primary, self.synchronous
        );
        for (name, port) in &self.members {
            text.push_str(&format!("member={name} 127.0.0.1 {port}\n"));
        }
        text
    }
}

/// The environment the StatefulSet gives an instance, pointed at loopback. Each instance
/// reads its own copy of the topology, as each Pod has its own ConfigMap volume that
/// its kubelet updates when it gets to it.
struct Instance<'a> {
    tools: &'a Toolbox,
    scripts: &'a Path,
    root: &'a Path,
}

impl Instance<'_> {
    fn topology_file(&self, pod: &str) -> PathBuf {
        self.root.join(pod).join("topology")
    }

    /// Writes `topology` for the instances `pods`, atomically, as the kubelet does.
    fn publish(&self, topology: &Topology, pods: &[&str]) {
        for pod in pods {
            let home = self.tools.dir(&self.root.join(pod));
            let tmp = home.join("topology.tmp");
            fs::write(&tmp, topology.text()).unwrap();
            fs::rename(&tmp, self.topology_file(pod)).unwrap();
        }
    }

    fn start(&self, name: &'static str, pod: &str, port: u16, app_password: &str) -> Server {
        let mut server = self.spawn(name, pod, port, app_password, false);
        server.wait_ready(self.tools);
        server
    }

    /// The instance under a restart loop, as the kubelet restarts a container that
    /// exits: the agent exits to step down.
    fn start_restarting(&self, name: &'static str, pod: &str, port: u16) -> Server {
        self.spawn(name, pod, port, APP_PASSWORD, true)
    }

    fn spawn(
        &self,
        name: &'static str,
        pod: &str,
        port: u16,
        app_password: &str,
        restarting: bool,
    ) -> Server {
        let home = self.tools.dir(&self.root.join(pod));
        let socket = self.tools.dir(&home.join("socket"));
        let pgdata = home.join("pgdata");
        let entrypoint = self.scripts.join(scripts::ENTRYPOINT_FILE);
        let mut cmd = self.tools.unprivileged("bash");
        if restarting {
            cmd.args([
                "-c",
                // Ends once the harness asks (bash does not act on a SIGINT its
                // child handled, so the signal alone would not end it).
                "while [ ! -e \"$RESTART_STOP_FILE\" ]; do bash \"$0\"; s=$?; [ ! -e \"$RESTART_STOP_FILE\" ] || exit 0; echo \"restart-loop: exited $s\" >&2; sleep 1; done",
            ]);
        }
        cmd.arg(entrypoint);
        self.environment(&mut cmd, pod, port, app_password);
        let log = home.join(format!("log-{name}").replace(' ', "-"));
        let stop_file = home.join("stop-requested");
        let _ = fs::remove_file(&stop_file);
        cmd.env("RESTART_STOP_FILE", &stop_file);
        let mut server = Server::spawn(name, cmd, port, socket, &pgdata, log);
        server.stop_file = restarting.then_some(stop_file);
        server
    }

    /// Runs the entrypoint's probe `command` (`ready` or `live`) for the instance `pod`,
    /// as its kubelet would: whether it passes.
    fn probe(&self, command: &str, pod: &str, port: u16) -> bool {
        let mut cmd = self.tools.unprivileged("bash");
        cmd.arg(self.scripts.join(scripts::ENTRYPOINT_FILE))
            .arg(command)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        self.environment(&mut cmd, pod, port, APP_PASSWORD);
        cmd.status().unwrap().success()
    }

    /// What the entrypoint's `command` prints for the instance `pod` (trimmed), if it
    /// succeeds.
    fn output(&self, command: &str, pod: &str, port: u16) -> Option<String> {
        let mut cmd = self.tools.unprivileged("bash");
        cmd.arg(self.scripts.join(scripts::ENTRYPOINT_FILE))
            .arg(command)
            .stderr(Stdio::null());
        self.environment(&mut cmd, pod, port, APP_PASSWORD);
        let out = cmd.output().unwrap();
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
    }

    /// The environment the StatefulSet gives the instance `pod`.
    fn environment(&self, cmd: &mut Command, pod: &str, port: u16, app_password: &str) {
        let home = self.root.join(pod);
        cmd.env("POD_NAME", pod)
            .env("PGDATA", home.join("pgdata"))
            .env("PG_PORT", port.to_string())
            .env("PG_LISTEN_ADDRESSES", "127.0.0.1")
            .env("PG_SOCKET_DIR", home.join("socket"))
            .env("TOPOLOGY_FILE", self.topology_file(pod))
            .env("AGENT_INTERVAL", "0.3")
            .env("PEER_TIMEOUT", "2")
            .env("PROMOTE_HOLD", "1")
            .env("APP_USER", "app")
            .env("APP_PASSWORD", app_password)
            .env("APP_DATABASE", "app")
            .env("REPLICATION_USER", "replicator")
            .env("REPLICATION_PASSWORD", REPLICATION_PASSWORD)
            .env("WAL_KEEP_SIZE", "64MB")
            .env("BASEBACKUP_ATTEMPTS", "3");
    }
}

/// Polls `f` until it returns `Some`, for at most [`WAIT`].
fn eventually<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {WAIT:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn dump_files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn primary_and_standby_replicate_and_the_dump_restores() {
    let tools = Toolbox::find();
    // As root, in /tmp: the servers' user must reach the directory, and $TMPDIR may be
    // somewhere only root can enter.
    let tmp = match tools.run_as {
        Some(_) => tempfile::Builder::new()
            .prefix("capstan-pg-")
            .tempdir_in("/tmp"),
        None => tempfile::Builder::new().prefix("capstan-pg-").tempdir(),
    }
    .unwrap();
    let root = tools.dir(tmp.path());
    let scripts_dir = root.join("scripts");
    fs::create_dir(&scripts_dir).unwrap();
    fs::write(
        scripts_dir.join(scripts::ENTRYPOINT_FILE),
        scripts::ENTRYPOINT,
    )
    .unwrap();
    fs::write(scripts_dir.join(scripts::DUMP_FILE), scripts::DUMP).unwrap();
    let instances = Instance {
        tools: &tools,
        scripts: &scripts_dir,
        root: &root,
    };
    let (primary_port, standby_port, restore_port) = (free_port(), free_port(), free_port());
    let topology = Topology {
        epoch: 1,
        primary: "pg-0",
        synchronous: 0,
        members: vec![("pg-0", primary_port), ("pg-1", standby_port)],
    };
    instances.publish(&topology, &["pg-0", "pg-1"]);

    // The primary initializes itself: the application role, its database, its password.
    let mut primary = instances.start("primary", "pg-0", primary_port, APP_PASSWORD);
    tools
        .psql(primary_port, "app", APP_PASSWORD, "CREATE TABLE notes (id int PRIMARY KEY, note text); INSERT INTO notes VALUES (1, 'before the standby existed')")
        .expect("the application role writes on the primary");
    let wrong = tools
        .psql(primary_port, "app", "wrong", "SELECT 1")
        .unwrap_err();
    assert!(
        wrong.contains("password authentication failed for user \"app\""),
        "passwords are checked over TCP: {wrong}"
    );

    // The standby copies the primary with pg_basebackup and streams from it.
    let standby = instances.start("standby", "pg-1", standby_port, APP_PASSWORD);
    assert_eq!(
        tools.psql(
            standby_port,
            "app",
            APP_PASSWORD,
            "SELECT note FROM notes WHERE id = 1"
        ),
        Ok("before the standby existed".into())
    );
    tools
        .psql(
            primary_port,
            "app",
            APP_PASSWORD,
            "INSERT INTO notes VALUES (2, 'streamed')",
        )
        .unwrap();
    eventually("row 2 on the standby", || {
        tools
            .psql(
                standby_port,
                "app",
                APP_PASSWORD,
                "SELECT note FROM notes WHERE id = 2",
            )
            .ok()
            .filter(|n| n == "streamed")
    });
    // What the agents report to the plugin: the primary its WAL position and the
    // standby's replay lag in bytes, the standby how far it replayed.
    let primary_report = eventually("the primary to report pg-1 streaming", || {
        instances
            .output("report", "pg-0", primary_port)
            .filter(|r| r.contains(" lag=pg-1:"))
    });
    let fields: Vec<&str> = primary_report.split(' ').collect();
    assert_eq!(
        fields[..3],
        ["epoch=1", "role=primary", "timeline=1"],
        "{primary_report}"
    );
    assert!(fields[3].starts_with("lsn=0/"), "{primary_report}");
    let lag: i64 = fields[4]
        .strip_prefix("lag=pg-1:")
        .and_then(|b| b.parse().ok())
        .unwrap_or_else(|| panic!("a lag in bytes: {primary_report}"));
    assert!(lag >= 0, "{primary_report}");
    let standby_report = instances.output("report", "pg-1", standby_port).unwrap();
    assert!(
        standby_report.starts_with("epoch=1 role=standby timeline=1 lsn=0/"),
        "{standby_report}"
    );
    assert_eq!(
        tools.psql(
            standby_port,
            "app",
            APP_PASSWORD,
            "SELECT pg_is_in_recovery()"
        ),
        Ok("t".into())
    );
    assert_eq!(
        tools.psql(
            primary_port,
            "app",
            APP_PASSWORD,
            "SELECT pg_is_in_recovery()"
        ),
        Ok("f".into())
    );
    assert_eq!(
        tools.psql_superuser(
            &primary.socket,
            primary_port,
            "postgres",
            "SELECT application_name, state FROM pg_stat_replication"
        ),
        Ok("pg-1|streaming".into())
    );
    let refused = tools
        .psql(
            standby_port,
            "app",
            APP_PASSWORD,
            "INSERT INTO notes VALUES (3, 'on the standby')",
        )
        .expect_err("the standby must refuse writes");
    assert!(
        refused.contains("cannot execute INSERT in a read-only transaction"),
        "{refused}"
    );

    // A restarted primary takes the password from the environment (the Secret), and
    // the standby reconnects and streams again. Its data directory comes back group
    // writable, as the kubelet leaves a volume for the Pod's fsGroup: the entrypoint sets
    // the mode PostgreSQL insists on back.
    primary.stop();
    {
        use std::os::unix::fs::PermissionsExt;
        let pgdata = primary
            .data_dirs
            .iter()
            .find(|dir| dir.join("PG_VERSION").exists())
            .expect("the primary's data directory");
        fs::set_permissions(pgdata, fs::Permissions::from_mode(0o2770)).unwrap();
    }
    let primary = instances.start("restarted primary", "pg-0", primary_port, NEW_APP_PASSWORD);
    assert!(
        tools
            .psql(primary_port, "app", APP_PASSWORD, "SELECT 1")
            .is_err(),
        "the old password is gone"
    );
    tools
        .psql(
            primary_port,
            "app",
            NEW_APP_PASSWORD,
            "INSERT INTO notes VALUES (3, 'after a restart')",
        )
        .expect("the new password works");
    eventually("row 3 on the standby", || {
        tools
            .psql(
                standby_port,
                "app",
                NEW_APP_PASSWORD,
                "SELECT note FROM notes WHERE id = 3",
            )
            .ok()
            .filter(|n| n == "after a restart")
    });
    for server in [&primary, &standby] {
        let log = server.log();
        for secret in [APP_PASSWORD, NEW_APP_PASSWORD, REPLICATION_PASSWORD] {
            assert!(
                !log.contains(secret),
                "a password is in the {} log:\n{log}",
                server.name
            );
        }
    }

    // Three dumps, keeping two: the oldest goes, no partial file stays.
    let dumps = tools.dir(&root.join("dumps"));
    let mut written = Vec::new();
    for _ in 0..3 {
        let out = tools
            .unprivileged("bash")
            .arg(scripts_dir.join(scripts::DUMP_FILE))
            .env("DUMP_HOST", "127.0.0.1")
            .env("DUMP_PORT", primary_port.to_string())
            .env("APP_USER", "app")
            .env("APP_PASSWORD", NEW_APP_PASSWORD)
            .env("APP_DATABASE", "app")
            .env("DUMP_DIR", &dumps)
            .env("DUMP_PREFIX", "pg")
            .env("DUMP_KEEP", "2")
            .output()
            .unwrap();
        let log = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "dump.sh failed: {log}");
        assert!(
            !log.contains(NEW_APP_PASSWORD),
            "the password is in the dump log: {log}"
        );
        written.push(dump_files(&dumps).last().cloned().unwrap());
        // Dumps are named by the second.
        std::thread::sleep(Duration::from_millis(1100));
    }
    let kept = dump_files(&dumps);
    assert_eq!(
        kept,
        written[1..],
        "the newest two dumps are kept, nothing else"
    );
    assert!(
        kept.iter().all(|n| n.starts_with("pg-")
            && n.ends_with("Z.dump")
            && n.len() == "pg-20260101T000000Z.dump".len()),
        "{kept:?}"
    );

    // An empty server, made with plain initdb, restores the newest dump.
    let home = tools.dir(&root.join("restore"));
    let socket = tools.dir(&home.join("socket"));
    let pgdata = home.join("pgdata");
    let init = tools
        .unprivileged("initdb")
        .arg("-D")
        .arg(&pgdata)
        .args(["-U", "postgres", "--auth=trust", "--encoding=UTF8"])
        .output()
        .unwrap();
    assert!(
        init.status.success(),
        "initdb: {}",
        String::from_utf8_lossy(&init.stderr)
    );
    let mut cmd = tools.unprivileged("postgres");
    cmd.arg("-D")
        .arg(&pgdata)
        .args([
            "-p",
            &restore_port.to_string(),
            "-c",
            "listen_addresses=127.0.0.1",
        ])
        .arg("-c")
        .arg(format!("unix_socket_directories={}", socket.display()));
    let mut restore = Server::spawn(
        "restore server",
        cmd,
        restore_port,
        socket.clone(),
        &pgdata,
        home.join("log"),
    );
    restore.wait_ready(&tools);
    tools
        .psql_superuser(
            &socket,
            restore_port,
            "postgres",
            "CREATE DATABASE restored",
        )
        .unwrap();
    let restored = tools
        .command("pg_restore")
        .args(["--no-owner", "--no-acl", "--exit-on-error", "-h"])
        .arg(&socket)
        .args([
            "-p",
            &restore_port.to_string(),
            "-U",
            "postgres",
            "-d",
            "restored",
        ])
        .arg(dumps.join(kept.last().unwrap()))
        .output()
        .unwrap();
    assert!(
        restored.status.success(),
        "pg_restore: {}",
        String::from_utf8_lossy(&restored.stderr)
    );
    assert_eq!(
        tools.psql_superuser(
            &socket,
            restore_port,
            "restored",
            "SELECT id, note FROM notes ORDER BY id"
        ),
        Ok("1|before the standby existed\n2|streamed\n3|after a restart".into())
    );
}

/// A scratch directory the servers' user can enter, and the scripts in it.
fn workspace(tools: &Toolbox) -> (tempfile::TempDir, PathBuf, PathBuf) {
    let tmp = match tools.run_as {
        Some(_) => tempfile::Builder::new()
            .prefix("capstan-pg-")
            .tempdir_in("/tmp"),
        None => tempfile::Builder::new().prefix("capstan-pg-").tempdir(),
    }
    .unwrap();
    let root = tools.dir(tmp.path());
    let scripts_dir = root.join("scripts");
    fs::create_dir(&scripts_dir).unwrap();
    fs::write(
        scripts_dir.join(scripts::ENTRYPOINT_FILE),
        scripts::ENTRYPOINT,
    )
    .unwrap();
    (tmp, root, scripts_dir)
}

impl Toolbox {
    /// Whether the server on `port` is a standby; none when it does not answer.
    fn in_recovery(&self, port: u16) -> Option<bool> {
        self.psql(port, "app", APP_PASSWORD, "SELECT pg_is_in_recovery()")
            .ok()
            .map(|r| r == "t")
    }

    /// The standbys streaming from the primary on `port`: `name:state:sync_state`, sorted.
    fn replication(&self, server: &Server) -> String {
        self.psql_superuser(
            &server.socket,
            server.port,
            "postgres",
            "SELECT string_agg(application_name || ':' || state || ':' || sync_state, ',' \
             ORDER BY application_name) FROM pg_stat_replication",
        )
        .unwrap_or_default()
    }

    /// The ids in `acked` on the server on `port`, in order.
    fn acked(&self, port: u16) -> Result<Vec<i32>, String> {
        let out = self.psql(
            port,
            "app",
            APP_PASSWORD,
            "SELECT id FROM acked ORDER BY id",
        )?;
        Ok(out.lines().map(|l| l.parse().unwrap()).collect())
    }

    /// Inserts `id` through the server on `port`; true when the commit was acknowledged
    /// within `within`. A commit still waiting then is abandoned (its client is killed),
    /// so it was never acknowledged.
    fn insert_acked(&self, port: u16, id: i32, within: Duration) -> bool {
        let mut child = self
            .command("psql")
            .args(["-X", "-q", "-v", "ON_ERROR_STOP=1", "-h", "127.0.0.1"])
            .args(["-p", &port.to_string(), "-U", "app", "-d", "app", "-c"])
            .arg(format!("INSERT INTO acked VALUES ({id})"))
            .env("PGPASSWORD", APP_PASSWORD)
            .env("PGCONNECT_TIMEOUT", "2")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status.success();
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Three instances with synchronous replication (one standby confirms each commit):
/// the primary crashes and the plugin names a standby, which promotes with every
/// acknowledged row; the deposed primary comes back while its topology is stale, serves
/// as a primary whose writes are never acknowledged, then steps down, rewinds and
/// follows; a switchover hands the primary role back; an older epoch is ignored.
#[test]
fn failover_switchover_and_rejoin_lose_no_acknowledged_commit() {
    let tools = Toolbox::find();
    let began = Instant::now();
    let phase = |what: &str| eprintln!("{:>6.1?} {what}", began.elapsed());
    let (_tmp, root, scripts_dir) = workspace(&tools);
    let instances = Instance {
        tools: &tools,
        scripts: &scripts_dir,
        root: &root,
    };
    let ports = [free_port(), free_port(), free_port()];
    let all = ["pg-0", "pg-1", "pg-2"];
    let mut topology = Topology {
        epoch: 1,
        primary: "pg-0",
        synchronous: 1,
        members: all.iter().copied().zip(ports).collect(),
    };
    instances.publish(&topology, &all);
    let mut pg0 = instances.start_restarting("pg-0", "pg-0", ports[0]);
    pg0.wait_ready(&tools);
    let mut pg1 = instances.start_restarting("pg-1", "pg-1", ports[1]);
    pg1.wait_ready(&tools);
    let mut pg2 = instances.start_restarting("pg-2", "pg-2", ports[2]);
    pg2.wait_ready(&tools);
    eventually("both standbys stream to pg-0 as a quorum of one", || {
        (tools.replication(&pg0) == "pg-1:streaming:quorum,pg-2:streaming:quorum").then_some(())
    });
    tools
        .psql(
            ports[0],
            "app",
            APP_PASSWORD,
            "CREATE TABLE acked (id int PRIMARY KEY)",
        )
        .unwrap();
    let mut acked: Vec<i32> = Vec::new();
    for id in 1..=20 {
        assert!(
            tools.insert_acked(ports[0], id, WAIT),
            "insert {id} on pg-0"
        );
        acked.push(id);
    }

    // pg-1 falls behind (pg-0's WAL sender to it is stopped): the next commits are
    // confirmed by pg-2 alone, and only pg-2 has them.
    let sender = tools
        .psql_superuser(
            &pg0.socket,
            ports[0],
            "postgres",
            "SELECT pid FROM pg_stat_replication WHERE application_name = 'pg-1'",
        )
        .unwrap();
    assert!(!sender.is_empty(), "pg-0 has a WAL sender to pg-1");
    signal("STOP", &sender);
    for id in 21..=25 {
        assert!(
            tools.insert_acked(ports[0], id, WAIT),
            "insert {id} on pg-0"
        );
        acked.push(id);
    }
    phase("three instances streaming, 25 rows acknowledged, pg-1 behind");
    // Failover: pg-0 crashes for good and the plugin names pg-1, the standby that is
    // behind: it catches up with pg-2 before it promotes. pg-0's own copy of the
    // topology stays at epoch 1, as a dead node's kubelet never updates it.
    pg0.crash();
    // Backends leave the server's process group (setsid), and a stopped one would
    // outlive the crash.
    signal("KILL", &sender);
    topology.epoch = 2;
    topology.primary = "pg-1";
    let named = Instant::now();
    instances.publish(&topology, &["pg-1", "pg-2"]);
    eventually("pg-1 promoted", || {
        (tools.in_recovery(ports[1]) == Some(false)).then_some(())
    });
    assert!(
        tools.insert_acked(ports[1], 26, WAIT),
        "pg-1 takes writes, confirmed by pg-2"
    );
    acked.push(26);
    eprintln!(
        "failover: pg-1 took writes {:?} after it was named",
        named.elapsed()
    );
    assert_eq!(
        tools.acked(ports[1]),
        Ok(acked.clone()),
        "every acknowledged row is on pg-1"
    );
    eventually("pg-2 streams from pg-1", || {
        (tools.replication(&pg1) == "pg-2:streaming:quorum").then_some(())
    });

    phase("failover done");
    // The deposed primary comes back before its kubelet updated its topology: it serves
    // as the primary of epoch 1 but cannot have a commit acknowledged, since no standby
    // follows it any more.
    let mut pg0 = instances.start_restarting("pg-0 deposed", "pg-0", ports[0]);
    pg0.wait_ready(&tools);
    assert_eq!(
        tools.in_recovery(ports[0]),
        Some(false),
        "pg-0 resumed as the epoch-1 primary"
    );
    assert!(
        !tools.insert_acked(ports[0], 1000, Duration::from_secs(5)),
        "a deposed primary acknowledged a commit"
    );
    phase("deposed primary refused to acknowledge");
    // Its topology catches up: it steps down, rewinds onto pg-1's timeline and follows.
    instances.publish(&topology, &["pg-0"]);
    eventually("pg-0 and pg-2 stream from pg-1", || {
        (tools.replication(&pg1) == "pg-0:streaming:quorum,pg-2:streaming:quorum").then_some(())
    });
    assert!(tools.insert_acked(ports[1], 27, WAIT));
    acked.push(27);
    eventually("pg-0 has every acknowledged row and nothing else", || {
        (tools.acked(ports[0]).ok()? == acked).then_some(())
    });
    assert!(
        pg0.log().contains("rewinding onto the timeline of pg-1"),
        "{}",
        pg0.log()
    );
    assert!(
        pg1.log().contains("catching up with pg-2"),
        "pg-1 promoted without catching up:\n{}",
        pg1.log()
    );

    phase("deposed primary rejoined");
    // Switchover back to pg-0: pg-1 steps down cleanly, pg-0 promotes.
    topology.epoch = 3;
    topology.primary = "pg-0";
    let named = Instant::now();
    instances.publish(&topology, &all);
    let mut id = 28;
    while !tools.insert_acked(ports[0], id, Duration::from_secs(2)) {
        assert!(
            named.elapsed() < WAIT,
            "pg-0 never took writes:\n{}",
            pg0.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    acked.push(id);
    eprintln!(
        "switchover: pg-0 took writes {:?} after it was named",
        named.elapsed()
    );
    id += 1;
    assert!(tools.insert_acked(ports[0], id, WAIT));
    acked.push(id);
    eventually("pg-1 and pg-2 stream from pg-0", || {
        (tools.replication(&pg0) == "pg-1:streaming:quorum,pg-2:streaming:quorum").then_some(())
    });
    for port in ports {
        eventually("every instance has every acknowledged row", || {
            (tools.acked(port).ok()? == acked).then_some(())
        });
    }

    phase("switchover done");
    // An older epoch, however it reads, changes nothing.
    instances.publish(
        &Topology {
            epoch: 2,
            primary: "pg-2",
            ..topology.clone()
        },
        &["pg-2"],
    );
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        tools.in_recovery(ports[2]),
        Some(true),
        "pg-2 took an old epoch"
    );
    assert_eq!(
        tools.replication(&pg0),
        "pg-1:streaming:quorum,pg-2:streaming:quorum"
    );

    // A switchover while pg-2 is down: pg-0 steps down and, until pg-1 serves, stays a
    // standby of nothing, which pg-1 counts (it follows the new epoch) and may catch up
    // from; then pg-0 rewinds and follows pg-1.
    phase("an older epoch ignored");
    pg2.stop();
    topology.epoch = 4;
    topology.primary = "pg-1";
    instances.publish(&topology, &["pg-0", "pg-1"]);
    eventually("pg-1 promoted with pg-2 down", || {
        (tools.in_recovery(ports[1]) == Some(false)).then_some(())
    });
    eventually("pg-0 streams from pg-1", || {
        (tools.replication(&pg1) == "pg-0:streaming:quorum").then_some(())
    });
    id += 1;
    assert!(tools.insert_acked(ports[1], id, WAIT), "confirmed by pg-0");
    acked.push(id);
    assert!(
        pg0.log()
            .contains("starting the deposed primary pg-0 detached"),
        "{}",
        pg0.log()
    );
    // pg-2 comes back, with the topology its kubelet shows it now.
    instances.publish(&topology, &["pg-2"]);
    let pg2 = instances.start_restarting("pg-2 again", "pg-2", ports[2]);
    eventually("pg-0 and pg-2 stream from pg-1", || {
        (tools.replication(&pg1) == "pg-0:streaming:quorum,pg-2:streaming:quorum").then_some(())
    });
    for port in ports {
        eventually("every instance has every acknowledged row", || {
            (tools.acked(port).ok()? == acked).then_some(())
        });
    }
    phase("switchover with a standby down done");

    for server in [&pg0, &pg1, &pg2] {
        let log = server.log();
        for secret in [APP_PASSWORD, REPLICATION_PASSWORD] {
            assert!(
                !log.contains(secret),
                "a password is in the {} log",
                server.name
            );
        }
    }
    drop(pg2);
    pg1.stop();
    pg0.stop();
}

/// A primary that starts again on its data first sets its roles and passwords on a
/// maintenance server, stops it and starts the real one. Its readiness probe must fail
/// until the real one serves: once the probe passes, postgres answers for good (the
/// end-to-end test saw a Pod Ready whose server then said "the database system is
/// starting up").
#[test]
fn a_restarting_primary_is_ready_only_once_it_serves_for_good() {
    let tools = Toolbox::find();
    let (_tmp, root, scripts_dir) = workspace(&tools);
    let instances = Instance {
        tools: &tools,
        scripts: &scripts_dir,
        root: &root,
    };
    let port = free_port();
    let topology = Topology {
        epoch: 1,
        primary: "pg-0",
        synchronous: 0,
        members: vec![("pg-0", port)],
    };
    instances.publish(&topology, &["pg-0"]);
    let mut first = instances.start("first start", "pg-0", port, APP_PASSWORD);
    assert!(instances.probe("ready", "pg-0", port), "{}", first.log());
    first.stop();
    assert!(
        !instances.probe("ready", "pg-0", port),
        "stopped, yet ready"
    );

    // The kubelet probes every second; here as fast as the probe runs, so that a pass
    // during the maintenance server's short life is caught.
    let mut again = instances.spawn("second start", "pg-0", port, APP_PASSWORD, false);
    let deadline = Instant::now() + WAIT;
    while !instances.probe("ready", "pg-0", port) {
        assert!(
            Instant::now() < deadline,
            "not ready within {WAIT:?}: {}",
            again.log()
        );
        assert!(
            again.child.try_wait().unwrap().is_none(),
            "the entrypoint exited: {}",
            again.log()
        );
    }
    let ready_at = Instant::now();
    while ready_at.elapsed() < Duration::from_secs(3) {
        assert!(
            instances.probe("ready", "pg-0", port),
            "ready, then not ready {:?} later: the probe passed before the server that \
             stays; the entrypoint's log:\n{}",
            ready_at.elapsed(),
            again.log()
        );
    }
    assert_eq!(tools.in_recovery(port), Some(false), "{}", again.log());
    again.stop();
}
