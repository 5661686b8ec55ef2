//! The online safety checker, fed by every client of every run.
//!
//! Clients report what they *saw*: a grant once its answer arrived, a release just
//! before the release request is sent. So a correct lock service can never make the
//! checker see two holders at once, and everything it flags is a real violation of the
//! peer (or of the harness), never an artefact of timing:
//! - **overlap**: a grant arrived while another client still held the key;
//! - **fence decrease**: a grant carried a fence not larger than one already seen for
//!   the key (only for targets that hand out fences).
//!
//! It also measures contention: **hand-offs** (grants to a different client than the
//! previous holder) and **FIFO inversions** (a grant to a client while another one
//! had been waiting for the key longer, by more than [`FIFO_SLACK`]).

use std::collections::{BTreeSet, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Two clients that started waiting less than this apart may reach the server in
/// either order (the start is stamped on the client), so such pairs never count as a
/// FIFO inversion.
pub const FIFO_SLACK: Duration = Duration::from_millis(1);

/// How many violation examples are kept (all are counted).
const MAX_EXAMPLES: usize = 10;

/// Which safety property a grant broke.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ViolationKind {
    /// Two holders of one key at the same time.
    Overlap,
    /// A fence that is not larger than an earlier fence of the same key.
    FenceDecrease,
}

/// One violation, for the report.
#[derive(Debug, Clone)]
pub struct Violation {
    /// What broke.
    pub kind: ViolationKind,
    /// The key.
    pub key: String,
    /// What was seen.
    pub detail: String,
}

/// What the checker counted over a run.
#[derive(Debug, Clone, Default)]
pub struct Summary {
    /// Grants that overlapped another holder.
    pub overlaps: u64,
    /// Grants whose fence did not increase.
    pub fence_decreases: u64,
    /// Grants to a different client than the key's previous holder (measured part only).
    pub handoffs: u64,
    /// Grants that overtook a longer waiter (measured part only).
    pub fifo_inversions: u64,
    /// The first few violations.
    pub examples: Vec<Violation>,
}

#[derive(Default)]
struct KeyState {
    holder: Option<usize>,
    last_owner: Option<usize>,
    max_fence: Option<u64>,
    waiting: BTreeSet<(Instant, usize)>,
}

#[derive(Default)]
struct State {
    keys: HashMap<String, KeyState>,
    summary: Summary,
}

/// The checker; share it between the clients of one run.
#[derive(Default)]
pub struct Checker {
    state: Mutex<State>,
}

impl Checker {
    /// A checker with no history.
    pub fn new() -> Checker {
        Checker::default()
    }

    /// `client` starts waiting for `key` at `at`.
    pub fn waiting(&self, key: &str, client: usize, at: Instant) {
        let mut state = self.state.lock().expect("checker lock");
        state
            .keys
            .entry(key.to_owned())
            .or_default()
            .waiting
            .insert((at, client));
    }

    /// `client` gave up waiting (an error, or the run ended).
    pub fn gave_up(&self, key: &str, client: usize, since: Instant) {
        let mut state = self.state.lock().expect("checker lock");
        if let Some(k) = state.keys.get_mut(key) {
            k.waiting.remove(&(since, client));
        }
    }

    /// `client`, waiting since `since`, was granted `key` with `fence` (if the target
    /// has fences). `measured`: inside the measured window (hand-offs and inversions
    /// are only counted there; violations always).
    pub fn granted(
        &self,
        key: &str,
        client: usize,
        since: Instant,
        fence: Option<u64>,
        measured: bool,
    ) {
        let mut guard = self.state.lock().expect("checker lock");
        let State { keys, summary } = &mut *guard;
        let k = keys.entry(key.to_owned()).or_default();
        k.waiting.remove(&(since, client));
        if measured {
            if let Some(&(oldest, _)) = k.waiting.iter().next() {
                if oldest + FIFO_SLACK < since {
                    summary.fifo_inversions += 1;
                }
            }
            if k.last_owner.is_some_and(|owner| owner != client) {
                summary.handoffs += 1;
            }
        }
        if let Some(other) = k.holder {
            summary.overlaps += 1;
            push_example(
                summary,
                ViolationKind::Overlap,
                key,
                format!("client {client} was granted the key while client {other} held it"),
            );
        }
        if let Some(fence) = fence {
            if let Some(max) = k.max_fence {
                if fence <= max {
                    summary.fence_decreases += 1;
                    push_example(
                        summary,
                        ViolationKind::FenceDecrease,
                        key,
                        format!("client {client} got fence {fence} after fence {max} was seen"),
                    );
                }
            }
            k.max_fence = Some(k.max_fence.map_or(fence, |m| m.max(fence)));
        }
        k.holder = Some(client);
        k.last_owner = Some(client);
    }

    /// `client` is about to send the release of `key` (it stops using it now).
    pub fn releasing(&self, key: &str, client: usize) {
        let mut state = self.state.lock().expect("checker lock");
        if let Some(k) = state.keys.get_mut(key) {
            if k.holder == Some(client) {
                k.holder = None;
            }
        }
    }

    /// What has been counted so far.
    pub fn summary(&self) -> Summary {
        self.state.lock().expect("checker lock").summary.clone()
    }
}

fn push_example(summary: &mut Summary, kind: ViolationKind, key: &str, detail: String) {
    if summary.examples.len() < MAX_EXAMPLES {
        summary.examples.push(Violation {
            kind,
            key: key.to_owned(),
            detail,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(base: Instant, ms: u64) -> Instant {
        base + Duration::from_millis(ms)
    }

    #[test]
    fn a_correct_history_has_no_violations() {
        let c = Checker::new();
        let t = Instant::now();
        for (i, client) in [0, 1, 0, 2].into_iter().enumerate() {
            c.waiting("k", client, at(t, i as u64));
            c.granted("k", client, at(t, i as u64), Some(10 + i as u64), true);
            c.releasing("k", client);
        }
        let s = c.summary();
        assert_eq!(
            (s.overlaps, s.fence_decreases, s.fifo_inversions),
            (0, 0, 0)
        );
        assert_eq!(s.handoffs, 3);
    }

    #[test]
    fn catches_a_planted_overlap() {
        let c = Checker::new();
        let t = Instant::now();
        c.granted("k", 0, t, Some(1), true);
        // Client 1 is granted the key before client 0 released it.
        c.granted("k", 1, t, Some(2), true);
        let s = c.summary();
        assert_eq!(s.overlaps, 1);
        assert_eq!(s.examples[0].kind, ViolationKind::Overlap);
        // Other keys are independent.
        c.granted("other", 2, t, Some(1), true);
        assert_eq!(c.summary().overlaps, 1);
    }

    #[test]
    fn catches_a_planted_fence_regression() {
        let c = Checker::new();
        let t = Instant::now();
        for (client, fence) in [(0, 5), (1, 7), (2, 6), (3, 7), (4, 8)] {
            c.granted("k", client, t, Some(fence), true);
            c.releasing("k", client);
        }
        let s = c.summary();
        // 6 after 7, and 7 again: two regressions; 8 is fine.
        assert_eq!(s.fence_decreases, 2);
        assert_eq!(s.overlaps, 0);
        assert!(s
            .examples
            .iter()
            .all(|v| v.kind == ViolationKind::FenceDecrease));
    }

    #[test]
    fn releases_by_others_do_not_clear_the_holder() {
        let c = Checker::new();
        let t = Instant::now();
        c.granted("k", 0, t, None, true);
        c.releasing("k", 1);
        c.granted("k", 2, t, None, true);
        assert_eq!(c.summary().overlaps, 1);
    }

    #[test]
    fn counts_fifo_inversions_beyond_the_slack() {
        let c = Checker::new();
        let t = Instant::now();
        c.granted("k", 0, t, None, true);
        c.waiting("k", 1, at(t, 1));
        c.waiting("k", 2, at(t, 10));
        c.waiting("k", 3, at(t, 10));
        c.releasing("k", 0);
        // Client 2 overtakes client 1, who waited 9 ms longer: an inversion.
        c.granted("k", 2, at(t, 10), None, true);
        c.releasing("k", 2);
        // Client 1 is next: no inversion.
        c.granted("k", 1, at(t, 1), None, true);
        c.releasing("k", 1);
        assert_eq!(c.summary().fifo_inversions, 1);
        // Unmeasured grants (warm-up) count no inversions but still hand-offs none.
        c.waiting("k", 4, at(t, 20));
        c.granted("k", 3, at(t, 10), None, false);
        assert_eq!(c.summary().fifo_inversions, 1);
    }
}
