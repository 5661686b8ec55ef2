//! What [`FencelockBackend`](crate::FencelockBackend)'s read calls return: lock
//! views and lock events as plain types of this crate, converted from the server's
//! gRPC messages here, so the public API does not depend on the wire format.

use fencelock_backend::LockMode;
use fencelock_proto as pb;
use fencelock_proto::vocab;

/// One lock's holders and queue (from
/// [`FencelockBackend::get_lock`](crate::FencelockBackend::get_lock) and
/// [`list_locks`](crate::FencelockBackend::list_locks)).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LockInfo {
    /// The lock's name.
    pub name: String,
    /// How many holders it admits (1 for a mutex).
    pub limit: u32,
    /// The current holders, in grant order.
    pub holders: Vec<HolderInfo>,
    /// How many requests are queued.
    pub waiters: u64,
    /// Lock-delay time left after a forced release or expiry (0 if none).
    pub lock_delay_remaining_ms: u64,
}

/// One holder of a lock.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct HolderInfo {
    /// Its fencing token.
    pub fence: u64,
    /// Its owner text.
    pub owner: String,
    /// How long it has held the lock.
    pub held_ms: u64,
    /// Lease time left (its session's, if session-held).
    pub ttl_remaining_ms: u64,
    /// Its session's handle, if session-held (never the session id).
    pub session: Option<String>,
}

/// A page of locks from [`list_locks`](crate::FencelockBackend::list_locks).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LockPage {
    /// Locks in name order.
    pub locks: Vec<LockInfo>,
    /// Set when the page is full: pass it as `after` for the next page.
    pub next_after: Option<String>,
}

/// What a [`LockEvent`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum EventKind {
    /// A grant was made (directly or by hand-off to a waiter).
    Granted,
    /// A grant was released by its holder (or its session was closed).
    Released,
    /// A grant's lease (or its session) expired.
    Expired,
    /// An operator took a grant away.
    ForceReleased,
    /// A request joined the queue.
    Queued,
    /// A request left the queue without a grant; [`LockEvent::wait_end`] says why.
    WaitEnded,
    /// An exclusive grant became shared (its fence kept).
    Downgraded,
    /// An election's leader published a new value.
    Proclaimed,
    /// A kind this client does not know (from a newer server).
    Unknown,
}

impl EventKind {
    /// The stable snake_case name (`granted`, `force_released`, …): the event
    /// vocabulary's ([`crate::vocab::Event::name`]), the same as the server's watch
    /// and audit log; `unknown` for [`EventKind::Unknown`].
    pub fn as_str(self) -> &'static str {
        self.event().map_or("unknown", vocab::Event::name)
    }

    /// The vocabulary event (`None` for [`EventKind::Unknown`]).
    pub fn event(self) -> Option<vocab::Event> {
        Some(match self {
            EventKind::Granted => vocab::Event::Granted,
            EventKind::Released => vocab::Event::Released,
            EventKind::Expired => vocab::Event::Expired,
            EventKind::ForceReleased => vocab::Event::ForceReleased,
            EventKind::Queued => vocab::Event::Queued,
            EventKind::WaitEnded => vocab::Event::WaitEnded,
            EventKind::Downgraded => vocab::Event::Downgraded,
            EventKind::Proclaimed => vocab::Event::Proclaimed,
            EventKind::Unknown => return None,
        })
    }

    fn from_pb(kind: i32) -> EventKind {
        let event = pb::EventKind::try_from(kind)
            .ok()
            .and_then(vocab::Event::from_pb);
        match event {
            Some(vocab::Event::Granted) => EventKind::Granted,
            Some(vocab::Event::Released) => EventKind::Released,
            Some(vocab::Event::Expired) => EventKind::Expired,
            Some(vocab::Event::ForceReleased) => EventKind::ForceReleased,
            Some(vocab::Event::Queued) => EventKind::Queued,
            Some(vocab::Event::WaitEnded) => EventKind::WaitEnded,
            Some(vocab::Event::Downgraded) => EventKind::Downgraded,
            Some(vocab::Event::Proclaimed) => EventKind::Proclaimed,
            // Audit-only events never come from watch.
            Some(vocab::Event::SessionEnded | vocab::Event::RenewFailed) | None => {
                EventKind::Unknown
            }
        }
    }
}

/// Why a queued request left the queue without a grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WaitEnd {
    /// Its `wait` passed.
    TimedOut,
    /// Its session expired or was closed.
    SessionEnded,
    /// The client cancelled or went away.
    Cancelled,
    /// The server restarted; the client must retry.
    ServerRestarted,
    /// A reason this client does not know (from a newer server).
    Unknown,
}

impl WaitEnd {
    /// The stable snake_case name (`timed_out`, `session_ended`, …), the server's.
    pub fn as_str(self) -> &'static str {
        let end = match self {
            WaitEnd::TimedOut => pb::WaitEnd::TimedOut,
            WaitEnd::SessionEnded => pb::WaitEnd::SessionEnded,
            WaitEnd::Cancelled => pb::WaitEnd::Cancelled,
            WaitEnd::ServerRestarted => pb::WaitEnd::ServerRestarted,
            WaitEnd::Unknown => pb::WaitEnd::Unspecified,
        };
        vocab::wait_end_name(end).unwrap_or("unknown")
    }

    /// `None` for "not a wait end".
    fn from_pb(end: i32) -> Option<WaitEnd> {
        match pb::WaitEnd::try_from(end) {
            Ok(pb::WaitEnd::Unspecified) => None,
            Ok(pb::WaitEnd::TimedOut) => Some(WaitEnd::TimedOut),
            Ok(pb::WaitEnd::SessionEnded) => Some(WaitEnd::SessionEnded),
            Ok(pb::WaitEnd::Cancelled) => Some(WaitEnd::Cancelled),
            Ok(pb::WaitEnd::ServerRestarted) => Some(WaitEnd::ServerRestarted),
            Err(_) => Some(WaitEnd::Unknown),
        }
    }
}

/// A lock event from [`EventStream::next`](crate::EventStream::next), sent only
/// after the change is durable.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LockEvent {
    /// What happened.
    pub kind: EventKind,
    /// The lock.
    pub name: String,
    /// The grant's fence (for grants and their ends).
    pub fence: Option<u64>,
    /// The owner text of the grant or request.
    pub owner: String,
    /// The handle of the session involved, if any (never its id).
    pub session: Option<String>,
    /// Server service time of the event (monotonic; only differences mean
    /// anything).
    pub at_ms: u64,
    /// For [`EventKind::Granted`]: time spent queued. For the ends of grants: time
    /// held.
    pub duration_ms: u64,
    /// For [`EventKind::ForceReleased`]: the operator's reason.
    pub reason: Option<String>,
    /// For [`EventKind::WaitEnded`]: why.
    pub wait_end: Option<WaitEnd>,
    /// Where the event stands in the server's log (`None` from a server too old
    /// to say): what a watch resumes after.
    pub position: Option<WatchPosition>,
    /// Wall-clock time of the change on the server, milliseconds since the Unix
    /// epoch (0 from a server too old to say). `time_ms`, as in the audit log.
    pub time_ms: u64,
    /// For [`EventKind::Granted`]: the lock was handed to a queued request (on a
    /// release, expiry, forced release, downgrade or a wait ending ahead of it)
    /// rather than granted to the acquire that asked. False for other kinds.
    pub handoff: bool,
    /// The grant's or request's mode (`None` from a server too old to say).
    pub mode: Option<LockMode>,
    /// For [`EventKind::Granted`] of an election's leader and
    /// [`EventKind::Proclaimed`]: the election value.
    pub value: Option<String>,
}

impl LockEvent {
    /// Wall-clock time of the change on the server (`None` from a server too old
    /// to say).
    pub fn at(&self) -> Option<std::time::SystemTime> {
        (self.time_ms > 0)
            .then(|| std::time::UNIX_EPOCH + std::time::Duration::from_millis(self.time_ms))
    }
}

/// Where a lock event stands in the server's log, the same after a restart:
/// ordered by `index`, then `ordinal`. Written `index.ordinal` (the SSE event id).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct WatchPosition {
    /// The log record's sequence number (cluster mode: the Raft log index).
    pub index: u64,
    /// The event's ordinal among its record's events.
    pub ordinal: u32,
}

impl std::fmt::Display for WatchPosition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.index, self.ordinal)
    }
}

impl std::str::FromStr for WatchPosition {
    type Err = crate::Error;

    /// `index.ordinal`, as [`Display`](std::fmt::Display) writes it.
    fn from_str(s: &str) -> Result<WatchPosition, crate::Error> {
        let bad = || {
            crate::Error::new(
                crate::ErrorKind::InvalidArgument,
                format!("invalid watch position {s:?}: expected INDEX.ORDINAL"),
            )
        };
        let (index, ordinal) = s.split_once('.').ok_or_else(bad)?;
        let digits = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit());
        if !digits(index) || !digits(ordinal) {
            return Err(bad());
        }
        Ok(WatchPosition {
            index: index.parse().map_err(|_| bad())?,
            ordinal: ordinal.parse().map_err(|_| bad())?,
        })
    }
}

impl From<pb::Holder> for HolderInfo {
    fn from(h: pb::Holder) -> HolderInfo {
        HolderInfo {
            fence: h.fence,
            owner: h.owner,
            held_ms: h.held_ms,
            ttl_remaining_ms: h.ttl_remaining_ms,
            session: h.session,
        }
    }
}

impl From<pb::LockInfo> for LockInfo {
    fn from(l: pb::LockInfo) -> LockInfo {
        LockInfo {
            name: l.name,
            limit: l.limit,
            holders: l.holders.into_iter().map(HolderInfo::from).collect(),
            waiters: l.waiters,
            lock_delay_remaining_ms: l.lock_delay_remaining_ms,
        }
    }
}

impl From<pb::ListLocksResponse> for LockPage {
    fn from(p: pb::ListLocksResponse) -> LockPage {
        LockPage {
            locks: p.locks.into_iter().map(LockInfo::from).collect(),
            next_after: p.next_after,
        }
    }
}

impl From<pb::LockEvent> for LockEvent {
    fn from(e: pb::LockEvent) -> LockEvent {
        LockEvent {
            kind: EventKind::from_pb(e.kind),
            name: e.name,
            fence: e.fence,
            owner: e.owner,
            session: e.session,
            at_ms: e.at_ms,
            duration_ms: e.duration_ms,
            reason: e.reason,
            wait_end: WaitEnd::from_pb(e.wait_end),
            position: e.position.map(|p| WatchPosition {
                index: p.index,
                ordinal: p.ordinal,
            }),
            time_ms: e.time_ms,
            handoff: e.handoff,
            mode: match e.mode.as_str() {
                "exclusive" => Some(LockMode::Exclusive),
                "shared" => Some(LockMode::Shared),
                _ => None,
            },
            value: e.value,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_convert_with_unknown_values_kept_apart() {
        let e = LockEvent::from(pb::LockEvent {
            kind: pb::EventKind::WaitEnded as i32,
            name: "a".into(),
            wait_end: pb::WaitEnd::ServerRestarted as i32,
            ..Default::default()
        });
        assert_eq!(e.kind, EventKind::WaitEnded);
        assert_eq!(e.wait_end, Some(WaitEnd::ServerRestarted));
        let e = LockEvent::from(pb::LockEvent {
            kind: 99,
            wait_end: 99,
            ..Default::default()
        });
        assert_eq!(
            (e.kind, e.wait_end),
            (EventKind::Unknown, Some(WaitEnd::Unknown))
        );
        let e = LockEvent::from(pb::LockEvent {
            kind: pb::EventKind::Granted as i32,
            ..Default::default()
        });
        assert_eq!(e.wait_end, None);
        assert_eq!(e.kind.as_str(), "granted");
    }

    #[test]
    fn every_kind_is_named_by_the_vocabulary() {
        for k in 0..=32 {
            let kind = EventKind::from_pb(k);
            let from_vocab = pb::EventKind::try_from(k)
                .ok()
                .and_then(vocab::Event::from_pb)
                .map_or("unknown", vocab::Event::name);
            assert_eq!(kind.as_str(), from_vocab, "kind {k}");
            assert_eq!(
                kind.event().map(vocab::Event::name),
                kind.event().map(|_| from_vocab)
            );
        }
        for k in 0..=8 {
            if let Some(end) = WaitEnd::from_pb(k) {
                let wire = pb::WaitEnd::try_from(k).ok().and_then(vocab::wait_end_name);
                assert_eq!(end.as_str(), wire.unwrap_or("unknown"), "wait end {k}");
            }
        }
    }
}
