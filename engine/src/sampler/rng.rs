//! Counter-based randomness: every draw is a pure function of (seed, draw
//! index), so a sequence's `n`-th token is drawn the same wherever and
//! whenever it is sampled — on the prefill worker or the decode worker, in
//! the first run or in a continuation from token `n` on another worker.
//!
//! The generator is Philox4x32-10 (Salmon, Moraes, Dror, Shaw: "Parallel
//! random numbers: as easy as 1, 2, 3", SC 2011), checked against the
//! Random123 known-answer vectors. The key is the request's 64-bit seed; the
//! counter is the draw index (low, high word), then a stream word (0: token
//! draws; other values are free for later draws that must not collide with
//! them) and a zero word. A stream RNG would make token `n` depend on how many
//! draws came before it on this process, which is what broke remote prefill
//! (the decode worker's fresh sampler re-drew token 0's value for token 1).

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

/// The sampler's numeric contract: which generator, which counter layout and
/// which draw-to-token rule. Part of a worker's determinism fingerprint, so a
/// continuation is only ever made by a worker that draws the same way. Bump it
/// whenever a seeded request's tokens could change.
pub const SAMPLER_VERSION: &str = "philox4x32-10/index-stream0/v1";

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

fn mulhilo(a: u32, b: u32) -> (u32, u32) {
    let p = u64::from(a) * u64::from(b);
    ((p >> 32) as u32, p as u32)
}

/// Philox4x32 with 10 rounds: the counter block `ctr` under `key`.
pub(crate) fn philox4x32_10(mut ctr: [u32; 4], mut key: [u32; 2]) -> [u32; 4] {
    for round in 0..10 {
        if round > 0 {
            key = [key[0].wrapping_add(W0), key[1].wrapping_add(W1)];
        }
        let (hi0, lo0) = mulhilo(M0, ctr[0]);
        let (hi1, lo1) = mulhilo(M1, ctr[2]);
        ctr = [hi1 ^ ctr[1] ^ key[0], lo1, hi0 ^ ctr[3] ^ key[1], lo0];
    }
    ctr
}

/// The draw for token `index` of a sequence seeded `seed`: uniform in
/// [0, 1) with 53 bits, from the first two words of its Philox block.
pub fn uniform(seed: u64, index: u64) -> f64 {
    const SCALE: f64 = 1.0 / (1u64 << 53) as f64;
    let out = philox4x32_10([index as u32, (index >> 32) as u32, 0, 0], [seed as u32, (seed >> 32) as u32]);
    let bits = (u64::from(out[1]) << 32) | u64::from(out[0]);
    (bits >> 11) as f64 * SCALE
}

/// A seed for requests that did not pass one. std's `RandomState` keys come
/// from OS randomness once per thread and change per instance; the counter
/// makes two calls distinct even if that ever stopped being true.
pub(crate) fn entropy_seed() -> u64 {
    static CALLS: AtomicU64 = AtomicU64::new(0);
    let mut h = RandomState::new().build_hasher();
    h.write_u64(CALLS.fetch_add(1, Ordering::Relaxed));
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random123's published known-answer vectors for Philox4x32-10 (its
    /// tests/kat_vectors: counter words, key words, expected block).
    #[test]
    fn philox_matches_the_random123_known_answers() {
        assert_eq!(philox4x32_10([0; 4], [0; 2]), [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]);
        assert_eq!(philox4x32_10([u32::MAX; 4], [u32::MAX; 2]), [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]);
        assert_eq!(
            philox4x32_10([0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344], [0xa409_3822, 0x299f_31d0]),
            [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1]
        );
    }

    /// The draw is a function of (seed, index) alone: asking out of order, twice, or
    /// after other draws gives the same value; neighbouring seeds and indices differ.
    #[test]
    fn draws_depend_only_on_seed_and_index() {
        let forward: Vec<f64> = (0..64).map(|i| uniform(7, i)).collect();
        let backward: Vec<f64> = (0..64).rev().map(|i| uniform(7, i)).collect();
        assert!(forward.iter().eq(backward.iter().rev()));
        assert_ne!(uniform(7, 0), uniform(8, 0));
        assert_ne!(uniform(7, 0), uniform(7, 1));
        assert_ne!(uniform(7, 1 << 32), uniform(7, 0), "the counter's high word counts");
        // Pinned: a seeded request's tokens change only with SAMPLER_VERSION.
        let bits = (u64::from(0xe169_c58d_u32) << 32) | 0x6627_e8d5;
        assert_eq!(uniform(0, 0), (bits >> 11) as f64 / (1u64 << 53) as f64);
    }

    #[test]
    fn uniform_draws_lie_in_the_unit_interval_with_a_sane_mean() {
        let n = 100_000;
        let mut sum = 0.0;
        for i in 0..n {
            let x = uniform(42, i);
            assert!((0.0..1.0).contains(&x));
            sum += x;
        }
        let mean = sum / n as f64;
        // Standard error of the mean is ~0.0009; 5 sigma.
        assert!((mean - 0.5).abs() < 0.005, "mean {mean}");
    }

    #[test]
    fn entropy_seeds_differ() {
        assert_ne!(entropy_seed(), entropy_seed());
    }
}
