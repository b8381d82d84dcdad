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

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderMap, Method, StatusCode, Uri, Version};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Map, Value};

use crate::cursor::Cursor;
use crate::error::Error;
use crate::idempotency::Idempotency;
use crate::metrics;
use crate::openai;
use crate::pipeline::{derived_seed, priority_of, Claimed, Draft, Entered, Pipeline, PromptInput};
use crate::prompt;
use crate::retries::Identity;
use crate::tenants::Pass;

mod answer;
pub mod error;
mod serve;
mod stall;
pub use answer::SEED_HEADER;
use answer::{replay_answer, respond};
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
    /// Whether the client port answers `GET /metrics` (false: only
    /// [`metrics_router`]'s listener does, and the client port answers 404).
    pub metrics_on_client_port: bool,
}

/// What an idempotent request recorded: the whole JSON answer, or one SSE
/// event's data.
#[derive(Clone, Debug)]
pub enum Recorded {
    Json(StatusCode, Value),
    /// One SSE event: its cursor (`id:`) and data.
    Event {
        id: String,
        data: String,
    },
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

/// Every route and the methods it answers: the `Allow` of a 405.
const ROUTES: [(&str, &str); 8] = [
    ("/v1/models", "GET, HEAD"),
    ("/v1/completions", "POST"),
    ("/v1/chat/completions", "POST"),
    ("/tokenize", "POST"),
    ("/detokenize", "POST"),
    ("/health", "GET, HEAD"),
    ("/ready", "GET, HEAD"),
    ("/metrics", "GET, HEAD"),
];

/// Longest path an error message repeats, bytes.
const MAX_ECHOED_PATH: usize = 128;

/// The client port's fallback: [`unrouted`] over [`ROUTES`] (less `/metrics` when
/// it is served on a listener of its own).
async fn no_route(State(app): State<Arc<App>>, method: Method, uri: Uri) -> Response {
    let served = |p: &str| p != "/metrics" || app.settings.metrics_on_client_port;
    unrouted(ROUTES.iter().filter(|(p, _)| served(p)), &method, &uri)
}

/// A request none of `routes` takes: 405 with `Allow` on one of their paths, else
/// 404; both with the OpenAI error body.
fn unrouted<'a>(
    mut routes: impl Iterator<Item = &'a (&'static str, &'static str)>,
    method: &Method,
    uri: &Uri,
) -> Response {
    let path = uri.path();
    let mut echoed = path.chars().take(MAX_ECHOED_PATH).collect::<String>();
    if echoed.len() < path.len() {
        echoed.push_str("...");
    }
    let method = method.as_str().chars().take(16).collect();
    match routes.find(|(p, _)| *p == path) {
        Some((_, allowed)) => Error::MethodNotAllowed { method, path: echoed, allowed }.into_response(),
        None => Error::UnknownRoute { method, path: echoed }.into_response(),
    }
}

/// Liveness: 200 whenever the process is up.
async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

/// RFC 9112 section 3.2: an HTTP/1.1 request without a `Host`, any request with
/// more than one, or one whose value is not `host[:port]`, is answered 400.
fn check_host(version: Version, headers: &HeaderMap) -> Result<(), Error> {
    let mut hosts = headers.get_all(header::HOST).iter();
    match (hosts.next(), hosts.next()) {
        (Some(_), Some(_)) => Err(Error::invalid("host", "the request has more than one Host header (RFC 9112, 3.2)")),
        (None, _) if version == Version::HTTP_11 => {
            Err(Error::invalid("host", "an HTTP/1.1 request must have a Host header (RFC 9112, 3.2)"))
        }
        (None, _) => Ok(()),
        (Some(v), None) => {
            // Empty is allowed: a target with no authority (RFC 9112, 3.2).
            let ok = v.is_empty()
                || v.to_str().is_ok_and(|h| !h.contains('@') && h.parse::<axum::http::uri::Authority>().is_ok());
            if ok {
                Ok(())
            } else {
                Err(Error::invalid("host", "the Host header is not a valid host[:port] (RFC 9112, 3.2)"))
            }
        }
    }
}

async fn host_rule(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    match check_host(req.version(), req.headers()) {
        Ok(()) => next.run(req).await,
        Err(e) => e.into_response(),
    }
}

/// Once the coordinator drains, every answer closes its connection
/// (`Connection: close`): the client's next request opens a new one, which a
/// front sends to another coordinator.
async fn closing(State(app): State<Arc<App>>, mut r: Response) -> Response {
    if app.pipeline.admission.is_closed() {
        r.headers_mut().insert(header::CONNECTION, header::HeaderValue::from_static("close"));
    }
    r
}

pub fn router(app: Arc<App>) -> Router {
    let with_metrics = app.settings.metrics_on_client_port;
    let router = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/health", get(health))
        .route("/ready", get(ready));
    let router = if with_metrics { router.route("/metrics", get(prometheus)) } else { router };
    router
        .fallback(no_route)
        .method_not_allowed_fallback(no_route)
        // The cap is enforced while reading (`read_body`), with our error body.
        .layer(DefaultBodyLimit::disable())
        .layer(axum::middleware::from_fn(host_rule))
        .layer(axum::middleware::map_response_with_state(app.clone(), closing))
        .with_state(app)
}

/// The metrics listener's routes (`--metrics-addr`): `GET /metrics` and
/// `/health`; anything else 404/405 with the OpenAI error body. No API key: keep the
/// listener where only the scraper reaches it (the pack's NetworkPolicy does).
pub fn metrics_router(app: Arc<App>) -> Router {
    Router::new()
        .route("/metrics", get(prometheus))
        .route("/health", get(health))
        .fallback(metrics_no_route)
        .method_not_allowed_fallback(metrics_no_route)
        .with_state(app)
}

/// The metrics listener's routes: the `Allow` of its 405.
const METRICS_ROUTES: [(&str, &str); 2] = [("/metrics", "GET, HEAD"), ("/health", "GET, HEAD")];

async fn metrics_no_route(method: Method, uri: Uri) -> Response {
    unrouted(METRICS_ROUTES.iter(), &method, &uri)
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

/// Reads the body: refused at once (413, before a byte of it is read and before
/// `100 Continue` is sent) when its `Content-Length` is over the cap; refused while
/// reading when a chunked one passes the cap (413, never buffering more than the cap);
/// 400 when its framing breaks; 408 when it does not arrive within the body timeout.
async fn read_body(app: &App, headers: &HeaderMap, body: Body) -> Result<Bytes, Error> {
    let cap = app.settings.max_body_bytes;
    let declared = headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if let Some(len) = declared.filter(|&len| len > cap as u64) {
        return Err(Error::BodyTooLarge { limit: cap, size: Some(usize::try_from(len).unwrap_or(usize::MAX)) });
    }
    let after = app.settings.body_timeout;
    match tokio::time::timeout(after, collect_body(body, cap)).await {
        Ok(read) => read,
        Err(_) => {
            metrics::http_timeout("body");
            Err(Error::BodyTimeout { after })
        }
    }
}

/// The whole body, at most `cap` bytes.
async fn collect_body(body: Body, cap: usize) -> Result<Bytes, Error> {
    use futures_util::StreamExt;
    let mut frames = body.into_data_stream();
    let mut out = Vec::new();
    while let Some(frame) = frames.next().await {
        let data = frame.map_err(|e| Error::InvalidBody { message: e.to_string() })?;
        if out.len() + data.len() > cap {
            return Err(Error::BodyTooLarge { limit: cap, size: None });
        }
        out.extend_from_slice(&data);
    }
    Ok(Bytes::from(out))
}

/// Content type, size cap and JSON, in that order: the body's object.
fn parse_json(app: &App, headers: &HeaderMap, body: &Bytes) -> Result<Map<String, Value>, Error> {
    let ct = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
    if !ct.split(';').next().is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json")) {
        return Err(Error::UnsupportedMediaType { content_type: ct.to_owned() });
    }
    if body.len() > app.settings.max_body_bytes {
        return Err(Error::BodyTooLarge { limit: app.settings.max_body_bytes, size: Some(body.len()) });
    }
    let text = std::str::from_utf8(body)
        .map_err(|e| Error::InvalidJson { message: format!("the body is not valid UTF-8: {e}") })?;
    match serde_json::from_str(text) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(Error::InvalidJson { message: "the body must be a JSON object".into() }),
        Err(e) => Err(Error::InvalidJson { message: format!("invalid JSON: {e}") }),
    }
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
/// as the client's clock reads it), else the configured default; never more than
/// `--max-request-timeout-ms` after arrival. A deadline that has already passed is
/// a 504 at once: no work starts for it.
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
    let at = match (timeout, absolute) {
        (None, None) => arrived + app.pipeline.settings.default_timeout,
        (Some(t), None) | (None, Some(t)) => t,
        (Some(a), Some(b)) => a.min(b),
    };
    Ok(app.pipeline.capped(arrived, at))
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
    priority: Option<String>,
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
async fn generation(
    app: Arc<App>,
    api: Api,
    headers: HeaderMap,
    body: Body,
    parse: impl FnOnce(&Pipeline, &Pass, Map<String, Value>) -> Result<Parsed, Error>,
) -> Response {
    let count = Unanswered(Some(api));
    let pipeline = app.pipeline.clone();
    let (r, id) = walk(app, api, headers, body, parse).await;
    // The retry gate learns when a retry of it may come (its Retry-After).
    let retry_after = r.headers().get(header::RETRY_AFTER).and_then(|v| v.to_str().ok());
    let code = r.extensions().get::<error::ErrorCode>().map(|c| c.0);
    pipeline.retries.answered(id.as_ref(), retry_after, code);
    count.answered(&r);
    r
}

/// Counts a generation request once in `tandem_coordinator_requests_total`: by the
/// status and error code of its answer when the answer starts (a streamed one's
/// status is its head's), or as `499 client_closed` when its client went away
/// before any answer (the handler is dropped).
struct Unanswered(Option<Api>);

impl Unanswered {
    fn answered(mut self, r: &Response) {
        if let Some(api) = self.0.take() {
            let code = match r.extensions().get::<error::ErrorCode>() {
                Some(error::ErrorCode(code)) => code,
                None if r.status().is_success() => "ok",
                // A recorded refusal replayed for an Idempotency-Key.
                None => "replayed",
            };
            metrics::request_finished(api.name(), r.status().as_u16(), code);
        }
    }
}

impl Drop for Unanswered {
    fn drop(&mut self) {
        if let Some(api) = self.0.take() {
            metrics::request_finished(api.name(), 499, "client_closed");
        }
    }
}

/// The walk of one generation request, and the request's identity for the retry
/// gate once it is known (by its key from the start, else once its body is read).
async fn walk(
    app: Arc<App>,
    api: Api,
    headers: HeaderMap,
    body: Body,
    parse: impl FnOnce(&Pipeline, &Pass, Map<String, Value>) -> Result<Parsed, Error>,
) -> (Response, Option<Identity>) {
    let key = header_str(&headers, "idempotency-key").ok().flatten();
    let entered = match app.pipeline.enter(&headers) {
        Ok(e) => e,
        Err(e) => {
            // Refused before the body (a tenant's rate or count): known only by its key.
            let id = key.zip(app.caller(&headers).ok()).map(|(k, caller)| Identity::keyed(&caller, api.name(), k));
            return (e.into_response(), id);
        }
    };
    let body = match read_body(&app, &headers, body).await {
        Ok(b) => b,
        Err(e) => return (e.into_response(), None),
    };
    let id = Identity::of(entered.pass.caller(), api.name(), key, &body);
    let r = walk_known(app, api, &headers, body, entered, &id, parse).await;
    (r, Some(id))
}

/// The walk from the retry gate on (steps 3 to 8).
async fn walk_known(
    app: Arc<App>,
    api: Api,
    headers: &HeaderMap,
    body: Bytes,
    entered: Entered,
    id: &Identity,
    parse: impl FnOnce(&Pipeline, &Pass, Map<String, Value>) -> Result<Parsed, Error>,
) -> Response {
    let entered = match entered.pace(&app.pipeline, id) {
        Ok(e) => e,
        Err(e) => return e.into_response(),
    };
    let tenant = entered.pass.tenant().name.clone();
    // A stream resumed from its last event's cursor, here or at another coordinator.
    let resume = match header_str(headers, "last-event-id") {
        Ok(None) => None,
        Ok(Some(v)) => match v.parse::<Cursor>() {
            Ok(c) => Some(c),
            Err(why) => return Error::invalid("Last-Event-ID", why).into_response(),
        },
        Err(e) => return e.into_response(),
    };
    if resume.is_some() {
        // Checked on the body as sent, before the key is claimed: a refusal of the
        // header is not recorded as the key's answer.
        let v = serde_json::from_slice::<Value>(&body).unwrap_or_default();
        let key = header_str(headers, "idempotency-key").ok().flatten();
        if let Err(e) = check_resumable(v["stream"] == json!(true), v["seed"].as_u64(), key) {
            return e.into_response();
        }
    }
    let claimed = header_str(headers, "idempotency-key").and_then(|key| {
        let mut digest = body.to_vec();
        digest.extend_from_slice(api.name().as_bytes());
        Ok((key, entered.claim(&app.idempotency, key, "idempotency-key", &digest)?))
    });
    let (entered, key, recorder) = match claimed {
        Ok((_, Claimed::Fresh { entered, key, recorder })) => (entered, key, recorder),
        Ok((key, Claimed::Replay(replay))) => {
            // The retry's stream flag and seed are its body's, which equal the first
            // request's; unseeded, the seed is its key's.
            let v = serde_json::from_slice::<Value>(&body).unwrap_or_default();
            let stream = v["stream"] == json!(true);
            let seed = v["seed"].as_u64().or_else(|| Some(derived_seed(&tenant, key?)));
            let idle = app.pipeline.settings.stream_idle_timeout;
            let mut r = replay_answer(replay, stream, idle, resume).await;
            if let Some(v) = seed.and_then(|s| header::HeaderValue::from_str(&s.to_string()).ok()) {
                r.headers_mut().insert(SEED_HEADER, v);
            }
            return r;
        }
        Err(e) => return e.into_response(),
    };
    let Entered { pass, arrived } = entered;
    let job = async {
        let parsed = parse(&app.pipeline, &pass, parse_json(&app, headers, &body)?)?;
        let priority = priority_of(header_str(headers, "x-priority")?, parsed.priority.as_deref())?;
        let draft = Draft {
            max_tokens_param: parsed.max_tokens_param,
            input: parsed.input,
            param: parsed.param,
            spec: parsed.spec,
            priority,
            deadline: deadline(&app, headers, arrived)?,
            arrived,
            idempotency_key: key,
        };
        app.pipeline.prepare(pass, draft).await
    }
    .await;
    respond(app, api, job, recorder, resume).await
}

/// A request with `Last-Event-ID` must be one a coordinator can regenerate
/// exactly: streamed, and with a seed it knows (the body's, or its
/// `Idempotency-Key`'s).
fn check_resumable(stream: bool, seed: Option<u64>, key: Option<&str>) -> Result<(), Error> {
    if !stream {
        return Err(Error::invalid(
            "Last-Event-ID",
            "a cursor resumes a streamed answer; this request has no `stream: true`",
        ));
    }
    if seed.is_none() && key.is_none() {
        return Err(Error::invalid(
            "Last-Event-ID",
            "a stream is resumed by regenerating it: send the first request's Idempotency-Key, or the seed it \
             was answered with (x-tandem-seed) as `seed`",
        ));
    }
    Ok(())
}

async fn completions(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    generation(app, Api::Completions, headers, body, |p, pass, body| {
        openai::check_fields(&body, &openai::COMPLETION_FIELDS)?;
        let sampling: openai::Sampling = openai::typed(&body)?;
        let req: openai::CompletionRequest = openai::typed(&body)?;
        p.check_model(req.model.as_deref())?;
        let logprobs = openai::completion_logprobs(req.logprobs)?;
        let spec = openai::sampling(&sampling, logprobs, pass.default_max_tokens(p.settings.default_max_tokens))?;
        Ok(Parsed {
            input: prompt::completion_input(req.prompt.as_ref(), p.tokenizer.vocab_size())?,
            param: "prompt",
            spec,
            max_tokens_param: max_tokens_param(&sampling),
            priority: sampling.priority,
        })
    })
    .await
}

async fn chat(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    generation(app, Api::Chat, headers, body, |p, pass, body| {
        openai::check_fields(&body, &openai::CHAT_FIELDS)?;
        let sampling: openai::Sampling = openai::typed(&body)?;
        let req: openai::ChatRequest = openai::typed(&body)?;
        p.check_model(req.model.as_deref())?;
        let logprobs = openai::chat_logprobs(req.logprobs, req.top_logprobs)?;
        let spec = openai::sampling(&sampling, logprobs, pass.default_max_tokens(p.settings.default_max_tokens))?;
        Ok(Parsed {
            input: prompt::chat_input(req.messages.as_ref())?,
            param: "messages",
            spec,
            max_tokens_param: max_tokens_param(&sampling),
            priority: sampling.priority,
        })
    })
    .await
}

async fn tokenize(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    // Tokenizing is the expensive part: the tenant's request limits apply.
    let pass = match app.pipeline.gate.enter(&headers) {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    let body = match read_body(&app, &headers, body).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let r = async {
        let v = parse_json(&app, &headers, &body)?;
        let (input, param) = if v.contains_key("messages") {
            openai::check_fields(&v, &["model", "messages"])?;
            (prompt::chat_input(v.get("messages"))?, "messages")
        } else {
            openai::check_fields(&v, &["model", "prompt"])?;
            (prompt::completion_input(v.get("prompt"), app.pipeline.tokenizer.vocab_size())?, "prompt")
        };
        let ids = app.pipeline.tokenize(&pass.tenant().name, input, param).await?;
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
    let body = match read_body(&app, &headers, body).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let r = (|| {
        let v = parse_json(&app, &headers, &body)?;
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
