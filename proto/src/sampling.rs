//! [`SamplingParams`] on the wire <-> [`types::sampling::SamplingParams`] (the engine's).
//!
//! Both directions destructure every field, so adding a field to either
//! struct fails to compile here until the mapping is extended. The wire
//! struct is a field-for-field mirror, so engine -> wire is infallible and
//! wire -> engine only has to validate.

use types::sampling::{SamplerError, SamplingParams as EngineParams};

use crate::worker::v1::SamplingParams;

impl From<&EngineParams> for SamplingParams {
    fn from(p: &EngineParams) -> Self {
        let EngineParams {
            temperature,
            top_k,
            top_p,
            min_p,
            seed,
            presence_penalty,
            frequency_penalty,
            repetition_penalty,
            max_tokens,
            stop_token_ids,
            stop_strings,
            logprobs,
            ignore_eos,
            prompt_lookup,
        } = p;
        Self {
            temperature: *temperature,
            top_p: *top_p,
            top_k: *top_k,
            min_p: *min_p,
            seed: *seed,
            presence_penalty: *presence_penalty,
            frequency_penalty: *frequency_penalty,
            repetition_penalty: *repetition_penalty,
            max_tokens: *max_tokens,
            stop_token_ids: stop_token_ids.clone(),
            stop_strings: stop_strings.clone(),
            logprobs: *logprobs,
            ignore_eos: *ignore_eos,
            prompt_lookup: *prompt_lookup,
        }
    }
}

impl TryFrom<&SamplingParams> for EngineParams {
    /// The first out-of-range field, as [`EngineParams::validate`] reports it
    /// ([`SamplerError::field`] names it; map with `WorkerError::from`).
    type Error = SamplerError;

    fn try_from(p: &SamplingParams) -> Result<Self, Self::Error> {
        let SamplingParams {
            temperature,
            top_p,
            top_k,
            min_p,
            seed,
            presence_penalty,
            frequency_penalty,
            repetition_penalty,
            max_tokens,
            stop_token_ids,
            stop_strings,
            logprobs,
            ignore_eos,
            prompt_lookup,
        } = p;
        let params = Self {
            temperature: *temperature,
            top_k: *top_k,
            top_p: *top_p,
            min_p: *min_p,
            seed: *seed,
            presence_penalty: *presence_penalty,
            frequency_penalty: *frequency_penalty,
            repetition_penalty: *repetition_penalty,
            max_tokens: *max_tokens,
            stop_token_ids: stop_token_ids.clone(),
            stop_strings: stop_strings.clone(),
            logprobs: *logprobs,
            ignore_eos: *ignore_eos,
            prompt_lookup: *prompt_lookup,
        };
        params.validate()?;
        Ok(params)
    }
}
