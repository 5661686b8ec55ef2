//! The conformance cases. Each takes a fresh [`Fixture`] and panics with a message
//! naming the broken promise.
//!
//! Timing appears only as bounds that make a case finish (a wait budget, [`STEP`]);
//! no case passes or fails on how fast a store is.

use std::sync::Arc;
use std::time::Duration;

use fencelock::{
    AcquireSpec, Client, ErrorKind, FenceGuarantee, Leader, Lease, LockBackend, LockMode,
};
use futures_util::StreamExt;
use tokio::time::Instant;

use crate::{connect, step, Fixture, Partitioned, STEP};

/// A lease long enough that it never expires during a case.
const LONG_TTL: Duration = Duration::from_secs(60);

fn spec(name: &str, ttl: Duration) -> AcquireSpec {
    let mut spec = AcquireSpec::new(name, ttl);
    spec.owner = "conformance".to_owned();
    spec
}

fn waiting(name: &str, ttl: Duration, wait: Duration) -> AcquireSpec {
    let mut spec = spec(name, ttl);
    spec.wait = wait;
    spec
}

async fn acquire(backend: &dyn LockBackend, spec: &AcquireSpec) -> Lease {
    match step(backend.acquire(spec)).await {
        Ok(lease) => lease,
        Err(e) => panic!("acquire {:?} failed: {e}", spec.name),
    }
}

async fn expect_refused(backend: &dyn LockBackend, spec: &AcquireSpec, kind: ErrorKind) {
    match step(backend.acquire(spec)).await {
        Ok(lease) => panic!(
            "acquire {:?} was granted (fence {}), expected {kind:?}",
            spec.name, lease.fence
        ),
        Err(e) => assert_eq!(e.kind(), kind, "acquire {:?}: {e}", spec.name),
    }
}

/// Fences must grow where the backend promises fences, and be 0 where it does not.
fn check_fence_order(guarantee: FenceGuarantee, earlier: u64, later: u64) {
    match guarantee {
        FenceGuarantee::None => assert_eq!(
            (earlier, later),
            (0, 0),
            "a backend without fences must report fence 0"
        ),
        _ => assert!(
            later > earlier,
            "fence went from {earlier} to {later}: a later grant must carry a larger fence"
        ),
    }
}

/// Capabilities are a property of the backend, not of one connection. (The behaviour
/// behind each flag is checked by the other cases.)
pub async fn capabilities_are_consistent(fixture: &dyn Fixture) {
    let a = connect(fixture).await;
    let b = connect(fixture).await;
    let caps = a.capabilities();
    assert_eq!(
        caps,
        b.capabilities(),
        "two clients disagree on capabilities"
    );
    assert!(!caps.backend.is_empty(), "a backend must name itself");
}

/// Malformed requests get `InvalidArgument`, and nothing is created on the store: the
/// same name is free afterwards.
pub async fn bad_input_is_refused(fixture: &dyn Fixture) {
    let backend = connect(fixture).await;
    let ttl = fixture.short_ttl();
    let mut cases = vec![
        ("empty name", spec("", ttl)),
        ("control character", spec("bad\nname", ttl)),
        (
            "name too long",
            spec(&"n".repeat(fencelock::MAX_NAME_BYTES + 1), ttl),
        ),
        ("zero ttl", spec("conformance:bad", Duration::ZERO)),
        (
            "ttl too long",
            spec("conformance:bad", fencelock::MAX_TTL * 2),
        ),
    ];
    let mut zero_limit = spec("conformance:bad", ttl);
    zero_limit.limit = 0;
    cases.push(("zero limit", zero_limit));
    let mut empty_request_id = spec("conformance:bad", ttl);
    empty_request_id.request_id = String::new();
    cases.push(("empty request id", empty_request_id));
    for (what, bad) in &cases {
        match step(backend.acquire(bad)).await {
            Ok(lease) => panic!("{what}: granted (fence {})", lease.fence),
            Err(e) => assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{what}: {e}"),
        }
    }
    let lease = acquire(&*backend, &spec("conformance:bad", ttl)).await;
    assert!(step(backend.release(&lease)).await.expect("release"));
}

/// One holder at a time: a second client is refused (`Held`) while the lock is held,
/// and gets it once it is released.
pub async fn exclusion(fixture: &dyn Fixture) {
    let a = connect(fixture).await;
    let b = connect(fixture).await;
    let name = "conformance:exclusion";
    let first = acquire(&*a, &spec(name, LONG_TTL)).await;
    expect_refused(&*b, &spec(name, LONG_TTL), ErrorKind::Held).await;
    // The same client asking again (a new request) is refused too: a lock is not
    // re-entrant.
    expect_refused(&*a, &spec(name, LONG_TTL), ErrorKind::Held).await;
    assert!(
        step(a.release(&first)).await.expect("release"),
        "release of a held lock"
    );
    let second = acquire(&*b, &spec(name, LONG_TTL)).await;
    check_fence_order(a.capabilities().fences, first.fence, second.fence);
    assert!(step(b.release(&second)).await.expect("release"));
}

/// A semaphore admits `limit` holders and refuses the next; a backend without
/// semaphores refuses `limit > 1` with `InvalidArgument` instead of granting a mutex
/// the caller did not ask for.
pub async fn semaphore(fixture: &dyn Fixture) {
    let clients = [
        connect(fixture).await,
        connect(fixture).await,
        connect(fixture).await,
        connect(fixture).await,
    ];
    let name = "conformance:semaphore";
    let mut request = spec(name, LONG_TTL);
    request.limit = 3;
    if !clients[0].capabilities().semaphores {
        let e = step(clients[0].acquire(&request))
            .await
            .expect_err("limit 3 on a backend without semaphores");
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
        return;
    }
    let mut leases = Vec::new();
    for client in &clients[..3] {
        let mut request = request.clone();
        request.request_id = AcquireSpec::new(name, LONG_TTL).request_id;
        leases.push(acquire(&**client, &request).await);
    }
    let mut tokens: Vec<&str> = leases.iter().map(|l| l.owner_token.as_str()).collect();
    tokens.sort_unstable();
    tokens.dedup();
    assert_eq!(tokens.len(), 3, "each holder needs its own owner token");
    if clients[0].capabilities().fences != FenceGuarantee::None {
        let mut fences: Vec<u64> = leases.iter().map(|l| l.fence).collect();
        fences.sort_unstable();
        fences.dedup();
        assert_eq!(fences.len(), 3, "semaphore holders need distinct fences");
    }
    let mut fourth = request.clone();
    fourth.request_id = AcquireSpec::new(name, LONG_TTL).request_id;
    expect_refused(&*clients[3], &fourth, ErrorKind::Held).await;
    assert!(step(clients[1].release(&leases[1])).await.expect("release"));
    let lease = acquire(&*clients[3], &fourth).await;
    assert!(step(clients[3].release(&lease)).await.expect("release"));
    for (client, lease) in [(&clients[0], &leases[0]), (&clients[2], &leases[2])] {
        assert!(step(client.release(lease)).await.expect("release"));
    }
}

/// Twenty grants in turn, alternating between two clients: each fence larger than the
/// one before (or all 0 on a backend without fences).
pub async fn fences_increase(fixture: &dyn Fixture) {
    let clients = [connect(fixture).await, connect(fixture).await];
    let guarantee = clients[0].capabilities().fences;
    let name = "conformance:fences";
    let mut last: Option<u64> = None;
    for round in 0..20 {
        let client = &clients[round % 2];
        let lease = acquire(&**client, &spec(name, LONG_TTL)).await;
        if let Some(last) = last {
            check_fence_order(guarantee, last, lease.fence);
        } else if guarantee == FenceGuarantee::None {
            assert_eq!(
                lease.fence, 0,
                "a backend without fences must report fence 0"
            );
        }
        last = Some(lease.fence);
        assert!(step(client.release(&lease)).await.expect("release"));
    }
}

/// Release and renew act only on the caller's own grant: another grant's owner token
/// or a stale one from an earlier grant of the same lock releases nothing and renews
/// nothing, and the holder keeps the lock.
pub async fn release_and_renew_check_the_owner(fixture: &dyn Fixture) {
    let holder = connect(fixture).await;
    let intruder = connect(fixture).await;
    let name = "conformance:owner";
    let stale = acquire(&*holder, &spec(name, LONG_TTL)).await;
    assert!(step(holder.release(&stale)).await.expect("release"));
    let lease = acquire(&*holder, &spec(name, LONG_TTL)).await;
    let elsewhere = acquire(&*intruder, &spec("conformance:owner-elsewhere", LONG_TTL)).await;
    let borrowed = Lease::new(
        lease.name.clone(),
        lease.fence,
        elsewhere.owner_token.clone(),
        lease.ttl,
    );
    for (what, wrong) in [
        ("another grant's token", &borrowed),
        ("a stale token", &stale),
    ] {
        match step(intruder.release(wrong)).await {
            Ok(released) => assert!(!released, "release with {what} released the lock"),
            Err(e) => assert_eq!(e.kind(), ErrorKind::NotHeld, "release with {what}: {e}"),
        }
        match step(intruder.renew(wrong, LONG_TTL)).await {
            Ok(granted) => panic!("renew with {what} renewed the lock for {granted:?}"),
            Err(e) => assert_eq!(e.kind(), ErrorKind::NotHeld, "renew with {what}: {e}"),
        }
        expect_refused(&*intruder, &spec(name, LONG_TTL), ErrorKind::Held).await;
    }
    // The holder's own renew and release work, once; then the grant is gone.
    let granted = step(holder.renew(&lease, LONG_TTL)).await.expect("renew");
    assert!(granted > Duration::ZERO, "renew granted {granted:?}");
    assert!(step(holder.release(&lease)).await.expect("release"));
    match step(holder.release(&lease)).await {
        Ok(released) => assert!(!released, "a released grant was released twice"),
        Err(e) => assert_eq!(e.kind(), ErrorKind::NotHeld, "second release: {e}"),
    }
    match step(holder.renew(&lease, LONG_TTL)).await {
        Ok(granted) => panic!("a released grant was renewed for {granted:?}"),
        Err(e) => assert_eq!(e.kind(), ErrorKind::NotHeld, "renew after release: {e}"),
    }
    assert!(step(intruder.release(&elsewhere)).await.expect("release"));
}

/// A holder that stops renewing (cut off, as if paused) loses the lock when its lease
/// runs out: a waiting client gets it, with a larger fence, and the old holder's
/// late renew and release are refused and touch nothing.
pub async fn expiry_frees_the_lock(fixture: &dyn Fixture) {
    let ttl = fixture.short_ttl();
    let holder = Partitioned::connect(fixture).await;
    let other = connect(fixture).await;
    let name = "conformance:expiry";
    // The grant is made after `asked`, so its lease cannot end before `asked + ttl`.
    let asked = Instant::now();
    let old = acquire(&*holder.backend, &spec(name, ttl)).await;
    holder.cut();
    let new = acquire(&*other, &waiting(name, LONG_TTL, STEP / 2)).await;
    let changed_hands = asked.elapsed();
    assert!(
        changed_hands + Duration::from_millis(50) >= old.ttl.min(ttl),
        "the lock changed hands {changed_hands:?} after it was asked for, before the \
         {:?} lease could have expired",
        old.ttl
    );
    check_fence_order(other.capabilities().fences, old.fence, new.fence);
    holder.heal();
    match step(holder.backend.renew(&old, ttl)).await {
        Ok(granted) => panic!("an expired grant was renewed for {granted:?}"),
        Err(e) => assert!(
            matches!(e.kind(), ErrorKind::NotHeld | ErrorKind::LockLost),
            "renew after expiry: {e}"
        ),
    }
    match step(holder.backend.release(&old)).await {
        Ok(released) => assert!(!released, "an expired grant was released"),
        Err(e) => assert!(
            matches!(e.kind(), ErrorKind::NotHeld | ErrorKind::LockLost),
            "release after expiry: {e}"
        ),
    }
    // The new holder still holds it.
    expect_refused(&*holder.backend, &spec(name, ttl), ErrorKind::Held).await;
    assert!(step(other.release(&new)).await.expect("release"));
}

/// The client library's promise over this backend: a guard whose renewals cannot get
/// through reports itself lost before any other client can be granted the lock.
pub async fn lost_signal_fires_before_another_holder(fixture: &dyn Fixture) {
    let ttl = fixture.short_ttl();
    let holder = Partitioned::connect(fixture).await;
    let client = Client::from_backend(holder.backend.clone());
    let other = connect(fixture).await;
    let name = "conformance:lost";
    let guard = step(client.lock(name).ttl(ttl).acquire())
        .await
        .expect("acquire a guard");
    assert!(!guard.is_lost());
    let lost = guard.lost();
    let lost_at = tokio::spawn(async move {
        lost.await;
        Instant::now()
    });
    holder.cut();
    let new = acquire(&*other, &waiting(name, LONG_TTL, STEP / 2)).await;
    let granted_at = Instant::now();
    let lost_at = step(lost_at).await.expect("lost task");
    assert!(
        lost_at <= granted_at,
        "the guard reported the lock lost {:?} after another client was granted it",
        lost_at - granted_at
    );
    assert!(guard.is_lost());
    check_fence_order(other.capabilities().fences, guard.fence(), new.fence);
    holder.heal();
    assert!(step(other.release(&new)).await.expect("release"));
}

/// A waiter is woken when the holder releases and gets the lock within its wait.
pub async fn waiter_wakes_on_release(fixture: &dyn Fixture) {
    let holder = connect(fixture).await;
    let waiter: Arc<dyn LockBackend> = connect(fixture).await;
    let name = "conformance:wake";
    let held = acquire(&*holder, &spec(name, LONG_TTL)).await;
    let wait = STEP / 2;
    let task = {
        let waiter = waiter.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            let result = waiter.acquire(&waiting(name, LONG_TTL, wait)).await;
            (result, started.elapsed())
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !task.is_finished(),
        "the waiter finished while the lock was held"
    );
    assert!(step(holder.release(&held)).await.expect("release"));
    let (result, waited) = step(task).await.expect("waiter task");
    let lease = result.unwrap_or_else(|e| panic!("waiter not granted after release: {e}"));
    assert!(
        waited < wait,
        "granted only after its whole wait ({waited:?})"
    );
    check_fence_order(holder.capabilities().fences, held.fence, lease.fence);
    assert!(step(waiter.release(&lease)).await.expect("release"));
}

/// Several waiters queued behind a holder are all served, one at a time, each with a
/// larger fence; on a FIFO backend in the order they arrived.
pub async fn waiters_are_all_served(fixture: &dyn Fixture) {
    let holder = connect(fixture).await;
    let caps = holder.capabilities();
    let name = "conformance:queue";
    let held = acquire(&*holder, &spec(name, LONG_TTL)).await;
    let (granted_tx, mut granted_rx) = tokio::sync::mpsc::unbounded_channel();
    let mut tasks = Vec::new();
    for index in 0..3usize {
        let waiter = connect(fixture).await;
        let granted_tx = granted_tx.clone();
        tasks.push(tokio::spawn(async move {
            let lease = waiter
                .acquire(&waiting(name, LONG_TTL, STEP / 2))
                .await
                .unwrap_or_else(|e| panic!("waiter {index} not granted: {e}"));
            let _ = granted_tx.send((index, lease.fence));
            // Hold briefly, so that the next waiter's grant is a real hand-off.
            tokio::time::sleep(Duration::from_millis(100)).await;
            assert!(waiter.release(&lease).await.expect("release"));
        }));
        // Give each waiter time to be queued before the next one arrives.
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    drop(granted_tx);
    assert!(step(holder.release(&held)).await.expect("release"));
    let mut order = Vec::new();
    while let Some(granted) = step(granted_rx.recv()).await {
        order.push(granted);
    }
    for task in tasks {
        step(task).await.expect("waiter task");
    }
    assert_eq!(order.len(), 3, "every waiter must be served: {order:?}");
    let mut last = held.fence;
    for &(_, fence) in &order {
        check_fence_order(caps.fences, last, fence);
        last = fence;
    }
    if caps.fifo {
        let indices: Vec<usize> = order.iter().map(|&(index, _)| index).collect();
        assert_eq!(
            indices,
            [0, 1, 2],
            "a FIFO backend served waiters out of order"
        );
    }
}

/// A retried acquire (same request id, say after a lost answer) returns the grant it
/// already made instead of a second grant or `Held`.
pub async fn retry_with_the_same_request_id_is_idempotent(fixture: &dyn Fixture) {
    let client = connect(fixture).await;
    let other = connect(fixture).await;
    let name = "conformance:retry";
    let request = spec(name, LONG_TTL);
    let first = acquire(&*client, &request).await;
    let again = acquire(&*client, &request).await;
    assert_eq!(
        (&again.owner_token, again.fence),
        (&first.owner_token, first.fence),
        "a retry with the same request id made a second grant"
    );
    expect_refused(&*other, &spec(name, LONG_TTL), ErrorKind::Held).await;
    assert!(step(client.release(&first)).await.expect("release"));
    let next = acquire(&*other, &spec(name, LONG_TTL)).await;
    check_fence_order(client.capabilities().fences, first.fence, next.fence);
    assert!(step(other.release(&next)).await.expect("release"));
}

fn shared(name: &str, ttl: Duration) -> AcquireSpec {
    let mut spec = spec(name, ttl);
    spec.mode = LockMode::Shared;
    spec
}

fn expect_unsupported<T: std::fmt::Debug>(what: &str, result: Result<T, fencelock::Error>) {
    match result {
        Ok(value) => panic!("{what}: the capabilities say no, but it answered {value:?}"),
        Err(e) => assert_eq!(e.kind(), ErrorKind::Unsupported, "{what}: {e}"),
    }
}

/// Where the capabilities say no, a shared acquire is `Unsupported`, never an
/// exclusive grant; `true` if the backend claims shared locks.
async fn claims_shared(backend: &dyn LockBackend, name: &str) -> bool {
    if backend.capabilities().shared {
        return true;
    }
    expect_unsupported(
        "a shared acquire",
        step(backend.acquire(&shared(name, LONG_TTL))).await,
    );
    false
}

/// Readers hold a shared lock together; a writer is refused while they do and gets it
/// once they are gone, with a larger fence than theirs; a reader is refused while the
/// writer holds it.
pub async fn shared_readers_hold_together(fixture: &dyn Fixture) {
    let clients = [
        connect(fixture).await,
        connect(fixture).await,
        connect(fixture).await,
    ];
    let name = "conformance:rw";
    if !claims_shared(&*clients[0], name).await {
        return;
    }
    let fences = clients[0].capabilities().fences;
    let first = acquire(&*clients[0], &shared(name, LONG_TTL)).await;
    let second = acquire(&*clients[1], &shared(name, LONG_TTL)).await;
    assert_ne!(
        first.owner_token, second.owner_token,
        "each reader needs its own owner token"
    );
    expect_refused(&*clients[2], &spec(name, LONG_TTL), ErrorKind::Held).await;
    assert!(step(clients[0].release(&first)).await.expect("release"));
    expect_refused(&*clients[2], &spec(name, LONG_TTL), ErrorKind::Held).await;
    assert!(step(clients[1].release(&second)).await.expect("release"));
    let writer = acquire(&*clients[2], &spec(name, LONG_TTL)).await;
    check_fence_order(fences, first.fence.max(second.fence), writer.fence);
    expect_refused(&*clients[0], &shared(name, LONG_TTL), ErrorKind::Held).await;
    assert!(step(clients[2].release(&writer)).await.expect("release"));
    let reader = acquire(&*clients[0], &shared(name, LONG_TTL)).await;
    check_fence_order(fences, writer.fence, reader.fence);
    assert!(step(clients[0].release(&reader)).await.expect("release"));
}

/// A writer queued behind a reader gets the lock when the reader leaves, with a larger
/// fence; on a FIFO backend a reader arriving after the queued writer waits for it
/// instead of joining the first reader (no writer starvation).
pub async fn shared_queued_writer_goes_first(fixture: &dyn Fixture) {
    let reader = connect(fixture).await;
    let writer: Arc<dyn LockBackend> = connect(fixture).await;
    let late = connect(fixture).await;
    let name = "conformance:rw-queue";
    if !claims_shared(&*reader, name).await {
        return;
    }
    let caps = reader.capabilities();
    let held = acquire(&*reader, &shared(name, LONG_TTL)).await;
    let task = {
        let writer = writer.clone();
        tokio::spawn(async move { writer.acquire(&waiting(name, LONG_TTL, STEP / 2)).await })
    };
    // Give the writer time to be queued.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !task.is_finished(),
        "the writer was granted beside a reader"
    );
    if caps.fifo {
        expect_refused(&*late, &shared(name, LONG_TTL), ErrorKind::Held).await;
    }
    assert!(step(reader.release(&held)).await.expect("release"));
    let granted = step(task)
        .await
        .expect("writer task")
        .unwrap_or_else(|e| panic!("the queued writer was not granted: {e}"));
    check_fence_order(caps.fences, held.fence, granted.fence);
    assert!(step(writer.release(&granted)).await.expect("release"));
}

/// A writer that downgrades keeps its fence and lets readers in — one already queued
/// behind it and one arriving after — but not writers; where the capabilities say no,
/// downgrade is `Unsupported` and the writer still holds exclusively.
pub async fn downgrade_lets_readers_in(fixture: &dyn Fixture) {
    let holder = connect(fixture).await;
    let other = connect(fixture).await;
    let queued: Arc<dyn LockBackend> = connect(fixture).await;
    let name = "conformance:downgrade";
    let lease = acquire(&*holder, &spec(name, LONG_TTL)).await;
    if !holder.capabilities().downgrade {
        expect_unsupported("downgrade", step(holder.downgrade(&lease)).await);
        expect_refused(&*other, &spec(name, LONG_TTL), ErrorKind::Held).await;
        assert!(step(holder.release(&lease)).await.expect("release"));
        return;
    }
    assert!(
        holder.capabilities().shared,
        "a backend that downgrades must have shared locks"
    );
    let task = {
        let queued = queued.clone();
        let mut reader = shared(name, LONG_TTL);
        reader.wait = STEP / 2;
        tokio::spawn(async move { queued.acquire(&reader).await })
    };
    // Give the reader time to be queued behind the writer.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !task.is_finished(),
        "a reader was granted beside the writer"
    );
    step(holder.downgrade(&lease)).await.expect("downgrade");
    let early = step(task)
        .await
        .expect("reader task")
        .unwrap_or_else(|e| panic!("the reader queued behind the writer was not let in: {e}"));
    let reader = acquire(&*other, &shared(name, LONG_TTL)).await;
    expect_refused(&*other, &spec(name, LONG_TTL), ErrorKind::Held).await;
    let renewed = step(holder.renew(&lease, LONG_TTL)).await.expect("renew");
    assert!(renewed > Duration::ZERO);
    assert!(step(holder.release(&lease)).await.expect("release"));
    assert!(step(other.release(&reader)).await.expect("release"));
    assert!(step(queued.release(&early)).await.expect("release"));
}

fn campaign_spec(name: &str, ttl: Duration, wait: Duration) -> AcquireSpec {
    let mut spec = waiting(name, ttl, wait);
    spec.owner = format!("candidate-{}", &spec.request_id[..8]);
    spec
}

async fn campaign(backend: &dyn LockBackend, spec: &AcquireSpec, value: &str) -> Lease {
    match step(backend.campaign(spec, value)).await {
        Ok(lease) => lease,
        Err(e) => panic!("campaign in {:?} failed: {e}", spec.name),
    }
}

async fn leader(backend: &dyn LockBackend, name: &str) -> Option<Leader> {
    step(backend.leader(name))
        .await
        .unwrap_or_else(|e| panic!("leader of {name:?}: {e}"))
}

/// Where the capabilities say no, campaign and leader are `Unsupported`; `true` if the
/// backend claims elections.
async fn claims_elections(backend: &dyn LockBackend, name: &str) -> bool {
    if backend.capabilities().elections {
        return true;
    }
    let spec = campaign_spec(name, LONG_TTL, Duration::ZERO);
    expect_unsupported("campaign", step(backend.campaign(&spec, "v")).await);
    expect_unsupported("leader", step(backend.leader(name)).await);
    false
}

/// One leader at a time: a second candidate is refused while the first leads, and
/// `leader` reports the first with its value and its term (the grant's fence).
pub async fn election_has_one_leader(fixture: &dyn Fixture) {
    let a = connect(fixture).await;
    let b = connect(fixture).await;
    let name = "conformance:election";
    if !claims_elections(&*a, name).await {
        return;
    }
    assert_eq!(leader(&*a, name).await, None, "a new election has a leader");
    let spec = campaign_spec(name, LONG_TTL, Duration::ZERO);
    let lease = campaign(&*a, &spec, "a:1").await;
    let second = campaign_spec(name, LONG_TTL, Duration::ZERO);
    match step(b.campaign(&second, "b:1")).await {
        Ok(other) => panic!("a second leader at term {}", other.fence),
        Err(e) => assert_eq!(e.kind(), ErrorKind::Held, "second campaign: {e}"),
    }
    let seen = leader(&*b, name).await.expect("a leader");
    assert_eq!(
        (seen.value.as_str(), seen.term, seen.owner.as_str()),
        ("a:1", lease.fence, spec.owner.as_str()),
        "leader() does not report the leader"
    );
    assert!(step(a.release(&lease)).await.expect("resign"));
    assert_eq!(
        leader(&*b, name).await,
        None,
        "a resigned leader still leads"
    );
}

/// A leader cut off until its lease runs out is replaced by a waiting candidate with a
/// larger term; the old leader's proclaim is then refused with `NotHeld` and changes
/// nothing.
pub async fn election_term_increases_on_takeover(fixture: &dyn Fixture) {
    let ttl = fixture.short_ttl();
    let old = Partitioned::connect(fixture).await;
    let new = connect(fixture).await;
    let name = "conformance:election-takeover";
    if !claims_elections(&*new, name).await {
        return;
    }
    let first = campaign(
        &*old.backend,
        &campaign_spec(name, ttl, Duration::ZERO),
        "old",
    )
    .await;
    old.cut();
    let second = campaign(&*new, &campaign_spec(name, LONG_TTL, STEP / 2), "new").await;
    assert!(
        second.fence > first.fence,
        "the new leader's term {} is not above the old one's {}",
        second.fence,
        first.fence
    );
    old.heal();
    match step(old.backend.proclaim(&first, "stale")).await {
        Ok(()) => panic!("a leader that lost its term proclaimed"),
        Err(e) => assert_eq!(e.kind(), ErrorKind::NotHeld, "proclaim after loss: {e}"),
    }
    let seen = leader(&*new, name).await.expect("a leader");
    assert_eq!((seen.value.as_str(), seen.term), ("new", second.fence));
    assert!(step(new.release(&second)).await.expect("resign"));
}

/// Proclaim changes the value `leader` reports and the value observers see, and keeps
/// the term.
pub async fn election_proclaim_is_seen(fixture: &dyn Fixture) {
    let a = connect(fixture).await;
    let follower = connect(fixture).await;
    let name = "conformance:election-proclaim";
    if !claims_elections(&*a, name).await {
        return;
    }
    let lease = campaign(&*a, &campaign_spec(name, LONG_TTL, Duration::ZERO), "one").await;
    let election = Client::from_backend(follower.clone()).election(name);
    let mut changes = Box::pin(election.observe());
    let first = step(changes.next()).await.expect("a first item");
    let first = first.expect("observe").expect("a leader");
    assert_eq!((first.value.as_str(), first.term), ("one", lease.fence));
    step(a.proclaim(&lease, "two")).await.expect("proclaim");
    let seen = leader(&*follower, name).await.expect("a leader");
    assert_eq!((seen.value.as_str(), seen.term), ("two", lease.fence));
    let next = step(changes.next()).await.expect("a second item");
    let next = next.expect("observe").expect("a leader");
    assert_eq!(
        (next.value.as_str(), next.term),
        ("two", lease.fence),
        "the observer did not see the proclaimed value"
    );
    assert!(step(a.release(&lease)).await.expect("resign"));
    let last = step(changes.next()).await.expect("a third item");
    assert_eq!(last.expect("observe"), None, "resignation not observed");
}

/// A candidate waiting behind a leader leads once the leader resigns, with a larger
/// term.
pub async fn election_successor_leads_after_resign(fixture: &dyn Fixture) {
    let a = connect(fixture).await;
    let b: Arc<dyn LockBackend> = connect(fixture).await;
    let name = "conformance:election-resign";
    if !claims_elections(&*a, name).await {
        return;
    }
    let first = campaign(&*a, &campaign_spec(name, LONG_TTL, Duration::ZERO), "a").await;
    let task = {
        let b = b.clone();
        tokio::spawn(async move {
            b.campaign(&campaign_spec(name, LONG_TTL, STEP / 2), "b")
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!task.is_finished(), "a second leader while the first leads");
    assert!(step(a.release(&first)).await.expect("resign"));
    let second = step(task)
        .await
        .expect("candidate task")
        .unwrap_or_else(|e| panic!("the successor was not elected: {e}"));
    assert!(
        second.fence > first.fence,
        "term went from {} to {}",
        first.fence,
        second.fence
    );
    let seen = leader(&*a, name).await.expect("a leader");
    assert_eq!((seen.value.as_str(), seen.term), ("b", second.fence));
    assert!(step(b.release(&second)).await.expect("resign"));
}

/// Capabilities tell the truth both ways: each kind a backend claims answers something
/// other than `Unsupported`, and each it does not claim answers `Unsupported` (a
/// shared request is never granted as exclusive) and leaves the name free.
pub async fn capabilities_match_the_kinds(fixture: &dyn Fixture) {
    let backend = connect(fixture).await;
    let caps = backend.capabilities();
    let name = "conformance:kinds";
    let shared_answer = step(backend.acquire(&shared(name, LONG_TTL))).await;
    match (&shared_answer, caps.shared) {
        (Err(e), true) => assert_ne!(e.kind(), ErrorKind::Unsupported, "claims shared: {e}"),
        (_, true) => {}
        (answer, false) => expect_unsupported("shared acquire", answer.clone()),
    }
    if let Ok(lease) = &shared_answer {
        assert!(step(backend.release(lease)).await.expect("release"));
    }
    let candidate = campaign_spec(name, LONG_TTL, Duration::ZERO);
    let campaigned = step(backend.campaign(&candidate, "v")).await;
    let read = step(backend.leader(name)).await;
    if caps.elections {
        let lease = campaigned.unwrap_or_else(|e| panic!("claims elections: {e}"));
        read.unwrap_or_else(|e| panic!("claims elections: {e}"));
        assert!(step(backend.release(&lease)).await.expect("resign"));
    } else {
        expect_unsupported("campaign", campaigned);
        expect_unsupported("leader", read);
    }
    let lease = acquire(&*backend, &spec(name, LONG_TTL)).await;
    let downgraded = step(backend.downgrade(&lease)).await;
    match (downgraded, caps.downgrade) {
        (Err(e), true) => panic!("claims downgrade: {e}"),
        (Ok(()), true) => {}
        (answer, false) => expect_unsupported("downgrade", answer),
    }
    assert!(step(backend.release(&lease)).await.expect("release"));
}
