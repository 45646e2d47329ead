//! Per-plugin limits: a small TOML file beside the plugin (`NAME.toml` beside
//! `NAME.wasm`) may set a plugin's deadline, memory cap, concurrency and CPU share,
//! within what the sandbox was sized for; what it leaves out comes from the flags. Its
//! `[grant]` table is what the administrator allows the plugin in the cluster
//! ([`crate::grant`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use super::cpu::CpuBudget;
use super::engine::SandboxConfig;

/// What a limits file may say. Every field is optional: absent, the sandbox's value.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct LimitsFile {
    /// Wall-clock limit of one call, in milliseconds (as `--plugin-timeout-ms`).
    pub timeout_ms: Option<u64>,
    /// Linear-memory limit of one instance, in MiB; at most `--plugin-memory-mib`, the
    /// size of the pool's slots.
    pub memory_mib: Option<usize>,
    /// Calls of this plugin running at once; more wait (outside their deadline).
    pub concurrency: Option<u32>,
    /// CPU the plugin's calls may use together, in cores (as `--plugin-cpu`).
    pub cpu: Option<f64>,
    /// What the plugin may touch beyond the safe defaults (none: the defaults).
    pub grant: Option<crate::grant::Grant>,
}

/// Why a limits file was not applied.
#[derive(Debug, thiserror::Error)]
pub enum LimitsError {
    /// The file exists but cannot be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// It is not valid TOML, or has a field that is not a limit.
    #[error("{path} is not a limits file: {reason}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message, on one line.
        reason: String,
    },
    /// A value is out of range.
    #[error("{path}: {reason}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// Which value, and its range.
        reason: String,
    },
}

/// The limits file of the plugin at `wasm`: the same name, `.toml`.
pub fn file_of(wasm: &Path) -> PathBuf {
    wasm.with_extension("toml")
}

/// Reads and checks the limits file of the plugin at `wasm` against the sandbox's
/// `config`. `Ok(None)` when there is none.
pub fn read(wasm: &Path, config: &SandboxConfig) -> Result<Option<LimitsFile>, LimitsError> {
    let path = file_of(wasm);
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(LimitsError::Read { path, source }),
    };
    parse(&text, config).map(Some).map_err(|e| match e {
        Problem::Parse(reason) => LimitsError::Parse { path, reason },
        Problem::Invalid(reason) => LimitsError::Invalid { path, reason },
    })
}

enum Problem {
    Parse(String),
    Invalid(String),
}

fn parse(text: &str, config: &SandboxConfig) -> Result<LimitsFile, Problem> {
    let file: LimitsFile = toml::from_str(text).map_err(|e| {
        Problem::Parse(
            e.message()
                .lines()
                .next()
                .unwrap_or_default()
                .trim()
                .to_string()
                + &e.span()
                    .map(|s| format!(" (at byte {})", s.start))
                    .unwrap_or_default(),
        )
    })?;
    let pool_mib = config.memory_limit >> 20;
    if file.timeout_ms == Some(0) {
        return Err(Problem::Invalid("timeout-ms must be at least 1".into()));
    }
    if let Some(mib) = file.memory_mib
        && !(1..=pool_mib).contains(&mib)
    {
        return Err(Problem::Invalid(format!(
            "memory-mib = {mib} is outside 1..={pool_mib} (the pool's slots are --plugin-memory-mib {pool_mib} MiB)"
        )));
    }
    if file.concurrency == Some(0) {
        return Err(Problem::Invalid("concurrency must be at least 1".into()));
    }
    if let Some(cpu) = file.cpu
        && !(cpu.is_finite() && cpu >= MIN_CPU)
    {
        return Err(Problem::Invalid(format!(
            "cpu = {cpu} must be at least {MIN_CPU} (cores)"
        )));
    }
    Ok(file)
}

/// The smallest CPU share: a hundredth of a core.
pub const MIN_CPU: f64 = 0.01;

/// The limits one plugin's calls run under, resolved against the sandbox's defaults.
#[derive(Debug)]
pub struct Limits {
    /// Wall-clock limit of one call.
    pub deadline: Duration,
    /// Linear-memory limit of one instance, in bytes.
    pub memory_limit: usize,
    /// Calls at once, if limited by the plugin's file.
    pub concurrency: Option<Arc<tokio::sync::Semaphore>>,
    /// The CPU share, if any.
    pub cpu: Option<Arc<CpuBudget>>,
    /// What the file said (empty without one).
    pub file: LimitsFile,
}

impl Limits {
    /// `file` over the sandbox's `config`.
    pub fn resolve(config: &SandboxConfig, file: LimitsFile) -> Self {
        let cpu = file.cpu.or(config.cpu);
        Limits {
            deadline: file
                .timeout_ms
                .map_or(config.deadline, Duration::from_millis),
            memory_limit: file.memory_mib.map_or(config.memory_limit, |mib| mib << 20),
            concurrency: file
                .concurrency
                .map(|n| Arc::new(tokio::sync::Semaphore::new(n as usize))),
            cpu: cpu.map(|cores| Arc::new(CpuBudget::new(cores))),
            file,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> SandboxConfig {
        SandboxConfig {
            memory_limit: 64 << 20,
            cpu: Some(1.0),
            ..SandboxConfig::default()
        }
    }

    fn problem(text: &str) -> String {
        match parse(text, &config()) {
            Ok(f) => panic!("accepted: {f:?}"),
            Err(Problem::Parse(m) | Problem::Invalid(m)) => m,
        }
    }

    #[test]
    fn a_file_sets_what_it_names_and_the_flags_the_rest() {
        let file = parse("timeout-ms = 300\ncpu = 0.25\n", &config())
            .ok()
            .unwrap();
        let limits = Limits::resolve(&config(), file);
        assert_eq!(limits.deadline, Duration::from_millis(300));
        assert_eq!(limits.memory_limit, 64 << 20);
        assert!(limits.concurrency.is_none());
        assert_eq!(limits.cpu.as_ref().unwrap().cores(), 0.25);

        let all =
            "# comments are fine\ntimeout-ms = 50\nmemory-mib = 16\nconcurrency = 2\ncpu = 2\n";
        let limits = Limits::resolve(&config(), parse(all, &config()).ok().unwrap());
        assert_eq!(limits.memory_limit, 16 << 20);
        assert_eq!(limits.concurrency.unwrap().available_permits(), 2);

        let none = Limits::resolve(&config(), LimitsFile::default());
        assert_eq!(none.deadline, config().deadline);
        assert_eq!(none.cpu.unwrap().cores(), 1.0);
    }

    #[test]
    fn a_bad_file_says_what_is_wrong_in_one_line() {
        for (text, expected) in [
            (
                "timeout-ms = \"fast\"",
                "invalid type: string \"fast\", expected u64",
            ),
            ("timeout = 300", "unknown field `timeout`"),
            ("timeout-ms = 300\ntimeout-ms = 400", "duplicate key"),
            ("memory-mib = 128", "memory-mib = 128 is outside 1..=64"),
            ("concurrency = 0", "concurrency must be at least 1"),
            ("cpu = 0", "cpu = 0 must be at least 0.01"),
            ("timeout-ms = 0", "timeout-ms must be at least 1"),
            ("[[", "invalid"),
        ] {
            let message = problem(text);
            assert!(message.contains(expected), "{text:?}: {message}");
            assert_eq!(message.lines().count(), 1, "{message}");
        }
    }

    #[test]
    fn the_file_is_found_beside_the_plugin_and_may_be_absent() {
        let dir = tempfile::tempdir().unwrap();
        let wasm = dir.path().join("widget.wasm");
        assert_eq!(file_of(&wasm), dir.path().join("widget.toml"));
        assert!(read(&wasm, &config()).unwrap().is_none());
        std::fs::write(dir.path().join("widget.toml"), "concurrency = 3").unwrap();
        assert_eq!(
            read(&wasm, &config()).unwrap().unwrap().concurrency,
            Some(3)
        );
        std::fs::write(dir.path().join("widget.toml"), "concurrency = -3").unwrap();
        let err = read(&wasm, &config()).unwrap_err().to_string();
        assert!(
            err.starts_with(&format!(
                "{} is not a limits file",
                dir.path().join("widget.toml").display()
            )),
            "{err}"
        );
    }
}
