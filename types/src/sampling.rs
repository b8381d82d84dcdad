//! Request-level sampling parameters, their validation, and the sampler's
//! error type.
//!
//! Ranges follow the OpenAI API where it defines one (penalties in [-2, 2],
//! `top_logprobs` <= 20) and vLLM elsewhere (`repetition_penalty` > 0,
//! `min_p` in [0, 1)). Every check is written as "value inside the allowed
//! range" so that NaN, which fails every comparison, is rejected too.

use serde::{Deserialize, Serialize};

/// Largest `logprobs` value accepted; the OpenAI API caps `top_logprobs` at 20.
pub const MAX_LOGPROBS: u32 = 20;

/// Largest magnitude of `presence_penalty` and `frequency_penalty` (OpenAI).
pub const MAX_ABS_PENALTY: f32 = 2.0;

/// How to pick each next token and when to stop. Build with struct-update
/// syntax over [`SamplingParams::default`] and call [`SamplingParams::validate`]
/// (the engine's `Sampler` and `StopChecker` constructors do).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Softmax temperature; `0.0` selects greedy (argmax) decoding. Finite, >= 0.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; `0` disables the filter.
    pub top_k: u32,
    /// Nucleus filter: keep the smallest set of tokens whose probability mass
    /// reaches `top_p`. In (0, 1]; `1.0` disables it.
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` times the most likely
    /// token's probability. In [0, 1); `0.0` disables it.
    pub min_p: f32,
    /// Seed for reproducible sampling; `None` seeds from process entropy.
    pub seed: Option<u64>,
    /// Subtracted once from the logit of every token already in the history
    /// (OpenAI semantics). In [-2, 2].
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per occurrence in the history
    /// (OpenAI semantics). In [-2, 2].
    pub frequency_penalty: f32,
    /// Divides positive logits and multiplies negative logits of tokens in the
    /// history (llama.cpp / HF semantics). Finite, > 0; `1.0` disables it.
    pub repetition_penalty: f32,
    /// Most tokens to generate; at least 1.
    pub max_tokens: u32,
    /// Token ids that end generation (honoured even with `ignore_eos`).
    pub stop_token_ids: Vec<u32>,
    /// Strings that end generation; the matched string is not emitted. Non-empty.
    pub stop_strings: Vec<String>,
    /// `Some(n)`: report the chosen token's logprob and the `n` most likely
    /// alternatives (n <= [`MAX_LOGPROBS`]). `None`: no logprobs.
    pub logprobs: Option<u32>,
    /// Keep generating past the model's end-of-sequence token(s).
    pub ignore_eos: bool,
    /// Allow prompt-lookup speculation where the worker runs it (its
    /// `prompt_lookup` draft length; 0 there: never). Tokens are the same
    /// either way; `false` only saves the verification compute.
    pub prompt_lookup: bool,
}

impl Default for SamplingParams {
    /// Greedy decoding, 256 tokens, every filter and penalty off.
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            max_tokens: 256,
            stop_token_ids: Vec::new(),
            stop_strings: Vec::new(),
            logprobs: None,
            ignore_eos: false,
            prompt_lookup: true,
        }
    }
}

impl SamplingParams {
    /// Checks every field's range; the first bad field is returned as a
    /// [`SamplerError`] that names it and carries the offending value.
    pub fn validate(&self) -> Result<(), SamplerError> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(SamplerError::InvalidTemperature(self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplerError::InvalidTopP(self.top_p));
        }
        if !(self.min_p >= 0.0 && self.min_p < 1.0) {
            return Err(SamplerError::InvalidMinP(self.min_p));
        }
        if !in_penalty_range(self.presence_penalty) {
            return Err(SamplerError::InvalidPresencePenalty(self.presence_penalty));
        }
        if !in_penalty_range(self.frequency_penalty) {
            return Err(SamplerError::InvalidFrequencyPenalty(self.frequency_penalty));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return Err(SamplerError::InvalidRepetitionPenalty(self.repetition_penalty));
        }
        if self.max_tokens == 0 {
            return Err(SamplerError::ZeroMaxTokens);
        }
        if let Some(index) = self.stop_strings.iter().position(String::is_empty) {
            return Err(SamplerError::EmptyStopString { index });
        }
        if let Some(n) = self.logprobs {
            if n > MAX_LOGPROBS {
                return Err(SamplerError::TooManyLogprobs(n));
            }
        }
        Ok(())
    }

    /// Whether `sample` ignores the RNG and takes the argmax: temperature 0,
    /// or so close to 0 (subnormal) that `1 / temperature` overflows, where
    /// sampling would converge to the argmax anyway.
    pub fn is_greedy(&self) -> bool {
        self.temperature < f32::MIN_POSITIVE
    }
}

fn in_penalty_range(v: f32) -> bool {
    (-MAX_ABS_PENALTY..=MAX_ABS_PENALTY).contains(&v)
}

/// Why sampling parameters were rejected or a sampling step failed.
///
/// The `Invalid*`, `ZeroMaxTokens`, `EmptyStopString` and `TooManyLogprobs`
/// variants are the client's fault (HTTP 400; [`SamplerError::field`] names
/// the request field). The logit and history variants mean the engine fed the
/// sampler bad data (a model or batching bug), see
/// [`SamplerError::is_invalid_input`].
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplerError {
    /// `temperature` was negative, NaN or infinite.
    #[error("temperature must be finite and >= 0, got {0}")]
    InvalidTemperature(f32),
    /// `top_p` was outside (0, 1].
    #[error("top_p must be in (0, 1], got {0}")]
    InvalidTopP(f32),
    /// `min_p` was outside [0, 1).
    #[error("min_p must be in [0, 1), got {0}")]
    InvalidMinP(f32),
    /// `presence_penalty` was outside [-2, 2].
    #[error("presence_penalty must be in [-2, 2], got {0}")]
    InvalidPresencePenalty(f32),
    /// `frequency_penalty` was outside [-2, 2].
    #[error("frequency_penalty must be in [-2, 2], got {0}")]
    InvalidFrequencyPenalty(f32),
    /// `repetition_penalty` was not a finite number > 0.
    #[error("repetition_penalty must be finite and > 0, got {0}")]
    InvalidRepetitionPenalty(f32),
    /// `max_tokens` was 0.
    #[error("max_tokens must be >= 1, got 0")]
    ZeroMaxTokens,
    /// `stop_strings[index]` was empty (it would match before any text).
    #[error("stop_strings[{index}] is empty")]
    EmptyStopString {
        /// Position of the empty string in `stop_strings`.
        index: usize,
    },
    /// `logprobs` asked for more than [`MAX_LOGPROBS`] alternatives.
    #[error("logprobs must be <= {MAX_LOGPROBS}, got {0}")]
    TooManyLogprobs(u32),
    /// `sample` was given an empty logit slice.
    #[error("logits are empty")]
    EmptyLogits,
    /// A logit was NaN (usually a numerical blow-up in the model).
    #[error("logit {index} is NaN")]
    NanLogit {
        /// Token id of the NaN logit.
        index: usize,
    },
    /// A logit was +infinity; softmax over it is undefined.
    #[error("logit {index} is +infinity")]
    InfiniteLogit {
        /// Token id of the infinite logit.
        index: usize,
    },
    /// Every logit was -infinity, so no token can be chosen.
    #[error("every logit is -infinity; no token can be sampled")]
    AllLogitsMasked,
    /// A history token id does not index the logits (vocab mismatch).
    #[error("history token {token} is outside the vocabulary of {vocab} logits")]
    HistoryTokenOutOfRange {
        /// The offending token id.
        token: u32,
        /// Number of logits passed to `sample`.
        vocab: usize,
    },
}

impl SamplerError {
    /// The request field at fault, for errors caused by the client's request.
    pub fn field(&self) -> Option<&'static str> {
        match self {
            Self::InvalidTemperature(_) => Some("temperature"),
            Self::InvalidTopP(_) => Some("top_p"),
            Self::InvalidMinP(_) => Some("min_p"),
            Self::InvalidPresencePenalty(_) => Some("presence_penalty"),
            Self::InvalidFrequencyPenalty(_) => Some("frequency_penalty"),
            Self::InvalidRepetitionPenalty(_) => Some("repetition_penalty"),
            Self::ZeroMaxTokens => Some("max_tokens"),
            Self::EmptyStopString { .. } => Some("stop"),
            Self::TooManyLogprobs(_) => Some("logprobs"),
            Self::EmptyLogits
            | Self::NanLogit { .. }
            | Self::InfiniteLogit { .. }
            | Self::AllLogitsMasked
            | Self::HistoryTokenOutOfRange { .. } => None,
        }
    }

    /// True when the request was bad (reject it, do not retry); false when the
    /// engine produced bad logits or history (an internal error).
    pub fn is_invalid_input(&self) -> bool {
        self.field().is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = SamplingParams::default();
        f(&mut p);
        p
    }

    #[test]
    fn default_is_valid_greedy() {
        let p = SamplingParams::default();
        assert_eq!(p.validate(), Ok(()));
        assert!(p.is_greedy());
        assert_eq!(p.max_tokens, 256);
        assert_eq!(p.repetition_penalty, 1.0);
        assert_eq!(p.top_p, 1.0);
    }

    #[test]
    fn boundary_values_are_accepted() {
        let p = with(|p| {
            p.temperature = 2.0;
            p.top_p = 1.0;
            p.min_p = 0.0;
            p.presence_penalty = -2.0;
            p.frequency_penalty = 2.0;
            p.repetition_penalty = 0.01;
            p.max_tokens = 1;
            p.stop_strings = vec!["x".into()];
            p.logprobs = Some(MAX_LOGPROBS);
        });
        assert_eq!(p.validate(), Ok(()));
    }

    #[test]
    fn each_bad_field_is_named() {
        let cases: Vec<(SamplingParams, SamplerError, &str)> = vec![
            (with(|p| p.temperature = -0.1), SamplerError::InvalidTemperature(-0.1), "temperature"),
            (with(|p| p.temperature = f32::INFINITY), SamplerError::InvalidTemperature(f32::INFINITY), "temperature"),
            (with(|p| p.top_p = 0.0), SamplerError::InvalidTopP(0.0), "top_p"),
            (with(|p| p.top_p = 1.5), SamplerError::InvalidTopP(1.5), "top_p"),
            (with(|p| p.min_p = 1.0), SamplerError::InvalidMinP(1.0), "min_p"),
            (with(|p| p.min_p = -0.5), SamplerError::InvalidMinP(-0.5), "min_p"),
            (with(|p| p.presence_penalty = 2.5), SamplerError::InvalidPresencePenalty(2.5), "presence_penalty"),
            (with(|p| p.frequency_penalty = -3.0), SamplerError::InvalidFrequencyPenalty(-3.0), "frequency_penalty"),
            (with(|p| p.repetition_penalty = 0.0), SamplerError::InvalidRepetitionPenalty(0.0), "repetition_penalty"),
            (with(|p| p.repetition_penalty = -1.0), SamplerError::InvalidRepetitionPenalty(-1.0), "repetition_penalty"),
            (with(|p| p.max_tokens = 0), SamplerError::ZeroMaxTokens, "max_tokens"),
            (
                with(|p| p.stop_strings = vec!["ok".into(), String::new()]),
                SamplerError::EmptyStopString { index: 1 },
                "stop",
            ),
            (with(|p| p.logprobs = Some(21)), SamplerError::TooManyLogprobs(21), "logprobs"),
        ];
        for (params, want, field) in cases {
            let got = params.validate().expect_err("params must be rejected");
            assert_eq!(got, want);
            assert_eq!(got.field(), Some(field));
            assert!(got.is_invalid_input());
            // The message names the field so a 400 response is self-explaining.
            assert!(got.to_string().contains(field), "{got}");
        }
    }

    #[test]
    fn nan_is_rejected_for_every_float_field() {
        type Setter = fn(&mut SamplingParams, f32);
        let nan = f32::NAN;
        let fields: [(&str, Setter); 6] = [
            ("temperature", |p, v| p.temperature = v),
            ("top_p", |p, v| p.top_p = v),
            ("min_p", |p, v| p.min_p = v),
            ("presence_penalty", |p, v| p.presence_penalty = v),
            ("frequency_penalty", |p, v| p.frequency_penalty = v),
            ("repetition_penalty", |p, v| p.repetition_penalty = v),
        ];
        for (name, set) in fields {
            let mut p = SamplingParams::default();
            set(&mut p, nan);
            let err = p.validate().expect_err("NaN must be rejected");
            assert_eq!(err.field(), Some(name));
            assert!(err.to_string().contains("NaN"), "{err}");
        }
    }

    #[test]
    fn engine_errors_are_not_client_errors() {
        for e in [
            SamplerError::EmptyLogits,
            SamplerError::NanLogit { index: 3 },
            SamplerError::InfiniteLogit { index: 3 },
            SamplerError::AllLogitsMasked,
            SamplerError::HistoryTokenOutOfRange { token: 9, vocab: 4 },
        ] {
            assert_eq!(e.field(), None);
            assert!(!e.is_invalid_input());
        }
    }

    #[test]
    fn deserializes_with_defaults_for_missing_fields() -> Result<(), serde_json::Error> {
        let p: SamplingParams = serde_json::from_str(r#"{"temperature":0.7,"seed":5}"#)?;
        assert_eq!(p.temperature, 0.7);
        assert_eq!(p.seed, Some(5));
        assert_eq!(p.max_tokens, 256);
        Ok(())
    }
}
