//! The local (shared-memory) transport's control socket carries messages
//! from a peer process that may be buggy or hostile. Decoding any bytes must
//! never panic or over-read; an accepted message must re-encode to bytes that
//! decode back to it (to exactly its bytes, but for a `Hello`'s tolerated
//! tail). The checks live in `kvtransfer::transport::local::check_decode`,
//! which the crate's mutation test also drives.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvtransfer::transport::local::check_decode(data);
});
