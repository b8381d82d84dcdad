//! A fixed pool of worker threads for data-parallel kernel calls.
//!
//! A decode step makes ~120 parallel calls (matmuls, attention, norms, the
//! output head), each only tens of microseconds long, so dispatch cost
//! matters more than generality. The caller publishes a job — `n` items —
//! by bumping an epoch counter; workers spin briefly on that counter, then
//! park so an idle engine burns no CPU. Items are claimed one at a time from
//! an atomic counter, and the caller claims them too, so:
//! - `threads = 1` spawns nothing, and
//! - a worker that the OS has descheduled (the machine is oversubscribed)
//!   does not stall the call: it simply claims nothing, the others take its
//!   share, and the caller waits only for items already being computed.
//!   A static split would instead wait a whole scheduler slice for it on
//!   every call, which measured here cut decode speed by 20x under load.
//!
//! Which thread computes an item never changes its result: kernels compute
//! each output with one fixed instruction sequence.

#![allow(clippy::disallowed_types, reason = "the compute pool spins on its own threads for a wall-clock budget")]
#![allow(unsafe_code)]

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle, Thread};
use std::time::{Duration, Instant};

/// How long an idle worker spins before parking. Long enough to bridge the
/// gap between two kernel calls of one step, short enough not to matter
/// when the engine is idle.
const SPIN: Duration = Duration::from_micros(200);

/// Set in `state` when a job accepts no more workers; the low bits count
/// the workers inside the job.
const CLOSED: usize = 1 << (usize::BITS - 1);

type Job = dyn Fn(usize) + Sync;

struct Shared {
    epoch: AtomicU64,
    /// The current job as a type-erased fat pointer; valid while its state is open
    /// or any worker is inside it.
    job: Mutex<Option<JobPtr>>,
    n_items: AtomicUsize,
    next: AtomicUsize,
    state: AtomicUsize,
    panicked: AtomicBool,
    shutdown: AtomicBool,
    n_threads: usize,
}

#[derive(Clone, Copy)]
struct JobPtr(*const Job);
// SAFETY: the pointee is `Sync`; `for_each` keeps it alive until the job is
// closed and no worker is inside it (see `Close`).
unsafe impl Send for JobPtr {}

/// A fixed set of threads that run one job at a time.
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<(JoinHandle<()>, Thread)>,
    /// Serialises callers: one job at a time.
    gate: Mutex<()>,
}

impl ThreadPool {
    /// A pool of `threads` threads in total (the caller counts as one).
    pub fn new(threads: usize) -> std::io::Result<Self> {
        let n_threads = threads.max(1);
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            job: Mutex::new(None),
            n_items: AtomicUsize::new(0),
            next: AtomicUsize::new(0),
            state: AtomicUsize::new(CLOSED),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            n_threads,
        });
        let mut workers = Vec::with_capacity(n_threads - 1);
        for index in 1..n_threads {
            let s = Arc::clone(&shared);
            let handle =
                thread::Builder::new().name(format!("tandem-kernel-{index}")).spawn(move || worker_loop(&s))?;
            let t = handle.thread().clone();
            workers.push((handle, t));
        }
        Ok(Self { shared, workers, gate: Mutex::new(()) })
    }

    pub fn threads(&self) -> usize {
        self.shared.n_threads
    }

    /// Calls `f(i)` exactly once for every `i` in `0..n`, spread over the
    /// pool, and returns when all calls have finished. A panic in any call
    /// is re-raised here after every thread is done with `f`.
    pub fn for_each(&self, n: usize, f: &(dyn Fn(usize) + Sync)) {
        if self.shared.n_threads == 1 || n <= 1 {
            (0..n).for_each(f);
            return;
        }
        let _one_at_a_time = self.gate.lock().unwrap_or_else(|e| e.into_inner());
        let s = &*self.shared;
        // SAFETY: erase the lifetime of `f`. Workers dereference the pointer
        // only while registered in `state`; `Close` (dropped before this
        // function returns, even if `f` panics on this thread) marks the job
        // closed and waits until no worker is registered, so `f` outlives
        // every use.
        let ptr: *const Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), &'static Job>(f) };
        *s.job.lock().unwrap_or_else(|e| e.into_inner()) = Some(JobPtr(ptr));
        s.panicked.store(false, Ordering::Relaxed);
        s.n_items.store(n, Ordering::Relaxed);
        s.next.store(0, Ordering::Relaxed);
        s.state.store(0, Ordering::Release);
        s.epoch.fetch_add(1, Ordering::AcqRel);
        for (_, t) in &self.workers {
            t.unpark();
        }
        let close = Close(s);
        loop {
            let i = s.next.fetch_add(1, Ordering::Relaxed);
            if i >= n {
                break;
            }
            f(i);
        }
        drop(close);
        if s.panicked.swap(false, Ordering::AcqRel) {
            panic!("a kernel worker thread panicked");
        }
    }

    /// Calls `f` on consecutive ranges of at most `chunk` items covering `0..n`.
    pub fn for_ranges(&self, n: usize, chunk: usize, f: &(dyn Fn(Range<usize>) + Sync)) {
        let chunk = chunk.max(1);
        self.for_each(n.div_ceil(chunk), &|i| f(i * chunk..((i + 1) * chunk).min(n)));
    }

    /// Splits `data` into items of `item` elements and calls `f(range, part)` on consecutive
    /// ranges of at most `chunk` items covering them all, where `part` is those items of
    /// `data`, lent mutably: the parts are disjoint by construction, so a caller cannot write
    /// another range's items. `data.len()` must be a multiple of `item` (which must not be 0).
    pub fn for_chunks_mut<T: Copy + Send>(
        &self,
        data: &mut [T],
        item: usize,
        chunk: usize,
        f: &(dyn Fn(Range<usize>, &mut [T]) + Sync),
    ) {
        assert!(item > 0 && data.len() % item == 0, "{} elements are not whole items of {item}", data.len());
        let n = data.len() / item;
        let shared = SharedSlice::new(data);
        self.for_ranges(n, chunk, &|r| {
            // SAFETY: `for_ranges` calls every range of a partition of 0..n exactly once
            // (`for_each`'s contract), so the element ranges handed out here are disjoint,
            // and `data` stays exclusively borrowed until this function returns.
            let part = unsafe { shared.range_mut(r.start * item..r.end * item) };
            f(r, part)
        });
    }
}

/// Closes the current job on drop and waits for the workers inside it, so a
/// panic in the caller's share cannot free the job while workers run it.
struct Close<'a>(&'a Shared);

impl Drop for Close<'_> {
    fn drop(&mut self) {
        let s = self.0;
        // Stop handing out items, then stop admitting workers.
        s.next.fetch_add(s.n_items.load(Ordering::Relaxed), Ordering::Relaxed);
        s.state.fetch_or(CLOSED, Ordering::AcqRel);
        let mut spins = 0u32;
        while s.state.load(Ordering::Acquire) & !CLOSED != 0 {
            spins = spins.wrapping_add(1);
            // A worker inside is computing its last item; if the OS has taken
            // its core, give ours up rather than spin against it.
            if spins % 1024 == 0 {
                thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        *s.job.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
}

/// Registers a worker in the open job; false if the job is closed.
fn join(s: &Shared) -> bool {
    let mut cur = s.state.load(Ordering::Acquire);
    loop {
        if cur & CLOSED != 0 {
            return false;
        }
        match s.state.compare_exchange_weak(cur, cur + 1, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return true,
            Err(now) => cur = now,
        }
    }
}

fn worker_loop(s: &Shared) {
    let mut seen = 0u64;
    loop {
        let started = Instant::now();
        let mut spins = 0u32;
        loop {
            if s.shutdown.load(Ordering::Acquire) {
                return;
            }
            let e = s.epoch.load(Ordering::Acquire);
            if e != seen {
                seen = e;
                break;
            }
            spins = spins.wrapping_add(1);
            if spins % 64 == 0 && started.elapsed() > SPIN {
                // Parks until `for_each` or `drop` unparks; a stale unpark
                // token just sends us round the loop once more.
                thread::park_timeout(Duration::from_millis(50));
            } else {
                std::hint::spin_loop();
            }
        }
        if !join(s) {
            continue;
        }
        // Registered: the job (whichever is open now) stays alive until we leave.
        let job = *s.job.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(JobPtr(ptr)) = job {
            // SAFETY: see `ThreadPool::for_each`.
            let f = unsafe { &*ptr };
            let n = s.n_items.load(Ordering::Relaxed);
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| loop {
                let i = s.next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    break;
                }
                f(i);
            }));
            if r.is_err() {
                s.panicked.store(true, Ordering::Release);
            }
        }
        s.state.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        for (handle, t) in self.workers.drain(..) {
            t.unpark();
            let _ = handle.join();
        }
    }
}

/// A mutable slice that pool threads write disjoint elements of.
///
/// A matmul's work items own disjoint weight rows, i.e. disjoint *columns*
/// of a row-major output, so the output cannot be split into per-item
/// sub-slices; each item writes single elements through this instead.
pub struct SharedSlice<'a, T> {
    ptr: *mut T,
    len: usize,
    _borrow: std::marker::PhantomData<&'a mut [T]>,
}

// SAFETY: callers write disjoint indices (each thread its own rows); the
// slice is exclusively borrowed for 'a, so nothing else reads it meanwhile.
unsafe impl<T: Send> Sync for SharedSlice<'_, T> {}

impl<'a, T: Copy> SharedSlice<'a, T> {
    pub fn new(s: &'a mut [T]) -> Self {
        Self { ptr: s.as_mut_ptr(), len: s.len(), _borrow: std::marker::PhantomData }
    }

    /// Writes element `i` (bounds-checked).
    ///
    /// # Safety
    /// No other thread may read or write element `i` while this slice lives: callers
    /// partition the indices between threads (each thread its own output rows).
    #[inline]
    pub unsafe fn set(&self, i: usize, v: T) {
        assert!(i < self.len, "SharedSlice index {i} out of bounds {}", self.len);
        // SAFETY: in bounds (checked above); exclusive access to `i` is the caller's
        // contract, and `T: Copy` has no drop.
        unsafe { self.ptr.add(i).write(v) }
    }

    /// A mutable sub-slice `range` (bounds-checked).
    ///
    /// # Safety
    /// No other reference to any element of `range` may exist while the returned slice
    /// lives: ranges taken by different threads (or twice by one) must not overlap.
    /// [`ThreadPool::for_chunks_mut`] is the safe way to split a slice between threads.
    #[inline]
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn range_mut(&self, range: std::ops::Range<usize>) -> &mut [T] {
        assert!(range.start <= range.end && range.end <= self.len, "SharedSlice range out of bounds");
        // SAFETY: in bounds; no overlapping reference (the caller's contract).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(range.start), range.len()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn every_item_runs_exactly_once() {
        let pool = ThreadPool::new(3).expect("spawn");
        for n in [0usize, 1, 2, 7, 100, 1000] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.for_each(n, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "n = {n}");
        }
    }

    #[test]
    fn many_small_jobs_back_to_back() {
        let pool = ThreadPool::new(2).expect("spawn");
        let total = AtomicUsize::new(0);
        for _ in 0..5000 {
            pool.for_each(3, &|i| {
                total.fetch_add(i + 1, Ordering::Relaxed);
            });
        }
        assert_eq!(total.load(Ordering::Relaxed), 5000 * 6);
    }

    #[test]
    fn ranges_cover_exactly() {
        let pool = ThreadPool::new(2).expect("spawn");
        let hits: Vec<AtomicUsize> = (0..103).map(|_| AtomicUsize::new(0)).collect();
        pool.for_ranges(103, 10, &|r| {
            assert!(r.len() <= 10);
            for i in r {
                hits[i].fetch_add(1, Ordering::Relaxed);
            }
        });
        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
    }

    #[test]
    fn worker_panic_is_reraised_and_pool_survives() {
        let pool = ThreadPool::new(2).expect("spawn");
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.for_each(64, &|i| {
                if i == 63 {
                    panic!("boom");
                }
            })
        }));
        assert!(r.is_err());
        let count = AtomicUsize::new(0);
        pool.for_each(10, &|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 10);
    }
}
