//! The file gate: fenced whole-file replacement in one directory.
//!
//! # On-disk layout
//!
//! For a file `NAME` in the gate's directory:
//!
//! | path | content |
//! |---|---|
//! | `NAME` | the data of the last completed write; readers just read it |
//! | `.NAME.fence` | the last accepted fence: `fencelock-fence 1\n<decimal fence>\n` |
//! | `.NAME.lock` | empty; `flock(2)`ed exclusively around every check + write |
//! | `.NAME.data-tmp`, `.NAME.fence-tmp` | a write in progress (or left by a crash) |
//!
//! The four suffixes differ in their last characters (`k`, `e`, `a-tmp`, `e-tmp`), so
//! the gate's files of two different names never coincide (`a` and `a.fence` included).
//!
//! # A write, step by step
//!
//! Before taking the lock (so a slow `fsync` of a large file never holds up the
//! other writers of the same name):
//!
//! 0. Refuse the write at once if `.NAME.fence` already holds a fence at least as
//!    large (recorded fences only grow, so it can only stay stale). Write the data
//!    and the fence record into two files without a name (`O_TMPFILE`) and `fsync`
//!    both: a writer that dies here leaves nothing behind.
//!
//! Holding the lock:
//!
//! 1. Read `.NAME.fence`; refuse the write as stale unless its fence is greater.
//! 2. Link the synced data in as `.NAME.data-tmp`.
//! 3. Link the synced fence record in as `.NAME.fence-tmp`, rename it over
//!    `.NAME.fence`, `fsync` the directory: **the new fence is durable before the data
//!    is visible.**
//! 4. Rename `.NAME.data-tmp` over `NAME`.
//!
//! Then, without the lock, `fsync` the directory and return. The directory `fsync`
//! of step 3 stays under the lock: it orders the fence before the data, and the
//! renames must be ordered against the next writer's. Where `O_TMPFILE` or linking
//! it by `/proc/self/fd` is not available, steps 0 and 2–3 write and `fsync` the
//! `-tmp` files under the lock instead, as one writer at a time must.
//!
//! A crash anywhere leaves `NAME` either old or new, never partial (rename is atomic).
//! A crash between 3 and 4 leaves the old data with the *new* fence recorded: that
//! write is lost (it was never acknowledged), and every writer with a fence up to the
//! new one is still refused, so a stale writer can never install older data than what
//! a newer writer may already have produced. Recording the fence *after* the rename
//! would open the opposite window: new data on disk, old fence recorded, and a stale
//! writer accepted on top of it.
//!
//! The lock is an `flock` on a file that is never deleted, so it excludes writers in
//! other threads and other processes on the same machine, and the kernel releases it
//! when a writer dies. (`flock` over NFS is not reliable: keep the directory local.)

use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind as IoErrorKind, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::{ErrorKind, FenceError, FenceGate, GateMetrics};

/// The first line of every fence record.
const RECORD_HEADER: &str = "fencelock-fence 1";

/// Longest accepted file name, in bytes (room for the `.NAME.fence-tmp` suffixes).
const MAX_NAME_LEN: usize = 200;

/// Fenced writes of whole files in one directory (see the [module docs](self) for the
/// layout and the crash analysis).
///
/// Each write replaces the file atomically (temp file, `fsync`, rename, `fsync` of the
/// directory) if its fence is greater than the last one accepted for that file. Safe
/// across threads and processes on one machine, and across crashes. Cloning gives
/// another handle to the same directory and counter.
///
/// The methods do blocking file I/O; [`FenceGate::apply`] runs them on tokio's blocking
/// pool (it needs a tokio runtime).
#[derive(Clone, Debug)]
pub struct FileGate {
    inner: Arc<Inner>,
}

struct Inner {
    name: String,
    dir: PathBuf,
    stale_rejections: AtomicU64,
    /// Test hook: stop a write right after this step, as a crash would.
    #[cfg(test)]
    crash_after: std::sync::Mutex<Option<Step>>,
    /// Test hook: runs once a write's data is synced, before it takes the lock.
    #[cfg(test)]
    synced: std::sync::Mutex<Option<Arc<dyn Fn() + Send + Sync>>>,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileGate")
            .field("name", &self.name)
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

/// The steps of a write, for the crash tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    DataSynced,
    FenceRecorded,
}

impl FileGate {
    /// A gate for the files in `dir` (which must exist), named `"file"`.
    pub fn new(dir: impl Into<PathBuf>) -> Result<FileGate, FenceError> {
        FileGate::named("file", dir)
    }

    /// Like [`new`](FileGate::new), with a name for metrics.
    pub fn named(name: impl Into<String>, dir: impl Into<PathBuf>) -> Result<FileGate, FenceError> {
        let dir = dir.into();
        let meta = fs::metadata(&dir).map_err(|e| io_error("open the directory", &dir, e))?;
        if !meta.is_dir() {
            return Err(FenceError::new(
                ErrorKind::InvalidInput,
                format!("{} is not a directory", dir.display()),
            ));
        }
        Ok(FileGate {
            inner: Arc::new(Inner {
                name: name.into(),
                dir,
                stale_rejections: AtomicU64::new(0),
                #[cfg(test)]
                crash_after: std::sync::Mutex::new(None),
                #[cfg(test)]
                synced: std::sync::Mutex::new(None),
            }),
        })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.inner.dir
    }

    /// The path of the data file `name`.
    pub fn path(&self, name: &str) -> Result<PathBuf, FenceError> {
        check_name(name)?;
        Ok(self.inner.dir.join(name))
    }

    /// Replaces the file `name` with `data` if `fence` is greater than the last fence
    /// accepted for it. Returns once the new contents and fence are durable.
    ///
    /// Errors: [`ErrorKind::Stale`] (nothing changed), [`ErrorKind::InvalidInput`] for a
    /// name that is empty, too long, starts with `.`, or contains `/` or NUL,
    /// [`ErrorKind::Corrupt`] for an unreadable fence record, [`ErrorKind::Io`].
    pub fn write(&self, name: &str, fence: u64, data: &[u8]) -> Result<(), FenceError> {
        check_name(name)?;
        let dir = &self.inner.dir;
        // A stale write is refused before its data costs an fsync.
        self.refuse_stale(name, fence)?;
        let record = format!("{RECORD_HEADER}\n{fence}\n");
        // The slow part, without the lock: other writers go on meanwhile.
        let staged_data = stage(dir, data)?;
        let staged_record = stage(dir, record.as_bytes())?;
        self.sync_hook();

        let lock = self.lock(name)?;
        self.refuse_stale(name, fence)?;

        let paths = Paths::new(dir, name);
        install(staged_data.as_ref(), data, &paths.data_tmp)?;
        self.crash_point(Step::DataSynced)?;

        install(staged_record.as_ref(), record.as_bytes(), &paths.record_tmp)?;
        rename(&paths.record_tmp, &paths.record)?;
        sync_dir(dir)?;
        self.crash_point(Step::FenceRecorded)?;

        rename(&paths.data_tmp, &paths.data)?;
        drop(lock);
        // Durable before it is acknowledged; a newer writer may already have
        // replaced it, which its own directory fsync makes durable in turn.
        sync_dir(dir)
    }

    /// Refuses `fence` unless it is greater than the last fence accepted for `name`.
    fn refuse_stale(&self, name: &str, fence: u64) -> Result<(), FenceError> {
        let last = self.read_record(name)?;
        if fence <= last.unwrap_or(0) {
            self.inner.stale_rejections.fetch_add(1, Ordering::Relaxed);
            return Err(FenceError::stale(
                &format_args!("file {:?}", self.inner.dir.join(name)),
                fence,
                Some(last.unwrap_or(0)),
            ));
        }
        Ok(())
    }

    /// The contents of the file `name` (`None` if no write completed yet).
    pub fn read(&self, name: &str) -> Result<Option<Vec<u8>>, FenceError> {
        let path = self.path(name)?;
        match fs::read(&path) {
            Ok(data) => Ok(Some(data)),
            Err(e) if e.kind() == IoErrorKind::NotFound => Ok(None),
            Err(e) => Err(io_error("read", &path, e)),
        }
    }

    /// The last fence accepted for `name` (`None` if none). After a crash in the middle
    /// of a write this can be newer than the fence of the data in the file.
    pub fn last_fence(&self, name: &str) -> Result<Option<u64>, FenceError> {
        check_name(name)?;
        self.read_record(name)
    }

    /// Takes the writers' lock for `name`; released when the returned file is closed.
    fn lock(&self, name: &str) -> Result<File, FenceError> {
        let path = Paths::new(&self.inner.dir, name).lock;
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| io_error("open the lock file", &path, e))?;
        loop {
            // SAFETY: a valid open file descriptor, owned by `file`.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } == 0 {
                return Ok(file);
            }
            let err = std::io::Error::last_os_error();
            if err.kind() != IoErrorKind::Interrupted {
                return Err(io_error("flock", &path, err));
            }
        }
    }

    fn read_record(&self, name: &str) -> Result<Option<u64>, FenceError> {
        let path = Paths::new(&self.inner.dir, name).record;
        let text = match fs::read(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == IoErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_error("read the fence record", &path, e)),
        };
        parse_record(&text).map(Some).ok_or_else(|| {
            FenceError::new(
                ErrorKind::Corrupt,
                format!(
                    "fence record {} is corrupt (expected \"{RECORD_HEADER}\\n<fence>\\n\"); \
                     refusing to write rather than guess the last fence",
                    path.display()
                ),
            )
        })
    }

    #[cfg(test)]
    pub(crate) fn crash_after(&self, step: Option<Step>) {
        *self.inner.crash_after.lock().unwrap() = step;
    }

    #[cfg(test)]
    fn crash_point(&self, step: Step) -> Result<(), FenceError> {
        if *self.inner.crash_after.lock().unwrap() == Some(step) {
            return Err(FenceError::new(
                ErrorKind::Io,
                format!("simulated crash after {step:?}"),
            ));
        }
        Ok(())
    }

    #[cfg(not(test))]
    #[inline(always)]
    fn crash_point(&self, _step: Step) -> Result<(), FenceError> {
        Ok(())
    }

    #[cfg(test)]
    pub(crate) fn on_synced(&self, hook: Option<Arc<dyn Fn() + Send + Sync>>) {
        *self.inner.synced.lock().unwrap() = hook;
    }

    #[cfg(test)]
    fn sync_hook(&self) {
        // Called without holding the mutex: the hook may wait for the test.
        let hook = self.inner.synced.lock().unwrap().clone();
        if let Some(hook) = hook {
            hook();
        }
    }

    #[cfg(not(test))]
    #[inline(always)]
    fn sync_hook(&self) {}
}

impl GateMetrics for FileGate {
    fn name(&self) -> &str {
        &self.inner.name
    }

    fn stale_rejections(&self) -> u64 {
        self.inner.stale_rejections.load(Ordering::Relaxed)
    }
}

impl FenceGate for FileGate {
    type Key = str;
    type Write = Vec<u8>;
    type Applied = ();

    /// [`FileGate::write`] on tokio's blocking thread pool.
    fn apply(
        &self,
        key: &str,
        fence: u64,
        write: Vec<u8>,
    ) -> impl std::future::Future<Output = Result<(), FenceError>> + Send {
        let gate = self.clone();
        let name = key.to_owned();
        async move {
            tokio::task::spawn_blocking(move || gate.write(&name, fence, &write))
                .await
                .map_err(|e| {
                    FenceError::new(ErrorKind::Io, format!("file write task failed: {e}"))
                })?
        }
    }
}

/// Where the gate keeps the files of one name (see the module docs).
struct Paths {
    data: PathBuf,
    data_tmp: PathBuf,
    record: PathBuf,
    record_tmp: PathBuf,
    lock: PathBuf,
}

impl Paths {
    fn new(dir: &Path, name: &str) -> Paths {
        Paths {
            data: dir.join(name),
            data_tmp: dir.join(format!(".{name}.data-tmp")),
            record: dir.join(format!(".{name}.fence")),
            record_tmp: dir.join(format!(".{name}.fence-tmp")),
            lock: dir.join(format!(".{name}.lock")),
        }
    }

    #[cfg(test)]
    fn all(&self) -> [&PathBuf; 5] {
        [
            &self.data,
            &self.data_tmp,
            &self.record,
            &self.record_tmp,
            &self.lock,
        ]
    }
}

fn parse_record(text: &[u8]) -> Option<u64> {
    let text = std::str::from_utf8(text).ok()?;
    let rest = text.strip_prefix(RECORD_HEADER)?.strip_prefix('\n')?;
    let digits = rest.strip_suffix('\n')?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

fn check_name(name: &str) -> Result<(), FenceError> {
    let problem = if name.is_empty() {
        Some("is empty")
    } else if name.len() > MAX_NAME_LEN {
        Some("is longer than 200 bytes")
    } else if name.starts_with('.') {
        Some("starts with '.' (reserved for the gate's own files)")
    } else if name.contains('/') || name.contains('\0') {
        Some("contains '/' or NUL (must be a plain file name)")
    } else {
        None
    };
    match problem {
        Some(problem) => Err(FenceError::new(
            ErrorKind::InvalidInput,
            format!("file name {name:?} {problem}"),
        )),
        None => Ok(()),
    }
}

fn write_synced(path: &Path, data: &[u8]) -> Result<(), FenceError> {
    let mut file = File::create(path).map_err(|e| io_error("create", path, e))?;
    file.write_all(data)
        .map_err(|e| io_error("write", path, e))?;
    file.sync_all().map_err(|e| io_error("fsync", path, e))
}

/// Writes `data` into a new file without a name in `dir` and fsyncs it (`O_TMPFILE`):
/// nothing is left behind if the writer dies before [`install`] links it in.
/// `None` where the file system or kernel has no `O_TMPFILE`.
fn stage(dir: &Path, data: &[u8]) -> Result<Option<File>, FenceError> {
    use std::os::unix::fs::OpenOptionsExt;
    let opened = OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_TMPFILE)
        .open(dir);
    let mut file = match opened {
        Ok(file) => file,
        // No O_TMPFILE here: an old kernel reads it as O_DIRECTORY (EISDIR), some
        // file systems refuse it.
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::EOPNOTSUPP | libc::EISDIR | libc::EINVAL)
            ) =>
        {
            return Ok(None)
        }
        Err(e) => return Err(io_error("create a staging file in", dir, e)),
    };
    file.write_all(data)
        .map_err(|e| io_error("write a staging file in", dir, e))?;
    file.sync_all()
        .map_err(|e| io_error("fsync a staging file in", dir, e))?;
    Ok(Some(file))
}

/// Puts the staged file at `to` (a `-tmp` name only writers holding the lock use),
/// or, without one, writes `data` there and fsyncs it.
fn install(staged: Option<&File>, data: &[u8], to: &Path) -> Result<(), FenceError> {
    let Some(file) = staged else {
        return write_synced(to, data);
    };
    match fs::remove_file(to) {
        Ok(()) => {}
        Err(e) if e.kind() == IoErrorKind::NotFound => {}
        Err(e) => return Err(io_error("remove the leftover", to, e)),
    }
    let from = format!("/proc/self/fd/{}", file.as_raw_fd());
    let (Ok(from), Ok(to_c)) = (
        std::ffi::CString::new(from),
        std::ffi::CString::new(to.as_os_str().as_bytes()),
    ) else {
        // A path with NUL cannot come from check_name; write it the plain way.
        return write_synced(to, data);
    };
    // SAFETY: both are valid NUL-terminated paths that outlive the call.
    let linked = unsafe {
        libc::linkat(
            libc::AT_FDCWD,
            from.as_ptr(),
            libc::AT_FDCWD,
            to_c.as_ptr(),
            libc::AT_SYMLINK_FOLLOW,
        )
    };
    if linked == 0 {
        return Ok(());
    }
    // No /proc, or linking refused: the plain way (holding the lock) still works.
    write_synced(to, data)
}

fn rename(from: &Path, to: &Path) -> Result<(), FenceError> {
    fs::rename(from, to).map_err(|e| io_error(&format!("rename {} to", from.display()), to, e))
}

fn sync_dir(dir: &Path) -> Result<(), FenceError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io_error("fsync the directory", dir, e))
}

fn io_error(what: &str, path: &Path, err: std::io::Error) -> FenceError {
    FenceError::new(ErrorKind::Io, format!("{what} {}", path.display())).with_source(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gate() -> (tempfile::TempDir, FileGate) {
        let dir = tempfile::tempdir().unwrap();
        let gate = FileGate::new(dir.path()).unwrap();
        (dir, gate)
    }

    /// The crash the ordering exists for: the new fence is recorded, the data rename
    /// never happened. The old data stays, every fence up to the recorded one is
    /// refused, and the next newer write cleans up and applies.
    #[test]
    fn crash_after_fence_recorded_before_rename_refuses_stale_writers() {
        let (_dir, gate) = gate();
        gate.write("report.csv", 3, b"from fence 3").unwrap();

        gate.crash_after(Some(Step::FenceRecorded));
        let crashed = gate.write("report.csv", 9, b"from fence 9").unwrap_err();
        assert!(crashed.to_string().contains("simulated crash"), "{crashed}");
        gate.crash_after(None);

        // On disk: old data, new fence, the unrenamed temp file.
        assert_eq!(gate.read("report.csv").unwrap().unwrap(), b"from fence 3");
        assert_eq!(gate.last_fence("report.csv").unwrap(), Some(9));
        assert!(gate.dir().join(".report.csv.data-tmp").exists());

        // A writer whose fence lies between the data's and the recorded one is stale.
        for fence in [4, 8, 9] {
            let err = gate.write("report.csv", fence, b"stale").unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Stale, "fence {fence}: {err}");
            assert_eq!(err.last_fence(), Some(9));
        }
        assert_eq!(gate.read("report.csv").unwrap().unwrap(), b"from fence 3");
        assert_eq!(gate.stale_rejections(), 3);

        gate.write("report.csv", 10, b"from fence 10").unwrap();
        assert_eq!(gate.read("report.csv").unwrap().unwrap(), b"from fence 10");
        assert_eq!(gate.last_fence("report.csv").unwrap(), Some(10));
        assert!(!gate.dir().join(".report.csv.data-tmp").exists());
    }

    /// A crash before the fence is recorded loses the write and changes nothing else:
    /// the same fence can still be applied afterwards.
    #[test]
    fn crash_after_data_synced_changes_nothing() {
        let (_dir, gate) = gate();
        gate.write("f", 3, b"three").unwrap();
        gate.crash_after(Some(Step::DataSynced));
        gate.write("f", 5, b"five").unwrap_err();
        gate.crash_after(None);
        assert_eq!(gate.read("f").unwrap().unwrap(), b"three");
        assert_eq!(gate.last_fence("f").unwrap(), Some(3));
        gate.write("f", 5, b"five").unwrap();
        assert_eq!(gate.read("f").unwrap().unwrap(), b"five");
    }

    /// The lock is not held while a write's data is fsynced: with one writer parked
    /// right after its sync (where a slow disk keeps it), the name's lock is free
    /// and a second writer of the same name completes.
    #[test]
    fn a_slow_sync_does_not_block_the_other_writers() {
        let (_dir, gate) = gate();
        let (parked_tx, parked_rx) = std::sync::mpsc::channel();
        let parked_tx = std::sync::Mutex::new(parked_tx);
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let go_rx = std::sync::Mutex::new(go_rx);
        gate.on_synced(Some(Arc::new(move || {
            let _ = parked_tx.lock().unwrap().send(());
            let _ = go_rx.lock().unwrap().recv();
        })));
        let slow = {
            let gate = gate.clone();
            std::thread::spawn(move || gate.write("f", 10, b"slow, newer"))
        };
        parked_rx.recv().expect("the slow writer synced its data");
        gate.on_synced(None);

        // The lock is free (a non-blocking flock gets it) ...
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(gate.dir().join(".f.lock"))
            .unwrap();
        // SAFETY: a valid open file descriptor, owned by `lock`.
        let taken = unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        assert_eq!(taken, 0, "the lock is held during another writer's sync");
        drop(lock);
        // ... so another writer of the same name goes through meanwhile.
        gate.write("f", 5, b"fast, older").unwrap();
        assert_eq!(gate.read("f").unwrap().unwrap(), b"fast, older");

        go_tx.send(()).unwrap();
        slow.join().unwrap().unwrap();
        assert_eq!(gate.read("f").unwrap().unwrap(), b"slow, newer");
        assert_eq!(gate.last_fence("f").unwrap(), Some(10));
        // Nothing staged is left behind.
        let names: Vec<_> = fs::read_dir(gate.dir())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        let mut names = names;
        names.sort();
        assert_eq!(names, [".f.fence", ".f.lock", "f"]);
    }

    #[test]
    fn corrupt_fence_record_refuses_writes() {
        let (_dir, gate) = gate();
        gate.write("f", 3, b"three").unwrap();
        for bad in [
            &b""[..],
            b"fencelock-fence 1\n",
            b"fencelock-fence 1\n12x\n",
            b"7\n",
        ] {
            fs::write(gate.dir().join(".f.fence"), bad).unwrap();
            let err = gate.write("f", 100, b"new").unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Corrupt, "{bad:?}: {err}");
            assert_eq!(gate.read("f").unwrap().unwrap(), b"three");
        }
    }

    #[test]
    fn names_must_be_plain_file_names() {
        let (_dir, gate) = gate();
        let long = "x".repeat(201);
        for name in ["", ".hidden", "a/b", "..", "a\0b", long.as_str()] {
            let err = gate.write(name, 1, b"x").unwrap_err();
            assert_eq!(err.kind(), ErrorKind::InvalidInput, "{name:?}");
        }
        gate.write(&"x".repeat(200), 1, b"x").unwrap();
    }

    /// Regression: with `.NAME.tmp` for data and `.NAME.fence.tmp` for the record, the
    /// record temp file of `a` was the data temp file of `a.fence`, and concurrent
    /// writes of the two names clobbered each other.
    #[test]
    fn files_of_different_names_never_coincide() {
        let dir = Path::new("/d");
        let names = [
            "a",
            "a.fence",
            "a.lock",
            "a.data-tmp",
            "a.fence-tmp",
            "a.tmp",
            "a.fence.tmp",
            "a.data",
            "a-tmp",
            "a.fence-",
            "fence",
            "lock",
            "a.fence.fence",
            "a.lock.fence",
        ];
        let mut seen = std::collections::HashMap::new();
        for name in names {
            for path in Paths::new(dir, name).all() {
                if let Some(other) = seen.insert(path.clone(), name) {
                    panic!("{} is used by both {other:?} and {name:?}", path.display());
                }
            }
        }
    }

    #[test]
    fn record_parser_accepts_only_the_documented_format() {
        assert_eq!(parse_record(b"fencelock-fence 1\n42\n"), Some(42));
        assert_eq!(
            parse_record(format!("fencelock-fence 1\n{}\n", u64::MAX).as_bytes()),
            Some(u64::MAX)
        );
        for bad in [
            &b"fencelock-fence 1\n42"[..],
            b"fencelock-fence 1\n+42\n",
            b"fencelock-fence 1\n 42\n",
            b"fencelock-fence 2\n42\n",
            b"fencelock-fence 1\n18446744073709551616\n",
        ] {
            assert_eq!(
                parse_record(bad),
                None,
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}
