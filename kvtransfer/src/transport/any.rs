//! One sender type over every transport, so a worker picks the transport
//! per destination at run time (`KvDestination.transport`) and drives it
//! the same way.

use std::fmt;

use crate::buffers::Buffer;
use crate::frame::{AbortReason, Ack};
use crate::session::Reservation;

use super::error::TransferError;
use super::local::LocalKvSender;
use super::quic::QuicKvSender;
use super::tcp::TcpKvSender;
use super::ucx::{StoredLayer, UcxDirectWriter, UcxKvSender};

/// The transports a destination can name on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransportKind {
    /// Plain TCP, for a trusted cluster network (integrity from frame checksums).
    Tcp,
    /// QUIC over TLS 1.3, for links that are not trusted.
    Quic,
    /// Same-host shared memory (a Unix socket path or `@name`).
    Local,
    /// One-sided puts through UCX into the receiver's landing region (the
    /// address is its UCX worker address, hex).
    Ucx,
}

impl TransportKind {
    pub const ALL: [Self; 4] = [Self::Tcp, Self::Quic, Self::Local, Self::Ucx];

    /// The wire name (`KvDestination.transport`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Tcp => "tcp",
            Self::Quic => "quic",
            Self::Local => "local",
            Self::Ucx => "ucx",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.as_str() == s)
    }
}

impl fmt::Display for TransportKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A connected sender on one of the transports.
#[derive(Debug)]
pub enum KvSender {
    Tcp(TcpKvSender),
    Quic(QuicKvSender),
    Local(LocalKvSender),
    Ucx(UcxKvSender),
}

impl KvSender {
    pub fn kind(&self) -> TransportKind {
        match self {
            Self::Tcp(_) => TransportKind::Tcp,
            Self::Quic(_) => TransportKind::Quic,
            Self::Local(_) => TransportKind::Local,
            Self::Ucx(_) => TransportKind::Ucx,
        }
    }

    /// See [`TcpKvSender::check_open`].
    pub fn check_open(&mut self) -> Result<(), TransferError> {
        match self {
            Self::Tcp(s) => s.check_open(),
            Self::Quic(s) => s.check_open(),
            Self::Local(s) => s.check_open(),
            Self::Ucx(s) => s.check_open(),
        }
    }

    /// See [`TcpKvSender::send_blocks`].
    pub async fn send_blocks(
        &mut self,
        r: Reservation,
        layer: usize,
        first_block: usize,
        k: &[u8],
        v: &[u8],
    ) -> Result<(), TransferError> {
        match self {
            Self::Tcp(s) => s.send_blocks(r, layer, first_block, k, v).await,
            Self::Quic(s) => s.send_blocks(r, layer, first_block, k, v).await,
            Self::Local(s) => s.send_blocks(r, layer, first_block, k, v).await,
            Self::Ucx(s) => s.send_blocks(r, layer, first_block, k, v).await,
        }
    }

    /// [`send_blocks`](Self::send_blocks) of buffers the caller gives up:
    /// ucx puts them as they are (its `send_blocks` would copy them to its
    /// connection's thread); the other transports write from them. Either
    /// way a recycled [`Buffer`] goes home once sent.
    pub async fn send_blocks_owned(
        &mut self,
        r: Reservation,
        layer: usize,
        first_block: usize,
        k: Buffer,
        v: Buffer,
    ) -> Result<(), TransferError> {
        match self {
            Self::Ucx(s) => s.send_blocks_owned(r, layer, first_block, k, v).await,
            _ => self.send_blocks(r, layer, first_block, &k, &v).await,
        }
    }

    /// A writer that stores `r`'s layers straight into the receiver's pool
    /// from the caller's thread ([`UcxKvSender::direct_writer`]); `None` on
    /// every other transport, and where ucx cannot.
    pub async fn direct_writer(&mut self, r: Reservation) -> Result<Option<UcxDirectWriter>, TransferError> {
        match self {
            Self::Ucx(s) => s.direct_writer(r).await,
            _ => Ok(None),
        }
    }

    /// Announces layers [`UcxDirectWriter`]s of this connection stored
    /// ([`UcxKvSender::announce`]); only ucx hands out writers.
    pub async fn announce(&mut self, stored: Vec<StoredLayer>) -> Result<(), TransferError> {
        match self {
            Self::Ucx(s) => s.announce(stored).await,
            _ => Err(TransferError::Protocol(format!("a stored layer announced on a {} connection", self.kind()))),
        }
    }

    /// See [`TcpKvSender::complete`].
    pub async fn complete(&mut self, r: Reservation) -> Result<Ack, TransferError> {
        match self {
            Self::Tcp(s) => s.complete(r).await,
            Self::Quic(s) => s.complete(r).await,
            Self::Local(s) => s.complete(r).await,
            Self::Ucx(s) => s.complete(r).await,
        }
    }

    /// See [`TcpKvSender::abort`].
    pub async fn abort(&mut self, r: Reservation, reason: AbortReason) -> Result<(), TransferError> {
        match self {
            Self::Tcp(s) => s.abort(r, reason).await,
            Self::Quic(s) => s.abort(r, reason).await,
            Self::Local(s) => s.abort(r, reason).await,
            Self::Ucx(s) => s.abort(r, reason).await,
        }
    }

    pub fn bytes_sent(&self) -> u64 {
        match self {
            Self::Tcp(s) => s.bytes_sent(),
            Self::Quic(s) => s.bytes_sent(),
            Self::Local(s) => s.bytes_sent(),
            Self::Ucx(s) => s.bytes_sent(),
        }
    }
}
