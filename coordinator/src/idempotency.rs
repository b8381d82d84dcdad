//! `Idempotency-Key`: a retry attaches to the first request's result
//! instead of generating twice.
//!
//! The first request with a key (per caller: keys of different API keys
//! never meet) becomes the *leader*: it runs, and records what it sends —
//! one whole response, or the SSE events of a stream, in order. A request
//! with the same key and the same body that arrives while the leader runs
//! or within the window after it finished *follows*: it gets the recorded
//! items from the start and then the live ones, ending the same way.
//!
//! What is kept, and what a retry runs anew:
//! - kept: a complete answer, and refusals a retry would get again (4xx
//!   other than 429);
//! - dropped, so a retry runs: 429, 5xx (shed, deadline, worker failure),
//!   and a leader that went away before finishing (client disconnect — the
//!   generation is cancelled and its KV freed, so there is nothing to
//!   attach to). Followers attached to such a leader get
//!   [`Replayed::Abandoned`].
//! - the same key with a different body is refused ([`Claim::Conflict`],
//!   HTTP 422): a key names one request.
//!
//! Memory is bounded: entries expire `window` after they finish, and at most
//! `max_entries` exist; when full of running requests a new key is refused
//! ([`Claim::Full`], HTTP 503) rather than run without its guarantee.
//!
//! Must not: let a follower wait forever (a leader dropped unfinished ends
//! its followers), or hold its lock across an await.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

/// Longest accepted key, bytes.
pub const MAX_KEY_LEN: usize = 256;

/// A stable digest of a request body (the same body always matches).
pub fn fingerprint(body: &[u8]) -> u64 {
    let mut h = std::hash::DefaultHasher::new();
    body.hash(&mut h);
    h.finish()
}

/// How an entry ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    Running,
    /// Finished and kept for followers.
    Kept,
    /// The leader went away or its result is not kept.
    Abandoned,
}

struct Log<T> {
    items: Vec<T>,
    end: End,
    finished_at: Option<Instant>,
}

struct Entry<T> {
    body: u64,
    log: Mutex<Log<T>>,
    /// Bumped on every push and at the end; followers wait on it.
    version: watch::Sender<u64>,
}

impl<T> Entry<T> {
    fn lock(&self) -> std::sync::MutexGuard<'_, Log<T>> {
        self.log.lock().unwrap_or_else(|e| e.into_inner())
    }
}

type Key = (String, String);

/// The table of keys.
pub struct Idempotency<T> {
    entries: Mutex<HashMap<Key, Arc<Entry<T>>>>,
    window: Duration,
    max_entries: usize,
}

/// What a request with a key gets to do.
pub enum Claim<T> {
    /// Run, recording into this.
    Leader(Recorder<T>),
    /// Replay the first request's items.
    Follower(Replay<T>),
    /// The key was used with a different body.
    Conflict,
    /// Too many keys in flight.
    Full,
}

impl<T: Clone> Idempotency<T> {
    pub fn new(window: Duration, max_entries: usize) -> Arc<Self> {
        Arc::new(Self { entries: Mutex::new(HashMap::new()), window, max_entries: max_entries.max(1) })
    }

    /// Entries held now (running or kept).
    pub fn len(&self) -> usize {
        self.entries.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Whether no entry is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Claims `key` for `caller`'s request whose body digests to `body`.
    pub fn claim(self: &Arc<Self>, caller: &str, key: &str, body: u64) -> Claim<T> {
        let now = Instant::now();
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let window = self.window;
        entries.retain(|_, e| {
            let log = e.lock();
            match log.end {
                End::Running => true,
                End::Kept => log.finished_at.is_some_and(|t| now.duration_since(t) < window),
                End::Abandoned => false,
            }
        });
        let k = (caller.to_owned(), key.to_owned());
        if let Some(e) = entries.get(&k) {
            if e.body != body {
                return Claim::Conflict;
            }
            return Claim::Follower(Replay { entry: e.clone(), next: 0, version: e.version.subscribe() });
        }
        if entries.len() >= self.max_entries {
            return Claim::Full;
        }
        let (version, _) = watch::channel(0);
        let entry = Arc::new(Entry {
            body,
            log: Mutex::new(Log { items: Vec::new(), end: End::Running, finished_at: None }),
            version,
        });
        entries.insert(k.clone(), entry.clone());
        Claim::Leader(Recorder { table: Arc::downgrade(self), key: k, entry, done: false })
    }
}

impl<T> Idempotency<T> {
    fn forget(&self, key: &Key, entry: &Arc<Entry<T>>) {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        if entries.get(key).is_some_and(|e| Arc::ptr_eq(e, entry)) {
            entries.remove(key);
        }
    }
}

/// The leader's side: push what is sent, then finish. Dropped unfinished,
/// the entry is abandoned (followers end, the key is free again).
pub struct Recorder<T> {
    table: std::sync::Weak<Idempotency<T>>,
    key: Key,
    entry: Arc<Entry<T>>,
    done: bool,
}

impl<T: Clone> Recorder<T> {
    /// Records one item sent to the client.
    pub fn push(&self, item: T) {
        self.entry.lock().items.push(item);
        self.entry.version.send_modify(|v| *v += 1);
    }

    /// The request ended; `keep` says whether a retry should get this
    /// result (true) or run anew (false).
    pub fn finish(mut self, keep: bool) {
        self.end(if keep { End::Kept } else { End::Abandoned });
    }
}

impl<T> Recorder<T> {
    fn end(&mut self, end: End) {
        if self.done {
            return;
        }
        self.done = true;
        {
            let mut log = self.entry.lock();
            log.end = end;
            log.finished_at = Some(Instant::now());
        }
        self.entry.version.send_modify(|v| *v += 1);
        if end == End::Abandoned {
            if let Some(t) = self.table.upgrade() {
                t.forget(&self.key, &self.entry);
            }
        }
    }
}

impl<T> Drop for Recorder<T> {
    fn drop(&mut self) {
        self.end(End::Abandoned);
    }
}

/// One step of a replay.
#[derive(Debug, PartialEq, Eq)]
pub enum Replayed<T> {
    Item(T),
    /// Every item was replayed and the leader finished normally.
    End,
    /// The leader went away unfinished; the client should retry.
    Abandoned,
}

/// A follower's side.
pub struct Replay<T> {
    entry: Arc<Entry<T>>,
    next: usize,
    version: watch::Receiver<u64>,
}

impl<T: Clone> Replay<T> {
    /// Whether the leader had already finished when this replay started
    /// reading (for metrics: `done` vs `inflight`).
    pub fn leader_finished(&self) -> bool {
        self.entry.lock().end != End::Running
    }

    /// The next recorded item, waiting for the leader when caught up.
    pub async fn next(&mut self) -> Replayed<T> {
        loop {
            {
                let log = self.entry.lock();
                if let Some(item) = log.items.get(self.next) {
                    self.next += 1;
                    return Replayed::Item(item.clone());
                }
                match log.end {
                    End::Kept => return Replayed::End,
                    End::Abandoned => return Replayed::Abandoned,
                    End::Running => {}
                }
            }
            // The sender lives in the entry we hold, so this cannot close;
            // every push and end bumps the version after writing the log.
            if self.version.changed().await.is_err() {
                return Replayed::Abandoned;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leader(c: Claim<u32>) -> Recorder<u32> {
        match c {
            Claim::Leader(r) => r,
            _ => panic!("expected to lead"),
        }
    }

    fn follower(c: Claim<u32>) -> Replay<u32> {
        match c {
            Claim::Follower(r) => r,
            _ => panic!("expected to follow"),
        }
    }

    #[tokio::test]
    async fn a_follower_gets_the_past_then_the_live_items_then_the_end() {
        let t = Idempotency::new(Duration::from_secs(60), 10);
        let l = leader(t.claim("alice", "k1", 7));
        l.push(1);
        let mut f = follower(t.claim("alice", "k1", 7));
        assert!(!f.leader_finished());
        assert_eq!(f.next().await, Replayed::Item(1));
        let live = tokio::spawn(async move {
            let mut got = Vec::new();
            loop {
                match f.next().await {
                    Replayed::Item(i) => got.push(i),
                    other => return (got, other),
                }
            }
        });
        l.push(2);
        l.push(3);
        l.finish(true);
        let (got, end) = live.await.expect("the follower task");
        assert_eq!((got, end), (vec![2, 3], Replayed::End));
        // After the end, a new follower gets everything at once.
        let mut g = follower(t.claim("alice", "k1", 7));
        assert!(g.leader_finished());
        for want in [1, 2, 3] {
            assert_eq!(g.next().await, Replayed::Item(want));
        }
        assert_eq!(g.next().await, Replayed::End);
    }

    #[tokio::test]
    async fn keys_are_per_caller_and_bodies_must_match() {
        let t = Idempotency::new(Duration::from_secs(60), 10);
        let _a = leader(t.claim("alice", "k", 1));
        assert!(matches!(t.claim("bob", "k", 2), Claim::Leader(_)), "bob's key is his own");
        assert!(matches!(t.claim("alice", "k", 2), Claim::Conflict));
    }

    #[tokio::test]
    async fn an_abandoned_leader_ends_followers_and_frees_the_key() {
        let t = Idempotency::new(Duration::from_secs(60), 10);
        let l = leader(t.claim("a", "k", 1));
        l.push(5);
        let mut f = follower(t.claim("a", "k", 1));
        drop(l);
        assert_eq!(f.next().await, Replayed::Item(5));
        assert_eq!(f.next().await, Replayed::Abandoned);
        assert!(t.is_empty());
        let l2 = leader(t.claim("a", "k", 1));
        // A result not worth keeping (e.g. a 503) also frees the key.
        l2.finish(false);
        assert!(matches!(t.claim("a", "k", 1), Claim::Leader(_)));
    }

    #[tokio::test(start_paused = true)]
    async fn kept_results_expire_after_the_window_and_the_table_is_bounded() {
        let t = Idempotency::new(Duration::from_secs(10), 2);
        leader(t.claim("a", "k1", 1)).finish(true);
        let _running = leader(t.claim("a", "k2", 1));
        assert!(matches!(t.claim("a", "k3", 1), Claim::Full));
        tokio::time::advance(Duration::from_secs(11)).await;
        // k1 expired: its slot is free, and the same key leads again.
        assert!(matches!(t.claim("a", "k1", 1), Claim::Leader(_)));
        assert_eq!(t.len(), 1, "only the running k2 is left once the new k1 leader dropped");
    }
}
