use super::*;
use crate::testutil::Rng;

fn hello() -> Hello {
    Hello {
        version_group: VersionGroup::new("smollm2-135m.q4_1").expect("label"),
        fingerprint: LayoutFingerprint::from_bytes([7; 32]),
        protocol_version: crate::PROTOCOL_VERSION,
    }
}

fn samples() -> Vec<Frame> {
    vec![
        Frame::Hello(hello()),
        Frame::HelloAck(HelloAck { protocol_version: 1 }),
        Frame::HelloReject(HelloReject { reason: RejectReason::Fingerprint }),
        Frame::LayerData(LayerData::new(u64::MAX, 42, 3, 5, 2, (0..=255).collect())),
        Frame::LayerData(LayerData::new(0, 1, 0, 0, 1, Vec::new())),
        Frame::Complete(Complete { reservation: 9, generation: 10, n_layers: 30 }),
        Frame::Ack(Ack { reservation: 9, generation: 10 }),
        Frame::Abort(Abort { reservation: 1, generation: 2, reason: AbortReason::ShuttingDown }),
    ]
}

fn encode(f: &Frame) -> Vec<u8> {
    let mut v = Vec::new();
    let n = f.encode(&mut v).expect("encode");
    assert_eq!(n, v.len());
    v
}

fn decode(buf: &[u8]) -> Result<Decoded, DecodeError> {
    Frame::decode(buf, &DecodeLimits::default())
}

#[test]
fn every_frame_round_trips() {
    for f in samples() {
        let bytes = encode(&f);
        assert_eq!(bytes.len(), f.encoded_len());
        assert_eq!(decode(&bytes), Ok(Decoded::Frame { frame: f.clone(), consumed: bytes.len() }), "{f:?}");
    }
    for reason in RejectReason::ALL {
        let f = Frame::HelloReject(HelloReject { reason });
        assert!(matches!(decode(&encode(&f)), Ok(Decoded::Frame { frame, .. }) if frame == f));
    }
    for reason in AbortReason::ALL {
        let f = Frame::Abort(Abort { reservation: 1, generation: 1, reason });
        assert!(matches!(decode(&encode(&f)), Ok(Decoded::Frame { frame, .. }) if frame == f));
    }
}

#[test]
fn encoding_is_pinned() {
    let f = Frame::Ack(Ack { reservation: 0x0102_0304_0506_0708, generation: 0x0a0b_0c0d });
    assert_eq!(encode(&f), [b't', b'K', 6, 0, 12, 0, 0, 0, 8, 7, 6, 5, 4, 3, 2, 1, 0x0d, 0x0c, 0x0b, 0x0a]);
    let d = Frame::LayerData(LayerData {
        reservation: 1,
        generation: 2,
        layer: 3,
        first_block: 4,
        n_blocks: 5,
        checksum: 6,
        payload: vec![0xee],
    });
    let mut want = vec![b't', b'K', 4, 0, 33, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0];
    for x in [2u32, 3, 4, 5, 6, 1] {
        want.extend_from_slice(&x.to_le_bytes());
    }
    want.push(0xee);
    assert_eq!(encode(&d), want);
    // CRC-32C check value ("123456789" -> 0xE3069283) pins the polynomial.
    assert_eq!(LayerData::new(0, 0, 0, 0, 0, b"123456789".to_vec()).checksum, 0xe306_9283);
}

#[test]
fn every_strict_prefix_needs_more() {
    for f in samples() {
        let bytes = encode(&f);
        for cut in 0..bytes.len() {
            let want = if cut < HEADER_LEN { HEADER_LEN } else { bytes.len() };
            assert_eq!(decode(&bytes[..cut]), Ok(Decoded::NeedMore { at_least: want }), "{f:?} cut at {cut}");
        }
    }
}

#[test]
fn decodes_a_stream_of_frames_and_leaves_the_rest() {
    let mut stream = Vec::new();
    for f in samples() {
        f.encode(&mut stream).expect("encode");
    }
    stream.extend_from_slice(b"tK"); // start of the next frame
    let mut at = 0;
    let mut got = Vec::new();
    while let Ok(Decoded::Frame { frame, consumed }) = decode(&stream[at..]) {
        got.push(frame);
        at += consumed;
    }
    assert_eq!(got, samples());
    assert_eq!(decode(&stream[at..]), Ok(Decoded::NeedMore { at_least: HEADER_LEN }));
}

#[test]
fn header_is_validated_before_the_body_arrives() {
    assert!(matches!(decode(b"xK"), Err(DecodeError::BadMagic { .. })));
    assert!(matches!(decode(b"t"), Ok(Decoded::NeedMore { .. })));
    assert!(matches!(decode(b"tx"), Err(DecodeError::BadMagic { .. })));
    assert_eq!(decode(b"tK\x09\0\0\0\0\0"), Err(DecodeError::UnknownKind(9)));
    assert_eq!(decode(b"tK\x06\x01\x0c\0\0\0"), Err(DecodeError::Reserved(1)));
    // A 4 GiB LayerData is refused from its header alone.
    assert!(matches!(decode(b"tK\x04\0\xff\xff\xff\xff"), Err(DecodeError::BodyLength { kind: "LayerData", .. })));
    // Fixed-size bodies must be exactly their size.
    assert!(matches!(decode(b"tK\x06\0\x0d\0\0\0"), Err(DecodeError::BodyLength { kind: "Ack", len: 13, .. })));
    // The payload limit is the caller's.
    let big = encode(&Frame::LayerData(LayerData::new(0, 0, 0, 0, 1, vec![0; 100])));
    let tight = DecodeLimits { max_payload_bytes: 99 };
    assert!(matches!(Frame::decode(&big, &tight), Err(DecodeError::BodyLength { .. })));
    assert!(matches!(Frame::decode(&big, &DecodeLimits { max_payload_bytes: 100 }), Ok(Decoded::Frame { .. })));
}

#[test]
fn body_fields_are_checked() {
    // LayerData whose payload_len field disagrees with the body.
    let mut b = encode(&Frame::LayerData(LayerData::new(0, 0, 0, 0, 1, vec![1, 2, 3])));
    b[36] = 2;
    assert_eq!(decode(&b), Err(DecodeError::PayloadLength { field: 2, available: 3 }));
    // Unknown reason codes.
    let mut r = encode(&Frame::HelloReject(HelloReject { reason: RejectReason::VersionGroup }));
    r[8] = 99;
    assert_eq!(decode(&r), Err(DecodeError::UnknownReason { what: "reject", code: 99 }));
    let mut a = encode(&Frame::Abort(Abort { reservation: 0, generation: 0, reason: AbortReason::Cancelled }));
    a[20] = 0;
    assert_eq!(decode(&a), Err(DecodeError::UnknownReason { what: "abort", code: 0 }));
    // Hello with a bad label, and with a label longer than the body.
    let mut h = encode(&Frame::Hello(hello()));
    h[HEADER_LEN + 37] = b' ';
    assert!(matches!(decode(&h), Err(DecodeError::VersionGroup(VersionGroupError::InvalidChar { ch: ' ', .. }))));
    let mut h = encode(&Frame::Hello(hello()));
    h[HEADER_LEN + 36] = 200;
    assert!(matches!(decode(&h), Err(DecodeError::Truncated { kind: "Hello", field: "version_group" })));
}

#[test]
fn hello_tolerates_fields_a_later_version_appends() {
    let mut h = encode(&Frame::Hello(Hello { protocol_version: 2, ..hello() }));
    let ext = [1u8, 2, 3, 4, 5];
    h.extend_from_slice(&ext);
    let body_len = (h.len() - HEADER_LEN) as u32;
    h[4..8].copy_from_slice(&body_len.to_le_bytes());
    match decode(&h) {
        Ok(Decoded::Frame { frame: Frame::Hello(got), consumed }) => {
            assert_eq!(consumed, h.len());
            assert_eq!(got.protocol_version, 2, "the version survives so the receiver can refuse it cleanly");
            assert_eq!(got.version_group, hello().version_group);
        }
        other => panic!("{other:?}"),
    }
    // But not on frames after the handshake.
    let mut c = encode(&Frame::Complete(Complete { reservation: 1, generation: 1, n_layers: 1 }));
    c.push(0);
    c[4] = 17;
    assert!(matches!(decode(&c), Err(DecodeError::BodyLength { .. })));
}

/// Decodes `buf` and checks the decoder's promises: no panic (the test
/// would fail), `consumed` within the buffer, `NeedMore` asks for more than
/// there is, and anything accepted re-encodes to something that decodes to
/// the same frame.
fn check_decode(buf: &[u8], limits: &DecodeLimits) -> Option<usize> {
    check_decode_head_agrees(buf, limits);
    match Frame::decode(buf, limits) {
        Ok(Decoded::Frame { frame, consumed }) => {
            assert!(consumed <= buf.len() && consumed >= HEADER_LEN);
            let again = encode(&frame);
            assert_eq!(Frame::decode(&again, limits), Ok(Decoded::Frame { frame, consumed: again.len() }));
            Some(consumed)
        }
        Ok(Decoded::NeedMore { at_least }) => {
            assert!(at_least > buf.len(), "NeedMore({at_least}) with {} bytes", buf.len());
            None
        }
        Err(_) => None,
    }
}

#[test]
fn random_mutations_never_panic() {
    let mut rng = Rng::new(0x6b76_7472_616e_7366);
    let limits = DecodeLimits { max_payload_bytes: 4096 };
    let seeds: Vec<Vec<u8>> = samples().iter().map(encode).collect();
    let (mut accepted, mut refused) = (0, 0);
    for _ in 0..20_000 {
        let mut b = seeds[rng.below(seeds.len())].clone();
        for _ in 0..1 + rng.below(4) {
            match rng.below(7) {
                0 if !b.is_empty() => {
                    let i = rng.below(b.len());
                    b[i] ^= 1 << rng.below(8);
                }
                1 if !b.is_empty() => {
                    let i = rng.below(b.len());
                    b[i] = rng.next_u64() as u8;
                }
                2 => b.truncate(rng.below(b.len() + 1)),
                3 => {
                    let i = rng.below(b.len() + 1);
                    let n = 1 + rng.below(16);
                    let extra = rng.bytes(n);
                    b.splice(i..i, extra);
                }
                // Rewrite the header's length: the field every attack aims at.
                4 if b.len() >= HEADER_LEN => {
                    let len = match rng.below(3) {
                        0 => rng.next_u64() as u32,
                        1 => (b.len() - HEADER_LEN) as u32,
                        _ => rng.below(64) as u32,
                    };
                    b[4..8].copy_from_slice(&len.to_le_bytes());
                }
                // Rewrite LayerData's payload_len field.
                5 if b.len() >= 40 => b[36..40].copy_from_slice(&(rng.next_u64() as u32 % 512).to_le_bytes()),
                _ => {
                    let n = rng.below(8);
                    b.extend(rng.bytes(n));
                }
            }
        }
        match check_decode(&b, &limits) {
            Some(_) => accepted += 1,
            None => refused += 1,
        }
    }
    // The mutations must exercise both outcomes, or the test proves little.
    assert!(accepted > 1000 && refused > 1000, "accepted {accepted}, refused {refused}");
}

#[test]
fn random_bytes_never_panic() {
    let mut rng = Rng::new(7);
    let limits = DecodeLimits::default();
    for i in 0..20_000 {
        // Half the inputs start with a valid magic and kind, to get past the header.
        let n = rng.below(80);
        let mut b = rng.bytes(n);
        if i % 2 == 0 && b.len() >= 4 {
            b[..2].copy_from_slice(&MAGIC);
            b[2] = 1 + rng.below(7) as u8;
            b[3] = 0;
        }
        // Walk the buffer as a stream would.
        let mut at = 0;
        while let Some(n) = check_decode(&b[at..], &limits) {
            at += n;
        }
    }
}

#[test]
fn layer_data_header_then_payload_equals_encode() {
    let d = LayerData::new(7, 3, 2, 5, 4, (0..=255u8).cycle().take(1000).collect());
    let mut want = Vec::new();
    Frame::LayerData(d.clone()).encode(&mut want).expect("encode");
    let h = LayerDataHeader {
        reservation: d.reservation,
        generation: d.generation,
        layer: d.layer,
        first_block: d.first_block,
        n_blocks: d.n_blocks,
        checksum: d.checksum,
        payload_len: d.payload.len(),
    };
    let mut got = Vec::new();
    h.encode(&mut got).expect("header");
    assert_eq!(got.len(), LAYER_DATA_OVERHEAD);
    got.extend_from_slice(&d.payload);
    assert_eq!(got, want);
    let too_big = LayerDataHeader { payload_len: DecodeLimits::MAX_PAYLOAD + 1, ..h };
    let mut out = vec![1];
    assert!(too_big.encode(&mut out).is_err());
    assert_eq!(out, [1], "unchanged on error");
}

/// [`Frame::decode_head`] accepts and refuses what [`Frame::decode`] does,
/// stopping only before a `LayerData`'s payload.
fn check_decode_head_agrees(buf: &[u8], limits: &DecodeLimits) {
    let head = Frame::decode_head(buf, limits);
    match (Frame::decode(buf, limits), head) {
        (
            Ok(Decoded::Frame { frame: Frame::LayerData(d), consumed }),
            Ok(DecodedHead::LayerData { header, consumed: h }),
        ) => {
            assert_eq!(h, LAYER_DATA_OVERHEAD);
            assert_eq!(h + header.payload_len, consumed);
            assert_eq!(header.with_payload(buf[h..consumed].to_vec()), d);
        }
        (Ok(Decoded::Frame { frame, consumed }), Ok(DecodedHead::Frame { frame: f, consumed: c })) => {
            assert!(!matches!(frame, Frame::LayerData(_)));
            assert_eq!((frame, consumed), (f, c));
        }
        (Ok(Decoded::NeedMore { .. }), Ok(DecodedHead::LayerData { header, consumed })) => {
            assert!(consumed <= buf.len() && consumed + header.payload_len > buf.len());
        }
        (Ok(Decoded::NeedMore { at_least }), Ok(DecodedHead::NeedMore { at_least: a })) => {
            assert!(a <= at_least && a > buf.len());
        }
        // decode_head checks a LayerData's payload length field as soon as
        // the fixed fields are in; decode reports it once the body is.
        (Ok(Decoded::NeedMore { .. }), Err(DecodeError::PayloadLength { .. })) => {}
        (Err(e), Err(h)) => assert_eq!(e, h),
        (d, h) => panic!("decode {d:?} but decode_head {h:?}"),
    }
}

#[test]
fn decode_head_stops_before_a_layer_payload_and_decodes_the_rest_whole() {
    let limits = DecodeLimits::default();
    let d = LayerData::new(7, 3, 2, 5, 4, (0..=255u8).cycle().take(1000).collect());
    let mut wire = encode(&Frame::LayerData(d.clone()));
    let ack = Frame::Ack(Ack { reservation: 1, generation: 2 });
    wire.extend(encode(&ack));
    for cut in 0..LAYER_DATA_OVERHEAD {
        assert!(matches!(Frame::decode_head(&wire[..cut], &limits), Ok(DecodedHead::NeedMore { .. })), "{cut}");
    }
    // The fixed fields alone are enough; the payload is the caller's to read.
    let Ok(DecodedHead::LayerData { header, consumed }) = Frame::decode_head(&wire[..LAYER_DATA_OVERHEAD], &limits)
    else {
        panic!("a LayerData head")
    };
    assert_eq!((consumed, header.payload_len, header.checksum), (LAYER_DATA_OVERHEAD, 1000, d.checksum));
    let rest = &wire[consumed + header.payload_len..];
    assert_eq!(Frame::decode_head(rest, &limits), Ok(DecodedHead::Frame { frame: ack, consumed: rest.len() }));
    // Limits and the payload length field are checked before any payload byte.
    let small = DecodeLimits { max_payload_bytes: 999 };
    assert!(matches!(Frame::decode_head(&wire[..LAYER_DATA_OVERHEAD], &small), Err(DecodeError::BodyLength { .. })));
    wire[LAYER_DATA_OVERHEAD - 4..LAYER_DATA_OVERHEAD].copy_from_slice(&999u32.to_le_bytes());
    assert!(matches!(
        Frame::decode_head(&wire[..LAYER_DATA_OVERHEAD], &limits),
        Err(DecodeError::PayloadLength { field: 999, available: 1000 })
    ));
}
