//! The harnesses' planted bugs (`FENCELOCK_FUZZ_PLANT`, see the crate docs).
//!
//! - No seed reaches a planted bug, so a fuzz run that reports one has *searched*
//!   for it (`scripts/fuzz.sh --planted 20` must crash every target).
//! - The inputs such a run found, committed in `fuzz/planted/<target>/`, still
//!   reach it: a harness that stopped getting through its decoder fails here.
//!   (`config/hand-written-*` was written by hand: in 20 s runs libFuzzer did not
//!   find the config target's planted bug. `log_dir/hand-written-*` replaced the
//!   found input when log format version 2 changed what the harness's bytes mean;
//!   since `log.durable` refuses a flip in the final synced batch after a process
//!   crash, it also deletes `log.durable`, as a power loss can lose its last write.)

use crate::support;

use support::{seeds, Harness, TARGETS};

/// Runs `input`; `Some(message)` if it panicked.
fn panics(harness: Harness, input: &[u8]) -> Option<String> {
    std::panic::catch_unwind(|| harness(input)).err().map(|e| {
        e.downcast_ref::<String>()
            .cloned()
            .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default()
    })
}

#[test]
fn seeds_miss_every_planted_bug_and_the_fuzzers_finds_still_reach_it() {
    // Set before any harness runs: the flag is read once per process.
    std::env::set_var("FENCELOCK_FUZZ_PLANT", "all");
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let mut problems = Vec::new();
    // The found inputs first: the api targets share one engine per process, and
    // a seed holding a lock could make a found acquire of it fail.
    for (target, harness) in TARGETS {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../fuzz/planted")
            .join(target);
        let found: Vec<_> = std::fs::read_dir(&dir)
            .map(|d| d.map(|e| e.unwrap().path()).collect())
            .unwrap_or_default();
        if found.is_empty() {
            problems.push(format!(
                "{target}: no planted-bug input in {}",
                dir.display()
            ));
        }
        for path in found {
            let input = std::fs::read(&path).unwrap();
            match panics(harness, &input) {
                Some(msg) if msg.starts_with("planted bug reached") => {}
                Some(msg) => problems.push(format!("{}: real failure: {msg}", path.display())),
                None => problems.push(format!(
                    "{} no longer reaches the planted bug",
                    path.display()
                )),
            }
        }
    }
    for (target, harness) in TARGETS {
        for (i, seed) in seeds(target).iter().enumerate() {
            if let Some(msg) = panics(harness, seed) {
                problems.push(format!("{target} seed {i} panics: {msg}"));
            }
        }
    }
    std::panic::set_hook(hook);
    assert!(problems.is_empty(), "{problems:#?}");
}
