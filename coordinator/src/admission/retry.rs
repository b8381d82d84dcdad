//! `Retry-After` for every refusal a retry can help (each 503, and 429):
//! one rule, so clients refused in the same instant do not all come back in
//! the same later instant and refuse each other again.
//!
//! The estimate is the measured drain time of the queue where the
//! coordinator has one (see [`Admission::drain_estimate`](super::Admission::drain_estimate)),
//! a circuit breaker's time to its next probe, or else [`BASE`]. Then each
//! answer draws a whole number of seconds uniformly from
//! `[max(1, floor(0.8 e)), max(that + 1, ceil(1.2 e))]`: ±20% of the
//! estimate, but at least two distinct values, since whole seconds cannot
//! spread a 1 s estimate by 20%; never below 1 s.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

/// The estimate when the coordinator has no measurement to give: draws
/// 1, 2 or 3 s.
pub const BASE: Duration = Duration::from_secs(2);
/// The spread of a draw around its estimate, as a fraction of it.
pub const JITTER: f64 = 0.2;

/// Seconds for a `Retry-After` (HTTP header and gRPC `retry-after` metadata
/// alike): `estimate` (else [`BASE`]) with jitter, see the module docs.
pub fn retry_after(estimate: Option<Duration>) -> u64 {
    jittered(estimate.unwrap_or(BASE), next_random())
}

/// The draw for `estimate` given a uniform random `r`.
fn jittered(estimate: Duration, r: u64) -> u64 {
    let e = estimate.as_secs_f64().max(0.0);
    let lo = ((e * (1.0 - JITTER)).floor() as u64).max(1);
    let hi = ((e * (1.0 + JITTER)).ceil() as u64).max(lo + 1);
    lo + r % (hi - lo + 1)
}

/// A splitmix64 stream shared by every refusal in the process: lock-free,
/// seeded per process so two coordinators do not draw in step.
fn next_random() -> u64 {
    static SEED: OnceLock<u64> = OnceLock::new();
    static STATE: AtomicU64 = AtomicU64::new(0);
    let seed = *SEED.get_or_init(|| {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        (now as u64) ^ (u64::from(std::process::id()) << 32)
    });
    let mut z = seed.wrapping_add(STATE.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn draws(estimate: Option<Duration>) -> BTreeSet<u64> {
        (0..2000).map(|_| retry_after(estimate)).collect()
    }

    #[test]
    fn draws_stay_within_twenty_percent_and_spread() {
        for (estimate, lo, hi) in [
            (None, 1, 3),
            (Some(Duration::ZERO), 1, 2),
            (Some(Duration::from_secs(1)), 1, 2),
            (Some(Duration::from_millis(2400)), 1, 3),
            (Some(Duration::from_secs(5)), 4, 6),
            (Some(Duration::from_secs(10)), 8, 12),
            (Some(Duration::from_secs(60)), 48, 72),
        ] {
            let seen = draws(estimate);
            // Over 2,000 draws every value of a range of at most 25 turns up.
            assert_eq!(seen, (lo..=hi).collect::<BTreeSet<_>>(), "{estimate:?}");
        }
    }

    #[test]
    fn consecutive_draws_differ() {
        let a: Vec<u64> = (0..64).map(|_| retry_after(None)).collect();
        let b: Vec<u64> = (0..64).map(|_| retry_after(None)).collect();
        assert_ne!(a, b, "two runs of 64 draws came out the same");
        assert!(a.windows(2).any(|w| w[0] != w[1]), "{a:?}");
    }

    #[test]
    fn the_draw_is_uniform_over_its_range() {
        let mut counts = [0u32; 3];
        for _ in 0..30_000 {
            counts[(retry_after(None) - 1) as usize] += 1;
        }
        // 10,000 expected each; 5 sigma is about 410.
        assert!(counts.iter().all(|&c| (9_000..=11_000).contains(&c)), "{counts:?}");
    }
}
