//! Exponential backoff with jitter for retrying transient errors.
//!
//! Ours on purpose: one formula, no timer and no runtime; backoff crates bring
//! policies, clocks and async wrappers the backends do not use.

use std::time::Duration;

/// Retry delays: the n-th delay is drawn uniformly from `[d/2, d]` where
/// `d = min(max, initial × 2ⁿ)` ("equal jitter": spread out, never zero).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Backoff {
    /// The first delay's upper bound. Default 50 ms.
    pub initial: Duration,
    /// The largest delay. Default 2 s.
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Backoff {
        Backoff {
            initial: Duration::from_millis(50),
            max: Duration::from_secs(2),
        }
    }
}

impl Backoff {
    /// A backoff from `initial` up to `max`.
    pub const fn new(initial: Duration, max: Duration) -> Backoff {
        Backoff { initial, max }
    }

    /// The delay before retry number `attempt` (0-based).
    pub fn delay(&self, attempt: u32) -> Duration {
        let cap = self
            .initial
            .saturating_mul(1u32 << attempt.min(20))
            .min(self.max);
        let half = cap / 2;
        let spread = u64::try_from((cap - half).as_nanos()).unwrap_or(u64::MAX);
        half + Duration::from_nanos(random_u64() % spread.saturating_add(1))
    }
}

/// A random `u64` from the operating system (jitter and request ids need no more).
pub fn random_u64() -> u64 {
    getrandom::u64().unwrap_or_else(|_| {
        // The OS RNG is not expected to fail; fall back to the clock's low bits.
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos() as u64)
            .unwrap_or(0)
    })
}

/// A fresh idempotency key: 32 hex digits.
pub fn request_id() -> String {
    let mut bytes = [0u8; 16];
    if getrandom::fill(&mut bytes).is_err() {
        bytes[..8].copy_from_slice(&random_u64().to_le_bytes());
        bytes[8..].copy_from_slice(&random_u64().to_le_bytes());
    }
    format!("{:032x}", u128::from_le_bytes(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_stay_within_half_and_full_cap_and_grow_to_max() {
        let b = Backoff::new(Duration::from_millis(10), Duration::from_millis(300));
        for attempt in 0..30 {
            let cap = Duration::from_millis(10 * (1u64 << attempt.min(20))).min(b.max);
            for _ in 0..50 {
                let d = b.delay(attempt);
                assert!(
                    d >= cap / 2 && d <= cap,
                    "attempt {attempt}: {d:?} vs {cap:?}"
                );
            }
        }
    }

    #[test]
    fn delays_are_jittered() {
        let b = Backoff::default();
        let delays: std::collections::HashSet<_> = (0..20).map(|_| b.delay(5)).collect();
        assert!(delays.len() > 1, "20 draws gave one value: {delays:?}");
    }
}
