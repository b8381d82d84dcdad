//! Plain TCP transport for a trusted cluster network.
//!
//! No encryption and no peer authentication: integrity comes from each
//! frame's CRC-32C, compatibility from the handshake. Use the QUIC transport
//! across links you do not trust.
//!
//! # Connection lifecycle
//!
//! ```text
//! prefill: TcpKvSender                         decode: TcpKvServer (one task per connection)
//!   connect ─── Hello ─────────────────────▶  first frame must be Hello, else close (NotHello)
//!          ◀── HelloAck | HelloReject ──────  reject: reply, then close (Rejected)
//!   send_layer ─ LayerData … ──────────────▶  Receiver::on_layer_checked → BlockSink::write_layer
//!          ◀── Abort{reason} (once) ────────  the frame was refused: reservation-level error
//!   complete ─── Complete ─────────────────▶  Receiver::on_complete
//!          ◀── Ack | Abort ─────────────────
//!   (drop) ─── FIN ────────────────────────▶  clean close between frames (PeerClosed)
//! ```
//!
//! One connection carries any number of reservations, one after another or
//! interleaved; the worker binaries keep one connection per peer pair.
//!
//! # Error handling
//!
//! The server never panics on peer input and buffers at most one frame's
//! payload (bounded by [`DecodeLimits`](crate::DecodeLimits)) plus 8 KiB per connection. What it does:
//!
//! | event | reply | connection |
//! |---|---|---|
//! | bytes that are not a frame ([`DecodeError`](crate::DecodeError)) | none (no reservation to name) | closed: the stream cannot be resynchronised |
//! | first frame not `Hello` | none | closed |
//! | handshake refused | `HelloReject{reason}` | closed |
//! | a frame only the receiver sends (`HelloAck`, `Ack`, a second `Hello`, …) | none | closed |
//! | `LayerData`/`Complete` refused by the [`Receiver`](crate::Receiver) ([`FrameError`](crate::FrameError)) | `Abort{error.abort_reason()}`, once per reservation | **kept**: the frame was well delimited, so the stream is in sync, and other reservations on it are unaffected |
//! | the [`BlockSink`](super::BlockSink) fails to store an accepted frame | the reservation is aborted, `Abort{Corrupt}` | kept |
//! | no byte for `idle_timeout` | none | closed (a dead peer never pins a task) |
//! | EOF mid-frame, I/O error | none | closed |
//!
//! Whatever ends a connection, reservations it was feeding stay in the
//! [`Receiver`](crate::Receiver) until their lease ends: they are never `Ready` unless every
//! (layer, block) arrived and `Complete` was acknowledged, and their blocks
//! come back through [`Receiver::poll_released`](crate::Receiver::poll_released) — the transport itself
//! never frees blocks.
//!
//! Accepted payloads are handed to the sink while the server holds the
//! receiver's lock, so a reservation cannot expire and its blocks be reused
//! before the write is placed. With a sink that writes in place (a pool
//! behind a mutex) that serialises the writes of concurrent connections;
//! the decode worker's sink only posts the payload to the engine thread.
//!
//! Copies: the sender writes each frame's header, K range and V range with
//! one vectored write straight from the caller's gathered K and V, the
//! checksum computed over the two ranges in place. The server reads each
//! payload straight from the socket into a recycled buffer that it hands
//! to the sink by value, checksumming each read's bytes right after the
//! read, while they are in cache, so the [`Receiver`](crate::Receiver)
//! gets the checksum with the frame
//! ([`on_layer_checked`](crate::Receiver::on_layer_checked)) and never
//! reads the payload again (`transport/stream.rs`).

mod sender;
mod server;

pub use super::close::CloseReason;
pub use super::error::TransferError;
pub use sender::{TcpKvSender, TcpSenderConfig};
pub use server::{TcpKvServer, TcpServerConfig, TcpServerStats};

/// Default largest frame a sender writes. 1 MiB beat 4 MiB on loopback
/// (benches/tcp.rs): a frame that stays in cache through the socket read,
/// checksum and the sink's copy is cheaper than fewer, larger frames; and
/// 256 KiB frames cost more per byte in per-frame work.
pub const DEFAULT_MAX_FRAME_BYTES: usize = 1 << 20;
