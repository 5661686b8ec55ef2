//! Byte layout of segment headers, record frames and snapshot files.
//! Pure functions over byte slices; no I/O. See the crate docs for the format.
//!
//! Hand-written on purpose: the bytes on disk are a format this crate must read
//! forever, so this file fixes them, not a serialization crate's choices.

/// The largest record payload [`Log::append`](crate::Log::append) accepts: 16 MiB.
pub const MAX_RECORD_BYTES: usize = 16 << 20;

/// The largest snapshot [`Log::snapshot`](crate::Log::snapshot) and
/// [`write_snapshot_file`](crate::write_snapshot_file) accept: 1 GiB.
pub const MAX_SNAPSHOT_BYTES: usize = 1 << 30;

pub(crate) const SEGMENT_MAGIC: [u8; 8] = *b"FLOGSEG\0";
pub(crate) const SNAPSHOT_MAGIC: [u8; 8] = *b"FLOGSNP\0";
pub(crate) const MANIFEST_MAGIC: [u8; 8] = *b"FLOGMAN\0";
/// Segments written by this version: header with capacity, chain links and seals.
pub(crate) const SEGMENT_VERSION: u32 = 2;
/// Segments written before format version 2: still read, never written.
pub(crate) const SEGMENT_VERSION_V1: u32 = 1;
/// Snapshots written by this version (the layout is unchanged from version 1; the
/// number tells that the directory also has a manifest).
pub(crate) const SNAPSHOT_VERSION: u32 = 2;
/// Snapshots written before format version 2 (same layout).
pub(crate) const SNAPSHOT_VERSION_V1: u32 = 1;
pub(crate) const MANIFEST_VERSION: u32 = 2;
pub(crate) const SEGMENT_HEADER_BYTES: u64 = 56;
pub(crate) const SEGMENT_HEADER_BYTES_V1: u64 = 32;
pub(crate) const SNAPSHOT_HEADER_BYTES: u64 = 32;
pub(crate) const MANIFEST_BYTES: u64 = 40;
pub(crate) const RECORD_HEADER_BYTES: u64 = 8;
/// Payload of a seal: `[kind u8 = 1][0 u8 x7][next_seq u64][next_first_record u64]`.
pub(crate) const SEAL_PAYLOAD_BYTES: usize = 24;
/// Room every version-2 segment keeps free at its end for its seal.
pub(crate) const SEAL_FRAME_BYTES: u64 = RECORD_HEADER_BYTES + SEAL_PAYLOAD_BYTES as u64;
const SEAL_KIND: u8 = 1;

/// Bit 31 of a record's length word: "first record written after an fdatasync".
pub(crate) const BATCH_START_FLAG: u32 = 1 << 31;
/// Bit 30 of the length word (version 2 segments only): a control record (a seal),
/// not a caller's record.
pub(crate) const CONTROL_FLAG: u32 = 1 << 30;
/// Bits 25..=29 of the length word are always zero (lengths are <= 2^24).
const LEN_RESERVED_BITS: u32 = 0x3E00_0000;
const LEN_MASK: u32 = !(BATCH_START_FLAG | CONTROL_FLAG);

const _: () = assert!(MAX_RECORD_BYTES as u32 & LEN_RESERVED_BITS == 0);
const _: () = assert!(MAX_RECORD_BYTES as u32 & (BATCH_START_FLAG | CONTROL_FLAG) == 0);

/// Why bytes read from disk do not decode. Always corruption; the caller knows the
/// file and offset ([`Malformed::at`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Malformed(pub(crate) String);

impl Malformed {
    /// The corruption error for this problem in `path` at `offset`.
    pub(crate) fn at(self, path: &std::path::Path, offset: Option<u64>) -> crate::LogError {
        crate::LogError::corrupt(path, offset, self.0)
    }
}

impl std::fmt::Display for Malformed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn le_u32(b: &[u8]) -> u32 {
    u32::from_le_bytes(b[..4].try_into().expect("4 bytes"))
}

fn le_u64(b: &[u8]) -> u64 {
    u64::from_le_bytes(b[..8].try_into().expect("8 bytes"))
}

/// A decoded segment header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SegmentHeader {
    /// 1 (read only) or 2.
    pub(crate) version: u32,
    pub(crate) seq: u64,
    /// Version 2: the preallocated file length; the file must be exactly this long.
    pub(crate) capacity: Option<u64>,
    /// Version 2: the number of the segment's first record, counted over the whole log.
    pub(crate) first_record: Option<u64>,
    /// Version 2: where the records of segment `seq - 1` end (the offset of its
    /// seal), or 0 if the segment was created without a predecessor.
    pub(crate) prev_end: Option<u64>,
}

impl SegmentHeader {
    /// Where the first record starts.
    pub(crate) fn len(&self) -> u64 {
        if self.version == SEGMENT_VERSION_V1 {
            SEGMENT_HEADER_BYTES_V1
        } else {
            SEGMENT_HEADER_BYTES
        }
    }
}

/// Version 2: `[magic 8][version u32 = 2][reserved u32 = 0][seq u64][capacity u64]
/// [first_record u64][prev_end u64][crc32 of bytes 0..48][reserved u32 = 0]`.
pub(crate) fn encode_segment_header(
    seq: u64,
    capacity: u64,
    first_record: u64,
    prev_end: u64,
) -> [u8; SEGMENT_HEADER_BYTES as usize] {
    let mut h = [0u8; SEGMENT_HEADER_BYTES as usize];
    h[0..8].copy_from_slice(&SEGMENT_MAGIC);
    h[8..12].copy_from_slice(&SEGMENT_VERSION.to_le_bytes());
    h[16..24].copy_from_slice(&seq.to_le_bytes());
    h[24..32].copy_from_slice(&capacity.to_le_bytes());
    h[32..40].copy_from_slice(&first_record.to_le_bytes());
    h[40..48].copy_from_slice(&prev_end.to_le_bytes());
    let crc = crc32fast::hash(&h[0..48]);
    h[48..52].copy_from_slice(&crc.to_le_bytes());
    h
}

/// Version 1 (kept for tests of the migration): `[magic 8][version u32 = 1]
/// [reserved u32 = 0][seq u64][crc32 of bytes 0..24][reserved u32 = 0]`.
#[cfg(test)]
pub(crate) fn encode_segment_header_v1(seq: u64) -> [u8; SEGMENT_HEADER_BYTES_V1 as usize] {
    let mut h = [0u8; SEGMENT_HEADER_BYTES_V1 as usize];
    h[0..8].copy_from_slice(&SEGMENT_MAGIC);
    h[8..12].copy_from_slice(&SEGMENT_VERSION_V1.to_le_bytes());
    h[16..24].copy_from_slice(&seq.to_le_bytes());
    let crc = crc32fast::hash(&h[0..24]);
    h[24..28].copy_from_slice(&crc.to_le_bytes());
    h
}

/// Decodes a segment header of either version from the first bytes of the file
/// (`h` holds up to [`SEGMENT_HEADER_BYTES`] of them), or says why it is invalid.
pub(crate) fn decode_segment_header(h: &[u8]) -> Result<SegmentHeader, Malformed> {
    if h.len() < SEGMENT_HEADER_BYTES_V1 as usize {
        return Err(Malformed(format!(
            "segment file is {} bytes, shorter than a segment header",
            h.len()
        )));
    }
    if h[0..8] != SEGMENT_MAGIC {
        return Err(Malformed(format!("bad segment magic {:02x?}", &h[0..8])));
    }
    let version = le_u32(&h[8..12]);
    match version {
        SEGMENT_VERSION_V1 => {
            if crc32fast::hash(&h[0..24]) != le_u32(&h[24..28]) {
                return Err(Malformed("segment header checksum mismatch".to_string()));
            }
            if le_u32(&h[12..16]) != 0 || le_u32(&h[28..32]) != 0 {
                return Err(Malformed(
                    "reserved segment header fields are not zero".to_string(),
                ));
            }
            Ok(SegmentHeader {
                version,
                seq: le_u64(&h[16..24]),
                capacity: None,
                first_record: None,
                prev_end: None,
            })
        }
        SEGMENT_VERSION => {
            if h.len() < SEGMENT_HEADER_BYTES as usize {
                return Err(Malformed(format!(
                    "segment file is {} bytes, shorter than its {SEGMENT_HEADER_BYTES}-byte header",
                    h.len()
                )));
            }
            if crc32fast::hash(&h[0..48]) != le_u32(&h[48..52]) {
                return Err(Malformed("segment header checksum mismatch".to_string()));
            }
            if le_u32(&h[12..16]) != 0 || le_u32(&h[52..56]) != 0 {
                return Err(Malformed(
                    "reserved segment header fields are not zero".to_string(),
                ));
            }
            let capacity = le_u64(&h[24..32]);
            if capacity < SEGMENT_HEADER_BYTES + SEAL_FRAME_BYTES {
                return Err(Malformed(format!(
                    "segment header has an impossible capacity {capacity}"
                )));
            }
            Ok(SegmentHeader {
                version,
                seq: le_u64(&h[16..24]),
                capacity: Some(capacity),
                first_record: Some(le_u64(&h[32..40])),
                prev_end: Some(le_u64(&h[40..48])),
            })
        }
        _ => Err(Malformed(format!(
            "unsupported segment format version {version}"
        ))),
    }
}

/// What a seal says: the segment that follows and the number of its first record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Seal {
    pub(crate) next_seq: u64,
    pub(crate) next_first_record: u64,
}

/// A complete seal frame (control flag set, and the batch-start flag if `batch_start`).
pub(crate) fn encode_seal_frame(seal: Seal, batch_start: bool) -> Vec<u8> {
    let mut payload = [0u8; SEAL_PAYLOAD_BYTES];
    payload[0] = SEAL_KIND;
    payload[8..16].copy_from_slice(&seal.next_seq.to_le_bytes());
    payload[16..24].copy_from_slice(&seal.next_first_record.to_le_bytes());
    let mut word = SEAL_PAYLOAD_BYTES as u32 | CONTROL_FLAG;
    if batch_start {
        word |= BATCH_START_FLAG;
    }
    let mut out = Vec::with_capacity(SEAL_FRAME_BYTES as usize);
    out.extend_from_slice(&word.to_le_bytes());
    out.extend_from_slice(&record_crc(word, &payload).to_le_bytes());
    out.extend_from_slice(&payload);
    out
}

/// Decodes the payload of a checksum-valid control record.
pub(crate) fn decode_seal(payload: &[u8]) -> Result<Seal, Malformed> {
    if payload.len() != SEAL_PAYLOAD_BYTES || payload[0] != SEAL_KIND || payload[1..8] != [0; 7] {
        return Err(Malformed("control record is not a valid seal".to_string()));
    }
    Ok(Seal {
        next_seq: le_u64(&payload[8..16]),
        next_first_record: le_u64(&payload[16..24]),
    })
}

/// The durable position a manifest records: records up to `offset` of segment
/// `seq` (and everything before that segment) were durable when it was written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct HighWater {
    pub(crate) seq: u64,
    pub(crate) offset: u64,
}

/// `[magic "FLOGMAN\0"][version u32 = 2][flags u32: bit 0 = high-water present]
/// [hw_seq u64][hw_offset u64][crc32 of bytes 0..32][reserved u32 = 0]`.
pub(crate) fn encode_manifest(hw: Option<HighWater>) -> [u8; MANIFEST_BYTES as usize] {
    let mut m = [0u8; MANIFEST_BYTES as usize];
    m[0..8].copy_from_slice(&MANIFEST_MAGIC);
    m[8..12].copy_from_slice(&MANIFEST_VERSION.to_le_bytes());
    if let Some(hw) = hw {
        m[12..16].copy_from_slice(&1u32.to_le_bytes());
        m[16..24].copy_from_slice(&hw.seq.to_le_bytes());
        m[24..32].copy_from_slice(&hw.offset.to_le_bytes());
    }
    let crc = crc32fast::hash(&m[0..32]);
    m[32..36].copy_from_slice(&crc.to_le_bytes());
    m
}

/// Decodes a whole manifest file; `Ok(None)` means no high-water was recorded yet.
pub(crate) fn decode_manifest(m: &[u8]) -> Result<Option<HighWater>, String> {
    if m.len() != MANIFEST_BYTES as usize {
        return Err(format!(
            "manifest is {} bytes, not {MANIFEST_BYTES}",
            m.len()
        ));
    }
    if m[0..8] != MANIFEST_MAGIC {
        return Err(format!("bad manifest magic {:02x?}", &m[0..8]));
    }
    let version = le_u32(&m[8..12]);
    if version != MANIFEST_VERSION {
        return Err(format!("unsupported manifest version {version}"));
    }
    if crc32fast::hash(&m[0..32]) != le_u32(&m[32..36]) {
        return Err("manifest checksum mismatch".to_string());
    }
    if le_u32(&m[36..40]) != 0 {
        return Err("reserved manifest field is not zero".to_string());
    }
    match le_u32(&m[12..16]) {
        0 if m[16..32] == [0; 16] => Ok(None),
        1 => Ok(Some(HighWater {
            seq: le_u64(&m[16..24]),
            offset: le_u64(&m[24..32]),
        })),
        _ => Err("bad manifest flags".to_string()),
    }
}

/// The durable-end file (`log.durable`): two slots, each a [`DurableMark`], at
/// offsets 0 and [`DURABLE_SLOT_STRIDE`] (different disk sectors).
pub(crate) const DURABLE_NAME: &str = "log.durable";
pub(crate) const DURABLE_MAGIC: [u8; 8] = *b"FLOGEND\0";
pub(crate) const DURABLE_VERSION: u32 = 1;
pub(crate) const DURABLE_SLOT_BYTES: usize = 40;
pub(crate) const DURABLE_SLOT_STRIDE: u64 = 512;
/// Length of `log.durable`: two slots, one sector apart.
pub(crate) const DURABLE_FILE_BYTES: u64 = 2 * DURABLE_SLOT_STRIDE;

/// "The records of segment `seq` up to `offset` were durable": written into
/// `log.durable` only after the fdatasync that made them so had returned.
pub(crate) type DurableMark = HighWater;

/// `[magic "FLOGEND\0"][version u32 = 1][0 u32][seq u64][offset u64][crc32 of
/// bytes 0..32][0 u32]`.
pub(crate) fn encode_durable_mark(mark: DurableMark) -> [u8; DURABLE_SLOT_BYTES] {
    let mut m = [0u8; DURABLE_SLOT_BYTES];
    m[0..8].copy_from_slice(&DURABLE_MAGIC);
    m[8..12].copy_from_slice(&DURABLE_VERSION.to_le_bytes());
    m[16..24].copy_from_slice(&mark.seq.to_le_bytes());
    m[24..32].copy_from_slice(&mark.offset.to_le_bytes());
    let crc = crc32fast::hash(&m[0..32]);
    m[32..36].copy_from_slice(&crc.to_le_bytes());
    m
}

/// Decodes one slot; `None` if it is not a valid mark (never written, or damaged).
pub(crate) fn decode_durable_mark(m: &[u8]) -> Option<DurableMark> {
    if m.len() < DURABLE_SLOT_BYTES
        || m[0..8] != DURABLE_MAGIC
        || le_u32(&m[8..12]) != DURABLE_VERSION
        || le_u32(&m[12..16]) != 0
        || le_u32(&m[36..40]) != 0
        || crc32fast::hash(&m[0..32]) != le_u32(&m[32..36])
    {
        return None;
    }
    Some(HighWater {
        seq: le_u64(&m[16..24]),
        offset: le_u64(&m[24..32]),
    })
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
    /// `control`: a seal, not a caller's record.
    Frame {
        word: u32,
        len: usize,
        crc: u32,
        control: bool,
    },
}

impl RecordHeader {
    /// `allow_control`: the segment is version 2, where bit 30 marks a control record
    /// (in version 1 it is a reserved bit).
    pub(crate) fn parse(h: &[u8], bytes_after_header: u64, allow_control: bool) -> RecordHeader {
        let word = le_u32(&h[0..4]);
        let crc = le_u32(&h[4..8]);
        if word == 0 && crc == 0 {
            return RecordHeader::End;
        }
        let control = word & CONTROL_FLAG != 0;
        if word & LEN_RESERVED_BITS != 0 || (control && !allow_control) {
            return RecordHeader::Invalid("record length word has reserved bits set");
        }
        let len = (word & LEN_MASK) as usize;
        if len > MAX_RECORD_BYTES {
            return RecordHeader::Invalid("record length exceeds MAX_RECORD_BYTES");
        }
        if len as u64 > bytes_after_header {
            return RecordHeader::Invalid("record length runs past the end of the file");
        }
        RecordHeader::Frame {
            word,
            len,
            crc,
            control,
        }
    }
}

/// If a complete, checksum-valid record starts at `buf[0]`, returns whether it
/// carries the batch-start flag. `crc_budget` is decremented by the bytes hashed.
pub(crate) fn valid_record_at(
    buf: &[u8],
    crc_budget: &mut u64,
    allow_control: bool,
) -> Option<bool> {
    if buf.len() < RECORD_HEADER_BYTES as usize {
        return None;
    }
    let after = (buf.len() - RECORD_HEADER_BYTES as usize) as u64;
    match RecordHeader::parse(buf, after, allow_control) {
        RecordHeader::Frame { word, len, crc, .. } => {
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
    h[8..12].copy_from_slice(&SNAPSHOT_VERSION.to_le_bytes());
    h[16..24].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    let mut crc = crc32fast::Hasher::new();
    crc.update(&h[0..24]);
    crc.update(payload);
    h[24..28].copy_from_slice(&crc.finalize().to_le_bytes());
    h
}

/// Checks a snapshot header against the file length; returns the payload length
/// and the format version (1 or 2; the layout is the same).
pub(crate) fn decode_snapshot_header(h: &[u8], file_len: u64) -> Result<(u64, u32), Malformed> {
    assert_eq!(h.len(), SNAPSHOT_HEADER_BYTES as usize);
    if h[0..8] != SNAPSHOT_MAGIC {
        return Err(Malformed(format!("bad snapshot magic {:02x?}", &h[0..8])));
    }
    let version = le_u32(&h[8..12]);
    if version != SNAPSHOT_VERSION && version != SNAPSHOT_VERSION_V1 {
        return Err(Malformed(format!(
            "unsupported snapshot format version {version}"
        )));
    }
    if le_u32(&h[12..16]) != 0 || le_u32(&h[28..32]) != 0 {
        return Err(Malformed(
            "reserved snapshot header fields are not zero".to_string(),
        ));
    }
    let len = le_u64(&h[16..24]);
    if Some(file_len) != len.checked_add(SNAPSHOT_HEADER_BYTES) {
        return Err(Malformed(format!(
            "snapshot header says {len} payload bytes but the file holds {}",
            file_len - SNAPSHOT_HEADER_BYTES
        )));
    }
    Ok((len, version))
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
        assert_eq!(valid_record_at(&frame, &mut budget, true), Some(false));
        assert_eq!(RecordHeader::parse(&[0u8; 8], 100, true), RecordHeader::End);
    }

    #[test]
    fn batch_start_flag_is_covered_by_the_checksum() {
        let mut frame = Vec::new();
        encode_record_into(&mut frame, b"hello");
        mark_batch_start(&mut frame);
        let mut budget = u64::MAX;
        assert_eq!(valid_record_at(&frame, &mut budget, true), Some(true));
        frame[3] &= 0x7f; // clear the flag without fixing the CRC
        assert_eq!(valid_record_at(&frame, &mut budget, true), None);
    }

    #[test]
    fn segment_header_round_trip_and_rejects_bit_flips() {
        let h = encode_segment_header(7, 4096, 99, 1234);
        let want = SegmentHeader {
            version: 2,
            seq: 7,
            capacity: Some(4096),
            first_record: Some(99),
            prev_end: Some(1234),
        };
        assert_eq!(decode_segment_header(&h), Ok(want));
        for i in 0..h.len() {
            let mut bad = h;
            bad[i] ^= 0x10;
            assert!(
                decode_segment_header(&bad).is_err(),
                "flip at byte {i} accepted"
            );
        }
        // A version 2 header cut to the length of a version 1 header.
        assert!(decode_segment_header(&h[..32]).is_err());
        let v1 = encode_segment_header_v1(7);
        assert_eq!(
            decode_segment_header(&v1).map(|h| (h.version, h.seq)),
            Ok((1, 7))
        );
        for i in 0..v1.len() {
            let mut bad = v1;
            bad[i] ^= 0x10;
            assert!(decode_segment_header(&bad).is_err(), "v1 flip at {i}");
        }
    }

    #[test]
    fn seal_is_a_control_record_only_in_version_2() {
        let seal = Seal {
            next_seq: 5,
            next_first_record: 77,
        };
        let frame = encode_seal_frame(seal, true);
        assert_eq!(frame.len() as u64, SEAL_FRAME_BYTES);
        let mut budget = u64::MAX;
        assert_eq!(valid_record_at(&frame, &mut budget, true), Some(true));
        assert_eq!(valid_record_at(&frame, &mut budget, false), None);
        match RecordHeader::parse(&frame, 24, true) {
            RecordHeader::Frame { control, len, .. } => {
                assert!(control);
                assert_eq!(decode_seal(&frame[8..8 + len]), Ok(seal));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn manifest_round_trip_and_rejects_bit_flips() {
        for hw in [
            None,
            Some(HighWater {
                seq: 3,
                offset: 4096,
            }),
        ] {
            let m = encode_manifest(hw);
            assert_eq!(decode_manifest(&m), Ok(hw));
            for i in 0..m.len() {
                let mut bad = m;
                bad[i] ^= 0x01;
                assert!(decode_manifest(&bad).is_err(), "flip at byte {i} accepted");
            }
            assert!(decode_manifest(&m[..39]).is_err());
        }
    }

    #[test]
    fn durable_mark_round_trip_and_rejects_bit_flips() {
        let mark = HighWater {
            seq: 9,
            offset: 777,
        };
        let m = encode_durable_mark(mark);
        assert_eq!(decode_durable_mark(&m), Some(mark));
        for i in 0..m.len() {
            let mut bad = m;
            bad[i] ^= 0x04;
            assert_eq!(decode_durable_mark(&bad), None, "flip at byte {i} accepted");
        }
        assert_eq!(decode_durable_mark(&[0u8; DURABLE_SLOT_BYTES]), None);
    }
}
