//! A plain-data image of the whole state, for snapshots. The server encodes it;
//! the core stays free of any serialization format.

use crate::command::GrantEnd;
use crate::types::{Fence, LockName, Mode, Owner, OwnerToken, RequestId, SessionId, Tenant, Value};

/// The whole state of a [`crate::Core`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateImage {
    /// Latest service time seen.
    pub now_ms: u64,
    /// The fence the next grant gets.
    pub next_fence: u64,
    /// Every lock record, in name order.
    pub locks: Vec<LockImage>,
    /// Every open session, in id order.
    pub sessions: Vec<SessionImage>,
    /// Recently ended grants (token, lock, how), oldest first.
    pub recent_ends: Vec<(OwnerToken, LockName, GrantEnd)>,
}

/// One lock record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockImage {
    /// The lock.
    pub name: LockName,
    /// Holders it admits.
    pub limit: u32,
    /// Lock-delay end (service time).
    pub blocked_until_ms: u64,
    /// Holders in grant order.
    pub holders: Vec<HolderImage>,
    /// Queued requests, FIFO.
    pub waiters: Vec<WaiterImage>,
}

/// A holder's lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseImage {
    /// A lease of its own.
    Own {
        /// Lease length.
        ttl_ms: u64,
        /// Expiry (service time).
        deadline_ms: u64,
    },
    /// Its session's lease.
    Session(SessionId),
}

/// One holder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HolderImage {
    /// Owner token.
    pub token: OwnerToken,
    /// Fence.
    pub fence: Fence,
    /// Owner text.
    pub owner: Owner,
    /// Idempotency key.
    pub request_id: Option<RequestId>,
    /// Lease.
    pub lease: LeaseImage,
    /// Grant time (service time).
    pub granted_at_ms: u64,
    /// Lock-delay on expiry or forced release.
    pub lock_delay_ms: u64,
    /// The principal it counts against (`None`: not recorded).
    pub tenant: Option<Tenant>,
    /// Exclusive or shared.
    pub mode: Mode,
    /// An election leader's value.
    pub value: Option<Value>,
}

/// One queued request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WaiterImage {
    /// Owner token the grant will carry.
    pub token: OwnerToken,
    /// Owner text.
    pub owner: Owner,
    /// Idempotency key.
    pub request_id: Option<RequestId>,
    /// Lease length once granted (absent for session requests).
    pub ttl_ms: Option<u64>,
    /// Session, if any.
    pub session: Option<SessionId>,
    /// Lock-delay once granted.
    pub lock_delay_ms: u64,
    /// When it was queued (service time).
    pub enqueued_at_ms: u64,
    /// When it gives up (service time).
    pub wait_deadline_ms: u64,
    /// The principal it counts against (`None`: not recorded).
    pub tenant: Option<Tenant>,
    /// Exclusive or shared.
    pub mode: Mode,
    /// An election campaign's value.
    pub value: Option<Value>,
    /// For a part of a multi-lock request: every part's token, in the order asked
    /// (this one included). Empty for a single request.
    pub group: Vec<OwnerToken>,
}

/// One open session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionImage {
    /// Session id.
    pub id: SessionId,
    /// Owner text.
    pub owner: Owner,
    /// The principal that opened it (`None`: owned by nobody).
    pub tenant: Option<Tenant>,
    /// Lease length.
    pub ttl_ms: u64,
    /// Expiry (service time).
    pub deadline_ms: u64,
}
