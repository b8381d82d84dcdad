//! The decode worker's side: accepts connections and feeds a [`Receiver`].

use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream, ToSocketAddrs};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

use super::super::close::ServerStats;
use super::super::lock::lock;
use super::super::serve::{serve, Shared};
use super::super::{BlockSink, DirectPool};
use crate::frame::DecodeLimits;
use crate::session::Receiver;

/// What the TCP server has done: see [`ServerStats`].
pub type TcpServerStats = ServerStats;

/// Server settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpServerConfig {
    /// Largest frame accepted (buffer growth per connection is bounded by it).
    pub limits: DecodeLimits,
    /// A connection with no incoming byte for this long is closed.
    pub idle_timeout: Duration,
    /// Connections served at once; more are closed on accept.
    pub max_connections: usize,
    /// The decode pool's memory, when the engine's pool lives in a
    /// [`PoolMemory`](crate::transport::PoolMemory): each accepted
    /// payload is then read from the socket straight into its blocks (one
    /// copy; `transport/direct.rs`), and the sink is told it landed in
    /// place rather than handed the bytes. `None`: payloads are read into
    /// buffers and written by the sink.
    pub direct: Option<DirectPool>,
}

impl Default for TcpServerConfig {
    /// Default limits (64 MiB frames), 30 s idle timeout, 256 connections, no direct reads.
    fn default() -> Self {
        Self {
            limits: DecodeLimits::default(),
            idle_timeout: Duration::from_secs(30),
            max_connections: 256,
            direct: None,
        }
    }
}

/// The decode worker's KV listener. Accepts connections on the current
/// tokio runtime and feeds their frames to a shared [`Receiver`]; dropping
/// it (or [`shutdown`](Self::shutdown)) stops accepting and ends every
/// connection task.
#[derive(Debug)]
pub struct TcpKvServer {
    local_addr: SocketAddr,
    stats: watch::Receiver<TcpServerStats>,
    task: JoinHandle<()>,
}

impl TcpKvServer {
    /// Binds `addr` and starts serving. Must be called within a tokio
    /// runtime. A [`direct`](TcpServerConfig::direct) pool of another
    /// layout than the receiver's is refused (`InvalidInput`).
    pub async fn bind<S>(
        addr: impl ToSocketAddrs,
        receiver: Arc<Mutex<Receiver>>,
        sink: S,
        config: TcpServerConfig,
    ) -> io::Result<Self>
    where
        S: BlockSink + Clone + 'static,
    {
        if let Some(pool) = &config.direct {
            let layout = lock(&receiver).config().layout;
            if *pool.layout() != layout {
                let msg = format!("direct pool of layout {:?}, receiver of {layout:?}", pool.layout());
                return Err(io::Error::new(io::ErrorKind::InvalidInput, msg));
            }
        }
        let listener = TcpListener::bind(addr).await?;
        let local_addr = listener.local_addr()?;
        let mut shared = Shared::new(receiver, config.limits, config.idle_timeout);
        shared.direct = config.direct;
        let shared = Arc::new(shared);
        let stats = shared.stats.subscribe();
        let task = tokio::spawn(accept_loop(listener, shared, sink, config.max_connections));
        Ok(Self { local_addr, stats, task })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> TcpServerStats {
        self.stats.borrow().clone()
    }

    /// A watch on the counters: `wait_for` lets a caller await an event
    /// (a connection closed, an abort sent) instead of polling.
    pub fn watch_stats(&self) -> watch::Receiver<TcpServerStats> {
        self.stats.clone()
    }

    /// Stops accepting and ends every connection task.
    pub fn shutdown(self) {
        self.task.abort();
    }
}

impl Drop for TcpKvServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn accept_loop<S: BlockSink + Clone + 'static>(
    listener: TcpListener,
    shared: Arc<Shared>,
    sink: S,
    max_connections: usize,
) {
    // Owned here, so aborting this task aborts every connection task too.
    let mut conns = JoinSet::new();
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(_) => {
                // Out of file descriptors and the like: back off instead of spinning.
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        while conns.try_join_next().is_some() {}
        if conns.len() >= max_connections {
            shared.stats.send_modify(|s| s.connections_refused_busy += 1);
            drop(stream);
            continue;
        }
        shared.stats.send_modify(|s| s.connections_accepted += 1);
        let (shared, mut sink) = (shared.clone(), sink.clone());
        conns.spawn(async move {
            let reason = serve_tcp(stream, &shared, &mut sink).await;
            shared.closed(&reason);
        });
    }
}

async fn serve_tcp<S: BlockSink>(mut stream: TcpStream, shared: &Shared, sink: &mut S) -> super::CloseReason {
    // Control frames (HelloAck, Ack, Abort) are small and latency-bound.
    let _ = stream.set_nodelay(true);
    let (mut rd, mut wr) = stream.split();
    serve(&mut rd, &mut wr, shared, sink).await
}
