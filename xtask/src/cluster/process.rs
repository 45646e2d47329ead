//! Detached component processes: starting them, telling whether they still run, and
//! stopping exactly them.
//!
//! A process is known by its PID *and* its start time (from `/proc`), so a PID that the
//! kernel has handed to another program since is never signalled.

use std::{
    fs::{self, File},
    path::Path,
    process::{Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

/// One started component, as recorded in the state directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Process {
    /// Component name, e.g. `kube-apiserver`; also the stem of its log file.
    pub component: String,
    /// Process id.
    pub pid: u32,
    /// Start time in clock ticks since boot (`/proc/PID/stat` field 22).
    pub start_time: u64,
}

impl Process {
    /// Whether this very process is alive: not exited, not a zombie, PID not reused.
    pub fn is_running(&self) -> bool {
        matches!(proc_stat(self.pid), Some((state, start)) if start == self.start_time && !matches!(state, 'Z' | 'X'))
    }

    /// The running process `pid`, known from now on by its start time too; `None` when
    /// there is no such process.
    pub fn observe(component: &str, pid: u32) -> Option<Self> {
        let (_, start_time) = proc_stat(pid)?;
        Some(Self {
            component: component.to_owned(),
            pid,
            start_time,
        })
    }

    /// One line of the state directory's `processes` file.
    pub fn to_record(&self) -> String {
        format!("{} {} {}\n", self.component, self.pid, self.start_time)
    }

    /// Parses a line written by [`Process::to_record`].
    pub fn from_record(line: &str) -> Option<Self> {
        let mut fields = line.split_whitespace();
        let process = Self {
            component: fields.next()?.to_owned(),
            pid: fields.next()?.parse().ok()?,
            start_time: fields.next()?.parse().ok()?,
        };
        fields.next().is_none().then_some(process)
    }

    /// SIGTERM, up to `grace` to exit, then SIGKILL. A process already gone is fine.
    pub fn stop(&self, grace: Duration) -> Result<()> {
        if !self.is_running() {
            return Ok(());
        }
        signal(self.pid, "TERM")?;
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if !self.is_running() {
                return Ok(());
            }
            thread::sleep(Duration::from_millis(100));
        }
        if self.is_running() {
            signal(self.pid, "KILL")?;
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.is_running() {
            if Instant::now() > deadline {
                bail!("{} (pid {}) survived SIGKILL", self.component, self.pid);
            }
            thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }
}

/// Starts `command` in its own process group (so that neither a Ctrl-C at the terminal
/// nor the end of xtask reaches it), with stdin closed and stdout and stderr appended to
/// `log`. It keeps running after xtask returns.
pub fn spawn_detached(component: &str, mut command: Command, log: &Path) -> Result<Process> {
    use std::os::unix::process::CommandExt;

    let log_file = File::options()
        .create(true)
        .append(true)
        .open(log)
        .with_context(|| format!("open {}", log.display()))?;
    let child = command
        .process_group(0)
        .stdin(Stdio::null())
        .stdout(log_file.try_clone()?)
        .stderr(log_file)
        .spawn()
        .with_context(|| format!("start {component} ({:?})", command.get_program()))?;
    let pid = child.id();
    // The child is not waited for: it outlives xtask, and init reaps it. While xtask
    // runs, an exited child is a zombie, which `is_running` counts as gone.
    drop(child);
    let (_, start_time) =
        proc_stat(pid).with_context(|| format!("{component} (pid {pid}) vanished at start"))?;
    Ok(Process {
        component: component.to_owned(),
        pid,
        start_time,
    })
}

/// (state, start time) from `/proc/PID/stat`, or `None` when there is no such process.
fn proc_stat(pid: u32) -> Option<(char, u64)> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    // Field 3 was `state`; field 22 is `starttime`, 19 further on.
    let start_time = fields.nth(18)?.parse().ok()?;
    Some((state, start_time))
}

/// std has no kill(2); the shell's `kill` builtin exists wherever `sh` does. Its exit
/// status is ignored: it fails only when the process is already gone, which is the goal.
pub fn signal(pid: u32, signal: &str) -> Result<()> {
    Command::new("sh")
        .args([
            "-c",
            "kill -s \"$1\" \"$2\" 2>/dev/null",
            "sh",
            signal,
            &pid.to_string(),
        ])
        .status()
        .context("run `sh -c kill`")?;
    Ok(())
}

/// Sends `signal` to every process in `pids` with one `kill` (nothing when empty).
pub fn signal_all(pids: &[u32], signal: &str) -> Result<()> {
    if pids.is_empty() {
        return Ok(());
    }
    let pids: Vec<String> = pids.iter().map(u32::to_string).collect();
    Command::new("sh")
        .args([
            "-c",
            "s=$1; shift; kill -s \"$s\" \"$@\" 2>/dev/null",
            "sh",
            signal,
        ])
        .args(&pids)
        .status()
        .context("run `sh -c kill`")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip() {
        let p = Process {
            component: "etcd".into(),
            pid: 42,
            start_time: 7,
        };
        assert_eq!(Process::from_record(&p.to_record()), Some(p));
        assert_eq!(Process::from_record("etcd 42"), None);
    }

    #[test]
    fn knows_itself_and_not_a_stranger() {
        let pid = std::process::id();
        let (_, start_time) = proc_stat(pid).unwrap();
        let me = Process {
            component: "xtask".into(),
            pid,
            start_time,
        };
        assert!(me.is_running());
        let reused = Process {
            start_time: start_time + 1,
            ..me
        };
        assert!(!reused.is_running());
    }

    #[test]
    fn stops_a_detached_process() {
        let dir = std::env::temp_dir().join(format!("xtask-process-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let mut sleep = Command::new("sleep");
        sleep.arg("60");
        let p = spawn_detached("sleep", sleep, &dir.join("sleep.log")).unwrap();
        assert!(p.is_running());
        p.stop(Duration::from_secs(5)).unwrap();
        assert!(!p.is_running());
        fs::remove_dir_all(dir).unwrap();
    }
}
