//! The workspace's one small generator: a seeded xorshift64 (Marsaglia's 13/7/17 triple)
//! for reproducible test data and for spread where no quality is needed (a router's
//! tie-break, a port probe). The same seed gives the same sequence on every machine, with
//! no dependency. Not for anything that needs statistical quality or secrecy.

/// A xorshift64 generator. Its state is never zero (a zero state would stay zero).
#[derive(Debug, Clone)]
pub struct XorShift64(u64);

impl XorShift64 {
    /// A generator starting from `state` (a zero state is replaced by a fixed odd constant).
    pub fn new(state: u64) -> Self {
        Self(if state == 0 { 0x9E37_79B9_7F4A_7C15 } else { state })
    }

    /// A generator for `seed` with its bits spread first, so that small neighbouring seeds
    /// (0, 1, 2, ...) start far apart.
    pub fn seeded(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// The next value.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// A value in `0..n` (`n` > 0; modulo bias is acceptable for test data).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// An index in `0..n` (`n` > 0).
    pub fn index(&mut self, n: usize) -> usize {
        self.below(n as u64) as usize
    }

    /// Uniform in [-1, 1), from the top 24 bits.
    pub fn f32_signed(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    /// Uniform in [0, 1), from the top 53 bits.
    pub fn unit_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sequence_is_marsaglias_and_depends_only_on_the_seed() {
        // The 13/7/17 xorshift64 from state 1: the first values are fixed forever.
        let mut r = XorShift64::new(1);
        assert_eq!([r.next_u64(), r.next_u64()], [0x4082_2041, 0x1000_4106_0C01_1441]);
        let (mut a, mut b) = (XorShift64::seeded(7), XorShift64::seeded(7));
        assert!((0..100).all(|_| a.next_u64() == b.next_u64()));
        assert_ne!(XorShift64::seeded(1).next_u64(), XorShift64::seeded(2).next_u64());
        assert_ne!(XorShift64::new(0).next_u64(), 0, "a zero state would stay zero");
    }

    #[test]
    fn ranges_hold() {
        let mut r = XorShift64::seeded(3);
        for _ in 0..10_000 {
            assert!(r.below(7) < 7);
            let f = r.f32_signed();
            assert!((-1.0..1.0).contains(&f), "{f}");
            let u = r.unit_f64();
            assert!((0.0..1.0).contains(&u), "{u}");
        }
    }
}
