//! CI smoke run of the three-member targets (`fencelock-3`, `etcd-3`, `zk-3`): the
//! harness binary in `--smoke` mode (tiny sizes, one leader kill each), against real
//! clusters. Proves that the clusters start, that W1–W3 and the failover rounds run
//! against each, and that the checker saw nothing wrong in fencelock. Timing never
//! decides: only errors, missing runs and violations fail it.
//!
//! Nothing is skipped: a missing peer (Debian `etcd-server`, `zookeeper`; `.ci/run`
//! installs both through `scripts/install-peers.sh`) or a missing server binary fails
//! the test with what to install or build.

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

const TARGETS: [&str; 3] = ["fencelock-3", "etcd-3", "zk-3"];

/// The `fencelock` server binary: `fencelock-cli`'s, in this binary's target directory.
fn fencelock_bin() -> PathBuf {
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_fencelock-bench")).with_file_name("fencelock");
    assert!(
        bin.is_file(),
        "no fencelock server binary at {}: build it first (cargo build -p fencelock-cli; \
         `cargo test --workspace` builds it)",
        bin.display()
    );
    bin
}

#[test]
fn cluster_targets_run_w1_to_w3_and_a_leader_kill_each() {
    let bin = fencelock_bin();
    let out = tempfile::tempdir().expect("temporary directory");
    let output = Command::new(env!("CARGO_BIN_EXE_fencelock-bench"))
        .args(["run", "--smoke", "--fencelock-bin"])
        .arg(&bin)
        .args([
            "--targets",
            &TARGETS.join(","),
            "--workloads",
            "w1,w2,w3,failover",
            "--out",
        ])
        .arg(out.path())
        .output()
        .expect("run fencelock-bench");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "fencelock-bench failed ({}); its messages:\n{stderr}",
        output.status
    );
    let text = std::fs::read_to_string(out.path().join("results.jsonl")).expect("results.jsonl");
    let runs: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    for target in TARGETS {
        let mine: Vec<&Value> = runs.iter().filter(|r| r["target"] == target).collect();
        if let Some(failed) = mine.iter().find(|r| r["error"].is_string()) {
            panic!("{target} failed: {}", failed["error"]);
        }
        for workload in ["W1", "W2", "W3", "failover"] {
            assert!(
                mine.iter().any(|r| r["workload"] == workload),
                "no {workload} result for {target}; messages:\n{stderr}"
            );
        }
        let failover = mine
            .iter()
            .find(|r| r["workload"] == "failover")
            .expect("checked above");
        assert_eq!(failover["kills"], 1, "{target}: {failover}");
    }
    for r in runs.iter().filter(|r| r["target"] == "fencelock-3") {
        assert_eq!(r["overlaps"].as_u64().unwrap_or(0), 0, "{r}");
        assert_eq!(r["fence_decreases"].as_u64().unwrap_or(0), 0, "{r}");
        if r["workload"] == "failover" {
            // The new leader granted a new key within the probe's bound.
            assert_eq!(r["timeouts"], 0, "{r}");
        } else if r["workload"].as_str().is_some_and(|w| w.starts_with('W')) {
            assert!(
                r["errors"].as_u64().unwrap_or(0) == 0
                    && r["server_fifo_inversions"].as_u64().unwrap_or(0) == 0,
                "{r}"
            );
        }
    }
}
