//! The fencing rule with readers: shared grants (`mode: shared`) read while an
//! exclusive grant writes.
//!
//! A reader's grant has its own fence from the same counter as every writer's, so
//! a writer granted after a reader has a larger fence, and a reader granted after a
//! writer too. The resource keeps two numbers per key:
//!
//! - `seen`: the largest fence of any read or write it accepted;
//! - `written`: the fence of the last write it accepted.
//!
//! A **read** is accepted if its fence is larger than `written` (no newer writer has
//! written since its grant), and raises `seen`. A **write** is accepted only if its
//! fence is larger than `seen`, reads included: a writer whose lock was lost and
//! handed to readers that already read must not write under them. So:
//!
//! - a stale writer (paused past its lease) is refused once a newer reader read;
//! - a stale reader is refused once a newer writer wrote (what it would read is no
//!   longer what its grant covered);
//! - readers holding together (any order of their fences) all read, since none of
//!   them wrote.

use crate::FenceError;

/// One resource's fencing state with readers (see the [module docs](self)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReadWriteFence {
    seen: u64,
    written: u64,
}

impl ReadWriteFence {
    /// A resource that has accepted nothing yet.
    pub fn new() -> ReadWriteFence {
        ReadWriteFence::default()
    }

    /// The largest fence of any accepted read or write (0: none).
    pub fn seen(&self) -> u64 {
        self.seen
    }

    /// The fence of the last accepted write (0: none).
    pub fn written(&self) -> u64 {
        self.written
    }

    /// Accepts a read under `fence` if it is larger than the last write's fence;
    /// raises the largest fence seen. A refused read changes nothing. `resource`
    /// names the resource in the error.
    pub fn read(&mut self, resource: &str, fence: u64) -> Result<(), FenceError> {
        if fence == 0 || fence <= self.written {
            return Err(FenceError::stale(
                &format_args!("{resource} (read)"),
                fence,
                Some(self.written),
            ));
        }
        self.seen = self.seen.max(fence);
        Ok(())
    }

    /// Accepts a write under `fence` if it is larger than every fence seen, reads
    /// included. A refused write changes nothing.
    pub fn write(&mut self, resource: &str, fence: u64) -> Result<(), FenceError> {
        if fence <= self.seen {
            return Err(FenceError::stale(
                &format_args!("{resource} (write)"),
                fence,
                Some(self.seen),
            ));
        }
        self.seen = fence;
        self.written = fence;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;

    #[test]
    fn a_stale_writer_is_refused_after_a_newer_reader_read() {
        let mut r = ReadWriteFence::new();
        r.write("doc", 3).expect("the first writer writes");
        // The writer pauses; its lock goes to a reader (fence 5), which reads.
        r.read("doc", 5).expect("the newer reader reads");
        let stale = r.write("doc", 3).expect_err("the old writer is refused");
        assert_eq!(stale.kind(), ErrorKind::Stale);
        // Even a writer newer than the last write but older than the read is refused.
        assert!(r.write("doc", 4).is_err());
        assert_eq!((r.seen(), r.written()), (5, 3));
        // A writer granted after the reader writes.
        r.write("doc", 6).expect("the newer writer writes");
    }

    #[test]
    fn a_stale_reader_is_refused_after_a_newer_writer_wrote() {
        let mut r = ReadWriteFence::new();
        r.read("doc", 2).expect("a reader reads");
        r.write("doc", 4).expect("a newer writer writes");
        let stale = r.read("doc", 2).expect_err("the old reader is refused");
        assert_eq!(stale.kind(), ErrorKind::Stale);
        assert!(r.read("doc", 3).is_err(), "older than the write");
        assert_eq!((r.seen(), r.written()), (4, 4));
    }

    #[test]
    fn readers_holding_together_all_read_in_any_order() {
        let mut r = ReadWriteFence::new();
        r.write("doc", 1).expect("written");
        for fence in [7, 5, 6, 7] {
            r.read("doc", fence)
                .expect("a reader of the same generation reads");
        }
        assert_eq!((r.seen(), r.written()), (7, 1));
        assert!(r.read("doc", 0).is_err(), "fence 0 is never a grant's");
    }
}
