//! On-disk cache of compiled components, keyed by the component's sha256 and the
//! engine's compatibility hash, so that a restart does not recompile every plugin.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::Path;

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
    }
    deserialize_bytes(engine, &serialized)
}

/// Writes through a temporary file and a rename, so a reader never sees half a file.
fn store(dir: &Path, path: &Path, serialized: &[u8]) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, serialized)?;
    std::fs::rename(&tmp, path)
}

/// Reads the entry into memory rather than mapping it: a mapped file truncated by
/// someone else would crash the host with SIGBUS.
#[allow(unsafe_code)]
fn deserialize(engine: &Engine, path: &Path) -> wasmtime::Result<Component> {
    let bytes = std::fs::read(path)?;
    // SAFETY: the file was written by `store` above from `precompile_component` output
    // of an engine with the same compatibility hash (part of the name) and renamed into
    // place whole. wasmtime checks the header and the engine settings again.
    unsafe { Component::deserialize(engine, &bytes) }
}

#[allow(unsafe_code)]
fn deserialize_bytes(engine: &Engine, serialized: &[u8]) -> wasmtime::Result<Component> {
    // SAFETY: `serialized` was produced by `precompile_component` of this very engine.
    unsafe { Component::deserialize(engine, serialized) }
}
