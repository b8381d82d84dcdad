//! The decode side of one frame stream, over any byte stream: handshake,
//! then every frame through the shared [`Receiver`] into the [`BlockSink`].
//! The TCP and QUIC servers run it once per connection (or stream).

use std::io;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::watch;
use tokio::time::Instant;

use super::stream::{frame_name, write_frame, FrameReader, Incoming, PayloadPool, ReadError, Recent, WriteError};
use super::BlockSink;
use crate::frame::{Abort, AbortReason, DecodeError, DecodeLimits, Frame, LayerDataHeader, RejectReason};
use crate::session::Receiver;

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
    /// The TLS handshake failed: the peer's certificate was refused, or it
    /// refused ours (QUIC only).
    #[error("TLS handshake failed: {0}")]
    Tls(String),
}

impl CloseReason {
    /// Every [`as_str`](Self::as_str) label, in [`ServerStats::closed`] order.
    pub const LABELS: [&'static str; 9] =
        ["peer_closed", "truncated", "io", "idle", "decode", "not_hello", "rejected", "unexpected_frame", "tls"];

    /// Stable label for logs and metrics.
    pub fn as_str(&self) -> &'static str {
        Self::LABELS[self.index()]
    }

    pub(crate) fn index(&self) -> usize {
        match self {
            Self::PeerClosed => 0,
            Self::Truncated => 1,
            Self::Io(_) => 2,
            Self::Idle(_) => 3,
            Self::Decode(_) => 4,
            Self::NotHello { .. } => 5,
            Self::Rejected(_) => 6,
            Self::UnexpectedFrame { .. } => 7,
            Self::Tls(_) => 8,
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

/// What a server has done, for metrics and tests. Frame-level counts live
/// in [`Receiver::counters`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServerStats {
    pub connections_accepted: u64,
    /// Closed on accept because `max_connections` were being served.
    pub connections_refused_busy: u64,
    /// Ended connections (QUIC: frame streams) by [`CloseReason`], in
    /// [`CloseReason::LABELS`] order.
    pub closed: [u64; CloseReason::LABELS.len()],
    /// `Abort` frames sent (refused frames, at most one per reservation and connection).
    pub aborts_sent: u64,
    /// Accepted frames the [`BlockSink`] failed to store.
    pub sink_failures: u64,
}

impl ServerStats {
    /// Connections that ended for any reason.
    pub fn connections_closed(&self) -> u64 {
        self.closed.iter().sum()
    }

    /// Connections that ended with this [`CloseReason::as_str`] label.
    pub fn closed_by(&self, label: &str) -> u64 {
        CloseReason::LABELS.iter().position(|l| *l == label).map_or(0, |i| self.closed[i])
    }
}

/// What every connection task of one server shares.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) receiver: Arc<Mutex<Receiver>>,
    pub(crate) limits: DecodeLimits,
    pub(crate) idle_timeout: Duration,
    pub(crate) stats: watch::Sender<ServerStats>,
    pub(crate) payloads: PayloadPool,
}

impl Shared {
    pub(crate) fn new(receiver: Arc<Mutex<Receiver>>, limits: DecodeLimits, idle_timeout: Duration) -> Self {
        let (stats, _) = watch::channel(ServerStats::default());
        Self { receiver, limits, idle_timeout, stats, payloads: PayloadPool::default() }
    }

    pub(crate) fn closed(&self, reason: &CloseReason) {
        self.stats.send_modify(|s| s.closed[reason.index()] += 1);
    }
}

/// The receiver never panics while locked (it is a plain state machine), so
/// a poisoned lock can only come from a panicking sink; its state is still
/// consistent.
fn lock(rx: &Mutex<Receiver>) -> MutexGuard<'_, Receiver> {
    rx.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs one frame stream to its end and says why it ended.
pub(crate) async fn serve<R, W, S>(rd: &mut R, wr: &mut W, shared: &Shared, sink: &mut S) -> CloseReason
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
    S: BlockSink,
{
    let idle = shared.idle_timeout;
    let mut reader = FrameReader::new(shared.limits, shared.payloads.clone());
    let mut out = Vec::with_capacity(64);

    let hello = match reader.next(rd, idle).await.map(|f| f.map(Incoming::into_frame)) {
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
    if let Err(e) = write_frame(wr, &mut out, &reply, idle).await {
        return e.into();
    }
    if let Err(reject) = verdict {
        return CloseReason::Rejected(reject.reason);
    }

    let mut aborted = Recent::default();
    loop {
        let frame = match reader.next(rd, idle).await {
            Ok(Some(f)) => f,
            Ok(None) => return CloseReason::PeerClosed,
            Err(e) => return e.into(),
        };
        let now = Instant::now().into_std();
        let reply = match frame {
            Incoming::Layer { header, payload, crc32c } => layer(shared, sink, &header, payload, crc32c, now),
            // Not from FrameReader::next (its LayerData come as Layer); checked the slow way all the same.
            Incoming::Frame(Frame::LayerData(d)) => {
                let crc = d.payload_checksum();
                layer(shared, sink, &d.header(), d.payload, crc, now)
            }
            Incoming::Frame(Frame::Complete(c)) => {
                // Bound first: the guard must not live across the await below.
                let verdict = lock(&shared.receiver).on_complete(&c, now);
                match verdict {
                    Ok(ack) => {
                        if let Err(e) = write_frame(wr, &mut out, &Frame::Ack(ack), idle).await {
                            return e.into();
                        }
                        None
                    }
                    Err(e) => {
                        Some(Abort { reservation: c.reservation, generation: c.generation, reason: e.abort_reason() })
                    }
                }
            }
            Incoming::Frame(Frame::Abort(a)) => {
                // Refused only when the reservation already ended: nothing to do.
                let _ = lock(&shared.receiver).on_abort(&a, now);
                None
            }
            Incoming::Frame(other) => return CloseReason::UnexpectedFrame { got: frame_name(&other) },
        };
        if let Some(a) = reply {
            let key = (a.reservation, a.generation);
            if !aborted.contains(&key) {
                aborted.push(key);
                if let Err(e) = write_frame(wr, &mut out, &Frame::Abort(a), idle).await {
                    return e.into();
                }
                shared.stats.send_modify(|s| s.aborts_sent += 1);
            }
        }
    }
}

/// Checks a `LayerData` whose payload (ours, already read) has CRC-32C
/// `crc`, and hands an accepted one to the sink. `Some`: the `Abort` to
/// send. The sink's write (or hand-off, for a deferring sink) happens under
/// the receiver's lock, so the reservation cannot end and its blocks be
/// reused before the write is placed; see [`BlockSink`].
fn layer<S: BlockSink>(
    shared: &Shared,
    sink: &mut S,
    header: &LayerDataHeader,
    payload: Vec<u8>,
    crc: u32,
    now: std::time::Instant,
) -> Option<Abort> {
    let mut rx = lock(&shared.receiver);
    let abort = |reason| Abort { reservation: header.reservation, generation: header.generation, reason };
    match rx.on_layer_checked(header, crc, now) {
        Ok(w) => match sink.write_layer_owned(w, shared.payloads.owned(payload)) {
            Ok(()) => None,
            Err(_) => {
                // The blocks' content is now unknown: void the reservation
                // (blocks go to poll_released) and tell the sender to retry
                // elsewhere.
                let a = abort(AbortReason::Corrupt);
                let _ = rx.on_abort(&a, now);
                shared.stats.send_modify(|s| s.sink_failures += 1);
                Some(a)
            }
        },
        Err(e) => Some(abort(e.abort_reason())),
    }
}
