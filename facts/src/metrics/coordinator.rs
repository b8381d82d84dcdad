use super::{Exporter, Kind, Metric};

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
/// `tandem_coordinator_route_decision_seconds`: how long one routing decision takes
/// in the coordinator (reading the membership cache, the load board, the prefix
/// reports and the breakers, and choosing): what the fleet's size costs each request.
/// vLLM: none.
pub const ROUTE_DECISION: &str = "tandem_coordinator_route_decision_seconds";
/// `tandem_coordinator_route_decision_cpu_seconds`: the same decision in CPU time of
/// the thread that made it: its own cost, without the time the thread waited for a
/// CPU or a lock (on a busy host the wall time above includes being preempted).
/// vLLM: none.
pub const ROUTE_DECISION_CPU: &str = "tandem_coordinator_route_decision_cpu_seconds";
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
/// `tandem_coordinator_stream_resumes_total{api,outcome}`: streams resumed
/// from a cursor (`Last-Event-ID`, gRPC `resume_cursor`): `ok` (the cursor
/// was regenerated and checked; the rest is sent), `mismatch` (another answer:
/// `resume_mismatch`), `failed` (the regeneration failed before the cursor).
/// vLLM: none.
pub const STREAM_RESUMES: &str = "tandem_coordinator_stream_resumes_total";
/// Every `outcome` of [`STREAM_RESUMES`].
pub const STREAM_RESUME_OUTCOMES: [&str; 3] = ["ok", "mismatch", "failed"];
/// `tandem_coordinator_stream_handoffs_total{api}`: running streams a draining
/// coordinator ended with the resumable `coordinator_draining` error because a
/// peer coordinator was live. vLLM: none.
pub const STREAM_HANDOFFS: &str = "tandem_coordinator_stream_handoffs_total";
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
/// fingerprints differ; the transfer handshake would refuse it), or may not:
/// `zone` (another zone, under `--zone-pairing=require`). Counted per routed
/// request and skipped worker. vLLM: none.
pub const ROUTE_PAIRS_SKIPPED: &str = "tandem_coordinator_route_pairs_skipped_total";
/// `tandem_coordinator_route_listings_total{listed}`: routing decisions by the
/// workers they listed: `sampled` (a fleet of more than 64 decode workers: the
/// prompt's prefix holders and a random sample, decided there), `all` (a smaller
/// fleet, or a sample that left the decision short: an error or fewer prefill
/// workers than a dispatch may try). vLLM: none.
pub const ROUTE_LISTINGS: &str = "tandem_coordinator_route_listings_total";
/// `tandem_coordinator_cross_zone_routes_total`: remote-prefill routes whose
/// first prefill worker registered another zone than the decode worker (its KV
/// crosses zones). What `--zone-pairing=prefer` would save; never counted under
/// `require`. vLLM: none.
pub const CROSS_ZONE_ROUTES: &str = "tandem_coordinator_cross_zone_routes_total";
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
/// `tandem_coordinator_migrations_total{reason,outcome}`: running requests moved
/// to another decode worker mid-stream (request migration), by why — `worker_lost`
/// (the stream broke: the process died or its link failed), `refused` (fenced, or
/// drained past its grace), `stalled` (no token and stale load reports: a frozen
/// worker), `gap` (tokens missing) — and how the move ended: `ok` (it
/// continues there), `failed` (no decode worker of its group and determinism
/// fingerprint could take it), `limit` (`--migration-limit` reached), `deadline`.
/// The client sees an error only for the last three. vLLM: none (Dynamo:
/// `migration` counters of its frontend).
pub const MIGRATIONS: &str = "tandem_coordinator_migrations_total";
/// Every `reason` of [`MIGRATIONS`].
pub const MIGRATION_REASONS: [&str; 4] = ["worker_lost", "refused", "stalled", "gap"];
/// Every `outcome` of [`MIGRATIONS`].
pub const MIGRATION_OUTCOMES: [&str; 4] = ["ok", "failed", "limit", "deadline"];
/// `tandem_coordinator_migration_recomputed_tokens_total`: prompt and already
/// generated tokens migrations sent to be prefilled again (less what the new
/// worker's prefix cache held): the price of moving. vLLM: none.
pub const MIGRATION_RECOMPUTED_TOKENS: &str = "tandem_coordinator_migration_recomputed_tokens_total";
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
/// `tandem_coordinator_prefix_watch_restarts_total{reason}`: a worker's
/// `WatchPrefixes` stream reopened after it `ended`, `failed`, could not be
/// opened (`refused`) or skipped an update (`gap`, which should never
/// happen); each drops that worker's prefix set until the new stream's
/// snapshot. A worker restarting shows as one `failed`. vLLM: none.
pub const PREFIX_WATCH_RESTARTS: &str = "tandem_coordinator_prefix_watch_restarts_total";
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
/// `tandem_coordinator_retries_total{outcome}`: requests the retry gate knew as
/// retries of a request refused with a Retry-After: `admitted` (on time, within
/// the caller's retry budget), `too_soon` (429 `retry_too_soon`),
/// `budget_exhausted` (429 `retry_budget_exhausted`), and refusals the full
/// table could not remember (`unremembered`).
pub const RETRIES: &str = "tandem_coordinator_retries_total";
/// `tandem_coordinator_grpc_connections_total`: gRPC connections accepted. With
/// `--grpc-max-connection-age-ms` it rises as long-lived channels are sent GOAWAY
/// and reconnect (possibly to another coordinator).
pub const GRPC_CONNECTIONS: &str = "tandem_coordinator_grpc_connections_total";
/// `tandem_coordinator_http_timeouts_total{phase}`: HTTP requests whose
/// `body` did not arrive within `--http-body-timeout-ms` (answered 408 and
/// closed). A head that is too slow is closed by the HTTP server itself.
pub const HTTP_TIMEOUTS: &str = "tandem_coordinator_http_timeouts_total";
/// `tandem_coordinator_metric_pairs_unlabelled`: (prefill, decode) pairs
/// beyond the first the coordinator's `PAIR_LABELS` seen: their breaker states are not
/// exported per pair, and their transitions and prefill attempts are
/// counted under `decode="_other"`, so a P×D fleet cannot grow the series
/// count past `PAIR_LABELS` + P. vLLM: none.
pub const PAIRS_UNLABELLED: &str = "tandem_coordinator_metric_pairs_unlabelled";
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
pub const PREFIX_WATCH_RESTART_REASONS: [&str; 4] = ["ended", "failed", "refused", "gap"];
/// `(api, layer)` of [`STREAM_SEND_TIMEOUTS`].
pub const SEND_TIMEOUT_LABELS: [(&str, &str); 3] = [("http", "event"), ("http", "connection"), ("grpc", "event")];
/// `outcome` of [`TENANTS_RELOADS`].
pub const TENANTS_RELOAD_OUTCOMES: [&str; 2] = ["applied", "refused"];

/// Every metric of this module: its kind, its label names and who exports it.
pub const CATALOG: &[Metric] = &[
    Metric { name: REQUESTS, kind: Kind::Counter, labels: &["api", "status", "code"], exporter: Exporter::Coordinator },
    Metric { name: SHED, kind: Kind::Counter, labels: &["reason"], exporter: Exporter::Coordinator },
    Metric { name: QUEUE_DEPTH, kind: Kind::Gauge, labels: &[], exporter: Exporter::Coordinator },
    Metric { name: QUEUE_TOKENS, kind: Kind::Gauge, labels: &[], exporter: Exporter::Coordinator },
    Metric { name: RUNNING, kind: Kind::Gauge, labels: &[], exporter: Exporter::Coordinator },
    Metric { name: QUEUE_WAIT, kind: Kind::Histogram, labels: &[], exporter: Exporter::Coordinator },
    Metric { name: ROUTE_DECISIONS, kind: Kind::Counter, labels: &["prefill"], exporter: Exporter::Coordinator },
    Metric { name: ROUTE_DECISION, kind: Kind::Histogram, labels: &[], exporter: Exporter::Coordinator },
    Metric { name: ROUTE_DECISION_CPU, kind: Kind::Histogram, labels: &[], exporter: Exporter::Coordinator },
    Metric { name: ROUTE_REFUSED, kind: Kind::Counter, labels: &["reason"], exporter: Exporter::Coordinator },
    Metric { name: WORKERS, kind: Kind::Gauge, labels: &["role", "state"], exporter: Exporter::Coordinator },
    Metric { name: WORKERS_STALE, kind: Kind::Gauge, labels: &["role"], exporter: Exporter::Coordinator },
    Metric { name: WORKERS_LOAD_KNOWN, kind: Kind::Gauge, labels: &["role"], exporter: Exporter::Coordinator },
    Metric { name: MEMBERSHIP_CHANGES, kind: Kind::Counter, labels: &["change"], exporter: Exporter::Coordinator },
    Metric { name: REGISTRY_RESYNCS, kind: Kind::Counter, labels: &[], exporter: Exporter::Coordinator },
    Metric { name: REGISTRY_HEALTHY, kind: Kind::Gauge, labels: &[], exporter: Exporter::Coordinator },
    Metric { name: TTFT, kind: Kind::Histogram, labels: &[], exporter: Exporter::Coordinator },
    Metric { name: TPOT, kind: Kind::Histogram, labels: &[], exporter: Exporter::Coordinator },
    Metric { name: E2E, kind: Kind::Histogram, labels: &[], exporter: Exporter::Coordinator },
    Metric { name: IDEMPOTENT_REPLAYS, kind: Kind::Counter, labels: &["state"], exporter: Exporter::Coordinator },
    Metric { name: STREAM_RESUMES, kind: Kind::Counter, labels: &["api", "outcome"], exporter: Exporter::Coordinator },
    Metric { name: STREAM_HANDOFFS, kind: Kind::Counter, labels: &["api"], exporter: Exporter::Coordinator },
    Metric { name: BREAKER_STATE, kind: Kind::Gauge, labels: &["prefill", "decode"], exporter: Exporter::Coordinator },
    Metric {
        name: BREAKER_TRANSITIONS,
        kind: Kind::Counter,
        labels: &["prefill", "decode", "from", "to"],
        exporter: Exporter::Coordinator,
    },
    Metric {
        name: PREFILL_ATTEMPTS,
        kind: Kind::Counter,
        labels: &["worker", "decode", "outcome"],
        exporter: Exporter::Coordinator,
    },
    Metric { name: ROUTE_PAIRS_SKIPPED, kind: Kind::Counter, labels: &["reason"], exporter: Exporter::Coordinator },
    Metric { name: ROUTE_LISTINGS, kind: Kind::Counter, labels: &["listed"], exporter: Exporter::Coordinator },
    Metric { name: CROSS_ZONE_ROUTES, kind: Kind::Counter, labels: &[], exporter: Exporter::Coordinator },
    Metric { name: PREFILL_UNAVAILABLE, kind: Kind::Counter, labels: &[], exporter: Exporter::Coordinator },
    Metric {
        name: STREAM_SEND_TIMEOUTS,
        kind: Kind::Counter,
        labels: &["api", "layer"],
        exporter: Exporter::Coordinator,
    },
    Metric { name: DECODE_REROUTES, kind: Kind::Counter, labels: &["reason"], exporter: Exporter::Coordinator },
    Metric { name: MIGRATIONS, kind: Kind::Counter, labels: &["reason", "outcome"], exporter: Exporter::Coordinator },
    Metric { name: MIGRATION_RECOMPUTED_TOKENS, kind: Kind::Counter, labels: &[], exporter: Exporter::Coordinator },
    Metric {
        name: TENANT_REQUESTS,
        kind: Kind::Counter,
        labels: &["tenant", "outcome"],
        exporter: Exporter::Coordinator,
    },
    Metric { name: TENANT_TOKENS, kind: Kind::Counter, labels: &["tenant", "kind"], exporter: Exporter::Coordinator },
    Metric { name: TENANT_KV_TOKENS, kind: Kind::Gauge, labels: &["tenant"], exporter: Exporter::Coordinator },
    Metric { name: PREFIX_CACHED_TOKENS, kind: Kind::Counter, labels: &["scope"], exporter: Exporter::Coordinator },
    Metric { name: PREFIX_HIT_TOKENS, kind: Kind::Counter, labels: &["scope"], exporter: Exporter::Coordinator },
    Metric { name: WORKER_PREFIX_BLOCKS, kind: Kind::Gauge, labels: &["worker"], exporter: Exporter::Coordinator },
    Metric { name: PREFIX_WATCH_RESTARTS, kind: Kind::Counter, labels: &["reason"], exporter: Exporter::Coordinator },
    Metric { name: ADMISSION_CAPACITY, kind: Kind::Gauge, labels: &[], exporter: Exporter::Coordinator },
    Metric { name: TENANTS, kind: Kind::Gauge, labels: &[], exporter: Exporter::Coordinator },
    Metric { name: TENANTS_RELOADS, kind: Kind::Counter, labels: &["outcome"], exporter: Exporter::Coordinator },
    Metric { name: FLEET_SPLIT, kind: Kind::Gauge, labels: &[], exporter: Exporter::Coordinator },
    Metric { name: TOKENIZER_QUEUE, kind: Kind::Gauge, labels: &[], exporter: Exporter::Coordinator },
    Metric { name: HTTP_CONNECTIONS, kind: Kind::Gauge, labels: &[], exporter: Exporter::Coordinator },
    Metric { name: GRPC_CONNECTIONS, kind: Kind::Counter, labels: &[], exporter: Exporter::Coordinator },
    Metric { name: RETRIES, kind: Kind::Counter, labels: &["outcome"], exporter: Exporter::Coordinator },
    Metric { name: HTTP_TIMEOUTS, kind: Kind::Counter, labels: &["phase"], exporter: Exporter::Coordinator },
    Metric { name: PAIRS_UNLABELLED, kind: Kind::Gauge, labels: &[], exporter: Exporter::Coordinator },
];
