//! The prefill worker's side: a thread per connection that owns a UCX
//! worker and one endpoint to the decode worker, driven by commands from
//! the async [`UcxKvSender`] handle.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::time::timeout;
use types::kv::KvLayout;

use super::link::link_thread;
use super::writer::{StoredLayer, UcxDirectWriter};
use crate::buffers::Buffer;
use crate::frame::{AbortReason, Ack};
use crate::session::{Peer, Reservation};
use crate::transport::error::TransferError;
use crate::transport::send::LayerPlan;

/// Sender settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UcxSenderConfig {
    /// The handshake, each layer's puts and flush, a landing grant, the Ack.
    pub timeout: Duration,
    /// Where UCX reaches the decode worker through shared memory (one host),
    /// store each layer through the landing region mapped into this process
    /// with its checksum taken in the same pass, instead of a checksum pass
    /// and a put. `false`: always put, as over tcp or RDMA.
    pub mapped_stores: bool,
    /// With mapped stores, and where the decode worker offers its pool
    /// (same host, `UcxServerConfig::pool_blocks`), store each layer
    /// straight into the reservation's pool blocks rather than into a
    /// landing range. `false`: always a landing range.
    pub direct: bool,
}

impl Default for UcxSenderConfig {
    /// 10 s; mapped stores and the direct path on.
    fn default() -> Self {
        Self { timeout: Duration::from_secs(10), mapped_stores: true, direct: true }
    }
}

type Reply<T> = oneshot::Sender<Result<T, TransferError>>;

pub(super) enum Cmd {
    Send {
        r: Reservation,
        layer: usize,
        first_block: usize,
        k: Buffer,
        v: Buffer,
        reply: Reply<()>,
    },
    Complete {
        r: Reservation,
        reply: Reply<Ack>,
    },
    Abort {
        r: Reservation,
        reason: AbortReason,
        reply: Reply<()>,
    },
    Writer {
        r: Reservation,
        reply: Reply<Option<UcxDirectWriter>>,
    },
    /// No reply: a failure is deferred to the reservation's next command.
    Announce {
        stored: Vec<StoredLayer>,
    },
}

/// The prefill worker's end of one UCX connection to a decode worker.
/// Dropping it ends the connection: its thread flushes every put it
/// started, tells the server (`Bye`, which frees any landing range it
/// held in quarantine) and exits.
#[derive(Debug)]
pub struct UcxKvSender {
    cmds: mpsc::Sender<Cmd>,
    layout: KvLayout,
    bytes_sent: u64,
    transports: Vec<String>,
    /// Layers stored through a mapping (landing region or pool; the rest were put).
    mapped_layers: Arc<AtomicU64>,
    /// Of those, layers stored straight into the decode worker's pool.
    direct_layers: Arc<AtomicU64>,
    /// Detached on drop: the thread's goodbye is bounded by the timeout.
    _thread: JoinHandle<()>,
}

impl UcxKvSender {
    /// Connects to the server at `addr` (its [`local_addr`](super::UcxKvServer::local_addr))
    /// and does the handshake as `local`, whose KV has `layout`.
    pub async fn connect(
        addr: &str,
        local: &Peer,
        layout: KvLayout,
        config: UcxSenderConfig,
    ) -> Result<Self, TransferError> {
        let server = super::unhex(addr).ok_or_else(|| {
            TransferError::Io(io::Error::new(io::ErrorKind::InvalidInput, "a UCX address is hex-encoded bytes"))
        })?;
        let hello = crate::transport::outbound::hello(local);
        let (cmds, rx) = mpsc::channel(1);
        let (ready_tx, ready_rx) = oneshot::channel();
        let wait = config.timeout;
        let counts = Counts::default();
        let counted = counts.clone();
        let thread = std::thread::Builder::new()
            .name("tandem-ucx-send".into())
            .spawn(move || link_thread(server, hello, layout, config, counted, ready_tx, rx))?;
        match timeout(wait + Duration::from_secs(1), ready_rx).await {
            Ok(Ok(Ok(transports))) => Ok(Self {
                cmds,
                layout,
                bytes_sent: 0,
                transports,
                mapped_layers: counts.mapped,
                direct_layers: counts.direct,
                _thread: thread,
            }),
            Ok(Ok(Err(e))) => Err(e),
            Ok(Err(_)) => Err(gone()),
            Err(_) => Err(TransferError::Timeout { what: "the UCX handshake", after: wait }),
        }
    }

    /// The transports UCX chose for the puts (`"sysv/memory"`, `"cma/memory"`,
    /// `"tcp/lo"`, `"rc_mlx5/mlx5_0:1"`, ...), as [`ucx_sys::Endpoint::transports`].
    pub fn transports(&self) -> &[String] {
        &self.transports
    }

    /// Payload bytes sent so far (put, or stored through the mapped landing region).
    pub fn bytes_sent(&self) -> u64 {
        self.bytes_sent
    }

    /// How many layer sends (one per `send_blocks` call) were stored through
    /// the mapped landing region rather than put
    /// ([`UcxSenderConfig::mapped_stores`]).
    pub fn mapped_layers(&self) -> u64 {
        self.mapped_layers.load(Ordering::Relaxed)
    }

    /// How many of those went straight into the decode worker's pool
    /// blocks (the direct path: the server offered its pool and granted
    /// the reservation's blocks) rather than into a landing range.
    pub fn direct_layers(&self) -> u64 {
        self.direct_layers.load(Ordering::Relaxed)
    }

    /// See [`TcpKvSender::check_open`](crate::TcpKvSender::check_open): here,
    /// only whether the connection's thread still runs. The UCX server keeps
    /// no idle timeout, and an endpoint error shows on the next put.
    pub fn check_open(&mut self) -> Result<(), TransferError> {
        if self.cmds.is_closed() {
            return Err(gone());
        }
        Ok(())
    }

    /// Puts K and V of blocks `first_block..` of one layer into the
    /// reservation's landing range (claimed on first use), flushes, then
    /// sends the layer's completion with the CRC-32C of what was put.
    ///
    /// Returns once the puts are posted: the flush and the completion
    /// message go out while the caller prepares the next layer (the
    /// connection's thread finishes them before it takes the next command),
    /// and if they fail, the next call for the same reservation (a layer,
    /// [`complete`](Self::complete) or [`abort`](Self::abort)) returns that
    /// error. Copies `k` and `v` once; [`send_blocks_owned`](Self::send_blocks_owned)
    /// does not.
    pub async fn send_blocks(
        &mut self,
        r: Reservation,
        layer: usize,
        first_block: usize,
        k: &[u8],
        v: &[u8],
    ) -> Result<(), TransferError> {
        // Shape checks before any copy or message.
        LayerPlan::new(&self.layout, layer, k, v, usize::MAX)?;
        self.send_blocks_owned(r, layer, first_block, Buffer::unpooled(k.to_vec()), Buffer::unpooled(v.to_vec())).await
    }

    /// [`send_blocks`](Self::send_blocks) of buffers the caller gives up:
    /// they are put as they are, with no copy on this side, and go home
    /// (a recycled [`Buffer`]) once the puts are done.
    pub async fn send_blocks_owned(
        &mut self,
        r: Reservation,
        layer: usize,
        first_block: usize,
        k: Buffer,
        v: Buffer,
    ) -> Result<(), TransferError> {
        LayerPlan::new(&self.layout, layer, &k, &v, usize::MAX)?;
        let n = k.len() + v.len();
        self.call(|reply| Cmd::Send { r, layer, first_block, k, v, reply }).await?;
        self.bytes_sent += n as u64;
        Ok(())
    }

    /// [`send_blocks`](Self::send_blocks) from block 0.
    pub async fn send_layer(&mut self, r: Reservation, layer: usize, k: &[u8], v: &[u8]) -> Result<(), TransferError> {
        self.send_blocks(r, layer, 0, k, v).await
    }

    /// A writer that stores `r`'s layers straight into its pool blocks from
    /// any thread (the module `writer`): claims the reservation's blocks if
    /// it has not yet. `None` where the direct path is not open to this
    /// connection (another host, no mapping, [`UcxSenderConfig::direct`]
    /// off, or the server granted a landing range): then send layers with
    /// [`send_blocks_owned`](Self::send_blocks_owned). Layers of one
    /// reservation may go either way.
    pub async fn direct_writer(&mut self, r: Reservation) -> Result<Option<UcxDirectWriter>, TransferError> {
        self.call(|reply| Cmd::Writer { r, reply }).await
    }

    /// Has the `Layer` messages sent for blocks [`UcxDirectWriter`]s of this
    /// connection stored (the server checksums them in its pool), in order.
    /// Returns once the connection's thread has them, without waiting for
    /// the messages to go out: a stream of layers costs no round trip each,
    /// and layers stored while the previous hand-over was on its way go
    /// together (one wake-up of the connection's thread for all). If
    /// sending fails, or a reservation has no live writer here, that
    /// reservation's next call ([`complete`](Self::complete),
    /// [`abort`](Self::abort), a layer) returns the error.
    pub async fn announce(&mut self, stored: Vec<StoredLayer>) -> Result<(), TransferError> {
        let bytes: usize = stored.iter().map(|s| s.bytes).sum();
        self.cmds.send(Cmd::Announce { stored }).await.map_err(|_| gone())?;
        self.bytes_sent += bytes as u64;
        Ok(())
    }

    /// Sends `Complete` and waits for the `Ack`.
    pub async fn complete(&mut self, r: Reservation) -> Result<Ack, TransferError> {
        self.call(|reply| Cmd::Complete { r, reply }).await
    }

    /// Flushes this connection's puts, then sends `Abort` (the server frees
    /// the reservation's landing range at once: nothing is left in flight).
    pub async fn abort(&mut self, r: Reservation, reason: AbortReason) -> Result<(), TransferError> {
        self.call(|reply| Cmd::Abort { r, reason, reply }).await
    }

    async fn call<T>(&self, cmd: impl FnOnce(Reply<T>) -> Cmd) -> Result<T, TransferError> {
        let (tx, rx) = oneshot::channel();
        self.cmds.send(cmd(tx)).await.map_err(|_| gone())?;
        rx.await.map_err(|_| gone())?
    }
}

/// What the connection's thread counts for the handle.
#[derive(Clone, Default)]
pub(super) struct Counts {
    pub(super) mapped: Arc<AtomicU64>,
    pub(super) direct: Arc<AtomicU64>,
}

fn gone() -> TransferError {
    TransferError::Io(io::Error::new(io::ErrorKind::BrokenPipe, "the UCX connection's thread has ended"))
}
