//! Fencing checks at the protected resource.
//!
//! A lock alone cannot guarantee that only one worker writes at a time: a holder can
//! pause (GC, `SIGSTOP`, a slow disk) past its lease, wake up and write, while a new
//! holder already writes too. Every fencelock grant carries a **fence**, a number that
//! strictly increases with every change of ownership. This crate is the other half:
//! the resource **applies a write only if its fence is greater than the last fence it
//! accepted for that resource, atomically with the write**. The paused holder's write
//! then carries an older fence and is refused.
//!
//! Fences are plain `u64`s (the `fence()` of a fencelock grant); nothing here depends
//! on the client library, so a resource service can use this crate alone.
//!
//! | gate | resource | how check + write is atomic | details |
//! |---|---|---|---|
//! | [`MemoryGate`] | values in memory (tests, examples) | one mutex around check and write | |
//! | [`FileGate`] | files in a directory | `flock`ed lock file; fence recorded before the atomic rename | [`file`](mod@file): on-disk layout, crash analysis |
//! | `PgFence` / `PgGate` (feature `postgres`) | a PostgreSQL row with a `fence` column | one conditional `UPDATE … WHERE fence < $f` | `postgres`: schema and SQL for any driver |
//! | `FenceLayer` (feature `http`, default) | an HTTP service (tower/axum) | per-key lock held across the inner call | `http`: status codes and error bodies |
//!
//! Every gate implements [`FenceGate`], whose `apply` takes the write itself, so the
//! check can never be separated from the write it guards.
//!
//! ```
//! use fencelock_fence::{ErrorKind, FenceGate, GateMetrics, MemoryGate};
//! # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
//! let stock = MemoryGate::new();
//! stock.apply("inventory:item:1", 7, 0u32).await?;    // holder with fence 7 sells
//! let stale = stock.apply("inventory:item:1", 5, 0u32).await; // paused holder wakes up
//! assert_eq!(stale.unwrap_err().kind(), ErrorKind::Stale);
//! assert_eq!(stock.stale_rejections(), 1);
//! # Ok::<(), fencelock_fence::FenceError>(()) }).unwrap();
//! ```
//!
//! # Semantics
//!
//! - Strictly greater: a write with a fence equal to the last accepted one is refused
//!   too, so one grant makes at most one write per resource key. (Do several changes
//!   in one write, e.g. one SQL `UPDATE` or one file.)
//! - A refused write changes nothing and counts as a *stale rejection*.
//! - Fence `0` is never accepted: it is the "nothing accepted yet" value, and
//!   fencelock's fences start at 1.
//!
//! # Metrics
//!
//! Every gate counts the writes it refused as stale ([`GateMetrics::stale_rejections`]).
//! [`render_prometheus`] renders them in the Prometheus text format:
//!
//! ```text
//! # HELP fencelock_fence_stale_rejections_total Writes refused because their fence was not newer than the last one accepted.
//! # TYPE fencelock_fence_stale_rejections_total counter
//! fencelock_fence_stale_rejections_total{gate="orders-db"} 3
//! ```
//!
//! A rising count is good news and bad news: a holder lost its lock and kept working,
//! and the fence stopped it.
//!
//! # Readers
//!
//! With reader-writer locks, readers fence their reads too. The resource keeps the
//! largest fence it has seen from reads and writes, and the last write's fence; a
//! read is accepted if its fence is larger than the last write's (and raises the
//! largest seen), a write only if its fence is larger than every fence seen, reads
//! included. [`ReadWriteFence`] is that rule for one resource; see
//! [`readers`](mod@readers).
#![deny(missing_docs)]

use std::fmt::Write as _;
use std::future::Future;

mod error;
pub mod file;
#[cfg(feature = "http")]
pub mod http;
mod memory;
#[cfg(feature = "postgres")]
pub mod postgres;
pub mod readers;

pub use error::{ErrorKind, FenceError};
pub use file::FileGate;
#[cfg(feature = "http")]
pub use http::{FenceLayer, FenceService, RequestHead, FENCING_TOKEN_HEADER};
pub use memory::MemoryGate;
#[cfg(feature = "postgres")]
pub use postgres::{PgFence, PgGate, PgWrite};
pub use readers::ReadWriteFence;

/// "Apply this write only if its fence is greater than the last fence accepted for
/// this resource, atomically with the write."
///
/// The write is an argument of [`apply`](FenceGate::apply), so no caller can check a
/// fence and then write without the check: the gate does both as one step. A refused
/// write returns an error of kind [`ErrorKind::Stale`] and changes nothing.
pub trait FenceGate: GateMetrics {
    /// What names a resource: a key string, a file name, a row id.
    type Key: ?Sized + Sync;
    /// The write to apply: a value, file contents, an SQL assignment.
    type Write: Send;
    /// What a successful write returns.
    type Applied: Send;

    /// Applies `write` to the resource `key` if `fence` is greater than the last fence
    /// accepted for it, and records `fence` as the last accepted, atomically.
    fn apply(
        &self,
        key: &Self::Key,
        fence: u64,
        write: Self::Write,
    ) -> impl Future<Output = Result<Self::Applied, FenceError>> + Send;
}

/// The counters a gate exposes as metrics.
pub trait GateMetrics {
    /// The gate's name, the `gate` label of its metrics (default: its kind, such as
    /// `"memory"`; every gate type has a constructor that takes a name).
    fn name(&self) -> &str;

    /// How many writes this gate refused because their fence was not newer than the
    /// last one accepted (since it was created; not persisted).
    fn stale_rejections(&self) -> u64;
}

/// The name of the stale-rejection counter in [`render_prometheus`]'s output.
pub const STALE_REJECTIONS_METRIC: &str = "fencelock_fence_stale_rejections_total";

/// Renders the gates' counters in the Prometheus text exposition format (version
/// 0.0.4): one `fencelock_fence_stale_rejections_total{gate="NAME"}` sample per gate,
/// preceded by its `# HELP` and `# TYPE` lines. Append it to a service's `/metrics`.
pub fn render_prometheus(gates: &[&dyn GateMetrics]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# HELP {STALE_REJECTIONS_METRIC} Writes refused because their fence was not newer than the last one accepted."
    );
    let _ = writeln!(out, "# TYPE {STALE_REJECTIONS_METRIC} counter");
    for gate in gates {
        let _ = writeln!(
            out,
            "{STALE_REJECTIONS_METRIC}{{gate=\"{}\"}} {}",
            escape_label(gate.name()),
            gate.stale_rejections()
        );
    }
    out
}

/// Escapes a Prometheus label value: backslash, double quote and newline.
fn escape_label(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prometheus_text_lists_every_gate_with_escaped_names() {
        let a = MemoryGate::<u8>::named("orders");
        let b = MemoryGate::<u8>::named("we\"ird\\name\n");
        a.set("k", 5, 1).unwrap();
        assert_eq!(a.set("k", 5, 2).unwrap_err().kind(), ErrorKind::Stale);
        assert_eq!(a.set("k", 4, 2).unwrap_err().kind(), ErrorKind::Stale);
        let text = render_prometheus(&[&a, &b]);
        assert_eq!(
            text,
            "# HELP fencelock_fence_stale_rejections_total Writes refused because their fence was not newer than the last one accepted.\n\
             # TYPE fencelock_fence_stale_rejections_total counter\n\
             fencelock_fence_stale_rejections_total{gate=\"orders\"} 2\n\
             fencelock_fence_stale_rejections_total{gate=\"we\\\"ird\\\\name\\n\"} 0\n"
        );
    }
}
