//! The runner's counters for the `Health` RPC, without waiting out a long
//! engine step.
//!
//! The runner thread answers a stats question between steps, and one step
//! (a 512-token prefill chunk on one CPU thread) can take seconds. The
//! coordinator takes a worker whose Health goes unanswered for 4 poll
//! intervals as frozen and routes nothing to it, so Health must not wait
//! for the step: it waits [`STATS_WAIT`], then answers the last snapshot
//! (the question stays asked; its answer becomes the next snapshot). A
//! frozen process answers nothing at all, which is what the coordinator
//! needs to see. A runner that has given no snapshot for [`STUCK_AFTER`]
//! is reported not ready rather than reported with figures that old.
//!
//! One question at a time: while one is out, Health waits (the same
//! [`STATS_WAIT`]) for its answer instead of asking again, so polls during
//! a long step do not pile up blocked threads all waiting on one runner.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use engine::runner::MAX_PREFIX_REPORT;
use engine::runner::{RunnerHandle, RunnerStats};
use kvtransfer::Peer;
use proto::worker::v1::{HealthRequest, HealthResponse, PrefixReport, WatchedLoad, WorkerError};
use tokio::sync::Notify;
// The snapshot's age is a timeout: on tokio's clock, like every other.
use tokio::time::Instant;

use crate::prefix_feed::{self, Feed};
use crate::serve::blocking;

/// How long Health waits for the runner before answering the last snapshot.
pub const STATS_WAIT: Duration = Duration::from_millis(50);
/// A snapshot older than this means the runner is stuck: not ready.
pub const STUCK_AFTER: Duration = Duration::from_secs(30);
/// How often the runner's published prefix epoch is checked while anyone watches the
/// set (an atomic load; the runner is asked for its set only when the epoch moved): a
/// block cached is sent to the coordinators at most this much (and one engine step) later.
pub const WATCH_TICK: Duration = Duration::from_millis(10);

/// The runner's last counters and when they were read.
#[derive(Clone, Default)]
pub struct StatsCache {
    last: Arc<Mutex<Option<(RunnerStats, Instant)>>>,
    /// A question is out to the runner; its answer becomes `last`.
    asking: Arc<AtomicBool>,
    /// Wakes those waiting for the question out.
    answered: Arc<Notify>,
    /// The cached prefix blocks as every read found them, for `WatchPrefixes`.
    feed: Feed,
    /// A task reads the runner every [`WATCH_TICK`] while anyone watches the feed.
    ticking: Arc<AtomicBool>,
}

/// Clears [`StatsCache::asking`] and wakes its waiters when the question
/// is answered (or its task ends otherwise).
struct Asked(Arc<AtomicBool>, Arc<Notify>);

impl Drop for Asked {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
        self.1.notify_waiters();
    }
}

impl StatsCache {
    /// The runner's counters now, or the last snapshot when the runner is
    /// mid-step; `None` once the runner thread has exited or is stuck.
    pub async fn read(&self, runner: &RunnerHandle) -> Result<Option<RunnerStats>, WorkerError> {
        // Made before the check, so an answer between the two still wakes it.
        let answered = self.answered.notified();
        if self.asking.swap(true, Ordering::SeqCst) {
            let _ = tokio::time::timeout(STATS_WAIT, answered).await;
            return Ok(self.snapshot(STUCK_AFTER));
        }
        let asked = Asked(self.asking.clone(), self.answered.clone());
        let (runner, last, feed) = (runner.clone(), self.last.clone(), self.feed.clone());
        let ask = blocking(move || {
            let _asked = asked;
            let s = runner.stats();
            if let Some(s) = &s {
                feed.observe(s.prefix_epoch, &s.prefixes);
            }
            let mut l = last.lock().unwrap_or_else(|e| e.into_inner());
            *l = s.clone().map(|s| (s, Instant::now()));
            s
        });
        match tokio::time::timeout(STATS_WAIT, ask).await {
            Ok(r) => r,
            Err(_) => Ok(self.snapshot(STUCK_AFTER)),
        }
    }

    /// One `WatchPrefixes` stream (see [`crate::prefix_feed`]): the runner is read every
    /// [`WATCH_TICK`] while anyone watches, besides each Health poll's read; the load it
    /// carries counts `extra_waiting()` in its waiting, as [`answer`] does.
    pub fn watch(&self, runner: &RunnerHandle, extra_waiting: ExtraWaiting) -> prefix_feed::Updates {
        // The snapshot carries the load of now, not of the last tick of an earlier watcher.
        observe_load(&self.feed, runner, &extra_waiting);
        let updates = self.feed.watch(runner.block_size() as u32);
        self.tick(runner, extra_waiting);
        updates
    }

    /// Ends every `WatchPrefixes` stream and refuses new ones: called when the worker
    /// starts draining, so its gRPC server's graceful shutdown does not wait on them.
    pub fn close_watches(&self) {
        self.feed.close();
    }

    /// Starts the ticker unless it runs. It stops when the last watcher has gone, and
    /// goes on when one came meanwhile (its `tick` may have found it still running).
    fn tick(&self, runner: &RunnerHandle, extra_waiting: ExtraWaiting) {
        if self.ticking.swap(true, Ordering::SeqCst) {
            return;
        }
        let (cache, runner) = (self.clone(), runner.clone());
        tokio::spawn(async move {
            let mut every = tokio::time::interval(WATCH_TICK);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            // The epoch last read: the runner is asked only when its published one moved.
            let mut read = None;
            loop {
                every.tick().await;
                if cache.feed.watchers() == 0 {
                    cache.ticking.store(false, Ordering::SeqCst);
                    if cache.feed.watchers() == 0 || cache.ticking.swap(true, Ordering::SeqCst) {
                        return;
                    }
                }
                observe_load(&cache.feed, &runner, &extra_waiting);
                let epoch = runner.prefix_epoch();
                if read != Some(epoch) {
                    // A stuck or exited runner: the watchers keep what they hold, Health
                    // says not ready; the next tick asks again.
                    if let Ok(Some(s)) = cache.read(&runner).await {
                        read = Some(s.prefix_epoch);
                    }
                }
            }
        });
    }

    /// The last snapshot if it is at most `max_age` old.
    fn snapshot(&self, max_age: Duration) -> Option<RunnerStats> {
        let l = self.last.lock().unwrap_or_else(|e| e.into_inner());
        l.as_ref().filter(|(_, at)| at.elapsed() <= max_age).map(|(s, _)| s.clone())
    }
}

/// Requests a worker counts as waiting beside its runner's (the decode worker's that
/// wait for remote KV), read when its load is sent to watchers.
pub type ExtraWaiting = Arc<dyn Fn() -> u32 + Send + Sync>;

/// The runner's published load, for the feed's watchers (no message to the runner).
fn observe_load(feed: &Feed, runner: &RunnerHandle, extra_waiting: &ExtraWaiting) {
    feed.observe_load(|| {
        let l = runner.load_now();
        WatchedLoad {
            running: l.running,
            waiting: l.waiting.saturating_add(extra_waiting()),
            kv_blocks_used: l.kv_used,
            kv_blocks_total: runner.kv_blocks() as u32,
        }
    });
}

/// The `Health` answer both workers give: live; ready when the worker says
/// so (`ready`: started, not fenced, not draining as it defines them) and the
/// runner answered; and the runner's counters, with `extra_waiting` added
/// to its waiting (the decode worker's requests that wait for remote KV).
/// The cached prefix blocks (the first [`MAX_PREFIX_REPORT`]) go along only
/// when the epoch the caller holds differs from the pool's, so a poll of an
/// unchanged worker carries 8 bytes of it, not the set, and never to a caller
/// that holds them by `WatchPrefixes` (`prefix_watched`).
///
/// The counters are also recorded as gauges here, on every poll and not
/// only after a request: two overlapping requests can record their
/// snapshots out of order (the earlier one, taken while the other still
/// held its blocks, last), which left `tandem_kv_blocks_used` above zero on
/// an idle worker until the next request (seen once in the
/// worker-etcd-cutoff drill as a 3-block "leak", invariant G2).
pub async fn answer(
    cache: &StatsCache,
    runner: &RunnerHandle,
    ready: bool,
    local: &Peer,
    extra_waiting: u32,
    asked: &HealthRequest,
) -> Result<HealthResponse, tonic::Status> {
    let stats = cache.read(runner).await.map_err(|e| tonic::Status::internal(e.message))?;
    let mut h = HealthResponse {
        live: true,
        ready: ready && stats.is_some(),
        version_group: local.version_group.as_str().to_owned(),
        layout_fingerprint: local.fingerprint.as_bytes().to_vec(),
        determinism_fingerprint: crate::serve::determinism(&local.fingerprint).to_vec(),
        ..HealthResponse::default()
    };
    if let Some(s) = stats {
        crate::metrics::record_stats(&s);
        h.kv_blocks_total = s.kv.total as u32;
        h.kv_blocks_used = s.kv.used as u32;
        h.running = s.running as u32;
        h.preemptions = s.preemptions;
        h.waiting = s.waiting as u32 + extra_waiting;
        h.prefix_epoch = prefix_epoch(s.prefix_epoch);
        if h.prefix_epoch != asked.prefix_epoch && !asked.prefix_watched {
            let hashes = s.prefixes.iter().take(MAX_PREFIX_REPORT).copied().collect();
            h.prefix = Some(PrefixReport { block_size: runner.block_size() as u32, hashes });
        }
    }
    Ok(h)
}

/// The pool's prefix epoch as this process reports it: offset by a number
/// drawn at start, so a restarted worker (whose pool counts from 0 again)
/// never repeats the epoch a coordinator holds from its predecessor; never 0.
fn prefix_epoch(pool_epoch: u64) -> u64 {
    static START: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    let start = *START.get_or_init(|| {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        (now.as_nanos() as u64 ^ u64::from(std::process::id()).rotate_left(32)) | 1
    });
    start.wrapping_add(pool_epoch).max(1)
}
