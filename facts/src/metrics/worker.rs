use super::{Exporter, Kind, Metric};

/// `tandem_kv_cache_usage_ratio`: used / total KV blocks in this worker's
/// pool. vLLM: `vllm:kv_cache_usage_perc` (also a 0..1 fraction).
pub const KV_CACHE_USAGE: &str = "tandem_kv_cache_usage_ratio";
/// `tandem_kv_blocks_total`: KV blocks in the pool. vLLM: `vllm:cache_config_info{num_gpu_blocks}`.
pub const KV_BLOCKS_TOTAL: &str = "tandem_kv_blocks_total";
/// `tandem_kv_blocks_used`: KV blocks referenced by running sequences,
/// reservations and held prefills (cached-but-free prefix blocks are not
/// used). Must return to 0 when the worker is idle. vLLM: none (derive
/// from the usage ratio).
pub const KV_BLOCKS_USED: &str = "tandem_kv_blocks_used";
/// `tandem_num_requests_running`: requests in the engine's running batch.
/// vLLM: `vllm:num_requests_running`.
pub const REQUESTS_RUNNING: &str = "tandem_num_requests_running";
/// `tandem_num_requests_waiting`: requests queued for a running seat.
/// vLLM: `vllm:num_requests_waiting`.
pub const REQUESTS_WAITING: &str = "tandem_num_requests_waiting";
/// `tandem_num_preemptions_total{reason}`: sequences the engine preempted
/// since start. `reason="kv_exhausted"`: the KV pool ran out during a step
/// and the most recently admitted sequence was evicted, to be recomputed
/// (the engine has no other kind of preemption). Rising under load means
/// the pool is too small for `max_running`. vLLM: `vllm:num_preemptions_total`.
pub const PREEMPTIONS: &str = "tandem_num_preemptions_total";
/// The `reason` of every preemption the engine makes today.
pub const PREEMPTION_KV_EXHAUSTED: &str = "kv_exhausted";
/// `tandem_prefix_cache_hit_tokens_total`: prompt tokens whose KV came from
/// this worker's prefix cache instead of being computed (hits are only ever
/// within one `cache_salt`, i.e. one tenant scope). vLLM:
/// `vllm:prefix_cache_hits_total` (tokens).
pub const PREFIX_CACHE_HIT_TOKENS: &str = "tandem_prefix_cache_hit_tokens_total";
/// `tandem_spec_decode_num_draft_tokens_total`: prompt-lookup draft tokens
/// the engine computed beside decoding sequences (`prompt_lookup`). vLLM:
/// `vllm:spec_decode_num_draft_tokens_total`.
pub const SPEC_DRAFT_TOKENS: &str = "tandem_spec_decode_num_draft_tokens_total";
/// `tandem_spec_decode_num_accepted_tokens_total`: of those, the ones equal
/// to the token sampled at their position, each a decode step saved; the
/// ratio to the drafted is the acceptance rate (low: the answers do not
/// repeat their prompts, and speculation only costs compute). vLLM:
/// `vllm:spec_decode_num_accepted_tokens_total`.
pub const SPEC_ACCEPTED_TOKENS: &str = "tandem_spec_decode_num_accepted_tokens_total";
/// `tandem_num_preemptions_by_priority_total{priority}`: the same
/// preemptions by the evicted sequence's class (`high`, `normal`, `low`).
/// The engine evicts the lowest class first, so `high` rising means the
/// pool is too small even for the high class alone. vLLM: none.
pub const PREEMPTIONS_BY_PRIORITY: &str = "tandem_num_preemptions_by_priority_total";
/// `tandem_num_requests_waiting_by_priority{priority}`: requests queued for
/// a running seat, by class. The queue serves classes strictly (see
/// engine `batch/order.rs`), so a `low` that stays up while `high` and
/// `normal` keep the seats is starvation in the making. vLLM: none.
pub const REQUESTS_WAITING_BY_PRIORITY: &str = "tandem_num_requests_waiting_by_priority";
/// `tandem_worker_requests_by_priority_total{priority}`: requests this
/// worker received (decode: `Generate`; prefill: `Prefill`), by the class
/// they carried. vLLM: none.
pub const REQUESTS_BY_PRIORITY: &str = "tandem_worker_requests_by_priority_total";
/// `tandem_worker_fenced`: 1 while the worker is fenced (another process holds
/// its etcd key, or no coordinator has called `Health` for
/// `--coordinator-silence-fence-ms`: it takes no new work), else 0. An
/// unreachable etcd does not fence (worker-common's `serve::Fencing`).
/// vLLM: none.
pub const FENCED: &str = "tandem_worker_fenced";
/// `tandem_worker_fences_total`: times the worker fenced itself. vLLM: none.
pub const FENCES: &str = "tandem_worker_fences_total";
/// `tandem_worker_heap_released_bytes_total`: resident anonymous memory the
/// worker's slow tick gave back to the kernel (`malloc_trim`: pages of freed
/// chunks the allocator kept), measured as `RssAnon` before less after each
/// release. Steady growth means the load's working set keeps moving around the
/// heap (bursts, faults); the tick is what keeps it from showing as a leak.
/// vLLM: none.
pub const HEAP_RELEASED_BYTES: &str = "tandem_worker_heap_released_bytes_total";
/// Every `outcome` label of a worker's request counter: `ok` and each of
/// worker-common's `metrics::outcome_label`'s.
pub const OUTCOMES: [&str; 9] = [
    "ok",
    "invalid_argument",
    "version_mismatch",
    "kv_load_failed",
    "retryable",
    "deadline",
    "overloaded",
    "cancelled",
    "internal",
];

/// Every metric of this module: its kind, its label names and who exports it.
pub const CATALOG: &[Metric] = &[
    Metric { name: KV_CACHE_USAGE, kind: Kind::Gauge, labels: &[], exporter: Exporter::Workers },
    Metric { name: KV_BLOCKS_TOTAL, kind: Kind::Gauge, labels: &[], exporter: Exporter::Workers },
    Metric { name: KV_BLOCKS_USED, kind: Kind::Gauge, labels: &[], exporter: Exporter::Workers },
    Metric { name: REQUESTS_RUNNING, kind: Kind::Gauge, labels: &[], exporter: Exporter::Workers },
    Metric { name: REQUESTS_WAITING, kind: Kind::Gauge, labels: &[], exporter: Exporter::Workers },
    Metric { name: PREEMPTIONS, kind: Kind::Counter, labels: &["reason"], exporter: Exporter::Workers },
    Metric { name: PREFIX_CACHE_HIT_TOKENS, kind: Kind::Counter, labels: &[], exporter: Exporter::Workers },
    Metric { name: SPEC_DRAFT_TOKENS, kind: Kind::Counter, labels: &[], exporter: Exporter::Workers },
    Metric { name: SPEC_ACCEPTED_TOKENS, kind: Kind::Counter, labels: &[], exporter: Exporter::Workers },
    Metric { name: PREEMPTIONS_BY_PRIORITY, kind: Kind::Counter, labels: &["priority"], exporter: Exporter::Workers },
    Metric {
        name: REQUESTS_WAITING_BY_PRIORITY,
        kind: Kind::Gauge,
        labels: &["priority"],
        exporter: Exporter::Workers,
    },
    Metric { name: REQUESTS_BY_PRIORITY, kind: Kind::Counter, labels: &["priority"], exporter: Exporter::Workers },
    Metric { name: FENCED, kind: Kind::Gauge, labels: &[], exporter: Exporter::Workers },
    Metric { name: FENCES, kind: Kind::Counter, labels: &[], exporter: Exporter::Workers },
    Metric { name: HEAP_RELEASED_BYTES, kind: Kind::Counter, labels: &[], exporter: Exporter::Workers },
];
