//! [`SharedMemory`]: memory the KV pool can live in that something else allocated and
//! a peer process writes into — a UCX registration peers write KV into with one-sided
//! stores. Here, not in the engine, because the transport that allocates it
//! (`kvtransfer`) and the engine that adopts it (`KvPool::adopt`) must both name it and
//! neither depends on the other: the transfer's production graph holds no engine.
//!
//! What a peer may write, and when, is the transport's contract (kvtransfer's UCX
//! fence): only blocks reserved for a transfer it was granted and not yet handed to the
//! engine, so the engine never reads or writes a block while a peer may write it. The
//! engine holds references over whole layers, as it does over its own mappings; that is
//! the same standing as any memory shared with another process (a `memmap2::MmapMut` of
//! a shared file).
//!
//! The only `unsafe` in this crate: the constructor's contract and the `Send`/`Sync`
//! claims below.

#![allow(unsafe_code)]

use std::ptr::NonNull;

/// `len` bytes at `ptr`, kept mapped by an owner dropped after the last user.
pub struct SharedMemory {
    ptr: NonNull<u8>,
    len: usize,
    /// Keeps the memory mapped; dropped after the last region over it.
    _owner: Box<dyn Send + Sync>,
}

// SAFETY: the memory is plain bytes owned through `_owner` (Send + Sync),
// with no thread affinity; the pool's own `&`/`&mut` rules govern access.
unsafe impl Send for SharedMemory {}
// SAFETY: as above.
unsafe impl Sync for SharedMemory {}

impl SharedMemory {
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes, zeroed or
    /// otherwise initialised, for as long as `owner` lives, and not be
    /// reachable through any Rust reference elsewhere in this process.
    pub unsafe fn new(ptr: NonNull<u8>, len: usize, owner: Box<dyn Send + Sync>) -> Self {
        Self { ptr, len, _owner: owner }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first byte (where a peer's offsets start).
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// The first byte, for the owner of the `&mut` access the contract grants.
    pub fn ptr(&self) -> NonNull<u8> {
        self.ptr
    }
}

impl std::fmt::Debug for SharedMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedMemory").field("ptr", &self.ptr).field("len", &self.len).finish()
    }
}
