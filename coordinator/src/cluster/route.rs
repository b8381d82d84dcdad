//! One routing decision ([`Route`]): the decode worker with the most headroom (or,
//! for a continuation, one its pin allows) and the prefill workers of its version
//! group, read from the membership cache, the load board, the prefix reports and the
//! circuit breakers, with no I/O.

use super::*;
use smallvec::SmallVec;

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
        self.route_prompt(prompt_tokens, None, None, &[])
    }

    /// [`Cluster::route`] with prefix affinity: each worker's reported
    /// prefix blocks are matched against `tokens` under `salt`
    /// ([`crate::prefix`]).
    pub fn route_for(&self, tokens: &[u32], salt: u64) -> Result<Route, Error> {
        self.route_prompt(tokens.len(), Some(Query::new(tokens, salt)), None, &[])
    }

    /// [`Cluster::route_for`] for a dispatch's attempt: only decode workers `pin` allows
    /// (a continuation's), and none in `avoid` (those whose stream broke earlier in this
    /// dispatch) while another can serve.
    pub(super) fn route_pinned(
        &self,
        tokens: &[u32],
        salt: u64,
        pin: Option<&Pin>,
        avoid: &[String],
    ) -> Result<Route, Error> {
        self.route_prompt(tokens.len(), Some(Query::new(tokens, salt)), pin, avoid)
    }

    /// One routing decision, timed in wall and thread CPU time
    /// (`tandem_coordinator_route_decision_seconds`, `..._cpu_seconds`). The wall clock
    /// runs inside the two CPU-clock reads: each is a system call, on whose return the
    /// kernel switches a thread out whose time slice is up, and on a busy core that
    /// switch (milliseconds) had been most of the wall time's p99.
    fn route_prompt(
        &self,
        prompt_tokens: usize,
        query: Option<Query<'_>>,
        pin: Option<&Pin>,
        avoid: &[String],
    ) -> Result<Route, Error> {
        let cpu = thread_cpu();
        let started = tokio::time::Instant::now();
        let route = self.decide(prompt_tokens, query, pin, avoid);
        let took = started.elapsed();
        let spent = thread_cpu().zip(cpu).map(|(now, then)| now.saturating_sub(then));
        metrics::route_decision(took, spent);
        route
    }

    fn decide(
        &self,
        prompt_tokens: usize,
        mut query: Option<Query<'_>>,
        pin: Option<&Pin>,
        avoid: &[String],
    ) -> Result<Route, Error> {
        let affinity = self.settings.prefix_affinity;
        // Read for the whole decision (no await in it): the answer's cached tokens come
        // from the same walk of the prefix index as the candidates' bonuses.
        let loads = self.board.read();
        // Who holds the prompt's start: one walk down its chain, whatever the fleet's size.
        let held = match query.as_mut() {
            Some(q) if affinity > 0.0 => Some(loads.matches(q)),
            _ => None,
        };
        // The workers to list, as one table kept while the membership and the board's
        // slots stay the same ([`listing`]).
        let table = {
            let mut listing = self.listing.lock().unwrap_or_else(|e| e.into_inner());
            match &self.source {
                Source::Static { decode, prefill } => {
                    let entries = decode.iter().map(|a| (a, true)).chain(prefill.iter().map(|a| (a, false)));
                    listing.table((0, loads.epoch()), || {
                        let entries = entries.map(|(a, decode)| listing::Entry {
                            id: a,
                            addr: a,
                            version_group: STATIC_GROUP,
                            layout: "",
                            determinism: "",
                            zone: "",
                            decode,
                            max_running: 0,
                            until: None,
                        });
                        listing::Table::build(entries, |a| loads.slot(a))
                    })
                }
                Source::Etcd { membership, max_stale } => {
                    if registry_expired(membership, *max_stale) {
                        metrics::route_refused("registry_unavailable");
                        return Err(Error::RegistryUnavailable);
                    }
                    let view = membership.view();
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
                    listing.table((view.revision(), loads.epoch()), || {
                        // The routable workers: the registered ones, then the departed ones
                        // with when their grace ends (judged per decision).
                        let listed = view
                            .workers()
                            .map(|w| (w, None))
                            .chain(view.departed_until().map(|(w, until)| (w, Some(until))))
                            .filter(|(w, _)| !w.draining);
                        let entries = listed.map(|(w, until)| listing::Entry {
                            id: &w.id,
                            addr: &w.grpc_addr,
                            version_group: &w.version_group,
                            layout: &w.layout_fingerprint,
                            determinism: &w.determinism_fingerprint,
                            zone: &w.zone,
                            decode: w.role == registry::Role::Decode,
                            max_running: w.capacity.max_running,
                            until,
                        });
                        listing::Table::build(entries, |a| loads.slot(a))
                    })
                }
            }
        };
        // The prompt's holders (a few workers) by their place in the table, in table order,
        // read in step with the walk below: no per-decision array of the fleet's size (an
        // allocation that size cost a fifth of a decision in malloc's consolidation).
        let mut holders: Vec<(u32, f64)> = match (&held, &query) {
            (Some(m), Some(q)) => m
                .iter()
                .flat_map(|(addr, tokens)| {
                    let bonus = affinity * q.fraction(tokens);
                    table.by_addr.get(addr).into_iter().flatten().map(move |&i| (i, bonus))
                })
                .collect(),
            _ => Vec::new(),
        };
        holders.sort_unstable_by_key(|&(i, _)| i);
        // A continuation runs only where `pin` allows: not on a worker it lost, and in the
        // group and determinism class of the worker that generated its tokens.
        // A worker whose stream broke earlier in this dispatch is avoided while another
        // can serve: the load board may not show its death yet (a poll answered just
        // before it died, applied just after the break was marked), and a second try
        // there was the dispatch's last (seen once in CI as a 503 to a client whose
        // decode worker was SIGKILLed). It stays a last resort: a reset connection to a
        // live worker, the only one of its group, must still be retried there.
        let avoiding = std::cell::Cell::new(!avoid.is_empty());
        let allowed = |addr: &str, group: &str, determinism: &str| match pin {
            _ if avoiding.get() && avoid.iter().any(|a| a == addr) => false,
            None => true,
            Some(p) => {
                !p.exclude.iter().any(|x| x == addr)
                    && group == p.version_group
                    && (p.determinism.is_empty() || determinism == p.determinism)
            }
        };
        let now = tokio::time::Instant::now();
        // The candidates among the table's members `pick` names (in table order), or all.
        let list = |pick: Option<&[u32]>| {
            let clients = self.decode.lock().unwrap_or_else(|e| e.into_inner());
            // A sample's candidates on the stack: lists of a few KB from the heap cost a
            // sixth of a sampled decision in malloc's consolidation of the polls' frees.
            let (mut decode, mut prefill): (Candidates<DecodeCandidate<'_>>, Candidates<PrefillCandidate<'_>>) =
                match pick {
                    Some(_) => (SmallVec::new(), SmallVec::new()),
                    None => (SmallVec::with_capacity(table.decode()), SmallVec::with_capacity(table.prefill())),
                };
            let mut held = holders.iter().peekable();
            let mut add = |i: u32| {
                let Some(m) = table.members.get(i as usize) else { return };
                while held.next_if(|&&(h, _)| h < i).is_some() {}
                let prefix_bonus = held.next_if(|&&(h, _)| h == i).map_or(0.0, |&(_, b)| b);
                if !m.present(now) {
                    return;
                }
                let (load, stale) = loads.get_and_stale_at(m.slot);
                if m.decode {
                    if !allowed(&m.addr, &m.version_group, &m.determinism) {
                        return;
                    }
                    decode.push(DecodeCandidate {
                        id: &m.id,
                        addr: &m.addr,
                        version_group: &m.version_group,
                        layout: &m.layout,
                        determinism: &m.determinism,
                        zone: &m.zone,
                        load,
                        stale,
                        inflight: clients.get(&*m.addr).map_or(0, |c| c.inflight.load(Ordering::Relaxed)),
                        max_running: m.max_running,
                        prefix_bonus,
                    });
                } else {
                    prefill.push(PrefillCandidate {
                        id: &m.id,
                        addr: &m.addr,
                        version_group: &m.version_group,
                        layout: &m.layout,
                        zone: &m.zone,
                        load,
                        stale,
                        prefix_bonus,
                    });
                }
            };
            match pick {
                Some(p) => p.iter().for_each(|&i| add(i)),
                None => (0..u32::try_from(table.members.len()).unwrap_or(u32::MAX)).for_each(add),
            }
            (decode, prefill)
        };
        // A large fleet is sampled first ([`listing::Table::sample`]); a sample that leaves
        // the decision short of what listing everyone would give falls back to that.
        let sampled = {
            let mut rng = self.rng.lock().unwrap_or_else(|e| e.into_inner());
            table.sample(&holders, &mut rng)
        };
        let (mut decode, mut prefill) = list(sampled.as_deref());
        let decided = match sampled {
            Some(_) => self.choose(&decode, &prefill, prompt_tokens, true),
            None => None,
        };
        metrics::route_listed(if decided.is_some() { "sampled" } else { "all" });
        let decision = match decided {
            Some(d) => d,
            None => {
                if sampled.is_some() {
                    (decode, prefill) = list(None);
                }
                // Not a sample: `choose` always answers.
                let all = |d: &[DecodeCandidate<'_>], p: &[PrefillCandidate<'_>]| {
                    self.choose(d, p, prompt_tokens, false).unwrap_or(Err(NoRoute::NoDecode))
                };
                match all(&decode, &prefill) {
                    // Nothing but the avoided workers can serve: try them too.
                    Err(_) if avoiding.get() => {
                        avoiding.set(false);
                        (decode, prefill) = list(None);
                        all(&decode, &prefill)
                    }
                    d => d,
                }
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

impl Cluster {
    /// The router's decision among these candidates, a pair due a probe claimed.
    /// `sampled`: `None` when the candidates are a sample whose answer listing every
    /// worker might better (an error, or fewer prefill workers than a dispatch may
    /// try): no probe is claimed then.
    fn choose(
        &self,
        decode: &[DecodeCandidate<'_>],
        prefill: &[PrefillCandidate<'_>],
        prompt_tokens: usize,
        sampled: bool,
    ) -> Option<Result<router::Decision, NoRoute>> {
        let threshold = self.settings.local_prefill_max_tokens;
        let zones = self.settings.zone_pairing;
        let mut gates =
            if prompt_tokens > threshold && !prefill.is_empty() { self.breakers.gates() } else { Gates::default() };
        // A pair due a probe goes first; when another request claimed that
        // probe meanwhile, the pair is as good as open for this one: route
        // again without it (another decode worker's pair may serve). Each
        // lost claim closes one more pair, so this ends.
        loop {
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
                match router::route(decode, prefill, gate, prompt_tokens, threshold, zones, &mut rng) {
                    // Configured to: the decode worker prefills while its pairs are all open.
                    Err(NoRoute::PrefillUnavailable(_)) if self.settings.breaker.open_group_prefills_locally => {
                        router::route(decode, &[], gate, prompt_tokens, threshold, zones, &mut rng)
                    }
                    d => d,
                }
            };
            let enough = |d: &router::Decision| {
                prompt_tokens <= threshold || d.prefill.len() >= self.settings.prefill_attempts.max(1)
            };
            let decision = match decision {
                Ok(d) if sampled && !enough(&d) => return None,
                Err(_) if sampled => return None,
                Err(why) => return Some(Err(why)),
                Ok(d) => d,
            };
            match decision.prefill.first() {
                Some(&first)
                    if gate(decision.decode, first) == Gate::Probe
                        && !self.breakers.claim_probe(prefill[first].addr, decode[decision.decode].addr) =>
                {
                    let open = Gate::Open(self.breakers.config().cooldown);
                    gates.set(prefill[first].addr, decode[decision.decode].addr, open);
                }
                _ => return Some(Ok(decision)),
            }
        }
    }
}

/// One decision's candidates of a role: a sample's fit inline.
type Candidates<T> = SmallVec<[T; listing::SAMPLE + 8]>;

/// This thread's CPU time so far (`CLOCK_THREAD_CPUTIME_ID`).
fn thread_cpu() -> Option<Duration> {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Some(Duration::new(u64::try_from(t.tv_sec).ok()?, u32::try_from(t.tv_nsec).ok()?))
}
