//! The prefill worker's side: one connection to a decode worker.

use std::time::Duration;

use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpStream, ToSocketAddrs};
use tokio::time::timeout;
use types::kv::KvLayout;

use super::super::send::FrameSender;
use super::DEFAULT_MAX_FRAME_BYTES;
use crate::frame::{AbortReason, Ack};
use crate::session::{Peer, Reservation};
use crate::TransferError;

/// Sender settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpSenderConfig {
    /// Limit for connecting, the handshake, each frame's write and waiting for an `Ack`.
    pub timeout: Duration,
    /// Largest encoded `LayerData` frame written (whole blocks per frame).
    pub max_frame_bytes: usize,
}

impl Default for TcpSenderConfig {
    /// 10 s, [`DEFAULT_MAX_FRAME_BYTES`].
    fn default() -> Self {
        Self { timeout: Duration::from_secs(10), max_frame_bytes: DEFAULT_MAX_FRAME_BYTES }
    }
}

/// The prefill worker's end of one connection to a decode worker.
#[derive(Debug)]
pub struct TcpKvSender {
    inner: FrameSender<OwnedReadHalf, OwnedWriteHalf>,
}

impl TcpKvSender {
    /// Connects and does the handshake as `local`, whose KV has `layout`.
    pub async fn connect(
        addr: impl ToSocketAddrs,
        local: &Peer,
        layout: KvLayout,
        config: TcpSenderConfig,
    ) -> Result<Self, TransferError> {
        let wait = config.timeout;
        let stream = timeout(wait, TcpStream::connect(addr))
            .await
            .map_err(|_| TransferError::Timeout { what: "TCP connect", after: wait })??;
        stream.set_nodelay(true)?;
        let (rd, wr) = stream.into_split();
        let inner = FrameSender::handshake(rd, wr, local, layout, wait, config.max_frame_bytes).await?;
        Ok(Self { inner })
    }

    /// Payload and header bytes written so far.
    pub fn bytes_sent(&self) -> u64 {
        self.inner.bytes_sent()
    }

    /// Fails when the receiver has closed this connection (its idle
    /// timeout, a restart) or broke the protocol on it: a look that does
    /// not wait, taking in whatever the receiver already sent. A pooled
    /// connection is checked so before it carries a new transfer, which
    /// would otherwise fail on its first frame.
    pub fn check_open(&mut self) -> Result<(), TransferError> {
        self.inner.check_open()
    }

    /// Sends one layer's K and V of the reservation's blocks (as
    /// [`KvPool::gather_layer`](engine::kv::KvPool::gather_layer) returns
    /// them), cut into frames of whole blocks as
    /// [`split_layer`](crate::split_layer) cuts them, written without
    /// copying the payload. Fails fast with
    /// [`PeerAbort`](TransferError::PeerAbort) if the receiver already
    /// refused this reservation.
    pub async fn send_layer(&mut self, r: Reservation, layer: usize, k: &[u8], v: &[u8]) -> Result<(), TransferError> {
        self.inner.send_blocks(r, layer, 0, k, v).await
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
        self.inner.send_blocks(r, layer, first_block, k, v).await
    }

    /// Sends one layer's run of blocks straight from the sender's pool, which lies in
    /// `pool`'s memory (see [`PinnedLayer`](crate::PinnedLayer)): no copy of the payload
    /// but the kernel's. `layer` must have been cut for this connection's
    /// `max_frame_bytes` ([`TcpKvSender::max_frame_bytes`]).
    pub async fn send_pinned(
        &mut self,
        r: Reservation,
        layer: &crate::PinnedLayer,
        pool: &crate::transport::DirectPool,
    ) -> Result<(), TransferError> {
        self.inner.send_pinned(r, layer, pool).await
    }

    /// The largest frame this connection writes, which a [`PinnedLayer`](crate::PinnedLayer)'s
    /// cut must follow.
    pub fn max_frame_bytes(&self) -> usize {
        self.inner.max_frame_bytes()
    }

    /// Says every layer was sent and waits (up to the configured timeout)
    /// for the receiver's `Ack`. After `Ok` the sender may drop its copy.
    pub async fn complete(&mut self, r: Reservation) -> Result<Ack, TransferError> {
        self.inner.complete(r).await
    }

    /// Tells the receiver this transfer is abandoned (prefill failed, request cancelled).
    pub async fn abort(&mut self, r: Reservation, reason: AbortReason) -> Result<(), TransferError> {
        self.inner.abort(r, reason).await
    }
}
