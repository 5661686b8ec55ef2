//! The [`Log`]: opening (recovery), appending, group commit, snapshots.
//!
//! Ours on purpose: one `fdatasync` per batch, preallocated segments and
//! snapshot-bounded recovery are the server's durability contract; embedded
//! databases (sled, redb) offer transactions instead, at a cost per write.

use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::error::{LogError, LogErrorKind};
use crate::format::{
    decode_durable_mark, decode_manifest, encode_durable_mark, encode_manifest, encode_record_into,
    encode_seal_frame, encode_segment_header, frame_len, mark_batch_start, HighWater, Seal,
    DURABLE_FILE_BYTES, DURABLE_NAME, DURABLE_SLOT_BYTES, DURABLE_SLOT_STRIDE, MANIFEST_BYTES,
    MAX_RECORD_BYTES, MAX_SNAPSHOT_BYTES, RECORD_HEADER_BYTES, SEAL_FRAME_BYTES,
    SEGMENT_HEADER_BYTES, SEGMENT_VERSION, SEGMENT_VERSION_V1, SNAPSHOT_VERSION,
    SNAPSHOT_VERSION_V1,
};
use crate::fsio::{fdatasync, preallocate, try_lock_exclusive, write_zeros};
use crate::recover::{
    list_dir, scan_segment, segment_path, snapshot_path, Listing, SegmentEnd, MANIFEST_NAME,
};
use crate::snapshot::{read_snapshot_versioned, sync_dir, write_snapshot_atomic};

/// Once this many encoded bytes are buffered, [`Log::append`] writes them to the
/// segment (without fdatasync) so memory stays bounded however long a batch is.
const WRITE_BEHIND_BYTES: usize = 4 << 20;

/// The smallest accepted [`LogOptions::segment_bytes`]: a header, one empty record
/// and the seal that ends every segment but the newest.
pub const MIN_SEGMENT_BYTES: u64 = SEGMENT_HEADER_BYTES + RECORD_HEADER_BYTES + SEAL_FRAME_BYTES;

/// Configuration for [`Log::open`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogOptions {
    /// Size each new segment file is preallocated to. Default 64 MiB. A record that
    /// does not fit in a fresh segment of this size gets a segment just big enough
    /// for it. Must be at least [`MIN_SEGMENT_BYTES`].
    pub segment_bytes: u64,
    /// `true` (the default): [`Log::sync`] and [`Log::snapshot`] call fdatasync/fsync
    /// as described in the crate docs. `false` is **unsafe**, for benchmarks only:
    /// no fdatasync or fsync is ever issued, so a machine crash can lose or tear
    /// anything written since the OS last flushed. A clean process exit loses nothing
    /// that was passed to `sync()`.
    pub fsync: bool,
}

impl Default for LogOptions {
    fn default() -> Self {
        LogOptions {
            segment_bytes: 64 << 20,
            fsync: true,
        }
    }
}

/// What [`Log::open`] found on disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recovered {
    /// The newest snapshot's payload, if a snapshot was ever taken.
    pub snapshot: Option<Vec<u8>>,
    /// Every record appended after that snapshot (or ever, without one), in append order.
    pub records: Vec<Vec<u8>>,
    /// Bytes of a torn write discarded at the end of the newest segment: from the
    /// first invalid record to the last non-zero byte. They were never acknowledged
    /// by a completed `sync()` (see the crate docs); `0` after a clean shutdown.
    pub truncated_tail_bytes: u64,
}

/// What one [`Log::sync`] did. Counts cover everything since the previous `sync()`,
/// including segment rolls and write-behind done inside [`Log::append`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SyncStats {
    /// Records made durable.
    pub records: usize,
    /// Framed bytes (record headers + payloads) made durable.
    pub bytes: u64,
    /// fdatasync/fsync calls issued (one per sync, plus three per segment roll).
    pub fsyncs: u32,
    /// Time spent inside those calls, in microseconds.
    pub fsync_micros: u64,
}

/// The segment records are currently written to (always format version 2).
#[derive(Debug)]
struct ActiveSegment {
    seq: u64,
    file: File,
    /// The file's (preallocated) length; records never extend into its last
    /// [`SEAL_FRAME_BYTES`], which are kept for the seal.
    capacity_bytes: u64,
    /// Where the next record goes.
    write_offset: u64,
    /// The log-wide number of the segment's first record.
    first_record: u64,
    /// Records written to this segment so far.
    records: u64,
    /// End of the data known durable (fdatasynced, or read back at open and synced).
    durable_end: u64,
}

impl ActiveSegment {
    /// Bytes left for records.
    fn room(&self) -> u64 {
        (self.capacity_bytes - SEAL_FRAME_BYTES).saturating_sub(self.write_offset)
    }
}

/// A durable, group-committed log of opaque records in a data directory.
///
/// Single writer: the directory is `flock`ed while the `Log` exists. Dropping a
/// `Log` discards records appended since the last [`sync`](Log::sync) and records
/// the durable end in the manifest (see the crate docs for the durability contract
/// and the on-disk format).
#[derive(Debug)]
pub struct Log {
    dir: PathBuf,
    dir_file: File,
    opts: LogOptions,
    active: ActiveSegment,
    /// Encoded frames not yet written (batch-start flag clear).
    pending: Vec<u8>,
    /// True when nothing has been written since the last fdatasync, so the next
    /// frame written must carry the batch-start flag.
    at_batch_start: bool,
    /// Something was written since the last fdatasync.
    dirty: bool,
    stats: SyncStats,
    bytes_since_snapshot: u64,
    poisoned: bool,
    /// The high-water mark the manifest holds now.
    manifest_hw: Option<HighWater>,
    /// `log.durable`, where each sync records the durable end after its fdatasync.
    durable_file: File,
    /// The slot of `log.durable` the next mark goes to (they alternate).
    durable_slot: u64,
}

impl Log {
    /// Opens (creating if missing) the data directory: loads the newest valid
    /// snapshot and every record appended after it, in order.
    ///
    /// Recovery discards a torn tail (reported in [`Recovered::truncated_tail_bytes`];
    /// the damaged bytes are zeroed and synced so later appends overwrite them) and
    /// refuses with [`LogErrorKind::Corrupt`] on anything else that fails validation,
    /// including a corrupt newest snapshot: it never falls back to an older snapshot,
    /// because the segments that led from it to the newest one were deleted when
    /// the newest was installed. Leftover `*.tmp` files and segments and snapshots
    /// made obsolete by the newest snapshot are deleted. Segments must fit together
    /// (capacity, seals, links) and reach the manifest's high-water mark; a missing
    /// segment or manifest is corruption too (the crate docs list every case). An
    /// empty or new directory starts a new log; a version 1 directory is read and
    /// continued in version 2. Fails with [`LogErrorKind::Locked`] if another `Log`
    /// has the directory open.
    pub fn open(dir: &Path, opts: LogOptions) -> Result<(Log, Recovered), LogError> {
        if opts.segment_bytes < MIN_SEGMENT_BYTES || opts.segment_bytes > i64::MAX as u64 {
            return Err(LogError::new(
                LogErrorKind::InvalidOptions,
                Some(dir),
                format!(
                    "segment_bytes = {} is outside {MIN_SEGMENT_BYTES}..={}",
                    opts.segment_bytes,
                    i64::MAX
                ),
            ));
        }
        let existed = dir.exists();
        fs::create_dir_all(dir).map_err(|e| LogError::io(dir, "create data directory", e))?;
        if !existed && opts.fsync {
            if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
                sync_dir(parent)?;
            }
        }
        let dir_file = File::open(dir).map_err(|e| LogError::io(dir, "open data directory", e))?;
        if !try_lock_exclusive(&dir_file)
            .map_err(|e| LogError::io(dir, "lock data directory", e))?
        {
            return Err(LogError::new(
                LogErrorKind::Locked,
                Some(dir),
                "another Log holds this directory",
            ));
        }

        let listing = list_dir(dir)?;
        let manifest = if listing.manifest {
            Some(read_manifest(dir)?)
        } else {
            None
        };
        // The newest durable position recorded, if any.
        let manifest_hw = manifest.flatten();
        // Without a manifest the directory is new (or version 1): a mark left over
        // from a directory wiped to start over says nothing about this one.
        let durable_mark = if manifest.is_some() {
            read_durable_mark(dir)
        } else {
            None
        };
        let snapshot_seq = listing.snapshots.last().copied();
        let (snapshot, snapshot_version) = match snapshot_seq {
            Some(seq) => {
                let (payload, version) = read_snapshot_versioned(&snapshot_path(dir, seq))?;
                (Some(payload), Some(version))
            }
            None => (None, None),
        };
        // Segment `first` is the first one not covered by the snapshot.
        let first = snapshot_seq.unwrap_or(0);
        let live: Vec<u64> = listing.segments.range(first..).copied().collect();
        check_sequence(dir, first, snapshot_seq, &live)?;

        let mut records = Vec::new();
        let mut bytes_since_snapshot = 0;
        let mut scanned: Vec<(u64, File, SegmentEnd)> = Vec::with_capacity(live.len());
        for (i, &seq) in live.iter().enumerate() {
            let path = segment_path(dir, seq);
            // The newest segment is written to; the one before it may need its seal.
            let writable = i + 2 >= live.len();
            let file = OpenOptions::new()
                .read(true)
                .write(writable)
                .open(&path)
                .map_err(|e| LogError::io(&path, "open segment", e))?;
            let end = scan_segment(&path, &file, seq, i + 1 == live.len(), &mut records)?;
            bytes_since_snapshot += end.record_bytes;
            scanned.push((seq, file, end));
        }

        check_manifest_present(dir, manifest.is_some(), &scanned, snapshot_version)?;
        if scanned.is_empty() {
            check_nothing_missing(dir, manifest_hw, snapshot_seq, snapshot_version)?;
        }
        // The crash window of a roll: the newest segment exists but its
        // predecessor's seal was not written yet.
        let mut unsealed = false;
        for pair in scanned.windows(2) {
            let is_newest = pair[1].0 == live[live.len() - 1];
            unsealed |= check_link(dir, &pair[0], &pair[1], is_newest)?;
        }
        if let Some((seq, _, end)) = scanned.last() {
            check_newest(dir, *seq, end, manifest_hw)?;
            check_durable_mark(dir, *seq, end, durable_mark)?;
        }

        // Everything is validated; from here on only repairs of what a crash leaves.
        if manifest.is_none() {
            // A new directory, or one written by format version 1: from now on the
            // directory has a manifest, so losing its files is detected.
            write_manifest(dir, &dir_file, None, opts.fsync)?;
        }
        let mut truncated_tail_bytes = 0;
        let active = scanned.pop();
        let previous = scanned.pop();
        drop(scanned);
        if let (true, Some((seq, file, end))) = (unsealed, &previous) {
            // Finish the roll: the predecessor of the newest segment gets its seal.
            let next_first = end.header.first_record.unwrap_or(0) + end.records;
            let seal = Seal {
                next_seq: seq + 1,
                next_first_record: next_first,
            };
            let path = segment_path(dir, *seq);
            file.write_all_at(&encode_seal_frame(seal, true), end.valid_end)
                .and_then(|()| if opts.fsync { fdatasync(file) } else { Ok(()) })
                .map_err(|e| LogError::io(&path, "write the seal of an interrupted roll", e))?;
        }
        drop(previous);

        let active = match active {
            Some((seq, file, end)) => {
                let path = segment_path(dir, seq);
                if end.damaged_end > end.valid_end {
                    truncated_tail_bytes = end.damaged_end - end.valid_end;
                    write_zeros(&file, end.valid_end, end.damaged_end)
                        .map_err(|e| LogError::io(&path, "zero torn tail", e))?;
                }
                // What was read back is made durable before the manifest says so.
                if opts.fsync {
                    fdatasync(&file).map_err(|e| LogError::io(&path, "fdatasync segment", e))?;
                }
                if end.header.version == SEGMENT_VERSION {
                    ActiveSegment {
                        seq,
                        file,
                        capacity_bytes: end.file_len,
                        write_offset: end.valid_end,
                        first_record: end.header.first_record.unwrap_or(0),
                        records: end.records,
                        durable_end: end.valid_end,
                    }
                } else {
                    // Format version 1: leave it as it is (never sealed, never
                    // written again) and go on in a new version 2 segment.
                    let size = opts.segment_bytes;
                    create_segment(
                        dir,
                        &dir_file,
                        seq + 1,
                        size,
                        records.len() as u64,
                        end.valid_end,
                        opts.fsync,
                    )?
                }
            }
            None => create_segment(dir, &dir_file, first, opts.segment_bytes, 0, 0, opts.fsync)?,
        };

        let mut obsolete: Vec<PathBuf> = listing.temps;
        obsolete.extend(
            listing
                .segments
                .range(..first)
                .map(|&s| segment_path(dir, s)),
        );
        if let Some(newest) = snapshot_seq {
            obsolete.extend(
                listing
                    .snapshots
                    .range(..newest)
                    .map(|&s| snapshot_path(dir, s)),
            );
        }
        remove_files(&dir_file, dir, &obsolete, opts.fsync)?;
        let durable_file = open_durable_file(dir, &dir_file, opts.fsync)?;

        let mut log = Log {
            dir: dir.to_path_buf(),
            dir_file,
            opts,
            active,
            pending: Vec::new(),
            at_batch_start: true,
            dirty: false,
            stats: SyncStats::default(),
            bytes_since_snapshot,
            poisoned: false,
            manifest_hw,
            durable_file,
            durable_slot: 0,
        };
        // Both slots: whatever they held (a stale mark of a wiped directory, a
        // damaged slot) is replaced by what was just read back and synced.
        log.write_durable_mark()?;
        log.write_durable_mark()?;
        log.record_high_water()?;
        let recovered = Recovered {
            snapshot,
            records,
            truncated_tail_bytes,
        };
        Ok((log, recovered))
    }

    /// Buffers one record (at most [`MAX_RECORD_BYTES`]; larger is a
    /// [`LogErrorKind::TooLarge`] error and leaves the log usable). Nothing is
    /// guaranteed durable until [`sync`](Self::sync) returns; long batches may be
    /// written to the segment early (without fdatasync) to bound memory.
    pub fn append(&mut self, record: &[u8]) -> Result<(), LogError> {
        self.check_usable()?;
        if record.len() > MAX_RECORD_BYTES {
            return Err(LogError::new(
                LogErrorKind::TooLarge,
                None,
                format!(
                    "record of {} bytes exceeds MAX_RECORD_BYTES ({MAX_RECORD_BYTES})",
                    record.len()
                ),
            ));
        }
        encode_record_into(&mut self.pending, record);
        let framed = RECORD_HEADER_BYTES + record.len() as u64;
        self.stats.records += 1;
        self.stats.bytes += framed;
        self.bytes_since_snapshot += framed;
        if self.pending.len() >= WRITE_BEHIND_BYTES {
            let result = self.write_pending();
            self.poison_on_error(result)?;
        }
        Ok(())
    }

    /// Writes all buffered records to the active segment without fdatasync: from
    /// here they survive a crash of this process (they are in the kernel's page
    /// cache, and [`open`](Self::open) reads them back), but not a crash of the
    /// machine until [`sync`](Self::sync) returns. Any I/O failure poisons the log.
    pub fn write(&mut self) -> Result<(), LogError> {
        self.check_usable()?;
        let result = self.write_pending();
        self.poison_on_error(result)
    }

    /// Writes all buffered records and makes them durable with one fdatasync of the
    /// active segment. If the segment fills up, its part of the batch is fdatasynced
    /// first, then a new preallocated segment is created (and the directory fsynced)
    /// for the rest. Any I/O failure poisons the log ([`LogErrorKind::Poisoned`]
    /// from then on): after a failed fdatasync nothing can be assumed about the file.
    pub fn sync(&mut self) -> Result<SyncStats, LogError> {
        self.check_usable()?;
        let result = self.write_pending().and_then(|()| self.sync_active());
        self.poison_on_error(result)?;
        Ok(std::mem::take(&mut self.stats))
    }

    /// Durably installs a snapshot that covers every record appended so far.
    ///
    /// Steps: [`sync`](Self::sync); write `snap-N.snap.tmp`, fdatasync, rename to
    /// `snap-N.snap`, fsync the directory (N = active segment + 1, so the snapshot
    /// is "the state before segment N"); create segment N; delete older segments and
    /// snapshots. A crash at any step leaves either the old snapshot and segments or
    /// the new snapshot (with or without segment N), both of which [`open`](Self::open)
    /// recovers. Fails with [`LogErrorKind::TooLarge`] above [`MAX_SNAPSHOT_BYTES`];
    /// any I/O failure poisons the log.
    pub fn snapshot(&mut self, state: &[u8]) -> Result<(), LogError> {
        self.check_usable()?;
        if state.len() > MAX_SNAPSHOT_BYTES {
            return Err(LogError::new(
                LogErrorKind::TooLarge,
                None,
                format!(
                    "snapshot of {} bytes exceeds MAX_SNAPSHOT_BYTES ({MAX_SNAPSHOT_BYTES})",
                    state.len()
                ),
            ));
        }
        self.sync()?;
        let result = self.install_snapshot(state);
        self.poison_on_error(result)
    }

    /// Makes everything appended so far durable and starts a new segment; returns
    /// its sequence number `seq`. The records appended before this call are exactly
    /// "the state before segment `seq`": a snapshot of that state, written with
    /// [`write_snapshot_at`](crate::write_snapshot_at) (possibly on another thread, while this log goes on
    /// appending), lets [`forget_before`](Self::forget_before) drop them.
    ///
    /// This is how a server snapshots without stopping: it keeps a replica of its
    /// state that lags behind the log, cuts the log here, and snapshots the replica
    /// when the replica reaches the cut.
    pub fn start_segment(&mut self) -> Result<u64, LogError> {
        self.check_usable()?;
        let result = self
            .write_pending()
            .and_then(|()| self.roll(0))
            .map(|()| self.active.seq);
        let seq = self.poison_on_error(result)?;
        self.at_batch_start = true;
        Ok(seq)
    }

    /// Deletes the segments before `seq` and the snapshots older than `seq`, once
    /// `snap-seq` is durable in the directory (written by [`write_snapshot_at`](crate::write_snapshot_at)).
    /// Refuses (with [`LogErrorKind::InvalidOptions`]) a `seq` that is not a segment
    /// boundary this log made or has no snapshot, so it can never drop records that
    /// no snapshot covers.
    pub fn forget_before(&mut self, seq: u64) -> Result<(), LogError> {
        self.check_usable()?;
        if seq > self.active.seq {
            return Err(LogError::new(
                LogErrorKind::InvalidOptions,
                Some(&self.dir),
                format!(
                    "cannot forget before segment {seq}: the active segment is {}",
                    self.active.seq
                ),
            ));
        }
        self.check_identity()?;
        let listing = list_dir(&self.dir)?;
        if !listing.snapshots.contains(&seq) {
            return Err(LogError::new(
                LogErrorKind::InvalidOptions,
                Some(&self.dir),
                format!("cannot forget before segment {seq}: no snapshot for it"),
            ));
        }
        let obsolete = covered_by_snapshot(&self.dir, &listing, seq);
        let result = remove_files(&self.dir_file, &self.dir, &obsolete, self.opts.fsync);
        self.poison_on_error(result)
    }

    /// Framed bytes (8-byte headers + payloads) appended since the last snapshot,
    /// including records not yet synced. The server uses it to decide when to snapshot.
    pub fn bytes_since_snapshot(&self) -> u64 {
        self.bytes_since_snapshot
    }

    /// The data directory this log was opened on.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn install_snapshot(&mut self, state: &[u8]) -> Result<(), LogError> {
        // The new segment first, then the snapshot: a snapshot `snap-N` always has
        // its segment N, so a missing one is damage, never a crash.
        self.roll(0)?;
        let seq = self.active.seq;
        write_snapshot_atomic(&snapshot_path(&self.dir, seq), state, self.opts.fsync)?;
        self.bytes_since_snapshot = 0;
        let listing = list_dir(&self.dir)?;
        let obsolete = covered_by_snapshot(&self.dir, &listing, seq);
        remove_files(&self.dir_file, &self.dir, &obsolete, self.opts.fsync)
    }

    fn check_usable(&self) -> Result<(), LogError> {
        if self.poisoned {
            return Err(LogError::new(
                LogErrorKind::Poisoned,
                Some(&self.dir),
                "an earlier write or sync failed; drop this Log and open the directory again",
            ));
        }
        Ok(())
    }

    fn poison_on_error<T>(&mut self, result: Result<T, LogError>) -> Result<T, LogError> {
        if result.is_err() {
            self.poisoned = true;
        }
        result
    }

    /// Writes `pending` to the active segment, rolling to new segments as needed.
    fn write_pending(&mut self) -> Result<(), LogError> {
        let mut pos = 0;
        while pos < self.pending.len() {
            // Take the longest run of whole frames that fits in the active segment.
            let room = self.active.room();
            let mut end = pos;
            let mut frames = 0;
            while end < self.pending.len() {
                let len = frame_len(&self.pending[end..]);
                if (end - pos + len) as u64 > room {
                    break;
                }
                end += len;
                frames += 1;
            }
            if end == pos {
                let needed = frame_len(&self.pending[pos..]) as u64;
                self.roll(needed)?;
                continue;
            }
            if self.at_batch_start {
                mark_batch_start(&mut self.pending[pos..]);
                self.at_batch_start = false;
            }
            let path = segment_path(&self.dir, self.active.seq);
            self.active
                .file
                .write_all_at(&self.pending[pos..end], self.active.write_offset)
                .map_err(|e| LogError::io(&path, "write records", e))?;
            self.dirty = true;
            self.active.write_offset += (end - pos) as u64;
            self.active.records += frames;
            pos = end;
        }
        self.pending.clear();
        Ok(())
    }

    /// fdatasyncs the active segment if anything was written since the last one.
    fn sync_active(&mut self) -> Result<(), LogError> {
        if self.dirty && self.opts.fsync {
            let started = Instant::now();
            fdatasync(&self.active.file).map_err(|e| {
                LogError::io(
                    &segment_path(&self.dir, self.active.seq),
                    "fdatasync segment",
                    e,
                )
            })?;
            self.stats.fsyncs += 1;
            self.stats.fsync_micros += started.elapsed().as_micros() as u64;
        }
        self.at_batch_start = true;
        self.active.durable_end = self.active.write_offset;
        if std::mem::take(&mut self.dirty) {
            self.write_durable_mark()?;
        }
        Ok(())
    }

    /// Records the active segment's durable end in the next slot of `log.durable`
    /// (a plain write, never synced by itself: see the crate docs, "The durable
    /// end"). Called only once that end is durable, so a mark never claims more.
    fn write_durable_mark(&mut self) -> Result<(), LogError> {
        let mark = HighWater {
            seq: self.active.seq,
            offset: self.active.durable_end,
        };
        let at = self.durable_slot * DURABLE_SLOT_STRIDE;
        self.durable_file
            .write_all_at(&encode_durable_mark(mark), at)
            .map_err(|e| LogError::io(&self.dir.join(DURABLE_NAME), "write the durable end", e))?;
        self.durable_slot ^= 1;
        Ok(())
    }

    /// Checks that the data directory, the active segment and `log.durable` at
    /// their paths are still the files this log holds open (same device and
    /// inode). A directory deleted (`rm -rf`), renamed away or replaced by another
    /// fails with [`LogErrorKind::Replaced`] and poisons the log: what it would
    /// write from then on could not be read back by the next [`open`](Self::open),
    /// and writing by path (manifest, snapshots, deletions) would touch a
    /// directory that is not its own. Six `stat` calls: cheap enough to run a few
    /// times a second, and before every step that works by path.
    pub fn check_identity(&mut self) -> Result<(), LogError> {
        self.check_usable()?;
        let result = self.same_files();
        self.poison_on_error(result)
    }

    fn same_files(&self) -> Result<(), LogError> {
        let segment = segment_path(&self.dir, self.active.seq);
        let durable = self.dir.join(DURABLE_NAME);
        let held = [
            ("the data directory", self.dir.as_path(), &self.dir_file),
            ("the active segment", segment.as_path(), &self.active.file),
            (
                "the durable-end file",
                durable.as_path(),
                &self.durable_file,
            ),
        ];
        for (what, path, file) in held {
            let ours = file
                .metadata()
                .map_err(|e| LogError::io(path, "stat an open file", e))?;
            let why = match fs::metadata(path) {
                Ok(now) if now.dev() == ours.dev() && now.ino() == ours.ino() => continue,
                Ok(_) => "another file now has its name (it was replaced)".to_string(),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    "it no longer exists (it was deleted or moved away)".to_string()
                }
                Err(e) => format!("it cannot be checked: {e}"),
            };
            return Err(LogError::new(
                LogErrorKind::Replaced,
                Some(path),
                format!("{what} is not the one this log opened: {why}"),
            ));
        }
        Ok(())
    }

    /// Makes the active segment durable, then switches to a new one with room for
    /// a frame of `needed` bytes, and seals the old one. Syncing first keeps the
    /// invariant that only the newest segment can hold unsynced (possibly torn)
    /// data. The order — sync the data, create the next segment (whose header
    /// records where this one's records end), write and sync the seal — leaves a
    /// crash at any point in a state [`open`](Self::open) accepts: either no next
    /// segment, or an empty one whose predecessor is complete up to the seal.
    fn roll(&mut self, needed: u64) -> Result<(), LogError> {
        self.same_files()?;
        self.sync_active()?;
        let size = self
            .opts
            .segment_bytes
            .max(SEGMENT_HEADER_BYTES + needed + SEAL_FRAME_BYTES);
        let started = Instant::now();
        let seal = Seal {
            next_seq: self.active.seq + 1,
            next_first_record: self.active.first_record + self.active.records,
        };
        let next = create_segment(
            &self.dir,
            &self.dir_file,
            seal.next_seq,
            size,
            seal.next_first_record,
            self.active.write_offset,
            self.opts.fsync,
        )?;
        let path = segment_path(&self.dir, self.active.seq);
        self.active
            .file
            .write_all_at(&encode_seal_frame(seal, true), self.active.write_offset)
            .and_then(|()| {
                if self.opts.fsync {
                    fdatasync(&self.active.file)
                } else {
                    Ok(())
                }
            })
            .map_err(|e| LogError::io(&path, "write the seal", e))?;
        self.active = next;
        self.at_batch_start = true;
        self.dirty = false;
        if self.opts.fsync {
            self.stats.fsyncs += 3;
            self.stats.fsync_micros += started.elapsed().as_micros() as u64;
        }
        Ok(())
    }

    /// Records the active segment's durable end in the manifest, if it moved.
    fn record_high_water(&mut self) -> Result<(), LogError> {
        let hw = HighWater {
            seq: self.active.seq,
            offset: self.active.durable_end,
        };
        if self.manifest_hw != Some(hw) {
            write_manifest(&self.dir, &self.dir_file, Some(hw), self.opts.fsync)?;
            self.manifest_hw = Some(hw);
        }
        Ok(())
    }
}

impl Drop for Log {
    /// Records in the manifest how far the log was durable (one small file write,
    /// fdatasync, rename and directory fsync; errors are ignored, the next
    /// [`Log::open`] does not need it). After a clean close, the next open then
    /// refuses to load a newest segment whose synced records were lost.
    fn drop(&mut self) {
        // Never into a directory that replaced ours: a manifest there would
        // describe segments it does not have.
        if !self.poisoned && self.same_files().is_ok() {
            let _ = self.record_high_water();
        }
    }
}

/// Reads `log.durable`: the furthest valid mark of its two slots, if any. A
/// missing, short or damaged file is no mark: it is evidence only, and without it
/// recovery falls back to the rules that held before it existed.
fn read_durable_mark(dir: &Path) -> Option<HighWater> {
    let bytes = fs::read(dir.join(DURABLE_NAME)).ok()?;
    (0..2)
        .filter_map(|slot| {
            let at = (slot * DURABLE_SLOT_STRIDE) as usize;
            bytes
                .get(at..at + DURABLE_SLOT_BYTES)
                .and_then(decode_durable_mark)
        })
        .max()
}

/// Opens `log.durable` for writing, creating it (one sector per slot) if needed;
/// a new file is synced with its directory so later marks land in a file that
/// survives a power loss.
fn open_durable_file(dir: &Path, dir_file: &File, fsync: bool) -> Result<File, LogError> {
    let path = dir.join(DURABLE_NAME);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| LogError::io(&path, "open the durable-end file", e))?;
    let len = file
        .metadata()
        .map_err(|e| LogError::io(&path, "stat the durable-end file", e))?
        .len();
    if len != DURABLE_FILE_BYTES {
        file.set_len(DURABLE_FILE_BYTES)
            .and_then(|()| if fsync { fdatasync(&file) } else { Ok(()) })
            .map_err(|e| LogError::io(&path, "size the durable-end file", e))?;
        if fsync {
            dir_file
                .sync_all()
                .map_err(|e| LogError::io(dir, "fsync directory", e))?;
        }
    }
    Ok(file)
}

/// The newest segment's valid records must reach the durable end `log.durable`
/// records for it: a mark is written only after the fdatasync that made its
/// records durable returned, so a record before it that fails its checksum was
/// acknowledged, and was damaged afterwards. Marks of older segments say nothing
/// the seals and links do not.
fn check_durable_mark(
    dir: &Path,
    seq: u64,
    end: &SegmentEnd,
    mark: Option<HighWater>,
) -> Result<(), LogError> {
    match mark {
        Some(mark) if mark.seq == seq && end.valid_end < mark.offset => Err(LogError::corrupt(
            &segment_path(dir, seq),
            Some(end.valid_end),
            format!(
                "valid records end here, but {DURABLE_NAME} records that records up to offset {} \
                 were durable (their fdatasync had completed): acknowledged records were \
                 damaged, cut or zeroed, not torn by a crash",
                mark.offset
            ),
        )),
        _ => Ok(()),
    }
}

/// Reads `log.manifest`: the durable position it records, if any.
fn read_manifest(dir: &Path) -> Result<Option<HighWater>, LogError> {
    let path = dir.join(MANIFEST_NAME);
    let mut bytes = Vec::with_capacity(MANIFEST_BYTES as usize);
    File::open(&path)
        .and_then(|f| {
            use std::io::Read;
            f.take(MANIFEST_BYTES + 1).read_to_end(&mut bytes)
        })
        .map_err(|e| LogError::io(&path, "read manifest", e))?;
    decode_manifest(&bytes).map_err(|msg| LogError::corrupt(&path, Some(0), msg))
}

/// Atomically replaces `log.manifest`: temp file, fdatasync, rename, directory fsync.
fn write_manifest(
    dir: &Path,
    dir_file: &File,
    hw: Option<HighWater>,
    fsync: bool,
) -> Result<(), LogError> {
    let path = dir.join(MANIFEST_NAME);
    let tmp = dir.join(format!("{MANIFEST_NAME}.tmp"));
    let file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&tmp)
        .map_err(|e| LogError::io(&tmp, "create manifest", e))?;
    file.write_all_at(&encode_manifest(hw), 0)
        .and_then(|()| if fsync { fdatasync(&file) } else { Ok(()) })
        .map_err(|e| LogError::io(&tmp, "write manifest", e))?;
    fs::rename(&tmp, &path).map_err(|e| LogError::io(&path, "rename manifest into place", e))?;
    if fsync {
        dir_file
            .sync_all()
            .map_err(|e| LogError::io(dir, "fsync directory", e))?;
    }
    Ok(())
}

/// A directory without a manifest is new or was written by format version 1. If
/// it holds anything written by version 2, the manifest was deleted.
fn check_manifest_present(
    dir: &Path,
    has_manifest: bool,
    scanned: &[(u64, File, SegmentEnd)],
    snapshot_version: Option<u32>,
) -> Result<(), LogError> {
    if has_manifest {
        return Ok(());
    }
    let path = dir.join(MANIFEST_NAME);
    if let Some((seq, _, _)) = scanned
        .iter()
        .find(|(_, _, end)| end.header.version != SEGMENT_VERSION_V1)
    {
        return Err(LogError::corrupt(
            &path,
            None,
            format!(
                "the manifest is missing, but log-{seq:016}.seg was written with it \
                 (format version 2): files of the data directory were deleted"
            ),
        ));
    }
    if snapshot_version == Some(SNAPSHOT_VERSION) {
        return Err(LogError::corrupt(
            &path,
            None,
            "the manifest is missing, but the newest snapshot was written with it \
             (format version 2): files of the data directory were deleted",
        ));
    }
    Ok(())
}

/// No segment at all is fine only for a new directory, or (format version 1) a
/// crash between installing a snapshot and creating its segment.
fn check_nothing_missing(
    dir: &Path,
    manifest_hw: Option<HighWater>,
    snapshot_seq: Option<u64>,
    snapshot_version: Option<u32>,
) -> Result<(), LogError> {
    match (snapshot_seq, manifest_hw) {
        (Some(seq), hw) if hw.is_some() || snapshot_version != Some(SNAPSHOT_VERSION_V1) => {
            Err(LogError::corrupt(
                &segment_path(dir, seq),
                None,
                format!(
                    "segment is missing: snap-{seq:016}.snap is always written after it, and it \
                     holds every record appended after that snapshot (it was deleted)"
                ),
            ))
        }
        (None, Some(hw)) => Err(LogError::corrupt(
            &segment_path(dir, hw.seq),
            None,
            format!(
                "segment is missing: the manifest records durable records up to offset {} in \
                 it, but the directory has no segments or snapshots (they were deleted; to start \
                 over on purpose, delete the whole data directory)",
                hw.offset
            ),
        )),
        _ => Ok(()),
    }
}

/// Checks that segment `cur` ends exactly where its successor `next` says, with a
/// seal naming `next`. Returns `true` for the one state a crash during a roll
/// leaves: `cur` unsealed and `next` the newest segment, still empty.
fn check_link(
    dir: &Path,
    (cur_seq, _, cur): &(u64, File, SegmentEnd),
    (next_seq, _, next): &(u64, File, SegmentEnd),
    next_is_newest: bool,
) -> Result<bool, LogError> {
    let cur_path = segment_path(dir, *cur_seq);
    let next_path = segment_path(dir, *next_seq);
    let (Some(prev_end), Some(next_first)) = (next.header.prev_end, next.header.first_record)
    else {
        // Format version 1 segments carry no links.
        if cur.header.version != SEGMENT_VERSION_V1 {
            return Err(LogError::corrupt(
                &next_path,
                Some(0),
                "a format version 1 segment after a version 2 segment",
            ));
        }
        return Ok(false);
    };
    if prev_end != cur.valid_end {
        return Err(LogError::corrupt(
            &cur_path,
            Some(cur.valid_end),
            format!(
                "records end at offset {}, but the header of log-{next_seq:016}.seg says they \
                 end at {prev_end}: records at the end of this segment were cut or zeroed",
                cur.valid_end
            ),
        ));
    }
    if cur.header.version == SEGMENT_VERSION_V1 {
        return Ok(false); // written before seals existed
    }
    let expected_first = cur.header.first_record.unwrap_or(0) + cur.records;
    match cur.seal {
        Some(seal) => {
            if seal.next_seq != *next_seq || seal.next_first_record != expected_first {
                return Err(LogError::corrupt(
                    &cur_path,
                    Some(cur.valid_end),
                    format!(
                        "the seal names segment {} (first record {}), but the next segment is \
                         {next_seq} and this one ends with record {}",
                        seal.next_seq, seal.next_first_record, expected_first
                    ),
                ));
            }
            if next_first != expected_first {
                return Err(LogError::corrupt(
                    &next_path,
                    Some(0),
                    format!(
                        "segment header says its first record is number {next_first}, but the \
                         previous segment ends before record {expected_first}"
                    ),
                ));
            }
            Ok(false)
        }
        None => {
            let next_empty = next.records == 0
                && next.damaged_end == next.header.len()
                && next_first == expected_first;
            if next_is_newest && next_empty {
                return Ok(true);
            }
            Err(LogError::corrupt(
                &cur_path,
                Some(cur.valid_end),
                format!(
                    "segment ends without the seal that names log-{next_seq:016}.seg: its last \
                     records or its seal were cut or zeroed"
                ),
            ))
        }
    }
}

/// The newest segment: never sealed (its seal would name a segment that does not
/// exist), and it reaches at least as far as the manifest says was durable.
fn check_newest(
    dir: &Path,
    seq: u64,
    end: &SegmentEnd,
    manifest_hw: Option<HighWater>,
) -> Result<(), LogError> {
    let path = segment_path(dir, seq);
    if let Some(seal) = end.seal {
        return Err(LogError::corrupt(
            &segment_path(dir, seal.next_seq),
            None,
            format!(
                "segment is missing: log-{seq:016}.seg is sealed and names it as the next \
                 segment (it was deleted)"
            ),
        ));
    }
    let Some(hw) = manifest_hw else {
        return Ok(());
    };
    if hw.seq > seq {
        return Err(LogError::corrupt(
            &segment_path(dir, hw.seq),
            None,
            format!(
                "segment is missing: the manifest records durable records up to offset {} in \
                 it, but the newest segment is log-{seq:016}.seg (it was deleted)",
                hw.offset
            ),
        ));
    }
    if hw.seq == seq && end.valid_end < hw.offset {
        return Err(LogError::corrupt(
            &path,
            Some(end.valid_end),
            format!(
                "valid records end here, but the manifest records that records up to offset {} \
                 were durable: synced records were damaged, cut or zeroed",
                hw.offset
            ),
        ));
    }
    Ok(())
}

/// Checks that the segments not covered by the snapshot form an unbroken run
/// starting at `first`.
fn check_sequence(
    dir: &Path,
    first: u64,
    snapshot_seq: Option<u64>,
    live: &[u64],
) -> Result<(), LogError> {
    for (expected, &seq) in (first..).zip(live) {
        if seq != expected {
            let covered_by = match snapshot_seq {
                Some(s) => format!("the newest snapshot is snap-{s:016}.snap"),
                None => "there is no snapshot".to_string(),
            };
            return Err(LogError::corrupt(
                &segment_path(dir, expected),
                None,
                format!("segment is missing from the sequence (found log-{seq:016}.seg after it; {covered_by})"),
            ));
        }
    }
    Ok(())
}

/// Creates segment `seq` of `size` bytes: preallocate `log-N.seg.tmp`, write the
/// header, fdatasync, rename into place, fsync the directory. A segment file under
/// its final name therefore always has a durable, valid header and its full length.
fn create_segment(
    dir: &Path,
    dir_file: &File,
    seq: u64,
    size: u64,
    first_record: u64,
    prev_end: u64,
    fsync: bool,
) -> Result<ActiveSegment, LogError> {
    assert!(size >= MIN_SEGMENT_BYTES);
    let path = segment_path(dir, seq);
    let mut tmp = path.clone().into_os_string();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&tmp)
        .map_err(|e| LogError::io(&tmp, "create segment", e))?;
    preallocate(&file, size)
        .and_then(|()| {
            file.write_all_at(&encode_segment_header(seq, size, first_record, prev_end), 0)
        })
        .and_then(|()| if fsync { fdatasync(&file) } else { Ok(()) })
        .map_err(|e| LogError::io(&tmp, "preallocate segment", e))?;
    fs::rename(&tmp, &path).map_err(|e| LogError::io(&path, "rename segment into place", e))?;
    if fsync {
        dir_file
            .sync_all()
            .map_err(|e| LogError::io(dir, "fsync directory", e))?;
    }
    Ok(ActiveSegment {
        seq,
        file,
        capacity_bytes: size,
        write_offset: SEGMENT_HEADER_BYTES,
        first_record,
        records: 0,
        durable_end: SEGMENT_HEADER_BYTES,
    })
}

/// The segments and older snapshots that snapshot `seq` makes obsolete.
fn covered_by_snapshot(dir: &Path, listing: &Listing, seq: u64) -> Vec<PathBuf> {
    listing
        .segments
        .range(..seq)
        .map(|&s| segment_path(dir, s))
        .chain(
            listing
                .snapshots
                .range(..seq)
                .map(|&s| snapshot_path(dir, s)),
        )
        .collect()
}

fn remove_files(
    dir_file: &File,
    dir: &Path,
    paths: &[PathBuf],
    fsync: bool,
) -> Result<(), LogError> {
    for path in paths {
        match fs::remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(LogError::io(path, "remove obsolete file", e)),
        }
    }
    if fsync && !paths.is_empty() {
        dir_file
            .sync_all()
            .map_err(|e| LogError::io(dir, "fsync directory", e))?;
    }
    Ok(())
}
