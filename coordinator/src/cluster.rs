//! The workers this coordinator routes to, and one request's trip to them.
//!
//! Workers come from etcd membership (`--etcd`; only non-draining ones, a
//! decode worker paired only with prefill workers of its own version group)
//! or from fixed addresses (`--decode`, `--prefill`). Routing: the decode
//! worker with the fewest requests in flight from this coordinator; prefill
//! workers of its group in round-robin order, the first as the choice and
//! the rest as fallbacks for the `retry` policy. Whether a short
//! prompt is prefilled remotely at all is the decode worker's call
//! (`local_prefill_max_tokens`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use engine::sampler::SamplingParams;
use proto::worker::v1::decode_worker_client::DecodeWorkerClient;
use proto::worker::v1::{generate_response, GenerateRequest, PrefillTarget};
use tonic::transport::{Channel, Endpoint};

use crate::openai::ApiError;
use axum::http::StatusCode;

/// One decode worker's client and this coordinator's in-flight count for it.
struct Decode {
    client: DecodeWorkerClient<Channel>,
    inflight: AtomicUsize,
}

/// Where the worker set comes from.
pub enum Source {
    /// Fixed addresses (`--decode`, `--prefill`): one version group assumed.
    Static { decode: Vec<String>, prefill: Vec<String> },
    /// etcd membership: only non-draining workers; a decode worker is paired
    /// only with prefill workers of its own version group. While etcd is
    /// unreachable the cached view is used for at most `max_stale`, then
    /// requests get 503.
    Etcd { membership: registry::Membership, max_stale: Duration },
}

/// The worker set and per-worker clients.
pub struct Cluster {
    source: Source,
    decode: Mutex<HashMap<String, Arc<Decode>>>,
    next_prefill: AtomicUsize,
    next_id: AtomicU64,
}

/// A request's stream from its decode worker; dropping it cancels the
/// request there (and its KV transfer and prefill).
pub type WorkerStream = tonic::Streaming<proto::worker::v1::GenerateResponse>;

/// Holds a decode worker's in-flight count for one request.
pub struct Lease {
    decode: Arc<Decode>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.decode.inflight.fetch_sub(1, Ordering::Relaxed);
    }
}

fn endpoint(addr: &str) -> Result<Endpoint, String> {
    Endpoint::from_shared(format!("http://{addr}"))
        .map(|e| e.connect_timeout(Duration::from_secs(2)).tcp_nodelay(true))
        .map_err(|e| format!("worker address {addr:?}: {e}"))
}

fn unavailable(code: &'static str, message: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "overloaded_error", code, message).retry_after(1)
}

/// One routing decision: a decode worker and the prefill workers (same
/// version group) it may use, first choice first.
struct Route {
    decode: String,
    prefill: Vec<PrefillTarget>,
}

impl Cluster {
    /// Lazy connections: a worker that is down now is tried per request.
    pub fn new(source: Source) -> Result<Self, String> {
        if let Source::Static { decode, .. } = &source {
            for a in decode {
                endpoint(a)?;
            }
        }
        Ok(Self {
            source,
            decode: Mutex::new(HashMap::new()),
            next_prefill: AtomicUsize::new(0),
            next_id: AtomicU64::new(1),
        })
    }

    /// Decode worker addresses known now (for readiness).
    pub fn decode_addrs(&self) -> Vec<String> {
        match &self.source {
            Source::Static { decode, .. } => decode.clone(),
            Source::Etcd { membership, .. } => membership
                .view()
                .workers()
                .filter(|w| w.role == registry::Role::Decode && !w.draining)
                .map(|w| w.grpc_addr.clone())
                .collect(),
        }
    }

    /// A fresh cluster-wide request id.
    pub fn request_id(&self) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("req-{}-{n}", std::process::id())
    }

    fn decode_entry(&self, addr: &str) -> Result<Arc<Decode>, ApiError> {
        let mut m = self.decode.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(d) = m.get(addr) {
            return Ok(d.clone());
        }
        let ep = endpoint(addr).map_err(|e| unavailable("worker_unavailable", e))?;
        let d = Arc::new(Decode { client: DecodeWorkerClient::new(ep.connect_lazy()), inflight: AtomicUsize::new(0) });
        m.insert(addr.to_owned(), d.clone());
        Ok(d)
    }

    fn inflight(&self, addr: &str) -> usize {
        let m = self.decode.lock().unwrap_or_else(|e| e.into_inner());
        m.get(addr).map_or(0, |d| d.inflight.load(Ordering::Relaxed))
    }

    /// Round-robin order of `addrs` (first choice, then fallbacks).
    fn rotate(&self, addrs: Vec<(String, String)>) -> Vec<PrefillTarget> {
        let n = addrs.len();
        if n == 0 {
            return Vec::new();
        }
        let start = self.next_prefill.fetch_add(1, Ordering::Relaxed) % n;
        (0..n)
            .map(|i| {
                let (id, addr) = &addrs[(start + i) % n];
                PrefillTarget { worker_id: id.clone(), grpc_addr: addr.clone() }
            })
            .collect()
    }

    /// Picks the decode worker with the fewest requests in flight from
    /// here, and the prefill workers of its version group.
    fn route(&self) -> Result<Route, ApiError> {
        match &self.source {
            Source::Static { decode, prefill } => {
                let d = decode
                    .iter()
                    .min_by_key(|a| self.inflight(a))
                    .ok_or_else(|| unavailable("no_worker", "no decode worker configured"))?;
                let p = prefill.iter().map(|a| (a.clone(), a.clone())).collect();
                Ok(Route { decode: d.clone(), prefill: self.rotate(p) })
            }
            Source::Etcd { membership, max_stale } => {
                let view = membership.view();
                if !membership.healthy() && membership.last_sync_age().is_none_or(|age| age > *max_stale) {
                    return Err(unavailable("registry_unavailable", "the worker registry (etcd) is unreachable"));
                }
                let d = view
                    .workers()
                    .filter(|w| w.role == registry::Role::Decode && !w.draining)
                    .min_by_key(|w| self.inflight(&w.grpc_addr))
                    .ok_or_else(|| unavailable("no_worker", "no ready decode worker is registered"))?;
                let p = view
                    .select(registry::Role::Prefill, &d.version_group)
                    .filter(|w| !w.draining)
                    .map(|w| (w.id.clone(), w.grpc_addr.clone()))
                    .collect();
                Ok(Route { decode: d.grpc_addr.clone(), prefill: self.rotate(p) })
            }
        }
    }

    /// Starts `Generate` on a decode worker and returns its stream.
    pub async fn generate(
        self: &Arc<Self>,
        request_id: String,
        token_ids: Vec<u32>,
        params: &SamplingParams,
        deadline_unix_ms: u64,
    ) -> Result<(WorkerStream, Lease), ApiError> {
        let route = self.route()?;
        let decode = self.decode_entry(&route.decode)?;
        decode.inflight.fetch_add(1, Ordering::Relaxed);
        let lease = Lease { decode: decode.clone() };
        let req = GenerateRequest {
            request_id,
            token_ids,
            sampling: Some(params.into()),
            deadline_unix_ms,
            prefill: route.prefill,
            policy_override: None,
            cache_salt: 0,
        };
        let mut client = decode.client.clone();
        let stream = client.generate(req).await.map_err(|s| {
            unavailable("worker_unavailable", format!("decode worker {}: {}", route.decode, s.message()))
        })?;
        Ok((stream.into_inner(), lease))
    }
}

/// What one step of a worker stream means to the frontend.
pub enum Step {
    Token(proto::worker::v1::TokenChunk),
    Finished(proto::worker::v1::Finished),
}

/// The next event of a worker stream, with worker errors mapped to HTTP.
pub async fn next(stream: &mut WorkerStream) -> Result<Step, ApiError> {
    let msg = stream.message().await.map_err(|s| {
        ApiError::new(
            StatusCode::BAD_GATEWAY,
            "server_error",
            "worker_stream",
            format!("decode worker stream: {}", s.message()),
        )
    })?;
    match msg.and_then(|m| m.event) {
        Some(generate_response::Event::Token(t)) => Ok(Step::Token(t)),
        Some(generate_response::Event::Finished(f)) => Ok(Step::Finished(f)),
        Some(generate_response::Event::Error(e)) => Err(worker_error(&e)),
        None => Err(ApiError::new(
            StatusCode::BAD_GATEWAY,
            "server_error",
            "worker_stream",
            "decode worker stream ended without a result",
        )),
    }
}

/// The HTTP face of a worker's typed error (the overload contract in the README).
pub fn worker_error(e: &proto::worker::v1::WorkerError) -> ApiError {
    use proto::worker::v1::ErrorKind as K;
    let (status, kind, code) = match e.kind() {
        K::InvalidArgument => (StatusCode::BAD_REQUEST, "invalid_request_error", "invalid_argument"),
        K::Overloaded => (StatusCode::SERVICE_UNAVAILABLE, "overloaded_error", "overloaded"),
        K::Retryable => (StatusCode::SERVICE_UNAVAILABLE, "overloaded_error", "retryable"),
        K::Deadline => (StatusCode::GATEWAY_TIMEOUT, "timeout_error", "deadline_exceeded"),
        K::KvLoadFailed => (StatusCode::BAD_GATEWAY, "server_error", "kv_load_failed"),
        K::VersionMismatch => (StatusCode::BAD_GATEWAY, "server_error", "version_mismatch"),
        K::Cancelled => (StatusCode::SERVICE_UNAVAILABLE, "server_error", "cancelled"),
        _ => (StatusCode::INTERNAL_SERVER_ERROR, "server_error", "internal"),
    };
    let err = ApiError::new(status, kind, code, e.message.clone());
    if status == StatusCode::SERVICE_UNAVAILABLE {
        err.retry_after(1)
    } else {
        err
    }
}
