//! Per-link TCP proxies between cluster members, for cutting, delaying and flapping
//! single links.
//!
//! Member *i* dials member *j* through the proxy of the ordered pair (i, j)
//! (`fencelock serve --peer-dial j=<proxy>`), so each direction of each link can be
//! faulted alone. A proxy forwards bytes in both directions of the connections its
//! member opens; what flows back on a connection is part of the same link (i → j's
//! requests and j's answers to them), while j's own requests to i go through (j, i).
//!
//! Every proxy runs on one small tokio runtime owned by [`Proxies`]; dropping it
//! closes every listener and connection. Connections per proxy are bounded.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};

/// Most connections one proxy carries at once (a member opens a handful per peer).
const MAX_CONNECTIONS: usize = 64;
/// How long a proxy waits for its target to accept a connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// Longest delay a link can be set to (a longer one is a cut).
pub const MAX_DELAY: Duration = Duration::from_secs(10);

/// What a link does with traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkMode {
    /// Forward at once.
    Pass,
    /// Refuse new connections (accepted, then closed at once) and close the open ones.
    Cut,
    /// Forward every chunk this much later (at most [`MAX_DELAY`]).
    Delay(Duration),
}

/// One proxy: its listening port and its mode.
#[derive(Debug)]
struct Link {
    from: u64,
    to: u64,
    port: u16,
    mode: watch::Sender<LinkMode>,
}

/// The proxies of a cluster run, one per ordered pair of members.
#[derive(Debug)]
pub struct Proxies {
    runtime: Option<tokio::runtime::Runtime>,
    links: Vec<Link>,
}

impl Proxies {
    /// A runtime for proxies, none yet.
    pub fn new() -> Result<Proxies, crate::ChaosError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("chaos-proxy")
            .enable_all()
            .build()
            .map_err(|e| format!("start the proxies' runtime: {e}"))?;
        Ok(Proxies {
            runtime: Some(runtime),
            links: Vec::new(),
        })
    }

    /// Starts the proxy of link `from → to`, forwarding to `target`, on a fresh
    /// loopback port; returns that port.
    pub fn add(
        &mut self,
        from: u64,
        to: u64,
        target: SocketAddr,
    ) -> Result<u16, crate::ChaosError> {
        let runtime = self.runtime.as_ref().ok_or("proxies closed")?;
        let listener = runtime
            .block_on(TcpListener::bind((Ipv4Addr::LOCALHOST, 0)))
            .map_err(|e| format!("bind a proxy port: {e}"))?;
        let port = listener
            .local_addr()
            .map_err(|e| format!("proxy address: {e}"))?
            .port();
        let (mode, rx) = watch::channel(LinkMode::Pass);
        runtime.spawn(serve(listener, target, rx));
        self.links.push(Link {
            from,
            to,
            port,
            mode,
        });
        Ok(port)
    }

    /// The port of link `from → to`'s proxy.
    pub fn port(&self, from: u64, to: u64) -> Option<u16> {
        self.find(from, to).map(|l| l.port)
    }

    /// Sets link `from → to`; `false` if there is no such link.
    pub fn set(&self, from: u64, to: u64, mode: LinkMode) -> bool {
        let mode = match mode {
            LinkMode::Delay(d) => LinkMode::Delay(d.min(MAX_DELAY)),
            other => other,
        };
        match self.find(from, to) {
            Some(link) => {
                link.mode.send_replace(mode);
                true
            }
            None => false,
        }
    }

    /// Sets both directions between `a` and `b`.
    pub fn set_both(&self, a: u64, b: u64, mode: LinkMode) {
        self.set(a, b, mode);
        self.set(b, a, mode);
    }

    /// Sets every link to or from `member` (isolates it with [`LinkMode::Cut`]).
    pub fn set_member(&self, member: u64, mode: LinkMode) {
        for link in self
            .links
            .iter()
            .filter(|l| l.from == member || l.to == member)
        {
            link.mode.send_replace(mode);
        }
    }

    /// Sets every link to `mode` ([`LinkMode::Pass`]: heal everything).
    pub fn set_all(&self, mode: LinkMode) {
        for link in &self.links {
            link.mode.send_replace(mode);
        }
    }

    /// The current mode of link `from → to`.
    pub fn mode(&self, from: u64, to: u64) -> Option<LinkMode> {
        self.find(from, to).map(|l| *l.mode.borrow())
    }

    fn find(&self, from: u64, to: u64) -> Option<&Link> {
        self.links.iter().find(|l| l.from == from && l.to == to)
    }
}

impl Drop for Proxies {
    fn drop(&mut self) {
        // Drops every task: listeners and connections close.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_timeout(Duration::from_secs(1));
        }
    }
}

/// Accepts connections for one link until the runtime stops.
async fn serve(listener: TcpListener, target: SocketAddr, mode: watch::Receiver<LinkMode>) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Ok((inbound, _)) = listener.accept().await else {
            // Out of descriptors, most likely: back off instead of spinning.
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        if *mode.borrow() == LinkMode::Cut {
            drop(inbound);
            continue;
        }
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            drop(inbound);
            continue;
        };
        let mode = mode.clone();
        tokio::spawn(async move {
            connection(inbound, target, mode).await;
            drop(slot);
        });
    }
}

/// Carries one connection until either side closes it or the link is cut.
async fn connection(inbound: TcpStream, target: SocketAddr, mut mode: watch::Receiver<LinkMode>) {
    let Ok(Ok(outbound)) = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(target)).await
    else {
        return;
    };
    let _ = inbound.set_nodelay(true);
    let _ = outbound.set_nodelay(true);
    let (in_read, in_write) = inbound.into_split();
    let (out_read, out_write) = outbound.into_split();
    let forward = pump(in_read, out_write, mode.clone());
    let backward = pump(out_read, in_write, mode.clone());
    let cut = async {
        // Ends when the link is cut (or the proxies are dropped).
        let _ = mode.wait_for(|m| *m == LinkMode::Cut).await;
    };
    tokio::select! {
        _ = forward => {}
        _ = backward => {}
        _ = cut => {}
    }
    // Dropping both halves of both sockets closes the connection on both sides.
}

/// Copies one direction, delaying each chunk as the link's mode says.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mode: watch::Receiver<LinkMode>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let current = *mode.borrow();
        match current {
            LinkMode::Cut => return,
            LinkMode::Delay(d) => tokio::time::sleep(d).await,
            LinkMode::Pass => {}
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpStream as StdStream;

    /// An echo server on a std thread; returns its address.
    fn echo() -> SocketAddr {
        let listener = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            for stream in listener.incoming().take(16) {
                let Ok(mut s) = stream else { continue };
                std::thread::spawn(move || {
                    let mut buf = [0u8; 256];
                    while let Ok(n) = s.read(&mut buf) {
                        if n == 0 || s.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                });
            }
        });
        addr
    }

    fn client(port: u16) -> StdStream {
        let s = StdStream::connect((Ipv4Addr::LOCALHOST, port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s
    }

    /// Sends `msg` and reads what comes back: the echo, or `None` when closed.
    fn round_trip(s: &mut StdStream, msg: &[u8]) -> Option<Vec<u8>> {
        s.write_all(msg).ok()?;
        let mut out = vec![0u8; msg.len()];
        s.read_exact(&mut out).ok()?;
        Some(out)
    }

    #[test]
    fn a_passing_link_forwards_and_a_cut_one_closes() {
        let target = echo();
        let mut proxies = Proxies::new().unwrap();
        let port = proxies.add(1, 2, target).unwrap();
        assert_eq!(proxies.port(1, 2), Some(port));
        assert_eq!(proxies.port(2, 1), None);
        let mut s = client(port);
        assert_eq!(round_trip(&mut s, b"ping").as_deref(), Some(&b"ping"[..]));

        // Cutting closes the open connection and refuses new ones.
        assert!(proxies.set(1, 2, LinkMode::Cut));
        assert_eq!(
            round_trip(&mut s, b"ping"),
            None,
            "existing connection killed"
        );
        let mut s = client(port);
        assert_eq!(round_trip(&mut s, b"ping"), None, "new connection refused");

        // Healing lets new connections through again.
        proxies.set_all(LinkMode::Pass);
        let mut s = client(port);
        assert_eq!(round_trip(&mut s, b"pong").as_deref(), Some(&b"pong"[..]));
    }

    #[test]
    fn member_settings_touch_only_its_links() {
        let target = echo();
        let mut proxies = Proxies::new().unwrap();
        for (a, b) in [(1, 2), (2, 1), (2, 3), (3, 2), (1, 3), (3, 1)] {
            proxies.add(a, b, target).unwrap();
        }
        proxies.set_member(1, LinkMode::Cut);
        assert_eq!(proxies.mode(1, 2), Some(LinkMode::Cut));
        assert_eq!(proxies.mode(3, 1), Some(LinkMode::Cut));
        assert_eq!(proxies.mode(2, 3), Some(LinkMode::Pass));
        proxies.set_both(2, 3, LinkMode::Delay(Duration::from_secs(60)));
        assert_eq!(
            proxies.mode(3, 2),
            Some(LinkMode::Delay(MAX_DELAY)),
            "delays are capped"
        );
        assert!(!proxies.set(4, 1, LinkMode::Pass), "no such link");
    }
}
