//! The `DecodeWorker` gRPC service.
//!
//! A `Generate`'s walk:
//!
//! 1. Validate (typed `invalid_argument` naming the field), refuse when
//!    draining (`retryable`) or when too many requests already wait for
//!    remote KV (`overloaded`).
//! 2. Route: a request naming prefill workers is prefilled remotely, one
//!    naming none here (the coordinator made the one local-vs-remote
//!    decision). A continuation (`generated_ids`, request migration) is
//!    prefilled over its prompt and those tokens, refused when its
//!    determinism fingerprint is not this worker's, and generates on after
//!    them; its token indices count them.
//! 3. Remote: reserve the prompt's blocks in the engine's pool, register
//!    them with the KV [`Receiver`] under a lease, and call `Prefill` on the
//!    first prefill worker with (reservation, generation, blocks, our layout
//!    fingerprint and version group). Its answer arrives only after every
//!    layer was acknowledged; then `take_ready` hands the blocks over, a
//!    barrier on the engine thread proves every posted write landed intact,
//!    and the sequence joins the batch with the prefill's first token.
//! 4. Anything else — the prefill worker unreachable, dead mid-transfer,
//!    answering an error, a corrupt frame, an expired lease, a refused
//!    handshake — is a failed KV load: the reservation is ended (its late
//!    frames are refused from then on), its blocks are freed, and the
//!    [`KvLoadFailurePolicy`] decides: `recompute` prefills here, `retry`
//!    tries the next named prefill worker, `fail` answers `kv_load_failed`.
//!    No token is ever produced from a partial or unverified reservation.
//!    Steps 3 and 4 live in `service/remote.rs`.
//! 5. Tokens stream back as the engine produces them; the stream ends with
//!    exactly one `Finished` or one `WorkerError`. A caller that goes away
//!    (or `Abort`) cancels the request wherever it is and frees its KV.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use engine::batch::Request;
use engine::runner::{RunnerEvent, RunnerHandle, Sink};
use engine::sampler::{FinishReason as EngineFinish, SampledToken};
use kvtransfer::{Peer, Receiver, Reservation};
use proto::worker::v1::decode_worker_server::DecodeWorker;
use proto::worker::v1::prefill_worker_client::PrefillWorkerClient;
use proto::worker::v1::{
    generate_response, AbortRequest, AbortResponse, ErrorKind, FinishReason, Finished, FirstToken, GenerateRequest,
    GenerateResponse, HealthRequest, HealthResponse, PrefillAttempt, TokenChunk, TopLogprob, WatchPrefixesRequest,
    WorkerError,
};
use tokio::sync::mpsc::error::TrySendError;
use tokio::sync::{mpsc, Notify};
use types::kv::BlockId;
use types::sampling::SamplingParams;
// Deadlines, leases and timeouts on tokio's clock (paused in tests); the
// runner, a thread outside tokio, takes them as `into_std()`.
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use tonic::{Request as GrpcRequest, Response, Status};

use crate::absorb::AbsorbBudget;
use crate::metrics as m;
use crate::KvLoadFailurePolicy;
use worker_common::serve::{blocking, err, local_deadline, runner_err};

mod remote;

/// The service's knobs (from [`crate::DecodeConfig`]).
#[derive(Debug, Clone)]
pub struct DecodeSettings {
    pub policy: KvLoadFailurePolicy,
    pub reservation_ttl: Duration,
    pub max_prefill_attempts: usize,
    /// Requests waiting for remote KV at once; more are refused as overloaded.
    pub max_pending_remote: usize,
    /// The KV transfer address prefill workers are told to push to.
    pub transfer_addr: String,
    /// The transport listening there.
    pub transport: kvtransfer::TransportKind,
    /// QUIC with a self-signed certificate: its SHA-256, for prefill workers to pin.
    pub tls_cert_sha256: Option<[u8; 32]>,
    /// Under `recompute`, prompt tokens per second prefilled here for
    /// requests a prefill worker refused as overloaded ([`AbsorbBudget`]).
    pub max_absorbed_prefill_tokens_per_s: u64,
}

/// Shared state of the service (cheap to clone).
#[derive(Clone)]
pub struct DecodeService {
    inner: Arc<Inner>,
}

struct Inner {
    runner: RunnerHandle,
    /// The runner's last counters, for Health while the runner is mid-step.
    stats: worker_common::health::StatsCache,
    local: Peer,
    receiver: Arc<Mutex<Receiver>>,
    settings: DecodeSettings,
    ready: AtomicBool,
    /// Set while fenced: another process holds this worker's etcd key, or no coordinator has
    /// called Health within `--coordinator-silence-fence-ms` (see `serve`).
    fenced: AtomicBool,
    next_id: AtomicU64,
    /// Wire request id -> its cancellation token.
    running: Mutex<HashMap<String, CancellationToken>>,
    /// Requests between reserving blocks and joining the batch.
    pending_remote: AtomicUsize,
    pending_changed: Notify,
    clients: Mutex<HashMap<String, PrefillWorkerClient<Channel>>>,
    /// Local prefill taken over from overloaded prefill workers.
    absorb: Mutex<AbsorbBudget>,
}

/// Why one remote prefill attempt did not deliver usable KV.
#[derive(Debug)]
enum Failure {
    /// A failed KV load: the policy decides. `reason` is the metric label.
    Load { reason: &'static str, error: WorkerError },
    /// Not a load failure (bad request, our deadline, cancelled, no capacity): answer it as is.
    Fatal(WorkerError),
}

/// What the remote path produced.
enum Remote {
    /// Every layer arrived intact: the blocks and the first token.
    Loaded(Vec<BlockId>, FirstToken),
    /// The policy says prefill here.
    Recompute,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every holder only does bookkeeping; a poisoned lock still holds consistent state.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The stream back to the caller, with TTFT and inter-token timing.
struct Out {
    tx: mpsc::Sender<Result<GenerateResponse, Status>>,
    arrived: Instant,
    last: Option<Instant>,
    sent: u32,
    /// Tokens generated before this worker's (a continuation's `generated_ids`):
    /// each token's index counts them.
    base: u32,
    /// Remote prefill attempts not yet reported: they ride on the next
    /// message (the first token or the error), for the coordinator's
    /// circuit breakers.
    attempts: Vec<PrefillAttempt>,
}

impl Out {
    async fn send(&mut self, event: generate_response::Event) -> Result<(), WorkerError> {
        let msg = GenerateResponse { event: Some(event), prefill_attempts: std::mem::take(&mut self.attempts) };
        self.tx.send(Ok(msg)).await.map_err(|_| err(ErrorKind::Cancelled, "the caller went away"))
    }

    async fn token(&mut self, mut chunk: TokenChunk) -> Result<(), WorkerError> {
        chunk.index = Some(self.base + self.sent);
        self.send(generate_response::Event::Token(chunk)).await?;
        let now = Instant::now();
        match self.last {
            None => m::record_first_token(now.duration_since(self.arrived).as_secs_f64()),
            Some(prev) => m::record_token_gap(now.duration_since(prev).as_secs_f64()),
        }
        self.last = Some(now);
        self.sent += 1;
        Ok(())
    }
}

fn chunk(t: &SampledToken) -> TokenChunk {
    TokenChunk {
        id: t.id,
        logprob: t.logprob,
        top: t.top.iter().map(|&(id, logprob)| TopLogprob { id, logprob }).collect(),
        index: None,
    }
}

/// Removes the request's id from the running map when the request ends.
struct Registered<'a> {
    inner: &'a Inner,
    request_id: String,
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        lock(&self.inner.running).remove(&self.request_id);
    }
}

/// Counts a request as waiting for remote KV while it lives.
struct Pending<'a>(&'a Inner);

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        self.0.pending_remote.fetch_sub(1, Ordering::SeqCst);
        self.0.pending_changed.notify_waiters();
    }
}

impl DecodeService {
    pub fn new(runner: RunnerHandle, local: Peer, receiver: Arc<Mutex<Receiver>>, settings: DecodeSettings) -> Self {
        let absorb = Mutex::new(AbsorbBudget::new(settings.max_absorbed_prefill_tokens_per_s, Instant::now()));
        Self {
            inner: Arc::new(Inner {
                runner,
                stats: worker_common::health::StatsCache::default(),
                local,
                receiver,
                settings,
                ready: AtomicBool::new(true),
                fenced: AtomicBool::new(false),
                next_id: AtomicU64::new(1),
                running: Mutex::new(HashMap::new()),
                pending_remote: AtomicUsize::new(0),
                pending_changed: Notify::new(),
                clients: Mutex::new(HashMap::new()),
                absorb,
            }),
        }
    }

    /// Fenced: take no new work (another process holds its etcd key, or no coordinator reaches it).
    pub fn set_fenced(&self, fenced: bool) {
        self.inner.fenced.store(fenced, Ordering::SeqCst);
    }

    /// Stops admitting (new `Generate` calls answer `retryable`), then waits
    /// up to `grace` for requests waiting on remote KV to join the batch
    /// (or fail), so the engine's drain that follows covers them. Returns
    /// the grace left.
    pub async fn drain(&self, grace: Duration) -> Duration {
        let started = Instant::now();
        self.inner.ready.store(false, Ordering::SeqCst);
        // Long-lived streams would hold the server's graceful shutdown for its whole grace.
        self.inner.stats.close_watches();
        let all_joined = async {
            loop {
                let changed = self.inner.pending_changed.notified();
                if self.inner.pending_remote.load(Ordering::SeqCst) == 0 {
                    return;
                }
                changed.await;
            }
        };
        if tokio::time::timeout(grace, all_joined).await.is_err() {
            tracing::warn!(?grace, "requests still waiting for remote KV at the end of the grace");
        }
        grace.saturating_sub(started.elapsed())
    }

    /// Frees the blocks of reservations that ended without reaching the
    /// engine (lease expiry, corruption, the sender's abort) and refreshes
    /// the transfer metrics, on a timer (the next lease deadline, at most
    /// 500 ms apart); requests also reap inline when they end a reservation.
    /// Stops when `stop` is cancelled.
    pub async fn reap_forever(self, stop: CancellationToken) {
        loop {
            self.reap().await;
            let next = lock(&self.inner.receiver).next_deadline();
            let cap = Instant::now() + Duration::from_millis(500);
            let wake = next.map_or(cap, |d| d.min(cap));
            tokio::select! {
                _ = tokio::time::sleep_until(wake) => {}
                _ = stop.cancelled() => break,
            }
        }
        // Once more, so what ended since the last pass is freed and exported before exit.
        self.reap().await;
    }

    async fn reap(&self) {
        let released = lock(&self.inner.receiver).poll_released(Instant::now());
        for r in released {
            tracing::info!(reservation = %r.reservation, cause = ?r.cause, blocks = r.blocks.len(), "reservation ended; freeing its blocks");
            self.release(r.blocks).await;
        }
        self.export_receiver();
    }

    /// Mirrors the KV receiver's counters and live reservations to `/metrics`
    /// (read under the lock, recorded after it).
    fn export_receiver(&self) {
        let (counters, live) = {
            let rx = lock(&self.inner.receiver);
            (rx.counters().clone(), rx.live_reservations())
        };
        m::record_receiver(&counters, live);
    }

    async fn release(&self, blocks: Vec<BlockId>) {
        let runner = self.inner.runner.clone();
        match blocking(move || runner.release_reserved(blocks)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::error!(error = %e, "releasing reserved blocks failed"),
            Err(e) => tracing::error!(error = %e.message, "releasing reserved blocks failed"),
        }
    }

    /// Ends a reservation that will not be used and frees its blocks: now if
    /// it was still live, else by reaping (it already ended and its blocks
    /// wait in the receiver's outbox).
    async fn end_reservation(&self, r: Reservation) {
        let aborted = lock(&self.inner.receiver).abort(r);
        match aborted {
            Ok(blocks) => self.release(blocks).await,
            Err(_) => self.reap().await,
        }
    }

    fn validate(&self, req: &GenerateRequest) -> Result<(SamplingParams, KvLoadFailurePolicy), WorkerError> {
        let bad = |m: String| Err(err(ErrorKind::InvalidArgument, m));
        if req.request_id.is_empty() {
            return bad("request_id is empty".into());
        }
        if req.token_ids.is_empty() {
            return bad("token_ids is empty".into());
        }
        let Some(sampling) = req.sampling.as_ref() else { return bad("sampling is required".into()) };
        let params = SamplingParams::try_from(sampling).map_err(|e| WorkerError::from(&e))?;
        let policy = match req.policy_override {
            None => self.inner.settings.policy,
            Some(v) => match proto::worker::v1::KvLoadFailurePolicy::try_from(v) {
                Ok(p) => KvLoadFailurePolicy::from_wire(p).unwrap_or(self.inner.settings.policy),
                Err(_) => return bad(format!("policy_override {v} is not a known KvLoadFailurePolicy")),
            },
        };
        if let Some(i) = req.prefill.iter().position(|t| t.grpc_addr.is_empty()) {
            return bad(format!("prefill[{i}].grpc_addr is empty"));
        }
        let own = worker_common::serve::determinism(&self.inner.local.fingerprint);
        if !req.determinism_fingerprint.is_empty() && req.determinism_fingerprint != own {
            return Err(err(
                ErrorKind::VersionMismatch,
                format!(
                    "continuation refused: determinism fingerprint {} is not this worker's {} (another sampler, \
                     kernel numerics, model, tokenizer or KV layout would continue with other tokens)",
                    worker_common::serve::hex(&req.determinism_fingerprint),
                    worker_common::serve::hex(&own)
                ),
            ));
        }
        Ok((params, policy))
    }

    /// Runs one request to its end, sending tokens on `out`; the caller
    /// sends the final message.
    async fn serve(
        &self,
        mut req: GenerateRequest,
        out: &mut Out,
        token: &CancellationToken,
    ) -> Result<Finished, WorkerError> {
        let (mut params, policy) = self.validate(&req)?;
        // Every answer has a seed it can be reproduced and continued with: an unseeded
        // request gets one here, which a remote prefill samples with too and Finished reports.
        let seed = *params.seed.get_or_insert_with(engine::sampler::fresh_seed);
        if let Some(s) = req.sampling.as_mut() {
            s.seed = Some(seed);
        }
        out.base = u32::try_from(req.generated_ids.len()).unwrap_or(u32::MAX);
        let inner = &self.inner;
        worker_common::serve::accepting(&inner.ready, &inner.fenced)?;
        {
            let mut running = lock(&inner.running);
            if running.contains_key(&req.request_id) {
                return Err(err(
                    ErrorKind::InvalidArgument,
                    format!("request_id {:?} is already running here", req.request_id),
                ));
            }
            running.insert(req.request_id.clone(), token.clone());
        }
        let _registered = Registered { inner, request_id: req.request_id.clone() };
        let deadline = local_deadline(req.deadline_unix_ms);
        let engine_req = Request {
            id: inner.next_id.fetch_add(1, Ordering::Relaxed),
            prompt: req.token_ids.clone(),
            params,
            salt: req.cache_salt,
            priority: req.priority().into(),
            generated: req.generated_ids.clone(),
        };
        let prompt_tokens = req.token_ids.len() as u32;
        let finished = |(reason, cached): (FinishReason, u32), prefilled_remotely| Finished {
            reason: reason as i32,
            prompt_tokens,
            generated_tokens: 0,
            prefilled_remotely,
            cached_prompt_tokens: cached,
            seed,
        };

        let remote = !req.prefill.is_empty();
        if remote {
            m::record_route(facts::metrics::decode::ROUTE_REMOTE);
            match self.remote(&req, deadline, policy, token, &mut out.attempts).await? {
                Remote::Loaded(blocks, first) => {
                    // The prefill worker's cache, not this one, saved the work.
                    let cached = first.cached_prompt_tokens;
                    let (reason, _) = self.decode_prefilled(engine_req, blocks, first, deadline, out, token).await?;
                    return Ok(finished((reason, cached), true));
                }
                Remote::Recompute => {}
            }
        } else {
            m::record_route(facts::metrics::decode::ROUTE_LOCAL);
        }
        let ended = self.decode_local(engine_req, deadline, out, token).await?;
        Ok(finished(ended, false))
    }

    /// Joins a remotely prefilled sequence and streams its tokens.
    async fn decode_prefilled(
        &self,
        req: Request,
        blocks: Vec<BlockId>,
        first: FirstToken,
        deadline: Option<Instant>,
        out: &mut Out,
        token: &CancellationToken,
    ) -> Result<(FinishReason, u32), WorkerError> {
        let sampled = SampledToken {
            id: first.id,
            logprob: first.logprob,
            top: first.top.iter().map(|t| (t.id, t.logprob)).collect(),
        };
        let (tx, rx) = mpsc::channel(self.inner.runner.max_events(req.params.max_tokens));
        let id = req.id;
        let runner = self.inner.runner.clone();
        let (b, s) = (blocks.clone(), sampled.clone());
        let deadline = deadline.map(Instant::into_std);
        let joined = blocking(move || runner.submit_prefilled(req, b, s, deadline, event_sink(tx))).await?;
        if let Err(e) = joined {
            // Not joined: the blocks are still ours.
            self.release(blocks).await;
            return Err(runner_err(&e));
        }
        if let Err(e) = out.token(chunk(&sampled)).await {
            self.abort_engine(id).await;
            return Err(e);
        }
        self.forward(id, rx, out, token).await
    }

    /// Prefills here and streams the tokens.
    async fn decode_local(
        &self,
        req: Request,
        deadline: Option<Instant>,
        out: &mut Out,
        token: &CancellationToken,
    ) -> Result<(FinishReason, u32), WorkerError> {
        let (tx, rx) = mpsc::channel(self.inner.runner.max_events(req.params.max_tokens));
        let id = req.id;
        let runner = self.inner.runner.clone();
        let deadline = deadline.map(Instant::into_std);
        blocking(move || runner.submit(req, deadline, event_sink(tx))).await?.map_err(|e| runner_err(&e))?;
        self.forward(id, rx, out, token).await
    }

    async fn abort_engine(&self, id: u64) {
        let runner = self.inner.runner.clone();
        // The runner answers false when the request already ended; either way it holds nothing now.
        let _ = blocking(move || runner.abort(id)).await;
    }

    /// Streams engine events until the request ends; returns why, and the
    /// prompt tokens the engine took from its prefix cache.
    async fn forward(
        &self,
        id: u64,
        mut events: mpsc::Receiver<RunnerEvent>,
        out: &mut Out,
        token: &CancellationToken,
    ) -> Result<(FinishReason, u32), WorkerError> {
        loop {
            let event = tokio::select! {
                ev = events.recv() => ev,
                _ = token.cancelled() => {
                    self.abort_engine(id).await;
                    return Err(err(ErrorKind::Cancelled, "aborted"));
                }
            };
            match event {
                Some(RunnerEvent::Token(t)) => {
                    if let Err(e) = out.token(chunk(&t)).await {
                        self.abort_engine(id).await;
                        return Err(e);
                    }
                }
                Some(RunnerEvent::Finished { reason, cached_prompt_tokens }) => {
                    let reason = match reason {
                        EngineFinish::Stop => FinishReason::Stop,
                        EngineFinish::Length => FinishReason::Length,
                    };
                    return Ok((reason, u32::try_from(cached_prompt_tokens).unwrap_or(u32::MAX)));
                }
                Some(RunnerEvent::Failed(e)) => return Err(runner_err(&e)),
                None => {
                    // The sink is gone without a terminal event (it panicked, or cut
                    // the stream, see `event_sink`): make sure the engine stops too.
                    self.abort_engine(id).await;
                    return Err(err(ErrorKind::Internal, "the engine's event stream ended without a terminal event"));
                }
            }
        }
    }

    async fn run(self, req: GenerateRequest, tx: mpsc::Sender<Result<GenerateResponse, Status>>) {
        let token = CancellationToken::new();
        // A caller that goes away cancels the request wherever it is.
        let watcher = {
            let (tx, token) = (tx.clone(), token.clone());
            tokio::spawn(async move {
                tokio::select! {
                    _ = tx.closed() => token.cancel(),
                    _ = token.cancelled() => {}
                }
            })
        };
        let mut out = Out { tx, arrived: Instant::now(), last: None, sent: 0, base: 0, attempts: Vec::new() };
        let request_id = req.request_id.clone();
        let result = self.serve(req, &mut out, &token).await;
        let (event, outcome) = match result {
            Ok(mut fin) => {
                fin.generated_tokens = out.sent;
                (generate_response::Event::Finished(fin), "ok")
            }
            Err(e) => {
                tracing::info!(request = %request_id, kind = ?e.kind(), message = %e.message, "generate failed");
                let label = worker_common::metrics::outcome_label(e.kind());
                (generate_response::Event::Error(e), label)
            }
        };
        m::record_outcome(outcome);
        // The caller may be gone; nothing else to tell then.
        let _ = out.send(event).await;
        watcher.abort();
        let runner = self.inner.runner.clone();
        if let Ok(Some(stats)) = blocking(move || runner.stats()).await {
            worker_common::metrics::record_stats(&stats);
        }
    }
}

/// The runner's sink for one request: events into `tx`, never waiting (it
/// runs on the engine thread). `tx` is as deep as the request has events
/// ([`RunnerHandle::max_events`]), so it is never full; should the engine
/// ever break that bound, the stream is cut rather than left with a gap:
/// the forwarder reads what came before, sees the end, and aborts the
/// request. A closed `tx` (the forwarder already returned and aborts the
/// request itself) drops the event.
fn event_sink(tx: mpsc::Sender<RunnerEvent>) -> Sink {
    let mut tx = Some(tx);
    Box::new(move |ev| {
        let Some(t) = &tx else { return };
        if let Err(TrySendError::Full(_)) = t.try_send(ev) {
            tracing::error!(capacity = t.max_capacity(), "a request's event queue is full; cutting its stream");
            tx = None;
        }
    })
}

type GenerateStream = Pin<Box<dyn tokio_stream::Stream<Item = Result<GenerateResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DecodeWorker for DecodeService {
    type GenerateStream = GenerateStream;

    async fn generate(&self, request: GrpcRequest<GenerateRequest>) -> Result<Response<GenerateStream>, Status> {
        let (tx, rx) = mpsc::channel(32);
        let req = request.into_inner();
        worker_common::metrics::record_request_class(req.priority().into());
        tokio::spawn(self.clone().run(req, tx));
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }

    async fn abort(&self, request: GrpcRequest<AbortRequest>) -> Result<Response<AbortResponse>, Status> {
        let id = request.into_inner().request_id;
        let token = lock(&self.inner.running).get(&id).cloned();
        let found = token.is_some();
        if let Some(t) = token {
            t.cancel();
        }
        Ok(Response::new(AbortResponse { found }))
    }

    async fn health(&self, request: GrpcRequest<HealthRequest>) -> Result<Response<HealthResponse>, Status> {
        let asked = request.into_inner();
        let i = &self.inner;
        let ready = i.ready.load(Ordering::SeqCst) && !i.fenced.load(Ordering::SeqCst);
        let extra = i.pending_remote.load(Ordering::SeqCst) as u32;
        worker_common::health::answer(&i.stats, &i.runner, ready, &i.local, extra, &asked).await.map(Response::new)
    }

    type WatchPrefixesStream = worker_common::prefix_feed::Updates;

    async fn watch_prefixes(
        &self,
        _: GrpcRequest<WatchPrefixesRequest>,
    ) -> Result<Response<Self::WatchPrefixesStream>, Status> {
        // Counted as Health counts them: the runner's and those waiting for remote KV.
        let inner = self.inner.clone();
        let extra = Arc::new(move || inner.pending_remote.load(Ordering::SeqCst) as u32);
        Ok(Response::new(self.inner.stats.watch(&self.inner.runner, extra)))
    }
}
