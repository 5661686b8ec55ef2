//! A TCP proxy that can stall a client's connections: a partition, or a client
//! process paused (SIGSTOP) while its peers go on.

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A TCP proxy on 127.0.0.1 in front of `target`. While paused it forwards nothing in
/// either direction (bytes wait in the kernel buffers) and connections stay open: to
/// the client and to the server it looks like a stalled network or a paused peer.
/// Resuming delivers what waited. Runs on the current tokio runtime; stops with it.
#[derive(Debug)]
pub struct Proxy {
    addr: SocketAddr,
    paused: watch::Sender<bool>,
}

impl Proxy {
    /// Starts a proxy to `target` on a fresh loopback port.
    pub async fn start(target: SocketAddr) -> std::io::Result<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (paused, _) = watch::channel(false);
        let gate = paused.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(target).await else {
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                tokio::spawn(pump(cr, sw, gate.subscribe()));
                tokio::spawn(pump(sr, cw, gate.subscribe()));
            }
        });
        Ok(Proxy { addr, paused })
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops forwarding, in both directions, on every connection.
    pub fn pause(&self) {
        self.paused.send_replace(true);
    }

    /// Forwards again.
    pub fn resume(&self) {
        self.paused.send_replace(false);
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut paused: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        if paused.wait_for(|p| !*p).await.is_err() {
            return;
        }
        let n = tokio::select! {
            n = from.read(&mut buf) => match n { Ok(0) | Err(_) => return, Ok(n) => n },
            // Paused while waiting to read: stop before forwarding anything.
            _ = paused.wait_for(|p| *p) => continue,
        };
        if paused.wait_for(|p| !*p).await.is_err() {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
