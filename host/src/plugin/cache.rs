//! On-disk cache of compiled components, keyed by the component's sha256 and the
//! engine's compatibility hash, so that a restart does not recompile every plugin.
//!
//! The directory is bounded: it keeps the entry of every plugin loaded (held by a
//! [`CacheEntry`]: in this process, and through a shared file lock in any other process
//! that uses the same directory, such as `capstan render` beside `capstan run`) plus the
//! [`KEPT_UNUSED`] most recently used others; the rest (plugins removed or replaced,
//! entries of other engine versions) is deleted whenever a new entry is written.
//!
//! A second, read-only directory of compiled code may stand behind the cache (the image
//! ships its plugins precompiled, `capstan precompile`): an entry missing from the cache
//! is copied from there when it has one of the same name. The name carries the engine's
//! compatibility hash (wasmtime version, compiler settings, the CPU features it
//! compiles for), so code compiled by another wasmtime or for another CPU is simply not
//! found, and wasmtime checks the same again when it loads the code.
//!
//! Compiled code runs inside the host, unsandboxed: a `.cwasm` planted in the cache
//! would bypass `--verify-key` and every limit. So each entry is sealed: its code is
//! followed by an HMAC-SHA256 of the component's sha256 and the code, under a key the
//! cache's readers hold ([`CacheKey`]: `--compile-cache-key-file`, or a `.key` file in
//! the cache directory that only this user may read). An entry whose seal does not
//! verify is not loaded: it is compiled again, and the log says why. A cache directory
//! that others may write to is not used at all. The precompiled directory is trusted
//! as the host's image is (it is read-only there).

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use hmac::{Hmac, Mac};
use sha2::Sha256;
use wasmtime::component::Component;
use wasmtime::{Config, Engine};

/// What ends a sealed entry: the seal's version.
const MAGIC: &[u8; 8] = b"capstan1";
/// The length of the seal's MAC.
const TAG_LEN: usize = 32;
/// The shortest key accepted.
pub const MIN_KEY_LEN: usize = 32;

/// The key entries are sealed with.
#[derive(Clone)]
pub struct CacheKey(std::sync::Arc<Vec<u8>>);

impl std::fmt::Debug for CacheKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CacheKey(..)")
    }
}

/// Why a cache cannot be used: compiled code then comes from compiling, every time.
#[derive(Debug, thiserror::Error)]
pub enum CacheRefused {
    /// Others may write to the directory: anyone could plant code in it.
    #[error("{} is writable by others (mode {mode:o})", dir.display())]
    WritableByOthers {
        /// The directory.
        dir: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// The key file is not this user's alone, or too short, or unreadable.
    #[error("its key {}: {reason}", path.display())]
    Key {
        /// The key file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
}

impl CacheKey {
    /// The key in `path`: at least [`MIN_KEY_LEN`] bytes, in a file only this user may
    /// read and write. Created (random) when `create` and the file is absent.
    pub fn from_file(path: &Path, create: bool) -> Result<CacheKey, CacheRefused> {
        use std::io::Write as _;
        use std::os::unix::fs::{MetadataExt as _, OpenOptionsExt as _};
        let refused = |reason: String| CacheRefused::Key {
            path: path.to_path_buf(),
            reason,
        };
        if create && !path.exists() {
            let mut key = vec![0u8; 32];
            rand::Rng::fill_bytes(&mut rand::make_rng::<rand::rngs::StdRng>(), &mut key);
            let made = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(path)
                .and_then(|mut f| f.write_all(&key));
            match made {
                Ok(()) => tracing::info!(key = %path.display(), "compile cache key created"),
                // Another process made it first: read theirs.
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(refused(format!("cannot create it: {e}"))),
            }
        }
        let meta = std::fs::metadata(path).map_err(|e| refused(e.to_string()))?;
        // SAFETY: geteuid has no preconditions and cannot fail.
        #[allow(unsafe_code)]
        let me = unsafe { libc::geteuid() };
        if meta.uid() != me {
            return Err(refused(format!(
                "owned by uid {}, not this user ({me})",
                meta.uid()
            )));
        }
        if meta.mode() & 0o077 != 0 {
            return Err(refused(format!(
                "mode {:o}: others may read or write it",
                meta.mode() & 0o777
            )));
        }
        let key = std::fs::read(path).map_err(|e| refused(e.to_string()))?;
        if key.len() < MIN_KEY_LEN {
            return Err(refused(format!(
                "{} bytes, at least {MIN_KEY_LEN} needed",
                key.len()
            )));
        }
        Ok(CacheKey(std::sync::Arc::new(key)))
    }

    fn mac(&self, sha256: &str, code: &[u8]) -> Hmac<Sha256> {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes any key length");
        mac.update(sha256.as_bytes());
        mac.update(&[0]);
        mac.update(code);
        mac
    }

    /// `code`, compiled from the component `sha256`, sealed: the code, its MAC, the
    /// magic.
    fn seal(&self, sha256: &str, code: &[u8]) -> Vec<u8> {
        let tag = self.mac(sha256, code).finalize().into_bytes();
        let mut sealed = Vec::with_capacity(code.len() + TAG_LEN + MAGIC.len());
        sealed.extend_from_slice(code);
        sealed.extend_from_slice(&tag);
        sealed.extend_from_slice(MAGIC);
        sealed
    }

    /// The code of the sealed entry `bytes` of the component `sha256`, if its seal
    /// verifies; else why not.
    fn open<'b>(&self, sha256: &str, bytes: &'b [u8]) -> Result<&'b [u8], Unusable> {
        let (code, tag) = split_seal(bytes).ok_or(Unusable::Unsealed)?;
        self.mac(sha256, code)
            .verify_slice(tag)
            .map_err(|_| Unusable::BadSeal)?;
        Ok(code)
    }
}

/// Why a cache entry is not loaded (it is compiled again).
#[derive(Debug, thiserror::Error)]
enum Unusable {
    /// No seal: written by a Capstan before entries were sealed, or planted.
    #[error("it is not sealed (written by an earlier Capstan, or not by Capstan at all)")]
    Unsealed,
    /// A seal that does not verify: planted, or sealed for another component.
    #[error(
        "its seal does not verify with this cache's key: it was not written by a host holding the key, or not for this component"
    )]
    BadSeal,
    /// Sealed, but wasmtime or the file system refused it.
    #[error(transparent)]
    Load(#[from] wasmtime::Error),
}

/// The code and the MAC of a sealed entry; none when `bytes` ends with no seal.
fn split_seal(bytes: &[u8]) -> Option<(&[u8], &[u8])> {
    let rest = bytes.strip_suffix(MAGIC.as_slice())?;
    let at = rest.len().checked_sub(TAG_LEN)?;
    Some(rest.split_at(at))
}

/// Whether the cache directory `dir` may be used: not writable by others.
pub fn check_dir(dir: &Path) -> Result<(), CacheRefused> {
    use std::os::unix::fs::MetadataExt as _;
    match std::fs::metadata(dir) {
        Ok(meta) if meta.mode() & 0o002 != 0 => Err(CacheRefused::WritableByOthers {
            dir: dir.to_path_buf(),
            mode: meta.mode() & 0o7777,
        }),
        _ => Ok(()),
    }
}

/// Entries of plugins not loaded in this process that the directory keeps, the most
/// recently used first: a plugin removed and put back, or a rollback to the previous
/// version, still starts from compiled code.
pub const KEPT_UNUSED: usize = 8;

/// Entries that are temporary files of a writer or a loader (`*.tmp<pid>`,
/// `*.load<pid>-<n>`) are only removed once this old: a live process may be using them.
const STRAY_AGE: Duration = Duration::from_secs(3600);

/// The cache entries loaded plugins of this process use, with how many use each.
static IN_USE: Mutex<Option<HashMap<PathBuf, usize>>> = Mutex::new(None);

/// A loaded plugin's hold on its cache entry: while it lives, the entry is not evicted,
/// by this process (a count by path) nor by another one (a shared lock on the file).
#[derive(Debug)]
pub struct CacheEntry {
    path: PathBuf,
    /// The entry, open and locked shared once it exists.
    locked: Option<std::fs::File>,
}

impl CacheEntry {
    fn hold(path: &Path) -> Self {
        let mut in_use = IN_USE.lock().expect("cache holds lock");
        *in_use
            .get_or_insert_with(HashMap::new)
            .entry(path.to_path_buf())
            .or_default() += 1;
        CacheEntry {
            path: path.to_path_buf(),
            locked: None,
        }
    }

    /// Takes the shared lock on the entry, which now exists (best effort: without it,
    /// only another process could evict the entry, and this one loses nothing but the
    /// compiled code of its next start).
    fn lock(&mut self) {
        let locked = std::fs::File::open(&self.path).and_then(|f| f.lock_shared().map(|()| f));
        match locked {
            Ok(file) => self.locked = Some(file),
            Err(err) => {
                tracing::debug!(path = %self.path.display(), "cannot lock the cache entry: {err}")
            }
        }
    }
}

impl Drop for CacheEntry {
    fn drop(&mut self) {
        let mut in_use = IN_USE.lock().expect("cache holds lock");
        let Some(holds) = in_use.as_mut() else {
            return;
        };
        if let Some(n) = holds.get_mut(&self.path) {
            *n -= 1;
            if *n == 0 {
                holds.remove(&self.path);
            }
        }
    }
}

fn in_use(path: &Path) -> bool {
    IN_USE
        .lock()
        .expect("cache holds lock")
        .as_ref()
        .is_some_and(|holds| holds.contains_key(path))
}

/// Where compiled code is looked for: the cache, and a read-only directory of
/// precompiled code behind it.
#[derive(Debug, Clone, Copy, Default)]
pub struct CacheDirs<'a> {
    /// The cache, written to, and the key its entries are sealed with; `None` compiles
    /// every time.
    pub cache: Option<(&'a Path, &'a CacheKey)>,
    /// Precompiled code, only read (see the module's documentation).
    pub precompiled: Option<&'a Path>,
}

/// Compiles `bytes`, or loads the code compiled earlier for the same bytes and engine.
/// `compiler` is the configuration of `engine` for compiling (see [`precompile`]).
/// With a cache, also returns the hold on the entry, for the plugin to keep.
///
/// A cache that cannot be read or written is not an error: the component is compiled
/// and the problem logged.
pub fn compile(
    engine: &Engine,
    compiler: &Config,
    dirs: CacheDirs<'_>,
    bytes: &[u8],
    sha256: &str,
) -> wasmtime::Result<(Component, Option<CacheEntry>)> {
    let name = entry_name(engine, sha256);
    let precompiled = dirs.precompiled.map(|d| d.join(&name));
    let Some((dir, key)) = dirs.cache else {
        if let Some(component) = precompiled.and_then(|p| load_precompiled(engine, &p)) {
            return Ok((component, None));
        }
        let component = precompile(compiler, bytes).and_then(|c| deserialize_bytes(engine, &c));
        return_freed_memory();
        return Ok((component?, None));
    };
    let path = dir.join(&name);
    let mut entry = CacheEntry::hold(&path);
    if !path.exists()
        && let Some(from) = &precompiled
        && !seed(dir, &path, from, key, sha256)
        && let Some(component) = load_precompiled(engine, from)
    {
        // The cache cannot take the copy: the code is read into memory instead.
        return Ok((component, None));
    }
    if path.exists() {
        match deserialize(engine, &path, key, sha256) {
            Ok(component) => {
                tracing::debug!(path = %path.display(), "compiled code taken from the cache");
                mark_used(&path);
                entry.lock();
                return Ok((component, Some(entry)));
            }
            // An earlier Capstan's entry is expected once after an upgrade.
            Err(err @ Unusable::Unsealed) => {
                tracing::info!(path = %path.display(), "not loading the cache entry, compiling the plugin again: {err}")
            }
            Err(err) => {
                tracing::warn!(path = %path.display(), "not loading the cache entry, compiling the plugin again: {err}")
            }
        }
    }
    let component = compile_into(engine, compiler, dir, &path, bytes, key, sha256);
    return_freed_memory();
    entry.lock();
    Ok((component?, Some(entry)))
}

/// The file name of the entry of the component `sha256` compiled by `engine`.
fn entry_name(engine: &Engine, sha256: &str) -> String {
    format!("{sha256}-{:016x}.cwasm", compatibility(engine))
}

/// Copies the precompiled entry `from`, if there is one, into the cache as `path`
/// (through a temporary file and a rename, like [`store`]): whether `path` now exists.
fn seed(dir: &Path, path: &Path, from: &Path, key: &CacheKey, sha256: &str) -> bool {
    if !from.is_file() {
        return false;
    }
    let copied = std::fs::read(from).and_then(|bytes| {
        // Trusted as the image is; sealed with this cache's key on the way in.
        let code = split_seal(&bytes).map_or(bytes.as_slice(), |(code, _)| code);
        store(dir, path, &key.seal(sha256, code))
    });
    match copied {
        Ok(()) => {
            tracing::debug!(from = %from.display(), "compile cache seeded with precompiled code");
            true
        }
        Err(err) => {
            tracing::warn!(dir = %dir.display(), "cannot copy precompiled code into the compile cache: {err}");
            false
        }
    }
}

/// Loads the precompiled entry `path`, if there is a usable one, from a copy in memory
/// (for want of a cache to copy it into: see [`deserialize`] for why not mapped).
fn load_precompiled(engine: &Engine, path: &Path) -> Option<Component> {
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return None,
        Err(err) => {
            tracing::warn!(path = %path.display(), "cannot read precompiled code: {err}");
            return None;
        }
    };
    let code = split_seal(&bytes).map_or(bytes.as_slice(), |(code, _)| code);
    // SAFETY: as in `deserialize_bytes`, but the bytes come from a file: wasmtime checks
    // its header, version and engine settings, and the name carries the compatibility
    // hash of this engine; the directory is trusted as the host's image is.
    #[allow(unsafe_code)]
    let loaded = unsafe { Component::deserialize(engine, code) };
    match loaded {
        Ok(component) => Some(component),
        Err(err) => {
            tracing::warn!(path = %path.display(), "ignoring unusable precompiled code: {err}");
            None
        }
    }
}

/// Deletes `path` unless another process holds it (a shared lock): whether it went.
fn remove_unlocked(path: &Path) -> std::io::Result<bool> {
    let file = std::fs::File::open(path)?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => return Ok(false),
        Err(std::fs::TryLockError::Error(err)) => return Err(err),
    }
    std::fs::remove_file(path)?;
    Ok(true)
}

/// Dates the entry `path` as just used, for [`evict`] (best effort).
fn mark_used(path: &Path) {
    let touched = std::fs::File::options()
        .append(true)
        .open(path)
        .and_then(|f| f.set_modified(SystemTime::now()));
    if let Err(err) = touched {
        tracing::debug!(path = %path.display(), "cannot date the cache entry: {err}");
    }
}

/// Deletes the entries of `dir` that no loaded plugin holds, but the `keep` most
/// recently used; and stray temporary files older than [`STRAY_AGE`]. Returns how many
/// files went. Best effort: what cannot be read or deleted is left.
pub fn evict(dir: &Path, keep: usize) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let now = SystemTime::now();
    let mut unused: Vec<(SystemTime, PathBuf)> = Vec::new();
    let mut stray: Vec<PathBuf> = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        let Ok(meta) = entry.metadata() else { continue };
        if !meta.is_file() {
            continue;
        }
        let modified = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
        match path.extension().and_then(|e| e.to_str()) {
            Some("cwasm") if !in_use(&path) => unused.push((modified, path)),
            Some(e)
                if (e.starts_with("tmp") || e.starts_with("load"))
                    && now
                        .duration_since(modified)
                        .is_ok_and(|age| age > STRAY_AGE) =>
            {
                stray.push(path)
            }
            _ => {}
        }
    }
    unused.sort_by_key(|(modified, _)| std::cmp::Reverse(*modified));
    let doomed = unused.into_iter().skip(keep).map(|(_, p)| p).chain(stray);
    let mut removed = 0;
    for path in doomed {
        match remove_unlocked(&path) {
            Ok(true) => removed += 1,
            Ok(false) => {}
            Err(err) => {
                tracing::debug!(path = %path.display(), "cannot evict from the compile cache: {err}")
            }
        }
    }
    if removed > 0 {
        tracing::info!(dir = %dir.display(), removed, "compile cache entries evicted");
    }
    removed
}

/// Compiles `bytes` into the cache entry `path` and loads it.
fn compile_into(
    engine: &Engine,
    compiler: &Config,
    dir: &Path,
    path: &Path,
    bytes: &[u8],
    key: &CacheKey,
    sha256: &str,
) -> wasmtime::Result<Component> {
    let serialized = precompile(compiler, bytes)?;
    if let Err(err) = store(dir, path, &key.seal(sha256, &serialized)) {
        tracing::warn!(dir = %dir.display(), "cannot write the compile cache: {err}");
        return deserialize_bytes(engine, &serialized);
    }
    evict(dir, KEPT_UNUSED);
    // Mapped from the file rather than kept from `serialized`: see `deserialize`.
    deserialize(engine, path, key, sha256).or_else(|_| deserialize_bytes(engine, &serialized))
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

/// Loads the sealed entry `path` of the component `sha256`, once its seal verifies
/// with `key`. Maps the code instead of keeping it in memory: it is then backed by a
/// file, and only the pages a plugin runs become resident (a read copy kept all of it,
/// 1-4 MiB a plugin). The map is of a private copy of the verified code, unlinked once
/// mapped, because a mapped file truncated by someone else would crash the host with
/// SIGBUS, and so that what is mapped is what was verified.
#[allow(unsafe_code)]
fn deserialize(
    engine: &Engine,
    path: &Path,
    key: &CacheKey,
    sha256: &str,
) -> Result<Component, Unusable> {
    static COPIES: AtomicU64 = AtomicU64::new(0);
    let bytes = std::fs::read(path).map_err(wasmtime::Error::from)?;
    let code = key.open(sha256, &bytes)?;
    let copy = path.with_extension(format!(
        "load{}-{}",
        std::process::id(),
        COPIES.fetch_add(1, Ordering::Relaxed)
    ));
    let written = {
        use std::io::Write as _;
        use std::os::unix::fs::OpenOptionsExt as _;
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&copy)
            .and_then(|mut f| f.write_all(code))
    };
    if let Err(err) = written {
        let _ = std::fs::remove_file(&copy);
        // No room for the copy (a read-only cache, such as one in an image): the code
        // is loaded from memory instead, which keeps all of it resident.
        tracing::debug!(path = %path.display(), "cannot copy the cache entry, loading it from memory: {err}");
        // SAFETY: as below; the bytes are this process's own, verified.
        return Ok(unsafe { Component::deserialize(engine, code) }?);
    }
    // SAFETY: the code's seal verified: a host holding this cache's key wrote it from
    // `precompile_component` output of an engine with the same compatibility hash (part
    // of the name); wasmtime checks the header and the engine settings again. The copy
    // was created by this process (create_new, mode 0600, a name of its own) in a
    // directory no one else may write to (`check_dir`), and is unlinked right after it
    // is mapped.
    let component = unsafe { Component::deserialize_file(engine, &copy) };
    let _ = std::fs::remove_file(&copy);
    Ok(component?)
}

#[allow(unsafe_code)]
fn deserialize_bytes(engine: &Engine, serialized: &[u8]) -> wasmtime::Result<Component> {
    // SAFETY: `serialized` was produced by `precompile_component` of this very engine.
    unsafe { Component::deserialize(engine, serialized) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file standing for a cache entry, dated `age_secs` ago.
    fn entry(dir: &Path, name: &str, age_secs: u64) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, b"compiled").unwrap();
        let file = std::fs::File::options().append(true).open(&path).unwrap();
        file.set_modified(SystemTime::now() - Duration::from_secs(age_secs))
            .unwrap();
        path
    }

    fn files(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn eviction_keeps_held_entries_and_the_most_recently_used_others() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let held = entry(d, "held-0.cwasm", 10_000);
        let _hold = CacheEntry::hold(&held);
        for i in 0..5 {
            entry(d, &format!("e{i}-0.cwasm"), 100 * (5 - i));
        }
        entry(d, "old.tmp42", 2 * STRAY_AGE.as_secs());
        entry(d, "young.tmp43", 1);
        entry(d, "old.load42-0", 2 * STRAY_AGE.as_secs());
        entry(d, "unrelated.txt", 2 * STRAY_AGE.as_secs());
        assert_eq!(evict(d, 2), 5);
        assert_eq!(
            files(d),
            [
                "e3-0.cwasm",
                "e4-0.cwasm",
                "held-0.cwasm",
                "unrelated.txt",
                "young.tmp43"
            ]
        );
        // An entry another process holds (a shared lock) stays too.
        let theirs = std::fs::File::open(d.join("e3-0.cwasm")).unwrap();
        theirs.lock_shared().unwrap();
        assert_eq!(evict(d, 0), 1, "e4 went, e3 is held elsewhere");
        assert!(files(d).contains(&"e3-0.cwasm".to_string()));
        drop(theirs);
        entry(d, "e4-0.cwasm", 50);
        // A use makes an entry the most recent.
        mark_used(&d.join("e3-0.cwasm"));
        entry(d, "e5-0.cwasm", 0);
        evict(d, 2);
        assert!(files(d).contains(&"e3-0.cwasm".to_string()));
        assert!(!files(d).contains(&"e4-0.cwasm".to_string()));
    }

    #[test]
    fn plugins_loaded_and_removed_leave_the_cache_as_it_was() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        // A cache in its steady state: full of entries of earlier runs.
        for i in 0..KEPT_UNUSED {
            entry(d, &format!("earlier{i}-0.cwasm"), 1_000 + i as u64);
        }
        let cwasm = |d: &Path| files(d).iter().filter(|f| f.ends_with(".cwasm")).count();
        let mut loaded: std::collections::VecDeque<CacheEntry> = Default::default();
        for i in 0..1_000 {
            // At most three versions are loaded at once: the oldest is removed first.
            if loaded.len() == 3 {
                loaded.pop_front();
            }
            // A plugin version loaded: its entry is held, then written, then the
            // directory is evicted, as `compile` does.
            let path = d.join(format!("v{i}-0.cwasm"));
            loaded.push_back(CacheEntry::hold(&path));
            std::fs::write(&path, b"compiled").unwrap();
            evict(d, KEPT_UNUSED);
            assert!(path.exists(), "a loaded plugin's entry stays");
            assert!(cwasm(d) <= loaded.len() + KEPT_UNUSED, "{:?}", files(d));
        }
        loaded.clear();
        evict(d, KEPT_UNUSED);
        assert_eq!(cwasm(d), KEPT_UNUSED);
    }

    /// `component` with a custom section named `name` at the end: other bytes (another
    /// sha256), the same plugin.
    fn variant(component: &[u8], name: &str) -> Vec<u8> {
        assert!(name.len() < 100);
        let mut out = component.to_vec();
        out.push(0); // custom section
        out.push(u8::try_from(name.len() + 1).unwrap());
        out.push(u8::try_from(name.len()).unwrap());
        out.extend_from_slice(name.as_bytes());
        out
    }

    #[test]
    fn a_loaded_plugins_entry_outlives_newer_ones_and_goes_once_it_is_unloaded() {
        let dir = tempfile::tempdir().unwrap();
        let sandbox = super::super::Sandbox::new(super::super::SandboxConfig {
            cache_dir: Some(dir.path().to_path_buf()),
            instances: 2,
            ..Default::default()
        })
        .unwrap();
        let path = crate::fixtures::test_plugin("fickle");
        let bytes = std::fs::read(&path).unwrap();
        let load = |name: &str| {
            sandbox
                .load_bytes_blocking(&variant(&bytes, name), &path)
                .unwrap()
        };
        let entry_of = |p: &super::super::Plugin| {
            files(dir.path())
                .into_iter()
                .find(|f| f.starts_with(p.sha256()))
                .unwrap_or_else(|| panic!("no entry of {}", p.sha256()))
        };
        let first = load("first");
        let first_entry = entry_of(&first);
        // Newer entries of plugins no longer loaded, as many as are kept.
        for i in 0..KEPT_UNUSED {
            let newer = dir.path().join(format!("newer{i}-0.cwasm"));
            std::fs::write(&newer, b"compiled").unwrap();
            let file = std::fs::File::options().append(true).open(&newer).unwrap();
            file.set_modified(SystemTime::now() + Duration::from_secs(3600))
                .unwrap();
        }
        let second = load("second");
        assert!(files(dir.path()).contains(&first_entry), "loaded: kept");
        drop(first);
        let third = load("third");
        assert!(
            !files(dir.path()).contains(&first_entry),
            "unloaded and oldest: evicted"
        );
        entry_of(&second);
        entry_of(&third);
    }
}
