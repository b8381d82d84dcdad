//! Deterministic randomness for property-style tests: the workspace's seeded generator
//! with the helpers these tests use.

/// The workspace's xorshift64, seeded so neighbouring seeds start far apart.
pub(crate) struct Rng(types::rng::XorShift64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Self(types::rng::XorShift64::seeded(seed))
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// An integer in `0..n` (`n > 0`).
    pub(crate) fn below(&mut self, n: usize) -> usize {
        self.0.index(n)
    }

    pub(crate) fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.0.next_u64() as u8).collect()
    }
}
