//! Start-up and request plumbing shared by both workers: loading the model
//! into an engine, computing the layout fingerprint, mapping runner errors
//! onto wire kinds, deadlines, and the start and end of both binaries
//! (logging, CPU placement, runtime; announcing the drain, joining the
//! runner, deregistering).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use engine::batch::Engine;
use engine::model::Model;
use engine::runner::{ErrorKind as RunnerKind, RunnerError};
use engine::tokenizer::Tokenizer;
use engine::weights::digest::weights_digest;
use engine::weights::Weights;
use kvtransfer::LayoutFingerprint;
use proto::worker::v1::{ErrorKind, WorkerError};
use types::kv::KvLayout;

use crate::config::CommonConfig;

/// A loaded model, ready to hand to a runner.
pub struct Loaded {
    pub engine: Engine,
    pub layout: KvLayout,
    pub fingerprint: LayoutFingerprint,
    pub tokenizer: Tokenizer,
}

/// Loads the model named by `cfg`, hashes its file (the weights digest in
/// the fingerprint, and the key of the host's shared panels) and builds the
/// engine.
pub fn load(cfg: &CommonConfig) -> anyhow::Result<Loaded> {
    let (weights, gguf) = Weights::from_gguf(&cfg.model).with_context(|| format!("loading {}", cfg.model.display()))?;
    let tokenizer = Tokenizer::from_gguf(&gguf).context("loading the tokenizer")?;
    let digest = weights_digest(&cfg.model).with_context(|| format!("hashing {}", cfg.model.display()))?;
    let started = tokio::time::Instant::now();
    let (model, panels) = Model::load(weights, cfg.threads, &cfg.panels.home(digest))
        .context("building the model (set `panel_dir` to `off` for private weight panels)")?;
    tracing::info!(ms = started.elapsed().as_millis() as u64, "weight panels: {panels}");
    let layout = model.kv_layout(cfg.kv_block_size, cfg.kv_dtype);
    let fingerprint = LayoutFingerprint::new(&layout, &digest, &tokenizer.digest());
    let mut engine = Engine::new(model, cfg.engine(), tokenizer.eos_ids().to_vec()).context("building the engine")?;
    // Back the KV pool with memory before serving: otherwise the engine
    // thread faults it in block by block under load (a stall in a running
    // stream's step), and a pool the host cannot hold is found out by the
    // OOM killer mid-request instead of here.
    let started = tokio::time::Instant::now();
    let bytes = engine.pool_mut().commit().context("committing the KV pool (lower `kv_blocks`?)")?;
    tracing::info!(mib = bytes >> 20, ms = started.elapsed().as_millis() as u64, "KV pool committed");
    // The same for the step buffers, sized for the largest step the config allows.
    let bytes = engine.reserve_scratch();
    tracing::info!(mib = bytes >> 20, "step buffers reserved");
    Ok(Loaded { engine, layout, fingerprint, tokenizer })
}

pub fn err(kind: ErrorKind, message: impl Into<String>) -> WorkerError {
    WorkerError::new(kind, message)
}

/// The wire kind of a runner error.
pub fn runner_err(e: &RunnerError) -> WorkerError {
    let kind = match e.kind() {
        RunnerKind::InvalidInput => ErrorKind::InvalidArgument,
        RunnerKind::Overloaded => ErrorKind::Overloaded,
        RunnerKind::Deadline => ErrorKind::Deadline,
        RunnerKind::Cancelled => ErrorKind::Cancelled,
        RunnerKind::ShuttingDown => ErrorKind::Retryable,
        RunnerKind::Internal => ErrorKind::Internal,
    };
    err(kind, e.to_string())
}

/// Runs a blocking runner call off the async threads.
pub async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, WorkerError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| err(ErrorKind::Internal, format!("runner call failed: {e}")))
}

/// The wire's wall-clock deadline on tokio's clock; `None` for 0.
///
/// Only the time left is taken from the wall clock, once, here; from then
/// on the deadline is a `tokio::time::Instant`, so every timeout and check
/// against it follows tokio's clock (paused in tests). The runner thread,
/// which is not async, takes it as `into_std()`.
pub fn local_deadline(unix_ms: u64) -> Option<tokio::time::Instant> {
    if unix_ms == 0 {
        return None;
    }
    let now_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    Some(tokio::time::Instant::now() + Duration::from_millis(unix_ms.saturating_sub(now_ms)))
}

/// A deadline on tokio's clock as wall-clock ms for the wire; 0 for none.
pub fn unix_deadline(deadline: Option<tokio::time::Instant>) -> u64 {
    let Some(d) = deadline else { return 0 };
    let now_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    // At least 1 ms from the epoch: 0 would mean "no deadline".
    (now_ms + d.saturating_duration_since(tokio::time::Instant::now()).as_millis() as u64).max(1)
}

/// Moves the engine's (still empty) KV pool into memory kvtransfer maps and returns its
/// view: a decode worker's TCP server reads payloads straight into its blocks
/// (`tcp_direct`), a prefill worker's TCP sender writes frames straight from them
/// (`tcp_pinned`). Call before anything can use the pool (before the listeners bind).
/// `what` names the use in the log and errors.
pub async fn pool_memory(
    runner: &engine::runner::RunnerHandle,
    what: &'static str,
) -> anyhow::Result<kvtransfer::transport::DirectPool> {
    let r = runner.clone();
    let (layout, blocks) =
        tokio::task::spawn_blocking(move || r.with_pool(|p| (*p.layout(), p.num_blocks()))).await??;
    let memory = kvtransfer::transport::PoolMemory::new(layout, blocks)
        .with_context(|| format!("mapping the KV pool ({what})"))?;
    let (view, bytes, r) = (memory.direct(), layout.pool_bytes(blocks).unwrap_or(0), runner.clone());
    let shared = memory.into_shared();
    tokio::task::spawn_blocking(move || r.with_pool(move |p| p.adopt(shared)))
        .await??
        .with_context(|| format!("moving the KV pool into mapped memory ({what})"))?;
    tracing::info!(bytes, what, "KV pool in mapped memory");
    Ok(view)
}

/// Binds the gRPC listener, prints `listening grpc=ADDR` and logs readiness.
pub async fn bind_grpc(cfg: &CommonConfig, fingerprint: &LayoutFingerprint) -> anyhow::Result<tokio::net::TcpListener> {
    let listener =
        tokio::net::TcpListener::bind(cfg.grpc).await.with_context(|| format!("binding grpc {}", cfg.grpc))?;
    let addr = listener.local_addr()?;
    let start_to_ready_ms = STARTED.get().map_or(0, |t| t.elapsed().as_millis() as u64);
    // Logged first: whoever waits for the `listening` line finds `ready` in the log.
    tracing::info!(%addr, fingerprint = %fingerprint, group = cfg.version_group.as_str(), start_to_ready_ms, "ready");
    println!("listening grpc={addr}");
    Ok(listener)
}

/// Serves `router` on `listener` until the returned token is cancelled;
/// in-flight calls then finish before the task ends.
pub fn spawn_grpc(
    router: tonic::transport::server::Router<tower::layer::util::Stack<HealthSeenLayer, tower::layer::util::Identity>>,
    listener: tokio::net::TcpListener,
) -> (tokio::task::JoinHandle<Result<(), tonic::transport::Error>>, tokio_util::sync::CancellationToken) {
    let stop = tokio_util::sync::CancellationToken::new();
    let incoming = registry::grpc::incoming(listener);
    let task = tokio::spawn(router.serve_with_incoming_shutdown(incoming, stop.clone().cancelled_owned()));
    (task, stop)
}

/// The standard `grpc.health.v1.Health` service on the worker's gRPC port, for
/// probes (Kubernetes `grpc:` readiness) that need no client in the image: the
/// empty service name is SERVING while the worker takes new work, NOT_SERVING once
/// it is fenced or draining. Coordinators keep calling the worker's own `Health`
/// RPC (load, fingerprint); a probe's `Check` is not a coordinator's call, so it
/// keeps no fence away.
#[derive(Clone)]
pub struct Probe {
    state: tokio::sync::watch::Sender<ProbeState>,
}

#[derive(Default, Clone, Copy)]
struct ProbeState {
    fenced: bool,
    draining: bool,
}

impl Probe {
    /// The probe and its service (add it to the worker's gRPC router). One task
    /// mirrors the latest state into the health service, in order.
    pub fn start() -> (Self, tonic_health::pb::health_server::HealthServer<impl tonic_health::pb::health_server::Health>)
    {
        let (reporter, server) = tonic_health::server::health_reporter();
        let (state, mut changes) = tokio::sync::watch::channel(ProbeState::default());
        tokio::spawn(async move {
            loop {
                let now = *changes.borrow_and_update();
                let status = if now.fenced || now.draining {
                    tonic_health::ServingStatus::NotServing
                } else {
                    tonic_health::ServingStatus::Serving
                };
                reporter.set_service_status("", status).await;
                if changes.changed().await.is_err() {
                    break;
                }
            }
        });
        (Self { state }, server)
    }

    pub fn fenced(&self, fenced: bool) {
        self.state.send_modify(|s| s.fenced = fenced);
    }

    /// From the drain on, for good.
    pub fn draining(&self) {
        self.state.send_modify(|s| s.draining = true);
    }
}

/// Whether this worker takes new work, from its two reasons not to:
/// another process holds its etcd key (the registry says so), or it is cut
/// off from its coordinators (no `Health` call for the configured silence,
/// after at least one). An unreachable etcd is neither: the worker serves on
/// (docs/REGISTRY.md, "Serving through an etcd outage").
pub struct Fencing {
    state: std::sync::Mutex<FenceState>,
    apply: Box<dyn Fn(bool) + Send + Sync>,
}

#[derive(Default)]
struct FenceState {
    registry: bool,
    cut_off: bool,
    /// The last coordinator `Health` call; `None` until the first.
    last_health: Option<tokio::time::Instant>,
    fenced: bool,
}

impl Fencing {
    /// Starts serving (unfenced); `apply(fenced)` is told every change. With
    /// `silence`, a task fences once no `Health` call came for that long.
    pub fn start(silence: Option<Duration>, apply: impl Fn(bool) + Send + Sync + 'static) -> std::sync::Arc<Self> {
        let me = std::sync::Arc::new(Self { state: Default::default(), apply: Box::new(apply) });
        crate::metrics::record_fence(false, false);
        if let Some(silence) = silence {
            let weak = std::sync::Arc::downgrade(&me);
            tokio::spawn(async move {
                let mut tick = tokio::time::interval((silence / 10).max(Duration::from_millis(20)));
                loop {
                    tick.tick().await;
                    let Some(me) = weak.upgrade() else { return };
                    me.check_silence(silence);
                }
            });
        }
        me
    }

    /// A coordinator called `Health`: it reaches this worker.
    pub fn health_called(&self) {
        self.change(|s| {
            s.last_health = Some(tokio::time::Instant::now());
            if s.cut_off {
                tracing::info!("a coordinator reaches this worker again; unfenced");
            }
            s.cut_off = false;
        });
    }

    /// A layer for the gRPC server that calls [`Fencing::health_called`] on every `Health` call.
    pub fn layer(self: &std::sync::Arc<Self>) -> HealthSeenLayer {
        HealthSeenLayer(self.clone())
    }

    /// Whether the worker is fenced now.
    pub fn is_fenced(&self) -> bool {
        self.lock().fenced
    }

    fn check_silence(&self, silence: Duration) {
        self.change(|s| {
            if let Some(last) = s.last_health.filter(|l| !s.cut_off && l.elapsed() >= silence) {
                s.cut_off = true;
                let ms = last.elapsed().as_millis();
                tracing::warn!(
                    silent_ms = ms,
                    "fenced: no coordinator has called Health for {ms} ms; taking no new work"
                );
            }
        });
    }

    fn set_registry(&self, fenced: bool) {
        self.change(|s| s.registry = fenced);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, FenceState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn change(&self, f: impl FnOnce(&mut FenceState)) {
        let mut s = self.lock();
        f(&mut s);
        let fenced = s.registry || s.cut_off;
        if fenced != s.fenced {
            s.fenced = fenced;
            (self.apply)(fenced);
            crate::metrics::record_fence(fenced, fenced);
        }
    }
}

/// See [`Fencing::layer`].
#[derive(Clone)]
pub struct HealthSeenLayer(std::sync::Arc<Fencing>);

impl<S> tower::Layer<S> for HealthSeenLayer {
    type Service = HealthSeen<S>;
    fn layer(&self, inner: S) -> HealthSeen<S> {
        HealthSeen { inner, fencing: self.0.clone() }
    }
}

/// A gRPC service that notes coordinators' `Health` calls before serving them
/// (so the answer to the call that ends a silence already says ready).
#[derive(Clone)]
pub struct HealthSeen<S> {
    inner: S,
    fencing: std::sync::Arc<Fencing>,
}

impl<S, B> tower::Service<tonic::codegen::http::Request<B>> for HealthSeen<S>
where
    S: tower::Service<tonic::codegen::http::Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: tonic::codegen::http::Request<B>) -> S::Future {
        // Only coordinators call Health (decode workers call Prefill).
        if req.uri().path().ends_with("/Health") {
            self.fencing.health_called();
        }
        self.inner.call(req)
    }
}

/// When [`main`] began, for the `ready` line's start-to-ready time.
static STARTED: std::sync::OnceLock<tokio::time::Instant> = std::sync::OnceLock::new();

/// The start both worker binaries share: the config from `load`, logs to
/// stderr as [`facts::log`] says (INFO unless `TANDEM_LOG`/`RUST_LOG` say
/// otherwise, in the config's `log_format`), its CPU placement applied before
/// any thread exists (so that every thread inherits it), and `run` on a
/// two-thread runtime beside the heap's release tick ([`crate::heap`]).
pub fn main<C, E, F>(
    load: impl FnOnce() -> Result<C, E>,
    common: impl FnOnce(&C) -> &CommonConfig,
    run: impl FnOnce(C) -> F,
) -> anyhow::Result<()>
where
    E: std::error::Error + Send + Sync + 'static,
    F: std::future::Future<Output = anyhow::Result<()>>,
{
    STARTED.get_or_init(tokio::time::Instant::now);
    let cfg = load()?;
    let c = common(&cfg);
    facts::log::init(c.log_format).map_err(anyhow::Error::msg)?;
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        model = %c.model.display(),
        threads = c.threads,
        group = c.version_group.as_str(),
        "starting"
    );
    crate::cpu::apply(c.nice, c.cpus.as_ref())?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let result = rt.block_on(async {
        crate::heap::spawn_release(crate::heap::RELEASE_EVERY);
        run(cfg).await
    });
    // The runtime is left to the process's exit, not dropped: by now `run` has drained,
    // deregistered and joined the engine, and a drop would cancel the tasks still in
    // flight, among them the Prometheus exporter's, which unwraps its render on a
    // blocking thread and panics when that is cancelled (a scrape that met the exit:
    // the version-relabel drill's decode worker, G5 "no panic in any log").
    std::mem::forget(rt);
    result
}

/// Marks the registration draining, so that coordinators stop routing here
/// before the drain ends. Best effort: a failure is logged and the drain
/// goes on (the lease still expires after the process exits).
pub async fn announce_draining(registration: Option<&registry::Registration>) {
    let Some(r) = registration else { return };
    if let Err(e) = r.set_draining(true).await {
        tracing::warn!(error = %e, "could not mark the registration draining");
    }
}

/// The end both workers share, after their own drain: waits up to `within`
/// for the runner thread to hand back its engine, then deregisters.
pub async fn finish(
    join: std::thread::JoinHandle<Engine>,
    within: Duration,
    registration: Option<registry::Registration>,
) {
    let joined = tokio::task::spawn_blocking(move || join.join());
    match tokio::time::timeout(within, joined).await {
        Ok(Ok(Ok(_engine))) => tracing::info!("runner drained"),
        _ => tracing::warn!("runner thread did not exit cleanly"),
    }
    if let Some(r) = registration {
        if let Err(e) = r.deregister().await {
            tracing::warn!(error = %e, "deregistering failed; the lease will expire");
        }
    }
}

/// Whether a worker takes new work: `ready` (cleared when it starts draining)
/// and not `fenced`; else the typed `retryable` refusal that sends the
/// caller elsewhere.
pub fn accepting(
    ready: &std::sync::atomic::AtomicBool,
    fenced: &std::sync::atomic::AtomicBool,
) -> Result<(), WorkerError> {
    use std::sync::atomic::Ordering;
    if !ready.load(Ordering::SeqCst) {
        return Err(err(ErrorKind::Retryable, "worker is draining"));
    }
    if fenced.load(Ordering::SeqCst) {
        return Err(err(
            ErrorKind::Retryable,
            "worker is fenced: another process holds its etcd key, or no coordinator has reached it",
        ));
    }
    Ok(())
}

/// How long a starting worker waits for an unreachable etcd before it gives up.
pub const REGISTER_PATIENCE: Duration = Duration::from_secs(30);

/// Registers this worker in etcd (when configured) and mirrors its fence
/// into `fencing`: a worker whose key another process holds takes no new
/// work until it holds it again. etcd unreachable at start is retried for
/// [`REGISTER_PATIENCE`]. Returns the registration, to mark draining and
/// deregister on shutdown.
pub async fn register(
    cfg: &CommonConfig,
    mut info: registry::WorkerInfo,
    fencing: std::sync::Arc<Fencing>,
) -> anyhow::Result<Option<registry::Registration>> {
    let Some(r) = &cfg.registry else { return Ok(None) };
    info.id = r.worker_id.clone();
    let mut config =
        registry::RegistrationConfig::new(registry::EtcdConfig::new(r.endpoints.clone()), r.prefix.clone());
    config.ttl = r.lease_ttl;
    // etcd unreachable at start (restarting, a blip) is waited out for a while rather than
    // ending the process at the first refused connect; a refusal etcd would give again
    // (an invalid field, the key held by another live worker) ends it at once.
    let until = tokio::time::Instant::now() + REGISTER_PATIENCE;
    let mut pause = Duration::from_millis(200);
    let reg = loop {
        match registry::Registration::register(config.clone(), info.clone()).await {
            Ok(reg) => break reg,
            Err(e @ (registry::RegistryError::Etcd { .. } | registry::RegistryError::Timeout { .. }))
                if tokio::time::Instant::now() + pause < until =>
            {
                tracing::warn!(error = %e, retry_in = ?pause, "etcd unreachable at start: retrying the registration");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
            }
            Err(e) => return Err(e).with_context(|| format!("registering in etcd at {:?}", r.endpoints)),
        }
    };
    let mut fence = reg.fence();
    tokio::spawn(async move {
        loop {
            // Stopped (deregistered on shutdown) is no fencing: the drain refuses work itself.
            let fenced = matches!(*fence.borrow_and_update(), registry::Fence::Fenced { .. });
            fencing.set_registry(fenced);
            if fence.changed().await.is_err() {
                return;
            }
        }
    });
    tracing::info!(key = reg.key(), "registered in etcd");
    Ok(Some(reg))
}

/// The common part of this worker's registry entry.
pub fn worker_info(
    cfg: &CommonConfig,
    role: registry::Role,
    fingerprint: &LayoutFingerprint,
    grpc: std::net::SocketAddr,
    metrics: std::net::SocketAddr,
) -> registry::WorkerInfo {
    registry::WorkerInfo {
        id: String::new(),
        role,
        version_group: cfg.version_group.as_str().to_owned(),
        layout_fingerprint: hex(fingerprint.as_bytes()),
        determinism_fingerprint: hex(&determinism(fingerprint)),
        grpc_addr: grpc.to_string(),
        transfer: None,
        metrics_addr: Some(metrics.to_string()),
        zone: cfg.zone.clone(),
        capacity: registry::Capacity { kv_blocks_total: cfg.kv_blocks as u64, max_running: cfg.max_running as u32 },
        draining: false,
        started_at_unix_ms: registry::WorkerInfo::unix_ms_now(),
    }
}

/// The determinism fingerprint of a worker with KV layout fingerprint `layout` (which
/// covers the model's weights, the tokenizer and the KV layout): SHA-256 over that, the
/// sampler's version and the kernels' numerics class. Workers with equal fingerprints
/// give bit-equal answers for a prompt and seed, so a request may move between them
/// mid-stream; the coordinator pairs continuations by it and workers refuse one whose
/// fingerprint differs from theirs.
pub fn determinism(layout: &LayoutFingerprint) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(b"tandem determinism fingerprint v1\0");
    h.update(engine::sampler::SAMPLER_VERSION.as_bytes());
    h.update([0]);
    h.update(kernels::NUMERICS_CLASS.as_bytes());
    h.update([0]);
    h.update(layout.as_bytes());
    h.finalize().into()
}

/// Lower-case hex of `bytes` (full length, unlike the fingerprints' short Display).
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    use super::*;

    fn unix_ms_now() -> u64 {
        SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
    }

    /// A wire deadline becomes one on tokio's clock: with the clock paused
    /// it has not passed a millisecond before its time, a timeout on it
    /// fires exactly when the clock reaches it, and what goes back on the
    /// wire is the time left on that clock. Ten seconds of deadline, no
    /// real waiting.
    #[tokio::test(start_paused = true)]
    #[allow(clippy::disallowed_types, reason = "checks that no real time passed")]
    async fn a_wire_deadline_fires_on_tokios_paused_clock() {
        assert_eq!(local_deadline(0), None);
        assert_eq!(unix_deadline(None), 0);
        let real = std::time::Instant::now();
        let d = local_deadline(unix_ms_now() + 10_000).expect("a deadline");
        let left = d.saturating_duration_since(tokio::time::Instant::now());
        assert!(left > Duration::from_secs(9) && left <= Duration::from_secs(10), "{left:?} left");

        tokio::time::advance(left - Duration::from_millis(1)).await;
        assert!(tokio::time::Instant::now() < d, "passed before its time");
        let wire = unix_deadline(Some(d));
        let wire_left = wire.saturating_sub(unix_ms_now());
        assert!(wire_left <= 2, "the wire gets the time left on tokio's clock, not the wall's: {wire_left} ms");

        let timed_out = tokio::time::timeout_at(d, std::future::pending::<()>()).await;
        assert!(timed_out.is_err(), "a timeout at the deadline fires");
        let over = tokio::time::Instant::now().saturating_duration_since(d);
        assert!(tokio::time::Instant::now() >= d && over <= Duration::from_millis(1), "the clock is {over:?} past it");
        assert!(real.elapsed() < Duration::from_secs(2), "waited in real time: {:?}", real.elapsed());
    }

    #[tokio::test]
    async fn silence_fences_only_after_a_first_health_call_and_a_call_unfences() {
        let applied = Arc::new(AtomicBool::new(false));
        let seen = applied.clone();
        let f = Fencing::start(Some(Duration::from_millis(200)), move |v| seen.store(v, Ordering::SeqCst));
        // Never polled: nobody to be cut off from.
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(!f.is_fenced() && !applied.load(Ordering::SeqCst));
        f.health_called();
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(f.is_fenced() && applied.load(Ordering::SeqCst), "silent past the bound, not fenced");
        // A coordinator reaches it again: unfenced at once.
        f.health_called();
        assert!(!f.is_fenced() && !applied.load(Ordering::SeqCst));
        // The registry's fence holds whatever the coordinators do.
        f.set_registry(true);
        f.health_called();
        assert!(f.is_fenced());
        f.set_registry(false);
        assert!(!f.is_fenced());
    }
}
