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
//! [`ApiError`], which each frontend maps onto its own status codes.
//!
//! Dropping a [`Run`] drops the worker stream, which cancels the request on
//! the decode and prefill workers and frees its KV; it also releases the
//! request's admission.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::http::StatusCode;
use engine::sampler::{FinishReason as EngineFinish, StopChecker};
use engine::tokenizer::{IncrementalDecoder as Detokenizer, Tokenizer};
use proto::worker::v1::{FinishReason as WireFinish, HealthRequest, TokenChunk};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::cluster::{next, Cluster, Lease, Step, WorkerStream};
use crate::openai::{ApiError, Spec, Usage};

/// Settings every frontend shares.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The model id clients must name.
    pub model: String,
    /// Requests in flight at once (503 + Retry-After beyond).
    pub max_inflight: usize,
    /// Deadline when the request sets none.
    pub default_timeout: Duration,
    /// `max_tokens` when the request sets none.
    pub default_max_tokens: u32,
}

/// What the frontends share: the tokenizer, the cluster and admission.
pub struct Pipeline {
    pub tokenizer: Tokenizer,
    /// The model's context length in tokens.
    pub context: usize,
    pub cluster: Arc<Cluster>,
    pub settings: Settings,
    inflight: Arc<Semaphore>,
}

/// A validated, tokenized request ready to run.
#[derive(Debug, Clone)]
pub struct Job {
    /// The prompt's token ids (chat template applied).
    pub ids: Vec<u32>,
    pub spec: Spec,
    /// When the request must have ended; travels to the workers.
    pub deadline: Instant,
}

/// A request's place among those admitted; released when dropped.
pub struct Admission {
    _permit: OwnedSemaphorePermit,
}

/// How long a readiness probe waits for one decode worker.
const READY_PROBE_TIMEOUT: Duration = Duration::from_secs(1);

impl Pipeline {
    pub fn new(tokenizer: Tokenizer, context: usize, cluster: Arc<Cluster>, settings: Settings) -> Arc<Self> {
        let inflight = Arc::new(Semaphore::new(settings.max_inflight));
        Arc::new(Self { tokenizer, context, cluster, settings, inflight })
    }

    /// The request names the served model (404 otherwise; 400 when absent).
    pub fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            None => Err(ApiError::invalid("model", "`model` is required")),
            Some(m) if m == self.settings.model => Ok(()),
            Some(m) => Err(ApiError {
                status: StatusCode::NOT_FOUND,
                message: format!("the model {m:?} does not exist; this cluster serves {:?}", self.settings.model),
                kind: "invalid_request_error",
                param: Some("model".into()),
                code: Some("model_not_found"),
                retry_after: None,
            }),
        }
    }

    /// The prompt plus `max_tokens` fits the model's context (400 naming `param` otherwise).
    pub fn check_context(&self, param: &str, prompt: usize, max_tokens: u32) -> Result<(), ApiError> {
        if prompt + max_tokens as usize > self.context {
            return Err(ApiError::invalid(
                param,
                format!(
                    "the prompt ({prompt} tokens) plus max_tokens ({max_tokens}) exceeds the model's context of {} tokens",
                    self.context
                ),
            )
            .with_code("context_length_exceeded"));
        }
        Ok(())
    }

    /// The deadline of a request arriving now: its own timeout, else the default.
    pub fn deadline(&self, timeout: Option<Duration>) -> Instant {
        Instant::now() + timeout.unwrap_or(self.settings.default_timeout)
    }

    /// Admission: a bounded number in flight; the rest are told to come back
    /// (503 + Retry-After). The priority/fairness queue replaces this one
    /// function; it gets the job to weigh.
    async fn admit(&self, _job: &Job) -> Result<Admission, ApiError> {
        match self.inflight.clone().try_acquire_owned() {
            Ok(permit) => Ok(Admission { _permit: permit }),
            Err(_) => Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "overloaded_error",
                "overloaded",
                format!("{} requests in flight; retry later", self.settings.max_inflight),
            )
            .retry_after(1)),
        }
    }

    /// Admits `job` and starts it on a decode worker, within its deadline.
    pub async fn run(self: &Arc<Self>, job: Job) -> Result<Run, ApiError> {
        // The single admission step.
        let admission = self.admit(&job).await?;
        let id = self.cluster.request_id();
        let started = tokio::time::timeout_at(
            job.deadline.into(),
            self.cluster.generate(id.clone(), job.ids.clone(), &job.spec.params, unix_ms(job.deadline)),
        )
        .await;
        let (stream, lease) = match started {
            Err(_) => return Err(deadline_error()),
            Ok(r) => r?,
        };
        Ok(Run::new(self.clone(), &job, id, stream, lease, admission))
    }

    /// A decode worker answers its health check as ready (what `/ready` and
    /// the gRPC health service report).
    pub async fn ready(&self) -> bool {
        for addr in self.cluster.decode_addrs() {
            let Ok(ep) = tonic::transport::Endpoint::from_shared(format!("http://{addr}")) else { continue };
            let check = async {
                let mut c = proto::worker::v1::decode_worker_client::DecodeWorkerClient::connect(ep).await.ok()?;
                c.health(HealthRequest {}).await.ok().map(|h| h.into_inner().ready)
            };
            if let Ok(Some(true)) = tokio::time::timeout(READY_PROBE_TIMEOUT, check).await {
                return true;
            }
        }
        false
    }
}

/// The refusal for a request whose deadline passed (504).
pub fn deadline_error() -> ApiError {
    ApiError::new(StatusCode::GATEWAY_TIMEOUT, "timeout_error", "deadline_exceeded", "the request's deadline passed")
}

/// A monotonic deadline as wall-clock ms since the epoch, for the wire.
fn unix_ms(d: Instant) -> u64 {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |n| n.as_millis() as u64);
    (now + d.saturating_duration_since(Instant::now()).as_millis() as u64).max(1)
}

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// End of sequence or a stop string.
    Stop,
    /// `max_tokens` or the context.
    Length,
}

impl Finish {
    /// The OpenAI `finish_reason`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
        }
    }
}

impl From<EngineFinish> for Finish {
    fn from(f: EngineFinish) -> Self {
        match f {
            EngineFinish::Stop => Self::Stop,
            EngineFinish::Length => Self::Length,
        }
    }
}

/// A generated token's log-probability and its alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub id: u32,
    /// The token's vocabulary piece.
    pub token: String,
    /// Set whenever the worker reported it (always, when logprobs were asked for).
    pub logprob: Option<f32>,
    /// Most likely first.
    pub top: Vec<TopLogprob>,
}

/// One alternative token.
#[derive(Debug, Clone, PartialEq)]
pub struct TopLogprob {
    pub id: u32,
    /// The token's vocabulary piece.
    pub token: String,
    pub logprob: f32,
}

/// What one generated token turned into.
#[derive(Debug, Clone, PartialEq)]
pub struct Piece {
    /// The token's id.
    pub token_id: u32,
    /// Text it completes, stop strings removed; may be empty (held back).
    pub text: String,
    /// Set when the request asked for logprobs.
    pub logprob: Option<TokenLogprob>,
    /// Set when this token ended the generation (a stop string): the caller
    /// stops reading, and dropping the run cancels the worker.
    pub finish: Option<Finish>,
}

/// One step of a [`Run`].
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A generated token.
    Piece(Piece),
    /// The worker ended normally; [`Run::flush`] has the text held back.
    End(Finish),
}

/// A whole generation, for non-streaming answers.
#[derive(Debug, Clone, PartialEq)]
pub struct Collected {
    pub text: String,
    /// One per token when logprobs were asked for.
    pub logprobs: Vec<TokenLogprob>,
    pub finish: Finish,
}

/// One running generation: the worker stream, detokenized, with stop strings.
pub struct Run {
    id: String,
    pipeline: Arc<Pipeline>,
    stream: WorkerStream,
    detok: Detokenizer,
    stop: Option<StopChecker>,
    deadline: Instant,
    prompt_tokens: u32,
    completion_tokens: u32,
    logprobs: bool,
    include_usage: bool,
    // Released last, with the run.
    _lease: Lease,
    _admission: Admission,
}

impl Run {
    fn new(
        pipeline: Arc<Pipeline>,
        job: &Job,
        id: String,
        stream: WorkerStream,
        lease: Lease,
        admission: Admission,
    ) -> Self {
        let stop = StopChecker::new(&job.spec.params, pipeline.tokenizer.eos_ids()).ok();
        Self {
            id,
            pipeline,
            stream,
            detok: Detokenizer::new(),
            stop,
            deadline: job.deadline,
            prompt_tokens: job.ids.len() as u32,
            completion_tokens: 0,
            logprobs: job.spec.params.logprobs.is_some(),
            include_usage: job.spec.include_usage,
            _lease: lease,
            _admission: admission,
        }
    }

    /// The cluster-wide request id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The request asked for logprobs.
    pub fn logprobs(&self) -> bool {
        self.logprobs
    }

    /// The request asked for usage in a streamed answer.
    pub fn include_usage(&self) -> bool {
        self.include_usage
    }

    /// Token counts so far.
    pub fn usage(&self) -> Usage {
        Usage::new(self.prompt_tokens, self.completion_tokens)
    }

    fn piece_of(&mut self, t: &TokenChunk) -> Piece {
        self.completion_tokens += 1;
        let tok = &self.pipeline.tokenizer;
        let raw = self.detok.push(tok, t.id).unwrap_or_default();
        let (text, finish) = match self.stop.as_mut() {
            Some(s) => {
                let d = s.on_token(t.id, &raw);
                (d.emit, d.finished.map(Finish::from))
            }
            None => (raw, None),
        };
        let logprob = self.logprobs.then(|| TokenLogprob {
            id: t.id,
            token: tok.token_piece(t.id).unwrap_or_default().to_owned(),
            logprob: t.logprob,
            top: t
                .top
                .iter()
                .map(|a| TopLogprob {
                    id: a.id,
                    token: tok.token_piece(a.id).unwrap_or_default().to_owned(),
                    logprob: a.logprob,
                })
                .collect(),
        });
        Piece { token_id: t.id, text, logprob, finish }
    }

    /// The next piece, or the end; a worker error or the deadline is an error.
    pub async fn step(&mut self) -> Result<Event, ApiError> {
        let event = tokio::time::timeout_at(self.deadline.into(), next(&mut self.stream)).await;
        match event {
            Err(_) => Err(deadline_error()),
            Ok(Err(e)) => Err(e),
            Ok(Ok(Step::Token(t))) => Ok(Event::Piece(self.piece_of(&t))),
            Ok(Ok(Step::Finished(f))) => Ok(Event::End(match f.reason() {
                WireFinish::Length => Finish::Length,
                _ => Finish::Stop,
            })),
        }
    }

    /// Text held back by the detokenizer and stop checker, once the worker
    /// ended normally ([`Event::End`]).
    pub fn flush(&mut self) -> String {
        let mut rest = self.detok.finish(&self.pipeline.tokenizer).unwrap_or_default();
        if let Some(s) = self.stop.as_mut() {
            let d = s.push_text(&rest);
            rest = d.emit;
            if d.finished.is_none() {
                rest.push_str(&s.flush());
            }
        }
        rest
    }

    /// Runs to the end: the whole text, logprobs and finish reason.
    pub async fn collect(&mut self) -> Result<Collected, ApiError> {
        let mut text = String::new();
        let mut logprobs = Vec::new();
        let finish = loop {
            match self.step().await? {
                Event::Piece(p) => {
                    text.push_str(&p.text);
                    logprobs.extend(p.logprob);
                    if let Some(f) = p.finish {
                        // A stop string: dropping the run cancels the worker.
                        break f;
                    }
                }
                Event::End(f) => {
                    text.push_str(&self.flush());
                    break f;
                }
            }
        };
        Ok(Collected { text, logprobs, finish })
    }
}
