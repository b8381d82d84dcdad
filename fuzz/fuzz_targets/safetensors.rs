//! Fuzzes the hand-written safetensors header parser with arbitrary bytes.
//!
//! An accepted header promises that every tensor range may be sliced from
//! the file and spans exactly the bytes its dtype and shape need; and what
//! was accepted must survive a round trip through `encode_header`.

#![no_main]

use engine::weights::safetensors::{encode_header, parse_header, Header, TensorSpec};
use libfuzzer_sys::fuzz_target;

/// Round trips allocate the data section again; skip ones larger than this
/// (possible when many tensors share one overlapping range).
const MAX_ROUND_TRIP_DATA: usize = 1 << 20;

fuzz_target!(|data: &[u8]| {
    if let Ok(header) = parse_header(data) {
        check_invariants(&header, data);
        round_trip(&header);
    }
});

fn check_invariants(header: &Header, data: &[u8]) {
    let len_prefix = u64::from_le_bytes(data[..8].try_into().expect("8 bytes"));
    assert_eq!(header.data_start as u64, 8 + len_prefix, "data_start disagrees with the length prefix");
    assert!(header.data_start <= data.len(), "data_start past the end");
    assert!(!header.tensors.contains_key("__metadata__"), "__metadata__ parsed as a tensor");
    for (name, t) in &header.tensors {
        assert!(
            t.range.start <= t.range.end && t.range.end <= data.len(),
            "tensor {name:?}: range {:?} outside file of {} bytes",
            t.range,
            data.len()
        );
        assert!(t.range.start >= header.data_start, "tensor {name:?}: range {:?} starts inside the header", t.range);
        let expected = t.shape.iter().try_fold(t.dtype.size(), |acc, &d| acc.checked_mul(d));
        assert_eq!(
            expected,
            Some(t.range.len()),
            "tensor {name:?}: {} shape {:?} disagrees with range {:?}",
            t.dtype.name(),
            t.shape,
            t.range
        );
        let _ = &data[t.range.clone()];
    }
}

fn round_trip(header: &Header) {
    let specs: Vec<TensorSpec> = header
        .tensors
        .iter()
        .map(|(name, t)| TensorSpec { name: name.clone(), dtype: t.dtype, shape: t.shape.clone() })
        .collect();
    let total: usize = header.tensors.values().map(|t| t.range.len()).sum();
    if total > MAX_ROUND_TRIP_DATA {
        return;
    }
    let mut file = encode_header(&specs, &header.metadata).expect("accepted tensors re-encode");
    assert_eq!(file.len() % 8, 0, "encoded header leaves data unaligned");
    file.resize(file.len() + total, 0);
    let again = parse_header(&file).expect("re-encoded header parses");
    assert_eq!(again.metadata, header.metadata, "metadata lost in round trip");
    assert_eq!(again.tensors.len(), header.tensors.len(), "tensor count changed in round trip");
    for (name, t) in &header.tensors {
        let u = &again.tensors[name];
        assert_eq!((u.dtype, &u.shape), (t.dtype, &t.shape), "tensor {name:?} changed");
    }
}
