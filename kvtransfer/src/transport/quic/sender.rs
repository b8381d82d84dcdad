//! The prefill worker's side: one QUIC connection (one stream) to a decode worker.

use std::io;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use quinn::{ConnectError, RecvStream, SendStream};
use tokio::net::{lookup_host, ToSocketAddrs};
use tokio::time::timeout;
use types::kv::KvLayout;

use super::tls::{self, PeerTrust, Refusal, TlsError, TlsIdentity};
use super::{connection_error, QuicTuning, CLOSE_DONE};
use crate::frame::{AbortReason, Ack};
use crate::session::{Peer, Reservation};
use crate::transport::send::FrameSender;
use crate::transport::tcp::DEFAULT_MAX_FRAME_BYTES;
use crate::TransferError;

/// Sender settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuicSenderConfig {
    /// How the decode worker's certificate is checked.
    pub server_trust: PeerTrust,
    /// The name the decode worker's certificate must be valid for (checked
    /// with [`PeerTrust::Ca`]; sent as SNI either way).
    pub server_name: String,
    /// This worker's certificate, for a decode worker that requires one (mutual TLS).
    pub identity: Option<TlsIdentity>,
    /// Limit for the handshakes, each frame's write and waiting for an
    /// `Ack`; also QUIC's idle timeout (kept alive by pings at a third of it).
    pub timeout: Duration,
    /// Largest encoded `LayerData` frame written (whole blocks per frame).
    pub max_frame_bytes: usize,
    pub tuning: QuicTuning,
}

impl QuicSenderConfig {
    /// Defaults around `server_trust`: server name `tandem-kv`, no client
    /// certificate, 10 s, [`DEFAULT_MAX_FRAME_BYTES`], default tuning.
    pub fn new(server_trust: PeerTrust) -> Self {
        Self {
            server_trust,
            server_name: "tandem-kv".into(),
            identity: None,
            timeout: Duration::from_secs(10),
            max_frame_bytes: DEFAULT_MAX_FRAME_BYTES,
            tuning: QuicTuning::default(),
        }
    }
}

/// The prefill worker's end of one QUIC connection to a decode worker.
/// Dropping it finishes the stream and closes the connection once the
/// receiver has everything written so far (in the background, bounded by
/// the timeout).
#[derive(Debug)]
pub struct QuicKvSender {
    inner: Option<FrameSender<RecvStream, SendStream>>,
    conn: quinn::Connection,
    endpoint: quinn::Endpoint,
    refusal: Refusal,
    timeout: Duration,
}

impl QuicKvSender {
    /// Connects, checks the decode worker's certificate, and does the
    /// protocol handshake as `local`, whose KV has `layout`.
    pub async fn connect(
        addr: impl ToSocketAddrs,
        local: &Peer,
        layout: KvLayout,
        config: QuicSenderConfig,
    ) -> Result<Self, TransferError> {
        let wait = config.timeout;
        let remote = timeout(wait, lookup_host(addr))
            .await
            .map_err(|_| TransferError::Timeout { what: "resolving the address", after: wait })??
            .next()
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "the address resolved to nothing"))?;
        let refusal = Refusal::default();
        let crypto = tls::client_config(&config.server_trust, config.identity.as_ref(), refusal.clone())?;
        let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(crypto)
            .map_err(|e| TlsError::Config { what: "QUIC client TLS", why: e.to_string() })?;
        let mut client = quinn::ClientConfig::new(Arc::new(crypto));
        client.transport_config(Arc::new(config.tuning.transport(wait, (!wait.is_zero()).then(|| wait / 3))));
        let any: SocketAddr = match remote {
            SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
            SocketAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
        };
        let endpoint = config.tuning.endpoint(any, None)?;
        let connecting = endpoint.connect_with(client, remote, &config.server_name).map_err(|e| match e {
            ConnectError::InvalidServerName(name) => TransferError::Tls(TlsError::Config {
                what: "server name",
                why: format!("{name:?} is not a valid name"),
            }),
            other => TransferError::Io(io::Error::other(other)),
        })?;
        let handshake = "the QUIC handshake";
        let conn = match timeout(wait, connecting).await {
            Err(_) => return Err(TransferError::Timeout { what: handshake, after: wait }),
            Ok(Err(e)) => return Err(connection_error(e, tls::take_refusal(&refusal), handshake, wait)),
            Ok(Ok(c)) => c,
        };
        let mut s = Self { inner: None, conn, endpoint, refusal, timeout: wait };
        let (wr, rd) = match timeout(wait, s.conn.open_bi()).await {
            Err(_) => return Err(TransferError::Timeout { what: "opening a stream", after: wait }),
            Ok(Err(e)) => return Err(s.refine(TransferError::Io(io::Error::other(e)))),
            Ok(Ok(pair)) => pair,
        };
        match FrameSender::handshake(rd, wr, local, layout, wait, config.max_frame_bytes).await {
            Ok(inner) => {
                s.inner = Some(inner);
                Ok(s)
            }
            Err(e) => Err(s.refine(e)),
        }
    }

    /// Payload and header bytes written so far.
    pub fn bytes_sent(&self) -> u64 {
        self.inner.as_ref().map_or(0, |i| i.bytes_sent())
    }

    /// See [`TcpKvSender::check_open`](crate::TcpKvSender::check_open); a
    /// closed QUIC connection is named by its close reason.
    pub fn check_open(&mut self) -> Result<(), TransferError> {
        let res = self.frames().and_then(|f| f.check_open());
        match (res, self.conn.close_reason()) {
            (Ok(()), None) => Ok(()),
            (Ok(()), Some(_)) => Err(self.refine(TransferError::Io(io::Error::from(io::ErrorKind::NotConnected)))),
            (Err(e), _) => Err(self.refine(e)),
        }
    }

    /// The QUIC stack's counters for this connection (path MTU, packets,
    /// losses, congestion window): for metrics and tuning.
    pub fn connection_stats(&self) -> quinn::ConnectionStats {
        self.conn.stats()
    }

    /// Sends one layer's K and V of the reservation's blocks. See
    /// [`TcpKvSender::send_layer`](crate::TcpKvSender::send_layer).
    pub async fn send_layer(&mut self, r: Reservation, layer: usize, k: &[u8], v: &[u8]) -> Result<(), TransferError> {
        self.send_blocks(r, layer, 0, k, v).await
    }

    /// Sends one layer's K and V of the reservation's blocks
    /// `first_block..first_block + n` (`n` from the lengths of `k` and `v`),
    /// as [`send_layer`](Self::send_layer) does for all of them: a layer may
    /// go out in pieces, as a streaming prefill completes its blocks. Each
    /// (layer, block) must be sent exactly once.
    pub async fn send_blocks(
        &mut self,
        r: Reservation,
        layer: usize,
        first_block: usize,
        k: &[u8],
        v: &[u8],
    ) -> Result<(), TransferError> {
        let res = self.frames()?.send_blocks(r, layer, first_block, k, v).await;
        res.map_err(|e| self.refine(e))
    }

    /// Says every layer was sent and waits (up to the configured timeout)
    /// for the receiver's `Ack`. After `Ok` the sender may drop its copy.
    pub async fn complete(&mut self, r: Reservation) -> Result<Ack, TransferError> {
        let res = self.frames()?.complete(r).await;
        res.map_err(|e| self.refine(e))
    }

    /// Tells the receiver this transfer is abandoned (prefill failed, request cancelled).
    pub async fn abort(&mut self, r: Reservation, reason: AbortReason) -> Result<(), TransferError> {
        let res = self.frames()?.abort(r, reason).await;
        res.map_err(|e| self.refine(e))
    }

    fn frames(&mut self) -> Result<&mut FrameSender<RecvStream, SendStream>, TransferError> {
        self.inner.as_mut().ok_or_else(|| TransferError::Io(io::Error::from(io::ErrorKind::NotConnected)))
    }

    /// A stream error says little; the connection's close reason says why
    /// (timed out, certificate refused, peer closed).
    fn refine(&self, e: TransferError) -> TransferError {
        match (&e, self.conn.close_reason()) {
            (TransferError::Io(_) | TransferError::Timeout { .. }, Some(ce)) => {
                connection_error(ce, tls::take_refusal(&self.refusal), "the connection", self.timeout)
            }
            _ => e,
        }
    }
}

impl Drop for QuicKvSender {
    fn drop(&mut self) {
        let Some(inner) = self.inner.take() else {
            self.conn.close(CLOSE_DONE.into(), b"");
            return;
        };
        let (_rd, mut wr) = inner.into_parts();
        let _ = wr.finish();
        let (conn, endpoint, wait) = (self.conn.clone(), self.endpoint.clone(), self.timeout);
        // Outside a runtime nothing can wait: the close is then immediate.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                // Everything written, FIN included, acknowledged by the peer.
                let _ = timeout(wait, wr.stopped()).await;
                conn.close(CLOSE_DONE.into(), b"");
                drop(endpoint);
            });
        } else {
            conn.close(CLOSE_DONE.into(), b"");
        }
    }
}
