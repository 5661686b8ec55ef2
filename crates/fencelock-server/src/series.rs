//! The last hour of lock traffic, per wall-clock minute, for the dashboard's charts:
//! grants, the wait time of each grant (p50 and p99 from a small fixed histogram),
//! acquires that had to queue and the peak number of queued requests. Bounded: one
//! ring of [`MINUTES`] buckets, whatever the traffic; recorded by the engine as it
//! counts events, so it is the server's own data and needs no viewer.

use std::sync::Mutex;

/// Minutes kept (the charts show the last hour).
pub const MINUTES: usize = 60;

/// Upper bounds (ms) of the wait-time histogram of each minute; the last catches
/// everything longer.
const WAIT_BOUNDS_MS: [u64; 16] = [
    0,
    1,
    2,
    5,
    10,
    20,
    50,
    100,
    200,
    500,
    1_000,
    2_000,
    5_000,
    10_000,
    60_000,
    u64::MAX,
];

const MINUTE_MS: u64 = 60_000;

#[derive(Debug, Clone, Copy, Default)]
struct Bucket {
    /// The minute (ms since the epoch / 60 000) this bucket counts; a bucket of
    /// another minute is stale and reads as empty.
    minute: u64,
    grants: u64,
    queued: u64,
    peak_waiters: u64,
    longest_wait_ms: u64,
    waits: [u64; WAIT_BOUNDS_MS.len()],
}

impl Bucket {
    /// The upper bound of the bucket holding quantile `q` of this minute's waits,
    /// capped at the longest wait seen (so the open last bound never shows).
    fn wait_quantile(&self, q: f64) -> Option<u64> {
        let count: u64 = self.waits.iter().sum();
        if count == 0 {
            return None;
        }
        let rank = ((count as f64) * q).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (bound, n) in WAIT_BOUNDS_MS.iter().zip(self.waits) {
            seen += n;
            if seen >= rank {
                return Some((*bound).min(self.longest_wait_ms));
            }
        }
        Some(self.longest_wait_ms)
    }
}

/// One minute of [`Series::last_hour`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct MinuteStats {
    /// Start of the minute, ms since the Unix epoch.
    pub start_ms: u64,
    /// Grants made (direct and hand-off).
    pub grants: u64,
    /// Median wait of those grants, ms (a histogram bucket's bound); `None` without grants.
    pub wait_p50_ms: Option<u64>,
    /// 99th percentile wait of those grants, ms; `None` without grants.
    pub wait_p99_ms: Option<u64>,
    /// Acquires that had to queue.
    pub queued: u64,
    /// Most requests queued at once (sampled after each batch of commands).
    pub peak_waiters: u64,
}

/// The per-minute ring (see the module doc).
#[derive(Debug)]
pub struct Series {
    ring: Mutex<[Bucket; MINUTES]>,
}

impl Default for Series {
    fn default() -> Series {
        Series {
            ring: Mutex::new([Bucket::default(); MINUTES]),
        }
    }
}

impl Series {
    /// Updates the bucket of the minute of `wall_ms` with `f`.
    fn with_minute(&self, wall_ms: u64, f: impl FnOnce(&mut Bucket)) {
        let minute = wall_ms / MINUTE_MS;
        let mut ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        let b = &mut ring[(minute % MINUTES as u64) as usize];
        if b.minute != minute {
            *b = Bucket {
                minute,
                ..Bucket::default()
            };
        }
        f(b);
    }

    /// A grant at `wall_ms` after `waited_ms` in the queue.
    pub fn grant(&self, wall_ms: u64, waited_ms: u64) {
        self.with_minute(wall_ms, |b| {
            b.grants += 1;
            b.longest_wait_ms = b.longest_wait_ms.max(waited_ms);
            let i = WAIT_BOUNDS_MS
                .iter()
                .position(|bound| waited_ms <= *bound)
                .unwrap_or(WAIT_BOUNDS_MS.len() - 1);
            b.waits[i] += 1;
        });
    }

    /// An acquire queued at `wall_ms`.
    pub fn queued(&self, wall_ms: u64) {
        self.with_minute(wall_ms, |b| b.queued += 1);
    }

    /// `waiters` requests are queued at `wall_ms`.
    pub fn waiters(&self, wall_ms: u64, waiters: u64) {
        self.with_minute(wall_ms, |b| b.peak_waiters = b.peak_waiters.max(waiters));
    }

    /// The [`MINUTES`] minutes up to and including the one of `wall_ms`, oldest
    /// first; minutes without data are zeros.
    pub fn last_hour(&self, wall_ms: u64) -> Vec<MinuteStats> {
        let now = wall_ms / MINUTE_MS;
        let ring = *self.ring.lock().unwrap_or_else(|e| e.into_inner());
        (0..MINUTES as u64)
            .rev()
            .filter_map(|ago| now.checked_sub(ago))
            .map(|minute| {
                let b = ring[(minute % MINUTES as u64) as usize];
                let b = if b.minute == minute {
                    b
                } else {
                    Bucket::default()
                };
                MinuteStats {
                    start_ms: minute * MINUTE_MS,
                    grants: b.grants,
                    wait_p50_ms: b.wait_quantile(0.5),
                    wait_p99_ms: b.wait_quantile(0.99),
                    queued: b.queued,
                    peak_waiters: b.peak_waiters,
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: u64 = 1_772_454_600_000; // a minute boundary

    #[test]
    fn counts_each_minute_and_keeps_one_hour() {
        let s = Series::default();
        for wait in [0, 0, 3, 40, 40, 40, 40, 40, 40, 90_000] {
            s.grant(T0 + 5_000, wait);
        }
        s.queued(T0 + 6_000);
        s.waiters(T0 + 6_000, 7);
        s.waiters(T0 + 7_000, 2);
        s.grant(T0 + MINUTE_MS, 1);
        let hour = s.last_hour(T0 + MINUTE_MS + 1);
        assert_eq!(hour.len(), MINUTES);
        let [.., m0, m1] = hour[..] else {
            unreachable!()
        };
        assert_eq!(m0.start_ms, T0);
        assert_eq!((m0.grants, m0.queued, m0.peak_waiters), (10, 1, 7));
        assert_eq!(m0.wait_p50_ms, Some(50));
        // The open last bucket reports the longest wait, not u64::MAX.
        assert_eq!(m0.wait_p99_ms, Some(90_000));
        assert_eq!((m1.grants, m1.wait_p50_ms), (1, Some(1)));
        assert!(hour[..MINUTES - 2]
            .iter()
            .all(|m| m.grants == 0 && m.wait_p50_ms.is_none() && m.start_ms < T0));

        // An hour later the ring slot of T0 is reused, not added to.
        let later = T0 + MINUTES as u64 * MINUTE_MS;
        s.grant(later, 0);
        let hour = s.last_hour(later);
        assert_eq!(hour[MINUTES - 1].grants, 1);
        assert_eq!(hour[0].start_ms, T0 + MINUTE_MS);
        assert_eq!(hour.iter().map(|m| m.grants).sum::<u64>(), 2);
    }
}
