use super::{Exporter, Kind, Metric};

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
/// reason (`io`, `rejected`, `timeout`, `protocol`, `peer_abort`, `layer` —
/// a local bug: K/V bytes that do not fit the layout, or more of a
/// reservation already completed or aborted on its connection —,
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
/// worker's pool (ucx on one host, a direct writer: no gather) —, `pinned` —
/// checksummed where they lie and written to the socket straight from the
/// pool's blocks (tcp with `--tcp-pinned`, the default: no gather) —, or
/// `gathered` — copied out of the pool into buffers for the transport. On a
/// same-host ucx cluster nearly all should be `in_place` (a prompt's first
/// layers may be computed before the writer is granted), on a tcp one all
/// `pinned`. vLLM: none.
pub const KV_LAYERS_SENT: &str = "tandem_kv_layers_sent_total";
/// The `path` label values of [`KV_LAYERS_SENT`].
pub const LAYER_PATHS: [&str; 3] = ["in_place", "pinned", "gathered"];
/// `tandem_faults_injected_total{fault}`: faults this worker injected into
/// its own work because a drill asked it to (`kv_corrupt`: ucx transfers
/// with a byte flipped after the checksum, `--fault-kv-corrupt`). Exported only
/// by a prefill worker built with the `fault-injection` feature. vLLM: none.
pub const FAULTS_INJECTED: &str = "tandem_faults_injected_total";
/// `tandem_prefill_seconds`: engine time of one prefill (submit to first
/// token, queueing included). vLLM: `vllm:request_prefill_time_seconds`.
pub const PREFILL_SECONDS: &str = "tandem_prefill_seconds";

/// Every metric of this module: its kind, its label names and who exports it.
pub const CATALOG: &[Metric] = &[
    Metric { name: PREFILL_REQUESTS, kind: Kind::Counter, labels: &["outcome"], exporter: Exporter::Prefill },
    Metric { name: PROMPT_TOKENS, kind: Kind::Counter, labels: &[], exporter: Exporter::Prefill },
    Metric { name: KV_TRANSFER_BYTES, kind: Kind::Counter, labels: &[], exporter: Exporter::Prefill },
    Metric { name: KV_TRANSFER_SECONDS, kind: Kind::Histogram, labels: &[], exporter: Exporter::Prefill },
    Metric { name: KV_TRANSFER_FAILURES, kind: Kind::Counter, labels: &["reason"], exporter: Exporter::Prefill },
    Metric { name: KV_STALE_CONNECTIONS, kind: Kind::Counter, labels: &[], exporter: Exporter::Prefill },
    Metric { name: KV_LAYERS_SENT, kind: Kind::Counter, labels: &["path"], exporter: Exporter::Prefill },
    Metric { name: FAULTS_INJECTED, kind: Kind::Counter, labels: &["fault"], exporter: Exporter::Prefill },
    Metric { name: PREFILL_SECONDS, kind: Kind::Histogram, labels: &[], exporter: Exporter::Prefill },
];
