//! A fixed pool of worker threads for data-parallel kernel calls.
//!
//! A decode step makes ~150 parallel calls (four matmuls a layer, attention,
//! the output head), each only tens of microseconds long, so dispatch cost
//! matters more than generality: a general work-stealing pool costs several
//! microseconds to wake its threads per call. Here the caller publishes a job
//! by bumping an epoch counter; workers spin briefly on that counter (waking
//! within ~100 ns while a step is running), then fall back to parking so an
//! idle engine burns no CPU. The calling thread always takes part as worker 0,
//! so `threads = 1` spawns nothing.
#![allow(unsafe_code)]

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle, Thread};
use std::time::{Duration, Instant};

/// How long an idle worker spins before parking. Long enough to bridge the
/// gap between two kernel calls of one step, short enough not to matter
/// when the engine is idle.
const SPIN: Duration = Duration::from_micros(200);

type Job = dyn Fn(usize, usize) + Sync;

struct Shared {
    epoch: AtomicU64,
    /// The current job, as a type-erased fat pointer; valid while `pending > 0`.
    job: Mutex<Option<JobPtr>>,
    pending: AtomicUsize,
    panicked: AtomicBool,
    shutdown: AtomicBool,
    n_threads: usize,
}

#[derive(Clone, Copy)]
struct JobPtr(*const Job);
// SAFETY: the pointee is `Sync` and `run` keeps it alive until every worker
// has finished with it (it waits for `pending == 0` before returning).
unsafe impl Send for JobPtr {}

/// A fixed set of threads that run one job at a time, each invocation
/// receiving `(thread_index, n_threads)`.
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
            pending: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            n_threads,
        });
        let mut workers = Vec::with_capacity(n_threads - 1);
        for index in 1..n_threads {
            let s = Arc::clone(&shared);
            let handle =
                thread::Builder::new().name(format!("tandem-kernel-{index}")).spawn(move || worker_loop(&s, index))?;
            let t = handle.thread().clone();
            workers.push((handle, t));
        }
        Ok(Self { shared, workers, gate: Mutex::new(()) })
    }

    pub fn threads(&self) -> usize {
        self.shared.n_threads
    }

    /// Runs `f(thread_index, n_threads)` once on every thread of the pool and
    /// returns when all have finished. A panic in any invocation is re-raised
    /// here after all threads are done with `f`.
    pub fn run(&self, f: &(dyn Fn(usize, usize) + Sync)) {
        let n = self.shared.n_threads;
        if n == 1 {
            f(0, 1);
            return;
        }
        let _one_at_a_time = self.gate.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: erase the lifetime of `f`. Workers dereference the pointer
        // only between the epoch bump below and their decrement of `pending`;
        // this function does not return (even when `f` panics on this thread,
        // see `Wait`) until `pending` is 0, so `f` outlives every use.
        let ptr: *const Job = unsafe { std::mem::transmute::<&(dyn Fn(usize, usize) + Sync), &'static Job>(f) };
        *self.shared.job.lock().unwrap_or_else(|e| e.into_inner()) = Some(JobPtr(ptr));
        self.shared.pending.store(n - 1, Ordering::Release);
        self.shared.epoch.fetch_add(1, Ordering::AcqRel);
        for (_, t) in &self.workers {
            t.unpark();
        }
        let wait = Wait(&self.shared);
        f(0, n);
        drop(wait);
        if self.shared.panicked.swap(false, Ordering::AcqRel) {
            panic!("a kernel worker thread panicked");
        }
    }
}

/// Waits for the workers on drop, so a panic in the caller's share of the
/// job cannot free the job while workers still run it.
struct Wait<'a>(&'a Shared);

impl Drop for Wait<'_> {
    fn drop(&mut self) {
        // Spin briefly (the usual case: workers finish within microseconds
        // of us), then yield, so that on an oversubscribed machine a worker
        // that lost its core gets it back instead of waiting behind our spin.
        let mut spins = 0u32;
        while self.0.pending.load(Ordering::Acquire) != 0 {
            if spins < 4096 {
                spins += 1;
                std::hint::spin_loop();
            } else {
                thread::yield_now();
            }
        }
    }
}

fn worker_loop(s: &Shared, index: usize) {
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
            spins += 1;
            if spins % 64 == 0 && started.elapsed() > SPIN {
                // Parks until `run` or `drop` unparks; a stale unpark token
                // just sends us round the loop once more.
                thread::park_timeout(Duration::from_millis(50));
            } else {
                std::hint::spin_loop();
            }
        }
        let job = *s.job.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(JobPtr(ptr)) = job {
            // SAFETY: see `ThreadPool::run`: the job lives until `pending` is 0.
            let f = unsafe { &*ptr };
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(index, s.n_threads)));
            if r.is_err() {
                s.panicked.store(true, Ordering::Release);
            }
        }
        s.pending.fetch_sub(1, Ordering::AcqRel);
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

/// The half-open range of `0..n` that thread `t` of `nt` takes, in units of
/// `align` (the last thread takes the remainder).
pub fn split(n: usize, t: usize, nt: usize, align: usize) -> std::ops::Range<usize> {
    let units = n.div_ceil(align);
    let start = (units * t / nt * align).min(n);
    let end = (units * (t + 1) / nt * align).min(n);
    start..end
}

/// A mutable slice that pool threads write disjoint elements of.
///
/// The matmul's threads own disjoint weight rows, i.e. disjoint *columns* of
/// a row-major output, so the output cannot be split into per-thread
/// sub-slices; each thread writes single elements through this instead.
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

    /// Writes element `i`. Threads must write disjoint indices.
    #[inline]
    pub fn set(&self, i: usize, v: T) {
        assert!(i < self.len, "SharedSlice index {i} out of bounds {}", self.len);
        // SAFETY: in bounds (checked above); disjointness is the caller's
        // contract documented on the type, and `T: Copy` has no drop.
        unsafe { self.ptr.add(i).write(v) }
    }

    /// A mutable sub-slice `range`. Threads must take disjoint ranges.
    #[inline]
    #[allow(clippy::mut_from_ref)]
    pub fn range_mut(&self, range: std::ops::Range<usize>) -> &mut [T] {
        assert!(range.start <= range.end && range.end <= self.len, "SharedSlice range out of bounds");
        // SAFETY: in bounds; disjoint ranges per thread (caller's contract).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(range.start), range.len()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn every_thread_runs_each_job_once() {
        let pool = ThreadPool::new(3).expect("spawn");
        for _ in 0..1000 {
            let hits = [AtomicUsize::new(0), AtomicUsize::new(0), AtomicUsize::new(0)];
            pool.run(&|t, n| {
                assert_eq!(n, 3);
                hits[t].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
    }

    #[test]
    fn split_covers_range_exactly() {
        for n in [0, 1, 7, 64, 100, 1000] {
            for nt in 1..5 {
                let mut next = 0;
                for t in 0..nt {
                    let r = split(n, t, nt, 4);
                    assert_eq!(r.start, next);
                    next = r.end;
                }
                assert_eq!(next, n);
            }
        }
    }

    #[test]
    fn worker_panic_is_reraised_and_pool_survives() {
        let pool = ThreadPool::new(2).expect("spawn");
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.run(&|t, _| {
                if t == 1 {
                    panic!("boom");
                }
            })
        }));
        assert!(r.is_err());
        let count = AtomicUsize::new(0);
        pool.run(&|_, _| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 2);
    }
}
