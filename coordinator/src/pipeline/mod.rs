//! One request's walk through the coordinator, whatever the frontend: the
//! model and context checks, the deadline, admission, the trip to a decode
//! worker, and turning its token stream into text pieces with stop strings
//! applied, finish reasons, usage and logprobs.
//!
//! The HTTP ([`crate::http`]) and gRPC ([`crate::grpc`]) frontends parse
//! their own request shapes into a [`Job`] (sharing [`crate::openai`]'s
//! validation and [`crate::prompt`]'s tokenization), call
//! [`Pipeline::run`], and shape the [`Run`]'s events for their wire. So both
//! admit, route, time out and fail the same way; every refusal is an
//! [`Error`] saying what went wrong, which each frontend maps onto its own
//! wire at its edge.
//!
//! Dropping a [`Run`] drops the worker stream, which cancels the request on
//! the decode and prefill workers and frees its KV; it also releases the
//! request's admission.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use types::priority::Priority;

use crate::admission::{self, Admission, Seat, Shed, Ticket};
use crate::cluster::{Cluster, Dispatch, WorkerTags};
use crate::error::Error;
use crate::metrics;
use crate::openai::Spec;
use crate::prompt::{self, pool::Pool};
use crate::retries::{RetryGate, RetrySettings};
use crate::tenants::{Pass, Tenancy};
use engine::tokenizer::Tokenizer;

mod run;
mod walk;
pub use run::{Collected, Event, Finish, Piece, Run, TokenLogprob, TopLogprob};
pub use walk::{Claimed, Entered};

/// Settings every frontend shares.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The model id clients must name.
    pub model: String,
    /// The central queue's bounds. `max_running` 0 means "the cluster's
    /// capacity": the sum of the registered decode workers' `max_running`,
    /// followed as workers come and go.
    pub admission: admission::AdmissionConfig,
    /// Deadline when the request sets none.
    pub default_timeout: Duration,
    /// The longest deadline any request gets, its own included (a longer one is
    /// cut to this): what a drain grace must outlast (`--max-request-timeout-ms`).
    /// `None`: no cap.
    pub max_timeout: Option<Duration>,
    /// `max_tokens` when the request sets none.
    pub default_max_tokens: u32,
    /// A streamed answer whose client takes no event (HTTP: no byte) for
    /// this long is ended: the request is cancelled on the workers (its KV
    /// freed) and the connection closed (`--stream-idle-timeout-ms`).
    pub stream_idle_timeout: Duration,
    /// Request migration: how a running request moves to another decode worker.
    pub migration: MigrationSettings,
    /// The retry gate's window and budget (walk step 3).
    pub retries: RetrySettings,
}

/// Request migration's bounds (docs/ARCHITECTURE.md, "Request migration").
#[derive(Debug, Clone, Copy)]
pub struct MigrationSettings {
    /// Moves one request may make (`--migration-limit`); 0 turns migration off.
    pub limit: u32,
    /// A stream with no event for this long, whose worker's load reports went
    /// stale too, is moved (`--migration-stall-ms`): a frozen worker.
    pub stall: Duration,
    /// Migrations re-prefilling at once in this coordinator
    /// (`--migration-concurrency`): a dying host does not start a prefill storm.
    pub concurrency: usize,
}

impl Default for MigrationSettings {
    fn default() -> Self {
        Self { limit: 3, stall: Duration::from_millis(2_000), concurrency: 8 }
    }
}

/// Hands `item` to a streamed answer's bounded channel within `idle`;
/// false when the client went away or did not take it in time (counted as
/// `tandem_coordinator_stream_send_timeouts_total{api,layer="event"}`).
pub async fn send_within<T>(tx: &tokio::sync::mpsc::Sender<T>, item: T, idle: Duration, api: &'static str) -> bool {
    match tx.send_timeout(item, idle).await {
        Ok(()) => true,
        Err(tokio::sync::mpsc::error::SendTimeoutError::Timeout(_)) => {
            metrics::stream_send_timeout(api, "event");
            tracing::info!(api, ?idle, "the client took no event within the stream idle timeout; ending the stream");
            false
        }
        Err(tokio::sync::mpsc::error::SendTimeoutError::Closed(_)) => false,
    }
}

/// What the frontends share: the tokenizer, the cluster and admission.
pub struct Pipeline {
    /// Migrations under way; at most `settings.migration.concurrency`.
    pub(crate) migrations: Arc<tokio::sync::Semaphore>,
    pub tokenizer: Tokenizer,
    /// The model's context length in tokens.
    pub context: usize,
    pub cluster: Arc<Cluster>,
    pub settings: Settings,
    /// Who may call, under which name and tenant, and within which limits.
    pub gate: Arc<Tenancy>,
    /// Where prompts are templated and tokenized, off the reactor.
    pub pool: Pool,
    pub admission: Arc<Admission>,
    /// Retries kept to their Retry-After and their caller's budget, across both APIs.
    pub retries: RetryGate,
    /// Cancelled when a draining coordinator hands its streams to its peers:
    /// every [`Run`] then ends with [`Error::Draining`].
    handoff: CancellationToken,
}

pub use crate::prompt::PromptInput;

/// A request parsed and validated by its frontend, before any token is
/// counted: what [`Pipeline::prepare`] turns into a [`Job`].
#[derive(Debug)]
pub struct Draft {
    pub input: PromptInput,
    /// The field the prompt came in (`prompt`, `messages`, `token_ids`).
    pub param: &'static str,
    pub spec: Spec,
    /// The field `max_tokens` came in (`max_tokens` or `max_completion_tokens`).
    pub max_tokens_param: &'static str,
    /// The class the request asked for, if any.
    pub priority: Option<Priority>,
    pub deadline: Instant,
    pub arrived: Instant,
    /// The request's `Idempotency-Key`, if it sent one: an unseeded request's seed
    /// is derived from it, so a retry anywhere samples the same answer.
    pub idempotency_key: Option<String>,
}

/// A validated, tokenized request ready to run.
#[derive(Debug)]
pub struct Job {
    /// The prompt's token ids (chat template applied).
    pub ids: Vec<u32>,
    pub spec: Spec,
    /// When the request must have ended; travels to the workers.
    pub deadline: Instant,
    /// The caller's name ([`crate::auth`]): fairness and limits are per caller.
    pub caller: String,
    pub priority: Priority,
    /// When it arrived (latency metrics count from here).
    pub arrived: Instant,
    /// Its place inside its tenant's limits, held until the run ends.
    pub pass: Pass,
}

/// The admission class a request asks for: the `x-priority` header, else
/// the body's `priority` field, else none (its tenant's class, see
/// [`crate::tenants::Tenant::class_of`]).
pub fn priority_of(header: Option<&str>, field: Option<&str>) -> Result<Option<Priority>, Error> {
    let bad = |param: &str| Error::invalid(param, "must be one of \"high\", \"normal\", \"low\"");
    if let Some(h) = header {
        return Priority::parse(h.trim()).map(Some).map_err(|_| bad("x-priority"));
    }
    field.map(|s| Priority::parse(s).map_err(|_| bad("priority"))).transpose()
}

/// One coordinator's share of the cluster's `capacity` (running seats)
/// when `split` coordinators share it: `max(1, floor(capacity / split))`,
/// the rule of every count cap across coordinators (docs/ARCHITECTURE.md,
/// "Tenant budgets across coordinators": at most `max(capacity, split)` in
/// all). A cluster without capacity stays at 0.
pub fn capacity_share(capacity: usize, split: usize) -> usize {
    if capacity == 0 {
        return 0;
    }
    (capacity / split.max(1)).max(1)
}

impl Pipeline {
    /// Validates the admission bounds; with `max_running` 0 the capacity
    /// follows the cluster (see [`Pipeline::follow_capacity`]).
    pub fn new(
        tokenizer: Tokenizer,
        context: usize,
        cluster: Arc<Cluster>,
        settings: Settings,
        gate: Arc<Tenancy>,
        pool: Pool,
    ) -> Result<Arc<Self>, admission::ConfigError> {
        let mut config = settings.admission.clone();
        let auto = config.max_running == 0;
        if auto {
            config.max_running = capacity_share(cluster.capacity(), gate.split().get());
        }
        metrics::admission_capacity(config.max_running);
        let admission = Admission::new(config)?;
        let migrations = Arc::new(tokio::sync::Semaphore::new(settings.migration.concurrency.max(1)));
        let retries = RetryGate::new(settings.retries);
        let handoff = CancellationToken::new();
        Ok(Arc::new(Self {
            migrations,
            tokenizer,
            context,
            cluster,
            settings,
            gate,
            pool,
            admission,
            retries,
            handoff,
        }))
    }

    /// With `max_running` 0, keeps the admission capacity at this
    /// coordinator's share of the cluster's as workers and coordinators
    /// come and go (checked every `every`): the cluster's capacity split
    /// like a tenant's count caps (see [`capacity_share`]), so N
    /// coordinators together dispatch no more than the cluster runs.
    pub fn follow_capacity(self: &Arc<Self>, every: Duration) -> Option<tokio::task::JoinHandle<()>> {
        if self.settings.admission.max_running != 0 {
            return None;
        }
        let me = Arc::downgrade(self);
        Some(tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            loop {
                tick.tick().await;
                let Some(p) = me.upgrade() else { return };
                let share = capacity_share(p.cluster.capacity(), p.gate.split().get());
                p.admission.set_max_running(share);
                metrics::admission_capacity(share);
            }
        }))
    }

    /// The request names the served model (`model` is required).
    pub fn check_model(&self, model: Option<&str>) -> Result<(), Error> {
        match model {
            None => Err(Error::invalid("model", "`model` is required")),
            Some(m) if m == self.settings.model => Ok(()),
            Some(m) => Err(Error::ModelNotFound { asked: m.to_owned(), served: self.settings.model.clone() }),
        }
    }

    /// The prompt (named by `param`) plus `max_tokens` fits the model's context.
    pub fn check_context(&self, param: &'static str, prompt: usize, max_tokens: u32) -> Result<(), Error> {
        if prompt + max_tokens as usize > self.context {
            return Err(Error::ContextLength { param, prompt, max_tokens, context: self.context });
        }
        Ok(())
    }

    /// The deadline of a request arriving now: its own timeout, else the default;
    /// at most `max_timeout` away.
    pub fn deadline(&self, timeout: Option<Duration>) -> Instant {
        let now = Instant::now();
        self.capped(now, now + timeout.unwrap_or(self.settings.default_timeout))
    }

    /// `at`, or `max_timeout` after `arrived` where that is sooner.
    pub fn capped(&self, arrived: Instant, at: Instant) -> Instant {
        cap(self.settings.max_timeout, arrived, at)
    }

    /// Turns a parsed request into a job, cheapest refusal first: the
    /// tenant's `max_tokens` cap, its streams, its output-token and prompt
    /// buckets (none of which needs a token count), then the prompt is
    /// tokenized in the pool and the context, the prompt cap, the
    /// prompt-token bucket and the tenant's KV share are checked.
    pub async fn prepare(self: &Arc<Self>, mut pass: Pass, mut draft: Draft) -> Result<Job, Error> {
        let max_tokens = draft.spec.params.max_tokens;
        // A max_tokens no prompt fits with is the context's refusal (400
        // context_length_exceeded, after tokenizing), whatever the cap.
        if (max_tokens as usize) < self.context {
            pass.check_max_tokens(draft.max_tokens_param, max_tokens)?;
        }
        if draft.spec.stream {
            pass.open_stream()?;
        }
        pass.charge_output(max_tokens)?;
        pass.check_prompt_budget()?;
        let ids = self.tokenize(&pass.tenant().name, draft.input, draft.param).await?;
        self.check_context(draft.param, ids.len(), max_tokens)?;
        pass.charge_prompt(draft.param, ids.len())?;
        // The most KV the request can hold on a decode worker: prompt and
        // answer, in whole blocks.
        let (cluster_kv, block) = self.cluster.kv_capacity();
        let need = (ids.len() as u64 + u64::from(max_tokens)).div_ceil(block as u64) * block as u64;
        pass.hold_kv(need, cluster_kv)?;
        // Every request has a seed, returned to the client: the answer can be reproduced
        // and, with the prompt and the tokens sent so far, continued anywhere.
        let seed = match (draft.spec.params.seed, &draft.idempotency_key) {
            (Some(s), _) => s,
            (None, Some(key)) => derived_seed(&pass.tenant().name, key),
            (None, None) => engine::sampler::fresh_seed(),
        };
        draft.spec.params.seed = Some(seed);
        // The tenant's switch wins over the request's ask.
        draft.spec.params.prompt_lookup &= pass.tenant().prompt_lookup;
        Ok(Job {
            ids,
            spec: draft.spec,
            deadline: draft.deadline,
            caller: pass.caller().to_owned(),
            priority: pass.tenant().class_of(draft.priority),
            arrived: draft.arrived,
            pass,
        })
    }

    /// The prompt's token ids (`param`: its field, for errors), templated and
    /// tokenized in the pool (a queue for `tenant`); ids given as ids need no pool.
    pub async fn tokenize(
        self: &Arc<Self>,
        tenant: &str,
        input: PromptInput,
        param: &'static str,
    ) -> Result<Vec<u32>, Error> {
        if let PromptInput::Ids(ids) = input {
            return Ok(ids);
        }
        let me = self.clone();
        self.pool.run(tenant, move || prompt::tokens(&me.tokenizer, &input, param)).await?
    }

    /// Admission through the central queue: a slot at once, a wait in
    /// line, or a typed refusal ([`Shed`]).
    async fn admit(&self, job: &Job) -> Result<Seat, Error> {
        let ticket = Ticket {
            key: job.caller.clone(),
            priority: job.priority,
            cost: job.ids.len() as u64 + u64::from(job.spec.params.max_tokens),
            deadline: job.deadline,
        };
        match self.admission.admit(ticket).await {
            Ok(slot) => {
                metrics::queue_wait(slot.queue_wait());
                Ok(slot)
            }
            Err(shed) => {
                metrics::shed(shed_label(&shed));
                Err(Error::Shed(shed))
            }
        }
    }

    /// Admits `job` and starts it on a decode worker, within its deadline:
    /// the last two steps of the walk (admission, then route).
    pub async fn run(self: &Arc<Self>, job: Job) -> Result<Run, Error> {
        job.pass.admitted();
        let seat = self.admit(&job).await?;
        let id = self.cluster.request_id();
        let tags = WorkerTags { cache_salt: job.pass.tenant().cache_salt, priority: job.priority };
        let dispatch = Dispatch {
            request_id: id.clone(),
            prompt: job.ids.clone(),
            generated: Vec::new(),
            params: job.spec.params.clone(),
            deadline_unix_ms: unix_ms(job.deadline),
            tags,
            pin: None,
        };
        let started = tokio::time::timeout_at(job.deadline, self.cluster.generate(dispatch.clone())).await;
        let (stream, inflight) = match started {
            Err(_) => return Err(Error::Deadline),
            Ok(r) => r?,
        };
        let tenant = job.pass.tenant();
        metrics::prefix_cached_tokens(tenant.cache_scope.label(&tenant.name), inflight.cached_tokens);
        Ok(Run::new(self.clone(), job, id, dispatch, stream, inflight, seat))
    }

    /// Whether the cluster can serve (what `/ready` and the gRPC health
    /// service report): not while draining, else see [`Cluster::ready`].
    pub async fn ready(&self) -> bool {
        self.readiness().is_ok()
    }

    /// [`Pipeline::ready`] with the reason when not.
    pub fn readiness(&self) -> Result<(), String> {
        if self.admission.is_closed() {
            return Err("the coordinator is shutting down".into());
        }
        self.cluster.ready()
    }

    /// Shutdown, within `grace`: every queued request and every later one is
    /// refused at once with 503 `shutting_down` (Retry-After: another
    /// coordinator can take it), `/ready` and gRPC health turn not ready, and
    /// requests already dispatched run on, until `peer_live` says another
    /// coordinator is live. Then `on_handoff` runs once (the caller stops its
    /// listeners: a front sends new connections to the peer, HTTP/2 clients get
    /// GOAWAY) and every running request ends with [`Error::Draining`], which
    /// carries its stream's cursor and seed: the client resumes it at the peer.
    /// Returns when none is left running, or after `grace`; `true` when all ended.
    pub async fn drain(&self, grace: Duration, peer_live: impl Fn() -> bool, on_handoff: impl FnOnce()) -> bool {
        self.admission.close();
        let until = tokio::time::Instant::now() + grace;
        let mut tick = tokio::time::interval(Duration::from_millis(20));
        let mut on_handoff = Some(on_handoff);
        loop {
            tick.tick().await;
            let running = self.admission.stats().running;
            if running == 0 {
                return true;
            }
            if tokio::time::Instant::now() >= until {
                return false;
            }
            if on_handoff.is_some() && peer_live() {
                tracing::info!(running, "a peer coordinator is live: handing the running streams to it");
                if let Some(f) = on_handoff.take() {
                    f();
                }
                self.handoff.cancel();
            }
        }
    }

    /// Whether running requests are being ended for a peer to resume.
    pub fn handing_off(&self) -> bool {
        self.handoff.is_cancelled()
    }

    /// Resolves once running requests are to end for a peer to resume.
    pub(crate) async fn handed_off(&self) {
        self.handoff.cancelled().await;
    }
}

/// The `reason` label of [`facts::metrics::coordinator::SHED`].
fn shed_label(shed: &Shed) -> &'static str {
    match shed {
        Shed::KeyLimit { .. } => "key_limit",
        Shed::QueueFull { .. } => "queue_full",
        Shed::Deadline => "queue_deadline",
        Shed::Closed => "closed",
    }
}

/// The seed of an unseeded request that came with an Idempotency-Key: the same
/// for the same tenant and key on every coordinator, so a retry (at another
/// coordinator too) samples the same answer. SHA-256, domain-separated.
pub fn derived_seed(tenant: &str, key: &str) -> u64 {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(b"tandem seed from idempotency key v1");
    for part in [tenant, key] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    let d = h.finalize();
    u64::from_le_bytes([d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]])
}

/// A monotonic deadline as wall-clock ms since the epoch, for the wire.
pub(crate) fn unix_ms(d: Instant) -> u64 {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |n| n.as_millis() as u64);
    (now + d.saturating_duration_since(Instant::now()).as_millis() as u64).max(1)
}

#[cfg(test)]
mod tests {
    use super::{capacity_share, derived_seed};

    #[test]
    fn a_key_derives_one_seed_per_tenant() {
        assert_eq!(derived_seed("t", "k1"), derived_seed("t", "k1"), "the same on every coordinator");
        assert_ne!(derived_seed("t", "k1"), derived_seed("t", "k2"));
        assert_ne!(derived_seed("t", "k1"), derived_seed("u", "k1"), "tenants do not share seeds");
        assert_ne!(derived_seed("t", "k\0x"), derived_seed("t\0k", "x"), "the parts do not run together");
    }

    #[test]
    fn the_capacity_splits_like_a_count_cap() {
        assert_eq!(capacity_share(6, 3), 2);
        assert_eq!(capacity_share(7, 3), 2, "rounded down: never more than the cluster runs");
        assert_eq!(capacity_share(2, 3), 1, "at least one each (then at most max(C, n) in all)");
        assert_eq!(capacity_share(6, 1), 6);
        assert_eq!(capacity_share(6, 0), 6, "a split of 0 is read as 1");
        assert_eq!(capacity_share(0, 3), 0, "no capacity stays none");
    }
}

/// `at`, or `max` after `arrived` where that is sooner.
fn cap(max: Option<Duration>, arrived: Instant, at: Instant) -> Instant {
    max.map_or(at, |m| at.min(arrived + m))
}

#[cfg(test)]
mod deadline_tests {
    use super::*;

    #[test]
    fn a_deadline_is_cut_to_the_cap_and_a_shorter_one_kept() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        assert_eq!(cap(Some(s(300)), t0, t0 + s(3600)), t0 + s(300), "an hour asked, five minutes given");
        assert_eq!(cap(Some(s(300)), t0, t0 + s(10)), t0 + s(10), "a shorter deadline stands");
        assert_eq!(cap(None, t0, t0 + s(3600)), t0 + s(3600), "no cap");
    }
}
