//! The coordinator's Prometheus metrics, served on `GET /metrics` of the
//! HTTP port (no API key needed, like `/health` and `/ready`).
//!
//! Names are prefixed `tandem_coordinator_` so they never collide with the
//! workers' `tandem_` series in one Prometheus. Every histogram has explicit
//! buckets (the exporter would otherwise render a summary). The vLLM
//! counterpart is named where one exists.

use std::time::Duration;

use metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram};
use metrics_exporter_prometheus::{BuildError, Matcher, PrometheusBuilder, PrometheusHandle};

use crate::router::Prefill;

/// `tandem_coordinator_requests_total{api,status,code}`: finished requests
/// by API (`chat`, `completions`, `grpc`), HTTP status and error code (`ok`
/// when it succeeded). vLLM: `vllm:request_success_total{finished_reason}`.
pub const REQUESTS: &str = "tandem_coordinator_requests_total";
/// `tandem_coordinator_admission_shed_total{reason}`: requests refused by
/// admission: `key_limit` (429), `queue_full` (503), `queue_deadline` (504,
/// dropped before prefill), `closed` (shutting down). vLLM: none.
pub const SHED: &str = "tandem_coordinator_admission_shed_total";
/// `tandem_coordinator_queue_depth`: requests waiting in the central queue.
/// vLLM: `vllm:num_requests_waiting` (per engine).
pub const QUEUE_DEPTH: &str = "tandem_coordinator_queue_depth";
/// `tandem_coordinator_queue_tokens`: token cost waiting in the central queue.
pub const QUEUE_TOKENS: &str = "tandem_coordinator_queue_tokens";
/// `tandem_coordinator_running`: requests admitted and dispatched to workers.
pub const RUNNING: &str = "tandem_coordinator_running";
/// `tandem_coordinator_queue_wait_seconds`: time from arrival to dispatch.
/// vLLM: `vllm:request_queue_time_seconds`.
pub const QUEUE_WAIT: &str = "tandem_coordinator_queue_wait_seconds";
/// `tandem_coordinator_route_decisions_total{prefill}`: routed requests by
/// `remote` or `local` prefill. vLLM: none.
pub const ROUTE_DECISIONS: &str = "tandem_coordinator_route_decisions_total";
/// `tandem_coordinator_route_refused_total{reason}`: no route (`no_decode`,
/// `none_ready`, `registry_unavailable`).
pub const ROUTE_REFUSED: &str = "tandem_coordinator_route_refused_total";
/// `tandem_coordinator_workers{role,state}`: registered workers, by role and
/// `serving`/`draining`.
pub const WORKERS: &str = "tandem_coordinator_workers";
/// `tandem_coordinator_workers_stale{role}`: known workers (`prefill` or
/// `decode`) that have not answered a load poll for 4 poll intervals
/// (`--load-poll-ms`): they get no requests until they answer again. Read
/// at scrape time. vLLM: none.
pub const WORKERS_STALE: &str = "tandem_coordinator_workers_stale";
/// `tandem_coordinator_workers_load_known{role}`: known workers whose load the last polls
/// answered (fresh and reachable), so routing scores them on real figures. Equal to the
/// serving count once the coordinator has heard from every worker; tests wait on it instead
/// of sleeping through poll intervals. Read at scrape time. vLLM: none.
pub const WORKERS_LOAD_KNOWN: &str = "tandem_coordinator_workers_load_known";
/// `tandem_coordinator_membership_changes_total{change}`: workers `joined`,
/// `left` or `updated` (e.g. started draining) as seen from etcd.
pub const MEMBERSHIP_CHANGES: &str = "tandem_coordinator_membership_changes_total";
/// `tandem_coordinator_registry_resyncs_total`: full re-lists of membership
/// after a lost etcd watch (session loss, compaction, silence).
pub const REGISTRY_RESYNCS: &str = "tandem_coordinator_registry_resyncs_total";
/// `tandem_coordinator_registry_healthy`: 1 while the etcd watch is live.
pub const REGISTRY_HEALTHY: &str = "tandem_coordinator_registry_healthy";
/// `tandem_coordinator_time_to_first_token_seconds`: arrival to first token
/// at the frontend (queueing included). vLLM: `vllm:time_to_first_token_seconds`.
pub const TTFT: &str = "tandem_coordinator_time_to_first_token_seconds";
/// `tandem_coordinator_time_per_output_token_seconds`: gap between tokens.
/// vLLM: `vllm:inter_token_latency_seconds`.
pub const TPOT: &str = "tandem_coordinator_time_per_output_token_seconds";
/// `tandem_coordinator_e2e_request_latency_seconds`: arrival to the end.
/// vLLM: `vllm:e2e_request_latency_seconds`.
pub const E2E: &str = "tandem_coordinator_e2e_request_latency_seconds";
/// `tandem_coordinator_idempotent_replays_total{state}`: requests answered
/// from an earlier one with the same `Idempotency-Key` (`inflight` or `done`).
pub const IDEMPOTENT_REPLAYS: &str = "tandem_coordinator_idempotent_replays_total";
/// `tandem_coordinator_prefill_breaker_state{prefill,decode}`: the circuit
/// breaker of each (prefill worker, decode worker) pair, by registry id: 0
/// closed, 1 half-open (a probe may go), 2 open. A pair whose worker left
/// the membership is dropped and its series set back to 0. vLLM: none.
pub const BREAKER_STATE: &str = "tandem_coordinator_prefill_breaker_state";
/// `tandem_coordinator_prefill_breaker_transitions_total{prefill,decode,from,to}`:
/// breaker state changes of each pair (`closed`, `open`, `half_open`).
pub const BREAKER_TRANSITIONS: &str = "tandem_coordinator_prefill_breaker_transitions_total";
/// `tandem_coordinator_prefill_attempts_total{worker,decode,outcome}`: remote
/// prefill attempts on prefill worker `worker` that decode worker `decode`
/// reported (`ok`, or their failure reason).
pub const PREFILL_ATTEMPTS: &str = "tandem_coordinator_prefill_attempts_total";
/// `tandem_coordinator_route_pairs_skipped_total{reason}`: prefill workers of
/// the chosen decode worker's version group left out of a route because the
/// pair cannot work: `layout_fingerprint` (their registered KV layout
/// fingerprints differ; the transfer handshake would refuse it). Counted per
/// routed request and skipped worker. vLLM: none.
pub const ROUTE_PAIRS_SKIPPED: &str = "tandem_coordinator_route_pairs_skipped_total";
/// `tandem_coordinator_prefill_unavailable_total`: requests answered 503
/// `prefill_unavailable` at once because every prefill worker of the group
/// had an open breaker.
pub const PREFILL_UNAVAILABLE: &str = "tandem_coordinator_prefill_unavailable_total";
/// `tandem_coordinator_stream_send_timeouts_total{api,layer}`: streamed
/// answers ended because the client did not take what was sent for
/// `--stream-idle-timeout-ms`: `layer="event"` when the next event could not
/// be handed over, `layer="connection"` when the socket accepted no byte
/// (the connection is closed). vLLM: none.
pub const STREAM_SEND_TIMEOUTS: &str = "tandem_coordinator_stream_send_timeouts_total";
/// `tandem_coordinator_decode_reroutes_total{reason}`: requests sent to
/// another decode worker before anything reached the client: `unreachable`
/// (the `Generate` call failed in the transport), `stream_broken` (the
/// stream broke before its first message), `refused` (the worker was fenced
/// or draining). vLLM: none.
pub const DECODE_REROUTES: &str = "tandem_coordinator_decode_reroutes_total";

/// `tandem_coordinator_tenant_requests_total{tenant,outcome}`: requests by
/// tenant (its name in the tenants file, or `default`) that passed every
/// tenant check (`admitted`) or were refused by one, by error code
/// (`rate_limit_requests`, `too_many_streams`, `max_tokens_too_large`, ...).
/// Bounded by the tenants file. vLLM: none.
pub const TENANT_REQUESTS: &str = "tandem_coordinator_tenant_requests_total";
/// `tandem_coordinator_tenant_tokens_total{tenant,kind}`: prompt tokens
/// admitted and output tokens generated (`kind`: `prompt`, `output`), by
/// tenant. vLLM: `vllm:prompt_tokens_total`, `vllm:generation_tokens_total`.
pub const TENANT_TOKENS: &str = "tandem_coordinator_tenant_tokens_total";
/// `tandem_coordinator_tenant_kv_tokens{tenant}`: KV tokens this
/// coordinator holds against the tenant's `max_kv_share` (prompt plus
/// `max_tokens` of its requests admitted and not ended, in whole blocks);
/// tenants whose share is 1 are not counted. vLLM: none.
pub const TENANT_KV_TOKENS: &str = "tandem_coordinator_tenant_kv_tokens";
/// `tandem_coordinator_prefix_cached_tokens_total{scope}`: prompt tokens of
/// routed requests that the worker chosen to prefill them (the first
/// prefill worker, or the decode worker for local prefill) reported holding
/// in its prefix cache under the request's scope (`tenant:NAME` or
/// `shared:POOL`), as prefix-aware routing saw it: the hits routing
/// expects. The workers' `tandem_prefix_cache_hit_tokens_total` counts the
/// hits they make (all scopes together). vLLM: none.
pub const PREFIX_CACHED_TOKENS: &str = "tandem_coordinator_prefix_cached_tokens_total";
/// `tandem_coordinator_prefix_hit_tokens_total{scope}`: prompt tokens the
/// workers reported taking from their prefix caches for this coordinator's
/// requests (each answer's `usage.prompt_tokens_details.cached_tokens`), by
/// the request's cache scope: the hits made, where
/// `tandem_coordinator_prefix_cached_tokens_total` is the hits routing
/// expected. vLLM: `vllm:prefix_cache_hits_total` (not by tenant).
pub const PREFIX_HIT_TOKENS: &str = "tandem_coordinator_prefix_hit_tokens_total";
/// `tandem_coordinator_worker_prefix_blocks{worker}`: prefix blocks the
/// worker (gRPC address) last reported cached, as this coordinator routes
/// by them; a worker that never reports stays absent. Per worker, so as
/// many series as workers. vLLM: none.
pub const WORKER_PREFIX_BLOCKS: &str = "tandem_coordinator_worker_prefix_blocks";
/// `tandem_coordinator_admission_capacity`: requests this coordinator may
/// have dispatched at once (`--max-running`, or its share of the decode
/// workers' seats when that is 0: the cluster's capacity split between the
/// live coordinators). vLLM: none.
pub const ADMISSION_CAPACITY: &str = "tandem_coordinator_admission_capacity";
/// `tandem_coordinator_tenants`: tenants configured (1 without a tenants file).
pub const TENANTS: &str = "tandem_coordinator_tenants";
/// `tandem_coordinator_tenants_reloads_total{outcome}`: tenants file reloads
/// (SIGHUP or a change on disk), `applied` or `refused` (the file did not
/// validate; the previous one stays in force and the log says why).
pub const TENANTS_RELOADS: &str = "tandem_coordinator_tenants_reloads_total";
/// `tandem_coordinator_fleet_split`: how many coordinators every tenant
/// budget is split between here (live ones in etcd, or the fallback while
/// etcd cannot tell). vLLM: none.
pub const FLEET_SPLIT: &str = "tandem_coordinator_fleet_split";
/// `tandem_coordinator_tokenizer_queue`: requests waiting for or in the
/// tokenizer pool. vLLM: none.
pub const TOKENIZER_QUEUE: &str = "tandem_coordinator_tokenizer_queue";
/// `tandem_coordinator_http_connections`: open HTTP connections (bounded
/// by `--http-max-connections`).
pub const HTTP_CONNECTIONS: &str = "tandem_coordinator_http_connections";
/// `tandem_coordinator_http_timeouts_total{phase}`: HTTP requests whose
/// `body` did not arrive within `--http-body-timeout-ms` (answered 408 and
/// closed). A head that is too slow is closed by the HTTP server itself.
pub const HTTP_TIMEOUTS: &str = "tandem_coordinator_http_timeouts_total";
/// `tandem_coordinator_metric_pairs_unlabelled`: (prefill, decode) pairs
/// beyond the first [`PAIR_LABELS`] seen: their breaker states are not
/// exported per pair, and their transitions and prefill attempts are
/// counted under `decode="_other"`, so a P×D fleet cannot grow the series
/// count past `PAIR_LABELS` + P. vLLM: none.
pub const PAIRS_UNLABELLED: &str = "tandem_coordinator_metric_pairs_unlabelled";

/// `tandem_process_start_time_seconds`: when this process started, Unix
/// seconds; changes with every restart (the restart alert counts them).
/// vLLM: none.
pub const PROCESS_START: &str = "tandem_process_start_time_seconds";

const LATENCY_BUCKETS: &[f64] = &[0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0];
const TOKEN_BUCKETS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5];

/// Installs the global recorder; render the returned handle on `/metrics`.
pub fn install() -> Result<PrometheusHandle, BuildError> {
    let handle = PrometheusBuilder::new()
        .set_buckets(LATENCY_BUCKETS)?
        .set_buckets_for_metric(Matcher::Full(TPOT.into()), TOKEN_BUCKETS)?
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
    describe_gauge!(BREAKER_STATE, "Prefill/decode pair circuit breaker: 0 closed, 1 half-open, 2 open");
    describe_counter!(BREAKER_TRANSITIONS, "Prefill/decode pair circuit breaker state changes");
    describe_counter!(PREFILL_ATTEMPTS, "Remote prefill attempts reported by decode workers, by outcome");
    describe_counter!(ROUTE_PAIRS_SKIPPED, "Prefill workers left out of a route because the pair cannot work");
    describe_counter!(PREFILL_UNAVAILABLE, "Requests refused at once: every prefill worker of the group open");
    describe_counter!(STREAM_SEND_TIMEOUTS, "Streams ended because the client stopped reading");
    describe_counter!(DECODE_REROUTES, "Requests routed to another decode worker before their first token");
    describe_counter!(TENANT_REQUESTS, "Requests by tenant: admitted, or refused by a tenant check (by code)");
    describe_counter!(TENANT_TOKENS, "Prompt tokens admitted and output tokens generated, by tenant");
    describe_gauge!(TENANT_KV_TOKENS, "KV tokens held against each tenant's max_kv_share");
    describe_gauge!(TENANTS, "Tenants configured");
    describe_gauge!(ADMISSION_CAPACITY, "Requests this coordinator may have dispatched at once");
    describe_gauge!(WORKER_PREFIX_BLOCKS, "Prefix blocks each worker last reported cached");
    describe_counter!(PREFIX_CACHED_TOKENS, "Prompt tokens routed to a worker that reported them cached, by scope");
    describe_counter!(PREFIX_HIT_TOKENS, "Prompt tokens the workers took from their prefix caches, by scope");
    describe_counter!(TENANTS_RELOADS, "Tenants file reloads, applied or refused");
    describe_gauge!(FLEET_SPLIT, "Coordinators every tenant budget is split between");
    describe_gauge!(TOKENIZER_QUEUE, "Requests waiting for or in the tokenizer pool");
    describe_gauge!(HTTP_CONNECTIONS, "Open HTTP connections");
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

pub fn http_timeout(phase: &'static str) {
    counter!(HTTP_TIMEOUTS, "phase" => phase).increment(1);
}

/// Label values of the counters with a fixed label set, each exported at 0
/// from the start: a labelled counter otherwise appears only at its first
/// increment, so a reader (a drill, an alert's `increase()`) could not tell
/// "none yet" from "no such series". The per-worker-pair series (breakers,
/// prefill attempts) and the requests counter (status x code) appear as
/// they happen.
pub const SHED_REASONS: [&str; 4] = ["key_limit", "queue_full", "queue_deadline", "closed"];
pub const ROUTE_REFUSED_REASONS: [&str; 4] = ["no_decode", "none_ready", "registry_unavailable", "prefill_unavailable"];
pub const REROUTE_REASONS: [&str; 3] = ["unreachable", "stream_broken", "refused"];
pub const MEMBERSHIP_CHANGE_KINDS: [&str; 3] = ["joined", "left", "updated"];
pub const ROUTE_PREFILL_KINDS: [&str; 2] = ["remote", "local"];
/// `(api, layer)` of [`STREAM_SEND_TIMEOUTS`].
pub const SEND_TIMEOUT_LABELS: [(&str, &str); 3] = [("http", "event"), ("http", "connection"), ("grpc", "event")];

fn zero() {
    let labelled: [(&'static str, &'static str, &[&'static str]); 6] = [
        (SHED, "reason", &SHED_REASONS),
        (ROUTE_REFUSED, "reason", &ROUTE_REFUSED_REASONS),
        (DECODE_REROUTES, "reason", &REROUTE_REASONS),
        (MEMBERSHIP_CHANGES, "change", &MEMBERSHIP_CHANGE_KINDS),
        (ROUTE_DECISIONS, "prefill", &ROUTE_PREFILL_KINDS),
        (ROUTE_PAIRS_SKIPPED, "reason", &["layout_fingerprint"]),
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
    counter!(REGISTRY_RESYNCS).increment(0);
    for outcome in TENANTS_RELOAD_OUTCOMES {
        counter!(TENANTS_RELOADS, "outcome" => outcome).increment(0);
    }
    counter!(HTTP_TIMEOUTS, "phase" => "body").increment(0);
}

/// `outcome` of [`TENANTS_RELOADS`].
pub const TENANTS_RELOAD_OUTCOMES: [&str; 2] = ["applied", "refused"];

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
