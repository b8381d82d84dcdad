//! The UCX transport's active messages.
//!
//! Every message is one active message: the AM header is `kind: u8,
//! conn: u64 LE` (the connection id the server assigned in its `Key`; 0
//! before that), the AM data is the body. Senders use AM id [`TO_SERVER`],
//! the server [`TO_SENDER`]. Protocol frames (`Hello`, `HelloAck`,
//! `HelloReject`, `Complete`, `Ack`, `Abort`) travel in the
//! [`frame`](crate::frame) codec as the body of a `Frame` message; a
//! `LayerData` never does (its payload lands by one-sided put).
//!
//! | kind | direction | message | body |
//! |---|---|---|---|
//! | 1 | → server | `Hello` | `addr_len: u16, addr (the sender's UCX worker address), pid: u32, start: u64, Hello frame` |
//! | 2 | → server | `Claim` | `reservation: u64, generation: u32` |
//! | 3 | → server | `Layer` | `reservation: u64, generation: u32, layer: u32, first_block: u32, n_blocks: u32, crc32c: u32, payload_len: u32` |
//! | 4 | both | `Frame` | a protocol frame |
//! | 5 | → server | `Fenced` | `reservation: u64, generation: u32` |
//! | 6 | → server | `Bye` | empty |
//! | 7 | → sender | `Key` | `base: u64, packed rkey` |
//! | 8 | → sender | `Grant` | `reservation: u64, generation: u32, offset: u64, n_blocks: u32` |
//! | 9 | → sender | `Refused` | `reservation: u64, generation: u32, code: u16` ([`LandingRefusal`]) |
//! | 10 | → sender | `PoolKey` | `base: u64, num_blocks: u32, packed rkey` (the decode pool's) |
//! | 11 | → server | `ClaimDirect` | `reservation: u64, generation: u32` |
//! | 12 | → sender | `Blocks` | `reservation: u64, generation: u32, block: u32 ...` (pool block ids) |
//!
//! `pid` and `start` name the sender's process (its id and its start time
//! in clock ticks since boot, `/proc/<pid>/stat` field 22; 0 and 0 when
//! unknown): the server lets a sender write its pool directly only if it
//! can see that process, so that it can tell when it is gone.
//!
//! Decoding never panics: a short or long body, an unknown kind or an
//! undecodable frame is a typed [`WireError`].

use crate::frame::{DecodeError, DecodeLimits, Decoded, Frame, LayerDataHeader};
use crate::session::{Reservation, ReservationId};
use crate::ErrorKind;

/// AM id of messages to the decode side's server.
pub(super) const TO_SERVER: u16 = 0x7431;
/// AM id of messages to a sender.
pub(super) const TO_SENDER: u16 = 0x7432;
/// Largest body accepted: a `Hello` with a worker address (UCX's are a few
/// hundred bytes) or a `Key` with a packed rkey.
const MAX_BODY: usize = 16 << 10;
/// Most blocks a `Blocks` grant names (8 KiB of ids: an eager message on
/// every transport). A larger reservation lands through the landing region.
pub(super) const MAX_DIRECT_BLOCKS: usize = 2048;

/// Why the server would not give a reservation landing space. Codes are stable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum LandingRefusal {
    /// The landing region has no free range that large now (live transfers
    /// and quarantined ranges hold it): back-pressure, try later or elsewhere.
    #[error("the landing region has no room for the reservation now")]
    Full,
    /// The reservation's KV is larger than the whole landing region.
    #[error("the reservation's KV is larger than the landing region")]
    TooLarge,
    /// The reservation is not receiving (unknown, ended, or another generation).
    #[error("the reservation is not receiving")]
    NotReceiving,
    /// Another connection already holds the reservation's landing range.
    #[error("another sender holds the reservation's landing range")]
    Claimed,
}

impl LandingRefusal {
    pub const ALL: [Self; 4] = [Self::Full, Self::TooLarge, Self::NotReceiving, Self::Claimed];

    /// Stable label for logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Full => "landing_full",
            Self::TooLarge => "landing_too_large",
            Self::NotReceiving => "not_receiving",
            Self::Claimed => "claimed",
        }
    }

    pub fn kind(self) -> ErrorKind {
        match self {
            Self::Full => ErrorKind::Overloaded,
            Self::NotReceiving => ErrorKind::Retryable,
            Self::TooLarge | Self::Claimed => ErrorKind::InvalidInput,
        }
    }

    fn code(self) -> u16 {
        match self {
            Self::Full => 1,
            Self::TooLarge => 2,
            Self::NotReceiving => 3,
            Self::Claimed => 4,
        }
    }

    fn from_code(c: u16) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.code() == c)
    }
}

/// Where a reservation's KV lands: bytes `offset..` of the landing region,
/// laid out layer by layer, each layer all blocks' K then all blocks' V.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Grant {
    pub reservation: Reservation,
    pub offset: u64,
    pub n_blocks: u32,
}

/// A process as `/proc` names it: its id and its start time (clock ticks
/// after boot), which together survive pid reuse.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ProcessId {
    pub pid: u32,
    pub start: u64,
}

/// One message, either direction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Msg {
    Hello { addr: Vec<u8>, process: ProcessId, frame: Frame },
    Claim(Reservation),
    Layer(LayerDataHeader),
    Frame(Frame),
    Fenced(Reservation),
    Bye,
    Key { base: u64, rkey: Vec<u8> },
    Grant(Grant),
    Refused { reservation: Reservation, refusal: LandingRefusal },
    PoolKey { base: u64, num_blocks: u32, rkey: Vec<u8> },
    ClaimDirect(Reservation),
    Blocks { reservation: Reservation, blocks: Vec<u32> },
}

/// A message that does not decode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("AM header of {0} bytes; 9 expected")]
    Header(usize),
    #[error("unknown message kind {0}")]
    UnknownKind(u8),
    #[error("{kind} body of {len} bytes is malformed")]
    Body { kind: &'static str, len: usize },
    #[error("frame: {0}")]
    Frame(DecodeError),
    #[error("unknown landing refusal code {0}")]
    UnknownRefusal(u16),
    /// The sender used UCX's rendezvous protocol (a body too large for eager).
    #[error("a rendezvous active message (bodies are small and eager)")]
    Rendezvous,
}

impl Msg {
    fn kind(&self) -> u8 {
        match self {
            Msg::Hello { .. } => 1,
            Msg::Claim(_) => 2,
            Msg::Layer(_) => 3,
            Msg::Frame(_) => 4,
            Msg::Fenced(_) => 5,
            Msg::Bye => 6,
            Msg::Key { .. } => 7,
            Msg::Grant(_) => 8,
            Msg::Refused { .. } => 9,
            Msg::PoolKey { .. } => 10,
            Msg::ClaimDirect(_) => 11,
            Msg::Blocks { .. } => 12,
        }
    }

    pub(super) fn name(&self) -> &'static str {
        match self {
            Msg::Hello { .. } => "Hello",
            Msg::Claim(_) => "Claim",
            Msg::Layer(_) => "Layer",
            Msg::Frame(_) => "Frame",
            Msg::Fenced(_) => "Fenced",
            Msg::Bye => "Bye",
            Msg::Key { .. } => "Key",
            Msg::Grant(_) => "Grant",
            Msg::Refused { .. } => "Refused",
            Msg::PoolKey { .. } => "PoolKey",
            Msg::ClaimDirect(_) => "ClaimDirect",
            Msg::Blocks { .. } => "Blocks",
        }
    }

    /// The AM header and data for this message on connection `conn`.
    pub(super) fn encode(&self, conn: u64) -> (Vec<u8>, Vec<u8>) {
        let mut header = Vec::with_capacity(9);
        header.push(self.kind());
        header.extend_from_slice(&conn.to_le_bytes());
        let mut body = Vec::new();
        let res = |body: &mut Vec<u8>, r: &Reservation| {
            body.extend_from_slice(&r.id.0.to_le_bytes());
            body.extend_from_slice(&r.generation.to_le_bytes());
        };
        match self {
            Msg::Hello { addr, process, frame } => {
                // Addresses are far below 64 KiB (bounded by MAX_BODY on decode).
                body.extend_from_slice(&(addr.len().min(u16::MAX as usize) as u16).to_le_bytes());
                body.extend_from_slice(addr);
                body.extend_from_slice(&process.pid.to_le_bytes());
                body.extend_from_slice(&process.start.to_le_bytes());
                // Only a LayerData can fail to encode, and none travels here.
                let _ = frame.encode(&mut body);
            }
            Msg::Claim(r) | Msg::Fenced(r) | Msg::ClaimDirect(r) => res(&mut body, r),
            Msg::Layer(h) => {
                body.extend_from_slice(&h.reservation.to_le_bytes());
                // The payload is bounded by the landing region (u32 checked by the sender).
                let len = u32::try_from(h.payload_len).unwrap_or(u32::MAX);
                for v in [h.generation, h.layer, h.first_block, h.n_blocks, h.checksum, len] {
                    body.extend_from_slice(&v.to_le_bytes());
                }
            }
            Msg::Frame(f) => {
                let _ = f.encode(&mut body);
            }
            Msg::Bye => {}
            Msg::Key { base, rkey } => {
                body.extend_from_slice(&base.to_le_bytes());
                body.extend_from_slice(rkey);
            }
            Msg::Grant(g) => {
                res(&mut body, &g.reservation);
                body.extend_from_slice(&g.offset.to_le_bytes());
                body.extend_from_slice(&g.n_blocks.to_le_bytes());
            }
            Msg::Refused { reservation, refusal } => {
                res(&mut body, reservation);
                body.extend_from_slice(&refusal.code().to_le_bytes());
            }
            Msg::PoolKey { base, num_blocks, rkey } => {
                body.extend_from_slice(&base.to_le_bytes());
                body.extend_from_slice(&num_blocks.to_le_bytes());
                body.extend_from_slice(rkey);
            }
            Msg::Blocks { reservation, blocks } => {
                res(&mut body, reservation);
                for b in blocks {
                    body.extend_from_slice(&b.to_le_bytes());
                }
            }
        }
        (header, body)
    }

    /// Decodes one active message: its connection id and the message.
    pub(super) fn decode(header: &[u8], body: &[u8]) -> Result<(u64, Msg), WireError> {
        let [kind, c @ ..] = header else { return Err(WireError::Header(header.len())) };
        let conn = <[u8; 8]>::try_from(c).map(u64::from_le_bytes).map_err(|_| WireError::Header(header.len()))?;
        let name = match kind {
            1 => "Hello",
            2 => "Claim",
            3 => "Layer",
            4 => "Frame",
            5 => "Fenced",
            6 => "Bye",
            7 => "Key",
            8 => "Grant",
            9 => "Refused",
            10 => "PoolKey",
            11 => "ClaimDirect",
            12 => "Blocks",
            k => return Err(WireError::UnknownKind(*k)),
        };
        let bad = || WireError::Body { kind: name, len: body.len() };
        if body.len() > MAX_BODY {
            return Err(bad());
        }
        let fixed = |n: usize| if body.len() == n { Ok(()) } else { Err(bad()) };
        let u32_at = |i: usize| u32::from_le_bytes([body[i], body[i + 1], body[i + 2], body[i + 3]]);
        let u64_at = |i: usize| u64::from(u32_at(i)) | (u64::from(u32_at(i + 4)) << 32);
        let res_at = |i: usize| Reservation { id: ReservationId(u64_at(i)), generation: u32_at(i + 8) };
        let msg = match kind {
            1 => {
                let (len, rest) = body.split_at_checked(2).ok_or_else(bad)?;
                let len = usize::from(u16::from_le_bytes([len[0], len[1]]));
                let (addr, rest) = rest.split_at_checked(len).ok_or_else(bad)?;
                let (p, frame) = rest.split_at_checked(12).ok_or_else(bad)?;
                let start = u64::from_le_bytes([p[4], p[5], p[6], p[7], p[8], p[9], p[10], p[11]]);
                let process = ProcessId { pid: u32::from_le_bytes([p[0], p[1], p[2], p[3]]), start };
                Msg::Hello { addr: addr.to_vec(), process, frame: whole_frame(frame)? }
            }
            2 => {
                fixed(12)?;
                Msg::Claim(res_at(0))
            }
            3 => {
                fixed(32)?;
                Msg::Layer(LayerDataHeader {
                    reservation: u64_at(0),
                    generation: u32_at(8),
                    layer: u32_at(12),
                    first_block: u32_at(16),
                    n_blocks: u32_at(20),
                    checksum: u32_at(24),
                    payload_len: u32_at(28) as usize,
                })
            }
            4 => Msg::Frame(whole_frame(body)?),
            5 => {
                fixed(12)?;
                Msg::Fenced(res_at(0))
            }
            6 => {
                fixed(0)?;
                Msg::Bye
            }
            7 => {
                if body.len() <= 8 {
                    return Err(bad());
                }
                Msg::Key { base: u64_at(0), rkey: body[8..].to_vec() }
            }
            8 => {
                fixed(24)?;
                Msg::Grant(Grant { reservation: res_at(0), offset: u64_at(12), n_blocks: u32_at(20) })
            }
            10 => {
                if body.len() <= 12 {
                    return Err(bad());
                }
                Msg::PoolKey { base: u64_at(0), num_blocks: u32_at(8), rkey: body[12..].to_vec() }
            }
            11 => {
                fixed(12)?;
                Msg::ClaimDirect(res_at(0))
            }
            12 => {
                let n = body.len().checked_sub(12).filter(|n| n % 4 == 0).ok_or_else(bad)? / 4;
                if n == 0 || n > MAX_DIRECT_BLOCKS {
                    return Err(bad());
                }
                Msg::Blocks { reservation: res_at(0), blocks: (0..n).map(|i| u32_at(12 + 4 * i)).collect() }
            }
            _ => {
                fixed(14)?;
                let code = u16::from_le_bytes([body[12], body[13]]);
                let refusal = LandingRefusal::from_code(code).ok_or(WireError::UnknownRefusal(code))?;
                Msg::Refused { reservation: res_at(0), refusal }
            }
        };
        Ok((conn, msg))
    }
}

/// Decodes one active message as the receiving worker does — the first byte of `data`
/// (mod 16) is the header's length, the next that many bytes the header, the rest the
/// body — and checks what it accepts: decoding never panics, and an accepted message
/// re-encodes to a header and body that decode back to the same message and connection:
/// the very bytes it was decoded from, except a message carrying a `Hello` frame, which
/// tolerates (and drops) what a later protocol version appends. Panics on a violation:
/// the fuzz target (`fuzz/fuzz_targets/ucx_wire.rs`) and the mutation test drive it with
/// hostile bytes. Returns whether the message was accepted.
#[doc(hidden)]
pub fn check_decode(data: &[u8]) -> bool {
    let Some((&n, rest)) = data.split_first() else { return false };
    let (header, body) = rest.split_at(usize::from(n % 16).min(rest.len()));
    let Ok((conn, msg)) = Msg::decode(header, body) else { return false };
    let (h, b) = msg.encode(conn);
    assert_eq!(Msg::decode(&h, &b), Ok((conn, msg.clone())), "encode -> decode changed the {}", msg.name());
    assert_eq!(h, header, "re-encoding {} changed its header", msg.name());
    let hello = matches!(msg, Msg::Hello { .. } | Msg::Frame(Frame::Hello(_)));
    if !hello {
        assert_eq!(b, body, "re-encoding {} differs from its bytes", msg.name());
    }
    true
}

/// Exactly one protocol frame with no payload.
fn whole_frame(bytes: &[u8]) -> Result<Frame, WireError> {
    match Frame::decode(bytes, &DecodeLimits { max_payload_bytes: 0 }).map_err(WireError::Frame)? {
        Decoded::Frame { frame, consumed } if consumed == bytes.len() => Ok(frame),
        _ => Err(WireError::Body { kind: "Frame", len: bytes.len() }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::{Abort, AbortReason, Complete, Hello};
    use crate::{LayoutFingerprint, VersionGroup};

    fn r(id: u64, generation: u32) -> Reservation {
        Reservation { id: ReservationId(id), generation }
    }

    fn samples() -> Vec<Msg> {
        let hello = Frame::Hello(Hello {
            version_group: VersionGroup::new("smollm2").expect("label"),
            fingerprint: LayoutFingerprint::from_bytes([7; 32]),
            protocol_version: crate::PROTOCOL_VERSION,
        });
        vec![
            Msg::Hello { addr: vec![9; 300], process: ProcessId { pid: 4242, start: 1 << 40 }, frame: hello },
            Msg::Claim(r(3, 4)),
            Msg::Layer(LayerDataHeader {
                reservation: 0x0102_0304_0506_0708,
                generation: 9,
                layer: 29,
                first_block: 40,
                n_blocks: 2,
                checksum: 0xdead_beef,
                payload_len: 4096,
            }),
            Msg::Frame(Frame::Complete(Complete { reservation: 5, generation: 6, n_layers: 30 })),
            Msg::Frame(Frame::Abort(Abort { reservation: 5, generation: 6, reason: AbortReason::LeaseExpired })),
            Msg::Fenced(r(5, 6)),
            Msg::Bye,
            Msg::Key { base: 0x7f00_1234_5000, rkey: vec![1, 2, 3] },
            Msg::Grant(Grant { reservation: r(1, 2), offset: 1 << 20, n_blocks: 7 }),
            Msg::Refused { reservation: r(1, 2), refusal: LandingRefusal::Full },
            Msg::PoolKey { base: 0x7f00_0000_1000, num_blocks: 729, rkey: vec![4, 5, 6] },
            Msg::ClaimDirect(r(8, 9)),
            Msg::Blocks { reservation: r(8, 9), blocks: vec![3, 700, 12] },
        ]
    }

    #[test]
    fn every_message_round_trips() {
        for (i, m) in samples().into_iter().enumerate() {
            let (h, b) = m.encode(i as u64 + 100);
            assert_eq!(Msg::decode(&h, &b), Ok((i as u64 + 100, m)));
        }
    }

    /// `check_decode`'s input for a header and body.
    fn input(h: &[u8], b: &[u8]) -> Vec<u8> {
        let mut v = vec![h.len() as u8];
        v.extend_from_slice(h);
        v.extend_from_slice(b);
        v
    }

    /// Mutation test: every single-byte corruption (three bit patterns at every offset) and
    /// every truncation of each message, and seeded random splices of two messages, go
    /// through the same checks as the fuzz target; a corrupted kind byte or header length
    /// is refused.
    #[test]
    fn mutated_messages_are_refused_or_round_trip_and_never_panic() {
        let wires: Vec<Vec<u8>> = samples()
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let (h, b) = m.encode(i as u64 * 0x0101_0101 + 7);
                input(&h, &b)
            })
            .collect();
        let (mut accepted, mut refused) = (0, 0);
        for wire in &wires {
            assert!(check_decode(wire), "a clean message decodes");
            for at in 0..wire.len() {
                for flip in [0x01u8, 0x80, 0xff] {
                    let mut bad = wire.clone();
                    bad[at] ^= flip;
                    let ok = check_decode(&bad);
                    (accepted, refused) = (accepted + usize::from(ok), refused + usize::from(!ok));
                    if at <= 1 && flip == 0xff {
                        assert!(!ok, "a header length or kind of {:#x} is refused", bad[at]);
                    }
                }
            }
            for n in 0..wire.len() {
                check_decode(&wire[..n]);
            }
        }
        // Both outcomes, or the test proves little: a flipped id or offset is still a
        // message, a flipped kind or length is not.
        assert!(accepted > 100 && refused > 100, "accepted {accepted}, refused {refused}");
        let mut rng = types::rng::XorShift64::new(0x5eed_0c0d_ec00_0001);
        for _ in 0..5_000 {
            let x = rng.next_u64();
            let (a, b) = (&wires[(x % wires.len() as u64) as usize], &wires[((x >> 8) % wires.len() as u64) as usize]);
            let cut = ((x >> 16) % a.len() as u64) as usize;
            let mut bad = a[..cut].to_vec();
            bad.extend_from_slice(&b[((x >> 32) % b.len() as u64) as usize..]);
            check_decode(&bad);
        }
        assert!(!check_decode(&[]), "no bytes at all");
    }

    #[test]
    fn malformed_messages_are_typed_errors() {
        assert_eq!(Msg::decode(&[], &[]), Err(WireError::Header(0)));
        assert_eq!(Msg::decode(&[2, 0, 0], &[]), Err(WireError::Header(3)));
        assert_eq!(Msg::decode(&[42, 0, 0, 0, 0, 0, 0, 0, 0], &[]), Err(WireError::UnknownKind(42)));
        for m in samples() {
            let (h, b) = m.encode(1);
            for n in 0..b.len() {
                // Every truncation is refused (a Key's rkey may shrink and stay a Key).
                let key_tail = match m {
                    Msg::Key { .. } => n > 8,
                    Msg::PoolKey { .. } => n > 12,
                    // Whole block ids shorter: still a (smaller) grant.
                    Msg::Blocks { .. } => n > 12 && (n - 12) % 4 == 0,
                    _ => false,
                };
                if !key_tail {
                    assert!(Msg::decode(&h, &b[..n]).is_err(), "{} cut to {n} bytes", m.name());
                }
            }
            let mut long = b.clone();
            long.push(0);
            if !matches!(m, Msg::Key { .. } | Msg::Hello { .. } | Msg::PoolKey { .. }) {
                assert!(Msg::decode(&h, &long).is_err(), "{} with a trailing byte", m.name());
            }
        }
        let (h, mut b) = samples()[9].encode(1);
        b[12] = 0x63;
        assert_eq!(Msg::decode(&h, &b), Err(WireError::UnknownRefusal(0x63)));
        let too_many = Msg::Blocks { reservation: r(1, 1), blocks: vec![0; MAX_DIRECT_BLOCKS + 1] };
        let (h, b) = too_many.encode(1);
        assert!(Msg::decode(&h, &b).is_err(), "a grant of more blocks than an eager message holds");
    }
}
