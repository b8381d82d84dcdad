//! One routing decision ([`Route`]): the decode worker with the most headroom (or,
//! for a continuation, one its pin allows) and the prefill workers of its version
//! group, read from the membership cache, the load board, the prefix reports and the
//! circuit breakers, with no I/O.

use super::*;

/// One routing decision: a decode worker and the prefill workers (same
/// version group) it may use, first choice first.
#[derive(Debug)]
pub struct Route {
    pub decode: String,
    /// The decode worker's registry id (its address for fixed-address workers).
    pub decode_id: String,
    /// The decode worker's version group and determinism fingerprint (hex; empty for
    /// fixed-address workers and workers older than the field): what a continuation of
    /// the request elsewhere must match.
    pub version_group: String,
    pub determinism: String,
    /// At most `prefill_attempts` of them ([`RouteSettings`]).
    pub prefill: Vec<PrefillTarget>,
    /// Prompt tokens the worker that prefills (the first prefill worker, or
    /// the decode worker) reported cached under the request's salt; 0 when
    /// routed without a prompt to match.
    pub cached_tokens: usize,
}

impl Cluster {
    /// Picks the decode worker with the most headroom and the prefill
    /// workers of its version group (see [`crate::router`]), by load only.
    /// No I/O: it reads the membership cache and the load board.
    pub fn route(&self, prompt_tokens: usize) -> Result<Route, Error> {
        self.route_prompt(prompt_tokens, None, None)
    }

    /// [`Cluster::route`] with prefix affinity: each worker's reported
    /// prefix blocks are matched against `tokens` under `salt`
    /// ([`crate::prefix`]).
    pub fn route_for(&self, tokens: &[u32], salt: u64) -> Result<Route, Error> {
        self.route_prompt(tokens.len(), Some(Query::new(tokens, salt)), None)
    }

    /// [`Cluster::route_for`] for a continuation: only decode workers `pin` allows.
    pub(super) fn route_pinned(&self, tokens: &[u32], salt: u64, pin: Option<&Pin>) -> Result<Route, Error> {
        self.route_prompt(tokens.len(), Some(Query::new(tokens, salt)), pin)
    }

    /// One routing decision, timed in wall and thread CPU time
    /// (`tandem_coordinator_route_decision_seconds`, `..._cpu_seconds`).
    fn route_prompt(&self, prompt_tokens: usize, query: Option<Query<'_>>, pin: Option<&Pin>) -> Result<Route, Error> {
        let started = tokio::time::Instant::now();
        let cpu = thread_cpu();
        let route = self.decide(prompt_tokens, query, pin);
        let spent = thread_cpu().zip(cpu).map(|(now, then)| now.saturating_sub(then));
        metrics::route_decision(started.elapsed(), spent);
        route
    }

    fn decide(&self, prompt_tokens: usize, mut query: Option<Query<'_>>, pin: Option<&Pin>) -> Result<Route, Error> {
        let affinity = self.settings.prefix_affinity;
        let view;
        // Read for the whole decision (no await in it): the answer's cached tokens come
        // from the same walk of the prefix index as the candidates' bonuses.
        let loads = self.board.read();
        // Who holds the prompt's start: one walk down its chain, whatever the fleet's size.
        let held = match query.as_mut() {
            Some(q) if affinity > 0.0 => Some(loads.matches(q)),
            _ => None,
        };
        let (decode, prefill): (Vec<DecodeCandidate<'_>>, Vec<PrefillCandidate<'_>>) = {
            let inflight = self.decode.lock().unwrap_or_else(|e| e.into_inner());
            let inflight_of = |a: &str| inflight.get(a).map_or(0, |d| d.inflight.load(Ordering::Relaxed));
            let bonus = |addr: &str| match (&held, &query) {
                (Some(m), Some(q)) => m.bonus(affinity, addr, q),
                _ => 0.0,
            };
            // A continuation runs only where `pin` allows: not on a worker it lost, and in the
            // group and determinism class of the worker that generated its tokens.
            let allowed = |addr: &str, group: &str, determinism: &str| match pin {
                None => true,
                Some(p) => {
                    !p.exclude.iter().any(|x| x == addr)
                        && group == p.version_group
                        && (p.determinism.is_empty() || determinism == p.determinism)
                }
            };
            let roster = |revision: i64, listed: &mut dyn Iterator<Item = &str>, count: usize| {
                let key = (revision, count, loads.epoch());
                let mut r = self.roster.lock().unwrap_or_else(|e| e.into_inner());
                r.slots(key, || listed.map(|a| loads.slot(a)).collect())
            };
            match &self.source {
                Source::Static { decode, prefill } => {
                    let slots =
                        roster(0, &mut decode.iter().chain(prefill).map(String::as_str), decode.len() + prefill.len());
                    let (decode_slots, prefill_slots) = slots.split_at(decode.len().min(slots.len()));
                    (
                        decode
                            .iter()
                            .zip(decode_slots)
                            .filter(|(a, _)| allowed(a, STATIC_GROUP, ""))
                            .map(|(a, &slot)| {
                                let (load, stale) = loads.get_and_stale_at(slot);
                                DecodeCandidate {
                                    id: a,
                                    addr: a,
                                    version_group: STATIC_GROUP,
                                    layout: "",
                                    determinism: "",
                                    zone: "",
                                    load,
                                    stale,
                                    inflight: inflight_of(a),
                                    max_running: 0,
                                    prefix_bonus: bonus(a),
                                }
                            })
                            .collect(),
                        prefill
                            .iter()
                            .zip(prefill_slots)
                            .map(|(a, &slot)| {
                                let (load, stale) = loads.get_and_stale_at(slot);
                                PrefillCandidate {
                                    id: a,
                                    addr: a,
                                    version_group: STATIC_GROUP,
                                    layout: "",
                                    zone: "",
                                    load,
                                    stale,
                                    prefix_bonus: bonus(a),
                                }
                            })
                            .collect(),
                    )
                }
                Source::Etcd { membership, max_stale } => {
                    if registry_expired(membership, *max_stale) {
                        metrics::route_refused("registry_unavailable");
                        return Err(Error::RegistryUnavailable);
                    }
                    view = membership.view();
                    // Breakers of pairs whose worker left the membership go with it: checked
                    // when the membership or the set of breakers changed, not per decision.
                    let mark = (view.revision(), self.breakers.len());
                    let mut pruned = self.pruned.lock().unwrap_or_else(|e| e.into_inner());
                    if mark.1 > 0 && *pruned != mark {
                        let members: std::collections::HashSet<&str> =
                            view.routable().map(|w| w.grpc_addr.as_str()).collect();
                        self.breakers.retain(|a| members.contains(a));
                        *pruned = (view.revision(), self.breakers.len());
                    }
                    drop(pruned);
                    let listed: Vec<&registry::WorkerInfo> = view.routable().collect();
                    let slots = roster(view.revision(), &mut listed.iter().map(|w| w.grpc_addr.as_str()), listed.len());
                    let (mut d, mut p) = (Vec::new(), Vec::new());
                    for (w, &slot) in listed.iter().zip(slots.iter()).filter(|(w, _)| !w.draining) {
                        let (load, stale) = loads.get_and_stale_at(slot);
                        if w.role == registry::Role::Decode {
                            if !allowed(&w.grpc_addr, &w.version_group, &w.determinism_fingerprint) {
                                continue;
                            }
                            d.push(DecodeCandidate {
                                id: &w.id,
                                addr: &w.grpc_addr,
                                version_group: &w.version_group,
                                layout: &w.layout_fingerprint,
                                determinism: &w.determinism_fingerprint,
                                zone: &w.zone,
                                load,
                                stale,
                                inflight: inflight_of(&w.grpc_addr),
                                max_running: w.capacity.max_running,
                                prefix_bonus: bonus(&w.grpc_addr),
                            });
                        } else {
                            p.push(PrefillCandidate {
                                id: &w.id,
                                addr: &w.grpc_addr,
                                version_group: &w.version_group,
                                layout: &w.layout_fingerprint,
                                zone: &w.zone,
                                load,
                                stale,
                                prefix_bonus: bonus(&w.grpc_addr),
                            });
                        }
                    }
                    (d, p)
                }
            }
        };
        let mut gates = if prompt_tokens > self.settings.local_prefill_max_tokens && !prefill.is_empty() {
            self.breakers.gates()
        } else {
            Gates::default()
        };
        let threshold = self.settings.local_prefill_max_tokens;
        let zones = self.settings.zone_pairing;
        // A pair due a probe goes first; when another request claimed that
        // probe meanwhile, the pair is as good as open for this one: route
        // again without it (another decode worker's pair may serve). Each
        // lost claim closes one more pair, so this ends.
        let decision = loop {
            // One decode worker's row serves its run of look-ups (the router asks about
            // one decode worker's pairs at a time): one hash per row, not per pair.
            let row_of = std::cell::Cell::new((usize::MAX, None));
            let gate = |d: usize, p: usize| {
                let row = match row_of.get() {
                    (cached, row) if cached == d => row,
                    _ => {
                        let row = gates.row(decode[d].addr);
                        row_of.set((d, row));
                        row
                    }
                };
                row.and_then(|r| r.get(prefill[p].addr)).copied().unwrap_or(Gate::Closed)
            };
            let decision = {
                let mut rng = self.rng.lock().unwrap_or_else(|e| e.into_inner());
                match router::route(&decode, &prefill, gate, prompt_tokens, threshold, zones, &mut rng) {
                    // Configured to: the decode worker prefills while its pairs are all open.
                    Err(NoRoute::PrefillUnavailable(_)) if self.settings.breaker.open_group_prefills_locally => {
                        router::route(&decode, &[], gate, prompt_tokens, threshold, zones, &mut rng)
                    }
                    d => d,
                }
            };
            let decision = decision.map_err(|why| {
                match why {
                    NoRoute::PrefillUnavailable(_) => {
                        metrics::route_refused("prefill_unavailable");
                        metrics::prefill_unavailable();
                    }
                    NoRoute::NoDecode => metrics::route_refused("no_decode"),
                    NoRoute::NoneReady(_) => metrics::route_refused("none_ready"),
                }
                Error::NoRoute { why, breaker_cooldown: self.breakers.config().cooldown }
            })?;
            match decision.prefill.first() {
                Some(&first)
                    if gate(decision.decode, first) == Gate::Probe
                        && !self.breakers.claim_probe(prefill[first].addr, decode[decision.decode].addr) =>
                {
                    let open = Gate::Open(self.breakers.config().cooldown);
                    gates.set(prefill[first].addr, decode[decision.decode].addr, open);
                }
                _ => break decision,
            }
        };
        metrics::route_pairs_skipped("layout_fingerprint", decision.layout_skipped);
        metrics::route_pairs_skipped("zone", decision.zone_skipped);
        if decision.cross_zone {
            metrics::cross_zone_route();
        }
        let chosen = &decode[decision.decode];
        metrics::route_decided(decision.kind);
        let prefiller = decision.prefill.first().map_or(chosen.addr, |&i| prefill[i].addr);
        let cached_tokens = match (&held, query.as_mut()) {
            (Some(m), _) => m.tokens(prefiller),
            (None, Some(q)) => loads.matches(q).tokens(prefiller),
            (None, None) => 0,
        };
        drop(loads);
        Ok(Route {
            cached_tokens,
            decode: chosen.addr.to_owned(),
            decode_id: chosen.id.to_owned(),
            version_group: chosen.version_group.to_owned(),
            determinism: chosen.determinism.to_owned(),
            // A dispatch makes at most `prefill_attempts` remote attempts in all: only
            // that many are ever sent, so only that many are built.
            prefill: decision
                .prefill
                .iter()
                .take(self.settings.prefill_attempts.max(1))
                .map(|&i| PrefillTarget { worker_id: prefill[i].id.to_owned(), grpc_addr: prefill[i].addr.to_owned() })
                .collect(),
        })
    }
}

/// This thread's CPU time so far (`CLOCK_THREAD_CPUTIME_ID`).
fn thread_cpu() -> Option<Duration> {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Some(Duration::new(u64::try_from(t.tv_sec).ok()?, u32::try_from(t.tv_nsec).ok()?))
}
