//! The real node's own cgroup, `/capstan-<id>`, in every hierarchy of the machine: the
//! node's processes start in `/capstan-<id>/node`, the kubelet puts pods under
//! `/capstan-<id>/kubepods` (its `cgroupRoot`), and so `down` finds every process of the
//! node, containers and shims included, and removes the cgroups after them.

use std::{
    fs,
    path::{Path, PathBuf},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

use super::process::signal_all;

/// The node's cgroup (relative to each hierarchy's root) in every hierarchy.
#[derive(Debug, Clone)]
pub struct NodeCgroup {
    /// `/capstan-<id>`: the kubelet's `cgroupRoot`.
    pub root: String,
    hierarchies: Vec<PathBuf>,
}

impl NodeCgroup {
    /// The cgroup `/capstan-<id>` in each hierarchy mounted on this machine.
    pub fn new(id: &str) -> Result<Self> {
        let hierarchies = hierarchies()?;
        if hierarchies.is_empty() {
            bail!("no cgroup hierarchy is mounted");
        }
        Ok(Self {
            root: format!("/capstan-{id}"),
            hierarchies,
        })
    }

    fn dirs(&self, sub: &str) -> impl Iterator<Item = PathBuf> + '_ {
        let rel = format!("{}{sub}", self.root.trim_start_matches('/'));
        self.hierarchies.iter().map(move |h| h.join(&rel))
    }

    /// Makes `/capstan-<id>` and `/capstan-<id>/node` everywhere (cpuset ones get their
    /// parent's CPUs and memory nodes, which v1 cpusets start without).
    pub fn create(&self) -> Result<()> {
        for sub in ["", "/node"] {
            for dir in self.dirs(sub) {
                fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
                for file in ["cpuset.cpus", "cpuset.mems"] {
                    let own = dir.join(file);
                    let parent = dir.parent().map(|p| p.join(file));
                    if let (true, Some(parent)) = (own.exists(), parent) {
                        let value = fs::read_to_string(&parent).unwrap_or_default();
                        if fs::read_to_string(&own)
                            .unwrap_or_default()
                            .trim()
                            .is_empty()
                        {
                            fs::write(&own, value.trim())
                                .with_context(|| format!("write {}", own.display()))?;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// `cgroup.procs` of `/capstan-<id>/node` in every hierarchy: a process that writes
    /// its PID into each is the node's.
    pub fn node_procs_files(&self) -> Vec<PathBuf> {
        self.dirs("/node").map(|d| d.join("cgroup.procs")).collect()
    }

    /// The node's top cgroup directories that exist, in every hierarchy.
    pub fn existing(&self) -> Vec<String> {
        self.dirs("")
            .filter(|d| d.is_dir())
            .map(|d| d.display().to_string())
            .collect()
    }

    /// Whether any of the node's cgroups exist.
    pub fn exists(&self) -> bool {
        self.dirs("").any(|d| d.is_dir())
    }

    /// Every process in the node's cgroups, in any hierarchy.
    pub fn pids(&self) -> Vec<u32> {
        let mut pids = Vec::new();
        for dir in self.dirs("") {
            for cgroup in subtree(&dir) {
                let procs = fs::read_to_string(cgroup.join("cgroup.procs")).unwrap_or_default();
                pids.extend(procs.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
            }
        }
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    /// Kills every process of the node (frozen first where a freezer exists, so that
    /// none forks away meanwhile) and removes the cgroups, deepest first.
    pub fn kill_and_remove(&self) -> Result<()> {
        if !self.exists() {
            return Ok(());
        }
        let freezer = self.dirs("").find(|d| d.join("freezer.state").exists());
        if let Some(freezer) = &freezer {
            let _ = fs::write(freezer.join("freezer.state"), "FROZEN");
            wait_until(Duration::from_secs(5), || {
                fs::read_to_string(freezer.join("freezer.state"))
                    .is_ok_and(|s| s.trim() != "FREEZING")
            });
        }
        signal_all(&self.pids(), "KILL")?;
        if let Some(freezer) = &freezer {
            let _ = fs::write(freezer.join("freezer.state"), "THAWED");
        }
        // Killed processes leave their cgroups once they are reaped; new ones cannot come.
        let empty = wait_until(Duration::from_secs(15), || {
            let left = self.pids();
            if !left.is_empty() {
                let _ = signal_all(&left, "KILL");
            }
            left.is_empty()
        });
        if !empty {
            bail!(
                "processes {:?} of the node's cgroup {} survived SIGKILL",
                self.pids(),
                self.root
            );
        }
        for dir in self.dirs("") {
            let mut cgroups = subtree(&dir);
            // Children before parents.
            cgroups.sort_by_key(|c| std::cmp::Reverse(c.components().count()));
            for cgroup in cgroups {
                let removed = wait_until(Duration::from_secs(5), || {
                    fs::remove_dir(&cgroup).is_ok() || !cgroup.exists()
                });
                if !removed {
                    bail!("cannot remove the cgroup {}", cgroup.display());
                }
            }
        }
        Ok(())
    }
}

/// The cgroup hierarchies mounted on this machine (v1 ones and the unified one), from
/// `/proc/self/mountinfo`.
fn hierarchies() -> Result<Vec<PathBuf>> {
    let mountinfo = fs::read_to_string("/proc/self/mountinfo").context("read mountinfo")?;
    let mut found: Vec<PathBuf> = mountinfo
        .lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let fstype = right.split_whitespace().next()?;
            let mount_point = left.split_whitespace().nth(4)?;
            matches!(fstype, "cgroup" | "cgroup2").then(|| PathBuf::from(mount_point))
        })
        .collect();
    found.sort();
    found.dedup();
    Ok(found)
}

/// `dir` and every cgroup below it.
fn subtree(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(entry.path());
            }
        }
        out.push(dir);
    }
    out
}

fn wait_until(timeout: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if done() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        thread::sleep(Duration::from_millis(50));
    }
}
