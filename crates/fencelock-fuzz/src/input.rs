//! A cursor over fuzz input that never fails: past the end it yields zeros, so
//! every byte string maps to exactly one structured value.

/// Reads structured values from fuzz bytes. Past the end every read returns 0.
#[derive(Debug, Clone)]
pub struct Input<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Input<'a> {
    /// A cursor at the start of `data`.
    pub fn new(data: &'a [u8]) -> Input<'a> {
        Input { data, pos: 0 }
    }

    /// Whether all bytes were read.
    pub fn is_empty(&self) -> bool {
        self.pos >= self.data.len()
    }

    /// One byte (0 past the end).
    pub fn byte(&mut self) -> u8 {
        let b = self.data.get(self.pos).copied().unwrap_or(0);
        self.pos += 1;
        b
    }

    /// A little-endian u16.
    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.byte(), self.byte()])
    }

    /// A little-endian u32.
    pub fn u32(&mut self) -> u32 {
        u32::from(self.u16()) | (u32::from(self.u16()) << 16)
    }

    /// A little-endian u64.
    pub fn u64(&mut self) -> u64 {
        u64::from(self.u32()) | (u64::from(self.u32()) << 32)
    }

    /// A value in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        assert!(n > 0);
        if n <= 256 {
            usize::from(self.byte()) % n
        } else {
            self.u32() as usize % n
        }
    }

    /// Up to `max` bytes, length chosen by the input (fewer at the end).
    pub fn bytes(&mut self, max: usize) -> &'a [u8] {
        let want = self.below(max + 1);
        self.take(want)
    }

    /// Exactly `n` bytes, or fewer at the end.
    pub fn take(&mut self, n: usize) -> &'a [u8] {
        let start = self.pos.min(self.data.len());
        let end = start.saturating_add(n).min(self.data.len());
        self.pos = start.saturating_add(n);
        &self.data[start..end]
    }

    /// Everything not read yet.
    pub fn rest(&mut self) -> &'a [u8] {
        let start = self.pos.min(self.data.len());
        self.pos = self.data.len();
        &self.data[start..]
    }
}
