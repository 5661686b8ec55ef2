//! Shared helpers for the gate tests.
#![allow(dead_code)] // Each test binary uses a different part.

use std::time::{SystemTime, UNIX_EPOCH};

/// A tiny seeded generator (splitmix64): every randomized test prints its seed, and
/// `FENCE_TEST_SEED=<seed>` replays it.
pub struct Rng(u64);

impl Rng {
    /// Seeded from `FENCE_TEST_SEED` or the clock; prints the seed.
    pub fn from_env(test: &str) -> Rng {
        let seed = std::env::var("FENCE_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .unwrap()
                    .as_nanos() as u64
            });
        eprintln!("{test}: FENCE_TEST_SEED={seed}");
        Rng(seed)
    }

    /// A generator with a fixed seed.
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// The next 64 random bits.
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `1..=max`.
    pub fn fence(&mut self, max: u64) -> u64 {
        1 + self.next() % max
    }

    /// `n` fences in `1..=max` (duplicates allowed: equal fences must not both apply).
    pub fn fences(&mut self, n: usize, max: u64) -> Vec<u64> {
        (0..n).map(|_| self.fence(max)).collect()
    }
}
