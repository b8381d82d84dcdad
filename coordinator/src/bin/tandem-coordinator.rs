//! `tandem-coordinator`: serves the OpenAI-compatible HTTP API and the gRPC
//! frontend (with health and reflection) in front of the workers registered
//! in etcd (or given by address), prints `listening http=ADDR grpc=ADDR` (one
//! line) once both are bound, and on SIGTERM/SIGINT drains: queued and new
//! requests get 503 `shutting_down` at once, in-flight ones finish (bounded
//! by `--shutdown-timeout-ms`), then both servers stop and it exits 0.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use coordinator::admission::AdmissionConfig;
use coordinator::auth::ApiKeys;
use coordinator::breaker::BreakerConfig;
use coordinator::cluster::{Cluster, RouteSettings, Source};
use coordinator::grpc;
use coordinator::http::{metrics_router, router, App, HttpSettings, ServeSettings};
use coordinator::pipeline::{MigrationSettings, Pipeline, Settings};
use coordinator::prompt::pool::Pool;
use coordinator::retries::RetrySettings;
use coordinator::router::ZonePairing;
use coordinator::tenants::{Split, Tenancy, Tenant};
use engine::tokenizer::Tokenizer;
use engine::weights::Weights;
use facts::log::LogFormat;
use tokio_util::sync::CancellationToken;

/// The version `--version` prints, naming the drill hook when the binary has it.
#[cfg(feature = "fault-injection")]
const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (fault-injection)");
/// The version `--version` prints.
#[cfg(not(feature = "fault-injection"))]
const VERSION: &str = env!("CARGO_PKG_VERSION");

/// Flags (each also a `TANDEM_*` env var).
#[derive(Debug, Parser)]
#[command(
    name = "tandem-coordinator",
    about = "tandem coordinator: OpenAI-compatible HTTP and gRPC fronts",
    version = VERSION
)]
struct Flags {
    /// Drills only, a planted bug: the N-th streamed HTTP answer never ends (its
    /// tokens, then silence on an open connection), for a chaos run to catch. Env:
    /// TANDEM_FAULT_ENDLESS_STREAM. Default 0 (off). Only in a binary built with the
    /// `fault-injection` feature.
    #[cfg(feature = "fault-injection")]
    #[arg(long, env = "TANDEM_FAULT_ENDLESS_STREAM", default_value_t = 0)]
    fault_endless_stream: u64,
    /// Drills only, a planted bug: a request moved to another decode worker (its
    /// worker lost mid-stream) never sends the client the first token the new worker
    /// generates, so only a fault that moves a stream breaks an answer (`tandem chaos
    /// --plant-on-move --shrink`). Env: TANDEM_FAULT_MOVE_DROPS_TOKEN. Default off.
    /// Only in a binary built with the `fault-injection` feature.
    #[cfg(feature = "fault-injection")]
    #[arg(long, env = "TANDEM_FAULT_MOVE_DROPS_TOKEN")]
    fault_move_drops_token: bool,
    /// HTTP listen address. Env: TANDEM_HTTP.
    #[arg(long, env = "TANDEM_HTTP", default_value = "127.0.0.1:8000")]
    http: SocketAddr,
    /// Serve `GET /metrics` on this address instead of the client port (which
    /// then answers 404 for it), so that clients never see metrics or the tenant
    /// names in their labels; port 0 picks a free one, printed as
    /// `listening metrics=ADDR`. Env: TANDEM_METRICS_ADDR. Default: the client port.
    #[arg(long, env = "TANDEM_METRICS_ADDR")]
    metrics_addr: Option<SocketAddr>,
    /// gRPC listen address (`tandem.frontend.v1.Frontend`, health,
    /// reflection); port 0 picks a free one. Env: TANDEM_GRPC.
    #[arg(long, env = "TANDEM_GRPC", default_value = "127.0.0.1:50051")]
    grpc: SocketAddr,
    /// GGUF model file (its tokenizer and chat template are used here). Env: TANDEM_MODEL.
    #[arg(long, env = "TANDEM_MODEL")]
    model: Option<PathBuf>,
    /// The model id clients name. Env: TANDEM_MODEL_NAME.
    #[arg(long, env = "TANDEM_MODEL_NAME", default_value = "SmolLM2-135M-Instruct")]
    model_name: String,
    /// etcd endpoints (comma-separated): route to the workers registered
    /// there. Env: TANDEM_ETCD. Either this or `--decode`.
    #[arg(long, env = "TANDEM_ETCD", value_delimiter = ',')]
    etcd: Vec<String>,
    /// Cluster prefix of the etcd keys. Env: TANDEM_CLUSTER_PREFIX.
    #[arg(long, env = "TANDEM_CLUSTER_PREFIX", default_value = "tandem")]
    cluster_prefix: String,
    /// With etcd unreachable, keep routing from the cached membership (to
    /// workers that answer their health checks) and stay ready this long
    /// after etcd last confirmed it, ms; then 503 registry_unavailable and
    /// /ready 503. A minute outlasts elections, restarts and short partitions;
    /// docs/REGISTRY.md says why routing on it is safe. Env:
    /// TANDEM_REGISTRY_MAX_STALE_MS.
    #[arg(long, env = "TANDEM_REGISTRY_MAX_STALE_MS", default_value_t = 60_000)]
    registry_max_stale_ms: u64,
    /// Decode worker gRPC addresses (repeat or comma-separate), without etcd. Env: TANDEM_DECODE.
    #[arg(long, env = "TANDEM_DECODE", value_delimiter = ',')]
    decode: Vec<String>,
    /// Prefill worker gRPC addresses (repeat or comma-separate; none: decode
    /// workers prefill locally). Env: TANDEM_PREFILL.
    #[arg(long, env = "TANDEM_PREFILL", value_delimiter = ',')]
    prefill: Vec<String>,
    /// Prompts of at most this many tokens are prefilled by the decode
    /// worker itself, not sent to a prefill worker. Env: TANDEM_LOCAL_PREFILL_MAX_TOKENS.
    #[arg(long, env = "TANDEM_LOCAL_PREFILL_MAX_TOKENS", default_value_t = 32)]
    local_prefill_max_tokens: usize,
    /// Prefix-aware routing: what a worker holding a prompt's whole prefix
    /// in its cache (under the request's tenant scope) is worth in load, a
    /// part in proportion; decode workers' load in score units (a full batch
    /// queued is 1), prefill workers' in queued requests. 0 routes on load
    /// only. Env: TANDEM_PREFIX_AFFINITY.
    #[arg(long, env = "TANDEM_PREFIX_AFFINITY", default_value_t = 1.0)]
    prefix_affinity: f64,
    /// How often each worker's load (queue, KV headroom) is polled, ms. Env: TANDEM_LOAD_POLL_MS.
    #[arg(long, env = "TANDEM_LOAD_POLL_MS", default_value_t = 250)]
    load_poll_ms: u64,
    /// Largest request body in bytes (413 beyond), and largest gRPC request
    /// message (OUT_OF_RANGE beyond). Env: TANDEM_MAX_BODY_BYTES.
    #[arg(long, env = "TANDEM_MAX_BODY_BYTES", default_value_t = 1 << 20)]
    max_body_bytes: usize,
    /// Requests dispatched to workers at once; 0 follows the cluster's
    /// capacity (the sum of the decode workers' max_running). Env: TANDEM_MAX_RUNNING.
    #[arg(long, env = "TANDEM_MAX_RUNNING", default_value_t = 0)]
    max_running: usize,
    /// Requests waiting in the central queue (503 + Retry-After beyond). Env: TANDEM_MAX_QUEUED.
    #[arg(long, env = "TANDEM_MAX_QUEUED", default_value_t = 64)]
    max_queued: usize,
    /// Token cost (prompt + max_tokens) waiting in the queue (503 beyond). Env: TANDEM_MAX_QUEUED_TOKENS.
    #[arg(long, env = "TANDEM_MAX_QUEUED_TOKENS", default_value_t = 131_072)]
    max_queued_tokens: u64,
    /// Requests one API key may have queued (429 + Retry-After beyond). Env: TANDEM_PER_KEY_MAX_QUEUED.
    #[arg(long, env = "TANDEM_PER_KEY_MAX_QUEUED", default_value_t = 16)]
    per_key_max_queued: usize,
    /// Token cost one API key may have queued (429 beyond). Env: TANDEM_PER_KEY_MAX_QUEUED_TOKENS.
    #[arg(long, env = "TANDEM_PER_KEY_MAX_QUEUED_TOKENS", default_value_t = 32_768)]
    per_key_max_queued_tokens: u64,
    /// An API key clients must send (repeatable; with none and no keys
    /// file, the API is open). Env: TANDEM_API_KEY (comma-separated).
    #[arg(long, env = "TANDEM_API_KEY", value_delimiter = ',')]
    api_key: Vec<String>,
    /// A file of API keys, one `KEY [NAME]` per line. Env: TANDEM_API_KEYS_FILE.
    #[arg(long, env = "TANDEM_API_KEYS_FILE")]
    api_keys_file: Option<PathBuf>,
    /// The tenants file (TOML: API keys per tenant, its class and limits;
    /// config/tenants.example.toml), reloaded on SIGHUP and when it
    /// changes. Instead of --api-key / --api-keys-file. Env: TANDEM_TENANTS.
    #[arg(long, env = "TANDEM_TENANTS", conflicts_with_all = ["api_key", "api_keys_file"])]
    tenants: Option<PathBuf>,
    /// This coordinator's id in etcd's fleet range (unique per live
    /// coordinator). Env: TANDEM_COORDINATOR_ID.
    #[arg(long, env = "TANDEM_COORDINATOR_ID")]
    coordinator_id: Option<String>,
    /// Lease TTL of this coordinator's fleet key in etcd, s: how long the
    /// others take to count it out when it dies. Env: TANDEM_FLEET_LEASE_TTL_S.
    #[arg(long, env = "TANDEM_FLEET_LEASE_TTL_S", default_value_t = 5)]
    fleet_lease_ttl_s: u64,
    /// The least number of coordinators every tenant budget is split
    /// between: the split without --etcd, and while etcd cannot tell
    /// (then the last fleet size seen counts too). Env: TANDEM_FLEET_MIN_SPLIT.
    #[arg(long, env = "TANDEM_FLEET_MIN_SPLIT", default_value_t = 1)]
    fleet_min_split: usize,
    /// Threads that template and tokenize prompts (off the async reactor). Env: TANDEM_TOKENIZER_THREADS.
    #[arg(long, env = "TANDEM_TOKENIZER_THREADS", default_value_t = 2)]
    tokenizer_threads: usize,
    /// Requests waiting for a tokenizer thread (503 tokenizer_busy beyond;
    /// one tenant at most a quarter). Env: TANDEM_TOKENIZER_QUEUE.
    #[arg(long, env = "TANDEM_TOKENIZER_QUEUE", default_value_t = 64)]
    tokenizer_queue: usize,
    /// HTTP connections open at once (more wait in the accept backlog). Env: TANDEM_HTTP_MAX_CONNECTIONS.
    #[arg(long, env = "TANDEM_HTTP_MAX_CONNECTIONS", default_value_t = 1024)]
    http_max_connections: usize,
    /// A request head must arrive within this long, ms (else the
    /// connection is closed). Env: TANDEM_HTTP_HEADER_TIMEOUT_MS.
    #[arg(long, env = "TANDEM_HTTP_HEADER_TIMEOUT_MS", default_value_t = 10_000)]
    http_header_timeout_ms: u64,
    /// A request body must arrive within this long, ms (else 408
    /// request_timeout and the connection closed). Env: TANDEM_HTTP_BODY_TIMEOUT_MS.
    #[arg(long, env = "TANDEM_HTTP_BODY_TIMEOUT_MS", default_value_t = 30_000)]
    http_body_timeout_ms: u64,
    /// How long a finished answer stays attached to its Idempotency-Key, s. Env: TANDEM_IDEMPOTENCY_WINDOW_S.
    #[arg(long, env = "TANDEM_IDEMPOTENCY_WINDOW_S", default_value_t = 600)]
    idempotency_window_s: u64,
    /// Most Idempotency-Keys remembered at once. Env: TANDEM_IDEMPOTENCY_MAX_KEYS.
    #[arg(long, env = "TANDEM_IDEMPOTENCY_MAX_KEYS", default_value_t = 10_000)]
    idempotency_max_keys: usize,
    /// HTTP/2 keepalive PING interval on gRPC connections, ms. Env: TANDEM_GRPC_KEEPALIVE_MS.
    #[arg(long, env = "TANDEM_GRPC_KEEPALIVE_MS", default_value_t = 30_000)]
    grpc_keepalive_ms: u64,
    /// A keepalive PING unanswered this long closes the gRPC connection, ms.
    /// Env: TANDEM_GRPC_KEEPALIVE_TIMEOUT_MS.
    #[arg(long, env = "TANDEM_GRPC_KEEPALIVE_TIMEOUT_MS", default_value_t = 10_000)]
    grpc_keepalive_timeout_ms: u64,
    /// A gRPC connection this old is sent GOAWAY, so long-lived channels reconnect
    /// and rebalance across coordinators; its calls in flight run on to their end, ms.
    /// Env: TANDEM_GRPC_MAX_CONNECTION_AGE_MS.
    #[arg(long, env = "TANDEM_GRPC_MAX_CONNECTION_AGE_MS", default_value_t = 1_800_000)]
    grpc_max_connection_age_ms: u64,
    /// Deadline of a request that sets no `x-request-timeout-ms` (HTTP) or
    /// `grpc-timeout` (gRPC), ms. Env: TANDEM_REQUEST_TIMEOUT_MS.
    #[arg(long, env = "TANDEM_REQUEST_TIMEOUT_MS", default_value_t = 300_000)]
    request_timeout_ms: u64,
    /// The longest deadline any request gets, ms: a longer `x-request-timeout-ms`,
    /// `x-request-deadline` or `grpc-timeout` is cut to this (the answer ends
    /// `deadline_exceeded` then). Set it, and the drain grace above it, so that a
    /// rollout never cuts a stream (the Kubernetes pack does). 0: no cap. Env:
    /// TANDEM_MAX_REQUEST_TIMEOUT_MS.
    #[arg(long, env = "TANDEM_MAX_REQUEST_TIMEOUT_MS", default_value_t = 0)]
    max_request_timeout_ms: u64,
    /// `max_tokens` of a request that sets none. Env: TANDEM_DEFAULT_MAX_TOKENS.
    #[arg(long, env = "TANDEM_DEFAULT_MAX_TOKENS", default_value_t = 256)]
    default_max_tokens: u32,
    /// A streamed answer whose client takes nothing for this long is ended
    /// (request cancelled on the workers, KV freed, connection closed), ms.
    /// Env: TANDEM_STREAM_IDLE_TIMEOUT_MS.
    #[arg(long, env = "TANDEM_STREAM_IDLE_TIMEOUT_MS", default_value_t = 30_000)]
    stream_idle_timeout_ms: u64,
    /// Consecutive failed remote prefills on one (prefill worker, decode
    /// worker) pair, as that decode worker reports them, that open the
    /// pair's circuit breaker; 0 disables the breakers. Env: TANDEM_PREFILL_BREAKER_FAILURES.
    #[arg(long, env = "TANDEM_PREFILL_BREAKER_FAILURES", default_value_t = 3)]
    prefill_breaker_failures: u32,
    /// How long an open breaker keeps its pair out of routing before one
    /// request probes it, ms. Env: TANDEM_PREFILL_BREAKER_COOLDOWN_MS.
    #[arg(long, env = "TANDEM_PREFILL_BREAKER_COOLDOWN_MS", default_value_t = 5_000)]
    prefill_breaker_cooldown_ms: u64,
    /// What a long prompt gets while every ready decode worker's pairs with
    /// its group's prefill workers have open breakers: `refuse` (503 `prefill_unavailable` + Retry-After, at
    /// once) or `local` (the decode worker prefills it; for decode workers
    /// running `kv_load_failure_policy = recompute`). Env: TANDEM_PREFILL_BREAKER_OPEN.
    #[arg(long, env = "TANDEM_PREFILL_BREAKER_OPEN", default_value = "refuse", value_parser = ["refuse", "local"])]
    prefill_breaker_open: String,
    /// How many times one running request may move to another decode worker
    /// when its worker dies, is fenced or drained past its grace, or freezes (request
    /// migration: the stream goes on, no token lost or repeated); 0 turns
    /// migration off. Env: TANDEM_MIGRATION_LIMIT.
    #[arg(long, env = "TANDEM_MIGRATION_LIMIT", default_value_t = 3)]
    migration_limit: u32,
    /// A running request that gets no token for this long, while its decode
    /// worker's load reports have gone stale too (a frozen process or a cut-off
    /// host), moves to another worker, ms. Env: TANDEM_MIGRATION_STALL_MS.
    #[arg(long, env = "TANDEM_MIGRATION_STALL_MS", default_value_t = 2_000)]
    migration_stall_ms: u64,
    /// Migrations re-prefilling at once (a dying host's streams wait their
    /// turn instead of starting a prefill storm). Env: TANDEM_MIGRATION_CONCURRENCY.
    #[arg(long, env = "TANDEM_MIGRATION_CONCURRENCY", default_value_t = 8)]
    migration_concurrency: usize,
    /// How long after its Retry-After a refused request is still known as a retry
    /// (by its Idempotency-Key, else its body), s. Env: TANDEM_RETRY_WINDOW_S.
    #[arg(long, env = "TANDEM_RETRY_WINDOW_S", default_value_t = 60)]
    retry_window_s: u64,
    /// Retries a caller earns per fresh request: the share of its traffic that may
    /// be retries (429 retry_budget_exhausted beyond). Env: TANDEM_RETRY_BUDGET_RATIO.
    #[arg(long, env = "TANDEM_RETRY_BUDGET_RATIO", default_value_t = 0.2)]
    retry_budget_ratio: f64,
    /// Retries a caller earns per second whatever its traffic. Env: TANDEM_RETRY_BUDGET_MIN_PER_S.
    #[arg(long, env = "TANDEM_RETRY_BUDGET_MIN_PER_S", default_value_t = 1.0)]
    retry_budget_min_per_s: f64,
    /// Most retries a caller may have saved up (its burst). Env: TANDEM_RETRY_BUDGET_BURST.
    #[arg(long, env = "TANDEM_RETRY_BUDGET_BURST", default_value_t = 10.0)]
    retry_budget_burst: f64,
    /// Remote prefill attempts one request may make in all, across every decode
    /// worker it is routed to: the coordinator lists at most this many prefill
    /// workers, and a decode worker (policy `retry`) walks its list without adding
    /// any. Env: TANDEM_PREFILL_ATTEMPTS.
    #[arg(long, env = "TANDEM_PREFILL_ATTEMPTS", default_value_t = 3)]
    prefill_attempts: usize,
    /// Whether prefill workers are paired by the zone workers register (their
    /// `--zone`): `any` ignores zones; `prefer` tries the decode worker's own zone's
    /// prefill workers first and crosses only when none of them can take the
    /// request; `require` never crosses (a decode worker whose zone has no prefill
    /// worker prefills itself). Env: TANDEM_ZONE_PAIRING.
    #[arg(long, env = "TANDEM_ZONE_PAIRING", default_value = "any")]
    zone_pairing: ZonePairing,
    /// Drain grace on SIGTERM/SIGINT, ms. Env: TANDEM_SHUTDOWN_TIMEOUT_MS.
    #[arg(long, env = "TANDEM_SHUTDOWN_TIMEOUT_MS", default_value_t = 10_000)]
    shutdown_timeout_ms: u64,
    /// Log line format: `text` or `json` (one object per line, for collectors). The
    /// filter is TANDEM_LOG, else RUST_LOG, else `info`. Env: TANDEM_LOG_FORMAT.
    #[arg(long, env = "TANDEM_LOG_FORMAT", default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

fn main() -> anyhow::Result<()> {
    let flags = Flags::parse();
    facts::log::init(flags.log_format).map_err(anyhow::Error::msg)?;
    tracing::info!(version = env!("CARGO_PKG_VERSION"), http = %flags.http, grpc = %flags.grpc, "starting");
    #[cfg(feature = "fault-injection")]
    if flags.fault_endless_stream > 0 {
        tracing::warn!(
            stream = flags.fault_endless_stream,
            "FAULT INJECTION ON (planted bug): that streamed answer never ends; drills only"
        );
        coordinator::plant::arm(flags.fault_endless_stream);
    }
    #[cfg(feature = "fault-injection")]
    if flags.fault_move_drops_token {
        tracing::warn!("FAULT INJECTION ON (planted bug): a moved request loses a token; drills only");
        coordinator::plant::arm_move_drops_token(true);
    }
    for (name, v) in [("max_body_bytes", flags.max_body_bytes), ("idempotency_max_keys", flags.idempotency_max_keys)] {
        anyhow::ensure!(v > 0, "config field `{name}`: must be at least 1");
    }
    anyhow::ensure!(flags.load_poll_ms > 0, "config field `load_poll_ms`: must be at least 1");
    anyhow::ensure!(
        flags.prefix_affinity.is_finite() && flags.prefix_affinity >= 0.0,
        "config field `prefix_affinity`: must be a finite number >= 0, got {}",
        flags.prefix_affinity
    );
    anyhow::ensure!(flags.request_timeout_ms > 0, "config field `request_timeout_ms`: must be at least 1");
    for (name, v) in
        [("retry_budget_ratio", flags.retry_budget_ratio), ("retry_budget_min_per_s", flags.retry_budget_min_per_s)]
    {
        anyhow::ensure!(v.is_finite() && v >= 0.0, "config field `{name}`: must be a finite number >= 0, got {v}");
    }
    anyhow::ensure!(
        flags.retry_budget_burst.is_finite() && flags.retry_budget_burst >= 1.0,
        "config field `retry_budget_burst`: must be a finite number >= 1, got {}",
        flags.retry_budget_burst
    );
    anyhow::ensure!(flags.default_max_tokens > 0, "config field `default_max_tokens`: must be at least 1");
    anyhow::ensure!(flags.stream_idle_timeout_ms > 0, "config field `stream_idle_timeout_ms`: must be at least 1");
    anyhow::ensure!(
        flags.prefill_breaker_cooldown_ms > 0,
        "config field `prefill_breaker_cooldown_ms`: must be at least 1"
    );
    for (name, v) in [
        ("fleet_lease_ttl_s", flags.fleet_lease_ttl_s),
        ("fleet_min_split", flags.fleet_min_split as u64),
        ("tokenizer_threads", flags.tokenizer_threads as u64),
        ("tokenizer_queue", flags.tokenizer_queue as u64),
        ("http_max_connections", flags.http_max_connections as u64),
        ("http_header_timeout_ms", flags.http_header_timeout_ms),
        ("http_body_timeout_ms", flags.http_body_timeout_ms),
        ("migration_stall_ms", flags.migration_stall_ms),
        ("migration_concurrency", flags.migration_concurrency as u64),
        ("prefill_attempts", flags.prefill_attempts as u64),
        ("grpc_keepalive_ms", flags.grpc_keepalive_ms),
        ("grpc_keepalive_timeout_ms", flags.grpc_keepalive_timeout_ms),
        ("grpc_max_connection_age_ms", flags.grpc_max_connection_age_ms),
    ] {
        anyhow::ensure!(v > 0, "config field `{name}`: must be at least 1");
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(run(flags))
}

async fn run(flags: Flags) -> anyhow::Result<()> {
    // Installed before the addresses are printed: a SIGTERM from then on drains.
    let mut signals = registry::StopSignals::install()?;
    let prometheus = coordinator::metrics::install().context("installing the metrics recorder")?;
    let path = flags.model.clone().unwrap_or_else(engine::paths::default_model_path);
    let (weights, gguf) = Weights::from_gguf(&path).with_context(|| format!("loading {}", path.display()))?;
    let tokenizer = Tokenizer::from_gguf(&gguf).context("loading the tokenizer")?;
    let context = weights.config.context;
    drop(weights);
    let source = match (flags.etcd.is_empty(), flags.decode.is_empty()) {
        (false, true) => {
            let etcd = registry::EtcdConfig::new(flags.etcd.clone());
            let membership =
                registry::Membership::start(registry::MembershipConfig::new(etcd, flags.cluster_prefix.clone()))
                    .await
                    .context("starting the etcd membership cache")?;
            Source::Etcd { membership, max_stale: Duration::from_millis(flags.registry_max_stale_ms) }
        }
        (true, false) => Source::Static { decode: flags.decode.clone(), prefill: flags.prefill.clone() },
        _ => {
            anyhow::bail!("config: give either `--etcd` or `--decode` (with optional `--prefill`), not both or neither")
        }
    };
    if let Source::Etcd { membership, .. } = &source {
        tokio::spawn(coordinator::metrics::follow_membership(membership.subscribe()));
    }
    let routing = RouteSettings {
        local_prefill_max_tokens: flags.local_prefill_max_tokens,
        load_poll: Duration::from_millis(flags.load_poll_ms),
        prefix_affinity: flags.prefix_affinity,
        prefill_attempts: flags.prefill_attempts,
        zone_pairing: flags.zone_pairing,
        breaker: BreakerConfig {
            failures: flags.prefill_breaker_failures,
            cooldown: Duration::from_millis(flags.prefill_breaker_cooldown_ms),
            open_group_prefills_locally: flags.prefill_breaker_open == "local",
        },
    };
    let cluster = Arc::new(Cluster::new(source, routing).map_err(anyhow::Error::msg)?);
    cluster.spawn_load_poller();
    // Every tenant budget is split between the live coordinators (etcd), or `--fleet-min-split`.
    let split = Split::new(flags.fleet_min_split);
    coordinator::metrics::fleet_split(split.get());
    let gate = match &flags.tenants {
        Some(path) => {
            let gate = Tenancy::from_file(path, split.clone()).context("loading the tenants file")?;
            tracing::info!(path = %path.display(), tenants = gate.tenant_count(), "tenants file loaded");
            gate
        }
        None => {
            let keys = ApiKeys::load(&flags.api_key, flags.api_keys_file.as_deref()).context("loading API keys")?;
            if keys.enabled() {
                tracing::info!(keys = keys.len(), "API keys required");
            } else {
                tracing::warn!("no API key configured: the API is open to anyone who can reach it");
            }
            coordinator::metrics::tenants_loaded(1);
            Tenancy::builtin(keys, Tenant::builtin(), split.clone())
        }
    };
    // Before the addresses are printed: SIGHUP's default action would end the process.
    gate.spawn_reloader().context("installing the SIGHUP handler")?;
    let admission = AdmissionConfig {
        max_running: flags.max_running,
        max_queued: flags.max_queued,
        max_queued_tokens: flags.max_queued_tokens,
        per_key_max_queued: flags.per_key_max_queued,
        per_key_max_queued_tokens: flags.per_key_max_queued_tokens,
    };
    let settings = Settings {
        model: flags.model_name.clone(),
        admission,
        default_timeout: Duration::from_millis(flags.request_timeout_ms),
        max_timeout: (flags.max_request_timeout_ms > 0).then(|| Duration::from_millis(flags.max_request_timeout_ms)),
        default_max_tokens: flags.default_max_tokens,
        stream_idle_timeout: Duration::from_millis(flags.stream_idle_timeout_ms),
        migration: MigrationSettings {
            limit: flags.migration_limit,
            stall: Duration::from_millis(flags.migration_stall_ms),
            concurrency: flags.migration_concurrency,
        },
        retries: RetrySettings {
            window: Duration::from_secs(flags.retry_window_s),
            ratio: flags.retry_budget_ratio,
            min_per_s: flags.retry_budget_min_per_s,
            burst: flags.retry_budget_burst,
            ..RetrySettings::default()
        },
    };
    let pool = Pool::new(flags.tokenizer_threads, flags.tokenizer_queue).context("starting the tokenizer threads")?;
    let pipeline = Pipeline::new(tokenizer, context, cluster, settings, gate, pool).context("admission settings")?;
    let drainer = pipeline.clone();
    pipeline.follow_capacity(Duration::from_millis(500));
    let http_settings = HttpSettings {
        max_body_bytes: flags.max_body_bytes,
        idempotency_window: Duration::from_secs(flags.idempotency_window_s),
        idempotency_max_keys: flags.idempotency_max_keys,
        body_timeout: Duration::from_millis(flags.http_body_timeout_ms),
        metrics_on_client_port: flags.metrics_addr.is_none(),
    };
    let app = App::new(pipeline.clone(), http_settings, Some(prometheus));
    let http_listener =
        tokio::net::TcpListener::bind(flags.http).await.with_context(|| format!("binding http {}", flags.http))?;
    let grpc_listener =
        tokio::net::TcpListener::bind(flags.grpc).await.with_context(|| format!("binding grpc {}", flags.grpc))?;
    println!("listening http={} grpc={}", http_listener.local_addr()?, grpc_listener.local_addr()?);
    let metrics_listener = match flags.metrics_addr {
        Some(a) => {
            let l = tokio::net::TcpListener::bind(a).await.with_context(|| format!("binding metrics {a}"))?;
            println!("listening metrics={}", l.local_addr()?);
            Some(l)
        }
        None => None,
    };
    // One token stops both servers: each stops accepting and lets its
    // in-flight requests finish.
    let stop = CancellationToken::new();
    // The other live coordinators; none known without a fleet (no etcd).
    let mut peers = None;
    if !flags.etcd.is_empty() {
        let fleet = coordinator::fleet::FleetConfig {
            etcd: registry::EtcdConfig::new(flags.etcd.clone()),
            prefix: flags.cluster_prefix.clone(),
            id: flags.coordinator_id.clone().unwrap_or_else(coordinator::fleet::default_id),
            ttl: Duration::from_secs(flags.fleet_lease_ttl_s),
            min_split: flags.fleet_min_split,
        };
        let (_, p) = coordinator::fleet::spawn(fleet, split, stop.clone()).context("joining the coordinator fleet")?;
        peers = Some(p);
    }
    let serve = ServeSettings {
        max_connections: flags.http_max_connections,
        header_timeout: Duration::from_millis(flags.http_header_timeout_ms),
        // A client that stops reading cannot hold its connection (and request) past the idle timeout.
        stall_limit: Duration::from_millis(flags.stream_idle_timeout_ms),
        counted: true,
    };
    let metrics_server = metrics_listener.map(|l| {
        let settings = ServeSettings { max_connections: 64, counted: false, ..serve };
        coordinator::http::serve(l, metrics_router(app.clone()), settings, stop.clone())
    });
    let http = coordinator::http::serve(http_listener, router(app), serve, stop.clone());
    let grpc_settings = grpc::GrpcSettings {
        max_message_bytes: flags.max_body_bytes,
        idempotency_window: Duration::from_secs(flags.idempotency_window_s),
        idempotency_max_keys: flags.idempotency_max_keys,
        keepalive: Duration::from_millis(flags.grpc_keepalive_ms),
        keepalive_timeout: Duration::from_millis(flags.grpc_keepalive_timeout_ms),
        max_connection_age: Duration::from_millis(flags.grpc_max_connection_age_ms),
    };
    let grpc = grpc::serve(pipeline, grpc_settings, grpc_listener, stop.clone());
    let mut servers = tokio::spawn(async move {
        tokio::try_join!(
            async { http.await.context("serving HTTP") },
            async { grpc.await.context("serving gRPC") },
            async {
                match metrics_server {
                    Some(m) => m.await.context("serving metrics"),
                    None => Ok(()),
                }
            },
        )
        .map(|_| ())
    });
    tokio::select! {
        r = &mut servers => return r.context("server task")?,
        s = signals.recv() => tracing::info!(signal = s, "draining"),
    }
    // Shutdown in phases, all within the grace: queued and new requests are
    // refused at once (503 shutting_down) while the listeners stay open, so
    // a client hears why instead of a refused connection; dispatched ones
    // run on. As soon as another coordinator is live (the fleet in etcd), the
    // servers stop accepting (a front sends new connections on, HTTP/2 clients
    // get GOAWAY, HTTP/1.1 answers `Connection: close`) and running streams end
    // with the resumable `coordinator_draining`, for their clients to resume
    // there. Once none is left the servers stop accepting and close their idle
    // connections; after the grace we exit anyway.
    let grace = Duration::from_millis(flags.shutdown_timeout_ms);
    let until = tokio::time::Instant::now() + grace;
    let peer_live = || peers.as_ref().is_some_and(|p| p.live() > 0);
    let stop_now = stop.clone();
    if !drainer.drain(grace, peer_live, move || stop_now.cancel()).await {
        tracing::warn!(?grace, "in-flight requests did not finish within the grace");
    }
    stop.cancel();
    match tokio::time::timeout_at(until, servers).await {
        Ok(r) => r.context("server task")?,
        Err(_) => {
            tracing::warn!(?grace, "in-flight requests did not finish within the grace");
            Ok(())
        }
    }
}
