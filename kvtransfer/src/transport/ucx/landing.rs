//! The landing region's ranges: which bytes belong to which transfer, and
//! which are fenced off. No UCX here, so the rules are tested in memory.
//!
//! A range is in exactly one of three states: free, granted (a live
//! reservation's sender may put into it) or quarantined (its reservation
//! ended without completing, and its sender may still have puts in flight).
//! Only [`Landing::free`] (a granted range) and [`Landing::release`] (a
//! quarantined one) make bytes allocatable again; the server calls the
//! first only after the transfer completed or its sender fenced, the second
//! only after the fence.

use std::collections::BTreeMap;
use std::ops::Range;

use super::wire::LandingRefusal;

/// Ranges start on this boundary (a cache line), so two transfers never
/// share one.
const ALIGN: usize = 64;

/// Free-range bookkeeping of a region of `size` bytes: first fit, adjacent
/// free ranges merged.
#[derive(Debug)]
pub(super) struct Landing {
    size: usize,
    /// Free ranges: start -> end.
    open: BTreeMap<usize, usize>,
    quarantined: usize,
    quarantined_ranges: usize,
}

impl Landing {
    pub(super) fn new(size: usize) -> Self {
        let size = size - size % ALIGN;
        let mut open = BTreeMap::new();
        if size > 0 {
            open.insert(0, size);
        }
        Self { size, open, quarantined: 0, quarantined_ranges: 0 }
    }

    pub(super) fn size(&self) -> usize {
        self.size
    }

    /// Bytes not free (granted or quarantined).
    pub(super) fn in_use(&self) -> usize {
        self.size - self.open.iter().map(|(s, e)| e - s).sum::<usize>()
    }

    /// Bytes and ranges held in quarantine now.
    pub(super) fn quarantined(&self) -> (usize, usize) {
        (self.quarantined, self.quarantined_ranges)
    }

    /// A range of `len` bytes (rounded up to the alignment), or why not.
    pub(super) fn alloc(&mut self, len: usize) -> Result<Range<usize>, LandingRefusal> {
        let len = len.checked_next_multiple_of(ALIGN).ok_or(LandingRefusal::TooLarge)?;
        if len == 0 || len > self.size {
            return Err(LandingRefusal::TooLarge);
        }
        let (&start, &end) = self.open.iter().find(|(s, e)| *e - *s >= len).ok_or(LandingRefusal::Full)?;
        self.open.remove(&start);
        if start + len < end {
            self.open.insert(start + len, end);
        }
        Ok(start..start + len)
    }

    /// Marks a granted range as quarantined (still not allocatable).
    pub(super) fn quarantine(&mut self, r: &Range<usize>) {
        self.quarantined += r.len();
        self.quarantined_ranges += 1;
    }

    /// The fence of a quarantined range completed: free it.
    pub(super) fn release(&mut self, r: Range<usize>) {
        self.quarantined -= r.len().min(self.quarantined);
        self.quarantined_ranges = self.quarantined_ranges.saturating_sub(1);
        self.free(r);
    }

    /// Makes a granted range allocatable again, merging it with its neighbours.
    pub(super) fn free(&mut self, r: Range<usize>) {
        let (mut start, mut end) = (r.start, r.end);
        if start >= end {
            return;
        }
        if let Some((&s, &e)) = self.open.range(..start).next_back() {
            if e == start {
                self.open.remove(&s);
                start = s;
            }
        }
        if let Some(e) = self.open.remove(&end) {
            end = e;
        }
        self.open.insert(start, end);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_disjoint_and_come_back_merged() {
        let mut l = Landing::new(1000);
        assert_eq!(l.size(), 960);
        let a = l.alloc(100).expect("a");
        let b = l.alloc(300).expect("b");
        let c = l.alloc(64).expect("c");
        assert_eq!((a.clone(), b.clone(), c.clone()), (0..128, 128..448, 448..512));
        assert_eq!(l.alloc(500), Err(LandingRefusal::Full));
        assert_eq!(l.alloc(961), Err(LandingRefusal::TooLarge));
        assert_eq!(l.alloc(0), Err(LandingRefusal::TooLarge));
        l.free(b);
        assert_eq!(l.alloc(449).err(), Some(LandingRefusal::Full), "free space is split in two");
        l.free(a);
        l.free(c);
        assert_eq!(l.in_use(), 0);
        assert_eq!(l.alloc(960), Ok(0..960), "everything merged back into one range");
    }

    #[test]
    fn a_quarantined_range_is_not_reused_until_released() {
        let mut l = Landing::new(256);
        let a = l.alloc(256).expect("whole region");
        l.quarantine(&a);
        assert_eq!(l.quarantined(), (256, 1));
        assert_eq!(l.alloc(64), Err(LandingRefusal::Full));
        l.release(a);
        assert_eq!(l.quarantined(), (0, 0));
        assert_eq!(l.alloc(64), Ok(0..64));
    }
}
