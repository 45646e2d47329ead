//! Where a serving file's next version waits: the shadow file's name (`NAME.next.wasm`)
//! and the slot the registry fills and the controller reads, with the canary that lets
//! it serve a share of the parents.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use super::canary::Canary;
use crate::plugin::Plugin;

/// How a shadow file is named: `NAME.next.wasm` (or `NAME.next.oci`, a reference to a
/// registry) shadows `NAME.wasm` (or `NAME.oci`).
pub const SHADOW_SUFFIX: &str = ".next.wasm";
/// The shadow suffix of an OCI reference file.
pub const SHADOW_OCI_SUFFIX: &str = ".next.oci";

/// The serving files `path` may shadow, if it is a shadow file: `NAME.wasm` then
/// `NAME.oci` (the registry takes the one present).
pub fn shadowed_by(path: &Path) -> Option<[PathBuf; 2]> {
    let name = path.file_name()?.to_str()?;
    let stem = name
        .strip_suffix(SHADOW_SUFFIX)
        .or_else(|| name.strip_suffix(SHADOW_OCI_SUFFIX))?;
    (!stem.is_empty()).then(|| {
        [
            path.with_file_name(format!("{stem}.wasm")),
            path.with_file_name(format!("{stem}.oci")),
        ]
    })
}

/// The shadow of one serving file, shared by the registry (which loads and unloads it)
/// and the file's controller (which calls it): empty while there is none.
#[derive(Clone, Default)]
pub struct ShadowSlot {
    /// The serving file, as `/plugins` names it.
    file: String,
    plugin: Arc<RwLock<Option<Plugin>>>,
    /// With `--canary`: the shadow's canary, which lets it serve a share of parents.
    canary: Arc<RwLock<Option<Arc<Canary>>>>,
}

impl ShadowSlot {
    /// An empty slot for the serving file `file`.
    pub fn new(file: &Path) -> Self {
        ShadowSlot {
            file: file.display().to_string(),
            plugin: Arc::default(),
            canary: Arc::default(),
        }
    }

    /// The shadow now, if any.
    pub fn get(&self) -> Option<Plugin> {
        self.plugin.read().expect("shadow lock").clone()
    }

    /// Puts `plugin` in (none: takes the shadow out), with its canary if it is one.
    pub fn set(&self, plugin: Option<Plugin>, canary: Option<Arc<Canary>>) {
        let mut slot = self.plugin.write().expect("shadow lock");
        *self.canary.write().expect("shadow lock") = canary.filter(|_| plugin.is_some());
        *slot = plugin;
    }

    /// The shadow and its canary, if it is one (`--canary`).
    pub fn canary(&self) -> Option<(Plugin, Arc<Canary>)> {
        let plugin = self.plugin.read().expect("shadow lock");
        let canary = self.canary.read().expect("shadow lock");
        Some((plugin.clone()?, canary.clone()?))
    }

    /// The serving file.
    pub fn file(&self) -> &str {
        &self.file
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shadow_file_names_the_file_it_shadows() {
        let both = Some([PathBuf::from("/p/uuid.wasm"), PathBuf::from("/p/uuid.oci")]);
        assert_eq!(shadowed_by(Path::new("/p/uuid.next.wasm")), both);
        assert_eq!(shadowed_by(Path::new("/p/uuid.next.oci")), both);
        assert_eq!(shadowed_by(Path::new("/p/uuid.oci")), None);
        assert_eq!(shadowed_by(Path::new("/p/uuid.wasm")), None);
        assert_eq!(shadowed_by(Path::new("/p/.next.wasm")), None);
    }
}
