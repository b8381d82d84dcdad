//! Retry discipline at the edge: a retry cannot come back before the
//! `Retry-After` it was given, and a caller's retries are a bounded share of
//! its traffic, so clients that retry at once, or all together, cannot
//! retry the cluster into the ground.
//!
//! A request is known again by its caller and its *identity*: its
//! idempotency key when it has one, else a digest of its body (HTTP) or
//! message (gRPC) and endpoint. Whenever the coordinator answers a request
//! with a `Retry-After` (every 429 and 503), it remembers that identity
//! until then ([`RetryGate::refused`]); the same identity seen again within
//! [`RetrySettings::window`] is a retry:
//!
//! - before its `Retry-After` is up: 429 `retry_too_soon`, whose
//!   `Retry-After` is the time still left (rounded up, not jittered), at the
//!   cost of a map lookup: nothing is validated, tokenized or queued. That
//!   answer is not remembered itself: the retry is held to the `Retry-After` of
//!   the refusal it retries (remembering the rounded-up one would push a client
//!   that keeps coming back early later and later, locking a poller out for
//!   good);
//! - after: it spends one token of the caller's retry budget, a bucket that
//!   fresh requests fill ([`RetrySettings::ratio`] each, so retries stay
//!   within that share of the caller's traffic) and time fills slowly
//!   ([`RetrySettings::min_per_s`], so a caller whose traffic is all retries
//!   still gets some through); empty: 429 `retry_budget_exhausted` with the
//!   time until a token is back.
//!
//! What is left out, and why: refusals before the body is read (a tenant's
//! rate or in-flight limit) are remembered only for keyed requests — an
//! unkeyed one has no identity yet, and the tenant's bucket already refuses
//! a retry before it refills. The table is bounded
//! ([`RetrySettings::max_entries`]); when it is full of live entries a
//! refusal is not remembered (counted), never a request refused for it.
//!
//! Must not: hold a lock across an await, refuse a request it has not seen
//! refused, or grow without bound.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use crate::error::Error;
use crate::metrics;

/// The gate's knobs (flags `--retry-window-s`, `--retry-budget-ratio`,
/// `--retry-budget-min-per-s`, `--retry-budget-burst`).
#[derive(Debug, Clone, Copy)]
pub struct RetrySettings {
    /// How long after its `Retry-After` a request is still known as a retry.
    pub window: Duration,
    /// Retry tokens each fresh request of a caller adds: the share of its
    /// traffic that may be retries.
    pub ratio: f64,
    /// Retry tokens a caller gets per second whatever its traffic.
    pub min_per_s: f64,
    /// Most retry tokens a caller holds (its burst of retries).
    pub burst: f64,
    /// Most identities remembered at once.
    pub max_entries: usize,
}

impl Default for RetrySettings {
    fn default() -> Self {
        Self { window: Duration::from_secs(60), ratio: 0.2, min_per_s: 1.0, burst: 10.0, max_entries: 100_000 }
    }
}

/// What a request is, to the gate: who sent it and what it asks.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Identity {
    caller: String,
    what: u64,
}

impl Identity {
    /// A keyed request: its key names it (whatever its body).
    pub fn keyed(caller: &str, api: &str, key: &str) -> Self {
        Self { caller: caller.to_owned(), what: digest(&[b"key", api.as_bytes(), key.as_bytes()]) }
    }

    /// An unkeyed request: its body (or message) and endpoint name it.
    pub fn of_body(caller: &str, api: &str, body: &[u8]) -> Self {
        Self { caller: caller.to_owned(), what: digest(&[b"body", api.as_bytes(), body]) }
    }

    /// The request's identity: by its key when it has one.
    pub fn of(caller: &str, api: &str, key: Option<&str>, body: &[u8]) -> Self {
        match key {
            Some(k) => Self::keyed(caller, api, k),
            None => Self::of_body(caller, api, body),
        }
    }
}

fn digest(parts: &[&[u8]]) -> u64 {
    let mut h = std::hash::DefaultHasher::new();
    for p in parts {
        p.len().hash(&mut h);
        p.hash(&mut h);
    }
    h.finish()
}

/// A refused identity: when it may come back, and until when it is known.
#[derive(Debug, Clone, Copy)]
struct Refused {
    not_before: Instant,
    forget_at: Instant,
}

/// One caller's retry budget.
#[derive(Debug, Clone, Copy)]
struct Budget {
    tokens: f64,
    at: Instant,
}

#[derive(Default)]
struct State {
    refused: HashMap<Identity, Refused>,
    budgets: HashMap<String, Budget>,
    /// When the table was last swept of forgotten entries.
    swept: Option<Instant>,
}

/// The gate every generation request passes once its identity is known.
pub struct RetryGate {
    settings: RetrySettings,
    state: Mutex<State>,
}

impl RetryGate {
    pub fn new(settings: RetrySettings) -> Self {
        Self { settings, state: Mutex::new(State::default()) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Lets a request through, or refuses it as a retry that came too soon or
    /// past its caller's budget (see the module docs).
    pub fn check(&self, id: &Identity) -> Result<(), Error> {
        self.check_at(id, Instant::now())
    }

    fn check_at(&self, id: &Identity, now: Instant) -> Result<(), Error> {
        let s = self.settings;
        let mut st = self.lock();
        let known = st.refused.get(id).copied().filter(|r| now < r.forget_at);
        let budget = st.budgets.entry(id.caller.clone()).or_insert(Budget { tokens: s.burst, at: now });
        budget.tokens = (budget.tokens + now.saturating_duration_since(budget.at).as_secs_f64() * s.min_per_s)
            .min(s.burst.max(1.0));
        budget.at = now;
        let Some(r) = known else {
            budget.tokens = (budget.tokens + s.ratio).min(s.burst.max(1.0));
            return Ok(());
        };
        if now < r.not_before {
            metrics::retry("too_soon");
            return Err(Error::RetryTooSoon { wait: r.not_before - now });
        }
        if budget.tokens < 1.0 {
            let wait = Duration::from_secs_f64((1.0 - budget.tokens) / s.min_per_s.max(f64::MIN_POSITIVE));
            metrics::retry("budget_exhausted");
            return Err(Error::RetryBudgetExhausted { wait });
        }
        budget.tokens -= 1.0;
        st.refused.remove(id);
        metrics::retry("admitted");
        Ok(())
    }

    /// Remembers that `id` was answered with `Retry-After: retry_after_s`. An earlier
    /// `Retry-After` still running that ends later stays: none the client was told is
    /// cut short.
    pub fn refused(&self, id: &Identity, retry_after_s: u64) {
        self.refused_at(id, retry_after_s, Instant::now());
    }

    /// What a frontend calls with each answer: the request's identity (none when the
    /// walk stopped before it had one), the answer's `Retry-After` value and its error
    /// code. An answer with a `Retry-After` is remembered, except a retry refused as too
    /// soon: it is held to the Retry-After it had (its own says the time left), so an
    /// eager client cannot push its own wait further out.
    pub fn answered(&self, id: Option<&Identity>, retry_after: Option<&str>, code: Option<&str>) {
        if let (Some(id), Some(secs)) = (id, retry_after_of(retry_after)) {
            if code != Some(TOO_SOON) {
                self.refused(id, secs);
            }
        }
    }

    fn refused_at(&self, id: &Identity, retry_after_s: u64, now: Instant) {
        let not_before = now + Duration::from_secs(retry_after_s);
        let entry = Refused { not_before, forget_at: not_before + self.settings.window };
        let mut st = self.lock();
        if !st.refused.contains_key(id) && st.refused.len() >= self.settings.max_entries {
            // Sweep at most once a second: a full table of live entries stays full.
            if st.swept.is_none_or(|t| now.saturating_duration_since(t) >= Duration::from_secs(1)) {
                st.refused.retain(|_, r| now < r.forget_at);
                st.budgets.retain(|_, b| now.saturating_duration_since(b.at) < self.settings.window);
                st.swept = Some(now);
            }
            if st.refused.len() >= self.settings.max_entries {
                metrics::retry("unremembered");
                return;
            }
        }
        let kept = st.refused.entry(id.clone()).or_insert(entry);
        if kept.not_before < entry.not_before {
            *kept = entry;
        }
    }

    /// Identities remembered now.
    pub fn len(&self) -> usize {
        self.lock().refused.len()
    }

    /// Whether none is remembered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The code of a retry refused as too soon ([`Error::RetryTooSoon`]): not remembered
/// (see [`RetryGate::answered`]).
pub const TOO_SOON: &str = "retry_too_soon";

/// The seconds of a `Retry-After` header or metadata value, if it is one.
fn retry_after_of(value: Option<&str>) -> Option<u64> {
    value?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gate() -> RetryGate {
        RetryGate::new(RetrySettings {
            window: Duration::from_secs(60),
            ratio: 0.5,
            min_per_s: 1.0,
            burst: 2.0,
            max_entries: 4,
        })
    }

    fn code(r: Result<(), Error>) -> &'static str {
        match r {
            Ok(()) => "ok",
            Err(e) => e.code(),
        }
    }

    #[test]
    fn a_retry_before_its_retry_after_is_refused_with_the_time_left() {
        let g = gate();
        let t0 = Instant::now();
        let id = Identity::of_body("alice", "chat", b"{}");
        assert_eq!(code(g.check_at(&id, t0)), "ok", "a fresh request passes");
        assert_eq!(Error::RetryTooSoon { wait: Duration::ZERO }.code(), TOO_SOON);
        g.refused_at(&id, 3, t0);
        match g.check_at(&id, t0 + Duration::from_millis(1200)) {
            Err(Error::RetryTooSoon { wait }) => assert_eq!(wait, Duration::from_millis(1800)),
            other => panic!("{other:?}"),
        }
        // A shorter Retry-After does not cut a longer one short.
        g.refused_at(&id, 1, t0 + Duration::from_millis(1300));
        assert_eq!(code(g.check_at(&id, t0 + Duration::from_millis(2500))), "retry_too_soon");
        // Another body, or another caller, is another request.
        assert_eq!(code(g.check_at(&Identity::of_body("alice", "chat", b"{ }"), t0)), "ok");
        assert_eq!(code(g.check_at(&Identity::of_body("bob", "chat", b"{}"), t0)), "ok");
        // On time: a retry, taken from the budget, and the identity is forgotten.
        assert_eq!(code(g.check_at(&id, t0 + Duration::from_secs(3))), "ok");
        assert!(g.is_empty());
    }

    #[test]
    fn answers_with_a_retry_after_are_remembered_but_a_too_soon_refusal_is_not() {
        let g = gate();
        let id = Identity::of_body("alice", "chat", b"{}");
        g.answered(None, Some("5"), Some("queue_full"));
        g.answered(Some(&id), None, Some("queue_full"));
        g.answered(Some(&id), Some("soon"), Some("queue_full"));
        assert!(g.is_empty(), "no identity, no Retry-After, or not a number: nothing to hold");
        g.answered(Some(&id), Some("5"), Some(TOO_SOON));
        assert!(g.is_empty(), "a too-soon refusal does not move the wait further out");
        g.answered(Some(&id), Some(" 5 "), Some("queue_full"));
        assert_eq!(code(g.check(&id)), "retry_too_soon");
    }

    #[test]
    fn a_keyed_retry_is_known_by_its_key_whatever_its_body() {
        let g = gate();
        let t0 = Instant::now();
        g.refused_at(&Identity::of("alice", "grpc", Some("k1"), b"a"), 2, t0);
        let again = Identity::of("alice", "grpc", Some("k1"), b"b");
        assert_eq!(code(g.check_at(&again, t0 + Duration::from_millis(500))), "retry_too_soon");
        assert_eq!(code(g.check_at(&Identity::of("alice", "chat", Some("k1"), b"a"), t0)), "ok", "another API");
    }

    #[test]
    fn retries_are_a_share_of_fresh_traffic_and_the_budget_says_when_one_is_back() {
        let g = gate();
        let t0 = Instant::now();
        // Burst 2: two retries at once pass, the third is over the budget.
        let ids: Vec<_> = (0..3).map(|i| Identity::of_body("alice", "chat", &[i])).collect();
        for id in &ids {
            g.refused_at(id, 1, t0);
        }
        let t1 = t0 + Duration::from_secs(1);
        // Each check first refills at 1/s since the bucket was last seen (full at 2).
        assert_eq!(code(g.check_at(&ids[0], t1)), "ok");
        assert_eq!(code(g.check_at(&ids[1], t1)), "ok");
        match g.check_at(&ids[2], t1) {
            Err(Error::RetryBudgetExhausted { wait }) => assert_eq!(wait, Duration::from_secs(1)),
            other => panic!("{other:?}"),
        }
        // Two fresh requests at ratio 0.5 earn one retry.
        g.check_at(&Identity::of_body("alice", "chat", b"x"), t1).unwrap_or_else(|e| panic!("{e}"));
        g.check_at(&Identity::of_body("alice", "chat", b"y"), t1).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(code(g.check_at(&ids[2], t1)), "ok");
        // Another caller's budget is its own.
        let bob = Identity::of_body("bob", "chat", b"z");
        g.refused_at(&bob, 1, t0);
        assert_eq!(code(g.check_at(&bob, t1)), "ok");
    }

    #[test]
    fn an_identity_is_forgotten_after_the_window_and_the_table_is_bounded() {
        let g = gate();
        let t0 = Instant::now();
        let id = Identity::of_body("alice", "chat", b"{}");
        g.refused_at(&id, 1, t0);
        // Past Retry-After + window: a fresh request again (no budget spent).
        assert_eq!(code(g.check_at(&id, t0 + Duration::from_secs(62))), "ok");
        // Four live entries fill the table (the forgotten one is swept for them); a fifth
        // is not remembered, and nobody is refused for it.
        let t1 = t0 + Duration::from_secs(62);
        for i in 0..5u8 {
            g.refused_at(&Identity::of_body("carol", "chat", &[i]), 30, t1);
        }
        assert_eq!(g.len(), 4);
        assert_eq!(code(g.check_at(&Identity::of_body("carol", "chat", &[0]), t1)), "retry_too_soon");
        assert_eq!(code(g.check_at(&Identity::of_body("carol", "chat", &[4]), t1)), "ok", "not remembered: passes");
    }
}
