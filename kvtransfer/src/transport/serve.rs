//! The decode side of one frame stream, over any byte stream: handshake,
//! then every frame through the shared [`Receiver`] into the [`BlockSink`].
//! The TCP and QUIC servers run it once per connection (or stream).

use std::future::poll_fn;
use std::io;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::watch;
use tokio::time::Instant;

use super::lock::lock;
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
        let reply = match frame {
            Incoming::Layer { header, payload, crc32c } => {
                poll_fn(|cx| sink.poll_ready(cx, payload.len())).await;
                layer(shared, sink, &header, payload, crc32c, Instant::now())
            }
            // Not from FrameReader::next (its LayerData come as Layer); checked the slow way all the same.
            Incoming::Frame(Frame::LayerData(d)) => {
                let crc = d.payload_checksum();
                poll_fn(|cx| sink.poll_ready(cx, d.payload.len())).await;
                layer(shared, sink, &d.header(), d.payload, crc, Instant::now())
            }
            Incoming::Frame(Frame::Complete(c)) => {
                // Bound first: the guard must not live across the await below.
                let verdict = lock(&shared.receiver).on_complete(&c, Instant::now());
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
                let _ = lock(&shared.receiver).on_abort(&a, Instant::now());
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
    now: tokio::time::Instant,
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
        Err(e) => {
            sink.unready();
            Some(abort(e.abort_reason()))
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::task::{Context, Poll, Waker};

    use tokio::io::{duplex, split, DuplexStream, ReadHalf, WriteHalf};
    use types::kv::{BlockId, KvDtype, KvLayout};

    use super::*;
    use crate::fingerprint::{LayoutFingerprint, VersionGroup};
    use crate::session::{Peer, ReceiverConfig, ReleaseCause, ReservationState};
    use crate::transport::send::FrameSender;
    use crate::transport::{FnSink, OwnedPayload};
    use crate::WriteInstruction;

    const LAYOUT: KvLayout = KvLayout { n_layers: 2, n_kv_heads: 1, head_dim: 8, block_size: 4, dtype: KvDtype::F16 };
    /// Bytes of one block's K (or V) in one layer.
    const SIDE: usize = 4 * 8 * 2;
    const WAIT: Duration = Duration::from_secs(1);

    fn peer() -> Peer {
        Peer {
            version_group: VersionGroup::new("g1").expect("label"),
            fingerprint: LayoutFingerprint::new(&LAYOUT, &[1; 32], &[2; 32]),
        }
    }

    type Sender = FrameSender<ReadHalf<DuplexStream>, WriteHalf<DuplexStream>>;

    /// A server on one end of an in-memory stream (no I/O driver, so a paused
    /// clock moves only when told), a handshaken sender on the other.
    async fn pair<S: BlockSink + 'static>(
        sink: S,
    ) -> (Arc<Mutex<Receiver>>, Sender, tokio::task::JoinHandle<CloseReason>) {
        let rx = Arc::new(Mutex::new(Receiver::new(peer(), ReceiverConfig::new(LAYOUT)).expect("config")));
        let shared = Shared::new(rx.clone(), DecodeLimits::default(), Duration::from_secs(30));
        let (client, server) = duplex(1 << 16);
        let task = tokio::spawn(async move {
            let (mut rd, mut wr) = split(server);
            let mut sink = sink;
            serve(&mut rd, &mut wr, &shared, &mut sink).await
        });
        let (rd, wr) = split(client);
        let tx = FrameSender::handshake(rd, wr, &peer(), LAYOUT, WAIT, 1 << 20).await.expect("handshake");
        (rx, tx, task)
    }

    /// Lets the server task run until `done` says so (a bounded number of
    /// turns: the clock does not move meanwhile).
    async fn until(what: &str, mut done: impl FnMut() -> bool) {
        for _ in 0..10_000 {
            if done() {
                return;
            }
            tokio::task::yield_now().await;
        }
        panic!("{what} did not happen");
    }

    /// A lease set on tokio's clock expires on it through a server: frames
    /// within the lease land, the clock is advanced past it, the next frame
    /// is refused as expired and the blocks come back as `LeaseExpired`. The
    /// clock is paused, so the five-second lease costs no real time.
    #[tokio::test(start_paused = true)]
    #[allow(clippy::disallowed_types, reason = "checks that no real time passed")]
    async fn a_lease_expires_on_tokios_paused_clock_through_the_server() {
        let real = std::time::Instant::now();
        let (rx, mut tx, _server) = pair(FnSink(|_: usize, _: &[BlockId], _: &[u8], _: &[u8]| Ok(()))).await;
        let ttl = Duration::from_secs(5);
        let r = lock(&rx).reserve(vec![10, 11], ttl, Instant::now()).expect("reserve");
        let (k, v) = (vec![1u8; 2 * SIDE], vec![2u8; 2 * SIDE]);

        tx.send_blocks(r, 0, 0, &k, &v).await.expect("send layer 0");
        until("layer 0 accepted", || lock(&rx).counters().layer_frames_accepted == 1).await;
        tokio::time::advance(ttl - Duration::from_millis(1)).await;
        assert!(lock(&rx).poll_released(Instant::now()).is_empty(), "not expired 1 ms before the lease end");

        tokio::time::advance(Duration::from_millis(1)).await;
        tx.send_blocks(r, 1, 0, &k, &v).await.expect("send layer 1");
        until("layer 1 refused", || lock(&rx).counters().refused("expired") == 1).await;
        assert_eq!(lock(&rx).state(r), Some(ReservationState::Expired));
        let released = lock(&rx).poll_released(Instant::now());
        assert_eq!(released.len(), 1);
        assert_eq!((released[0].blocks.clone(), released[0].cause), (vec![10, 11], ReleaseCause::LeaseExpired));
        assert!(real.elapsed() < Duration::from_secs(2), "waited in real time: {:?}", real.elapsed());
    }

    /// A sink that takes one write per credit it is given, and is not ready
    /// without one.
    #[derive(Clone, Default)]
    struct Gated(Arc<Mutex<GateState>>);

    #[derive(Default)]
    struct GateState {
        credits: usize,
        written: VecDeque<usize>,
        waiting: Option<Waker>,
        polled: usize,
    }

    impl Gated {
        fn give(&self, n: usize) {
            let mut g = self.0.lock().expect("gate");
            g.credits += n;
            if let Some(w) = g.waiting.take() {
                w.wake();
            }
        }

        fn state<T>(&self, f: impl FnOnce(&GateState) -> T) -> T {
            f(&self.0.lock().expect("gate"))
        }
    }

    impl BlockSink for Gated {
        fn poll_ready(&mut self, cx: &mut Context<'_>, _len: usize) -> Poll<()> {
            let mut g = self.0.lock().expect("gate");
            g.polled += 1;
            if g.credits > 0 {
                return Poll::Ready(());
            }
            g.waiting = Some(cx.waker().clone());
            Poll::Pending
        }

        fn write_layer(&mut self, _: usize, _: &[BlockId], _: &[u8], _: &[u8]) -> Result<(), String> {
            Err("owned only".into())
        }

        fn write_layer_owned(&mut self, w: WriteInstruction, _payload: OwnedPayload) -> Result<(), String> {
            let mut g = self.0.lock().expect("gate");
            g.credits = g.credits.checked_sub(1).ok_or("written without a credit")?;
            g.written.push_back(w.layer);
            Ok(())
        }
    }

    /// While the sink is not ready the server neither checks nor writes the
    /// frame, and holds no lock: the receiver stays free for everyone else.
    /// Once the sink is ready the frame lands, in order.
    #[tokio::test]
    async fn a_sink_that_is_not_ready_holds_the_frame_back_without_the_receiver() {
        let gate = Gated::default();
        let (rx, mut tx, _server) = pair(gate.clone()).await;
        let r = lock(&rx).reserve(vec![3, 4], Duration::from_secs(60), Instant::now()).expect("reserve");
        let (k, v) = (vec![1u8; 2 * SIDE], vec![2u8; 2 * SIDE]);
        tx.send_blocks(r, 0, 0, &k, &v).await.expect("send layer 0");
        tx.send_blocks(r, 1, 0, &k, &v).await.expect("send layer 1");
        until("the server waits for the sink", || gate.state(|g| g.polled > 0 && g.waiting.is_some())).await;
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        // Free, and nothing checked yet.
        let counters = rx.try_lock().expect("the receiver is not held while the sink is not ready").counters().clone();
        assert_eq!(counters.layer_frames_accepted, 0);

        gate.give(1);
        until("layer 0 written", || gate.state(|g| g.written.len() == 1)).await;
        assert_eq!(lock(&rx).counters().layer_frames_accepted, 1, "one credit, one frame");
        gate.give(1);
        until("layer 1 written", || gate.state(|g| g.written.len() == 2)).await;
        assert_eq!(gate.state(|g| g.written.iter().copied().collect::<Vec<_>>()), vec![0, 1]);
        let ack = tx.complete(r).await.expect("complete");
        assert_eq!((ack.reservation, ack.generation), (r.id.0, r.generation));
    }
}
