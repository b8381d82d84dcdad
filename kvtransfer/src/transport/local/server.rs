//! The decode worker's side: accepts connections on a Unix socket, maps
//! each sender's ring and feeds a [`Receiver`].

use std::io::{self, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
use tokio::io::Interest;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::timeout;

use super::shm::{ReceiverRing, DATA_OFFSET};
use super::wire::{Msg, MsgReader, RingRefusal};
use super::{next_msg, socket_path, write_all, write_msg, ReadError, WriteError};
use crate::buffers::Buffers;
use crate::frame::{Frame, Hello};
use crate::session::Receiver;
use crate::transport::close::{CloseReason, ServerStats};
use crate::transport::inbound::Event;
use crate::transport::serve::{drive, Conn};
use crate::transport::stream::frame_name;
use crate::transport::BlockSink;

/// Descriptors taken from one read; more are closed by the kernel.
const MAX_FDS: usize = 4;

/// Server settings. The ring limits bound what one connection maps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalServerConfig {
    /// A connection with no incoming byte for this long is closed.
    pub idle_timeout: Duration,
    /// Connections served at once; more are closed on accept.
    pub max_connections: usize,
    /// Most slots a sender's ring may have.
    pub max_slots: usize,
    /// Largest slot (frame payload) accepted.
    pub max_slot_bytes: usize,
    /// Largest ring mapped, in bytes of shared memory.
    pub max_ring_bytes: usize,
    /// Refuse peers whose effective user id differs from this process's
    /// (checked with `SO_PEERCRED` before the handshake). Matters most for
    /// abstract socket names, which any local user can connect to.
    pub same_uid_only: bool,
}

impl Default for LocalServerConfig {
    /// 30 s idle timeout, 256 connections, rings of at most 1024 slots of
    /// at most 64 MiB and 256 MiB in all, same user only.
    fn default() -> Self {
        Self {
            idle_timeout: Duration::from_secs(30),
            max_connections: 256,
            max_slots: 1024,
            max_slot_bytes: 64 << 20,
            max_ring_bytes: 256 << 20,
            same_uid_only: true,
        }
    }
}

impl From<ReadError> for CloseReason {
    fn from(e: ReadError) -> Self {
        match e {
            ReadError::Io(e) => Self::Io(e.kind()),
            ReadError::Idle(d) => Self::Idle(d),
            ReadError::Wire(e) => e.into(),
            ReadError::Truncated => Self::Truncated,
        }
    }
}

/// What the local server has done: see [`ServerStats`] (and its
/// `rings_mapped`).
pub type LocalServerStats = ServerStats;

struct Shared {
    receiver: Arc<Mutex<Receiver>>,
    config: LocalServerConfig,
    stats: watch::Sender<ServerStats>,
    buffers: Buffers,
}

/// The decode worker's same-host KV listener. Accepts connections on the
/// current tokio runtime and feeds their frames to a shared [`Receiver`];
/// dropping it (or [`shutdown`](Self::shutdown)) stops accepting, ends
/// every connection task and removes the socket file it created.
#[derive(Debug)]
pub struct LocalKvServer {
    addr: String,
    /// The socket file to remove at the end (none for abstract names).
    file: Option<PathBuf>,
    stats: watch::Receiver<ServerStats>,
    task: JoinHandle<()>,
}

impl LocalKvServer {
    /// Listens on `addr` — a socket path, or `@name` in the Linux abstract
    /// namespace — and starts serving. Must be called within a tokio
    /// runtime. A stale socket file at the path (nobody listening) is
    /// replaced.
    pub async fn bind<S>(
        addr: impl AsRef<str>,
        receiver: Arc<Mutex<Receiver>>,
        sink: S,
        config: LocalServerConfig,
    ) -> io::Result<Self>
    where
        S: BlockSink + Clone + 'static,
    {
        let addr = addr.as_ref().to_owned();
        let path = socket_path(&addr)?;
        let listener = match UnixListener::bind(&path) {
            Err(e) if e.kind() == io::ErrorKind::AddrInUse && !addr.starts_with('@') => {
                match std::os::unix::net::UnixStream::connect(&path) {
                    Err(c) if c.kind() == io::ErrorKind::ConnectionRefused => {
                        std::fs::remove_file(&path)?;
                        UnixListener::bind(&path)?
                    }
                    _ => return Err(e),
                }
            }
            other => other?,
        };
        let file = (!addr.starts_with('@')).then_some(path);
        let (tx, stats) = watch::channel(ServerStats::default());
        let shared = Arc::new(Shared { receiver, config, stats: tx, buffers: Buffers::new(KEPT_BYTES) });
        let task = tokio::spawn(accept_loop(listener, shared, sink));
        Ok(Self { addr, file, stats, task })
    }

    /// The address a [`LocalKvSender`](super::LocalKvSender) connects to.
    pub fn local_addr(&self) -> &str {
        &self.addr
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> ServerStats {
        self.stats.borrow().clone()
    }

    /// A watch on the counters: `wait_for` lets a caller await an event
    /// (a connection closed, an abort sent) instead of polling.
    pub fn watch_stats(&self) -> watch::Receiver<ServerStats> {
        self.stats.clone()
    }

    /// Stops accepting and ends every connection task.
    pub fn shutdown(self) {
        // Drop does it all.
    }
}

impl Drop for LocalKvServer {
    fn drop(&mut self) {
        self.task.abort();
        if let Some(path) = &self.file {
            let _ = std::fs::remove_file(path);
        }
    }
}

async fn accept_loop<S: BlockSink + Clone + 'static>(listener: UnixListener, shared: Arc<Shared>, sink: S) {
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
        if conns.len() >= shared.config.max_connections {
            shared.stats.send_modify(|s| s.connections_refused_busy += 1);
            drop(stream);
            continue;
        }
        shared.stats.send_modify(|s| s.connections_accepted += 1);
        let (shared, mut sink) = (shared.clone(), sink.clone());
        conns.spawn(async move {
            let reason = serve(stream, &shared, &mut sink).await;
            shared.stats.send_modify(|s| s.close(&reason));
        });
    }
}

/// Runs one connection to its end and says why it ended.
async fn serve<S: BlockSink>(stream: UnixStream, shared: &Shared, sink: &mut S) -> CloseReason {
    if shared.config.same_uid_only {
        let me = rustix::process::geteuid().as_raw();
        match stream.peer_cred() {
            Ok(c) if c.uid() == me => {}
            Ok(c) => return CloseReason::PeerUid { uid: c.uid() },
            Err(e) => return CloseReason::Io(e.kind()),
        }
    }
    let mut conn = LocalConn { stream, reader: MsgReader::new(), out: Vec::with_capacity(64), ring: None, shared };
    drive(&mut conn, &shared.receiver, &shared.stats, sink).await
}

/// One sender's socket and, after the handshake, its ring, as a [`Conn`].
struct LocalConn<'a> {
    stream: UnixStream,
    reader: MsgReader,
    /// Encoding space for the handshake's messages.
    out: Vec<u8>,
    /// The mapped ring and the batched replies, once accepted.
    ring: Option<(ReceiverRing, Replies)>,
    shared: &'a Shared,
}

impl Conn for LocalConn<'_> {
    async fn hello(&mut self) -> Result<Hello, CloseReason> {
        match next_msg(&mut self.stream, &mut self.reader, self.shared.config.idle_timeout).await {
            Ok(Some(Msg::Frame(Frame::Hello(h)))) => Ok(h),
            Ok(Some(other)) => Err(CloseReason::NotHello { got: other.name() }),
            Ok(None) => Err(CloseReason::PeerClosed),
            Err(e) => Err(e.into()),
        }
    }

    /// The sender's ring, mapped once checked, and its answer.
    async fn handshaken(&mut self) -> Result<(), CloseReason> {
        let (config, idle) = (&self.shared.config, self.shared.config.idle_timeout);
        let ring = match accept_ring(&mut self.stream, &mut self.reader, config).await {
            Ok(ring) => ring,
            Err(Ok(refusal)) => {
                write_msg(&mut self.stream, &mut self.out, &Msg::RingReject(refusal), idle).await?;
                return Err(CloseReason::RingRefused(refusal));
            }
            Err(Err(close)) => return Err(close),
        };
        write_msg(&mut self.stream, &mut self.out, &Msg::RingAck, idle).await?;
        self.shared.stats.send_modify(|s| s.rings_mapped += 1);
        let replies = Replies::new(ring.slots(), idle);
        self.ring = Some((ring, replies));
        Ok(())
    }

    async fn next(&mut self) -> Result<Event, CloseReason> {
        let idle = self.shared.config.idle_timeout;
        let Some((ring, replies)) = &mut self.ring else {
            return Err(CloseReason::UnexpectedMessage { got: "a frame before the ring" });
        };
        let msg = match self.reader.decode()? {
            Some(m) => m,
            None => {
                // Nothing buffered: before waiting for the sender, give back
                // the slots it may be waiting for.
                replies.send(&mut self.stream, None).await?;
                match next_msg(&mut self.stream, &mut self.reader, idle).await? {
                    Some(m) => m,
                    None => return Ok(Event::Closed),
                }
            }
        };
        match msg {
            Msg::Data(d) => {
                // Copy first, then credit the slot: from here the sender may
                // rewrite it, and everything after reads only our copy. The
                // checksum is computed over that copy as it is made.
                let mut buf = self.shared.buffers.take_with(ring.slot_bytes(), fresh);
                let Some(crc) = ring.copy_out(d.slot as usize, d.header.payload_len, &mut buf) else {
                    return Err(CloseReason::BadSlot { slot: d.slot, len: d.header.payload_len });
                };
                replies.credit(d.slot);
                if replies.credits_due() {
                    replies.send(&mut self.stream, None).await?;
                }
                // `d.header.payload_len` is `buf.len()`: copy_out copied exactly that.
                Ok(Event::Layer { header: d.header, payload: Box::new(buf), crc })
            }
            Msg::Frame(f) => Ok(Event::Frame(f)),
            other => Err(CloseReason::UnexpectedMessage { got: other.name() }),
        }
    }

    async fn reply(&mut self, f: &Frame) -> Result<(), CloseReason> {
        let msg = Msg::Frame(f.clone());
        match &mut self.ring {
            // With the pending credits.
            Some((_, replies)) => replies.send(&mut self.stream, Some(&msg)).await,
            None => Ok(write_msg(&mut self.stream, &mut self.out, &msg, self.shared.config.idle_timeout).await?),
        }
    }

    fn unexpected(&self, f: &Frame) -> CloseReason {
        CloseReason::UnexpectedMessage { got: frame_name(f) }
    }
}

/// The server's messages after the handshake, slot credits batched: a
/// credit is a wake-up for the sender, so they go out a quarter of the ring
/// at a time (the sender refills those slots while the rest are
/// processed), and all at once before the server waits for more input or
/// replies otherwise.
struct Replies {
    out: Vec<u8>,
    credits: usize,
    batch: usize,
    idle: Duration,
    /// A write failed: the sender went away. Frames it sent before are
    /// still in our socket buffer and are read to the end (EOF closes the
    /// connection), so a failed write only stops further writes.
    gone: bool,
}

impl Replies {
    fn new(slots: usize, idle: Duration) -> Self {
        Self { out: Vec::with_capacity(64), credits: 0, batch: slots.div_ceil(4), idle, gone: false }
    }

    fn credit(&mut self, slot: u32) {
        Msg::Credit(slot).encode(&mut self.out);
        self.credits += 1;
    }

    fn credits_due(&self) -> bool {
        self.credits >= self.batch
    }

    /// Writes the pending credits and `msg`. A write that times out ends
    /// the connection.
    async fn send(&mut self, stream: &mut UnixStream, msg: Option<&Msg>) -> Result<(), CloseReason> {
        if let Some(m) = msg {
            m.encode(&mut self.out);
        }
        let written = match self.gone || self.out.is_empty() {
            true => Ok(()),
            false => write_all(stream, &self.out, self.idle).await,
        };
        self.out.clear();
        self.credits = 0;
        match written {
            Ok(()) => Ok(()),
            Err(WriteError::Io(_)) => {
                self.gone = true;
                Ok(())
            }
            Err(e @ WriteError::Timeout(_)) => Err(e.into()),
        }
    }
}

/// Reads the `Ring` message with its descriptor and maps the ring.
/// `Err(Ok(refusal))`: tell the sender, then close; `Err(Err(reason))`: close.
async fn accept_ring(
    stream: &mut UnixStream,
    reader: &mut MsgReader,
    config: &LocalServerConfig,
) -> Result<ReceiverRing, Result<RingRefusal, CloseReason>> {
    let idle = config.idle_timeout;
    let mut fds = Vec::new();
    let msg = loop {
        match reader.decode() {
            Ok(Some(m)) => break m,
            Ok(None) => {}
            Err(e) => return Err(Err(e.into())),
        }
        match timeout(idle, read_with_fds(stream, reader.space(), &mut fds)).await {
            Err(_) => return Err(Err(CloseReason::Idle(idle))),
            Ok(Err(e)) => return Err(Err(CloseReason::Io(e.kind()))),
            Ok(Ok(0)) if reader.is_empty() => return Err(Err(CloseReason::PeerClosed)),
            Ok(Ok(0)) => return Err(Err(CloseReason::Truncated)),
            Ok(Ok(n)) => reader.advance(n),
        }
    };
    let spec = match msg {
        Msg::Ring(spec) => spec,
        other => return Err(Err(CloseReason::UnexpectedMessage { got: other.name() })),
    };
    // Exactly one descriptor; any other dropped (closed) here.
    let fd = match (fds.pop(), fds.is_empty()) {
        (Some(fd), true) => fd,
        _ => return Err(Ok(RingRefusal::NoFd)),
    };
    let (slots, slot_bytes) = (spec.slots as usize, spec.slot_bytes as usize);
    let within = slots <= config.max_slots
        && slot_bytes <= config.max_slot_bytes
        && super::shm::geometry(slots, slot_bytes).is_some_and(|(_, len)| len <= config.max_ring_bytes);
    if !within {
        return Err(Ok(RingRefusal::Limits));
    }
    ReceiverRing::map(fd, slots, slot_bytes).map_err(Ok)
}

/// One `recvmsg` into `buf`, keeping any descriptors that came with it.
async fn read_with_fds(stream: &UnixStream, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> io::Result<usize> {
    stream
        .async_io(Interest::READABLE, || {
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
            let mut control = RecvAncillaryBuffer::new(&mut space);
            let mut iov = [IoSliceMut::new(&mut *buf)];
            let got = rustix::net::recvmsg(stream, &mut iov, &mut control, RecvFlags::CMSG_CLOEXEC)?;
            for m in control.drain() {
                if let RecvAncillaryMessage::ScmRights(received) = m {
                    fds.extend(received);
                }
            }
            Ok(got.bytes)
        })
        .await
}

/// Most bytes of idle payload buffers the server keeps for reuse.
const KEPT_BYTES: usize = 64 << 20;

/// A new buffer whose address does not make the copy out of a slot slow
/// (see [`DATA_OFFSET`]): one lying 1..=31 bytes past a slot's payload
/// modulo 4 KiB is swapped for another allocation (a few tries; then
/// whatever came, which is only slower).
fn fresh(capacity: usize) -> Vec<u8> {
    let slow = |b: &Vec<u8>| (1..32).contains(&((b.as_ptr() as usize).wrapping_sub(DATA_OFFSET) % 4096));
    let mut tried = Vec::new();
    for _ in 0..4 {
        let b = Vec::with_capacity(capacity);
        if !slow(&b) {
            return b;
        }
        tried.push(b);
    }
    tried.pop().unwrap_or_default()
}
