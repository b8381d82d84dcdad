//! KV-transfer frames arrive from peers (possibly hostile). Decoding any
//! bytes must never panic, and an accepted frame must re-encode to exactly
//! the bytes it was decoded from.
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
        assert_eq!(&again[..], &rest[..consumed], "re-encoding differs from the accepted bytes");
        rest = &rest[consumed..];
    }
});
