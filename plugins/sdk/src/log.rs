//! Logging to the host's log, tagged with the plugin's name.
//!
//! Inside the sandbox the lines go through the `capstan:plugin/log` import; in native
//! unit tests they go to stderr.

/// Severity of a log line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// Very detailed.
    Trace,
    /// For debugging.
    Debug,
    /// Normal operation.
    Info,
    /// Something unusual.
    Warn,
    /// Something failed.
    Error,
}

#[cfg(target_arch = "wasm32")]
fn to_wit(level: Level) -> crate::bindings::capstan::plugin::log::Level {
    use crate::bindings::capstan::plugin::log::Level as L;
    match level {
        Level::Trace => L::Trace,
        Level::Debug => L::Debug,
        Level::Info => L::Info,
        Level::Warn => L::Warn,
        Level::Error => L::Error,
    }
}

/// Whether a line at `level` would be recorded; cheap.
pub fn enabled(level: Level) -> bool {
    #[cfg(target_arch = "wasm32")]
    {
        crate::bindings::capstan::plugin::log::enabled(to_wit(level))
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        level >= Level::Info
    }
}

/// Records one line at `level`.
pub fn log(level: Level, message: &str) {
    #[cfg(target_arch = "wasm32")]
    {
        crate::bindings::capstan::plugin::log::log(to_wit(level), message);
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        if enabled(level) {
            eprintln!("[{level:?}] {message}");
        }
    }
}

/// Logs at debug level; the message is only built when debug is enabled.
#[macro_export]
macro_rules! debug {
    ($($arg:tt)*) => {
        if $crate::log::enabled($crate::log::Level::Debug) {
            $crate::log::log($crate::log::Level::Debug, &format!($($arg)*));
        }
    };
}

/// Logs at info level.
#[macro_export]
macro_rules! info {
    ($($arg:tt)*) => {
        if $crate::log::enabled($crate::log::Level::Info) {
            $crate::log::log($crate::log::Level::Info, &format!($($arg)*));
        }
    };
}

/// Logs at warn level.
#[macro_export]
macro_rules! warn {
    ($($arg:tt)*) => {
        if $crate::log::enabled($crate::log::Level::Warn) {
            $crate::log::log($crate::log::Level::Warn, &format!($($arg)*));
        }
    };
}
