//! The decode worker's side: accepts connections on a Unix socket, maps
//! each sender's ring and feeds a [`Receiver`].

use std::future::poll_fn;
use std::io::{self, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
use tokio::io::Interest;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::{timeout, Instant};

use super::shm::{ReceiverRing, DATA_OFFSET};
use super::wire::{Msg, MsgReader, RingRefusal, WireError};
use super::{next_msg, socket_path, write_all, write_msg, ReadError, Recent, WriteError};
use crate::frame::{Abort, AbortReason, Frame, RejectReason};
use crate::session::Receiver;
use crate::transport::lock::lock;
use crate::transport::{BlockSink, OwnedPayload};

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

/// Why the server closed (or saw the end of) a connection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LocalCloseReason {
    /// The peer closed between messages: the normal end.
    #[error("peer closed the connection")]
    PeerClosed,
    /// The peer closed in the middle of a message.
    #[error("peer closed mid-message")]
    Truncated,
    /// A socket error (reset, broken pipe, …).
    #[error("i/o error: {0:?}")]
    Io(io::ErrorKind),
    /// No byte arrived (or could be written) within the idle timeout.
    #[error("idle for {0:?}")]
    Idle(Duration),
    /// Bytes that are not a message; the stream cannot be resynchronised.
    #[error("undecodable bytes: {0}")]
    Decode(WireError),
    /// The first message was not `Hello`.
    #[error("first message was {got}, not Hello")]
    NotHello { got: &'static str },
    /// The handshake was refused (after telling the peer).
    #[error("handshake rejected: {}", .0.as_str())]
    Rejected(RejectReason),
    /// The sender's ring was refused (after telling the peer).
    #[error("ring refused: {0}")]
    RingRefused(RingRefusal),
    /// A `Data` message named a slot or length outside the ring.
    #[error("Data for slot {slot} with {len} bytes is outside the ring")]
    BadSlot { slot: u32, len: usize },
    /// A message a sender never sends (`HelloAck`, `Credit`, a second `Hello`, an inline `LayerData`, …).
    #[error("unexpected {got} from a sender")]
    UnexpectedMessage { got: &'static str },
    /// The peer runs as another user and `same_uid_only` is set.
    #[error("peer runs as uid {uid}")]
    PeerUid { uid: u32 },
}

impl LocalCloseReason {
    /// Every [`as_str`](Self::as_str) label, in [`LocalServerStats::closed`] order.
    pub const LABELS: [&'static str; 11] = [
        "peer_closed",
        "truncated",
        "io",
        "idle",
        "decode",
        "not_hello",
        "rejected",
        "ring_refused",
        "bad_slot",
        "unexpected_message",
        "peer_uid",
    ];

    /// Stable label for logs and metrics.
    pub fn as_str(&self) -> &'static str {
        Self::LABELS[self.index()]
    }

    fn index(&self) -> usize {
        match self {
            Self::PeerClosed => 0,
            Self::Truncated => 1,
            Self::Io(_) => 2,
            Self::Idle(_) => 3,
            Self::Decode(_) => 4,
            Self::NotHello { .. } => 5,
            Self::Rejected(_) => 6,
            Self::RingRefused(_) => 7,
            Self::BadSlot { .. } => 8,
            Self::UnexpectedMessage { .. } => 9,
            Self::PeerUid { .. } => 10,
        }
    }
}

impl From<ReadError> for LocalCloseReason {
    fn from(e: ReadError) -> Self {
        match e {
            ReadError::Io(e) => Self::Io(e.kind()),
            ReadError::Idle(d) => Self::Idle(d),
            ReadError::Wire(e) => Self::Decode(e),
            ReadError::Truncated => Self::Truncated,
        }
    }
}

impl From<WriteError> for LocalCloseReason {
    fn from(e: WriteError) -> Self {
        match e {
            WriteError::Io(e) => Self::Io(e.kind()),
            WriteError::Timeout(d) => Self::Idle(d),
        }
    }
}

/// What the server has done, for metrics and tests. Frame-level counts live
/// in [`Receiver::counters`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LocalServerStats {
    pub connections_accepted: u64,
    /// Closed on accept because `max_connections` were being served.
    pub connections_refused_busy: u64,
    /// Rings accepted and mapped.
    pub rings_mapped: u64,
    /// Ended connections by [`LocalCloseReason`], in [`LocalCloseReason::LABELS`] order.
    pub closed: [u64; LocalCloseReason::LABELS.len()],
    /// `Abort` frames sent (refused frames, at most one per reservation and connection).
    pub aborts_sent: u64,
    /// Accepted frames the [`BlockSink`] failed to store.
    pub sink_failures: u64,
}

impl LocalServerStats {
    /// Connections that ended for any reason.
    pub fn connections_closed(&self) -> u64 {
        self.closed.iter().sum()
    }

    /// Connections that ended with this [`LocalCloseReason::as_str`] label.
    pub fn closed_by(&self, label: &str) -> u64 {
        LocalCloseReason::LABELS.iter().position(|l| *l == label).map_or(0, |i| self.closed[i])
    }
}

struct Shared {
    receiver: Arc<Mutex<Receiver>>,
    config: LocalServerConfig,
    stats: watch::Sender<LocalServerStats>,
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
    stats: watch::Receiver<LocalServerStats>,
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
        let (tx, stats) = watch::channel(LocalServerStats::default());
        let shared = Arc::new(Shared { receiver, config, stats: tx, buffers: Buffers::default() });
        let task = tokio::spawn(accept_loop(listener, shared, sink));
        Ok(Self { addr, file, stats, task })
    }

    /// The address a [`LocalKvSender`](super::LocalKvSender) connects to.
    pub fn local_addr(&self) -> &str {
        &self.addr
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> LocalServerStats {
        self.stats.borrow().clone()
    }

    /// A watch on the counters: `wait_for` lets a caller await an event
    /// (a connection closed, an abort sent) instead of polling.
    pub fn watch_stats(&self) -> watch::Receiver<LocalServerStats> {
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
            shared.stats.send_modify(|s| s.closed[reason.index()] += 1);
        });
    }
}

/// Runs one connection to its end and says why it ended.
async fn serve<S: BlockSink>(mut stream: UnixStream, shared: &Shared, sink: &mut S) -> LocalCloseReason {
    if shared.config.same_uid_only {
        let me = rustix::process::geteuid().as_raw();
        match stream.peer_cred() {
            Ok(c) if c.uid() == me => {}
            Ok(c) => return LocalCloseReason::PeerUid { uid: c.uid() },
            Err(e) => return LocalCloseReason::Io(e.kind()),
        }
    }
    let idle = shared.config.idle_timeout;
    let mut reader = MsgReader::new();
    let mut out = Vec::with_capacity(64);

    let hello = match next_msg(&mut stream, &mut reader, idle).await {
        Ok(Some(Msg::Frame(Frame::Hello(h)))) => h,
        Ok(Some(other)) => return LocalCloseReason::NotHello { got: other.name() },
        Ok(None) => return LocalCloseReason::PeerClosed,
        Err(e) => return e.into(),
    };
    let verdict = lock(&shared.receiver).on_hello(&hello);
    let answer = match verdict {
        Ok(ack) => Frame::HelloAck(ack),
        Err(reject) => Frame::HelloReject(reject),
    };
    if let Err(e) = write_msg(&mut stream, &mut out, &Msg::Frame(answer), idle).await {
        return e.into();
    }
    if let Err(reject) = verdict {
        return LocalCloseReason::Rejected(reject.reason);
    }

    let ring = match accept_ring(&mut stream, &mut reader, &shared.config).await {
        Ok(ring) => ring,
        Err(Ok(refusal)) => {
            if let Err(e) = write_msg(&mut stream, &mut out, &Msg::RingReject(refusal), idle).await {
                return e.into();
            }
            return LocalCloseReason::RingRefused(refusal);
        }
        Err(Err(close)) => return close,
    };
    if let Err(e) = write_msg(&mut stream, &mut out, &Msg::RingAck, idle).await {
        return e.into();
    }
    shared.stats.send_modify(|s| s.rings_mapped += 1);

    let buffers = &shared.buffers;
    let mut aborted = Recent::default();
    let mut replies = Replies::new(ring.slots(), idle);
    loop {
        let msg = match reader.decode() {
            Ok(Some(m)) => m,
            Err(e) => return LocalCloseReason::Decode(e),
            Ok(None) => {
                // Nothing buffered: before waiting for the sender, give back
                // the slots it may be waiting for.
                if let Err(e) = replies.send(&mut stream, None).await {
                    return e;
                }
                match next_msg(&mut stream, &mut reader, idle).await {
                    Ok(Some(m)) => m,
                    Ok(None) => return LocalCloseReason::PeerClosed,
                    Err(e) => return e.into(),
                }
            }
        };
        let refusal = match msg {
            Msg::Data(d) => {
                // Copy first, then credit the slot: from here the sender may
                // rewrite it, and everything below reads only our copy. The
                // checksum is computed over that copy as it is made.
                let mut buf = buffers.take(ring.slot_bytes());
                let Some(crc) = ring.copy_out(d.slot as usize, d.header.payload_len, &mut buf) else {
                    return LocalCloseReason::BadSlot { slot: d.slot, len: d.header.payload_len };
                };
                replies.credit(d.slot);
                if replies.credits_due() {
                    if let Err(e) = replies.send(&mut stream, None).await {
                        return e;
                    }
                }
                let h = d.header;
                // The sink's room first, without the receiver (see BlockSink::poll_ready).
                poll_fn(|cx| sink.poll_ready(cx, buf.len())).await;
                let now = Instant::now();
                let abort = |reason| Abort { reservation: h.reservation, generation: h.generation, reason };
                let mut rx = lock(&shared.receiver);
                // `h.payload_len` is `buf.len()`: copy_out copied exactly that.
                match rx.on_layer_checked(&h, crc, now) {
                    Ok(w) => match sink.write_layer_owned(w, buffers.owned(buf)) {
                        Ok(()) => None,
                        Err(_) => {
                            // The blocks' content is now unknown: void the
                            // reservation (blocks go to poll_released) and
                            // tell the sender to retry elsewhere.
                            let a = abort(AbortReason::Corrupt);
                            let _ = rx.on_abort(&a, now);
                            shared.stats.send_modify(|s| s.sink_failures += 1);
                            Some(a)
                        }
                    },
                    Err(e) => {
                        sink.unready();
                        buffers.put(buf);
                        Some(abort(e.abort_reason()))
                    }
                }
            }
            Msg::Frame(Frame::Complete(c)) => {
                // Bound first: the guard must not live across the await below.
                let verdict = lock(&shared.receiver).on_complete(&c, Instant::now());
                match verdict {
                    Ok(ack) => {
                        if let Err(e) = replies.send(&mut stream, Some(&Msg::Frame(Frame::Ack(ack)))).await {
                            return e;
                        }
                        None
                    }
                    Err(e) => {
                        Some(Abort { reservation: c.reservation, generation: c.generation, reason: e.abort_reason() })
                    }
                }
            }
            Msg::Frame(Frame::Abort(a)) => {
                // Refused only when the reservation already ended: nothing to do.
                let _ = lock(&shared.receiver).on_abort(&a, Instant::now());
                None
            }
            other => return LocalCloseReason::UnexpectedMessage { got: other.name() },
        };
        if let Some(a) = refusal {
            let key = (a.reservation, a.generation);
            if !aborted.contains(&key) {
                aborted.push(key);
                if let Err(e) = replies.send(&mut stream, Some(&Msg::Frame(Frame::Abort(a)))).await {
                    return e;
                }
                shared.stats.send_modify(|s| s.aborts_sent += 1);
            }
        }
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
    async fn send(&mut self, stream: &mut UnixStream, msg: Option<&Msg>) -> Result<(), LocalCloseReason> {
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
) -> Result<ReceiverRing, Result<RingRefusal, LocalCloseReason>> {
    let idle = config.idle_timeout;
    let mut fds = Vec::new();
    let msg = loop {
        match reader.decode() {
            Ok(Some(m)) => break m,
            Ok(None) => {}
            Err(e) => return Err(Err(LocalCloseReason::Decode(e))),
        }
        match timeout(idle, read_with_fds(stream, reader.space(), &mut fds)).await {
            Err(_) => return Err(Err(LocalCloseReason::Idle(idle))),
            Ok(Err(e)) => return Err(Err(LocalCloseReason::Io(e.kind()))),
            Ok(Ok(0)) if reader.is_empty() => return Err(Err(LocalCloseReason::PeerClosed)),
            Ok(Ok(0)) => return Err(Err(LocalCloseReason::Truncated)),
            Ok(Ok(n)) => reader.advance(n),
        }
    };
    let spec = match msg {
        Msg::Ring(spec) => spec,
        other => return Err(Err(LocalCloseReason::UnexpectedMessage { got: other.name() })),
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

/// Payload buffers, reused across frames and connections: a buffer handed
/// to the sink comes back when the sink drops it (on whatever thread that
/// is). Idle buffers are kept up to [`KEPT_BYTES`] in all.
#[derive(Debug, Clone, Default)]
struct Buffers(Arc<Mutex<Vec<Vec<u8>>>>);

impl Buffers {
    /// An empty buffer with room for `capacity` bytes: the most recently
    /// returned one (the warmest in cache) if it is large enough.
    fn take(&self, capacity: usize) -> Vec<u8> {
        let reused = self.0.lock().unwrap_or_else(|e| e.into_inner()).pop();
        match reused {
            Some(b) if b.capacity() >= capacity => b,
            _ => fresh(capacity),
        }
    }

    fn put(&self, buf: Vec<u8>) {
        put(&self.0, buf);
    }

    fn owned(&self, buf: Vec<u8>) -> OwnedPayload {
        Box::new(Pooled { buf, home: Arc::downgrade(&self.0) })
    }
}

fn put(idle: &Mutex<Vec<Vec<u8>>>, buf: Vec<u8>) {
    let mut idle = idle.lock().unwrap_or_else(|e| e.into_inner());
    let kept: usize = idle.iter().map(Vec::capacity).sum();
    if kept + buf.capacity() <= KEPT_BYTES {
        idle.push(buf);
    }
}

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

/// A payload on loan to the sink.
struct Pooled {
    buf: Vec<u8>,
    home: Weak<Mutex<Vec<Vec<u8>>>>,
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        if let Some(home) = self.home.upgrade() {
            put(&home, std::mem::take(&mut self.buf));
        }
    }
}
