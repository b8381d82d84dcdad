//! Live worker load, read straight from the workers.
//!
//! etcd carries who exists and their static capacity; how busy a worker is
//! changes every step and would flood etcd with writes, so the coordinator
//! asks each worker itself: a poller calls every known worker's `Health` RPC
//! once per interval and keeps the last answer ([`Load`]). The router reads
//! the board without waiting on the network.
//!
//! How answers age: a worker refusing connections is marked unreachable at
//! once (the router skips it until it answers again). A slow answer (the
//! engine thread is mid-prefill and answers after the step) keeps the last
//! figures; once they are older than [`LoadBoard::max_age`] (4 poll
//! intervals) the worker is *stale* and the router fails closed: it sends
//! it nothing until it answers again. A worker that was never answered is
//! stale once it has been asked for that long. Stale is not unreachable: a
//! frozen process (SIGSTOP, a stuck host) still completes TCP handshakes,
//! so only the missing answers show it, and routing to it would hang each
//! request until its deadline. Workers answer Health from their gRPC
//! runtime without waiting for a long engine step, so a busy worker is
//! never taken for a frozen one.
//!
//! Each worker's cached prefix blocks ([`crate::prefix`]) arrive on a
//! `WatchPrefixes` stream per worker, opened beside its polls: the whole set,
//! then each change as it happens. A worker that does not serve it (an
//! older release) is read from its `Health` answers instead: the poller tells
//! it which epoch of the set it holds, so only a changed set travels. A
//! watch that breaks drops the worker's set at once (it is routed as holding
//! nothing) and is opened again after one poll interval.
//!
//! The same stream carries the worker's load figures (running, waiting, KV
//! blocks) as they change: while it lasts they replace the polls' figures,
//! which are up to a poll interval old (at 250 ms, a router on polled figures
//! alone sent requests to workers that had just filled up, and its prefix hit
//! rate fell 3.2-3.6 points short of an oracle's; pushed, it is within 0.4). The polls
//! still decide whether a worker is alive, ready and fresh: a frozen worker
//! stops both, and only the missing answers mark it stale. A watch that ends
//! drops its figures with its set, and the polls' count again.
//!
//! Must not: block the request path, or let one slow worker delay the
//! polling of the others.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use proto::worker::v1::{HealthRequest, HealthResponse, PrefixReport, PrefixUpdate, WatchedLoad};
use rustc_hash::FxHashMap;
use tokio::time::Instant;

mod worker;
use worker::{connect, watch, Client, Watch};

use crate::prefix::{Index, Matches, Query, Via};

/// Which service a worker's gRPC address speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    Decode,
    Prefill,
}

/// One worker's last answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Load {
    /// Answered and said ready (not fenced, not draining, engine up).
    pub ready: bool,
    /// The last poll reached it; `false` means refused or reset.
    pub reachable: bool,
    pub kv_blocks_total: u32,
    pub kv_blocks_used: u32,
    pub running: u32,
    pub waiting: u32,
    /// When this answer arrived.
    pub at: Instant,
}

impl Load {
    /// From a Health answer received `at`.
    pub fn from_health(h: &HealthResponse, at: Instant) -> Self {
        Self {
            ready: h.live && h.ready,
            reachable: true,
            kv_blocks_total: h.kv_blocks_total,
            kv_blocks_used: h.kv_blocks_used,
            running: h.running,
            waiting: h.waiting,
            at,
        }
    }

    /// Requests on the worker: running plus queued.
    pub fn queue(&self) -> u32 {
        self.running.saturating_add(self.waiting)
    }

    /// Used fraction of the KV pool, 0..=1 (1 when the pool size is unknown).
    pub fn kv_used_fraction(&self) -> f64 {
        if self.kv_blocks_total == 0 {
            return 1.0;
        }
        (f64::from(self.kv_blocks_used) / f64::from(self.kv_blocks_total)).min(1.0)
    }
}

/// The last known load of every polled worker, keyed by gRPC address.
pub struct LoadBoard {
    state: RwLock<Board>,
    interval: Duration,
}

#[derive(Default)]
struct Board {
    /// Each worker's place in `slots`, by gRPC address (a fast hash of our own keys).
    /// A routing decision reads by slot ([`Loads::slot`], [`Loads::get_and_stale_at`]),
    /// hashing no address, while [`Loads::epoch`] holds.
    slot: FxHashMap<String, u32>,
    slots: Vec<Slot>,
    /// Slots of addresses retained away, for the next new address.
    free: Vec<u32>,
    /// Counts slots given to or taken from an address: a slot read under one epoch is
    /// the same address's for as long as the epoch is unchanged.
    epoch: u64,
    /// Every worker's cached prefix blocks.
    prefixes: Index,
}

/// One worker's entry on the board.
#[derive(Clone, Copy, Debug, Default)]
struct Slot {
    load: Option<Load>,
    /// When the poller first asked it, while it has no answer.
    asked: Option<Instant>,
    /// The load figures its watch stream last carried, newer than any poll's.
    pushed: Option<WatchedLoad>,
}

impl Slot {
    /// The polled load with the pushed figures in place of its own (readiness,
    /// reachability and age stay the poll's).
    fn current(&self) -> Option<Load> {
        let l = self.load?;
        Some(match self.pushed {
            Some(p) if l.reachable => Load {
                kv_blocks_total: p.kv_blocks_total,
                kv_blocks_used: p.kv_blocks_used,
                running: p.running,
                waiting: p.waiting,
                ..l
            },
            _ => l,
        })
    }
}

impl Board {
    fn get(&self, addr: &str) -> Option<&Slot> {
        self.slot.get(addr).and_then(|&i| self.slots.get(i as usize))
    }

    /// `addr`'s slot if it has one (none is given: see [`Board::entry`]).
    fn get_mut(&mut self, addr: &str) -> Option<&mut Slot> {
        self.slot.get(addr).and_then(|&i| self.slots.get_mut(i as usize))
    }

    /// `addr`'s slot, given one (a free one first) if it has none.
    fn entry(&mut self, addr: &str) -> &mut Slot {
        let i = match self.slot.get(addr) {
            Some(&i) => i as usize,
            None => {
                let i = self.free.pop().map_or_else(
                    || {
                        self.slots.push(Slot::default());
                        self.slots.len() - 1
                    },
                    |i| i as usize,
                );
                // Fewer workers than 2^32 ever share a board.
                self.slot.insert(addr.to_owned(), i as u32);
                self.epoch += 1;
                i
            }
        };
        &mut self.slots[i]
    }

    /// Frees the slots of addresses `keep` does not name.
    fn retain(&mut self, keep: impl Fn(&str) -> bool) {
        let Board { slot, slots, free, epoch, .. } = self;
        slot.retain(|a, i| {
            let kept = keep(a);
            if !kept {
                if let Some(s) = slots.get_mut(*i as usize) {
                    *s = Slot::default();
                }
                free.push(*i);
                *epoch += 1;
            }
            kept
        });
    }
}

/// The board under its read lock; drop it before any await.
pub struct Loads<'a> {
    board: std::sync::RwLockReadGuard<'a, Board>,
    /// `now - max_age`: an answer from before it is stale (`None`: the clock is younger
    /// than the max age, nothing is). One comparison per worker, not a subtraction.
    fresh_from: Option<Instant>,
}

impl Loads<'_> {
    /// The worker's load if known and fresh (an unreachable mark, until the worker
    /// answers again).
    pub fn get(&self, addr: &str) -> Option<Load> {
        self.get_and_stale(addr).0
    }

    /// Whether an answer at `at` is within the max age (`now - at <= max_age`).
    fn fresh(&self, at: Instant) -> bool {
        self.fresh_from.is_none_or(|from| at >= from)
    }

    /// [`Loads::get`] and [`Loads::stale`] in one look-up (the router asks both of every worker).
    pub fn get_and_stale(&self, addr: &str) -> (Option<Load>, bool) {
        self.judge(self.board.get(addr))
    }

    /// Where `addr` is on the board: read it with [`Loads::get_and_stale_at`] under this
    /// [`Loads::epoch`] (`None`: not on the board, neither answered nor asked).
    pub fn slot(&self, addr: &str) -> Option<u32> {
        self.board.slot.get(addr).copied()
    }

    /// Changes whenever an address gets or loses its slot: slots read under another
    /// epoch may name other workers now.
    pub fn epoch(&self) -> u64 {
        self.board.epoch
    }

    /// [`Loads::get_and_stale`] of the address whose [`Loads::slot`] this is, read under
    /// the same epoch; no hashing.
    pub fn get_and_stale_at(&self, slot: Option<u32>) -> (Option<Load>, bool) {
        self.judge(slot.and_then(|i| self.board.slots.get(i as usize)))
    }

    fn judge(&self, slot: Option<&Slot>) -> (Option<Load>, bool) {
        match slot.map(|s| (s.current(), s.asked)) {
            Some((Some(l), _)) if !l.reachable => (Some(l), false),
            Some((Some(l), _)) => {
                let fresh = self.fresh(l.at);
                (fresh.then_some(l), !fresh)
            }
            Some((None, Some(asked))) => (None, !self.fresh(asked)),
            Some((None, None)) | None => (None, false),
        }
    }

    /// Whether the worker has not answered for longer than the max age:
    /// its last answer (or, never answered, the first question) is older.
    /// Unreachable workers are not stale: they are already unusable.
    pub fn stale(&self, addr: &str) -> bool {
        self.get_and_stale(addr).1
    }

    /// The prefix block size `addr` reported (`None`: no prefix set held from it).
    pub fn block_size(&self, addr: &str) -> Option<usize> {
        self.board.prefixes.block_size(addr)
    }

    /// Which workers hold how much of `query`'s prompt ([`Index::matches`]).
    pub fn matches(&self, query: &mut Query<'_>) -> Matches<'_> {
        self.board.prefixes.matches(query)
    }
}

/// What one poll of one worker found.
enum Polled {
    Answer(Load, Option<(u64, PrefixReport)>),
    Refused(Instant),
    Slow,
}

impl LoadBoard {
    /// An empty board polled every `interval` once [`LoadBoard::spawn`] runs.
    pub fn new(interval: Duration) -> Arc<Self> {
        Arc::new(Self { state: RwLock::new(Board::default()), interval: interval.max(Duration::from_millis(10)) })
    }

    /// Answers older than this count as unknown, and the worker as stale.
    pub fn max_age(&self) -> Duration {
        self.interval * 4
    }

    /// The worker's load if known and fresh.
    pub fn get(&self, addr: &str) -> Option<Load> {
        self.read().get(addr)
    }

    /// A read view for many look-ups under one lock (one routing decision).
    pub fn read(&self) -> Loads<'_> {
        let (now, max_age) = (Instant::now(), self.max_age());
        Loads { board: self.state.read().unwrap_or_else(|e| e.into_inner()), fresh_from: now.checked_sub(max_age) }
    }

    /// Records an answer (the poller's path; also for tests and benches).
    pub fn set(&self, addr: &str, load: Load) {
        let mut b = self.write();
        let s = b.entry(addr);
        (s.load, s.asked) = (Some(load), None);
    }

    /// Records a poll's outcome unless something newer is known: a round's answers are
    /// applied when its slowest poll ends (up to an interval later), and by then a
    /// request may have found the worker gone ([`LoadBoard::mark_unreachable`]); an
    /// answer given before that must not make it routable again.
    fn set_polled(&self, addr: &str, load: Load) {
        let mut b = self.write();
        let s = b.entry(addr);
        if s.load.is_some_and(|l| l.at > load.at) {
            return;
        }
        (s.load, s.asked) = (Some(load), None);
    }

    /// Records that the poller asked `addr` at `at`, if it has no answer yet.
    fn asked(&self, addr: &str, at: Instant) {
        let mut b = self.write();
        let s = b.entry(addr);
        if s.load.is_none() {
            s.asked.get_or_insert(at);
        }
    }

    /// How many of `addrs` are stale now (see [`Loads::stale`]).
    pub fn count_stale<'a>(&self, addrs: impl IntoIterator<Item = &'a str>) -> usize {
        let loads = self.read();
        addrs.into_iter().filter(|a| loads.stale(a)).count()
    }

    /// How many of `addrs` have a fresh load reading (answered a poll within the max age,
    /// and reachable): the workers routing can score on their real load.
    pub fn count_known<'a>(&self, addrs: impl IntoIterator<Item = &'a str>) -> usize {
        let loads = self.read();
        addrs.into_iter().filter(|a| loads.get(a).is_some_and(|l| l.reachable)).count()
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Board> {
        self.state.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Marks a worker unreachable now (a request could not connect); the
    /// next answer from it clears the mark.
    pub fn mark_unreachable(&self, addr: &str) {
        self.set(addr, unreachable(Instant::now()));
    }

    /// Marks a worker that refused work as not ready until its next poll answers.
    pub fn mark_not_ready(&self, addr: &str) {
        let now = Instant::now();
        let load = self.get(addr).map_or_else(|| unreachable(now), |l| Load { ready: false, at: now, ..l });
        self.set(addr, load);
    }

    /// Records a worker's whole prefix set (tests and benches; the poller's paths are
    /// the watch and the Health report).
    pub fn set_prefixes(&self, addr: &str, block_size: usize, hashes: impl IntoIterator<Item = u64>) {
        self.write().prefixes.replace(addr, block_size, hashes, Via::Report(1));
    }

    /// Whether the index holds `hash` for `addr` (tests).
    pub fn holds_prefix(&self, addr: &str, hash: u64) -> bool {
        self.state.read().unwrap_or_else(|e| e.into_inner()).prefixes.holds(addr, hash)
    }

    fn retain(&self, keep: &HashMap<String, Kind>) {
        let mut b = self.write();
        b.retain(|a| keep.contains_key(a));
        b.prefixes.retain(|a| keep.contains_key(a));
    }

    /// Applies one update of `addr`'s watch, its load included; a gap drops its set
    /// (see [`Index::apply`]) and its pushed figures.
    fn apply(&self, addr: &str, u: &PrefixUpdate) -> Result<usize, crate::prefix::Gap> {
        let mut b = self.write();
        let applied = b.prefixes.apply(addr, u);
        // A worker the poller no longer names keeps no slot for a late update to fill.
        if let Some(s) = b.get_mut(addr) {
            match &applied {
                Ok(()) => s.pushed = u.load.or(s.pushed),
                Err(_) => s.pushed = None,
            }
        }
        applied?;
        Ok(b.prefixes.blocks(addr))
    }

    /// Drops `addr`'s set if its watch gave it, and the figures it pushed (a watch
    /// that ended).
    fn unwatch(&self, addr: &str) {
        let mut b = self.write();
        if matches!(b.prefixes.via(addr), Some(Via::Watch(_))) {
            b.prefixes.forget(addr);
        }
        if let Some(s) = b.get_mut(addr) {
            s.pushed = None;
        }
    }

    /// Polls the workers `targets()` names every interval until the board
    /// is dropped by everyone else. Each round asks all workers at once and
    /// waits at most one interval for their answers.
    pub fn spawn<F>(self: &Arc<Self>, targets: F) -> tokio::task::JoinHandle<()>
    where
        F: Fn() -> HashMap<String, Kind> + Send + 'static,
    {
        let board = Arc::downgrade(self);
        let interval = self.interval;
        tokio::spawn(async move {
            let mut clients: HashMap<String, (Kind, Client, Watch)> = HashMap::new();
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(strong) = board.upgrade() else { return };
                let want = targets();
                clients.retain(|a, (k, _, _)| want.get(a) == Some(k));
                for (addr, kind) in &want {
                    if !clients.contains_key(addr) {
                        if let Some(c) = connect(addr, *kind) {
                            let watch = Watch(tokio::spawn(watch(board.clone(), addr.clone(), c.clone(), interval)));
                            clients.insert(addr.clone(), (*kind, c, watch));
                        }
                    }
                }
                let board = strong;
                board.retain(&want);
                let asked = Instant::now();
                for addr in clients.keys() {
                    board.asked(addr, asked);
                }
                // What each worker's set came by: the epoch held from its reports, or a watch.
                let known: HashMap<String, Option<Via>> = {
                    let b = board.state.read().unwrap_or_else(|e| e.into_inner());
                    clients.keys().map(|a| (a.clone(), b.prefixes.via(a))).collect()
                };
                let polls = clients.iter_mut().map(|(addr, (_, client, _))| {
                    let req = match known.get(addr).copied().flatten() {
                        Some(Via::Watch(_)) => HealthRequest { prefix_epoch: 0, prefix_watched: true },
                        Some(Via::Report(epoch)) => HealthRequest { prefix_epoch: epoch, prefix_watched: false },
                        None => HealthRequest::default(),
                    };
                    async move {
                        let polled = match tokio::time::timeout(interval, client.health(req)).await {
                            Err(_) => Polled::Slow,
                            Ok(Ok(mut h)) => {
                                let prefixes = h.prefix.take().map(|r| (h.prefix_epoch, r));
                                Polled::Answer(Load::from_health(&h, Instant::now()), prefixes)
                            }
                            Ok(Err(s)) if s.code() == tonic::Code::Unavailable => Polled::Refused(Instant::now()),
                            // Any other status: it answered, but not as a ready worker.
                            Ok(Err(_)) => Polled::Answer(Load { ready: false, ..unreachable(Instant::now()) }, None),
                        };
                        (addr.clone(), polled)
                    }
                });
                for (addr, polled) in futures_util::future::join_all(polls).await {
                    match polled {
                        Polled::Answer(l, report) => {
                            board.set_polled(&addr, Load { reachable: true, ..l });
                            if let Some((epoch, r)) = report {
                                let mut b = board.write();
                                // A watch that began meanwhile is newer than any report.
                                if !matches!(b.prefixes.via(&addr), Some(Via::Watch(_))) {
                                    crate::metrics::worker_prefix_blocks(&addr, r.hashes.len());
                                    b.prefixes.report(&addr, epoch, &r);
                                }
                            }
                        }
                        Polled::Refused(at) => board.set_polled(&addr, unreachable(at)),
                        Polled::Slow => {}
                    }
                }
            }
        })
    }
}

fn unreachable(at: Instant) -> Load {
    Load { ready: false, reachable: false, kv_blocks_total: 0, kv_blocks_used: 0, running: 0, waiting: 0, at }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto::worker::v1::WatchPrefixesRequest;

    fn load(used: u32, total: u32, running: u32, waiting: u32) -> Load {
        Load {
            ready: true,
            reachable: true,
            kv_blocks_total: total,
            kv_blocks_used: used,
            running,
            waiting,
            at: Instant::now(),
        }
    }

    #[test]
    fn queue_and_kv_fraction() {
        let l = load(30, 120, 3, 2);
        assert_eq!(l.queue(), 5);
        assert!((l.kv_used_fraction() - 0.25).abs() < 1e-9);
        assert_eq!(load(0, 0, 0, 0).kv_used_fraction(), 1.0, "an unknown pool counts as full");
    }

    #[tokio::test(start_paused = true)]
    async fn answers_age_out_but_unreachable_marks_stay() {
        let board = LoadBoard::new(Duration::from_millis(100));
        board.set("a:1", load(0, 10, 1, 0));
        board.set("b:1", unreachable(Instant::now()));
        assert!(board.get("a:1").is_some());
        tokio::time::advance(board.max_age() + Duration::from_millis(1)).await;
        assert_eq!(board.get("a:1"), None, "a stale answer is unknown");
        assert!(board.get("b:1").is_some_and(|l| !l.reachable), "unreachable until it answers again");
    }

    /// A slot read under one epoch names the same worker while the epoch holds; a
    /// worker retained away frees its slot (the epoch moves) and a newcomer may get it.
    #[tokio::test(start_paused = true)]
    async fn slots_name_one_worker_per_epoch() {
        let board = LoadBoard::new(Duration::from_millis(100));
        board.set("a:1", load(0, 10, 1, 0));
        board.set("b:1", load(0, 10, 2, 0));
        let (a, b, epoch) = {
            let loads = board.read();
            (loads.slot("a:1"), loads.slot("b:1"), loads.epoch())
        };
        assert!(a.is_some() && b.is_some() && a != b);
        board.set("a:1", load(0, 10, 3, 0));
        board.asked("a:1", Instant::now());
        {
            let loads = board.read();
            assert_eq!(loads.epoch(), epoch, "a new answer or question of a known worker keeps its slot");
            assert_eq!(loads.get_and_stale_at(a), loads.get_and_stale("a:1"));
            assert_eq!(loads.get_and_stale_at(a).0.map(|l| l.running), Some(3));
            assert_eq!(loads.get_and_stale_at(None), (None, false), "not on the board: unknown, not stale");
        }
        board.retain(&HashMap::from([("b:1".to_owned(), Kind::Decode)]));
        board.set("c:1", load(0, 10, 7, 0));
        let loads = board.read();
        assert_ne!(loads.epoch(), epoch, "a slot freed and given again: another epoch");
        assert_eq!((loads.slot("a:1"), loads.slot("c:1")), (None, a), "the newcomer took the freed slot");
        assert_eq!(loads.get_and_stale_at(a).0.map(|l| l.running), Some(7), "and the slot reads its load");
        assert_eq!(loads.get_and_stale_at(b), loads.get_and_stale("b:1"));
        drop(loads);
        tokio::time::advance(board.max_age() + Duration::from_millis(1)).await;
        let loads = board.read();
        assert_eq!(loads.get_and_stale_at(b), (None, true), "by slot, staleness as by address");
    }

    #[tokio::test(start_paused = true)]
    async fn a_worker_silent_for_the_max_age_is_stale_until_it_answers() {
        let board = LoadBoard::new(Duration::from_millis(100));
        board.set("a:1", load(0, 10, 1, 0));
        board.asked("new:1", Instant::now());
        board.set("gone:1", unreachable(Instant::now()));
        let all = ["a:1", "new:1", "gone:1", "unpolled:1"];
        tokio::time::advance(board.max_age()).await;
        assert_eq!(board.count_stale(all), 0, "at the max age nothing is stale yet");
        tokio::time::advance(Duration::from_millis(1)).await;
        let loads = board.read();
        assert!(loads.stale("a:1"), "no answer for 4 intervals");
        assert!(loads.stale("new:1"), "asked 4 intervals ago, never answered");
        assert!(!loads.stale("gone:1"), "unreachable is its own state");
        assert!(!loads.stale("unpolled:1"), "never asked: not stale");
        for a in all {
            assert_eq!(loads.get_and_stale(a), (loads.get(a), loads.stale(a)), "{a}: one look-up, the same answers");
        }
        drop(loads);
        assert_eq!(board.count_stale(all), 2);
        // Asking again does not reset the clock of a worker that never answered.
        board.asked("new:1", Instant::now());
        assert!(board.read().stale("new:1"));
        board.set("a:1", load(0, 10, 1, 0));
        board.set("new:1", load(0, 10, 0, 0));
        assert_eq!(board.count_stale(all), 0, "an answer makes it fresh again");
    }

    /// A round's answers are applied when its slowest poll ends: one given before a
    /// request found the worker gone must not make it routable again; a later one does.
    #[tokio::test(start_paused = true)]
    async fn an_answer_older_than_a_marked_failure_does_not_revive_the_worker() {
        let board = LoadBoard::new(Duration::from_millis(100));
        let answered = Instant::now();
        board.set_polled("a:1", Load { at: answered, ..load(0, 10, 1, 0) });
        tokio::time::advance(Duration::from_millis(5)).await;
        board.mark_unreachable("a:1");
        board.set_polled("a:1", Load { at: answered, ..load(0, 10, 1, 0) });
        assert!(board.get("a:1").is_some_and(|l| !l.reachable), "the older answer is dropped");
        tokio::time::advance(Duration::from_millis(5)).await;
        board.set_polled("a:1", load(0, 10, 1, 0));
        assert!(board.get("a:1").is_some_and(|l| l.reachable && l.ready), "a newer answer counts");
    }

    #[tokio::test]
    async fn a_refused_worker_is_marked_unreachable() {
        // A port nobody listens on: bind, take the port, drop the listener.
        let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port());
        let addr = format!("127.0.0.1:{}", port.expect("a free port"));
        let board = LoadBoard::new(Duration::from_millis(50));
        let target = addr.clone();
        let task = board.spawn(move || HashMap::from([(target.clone(), Kind::Decode)]));
        let deadline = Instant::now() + Duration::from_secs(10);
        while board.get(&addr).is_none() {
            assert!(Instant::now() < deadline, "the poller never recorded the refused worker");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let l = board.get(&addr).expect("recorded");
        assert!(!l.reachable && !l.ready);
        task.abort();
    }

    /// A decode worker whose watch streams the test writes: each `WatchPrefixes` call
    /// takes the next receiver (none left: refused). Health answers ready, and records
    /// what it was asked.
    struct Watched {
        streams: std::sync::Mutex<Vec<tokio::sync::mpsc::Receiver<Result<PrefixUpdate, tonic::Status>>>>,
        asked: Arc<std::sync::Mutex<Vec<HealthRequest>>>,
    }

    #[tonic::async_trait]
    impl proto::worker::v1::decode_worker_server::DecodeWorker for Watched {
        type GenerateStream = tokio_stream::Empty<Result<proto::worker::v1::GenerateResponse, tonic::Status>>;
        type WatchPrefixesStream = tokio_stream::wrappers::ReceiverStream<Result<PrefixUpdate, tonic::Status>>;

        async fn generate(
            &self,
            _: tonic::Request<proto::worker::v1::GenerateRequest>,
        ) -> Result<tonic::Response<Self::GenerateStream>, tonic::Status> {
            Err(tonic::Status::unimplemented("not here"))
        }

        async fn abort(
            &self,
            _: tonic::Request<proto::worker::v1::AbortRequest>,
        ) -> Result<tonic::Response<proto::worker::v1::AbortResponse>, tonic::Status> {
            Err(tonic::Status::unimplemented("not here"))
        }

        async fn health(
            &self,
            r: tonic::Request<HealthRequest>,
        ) -> Result<tonic::Response<HealthResponse>, tonic::Status> {
            self.asked.lock().unwrap_or_else(|e| e.into_inner()).push(r.into_inner());
            Ok(tonic::Response::new(HealthResponse { live: true, ready: true, ..HealthResponse::default() }))
        }

        async fn watch_prefixes(
            &self,
            _: tonic::Request<WatchPrefixesRequest>,
        ) -> Result<tonic::Response<Self::WatchPrefixesStream>, tonic::Status> {
            let mut s = self.streams.lock().unwrap_or_else(|e| e.into_inner());
            if s.is_empty() {
                return Err(tonic::Status::unavailable("no more streams"));
            }
            Ok(tonic::Response::new(tokio_stream::wrappers::ReceiverStream::new(s.remove(0))))
        }
    }

    async fn until(what: &str, cond: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !cond() {
            assert!(Instant::now() < deadline, "never: {what}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// The fake's Health answers carry no figures (all zero): any the board shows came
    /// from the watch.
    #[tokio::test]
    async fn a_watch_applies_changes_drops_the_set_on_a_gap_or_an_end_and_opens_again() {
        let update = |seq, snapshot, added: Vec<u64>, removed: Vec<u64>| {
            Ok(PrefixUpdate { seq, block_size: 16, snapshot, added, removed, load: None })
        };
        let pushed =
            |running, waiting, used| WatchedLoad { running, waiting, kv_blocks_used: used, kv_blocks_total: 64 };
        let with_load =
            |u: Result<PrefixUpdate, tonic::Status>, l: WatchedLoad| u.map(|u| PrefixUpdate { load: Some(l), ..u });
        let (first, r1) = tokio::sync::mpsc::channel(8);
        let (second, r2) = tokio::sync::mpsc::channel(8);
        let asked = Arc::new(std::sync::Mutex::new(Vec::new()));
        let fake = Watched { streams: std::sync::Mutex::new(vec![r1, r2]), asked: asked.clone() };
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = l.local_addr().expect("addr").to_string();
        let server = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(proto::worker::v1::decode_worker_server::DecodeWorkerServer::new(fake))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(l)),
        );
        let board = LoadBoard::new(Duration::from_millis(20));
        let target = addr.clone();
        let poller = board.spawn(move || HashMap::from([(target.clone(), Kind::Decode)]));
        let holds = |h| board.holds_prefix(&addr, h);

        let figures = || board.get(&addr).map(|l| (l.running, l.waiting, l.kv_blocks_used, l.kv_blocks_total));
        until("a first poll answered", || figures().is_some()).await;
        first.send(with_load(update(1, true, vec![1, 2], vec![]), pushed(3, 1, 20))).await.expect("open");
        first.send(update(2, false, vec![3], vec![1])).await.expect("open");
        until("the snapshot and the change applied", || holds(3) && holds(2) && !holds(1)).await;
        let via = board.state.read().unwrap_or_else(|e| e.into_inner()).prefixes.via(&addr);
        assert_eq!(via, Some(Via::Watch(2)));
        assert_eq!(figures(), Some((3, 1, 20, 64)), "the snapshot's load, over the polls' zeros");
        first.send(with_load(update(3, false, vec![], vec![]), pushed(4, 0, 30))).await.expect("open");
        until("a load alone applied", || figures() == Some((4, 0, 30, 64))).await;
        assert!(board.get(&addr).is_some_and(|l| l.ready && l.reachable), "readiness is the polls'");
        assert!(holds(3) && holds(2), "a load alone leaves the set as it was");
        until("a poll saying the set is watched", || {
            asked.lock().unwrap_or_else(|e| e.into_inner()).iter().any(|r| r.prefix_watched)
        })
        .await;

        // Update 5 after 3: the set goes at once, before any new stream says anything, and
        // the figures are the polls' again.
        first.send(with_load(update(5, false, vec![4], vec![]), pushed(9, 9, 9))).await.expect("open");
        until("the set dropped on the gap", || !holds(2) && !holds(3)).await;
        assert!(!holds(4), "nothing of the out-of-sequence update was applied");
        assert_eq!(figures(), Some((0, 0, 0, 0)), "nor its load");
        second.send(with_load(update(1, true, vec![7], vec![]), pushed(2, 0, 8))).await.expect("opened again");
        until("the new stream's snapshot", || holds(7) && figures() == Some((2, 0, 8, 64))).await;

        // The worker ends the stream: its set goes, and is not brought back by the reopening
        // (the fake refuses it) nor by the Health answers (which carry no report).
        drop(second);
        until("the set dropped at the stream's end", || !holds(7)).await;
        assert_eq!(board.read().block_size(&addr), None);
        assert_eq!(figures(), Some((0, 0, 0, 0)), "the ended stream's figures went with it");
        poller.abort();
        server.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_worker_that_refused_work_is_not_ready_until_it_answers() {
        let board = LoadBoard::new(Duration::from_millis(100));
        board.set("a:1", load(2, 10, 1, 0));
        board.mark_not_ready("a:1");
        let l = board.get("a:1").expect("still known");
        assert!(!l.ready && l.reachable, "{l:?}");
        assert_eq!((l.kv_blocks_used, l.running), (2, 1), "its load is kept");
        // Never polled: not ready rather than unknown (which the router would take as ready).
        board.mark_not_ready("b:1");
        assert!(board.get("b:1").is_some_and(|l| !l.ready));
        board.set("a:1", load(0, 10, 0, 0));
        assert!(board.get("a:1").is_some_and(|l| l.ready), "the next answer clears the mark");
    }
}
