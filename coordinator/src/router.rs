//! Routing decisions, as pure functions over the candidates a caller lists.
//!
//! A request goes to one decode worker, and (unless its prompt is short)
//! names the prefill workers of that worker's version group, first choice
//! first; the decode worker falls back down that list under the `retry`
//! policy. Pairing never crosses version groups: the caller lists only the
//! decode worker's group as prefill candidates, and [`route`] checks it
//! again.
//!
//! - Prefix affinity: each candidate carries a `prefix_bonus`, the caller's
//!   `--prefix-affinity` times the share of the prompt that worker holds in
//!   its prefix cache under the request's salt ([`crate::prefix`]), taken
//!   off its score: load and cached prefix are traded in one number, so a
//!   longer cached prefix wins at equal load and a busier worker wins only
//!   when its prefix saves more than its extra load costs.
//! - Decode: the lowest score, where score = queue / max_running + used KV
//!   fraction - prefix bonus. The queue is the larger of what the worker last reported
//!   (running + waiting) and what this coordinator has in flight there, so
//!   a burst between two load polls still spreads. Workers that reported
//!   not ready, refused the last poll, or are stale (no answer for the load
//!   board's max age: fail closed, see [`crate::load`]) are skipped.
//! - Prefill: power of two choices on the reported queue (two candidates
//!   drawn at random, the less busy one first), then the rest by queue as
//!   fallbacks. Random pairs keep many coordinators from herding onto the
//!   single least-loaded worker their stale views agree on. When some
//!   worker holds part of the prompt, the first choice is instead the
//!   lowest queue - prefix bonus over all of them (the bonus in queued
//!   requests: a fully cached prompt is worth `affinity` requests of queue);
//!   herding there is the point, since only that worker can skip the work.
//! - Layout: a prefill worker is paired with a decode worker only when
//!   their registered KV layout fingerprints are equal (the transfer
//!   handshake would refuse the pair anyway; leaving it out saves the
//!   failed attempt). The group's prefill workers left out this way are
//!   counted in [`Decision::layout_skipped`]; a decode worker with none left
//!   prefills locally, as one whose group has no prefill worker.
//! - Zone ([`ZonePairing`], `--zone-pairing`): workers register the zone they run in
//!   (`--zone`). `prefer` tries the decode worker's own zone's prefill workers first
//!   and the others after them (a pair due a probe in another zone goes first only when
//!   the own zone has no usable pair); `require` leaves other zones out, counted in
//!   [`Decision::zone_skipped`], and a decode worker with none left prefills locally;
//!   `any` (the default) ignores zones. KV then crosses a zone only where the operator
//!   allowed it: cross-zone traffic is slower and, in most clouds, billed.
//! - Circuit breakers ([`crate::breaker`]), one per (prefill, decode) pair:
//!   having chosen a decode worker, a prefill worker whose pair breaker is
//!   open is left out; one whose cooldown passed goes first, as the probe. A
//!   decode worker whose group has prefill workers but all of its pairs open
//!   is passed over for one that has a usable pair; when there is none, the
//!   answer is [`NoRoute::PrefillUnavailable`] (a fast 503), never a decode
//!   worker left waiting for KV that cannot come.
//!
//! Must not: do I/O, allocate per candidate beyond the result, or panic.

use std::time::Duration;

// Routing needs spread, not cryptography: the workspace's small generator.
use types::rng::XorShift64;

use crate::breaker::Gate;
use crate::load::Load;

/// A decode worker the request could go to.
#[derive(Clone, Debug)]
pub struct DecodeCandidate<'a> {
    /// Registry id (the address for fixed-address workers).
    pub id: &'a str,
    pub addr: &'a str,
    pub version_group: &'a str,
    /// Registered KV layout fingerprint (hex; empty for fixed-address workers).
    pub layout: &'a str,
    /// Registered determinism fingerprint (hex; empty for fixed-address workers):
    /// carried for the caller, not scored.
    pub determinism: &'a str,
    /// Registered zone (empty: none given).
    pub zone: &'a str,
    /// Last reported load, if fresh.
    pub load: Option<Load>,
    /// No answer for the load board's max age: not routable.
    pub stale: bool,
    /// Requests this coordinator has in flight there.
    pub inflight: usize,
    /// Most sequences it runs at once (its registration; 0 when unknown).
    pub max_running: u32,
    /// Taken off its score for the prompt's prefix it holds (see the module doc); 0 = none.
    pub prefix_bonus: f64,
}

/// A prefill worker of the chosen group.
#[derive(Clone, Debug)]
pub struct PrefillCandidate<'a> {
    pub id: &'a str,
    pub addr: &'a str,
    pub version_group: &'a str,
    /// Registered KV layout fingerprint (hex; empty for fixed-address workers).
    pub layout: &'a str,
    /// Registered zone (empty: none given).
    pub zone: &'a str,
    pub load: Option<Load>,
    /// No answer for the load board's max age: not routable.
    pub stale: bool,
    /// Taken off its queue for the prompt's prefix it holds, in queued requests; 0 = none.
    pub prefix_bonus: f64,
}

/// Why no route exists.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NoRoute {
    #[error("no decode worker is registered")]
    NoDecode,
    #[error("no decode worker is ready ({0} known, none ready, reachable and answering its load polls)")]
    NoneReady(usize),
    /// Every ready decode worker's pairs with its group's prefill workers have open circuit breakers.
    #[error("every prefill worker of the version group keeps failing (circuit breakers open); retry in {0:?}")]
    PrefillUnavailable(Duration),
}

/// Whether the prompt is prefilled on a prefill worker or by the decode worker itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Prefill {
    Remote,
    /// Short prompt (at most the threshold) or no prefill worker in the group.
    Local,
}

/// One decision: indexes into the caller's candidate lists.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    pub decode: usize,
    /// Prefill candidates, first choice first; empty for local prefill.
    pub prefill: Vec<usize>,
    pub kind: Prefill,
    /// Prefill workers of the decode worker's group left out because their
    /// layout fingerprint differs from the decode worker's.
    pub layout_skipped: usize,
    /// Prefill workers of the group left out for their zone (`require` only).
    pub zone_skipped: usize,
    /// The first prefill worker is in another zone than the decode worker.
    pub cross_zone: bool,
}

/// Whether a prefill worker's zone matters in pairing it with a decode worker
/// (`--zone-pairing`; see the module doc). Equal zone strings are one zone; workers that
/// gave none share the empty one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ZonePairing {
    /// Zones play no part.
    #[default]
    Any,
    /// The decode worker's zone first, then the others.
    Prefer,
    /// The decode worker's zone only.
    Require,
}

impl std::str::FromStr for ZonePairing {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "any" => Ok(Self::Any),
            "prefer" => Ok(Self::Prefer),
            "require" => Ok(Self::Require),
            other => Err(format!("{other:?}: use any, prefer or require")),
        }
    }
}

/// Ready and reachable by its last answer, and not stale. A worker not yet
/// polled (no answer, not stale) is usable: it has just joined.
fn usable(load: &Option<Load>, stale: bool) -> bool {
    !stale && load.is_none_or(|l| l.ready && l.reachable)
}

fn decode_score(c: &DecodeCandidate<'_>) -> f64 {
    let reported = c.load.map_or(0, |l| l.queue() as usize);
    let queue = reported.max(c.inflight) as f64;
    let per_seat = queue / f64::from(c.max_running.max(1));
    // Unknown KV use counts as half full: neither preferred nor avoided.
    let kv = c.load.map_or(0.5, |l| l.kv_used_fraction());
    per_seat + kv - c.prefix_bonus
}

/// The decode worker to use: the lowest score among usable ones (ties: the
/// earlier candidate, so a caller's stable order gives stable choices).
pub fn pick_decode(cands: &[DecodeCandidate<'_>]) -> Result<usize, NoRoute> {
    pick_decode_where(cands, |_| true)
}

/// [`pick_decode`] among the candidates `allowed` accepts (by index).
fn pick_decode_where(cands: &[DecodeCandidate<'_>], allowed: impl Fn(usize) -> bool) -> Result<usize, NoRoute> {
    if cands.is_empty() {
        return Err(NoRoute::NoDecode);
    }
    let mut best: Option<(usize, f64)> = None;
    for (i, c) in cands.iter().enumerate() {
        if !usable(&c.load, c.stale) || !allowed(i) {
            continue;
        }
        let s = decode_score(c);
        if best.is_none_or(|(_, b)| s < b) {
            best = Some((i, s));
        }
    }
    best.map(|(i, _)| i).ok_or(NoRoute::NoneReady(cands.len()))
}

fn prefill_queue(c: &PrefillCandidate<'_>) -> u32 {
    // Unknown load sorts after every known one with an empty queue.
    c.load.map_or(u32::MAX / 2, |l| l.queue())
}

/// Prefill candidates in the order to try: power of two choices for the
/// first, then the rest by reported queue. Unusable ones are left out.
pub fn order_prefill(cands: &[PrefillCandidate<'_>], rng: &mut XorShift64) -> Vec<usize> {
    let mut ok: Vec<usize> = (0..cands.len()).filter(|&i| usable(&cands[i].load, cands[i].stale)).collect();
    if ok.len() < 2 {
        return ok;
    }
    let first = if ok.iter().any(|&i| cands[i].prefix_bonus > 0.0) {
        // Someone holds part of the prompt: the best trade of queue and prefix.
        let score = |i: usize| f64::from(prefill_queue(&cands[ok[i]])) - cands[ok[i]].prefix_bonus;
        (0..ok.len()).fold(0, |best, i| if score(i) < score(best) { i } else { best })
    } else {
        let a = rng.index(ok.len());
        let mut b = rng.index(ok.len() - 1);
        if b >= a {
            b += 1;
        }
        if prefill_queue(&cands[ok[b]]) < prefill_queue(&cands[ok[a]]) {
            b
        } else {
            a
        }
    };
    let first = ok.swap_remove(first);
    // Keys are unique (the index breaks ties): an unstable sort gives the stable order.
    // Sorted as packed integers, (queue, index) in one u64, not through the candidates:
    // the sort was a sixth of a decision over 1,000 workers (`benches/route.rs`, profiled).
    let mut keyed: Vec<u64> = ok.iter().map(|&i| u64::from(prefill_queue(&cands[i])) << 32 | i as u64).collect();
    keyed.sort_unstable();
    ok.clear();
    ok.push(first);
    ok.extend(keyed.iter().map(|k| (k & u64::from(u32::MAX)) as usize));
    ok
}

/// String equality without a library call, for the per-candidate tests of a decision:
/// `==` on `str` calls `memcmp`, which took a third of a decision over 1,000 workers
/// (`benches/route.rs`, profiled) for strings that are nearly always short and equal. The
/// pointer test settles shared constants (fixed-address workers' group and layout) at once.
#[inline]
fn same(a: &str, b: &str) -> bool {
    a.len() == b.len() && (std::ptr::eq(a.as_ptr(), b.as_ptr()) || a.bytes().zip(b.bytes()).all(|(x, y)| x == y))
}

/// One pass over a decode worker's candidate pairs: the pair due a probe (one only), the
/// closed ones, the soonest an open one becomes a probe, and how many it left out for
/// their zone.
#[derive(Default)]
struct Pairs {
    probe: Option<usize>,
    closed: Vec<usize>,
    wait: Option<Duration>,
    /// The group's candidates this pass left out for their zone.
    other_zone: usize,
}

impl Pairs {
    fn usable(&self) -> bool {
        self.probe.is_some() || !self.closed.is_empty()
    }
}

/// The prefill workers paired with decode worker `d` in the order to try,
/// breakers applied: its group's, with its layout fingerprint, zones as `zones`
/// says; a pair due a probe first (one only), then the closed ones; open pairs
/// are left out. Ok: the order and how many of the group were left out for their
/// layout and for their zone. `Err(wait)`: usable pairs exist but every breaker
/// is open, the first closing to a probe in `wait`.
fn pair_order<G: Fn(usize, usize) -> Gate>(
    decode: &[DecodeCandidate<'_>],
    d: usize,
    prefill: &[PrefillCandidate<'_>],
    order: &[usize],
    zones: ZonePairing,
    gate: &G,
) -> Result<(Vec<usize>, usize, usize), Duration> {
    let (group, layout, zone) = (decode[d].version_group, decode[d].layout, decode[d].zone);
    let (mut layout_skipped, mut zone_skipped) = (0, 0);
    // One pass over the group's candidates whose zone is (`Some(true)`) or is not
    // (`Some(false)`) the decode worker's, or all (`None`).
    let mut pass = |same_zone: Option<bool>| {
        let mut pairs = Pairs::default();
        for &i in order.iter().filter(|&&i| same(prefill[i].version_group, group)) {
            if same_zone.is_some_and(|want| want != same(prefill[i].zone, zone)) {
                pairs.other_zone += 1;
                continue;
            }
            if !same(prefill[i].layout, layout) {
                layout_skipped += 1;
                continue;
            }
            match gate(d, i) {
                Gate::Closed => pairs.closed.push(i),
                Gate::Probe if pairs.probe.is_none() => pairs.probe = Some(i),
                Gate::Probe => {}
                Gate::Open(w) => pairs.wait = Some(pairs.wait.map_or(w, |x| x.min(w))),
            }
        }
        pairs
    };
    let pairs = match zones {
        ZonePairing::Any => pass(None),
        ZonePairing::Require => {
            let pairs = pass(Some(true));
            zone_skipped = pairs.other_zone;
            pairs
        }
        ZonePairing::Prefer => {
            let (mut own, other) = (pass(Some(true)), pass(Some(false)));
            if own.usable() {
                // Other zones' closed pairs as fallbacks; their probes wait for a request
                // the own zone cannot take.
                own.closed.extend(other.closed);
                own
            } else {
                Pairs { wait: own.wait.into_iter().chain(other.wait).min(), ..other }
            }
        }
    };
    match (pairs.usable(), pairs.wait) {
        (false, Some(w)) => Err(w),
        _ => Ok((pairs.probe.into_iter().chain(pairs.closed).collect(), layout_skipped, zone_skipped)),
    }
}

/// The whole decision: a decode worker, then the prefill workers it pairs
/// with (its version group and layout fingerprint, zones as `zones` says,
/// `gate(decode, prefill)` the pair's breaker) unless the prompt is at most
/// `local_prefill_max_tokens` long (or it pairs with no prefill worker:
/// local prefill).
pub fn route<G: Fn(usize, usize) -> Gate>(
    decode: &[DecodeCandidate<'_>],
    prefill: &[PrefillCandidate<'_>],
    gate: G,
    prompt_tokens: usize,
    local_prefill_max_tokens: usize,
    zones: ZonePairing,
    rng: &mut XorShift64,
) -> Result<Decision, NoRoute> {
    let d = pick_decode(decode)?;
    if prompt_tokens <= local_prefill_max_tokens {
        return Ok(Decision {
            decode: d,
            prefill: Vec::new(),
            kind: Prefill::Local,
            layout_skipped: 0,
            zone_skipped: 0,
            cross_zone: false,
        });
    }
    let all = order_prefill(prefill, rng);
    let decided = |d: usize, (order, layout_skipped, zone_skipped): (Vec<usize>, usize, usize)| {
        let kind = if order.is_empty() { Prefill::Local } else { Prefill::Remote };
        let cross_zone = order.first().is_some_and(|&p| prefill[p].zone != decode[d].zone);
        Decision { decode: d, prefill: order, kind, layout_skipped, zone_skipped, cross_zone }
    };
    let wait = match pair_order(decode, d, prefill, &all, zones, &gate) {
        Ok(order) => return Ok(decided(d, order)),
        Err(wait) => wait,
    };
    // The best decode worker cannot get a prefill now: the best one that can.
    match pick_decode_where(decode, |i| pair_order(decode, i, prefill, &all, zones, &gate).is_ok()) {
        Ok(d) => Ok(decided(d, pair_order(decode, d, prefill, &all, zones, &gate).unwrap_or_default())),
        Err(_) => Err(NoRoute::PrefillUnavailable(wait)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::time::Instant;

    fn load(used: u32, running: u32, waiting: u32) -> Option<Load> {
        Some(Load {
            ready: true,
            reachable: true,
            kv_blocks_total: 100,
            kv_blocks_used: used,
            running,
            waiting,
            at: Instant::now(),
        })
    }

    fn d<'a>(addr: &'a str, load: Option<Load>, inflight: usize) -> DecodeCandidate<'a> {
        DecodeCandidate {
            id: addr,
            addr,
            version_group: "g1",
            layout: "ab",
            determinism: "",
            zone: "",
            load,
            stale: false,
            inflight,
            max_running: 8,
            prefix_bonus: 0.0,
        }
    }

    #[test]
    fn decode_prefers_headroom_and_short_queues() {
        let c = [d("busy", load(90, 8, 4), 0), d("idle", load(10, 0, 0), 0), d("half", load(50, 4, 0), 0)];
        assert_eq!(pick_decode(&c), Ok(1));
        // Our own in-flight count wins over a stale report of an empty queue.
        let c = [d("a", load(10, 0, 0), 16), d("b", load(20, 1, 0), 0)];
        assert_eq!(pick_decode(&c), Ok(1));
    }

    #[test]
    fn unready_and_unreachable_decode_workers_are_skipped() {
        let down = load(0, 0, 0).map(|l| Load { reachable: false, ..l });
        let fenced = load(0, 0, 0).map(|l| Load { ready: false, ..l });
        let c = [d("down", down, 0), d("fenced", fenced, 0), d("busy", load(99, 8, 8), 3)];
        assert_eq!(pick_decode(&c), Ok(2));
        assert_eq!(pick_decode(&c[..2]), Err(NoRoute::NoneReady(2)));
        assert_eq!(pick_decode(&[]), Err(NoRoute::NoDecode));
        // Unknown load is usable.
        assert_eq!(pick_decode(&[d("new", None, 0)]), Ok(0));
    }

    #[test]
    fn stale_workers_are_never_routed_to() {
        // The stale worker looks idlest by its last figures (or has none).
        let frozen = DecodeCandidate { stale: true, ..d("frozen", load(0, 0, 0), 0) };
        let silent = DecodeCandidate { stale: true, ..d("silent", None, 0) };
        let c = [frozen.clone(), silent.clone(), d("busy", load(90, 8, 8), 5)];
        assert_eq!(pick_decode(&c), Ok(2));
        assert_eq!(pick_decode(&[frozen, silent]), Err(NoRoute::NoneReady(2)), "every decode worker stale: refused");
        let pre = [PrefillCandidate { stale: true, ..p("frozen", "g1", 0) }, p("busy", "g1", 9)];
        let mut rng = XorShift64::new(13);
        for _ in 0..50 {
            assert_eq!(order_prefill(&pre, &mut rng), vec![1]);
        }
        let dec = [d("d", load(0, 0, 0), 0)];
        let r = route(&dec, &pre[..1], closed, 100, 32, ZonePairing::Any, &mut rng).expect("a route");
        assert_eq!((r.kind, r.prefill.len()), (Prefill::Local, 0), "a stale prefill worker is not paired");
    }

    fn p<'a>(id: &'a str, group: &'a str, q: u32) -> PrefillCandidate<'a> {
        PrefillCandidate {
            id,
            addr: id,
            version_group: group,
            layout: "ab",
            zone: "",
            load: load(0, q, 0),
            stale: false,
            prefix_bonus: 0.0,
        }
    }

    /// Every pair closed.
    fn closed(_: usize, _: usize) -> Gate {
        Gate::Closed
    }

    #[test]
    fn power_of_two_choices_never_picks_the_busiest_of_a_pair() {
        let c = [p("a", "g1", 0), p("b", "g1", 5), p("c", "g1", 9)];
        let mut rng = XorShift64::new(7);
        let mut firsts = [0usize; 3];
        for _ in 0..3000 {
            let o = order_prefill(&c, &mut rng);
            assert_eq!(o.len(), 3);
            let mut sorted = o.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, vec![0, 1, 2], "each candidate exactly once");
            firsts[o[0]] += 1;
            // The fallbacks are by queue.
            let rest: Vec<u32> = o[1..].iter().map(|&i| prefill_queue(&c[i])).collect();
            assert!(rest.windows(2).all(|w| w[0] <= w[1]));
        }
        assert_eq!(firsts[2], 0, "the busiest worker loses every pair it is drawn in");
        // a wins both pairs it is in (2 of 3 pairs), b one of three.
        assert!(firsts[0] > 1700 && firsts[1] > 700, "{firsts:?}");
    }

    #[test]
    fn route_stays_in_the_decode_workers_group_and_honours_the_local_threshold() {
        let dec = [DecodeCandidate { version_group: "g2", ..d("d", load(0, 0, 0), 0) }];
        let pre = [p("p1", "g1", 0), p("p2", "g2", 3), p("p3", "g2", 1)];
        let mut rng = XorShift64::new(1);
        for _ in 0..100 {
            let r = route(&dec, &pre, closed, 100, 32, ZonePairing::Any, &mut rng).expect("a route");
            assert_eq!(r.kind, Prefill::Remote);
            assert!(r.prefill.iter().all(|&i| pre[i].version_group == "g2"), "{r:?}");
            assert_eq!(r.prefill.len(), 2);
            assert_eq!(r.layout_skipped, 0, "other groups are not counted");
        }
        let r = route(&dec, &pre, closed, 32, 32, ZonePairing::Any, &mut rng).expect("a route");
        assert_eq!((r.kind, r.prefill.len()), (Prefill::Local, 0));
        let r = route(&dec, &pre[..1], closed, 100, 32, ZonePairing::Any, &mut rng).expect("a route");
        assert_eq!((r.kind, r.prefill.len()), (Prefill::Local, 0), "no prefill worker in the group");
    }

    #[test]
    fn a_prefill_worker_with_another_layout_is_never_paired_and_is_counted() {
        let dec = [d("d", load(0, 0, 0), 0)];
        let pre = [PrefillCandidate { layout: "cd", ..p("other", "g1", 0) }, p("same", "g1", 5)];
        let mut rng = XorShift64::new(11);
        for _ in 0..100 {
            let r = route(&dec, &pre, closed, 100, 32, ZonePairing::Any, &mut rng).expect("a route");
            assert_eq!((r.kind, r.prefill.clone(), r.layout_skipped), (Prefill::Remote, vec![1], 1), "{r:?}");
        }
        // Only mismatched prefill workers in the group: the decode worker prefills itself.
        let r = route(&dec, &pre[..1], closed, 100, 32, ZonePairing::Any, &mut rng).expect("a route");
        assert_eq!((r.kind, r.prefill.len(), r.layout_skipped), (Prefill::Local, 0, 1));
        // Short prompts never look at the prefill workers.
        assert_eq!(route(&dec, &pre, closed, 10, 32, ZonePairing::Any, &mut rng).map(|r| r.layout_skipped), Ok(0));
        // Each decode worker is paired by its own fingerprint.
        let dec = [DecodeCandidate { layout: "cd", ..d("d-cd", load(0, 0, 0), 0) }];
        let r = route(&dec, &pre, closed, 100, 32, ZonePairing::Any, &mut rng).expect("a route");
        assert_eq!((r.prefill, r.layout_skipped), (vec![0], 1));
    }

    #[test]
    fn open_breakers_keep_prefill_workers_out_and_a_due_probe_goes_first() {
        let dec = [d("d", load(0, 0, 0), 0)];
        let open = Gate::Open(Duration::from_secs(3));
        let mut rng = XorShift64::new(3);
        let pre = [p("bad", "g1", 0), p("good", "g1", 5)];
        let gate = |_: usize, i: usize| if i == 0 { open } else { Gate::Closed };
        for _ in 0..50 {
            let r = route(&dec, &pre, gate, 100, 32, ZonePairing::Any, &mut rng).expect("a route");
            assert_eq!((r.kind, r.prefill.clone()), (Prefill::Remote, vec![1]));
        }
        let pre = [p("bad", "g1", 9), p("good", "g1", 0)];
        let gate = |_: usize, i: usize| if i == 0 { Gate::Probe } else { Gate::Closed };
        for _ in 0..50 {
            let r = route(&dec, &pre, gate, 100, 32, ZonePairing::Any, &mut rng).expect("a route");
            assert_eq!(r.prefill, vec![0, 1], "the probe first, the healthy one as fallback");
        }
    }

    #[test]
    fn breakers_are_read_for_the_chosen_decode_worker_only() {
        // (p0, d0) is open (d0's link is bad); d0 is the idler decode worker.
        let dec = [d("d0", load(0, 0, 0), 0), d("d1", load(50, 4, 0), 0)];
        let pre = [p("p0", "g1", 0)];
        let gate = |d: usize, _: usize| if d == 0 { Gate::Open(Duration::from_secs(2)) } else { Gate::Closed };
        let mut rng = XorShift64::new(9);
        for _ in 0..50 {
            let r = route(&dec, &pre, gate, 100, 32, ZonePairing::Any, &mut rng).expect("a route");
            assert_eq!((r.decode, r.prefill), (1, vec![0]), "d1's pair with p0 is closed: it takes the request");
        }
        // Short prompts need no pair: d0 still takes them.
        assert_eq!(route(&dec, &pre, gate, 10, 32, ZonePairing::Any, &mut rng).map(|r| r.decode), Ok(0));
        // With d1's pair open too, the request is refused fast.
        let all_open = |_: usize, _: usize| Gate::Open(Duration::from_secs(2));
        assert_eq!(
            route(&dec, &pre, all_open, 100, 32, ZonePairing::Any, &mut rng),
            Err(NoRoute::PrefillUnavailable(Duration::from_secs(2)))
        );
    }

    #[test]
    fn a_group_whose_prefill_workers_are_all_open_is_refused_fast_or_avoided() {
        let mut rng = XorShift64::new(5);
        let short = Gate::Open(Duration::from_millis(1500));
        let long = Gate::Open(Duration::from_secs(4));
        let pre = [p("a", "g1", 0), p("b", "g1", 0)];
        let gate = |_: usize, i: usize| match i {
            0 => long,
            1 => short,
            _ => Gate::Closed,
        };
        let dec = [d("d", load(0, 0, 0), 0)];
        assert_eq!(
            route(&dec, &pre, gate, 100, 32, ZonePairing::Any, &mut rng),
            Err(NoRoute::PrefillUnavailable(Duration::from_millis(1500))),
            "the soonest probe sets Retry-After"
        );
        // Short prompts never needed the prefill workers.
        assert_eq!(route(&dec, &pre, gate, 10, 32, ZonePairing::Any, &mut rng).map(|r| r.kind), Ok(Prefill::Local));
        // A busier decode worker in a group that can prefill takes it instead.
        let dec =
            [d("idle", load(0, 0, 0), 0), DecodeCandidate { version_group: "g2", ..d("busy", load(80, 6, 0), 0) }];
        let pre = [pre[0].clone(), pre[1].clone(), p("c", "g2", 0)];
        let r = route(&dec, &pre, gate, 100, 32, ZonePairing::Any, &mut rng).expect("a route");
        assert_eq!((r.decode, r.prefill), (1, vec![2]));
    }

    /// A decode worker in zone a; prefill workers `far` (zone b, queue 0) and `near`
    /// (zone a, queue `near_queue`), in that order.
    fn two_zones(near_queue: u32) -> ([DecodeCandidate<'static>; 1], [PrefillCandidate<'static>; 2]) {
        let dec = [DecodeCandidate { zone: "a", ..d("d", load(0, 0, 0), 0) }];
        let far = PrefillCandidate { zone: "b", ..p("far", "g1", 0) };
        (dec, [far, PrefillCandidate { zone: "a", ..p("near", "g1", near_queue) }])
    }

    #[test]
    fn zones_order_or_restrict_the_pairs_as_configured() {
        // The other zone's worker is the idler one: by load alone it comes first.
        let (dec, pre) = two_zones(6);
        let mut rng = XorShift64::new(17);
        let mut far_first = 0;
        for _ in 0..200 {
            let any = route(&dec, &pre, closed, 100, 32, ZonePairing::Any, &mut rng).expect("a route");
            far_first += usize::from(any.prefill[0] == 0);
            assert_eq!(any.cross_zone, any.prefill[0] == 0, "{any:?}");
            let prefer = route(&dec, &pre, closed, 100, 32, ZonePairing::Prefer, &mut rng).expect("a route");
            assert_eq!((prefer.prefill, prefer.zone_skipped, prefer.cross_zone), (vec![1, 0], 0, false));
            let require = route(&dec, &pre, closed, 100, 32, ZonePairing::Require, &mut rng).expect("a route");
            assert_eq!((require.prefill, require.zone_skipped, require.cross_zone), (vec![1], 1, false));
        }
        assert!(far_first > 100, "`any` ignores zones: the idler worker mostly first ({far_first}/200)");
        // No prefill worker in the own zone: `prefer` crosses, `require` prefills locally.
        let r = route(&dec, &pre[..1], closed, 100, 32, ZonePairing::Prefer, &mut rng).expect("a route");
        assert_eq!((r.kind, r.prefill, r.cross_zone), (Prefill::Remote, vec![0], true));
        let r = route(&dec, &pre[..1], closed, 100, 32, ZonePairing::Require, &mut rng).expect("a route");
        assert_eq!((r.kind, r.prefill.len(), r.zone_skipped), (Prefill::Local, 0, 1));
    }

    #[test]
    fn under_prefer_another_zones_probe_waits_while_the_own_zone_has_a_pair() {
        let (dec, pre) = two_zones(0);
        let mut rng = XorShift64::new(23);
        let far_probe = |_: usize, i: usize| if i == 0 { Gate::Probe } else { Gate::Closed };
        let r = route(&dec, &pre, far_probe, 100, 32, ZonePairing::Prefer, &mut rng).expect("a route");
        assert_eq!(r.prefill, vec![1], "the own zone's pair; the other zone's probe is not claimed");
        // The own zone's pair open: the other zone's probe goes first.
        let near_open = |_: usize, i: usize| if i == 0 { Gate::Probe } else { Gate::Open(Duration::from_secs(2)) };
        let r = route(&dec, &pre, near_open, 100, 32, ZonePairing::Prefer, &mut rng).expect("a route");
        assert_eq!((r.prefill, r.cross_zone), (vec![0], true));
        // Every pair open: refused fast, with the soonest probe of either zone.
        let open = |_: usize, i: usize| Gate::Open(Duration::from_secs(if i == 0 { 1 } else { 3 }));
        assert_eq!(
            route(&dec, &pre, open, 100, 32, ZonePairing::Prefer, &mut rng),
            Err(NoRoute::PrefillUnavailable(Duration::from_secs(1)))
        );
    }

    #[test]
    fn zone_pairing_parses_its_three_values_only() {
        assert_eq!("any".parse(), Ok(ZonePairing::Any));
        assert_eq!("prefer".parse(), Ok(ZonePairing::Prefer));
        assert_eq!("require".parse(), Ok(ZonePairing::Require));
        assert!("same-zone".parse::<ZonePairing>().is_err_and(|e| e.contains("any, prefer or require")));
    }

    /// Prefix affinity through the real match: the workers hold a prompt's
    /// first blocks under salt 7 (the tenant's scope), as reported.
    mod prefix_affinity {
        use super::*;
        use crate::prefix::{bonus, Prefixes, Query};

        const AFFINITY: f64 = 1.0;

        fn holding(prompt: &[u32], tokens: usize, salt: u64) -> Prefixes {
            let hashes = engine::kv::prefix_hashes(&prompt[..tokens], 16, salt).into_iter().collect();
            Prefixes { epoch: 1, block_size: 16, hashes }
        }

        /// Decode candidates for `prompt` asked under `salt`, one per (load, held prefix).
        fn decode_for<'a>(
            workers: &[(&'a str, Option<Load>, Prefixes)],
            prompt: &[u32],
            salt: u64,
        ) -> Vec<DecodeCandidate<'a>> {
            let mut q = Query::new(prompt, salt);
            workers
                .iter()
                .map(|(id, l, held)| DecodeCandidate {
                    prefix_bonus: bonus(AFFINITY, Some(held), &mut q).0,
                    ..d(id, *l, 0)
                })
                .collect()
        }

        fn prompt() -> Vec<u32> {
            (0..129).collect()
        }

        #[test]
        fn the_longest_cached_prefix_wins_at_equal_load() {
            let p = prompt();
            let w = [
                ("short", load(20, 2, 0), holding(&p, 32, 7)),
                ("long", load(20, 2, 0), holding(&p, 96, 7)),
                ("none", load(20, 2, 0), Prefixes::default()),
            ];
            assert_eq!(pick_decode(&decode_for(&w, &p, 7)), Ok(1));
            let pre: Vec<PrefillCandidate<'_>> = {
                let mut q = Query::new(&p, 7);
                w.iter()
                    .map(|(id, _, held)| PrefillCandidate {
                        prefix_bonus: bonus(AFFINITY, Some(held), &mut q).0,
                        ..p_(id, 3)
                    })
                    .collect()
            };
            for seed in 1..50 {
                assert_eq!(order_prefill(&pre, &mut XorShift64::new(seed))[0], 1, "seed {seed}");
            }
        }

        #[test]
        fn load_outweighs_a_short_prefix() {
            let p = prompt();
            // One block of 129 tokens cached (bonus 0.12) does not pay for a
            // queue of 8 on 8 seats and a fuller pool.
            let w =
                [("cached-busy", load(60, 8, 0), holding(&p, 16, 7)), ("idle", load(10, 0, 0), Prefixes::default())];
            assert_eq!(pick_decode(&decode_for(&w, &p, 7)), Ok(1));
            // The whole prompt cached there (bonus 0.99) still loses to an idle
            // worker when it is that much busier...
            let w =
                [("cached-busy", load(90, 12, 0), holding(&p, 128, 7)), ("idle", load(10, 0, 0), Prefixes::default())];
            assert_eq!(pick_decode(&decode_for(&w, &p, 7)), Ok(1));
            // ...and wins when the difference in load is smaller than what it saves.
            let w = [("cached", load(30, 2, 0), holding(&p, 128, 7)), ("idle", load(10, 0, 0), Prefixes::default())];
            assert_eq!(pick_decode(&decode_for(&w, &p, 7)), Ok(0));
            // Prefill: a queue of 3 more requests outweighs a fully cached prompt (worth 1).
            let mut q = Query::new(&p, 7);
            let pre = [
                PrefillCandidate {
                    prefix_bonus: bonus(AFFINITY, Some(&holding(&p, 128, 7)), &mut q).0,
                    ..p_("cached", 4)
                },
                p_("idle", 1),
            ];
            assert_eq!(order_prefill(&pre, &mut XorShift64::new(3))[0], 1);
        }

        #[test]
        fn another_tenants_cache_never_matches() {
            let p = prompt();
            // Worker "a" holds the whole prompt, but under salt 7; the request
            // comes with salt 8: no bonus, so the idler worker wins as without
            // any cache.
            let w = [("a", load(20, 1, 0), holding(&p, 128, 7)), ("b", load(10, 0, 0), Prefixes::default())];
            let c = decode_for(&w, &p, 8);
            assert_eq!(c[0].prefix_bonus, 0.0);
            assert_eq!(pick_decode(&c), Ok(1));
            assert_eq!(pick_decode(&decode_for(&w, &p, 7)), Ok(0), "the owner's own requests do match");
        }

        fn p_<'a>(id: &'a str, q: u32) -> PrefillCandidate<'a> {
            p(id, "g1", q)
        }
    }
}
