//! CI smoke run of issue 22's workloads: the harness binary in `--smoke` mode runs W6
//! (4 clients, 95 % shared, 0.3 s) and the election failover (three candidate
//! processes, two `kill -9`s of the leader) against fencelock, etcd and ZooKeeper.
//! Proves that both run against real stores, that candidates are real processes whose
//! successors write through the fence with a larger term, and that the reader-writer
//! checker saw nothing wrong. Timing never decides: only errors, missing runs,
//! timeouts and violations fail it.
//!
//! Nothing is skipped: a missing peer (Debian `etcd-server`, `zookeeper`) or a missing
//! server binary fails the test with what to install or build.

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

const TARGETS: [&str; 3] = ["fencelock", "etcd", "zookeeper"];

/// The `fencelock` server binary: `fencelock-cli`'s, in this binary's target directory.
fn fencelock_bin() -> PathBuf {
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_fencelock-bench")).with_file_name("fencelock");
    assert!(
        bin.is_file(),
        "no fencelock server binary at {}: build it first (cargo build -p fencelock-cli)",
        bin.display()
    );
    bin
}

#[test]
fn w6_and_the_election_failover_run_against_every_store() {
    let out = tempfile::tempdir().expect("temporary directory");
    let output = Command::new(env!("CARGO_BIN_EXE_fencelock-bench"))
        .args(["run", "--smoke", "--fencelock-bin"])
        .arg(fencelock_bin())
        .args([
            "--targets",
            &TARGETS.join(","),
            "--workloads",
            "w6,election",
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
        let w6 = mine
            .iter()
            .find(|r| r["workload"] == "W6")
            .unwrap_or_else(|| panic!("no W6 result for {target}; messages:\n{stderr}"));
        assert!(w6["shared_grants"].as_u64().unwrap_or(0) > 0, "{w6}");
        assert_eq!(w6["overlaps"], 0, "{w6}");
        assert_eq!(w6["fence_decreases"], 0, "{w6}");
        let election = mine
            .iter()
            .find(|r| r["workload"] == "election")
            .unwrap_or_else(|| panic!("no election result for {target}; messages:\n{stderr}"));
        assert_eq!(election["rounds"], 2, "{election}");
        assert_eq!(election["timeouts"], 0, "{election}");
        assert_eq!(election["election_violations"], 0, "{election}");
        // Each new leader's term is above the killed one's, and the fence holds the
        // last leader's term.
        let terms = election["terms"].as_array().expect("terms");
        for pair in terms {
            let (old, new) = (pair[0].as_u64(), pair[1].as_u64());
            assert!(new > old, "{target}: term {new:?} after {old:?}");
        }
        assert_eq!(
            election["final_fence"],
            terms.last().expect("two rounds")[1],
            "{election}"
        );
    }
}
