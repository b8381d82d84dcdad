//! One close reason and one stats type for every KV server (tcp, quic,
//! local, ucx): a rule about how a connection ends is named once, and the
//! decode worker exports each transport's counters the same way.
//!
//! The labels are the metric's (`tandem_kv_connections_closed_total{reason}`)
//! and stay as they were when each transport had its own type; a transport
//! exports only the labels it can produce ([`CloseReason::labels`]).

use std::io;
use std::time::Duration;

use super::any::TransportKind;
use super::local::{RingRefusal, WireError};
use super::ucx::LandingRefusal;
use crate::frame::{DecodeError, RejectReason};

/// Why a server closed (or saw the end of) a sender's connection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CloseReason {
    /// The peer closed between frames: the normal end of a stream.
    #[error("peer closed the connection")]
    PeerClosed,
    /// The peer closed in the middle of a frame (or local message).
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
    /// Bytes that are not a local message (local); as [`Decode`](Self::Decode).
    #[error("undecodable bytes: {0}")]
    DecodeMessage(WireError),
    /// The first frame was not `Hello`.
    #[error("first frame was {got}, not Hello")]
    NotHello { got: &'static str },
    /// The handshake was refused (after telling the peer).
    #[error("handshake rejected: {}", .0.as_str())]
    Rejected(RejectReason),
    /// A frame a sender never sends (`HelloAck`, `Ack`, a second `Hello`, …)
    /// on a frame stream (tcp, quic).
    #[error("unexpected {got} from a sender")]
    UnexpectedFrame { got: &'static str },
    /// The TLS handshake failed: the peer's certificate was refused, or it
    /// refused ours (quic).
    #[error("TLS handshake failed: {0}")]
    Tls(String),
    /// The sender's ring was refused, after telling the peer (local).
    #[error("ring refused: {0}")]
    RingRefused(RingRefusal),
    /// A `Data` message named a slot or length outside the ring (local).
    #[error("Data for slot {slot} with {len} bytes is outside the ring")]
    BadSlot { slot: u32, len: usize },
    /// A message a sender never sends (`HelloAck`, `Credit`, a second
    /// `Hello`, an inline `LayerData`, …) on the local transport.
    #[error("unexpected {got} from a sender")]
    UnexpectedMessage { got: &'static str },
    /// The peer runs as another user and `same_uid_only` is set (local).
    #[error("peer runs as uid {uid}")]
    PeerUid { uid: u32 },
    /// The sender said `Bye` after flushing: the normal end (ucx).
    #[error("the sender said Bye")]
    Bye,
    /// UCX reported the endpoint to the sender failed: the process died or
    /// became unreachable (ucx).
    #[error("the sender's endpoint failed")]
    PeerFailed,
    /// `max_connections` senders were being served (ucx; the streams count
    /// these in [`ServerStats::connections_refused_busy`], as they never
    /// start).
    #[error("too many senders")]
    Busy,
}

impl CloseReason {
    /// Every [`as_str`](Self::as_str) label, in [`ServerStats::closed`] order.
    pub const LABELS: [&'static str; 16] = [
        "peer_closed",
        "truncated",
        "io",
        "idle",
        "decode",
        "not_hello",
        "rejected",
        "unexpected_frame",
        "tls",
        "ring_refused",
        "bad_slot",
        "unexpected_message",
        "peer_uid",
        "bye",
        "peer_failed",
        "busy",
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
            Self::Decode(_) | Self::DecodeMessage(_) => 4,
            Self::NotHello { .. } => 5,
            Self::Rejected(_) => 6,
            Self::UnexpectedFrame { .. } => 7,
            Self::Tls(_) => 8,
            Self::RingRefused(_) => 9,
            Self::BadSlot { .. } => 10,
            Self::UnexpectedMessage { .. } => 11,
            Self::PeerUid { .. } => 12,
            Self::Bye => 13,
            Self::PeerFailed => 14,
            Self::Busy => 15,
        }
    }

    /// The labels a server of `kind` can produce, which the decode worker
    /// exports (each transport's series as before one type served them all).
    pub fn labels(kind: TransportKind) -> impl Iterator<Item = &'static str> {
        let at: &'static [usize] = match kind {
            TransportKind::Tcp | TransportKind::Quic => &[0, 1, 2, 3, 4, 5, 6, 7, 8],
            TransportKind::Local => &[0, 1, 2, 3, 4, 5, 6, 9, 10, 11, 12],
            TransportKind::Ucx => &[13, 14, 6, 15],
        };
        at.iter().map(|i| Self::LABELS[*i])
    }

    /// The normal end of a connection: the sender finished and left.
    pub fn is_normal(&self) -> bool {
        matches!(self, Self::PeerClosed | Self::Bye)
    }
}

impl From<WireError> for CloseReason {
    fn from(e: WireError) -> Self {
        match e {
            WireError::Frame(e) => Self::Decode(e),
            other => Self::DecodeMessage(other),
        }
    }
}

/// What a KV server has done, for metrics and tests; the same type for
/// every transport (fields a transport has no use for stay zero).
/// Frame-level counts live in [`Receiver::counters`](crate::Receiver::counters).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServerStats {
    /// Connections that arrived and were served at least as far as their
    /// handshake (ucx: every `Hello` from a reachable sender), refused ones
    /// included: on every transport `connections_accepted −
    /// connections_closed()` is what is open. A stream refused on accept for
    /// `max_connections` is not in it but in `connections_refused_busy`; ucx
    /// has no accept, so its busy refusals are accepted and closed
    /// [`CloseReason::Busy`].
    pub connections_accepted: u64,
    /// Streams closed on accept because `max_connections` were being served.
    pub connections_refused_busy: u64,
    /// Ended connections (QUIC: frame streams) by [`CloseReason`], in
    /// [`CloseReason::LABELS`] order.
    pub closed: [u64; CloseReason::LABELS.len()],
    /// `Abort`s told to senders (refused frames, at most one per reservation
    /// and connection), counted as decided: a write of one that fails ends
    /// the connection, which the close reason shows.
    pub aborts_sent: u64,
    /// Accepted frames the [`BlockSink`](super::BlockSink) failed to store.
    pub sink_failures: u64,
    /// Rings accepted and mapped (local).
    pub rings_mapped: u64,
    /// Layer frames read from the socket straight into their pool blocks
    /// and accepted (tcp with a direct pool); the rest went through the sink.
    pub layers_read_in_place: u64,
    /// The landing region, direct puts and fences (ucx).
    pub ucx: UcxStats,
}

/// The UCX server's own counters, in [`ServerStats::ucx`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UcxStats {
    /// Landing ranges granted.
    pub grants: u64,
    /// Claims refused, by [`LandingRefusal`], in [`LandingRefusal::ALL`] order.
    pub refused: [u64; LandingRefusal::ALL.len()],
    /// Messages that did not decode, named an unknown connection, or are
    /// not for a server.
    pub bad_messages: u64,
    pub landing_bytes: u64,
    /// Granted or quarantined.
    pub landing_in_use_bytes: u64,
    /// Ranges of reservations that ended while their sender may still write:
    /// not reusable until the sender is fenced.
    pub quarantined_bytes: u64,
    pub quarantined_ranges: u64,
    /// Quarantined ranges freed because their sender was fenced.
    pub fences_completed: u64,
    /// Reservations granted pool blocks to write directly.
    pub direct_grants: u64,
    /// Layers written directly into the pool and accepted.
    pub direct_layers: u64,
    /// Pool blocks of ended reservations whose direct writer is not fenced yet.
    pub quarantined_blocks: u64,
    /// Live transfers holding a landing range or pool blocks now.
    pub granted_transfers: u64,
}

impl UcxStats {
    pub fn refused_by(&self, refusal: LandingRefusal) -> u64 {
        LandingRefusal::ALL.iter().position(|r| *r == refusal).map_or(0, |i| self.refused[i])
    }
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

    /// Counts one ended connection.
    pub(crate) fn close(&mut self, reason: &CloseReason) {
        self.closed[reason.index()] += 1;
    }

    /// `(label, count)` for each label a server of `kind` can produce.
    pub fn closed_for(&self, kind: TransportKind) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        CloseReason::labels(kind).map(|l| (l, self.closed_by(l)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each transport exports exactly the labels it had when it had its own
    /// close-reason type (the metric's series are unchanged), and every
    /// label is some transport's.
    #[test]
    fn each_transport_keeps_its_labels() {
        let labels = |k| CloseReason::labels(k).collect::<Vec<_>>();
        let tcp =
            ["peer_closed", "truncated", "io", "idle", "decode", "not_hello", "rejected", "unexpected_frame", "tls"];
        assert_eq!(labels(TransportKind::Tcp), tcp);
        assert_eq!(labels(TransportKind::Quic), tcp);
        let local = ["peer_closed", "truncated", "io", "idle", "decode", "not_hello", "rejected"];
        let local_own = ["ring_refused", "bad_slot", "unexpected_message", "peer_uid"];
        assert_eq!(labels(TransportKind::Local), [local.as_slice(), &local_own].concat());
        assert_eq!(labels(TransportKind::Ucx), ["bye", "peer_failed", "rejected", "busy"]);
        for label in CloseReason::LABELS {
            let used = [TransportKind::Tcp, TransportKind::Local, TransportKind::Ucx]
                .into_iter()
                .any(|k| CloseReason::labels(k).any(|l| l == label));
            assert!(used, "{label} is no transport's");
        }
    }

    /// A label is found by its variant, whichever payload it carries, and
    /// local's frame-level decode errors count as `decode` like the streams'.
    #[test]
    fn variants_map_to_their_labels() {
        let mut s = ServerStats::default();
        s.close(&CloseReason::Idle(Duration::ZERO));
        s.close(&CloseReason::from(WireError::Frame(DecodeError::UnknownKind(99))));
        s.close(&CloseReason::from(WireError::UnknownKind(9)));
        s.close(&CloseReason::Bye);
        assert_eq!((s.closed_by("idle"), s.closed_by("decode"), s.closed_by("bye")), (1, 2, 1));
        assert_eq!(s.closed_by("no such label"), 0);
        assert_eq!(s.connections_closed(), 4);
        let ucx: Vec<_> = s.closed_for(TransportKind::Ucx).collect();
        assert_eq!(ucx, [("bye", 1), ("peer_failed", 0), ("rejected", 0), ("busy", 0)]);
        for (i, label) in CloseReason::LABELS.iter().enumerate() {
            assert_eq!(CloseReason::LABELS.iter().position(|l| l == label), Some(i), "{label} twice");
        }
    }
}
