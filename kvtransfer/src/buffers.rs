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

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

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
    buffers: Vec<Vec<u8>>,
    /// Their capacities, summed.
    bytes: usize,
}

impl Idle {
    fn pop(&mut self) -> Option<Vec<u8>> {
        let b = self.buffers.pop()?;
        self.bytes -= b.capacity();
        Some(b)
    }
}

impl Home {
    fn idle(&self) -> MutexGuard<'_, Idle> {
        // A panic while the list was held cannot leave it inconsistent
        // (each change is one push or pop with its byte count).
        self.idle.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
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
        let mut buf = self.0.idle().pop().unwrap_or_default();
        buf.clear();
        self.lend(buf)
    }

    /// A buffer of exactly `len` bytes whose contents are unspecified (the
    /// caller overwrites them all): the most recently returned one, zeroed
    /// only beyond its old length (so a steady stream of same-sized
    /// payloads is never zeroed again).
    pub fn take_sized(&self, len: usize) -> Buffer {
        let mut buf = self.0.idle().pop().unwrap_or_default();
        buf.resize(len, 0);
        self.lend(buf)
    }

    /// An empty buffer with room for `capacity` bytes: the most recently
    /// returned one if it is large enough, else `fresh(capacity)` (which
    /// may place the allocation where the caller's copy is fastest).
    pub fn take_with(&self, capacity: usize, fresh: impl FnOnce(usize) -> Vec<u8>) -> Buffer {
        let reused = self.0.idle().pop();
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
        let mut idle = home.idle();
        let cap = self.buf.capacity();
        if idle.buffers.is_empty() || idle.bytes + cap <= home.keep_bytes {
            idle.bytes += cap;
            idle.buffers.push(std::mem::take(&mut self.buf));
        }
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
}
