//! Connections whose writes stall: a client that stops reading an answer
//! loses its connection after the idle limit (see [`StallGuardListener`]).

use std::time::Duration;

use crate::metrics;

/// A listener whose connections fail a write that makes no progress for
/// `limit`: the socket accepted no byte (the client stopped reading and
/// every buffer on the way is full), so the connection is closed, which
/// drops the answer being written and cancels its request on the workers.
/// Idle keep-alive connections are not affected (nothing is being written).
/// Counted as `tandem_coordinator_stream_send_timeouts_total{layer="connection"}`.
pub struct StallGuardListener<L> {
    inner: L,
    limit: Duration,
}

impl<L> StallGuardListener<L> {
    pub fn new(inner: L, limit: Duration) -> Self {
        Self { inner, limit }
    }
}

impl<L: axum::serve::Listener> axum::serve::Listener for StallGuardListener<L> {
    type Io = StallGuard<L::Io>;
    type Addr = L::Addr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        let (io, addr) = self.inner.accept().await;
        (StallGuard { io, limit: self.limit, stalled: None, timed_out: false }, addr)
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

/// One connection under a [`StallGuardListener`].
pub struct StallGuard<T> {
    io: T,
    limit: Duration,
    /// Running while a write or flush waits on the socket.
    stalled: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
    /// The limit passed once: the connection is failed for good.
    timed_out: bool,
}

impl<T> StallGuard<T> {
    /// Guards `io`: a write that makes no progress for `limit` fails.
    pub fn new(io: T, limit: Duration) -> Self {
        Self { io, limit, stalled: None, timed_out: false }
    }

    /// The socket is not taking bytes: pending until the limit, then an error.
    fn stalled<R>(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<std::io::Result<R>> {
        use std::future::Future;
        let limit = self.limit;
        let timer = self.stalled.get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match timer.as_mut().poll(cx) {
            std::task::Poll::Pending => std::task::Poll::Pending,
            std::task::Poll::Ready(()) => {
                if !self.timed_out {
                    metrics::stream_send_timeout("http", "connection");
                    tracing::info!(?limit, "the client took no byte within the stream idle timeout; closing");
                    self.timed_out = true;
                }
                std::task::Poll::Ready(Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "the client took no byte within the stream idle timeout",
                )))
            }
        }
    }

    fn progress<R>(
        &mut self,
        r: std::task::Poll<std::io::Result<R>>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<R>> {
        match r {
            std::task::Poll::Pending => self.stalled(cx),
            done if !self.timed_out => {
                self.stalled = None;
                done
            }
            _ => self.stalled(cx),
        }
    }
}

impl<T: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for StallGuard<T> {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl<T: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for StallGuard<T> {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let r = std::pin::Pin::new(&mut this.io).poll_write(cx, buf);
        this.progress(r, cx)
    }

    fn poll_write_vectored(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let r = std::pin::Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        this.progress(r, cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let r = std::pin::Pin::new(&mut this.io).poll_flush(cx);
        this.progress(r, cx)
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let r = std::pin::Pin::new(&mut this.io).poll_shutdown(cx);
        this.progress(r, cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test(start_paused = true)]
    async fn a_write_the_peer_does_not_take_fails_after_the_idle_limit() {
        let (ours, mut theirs) = tokio::io::duplex(64);
        let limit = Duration::from_secs(3);
        let mut g = StallGuard { io: ours, limit, stalled: None, timed_out: false };
        // A reader that keeps taking bytes keeps the connection, however long it takes.
        for _ in 0..5 {
            g.write_all(&[1u8; 64]).await.expect("the buffer has room");
            tokio::time::sleep(Duration::from_secs(2)).await;
            let mut buf = [0u8; 64];
            theirs.read_exact(&mut buf).await.expect("the bytes arrive");
        }
        // One that stops: the write fails once nothing moved for the limit, and stays failed.
        let t = tokio::time::Instant::now();
        let e = g.write_all(&[2u8; 256]).await.expect_err("the peer takes nothing");
        assert_eq!(e.kind(), std::io::ErrorKind::TimedOut);
        assert!(t.elapsed() >= limit, "{:?}", t.elapsed());
        let mut buf = [0u8; 64];
        theirs.read_exact(&mut buf).await.expect("what was buffered");
        assert!(g.write_all(&[3u8; 1]).await.is_err(), "a timed-out connection is failed for good");
    }
}
