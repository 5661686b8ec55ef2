//! The core's events in the vocabulary's words ([`fencelock_proto::vocab`]): the one
//! place the server maps a [`fencelock_core::EventKind`] to an event name. Audit,
//! watch (SSE, gRPC, `flw/1`), the dashboard and metrics all go through here, and
//! the test `tests/vocab.rs` checks that no other string literal for an event name
//! is left in the server's source.

use fencelock_core::{EventKind, GrantEnd, WaitEnd};
use fencelock_proto as pb;
pub use fencelock_proto::vocab::{human_ms, Event, KindFilter};
use serde::Serialize;

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

/// The fields of an event on the wire, one set for the audit log (`GET /v1/audit`
/// entries) and watch (`GET /v1/watch` event data), and the same names as the gRPC /
/// `flw/1` `LockEvent` and the CLI's `--json` lines. A field is absent when it does
/// not apply (or, in the audit log, was not recorded). Each surface adds only its
/// own position (`seq` in the audit log, `position` in watch) and what it alone has.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct EventFields {
    /// What happened: an event name of the vocabulary.
    #[schema(schema_with = event_name_schema)]
    pub kind: &'static str,
    /// On `granted`: whether the lock was handed to a queued request (on a release,
    /// expiry, forced release, downgrade or a wait ending ahead of it) rather than
    /// granted to the acquire that asked.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub handoff: Option<bool>,
    /// The lock (or election).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub name: Option<String>,
    /// The grant's fence (an election's term).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub fence: Option<u64>,
    /// The owner text of the grant or request.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub owner: Option<String>,
    /// The session involved, by its handle (never its id).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub session: Option<String>,
    /// The grant's or request's mode.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false, schema_with = mode_schema)]
    pub mode: Option<&'static str>,
    /// An election's value (on `granted` of a leader and on `proclaimed`).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub value: Option<String>,
    /// When the change was committed, RFC 3339 UTC with milliseconds.
    pub time: String,
    /// The same time in milliseconds since the Unix epoch (what `since_ms` and
    /// `until_ms` compare with).
    pub time_ms: u64,
    /// Milliseconds: how long the grant was held (ends), or how long the request
    /// was queued (`granted`, `wait_ended`); 0 otherwise.
    pub duration_ms: u64,
    /// A forced release's reason; `closed` or `expired` for a session end.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub reason: Option<String>,
    /// On `wait_ended`: why (`timed_out`, `session_ended`, `cancelled`,
    /// `server_restarted`).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub wait_end: Option<&'static str>,
}

impl EventFields {
    /// The fields of a core event committed at `time_ms`.
    pub fn of(e: &fencelock_core::Event, time_ms: u64) -> EventFields {
        let kind = event(e.kind);
        EventFields {
            kind: kind.name(),
            handoff: (kind == Event::Granted).then_some(e.handoff),
            name: Some(e.name.as_str().to_owned()),
            fence: e.fence.map(fencelock_core::Fence::get),
            owner: Some(e.owner.as_str().to_owned()),
            session: e.session.map(crate::input::session_handle),
            mode: Some(e.mode.as_str()),
            value: e.value.as_ref().map(|v| v.as_str().to_owned()),
            time: crate::dashboard::rfc3339(time_ms),
            time_ms,
            duration_ms: e.duration_ms,
            reason: e.reason.as_ref().map(|r| r.as_str().to_owned()),
            wait_end: match e.kind {
                EventKind::WaitEnded(end) => Some(wait_end_name(end)),
                _ => None,
            },
        }
    }
}

fn event_name_schema() -> impl Into<utoipa::openapi::RefOr<utoipa::openapi::Schema>> {
    let names: Vec<&str> = Event::ALL.iter().map(|e| e.name()).collect();
    utoipa::openapi::ObjectBuilder::new()
        .schema_type(utoipa::openapi::schema::Type::String)
        .enum_values(Some(names))
}

fn mode_schema() -> impl Into<utoipa::openapi::RefOr<utoipa::openapi::Schema>> {
    utoipa::openapi::ObjectBuilder::new()
        .schema_type(utoipa::openapi::schema::Type::String)
        .enum_values(Some(["exclusive", "shared"]))
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
