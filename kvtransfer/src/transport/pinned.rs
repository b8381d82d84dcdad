//! Sending a layer straight from the sender's pool: no gather.
//!
//! A prefill pool in [`PoolMemory`](super::PoolMemory) (as the decode pool is for
//! direct reads) lets a TCP sender write each `LayerData` frame's payload from the
//! blocks where the engine computed them, one `writev` per frame over the blocks'
//! pieces, instead of the engine thread copying each layer into a buffer first. The
//! copy cost a pass over every byte sent (`gather_layer`, ~8 GB/s here) on the engine
//! thread, mid-step; what is left is the kernel's copy, which raw TCP pays too.
//!
//! The split of work keeps Rust's rules:
//! - [`PinnedLayer::new`] runs where the layer was computed (the engine thread, with
//!   the pool borrowed): it takes each frame's CRC-32C from the bytes while they are in
//!   cache, through ordinary references.
//! - The sender ([`write_pinned`]) hands the kernel raw addresses only: no Rust
//!   reference into the pool exists off the engine thread, and the mapping stays alive
//!   through the [`DirectPool`] the sender holds.
//!
//! The blocks must stay the sequence's until the push ends (the prefill worker holds
//! them until its push returns or is dropped, and frees them after). Should they be
//! written meanwhile anyway (a runner deadline that freed them first), the checksum
//! taken at computation no longer matches what is sent and the receiver refuses the
//! frame as corrupt: a wrong byte never lands as KV.

use std::io;
use std::time::Duration;

use tokio::net::TcpStream;
use types::kv::{BlockId, KvLayout};

use super::direct::{vectored, Cursor, Way};
use super::stream::WriteError;
use crate::checksum;
use crate::sender::{blocks_per_frame, SplitError};

/// One layer's run of blocks to send from the pool, with each frame's checksum.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PinnedLayer {
    layer: usize,
    /// The reservation's block index of the run's first block.
    first_block: usize,
    /// The run's blocks in the sender's pool, in payload order.
    blocks: Vec<BlockId>,
    /// Blocks per frame, as the sender cuts them for `max_frame_bytes`.
    per_frame: usize,
    /// Each frame's CRC-32C (its K pieces, then its V pieces).
    checksums: Vec<u32>,
}

impl PinnedLayer {
    /// Takes the checksums of `blocks` of `layer`, read from `k` and `v`: that layer's
    /// K and V of every block of the pool (`KvPool::layer_bytes`), frames cut as a sender
    /// with `max_frame_bytes` cuts them. `first_block` numbers the run's first block in
    /// the reservation.
    pub fn new(
        layout: &KvLayout,
        layer: usize,
        first_block: usize,
        blocks: &[BlockId],
        k: &[u8],
        v: &[u8],
        max_frame_bytes: usize,
    ) -> Result<Self, SplitError> {
        if layer >= layout.n_layers || layer > u32::MAX as usize {
            return Err(SplitError::LayerOutOfRange { layer, n_layers: layout.n_layers });
        }
        let side = layout.side_bytes();
        if side == 0 || blocks.is_empty() || k.len() != v.len() || k.len() % side != 0 {
            return Err(SplitError::Shape { len: k.len() + v.len(), per_block: 2 * side });
        }
        if first_block.checked_add(blocks.len()).is_none_or(|end| end > u32::MAX as usize) {
            return Err(SplitError::TooManyBlocks { n_blocks: first_block.saturating_add(blocks.len()) });
        }
        let per_frame = blocks_per_frame(2 * side, max_frame_bytes)?;
        let outside = SplitError::Shape { len: k.len() + v.len(), per_block: 2 * side };
        let mut checksums = Vec::with_capacity(blocks.len().div_ceil(per_frame));
        for frame in blocks.chunks(per_frame) {
            let mut crc = 0;
            for bytes in [k, v] {
                // Blocks that follow each other in the pool in one call: one fold, not one per block.
                for (first, n) in runs(frame) {
                    let run = first.checked_mul(side).and_then(|at| bytes.get(at..at + n * side));
                    crc = checksum::crc32c_append(crc, run.ok_or(outside.clone())?);
                }
            }
            checksums.push(crc);
        }
        Ok(Self { layer, first_block, blocks: blocks.to_vec(), per_frame, checksums })
    }

    pub fn layer(&self) -> usize {
        self.layer
    }

    /// Payload bytes the layer's frames carry (K and V of every block).
    pub fn payload_bytes(&self, layout: &KvLayout) -> usize {
        2 * layout.side_bytes() * self.blocks.len()
    }

    /// The frames: (reservation block index of the first, the blocks, the checksum).
    pub(crate) fn frames(&self) -> impl Iterator<Item = (usize, &[BlockId], u32)> {
        let first = self.first_block;
        self.blocks
            .chunks(self.per_frame)
            .zip(&self.checksums)
            .enumerate()
            .map(move |(i, (blocks, &crc))| (first + i * self.per_frame, blocks, crc))
    }

    /// Whether the frames were cut for `max_frame_bytes` under `layout`.
    pub(crate) fn cut_for(&self, layout: &KvLayout, max_frame_bytes: usize) -> bool {
        blocks_per_frame(2 * layout.side_bytes(), max_frame_bytes).is_ok_and(|n| n == self.per_frame)
    }
}

/// `blocks` as runs of consecutive ids: (first, how many), in order.
fn runs(blocks: &[BlockId]) -> impl Iterator<Item = (usize, usize)> + '_ {
    let mut i = 0;
    std::iter::from_fn(move || {
        let first = *blocks.get(i)?;
        let n = 1 + blocks[i + 1..].iter().zip(1..).take_while(|&(&b, k)| u64::from(b) == u64::from(first) + k).count();
        i += n;
        Some((first as usize, n))
    })
}

/// Writes `header` and then the payload `pieces` (raw addresses in a pool's mapping,
/// which the caller keeps alive: `DirectPool::pieces`) to `socket`, with vectored writes, within `wait`.
pub(crate) async fn write_pinned(
    socket: &TcpStream,
    header: &[u8],
    pieces: &[(usize, usize)],
    wait: Duration,
) -> Result<(), WriteError> {
    let mut all = Vec::with_capacity(pieces.len() + 1);
    all.push((header.as_ptr() as usize, header.len()));
    all.extend_from_slice(pieces);
    let mut at = Cursor::new(&all);
    let write = async {
        while at.remaining() > 0 {
            // The pieces are the caller's header and pool memory it keeps mapped.
            let n = vectored(socket, &at, usize::MAX, Way::Write).await?;
            if n == 0 {
                return Err(io::Error::from(io::ErrorKind::WriteZero));
            }
            at.advance(n);
        }
        Ok(())
    };
    match tokio::time::timeout(wait, write).await {
        Ok(r) => r.map_err(WriteError::Io),
        Err(_) => Err(WriteError::Timeout(wait)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::LAYER_DATA_OVERHEAD;
    use types::kv::KvDtype;

    const LAYOUT: KvLayout = KvLayout { n_layers: 2, n_kv_heads: 1, head_dim: 4, block_size: 2, dtype: KvDtype::F16 };

    #[test]
    fn runs_are_consecutive_ids_in_order() {
        assert_eq!(runs(&[3, 4, 5, 7, 8, 1, 0]).collect::<Vec<_>>(), vec![(3, 3), (7, 2), (1, 1), (0, 1)]);
        assert_eq!(runs(&[]).count(), 0);
    }

    /// Each frame's checksum is the CRC-32C of what the frame carries: its blocks' K,
    /// then their V, in table order, whether or not the blocks lie side by side.
    #[test]
    fn each_frame_checksums_its_blocks_k_then_v() {
        let side = LAYOUT.side_bytes();
        let n = 10;
        let k: Vec<u8> = (0..n * side).map(|i| (i * 7 + 3) as u8).collect();
        let v: Vec<u8> = (0..n * side).map(|i| (i * 13 + 5) as u8).collect();
        let table = [3, 4, 9, 0, 1, 2, 6];
        // Two blocks per frame: 4 frames, the last of one block.
        let max_frame = LAYER_DATA_OVERHEAD + 2 * 2 * side;
        let p = PinnedLayer::new(&LAYOUT, 1, 5, &table, &k, &v, max_frame).expect("pinned");
        let frames: Vec<_> = p.frames().collect();
        assert_eq!(frames.len(), 4);
        for (i, (first, blocks, crc)) in frames.into_iter().enumerate() {
            assert_eq!((first, blocks), (5 + 2 * i, &table[2 * i..(2 * i + 2).min(table.len())]));
            let mut payload = Vec::new();
            for bytes in [&k, &v] {
                for &b in blocks {
                    payload.extend_from_slice(&bytes[b as usize * side..(b as usize + 1) * side]);
                }
            }
            assert_eq!(crc, checksum::crc32c_append(0, &payload), "frame {i}");
        }
        assert_eq!(p.payload_bytes(&LAYOUT), 2 * side * table.len());
        assert!(p.cut_for(&LAYOUT, max_frame) && !p.cut_for(&LAYOUT, 1 << 20));
    }

    #[test]
    fn a_block_outside_the_pool_or_a_bad_shape_is_refused() {
        let side = LAYOUT.side_bytes();
        let (k, v) = (vec![0u8; 4 * side], vec![0u8; 4 * side]);
        assert!(PinnedLayer::new(&LAYOUT, 0, 0, &[1, 4], &k, &v, 1 << 20).is_err(), "block 4 of 4");
        assert!(PinnedLayer::new(&LAYOUT, 2, 0, &[1], &k, &v, 1 << 20).is_err(), "layer 2 of 2");
        assert!(PinnedLayer::new(&LAYOUT, 0, 0, &[], &k, &v, 1 << 20).is_err(), "no block");
        assert!(PinnedLayer::new(&LAYOUT, 0, 0, &[1], &k, &v[1..], 1 << 20).is_err(), "K and V differ");
        assert!(PinnedLayer::new(&LAYOUT, 0, 0, &[1], &k, &v, 8).is_err(), "no block fits a frame");
    }
}
