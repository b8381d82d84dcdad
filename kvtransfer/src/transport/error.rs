//! The sender's error, shared by every transport.

use std::io;
use std::time::Duration;

use super::quic::TlsError;
use super::stream::{ReadError, WriteError};
use super::ucx::LandingRefusal;
use crate::frame::{AbortReason, RejectReason};
use crate::sender::SplitError;
use crate::ErrorKind;

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
    /// UCX only: the decode worker has no landing space for the
    /// reservation now, or will never have (see [`LandingRefusal`]).
    #[error("landing refused: {refusal}")]
    Landing { refusal: LandingRefusal },
    /// A direct writer's grant was revoked (its reservation completed or
    /// was aborted, or its connection ended) before this store; nothing was
    /// stored.
    #[error("the direct grant of reservation {reservation} (generation {generation}) was revoked")]
    Revoked { reservation: u64, generation: u32 },
    /// The caller sent a layer, `Complete` or another `Complete` of a
    /// reservation after its own `Complete` or `Abort` on this connection
    /// (a local bug); nothing was sent.
    #[error(
        "reservation {reservation} (generation {generation}) was already {how} on this connection; nothing was sent"
    )]
    Ended { reservation: u64, generation: u32, how: &'static str },
    /// QUIC only: a certificate was refused (the receiver's by us, or ours
    /// by the receiver), or the TLS settings are unusable.
    #[error("TLS: {0}")]
    Tls(#[from] TlsError),
}

impl TransferError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Io(_) => ErrorKind::Retryable,
            Self::Rejected { reason } => reason.kind(),
            Self::Timeout { .. } => ErrorKind::Deadline,
            Self::Protocol(_) | Self::Layer(_) | Self::Ended { .. } => ErrorKind::InvalidInput,
            Self::PeerAbort { reason } => reason.kind(),
            Self::Tls(e) => e.kind(),
            Self::Landing { refusal } => refusal.kind(),
            Self::Revoked { .. } => ErrorKind::Retryable,
        }
    }

    /// Stable label for logs and the `reason` metric label.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Io(_) => "io",
            Self::Rejected { .. } => "rejected",
            Self::Timeout { .. } => "timeout",
            Self::Protocol(_) => "protocol",
            Self::PeerAbort { .. } => "peer_abort",
            // Both a local bug: nothing of it was sent.
            Self::Layer(_) | Self::Ended { .. } => "layer",
            Self::Tls(_) => "tls",
            Self::Landing { .. } => "landing",
            Self::Revoked { .. } => "revoked",
        }
    }

    pub(crate) fn write(e: WriteError, what: &'static str) -> Self {
        match e {
            WriteError::Io(e) => Self::Io(e),
            WriteError::Timeout(after) => Self::Timeout { what, after },
        }
    }

    pub(crate) fn read(e: ReadError, what: &'static str) -> Self {
        match e {
            ReadError::Io(e) => Self::Io(e),
            ReadError::Idle(after) => Self::Timeout { what, after },
            ReadError::Decode(e) => Self::Protocol(format!("undecodable bytes from the receiver: {e}")),
            ReadError::Truncated => Self::Io(io::Error::new(io::ErrorKind::UnexpectedEof, "receiver closed mid-frame")),
        }
    }
}
