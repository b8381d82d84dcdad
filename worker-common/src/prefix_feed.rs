//! The worker's cached prefix blocks as a stream of numbered changes
//! (`WatchPrefixes`), so a coordinator's routing index follows a worker's
//! pool within milliseconds instead of a poll interval, with no cap on the
//! set and without the whole set crossing the wire each time it changes.
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
//! ([`crate::health::StatsCache`]) each time it reads the runner (and a
//! ticker while anyone watches); `tandem sim` with the changes its modelled
//! pool makes.
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

use proto::worker::v1::PrefixUpdate;
use tokio::sync::{broadcast, mpsc};
use tokio_util::sync::CancellationToken;
// A change's age is measured on tokio's clock, as every other duration here.
use tokio::time::Instant;

/// Changes a watcher may fall behind by before it is resynced with the whole set.
pub const BACKLOG: usize = 256;

/// One change of the set and when it happened.
#[derive(Debug)]
pub struct Change {
    pub added: Vec<u64>,
    pub removed: Vec<u64>,
    pub at: Instant,
}

/// Told of every message a watcher is sent: the hashes it carried and, for a change,
/// how long after the change it went out (freshness; `None` for a snapshot).
pub type OnSent = Arc<dyn Fn(usize, Option<Duration>) + Send + Sync>;

/// The stream [`Feed::watch`] returns, as a tonic server stream.
pub type Updates = Pin<Box<dyn tokio_stream::Stream<Item = Result<PrefixUpdate, tonic::Status>> + Send>>;

#[derive(Default)]
struct State {
    /// The pool's epoch the set was last read at (`None`: never read).
    epoch: Option<u64>,
    set: HashSet<u64>,
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
        self.send(&s, added, removed);
    }

    /// Applies one change the caller computed (hashes added and removed).
    pub fn apply(&self, added: Vec<u64>, removed: Vec<u64>) {
        let mut s = self.lock();
        let added: Vec<u64> = added.into_iter().filter(|h| s.set.insert(*h)).collect();
        let removed: Vec<u64> = removed.into_iter().filter(|h| s.set.remove(h)).collect();
        self.send(&s, added, removed);
    }

    /// Sends a change while the caller holds the state's lock (see the module doc).
    fn send(&self, _held: &State, added: Vec<u64>, removed: Vec<u64>) {
        if added.is_empty() && removed.is_empty() {
            return;
        }
        // No watcher: nothing to send, and an error that says only that.
        let _ = self.changes.send(Arc::new(Change { added, removed, at: Instant::now() }));
    }

    /// The whole set now, and a receiver of every change after it.
    fn subscribe(&self) -> (Vec<u64>, broadcast::Receiver<Arc<Change>>) {
        let s = self.lock();
        (s.set.iter().copied().collect(), self.changes.subscribe())
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
                let (set, mut changes) = feed.subscribe();
                seq += 1;
                feed.sent(set.len(), None);
                let snapshot = PrefixUpdate { seq, block_size, snapshot: true, added: set, removed: Vec::new() };
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
                    feed.sent(c.added.len() + c.removed.len(), Some(c.at.elapsed()));
                    let update = PrefixUpdate {
                        seq,
                        block_size,
                        snapshot: false,
                        added: c.added.clone(),
                        removed: c.removed.clone(),
                    };
                    if tx.send(Ok(update)).await.is_err() {
                        return;
                    }
                }
            }
        });
        Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
    }

    fn sent(&self, hashes: usize, age: Option<Duration>) {
        if let Some(f) = &self.on_sent {
            f(hashes, age);
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
            out.push(s.next().await.expect("an update").expect("not an error"));
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
        let feed =
            Feed::new(Some(Arc::new(move |n, age: Option<Duration>| s2.lock().unwrap().push((n, age.is_some())))));
        let big: Vec<u64> = (0..50_000).collect();
        feed.observe(7, &big);
        let mut w = feed.watch(32);
        let snap = take(&mut w, 1).await.remove(0);
        assert_eq!(snap.added.len(), 50_000);
        feed.apply(vec![1_000_000], vec![]);
        take(&mut w, 1).await;
        assert_eq!(*sent.lock().unwrap(), vec![(50_000, false), (1, true)]);
    }
}
