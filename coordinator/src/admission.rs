//! The coordinator's admission queue: who runs now, who waits, and who is
//! refused at once. This is the cluster's overload contract.
//!
//! A request arrives as a [`Ticket`] (API key, priority class, token cost,
//! deadline). [`Admission::admit`] grants it a running [`Slot`] at once when
//! one is free and nobody of its class or above is waiting; otherwise it
//! queues, bounded four ways (entries and tokens, in all and per key), and a
//! ticket beyond a bound is shed at once with a `Retry-After` estimate:
//! its own key's bound gives [`Shed::KeyLimit`] (429), the whole queue's
//! [`Shed::QueueFull`] (503). A queued ticket leaves with a slot, with
//! [`Shed::Deadline`] when its deadline passes first (it never reaches a
//! worker), with [`Shed::QueueFull`] when a ticket of a higher class needs
//! its place in a full queue, or with [`Shed::Closed`] at shutdown. Dropping
//! a [`Slot`] frees it for the next ticket.
//!
//! Order of the queue: strict priority between classes, then fairness by
//! token cost between keys inside a class, by self-clocked fair queueing.
//! Each class has a virtual time `v` (the finish tag of the last ticket it
//! dispatched); each key remembers the finish tag of its last queued ticket
//! in the class. A ticket gets `start = max(v, key's last finish)` and
//! `finish = start + cost`, and the smallest finish goes first (ties by
//! arrival). A key with many large requests queued thus pushes its own
//! later requests back, not other keys' small ones; a key that was idle
//! starts at `v` and so gets no credit for its idle time.
//!
//! Under overload the lowest class goes first, twice over. Low can starve
//! while High (or Normal) load is sustained: priority is strict and there
//! is no aging, and a starved ticket still leaves at its deadline, so its
//! wait is bounded by the deadline the client chose. And a full queue does
//! not turn a higher class away while it holds lower-class tickets: the
//! last-placed of those are shed to make room. Otherwise a flood of Low
//! batch traffic could keep the queue full and make High wait out 503s.
//!
//! Cancellation: `admit` may be dropped at any point (the client went away).
//! A queued ticket then leaves the queue and its tokens are un-counted; a
//! ticket that was granted a slot in the instant before the drop gives the
//! slot back, so slots never leak. A dispatch only records its decision and
//! sends a plain verdict, with no side effects, so nothing that could take
//! the lock runs while it is held.
//!
//! Must not: look inside requests (it sees a key, a class, a cost and a
//! deadline), talk to workers, hold its lock across an `await`, or hand out
//! a slot to a ticket whose deadline had passed when it was dispatched.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::http::StatusCode;
use thiserror::Error;
use tokio::sync::oneshot;
use tokio::time::Instant;

/// The key of a request that carries no API key.
pub const ANONYMOUS: &str = "anonymous";

/// Weight of the newest sample in the per-slot throughput average.
const RATE_ALPHA: f64 = 0.2;
/// Bounds of a `Retry-After` estimate, whole seconds.
const RETRY_AFTER_MIN_S: f64 = 1.0;
const RETRY_AFTER_MAX_S: f64 = 60.0;

/// Limits of the admission queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdmissionConfig {
    /// Requests running at once (holding a [`Slot`]). The default, 8, is a
    /// cautious start; the cluster raises it with
    /// [`Admission::set_max_running`] once it knows its workers' capacity.
    pub max_running: usize,
    /// Tickets queued at once, all keys. The default, 64 (8 per running
    /// slot), is about what can be served within a typical deadline; a
    /// deeper queue mostly produces timeouts instead of quick 503s.
    pub max_queued: usize,
    /// Tokens (prompt + `max_tokens`) queued at once, all keys. Default:
    /// 64 requests of a 2,048-token budget.
    pub max_queued_tokens: u64,
    /// Tickets queued at once for one key. Default 16: one key can fill at
    /// most a quarter of the default queue, so at least four keys always
    /// find room.
    pub per_key_max_queued: usize,
    /// Tokens queued at once for one key. Default: 16 requests of a
    /// 2,048-token budget, a quarter of the default token bound.
    pub per_key_max_queued_tokens: u64,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        Self {
            max_running: 8,
            max_queued: 64,
            max_queued_tokens: 64 * 2048,
            per_key_max_queued: 16,
            per_key_max_queued_tokens: 16 * 2048,
        }
    }
}

/// A configuration that cannot work.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ConfigError {
    /// A limit is zero, so nothing could ever run or queue.
    #[error("admission.{field} must be at least 1")]
    Zero { field: &'static str },
}

impl AdmissionConfig {
    /// Refuses a zero limit, naming the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let zero = [
            ("max_running", self.max_running == 0),
            ("max_queued", self.max_queued == 0),
            ("max_queued_tokens", self.max_queued_tokens == 0),
            ("per_key_max_queued", self.per_key_max_queued == 0),
            ("per_key_max_queued_tokens", self.per_key_max_queued_tokens == 0),
        ];
        match zero.into_iter().find(|(_, is_zero)| *is_zero) {
            Some((field, _)) => Err(ConfigError::Zero { field }),
            None => Ok(()),
        }
    }
}

/// A request's class. Classes are served in strict order: a queued High
/// ticket always goes before any Normal one, Normal before Low.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum Priority {
    High,
    #[default]
    Normal,
    Low,
}

/// A priority that is not `high`, `normal` or `low`.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("priority must be high, normal or low, not {0:?}")]
pub struct PriorityParseError(pub String);

impl Priority {
    /// All classes, highest first; `Priority::ALL[p.index()] == p`.
    pub const ALL: [Priority; 3] = [Priority::High, Priority::Normal, Priority::Low];

    /// `high`, `normal` or `low`, in any case. Numbers are refused: whether
    /// 0 is the highest or the lowest is a guess clients would get wrong.
    pub fn parse(s: &str) -> Result<Self, PriorityParseError> {
        Self::ALL
            .into_iter()
            .find(|p| s.eq_ignore_ascii_case(p.as_str()))
            .ok_or_else(|| PriorityParseError(s.chars().take(32).collect()))
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Priority::High => "high",
            Priority::Normal => "normal",
            Priority::Low => "low",
        }
    }

    /// 0 for High, 1 for Normal, 2 for Low (the index into
    /// [`AdmissionStats::queued_by_priority`]).
    pub fn index(self) -> usize {
        self as usize
    }
}

impl FromStr for Priority {
    type Err = PriorityParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl fmt::Display for Priority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What admission knows of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ticket {
    /// The caller's identity for fairness and per-key limits: its API key,
    /// or [`ANONYMOUS`].
    pub key: String,
    pub priority: Priority,
    /// Prompt tokens + `max_tokens`: the most work the request can cause.
    pub cost: u64,
    /// When the request stops being worth starting.
    pub deadline: Instant,
}

/// Why a ticket was not admitted. Nothing was started for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum Shed {
    /// The caller's own key has as many tickets or tokens queued as it may:
    /// HTTP 429 with `Retry-After`. Other keys are still admitted.
    #[error("too many requests queued for this API key")]
    KeyLimit { retry_after: Duration },
    /// The whole queue is full, with nothing of a lower class to displace;
    /// or this ticket was queued and a higher-class one took its place:
    /// HTTP 503 with `Retry-After`.
    #[error("server overloaded: the admission queue is full")]
    QueueFull { retry_after: Duration },
    /// The deadline passed before a slot was free: HTTP 504. The request
    /// never reached a worker.
    #[error("the request deadline passed while it was queued")]
    Deadline,
    /// The coordinator is shutting down: HTTP 503, no `Retry-After` (try
    /// another coordinator).
    #[error("the coordinator is shutting down")]
    Closed,
}

impl Shed {
    /// How long the client should wait before trying again, when that is
    /// worth saying: whole seconds in [1, 60].
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Shed::KeyLimit { retry_after } | Shed::QueueFull { retry_after } => Some(*retry_after),
            Shed::Deadline | Shed::Closed => None,
        }
    }

    /// The HTTP status of the overload contract for this refusal.
    pub fn http_status(&self) -> StatusCode {
        match self {
            Shed::KeyLimit { .. } => StatusCode::TOO_MANY_REQUESTS,
            Shed::QueueFull { .. } | Shed::Closed => StatusCode::SERVICE_UNAVAILABLE,
            Shed::Deadline => StatusCode::GATEWAY_TIMEOUT,
        }
    }
}

/// What admission is doing now, for metrics. Reading it changes nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AdmissionStats {
    /// Slots held. May exceed `max_running` for a while after it is lowered.
    pub running: usize,
    pub max_running: usize,
    pub queued: usize,
    pub queued_tokens: u64,
    /// Queued tickets per class, indexed by [`Priority::index`].
    pub queued_by_priority: [usize; 3],
}

/// Where a queued ticket sits; the queue's order is this type's order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Place {
    priority: Priority,
    finish: u64,
    /// Arrival order, breaking ties.
    seq: u64,
}

/// How a queued ticket left the queue when someone else removed it: the
/// instant it was granted a slot, or why not. Plain data, so sending it
/// under the lock runs nothing.
type Verdict = Result<Instant, Shed>;

struct Entry {
    key: String,
    start: u64,
    cost: u64,
    deadline: Instant,
    tx: oneshot::Sender<Verdict>,
}

/// One key's share of the queue. Dropped when it has nothing queued, so
/// memory stays bounded by the queue, not by the number of keys ever seen.
struct KeyUse {
    queued: usize,
    tokens: u64,
    /// Finish tag of the key's last queued ticket, per class.
    last_finish: [u64; 3],
}

struct State {
    cfg: AdmissionConfig,
    running: usize,
    closed: bool,
    queue: BTreeMap<Place, Entry>,
    keys: HashMap<String, KeyUse>,
    /// Per class: the finish tag of the last ticket it dispatched.
    vtime: [u64; 3],
    queued_tokens: u64,
    queued_by_priority: [usize; 3],
    next_seq: u64,
    /// Average tokens per second one slot works through (cost / time
    /// held), or `None` before any slot came back.
    slot_rate: Option<f64>,
}

/// The admission queue. Share it as `Arc<Admission>`.
pub struct Admission {
    state: Mutex<State>,
}

/// A running slot. Dropping it frees the slot and dispatches the next
/// queued ticket. Hold it for as long as the request uses workers.
pub struct Slot {
    admission: Arc<Admission>,
    cost: u64,
    granted_at: Instant,
    queue_wait: Duration,
}

impl Slot {
    /// Time the ticket spent queued (zero when granted at once).
    pub fn queue_wait(&self) -> Duration {
        self.queue_wait
    }

    /// The ticket's cost.
    pub fn cost(&self) -> u64 {
        self.cost
    }
}

impl fmt::Debug for Slot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Slot").field("cost", &self.cost).field("queue_wait", &self.queue_wait).finish()
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.admission.release(Some((self.cost, self.granted_at.elapsed())));
    }
}

/// A queued ticket's side of the queue, inside the `admit` future. If the
/// future is dropped while it is armed, the ticket is withdrawn.
struct Waiter<'a> {
    admission: &'a Admission,
    place: Place,
    rx: oneshot::Receiver<Verdict>,
    armed: bool,
}

impl Drop for Waiter<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if let Some(Ok(_)) = self.admission.withdraw(self.place, &mut self.rx) {
            // Granted in the instant before the drop: the slot was never
            // used, so it goes back without a throughput sample.
            self.admission.release(None);
        }
    }
}

impl Admission {
    /// An empty queue with these limits.
    pub fn new(cfg: AdmissionConfig) -> Result<Arc<Self>, ConfigError> {
        cfg.validate()?;
        let state = State {
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
        };
        Ok(Arc::new(Self { state: Mutex::new(state) }))
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Admits `ticket`: a slot at once, a slot after queueing, or a refusal
    /// (see [`Shed`]). Nothing happens until the future is first polled;
    /// dropping it at any point withdraws the ticket without leaking a slot.
    /// Needs a tokio runtime with time enabled (the deadline is a timer).
    ///
    /// Token bounds limit what is already queued: a ticket is refused for
    /// tokens only when something is queued and it would take the total
    /// past the bound. So a ticket larger than a bound on its own still
    /// queues when its key (per-key bound) or the queue (global bound) has
    /// nothing queued; large requests are slow, never impossible. A full
    /// queue makes room for a ticket by shedding queued tickets of lower
    /// classes, last-placed first, when that is enough.
    pub async fn admit(self: &Arc<Self>, ticket: Ticket) -> Result<Slot, Shed> {
        let arrived = Instant::now();
        let (cost, deadline) = (ticket.cost, ticket.deadline);
        let (place, rx) = {
            let mut st = self.lock();
            if st.closed {
                return Err(Shed::Closed);
            }
            if deadline <= arrived {
                return Err(Shed::Deadline);
            }
            if st.running < st.cfg.max_running && !st.queued_at_or_above(ticket.priority) {
                st.running += 1;
                drop(st);
                return Ok(Slot { admission: Arc::clone(self), cost, granted_at: arrived, queue_wait: Duration::ZERO });
            }
            st.make_room(&ticket.key, ticket.priority, cost)?;
            st.enqueue(ticket)
        };
        let mut waiter = Waiter { admission: self, place, rx, armed: true };
        let verdict = match tokio::time::timeout_at(deadline, &mut waiter.rx).await {
            Ok(Ok(verdict)) => verdict,
            // Every removal by someone else sends a verdict first; a sender
            // dropped without one can only mean the queue is going away.
            Ok(Err(_)) => Err(Shed::Closed),
            // Still queued: withdrawn now. Removed an instant ago by someone
            // else: their verdict stands (a grant was made before the
            // deadline, as dispatch skips expired tickets).
            Err(_) => self.withdraw(place, &mut waiter.rx).unwrap_or(Err(Shed::Deadline)),
        };
        waiter.armed = false;
        verdict.map(|granted_at| Slot {
            admission: Arc::clone(self),
            cost,
            granted_at,
            queue_wait: granted_at.saturating_duration_since(arrived),
        })
    }

    /// Changes how many slots may run at once, as the cluster learns its
    /// workers' capacity. Raising it dispatches queued tickets at once;
    /// lowering it takes effect as running slots are dropped (none is
    /// revoked). 0 pauses dispatch: tickets queue until their deadline.
    pub fn set_max_running(&self, n: usize) {
        let mut st = self.lock();
        st.cfg.max_running = n;
        st.dispatch(Instant::now());
    }

    /// Stops admitting, for shutdown: every queued ticket and every later
    /// one gets [`Shed::Closed`]. Running slots are untouched; drain them
    /// by waiting for [`AdmissionStats::running`] to reach 0.
    pub fn close(&self) {
        let mut st = self.lock();
        st.closed = true;
        for (_, entry) in std::mem::take(&mut st.queue) {
            // A waiter that already went away has nothing to tell.
            let _ = entry.tx.send(Err(Shed::Closed));
        }
        st.keys.clear();
        st.queued_tokens = 0;
        st.queued_by_priority = [0; 3];
    }

    /// What admission is doing now, for metrics and for draining.
    pub fn stats(&self) -> AdmissionStats {
        let st = self.lock();
        AdmissionStats {
            running: st.running,
            max_running: st.cfg.max_running,
            queued: st.queue.len(),
            queued_tokens: st.queued_tokens,
            queued_by_priority: st.queued_by_priority,
        }
    }

    /// Gives back a running slot; `used` is (cost, time held) when the slot
    /// did work, for the throughput estimate.
    fn release(&self, used: Option<(u64, Duration)>) {
        let mut st = self.lock();
        st.running = st.running.saturating_sub(1);
        if let Some((cost, held)) = used {
            st.record_rate(cost, held);
        }
        st.dispatch(Instant::now());
    }

    /// Takes a queued ticket out of the queue (its waiter timed out or went
    /// away) and returns `None`; or, when someone else already removed it,
    /// returns their verdict. A grant returned here is a running slot the
    /// caller now owns.
    fn withdraw(&self, place: Place, rx: &mut oneshot::Receiver<Verdict>) -> Option<Verdict> {
        let mut st = self.lock();
        if st.remove(place, true).is_some() {
            return None;
        }
        // Removals send their verdict under this lock, so it is there now.
        Some(rx.try_recv().unwrap_or(Err(Shed::Closed)))
    }
}

/// Whether `cost` more would take `queued` past `limit`. Token bounds limit
/// what is already queued (see [`Admission::admit`]), so nothing is over
/// when nothing is queued.
fn over(queued: u64, cost: u64, limit: u64) -> bool {
    queued > 0 && queued.saturating_add(cost) > limit
}

impl State {
    fn queued_at_or_above(&self, priority: Priority) -> bool {
        self.queue.first_key_value().is_some_and(|(place, _)| place.priority <= priority)
    }

    /// Makes room to queue `cost` more for `key` in class `priority`, or
    /// says why not. The key's own bounds are checked first: a key over its
    /// share hears that it is the one to slow down. When the whole queue is
    /// full, the last-placed tickets of lower classes are shed (with
    /// [`Shed::QueueFull`]) if that makes enough room; otherwise nothing is.
    fn make_room(&mut self, key: &str, priority: Priority, cost: u64) -> Result<(), Shed> {
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
    /// tokens over (per-slot rate x slots), whole seconds in [1, 60]; 1 s
    /// before any slot has come back. It errs long rather than short, so
    /// retries do not arrive before there is room.
    fn retry_after(&self) -> Duration {
        let Some(rate) = self.slot_rate else {
            return Duration::from_secs(1);
        };
        let per_second = rate * self.cfg.max_running.max(1) as f64;
        let secs = (self.queued_tokens as f64 / per_second).ceil();
        let secs = if secs.is_finite() { secs.clamp(RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S) } else { RETRY_AFTER_MAX_S };
        Duration::from_secs(secs as u64)
    }

    fn record_rate(&mut self, cost: u64, held: Duration) {
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

    fn enqueue(&mut self, ticket: Ticket) -> (Place, oneshot::Receiver<Verdict>) {
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
    fn remove(&mut self, place: Place, withdrawn: bool) -> Option<Entry> {
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
    fn dispatch(&mut self, now: Instant) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::FutureExt;
    use std::future::Future;
    use std::pin::Pin;

    type Admit<'a> = Pin<Box<dyn Future<Output = Result<Slot, Shed>> + 'a>>;

    fn admission(cfg: AdmissionConfig) -> Arc<Admission> {
        Admission::new(cfg).expect("valid config")
    }

    fn running(max_running: usize) -> AdmissionConfig {
        AdmissionConfig { max_running, ..AdmissionConfig::default() }
    }

    fn ticket(key: &str, priority: Priority, cost: u64) -> Ticket {
        Ticket { key: key.into(), priority, cost, deadline: Instant::now() + Duration::from_secs(60) }
    }

    fn admit(a: &Arc<Admission>, t: Ticket) -> Admit<'_> {
        Box::pin(a.admit(t))
    }

    /// Polls once; `None` while the ticket waits. Unconstrained: these
    /// tests poll many futures from one task, and tokio's cooperative
    /// budget would otherwise report a delivered verdict as pending.
    fn poll(f: &mut Admit<'_>) -> Option<Result<Slot, Shed>> {
        tokio::task::unconstrained(f.as_mut()).now_or_never()
    }

    /// The refusal when `t` is refused at once.
    fn shed(a: &Arc<Admission>, t: Ticket) -> Option<Shed> {
        poll(&mut admit(a, t)).and_then(|r| r.err())
    }

    fn granted(a: &Arc<Admission>, t: Ticket) -> Slot {
        match poll(&mut admit(a, t)) {
            Some(Ok(slot)) => slot,
            other => panic!("expected a slot at once, got {other:?}"),
        }
    }

    fn queued(a: &Arc<Admission>, t: Ticket) -> Admit<'_> {
        let mut f = admit(a, t);
        if let Some(r) = poll(&mut f) {
            panic!("expected the ticket to queue, got {r:?}");
        }
        f
    }

    /// Polls every waiter once; returns the names of those that got a
    /// slot (kept in `slots`), in the order given.
    fn settle(waiting: &mut Vec<(&'static str, Admit<'_>)>, slots: &mut Vec<Slot>) -> Vec<&'static str> {
        let mut got = Vec::new();
        waiting.retain_mut(|(name, f)| match poll(f) {
            None => true,
            Some(Ok(slot)) => {
                slots.push(slot);
                got.push(*name);
                false
            }
            Some(Err(e)) => panic!("{name}: unexpected {e:?}"),
        });
        got
    }

    /// The counters agree with the live entries, empty keys are gone, and
    /// no slot is free while tickets wait.
    fn check(a: &Admission) {
        let st = a.lock();
        let mut tokens = 0;
        let mut by_priority = [0; 3];
        let mut keys: HashMap<&str, (usize, u64)> = HashMap::new();
        for (place, e) in &st.queue {
            tokens += e.cost;
            by_priority[place.priority.index()] += 1;
            let k = keys.entry(e.key.as_str()).or_default();
            k.0 += 1;
            k.1 += e.cost;
        }
        assert_eq!(tokens, st.queued_tokens, "queued tokens");
        assert_eq!(by_priority, st.queued_by_priority, "queued by priority");
        assert_eq!(keys.len(), st.keys.len(), "keys with nothing queued are dropped");
        for (k, (n, t)) in keys {
            let used = st.keys.get(k).map(|u| (u.queued, u.tokens));
            assert_eq!(used, Some((n, t)), "key {k}");
        }
        assert!(st.queue.is_empty() || st.running >= st.cfg.max_running, "a slot is free while tickets wait");
    }

    #[test]
    fn config_defaults_are_valid_and_zero_limits_name_their_field() {
        assert_eq!(AdmissionConfig::default().validate(), Ok(()));
        let d = AdmissionConfig::default;
        for (field, cfg) in [
            ("max_running", AdmissionConfig { max_running: 0, ..d() }),
            ("max_queued", AdmissionConfig { max_queued: 0, ..d() }),
            ("max_queued_tokens", AdmissionConfig { max_queued_tokens: 0, ..d() }),
            ("per_key_max_queued", AdmissionConfig { per_key_max_queued: 0, ..d() }),
            ("per_key_max_queued_tokens", AdmissionConfig { per_key_max_queued_tokens: 0, ..d() }),
        ] {
            assert_eq!(cfg.validate(), Err(ConfigError::Zero { field }));
            assert_eq!(Admission::new(cfg).err(), Some(ConfigError::Zero { field }));
        }
    }

    #[test]
    fn priority_parses_names_in_any_case_and_nothing_else() {
        assert_eq!(Priority::parse("high"), Ok(Priority::High));
        assert_eq!(Priority::parse("NORMAL"), Ok(Priority::Normal));
        assert_eq!("Low".parse::<Priority>(), Ok(Priority::Low));
        for bad in ["0", "2", "urgent", "", " high"] {
            assert_eq!(Priority::parse(bad), Err(PriorityParseError(bad.into())));
        }
        assert_eq!(Priority::default(), Priority::Normal);
        assert!(Priority::High < Priority::Normal && Priority::Normal < Priority::Low);
        for (i, p) in Priority::ALL.into_iter().enumerate() {
            assert_eq!(p.index(), i);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn grants_at_once_under_capacity_and_queues_when_full() {
        let a = admission(running(2));
        let s1 = granted(&a, ticket("a", Priority::Normal, 10));
        let s2 = granted(&a, ticket("b", Priority::Low, 10));
        assert_eq!((s1.queue_wait(), s2.cost()), (Duration::ZERO, 10));
        let f = queued(&a, ticket("c", Priority::High, 10));
        let s = a.stats();
        assert_eq!((s.running, s.queued, s.queued_tokens, s.queued_by_priority), (2, 1, 10, [1, 0, 0]));
        // The future must be Send to run in the frontends' tasks.
        fn assert_send<T: Send>(_: &T) {}
        assert_send(&a.admit(ticket("d", Priority::Normal, 1)));
        drop((f, s1, s2));
        assert_eq!(a.stats(), AdmissionStats { max_running: 2, ..AdmissionStats::default() });
        check(&a);
    }

    #[tokio::test(start_paused = true)]
    async fn dispatches_in_arrival_order_on_slot_drop() {
        let a = admission(running(1));
        let mut slots = vec![granted(&a, ticket("h", Priority::Normal, 10))];
        let mut waiting: Vec<_> = ["x", "y", "z"].map(|k| (k, queued(&a, ticket(k, Priority::Normal, 100)))).into();
        let mut order = Vec::new();
        while !slots.is_empty() {
            slots.remove(0);
            order.extend(settle(&mut waiting, &mut slots));
            check(&a);
        }
        assert_eq!(order, ["x", "y", "z"]);
        let holder = granted(&a, ticket("h", Priority::Normal, 1));
        let mut w = vec![("w", queued(&a, ticket("w", Priority::Normal, 1)))];
        tokio::time::advance(Duration::from_millis(7)).await;
        drop(holder);
        assert_eq!(settle(&mut w, &mut slots), ["w"]);
        assert_eq!(slots.iter().map(Slot::queue_wait).collect::<Vec<_>>(), [Duration::from_millis(7)]);
    }

    #[tokio::test(start_paused = true)]
    async fn higher_classes_go_first() {
        let a = admission(running(1));
        let mut slots = vec![granted(&a, ticket("h", Priority::Low, 1))];
        let mut waiting = vec![
            ("low", queued(&a, ticket("a", Priority::Low, 1))),
            ("normal", queued(&a, ticket("a", Priority::Normal, 1000))),
            ("high", queued(&a, ticket("b", Priority::High, 5000))),
        ];
        assert_eq!(a.stats().queued_by_priority, [1, 1, 1]);
        let mut order = Vec::new();
        while !slots.is_empty() {
            slots.remove(0);
            order.extend(settle(&mut waiting, &mut slots));
        }
        assert_eq!(order, ["high", "normal", "low"]);
    }

    #[tokio::test(start_paused = true)]
    async fn small_requests_are_not_starved_by_a_key_with_large_ones() {
        let a = admission(running(1));
        let mut slots = vec![granted(&a, ticket("h", Priority::Normal, 1))];
        let mut waiting = Vec::new();
        for _ in 0..10 {
            waiting.push(("A", queued(&a, ticket("A", Priority::Normal, 1000))));
        }
        for _ in 0..10 {
            waiting.push(("B", queued(&a, ticket("B", Priority::Normal, 100))));
        }
        let mut order = Vec::new();
        while !slots.is_empty() {
            slots.remove(0);
            order.extend(settle(&mut waiting, &mut slots));
        }
        assert_eq!(order.len(), 20, "everyone is served");
        let b_early = order[..8].iter().filter(|k| **k == "B").count();
        assert_eq!(b_early, 8, "B's small tickets go first, order {order:?}");
        check(&a);
    }

    /// Serves `waiting` one slot at a time from `slots`; the order served.
    fn serve(n: usize, waiting: &mut Vec<(&'static str, Admit<'_>)>, slots: &mut Vec<Slot>) -> Vec<&'static str> {
        let mut order = Vec::new();
        while order.len() < n && !slots.is_empty() {
            slots.remove(0);
            order.extend(settle(waiting, slots));
        }
        order
    }

    #[tokio::test(start_paused = true)]
    async fn a_large_request_is_not_starved_by_many_small_ones() {
        // Fairness is by cost, not shortest-first: B's small tickets arrived
        // first, yet A's one larger ticket goes once B has had about as much.
        let a = admission(running(1));
        let mut slots = vec![granted(&a, ticket("h", Priority::Normal, 1))];
        let mut waiting = Vec::new();
        for _ in 0..10 {
            waiting.push(("B", queued(&a, ticket("B", Priority::Normal, 100))));
        }
        waiting.push(("A", queued(&a, ticket("A", Priority::Normal, 300))));
        let order = serve(11, &mut waiting, &mut slots);
        assert_eq!(order[..4], ["B", "B", "B", "A"], "order {order:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_late_key_gets_its_share_not_a_head_start() {
        // B starts at the class's virtual time, so it shares with A from
        // where A is, instead of being owed everything A got before.
        let a = admission(running(1));
        let mut slots = vec![granted(&a, ticket("h", Priority::Normal, 1))];
        let mut waiting = Vec::new();
        for _ in 0..10 {
            waiting.push(("A", queued(&a, ticket("A", Priority::Normal, 100))));
        }
        assert_eq!(serve(5, &mut waiting, &mut slots), ["A"; 5]);
        for _ in 0..5 {
            waiting.push(("B", queued(&a, ticket("B", Priority::Normal, 100))));
        }
        assert_eq!(serve(4, &mut waiting, &mut slots), ["A", "B", "A", "B"]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_withdrawn_ticket_gives_back_its_place_in_line() {
        let a = admission(running(1));
        let mut slots = vec![granted(&a, ticket("h", Priority::Normal, 1))];
        let mut waiting = vec![("x", queued(&a, ticket("A", Priority::Normal, 100)))];
        let gone = queued(&a, ticket("A", Priority::Normal, 1000));
        waiting.push(("b", queued(&a, ticket("B", Priority::Normal, 500))));
        drop(gone);
        // Without the withdrawn 1,000 tokens ahead of it, z finishes at 200.
        waiting.push(("z", queued(&a, ticket("A", Priority::Normal, 100))));
        assert_eq!(serve(3, &mut waiting, &mut slots), ["x", "z", "b"]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_key_over_its_share_is_refused_while_others_get_in() {
        let cfg = AdmissionConfig { per_key_max_queued: 2, per_key_max_queued_tokens: 1000, ..running(1) };
        let a = admission(cfg);
        let _holder = granted(&a, ticket("h", Priority::Normal, 1));
        let _a1 = queued(&a, ticket("a", Priority::Normal, 100));
        let _a2 = queued(&a, ticket("a", Priority::Low, 100));
        let refused = shed(&a, ticket("a", Priority::High, 1));
        assert_eq!(refused, Some(Shed::KeyLimit { retry_after: Duration::from_secs(1) }), "by count");
        let _b1 = queued(&a, ticket("b", Priority::Normal, 900));
        let refused = shed(&a, ticket("b", Priority::Normal, 200));
        assert_eq!(refused.map(|s| s.http_status()), Some(StatusCode::TOO_MANY_REQUESTS), "by tokens");
        let _c1 = queued(&a, ticket("c", Priority::Normal, 1000));
        assert_eq!(a.stats().queued, 4);
        check(&a);
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_queue_refuses_its_own_class_and_above() {
        let cfg = AdmissionConfig { max_queued: 3, max_queued_tokens: 1000, ..running(1) };
        let a = admission(cfg);
        let _holder = granted(&a, ticket("h", Priority::Normal, 1));
        let _w = [queued(&a, ticket("a", Priority::Normal, 600)), queued(&a, ticket("b", Priority::Normal, 300))];
        let refused = shed(&a, ticket("c", Priority::Normal, 200));
        assert_eq!(refused, Some(Shed::QueueFull { retry_after: Duration::from_secs(1) }), "by tokens");
        let _c = queued(&a, ticket("c", Priority::Normal, 100));
        let refused = shed(&a, ticket("d", Priority::Low, 1));
        assert_eq!(refused.map(|s| s.http_status()), Some(StatusCode::SERVICE_UNAVAILABLE), "by count");
        check(&a);
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_queue_sheds_lower_classes_to_make_room() {
        let cfg = AdmissionConfig { max_queued: 3, max_queued_tokens: 1000, ..running(1) };
        let a = admission(cfg);
        let _holder = granted(&a, ticket("h", Priority::Normal, 1));
        let mut low1 = queued(&a, ticket("a", Priority::Low, 100));
        let mut low2 = queued(&a, ticket("b", Priority::Low, 100));
        let _normal = queued(&a, ticket("c", Priority::Normal, 700));
        let _high = queued(&a, ticket("d", Priority::High, 150));
        let displaced = poll(&mut low2).and_then(|r| r.err());
        assert_eq!(displaced, Some(Shed::QueueFull { retry_after: Duration::from_secs(1) }), "last-placed Low");
        assert!(poll(&mut low1).is_none(), "one was enough");
        // Shedding low1 would not make room for 300 tokens: nothing is shed.
        assert!(matches!(shed(&a, ticket("e", Priority::Normal, 300)), Some(Shed::QueueFull { .. })));
        assert!(poll(&mut low1).is_none(), "shed for nothing");
        let _n2 = queued(&a, ticket("e", Priority::Normal, 100));
        assert!(matches!(poll(&mut low1).and_then(|r| r.err()), Some(Shed::QueueFull { .. })));
        assert_eq!(a.stats().queued_by_priority, [1, 2, 0]);
        check(&a);
    }

    #[tokio::test(start_paused = true)]
    async fn a_ticket_larger_than_a_bound_queues_alone() {
        let cfg = AdmissionConfig { max_queued_tokens: 1000, per_key_max_queued_tokens: 500, ..running(1) };
        let a = admission(cfg);
        let holder = granted(&a, ticket("h", Priority::Normal, 1));
        let mut big = queued(&a, ticket("a", Priority::Normal, 5000));
        let refused = shed(&a, ticket("a", Priority::Normal, 1));
        assert!(matches!(refused, Some(Shed::KeyLimit { .. })), "{refused:?}");
        let refused = shed(&a, ticket("b", Priority::Normal, 1));
        assert!(matches!(refused, Some(Shed::QueueFull { .. })), "{refused:?}");
        drop(holder);
        let running = poll(&mut big);
        assert!(matches!(running, Some(Ok(_))), "the large ticket runs: {running:?}");
        let _next = queued(&a, ticket("b", Priority::Normal, 3000));
    }

    #[tokio::test(start_paused = true)]
    async fn deadline_in_queue_sheds_and_restores_accounting() {
        let a = admission(running(1));
        let holder = granted(&a, ticket("h", Priority::Normal, 1));
        let t = Ticket { deadline: Instant::now() + Duration::from_millis(100), ..ticket("a", Priority::Normal, 700) };
        let mut f = queued(&a, t);
        assert_eq!((a.stats().queued, a.stats().queued_tokens), (1, 700));
        tokio::time::advance(Duration::from_millis(99)).await;
        assert!(poll(&mut f).is_none(), "not yet");
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(poll(&mut f).map(|r| r.err()), Some(Some(Shed::Deadline)));
        assert_eq!(a.stats(), AdmissionStats { running: 1, max_running: 1, ..AdmissionStats::default() });
        check(&a);
        drop(holder);
        let late = Ticket { deadline: Instant::now(), ..ticket("b", Priority::Normal, 1) };
        let refused = shed(&a, late);
        assert_eq!(refused, Some(Shed::Deadline), "a passed deadline is refused even with a free slot");
    }

    #[tokio::test(start_paused = true)]
    async fn an_expired_ticket_is_skipped_at_dispatch() {
        let a = admission(running(1));
        let holder = granted(&a, ticket("h", Priority::Normal, 1));
        let t = Ticket { deadline: Instant::now() + Duration::from_millis(50), ..ticket("a", Priority::High, 1) };
        let mut expired = queued(&a, t);
        let mut next = queued(&a, ticket("b", Priority::Normal, 1));
        tokio::time::advance(Duration::from_millis(50)).await;
        // The expired ticket's waiter has not run yet; the free slot must
        // go past it.
        drop(holder);
        assert!(matches!(poll(&mut next), Some(Ok(_))));
        assert_eq!(poll(&mut expired).map(|r| r.err()), Some(Some(Shed::Deadline)));
        assert_eq!(a.stats().queued, 0);
        check(&a);
    }

    #[tokio::test(start_paused = true)]
    async fn a_dropped_waiter_restores_accounting_and_does_not_block_the_next() {
        let a = admission(running(1));
        let holder = granted(&a, ticket("h", Priority::Normal, 1));
        let gone = queued(&a, ticket("a", Priority::Normal, 500));
        let mut next = queued(&a, ticket("b", Priority::Normal, 20));
        drop(gone);
        assert_eq!((a.stats().queued, a.stats().queued_tokens), (1, 20));
        check(&a);
        drop(holder);
        assert!(matches!(poll(&mut next), Some(Ok(_))));
    }

    #[tokio::test(start_paused = true)]
    async fn a_slot_granted_to_a_dropped_waiter_is_given_back() {
        let a = admission(running(1));
        let holder = granted(&a, ticket("h", Priority::Normal, 1));
        let first = queued(&a, ticket("a", Priority::Normal, 1));
        let mut second = queued(&a, ticket("b", Priority::Normal, 1));
        drop(holder);
        // `first` has its grant but was never polled again: the client left.
        drop(first);
        let slot = poll(&mut second);
        assert!(matches!(slot, Some(Ok(_))), "the slot moves on: {slot:?}");
        assert_eq!(a.stats().running, 1);
        drop(slot);
        assert_eq!(a.stats().running, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn raising_capacity_dispatches_and_lowering_it_lets_running_ones_finish() {
        let a = admission(running(1));
        let mut slots = vec![granted(&a, ticket("h", Priority::Normal, 1))];
        let mut waiting = vec![
            ("x", queued(&a, ticket("x", Priority::Normal, 1))),
            ("y", queued(&a, ticket("y", Priority::Normal, 1))),
            ("z", queued(&a, ticket("z", Priority::Normal, 1))),
        ];
        a.set_max_running(3);
        assert_eq!(settle(&mut waiting, &mut slots), ["x", "y"]);
        a.set_max_running(1);
        assert_eq!(a.stats().running, 3, "nothing is revoked");
        for left in [2, 1] {
            slots.pop();
            assert!(settle(&mut waiting, &mut slots).is_empty());
            assert_eq!(a.stats().running, left);
        }
        slots.pop();
        assert_eq!(settle(&mut waiting, &mut slots), ["z"]);
        check(&a);
    }

    #[tokio::test(start_paused = true)]
    async fn close_refuses_queued_and_new_tickets() {
        let a = admission(running(1));
        let holder = granted(&a, ticket("h", Priority::Normal, 1));
        let mut f = queued(&a, ticket("a", Priority::High, 10));
        a.close();
        assert_eq!(poll(&mut f).map(|r| r.err()), Some(Some(Shed::Closed)));
        let refused = shed(&a, ticket("b", Priority::High, 1));
        assert_eq!(refused, Some(Shed::Closed));
        assert_eq!((a.stats().running, a.stats().queued, a.stats().queued_tokens), (1, 0, 0));
        drop(holder);
        assert_eq!(a.stats().running, 0, "running slots drain normally");
        check(&a);
    }

    #[tokio::test(start_paused = true)]
    async fn retry_after_is_queued_tokens_over_measured_throughput() {
        let a = admission(AdmissionConfig { max_queued: 1, ..running(1) });
        let done = granted(&a, ticket("h", Priority::Normal, 1000));
        tokio::time::advance(Duration::from_secs(1)).await;
        drop(done); // 1,000 tokens per second per slot.
        let _holder = granted(&a, ticket("h", Priority::Normal, 1));
        let mut f = queued(&a, ticket("a", Priority::Normal, 4500));
        let refused = shed(&a, ticket("b", Priority::Normal, 1));
        assert_eq!(refused.and_then(|s| s.retry_after()), Some(Duration::from_secs(5)));
        drop(f);
        f = queued(&a, ticket("a", Priority::Normal, 100_000));
        let refused = shed(&a, ticket("b", Priority::Normal, 1));
        assert_eq!(refused.and_then(|s| s.retry_after()), Some(Duration::from_secs(60)), "clamped");
        drop(f);
    }

    /// xorshift64: a seeded, dependency-free source of test sequences.
    struct Rng(u64);

    impl Rng {
        fn below(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % n
        }
    }

    struct Waiting<'a> {
        ticket: Ticket,
        arrived: Instant,
        fut: Admit<'a>,
    }

    /// Random admits, slot drops, cancellations (some right after a grant,
    /// before the waiter runs), time steps (some followed by a slot drop
    /// before expired waiters run) and capacity changes; after each
    /// step the counters must match a model built from the live futures.
    async fn random_run(seed: u64) {
        let cfg = AdmissionConfig {
            max_running: 2,
            max_queued: 6,
            max_queued_tokens: 3000,
            per_key_max_queued: 3,
            per_key_max_queued_tokens: 1500,
        };
        let a = admission(cfg.clone());
        let mut rng = Rng(seed);
        let mut max_running = cfg.max_running;
        let mut slots: Vec<Slot> = Vec::new();
        let mut waiting: Vec<Waiting<'_>> = Vec::new();
        for step in 0..400 {
            let before = a.stats();
            // The class of a ticket that may have displaced queued ones.
            let mut displacing = None;
            match rng.below(10) {
                0..=3 => {
                    let t = Ticket {
                        key: format!("k{}", rng.below(4)),
                        priority: Priority::ALL[rng.below(3) as usize],
                        cost: 1 + rng.below(1200),
                        deadline: Instant::now() + Duration::from_millis(1 + rng.below(200)),
                    };
                    let mine = waiting.iter().filter(|w| w.ticket.key == t.key);
                    let (kn, kt) = mine.fold((0, 0), |(n, c), w| (n + 1, c + w.ticket.cost));
                    let key_over =
                        kn >= cfg.per_key_max_queued || (kt > 0 && kt + t.cost > cfg.per_key_max_queued_tokens);
                    let all_over = |n: usize, tokens: u64| {
                        n >= cfg.max_queued || (tokens > 0 && tokens + t.cost > cfg.max_queued_tokens)
                    };
                    let lower = waiting.iter().filter(|w| w.ticket.priority > t.priority);
                    let (ln, lt) = lower.fold((0, 0), |(n, c), w| (n + 1, c + w.ticket.cost));
                    // Room that shedding every lower-class ticket would make.
                    let no_room = all_over(before.queued - ln, before.queued_tokens - lt);
                    let would_displace = all_over(before.queued, before.queued_tokens).then_some(t.priority);
                    let full = before.running >= max_running;
                    let mut fut = admit(&a, t.clone());
                    match poll(&mut fut) {
                        Some(Ok(slot)) => {
                            assert!(!full, "seed {seed} step {step}: granted past capacity");
                            slots.push(slot);
                        }
                        Some(Err(Shed::KeyLimit { .. })) => assert!(full && key_over, "seed {seed} step {step}"),
                        Some(Err(Shed::QueueFull { .. })) => {
                            assert!(full && !key_over && no_room, "seed {seed} step {step}")
                        }
                        Some(Err(e)) => panic!("seed {seed} step {step}: unexpected {e:?}"),
                        None => {
                            assert!(full && !key_over && !no_room, "seed {seed} step {step}: queued");
                            displacing = would_displace;
                            waiting.push(Waiting { ticket: t, arrived: Instant::now(), fut });
                        }
                    }
                }
                4..=5 if !slots.is_empty() => drop(slots.swap_remove(rng.below(slots.len() as u64) as usize)),
                6 => {
                    if !slots.is_empty() {
                        drop(slots.swap_remove(rng.below(slots.len() as u64) as usize));
                    }
                    if !waiting.is_empty() {
                        drop(waiting.swap_remove(rng.below(waiting.len() as u64) as usize));
                    }
                }
                7..=8 => {
                    tokio::time::advance(Duration::from_millis(rng.below(80))).await;
                    // A slot freed before the expired waiters run: dispatch
                    // must pass over them.
                    if rng.below(2) == 0 && !slots.is_empty() {
                        drop(slots.swap_remove(rng.below(slots.len() as u64) as usize));
                    }
                }
                9 => {
                    max_running = 1 + rng.below(3) as usize;
                    a.set_max_running(max_running);
                }
                _ => {}
            }
            let now = Instant::now();
            waiting.retain_mut(|w| match poll(&mut w.fut) {
                None => true,
                Some(Ok(slot)) => {
                    assert!(slot.queue_wait() < w.ticket.deadline - w.arrived, "seed {seed}: granted after deadline");
                    slots.push(slot);
                    false
                }
                Some(Err(Shed::Deadline)) => {
                    assert!(now >= w.ticket.deadline, "seed {seed}: shed before its deadline");
                    false
                }
                Some(Err(Shed::QueueFull { .. })) => {
                    let by = displacing.expect("displaced only by a ticket queued into a full queue");
                    assert!(w.ticket.priority > by, "seed {seed} step {step}: displaced by {by:?}");
                    false
                }
                Some(Err(e)) => panic!("seed {seed} step {step}: unexpected {e:?}"),
            });
            let s = a.stats();
            assert_eq!(s.running, slots.len(), "seed {seed} step {step}: running");
            assert!(s.running <= before.running || s.running <= max_running, "seed {seed} step {step}: over capacity");
            assert_eq!(s.queued, waiting.len(), "seed {seed} step {step}: queued");
            assert_eq!(s.queued_tokens, waiting.iter().map(|w| w.ticket.cost).sum::<u64>());
            let mut by_priority = [0; 3];
            waiting.iter().for_each(|w| by_priority[w.ticket.priority.index()] += 1);
            assert_eq!(s.queued_by_priority, by_priority, "seed {seed} step {step}");
            check(&a);
        }
        drop(waiting);
        drop(slots);
        assert_eq!(a.stats(), AdmissionStats { max_running, ..AdmissionStats::default() }, "seed {seed}: all back");
        assert!(a.lock().keys.is_empty(), "seed {seed}: no key state left");
    }

    #[tokio::test(start_paused = true)]
    async fn random_sequences_keep_the_books_straight() {
        for seed in 1..=25 {
            random_run(seed).await;
        }
    }
}
