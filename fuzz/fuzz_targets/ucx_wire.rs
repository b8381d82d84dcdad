//! The UCX transport's active messages come from a peer process that may be buggy or
//! hostile. Decoding any header and body must never panic or over-read; an accepted
//! message must re-encode to a header and body that decode back to it (to exactly its
//! bytes, but for a `Hello` frame's tolerated tail). The checks live in
//! `kvtransfer::transport::ucx::check_decode`, which the crate's mutation test also drives.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvtransfer::transport::ucx::check_decode(data);
});
