//! Benchmarks of Capstan against a real local control plane, run by `cargo xtask bench`
//! (`docs/performance.md` has the figures and what bounds each). The driver
//! (`capstan-bench`) creates parents, starts the operator under test and watches until
//! they converged, measuring time, CPU and memory of the operator from `/proc`; the
//! native controller (`native-uuid`, [`native`]) is the baseline for the Uuid plugin.
//!
//! Nothing here asserts a speed: `--quick` (run by `cargo xtask test`) only checks that
//! every scenario converges.
#![forbid(unsafe_code)]

pub mod native;
pub mod objects;
pub mod process;
pub mod procfs;
pub mod report;
pub mod requests;
pub mod scenarios;

use std::path::PathBuf;
use std::time::Duration;

/// Why a benchmark could not be measured.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The API server refused or failed a request of the benchmark itself.
    #[error("{action}: {source}")]
    Api {
        /// What the benchmark was doing.
        action: String,
        /// The client's error.
        #[source]
        source: kube::Error,
    },
    /// The operator under test exited.
    #[error("the operator exited ({status}); log {}:\n{tail}", log.display())]
    Exited {
        /// Its exit status.
        status: String,
        /// Its log file.
        log: PathBuf,
        /// The end of the log.
        tail: String,
    },
    /// Something did not converge in time.
    #[error("timed out after {after:?} waiting for {what} ({reached} reached)")]
    Timeout {
        /// What was awaited.
        what: String,
        /// The time limit.
        after: Duration,
        /// How many made it.
        reached: usize,
    },
    /// Preparing a measurement failed (files, processes, the first list of a watch).
    #[error("{0}")]
    Setup(String),
}

impl Error {
    fn api(action: impl Into<String>, source: kube::Error) -> Self {
        Error::Api {
            action: action.into(),
            source,
        }
    }
}

/// The result type of the benchmarks.
pub type Result<T, E = Error> = std::result::Result<T, E>;
