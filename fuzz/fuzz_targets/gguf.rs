//! Fuzzes the GGUF header parser with arbitrary bytes.
//!
//! Beyond "never panics", an accepted file must keep the promises the rest
//! of the engine relies on when it slices tensor data out of the mapping.

#![no_main]

use std::collections::HashSet;

use engine::gguf::{parse, GgufHeader};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(header) = parse(data) {
        check_invariants(&header, data);
    }
});

fn check_invariants(header: &GgufHeader, data: &[u8]) {
    assert!((2..=3).contains(&header.version), "accepted version {}", header.version);
    assert!(header.alignment.is_power_of_two(), "alignment {} is not a power of two", header.alignment);
    assert_eq!(
        header.data_offset % header.alignment,
        0,
        "data offset {} not aligned to {}",
        header.data_offset,
        header.alignment
    );

    let mut names = HashSet::new();
    for t in &header.tensors {
        assert!(names.insert(t.name.as_str()), "duplicate tensor {:?}", t.name);

        let end = t.offset.checked_add(t.len);
        assert!(
            end.is_some_and(|e| e <= data.len()),
            "tensor {:?}: offset {} + len {} past file of {} bytes",
            t.name,
            t.offset,
            t.len,
            data.len()
        );
        assert!(
            t.offset >= header.data_offset,
            "tensor {:?}: offset {} before data section at {}",
            t.name,
            t.offset,
            header.data_offset
        );
        assert_eq!(
            (t.offset - header.data_offset) % header.alignment,
            0,
            "tensor {:?}: offset {} not aligned",
            t.name,
            t.offset
        );

        assert!((1..=4).contains(&t.dims.len()), "tensor {:?}: {} dims", t.name, t.dims.len());
        let product = t.dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d));
        assert_eq!(
            product,
            Some(t.n_elements() as u64),
            "tensor {:?}: n_elements {} disagrees with dims {:?}",
            t.name,
            t.n_elements(),
            t.dims
        );
        assert!(t.n_elements() > 0, "tensor {:?}: no elements", t.name);

        let block = t.dtype.block_elems();
        assert_eq!(
            t.dims[0] % block as u64,
            0,
            "tensor {:?}: row {} not whole {} blocks",
            t.name,
            t.dims[0],
            t.dtype.name()
        );
        assert_eq!(
            t.len,
            t.n_elements() / block * t.dtype.block_bytes(),
            "tensor {:?}: len {} disagrees with {} dims {:?}",
            t.name,
            t.len,
            t.dtype.name(),
            t.dims
        );

        // What GgufFile::tensor_data does; must not panic for an accepted file.
        let _ = &data[t.offset..t.offset + t.len];
    }
}
