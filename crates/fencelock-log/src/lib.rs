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
//! - After a [`Log`] was dropped (a clean close), the next [`Log::open`] returns
//!   every synced record or refuses with [`LogErrorKind::Corrupt`]; after a crash,
//!   every record synced before the manifest's mark (see below) or followed by a
//!   later sync batch, or refuses.
//! - [`Log::snapshot`] is durable when it returns `Ok` and covers every record
//!   appended before it.
//! - After any I/O error while writing or syncing, the [`Log`] is poisoned
//!   ([`LogErrorKind::Poisoned`]): a failed fdatasync leaves the file in an
//!   unknown state, so the only way on is to drop it and [`Log::open`] again.
//! - With [`LogOptions::fsync`] `= false` none of this holds across a machine
//!   crash (benchmarks only).
//!
//! # On-disk format (version 2)
//!
//! All integers are little-endian; every checksum is CRC-32 (IEEE, `crc32fast`).
//!
//! - `log-NNNNNNNNNNNNNNNN.seg` (16-digit sequence number): a segment, preallocated
//!   with `posix_fallocate` to [`LogOptions::segment_bytes`] (larger for a single
//!   record that would not fit). A 56-byte header `[magic "FLOGSEG\0"][version u32 = 2]
//!   [0 u32][seq u64][capacity u64][first_record u64][prev_end u64][crc u32 of bytes
//!   0..48][0 u32]`, then records back to back. `capacity` is the preallocated file
//!   length: the file must be exactly that long. `first_record` numbers the
//!   segment's first record over the whole log; `prev_end` is the offset where the
//!   records of segment `seq - 1` end (0 if it was created without one).
//! - A record is `[word u32][crc u32][payload]`: the low 25 bits of `word` are the
//!   payload length (at most [`MAX_RECORD_BYTES`]), bit 31 is set on the first record
//!   written after each fdatasync (the *batch-start flag*), bit 30 marks a control
//!   record, bits 25..=29 are zero, and `crc` covers `word` and the payload. Eight
//!   zero bytes (the preallocated zeros) end the segment's data; an empty record is
//!   still distinguishable because its `crc` is non-zero.
//! - The *seal*: the control record that ends every segment but the newest, with the
//!   payload `[1 u8][0 u8 x7][next_seq u64][next_first_record u64]`. The last 32
//!   bytes of every segment's capacity are kept free for it; only zeros follow it.
//! - `log.manifest`: 40 bytes `[magic "FLOGMAN\0"][version u32 = 2][flags u32]
//!   [hw_seq u64][hw_offset u64][crc u32 of bytes 0..32][0 u32]`. Flag bit 0 means
//!   the *high-water mark* is set: the records of segment `hw_seq` up to `hw_offset`
//!   (and everything before that segment) were durable when it was written. It is
//!   replaced atomically (temp file, fdatasync, rename, directory fsync) when a
//!   directory is initialised, by [`Log::open`] when the mark moved (after a crash),
//!   and when a [`Log`] is dropped — never per write.
//! - `snap-NNNNNNNNNNNNNNNN.snap`: the state *before* segment N, i.e. covering all
//!   records in segments `< N`. A 32-byte header `[magic "FLOGSNP\0"][version u32 = 2]
//!   [0 u32][len u64][crc u32 of bytes 0..24 and the payload][0 u32]`, then the
//!   payload; the file is exactly `32 + len` bytes. [`write_snapshot_file`] and
//!   [`read_snapshot_file`] use the same format for standalone backups (version 1
//!   files, with the same layout, are read too).
//! - `log.durable`: 1024 bytes, two 40-byte slots at offsets 0 and 512 (different
//!   sectors), each `[magic "FLOGEND\0"][version u32 = 1][0 u32][seq u64]
//!   [offset u64][crc u32 of bytes 0..32][0 u32]`: the *durable end*, "the records
//!   of segment `seq` up to `offset` were durable". Each [`Log::sync`] that wrote
//!   something overwrites the older slot after its fdatasync returned (see "The
//!   durable end" below). Evidence only: a missing, short or damaged file, or a
//!   slot that fails its checksum, is no mark.
//! - `*.tmp`: a segment, snapshot or manifest being created; deleted by [`Log::open`].
//!   Other files in the directory are ignored. The directory is `flock`ed while open,
//!   and [`Log::check_identity`] (also run before every roll, snapshot, deletion
//!   and the close's manifest write) notices when the directory, the active
//!   segment or `log.durable` at their paths are no longer the files the log
//!   holds open: deleted, moved away or replaced.
//!
//! New segments, snapshots and the manifest are written under a `.tmp` name, synced,
//! renamed into place and the directory fsynced, so a file under its final name is
//! complete and has its full length. When a segment fills up mid-batch (or
//! [`Log::start_segment`] or [`Log::snapshot`] cuts the log), its part of the batch
//! is fdatasynced, the next segment is created, and then the seal is written and
//! fdatasynced: only the newest segment can hold unsynced data, and a crash leaves
//! at worst an empty newest segment after an unsealed one, which the next
//! [`Log::open`] completes by writing the seal. A snapshot `snap-N` is written only
//! after segment N exists.
//!
//! # Recovery: torn tail versus corruption
//!
//! [`Log::open`] loads the newest snapshot, then scans segments `N, N+1, ...` (from
//! `0` without a snapshot), which must form an unbroken run. In each segment the
//! scan stops at the first record that is not valid, or at the seal. If only zeros
//! follow, that is the clean end. Otherwise:
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
//! - and whatever follows, a bad record before the durable end that
//!   `log.durable` records for the newest segment is **corruption** (see "The
//!   durable end" below).
//!
//! Then the segments must fit together, and anything else is refused as
//! corruption too:
//!
//! - a segment file whose length differs from the capacity in its header (a crash
//!   never shortens a preallocated file, so this is a cut, wherever it falls);
//! - a segment followed by another that does not end with a seal naming it, or
//!   whose records do not end exactly where the next segment's header says (an
//!   older segment cut or zeroed at a record boundary, or its seal lost). The one
//!   exception is the crash window of a roll described above;
//! - a sealed newest segment (the segment its seal names was deleted);
//! - a newest segment whose valid records end before the manifest's high-water
//!   mark, or a mark in a segment that no longer exists (synced records of the
//!   newest segment damaged, cut or zeroed; the newest segment deleted);
//! - a manifest whose mark is set but no segment at all, or a snapshot without its
//!   segment (a wiped directory that kept its manifest, a deleted newest segment);
//! - no manifest, but a version 2 segment or snapshot (the manifest was deleted);
//! - a bad segment header, manifest or snapshot (magic, version, checksum, or a
//!   sequence number that does not match the file name), and a missing segment.
//!
//! Corruption is refused with [`LogErrorKind::Corrupt`], naming the file and, where
//! it applies, the offset; corrupt data is never loaded and never silently skipped.
//! A corrupt *newest* snapshot is refused rather than falling back to an older one,
//! because the segments between the two were deleted when the newest one was
//! installed and falling back would silently lose their records. To recover by
//! hand, restore a backup made with [`write_snapshot_file`]. To start over on
//! purpose, delete the whole directory (manifest included).
//!
//! # The durable end: torn final batch versus damaged acknowledged batch
//!
//! The batch-start flag proves a record durable only if a *later* fdatasync
//! happened; the final synced batch has no later one. A bit flip inside it, after
//! a crash, used to look exactly like a torn write and was dropped, though its
//! records had been acknowledged. So each sync, *after* its fdatasync returned,
//! writes the durable end (segment, offset) into the older of the two slots of
//! `log.durable`. The argument:
//!
//! - *It never claims too much.* The mark is written only once the data it names
//!   is durable. Writing it before or with the data's fdatasync instead would let
//!   a crash persist the mark but not the data, turning ordinary torn writes into
//!   refusals. So at recovery a record before the mark that fails its checksum
//!   (or is missing: zeroed, cut) was acknowledged and damaged afterwards:
//!   corruption, refused like any other. Damage after the mark is judged by the
//!   torn-tail rules above.
//! - *It costs no fdatasync.* The mark is one 40-byte `pwrite` into the page
//!   cache per sync that wrote something. A process crash (`kill -9`, a panic,
//!   the OOM killer) loses nothing in the page cache, so after one the mark
//!   always covers the final batch. It reaches the disk with the kernel's
//!   writeback (seconds).
//! - *Two slots, one sector apart*, written alternately: a write torn by a power
//!   loss damages at most the slot being written; the other still holds the
//!   previous durable end, which is also true. The furthest valid slot wins.
//! - `log.durable` itself is created (and sized) once, synced with its
//!   directory; later writes never change its length or metadata.
//! - Only a mark naming the newest segment is used (older segments are covered
//!   by seals and links), and only when the directory has a manifest: a
//!   directory wiped to start over may keep a stale `log.durable`, which
//!   [`Log::open`] then overwrites.
//!
//! Limits, what remains undetectable:
//!
//! - A directory wiped completely, manifest included, is a new, empty log: nothing
//!   is left inside it to tell the two apart.
//! - After a *power loss* (or kernel crash) that also lost the last writes to
//!   `log.durable` (no clean drop since the manifest's mark was written), the
//!   newest segment's data after the last durable end that reached the disk is
//!   judged as above: damage confined to its final sync batch, or its last
//!   batches zeroed from a record boundary on, cannot be told from writes the
//!   crash cut short. It is treated as torn (counted in `truncated_tail_bytes`,
//!   which callers may log as a warning) or, when zeroed at a boundary, as never
//!   written. Closing this gap needs a second fdatasync per batch. After a clean
//!   drop the manifest covers every synced record, and after a process crash
//!   `log.durable` does, so there this is refused.
//!
//! # Version 1 directories
//!
//! A directory without a manifest whose files are all version 1 (32-byte segment
//! headers without capacity or links, no seals) loads with the version 1 rules:
//! its segments are neither sealed nor length-checked. [`Log::open`] then writes a
//! manifest, leaves the version 1 segments as they are and appends to a new version
//! 2 segment, whose header records where the last version 1 segment's records end.
//! The version 1 segments go away with the next snapshot. A version 1 reader
//! refuses a version 2 directory ("unsupported segment format version 2").

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
