//! The per-call store state: WASI with nothing granted, the memory limiter, the captured
//! stdout/stderr, and the host side of the `log` interface.

use wasmtime::ResourceLimiter;
use wasmtime::component::ResourceTable;
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use super::bindings::{Level, LogHost};

/// How much a plugin may print on stdout or stderr in one call; the rest is dropped.
const OUTPUT_CAPACITY: usize = 64 << 10;

/// Everything one call's `Store` holds. Made fresh for every call.
pub struct CallState {
    plugin: String,
    wasi: WasiCtx,
    table: ResourceTable,
    stdout: MemoryOutputPipe,
    stderr: MemoryOutputPipe,
    pub(super) limits: MemoryCap,
}

impl CallState {
    /// State for one call of `plugin`, with `memory_limit` bytes of linear memory.
    pub fn new(plugin: &str, memory_limit: usize) -> Self {
        let stdout = MemoryOutputPipe::new(OUTPUT_CAPACITY);
        let stderr = MemoryOutputPipe::new(OUTPUT_CAPACITY);
        // The builder's defaults grant nothing: no preopens, no env, no args, stdin
        // closed, every socket address denied. Say the network part out loud anyway.
        let wasi = WasiCtx::builder()
            .stdout(stdout.clone())
            .stderr(stderr.clone())
            .allow_tcp(false)
            .allow_udp(false)
            .allow_ip_name_lookup(false)
            .build();
        CallState {
            plugin: plugin.to_string(),
            wasi,
            table: ResourceTable::new(),
            stdout,
            stderr,
            limits: MemoryCap {
                limit: memory_limit,
                exceeded: false,
            },
        }
    }

    /// Whether the instance tried to grow past its memory cap.
    pub fn memory_exceeded(&self) -> bool {
        self.limits.exceeded
    }

    /// What the plugin printed during the call.
    pub fn take_output(&mut self) -> Output {
        Output {
            stdout: String::from_utf8_lossy(&self.stdout.contents()).into_owned(),
            stderr: String::from_utf8_lossy(&self.stderr.contents()).into_owned(),
        }
    }
}

impl WasiView for CallState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

/// The plugin's stdout and stderr of one call.
pub struct Output {
    stdout: String,
    stderr: String,
}

impl Output {
    /// Sends every printed line to the host's log, tagged with the plugin's name.
    pub fn log(&self, plugin: &str) {
        for line in self.stdout.lines().filter(|l| !l.trim().is_empty()) {
            tracing::info!(target: "capstan::plugin", plugin, stream = "stdout", "{line}");
        }
        for line in self.stderr.lines().filter(|l| !l.trim().is_empty()) {
            tracing::info!(target: "capstan::plugin", plugin, stream = "stderr", "{line}");
        }
    }

    /// The message of a Rust panic, as the guest's panic hook printed it to stderr
    /// (`thread '<unnamed>' panicked at src/lib.rs:3:5:\nmessage`).
    pub fn panic_message(&self) -> Option<String> {
        let mut lines = self.stderr.lines();
        while let Some(line) = lines.next() {
            if line.contains("panicked at") {
                let location = line.split("panicked at").nth(1).unwrap_or("").trim();
                let location = location.trim_end_matches(':');
                let message: Vec<&str> = lines
                    .by_ref()
                    .take_while(|l| !l.starts_with("note:"))
                    .collect();
                let message = message.join(" ");
                return Some(if location.is_empty() {
                    message
                } else {
                    format!("{message} (at {location})")
                });
            }
        }
        None
    }
}

/// Caps an instance's linear memory, and remembers that the cap was hit so the host can
/// say so instead of reporting an opaque trap.
pub struct MemoryCap {
    limit: usize,
    exceeded: bool,
}

impl ResourceLimiter for MemoryCap {
    fn memory_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired > self.limit {
            self.exceeded = true;
            wasmtime::bail!("memory cap of {} bytes exceeded", self.limit);
        }
        Ok(true)
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(desired <= 100_000)
    }
}

impl LogHost for CallState {
    fn enabled(&mut self, level: Level) -> bool {
        match level {
            Level::Trace => tracing::enabled!(target: "capstan::plugin", tracing::Level::TRACE),
            Level::Debug => tracing::enabled!(target: "capstan::plugin", tracing::Level::DEBUG),
            Level::Info => tracing::enabled!(target: "capstan::plugin", tracing::Level::INFO),
            Level::Warn => tracing::enabled!(target: "capstan::plugin", tracing::Level::WARN),
            Level::Error => tracing::enabled!(target: "capstan::plugin", tracing::Level::ERROR),
        }
    }

    fn log(&mut self, level: Level, message: String) {
        let plugin = self.plugin.as_str();
        match level {
            Level::Trace => tracing::trace!(target: "capstan::plugin", plugin, "{message}"),
            Level::Debug => tracing::debug!(target: "capstan::plugin", plugin, "{message}"),
            Level::Info => tracing::info!(target: "capstan::plugin", plugin, "{message}"),
            Level::Warn => tracing::warn!(target: "capstan::plugin", plugin, "{message}"),
            Level::Error => tracing::error!(target: "capstan::plugin", plugin, "{message}"),
        }
    }
}

impl super::bindings::capstan::plugin::types::Host for CallState {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panic_message_is_read_from_the_panic_hook_output() {
        let out = Output {
            stdout: String::new(),
            stderr: "thread '<unnamed>' panicked at src/lib.rs:10:5:\nboom: spec.replicas missing\nnote: run with `RUST_BACKTRACE=1`\n".into(),
        };
        assert_eq!(
            out.panic_message().as_deref(),
            Some("boom: spec.replicas missing (at src/lib.rs:10:5)")
        );
        let quiet = Output {
            stdout: "hello".into(),
            stderr: String::new(),
        };
        assert_eq!(quiet.panic_message(), None);
    }

    #[test]
    fn memory_cap_refuses_growth_past_the_limit_and_remembers_it() {
        let mut cap = MemoryCap {
            limit: 1 << 20,
            exceeded: false,
        };
        assert!(cap.memory_growing(0, 1 << 20, None).unwrap());
        assert!(!cap.exceeded);
        assert!(cap.memory_growing(1 << 20, 2 << 20, None).is_err());
        assert!(cap.exceeded);
    }
}
