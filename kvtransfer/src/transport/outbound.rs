//! The sender's rules for one connection, whatever carries it (the
//! streams' `send.rs`, local's and ucx's senders): the `Hello` it presents,
//! how it reads the receiver's answer to it, and the machine ([`Outbound`])
//! that says, reservation by reservation, what may go out and how each
//! ended. The mirror of `inbound.rs`; nothing here does I/O or reads a
//! clock.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;
use types::kv::KvLayout;

use super::stream::frame_name;
use super::TransferError;
use crate::frame::{Abort, AbortReason, Ack, Complete, Frame, Hello, HelloAck, HelloReject};
use crate::session::{Peer, Reservation, ReservationId};

/// The `Hello` a sender of `local` presents.
pub(crate) fn hello(local: &Peer) -> Hello {
    Hello {
        version_group: local.version_group.clone(),
        fingerprint: local.fingerprint,
        protocol_version: crate::PROTOCOL_VERSION,
    }
}

/// The receiver's answer to our `Hello`: `Ok` for an ack of our protocol
/// version; a refusal with its reason; any other ack or frame a protocol
/// error.
pub(crate) fn hello_answer(answer: Result<HelloAck, HelloReject>) -> Result<(), TransferError> {
    match answer {
        Ok(a) if a.protocol_version == crate::PROTOCOL_VERSION => Ok(()),
        Ok(a) => Err(TransferError::Protocol(format!("HelloAck for protocol version {}", a.protocol_version))),
        Err(r) => Err(TransferError::Rejected { reason: r.reason }),
    }
}

/// [`hello_answer`] of a frame: anything but `HelloAck`/`HelloReject` is a
/// protocol error.
pub(crate) fn hello_answer_frame(f: Frame) -> Result<(), TransferError> {
    match f {
        Frame::HelloAck(a) => hello_answer(Ok(a)),
        Frame::HelloReject(r) => hello_answer(Err(r)),
        other => Err(TransferError::Protocol(format!("{} instead of HelloAck", frame_name(&other)))),
    }
}

/// `Complete` for `r`, whose KV has `layout`.
pub(crate) fn complete(r: Reservation, layout: &KvLayout) -> Frame {
    Frame::Complete(Complete { reservation: r.id.0, generation: r.generation, n_layers: layout.n_layers as u32 })
}

/// `Abort` of `r`, for `reason`.
pub(crate) fn abort(r: Reservation, reason: AbortReason) -> Frame {
    Frame::Abort(Abort { reservation: r.id.0, generation: r.generation, reason })
}

/// How far one reservation got on this connection, as its sender knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Standing {
    /// Layers may go out.
    Sending,
    /// `Complete` went out; its answer is awaited until `deadline`, which
    /// is `wait` after it was sent.
    Completing { deadline: Instant, wait: Duration },
    /// The receiver acknowledged it: the blocks are the decode side's.
    Acked,
    /// The receiver aborted it, for this reason.
    AbortedByReceiver(AbortReason),
    /// We aborted it.
    AbortedBySender,
}

/// The sender's machine for one connection: where each reservation it
/// spoke of stands, moved only by what the caller does (a layer, `Complete`,
/// `Abort`) and what the receiver answers (`Ack`, `Abort`), with time
/// passed in. It says whether a layer or `Complete` may go out, which
/// frame to send, and how a `Complete` ended — the receiver's `Ack`, its
/// `Abort`, or the deadline — so every sender (the streams', local's,
/// ucx's) keeps one set of rules:
/// - nothing of a reservation goes out after its `Complete` or our `Abort`
///   ([`TransferError::Ended`], and no bytes written);
/// - once the receiver aborted it, every later call for it says so
///   ([`TransferError::PeerAbort`]), however long ago that was;
/// - an `Ack` answers only a `Complete`, an `Abort` never follows an
///   `Ack`: a receiver that does either breaks the protocol;
/// - an `Abort` goes out at most once per reservation, and not for one the
///   receiver acknowledged or aborted itself.
///
/// A reservation it never heard of is one about to start; at most
/// [`REMEMBERED`] are kept, the oldest forgotten first (a connection
/// carries a few at a time).
#[derive(Debug, Default)]
pub(crate) struct Outbound {
    known: VecDeque<(Reservation, Standing)>,
}

/// Reservations an [`Outbound`] remembers.
pub(crate) const REMEMBERED: usize = 64;

impl Outbound {
    fn standing(&self, r: Reservation) -> Option<Standing> {
        self.known.iter().rev().find(|(k, _)| *k == r).map(|&(_, s)| s)
    }

    fn set(&mut self, r: Reservation, s: Standing) {
        if let Some(at) = self.known.iter().position(|(k, _)| *k == r) {
            self.known.remove(at);
        } else if self.known.len() == REMEMBERED {
            self.known.pop_front();
        }
        self.known.push_back((r, s));
    }

    /// Takes in a frame from the receiver. A receiver sends only `Ack` and
    /// `Abort` after the handshake: anything else is a protocol error, as
    /// is an `Ack` of a reservation we did not complete or an `Abort`
    /// after an `Ack`.
    pub(crate) fn on_frame(&mut self, f: Frame) -> Result<(), TransferError> {
        match f {
            Frame::Abort(a) => {
                let r = reservation(a.reservation, a.generation);
                match self.standing(r) {
                    Some(Standing::Acked) => {
                        return Err(TransferError::Protocol(format!(
                            "Abort of reservation {} (generation {}) after its Ack",
                            a.reservation, a.generation
                        )))
                    }
                    Some(Standing::AbortedByReceiver(_)) => {}
                    _ => self.set(r, Standing::AbortedByReceiver(a.reason)),
                }
            }
            Frame::Ack(a) => {
                let r = reservation(a.reservation, a.generation);
                match self.standing(r) {
                    // None: one we forgot long ago; only a Complete could have asked.
                    None | Some(Standing::Completing { .. } | Standing::Acked) => self.set(r, Standing::Acked),
                    Some(other) => {
                        return Err(TransferError::Protocol(format!(
                            "Ack of reservation {} (generation {}), which stood {}",
                            a.reservation,
                            a.generation,
                            name(other)
                        )))
                    }
                }
            }
            other => {
                return Err(TransferError::Protocol(format!("unexpected {} from the receiver", frame_name(&other))))
            }
        }
        Ok(())
    }

    /// May a layer (or a piece of one) of `r` go out now? `Err` with the
    /// receiver's reason if it aborted `r`, or [`TransferError::Ended`]
    /// after our `Complete` or `Abort`.
    pub(crate) fn layer(&mut self, r: Reservation) -> Result<(), TransferError> {
        let standing = self.standing(r);
        if let Some(e) = refusal(r, standing) {
            return Err(e);
        }
        if standing.is_none() {
            self.set(r, Standing::Sending);
        }
        Ok(())
    }

    /// `Complete` for `r`, whose KV has `layout`, sent now: its answer is
    /// awaited `wait` (until `now + wait`). Refused as [`layer`](Self::layer)
    /// is.
    pub(crate) fn complete(
        &mut self,
        r: Reservation,
        layout: &KvLayout,
        now: Instant,
        wait: Duration,
    ) -> Result<Frame, TransferError> {
        if let Some(e) = refusal(r, self.standing(r)) {
            return Err(e);
        }
        self.set(r, Standing::Completing { deadline: now + wait, wait });
        Ok(complete(r, layout))
    }

    /// The `Abort` of `r` for `reason` to send, if one should go out: not
    /// for one the receiver acknowledged or aborted, nor twice.
    pub(crate) fn abort(&mut self, r: Reservation, reason: AbortReason) -> Option<Frame> {
        match self.standing(r) {
            Some(Standing::Acked | Standing::AbortedByReceiver(_) | Standing::AbortedBySender) => None,
            None | Some(Standing::Sending | Standing::Completing { .. }) => {
                self.set(r, Standing::AbortedBySender);
                Some(abort(r, reason))
            }
        }
    }

    /// How `r`'s `Complete` ended by `now`: its `Ack`, the receiver's
    /// `Abort`, or [`TransferError::Timeout`] once its deadline passed;
    /// `None` while it is still awaited. A reservation the receiver aborted
    /// answers so whether or not it was completed.
    pub(crate) fn answer(&self, r: Reservation, now: Instant) -> Option<Result<Ack, TransferError>> {
        match self.standing(r)? {
            Standing::Acked => Some(Ok(Ack { reservation: r.id.0, generation: r.generation })),
            Standing::AbortedByReceiver(reason) => Some(Err(TransferError::PeerAbort { reason })),
            Standing::Completing { deadline, wait } if now >= deadline => {
                Some(Err(TransferError::Timeout { what: "Ack", after: wait }))
            }
            Standing::Completing { .. } | Standing::Sending | Standing::AbortedBySender => None,
        }
    }

    /// When `r`'s `Complete` stops being awaited, while it is.
    pub(crate) fn deadline(&self, r: Reservation) -> Option<Instant> {
        match self.standing(r)? {
            Standing::Completing { deadline, .. } => Some(deadline),
            _ => None,
        }
    }

    /// The receiver aborted `r`: its reason.
    pub(crate) fn aborted(&self, r: Reservation) -> Option<AbortReason> {
        match self.standing(r)? {
            Standing::AbortedByReceiver(reason) => Some(reason),
            _ => None,
        }
    }

    /// `Err` with the receiver's reason if it aborted `r`.
    pub(crate) fn check_aborted(&self, r: Reservation) -> Result<(), TransferError> {
        match self.aborted(r) {
            Some(reason) => Err(TransferError::PeerAbort { reason }),
            None => Ok(()),
        }
    }

    /// The receiver acknowledged `r`: its `Ack`.
    pub(crate) fn acked(&self, r: Reservation) -> Option<Ack> {
        (self.standing(r)? == Standing::Acked).then_some(Ack { reservation: r.id.0, generation: r.generation })
    }
}

fn reservation(id: u64, generation: u32) -> Reservation {
    Reservation { id: ReservationId(id), generation }
}

fn name(s: Standing) -> &'static str {
    match s {
        Standing::Sending => "sending",
        Standing::Completing { .. } => "completing",
        Standing::Acked => "acknowledged",
        Standing::AbortedByReceiver(_) => "aborted by the receiver",
        Standing::AbortedBySender => "aborted by the sender",
    }
}

/// Why nothing more of `r` may go out, standing `s`; `None` while it may
/// (a reservation not heard of yet, or one still sending): the one rule
/// behind [`Outbound::layer`] and [`Outbound::complete`].
fn refusal(r: Reservation, s: Option<Standing>) -> Option<TransferError> {
    let ended = |how| TransferError::Ended { reservation: r.id.0, generation: r.generation, how };
    match s? {
        Standing::Sending => None,
        Standing::AbortedByReceiver(reason) => Some(TransferError::PeerAbort { reason }),
        Standing::Completing { .. } | Standing::Acked => Some(ended("completed")),
        Standing::AbortedBySender => Some(ended("aborted")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::RejectReason;
    use crate::testutil::Rng;

    fn r(id: u64, generation: u32) -> Reservation {
        Reservation { id: ReservationId(id), generation }
    }

    /// Acks and aborts are told apart by reservation *and* generation; a
    /// frame a receiver never sends after the handshake is an error.
    #[test]
    fn acks_and_aborts_are_remembered_by_reservation_and_generation() {
        let mut o = Outbound::default();
        o.on_frame(abort(r(1, 1), AbortReason::LeaseExpired)).expect("abort");
        o.on_frame(Frame::Ack(Ack { reservation: 2, generation: 7 })).expect("ack");
        assert!(matches!(
            o.check_aborted(r(1, 1)),
            Err(TransferError::PeerAbort { reason: AbortReason::LeaseExpired })
        ));
        assert!(o.check_aborted(r(1, 2)).is_ok(), "another generation of the same slot");
        assert_eq!(o.acked(r(2, 7)), Some(Ack { reservation: 2, generation: 7 }));
        assert_eq!(o.acked(r(2, 8)), None);
        let layout =
            KvLayout { n_layers: 3, n_kv_heads: 1, head_dim: 8, block_size: 4, dtype: types::kv::KvDtype::F16 };
        assert!(matches!(o.on_frame(complete(r(3, 1), &layout)), Err(TransferError::Protocol(_))));
    }

    #[test]
    fn the_hello_answer_is_read_the_same_everywhere() {
        let ack = |v| HelloAck { protocol_version: v };
        assert!(hello_answer(Ok(ack(crate::PROTOCOL_VERSION))).is_ok());
        assert!(matches!(hello_answer(Ok(ack(crate::PROTOCOL_VERSION + 1))), Err(TransferError::Protocol(_))));
        let reject = HelloReject { reason: RejectReason::Fingerprint };
        assert!(matches!(
            hello_answer_frame(Frame::HelloReject(reject)),
            Err(TransferError::Rejected { reason: RejectReason::Fingerprint })
        ));
        assert!(matches!(
            hello_answer_frame(Frame::Ack(Ack { reservation: 1, generation: 1 })),
            Err(TransferError::Protocol(_))
        ));
    }

    /// What a test saw of one reservation, in the order it happened.
    #[derive(Default, Clone)]
    struct Seen {
        completed: Option<Instant>,
        we_aborted: bool,
        acked: bool,
        receiver_aborted: Option<AbortReason>,
        sent_layer: bool,
    }

    impl Seen {
        /// Nothing more may go out: what `layer` and `complete` must say.
        fn refused(&self) -> Option<&'static str> {
            if self.receiver_aborted.is_some() {
                Some("peer_abort")
            } else if self.completed.is_some() || self.we_aborted || self.acked {
                Some("ended")
            } else {
                None
            }
        }
    }

    /// Which refusal an error is, for comparing with [`Seen::refused`].
    fn what(e: &TransferError) -> &'static str {
        match e {
            TransferError::PeerAbort { .. } => "peer_abort",
            TransferError::Ended { .. } => "ended",
            _ => "another error",
        }
    }

    /// Random interleavings of what a caller does (layers, `Complete`,
    /// `Abort`) and what a receiver answers (`Ack`, `Abort`, some of them
    /// out of turn), over three reservations — two generations of one slot
    /// among them — with time moving: the machine's every answer agrees
    /// with the history, and the rules in its doc hold.
    #[test]
    fn the_sender_machine_keeps_its_rules_under_any_interleaving() {
        let layout =
            KvLayout { n_layers: 2, n_kv_heads: 1, head_dim: 8, block_size: 4, dtype: types::kv::KvDtype::F16 };
        let wait = Duration::from_millis(50);
        let rs = [r(1, 1), r(1, 2), r(2, 1)];
        for seed in 0..500 {
            let mut rng = Rng::new(seed);
            let mut o = Outbound::default();
            let mut seen: [Seen; 3] = Default::default();
            let mut now = Instant::now();
            for step in 0..40 {
                let i = rng.below(3);
                let (res, s) = (rs[i], &mut seen[i]);
                let at = format!("seed {seed} step {step} reservation {res:?}");
                match rng.below(8) {
                    0 | 1 => {
                        let got = o.layer(res);
                        assert_eq!(got.as_ref().err().map(what), s.refused(), "layer, {at}");
                        s.sent_layer |= got.is_ok();
                    }
                    2 => {
                        let got = o.complete(res, &layout, now, wait);
                        assert_eq!(got.as_ref().err().map(what), s.refused(), "complete, {at}");
                        if let Ok(f) = got {
                            assert_eq!(f, complete(res, &layout));
                            s.completed = Some(now + wait);
                        }
                    }
                    3 => {
                        let got = o.abort(res, AbortReason::Cancelled);
                        let expect = !(s.we_aborted || s.acked || s.receiver_aborted.is_some());
                        assert_eq!(got.is_some(), expect, "abort, {at}");
                        if let Some(f) = got {
                            assert_eq!(f, abort(res, AbortReason::Cancelled));
                            s.we_aborted = true;
                        }
                    }
                    4 => {
                        let got = o.on_frame(Frame::Ack(Ack { reservation: res.id.0, generation: res.generation }));
                        // An Ack answers a Complete (or one we never spoke of);
                        // after a layer with no Complete, or any abort, it is
                        // out of turn.
                        let fine = s.acked
                            || (s.completed.is_some() && !s.we_aborted && s.receiver_aborted.is_none())
                            || !(s.sent_layer || s.we_aborted || s.receiver_aborted.is_some());
                        assert_eq!(got.is_ok(), fine, "ack, {at}");
                        s.acked |= got.is_ok();
                    }
                    5 => {
                        let reason = AbortReason::ALL[rng.below(AbortReason::ALL.len())];
                        let got = o.on_frame(abort(res, reason));
                        assert_eq!(got.is_ok(), !s.acked, "receiver abort after an ack, {at}");
                        if got.is_ok() && s.receiver_aborted.is_none() {
                            s.receiver_aborted = Some(reason);
                        }
                    }
                    _ => now += Duration::from_millis(rng.below(40) as u64),
                }
                // How each reservation's Complete ended, as the machine says it now.
                for (j, s) in seen.iter().enumerate() {
                    let got = o.answer(rs[j], now);
                    let at = format!("answer, seed {seed} step {step} reservation {:?}", rs[j]);
                    match (s.acked, s.receiver_aborted, s.completed) {
                        (true, _, _) => assert!(matches!(got, Some(Ok(a)) if a.generation == rs[j].generation), "{at}"),
                        (false, Some(reason), _) => {
                            assert!(
                                matches!(got, Some(Err(TransferError::PeerAbort { reason: r })) if r == reason),
                                "{at}"
                            )
                        }
                        (false, None, Some(deadline)) if !s.we_aborted => {
                            if now >= deadline {
                                assert!(
                                    matches!(got, Some(Err(TransferError::Timeout { after, .. })) if after == wait),
                                    "{at}"
                                );
                            } else {
                                assert!(got.is_none(), "{at}");
                                assert_eq!(o.deadline(rs[j]), Some(deadline), "{at}");
                            }
                        }
                        _ => assert!(got.is_none(), "{at}"),
                    }
                }
            }
        }
    }

    /// However many reservations pass through a connection, the machine
    /// keeps at most `REMEMBERED`; the newest are the ones it knows.
    #[test]
    fn the_sender_machine_remembers_a_bounded_number_of_reservations() {
        let mut o = Outbound::default();
        for id in 0..10 * REMEMBERED as u64 {
            o.layer(r(id, 1)).expect("a fresh reservation");
            assert!(o.abort(r(id, 1), AbortReason::Cancelled).is_some());
        }
        assert_eq!(o.known.len(), REMEMBERED);
        let newest = r(10 * REMEMBERED as u64 - 1, 1);
        assert!(matches!(o.layer(newest), Err(TransferError::Ended { how: "aborted", .. })));
    }
}
