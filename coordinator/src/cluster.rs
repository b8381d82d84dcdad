//! The workers this coordinator routes to, and one request's trip to them.
//!
//! Workers are given by address for now (`--decode`, `--prefill`); the etcd
//! registry replaces the static lists with live membership. Routing: the
//! decode worker with the fewest requests in flight from this coordinator
//! (power of two choices between two random candidates would be the same
//! at this size); prefill workers in round-robin order, the first as the
//! choice and the rest as fallbacks for the `retry` policy. Whether a short
//! prompt is prefilled remotely at all is the decode worker's call
//! (`local_prefill_max_tokens`).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use engine::sampler::SamplingParams;
use proto::worker::v1::decode_worker_client::DecodeWorkerClient;
use proto::worker::v1::{generate_response, GenerateRequest, PrefillTarget};
use tonic::transport::{Channel, Endpoint};

use crate::openai::ApiError;
use axum::http::StatusCode;

/// One decode worker.
pub struct Decode {
    pub addr: String,
    client: DecodeWorkerClient<Channel>,
    inflight: AtomicUsize,
}

/// The static worker set.
pub struct Cluster {
    decode: Vec<Decode>,
    prefill: Vec<String>,
    next_prefill: AtomicUsize,
    next_id: AtomicU64,
}

/// A request's stream from its decode worker; dropping it cancels the
/// request there (and its KV transfer and prefill).
pub type WorkerStream = tonic::Streaming<proto::worker::v1::GenerateResponse>;

/// Holds a decode worker's in-flight count for one request.
pub struct Lease {
    cluster: Arc<Cluster>,
    index: usize,
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.cluster.decode[self.index].inflight.fetch_sub(1, Ordering::Relaxed);
    }
}

fn endpoint(addr: &str) -> Result<Endpoint, String> {
    Endpoint::from_shared(format!("http://{addr}"))
        .map(|e| e.connect_timeout(Duration::from_secs(2)).tcp_nodelay(true))
        .map_err(|e| format!("worker address {addr:?}: {e}"))
}

impl Cluster {
    /// Lazy connections: a worker that is down now is tried per request.
    pub fn new(decode: &[String], prefill: &[String]) -> Result<Self, String> {
        let decode = decode
            .iter()
            .map(|a| {
                Ok(Decode {
                    addr: a.clone(),
                    client: DecodeWorkerClient::new(endpoint(a)?.connect_lazy()),
                    inflight: AtomicUsize::new(0),
                })
            })
            .collect::<Result<Vec<_>, String>>()?;
        Ok(Self { decode, prefill: prefill.to_vec(), next_prefill: AtomicUsize::new(0), next_id: AtomicU64::new(1) })
    }

    pub fn decode_addrs(&self) -> impl Iterator<Item = &str> {
        self.decode.iter().map(|d| d.addr.as_str())
    }

    /// A fresh cluster-wide request id.
    pub fn request_id(&self) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("req-{}-{n}", std::process::id())
    }

    fn pick_decode(self: &Arc<Self>) -> Option<Lease> {
        let index = (0..self.decode.len()).min_by_key(|&i| self.decode[i].inflight.load(Ordering::Relaxed))?;
        self.decode[index].inflight.fetch_add(1, Ordering::Relaxed);
        Some(Lease { cluster: self.clone(), index })
    }

    fn prefill_order(&self) -> Vec<PrefillTarget> {
        let n = self.prefill.len();
        if n == 0 {
            return Vec::new();
        }
        let start = self.next_prefill.fetch_add(1, Ordering::Relaxed) % n;
        (0..n)
            .map(|i| {
                let addr = &self.prefill[(start + i) % n];
                PrefillTarget { worker_id: addr.clone(), grpc_addr: addr.clone() }
            })
            .collect()
    }

    /// Starts `Generate` on a decode worker and returns its stream.
    pub async fn generate(
        self: &Arc<Self>,
        request_id: String,
        token_ids: Vec<u32>,
        params: &SamplingParams,
        deadline_unix_ms: u64,
    ) -> Result<(WorkerStream, Lease), ApiError> {
        let lease = self.pick_decode().ok_or_else(|| {
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "overloaded_error",
                "no_worker",
                "no decode worker configured",
            )
            .retry_after(1)
        })?;
        let d = &self.decode[lease.index];
        let req = GenerateRequest {
            request_id,
            token_ids,
            sampling: Some(params.into()),
            deadline_unix_ms,
            prefill: self.prefill_order(),
            policy_override: None,
            cache_salt: 0,
        };
        let mut client = d.client.clone();
        let stream = client.generate(req).await.map_err(|s| {
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "overloaded_error",
                "worker_unavailable",
                format!("decode worker {}: {}", d.addr, s.message()),
            )
            .retry_after(1)
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
