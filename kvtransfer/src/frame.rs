//! Wire messages of the KV transfer protocol and their binary codec.
//!
//! Hand-written rather than serde so the byte layout is the specification,
//! and so a decoder can check every length before it allocates. Every frame
//! is an 8-byte header and a body:
//!
//! ```text
//! magic "tK" (2) | kind: u8 | reserved: u8 = 0 | body_len: u32 LE | body
//! ```
//!
//! Integers are little-endian. Bodies by kind:
//!
//! | kind | frame | body |
//! |---|---|---|
//! | 1 | `Hello` | `protocol_version: u32, fingerprint: [u8; 32], group_len: u8, group` — then bytes a later version may append, which this version ignores |
//! | 2 | `HelloAck` | `protocol_version: u32` |
//! | 3 | `HelloReject` | `reason: u16` |
//! | 4 | `LayerData` | `reservation: u64, generation: u32, layer: u32, first_block: u32, n_blocks: u32, crc32c: u32, payload_len: u32, payload` |
//! | 5 | `Complete` | `reservation: u64, generation: u32, n_layers: u32` |
//! | 6 | `Ack` | `reservation: u64, generation: u32` |
//! | 7 | `Abort` | `reservation: u64, generation: u32, reason: u16` |
//!
//! Versioning: the header, the kind codes and the start of `Hello` are frozen
//! for all protocol versions, so peers of any two versions can always decode
//! each other's `Hello` and `HelloReject` and refuse cleanly with
//! [`RejectReason::ProtocolVersion`] instead of failing to parse. Everything
//! after the handshake is specific to the agreed version and decoded
//! strictly: a body must be exactly as long as its fields.
//!
//! The decoder validates the header as soon as its 8 bytes are there —
//! before asking for the body — so a hostile length is refused at once
//! rather than making the transport buffer gigabytes.

use std::fmt;

use crate::fingerprint::{LayoutFingerprint, VersionGroup, VersionGroupError};
use crate::ErrorKind;

const MAGIC: [u8; 2] = *b"tK";
/// Bytes of the frame header.
pub const HEADER_LEN: usize = 8;
/// Fixed part of a `LayerData` body (everything but the payload).
const LAYER_DATA_FIXED: usize = 8 + 4 * 6;
/// Bytes a `LayerData` frame adds to its payload (header + fixed fields).
pub const LAYER_DATA_OVERHEAD: usize = HEADER_LEN + LAYER_DATA_FIXED;
/// Smallest `Hello` body: version, fingerprint, a 1-byte label.
const HELLO_MIN: usize = 4 + 32 + 1 + 1;
/// Largest `Hello` body accepted, leaving room for later versions' fields.
const HELLO_MAX: usize = 1024;

/// How large a frame this decoder accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeLimits {
    /// Largest `LayerData` payload, in bytes.
    pub max_payload_bytes: usize,
}

impl DecodeLimits {
    /// The most any limit may be: the body length must fit the u32 field.
    pub const MAX_PAYLOAD: usize = u32::MAX as usize - LAYER_DATA_FIXED;
}

impl Default for DecodeLimits {
    /// 64 MiB: several blocks of a large model's layer per frame.
    fn default() -> Self {
        Self { max_payload_bytes: 64 << 20 }
    }
}

/// Why a handshake was refused. Codes are stable across versions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RejectReason {
    /// The peers speak different protocol versions.
    ProtocolVersion,
    /// The peers carry different version-group labels.
    VersionGroup,
    /// Labels agree but the layout fingerprints (weights, tokenizer, layout) differ.
    Fingerprint,
}

impl RejectReason {
    pub const ALL: [RejectReason; 3] = [Self::ProtocolVersion, Self::VersionGroup, Self::Fingerprint];

    fn code(self) -> u16 {
        match self {
            Self::ProtocolVersion => 1,
            Self::VersionGroup => 2,
            Self::Fingerprint => 3,
        }
    }

    fn from_code(c: u16) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.code() == c)
    }

    /// Label for logs and the `reason` metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ProtocolVersion => "protocol_version",
            Self::VersionGroup => "version_group",
            Self::Fingerprint => "fingerprint",
        }
    }

    pub fn kind(self) -> ErrorKind {
        ErrorKind::VersionMismatch
    }
}

/// Why a transfer was abandoned, by either side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AbortReason {
    /// The request was cancelled (client gone, request dropped).
    Cancelled,
    /// The request's deadline passed.
    DeadlineExceeded,
    /// The sender could not compute the KV (prefill failed).
    PrefillFailed,
    /// The reservation's lease ran out before the transfer completed.
    LeaseExpired,
    /// A frame failed its checksum; the reservation is void.
    Corrupt,
    /// The receiver refused a frame for breaking a protocol rule.
    ProtocolViolation,
    /// The peer is shutting down.
    ShuttingDown,
}

impl AbortReason {
    pub const ALL: [AbortReason; 7] = [
        Self::Cancelled,
        Self::DeadlineExceeded,
        Self::PrefillFailed,
        Self::LeaseExpired,
        Self::Corrupt,
        Self::ProtocolViolation,
        Self::ShuttingDown,
    ];

    fn code(self) -> u16 {
        match self {
            Self::Cancelled => 1,
            Self::DeadlineExceeded => 2,
            Self::PrefillFailed => 3,
            Self::LeaseExpired => 4,
            Self::Corrupt => 5,
            Self::ProtocolViolation => 6,
            Self::ShuttingDown => 7,
        }
    }

    fn from_code(c: u16) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.code() == c)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Cancelled => "cancelled",
            Self::DeadlineExceeded => "deadline_exceeded",
            Self::PrefillFailed => "prefill_failed",
            Self::LeaseExpired => "lease_expired",
            Self::Corrupt => "corrupt",
            Self::ProtocolViolation => "protocol_violation",
            Self::ShuttingDown => "shutting_down",
        }
    }

    pub fn kind(self) -> ErrorKind {
        match self {
            Self::Cancelled => ErrorKind::Cancelled,
            Self::DeadlineExceeded | Self::LeaseExpired => ErrorKind::Deadline,
            Self::PrefillFailed | Self::Corrupt | Self::ShuttingDown => ErrorKind::Retryable,
            Self::ProtocolViolation => ErrorKind::InvalidInput,
        }
    }
}

/// Sender -> receiver: who I am. The first frame on every connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    pub version_group: VersionGroup,
    pub fingerprint: LayoutFingerprint,
    pub protocol_version: u32,
}

/// Receiver -> sender: handshake accepted at this protocol version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HelloAck {
    pub protocol_version: u32,
}

/// Receiver -> sender: handshake refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HelloReject {
    pub reason: RejectReason,
}

/// Sender -> receiver: one layer's K then V for the contiguous blocks
/// `first_block..first_block + n_blocks` of a reservation (indices into the
/// reservation's block list, not pool block ids, which only the receiver
/// knows).
#[derive(Clone, PartialEq, Eq)]
pub struct LayerData {
    pub reservation: u64,
    pub generation: u32,
    pub layer: u32,
    pub first_block: u32,
    pub n_blocks: u32,
    /// CRC-32C (Castagnoli) of `payload`.
    pub checksum: u32,
    /// K of the `n_blocks` blocks in order, then V of the same blocks;
    /// little-endian elements of the layout's dtype.
    pub payload: Vec<u8>,
}

impl LayerData {
    /// Builds a frame, computing the checksum of `payload`.
    pub fn new(
        reservation: u64,
        generation: u32,
        layer: u32,
        first_block: u32,
        n_blocks: u32,
        payload: Vec<u8>,
    ) -> Self {
        let checksum = crate::checksum::crc32c_append(0, &payload);
        Self { reservation, generation, layer, first_block, n_blocks, checksum, payload }
    }

    /// CRC-32C of the payload as it is now.
    pub fn payload_checksum(&self) -> u32 {
        crate::checksum::crc32c_append(0, &self.payload)
    }

    /// The frame's fields before its payload, `payload_len` being the
    /// payload's actual length.
    pub fn header(&self) -> LayerDataHeader {
        let Self { reservation, generation, layer, first_block, n_blocks, checksum, ref payload } = *self;
        LayerDataHeader { reservation, generation, layer, first_block, n_blocks, checksum, payload_len: payload.len() }
    }
}

impl fmt::Debug for LayerData {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LayerData")
            .field("reservation", &self.reservation)
            .field("generation", &self.generation)
            .field("layer", &self.layer)
            .field("first_block", &self.first_block)
            .field("n_blocks", &self.n_blocks)
            .field("checksum", &format_args!("{:#010x}", self.checksum))
            .field("payload_len", &self.payload.len())
            .finish()
    }
}

/// Everything of a `LayerData` frame before its payload: lets a transport
/// write the payload from where it already lies (for example K and V slices
/// of a gathered layer) instead of copying it into an encode buffer first.
/// `header.encode(out)` followed by the payload bytes is byte-for-byte what
/// [`Frame::encode`] writes for the equivalent [`LayerData`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerDataHeader {
    pub reservation: u64,
    pub generation: u32,
    pub layer: u32,
    pub first_block: u32,
    pub n_blocks: u32,
    /// CRC-32C of the payload that follows.
    pub checksum: u32,
    pub payload_len: usize,
}

impl LayerDataHeader {
    /// Appends the [`LAYER_DATA_OVERHEAD`] header bytes. On error `out` is unchanged.
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<(), EncodeError> {
        if self.payload_len > DecodeLimits::MAX_PAYLOAD {
            return Err(EncodeError::PayloadTooLarge { len: self.payload_len });
        }
        out.reserve(LAYER_DATA_OVERHEAD);
        let mut w = Writer(out);
        w.bytes(&MAGIC);
        w.u8(Kind::LayerData as u8);
        w.u8(0);
        // Fits: payload_len <= MAX_PAYLOAD = u32::MAX - LAYER_DATA_FIXED.
        w.u32((LAYER_DATA_FIXED + self.payload_len) as u32);
        w.u64(self.reservation);
        w.u32(self.generation);
        w.u32(self.layer);
        w.u32(self.first_block);
        w.u32(self.n_blocks);
        w.u32(self.checksum);
        w.u32(self.payload_len as u32);
        Ok(())
    }

    /// The frame this header starts, given its payload (read separately,
    /// e.g. after [`Frame::decode_head`]). `payload_len` is not consulted:
    /// the receiver checks the payload's length against `n_blocks`.
    pub fn with_payload(self, payload: Vec<u8>) -> LayerData {
        let Self { reservation, generation, layer, first_block, n_blocks, checksum, payload_len: _ } = self;
        LayerData { reservation, generation, layer, first_block, n_blocks, checksum, payload }
    }
}

/// Sender -> receiver: every layer of the reservation has been sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Complete {
    pub reservation: u64,
    pub generation: u32,
    pub n_layers: u32,
}

/// Receiver -> sender: the complete set arrived; the sender may drop its copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ack {
    pub reservation: u64,
    pub generation: u32,
}

/// Either direction: this transfer is over without success.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Abort {
    pub reservation: u64,
    pub generation: u32,
    pub reason: AbortReason,
}

/// Every message of the protocol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    Hello(Hello),
    HelloAck(HelloAck),
    HelloReject(HelloReject),
    LayerData(LayerData),
    Complete(Complete),
    Ack(Ack),
    Abort(Abort),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Hello = 1,
    HelloAck = 2,
    HelloReject = 3,
    LayerData = 4,
    Complete = 5,
    Ack = 6,
    Abort = 7,
}

impl Kind {
    fn from_u8(b: u8) -> Option<Self> {
        Some(match b {
            1 => Self::Hello,
            2 => Self::HelloAck,
            3 => Self::HelloReject,
            4 => Self::LayerData,
            5 => Self::Complete,
            6 => Self::Ack,
            7 => Self::Abort,
            _ => return None,
        })
    }

    fn name(self) -> &'static str {
        match self {
            Self::Hello => "Hello",
            Self::HelloAck => "HelloAck",
            Self::HelloReject => "HelloReject",
            Self::LayerData => "LayerData",
            Self::Complete => "Complete",
            Self::Ack => "Ack",
            Self::Abort => "Abort",
        }
    }

    /// Allowed body lengths, inclusive.
    fn body_range(self, limits: &DecodeLimits) -> (usize, usize) {
        match self {
            Self::Hello => (HELLO_MIN, HELLO_MAX),
            Self::HelloAck => (4, 4),
            Self::HelloReject => (2, 2),
            Self::LayerData => {
                let max_payload = limits.max_payload_bytes.min(DecodeLimits::MAX_PAYLOAD);
                (LAYER_DATA_FIXED, LAYER_DATA_FIXED + max_payload)
            }
            Self::Complete => (16, 16),
            Self::Ack => (12, 12),
            Self::Abort => (14, 14),
        }
    }
}

/// Result of decoding from the front of a buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decoded {
    /// A whole frame, and how many bytes of the buffer it used.
    Frame { frame: Frame, consumed: usize },
    /// The buffer holds a valid prefix; at least `at_least` bytes in total
    /// are needed before decoding can proceed.
    NeedMore { at_least: usize },
}

/// Bytes that are not a valid frame. The connection cannot resynchronise
/// after one of these: the caller closes it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The stream does not start with the frame magic: not a tandem KV peer,
    /// or the stream lost sync.
    #[error("bad frame magic {found:02x?}")]
    BadMagic { found: Vec<u8> },
    /// A frame kind this version does not know.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// The reserved header byte is not zero.
    #[error("reserved header byte is {0:#04x}, must be 0")]
    Reserved(u8),
    /// The header's body length is outside what this kind (and the limits) allow.
    #[error("{kind} body of {len} bytes; allowed {min}..={max}")]
    BodyLength { kind: &'static str, len: usize, min: usize, max: usize },
    /// A field runs past the end of the body.
    #[error("{kind} body truncated reading {field}")]
    Truncated { kind: &'static str, field: &'static str },
    /// The body is longer than its fields.
    #[error("{kind} body has {extra} trailing bytes")]
    TrailingBytes { kind: &'static str, extra: usize },
    /// `LayerData`'s payload length disagrees with its body length.
    #[error("payload length field {field} but {available} payload bytes in the body")]
    PayloadLength { field: u32, available: usize },
    /// `Hello` carries a malformed version-group label.
    #[error("hello version group: {0}")]
    VersionGroup(#[from] VersionGroupError),
    /// A reject or abort reason code this version does not know.
    #[error("unknown {what} code {code}")]
    UnknownReason { what: &'static str, code: u16 },
}

impl DecodeError {
    pub fn kind(&self) -> ErrorKind {
        ErrorKind::InvalidInput
    }
}

/// A frame that cannot be encoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    /// The payload does not fit the protocol's u32 length fields.
    #[error("payload of {len} bytes exceeds the protocol maximum of {max}", max = DecodeLimits::MAX_PAYLOAD)]
    PayloadTooLarge { len: usize },
}

/// Appends little-endian fields to a buffer.
struct Writer<'a>(&'a mut Vec<u8>);

impl Writer<'_> {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn bytes(&mut self, b: &[u8]) {
        self.0.extend_from_slice(b);
    }
}

/// Reads little-endian fields from a body, every read bounds-checked.
struct Reader<'a> {
    buf: &'a [u8],
    kind: &'static str,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, field: &'static str) -> Result<&'a [u8], DecodeError> {
        if self.buf.len() < n {
            return Err(DecodeError::Truncated { kind: self.kind, field });
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }
    fn array<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], DecodeError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N, field)?);
        Ok(a)
    }
    fn u8(&mut self, field: &'static str) -> Result<u8, DecodeError> {
        Ok(self.array::<1>(field)?[0])
    }
    fn u16(&mut self, field: &'static str) -> Result<u16, DecodeError> {
        self.array(field).map(u16::from_le_bytes)
    }
    fn u32(&mut self, field: &'static str) -> Result<u32, DecodeError> {
        self.array(field).map(u32::from_le_bytes)
    }
    fn u64(&mut self, field: &'static str) -> Result<u64, DecodeError> {
        self.array(field).map(u64::from_le_bytes)
    }
    fn finish(self) -> Result<(), DecodeError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(DecodeError::TrailingBytes { kind: self.kind, extra: self.buf.len() })
        }
    }
}

impl Frame {
    fn kind(&self) -> Kind {
        match self {
            Frame::Hello(_) => Kind::Hello,
            Frame::HelloAck(_) => Kind::HelloAck,
            Frame::HelloReject(_) => Kind::HelloReject,
            Frame::LayerData(_) => Kind::LayerData,
            Frame::Complete(_) => Kind::Complete,
            Frame::Ack(_) => Kind::Ack,
            Frame::Abort(_) => Kind::Abort,
        }
    }

    /// Bytes [`encode`](Self::encode) appends for this frame.
    pub fn encoded_len(&self) -> usize {
        HEADER_LEN
            + match self {
                Frame::Hello(h) => 4 + 32 + 1 + h.version_group.as_str().len(),
                Frame::HelloAck(_) => 4,
                Frame::HelloReject(_) => 2,
                Frame::LayerData(d) => LAYER_DATA_FIXED + d.payload.len(),
                Frame::Complete(_) => 16,
                Frame::Ack(_) => 12,
                Frame::Abort(_) => 14,
            }
    }

    /// Appends the frame to `out` and returns the bytes written. On error
    /// `out` is unchanged.
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<usize, EncodeError> {
        if let Frame::LayerData(d) = self {
            if d.payload.len() > DecodeLimits::MAX_PAYLOAD {
                return Err(EncodeError::PayloadTooLarge { len: d.payload.len() });
            }
        }
        let len = self.encoded_len();
        out.reserve(len);
        let start = out.len();
        let mut w = Writer(out);
        w.bytes(&MAGIC);
        w.u8(self.kind() as u8);
        w.u8(0);
        // Body length fits: the only variable parts are bounded above.
        w.u32((len - HEADER_LEN) as u32);
        match self {
            Frame::Hello(h) => {
                w.u32(h.protocol_version);
                w.bytes(h.fingerprint.as_bytes());
                // VersionGroup guarantees 1..=64 ASCII bytes.
                w.u8(h.version_group.as_str().len() as u8);
                w.bytes(h.version_group.as_str().as_bytes());
            }
            Frame::HelloAck(a) => w.u32(a.protocol_version),
            Frame::HelloReject(r) => w.u16(r.reason.code()),
            Frame::LayerData(d) => {
                w.u64(d.reservation);
                w.u32(d.generation);
                w.u32(d.layer);
                w.u32(d.first_block);
                w.u32(d.n_blocks);
                w.u32(d.checksum);
                w.u32(d.payload.len() as u32);
                w.bytes(&d.payload);
            }
            Frame::Complete(c) => {
                w.u64(c.reservation);
                w.u32(c.generation);
                w.u32(c.n_layers);
            }
            Frame::Ack(a) => {
                w.u64(a.reservation);
                w.u32(a.generation);
            }
            Frame::Abort(a) => {
                w.u64(a.reservation);
                w.u32(a.generation);
                w.u16(a.reason.code());
            }
        }
        debug_assert_eq!(out.len() - start, len);
        Ok(len)
    }

    /// Decodes one frame from the front of `buf`. Never panics, whatever the
    /// bytes; never allocates more than the frame's (limit-checked) size.
    pub fn decode(buf: &[u8], limits: &DecodeLimits) -> Result<Decoded, DecodeError> {
        let Some((kind, total)) = decode_header(buf, limits)? else {
            return Ok(Decoded::NeedMore { at_least: HEADER_LEN });
        };
        let Some(body) = buf.get(HEADER_LEN..total) else {
            return Ok(Decoded::NeedMore { at_least: total });
        };
        let frame = decode_body(kind, body)?;
        Ok(Decoded::Frame { frame, consumed: total })
    }

    /// Like [`decode`](Self::decode), but stops after a `LayerData`'s fixed
    /// fields: a transport then reads the payload straight into a buffer of
    /// its own ([`LayerDataHeader::with_payload`]) instead of buffering the
    /// frame and copying the payload out. Every check `decode` makes on a
    /// `LayerData` before its payload is made here too; other frames decode
    /// whole, exactly as `decode` decodes them.
    pub fn decode_head(buf: &[u8], limits: &DecodeLimits) -> Result<DecodedHead, DecodeError> {
        let Some((kind, total)) = decode_header(buf, limits)? else {
            return Ok(DecodedHead::NeedMore { at_least: HEADER_LEN });
        };
        if kind != Kind::LayerData {
            return Ok(match buf.get(HEADER_LEN..total) {
                Some(body) => DecodedHead::Frame { frame: decode_body(kind, body)?, consumed: total },
                None => DecodedHead::NeedMore { at_least: total },
            });
        }
        let Some(fixed) = buf.get(HEADER_LEN..LAYER_DATA_OVERHEAD) else {
            return Ok(DecodedHead::NeedMore { at_least: LAYER_DATA_OVERHEAD });
        };
        let mut r = Reader { buf: fixed, kind: kind.name() };
        let (reservation, generation, layer) = (r.u64("reservation")?, r.u32("generation")?, r.u32("layer")?);
        let (first_block, n_blocks, checksum) = (r.u32("first_block")?, r.u32("n_blocks")?, r.u32("checksum")?);
        let field = r.u32("payload_len")?;
        let available = total - LAYER_DATA_OVERHEAD;
        if field as usize != available {
            return Err(DecodeError::PayloadLength { field, available });
        }
        let header =
            LayerDataHeader { reservation, generation, layer, first_block, n_blocks, checksum, payload_len: available };
        Ok(DecodedHead::LayerData { header, consumed: LAYER_DATA_OVERHEAD })
    }
}

/// Result of [`Frame::decode_head`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecodedHead {
    /// A whole frame other than `LayerData`, and the bytes it used.
    Frame { frame: Frame, consumed: usize },
    /// A `LayerData` up to its payload: the `header.payload_len` payload
    /// bytes follow the first `consumed` bytes of the buffer.
    LayerData { header: LayerDataHeader, consumed: usize },
    /// The buffer holds a valid prefix; at least `at_least` bytes in total
    /// are needed before decoding can proceed.
    NeedMore { at_least: usize },
}

/// Checks the 8-byte header at the front of `buf` (magic, kind, reserved
/// byte, body length against the limits) and returns the kind and the
/// frame's total length; `None` while fewer than 8 bytes are there.
fn decode_header(buf: &[u8], limits: &DecodeLimits) -> Result<Option<(Kind, usize)>, DecodeError> {
    let seen = buf.len().min(MAGIC.len());
    if buf[..seen] != MAGIC[..seen] {
        return Err(DecodeError::BadMagic { found: buf[..seen].to_vec() });
    }
    let Some(header) = buf.get(..HEADER_LEN) else {
        return Ok(None);
    };
    let kind = Kind::from_u8(header[2]).ok_or(DecodeError::UnknownKind(header[2]))?;
    if header[3] != 0 {
        return Err(DecodeError::Reserved(header[3]));
    }
    let body_len = u32::from_le_bytes([header[4], header[5], header[6], header[7]]) as usize;
    let (min, max) = kind.body_range(limits);
    if !(min..=max).contains(&body_len) {
        return Err(DecodeError::BodyLength { kind: kind.name(), len: body_len, min, max });
    }
    // Only a 32-bit target could overflow here; refuse rather than wrap.
    match HEADER_LEN.checked_add(body_len) {
        Some(total) => Ok(Some((kind, total))),
        None => Err(DecodeError::BodyLength { kind: kind.name(), len: body_len, min, max }),
    }
}

fn decode_body(kind: Kind, body: &[u8]) -> Result<Frame, DecodeError> {
    let mut r = Reader { buf: body, kind: kind.name() };
    let frame = match kind {
        Kind::Hello => {
            let protocol_version = r.u32("protocol_version")?;
            let fingerprint = LayoutFingerprint::from_bytes(r.array("fingerprint")?);
            let n = r.u8("version_group length")? as usize;
            let version_group = VersionGroup::from_bytes(r.take(n, "version_group")?)?;
            // Later versions may append fields: the frozen prefix is all v1 reads.
            return Ok(Frame::Hello(Hello { version_group, fingerprint, protocol_version }));
        }
        Kind::HelloAck => Frame::HelloAck(HelloAck { protocol_version: r.u32("protocol_version")? }),
        Kind::HelloReject => {
            let code = r.u16("reason")?;
            let reason = RejectReason::from_code(code).ok_or(DecodeError::UnknownReason { what: "reject", code })?;
            Frame::HelloReject(HelloReject { reason })
        }
        Kind::LayerData => {
            let reservation = r.u64("reservation")?;
            let generation = r.u32("generation")?;
            let layer = r.u32("layer")?;
            let first_block = r.u32("first_block")?;
            let n_blocks = r.u32("n_blocks")?;
            let checksum = r.u32("checksum")?;
            let field = r.u32("payload_len")?;
            if field as usize != r.buf.len() {
                return Err(DecodeError::PayloadLength { field, available: r.buf.len() });
            }
            let payload = r.take(field as usize, "payload")?.to_vec();
            Frame::LayerData(LayerData { reservation, generation, layer, first_block, n_blocks, checksum, payload })
        }
        Kind::Complete => Frame::Complete(Complete {
            reservation: r.u64("reservation")?,
            generation: r.u32("generation")?,
            n_layers: r.u32("n_layers")?,
        }),
        Kind::Ack => Frame::Ack(Ack { reservation: r.u64("reservation")?, generation: r.u32("generation")? }),
        Kind::Abort => {
            let reservation = r.u64("reservation")?;
            let generation = r.u32("generation")?;
            let code = r.u16("reason")?;
            let reason = AbortReason::from_code(code).ok_or(DecodeError::UnknownReason { what: "abort", code })?;
            Frame::Abort(Abort { reservation, generation, reason })
        }
    };
    r.finish()?;
    Ok(frame)
}

#[cfg(test)]
mod tests;
