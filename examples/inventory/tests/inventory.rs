//! Runs the example binary with each gate: with fencing the paused worker's write is
//! refused and the stock never goes negative; without it the lost update happens.

use std::collections::HashMap;
use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Longest a run may take before the test fails instead of hanging.
const RUN_TIMEOUT: Duration = Duration::from_secs(120);

struct Run {
    output: String,
    result: HashMap<String, i64>,
}

impl Run {
    fn get(&self, key: &str) -> i64 {
        self.result[key]
    }

    /// The fence each worker acquired, by worker name.
    fn fences(&self) -> HashMap<String, u64> {
        self.output
            .lines()
            .filter_map(|line| {
                let (who, rest) = line.split_once(": acquired ")?;
                let fence = rest.split(" with fence ").nth(1)?.split(';').next()?;
                Some((who.trim().to_owned(), fence.parse().ok()?))
            })
            .collect()
    }
}

fn run(args: &[&str]) -> Run {
    let mut child = Command::new(env!("CARGO_BIN_EXE_inventory"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the example");
    let deadline = Instant::now() + RUN_TIMEOUT;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("inventory {args:?} did not finish within {RUN_TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let (mut output, mut errors) = (String::new(), String::new());
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut output)
        .unwrap();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut errors)
        .unwrap();
    assert!(
        status.success(),
        "inventory {args:?} failed ({status}):\n{output}\n{errors}"
    );
    let last = output.lines().last().unwrap_or_default();
    let result = last
        .strip_prefix("result: ")
        .unwrap_or_else(|| panic!("no result line in:\n{output}"))
        .split(' ')
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap();
            (k.to_owned(), v.parse().unwrap())
        })
        .collect();
    Run { output, result }
}

fn check_fenced(gate: &str) {
    let run = run(&["--gate", gate]);
    let out = &run.output;
    assert_eq!(run.get("stock"), 0, "{out}");
    assert_eq!(run.get("sales"), 1, "exactly one sale of one item:\n{out}");
    assert_eq!(run.get("stale_refused"), 1, "{out}");
    assert!(
        out.contains("worker-1: write REFUSED: stale fence"),
        "{out}"
    );
    assert!(out.contains("PAUSED"), "{out}");
    // Every later holder got a larger fence than the paused one.
    let fences = run.fences();
    assert_eq!(fences.len(), 3, "{out}");
    for (who, fence) in &fences {
        if who != "worker-1" {
            assert!(*fence > fences["worker-1"], "{who}: {fence}\n{out}");
        }
    }
}

fn check_unfenced(gate: &str) {
    let run = run(&["--gate", gate, "--no-fencing"]);
    let out = &run.output;
    assert_eq!(run.get("stock"), -1, "the lost update must show:\n{out}");
    assert_eq!(run.get("sales"), 2, "{out}");
    assert_eq!(run.get("stale_refused"), 0, "{out}");
    assert!(out.contains("LOST UPDATE"), "{out}");
}

#[test]
fn memory_gate_refuses_the_paused_workers_write() {
    check_fenced("memory");
}

#[test]
fn postgres_gate_refuses_the_paused_workers_write() {
    check_fenced("postgres");
}

#[test]
fn memory_without_fencing_sells_the_item_twice() {
    check_unfenced("memory");
}

#[test]
fn postgres_without_fencing_sells_the_item_twice() {
    check_unfenced("postgres");
}
