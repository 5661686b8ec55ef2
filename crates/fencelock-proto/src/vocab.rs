//! The event vocabulary: one name for each lock event, the same in the audit log,
//! watch (HTTP SSE, gRPC, `flw/1`), the dashboard, metrics label values, the client
//! library and the CLI; and one duration format for people ([`human_ms`]).
//!
//! It lives here because every surface can reach this crate without a new
//! dependency edge: the server and the client library both depend on it, and the
//! CLI through the client (`fencelock::vocab`). The core stays free of names.
//!
//! Names are past-tense snake_case (`granted`, `force_released`). A hand-off (a
//! queued request granted on someone else's release, expiry or forced release) is a
//! `granted` event with `handoff: true` in the audit log, not an event of its own: to
//! the waiter it is the grant it asked for, and watchers that count grants see it.
//!
//! The audit log named its entries differently before (`grant`, `handoff`,
//! `forced_release`, …). Those names are still accepted as input ([`KindFilter`]);
//! the output uses only the names here.

use crate::EventKind as PbEventKind;
use crate::WaitEnd as PbWaitEnd;

/// What happened to a lock, a queued request or a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Event {
    /// A grant was made, directly or by hand-off to a waiter.
    Granted,
    /// A holder released its grant (or its session was closed).
    Released,
    /// A grant's lease (or its session) expired.
    Expired,
    /// An operator took a grant away.
    ForceReleased,
    /// A request joined a lock's queue.
    Queued,
    /// A request left the queue without a grant (the reason is [`wait_end_name`]).
    WaitEnded,
    /// An exclusive grant became shared (its fence kept).
    Downgraded,
    /// An election's leader published a new value.
    Proclaimed,
    /// A session ended (closed or expired).
    SessionEnded,
    /// A renew was refused (not a state change; audit log only).
    RenewFailed,
}

impl Event {
    /// Every event, in a stable order.
    pub const ALL: [Event; 10] = [
        Event::Granted,
        Event::Released,
        Event::Expired,
        Event::ForceReleased,
        Event::Queued,
        Event::WaitEnded,
        Event::Downgraded,
        Event::Proclaimed,
        Event::SessionEnded,
        Event::RenewFailed,
    ];

    /// The wire name: JSON `kind`, the SSE `event:` field, CLI output, metrics label
    /// values, the dashboard's CSS class (`kind-<name>`).
    pub const fn name(self) -> &'static str {
        match self {
            Event::Granted => "granted",
            Event::Released => "released",
            Event::Expired => "expired",
            Event::ForceReleased => "force_released",
            Event::Queued => "queued",
            Event::WaitEnded => "wait_ended",
            Event::Downgraded => "downgraded",
            Event::Proclaimed => "proclaimed",
            Event::SessionEnded => "session_ended",
            Event::RenewFailed => "renew_failed",
        }
    }

    /// The label for people (the dashboard): the name with spaces.
    pub const fn label(self) -> &'static str {
        match self {
            Event::Granted => "granted",
            Event::Released => "released",
            Event::Expired => "expired",
            Event::ForceReleased => "force released",
            Event::Queued => "queued",
            Event::WaitEnded => "wait ended",
            Event::Downgraded => "downgraded",
            Event::Proclaimed => "proclaimed",
            Event::SessionEnded => "session ended",
            Event::RenewFailed => "renew failed",
        }
    }

    /// The event of a wire name (the current names only; see [`KindFilter`] for
    /// the old audit names).
    pub fn from_name(name: &str) -> Option<Event> {
        Event::ALL.into_iter().find(|e| e.name() == name)
    }

    /// The gRPC / `flw/1` kind; `None` for the audit-only events (session ends and
    /// refused renews are not watch events).
    pub const fn pb(self) -> Option<PbEventKind> {
        match self {
            Event::Granted => Some(PbEventKind::Granted),
            Event::Released => Some(PbEventKind::Released),
            Event::Expired => Some(PbEventKind::Expired),
            Event::ForceReleased => Some(PbEventKind::ForceReleased),
            Event::Queued => Some(PbEventKind::Queued),
            Event::WaitEnded => Some(PbEventKind::WaitEnded),
            Event::Downgraded => Some(PbEventKind::Downgraded),
            Event::Proclaimed => Some(PbEventKind::Proclaimed),
            Event::SessionEnded | Event::RenewFailed => None,
        }
    }

    /// The event of a gRPC / `flw/1` kind; `None` for `UNSPECIFIED`.
    pub fn from_pb(kind: PbEventKind) -> Option<Event> {
        Event::ALL.into_iter().find(|e| e.pb() == Some(kind))
    }
}

impl std::fmt::Display for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The stable name of why a request left the queue (`wait_end` in JSON and the
/// CLI); `None` for `UNSPECIFIED` (not a wait end).
pub const fn wait_end_name(end: PbWaitEnd) -> Option<&'static str> {
    match end {
        PbWaitEnd::Unspecified => None,
        PbWaitEnd::TimedOut => Some("timed_out"),
        PbWaitEnd::SessionEnded => Some("session_ended"),
        PbWaitEnd::Cancelled => Some("cancelled"),
        PbWaitEnd::ServerRestarted => Some("server_restarted"),
    }
}

/// The audit log's names before the vocabulary, each with the event and hand-off
/// flag it selects. Accepted as input only (the `kind` filter), so scripts written
/// against them keep working.
pub const OLD_AUDIT_NAMES: [(&str, Event, Option<bool>); 9] = [
    ("grant", Event::Granted, Some(false)),
    ("handoff", Event::Granted, Some(true)),
    ("release", Event::Released, None),
    ("expiry", Event::Expired, None),
    ("forced_release", Event::ForceReleased, None),
    ("session_end", Event::SessionEnded, None),
    ("renew_failed", Event::RenewFailed, None),
    ("downgrade", Event::Downgraded, None),
    ("proclaim", Event::Proclaimed, None),
];

/// One term of a `kind` filter: an event, and for `granted` optionally only direct
/// grants (`handoff: Some(false)`, the old name `grant`) or only hand-offs
/// (`Some(true)`, the old name `handoff`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KindFilter {
    /// The event selected.
    pub event: Event,
    /// `None`: any; otherwise only entries whose hand-off flag is this.
    pub handoff: Option<bool>,
}

impl KindFilter {
    /// Parses a current name or an old audit name ([`OLD_AUDIT_NAMES`]).
    pub fn parse(text: &str) -> Option<KindFilter> {
        if let Some(event) = Event::from_name(text) {
            return Some(KindFilter {
                event,
                handoff: None,
            });
        }
        OLD_AUDIT_NAMES
            .iter()
            .find(|(old, _, _)| *old == text)
            .map(|&(_, event, handoff)| KindFilter { event, handoff })
    }

    /// Parses a comma-separated list of names (`granted,force_released`); the
    /// error names the first unknown one.
    pub fn parse_list(text: &str) -> Result<Vec<KindFilter>, String> {
        text.split(',')
            .map(str::trim)
            .map(|t| {
                KindFilter::parse(t).ok_or_else(|| {
                    let names: Vec<&str> = Event::ALL.iter().map(|e| e.name()).collect();
                    format!("{t:?} is not an event (one of: {})", names.join(", "))
                })
            })
            .collect()
    }

    /// Whether an entry of `event` with hand-off flag `handoff` matches.
    pub fn matches(&self, event: Event, handoff: bool) -> bool {
        self.event == event && self.handoff.is_none_or(|h| h == handoff)
    }
}

/// A duration for people, as precise as a glance needs and never more than it
/// was: the two largest units, the smaller one truncated (`250ms`, `12s300ms`,
/// `1m48s`, `2h3m`, `3d4h`; a whole unit alone: `30s`, `2h`). Seconds keep tenths
/// (`1s500ms`). The text parses back as a duration (`humantime`, the CLI's flags).
/// Machines get integer milliseconds (`duration_ms`) instead.
pub fn human_ms(ms: u64) -> String {
    const S: u64 = 1_000;
    const M: u64 = 60 * S;
    const H: u64 = 60 * M;
    const D: u64 = 24 * H;
    let (big, big_unit, small, small_unit) = match ms {
        0..S => return format!("{ms}ms"),
        S..M => (ms / S, "s", (ms % S) / 100 * 100, "ms"),
        M..H => (ms / M, "m", (ms % M) / S, "s"),
        H..D => (ms / H, "h", (ms % H) / M, "m"),
        _ => (ms / D, "d", (ms % D) / H, "h"),
    };
    if small == 0 {
        format!("{big}{big_unit}")
    } else {
        format!("{big}{big_unit}{small}{small_unit}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_past_tense_snake_case_and_round_trip() {
        let mut seen = std::collections::HashSet::new();
        for e in Event::ALL {
            let name = e.name();
            assert!(seen.insert(name), "{name} twice");
            assert!(
                name.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'),
                "{name}"
            );
            assert!(name.ends_with("ed"), "{name} is not past tense");
            assert_eq!(Event::from_name(name), Some(e));
            assert_eq!(e.label(), name.replace('_', " "));
            assert_eq!(e.to_string(), name);
            if let Some(kind) = e.pb() {
                assert_eq!(Event::from_pb(kind), Some(e));
            }
        }
        assert_eq!(Event::from_pb(PbEventKind::Unspecified), None);
        assert_eq!(Event::from_name("forced_release"), None);
    }

    #[test]
    fn every_grpc_kind_has_an_event() {
        for k in 1..=32 {
            if let Ok(kind) = PbEventKind::try_from(k) {
                let e = Event::from_pb(kind).expect("a vocabulary event");
                assert_eq!(
                    kind.as_str_name().trim_start_matches("EVENT_KIND_"),
                    e.name().to_ascii_uppercase()
                );
            }
        }
        for k in 1..=8 {
            if let Ok(end) = PbWaitEnd::try_from(k) {
                let name = wait_end_name(end).expect("a name");
                assert_eq!(
                    end.as_str_name().trim_start_matches("WAIT_END_"),
                    name.to_ascii_uppercase()
                );
            }
        }
    }

    #[test]
    fn filters_take_new_names_and_the_old_audit_names() {
        let f = |t: &str| KindFilter::parse(t).unwrap();
        assert!(f("granted").matches(Event::Granted, true));
        assert!(f("granted").matches(Event::Granted, false));
        assert!(f("grant").matches(Event::Granted, false));
        assert!(!f("grant").matches(Event::Granted, true));
        assert!(f("handoff").matches(Event::Granted, true));
        assert!(!f("handoff").matches(Event::Granted, false));
        assert!(f("forced_release").matches(Event::ForceReleased, false));
        assert!(!f("forced_release").matches(Event::Released, false));
        for (old, event, _) in OLD_AUDIT_NAMES {
            assert_eq!(f(old).event, event, "{old}");
        }
        assert_eq!(
            KindFilter::parse_list("released, expiry").unwrap(),
            vec![f("released"), f("expired")]
        );
        let e = KindFilter::parse_list("granted,nope").unwrap_err();
        assert!(
            e.contains("\"nope\"") && e.contains("force_released"),
            "{e}"
        );
        assert!(KindFilter::parse_list("").is_err());
    }

    #[test]
    fn durations_for_people() {
        for (ms, text) in [
            (0, "0ms"),
            (250, "250ms"),
            (999, "999ms"),
            (1_000, "1s"),
            (1_549, "1s500ms"),
            (12_345, "12s300ms"),
            (59_999, "59s900ms"),
            (60_000, "1m"),
            (108_860, "1m48s"),
            (3_599_999, "59m59s"),
            (3_600_000, "1h"),
            (7_380_000, "2h3m"),
            (86_400_000, "1d"),
            (3 * 86_400_000 + 4 * 3_600_000 + 5, "3d4h"),
            (u64::MAX, "213503982334d14h"),
        ] {
            assert_eq!(human_ms(ms), text, "{ms}");
        }
    }
}
