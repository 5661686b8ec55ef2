//! The in-memory gate: stale writes are refused and change nothing; concurrent writers
//! end with the largest fence's value, and accepted fences only ever increase.

use crate::support;

use std::sync::{Arc, Mutex};

use fencelock_fence::{ErrorKind, FenceGate, GateMetrics, MemoryGate};
use support::Rng;

#[tokio::test]
async fn stale_write_is_refused_and_changes_nothing() {
    let gate = MemoryGate::new();
    assert_eq!(gate.name(), "memory");
    // Fence 0 is "nothing accepted yet" and is never accepted.
    assert_eq!(
        gate.apply("item", 0, "zero").await.unwrap_err().kind(),
        ErrorKind::Stale
    );
    gate.apply("item", 5, "five").await.unwrap();
    for stale in [5, 4, 1] {
        let err = gate.apply("item", stale, "stale").await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Stale);
        assert!(err.is_stale());
        assert_eq!((err.fence(), err.last_fence()), (Some(stale), Some(5)));
        assert_eq!(gate.get("item"), Some((5, "five")));
    }
    assert_eq!(gate.stale_rejections(), 4);
    gate.apply("item", 6, "six").await.unwrap();
    assert_eq!(gate.get("item"), Some((6, "six")));
    // Keys are independent.
    gate.apply("other", 1, "one").await.unwrap();
    assert_eq!(gate.last_fence("other"), Some(1));
    assert_eq!(gate.last_fence("missing"), None);
}

#[test]
fn seeded_value_takes_any_positive_fence_and_is_not_overwritten_by_seed() {
    let gate = MemoryGate::new();
    assert!(gate.seed("stock", 1));
    assert_eq!(gate.get("stock"), Some((0, 1)));
    assert!(!gate.seed("stock", 99));
    assert_eq!(gate.get("stock"), Some((0, 1)));
    gate.update("stock", 1, |old| old.unwrap() - 1).unwrap();
    assert_eq!(gate.get("stock"), Some((1, 0)));
    assert!(!gate.seed("stock", 99));
    assert_eq!(gate.get("stock"), Some((1, 0)));
}

#[test]
fn update_runs_only_for_a_newer_fence() {
    let gate = MemoryGate::new();
    gate.update("stock", 1, |old| old.copied().unwrap_or(1) - 1)
        .unwrap();
    assert_eq!(gate.get("stock"), Some((1, 0)));
    let mut ran = false;
    let err = gate
        .update("stock", 1, |old: Option<&i32>| {
            ran = true;
            old.unwrap() - 1
        })
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Stale);
    assert!(!ran, "the write must not run for a stale fence");
    assert_eq!(gate.get("stock"), Some((1, 0)));
}

#[test]
fn concurrent_writers_end_with_the_largest_fence_and_never_regress() {
    let mut rng = Rng::from_env("memory concurrent");
    let gate = MemoryGate::<u64>::new();
    // Every accepted write appends (previous fence, new fence) from inside the gate.
    let history = Arc::new(Mutex::new(Vec::new()));
    let fences: Vec<Vec<u64>> = (0..8).map(|_| rng.fences(200, 500)).collect();
    let max = *fences.iter().flatten().max().unwrap();
    std::thread::scope(|s| {
        for mine in &fences {
            let (gate, history) = (gate.clone(), Arc::clone(&history));
            s.spawn(move || {
                for &fence in mine {
                    match gate.update("k", fence, |old| {
                        history.lock().unwrap().push((old.copied(), fence));
                        fence
                    }) {
                        Ok(()) => {}
                        Err(e) => {
                            assert_eq!(e.kind(), ErrorKind::Stale);
                            assert!(e.last_fence().unwrap() >= fence);
                        }
                    }
                }
            });
        }
    });
    assert_eq!(gate.get("k"), Some((max, max)));
    let history = history.lock().unwrap();
    for (old, new) in history.iter() {
        assert!(old.unwrap_or(0) < *new, "regression: {old:?} -> {new}");
    }
    assert_eq!(
        history.len() as u64 + gate.stale_rejections(),
        (8 * 200) as u64,
        "every write is either applied or counted as stale"
    );
}
