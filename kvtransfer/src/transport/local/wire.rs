//! Messages on the local transport's Unix socket.
//!
//! Two families share the socket, told apart by their magic:
//! - `"tK"`: the protocol's own [`Frame`]s, in the [`frame`](crate::frame)
//!   codec: `Hello`, `HelloAck`, `HelloReject`, `Complete`, `Ack`, `Abort`.
//!   A `LayerData` never travels here (its payload goes through shared
//!   memory); one that does is decoded with an empty payload and refused by
//!   the server.
//! - `"tS"`: this transport's messages, the same 8-byte header shape
//!   (`magic | kind: u8 | reserved: u8 = 0 | body_len: u32 LE | body`) and
//!   fixed-size bodies:
//!
//! | kind | message | body |
//! |---|---|---|
//! | 1 | `Ring` (+ the memfd as `SCM_RIGHTS`) | `slots: u32, slot_bytes: u32` |
//! | 2 | `RingAck` | empty |
//! | 3 | `RingReject` | `reason: u16` |
//! | 4 | `Data` | `slot: u32, reservation: u64, generation: u32, layer: u32, first_block: u32, n_blocks: u32, crc32c: u32, len: u32` |
//! | 5 | `Credit` | `slot: u32` |
//!
//! `Data` is `LayerData` with the payload replaced by "`len` bytes in
//! `slot`". Decoding never panics and never allocates more than a `Hello`.

use crate::frame::{DecodeError, DecodeLimits, Decoded, Frame, LayerDataHeader};

const FRAME_MAGIC: [u8; 2] = *b"tK";
const LOCAL_MAGIC: [u8; 2] = *b"tS";
const HEADER_LEN: usize = 8;
/// Largest message on the socket: a `Hello` (header + at most 1 KiB body).
pub(super) const MAX_MESSAGE: usize = HEADER_LEN + 1024;

/// The sender's shared-memory ring, as it announces it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingSpec {
    pub slots: u32,
    /// Most payload bytes one slot holds (K and V of one frame).
    pub slot_bytes: u32,
}

/// A `LayerData` frame whose payload lies in a ring slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct SlotData {
    pub slot: u32,
    /// `payload_len` is the number of bytes in the slot.
    pub header: LayerDataHeader,
}

/// Why a server refused the sender's ring. Codes are stable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum RingRefusal {
    /// No file descriptor (or more than one) came with the `Ring` message.
    #[error("the Ring message did not carry exactly one file descriptor")]
    NoFd,
    /// The descriptor is not a sealable shared-memory file (a memfd on tmpfs).
    #[error("the descriptor is not a sealable shared-memory file")]
    NotMemfd,
    /// The file is not sealed against shrinking, so mapping it could fault
    /// (SIGBUS) when the sender truncates it.
    #[error("the ring is not sealed against shrinking")]
    NotSealed,
    /// The file's size is not what `slots` and `slot_bytes` imply.
    #[error("the ring's size does not match its slots")]
    Size,
    /// More slots, larger slots or a larger ring than the server accepts.
    #[error("the ring exceeds the server's limits")]
    Limits,
    /// Mapping the ring failed.
    #[error("mapping the ring failed")]
    Map,
}

impl RingRefusal {
    pub const ALL: [RingRefusal; 6] =
        [Self::NoFd, Self::NotMemfd, Self::NotSealed, Self::Size, Self::Limits, Self::Map];

    fn code(self) -> u16 {
        match self {
            Self::NoFd => 1,
            Self::NotMemfd => 2,
            Self::NotSealed => 3,
            Self::Size => 4,
            Self::Limits => 5,
            Self::Map => 6,
        }
    }

    fn from_code(c: u16) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.code() == c)
    }
}

/// One message on the socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Msg {
    Frame(Frame),
    Ring(RingSpec),
    RingAck,
    RingReject(RingRefusal),
    Data(SlotData),
    Credit(u32),
}

/// Bytes that are not a message; the stream cannot be resynchronised.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// A protocol frame that does not decode.
    #[error("{0}")]
    Frame(DecodeError),
    /// Neither a protocol frame nor a local message.
    #[error("bad message magic {0:02x?}")]
    BadMagic([u8; 2]),
    #[error("unknown local message kind {0}")]
    UnknownKind(u8),
    #[error("reserved header byte is {0:#04x}, must be 0")]
    Reserved(u8),
    #[error("{kind} body of {len} bytes; expected {expected}")]
    BodyLength { kind: &'static str, len: usize, expected: usize },
    #[error("unknown ring refusal code {0}")]
    UnknownRefusal(u16),
}

/// Body lengths of the local messages, by kind.
fn local_body(kind: u8) -> Option<(&'static str, usize)> {
    Some(match kind {
        1 => ("Ring", 8),
        2 => ("RingAck", 0),
        3 => ("RingReject", 2),
        4 => ("Data", 36),
        5 => ("Credit", 4),
        _ => return None,
    })
}

impl Msg {
    /// Appends the message to `out`.
    pub(super) fn encode(&self, out: &mut Vec<u8>) {
        let (kind, body): (u8, &[&[u8]]) = match self {
            Msg::Frame(f) => {
                // Only a LayerData can fail to encode, and none is sent here.
                let _ = f.encode(out);
                return;
            }
            Msg::Ring(r) => (1, &[&r.slots.to_le_bytes(), &r.slot_bytes.to_le_bytes()]),
            Msg::RingAck => (2, &[]),
            Msg::RingReject(r) => (3, &[&r.code().to_le_bytes()]),
            Msg::Data(d) => {
                let h = &d.header;
                // The slot bounds the length far below u32::MAX (checked by both ends).
                let len = u32::try_from(h.payload_len).unwrap_or(u32::MAX);
                header(out, 4, 36);
                out.extend_from_slice(&d.slot.to_le_bytes());
                out.extend_from_slice(&h.reservation.to_le_bytes());
                for v in [h.generation, h.layer, h.first_block, h.n_blocks, h.checksum, len] {
                    out.extend_from_slice(&v.to_le_bytes());
                }
                return;
            }
            Msg::Credit(slot) => (5, &[&slot.to_le_bytes()]),
        };
        header(out, kind, body.iter().map(|b| b.len()).sum());
        for b in body {
            out.extend_from_slice(b);
        }
    }

    /// Decodes one message from the front of `buf`: `Ok(None)` while more
    /// bytes are needed, else the message and the bytes it used.
    pub(super) fn decode(buf: &[u8]) -> Result<Option<(Msg, usize)>, WireError> {
        let seen = buf.len().min(2);
        if buf[..seen] != FRAME_MAGIC[..seen] && buf[..seen] != LOCAL_MAGIC[..seen] {
            let mut m = [0; 2];
            m[..seen].copy_from_slice(&buf[..seen]);
            return Err(WireError::BadMagic(m));
        }
        if seen < 2 {
            return Ok(None);
        }
        if buf[..2] == FRAME_MAGIC {
            // No inline payloads on this transport: a LayerData decodes only
            // with an empty one, which the server then refuses.
            let limits = DecodeLimits { max_payload_bytes: 0 };
            return match Frame::decode(buf, &limits).map_err(WireError::Frame)? {
                Decoded::Frame { frame, consumed } => Ok(Some((Msg::Frame(frame), consumed))),
                Decoded::NeedMore { .. } => Ok(None),
            };
        }
        let Some(h) = buf.get(..HEADER_LEN) else { return Ok(None) };
        let (name, expected) = local_body(h[2]).ok_or(WireError::UnknownKind(h[2]))?;
        if h[3] != 0 {
            return Err(WireError::Reserved(h[3]));
        }
        let len = u32::from_le_bytes([h[4], h[5], h[6], h[7]]) as usize;
        if len != expected {
            return Err(WireError::BodyLength { kind: name, len, expected });
        }
        let Some(body) = buf.get(HEADER_LEN..HEADER_LEN + len) else { return Ok(None) };
        let u32_at = |i: usize| u32::from_le_bytes([body[i], body[i + 1], body[i + 2], body[i + 3]]);
        let msg = match h[2] {
            1 => Msg::Ring(RingSpec { slots: u32_at(0), slot_bytes: u32_at(4) }),
            2 => Msg::RingAck,
            3 => {
                let code = u16::from_le_bytes([body[0], body[1]]);
                Msg::RingReject(RingRefusal::from_code(code).ok_or(WireError::UnknownRefusal(code))?)
            }
            4 => {
                let reservation = u64::from(u32_at(4)) | (u64::from(u32_at(8)) << 32);
                Msg::Data(SlotData {
                    slot: u32_at(0),
                    header: LayerDataHeader {
                        reservation,
                        generation: u32_at(12),
                        layer: u32_at(16),
                        first_block: u32_at(20),
                        n_blocks: u32_at(24),
                        checksum: u32_at(28),
                        payload_len: u32_at(32) as usize,
                    },
                })
            }
            _ => Msg::Credit(u32_at(0)),
        };
        Ok(Some((msg, HEADER_LEN + len)))
    }

    /// Name for errors and close reasons.
    pub(super) fn name(&self) -> &'static str {
        match self {
            Msg::Frame(f) => crate::transport::stream::frame_name(f),
            Msg::Ring(_) => "Ring",
            Msg::RingAck => "RingAck",
            Msg::RingReject(_) => "RingReject",
            Msg::Data(_) => "Data",
            Msg::Credit(_) => "Credit",
        }
    }
}

fn header(out: &mut Vec<u8>, kind: u8, body_len: usize) {
    out.extend_from_slice(&LOCAL_MAGIC);
    out.push(kind);
    out.push(0);
    // Local bodies are at most 36 bytes.
    out.extend_from_slice(&(body_len as u32).to_le_bytes());
}

/// A read buffer that yields whole messages; holds at most one partial
/// message plus what one read brought.
#[derive(Debug)]
pub(super) struct MsgReader {
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

impl MsgReader {
    pub(super) fn new() -> Self {
        Self { buf: vec![0; 4 * MAX_MESSAGE], start: 0, end: 0 }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.start == self.end
    }

    /// The next message already buffered, if any.
    pub(super) fn decode(&mut self) -> Result<Option<Msg>, WireError> {
        if self.is_empty() {
            (self.start, self.end) = (0, 0);
            return Ok(None);
        }
        match Msg::decode(&self.buf[self.start..self.end])? {
            Some((msg, used)) => {
                self.start += used;
                Ok(Some(msg))
            }
            None => Ok(None),
        }
    }

    /// Room to read into (at least one whole message's worth).
    pub(super) fn space(&mut self) -> &mut [u8] {
        if self.buf.len() - self.end < MAX_MESSAGE {
            self.buf.copy_within(self.start..self.end, 0);
            (self.start, self.end) = (0, self.end - self.start);
        }
        &mut self.buf[self.end..]
    }

    pub(super) fn advance(&mut self, n: usize) {
        self.end = (self.end + n).min(self.buf.len());
    }
}

/// Decodes every message at the front of `data` as the server's reader does, and checks what
/// it accepts: decoding never panics or claims more bytes than it has, and an accepted
/// message re-encodes to bytes that decode back to the same message — the very bytes it
/// was decoded from, except a `Hello`, which tolerates (and drops) bytes a later protocol
/// version appends. Panics on a violation: the fuzz target (`fuzz/fuzz_targets/local_wire.rs`)
/// and the mutation test drive it with hostile bytes. Returns how many messages it accepted
/// and whether it stopped on a typed error (rather than needing more bytes).
#[doc(hidden)]
pub fn check_decode(data: &[u8]) -> (usize, bool) {
    let mut rest = data;
    let mut accepted = 0;
    loop {
        match Msg::decode(rest) {
            Ok(Some((msg, used))) => {
                assert!(used > 0 && used <= rest.len(), "consumed {used} of {}", rest.len());
                assert!(used <= MAX_MESSAGE, "a {used}-byte message is over the {MAX_MESSAGE}-byte bound");
                let mut again = Vec::new();
                msg.encode(&mut again);
                match Msg::decode(&again) {
                    Ok(Some((back, n))) => {
                        assert_eq!(back, msg, "encode -> decode changed the message");
                        assert_eq!(n, again.len(), "re-encoded {} bytes, decoded {n}", again.len());
                    }
                    other => panic!("re-encoded {} does not decode: {other:?}", msg.name()),
                }
                if !matches!(msg, Msg::Frame(Frame::Hello(_))) {
                    assert_eq!(&again[..], &rest[..used], "re-encoding {} differs from its bytes", msg.name());
                }
                accepted += 1;
                rest = &rest[used..];
            }
            Ok(None) => return (accepted, false),
            Err(_) => return (accepted, true),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::{Abort, AbortReason, Complete, LayerData};

    fn samples() -> Vec<Msg> {
        let header = LayerDataHeader {
            reservation: 0x0102_0304_0506_0708,
            generation: 9,
            layer: 29,
            first_block: 40,
            n_blocks: 42,
            checksum: 0xdead_beef,
            payload_len: 258_048,
        };
        vec![
            Msg::Ring(RingSpec { slots: 8, slot_bytes: 1 << 18 }),
            Msg::RingAck,
            Msg::RingReject(RingRefusal::NotSealed),
            Msg::Data(SlotData { slot: 7, header }),
            Msg::Credit(3),
            Msg::Frame(Frame::Complete(Complete { reservation: 5, generation: 6, n_layers: 30 })),
            Msg::Frame(Frame::Abort(Abort { reservation: 5, generation: 6, reason: AbortReason::Cancelled })),
        ]
    }

    #[test]
    fn every_message_round_trips_byte_by_byte() {
        let mut wire = Vec::new();
        for m in samples() {
            m.encode(&mut wire);
        }
        // Fed one byte at a time, the reader yields exactly the messages sent.
        let mut r = MsgReader::new();
        let mut got = Vec::new();
        for &b in &wire {
            r.space()[0] = b;
            r.advance(1);
            while let Some(m) = r.decode().expect("valid") {
                got.push(m);
            }
        }
        assert_eq!(got, samples());
        assert!(r.is_empty());
    }

    #[test]
    fn refuses_bad_bytes_without_panicking() {
        assert_eq!(Msg::decode(b"GET /"), Err(WireError::BadMagic(*b"GE")));
        assert_eq!(Msg::decode(b"tS\x09\0\0\0\0\0"), Err(WireError::UnknownKind(9)));
        assert_eq!(Msg::decode(b"tS\x05\x01\x04\0\0\0"), Err(WireError::Reserved(1)));
        assert!(matches!(Msg::decode(b"tS\x05\0\x05\0\0\0\0\0\0\0\0"), Err(WireError::BodyLength { .. })));
        assert_eq!(Msg::decode(b"tS\x03\0\x02\0\0\0\x63\0"), Err(WireError::UnknownRefusal(0x63)));
        assert_eq!(Msg::decode(b"t"), Ok(None));
        // An inline LayerData payload is refused by the frame decoder's limit.
        let mut wire = Vec::new();
        Frame::LayerData(LayerData::new(1, 1, 0, 0, 1, vec![1; 16])).encode(&mut wire).expect("encode");
        assert!(matches!(Msg::decode(&wire), Err(WireError::Frame(DecodeError::BodyLength { .. }))));
        // Every prefix of a valid message asks for more; none panics.
        let mut one = Vec::new();
        samples()[3].encode(&mut one);
        for n in 0..one.len() {
            assert_eq!(Msg::decode(&one[..n]), Ok(None), "prefix of {n} bytes");
        }
    }

    /// Mutation test: every single-byte corruption (three bit patterns at every offset), every
    /// truncation and seeded random splices of a stream of valid messages go through the same
    /// checks as the fuzz target; corruptions of the header are refused with a typed error.
    #[test]
    fn mutated_messages_are_refused_or_round_trip_and_never_panic() {
        let mut wire = Vec::new();
        for m in samples() {
            m.encode(&mut wire);
        }
        assert_eq!(check_decode(&wire), (samples().len(), false), "the clean stream decodes whole");
        let mut refused = 0;
        for at in 0..wire.len() {
            for flip in [0x01u8, 0x80, 0xff] {
                let mut bad = wire.clone();
                bad[at] ^= flip;
                refused += usize::from(check_decode(&bad).1);
            }
        }
        for n in 0..wire.len() {
            assert!(!check_decode(&wire[..n]).1, "a truncation is a need for more bytes, not an error");
        }
        // Every magic byte flipped is a typed refusal, so at least 2 x 3 per message.
        assert!(refused >= 6 * samples().len(), "only {refused} corruptions were refused");
        let mut rng = types::rng::XorShift64::new(0x9e37_79b9_7f4a_7c15);
        for _ in 0..2_000 {
            let x = rng.next_u64();
            let (a, b) = ((x % wire.len() as u64) as usize, ((x >> 20) % wire.len() as u64) as usize);
            let (lo, hi) = (a.min(b), a.max(b));
            // Splice: a piece of the stream moved to its front, then bytes repeated.
            let mut bad = wire[lo..hi].to_vec();
            bad.extend_from_slice(&wire[..lo]);
            bad.extend_from_slice(&wire[hi..]);
            bad.extend_from_slice(&wire[lo..hi]);
            check_decode(&bad);
        }
        assert_eq!(Msg::decode(b"\0\0"), Err(WireError::BadMagic([0, 0])));
    }
}
