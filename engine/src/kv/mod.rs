//! The paged KV cache: a fixed pool of blocks, each holding `block_size`
//! tokens' K and V for every layer.
//!
//! Sequences own blocks through block tables; blocks are reference-counted
//! so sequences with a common prefix share the full blocks of that prefix.
//! A full block is addressed by a chained hash (parent hash, its tokens, a
//! salt), so the same tokens after a different prefix — or under another
//! tenant's salt — never match. A block whose last owner let go keeps its
//! contents and its hash and stays findable until the pool needs the space
//! (least recently released first). Only full blocks are ever shared, and a
//! sequence only writes into blocks it owns alone, so no block is written
//! while another sequence reads it.

mod pool;
mod region;

pub use pool::{prefix_hashes, KvPool, KvStats, PrefixHash};
pub use region::SharedMemory;
use types::kv::{BlockId, KvDtype, KvLayout};

/// KV cache errors.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KvError {
    /// Every block is in use by a running sequence.
    #[error("KV cache exhausted: {needed} more blocks needed, {available} available of {total}")]
    Exhausted { needed: usize, available: usize, total: usize },
    /// A block id outside the pool, or a release of a free block — a bug in
    /// the caller, reported rather than corrupting the pool.
    #[error("invalid block {block}: {why}")]
    InvalidBlock { block: BlockId, why: &'static str },
    /// The pool configuration is unusable.
    #[error("invalid KV configuration: {0}")]
    Config(String),
    /// The host could not map or back the pool's memory.
    #[error("KV pool memory: {0}")]
    Memory(String),
    /// A buffer does not match the layout for a gather/scatter.
    #[error("KV buffer shape: {0}")]
    Shape(String),
}
