//! A fast hasher for the core's id-keyed tables (owner tokens, session ids).
//!
//! Those ids are 128 random bits drawn by the server, never chosen by a client, so the
//! flooding resistance of the default SipHash buys nothing there, while hashing is a
//! tenth of a restart with a million locks. Keys chosen by clients (lock names,
//! request ids) keep the default hasher.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Multiply-rotate mixing (as in FxHash), fed one 64-bit word at a time.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct IdHasher(u64);

const SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl IdHasher {
    fn mix(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(SEED);
    }
}

impl Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        // Ids hash through `write_u128`; anything else still gets a valid hash.
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.mix(u64::from_le_bytes(word));
        }
    }

    fn write_u128(&mut self, bits: u128) {
        self.mix(bits as u64);
        self.mix((bits >> 64) as u64);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// A `HashMap` keyed by a server-drawn id.
pub(crate) type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::{BuildHasher, Hash};

    fn hash(v: u128) -> u64 {
        BuildHasherDefault::<IdHasher>::default().hash_one(v)
    }

    #[test]
    fn both_halves_and_sequential_ids_spread() {
        assert_ne!(hash(1), hash(1 << 64));
        assert_ne!(hash(1), hash(2));
        // Sequential ids (as tests use) differ in the top 7 bits hashbrown uses as tags.
        let tags: std::collections::HashSet<u64> = (0..1000u128).map(|i| hash(i) >> 57).collect();
        assert!(tags.len() > 64, "{} distinct tags", tags.len());
    }

    #[test]
    fn write_hashes_every_byte() {
        let mut a = IdHasher::default();
        let mut b = IdHasher::default();
        a.write(b"0123456789");
        b.write(b"0123456788");
        assert_ne!(a.finish(), b.finish());
        let mut c = IdHasher::default();
        7u128.hash(&mut c);
        assert_eq!(c.finish(), hash(7));
    }
}
