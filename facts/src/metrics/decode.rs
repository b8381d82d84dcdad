use super::{Exporter, Kind, Metric};

/// `tandem_decode_requests_total{outcome}`: Generate streams ended, by
/// outcome (`ok`, or the error kind). vLLM: `vllm:request_success_total`.
pub const DECODE_REQUESTS: &str = "tandem_decode_requests_total";
/// `tandem_prefill_route_total{route}`: where a request's prompt was
/// prefilled first: `local` (short prompt or no prefill worker named) or
/// `remote`. vLLM: none (its disaggregation has no conditional route).
pub const PREFILL_ROUTE: &str = "tandem_prefill_route_total";
/// `tandem_kv_load_failure_policy{policy}`: 1 for the configured policy
/// (an info metric, so dashboards show what a failed load will do).
pub const POLICY_INFO: &str = "tandem_kv_load_failure_policy";
/// `tandem_kv_load_failures_total{reason}`: remote KV loads that failed, by
/// reason (`rpc` — the prefill worker could not be reached or died;
/// `prefill_error` — it answered an error; `version_mismatch`; `corrupt`;
/// `lease_expired`; `timeout` — the lease ran out waiting for it).
pub const KV_LOAD_FAILURES: &str = "tandem_kv_load_failures_total";
/// Every [`KV_LOAD_FAILURES`] reason (`incomplete`: the prefill worker
/// answered before every layer arrived).
pub const LOAD_FAILURE_REASONS: [&str; 7] =
    ["rpc", "prefill_error", "version_mismatch", "corrupt", "lease_expired", "timeout", "incomplete"];
/// `tandem_kv_load_policy_outcomes_total{policy,outcome}`: what the policy
/// did about a failed load: `recomputed`, `retried`, `failed`; and, under
/// `recompute` when the prefill worker refused as overloaded,
/// `overload_absorbed` (prefilled here, within
/// `max_absorbed_prefill_tokens_per_s`) or `overload_refused` (over it:
/// answered `overloaded`).
pub const POLICY_OUTCOMES: &str = "tandem_kv_load_policy_outcomes_total";
/// [`POLICY_OUTCOMES`] label values.
pub const OUTCOME_RECOMPUTED: &str = "recomputed";
pub const OUTCOME_RETRIED: &str = "retried";
pub const OUTCOME_FAILED: &str = "failed";
pub const OUTCOME_OVERLOAD_ABSORBED: &str = "overload_absorbed";
pub const OUTCOME_OVERLOAD_REFUSED: &str = "overload_refused";
pub const POLICY_OUTCOME_LABELS: [&str; 5] =
    [OUTCOME_RECOMPUTED, OUTCOME_RETRIED, OUTCOME_FAILED, OUTCOME_OVERLOAD_ABSORBED, OUTCOME_OVERLOAD_REFUSED];
/// [`PREFILL_ROUTE`] label values.
pub const ROUTE_LOCAL: &str = "local";
pub const ROUTE_REMOTE: &str = "remote";
/// `tandem_kv_received_bytes_total`: K+V payload bytes written into this
/// worker's pool by transfers (all frames accepted, whether or not the
/// reservation completed).
pub const KV_RECEIVED_BYTES: &str = "tandem_kv_received_bytes_total";
/// `tandem_kv_transfers_completed_total`: reservations whose every layer
/// arrived and was acknowledged.
pub const KV_TRANSFERS_COMPLETED: &str = "tandem_kv_transfers_completed_total";
/// `tandem_kv_handshakes_rejected_total{reason}`: KV connections refused at
/// the handshake (`version_group`, `fingerprint`, `protocol_version`).
pub const HANDSHAKES_REJECTED: &str = "tandem_kv_handshakes_rejected_total";
/// `tandem_kv_frames_refused_total{reason}`: KV frames the receiver
/// refused and never wrote (`expired`, `checksum`, `stale_generation`,
/// `aborted`, ... — kvtransfer's `FrameError::REASONS`).
pub const FRAMES_REFUSED: &str = "tandem_kv_frames_refused_total";
/// `tandem_kv_connections_accepted_total`: KV connections the transfer
/// listener accepted (QUIC: connections, each carrying frame streams).
pub const CONNECTIONS_ACCEPTED: &str = "tandem_kv_connections_accepted_total";
/// `tandem_kv_connections_closed_total{reason}`: KV connections (QUIC: frame
/// streams) that ended, by reason: `peer_closed` is the normal end; `decode`
/// (bytes that are not a frame), `truncated`, `io`, `idle`, `not_hello`,
/// `rejected`, `unexpected_frame`, `tls` and the shared-memory transport's
/// `ring_refused`, `bad_slot`, `unexpected_message`, `peer_uid` are a peer or
/// link at fault; UCX's are `bye` (the normal end), `peer_failed`, `rejected`
/// and `busy` (kvtransfer's `CloseReason` labels, each transport its own).
pub const CONNECTIONS_CLOSED: &str = "tandem_kv_connections_closed_total";
/// `tandem_kv_load_seconds`: reserve to acknowledged KV (the remote prefill
/// and its transfer), for loads that succeeded.
pub const KV_LOAD_SECONDS: &str = "tandem_kv_load_seconds";
/// `tandem_reservations_active`: KV reservations live now.
pub const RESERVATIONS_ACTIVE: &str = "tandem_reservations_active";
/// `tandem_reservations_expired_total`: reservations whose lease ran out
/// before the KV arrived (their blocks were freed, their late frames refused).
pub const RESERVATIONS_EXPIRED: &str = "tandem_reservations_expired_total";
/// `tandem_kv_lease_renewals_total`: reservation leases renewed because the
/// prefill worker reported the prompt still queued there (`PrefillStatus`):
/// rising steadily means prompts wait in prefill queues for longer than a
/// third of `reservation_ttl_ms` — prefill capacity is short, while decode
/// KV stays reserved for them.
pub const LEASE_RENEWALS: &str = "tandem_kv_lease_renewals_total";
/// `tandem_kv_transport_info{transport,ucx_tls}`: 1 for the KV transport
/// this worker receives on; `ucx_tls` is `UCX_TLS` (or `default`) for ucx,
/// `none` for the others. vLLM: none (its KV connector is in its config).
pub const TRANSPORT_INFO: &str = "tandem_kv_transport_info";
/// `tandem_kv_ucx_quarantined_bytes` / `_ranges`: landing-region bytes and
/// ranges of reservations that ended unfinished, held until their sender is
/// fenced (ucx only). Stuck above 0: a sender stalled or cut off.
pub const UCX_QUARANTINED_BYTES: &str = "tandem_kv_ucx_quarantined_bytes";
pub const UCX_QUARANTINED_RANGES: &str = "tandem_kv_ucx_quarantined_ranges";
/// `tandem_kv_ucx_landing_in_use_bytes` of `tandem_kv_ucx_landing_bytes`:
/// the landing region granted to transfers or quarantined (ucx only).
pub const UCX_LANDING_IN_USE: &str = "tandem_kv_ucx_landing_in_use_bytes";
pub const UCX_LANDING_BYTES: &str = "tandem_kv_ucx_landing_bytes";
/// `tandem_kv_ucx_landing_refused_total{reason}`: reservations refused
/// landing space (`landing_full`: back-pressure; `landing_too_large`,
/// `not_receiving`, `claimed`) — kvtransfer's `LandingRefusal` labels.
pub const UCX_LANDING_REFUSED: &str = "tandem_kv_ucx_landing_refused_total";
/// `tandem_kv_ucx_fences_total`: quarantined ranges freed after their
/// sender flushed or went away.
pub const UCX_FENCES: &str = "tandem_kv_ucx_fences_total";
/// `tandem_kv_ucx_quarantined_blocks`: pool blocks of ended reservations
/// that a sender on this host wrote directly and has not been fenced for
/// (ucx with `ucx_direct`). Stuck above 0: a sender stalled, or cut off from
/// its control connection while its process still runs.
pub const UCX_QUARANTINED_BLOCKS: &str = "tandem_kv_ucx_quarantined_blocks";
/// `tandem_kv_ucx_direct_grants_total` / `tandem_kv_ucx_direct_layers_total`:
/// reservations granted their pool blocks to write directly, and layers
/// accepted that way (the rest went through the landing region).
pub const UCX_DIRECT_GRANTS: &str = "tandem_kv_ucx_direct_grants_total";
pub const UCX_DIRECT_LAYERS: &str = "tandem_kv_ucx_direct_layers_total";
/// `tandem_kv_layers_read_in_place_total`: layer frames the TCP server read
/// from the socket straight into their pool blocks and accepted
/// (`tcp_direct`); the rest were read into buffers and written by the engine.
pub const KV_LAYERS_READ_IN_PLACE: &str = "tandem_kv_layers_read_in_place_total";
/// `tandem_kv_ucx_granted_transfers`: transfers under way now, holding a
/// landing range or their pool blocks (ucx only).
pub const UCX_GRANTED_TRANSFERS: &str = "tandem_kv_ucx_granted_transfers";
/// `tandem_time_to_first_token_seconds`: Generate arrival to the first
/// token sent. vLLM: `vllm:time_to_first_token_seconds`.
pub const TTFT: &str = "tandem_time_to_first_token_seconds";
/// `tandem_time_per_output_token_seconds`: gap between consecutive tokens
/// of a stream. vLLM: `vllm:time_per_output_token_seconds` (inter-token latency).
pub const TPOT: &str = "tandem_time_per_output_token_seconds";
/// `tandem_generation_tokens_total`: tokens streamed. vLLM: `vllm:generation_tokens_total`.
pub const GENERATION_TOKENS: &str = "tandem_generation_tokens_total";

/// Every metric of this module: its kind, its label names and who exports it.
pub const CATALOG: &[Metric] = &[
    Metric { name: DECODE_REQUESTS, kind: Kind::Counter, labels: &["outcome"], exporter: Exporter::Decode },
    Metric { name: PREFILL_ROUTE, kind: Kind::Counter, labels: &["route"], exporter: Exporter::Decode },
    Metric { name: POLICY_INFO, kind: Kind::Gauge, labels: &["policy"], exporter: Exporter::Decode },
    Metric { name: KV_LOAD_FAILURES, kind: Kind::Counter, labels: &["reason"], exporter: Exporter::Decode },
    Metric { name: POLICY_OUTCOMES, kind: Kind::Counter, labels: &["policy", "outcome"], exporter: Exporter::Decode },
    Metric { name: KV_RECEIVED_BYTES, kind: Kind::Counter, labels: &[], exporter: Exporter::Decode },
    Metric { name: KV_TRANSFERS_COMPLETED, kind: Kind::Counter, labels: &[], exporter: Exporter::Decode },
    Metric { name: HANDSHAKES_REJECTED, kind: Kind::Counter, labels: &["reason"], exporter: Exporter::Decode },
    Metric { name: FRAMES_REFUSED, kind: Kind::Counter, labels: &["reason"], exporter: Exporter::Decode },
    Metric { name: CONNECTIONS_ACCEPTED, kind: Kind::Counter, labels: &[], exporter: Exporter::Decode },
    Metric { name: CONNECTIONS_CLOSED, kind: Kind::Counter, labels: &["reason"], exporter: Exporter::Decode },
    Metric { name: KV_LOAD_SECONDS, kind: Kind::Histogram, labels: &[], exporter: Exporter::Decode },
    Metric { name: RESERVATIONS_ACTIVE, kind: Kind::Gauge, labels: &[], exporter: Exporter::Decode },
    Metric { name: RESERVATIONS_EXPIRED, kind: Kind::Counter, labels: &[], exporter: Exporter::Decode },
    Metric { name: LEASE_RENEWALS, kind: Kind::Counter, labels: &[], exporter: Exporter::Decode },
    Metric { name: TRANSPORT_INFO, kind: Kind::Gauge, labels: &["transport", "ucx_tls"], exporter: Exporter::Decode },
    Metric { name: UCX_QUARANTINED_BYTES, kind: Kind::Gauge, labels: &[], exporter: Exporter::Decode },
    Metric { name: UCX_QUARANTINED_RANGES, kind: Kind::Gauge, labels: &[], exporter: Exporter::Decode },
    Metric { name: UCX_LANDING_IN_USE, kind: Kind::Gauge, labels: &[], exporter: Exporter::Decode },
    Metric { name: UCX_LANDING_BYTES, kind: Kind::Gauge, labels: &[], exporter: Exporter::Decode },
    Metric { name: UCX_LANDING_REFUSED, kind: Kind::Counter, labels: &["reason"], exporter: Exporter::Decode },
    Metric { name: UCX_FENCES, kind: Kind::Counter, labels: &[], exporter: Exporter::Decode },
    Metric { name: UCX_QUARANTINED_BLOCKS, kind: Kind::Gauge, labels: &[], exporter: Exporter::Decode },
    Metric { name: UCX_DIRECT_GRANTS, kind: Kind::Counter, labels: &[], exporter: Exporter::Decode },
    Metric { name: UCX_DIRECT_LAYERS, kind: Kind::Counter, labels: &[], exporter: Exporter::Decode },
    Metric { name: UCX_GRANTED_TRANSFERS, kind: Kind::Gauge, labels: &[], exporter: Exporter::Decode },
    Metric { name: KV_LAYERS_READ_IN_PLACE, kind: Kind::Counter, labels: &[], exporter: Exporter::Decode },
    Metric { name: TTFT, kind: Kind::Histogram, labels: &[], exporter: Exporter::Decode },
    Metric { name: TPOT, kind: Kind::Histogram, labels: &[], exporter: Exporter::Decode },
    Metric { name: GENERATION_TOKENS, kind: Kind::Counter, labels: &[], exporter: Exporter::Decode },
];
