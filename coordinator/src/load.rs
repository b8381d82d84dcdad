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
//! Each answer may carry the worker's cached prefix blocks
//! ([`crate::prefix`]); the poller tells the worker which epoch of that set
//! it holds, so only a changed set travels.
//!
//! Must not: block the request path, or let one slow worker delay the
//! polling of the others.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use proto::worker::v1::decode_worker_client::DecodeWorkerClient;
use proto::worker::v1::prefill_worker_client::PrefillWorkerClient;
use proto::worker::v1::{HealthRequest, HealthResponse};
use tokio::time::Instant;
use tonic::transport::{Channel, Endpoint};

use crate::prefix::Prefixes;

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

enum Client {
    Decode(DecodeWorkerClient<Channel>),
    Prefill(PrefillWorkerClient<Channel>),
}

impl Client {
    async fn health(&mut self, prefix_epoch: u64) -> Result<HealthResponse, tonic::Status> {
        let req = HealthRequest { prefix_epoch };
        let r = match self {
            Client::Decode(c) => c.health(req).await,
            Client::Prefill(c) => c.health(req).await,
        };
        r.map(tonic::Response::into_inner)
    }
}

/// The last known load of every polled worker, keyed by gRPC address.
pub struct LoadBoard {
    state: RwLock<Board>,
    interval: Duration,
}

#[derive(Default)]
struct Board {
    loads: HashMap<String, Load>,
    /// When the poller first asked a worker it has no answer from.
    asked: HashMap<String, Instant>,
    /// Each worker's last reported prefix blocks.
    prefixes: HashMap<String, Arc<Prefixes>>,
}

/// The board under its read lock; drop it before any await.
pub struct Loads<'a> {
    board: std::sync::RwLockReadGuard<'a, Board>,
    now: Instant,
    max_age: Duration,
}

impl Loads<'_> {
    /// The worker's load if known and fresh.
    pub fn get(&self, addr: &str) -> Option<Load> {
        let l = *self.board.loads.get(addr)?;
        // An unreachable mark stays until the worker answers again.
        (!l.reachable || self.now.saturating_duration_since(l.at) <= self.max_age).then_some(l)
    }

    /// Whether the worker has not answered for longer than the max age:
    /// its last answer (or, never answered, the first question) is older.
    /// Unreachable workers are not stale: they are already unusable.
    pub fn stale(&self, addr: &str) -> bool {
        let since = match self.board.loads.get(addr) {
            Some(l) if !l.reachable => return false,
            Some(l) => l.at,
            None => match self.board.asked.get(addr) {
                Some(&t) => t,
                None => return false,
            },
        };
        self.now.saturating_duration_since(since) > self.max_age
    }

    /// The worker's last reported prefix blocks.
    pub fn prefixes(&self, addr: &str) -> Option<&Prefixes> {
        self.board.prefixes.get(addr).map(|p| &**p)
    }
}

/// What one poll of one worker found.
enum Polled {
    Answer(Load, Option<Prefixes>),
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
        Loads {
            board: self.state.read().unwrap_or_else(|e| e.into_inner()),
            now: Instant::now(),
            max_age: self.max_age(),
        }
    }

    /// Records an answer (the poller's path; also for tests and benches).
    pub fn set(&self, addr: &str, load: Load) {
        let mut b = self.write();
        b.asked.remove(addr);
        b.loads.insert(addr.to_owned(), load);
    }

    /// Records that the poller asked `addr` at `at`, if it has no answer yet.
    fn asked(&self, addr: &str, at: Instant) {
        let mut b = self.write();
        if !b.loads.contains_key(addr) {
            b.asked.entry(addr.to_owned()).or_insert(at);
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

    /// Records a worker's prefix blocks (the poller's path; also for tests and benches).
    pub fn set_prefixes(&self, addr: &str, p: Prefixes) {
        self.write().prefixes.insert(addr.to_owned(), Arc::new(p));
    }

    fn retain(&self, keep: &HashMap<String, Kind>) {
        let mut b = self.write();
        b.loads.retain(|a, _| keep.contains_key(a));
        b.asked.retain(|a, _| keep.contains_key(a));
        b.prefixes.retain(|a, _| keep.contains_key(a));
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
            let mut clients: HashMap<String, (Kind, Client)> = HashMap::new();
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(board) = board.upgrade() else { return };
                let want = targets();
                clients.retain(|a, (k, _)| want.get(a) == Some(k));
                for (addr, kind) in &want {
                    if !clients.contains_key(addr) {
                        if let Some(c) = connect(addr, *kind) {
                            clients.insert(addr.clone(), (*kind, c));
                        }
                    }
                }
                board.retain(&want);
                let asked = Instant::now();
                for addr in clients.keys() {
                    board.asked(addr, asked);
                }
                let known: HashMap<String, u64> = {
                    let b = board.state.read().unwrap_or_else(|e| e.into_inner());
                    b.prefixes.iter().map(|(a, p)| (a.clone(), p.epoch)).collect()
                };
                let polls = clients.iter_mut().map(|(addr, (_, client))| {
                    let epoch = known.get(addr).copied().unwrap_or(0);
                    async move {
                        let polled = match tokio::time::timeout(interval, client.health(epoch)).await {
                            Err(_) => Polled::Slow,
                            Ok(Ok(h)) => {
                                let prefixes = h.prefix.as_ref().map(|r| Prefixes::from_report(h.prefix_epoch, r));
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
                        Polled::Answer(l, prefixes) => {
                            board.set(&addr, Load { reachable: true, ..l });
                            if let Some(p) = prefixes {
                                crate::metrics::worker_prefix_blocks(&addr, p.hashes.len());
                                board.set_prefixes(&addr, p);
                            }
                        }
                        Polled::Refused(at) => board.set(&addr, unreachable(at)),
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

fn connect(addr: &str, kind: Kind) -> Option<Client> {
    let ep =
        Endpoint::from_shared(format!("http://{addr}")).ok()?.connect_timeout(Duration::from_secs(1)).tcp_nodelay(true);
    let ch = ep.connect_lazy();
    Some(match kind {
        Kind::Decode => Client::Decode(DecodeWorkerClient::new(ch)),
        Kind::Prefill => Client::Prefill(PrefillWorkerClient::new(ch)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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
        drop(loads);
        assert_eq!(board.count_stale(all), 2);
        // Asking again does not reset the clock of a worker that never answered.
        board.asked("new:1", Instant::now());
        assert!(board.read().stale("new:1"));
        board.set("a:1", load(0, 10, 1, 0));
        board.set("new:1", load(0, 10, 0, 0));
        assert_eq!(board.count_stale(all), 0, "an answer makes it fresh again");
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
