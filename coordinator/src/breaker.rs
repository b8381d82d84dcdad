//! Per-prefill-worker circuit breakers: a prefill worker that keeps failing
//! stops being chosen for a while.
//!
//! The coordinator never talks to prefill workers on the request path; the
//! decode worker drives the prefill and reports every attempt back on the
//! request's stream (`GenerateResponse.prefill_attempts`: target, error,
//! reason). Each report is one outcome for that worker's breaker:
//!
//! - **closed**: chosen as usual; `failures` consecutive failures open it.
//! - **open**: not chosen until `cooldown` has passed.
//! - **half-open** (the cooldown passed): the next request that would use
//!   the group's prefill workers probes it, first in its list; success
//!   closes the breaker, failure opens it for another cooldown. Only one
//!   probe at a time; a probe that never reports (its request was
//!   cancelled before the prefill) frees the slot after another cooldown.
//!
//! Outcomes that say nothing about the worker's health (the prefill worker
//! answered `overloaded`) are neither successes nor failures.
//!
//! [`Breaker`] is the pure state machine (time passed in); [`Breakers`] keys
//! them by prefill worker address and exports their state as metrics.
//!
//! Must not: do I/O, or block routing beyond one short lock.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use crate::metrics;

/// Breaker settings (`--prefill-breaker-failures`, `--prefill-breaker-cooldown-ms`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BreakerConfig {
    /// Consecutive failures that open a closed breaker; 0 disables breakers.
    pub failures: u32,
    /// How long an open breaker keeps its worker out of routing.
    pub cooldown: Duration,
    /// When every prefill worker of a group is open: false (the default)
    /// answers long prompts 503 `prefill_unavailable` at once; true sends
    /// them to the decode worker to prefill itself (for decode workers that
    /// run `recompute` anyway and can afford the compute).
    pub open_group_prefills_locally: bool,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self { failures: 3, cooldown: Duration::from_secs(5), open_group_prefills_locally: false }
    }
}

/// A breaker's state, as exported (`tandem_coordinator_prefill_breaker_state`: 0, 1, 2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    Closed,
    HalfOpen,
    Open,
}

impl State {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Closed => "closed",
            Self::HalfOpen => "half_open",
            Self::Open => "open",
        }
    }

    /// The gauge value.
    pub fn level(self) -> f64 {
        match self {
            Self::Closed => 0.0,
            Self::HalfOpen => 1.0,
            Self::Open => 2.0,
        }
    }
}

/// What routing may do with a worker now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gate {
    /// Use it.
    Closed,
    /// Its cooldown passed and no probe is out: one request may probe it.
    Probe,
    /// Keep it out; it may be probed after this long.
    Open(Duration),
}

/// One worker's outcome, as the decode worker reported it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Success,
    Failure,
    /// Says nothing about the worker's health (it was merely busy).
    Neutral,
}

/// One prefill worker's breaker. Pure: every method takes the time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Breaker {
    state: Inner,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Inner {
    Closed {
        failures: u32,
    },
    /// Until `until`; then half-open.
    Open {
        until: Instant,
    },
    /// `probe`: when the last probe was handed out, if one is out.
    HalfOpen {
        probe: Option<Instant>,
    },
}

impl Default for Breaker {
    fn default() -> Self {
        Self { state: Inner::Closed { failures: 0 } }
    }
}

impl Breaker {
    /// The state at `now` (an open breaker whose cooldown passed is half-open).
    pub fn state(&self, now: Instant) -> State {
        match self.state {
            Inner::Closed { .. } => State::Closed,
            Inner::Open { until } if now < until => State::Open,
            Inner::Open { .. } | Inner::HalfOpen { .. } => State::HalfOpen,
        }
    }

    /// What routing may do with the worker at `now`; no state change.
    pub fn gate(&self, now: Instant, cfg: &BreakerConfig) -> Gate {
        match self.state {
            Inner::Closed { .. } => Gate::Closed,
            Inner::Open { until } if now < until => Gate::Open(until - now),
            Inner::Open { .. } | Inner::HalfOpen { probe: None } => Gate::Probe,
            Inner::HalfOpen { probe: Some(at) } => {
                let free = at + cfg.cooldown;
                if now < free {
                    Gate::Open(free - now)
                } else {
                    Gate::Probe
                }
            }
        }
    }

    /// Hands out the probe if [`Breaker::gate`] says one may go; false when another took it.
    pub fn claim_probe(&mut self, now: Instant, cfg: &BreakerConfig) -> bool {
        if self.gate(now, cfg) != Gate::Probe {
            return false;
        }
        self.state = Inner::HalfOpen { probe: Some(now) };
        true
    }

    /// Records an outcome at `now`; returns the state change, if any.
    pub fn record(&mut self, outcome: Outcome, now: Instant, cfg: &BreakerConfig) -> Option<(State, State)> {
        let before = self.state(now);
        match (outcome, &mut self.state) {
            (Outcome::Neutral, _) => return None,
            (Outcome::Success, Inner::Closed { failures }) => *failures = 0,
            // A late success from before the breaker opened says nothing about now.
            (Outcome::Success, Inner::Open { until }) if now < *until => {}
            (Outcome::Success, _) => self.state = Inner::Closed { failures: 0 },
            (Outcome::Failure, Inner::Closed { failures }) => {
                *failures += 1;
                if *failures >= cfg.failures.max(1) {
                    self.state = Inner::Open { until: now + cfg.cooldown };
                }
            }
            // Late failures of requests sent before it opened do not extend the cooldown.
            (Outcome::Failure, Inner::Open { until }) if now < *until => {}
            (Outcome::Failure, _) => self.state = Inner::Open { until: now + cfg.cooldown },
        }
        let after = self.state(now);
        (before != after).then_some((before, after))
    }
}

/// Every prefill worker's breaker, keyed by gRPC address.
pub struct Breakers {
    config: BreakerConfig,
    map: Mutex<HashMap<String, Entry>>,
}

struct Entry {
    breaker: Breaker,
    /// The worker's registry id, for metric labels.
    worker: String,
}

impl Breakers {
    pub fn new(config: BreakerConfig) -> Self {
        Self { config, map: Mutex::new(HashMap::new()) }
    }

    pub fn config(&self) -> BreakerConfig {
        self.config
    }

    fn enabled(&self) -> bool {
        self.config.failures > 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        // Only bookkeeping happens under the lock; a poisoned map is still consistent.
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The gate of each address, in order (unknown workers are closed).
    pub fn gates<'a>(&self, addrs: impl Iterator<Item = &'a str>) -> Vec<Gate> {
        let now = Instant::now();
        let map = if self.enabled() { Some(self.lock()) } else { None };
        addrs
            .map(|a| match map.as_ref().and_then(|m| m.get(a)) {
                Some(e) => e.breaker.gate(now, &self.config),
                None => Gate::Closed,
            })
            .collect()
    }

    /// Claims the half-open probe of `addr`; false when another request took it.
    pub fn claim_probe(&self, addr: &str) -> bool {
        let now = Instant::now();
        let mut map = self.lock();
        let Some(e) = map.get_mut(addr) else { return true };
        let ok = e.breaker.claim_probe(now, &self.config);
        if ok {
            tracing::info!(worker = %e.worker, %addr, "prefill breaker half-open: probing");
            metrics::breaker_transition(&e.worker, State::Open, State::HalfOpen);
            metrics::breaker_state(&e.worker, State::HalfOpen);
        }
        ok
    }

    /// Feeds one reported attempt to its worker's breaker.
    pub fn record(&self, worker: &str, addr: &str, outcome: Outcome, why: &str) {
        if !self.enabled() {
            return;
        }
        let now = Instant::now();
        let mut map = self.lock();
        let e = map
            .entry(addr.to_owned())
            .or_insert_with(|| Entry { breaker: Breaker::default(), worker: worker.to_owned() });
        if !worker.is_empty() && e.worker != worker {
            worker.clone_into(&mut e.worker);
        }
        if let Some((from, to)) = e.breaker.record(outcome, now, &self.config) {
            tracing::warn!(worker = %e.worker, %addr, from = from.as_str(), to = to.as_str(), last = why, "prefill breaker");
            metrics::breaker_transition(&e.worker, from, to);
        }
        metrics::breaker_state(&e.worker, e.breaker.state(now));
    }

    /// Refreshes the state gauges (an open breaker turns half-open by time alone); for `/metrics`.
    pub fn export(&self) {
        let now = Instant::now();
        for e in self.lock().values() {
            metrics::breaker_state(&e.worker, e.breaker.state(now));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CFG: BreakerConfig =
        BreakerConfig { failures: 3, cooldown: Duration::from_secs(5), open_group_prefills_locally: false };

    fn fail(b: &mut Breaker, now: Instant) -> Option<(State, State)> {
        b.record(Outcome::Failure, now, &CFG)
    }

    #[test]
    fn opens_after_consecutive_failures_only() {
        let t = Instant::now();
        let mut b = Breaker::default();
        assert_eq!(fail(&mut b, t), None);
        assert_eq!(fail(&mut b, t), None);
        // A success resets the run.
        assert_eq!(b.record(Outcome::Success, t, &CFG), None);
        assert_eq!(fail(&mut b, t), None);
        assert_eq!(fail(&mut b, t), None);
        assert_eq!(b.gate(t, &CFG), Gate::Closed);
        assert_eq!(fail(&mut b, t), Some((State::Closed, State::Open)));
        assert_eq!(b.gate(t + Duration::from_secs(1), &CFG), Gate::Open(Duration::from_secs(4)));
    }

    #[test]
    fn neutral_outcomes_change_nothing() {
        let t = Instant::now();
        let mut b = Breaker::default();
        fail(&mut b, t);
        fail(&mut b, t);
        for _ in 0..10 {
            assert_eq!(b.record(Outcome::Neutral, t, &CFG), None);
        }
        assert_eq!(b.state(t), State::Closed);
        assert_eq!(fail(&mut b, t), Some((State::Closed, State::Open)));
    }

    #[test]
    fn late_reports_while_open_do_not_move_it() {
        let t = Instant::now();
        let mut b = Breaker::default();
        for _ in 0..3 {
            fail(&mut b, t);
        }
        let later = t + Duration::from_secs(2);
        assert_eq!(fail(&mut b, later), None);
        assert_eq!(b.record(Outcome::Success, later, &CFG), None);
        // The cooldown still ends 5 s after it opened.
        assert_eq!(b.gate(t + Duration::from_secs(5), &CFG), Gate::Probe);
    }

    #[test]
    fn half_open_lets_one_probe_through_and_closes_on_success() {
        let t = Instant::now();
        let mut b = Breaker::default();
        for _ in 0..3 {
            fail(&mut b, t);
        }
        let t1 = t + Duration::from_secs(5);
        assert_eq!(b.state(t1), State::HalfOpen);
        assert!(b.claim_probe(t1, &CFG));
        // One probe at a time.
        assert!(!b.claim_probe(t1, &CFG));
        assert!(matches!(b.gate(t1 + Duration::from_secs(1), &CFG), Gate::Open(_)));
        assert_eq!(b.record(Outcome::Success, t1, &CFG), Some((State::HalfOpen, State::Closed)));
        assert_eq!(b.gate(t1, &CFG), Gate::Closed);
    }

    #[test]
    fn a_failed_probe_opens_it_for_another_cooldown() {
        let t = Instant::now();
        let mut b = Breaker::default();
        for _ in 0..3 {
            fail(&mut b, t);
        }
        let t1 = t + Duration::from_secs(6);
        assert!(b.claim_probe(t1, &CFG));
        assert_eq!(fail(&mut b, t1), Some((State::HalfOpen, State::Open)));
        assert_eq!(b.gate(t1, &CFG), Gate::Open(Duration::from_secs(5)));
        assert_eq!(b.gate(t1 + Duration::from_secs(5), &CFG), Gate::Probe);
    }

    #[test]
    fn a_probe_that_never_reports_frees_the_slot_after_a_cooldown() {
        let t = Instant::now();
        let mut b = Breaker::default();
        for _ in 0..3 {
            fail(&mut b, t);
        }
        let t1 = t + Duration::from_secs(5);
        assert!(b.claim_probe(t1, &CFG));
        assert!(!b.claim_probe(t1 + Duration::from_secs(4), &CFG));
        assert!(b.claim_probe(t1 + Duration::from_secs(5), &CFG));
    }

    #[test]
    fn breakers_are_per_worker_and_can_be_disabled() {
        let on = Breakers::new(CFG);
        for _ in 0..3 {
            on.record("p0", "a:1", Outcome::Failure, "test");
        }
        let g = on.gates(["a:1", "b:2", "unknown:3"].into_iter());
        assert!(matches!(g[0], Gate::Open(_)), "{g:?}");
        assert_eq!(&g[1..], &[Gate::Closed, Gate::Closed]);
        let off = Breakers::new(BreakerConfig { failures: 0, ..CFG });
        for _ in 0..10 {
            off.record("p0", "a:1", Outcome::Failure, "test");
        }
        assert_eq!(off.gates(["a:1"].into_iter()), vec![Gate::Closed]);
    }
}
