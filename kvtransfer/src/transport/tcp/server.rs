//! The decode worker's side: accepts connections and feeds a [`Receiver`].

use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream, ToSocketAddrs};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;

use super::super::BlockSink;
use crate::frame::{Abort, AbortReason, DecodeError, DecodeLimits, Frame, RejectReason};
use crate::session::Receiver;

use super::{frame_name, write_frame, FrameReader, ReadError, Recent, WriteError};

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
                        let (reservation, generation) = (d.reservation, d.generation);
                        let abort = |reason| Abort { reservation, generation, reason };
                        match sink.write_layer_owned(w, Box::new(d.payload)) {
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
