//! Watch positions and the history a watch resumes from.
//!
//! Every event comes from applying one logged command (ticks and expiries are logged
//! commands too), so its [`Position`] — the record's sequence number (in cluster mode
//! the Raft log index) and the event's ordinal among that record's events — is a
//! function of the log: a restart that replays the log gives every event the
//! position it had. The server keeps the most recent events in a ring
//! ([`History`]); recovery refills it from the records it replays. A watch that
//! names the last position it saw gets everything after it from the ring, then
//! live events, with no gap and no repeat; one whose position is older than the
//! ring (compacted into a snapshot, or pushed out) or newer than anything this
//! server has (another data directory) is refused explicitly.

use std::collections::VecDeque;
use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, Mutex};

use fencelock_core::Event;
use tokio::sync::broadcast;

use crate::error::{ApiError, ApiErrorKind};

/// Where an event stands in the log: its record's index, then its ordinal among
/// that record's events. Ordered; written `index.ordinal`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Position {
    /// The log record's sequence number (cluster mode: the Raft log index).
    pub index: u64,
    /// The event's ordinal among its record's events, from 0.
    pub ordinal: u32,
}

impl Position {
    /// The position just before every event of record `index`.
    fn before_record(index: u64) -> Position {
        match index.checked_sub(1) {
            Some(prev) => Position {
                index: prev,
                ordinal: u32::MAX,
            },
            None => Position::default(),
        }
    }
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.index, self.ordinal)
    }
}

impl FromStr for Position {
    type Err = ApiError;

    /// `index.ordinal`, both decimal; anything else is refused (a bare index too),
    /// so that a typo is never read as some other position.
    fn from_str(s: &str) -> Result<Position, ApiError> {
        let bad = || {
            ApiError::new(
                ApiErrorKind::InvalidArgument,
                format!("invalid watch position {s:?}: expected INDEX.ORDINAL, as sent in events"),
            )
        };
        let (index, ordinal) = s.split_once('.').ok_or_else(bad)?;
        let digits = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit());
        if !digits(index) || !digits(ordinal) {
            return Err(bad());
        }
        Ok(Position {
            index: index.parse().map_err(|_| bad())?,
            ordinal: ordinal.parse().map_err(|_| bad())?,
        })
    }
}

/// A lock event as watchers get it: the core's event, where it stands in the log,
/// and the wall-clock time its record was made (milliseconds since the Unix epoch,
/// from the record itself, so the same after a restart).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchEvent {
    /// Where it stands in the log.
    pub position: Position,
    /// Wall-clock time of its record, ms since the Unix epoch.
    pub wall_ms: u64,
    /// What happened.
    pub event: Event,
}

impl std::ops::Deref for WatchEvent {
    type Target = Event;

    fn deref(&self) -> &Event {
        &self.event
    }
}

/// The default number of recent events kept for watches to resume from.
pub const DEFAULT_WATCH_HISTORY: usize = 65_536;

/// The recent events, bounded by count, and what a resume may start from.
pub(crate) struct History {
    inner: Mutex<Ring>,
}

struct Ring {
    events: VecDeque<Arc<WatchEvent>>,
    capacity: usize,
    /// Every event after this position is in `events`.
    floor: Position,
    /// The last record index this server knows of (published or recovered): a
    /// position beyond it comes from another data directory.
    head: u64,
    /// Whether a position past `head` is refused. Not in a cluster: a member
    /// that lags behind the one a watcher came from will get there.
    refuse_future: bool,
}

/// How a resumed watch starts: the events it missed, then the live ones from
/// `live` (which may repeat some of the missed ones: drop those up to `last`).
pub struct Resume {
    /// Events after the asked position, oldest first.
    pub backlog: Vec<Arc<WatchEvent>>,
    /// Live events, subscribed before the backlog was read.
    pub live: broadcast::Receiver<Arc<WatchEvent>>,
}

impl History {
    /// An empty history whose floor is `before` (the record index of the first
    /// record it will hear of), holding at most `capacity` events.
    pub(crate) fn new(capacity: usize, first_index: u64) -> History {
        History {
            inner: Mutex::new(Ring {
                events: VecDeque::new(),
                capacity: capacity.max(1),
                floor: Position::before_record(first_index),
                head: first_index.saturating_sub(1),
                refuse_future: true,
            }),
        }
    }

    /// A cluster member's history: a position past what this member has applied
    /// is waited for, not refused (another member applied it first).
    pub(crate) fn for_member(capacity: usize) -> History {
        let history = History::new(capacity, 0);
        history.ring().refuse_future = false;
        history
    }

    fn ring(&self) -> std::sync::MutexGuard<'_, Ring> {
        // A panic elsewhere while holding it left a consistent ring (every
        // mutation is a single push/pop/assignment): keep serving.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records `event` (its position after every one recorded before).
    pub(crate) fn push(&self, event: Arc<WatchEvent>) {
        self.push_all(std::slice::from_ref(&event));
    }

    /// Records `events`, in order, under one lock.
    pub(crate) fn push_all(&self, events: &[Arc<WatchEvent>]) {
        let mut ring = self.ring();
        for event in events {
            ring.head = ring.head.max(event.position.index);
            if ring.events.len() == ring.capacity {
                if let Some(old) = ring.events.pop_front() {
                    ring.floor = old.position;
                }
            }
            ring.events.push_back(event.clone());
        }
    }

    /// Notes that records up to `index` were applied (some make no event).
    pub(crate) fn applied(&self, index: u64) {
        let mut ring = self.ring();
        ring.head = ring.head.max(index);
    }

    /// Forgets everything up to record `index`: a snapshot replaced the state.
    pub(crate) fn reset(&self, index: u64) {
        let mut ring = self.ring();
        ring.events.clear();
        ring.floor = Position {
            index,
            ordinal: u32::MAX,
        };
        ring.head = ring.head.max(index);
    }

    /// A watch from now on: live events from `sender` after the returned position
    /// (the last event recorded; a live event at or before it was recorded before
    /// the watch began, so the watcher drops it). With a position, a watcher that
    /// falls behind the live channel can resume from the history.
    pub(crate) fn now(
        &self,
        sender: &broadcast::Sender<Arc<WatchEvent>>,
    ) -> (Position, broadcast::Receiver<Arc<WatchEvent>>) {
        let live = sender.subscribe();
        let ring = self.ring();
        let last = ring.events.back().map_or(ring.floor, |e| e.position);
        (last, live)
    }

    /// The events after `after`, read after subscribing to `sender`, or why a watch
    /// cannot resume there.
    pub(crate) fn resume(
        &self,
        sender: &broadcast::Sender<Arc<WatchEvent>>,
        after: Position,
    ) -> Result<Resume, ApiError> {
        // Subscribe first: an event pushed after the read below is published after
        // this, so it reaches `live`; one pushed before is in the backlog.
        let live = sender.subscribe();
        let ring = self.ring();
        if after < ring.floor {
            return Err(ApiError::new(
                ApiErrorKind::WatchCompacted,
                format!(
                    "cannot resume the watch after {after}: this server keeps events after {} \
                     only; re-read the locks and watch again",
                    ring.floor
                ),
            ));
        }
        if ring.refuse_future && after.index > ring.head {
            return Err(ApiError::new(
                ApiErrorKind::WatchCompacted,
                format!(
                    "cannot resume the watch after {after}: this server's log ends at index {} \
                     (a position from another data directory?); re-read the locks and watch again",
                    ring.head
                ),
            ));
        }
        let start = ring.events.partition_point(|e| e.position <= after);
        let backlog = ring.events.range(start..).cloned().collect();
        Ok(Resume { backlog, live })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fencelock_core::{EventKind, LockName, Owner};

    fn event(index: u64, ordinal: u32) -> Arc<WatchEvent> {
        Arc::new(WatchEvent {
            position: Position { index, ordinal },
            wall_ms: 0,
            event: Event {
                kind: EventKind::Granted,
                name: LockName::new("a").unwrap(),
                fence: None,
                owner: Owner::default(),
                session: None,
                tenant: None,
                at_ms: 0,
                duration_ms: 0,
                reason: None,
                mode: Default::default(),
                value: None,
                handoff: false,
            },
        })
    }

    fn positions(r: &Resume) -> Vec<(u64, u32)> {
        r.backlog
            .iter()
            .map(|e| (e.position.index, e.position.ordinal))
            .collect()
    }

    #[test]
    fn positions_parse_and_print_alike_and_order_by_index_then_ordinal() {
        let p: Position = "42.7".parse().unwrap();
        assert_eq!(
            p,
            Position {
                index: 42,
                ordinal: 7
            }
        );
        assert_eq!(p.to_string(), "42.7");
        assert!(p < "43.0".parse().unwrap());
        assert!(p > "42.6".parse().unwrap());
        for bad in [
            "",
            "42",
            "42.",
            ".7",
            "a.1",
            "1.-1",
            "1.99999999999",
            " 1.2",
            "1.2.3",
        ] {
            let err = bad.parse::<Position>().unwrap_err();
            assert_eq!(err.kind(), ApiErrorKind::InvalidArgument, "{bad:?}");
        }
    }

    #[test]
    fn a_resume_gets_what_followed_and_is_refused_before_the_floor_or_past_the_head() {
        let (sender, _) = broadcast::channel(16);
        let history = History::new(3, 5);
        // Nothing yet: resuming just before record 5 is fine, before that is not.
        assert!(history
            .resume(&sender, "4.4294967295".parse().unwrap())
            .is_ok());
        let err = history
            .resume(&sender, "4.0".parse().unwrap())
            .err()
            .unwrap();
        assert_eq!(err.kind(), ApiErrorKind::WatchCompacted);
        for (i, o) in [(5, 0), (5, 1), (7, 0), (8, 0)] {
            history.push(event(i, o));
        }
        // (5, 0) was pushed out: resuming after it still works, before it not.
        let r = history.resume(&sender, "5.0".parse().unwrap()).unwrap();
        assert_eq!(positions(&r), [(5, 1), (7, 0), (8, 0)]);
        let r = history.resume(&sender, "6.0".parse().unwrap()).unwrap();
        assert_eq!(positions(&r), [(7, 0), (8, 0)]);
        let err = history
            .resume(&sender, "4.9".parse().unwrap())
            .err()
            .unwrap();
        assert_eq!(err.kind(), ApiErrorKind::WatchCompacted);
        // Past the head: refused; a record that made no event moves the head.
        let err = history
            .resume(&sender, "9.0".parse().unwrap())
            .err()
            .unwrap();
        assert!(err.message().contains("another data directory"), "{err}");
        history.applied(9);
        let r = history.resume(&sender, "9.0".parse().unwrap()).unwrap();
        assert!(r.backlog.is_empty());
        // A snapshot installed up to record 20: its events are gone.
        history.reset(20);
        let err = history
            .resume(&sender, "20.0".parse().unwrap())
            .err()
            .unwrap();
        assert_eq!(err.kind(), ApiErrorKind::WatchCompacted);
        assert!(history
            .resume(&sender, "20.4294967295".parse().unwrap())
            .is_ok());
    }

    #[test]
    fn a_cluster_member_waits_for_a_position_it_has_not_applied_yet() {
        let (sender, _) = broadcast::channel(16);
        let history = History::for_member(8);
        history.push(event(3, 0));
        let r = history.resume(&sender, "9.0".parse().unwrap()).unwrap();
        assert!(r.backlog.is_empty());
        history.reset(20);
        let err = history
            .resume(&sender, "9.0".parse().unwrap())
            .err()
            .unwrap();
        assert_eq!(err.kind(), ApiErrorKind::WatchCompacted);
    }
}
