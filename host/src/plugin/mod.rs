//! Loading plugin components and calling them in the sandbox.
//!
//! A [`Sandbox`] owns the wasmtime engine (component model, epoch interruption, pooling
//! allocator), the linker (WASI with nothing granted, plus the `log` import) and the
//! on-disk cache of compiled code. [`Sandbox::load_file`] turns a `.wasm` file into a
//! [`Plugin`]: compiled, linked, pre-instantiated and described. Every call on a
//! [`Plugin`] runs in a fresh instance with its own deadline and memory cap.
//!
//! **Async and blocking callers.** Each operation comes twice: `load_file`,
//! `reconcile_async`, `finalize_async` for async code, and `load_file_blocking`,
//! `reconcile_blocking`, `finalize_blocking` for threads that run no async code (the
//! command line, tests, `spawn_blocking`). None of them panics wherever it is called: a
//! blocking call made on a thread of a tokio runtime runs on the sandbox's runtime while
//! the caller's thread waits, which is correct but holds that thread for the call.
//!
//! How a call is bounded (deadline, memory, CPU share) is told in `call.rs`.

mod bindings;
mod cache;
mod call;
mod cpu;
mod engine;
mod error;
mod handle;
pub mod limits;
mod load;
mod state;
mod stats;

pub use bindings::CONTRACT_VERSION;
pub use engine::{DEFAULT_INSTANCES, Sandbox, SandboxConfig};
pub use error::{CallError, LoadError, SandboxError};
pub use handle::{Answer, Guest, Native, Plugin};
pub use limits::{LimitsError, LimitsFile};
pub use load::sha256_hex;
pub use state::Pinned;
pub use stats::{Outcome, SandboxMetrics, SandboxSummary};
