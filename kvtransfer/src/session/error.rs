//! Errors of the receiver state machine.

use std::time::Duration;

use types::kv::BlockId;

use super::{Reservation, ReservationState};
use crate::frame::AbortReason;
use crate::ErrorKind;

/// Why the receiver refused a frame from the sender. Nothing was written
/// for a refused frame. Only [`FrameError::ChecksumMismatch`] and the first
/// [`FrameError::Expired`] end the reservation (its blocks then come back
/// through [`Receiver::poll_released`](super::Receiver::poll_released));
/// the others leave it as it was.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// No reservation with this id was ever made here.
    #[error("unknown reservation {id}")]
    UnknownReservation { id: u64 },
    /// The id exists but is now on another generation: the frame belongs to
    /// a superseded or abandoned transfer.
    #[error("reservation {id}: generation {got} is not the current {current}")]
    StaleGeneration { id: u64, got: u32, current: u32 },
    /// The lease ran out before the transfer completed.
    #[error("reservation {0} expired")]
    Expired(Reservation),
    /// An earlier frame failed its checksum; the reservation is void.
    #[error("reservation {0} failed after a corrupt frame")]
    Failed(Reservation),
    /// The reservation was aborted (by either side).
    #[error("reservation {0} was aborted")]
    Aborted(Reservation),
    /// The reservation already completed; no more frames are accepted.
    #[error("reservation {0} is already complete")]
    AlreadyComplete(Reservation),
    /// `layer` is not below the layout's layer count.
    #[error("layer {layer} out of range: the layout has {n_layers} layers")]
    LayerOutOfRange { layer: u32, n_layers: usize },
    /// The frame names no blocks.
    #[error("frame names zero blocks")]
    EmptyRange,
    /// The block range runs past the reservation's blocks.
    #[error("blocks {first_block}..{first_block}+{n_blocks} outside the reservation's {reserved}")]
    BlockRange { first_block: u32, n_blocks: u32, reserved: usize },
    /// The payload is not exactly K and V of the named blocks.
    #[error("payload of {got} bytes; {expected} expected for the named blocks")]
    PayloadLength { got: usize, expected: usize },
    /// This (layer, block) was already written.
    #[error("layer {layer} block {block} written twice")]
    Duplicate { layer: u32, block: u32 },
    /// The payload does not match its CRC-32C. The reservation is now failed.
    #[error("reservation {reservation}: checksum {actual:#010x}, frame says {expected:#010x}")]
    ChecksumMismatch { reservation: Reservation, expected: u32, actual: u32 },
    /// `Complete` arrived before every (layer, block) was written.
    #[error("complete with {written} of {expected} layer-blocks written")]
    Incomplete { written: usize, expected: usize },
    /// `Complete` names a different layer count than the layout.
    #[error("complete names {got} layers; the layout has {expected}")]
    LayerCount { got: u32, expected: usize },
}

impl FrameError {
    /// Every [`reason`](Self::reason) label, for pre-registering metrics.
    pub const REASONS: [&'static str; 14] = [
        "unknown_reservation",
        "stale_generation",
        "expired",
        "failed",
        "aborted",
        "already_complete",
        "layer_out_of_range",
        "empty_range",
        "block_range",
        "payload_length",
        "duplicate",
        "checksum",
        "incomplete",
        "layer_count",
    ];

    /// Stable label for logs and `tandem_kv_transfer_failures_total{reason}`.
    pub fn reason(&self) -> &'static str {
        let i = match self {
            Self::UnknownReservation { .. } => 0,
            Self::StaleGeneration { .. } => 1,
            Self::Expired(_) => 2,
            Self::Failed(_) => 3,
            Self::Aborted(_) => 4,
            Self::AlreadyComplete(_) => 5,
            Self::LayerOutOfRange { .. } => 6,
            Self::EmptyRange => 7,
            Self::BlockRange { .. } => 8,
            Self::PayloadLength { .. } => 9,
            Self::Duplicate { .. } => 10,
            Self::ChecksumMismatch { .. } => 11,
            Self::Incomplete { .. } => 12,
            Self::LayerCount { .. } => 13,
        };
        Self::REASONS[i]
    }

    /// What the receiver tells the sender in an `Abort`, if it gives up.
    pub fn abort_reason(&self) -> AbortReason {
        match self {
            Self::Expired(_) => AbortReason::LeaseExpired,
            Self::ChecksumMismatch { .. } | Self::Failed(_) => AbortReason::Corrupt,
            Self::Aborted(_) => AbortReason::Cancelled,
            _ => AbortReason::ProtocolViolation,
        }
    }

    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Expired(_) => ErrorKind::Deadline,
            Self::ChecksumMismatch { .. } | Self::Failed(_) => ErrorKind::Retryable,
            Self::Aborted(_) => ErrorKind::Cancelled,
            _ => ErrorKind::InvalidInput,
        }
    }
}

/// Why the local caller's request about a reservation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReservationError {
    /// No reservation with this id was ever made here.
    #[error("unknown reservation {id}")]
    Unknown { id: u64 },
    /// The id is now on another generation (this one ended and was reused).
    #[error("reservation {id}: generation {got} is not the current {current}")]
    StaleGeneration { id: u64, got: u32, current: u32 },
    /// The transfer has not completed yet; its blocks are not readable.
    #[error("reservation {reservation} is {state:?}, not ready")]
    NotReady { reservation: Reservation, state: ReservationState },
    /// The reservation already ended; its blocks were handed back then.
    #[error("reservation {reservation} already ended: {state:?}")]
    Ended { reservation: Reservation, state: ReservationState },
    /// A renewal asked for a lease of zero or over `ReceiverConfig::max_lease`.
    #[error("a lease of {ttl:?} is not in (0, {max:?}]")]
    InvalidTtl { ttl: Duration, max: Duration },
}

/// A reservation that was not made. The blocks come back in the error so
/// the caller returns them to its pool.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("reservation refused: {refusal}")]
pub struct ReserveError {
    pub refusal: ReserveRefusal,
    pub blocks: Vec<BlockId>,
}

impl ReserveError {
    pub fn into_blocks(self) -> Vec<BlockId> {
        self.blocks
    }
}

/// Why [`Receiver::reserve`](super::Receiver::reserve) refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReserveRefusal {
    /// No blocks given.
    #[error("no blocks")]
    Empty,
    /// More blocks than the configured maximum for one reservation.
    #[error("{n} blocks; at most {max} per reservation")]
    TooManyBlocks { n: usize, max: usize },
    /// The same block appears twice in the list.
    #[error("block {block} listed twice")]
    DuplicateBlock { block: BlockId },
    /// The block already belongs to another reservation here (a caller bug).
    #[error("block {block} already held by a reservation")]
    AlreadyHeld { block: BlockId },
    /// The lease is zero, longer than the configured maximum, or overflows the clock.
    #[error("lease of {ttl:?} not in (0, {max:?}]")]
    InvalidTtl { ttl: Duration, max: Duration },
    /// Every reservation slot is live.
    #[error("all {max} reservation slots are in use")]
    Full { max: usize },
}

impl ReserveRefusal {
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Full { .. } => ErrorKind::Overloaded,
            _ => ErrorKind::InvalidInput,
        }
    }
}

/// A [`ReceiverConfig`](super::ReceiverConfig) that cannot work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid receiver config `{field}`: {why}")]
pub struct ConfigError {
    pub field: &'static str,
    pub why: String,
}
