//! Moving KV cache blocks from a prefill worker into a decode worker.
//!
//! Owns: the [`LayoutFingerprint`] and [`VersionGroup`] that decide which
//! peers may exchange KV, the wire [`frame`]s and their binary codec, the
//! receiver-side session state machine ([`Receiver`]: reservations, leases,
//! per-layer coverage, completion) and the sender-side frame splitter
//! ([`split_layer`]), and the [`transport`]s that drive them:
//! - [`transport::tcp`]: plain TCP for a trusted cluster network
//!   ([`TcpKvServer`] on the decode worker, [`TcpKvSender`] on the prefill
//!   worker), writing received frames straight into pool blocks through a
//!   [`BlockSink`].
//! - [`transport::local`]: same host, payloads through shared memory
//!   ([`LocalKvServer`], [`LocalKvSender`]).
//! - [`transport::quic`]: QUIC with TLS 1.3 for untrusted links
//!   ([`QuicKvServer`], [`QuicKvSender`]): the same frames and rules as TCP.
//!
//! - [`transport::ucx`]: one-sided puts through UCX into a registered
//!   landing region ([`UcxKvServer`], [`UcxKvSender`]), fenced so a late
//!   write never reaches pool blocks.
//!
//! A CUDA transport comes later, behind the same shape.
//!
//! Must not: know about models beyond [`types::kv::KvLayout`]. Outside
//! [`transport`], must not open sockets, read a clock or spawn tasks either:
//! everything there is protocol logic with time passed in (the quinn-proto
//! shape), so it is tested deterministically in memory and every byte parser
//! can be fuzzed. Transports only move bytes and pass the time in.
//!
//! # Protocol
//!
//! The decode worker owns the request. It allocates blocks from its own
//! [`engine::kv::KvPool`] first, registers them with [`Receiver::reserve`]
//! under a lease, and tells the prefill worker (over the control plane) the
//! reservation id, generation and block count. The prefill worker then
//! connects and streams:
//!
//! ```text
//! prefill (sender)                                decode (receiver)
//!   Hello{group, fingerprint, version}  ───────▶  on_hello
//!                                      ◀───────  HelloAck | HelloReject{reason}
//!   LayerData{res, gen, layer, first_block, n_blocks, crc32c, K‥V}  ───▶  on_layer
//!   … any number, any layer order, as each layer is computed …
//!   Complete{res, gen, n_layers}        ───────▶  on_complete
//!                                      ◀───────  Ack{res, gen}
//!   Abort{res, gen, reason}             ◀──────▶  either side, any time
//! ```
//!
//! Rules the receiver enforces (each is a typed [`FrameError`]):
//! - The handshake refuses a different protocol version, a different version
//!   group label, and — even when labels agree — a different layout
//!   fingerprint, because a mislabelled deployment must not produce silently
//!   wrong KV.
//! - Every frame names (reservation, generation). Ids are slots that are
//!   reused; the generation is fresh for every reservation, so a late frame
//!   from a superseded or abandoned transfer never lands in blocks that now
//!   belong to someone else.
//! - A frame past the lease deadline expires the reservation; every later
//!   frame for it is refused.
//! - Each (layer, block) is written exactly once; ranges, lengths and layer
//!   numbers are checked before any byte is written.
//! - A checksum mismatch fails the reservation for good: a transfer that
//!   delivered one corrupt frame is not trusted for the rest.
//! - `Complete` is acknowledged only when every (layer, block) has arrived,
//!   and only then does [`Receiver::take_ready`] hand the blocks to the
//!   engine. Blocks are never readable while a writer may still be writing:
//!   a partially written block set looks like valid KV to attention, so the
//!   only safe moment to read is after the full set is known to be there.
//! - Every way a reservation ends (taken after completion, local abort, peer
//!   abort, lease expiry, corruption) hands its blocks back to the caller
//!   exactly once, so the caller's pool never leaks or double-frees.

// `deny`, not `forbid`: transport::local::shm (memory mappings), checksum
// (the fused copy loop), and the UCX transport's two calls of it on the
// landing region (the sender's `store_mapped`, the server's `copy_out`) are
// allowed `unsafe`.
#![deny(unsafe_code)]

pub mod buffers;
pub mod checksum;
pub mod fingerprint;
pub mod frame;
pub mod sender;
pub mod session;
pub mod transport;

pub use buffers::{Buffer, Buffers};
pub use fingerprint::{LayoutFingerprint, VersionGroup, VersionGroupError};
pub use frame::{
    Abort, AbortReason, Ack, Complete, DecodeError, DecodeLimits, Decoded, EncodeError, Frame, Hello, HelloAck,
    HelloReject, LayerData, LayerDataHeader, RejectReason,
};
pub use sender::{gathered_layer, split_layer, LayerChunks, SplitError};
pub use session::{
    ConfigError, FrameError, Peer, Receiver, ReceiverConfig, ReceiverCounters, ReleaseCause, Released, Reservation,
    ReservationError, ReservationId, ReservationState, ReserveError, ReserveRefusal, WriteInstruction,
};
pub use transport::any::{KvSender, KvServer, SenderConfig, ServerConfig, TransportKind};
pub use transport::local::{LocalKvSender, LocalKvServer, LocalSenderConfig, LocalServerConfig, LocalServerStats};
pub use transport::quic::{
    CertFingerprint, PeerTrust, QuicKvSender, QuicKvServer, QuicSenderConfig, QuicServerConfig, QuicServerStats,
    QuicTuning, TlsError, TlsIdentity,
};
pub use transport::tcp::{TcpKvSender, TcpKvServer, TcpSenderConfig, TcpServerConfig, TcpServerStats};
pub use transport::ucx::{
    LandingRefusal, StoredLayer, UcxDirectWriter, UcxKvSender, UcxKvServer, UcxPoolMemory, UcxSenderConfig,
    UcxServerConfig, UcxServerStats,
};
pub use transport::{BlockSink, FnSink, OwnedPayload};
pub use transport::{CloseReason, PinnedLayer, ServerStats, TransferError, UcxStats};

/// Version of the transfer protocol: frame layouts and session rules. Peers
/// with different versions refuse each other in the handshake. It is also
/// hashed into the [`LayoutFingerprint`].
pub const PROTOCOL_VERSION: u32 = 1;

/// What a caller can do about an error that crosses the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// Another attempt (another prefill worker, a fresh reservation) may succeed.
    Retryable,
    /// The peer has no capacity now.
    Overloaded,
    /// A lease or deadline passed.
    Deadline,
    /// The peers cannot exchange KV: protocol, group or layout differ.
    VersionMismatch,
    /// The message broke a protocol rule; retrying the same thing fails again.
    InvalidInput,
    /// The work was cancelled on purpose.
    Cancelled,
}

#[cfg(test)]
mod testutil;
