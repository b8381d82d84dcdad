//! Start-up and request plumbing shared by both workers: loading the model
//! into an engine, computing the layout fingerprint, mapping runner errors
//! onto wire kinds, deadlines, and waiting for a stop signal.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use engine::batch::Engine;
use engine::kv::KvLayout;
use engine::model::Model;
use engine::runner::{ErrorKind as RunnerKind, RunnerError};
use engine::tokenizer::Tokenizer;
use engine::weights::digest::weights_digest;
use engine::weights::Weights;
use kvtransfer::LayoutFingerprint;
use proto::worker::v1::{ErrorKind, WorkerError};

use crate::config::CommonConfig;

/// A loaded model, ready to hand to a runner.
pub struct Loaded {
    pub engine: Engine,
    pub layout: KvLayout,
    pub fingerprint: LayoutFingerprint,
    pub tokenizer: Tokenizer,
}

/// Loads the model named by `cfg`, hashes its file (the weights digest in
/// the fingerprint) and builds the engine.
pub fn load(cfg: &CommonConfig) -> anyhow::Result<Loaded> {
    let (weights, gguf) = Weights::from_gguf(&cfg.model).with_context(|| format!("loading {}", cfg.model.display()))?;
    let tokenizer = Tokenizer::from_gguf(&gguf).context("loading the tokenizer")?;
    let model = Model::new(weights, cfg.threads).context("building the model")?;
    let layout = model.kv_layout(cfg.kv_block_size, cfg.kv_dtype);
    let digest = weights_digest(&cfg.model).with_context(|| format!("hashing {}", cfg.model.display()))?;
    let fingerprint = LayoutFingerprint::new(&layout, &digest, &tokenizer.digest());
    let engine = Engine::new(model, cfg.engine(), tokenizer.eos_ids().to_vec()).context("building the engine")?;
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

/// The wire's wall-clock deadline as a local monotonic one; `None` for 0.
pub fn local_deadline(unix_ms: u64) -> Option<Instant> {
    if unix_ms == 0 {
        return None;
    }
    let now_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    Some(Instant::now() + Duration::from_millis(unix_ms.saturating_sub(now_ms)))
}

/// A local monotonic deadline as wall-clock ms for the wire; 0 for none.
pub fn unix_deadline(deadline: Option<Instant>) -> u64 {
    let Some(d) = deadline else { return 0 };
    let now_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    // At least 1 ms from the epoch: 0 would mean "no deadline".
    (now_ms + d.saturating_duration_since(Instant::now()).as_millis() as u64).max(1)
}

/// Binds the gRPC listener, prints `listening grpc=ADDR` and logs readiness.
pub async fn bind_grpc(cfg: &CommonConfig, fingerprint: &LayoutFingerprint) -> anyhow::Result<tokio::net::TcpListener> {
    let listener =
        tokio::net::TcpListener::bind(cfg.grpc).await.with_context(|| format!("binding grpc {}", cfg.grpc))?;
    let addr = listener.local_addr()?;
    println!("listening grpc={addr}");
    tracing::info!(%addr, fingerprint = %fingerprint, group = cfg.version_group.as_str(), "ready");
    Ok(listener)
}

/// Serves `router` on `listener` until the returned token is cancelled;
/// in-flight calls then finish before the task ends.
pub fn spawn_grpc(
    router: tonic::transport::server::Router,
    listener: tokio::net::TcpListener,
) -> (tokio::task::JoinHandle<Result<(), tonic::transport::Error>>, tokio_util::sync::CancellationToken) {
    let stop = tokio_util::sync::CancellationToken::new();
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    let task = tokio::spawn(router.serve_with_incoming_shutdown(incoming, stop.clone().cancelled_owned()));
    (task, stop)
}

/// Registers this worker in etcd (when configured) and mirrors its fence
/// into `set_fenced`: a worker that lost its lease takes no new work until
/// it has re-registered. Returns the registration, to mark draining and
/// deregister on shutdown.
pub async fn register(
    cfg: &CommonConfig,
    mut info: registry::WorkerInfo,
    set_fenced: impl Fn(bool) + Send + 'static,
) -> anyhow::Result<Option<registry::Registration>> {
    let Some(r) = &cfg.registry else { return Ok(None) };
    info.id = r.worker_id.clone();
    let mut config =
        registry::RegistrationConfig::new(registry::EtcdConfig::new(r.endpoints.clone()), r.prefix.clone());
    config.ttl = r.lease_ttl;
    let reg = registry::Registration::register(config, info)
        .await
        .with_context(|| format!("registering in etcd at {:?}", r.endpoints))?;
    let mut fence = reg.fence();
    tokio::spawn(async move {
        let mut was_fenced = false;
        loop {
            let (serving, fenced) = {
                let f = fence.borrow_and_update();
                (f.is_serving(), matches!(*f, registry::Fence::Fenced { .. }))
            };
            set_fenced(!serving);
            // Stopped (deregistered on shutdown) takes no work either, but is no fencing.
            crate::metrics::record_fence(fenced, fenced && !was_fenced);
            was_fenced = fenced;
            if fenced {
                tracing::warn!("fenced: the etcd lease is lost or in doubt; taking no new work until re-registered");
            }
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
        grpc_addr: grpc.to_string(),
        transfer: None,
        metrics_addr: Some(metrics.to_string()),
        capacity: registry::Capacity { kv_blocks_total: cfg.kv_blocks as u64, max_running: cfg.max_running as u32 },
        draining: false,
        started_at_unix_ms: registry::WorkerInfo::unix_ms_now(),
    }
}

/// Lower-case hex of `bytes` (full length, unlike the fingerprints' short Display).
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
