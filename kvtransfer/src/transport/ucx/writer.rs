//! Direct stores from the thread that holds the KV.
//!
//! On the direct path the sender's connection thread stores each layer it
//! is handed into the decode worker's pool, mapped into this process. Handed
//! means gathered first: the prefill engine copies the layer's blocks out of
//! its own pool into buffers, and the connection thread copies those into
//! the decode pool, two copies of every byte. A [`UcxDirectWriter`] removes
//! the first: the engine's thread, right after the forward pass wrote a
//! layer, copies its blocks from its own pool straight into the
//! reservation's blocks of the decode pool, the CRC-32C taken on the words
//! as they are stored ([`checksum::copy_crc_streaming`]), and hands the connection
//! only a [`StoredLayer`] (which blocks, their checksum) to announce in the
//! `Layer` message ([`UcxKvSender::announce`](super::UcxKvSender::announce)).
//!
//! # The fence still holds
//!
//! A writer stores only while its grant is live, under a read lock; the
//! connection thread revokes it, under the write lock (so after any store
//! in progress finished), before it sends anything that tells the server
//! this process has stopped writing the reservation's blocks: `Complete`,
//! `Abort`, `Fenced`, `Bye`, or before it drops the mapping. A store after
//! that is refused ([`TransferError::Revoked`]) and writes nothing. So every
//! store a writer makes precedes, in this process, the message the server's
//! quarantine waits for, exactly as the connection thread's own stores do;
//! a process that dies or is stopped mid-store is fenced as before (the
//! server waits for the process to exit).

#![allow(unsafe_code)]

use std::ptr::NonNull;
use std::sync::atomic::Ordering;
use std::sync::{Arc, RwLock, RwLockReadGuard};

use types::kv::KvLayout;

use super::runs::{runs, Run};
use crate::checksum;
use crate::sender::SplitError;
use crate::session::Reservation;
use crate::transport::error::TransferError;

/// A reservation's blocks of the decode worker's pool, mapped into this
/// process, to store into from any thread (see the module docs). Cheap to
/// clone; obtained from [`UcxKvSender::direct_writer`](super::UcxKvSender::direct_writer).
#[derive(Clone)]
pub struct UcxDirectWriter {
    grant: Arc<Grant>,
}

impl std::fmt::Debug for UcxDirectWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UcxDirectWriter").field("reservation", &self.grant.r).finish_non_exhaustive()
    }
}

/// One layer's blocks a [`UcxDirectWriter`] stored: what the `Layer`
/// message announces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoredLayer {
    pub reservation: Reservation,
    pub layer: usize,
    /// Blocks `first_block..first_block + n_blocks` of the reservation.
    pub first_block: usize,
    pub n_blocks: usize,
    /// CRC-32C of what was stored: every block's K in order, then every V.
    pub checksum: u32,
    /// K and V bytes stored.
    pub bytes: usize,
}

/// The shared state of a writer; the connection thread keeps one per
/// reservation it handed a writer for, to revoke it.
pub(super) struct Grant {
    r: Reservation,
    layout: KvLayout,
    side: usize,
    /// `None` once revoked.
    target: RwLock<Option<Target>>,
}

/// Where a live grant stores.
struct Target {
    /// The decode worker's whole pool, mapped here.
    pool: NonNull<u8>,
    num_blocks: usize,
    /// The reservation's blocks, as granted, each below `num_blocks`.
    blocks: Vec<u32>,
}

// SAFETY: `pool` points into shared memory that stays mapped while the
// target is `Some` (the connection thread holds the key that maps it, and
// clears the target under the write lock before dropping the key). Stores
// through it are made only under the read lock, into the reservation's own
// blocks; no reference into the mapping is ever formed.
unsafe impl Send for Target {}
// SAFETY: as above; `&Target` only reads the pointer value and the block ids.
unsafe impl Sync for Target {}

impl Grant {
    /// A live grant of `blocks` of the pool mapped at `pool`
    /// (`layout.pool_bytes(num_blocks)` bytes).
    ///
    /// # Safety
    /// `pool` stays valid for writes of that many bytes until [`revoke`](Self::revoke)
    /// returns, and nothing in this process reads or writes the granted
    /// blocks through another path meanwhile.
    pub(super) unsafe fn new(
        r: Reservation,
        layout: KvLayout,
        pool: NonNull<u8>,
        num_blocks: usize,
        blocks: Vec<u32>,
    ) -> Result<Arc<Self>, TransferError> {
        if blocks.iter().any(|&b| b as usize >= num_blocks) {
            return Err(TransferError::Protocol("a granted pool block is outside the decode worker's pool".into()));
        }
        let target = Target { pool, num_blocks, blocks };
        Ok(Arc::new(Self { r, layout, side: layout.side_bytes(), target: RwLock::new(Some(target)) }))
    }

    /// Stops the writer: waits for a store in progress, then refuses every
    /// later one. After it returns nothing of this process's writers
    /// touches the pool for this reservation.
    pub(super) fn revoke(&self) {
        *self.target.write().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// The target, held against revocation, if the grant is live.
    fn live(&self) -> Result<RwLockReadGuard<'_, Option<Target>>, TransferError> {
        let guard = self.target.read().unwrap_or_else(|p| p.into_inner());
        if guard.is_none() {
            return Err(TransferError::Revoked { reservation: self.r.id.0, generation: self.r.generation });
        }
        Ok(guard)
    }
}

impl UcxDirectWriter {
    pub(super) fn new(grant: Arc<Grant>) -> Self {
        Self { grant }
    }

    /// The reservation it stores for.
    pub fn reservation(&self) -> Reservation {
        self.grant.r
    }

    /// Whether it still stores (its grant was not revoked).
    pub fn is_live(&self) -> bool {
        self.grant.live().is_ok()
    }

    /// Stores layer `layer`'s K and V of the reservation's blocks
    /// `first_block..first_block + blocks.len()` from the sender's own pool:
    /// `k` and `v` are that layer's whole K and V storage there (block `b`
    /// at `b * side_bytes`, as `KvPool::layer_bytes` gives them) and
    /// `blocks` the sender pool's ids of those blocks. Runs of blocks
    /// consecutive on both sides are copied as one piece. Returns what to
    /// [`announce`](super::UcxKvSender::announce).
    ///
    /// Errors, having stored nothing, if the shapes do not fit or the grant
    /// was revoked ([`TransferError::Revoked`]).
    pub fn store_layer(
        &self,
        layer: usize,
        first_block: usize,
        k: &[u8],
        v: &[u8],
        blocks: &[u32],
    ) -> Result<StoredLayer, TransferError> {
        let g = &self.grant;
        let side = g.side;
        if layer >= g.layout.n_layers {
            return Err(SplitError::LayerOutOfRange { layer, n_layers: g.layout.n_layers }.into());
        }
        let per_block = 2 * side;
        let whole =
            |b: u32| (b as usize).checked_add(1).and_then(|e| e.checked_mul(side)).is_some_and(|e| e <= k.len());
        if blocks.is_empty() || k.len() != v.len() || !blocks.iter().all(|&b| whole(b)) {
            return Err(SplitError::Shape { len: k.len() + v.len(), per_block }.into());
        }
        let guard = g.live()?;
        let Some(target) = guard.as_ref() else { unreachable!("live() checked it") };
        let n = blocks.len();
        let Some(ours) = first_block.checked_add(n).and_then(|end| target.blocks.get(first_block..end)) else {
            return Err(SplitError::TooManyBlocks { n_blocks: first_block.saturating_add(n) }.into());
        };
        let runs = runs(blocks.iter().zip(ours).map(|(&from, &to)| (from as usize, to as usize)));
        let mut crc = 0;
        for (is_v, src) in [(false, k), (true, v)] {
            for &Run { from, to, len, .. } in &runs {
                let at = g.layout.pool_offset(target.num_blocks, layer, is_v, to);
                // SAFETY: `to + len <= num_blocks` (every granted block is below it, and
                // a run is consecutive granted blocks), so the destination is inside
                // the pool the target maps, which stays mapped while we hold the read
                // lock (`Grant::new`); the source is inside `src` (`whole`), a slice of
                // this process's own memory that cannot overlap the peer's mapping.
                crc = unsafe {
                    checksum::copy_crc_streaming(
                        src.as_ptr().add(from * side),
                        target.pool.as_ptr().add(at),
                        len * side,
                        crc,
                    )
                };
            }
        }
        // Drills only (built with `fault-injection` and armed): a byte of K flipped after
        // the checksum.
        #[cfg(feature = "fault-injection")]
        if let Some(off) = crate::transport::fault::flip_in_place(layer, first_block, n * side) {
            let run = runs.iter().rev().find(|r| r.index * side <= off).copied().unwrap_or(runs[0]);
            let at = g.layout.pool_offset(target.num_blocks, layer, false, run.to) + (off - run.index * side);
            // SAFETY: `off < n * side` lies in the K piece of `run`, the last run
            // starting at or before it (runs cover the blocks in order), inside the
            // mapped pool as above.
            unsafe {
                let p = target.pool.as_ptr().add(at);
                p.write_volatile(p.read_volatile() ^ 0xff);
            }
        }
        // Every store is done before the caller hands the result on (and so
        // before the `Layer` message): copies may use weakly ordered stores.
        std::sync::atomic::fence(Ordering::SeqCst);
        drop(guard);
        Ok(StoredLayer { reservation: g.r, layer, first_block, n_blocks: n, checksum: crc, bytes: n * per_block })
    }
}

/// The grants a connection handed writers for, revoked when it ends
/// (declared in `Link` before the pool key that maps their memory, so that
/// it drops first).
#[derive(Default)]
pub(super) struct Grants(Vec<Arc<Grant>>);

impl Grants {
    pub(super) fn get(&self, r: Reservation) -> Option<&Arc<Grant>> {
        self.0.iter().find(|g| g.r == r)
    }

    pub(super) fn push(&mut self, g: Arc<Grant>) {
        self.0.push(g);
    }

    /// Revokes and forgets `r`'s grant, if any.
    pub(super) fn revoke(&mut self, r: Reservation) {
        self.0.retain(|g| {
            if g.r == r {
                g.revoke();
            }
            g.r != r
        });
    }

    pub(super) fn revoke_all(&mut self) {
        for g in self.0.drain(..) {
            g.revoke();
        }
    }
}

impl Drop for Grants {
    fn drop(&mut self) {
        self.revoke_all();
    }
}
