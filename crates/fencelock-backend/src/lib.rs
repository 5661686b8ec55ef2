//! # fencelock-backend: what a lock store implements
//!
//! The small crate every fencelock store crate builds on: the [`LockBackend`] trait
//! (acquire, renew, release one grant), [`Capabilities`] (what the store can honestly
//! promise), the shared [`Error`] type, request validation and [`Backoff`].
//!
//! Users take locks through the `fencelock` crate, which re-exports all of this and
//! adds the guard logic (renewal, the lost-lock signal, retries) on top of any backend.
//! A store crate (`fencelock-redis`, `fencelock-postgres`, …) depends only on this one.

#![deny(missing_docs)]

mod backend;
mod backoff;
mod error;

pub use backend::{
    validate_value, AcquireSpec, BoxFuture, Capabilities, FenceGuarantee, Leader, Lease,
    LockBackend, LockMode, SessionLease, MAX_NAME_BYTES, MAX_OWNER_BYTES, MAX_REQUEST_ID_BYTES,
    MAX_TTL, MAX_VALUE_BYTES,
};
pub use backoff::{random_u64, request_id, Backoff};
pub use error::{Error, ErrorKind};
