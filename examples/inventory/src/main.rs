//! The inventory race from the reference material, and how a fence stops it.
//!
//! One item is in stock. Several workers each take the lock `inventory:item:1`, read
//! the stock, and sell the item if there is one. The first worker is **paused** right
//! after it decided to sell — a stop-the-world GC pause or `SIGSTOP`, simulated by
//! blocking its whole runtime (its lock renewal included) — for longer than its
//! lease. The lock server expires its lease and the next worker sells the item. Then
//! the paused worker wakes up and writes, still believing it holds the lock:
//!
//! - with fencing (the default) its write carries its old fence and is **refused**:
//!   one sale, stock 0;
//! - with `--no-fencing` the write goes through: two sales of one item, stock -1.
//!
//! The stock lives in a PostgreSQL row (`--gate postgres`: a throwaway server is
//! started, or pass `--postgres CONNSTR`) or in memory (`--gate memory`, the default).
//! A throwaway lock server is embedded unless `--server URL` is given.
//!
//! Run it from the repository root:
//!
//! ```sh
//! cargo run -p fencelock-example-inventory -- --gate postgres
//! cargo run -p fencelock-example-inventory -- --gate postgres --no-fencing
//! ```
//!
//! The last line of the output sums it up: `result: stock=… sales=… stale_refused=…`.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context as _};
use clap::{Parser, ValueEnum};
use fencelock_fence::{FenceError, GateMetrics, MemoryGate, PgFence};
use tokio_postgres::NoTls;

/// The lock that serializes the workers.
const LOCK: &str = "inventory:item:1";
/// The resource key in the in-memory gate.
const KEY: &str = "item:1";
/// The table in PostgreSQL (created by this example).
const TABLE: &str = "fencelock_example_inventory";

#[derive(Parser, Debug)]
#[command(
    about = "The inventory race: a paused lock holder wakes up and writes; the fence refuses it."
)]
struct Args {
    /// Where the stock lives.
    #[arg(long, value_enum, default_value_t = Gate::Memory)]
    gate: Gate,
    /// Write without the fence check, to see the lost update it prevents.
    #[arg(long)]
    no_fencing: bool,
    /// A running fencelock server (default: start a throwaway one).
    #[arg(long, value_name = "URL")]
    server: Option<String>,
    /// A PostgreSQL connection string for `--gate postgres` (default: start a
    /// throwaway server). The example (re)creates its own table in it.
    #[arg(long, value_name = "CONNSTR")]
    postgres: Option<String>,
    /// How many workers compete for the item (at least 2).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(2..=32))]
    workers: u32,
    /// Lease of the worker that gets paused, in milliseconds (the others get ten
    /// times as long).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(10..=60_000))]
    ttl_ms: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Gate {
    /// `fencelock_fence::MemoryGate`.
    Memory,
    /// A PostgreSQL row with a `fence` column, written with `fencelock_fence::PgFence`.
    Postgres,
}

/// What all workers share.
struct Shop {
    server_url: String,
    ttl: Duration,
    fencing: bool,
    kind: ShopKind,
    sales: AtomicU64,
}

enum ShopKind {
    Memory {
        /// The stock behind the fence check.
        gate: MemoryGate<i64>,
        /// The stock when `--no-fencing`: a plain value anyone may overwrite.
        plain: Arc<Mutex<i64>>,
    },
    Postgres {
        conn: String,
        fence: PgFence,
    },
}

/// One worker's connection to the stock.
enum Store<'a> {
    Memory {
        gate: &'a MemoryGate<i64>,
        plain: &'a Mutex<i64>,
    },
    Postgres {
        client: tokio_postgres::Client,
        fence: &'a PgFence,
    },
}

impl Shop {
    async fn open(&self) -> anyhow::Result<Store<'_>> {
        Ok(match &self.kind {
            ShopKind::Memory { gate, plain } => Store::Memory { gate, plain },
            ShopKind::Postgres { conn, fence } => Store::Postgres {
                client: pg_connect(conn).await?,
                fence,
            },
        })
    }

    fn stale_refused(&self) -> u64 {
        match &self.kind {
            ShopKind::Memory { gate, .. } => gate.stale_rejections(),
            ShopKind::Postgres { fence, .. } => fence.stale_rejections(),
        }
    }
}

impl Store<'_> {
    async fn stock(&self) -> anyhow::Result<i64> {
        Ok(match self {
            Store::Memory { gate, plain } => match gate.get(KEY) {
                Some((_, stock)) => stock,
                None => *plain.lock().unwrap(),
            },
            Store::Postgres { client, .. } => client
                .query_one(&format!("SELECT stock FROM {TABLE} WHERE id = 1"), &[])
                .await?
                .get(0),
        })
    }

    /// Decrements the stock, with the fence check or (`fencing == false`) without.
    /// The outer error is an infrastructure failure; the inner one a refused write.
    async fn sell_one(&self, fence: u64, fencing: bool) -> anyhow::Result<Result<(), FenceError>> {
        match self {
            Store::Memory { gate, plain } => {
                if fencing {
                    Ok(gate.update(KEY, fence, |stock| stock.copied().unwrap_or(0) - 1))
                } else {
                    *plain.lock().unwrap() -= 1;
                    Ok(Ok(()))
                }
            }
            Store::Postgres { client, fence: pg } => {
                if fencing {
                    // UPDATE … SET stock = stock - 1, fence = $1 WHERE id = $2 AND fence < $1
                    match pg
                        .update(client, &1i64, fence, "stock = stock - 1", &[])
                        .await
                    {
                        Err(e) if e.is_stale() => Ok(Err(e)),
                        other => Ok(Ok(other?)),
                    }
                } else {
                    client
                        .execute(
                            &format!("UPDATE {TABLE} SET stock = stock - 1 WHERE id = 1"),
                            &[],
                        )
                        .await?;
                    Ok(Ok(()))
                }
            }
        }
    }
}

async fn pg_connect(conn: &str) -> anyhow::Result<tokio_postgres::Client> {
    let (client, connection) = tokio_postgres::connect(conn, NoTls)
        .await
        .with_context(|| format!("connect to PostgreSQL ({conn})"))?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}

fn say(who: &str, what: impl std::fmt::Display) {
    println!("{who:>9}: {what}");
}

/// A worker on its own thread and runtime, like a separate process. The paused one
/// blocks that runtime on `pause` after deciding to sell.
fn spawn_worker(
    shop: Arc<Shop>,
    id: u32,
    pause: Option<(mpsc::Sender<()>, mpsc::Receiver<()>)>,
) -> std::thread::JoinHandle<anyhow::Result<()>> {
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        runtime.block_on(work(&shop, id, pause))
    })
}

async fn work(
    shop: &Shop,
    id: u32,
    pause: Option<(mpsc::Sender<()>, mpsc::Receiver<()>)>,
) -> anyhow::Result<()> {
    let me = format!("worker-{id}");
    let client = fencelock::Client::connect(&shop.server_url).await?;
    let store = shop.open().await?;
    let guard = client
        .lock(LOCK)
        .ttl(shop.ttl)
        .wait(Duration::from_secs(30))
        .owner(me.as_str())
        .acquire()
        .await?;
    let fence = guard.fence();
    let stock = store.stock().await?;
    say(
        &me,
        format_args!("acquired {LOCK} with fence {fence}; stock is {stock}"),
    );
    if stock <= 0 {
        say(&me, "sold out, nothing to sell");
        guard.release().await?;
        return Ok(());
    }
    if let Some((paused, resume)) = pause {
        say(
            &me,
            format_args!(
                "still holds the lock (lost: {}), decides to sell... and is PAUSED \
                 (GC pause / SIGSTOP): no renewals, no writes",
                guard.is_lost()
            ),
        );
        let _ = paused.send(());
        // Blocking the thread stops this whole runtime, renewal task included, as a
        // stopped process would be. `recv` returns when the driver resumes us.
        let _ = resume.recv();
        say(
            &me,
            format_args!(
                "wakes up; its lease expired meanwhile (lost: {}), but the pause came between \
                 its check and its write, so it writes with its old fence {fence}",
                guard.is_lost()
            ),
        );
    }
    match store.sell_one(fence, shop.fencing).await? {
        Ok(()) => {
            shop.sales.fetch_add(1, Ordering::SeqCst);
            say(
                &me,
                format_args!("SOLD the item (stock now {})", store.stock().await?),
            );
        }
        Err(refused) => say(&me, format_args!("write REFUSED: {refused}")),
    }
    // The paused worker's lease is gone already; its release just says so.
    let _ = tokio::time::timeout(Duration::from_secs(10), guard.release()).await;
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();

    // The lock server.
    let mut embedded = None;
    let server_url = match &args.server {
        Some(url) => url.clone(),
        None => {
            let dir = tempfile::tempdir()?;
            let listen: SocketAddr = "127.0.0.1:0".parse()?;
            let config = fencelock_server::ServerConfig::new(
                listen,
                fencelock_server::EngineConfig::new(dir.path()),
            );
            let server = fencelock_server::Server::start(config)
                .await
                .map_err(|e| anyhow::anyhow!("start the embedded lock server: {e}"))?;
            let url = format!("http://{}", server.local_addr());
            embedded = Some((server, dir));
            url
        }
    };

    // The stock: one item.
    let mut throwaway_pg = None;
    let kind = match args.gate {
        Gate::Memory => {
            let gate = MemoryGate::named("inventory");
            if !args.no_fencing {
                gate.seed(KEY, 1);
            }
            ShopKind::Memory {
                gate,
                plain: Arc::new(Mutex::new(1)),
            }
        }
        Gate::Postgres => {
            let conn = match &args.postgres {
                Some(conn) => conn.clone(),
                None => {
                    let pg = tokio::task::spawn_blocking(fencelock_testkit::Postgres::start)
                        .await?
                        .context("start a throwaway PostgreSQL server")?;
                    let conn = pg.connection_string();
                    throwaway_pg = Some(pg);
                    conn
                }
            };
            let client = pg_connect(&conn).await?;
            client
                .batch_execute(&format!(
                    "DROP TABLE IF EXISTS {TABLE};
                     CREATE TABLE {TABLE} (
                         id BIGINT PRIMARY KEY,
                         stock BIGINT NOT NULL,
                         fence BIGINT NOT NULL DEFAULT 0
                     );
                     INSERT INTO {TABLE} (id, stock) VALUES (1, 1);"
                ))
                .await
                .context("create the inventory table")?;
            ShopKind::Postgres {
                conn,
                fence: PgFence::new(TABLE)?.named("inventory"),
            }
        }
    };
    let shop = Arc::new(Shop {
        server_url: server_url.clone(),
        ttl: Duration::from_millis(args.ttl_ms),
        fencing: !args.no_fencing,
        kind,
        sales: AtomicU64::new(0),
    });
    println!(
        "lock server {server_url}{}; stock in {}{}; {} workers; lease of worker-1 {} ms; fencing {}",
        if embedded.is_some() { " (embedded)" } else { "" },
        match args.gate {
            Gate::Memory => "memory (MemoryGate)",
            Gate::Postgres => "PostgreSQL (PgFence)",
        },
        match &throwaway_pg {
            Some(pg) => format!(" (throwaway server on port {})", pg.port()),
            None => String::new(),
        },
        args.workers,
        args.ttl_ms,
        if args.no_fencing { "OFF" } else { "on" },
    );
    println!("{:>9}: stock of {LOCK} is 1", "shop");

    // Worker 1 takes the lock first and pauses; the others queue behind it.
    let (paused_tx, paused_rx) = mpsc::channel();
    let (resume_tx, resume_rx) = mpsc::channel();
    let first = spawn_worker(Arc::clone(&shop), 1, Some((paused_tx, resume_rx)));
    if tokio::task::spawn_blocking(move || paused_rx.recv())
        .await?
        .is_err()
    {
        let result = tokio::task::spawn_blocking(move || first.join()).await?;
        bail!("worker-1 stopped before pausing: {result:?}");
    }
    let others: Vec<_> = (2..=args.workers)
        .map(|id| spawn_worker(Arc::clone(&shop), id, None))
        .collect();
    for worker in others {
        tokio::task::spawn_blocking(move || worker.join())
            .await?
            .map_err(|_| anyhow::anyhow!("a worker panicked"))??;
    }
    // Everyone else is done; the paused worker resumes.
    let _ = resume_tx.send(());
    tokio::task::spawn_blocking(move || first.join())
        .await?
        .map_err(|_| anyhow::anyhow!("worker-1 panicked"))??;

    let stock = shop.open().await?.stock().await?;
    let sales = shop.sales.load(Ordering::SeqCst);
    let refused = shop.stale_refused();
    if stock < 0 || sales > 1 {
        println!(
            "{:>9}: LOST UPDATE: {sales} sales of 1 item, stock {stock}",
            "shop"
        );
    } else {
        println!(
            "{:>9}: consistent: {sales} sale, stock {stock}; the stale write was refused",
            "shop"
        );
    }
    println!("result: stock={stock} sales={sales} stale_refused={refused}");

    if let Some((server, dir)) = embedded {
        server.shutdown().await?;
        drop(dir);
    }
    drop(throwaway_pg);
    Ok(())
}
