//! The decode side's rules for one sender's connection, whatever carries
//! it: the handshake, each layer's check and hand-off to the sink, a
//! sender's `Complete` and `Abort`, and at most one `Abort` per reservation
//! told to the sender. Every server (tcp and quic through `serve.rs`,
//! local, ucx) turns its primitives into these calls and carries out what
//! they answer (a frame to send, an abort to tell), so a rule about leases,
//! aborts or a sink's failure is written once, here.
//!
//! Time is passed in (`now`): nothing here reads a clock. The receiver is
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
    /// A layer whose payload (ours: read, copied out of a ring or a landing
    /// region) has CRC-32C `crc`: waits for the sink's room without the
    /// receiver, then checks it and hands an accepted one to the sink in
    /// one hold of the receiver. `Err` when it was refused (or its write
    /// failed), with the `Abort` to tell the sender unless it was told.
    pub(crate) async fn layer<S: BlockSink>(
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

    /// A layer a peer stored straight into the reservation's pool blocks
    /// (ucx, direct), checksummed there as `crc`: nothing to write. `Err`
    /// as for [`layer`](Self::layer).
    pub(crate) fn landed_in_place<S: BlockSink>(
        &mut self,
        receiver: &Mutex<Receiver>,
        sink: &mut S,
        stats: &mut impl Tally,
        header: &LayerDataHeader,
        crc: u32,
        now: Instant,
    ) -> Result<(), Option<Abort>> {
        let verdict = lock(receiver).on_layer_checked(header, crc, now);
        self.in_place(verdict, sink, stats, header)
    }

    /// A layer this server read straight into the reservation's pool blocks
    /// (tcp, direct: opened by `Receiver::begin_direct`), checksummed there
    /// as `crc`: closes the direct read. `Err` as for [`layer`](Self::layer).
    pub(crate) fn read_in_place<S: BlockSink>(
        &mut self,
        receiver: &Mutex<Receiver>,
        sink: &mut S,
        stats: &mut impl Tally,
        header: &LayerDataHeader,
        crc: u32,
        now: Instant,
    ) -> Result<(), Option<Abort>> {
        let verdict = lock(receiver).end_direct(header, crc, now);
        if verdict.is_ok() {
            stats.tally(|s| s.layers_read_in_place += 1);
        }
        self.in_place(verdict, sink, stats, header)
    }

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
    pub(crate) fn complete(
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
    pub(crate) fn peer_abort(receiver: &Mutex<Receiver>, a: &Abort, now: Instant) {
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
