//! The PostgreSQL backends built on what the application already holds: the
//! conformance suite for table mode on the application's `tokio_postgres::Client` and
//! on its `deadpool_postgres::Pool`, and for advisory mode on its pool; and, counted
//! in `pg_stat_activity`, that those backends use the application's connections and
//! open none of their own.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use fencelock::postgres::{PostgresAdvisoryBackend, PostgresBackend, PostgresConfig};
use fencelock::{AcquireSpec, BoxFuture, Error, LockBackend};
use fencelock_conformance::{step, Fixture};
use fencelock_testkit::Postgres;
use tokio_postgres::{Client, NoTls};

/// The application's connections carry this name, the observer's another.
const APP: &str = "the-app";

#[derive(Clone, Copy)]
enum Mode {
    TableClient,
    TablePool,
    AdvisoryPool,
}

struct Pg {
    server: Postgres,
    mode: Mode,
}

fn pg_config(addr: SocketAddr) -> tokio_postgres::Config {
    let mut config = tokio_postgres::Config::new();
    config
        .host(addr.ip().to_string())
        .port(addr.port())
        .user("postgres")
        .dbname("postgres")
        .application_name(APP);
    config
}

/// The application's own client.
async fn app_client(addr: SocketAddr) -> Result<Arc<Client>, Error> {
    let (client, connection) = pg_config(addr)
        .connect(NoTls)
        .await
        .map_err(|e| Error::new(fencelock::ErrorKind::Unavailable, e.to_string()))?;
    tokio::spawn(connection);
    Ok(Arc::new(client))
}

/// The application's own pool.
fn app_pool(addr: SocketAddr, max_size: usize) -> deadpool_postgres::Pool {
    let manager = deadpool_postgres::Manager::new(pg_config(addr), NoTls);
    deadpool_postgres::Pool::builder(manager)
        .max_size(max_size)
        .build()
        .expect("a pool")
}

impl Fixture for Pg {
    fn addrs(&self) -> Vec<SocketAddr> {
        vec![SocketAddr::from(([127, 0, 0, 1], self.server.port()))]
    }

    fn connect<'a>(
        &'a self,
        addrs: &'a [SocketAddr],
    ) -> BoxFuture<'a, Result<Arc<dyn LockBackend>, Error>> {
        Box::pin(async move {
            let config = PostgresConfig::default();
            let backend: Arc<dyn LockBackend> = match self.mode {
                Mode::TableClient => Arc::new(
                    PostgresBackend::with_client(app_client(addrs[0]).await?, config).await?,
                ),
                Mode::TablePool => {
                    Arc::new(PostgresBackend::with_pool(app_pool(addrs[0], 4), config).await?)
                }
                Mode::AdvisoryPool => Arc::new(
                    PostgresAdvisoryBackend::with_pool(app_pool(addrs[0], 4), config).await?,
                ),
            };
            Ok(backend)
        })
    }
}

async fn start_server() -> Postgres {
    tokio::task::spawn_blocking(Postgres::start)
        .await
        .expect("start task")
        .expect("PostgreSQL starts")
}

async fn start(mode: Mode) -> Pg {
    Pg {
        server: start_server().await,
        mode,
    }
}

mod table_client {
    use super::*;
    fencelock_conformance::conformance_suite!(start(Mode::TableClient));
}

mod table_pool {
    use super::*;
    fencelock_conformance::conformance_suite!(start(Mode::TablePool));
}

mod advisory_pool {
    use super::*;
    fencelock_conformance::conformance_suite!(start(Mode::AdvisoryPool));
}

fn spec(name: &str, wait: Duration) -> AcquireSpec {
    let mut spec = AcquireSpec::new(name, Duration::from_secs(60));
    spec.wait = wait;
    spec
}

/// Client sessions on the server other than the observer's: (pid, application_name).
async fn sessions(observer: &Client) -> Vec<(i32, String)> {
    observer
        .query(
            "SELECT pid, application_name FROM pg_stat_activity \
             WHERE backend_type = 'client backend' AND pid <> pg_backend_pid() ORDER BY pid",
            &[],
        )
        .await
        .expect("read pg_stat_activity")
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect()
}

async fn observer(server: &Postgres) -> Client {
    let (client, connection) = tokio_postgres::connect(&server.connection_string(), NoTls)
        .await
        .expect("connect the observer");
    tokio::spawn(connection);
    client
}

/// Exercises every call, a waiting acquire included, recording the sessions seen.
async fn exercise(backend: &dyn LockBackend, observer: &Client, seen: &mut Vec<(i32, String)>) {
    let name = "app:exercise";
    let held = step(backend.acquire(&spec(name, Duration::ZERO)))
        .await
        .expect("acquire");
    seen.extend(sessions(observer).await);
    let waiting = spec(name, Duration::from_millis(600));
    let e = step(backend.acquire(&waiting))
        .await
        .expect_err("held: the waiter times out");
    assert_eq!(e.kind(), fencelock::ErrorKind::Timeout, "{e}");
    seen.extend(sessions(observer).await);
    step(backend.renew(&held, Duration::from_secs(60)))
        .await
        .expect("renew");
    assert!(step(backend.release(&held)).await.expect("release"));
    seen.extend(sessions(observer).await);
}

/// Table mode on the application's client runs everything on that one connection:
/// the server never sees a second session. The same check sees the two connections
/// a backend built from a connection string opens (command and `LISTEN`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_mode_on_the_applications_client_opens_no_connection() {
    let server = start_server().await;
    let observer = observer(&server).await;
    let addr = SocketAddr::from(([127, 0, 0, 1], server.port()));
    let client = app_client(addr).await.expect("the application's client");
    let app_pid = sessions(&observer).await;
    assert_eq!(
        app_pid.len(),
        1,
        "only the application's client: {app_pid:?}"
    );
    let backend = PostgresBackend::with_client(client.clone(), PostgresConfig::default())
        .await
        .expect("with_client");
    assert!(!backend.capabilities().push_wakeups);
    let mut seen = Vec::new();
    exercise(&backend, &observer, &mut seen).await;
    seen.sort();
    seen.dedup();
    assert_eq!(seen, app_pid, "sessions other than the application's");
    // The application's client still works for the application.
    client.query_one("SELECT 1", &[]).await.expect("app query");

    let own = PostgresBackend::connect(PostgresConfig::new(server.connection_string()))
        .await
        .expect("connect");
    let mut seen = Vec::new();
    exercise(&own, &observer, &mut seen).await;
    seen.sort();
    seen.dedup();
    assert!(
        seen.len() >= 3,
        "a backend with its own connections must show up: {seen:?}"
    );
}

/// Table mode on the application's pool uses only pooled connections (each named as
/// the application names them) and never more than the pool's size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_mode_on_the_applications_pool_opens_no_connection() {
    let server = start_server().await;
    let observer = observer(&server).await;
    let addr = SocketAddr::from(([127, 0, 0, 1], server.port()));
    let backend = PostgresBackend::with_pool(app_pool(addr, 2), PostgresConfig::default())
        .await
        .expect("with_pool");
    let mut seen = Vec::new();
    exercise(&backend, &observer, &mut seen).await;
    seen.sort();
    seen.dedup();
    assert!(!seen.is_empty() && seen.len() <= 2, "sessions: {seen:?}");
    assert!(
        seen.iter().all(|(_, name)| name == APP),
        "a session not from the pool: {seen:?}"
    );
}

/// Advisory mode on the application's pool holds each lock on a pooled session taken
/// out of the pool, and closes it on release: the holding session is gone from the
/// server afterwards (never handed back to the application holding a lock).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advisory_mode_takes_a_session_out_of_the_pool_per_lock() {
    let server = start_server().await;
    let observer = observer(&server).await;
    let addr = SocketAddr::from(([127, 0, 0, 1], server.port()));
    let backend = PostgresAdvisoryBackend::with_pool(app_pool(addr, 4), PostgresConfig::default())
        .await
        .expect("with_pool");
    let lease = step(backend.acquire(&spec("app:advisory", Duration::ZERO)))
        .await
        .expect("acquire");
    let holders: Vec<i32> = observer
        .query(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted",
            &[],
        )
        .await
        .expect("read pg_locks")
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(holders.len(), 1, "one holding session: {holders:?}");
    let holder = holders[0];
    let all = sessions(&observer).await;
    assert!(
        all.iter().all(|(_, name)| name == APP),
        "a session not from the pool: {all:?}"
    );
    assert!(step(backend.release(&lease)).await.expect("release"));
    // Closing is asynchronous on the server: await the session's end (bounded).
    let mut gone = false;
    for _ in 0..100 {
        if !sessions(&observer)
            .await
            .iter()
            .any(|(pid, _)| *pid == holder)
        {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(gone, "the session that held the lock is still open");
}
