//! The worker's Prometheus metrics, served on `/metrics` by
//! metrics-exporter-prometheus' HTTP listener (`metrics` config field).
//!
//! Names are prefixed `tandem_` (Prometheus reserves colons for recording
//! rules; vLLM's `vllm:` names map over by a rename). Every histogram has
//! explicit buckets, so it renders as a real histogram (`_bucket{le=..}`),
//! never as the exporter's default summary.

use std::net::SocketAddr;

use metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram, Unit};
use metrics_exporter_prometheus::{BuildError, Matcher, PrometheusBuilder};
use proto::worker::v1::ErrorKind;

/// `tandem_prefill_requests_total{outcome}`: Prefill RPCs answered, by
/// outcome (`ok`, or the error kind: `invalid_argument`, `version_mismatch`,
/// `kv_load_failed`, `retryable`, `deadline`, `overloaded`, `cancelled`,
/// `internal`). vLLM: `vllm:request_success_total{finished_reason}` (for `ok`).
pub const PREFILL_REQUESTS: &str = "tandem_prefill_requests_total";
/// `tandem_prompt_tokens_total`: prompt tokens prefilled by the engine.
/// vLLM: `vllm:prompt_tokens_total`.
pub const PROMPT_TOKENS: &str = "tandem_prompt_tokens_total";
/// `tandem_kv_transfer_bytes_total`: K+V payload bytes of completed
/// (acknowledged) transfers to decode workers. vLLM: none (its KV
/// connectors report transfer sizes only in their own logs/stats).
pub const KV_TRANSFER_BYTES: &str = "tandem_kv_transfer_bytes_total";
/// `tandem_kv_transfer_seconds`: wall time of one completed transfer
/// (connect if needed, every layer, Complete/Ack). vLLM: none directly
/// (closest: NIXL connector's transfer-duration stats).
pub const KV_TRANSFER_SECONDS: &str = "tandem_kv_transfer_seconds";
/// `tandem_kv_transfer_failures_total{reason}`: transfers that failed, by
/// reason (`io`, `rejected`, `timeout`, `protocol`, `peer_abort`, `layer`,
/// `deadline` — the request's deadline passed mid-transfer). vLLM: none
/// (closest: `vllm:kv_connector` failed-transfer counts).
pub const KV_TRANSFER_FAILURES: &str = "tandem_kv_transfer_failures_total";
/// `tandem_kv_cache_usage_ratio`: used / total KV blocks in this worker's
/// pool, sampled after each request. vLLM: `vllm:kv_cache_usage_perc`
/// (formerly `vllm:gpu_cache_usage_perc`), also a 0..1 fraction.
pub const KV_CACHE_USAGE: &str = "tandem_kv_cache_usage_ratio";
/// `tandem_num_requests_running`: requests in the engine's running batch,
/// sampled after each request. vLLM: `vllm:num_requests_running`.
pub const REQUESTS_RUNNING: &str = "tandem_num_requests_running";
/// `tandem_num_requests_waiting`: requests queued for a running seat,
/// sampled after each request. vLLM: `vllm:num_requests_waiting`.
pub const REQUESTS_WAITING: &str = "tandem_num_requests_waiting";
/// `tandem_prefill_seconds`: engine time of one prefill (submit to first
/// token, queueing included). vLLM: `vllm:request_prefill_time_seconds`.
pub const PREFILL_SECONDS: &str = "tandem_prefill_seconds";

/// Buckets of `tandem_kv_transfer_seconds`: 1 ms .. 10 s.
pub const KV_TRANSFER_BUCKETS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];
/// Buckets of `tandem_prefill_seconds`: 5 ms .. 60 s (CPU prefill of long prompts is slow).
pub const PREFILL_BUCKETS: &[f64] = &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0];

/// Installs the global recorder and the HTTP listener on `addr` (serving
/// `/metrics`), spawning it on the current tokio runtime. Returns the bound
/// address.
///
/// The exporter binds the address itself and cannot report the port it got
/// nor take a pre-bound listener, so for port 0 a free port is found first
/// by binding `addr`, reading the port and dropping the socket; another
/// process could take that port in between (a small race; the install then
/// fails with a bind error rather than serving elsewhere).
pub fn install(addr: SocketAddr) -> Result<SocketAddr, InstallError> {
    let addr = if addr.port() == 0 {
        std::net::TcpListener::bind(addr).and_then(|l| l.local_addr()).map_err(InstallError::Probe)?
    } else {
        addr
    };
    PrometheusBuilder::new()
        .with_http_listener(addr)
        // A default for any histogram added later: never a summary.
        .set_buckets(PREFILL_BUCKETS)?
        .set_buckets_for_metric(Matcher::Full(KV_TRANSFER_SECONDS.into()), KV_TRANSFER_BUCKETS)?
        .set_buckets_for_metric(Matcher::Full(PREFILL_SECONDS.into()), PREFILL_BUCKETS)?
        .install()?;
    describe();
    Ok(addr)
}

/// Why the exporter could not be installed.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    /// Binding the address to learn a free port failed.
    #[error("finding a free port: {0}")]
    Probe(std::io::Error),
    /// The exporter refused (bind failure, a recorder already installed, ...).
    #[error(transparent)]
    Build(#[from] BuildError),
}

fn describe() {
    describe_counter!(PREFILL_REQUESTS, "Prefill RPCs answered, by outcome.");
    describe_counter!(PROMPT_TOKENS, Unit::Count, "Prompt tokens prefilled by the engine.");
    describe_counter!(KV_TRANSFER_BYTES, Unit::Bytes, "K+V payload bytes of completed KV transfers.");
    describe_histogram!(KV_TRANSFER_SECONDS, Unit::Seconds, "Wall time of one completed KV transfer.");
    describe_counter!(KV_TRANSFER_FAILURES, "KV transfers that failed, by reason.");
    describe_gauge!(KV_CACHE_USAGE, "Used fraction of the KV block pool (0..1).");
    describe_gauge!(REQUESTS_RUNNING, "Requests in the engine's running batch.");
    describe_gauge!(REQUESTS_WAITING, "Requests waiting for a running seat.");
    describe_histogram!(PREFILL_SECONDS, Unit::Seconds, "Engine time of one prefill, queueing included.");
}

/// The `outcome` label of an error kind.
pub fn outcome_label(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::InvalidArgument => "invalid_argument",
        ErrorKind::VersionMismatch => "version_mismatch",
        ErrorKind::KvLoadFailed => "kv_load_failed",
        ErrorKind::Retryable => "retryable",
        ErrorKind::Deadline => "deadline",
        ErrorKind::Overloaded => "overloaded",
        ErrorKind::Cancelled => "cancelled",
        _ => "internal",
    }
}

/// Counts one answered Prefill under `outcome`.
pub fn record_outcome(outcome: &'static str) {
    counter!(PREFILL_REQUESTS, "outcome" => outcome).increment(1);
}

/// Records a finished engine prefill of `tokens` prompt tokens.
pub fn record_prefill(tokens: usize, seconds: f64) {
    counter!(PROMPT_TOKENS).increment(tokens as u64);
    histogram!(PREFILL_SECONDS).record(seconds);
}

/// Records a completed KV transfer.
pub fn record_transfer(bytes: u64, seconds: f64) {
    counter!(KV_TRANSFER_BYTES).increment(bytes);
    histogram!(KV_TRANSFER_SECONDS).record(seconds);
}

/// Counts one failed KV transfer under `reason`.
pub fn record_transfer_failure(reason: &'static str) {
    counter!(KV_TRANSFER_FAILURES, "reason" => reason).increment(1);
}

/// Sets the engine gauges from a runner snapshot.
pub fn record_stats(s: &engine::runner::RunnerStats) {
    let usage = if s.kv.total == 0 { 0.0 } else { s.kv.used as f64 / s.kv.total as f64 };
    gauge!(KV_CACHE_USAGE).set(usage);
    gauge!(REQUESTS_RUNNING).set(s.running as f64);
    gauge!(REQUESTS_WAITING).set(s.waiting as f64);
}
