//! `EventStream` resumes (issue 22, item 5): across a dropped connection without a
//! gap or a repeat, and, when the server can no longer resume, fails with the
//! distinct `ErrorKind::WatchCompacted` instead of skipping ahead.

use crate::support;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fencelock::{
    AcquireSpec, ErrorKind, EventStream, FencelockBackend, LockBackend, ServerConfig, WatchPosition,
};
use support::STEP;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// A TCP forwarder to `target` whose connections can all be cut at once (a dropped
/// connection); new connections are still accepted afterwards.
struct Cutter {
    addr: SocketAddr,
    pipes: Arc<Mutex<Vec<JoinHandle<()>>>>,
    _accept: JoinHandle<()>,
}

impl Cutter {
    async fn start(target: SocketAddr) -> Cutter {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let pipes: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let accepted = pipes.clone();
        let accept = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let pipe = tokio::spawn(async move {
                    if let Ok(mut server) = TcpStream::connect(target).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
                accepted.lock().unwrap().push(pipe);
            }
        });
        Cutter {
            addr,
            pipes,
            _accept: accept,
        }
    }

    /// Drops every open connection (both sockets close).
    fn cut(&self) {
        for pipe in self.pipes.lock().unwrap().drain(..) {
            pipe.abort();
        }
    }
}

/// Acquires and releases `name` on `backend`: the events it makes.
async fn round(backend: &FencelockBackend, name: &str) -> Vec<String> {
    let lease = backend
        .acquire(&AcquireSpec::new(name, Duration::from_secs(60)))
        .await
        .unwrap();
    assert!(backend.release(&lease).await.unwrap());
    vec![
        format!("granted {name} {}", lease.fence),
        format!("released {name} {}", lease.fence),
    ]
}

/// The next `n` events of `stream`, checking that positions strictly increase.
async fn read(stream: &mut EventStream, n: usize) -> Vec<(WatchPosition, String)> {
    let mut out: Vec<(WatchPosition, String)> = Vec::new();
    for _ in 0..n {
        let e = tokio::time::timeout(STEP, stream.next())
            .await
            .expect("an event in time")
            .expect("the watch goes on")
            .expect("the stream does not end");
        let position = e.position.expect("events carry their position");
        if let Some((last, _)) = out.last() {
            assert!(position > *last, "{position} after {last}");
        }
        assert!(e.at().is_some(), "events carry their wall-clock time");
        out.push((
            position,
            format!("{} {} {}", e.kind.as_str(), e.name, e.fence.unwrap_or(0)),
        ));
    }
    out
}

fn whats(seen: &[(WatchPosition, String)]) -> Vec<String> {
    seen.iter().map(|(_, w)| w.clone()).collect()
}

/// Nothing more comes right away: what was read was everything (a repeat would
/// be the next event). Bounded by a read of one more event we make ourselves.
async fn next_is(stream: &mut EventStream, backend: &FencelockBackend, name: &str) {
    let expected = round(backend, name).await;
    let got = read(stream, 2).await;
    assert_eq!(
        whats(&got),
        expected,
        "a repeat or an extra event came first"
    );
}

#[tokio::test]
async fn a_watch_resumes_across_a_dropped_connection_without_gap_or_repeat() {
    let server = support::TestServer::start().await;
    let cutter = Cutter::start(server.addr()).await;
    // The watcher goes through the cutter; the changes go straight to the server.
    let watcher = FencelockBackend::connect(ServerConfig::new(format!("http://{}", cutter.addr)))
        .await
        .unwrap();
    let backend = server.backend().await;
    let mut stream = watcher.watch("w:").await.unwrap();
    assert!(stream.position().is_some(), "the start position is known");

    let mut expected = Vec::new();
    for name in ["w:a", "w:b"] {
        expected.extend(round(&backend, name).await);
    }
    let mut seen = read(&mut stream, expected.len()).await;
    // Made while the connection is cut and before the watcher notices.
    cutter.cut();
    for name in ["w:c", "other", "w:d"] {
        let events = round(&backend, name).await;
        if name.starts_with("w:") {
            expected.extend(events);
        }
    }
    seen.extend(read(&mut stream, expected.len() - seen.len()).await);
    assert_eq!(whats(&seen), expected);
    assert!(seen.windows(2).all(|w| w[0].0 < w[1].0));
    next_is(&mut stream, &backend, "w:e").await;
    let last = read_position(&mut stream, &backend).await;
    assert_eq!(stream.position(), Some(last));
}

/// Makes one more event and returns its position (the stream's position after it).
async fn read_position(stream: &mut EventStream, backend: &FencelockBackend) -> WatchPosition {
    round(backend, "w:last").await;
    let got = read(stream, 2).await;
    got[1].0
}

#[tokio::test]
async fn a_watch_that_cannot_resume_fails_with_watch_compacted() {
    let dir = tempfile::tempdir().unwrap();
    let mut engine = fencelock_server::EngineConfig::new(dir.path());
    engine.watch_history = 4;
    let config = fencelock_server::ServerConfig::new("127.0.0.1:0".parse().unwrap(), engine);
    let server = fencelock_server::Server::start(config).await.unwrap();
    let cutter = Cutter::start(server.local_addr()).await;
    let watcher = FencelockBackend::connect(ServerConfig::new(format!("http://{}", cutter.addr)))
        .await
        .unwrap();
    let backend =
        FencelockBackend::connect(ServerConfig::new(format!("http://{}", server.local_addr())))
            .await
            .unwrap();
    let mut stream = watcher.watch("").await.unwrap();
    round(&backend, "c:a").await;
    let first = read(&mut stream, 2).await;
    let old = first[0].0;

    // More events than the history holds while the watcher is cut off: the
    // server cannot resume it, and says so rather than skipping ahead.
    cutter.cut();
    for _ in 0..3 {
        round(&backend, "c:b").await;
    }
    let err = tokio::time::timeout(STEP, stream.next())
        .await
        .expect("an answer in time")
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::WatchCompacted, "{err}");
    let again = stream.next().await.unwrap_err();
    assert_eq!(
        again.kind(),
        ErrorKind::WatchCompacted,
        "the stream is over"
    );

    // Asked directly: an old position, and one from the future.
    let err = watcher.watch_after("", Some(old)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::WatchCompacted, "{err}");
    let future = WatchPosition {
        index: old.index + 1_000_000,
        ordinal: 0,
    };
    let err = watcher.watch_after("", Some(future)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::WatchCompacted, "{err}");
    assert!(err.to_string().contains("another data directory"), "{err}");

    // A recent position still resumes.
    let mut resumed = watcher.watch("").await.unwrap();
    let start = resumed.position().unwrap();
    let mut again = watcher.watch_after("", Some(start)).await.unwrap();
    let expected = round(&backend, "c:c").await;
    assert_eq!(whats(&read(&mut again, 2).await), expected);
    assert_eq!(whats(&read(&mut resumed, 2).await), expected);
}

/// A watcher that falls behind the server's live channel (the server ends its call
/// with DATA_LOSS) is resumed from the history by the stream itself: every event,
/// in order, none twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watcher_that_fell_behind_is_resumed_from_the_history() {
    let dir = tempfile::tempdir().unwrap();
    let mut engine = fencelock_server::EngineConfig::new(dir.path());
    engine.durability = fencelock_server::engine::Durability::None;
    let config = fencelock_server::ServerConfig::new("127.0.0.1:0".parse().unwrap(), engine);
    let server = fencelock_server::Server::start(config).await.unwrap();
    let url = format!("http://{}", server.local_addr());
    let backend = FencelockBackend::connect(ServerConfig::new(url))
        .await
        .unwrap();
    let mut stream = backend.watch("lag:").await.unwrap();
    // Nothing is read meanwhile: 1 KiB owners fill the connection's windows, then
    // the server's channel overflows.
    let rounds = fencelock_server::engine::EVENT_BUFFER;
    let mut spec = AcquireSpec::new("lag:x", Duration::from_secs(60));
    spec.owner = "o".repeat(1000);
    for _ in 0..rounds {
        let lease = backend.acquire(&spec).await.unwrap();
        assert!(backend.release(&lease).await.unwrap());
    }
    let seen = read(&mut stream, 2 * rounds).await;
    let kinds: Vec<String> = seen
        .iter()
        .map(|(_, w)| w.split(' ').next().unwrap().to_owned())
        .collect();
    assert!(
        kinds.chunks(2).all(|c| c == ["granted", "released"]),
        "out of order"
    );
    let fences: Vec<&str> = seen
        .iter()
        .map(|(_, w)| w.rsplit(' ').next().unwrap())
        .collect();
    assert!(fences.chunks(2).all(|c| c[0] == c[1]), "a gap");
    server.shutdown().await.unwrap();
}
