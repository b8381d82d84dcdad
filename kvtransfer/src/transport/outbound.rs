//! The sender's rules for one connection, whatever carries it (the
//! streams' `send.rs`, local's and ucx's senders): the `Hello` it presents,
//! how it reads the receiver's answer to it, and what it remembers of the
//! receiver's `Ack`s and `Abort`s so a later call for a reservation learns
//! how that reservation ended. The mirror of `inbound.rs`; nothing here
//! does I/O or reads a clock.

use super::stream::{frame_name, Recent};
use super::TransferError;
use crate::frame::{Abort, AbortReason, Ack, Complete, Frame, Hello, HelloAck, HelloReject};
use crate::session::{Peer, Reservation};
use types::kv::KvLayout;

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

/// What one connection's sender heard from the receiver after the
/// handshake: the latest `Ack`s and `Abort`s, before the caller asked.
#[derive(Debug, Default)]
pub(crate) struct Outbound {
    aborts: Recent<Abort>,
    acks: Recent<Ack>,
}

impl Outbound {
    /// Takes in a frame from the receiver. A receiver sends only `Ack` and
    /// `Abort` after the handshake: anything else is a protocol error.
    pub(crate) fn on_frame(&mut self, f: Frame) -> Result<(), TransferError> {
        match f {
            Frame::Abort(a) => self.aborts.push(a),
            Frame::Ack(a) => self.acks.push(a),
            other => {
                return Err(TransferError::Protocol(format!("unexpected {} from the receiver", frame_name(&other))))
            }
        }
        Ok(())
    }

    /// The receiver aborted `r`: its reason.
    pub(crate) fn aborted(&self, r: Reservation) -> Option<AbortReason> {
        self.aborts.0.iter().find(|a| a.reservation == r.id.0 && a.generation == r.generation).map(|a| a.reason)
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
        let want = Ack { reservation: r.id.0, generation: r.generation };
        self.acks.contains(&want).then_some(want)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::RejectReason;
    use crate::session::ReservationId;

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
}
