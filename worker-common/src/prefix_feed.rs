//! The worker's cached prefix blocks as a stream of numbered changes
//! (`WatchPrefixes`), so a coordinator's routing index follows a worker's
//! pool within milliseconds instead of a poll interval, with no cap on the
//! set and without the whole set crossing the wire each time it changes.
//! The worker's load (running, waiting, KV blocks used) rides the same
//! stream, in the first message and whenever it changed enough to matter to
//! routing ([`Feed::observe_load`]): a coordinator that routed on figures up
//! to a poll interval old chose busier workers and missed cached prefixes.
//!
//! [`Feed`] holds the set last seen and sends each change, once, to every
//! watcher; [`Feed::watch`] is one watcher's stream: the whole set first
//! (`snapshot`), then each change, numbered 1, 2, 3... A watcher too slow to
//! take the changes as they come (more than [`BACKLOG`] behind) is sent the
//! whole set again in place of what it missed, still in sequence: it never
//! sees a gap, and one that does (a broken or hostile peer) must drop the
//! worker's set and watch again. A change is sent under the same lock as
//! the set it leaves, so a new watcher's snapshot and the changes after it
//! neither miss nor repeat a step.
//!
//! Who feeds it: the real workers' Health statistics cache
//! ([`crate::health::StatsCache`]) each time it reads the runner, and a
//! ticker while anyone watches (the set when the runner's published epoch
//! moved, the load the runner publishes after every turn); `tandem sim` with
//! the changes its modelled pool and queues make.
//!
//! [`Feed::close`] ends every stream and refuses new ones: a draining worker must not
//! keep its gRPC server's graceful shutdown waiting on streams that never end (a
//! watcher then holds nothing of it, which is right for a worker routed nothing).
//!
//! Must not: block on a watcher (a full one is resynced, never waited for).

use std::collections::HashSet;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use proto::worker::v1::{PrefixUpdate, WatchedLoad};
use tokio::sync::{broadcast, mpsc};
use tokio_util::sync::CancellationToken;
// A change's age is measured on tokio's clock, as every other duration here.
use tokio::time::Instant;

/// Changes a watcher may fall behind by before it is resynced with the whole set.
pub const BACKLOG: usize = 256;

/// One change of the set (and of the load) and when it happened.
#[derive(Debug)]
pub struct Change {
    pub added: Vec<u64>,
    pub removed: Vec<u64>,
    /// The load, when it changed enough to send ([`Feed::observe_load`]).
    pub load: Option<WatchedLoad>,
    pub at: Instant,
}

/// Told of every message a watcher is sent: the hashes it carried; for a change of the
/// set, how long after the change it went out (freshness; `None` for a snapshot and a
/// change of the load alone); and whether it carried the load.
pub type OnSent = Arc<dyn Fn(usize, Option<Duration>, bool) + Send + Sync>;

/// The share of the pool KV blocks used must move by (as a divisor of the pool's
/// size, at least one block) before a load is sent for it alone: the router weighs the
/// used fraction, and every block's change would be a message per decode step.
pub const KV_STEP_DIVISOR: u32 = 64;

/// Whether `now` differs enough from `sent` to go to the watchers: any change of
/// running or waiting, of the pool's size, or of the blocks used by a step.
pub fn load_moved(sent: Option<&WatchedLoad>, now: &WatchedLoad) -> bool {
    let Some(s) = sent else { return true };
    let step = (now.kv_blocks_total / KV_STEP_DIVISOR).max(1);
    s.running != now.running
        || s.waiting != now.waiting
        || s.kv_blocks_total != now.kv_blocks_total
        || s.kv_blocks_used.abs_diff(now.kv_blocks_used) >= step
}

/// The stream [`Feed::watch`] returns, as a tonic server stream.
pub type Updates = Pin<Box<dyn tokio_stream::Stream<Item = Result<PrefixUpdate, tonic::Status>> + Send>>;

#[derive(Default)]
struct State {
    /// The pool's epoch the set was last read at (`None`: never read).
    epoch: Option<u64>,
    set: HashSet<u64>,
    /// The load as last observed (a snapshot's), and as last sent to the watchers.
    load: Option<WatchedLoad>,
    sent_load: Option<WatchedLoad>,
}

/// One worker's prefix set and its watchers (cheap to clone: one shared feed).
#[derive(Clone)]
pub struct Feed {
    state: Arc<Mutex<State>>,
    changes: broadcast::Sender<Arc<Change>>,
    on_sent: Option<OnSent>,
    closed: CancellationToken,
}

impl Default for Feed {
    fn default() -> Self {
        Self::new(None)
    }
}

impl Feed {
    pub fn new(on_sent: Option<OnSent>) -> Self {
        Self {
            state: Arc::default(),
            changes: broadcast::channel(BACKLOG).0,
            on_sent,
            closed: CancellationToken::new(),
        }
    }

    /// Ends every watcher's stream now and every later one at once (see the module doc).
    pub fn close(&self) {
        self.closed.cancel();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Watchers now.
    pub fn watchers(&self) -> usize {
        self.changes.receiver_count()
    }

    /// The pool's whole set at `epoch` (which changes whenever the set does): when the
    /// epoch moved since the last call, the difference is sent as one change.
    pub fn observe(&self, epoch: u64, hashes: &[u64]) {
        let mut s = self.lock();
        if s.epoch == Some(epoch) {
            return;
        }
        s.epoch = Some(epoch);
        let now: HashSet<u64> = hashes.iter().copied().collect();
        let added: Vec<u64> = now.difference(&s.set).copied().collect();
        let removed: Vec<u64> = s.set.difference(&now).copied().collect();
        s.set = now;
        self.send(&s, added, removed, None);
    }

    /// The worker's load now, read by `now` under the feed's lock (so of two callers
    /// racing after two changes, the later sees both): sent to the watchers when it
    /// moved enough since the last one sent ([`load_moved`]); always the next
    /// snapshot's.
    pub fn observe_load(&self, now: impl FnOnce() -> WatchedLoad) {
        let mut s = self.lock();
        let load = now();
        s.load = Some(load);
        if load_moved(s.sent_load.as_ref(), &load) {
            s.sent_load = Some(load);
            self.send(&s, Vec::new(), Vec::new(), Some(load));
        }
    }

    /// Applies one change the caller computed (hashes added and removed).
    pub fn apply(&self, added: Vec<u64>, removed: Vec<u64>) {
        let mut s = self.lock();
        let added: Vec<u64> = added.into_iter().filter(|h| s.set.insert(*h)).collect();
        let removed: Vec<u64> = removed.into_iter().filter(|h| s.set.remove(h)).collect();
        self.send(&s, added, removed, None);
    }

    /// Sends a change while the caller holds the state's lock (see the module doc).
    fn send(&self, _held: &State, added: Vec<u64>, removed: Vec<u64>, load: Option<WatchedLoad>) {
        if added.is_empty() && removed.is_empty() && load.is_none() {
            return;
        }
        // No watcher: nothing to send, and an error that says only that.
        let _ = self.changes.send(Arc::new(Change { added, removed, load, at: Instant::now() }));
    }

    /// The whole set and the load now, and a receiver of every change after them.
    fn subscribe(&self) -> (Vec<u64>, Option<WatchedLoad>, broadcast::Receiver<Arc<Change>>) {
        let s = self.lock();
        (s.set.iter().copied().collect(), s.load, self.changes.subscribe())
    }

    /// One watcher's stream (see the module doc), `block_size` tokens per block. It
    /// ends when the watcher goes away.
    pub fn watch(&self, block_size: u32) -> Updates {
        let (tx, rx) = mpsc::channel(8);
        if self.closed.is_cancelled() {
            return Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx));
        }
        let feed = self.clone();
        tokio::spawn(async move {
            let mut seq = 0u64;
            // Each pass: the whole set, then changes until this watcher falls behind.
            loop {
                let (set, load, mut changes) = feed.subscribe();
                seq += 1;
                feed.sent(set.len(), None, load.is_some());
                let snapshot = PrefixUpdate { seq, block_size, snapshot: true, added: set, removed: Vec::new(), load };
                if tx.send(Ok(snapshot)).await.is_err() {
                    return;
                }
                loop {
                    let change = tokio::select! {
                        c = changes.recv() => c,
                        () = tx.closed() => return,
                        () = feed.closed.cancelled() => return,
                    };
                    let c = match change {
                        Ok(c) => c,
                        Err(broadcast::error::RecvError::Lagged(_)) => break,
                        Err(broadcast::error::RecvError::Closed) => return,
                    };
                    seq += 1;
                    let hashes = c.added.len() + c.removed.len();
                    feed.sent(hashes, (hashes > 0).then(|| c.at.elapsed()), c.load.is_some());
                    let update = PrefixUpdate {
                        seq,
                        block_size,
                        snapshot: false,
                        added: c.added.clone(),
                        removed: c.removed.clone(),
                        load: c.load,
                    };
                    if tx.send(Ok(update)).await.is_err() {
                        return;
                    }
                }
            }
        });
        Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
    }

    fn sent(&self, hashes: usize, age: Option<Duration>, load: bool) {
        if let Some(f) = &self.on_sent {
            f(hashes, age, load);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio_stream::StreamExt;

    /// What a watcher holds after applying `updates` the way the coordinator does.
    fn replay(updates: &[PrefixUpdate]) -> HashSet<u64> {
        let mut held = HashSet::new();
        for (i, u) in updates.iter().enumerate() {
            assert_eq!(u.seq, i as u64 + 1, "numbered without a gap");
            if u.snapshot {
                held = u.added.iter().copied().collect();
            } else {
                held.extend(&u.added);
                for h in &u.removed {
                    held.remove(h);
                }
            }
        }
        held
    }

    async fn take(s: &mut Updates, n: usize) -> Vec<PrefixUpdate> {
        let mut out = Vec::new();
        for _ in 0..n {
            let next = tokio::time::timeout(Duration::from_secs(10), s.next()).await;
            out.push(next.expect("an update within 10 s").expect("an update").expect("not an error"));
        }
        out
    }

    #[tokio::test]
    async fn a_watcher_gets_the_set_then_each_change_once_in_order() {
        let feed = Feed::default();
        feed.observe(1, &[10, 11]);
        let mut w = feed.watch(16);
        let first = take(&mut w, 1).await;
        assert!(first[0].snapshot && first[0].block_size == 16);
        feed.observe(1, &[10, 11, 12]); // the same epoch: nothing read
        feed.observe(2, &[11, 12]);
        feed.observe(3, &[11, 12]); // a new epoch, the same set: no change sent
        feed.apply(vec![13, 12], vec![99]);
        let rest = take(&mut w, 2).await;
        assert_eq!((rest[0].added.clone(), rest[0].removed.clone()), (vec![12], vec![10]));
        assert_eq!((rest[1].added.clone(), rest[1].removed.clone()), (vec![13], vec![]), "only what changed");
        let all: Vec<PrefixUpdate> = first.into_iter().chain(rest).collect();
        assert_eq!(replay(&all), HashSet::from([11, 12, 13]));
        assert_eq!(feed.watchers(), 1);
        drop(w);
        // The watcher's task notices its caller left and lets go of the feed.
        while feed.watchers() > 0 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn a_watcher_that_falls_behind_is_resynced_with_the_whole_set_and_no_gap() {
        let feed = Feed::default();
        let mut w = feed.watch(16);
        let mut got = take(&mut w, 1).await;
        // Far more changes than the backlog before the watcher's task runs again (one
        // thread: it cannot run while this loop does).
        for h in 0..(BACKLOG as u64 * 3) {
            feed.apply(vec![h], if h % 2 == 1 { vec![h - 1] } else { vec![] });
        }
        got.extend(take(&mut w, 1).await);
        assert!(got[1].snapshot && got[1].seq == 2, "the whole set again, next in sequence: {:?}", got[1].seq);
        assert_eq!(replay(&got), feed.lock().set.clone());
        feed.apply(vec![5_000], vec![]);
        got.extend(take(&mut w, 1).await);
        assert_eq!((got[2].seq, got[2].snapshot, got[2].added.clone()), (3, false, vec![5_000]), "then changes again");
    }

    #[tokio::test]
    async fn closing_ends_every_stream_and_refuses_new_ones() {
        let feed = Feed::default();
        feed.observe(1, &[1]);
        let mut w = feed.watch(16);
        take(&mut w, 1).await;
        feed.close();
        assert!(w.next().await.is_none(), "the open stream ends");
        let mut later = feed.watch(16);
        assert!(later.next().await.is_none(), "a new one ends at once");
        assert_eq!(feed.watchers(), 0);
    }

    #[tokio::test]
    async fn the_set_has_no_cap_and_messages_are_counted() {
        let sent = Arc::new(Mutex::new(Vec::new()));
        let s2 = sent.clone();
        let feed = Feed::new(Some(Arc::new(move |n, age: Option<Duration>, _load| {
            s2.lock().unwrap().push((n, age.is_some()));
        })));
        let big: Vec<u64> = (0..50_000).collect();
        feed.observe(7, &big);
        let mut w = feed.watch(32);
        let snap = take(&mut w, 1).await.remove(0);
        assert_eq!(snap.added.len(), 50_000);
        feed.apply(vec![1_000_000], vec![]);
        take(&mut w, 1).await;
        assert_eq!(*sent.lock().unwrap(), vec![(50_000, false), (1, true)]);
    }

    fn load(running: u32, waiting: u32, used: u32) -> WatchedLoad {
        WatchedLoad { running, waiting, kv_blocks_used: used, kv_blocks_total: 640 }
    }

    /// The load rides the stream: in the snapshot, then each change that matters to
    /// routing (a running or waiting count, or a 64th of the pool used), in
    /// sequence with the set's changes; a block's worth of drift alone is not sent.
    #[tokio::test]
    async fn the_load_goes_in_the_snapshot_and_with_each_change_that_matters() {
        let loads = Arc::new(Mutex::new(0));
        let l2 = loads.clone();
        let feed = Feed::new(Some(Arc::new(move |_, _, load| *l2.lock().unwrap() += usize::from(load))));
        feed.observe_load(|| load(1, 0, 20));
        let mut w = feed.watch(16);
        let first = take(&mut w, 1).await;
        assert_eq!(first[0].load, Some(load(1, 0, 20)), "the snapshot carries the load");
        feed.observe_load(|| load(1, 0, 29)); // 9 blocks: under 640 / 64
        feed.observe_load(|| load(2, 0, 29));
        feed.apply(vec![7], vec![]);
        feed.observe_load(|| load(2, 0, 38)); // 9 blocks from the 29 sent last: not yet
        feed.observe_load(|| load(2, 0, 39)); // 10: a step
        feed.observe_load(|| load(2, 1, 38));
        let rest = take(&mut w, 4).await;
        let got: Vec<(Option<WatchedLoad>, Vec<u64>)> = rest.iter().map(|u| (u.load, u.added.clone())).collect();
        assert_eq!(
            got,
            vec![
                (Some(load(2, 0, 29)), vec![]),
                (None, vec![7]),
                (Some(load(2, 0, 39)), vec![]),
                (Some(load(2, 1, 38)), vec![]),
            ]
        );
        assert!(rest.iter().all(|u| !u.snapshot) && rest.last().is_some_and(|u| u.seq == 5), "in sequence");
        assert_eq!(*loads.lock().unwrap(), 4, "each message with a load counted");
        // A new watcher's snapshot has the load last observed, sent or not.
        feed.observe_load(|| load(2, 1, 40));
        let mut late = feed.watch(16);
        assert_eq!(take(&mut late, 1).await[0].load, Some(load(2, 1, 40)));
    }

    #[test]
    fn a_load_moves_by_a_count_or_a_step_of_the_pool() {
        assert!(load_moved(None, &load(0, 0, 0)), "the first is always sent");
        let sent = load(3, 1, 100);
        assert!(!load_moved(Some(&sent), &load(3, 1, 109)) && !load_moved(Some(&sent), &load(3, 1, 91)));
        assert!(load_moved(Some(&sent), &load(3, 1, 110)) && load_moved(Some(&sent), &load(3, 1, 90)));
        assert!(load_moved(Some(&sent), &load(4, 1, 100)) && load_moved(Some(&sent), &load(3, 0, 100)));
        let small = WatchedLoad { kv_blocks_total: 16, ..sent };
        assert!(load_moved(Some(&small), &WatchedLoad { kv_blocks_used: 101, ..small }), "a small pool: one block");
    }
}
