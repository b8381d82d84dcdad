//! The prefill worker's own metrics (the shared ones, KV usage and request
//! gauges, are in [`crate::metrics`]).

use metrics::{counter, describe_counter, describe_histogram, histogram, Unit};

use facts::metrics::prefill::*;

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
        "Streamed KV layer messages, by path (in_place: stored by the engine's thread into the decode pool; pinned: written from the pool; gathered)."
    );
    #[cfg(feature = "fault-injection")]
    describe_counter!(FAULTS_INJECTED, "Faults injected by drill flags, by fault.");
    // Exported from the start, so a check that reads it can tell 0 from a missing series.
    counter!(KV_TRANSFER_BYTES).absolute(0);
    counter!(KV_STALE_CONNECTIONS).absolute(0);
    #[cfg(feature = "fault-injection")]
    for fault in ["kv_corrupt", "swap_token", "leak_blocks"] {
        counter!(FAULTS_INJECTED, "fault" => fault).absolute(0);
    }
    worker_common::metrics::zero(PREFILL_REQUESTS, "outcome", &facts::metrics::worker::OUTCOMES);
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
    debug_assert!(facts::metrics::worker::OUTCOMES.contains(&outcome), "unlisted outcome {outcome}");
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

#[cfg(feature = "fault-injection")]
/// Counts one ucx transfer the `--fault-kv-corrupt` drill hook corrupted
/// (called on the sender's thread at the flip, before the put).
pub fn record_kv_corrupt_fault() {
    counter!(FAULTS_INJECTED, "fault" => "kv_corrupt").increment(1);
}

/// Counts one planted bug that struck (`swap_token`, `leak_blocks`; see `crate::plant`).
#[cfg(feature = "fault-injection")]
pub fn record_planted(fault: &'static str) {
    counter!(FAULTS_INJECTED, "fault" => fault).increment(1);
}
