//! Recycled byte buffers for KV on the move: one kind for the whole data
//! plane — a sender's gathered layers, a stream server's frame payloads, the
//! local server's copies out of a ring slot, ucx's copies out of its landing
//! region. A steady stream of layers reuses warm memory instead of faulting
//! in (and zeroing) a fresh allocation for every layer; on the prefill
//! worker that allocation happened on the engine thread, mid-step.
//!
//! A [`Buffer`] is lent out by [`Buffers::take`] and comes home when it is
//! dropped, on whatever thread that is (a sink's, ucx's connection thread);
//! home keeps idle buffers up to a byte budget and lets the rest go.
//!
//! Idle buffers decay: those no transfer took for a whole [`IDLE_DECAY`] are
//! freed. A fault that holds many layers in flight at once (a stalled peer, a
//! burst) fills the home with buffers the steady stream never needs again;
//! without decay each new such peak raised the worker's memory for good, up
//! to the budget (a chaos hour measured the prefill worker's 64 MiB filling
//! at ~7 MiB per 10 minutes, read as a leak).

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use tokio::time::Instant;

/// How long an idle buffer is kept untaken before it is freed: one to two of these
/// (a buffer is counted from the start of the first whole window it sits out). A
/// window, not a timer: a home trims when it is next used, so one that no transfer
/// touches keeps what it has (within its budget).
pub const IDLE_DECAY: Duration = Duration::from_secs(10);

/// A home for idle buffers. Cloning shares it.
#[derive(Debug, Clone)]
pub struct Buffers(Arc<Home>);

#[derive(Debug)]
struct Home {
    idle: Mutex<Idle>,
    /// Most bytes (capacity) of idle buffers kept; one buffer is kept
    /// whatever its size, so a stream of layers larger than the budget
    /// still reuses one.
    keep_bytes: usize,
}

#[derive(Debug, Default)]
struct Idle {
    /// Coldest first: taken from the end, returned to the end.
    buffers: Vec<Vec<u8>>,
    /// Their capacities, summed.
    bytes: usize,
    /// The window that started at `since`: the fewest buffers idle in it. That
    /// many at the bottom of the stack were not taken all window.
    low: usize,
    since: Option<Instant>,
}

impl Idle {
    fn pop(&mut self) -> Option<Vec<u8>> {
        let b = self.buffers.pop()?;
        self.bytes -= b.capacity();
        self.low = self.low.min(self.buffers.len());
        Some(b)
    }

    /// At a window's end, takes out the buffers no one took in it (for the caller
    /// to free outside the lock) and starts the next window.
    fn settle(&mut self, now: Instant) -> Vec<Vec<u8>> {
        let Some(since) = self.since else {
            (self.since, self.low) = (Some(now), self.buffers.len());
            return Vec::new();
        };
        if now.saturating_duration_since(since) < IDLE_DECAY {
            return Vec::new();
        }
        let stale: Vec<Vec<u8>> = self.buffers.drain(..self.low.min(self.buffers.len())).collect();
        self.bytes -= stale.iter().map(Vec::capacity).sum::<usize>();
        (self.since, self.low) = (Some(now), self.buffers.len());
        stale
    }
}

impl Home {
    fn idle(&self) -> MutexGuard<'_, Idle> {
        // A panic while the list was held cannot leave it inconsistent
        // (each change is one push, pop or drain with its byte count).
        self.idle.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The warmest idle buffer, if any; idle ones past their decay are freed.
    fn reuse(&self) -> Option<Vec<u8>> {
        let (buf, stale) = {
            let mut idle = self.idle();
            let buf = idle.pop();
            (buf, idle.settle(Instant::now()))
        };
        free(stale);
        buf
    }
}

impl Buffers {
    /// Keeps up to `keep_bytes` of idle buffers.
    pub fn new(keep_bytes: usize) -> Self {
        Self(Arc::new(Home { idle: Mutex::new(Idle::default()), keep_bytes }))
    }

    /// An empty buffer: the most recently returned one (the warmest in
    /// cache), or a new one with nothing allocated.
    pub fn take(&self) -> Buffer {
        let mut buf = self.0.reuse().unwrap_or_default();
        buf.clear();
        self.lend(buf)
    }

    /// A buffer of exactly `len` bytes whose contents are unspecified (the
    /// caller overwrites them all): the most recently returned one, zeroed
    /// only beyond its old length (so a steady stream of same-sized
    /// payloads is never zeroed again).
    pub fn take_sized(&self, len: usize) -> Buffer {
        let mut buf = self.0.reuse().unwrap_or_default();
        buf.resize(len, 0);
        self.lend(buf)
    }

    /// An empty buffer with room for `capacity` bytes: the most recently
    /// returned one if it is large enough, else `fresh(capacity)` (which
    /// may place the allocation where the caller's copy is fastest).
    pub fn take_with(&self, capacity: usize, fresh: impl FnOnce(usize) -> Vec<u8>) -> Buffer {
        let reused = self.0.reuse();
        let mut buf = match reused {
            Some(b) if b.capacity() >= capacity => b,
            _ => fresh(capacity),
        };
        buf.clear();
        self.lend(buf)
    }

    /// `buf` as a buffer of this home: it comes here when dropped.
    pub fn lend(&self, buf: Vec<u8>) -> Buffer {
        Buffer { buf, home: Arc::downgrade(&self.0) }
    }

    /// Bytes (capacity) of the idle buffers kept now.
    pub fn idle_bytes(&self) -> usize {
        self.0.idle().bytes
    }
}

/// Freed buffers of at least this many bytes in all are handed back to the kernel.
const RELEASE_BYTES: usize = 1 << 20;

/// Frees buffers that decayed and, when they were [`RELEASE_BYTES`] or more, asks the
/// allocator to give its free pages back to the kernel. Freeing alone does not lower
/// the worker's resident memory: glibc keeps a thread arena's freed pages, and layers
/// are gathered on the engine thread, so a burst's buffers stayed resident in its arena
/// for good (a chaos run measured the prefill worker's `RssAnon` still climbing with
/// the decay alone: +32 MiB in its first 10 faulted minutes).
fn free(stale: Vec<Vec<u8>>) {
    let bytes: usize = stale.iter().map(Vec::capacity).sum();
    drop(stale);
    if bytes >= RELEASE_BYTES {
        release_free_pages();
    }
}

/// `malloc_trim(0)`: every arena's free pages back to the kernel (a walk of the free
/// lists; here at most once per decay window per home, and on the workers' slow tick,
/// worker-common's `heap`). Nothing to do on other allocators.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
pub fn release_free_pages() {
    // SAFETY: malloc_trim takes no pointers and has no preconditions; it only locks and
    // walks glibc's own arenas.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Nothing to release on other allocators.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn release_free_pages() {}

/// A buffer on loan from [`Buffers`]; it derefs to its `Vec<u8>` and goes
/// home when dropped (if home is still there and has room).
#[derive(Debug, Default)]
pub struct Buffer {
    buf: Vec<u8>,
    home: Weak<Home>,
}

impl Buffer {
    /// A buffer with no home: dropped, it is freed.
    pub fn unpooled(buf: Vec<u8>) -> Self {
        Self { buf, home: Weak::new() }
    }
}

impl Deref for Buffer {
    type Target = Vec<u8>;
    fn deref(&self) -> &Vec<u8> {
        &self.buf
    }
}

impl DerefMut for Buffer {
    fn deref_mut(&mut self) -> &mut Vec<u8> {
        &mut self.buf
    }
}

impl AsRef<[u8]> for Buffer {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        let Some(home) = self.home.upgrade() else { return };
        if self.buf.capacity() == 0 {
            return;
        }
        let stale = {
            let mut idle = home.idle();
            let cap = self.buf.capacity();
            if idle.buffers.is_empty() || idle.bytes + cap <= home.keep_bytes {
                idle.bytes += cap;
                idle.buffers.push(std::mem::take(&mut self.buf));
            }
            idle.settle(Instant::now())
        };
        free(stale);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A dropped buffer comes home and is the next one taken, with its
    /// memory (no new allocation), emptied; beyond the budget, buffers are
    /// let go; a buffer outliving its home is simply freed.
    #[test]
    fn buffers_come_home_within_the_budget() {
        let home = Buffers::new(3000);
        let mut a = home.take();
        a.extend_from_slice(&[7; 1000]);
        let at = a.as_ptr();
        let cap = a.capacity();
        drop(a);
        assert_eq!(home.idle_bytes(), cap);
        let b = home.take();
        assert_eq!((b.as_ptr(), b.len()), (at, 0), "the same memory, emptied");
        drop(b);

        let big = home.lend(Vec::with_capacity(4000));
        drop(big);
        assert_eq!(home.idle_bytes(), cap, "over the budget: let go");

        let small = home.take_with(10_000, Vec::with_capacity);
        assert!(small.capacity() >= 10_000, "too small a kept buffer is not reused");
        assert_eq!(home.idle_bytes(), 0, "the kept one was taken (and freed) on the way");
        drop(small);
        assert!(home.idle_bytes() >= 10_000, "one buffer is kept even over the budget");
        let again = home.take();
        assert!(again.capacity() >= 10_000, "and reused: a stream of large layers keeps one");

        let orphan = home.take();
        drop(home);
        drop(orphan);
        let mut u = Buffer::unpooled(vec![1, 2, 3]);
        u.push(4);
        assert_eq!(u.as_ref(), [1, 2, 3, 4]);
    }

    /// Buffers a burst needed and the steady stream does not are freed after a
    /// decay window with nothing taking them; the one the stream keeps taking stays,
    /// with its memory. (Paused time: the window is the clock's, not the test's.)
    #[tokio::test(start_paused = true)]
    async fn idle_buffers_no_one_takes_decay() {
        let home = Buffers::new(1 << 20);
        let burst: Vec<Buffer> = (0..8)
            .map(|_| {
                let mut b = home.take();
                b.extend_from_slice(&[1; 1000]);
                b
            })
            .collect();
        drop(burst);
        let one = home.idle_bytes() / 8;
        assert_eq!(home.idle_bytes(), 8 * one, "a burst's buffers come home");
        // The steady stream: one buffer at a time, for three windows.
        let mut warm = None;
        for _ in 0..3 {
            for _ in 0..20 {
                let b = home.take();
                assert!(b.capacity() >= 1000, "a kept buffer is reused");
                warm.get_or_insert(b.as_ptr());
                assert_eq!(Some(b.as_ptr()), warm, "the warmest one, the same memory each time");
                drop(b);
                tokio::time::advance(IDLE_DECAY / 8).await;
            }
        }
        assert_eq!(home.idle_bytes(), one, "the seven the stream never took were freed");
        // A window with nothing taken frees the rest on the next use.
        tokio::time::advance(IDLE_DECAY).await;
        let fresh = home.take();
        assert_eq!((fresh.capacity(), home.idle_bytes()), (one, 0), "the last one is taken, not freed");
        drop(fresh);
        // Returns settle too. A buffer is freed after one to two windows untaken:
        // the window it came home in counts only from its start.
        tokio::time::advance(IDLE_DECAY).await;
        drop(home.lend(Vec::with_capacity(64)));
        assert_eq!(home.idle_bytes(), one + 64, "idle part of a window only: kept");
        tokio::time::advance(IDLE_DECAY).await;
        drop(home.lend(Vec::with_capacity(32)));
        assert_eq!(home.idle_bytes(), 32, "the two idle all window went, the returned one stays");
    }

    /// Resident anonymous memory of this process, KiB (nextest runs each test in its own).
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn rss_anon_kib() -> u64 {
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let line = status.lines().find(|l| l.starts_with("RssAnon:")).unwrap_or_default();
        line.split_whitespace().nth(1).and_then(|n| n.parse().ok()).unwrap_or(0)
    }

    /// What the release is for: layer-sized buffers allocated on one thread (its own
    /// arena, as the engine thread's) and freed between survivors stay resident after
    /// `free`; the release gives their pages back.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn freed_buffers_pages_go_back_to_the_kernel() {
        let kept = std::thread::spawn(|| {
            let mut all: Vec<Vec<u8>> = (0..2048).map(|i| vec![i as u8 | 1; 32 << 10]).collect();
            // Every eighth survives: the freed ones are holes the arena's top cannot trim.
            let kept: Vec<Vec<u8>> = all.iter_mut().step_by(8).map(std::mem::take).collect();
            let before = rss_anon_kib();
            drop(all);
            let freed = rss_anon_kib();
            release_free_pages();
            let released = rss_anon_kib();
            (kept, before, freed, released)
        })
        .join();
        let Ok((kept, before, freed, released)) = kept else { panic!("the allocating thread panicked") };
        assert_eq!(kept.len(), 256);
        assert!(before >= 60 << 10, "64 MiB were resident: {before} KiB");
        assert!(freed + (16 << 10) >= before, "free alone kept most of it resident: {before} -> {freed} KiB");
        assert!(released + (32 << 10) <= freed, "the release gave back the holes: {freed} -> {released} KiB");
    }
}
