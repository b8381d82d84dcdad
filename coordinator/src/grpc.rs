//! The gRPC frontend (tonic): `tandem.frontend.v1.Frontend` (`Generate`,
//! server-streaming; `ListModels`), the standard health service
//! (`grpc.health.v1.Health`) and server reflection (v1 and v1alpha, so
//! `grpcurl` and `grpc_cli` work without the .proto files).
//!
//! It is the HTTP frontend's twin: a request is validated with the same
//! [`crate::openai`] rules (a [`GenerateRequest`] becomes the same `Spec`),
//! tokenized by [`crate::prompt`], and run by [`Pipeline::run`], so
//! admission, routing, deadlines and worker errors are shared. Only the
//! shapes differ: text pieces stream as `Chunk` events and the end as one
//! `Done`; a refusal or failure is the call's status, chosen from the
//! [`Error`] here and nowhere else ([`status_of`]).
//!
//! Deadline: the standard `grpc-timeout` header, else the configured
//! default, measured from arrival and propagated to the workers. The handler
//! returns the response stream at once and runs the request in a task, so a
//! deadline that passes is always answered `DEADLINE_EXCEEDED` from the
//! pipeline (tonic's own `grpc-timeout` guard, which answers `CANCELLED`,
//! only covers the handler's quick return).
//!
//! A client that cancels the call or goes away drops the response stream;
//! the request's task sees its channel close, even while it waits for the
//! next token, and drops the run, which cancels the request on the workers.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use prost::Message as _;
use proto::frontend::v1::frontend_server::{Frontend, FrontendServer, SERVICE_NAME};
use proto::frontend::v1::{
    generate_request::Input, generate_response, Chunk, Done, FinishReason, GenerateRequest, GenerateResponse,
    ListModelsRequest, ListModelsResponse, Model, TokenLogprob as WireLogprob, TopLogprob as WireTop,
    Usage as WireUsage,
};
use proto::worker::v1::ErrorKind;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tonic::codegen::http;
use tonic::metadata::{MetadataMap, MetadataValue};
use tonic::{Code, Request, Response, Status};
use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};
use tonic_health::server::{HealthReporter, HealthService};
use tonic_health::ServingStatus;
use tonic_types::{ErrorDetails, StatusExt};

use crate::admission::Shed;
use crate::cursor::{resume_outcome, skip_to, Chain, Cursor, Gate, Pass, Stamper};
use crate::error::Error;
use crate::idempotency::{Idempotency, Recorder, Replay, Replayed};
use crate::metrics;
use crate::openai::{self, Sampling, Stop, StreamOptions};
use crate::pipeline::{
    derived_seed, priority_of, send_within, Claimed, Draft, Entered, Event, Finish, Job, Pipeline, PromptInput,
    TokenLogprob,
};
use crate::prompt::{self, Turn};
use crate::retries::Identity;
use crate::router::NoRoute;

/// Metadata key carrying the OpenAI error code (`model_not_found`, ...).
pub const ERROR_CODE_KEY: &str = "x-tandem-error-code";
/// Metadata key carrying the OpenAI error type (`invalid_request_error`, ...).
pub const ERROR_TYPE_KEY: &str = "x-tandem-error-type";
/// Metadata key naming the offending request field.
pub const ERROR_PARAM_KEY: &str = "x-tandem-error-param";
/// Metadata key with the seconds to wait before retrying (as HTTP's header).
pub const RETRY_AFTER_KEY: &str = "retry-after";

/// How often the health service re-checks for a ready decode worker.
const HEALTH_INTERVAL: Duration = Duration::from_secs(1);

/// Events buffered per response stream before the request waits for the client.
const STREAM_BUFFER: usize = 16;

mod stream;
pub use stream::CURSOR_KEY;
use stream::{
    generate, keeps, remember, replay, resume_of, sent_cursor, with_seed_status, Count, Item, Sent, Sink, API,
};

/// The gRPC code of an error: what a gRPC client should do about it.
///
/// - `INVALID_ARGUMENT`: the request is bad; never resend it unchanged.
///   A body over the cap too: as final as a bad field (`RESOURCE_EXHAUSTED`
///   would invite a retry); and a reused idempotency key (HTTP only).
/// - `UNAUTHENTICATED`, `NOT_FOUND`: a missing or wrong API key; an unknown model.
/// - `RESOURCE_EXHAUSTED`: this caller is over its share of the queue, or
///   its tenant over a rate or count (`rate_limit_*`, `too_many_*`); back
///   off for `retry-after`, retry. A tenant cap passed is `INVALID_ARGUMENT`.
/// - `UNAVAILABLE`: retry; the code gRPC clients and retry policies retry.
///   With `retry-after` when the cluster is full, draining or has no
///   usable worker; without when a decode worker's stream broke (the retry
///   may land elsewhere) or it could not load the KV (`kv_load_failed`:
///   that fails before the first token, so nothing reached the client, and
///   the call sent again is routed anew; the failed pair's breaker counted it).
/// - `FAILED_PRECONDITION`: `version_mismatch`, a deployment fault (the
///   pair's version groups or KV layouts differ); retrying does not cure
///   it until the deployment is fixed. `resume_mismatch` too: the cursor
///   was taken from another answer.
/// - `DEADLINE_EXCEEDED`: the deadline passed, queued or running.
/// - `INTERNAL`: a worker failed internally.
pub fn code_of(e: &Error) -> Code {
    use ErrorKind as K;
    match e {
        Error::Invalid { .. }
        | Error::InvalidJson { .. }
        | Error::Unsupported { .. }
        | Error::InvalidBody { .. }
        | Error::ContextLength { .. }
        | Error::UnsupportedMediaType { .. }
        | Error::IdempotencyKeyReused => Code::InvalidArgument,
        Error::BodyTooLarge { .. } => Code::ResourceExhausted,
        // HTTP only: a gRPC method that does not exist is tonic's own UNIMPLEMENTED.
        Error::UnknownRoute { .. } | Error::MethodNotAllowed { .. } => Code::Unimplemented,
        Error::MissingApiKey | Error::WrongApiKey => Code::Unauthenticated,
        Error::ModelNotFound { .. } => Code::NotFound,
        Error::Shed(shed) => match shed {
            Shed::KeyLimit { .. } => Code::ResourceExhausted,
            Shed::QueueFull { .. } | Shed::Closed => Code::Unavailable,
            Shed::Deadline => Code::DeadlineExceeded,
        },
        Error::IdempotencyTableFull
        | Error::IdempotentOriginalFailed
        | Error::NotReady(_)
        | Error::RegistryUnavailable
        | Error::NoRoute { why: NoRoute::NoDecode | NoRoute::NoneReady(_) | NoRoute::PrefillUnavailable(_), .. }
        | Error::WorkerUnavailable(_)
        | Error::MigrationFailed { .. }
        | Error::WorkerStream(_) => Code::Unavailable,
        Error::Worker { kind, .. } => match kind {
            K::InvalidArgument => Code::InvalidArgument,
            K::Overloaded | K::Retryable | K::Cancelled | K::KvLoadFailed => Code::Unavailable,
            K::VersionMismatch => Code::FailedPrecondition,
            K::Deadline => Code::DeadlineExceeded,
            K::Internal | K::Unspecified => Code::Internal,
        },
        Error::Deadline => Code::DeadlineExceeded,
        Error::TenantLimit { .. } | Error::RetryTooSoon { .. } | Error::RetryBudgetExhausted { .. } => {
            Code::ResourceExhausted
        }
        Error::OverCap { .. } => Code::InvalidArgument,
        Error::TokenizerBusy => Code::Unavailable,
        // HTTP only: gRPC messages are read by tonic, bounded by its own limits.
        Error::BodyTimeout { .. } => Code::DeadlineExceeded,
        // The cursor names another answer: sending it again does not help.
        Error::ResumeMismatch { .. } => Code::FailedPrecondition,
        Error::Draining => Code::Unavailable,
    }
}

/// The `google.rpc.ErrorInfo` domain of every error this frontend sends.
pub const ERROR_DOMAIN: &str = "tandem";

/// The call's status for an error: [`code_of`], the OpenAI code prefixing
/// the message, metadata [`ERROR_CODE_KEY`], [`ERROR_TYPE_KEY`],
/// [`ERROR_PARAM_KEY`] and [`RETRY_AFTER_KEY`] where the error has them, and
/// the same facts as `google.rpc.Status` details (`grpc-status-details-bin`),
/// which gRPC's own libraries read: `ErrorInfo` (reason: the code in upper case;
/// domain [`ERROR_DOMAIN`]; metadata `code`, `type` and `param`), `RetryInfo`
/// with the Retry-After, and `BadRequest` naming the field.
pub fn status_of(e: &Error) -> Status {
    let code = e.code();
    let message = format!("{code}: {e}");
    let mut md = MetadataMap::new();
    let mut put = |key: &'static str, value: &str| {
        // Only visible ASCII travels as metadata; our codes and field names are.
        if let Ok(v) = MetadataValue::try_from(value) {
            md.insert(key, v);
        }
    };
    put(ERROR_CODE_KEY, code);
    put(ERROR_TYPE_KEY, e.openai_type());
    let mut info = std::collections::HashMap::from([
        ("code".to_owned(), code.to_owned()),
        ("type".to_owned(), e.openai_type().to_owned()),
    ]);
    if let Some(p) = e.param() {
        put(ERROR_PARAM_KEY, p);
        info.insert("param".to_owned(), p.to_owned());
    }
    let mut details = ErrorDetails::with_error_info(code.to_ascii_uppercase(), ERROR_DOMAIN, info);
    if let Some(s) = e.retry_after() {
        put(RETRY_AFTER_KEY, &s.to_string());
        details.set_retry_info(Some(Duration::from_secs(s)));
    }
    if let Some(p) = e.param() {
        details.add_bad_request_violation(p, e.to_string());
    }
    Status::with_error_details_and_metadata(code_of(e), message, details, md)
}

/// A `grpc-timeout` value: 1 to 8 digits and a unit (`H`ours, `M`inutes,
/// `S`econds, `m`illis, `u` micros, `n`anos), per the gRPC HTTP/2 spec.
pub fn parse_grpc_timeout(v: &str) -> Option<Duration> {
    if !v.is_ascii() || v.len() < 2 || v.len() > 9 {
        return None;
    }
    let (digits, unit) = v.split_at(v.len() - 1);
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// The request's own timeout (`grpc-timeout`), if it set one.
fn request_timeout(md: &MetadataMap) -> Result<Option<Duration>, Error> {
    let Some(v) = md.get("grpc-timeout") else { return Ok(None) };
    v.to_str()
        .ok()
        .and_then(parse_grpc_timeout)
        .map(Some)
        .ok_or_else(|| Error::invalid("grpc-timeout", "must be 1 to 8 digits and a unit (H, M, S, m, u or n)"))
}

/// Validates and tokenizes a request into a job, with the HTTP API's rules
/// and order: the caller's tenant limits first, tokenizing (in the pool) last.
async fn job_of(
    p: &Arc<Pipeline>,
    md: &MetadataMap,
    req: &GenerateRequest,
    entered: Entered,
    idempotency_key: Option<String>,
) -> Result<Job, Error> {
    let headers = md.clone().into_headers();
    let Entered { pass, arrived } = entered;
    let timeout = request_timeout(md)?;
    let deadline = p.deadline(timeout);
    let header_priority = match headers.get("x-priority") {
        Some(v) => Some(v.to_str().map_err(|_| Error::invalid("x-priority", "not visible ASCII"))?),
        None => None,
    };
    let priority = priority_of(header_priority, (!req.priority.is_empty()).then_some(req.priority.as_str()))?;
    p.check_model((!req.model.is_empty()).then_some(req.model.as_str()))?;
    let logprobs = openai::completion_logprobs(req.logprobs.map(i64::from))?;
    let sampling = Sampling {
        max_tokens: req.max_tokens.map(i64::from),
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k.map(i64::from),
        min_p: req.min_p,
        seed: req.seed,
        presence_penalty: req.presence_penalty,
        frequency_penalty: req.frequency_penalty,
        repetition_penalty: req.repetition_penalty,
        stop: (!req.stop.is_empty()).then(|| Stop::Many(req.stop.clone())),
        // Always a stream; `include_usage` asks for Done.usage.
        stream: true,
        stream_options: Some(StreamOptions { include_usage: req.include_usage }),
        ignore_eos: req.ignore_eos,
        prompt_lookup: req.prompt_lookup,
        ..Sampling::default()
    };
    let spec = openai::sampling(&sampling, logprobs, pass.default_max_tokens(p.settings.default_max_tokens))?;
    let (param, input) = match &req.input {
        Some(Input::Prompt(text)) => ("prompt", PromptInput::Text(text.clone())),
        Some(Input::Messages(chat)) => {
            if chat.messages.is_empty() {
                return Err(Error::invalid("messages", "`messages` must not be empty"));
            }
            let turns = chat.messages.iter().enumerate().map(|(i, m)| Turn::new(i, &m.role, m.content.clone()));
            ("messages", PromptInput::Chat(turns.collect::<Result<_, _>>()?))
        }
        Some(Input::TokenIds(t)) => {
            ("token_ids", PromptInput::Ids(prompt::checked_ids("token_ids", &t.ids, p.tokenizer.vocab_size())?))
        }
        None => return Err(Error::invalid("input", "one of `prompt`, `messages` or `token_ids` is required")),
    };
    let draft =
        Draft { input, param, spec, max_tokens_param: "max_tokens", priority, deadline, arrived, idempotency_key };
    p.prepare(pass, draft).await
}

/// The `tandem.frontend.v1.Frontend` service.
pub struct FrontendService {
    pipeline: Arc<Pipeline>,
    /// Idempotency keys of gRPC calls (HTTP's keys are its own table: a key names one
    /// request of one API).
    idempotency: Arc<Idempotency<Sent>>,
}

impl FrontendService {
    pub fn new(pipeline: Arc<Pipeline>, settings: &GrpcSettings) -> Self {
        let idempotency = Idempotency::new(settings.idempotency_window, settings.idempotency_max_keys);
        Self { pipeline, idempotency }
    }
}

type GenerateStream = Pin<Box<dyn tokio_stream::Stream<Item = Result<GenerateResponse, Status>> + Send>>;

fn stream_of(rx: mpsc::Receiver<Item>) -> Response<GenerateStream> {
    Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx)) as GenerateStream)
}

/// The answer's `x-tandem-seed` metadata: the seed it is sampled with.
fn with_seed(mut response: Response<GenerateStream>, seed: u64) -> Response<GenerateStream> {
    if let Ok(v) = seed.to_string().parse() {
        response.metadata_mut().insert(crate::http::SEED_HEADER, v);
    }
    response
}

#[tonic::async_trait]
impl Frontend for FrontendService {
    type GenerateStream = GenerateStream;

    /// The walk of crate::pipeline::walk: the caller and its tenant's limits, the
    /// idempotency key (a retry is answered from the first call with it), then
    /// validation, tokenizing, admission and routing.
    async fn generate(&self, request: Request<GenerateRequest>) -> Result<Response<GenerateStream>, Status> {
        let mut count = Count::new();
        let p = &self.pipeline;
        let (md, req) = (request.metadata(), request.get_ref());
        let headers = md.clone().into_headers();
        let key = (!req.idempotency_key.is_empty()).then_some(req.idempotency_key.as_str());
        // Counted, and remembered for the retry gate when it has a Retry-After.
        let refuse = |count: &mut Count, id: Option<&Identity>, e: Error| {
            count.error(&e);
            let status = status_of(&e);
            remember(p, id, &status);
            status
        };
        let entered = match p.enter(&headers) {
            Ok(e) => e,
            Err(e) => {
                // Refused before its message is read (a tenant's rate or count): known only by its key.
                let id = key.zip(p.gate.caller(&headers).ok()).map(|(k, caller)| Identity::keyed(&caller, API, k));
                return Err(refuse(&mut count, id.as_ref(), e));
            }
        };
        let digest = {
            // The message without its key and cursor names the request, as HTTP's body does.
            let mut unkeyed = req.clone();
            unkeyed.idempotency_key.clear();
            unkeyed.resume_cursor.clear();
            let mut d = unkeyed.encode_to_vec();
            d.extend_from_slice(API.as_bytes());
            d
        };
        let id = Identity::of(entered.pass.caller(), API, key, &digest);
        let entered = entered.pace(p, &id).map_err(|e| refuse(&mut count, Some(&id), e))?;
        let idle = p.settings.stream_idle_timeout;
        let resume = resume_of(req, key).map_err(|e| refuse(&mut count, Some(&id), e))?;
        // A retry's seed is known without running it: the request's, or its key's.
        let replay_seed = req.seed.unwrap_or_else(|| derived_seed(&entered.pass.tenant().name, &req.idempotency_key));
        let (entered, key, recorder) = match entered
            .claim(&self.idempotency, key, "idempotency_key", &digest)
            .map_err(|e| refuse(&mut count, Some(&id), e))?
        {
            Claimed::Fresh { entered, key, recorder } => (entered, key, recorder),
            Claimed::Replay(mut r) => {
                metrics::idempotent_replay(if r.leader_finished() { "done" } else { "inflight" });
                if let Some(at) = resume {
                    let checked = skip_to(&mut r, None, at, sent_cursor).await;
                    metrics::stream_resume(API, resume_outcome(&checked));
                    if let Err(e) = checked {
                        return Err(refuse(&mut count, Some(&id), e));
                    }
                }
                count.defuse();
                let (tx, rx) = mpsc::channel(STREAM_BUFFER);
                tokio::spawn(replay(r, tx, idle));
                return Ok(with_seed(stream_of(rx), replay_seed));
            }
        };
        let job = match job_of(p, md, req, entered, key).await {
            Ok(job) => job,
            Err(e) => {
                // Refused before admission: kept for the key's retries when they would get it again.
                if let Some(rec) = recorder {
                    if keeps(&e) {
                        rec.push(Sent::refusal(&e));
                    }
                    rec.finish(keeps(&e));
                }
                return Err(refuse(&mut count, Some(&id), e));
            }
        };
        let seed = job.spec.params.seed.unwrap_or_default();
        let (tx, rx) = mpsc::channel(STREAM_BUFFER);
        let (gate, verified) = resume.map(Gate::new).unzip();
        let sink = Sink {
            tx,
            recorder,
            idle,
            count,
            id,
            pipeline: self.pipeline.clone(),
            seed,
            stamper: Stamper::default(),
            gate,
        };
        tokio::spawn(generate(self.pipeline.clone(), job, sink));
        if let Some(verified) = verified {
            // The stream's messages start once the regenerated answer reached the cursor.
            let checked = verified.await.unwrap_or_else(|_| Err(Status::unavailable("the resumed stream ended")));
            checked.map_err(|s| with_seed_status(s, seed))?;
        }
        Ok(with_seed(stream_of(rx), seed))
    }

    async fn list_models(&self, request: Request<ListModelsRequest>) -> Result<Response<ListModelsResponse>, Status> {
        self.pipeline.gate.caller(&request.metadata().clone().into_headers()).map_err(|e| status_of(&e))?;
        let model = Model { id: self.pipeline.settings.model.clone(), owned_by: "tandem".into() };
        Ok(Response::new(ListModelsResponse { models: vec![model] }))
    }
}

/// The names whose health is reported: the whole server ("") and the frontend.
const HEALTH_NAMES: [&str; 2] = ["", SERVICE_NAME];

async fn set_health(reporter: &HealthReporter, status: ServingStatus) {
    for name in HEALTH_NAMES {
        reporter.set_service_status(name, status).await;
    }
}

/// Owns the health status: `SERVING` while a decode worker answers ready
/// (what HTTP `/ready` checks), re-checked every [`HEALTH_INTERVAL`];
/// `NOT_SERVING` otherwise and, for good, once `stop` is cancelled.
/// Watchers hear of changes only.
async fn track_readiness(pipeline: Arc<Pipeline>, reporter: HealthReporter, stop: CancellationToken) {
    let mut last = None;
    let mut tick = tokio::time::interval(HEALTH_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let ready = tokio::select! {
            () = stop.cancelled() => break,
            ready = async { tick.tick().await; pipeline.ready().await } => ready,
        };
        let status = if ready { ServingStatus::Serving } else { ServingStatus::NotServing };
        if last != Some(status) {
            set_health(&reporter, status).await;
            last = Some(status);
        }
    }
    set_health(&reporter, ServingStatus::NotServing).await;
}

type WatchStream = Pin<Box<dyn tokio_stream::Stream<Item = Result<HealthCheckResponse, Status>> + Send>>;

/// tonic-health's service, except that `Watch` streams end once the server
/// drains (after a last `NOT_SERVING`): they never end on their own, and a
/// graceful shutdown waits for every open stream, so one watching prober
/// would otherwise hold the coordinator for the whole grace.
struct DrainingHealth {
    inner: HealthService,
    drained: CancellationToken,
}

#[tonic::async_trait]
impl Health for DrainingHealth {
    type WatchStream = WatchStream;

    async fn check(&self, request: Request<HealthCheckRequest>) -> Result<Response<HealthCheckResponse>, Status> {
        self.inner.check(request).await
    }

    async fn watch(&self, request: Request<HealthCheckRequest>) -> Result<Response<WatchStream>, Status> {
        use futures_util::StreamExt;
        let updates = self.inner.watch(request).await?.into_inner();
        let last =
            HealthCheckResponse { status: tonic_health::pb::health_check_response::ServingStatus::NotServing as i32 };
        let stream = updates
            .take_until(self.drained.clone().cancelled_owned())
            .chain(futures_util::stream::once(std::future::ready(Ok(last))));
        Ok(Response::new(Box::pin(stream)))
    }
}

/// Why the gRPC frontend could not serve.
#[derive(Debug, thiserror::Error)]
pub enum GrpcError {
    /// The reflection service refused a descriptor set (a build fault).
    #[error("gRPC reflection: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
    /// The server failed (the listener broke).
    #[error("serving gRPC: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// The reflection builder: every file of ours and health's, advertising only
/// the services this server runs (the worker API's files are in the same
/// descriptor set but not served here).
fn reflection() -> tonic_reflection::server::Builder<'static> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .with_service_name(SERVICE_NAME)
        .with_service_name(tonic_health::pb::health_server::SERVICE_NAME)
        .with_service_name(tonic_reflection::pb::v1::server_reflection_server::SERVICE_NAME)
        .with_service_name(tonic_reflection::pb::v1alpha::server_reflection_server::SERVICE_NAME)
}

/// gRPC-only settings (the shared ones are in [`crate::pipeline::Settings`]).
#[derive(Debug, Clone)]
pub struct GrpcSettings {
    /// Largest request message, bytes: the HTTP body cap, so both frontends
    /// take the same prompts. A larger one is refused `RESOURCE_EXHAUSTED`
    /// (`request_too_large`) before it is decoded.
    pub max_message_bytes: usize,
    /// How long a finished answer stays attached to its idempotency key (HTTP's window).
    pub idempotency_window: Duration,
    /// Most idempotency keys remembered at once (a new key beyond: `UNAVAILABLE`).
    pub idempotency_max_keys: usize,
    /// HTTP/2 PING interval on an idle connection, and how long its answer may take
    /// before the connection is closed: a dead client's connection does not linger.
    pub keepalive: Duration,
    pub keepalive_timeout: Duration,
    /// A connection this old is sent GOAWAY: its client opens a new one, which its
    /// balancer may place on another coordinator (long-lived channels rebalance).
    /// Calls in flight on it run on to their end, each bounded by its own deadline.
    /// (tonic's `max_connection_age_grace` is not used: with it set, tonic sends no
    /// GOAWAY at the age and closes the connection, streams and all, after age plus
    /// grace.)
    pub max_connection_age: Duration,
}

/// gRPC's status table for the two request faults tonic finds itself, in tonic's
/// words (pinned by this module's tests against tonic's own answers).
const TONIC_TOO_LARGE: &str = "Error, decoded message length too large: found ";
const TONIC_NO_MESSAGE: &str = "Missing request message.";

/// The status gRPC's table gives a fault tonic reports otherwise: a request message
/// over the cap is `RESOURCE_EXHAUSTED` (`request_too_large`, tonic says
/// `OUT_OF_RANGE`), a call without its one request message `UNIMPLEMENTED`
/// (`cardinality_violation`, tonic says `INTERNAL`); with the HTTP status and code
/// it counts under. `None` for any other status.
fn by_the_table(code: Code, message: &str) -> Option<(Status, u16, &'static str)> {
    match code {
        Code::OutOfRange => {
            let rest = message.strip_prefix(TONIC_TOO_LARGE)?;
            let mut numbers = rest.split(|c: char| !c.is_ascii_digit()).filter_map(|n| n.parse::<usize>().ok());
            let (size, limit) = (numbers.next()?, numbers.next()?);
            let e = Error::BodyTooLarge { limit, size: Some(size) };
            Some((status_of(&e), crate::http::error::status(&e).as_u16(), e.code()))
        }
        Code::Internal if message == TONIC_NO_MESSAGE => {
            let mut md = MetadataMap::new();
            md.insert(ERROR_CODE_KEY, MetadataValue::from_static(CARDINALITY_VIOLATION));
            let status = Status::with_metadata(
                Code::Unimplemented,
                format!("{CARDINALITY_VIOLATION}: this method takes exactly one request message; the call sent none"),
                md,
            );
            Some((status, 400, CARDINALITY_VIOLATION))
        }
        _ => None,
    }
}

/// The code of a call that broke its method's message count (gRPC only).
pub const CARDINALITY_VIOLATION: &str = "cardinality_violation";

/// Rewrites the answers tonic gives before our handler runs ([`by_the_table`]),
/// which are trailers-only responses (the status in the headers), and counts them.
#[derive(Clone)]
struct StatusTable<S> {
    inner: S,
}

impl<S, B, R> tower::Service<http::Request<B>> for StatusTable<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<R>;
    type Error = S::Error;
    type Future = Pin<Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let frontend = req.uri().path().strip_prefix('/').is_some_and(|p| p.starts_with(SERVICE_NAME));
        let answer = self.inner.call(req);
        Box::pin(async move {
            let mut response = answer.await?;
            if !frontend {
                return Ok(response);
            }
            let Some(status) = Status::from_header_map(response.headers()) else { return Ok(response) };
            if let Some((fixed, http_status, code)) = by_the_table(status.code(), status.message()) {
                metrics::request_finished(API, http_status, code);
                let headers = response.headers_mut();
                for name in ["grpc-status", "grpc-message", "grpc-status-details-bin"] {
                    headers.remove(name);
                }
                if let Err(e) = fixed.add_header(headers) {
                    tracing::warn!(error = %e, "writing a gRPC status");
                }
            }
            Ok(response)
        })
    }
}

/// Serves the frontend, health and reflection on `listener` until `stop` is
/// cancelled: then health turns `NOT_SERVING`, health watches end, new
/// calls are refused and in-flight ones finish (the caller bounds how long
/// it waits).
pub async fn serve(
    pipeline: Arc<Pipeline>,
    settings: GrpcSettings,
    listener: tokio::net::TcpListener,
    stop: CancellationToken,
) -> Result<(), GrpcError> {
    use futures_util::StreamExt;
    let v1 = reflection().build_v1()?;
    let v1alpha = reflection().build_v1alpha()?;
    let frontend = FrontendServer::new(FrontendService::new(pipeline.clone(), &settings))
        .max_decoding_message_size(settings.max_message_bytes);
    let reporter = HealthReporter::new();
    // Not serving until a decode worker answers ready.
    set_health(&reporter, ServingStatus::NotServing).await;
    let drained = CancellationToken::new();
    let health = HealthServer::new(DrainingHealth {
        inner: HealthService::from_health_reporter(reporter.clone()),
        drained: drained.clone(),
    });
    let tracker = tokio::spawn(track_readiness(pipeline, reporter, stop.clone()));
    let shutdown = async move {
        stop.cancelled().await;
        // Probes see NOT_SERVING before the listener closes; then health
        // watches end so that only real work holds the drain.
        let _ = tracker.await;
        drained.cancel();
    };
    let incoming = registry::grpc::incoming(listener).inspect(|accepted| {
        if accepted.is_ok() {
            metrics::grpc_connection_accepted();
        }
    });
    tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(settings.keepalive))
        .http2_keepalive_timeout(Some(settings.keepalive_timeout))
        .max_connection_age(settings.max_connection_age)
        .layer(tower::layer::layer_fn(|inner| StatusTable { inner }))
        .add_service(health)
        .add_service(v1)
        .add_service(v1alpha)
        .add_service(frontend)
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeout_values() {
        assert_eq!(parse_grpc_timeout("50m"), Some(Duration::from_millis(50)));
        assert_eq!(parse_grpc_timeout("2S"), Some(Duration::from_secs(2)));
        assert_eq!(parse_grpc_timeout("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_grpc_timeout("3M"), Some(Duration::from_secs(180)));
        assert_eq!(parse_grpc_timeout("7u"), Some(Duration::from_micros(7)));
        assert_eq!(parse_grpc_timeout("99999999n"), Some(Duration::from_nanos(99_999_999)));
        for bad in ["", "m", "5", "5x", "123456789S", "-1S", "1.5S", "5 m", "5é"] {
            assert_eq!(parse_grpc_timeout(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_plain_invalid_field_has_its_code_and_names_its_field() {
        let s = status_of(&Error::invalid("temperature", "too hot"));
        assert_eq!(s.code(), Code::InvalidArgument);
        assert_eq!(s.message(), "invalid_value: too hot");
        assert_eq!(s.metadata().get(ERROR_PARAM_KEY).and_then(|v| v.to_str().ok()), Some("temperature"));
        assert_eq!(s.metadata().get(ERROR_TYPE_KEY).and_then(|v| v.to_str().ok()), Some("invalid_request_error"));
        assert_eq!(s.metadata().get(ERROR_CODE_KEY).and_then(|v| v.to_str().ok()), Some("invalid_value"));
        assert!(s.metadata().get(RETRY_AFTER_KEY).is_none());
    }
}
