//! The `PrefillWorker` gRPC service.
//!
//! A request's life here: validate -> prefill-only on the runner -> push
//! each layer's KV to the destination reservation -> `Complete`/`Ack` ->
//! release the held blocks (always) -> answer with the first token. Every
//! failure is a typed `WorkerError` in the response, never a gRPC status.
//!
//! One KV connection per destination address is kept and reused; a
//! transfer holds it for its whole length (transfers to one decode worker
//! are serialised; they are bandwidth-bound anyway). Any error drops the
//! connection so the next request reconnects, and one the receiver closed
//! while it sat in the pool is replaced before a transfer uses it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use engine::batch::Request;
use engine::runner::{PrefillDone, RunnerError, RunnerHandle};
use engine::sampler::SampledToken;
use types::kv::KvLayout;

use kvtransfer::transport::DirectPool;
use kvtransfer::{
    AbortReason, Buffers, CertFingerprint, KvSender, LayoutFingerprint, LocalSenderConfig, Peer, PeerTrust,
    QuicSenderConfig, RejectReason, Reservation, ReservationId, SenderConfig, TcpSenderConfig, TlsIdentity,
    TransferError, TransportKind, UcxSenderConfig,
};
use proto::worker::v1::prefill_worker_server::PrefillWorker;
use proto::worker::v1::{
    prefill_response, AbortRequest, AbortResponse, ErrorKind, FirstToken, HealthRequest, HealthResponse,
    PrefillRequest, PrefillResponse, PrefillState, PrefillStatusRequest, PrefillStatusResponse, TopLogprob,
    WatchPrefixesRequest, WorkerError,
};
use tokio::sync::mpsc;
// Deadlines and timeouts on tokio's clock (paused in tests); the runner
// takes them as `into_std()`.
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::{Request as GrpcRequest, Response, Status};
use worker_common::serve::{blocking, err, local_deadline, runner_err};

mod sink;
use sink::{layer_sink, Pin, Streamed, Streams};

type Slot = Arc<tokio::sync::Mutex<Option<KvSender>>>;

/// Removes `key`'s slot from `table` when it is `ours`, empty, and held by nobody but
/// the table and us (no other request is using or waiting on it). Whether it went.
fn forget_idle(table: &mut HashMap<String, Slot>, key: &str, ours: &Slot) -> bool {
    let idle = table
        .get(key)
        .is_some_and(|s| Arc::ptr_eq(s, ours) && Arc::strong_count(s) == 2 && s.try_lock().is_ok_and(|g| g.is_none()));
    if idle {
        table.remove(key);
    }
    idle
}

/// One request this worker has accepted and not yet answered.
#[derive(Clone)]
struct Running {
    engine_id: u64,
    token: CancellationToken,
    /// Set by the engine's sink with the first computed layer: from then on
    /// the prompt is computing or being pushed, no longer queued.
    computing: Arc<AtomicBool>,
}

/// How this worker connects to destinations.
#[derive(Debug, Clone)]
pub struct TransferSettings {
    /// Connect, each frame's write and the Ack, on every transport.
    pub timeout: std::time::Duration,
    /// QUIC: trust decode workers' certificates issued by this CA; without
    /// it, pin the self-signed certificate a destination names.
    pub quic_ca: Option<PeerTrust>,
    /// QUIC: this worker's certificate, for decode workers that require one.
    pub quic_identity: Option<TlsIdentity>,
    /// tcp: the engine's pool in mapped memory (`--tcp-pinned`): each layer is sent
    /// straight from its blocks ([`kvtransfer::PinnedLayer`]), not gathered into a buffer.
    pub pinned: Option<DirectPool>,
}

/// Where one request's KV goes.
#[derive(Debug, Clone)]
struct Dest {
    kind: TransportKind,
    addr: String,
    /// QUIC: the destination's self-signed certificate to pin.
    pin: Option<[u8; 32]>,
}

impl Dest {
    /// Connections are reused per transport, address and pinned certificate.
    fn key(&self) -> String {
        let pin = self.pin.map(|p| CertFingerprint(p).to_string()).unwrap_or_default();
        format!("{}://{}#{pin}", self.kind, self.addr)
    }
}

/// Shared state of the service (cheap to clone).
#[derive(Clone)]
pub struct PrefillService {
    inner: Arc<Inner>,
}

struct Inner {
    runner: RunnerHandle,
    /// The runner's last counters, for Health while the runner is mid-step.
    stats: worker_common::health::StatsCache,
    layout: KvLayout,
    local: Peer,
    transfer: TransferSettings,
    /// Process-level token: cancelled at the end of shutdown.
    shutdown: CancellationToken,
    ready: AtomicBool,
    /// Set while fenced: another process holds this worker's etcd key, or no
    /// coordinator has called `Health` for the silence bound (`serve::Fencing`).
    fenced: AtomicBool,
    next_id: AtomicU64,
    /// Wire request id -> engine id, the request's token, and whether the
    /// engine has computed a layer of it yet (`PrefillStatus`).
    running: Mutex<HashMap<String, Running>>,
    senders: Mutex<HashMap<String, Slot>>,
    /// Gathered layers' buffers, recycled: the engine thread gathers each
    /// layer into one that came home from an earlier send, not a fresh
    /// allocation faulted in mid-step.
    layer_buffers: Buffers,
}

/// Most bytes of idle layer buffers a prefill worker keeps: a 2,800-token
/// prompt's whole KV on SmolLM2-135M.
const LAYER_BUFFER_BYTES: usize = 64 << 20;

fn transfer_err(e: &TransferError) -> WorkerError {
    crate::metrics::record_transfer_failure(e.as_str());
    let kind = match e {
        TransferError::Io(_) => ErrorKind::Retryable,
        TransferError::Rejected { reason: RejectReason::Fingerprint | RejectReason::VersionGroup } => {
            ErrorKind::VersionMismatch
        }
        _ => ErrorKind::KvLoadFailed,
    };
    err(kind, format!("KV transfer: {e}"))
}

/// Removes the request's id mapping and, unless disarmed, aborts it in the
/// engine (which also frees held blocks) and then refreshes the gauges, on
/// the blocking pool without waiting: covers the caller going away, and a
/// pushed prompt released behind its answer.
/// `gone` is set first, for a submission still on the blocking pool when the
/// caller went away: it aborts what it just submitted (the abort spawned here
/// may run before it), so a prefill nobody waits for never keeps its blocks.
struct Cleanup {
    inner: Arc<Inner>,
    request_id: String,
    engine_id: u64,
    armed: bool,
    gone: Arc<AtomicBool>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        self.gone.store(true, Ordering::SeqCst);
        if let Ok(mut m) = self.inner.running.lock() {
            m.remove(&self.request_id);
        }
        if self.armed {
            let runner = self.inner.runner.clone();
            let id = self.engine_id;
            // Outside a runtime (never in practice) the runner's own deadline frees it.
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn_blocking(move || {
                    runner.abort(id);
                    refresh_gauges(&runner);
                });
            }
        }
    }
}

impl PrefillService {
    pub fn new(
        runner: RunnerHandle,
        layout: KvLayout,
        local: Peer,
        transfer: TransferSettings,
        shutdown: CancellationToken,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                runner,
                stats: worker_common::health::StatsCache::default(),
                layout,
                local,
                transfer,
                shutdown,
                ready: AtomicBool::new(true),
                fenced: AtomicBool::new(false),
                next_id: AtomicU64::new(1),
                running: Mutex::new(HashMap::new()),
                senders: Mutex::new(HashMap::new()),
                layer_buffers: Buffers::new(LAYER_BUFFER_BYTES),
            }),
        }
    }

    /// Fenced: take no new work. Told by [`worker_common::serve::Fencing`], which fences
    /// when another process holds this worker's etcd key (`FenceReason::KeyTaken`)
    /// or when no coordinator has called `Health` for `--coordinator-silence-fence-ms`;
    /// never because etcd is unreachable (docs/REGISTRY.md, static stability).
    pub fn set_fenced(&self, fenced: bool) {
        self.inner.fenced.store(fenced, Ordering::SeqCst);
    }

    /// Stops reporting ready (the first phase of shutdown).
    pub fn set_draining(&self) {
        self.inner.ready.store(false, Ordering::SeqCst);
        // Long-lived streams would hold the server's graceful shutdown for its whole grace.
        self.inner.stats.close_watches();
    }

    fn validate(
        &self,
        req: &PrefillRequest,
    ) -> Result<(types::sampling::SamplingParams, Reservation, Dest), WorkerError> {
        let bad = |m: &str| Err(err(ErrorKind::InvalidArgument, m));
        if req.request_id.is_empty() {
            return bad("request_id is empty");
        }
        if req.token_ids.is_empty() {
            return bad("token_ids is empty");
        }
        let Some(sampling) = req.sampling.as_ref() else { return bad("sampling is required") };
        let params = types::sampling::SamplingParams::try_from(sampling).map_err(|e| WorkerError::from(&e))?;
        let Some(d) = req.destination.as_ref() else { return bad("destination is required") };
        let Some(kind) = TransportKind::parse(&d.transport) else {
            return Err(err(
                ErrorKind::InvalidArgument,
                format!("destination.transport {:?} is not supported (tcp, quic, local, ucx)", d.transport),
            ));
        };
        if d.transfer_addr.is_empty() {
            return bad("destination.transfer_addr is empty");
        }
        let pin = match d.tls_cert_sha256.len() {
            0 => None,
            _ => Some(<[u8; 32]>::try_from(d.tls_cert_sha256.as_slice()).map_err(|_| {
                err(
                    ErrorKind::InvalidArgument,
                    format!("destination.tls_cert_sha256 is {} bytes; 32 expected", d.tls_cert_sha256.len()),
                )
            })?),
        };
        if kind == TransportKind::Quic && pin.is_none() && self.inner.transfer.quic_ca.is_none() {
            return bad("destination is quic with a CA-issued certificate, and this prefill worker has no quic_ca");
        }
        let dest = Dest { kind, addr: d.transfer_addr.clone(), pin };
        let Ok(fp) = <[u8; 32]>::try_from(d.layout_fingerprint.as_slice()) else {
            return Err(err(
                ErrorKind::InvalidArgument,
                format!("destination.layout_fingerprint is {} bytes; 32 expected", d.layout_fingerprint.len()),
            ));
        };
        if d.version_group != self.inner.local.version_group.as_str() {
            return Err(err(
                ErrorKind::VersionMismatch,
                format!(
                    "destination.version_group {:?} differs from ours {:?}",
                    d.version_group,
                    self.inner.local.version_group.as_str()
                ),
            ));
        }
        if LayoutFingerprint::from_bytes(fp) != self.inner.local.fingerprint {
            return Err(err(
                ErrorKind::VersionMismatch,
                format!(
                    "destination.layout_fingerprint {} differs from ours {}",
                    LayoutFingerprint::from_bytes(fp),
                    self.inner.local.fingerprint
                ),
            ));
        }
        // This worker samples the request's first token: it must draw the way the decode
        // worker (and any worker continuing the request) draws.
        let own = worker_common::serve::determinism(&self.inner.local.fingerprint);
        if !req.determinism_fingerprint.is_empty() && req.determinism_fingerprint != own {
            return Err(err(
                ErrorKind::VersionMismatch,
                format!(
                    "determinism_fingerprint {} differs from ours {} (another sampler or kernel numerics class)",
                    worker_common::serve::hex(&req.determinism_fingerprint),
                    worker_common::serve::hex(&own)
                ),
            ));
        }
        // After the identity checks: a different block size shows up as a
        // block count mismatch, which is a version mismatch in disguise.
        let need = (req.token_ids.len() + req.generated_ids.len()).div_ceil(self.inner.layout.block_size);
        if d.block_ids.len() != need {
            return Err(err(
                ErrorKind::InvalidArgument,
                format!("destination.block_ids has {} blocks; the prompt needs {need}", d.block_ids.len()),
            ));
        }
        Ok((params, Reservation { id: ReservationId(d.reservation_id), generation: d.generation }, dest))
    }

    async fn prefill_inner(&self, req: PrefillRequest) -> Result<FirstToken, WorkerError> {
        let (params, reservation, dest) = self.validate(&req)?;
        let deadline = local_deadline(req.deadline_unix_ms);
        let inner = &self.inner;
        worker_common::serve::accepting(&inner.ready, &inner.fenced)?;
        let engine_id = inner.next_id.fetch_add(1, Ordering::Relaxed);
        #[cfg(feature = "fault-injection")]
        let planted = crate::plant::next();
        let token = inner.shutdown.child_token();
        let computing = Arc::new(AtomicBool::new(false));
        {
            let mut m = inner.running.lock().map_err(|_| err(ErrorKind::Internal, "request map poisoned"))?;
            if m.contains_key(&req.request_id) {
                return Err(err(
                    ErrorKind::InvalidArgument,
                    format!("request_id {:?} is already running here", req.request_id),
                ));
            }
            m.insert(req.request_id.clone(), Running { engine_id, token: token.clone(), computing: computing.clone() });
        }
        let gone = Arc::new(AtomicBool::new(false));
        // Armed before the submission: the caller may go away while it is on the blocking pool.
        let mut cleanup = Cleanup {
            inner: inner.clone(),
            request_id: req.request_id.clone(),
            engine_id,
            armed: true,
            gone: gone.clone(),
        };

        // The engine streams each layer's newly complete blocks from inside
        // its forward pass; the push sends them while later layers (and
        // later chunks) compute. Every message carries at least one block
        // and each (layer, block) comes once, so the prompt's messages never
        // outnumber layers x blocks: a queue that deep is never full, and
        // holds at most one copy of the prompt's KV (which the engine's pool
        // holds anyway) however far the push falls behind.
        let tokens = req.token_ids.len() + req.generated_ids.len();
        let depth = (inner.layout.n_layers * inner.runner.blocks_for(tokens)).max(1);
        let (layer_tx, layer_rx) = mpsc::channel::<Streamed>(depth);
        // Filled by the push once the transport grants one (ucx, same host): then
        // the engine's thread stores each layer straight into the decode pool.
        let writer = Arc::new(OnceLock::new());
        let (done_tx, done_rx) = tokio::sync::oneshot::channel::<Result<PrefillDone, RunnerError>>();
        let runner = inner.runner.clone();
        let writer_for_sink = writer.clone();
        let buffers = inner.layer_buffers.clone();
        // tcp with the pool in mapped memory: the engine's thread only checksums each
        // layer of the prompt's last step where it lies, and the push writes it from there
        // (see `Pin`).
        let pin = match (dest.kind, &inner.transfer.pinned) {
            (TransportKind::Tcp, Some(_)) => Some(Pin {
                layout: inner.layout,
                max_frame_bytes: TcpSenderConfig::default().max_frame_bytes,
                prompt_blocks: inner.runner.blocks_for(tokens),
            }),
            _ => None,
        };
        let engine_req = Request {
            id: engine_id,
            prompt: req.token_ids.clone(),
            params,
            salt: req.cache_salt,
            priority: req.priority().into(),
            generated: req.generated_ids.clone(),
        };
        let started = Instant::now();
        let runner_deadline = deadline.map(Instant::into_std);
        // A planted leak keeps its blocks past any deadline too.
        #[cfg(feature = "fault-injection")]
        let runner_deadline = runner_deadline.filter(|_| !planted.leak_blocks);
        blocking(move || {
            let submitted = runner.submit_prefill_streaming(
                engine_req,
                runner_deadline,
                layer_sink(layer_tx, computing, writer_for_sink, buffers, pin),
                Box::new(move |r| drop(done_tx.send(r))),
            );
            // The caller went away while this waited for a blocking thread (a control-link
            // reset in the control-link-resets drill): nobody will push or release this
            // prefill, and Cleanup's abort may have run before the submission. Seen as 3
            // blocks held on the prefill worker until the request's deadline (G2).
            if gone.load(Ordering::SeqCst) {
                let _ = runner.abort(engine_id);
            }
            submitted
        })
        .await?
        .map_err(|e| runner_err(&e))?;

        let streams = Streams { layers: layer_rx, writer };
        let push = self.push(&dest, reservation, streams, done_rx, started, tokens, &token);
        let pushed = match deadline {
            Some(d) => match tokio::time::timeout_at(d, push).await {
                Ok(r) => r,
                Err(_) => {
                    crate::metrics::record_transfer_failure("deadline");
                    Err(err(ErrorKind::Deadline, "deadline passed during the prefill or its KV transfer"))
                }
            },
            None => push.await,
        };
        // Always: the prefill worker keeps no KV, whatever the transfer did.
        // Abort covers both ends: a request still computing (the push failed
        // early) is stopped, a finished one's held blocks are released. A
        // failed one is stopped before the answer goes out. A pushed one is
        // answered at once, and `cleanup` (still armed) releases its held
        // blocks and refreshes the gauges behind the answer: the runner takes
        // a command only between steps, and waiting for it held the first
        // token back by whatever step ran meanwhile, often other prompts'
        // whole prefill (a wave of four prompts at once: 0.85 s on two).
        if pushed.is_err() {
            let runner = inner.runner.clone();
            blocking(move || runner.abort(engine_id)).await?;
            cleanup.armed = false;
        }
        let Pushed { first, cached_prompt_tokens, bytes, seconds } = pushed?;
        crate::metrics::record_transfer(bytes, seconds);
        #[allow(unused_mut, reason = "only a planted bug changes it")]
        let mut id = first.id;
        #[cfg(feature = "fault-injection")]
        {
            if planted.leak_blocks {
                cleanup.armed = false;
                crate::metrics::record_planted("leak_blocks");
            }
            if planted.swap_first_token {
                id = crate::plant::swapped(id);
                crate::metrics::record_planted("swap_token");
            }
        }
        Ok(FirstToken {
            id,
            logprob: first.logprob,
            top: first.top.iter().map(|&(id, logprob)| TopLogprob { id, logprob }).collect(),
            kv_layers_sent: inner.layout.n_layers as u32,
            kv_bytes_sent: bytes,
            cached_prompt_tokens: u32::try_from(cached_prompt_tokens).unwrap_or(u32::MAX),
        })
    }

    fn slot(&self, dest: &Dest) -> Result<Slot, WorkerError> {
        let mut m = self.inner.senders.lock().map_err(|_| err(ErrorKind::Internal, "sender map poisoned"))?;
        Ok(m.entry(dest.key()).or_default().clone())
    }

    async fn connect(&self, dest: &Dest) -> Result<KvSender, WorkerError> {
        let inner = &self.inner;
        let t = &inner.transfer;
        let (local, layout, addr) = (&inner.local, inner.layout, dest.addr.as_str());
        let config = match dest.kind {
            TransportKind::Tcp => {
                SenderConfig::Tcp(TcpSenderConfig { timeout: t.timeout, ..TcpSenderConfig::default() })
            }
            TransportKind::Local => {
                SenderConfig::Local(LocalSenderConfig { timeout: t.timeout, ..LocalSenderConfig::default() })
            }
            TransportKind::Ucx => {
                SenderConfig::Ucx(UcxSenderConfig { timeout: t.timeout, ..UcxSenderConfig::default() })
            }
            TransportKind::Quic => {
                let trust = match (&t.quic_ca, dest.pin) {
                    (Some(ca), _) => ca.clone(),
                    (None, Some(pin)) => PeerTrust::Pinned(CertFingerprint(pin)),
                    (None, None) => {
                        return Err(err(ErrorKind::InvalidArgument, "no way to trust the QUIC destination"))
                    }
                };
                let mut config = QuicSenderConfig::new(trust);
                config.identity = t.quic_identity.clone();
                config.timeout = t.timeout;
                SenderConfig::Quic(config)
            }
        };
        let sender = KvSender::connect(addr, local, layout, config).await;
        sender.map_err(|e| transfer_err(&e))
    }

    /// Sends the streamed blocks as they come, then (once the engine is
    /// done) `Complete`.
    #[allow(clippy::too_many_arguments)]
    async fn push(
        &self,
        dest: &Dest,
        r: Reservation,
        layers: Streams,
        done: tokio::sync::oneshot::Receiver<Result<PrefillDone, RunnerError>>,
        started: Instant,
        prompt_tokens: usize,
        token: &CancellationToken,
    ) -> Result<Pushed, WorkerError> {
        let slot = self.slot(dest)?;
        let mut guard = slot.lock().await;
        // Out of the slot while in use: if this future is dropped mid-frame
        // (the caller went away), the half-written connection is dropped with
        // it instead of being reused out of sync.
        let mut conn = guard.take();
        let result = tokio::select! {
            r = self.push_on(&mut conn, dest, r, layers, done, started, prompt_tokens) => r,
            _ = token.cancelled() => Err(err(ErrorKind::Cancelled, "aborted during the KV transfer")),
        };
        // A connection that saw an error is not trusted for the next request.
        if result.is_ok() {
            *guard = conn;
        } else {
            drop(guard);
            self.forget_slot(dest, &slot);
        }
        result
    }

    /// Drops `dest`'s empty slot from the table once nobody else holds it: a decode
    /// worker that restarted listens at another address (a new port, a new pod IP), so
    /// the slots of failed destinations would otherwise pile up for this worker's life.
    fn forget_slot(&self, dest: &Dest, slot: &Slot) {
        if let Ok(mut m) = self.inner.senders.lock() {
            forget_idle(&mut m, &dest.key(), slot);
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn push_on(
        &self,
        conn: &mut Option<KvSender>,
        dest: &Dest,
        r: Reservation,
        streams: Streams,
        done: tokio::sync::oneshot::Receiver<Result<PrefillDone, RunnerError>>,
        started: Instant,
        prompt_tokens: usize,
    ) -> Result<Pushed, WorkerError> {
        let Streams { mut layers, writer } = streams;
        let inner = &self.inner;
        // A pooled connection the receiver has closed meanwhile (its idle
        // timeout, 30 s by default; a restart) would fail this transfer on its
        // first frame: replace it first. Nothing of this transfer went out on it.
        if let Some(Err(e)) = conn.as_mut().map(KvSender::check_open) {
            tracing::info!(dest = %dest.addr, error = %e, "the pooled KV connection was closed by the receiver; reconnecting");
            crate::metrics::record_stale_connection();
            *conn = None;
        }
        if conn.is_none() {
            // Connects while the engine computes the first layers.
            *conn = Some(self.connect(dest).await?);
        }
        let Some(sender) = conn.as_mut() else { return Err(err(ErrorKind::Internal, "no KV connection")) };
        // Layers the engine computes from now on skip the gather where the
        // transport lets its thread store them in place (ucx on one host).
        if let Some(w) = sender.direct_writer(r).await.map_err(|e| transfer_err(&e))? {
            let _ = writer.set(w);
        }
        let mut bytes = 0u64;
        let mut first_sent = None;
        // Ends when the engine drops the sink: after the last block, or when
        // the request failed (then `done` says how).
        let mut next = layers.recv().await;
        while let Some(c) = next.take() {
            first_sent.get_or_insert_with(Instant::now);
            match c {
                Streamed::Pinned(p) => {
                    let Some(pool) = &inner.transfer.pinned else {
                        return Err(err(ErrorKind::Internal, "a pinned layer without a mapped pool"));
                    };
                    bytes += p.payload_bytes(&inner.layout) as u64;
                    sender.send_pinned(r, &p, pool).await.map_err(|e| transfer_err(&e))?;
                    crate::metrics::record_layers_sent("pinned", 1);
                }
                Streamed::Gathered(c) => {
                    bytes += (c.k.len() + c.v.len()) as u64;
                    sender
                        .send_blocks_owned(r, c.layer, c.first_block, c.k, c.v)
                        .await
                        .map_err(|e| transfer_err(&e))?;
                    crate::metrics::record_layers_sent("gathered", 1);
                }
                Streamed::Stored(s) => {
                    // Whatever the engine stored meanwhile goes in the same hand-over:
                    // one wake-up of the connection's thread, not one per layer.
                    let mut batch = vec![s];
                    loop {
                        match layers.try_recv() {
                            Ok(Streamed::Stored(s)) => batch.push(s),
                            Ok(other) => {
                                next = Some(other);
                                break;
                            }
                            Err(_) => break,
                        }
                    }
                    bytes += batch.iter().map(|s| s.bytes as u64).sum::<u64>();
                    let n = batch.len() as u64;
                    sender.announce(batch).await.map_err(|e| transfer_err(&e))?;
                    crate::metrics::record_layers_sent("in_place", n);
                }
            }
            if next.is_none() {
                next = layers.recv().await;
            }
        }
        let finished = done.await.map_err(|_| err(ErrorKind::Internal, "runner dropped the request"))?;
        let finished = match finished {
            Ok(d) => d,
            Err(e) => {
                // Tell the receiver now rather than let its lease run out.
                let _ = sender.abort(r, AbortReason::PrefillFailed).await;
                return Err(runner_err(&e));
            }
        };
        crate::metrics::record_prefill(prompt_tokens, started.elapsed().as_secs_f64());
        let expected = (finished.blocks.len() * inner.layout.block_bytes()) as u64;
        if bytes != expected {
            let _ = sender.abort(r, AbortReason::PrefillFailed).await;
            return Err(err(ErrorKind::Internal, format!("streamed {bytes} KV bytes, the prompt has {expected}")));
        }
        sender.complete(r).await.map_err(|e| transfer_err(&e))?;
        let seconds = first_sent.map_or(0.0, |t| t.elapsed().as_secs_f64());
        Ok(Pushed { first: finished.first, cached_prompt_tokens: finished.cached_prompt_tokens, bytes, seconds })
    }
}

/// Sets the engine gauges from the runner's counters (a stopped runner leaves
/// them as they were). Waits for the runner to take the ask: between steps.
fn refresh_gauges(runner: &RunnerHandle) {
    if let Some(stats) = runner.stats() {
        worker_common::metrics::record_stats(&stats);
    }
}

/// A prefill whose KV was pushed and acknowledged.
struct Pushed {
    first: SampledToken,
    /// Prompt tokens this worker's prefix cache supplied (not computed).
    cached_prompt_tokens: usize,
    /// KV payload bytes sent.
    bytes: u64,
    /// From the first frame sent to the Ack.
    seconds: f64,
}

#[tonic::async_trait]
impl PrefillWorker for PrefillService {
    async fn prefill(&self, request: GrpcRequest<PrefillRequest>) -> Result<Response<PrefillResponse>, Status> {
        let req = request.into_inner();
        worker_common::metrics::record_request_class(req.priority().into());
        let outcome = match self.prefill_inner(req).await {
            Ok(first) => {
                crate::metrics::record_outcome("ok");
                prefill_response::Outcome::FirstToken(first)
            }
            Err(e) => {
                tracing::info!(kind = ?e.kind(), message = %e.message, "prefill failed");
                crate::metrics::record_outcome(worker_common::metrics::outcome_label(e.kind()));
                // Gauges follow the runner after every request; a pushed one's are
                // refreshed behind its answer, with its release (`Cleanup`).
                let runner = self.inner.runner.clone();
                let _ = blocking(move || refresh_gauges(&runner)).await;
                prefill_response::Outcome::Error(e)
            }
        };
        Ok(Response::new(PrefillResponse { outcome: Some(outcome) }))
    }

    async fn abort(&self, request: GrpcRequest<AbortRequest>) -> Result<Response<AbortResponse>, Status> {
        let id = request.into_inner().request_id;
        let found = self.inner.running.lock().ok().and_then(|m| m.get(&id).cloned());
        let Some(Running { engine_id, token, .. }) = found else {
            return Ok(Response::new(AbortResponse { found: false }));
        };
        // Token first: a gather that runs after the engine abort sees it.
        token.cancel();
        let runner = self.inner.runner.clone();
        blocking(move || runner.abort(engine_id)).await.map_err(|e| Status::internal(e.message))?;
        Ok(Response::new(AbortResponse { found: true }))
    }

    async fn prefill_status(
        &self,
        request: GrpcRequest<PrefillStatusRequest>,
    ) -> Result<Response<PrefillStatusResponse>, Status> {
        let id = request.into_inner().request_id;
        let running = self.inner.running.lock().map_err(|_| Status::internal("request map poisoned"))?;
        let state = match running.get(&id) {
            None => PrefillState::Unknown,
            Some(r) if r.computing.load(Ordering::Relaxed) => PrefillState::Running,
            Some(_) => PrefillState::Queued,
        };
        Ok(Response::new(PrefillStatusResponse { state: state.into() }))
    }

    async fn health(&self, request: GrpcRequest<HealthRequest>) -> Result<Response<HealthResponse>, Status> {
        let asked = request.into_inner();
        let i = &self.inner;
        let ready = i.ready.load(Ordering::SeqCst) && !i.fenced.load(Ordering::SeqCst);
        let extra = 0;
        worker_common::health::answer(&i.stats, &i.runner, ready, &i.local, extra, &asked).await.map(Response::new)
    }

    type WatchPrefixesStream = worker_common::prefix_feed::Updates;

    async fn watch_prefixes(
        &self,
        _: GrpcRequest<WatchPrefixesRequest>,
    ) -> Result<Response<Self::WatchPrefixesStream>, Status> {
        // The waiting count is the runner's alone, as in Health.
        Ok(Response::new(self.inner.stats.watch(&self.inner.runner, Arc::new(|| 0))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_failed_destinations_slot_goes_only_when_nobody_else_holds_it() {
        let mut table: HashMap<String, Slot> = HashMap::new();
        let slot = table.entry("tcp://10.0.0.7:9000#".into()).or_default().clone();
        let waiting = slot.clone();
        assert!(!forget_idle(&mut table, "tcp://10.0.0.7:9000#", &slot), "another request waits on it");
        drop(waiting);
        let other: Slot = Slot::default();
        assert!(!forget_idle(&mut table, "tcp://10.0.0.7:9000#", &other), "not the slot we used");
        let held = slot.lock().await;
        assert!(!forget_idle(&mut table, "tcp://10.0.0.7:9000#", &slot), "in use");
        drop(held);
        assert!(forget_idle(&mut table, "tcp://10.0.0.7:9000#", &slot));
        assert!(table.is_empty());
        assert!(!forget_idle(&mut table, "tcp://10.0.0.7:9000#", &slot), "gone already");
    }
}
