//! Cost of an admission decision, against a baseline measured in the same
//! run. `cargo bench -p coordinator --bench admission`.
//!
//! Paths timed, 100,000 operations each, 1,000 distinct keys:
//! - immediate: `admit` finds a free slot (the queue is then empty by
//!   construction), plus dropping the slot;
//! - queued: with every slot held and ~500 tickets queued, `admit` queues
//!   a ticket, the oldest slot is dropped (dispatching the head of the
//!   queue), and the granted waiter is polled to its slot: one full trip;
//! - cancel: `admit` queues a ticket and the client goes away;
//! - baseline: an uncontended tokio `Semaphore::try_acquire` + release.
//!
//! Futures are polled by hand with wakers that record who was woken, so
//! no scheduler cost is mixed into the numbers.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]
#![allow(clippy::disallowed_types, reason = "measures wall time on purpose (std::time::Instant)")]
#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::error::Error;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant as Clock};
use types::priority::Priority;

use coordinator::admission::{Admission, AdmissionConfig, Seat, Shed, Ticket};
use tokio::sync::Semaphore;
use tokio::time::Instant;
use types::rng::XorShift64;

const KEYS: u64 = 1000;
const QUEUED: usize = 500;
const RUNNING: usize = 64;
const OPS: usize = 100_000;
const WARMUP: usize = 10_000;

type Admit<'a> = Pin<Box<dyn Future<Output = Result<Seat, Shed>> + 'a>>;

/// Polls once, outside tokio's cooperative budget: this bench polls many
/// futures from one task, and the budget would otherwise turn a delivered
/// grant into a spurious wake-up after 128 of them.
fn poll_once<F: Future + ?Sized>(fut: Pin<&mut F>, waker: &Waker) -> Poll<F::Output> {
    let mut fut = tokio::task::unconstrained(fut);
    Pin::new(&mut fut).poll(&mut Context::from_waker(waker))
}

/// Records the waiter a dispatch woke.
struct Wakeup {
    id: usize,
    woken: Arc<Mutex<Vec<usize>>>,
}

impl Wake for Wakeup {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.lock().unwrap_or_else(|e| e.into_inner()).push(self.id);
    }
}

/// Reproducible keys and classes.
struct Rng(XorShift64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0.below(n)
    }

    /// A ticket from one of `KEYS` keys; mostly Normal, some High and Low.
    fn ticket(&mut self) -> Ticket {
        let priority = match self.below(10) {
            0 => Priority::High,
            1 => Priority::Low,
            _ => Priority::Normal,
        };
        Ticket {
            key: format!("key-{}", self.below(KEYS)),
            priority,
            cost: 100 + self.below(4000),
            deadline: Instant::now() + Duration::from_secs(3600),
        }
    }
}

struct Summary {
    p50: f64,
    p99: f64,
}

fn summarize(name: &str, mut ns: Vec<u64>) -> Summary {
    ns.sort_unstable();
    let at = |q: usize| ns.get(ns.len() * q / 100).copied().unwrap_or(0) as f64 / 1000.0;
    let s = Summary { p50: at(50), p99: at(99) };
    println!("{name:<10} p50 {:>7.3} us   p99 {:>7.3} us   ({} ops)", s.p50, s.p99, ns.len());
    s
}

fn baseline() -> Vec<u64> {
    let sem = Semaphore::new(RUNNING);
    let mut ns = Vec::with_capacity(OPS);
    for i in 0..WARMUP + OPS {
        let t0 = Clock::now();
        let permit = sem.try_acquire();
        drop(permit);
        if i >= WARMUP {
            ns.push(t0.elapsed().as_nanos() as u64);
        }
    }
    ns
}

fn immediate(rng: &mut Rng) -> Result<Vec<u64>, Box<dyn Error>> {
    let adm = Admission::new(AdmissionConfig { max_running: RUNNING, ..AdmissionConfig::default() })?;
    let noop = Waker::noop();
    let mut ns = Vec::with_capacity(OPS);
    for i in 0..WARMUP + OPS {
        let ticket = rng.ticket();
        let t0 = Clock::now();
        let Poll::Ready(Ok(slot)) = poll_once(std::pin::pin!(adm.admit(ticket)), noop) else {
            return Err("immediate path: no slot at once".into());
        };
        drop(slot);
        if i >= WARMUP {
            ns.push(t0.elapsed().as_nanos() as u64);
        }
    }
    Ok(ns)
}

/// Waiters by id, with the waker that reports each one's id.
struct Waiters<'a> {
    slots: Vec<Option<(Admit<'a>, Waker)>>,
    free: Vec<usize>,
    woken: Arc<Mutex<Vec<usize>>>,
}

impl<'a> Waiters<'a> {
    /// Polls a new admit once; it must queue.
    fn push(&mut self, fut: Admit<'a>) -> Result<(), Box<dyn Error>> {
        let id = self.free.pop().unwrap_or(self.slots.len());
        if id == self.slots.len() {
            self.slots.push(None);
        }
        let waker = Waker::from(Arc::new(Wakeup { id, woken: Arc::clone(&self.woken) }));
        let mut fut = fut;
        if poll_once(fut.as_mut(), &waker).is_ready() {
            return Err("queued path: the ticket did not queue".into());
        }
        self.slots[id] = Some((fut, waker));
        Ok(())
    }

    /// Polls the woken waiters to their slots.
    fn collect(&mut self, held: &mut VecDeque<Seat>) -> Result<(), Box<dyn Error>> {
        let ids = std::mem::take(&mut *self.woken.lock().unwrap_or_else(|e| e.into_inner()));
        for id in ids {
            let Some((mut fut, waker)) = self.slots.get_mut(id).and_then(Option::take) else {
                continue;
            };
            match poll_once(fut.as_mut(), &waker) {
                Poll::Ready(Ok(slot)) => held.push_back(slot),
                Poll::Ready(Err(e)) => return Err(format!("queued path: shed {e:?}").into()),
                Poll::Pending => return Err("queued path: woken but not granted".into()),
            }
            self.free.push(id);
        }
        Ok(())
    }
}

/// Every slot held, ~500 queued: (queued trip, cancel) timings.
fn queued(rng: &mut Rng) -> Result<(Vec<u64>, Vec<u64>), Box<dyn Error>> {
    let cfg = AdmissionConfig {
        max_running: RUNNING,
        max_queued: 10 * QUEUED,
        max_queued_tokens: u64::MAX / 2,
        per_key_max_queued: QUEUED,
        per_key_max_queued_tokens: u64::MAX / 2,
    };
    let adm = Admission::new(cfg)?;
    let mut held = VecDeque::new();
    let mut waiters = Waiters { slots: Vec::new(), free: Vec::new(), woken: Arc::new(Mutex::new(Vec::new())) };
    let noop = Waker::noop();
    for _ in 0..RUNNING {
        match poll_once(std::pin::pin!(adm.admit(rng.ticket())), noop) {
            Poll::Ready(Ok(slot)) => held.push_back(slot),
            _ => return Err("queued path: set-up found no free slot".into()),
        }
    }
    for _ in 0..QUEUED {
        waiters.push(Box::pin(adm.admit(rng.ticket())))?;
    }
    let (mut trip, mut cancel) = (Vec::with_capacity(OPS), Vec::with_capacity(OPS));
    for i in 0..WARMUP + OPS {
        let fut: Admit<'_> = Box::pin(adm.admit(rng.ticket()));
        let t0 = Clock::now();
        waiters.push(fut)?;
        drop(held.pop_front());
        waiters.collect(&mut held)?;
        let t = t0.elapsed();

        let mut fut: Admit<'_> = Box::pin(adm.admit(rng.ticket()));
        let t0 = Clock::now();
        if poll_once(fut.as_mut(), noop).is_ready() {
            return Err("cancel path: the ticket did not queue".into());
        }
        drop(fut);
        let c = t0.elapsed();
        if i >= WARMUP {
            trip.push(t.as_nanos() as u64);
            cancel.push(c.as_nanos() as u64);
        }
    }
    let s = adm.stats();
    if s.queued != QUEUED || s.running != RUNNING {
        return Err(format!("queued path drifted: {s:?}").into());
    }
    Ok((trip, cancel))
}

fn main() -> Result<(), Box<dyn Error>> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().build()?;
    rt.block_on(async {
        let mut rng = Rng(XorShift64::new(0x9e37_79b9_7f4a_7c15));
        let started = Clock::now();
        println!("admission: {KEYS} keys, {RUNNING} slots, {QUEUED} queued on the queued paths");
        let base = summarize("baseline", baseline());
        let imm = summarize("immediate", immediate(&mut rng)?);
        let (trip, cancel) = queued(&mut rng)?;
        let trip = summarize("queued", trip);
        let cancel = summarize("cancel", cancel);
        for (name, s) in [("immediate", &imm), ("queued", &trip), ("cancel", &cancel)] {
            println!("{name:<10} / baseline: p50 {:.1}x, p99 {:.1}x", s.p50 / base.p50, s.p99 / base.p99);
        }
        println!("total {:.1} s", started.elapsed().as_secs_f64());
        Ok(())
    })
}
