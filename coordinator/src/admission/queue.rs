//! The queue's state, kept under the [`Admission`](super::Admission) lock:
//! the order of queued tickets (strict priority, then self-clocked fair
//! queueing by finish tag), the per-key and total entry and token counts
//! behind the four bounds, room-making by shedding lower classes, dispatch
//! to free slots, and the `Retry-After` estimate. Nothing here awaits or
//! runs a waiter's code: verdicts are plain data sent on oneshot channels.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::Instant;

use super::{AdmissionConfig, Shed, Ticket};
use types::priority::Priority;

/// Weight of the newest sample in the per-slot throughput average.
const RATE_ALPHA: f64 = 0.2;
/// Bounds of a `Retry-After` estimate, whole seconds.
const RETRY_AFTER_MIN_S: f64 = 1.0;
const RETRY_AFTER_MAX_S: f64 = 60.0;

/// Where a queued ticket sits; the queue's order is this type's order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct Place {
    pub(super) priority: Priority,
    pub(super) finish: u64,
    /// Arrival order, breaking ties.
    pub(super) seq: u64,
}

/// How a queued ticket left the queue when someone else removed it: the
/// instant it was granted a slot, or why not. Plain data, so sending it
/// under the lock runs nothing.
pub(super) type Verdict = Result<Instant, Shed>;

pub(super) struct Entry {
    pub(super) key: String,
    pub(super) start: u64,
    pub(super) cost: u64,
    pub(super) deadline: Instant,
    pub(super) tx: oneshot::Sender<Verdict>,
}

/// One key's share of the queue. Dropped when it has nothing queued, so
/// memory stays bounded by the queue, not by the number of keys ever seen.
pub(super) struct KeyUse {
    pub(super) queued: usize,
    pub(super) tokens: u64,
    /// Finish tag of the key's last queued ticket, per class.
    pub(super) last_finish: [u64; 3],
}

pub(super) struct State {
    pub(super) cfg: AdmissionConfig,
    pub(super) running: usize,
    pub(super) closed: bool,
    pub(super) queue: BTreeMap<Place, Entry>,
    pub(super) keys: HashMap<String, KeyUse>,
    /// Per class: the finish tag of the last ticket it dispatched.
    pub(super) vtime: [u64; 3],
    pub(super) queued_tokens: u64,
    pub(super) queued_by_priority: [usize; 3],
    pub(super) next_seq: u64,
    /// Average tokens per second one slot works through (cost / time
    /// held), or `None` before any slot came back.
    pub(super) slot_rate: Option<f64>,
}

/// Whether `cost` more would take `queued` past `limit`. Token bounds limit
/// what is already queued (see [`Admission::admit`]), so nothing is over
/// when nothing is queued.
fn over(queued: u64, cost: u64, limit: u64) -> bool {
    queued > 0 && queued.saturating_add(cost) > limit
}

impl State {
    /// An empty queue with these limits.
    pub(super) fn new(cfg: AdmissionConfig) -> Self {
        Self {
            cfg,
            running: 0,
            closed: false,
            queue: BTreeMap::new(),
            keys: HashMap::new(),
            vtime: [0; 3],
            queued_tokens: 0,
            queued_by_priority: [0; 3],
            next_seq: 0,
            slot_rate: None,
        }
    }

    pub(super) fn queued_at_or_above(&self, priority: Priority) -> bool {
        self.queue.first_key_value().is_some_and(|(place, _)| place.priority <= priority)
    }

    /// Makes room to queue `cost` more for `key` in class `priority`, or
    /// says why not. The key's own bounds are checked first: a key over its
    /// share hears that it is the one to slow down. When the whole queue is
    /// full, the last-placed tickets of lower classes are shed (with
    /// [`Shed::QueueFull`]) if that makes enough room; otherwise nothing is.
    pub(super) fn make_room(&mut self, key: &str, priority: Priority, cost: u64) -> Result<(), Shed> {
        if let Some(k) = self.keys.get(key) {
            if k.queued >= self.cfg.per_key_max_queued || over(k.tokens, cost, self.cfg.per_key_max_queued_tokens) {
                return Err(Shed::KeyLimit { retry_after: self.retry_after() });
            }
        }
        let fits = |shed: usize, shed_tokens: u64| {
            self.queue.len().saturating_sub(shed) < self.cfg.max_queued
                && !over(self.queued_tokens.saturating_sub(shed_tokens), cost, self.cfg.max_queued_tokens)
        };
        let (mut shed, mut shed_tokens) = (0, 0);
        for (place, entry) in self.queue.iter().rev() {
            if fits(shed, shed_tokens) || place.priority <= priority {
                break;
            }
            shed += 1;
            shed_tokens = shed_tokens.saturating_add(entry.cost);
        }
        let retry_after = self.retry_after();
        if !fits(shed, shed_tokens) {
            return Err(Shed::QueueFull { retry_after });
        }
        for _ in 0..shed {
            if let Some((place, entry)) = self.queue.pop_last() {
                self.uncount(place, &entry, true);
                // A waiter that already went away has nothing to hear.
                let _ = entry.tx.send(Err(Shed::QueueFull { retry_after }));
            }
        }
        Ok(())
    }

    /// Time for the cluster to work through what is queued now: queued
    /// tokens over (per-slot rate x slots), whole seconds in [1, 60];
    /// [`BASE`](super::retry::BASE) before any slot has come back. It errs
    /// long rather than short, so retries do not arrive before there is
    /// room. Refusals add jitter on top ([`super::retry_after`]).
    fn retry_after(&self) -> Duration {
        self.drain_estimate().unwrap_or(super::retry::BASE)
    }

    /// [`State::retry_after`], `None` before any throughput was measured.
    pub(super) fn drain_estimate(&self) -> Option<Duration> {
        let rate = self.slot_rate?;
        let per_second = rate * self.cfg.max_running.max(1) as f64;
        let secs = (self.queued_tokens as f64 / per_second).ceil();
        let secs = if secs.is_finite() { secs.clamp(RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S) } else { RETRY_AFTER_MAX_S };
        Some(Duration::from_secs(secs as u64))
    }

    pub(super) fn record_rate(&mut self, cost: u64, held: Duration) {
        if cost == 0 {
            return;
        }
        // A slot given back within a millisecond says little; do not let it
        // claim an absurd rate.
        let sample = cost as f64 / held.as_secs_f64().max(1e-3);
        self.slot_rate = Some(match self.slot_rate {
            Some(avg) => avg + RATE_ALPHA * (sample - avg),
            None => sample,
        });
    }

    pub(super) fn enqueue(&mut self, ticket: Ticket) -> (Place, oneshot::Receiver<Verdict>) {
        let class = ticket.priority.index();
        let vtime = self.vtime[class];
        let key = match self.keys.get_mut(&ticket.key) {
            Some(k) => k,
            None => self.keys.entry(ticket.key.clone()).or_insert(KeyUse { queued: 0, tokens: 0, last_finish: [0; 3] }),
        };
        let start = vtime.max(key.last_finish[class]);
        let finish = start.saturating_add(ticket.cost);
        key.last_finish[class] = finish;
        key.queued += 1;
        key.tokens = key.tokens.saturating_add(ticket.cost);
        self.queued_tokens = self.queued_tokens.saturating_add(ticket.cost);
        self.queued_by_priority[class] += 1;
        let place = Place { priority: ticket.priority, finish, seq: self.next_seq };
        self.next_seq += 1;
        let (tx, rx) = oneshot::channel();
        let entry = Entry { key: ticket.key, start, cost: ticket.cost, deadline: ticket.deadline, tx };
        self.queue.insert(place, entry);
        (place, rx)
    }

    /// Takes `place` out of the queue and un-counts it. `withdrawn`: it
    /// leaves unserved, so its key's finish tag goes back to where it was
    /// if this was the key's last ticket in the class.
    pub(super) fn remove(&mut self, place: Place, withdrawn: bool) -> Option<Entry> {
        let entry = self.queue.remove(&place)?;
        self.uncount(place, &entry, withdrawn);
        Some(entry)
    }

    fn uncount(&mut self, place: Place, entry: &Entry, withdrawn: bool) {
        let class = place.priority.index();
        self.queued_tokens = self.queued_tokens.saturating_sub(entry.cost);
        self.queued_by_priority[class] = self.queued_by_priority[class].saturating_sub(1);
        let Some(key) = self.keys.get_mut(&entry.key) else {
            return;
        };
        key.queued = key.queued.saturating_sub(1);
        key.tokens = key.tokens.saturating_sub(entry.cost);
        if withdrawn && key.last_finish[class] == place.finish {
            key.last_finish[class] = entry.start;
        }
        if key.queued == 0 {
            self.keys.remove(&entry.key);
        }
    }

    /// Grants free slots to the head of the queue. Tickets whose deadline
    /// has passed are dropped here rather than granted.
    pub(super) fn dispatch(&mut self, now: Instant) {
        while self.running < self.cfg.max_running {
            let Some((place, entry)) = self.queue.pop_first() else {
                return;
            };
            self.uncount(place, &entry, false);
            if entry.deadline <= now {
                let _ = entry.tx.send(Err(Shed::Deadline));
                continue;
            }
            let class = place.priority.index();
            self.vtime[class] = self.vtime[class].max(place.finish);
            self.running += 1;
            if entry.tx.send(Ok(now)).is_err() {
                // Unreachable while waiters withdraw before dropping their
                // receiver; if it happens, the slot is simply not taken.
                self.running -= 1;
            }
        }
    }
}
