//! Thin wrappers over the few system calls the log needs beyond `std`.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;

const ZERO_CHUNK_BYTES: usize = 1 << 20;

/// `fdatasync(2)`: flushes the file's data and the metadata needed to read it back.
pub(crate) fn fdatasync(file: &File) -> io::Result<()> {
    // SAFETY: the descriptor is owned by `file` and open for the duration of the call.
    let rc = unsafe { libc::fdatasync(file.as_raw_fd()) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Allocates `[0, len)` so later writes overwrite allocated blocks instead of growing
/// the file. Uses `posix_fallocate`; if the filesystem does not support it, writes zeros.
pub(crate) fn preallocate(file: &File, len: u64) -> io::Result<()> {
    let off_len = libc::off_t::try_from(len)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "segment too large"))?;
    // SAFETY: plain syscall on an owned, open descriptor; no pointers involved.
    let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, off_len) };
    match rc {
        0 => Ok(()),
        libc::EOPNOTSUPP | libc::EINVAL => write_zeros(file, 0, len),
        errno => Err(io::Error::from_raw_os_error(errno)),
    }
}

/// Overwrites `[start, end)` with zeros.
pub(crate) fn write_zeros(file: &File, start: u64, end: u64) -> io::Result<()> {
    let zeros = vec![0u8; ZERO_CHUNK_BYTES.min((end.saturating_sub(start)) as usize)];
    let mut off = start;
    while off < end {
        let n = (end - off).min(zeros.len() as u64) as usize;
        file.write_all_at(&zeros[..n], off)?;
        off += n as u64;
    }
    Ok(())
}

/// Takes an exclusive, non-blocking `flock` on the directory. Returns
/// `Ok(false)` if another open file description already holds it.
pub(crate) fn try_lock_exclusive(dir: &File) -> io::Result<bool> {
    // SAFETY: plain syscall on an owned, open descriptor.
    let rc = unsafe { libc::flock(dir.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc == 0 {
        return Ok(true);
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(false)
    } else {
        Err(err)
    }
}
