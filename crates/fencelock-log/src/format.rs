//! Byte layout of segment headers, record frames and snapshot files.
//! Pure functions over byte slices; no I/O. See the crate docs for the format.

/// The largest record payload [`Log::append`](crate::Log::append) accepts: 16 MiB.
pub const MAX_RECORD_BYTES: usize = 16 << 20;

/// The largest snapshot [`Log::snapshot`](crate::Log::snapshot) and
/// [`write_snapshot_file`](crate::write_snapshot_file) accept: 1 GiB.
pub const MAX_SNAPSHOT_BYTES: usize = 1 << 30;

pub(crate) const SEGMENT_MAGIC: [u8; 8] = *b"FLOGSEG\0";
pub(crate) const SNAPSHOT_MAGIC: [u8; 8] = *b"FLOGSNP\0";
pub(crate) const FORMAT_VERSION: u32 = 1;
pub(crate) const SEGMENT_HEADER_BYTES: u64 = 32;
pub(crate) const SNAPSHOT_HEADER_BYTES: u64 = 32;
pub(crate) const RECORD_HEADER_BYTES: u64 = 8;

/// Bit 31 of a record's length word: "first record written after an fdatasync".
pub(crate) const BATCH_START_FLAG: u32 = 1 << 31;
/// Bits 25..=30 of the length word are always zero (lengths are <= 2^24).
const LEN_RESERVED_BITS: u32 = 0x7E00_0000;
const LEN_MASK: u32 = !BATCH_START_FLAG;

const _: () = assert!(MAX_RECORD_BYTES as u32 & LEN_RESERVED_BITS == 0);
const _: () = assert!(MAX_RECORD_BYTES as u32 & BATCH_START_FLAG == 0);

fn le_u32(b: &[u8]) -> u32 {
    u32::from_le_bytes(b[..4].try_into().expect("4 bytes"))
}

fn le_u64(b: &[u8]) -> u64 {
    u64::from_le_bytes(b[..8].try_into().expect("8 bytes"))
}

/// `[magic 8][version u32][reserved u32 = 0][seq u64][crc32 of bytes 0..24][reserved u32 = 0]`.
pub(crate) fn encode_segment_header(seq: u64) -> [u8; SEGMENT_HEADER_BYTES as usize] {
    let mut h = [0u8; SEGMENT_HEADER_BYTES as usize];
    h[0..8].copy_from_slice(&SEGMENT_MAGIC);
    h[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    h[16..24].copy_from_slice(&seq.to_le_bytes());
    let crc = crc32fast::hash(&h[0..24]);
    h[24..28].copy_from_slice(&crc.to_le_bytes());
    h
}

/// Returns the sequence number stored in a segment header, or why the header is invalid.
pub(crate) fn decode_segment_header(h: &[u8]) -> Result<u64, String> {
    assert_eq!(h.len(), SEGMENT_HEADER_BYTES as usize);
    if h[0..8] != SEGMENT_MAGIC {
        return Err(format!("bad segment magic {:02x?}", &h[0..8]));
    }
    let version = le_u32(&h[8..12]);
    if version != FORMAT_VERSION {
        return Err(format!("unsupported segment format version {version}"));
    }
    if crc32fast::hash(&h[0..24]) != le_u32(&h[24..28]) {
        return Err("segment header checksum mismatch".to_string());
    }
    if le_u32(&h[12..16]) != 0 || le_u32(&h[28..32]) != 0 {
        return Err("reserved segment header fields are not zero".to_string());
    }
    Ok(le_u64(&h[16..24]))
}

/// CRC32 over the stored length word (little-endian) followed by the payload.
pub(crate) fn record_crc(word: u32, payload: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&word.to_le_bytes());
    h.update(payload);
    h.finalize()
}

/// Appends one frame `[len u32][crc u32][payload]` with the batch-start flag clear.
pub(crate) fn encode_record_into(out: &mut Vec<u8>, payload: &[u8]) {
    assert!(payload.len() <= MAX_RECORD_BYTES);
    let word = payload.len() as u32;
    out.extend_from_slice(&word.to_le_bytes());
    out.extend_from_slice(&record_crc(word, payload).to_le_bytes());
    out.extend_from_slice(payload);
}

/// Total frame length (header + payload) of the encoded frame starting at `frame[0]`.
pub(crate) fn frame_len(frame: &[u8]) -> usize {
    RECORD_HEADER_BYTES as usize + (le_u32(frame) & LEN_MASK) as usize
}

/// Sets the batch-start flag on an encoded frame and recomputes its checksum.
pub(crate) fn mark_batch_start(frame: &mut [u8]) {
    let word = le_u32(frame) | BATCH_START_FLAG;
    let len = frame_len(frame);
    let crc = record_crc(word, &frame[RECORD_HEADER_BYTES as usize..len]);
    frame[0..4].copy_from_slice(&word.to_le_bytes());
    frame[4..8].copy_from_slice(&crc.to_le_bytes());
}

/// What a record header says, before the payload checksum is checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RecordHeader {
    /// Eight zero bytes: the end of the written part of a segment.
    End,
    /// The header cannot start a record (reserved bits set, or length too large).
    Invalid(&'static str),
    /// A plausible frame; the payload is `len` bytes and must match `crc`.
    Frame { word: u32, len: usize, crc: u32 },
}

impl RecordHeader {
    pub(crate) fn parse(h: &[u8], bytes_after_header: u64) -> RecordHeader {
        let word = le_u32(&h[0..4]);
        let crc = le_u32(&h[4..8]);
        if word == 0 && crc == 0 {
            return RecordHeader::End;
        }
        if word & LEN_RESERVED_BITS != 0 {
            return RecordHeader::Invalid("record length word has reserved bits set");
        }
        let len = (word & LEN_MASK) as usize;
        if len > MAX_RECORD_BYTES {
            return RecordHeader::Invalid("record length exceeds MAX_RECORD_BYTES");
        }
        if len as u64 > bytes_after_header {
            return RecordHeader::Invalid("record length runs past the end of the file");
        }
        RecordHeader::Frame { word, len, crc }
    }
}

/// If a complete, checksum-valid record starts at `buf[0]`, returns whether it
/// carries the batch-start flag. `crc_budget` is decremented by the bytes hashed.
pub(crate) fn valid_record_at(buf: &[u8], crc_budget: &mut u64) -> Option<bool> {
    if buf.len() < RECORD_HEADER_BYTES as usize {
        return None;
    }
    let after = (buf.len() - RECORD_HEADER_BYTES as usize) as u64;
    match RecordHeader::parse(buf, after) {
        RecordHeader::Frame { word, len, crc } => {
            *crc_budget = crc_budget.saturating_sub(len as u64 + 4);
            let payload = &buf[RECORD_HEADER_BYTES as usize..][..len];
            (record_crc(word, payload) == crc).then_some(word & BATCH_START_FLAG != 0)
        }
        RecordHeader::End | RecordHeader::Invalid(_) => None,
    }
}

/// `[magic 8][version u32][reserved u32 = 0][len u64][crc32 of bytes 0..24 ++ payload][reserved u32 = 0]`.
pub(crate) fn encode_snapshot_header(payload: &[u8]) -> [u8; SNAPSHOT_HEADER_BYTES as usize] {
    let mut h = [0u8; SNAPSHOT_HEADER_BYTES as usize];
    h[0..8].copy_from_slice(&SNAPSHOT_MAGIC);
    h[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    h[16..24].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    let mut crc = crc32fast::Hasher::new();
    crc.update(&h[0..24]);
    crc.update(payload);
    h[24..28].copy_from_slice(&crc.finalize().to_le_bytes());
    h
}

/// Checks a snapshot header against the file length; returns the payload length.
pub(crate) fn decode_snapshot_header(h: &[u8], file_len: u64) -> Result<u64, String> {
    assert_eq!(h.len(), SNAPSHOT_HEADER_BYTES as usize);
    if h[0..8] != SNAPSHOT_MAGIC {
        return Err(format!("bad snapshot magic {:02x?}", &h[0..8]));
    }
    let version = le_u32(&h[8..12]);
    if version != FORMAT_VERSION {
        return Err(format!("unsupported snapshot format version {version}"));
    }
    if le_u32(&h[12..16]) != 0 || le_u32(&h[28..32]) != 0 {
        return Err("reserved snapshot header fields are not zero".to_string());
    }
    let len = le_u64(&h[16..24]);
    if Some(file_len) != len.checked_add(SNAPSHOT_HEADER_BYTES) {
        return Err(format!(
            "snapshot header says {len} payload bytes but the file holds {}",
            file_len - SNAPSHOT_HEADER_BYTES
        ));
    }
    Ok(len)
}

/// Verifies the whole-file checksum of a snapshot.
pub(crate) fn snapshot_crc_ok(h: &[u8], payload: &[u8]) -> bool {
    let mut crc = crc32fast::Hasher::new();
    crc.update(&h[0..24]);
    crc.update(payload);
    crc.finalize() == le_u32(&h[24..28])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_record_is_not_an_end_marker() {
        let mut frame = Vec::new();
        encode_record_into(&mut frame, b"");
        assert_eq!(frame.len(), 8);
        assert_ne!(frame, [0u8; 8]);
        let mut budget = u64::MAX;
        assert_eq!(valid_record_at(&frame, &mut budget), Some(false));
        assert_eq!(RecordHeader::parse(&[0u8; 8], 100), RecordHeader::End);
    }

    #[test]
    fn batch_start_flag_is_covered_by_the_checksum() {
        let mut frame = Vec::new();
        encode_record_into(&mut frame, b"hello");
        mark_batch_start(&mut frame);
        let mut budget = u64::MAX;
        assert_eq!(valid_record_at(&frame, &mut budget), Some(true));
        frame[3] &= 0x7f; // clear the flag without fixing the CRC
        assert_eq!(valid_record_at(&frame, &mut budget), None);
    }

    #[test]
    fn segment_header_round_trip_and_rejects_bit_flips() {
        let h = encode_segment_header(7);
        assert_eq!(decode_segment_header(&h), Ok(7));
        for i in 0..h.len() {
            let mut bad = h;
            bad[i] ^= 0x10;
            assert!(
                decode_segment_header(&bad).is_err(),
                "flip at byte {i} accepted"
            );
        }
    }
}
