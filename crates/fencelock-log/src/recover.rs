//! Reading a data directory back: file names, segment scanning, and the
//! torn-tail-versus-corruption decision.

use std::collections::BTreeSet;
use std::fs::{self, File};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::error::LogError;
use crate::format::{
    decode_seal, decode_segment_header, record_crc, valid_record_at, Malformed, RecordHeader, Seal,
    SegmentHeader, MAX_RECORD_BYTES, RECORD_HEADER_BYTES, SEAL_FRAME_BYTES, SEGMENT_HEADER_BYTES,
    SEGMENT_VERSION_V1,
};

/// Read-ahead window for scanning segments.
const WINDOW_BYTES: usize = 1 << 20;
/// Upper bound on bytes hashed while classifying a damaged tail; past it we give
/// up and report corruption rather than spin.
const CLASSIFY_CRC_BUDGET_BYTES: u64 = 1 << 30;

pub(crate) fn segment_path(dir: &Path, seq: u64) -> PathBuf {
    dir.join(format!("log-{seq:016}.seg"))
}

pub(crate) fn snapshot_path(dir: &Path, seq: u64) -> PathBuf {
    dir.join(format!("snap-{seq:016}.snap"))
}

/// The name of the manifest file (see the crate docs).
pub(crate) const MANIFEST_NAME: &str = "log.manifest";

/// The files of a data directory that this crate owns.
#[derive(Debug, Default)]
pub(crate) struct Listing {
    pub(crate) segments: BTreeSet<u64>,
    pub(crate) snapshots: BTreeSet<u64>,
    /// Leftover `*.tmp` files from an interrupted segment creation, snapshot or
    /// manifest update.
    pub(crate) temps: Vec<PathBuf>,
    /// Whether `log.manifest` exists.
    pub(crate) manifest: bool,
}

fn parse_seq(name: &str, prefix: &str, suffix: &str) -> Option<u64> {
    let digits = name.strip_prefix(prefix)?.strip_suffix(suffix)?;
    if digits.len() != 16 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Lists `log-N.seg`, `snap-N.snap` and their `.tmp` leftovers; ignores other files.
pub(crate) fn list_dir(dir: &Path) -> Result<Listing, LogError> {
    let mut listing = Listing::default();
    let entries = fs::read_dir(dir).map_err(|e| LogError::io(dir, "list directory", e))?;
    for entry in entries {
        let entry = entry.map_err(|e| LogError::io(dir, "list directory", e))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if let Some(seq) = parse_seq(name, "log-", ".seg") {
            listing.segments.insert(seq);
        } else if let Some(seq) = parse_seq(name, "snap-", ".snap") {
            listing.snapshots.insert(seq);
        } else if name == MANIFEST_NAME {
            listing.manifest = true;
        } else if parse_seq(name, "log-", ".seg.tmp").is_some()
            || parse_seq(name, "snap-", ".snap.tmp").is_some()
            || name.strip_suffix(".tmp") == Some(MANIFEST_NAME)
        {
            listing.temps.push(entry.path());
        }
    }
    Ok(listing)
}

/// A buffered positional reader over one file.
struct WindowReader<'a> {
    file: &'a File,
    file_len: u64,
    start: u64,
    buf: Vec<u8>,
}

impl<'a> WindowReader<'a> {
    fn new(file: &'a File, file_len: u64) -> Self {
        WindowReader {
            file,
            file_len,
            start: 0,
            buf: Vec::new(),
        }
    }

    /// Returns `[off, off + len)`; the range must lie inside the file.
    fn get(&mut self, off: u64, len: usize) -> io::Result<&[u8]> {
        assert!(off + len as u64 <= self.file_len, "read past end of file");
        let cached_end = self.start + self.buf.len() as u64;
        if off < self.start || off + len as u64 > cached_end {
            let want = len.max(WINDOW_BYTES).min((self.file_len - off) as usize);
            self.buf.resize(want, 0);
            self.file.read_exact_at(&mut self.buf, off)?;
            self.start = off;
        }
        let i = (off - self.start) as usize;
        Ok(&self.buf[i..i + len])
    }

    /// The end of the last non-zero byte in `[from, file_len)`, or `from` if all zero.
    fn nonzero_end(&mut self, from: u64) -> io::Result<u64> {
        let mut end = from;
        let mut off = from;
        while off < self.file_len {
            let n = (self.file_len - off).min(WINDOW_BYTES as u64) as usize;
            if let Some(i) = self.get(off, n)?.iter().rposition(|b| *b != 0) {
                end = off + i as u64 + 1;
            }
            off += n as u64;
        }
        Ok(end)
    }
}

/// How a segment's written part ended.
#[derive(Debug)]
pub(crate) struct SegmentEnd {
    /// The segment's header.
    pub(crate) header: SegmentHeader,
    /// Offset just past the last valid record: where the next record (or the seal)
    /// goes; the offset of the seal if the segment is sealed.
    pub(crate) valid_end: u64,
    /// End of the damaged bytes (the last non-zero byte + 1) when the tail was torn;
    /// equal to `valid_end` when the segment ended cleanly.
    pub(crate) damaged_end: u64,
    /// Framed bytes (headers + payloads) of the valid records.
    pub(crate) record_bytes: u64,
    /// How many valid records the segment holds (not counting a seal).
    pub(crate) records: u64,
    /// The seal that ends the segment, if it has one.
    pub(crate) seal: Option<Seal>,
    /// The file's length, which is the segment's capacity.
    pub(crate) file_len: u64,
}

/// Validates the header of segment `seq` and pushes its records onto `out`.
///
/// A record that is not valid ends the scan. If anything but zeros follows it,
/// the segment is damaged: for the newest segment (`is_last`) [`classify_tail`]
/// decides between a torn tail (allowed) and corruption; in any older segment,
/// damage is always corruption, because older segments were fdatasynced in full
/// before the next one was created.
pub(crate) fn scan_segment(
    path: &Path,
    file: &File,
    seq: u64,
    is_last: bool,
    out: &mut Vec<Vec<u8>>,
) -> Result<SegmentEnd, LogError> {
    let io_err = |e| LogError::io(path, "read segment", e);
    let file_len = file.metadata().map_err(io_err)?.len();
    let mut reader = WindowReader::new(file, file_len);
    let header_bytes = reader
        .get(0, file_len.min(SEGMENT_HEADER_BYTES) as usize)
        .map_err(io_err)?;
    let header = decode_segment_header(header_bytes).map_err(|m| m.at(path, Some(0)))?;
    if header.seq != seq {
        return Err(LogError::corrupt(
            path,
            Some(0),
            format!(
                "segment header says sequence {}, file name says {seq}",
                header.seq
            ),
        ));
    }
    if let Some(capacity) = header.capacity {
        // Segments are preallocated to their capacity before they get their final
        // name, and never change length afterwards: a crash cannot shorten one.
        if file_len != capacity {
            let how = if file_len < capacity {
                "cut short (truncated)"
            } else {
                "extended"
            };
            return Err(LogError::corrupt(
                path,
                Some(file_len.min(capacity)),
                format!(
                    "segment file is {file_len} bytes but its header says it was preallocated \
                     to {capacity}: the file was {how} after it was written"
                ),
            ));
        }
    }
    let allow_control = header.version != SEGMENT_VERSION_V1;

    let mut off = header.len();
    let mut record_bytes = 0u64;
    let mut records = 0u64;
    let mut seal = None;
    let why_stopped = loop {
        if off + RECORD_HEADER_BYTES > file_len {
            break "record header runs past the end of the file";
        }
        let frame_header = reader
            .get(off, RECORD_HEADER_BYTES as usize)
            .map_err(io_err)?;
        match RecordHeader::parse(
            frame_header,
            file_len - off - RECORD_HEADER_BYTES,
            allow_control,
        ) {
            RecordHeader::End => break "zeroed record header",
            RecordHeader::Invalid(why) => break why,
            RecordHeader::Frame {
                word,
                len,
                crc,
                control,
            } => {
                let frame_end = off + RECORD_HEADER_BYTES + len as u64;
                if allow_control && !control && frame_end + SEAL_FRAME_BYTES > file_len {
                    break "record runs into the space kept for the seal";
                }
                let payload = reader.get(off + RECORD_HEADER_BYTES, len).map_err(io_err)?;
                if record_crc(word, payload) != crc {
                    break "record checksum mismatch";
                }
                if control {
                    let found = decode_seal(payload).map_err(|m| m.at(path, Some(off)))?;
                    seal = Some((found, off + RECORD_HEADER_BYTES + len as u64));
                    break "seal";
                }
                out.push(payload.to_vec());
                let framed = RECORD_HEADER_BYTES + len as u64;
                off += framed;
                record_bytes += framed;
                records += 1;
            }
        }
    };

    if let Some((found, seal_end)) = seal {
        // Nothing is ever written after a seal: the rest must be the preallocated zeros.
        let nonzero = reader.nonzero_end(seal_end).map_err(io_err)?;
        if nonzero != seal_end {
            return Err(LogError::corrupt(
                path,
                Some(seal_end),
                format!(
                    "{} non-zero bytes after the seal that ends the segment",
                    nonzero - seal_end
                ),
            ));
        }
        return Ok(SegmentEnd {
            header,
            valid_end: off,
            damaged_end: off,
            record_bytes,
            records,
            seal: Some(found),
            file_len,
        });
    }

    let damaged_end = reader.nonzero_end(off).map_err(io_err)?;
    let end = SegmentEnd {
        header,
        valid_end: off,
        damaged_end,
        record_bytes,
        records,
        seal: None,
        file_len,
    };
    if damaged_end == off {
        return Ok(end);
    }
    if !is_last {
        return Err(LogError::corrupt(
            path,
            Some(off),
            format!(
                "{why_stopped}, followed by {} non-zero bytes, in a segment that is not the newest \
                 (only the newest segment can have a torn tail)",
                damaged_end - off
            ),
        ));
    }
    // Classify using the damaged bytes plus enough room for a valid record that
    // starts inside them to end in trailing zeros.
    let tail_end = file_len.min(damaged_end + RECORD_HEADER_BYTES + MAX_RECORD_BYTES as u64);
    let mut tail = vec![0u8; (tail_end - off) as usize];
    file.read_exact_at(&mut tail, off).map_err(io_err)?;
    classify_tail(&tail, off, (damaged_end - off) as usize, allow_control)
        .map_err(|msg| LogError::corrupt(path, Some(off), format!("{why_stopped}; {msg}")))?;
    Ok(end)
}

/// Decides whether the damaged bytes at the end of the newest segment are a torn
/// write (Ok) or corruption (Err with an explanation).
///
/// `tail` starts at the first invalid record (file offset `base`); its first
/// `damaged_len` bytes end in the segment's last non-zero byte.
///
/// Only data written since the last fdatasync can be torn, and the first record
/// written after each fdatasync carries the batch-start flag. A valid batch-start
/// record after the damage therefore proves a later fdatasync happened, so the
/// damaged record had been durable: corruption. Otherwise the damage lies in the
/// final batch, where a crash can leave any mix of written and unwritten sectors
/// (writeback may persist later pages first, so valid records of the same batch
/// may follow the damage): a torn tail.
pub(crate) fn classify_tail(
    tail: &[u8],
    base: u64,
    damaged_len: usize,
    allow_control: bool,
) -> Result<(), Malformed> {
    assert!(damaged_len > 0 && damaged_len <= tail.len());
    let mut budget = CLASSIFY_CRC_BUDGET_BYTES;
    for p in 1..damaged_len {
        if valid_record_at(&tail[p..], &mut budget, allow_control) == Some(true) {
            return Err(Malformed(format!(
                "a valid record at offset {} starts a later sync batch, so the damaged \
                 record had been made durable",
                base + p as u64
            )));
        }
        if budget == 0 {
            return Err(Malformed(
                "damaged tail could not be classified within the work budget".to_string(),
            ));
        }
    }
    Ok(())
}
