//! The prefill worker's own metrics (the shared ones, KV usage and request
//! gauges, are in [`crate::metrics`]).

use metrics::{counter, describe_counter, describe_histogram, histogram, Unit};

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
/// `tls`, `landing` — ucx: the decode worker had no landing space —,
/// `revoked` — ucx: a direct writer's grant ended before the transfer did —,
/// `deadline` — the request's deadline passed mid-transfer). vLLM: none
/// (closest: `vllm:kv_connector` failed-transfer counts).
pub const KV_TRANSFER_FAILURES: &str = "tandem_kv_transfer_failures_total";
/// Every [`KV_TRANSFER_FAILURES`] reason: kvtransfer's `TransferError`
/// kinds (and `tls`, QUIC's handshake) plus `deadline`.
pub const TRANSFER_FAILURE_REASONS: [&str; 10] =
    ["io", "rejected", "timeout", "protocol", "peer_abort", "layer", "tls", "landing", "revoked", "deadline"];
/// `tandem_kv_stale_connections_total`: pooled KV connections found closed
/// by the decode worker (its idle timeout, a restart) when a transfer was
/// about to use them, and replaced by a fresh one before any frame went out:
/// the transfer itself does not fail. vLLM: none.
pub const KV_STALE_CONNECTIONS: &str = "tandem_kv_stale_connections_total";
/// `tandem_kv_layers_sent_total{path}`: streamed KV messages (one layer's
/// run of newly computed blocks each), by how they left the engine:
/// `in_place` — the engine's thread stored them straight into the decode
/// worker's pool (ucx on one host, a direct writer: no gather) —, or
/// `gathered` — copied out of the pool into buffers for the transport. On a
/// same-host ucx cluster nearly all should be `in_place` (a prompt's first
/// layers may be computed before the writer is granted). vLLM: none.
pub const KV_LAYERS_SENT: &str = "tandem_kv_layers_sent_total";
/// The `path` label values of [`KV_LAYERS_SENT`].
pub const LAYER_PATHS: [&str; 2] = ["in_place", "gathered"];
/// `tandem_faults_injected_total{fault}`: faults this worker injected into
/// its own work because a drill asked it to (`kv_corrupt`: ucx transfers
/// with a byte flipped after the checksum, `--fault-kv-corrupt`). 0 in
/// production. vLLM: none.
pub const FAULTS_INJECTED: &str = "tandem_faults_injected_total";
/// `tandem_prefill_seconds`: engine time of one prefill (submit to first
/// token, queueing included). vLLM: `vllm:request_prefill_time_seconds`.
pub const PREFILL_SECONDS: &str = "tandem_prefill_seconds";

/// Buckets of `tandem_kv_transfer_seconds`: 1 ms .. 10 s.
pub const KV_TRANSFER_BUCKETS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];
/// Buckets of `tandem_prefill_seconds`: 5 ms .. 60 s (CPU prefill of long prompts is slow).
pub const PREFILL_BUCKETS: &[f64] = &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0];

/// Buckets per histogram, for [`worker_common::metrics::install`].
pub const BUCKETS: &[(&str, &[f64])] =
    &[(KV_TRANSFER_SECONDS, KV_TRANSFER_BUCKETS), (PREFILL_SECONDS, PREFILL_BUCKETS)];

/// Describes this role's metrics (after [`worker_common::metrics::install`]).
pub fn describe() {
    describe_counter!(PREFILL_REQUESTS, "Prefill RPCs answered, by outcome.");
    describe_counter!(PROMPT_TOKENS, Unit::Count, "Prompt tokens prefilled by the engine.");
    describe_counter!(KV_TRANSFER_BYTES, Unit::Bytes, "K+V payload bytes of completed KV transfers.");
    describe_histogram!(KV_TRANSFER_SECONDS, Unit::Seconds, "Wall time of one completed KV transfer.");
    describe_counter!(KV_TRANSFER_FAILURES, "KV transfers that failed, by reason.");
    describe_histogram!(PREFILL_SECONDS, Unit::Seconds, "Engine time of one prefill, queueing included.");
    describe_counter!(
        KV_STALE_CONNECTIONS,
        "Pooled KV connections found closed by the decode worker before a transfer, and replaced."
    );
    describe_counter!(
        KV_LAYERS_SENT,
        "Streamed KV layer messages, by path (in_place: stored by the engine's thread into the decode pool; gathered)."
    );
    describe_counter!(FAULTS_INJECTED, "Faults injected by drill flags, by fault (0 in production).");
    // Exported from the start, so a check that reads it can tell 0 from a missing series.
    counter!(KV_TRANSFER_BYTES).absolute(0);
    counter!(KV_STALE_CONNECTIONS).absolute(0);
    counter!(FAULTS_INJECTED, "fault" => "kv_corrupt").absolute(0);
    worker_common::metrics::zero(PREFILL_REQUESTS, "outcome", &worker_common::metrics::OUTCOMES);
    worker_common::metrics::zero(KV_TRANSFER_FAILURES, "reason", &TRANSFER_FAILURE_REASONS);
    worker_common::metrics::zero(KV_LAYERS_SENT, "path", &LAYER_PATHS);
}

/// Counts `n` streamed layer messages sent by `path` ([`LAYER_PATHS`]).
pub fn record_layers_sent(path: &'static str, n: u64) {
    debug_assert!(LAYER_PATHS.contains(&path), "unlisted path {path}");
    counter!(KV_LAYERS_SENT, "path" => path).increment(n);
}

/// Counts one answered Prefill under `outcome`.
pub fn record_outcome(outcome: &'static str) {
    debug_assert!(worker_common::metrics::OUTCOMES.contains(&outcome), "unlisted outcome {outcome}");
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

/// Counts one pooled KV connection found closed and replaced.
pub fn record_stale_connection() {
    counter!(KV_STALE_CONNECTIONS).increment(1);
}

/// Counts one failed KV transfer under `reason`.
pub fn record_transfer_failure(reason: &'static str) {
    counter!(KV_TRANSFER_FAILURES, "reason" => reason).increment(1);
}

/// Counts one ucx transfer the `--fault-kv-corrupt` drill hook corrupted
/// (called on the sender's thread at the flip, before the put).
pub fn record_kv_corrupt_fault() {
    counter!(FAULTS_INJECTED, "fault" => "kv_corrupt").increment(1);
}
