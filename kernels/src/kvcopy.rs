//! Copying a sequence's KV blocks to and from a contiguous buffer.
//!
//! The transfer path sends a sequence's KV as one buffer per layer: gather
//! copies the blocks a block table names, in order, into the buffer; scatter
//! copies them back into (possibly different) blocks. Both are exact copies.

use crate::KernelError;

/// Copies blocks `table[i]` (each `block_elems` long) of `storage` to
/// `out[i * block_elems..]`.
pub fn gather<T: Copy>(storage: &[T], block_elems: usize, table: &[u32], out: &mut [T]) -> Result<(), KernelError> {
    check(storage.len(), block_elems, table, out.len(), "gather")?;
    for (i, &b) in table.iter().enumerate() {
        let src = b as usize * block_elems;
        out[i * block_elems..(i + 1) * block_elems].copy_from_slice(&storage[src..src + block_elems]);
    }
    Ok(())
}

/// Copies `buf[i * block_elems..]` into block `table[i]` of `storage`.
pub fn scatter<T: Copy>(buf: &[T], block_elems: usize, table: &[u32], storage: &mut [T]) -> Result<(), KernelError> {
    check(storage.len(), block_elems, table, buf.len(), "scatter")?;
    for (i, &b) in table.iter().enumerate() {
        let dst = b as usize * block_elems;
        storage[dst..dst + block_elems].copy_from_slice(&buf[i * block_elems..(i + 1) * block_elems]);
    }
    Ok(())
}

fn check(storage: usize, block_elems: usize, table: &[u32], buf: usize, op: &'static str) -> Result<(), KernelError> {
    if buf != table.len() * block_elems {
        return Err(KernelError::Shape {
            op,
            detail: format!(
                "buffer has {buf} elements, {} blocks of {block_elems} need {}",
                table.len(),
                table.len() * block_elems
            ),
        });
    }
    if let Some(&b) = table.iter().find(|&&b| (b as usize + 1) * block_elems > storage) {
        return Err(KernelError::Shape {
            op,
            detail: format!("block {b} is outside storage of {} blocks", storage / block_elems.max(1)),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gather_scatter_roundtrip_into_other_blocks() {
        let storage: Vec<u16> = (0..64).collect();
        let mut buf = vec![0u16; 3 * 8];
        gather(&storage, 8, &[5, 1, 7], &mut buf).expect("gather");
        assert_eq!(&buf[..8], &storage[40..48]);
        let mut other = vec![0u16; 64];
        scatter(&buf, 8, &[0, 2, 4], &mut other).expect("scatter");
        assert_eq!(&other[16..24], &storage[8..16]);
        let mut back = vec![0u16; 24];
        gather(&other, 8, &[0, 2, 4], &mut back).expect("gather");
        assert_eq!(back, buf);
    }

    #[test]
    fn out_of_range_block_is_an_error() {
        let storage = vec![0f32; 16];
        let mut buf = vec![0f32; 8];
        assert!(gather(&storage, 8, &[2], &mut buf).is_err());
        assert!(gather(&storage, 8, &[0, 1], &mut buf).is_err());
    }
}
