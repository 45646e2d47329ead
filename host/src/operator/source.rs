//! Where the registry's plugins come from, and whether they are trusted.
//!
//! - `NAME.wasm` in the plugin directory: the file's bytes. With `--verify-key`, its
//!   signature `NAME.wasm.sig` (cosign `sign-blob`) must verify first.
//! - `NAME.oci` in the plugin directory: a small file naming an OCI reference (one line,
//!   `oci://REGISTRY/REPOSITORY:TAG` or `…@sha256:…`; `#` comments): the component
//!   pulled from the registry by digest ([`crate::oci`]), verified with `--verify-key`.
//! - `--plugin oci://…` on the command line: the same, without a file (its limits are
//!   the sandbox's defaults; a reference file takes a limits file `NAME.toml` beside it).
//!
//! A reference is resolved again every `--oci-refresh-seconds`: when its tag names a new
//! digest, the new component is a new version of that plugin, which replaces the one
//! serving as a changed file would, or with `--canary` becomes its candidate (the
//! registry's `stage`); a tag named in `NAME.next.oci` shadows, or with `--canary`
//! serves a share, like `NAME.next.wasm`. While a registry cannot be reached, the
//! version already serving keeps serving.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::oci::{self, OciStore};
use crate::plugin::{LoadError, Plugin, SandboxConfig, limits};
use crate::signature::{VerifyKey, sig_file_of};

/// Compiles, links and describes a plugin from its bytes; the path names them (the
/// sandbox's loader, or a test's).
pub type Loader = Arc<dyn Fn(&[u8], &Path) -> Result<Plugin, LoadError> + Send + Sync>;

/// A file whose modification time is younger than this may still be being written: it
/// is loaded once it is this old, or once it kept its size and time for a poll interval.
pub const SETTLE: Duration = Duration::from_millis(500);

/// The extension of an OCI reference file.
pub const REFERENCE_EXTENSION: &str = "oci";

/// Why the plugin entries could not be listed.
#[derive(Debug, thiserror::Error)]
pub enum ListError {
    /// The plugin directory could not be read.
    #[error("cannot read the plugin directory {}: {source}", dir.display())]
    ReadDir {
        /// The directory.
        dir: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The listing's task did not complete.
    #[error("the scan of the plugin directory did not complete: {0}")]
    Aborted(#[source] tokio::task::JoinError),
}

/// Where plugins come from, and the key they must be signed with.
#[derive(Clone)]
pub struct PluginSource {
    oci: Arc<OciStore>,
    verify: Option<VerifyKey>,
    /// `--plugin oci://…`, as given.
    references: Vec<String>,
    /// How often references are resolved again.
    refresh: Duration,
}

impl std::fmt::Debug for PluginSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PluginSource")
            .field("references", &self.references)
            .field("refresh", &self.refresh)
            .field(
                "verify",
                &self.verify.as_ref().map(|k| k.path().to_path_buf()),
            )
            .finish()
    }
}

/// (size, mtime) of a file.
pub type FileStamp = (u64, SystemTime);

/// What tells the registry a plugin entry changed: its file, and its signature file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    /// The plugin (or reference) file's (size, mtime); the epoch for `--plugin oci://`.
    pub file: FileStamp,
    /// The signature file's, when there is one.
    pub sig: Option<FileStamp>,
}

impl Stamp {
    /// Whether a part was written less than `settle` ago (it may still be being written).
    pub fn young(&self, settle: Duration) -> bool {
        let young = |(_, mtime): FileStamp| mtime.elapsed().is_ok_and(|age| age < settle);
        young(self.file) || self.sig.is_some_and(young)
    }
}

/// A plugin entry as the listing saw it.
#[derive(Debug, Clone, Copy)]
pub struct Listed {
    /// Its stamp.
    pub stamp: Stamp,
    /// The (size, mtime) of its limits file, if it has one.
    pub limits: Option<FileStamp>,
}

impl PluginSource {
    /// Plugins from files, references and `references`, with `oci` pulling them and,
    /// with `verify`, only signed ones accepted.
    pub fn new(
        oci: OciStore,
        verify: Option<VerifyKey>,
        references: Vec<String>,
        refresh: Duration,
    ) -> Self {
        PluginSource {
            oci: Arc::new(oci),
            verify,
            references,
            refresh,
        }
    }

    /// Files only, unsigned accepted (tests).
    #[cfg(test)]
    pub fn files_only() -> Self {
        Self::new(
            OciStore::new(oci::OciOptions {
                cache: std::env::temp_dir().join("capstan-test-oci"),
                ..Default::default()
            }),
            None,
            Vec::new(),
            Duration::from_secs(60),
        )
    }

    /// How often references are resolved again.
    pub fn refresh(&self) -> Duration {
        self.refresh
    }

    /// Checks the `--plugin` references; the first that does not parse.
    pub fn check_references(&self) -> Result<(), oci::OciError> {
        for reference in &self.references {
            oci::parse_reference(reference)?;
        }
        Ok(())
    }

    /// [`PluginSource::list_blocking`] on a blocking thread (a slow volume must not hold
    /// a runtime worker): what the registry and a standby's webhook both list.
    pub async fn list(&self, dir: &Path) -> Result<BTreeMap<PathBuf, Listed>, ListError> {
        let (source, dir) = (self.clone(), dir.to_path_buf());
        tokio::task::spawn_blocking(move || {
            source
                .list_blocking(&dir)
                .map_err(|source| ListError::ReadDir { dir, source })
        })
        .await
        .map_err(ListError::Aborted)?
    }

    /// Every plugin entry: the `*.wasm` and `*.oci` files of `dir` (following symlinks),
    /// then the `--plugin` references, by name. Blocking: call it on a blocking thread.
    pub fn list_blocking(&self, dir: &Path) -> std::io::Result<BTreeMap<PathBuf, Listed>> {
        let mut out = BTreeMap::new();
        for entry in std::fs::read_dir(dir)? {
            let path = entry?.path();
            let wasm = path.extension().is_some_and(|e| e == "wasm");
            if !wasm && path.extension().is_none_or(|e| e != REFERENCE_EXTENSION) {
                continue;
            }
            let Some(file) = file_stamp(&path) else {
                continue;
            };
            let sig = wasm.then(|| file_stamp(&sig_file_of(&path))).flatten();
            out.insert(
                path.clone(),
                Listed {
                    stamp: Stamp { file, sig },
                    limits: file_stamp(&limits::file_of(&path)),
                },
            );
        }
        for reference in &self.references {
            out.insert(
                PathBuf::from(reference),
                Listed {
                    stamp: Stamp {
                        file: (0, SystemTime::UNIX_EPOCH),
                        sig: None,
                    },
                    limits: None,
                },
            );
        }
        Ok(out)
    }

    /// Whether `path` is pulled from a registry (and resolved again on the schedule).
    pub fn is_remote(path: &Path) -> bool {
        path.to_str().is_some_and(|p| p.starts_with(oci::SCHEME))
            || path.extension().is_some_and(|e| e == REFERENCE_EXTENSION)
    }

    /// The bytes of the plugin `path` names, once trusted: a file's (with its signature
    /// verified when a key is set), or a reference's component pulled by digest. The
    /// error is one line that names `path`.
    pub async fn read(&self, path: &Path) -> Result<Vec<u8>, String> {
        let reference = match path.to_str() {
            Some(p) if p.starts_with(oci::SCHEME) => p.to_string(),
            _ if path.extension().is_some_and(|e| e == REFERENCE_EXTENSION) => {
                let text = tokio::fs::read_to_string(path)
                    .await
                    .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
                reference_in(&text)
                    .ok_or_else(|| format!("{} names no OCI reference", path.display()))?
            }
            _ => return self.read_file(path).await,
        };
        let parsed =
            oci::parse_reference(&reference).map_err(|e| format!("{}: {e}", path.display()))?;
        let pulled = self.oci.pull(&parsed).await.map_err(|e| {
            if path.to_str() == Some(reference.as_str()) {
                e.to_string()
            } else {
                format!("{}: {e}", path.display())
            }
        })?;
        tracing::debug!(plugin = %path.display(), digest = %pulled.digest, "resolved");
        Ok(pulled.bytes)
    }

    async fn read_file(&self, path: &Path) -> Result<Vec<u8>, String> {
        let bytes = tokio::fs::read(path)
            .await
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        if let Some(key) = &self.verify {
            let sig_file = sig_file_of(path);
            let signature = match tokio::fs::read_to_string(&sig_file).await {
                Ok(text) => text,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return Err(format!(
                        "{}: refused: unsigned (no {}) and --verify-key {} is set",
                        path.display(),
                        sig_file.display(),
                        key.path().display()
                    ));
                }
                Err(e) => return Err(format!("cannot read {}: {e}", sig_file.display())),
            };
            key.verify(&bytes, &signature).map_err(|e| {
                format!(
                    "{}: refused: {} does not verify with {}: {e}",
                    path.display(),
                    sig_file.display(),
                    key.path().display()
                )
            })?;
        }
        Ok(bytes)
    }
}

/// The reference a reference file names: its first line that is neither empty nor a
/// `#` comment.
fn reference_in(text: &str) -> Option<String> {
    text.lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_string)
}

/// (size, mtime) of `path`, following symlinks; `None` when it is not a file.
pub fn file_stamp(path: &Path) -> Option<FileStamp> {
    let meta = std::fs::metadata(path).ok().filter(|m| m.is_file())?;
    Some((
        meta.len(),
        meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
    ))
}

/// The entries of `known` that `present` no longer lists.
pub fn gone<V, W>(known: &BTreeMap<PathBuf, V>, present: &BTreeMap<PathBuf, W>) -> Vec<PathBuf> {
    known
        .keys()
        .filter(|p| !present.contains_key(*p))
        .cloned()
        .collect()
}

/// The limits file of the plugin `path`, if there is a valid one, read on a blocking
/// thread (a slow volume must not hold a runtime worker). A bad one is reported when
/// the registry applies the serving version's limits.
pub async fn read_limits(path: &Path, config: &SandboxConfig) -> Option<limits::LimitsFile> {
    let (path, config) = (path.to_path_buf(), config.clone());
    tokio::task::spawn_blocking(move || limits::read(&path, &config))
        .await
        .ok()?
        .ok()
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::signature::SigningKey;

    fn source(verify: Option<VerifyKey>) -> PluginSource {
        PluginSource::new(
            OciStore::new(oci::OciOptions::default()),
            verify,
            vec!["oci://127.0.0.1:1/plugins/x:1".into()],
            Duration::from_secs(60),
        )
    }

    #[test]
    fn a_reference_file_names_its_first_line_that_is_not_a_comment() {
        assert_eq!(
            reference_in("# the uuid plugin\n\n  oci://r.example/p/uuid:1  \nignored\n").as_deref(),
            Some("oci://r.example/p/uuid:1")
        );
        assert_eq!(reference_in("# nothing\n\n"), None);
    }

    #[test]
    fn the_listing_has_plugins_references_and_signature_stamps() {
        let dir = tempfile::tempdir().unwrap();
        for name in ["a.wasm", "a.wasm.sig", "b.oci", "c.txt", "d.toml"] {
            std::fs::write(dir.path().join(name), name).unwrap();
        }
        let listed = source(None).list_blocking(dir.path()).unwrap();
        let names: Vec<String> = listed.keys().map(|p| p.display().to_string()).collect();
        assert_eq!(
            names,
            [
                dir.path().join("a.wasm").display().to_string(),
                dir.path().join("b.oci").display().to_string(),
                "oci://127.0.0.1:1/plugins/x:1".to_string(),
            ]
        );
        assert!(listed[&dir.path().join("a.wasm")].stamp.sig.is_some());
        assert!(listed[&dir.path().join("b.oci")].stamp.sig.is_none());
        assert!(PluginSource::is_remote(&dir.path().join("b.oci")));
        assert!(PluginSource::is_remote(Path::new("oci://r.example/p/x:1")));
        assert!(!PluginSource::is_remote(&dir.path().join("a.wasm")));
    }

    #[tokio::test]
    async fn with_a_key_a_file_is_read_only_with_a_signature_that_verifies() {
        let dir = tempfile::tempdir().unwrap();
        let key = SigningKey::from_scalar([5; 32]);
        let public = VerifyKey::from_pem(&key.public_pem(), Path::new("k.pub")).unwrap();
        let wasm = dir.path().join("p.wasm");
        std::fs::write(&wasm, b"the plugin").unwrap();
        let source = source(Some(public));

        let err = source.read(&wasm).await.unwrap_err();
        assert!(
            err.contains("refused: unsigned (no") && err.contains("p.wasm.sig"),
            "{err}"
        );

        std::fs::write(
            sig_file_of(&wasm),
            SigningKey::from_scalar([6; 32]).sign(b"the plugin"),
        )
        .unwrap();
        let err = source.read(&wasm).await.unwrap_err();
        assert!(err.contains("does not verify with k.pub"), "{err}");

        std::fs::write(sig_file_of(&wasm), key.sign(b"the plugin")).unwrap();
        assert_eq!(source.read(&wasm).await.unwrap(), b"the plugin");

        // Signed bytes, then the file changed: refused again.
        std::fs::write(&wasm, b"the plugin, changed").unwrap();
        let err = source.read(&wasm).await.unwrap_err();
        assert!(err.contains("does not verify"), "{err}");
        // Without a key, anything is read.
        assert!(self::source(None).read(&wasm).await.is_ok());
    }

    #[tokio::test]
    async fn a_bad_reference_file_is_one_line_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("x.oci");
        std::fs::write(&file, "# only a comment\n").unwrap();
        let err = source(None).read(&file).await.unwrap_err();
        assert_eq!(err, format!("{} names no OCI reference", file.display()));
        std::fs::write(&file, "uuid:1.0\n").unwrap();
        let err = source(None).read(&file).await.unwrap_err();
        assert!(
            err.starts_with(&format!(
                "{}: \"uuid:1.0\" is not an OCI reference",
                file.display()
            )),
            "{err}"
        );
        assert!(!err.contains('\n'));
    }
}
