//! Snapshot files: one checksummed blob per file, installed atomically.

use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::error::{LogError, LogErrorKind};
use crate::format::{
    decode_snapshot_header, encode_snapshot_header, snapshot_crc_ok, MAX_SNAPSHOT_BYTES,
    SNAPSHOT_HEADER_BYTES,
};
use crate::fsio::fdatasync;

/// Durably writes `state` to `path` in the snapshot format (see the crate docs):
/// writes `path` + `.tmp`, fdatasyncs it, renames it over `path`, then fsyncs the
/// parent directory. A crash leaves either the old file or the new one, never a mix.
///
/// Fails with [`LogErrorKind::TooLarge`] if `state` exceeds [`MAX_SNAPSHOT_BYTES`].
pub fn write_snapshot_file(path: &Path, state: &[u8]) -> Result<(), LogError> {
    write_snapshot_atomic(path, state, true)
}

/// Durably writes `state` as the snapshot of everything before segment `seq` of the
/// log in `dir` (`seq` as returned by [`crate::Log::start_segment`]): temp file,
/// fdatasync, rename, directory fsync (the syncs only if `fsync`). Safe to call from
/// another thread while the [`crate::Log`] keeps appending: it touches only its own
/// file. A crash part-way leaves a `*.tmp` file that the next open deletes.
pub fn write_snapshot_at(dir: &Path, seq: u64, state: &[u8], fsync: bool) -> Result<(), LogError> {
    write_snapshot_atomic(&crate::recover::snapshot_path(dir, seq), state, fsync)
}

/// Reads a snapshot file written by [`write_snapshot_file`] (or a `snap-*.snap`
/// file from a log directory) and returns its payload after checking magic,
/// version (1 or 2), length and checksum. Any mismatch is [`LogErrorKind::Corrupt`].
pub fn read_snapshot_file(path: &Path) -> Result<Vec<u8>, LogError> {
    read_snapshot_versioned(path).map(|(payload, _)| payload)
}

/// [`read_snapshot_file`], also returning the file's format version.
pub(crate) fn read_snapshot_versioned(path: &Path) -> Result<(Vec<u8>, u32), LogError> {
    let mut file = File::open(path).map_err(|e| LogError::io(path, "open snapshot", e))?;
    let file_len = file
        .metadata()
        .map_err(|e| LogError::io(path, "stat snapshot", e))?
        .len();
    if file_len < SNAPSHOT_HEADER_BYTES {
        return Err(LogError::corrupt(
            path,
            Some(0),
            format!("snapshot file is {file_len} bytes, shorter than its {SNAPSHOT_HEADER_BYTES}-byte header"),
        ));
    }
    if file_len - SNAPSHOT_HEADER_BYTES > MAX_SNAPSHOT_BYTES as u64 {
        return Err(LogError::corrupt(
            path,
            Some(0),
            format!("snapshot file is {file_len} bytes, more than MAX_SNAPSHOT_BYTES allows"),
        ));
    }
    let mut header = [0u8; SNAPSHOT_HEADER_BYTES as usize];
    file.read_exact(&mut header)
        .map_err(|e| LogError::io(path, "read snapshot header", e))?;
    let (len, version) =
        decode_snapshot_header(&header, file_len).map_err(|m| m.at(path, Some(0)))?;
    // The length was checked against the file size and MAX_SNAPSHOT_BYTES above.
    let mut payload = vec![0u8; len as usize];
    file.read_exact_at(&mut payload, SNAPSHOT_HEADER_BYTES)
        .map_err(|e| LogError::io(path, "read snapshot payload", e))?;
    if !snapshot_crc_ok(&header, &payload) {
        return Err(LogError::corrupt(
            path,
            Some(0),
            "snapshot checksum mismatch (the file was damaged after it was written)",
        ));
    }
    Ok((payload, version))
}

pub(crate) fn write_snapshot_atomic(
    path: &Path,
    state: &[u8],
    fsync: bool,
) -> Result<(), LogError> {
    if state.len() > MAX_SNAPSHOT_BYTES {
        return Err(LogError::new(
            LogErrorKind::TooLarge,
            Some(path),
            format!(
                "snapshot of {} bytes exceeds MAX_SNAPSHOT_BYTES ({MAX_SNAPSHOT_BYTES})",
                state.len()
            ),
        ));
    }
    let tmp = tmp_path(path);
    let file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&tmp)
        .map_err(|e| LogError::io(&tmp, "create snapshot temp file", e))?;
    let header = encode_snapshot_header(state);
    let written = file
        .write_all_at(&header, 0)
        .and_then(|()| file.write_all_at(state, SNAPSHOT_HEADER_BYTES))
        .and_then(|()| if fsync { fdatasync(&file) } else { Ok(()) });
    if let Err(e) = written {
        drop(file);
        let _ = fs::remove_file(&tmp);
        return Err(LogError::io(&tmp, "write snapshot temp file", e));
    }
    drop(file);
    fs::rename(&tmp, path).map_err(|e| LogError::io(path, "rename snapshot into place", e))?;
    if fsync {
        let parent = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        sync_dir(parent)?;
    }
    Ok(())
}

pub(crate) fn sync_dir(dir: &Path) -> Result<(), LogError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| LogError::io(dir, "fsync directory", e))
}

fn tmp_path(path: &Path) -> PathBuf {
    let mut name: OsString = path.as_os_str().to_owned();
    name.push(".tmp");
    PathBuf::from(name)
}
