//! On-disk cache of compiled components, keyed by the component's sha256 and the
//! engine's compatibility hash, so that a restart does not recompile every plugin.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use wasmtime::Engine;
use wasmtime::component::Component;

/// Compiles `bytes`, or loads the code compiled earlier for the same bytes and engine.
///
/// A cache that cannot be read or written is not an error: the component is compiled
/// and the problem logged.
pub fn compile(
    engine: &Engine,
    cache_dir: Option<&Path>,
    bytes: &[u8],
    sha256: &str,
) -> wasmtime::Result<Component> {
    let Some(dir) = cache_dir else {
        return Component::new(engine, bytes);
    };
    let mut hasher = DefaultHasher::new();
    engine.precompile_compatibility_hash().hash(&mut hasher);
    let path = dir.join(format!("{sha256}-{:016x}.cwasm", hasher.finish()));
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
    let serialized = engine.precompile_component(bytes)?;
    if let Err(err) = store(dir, &path, &serialized) {
        tracing::warn!(dir = %dir.display(), "cannot write the compile cache: {err}");
        return deserialize_bytes(engine, &serialized);
    }
    // Mapped from the file rather than kept from `serialized`: see `deserialize`.
    deserialize(engine, &path).or_else(|_| deserialize_bytes(engine, &serialized))
}

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
