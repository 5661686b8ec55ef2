//! What only the PostgreSQL backends do, each test on its own throwaway cluster.
//!
//! Table mode: fences drawn under the row lock never go back, measured against the
//! naive recipe (a sequence value drawn before the row is won) under the same
//! contention; a release announces itself with `NOTIFY` and keeps the row.
//! Advisory mode: the lease is the session's idle timeout; renewals keep the lock;
//! the lock is visible in `pg_locks` under its documented key.

use std::sync::Arc;
use std::time::Duration;

use fencelock::postgres::{advisory_key, PostgresAdvisoryBackend, PostgresBackend, PostgresConfig};
use fencelock::{AcquireSpec, ErrorKind, LockBackend};
use fencelock_conformance::step;
use fencelock_testkit::Postgres;
use tokio_postgres::{AsyncMessage, Client, NoTls};

async fn start() -> Postgres {
    tokio::task::spawn_blocking(Postgres::start)
        .await
        .expect("start task")
        .expect("PostgreSQL starts")
}

/// A plain connection for the test's own SQL; notifications go to the returned
/// receiver.
async fn raw(
    server: &Postgres,
) -> (
    Client,
    tokio::sync::mpsc::UnboundedReceiver<(String, String)>,
) {
    let (client, mut connection) = tokio_postgres::connect(&server.connection_string(), NoTls)
        .await
        .expect("connect");
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(Ok(message)) = std::future::poll_fn(|cx| connection.poll_message(cx)).await {
            if let AsyncMessage::Notification(n) = message {
                let _ = tx.send((n.channel().to_owned(), n.payload().to_owned()));
            }
        }
    });
    (client, rx)
}

fn spec(name: &str, ttl: Duration, wait: Duration) -> AcquireSpec {
    let mut spec = AcquireSpec::new(name, ttl);
    spec.wait = wait;
    spec
}

/// Every place where a history of fences, in the order the grants were made, fails to
/// increase: `(index, previous fence, fence)`.
fn fence_decreases(history: &[i64]) -> Vec<(usize, i64, i64)> {
    history
        .windows(2)
        .enumerate()
        .filter(|(_, pair)| pair[1] <= pair[0])
        .map(|(index, pair)| (index + 1, pair[0], pair[1]))
        .collect()
}

#[test]
fn the_fence_checker_catches_a_planted_decrease() {
    assert_eq!(fence_decreases(&[1, 2, 3, 7, 9]), []);
    // A slow winner carrying a fence drawn before the previous holder's.
    assert_eq!(fence_decreases(&[1, 2, 5, 4, 6]), [(3, 5, 4)]);
    // A fence reused is as bad as one that goes back.
    assert_eq!(fence_decreases(&[3, 3]), [(1, 3, 3)]);
}

/// Logs every new grant of the two lock tables into `grant_log`, in the order the
/// grants happen: a grant's trigger runs under the row lock (or after the deletion)
/// that made the previous grant's transaction commit first.
const GRANT_LOG: &str = "
CREATE TABLE grant_log (id bigserial PRIMARY KEY, recipe text NOT NULL, fence bigint NOT NULL);
CREATE FUNCTION log_grant() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.owner_token IS NOT NULL
     AND (TG_OP = 'INSERT' OR NEW.owner_token IS DISTINCT FROM OLD.owner_token) THEN
    INSERT INTO grant_log (recipe, fence) VALUES (TG_ARGV[0], NEW.fencing_seq);
  END IF;
  RETURN NULL;
END $$;
CREATE TRIGGER log_grant AFTER INSERT OR UPDATE ON distributed_lock
  FOR EACH ROW EXECUTE FUNCTION log_grant('ours');

-- The naive recipe (crates/fencelock-bench/src/targets/pg.rs), with a 20 ms lease,
-- once with nextval in the upsert (as the benchmark does) and once with nextval
-- fetched by the client first.
CREATE TABLE naive_lock (
  lock_name    VARCHAR(200) PRIMARY KEY,
  owner_token  VARCHAR(100) NOT NULL,
  fencing_seq  BIGINT NOT NULL,
  lease_until  TIMESTAMP NOT NULL,
  updated_at   TIMESTAMP NOT NULL
);
CREATE TABLE naive_client_lock (LIKE naive_lock INCLUDING ALL);
CREATE SEQUENCE naive_fencing_seq;
CREATE TRIGGER log_grant AFTER INSERT OR UPDATE ON naive_lock
  FOR EACH ROW EXECUTE FUNCTION log_grant('naive');
CREATE TRIGGER log_grant AFTER INSERT OR UPDATE ON naive_client_lock
  FOR EACH ROW EXECUTE FUNCTION log_grant('naive-client');
";

/// The benchmark's statement: the sequence value is drawn when the statement starts,
/// before it waits for (and perhaps wins) the row.
const NAIVE_ACQUIRE: &str = "
INSERT INTO naive_lock (lock_name, owner_token, fencing_seq, lease_until, updated_at)
VALUES ($1, $2, nextval('naive_fencing_seq'), localtimestamp + interval '20 milliseconds', localtimestamp)
ON CONFLICT (lock_name) DO UPDATE
  SET owner_token = EXCLUDED.owner_token, fencing_seq = EXCLUDED.fencing_seq,
      lease_until = EXCLUDED.lease_until, updated_at = EXCLUDED.updated_at
  WHERE naive_lock.lease_until < localtimestamp
RETURNING fencing_seq";

/// The same with the fence fetched by the client beforehand (`SELECT nextval(…)`),
/// the recipe as often written: the window between drawing and winning is a round
/// trip.
const NAIVE_CLIENT_ACQUIRE: &str = "
INSERT INTO naive_client_lock (lock_name, owner_token, fencing_seq, lease_until, updated_at)
VALUES ($1, $2, $3, localtimestamp + interval '20 milliseconds', localtimestamp)
ON CONFLICT (lock_name) DO UPDATE
  SET owner_token = EXCLUDED.owner_token, fencing_seq = EXCLUDED.fencing_seq,
      lease_until = EXCLUDED.lease_until, updated_at = EXCLUDED.updated_at
  WHERE naive_client_lock.lease_until < localtimestamp
RETURNING fencing_seq";

#[derive(Debug, Clone, Copy)]
enum Naive {
    /// `nextval` inside the upsert.
    InStatement,
    /// `nextval` fetched by the client, then the upsert.
    InClient,
}

const TASKS: usize = 8;
const GRANTS_PER_TASK: usize = 200;
/// Every this many grants a task lets its lease expire instead of releasing.
const EXPIRE_EVERY: usize = 10;
const SHORT_TTL: Duration = Duration::from_millis(20);

/// One task of our recipe: `GRANTS_PER_TASK` grants of one lock through its own
/// backend, waiting as long as it takes (a `Timeout` just means "ask again").
async fn our_task(server_conninfo: String, task: usize) {
    let backend = PostgresBackend::connect(PostgresConfig::new(server_conninfo))
        .await
        .expect("connect");
    for n in 0..GRANTS_PER_TASK {
        let lease = loop {
            match backend
                .acquire(&spec("contended", SHORT_TTL, Duration::from_secs(5)))
                .await
            {
                Ok(lease) => break lease,
                Err(e) if e.kind() == ErrorKind::Timeout => continue,
                Err(e) => panic!("task {task}: acquire: {e}"),
            }
        };
        if n % EXPIRE_EVERY != 0 {
            backend.release(&lease).await.expect("release");
        }
    }
}

/// One task of the naive recipe: insert-or-take-over, polled every millisecond while
/// busy; release deletes the row.
async fn naive_task(client: Client, recipe: Naive, task: usize) {
    let (acquire, table) = match recipe {
        Naive::InStatement => (NAIVE_ACQUIRE, "naive_lock"),
        Naive::InClient => (NAIVE_CLIENT_ACQUIRE, "naive_client_lock"),
    };
    let acquire = client.prepare(acquire).await.expect("prepare");
    let release = client
        .prepare(&format!(
            "DELETE FROM {table} WHERE lock_name = $1 AND owner_token = $2"
        ))
        .await
        .expect("prepare");
    let next = client
        .prepare("SELECT nextval('naive_fencing_seq')")
        .await
        .expect("prepare");
    for n in 0..GRANTS_PER_TASK {
        let token = format!("naive-{task}-{n}");
        loop {
            let rows = match recipe {
                Naive::InStatement => client.query(&acquire, &[&"contended", &token]).await,
                Naive::InClient => {
                    let fence: i64 = client.query_one(&next, &[]).await.expect("nextval").get(0);
                    client
                        .query(&acquire, &[&"contended", &token, &fence])
                        .await
                }
            };
            if !rows.expect("naive acquire").is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        if n % EXPIRE_EVERY != 0 {
            client
                .execute(&release, &[&"contended", &token])
                .await
                .expect("naive release");
        }
    }
}

/// The measurement: 8 tasks × 200 grants of one lock with a short lease, our
/// recipe and two naive ones at the same time, each grant logged in grant order by a
/// trigger. Ours must never issue a fence smaller than (or equal to) the one before;
/// the naive recipe's decreases (both variants) are counted and printed: how many show
/// up depends on scheduling, so the count is reported, not asserted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fences_drawn_under_the_row_lock_never_go_back_unlike_the_naive_recipe() {
    let server = start().await;
    // Creates distributed_lock.
    drop(
        PostgresBackend::connect(PostgresConfig::new(server.connection_string()))
            .await
            .expect("connect"),
    );
    let (admin, _) = raw(&server).await;
    admin
        .batch_execute(GRANT_LOG)
        .await
        .expect("set up the grant log");

    let mut tasks = Vec::new();
    for task in 0..TASKS {
        tasks.push(tokio::spawn(our_task(server.connection_string(), task)));
        for recipe in [Naive::InStatement, Naive::InClient] {
            let (client, _) = raw(&server).await;
            tasks.push(tokio::spawn(naive_task(client, recipe, task)));
        }
    }
    let all = async {
        for task in tasks {
            task.await.expect("task");
        }
    };
    tokio::time::timeout(Duration::from_secs(300), all)
        .await
        .expect("the contention run finishes within 5 minutes");

    let history = |recipe: &'static str| {
        let admin = &admin;
        async move {
            admin
                .query(
                    "SELECT fence FROM grant_log WHERE recipe = $1 ORDER BY id",
                    &[&recipe],
                )
                .await
                .expect("read the grant log")
                .iter()
                .map(|row| row.get::<_, i64>(0))
                .collect::<Vec<i64>>()
        }
    };
    let ours = history("ours").await;
    let total = TASKS * GRANTS_PER_TASK;
    assert_eq!(ours.len(), total, "every grant of ours was logged");

    assert_eq!(
        fence_decreases(&ours),
        [],
        "our recipe issued a fence that did not increase"
    );
    // Drawn only by grants, under the row lock: no gaps either.
    assert_eq!(ours, (1..=total as i64).collect::<Vec<_>>());

    for recipe in ["naive", "naive-client"] {
        let naive = history(recipe).await;
        assert_eq!(naive.len(), total, "every {recipe} grant was logged");
        let decreases = fence_decreases(&naive);
        println!(
            "{recipe} recipe: {} fence decrease(s) in {total} grants (ours: 0)",
            decreases.len()
        );
        for (index, before, after) in decreases.iter().take(10) {
            println!("  grant #{index}: fence {after} after fence {before}");
        }
    }
}

/// A release marks the row free (the fence counter stays) and announces the lock name
/// on the channel, so other backends' waiters wake.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_notifies_and_keeps_the_row() {
    let server = start().await;
    let backend = PostgresBackend::connect(PostgresConfig::new(server.connection_string()))
        .await
        .expect("connect");
    let (admin, mut notifications) = raw(&server).await;
    admin
        .batch_execute("LISTEN fencelock_release")
        .await
        .expect("listen");
    let name = "job:daily-settlement:2026-09-16";
    let lease = step(backend.acquire(&spec(name, Duration::from_secs(60), Duration::ZERO)))
        .await
        .expect("acquire");
    assert!(step(backend.release(&lease)).await.expect("release"));
    let (channel, payload) = step(notifications.recv()).await.expect("a notification");
    assert_eq!(
        (channel.as_str(), payload.as_str()),
        ("fencelock_release", name)
    );

    let row = admin
        .query_one(
            "SELECT owner_token IS NULL, request_id IS NULL, fencing_seq, lease_until < now() \
             FROM distributed_lock WHERE lock_name = $1",
            &[&name],
        )
        .await
        .expect("the row is still there");
    assert_eq!(
        (
            row.get::<_, bool>(0),
            row.get::<_, bool>(1),
            row.get::<_, i64>(2),
            row.get::<_, bool>(3)
        ),
        (true, true, lease.fence as i64, true),
        "a released row is free and keeps its fence"
    );
    // A failed release (not held any more) announces nothing.
    assert!(!step(backend.release(&lease)).await.expect("release again"));
    let next = step(backend.acquire(&spec(name, Duration::from_secs(60), Duration::ZERO)))
        .await
        .expect("acquire again");
    assert_eq!(next.fence, lease.fence + 1);
    assert!(step(backend.release(&next)).await.expect("release"));
    let (_, payload) = step(notifications.recv()).await.expect("a notification");
    assert_eq!(
        payload, name,
        "exactly one notification per successful release"
    );
}

/// A retry whose grant has expired is not given the old grant back: the lock is free,
/// so it is a new grant with a new fence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_after_expiry_is_a_new_grant() {
    let server = start().await;
    let backend = PostgresBackend::connect(PostgresConfig::new(server.connection_string()))
        .await
        .expect("connect");
    let request = spec("retry-late", Duration::from_millis(50), Duration::ZERO);
    let first = step(backend.acquire(&request)).await.expect("acquire");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let again = step(backend.acquire(&request)).await.expect("retry");
    assert_ne!(again.owner_token, first.owner_token);
    assert!(again.fence > first.fence);
    match step(backend.renew(&first, Duration::from_secs(1))).await {
        Err(e) => assert_eq!(e.kind(), ErrorKind::NotHeld, "{e}"),
        Ok(ttl) => panic!("the expired grant was renewed for {ttl:?}"),
    }
}

async fn advisory(server: &Postgres) -> Arc<PostgresAdvisoryBackend> {
    Arc::new(
        PostgresAdvisoryBackend::connect(PostgresConfig::new(server.connection_string()))
            .await
            .expect("connect"),
    )
}

/// The lease is `idle_session_timeout`: a holder that sends nothing loses its session
/// and its lock on the server's say-so; its late renew and release learn the server
/// ended the session (`NotHeld` / `false`), and another client got the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_advisory_holder_loses_its_session() {
    let server = start().await;
    let holder = advisory(&server).await;
    let other = advisory(&server).await;
    let name = "advisory:idle";
    let lease = step(holder.acquire(&spec(name, Duration::from_millis(500), Duration::ZERO)))
        .await
        .expect("acquire");
    let taken = step(other.acquire(&spec(
        name,
        Duration::from_secs(60),
        Duration::from_secs(10),
    )))
    .await
    .expect("granted once the idle session is ended");
    match step(holder.renew(&lease, Duration::from_secs(1))).await {
        Err(e) => assert_eq!(e.kind(), ErrorKind::NotHeld, "{e}"),
        Ok(ttl) => panic!("a session the server ended was renewed for {ttl:?}"),
    }
    assert!(!step(holder.release(&lease)).await.expect("late release"));
    assert_eq!(holder.held(), 0);
    assert!(step(other.release(&taken)).await.expect("release"));
}

/// Renewals (each a statement that restarts the idle timer) keep the lock well past
/// one lease; a release hands it over at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_keep_an_advisory_lock() {
    let server = start().await;
    let holder = advisory(&server).await;
    let other = advisory(&server).await;
    let name = "advisory:renewed";
    let ttl = Duration::from_secs(1);
    let lease = step(holder.acquire(&spec(name, ttl, Duration::ZERO)))
        .await
        .expect("acquire");
    for _ in 0..8 {
        // A third of the lease, as the client library renews.
        tokio::time::sleep(ttl / 3).await;
        assert_eq!(step(holder.renew(&lease, ttl)).await.expect("renew"), ttl);
        match step(other.acquire(&spec(name, ttl, Duration::ZERO))).await {
            Err(e) => assert_eq!(e.kind(), ErrorKind::Held, "{e}"),
            Ok(_) => panic!("granted to another client while renewed"),
        }
    }
    assert!(step(holder.release(&lease)).await.expect("release"));
    let next = step(other.acquire(&spec(name, ttl, Duration::ZERO)))
        .await
        .expect("free after release");
    assert_eq!(next.fence, 0, "advisory locks have no fences");
    assert!(step(other.release(&next)).await.expect("release"));
}

/// What the docs tell operators: the lock is in `pg_locks` under `advisory_key(name)`
/// (high and low halves in classid/objid, objsubid 1), held by a session whose
/// `application_name` is `fencelock:NAME`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_advisory_lock_is_visible_under_its_key() {
    let server = start().await;
    let backend = advisory(&server).await;
    let name = "inventory:item:1234";
    let lease = step(backend.acquire(&spec(name, Duration::from_secs(60), Duration::ZERO)))
        .await
        .expect("acquire");
    let (admin, _) = raw(&server).await;
    let key = advisory_key(name);
    let rows = admin
        .query(
            "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a USING (pid) \
             WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 \
               AND l.classid = (($1::bigint >> 32) & 4294967295)::text::oid \
               AND l.objid = ($1::bigint & 4294967295)::text::oid",
            &[&key],
        )
        .await
        .expect("query pg_locks");
    let holders: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
    assert_eq!(holders, [format!("fencelock:{name}")]);
    assert!(step(backend.release(&lease)).await.expect("release"));
}

/// Waiters are woken by the release's notification, not by polling: while the
/// backend's listening session is up, a lock freed behind its back (no `NOTIFY`) with
/// the old lease still far in the future does not wake the waiter; the notification
/// does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_wake_on_the_notification_not_by_polling() {
    let server = start().await;
    let config = PostgresConfig::new(server.connection_string());
    let holder = PostgresBackend::connect(config.clone())
        .await
        .expect("connect");
    let waiter = Arc::new(PostgresBackend::connect(config).await.expect("connect"));
    let (admin, _) = raw(&server).await;
    let name = "push:wake";
    let held = step(holder.acquire(&spec(name, Duration::from_secs(60), Duration::ZERO)))
        .await
        .expect("acquire");
    let task = {
        let waiter = waiter.clone();
        tokio::spawn(async move {
            waiter
                .acquire(&spec(
                    name,
                    Duration::from_secs(60),
                    Duration::from_secs(25),
                ))
                .await
        })
    };
    // Until the waiter's backend is listening (it starts listening on its first wait).
    step(async {
        loop {
            let listening: i64 = admin
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity \
                     WHERE query = 'LISTEN \"fencelock_release\"'",
                    &[],
                )
                .await
                .expect("pg_stat_activity")
                .get(0);
            if listening == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    // Free the row without a notification: a polling waiter would take it now.
    let freed = admin
        .execute(
            "UPDATE distributed_lock SET owner_token = NULL, request_id = NULL, \
               lease_until = '-infinity' WHERE lock_name = $1",
            &[&name],
        )
        .await
        .expect("free the row");
    assert_eq!(freed, 1);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        !task.is_finished(),
        "the waiter noticed a free lock without a notification (it polls)"
    );
    admin
        .execute("SELECT pg_notify('fencelock_release', $1)", &[&name])
        .await
        .expect("notify");
    let lease = step(task)
        .await
        .expect("waiter task")
        .expect("granted after the notification");
    assert_eq!(lease.fence, held.fence + 1);
    assert!(step(waiter.release(&lease)).await.expect("release"));
}

/// Regression: an advisory acquire cancelled while waiting (its future dropped) must
/// not leave its request id marked "in progress", or every retry with that id would be
/// refused as `Unavailable` for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_advisory_acquire_can_be_retried() {
    let server = start().await;
    let holder = advisory(&server).await;
    let waiter = advisory(&server).await;
    let name = "advisory:cancelled";
    let held = step(holder.acquire(&spec(name, Duration::from_secs(60), Duration::ZERO)))
        .await
        .expect("acquire");
    let request = spec(name, Duration::from_secs(60), Duration::from_secs(20));
    let cancelled =
        tokio::time::timeout(Duration::from_millis(300), waiter.acquire(&request)).await;
    assert!(cancelled.is_err(), "granted while held: {cancelled:?}");
    assert!(step(holder.release(&held)).await.expect("release"));
    let lease = step(waiter.acquire(&request))
        .await
        .expect("the retry is served");
    assert!(step(waiter.release(&lease)).await.expect("release"));
}

/// The schema, table and channel are configurable: a second lock table in its own
/// schema works alongside the default one, with its own fences and notifications.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configured_table_and_channel_are_used() {
    let server = start().await;
    let mut config = PostgresConfig::new(server.connection_string());
    config.schema = "locks".to_owned();
    config.table = "leases".to_owned();
    config.channel = "leases_released".to_owned();
    let holder = PostgresBackend::connect(config.clone())
        .await
        .expect("connect");
    let waiter = Arc::new(PostgresBackend::connect(config).await.expect("connect"));
    let default = PostgresBackend::connect(PostgresConfig::new(server.connection_string()))
        .await
        .expect("connect");
    let name = "shared-name";
    let held = step(holder.acquire(&spec(name, Duration::from_secs(60), Duration::ZERO)))
        .await
        .expect("acquire in locks.leases");
    // The default table is another namespace: the same name is free there.
    let elsewhere = step(default.acquire(&spec(name, Duration::from_secs(60), Duration::ZERO)))
        .await
        .expect("acquire in public.distributed_lock");
    let task = {
        let waiter = waiter.clone();
        tokio::spawn(async move {
            waiter
                .acquire(&spec(
                    name,
                    Duration::from_secs(60),
                    Duration::from_secs(25),
                ))
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!task.is_finished(), "granted while held");
    assert!(step(holder.release(&held)).await.expect("release"));
    let lease = step(task)
        .await
        .expect("task")
        .expect("granted after release");
    assert_eq!(lease.fence, held.fence + 1);
    let (admin, _) = raw(&server).await;
    let fence: i64 = admin
        .query_one(
            "SELECT fencing_seq FROM locks.leases WHERE lock_name = $1",
            &[&name],
        )
        .await
        .expect("the configured table holds the lock")
        .get(0);
    assert_eq!(fence as u64, lease.fence);
    assert!(step(waiter.release(&lease)).await.expect("release"));
    assert!(step(default.release(&elsewhere)).await.expect("release"));
}

/// A pre-existing table of another shape (the reference article's, say) is not
/// silently misused: connecting fails with `InvalidArgument` naming the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_of_another_shape_is_refused() {
    let server = start().await;
    let (admin, _) = raw(&server).await;
    admin
        .batch_execute(
            "CREATE TABLE distributed_lock (
               lock_name    VARCHAR(200) PRIMARY KEY,
               owner_token  VARCHAR(100) NOT NULL,
               fencing_seq  BIGINT NOT NULL,
               lease_until  TIMESTAMP NOT NULL,
               updated_at   TIMESTAMP NOT NULL)",
        )
        .await
        .expect("create the reference table");
    let e = PostgresBackend::connect(PostgresConfig::new(server.connection_string()))
        .await
        .expect_err("connect to a table without request_id and owner columns");
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert!(e.message().contains("distributed_lock"), "{e}");
}

/// An unreachable server is a transient `Unavailable` for both modes (so the client
/// library retries), not a permanent error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_server_is_unavailable() {
    let port = fencelock_testkit::free_port().expect("a free port");
    let config = PostgresConfig::new(format!(
        "host=127.0.0.1 port={port} user=postgres dbname=postgres"
    ));
    let e = PostgresBackend::connect(config.clone())
        .await
        .expect_err("nothing listens there");
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    let e = PostgresAdvisoryBackend::connect(config)
        .await
        .expect_err("nothing listens there");
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
}

/// Advisory mode bounds its connections: one per held lock or acquire in progress, at
/// most `max_connections`; the next acquire is `ResourceExhausted` (transient) until
/// one is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advisory_connections_are_bounded() {
    let server = start().await;
    let mut config = PostgresConfig::new(server.connection_string());
    config.max_connections = 2;
    let backend = PostgresAdvisoryBackend::connect(config)
        .await
        .expect("connect");
    let ttl = Duration::from_secs(60);
    let a = step(backend.acquire(&spec("bounded:a", ttl, Duration::ZERO)))
        .await
        .expect("first");
    let b = step(backend.acquire(&spec("bounded:b", ttl, Duration::ZERO)))
        .await
        .expect("second");
    let e = step(backend.acquire(&spec("bounded:c", ttl, Duration::ZERO)))
        .await
        .expect_err("a third connection");
    assert_eq!(e.kind(), ErrorKind::ResourceExhausted, "{e}");
    assert!(step(backend.release(&a)).await.expect("release"));
    let c = step(backend.acquire(&spec("bounded:c", ttl, Duration::ZERO)))
        .await
        .expect("a slot is free again");
    for lease in [b, c] {
        assert!(step(backend.release(&lease)).await.expect("release"));
    }
}

/// The PIDs of sessions listening on the default channel.
async fn listeners(admin: &Client) -> Vec<i32> {
    admin
        .query(
            "SELECT pid FROM pg_stat_activity WHERE query = 'LISTEN \"fencelock_release\"'",
            &[],
        )
        .await
        .expect("pg_stat_activity")
        .iter()
        .map(|row| row.get(0))
        .collect()
}

/// The listening session comes back after the server ends it, and a waiter that
/// waited through the outage is still woken by the release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_listener_reconnects() {
    let server = start().await;
    let config = PostgresConfig::new(server.connection_string());
    let holder = PostgresBackend::connect(config.clone())
        .await
        .expect("connect");
    let waiter = Arc::new(PostgresBackend::connect(config).await.expect("connect"));
    let (admin, _) = raw(&server).await;
    let name = "listener:reconnect";
    let held = step(holder.acquire(&spec(name, Duration::from_secs(60), Duration::ZERO)))
        .await
        .expect("acquire");
    let task = {
        let waiter = waiter.clone();
        tokio::spawn(async move {
            waiter
                .acquire(&spec(
                    name,
                    Duration::from_secs(60),
                    Duration::from_secs(25),
                ))
                .await
        })
    };
    let first = step(async {
        loop {
            if let [pid] = listeners(&admin).await[..] {
                break pid;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    admin
        .execute("SELECT pg_terminate_backend($1)", &[&first])
        .await
        .expect("terminate the listening session");
    step(async {
        loop {
            if let [pid] = listeners(&admin).await[..] {
                if pid != first {
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(!task.is_finished(), "granted while held");
    assert!(step(holder.release(&held)).await.expect("release"));
    let lease = step(task)
        .await
        .expect("task")
        .expect("granted after release");
    assert_eq!(lease.fence, held.fence + 1);
    assert!(step(waiter.release(&lease)).await.expect("release"));
}

/// The lock table as versions before elections made it.
const TABLE_BEFORE_ELECTIONS: &str = "CREATE TABLE distributed_lock (
   lock_name   text PRIMARY KEY,
   owner_token text,
   owner       text NOT NULL DEFAULT '',
   request_id  text,
   fencing_seq bigint NOT NULL CHECK (fencing_seq > 0),
   lease_until timestamptz NOT NULL,
   updated_at  timestamptz NOT NULL)";

async fn has_leader_value(admin: &Client) -> bool {
    admin
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM information_schema.columns \
             WHERE table_name = 'distributed_lock' AND column_name = 'leader_value')",
            &[],
        )
        .await
        .expect("read the columns")
        .get(0)
}

/// A table made before elections gains `leader_value` at connect, keeps its rows and
/// fences, and the backend then has elections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_made_before_elections_gains_the_leader_value_column() {
    let server = start().await;
    let (admin, _) = raw(&server).await;
    admin
        .batch_execute(TABLE_BEFORE_ELECTIONS)
        .await
        .expect("create the old table");
    admin
        .batch_execute(
            "INSERT INTO distributed_lock VALUES \
             ('scheduler', NULL, '', NULL, 41, '-infinity', now())",
        )
        .await
        .expect("a row with fences already drawn");
    let backend = PostgresBackend::connect(PostgresConfig::new(server.connection_string()))
        .await
        .expect("connect");
    assert!(has_leader_value(&admin).await, "the column was not added");
    assert!(backend.capabilities().elections);
    let mut request = spec("scheduler", Duration::from_secs(30), Duration::ZERO);
    request.owner = "me".to_owned();
    let lease = step(backend.campaign(&request, "10.0.0.1:80"))
        .await
        .expect("campaign");
    assert_eq!(
        lease.fence, 42,
        "the row's fences went on from where they were"
    );
    let leader = step(backend.leader("scheduler"))
        .await
        .expect("leader")
        .expect("a leader");
    assert_eq!(
        (leader.value.as_str(), leader.term, leader.owner.as_str()),
        ("10.0.0.1:80", 42, "me")
    );
}

/// A role that may use the old table but not alter it keeps its locks and has no
/// elections: the capabilities say so and a campaign is `Unsupported`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_that_cannot_alter_the_old_table_works_without_elections() {
    let server = start().await;
    let (admin, _) = raw(&server).await;
    admin
        .batch_execute(&format!(
            "{TABLE_BEFORE_ELECTIONS}; CREATE ROLE app LOGIN; \
             GRANT SELECT, INSERT, UPDATE ON distributed_lock TO app;"
        ))
        .await
        .expect("create the old table and a role without ALTER");
    let conninfo = format!(
        "host=127.0.0.1 port={} user=app dbname=postgres",
        server.port()
    );
    let backend = PostgresBackend::connect(PostgresConfig::new(conninfo))
        .await
        .expect("connect as a role that cannot alter the table");
    assert!(!has_leader_value(&admin).await);
    assert!(!backend.capabilities().elections);
    let request = spec("scheduler", Duration::from_secs(30), Duration::ZERO);
    let e = step(backend.campaign(&request, "v"))
        .await
        .expect_err("campaign without the column");
    assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
    let lease = step(backend.acquire(&request)).await.expect("a plain lock");
    assert!(step(backend.release(&lease)).await.expect("release"));
}
