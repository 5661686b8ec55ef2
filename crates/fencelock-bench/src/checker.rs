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

/// Shared (a reader) or exclusive (a writer), as [`RwChecker`] sees a grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Mode {
    /// Any number of shared holders may hold together.
    Shared,
    /// The only holder.
    Exclusive,
}

#[derive(Default)]
struct RwKeyState {
    /// Current holders: client → (mode, fence).
    holders: HashMap<usize, (Mode, Option<u64>)>,
    /// The largest fence of any grant seen.
    max_fence: Option<u64>,
    /// The largest fence of an exclusive grant seen.
    max_writer_fence: Option<u64>,
    /// The largest fence of a grant whose release was reported.
    max_released_fence: Option<u64>,
    /// Per waiting client: `max_released_fence` when it started waiting.
    floors: HashMap<usize, Option<u64>>,
}

/// The online checker of reader-writer locks (W6), fed like [`Checker`]: a grant once
/// its answer arrived, a release just before it is sent. What it flags can only be a
/// real violation:
/// - **overlap**: an exclusive grant while any other client held the key, or a shared
///   grant while a writer held it (readers together are fine);
/// - **fence decrease** (targets with fences): an exclusive grant whose fence is not
///   above every fence seen for the key; a shared grant whose fence is not above every
///   writer's fence seen, nor above every fence released before its acquire started,
///   or equal to a current holder's. Readers granted together may answer in any
///   order, so a reader is never compared with a reader it may have run beside.
#[derive(Default)]
pub struct RwChecker {
    state: Mutex<(HashMap<String, RwKeyState>, Summary)>,
}

impl RwChecker {
    /// A checker with no history.
    pub fn new() -> RwChecker {
        RwChecker::default()
    }

    /// `client` starts an acquire of `key`.
    pub fn waiting(&self, key: &str, client: usize) {
        let mut guard = self.state.lock().expect("checker lock");
        let k = guard.0.entry(key.to_owned()).or_default();
        let floor = k.max_released_fence;
        k.floors.insert(client, floor);
    }

    /// `client` was granted `key` in `mode` with `fence` (if the target has fences).
    pub fn granted(&self, key: &str, client: usize, mode: Mode, fence: Option<u64>) {
        let mut guard = self.state.lock().expect("checker lock");
        let (keys, summary) = &mut *guard;
        let k = keys.entry(key.to_owned()).or_default();
        let floor = k.floors.remove(&client).flatten();
        let conflicting = k
            .holders
            .iter()
            .filter(|(&other, &(held, _))| {
                other != client && (mode == Mode::Exclusive || held == Mode::Exclusive)
            })
            .map(|(&other, &(held, _))| (other, held))
            .min();
        if let Some((other, held)) = conflicting {
            summary.overlaps += 1;
            push_example(
                summary,
                ViolationKind::Overlap,
                key,
                format!(
                    "client {client} was granted {mode:?} while client {other} held it {held:?}"
                ),
            );
        }
        if let Some(fence) = fence {
            let bound = match mode {
                Mode::Exclusive => k.max_fence,
                Mode::Shared => k.max_writer_fence.max(floor),
            };
            let duplicate = k.holders.values().any(|&(_, f)| f == Some(fence));
            if bound.is_some_and(|b| fence <= b) || duplicate {
                summary.fence_decreases += 1;
                push_example(
                    summary,
                    ViolationKind::FenceDecrease,
                    key,
                    format!(
                        "client {client} got {mode:?} fence {fence}, not above {} ({})",
                        bound.unwrap_or(fence),
                        if duplicate {
                            "a current holder's"
                        } else {
                            "an earlier grant's"
                        }
                    ),
                );
            }
            k.max_fence = k.max_fence.max(Some(fence));
            if mode == Mode::Exclusive {
                k.max_writer_fence = k.max_writer_fence.max(Some(fence));
            }
        }
        k.holders.insert(client, (mode, fence));
    }

    /// `client` gave up its acquire of `key` (an error, or the run ended).
    pub fn gave_up(&self, key: &str, client: usize) {
        let mut guard = self.state.lock().expect("checker lock");
        if let Some(k) = guard.0.get_mut(key) {
            k.floors.remove(&client);
        }
    }

    /// `client` is about to send the release of `key`.
    pub fn releasing(&self, key: &str, client: usize) {
        let mut guard = self.state.lock().expect("checker lock");
        if let Some(k) = guard.0.get_mut(key) {
            if let Some((_, fence)) = k.holders.remove(&client) {
                k.max_released_fence = k.max_released_fence.max(fence);
            }
        }
    }

    /// What has been counted so far (overlaps, fence decreases, examples).
    pub fn summary(&self) -> Summary {
        self.state.lock().expect("checker lock").1.clone()
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

    fn rw(events: &[(&str, usize, Mode, u64)]) -> Summary {
        let c = RwChecker::new();
        for &(what, client, mode, fence) in events {
            match what {
                "wait" => c.waiting("k", client),
                "grant" => c.granted("k", client, mode, Some(fence)),
                _ => c.releasing("k", client),
            }
        }
        c.summary()
    }

    use Mode::{Exclusive as W, Shared as R};

    #[test]
    fn readers_together_and_answers_out_of_order_are_fine() {
        // Readers 0 and 1 granted together (fences 5 and 6, answered 6 first), then a
        // writer after both left, then a reader after the writer.
        let s = rw(&[
            ("wait", 0, R, 0),
            ("wait", 1, R, 0),
            ("grant", 1, R, 6),
            ("grant", 0, R, 5),
            ("wait", 2, W, 0),
            ("rel", 0, R, 0),
            ("rel", 1, R, 0),
            ("grant", 2, W, 7),
            ("wait", 0, R, 0),
            ("rel", 2, W, 0),
            ("grant", 0, R, 8),
        ]);
        assert_eq!((s.overlaps, s.fence_decreases), (0, 0), "{:?}", s.examples);
    }

    #[test]
    fn catches_a_planted_writer_overlapping_a_reader() {
        // The writer is granted while reader 0 still holds.
        let s = rw(&[("grant", 0, R, 5), ("grant", 1, W, 6)]);
        assert_eq!((s.overlaps, s.fence_decreases), (1, 0));
        assert!(s.examples[0]
            .detail
            .contains("Exclusive while client 0 held it Shared"));
        // And a reader granted while a writer holds.
        let s = rw(&[("grant", 0, W, 5), ("grant", 1, R, 6)]);
        assert_eq!(s.overlaps, 1);
    }

    #[test]
    fn catches_planted_fence_regressions_across_modes() {
        // A writer below a reader's fence seen before it.
        let s = rw(&[("grant", 0, R, 9), ("rel", 0, R, 0), ("grant", 1, W, 8)]);
        assert_eq!((s.overlaps, s.fence_decreases), (0, 1));
        // A reader below the writer before it.
        let s = rw(&[("grant", 0, W, 9), ("rel", 0, W, 0), ("grant", 1, R, 8)]);
        assert_eq!(s.fence_decreases, 1);
        // A reader below a reader that had left before it asked.
        let s = rw(&[
            ("grant", 0, R, 9),
            ("rel", 0, R, 0),
            ("wait", 1, R, 0),
            ("grant", 1, R, 4),
        ]);
        assert_eq!(s.fence_decreases, 1);
        // Two readers with one fence.
        let s = rw(&[("grant", 0, R, 9), ("grant", 1, R, 9)]);
        assert_eq!(s.fence_decreases, 1);
    }
}
