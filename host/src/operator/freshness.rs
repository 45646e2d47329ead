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
//! - [`Expectations`]: what the host wrote for each parent's children, which the child
//!   caches must show before the parent's next reconcile may trust them.
//!
//! Every map here is swept by age or liveness as it is used, so that parents and
//! children that come and go leave nothing behind.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kube::api::DynamicObject;
use kube::{Resource, ResourceExt};
use serde_json::Value;

use super::children::{Cached, Key};
use super::parent::{CachedParent, ParentKind};

/// How long a written parent is kept for a cache that never shows it (the parent was
/// deleted, or the watch relisted past it): far longer than any watch lag.
const OWN_WRITE_LIFETIME: Duration = Duration::from_secs(120);

/// The longest time between two sweeps of a map of this module that is in use.
const SWEEP_PERIOD: Duration = Duration::from_secs(120);

/// When a map is swept: as it grows, each time it reaches a power of two from 1024
/// entries on (the cost stays proportional to the growth); and at least once per
/// [`SWEEP_PERIOD`] while it is used, so that what parents that are gone left behind
/// does not stay until the map grows again.
struct SweepClock {
    /// When the map was last swept; none: a sweep is due.
    last: Option<Instant>,
}

impl SweepClock {
    fn new(now: Instant) -> Self {
        SweepClock { last: Some(now) }
    }

    /// Whether a map of `len` entries is to be swept now (then the clock restarts).
    fn due(&mut self, len: usize, now: Instant) -> bool {
        let due = (len >= 1024 && len.is_power_of_two())
            || self
                .last
                .is_none_or(|last| now.saturating_duration_since(last) >= SWEEP_PERIOD);
        if due {
            self.last = Some(now);
        }
        due
    }

    /// Makes the next use sweep, as if the period had passed (tests).
    #[cfg(test)]
    fn make_due(&mut self) {
        self.last = None;
    }
}

/// The host's latest writes of parents, by UID, until the parent cache catches up.
pub struct OwnWrites {
    written: Mutex<(WrittenParents, SweepClock)>,
}

/// By parent UID: the parent as written, and when.
type WrittenParents = HashMap<String, (Arc<DynamicObject>, Instant)>;

impl Default for OwnWrites {
    fn default() -> Self {
        OwnWrites {
            written: Mutex::new((HashMap::new(), SweepClock::new(Instant::now()))),
        }
    }
}

impl OwnWrites {
    /// Remembers `obj` as the API server returned it after a write by this host, and
    /// returns it as a reconcile should see it.
    pub fn remember(&self, obj: DynamicObject) -> Arc<DynamicObject> {
        self.remember_at(obj, Instant::now())
    }

    fn remember_at(&self, mut obj: DynamicObject, now: Instant) -> Arc<DynamicObject> {
        // The caches hold no managedFields; neither does what stands in for them.
        obj.managed_fields_mut().clear();
        let obj = Arc::new(obj);
        let Some(uid) = obj.metadata.uid.clone() else {
            return obj;
        };
        let mut guard = self.written.lock().expect("own writes lock");
        let (written, clock) = &mut *guard;
        if clock.due(written.len(), now) {
            written.retain(|_, (_, at)| now.saturating_duration_since(*at) < OWN_WRITE_LIFETIME);
        }
        written.insert(uid, (obj.clone(), now));
        obj
    }

    /// The newer of the cached parent (of kind `kind`) and the host's own last write of
    /// it. Once the cache shows the write (or anything later), the write is forgotten.
    pub fn freshest(&self, cached: &CachedParent, kind: &ParentKind) -> Arc<DynamicObject> {
        let meta = cached.meta();
        let Some(uid) = meta.uid.as_deref() else {
            return Arc::new(cached.to_dynamic(kind));
        };
        let mut guard = self.written.lock().expect("own writes lock");
        let written = &mut guard.0;
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
        let mut guard = self.written.lock().expect("own writes lock");
        let written = &mut guard.0;
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
        self.written.lock().expect("own writes lock").0.remove(uid);
    }

    /// How many writes are remembered.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.written.lock().unwrap().0.len()
    }

    /// Makes the next write sweep, as if the period had passed.
    #[cfg(test)]
    pub(super) fn make_sweep_due(&self) {
        self.written.lock().unwrap().1.make_due();
    }
}

/// Per child (kind index, key): the hash of the manifest last applied and the
/// resourceVersion that apply returned.
pub struct AppliedChildren {
    applied: Mutex<(AppliedByChild, SweepClock)>,
}

/// By (kind index, key): the manifest's hash and the resourceVersion written.
type AppliedByChild = HashMap<(usize, Key), (u64, String)>;

impl Default for AppliedChildren {
    fn default() -> Self {
        AppliedChildren {
            applied: Mutex::new((HashMap::new(), SweepClock::new(Instant::now()))),
        }
    }
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
            .0
            .get(&(index, key.clone()))
            .is_some_and(|(hash, rv)| *hash == manifest_hash(manifest) && rv == cached_rv)
    }

    /// Records that `manifest` was applied to the child at `key` and the API server
    /// returned `rv`. `live` is asked, when the map is swept, which recorded children
    /// still exist (the others went with their parents).
    pub fn record(
        &self,
        index: usize,
        key: Key,
        manifest: &Value,
        rv: Option<String>,
        live: impl Fn(usize, &Key) -> bool,
    ) {
        self.record_at(index, key, manifest, rv, live, Instant::now());
    }

    fn record_at(
        &self,
        index: usize,
        key: Key,
        manifest: &Value,
        rv: Option<String>,
        live: impl Fn(usize, &Key) -> bool,
        now: Instant,
    ) {
        let mut guard = self.applied.lock().expect("applied children lock");
        let (applied, clock) = &mut *guard;
        let Some(rv) = rv else {
            applied.remove(&(index, key));
            return;
        };
        if clock.due(applied.len(), now) {
            applied.retain(|(i, k), _| live(*i, k));
        }
        applied.insert((index, key), (manifest_hash(manifest), rv));
    }

    /// Forgets the child at `key` (pruned).
    pub fn forget(&self, index: usize, key: &Key) {
        self.applied
            .lock()
            .expect("applied children lock")
            .0
            .remove(&(index, key.clone()));
    }

    /// How many children are recorded.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.applied.lock().unwrap().0.len()
    }

    /// Makes the next record sweep, as if the period had passed.
    #[cfg(test)]
    pub(super) fn make_sweep_due(&self) {
        self.applied.lock().unwrap().1.make_due();
    }
}

/// A hash of a manifest's JSON, stable within the process.
fn manifest_hash(manifest: &Value) -> u64 {
    let mut h = DefaultHasher::new();
    manifest.to_string().hash(&mut h);
    h.finish()
}

/// What the host wrote for one parent, which the caches must show before the parent's
/// next reconcile may trust them (controller-runtime's "expectations").
#[derive(Debug, Clone, Default)]
pub struct Written {
    /// Children applied: (kind index, key, resourceVersion returned by the write).
    pub applied: Vec<(usize, Key, Option<String>)>,
    /// Children pruned: (kind index, key, UID deleted).
    pub pruned: Vec<(usize, Key, Option<String>)>,
}

impl Written {
    /// Whether nothing was written.
    pub fn is_empty(&self) -> bool {
        self.applied.is_empty() && self.pruned.is_empty()
    }
}

/// How long an expectation is kept at most. Past the reconcile's limit it only says
/// "trust the caches anyway"; and a parent deleted without a finalizer is never
/// reconciled again, so nothing but this sweep would remove its entry.
const EXPECTATION_LIFETIME: Duration = Duration::from_secs(120);

/// Per parent UID, the writes the caches have not shown yet.
pub struct Expectations {
    pending: Mutex<Pending>,
}

struct Pending {
    /// By parent UID: the writes, and when they were complete.
    by_parent: HashMap<String, (Written, Instant)>,
    clock: SweepClock,
}

impl Pending {
    /// Drops the entries older than [`EXPECTATION_LIFETIME`], when a sweep is due.
    fn sweep(&mut self, now: Instant) {
        if self.clock.due(self.by_parent.len(), now) {
            self.by_parent.retain(|_, (_, since)| {
                now.saturating_duration_since(*since) < EXPECTATION_LIFETIME
            });
        }
    }
}

impl Default for Expectations {
    fn default() -> Self {
        Expectations {
            pending: Mutex::new(Pending {
                by_parent: HashMap::new(),
                clock: SweepClock::new(Instant::now()),
            }),
        }
    }
}

/// Whether a parent's caches caught up with what was written for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheState {
    /// Nothing pending: the caches can be trusted.
    Current,
    /// Some writes are not in the caches yet: wait.
    Behind,
    /// Waited longer than the limit: trust the caches anyway (logged).
    GaveUp,
}

impl Expectations {
    /// Records what was written for the parent `uid` (nothing: forgets it). Call it
    /// once every write is complete: a cache that listed its kind after this call shows
    /// them all.
    pub fn expect(&self, uid: &str, written: Written) {
        self.expect_at(uid, written, Instant::now());
    }

    fn expect_at(&self, uid: &str, written: Written, now: Instant) {
        let mut pending = self.pending.lock().expect("expectations lock");
        pending.sweep(now);
        if written.is_empty() {
            pending.by_parent.remove(uid);
        } else {
            pending.by_parent.insert(uid.to_string(), (written, now));
        }
    }

    /// Forgets the parent `uid` (deleted).
    pub fn forget(&self, uid: &str) {
        self.pending
            .lock()
            .expect("expectations lock")
            .by_parent
            .remove(uid);
    }

    /// Whether the caches show everything written for `uid` (`seen` looks a key up by
    /// kind index); waits at most `limit` from the write.
    ///
    /// An applied child is shown by its written version or a later one, by a deletion
    /// after the write (deleted by hand or by someone else: waiting for the written
    /// version would wait forever), or by its absence from a list the cache made after
    /// the write (deleted while the watch was down: a re-list has no tombstones). A
    /// pruned child is shown by its absence or by another object (another UID) there.
    pub fn check(
        &self,
        uid: &str,
        seen: impl Fn(usize, &Key) -> Cached,
        limit: Duration,
    ) -> CacheState {
        let mut pending = self.pending.lock().expect("expectations lock");
        let Some((written, since)) = pending.by_parent.get(uid) else {
            return CacheState::Current;
        };
        let since = *since;
        let applied = written
            .applied
            .iter()
            .all(|(index, key, rv)| match seen(*index, key) {
                Cached::Present(obj) => {
                    is_at_least(obj.metadata.resource_version.as_deref(), rv.as_deref())
                }
                Cached::Deleted(at) => is_at_least(at.as_deref(), rv.as_deref()),
                Cached::Unlisted { listed_at } => listed_at >= since,
                Cached::Absent => false,
            });
        let pruned = written
            .pruned
            .iter()
            .all(|(index, key, uid)| match seen(*index, key) {
                Cached::Present(obj) => obj.metadata.uid != *uid,
                Cached::Deleted(_) | Cached::Unlisted { .. } | Cached::Absent => true,
            });
        if applied && pruned {
            pending.by_parent.remove(uid);
            CacheState::Current
        } else if since.elapsed() > limit {
            pending.by_parent.remove(uid);
            CacheState::GaveUp
        } else {
            CacheState::Behind
        }
    }

    /// How many parents have writes pending.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.pending.lock().unwrap().by_parent.len()
    }

    /// Makes the next write sweep, as if the period had passed.
    #[cfg(test)]
    pub(super) fn make_sweep_due(&self) {
        self.pending.lock().unwrap().clock.make_due();
    }
}

/// Whether the cached resourceVersion `have` is the written one `want` or a later one.
/// resourceVersions are opaque to clients, but the API server's are etcd revisions:
/// compared as numbers when both are, else only equality counts.
pub fn is_at_least(have: Option<&str>, want: Option<&str>) -> bool {
    match (have, want) {
        (_, None) => true,
        (None, Some(_)) => false,
        (Some(h), Some(w)) => match (h.parse::<u64>(), w.parse::<u64>()) {
            (Ok(h), Ok(w)) => h >= w,
            _ => h == w,
        },
    }
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
        assert_eq!(applied.len(), 513);
    }

    #[test]
    fn resource_versions_compare_as_revisions() {
        assert!(is_at_least(Some("12"), Some("9")));
        assert!(is_at_least(Some("9"), Some("9")));
        assert!(!is_at_least(Some("8"), Some("9")));
        assert!(!is_at_least(None, Some("9")));
        assert!(is_at_least(Some("x"), Some("x")));
        assert!(!is_at_least(Some("y"), Some("x")));
        assert!(is_at_least(None, None));
    }

    fn written(name: &str) -> Written {
        Written {
            applied: vec![(0, key(name), Some("7".into()))],
            pruned: vec![],
        }
    }

    #[test]
    fn parents_that_come_and_go_leave_no_expectation_behind() {
        let expectations = Expectations::default();
        let start = Instant::now();
        // 10 000 parents written for, each deleted before its caches caught up: half
        // with a finalizer (their last reconcile forgets them), half without (nothing
        // ever looks at them again).
        for i in 0..10_000u64 {
            let uid = format!("p{i}");
            let at = start + Duration::from_millis(i);
            expectations.expect_at(&uid, written(&uid), at);
            if i % 2 == 0 {
                expectations.forget(&uid);
            }
        }
        assert!(expectations.len() <= 5_000);
        // Past the lifetime, the next write sweeps the rest.
        let later = start + Duration::from_millis(10_000) + EXPECTATION_LIFETIME + SWEEP_PERIOD;
        expectations.expect_at("last", written("last"), later);
        assert_eq!(expectations.len(), 1);
        expectations.forget("last");
        assert_eq!(expectations.len(), 0);
    }

    #[test]
    fn young_expectations_survive_a_sweep() {
        let expectations = Expectations::default();
        let start = Instant::now();
        let s = |secs| start + Duration::from_secs(secs);
        assert!(EXPECTATION_LIFETIME == s(120) - start && SWEEP_PERIOD == s(120) - start);
        expectations.expect_at("old", written("a"), start);
        expectations.expect_at("young", written("b"), s(100));
        expectations.expect_at("now", written("c"), s(200));
        assert_eq!(expectations.len(), 2, "only the one past its lifetime went");
    }

    #[test]
    fn writes_and_applies_for_parents_that_are_gone_are_swept_by_age() {
        let own = OwnWrites::default();
        let applied = AppliedChildren::default();
        let start = Instant::now();
        let manifest = json!({});
        for i in 0..10_000u64 {
            let at = start + Duration::from_millis(i);
            let uid = format!("p{i}");
            own.remember_at(parent(&uid, "12", "written"), at);
            applied.record_at(0, key(&uid), &manifest, Some("5".into()), |_, _| false, at);
            // Half the parents go with a Delete event; the others while the watch was
            // down (a re-list sends no Delete event).
            if i % 2 == 0 {
                own.forget(&uid);
            }
        }
        assert!(own.len() <= 5_000);
        assert!(
            applied.len() <= 1024,
            "swept as it grows: {}",
            applied.len()
        );
        let later = start + Duration::from_millis(10_000) + OWN_WRITE_LIFETIME + SWEEP_PERIOD;
        own.remember_at(parent("last", "1", "written"), later);
        applied.record_at(
            0,
            key("last"),
            &manifest,
            Some("5".into()),
            |_, _| false,
            later,
        );
        assert_eq!(own.len(), 1);
        assert_eq!(applied.len(), 1);
        own.forget("last");
        applied.forget(0, &key("last"));
        assert_eq!((own.len(), applied.len()), (0, 0));
    }
}
