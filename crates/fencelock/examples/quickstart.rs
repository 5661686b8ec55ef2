//! Quickstart: take a lock, use its fence, release it; then run work under
//! `with_lock`, and watch a semaphore refuse a third holder.
//!
//! Start a server (`cargo run --release -- serve`), then:
//!
//! ```sh
//! cargo run -p fencelock --example quickstart -- http://127.0.0.1:7420
//! ```

use std::time::Duration;

use fencelock::{Client, ErrorKind, LockOptions};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), fencelock::Error> {
    let url = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "http://127.0.0.1:7420".to_owned());
    let client = Client::connect(&url).await?;
    println!("connected to {url}: {:?}", client.capabilities());

    // A guard: renewed in the background until released or dropped.
    let guard = client
        .lock("example:inventory:item:1234")
        .ttl(Duration::from_secs(10))
        .wait(Duration::from_secs(5))
        .owner("quickstart example")
        .acquire()
        .await?;
    println!(
        "holding {:?} with fence {} (certainly held for {:?} more)",
        guard.name(),
        guard.fence(),
        guard.valid_for()
    );
    // Someone else trying now is refused at once.
    match client.lock(guard.name()).try_acquire().await {
        Err(e) if e.kind() == ErrorKind::Held => println!("a second try_acquire: {e}"),
        other => println!("unexpected: {other:?}"),
    }
    guard.release().await?;

    // Work under the lock, cancelled if the lock is lost.
    let written = client
        .with_lock(
            "example:job:daily-settlement",
            LockOptions::default().ttl(Duration::from_secs(10)),
            async |guard| {
                // A real job would send `guard.fence()` with every write to its resource.
                format!("settled with fence {}", guard.fence())
            },
        )
        .await?;
    println!("{written}");

    // A semaphore of two.
    let a = client.lock("example:pool").limit(2).acquire().await?;
    let b = client.lock("example:pool").limit(2).acquire().await?;
    let third = client.lock("example:pool").limit(2).try_acquire().await;
    println!(
        "semaphore: fences {} and {}; third holder: {}",
        a.fence(),
        b.fence(),
        third.err().map(|e| e.to_string()).unwrap_or_default()
    );
    a.release().await?;
    b.release().await?;
    Ok(())
}
