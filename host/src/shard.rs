//! The shard arithmetic of `capstan run --shards`: the API server's hash of a parent's
//! UID, the fixed buckets that split the hash space, the selectors that make the API
//! server send a replica only its buckets' parents (`shardSelector`) and children (a
//! label selector on [`SHARD_BUCKET_LABEL`]), and the even split of the buckets among
//! the live members.
//!
//! The API server (KEP-5866, `k8s.io/apimachinery/pkg/sharding`) hashes the UID string's
//! bytes with 64-bit FNV-1a and keeps an object when `start <= hash < end`, each bound a
//! `0x`-prefixed, 16-digit lowercase hex literal, the end possibly `0x10000000000000000`
//! (2^64). It can hash only `metadata.uid` or `metadata.namespace`, so a child (which has
//! its own UID) is selected by a label holding its parent's bucket instead.

use std::fmt;

/// The label the host sets on every child: the bucket of its controller's UID.
pub const SHARD_BUCKET_LABEL: &str = "capstan.dev/shard-bucket";

/// How many buckets the hash space is cut into: the unit in which ranges move. Fixed for
/// good, since every child carries its bucket number in a label. 64 buckets split among
/// 3 replicas as 21/21/22, among 5 as 12/13/13/13/13: within 8 % of even.
pub const BUCKETS: u32 = 64;

/// The bits of the hash below the bucket number.
const BUCKET_SHIFT: u32 = 64 - BUCKETS.trailing_zeros();

/// 64-bit FNV-1a of `bytes`, as Go's `hash/fnv.New64a`.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    bytes
        .iter()
        .fold(OFFSET, |h, b| (h ^ u64::from(*b)).wrapping_mul(PRIME))
}

/// The bucket of the object with this UID.
pub fn bucket_of(uid: &str) -> u32 {
    (fnv1a64(uid.as_bytes()) >> BUCKET_SHIFT) as u32
}

/// A set of buckets (bit `b` set: bucket `b` is in).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct Buckets(u64);

impl Buckets {
    /// No bucket.
    pub const NONE: Buckets = Buckets(0);
    /// Every bucket: the whole hash space.
    pub const ALL: Buckets = Buckets(u64::MAX);

    /// Buckets `start..end`.
    pub fn range(start: u32, end: u32) -> Buckets {
        (start..end.min(BUCKETS)).fold(Buckets::NONE, |s, b| s.with(b))
    }

    /// This set and bucket `b`.
    pub fn with(self, b: u32) -> Buckets {
        Buckets(self.0 | (1 << b))
    }

    /// Whether bucket `b` is in.
    pub fn contains(self, b: u32) -> bool {
        self.0 & (1 << b) != 0
    }

    /// Whether the set is empty.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// How many buckets are in.
    pub fn len(self) -> u32 {
        self.0.count_ones()
    }

    /// Buckets in both.
    pub fn and(self, other: Buckets) -> Buckets {
        Buckets(self.0 & other.0)
    }

    /// Buckets in either.
    pub fn or(self, other: Buckets) -> Buckets {
        Buckets(self.0 | other.0)
    }

    /// Buckets in `self` but not in `other`.
    pub fn minus(self, other: Buckets) -> Buckets {
        Buckets(self.0 & !other.0)
    }

    /// The buckets, in order.
    pub fn iter(self) -> impl Iterator<Item = u32> {
        (0..BUCKETS).filter(move |b| self.contains(*b))
    }

    /// The set as a compact text (16 hex digits), as membership Leases carry it.
    pub fn to_hex(self) -> String {
        format!("{:016x}", self.0)
    }

    /// The set written by [`Buckets::to_hex`]; `None` if it is not that.
    pub fn from_hex(text: &str) -> Option<Buckets> {
        u64::from_str_radix(text, 16).ok().map(Buckets)
    }

    /// The hash ranges `[start, end)` the buckets cover, adjacent buckets merged.
    pub fn hash_ranges(self) -> Vec<(u128, u128)> {
        let width = 1u128 << BUCKET_SHIFT;
        let mut ranges: Vec<(u128, u128)> = Vec::new();
        for b in self.iter() {
            let (start, end) = (u128::from(b) * width, u128::from(b + 1) * width);
            match ranges.last_mut() {
                Some(last) if last.1 == start => last.1 = end,
                _ => ranges.push((start, end)),
            }
        }
        ranges
    }

    /// The `shardSelector` that makes the API server send only the objects whose UID
    /// falls in these buckets; `None` for every bucket (no selector needed) or none.
    pub fn shard_selector(self) -> Option<String> {
        if self == Buckets::ALL || self.is_empty() {
            return None;
        }
        let ranges: Vec<String> = self
            .hash_ranges()
            .into_iter()
            .map(|(start, end)| {
                format!(
                    "shardRange(object.metadata.uid, '{}', '{}')",
                    hex(start),
                    hex(end)
                )
            })
            .collect();
        Some(ranges.join(" || "))
    }

    /// The label selector of the children of these buckets' parents (with `base`, the
    /// host's managed-by selector).
    pub fn child_label_selector(self, base: &str) -> String {
        if self == Buckets::ALL {
            return base.to_string();
        }
        let values: Vec<String> = self.iter().map(|b| b.to_string()).collect();
        format!("{base},{SHARD_BUCKET_LABEL} in ({})", values.join(","))
    }
}

impl fmt::Display for Buckets {
    /// Bucket ranges as `0-20,42-63`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let width = 1u128 << BUCKET_SHIFT;
        let parts: Vec<String> = self
            .hash_ranges()
            .into_iter()
            .map(|(s, e)| format!("{}-{}", s / width, e / width - 1))
            .collect();
        if parts.is_empty() {
            f.write_str("none")
        } else {
            f.write_str(&parts.join(","))
        }
    }
}

/// A hash bound as the API server wants it: 16 hex digits, or 17 for 2^64.
fn hex(bound: u128) -> String {
    format!("0x{bound:016x}")
}

/// The buckets `member` is due among `members` (any order, `member` among them): the
/// members sorted by name split the buckets into contiguous, even runs.
pub fn fair_share(members: &[&str], member: &str) -> Buckets {
    let mut sorted: Vec<&str> = members.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let Some(k) = sorted.iter().position(|m| *m == member) else {
        return Buckets::NONE;
    };
    let n = sorted.len() as u32;
    let k = k as u32;
    Buckets::range(k * BUCKETS / n, (k + 1) * BUCKETS / n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a_matches_go_hash_fnv() {
        // Go's hash/fnv test vectors for New64a.
        assert_eq!(fnv1a64(b""), 0xcbf29ce484222325);
        assert_eq!(fnv1a64(b"a"), 0xaf63dc4c8601ec8c);
        assert_eq!(fnv1a64(b"ab"), 0x089c4407b545986a);
        assert_eq!(fnv1a64(b"abc"), 0xe71fa2190541574b);
        // A UID and its hash as the v1.37.2 API server filtered it: this ConfigMap was
        // returned by `shardRange(object.metadata.uid, '0x0000000000000000',
        // '0x8000000000000000')` and its neighbour 0xbaec… was not.
        assert_eq!(
            fnv1a64(b"5f362ddd-9692-4340-be0c-be76df9a45cd"),
            0x6a97e3ebf51e7964
        );
        assert_eq!(bucket_of("5f362ddd-9692-4340-be0c-be76df9a45cd"), 0x6a >> 2);
    }

    #[test]
    fn selectors_are_in_the_api_servers_format() {
        assert_eq!(
            Buckets::range(0, 32).shard_selector().unwrap(),
            "shardRange(object.metadata.uid, '0x0000000000000000', '0x8000000000000000')"
        );
        assert_eq!(
            Buckets::range(32, 64).shard_selector().unwrap(),
            "shardRange(object.metadata.uid, '0x8000000000000000', '0x10000000000000000')"
        );
        let split = Buckets::range(0, 1).or(Buckets::range(63, 64));
        assert_eq!(
            split.shard_selector().unwrap(),
            "shardRange(object.metadata.uid, '0x0000000000000000', '0x0400000000000000') || \
             shardRange(object.metadata.uid, '0xfc00000000000000', '0x10000000000000000')"
        );
        assert_eq!(Buckets::ALL.shard_selector(), None);
        assert_eq!(
            Buckets::range(2, 5).child_label_selector("app.kubernetes.io/managed-by=capstan"),
            "app.kubernetes.io/managed-by=capstan,capstan.dev/shard-bucket in (2,3,4)"
        );
        assert_eq!(split.to_string(), "0-0,63-63");
        assert_eq!(Buckets::from_hex(&split.to_hex()), Some(split));
    }

    #[test]
    fn a_uid_is_in_the_range_of_its_bucket() {
        for uid in ["a", "5f362ddd-9692-4340-be0c-be76df9a45cd", "ffff"] {
            let h = u128::from(fnv1a64(uid.as_bytes()));
            let b = bucket_of(uid);
            let ranges = Buckets::NONE.with(b).hash_ranges();
            assert_eq!(ranges.len(), 1);
            assert!(ranges[0].0 <= h && h < ranges[0].1, "{uid}");
        }
    }

    #[test]
    fn fair_shares_cover_every_bucket_once_and_evenly() {
        for n in 1..=9usize {
            let names: Vec<String> = (0..n).map(|i| format!("replica-{i}")).collect();
            let members: Vec<&str> = names.iter().map(String::as_str).collect();
            let shares: Vec<Buckets> = members.iter().map(|m| fair_share(&members, m)).collect();
            let union = shares.iter().fold(Buckets::NONE, |u, s| {
                assert!(u.and(*s).is_empty(), "overlap with {n} members");
                u.or(*s)
            });
            assert_eq!(union, Buckets::ALL, "{n} members leave a gap");
            let (min, max) = (
                shares.iter().map(|s| s.len()).min().unwrap(),
                shares.iter().map(|s| s.len()).max().unwrap(),
            );
            assert!(max - min <= 1, "{n} members: {min}..{max}");
            for s in &shares {
                assert!(
                    s.hash_ranges().len() == 1,
                    "a share is one contiguous range"
                );
            }
        }
        assert_eq!(fair_share(&["b", "a", "c"], "a"), Buckets::range(0, 21));
        assert_eq!(fair_share(&["b", "a", "c"], "c"), Buckets::range(42, 64));
        assert_eq!(fair_share(&["a"], "z"), Buckets::NONE);
    }
}
