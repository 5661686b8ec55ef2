//! A durable, append-only log of opaque byte records with group commit,
//! preallocated segment files and snapshots that bound recovery.
//!
//! The caller [`append`](Log::append)s many records, then calls [`sync`](Log::sync)
//! once: one `fdatasync(2)` makes the whole batch durable. Now and then it hands
//! its state to [`snapshot`](Log::snapshot), which lets older segments be deleted.
//! [`Log::open`] returns the newest snapshot plus every record appended after it.
//! This crate never interprets payloads. Linux (Unix) only.
//!
//! ```no_run
//! use fencelock_log::{Log, LogOptions};
//! # fn main() -> Result<(), fencelock_log::LogError> {
//! let (mut log, recovered) = Log::open("data".as_ref(), LogOptions::default())?;
//! // ... rebuild state from recovered.snapshot and recovered.records ...
//! log.append(b"command 1")?;
//! log.append(b"command 2")?;
//! log.sync()?; // both are durable now; reply to clients
//! # Ok(()) }
//! ```
//!
//! # Durability contract
//!
//! - A record is durable once a [`Log::sync`] call that follows its `append`
//!   returns `Ok`. Records appended but not synced may or may not survive a crash.
//! - What survives a crash is always a prefix of the appended records: recovery
//!   never returns a record without all the records appended before it.
//! - [`Log::snapshot`] is durable when it returns `Ok` and covers every record
//!   appended before it.
//! - After any I/O error while writing or syncing, the [`Log`] is poisoned
//!   ([`LogErrorKind::Poisoned`]): a failed fdatasync leaves the file in an
//!   unknown state, so the only way on is to drop it and [`Log::open`] again.
//! - With [`LogOptions::fsync`] `= false` none of this holds across a machine
//!   crash (benchmarks only).
//!
//! # On-disk format
//!
//! All integers are little-endian; every checksum is CRC-32 (IEEE, `crc32fast`).
//!
//! - `log-NNNNNNNNNNNNNNNN.seg` (16-digit sequence number): a segment, preallocated
//!   with `posix_fallocate` to [`LogOptions::segment_bytes`] (larger for a single
//!   record that would not fit). A 32-byte header `[magic "FLOGSEG\0"][version u32 = 1]
//!   [0 u32][seq u64][crc u32 of bytes 0..24][0 u32]`, then records back to back.
//! - A record is `[word u32][crc u32][payload]`: the low 31 bits of `word` are the
//!   payload length (at most [`MAX_RECORD_BYTES`]), bit 31 is set on the first record
//!   written after each fdatasync (the *batch-start flag*), and `crc` covers `word`
//!   and the payload. Eight zero bytes (the preallocated zeros) end the segment's
//!   data; an empty record is still distinguishable because its `crc` is non-zero.
//! - `snap-NNNNNNNNNNNNNNNN.snap`: the state *before* segment N, i.e. covering all
//!   records in segments `< N`. A 32-byte header `[magic "FLOGSNP\0"][version u32 = 1]
//!   [0 u32][len u64][crc u32 of bytes 0..24 and the payload][0 u32]`, then the
//!   payload; the file is exactly `32 + len` bytes. [`write_snapshot_file`] and
//!   [`read_snapshot_file`] use the same format for standalone backups.
//! - `*.tmp`: a segment or snapshot being created; deleted by [`Log::open`].
//!   Other files in the directory are ignored. The directory is `flock`ed while open.
//!
//! New segments and snapshots are written under a `.tmp` name, synced, renamed into
//! place and the directory fsynced, so a file under its final name is complete.
//! When a segment fills up mid-batch, its part of the batch is fdatasynced before
//! the next segment is created, so only the newest segment can hold unsynced data.
//!
//! # Recovery: torn tail versus corruption
//!
//! [`Log::open`] loads the newest snapshot, then scans segments `N, N+1, ...` (from
//! `0` without a snapshot), which must form an unbroken run. In each segment the
//! scan stops at the first record that is not valid. If only zeros follow, that is
//! the clean end. Otherwise:
//!
//! - in any segment but the newest, it is **corruption**: that data was synced;
//! - in the newest segment it is a **torn tail** (a crash during the last, unsynced
//!   write), which is discarded, reported in [`Recovered::truncated_tail_bytes`] and
//!   zeroed on disk so later appends overwrite it; unless a valid record carrying
//!   the batch-start flag follows the bad one anywhere in the segment: that proves
//!   a later fdatasync happened, so the bad record had been durable, and it is
//!   **corruption**. Valid records of the *same* batch after the bad one do not
//!   make it corruption: writeback may persist later pages of a batch before
//!   earlier ones, so a crash can leave exactly that pattern (the seeded crash
//!   simulation in the tests produces it).
//!
//! Corruption is refused with [`LogErrorKind::Corrupt`], naming the file and
//! offset; corrupt data is never loaded and never silently skipped. So are: a bad
//! segment header (magic, version, checksum, or a sequence number that does not
//! match the file name), a missing segment, and a snapshot whose header or
//! checksum is wrong. A corrupt *newest* snapshot is refused too rather than
//! falling back to an older one, because the segments between the two were
//! deleted when the newest one was installed and falling back would silently lose
//! their records. To recover by hand, restore a backup made with
//! [`write_snapshot_file`].
//!
//! Limit: damage confined to the final sync batch of the newest segment (say a
//! flipped bit after that batch's `sync()` returned) cannot be told apart from a
//! torn write, because nothing written after it proves its fdatasync completed.
//! It is treated as torn: that batch's records from the bad one on are dropped and
//! counted in `truncated_tail_bytes` (callers may log a warning when it is non-zero).
//! The alternative, refusing to open, would make ordinary crashes fatal.

#![deny(missing_docs)]

#[cfg(not(unix))]
compile_error!("fencelock-log uses fdatasync/posix_fallocate/flock and supports Unix (Linux) only");

mod error;
mod format;
mod fsio;
mod log;
mod recover;
mod snapshot;

pub use crate::error::{LogError, LogErrorKind};
pub use crate::format::{MAX_RECORD_BYTES, MAX_SNAPSHOT_BYTES};
pub use crate::log::{Log, LogOptions, Recovered, SyncStats, MIN_SEGMENT_BYTES};
pub use crate::snapshot::{read_snapshot_file, write_snapshot_at, write_snapshot_file};
