//! The OpenAI-compatible request and response shapes and their validation.
//!
//! Validation happens before admission; a refusal names the offending field
//! (the HTTP answer's `param`). No field is accepted silently: each one is
//! read ([`SHARED_FIELDS`] and the endpoint's own), or is one of OpenAI's that
//! tandem does not implement and is set to a value that asks for nothing
//! ([`UNIMPLEMENTED_FIELDS`]); anything else is refused with
//! [`Error::Unsupported`] (`unsupported_parameter`). A read field with the wrong
//! type or an out-of-range value is [`Error::Invalid`] (`invalid_value`).

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use types::sampling::SamplingParams;

use crate::error::Error;

/// Most completions per request (`n`); only 1 is supported today.
pub const MAX_N: u32 = 1;
/// Most alternatives per token for `logprobs` / `top_logprobs`.
pub const MAX_TOP_LOGPROBS: u32 = 20;
/// Most stop strings.
pub const MAX_STOP: usize = 4;

/// The fields both endpoints read (README: "Request fields").
pub const SHARED_FIELDS: [&str; 20] = [
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop",
    "n",
    "stream",
    "stream_options",
    "ignore_eos",
    "prompt_lookup",
    "priority",
    "logprobs",
    "user",
];
/// The fields only `POST /v1/completions` reads.
pub const COMPLETION_FIELDS: [&str; 1] = ["prompt"];
/// The fields only `POST /v1/chat/completions` reads.
pub const CHAT_FIELDS: [&str; 2] = ["messages", "top_logprobs"];

/// OpenAI request fields tandem does not implement, each with the values (JSON) that
/// ask for nothing; `null` always does. Any other value is refused naming the field,
/// never ignored: a client that asks for tools or `best_of` learns it gets none.
pub const UNIMPLEMENTED_FIELDS: [(&str, &[&str]); 18] = [
    ("best_of", &["1"]),
    ("echo", &["false"]),
    ("suffix", &["\"\""]),
    ("logit_bias", &["{}"]),
    ("tools", &["[]"]),
    ("tool_choice", &["\"none\""]),
    // Tandem makes no tool call, so either value holds.
    ("parallel_tool_calls", &["true", "false"]),
    ("functions", &["[]"]),
    ("function_call", &["\"none\""]),
    ("response_format", &["{\"type\":\"text\"}"]),
    ("modalities", &["[\"text\"]"]),
    ("audio", &[]),
    ("prediction", &[]),
    ("store", &["false"]),
    ("metadata", &["{}"]),
    ("service_tier", &["\"auto\"", "\"default\""]),
    ("reasoning_effort", &[]),
    ("web_search_options", &[]),
];

/// Longest `user`, characters.
pub const MAX_USER_CHARS: usize = 256;

/// Checks a body's field names: each is read (shared or in `own`), or is an
/// unimplemented field set to ask for nothing.
pub fn check_fields(body: &Map<String, Value>, own: &[&str]) -> Result<(), Error> {
    for (k, v) in body {
        if SHARED_FIELDS.contains(&k.as_str()) || own.contains(&k.as_str()) {
            continue;
        }
        let Some((_, nothing)) = UNIMPLEMENTED_FIELDS.iter().find(|(name, _)| name == k) else {
            return Err(Error::Unsupported {
                param: k.clone(),
                message: format!("`{k}` is not a field of this endpoint (README: Request fields)"),
            });
        };
        let harmless =
            v.is_null() || nothing.iter().any(|lit| serde_json::from_str::<Value>(lit).is_ok_and(|d| d == *v));
        if !harmless {
            let allowed: Vec<&str> = std::iter::once("null").chain(nothing.iter().copied()).collect();
            return Err(Error::Unsupported {
                param: k.clone(),
                message: format!("`{k}` is not supported by tandem: leave it out or send {}", allowed.join(" or ")),
            });
        }
    }
    Ok(())
}

/// The typed view `T` of a checked body; a field of the wrong type is refused naming it.
pub fn typed<T: DeserializeOwned>(body: &Map<String, Value>) -> Result<T, Error> {
    serde_path_to_error::deserialize(Value::Object(body.clone())).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path.is_empty() || path == "." {
            Error::InvalidJson { message: inner.to_string() }
        } else {
            let field = path.split(['.', '[']).next().unwrap_or(&path).to_owned();
            Error::invalid(field, format!("`{path}`: {inner}"))
        }
    })
}

/// `stop`: a string or a list of strings.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// The sampling fields shared by both endpoints.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Sampling {
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub seed: Option<u64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub stop: Option<Stop>,
    pub n: Option<i64>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    /// Ignore the model's end-of-sequence token (vLLM extension).
    #[serde(default)]
    pub ignore_eos: bool,
    /// Prompt-lookup speculation where decode workers run it: unset or
    /// `true` allows it, `false` turns it off (tandem extension; the tokens
    /// are the same either way).
    pub prompt_lookup: Option<bool>,
    /// Admission class: `high`, `normal` (default) or `low` (tandem
    /// extension; the `x-priority` header does the same).
    pub priority: Option<String>,
    /// The end user, for the caller's own records: accepted (a string of at most
    /// [`MAX_USER_CHARS`]) and asks for nothing the answer shows.
    pub user: Option<String>,
}

/// `POST /v1/completions`'s own fields (the sampling fields are read apart, as [`Sampling`]).
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: Option<Value>,
    /// Completions API: an integer, the number of alternatives.
    pub logprobs: Option<i64>,
}

/// `POST /v1/chat/completions`'s own fields (the sampling fields are read apart).
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    pub model: Option<String>,
    /// Message objects, validated by [`crate::prompt::chat_input`].
    pub messages: Option<Value>,
    /// Chat API: a boolean; `top_logprobs` gives the count.
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
}

/// What a validated request asks for, independent of the endpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct Spec {
    pub params: SamplingParams,
    pub stream: bool,
    pub include_usage: bool,
}

fn finite(param: &str, v: f64, lo: f64, hi: f64, what: &str) -> Result<f32, Error> {
    if !v.is_finite() || v < lo || v > hi {
        return Err(Error::invalid(param, format!("`{param}` must be {what}; got {v}")));
    }
    Ok(v as f32)
}

/// Validates the sampling fields into engine parameters. `logprobs` is the
/// number of alternatives asked for (None: no logprobs).
pub fn sampling(s: &Sampling, logprobs: Option<u32>, default_max_tokens: u32) -> Result<Spec, Error> {
    let mut p = SamplingParams::default();
    if let Some(n) = s.n {
        if n < 1 || n > MAX_N as i64 {
            return Err(Error::invalid("n", format!("`n` must be between 1 and {MAX_N}; got {n}")));
        }
    }
    let max = match (s.max_completion_tokens, s.max_tokens) {
        (Some(m), _) => ("max_completion_tokens", Some(m)),
        (None, m) => ("max_tokens", m),
    };
    p.max_tokens = match max.1 {
        None => default_max_tokens,
        Some(m) if m < 1 => return Err(Error::invalid(max.0, format!("`{}` must be at least 1; got {m}", max.0))),
        Some(m) => u32::try_from(m).map_err(|_| Error::invalid(max.0, format!("`{}` is too large", max.0)))?,
    };
    if let Some(t) = s.temperature {
        p.temperature = finite("temperature", t, 0.0, 2.0, "between 0 and 2")?;
    }
    if let Some(t) = s.top_p {
        p.top_p = finite("top_p", t, 0.0, 1.0, "in (0, 1]")?;
        if p.top_p <= 0.0 {
            return Err(Error::invalid("top_p", "`top_p` must be in (0, 1]; got 0"));
        }
    }
    if let Some(k) = s.top_k {
        // -1 and 0 both mean "off" (vLLM uses -1).
        p.top_k = if k <= 0 { 0 } else { u32::try_from(k).map_err(|_| Error::invalid("top_k", "too large"))? };
    }
    if let Some(m) = s.min_p {
        p.min_p = finite("min_p", m, 0.0, 1.0, "in [0, 1)")?;
        if p.min_p >= 1.0 {
            return Err(Error::invalid("min_p", "`min_p` must be in [0, 1); got 1"));
        }
    }
    if let Some(v) = s.presence_penalty {
        p.presence_penalty = finite("presence_penalty", v, -2.0, 2.0, "between -2 and 2")?;
    }
    if let Some(v) = s.frequency_penalty {
        p.frequency_penalty = finite("frequency_penalty", v, -2.0, 2.0, "between -2 and 2")?;
    }
    if let Some(v) = s.repetition_penalty {
        p.repetition_penalty = finite("repetition_penalty", v, f64::MIN_POSITIVE, 10.0, "in (0, 10]")?;
    }
    if s.user.as_ref().is_some_and(|u| u.chars().count() > MAX_USER_CHARS) {
        return Err(Error::invalid("user", format!("`user` is longer than {MAX_USER_CHARS} characters")));
    }
    p.seed = s.seed;
    p.ignore_eos = s.ignore_eos;
    if let Some(v) = s.prompt_lookup {
        p.prompt_lookup = v;
    }
    p.stop_strings = match &s.stop {
        None => Vec::new(),
        Some(Stop::One(x)) => vec![x.clone()],
        Some(Stop::Many(v)) => v.clone(),
    };
    if p.stop_strings.len() > MAX_STOP {
        return Err(Error::invalid("stop", format!("at most {MAX_STOP} stop strings")));
    }
    if p.stop_strings.iter().any(String::is_empty) {
        return Err(Error::invalid("stop", "stop strings must not be empty"));
    }
    p.logprobs = logprobs;
    p.validate().map_err(|e| Error::invalid(e.field().unwrap_or("body"), e.to_string()))?;
    let include_usage = s.stream_options.as_ref().is_some_and(|o| o.include_usage);
    if s.stream_options.is_some() && !s.stream {
        return Err(Error::invalid("stream_options", "`stream_options` is only allowed with `stream: true`"));
    }
    Ok(Spec { params: p, stream: s.stream, include_usage })
}

/// The completions API's `logprobs` (an integer 0..=20, or absent).
pub fn completion_logprobs(v: Option<i64>) -> Result<Option<u32>, Error> {
    match v {
        None => Ok(None),
        Some(k) if (0..=i64::from(MAX_TOP_LOGPROBS)).contains(&k) => Ok(Some(k as u32)),
        Some(_) => Err(Error::invalid("logprobs", format!("`logprobs` must be an integer 0..={MAX_TOP_LOGPROBS}"))),
    }
}

/// The chat API's `logprobs` (bool) and `top_logprobs` (0..=20).
pub fn chat_logprobs(logprobs: Option<bool>, top: Option<i64>) -> Result<Option<u32>, Error> {
    let on = logprobs.unwrap_or(false);
    match (on, top) {
        (_, Some(k)) if !(0..=MAX_TOP_LOGPROBS as i64).contains(&k) => {
            Err(Error::invalid("top_logprobs", format!("`top_logprobs` must be between 0 and {MAX_TOP_LOGPROBS}")))
        }
        (false, Some(_)) => Err(Error::invalid("top_logprobs", "`top_logprobs` requires `logprobs: true`")),
        (false, None) => Ok(None),
        (true, k) => Ok(Some(k.unwrap_or(0) as u32)),
    }
}

/// `usage`.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
    /// Present when the worker reported how much of the prompt its prefix
    /// cache supplied (absent when the answer ended on this side before the
    /// worker's end arrived, e.g. on a stop string only the coordinator saw).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct PromptTokensDetails {
    /// Prompt tokens whose KV came from a prefix cache instead of being computed.
    pub cached_tokens: u32,
}

impl Usage {
    pub fn new(prompt: u32, completion: u32, cached: Option<u32>) -> Self {
        Self {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
            prompt_tokens_details: cached.map(|cached_tokens| PromptTokensDetails { cached_tokens }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_names_cached_tokens_only_when_known() -> Result<(), serde_json::Error> {
        let known = serde_json::to_value(Usage::new(40, 3, Some(32)))?;
        assert_eq!(known["total_tokens"], 43);
        assert_eq!(known["prompt_tokens_details"]["cached_tokens"], 32);
        let unknown = serde_json::to_value(Usage::new(40, 3, None))?;
        assert!(unknown.get("prompt_tokens_details").is_none(), "{unknown}");
        Ok(())
    }

    fn spec(json: &str) -> Result<Spec, Error> {
        let s: Sampling = serde_json::from_str(json).map_err(|e| Error::invalid("body", e.to_string()))?;
        sampling(&s, None, 16)
    }

    #[test]
    fn defaults_and_max_tokens() {
        let s = spec("{}").map_err(|e| e.to_string());
        assert_eq!(s.as_ref().map(|s| s.params.max_tokens), Ok(16));
        let s = spec(r#"{"max_tokens": 5, "max_completion_tokens": 7}"#).map_err(|e| e.to_string());
        assert_eq!(s.map(|s| s.params.max_tokens), Ok(7), "max_completion_tokens wins");
    }

    #[test]
    fn prompt_lookup_is_allowed_unless_the_request_says_false() {
        let lookup = |json: &str| spec(json).map(|s| s.params.prompt_lookup).map_err(|e| e.to_string());
        assert_eq!(lookup("{}"), Ok(true));
        assert_eq!(lookup(r#"{"prompt_lookup": null}"#), Ok(true));
        assert_eq!(lookup(r#"{"prompt_lookup": false}"#), Ok(false));
        assert_eq!(lookup(r#"{"prompt_lookup": true}"#), Ok(true));
        assert!(spec(r#"{"prompt_lookup": "no"}"#).is_err());
    }

    #[test]
    fn out_of_range_values_name_their_field() {
        for (json, param) in [
            (r#"{"max_tokens": 0}"#, "max_tokens"),
            (r#"{"max_completion_tokens": -3}"#, "max_completion_tokens"),
            (r#"{"temperature": 2.5}"#, "temperature"),
            (r#"{"temperature": -0.1}"#, "temperature"),
            (r#"{"top_p": 0}"#, "top_p"),
            (r#"{"top_p": 1.5}"#, "top_p"),
            (r#"{"presence_penalty": 3}"#, "presence_penalty"),
            (r#"{"frequency_penalty": -2.5}"#, "frequency_penalty"),
            (r#"{"n": 2}"#, "n"),
            (r#"{"stop": ["a", ""]}"#, "stop"),
            (r#"{"stop": ["a", "b", "c", "d", "e"]}"#, "stop"),
            (r#"{"stream_options": {"include_usage": true}}"#, "stream_options"),
        ] {
            let e = spec(json).err();
            assert_eq!(e.as_ref().and_then(Error::param), Some(param), "{json}: {e:?}");
            assert!(matches!(e, Some(Error::Invalid { .. })), "{json}: {e:?}");
        }
    }

    #[test]
    fn logprob_fields() {
        assert_eq!(chat_logprobs(Some(true), Some(3)).map_err(|e| e.to_string()), Ok(Some(3)));
        assert_eq!(chat_logprobs(None, None).map_err(|e| e.to_string()), Ok(None));
        assert!(chat_logprobs(None, Some(2)).is_err());
        assert!(chat_logprobs(Some(true), Some(21)).is_err());
        assert_eq!(completion_logprobs(Some(2)).map_err(|e| e.to_string()), Ok(Some(2)));
        assert!(completion_logprobs(Some(-1)).is_err());
    }
}
