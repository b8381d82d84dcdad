//! Which (layer, block) cells of a reservation have been written.

/// A bitset over `n_layers × n_blocks`, row-major by layer.
#[derive(Debug, Clone)]
pub(super) struct Coverage {
    n_blocks: usize,
    bits: Vec<u64>,
    written: usize,
    total: usize,
}

impl Coverage {
    pub(super) fn new(n_layers: usize, n_blocks: usize) -> Self {
        let total = n_layers * n_blocks;
        Self { n_blocks, bits: vec![0; total.div_ceil(64)], written: 0, total }
    }

    fn get(&self, i: usize) -> bool {
        self.bits[i / 64] & (1 << (i % 64)) != 0
    }

    /// The first already-written block of `layer` in `blocks`, if any.
    /// Callers have checked `layer < n_layers` and `blocks.end <= n_blocks`.
    pub(super) fn first_written(&self, layer: usize, blocks: std::ops::Range<usize>) -> Option<usize> {
        let base = layer * self.n_blocks;
        blocks.into_iter().find(|&b| self.get(base + b))
    }

    /// Marks `blocks` of `layer` written. Callers have checked none is.
    pub(super) fn mark(&mut self, layer: usize, blocks: std::ops::Range<usize>) {
        let base = layer * self.n_blocks;
        for b in blocks {
            let i = base + b;
            debug_assert!(!self.get(i));
            self.bits[i / 64] |= 1 << (i % 64);
            self.written += 1;
        }
    }

    /// Clears `blocks` of `layer`, all marked: a landing that did not finish.
    pub(super) fn unmark(&mut self, layer: usize, blocks: std::ops::Range<usize>) {
        let base = layer * self.n_blocks;
        for b in blocks {
            let i = base + b;
            debug_assert!(self.get(i));
            self.bits[i / 64] &= !(1 << (i % 64));
            self.written -= 1;
        }
    }

    pub(super) fn written(&self) -> usize {
        self.written
    }

    pub(super) fn total(&self) -> usize {
        self.total
    }

    pub(super) fn is_full(&self) -> bool {
        self.written == self.total
    }
}

#[cfg(test)]
mod tests {
    use super::Coverage;

    #[test]
    fn marks_and_finds_across_word_boundaries() {
        let mut c = Coverage::new(3, 50);
        assert_eq!(c.total(), 150);
        c.mark(1, 10..20);
        assert_eq!(c.first_written(1, 0..10), None);
        assert_eq!(c.first_written(1, 5..15), Some(10));
        assert_eq!(c.first_written(0, 0..50), None);
        assert_eq!(c.first_written(2, 0..50), None);
        c.mark(0, 0..50);
        c.mark(1, 0..10);
        c.mark(1, 20..50);
        assert!(!c.is_full());
        c.mark(2, 0..50);
        assert!(c.is_full());
        assert_eq!(c.written(), 150);
    }
}
