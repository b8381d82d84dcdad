//! The decode side's one driver ([`drive`]) of a sender's connection:
//! handshake, then every frame through the shared [`Receiver`] into the
//! [`BlockSink`], by the rules of `inbound.rs`, over any transport's
//! primitives ([`Conn`]). The TCP and QUIC servers run it over a byte stream
//! ([`StreamConn`]) once per connection (or stream), the local server over
//! its socket and ring.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::watch;
use tokio::time::Instant;

use super::close::{CloseReason, ServerStats};
use super::direct::{read_into_pool, DirectPool, DirectRead, InPlace};
use super::inbound::{self, Event, InboundConn, Verdict};
use super::lock::lock;
use super::stream::{frame_name, write_frame, FrameReader, Head, ReadError, WriteError};
use super::BlockSink;
use crate::buffers::Buffers;
use crate::frame::{DecodeLimits, Frame, Hello, LayerDataHeader};
use crate::session::{Receiver, Reservation, ReservationId};

/// Most bytes of idle payload buffers a server keeps for reuse.
const PAYLOAD_KEEP_BYTES: usize = 32 << 20;

/// What every connection task of one server shares.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) receiver: Arc<Mutex<Receiver>>,
    pub(crate) limits: DecodeLimits,
    pub(crate) idle_timeout: Duration,
    pub(crate) stats: watch::Sender<ServerStats>,
    pub(crate) payloads: Buffers,
    /// The pool tcp connections read payloads straight into, if any.
    pub(crate) direct: Option<DirectPool>,
}

impl Shared {
    pub(crate) fn new(receiver: Arc<Mutex<Receiver>>, limits: DecodeLimits, idle_timeout: Duration) -> Self {
        let (stats, _) = watch::channel(ServerStats::default());
        Self { receiver, limits, idle_timeout, stats, payloads: Buffers::new(PAYLOAD_KEEP_BYTES), direct: None }
    }

    pub(crate) fn closed(&self, reason: &CloseReason) {
        self.stats.send_modify(|s| s.close(reason));
    }
}

/// One sender's connection as a transport carries it: the primitives
/// [`drive`] runs the receive rules (`inbound.rs`) over. Tcp and quic
/// streams are [`StreamConn`]; the local transport's socket and ring are
/// its own.
pub(crate) trait Conn {
    /// The first message, which must be `Hello`.
    async fn hello(&mut self) -> Result<Hello, CloseReason>;
    /// After an accepted handshake: whatever the transport sets up before
    /// frames flow (local: the sender's ring).
    async fn handshaken(&mut self) -> Result<(), CloseReason> {
        Ok(())
    }
    /// The next event.
    async fn next(&mut self) -> Result<Event, CloseReason>;
    /// Writes a reply (`HelloAck`/`HelloReject`, `Ack`, `Abort`).
    async fn reply(&mut self, f: &Frame) -> Result<(), CloseReason>;
    /// The close reason for a frame a sender never sends after its `Hello`.
    fn unexpected(&self, f: &Frame) -> CloseReason;
}

/// Runs one sender's connection to its end and says why it ended: the
/// handshake, then every layer, `Complete` and `Abort` through the shared
/// [`Receiver`] into the [`BlockSink`]. The one driver of the tcp, quic
/// and local servers.
pub(crate) async fn drive<C: Conn, S: BlockSink>(
    conn: &mut C,
    receiver: &Mutex<Receiver>,
    stats: &watch::Sender<ServerStats>,
    sink: &mut S,
) -> CloseReason {
    let hello = match conn.hello().await {
        Ok(h) => h,
        Err(close) => return close,
    };
    let (reply, refused) = inbound::hello(receiver, &hello);
    if let Err(close) = conn.reply(&reply).await {
        return close;
    }
    if let Some(close) = refused {
        return close;
    }
    if let Err(close) = conn.handshaken().await {
        return close;
    }
    let mut rules = InboundConn::default();
    let mut stats = stats;
    loop {
        let event = match conn.next().await {
            Ok(e) => e,
            Err(close) => return close,
        };
        let reply = match rules.on_event(receiver, sink, &mut stats, event).await {
            Verdict::Closed => return CloseReason::PeerClosed,
            Verdict::Unexpected(other) => return conn.unexpected(&other),
            mut v => v.reply(),
        };
        if let Some(reply) = reply {
            if let Err(close) = conn.reply(&reply).await {
                return close;
            }
        }
    }
}

/// A frame stream (a TCP connection, a QUIC stream) as a [`Conn`].
pub(crate) struct StreamConn<'a, R, W> {
    rd: &'a mut R,
    wr: &'a mut W,
    reader: FrameReader,
    out: Vec<u8>,
    idle: Duration,
    payloads: &'a Buffers,
    /// Where payloads are read straight into, when the stream can (tcp).
    direct: Option<(&'a DirectPool, &'a Mutex<Receiver>)>,
}

impl<R: AsyncRead + DirectRead + Unpin, W: AsyncWrite + Unpin> Conn for StreamConn<'_, R, W> {
    async fn hello(&mut self) -> Result<Hello, CloseReason> {
        match self.reader.next(self.rd, self.idle).await {
            Ok(Some(Frame::Hello(h))) => Ok(h),
            Ok(Some(other)) => Err(CloseReason::NotHello { got: frame_name(&other) }),
            Ok(None) => Err(CloseReason::PeerClosed),
            Err(e) => Err(e.into()),
        }
    }

    async fn next(&mut self) -> Result<Event, CloseReason> {
        let header = match self.reader.next_head(self.rd, self.idle).await? {
            None => return Ok(Event::Closed),
            Some(Head::Layer(header)) => header,
            // Not from FrameReader::next_head (its LayerData come as Layer); checked the slow way all the same.
            Some(Head::Frame(Frame::LayerData(d))) => {
                let (header, crc) = (d.header(), d.payload_checksum());
                return Ok(Event::Layer { header, payload: Box::new(self.payloads.lend(d.payload)), crc });
            }
            Some(Head::Frame(f)) => return Ok(Event::Frame(f)),
        };
        let mut len = header.payload_len;
        if let (Some((pool, receiver)), Some(socket)) = (self.direct, self.rd.socket()) {
            let opened = lock(receiver).begin_direct(&header, Instant::now());
            if let Ok(blocks) = opened {
                let open = OpenDirect { receiver, header: Some(header) };
                let r = Reservation { id: ReservationId(header.reservation), generation: header.generation };
                let layer = header.layer as usize;
                let read = read_into_pool(socket, &mut self.reader, pool, receiver, r, layer, &blocks, len, self.idle);
                match read.await? {
                    InPlace::Landed(crc) => {
                        // Closed by the rules (`on_event`: `end_direct`), with no await between.
                        open.disarm();
                        return Ok(Event::ReadInPlace { header, crc });
                    }
                    // Nothing written: read the ordinary way.
                    InPlace::Outside => {}
                    // Abandoned here (the blocks go back now); the rest is read
                    // the ordinary way, to be refused below.
                    InPlace::Stopped { left } => len = left,
                }
            }
            // Refused: read the ordinary way, to be refused (and counted) by the rules.
        }
        let (payload, crc) = self.reader.read_payload(self.rd, len, self.idle).await?;
        // A stopped read's tail is not the payload: a checksum that cannot match
        // keeps it out of the pool should the reservation (impossibly) receive again.
        let crc = if len == header.payload_len { crc } else { !header.checksum };
        Ok(Event::Layer { header, payload: Box::new(payload), crc })
    }

    async fn reply(&mut self, f: &Frame) -> Result<(), CloseReason> {
        Ok(write_frame(self.wr, &mut self.out, f, self.idle).await?)
    }

    fn unexpected(&self, f: &Frame) -> CloseReason {
        CloseReason::UnexpectedFrame { got: frame_name(f) }
    }
}

/// A direct read the receiver opened (`begin_direct`) and nothing closed
/// yet: abandoned when dropped — the read failed, or the connection's task
/// was aborted mid-read — so its blocks are never held for good.
struct OpenDirect<'a> {
    receiver: &'a Mutex<Receiver>,
    header: Option<LayerDataHeader>,
}

impl OpenDirect<'_> {
    fn disarm(mut self) {
        self.header = None;
    }
}

impl Drop for OpenDirect<'_> {
    fn drop(&mut self) {
        if let Some(h) = self.header.take() {
            lock(self.receiver).abandon_direct(&h);
        }
    }
}

/// Runs one frame stream to its end and says why it ended.
pub(crate) async fn serve<R, W, S>(rd: &mut R, wr: &mut W, shared: &Shared, sink: &mut S) -> CloseReason
where
    R: AsyncRead + DirectRead + Unpin,
    W: AsyncWrite + Unpin,
    S: BlockSink,
{
    let reader = FrameReader::new(shared.limits, shared.payloads.clone());
    let idle = shared.idle_timeout;
    let direct = shared.direct.as_ref().map(|pool| (pool, &*shared.receiver));
    let mut conn = StreamConn { rd, wr, reader, out: Vec::with_capacity(64), idle, payloads: &shared.payloads, direct };
    drive(&mut conn, &shared.receiver, &shared.stats, sink).await
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

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::task::{Context, Poll, Waker};

    use tokio::io::{duplex, split, DuplexStream, ReadHalf, WriteHalf};
    use types::kv::{BlockId, KvDtype, KvLayout};

    use super::*;
    use crate::fingerprint::{LayoutFingerprint, VersionGroup};
    use crate::session::{Peer, ReceiverConfig, ReleaseCause, ReservationState};
    use crate::transport::lock::lock;
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
