//! Where a `flw/1` connection's writer task writes: the one copy of the write loop
//! the client and the server share.

use std::sync::Arc;

use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::net::tcp::OwnedWriteHalf;

/// The write side of a `flw/1` connection.
pub enum Sink {
    /// Plain TCP, whose write half other writers may share (each write is one
    /// `try_write` loop, so this task never holds a lock across an await).
    Direct(Arc<OwnedWriteHalf>),
    /// Any other stream (TLS): only the owning task writes.
    Stream(Box<dyn AsyncWrite + Send + Unpin>),
}

impl Sink {
    /// Writes all of `bytes` (and flushes a stream, which may hold what it
    /// encrypted until then).
    pub async fn write_all(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        match self {
            Sink::Direct(socket) => {
                let mut at = 0;
                while at < bytes.len() {
                    socket.writable().await?;
                    match socket.try_write(&bytes[at..]) {
                        Ok(n) => at += n,
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                        Err(e) => return Err(e),
                    }
                }
                Ok(())
            }
            Sink::Stream(w) => {
                w.write_all(bytes).await?;
                w.flush().await
            }
        }
    }

    /// Ends the write side after a graceful stop (a TCP write half shuts down when
    /// its last handle is dropped).
    pub async fn shutdown(self) -> std::io::Result<()> {
        match self {
            Sink::Direct(_) => Ok(()),
            Sink::Stream(mut w) => w.shutdown().await,
        }
    }
}
