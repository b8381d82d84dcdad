//! What went wrong with a request, in the coordinator's own terms: a bad
//! field and which one, a cap and by how much, an unknown model, an
//! admission refusal ([`Shed`]), no route ([`NoRoute`]), a decode worker's
//! typed error ([`ErrorKind`]), a deadline. Validation, [`crate::pipeline`]
//! and [`crate::cluster`] return an [`Error`] and never a wire status; each
//! frontend turns it into its own wire once, at its edge:
//! [`crate::http::error`] into an HTTP status, the OpenAI error body and
//! `Retry-After`, [`crate::grpc::status_of`] into a `tonic::Code` with
//! metadata. Both are one exhaustive `match` over the variants (and over
//! the worker kinds, shed reasons and route failures inside them), so a new
//! variant does not compile until each edge has chosen for it, and no
//! mapping goes from one wire's status to the other's.
//!
//! What the two wires share is decided here, once: the OpenAI `type` and
//! `code` strings (README's error-code table; over gRPC they travel as
//! metadata), the offending field, and `Retry-After` (one rule for the HTTP
//! header and the gRPC `retry-after` metadata, see [`admission::retry_after`]).

use std::time::Duration;

use proto::worker::v1::ErrorKind;

use crate::admission::{self, Shed};
use crate::router::NoRoute;
use crate::tenants::{Cap, TenantLimit};

/// Why a request was refused or failed. Each variant names a cause a
/// caller can act on; how it shows on the wire is the frontends' business.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// A request field or header is missing or invalid: `param` names it,
    /// `message` says what is wrong (with the allowed range where there is one).
    #[error("{message}")]
    Invalid { param: String, message: String },
    /// The body is not UTF-8 or not JSON.
    #[error("{message}")]
    InvalidJson { message: String },
    /// A field tandem does not implement: one it does not know at all, or one of
    /// OpenAI's that it does not implement set to a value that asks for something
    /// (`best_of: 3`, a non-empty `tools`). `param` names it; README lists them.
    #[error("{message}")]
    Unsupported { param: String, message: String },
    /// No route has this path (HTTP only).
    #[error("unknown request URL: {method} {path}")]
    UnknownRoute { method: String, path: String },
    /// The path exists, but not for this method (HTTP only; `Allow` lists `allowed`).
    #[error("{method} is not allowed on {path}; use {allowed}")]
    MethodNotAllowed { method: String, path: String, allowed: &'static str },
    /// The body could not be read whole: its chunked framing is broken, or the
    /// connection failed in the middle of it (HTTP only).
    #[error("the request body could not be read: {message}")]
    InvalidBody { message: String },
    /// The prompt (`param`: `prompt`, `messages` or `token_ids`) plus
    /// `max_tokens` does not fit the model's context.
    #[error(
        "the prompt ({prompt} tokens) plus max_tokens ({max_tokens}) exceeds the model's context of {context} tokens"
    )]
    ContextLength { param: &'static str, prompt: usize, max_tokens: u32, context: usize },
    /// The body is over the `limit` in bytes; `size` when it was read whole.
    #[error("{}", too_large(.limit, .size))]
    BodyTooLarge { limit: usize, size: Option<usize> },
    /// `Content-Type` is not `application/json`.
    #[error("Content-Type must be application/json, got {content_type:?}")]
    UnsupportedMediaType { content_type: String },
    /// API keys are configured and the request carries none.
    #[error("no API key given: send `Authorization: Bearer KEY`")]
    MissingApiKey,
    /// The request's API key is not one of the configured ones (never echoed).
    #[error("incorrect API key provided")]
    WrongApiKey,
    /// The request names a model this cluster does not serve.
    #[error("the model {asked:?} does not exist; this cluster serves {served:?}")]
    ModelNotFound { asked: String, served: String },
    /// An `Idempotency-Key` sent again with a different body.
    #[error("this Idempotency-Key was used with a different request body")]
    IdempotencyKeyReused,
    /// Too many `Idempotency-Key`s are in use to take one more; the request
    /// is refused rather than run without the guarantee.
    #[error("too many Idempotency-Keys are in use; retry later")]
    IdempotencyTableFull,
    /// A retry attached to the first request with its key, which ended
    /// without an answer; running it anew is safe.
    #[error("the first request with this Idempotency-Key ended without an answer; retry it")]
    IdempotentOriginalFailed,
    /// Admission refused the request; nothing was started for it.
    #[error("{}", shed_message(.0))]
    Shed(Shed),
    /// The cluster cannot serve now (`/ready` only); the reason.
    #[error("{0}")]
    NotReady(String),
    /// etcd has not confirmed the membership for longer than its stale bound.
    #[error("the worker registry (etcd) is unreachable")]
    RegistryUnavailable,
    /// Routing found no decode worker to use, or none with a usable prefill
    /// pair. `breaker_cooldown` bounds the Retry-After of
    /// [`NoRoute::PrefillUnavailable`]: by then every breaker lets a probe through.
    #[error("{why}")]
    NoRoute { why: NoRoute, breaker_cooldown: Duration },
    /// A decode worker could not be called: its address is not a usable
    /// endpoint, or its `Generate` failed before it answered and no other
    /// worker was left to try.
    #[error("{0}")]
    WorkerUnavailable(String),
    /// The decode worker's stream broke after it answered, or ended
    /// without a result.
    #[error("{0}")]
    WorkerStream(String),
    /// The request's decode worker was lost mid-stream and the request could not
    /// move to another (no worker of the same version group and determinism
    /// fingerprint could take it): `moves` it made, the `cause` that needed a
    /// move, and the `last` refusal.
    #[error(
        "the request's decode worker was lost ({cause}) and it could not move to another after {moves} move(s): {last}"
    )]
    MigrationFailed { moves: u32, cause: String, last: String },
    /// The decode worker ended the request with a typed error. `drain` is
    /// the admission queue's drain estimate when it came: the Retry-After
    /// of the kinds a retry can cure.
    #[error("{message}")]
    Worker { kind: ErrorKind, message: String, drain: Option<Duration> },
    /// The request's deadline passed after admission (on arrival, while
    /// starting or while running); in the queue it is [`Shed::Deadline`].
    #[error("the request's deadline passed")]
    Deadline,
    /// The caller's tenant is over one of its limits (a rate or a count);
    /// nothing was started. `wait`: when the limit is a bucket, how long
    /// until it holds what was asked (the Retry-After); `None` for counts.
    #[error("tenant {tenant:?} is over its {}", .limit.describe())]
    TenantLimit { tenant: String, limit: TenantLimit, wait: Option<Duration> },
    /// A request asks for more than its tenant's cap on one field (`param`).
    #[error("{param} is {got}, over this tenant's cap of {cap} ({})", .what.describe())]
    OverCap { param: &'static str, what: Cap, cap: u64, got: u64 },
    /// The tokenizer pool's queue is full: the request was shed before
    /// anything was tokenized.
    #[error("the coordinator's tokenizer queue is full")]
    TokenizerBusy,
    /// A retry of a request refused with a `Retry-After` that came back before it
    /// was up ([`crate::retries`]); `wait` is the time still left.
    #[error("this request was refused with a Retry-After that is not up yet; retry in {}", fmt_ms(.wait))]
    RetryTooSoon { wait: Duration },
    /// A retry past its caller's retry budget ([`crate::retries`]); `wait` is the
    /// time until the budget holds one again.
    #[error("this caller's retries are over its retry budget; retry in {}", fmt_ms(.wait))]
    RetryBudgetExhausted { wait: Duration },
    /// The client did not send the whole body within the body read timeout.
    #[error("the request body did not arrive within {}", fmt_ms(.after))]
    BodyTimeout { after: Duration },
    /// A stream resumed from a cursor (`Last-Event-ID`, gRPC `resume_cursor`)
    /// regenerated another answer than the one the cursor was taken from: its
    /// hash at `tokens` differs, or the answer ended before it. Another build,
    /// tokenizer or sampler, or another request; nothing was sent.
    #[error(
        "the answer regenerated to resume this stream differs from the one at cursor token {tokens}: \
         a worker of another build, tokenizer or sampler, or a changed request; nothing was resent"
    )]
    ResumeMismatch { tokens: u32 },
    /// The coordinator is draining and a peer coordinator is live: the stream
    /// ends here, resumable at another coordinator from its last cursor.
    #[error("this coordinator is draining; resume the stream at another coordinator from its last event")]
    Draining,
}

fn fmt_ms(d: &Duration) -> String {
    format!("{} ms", d.as_millis())
}

fn too_large(limit: &usize, size: &Option<usize>) -> String {
    match size {
        Some(size) => format!("the body is {size} bytes; the limit is {limit}"),
        None => format!("the body is larger than the limit of {limit} bytes"),
    }
}

fn shed_message(shed: &Shed) -> &'static str {
    match shed {
        Shed::KeyLimit { .. } => "this API key has too many requests or tokens queued; retry later",
        Shed::QueueFull { .. } => "the cluster is at capacity and its queue is full; retry later",
        Shed::Deadline => "the request's deadline passed while it was queued; it was dropped before prefill",
        Shed::Closed => "the coordinator is shutting down",
    }
}

impl Error {
    /// A missing or invalid field or header, named by `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Invalid { param: param.into(), message: message.into() }
    }

    /// The OpenAI error `type` and `code` (README's error-code table), the
    /// same over both frontends. Every error has a code.
    pub fn openai(&self) -> (&'static str, &'static str) {
        use ErrorKind as K;
        match self {
            Self::Invalid { .. } => ("invalid_request_error", "invalid_value"),
            Self::InvalidJson { .. } => ("invalid_request_error", "invalid_json"),
            Self::Unsupported { .. } => ("invalid_request_error", "unsupported_parameter"),
            Self::UnknownRoute { .. } => ("invalid_request_error", "unknown_url"),
            Self::MethodNotAllowed { .. } => ("invalid_request_error", "method_not_allowed"),
            Self::InvalidBody { .. } => ("invalid_request_error", "invalid_body"),
            Self::ContextLength { .. } => ("invalid_request_error", "context_length_exceeded"),
            Self::BodyTooLarge { .. } => ("invalid_request_error", "request_too_large"),
            Self::UnsupportedMediaType { .. } => ("invalid_request_error", "unsupported_media_type"),
            Self::MissingApiKey | Self::WrongApiKey => ("invalid_request_error", "invalid_api_key"),
            Self::ModelNotFound { .. } => ("invalid_request_error", "model_not_found"),
            Self::IdempotencyKeyReused => ("invalid_request_error", "idempotency_key_reused"),
            Self::IdempotencyTableFull => ("overloaded_error", "idempotency_table_full"),
            Self::IdempotentOriginalFailed => ("overloaded_error", "idempotent_original_failed"),
            Self::Shed(shed) => match shed {
                Shed::KeyLimit { .. } => ("rate_limit_error", "rate_limit_exceeded"),
                Shed::QueueFull { .. } => ("overloaded_error", "queue_full"),
                Shed::Deadline => ("timeout_error", "deadline_exceeded"),
                Shed::Closed => ("overloaded_error", "shutting_down"),
            },
            Self::NotReady(_) => ("overloaded_error", "not_ready"),
            Self::RegistryUnavailable => ("overloaded_error", "registry_unavailable"),
            Self::NoRoute { why, .. } => match why {
                NoRoute::NoDecode | NoRoute::NoneReady(_) => ("overloaded_error", "no_worker"),
                NoRoute::PrefillUnavailable(_) => ("overloaded_error", "prefill_unavailable"),
            },
            Self::WorkerUnavailable(_) => ("overloaded_error", "worker_unavailable"),
            Self::WorkerStream(_) => ("server_error", "worker_stream"),
            Self::MigrationFailed { .. } => ("overloaded_error", "migration_failed"),
            Self::Worker { kind, .. } => match kind {
                K::InvalidArgument => ("invalid_request_error", "invalid_argument"),
                K::Overloaded => ("overloaded_error", "overloaded"),
                K::Retryable => ("overloaded_error", "retryable"),
                K::Deadline => ("timeout_error", "deadline_exceeded"),
                K::KvLoadFailed => ("server_error", "kv_load_failed"),
                K::VersionMismatch => ("server_error", "version_mismatch"),
                K::Cancelled => ("server_error", "cancelled"),
                K::Internal | K::Unspecified => ("server_error", "internal"),
            },
            Self::Deadline => ("timeout_error", "deadline_exceeded"),
            // Spelled out (not `limit.code()`): README's table is checked against these literals.
            Self::TenantLimit { limit, .. } => match limit {
                TenantLimit::Requests => ("rate_limit_error", "rate_limit_requests"),
                TenantLimit::PromptTokens => ("rate_limit_error", "rate_limit_prompt_tokens"),
                TenantLimit::OutputTokens => ("rate_limit_error", "rate_limit_output_tokens"),
                TenantLimit::InFlight => ("rate_limit_error", "too_many_in_flight"),
                TenantLimit::Streams => ("rate_limit_error", "too_many_streams"),
                TenantLimit::KvShare => ("rate_limit_error", "kv_share"),
            },
            Self::OverCap { what: Cap::MaxTokens, .. } => ("invalid_request_error", "max_tokens_too_large"),
            Self::OverCap { what: Cap::PromptTokens, .. } => ("invalid_request_error", "prompt_too_long"),
            Self::TokenizerBusy => ("overloaded_error", "tokenizer_busy"),
            Self::BodyTimeout { .. } => ("invalid_request_error", "request_timeout"),
            Self::RetryTooSoon { .. } => ("rate_limit_error", "retry_too_soon"),
            Self::RetryBudgetExhausted { .. } => ("rate_limit_error", "retry_budget_exhausted"),
            Self::ResumeMismatch { .. } => ("invalid_request_error", "resume_mismatch"),
            Self::Draining => ("overloaded_error", "coordinator_draining"),
        }
    }

    /// The OpenAI error `type`: `invalid_request_error`, `overloaded_error`, ...
    pub fn openai_type(&self) -> &'static str {
        self.openai().0
    }

    /// The OpenAI error `code` (`queue_full`, `kv_load_failed`, ...).
    pub fn code(&self) -> &'static str {
        self.openai().1
    }

    /// The request field or header at fault, when there is one.
    pub fn param(&self) -> Option<&str> {
        match self {
            Self::Invalid { param, .. } | Self::Unsupported { param, .. } => Some(param),
            Self::InvalidJson { .. } => Some("body"),
            Self::ContextLength { param, .. } | Self::OverCap { param, .. } => Some(param),
            Self::ModelNotFound { .. } => Some("model"),
            _ => None,
        }
    }

    /// Seconds the client should wait before sending the request again,
    /// for the refusals a later retry can cure (the overload contract: 429
    /// and every 503 over HTTP); `None` where retrying is pointless or
    /// nothing is known of when it would help. Jittered: each call draws anew.
    pub fn retry_after(&self) -> Option<u64> {
        use ErrorKind as K;
        match self {
            Self::Shed(Shed::KeyLimit { retry_after } | Shed::QueueFull { retry_after }) => {
                Some(admission::retry_after(Some(*retry_after)))
            }
            Self::Worker { kind: K::Overloaded | K::Retryable | K::Cancelled, drain, .. } => {
                Some(admission::retry_after(*drain))
            }
            Self::NoRoute { why: NoRoute::PrefillUnavailable(wait), breaker_cooldown } => {
                // Never past a whole cooldown: by then every breaker probes.
                let most = breaker_cooldown.as_millis().div_ceil(1000).max(1) as u64;
                Some(admission::retry_after(Some(*wait)).min(most))
            }
            Self::Shed(Shed::Closed)
            | Self::NoRoute { why: NoRoute::NoDecode | NoRoute::NoneReady(_), .. }
            | Self::RegistryUnavailable
            | Self::WorkerUnavailable(_)
            | Self::MigrationFailed { .. }
            | Self::IdempotencyTableFull
            | Self::IdempotentOriginalFailed
            | Self::TokenizerBusy
            | Self::NotReady(_) => Some(admission::retry_after(None)),
            // Another coordinator takes the rest now; the least a header can say.
            Self::Draining => Some(1),
            // A bucket: when it will hold what was asked, rounded up, so the
            // retry finds it there (not jittered below it).
            Self::TenantLimit { wait: Some(wait), .. } => Some(crate::tenants::retry_after_secs(*wait)),
            // A count: frees as the tenant's own requests end.
            Self::TenantLimit { wait: None, .. } => Some(admission::retry_after(None)),
            // The time left, rounded up: not jittered below it, or the retry is too soon again.
            Self::RetryTooSoon { wait } | Self::RetryBudgetExhausted { wait } => {
                Some(crate::tenants::retry_after_secs(*wait))
            }
            Self::Shed(Shed::Deadline)
            | Self::Worker { .. }
            | Self::Invalid { .. }
            | Self::InvalidJson { .. }
            | Self::Unsupported { .. }
            | Self::UnknownRoute { .. }
            | Self::MethodNotAllowed { .. }
            | Self::InvalidBody { .. }
            | Self::ContextLength { .. }
            | Self::BodyTooLarge { .. }
            | Self::UnsupportedMediaType { .. }
            | Self::MissingApiKey
            | Self::WrongApiKey
            | Self::ModelNotFound { .. }
            | Self::IdempotencyKeyReused
            | Self::WorkerStream(_)
            | Self::OverCap { .. }
            | Self::BodyTimeout { .. }
            | Self::ResumeMismatch { .. }
            | Self::Deadline => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tenants::{Cap, TenantLimit};
    use axum::http::StatusCode;
    use tonic::Code;

    /// One error of every variant, every worker kind (all the wire enum
    /// has, so a new kind joins by itself), every shed reason and every
    /// route failure.
    fn every_error() -> Vec<Error> {
        let d = Duration::from_secs(3);
        let mut all = vec![
            Error::invalid("temperature", "too hot"),
            Error::InvalidJson { message: "invalid JSON".into() },
            Error::Unsupported { param: "best_of".into(), message: "`best_of` is not supported".into() },
            Error::UnknownRoute { method: "GET".into(), path: "/v2".into() },
            Error::MethodNotAllowed { method: "GET".into(), path: "/v1/completions".into(), allowed: "POST" },
            Error::InvalidBody { message: "bad chunk".into() },
            Error::ContextLength { param: "prompt", prompt: 9, max_tokens: 9, context: 16 },
            Error::BodyTooLarge { limit: 10, size: None },
            Error::BodyTooLarge { limit: 10, size: Some(11) },
            Error::UnsupportedMediaType { content_type: "text/plain".into() },
            Error::MissingApiKey,
            Error::WrongApiKey,
            Error::ModelNotFound { asked: "x".into(), served: "y".into() },
            Error::IdempotencyKeyReused,
            Error::IdempotencyTableFull,
            Error::IdempotentOriginalFailed,
            Error::Shed(Shed::KeyLimit { retry_after: d }),
            Error::Shed(Shed::QueueFull { retry_after: d }),
            Error::Shed(Shed::Deadline),
            Error::Shed(Shed::Closed),
            Error::NotReady("no decode worker answers ready".into()),
            Error::RegistryUnavailable,
            Error::NoRoute { why: NoRoute::NoDecode, breaker_cooldown: d },
            Error::NoRoute { why: NoRoute::NoneReady(2), breaker_cooldown: d },
            Error::NoRoute { why: NoRoute::PrefillUnavailable(d), breaker_cooldown: d },
            Error::WorkerUnavailable("decode worker 127.0.0.1:1: refused".into()),
            Error::WorkerStream("decode worker stream: reset".into()),
            Error::MigrationFailed { moves: 1, cause: "worker lost".into(), last: "no worker".into() },
            Error::Deadline,
            Error::TokenizerBusy,
            Error::BodyTimeout { after: d },
            Error::RetryTooSoon { wait: d },
            Error::RetryBudgetExhausted { wait: d },
            Error::ResumeMismatch { tokens: 17 },
            Error::Draining,
            Error::OverCap { param: "max_tokens", what: Cap::MaxTokens, cap: 16, got: 64 },
            Error::OverCap { param: "messages", what: Cap::PromptTokens, cap: 16, got: 64 },
        ];
        for limit in TenantLimit::ALL {
            all.push(Error::TenantLimit { tenant: "t".into(), limit, wait: limit.is_rate().then_some(d) });
        }
        let kinds: Vec<ErrorKind> = (0..64).filter_map(|k| ErrorKind::try_from(k).ok()).collect();
        assert!(kinds.len() >= 9, "the wire has at least the nine kinds of v1: {kinds:?}");
        all.extend(kinds.into_iter().map(|kind| Error::Worker { kind, message: "w".into(), drain: Some(d) }));
        all
    }

    /// The contract, one row per variant, worker kind, shed reason and route
    /// failure: HTTP status, `code`, gRPC code, and whether Retry-After is
    /// sent (header and metadata alike). Exhaustive, so a new variant does
    /// not compile until its row is chosen here too.
    ///
    /// `kv_load_failed` is UNAVAILABLE (what gRPC clients retry: it fails
    /// before the first token and a fresh call is routed anew) and
    /// `version_mismatch` FAILED_PRECONDITION (a deployment fault); see
    /// [`crate::grpc::code_of`].
    fn contract(e: &Error) -> (StatusCode, &'static str, Code, bool) {
        use ErrorKind as K;
        use StatusCode as H;
        match e {
            Error::Invalid { .. } => (H::BAD_REQUEST, "invalid_value", Code::InvalidArgument, false),
            Error::InvalidJson { .. } => (H::BAD_REQUEST, "invalid_json", Code::InvalidArgument, false),
            Error::Unsupported { .. } => (H::BAD_REQUEST, "unsupported_parameter", Code::InvalidArgument, false),
            // HTTP only; a gRPC method that does not exist is tonic's UNIMPLEMENTED.
            Error::UnknownRoute { .. } => (H::NOT_FOUND, "unknown_url", Code::Unimplemented, false),
            Error::MethodNotAllowed { .. } => (H::METHOD_NOT_ALLOWED, "method_not_allowed", Code::Unimplemented, false),
            Error::InvalidBody { .. } => (H::BAD_REQUEST, "invalid_body", Code::InvalidArgument, false),
            Error::ContextLength { .. } => (H::BAD_REQUEST, "context_length_exceeded", Code::InvalidArgument, false),
            // gRPC's status table: a message over the limit is RESOURCE_EXHAUSTED
            // (without retry-after: the same message is refused again).
            Error::BodyTooLarge { .. } => (H::PAYLOAD_TOO_LARGE, "request_too_large", Code::ResourceExhausted, false),
            Error::UnsupportedMediaType { .. } => {
                (H::UNSUPPORTED_MEDIA_TYPE, "unsupported_media_type", Code::InvalidArgument, false)
            }
            Error::MissingApiKey | Error::WrongApiKey => {
                (H::UNAUTHORIZED, "invalid_api_key", Code::Unauthenticated, false)
            }
            Error::ModelNotFound { .. } => (H::NOT_FOUND, "model_not_found", Code::NotFound, false),
            Error::IdempotencyKeyReused => {
                (H::UNPROCESSABLE_ENTITY, "idempotency_key_reused", Code::InvalidArgument, false)
            }
            Error::IdempotencyTableFull => (H::SERVICE_UNAVAILABLE, "idempotency_table_full", Code::Unavailable, true),
            Error::IdempotentOriginalFailed => {
                (H::SERVICE_UNAVAILABLE, "idempotent_original_failed", Code::Unavailable, true)
            }
            Error::Shed(Shed::KeyLimit { .. }) => {
                (H::TOO_MANY_REQUESTS, "rate_limit_exceeded", Code::ResourceExhausted, true)
            }
            Error::Shed(Shed::QueueFull { .. }) => (H::SERVICE_UNAVAILABLE, "queue_full", Code::Unavailable, true),
            Error::Shed(Shed::Deadline) => (H::GATEWAY_TIMEOUT, "deadline_exceeded", Code::DeadlineExceeded, false),
            Error::Shed(Shed::Closed) => (H::SERVICE_UNAVAILABLE, "shutting_down", Code::Unavailable, true),
            Error::NotReady(_) => (H::SERVICE_UNAVAILABLE, "not_ready", Code::Unavailable, true),
            Error::RegistryUnavailable => (H::SERVICE_UNAVAILABLE, "registry_unavailable", Code::Unavailable, true),
            Error::NoRoute { why: NoRoute::NoDecode | NoRoute::NoneReady(_), .. } => {
                (H::SERVICE_UNAVAILABLE, "no_worker", Code::Unavailable, true)
            }
            Error::NoRoute { why: NoRoute::PrefillUnavailable(_), .. } => {
                (H::SERVICE_UNAVAILABLE, "prefill_unavailable", Code::Unavailable, true)
            }
            Error::WorkerUnavailable(_) => (H::SERVICE_UNAVAILABLE, "worker_unavailable", Code::Unavailable, true),
            Error::WorkerStream(_) => (H::BAD_GATEWAY, "worker_stream", Code::Unavailable, false),
            Error::MigrationFailed { .. } => (H::SERVICE_UNAVAILABLE, "migration_failed", Code::Unavailable, true),
            Error::Deadline => (H::GATEWAY_TIMEOUT, "deadline_exceeded", Code::DeadlineExceeded, false),
            Error::TenantLimit { limit, .. } => (H::TOO_MANY_REQUESTS, limit.code(), Code::ResourceExhausted, true),
            Error::OverCap { what: Cap::MaxTokens, .. } => {
                (H::BAD_REQUEST, "max_tokens_too_large", Code::InvalidArgument, false)
            }
            Error::OverCap { what: Cap::PromptTokens, .. } => {
                (H::PAYLOAD_TOO_LARGE, "prompt_too_long", Code::InvalidArgument, false)
            }
            Error::TokenizerBusy => (H::SERVICE_UNAVAILABLE, "tokenizer_busy", Code::Unavailable, true),
            Error::BodyTimeout { .. } => (H::REQUEST_TIMEOUT, "request_timeout", Code::DeadlineExceeded, false),
            Error::RetryTooSoon { .. } => (H::TOO_MANY_REQUESTS, "retry_too_soon", Code::ResourceExhausted, true),
            Error::RetryBudgetExhausted { .. } => {
                (H::TOO_MANY_REQUESTS, "retry_budget_exhausted", Code::ResourceExhausted, true)
            }
            Error::ResumeMismatch { .. } => (H::CONFLICT, "resume_mismatch", Code::FailedPrecondition, false),
            Error::Draining => (H::SERVICE_UNAVAILABLE, "coordinator_draining", Code::Unavailable, true),
            Error::Worker { kind, .. } => match kind {
                K::InvalidArgument => (H::BAD_REQUEST, "invalid_argument", Code::InvalidArgument, false),
                K::Overloaded => (H::SERVICE_UNAVAILABLE, "overloaded", Code::Unavailable, true),
                K::Retryable => (H::SERVICE_UNAVAILABLE, "retryable", Code::Unavailable, true),
                K::Cancelled => (H::SERVICE_UNAVAILABLE, "cancelled", Code::Unavailable, true),
                K::Deadline => (H::GATEWAY_TIMEOUT, "deadline_exceeded", Code::DeadlineExceeded, false),
                K::KvLoadFailed => (H::BAD_GATEWAY, "kv_load_failed", Code::Unavailable, false),
                K::VersionMismatch => (H::BAD_GATEWAY, "version_mismatch", Code::FailedPrecondition, false),
                K::Internal | K::Unspecified => (H::INTERNAL_SERVER_ERROR, "internal", Code::Internal, false),
            },
        }
    }

    fn header<'a>(r: &'a axum::response::Response, name: &str) -> Option<&'a str> {
        r.headers().get(name).and_then(|v| v.to_str().ok())
    }

    #[test]
    fn every_error_maps_to_its_http_status_and_code_and_its_grpc_code() {
        use axum::response::IntoResponse;
        for e in every_error() {
            let (status, code, grpc, retry) = contract(&e);
            let body = crate::http::error::body(&e);
            assert_eq!(crate::http::error::status(&e), status, "HTTP status of {e:?}");
            assert_eq!(body["error"]["code"].as_str(), Some(code), "HTTP code of {e:?}");
            assert_eq!(body["error"]["type"].as_str(), Some(e.openai_type()), "{e:?}");
            assert_eq!(body["error"]["message"].as_str(), Some(e.to_string().as_str()), "{e:?}");
            assert_eq!(body["error"]["param"].as_str(), e.param(), "{e:?}");
            let r = e.clone().into_response();
            assert_eq!(r.status(), status, "{e:?}");
            let seconds = header(&r, "retry-after").and_then(|s| s.parse::<u64>().ok());
            assert_eq!(seconds.is_some(), retry, "HTTP Retry-After of {e:?}");
            assert!(seconds.is_none_or(|s| (1..=60).contains(&s)), "{e:?}: {seconds:?}");

            let s = crate::grpc::status_of(&e);
            assert_eq!(s.code(), grpc, "gRPC code of {e:?}");
            let md = |key: &str| s.metadata().get(key).and_then(|v| v.to_str().ok()).map(str::to_owned);
            assert_eq!(md(crate::grpc::ERROR_CODE_KEY).as_deref(), Some(code), "gRPC code metadata of {e:?}");
            assert_eq!(md(crate::grpc::ERROR_TYPE_KEY).as_deref(), Some(e.openai_type()), "{e:?}");
            assert_eq!(md(crate::grpc::ERROR_PARAM_KEY).as_deref(), e.param(), "{e:?}");
            assert_eq!(md(crate::grpc::RETRY_AFTER_KEY).is_some(), retry, "gRPC retry-after of {e:?}");
            assert_eq!(s.message(), format!("{code}: {e}"), "{e:?}");
            // The same facts as google.rpc.Status details.
            use tonic_types::StatusExt;
            let info = s.get_details_error_info();
            assert_eq!(info.as_ref().map(|i| i.reason.clone()), Some(code.to_ascii_uppercase()), "{e:?}");
            assert_eq!(info.as_ref().map(|i| i.domain.as_str()), Some(crate::grpc::ERROR_DOMAIN), "{e:?}");
            assert_eq!(info.as_ref().and_then(|i| i.metadata.get("code")).map(String::as_str), Some(code), "{e:?}");
            let delay = s.get_details_retry_info().and_then(|r| r.retry_delay);
            assert_eq!(
                delay.map(|d| d.as_secs()),
                md(crate::grpc::RETRY_AFTER_KEY).and_then(|v| v.parse().ok()),
                "{e:?}"
            );
            let fields: Vec<String> = s
                .get_details_bad_request()
                .map(|b| b.field_violations.into_iter().map(|v| v.field).collect())
                .unwrap_or_default();
            assert_eq!(fields, e.param().into_iter().map(str::to_owned).collect::<Vec<_>>(), "{e:?}");
        }
    }

    #[test]
    fn a_rate_limit_retry_after_is_the_refill_rounded_up_and_names_its_limit() {
        let e = Error::TenantLimit {
            tenant: "a".into(),
            limit: TenantLimit::PromptTokens,
            wait: Some(Duration::from_millis(4200)),
        };
        for _ in 0..20 {
            assert_eq!(e.retry_after(), Some(5), "not jittered below the refill");
        }
        assert_eq!(e.code(), "rate_limit_prompt_tokens");
        let codes: Vec<_> = TenantLimit::ALL.iter().map(|l| l.code()).collect();
        assert_eq!(
            codes,
            [
                "rate_limit_requests",
                "rate_limit_prompt_tokens",
                "rate_limit_output_tokens",
                "too_many_in_flight",
                "too_many_streams",
                "kv_share"
            ]
        );
        let cap = Error::OverCap { param: "max_tokens", what: Cap::MaxTokens, cap: 16, got: 64 };
        assert_eq!(cap.param(), Some("max_tokens"));
        assert!(cap.to_string().contains("16") && cap.to_string().contains("64"), "{cap}");
    }

    #[test]
    fn a_kv_load_failure_and_a_version_mismatch_are_told_apart_over_grpc() {
        let worker = |kind| Error::Worker { kind, message: "x".into(), drain: None };
        let kv = crate::grpc::status_of(&worker(ErrorKind::KvLoadFailed));
        let version = crate::grpc::status_of(&worker(ErrorKind::VersionMismatch));
        assert_eq!((kv.code(), version.code()), (Code::Unavailable, Code::FailedPrecondition));
        // The HTTP contract is unchanged: both are 502.
        let http = |kind| crate::http::error::status(&worker(kind));
        assert_eq!(http(ErrorKind::KvLoadFailed), StatusCode::BAD_GATEWAY);
        assert_eq!(http(ErrorKind::VersionMismatch), StatusCode::BAD_GATEWAY);
    }

    #[test]
    fn a_prefill_unavailable_retry_after_never_passes_a_breaker_cooldown() {
        let e = Error::NoRoute {
            why: NoRoute::PrefillUnavailable(Duration::from_secs(30)),
            breaker_cooldown: Duration::from_millis(1500),
        };
        for _ in 0..50 {
            assert!(e.retry_after().is_some_and(|s| (1..=2).contains(&s)), "{:?}", e.retry_after());
        }
    }
}
