//! The sans-IO heart of fencelock: a deterministic lock state machine.
//!
//! No tokio, no serde, no clock, no I/O. Time is an input (`now_ms`, a monotonic
//! *service time*), randomness is an input (owner tokens and session ids come inside
//! commands), and every decision — expiry included — is the result of a
//! [`Command`] applied with [`Core::apply`]. Replaying the same commands gives the same
//! state and the same outputs, which is what the durable log (and later a replicated
//! log) relies on.
//!
//! What it guarantees (each is checked by [`Core::check_invariants`] and by the
//! property tests against a reference model):
//! - a lock never has more than `limit` holders, and never an exclusive holder
//!   together with a shared one;
//! - fences are strictly increasing across every grant and never reused;
//! - a multi-lock request ([`Command::AcquireAll`]) holds all of its locks or none,
//!   and every lock's queue agrees with one global arrival order, so no two
//!   requests can wait for each other;
//! - queued requests are granted strictly in FIFO order across modes, directly on release or
//!   expiry (hand-off in the same transition), and never after their wait or their
//!   session is over;
//! - after an expiry or a forced release with `lock_delay_ms`, nobody is granted the
//!   lock until the delay has passed;
//! - every table and queue is bounded by [`Config`].
#![deny(missing_docs)]

mod command;
mod idhash;
mod image;
mod machine;
mod types;

pub use command::{
    Acquire, Command, Error, ErrorKind, Event, EventKind, Grant, GrantEnd, InvariantError,
    InvariantErrorKind, Outcome, Quota, Reply, WaitEnd,
};
pub use image::{HolderImage, LeaseImage, LockImage, SessionImage, StateImage, WaiterImage};
#[cfg(feature = "planted-bugs")]
#[doc(hidden)]
pub use machine::PlantedBugs;
pub use machine::{
    Config, Core, HolderView, LockView, SessionView, Stats, MAX_FENCE_FLOOR, MAX_NAMES_PER_REQUEST,
};
pub use machine::{WaiterView, MAX_VIEW_WAITERS};
pub use types::{
    Fence, LockName, Mode, Owner, OwnerToken, Reason, RequestId, SessionId, Tenant, TextError,
    TextProblem, TokenParseError, Value, MAX_NAME_BYTES, MAX_OWNER_BYTES, MAX_REASON_BYTES,
    MAX_REQUEST_ID_BYTES, MAX_TENANT_BYTES, MAX_VALUE_BYTES,
};
