//! The runner thread: owns the engine and every request's routing state
//! (sinks, deadlines, held and reserved blocks, counters) in one place.
//!
//! Invariant: a request is in `live` exactly while the engine has it queued
//! or running; `held` mirrors the engine's held prefill-only requests, and
//! `reserved` the blocks handed out by `reserve` and not yet given back or
//! joined. That is what lets shutdown free everything.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TryRecvError};
use std::time::{Duration, Instant};

use super::{ErrorKind, OnDone, PrefillDone, RunnerConfig, RunnerError, RunnerEvent, RunnerStats, Sink};
use crate::batch::{Engine, LayerSink, Request, TokenEvent};
use crate::kv::KvPool;
use crate::sampler::SampledToken;
use types::kv::BlockId;

/// One answer: a channel with room for exactly it, so answering never waits.
type Reply<T> = SyncSender<T>;

/// What a handle asks of the runner thread.
pub(super) enum Command {
    Submit {
        req: Request,
        deadline: Option<Instant>,
        sink: Sink,
        reply: Reply<Result<(), RunnerError>>,
    },
    SubmitPrefillOnly {
        req: Request,
        deadline: Option<Instant>,
        on_done: OnDone,
        stream: Option<LayerSink>,
        reply: Reply<Result<(), RunnerError>>,
    },
    SubmitPrefilled {
        req: Request,
        blocks: Vec<BlockId>,
        first: SampledToken,
        deadline: Option<Instant>,
        sink: Sink,
        reply: Reply<Result<(), RunnerError>>,
    },
    WithPool(Box<dyn FnOnce(&mut KvPool) + Send>),
    ReleaseHeld {
        id: u64,
        reply: Reply<bool>,
    },
    Reserve {
        n: usize,
        reply: Reply<Result<Vec<BlockId>, RunnerError>>,
    },
    ReleaseReserved {
        blocks: Vec<BlockId>,
        reply: Reply<Result<(), RunnerError>>,
    },
    Abort {
        id: u64,
        reply: Reply<bool>,
    },
    Stats {
        reply: Reply<RunnerStats>,
    },
    Shutdown {
        grace: Duration,
    },
}

/// Who hears about a request.
enum Client {
    Stream(Sink),
    Prefill(OnDone),
}

struct Entry {
    deadline: Option<Instant>,
    client: Client,
}

#[derive(Clone, Copy)]
enum Phase {
    Serving,
    /// Admission is closed; `until` is when the grace ends (`None`: when
    /// the in-flight work ends, as after every handle was dropped).
    Draining {
        until: Option<Instant>,
    },
}

pub(super) struct Worker {
    engine: Engine,
    cfg: RunnerConfig,
    rx: Receiver<Command>,
    live: HashMap<u64, Entry>,
    /// Held prefill-only requests and their deadlines.
    held: HashMap<u64, Option<Instant>>,
    reserved: HashSet<BlockId>,
    phase: Phase,
    /// Every handle is gone: no command can arrive any more.
    disconnected: bool,
    finished: u64,
    failed: BTreeMap<ErrorKind, u64>,
    /// Where [`super::RunnerHandle::prefix_epoch`] and [`super::RunnerHandle::load_now`]
    /// read.
    published: std::sync::Arc<super::Published>,
    /// The pool's prefix epoch and cached hashes at the last stats call.
    prefixes: (u64, std::sync::Arc<[u64]>),
}

/// Calls a sink; false if it panicked (the client is treated as gone).
fn deliver(sink: &mut Sink, ev: RunnerEvent) -> bool {
    catch_unwind(AssertUnwindSafe(|| sink(ev))).is_ok()
}

fn deliver_once(on_done: OnDone, r: Result<PrefillDone, RunnerError>) -> bool {
    catch_unwind(AssertUnwindSafe(move || on_done(r))).is_ok()
}

impl Worker {
    pub(super) fn new(
        engine: Engine,
        cfg: RunnerConfig,
        rx: Receiver<Command>,
        published: std::sync::Arc<super::Published>,
    ) -> Self {
        Self {
            engine,
            cfg,
            rx,
            live: HashMap::new(),
            held: HashMap::new(),
            reserved: HashSet::new(),
            phase: Phase::Serving,
            disconnected: false,
            finished: 0,
            failed: BTreeMap::new(),
            prefixes: (0, std::sync::Arc::from(Vec::new())),
            published,
        }
    }

    /// The thread's body; returns the engine with every block freed.
    pub(super) fn run(mut self) -> Engine {
        loop {
            self.take_commands();
            let now = Instant::now();
            self.expire(now);
            if self.drained(now) {
                break;
            }
            if self.engine.has_work() {
                self.step();
            }
            self.publish();
        }
        self.fail_all(&RunnerError::ShuttingDown);
        for id in std::mem::take(&mut self.held).into_keys() {
            self.engine.release_held(id);
        }
        let reserved: Vec<BlockId> = self.reserved.drain().collect();
        if let Err(e) = self.engine.release_reserved(&reserved) {
            tracing::error!(error = %e, "releasing reserved blocks at shutdown");
        }
        tracing::info!(finished = self.finished, "runner stopped");
        self.engine
    }

    /// Publishes the prefix epoch and the load for the handles to read.
    fn publish(&self) {
        use std::sync::atomic::Ordering::Release;
        let load = super::LoadNow {
            running: self.engine.num_running() as u32,
            waiting: self.engine.num_waiting() as u32,
            kv_used: self.engine.kv_stats().used as u32,
        };
        self.published.epoch.store(self.engine.pool().prefix_epoch(), Release);
        self.published.load.store(load.pack(), Release);
    }

    /// Handles every queued command; waits for one first if there is
    /// nothing to step (until the next held deadline or the grace's end).
    fn take_commands(&mut self) {
        let drain_done =
            matches!(self.phase, Phase::Draining { .. }) && self.held.is_empty() && self.reserved.is_empty();
        // A finished drain must not wait: the loop is about to exit.
        let idle = !self.engine.has_work() && !self.disconnected && !drain_done;
        if idle {
            let until = match self.phase {
                Phase::Serving => None,
                Phase::Draining { until } => until,
            };
            let wake = self.held.values().flatten().chain(until.as_ref()).min().copied();
            let first = match wake {
                None => self.rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
                Some(at) => self.rx.recv_timeout(at.saturating_duration_since(Instant::now())),
            };
            match first {
                Ok(cmd) => self.handle(cmd),
                Err(RecvTimeoutError::Timeout) => return,
                Err(RecvTimeoutError::Disconnected) => self.on_disconnect(),
            }
        }
        while !self.disconnected {
            match self.rx.try_recv() {
                Ok(cmd) => self.handle(cmd),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => self.on_disconnect(),
            }
        }
    }

    fn on_disconnect(&mut self) {
        self.disconnected = true;
        if let Phase::Serving = self.phase {
            tracing::info!("every runner handle dropped; finishing in-flight requests");
            self.phase = Phase::Draining { until: None };
        }
    }

    /// Whether a drain is complete (or its grace is over: then the rest fail).
    fn drained(&mut self, now: Instant) -> bool {
        let Phase::Draining { until } = self.phase else { return false };
        if until.is_some_and(|u| now >= u) {
            self.fail_all(&RunnerError::ShuttingDown);
            return true;
        }
        !self.engine.has_work() && (self.disconnected || (self.held.is_empty() && self.reserved.is_empty()))
    }

    fn handle(&mut self, cmd: Command) {
        // A send fails only if the asker gave up waiting; nothing to undo then.
        match cmd {
            Command::Submit { req, deadline, sink, reply } => {
                let _ = reply.send(self.admit(req, deadline, Client::Stream(sink), None));
            }
            Command::SubmitPrefillOnly { req, deadline, on_done, stream, reply } => {
                let _ = reply.send(self.admit(req, deadline, Client::Prefill(on_done), stream));
            }
            Command::SubmitPrefilled { req, blocks, first, deadline, sink, reply } => {
                let _ = reply.send(self.join(req, blocks, first, deadline, sink));
            }
            Command::WithPool(f) => {
                // The handle's wrapper already catches a panic in the caller's closure.
                if catch_unwind(AssertUnwindSafe(|| f(self.engine.pool_mut()))).is_err() {
                    tracing::error!("pool closure panicked");
                }
            }
            Command::ReleaseHeld { id, reply } => {
                let was = self.held.remove(&id).is_some() && self.engine.release_held(id);
                let _ = reply.send(was);
            }
            Command::Reserve { n, reply } => {
                let _ = reply.send(self.reserve(n));
            }
            Command::ReleaseReserved { blocks, reply } => {
                let _ = reply.send(self.release_reserved(&blocks));
            }
            Command::Abort { id, reply } => {
                let was = if self.live.contains_key(&id) {
                    self.fail(id, RunnerError::Cancelled);
                    true
                } else {
                    self.held.remove(&id).is_some() && self.engine.release_held(id)
                };
                let _ = reply.send(was);
            }
            Command::Stats { reply } => {
                let _ = reply.send(self.stats());
            }
            Command::Shutdown { grace } => {
                let until = Instant::now().checked_add(grace);
                let until = match (self.phase, until) {
                    (Phase::Draining { until: Some(old) }, Some(new)) => Some(old.min(new)),
                    (Phase::Draining { until: Some(old) }, None) => Some(old),
                    (_, new) => new,
                };
                tracing::info!(?grace, in_flight = self.live.len(), "runner draining");
                self.phase = Phase::Draining { until };
            }
        }
    }

    fn count_failure(&mut self, kind: ErrorKind) {
        *self.failed.entry(kind).or_insert(0) += 1;
    }

    /// Refuses new work while draining or when the queue beyond the
    /// running seats is full.
    fn check_admission(&self) -> Result<(), RunnerError> {
        if let Phase::Draining { .. } = self.phase {
            return Err(RunnerError::ShuttingDown);
        }
        let queued = self.engine.num_running() + self.engine.num_waiting();
        let waiting = queued.saturating_sub(self.engine.config().max_running);
        if waiting >= self.cfg.max_waiting {
            return Err(RunnerError::Overloaded { waiting, max_waiting: self.cfg.max_waiting });
        }
        Ok(())
    }

    fn admit(
        &mut self,
        req: Request,
        deadline: Option<Instant>,
        client: Client,
        stream: Option<LayerSink>,
    ) -> Result<(), RunnerError> {
        let id = req.id;
        let added = self.check_admission().and_then(|()| {
            match client {
                Client::Stream(_) => self.engine.add(req),
                Client::Prefill(_) => match stream {
                    Some(sink) => self.engine.add_prefill_streaming(req, sink),
                    None => self.engine.add_prefill_only(req),
                },
            }
            .map_err(RunnerError::from_engine)
        });
        match added {
            Ok(()) => {
                self.live.insert(id, Entry { deadline, client });
                Ok(())
            }
            Err(e) => {
                self.count_failure(e.kind());
                Err(e)
            }
        }
    }

    /// `submit_prefilled`: allowed while draining, since the reservation
    /// it completes is work accepted before the drain began.
    fn join(
        &mut self,
        req: Request,
        blocks: Vec<BlockId>,
        first: SampledToken,
        deadline: Option<Instant>,
        mut sink: Sink,
    ) -> Result<(), RunnerError> {
        let id = req.id;
        let r = self.check_reserved(&blocks).and_then(|()| match self.phase {
            Phase::Serving => self.check_admission(),
            Phase::Draining { .. } => Ok(()),
        });
        let r =
            r.and_then(|()| self.engine.add_prefilled(req, blocks.clone(), &first).map_err(RunnerError::from_engine));
        match r {
            Ok(done) => {
                for b in &blocks {
                    self.reserved.remove(b);
                }
                match done {
                    None => {
                        self.live.insert(id, Entry { deadline, client: Client::Stream(sink) });
                    }
                    Some(reason) => {
                        // The first token already ended it; the engine freed the blocks.
                        self.finished += 1;
                        deliver(&mut sink, RunnerEvent::Finished { reason, cached_prompt_tokens: 0 });
                    }
                }
                Ok(())
            }
            Err(e) => {
                self.count_failure(e.kind());
                Err(e)
            }
        }
    }

    fn check_reserved(&self, blocks: &[BlockId]) -> Result<(), RunnerError> {
        let mut seen = HashSet::new();
        match blocks.iter().find(|b| !self.reserved.contains(b) || !seen.insert(**b)) {
            Some(b) => Err(RunnerError::Invalid(format!("block {b} is not reserved (or is listed twice)"))),
            None => Ok(()),
        }
    }

    fn reserve(&mut self, n: usize) -> Result<Vec<BlockId>, RunnerError> {
        let r = match self.phase {
            Phase::Draining { .. } => Err(RunnerError::ShuttingDown),
            Phase::Serving => self.engine.reserve_blocks(n).map_err(RunnerError::from_engine),
        };
        match r {
            Ok(blocks) => {
                self.reserved.extend(&blocks);
                Ok(blocks)
            }
            Err(e) => {
                self.count_failure(e.kind());
                Err(e)
            }
        }
    }

    fn release_reserved(&mut self, blocks: &[BlockId]) -> Result<(), RunnerError> {
        self.check_reserved(blocks)?;
        self.engine.release_reserved(blocks).map_err(RunnerError::from_engine)?;
        for b in blocks {
            self.reserved.remove(b);
        }
        Ok(())
    }

    fn stats(&mut self) -> RunnerStats {
        let epoch = self.engine.pool().prefix_epoch();
        if self.prefixes.0 != epoch {
            self.prefixes = (epoch, self.engine.pool().cached_prefixes(usize::MAX).into());
        }
        RunnerStats {
            running: self.engine.num_running(),
            waiting: self.engine.num_waiting(),
            held: self.held.len(),
            kv: self.engine.kv_stats(),
            preemptions: self.engine.preemptions(),
            preemptions_by_class: self.engine.preemptions_by_class(),
            prefix_hit_tokens: self.engine.prefix_hit_tokens(),
            draft_tokens: self.engine.draft_tokens(),
            prefix_epoch: self.prefixes.0,
            prefixes: self.prefixes.1.clone(),
            waiting_by_class: self.engine.waiting_by_class(),
            finished: self.finished,
            failed_by_kind: self.failed.clone(),
        }
    }

    /// Ends a live request with `err`: stops its work, frees its blocks and
    /// sends its terminal event.
    fn fail(&mut self, id: u64, err: RunnerError) {
        self.engine.abort(id);
        let Some(entry) = self.live.remove(&id) else { return };
        self.count_failure(err.kind());
        // A panic here changes nothing: this was the last call anyway.
        match entry.client {
            Client::Stream(mut sink) => {
                deliver(&mut sink, RunnerEvent::Failed(err));
            }
            Client::Prefill(on_done) => {
                deliver_once(on_done, Err(err));
            }
        }
    }

    fn fail_all(&mut self, err: &RunnerError) {
        let ids: Vec<u64> = self.live.keys().copied().collect();
        for id in ids {
            self.fail(id, err.clone());
        }
    }

    /// Fails live requests, and lets go of held blocks, whose deadline passed.
    fn expire(&mut self, now: Instant) {
        let due = |d: &Option<Instant>| d.is_some_and(|d| d <= now);
        let late: Vec<u64> = self.live.iter().filter(|(_, e)| due(&e.deadline)).map(|(&id, _)| id).collect();
        for id in late {
            self.fail(id, RunnerError::Deadline);
        }
        let late: Vec<u64> = self.held.iter().filter(|(_, d)| due(d)).map(|(&id, _)| id).collect();
        for id in late {
            tracing::warn!(id, "held prefill blocks were not collected before the deadline; releasing them");
            self.held.remove(&id);
            self.engine.release_held(id);
        }
    }

    fn step(&mut self) {
        match self.engine.step() {
            Ok(events) => {
                for ev in events {
                    self.route(ev);
                }
            }
            Err(e) => {
                // Which sequences the failed step left consistent is unknown,
                // so every in-flight request fails; the thread carries on.
                tracing::error!(error = %e, in_flight = self.live.len(), "engine step failed");
                self.fail_all(&RunnerError::Internal(e.to_string()));
            }
        }
    }

    /// Hands one token to its request's client.
    fn route(&mut self, ev: TokenEvent) {
        let Some(mut entry) = self.live.remove(&ev.id) else { return };
        match entry.client {
            Client::Stream(ref mut sink) => {
                if !deliver(sink, RunnerEvent::Token(ev.token)) {
                    tracing::warn!(id = ev.id, "sink panicked; treating the client as gone");
                    self.engine.abort(ev.id);
                    self.count_failure(ErrorKind::Cancelled);
                    return;
                }
                match ev.finished {
                    Some(reason) => {
                        self.finished += 1;
                        deliver(sink, RunnerEvent::Finished { reason, cached_prompt_tokens: ev.cached_prompt_tokens });
                    }
                    None => {
                        self.live.insert(ev.id, entry);
                    }
                }
            }
            Client::Prefill(on_done) => {
                // A prefill-only request's one token is always its last;
                // its blocks are now held by the engine.
                let Some(blocks) = self.engine.held_blocks(ev.id).map(<[BlockId]>::to_vec) else {
                    let err =
                        RunnerError::Internal(format!("prefill-only request {} ended without held blocks", ev.id));
                    self.engine.abort(ev.id);
                    self.count_failure(err.kind());
                    deliver_once(on_done, Err(err));
                    return;
                };
                self.finished += 1;
                self.held.insert(ev.id, entry.deadline);
                if !deliver_once(
                    on_done,
                    Ok(PrefillDone { first: ev.token, blocks, cached_prompt_tokens: ev.cached_prompt_tokens }),
                ) {
                    tracing::warn!(id = ev.id, "prefill callback panicked; releasing its blocks");
                    self.held.remove(&ev.id);
                    self.engine.release_held(ev.id);
                }
            }
        }
    }
}
