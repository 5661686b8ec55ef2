//! The PostgreSQL gate against a real server started for each test (fencelock-testkit).

use crate::support;

use fencelock_fence::{ErrorKind, FenceGate, GateMetrics, PgFence, PgGate, PgWrite};
use fencelock_testkit::Postgres;
use support::Rng;
use tokio_postgres::{Client, NoTls};

async fn connect(pg: &Postgres) -> Client {
    let (client, connection) = tokio_postgres::connect(&pg.connection_string(), NoTls)
        .await
        .expect("connect to the test server");
    tokio::spawn(async move {
        let _ = connection.await;
    });
    client
}

/// The schema from the module docs, with one item in stock.
async fn setup(client: &Client) {
    client
        .batch_execute(
            "CREATE TABLE inventory (
                 id BIGINT PRIMARY KEY,
                 stock INT NOT NULL,
                 fence BIGINT NOT NULL DEFAULT 0
             );
             INSERT INTO inventory (id, stock) VALUES (1, 1);",
        )
        .await
        .unwrap();
}

async fn row(client: &Client, id: i64) -> (i32, i64) {
    let row = client
        .query_one("SELECT stock, fence FROM inventory WHERE id = $1", &[&id])
        .await
        .unwrap();
    (row.get(0), row.get(1))
}

#[tokio::test]
async fn stale_write_is_refused_and_changes_nothing() {
    let pg = Postgres::start().unwrap();
    let client = connect(&pg).await;
    setup(&client).await;
    let inventory = PgFence::new("inventory").unwrap().named("inventory-db");

    inventory
        .update(&client, &1i64, 5, "stock = stock - $1", &[&1i32])
        .await
        .unwrap();
    assert_eq!(row(&client, 1).await, (0, 5));

    // Equal and older fences are refused, and the row is untouched.
    for stale in [5, 4, 1] {
        let err = inventory
            .update(&client, &1i64, stale, "stock = stock - $1", &[&1i32])
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Stale, "fence {stale}: {err}");
        assert_eq!((err.fence(), err.last_fence()), (Some(stale), Some(5)));
        assert_eq!(row(&client, 1).await, (0, 5));
    }
    assert_eq!(inventory.stale_rejections(), 3);

    // A missing row is not a stale fence, and is not counted as one.
    let err = inventory
        .update(&client, &2i64, 9, "stock = 0", &[])
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");

    // Fences that BIGINT cannot hold are refused before reaching the database.
    let err = inventory
        .update(&client, &1i64, i64::MAX as u64 + 1, "stock = 7", &[])
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::FenceOutOfRange, "{err}");
    assert_eq!(row(&client, 1).await, (0, 5));
    assert_eq!(inventory.stale_rejections(), 3);

    // A newer fence applies; the largest storable fence works.
    inventory
        .update(&client, &1i64, 6, "stock = $1", &[&10i32])
        .await
        .unwrap();
    assert_eq!(row(&client, 1).await, (10, 6));
    inventory
        .update(&client, &1i64, i64::MAX as u64, "", &[])
        .await
        .unwrap();
    assert_eq!(row(&client, 1).await, (10, i64::MAX));
    assert_eq!(
        inventory.last_fence(&client, &1i64).await.unwrap(),
        Some(i64::MAX as u64)
    );
}

#[tokio::test]
async fn gate_trait_and_transactions() {
    let pg = Postgres::start().unwrap();
    let mut client = connect(&pg).await;
    setup(&client).await;

    // Inside a transaction that rolls back, nothing is applied, fence included.
    let inventory = PgFence::new("inventory").unwrap();
    let tx = client.transaction().await.unwrap();
    inventory
        .update(&tx, &1i64, 3, "stock = stock - 1", &[])
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(row(&client, 1).await, (1, 0));

    let gate = PgGate::new(client, inventory);
    assert_eq!(gate.name(), "postgres");
    gate.apply(&1i64, 3, PgWrite::new("stock = stock - $1").param(1i32))
        .await
        .unwrap();
    let err = gate
        .apply(&1i64, 2, PgWrite::new("stock = stock - $1").param(1i32))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Stale);
    assert_eq!(gate.stale_rejections(), 1);
    assert_eq!(row(gate.client(), 1).await, (0, 3));
}

/// Many connections write random fences to one row at once. The row ends with the
/// largest fence and the value written with it; a refused write is always stale.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writers_end_with_the_largest_fence() {
    let mut rng = Rng::from_env("postgres concurrent");
    let pg = Postgres::start().unwrap();
    let admin = connect(&pg).await;
    setup(&admin).await;
    let shares: Vec<Vec<u64>> = (0..8).map(|_| rng.fences(25, 400)).collect();
    let max = *shares.iter().flatten().max().unwrap();
    let inventory = std::sync::Arc::new(PgFence::new("inventory").unwrap());
    let mut tasks = Vec::new();
    for share in shares {
        let client = connect(&pg).await;
        let inventory = inventory.clone();
        tasks.push(tokio::spawn(async move {
            let mut applied = 0u64;
            for fence in share {
                // The value written is the fence itself, so the end state names its writer.
                match inventory
                    .update(&client, &1i64, fence, "stock = $1", &[&(fence as i32)])
                    .await
                {
                    Ok(()) => applied += 1,
                    Err(e) => {
                        assert_eq!(e.kind(), ErrorKind::Stale, "{e}");
                        assert!(e.last_fence().unwrap() >= fence, "{e}");
                    }
                }
            }
            applied
        }));
    }
    let mut applied = 0;
    for task in tasks {
        applied += task.await.unwrap();
    }
    assert_eq!(row(&admin, 1).await, (max as i32, max as i64));
    assert_eq!(applied + inventory.stale_rejections(), 8 * 25);
}
