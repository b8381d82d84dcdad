//! The receiver's lock, as every server takes it.
//!
//! # Why a lock, not an owning task
//!
//! One [`Receiver`] serves a decode worker: its transfer connections (one
//! task each), its request tasks (reserve, take, abort, state) and its
//! reaper (lease timer). They share it behind a `std::sync::Mutex` rather
//! than talking to a task that owns it, because:
//! - every hold is short and synchronous: a guard never lives across an
//!   await (it is not `Send`, so a spawned task cannot even compile one
//!   that does), and what is done under it is the receiver's bookkeeping
//!   plus, for a frame, the sink's hand-off (the decode worker posts the
//!   write to the engine thread; it never waits there: see
//!   [`BlockSink::poll_ready`](super::BlockSink::poll_ready), awaited
//!   *before* the lock);
//! - a frame's check and its write's hand-off must be one step, so that the
//!   reservation cannot end (and its blocks be reused) in between; under
//!   the lock that is the guard's scope, with an owner it would have to be
//!   the owner doing the hand-off, which changes nothing but adds the hop;
//! - every caller needs its answer before it goes on (a frame's verdict
//!   decides whether an `Abort` goes back; `reserve` yields the
//!   reservation to send; `take_ready` the blocks), so a message interface
//!   is a request and a reply per call, with an "owner gone" failure at
//!   every call site.
//!
//! Measured on the development machine (2 cores shared with other builds,
//! load 9; `cargo bench -p kvtransfer --features pool,lock-stats --bench
//! tcp -- 256k 1` and `--bench local`, 256 MiB per transfer):
//! - production shape (local transport, sink deferring to another thread,
//!   as the decode worker's does): hold per frame p50 <= 1 us, mean 2.2 us
//!   (256 KiB frames), p50 <= 4 us (1 MiB); one connection never contends.
//!   Sinks that copy in place hold it for the copy (33-68 us per 256 KiB),
//!   the tests' and benches' shape only.
//! - four senders at once with a deferring sink plus a task taking the lock
//!   every millisecond (the reaper's worst is every 500 ms): 1.6-3.5% of
//!   acquisitions wait; the waits (mean 0.4-11 ms) are holders preempted by
//!   the oversubscribed machine, 7-180 us per acquisition averaged.
//! - a request to an owning task and its reply on the same runtime: p50
//!   0.6 us, mean 3.1 us idle, mean 8.3 us while those four senders run.
//!
//! So uncontended (the common case: one connection per prefill worker, the
//! reaper twice a second) the lock costs an atomic pair while a hop would
//! cost as much as the whole hold; and a preempted holder stalls an owner
//! task's queue exactly as it stalls the lock's waiters. Revisit if
//! contention shows up at scale: the figures come from the counters below.
//!
//! # Measuring
//!
//! With feature `lock-stats` (benches only, never a worker binary) every
//! acquisition through [`lock`] is timed: how often it found the lock held,
//! how long it waited then, and how long it was held, as log2 histograms
//! ([`stats::snapshot`]). Without the feature, [`lock`] is a plain
//! `Mutex::lock`.

use std::sync::Mutex;

use crate::session::Receiver;

/// Takes the receiver. It never panics while locked (a plain state
/// machine), so a poisoned lock can only come from a panicking sink; its
/// state is still consistent.
#[cfg(not(feature = "lock-stats"))]
pub(crate) fn lock(rx: &Mutex<Receiver>) -> std::sync::MutexGuard<'_, Receiver> {
    rx.lock().unwrap_or_else(|e| e.into_inner())
}

/// Takes the receiver, timed (see the module docs).
#[cfg(feature = "lock-stats")]
pub(crate) fn lock(rx: &Mutex<Receiver>) -> stats::Timed<'_> {
    stats::lock(rx)
}

/// Lock timings, process-wide (feature `lock-stats`).
#[cfg(feature = "lock-stats")]
#[allow(clippy::disallowed_types, reason = "hold and wait times are wall time, never a deadline")]
pub mod stats {
    use std::ops::{Deref, DerefMut};
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
    use std::sync::{Mutex, MutexGuard, TryLockError};
    use std::time::Instant;

    use crate::session::Receiver;

    const BUCKETS: usize = 40;

    struct Histogram {
        /// Bucket `i` counts durations of `2^i ..= 2^(i+1) - 1` ns (0 ns in bucket 0).
        buckets: [AtomicU64; BUCKETS],
        sum_ns: AtomicU64,
        max_ns: AtomicU64,
    }

    impl Histogram {
        const fn new() -> Self {
            Self {
                buckets: [const { AtomicU64::new(0) }; BUCKETS],
                sum_ns: AtomicU64::new(0),
                max_ns: AtomicU64::new(0),
            }
        }

        fn record(&self, ns: u64) {
            let i = (63 - ns.max(1).leading_zeros() as usize).min(BUCKETS - 1);
            self.buckets[i].fetch_add(1, Relaxed);
            self.sum_ns.fetch_add(ns, Relaxed);
            self.max_ns.fetch_max(ns, Relaxed);
        }

        fn snapshot(&self) -> Durations {
            Durations {
                buckets: std::array::from_fn(|i| self.buckets[i].load(Relaxed)),
                sum_ns: self.sum_ns.load(Relaxed),
                max_ns: self.max_ns.load(Relaxed),
            }
        }

        fn reset(&self) {
            for b in &self.buckets {
                b.store(0, Relaxed);
            }
            self.sum_ns.store(0, Relaxed);
            self.max_ns.store(0, Relaxed);
        }
    }

    static ACQUIRED: AtomicU64 = AtomicU64::new(0);
    static CONTENDED: AtomicU64 = AtomicU64::new(0);
    static WAIT: Histogram = Histogram::new();
    static HOLD: Histogram = Histogram::new();

    /// A histogram of durations, read at one moment.
    #[derive(Debug, Clone)]
    pub struct Durations {
        buckets: [u64; BUCKETS],
        pub sum_ns: u64,
        pub max_ns: u64,
    }

    impl Durations {
        pub fn count(&self) -> u64 {
            self.buckets.iter().sum()
        }

        /// An upper bound on the `q` quantile (0..=1), in ns: the top of its log2 bucket.
        pub fn quantile_ns(&self, q: f64) -> u64 {
            let n = self.count();
            let want = ((n as f64 * q).ceil() as u64).max(1);
            let mut seen = 0;
            for (i, &c) in self.buckets.iter().enumerate() {
                seen += c;
                if seen >= want {
                    return ((2u128 << i) - 1).min(self.max_ns as u128) as u64;
                }
            }
            self.max_ns
        }

        pub fn mean_ns(&self) -> f64 {
            self.sum_ns as f64 / self.count().max(1) as f64
        }
    }

    /// Every acquisition through the servers since the last [`reset`].
    #[derive(Debug, Clone)]
    pub struct LockStats {
        pub acquired: u64,
        /// Acquisitions that found the lock held and waited.
        pub contended: u64,
        /// Waits of the contended acquisitions.
        pub wait: Durations,
        /// Hold times of every acquisition.
        pub hold: Durations,
    }

    pub fn snapshot() -> LockStats {
        LockStats {
            acquired: ACQUIRED.load(Relaxed),
            contended: CONTENDED.load(Relaxed),
            wait: WAIT.snapshot(),
            hold: HOLD.snapshot(),
        }
    }

    pub fn reset() {
        ACQUIRED.store(0, Relaxed);
        CONTENDED.store(0, Relaxed);
        WAIT.reset();
        HOLD.reset();
    }

    /// The receiver, held; the hold time is recorded when it is dropped.
    pub struct Timed<'a> {
        guard: MutexGuard<'a, Receiver>,
        since: Instant,
    }

    impl Deref for Timed<'_> {
        type Target = Receiver;
        fn deref(&self) -> &Receiver {
            &self.guard
        }
    }

    impl DerefMut for Timed<'_> {
        fn deref_mut(&mut self) -> &mut Receiver {
            &mut self.guard
        }
    }

    impl Drop for Timed<'_> {
        fn drop(&mut self) {
            HOLD.record(self.since.elapsed().as_nanos() as u64);
        }
    }

    pub(super) fn lock(rx: &Mutex<Receiver>) -> Timed<'_> {
        ACQUIRED.fetch_add(1, Relaxed);
        let guard = match rx.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(e)) => e.into_inner(),
            Err(TryLockError::WouldBlock) => {
                let t = Instant::now();
                let g = rx.lock().unwrap_or_else(|e| e.into_inner());
                CONTENDED.fetch_add(1, Relaxed);
                WAIT.record(t.elapsed().as_nanos() as u64);
                g
            }
        };
        Timed { guard, since: Instant::now() }
    }
}
