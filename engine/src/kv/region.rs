//! Memory for the KV pool: one anonymous, page-aligned, zeroed mapping per
//! layer's K or V, which the kernel backs with pages at their first write
//! unless [`Region::commit`] backs it all at once — or a part of a
//! [`SharedMemory`] the pool adopted, which a peer process writes into
//! ([`KvPool::adopt`](super::KvPool::adopt)).
//!
//! Why a mapping and not a `Vec`: a committed region is populated by one
//! `MADV_POPULATE_WRITE` call, which returns ENOMEM as an error where a
//! `Vec` touched page by page would be killed, and costs 0.1-0.4 s for the
//! default SmolLM2 pool (360 MiB) at worker start on the 2-core CI machine
//! against 1.4-2 s for touching each 4 KiB page of a `Vec` (two workers
//! starting together), a cost every process test pays. Transparent huge
//! pages were tried (`MADV_HUGEPAGE` before populating): 46 ms on a quiet
//! host, but 1.4-2.4 s when the kernel had to compact memory for them, so
//! the pool stays in 4 KiB pages.

use std::io;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use memmap2::MmapMut;

/// The smallest page the kernel backs memory with (4 KiB on x86_64 and on
/// common aarch64 kernels); touching a larger page more than once is harmless.
const PAGE_BYTES: usize = 4096;

/// Memory the pool can live in that something else allocated (a UCX registration peers
/// write into); defined in `types` so the transport that allocates it needs no engine.
pub use types::memory::SharedMemory;

enum Backing {
    Own(MmapMut),
    /// Bytes `at..` of a shared allocation.
    Shared {
        mem: Arc<SharedMemory>,
        at: usize,
    },
}

/// `len` elements of `T`, zeroed.
pub(super) struct Region<T> {
    backing: Backing,
    len: usize,
    _elem: PhantomData<T>,
}

impl<T: bytemuck::Pod> Region<T> {
    pub(super) fn zeroed(len: usize) -> io::Result<Self> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "KV region size overflows"))?;
        // A zero-length mapping is refused by the kernel; one byte stands in.
        let map = MmapMut::map_anon(bytes.max(1))?;
        Ok(Self { backing: Backing::Own(map), len, _elem: PhantomData })
    }

    /// `len` elements at byte `at` of `mem`, or `None` if they do not fit or
    /// `at` is not aligned for `T` there.
    pub(super) fn shared(mem: &Arc<SharedMemory>, at: usize, len: usize) -> Option<Self> {
        let bytes = len.checked_mul(std::mem::size_of::<T>())?;
        let fits = at.checked_add(bytes).is_some_and(|end| end <= mem.len());
        let aligned = (mem.ptr().as_ptr() as usize).wrapping_add(at) % std::mem::align_of::<T>() == 0;
        (fits && aligned).then(|| Self { backing: Backing::Shared { mem: mem.clone(), at }, len, _elem: PhantomData })
    }

    fn base(&self) -> *mut u8 {
        match &self.backing {
            Backing::Own(map) => map.as_ptr().cast_mut(),
            Backing::Shared { mem, at } => mem.ptr().as_ptr().wrapping_add(*at),
        }
    }

    fn bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    /// Backs every page with memory now; returns the bytes covered. An
    /// error (ENOMEM: the host cannot hold the pool) leaves the region
    /// usable but possibly only partly backed.
    pub(super) fn commit(&mut self) -> io::Result<usize> {
        if let Backing::Shared { .. } = self.backing {
            // Its owner backed it (UCX zero-fills what it allocates); touching it
            // here could overwrite what a peer already wrote.
            return Ok(self.bytes());
        }
        #[cfg(target_os = "linux")]
        if let Backing::Own(map) = &self.backing {
            match map.advise(memmap2::Advice::PopulateWrite) {
                Ok(()) => return Ok(self.bytes()),
                // Kernels before 5.14 do not know the advice: touch instead.
                Err(e) if e.kind() == io::ErrorKind::InvalidInput => {}
                Err(e) => return Err(e),
            }
        }
        let bytes = self.bytes();
        let step = (PAGE_BYTES / std::mem::size_of::<T>().max(1)).max(1);
        for x in self.iter_mut().step_by(step) {
            // `black_box` keeps the store from being proven redundant (the
            // region is known to be zero).
            *x = std::hint::black_box(T::zeroed());
        }
        Ok(bytes)
    }
}

impl<T: bytemuck::Pod> Deref for Region<T> {
    type Target = [T];

    #[allow(unsafe_code)]
    fn deref(&self) -> &[T] {
        // SAFETY: `base()` is aligned for `T` (a page-aligned mapping, or
        // checked by `shared`) and valid for `len` elements while `self`
        // keeps the mapping or the shared memory alive; any bit pattern is a
        // `T` (Pod). What a peer may write meanwhile is `SharedMemory`'s contract.
        unsafe { std::slice::from_raw_parts(self.base().cast_const().cast::<T>(), self.len) }
    }
}

impl<T: bytemuck::Pod> DerefMut for Region<T> {
    #[allow(unsafe_code)]
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`; `&mut self` makes this the only reference
        // into the region from this process.
        unsafe { std::slice::from_raw_parts_mut(self.base().cast::<T>(), self.len) }
    }
}

impl<T> std::fmt::Debug for Region<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region").field("len", &self.len).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_region_is_zeroed_writable_and_as_long_as_asked() {
        let mut r = Region::<u16>::zeroed(3 * PAGE_BYTES + 5).expect("region");
        assert_eq!(r.len(), 3 * PAGE_BYTES + 5);
        assert!(r.iter().all(|&x| x == 0));
        r[7] = 9;
        let last = r.len() - 1;
        r[last] = 4;
        assert_eq!(r.commit().expect("commit"), (3 * PAGE_BYTES + 5) * 2);
        assert_eq!((r[7], r[last], r[8]), (9, 4, 0), "commit keeps what was written");
        assert_eq!(Region::<f32>::zeroed(0).expect("empty region").len(), 0);
    }
}
