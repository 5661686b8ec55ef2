//! The file gate: stale writes are refused and change nothing, across threads and
//! across processes; the largest fence's contents win.

use crate::support;

use std::process::Command;

use fencelock_fence::{ErrorKind, FenceGate, FileGate, GateMetrics};
use support::Rng;

#[tokio::test]
async fn stale_write_is_refused_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let gate = FileGate::named("reports", dir.path()).unwrap();
    assert_eq!(gate.read("report.csv").unwrap(), None);
    gate.apply("report.csv", 5, b"v5".to_vec()).await.unwrap();
    for stale in [5, 2] {
        let err = gate
            .apply("report.csv", stale, b"stale".to_vec())
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Stale, "{err}");
        assert_eq!(err.last_fence(), Some(5));
    }
    assert_eq!(gate.read("report.csv").unwrap().unwrap(), b"v5");
    assert_eq!(gate.stale_rejections(), 2);
    gate.apply("report.csv", 7, b"v7".to_vec()).await.unwrap();
    assert_eq!(std::fs::read(dir.path().join("report.csv")).unwrap(), b"v7");
    assert_eq!(gate.last_fence("report.csv").unwrap(), Some(7));
    // The documented layout: data, fence record, lock file; no temp files left.
    let mut names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [".report.csv.fence", ".report.csv.lock", "report.csv"]
    );
    assert_eq!(
        std::fs::read_to_string(dir.path().join(".report.csv.fence")).unwrap(),
        "fencelock-fence 1\n7\n"
    );
}

#[test]
fn threads_with_their_own_handles_end_with_the_largest_fence() {
    let mut rng = Rng::from_env("file threads");
    let dir = tempfile::tempdir().unwrap();
    let fences: Vec<Vec<u64>> = (0..6).map(|_| rng.fences(15, 60)).collect();
    let max = *fences.iter().flatten().max().unwrap();
    std::thread::scope(|s| {
        for mine in &fences {
            // A separate handle per thread: only the lock file coordinates them.
            let gate = FileGate::new(dir.path()).unwrap();
            s.spawn(move || {
                for &fence in mine {
                    write_checked(&gate, fence);
                }
            });
        }
    });
    let gate = FileGate::new(dir.path()).unwrap();
    assert_eq!(
        gate.read("shared").unwrap().unwrap(),
        max.to_string().as_bytes()
    );
    assert_eq!(gate.last_fence("shared").unwrap(), Some(max));
}

/// Writes `fence` as the contents of `shared`; a refusal must be a stale one.
fn write_checked(gate: &FileGate, fence: u64) {
    match gate.write("shared", fence, fence.to_string().as_bytes()) {
        Ok(()) => {}
        Err(e) => {
            assert_eq!(e.kind(), ErrorKind::Stale, "{e}");
            assert!(e.last_fence().unwrap() >= fence, "{e}");
        }
    }
}

const CHILD_DIR: &str = "FENCE_TEST_CHILD_DIR";
const CHILD_FENCES: &str = "FENCE_TEST_CHILD_FENCES";

/// Three processes (this test and two copies of it started as children) write random
/// fences to one file. Each refusal must be stale, and the file ends with the largest
/// fence of all. Run as a child, the same test does its share of writes and checks.
#[test]
fn processes_end_with_the_largest_fence() {
    if let (Ok(dir), Ok(fences)) = (std::env::var(CHILD_DIR), std::env::var(CHILD_FENCES)) {
        let gate = FileGate::new(&dir).unwrap();
        for fence in fences.split(',') {
            write_checked(&gate, fence.parse().unwrap());
        }
        // Proof for the parent that this child really ran its share.
        let done = std::path::Path::new(&dir).join(format!("done-{}", std::process::id()));
        std::fs::write(done, b"").unwrap();
        return;
    }
    let mut rng = Rng::from_env("file processes");
    let dir = tempfile::tempdir().unwrap();
    let shares: Vec<Vec<u64>> = (0..3).map(|_| rng.fences(25, 100)).collect();
    let max = *shares.iter().flatten().max().unwrap();
    let exe = std::env::current_exe().unwrap();
    // The test's own name in its binary (`file::…` in `tests/it.rs`), for `--exact`.
    let module = module_path!().split_once("::").map_or("", |(_, m)| m);
    let this_test = format!("{module}::processes_end_with_the_largest_fence");
    let children: Vec<_> = shares[1..]
        .iter()
        .map(|share| {
            let list: Vec<String> = share.iter().map(u64::to_string).collect();
            Command::new(&exe)
                .args(["--exact", &this_test, "--test-threads=1"])
                .env(CHILD_DIR, dir.path())
                .env(CHILD_FENCES, list.join(","))
                .stdout(std::process::Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    let gate = FileGate::new(dir.path()).unwrap();
    for &fence in &shares[0] {
        write_checked(&gate, fence);
    }
    for mut child in children {
        let status = child.wait().unwrap();
        assert!(status.success(), "a child writer failed: {status}");
    }
    let done = std::fs::read_dir(dir.path())
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with("done-")
        })
        .count();
    assert_eq!(done, 2, "both child writers must have run");
    assert_eq!(
        gate.read("shared").unwrap().unwrap(),
        max.to_string().as_bytes()
    );
    assert_eq!(gate.last_fence("shared").unwrap(), Some(max));
}
