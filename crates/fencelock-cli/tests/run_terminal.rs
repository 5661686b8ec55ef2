//! `fencelock run` on a terminal: the real binary in a pseudo-terminal of its own
//! (it is the session leader and the terminal's foreground group, as a command typed
//! at a shell prompt is), against a real `fencelock serve`.
//!
//! Run: `cargo test -p fencelock-cli --test it run_terminal::`

use crate::support;

use std::ffi::{CStr, OsStr};
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::FromRawFd;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Longest any step may take before the test fails instead of hanging.
const STEP: Duration = Duration::from_secs(30);

/// A pseudo-terminal's controlling side, and what the program wrote to it so far.
struct Terminal {
    master: File,
    output: mpsc::Receiver<Vec<u8>>,
    seen: String,
    child: Child,
}

impl Terminal {
    /// Starts `fencelock ARGS…` as the session leader of a new pseudo-terminal.
    fn spawn(args: &[&str]) -> Terminal {
        Terminal::spawn_program(support::BIN, args)
    }

    /// Starts `PROGRAM ARGS…` as the session leader of a new pseudo-terminal.
    fn spawn_program(program: &str, args: &[&str]) -> Terminal {
        // SAFETY: plain libc calls on descriptors this function owns; the name is
        // read from a NUL-terminated buffer ptsname_r filled.
        let (master, slave) = unsafe {
            let m = libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY);
            assert!(m >= 0, "posix_openpt: {}", std::io::Error::last_os_error());
            assert_eq!(libc::grantpt(m), 0);
            assert_eq!(libc::unlockpt(m), 0);
            let mut name = [0 as libc::c_char; 128];
            assert_eq!(libc::ptsname_r(m, name.as_mut_ptr(), name.len()), 0);
            let s = libc::open(
                CStr::from_ptr(name.as_ptr()).as_ptr(),
                libc::O_RDWR | libc::O_NOCTTY,
            );
            assert!(s >= 0, "open the pty: {}", std::io::Error::last_os_error());
            (File::from_raw_fd(m), File::from_raw_fd(s))
        };
        let mut command = Command::new(program);
        command
            .args(args)
            .env_remove("FENCELOCK_TOKEN")
            .env_remove("FENCELOCK_SERVER")
            .stdin(Stdio::from(slave.try_clone().unwrap()))
            .stdout(Stdio::from(slave.try_clone().unwrap()))
            .stderr(Stdio::from(slave));
        // SAFETY: setsid and ioctl are async-signal-safe; they make the pty the
        // child's controlling terminal, with the child's group in its foreground.
        unsafe {
            command.pre_exec(|| {
                if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command.spawn().expect("spawn fencelock in a pty");
        // The test's copies of the terminal side are gone: reads end (EIO) once
        // every process on the terminal has closed it.
        drop(command);
        let mut reader = master.try_clone().unwrap();
        let (tx, output) = mpsc::channel();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n @ 1..) = reader.read(&mut buf) {
                if tx.send(buf[..n].to_vec()).is_err() {
                    return;
                }
            }
        });
        Terminal {
            master,
            output,
            seen: String::new(),
            child,
        }
    }

    /// Waits until the terminal has shown `text`.
    fn expect(&mut self, text: &str) {
        let deadline = Instant::now() + STEP;
        while !self.seen.contains(text) {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.output.recv_timeout(left) {
                Ok(bytes) => self.seen.push_str(&String::from_utf8_lossy(&bytes)),
                Err(_) => panic!(
                    "the terminal never showed {text:?}; it shows {:?}",
                    self.seen
                ),
            }
        }
    }

    /// Types `text` at the terminal.
    fn type_in(&mut self, text: &str) {
        self.master.write_all(text.as_bytes()).unwrap();
    }

    /// The exit code of `fencelock`, waited for up to [`STEP`].
    fn exit_code(&mut self) -> Option<i32> {
        let deadline = Instant::now() + STEP;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.code();
            }
            assert!(
                Instant::now() < deadline,
                "fencelock did not exit; the terminal shows {:?}",
                self.seen
            );
            // Polling a child's exit: there is no exit notification to await here.
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Terminal {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Server {
    child: Child,
    url: String,
    _dir: tempfile::TempDir,
}

impl Server {
    fn start() -> Server {
        let dir = tempfile::tempdir().unwrap();
        let (child, addr) = support::serve([OsStr::new("--data-dir"), dir.path().as_os_str()]);
        Server {
            child,
            url: format!("http://{addr}"),
            _dir: dir,
        }
    }

    fn fencelock(&self, args: &[&str]) -> std::process::Output {
        Command::new(support::BIN)
            .args(args)
            .args(["--server", &self.url])
            .env_remove("FENCELOCK_TOKEN")
            .output()
            .unwrap()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A command that reads the terminal gets what is typed: it runs in the terminal's
/// foreground group (in a background group its read would stop it with SIGTTIN, and
/// `run` would renew the lock forever).
#[test]
fn an_interactive_command_reads_the_terminal() {
    let server = Server::start();
    let mut t = Terminal::spawn(&[
        "run",
        "tty:read",
        "--server",
        &server.url,
        "--",
        "sh",
        "-c",
        "printf 'name? '; read answer; echo \"hello $answer from $FENCELOCK_LOCK\"",
    ]);
    t.expect("name? ");
    t.type_in("fencelock\n");
    t.expect("hello fencelock from tty:read");
    assert_eq!(t.exit_code(), Some(0), "{}", t.seen);
    // Released when the command ended.
    let out = server.fencelock(&["show", "tty:read"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
}

/// Ctrl-C typed at the terminal reaches the command (the foreground group), which
/// ends; `run` exits with its code and releases the lock.
#[test]
fn ctrl_c_at_the_terminal_reaches_the_command() {
    let server = Server::start();
    let mut t = Terminal::spawn(&[
        "run",
        "tty:int",
        "--server",
        &server.url,
        "--",
        "sh",
        "-c",
        "trap 'echo interrupted; exit 3' INT; echo ready; while :; do sleep 0.05; done",
    ]);
    t.expect("ready");
    t.type_in("\x03");
    t.expect("interrupted");
    assert_eq!(t.exit_code(), Some(3), "{}", t.seen);
    let out = server.fencelock(&["show", "tty:int"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
}

/// `run` gives the terminal back when its command ends: a script that goes on to
/// read the terminal after `run` can (it would be outside the foreground group
/// otherwise, and its read would fail).
#[test]
fn the_terminal_is_given_back_when_the_command_ends() {
    let server = Server::start();
    let script = format!(
        "{} run tty:back --server {} -- sh -c 'echo inside'; echo next?; read answer; echo \"after $answer\"",
        support::BIN,
        server.url
    );
    let mut t = Terminal::spawn_program("sh", &["-c", &script]);
    t.expect("inside");
    t.expect("next?");
    t.type_in("run\n");
    t.expect("after run");
    assert_eq!(t.exit_code(), Some(0), "{}", t.seen);
}

/// The terminal does not make the command unstoppable: when the lock is lost while
/// it waits for input, it gets SIGTERM and `run` exits 75.
#[test]
fn an_interactive_command_is_still_stopped_when_the_lock_is_lost() {
    let server = Server::start();
    let dir = tempfile::tempdir().unwrap();
    let pid_file = dir.path().join("pid");
    let script = format!(
        "echo $$ > {}; echo ready; read answer; echo \"read $answer\"",
        pid_file.display()
    );
    let mut t = Terminal::spawn(&[
        "run",
        "tty:lost",
        "--ttl",
        "1s",
        "--grace",
        "1s",
        "--server",
        &server.url,
        "--",
        "sh",
        "-c",
        &script,
    ]);
    t.expect("ready");
    let out = server.fencelock(&["force-release", "tty:lost", "--reason", "test"]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(t.exit_code(), Some(75), "{}", t.seen);
    t.expect("lost");
    let pid: libc::pid_t = std::fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // SAFETY: kill with signal 0 only checks whether the process exists.
    let alive = unsafe { libc::kill(pid, 0) } == 0;
    assert!(!alive, "the command outlived its lock");
    assert!(!t.seen.contains("read "), "{}", t.seen);
}

/// Ctrl-Z stops the command; `run` takes the terminal back and stops itself (here,
/// a session leader with no shell above it, the kernel ignores that stop), and once
/// continued continues the command, which can read the terminal again.
#[test]
fn a_command_stopped_by_ctrl_z_is_continued_with_the_terminal() {
    let server = Server::start();
    let mut t = Terminal::spawn(&[
        "run",
        "tty:stop",
        "--server",
        &server.url,
        "--",
        "sh",
        "-c",
        "echo ready; read answer; echo \"got $answer\"",
    ]);
    t.expect("ready");
    t.type_in("\x1a");
    t.type_in("back\n");
    t.expect("got back");
    assert_eq!(t.exit_code(), Some(0), "{}", t.seen);
}
