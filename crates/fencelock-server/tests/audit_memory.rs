//! Issue 19, item 8: the audit index took about five times its configured
//! `max_bytes` in memory (1.02M entries, 345 MB RSS at 64 MiB), because retention
//! counted the entries' encoded size. Here a counting allocator measures the heap
//! the audit store holds after far more entries than it retains, and it must stay
//! within 1.5 times `max_bytes`; the index's own count must stay within
//! `max_bytes`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicI64, Ordering};

use fencelock_server::audit::{AuditConfig, AuditEntry, AuditKind, AuditStore};

/// Live heap bytes, each allocation counted as glibc's malloc lays it out (an
/// 8-byte header, rounded up to 16, at least 32), so the figure is what the
/// process really holds for it, not just what was asked for.
struct Counting;

static LIVE: AtomicI64 = AtomicI64::new(0);

fn footprint(size: usize) -> i64 {
    ((size + 8 + 15) & !15).max(32) as i64
}

// SAFETY: forwards to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(footprint(layout.size()), Ordering::Relaxed);
        // SAFETY: the caller's contract is passed through.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(footprint(layout.size()), Ordering::Relaxed);
        // SAFETY: the caller's contract is passed through.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(
            footprint(new_size) - footprint(layout.size()),
            Ordering::Relaxed,
        );
        // SAFETY: the caller's contract is passed through.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// A grant's entry as the engine writes it: lock, fence, owner, session, request id.
fn grant(seq: u64, wall_ms: u64) -> AuditEntry {
    AuditEntry {
        seq,
        index: 0,
        wall_ms,
        kind: AuditKind::Grant,
        lock: Some(format!("a:orders/{seq:08}")),
        fence: Some(seq),
        owner: Some(format!("worker-{:04}@host-{:02}", seq % 1000, seq % 17)),
        session: Some(format!("{:032x}", u128::from(seq) * 0x9E37_79B9)),
        request_id: Some(format!("client-a/{seq:016x}-{:08x}", seq * 31)),
        actor: None,
        reason: None,
        duration_ms: 3,
        detail: None,
    }
}

#[test]
fn the_audit_index_holds_at_most_its_max_bytes_in_memory() {
    const MAX_BYTES: u64 = 8 << 20;
    const BATCHES: u64 = 400;
    const PER_BATCH: u64 = 250;
    let dir = tempfile::tempdir().unwrap();
    let config = AuditConfig {
        max_age_ms: None,
        max_bytes: MAX_BYTES,
    };
    let before = LIVE.load(Ordering::Relaxed);
    let mut store = AuditStore::open(dir.path(), config, false).unwrap();
    let wall_ms = fencelock_server::audit::wall_ms();
    let mut seq = 0;
    for _ in 0..BATCHES {
        let batch: Vec<AuditEntry> = (0..PER_BATCH)
            .map(|_| {
                seq += 1;
                grant(seq, wall_ms)
            })
            .collect();
        store.commit(batch).unwrap();
    }
    let held = (LIVE.load(Ordering::Relaxed) - before) as u64;
    let index = store.shared_index();
    let (retained, counted) = {
        let index = index.lock().unwrap();
        (index.len(), index.bytes())
    };
    let ratio = held as f64 / MAX_BYTES as f64;
    println!(
        "ATTACK 8: {} audit entries into an index with max_bytes = {} MiB -> {retained} \
         retained, {:.1} MiB counted, {:.1} MiB of heap held ({ratio:.2}x max_bytes)",
        BATCHES * PER_BATCH,
        MAX_BYTES >> 20,
        counted as f64 / (1 << 20) as f64,
        held as f64 / (1 << 20) as f64,
    );
    assert!(
        (retained as u64) < BATCHES * PER_BATCH,
        "retention never applied"
    );
    assert!(counted <= MAX_BYTES, "{counted} bytes counted");
    assert!(
        ratio <= 1.5,
        "the audit store holds {held} bytes of heap for max_bytes = {MAX_BYTES} ({ratio:.2}x)"
    );
    // The newest entry is the one kept last.
    let newest = store.shared_index();
    let newest = newest
        .lock()
        .unwrap()
        .query(&fencelock_server::audit::AuditQuery::newest(1));
    assert_eq!(newest[0].seq, seq);
}
