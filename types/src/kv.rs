//! What a KV block is, in bytes — the description two processes must agree
//! on before one writes blocks for the other — and how blocks are named.

use serde::{Deserialize, Serialize};

/// A block's index in a KV pool.
pub type BlockId = u32;

/// Element type of cached K and V.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvDtype {
    F32,
    F16,
}

impl KvDtype {
    pub fn size(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 => 2,
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Some(KvDtype::F32),
            "f16" => Some(KvDtype::F16),
            _ => None,
        }
    }
}

/// The shape of one KV block. A later layer fingerprints this (with the
/// weights and tokenizer digests) so mismatched peers refuse each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvLayout {
    pub n_layers: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub dtype: KvDtype,
}

impl KvLayout {
    /// Elements of one token's K (or V) in one layer.
    pub fn row_elems(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Elements of one block's K (or V) in one layer.
    pub fn block_elems(&self) -> usize {
        self.block_size * self.row_elems()
    }

    /// Bytes of one block across all layers, K and V.
    pub fn block_bytes(&self) -> usize {
        2 * self.n_layers * self.block_elems() * self.dtype.size()
    }

    /// Bytes one token occupies across all layers, K and V.
    pub fn token_bytes(&self) -> usize {
        2 * self.n_layers * self.row_elems() * self.dtype.size()
    }

    /// Bytes of one block's K (or V) in one layer.
    pub fn side_bytes(&self) -> usize {
        self.block_elems() * self.dtype.size()
    }

    /// Bytes of a pool of `num_blocks` blocks held as one allocation in the
    /// order [`pool_offset`](Self::pool_offset) gives: what a pool that a
    /// peer writes into (UCX) maps; `None` if that overflows.
    pub fn pool_bytes(&self, num_blocks: usize) -> Option<usize> {
        self.side_bytes().checked_mul(num_blocks)?.checked_mul(2 * self.n_layers)
    }

    /// Where block `block`'s K (`v == false`) or V of `layer` starts in such
    /// an allocation: each layer's K of every block, then its V, layer after
    /// layer. The engine's pool and the peer that writes into it agree on
    /// this one formula. Callers keep `layer < n_layers` and `block < num_blocks`.
    pub fn pool_offset(&self, num_blocks: usize, layer: usize, v: bool, block: usize) -> usize {
        ((2 * layer + usize::from(v)) * num_blocks + block) * self.side_bytes()
    }
}
