//! Fast unique ids.
//!
//! Message ids are v4 uuids. `Uuid::new_v4` asks the kernel for 16 random bytes per call, one
//! system call per message on the hot append path; here each thread seeds a SplitMix64 stream
//! once from the kernel and draws from it, which keeps the ids random (122 random bits, unique
//! across processes by the seed) at a fraction of the cost.

use std::cell::Cell;

thread_local! {
    static STATE: Cell<u64> = Cell::new(seed());
}

fn seed() -> u64 {
    let b = *uuid::Uuid::new_v4().as_bytes();
    u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
        ^ u64::from_le_bytes([b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]]).rotate_left(17)
}

fn next() -> u64 {
    STATE.with(|s| {
        let z = s.get().wrapping_add(0x9E37_79B9_7F4A_7C15);
        s.set(z);
        let z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        let z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    })
}

/// A random v4 uuid.
pub fn uuid_v4() -> uuid::Uuid {
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&next().to_le_bytes());
    bytes[8..].copy_from_slice(&next().to_le_bytes());
    uuid::Builder::from_random_bytes(bytes).into_uuid()
}

/// A random number in `0..1`, for jitter.
pub fn unit_f64() -> f64 {
    (next() >> 11) as f64 / (1u64 << 53) as f64
}

/// A v4-shaped uuid derived from `key` (the same key always gives the same id): ids of messages
/// that a restarted process may send again, so that the recipient's dedup drops the repeat.
pub fn derived(key: &str) -> uuid::Uuid {
    // Two FNV-1a passes with different offsets, mixed through SplitMix64's finalizer.
    let fnv = |offset: u64| {
        key.bytes().fold(offset, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
    };
    let mix = |mut z: u64| {
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&mix(fnv(0xcbf2_9ce4_8422_2325)).to_le_bytes());
    bytes[8..].copy_from_slice(&mix(fnv(0x84222325_cbf29ce4)).to_le_bytes());
    uuid::Builder::from_random_bytes(bytes).into_uuid()
}

#[cfg(test)]
mod tests {
    #[test]
    fn ids_are_v4_and_distinct() {
        let a = super::uuid_v4();
        let b = super::uuid_v4();
        assert_ne!(a, b);
        assert_eq!(a.get_version_num(), 4);
        let set: std::collections::HashSet<_> = (0..10_000).map(|_| super::uuid_v4()).collect();
        assert_eq!(set.len(), 10_000);
    }

    #[test]
    fn id_sets_pack_canonical_uuids_and_keep_every_other_spelling_apart() {
        let mut s = super::IdSet::default();
        let u = super::uuid_v4().to_string();
        assert!(s.insert(&u));
        assert!(!s.insert(&u));
        assert!(s.contains(&u));
        assert_eq!(super::pack(&u), Some(uuid_v4_bits(&u)));
        // The same bits spelled otherwise are other ids.
        let upper = u.to_uppercase();
        assert!(!s.contains(&upper));
        assert!(s.insert(&upper));
        for other in ["x", "", "12345678-1234-1234-1234-12345678901g", &u[..35]] {
            assert!(!s.contains(other));
            assert!(s.insert(other));
            assert!(!s.insert(other));
        }
        assert_eq!(s.len(), 6);
    }

    /// The bits of a uuid, as the uuid crate reads them.
    fn uuid_v4_bits(s: &str) -> u128 {
        uuid::Uuid::parse_str(s).unwrap().as_u128()
    }
}

/// A set of message ids, hashed with [`IdHasher`]. An id in the form troupe writes (a uuid in
/// lower-case hex with hyphens) is kept as its 16 bytes: a journal's set holds every id its
/// owner ever consumed, and a String per id made it several times larger, and slower to grow
/// and to search. Any other id is kept as it is. The two forms never meet: only the canonical
/// spelling is packed, so two different spellings stay two ids.
#[derive(Debug, Clone, Default)]
pub struct IdSet {
    packed: std::collections::HashSet<u128, IdHashBuilder>,
    other: std::collections::HashSet<String, IdHashBuilder>,
}

impl IdSet {
    /// Adds `id`; false if it was there already.
    pub fn insert(&mut self, id: &str) -> bool {
        match pack(id) {
            Some(u) => self.packed.insert(u),
            None => {
                if self.other.contains(id) {
                    return false;
                }
                self.other.insert(id.to_owned())
            }
        }
    }

    /// Takes `id` out; false if it was not there.
    pub fn remove(&mut self, id: &str) -> bool {
        match pack(id) {
            Some(u) => self.packed.remove(&u),
            None => self.other.remove(id),
        }
    }

    pub fn contains(&self, id: &str) -> bool {
        match pack(id) {
            Some(u) => self.packed.contains(&u),
            None => self.other.contains(id),
        }
    }

    pub fn len(&self) -> usize {
        self.packed.len() + self.other.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The 128 bits of a uuid written as 8-4-4-4-12 lower-case hex digits, or `None` for any other
/// string.
fn pack(id: &str) -> Option<u128> {
    let b = id.as_bytes();
    if b.len() != 36 {
        return None;
    }
    let mut v: u128 = 0;
    for (i, &c) in b.iter().enumerate() {
        if matches!(i, 8 | 13 | 18 | 23) {
            if c != b'-' {
                return None;
            }
            continue;
        }
        let d = match c {
            b'0'..=b'9' => c - b'0',
            b'a'..=b'f' => c - b'a' + 10,
            _ => return None,
        };
        v = (v << 4) | u128::from(d);
    }
    Some(v)
}

/// Builds [`IdHasher`]s keyed with a per-process random seed.
#[derive(Debug, Clone, Copy)]
pub struct IdHashBuilder(u64);

impl Default for IdHashBuilder {
    fn default() -> Self {
        static SEED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
        IdHashBuilder(*SEED.get_or_init(next))
    }
}

impl std::hash::BuildHasher for IdHashBuilder {
    type Hasher = IdHasher;
    fn build_hasher(&self) -> IdHasher {
        IdHasher(self.0)
    }
}

/// A fast keyed hash for the id sets the drain consults for every message (SipHash was a tenth
/// of a busy drain's time). Eight bytes per multiply, then a final mix; the per-process random
/// key keeps a local writer from choosing ids that collide.
#[derive(Debug, Clone, Copy)]
pub struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    /// A packed uuid: its two halves, no byte loop.
    fn write_u128(&mut self, v: u128) {
        for word in [v as u64, (v >> 64) as u64] {
            self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x517c_c1b7_2722_0a95);
        }
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.0 = (self.0.rotate_left(5) ^ u64::from_le_bytes(word))
                .wrapping_mul(0x517c_c1b7_2722_0a95);
        }
    }

    fn finish(&self) -> u64 {
        let z = (self.0 ^ (self.0 >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        let z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}
