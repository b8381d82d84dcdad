//! The tokenizer pool: chat templating and tokenization run here, on a few
//! threads of their own, never on the async reactor. A 1 MiB prompt takes
//! a core for a long while; on the reactor it would stall every stream the
//! coordinator is relaying.
//!
//! Bounded and fair: at most `max_queued` jobs wait (a tenant at most a
//! quarter of them), and one beyond is refused at once with
//! [`Error::TokenizerBusy`] (503 + Retry-After) instead of waiting. Waiting
//! jobs are taken round-robin across tenants, and one tenant runs on at
//! most `threads - 1` threads at once (1 with a single thread), so a
//! tenant flooding the pool with huge prompts leaves a thread to everyone
//! else: another tenant's job waits at most for the jobs already running
//! on that thread, not behind the flood. A job whose request went away
//! before it started is skipped.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use tokio::sync::oneshot;

use crate::error::Error;
use crate::metrics;

type Job = Box<dyn FnOnce() + Send>;

#[derive(Default)]
struct State {
    /// Waiting jobs per tenant.
    queues: HashMap<String, VecDeque<Job>>,
    /// Tenants with waiting jobs, next to be served first.
    order: VecDeque<String>,
    /// Jobs running per tenant.
    running: HashMap<String, usize>,
    queued: usize,
    closed: bool,
}

struct Shared {
    state: Mutex<State>,
    wake: Condvar,
    per_tenant_running: usize,
    max_queued: usize,
    per_tenant_queued: usize,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A bounded, tenant-fair pool of tokenizer threads.
pub struct Pool {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool").field("max_queued", &self.shared.max_queued).finish()
    }
}

impl Pool {
    /// Starts `threads` threads (at least 1) with room for `max_queued` waiting jobs (at least 1).
    pub fn new(threads: usize, max_queued: usize) -> std::io::Result<Self> {
        let threads = threads.max(1);
        let max_queued = max_queued.max(1);
        let shared = Arc::new(Shared {
            state: Mutex::default(),
            wake: Condvar::new(),
            per_tenant_running: threads.saturating_sub(1).max(1),
            max_queued,
            per_tenant_queued: (max_queued / 4).max(1),
        });
        for i in 0..threads {
            let s = shared.clone();
            std::thread::Builder::new().name(format!("tokenizer-{i}")).spawn(move || work(&s))?;
        }
        Ok(Self { shared })
    }

    /// Runs `f` on the pool for `tenant` and returns its result, or
    /// [`Error::TokenizerBusy`] at once when the queue (or the tenant's
    /// share of it) is full. Dropping the future before the job starts
    /// skips it.
    pub async fn run<T: Send + 'static>(
        &self,
        tenant: &str,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, Error> {
        let (tx, rx) = oneshot::channel();
        let job: Job = Box::new(move || {
            if !tx.is_closed() {
                let _ = tx.send(f());
            }
        });
        {
            let mut st = self.shared.lock();
            let mine = st.queues.get(tenant).map_or(0, VecDeque::len);
            if st.closed || st.queued >= self.shared.max_queued || mine >= self.shared.per_tenant_queued {
                return Err(Error::TokenizerBusy);
            }
            if mine == 0 {
                st.order.push_back(tenant.to_owned());
            }
            st.queues.entry(tenant.to_owned()).or_default().push_back(job);
            st.queued += 1;
            metrics::tokenizer_queue(st.queued + st.running.values().sum::<usize>());
        }
        self.shared.wake.notify_one();
        // A job never sends only when the pool closed (the process is ending).
        rx.await.map_err(|_| Error::TokenizerBusy)
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.lock().closed = true;
        self.shared.wake.notify_all();
    }
}

/// One thread: take the next job a tenant may run, run it, repeat.
fn work(s: &Shared) {
    loop {
        let (tenant, job) = {
            let mut st = s.lock();
            loop {
                if st.closed {
                    return;
                }
                if let Some(next) = take(&mut st, s.per_tenant_running) {
                    break next;
                }
                st = s.wake.wait(st).unwrap_or_else(|e| e.into_inner());
            }
        };
        job();
        let mut st = s.lock();
        if let Some(n) = st.running.get_mut(&tenant) {
            *n -= 1;
            if *n == 0 {
                st.running.remove(&tenant);
            }
        }
        metrics::tokenizer_queue(st.queued + st.running.values().sum::<usize>());
        drop(st);
        // The tenant may run another job now, on any thread.
        s.wake.notify_all();
    }
}

/// The first tenant in round-robin order below its running bound, with its
/// oldest job; the tenant goes to the back of the order.
fn take(st: &mut State, per_tenant: usize) -> Option<(String, Job)> {
    let i = st.order.iter().position(|t| st.running.get(t).copied().unwrap_or(0) < per_tenant)?;
    let tenant = st.order.remove(i)?;
    let queue = st.queues.get_mut(&tenant)?;
    let job = queue.pop_front()?;
    if queue.is_empty() {
        st.queues.remove(&tenant);
    } else {
        st.order.push_back(tenant.clone());
    }
    st.queued -= 1;
    *st.running.entry(tenant.clone()).or_default() += 1;
    Some((tenant, job))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    async fn settle(what: &str, f: impl Fn() -> bool) {
        opskit::eventually(what, Duration::from_secs(10), || std::future::ready(f())).await.expect("settled");
    }

    /// A job that blocks until released, reporting when it starts.
    fn gated(started: mpsc::Sender<&'static str>, name: &'static str) -> (impl FnOnce() + Send, mpsc::Sender<()>) {
        let (release, gate) = mpsc::channel::<()>();
        (
            move || {
                let _ = started.send(name);
                let _ = gate.recv_timeout(Duration::from_secs(30));
            },
            release,
        )
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_flooding_tenant_leaves_a_thread_to_the_others() {
        let pool = Arc::new(Pool::new(2, 64).expect("threads"));
        let (started, seen) = mpsc::channel();
        let mut releases = Vec::new();
        let mut flood = Vec::new();
        for _ in 0..4 {
            let (job, release) = gated(started.clone(), "a");
            releases.push(release);
            let p = pool.clone();
            flood.push(tokio::spawn(async move { p.run("a", job).await }));
        }
        assert_eq!(seen.recv_timeout(Duration::from_secs(10)), Ok("a"));
        // a holds one thread and has three waiting: b's job runs on the other at once.
        let b = pool.run("b", || 7).await.expect("b runs");
        assert_eq!(b, 7);
        assert!(seen.try_recv().is_err(), "a never took the second thread");
        drop(releases);
        for f in flood {
            f.await.expect("joined").expect("a's jobs run in turn");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_full_queue_refuses_at_once_and_a_tenant_has_a_quarter_of_it() {
        let pool = Arc::new(Pool::new(1, 8).expect("threads"));
        let (started, seen) = mpsc::channel();
        let (job, release) = gated(started, "hold");
        let p = pool.clone();
        let holder = tokio::spawn(async move { p.run("a", job).await });
        assert_eq!(seen.recv_timeout(Duration::from_secs(10)), Ok("hold"));
        // The one thread is busy: a may queue 8 / 4 = 2, then it is refused.
        let mut waiting = Vec::new();
        for _ in 0..2 {
            let p = pool.clone();
            waiting.push(tokio::spawn(async move { p.run("a", || ()).await }));
        }
        settle("a's two jobs queued", || pool.shared.lock().queued == 2).await;
        assert_eq!(pool.run("a", || ()).await, Err(Error::TokenizerBusy));
        for t in ["b", "c", "d"] {
            for _ in 0..2 {
                let p = pool.clone();
                waiting.push(tokio::spawn(async move { p.run(t, || ()).await }));
            }
        }
        settle("eight jobs queued", || pool.shared.lock().queued == 8).await;
        assert_eq!(pool.run("e", || ()).await, Err(Error::TokenizerBusy), "the whole queue is full");
        drop(release);
        holder.await.expect("joined").expect("ran");
        for w in waiting {
            w.await.expect("joined").expect("every queued job runs");
        }
    }
}
