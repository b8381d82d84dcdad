//! The decode worker's own metrics (the shared KV usage and request gauges
//! are in [`crate::metrics`]).

use metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram, Unit};

use facts::metrics::decode::*;

/// Buckets of TTFT and KV load time: 5 ms .. 60 s.
pub const LATENCY_BUCKETS: &[f64] = &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0];
/// Buckets of the per-token gap: 1 ms .. 2.5 s.
pub const TPOT_BUCKETS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5];

/// Buckets per histogram, for [`worker_common::metrics::install`].
pub const BUCKETS: &[(&str, &[f64])] =
    &[(TTFT, LATENCY_BUCKETS), (KV_LOAD_SECONDS, LATENCY_BUCKETS), (TPOT, TPOT_BUCKETS)];

/// Describes this role's metrics and sets the policy info metric.
pub fn describe(policy: crate::KvLoadFailurePolicy) {
    describe_counter!(DECODE_REQUESTS, "Generate streams ended, by outcome.");
    describe_counter!(PREFILL_ROUTE, "Requests by where their prompt was first prefilled.");
    describe_gauge!(POLICY_INFO, "1 for the configured kv_load_failure_policy.");
    describe_counter!(KV_LOAD_FAILURES, "Remote KV loads that failed, by reason.");
    describe_counter!(POLICY_OUTCOMES, "What kv_load_failure_policy did about a failed load.");
    describe_counter!(KV_RECEIVED_BYTES, Unit::Bytes, "K+V payload bytes written by transfers.");
    describe_counter!(KV_TRANSFERS_COMPLETED, "Reservations whose KV arrived complete.");
    describe_counter!(HANDSHAKES_REJECTED, "KV connections refused at the handshake, by reason.");
    describe_counter!(FRAMES_REFUSED, "KV frames refused and never written, by reason.");
    describe_counter!(CONNECTIONS_ACCEPTED, "KV connections the transfer listener accepted.");
    describe_counter!(CONNECTIONS_CLOSED, "KV connections (QUIC: frame streams) that ended, by reason.");
    describe_histogram!(KV_LOAD_SECONDS, Unit::Seconds, "Reserve to acknowledged KV, successful loads.");
    describe_gauge!(RESERVATIONS_ACTIVE, "KV reservations live now.");
    describe_counter!(RESERVATIONS_EXPIRED, "Reservations whose lease ran out before the KV arrived.");
    describe_gauge!(TRANSPORT_INFO, "1 for the KV transport this worker receives on (ucx_tls: UCX_TLS).");
    describe_gauge!(UCX_QUARANTINED_BYTES, Unit::Bytes, "UCX landing bytes quarantined until their sender is fenced.");
    describe_gauge!(UCX_QUARANTINED_RANGES, "UCX landing ranges quarantined until their sender is fenced.");
    describe_gauge!(UCX_LANDING_IN_USE, Unit::Bytes, "UCX landing bytes granted or quarantined.");
    describe_gauge!(UCX_LANDING_BYTES, Unit::Bytes, "UCX landing region size.");
    describe_counter!(UCX_LANDING_REFUSED, "Reservations refused UCX landing space, by reason.");
    describe_counter!(LEASE_RENEWALS, "Reservation leases renewed while their prompt was queued on a prefill worker.");
    describe_counter!(
        UCX_FENCES,
        "Quarantined UCX landing ranges and direct reservations freed after their sender was fenced."
    );
    describe_gauge!(
        UCX_QUARANTINED_BLOCKS,
        "Pool blocks written directly over UCX, quarantined until their sender is fenced."
    );
    describe_counter!(UCX_DIRECT_GRANTS, "Reservations whose sender was granted their pool blocks to write directly.");
    describe_counter!(UCX_DIRECT_LAYERS, "Layers written directly into the pool over UCX and accepted.");
    describe_gauge!(UCX_GRANTED_TRANSFERS, "UCX transfers under way, holding a landing range or their pool blocks.");
    describe_counter!(
        KV_LAYERS_READ_IN_PLACE,
        "Layers the TCP server read straight into their pool blocks and accepted."
    );
    describe_histogram!(TTFT, Unit::Seconds, "Generate arrival to the first token sent.");
    describe_histogram!(TPOT, Unit::Seconds, "Gap between consecutive streamed tokens.");
    describe_counter!(GENERATION_TOKENS, Unit::Count, "Tokens streamed.");
    for p in crate::KvLoadFailurePolicy::ALL {
        gauge!(POLICY_INFO, "policy" => p.as_str()).set(if p == policy { 1.0 } else { 0.0 });
    }
    // Exported from the start, so a check that reads them can tell 0 from a missing series.
    counter!(KV_RECEIVED_BYTES).absolute(0);
    worker_common::metrics::zero(DECODE_REQUESTS, "outcome", &facts::metrics::worker::OUTCOMES);
    worker_common::metrics::zero(PREFILL_ROUTE, "route", &[ROUTE_LOCAL, ROUTE_REMOTE]);
    worker_common::metrics::zero(KV_LOAD_FAILURES, "reason", &LOAD_FAILURE_REASONS);
    for o in POLICY_OUTCOME_LABELS {
        counter!(POLICY_OUTCOMES, "policy" => policy.as_str(), "outcome" => o).increment(0);
    }
    worker_common::metrics::zero(FRAMES_REFUSED, "reason", &kvtransfer::FrameError::REASONS);
    counter!(KV_TRANSFERS_COMPLETED).increment(0);
    counter!(RESERVATIONS_EXPIRED).increment(0);
    counter!(LEASE_RENEWALS).increment(0);
}

pub fn record_outcome(outcome: &'static str) {
    debug_assert!(facts::metrics::worker::OUTCOMES.contains(&outcome), "unlisted outcome {outcome}");
    counter!(DECODE_REQUESTS, "outcome" => outcome).increment(1);
}

pub fn record_route(route: &'static str) {
    debug_assert!([ROUTE_LOCAL, ROUTE_REMOTE].contains(&route), "unlisted route {route}");
    counter!(PREFILL_ROUTE, "route" => route).increment(1);
}

pub fn record_load_failure(reason: &'static str) {
    // A reason missing from the list would not be exported before its first count.
    debug_assert!(LOAD_FAILURE_REASONS.contains(&reason), "unlisted reason {reason}");
    counter!(KV_LOAD_FAILURES, "reason" => reason).increment(1);
}

pub fn record_policy(policy: crate::KvLoadFailurePolicy, outcome: &'static str) {
    debug_assert!(POLICY_OUTCOME_LABELS.contains(&outcome), "unlisted outcome {outcome}");
    counter!(POLICY_OUTCOMES, "policy" => policy.as_str(), "outcome" => outcome).increment(1);
}

pub fn record_lease_renewal() {
    counter!(LEASE_RENEWALS).increment(1);
}

pub fn record_load(seconds: f64) {
    histogram!(KV_LOAD_SECONDS).record(seconds);
}

pub fn record_first_token(seconds: f64) {
    histogram!(TTFT).record(seconds);
}

pub fn record_token_gap(seconds: f64) {
    histogram!(TPOT).record(seconds);
    counter!(GENERATION_TOKENS).increment(1);
}

/// K+V payload bytes of one accepted frame, posted to the pool.
pub fn record_received(bytes: u64) {
    counter!(KV_RECEIVED_BYTES).increment(bytes);
}

/// Mirrors the transfer listener's connection counters (absolute values,
/// never reset), with the close reasons a listener of `kind` can give.
pub fn record_connections(s: &kvtransfer::ServerStats, kind: kvtransfer::TransportKind) {
    counter!(CONNECTIONS_ACCEPTED).absolute(s.connections_accepted);
    if kind == kvtransfer::TransportKind::Tcp {
        counter!(KV_LAYERS_READ_IN_PLACE).absolute(s.layers_read_in_place);
    }
    for (label, n) in s.closed_for(kind) {
        counter!(CONNECTIONS_CLOSED, "reason" => label).absolute(n);
    }
}

/// Sets the transport info metric.
pub fn record_transport(transport: kvtransfer::TransportKind) {
    let tls = match transport {
        kvtransfer::TransportKind::Ucx => kvtransfer::transport::ucx::ucx_tls(),
        _ => "none".to_owned(),
    };
    gauge!(TRANSPORT_INFO, "transport" => transport.as_str(), "ucx_tls" => tls).set(1.0);
}

/// Mirrors the UCX server's landing-region counters (absolute values).
pub fn record_ucx(s: &kvtransfer::UcxStats) {
    gauge!(UCX_QUARANTINED_BYTES).set(s.quarantined_bytes as f64);
    gauge!(UCX_QUARANTINED_RANGES).set(s.quarantined_ranges as f64);
    gauge!(UCX_LANDING_IN_USE).set(s.landing_in_use_bytes as f64);
    gauge!(UCX_LANDING_BYTES).set(s.landing_bytes as f64);
    for (i, r) in kvtransfer::LandingRefusal::ALL.iter().enumerate() {
        counter!(UCX_LANDING_REFUSED, "reason" => r.as_str()).absolute(s.refused[i]);
    }
    counter!(UCX_FENCES).absolute(s.fences_completed);
    gauge!(UCX_QUARANTINED_BLOCKS).set(s.quarantined_blocks as f64);
    counter!(UCX_DIRECT_GRANTS).absolute(s.direct_grants);
    counter!(UCX_DIRECT_LAYERS).absolute(s.direct_layers);
    gauge!(UCX_GRANTED_TRANSFERS).set(s.granted_transfers as f64);
}

/// Mirrors the KV receiver's own counters (absolute values, never reset);
/// received bytes are counted as each frame lands ([`record_received`]).
pub fn record_receiver(c: &kvtransfer::ReceiverCounters, active: usize) {
    counter!(KV_TRANSFERS_COMPLETED).absolute(c.reservations_completed);
    counter!(RESERVATIONS_EXPIRED).absolute(c.reservations_expired);
    for reason in [
        kvtransfer::RejectReason::VersionGroup,
        kvtransfer::RejectReason::Fingerprint,
        kvtransfer::RejectReason::ProtocolVersion,
    ] {
        counter!(HANDSHAKES_REJECTED, "reason" => reason.as_str()).absolute(c.hello_rejected(reason));
    }
    for (i, reason) in kvtransfer::FrameError::REASONS.iter().enumerate() {
        counter!(FRAMES_REFUSED, "reason" => *reason).absolute(c.frames_refused[i]);
    }
    gauge!(RESERVATIONS_ACTIVE).set(active as f64);
}
