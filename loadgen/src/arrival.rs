//! Seeded randomness and open-loop arrival times.
//!
//! A small SplitMix64 generator rather than a `rand` dependency: the stream
//! for a seed is fixed here, so a seed names the same prompts and gaps in
//! every version and on every target.

use std::time::Duration;

/// SplitMix64 (Steele, Lea, Flood 2014): one u64 of state, passes BigCrush.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// A generator for stream `n` of `seed`: independent streams per request.
    pub fn stream(seed: u64, n: u64) -> Self {
        let mut r = Self(seed ^ n.wrapping_mul(0xD1B5_4A32_D192_ED03));
        r.next_u64();
        r
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1), 53 bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `0..n` (`n > 0`; 0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        // Multiply-shift (Lemire): bias below n / 2^64.
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }

    /// Exponential with mean `1/rate`.
    pub fn exp(&mut self, rate: f64) -> f64 {
        // 1 - u is in (0, 1], so the log is finite.
        -(1.0 - self.next_f64()).ln() / rate
    }
}

/// Start offsets of `n` requests of a Poisson process of `rate` per second:
/// the first at its first gap, not at zero, as a process started at zero.
pub fn poisson_offsets(n: usize, rate: f64, seed: u64) -> Vec<Duration> {
    let mut rng = Rng::stream(seed, u64::MAX);
    let mut t = 0.0f64;
    (0..n)
        .map(|_| {
            t += rng.exp(rate);
            Duration::try_from_secs_f64(t).unwrap_or(Duration::MAX)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poisson_arrivals_are_reproducible_per_seed() {
        let a = poisson_offsets(100, 5.0, 42);
        assert_eq!(a, poisson_offsets(100, 5.0, 42));
        assert_ne!(a, poisson_offsets(100, 5.0, 43));
        assert!(a.windows(2).all(|w| w[0] <= w[1]), "offsets are increasing");
    }

    #[test]
    fn poisson_gaps_have_the_rate_asked_for() {
        let rate = 8.0;
        let n = 20_000;
        let a = poisson_offsets(n, rate, 7);
        let last = a.last().map_or(0.0, Duration::as_secs_f64);
        let mean_gap = last / n as f64;
        assert!((mean_gap * rate - 1.0).abs() < 0.03, "mean gap {mean_gap} vs {}", 1.0 / rate);
        // Exponential: the fraction of gaps shorter than the mean is 1 - 1/e.
        let mut prev = 0.0;
        let short = a
            .iter()
            .filter(|t| {
                let g = t.as_secs_f64() - prev;
                prev = t.as_secs_f64();
                g < 1.0 / rate
            })
            .count();
        let frac = short as f64 / n as f64;
        assert!((frac - (1.0 - (-1.0f64).exp())).abs() < 0.02, "fraction of short gaps {frac}");
    }

    #[test]
    fn uniform_draws_stay_in_range() {
        let mut r = Rng::new(1);
        for _ in 0..10_000 {
            let x = r.next_f64();
            assert!((0.0..1.0).contains(&x));
            assert!(r.below(7) < 7);
        }
        assert_eq!(r.below(0), 0);
    }
}
