//! KV-transfer frames arrive from peers (possibly hostile). Decoding any
//! bytes must never panic; an accepted frame must survive encode -> decode
//! unchanged, and re-encode to exactly its bytes — except `Hello`, which
//! tolerates (and drops) bytes a later protocol version appends.
#![no_main]

use kvtransfer::{DecodeLimits, Decoded, Frame};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let limits = DecodeLimits { max_payload_bytes: 1 << 20 };
    let mut rest = data;
    while let Ok(Decoded::Frame { frame, consumed }) = Frame::decode(rest, &limits) {
        assert!(consumed > 0 && consumed <= rest.len(), "consumed {consumed} of {}", rest.len());
        let mut again = Vec::new();
        frame.encode(&mut again).expect("an accepted frame encodes");
        match Frame::decode(&again, &limits) {
            Ok(Decoded::Frame { frame: back, consumed: n }) => {
                assert_eq!(back, frame, "encode -> decode changed the frame");
                assert_eq!(n, again.len());
            }
            other => panic!("re-encoded frame does not decode: {other:?}"),
        }
        if !matches!(frame, Frame::Hello(_)) {
            assert_eq!(&again[..], &rest[..consumed], "re-encoding differs from the accepted bytes");
        }
        rest = &rest[consumed..];
    }
});
