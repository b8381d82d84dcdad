//! One sender type and one server type over every transport, so a worker
//! picks the transport per destination at run time
//! (`KvDestination.transport`) and drives it the same way; the decode worker,
//! the conformance suite and `tandem bench handoff` bind their servers here.

use std::fmt;
use std::io;
use std::sync::{Arc, Mutex};

use tokio::sync::watch;
use types::kv::KvLayout;

use crate::buffers::Buffer;
use crate::frame::{AbortReason, Ack};
use crate::session::{Peer, Receiver, Reservation};

use super::close::ServerStats;
use super::error::TransferError;
use super::local::{LocalKvSender, LocalKvServer, LocalSenderConfig, LocalServerConfig};
use super::quic::{QuicKvSender, QuicKvServer, QuicSenderConfig, QuicServerConfig};
use super::tcp::{TcpKvSender, TcpKvServer, TcpSenderConfig, TcpServerConfig};
use super::ucx::{StoredLayer, UcxDirectWriter, UcxKvSender, UcxKvServer, UcxSenderConfig, UcxServerConfig};
use super::BlockSink;

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

/// How to connect to a destination, per transport.
#[derive(Debug, Clone)]
pub enum SenderConfig {
    Tcp(TcpSenderConfig),
    Quic(QuicSenderConfig),
    Local(LocalSenderConfig),
    Ucx(UcxSenderConfig),
}

impl SenderConfig {
    pub fn kind(&self) -> TransportKind {
        match self {
            Self::Tcp(_) => TransportKind::Tcp,
            Self::Quic(_) => TransportKind::Quic,
            Self::Local(_) => TransportKind::Local,
            Self::Ucx(_) => TransportKind::Ucx,
        }
    }
}

impl KvSender {
    /// Connects to the server at `addr` (its [`KvServer::local_addr`]) of the transport
    /// `config` names, presenting `local` and `layout` in the hello.
    pub async fn connect(
        addr: &str,
        local: &Peer,
        layout: KvLayout,
        config: SenderConfig,
    ) -> Result<Self, TransferError> {
        Ok(match config {
            SenderConfig::Tcp(c) => Self::Tcp(TcpKvSender::connect(addr, local, layout, c).await?),
            SenderConfig::Quic(c) => Self::Quic(QuicKvSender::connect(addr, local, layout, c).await?),
            SenderConfig::Local(c) => Self::Local(LocalKvSender::connect(addr, local, layout, c).await?),
            SenderConfig::Ucx(c) => Self::Ucx(UcxKvSender::connect(addr, local, layout, c).await?),
        })
    }

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

    /// See [`TcpKvSender::send_pinned`]: tcp only; a pinned layer offered to another
    /// transport is a local bug, refused with nothing sent.
    pub async fn send_pinned(
        &mut self,
        r: Reservation,
        layer: &crate::PinnedLayer,
        pool: &super::DirectPool,
    ) -> Result<(), TransferError> {
        match self {
            Self::Tcp(s) => s.send_pinned(r, layer, pool).await,
            _ => Err(TransferError::Protocol(format!("a pinned layer offered to a {} connection", self.kind()))),
        }
    }

    /// Whether this connection sends layers straight from a pool in mapped memory
    /// ([`send_pinned`](Self::send_pinned)), and the largest frame it cuts them into.
    pub fn pinned_frames(&self) -> Option<usize> {
        match self {
            Self::Tcp(s) => Some(s.max_frame_bytes()),
            _ => None,
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

/// How to bind a KV server, per transport.
#[derive(Debug)]
pub enum ServerConfig {
    Tcp(TcpServerConfig),
    Quic(QuicServerConfig),
    Local(LocalServerConfig),
    Ucx(UcxServerConfig),
}

/// A KV listener on one of the transports, feeding one [`Receiver`]: what a
/// decode worker runs.
#[derive(Debug)]
pub enum KvServer {
    Tcp(TcpKvServer),
    Quic(QuicKvServer),
    Local(LocalKvServer),
    Ucx(UcxKvServer),
}

impl KvServer {
    /// Binds `addr` (a socket address for tcp and quic, a path or `@name` for
    /// local; ucx listens where its worker address says and ignores it) and
    /// starts serving, within a tokio runtime.
    pub async fn bind<S>(addr: &str, receiver: Arc<Mutex<Receiver>>, sink: S, config: ServerConfig) -> io::Result<Self>
    where
        S: BlockSink + Clone + 'static,
    {
        Ok(match config {
            ServerConfig::Tcp(c) => Self::Tcp(TcpKvServer::bind(addr, receiver, sink, c).await?),
            ServerConfig::Quic(c) => Self::Quic(QuicKvServer::bind(addr, receiver, sink, c).await?),
            ServerConfig::Local(c) => Self::Local(LocalKvServer::bind(addr, receiver, sink, c).await?),
            ServerConfig::Ucx(c) => Self::Ucx(UcxKvServer::bind(receiver, sink, c).await?),
        })
    }

    pub fn kind(&self) -> TransportKind {
        match self {
            Self::Tcp(_) => TransportKind::Tcp,
            Self::Quic(_) => TransportKind::Quic,
            Self::Local(_) => TransportKind::Local,
            Self::Ucx(_) => TransportKind::Ucx,
        }
    }

    /// Where senders connect: what a `KvDestination` carries.
    pub fn local_addr(&self) -> String {
        match self {
            Self::Tcp(s) => s.local_addr().to_string(),
            Self::Quic(s) => s.local_addr().to_string(),
            Self::Local(s) => s.local_addr().to_owned(),
            Self::Ucx(s) => s.local_addr().to_owned(),
        }
    }

    /// A watch on the listener's counters (one [`ServerStats`] for every transport).
    pub fn watch_stats(&self) -> watch::Receiver<ServerStats> {
        match self {
            Self::Tcp(s) => s.watch_stats(),
            Self::Quic(s) => s.watch_stats(),
            Self::Local(s) => s.watch_stats(),
            Self::Ucx(s) => s.watch_stats(),
        }
    }

    /// The ucx server, for what only it has (its registered pool memory).
    pub fn ucx_mut(&mut self) -> Option<&mut UcxKvServer> {
        match self {
            Self::Ucx(s) => Some(s),
            _ => None,
        }
    }

    /// Stops accepting and ends every connection.
    pub fn shutdown(self) {
        match self {
            Self::Tcp(s) => s.shutdown(),
            Self::Quic(s) => s.shutdown(),
            Self::Local(s) => s.shutdown(),
            Self::Ucx(s) => s.shutdown(),
        }
    }
}
