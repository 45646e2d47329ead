//! Why the sandbox could not be set up, a plugin file not loaded, or a call not answered.

use std::path::PathBuf;
use std::time::Duration;

use super::bindings::CONTRACT_VERSION;

/// Why a plugin file could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not a WebAssembly component (a core module, or not wasm at all).
    #[error("{path} is not a WebAssembly component: {reason}")]
    NotComponent {
        /// The file.
        path: PathBuf,
        /// What it is instead.
        reason: String,
    },
    /// The component does not implement a contract release this host runs.
    #[error("{path} does not implement capstan:plugin@{CONTRACT_VERSION} (nor 0.1.0): {reason}")]
    Contract {
        /// The file.
        path: PathBuf,
        /// What does not match.
        reason: String,
    },
    /// The component failed to compile or link.
    #[error("cannot compile {path}: {reason}")]
    Compile {
        /// The file.
        path: PathBuf,
        /// The compiler's message.
        reason: String,
    },
    /// `describe` failed or returned an invalid declaration.
    #[error("{path}: describe failed: {reason}")]
    Describe {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
}

/// Why the sandbox could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// The pooling allocator could not reserve its instance slots (address space or
    /// memory limits of the process).
    #[error(
        "cannot reserve the plugin instance pool ({instances} instances of up to {memory_mib} MiB): {reason}"
    )]
    Pool {
        /// Instances asked for.
        instances: u32,
        /// Memory cap of one instance, in MiB.
        memory_mib: usize,
        /// The engine's message.
        reason: String,
    },
    /// WASI or the `log` import could not be added to the linker.
    #[error("cannot link the host's imports: {0}")]
    Link(String),
    /// The threads of the call runtime could not be started.
    #[error("cannot start the plugin call runtime")]
    Runtime(#[source] std::io::Error),
}

/// Why a call into a plugin did not return a value. (A plugin's own `error` result is
/// not a `CallError`: it is returned as `Ok(Err(PluginError))`.)
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CallError {
    /// The call ran past the configured deadline and was interrupted.
    #[error("plugin {plugin} ran past its deadline of {deadline:?} and was stopped")]
    Deadline {
        /// Plugin name.
        plugin: String,
        /// The deadline.
        deadline: Duration,
    },
    /// The instance tried to grow its memory beyond the configured cap.
    #[error("plugin {plugin} exceeded its memory cap of {limit_mib} MiB and was stopped")]
    MemoryCap {
        /// Plugin name.
        plugin: String,
        /// The cap in MiB.
        limit_mib: usize,
    },
    /// The plugin panicked (the panic message is what it printed).
    #[error("plugin {plugin} panicked: {message}")]
    Panic {
        /// Plugin name.
        plugin: String,
        /// The panic message.
        message: String,
    },
    /// The plugin trapped for another reason.
    #[error("plugin {plugin} crashed: {message}")]
    Trap {
        /// Plugin name.
        plugin: String,
        /// The trap, without a backtrace.
        message: String,
    },
}

/// The first line of an error chain, without wasm backtraces.
pub(super) fn one_line(err: &wasmtime::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in err.chain() {
        let text = cause.to_string();
        let first = text.lines().next().unwrap_or_default().trim().to_string();
        if first.is_empty() || first.starts_with("error while executing at wasm backtrace") {
            continue;
        }
        if !parts.contains(&first) {
            parts.push(first);
        }
    }
    parts.join(": ")
}
