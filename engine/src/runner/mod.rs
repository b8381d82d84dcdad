//! The engine on its own thread, driven through a cloneable handle.
//!
//! The worker binaries wrap this in gRPC. One thread owns the [`Engine`] and
//! everything about the requests in it (sinks, deadlines, held blocks,
//! counters); handles talk to it only through a command channel, so there is
//! no lock and the state lives in one place. The loop:
//!
//! 1. take commands — without blocking while the engine has work, with a
//!    blocking `recv` when it is idle (no busy loop);
//! 2. expire deadlines (and the shutdown grace);
//! 3. run one [`Engine::step`] and route its tokens to the request's sink.
//!
//! Every accepted request gets exactly one terminal event: `Finished`, or
//! `Failed` with a typed [`RunnerError`]. Admission is answered synchronously
//! (the handle waits for the thread's reply), so `Overloaded`, `Invalid` and
//! `ShuttingDown` are return values, never events.
//!
//! Time: deadlines are [`Instant`]s compared with `Instant::now()` on the
//! runner thread, checked once per loop turn, i.e. before every step. A
//! request whose deadline has passed when it is submitted is accepted and
//! then failed with `Deadline` before any work is done for it. The thread is
//! not async, so it reads the real clock; the workers keep their deadlines
//! on tokio's clock and hand them over as `tokio::time::Instant::into_std`.
//!
//! Sinks run on the runner thread, between steps: they must be quick (push
//! into a channel) and must never block on the caller's side, nor call the
//! handle (the thread would wait for itself). A sink that panics is treated
//! as a client that went away: the panic is caught, the request aborted and
//! its blocks freed, and the sink is not called again.
//!
//! The command queue is bounded ([`COMMAND_QUEUE`] commands). Nothing on the
//! runner thread ever sends into it, so a full queue can only make a
//! *sender* wait, never the thread that empties it; and who waits is chosen
//! by what the sender is doing:
//! - a call that waits for its answer (`submit`, `reserve`, `with_pool`,
//!   `stats`, ...) waits for room too: it was about to block until the
//!   runner's next turn anyway, and each such caller has one command
//!   queued, so asks in the queue never outnumber the threads asking;
//! - [`RunnerHandle::post_pool`] never waits: the KV transport calls it from
//!   an async task while it holds the KV receiver, so a full queue answers
//!   [`PostError::Full`] at once. Its callers bound what they post
//!   themselves (the decode worker's sink takes a credit, see
//!   [`POST_ROOM`]), so only more than [`ASK_ROOM`] threads asking at once
//!   can leave a post no room: overload, which fails that KV write.

#![allow(
    clippy::disallowed_types,
    reason = "the runner is a thread outside tokio: its deadlines are wall-clock instants (callers pass into_std())"
)]

mod error;
mod worker;

use std::sync::atomic::Ordering;
use std::sync::mpsc::{self, TrySendError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::batch::{Engine, LayerSink, Request};
use crate::kv::{KvPool, KvStats};
use crate::sampler::{FinishReason, SampledToken};
use types::kv::BlockId;

pub use error::{ErrorKind, PostError, RunnerError};
use worker::{Command, Worker};

/// Queue room for posted pool jobs ([`RunnerHandle::post_pool`]): a caller
/// that posts keeps at most this many unexecuted (the decode worker's KV
/// sink holds one credit per post until its job has run). Each job carries
/// one received KV frame; the sink's credit also bounds their bytes.
pub const POST_ROOM: usize = 1024;

/// Queue room for commands whose sender waits for the answer. Each such
/// command is one thread blocked in the handle (the workers ask from
/// tokio's blocking pool), so this is how many may queue before more wait
/// for room instead of for their answer. A worker's requests ask one at a
/// time each, and the runner admits `max_running + max_waiting` of them
/// (16 + 64 by default; the decode worker adds `max_waiting` more waiting
/// for remote KV): 256 is room for all of them with their reaper,
/// health and abort calls; only a flood of asks beyond it takes room that
/// posts would use, and then a post is refused rather than waited for.
pub const ASK_ROOM: usize = 256;

/// The command queue's capacity: [`ASK_ROOM`] + [`POST_ROOM`]. Its slots
/// are allocated when the runner starts (264 bytes each: about 340 KB).
pub const COMMAND_QUEUE: usize = ASK_ROOM + POST_ROOM;

/// Most prefix hashes a `Health` answer carries (64 KiB): a pool larger than
/// this reports the blocks in use and the most recently released ones there
/// (`WatchPrefixes` carries them all).
pub const MAX_PREFIX_REPORT: usize = 8192;

/// Runner knobs (the engine's own are in [`crate::batch::EngineConfig`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunnerConfig {
    /// Requests that may queue beyond the engine's `max_running` seats; a
    /// submit that would exceed it is refused with `Overloaded`.
    pub max_waiting: usize,
}

impl Default for RunnerConfig {
    fn default() -> Self {
        Self { max_waiting: 64 }
    }
}

/// What a streaming request's sink receives.
#[derive(Debug, Clone, PartialEq)]
pub enum RunnerEvent {
    Token(SampledToken),
    /// Terminal: the last `Token` was the final one. `cached_prompt_tokens`:
    /// prompt tokens whose KV came from the prefix cache rather than being
    /// computed for this request (the `usage.prompt_tokens_details.cached_tokens`
    /// of the OpenAI API).
    Finished {
        reason: FinishReason,
        cached_prompt_tokens: usize,
    },
    /// Terminal: the request stopped early; its blocks are already freed.
    Failed(RunnerError),
}

/// A finished prefill-only request: its first token and the blocks that
/// hold its prompt's KV. The blocks stay allocated until
/// [`RunnerHandle::release_held`], [`RunnerHandle::abort`], or the request's
/// deadline, whichever comes first.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefillDone {
    pub first: SampledToken,
    pub blocks: Vec<BlockId>,
    /// Prompt tokens taken from this engine's prefix cache, not computed.
    pub cached_prompt_tokens: usize,
}

/// A point-in-time view of the runner, for metrics and routing.
#[derive(Debug, Clone, PartialEq)]
pub struct RunnerStats {
    pub running: usize,
    pub waiting: usize,
    /// Prefill-only requests whose blocks are held for sending.
    pub held: usize,
    pub kv: KvStats,
    pub preemptions: u64,
    /// Prompt tokens served from the prefix cache since start.
    pub prefix_hit_tokens: u64,
    /// Prompt-lookup draft tokens computed and accepted since start
    /// (`Engine::draft_tokens`).
    pub draft_tokens: (u64, u64),
    /// `preemptions` by the evicted sequence's class (`Priority::index`).
    pub preemptions_by_class: [u64; 3],
    /// `waiting` by class (`Priority::index`).
    pub waiting_by_class: [usize; 3],
    /// Changes whenever the pool's set of cached prefix blocks does.
    pub prefix_epoch: u64,
    /// Hashes of the pool's cached prefix blocks (in use or evictable), all of
    /// them, those in use first, then the most recently released; shared,
    /// rebuilt only when the epoch moves.
    pub prefixes: std::sync::Arc<[u64]>,
    /// Requests that ended normally (prefill-only ones included).
    pub finished: u64,
    /// Every error the runner answered a request with, at admission or as
    /// its terminal event, by kind.
    pub failed_by_kind: std::collections::BTreeMap<ErrorKind, u64>,
}

/// Receives a streaming request's events, on the runner thread.
pub type Sink = Box<dyn FnMut(RunnerEvent) + Send>;
/// Receives a prefill-only request's outcome, on the runner thread.
pub type OnDone = Box<dyn FnOnce(Result<PrefillDone, RunnerError>) + Send>;

/// Starts runner threads.
pub struct Runner;

impl Runner {
    /// Moves `engine` onto a new thread. The thread exits after
    /// [`RunnerHandle::shutdown`] has drained, or once every handle is
    /// dropped and the in-flight requests have ended; joining it gives the
    /// engine back (with its pool empty of requests).
    pub fn spawn(engine: Engine, cfg: RunnerConfig) -> std::io::Result<(RunnerHandle, JoinHandle<Engine>)> {
        let (tx, rx) = mpsc::sync_channel(COMMAND_QUEUE);
        let block_size = engine.config().block_size;
        let context = engine.model().config().context;
        let kv_blocks = engine.kv_stats().total;
        let published = std::sync::Arc::new(Published::default());
        published.epoch.store(engine.pool().prefix_epoch(), Ordering::Release);
        let worker = Worker::new(engine, cfg, rx, published.clone());
        let join = std::thread::Builder::new().name("tandem-runner".into()).spawn(move || worker.run())?;
        Ok((RunnerHandle { tx, block_size, context, kv_blocks, published }, join))
    }
}

/// Drives a runner from any thread. Every call is answered by the runner
/// thread between two steps; once the thread has exited, calls answer
/// `ShuttingDown` (or `false` / nothing where they return no error).
#[derive(Clone)]
pub struct RunnerHandle {
    tx: mpsc::SyncSender<Command>,
    block_size: usize,
    /// The model's context length, in tokens.
    context: usize,
    /// Blocks in the engine's KV pool (fixed once the runner starts).
    kv_blocks: usize,
    /// What the runner thread publishes after every turn of its loop: read without
    /// asking the thread.
    published: std::sync::Arc<Published>,
}

/// What the runner thread publishes after every turn of its loop (between steps).
#[derive(Default)]
pub(crate) struct Published {
    /// The pool's prefix epoch.
    pub(crate) epoch: std::sync::atomic::AtomicU64,
    /// The load, packed by [`LoadNow::pack`].
    pub(crate) load: std::sync::atomic::AtomicU64,
}

/// A runner's load as of its last turn ([`RunnerHandle::load_now`]): what a worker's
/// `Health` answer counts, without asking the runner thread.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoadNow {
    /// Sequences in the running batch.
    pub running: u32,
    /// Requests accepted and not running yet.
    pub waiting: u32,
    /// KV blocks referenced (running sequences, reservations, pinned prefixes).
    pub kv_used: u32,
}

impl LoadNow {
    /// One word: running and waiting in 16 bits each (saturated; both are bounded far
    /// below by the runner's config), the blocks used in the low 32.
    pub(crate) fn pack(self) -> u64 {
        let sat = |n: u32| u64::from(n.min(u32::from(u16::MAX)));
        sat(self.running) << 48 | sat(self.waiting) << 32 | u64::from(self.kv_used)
    }

    pub(crate) fn unpack(w: u64) -> Self {
        Self { running: (w >> 48) as u32, waiting: (w >> 32 & 0xffff) as u32, kv_used: w as u32 }
    }
}

impl RunnerHandle {
    /// The pool's prefix epoch as of the runner's last turn (it changes whenever the set
    /// of cached prefix blocks does): a watcher of the set asks for [`RunnerStats`] only
    /// when this moved. No message to the runner thread.
    pub fn prefix_epoch(&self) -> u64 {
        self.published.epoch.load(Ordering::Acquire)
    }

    /// Blocks in the engine's KV pool.
    pub fn kv_blocks(&self) -> usize {
        self.kv_blocks
    }

    /// The runner's load as of its last turn; no message to the runner thread. (Zero
    /// until the thread's first turn.)
    pub fn load_now(&self) -> LoadNow {
        LoadNow::unpack(self.published.load.load(Ordering::Acquire))
    }

    /// Sends a command that carries `reply` and waits for the answer
    /// (first for room in the queue, if it is full: see the module docs).
    fn ask<T>(&self, make: impl FnOnce(mpsc::SyncSender<T>) -> Command) -> Option<T> {
        // One answer per command: room for exactly it, so answering never waits.
        let (reply, rx) = mpsc::sync_channel(1);
        self.tx.send(make(reply)).ok()?;
        // The thread answers every command it takes; an error means it exited.
        rx.recv().ok()
    }

    /// Queues a streaming request. `Ok` means accepted: `sink` will get its
    /// tokens and exactly one terminal event.
    pub fn submit(&self, req: Request, deadline: Option<Instant>, sink: Sink) -> Result<(), RunnerError> {
        self.ask(|reply| Command::Submit { req, deadline, sink, reply }).unwrap_or(Err(RunnerError::ShuttingDown))
    }

    /// Queues a request that stops after its first token and keeps its
    /// prompt's KV blocks for sending; `on_done` is called exactly once if
    /// it is accepted.
    pub fn submit_prefill_only(
        &self,
        req: Request,
        deadline: Option<Instant>,
        on_done: OnDone,
    ) -> Result<(), RunnerError> {
        self.ask(|reply| Command::SubmitPrefillOnly { req, deadline, on_done, stream: None, reply })
            .unwrap_or(Err(RunnerError::ShuttingDown))
    }

    /// [`submit_prefill_only`](Self::submit_prefill_only), streaming the
    /// prompt's KV to `stream` layer by layer as steps compute it (see
    /// [`Engine::add_prefill_streaming`]). `stream` runs on the runner
    /// thread mid-step and is dropped after the last block, before
    /// `on_done` is called.
    pub fn submit_prefill_streaming(
        &self,
        req: Request,
        deadline: Option<Instant>,
        stream: LayerSink,
        on_done: OnDone,
    ) -> Result<(), RunnerError> {
        self.ask(|reply| Command::SubmitPrefillOnly { req, deadline, on_done, stream: Some(stream), reply })
            .unwrap_or(Err(RunnerError::ShuttingDown))
    }

    /// Joins a request whose prompt KV is already in `blocks` (from
    /// [`reserve`](Self::reserve), filled through [`with_pool`](Self::with_pool))
    /// and whose first token `first` was sampled by the prefill side. The
    /// sink gets the tokens after `first` (not `first` itself). On `Ok` the
    /// runner owns the blocks; on `Err` the caller still does and must
    /// [`release_reserved`](Self::release_reserved) them.
    pub fn submit_prefilled(
        &self,
        req: Request,
        blocks: Vec<BlockId>,
        first: SampledToken,
        deadline: Option<Instant>,
        sink: Sink,
    ) -> Result<(), RunnerError> {
        self.ask(|reply| Command::SubmitPrefilled { req, blocks, first, deadline, sink, reply })
            .unwrap_or(Err(RunnerError::ShuttingDown))
    }

    /// Runs `f` on the runner thread with the KV pool, between steps; for
    /// gathering held blocks and scattering received KV into reserved ones.
    /// `f` must touch only blocks the caller holds or reserved.
    pub fn with_pool<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut KvPool) -> R + Send + 'static,
    ) -> Result<R, RunnerError> {
        let answer = self.ask(|reply| {
            Command::WithPool(Box::new(move |pool: &mut KvPool| {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(pool)));
                // The caller may have gone; nothing to do then.
                let _ = reply.send(r.map_err(|_| ()));
            }))
        });
        match answer {
            Some(Ok(r)) => Ok(r),
            Some(Err(())) => Err(RunnerError::Internal("the pool closure panicked".into())),
            None => Err(RunnerError::ShuttingDown),
        }
    }

    /// Runs `f` on the runner thread with the KV pool, between steps, and
    /// returns at once without waiting for it. Posted closures and every
    /// other command run in the order they were sent, so a write posted
    /// before a [`release_reserved`](Self::release_reserved) or a
    /// [`submit_prefilled`](Self::submit_prefilled) of the same blocks lands
    /// before it. A panic in `f` is caught and dropped; `f` reports its own
    /// failures (e.g. through a flag the caller checks with a later
    /// [`with_pool`](Self::with_pool)).
    ///
    /// Never waits: with the command queue full it answers
    /// [`PostError::Full`] (and `f` is dropped unrun); a caller keeps at most
    /// [`POST_ROOM`] posts unexecuted so that this means overload. Once the
    /// runner has exited, [`PostError::Exited`]. A job still queued when the
    /// runner exits is dropped unrun.
    pub fn post_pool(&self, f: impl FnOnce(&mut KvPool) + Send + 'static) -> Result<(), PostError> {
        let job = move |pool: &mut KvPool| {
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(pool)));
        };
        self.tx.try_send(Command::WithPool(Box::new(job))).map_err(|e| match e {
            TrySendError::Full(_) => PostError::Full { capacity: COMMAND_QUEUE },
            TrySendError::Disconnected(_) => PostError::Exited,
        })
    }

    /// Frees a finished prefill-only request's held blocks. Returns whether it was held.
    pub fn release_held(&self, id: u64) -> bool {
        self.ask(|reply| Command::ReleaseHeld { id, reply }).unwrap_or(false)
    }

    /// Allocates `n` blocks for KV another process will write. Refused
    /// with `ShuttingDown` once draining.
    pub fn reserve(&self, n: usize) -> Result<Vec<BlockId>, RunnerError> {
        self.ask(|reply| Command::Reserve { n, reply }).unwrap_or(Err(RunnerError::ShuttingDown))
    }

    /// Returns reserved blocks that never reached `submit_prefilled`.
    pub fn release_reserved(&self, blocks: Vec<BlockId>) -> Result<(), RunnerError> {
        self.ask(|reply| Command::ReleaseReserved { blocks, reply }).unwrap_or(Err(RunnerError::ShuttingDown))
    }

    /// Blocks a prompt of `prompt_len` tokens needs (no round trip).
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn blocks_for(&self, prompt_len: usize) -> usize {
        prompt_len.div_ceil(self.block_size)
    }

    /// The most events a streaming request with `max_tokens` can send its
    /// sink (no round trip): one per token — at most `max_tokens`, and at
    /// most the model's context, where the engine ends any sequence — plus
    /// the terminal one. A sink's queue this deep is never full.
    pub fn max_events(&self, max_tokens: u32) -> usize {
        (max_tokens as usize).min(self.context) + 1
    }

    /// Stops a request wherever it is and frees its blocks; its sink gets
    /// `Failed(Cancelled)` (a held prefill-only request is just released).
    /// Returns whether it existed.
    pub fn abort(&self, id: u64) -> bool {
        self.ask(|reply| Command::Abort { id, reply }).unwrap_or(false)
    }

    /// Current counters; `None` once the runner thread has exited.
    pub fn stats(&self) -> Option<RunnerStats> {
        self.ask(|reply| Command::Stats { reply })
    }

    /// Stops admitting (new work answers `ShuttingDown`), lets in-flight
    /// requests run for up to `grace`, then fails the rest with
    /// `ShuttingDown`, frees every block and ends the thread. Returns once
    /// the command is queued (waiting for room, as an ask does: call it off
    /// the async threads); join the thread to wait for the drain. A second
    /// call can only shorten the grace.
    pub fn shutdown(&self, grace: Duration) {
        // If the thread is already gone there is nothing left to stop.
        let _ = self.tx.send(Command::Shutdown { grace });
    }
}
