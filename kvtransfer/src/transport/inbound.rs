//! The decode side's rules for one sender's connection, whatever carries
//! it: the handshake, each layer's check and hand-off to the sink, a
//! sender's `Complete` and `Abort`, and at most one `Abort` per reservation
//! told to the sender. Every server (tcp and quic through `serve.rs`,
//! local, ucx) turns its primitives into these calls and carries out what
//! they answer (a frame to send, an abort to tell), so a rule about leases,
//! aborts or a sink's failure is written once, here.
//!
//! [`InboundConn::on_event`] is the one step from a transport's event to the
//! rules and back to what the transport carries out ([`Verdict`]): `drive`
//! (`serve.rs`) loops over it for tcp, quic and local, and the ucx server's
//! thread calls it for each sender's message it multiplexes.
//!
//! Time is passed in (`now`) to every rule below `on_event`; `on_event`
//! reads the clock for each event as it comes (a layer's check once the
//! sink had room, a wait of unknown length), so a driver never holds an
//! instant across an await. The receiver is
//! reached through its lock, a measured choice (`lock.rs`); every hold is
//! synchronous and short, and a layer's check and its hand-off to the sink
//! are one hold, so a lease cannot end and its blocks be reused before the
//! write is placed (see [`BlockSink`]).

use std::future::poll_fn;
use std::sync::Mutex;

use tokio::sync::watch;
use tokio::time::Instant;

use super::close::{CloseReason, ServerStats};
use super::lock::lock;
use super::stream::Recent;
use super::{BlockSink, OwnedPayload};
use crate::frame::{Abort, AbortReason, Ack, Complete, Frame, Hello, LayerDataHeader};
use crate::session::{FrameError, Receiver, WriteInstruction};

/// Where a server's counters go: straight into a watch (the async
/// servers), or into a value the server publishes itself (ucx's thread).
pub(crate) trait Tally {
    fn tally(&mut self, f: impl FnOnce(&mut ServerStats));
}

impl Tally for ServerStats {
    fn tally(&mut self, f: impl FnOnce(&mut ServerStats)) {
        f(self)
    }
}

impl Tally for &watch::Sender<ServerStats> {
    fn tally(&mut self, f: impl FnOnce(&mut ServerStats)) {
        self.send_modify(f)
    }
}

/// What a handshaken connection yields to its driver: the events of the
/// driver's vocabulary (docs/ARCHITECTURE.md).
pub(crate) enum Event {
    /// A layer's payload, ours (read, or copied out of shared memory or a
    /// landing range), with the CRC-32C of exactly those bytes.
    Layer { header: LayerDataHeader, payload: OwnedPayload, crc: u32 },
    /// A layer this server read straight into its pool blocks (a direct
    /// read the receiver opened), with the CRC-32C of the bytes as they lie.
    ReadInPlace { header: LayerDataHeader, crc: u32 },
    /// A layer the sender stored into its pool blocks itself and announced
    /// (ucx, direct), with the CRC-32C of the bytes as they lie.
    StoredInPlace { header: LayerDataHeader, crc: u32 },
    /// Any other frame.
    Frame(Frame),
    /// The peer closed between frames: the normal end.
    Closed,
}

/// What the rules made of one event, for the transport to carry out.
#[derive(Debug)]
pub(crate) enum Verdict {
    /// Taken: a layer checked and handed on, or a `Complete` answered with
    /// this `Ack` to send.
    Taken(Option<Frame>),
    /// Refused: the reservation no longer receives through this connection
    /// (nothing more of it is written); the `Abort` to send, unless the
    /// sender was already told.
    Refused(Option<Frame>),
    /// The sender aborted the reservation itself: nothing to send.
    PeerAborted,
    /// The peer closed between frames.
    Closed,
    /// A frame no sender sends after its `Hello`.
    Unexpected(Frame),
}

impl Verdict {
    /// The frame to send back, if any.
    pub(crate) fn reply(&mut self) -> Option<Frame> {
        match self {
            Verdict::Taken(f) | Verdict::Refused(f) => f.take(),
            _ => None,
        }
    }
}

/// The handshake: the reply to send, and the close reason when it was a
/// refusal (send the reply, then close).
pub(crate) fn hello(receiver: &Mutex<Receiver>, h: &Hello) -> (Frame, Option<CloseReason>) {
    match lock(receiver).on_hello(h) {
        Ok(ack) => (Frame::HelloAck(ack), None),
        Err(reject) => (Frame::HelloReject(reject), Some(CloseReason::Rejected(reject.reason))),
    }
}

/// One sender's connection after its handshake.
#[derive(Default)]
pub(crate) struct InboundConn {
    /// Reservations this sender was told to abort (the most recent ones).
    aborted: Recent<(u64, u32)>,
}

impl InboundConn {
    /// One event through the rules. Every layer, `Complete` and `Abort` of
    /// every transport passes here.
    pub(crate) async fn on_event<S: BlockSink>(
        &mut self,
        receiver: &Mutex<Receiver>,
        sink: &mut S,
        stats: &mut impl Tally,
        event: Event,
    ) -> Verdict {
        let judged = |r: Result<Option<Frame>, Option<Abort>>| match r {
            Ok(f) => Verdict::Taken(f),
            Err(a) => Verdict::Refused(a.map(Frame::Abort)),
        };
        match event {
            Event::Closed => Verdict::Closed,
            Event::Layer { header, payload, crc } => {
                judged(self.layer(receiver, sink, stats, &header, payload, crc).await.map(|()| None))
            }
            // Read straight into the blocks here (tcp, opened by `Receiver::begin_direct`):
            // its check closes the direct read.
            Event::ReadInPlace { header, crc } => {
                let verdict = lock(receiver).end_direct(&header, crc, Instant::now());
                if verdict.is_ok() {
                    stats.tally(|s| s.layers_read_in_place += 1);
                }
                judged(self.in_place(verdict, sink, stats, &header).map(|()| None))
            }
            // Stored by the peer (ucx, direct): nothing to write.
            Event::StoredInPlace { header, crc } => {
                let verdict = lock(receiver).on_layer_checked(&header, crc, Instant::now());
                judged(self.in_place(verdict, sink, stats, &header).map(|()| None))
            }
            Event::Frame(Frame::Complete(c)) => {
                judged(self.complete(receiver, stats, &c, Instant::now()).map(|ack| Some(Frame::Ack(ack))))
            }
            Event::Frame(Frame::Abort(a)) => {
                Self::peer_abort(receiver, &a, Instant::now());
                Verdict::PeerAborted
            }
            Event::Frame(other) => Verdict::Unexpected(other),
        }
    }

    /// A layer whose payload (ours: read, copied out of a ring or a landing
    /// region) has CRC-32C `crc`: waits for the sink's room without the
    /// receiver, then checks it and hands an accepted one to the sink in
    /// one hold of the receiver. `Err` when it was refused (or its write
    /// failed), with the `Abort` to tell the sender unless it was told.
    async fn layer<S: BlockSink>(
        &mut self,
        receiver: &Mutex<Receiver>,
        sink: &mut S,
        stats: &mut impl Tally,
        header: &LayerDataHeader,
        payload: OwnedPayload,
        crc: u32,
    ) -> Result<(), Option<Abort>> {
        let len = (*payload).as_ref().len();
        poll_fn(|cx| sink.poll_ready(cx, len)).await;
        let now = Instant::now();
        let mut rx = lock(receiver);
        let reason = match rx.on_layer_checked(header, crc, now) {
            Ok(w) => match sink.write_layer_owned(w, payload) {
                Ok(()) => return Ok(()),
                Err(_) => {
                    // The blocks' content is now unknown: void the reservation
                    // (blocks go to poll_released) and tell the sender to retry
                    // elsewhere.
                    let a = abort_of(header, AbortReason::Corrupt);
                    let _ = rx.on_abort(&a, now);
                    stats.tally(|s| s.sink_failures += 1);
                    AbortReason::Corrupt
                }
            },
            Err(e) => {
                sink.unready();
                e.abort_reason()
            }
        };
        drop(rx);
        Err(self.abort_once(stats, abort_of(header, reason)))
    }

    /// A layer already in its pool blocks, checked (`verdict`): the sink is
    /// told it landed; `Err` as for [`layer`](Self::layer).
    fn in_place<S: BlockSink>(
        &mut self,
        verdict: Result<WriteInstruction, FrameError>,
        sink: &mut S,
        stats: &mut impl Tally,
        header: &LayerDataHeader,
    ) -> Result<(), Option<Abort>> {
        let refusal = match verdict {
            Ok(w) => {
                sink.landed_in_place(&w, header.payload_len);
                return Ok(());
            }
            Err(e) => e.abort_reason(),
        };
        Err(self.abort_once(stats, abort_of(header, refusal)))
    }

    /// The sender's `Complete`: `Ok` the `Ack` to send; `Err(Some)` the
    /// `Abort` to tell it instead.
    fn complete(
        &mut self,
        receiver: &Mutex<Receiver>,
        stats: &mut impl Tally,
        c: &Complete,
        now: Instant,
    ) -> Result<Ack, Option<Abort>> {
        let verdict = lock(receiver).on_complete(c, now);
        verdict.map_err(|e| {
            let a = Abort { reservation: c.reservation, generation: c.generation, reason: e.abort_reason() };
            self.abort_once(stats, a)
        })
    }

    /// The sender's `Abort`: refused only when the reservation already
    /// ended, which leaves nothing to do.
    fn peer_abort(receiver: &Mutex<Receiver>, a: &Abort, now: Instant) {
        let _ = lock(receiver).on_abort(a, now);
    }

    /// `a`, unless this sender was already told to abort that reservation;
    /// counted as sent.
    pub(crate) fn abort_once(&mut self, stats: &mut impl Tally, a: Abort) -> Option<Abort> {
        let key = (a.reservation, a.generation);
        if self.aborted.contains(&key) {
            return None;
        }
        self.aborted.push(key);
        stats.tally(|s| s.aborts_sent += 1);
        Some(a)
    }
}

fn abort_of(h: &LayerDataHeader, reason: AbortReason) -> Abort {
    Abort { reservation: h.reservation, generation: h.generation, reason }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use types::kv::{BlockId, KvDtype, KvLayout};

    use super::*;
    use crate::checksum::crc32c_append;
    use crate::fingerprint::{LayoutFingerprint, VersionGroup};
    use crate::session::{Peer, ReceiverConfig, Reservation, ReservationState};
    use crate::transport::FnSink;

    const LAYOUT: KvLayout = KvLayout { n_layers: 1, n_kv_heads: 1, head_dim: 8, block_size: 4, dtype: KvDtype::F16 };
    /// One layer of two blocks: K then V, each 2 × 64 bytes.
    const PAYLOAD: usize = 2 * 2 * 4 * 8 * 2;

    fn peer() -> Peer {
        Peer {
            version_group: VersionGroup::new("g1").expect("label"),
            fingerprint: LayoutFingerprint::new(&LAYOUT, &[1; 32], &[2; 32]),
        }
    }

    fn receiver() -> Mutex<Receiver> {
        Mutex::new(Receiver::new(peer(), ReceiverConfig::new(LAYOUT)).expect("config"))
    }

    fn layer(r: Reservation, payload: &[u8]) -> (LayerDataHeader, u32) {
        let crc = crc32c_append(0, payload);
        let h = LayerDataHeader {
            reservation: r.id.0,
            generation: r.generation,
            layer: 0,
            first_block: 0,
            n_blocks: 2,
            checksum: crc,
            payload_len: payload.len(),
        };
        (h, crc)
    }

    /// Each event of the vocabulary gets its verdict from the one step: a
    /// layer and its `Complete` taken (the `Ack` to send), a corrupt layer
    /// refused with one `Abort` and then without one, the sender's abort, the
    /// peer's close and a frame no sender sends.
    #[tokio::test]
    async fn every_event_gets_its_verdict_from_the_one_step() {
        let rx = receiver();
        let written = std::sync::atomic::AtomicUsize::new(0);
        let mut sink = FnSink(|_: usize, _: &[BlockId], _: &[u8], _: &[u8]| {
            written.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok(())
        });
        let mut stats = ServerStats::default();
        let mut conn = InboundConn::default();
        let now = Instant::now();
        let ttl = Duration::from_secs(60);

        let good = lock(&rx).reserve(vec![1, 2], ttl, now).expect("reserve");
        let payload = vec![7u8; PAYLOAD];
        let (h, crc) = layer(good, &payload);
        let v = conn.on_event(&rx, &mut sink, &mut stats, Event::Layer { header: h, payload: Box::new(payload), crc });
        assert!(matches!(v.await, Verdict::Taken(None)));
        let c = Complete { reservation: good.id.0, generation: good.generation, n_layers: 1 };
        match conn.on_event(&rx, &mut sink, &mut stats, Event::Frame(Frame::Complete(c))).await {
            Verdict::Taken(Some(Frame::Ack(a))) => {
                assert_eq!((a.reservation, a.generation), (good.id.0, good.generation))
            }
            other => panic!("complete: {other:?}"),
        }
        assert_eq!(lock(&rx).state(good), Some(ReservationState::Ready));

        let bad = lock(&rx).reserve(vec![3, 4], ttl, now).expect("reserve");
        for told in [true, false] {
            let payload = vec![9u8; PAYLOAD];
            let (h, crc) = layer(bad, &payload);
            let event = Event::Layer { header: h, payload: Box::new(payload), crc: !crc };
            match conn.on_event(&rx, &mut sink, &mut stats, event).await {
                Verdict::Refused(Some(Frame::Abort(a))) if told => assert_eq!(a.reason, AbortReason::Corrupt),
                Verdict::Refused(None) if !told => {}
                other => panic!("corrupt layer (abort told now: {told}): {other:?}"),
            }
        }
        assert_eq!(stats.aborts_sent, 1, "one abort per reservation");

        // In place: stored by the sender into exposed blocks (ucx), read in by a direct
        // read this server opened (tcp); the sink writes nothing for either.
        let stored = lock(&rx).reserve(vec![7, 8], ttl, now).expect("reserve");
        assert!(lock(&rx).expose(stored).is_some());
        let (h, crc) = layer(stored, &[5u8; PAYLOAD]);
        assert!(matches!(
            conn.on_event(&rx, &mut sink, &mut stats, Event::StoredInPlace { header: h, crc }).await,
            Verdict::Taken(None)
        ));
        let read = lock(&rx).reserve(vec![9, 10], ttl, now).expect("reserve");
        let (h, crc) = layer(read, &[6u8; PAYLOAD]);
        lock(&rx).begin_direct(&h, now).expect("a direct read opens");
        assert!(matches!(
            conn.on_event(&rx, &mut sink, &mut stats, Event::ReadInPlace { header: h, crc }).await,
            Verdict::Taken(None)
        ));
        assert_eq!(stats.layers_read_in_place, 1, "only the read in place is counted as one");
        assert_eq!(lock(&rx).counters().layer_frames_accepted, 3, "good, stored and read in place");

        let third = lock(&rx).reserve(vec![5, 6], ttl, now).expect("reserve");
        let a = Abort { reservation: third.id.0, generation: third.generation, reason: AbortReason::Cancelled };
        assert!(matches!(
            conn.on_event(&rx, &mut sink, &mut stats, Event::Frame(Frame::Abort(a))).await,
            Verdict::PeerAborted
        ));
        assert_eq!(lock(&rx).state(third), Some(ReservationState::Aborted));
        assert!(matches!(conn.on_event(&rx, &mut sink, &mut stats, Event::Closed).await, Verdict::Closed));
        let hello = crate::transport::outbound::hello(&peer());
        assert!(matches!(
            conn.on_event(&rx, &mut sink, &mut stats, Event::Frame(Frame::Hello(hello))).await,
            Verdict::Unexpected(Frame::Hello(_))
        ));
        assert_eq!(written.into_inner(), 1, "only the good layer reached the sink");
    }
}
