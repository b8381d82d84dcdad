//! Circuit breakers per (prefill worker, decode worker) pair: a pair whose
//! remote prefills keep failing stops being used for a while.
//!
//! The coordinator never talks to prefill workers on the request path; the
//! decode worker drives the prefill (the prefill worker pushes KV over the
//! decode worker's KV link) and reports every attempt back on the request's
//! stream (`GenerateResponse.prefill_attempts`: target, error, reason). An
//! attempt decode worker D reports about prefill worker P is one outcome for
//! the breaker of the pair (P, D), and only that pair: a failure says "P
//! could not get KV to D", which may be P (broken) or D's KV link (lossy,
//! blackholed, resetting). Keying by pair keeps a bad link on one decode
//! worker from taking a healthy prefill worker away from every other
//! decode worker. Each pair's breaker:
//!
//! - **closed**: used as usual; `failures` consecutive failures open it.
//! - **open**: not used until `cooldown` has passed.
//! - **half-open** (the cooldown passed): the next request routed to D that
//!   would use P probes it, first in its list; success closes the breaker,
//!   failure opens it for another cooldown. Only one probe per pair at a
//!   time; a probe that never reports (its request was cancelled before the
//!   prefill) frees the slot after another cooldown.
//!
//! Outcomes that say nothing about the worker's health (the prefill worker
//! answered `overloaded`) are neither successes nor failures.
//!
//! **When pairs disagree** ((P, D1) open, (P, D2) closed), each is taken at
//! its word: routing, having chosen D, reads only D's pairs. A decode worker
//! all of whose pairs are open is passed over for one with a usable pair
//! ([`crate::router`]); only when no ready decode worker has one is the
//! request refused fast (503 `prefill_unavailable`). Nothing is inferred
//! across pairs: a prefill worker that is broken for everyone opens each of
//! its pairs on that pair's own reports, so it costs up to `failures` failed
//! attempts per decode worker (and one probe per pair per cooldown) instead
//! of `failures` in all. That is the price of never blaming a healthy
//! prefill worker for one decode worker's link; with a handful of decode
//! workers it is a few requests more, each still answered by the decode
//! worker's `kv_load_failure_policy` (retry/recompute/fail).
//!
//! Pairs whose prefill or decode worker left the membership are dropped
//! ([`Breakers::retain`], from routing), so the table holds at most one
//! entry per live pair.
//!
//! [`Breaker`] is the pure state machine (time passed in); [`Breakers`] keys
//! them by pair (gRPC addresses) and exports their state as metrics labelled
//! `{prefill, decode}` (registry ids).
//!
//! Must not: do I/O, or block routing beyond one short lock.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::Duration;

use rustc_hash::FxHashMap;
use tokio::time::Instant;

use crate::metrics;

/// Breaker settings (`--prefill-breaker-failures`, `--prefill-breaker-cooldown-ms`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BreakerConfig {
    /// Consecutive failures that open a closed breaker; 0 disables breakers.
    pub failures: u32,
    /// How long an open breaker keeps its pair out of routing.
    pub cooldown: Duration,
    /// When every ready decode worker's pairs are open: false (the default)
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

/// What routing may do with a pair now.
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

/// One pair's breaker. Pure: every method takes the time.
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

/// One (prefill worker, decode worker) pair: gRPC addresses key it, registry
/// ids label its metrics (fixed-address workers use their address as id).
#[derive(Clone, Copy, Debug)]
pub struct Pair<'a> {
    pub prefill_id: &'a str,
    pub prefill_addr: &'a str,
    pub decode_id: &'a str,
    pub decode_addr: &'a str,
}

/// Every (prefill worker, decode worker) pair's breaker, keyed by their gRPC
/// addresses (prefill, decode).
pub struct Breakers {
    config: BreakerConfig,
    map: Mutex<Table>,
}

/// The breakers, and which of them are not closed: a routing decision reads
/// only those ([`Breakers::gates`]), so its cost does not grow with the
/// pairs that ever reported (up to prefill x decode workers).
#[derive(Default)]
struct Table {
    entries: HashMap<(String, String), Entry>,
    /// Keys of `entries` whose breaker is open or half-open.
    not_closed: HashSet<(String, String)>,
}

/// The gates of one routing decision: the pairs whose breaker is not
/// closed, by decode then prefill address; every other pair is closed.
#[derive(Debug, Default)]
pub struct Gates {
    // Read for each candidate pair of a decision: a fast hash of our own keys.
    by_decode: FxHashMap<String, FxHashMap<String, Gate>>,
}

impl Gates {
    /// The gate of the (prefill, decode) pair; a look-up with no allocation.
    pub fn get(&self, prefill_addr: &str, decode_addr: &str) -> Gate {
        self.by_decode.get(decode_addr).and_then(|m| m.get(prefill_addr)).copied().unwrap_or(Gate::Closed)
    }

    /// The gates of one decode worker's pairs that are not closed, by prefill address.
    pub fn row(&self, decode_addr: &str) -> Option<&FxHashMap<String, Gate>> {
        self.by_decode.get(decode_addr)
    }

    /// Sets the pair's gate for the rest of this decision (a probe another request claimed).
    pub fn set(&mut self, prefill_addr: &str, decode_addr: &str, gate: Gate) {
        self.by_decode.entry(decode_addr.to_owned()).or_default().insert(prefill_addr.to_owned(), gate);
    }
}

struct Entry {
    breaker: Breaker,
    /// The workers' registry ids, for metric labels.
    prefill: String,
    decode: String,
}

impl Breakers {
    pub fn new(config: BreakerConfig) -> Self {
        Self { config, map: Mutex::new(Table::default()) }
    }

    pub fn config(&self) -> BreakerConfig {
        self.config
    }

    fn enabled(&self) -> bool {
        self.config.failures > 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        // Only bookkeeping happens under the lock; a poisoned map is still consistent.
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The gates of the pairs whose breaker is not closed now (one lock; the
    /// cost follows those pairs, not all pairs).
    pub fn gates(&self) -> Gates {
        let mut gates = Gates::default();
        if !self.enabled() {
            return gates;
        }
        let now = Instant::now();
        let t = self.lock();
        for key in &t.not_closed {
            let Some(e) = t.entries.get(key) else { continue };
            let gate = e.breaker.gate(now, &self.config);
            if gate != Gate::Closed {
                gates.set(&key.0, &key.1, gate);
            }
        }
        gates
    }

    /// Claims the half-open probe of the (prefill, decode) pair; false when another request took it.
    pub fn claim_probe(&self, prefill_addr: &str, decode_addr: &str) -> bool {
        let now = Instant::now();
        let mut t = self.lock();
        let Some(e) = t.entries.get_mut(&(prefill_addr.to_owned(), decode_addr.to_owned())) else { return true };
        let ok = e.breaker.claim_probe(now, &self.config);
        if ok {
            tracing::info!(prefill = %e.prefill, decode = %e.decode, %prefill_addr, %decode_addr, "prefill breaker half-open: probing");
            metrics::breaker_transition(&e.prefill, &e.decode, State::Open, State::HalfOpen);
            metrics::breaker_state(&e.prefill, &e.decode, State::HalfOpen);
        }
        ok
    }

    /// Feeds one attempt, as the pair's decode worker reported it, to the pair's breaker.
    pub fn record(&self, pair: Pair<'_>, outcome: Outcome, why: &str) {
        if !self.enabled() {
            return;
        }
        let now = Instant::now();
        let mut t = self.lock();
        let key = (pair.prefill_addr.to_owned(), pair.decode_addr.to_owned());
        let e = t.entries.entry(key.clone()).or_insert_with(|| Entry {
            breaker: Breaker::default(),
            prefill: pair.prefill_id.to_owned(),
            decode: pair.decode_id.to_owned(),
        });
        if !pair.prefill_id.is_empty() && e.prefill != pair.prefill_id {
            pair.prefill_id.clone_into(&mut e.prefill);
        }
        if !pair.decode_id.is_empty() && e.decode != pair.decode_id {
            pair.decode_id.clone_into(&mut e.decode);
        }
        if let Some((from, to)) = e.breaker.record(outcome, now, &self.config) {
            tracing::warn!(
                prefill = %e.prefill,
                decode = %e.decode,
                prefill_addr = %pair.prefill_addr,
                decode_addr = %pair.decode_addr,
                from = from.as_str(),
                to = to.as_str(),
                last = why,
                "prefill breaker"
            );
            metrics::breaker_transition(&e.prefill, &e.decode, from, to);
        }
        let state = e.breaker.state(now);
        metrics::breaker_state(&e.prefill, &e.decode, state);
        if state == State::Closed {
            t.not_closed.remove(&key);
        } else {
            t.not_closed.insert(key);
        }
    }

    /// Drops the breakers of pairs whose prefill or decode worker left the
    /// membership (`member(addr)` is false for both roles' gone addresses);
    /// their state gauge is set back to closed, since the exporter cannot
    /// delete a series. Returns how many were dropped.
    pub fn retain(&self, member: impl Fn(&str) -> bool) -> usize {
        let mut t = self.lock();
        let before = t.entries.len();
        t.entries.retain(|(p, d), e| {
            let keep = member(p) && member(d);
            if !keep {
                metrics::breaker_state(&e.prefill, &e.decode, State::Closed);
            }
            keep
        });
        t.not_closed.retain(|(p, d)| member(p) && member(d));
        before - t.entries.len()
    }

    /// Pairs with a breaker (ever reported, not yet dropped).
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Refreshes the state gauges (an open breaker turns half-open by time alone); for `/metrics`.
    pub fn export(&self) {
        let now = Instant::now();
        for e in self.lock().entries.values() {
            metrics::breaker_state(&e.prefill, &e.decode, e.breaker.state(now));
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

    fn pair<'a>(p: &'a str, d: &'a str) -> Pair<'a> {
        Pair { prefill_id: p, prefill_addr: p, decode_id: d, decode_addr: d }
    }

    #[test]
    fn breakers_are_per_pair_and_can_be_disabled() {
        let on = Breakers::new(CFG);
        for _ in 0..3 {
            on.record(pair("p:1", "d:1"), Outcome::Failure, "test");
        }
        let g = on.gates();
        assert!(matches!(g.get("p:1", "d:1"), Gate::Open(_)), "{g:?}");
        assert_eq!([g.get("p:2", "d:1"), g.get("unknown:3", "d:1")], [Gate::Closed, Gate::Closed]);
        // Failures reported by d:1 say nothing about p:1's link to d:2.
        assert_eq!(g.get("p:1", "d:2"), Gate::Closed, "{g:?}");
        // The probe is per pair too.
        assert!(on.claim_probe("p:1", "d:2"), "an unknown pair needs no probe");
        let off = Breakers::new(BreakerConfig { failures: 0, ..CFG });
        for _ in 0..10 {
            off.record(pair("p:1", "d:1"), Outcome::Failure, "test");
        }
        assert_eq!(off.gates().get("p:1", "d:1"), Gate::Closed);
        assert!(off.is_empty());
    }

    #[test]
    fn a_prefill_worker_failing_everywhere_opens_each_pair_on_its_own_reports() {
        let b = Breakers::new(CFG);
        for _ in 0..3 {
            b.record(pair("p", "d1"), Outcome::Failure, "test");
        }
        for _ in 0..2 {
            b.record(pair("p", "d2"), Outcome::Failure, "test");
        }
        let g = b.gates();
        assert!(matches!(g.get("p", "d1"), Gate::Open(_)));
        assert_eq!(g.get("p", "d2"), Gate::Closed, "d2 has seen 2 failures, not 3");
        b.record(pair("p", "d2"), Outcome::Failure, "test");
        let g = b.gates();
        assert!(["d1", "d2"].iter().all(|d| matches!(g.get("p", d), Gate::Open(_))), "{g:?}");
    }

    #[test]
    fn pairs_of_workers_that_left_are_dropped() {
        let b = Breakers::new(CFG);
        for (p, d) in [("p1", "d1"), ("p1", "d2"), ("p2", "d1"), ("p2", "d2")] {
            b.record(pair(p, d), Outcome::Failure, "test");
        }
        assert_eq!(b.len(), 4);
        // p2 and d2 left: only (p1, d1) stays.
        assert_eq!(b.retain(|a| a == "p1" || a == "d1"), 3);
        assert_eq!(b.len(), 1);
        // Workers coming and going leave no trace behind.
        for i in 0..100 {
            let d = format!("d-new-{i}");
            b.record(pair("p1", &d), Outcome::Success, "test");
            b.retain(|a| a == "p1" || a == "d1" || a == d);
        }
        assert_eq!(b.len(), 2);
    }

    /// A decision reads only the pairs that are not closed: a pair that opened
    /// is in its gates, and leaves them when a probe closes it again.
    #[tokio::test(start_paused = true)]
    async fn gates_hold_only_the_pairs_not_closed() {
        let b = Breakers::new(CFG);
        for i in 0..50 {
            b.record(pair("p", &format!("d{i}")), Outcome::Success, "test");
        }
        for _ in 0..3 {
            b.record(pair("p", "d7"), Outcome::Failure, "test");
        }
        assert_eq!(b.len(), 50);
        let g = b.gates();
        assert_eq!(g.by_decode.len(), 1, "{g:?}");
        assert!(matches!(g.get("p", "d7"), Gate::Open(_)));
        tokio::time::advance(CFG.cooldown).await;
        assert_eq!(b.gates().get("p", "d7"), Gate::Probe);
        assert!(b.claim_probe("p", "d7"));
        assert!(matches!(b.gates().get("p", "d7"), Gate::Open(_)), "the probe is out: no second one");
        b.record(pair("p", "d7"), Outcome::Success, "test");
        assert!(b.gates().by_decode.is_empty(), "closed again: no gate left");
        // Dropped pairs leave the gates too.
        for _ in 0..3 {
            b.record(pair("p", "d8"), Outcome::Failure, "test");
        }
        b.retain(|a| a != "d8");
        assert!(b.gates().by_decode.is_empty());
    }
}
