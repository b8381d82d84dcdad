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
//!   send_layer ─ LayerData … ──────────────▶  Receiver::on_layer → BlockSink::write_layer
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
//! The server never panics on peer input and buffers at most one frame
//! (bounded by [`DecodeLimits`]) plus 64 KiB per connection. What it does:
//!
//! | event | reply | connection |
//! |---|---|---|
//! | bytes that are not a frame ([`DecodeError`]) | none (no reservation to name) | closed: the stream cannot be resynchronised |
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
//! Accepted payloads are written while the server holds the receiver's
//! lock, so a reservation cannot expire and its blocks be reused while the
//! bytes are landing. (That serialises writes across connections; fine at
//! one memcpy per frame, to revisit for many concurrent senders.)
//!
//! The sender writes each frame's header, K range and V range with one
//! vectored write straight from the caller's gathered K and V: no payload
//! copy, the checksum computed over the two ranges in place.

use std::io::{self, IoSlice};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::timeout;

use crate::frame::{DecodeError, DecodeLimits, Decoded, Frame, HEADER_LEN};

mod sender;
mod server;

pub use sender::{TcpKvSender, TcpSenderConfig, TransferError};
pub use server::{CloseReason, TcpKvServer, TcpServerConfig, TcpServerStats};

/// Default largest frame a sender writes. 1 MiB beat 4 MiB on loopback
/// (benches/tcp.rs): a frame that stays in cache through decode, checksum
/// and the sink's copy is cheaper than fewer, larger frames.
pub const DEFAULT_MAX_FRAME_BYTES: usize = 1 << 20;

/// Bytes read past the frame in progress: small, so compacting the read
/// buffer after a frame moves little.
const READ_SLACK: usize = 64 << 10;

/// Frames remembered per connection for de-duplication (aborts sent by the
/// server, acks and aborts received by the sender).
const REMEMBERED: usize = 64;

// ---------------------------------------------------------------- reading

/// Why reading the next frame failed.
#[derive(Debug)]
enum ReadError {
    Io(io::Error),
    Idle(Duration),
    Decode(DecodeError),
    /// EOF inside a frame.
    Truncated,
}

/// A reusable read buffer that yields whole frames. Holds at most one frame
/// (bounded by the decode limits, checked from the header before the body is
/// read) plus [`READ_SLACK`].
#[derive(Debug)]
struct FrameReader {
    buf: Vec<u8>,
    start: usize,
    end: usize,
    /// Bytes the frame in progress needs in total, from `start`.
    need: usize,
    limits: DecodeLimits,
}

impl FrameReader {
    fn new(limits: DecodeLimits) -> Self {
        Self { buf: Vec::new(), start: 0, end: 0, need: HEADER_LEN, limits }
    }

    fn is_empty(&self) -> bool {
        self.start == self.end
    }

    /// The next frame already buffered, if any.
    fn decode(&mut self) -> Result<Option<Frame>, DecodeError> {
        if self.is_empty() {
            (self.start, self.end, self.need) = (0, 0, HEADER_LEN);
            return Ok(None);
        }
        match Frame::decode(&self.buf[self.start..self.end], &self.limits)? {
            Decoded::Frame { frame, consumed } => {
                self.start += consumed;
                Ok(Some(frame))
            }
            Decoded::NeedMore { at_least } => {
                self.need = at_least;
                Ok(None)
            }
        }
    }

    /// Room for the rest of the frame in progress (plus slack) to be read into.
    fn space(&mut self) -> &mut [u8] {
        let want = self.need.max(HEADER_LEN) + READ_SLACK;
        if self.start + want > self.buf.len() {
            if self.start > 0 {
                self.buf.copy_within(self.start..self.end, 0);
                (self.start, self.end) = (0, self.end - self.start);
            }
            if want > self.buf.len() {
                self.buf.resize(want, 0);
            }
        }
        let limit = self.start + want;
        &mut self.buf[self.end..limit]
    }

    fn advance(&mut self, n: usize) {
        self.end += n;
    }

    /// Reads until a whole frame is buffered. `Ok(None)`: the peer closed
    /// cleanly between frames. Each read waits at most `idle`.
    async fn next(&mut self, stream: &mut TcpStream, idle: Duration) -> Result<Option<Frame>, ReadError> {
        loop {
            if let Some(frame) = self.decode().map_err(ReadError::Decode)? {
                return Ok(Some(frame));
            }
            let n = match timeout(idle, stream.read(self.space())).await {
                Err(_) => return Err(ReadError::Idle(idle)),
                Ok(Err(e)) => return Err(ReadError::Io(e)),
                Ok(Ok(n)) => n,
            };
            if n == 0 {
                return if self.is_empty() { Ok(None) } else { Err(ReadError::Truncated) };
            }
            self.advance(n);
        }
    }
}

/// Why a write did not finish.
#[derive(Debug)]
enum WriteError {
    Io(io::Error),
    Timeout(Duration),
}

/// Writes every byte of `parts`, in order, with vectored writes, within `wait`.
async fn write_parts<const N: usize>(
    stream: &mut TcpStream,
    parts: [&[u8]; N],
    wait: Duration,
) -> Result<(), WriteError> {
    let total: usize = parts.iter().map(|p| p.len()).sum();
    let all = async {
        let mut done = 0;
        while done < total {
            let mut slices: [IoSlice<'_>; N] = std::array::from_fn(|_| IoSlice::new(&[]));
            let (mut skip, mut k) = (done, 0);
            for p in parts {
                if skip >= p.len() {
                    skip -= p.len();
                    continue;
                }
                slices[k] = IoSlice::new(&p[skip..]);
                skip = 0;
                k += 1;
            }
            let n = stream.write_vectored(&slices[..k]).await?;
            if n == 0 {
                return Err(io::Error::from(io::ErrorKind::WriteZero));
            }
            done += n;
        }
        Ok(())
    };
    match timeout(wait, all).await {
        Err(_) => Err(WriteError::Timeout(wait)),
        Ok(r) => r.map_err(WriteError::Io),
    }
}

/// Encodes a small control frame into `out` and writes it.
async fn write_frame(stream: &mut TcpStream, out: &mut Vec<u8>, f: &Frame, wait: Duration) -> Result<(), WriteError> {
    out.clear();
    // Only LayerData can fail to encode; control frames are fixed-size.
    f.encode(out).map_err(|e| WriteError::Io(io::Error::new(io::ErrorKind::InvalidInput, e)))?;
    write_parts(stream, [out.as_slice()], wait).await
}

fn frame_name(f: &Frame) -> &'static str {
    match f {
        Frame::Hello(_) => "Hello",
        Frame::HelloAck(_) => "HelloAck",
        Frame::HelloReject(_) => "HelloReject",
        Frame::LayerData(_) => "LayerData",
        Frame::Complete(_) => "Complete",
        Frame::Ack(_) => "Ack",
        Frame::Abort(_) => "Abort",
    }
}

/// Bounded memory of recent items, oldest forgotten first.
#[derive(Debug)]
struct Recent<T>(std::collections::VecDeque<T>);

impl<T> Default for Recent<T> {
    fn default() -> Self {
        Self(std::collections::VecDeque::new())
    }
}

impl<T: PartialEq> Recent<T> {
    fn push(&mut self, t: T) {
        if self.0.len() == REMEMBERED {
            self.0.pop_front();
        }
        self.0.push_back(t);
    }
    fn contains(&self, t: &T) -> bool {
        self.0.contains(t)
    }
}
