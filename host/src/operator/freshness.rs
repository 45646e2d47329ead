//! Read-your-own-writes for a reconcile, on top of caches that lag.
//!
//! - [`OwnWrites`]: the parent as the host's last write returned it (status,
//!   finalizers), used instead of the cached parent until the parent cache shows that
//!   write. Without it, a reconcile that follows a status write by a few milliseconds
//!   (its children's watch events trigger it) computes and writes the status from the
//!   cached, older parent, and the resourceVersion precondition answers 409.
//! - [`AppliedChildren`]: what the host last applied to each child and the version the
//!   API server gave back. A child whose cached version is still that one and whose
//!   desired manifest did not change is exactly what the apply made; applying it again
//!   would be a no-op request, so it is skipped. Any other writer, a hand edit or a
//!   deletion changes the version, and the next reconcile applies again.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kube::api::DynamicObject;
use kube::{Resource, ResourceExt};
use serde_json::Value;

use super::children::{Key, is_at_least};
use super::parent::{CachedParent, ParentKind};

/// How long a written parent is kept for a cache that never shows it (the parent was
/// deleted, or the watch relisted past it): far longer than any watch lag.
const OWN_WRITE_LIFETIME: Duration = Duration::from_secs(120);

/// The host's latest writes of parents, by UID, until the parent cache catches up.
#[derive(Default)]
pub struct OwnWrites {
    written: Mutex<HashMap<String, (Arc<DynamicObject>, Instant)>>,
}

impl OwnWrites {
    /// Remembers `obj` as the API server returned it after a write by this host, and
    /// returns it as a reconcile should see it.
    pub fn remember(&self, mut obj: DynamicObject) -> Arc<DynamicObject> {
        // The caches hold no managedFields; neither does what stands in for them.
        obj.managed_fields_mut().clear();
        let obj = Arc::new(obj);
        let Some(uid) = obj.metadata.uid.clone() else {
            return obj;
        };
        let mut written = self.written.lock().expect("own writes lock");
        if written.len() >= 1024 && written.len().is_power_of_two() {
            let now = Instant::now();
            written.retain(|_, (_, at)| now.duration_since(*at) < OWN_WRITE_LIFETIME);
        }
        written.insert(uid, (obj.clone(), Instant::now()));
        obj
    }

    /// The newer of the cached parent (of kind `kind`) and the host's own last write of
    /// it. Once the cache shows the write (or anything later), the write is forgotten.
    pub fn freshest(&self, cached: &CachedParent, kind: &ParentKind) -> Arc<DynamicObject> {
        let meta = cached.meta();
        let Some(uid) = meta.uid.as_deref() else {
            return Arc::new(cached.to_dynamic(kind));
        };
        let mut written = self.written.lock().expect("own writes lock");
        let Some((own, at)) = written.get(uid) else {
            return Arc::new(cached.to_dynamic(kind));
        };
        let cached_rv = meta.resource_version.as_deref();
        let own_rv = own.metadata.resource_version.as_deref();
        // Versions that do not compare (not etcd revisions) trust the cache.
        if !is_at_least(cached_rv, own_rv)
            && is_at_least(own_rv, cached_rv)
            && at.elapsed() < OWN_WRITE_LIFETIME
        {
            return own.clone();
        }
        written.remove(uid);
        Arc::new(cached.to_dynamic(kind))
    }

    /// Told of every parent the parent watch delivers: a write the cache now shows (or
    /// went past) is forgotten, so that the map only holds writes still in flight.
    pub fn seen(&self, cached: &CachedParent) {
        let meta = cached.meta();
        let Some(uid) = meta.uid.as_deref() else {
            return;
        };
        let mut written = self.written.lock().expect("own writes lock");
        if let Some((own, _)) = written.get(uid)
            && is_at_least(
                meta.resource_version.as_deref(),
                own.metadata.resource_version.as_deref(),
            )
        {
            written.remove(uid);
        }
    }

    /// Forgets the parent `uid` (deleted).
    pub fn forget(&self, uid: &str) {
        self.written.lock().expect("own writes lock").remove(uid);
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.written.lock().unwrap().len()
    }
}

/// Per child (kind index, key): the hash of the manifest last applied and the
/// resourceVersion that apply returned.
#[derive(Default)]
pub struct AppliedChildren {
    applied: Mutex<HashMap<(usize, Key), (u64, String)>>,
}

impl AppliedChildren {
    /// Whether applying `manifest` to the child at `key`, cached at `cached_rv`, would
    /// change nothing: the host's last apply of it wrote this same manifest and nobody
    /// wrote the object since.
    pub fn unchanged(
        &self,
        index: usize,
        key: &Key,
        manifest: &Value,
        cached_rv: Option<&str>,
    ) -> bool {
        let Some(cached_rv) = cached_rv else {
            return false;
        };
        let applied = self.applied.lock().expect("applied children lock");
        applied
            .get(&(index, key.clone()))
            .is_some_and(|(hash, rv)| *hash == manifest_hash(manifest) && rv == cached_rv)
    }

    /// Records that `manifest` was applied to the child at `key` and the API server
    /// returned `rv`. `live` is asked, when the map has grown, which recorded children
    /// still exist (the others went with their parents).
    pub fn record(
        &self,
        index: usize,
        key: Key,
        manifest: &Value,
        rv: Option<String>,
        live: impl Fn(usize, &Key) -> bool,
    ) {
        let mut applied = self.applied.lock().expect("applied children lock");
        let Some(rv) = rv else {
            applied.remove(&(index, key));
            return;
        };
        if applied.len() >= 1024 && applied.len().is_power_of_two() {
            applied.retain(|(i, k), _| live(*i, k));
        }
        applied.insert((index, key), (manifest_hash(manifest), rv));
    }

    /// Forgets the child at `key` (pruned).
    pub fn forget(&self, index: usize, key: &Key) {
        self.applied
            .lock()
            .expect("applied children lock")
            .remove(&(index, key.clone()));
    }
}

/// A hash of a manifest's JSON, stable within the process.
fn manifest_hash(manifest: &Value) -> u64 {
    let mut h = DefaultHasher::new();
    manifest.to_string().hash(&mut h);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::api::ApiResource;
    use serde_json::json;

    fn parent(uid: &str, rv: &str, status: &str) -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "example.com/v1", "kind": "Widget",
            "metadata": {"name": "w", "namespace": "ns", "uid": uid, "resourceVersion": rv,
                "managedFields": [{"manager": "m", "operation": "Apply"}]},
            "status": {"phase": status},
        }))
        .unwrap()
    }

    fn cached(uid: &str, rv: &str, status: &str) -> CachedParent {
        CachedParent::new(parent(uid, rv, status))
    }

    fn kind() -> ParentKind {
        ParentKind::new(ApiResource::from_gvk_with_plural(
            &kube::api::GroupVersionKind::gvk("example.com", "v1", "Widget"),
            "widgets",
        ))
    }

    #[test]
    fn the_own_write_stands_in_until_the_cache_shows_it() {
        let own = OwnWrites::default();
        own.remember(parent("u1", "12", "written"));
        // The cache is older: the write is used, without its managedFields.
        let used = own.freshest(&cached("u1", "10", "stale"), &kind());
        assert_eq!(used.data["status"]["phase"], "written");
        assert!(
            used.metadata
                .managed_fields
                .iter()
                .flatten()
                .next()
                .is_none()
        );
        // Other parents are untouched.
        assert_eq!(
            own.freshest(&cached("u2", "3", "other"), &kind()).data["status"]["phase"],
            "other"
        );
        // The cache caught up (or went past it): the cache wins and the write is gone.
        assert_eq!(
            own.freshest(&cached("u1", "15", "newer"), &kind()).data["status"]["phase"],
            "newer"
        );
        assert_eq!(own.len(), 0);
        assert_eq!(
            own.freshest(&cached("u1", "11", "stale again"), &kind())
                .data["status"]["phase"],
            "stale again"
        );
    }

    #[test]
    fn the_parent_watch_clears_writes_it_delivered() {
        let own = OwnWrites::default();
        own.remember(parent("u1", "12", "written"));
        own.remember(parent("u2", "20", "written"));
        own.seen(&cached("u1", "11", "older event"));
        own.seen(&cached("u2", "21", "later event"));
        assert_eq!(own.len(), 1);
        own.seen(&cached("u1", "12", "the write itself"));
        assert_eq!(own.len(), 0);
    }

    #[test]
    fn versions_that_do_not_compare_trust_the_cache() {
        let own = OwnWrites::default();
        own.remember(parent("u1", "abc", "written"));
        assert_eq!(
            own.freshest(&cached("u1", "xyz", "cached"), &kind()).data["status"]["phase"],
            "cached"
        );
        own.remember(parent("u1", "abc", "written"));
        own.forget("u1");
        assert_eq!(own.len(), 0);
    }

    fn key(name: &str) -> Key {
        (Some("ns".into()), name.into())
    }

    #[test]
    fn a_child_is_unchanged_only_at_the_applied_version_with_the_same_manifest() {
        let applied = AppliedChildren::default();
        let manifest = json!({"kind": "ConfigMap", "data": {"a": "1"}});
        assert!(!applied.unchanged(0, &key("c"), &manifest, Some("5")));
        applied.record(0, key("c"), &manifest, Some("5".into()), |_, _| true);
        assert!(applied.unchanged(0, &key("c"), &manifest, Some("5")));
        // Someone wrote it since (a hand edit): apply again.
        assert!(!applied.unchanged(0, &key("c"), &manifest, Some("6")));
        // The plugin wants something else now.
        let other = json!({"kind": "ConfigMap", "data": {"a": "2"}});
        assert!(!applied.unchanged(0, &key("c"), &other, Some("5")));
        // Another kind at the same name, or no version known.
        assert!(!applied.unchanged(1, &key("c"), &manifest, Some("5")));
        assert!(!applied.unchanged(0, &key("c"), &manifest, None));
        applied.forget(0, &key("c"));
        assert!(!applied.unchanged(0, &key("c"), &manifest, Some("5")));
    }

    #[test]
    fn records_of_children_that_are_gone_are_swept_as_the_map_grows() {
        let applied = AppliedChildren::default();
        let manifest = json!({});
        for i in 0..1024 {
            applied.record(
                0,
                key(&format!("c{i}")),
                &manifest,
                Some("1".into()),
                |_, _| true,
            );
        }
        // At 1024 entries the next record sweeps: only even names are still live.
        applied.record(0, key("new"), &manifest, Some("1".into()), |_, k| {
            k.1.trim_start_matches('c')
                .parse::<u32>()
                .is_ok_and(|n| n % 2 == 0)
        });
        assert!(applied.unchanged(0, &key("c2"), &manifest, Some("1")));
        assert!(!applied.unchanged(0, &key("c3"), &manifest, Some("1")));
        assert!(applied.unchanged(0, &key("new"), &manifest, Some("1")));
        assert_eq!(applied.applied.lock().unwrap().len(), 513);
    }
}
