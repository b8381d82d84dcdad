//! Prometheus plumbing and the metrics both workers export, served on
//! `/metrics` by metrics-exporter-prometheus' HTTP listener (the `metrics`
//! config field). Role-specific metrics live in `prefill::metrics` and
//! `decode::metrics`.
//!
//! Names are prefixed `tandem_` (Prometheus reserves colons for recording
//! rules; vLLM's `vllm:` names map over by a rename). Every histogram has
//! explicit buckets, so it renders as a real histogram (`_bucket{le=..}`),
//! never as the exporter's default summary.

use std::net::SocketAddr;

use facts::metrics::worker::*;
use facts::metrics::PROCESS_START;
use metrics::{counter, describe_counter, describe_gauge, gauge};
use metrics_exporter_prometheus::{BuildError, Matcher, PrometheusBuilder};
use proto::worker::v1::ErrorKind;
use types::priority::Priority;

/// Sets [`PROCESS_START`] to now (every tandem process calls it once).
pub fn record_process_start() {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
    gauge!(PROCESS_START).set(now);
}

/// Default buckets for any histogram without its own: 5 ms .. 60 s.
pub const DEFAULT_BUCKETS: &[f64] = &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0];

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

/// Installs the global recorder and the HTTP listener on `addr` (serving
/// `/metrics`), spawning it on the current tokio runtime, with `buckets`
/// per histogram name. Returns the bound address.
///
/// The exporter binds the address itself and cannot report the port it got
/// nor take a pre-bound listener, so for port 0 a free port is found first
/// by binding `addr`, reading the port and dropping the socket; another
/// process could take that port in between (a small race; the install then
/// fails with a bind error rather than serving elsewhere).
pub fn install(addr: SocketAddr, buckets: &[(&str, &[f64])]) -> Result<SocketAddr, InstallError> {
    let addr = if addr.port() == 0 {
        std::net::TcpListener::bind(addr).and_then(|l| l.local_addr()).map_err(InstallError::Probe)?
    } else {
        addr
    };
    // A default for any histogram added later: never a summary.
    let mut builder = PrometheusBuilder::new().with_http_listener(addr).set_buckets(DEFAULT_BUCKETS)?;
    for (name, b) in buckets {
        builder = builder.set_buckets_for_metric(Matcher::Full((*name).into()), b)?;
    }
    builder.install()?;
    describe_gauge!(KV_CACHE_USAGE, "Used fraction of the KV block pool (0..1).");
    describe_gauge!(KV_BLOCKS_TOTAL, "KV blocks in the pool.");
    describe_gauge!(KV_BLOCKS_USED, "KV blocks referenced by sequences, reservations and held prefills.");
    describe_gauge!(REQUESTS_RUNNING, "Requests in the engine's running batch.");
    describe_gauge!(REQUESTS_WAITING, "Requests waiting for a running seat.");
    describe_gauge!(FENCED, "1 while fenced (another process holds this worker's etcd key, or no coordinator has called Health for --coordinator-silence-fence-ms): no new work is taken.");
    describe_counter!(FENCES, "Times this worker fenced itself.");
    describe_counter!(
        HEAP_RELEASED_BYTES,
        "Resident memory the allocator's free pages gave back to the kernel (RssAnon before less after each release)."
    );
    describe_counter!(PREEMPTIONS, "Sequences preempted (evicted, to be recomputed), by reason.");
    describe_counter!(PREFIX_CACHE_HIT_TOKENS, "Prompt tokens served from the prefix cache instead of computed.");
    describe_counter!(PREEMPTIONS_BY_PRIORITY, "Sequences preempted, by the evicted sequence's priority class.");
    describe_counter!(SPEC_DRAFT_TOKENS, "Prompt-lookup draft tokens computed beside decoding sequences.");
    describe_counter!(SPEC_ACCEPTED_TOKENS, "Prompt-lookup draft tokens accepted (equal to the token sampled there).");
    describe_gauge!(REQUESTS_WAITING_BY_PRIORITY, "Requests waiting for a running seat, by priority class.");
    describe_counter!(REQUESTS_BY_PRIORITY, "Requests received, by the priority class they carried.");
    describe_gauge!(PROCESS_START, "When this process started, Unix seconds.");
    record_process_start();
    gauge!(FENCED).set(0.0);
    counter!(FENCES).absolute(0);
    counter!(HEAP_RELEASED_BYTES).absolute(0);
    counter!(PREEMPTIONS, "reason" => PREEMPTION_KV_EXHAUSTED).absolute(0);
    counter!(PREFIX_CACHE_HIT_TOKENS).absolute(0);
    counter!(SPEC_DRAFT_TOKENS).absolute(0);
    counter!(SPEC_ACCEPTED_TOKENS).absolute(0);
    for p in Priority::ALL {
        counter!(PREEMPTIONS_BY_PRIORITY, "priority" => p.as_str()).absolute(0);
        gauge!(REQUESTS_WAITING_BY_PRIORITY, "priority" => p.as_str()).set(0.0);
        counter!(REQUESTS_BY_PRIORITY, "priority" => p.as_str()).absolute(0);
    }
    Ok(addr)
}

/// Records the fence state: `fenced` now, and whether this is a new fencing.
pub fn record_fence(fenced: bool, newly: bool) {
    gauge!(FENCED).set(if fenced { 1.0 } else { 0.0 });
    if newly {
        counter!(FENCES).increment(1);
    }
}

/// Exports `name{label=v}` at 0 for every `v` of `values`, before anything
/// is counted: a labelled counter otherwise appears only at its first
/// increment, so a reader (a drill, an alert's `increase()`) could not tell
/// "none yet" from "no such series" (e.g. a renamed metric).
pub fn zero(name: &'static str, label: &'static str, values: &[&'static str]) {
    for v in values {
        counter!(name, label => *v).increment(0);
    }
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

/// Sets the engine gauges from a runner snapshot.
pub fn record_stats(s: &engine::runner::RunnerStats) {
    let usage = if s.kv.total == 0 { 0.0 } else { s.kv.used as f64 / s.kv.total as f64 };
    gauge!(KV_CACHE_USAGE).set(usage);
    gauge!(KV_BLOCKS_TOTAL).set(s.kv.total as f64);
    gauge!(KV_BLOCKS_USED).set(s.kv.used as f64);
    gauge!(REQUESTS_RUNNING).set(s.running as f64);
    gauge!(REQUESTS_WAITING).set(s.waiting as f64);
    counter!(PREEMPTIONS, "reason" => PREEMPTION_KV_EXHAUSTED).absolute(s.preemptions);
    counter!(PREFIX_CACHE_HIT_TOKENS).absolute(s.prefix_hit_tokens);
    counter!(SPEC_DRAFT_TOKENS).absolute(s.draft_tokens.0);
    counter!(SPEC_ACCEPTED_TOKENS).absolute(s.draft_tokens.1);
    for p in Priority::ALL {
        gauge!(REQUESTS_WAITING_BY_PRIORITY, "priority" => p.as_str()).set(s.waiting_by_class[p.index()] as f64);
        counter!(PREEMPTIONS_BY_PRIORITY, "priority" => p.as_str()).absolute(s.preemptions_by_class[p.index()]);
    }
}

/// Counts a request received with class `p` ([`REQUESTS_BY_PRIORITY`]).
pub fn record_request_class(p: Priority) {
    counter!(REQUESTS_BY_PRIORITY, "priority" => p.as_str()).increment(1);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_kind_has_a_listed_outcome() {
        let kinds: Vec<ErrorKind> = (0..64).filter_map(|i| ErrorKind::try_from(i).ok()).collect();
        assert!(kinds.len() >= 8, "only {} kinds decoded", kinds.len());
        for k in kinds {
            assert!(OUTCOMES.contains(&outcome_label(k)), "{k:?} -> {} is not in OUTCOMES", outcome_label(k));
        }
        assert!(OUTCOMES.contains(&"ok"));
    }
}
