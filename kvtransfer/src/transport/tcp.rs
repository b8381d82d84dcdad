//! Plain TCP transport for a trusted cluster network.
//!
//! No encryption and no peer authentication: integrity comes from each
//! frame's CRC-32C, compatibility from the handshake. Use the QUIC transport
//! across links you do not trust.
//!
//! # Connection lifecycle
//!
//! ```text
//! prefill: TcpKvSender                         decode: TcpKvServer (one task per connection)
//!   connect ─── Hello ─────────────────────▶  first frame must be Hello, else close (NotHello)
//!          ◀── HelloAck | HelloReject ──────  reject: reply, then close (Rejected)
//!   send_layer ─ LayerData … ──────────────▶  Receiver::on_layer → BlockSink::write_layer
//!          ◀── Abort{reason} (once) ────────  the frame was refused: reservation-level error
//!   complete ─── Complete ─────────────────▶  Receiver::on_complete
//!          ◀── Ack | Abort ─────────────────
//!   (drop) ─── FIN ────────────────────────▶  clean close between frames (PeerClosed)
//! ```
//!
//! One connection carries any number of reservations, one after another or
//! interleaved; the worker binaries keep one connection per peer pair.
//!
//! # Error handling
//!
//! The server never panics on peer input and buffers at most one frame
//! (bounded by [`DecodeLimits`]) plus 64 KiB per connection. What it does:
//!
//! | event | reply | connection |
//! |---|---|---|
//! | bytes that are not a frame ([`DecodeError`]) | none (no reservation to name) | closed: the stream cannot be resynchronised |
//! | first frame not `Hello` | none | closed |
//! | handshake refused | `HelloReject{reason}` | closed |
//! | a frame only the receiver sends (`HelloAck`, `Ack`, a second `Hello`, …) | none | closed |
//! | `LayerData`/`Complete` refused by the [`Receiver`] ([`FrameError`](crate::FrameError)) | `Abort{error.abort_reason()}`, once per reservation | **kept**: the frame was well delimited, so the stream is in sync, and other reservations on it are unaffected |
//! | the [`BlockSink`] fails to store an accepted frame | the reservation is aborted, `Abort{Corrupt}` | kept |
//! | no byte for `idle_timeout` | none | closed (a dead peer never pins a task) |
//! | EOF mid-frame, I/O error | none | closed |
//!
//! Whatever ends a connection, reservations it was feeding stay in the
//! [`Receiver`] until their lease ends: they are never `Ready` unless every
//! (layer, block) arrived and `Complete` was acknowledged, and their blocks
//! come back through [`Receiver::poll_released`] — the transport itself
//! never frees blocks.
//!
//! Accepted payloads are written while the server holds the receiver's
//! lock, so a reservation cannot expire and its blocks be reused while the
//! bytes are landing. (That serialises writes across connections; fine at
//! one memcpy per frame, to revisit for many concurrent senders.)
//!
//! The sender writes each frame's header, K range and V range with one
//! vectored write straight from the caller's gathered K and V: no payload
//! copy, the checksum computed over the two ranges in place.

use std::io::{self, IoSlice};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use engine::kv::KvLayout;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, ToSocketAddrs};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::{timeout, Instant};

use super::BlockSink;
use crate::frame::{
    Abort, AbortReason, Ack, Complete, DecodeError, DecodeLimits, Decoded, Frame, Hello, LayerDataHeader, RejectReason,
    HEADER_LEN, LAYER_DATA_OVERHEAD,
};
use crate::sender::SplitError;
use crate::session::{Peer, Receiver, Reservation};
use crate::ErrorKind;

/// Default largest frame a sender writes. 1 MiB beat 4 MiB on loopback
/// (benches/tcp.rs): a frame that stays in cache through decode, checksum
/// and the sink's copy is cheaper than fewer, larger frames.
pub const DEFAULT_MAX_FRAME_BYTES: usize = 1 << 20;

/// Bytes read past the frame in progress: small, so compacting the read
/// buffer after a frame moves little.
const READ_SLACK: usize = 64 << 10;

/// Frames remembered per connection for de-duplication (aborts sent by the
/// server, acks and aborts received by the sender).
const REMEMBERED: usize = 64;

// ---------------------------------------------------------------- reading

/// Why reading the next frame failed.
#[derive(Debug)]
enum ReadError {
    Io(io::Error),
    Idle(Duration),
    Decode(DecodeError),
    /// EOF inside a frame.
    Truncated,
}

/// A reusable read buffer that yields whole frames. Holds at most one frame
/// (bounded by the decode limits, checked from the header before the body is
/// read) plus [`READ_SLACK`].
#[derive(Debug)]
struct FrameReader {
    buf: Vec<u8>,
    start: usize,
    end: usize,
    /// Bytes the frame in progress needs in total, from `start`.
    need: usize,
    limits: DecodeLimits,
}

impl FrameReader {
    fn new(limits: DecodeLimits) -> Self {
        Self { buf: Vec::new(), start: 0, end: 0, need: HEADER_LEN, limits }
    }

    fn is_empty(&self) -> bool {
        self.start == self.end
    }

    /// The next frame already buffered, if any.
    fn decode(&mut self) -> Result<Option<Frame>, DecodeError> {
        if self.is_empty() {
            (self.start, self.end, self.need) = (0, 0, HEADER_LEN);
            return Ok(None);
        }
        match Frame::decode(&self.buf[self.start..self.end], &self.limits)? {
            Decoded::Frame { frame, consumed } => {
                self.start += consumed;
                Ok(Some(frame))
            }
            Decoded::NeedMore { at_least } => {
                self.need = at_least;
                Ok(None)
            }
        }
    }

    /// Room for the rest of the frame in progress (plus slack) to be read into.
    fn space(&mut self) -> &mut [u8] {
        let want = self.need.max(HEADER_LEN) + READ_SLACK;
        if self.start + want > self.buf.len() {
            if self.start > 0 {
                self.buf.copy_within(self.start..self.end, 0);
                (self.start, self.end) = (0, self.end - self.start);
            }
            if want > self.buf.len() {
                self.buf.resize(want, 0);
            }
        }
        let limit = self.start + want;
        &mut self.buf[self.end..limit]
    }

    fn advance(&mut self, n: usize) {
        self.end += n;
    }

    /// Reads until a whole frame is buffered. `Ok(None)`: the peer closed
    /// cleanly between frames. Each read waits at most `idle`.
    async fn next(&mut self, stream: &mut TcpStream, idle: Duration) -> Result<Option<Frame>, ReadError> {
        loop {
            if let Some(frame) = self.decode().map_err(ReadError::Decode)? {
                return Ok(Some(frame));
            }
            let n = match timeout(idle, stream.read(self.space())).await {
                Err(_) => return Err(ReadError::Idle(idle)),
                Ok(Err(e)) => return Err(ReadError::Io(e)),
                Ok(Ok(n)) => n,
            };
            if n == 0 {
                return if self.is_empty() { Ok(None) } else { Err(ReadError::Truncated) };
            }
            self.advance(n);
        }
    }
}

/// Why a write did not finish.
#[derive(Debug)]
enum WriteError {
    Io(io::Error),
    Timeout(Duration),
}

/// Writes every byte of `parts`, in order, with vectored writes, within `wait`.
async fn write_parts<const N: usize>(
    stream: &mut TcpStream,
    parts: [&[u8]; N],
    wait: Duration,
) -> Result<(), WriteError> {
    let total: usize = parts.iter().map(|p| p.len()).sum();
    let all = async {
        let mut done = 0;
        while done < total {
            let mut slices: [IoSlice<'_>; N] = std::array::from_fn(|_| IoSlice::new(&[]));
            let (mut skip, mut k) = (done, 0);
            for p in parts {
                if skip >= p.len() {
                    skip -= p.len();
                    continue;
                }
                slices[k] = IoSlice::new(&p[skip..]);
                skip = 0;
                k += 1;
            }
            let n = stream.write_vectored(&slices[..k]).await?;
            if n == 0 {
                return Err(io::Error::from(io::ErrorKind::WriteZero));
            }
            done += n;
        }
        Ok(())
    };
    match timeout(wait, all).await {
        Err(_) => Err(WriteError::Timeout(wait)),
        Ok(r) => r.map_err(WriteError::Io),
    }
}

/// Encodes a small control frame into `out` and writes it.
async fn write_frame(stream: &mut TcpStream, out: &mut Vec<u8>, f: &Frame, wait: Duration) -> Result<(), WriteError> {
    out.clear();
    // Only LayerData can fail to encode; control frames are fixed-size.
    f.encode(out).map_err(|e| WriteError::Io(io::Error::new(io::ErrorKind::InvalidInput, e)))?;
    write_parts(stream, [out.as_slice()], wait).await
}

fn frame_name(f: &Frame) -> &'static str {
    match f {
        Frame::Hello(_) => "Hello",
        Frame::HelloAck(_) => "HelloAck",
        Frame::HelloReject(_) => "HelloReject",
        Frame::LayerData(_) => "LayerData",
        Frame::Complete(_) => "Complete",
        Frame::Ack(_) => "Ack",
        Frame::Abort(_) => "Abort",
    }
}

/// Bounded memory of recent items, oldest forgotten first.
#[derive(Debug)]
struct Recent<T>(std::collections::VecDeque<T>);

impl<T> Default for Recent<T> {
    fn default() -> Self {
        Self(std::collections::VecDeque::new())
    }
}

impl<T: PartialEq> Recent<T> {
    fn push(&mut self, t: T) {
        if self.0.len() == REMEMBERED {
            self.0.pop_front();
        }
        self.0.push_back(t);
    }
    fn contains(&self, t: &T) -> bool {
        self.0.contains(t)
    }
}

// ---------------------------------------------------------------- server

/// Server settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpServerConfig {
    /// Largest frame accepted (buffer growth per connection is bounded by it).
    pub limits: DecodeLimits,
    /// A connection with no incoming byte for this long is closed.
    pub idle_timeout: Duration,
    /// Connections served at once; more are closed on accept.
    pub max_connections: usize,
}

impl Default for TcpServerConfig {
    /// Default limits (64 MiB frames), 30 s idle timeout, 256 connections.
    fn default() -> Self {
        Self { limits: DecodeLimits::default(), idle_timeout: Duration::from_secs(30), max_connections: 256 }
    }
}

/// Why the server closed (or saw the end of) a connection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CloseReason {
    /// The peer closed between frames: the normal end.
    #[error("peer closed the connection")]
    PeerClosed,
    /// The peer closed in the middle of a frame.
    #[error("peer closed mid-frame")]
    Truncated,
    /// A socket error (reset, broken pipe, …).
    #[error("i/o error: {0:?}")]
    Io(io::ErrorKind),
    /// No byte arrived (or could be written) within the idle timeout.
    #[error("idle for {0:?}")]
    Idle(Duration),
    /// Bytes that are not a frame; the stream cannot be resynchronised.
    #[error("undecodable bytes: {0}")]
    Decode(DecodeError),
    /// The first frame was not `Hello`.
    #[error("first frame was {got}, not Hello")]
    NotHello { got: &'static str },
    /// The handshake was refused (after telling the peer).
    #[error("handshake rejected: {}", .0.as_str())]
    Rejected(RejectReason),
    /// A frame a sender never sends (`HelloAck`, `Ack`, a second `Hello`, …).
    #[error("unexpected {got} from a sender")]
    UnexpectedFrame { got: &'static str },
}

impl CloseReason {
    /// Every [`as_str`](Self::as_str) label, in [`TcpServerStats::closed`] order.
    pub const LABELS: [&'static str; 8] =
        ["peer_closed", "truncated", "io", "idle", "decode", "not_hello", "rejected", "unexpected_frame"];

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
            Self::UnexpectedFrame { .. } => 7,
        }
    }
}

impl From<ReadError> for CloseReason {
    fn from(e: ReadError) -> Self {
        match e {
            ReadError::Io(e) => Self::Io(e.kind()),
            ReadError::Idle(d) => Self::Idle(d),
            ReadError::Decode(e) => Self::Decode(e),
            ReadError::Truncated => Self::Truncated,
        }
    }
}

impl From<WriteError> for CloseReason {
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
pub struct TcpServerStats {
    pub connections_accepted: u64,
    /// Closed on accept because `max_connections` were being served.
    pub connections_refused_busy: u64,
    /// Ended connections by [`CloseReason`], in [`CloseReason::LABELS`] order.
    pub closed: [u64; CloseReason::LABELS.len()],
    /// `Abort` frames sent (refused frames, at most one per reservation and connection).
    pub aborts_sent: u64,
    /// Accepted frames the [`BlockSink`] failed to store.
    pub sink_failures: u64,
}

impl TcpServerStats {
    /// Connections that ended for any reason.
    pub fn connections_closed(&self) -> u64 {
        self.closed.iter().sum()
    }

    /// Connections that ended with this [`CloseReason::as_str`] label.
    pub fn closed_by(&self, label: &str) -> u64 {
        CloseReason::LABELS.iter().position(|l| *l == label).map_or(0, |i| self.closed[i])
    }
}

struct Shared {
    receiver: Arc<Mutex<Receiver>>,
    config: TcpServerConfig,
    stats: watch::Sender<TcpServerStats>,
}

/// The receiver never panics while locked (it is a plain state machine), so
/// a poisoned lock can only come from a panicking sink; its state is still
/// consistent.
fn lock(rx: &Mutex<Receiver>) -> MutexGuard<'_, Receiver> {
    rx.lock().unwrap_or_else(|e| e.into_inner())
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
    /// Binds `addr` and starts serving. Must be called within a tokio runtime.
    pub async fn bind<S>(
        addr: impl ToSocketAddrs,
        receiver: Arc<Mutex<Receiver>>,
        sink: S,
        config: TcpServerConfig,
    ) -> io::Result<Self>
    where
        S: BlockSink + Clone + 'static,
    {
        let listener = TcpListener::bind(addr).await?;
        let local_addr = listener.local_addr()?;
        let (tx, stats) = watch::channel(TcpServerStats::default());
        let shared = Arc::new(Shared { receiver, config, stats: tx });
        let task = tokio::spawn(accept_loop(listener, shared, sink));
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

async fn accept_loop<S: BlockSink + Clone + 'static>(listener: TcpListener, shared: Arc<Shared>, sink: S) {
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
async fn serve<S: BlockSink>(mut stream: TcpStream, shared: &Shared, sink: &mut S) -> CloseReason {
    // Control frames (HelloAck, Ack, Abort) are small and latency-bound.
    let _ = stream.set_nodelay(true);
    let idle = shared.config.idle_timeout;
    let mut reader = FrameReader::new(shared.config.limits);
    let mut out = Vec::with_capacity(64);

    let hello = match reader.next(&mut stream, idle).await {
        Ok(Some(Frame::Hello(h))) => h,
        Ok(Some(other)) => return CloseReason::NotHello { got: frame_name(&other) },
        Ok(None) => return CloseReason::PeerClosed,
        Err(e) => return e.into(),
    };
    let verdict = lock(&shared.receiver).on_hello(&hello);
    let reply = match verdict {
        Ok(ack) => Frame::HelloAck(ack),
        Err(reject) => Frame::HelloReject(reject),
    };
    if let Err(e) = write_frame(&mut stream, &mut out, &reply, idle).await {
        return e.into();
    }
    if let Err(reject) = verdict {
        return CloseReason::Rejected(reject.reason);
    }

    let mut aborted = Recent::default();
    loop {
        let frame = match reader.next(&mut stream, idle).await {
            Ok(Some(f)) => f,
            Ok(None) => return CloseReason::PeerClosed,
            Err(e) => return e.into(),
        };
        let now = Instant::now().into_std();
        let reply = match frame {
            Frame::LayerData(d) => {
                let mut rx = lock(&shared.receiver);
                let abort = |reason| Abort { reservation: d.reservation, generation: d.generation, reason };
                match rx.on_layer(&d, now) {
                    Ok(w) => {
                        let (k, v) = w.split_payload(&d.payload);
                        match sink.write_layer(w.layer, &w.blocks, k, v) {
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
                        }
                    }
                    Err(e) => Some(abort(e.abort_reason())),
                }
            }
            Frame::Complete(c) => {
                // Bound first: the guard must not live across the await below.
                let verdict = lock(&shared.receiver).on_complete(&c, now);
                match verdict {
                    Ok(ack) => {
                        if let Err(e) = write_frame(&mut stream, &mut out, &Frame::Ack(ack), idle).await {
                            return e.into();
                        }
                        None
                    }
                    Err(e) => {
                        Some(Abort { reservation: c.reservation, generation: c.generation, reason: e.abort_reason() })
                    }
                }
            }
            Frame::Abort(a) => {
                // Refused only when the reservation already ended: nothing to do.
                let _ = lock(&shared.receiver).on_abort(&a, now);
                None
            }
            other => return CloseReason::UnexpectedFrame { got: frame_name(&other) },
        };
        if let Some(a) = reply {
            let key = (a.reservation, a.generation);
            if !aborted.contains(&key) {
                aborted.push(key);
                if let Err(e) = write_frame(&mut stream, &mut out, &Frame::Abort(a), idle).await {
                    return e.into();
                }
                shared.stats.send_modify(|s| s.aborts_sent += 1);
            }
        }
    }
}

// ---------------------------------------------------------------- sender

/// Why a send failed. Each variant has a [`kind`](Self::kind) the caller
/// acts on (`kv_load_failure_policy`).
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    /// Connecting, reading or writing failed, or the receiver closed the connection.
    #[error("connection: {0}")]
    Io(#[from] io::Error),
    /// The receiver refused the handshake: protocol version, version group
    /// or layout fingerprint differ. Retrying the same pair fails again.
    #[error("handshake rejected: {}", reason.as_str())]
    Rejected { reason: RejectReason },
    /// Something did not happen in time.
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout { what: &'static str, after: Duration },
    /// The receiver said something the protocol does not allow here.
    #[error("protocol: {0}")]
    Protocol(String),
    /// The receiver refused the transfer (lease expired, corrupt frame, …).
    #[error("receiver aborted the transfer: {}", reason.as_str())]
    PeerAbort { reason: AbortReason },
    /// The caller's K/V bytes do not fit the layout (a local bug).
    #[error("layer not sendable: {0}")]
    Layer(#[from] SplitError),
}

impl TransferError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Io(_) => ErrorKind::Retryable,
            Self::Rejected { reason } => reason.kind(),
            Self::Timeout { .. } => ErrorKind::Deadline,
            Self::Protocol(_) | Self::Layer(_) => ErrorKind::InvalidInput,
            Self::PeerAbort { reason } => reason.kind(),
        }
    }

    fn write(e: WriteError, what: &'static str) -> Self {
        match e {
            WriteError::Io(e) => Self::Io(e),
            WriteError::Timeout(after) => Self::Timeout { what, after },
        }
    }

    fn read(e: ReadError, what: &'static str) -> Self {
        match e {
            ReadError::Io(e) => Self::Io(e),
            ReadError::Idle(after) => Self::Timeout { what, after },
            ReadError::Decode(e) => Self::Protocol(format!("undecodable bytes from the receiver: {e}")),
            ReadError::Truncated => Self::Io(io::Error::new(io::ErrorKind::UnexpectedEof, "receiver closed mid-frame")),
        }
    }
}

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
    stream: TcpStream,
    layout: KvLayout,
    config: TcpSenderConfig,
    reader: FrameReader,
    out: Vec<u8>,
    /// Aborts and acks that arrived before the caller asked about them.
    aborts: Recent<Abort>,
    acks: Recent<Ack>,
    bytes_sent: u64,
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
        // The receiver only sends small control frames.
        let reader = FrameReader::new(DecodeLimits { max_payload_bytes: 0 });
        let mut s = Self {
            stream,
            layout,
            config,
            reader,
            out: Vec::with_capacity(LAYER_DATA_OVERHEAD),
            aborts: Recent::default(),
            acks: Recent::default(),
            bytes_sent: 0,
        };
        let hello = Frame::Hello(Hello {
            version_group: local.version_group.clone(),
            fingerprint: local.fingerprint,
            protocol_version: crate::PROTOCOL_VERSION,
        });
        write_frame(&mut s.stream, &mut s.out, &hello, wait)
            .await
            .map_err(|e| TransferError::write(e, "sending Hello"))?;
        match s.reader.next(&mut s.stream, wait).await.map_err(|e| TransferError::read(e, "HelloAck"))? {
            Some(Frame::HelloAck(a)) if a.protocol_version == crate::PROTOCOL_VERSION => Ok(s),
            Some(Frame::HelloAck(a)) => {
                Err(TransferError::Protocol(format!("HelloAck for protocol version {}", a.protocol_version)))
            }
            Some(Frame::HelloReject(r)) => Err(TransferError::Rejected { reason: r.reason }),
            Some(other) => Err(TransferError::Protocol(format!("{} instead of HelloAck", frame_name(&other)))),
            None => Err(TransferError::Io(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "receiver closed the connection during the handshake",
            ))),
        }
    }

    /// Payload and header bytes written so far.
    pub fn bytes_sent(&self) -> u64 {
        self.bytes_sent
    }

    /// Sends one layer's K and V of the reservation's blocks (as
    /// [`KvPool::gather_layer`](engine::kv::KvPool::gather_layer) returns
    /// them), cut into frames of whole blocks as
    /// [`split_layer`](crate::split_layer) cuts them, written without
    /// copying the payload. Fails fast with
    /// [`PeerAbort`](TransferError::PeerAbort) if the receiver already
    /// refused this reservation.
    pub async fn send_layer(&mut self, r: Reservation, layer: usize, k: &[u8], v: &[u8]) -> Result<(), TransferError> {
        let l = &self.layout;
        if layer >= l.n_layers || layer > u32::MAX as usize {
            return Err(SplitError::LayerOutOfRange { layer, n_layers: l.n_layers }.into());
        }
        let side = l.block_elems() * l.dtype.size();
        if side == 0 || k.is_empty() || k.len() != v.len() || k.len() % side != 0 {
            return Err(SplitError::Shape { len: k.len() + v.len(), per_block: 2 * side }.into());
        }
        let n_blocks = k.len() / side;
        if n_blocks > u32::MAX as usize {
            return Err(SplitError::TooManyBlocks { n_blocks }.into());
        }
        let max = self.config.max_frame_bytes;
        let per_frame = max.saturating_sub(LAYER_DATA_OVERHEAD) / (2 * side);
        if per_frame == 0 {
            return Err(
                SplitError::FrameTooSmall { max_frame_bytes: max, needed: LAYER_DATA_OVERHEAD + 2 * side }.into()
            );
        }
        let mut first = 0;
        while first < n_blocks {
            self.check_not_aborted(r)?;
            let n = per_frame.min(n_blocks - first);
            let range = first * side..(first + n) * side;
            let (kr, vr) = (&k[range.clone()], &v[range]);
            let header = LayerDataHeader {
                reservation: r.id.0,
                generation: r.generation,
                // Both checked to fit u32 above.
                layer: layer as u32,
                first_block: first as u32,
                n_blocks: n as u32,
                checksum: crc32c::crc32c_append(crc32c::crc32c(kr), vr),
                payload_len: 2 * kr.len(),
            };
            self.out.clear();
            header.encode(&mut self.out).map_err(|e| TransferError::Protocol(e.to_string()))?;
            write_parts(&mut self.stream, [self.out.as_slice(), kr, vr], self.config.timeout)
                .await
                .map_err(|e| TransferError::write(e, "writing a LayerData frame"))?;
            self.bytes_sent += (LAYER_DATA_OVERHEAD + 2 * kr.len()) as u64;
            first += n;
        }
        Ok(())
    }

    /// Says every layer was sent and waits (up to the configured timeout)
    /// for the receiver's `Ack`. After `Ok` the sender may drop its copy.
    pub async fn complete(&mut self, r: Reservation) -> Result<Ack, TransferError> {
        self.check_not_aborted(r)?;
        let c = Frame::Complete(Complete {
            reservation: r.id.0,
            generation: r.generation,
            n_layers: self.layout.n_layers as u32,
        });
        let wait = self.config.timeout;
        write_frame(&mut self.stream, &mut self.out, &c, wait)
            .await
            .map_err(|e| TransferError::write(e, "sending Complete"))?;
        let want = Ack { reservation: r.id.0, generation: r.generation };
        let waiting = async {
            loop {
                if self.acks.contains(&want) {
                    return Ok(want);
                }
                self.check_aborted(r)?;
                match self.reader.next(&mut self.stream, wait).await.map_err(|e| TransferError::read(e, "Ack"))? {
                    Some(f) => self.note(f)?,
                    None => {
                        return Err(TransferError::Io(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            "receiver closed the connection before acknowledging",
                        )))
                    }
                }
            }
        };
        timeout(wait, waiting).await.map_err(|_| TransferError::Timeout { what: "Ack", after: wait })?
    }

    /// Tells the receiver this transfer is abandoned (prefill failed, request cancelled).
    pub async fn abort(&mut self, r: Reservation, reason: AbortReason) -> Result<(), TransferError> {
        let a = Frame::Abort(Abort { reservation: r.id.0, generation: r.generation, reason });
        write_frame(&mut self.stream, &mut self.out, &a, self.config.timeout)
            .await
            .map_err(|e| TransferError::write(e, "sending Abort"))
    }

    /// Takes in whatever the receiver already sent, without waiting, then
    /// fails if it aborted `r`.
    fn check_not_aborted(&mut self, r: Reservation) -> Result<(), TransferError> {
        let drained = self.drain();
        self.check_aborted(r)?;
        drained
    }

    fn check_aborted(&self, r: Reservation) -> Result<(), TransferError> {
        match self.aborts.0.iter().find(|a| a.reservation == r.id.0 && a.generation == r.generation) {
            Some(a) => Err(TransferError::PeerAbort { reason: a.reason }),
            None => Ok(()),
        }
    }

    fn drain(&mut self) -> Result<(), TransferError> {
        loop {
            while let Some(f) = self.reader.decode().map_err(|e| TransferError::read(ReadError::Decode(e), ""))? {
                self.note(f)?;
            }
            match self.stream.try_read(self.reader.space()) {
                Ok(0) => {
                    return Err(TransferError::Io(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "receiver closed the connection",
                    )))
                }
                Ok(n) => self.reader.advance(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) => return Err(e.into()),
            }
        }
    }

    fn note(&mut self, f: Frame) -> Result<(), TransferError> {
        match f {
            Frame::Abort(a) => self.aborts.push(a),
            Frame::Ack(a) => self.acks.push(a),
            other => {
                return Err(TransferError::Protocol(format!("unexpected {} from the receiver", frame_name(&other))))
            }
        }
        Ok(())
    }
}
