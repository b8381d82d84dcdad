//! The coordinator's Prometheus metrics, served on `GET /metrics` of the
//! HTTP port (no API key needed, like `/health` and `/ready`).
//!
//! Names are prefixed `tandem_coordinator_` so they never collide with the
//! workers' `tandem_` series in one Prometheus. Every histogram has explicit
//! buckets (the exporter would otherwise render a summary). The vLLM
//! counterpart is named where one exists.

use std::time::Duration;

use facts::metrics::coordinator::*;
use facts::metrics::PROCESS_START;
use metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram};
use metrics_exporter_prometheus::{BuildError, Matcher, PrometheusBuilder, PrometheusHandle};

use crate::router::Prefill;

const LATENCY_BUCKETS: &[f64] = &[0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0];
const TOKEN_BUCKETS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5];
/// A routing decision: microseconds, up to a few milliseconds.
const DECISION_BUCKETS: &[f64] =
    &[1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 7.5e-5, 1e-4, 1.5e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2];

/// Installs the global recorder; render the returned handle on `/metrics`.
pub fn install() -> Result<PrometheusHandle, BuildError> {
    let handle = PrometheusBuilder::new()
        .set_buckets(LATENCY_BUCKETS)?
        .set_buckets_for_metric(Matcher::Full(TPOT.into()), TOKEN_BUCKETS)?
        .set_buckets_for_metric(Matcher::Full(ROUTE_DECISION.into()), DECISION_BUCKETS)?
        .set_buckets_for_metric(Matcher::Full(ROUTE_DECISION_CPU.into()), DECISION_BUCKETS)?
        .install_recorder()?;
    describe();
    zero();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
    gauge!(PROCESS_START).set(now);
    Ok(handle)
}

fn describe() {
    describe_counter!(REQUESTS, "Finished requests by API, HTTP status and error code");
    describe_counter!(SHED, "Requests refused by admission, by reason");
    describe_gauge!(QUEUE_DEPTH, "Requests waiting in the central queue");
    describe_gauge!(PROCESS_START, "When this process started, Unix seconds");
    describe_gauge!(QUEUE_TOKENS, "Token cost waiting in the central queue");
    describe_gauge!(RUNNING, "Requests dispatched to workers");
    describe_histogram!(QUEUE_WAIT, metrics::Unit::Seconds, "Arrival to dispatch");
    describe_histogram!(ROUTE_DECISION, metrics::Unit::Seconds, "One routing decision, in the coordinator");
    describe_histogram!(
        ROUTE_DECISION_CPU,
        metrics::Unit::Seconds,
        "One routing decision, in CPU time of the thread that made it"
    );
    describe_counter!(ROUTE_DECISIONS, "Routed requests by remote or local prefill");
    describe_counter!(ROUTE_REFUSED, "Requests with no route, by reason");
    describe_gauge!(WORKERS, "Registered workers by role and state");
    describe_gauge!(WORKERS_STALE, "Workers not routed to: no load poll answered for 4 intervals");
    describe_gauge!(WORKERS_LOAD_KNOWN, "Workers whose load the last polls answered");
    describe_counter!(MEMBERSHIP_CHANGES, "Membership changes seen from etcd");
    describe_counter!(REGISTRY_RESYNCS, "Full membership re-lists after a lost etcd watch");
    describe_gauge!(REGISTRY_HEALTHY, "1 while the etcd watch is live");
    describe_histogram!(TTFT, metrics::Unit::Seconds, "Arrival to first token");
    describe_histogram!(TPOT, metrics::Unit::Seconds, "Gap between output tokens");
    describe_histogram!(E2E, metrics::Unit::Seconds, "Arrival to the last byte");
    describe_counter!(IDEMPOTENT_REPLAYS, "Requests answered from an earlier one with the same Idempotency-Key");
    describe_counter!(STREAM_RESUMES, "Streams resumed from a cursor, by outcome");
    describe_counter!(STREAM_HANDOFFS, "Running streams a draining coordinator ended for a peer to resume");
    describe_gauge!(BREAKER_STATE, "Prefill/decode pair circuit breaker: 0 closed, 1 half-open, 2 open");
    describe_counter!(BREAKER_TRANSITIONS, "Prefill/decode pair circuit breaker state changes");
    describe_counter!(PREFILL_ATTEMPTS, "Remote prefill attempts reported by decode workers, by outcome");
    describe_counter!(ROUTE_LISTINGS, "Routing decisions by the workers they listed: a sample or all");
    describe_counter!(ROUTE_PAIRS_SKIPPED, "Prefill workers left out of a route because the pair cannot work");
    describe_counter!(CROSS_ZONE_ROUTES, "Remote-prefill routes whose first prefill worker is in another zone");
    describe_counter!(PREFILL_UNAVAILABLE, "Requests refused at once: every prefill worker of the group open");
    describe_counter!(STREAM_SEND_TIMEOUTS, "Streams ended because the client stopped reading");
    describe_counter!(DECODE_REROUTES, "Requests routed to another decode worker before their first token");
    describe_counter!(MIGRATIONS, "Running requests moved to another decode worker, by reason and outcome");
    describe_counter!(MIGRATION_RECOMPUTED_TOKENS, "Tokens migrations sent to be prefilled again");
    describe_counter!(TENANT_REQUESTS, "Requests by tenant: admitted, or refused by a tenant check (by code)");
    describe_counter!(TENANT_TOKENS, "Prompt tokens admitted and output tokens generated, by tenant");
    describe_gauge!(TENANT_KV_TOKENS, "KV tokens held against each tenant's max_kv_share");
    describe_gauge!(TENANTS, "Tenants configured");
    describe_gauge!(ADMISSION_CAPACITY, "Requests this coordinator may have dispatched at once");
    describe_gauge!(WORKER_PREFIX_BLOCKS, "Prefix blocks each worker last reported cached");
    describe_counter!(PREFIX_WATCH_RESTARTS, "Prefix watch streams reopened, by why the last one stopped");
    describe_counter!(PREFIX_CACHED_TOKENS, "Prompt tokens routed to a worker that reported them cached, by scope");
    describe_counter!(PREFIX_HIT_TOKENS, "Prompt tokens the workers took from their prefix caches, by scope");
    describe_counter!(TENANTS_RELOADS, "Tenants file reloads, applied or refused");
    describe_gauge!(FLEET_SPLIT, "Coordinators every tenant budget is split between");
    describe_gauge!(TOKENIZER_QUEUE, "Requests waiting for or in the tokenizer pool");
    describe_gauge!(HTTP_CONNECTIONS, "Open HTTP connections");
    describe_counter!(GRPC_CONNECTIONS, "gRPC connections accepted");
    describe_counter!(RETRIES, "Retries seen by the retry gate, by outcome");
    describe_counter!(HTTP_TIMEOUTS, "HTTP requests whose body did not arrive in time");
    describe_gauge!(PAIRS_UNLABELLED, "Prefill/decode pairs past the label budget");
}

/// How many (prefill, decode) pairs get series of their own.
pub const PAIR_LABELS: usize = 256;

/// The label budget for pair series: the first [`PAIR_LABELS`] pairs seen
/// keep their names; later ones are `None` (not exported per pair).
fn pair_labelled(prefill: &str, decode: &str) -> bool {
    use std::collections::HashSet;
    use std::sync::{Mutex, OnceLock};
    static SEEN: OnceLock<Mutex<HashSet<(String, String)>>> = OnceLock::new();
    static OVER: OnceLock<Mutex<HashSet<(String, String)>>> = OnceLock::new();
    let seen = SEEN.get_or_init(Mutex::default);
    let mut seen = seen.lock().unwrap_or_else(|e| e.into_inner());
    let pair = (prefill.to_owned(), decode.to_owned());
    if seen.contains(&pair) {
        return true;
    }
    if seen.len() < PAIR_LABELS {
        seen.insert(pair);
        return true;
    }
    drop(seen);
    // Counted once per pair; bounded by the fleet, not by requests.
    let over = OVER.get_or_init(Mutex::default);
    let mut over = over.lock().unwrap_or_else(|e| e.into_inner());
    if over.len() < 1 << 20 && over.insert(pair) {
        gauge!(PAIRS_UNLABELLED).set(over.len() as f64);
    }
    false
}

/// The `decode` label of a pair series: its own within the budget, else `_other`.
fn decode_label(prefill: &str, decode: &str) -> String {
    if pair_labelled(prefill, decode) {
        decode.to_owned()
    } else {
        "_other".to_owned()
    }
}

pub fn tenant_outcome(tenant: &str, outcome: &'static str) {
    counter!(TENANT_REQUESTS, "tenant" => tenant.to_owned(), "outcome" => outcome).increment(1);
}

pub fn tenant_kv_tokens(tenant: &str, held: u64) {
    gauge!(TENANT_KV_TOKENS, "tenant" => tenant.to_owned()).set(held as f64);
}

pub fn tenant_tokens(tenant: &str, kind: &'static str, n: u64) {
    counter!(TENANT_TOKENS, "tenant" => tenant.to_owned(), "kind" => kind).increment(n);
}

pub fn prefix_cached_tokens(scope: String, n: usize) {
    counter!(PREFIX_CACHED_TOKENS, "scope" => scope).increment(n as u64);
}

pub fn prefix_hit_tokens(scope: String, n: u32) {
    counter!(PREFIX_HIT_TOKENS, "scope" => scope).increment(u64::from(n));
}

pub fn prefix_watch_restart(reason: &'static str) {
    counter!(PREFIX_WATCH_RESTARTS, "reason" => reason).increment(1);
}

pub fn worker_prefix_blocks(worker: &str, n: usize) {
    gauge!(WORKER_PREFIX_BLOCKS, "worker" => worker.to_owned()).set(n as f64);
}

pub fn admission_capacity(n: usize) {
    gauge!(ADMISSION_CAPACITY).set(n as f64);
}

pub fn tenants_loaded(n: usize) {
    gauge!(TENANTS).set(n as f64);
}

pub fn tenants_reload(outcome: &'static str) {
    debug_assert!(TENANTS_RELOAD_OUTCOMES.contains(&outcome), "unlisted outcome {outcome}");
    counter!(TENANTS_RELOADS, "outcome" => outcome).increment(1);
}

pub fn fleet_split(n: usize) {
    gauge!(FLEET_SPLIT).set(n as f64);
}

pub fn tokenizer_queue(n: usize) {
    gauge!(TOKENIZER_QUEUE).set(n as f64);
}

pub fn http_connections(n: usize) {
    gauge!(HTTP_CONNECTIONS).set(n as f64);
}

pub fn retry(outcome: &'static str) {
    counter!(RETRIES, "outcome" => outcome).increment(1);
}

pub fn grpc_connection_accepted() {
    counter!(GRPC_CONNECTIONS).increment(1);
}

pub fn http_timeout(phase: &'static str) {
    counter!(HTTP_TIMEOUTS, "phase" => phase).increment(1);
}

fn zero() {
    let labelled: [(&'static str, &'static str, &[&'static str]); 8] = [
        (SHED, "reason", &SHED_REASONS),
        (ROUTE_REFUSED, "reason", &ROUTE_REFUSED_REASONS),
        (DECODE_REROUTES, "reason", &REROUTE_REASONS),
        (MEMBERSHIP_CHANGES, "change", &MEMBERSHIP_CHANGE_KINDS),
        (ROUTE_DECISIONS, "prefill", &ROUTE_PREFILL_KINDS),
        (ROUTE_PAIRS_SKIPPED, "reason", &["layout_fingerprint", "zone"]),
        (ROUTE_LISTINGS, "listed", &["sampled", "all"]),
        (PREFIX_WATCH_RESTARTS, "reason", &PREFIX_WATCH_RESTART_REASONS),
    ];
    for (name, label, values) in labelled {
        for v in values {
            counter!(name, label => *v).increment(0);
        }
    }
    for (api, layer) in SEND_TIMEOUT_LABELS {
        counter!(STREAM_SEND_TIMEOUTS, "api" => api, "layer" => layer).increment(0);
    }
    counter!(PREFILL_UNAVAILABLE).increment(0);
    counter!(CROSS_ZONE_ROUTES).increment(0);
    counter!(REGISTRY_RESYNCS).increment(0);
    for outcome in TENANTS_RELOAD_OUTCOMES {
        counter!(TENANTS_RELOADS, "outcome" => outcome).increment(0);
    }
    counter!(HTTP_TIMEOUTS, "phase" => "body").increment(0);
    for reason in MIGRATION_REASONS {
        for outcome in MIGRATION_OUTCOMES {
            counter!(MIGRATIONS, "reason" => reason, "outcome" => outcome).increment(0);
        }
    }
    counter!(MIGRATION_RECOMPUTED_TOKENS).increment(0);
    for api in ["http", "grpc"] {
        for outcome in STREAM_RESUME_OUTCOMES {
            counter!(STREAM_RESUMES, "api" => api, "outcome" => outcome).increment(0);
        }
        counter!(STREAM_HANDOFFS, "api" => api).increment(0);
    }
}

/// Counts one request migration by `reason` and `outcome` ([`MIGRATIONS`]).
pub fn migration(reason: &'static str, outcome: &'static str) {
    debug_assert!(MIGRATION_REASONS.contains(&reason) && MIGRATION_OUTCOMES.contains(&outcome));
    counter!(MIGRATIONS, "reason" => reason, "outcome" => outcome).increment(1);
}

/// Counts tokens a migration sent to be prefilled again.
pub fn migration_recomputed_tokens(n: u64) {
    counter!(MIGRATION_RECOMPUTED_TOKENS).increment(n);
}

pub fn decode_reroute(reason: &'static str) {
    debug_assert!(REROUTE_REASONS.contains(&reason), "unlisted reason {reason}");
    counter!(DECODE_REROUTES, "reason" => reason).increment(1);
}

pub fn breaker_state(prefill: &str, decode: &str, state: crate::breaker::State) {
    if pair_labelled(prefill, decode) {
        gauge!(BREAKER_STATE, "prefill" => prefill.to_owned(), "decode" => decode.to_owned()).set(state.level());
    }
}

pub fn breaker_transition(prefill: &str, decode: &str, from: crate::breaker::State, to: crate::breaker::State) {
    counter!(
        BREAKER_TRANSITIONS,
        "prefill" => prefill.to_owned(),
        "decode" => decode_label(prefill, decode),
        "from" => from.as_str(),
        "to" => to.as_str()
    )
    .increment(1);
}

pub fn prefill_attempt(worker: &str, decode: &str, outcome: &str) {
    counter!(
        PREFILL_ATTEMPTS,
        "worker" => worker.to_owned(),
        "decode" => decode_label(worker, decode),
        "outcome" => bounded_reason(outcome)
    )
    .increment(1);
}

/// A failure reason a worker reported, as a label: short snake_case words
/// pass, anything else is `other` (a peer's text must not mint series).
fn bounded_reason(reason: &str) -> String {
    let ok = !reason.is_empty() && reason.len() <= 32 && reason.bytes().all(|b| b.is_ascii_lowercase() || b == b'_');
    if ok {
        reason.to_owned()
    } else {
        "other".to_owned()
    }
}

pub fn route_pairs_skipped(reason: &'static str, n: usize) {
    if n > 0 {
        counter!(ROUTE_PAIRS_SKIPPED, "reason" => reason).increment(n as u64);
    }
}

pub fn prefill_unavailable() {
    counter!(PREFILL_UNAVAILABLE).increment(1);
}

pub fn stream_send_timeout(api: &'static str, layer: &'static str) {
    debug_assert!(SEND_TIMEOUT_LABELS.contains(&(api, layer)), "unlisted labels {api} {layer}");
    counter!(STREAM_SEND_TIMEOUTS, "api" => api, "layer" => layer).increment(1);
}

pub fn cross_zone_route() {
    counter!(CROSS_ZONE_ROUTES).increment(1);
}

/// A decision listed a sample of the fleet (`sampled`) or every worker (`all`).
pub fn route_listed(listed: &'static str) {
    counter!(ROUTE_LISTINGS, "listed" => listed).increment(1);
}

pub fn route_decided(kind: Prefill) {
    let prefill = match kind {
        Prefill::Remote => "remote",
        Prefill::Local => "local",
    };
    counter!(ROUTE_DECISIONS, "prefill" => prefill).increment(1);
}

/// Workers with a fresh load reading, by role (`prefill`, `decode`).
pub fn workers_load_known(role: &'static str, n: usize) {
    gauge!(WORKERS_LOAD_KNOWN, "role" => role).set(n as f64);
}

/// Stale workers by role (`prefill`, `decode`).
pub fn workers_stale(role: &'static str, n: usize) {
    gauge!(WORKERS_STALE, "role" => role).set(n as f64);
}

pub fn route_refused(reason: &'static str) {
    debug_assert!(ROUTE_REFUSED_REASONS.contains(&reason), "unlisted reason {reason}");
    counter!(ROUTE_REFUSED, "reason" => reason).increment(1);
}

pub fn request_finished(api: &'static str, status: u16, code: &str) {
    counter!(REQUESTS, "api" => api, "status" => status.to_string(), "code" => code.to_owned()).increment(1);
}

pub fn shed(reason: &'static str) {
    counter!(SHED, "reason" => reason).increment(1);
}

pub fn queue(depth: usize, tokens: u64, running: usize) {
    gauge!(QUEUE_DEPTH).set(depth as f64);
    gauge!(QUEUE_TOKENS).set(tokens as f64);
    gauge!(RUNNING).set(running as f64);
}

/// One decision's wall time and, when the thread's CPU clock could be read, its CPU time.
pub fn route_decision(d: Duration, cpu: Option<Duration>) {
    histogram!(ROUTE_DECISION).record(d.as_secs_f64());
    if let Some(cpu) = cpu {
        histogram!(ROUTE_DECISION_CPU).record(cpu.as_secs_f64());
    }
}

pub fn queue_wait(d: Duration) {
    histogram!(QUEUE_WAIT).record(d.as_secs_f64());
}

pub fn ttft(d: Duration) {
    histogram!(TTFT).record(d.as_secs_f64());
}

pub fn tpot(d: Duration) {
    histogram!(TPOT).record(d.as_secs_f64());
}

pub fn e2e(d: Duration) {
    histogram!(E2E).record(d.as_secs_f64());
}

pub fn idempotent_replay(state: &'static str) {
    counter!(IDEMPOTENT_REPLAYS, "state" => state).increment(1);
}

/// A stream resumed from a cursor, by outcome (`ok`, `mismatch`, `failed`).
pub fn stream_resume(api: &'static str, outcome: &'static str) {
    counter!(STREAM_RESUMES, "api" => api, "outcome" => outcome).increment(1);
}

/// A running stream ended with `coordinator_draining` for a peer to resume.
pub fn stream_handoff(api: &'static str) {
    counter!(STREAM_HANDOFFS, "api" => api).increment(1);
}

/// Follows membership: worker gauges, change counts, resyncs and health.
/// Ends when the membership cache stops (`rx` from `Membership::subscribe`).
pub async fn follow_membership(mut rx: tokio::sync::watch::Receiver<registry::MembershipView>) {
    use std::collections::HashMap;
    let mut known: HashMap<(registry::Role, String), registry::WorkerInfo> = HashMap::new();
    let mut resyncs = 0u64;
    loop {
        let view = rx.borrow_and_update().clone();
        gauge!(REGISTRY_HEALTHY).set(if view.is_live() { 1.0 } else { 0.0 });
        if view.resyncs() > resyncs {
            counter!(REGISTRY_RESYNCS).increment(view.resyncs() - resyncs);
            resyncs = view.resyncs();
        }
        let now: HashMap<_, _> = view.workers().map(|w| ((w.role, w.id.clone()), w.clone())).collect();
        for (k, w) in &now {
            match known.get(k) {
                None => counter!(MEMBERSHIP_CHANGES, "change" => "joined").increment(1),
                Some(old) if old != w => counter!(MEMBERSHIP_CHANGES, "change" => "updated").increment(1),
                Some(_) => {}
            }
        }
        let left = known.keys().filter(|k| !now.contains_key(*k)).count();
        if left > 0 {
            counter!(MEMBERSHIP_CHANGES, "change" => "left").increment(left as u64);
        }
        for role in [registry::Role::Prefill, registry::Role::Decode] {
            for (state, draining) in [("serving", false), ("draining", true)] {
                let n = now.values().filter(|w| w.role == role && w.draining == draining).count();
                gauge!(WORKERS, "role" => role.as_str(), "state" => state).set(n as f64);
            }
        }
        known = now;
        if rx.changed().await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::breaker::State;

    /// Series of `name` in a rendered page (its sample lines).
    fn series(page: &str, name: &str) -> usize {
        page.lines().filter(|l| !l.starts_with('#') && l.split(['{', ' ']).next() == Some(name)).count()
    }

    #[test]
    fn a_thousand_workers_give_a_bounded_series_count() {
        let recorder = PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        let (p, d) = (500, 500);
        metrics::with_local_recorder(&recorder, || {
            for i in 0..p {
                for j in 0..d {
                    let (prefill, decode) = (format!("prefill-{i}"), format!("decode-{j}"));
                    prefill_attempt(&prefill, &decode, "ok");
                    breaker_transition(&prefill, &decode, State::Closed, State::Open);
                    breaker_state(&prefill, &decode, State::Open);
                }
            }
        });
        let page = handle.render();
        // 250,000 pairs: per pair that would be 750,000 series.
        let bound = PAIR_LABELS + p;
        for name in [PREFILL_ATTEMPTS, BREAKER_TRANSITIONS] {
            let n = series(&page, name);
            assert!(n > 0 && n <= bound, "{name}: {n} series, bound {bound}");
        }
        let n = series(&page, BREAKER_STATE);
        assert!(n > 0 && n <= PAIR_LABELS, "{BREAKER_STATE}: {n} series");
        let total = page.lines().filter(|l| !l.starts_with('#')).count();
        assert!(total <= 3 * bound, "{total} series in all");
        assert!(page.contains("decode=\"_other\""), "pairs past the budget are counted, not dropped");
    }
}
