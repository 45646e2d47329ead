//! The per-call store state: WASI with nothing granted, the memory limiter, the captured
//! stdout/stderr, and the host side of the `log` interface.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use wasmtime::ResourceLimiter;
use wasmtime::component::ResourceTable;
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::p2::{OutputStream, Pollable, StreamError};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

/// What a call may read of the world outside its input, pinned: the wall clock stands
/// at `at` (seconds since the Unix epoch) and every random byte comes from `seed`. Two
/// calls pinned alike on the same input get the same answer from a plugin that reads
/// nothing else, as the contract asks: so `capstan render`, `plan` and `test` can be
/// held to what `capstan run` decides, and a history replayed. Unpinned calls (the
/// default, and what `capstan run` uses) read the host's clock and its secure random.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pinned {
    /// The wall clock, in seconds since the Unix epoch.
    pub at: i64,
    /// The seed of `wasi:random`, secure and insecure alike.
    pub seed: u64,
}

/// A wall clock that stands still.
struct StoppedClock(std::time::Duration);

impl wasmtime_wasi::HostWallClock for StoppedClock {
    fn resolution(&self) -> std::time::Duration {
        std::time::Duration::from_secs(1)
    }

    fn now(&self) -> std::time::Duration {
        self.0
    }
}

/// How much a plugin may print on stdout or stderr in one call; the rest is dropped.
const OUTPUT_CAPACITY: usize = 64 << 10;
/// Lines one call may send through the `log` import; more are dropped and counted.
pub const MAX_LOG_LINES: u32 = 64;
/// Bytes of `log` messages one call may send, all lines together.
pub const MAX_LOG_BYTES: usize = 64 << 10;
/// The longest `log` message; a longer one is cut there.
pub const MAX_LOG_LINE: usize = 4 << 10;

/// Lines a plugin may log per second across its calls (`log` lines, and stdout and
/// stderr lines), once its burst is spent.
pub const LOG_RATE_LINES: f64 = 100.0;
/// Lines a plugin may log at once before [`LOG_RATE_LINES`] holds it back.
pub const LOG_BURST_LINES: f64 = 1000.0;
/// Bytes a plugin may log per second across its calls, once its burst is spent.
pub const LOG_RATE_BYTES: f64 = 128.0 * 1024.0;
/// Bytes a plugin may log at once before [`LOG_RATE_BYTES`] holds it back.
pub const LOG_BURST_BYTES: f64 = 1024.0 * 1024.0;
/// How often, at most, the host says that a plugin's lines are dropped by its rate.
const RATE_WARNING_EVERY: std::time::Duration = std::time::Duration::from_secs(60);

/// A plugin's log budget across its calls: a token bucket of lines and of bytes,
/// refilled at [`LOG_RATE_LINES`] and [`LOG_RATE_BYTES`] a second up to their bursts.
/// One call's budget alone ([`MAX_LOG_LINES`]) does not bound a plugin that is called
/// often; this does, so that no plugin can flood the host's log (and what ships it)
/// however many parents it has. Lines past it are dropped, counted, and said at most
/// once a minute.
#[derive(Debug)]
pub struct LogRate(Mutex<Bucket>);

#[derive(Debug)]
struct Bucket {
    lines: f64,
    bytes: f64,
    at: Instant,
    /// Lines dropped since the host last said so, and when it did.
    dropped: u64,
    warned: Option<Instant>,
}

impl Default for LogRate {
    fn default() -> Self {
        LogRate(Mutex::new(Bucket {
            lines: LOG_BURST_LINES,
            bytes: LOG_BURST_BYTES,
            at: Instant::now(),
            dropped: 0,
            warned: None,
        }))
    }
}

impl LogRate {
    /// Whether a line of `len` bytes may be logged now; if not, it is counted.
    pub fn take(&self, len: usize) -> bool {
        self.take_at(len, Instant::now())
    }

    fn take_at(&self, len: usize, now: Instant) -> bool {
        let mut b = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let elapsed = now.saturating_duration_since(b.at).as_secs_f64();
        b.at = b.at.max(now);
        b.lines = (b.lines + elapsed * LOG_RATE_LINES).min(LOG_BURST_LINES);
        b.bytes = (b.bytes + elapsed * LOG_RATE_BYTES).min(LOG_BURST_BYTES);
        if b.lines >= 1.0 && b.bytes >= len as f64 {
            b.lines -= 1.0;
            b.bytes -= len as f64;
            true
        } else {
            b.dropped += 1;
            false
        }
    }

    /// The lines dropped since the last time this answered, if it is time to say so
    /// (at most once a minute).
    fn due_warning(&self, now: Instant) -> Option<u64> {
        let mut b = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let due = b.dropped > 0 && b.warned.is_none_or(|at| now >= at + RATE_WARNING_EVERY);
        due.then(|| {
            b.warned = Some(now);
            std::mem::take(&mut b.dropped)
        })
    }

    /// Says, at most once a minute, how many of `plugin`'s lines its rate dropped.
    pub fn warn(&self, plugin: &str) {
        if let Some(lines) = self.due_warning(Instant::now()) {
            tracing::warn!(target: "capstan::plugin", plugin, lines, "the plugin logs faster than {LOG_RATE_LINES} lines or {} KiB a second across its calls; {lines} lines were dropped", LOG_RATE_BYTES as u64 / 1024);
        }
    }
}

/// What is left of one call's `log` budget, and what went past it.
#[derive(Debug)]
struct LogBudget {
    lines: u32,
    bytes: usize,
    dropped_lines: u64,
    dropped_bytes: u64,
    /// The plugin's budget across its calls.
    rate: Arc<LogRate>,
}

impl LogBudget {
    fn new(rate: Arc<LogRate>) -> Self {
        LogBudget {
            lines: MAX_LOG_LINES,
            bytes: MAX_LOG_BYTES,
            dropped_lines: 0,
            dropped_bytes: 0,
            rate,
        }
    }

    /// `message` as it may be logged (cut at [`MAX_LOG_LINE`]), or none once the
    /// call's lines or bytes are spent (then counted as dropped).
    fn admit(&mut self, message: String) -> Option<String> {
        let mut message = message;
        if message.len() > MAX_LOG_LINE {
            let mut cut = MAX_LOG_LINE;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            self.dropped_bytes += (message.len() - cut) as u64;
            message.truncate(cut);
            message.push_str(" …");
        }
        if self.lines == 0 || message.len() > self.bytes || !self.rate.take(message.len()) {
            self.dropped_lines += 1;
            self.dropped_bytes += message.len() as u64;
            return None;
        }
        self.lines -= 1;
        self.bytes -= message.len();
        Some(message)
    }
}

/// Everything one call's `Store` holds. Made fresh for every call.
pub struct CallState {
    plugin: String,
    wasi: WasiCtx,
    table: ResourceTable,
    stdout: BoundedOutput,
    stderr: BoundedOutput,
    pub(super) limits: MemoryCap,
    log_budget: LogBudget,
}

impl CallState {
    /// State for one call of `plugin`, with `memory_limit` bytes of linear memory, its
    /// clock and random pinned if `pinned`, and its log budget across calls `rate`.
    pub fn new(
        plugin: &str,
        memory_limit: usize,
        pinned: Option<Pinned>,
        rate: Arc<LogRate>,
    ) -> Self {
        let stdout = BoundedOutput::new(OUTPUT_CAPACITY);
        let stderr = BoundedOutput::new(OUTPUT_CAPACITY);
        // The builder's defaults grant nothing: no preopens, no env, no args, stdin
        // closed, every socket address denied. Say the network part out loud anyway.
        let mut builder = WasiCtx::builder();
        builder
            .stdout(stdout.clone())
            .stderr(stderr.clone())
            .allow_tcp(false)
            .allow_udp(false)
            .allow_ip_name_lookup(false);
        if let Some(pinned) = pinned {
            use rand::SeedableRng;
            let since_epoch = std::time::Duration::from_secs(pinned.at.max(0) as u64);
            builder
                .wall_clock(StoppedClock(since_epoch))
                .secure_random(rand::rngs::StdRng::seed_from_u64(pinned.seed))
                .insecure_random(rand::rngs::StdRng::seed_from_u64(pinned.seed ^ 1))
                .insecure_random_seed(u128::from(pinned.seed));
        }
        let wasi = builder.build();
        CallState {
            plugin: plugin.to_string(),
            wasi,
            table: ResourceTable::new(),
            stdout,
            stderr,
            limits: MemoryCap {
                limit: memory_limit,
                exceeded: false,
                peak: 0,
            },
            log_budget: LogBudget::new(rate),
        }
    }

    /// The largest linear memory the instance grew to, in bytes.
    pub fn peak_memory(&self) -> usize {
        self.limits.peak
    }

    /// Whether the instance tried to grow past its memory cap.
    pub fn memory_exceeded(&self) -> bool {
        self.limits.exceeded
    }

    /// What the plugin printed during the call.
    pub fn take_output(&mut self) -> Output {
        let (stdout, out_dropped) = self.stdout.take();
        let (stderr, err_dropped) = self.stderr.take();
        let rate = self.log_budget.rate.clone();
        let log = std::mem::replace(&mut self.log_budget, LogBudget::new(rate.clone()));
        Output {
            stdout: String::from_utf8_lossy(&stdout).into_owned(),
            stderr: String::from_utf8_lossy(&stderr).into_owned(),
            dropped: out_dropped + err_dropped + log.dropped_bytes,
            log_lines_dropped: log.dropped_lines,
            rate,
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
    /// Bytes printed or logged beyond the capacity, dropped.
    dropped: u64,
    /// `log` lines beyond the call's budget, dropped.
    log_lines_dropped: u64,
    /// The plugin's log budget across its calls.
    rate: Arc<LogRate>,
}

impl Output {
    /// Bytes the plugin printed beyond what the host keeps, dropped.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Sends every printed line to the host's log, tagged with the plugin's name, within
    /// the plugin's log rate (the lines past it are dropped and counted).
    pub fn log(&mut self, plugin: &str) {
        if self.log_lines_dropped > 0 {
            tracing::warn!(target: "capstan::plugin", plugin, lines = self.log_lines_dropped, "the plugin logged more than {MAX_LOG_LINES} lines or {MAX_LOG_BYTES} bytes in one call; the rest was dropped");
        } else if self.dropped > 0 {
            tracing::warn!(target: "capstan::plugin", plugin, dropped = self.dropped, "the plugin printed more than {OUTPUT_CAPACITY} bytes on a stream (or a log line over {MAX_LOG_LINE}) in one call; the rest was dropped");
        }
        let mut dropped = 0;
        for (stream, text) in [("stdout", &self.stdout), ("stderr", &self.stderr)] {
            for line in text.lines().filter(|l| !l.trim().is_empty()) {
                if self.rate.take(line.len()) {
                    tracing::info!(target: "capstan::plugin", plugin, stream, "{line}");
                } else {
                    dropped += line.len() as u64;
                }
            }
        }
        self.dropped += dropped;
        self.rate.warn(plugin);
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

/// A stdout/stderr that keeps the first `capacity` bytes of a call and drops (and
/// counts) the rest. It never refuses a write: a guest whose writes fail would panic
/// (Rust's `println!` does), turning chatty into broken.
#[derive(Clone)]
pub struct BoundedOutput {
    capacity: usize,
    inner: Arc<Mutex<(Vec<u8>, u64)>>,
}

impl BoundedOutput {
    /// An empty stream keeping up to `capacity` bytes.
    pub fn new(capacity: usize) -> Self {
        BoundedOutput {
            capacity,
            inner: Arc::new(Mutex::new((Vec::new(), 0))),
        }
    }

    fn push(&self, bytes: &[u8]) {
        let mut inner = self.inner.lock().expect("output lock");
        let room = self.capacity.saturating_sub(inner.0.len());
        let kept = bytes.len().min(room);
        inner.0.extend_from_slice(&bytes[..kept]);
        inner.1 += (bytes.len() - kept) as u64;
    }

    /// What was kept, and how many bytes were dropped.
    pub fn take(&self) -> (Vec<u8>, u64) {
        let mut inner = self.inner.lock().expect("output lock");
        (std::mem::take(&mut inner.0), std::mem::take(&mut inner.1))
    }
}

#[wasmtime_wasi::async_trait]
impl OutputStream for BoundedOutput {
    fn write(&mut self, bytes: Bytes) -> Result<(), StreamError> {
        self.push(&bytes);
        Ok(())
    }

    fn flush(&mut self) -> Result<(), StreamError> {
        Ok(())
    }

    fn check_write(&mut self) -> Result<usize, StreamError> {
        // Always room: what does not fit is dropped, not refused.
        Ok(64 << 10)
    }
}

#[wasmtime_wasi::async_trait]
impl Pollable for BoundedOutput {
    async fn ready(&mut self) {}
}

impl tokio::io::AsyncWrite for BoundedOutput {
    fn poll_write(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.push(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

impl IsTerminal for BoundedOutput {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for BoundedOutput {
    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(self.clone())
    }

    fn async_stream(&self) -> Box<dyn tokio::io::AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }
}

/// Caps an instance's linear memory, and remembers that the cap was hit so the host can
/// say so instead of reporting an opaque trap.
pub struct MemoryCap {
    limit: usize,
    exceeded: bool,
    peak: usize,
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
        self.peak = self.peak.max(desired);
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

/// The `log` import of each contract release: the same levels, in types of its own.
macro_rules! log_host {
    ($release:ident) => {
        impl super::bindings::$release::capstan::plugin::log::Host for CallState {
            fn enabled(&mut self, level: super::bindings::$release::capstan::plugin::log::Level) -> bool {
                use super::bindings::$release::capstan::plugin::log::Level;
                match level {
                    Level::Trace => tracing::enabled!(target: "capstan::plugin", tracing::Level::TRACE),
                    Level::Debug => tracing::enabled!(target: "capstan::plugin", tracing::Level::DEBUG),
                    Level::Info => tracing::enabled!(target: "capstan::plugin", tracing::Level::INFO),
                    Level::Warn => tracing::enabled!(target: "capstan::plugin", tracing::Level::WARN),
                    Level::Error => tracing::enabled!(target: "capstan::plugin", tracing::Level::ERROR),
                }
            }

            fn log(&mut self, level: super::bindings::$release::capstan::plugin::log::Level, message: String) {
                use super::bindings::$release::capstan::plugin::log::Level;
                let Some(message) = self.log_budget.admit(message) else {
                    return;
                };
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

        impl super::bindings::$release::capstan::plugin::types::Host for CallState {}
    };
}

log_host!(v0_1);
log_host!(v0_2);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panic_message_is_read_from_the_panic_hook_output() {
        let out = Output {
            stdout: String::new(),
            stderr: "thread '<unnamed>' panicked at src/lib.rs:10:5:\nboom: spec.replicas missing\nnote: run with `RUST_BACKTRACE=1`\n".into(),
            dropped: 0,
            log_lines_dropped: 0,
            rate: Arc::default(),
        };
        assert_eq!(
            out.panic_message().as_deref(),
            Some("boom: spec.replicas missing (at src/lib.rs:10:5)")
        );
        let quiet = Output {
            stdout: "hello".into(),
            stderr: String::new(),
            dropped: 0,
            log_lines_dropped: 0,
            rate: Arc::default(),
        };
        assert_eq!(quiet.panic_message(), None);
    }

    #[test]
    fn a_call_logs_within_its_budget_and_the_rest_is_dropped_and_counted() {
        use super::super::bindings::v0_2::capstan::plugin::log::{Host, Level};
        let mut state = CallState::new("flood", 1 << 20, None, Arc::default());
        // One huge line: cut at the line limit.
        Host::log(&mut state, Level::Info, "x".repeat(MAX_LOG_LINE + 1000));
        // A flood: the call's lines run out.
        for i in 0..10_000 {
            Host::log(&mut state, Level::Info, format!("line {i}"));
        }
        assert_eq!(state.log_budget.lines, 0);
        let output = state.take_output();
        assert_eq!(
            output.log_lines_dropped,
            10_000 - u64::from(MAX_LOG_LINES - 1)
        );
        assert!(
            output.dropped() >= 1000,
            "the cut bytes are counted: {}",
            output.dropped()
        );
        // The next call starts with a whole budget.
        Host::log(&mut state, Level::Info, "again".into());
        assert_eq!(state.log_budget.lines, MAX_LOG_LINES - 1);
        // Bytes run out before lines do with long lines.
        let mut budget = LogBudget::new(Arc::default());
        let admitted = (0..MAX_LOG_LINES)
            .filter(|_| budget.admit("y".repeat(MAX_LOG_LINE)).is_some())
            .count();
        assert_eq!(admitted, MAX_LOG_BYTES / MAX_LOG_LINE);
        assert_eq!(
            budget.dropped_lines,
            u64::from(MAX_LOG_LINES) - admitted as u64
        );
    }

    #[test]
    fn a_plugin_logs_within_its_rate_across_calls() {
        use super::super::bindings::v0_2::capstan::plugin::log::{Host, Level};
        let rate = Arc::new(LogRate::default());
        // Calls that each stay within their own budget, many of them at once: the burst
        // goes through, then the rate holds the plugin back.
        let mut logged = 0;
        for _ in 0..100 {
            let mut state = CallState::new("chatty", 1 << 20, None, rate.clone());
            for i in 0..MAX_LOG_LINES {
                Host::log(&mut state, Level::Info, format!("line {i}"));
            }
            let output = state.take_output();
            logged += u64::from(MAX_LOG_LINES) - output.log_lines_dropped;
        }
        // The burst, and what the rate refilled while the loop ran (well under a second).
        assert!(
            (LOG_BURST_LINES as u64..LOG_BURST_LINES as u64 + LOG_RATE_LINES as u64)
                .contains(&logged),
            "{logged} lines got through"
        );
        // Said once, with the count, then not again within the minute.
        let now = Instant::now();
        let said = rate.due_warning(now).expect("the drops are said");
        assert_eq!(said, 100 * u64::from(MAX_LOG_LINES) - logged);
        assert!(!rate.take_at(8, now), "still spent");
        assert_eq!(
            rate.due_warning(now + std::time::Duration::from_secs(1)),
            None
        );
        assert_eq!(
            rate.due_warning(now + RATE_WARNING_EVERY),
            Some(1),
            "a minute later, the next drops are said"
        );
        // It refills with time: ten seconds give the whole burst back.
        let later = now + std::time::Duration::from_secs(10);
        assert!((0..LOG_BURST_LINES as usize).all(|_| rate.take_at(8, later)));
        assert!(!rate.take_at(8, later));
        // Printed lines share it: stdout past the rate is dropped and counted.
        let mut output = Output {
            stdout: "a\nb\n".into(),
            stderr: String::new(),
            dropped: 0,
            log_lines_dropped: 0,
            rate: rate.clone(),
        };
        output.log("chatty");
        assert!(output.dropped() >= 2, "{}", output.dropped());
    }

    #[test]
    fn output_past_the_capacity_is_dropped_and_counted_never_refused() {
        let mut out = BoundedOutput::new(8);
        assert_eq!(out.check_write().unwrap(), 64 << 10);
        out.write(Bytes::from_static(b"hello ")).unwrap();
        out.write(Bytes::from_static(b"world, and more")).unwrap();
        assert!(out.check_write().is_ok(), "still accepting");
        let (kept, dropped) = out.take();
        assert_eq!(kept, b"hello wo");
        assert_eq!(dropped, 13);
    }

    #[test]
    fn memory_cap_refuses_growth_past_the_limit_and_remembers_it() {
        let mut cap = MemoryCap {
            limit: 1 << 20,
            exceeded: false,
            peak: 0,
        };
        assert!(cap.memory_growing(0, 1 << 20, None).unwrap());
        assert!(!cap.exceeded);
        let err = cap.memory_growing(1 << 20, 2 << 20, None).unwrap_err();
        assert!(err.to_string().contains("memory cap"), "{err}");
        assert!(cap.exceeded);
    }
}
