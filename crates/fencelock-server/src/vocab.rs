//! The core's events in the vocabulary's words ([`fencelock_proto::vocab`]): the one
//! place the server maps a [`fencelock_core::EventKind`] to an event name. Audit,
//! watch (SSE, gRPC, `flw/1`), the dashboard and metrics all go through here, and
//! the test `tests/vocab.rs` checks that no other string literal for an event name
//! is left in the server's source.

use fencelock_core::{EventKind, GrantEnd, WaitEnd};
use fencelock_proto as pb;
pub use fencelock_proto::vocab::{human_ms, Event, KindFilter};

/// The vocabulary event of a core event.
pub fn event(kind: EventKind) -> Event {
    match kind {
        EventKind::Granted => Event::Granted,
        EventKind::Ended(GrantEnd::Released) => Event::Released,
        EventKind::Ended(GrantEnd::Expired) => Event::Expired,
        EventKind::Ended(GrantEnd::ForceReleased) => Event::ForceReleased,
        EventKind::Queued => Event::Queued,
        EventKind::WaitEnded(_) => Event::WaitEnded,
        EventKind::Downgraded => Event::Downgraded,
        EventKind::Proclaimed => Event::Proclaimed,
    }
}

/// The gRPC / `flw/1` reason of a wait end.
pub fn wait_end_pb(end: WaitEnd) -> pb::WaitEnd {
    match end {
        WaitEnd::TimedOut => pb::WaitEnd::TimedOut,
        WaitEnd::SessionEnded => pb::WaitEnd::SessionEnded,
        WaitEnd::Cancelled => pb::WaitEnd::Cancelled,
        WaitEnd::ServerRestarted => pb::WaitEnd::ServerRestarted,
    }
}

/// The stable name of a wait end (`timed_out`, …; JSON `wait_end`).
pub fn wait_end_name(end: WaitEnd) -> &'static str {
    // Every core reason has a wire value other than UNSPECIFIED.
    fencelock_proto::vocab::wait_end_name(wait_end_pb(end)).unwrap_or("unknown")
}

#[cfg(test)]
mod tests {
    use super::*;
    use fencelock_core::{GrantEnd, WaitEnd};

    /// Every core event kind, with every variant of what it carries.
    pub(crate) fn all_kinds() -> Vec<EventKind> {
        let mut kinds = vec![
            EventKind::Granted,
            EventKind::Queued,
            EventKind::Downgraded,
            EventKind::Proclaimed,
        ];
        for end in [
            GrantEnd::Released,
            GrantEnd::Expired,
            GrantEnd::ForceReleased,
        ] {
            kinds.push(EventKind::Ended(end));
        }
        for end in [
            WaitEnd::TimedOut,
            WaitEnd::SessionEnded,
            WaitEnd::Cancelled,
            WaitEnd::ServerRestarted,
        ] {
            kinds.push(EventKind::WaitEnded(end));
        }
        kinds
    }

    #[test]
    fn every_core_event_has_a_watch_kind_and_every_wait_end_a_name() {
        for kind in all_kinds() {
            let e = event(kind);
            assert!(e.pb().is_some(), "{e} is a watch event");
            if let EventKind::WaitEnded(end) = kind {
                assert_ne!(wait_end_name(end), "unknown");
            }
        }
    }
}
