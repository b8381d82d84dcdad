//! A token bucket with time passed in, so it is tested on plain numbers.
//!
//! The bucket holds up to `capacity` tokens and refills at `rate` per
//! second. Its parameters are given at every call, not stored: a tenant's
//! budget is re-split whenever the number of live coordinators changes, and
//! the next call simply uses the new share (the level is clamped to the new
//! capacity, so a shrinking share never leaves a stored surplus behind).
//!
//! A take of `n` succeeds when the level covers `min(n, capacity)` and then
//! subtracts all of `n`, so the level may go below zero (debt). Without
//! that a request larger than one coordinator's share of a per-minute
//! budget could never pass; with it, the long-run rate still holds, since
//! the debt must be refilled before anything else passes.

use std::time::Duration;

use tokio::time::Instant;

/// One bucket's level and when it was last brought up to date.
#[derive(Debug, Clone, Copy)]
pub struct Bucket {
    level: f64,
    at: Instant,
}

/// A bucket's size and refill rate, as this coordinator's share of a budget.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Refill {
    /// Most tokens held (the burst).
    pub capacity: f64,
    /// Tokens added per second.
    pub per_s: f64,
}

impl Bucket {
    /// A full bucket.
    pub fn full(refill: Refill, now: Instant) -> Self {
        Self { level: refill.capacity, at: now }
    }

    fn refill(&mut self, refill: Refill, now: Instant) {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.level = (self.level + dt * refill.per_s).min(refill.capacity);
        self.at = now;
    }

    /// Takes `n` tokens, or says how long until they could be taken.
    pub fn take(&mut self, n: f64, refill: Refill, now: Instant) -> Result<(), Duration> {
        self.refill(refill, now);
        let need = n.min(refill.capacity);
        if self.level + 1e-9 >= need {
            self.level -= n;
            return Ok(());
        }
        Err(wait(need - self.level, refill.per_s))
    }

    /// Whether the bucket is out of debt (holds at least one token), or how
    /// long until it is: the check that needs no token count.
    pub fn check(&mut self, refill: Refill, now: Instant) -> Result<(), Duration> {
        self.refill(refill, now);
        let need = refill.capacity.min(1.0);
        if self.level + 1e-9 >= need {
            return Ok(());
        }
        Err(wait(need - self.level, refill.per_s))
    }

    /// Gives back `n` tokens taken earlier and not used (never past the capacity).
    pub fn give_back(&mut self, n: f64, refill: Refill, now: Instant) {
        self.refill(refill, now);
        self.level = (self.level + n).min(refill.capacity);
    }

    /// The level now (for tests and metrics).
    pub fn level(&mut self, refill: Refill, now: Instant) -> f64 {
        self.refill(refill, now);
        self.level
    }
}

/// Time to refill `missing` tokens at `per_s`.
fn wait(missing: f64, per_s: f64) -> Duration {
    if per_s <= 0.0 {
        return Duration::from_secs(3600);
    }
    Duration::from_secs_f64((missing / per_s).min(3600.0))
}

/// Whole seconds for a `Retry-After` from a refill wait: rounded up (a
/// client that waits that long finds the tokens there), within [1, 60] like
/// every other Retry-After; a longer wait is answered again at its end.
pub fn retry_after_secs(wait: Duration) -> u64 {
    let s = wait.as_secs_f64().ceil() as u64;
    s.clamp(1, 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEN_PER_S: Refill = Refill { capacity: 10.0, per_s: 10.0 };

    #[test]
    fn a_full_bucket_gives_its_burst_then_refills_at_its_rate() {
        let t0 = Instant::now();
        let mut b = Bucket::full(TEN_PER_S, t0);
        for _ in 0..10 {
            assert_eq!(b.take(1.0, TEN_PER_S, t0), Ok(()));
        }
        let wait = b.take(1.0, TEN_PER_S, t0).expect_err("empty");
        assert_eq!(wait, Duration::from_millis(100), "one token at 10/s");
        assert!(b.take(1.0, TEN_PER_S, t0 + Duration::from_millis(99)).is_err());
        assert_eq!(b.take(1.0, TEN_PER_S, t0 + Duration::from_millis(100)), Ok(()));
        // A long idle refills to the capacity, no further.
        assert_eq!(b.level(TEN_PER_S, t0 + Duration::from_secs(60)), 10.0);
    }

    #[test]
    fn a_take_larger_than_the_capacity_passes_from_full_and_leaves_debt() {
        let r = Refill { capacity: 100.0, per_s: 10.0 };
        let t0 = Instant::now();
        let mut b = Bucket::full(r, t0);
        assert_eq!(b.take(250.0, r, t0), Ok(()), "a whole bucket covers any size");
        assert_eq!(b.level(r, t0), -150.0);
        // Nothing passes until the debt is refilled: 151 tokens at 10/s.
        assert_eq!(b.check(r, t0), Err(Duration::from_secs_f64(15.1)));
        assert_eq!(b.take(5.0, r, t0), Err(Duration::from_secs_f64(15.5)));
        assert_eq!(b.take(5.0, r, t0 + Duration::from_secs_f64(15.5)), Ok(()));
    }

    #[test]
    fn a_smaller_share_clamps_the_level_and_slows_the_refill() {
        let t0 = Instant::now();
        let mut b = Bucket::full(TEN_PER_S, t0);
        let half = Refill { capacity: 5.0, per_s: 5.0 };
        assert_eq!(b.level(half, t0), 5.0, "no surplus kept past the new capacity");
        for _ in 0..5 {
            assert_eq!(b.take(1.0, half, t0), Ok(()));
        }
        assert_eq!(b.take(1.0, half, t0), Err(Duration::from_millis(200)));
    }

    #[test]
    fn given_back_tokens_never_pass_the_capacity() {
        let t0 = Instant::now();
        let mut b = Bucket::full(TEN_PER_S, t0);
        b.take(8.0, TEN_PER_S, t0).expect("room");
        b.give_back(5.0, TEN_PER_S, t0);
        assert_eq!(b.level(TEN_PER_S, t0), 7.0);
        b.give_back(50.0, TEN_PER_S, t0);
        assert_eq!(b.level(TEN_PER_S, t0), 10.0);
    }

    #[test]
    fn retry_after_rounds_up_within_one_to_sixty() {
        assert_eq!(retry_after_secs(Duration::ZERO), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(100)), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1001)), 2);
        assert_eq!(retry_after_secs(Duration::from_secs_f64(15.1)), 16);
        assert_eq!(retry_after_secs(Duration::from_secs(600)), 60);
    }
}
