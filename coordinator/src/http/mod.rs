//! The OpenAI-compatible HTTP frontend (axum).
//!
//! Routes: `GET /v1/models`, `POST /v1/completions`,
//! `POST /v1/chat/completions` (JSON or SSE with `stream: true`),
//! `POST /tokenize`, `POST /detokenize`, `GET /health` (liveness),
//! `GET /ready` (membership within its stale bound and a ready prefill/decode
//! pair, or a ready decode worker of a group without prefill workers),
//! `GET /metrics` (Prometheus). With API keys configured, every route but
//! health, ready and metrics needs one ([`crate::auth`]).
//!
//! A request's walk here: API key (401), size cap and content type, JSON, model name,
//! validation (400 naming the field), tokenization (once, here), context
//! check and deadline (the `x-request-timeout-ms` header or the configured
//! default); then [`Pipeline::run`] admits it and starts it on the workers,
//! and this module shapes the run's text pieces as OpenAI JSON or SSE.
//! A client that goes away drops the run, which cancels the request on the
//! decode and prefill workers and frees its KV.
//!
//! A client that stops reading a streamed answer: each SSE event must be
//! taken within `stream_idle_timeout` (the pipeline's setting), else the
//! answer ends, which cancels the request on the workers; and a connection
//! whose socket accepts no byte for that long is closed
//! ([`StallGuardListener`]). So a stuck reader holds neither KV nor an
//! admission slot past the timeout, and what the coordinator buffers for it
//! is bounded (a 16-event channel plus hyper's write buffer).
//!
//! `Idempotency-Key`: the first request with a key runs and records what it
//! sends; a retry with the same key and body gets that answer (replayed,
//! live if still running) instead of running twice ([`crate::idempotency`]).
//!
//! Every refusal or failure is a [`crate::error::Error`] until the answer is
//! written; [`error`] gives it its status, body and `Retry-After`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::Stream;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::error::Error;
use crate::idempotency::{Idempotency, Recorder, Replay, Replayed};
use crate::metrics;
use crate::openai;
use crate::pipeline::{
    priority_of, send_within, Claimed, Draft, Entered, Event as RunEvent, Job, Pipeline, PromptInput, Run, TokenLogprob,
};
use crate::tenants::Pass;

pub mod error;
mod serve;
mod stall;
pub use serve::{serve, ServeSettings};
pub use stall::{StallGuard, StallGuardListener};

/// HTTP-only settings (the shared ones are in [`crate::pipeline::Settings`]).
#[derive(Debug, Clone)]
pub struct HttpSettings {
    /// Largest request body, bytes (413 beyond).
    pub max_body_bytes: usize,
    /// How long a finished answer stays attached to its `Idempotency-Key`.
    pub idempotency_window: Duration,
    /// Most keys remembered at once (503 for a new key beyond, never a silent run).
    pub idempotency_max_keys: usize,
    /// The whole body must arrive within this long of the handler asking
    /// for it (408 `request_timeout` and the connection closed beyond).
    pub body_timeout: Duration,
}

/// What an idempotent request recorded: the whole JSON answer, or one SSE
/// event's data.
#[derive(Clone, Debug)]
pub enum Recorded {
    Json(StatusCode, Value),
    Event(String),
}

/// Shared state.
pub struct App {
    pub pipeline: Arc<Pipeline>,
    pub settings: HttpSettings,
    idempotency: Arc<Idempotency<Recorded>>,
    /// Renders `/metrics`; none when no recorder is installed (library use).
    metrics: Option<metrics_exporter_prometheus::PrometheusHandle>,
}

impl App {
    pub fn new(
        pipeline: Arc<Pipeline>,
        settings: HttpSettings,
        metrics: Option<metrics_exporter_prometheus::PrometheusHandle>,
    ) -> Arc<Self> {
        let idempotency = Idempotency::new(settings.idempotency_window, settings.idempotency_max_keys);
        Arc::new(Self { pipeline, settings, idempotency, metrics })
    }

    /// The caller's name, or 401.
    fn caller(&self, headers: &HeaderMap) -> Result<String, Error> {
        self.pipeline.gate.caller(headers)
    }
}

pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/health", get(|| async { Json(json!({"status": "ok"})) }))
        .route("/ready", get(ready))
        .route("/metrics", get(prometheus))
        // The cap is enforced while reading (`read_body`), with our error body.
        .layer(DefaultBodyLimit::disable())
        .with_state(app)
}

fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

async fn models(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    if let Err(e) = app.caller(&headers) {
        return e.into_response();
    }
    Json(json!({
        "object": "list",
        "data": [{"id": app.pipeline.settings.model, "object": "model", "created": 0, "owned_by": "tandem"}]
    }))
    .into_response()
}

async fn ready(State(app): State<Arc<App>>) -> Response {
    match app.pipeline.readiness() {
        Ok(()) => Json(json!({"status": "ready"})).into_response(),
        Err(why) => Error::NotReady(why).into_response(),
    }
}

async fn prometheus(State(app): State<Arc<App>>) -> Response {
    let Some(handle) = &app.metrics else {
        return (StatusCode::NOT_FOUND, "no metrics recorder is installed\n").into_response();
    };
    // Gauges read at scrape time, so they are exact when read.
    let s = app.pipeline.admission.stats();
    metrics::queue(s.queued, s.queued_tokens, s.running);
    app.pipeline.cluster.breakers().export();
    let (decode, prefill) = app.pipeline.cluster.stale_workers();
    metrics::workers_stale("decode", decode);
    metrics::workers_stale("prefill", prefill);
    let (decode, prefill) = app.pipeline.cluster.load_known_workers();
    metrics::workers_load_known("decode", decode);
    metrics::workers_load_known("prefill", prefill);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], handle.render()).into_response()
}

/// Reads the body, refusing one over the cap (413) without buffering more
/// than the cap, and one that does not arrive within the body timeout (408).
async fn read_body(app: &App, body: Body) -> Result<Bytes, Error> {
    let cap = app.settings.max_body_bytes;
    let after = app.settings.body_timeout;
    match tokio::time::timeout(after, axum::body::to_bytes(body, cap)).await {
        Ok(read) => read.map_err(|_| Error::BodyTooLarge { limit: cap, size: None }),
        Err(_) => {
            metrics::http_timeout("body");
            Err(Error::BodyTimeout { after })
        }
    }
}

/// Content type, size cap and JSON, in that order.
fn parse_json<T: serde::de::DeserializeOwned>(app: &App, headers: &HeaderMap, body: &Bytes) -> Result<T, Error> {
    let ct = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
    if !ct.split(';').next().is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json")) {
        return Err(Error::UnsupportedMediaType { content_type: ct.to_owned() });
    }
    if body.len() > app.settings.max_body_bytes {
        return Err(Error::BodyTooLarge { limit: app.settings.max_body_bytes, size: Some(body.len()) });
    }
    let text = std::str::from_utf8(body)
        .map_err(|e| Error::InvalidJson { message: format!("the body is not valid UTF-8: {e}") })?;
    serde_json::from_str(text).map_err(|e| Error::InvalidJson { message: format!("invalid JSON: {e}") })
}

/// A header as text (400 naming it when it is not).
fn header_str<'h>(headers: &'h HeaderMap, name: &str) -> Result<Option<&'h str>, Error> {
    headers
        .get(name)
        .map(|v| v.to_str().map_err(|_| Error::invalid(name, "the header is not visible ASCII")))
        .transpose()
}

/// The deadline: the earlier of `x-request-timeout-ms` (relative to
/// arrival) and `x-request-deadline` (absolute, Unix time in milliseconds,
/// as the client's clock reads it), else the configured default. A deadline
/// that has already passed is a 504 at once: no work starts for it.
fn deadline(app: &App, headers: &HeaderMap, arrived: Instant) -> Result<Instant, Error> {
    let positive_ms = |name: &str| -> Result<Option<u64>, Error> {
        match header_str(headers, name)? {
            None => Ok(None),
            Some(v) => match v.trim().parse::<u64>() {
                Ok(ms) if ms > 0 => Ok(Some(ms)),
                _ => Err(Error::invalid(name, "must be a positive integer of milliseconds")),
            },
        }
    };
    let timeout = positive_ms("x-request-timeout-ms")?.map(|ms| arrived + Duration::from_millis(ms));
    let absolute = match positive_ms("x-request-deadline")? {
        None => None,
        Some(ms) => {
            let at = UNIX_EPOCH + Duration::from_millis(ms);
            match at.duration_since(SystemTime::now()) {
                Ok(left) => Some(Instant::now() + left),
                Err(_) => return Err(Error::Deadline),
            }
        }
    };
    Ok(match (timeout, absolute) {
        (None, None) => arrived + app.pipeline.settings.default_timeout,
        (Some(t), None) | (None, Some(t)) => t,
        (Some(a), Some(b)) => a.min(b),
    })
}

/// Which OpenAI endpoint a request came in on: it decides the answer's shape.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Api {
    Completions,
    Chat,
}

impl Api {
    fn name(self) -> &'static str {
        match self {
            Api::Completions => "completions",
            Api::Chat => "chat",
        }
    }
}

/// What a generation route reads from its parsed body, before any token
/// is counted.
struct Parsed {
    input: PromptInput,
    /// The prompt's field.
    param: &'static str,
    spec: openai::Spec,
    /// The field `max_tokens` came in ([`max_tokens_param`]).
    max_tokens_param: &'static str,
    priority: Option<Value>,
}

/// The field `max_tokens` came in.
fn max_tokens_param(s: &openai::Sampling) -> &'static str {
    if s.max_completion_tokens.is_some() {
        "max_completion_tokens"
    } else {
        "max_tokens"
    }
}

/// The walk both generation routes share, in the pipeline's order
/// ([`crate::pipeline::walk`]): the key and its tenant's in-flight and rate
/// limits (401, 429) before the body is read; the body (413, 408); the
/// `Idempotency-Key` (a retry is answered from the first request with it);
/// then `parse` validates the request (with the tenant's default
/// `max_tokens`), [`Pipeline::prepare`] tokenizes it within the tenant's caps
/// and budgets and gives it its seed, and [`respond`] admits, routes and
/// answers it.
async fn generation<R: serde::de::DeserializeOwned>(
    app: Arc<App>,
    api: Api,
    headers: HeaderMap,
    body: Body,
    parse: impl FnOnce(&Pipeline, &Pass, R) -> Result<Parsed, Error>,
) -> Response {
    let entered = match app.pipeline.enter(&headers) {
        Ok(e) => e,
        Err(e) => return finished(api, e.into_response()),
    };
    let body = match read_body(&app, body).await {
        Ok(b) => b,
        Err(e) => return finished(api, e.into_response()),
    };
    let claimed = header_str(&headers, "idempotency-key").and_then(|key| {
        let mut digest = body.to_vec();
        digest.extend_from_slice(api.name().as_bytes());
        entered.claim(&app.idempotency, key, &digest)
    });
    let (entered, key, recorder) = match claimed {
        Ok(Claimed::Fresh { entered, key, recorder }) => (entered, key, recorder),
        Ok(Claimed::Replay(replay)) => {
            // The retry's stream flag is its body's, which equals the first request's.
            let stream = serde_json::from_slice::<Value>(&body).is_ok_and(|v| v["stream"] == json!(true));
            let idle = app.pipeline.settings.stream_idle_timeout;
            return finished(api, replay_answer(replay, stream, idle).await);
        }
        Err(e) => return finished(api, e.into_response()),
    };
    let Entered { pass, arrived } = entered;
    let job = async {
        let parsed = parse(&app.pipeline, &pass, parse_json(&app, &headers, &body)?)?;
        let priority = priority_of(header_str(&headers, "x-priority")?, parsed.priority.as_ref())?;
        let draft = Draft {
            max_tokens_param: parsed.max_tokens_param,
            input: parsed.input,
            param: parsed.param,
            spec: parsed.spec,
            priority,
            deadline: deadline(&app, &headers, arrived)?,
            arrived,
            idempotency_key: key,
        };
        app.pipeline.prepare(pass, draft).await
    }
    .await;
    respond(app, api, job, recorder).await
}

async fn completions(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    generation(app, Api::Completions, headers, body, |p, pass, req: openai::CompletionRequest| {
        p.check_model(req.model.as_deref())?;
        let logprobs = openai::completion_logprobs(&req.logprobs)?;
        let spec = openai::sampling(&req.sampling, logprobs, pass.default_max_tokens(p.settings.default_max_tokens))?;
        Ok(Parsed {
            input: PromptInput::Completion(req.prompt),
            param: "prompt",
            spec,
            max_tokens_param: max_tokens_param(&req.sampling),
            priority: req.sampling.priority,
        })
    })
    .await
}

async fn chat(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    generation(app, Api::Chat, headers, body, |p, pass, req: openai::ChatRequest| {
        p.check_model(req.model.as_deref())?;
        let messages = req.messages.ok_or_else(|| Error::invalid("messages", "`messages` is required"))?;
        let logprobs = openai::chat_logprobs(&req.logprobs, req.top_logprobs)?;
        let spec = openai::sampling(&req.sampling, logprobs, pass.default_max_tokens(p.settings.default_max_tokens))?;
        Ok(Parsed {
            input: PromptInput::Chat(messages),
            param: "messages",
            spec,
            max_tokens_param: max_tokens_param(&req.sampling),
            priority: req.sampling.priority,
        })
    })
    .await
}

/// Counts a finished request by its status and error code.
fn finished(api: Api, r: Response) -> Response {
    let code = if r.status().is_success() { "ok" } else { "error" };
    metrics::request_finished(api.name(), r.status().as_u16(), code);
    r
}

/// Admits and routes a prepared request (or answers its refusal) and shapes
/// its run as an OpenAI answer, streamed or whole; with `recorder` (an
/// `Idempotency-Key`) what it sends is recorded for retries. The answer's
/// `x-tandem-seed` header carries the seed it was sampled with.
async fn respond(app: Arc<App>, api: Api, job: Result<Job, Error>, recorder: Option<Recorder<Recorded>>) -> Response {
    let refused = |e: Error, recorder: Option<Recorder<Recorded>>| {
        // A refusal is kept for retries only when a retry would get it again.
        let status = error::status(&e);
        if let Some(rec) = recorder {
            rec.push(Recorded::Json(status, error::body(&e)));
            rec.finish(keeps(status));
        }
        finished(api, e.into_response())
    };
    let job = match job {
        Ok(j) => j,
        Err(e) => return refused(e, recorder),
    };
    let stream = job.spec.stream;
    let run = match app.pipeline.run(job).await {
        Ok(r) => r,
        Err(e) => {
            // A refusal after admission (no route, a deadline) is never kept: a retry may pass.
            if let Some(rec) = recorder {
                rec.finish(false);
            }
            return finished(api, e.into_response());
        }
    };
    let seed = run.seed();
    let answer = Answer {
        api,
        created: now_secs(),
        model: app.pipeline.settings.model.clone(),
        run,
        recorder,
        idle: app.pipeline.settings.stream_idle_timeout,
    };
    let mut response = if stream {
        let (tx, rx) = mpsc::channel::<Event>(16);
        tokio::spawn(answer.stream(tx));
        let events = tokio_stream::wrappers::ReceiverStream::new(rx);
        Sse::new(infallible(events)).into_response()
    } else {
        let (result, recorder) = answer.collect().await;
        let (status, body) = match result {
            Ok(body) => (StatusCode::OK, body),
            Err(e) => (error::status(&e), error::body(&e)),
        };
        if let Some(rec) = recorder {
            rec.push(Recorded::Json(status, body.clone()));
            rec.finish(keeps(status));
        }
        (status, Json(body)).into_response()
    };
    if let Ok(v) = header::HeaderValue::from_str(&seed.to_string()) {
        response.headers_mut().insert(SEED_HEADER, v);
    }
    finished(api, response)
}

/// The response header that carries the seed an answer was sampled with.
pub const SEED_HEADER: &str = "x-tandem-seed";

/// Whether a retry should get this status again rather than run anew.
fn keeps(status: StatusCode) -> bool {
    status.is_success() || (status.is_client_error() && status != StatusCode::TOO_MANY_REQUESTS)
}

/// The answer of a request that follows an earlier one with its key.
async fn replay_answer(mut replay: Replay<Recorded>, stream: bool, idle: Duration) -> Response {
    metrics::idempotent_replay(if replay.leader_finished() { "done" } else { "inflight" });
    // The first thing the original sent: a whole answer (a JSON body, or a streamed
    // request's refusal, which went out as JSON with its status) is replayed as it was.
    let first = replay.next().await;
    let first = match first {
        Replayed::Item(Recorded::Json(status, body)) => return (status, Json(body)).into_response(),
        other if !stream => {
            drop(other);
            return Error::IdempotentOriginalFailed.into_response();
        }
        other => other,
    };
    let (tx, rx) = mpsc::channel::<Event>(16);
    tokio::spawn(async move {
        let mut first = Some(first);
        loop {
            let next = match first.take() {
                Some(f) => f,
                None => replay.next().await,
            };
            let event = match next {
                Replayed::Item(Recorded::Event(data)) => Event::default().data(data),
                Replayed::Item(Recorded::Json(_, body)) => Event::default().data(body.to_string()),
                Replayed::End => return,
                Replayed::Abandoned => Event::default().data(error::body(&Error::IdempotentOriginalFailed).to_string()),
            };
            if !send_within(&tx, event, idle, "http").await {
                return;
            }
        }
    });
    Sse::new(infallible(tokio_stream::wrappers::ReceiverStream::new(rx))).into_response()
}

fn infallible(s: impl Stream<Item = Event>) -> impl Stream<Item = Result<Event, Infallible>> {
    use futures_util::StreamExt;
    s.map(Ok)
}

/// One token's `logprobs.content[]` entry.
fn logprob_json(l: TokenLogprob) -> Value {
    let top: Vec<Value> = l.top.into_iter().map(|a| json!({"token": a.token, "logprob": a.logprob})).collect();
    json!({"token": l.token, "logprob": l.logprob, "top_logprobs": top})
}

/// A run shaped as an OpenAI answer of one endpoint.
struct Answer {
    api: Api,
    created: u64,
    model: String,
    run: Run,
    /// Set for a request with an `Idempotency-Key`: what is sent is recorded.
    recorder: Option<Recorder<Recorded>>,
    /// How long the client may leave an event untaken before the stream ends.
    idle: Duration,
}

impl Answer {
    /// Runs to the end and builds the non-streaming body; hands the
    /// recorder back for the caller to record the final answer.
    async fn collect(mut self) -> (Result<Value, Error>, Option<Recorder<Recorded>>) {
        let recorder = self.recorder.take();
        (self.body().await, recorder)
    }

    async fn body(&mut self) -> Result<Value, Error> {
        let c = self.run.collect().await?;
        let usage = self.run.usage();
        let lp = self
            .run
            .logprobs()
            .then(|| json!({"content": c.logprobs.into_iter().map(logprob_json).collect::<Vec<_>>()}));
        let (text, finish, id) = (c.text, c.finish.as_str(), self.run.id());
        Ok(match self.api {
            Api::Chat => json!({
                "id": format!("chatcmpl-{id}"),
                "object": "chat.completion",
                "created": self.created,
                "model": self.model,
                "choices": [{
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": lp,
                    "finish_reason": finish,
                }],
                "usage": usage,
                "system_fingerprint": self.run.system_fingerprint(),
            }),
            Api::Completions => json!({
                "id": format!("cmpl-{id}"),
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}],
                "usage": usage,
                "system_fingerprint": self.run.system_fingerprint(),
            }),
        })
    }

    fn chunk(&self, text: Option<&str>, logprob: Option<Value>, finish: Option<&str>, first: bool) -> Value {
        let id = self.run.id();
        match self.api {
            Api::Chat => {
                let mut delta = serde_json::Map::new();
                if first {
                    delta.insert("role".into(), json!("assistant"));
                }
                if let Some(t) = text {
                    delta.insert("content".into(), json!(t));
                }
                json!({
                    "id": format!("chatcmpl-{id}"),
                    "object": "chat.completion.chunk",
                    "created": self.created,
                    "model": self.model,
                    "system_fingerprint": self.run.system_fingerprint(),
                    "choices": [{
                        "index": 0,
                        "delta": delta,
                        "logprobs": logprob.map(|l| json!({"content": [l]})),
                        "finish_reason": finish,
                    }],
                })
            }
            Api::Completions => json!({
                "id": format!("cmpl-{id}"),
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "system_fingerprint": self.run.system_fingerprint(),
                "choices": [{
                    "index": 0,
                    "text": text.unwrap_or(""),
                    "logprobs": logprob.map(|l| json!({"content": [l]})),
                    "finish_reason": finish,
                }],
            }),
        }
    }

    /// Streams SSE events until the end; a send failure means the client
    /// went away, and returning drops the run (cancelling it).
    async fn stream(mut self, tx: mpsc::Sender<Event>) {
        let mut first = true;
        if self.api == Api::Chat {
            if !self.emit(&tx, self.chunk(None, None, None, true).to_string()).await {
                return;
            }
            first = false;
        }
        let finish = loop {
            match self.run.step().await {
                Err(e) => {
                    // Headers are gone already: the error travels as an
                    // event. Not kept for idempotent retries (dropping the
                    // recorder abandons it): a retry runs anew.
                    self.recorder = None;
                    send_within(&tx, Event::default().data(error::body(&e).to_string()), self.idle, "http").await;
                    return;
                }
                Ok(RunEvent::Piece(p)) => {
                    let logprob = p.logprob.map(logprob_json);
                    if (!p.text.is_empty() || logprob.is_some())
                        && !self.emit(&tx, self.chunk(Some(&p.text), logprob, None, first).to_string()).await
                    {
                        return;
                    }
                    first = false;
                    if let Some(f) = p.finish {
                        break f;
                    }
                }
                Ok(RunEvent::End(f)) => {
                    let rest = self.run.flush();
                    if !rest.is_empty() && !self.emit(&tx, self.chunk(Some(&rest), None, None, first).to_string()).await
                    {
                        return;
                    }
                    break f;
                }
            }
        };
        let text = if self.api == Api::Chat { None } else { Some("") };
        if !self.emit(&tx, self.chunk(text, None, Some(finish.as_str()), false).to_string()).await {
            return;
        }
        if self.run.include_usage() {
            let mut u = self.chunk(text, None, None, false);
            u["choices"] = json!([]);
            u["usage"] = json!(self.run.usage());
            if !self.emit(&tx, u.to_string()).await {
                return;
            }
        }
        if self.emit(&tx, "[DONE]".to_owned()).await {
            if let Some(rec) = self.recorder.take() {
                rec.finish(true);
            }
        }
    }

    /// Records (for idempotent retries) and sends one SSE event; false when
    /// the client went away or took no event within the idle timeout.
    async fn emit(&self, tx: &mpsc::Sender<Event>, data: String) -> bool {
        if let Some(rec) = &self.recorder {
            rec.push(Recorded::Event(data.clone()));
        }
        send_within(tx, Event::default().data(data), self.idle, "http").await
    }
}

async fn tokenize(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    // Tokenizing is the expensive part: the tenant's request limits apply.
    let pass = match app.pipeline.gate.enter(&headers) {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    let body = match read_body(&app, body).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let r = async {
        let v: Value = parse_json(&app, &headers, &body)?;
        let input = if let Some(m) = v.get("messages") {
            let messages: Vec<openai::Message> = serde_json::from_value(m.clone())
                .map_err(|e| Error::invalid("messages", format!("invalid messages: {e}")))?;
            PromptInput::Chat(messages)
        } else {
            PromptInput::Completion(v.get("prompt").cloned())
        };
        let ids = app.pipeline.tokenize(&pass.tenant().name, input).await?;
        Ok::<_, Error>(json!({"tokens": ids, "count": ids.len(), "max_model_len": app.pipeline.context}))
    }
    .await;
    drop(pass);
    match r {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn detokenize(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    if let Err(e) = app.caller(&headers) {
        return e.into_response();
    }
    let body = match read_body(&app, body).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let r = (|| {
        let v: Value = parse_json(&app, &headers, &body)?;
        let ids: Vec<u32> = v
            .get("tokens")
            .and_then(|t| serde_json::from_value(t.clone()).ok())
            .ok_or_else(|| Error::invalid("tokens", "`tokens` must be a list of token ids"))?;
        let tokenizer = &app.pipeline.tokenizer;
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= tokenizer.vocab_size()) {
            return Err(Error::invalid("tokens", format!("token id {bad} is outside the vocabulary")));
        }
        let text = tokenizer.decode(&ids, false).map_err(|e| Error::invalid("tokens", e.to_string()))?;
        Ok(json!({"prompt": text}))
    })();
    match r {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}
