//! What a process costs, from `/proc`: CPU seconds (user + system) and memory (resident
//! now, and the peak resident set, `VmHWM`).

use std::path::Path;
use std::sync::OnceLock;

use serde::Serialize;

/// One reading of a process.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Usage {
    /// utime + stime, in seconds.
    pub cpu_seconds: f64,
    /// VmRSS, in MiB.
    pub rss_mib: f64,
    /// VmHWM (peak resident set), in MiB.
    pub peak_rss_mib: f64,
}

/// Reads process `pid`; `None` when it is gone or `/proc` is not there.
pub fn usage(pid: u32) -> Option<Usage> {
    let proc = Path::new("/proc").join(pid.to_string());
    let stat = std::fs::read_to_string(proc.join("stat")).ok()?;
    // The command name (field 2) may hold spaces: the fields after it start past ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name.
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    let status = std::fs::read_to_string(proc.join("status")).ok()?;
    let kib = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    Some(Usage {
        cpu_seconds: ticks as f64 / clock_ticks(),
        rss_mib: kib("VmRSS:") / 1024.0,
        peak_rss_mib: kib("VmHWM:") / 1024.0,
    })
}

/// The PID of a process whose command line contains `needle` (the first found): the
/// control plane's processes, which the benchmark did not start but reads.
pub fn find_process(needle: &str) -> Option<u32> {
    find_process_with(needle).map(|(pid, _)| pid)
}

/// Like [`find_process`], with the command line (arguments separated by spaces).
pub fn find_process_with(needle: &str) -> Option<(u32, String)> {
    let entries = std::fs::read_dir("/proc").ok()?;
    entries.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        cmdline.contains(needle).then_some((pid, cmdline))
    })
}

/// The machine's 1-minute load average.
pub fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

/// Online CPUs.
pub fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// `getconf CLK_TCK` (100 on every Linux this runs on; asked once in case it is not).
fn clock_ticks() -> f64 {
    static TICKS: OnceLock<f64> = OnceLock::new();
    *TICKS.get_or_init(|| {
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
            .unwrap_or(100.0)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process() {
        let u = usage(std::process::id()).unwrap();
        assert!(u.rss_mib > 0.0 && u.peak_rss_mib >= u.rss_mib, "{u:?}");
    }
}
