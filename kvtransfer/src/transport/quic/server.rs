//! The decode worker's side: accepts QUIC connections and feeds a [`Receiver`].

use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use quinn::ConnectionError;
use tokio::net::{lookup_host, ToSocketAddrs};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::timeout;

use super::tls::{self, PeerTrust, Refusal, TlsIdentity};
use super::{is_crypto_refusal, QuicTuning, CLOSE_DONE};
use crate::frame::DecodeLimits;
use crate::session::Receiver;
use crate::transport::close::{CloseReason, ServerStats};
use crate::transport::serve::{serve, Shared};
use crate::transport::BlockSink;

/// What the QUIC server has done: see [`ServerStats`]. Each connection
/// carries one frame stream; a connection whose TLS handshake fails is
/// counted as closed with [`CloseReason::Tls`].
pub type QuicServerStats = ServerStats;

/// Server settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuicServerConfig {
    /// The certificate this decode worker presents.
    pub identity: TlsIdentity,
    /// With `Some`, senders must present a certificate this trust accepts
    /// (mutual TLS); with `None`, any sender that passes the protocol
    /// handshake is served.
    pub client_trust: Option<PeerTrust>,
    /// Largest frame accepted (buffer growth per connection is bounded by it).
    pub limits: DecodeLimits,
    /// A connection with no incoming frame byte for this long is closed;
    /// also QUIC's idle timeout and the TLS handshake's limit.
    pub idle_timeout: Duration,
    /// Connections served at once; more are refused.
    pub max_connections: usize,
    pub tuning: QuicTuning,
}

impl QuicServerConfig {
    /// Defaults around `identity`: no client certificates, default limits
    /// (64 MiB frames), 30 s idle timeout, 256 connections, default tuning.
    pub fn new(identity: TlsIdentity) -> Self {
        Self {
            identity,
            client_trust: None,
            limits: DecodeLimits::default(),
            idle_timeout: Duration::from_secs(30),
            max_connections: 256,
            tuning: QuicTuning::default(),
        }
    }
}

/// The decode worker's QUIC KV listener. Accepts connections on the current
/// tokio runtime and feeds their frames to a shared [`Receiver`]; dropping
/// it (or [`shutdown`](Self::shutdown)) closes the endpoint and ends every
/// connection task.
#[derive(Debug)]
pub struct QuicKvServer {
    local_addr: SocketAddr,
    stats: watch::Receiver<QuicServerStats>,
    endpoint: quinn::Endpoint,
    task: JoinHandle<()>,
}

impl QuicKvServer {
    /// Binds `addr` (UDP) and starts serving. Must be called within a tokio
    /// runtime. Unusable TLS settings fail with `InvalidInput` (the source
    /// is a [`TlsError`](super::TlsError)).
    pub async fn bind<S>(
        addr: impl ToSocketAddrs,
        receiver: Arc<Mutex<Receiver>>,
        sink: S,
        config: QuicServerConfig,
    ) -> io::Result<Self>
    where
        S: BlockSink + Clone + 'static,
    {
        let addr = lookup_host(addr)
            .await?
            .next()
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "the address resolved to nothing"))?;
        let invalid = |e: tls::TlsError| io::Error::new(io::ErrorKind::InvalidInput, e);
        let refusal = Refusal::default();
        let crypto =
            tls::server_config(&config.identity, config.client_trust.as_ref(), refusal.clone()).map_err(invalid)?;
        let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(crypto)
            .map_err(|e| invalid(tls::TlsError::Config { what: "QUIC server TLS", why: e.to_string() }))?;
        let mut server = quinn::ServerConfig::with_crypto(Arc::new(crypto));
        server.transport_config(Arc::new(config.tuning.transport(config.idle_timeout, None)));
        let endpoint = config.tuning.endpoint(addr, Some(server))?;
        let local_addr = endpoint.local_addr()?;
        let shared = Arc::new(Shared::new(receiver, config.limits, config.idle_timeout));
        let stats = shared.stats.subscribe();
        let task = tokio::spawn(accept_loop(endpoint.clone(), shared, sink, config.max_connections, refusal));
        Ok(Self { local_addr, stats, endpoint, task })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> QuicServerStats {
        self.stats.borrow().clone()
    }

    /// A watch on the counters: `wait_for` lets a caller await an event
    /// (a connection closed, an abort sent) instead of polling.
    pub fn watch_stats(&self) -> watch::Receiver<QuicServerStats> {
        self.stats.clone()
    }

    /// Stops accepting, closes every connection and ends their tasks.
    pub fn shutdown(self) {
        // Drop does it.
    }
}

impl Drop for QuicKvServer {
    fn drop(&mut self) {
        self.endpoint.close(CLOSE_DONE.into(), b"shutting down");
        self.task.abort();
    }
}

async fn accept_loop<S: BlockSink + Clone + 'static>(
    endpoint: quinn::Endpoint,
    shared: Arc<Shared>,
    sink: S,
    max_connections: usize,
    refusal: Refusal,
) {
    // Owned here, so aborting this task aborts every connection task too.
    let mut conns = JoinSet::new();
    while let Some(incoming) = endpoint.accept().await {
        while conns.try_join_next().is_some() {}
        if conns.len() >= max_connections {
            shared.stats.send_modify(|s| s.connections_refused_busy += 1);
            incoming.refuse();
            continue;
        }
        shared.stats.send_modify(|s| s.connections_accepted += 1);
        let (shared, mut sink, refusal) = (shared.clone(), sink.clone(), refusal.clone());
        conns.spawn(async move {
            let reason = serve_connection(incoming, &shared, &mut sink, &refusal).await;
            shared.closed(&reason);
        });
    }
}

/// Runs one connection (its TLS handshake, then its one frame stream) to
/// its end and says why it ended.
async fn serve_connection<S: BlockSink>(
    incoming: quinn::Incoming,
    shared: &Shared,
    sink: &mut S,
    refusal: &Refusal,
) -> CloseReason {
    let idle = shared.idle_timeout;
    let conn = match timeout(idle, incoming).await {
        Err(_) => return CloseReason::Idle(idle),
        Ok(Err(e)) => return handshake_failure(e, refusal),
        Ok(Ok(c)) => c,
    };
    let (mut wr, mut rd) = match timeout(idle, conn.accept_bi()).await {
        Err(_) => {
            conn.close(CLOSE_DONE.into(), b"idle");
            return CloseReason::Idle(idle);
        }
        Ok(Err(e)) => return stream_end(&e),
        Ok(Ok(pair)) => pair,
    };
    let reason = match serve(&mut rd, &mut wr, shared, sink).await {
        // A sender that dropped its connection after its last frame.
        CloseReason::Io(_) => conn.close_reason().map_or(CloseReason::Io(io::ErrorKind::Other), |e| stream_end(&e)),
        r => r,
    };
    // Let the last reply (an Abort, a HelloReject) reach the sender before
    // the connection goes: closing at once would discard unsent data.
    if wr.finish().is_ok() {
        let _ = timeout(idle, wr.stopped()).await;
    }
    conn.close(CLOSE_DONE.into(), b"");
    reason
}

/// Why a handshake failed: a certificate refused (by us or by the sender),
/// a timeout, or the network.
fn handshake_failure(e: ConnectionError, refusal: &Refusal) -> CloseReason {
    if let Some(t) = tls::take_refusal(refusal) {
        return CloseReason::Tls(t.to_string());
    }
    if let Some(alert) = is_crypto_refusal(&e) {
        return CloseReason::Tls(alert);
    }
    match e {
        ConnectionError::TimedOut => CloseReason::Idle(Duration::ZERO),
        _ => CloseReason::Io(io::ErrorKind::ConnectionReset),
    }
}

/// How a stream ended when its connection did.
fn stream_end(e: &ConnectionError) -> CloseReason {
    match e {
        ConnectionError::ApplicationClosed(c) if c.error_code == CLOSE_DONE.into() => CloseReason::PeerClosed,
        ConnectionError::TimedOut => CloseReason::Idle(Duration::ZERO),
        _ => CloseReason::Io(io::ErrorKind::ConnectionReset),
    }
}
