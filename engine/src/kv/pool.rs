//! The block pool: storage, reference counts, the prefix index and eviction.

use std::collections::{BTreeMap, HashMap};

use kernels::attention::KvSlice;
use sha2::{Digest, Sha256};

use super::region::{Region, SharedMemory};
use super::{BlockId, KvDtype, KvError, KvLayout};
use std::sync::Arc;

/// Chained hash of a full block: identifies its tokens *and* everything
/// before them (and the salt).
pub type PrefixHash = u64;

#[derive(Debug)]
enum Storage {
    F32(Region<f32>),
    F16(Region<u16>),
}

impl Storage {
    fn new(dtype: KvDtype, n: usize) -> std::io::Result<Self> {
        Ok(match dtype {
            KvDtype::F32 => Storage::F32(Region::zeroed(n)?),
            KvDtype::F16 => Storage::F16(Region::zeroed(n)?),
        })
    }

    /// `n` elements at byte `at` of `mem`.
    fn shared(dtype: KvDtype, mem: &Arc<SharedMemory>, at: usize, n: usize) -> Option<Self> {
        Some(match dtype {
            KvDtype::F32 => Storage::F32(Region::shared(mem, at, n)?),
            KvDtype::F16 => Storage::F16(Region::shared(mem, at, n)?),
        })
    }

    fn slice(&self) -> KvSlice<'_> {
        match self {
            Storage::F32(v) => KvSlice::F32(v),
            Storage::F16(v) => KvSlice::F16(v),
        }
    }

    fn write(&mut self, at: usize, row: &[f32]) {
        match self {
            Storage::F32(v) => v[at..at + row.len()].copy_from_slice(row),
            Storage::F16(v) => {
                for (d, s) in v[at..at + row.len()].iter_mut().zip(row) {
                    *d = kernels::f16::f32_to_f16_bits(*s);
                }
            }
        }
    }

    /// Appends the blocks of `table` as little-endian bytes. On little-endian
    /// hosts (every supported one) each block is one `memcpy`: the transfer
    /// path moves hundreds of MiB through here.
    fn gather(&self, block_elems: usize, table: &[BlockId], out: &mut Vec<u8>) {
        for &b in table {
            let r = b as usize * block_elems..(b as usize + 1) * block_elems;
            match self {
                Storage::F32(v) => extend_le(out, &v[r]),
                Storage::F16(v) => extend_le(out, &v[r]),
            }
        }
    }

    /// Overwrites the blocks of `table` from little-endian bytes (inverse of `gather`).
    fn scatter(&mut self, block_elems: usize, table: &[BlockId], bytes: &[u8]) {
        for (i, &b) in table.iter().enumerate() {
            let r = b as usize * block_elems..(b as usize + 1) * block_elems;
            match self {
                Storage::F32(v) => fill_le(&mut v[r], &bytes[i * block_elems * 4..(i + 1) * block_elems * 4]),
                Storage::F16(v) => fill_le(&mut v[r], &bytes[i * block_elems * 2..(i + 1) * block_elems * 2]),
            }
        }
    }

    /// The elements as little-endian bytes, where that is how they lie in
    /// memory (little-endian hosts, every supported one).
    fn le_bytes(&self) -> Result<&[u8], KvError> {
        if cfg!(target_endian = "big") {
            return Err(KvError::Shape("the pool's bytes are not little-endian on this host".into()));
        }
        Ok(match self {
            Storage::F32(v) => bytemuck::cast_slice(v),
            Storage::F16(v) => bytemuck::cast_slice(v),
        })
    }

    fn commit(&mut self) -> std::io::Result<usize> {
        match self {
            Storage::F32(v) => v.commit(),
            Storage::F16(v) => v.commit(),
        }
    }

    fn clear_blocks(&mut self, block_elems: usize, table: &[BlockId]) {
        for &b in table {
            let r = b as usize * block_elems..(b as usize + 1) * block_elems;
            match self {
                Storage::F32(v) => v[r].fill(0.0),
                Storage::F16(v) => v[r].fill(0),
            }
        }
    }
}

/// Element types stored in the pool, with their little-endian byte form.
trait LeBytes: bytemuck::Pod {
    #[cfg(target_endian = "big")]
    fn swap(self) -> Self;
}

impl LeBytes for f32 {
    #[cfg(target_endian = "big")]
    fn swap(self) -> Self {
        f32::from_bits(self.to_bits().swap_bytes())
    }
}

impl LeBytes for u16 {
    #[cfg(target_endian = "big")]
    fn swap(self) -> Self {
        self.swap_bytes()
    }
}

fn extend_le<T: LeBytes>(out: &mut Vec<u8>, src: &[T]) {
    #[cfg(target_endian = "little")]
    out.extend_from_slice(bytemuck::cast_slice(src));
    #[cfg(target_endian = "big")]
    for &x in src {
        out.extend_from_slice(bytemuck::bytes_of(&x.swap()));
    }
}

fn fill_le<T: LeBytes>(dst: &mut [T], bytes: &[u8]) {
    let d: &mut [u8] = bytemuck::cast_slice_mut(dst);
    d.copy_from_slice(bytes);
    #[cfg(target_endian = "big")]
    for x in dst.iter_mut() {
        *x = x.swap();
    }
}

/// Pool occupancy, for metrics and admission.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvStats {
    pub total: usize,
    /// Blocks owned by at least one sequence.
    pub used: usize,
    /// Unowned blocks that keep a reusable prefix until evicted.
    pub cached: usize,
    /// Blocks with nothing in them.
    pub free: usize,
}

impl KvStats {
    /// Fraction of blocks owned by sequences (vLLM's `kv_cache_usage_perc`).
    pub fn usage_ratio(&self) -> f64 {
        self.used as f64 / self.total.max(1) as f64
    }
}

/// The fixed-capacity block pool.
#[derive(Debug)]
pub struct KvPool {
    layout: KvLayout,
    num_blocks: usize,
    k: Vec<Storage>,
    v: Vec<Storage>,
    refs: Vec<u32>,
    free: Vec<BlockId>,
    /// Hash of each block's content, once it is full and registered.
    hash_of: Vec<Option<PrefixHash>>,
    by_hash: HashMap<PrefixHash, BlockId>,
    /// Unowned blocks with a hash, oldest release first (tick -> block).
    evictable: BTreeMap<u64, BlockId>,
    evict_tick: Vec<u64>,
    tick: u64,
    /// Changes whenever `by_hash` gains or loses an entry.
    prefix_epoch: u64,
}

/// Chained hashes of the full blocks of `tokens` in blocks of `block_size`
/// tokens under `salt`: block i's hash covers its tokens and, through its
/// parent's, every token before them and the salt. The coordinator computes
/// the same chain to ask which worker holds a prompt's prefix.
pub fn prefix_hashes(tokens: &[u32], block_size: usize, salt: u64) -> Vec<PrefixHash> {
    if block_size == 0 {
        return Vec::new();
    }
    let mut parent = salt;
    // The parent and the block's tokens, little-endian, hashed in one call: the same bytes
    // as one update per token (so the same hashes), at a third of the cost; the router
    // hashes every prompt it routes.
    let mut bytes = Vec::with_capacity(8 + 4 * block_size);
    tokens
        .chunks_exact(block_size)
        .map(|chunk| {
            bytes.clear();
            bytes.extend_from_slice(&parent.to_le_bytes());
            bytes.extend(chunk.iter().flat_map(|t| t.to_le_bytes()));
            let d = Sha256::digest(&bytes);
            parent = u64::from_le_bytes([d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]]);
            parent
        })
        .collect()
}

impl KvPool {
    pub fn new(layout: KvLayout, num_blocks: usize) -> Result<Self, KvError> {
        if num_blocks == 0 || num_blocks > u32::MAX as usize {
            return Err(KvError::Config(format!("num_blocks must be 1..=2^32-1, got {num_blocks}")));
        }
        if layout.block_size == 0 || layout.n_layers == 0 || layout.row_elems() == 0 {
            return Err(KvError::Config(format!("empty layout {layout:?}")));
        }
        let n = num_blocks
            .checked_mul(layout.block_elems())
            .ok_or_else(|| KvError::Config("pool size overflows".into()))?;
        let storage = || {
            (0..layout.n_layers)
                .map(|_| Storage::new(layout.dtype, n))
                .collect::<std::io::Result<Vec<_>>>()
                .map_err(|e| KvError::Memory(format!("mapping {n} KV elements per layer: {e}")))
        };
        Ok(Self {
            layout,
            num_blocks,
            k: storage()?,
            v: storage()?,
            refs: vec![0; num_blocks],
            // Pop order hands out low ids first (only cosmetic).
            free: (0..num_blocks as BlockId).rev().collect(),
            hash_of: vec![None; num_blocks],
            by_hash: HashMap::new(),
            evictable: BTreeMap::new(),
            evict_tick: vec![0; num_blocks],
            tick: 0,
            prefix_epoch: 0,
        })
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Backs the whole pool with memory now (4 KiB pages, see
    /// `kv/region.rs` for why not huge ones); returns its bytes.
    ///
    /// The storage is zeroed anonymous memory, which the kernel backs only at
    /// each page's first write. Uncommitted, a worker's pool is faulted in by
    /// the engine thread the first time each block is written — a KV load
    /// or a decode step then pays for it (about 8 ms for one 1,080-token
    /// prompt of SmolLM2-135M in 4 KiB pages, measured on the 2-core CI
    /// machine) — and a pool larger than the host can hold is found out by
    /// the OOM killer under load instead of here, as [`KvError::Memory`].
    /// The worker binaries commit at start; tests and benches that build
    /// many small engines need not.
    pub fn commit(&mut self) -> Result<usize, KvError> {
        let mut bytes = 0;
        for s in self.k.iter_mut().chain(self.v.iter_mut()) {
            bytes += s.commit().map_err(|e| KvError::Memory(format!("backing the KV pool with memory: {e}")))?;
        }
        Ok(bytes)
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Moves the pool's storage into `mem`, laid out as
    /// [`KvLayout::pool_offset`] says (each layer's K of every block, then
    /// its V), so that a peer holding the same layout and block ids can
    /// write a block's KV straight where the engine reads it (the UCX
    /// transport's direct path). Only an empty pool can move: no block in
    /// use or cached, since nothing is copied. The old storage is freed.
    pub fn adopt(&mut self, mem: SharedMemory) -> Result<(), KvError> {
        if self.free.len() != self.num_blocks {
            return Err(KvError::Config(format!(
                "a pool moves into shared memory only while empty; {} of {} blocks are in use or cached",
                self.num_blocks - self.free.len(),
                self.num_blocks
            )));
        }
        let need =
            self.layout.pool_bytes(self.num_blocks).ok_or_else(|| KvError::Config("pool size overflows".into()))?;
        if mem.len() < need {
            return Err(KvError::Memory(format!("{} bytes of shared memory for a {need}-byte pool", mem.len())));
        }
        let (mem, n, nb) = (Arc::new(mem), self.num_blocks * self.layout.block_elems(), self.num_blocks);
        let side = |v: bool| -> Result<Vec<Storage>, KvError> {
            (0..self.layout.n_layers)
                .map(|l| {
                    let at = self.layout.pool_offset(nb, l, v, 0);
                    Storage::shared(self.layout.dtype, &mem, at, n)
                        .ok_or_else(|| KvError::Memory(format!("shared memory misaligned for the pool at byte {at}")))
                })
                .collect()
        };
        let (k, v) = (side(false)?, side(true)?);
        (self.k, self.v) = (k, v);
        Ok(())
    }

    pub fn stats(&self) -> KvStats {
        let cached = self.evictable.len();
        let free = self.free.len();
        KvStats { total: self.num_blocks, used: self.num_blocks - cached - free, cached, free }
    }

    /// Blocks that an allocation could obtain now (free + evictable).
    pub fn available(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Allocates `n` blocks, all or none, evicting cached prefixes (oldest
    /// first) when the free list runs out.
    pub fn allocate(&mut self, n: usize) -> Result<Vec<BlockId>, KvError> {
        if n > self.available() {
            return Err(KvError::Exhausted { needed: n, available: self.available(), total: self.num_blocks });
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let b = match self.free.pop() {
                Some(b) => b,
                None => {
                    let (_, b) = self.evictable.pop_first().ok_or(KvError::Exhausted {
                        needed: n,
                        available: 0,
                        total: self.num_blocks,
                    })?;
                    if let Some(h) = self.hash_of[b as usize].take() {
                        self.by_hash.remove(&h);
                        self.prefix_epoch += 1;
                    }
                    b
                }
            };
            self.refs[b as usize] = 1;
            out.push(b);
        }
        Ok(out)
    }

    fn check(&self, b: BlockId) -> Result<usize, KvError> {
        let i = b as usize;
        if i >= self.num_blocks {
            return Err(KvError::InvalidBlock { block: b, why: "outside the pool" });
        }
        Ok(i)
    }

    /// Drops one reference to each block. A block nobody owns goes back to
    /// the free list, or — if it holds a registered prefix — to the
    /// evictable set where a later request can still find it.
    pub fn release(&mut self, blocks: &[BlockId]) -> Result<(), KvError> {
        for &b in blocks {
            let i = self.check(b)?;
            if self.refs[i] == 0 {
                return Err(KvError::InvalidBlock { block: b, why: "released while not owned" });
            }
            self.refs[i] -= 1;
            if self.refs[i] == 0 {
                if self.hash_of[i].is_some() {
                    self.tick += 1;
                    self.evict_tick[i] = self.tick;
                    self.evictable.insert(self.tick, b);
                } else {
                    self.free.push(b);
                }
            }
        }
        Ok(())
    }

    /// Chained hashes of the full blocks of `tokens` ([`prefix_hashes`]).
    pub fn prefix_hashes(&self, tokens: &[u32], salt: u64) -> Vec<PrefixHash> {
        prefix_hashes(tokens, self.layout.block_size, salt)
    }

    /// A number that changes whenever the set of indexed prefixes does.
    pub fn prefix_epoch(&self) -> u64 {
        self.prefix_epoch
    }

    /// Hashes of indexed blocks, at most `max`: those in use first, then
    /// cached ones, most recently released first (the last to be evicted).
    pub fn cached_prefixes(&self, max: usize) -> Vec<PrefixHash> {
        let in_use = self.hash_of.iter().zip(&self.refs).filter(|(_, &r)| r > 0).filter_map(|(h, _)| *h);
        let cached = self.evictable.values().rev().filter_map(|&b| self.hash_of[b as usize]);
        in_use.chain(cached).take(max).collect()
    }

    /// Takes a reference to the longest run of cached blocks matching
    /// `hashes` from the start, and returns them.
    pub fn acquire_prefix(&mut self, hashes: &[PrefixHash]) -> Vec<BlockId> {
        let mut out = Vec::new();
        for h in hashes {
            let Some(&b) = self.by_hash.get(h) else { break };
            let i = b as usize;
            if self.refs[i] == 0 {
                self.evictable.remove(&self.evict_tick[i]);
            }
            self.refs[i] += 1;
            out.push(b);
        }
        out
    }

    /// Records that `block` is full and holds the tokens `hash` names. A
    /// block with an equal hash already indexed wins (the caller keeps its
    /// private copy, which simply is not shared).
    pub fn register(&mut self, block: BlockId, hash: PrefixHash) -> Result<(), KvError> {
        let i = self.check(block)?;
        if self.refs[i] == 0 {
            return Err(KvError::InvalidBlock { block, why: "registered while not owned" });
        }
        if self.hash_of[i].is_none() && !self.by_hash.contains_key(&hash) {
            self.by_hash.insert(hash, block);
            self.hash_of[i] = Some(hash);
            self.prefix_epoch += 1;
        }
        Ok(())
    }

    /// Writes one token's K and V rows for `layer` into `slot` of `block`.
    pub fn write(&mut self, layer: usize, block: BlockId, slot: usize, k: &[f32], v: &[f32]) {
        let row = self.layout.row_elems();
        let at = (block as usize * self.layout.block_size + slot) * row;
        self.k[layer].write(at, &k[..row]);
        self.v[layer].write(at, &v[..row]);
    }

    /// One layer's whole K and V storage, for attention.
    pub fn layer(&self, layer: usize) -> (KvSlice<'_>, KvSlice<'_>) {
        (self.k[layer].slice(), self.v[layer].slice())
    }

    /// Bytes a gather of `n` blocks produces.
    pub fn gathered_len(&self, n: usize) -> usize {
        n * self.layout.block_bytes()
    }

    /// Copies the blocks of `table` into a contiguous little-endian buffer:
    /// for each layer, its K blocks in table order, then its V blocks.
    pub fn gather(&self, table: &[BlockId]) -> Result<Vec<u8>, KvError> {
        for &b in table {
            self.check(b)?;
        }
        let be = self.layout.block_elems();
        let mut out = Vec::with_capacity(self.gathered_len(table.len()));
        for l in 0..self.layout.n_layers {
            self.k[l].gather(be, table, &mut out);
            self.v[l].gather(be, table, &mut out);
        }
        Ok(out)
    }

    /// The inverse of [`gather`](Self::gather), into the blocks of `table`.
    pub fn scatter(&mut self, table: &[BlockId], bytes: &[u8]) -> Result<(), KvError> {
        for &b in table {
            self.check(b)?;
        }
        if bytes.len() != self.gathered_len(table.len()) {
            return Err(KvError::Shape(format!(
                "{} bytes for {} blocks of {} bytes",
                bytes.len(),
                table.len(),
                self.layout.block_bytes()
            )));
        }
        let be = self.layout.block_elems();
        let per = table.len() * be * self.layout.dtype.size();
        for l in 0..self.layout.n_layers {
            let base = 2 * l * per;
            self.k[l].scatter(be, table, &bytes[base..base + per]);
            self.v[l].scatter(be, table, &bytes[base + per..base + 2 * per]);
        }
        Ok(())
    }

    /// One layer's K and V of the blocks of `table`, each as contiguous
    /// little-endian bytes (blocks in table order): what the transfer path
    /// sends as soon as that layer is computed.
    pub fn gather_layer(&self, layer: usize, table: &[BlockId]) -> Result<(Vec<u8>, Vec<u8>), KvError> {
        let (mut k, mut v) = (Vec::new(), Vec::new());
        self.gather_layer_into(layer, table, &mut k, &mut v)?;
        Ok((k, v))
    }

    /// [`gather_layer`](Self::gather_layer) into caller-owned buffers
    /// (cleared first), so a sender streaming layer after layer reuses
    /// warm memory instead of faulting in fresh pages for every layer.
    pub fn gather_layer_into(
        &self,
        layer: usize,
        table: &[BlockId],
        k: &mut Vec<u8>,
        v: &mut Vec<u8>,
    ) -> Result<(), KvError> {
        self.check_layer(layer)?;
        for &b in table {
            self.check(b)?;
        }
        let be = self.layout.block_elems();
        k.clear();
        v.clear();
        self.k[layer].gather(be, table, k);
        self.v[layer].gather(be, table, v);
        Ok(())
    }

    /// One layer's whole K and V storage as little-endian bytes: block `b`'s
    /// K is `k[b * s..(b + 1) * s]` with `s` = [`KvLayout::side_bytes`], V
    /// likewise, and a run of consecutive blocks is one contiguous range (a
    /// sender copies such runs out with no gather).
    pub fn layer_bytes(&self, layer: usize) -> Result<(&[u8], &[u8]), KvError> {
        self.check_layer(layer)?;
        Ok((self.k[layer].le_bytes()?, self.v[layer].le_bytes()?))
    }

    /// Writes one layer's K and V bytes (as [`gather_layer`](Self::gather_layer)
    /// produces them) into the blocks of `table`.
    pub fn scatter_layer(&mut self, layer: usize, table: &[BlockId], k: &[u8], v: &[u8]) -> Result<(), KvError> {
        self.check_layer(layer)?;
        for &b in table {
            self.check(b)?;
        }
        let n = table.len() * self.layout.block_elems() * self.layout.dtype.size();
        if k.len() != n || v.len() != n {
            return Err(KvError::Shape(format!(
                "layer {layer}: K {} and V {} bytes for {} blocks, expected {n} each",
                k.len(),
                v.len(),
                table.len()
            )));
        }
        let be = self.layout.block_elems();
        self.k[layer].scatter(be, table, k);
        self.v[layer].scatter(be, table, v);
        Ok(())
    }

    fn check_layer(&self, layer: usize) -> Result<(), KvError> {
        if layer >= self.layout.n_layers {
            return Err(KvError::Shape(format!("layer {layer} of {}", self.layout.n_layers)));
        }
        Ok(())
    }

    /// Zeroes the blocks of `table` (tests use it to prove a scatter restores them).
    pub fn clear(&mut self, table: &[BlockId]) -> Result<(), KvError> {
        for &b in table {
            self.check(b)?;
        }
        let be = self.layout.block_elems();
        for l in 0..self.layout.n_layers {
            self.k[l].clear_blocks(be, table);
            self.v[l].clear_blocks(be, table);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> KvLayout {
        KvLayout { n_layers: 2, n_kv_heads: 1, head_dim: 4, block_size: 2, dtype: KvDtype::F16 }
    }

    /// Zeroed, 8-byte-aligned memory as a `SharedMemory`, and where it is.
    #[allow(unsafe_code)]
    fn shared(bytes: usize) -> (SharedMemory, *const u8) {
        let mut words = vec![0u64; bytes.div_ceil(8)].into_boxed_slice();
        let ptr = std::ptr::NonNull::new(words.as_mut_ptr().cast::<u8>()).expect("non-null");
        // SAFETY: the box owns `bytes` zeroed bytes at `ptr` and moves (unmoved
        // on the heap) into the owner; nothing else references them.
        let mem = unsafe { SharedMemory::new(ptr, bytes, Box::new(words)) };
        (mem, ptr.as_ptr())
    }

    /// The pool's blocks live where `KvLayout::pool_offset` says once it adopts
    /// shared memory: a peer writing there is what the engine reads.
    #[test]
    #[allow(unsafe_code)]
    fn an_adopted_pool_keeps_each_block_where_pool_offset_says() {
        let l = layout();
        let mut p = KvPool::new(l, 3).expect("pool");
        let (mem, base) = shared(l.pool_bytes(3).expect("size"));
        p.adopt(mem).expect("adopt");
        let b = p.allocate(3).expect("blocks");
        let (row, side) = (l.row_elems(), l.side_bytes());
        for (i, &blk) in b.iter().enumerate() {
            for layer in 0..l.n_layers {
                let k: Vec<f32> = (0..row).map(|e| (100 * i + 10 * layer + e) as f32).collect();
                let v: Vec<f32> = k.iter().map(|x| -x).collect();
                p.write(layer, blk, 1, &k, &v);
            }
        }
        for &blk in &b {
            for layer in 0..l.n_layers {
                let (k, v) = p.gather_layer(layer, &[blk]).expect("gather");
                for (side_v, want) in [(false, k), (true, v)] {
                    let at = l.pool_offset(3, layer, side_v, blk as usize);
                    // SAFETY: `at + side` lies inside the adopted memory, which `p` keeps alive.
                    let got = unsafe { std::slice::from_raw_parts(base.add(at), side) };
                    assert_eq!(got, &want[..], "layer {layer} block {blk} v={side_v}");
                }
            }
        }
        // A pool in use cannot move; nor can one into memory too small.
        let (mem, _) = shared(l.pool_bytes(3).expect("size"));
        assert!(matches!(p.adopt(mem), Err(KvError::Config(_))));
        p.release(&b).expect("release");
        let (small, _) = shared(l.pool_bytes(3).expect("size") - 1);
        assert!(matches!(p.adopt(small), Err(KvError::Memory(_))));
    }

    /// This process's resident bytes (`/proc/self/statm`, pages of 4 KiB).
    #[cfg(target_os = "linux")]
    fn resident_bytes() -> usize {
        let statm = std::fs::read_to_string("/proc/self/statm").expect("statm");
        let pages: usize = statm.split_whitespace().nth(1).and_then(|p| p.parse().ok()).expect("resident pages");
        pages * 4096
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn commit_backs_the_whole_pool_with_memory_that_a_new_pool_does_not_hold_yet() {
        // 2 layers x K,V x 1,024 blocks x 16 tokens x 8 heads x 64 dims x 2 bytes: 64 MiB.
        let big = KvLayout { n_layers: 2, n_kv_heads: 8, head_dim: 64, block_size: 16, dtype: KvDtype::F16 };
        let before = resident_bytes();
        let mut p = KvPool::new(big, 1024).expect("pool");
        let fresh = resident_bytes().saturating_sub(before);
        let bytes = p.commit().expect("commit");
        assert_eq!(bytes, 64 << 20, "commit covers every layer's K and V");
        let committed = resident_bytes().saturating_sub(before);
        assert!(fresh < bytes / 4, "a new pool is not resident yet ({fresh} of {bytes} bytes): nothing to test");
        assert!(committed >= bytes * 9 / 10, "after commit {committed} of {bytes} bytes are resident");
        // Still a zeroed, working pool.
        let b = p.allocate(1).expect("a block");
        assert!(p.gather(&b).expect("gather").iter().all(|&x| x == 0));
    }

    #[test]
    fn allocate_is_all_or_nothing_and_release_frees() {
        let mut p = KvPool::new(layout(), 4).expect("pool");
        let a = p.allocate(3).expect("3 fit");
        assert_eq!(p.stats().used, 3);
        assert!(matches!(p.allocate(2), Err(KvError::Exhausted { needed: 2, available: 1, total: 4 })));
        assert_eq!(p.stats().used, 3, "failed allocation must not leak");
        p.release(&a).expect("release");
        assert_eq!(p.stats(), KvStats { total: 4, used: 0, cached: 0, free: 4 });
        assert!(p.release(&a[..1]).is_err(), "double release is an error");
        assert!(p.release(&[9]).is_err());
    }

    #[test]
    fn prefix_is_shared_then_cached_then_evicted() {
        let mut p = KvPool::new(layout(), 3).expect("pool");
        let toks = [1, 2, 3, 4, 5];
        let hashes = p.prefix_hashes(&toks, 0);
        assert_eq!(hashes.len(), 2);
        let blocks = p.allocate(2).expect("alloc");
        p.register(blocks[0], hashes[0]).expect("reg");
        p.register(blocks[1], hashes[1]).expect("reg");
        // A second sequence shares both.
        let shared = p.acquire_prefix(&hashes);
        assert_eq!(shared, blocks);
        p.release(&shared).expect("release");
        p.release(&blocks).expect("release");
        assert_eq!(p.stats().cached, 2);
        assert_eq!(p.stats().used, 0);
        // Still findable after release.
        assert_eq!(p.acquire_prefix(&hashes[..1]), vec![blocks[0]]);
        p.release(&[blocks[0]]).expect("release");
        // Pressure evicts the oldest released (blocks[1] was released first... then blocks[0] again).
        let all = p.allocate(3).expect("evicts both cached");
        assert_eq!(all.len(), 3);
        assert!(p.acquire_prefix(&hashes).is_empty(), "evicted prefixes are gone");
    }

    #[test]
    fn salt_and_parent_change_hashes() {
        let p = KvPool::new(layout(), 1).expect("pool");
        let a = p.prefix_hashes(&[1, 2, 3, 4], 0);
        let b = p.prefix_hashes(&[1, 2, 3, 4], 7);
        let c = p.prefix_hashes(&[9, 9, 3, 4], 0);
        assert_ne!(a[0], b[0]);
        assert_ne!(a[1], c[1], "same block tokens after another prefix must differ");
    }

    /// The chain is a wire format (workers report it, coordinators compute it to route, a
    /// fleet mixes releases during an upgrade): SHA-256 of the parent (u64) and the block's
    /// tokens (u32 each), little-endian, its first 8 bytes the hash. Frozen values,
    /// computed apart from this code (Python's `hashlib`).
    #[test]
    fn the_hash_chain_is_frozen() {
        let tokens: Vec<u32> = (1000..1032).collect();
        assert_eq!(prefix_hashes(&tokens, 16, 42), [0xd4f8_5a86_6e43_e819, 0x0e88_e93a_85e4_9b6b]);
    }

    #[test]
    fn gather_clear_scatter_is_bit_exact() {
        for dtype in [KvDtype::F16, KvDtype::F32] {
            let mut p = KvPool::new(KvLayout { dtype, ..layout() }, 5).expect("pool");
            let t = p.allocate(3).expect("alloc");
            for l in 0..2 {
                for (i, &b) in t.iter().enumerate() {
                    for s in 0..2 {
                        let k: Vec<f32> = (0..4).map(|j| (l * 100 + i * 10 + s * 4 + j) as f32 * 0.37).collect();
                        let v: Vec<f32> = k.iter().map(|x| -x).collect();
                        p.write(l, b, s, &k, &v);
                    }
                }
            }
            let buf = p.gather(&t).expect("gather");
            assert_eq!(buf.len(), p.gathered_len(3));
            p.clear(&t).expect("clear");
            assert_ne!(p.gather(&t).expect("gather"), buf);
            p.scatter(&t, &buf).expect("scatter");
            assert_eq!(p.gather(&t).expect("gather"), buf);
            assert!(p.scatter(&t, &buf[1..]).is_err());
            // Layer by layer into other blocks gives the same bytes.
            let other = p.allocate(2).expect("alloc");
            let mut q = KvPool::new(KvLayout { dtype, ..layout() }, 5).expect("pool");
            let dst = q.allocate(3).expect("alloc");
            for l in 0..2 {
                let (k, v) = p.gather_layer(l, &t).expect("gather layer");
                // The same bytes where they lie: block b's at b * side of the layer's storage.
                let (lk, lv) = p.layer_bytes(l).expect("layer bytes");
                let side = p.layout().side_bytes();
                assert_eq!((lk.len(), lv.len()), (5 * side, 5 * side));
                for (i, &b) in t.iter().enumerate() {
                    let at = b as usize * side;
                    assert_eq!(&lk[at..at + side], &k[i * side..(i + 1) * side]);
                    assert_eq!(&lv[at..at + side], &v[i * side..(i + 1) * side]);
                }
                q.scatter_layer(l, &dst, &k, &v).expect("scatter layer");
                assert!(q.scatter_layer(l, &dst, &k[1..], &v).is_err());
            }
            assert!(p.gather_layer(2, &t).is_err());
            assert!(p.layer_bytes(2).is_err());
            assert_eq!(q.gather(&dst).expect("gather"), buf);
            p.release(&other).expect("release");
        }
    }
}
