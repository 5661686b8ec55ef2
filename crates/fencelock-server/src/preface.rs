//! The first bytes of a connection, read within a deadline.
//!
//! hyper-util's protocol detection (HTTP/1.1 or HTTP/2 by prior knowledge) waits for
//! the first bytes without any timeout, and hyper's header read timeout only starts
//! once it has decided. So a client that connects and sends nothing (or a few bytes of
//! the HTTP/2 preface) held its connection slot forever, and `max_connections` silent
//! clients locked everyone out. [`read_start`] reads what detection needs within the
//! header read timeout, and [`Prefixed`] hands those bytes back in front of the stream.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};

/// What an HTTP/2 client sends first; anything that departs from it is HTTP/1.1.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Reads until the protocol can be told (the whole HTTP/2 preface, or a byte that
/// departs from it), within `within`. `None` if the client sent nothing in time, or
/// closed first.
pub(crate) async fn read_start<I: AsyncRead + Unpin>(
    io: &mut I,
    within: Duration,
) -> Option<Vec<u8>> {
    let read = async {
        let mut start = Vec::with_capacity(H2_PREFACE.len());
        let mut buf = [0u8; H2_PREFACE.len()];
        loop {
            let want = H2_PREFACE.len() - start.len();
            let n = io.read(&mut buf[..want]).await.ok()?;
            if n == 0 {
                return (!start.is_empty()).then_some(start);
            }
            start.extend_from_slice(&buf[..n]);
            if start.len() == H2_PREFACE.len() || !H2_PREFACE.starts_with(&start) {
                return Some(start);
            }
        }
    };
    tokio::time::timeout(within, read).await.ok().flatten()
}

/// Whether a connection that began with `start` speaks `flw/1`
/// ([`fencelock_proto::wire`]): its magic's first byte starts no HTTP request.
pub(crate) fn is_wire(start: &[u8]) -> bool {
    start.first() == Some(&fencelock_proto::wire::CLIENT_MAGIC[0])
}

/// A stream with bytes already read from it put back in front.
#[derive(Debug)]
pub(crate) struct Prefixed<I> {
    prefix: Vec<u8>,
    consumed: usize,
    io: I,
}

impl<I> Prefixed<I> {
    /// The bytes put back in front.
    pub(crate) fn prefix(&self) -> &[u8] {
        &self.prefix
    }

    /// The bytes of the prefix not yet read, and the stream.
    pub(crate) fn into_parts(mut self) -> (Vec<u8>, I) {
        self.prefix.drain(..self.consumed);
        (self.prefix, self.io)
    }

    /// `io`, whose next reads first return `prefix`.
    pub(crate) fn new(prefix: Vec<u8>, io: I) -> Prefixed<I> {
        Prefixed {
            prefix,
            consumed: 0,
            io,
        }
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for Prefixed<I> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.consumed < this.prefix.len() {
            let rest = &this.prefix[this.consumed..];
            let n = rest.len().min(buf.remaining());
            buf.put_slice(&rest[..n]);
            this.consumed += n;
            if this.consumed == this.prefix.len() {
                this.prefix = Vec::new();
                this.consumed = 0;
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.io).poll_read(cx, buf)
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Prefixed<I> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    const WITHIN: Duration = Duration::from_millis(200);

    async fn start_of(sent: &[u8], close: bool) -> (Option<Vec<u8>>, tokio::io::DuplexStream) {
        let (mut client, mut server) = tokio::io::duplex(1024);
        client.write_all(sent).await.unwrap();
        if close {
            client.shutdown().await.unwrap();
        }
        (read_start(&mut server, WITHIN).await, server)
    }

    #[tokio::test]
    async fn http1_is_told_from_its_first_byte() {
        let (start, _) = start_of(b"G", false).await;
        assert_eq!(start.as_deref(), Some(&b"G"[..]));
    }

    #[tokio::test]
    async fn the_http2_preface_is_read_whole_and_no_further() {
        let mut sent = H2_PREFACE.to_vec();
        sent.extend_from_slice(b"frames");
        let (start, mut rest) = start_of(&sent, false).await;
        assert_eq!(start.as_deref(), Some(H2_PREFACE));
        let mut next = [0u8; 6];
        rest.read_exact(&mut next).await.unwrap();
        assert_eq!(&next, b"frames");
    }

    /// Regression: silent clients (and ones stalling inside the HTTP/2 preface) held
    /// their connection slot forever.
    #[tokio::test]
    async fn silence_or_a_stalled_preface_gives_up_in_time() {
        assert_eq!(start_of(b"", false).await.0, None);
        assert_eq!(start_of(b"PRI * HT", false).await.0, None);
        assert_eq!(start_of(b"", true).await.0, None);
        // A short request that ends the stream is still served.
        assert_eq!(start_of(b"PRI", true).await.0.as_deref(), Some(&b"PRI"[..]));
    }

    #[tokio::test]
    async fn prefixed_reads_the_prefix_then_the_stream() {
        let (mut client, server) = tokio::io::duplex(64);
        client.write_all(b" world").await.unwrap();
        client.shutdown().await.unwrap();
        let mut both = Prefixed::new(b"hello".to_vec(), server);
        let mut out = String::new();
        both.read_to_string(&mut out).await.unwrap();
        assert_eq!(out, "hello world");
    }
}
