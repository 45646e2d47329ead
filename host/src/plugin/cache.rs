//! On-disk cache of compiled components, keyed by the component's sha256 and the
//! engine's compatibility hash, so that a restart does not recompile every plugin.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use wasmtime::component::Component;
use wasmtime::{Config, Engine};

/// Compiles `bytes`, or loads the code compiled earlier for the same bytes and engine.
/// `compiler` is the configuration of `engine` for compiling (see [`precompile`]).
///
/// A cache that cannot be read or written is not an error: the component is compiled
/// and the problem logged.
pub fn compile(
    engine: &Engine,
    compiler: &Config,
    cache_dir: Option<&Path>,
    bytes: &[u8],
    sha256: &str,
) -> wasmtime::Result<Component> {
    let Some(dir) = cache_dir else {
        let component = precompile(compiler, bytes).and_then(|c| deserialize_bytes(engine, &c));
        return_freed_memory();
        return component;
    };
    let path = dir.join(format!("{sha256}-{:016x}.cwasm", compatibility(engine)));
    if path.exists() {
        match deserialize(engine, &path) {
            Ok(component) => {
                tracing::debug!(path = %path.display(), "compiled code taken from the cache");
                return Ok(component);
            }
            Err(err) => {
                tracing::warn!(path = %path.display(), "ignoring unusable cache entry: {err}")
            }
        }
    }
    let component = compile_into(engine, compiler, dir, &path, bytes);
    return_freed_memory();
    component
}

/// Compiles `bytes` into the cache entry `path` and loads it.
fn compile_into(
    engine: &Engine,
    compiler: &Config,
    dir: &Path,
    path: &Path,
    bytes: &[u8],
) -> wasmtime::Result<Component> {
    let serialized = precompile(compiler, bytes)?;
    if let Err(err) = store(dir, path, &serialized) {
        tracing::warn!(dir = %dir.display(), "cannot write the compile cache: {err}");
        return deserialize_bytes(engine, &serialized);
    }
    // Mapped from the file rather than kept from `serialized`: see `deserialize`.
    deserialize(engine, path).or_else(|_| deserialize_bytes(engine, &serialized))
}

/// The engine's compatibility hash: compiled code is usable by any engine with the same.
pub(super) fn compatibility(engine: &Engine) -> u64 {
    let mut hasher = DefaultHasher::new();
    engine.precompile_compatibility_hash().hash(&mut hasher);
    hasher.finish()
}

/// Compiles `bytes` in an engine made for this compile alone; the caller then gives the
/// memory it used back to the system ([`return_freed_memory`]).
///
/// Cranelift needs a few hundred MiB for a large component (330 MiB for the PostgreSQL
/// plugin), and an engine keeps its compiler's working buffers, sized for the largest
/// function it compiled, for as long as it lives. Compiled in the serving engine, the
/// shipped plugins left a first start at 190-360 MiB (in a Pod limited to 512 MiB)
/// where a restart from the cache needs 25-40. `compiler` differs from the serving engine's
/// configuration only in how instances are allocated, which compiled code does not
/// depend on (the compatibility hashes are equal: a test holds them so).
fn precompile(compiler: &Config, bytes: &[u8]) -> wasmtime::Result<Vec<u8>> {
    Engine::new(compiler)?.precompile_component(bytes)
}

/// Returns the allocator's free pages to the system: what a compile freed (the
/// compiler's buffers, the serialized code) is otherwise kept by glibc's arenas, in
/// blocks too scattered for it to give back by itself.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn return_freed_memory() {
    // SAFETY: malloc_trim only releases free pages of the allocator's own arenas, under
    // their locks; it touches no memory in use.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn return_freed_memory() {}

/// Writes through a temporary file and a rename, so a reader never sees half a file.
fn store(dir: &Path, path: &Path, serialized: &[u8]) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, serialized)?;
    std::fs::rename(&tmp, path)
}

/// Maps the entry instead of reading it into memory: the code is then backed by the
/// file, and only the pages a plugin runs become resident (a read copy kept all of it,
/// 1-4 MiB a plugin). The map is of a private copy, unlinked once mapped, because a
/// mapped file truncated by someone else would crash the host with SIGBUS; entries
/// are only ever replaced by a rename, which leaves the copy intact anyway.
#[allow(unsafe_code)]
fn deserialize(engine: &Engine, path: &Path) -> wasmtime::Result<Component> {
    static COPIES: AtomicU64 = AtomicU64::new(0);
    let copy = path.with_extension(format!(
        "load{}-{}",
        std::process::id(),
        COPIES.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::copy(path, &copy)?;
    // SAFETY: the entry was written by `store` from `precompile_component` output of an
    // engine with the same compatibility hash (part of the name) and renamed into place
    // whole; wasmtime checks the header and the engine settings again. The copy has a
    // name of this process alone and is unlinked right after it is mapped, so nothing
    // can modify it while the component lives.
    let component = unsafe { Component::deserialize_file(engine, &copy) };
    let _ = std::fs::remove_file(&copy);
    component
}

#[allow(unsafe_code)]
fn deserialize_bytes(engine: &Engine, serialized: &[u8]) -> wasmtime::Result<Component> {
    // SAFETY: `serialized` was produced by `precompile_component` of this very engine.
    unsafe { Component::deserialize(engine, serialized) }
}
