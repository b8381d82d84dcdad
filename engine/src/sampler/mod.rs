//! Token sampling and stop detection: pure computation, no I/O, no model.
//!
//! [`Sampler`] turns one row of logits into a token; [`StopChecker`] decides
//! when a sequence ends and which text may be streamed. Both are built per
//! sequence from a validated [`SamplingParams`].
//!
//! Design choices, stated once:
//!
//! * **Pipeline order.** penalties -> greedy argmax, or penalties ->
//!   temperature -> min-p -> top-k -> top-p -> draw. The filter order is
//!   vLLM v1's; each filter sees the distribution renormalised over what the
//!   previous one kept (HF semantics). `temperature == 0` (or subnormal, whose
//!   reciprocal overflows) is greedy and ignores the filters, which could not
//!   change the argmax anyway.
//! * **Penalties apply over `history`, which the caller chooses.** The engine
//!   passes the tokens generated so far, which is OpenAI's definition for
//!   presence/frequency penalties. `repetition_penalty` uses the same window
//!   (HF and llama.cpp also count the prompt; a caller wanting that passes
//!   prompt + generated). Order and formulas: divide positive / multiply
//!   negative logits by `repetition_penalty`, then subtract
//!   `count * frequency_penalty + presence_penalty`.
//! * **Logprobs are from the raw logits**: the log-softmax before penalties
//!   and temperature, like llama.cpp's `n_probs`. They describe what the model
//!   predicted, independent of request knobs, and are comparable across
//!   requests. The chosen token is always reported, even if filters or
//!   penalties made it a less likely pick than the raw numbers suggest.
//! * **Ties** go to the lower token id everywhere (greedy, top-k, top-p, the
//!   logprob list), so results do not depend on selection-algorithm details.
//! * **Cost for a 49k vocabulary.** Greedy without penalties is one
//!   vectorisable pass that both validates and takes the argmax. Penalties
//!   add a copy of the logits and a sort of the (short) history. Without
//!   top-k/top-p the draw needs no ranking: one pass of weights (min-p is a
//!   logit-space comparison in it) and a cumulative scan. Top-k is an O(n)
//!   `select_nth_unstable`; top-p first prunes tokens too light to reach the
//!   nucleus (a bound from the total mass), then sorts the rest in growing
//!   chunks until the mass is reached. Candidates are packed (logit, id) `u64`
//!   keys, so selection and sorting compare integers. Nothing sorts the whole
//!   vocabulary, and buffers are reused across steps.
//! * **Randomness is by position.** Token `n` of a sequence is drawn with
//!   [`uniform`]`(seed, n)`, a counter-based generator (Philox4x32-10, the
//!   private `rng` module): a pure function of the seed and the draw index,
//!   so prompt + emitted tokens + seed fully determine the rest of an answer,
//!   wherever it is computed ([`SAMPLER_VERSION`] names the contract). Index
//!   0 is the token sampled at the end of prefill. Unseeded samplers draw a
//!   seed from std's per-process random keys and expose it via
//!   [`Sampler::seed`].
//! * **Bad logits are errors, not guesses.** NaN or +inf logits, an empty
//!   slice, all tokens masked to -inf, or a history id outside the vocabulary
//!   are typed [`SamplerError`]s; -inf alone is a valid mask.

mod filter;
mod logits;
mod logprobs;
mod rng;
mod stop;

pub use rng::{uniform, SAMPLER_VERSION};

use serde::Serialize;

pub use stop::{FinishReason, StopChecker, StopDecision};
use types::sampling::{SamplerError, SamplingParams};

use filter::Filters;
use logits::Penalties;

/// A seed for a request that came without one, from process entropy: a
/// worker assigns it before sampling so it can report what it drew with.
pub fn fresh_seed() -> u64 {
    rng::entropy_seed()
}

/// One sampled token and, if requested, its logprobs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SampledToken {
    /// The chosen token id.
    pub id: u32,
    /// Raw log-probability of `id`; `Some` iff the request asked for logprobs.
    pub logprob: Option<f32>,
    /// The `n` most likely tokens under the raw logits with their
    /// log-probabilities, by descending logprob, ties by lower id. Empty when
    /// logprobs were not requested or `n == 0`; masked (-inf) tokens omitted.
    pub top: Vec<(u32, f32)>,
}

/// Per-sequence sampler: the request's knobs, its RNG, and scratch buffers.
#[derive(Debug, Clone)]
pub struct Sampler {
    greedy: bool,
    filters: Filters,
    penalties: Penalties,
    logprobs: Option<u32>,
    seed: u64,
    /// Penalised copy of the logits (only filled when penalties apply).
    penalized: Vec<f32>,
    /// Sorted copy of the history, used to count occurrences.
    history_sorted: Vec<u32>,
    /// Packed (logit, id) ranking keys of the candidates for top-k / top-p.
    keys: Vec<u64>,
    /// Per-token weights when no ranking filter is set.
    weights: Vec<f32>,
}

impl Sampler {
    /// Validates `params` and seeds the RNG from `params.seed`, or from
    /// process entropy when it is `None`.
    pub fn new(params: &SamplingParams) -> Result<Self, SamplerError> {
        params.validate()?;
        let seed = params.seed.unwrap_or_else(rng::entropy_seed);
        Ok(Self {
            greedy: params.is_greedy(),
            filters: Filters {
                temperature: params.temperature,
                top_k: params.top_k,
                top_p: params.top_p,
                min_p: params.min_p,
            },
            penalties: Penalties {
                presence: params.presence_penalty,
                frequency: params.frequency_penalty,
                repetition: params.repetition_penalty,
            },
            logprobs: params.logprobs,
            seed,
            penalized: Vec::new(),
            history_sorted: Vec::new(),
            keys: Vec::new(),
            weights: Vec::new(),
        })
    }

    /// The seed of this sampler's draws (the drawn one if unseeded).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Picks token `draw` of the sequence (its index among the generated
    /// tokens: 0 for the one sampled at the end of prefill) from one row of
    /// `logits` (one per vocabulary id). The same row, history and index give
    /// the same token, whatever was sampled before.
    ///
    /// `history` is the token sequence the penalties count (see the module
    /// docs; the engine passes the generated tokens). It is only read, and
    /// only checked against the vocabulary, when a penalty is active.
    pub fn sample(&mut self, logits: &[f32], history: &[u32], draw: u64) -> Result<SampledToken, SamplerError> {
        let (raw_best, raw_max) = logits::scan(logits)?;
        let (values, best, max) = if self.penalties.is_active() && !history.is_empty() {
            logits::apply_penalties(&self.penalties, logits, history, &mut self.penalized, &mut self.history_sorted)?;
            let (best, max) = logits::scan(&self.penalized)?;
            (self.penalized.as_slice(), best, max)
        } else {
            (logits, raw_best, raw_max)
        };

        let id = if self.greedy {
            best as u32
        } else {
            // The top token always survives with weight 1, so the fallback is
            // unreachable; it keeps a logic slip from becoming a panic.
            let u = rng::uniform(self.seed, draw);
            filter::sample_random(values, max, &self.filters, &mut self.keys, &mut self.weights, u)
                .unwrap_or(best as u32)
        };

        let (logprob, top) = match self.logprobs {
            Some(n) => {
                let (lp, top) = logprobs::logprobs(logits, raw_max, id, n as usize);
                (Some(lp), top)
            }
            None => (None, Vec::new()),
        };
        Ok(SampledToken { id, logprob, top })
    }
}

#[cfg(test)]
mod tests;
