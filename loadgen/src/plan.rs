//! What to send, to whom, and when: the [`Plan`], checked once by
//! [`Plan::validate`] before anything is sent.

use std::str::FromStr;
use std::time::Duration;

use hyper::header::{HeaderMap, HeaderName, HeaderValue, AUTHORIZATION, CONTENT_TYPE, HOST};
use hyper::Uri;

/// Which OpenAI endpoint the requests go to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Endpoint {
    /// `POST /v1/chat/completions`, the prompt as one user message.
    Chat,
    /// `POST /v1/completions`, the prompt as raw text (no chat template).
    Completions,
}

impl Endpoint {
    /// The path under the base URL.
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
        }
    }
}

impl FromStr for Endpoint {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "chat" => Ok(Endpoint::Chat),
            "completions" => Ok(Endpoint::Completions),
            other => Err(format!("unknown endpoint `{other}`: chat | completions")),
        }
    }
}

/// Which API the requests speak.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Api {
    /// The OpenAI-compatible HTTP API at [`Endpoint`]'s path.
    #[default]
    Http,
    /// tandem's gRPC frontend (`tandem.frontend.v1.Frontend/Generate`), the base URL
    /// its listener; answers always stream. [`Endpoint::Completions`] sends the
    /// prompt as raw text, [`Endpoint::Chat`] as messages; the deadline travels as
    /// `grpc-timeout`, the API key as `authorization` metadata.
    Grpc,
}

/// When requests start.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Arrival {
    /// Closed loop: this many requests in flight; each one that ends starts the next.
    Closed { concurrency: usize },
    /// Open loop: starts at exponential gaps of mean `1/rate` seconds (a
    /// Poisson process of `rate` requests per second) from the plan's seed,
    /// whatever is still in flight.
    Poisson { rate: f64 },
}

/// Where prompts come from.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PromptSource {
    /// These prompts, request `i` taking `list[i % len]`.
    List(Vec<String>),
    /// Word-list text of about `tokens` tokens, unique per request from its
    /// first word on, so a server's prefix cache cannot help (see [`crate::prompts`]).
    Generated { tokens: usize },
    /// Multi-turn chats, where a prefix cache can help (chat endpoint only).
    /// The plan's requests are split into conversations of `turns` requests
    /// (the last may be shorter). Conversation `c` opens with system prompt
    /// `c % system_prompts` of about `system_tokens` tokens, shared with the
    /// other conversations that use it; each turn adds a fresh user message
    /// of about `user_tokens` tokens, and sends the system prompt, every
    /// earlier user message with the server's own answer to it, and the new
    /// message. A conversation's turns go one after another (the next once
    /// the answer is in); the plan's arrivals start conversations, not
    /// requests: closed loop, `concurrency` conversations at a time; Poisson,
    /// conversations at `rate` per second.
    Chats { system_prompts: usize, system_tokens: usize, turns: usize, user_tokens: usize },
}

/// Which requests of a plan sample, and how: request `i` samples when
/// `i % every == every - 1` (every second one with `every` 2), at
/// `temperature` and `top_p`, seeded `seed + i`, so its answer is reproducible
/// (and checkable against a reference). The others stay greedy.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Sampled {
    pub every: usize,
    pub temperature: f32,
    pub top_p: f32,
    pub seed: u64,
}

impl Sampled {
    /// The seed request `index` samples with, if it samples.
    pub fn seed_of(&self, index: usize) -> Option<u64> {
        (self.every > 0 && index % self.every == self.every - 1).then(|| self.seed.wrapping_add(index as u64))
    }
}

/// Clients that send a request again when it is refused with 429 or 503 (and
/// only then: a request that was answered, or failed otherwise, is not
/// retried), at most `max` times each. Request `i` is an *eager* client when
/// `eager_every > 0 && i % eager_every == 0`: it ignores `Retry-After` and
/// comes back after `eager_delay` (a retry storm); the others wait out the
/// `Retry-After` they were given (or 1 s without one) and send an
/// `Idempotency-Key`, as a careful client does.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Retry {
    pub max: u32,
    pub eager_every: usize,
    #[serde(rename = "eager_delay_ms", serialize_with = "crate::report::ms")]
    pub eager_delay: Duration,
}

impl Retry {
    /// Whether request `index` ignores `Retry-After`.
    pub fn eager(&self, index: usize) -> bool {
        self.eager_every > 0 && index % self.eager_every == 0
    }
}

/// One load run against one server. Sampling is greedy (`temperature: 0`)
/// unless [`Plan::sampled`] says otherwise.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct Plan {
    /// Server base URL, `http://host:port` (plain HTTP; no TLS). The
    /// endpoint path is appended.
    pub base_url: String,
    /// The `model` field of every request.
    pub model: String,
    pub endpoint: Endpoint,
    /// HTTP (the default) or gRPC.
    pub api: Api,
    /// Requests in the run.
    pub requests: usize,
    pub arrival: Arrival,
    pub prompts: PromptSource,
    /// `max_tokens` of every request.
    pub max_tokens: u32,
    /// `stream: true` (SSE): gives time to first token and inter-token latencies.
    pub stream: bool,
    /// With `stream`, ask for `stream_options.include_usage` and count output
    /// tokens from `usage` rather than from content events.
    pub include_usage: bool,
    /// Send `ignore_eos: true` (vLLM/llama.cpp extension): every request
    /// generates `max_tokens`, so targets do the same work.
    pub ignore_eos: bool,
    /// Sent as `x-request-timeout-ms` (gRPC: `grpc-timeout`): the server-side deadline.
    /// A retry or a resume sends what is left of it since the first attempt.
    #[serde(rename = "deadline_ms", serialize_with = "crate::report::opt_ms")]
    pub deadline: Option<Duration>,
    /// Sent as `x-priority`.
    pub priority: Option<String>,
    /// Sent as `Authorization: Bearer ...`; never serialized.
    #[serde(skip)]
    pub api_key: Option<String>,
    /// Seeds the arrivals and the generated prompts: the same seed gives the
    /// same prompts and gaps, whatever the target.
    pub seed: u64,
    /// Requests that sample (seeded) instead of decoding greedily.
    pub sampled: Option<Sampled>,
    /// Clients that retry refusals ([`Retry`]: HTTP 429/503, gRPC `RESOURCE_EXHAUSTED`
    /// or `UNAVAILABLE` with an error code); `None`: every request is sent once.
    pub retry: Option<Retry>,
    /// Resuming clients: every request carries an
    /// `Idempotency-Key`, and a stream whose connection breaks, that ends with
    /// `coordinator_draining` or `idempotent_original_failed` (its retry met the first
    /// attempt ending), or that is refused with 503 `shutting_down` is sent
    /// again with `Last-Event-ID` set to its last event's cursor — up to
    /// [`crate::MAX_RESUMES`] times within the timeout. The record is one request:
    /// its text and timings run on across the resumes. A whole (non-streamed) request
    /// cut the same way is sent again whole, with its key. With `retry` too, a
    /// request refused with 429 or 503 (not a hand-off) waits out its `Retry-After`
    /// and is sent again, from its cursor, up to `retry.max` times (counted in
    /// `retries.sent`; early retries are not tracked for resuming clients).
    pub resume: bool,
    /// Client-side limit on a whole request, connect to last byte; past it
    /// the request is dropped and recorded as [`crate::Outcome::Timeout`].
    #[serde(rename = "timeout_ms", serialize_with = "crate::report::ms")]
    pub timeout: Duration,
}

impl Plan {
    /// A plan with the defaults: completions, 32 requests at concurrency 4,
    /// generated prompts of ~235 tokens, `max_tokens` 64, streaming with
    /// usage, seed 0, a 300 s client timeout, no optional headers.
    pub fn new(base_url: impl Into<String>, model: impl Into<String>) -> Self {
        Self {
            base_url: base_url.into(),
            model: model.into(),
            endpoint: Endpoint::Completions,
            api: Api::Http,
            requests: 32,
            arrival: Arrival::Closed { concurrency: 4 },
            prompts: PromptSource::Generated { tokens: 235 },
            max_tokens: 64,
            stream: true,
            include_usage: true,
            ignore_eos: false,
            deadline: None,
            priority: None,
            api_key: None,
            seed: 0,
            sampled: None,
            retry: None,
            resume: false,
            timeout: Duration::from_secs(300),
        }
    }

    /// Checks the plan; what the client needs, ready to use.
    pub(crate) fn validate(&self) -> Result<Checked, PlanError> {
        if self.requests == 0 {
            return Err(PlanError::Invalid { field: "requests", reason: "must be at least 1".into() });
        }
        if self.api == Api::Grpc && !self.stream {
            return Err(PlanError::Invalid { field: "stream", reason: "gRPC answers always stream".into() });
        }
        match self.arrival {
            Arrival::Closed { concurrency: 0 } => {
                return Err(PlanError::Invalid { field: "arrival", reason: "concurrency must be at least 1".into() })
            }
            Arrival::Poisson { rate } if !(rate.is_finite() && rate > 0.0) => {
                return Err(PlanError::Invalid {
                    field: "arrival",
                    reason: format!("rate must be positive; got {rate}"),
                })
            }
            _ => {}
        }
        match &self.prompts {
            PromptSource::List(l) if l.is_empty() => {
                return Err(PlanError::Invalid { field: "prompts", reason: "the list is empty".into() })
            }
            PromptSource::Generated { tokens: 0 } => {
                return Err(PlanError::Invalid { field: "prompts", reason: "tokens must be at least 1".into() })
            }
            PromptSource::Chats { .. } if self.endpoint != Endpoint::Chat => {
                return Err(PlanError::Invalid {
                    field: "prompts",
                    reason: "chats need the chat endpoint (they send messages)".into(),
                })
            }
            PromptSource::Chats { system_prompts, system_tokens, turns, user_tokens } => {
                let zero = [
                    ("system_prompts", system_prompts),
                    ("system_tokens", system_tokens),
                    ("turns", turns),
                    ("user_tokens", user_tokens),
                ]
                .into_iter()
                .find(|(_, n)| **n == 0);
                if let Some((name, _)) = zero {
                    return Err(PlanError::Invalid {
                        field: "prompts",
                        reason: format!("chats: {name} must be at least 1"),
                    });
                }
            }
            _ => {}
        }
        if self.max_tokens == 0 {
            return Err(PlanError::Invalid { field: "max_tokens", reason: "must be at least 1".into() });
        }
        if let Some(s) = self.sampled {
            if s.every == 0 || !(s.temperature.is_finite() && s.temperature > 0.0) || !(s.top_p > 0.0 && s.top_p <= 1.0)
            {
                return Err(PlanError::Invalid {
                    field: "sampled",
                    reason: format!("every must be at least 1, temperature > 0 and top_p in (0, 1]: {s:?}"),
                });
            }
        }
        if self.timeout.is_zero() {
            return Err(PlanError::Invalid { field: "timeout", reason: "must be positive".into() });
        }
        let uri = endpoint_uri(&self.base_url, self.endpoint)?;
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        if let Some(a) = uri.authority() {
            headers.insert(HOST, header_value("base_url", a.as_str())?);
        }
        if let Some(d) = self.deadline {
            let ms = d.as_millis();
            if ms == 0 {
                return Err(PlanError::Invalid { field: "deadline", reason: "must be at least 1 ms".into() });
            }
            headers.insert(HeaderName::from_static("x-request-timeout-ms"), header_value("deadline", &ms.to_string())?);
        }
        if let Some(p) = &self.priority {
            headers.insert(HeaderName::from_static("x-priority"), header_value("priority", p)?);
        }
        if let Some(k) = &self.api_key {
            let mut v = header_value("api_key", &format!("Bearer {k}"))?;
            v.set_sensitive(true);
            headers.insert(AUTHORIZATION, v);
        }
        Ok(Checked { uri, headers })
    }
}

/// A plan's request target and fixed headers, once validated.
#[derive(Debug, Clone)]
pub(crate) struct Checked {
    pub uri: Uri,
    pub headers: HeaderMap,
}

fn header_value(field: &'static str, v: &str) -> Result<HeaderValue, PlanError> {
    HeaderValue::from_str(v).map_err(|_| PlanError::Invalid { field, reason: "not a valid HTTP header value".into() })
}

fn endpoint_uri(base: &str, endpoint: Endpoint) -> Result<Uri, PlanError> {
    let bad = |reason: &str| PlanError::Invalid { field: "base_url", reason: format!("`{base}`: {reason}") };
    let full = format!("{}{}", base.trim_end_matches('/'), endpoint.path());
    let uri: Uri = full.parse().map_err(|e| bad(&format!("{e}")))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some(s) => return Err(bad(&format!("scheme `{s}` is not supported (plain http only)"))),
        None => return Err(bad("needs a scheme, e.g. http://127.0.0.1:8000")),
    }
    if uri.authority().is_none() {
        return Err(bad("needs a host"));
    }
    if uri.query().is_some() {
        return Err(bad("must not have a query"));
    }
    Ok(uri)
}

/// A plan that cannot run; nothing was sent.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    /// A field is out of range or malformed; `field` names it.
    #[error("plan field `{field}`: {reason}")]
    Invalid { field: &'static str, reason: String },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_endpoint_path_is_appended_to_the_base_url() -> Result<(), PlanError> {
        let c = Plan::new("http://127.0.0.1:8000/", "m").validate()?;
        assert_eq!(c.uri.to_string(), "http://127.0.0.1:8000/v1/completions");
        assert_eq!(c.headers[HOST], "127.0.0.1:8000");
        Ok(())
    }

    #[test]
    fn bad_plans_name_their_field() {
        let field = |p: Plan| match p.validate() {
            Err(PlanError::Invalid { field, .. }) => field,
            Ok(_) => "ok",
        };
        let base = Plan::new("http://127.0.0.1:1", "m");
        assert_eq!(field(Plan { base_url: "https://x".into(), ..base.clone() }), "base_url");
        assert_eq!(field(Plan { base_url: "127.0.0.1:1".into(), ..base.clone() }), "base_url");
        assert_eq!(field(Plan { requests: 0, ..base.clone() }), "requests");
        assert_eq!(field(Plan { arrival: Arrival::Poisson { rate: f64::NAN }, ..base.clone() }), "arrival");
        assert_eq!(field(Plan { arrival: Arrival::Closed { concurrency: 0 }, ..base.clone() }), "arrival");
        assert_eq!(field(Plan { prompts: PromptSource::List(vec![]), ..base.clone() }), "prompts");
        let chats = PromptSource::Chats { system_prompts: 2, system_tokens: 50, turns: 3, user_tokens: 20 };
        assert_eq!(field(Plan { prompts: chats.clone(), ..base.clone() }), "prompts", "chats on completions");
        assert_eq!(field(Plan { prompts: chats.clone(), endpoint: Endpoint::Chat, ..base.clone() }), "ok");
        let no_turns = PromptSource::Chats { system_prompts: 2, system_tokens: 50, turns: 0, user_tokens: 20 };
        assert_eq!(field(Plan { prompts: no_turns, endpoint: Endpoint::Chat, ..base.clone() }), "prompts");
        assert_eq!(field(Plan { priority: Some("a\nb".into()), ..base.clone() }), "priority");
        assert_eq!(field(Plan { deadline: Some(Duration::from_micros(10)), ..base.clone() }), "deadline");
        let grpc = Plan { api: Api::Grpc, ..base.clone() };
        assert_eq!(field(Plan { stream: false, ..grpc.clone() }), "stream");
        let retry = Retry { max: 2, eager_every: 0, eager_delay: Duration::ZERO };
        assert_eq!(field(Plan { retry: Some(retry), resume: true, ..grpc.clone() }), "ok");
        assert_eq!(field(Plan { retry: Some(retry), resume: true, ..base.clone() }), "ok");
        assert_eq!(field(grpc), "ok");
        assert_eq!(field(base), "ok");
    }

    #[test]
    fn optional_headers_are_sent_and_the_key_is_not_serialized() -> Result<(), Box<dyn std::error::Error>> {
        let p = Plan {
            deadline: Some(Duration::from_millis(1500)),
            priority: Some("high".into()),
            api_key: Some("sk-1".into()),
            ..Plan::new("http://h:1", "m")
        };
        let h = p.validate()?.headers;
        assert_eq!(h["x-request-timeout-ms"], "1500");
        assert_eq!(h["x-priority"], "high");
        assert_eq!(h[AUTHORIZATION], "Bearer sk-1");
        let json = serde_json::to_value(&p)?;
        assert!(!json.to_string().contains("sk-1"), "{json}");
        assert_eq!(json["deadline_ms"], 1500.0);
        Ok(())
    }
}
