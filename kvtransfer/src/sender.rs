//! Sender-side helpers: cutting one layer's KV into `LayerData` frames.
//!
//! A layer's bytes for a reservation are `K(block 0..n) ‖ V(block 0..n)`, the
//! per-layer slice of what [`engine::kv::KvPool::gather`] produces. A frame
//! carries whole blocks only (so the receiver can track coverage per block)
//! and the same contiguous range of K and of V, so each frame is
//! self-contained: the receiver can write it the moment it arrives, in any
//! order relative to other frames.

use types::kv::KvLayout;

use crate::frame::{LayerData, LAYER_DATA_OVERHEAD};
use crate::session::Reservation;

/// Why a layer cannot be split into frames.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SplitError {
    /// `layer` is not below the layout's layer count.
    #[error("layer {layer} out of range: the layout has {n_layers} layers")]
    LayerOutOfRange { layer: usize, n_layers: usize },
    /// The bytes are not K and V of a whole, non-zero number of blocks.
    #[error("{len} bytes is not K and V of a whole number of {per_block}-byte blocks")]
    Shape { len: usize, per_block: usize },
    /// Even one block (K and V) does not fit `max_frame_bytes`.
    #[error("max frame of {max_frame_bytes} bytes cannot carry one block ({needed} bytes with header)")]
    FrameTooSmall { max_frame_bytes: usize, needed: usize },
    /// More blocks than a frame's u32 block index can name.
    #[error("{n_blocks} blocks exceed the protocol's u32 block index")]
    TooManyBlocks { n_blocks: usize },
}

/// Bytes of one block's K (or V) in one layer.
fn side_bytes(layout: &KvLayout) -> usize {
    layout.block_elems() * layout.dtype.size()
}

/// The bytes of `layer` inside a [`KvPool::gather`](engine::kv::KvPool::gather)
/// of `n_blocks` blocks: `K ‖ V` of that layer. `None` when `gathered` is not
/// the size that gather produces or the layer is out of range.
pub fn gathered_layer<'a>(layout: &KvLayout, gathered: &'a [u8], n_blocks: usize, layer: usize) -> Option<&'a [u8]> {
    let per_layer = n_blocks.checked_mul(2 * side_bytes(layout))?;
    if layer >= layout.n_layers || gathered.len() != per_layer.checked_mul(layout.n_layers)? {
        return None;
    }
    gathered.get(layer * per_layer..(layer + 1) * per_layer)
}

/// Splits one layer's `K ‖ V` bytes into frames of at most
/// `max_frame_bytes` encoded bytes each, every frame holding whole blocks.
pub fn split_layer<'a>(
    layout: &KvLayout,
    reservation: Reservation,
    layer: usize,
    kv: &'a [u8],
    max_frame_bytes: usize,
) -> Result<LayerChunks<'a>, SplitError> {
    if layer >= layout.n_layers || layer > u32::MAX as usize {
        return Err(SplitError::LayerOutOfRange { layer, n_layers: layout.n_layers });
    }
    let side = side_bytes(layout);
    let per_block = 2 * side;
    if per_block == 0 || kv.is_empty() || kv.len() % per_block != 0 {
        return Err(SplitError::Shape { len: kv.len(), per_block });
    }
    let n_blocks = kv.len() / per_block;
    if n_blocks > u32::MAX as usize {
        return Err(SplitError::TooManyBlocks { n_blocks });
    }
    let per_frame = blocks_per_frame(per_block, max_frame_bytes)?;
    let (k, v) = kv.split_at(n_blocks * side);
    Ok(LayerChunks { reservation, layer: layer as u32, k, v, side, n_blocks, per_frame, next: 0 })
}

/// Whole blocks of `per_block` payload bytes (a block's K and V) one `LayerData` frame of
/// at most `max_frame_bytes` carries: the one cut every sender makes.
pub(crate) fn blocks_per_frame(per_block: usize, max_frame_bytes: usize) -> Result<usize, SplitError> {
    match max_frame_bytes.saturating_sub(LAYER_DATA_OVERHEAD).checked_div(per_block) {
        Some(n) if n > 0 => Ok(n),
        _ => Err(SplitError::FrameTooSmall { max_frame_bytes, needed: LAYER_DATA_OVERHEAD + per_block }),
    }
}

/// Iterator over one layer's frames, in block order. See [`split_layer`].
#[derive(Debug, Clone)]
pub struct LayerChunks<'a> {
    reservation: Reservation,
    layer: u32,
    k: &'a [u8],
    v: &'a [u8],
    side: usize,
    n_blocks: usize,
    per_frame: usize,
    next: usize,
}

impl Iterator for LayerChunks<'_> {
    type Item = LayerData;

    fn next(&mut self) -> Option<LayerData> {
        if self.next >= self.n_blocks {
            return None;
        }
        let first = self.next;
        let n = self.per_frame.min(self.n_blocks - first);
        self.next += n;
        let range = first * self.side..(first + n) * self.side;
        let mut payload = Vec::with_capacity(2 * range.len());
        payload.extend_from_slice(&self.k[range.clone()]);
        payload.extend_from_slice(&self.v[range]);
        // split_layer checked n_blocks fits u32.
        Some(LayerData::new(
            self.reservation.id.0,
            self.reservation.generation,
            self.layer,
            first as u32,
            n as u32,
            payload,
        ))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = (self.n_blocks - self.next).div_ceil(self.per_frame);
        (left, Some(left))
    }
}

impl ExactSizeIterator for LayerChunks<'_> {}

#[cfg(test)]
mod tests {
    use types::kv::KvDtype;

    use super::*;
    use crate::frame::Frame;
    use crate::session::ReservationId;

    fn layout() -> KvLayout {
        KvLayout { n_layers: 2, n_kv_heads: 1, head_dim: 8, block_size: 4, dtype: KvDtype::F16 }
    }

    const RES: Reservation = Reservation { id: ReservationId(3), generation: 9 };

    #[test]
    fn frames_carry_whole_blocks_and_fit_the_limit() {
        let l = layout();
        let side = 4 * 8 * 2; // 64 bytes of K per block
        let n = 5;
        let kv: Vec<u8> = (0..2 * n * side).map(|i| i as u8).collect();
        // Room for exactly two blocks per frame.
        let max = LAYER_DATA_OVERHEAD + 2 * 2 * side + 7;
        let frames: Vec<_> = split_layer(&l, RES, 1, &kv, max).expect("split").collect();
        assert_eq!(frames.iter().map(|f| (f.first_block, f.n_blocks)).collect::<Vec<_>>(), [(0, 2), (2, 2), (4, 1)]);
        for f in &frames {
            assert_eq!((f.reservation, f.generation, f.layer), (3, 9, 1));
            assert!(Frame::LayerData(f.clone()).encoded_len() <= max);
            assert_eq!(f.checksum, f.payload_checksum());
            let (a, m) = (f.first_block as usize, f.n_blocks as usize);
            let (k, v) = f.payload.split_at(m * side);
            assert_eq!(k, &kv[a * side..(a + m) * side]);
            assert_eq!(v, &kv[n * side + a * side..n * side + (a + m) * side]);
        }
        assert_eq!(split_layer(&l, RES, 1, &kv, max).expect("split").len(), 3);
    }

    #[test]
    fn refuses_bad_shapes() {
        let l = layout();
        let kv = vec![0u8; 2 * 64];
        assert!(matches!(split_layer(&l, RES, 2, &kv, 1 << 20), Err(SplitError::LayerOutOfRange { .. })));
        assert!(matches!(split_layer(&l, RES, 0, &kv[1..], 1 << 20), Err(SplitError::Shape { .. })));
        assert!(matches!(split_layer(&l, RES, 0, &[], 1 << 20), Err(SplitError::Shape { .. })));
        assert_eq!(
            split_layer(&l, RES, 0, &kv, LAYER_DATA_OVERHEAD + 127).map(|c| c.count()),
            Err(SplitError::FrameTooSmall {
                max_frame_bytes: LAYER_DATA_OVERHEAD + 127,
                needed: LAYER_DATA_OVERHEAD + 128
            })
        );
        assert_eq!(split_layer(&l, RES, 0, &kv, LAYER_DATA_OVERHEAD + 128).map(|c| c.count()), Ok(1));
    }

    #[test]
    fn gathered_layer_slices_k_then_v_per_layer() {
        let l = layout();
        let per_layer = 3 * 2 * 64;
        let g: Vec<u8> = (0..2 * per_layer).map(|i| (i / per_layer) as u8).collect();
        assert_eq!(gathered_layer(&l, &g, 3, 0), Some(&g[..per_layer]));
        assert!(gathered_layer(&l, &g, 3, 1).is_some_and(|s| s.iter().all(|&b| b == 1)));
        assert_eq!(gathered_layer(&l, &g, 3, 2), None);
        assert_eq!(gathered_layer(&l, &g[1..], 3, 0), None);
    }
}
