//! The lock kinds survive a restart: modes, a downgrade and an election's proclaimed
//! value come back from the snapshot and the log replayed after it.

use fencelock_core::{LockName, Mode, Owner, Value};
use fencelock_server::{AcquireArgs, EngineConfig, Requester, Server, ServerConfig};

fn config(dir: &std::path::Path) -> ServerConfig {
    let mut engine = EngineConfig::new(dir);
    engine.segment_bytes = 1 << 20;
    engine.snapshot_after_bytes = 4 << 10;
    ServerConfig::new("127.0.0.1:0".parse().expect("an address"), engine)
}

fn args(name: &str, mode: Mode, value: Option<&str>) -> AcquireArgs {
    AcquireArgs {
        name: LockName::new(name).expect("a name"),
        ttl_ms: Some(60_000),
        wait_ms: 0,
        owner: Owner::new("test").expect("an owner"),
        request_id: None,
        limit: 1,
        lock_delay_ms: 0,
        session: None,
        mode,
        value: value.map(|v| Value::new(v).expect("a value")),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn modes_downgrades_and_values_survive_a_restart() {
    let dir = tempfile::tempdir().expect("a directory");
    let anon = Requester::anonymous();
    let server = Server::start(config(dir.path())).await.expect("started");
    let h = server.handle().clone();
    let r1 = h
        .acquire(&anon, args("rw", Mode::Shared, None))
        .await
        .expect("reader");
    let leader = h
        .acquire(&anon, args("e", Mode::Exclusive, Some("v1")))
        .await
        .expect("leader");
    // Churn past the snapshot threshold, so some state comes from a snapshot ...
    for i in 0..100 {
        let g = h
            .acquire(&anon, args(&format!("churn:{}", i % 5), Mode::Shared, None))
            .await
            .expect("churn");
        assert!(h.release(&anon, g.name, g.token).await.expect("released"));
    }
    // ... and some from the log after it.
    let r2 = h
        .acquire(&anon, args("rw", Mode::Shared, None))
        .await
        .expect("reader");
    let w = h
        .acquire(&anon, args("d", Mode::Exclusive, None))
        .await
        .expect("writer");
    h.downgrade(&anon, w.name.clone(), w.token)
        .await
        .expect("downgraded");
    h.proclaim(
        &anon,
        leader.name.clone(),
        leader.token,
        Value::new("v2").expect("v"),
    )
    .await
    .expect("proclaimed");
    server.shutdown().await.expect("clean shutdown");

    let server = Server::start(config(dir.path())).await.expect("restarted");
    let h = server.handle().clone();
    assert!(h.recovery().snapshot_loaded, "{:?}", h.recovery());
    let rw = h.lock(r1.name.clone()).await.expect("read").expect("held");
    let readers: Vec<(u64, Mode)> = rw.holders.iter().map(|x| (x.fence.get(), x.mode)).collect();
    assert_eq!(
        readers,
        [
            (r1.fence.get(), Mode::Shared),
            (r2.fence.get(), Mode::Shared)
        ]
    );
    let d = h.lock(w.name.clone()).await.expect("read").expect("held");
    assert_eq!(
        (d.holders[0].fence, d.holders[0].mode),
        (w.fence, Mode::Shared)
    );
    let e = h
        .lock(leader.name.clone())
        .await
        .expect("read")
        .expect("held");
    assert_eq!(e.holders[0].value.as_ref().map(Value::as_str), Some("v2"));
    // Still a reader-writer lock: a writer is refused, a reader joins.
    assert!(h
        .acquire(&anon, args("rw", Mode::Exclusive, None))
        .await
        .is_err());
    h.acquire(&anon, args("rw", Mode::Shared, None))
        .await
        .expect("a third reader");
    server.shutdown().await.expect("clean shutdown");
}
