//! The OpenAI-compatible HTTP frontend (axum).
//!
//! Routes: `GET /v1/models`, `POST /v1/completions`,
//! `POST /v1/chat/completions` (JSON or SSE with `stream: true`),
//! `POST /tokenize`, `POST /detokenize`, `GET /health` (liveness),
//! `GET /ready` (a decode worker answers ready).
//!
//! A request's walk here: size cap and content type, JSON, model name,
//! validation (400 naming the field), tokenization (once, here), context
//! check, admission (a bounded number in flight; beyond it 503 +
//! Retry-After), deadline (the `x-request-timeout-ms` header or the
//! configured default, propagated to the workers; 504 when it passes), then
//! the decode worker's stream is detokenized here with stop strings applied.
//! A client that goes away drops the worker stream, which cancels the
//! request on the decode and prefill workers and frees its KV.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use engine::sampler::{FinishReason as EngineFinish, StopChecker};
use engine::tokenizer::{IncrementalDecoder as Detokenizer, Tokenizer};
use futures_util::stream::Stream;
use proto::worker::v1::{FinishReason, HealthRequest, TokenChunk};
use serde_json::{json, Value};
use tokio::sync::{mpsc, Semaphore};

use crate::cluster::{next, Cluster, Lease, Step, WorkerStream};
use crate::openai::{self, ApiError, Spec, Usage};
use crate::prompt;

/// Frontend settings.
#[derive(Debug, Clone)]
pub struct HttpSettings {
    /// The model id clients must name.
    pub model: String,
    /// Largest request body, bytes (413 beyond).
    pub max_body_bytes: usize,
    /// Requests in flight at once (503 + Retry-After beyond).
    pub max_inflight: usize,
    /// Deadline when the request sets none.
    pub default_timeout: Duration,
    /// `max_tokens` when the request sets none.
    pub default_max_tokens: u32,
}

/// Shared state.
pub struct App {
    pub tokenizer: Tokenizer,
    /// The model's context length in tokens.
    pub context: usize,
    pub cluster: Arc<Cluster>,
    pub settings: HttpSettings,
    inflight: Arc<Semaphore>,
}

impl App {
    pub fn new(tokenizer: Tokenizer, context: usize, cluster: Arc<Cluster>, settings: HttpSettings) -> Arc<Self> {
        let inflight = Arc::new(Semaphore::new(settings.max_inflight));
        Arc::new(Self { tokenizer, context, cluster, settings, inflight })
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
        // The cap is enforced while reading (`read_body`), with our error body.
        .layer(DefaultBodyLimit::disable())
        .with_state(app)
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            if let Ok(v) = HeaderValue::from_str(&s.to_string()) {
                r.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        r
    }
}

fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

async fn models(State(app): State<Arc<App>>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{"id": app.settings.model, "object": "model", "created": 0, "owned_by": "tandem"}]
    }))
}

async fn ready(State(app): State<Arc<App>>) -> Response {
    for addr in app.cluster.decode_addrs() {
        let Ok(ep) = tonic::transport::Endpoint::from_shared(format!("http://{addr}")) else { continue };
        let check = async {
            let mut c = proto::worker::v1::decode_worker_client::DecodeWorkerClient::connect(ep).await.ok()?;
            c.health(HealthRequest {}).await.ok().map(|h| h.into_inner().ready)
        };
        if let Ok(Some(true)) = tokio::time::timeout(Duration::from_secs(1), check).await {
            return Json(json!({"status": "ready"})).into_response();
        }
    }
    ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "overloaded_error", "not_ready", "no ready decode worker")
        .retry_after(1)
        .into_response()
}

/// Reads the body, refusing one over the cap (413) without buffering more than the cap.
async fn read_body(app: &App, body: Body) -> Result<Bytes, ApiError> {
    let cap = app.settings.max_body_bytes;
    axum::body::to_bytes(body, cap).await.map_err(|_| {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "request_too_large",
            format!("the body is larger than the limit of {cap} bytes"),
        )
    })
}

/// Content type, size cap and JSON, in that order.
fn parse_json<T: serde::de::DeserializeOwned>(app: &App, headers: &HeaderMap, body: &Bytes) -> Result<T, ApiError> {
    let ct = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
    if !ct.split(';').next().is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json")) {
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "invalid_request_error",
            "unsupported_media_type",
            format!("Content-Type must be application/json, got {ct:?}"),
        ));
    }
    if body.len() > app.settings.max_body_bytes {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "request_too_large",
            format!("the body is {} bytes; the limit is {}", body.len(), app.settings.max_body_bytes),
        ));
    }
    let text = std::str::from_utf8(body).map_err(|e| {
        ApiError::invalid("body", format!("the body is not valid UTF-8: {e}")).with_code("invalid_json")
    })?;
    serde_json::from_str(text)
        .map_err(|e| ApiError::invalid("body", format!("invalid JSON: {e}")).with_code("invalid_json"))
}

fn check_model(app: &App, model: &Option<String>) -> Result<(), ApiError> {
    match model {
        None => Err(ApiError::invalid("model", "`model` is required")),
        Some(m) if *m == app.settings.model => Ok(()),
        Some(m) => Err(ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("the model {m:?} does not exist; this cluster serves {:?}", app.settings.model),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
            retry_after: None,
        }),
    }
}

fn check_context(app: &App, param: &str, prompt: usize, max_tokens: u32) -> Result<(), ApiError> {
    if prompt + max_tokens as usize > app.context {
        return Err(ApiError::invalid(
            param,
            format!(
                "the prompt ({prompt} tokens) plus max_tokens ({max_tokens}) exceeds the model's context of {} tokens",
                app.context
            ),
        )
        .with_code("context_length_exceeded"));
    }
    Ok(())
}

/// The deadline: `x-request-timeout-ms`, else the default.
fn deadline(app: &App, headers: &HeaderMap) -> Result<Instant, ApiError> {
    let timeout = match headers.get("x-request-timeout-ms") {
        None => app.settings.default_timeout,
        Some(v) => match v.to_str().ok().and_then(|s| s.trim().parse::<u64>().ok()) {
            Some(ms) if ms > 0 => Duration::from_millis(ms),
            _ => return Err(ApiError::invalid("x-request-timeout-ms", "must be a positive integer of milliseconds")),
        },
    };
    Ok(Instant::now() + timeout)
}

fn unix_ms(d: Instant) -> u64 {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |n| n.as_millis() as u64);
    (now + d.saturating_duration_since(Instant::now()).as_millis() as u64).max(1)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Api {
    Completions,
    Chat,
}

/// A validated, tokenized request ready to run.
struct Job {
    api: Api,
    ids: Vec<u32>,
    spec: Spec,
    deadline: Instant,
}

async fn completions(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    let body = match read_body(&app, body).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let job = (|| {
        let req: openai::CompletionRequest = parse_json(&app, &headers, &body)?;
        check_model(&app, &req.model)?;
        let logprobs = openai::completion_logprobs(&req.logprobs)?;
        let spec = openai::sampling(&req.sampling, logprobs, app.settings.default_max_tokens)?;
        let ids = prompt::completion_tokens(&app.tokenizer, &req.prompt)?;
        check_context(&app, "prompt", ids.len(), spec.params.max_tokens)?;
        Ok::<_, ApiError>(Job { api: Api::Completions, ids, spec, deadline: deadline(&app, &headers)? })
    })();
    respond(app, job).await
}

async fn chat(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    let body = match read_body(&app, body).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let job = (|| {
        let req: openai::ChatRequest = parse_json(&app, &headers, &body)?;
        check_model(&app, &req.model)?;
        let messages =
            req.messages.as_deref().ok_or_else(|| ApiError::invalid("messages", "`messages` is required"))?;
        let logprobs = openai::chat_logprobs(&req.logprobs, req.top_logprobs)?;
        let spec = openai::sampling(&req.sampling, logprobs, app.settings.default_max_tokens)?;
        let ids = prompt::chat_tokens(&app.tokenizer, messages)?;
        check_context(&app, "messages", ids.len(), spec.params.max_tokens)?;
        Ok::<_, ApiError>(Job { api: Api::Chat, ids, spec, deadline: deadline(&app, &headers)? })
    })();
    respond(app, job).await
}

async fn respond(app: Arc<App>, job: Result<Job, ApiError>) -> Response {
    let job = match job {
        Ok(j) => j,
        Err(e) => return e.into_response(),
    };
    // Admission: a bounded number in flight; the rest are told to come back.
    let permit = match app.inflight.clone().try_acquire_owned() {
        Ok(p) => p,
        Err(_) => {
            return ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "overloaded_error",
                "overloaded",
                format!("{} requests in flight; retry later", app.settings.max_inflight),
            )
            .retry_after(1)
            .into_response()
        }
    };
    let id = app.cluster.request_id();
    let started = tokio::time::timeout_at(
        job.deadline.into(),
        app.cluster.generate(id.clone(), job.ids.clone(), &job.spec.params, unix_ms(job.deadline)),
    )
    .await;
    let (stream, lease) = match started {
        Err(_) => return deadline_error().into_response(),
        Ok(Err(e)) => return e.into_response(),
        Ok(Ok(s)) => s,
    };
    let run = Run::new(&app, &job, id, stream, lease);
    if job.spec.stream {
        let (tx, rx) = mpsc::channel::<Event>(16);
        tokio::spawn(async move {
            let _permit = permit;
            run.stream(tx).await;
        });
        let events = tokio_stream::wrappers::ReceiverStream::new(rx);
        Sse::new(infallible(events)).into_response()
    } else {
        let _permit = permit;
        match run.collect().await {
            Ok(body) => Json(body).into_response(),
            Err(e) => e.into_response(),
        }
    }
}

fn infallible(s: impl Stream<Item = Event>) -> impl Stream<Item = Result<Event, Infallible>> {
    use futures_util::StreamExt;
    s.map(Ok)
}

fn deadline_error() -> ApiError {
    ApiError::new(StatusCode::GATEWAY_TIMEOUT, "timeout_error", "deadline_exceeded", "the request's deadline passed")
}

/// One running generation: the worker stream, detokenized, with stop strings.
struct Run {
    api: Api,
    id: String,
    model: String,
    created: u64,
    app: Arc<App>,
    stream: WorkerStream,
    _lease: Lease,
    detok: Detokenizer,
    stop: Option<StopChecker>,
    deadline: Instant,
    prompt_tokens: u32,
    completion_tokens: u32,
    logprobs: bool,
    include_usage: bool,
}

/// What one worker event turned into.
struct Piece {
    text: String,
    logprob: Option<Value>,
    finish: Option<&'static str>,
}

impl Run {
    fn new(app: &Arc<App>, job: &Job, id: String, stream: WorkerStream, lease: Lease) -> Self {
        let stop = StopChecker::new(&job.spec.params, app.tokenizer.eos_ids()).ok();
        Self {
            api: job.api,
            id,
            model: app.settings.model.clone(),
            created: now_secs(),
            app: app.clone(),
            stream,
            _lease: lease,
            detok: Detokenizer::new(),
            stop,
            deadline: job.deadline,
            prompt_tokens: job.ids.len() as u32,
            completion_tokens: 0,
            logprobs: job.spec.params.logprobs.is_some(),
            include_usage: job.spec.include_usage,
        }
    }

    fn piece_of(&mut self, t: &TokenChunk) -> Piece {
        self.completion_tokens += 1;
        let tok = &self.app.tokenizer;
        let raw = self.detok.push(tok, t.id).unwrap_or_default();
        let (text, finish) = match self.stop.as_mut() {
            Some(s) => {
                let d = s.on_token(t.id, &raw);
                (d.emit, d.finished.map(finish_name))
            }
            None => (raw, None),
        };
        let logprob = self.logprobs.then(|| {
            let piece = tok.token_piece(t.id).unwrap_or_default().to_owned();
            let top: Vec<Value> = t
                .top
                .iter()
                .map(|a| json!({"token": tok.token_piece(a.id).unwrap_or_default(), "logprob": a.logprob}))
                .collect();
            json!({"token": piece, "logprob": t.logprob, "top_logprobs": top})
        });
        Piece { text, logprob, finish }
    }

    /// The next piece, or the end (`Ok(None)` with the finish reason set).
    async fn step(&mut self) -> Result<Result<Piece, &'static str>, ApiError> {
        let event = tokio::time::timeout_at(self.deadline.into(), next(&mut self.stream)).await;
        match event {
            Err(_) => Err(deadline_error()),
            Ok(Err(e)) => Err(e),
            Ok(Ok(Step::Token(t))) => Ok(Ok(self.piece_of(&t))),
            Ok(Ok(Step::Finished(f))) => Ok(Err(match f.reason() {
                FinishReason::Length => "length",
                _ => "stop",
            })),
        }
    }

    /// Text held back by the stop checker when the worker ends normally.
    fn flush(&mut self) -> String {
        let mut rest = self.detok.finish(&self.app.tokenizer).unwrap_or_default();
        if let Some(s) = self.stop.as_mut() {
            let d = s.push_text(&rest);
            rest = d.emit;
            if d.finished.is_none() {
                rest.push_str(&s.flush());
            }
        }
        rest
    }

    fn usage(&self) -> Usage {
        Usage::new(self.prompt_tokens, self.completion_tokens)
    }

    /// Runs to the end and builds the non-streaming body.
    async fn collect(mut self) -> Result<Value, ApiError> {
        let mut text = String::new();
        let mut logprobs = Vec::new();
        let finish = loop {
            match self.step().await? {
                Ok(p) => {
                    text.push_str(&p.text);
                    logprobs.extend(p.logprob);
                    if let Some(f) = p.finish {
                        // A stop string (or the last token): dropping the stream cancels the worker.
                        break f;
                    }
                }
                Err(f) => {
                    text.push_str(&self.flush());
                    break f;
                }
            }
        };
        let usage = self.usage();
        let lp = self.logprobs.then(|| json!({"content": logprobs}));
        Ok(match self.api {
            Api::Chat => json!({
                "id": format!("chatcmpl-{}", self.id),
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
            }),
            Api::Completions => json!({
                "id": format!("cmpl-{}", self.id),
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}],
                "usage": usage,
            }),
        })
    }

    fn chunk(&self, text: Option<&str>, logprob: Option<Value>, finish: Option<&str>, first: bool) -> Value {
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
                    "id": format!("chatcmpl-{}", self.id),
                    "object": "chat.completion.chunk",
                    "created": self.created,
                    "model": self.model,
                    "choices": [{
                        "index": 0,
                        "delta": delta,
                        "logprobs": logprob.map(|l| json!({"content": [l]})),
                        "finish_reason": finish,
                    }],
                })
            }
            Api::Completions => json!({
                "id": format!("cmpl-{}", self.id),
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
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
    /// went away, and returning drops the worker stream (cancelling it).
    async fn stream(mut self, tx: mpsc::Sender<Event>) {
        let send = |v: Value| Event::default().data(v.to_string());
        let mut first = true;
        if self.api == Api::Chat {
            if tx.send(send(self.chunk(None, None, None, true))).await.is_err() {
                return;
            }
            first = false;
        }
        let finish = loop {
            match self.step().await {
                Err(e) => {
                    // Headers are gone already: the error travels as an event.
                    let _ = tx.send(send(e.body())).await;
                    return;
                }
                Ok(Ok(p)) => {
                    if (!p.text.is_empty() || p.logprob.is_some())
                        && tx.send(send(self.chunk(Some(&p.text), p.logprob, None, first))).await.is_err()
                    {
                        return;
                    }
                    first = false;
                    if let Some(f) = p.finish {
                        break f;
                    }
                }
                Ok(Err(f)) => {
                    let rest = self.flush();
                    if !rest.is_empty() && tx.send(send(self.chunk(Some(&rest), None, None, first))).await.is_err() {
                        return;
                    }
                    break f;
                }
            }
        };
        let text = if self.api == Api::Chat { None } else { Some("") };
        if tx.send(send(self.chunk(text, None, Some(finish), false))).await.is_err() {
            return;
        }
        if self.include_usage {
            let mut u = self.chunk(text, None, None, false);
            u["choices"] = json!([]);
            u["usage"] = json!(self.usage());
            if tx.send(send(u)).await.is_err() {
                return;
            }
        }
        let _ = tx.send(Event::default().data("[DONE]")).await;
    }
}

fn finish_name(f: EngineFinish) -> &'static str {
    match f {
        EngineFinish::Stop => "stop",
        EngineFinish::Length => "length",
    }
}

async fn tokenize(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    let body = match read_body(&app, body).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let r = (|| {
        let v: Value = parse_json(&app, &headers, &body)?;
        let ids = if let Some(m) = v.get("messages") {
            let messages: Vec<openai::Message> = serde_json::from_value(m.clone())
                .map_err(|e| ApiError::invalid("messages", format!("invalid messages: {e}")))?;
            prompt::chat_tokens(&app.tokenizer, &messages)?
        } else {
            prompt::completion_tokens(&app.tokenizer, &v.get("prompt").cloned())?
        };
        Ok::<_, ApiError>(json!({"tokens": ids, "count": ids.len(), "max_model_len": app.context}))
    })();
    match r {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn detokenize(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    let body = match read_body(&app, body).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let r = (|| {
        let v: Value = parse_json(&app, &headers, &body)?;
        let ids: Vec<u32> = v
            .get("tokens")
            .and_then(|t| serde_json::from_value(t.clone()).ok())
            .ok_or_else(|| ApiError::invalid("tokens", "`tokens` must be a list of token ids"))?;
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= app.tokenizer.vocab_size()) {
            return Err(ApiError::invalid("tokens", format!("token id {bad} is outside the vocabulary")));
        }
        let text = app.tokenizer.decode(&ids, false).map_err(|e| ApiError::invalid("tokens", e.to_string()))?;
        Ok(json!({"prompt": text}))
    })();
    match r {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}
