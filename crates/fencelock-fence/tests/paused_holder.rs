//! The scenario fencing exists for, against every gate at once: a holder takes a real
//! lock from a real fencelock server, is paused past its lease (its whole runtime
//! blocked, renewal included, as in a GC pause or SIGSTOP), the next holder gets a
//! larger fence and writes, and then the paused holder wakes up and writes with its
//! old fence. Every gate refuses that write and keeps the newer holder's data.

use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::routing::put;
use axum::Router;
use fencelock_fence::{ErrorKind, FenceGate, FenceLayer, FileGate, MemoryGate, PgFence};
use fencelock_server::{EngineConfig, Server, ServerConfig};
use fencelock_testkit::Postgres;
use http::{Request, StatusCode};
use tokio_postgres::NoTls;
use tower::ServiceExt;

const LOCK: &str = "inventory:item:1";

/// The four protected resources.
struct Resources {
    memory: MemoryGate<String>,
    file: FileGate,
    pg: PgFence,
    pg_conn: String,
    /// An axum app behind the fence layer; its handler stores the body.
    app: Router,
    http_value: Arc<Mutex<String>>,
}

#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Applied,
    Stale,
}

fn outcome<T>(result: Result<T, fencelock_fence::FenceError>) -> Outcome {
    match result {
        Ok(_) => Outcome::Applied,
        Err(e) if e.kind() == ErrorKind::Stale => Outcome::Stale,
        Err(e) => panic!("unexpected error: {e}"),
    }
}

impl Resources {
    /// Writes `value` with `fence` to every resource, on the caller's runtime.
    async fn write_everywhere(&self, fence: u64, value: &str) -> Vec<(&'static str, Outcome)> {
        let (client, connection) = tokio_postgres::connect(&self.pg_conn, NoTls).await.unwrap();
        tokio::spawn(connection);
        let pg = self
            .pg
            .update(&client, &1i64, fence, "value = $1", &[&value])
            .await;
        let response = self
            .app
            .clone()
            .oneshot(
                Request::put("/item")
                    .header("Fencing-Token", fence.to_string())
                    .body(Body::from(value.to_owned()))
                    .unwrap(),
            )
            .await
            .unwrap();
        let http = match response.status() {
            StatusCode::OK => Outcome::Applied,
            StatusCode::CONFLICT => Outcome::Stale,
            other => panic!("unexpected status {other}"),
        };
        vec![
            (
                "memory",
                outcome(self.memory.apply("item", fence, value.to_owned()).await),
            ),
            (
                "file",
                outcome(
                    self.file
                        .apply("item", fence, value.as_bytes().to_vec())
                        .await,
                ),
            ),
            ("postgres", outcome(pg)),
            ("http", http),
        ]
    }

    /// What every resource holds now.
    async fn values(&self) -> Vec<String> {
        let (client, connection) = tokio_postgres::connect(&self.pg_conn, NoTls).await.unwrap();
        tokio::spawn(connection);
        let pg: String = client
            .query_one("SELECT value FROM item WHERE id = 1", &[])
            .await
            .unwrap()
            .get(0);
        vec![
            self.memory.get("item").unwrap().1,
            String::from_utf8(self.file.read("item").unwrap().unwrap()).unwrap(),
            pg,
            self.http_value.lock().unwrap().clone(),
        ]
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_holders_write_is_refused_by_every_gate() {
    // A throwaway lock server and PostgreSQL.
    let server_dir = tempfile::tempdir().unwrap();
    let server = Server::start(ServerConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        EngineConfig::new(server_dir.path()),
    ))
    .await
    .unwrap();
    let url = format!("http://{}", server.local_addr());
    let pg_server = tokio::task::spawn_blocking(Postgres::start)
        .await
        .unwrap()
        .unwrap();
    let (admin, connection) = tokio_postgres::connect(&pg_server.connection_string(), NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    admin
        .batch_execute(
            "CREATE TABLE item (id BIGINT PRIMARY KEY, value TEXT NOT NULL,
                                fence BIGINT NOT NULL DEFAULT 0);
             INSERT INTO item (id, value) VALUES (1, 'initial');",
        )
        .await
        .unwrap();
    let files = tempfile::tempdir().unwrap();
    let http_value = Arc::new(Mutex::new(String::new()));
    let stored = Arc::clone(&http_value);
    let app = Router::new()
        .route(
            "/item",
            put(move |body: String| async move {
                *stored.lock().unwrap() = body;
                "stored"
            }),
        )
        .layer(FenceLayer::by_path());
    let resources = Arc::new(Resources {
        memory: MemoryGate::new(),
        file: FileGate::new(files.path()).unwrap(),
        pg: PgFence::new("item").unwrap(),
        pg_conn: pg_server.connection_string(),
        app,
        http_value,
    });

    // Holder A, on its own thread and runtime, acquires and then is paused.
    let (acquired_tx, acquired_rx) = mpsc::channel();
    let (resume_tx, resume_rx) = mpsc::channel::<()>();
    let holder_a = {
        let (url, resources) = (url.clone(), Arc::clone(&resources));
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let client = fencelock::Client::connect(&url).await.unwrap();
                let guard = client
                    .lock(LOCK)
                    .ttl(Duration::from_millis(500))
                    .acquire()
                    .await
                    .unwrap();
                acquired_tx.send(guard.fence()).unwrap();
                // The pause: nothing on this runtime runs, renewal included.
                resume_rx.recv().unwrap();
                let lost_after_pause = guard.is_lost();
                let outcomes = resources.write_everywhere(guard.fence(), "from A").await;
                (lost_after_pause, outcomes)
            })
        })
    };
    let fence_a = tokio::task::spawn_blocking(move || acquired_rx.recv().unwrap())
        .await
        .unwrap();

    // Holder B waits for the lock: granted only once the server expired A's lease.
    let client = fencelock::Client::connect(&url).await.unwrap();
    let guard_b = client
        .lock(LOCK)
        .ttl(Duration::from_secs(30))
        .wait(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    assert!(
        guard_b.fence() > fence_a,
        "B's fence {} must exceed A's {fence_a}",
        guard_b.fence()
    );
    let b_outcomes = resources.write_everywhere(guard_b.fence(), "from B").await;
    for (gate, outcome) in &b_outcomes {
        assert_eq!(*outcome, Outcome::Applied, "{gate}: B's write must apply");
    }

    // A wakes up and writes with its old fence: refused everywhere.
    resume_tx.send(()).unwrap();
    let (lost_after_pause, a_outcomes) = tokio::task::spawn_blocking(move || holder_a.join())
        .await
        .unwrap()
        .unwrap();
    assert!(lost_after_pause, "A's guard must know its lease is gone");
    for (gate, outcome) in &a_outcomes {
        assert_eq!(
            *outcome,
            Outcome::Stale,
            "{gate}: A's stale write must be refused"
        );
    }
    assert_eq!(a_outcomes.len(), 4);
    assert_eq!(resources.values().await, ["from B"; 4]);

    guard_b.release().await.unwrap();
    server.shutdown().await.unwrap();
}
