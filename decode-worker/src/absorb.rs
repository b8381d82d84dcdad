//! How much prefill a decode worker takes over from an overloaded prefill
//! tier.
//!
//! Under `recompute`, a prefill worker that refuses a request as overloaded
//! could simply be replaced by a local prefill. Done without limit, that
//! turns prefill-tier overload into decode-tier stalls: every local prefill
//! chunk shares an engine step with the running streams, whose tokens then
//! wait. So the decode worker absorbs at most `tokens_per_s` prompt tokens
//! per second this way; past that the request is refused as `overloaded`
//! (the coordinator answers 503 + Retry-After), and the running streams
//! keep their pace.
//!
//! A token bucket holding one second's worth, allowed to go into debt: a
//! request is taken while anything is left, and its whole prompt is
//! charged. So one prompt longer than a second's budget still passes when
//! the bucket is full (and the next wait is longer), and over any window of
//! `t` seconds at most `tokens_per_s * (1 + t)` tokens plus one prompt are
//! absorbed. Time is passed in (tokio's clock in the service), so it is
//! tested without one, or on a paused one.

use tokio::time::Instant;

/// The bucket. 0 tokens per second absorbs nothing.
#[derive(Debug)]
pub struct AbsorbBudget {
    tokens_per_s: f64,
    level: f64,
    at: Instant,
}

impl AbsorbBudget {
    /// A full bucket (one second's worth) at `now`.
    pub fn new(tokens_per_s: u64, now: Instant) -> Self {
        let rate = tokens_per_s as f64;
        Self { tokens_per_s: rate, level: rate, at: now }
    }

    /// Charges `tokens` and says yes while budget is left at `now`; says no
    /// (and charges nothing) once it is spent.
    pub fn try_take(&mut self, tokens: usize, now: Instant) -> bool {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.at = self.at.max(now);
        self.level = (self.level + dt * self.tokens_per_s).min(self.tokens_per_s);
        if self.level <= 0.0 {
            return false;
        }
        self.level -= tokens as f64;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn takes_while_budget_is_left_then_refills_at_the_rate() {
        let t0 = Instant::now();
        let mut b = AbsorbBudget::new(100, t0);
        assert!(b.try_take(60, t0));
        assert!(b.try_take(60, t0), "40 left: taken, into debt");
        assert!(!b.try_take(1, t0), "spent");
        // -20 + 100/s: still spent at 0.2 s, open again just after.
        assert!(!b.try_take(1, t0 + Duration::from_millis(200)));
        assert!(b.try_take(1, t0 + Duration::from_millis(210)));
    }

    #[test]
    fn a_prompt_longer_than_a_second_passes_a_full_bucket_and_pays_after() {
        let t0 = Instant::now();
        let mut b = AbsorbBudget::new(100, t0);
        assert!(b.try_take(500, t0));
        assert!(!b.try_take(1, t0 + Duration::from_secs(4)), "-400 + 400 is nothing left");
        assert!(b.try_take(1, t0 + Duration::from_millis(4010)));
    }

    #[test]
    fn idle_time_fills_only_one_second_of_budget() {
        let t0 = Instant::now();
        let mut b = AbsorbBudget::new(100, t0);
        let later = t0 + Duration::from_secs(3600);
        assert!(b.try_take(100, later));
        assert!(!b.try_take(1, later), "an hour idle is still one second's worth");
    }

    #[test]
    fn zero_absorbs_nothing() {
        let t0 = Instant::now();
        let mut b = AbsorbBudget::new(0, t0);
        assert!(!b.try_take(1, t0));
        assert!(!b.try_take(1, t0 + Duration::from_secs(60)));
    }

    /// The service reads tokio's clock, so a paused clock refills the
    /// bucket exactly as far as it is advanced, with no real waiting.
    #[tokio::test(start_paused = true)]
    #[allow(clippy::disallowed_types, reason = "checks that no real time passed")]
    async fn the_bucket_refills_on_tokios_paused_clock() {
        let real = std::time::Instant::now();
        let mut b = AbsorbBudget::new(100, Instant::now());
        assert!(b.try_take(150, Instant::now()), "a full bucket takes a long prompt, into debt");
        assert!(!b.try_take(1, Instant::now()), "spent");
        tokio::time::advance(Duration::from_millis(499)).await;
        assert!(!b.try_take(1, Instant::now()), "49.9 of the 50 tokens owed are back: still spent");
        tokio::time::advance(Duration::from_millis(2)).await;
        assert!(b.try_take(1, Instant::now()), "the debt is paid 500 ms on");
        tokio::time::advance(Duration::from_secs(3600)).await;
        assert!(b.try_take(100, Instant::now()), "refilled");
        assert!(!b.try_take(1, Instant::now()), "an hour idle is one second's worth");
        assert!(real.elapsed() < Duration::from_secs(2), "waited in real time: {:?}", real.elapsed());
    }

    /// Over any window the bound in the module docs holds, whatever the arrivals.
    #[test]
    fn absorbed_tokens_stay_within_rate_times_window_plus_a_burst() {
        let t0 = Instant::now();
        let mut b = AbsorbBudget::new(300, t0);
        let mut absorbed = 0usize;
        let mut rng = types::rng::XorShift64::new(0x2545_F491_4F6C_DD1D);
        for ms in 0..20_000u64 {
            let seed = rng.next_u64();
            let prompt = 1 + (seed % 700) as usize;
            if seed % 3 == 0 && b.try_take(prompt, t0 + Duration::from_millis(ms)) {
                absorbed += prompt;
            }
            let bound = 300.0 * (1.0 + ms as f64 / 1000.0) + 700.0;
            assert!(absorbed as f64 <= bound, "{absorbed} tokens by {ms} ms");
        }
        assert!(absorbed > 300 * 18, "the budget is used, not just bounded: {absorbed}");
    }
}
