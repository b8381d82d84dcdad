//! The coordinator's admission queue: who runs now, who waits, and who is
//! refused at once. This is the cluster's overload contract.
//!
//! A request arrives as a [`Ticket`] (API key, priority class, token cost,
//! deadline). [`Admission::admit`] grants it a running [`Seat`] at once when
//! one is free and nobody of its class or above is waiting; otherwise it
//! queues, bounded four ways (entries and tokens, in all and per key), and a
//! ticket beyond a bound is shed at once with a `Retry-After` estimate:
//! its own key's bound gives [`Shed::KeyLimit`] (429), the whole queue's
//! [`Shed::QueueFull`] (503). A queued ticket leaves with a slot, with
//! [`Shed::Deadline`] when its deadline passes first (it never reaches a
//! worker), with [`Shed::QueueFull`] when a ticket of a higher class needs
//! its place in a full queue, or with [`Shed::Closed`] at shutdown. Dropping
//! a [`Seat`] frees it for the next ticket.
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

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::Instant;

mod config;
mod queue;
mod retry;
mod ticket;

pub use config::{AdmissionConfig, ConfigError};
pub use retry::{retry_after, BASE as RETRY_AFTER_BASE, JITTER as RETRY_AFTER_JITTER};
pub use ticket::{Shed, Ticket};

use queue::{Place, State, Verdict};

/// The key of a request that carries no API key.
pub const ANONYMOUS: &str = "anonymous";

/// What admission is doing now, for metrics. Reading it changes nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AdmissionStats {
    /// Slots held. May exceed `max_running` for a while after it is lowered.
    pub running: usize,
    pub max_running: usize,
    pub queued: usize,
    pub queued_tokens: u64,
    /// Queued tickets per class, indexed by [`Priority::index`](types::priority::Priority::index).
    pub queued_by_priority: [usize; 3],
}

/// The admission queue. Share it as `Arc<Admission>`.
pub struct Admission {
    state: Mutex<State>,
}

/// A running slot. Dropping it frees the slot and dispatches the next
/// queued ticket. Hold it for as long as the request uses workers.
pub struct Seat {
    admission: Arc<Admission>,
    cost: u64,
    granted_at: Instant,
    queue_wait: Duration,
}

impl Seat {
    /// Time the ticket spent queued (zero when granted at once).
    pub fn queue_wait(&self) -> Duration {
        self.queue_wait
    }

    /// The ticket's cost.
    pub fn cost(&self) -> u64 {
        self.cost
    }
}

impl fmt::Debug for Seat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Seat").field("cost", &self.cost).field("queue_wait", &self.queue_wait).finish()
    }
}

impl Drop for Seat {
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
        Ok(Arc::new(Self { state: Mutex::new(State::new(cfg)) }))
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
    pub async fn admit(self: &Arc<Self>, ticket: Ticket) -> Result<Seat, Shed> {
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
                return Ok(Seat { admission: Arc::clone(self), cost, granted_at: arrived, queue_wait: Duration::ZERO });
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
        verdict.map(|granted_at| Seat {
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

    /// Whether [`Admission::close`] was called (the coordinator is draining).
    pub fn is_closed(&self) -> bool {
        self.lock().closed
    }

    /// How long the queue takes to drain at the throughput measured so
    /// far (whole seconds in [1, 60]); `None` before any slot came back.
    /// The estimate behind `Retry-After` where the refusal is about load.
    pub fn drain_estimate(&self) -> Option<Duration> {
        self.lock().drain_estimate()
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

#[cfg(test)]
mod tests;
