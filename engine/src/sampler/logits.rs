//! Checks on one row of logits and the repetition penalties, the steps that
//! run before the greedy / random split. Free functions over slices, so the
//! [`super::Sampler`] can lend them its reusable buffers.

use super::SamplerError;

/// Lanes of the argmax scan. Sixteen independent running maxima let LLVM
/// vectorise the loop (a single running max is a serial dependency chain).
const LANES: usize = 16;

/// Validates `logits` and finds the argmax in one pass. Ties go to the lowest
/// id: within a lane only a strictly greater value replaces the best, and
/// across lanes the lowest index among equal maxima wins. -inf is allowed (it
/// is how callers mask tokens); NaN and +inf are errors.
pub(super) fn scan(logits: &[f32]) -> Result<(usize, f32), SamplerError> {
    if logits.is_empty() {
        return Err(SamplerError::EmptyLogits);
    }
    let mut lane_max = [f32::NEG_INFINITY; LANES];
    // u32 lanes vectorise twice as wide as usize; token ids are u32 anyway.
    let mut lane_idx = [0u32; LANES];
    let mut nan = false;
    let chunks = logits.chunks_exact(LANES);
    let tail = chunks.remainder();
    for (c, chunk) in chunks.enumerate() {
        let base = (c * LANES) as u32;
        for (j, ((&v, m), idx)) in chunk.iter().zip(lane_max.iter_mut()).zip(lane_idx.iter_mut()).enumerate() {
            nan |= v.is_nan();
            // Selects rather than branches, so the loop stays vectorisable.
            let greater = v > *m;
            *m = if greater { v } else { *m };
            // Token ids are u32, so a real vocabulary never wraps this.
            *idx = if greater { base.wrapping_add(j as u32) } else { *idx };
        }
    }
    let mut max = f32::NEG_INFINITY;
    let mut best = 0;
    for (&m, &idx) in lane_max.iter().zip(&lane_idx) {
        let idx = idx as usize;
        if m > max || (m == max && idx < best) {
            max = m;
            best = idx;
        }
    }
    // The tail's ids are above every lane's, so strictly greater is the rule.
    let tail_start = logits.len() - tail.len();
    for (i, &v) in tail.iter().enumerate() {
        nan |= v.is_nan();
        if v > max {
            max = v;
            best = tail_start + i;
        }
    }
    if nan {
        let index = logits.iter().position(|v| v.is_nan()).unwrap_or(0);
        return Err(SamplerError::NanLogit { index });
    }
    if max == f32::INFINITY {
        return Err(SamplerError::InfiniteLogit { index: best });
    }
    if max == f32::NEG_INFINITY {
        return Err(SamplerError::AllLogitsMasked);
    }
    Ok((best, max))
}

/// Presence, frequency and repetition penalties of one request.
#[derive(Debug, Clone, Copy)]
pub(super) struct Penalties {
    pub(super) presence: f32,
    pub(super) frequency: f32,
    pub(super) repetition: f32,
}

impl Penalties {
    pub(super) fn is_active(&self) -> bool {
        self.presence != 0.0 || self.frequency != 0.0 || self.repetition != 1.0
    }

    /// Penalised logit of a token seen `count` (>= 1) times. Repetition first,
    /// then frequency and presence, the order of llama.cpp's penalties sampler
    /// and vLLM. Finite inputs stay finite so a tiny repetition penalty cannot
    /// overflow into +inf and break the softmax.
    fn apply(&self, logit: f32, count: usize) -> f32 {
        if logit == f32::NEG_INFINITY {
            return logit;
        }
        let v = if logit > 0.0 { logit / self.repetition } else { logit * self.repetition };
        let v = v - self.frequency * count as f32 - self.presence;
        v.clamp(f32::MIN, f32::MAX)
    }
}

/// Writes the penalised copy of `logits` into `out`. `scratch` is reused to
/// count occurrences by sorting (no hashing, deterministic, allocation-free
/// once warm).
pub(super) fn apply_penalties(
    p: &Penalties,
    logits: &[f32],
    history: &[u32],
    out: &mut Vec<f32>,
    scratch: &mut Vec<u32>,
) -> Result<(), SamplerError> {
    out.clear();
    out.extend_from_slice(logits);
    scratch.clear();
    scratch.extend_from_slice(history);
    scratch.sort_unstable();
    for run in scratch.chunk_by(|a, b| a == b) {
        let Some(&token) = run.first() else { continue };
        let slot =
            out.get_mut(token as usize).ok_or(SamplerError::HistoryTokenOutOfRange { token, vocab: logits.len() })?;
        *slot = p.apply(*slot, run.len());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use types::rng::XorShift64;

    #[test]
    fn scan_finds_first_max_and_rejects_bad_logits() {
        assert_eq!(scan(&[1.0, 3.0, 3.0, -2.0]), Ok((1, 3.0)));
        assert_eq!(scan(&[f32::NEG_INFINITY, -5.0]), Ok((1, -5.0)));
        assert_eq!(scan(&[]), Err(SamplerError::EmptyLogits));
        assert_eq!(scan(&[0.0, f32::NAN, 1.0]), Err(SamplerError::NanLogit { index: 1 }));
        assert_eq!(scan(&[f32::NAN]), Err(SamplerError::NanLogit { index: 0 }));
        assert_eq!(scan(&[0.0, f32::INFINITY]), Err(SamplerError::InfiniteLogit { index: 1 }));
        assert_eq!(scan(&[f32::NEG_INFINITY; 3]), Err(SamplerError::AllLogitsMasked));
    }

    /// The lane-parallel scan must agree with a plain first-maximum loop on
    /// ties across lanes, in the tail, and for errors anywhere.

    #[test]
    fn scan_lanes_match_scalar_reference() {
        let mut rng = XorShift64::seeded(5);
        for len in [1, 15, 16, 17, 33, 100, 1000] {
            for _ in 0..50 {
                // Few distinct values, so ties across lanes are common.
                let mut v: Vec<f32> = (0..len).map(|_| (rng.unit_f64() * 4.0).floor() as f32).collect();
                let pos = (rng.unit_f64() * len as f64) as usize;
                let mut want_best = 0;
                for (i, &x) in v.iter().enumerate() {
                    if x > v[want_best] {
                        want_best = i;
                    }
                }
                assert_eq!(scan(&v), Ok((want_best, v[want_best])), "len {len}");
                v[pos] = f32::NAN;
                assert_eq!(scan(&v), Err(SamplerError::NanLogit { index: pos }));
                v[pos] = f32::INFINITY;
                assert_eq!(scan(&v), Err(SamplerError::InfiniteLogit { index: pos }));
            }
        }
    }

    #[test]
    fn penalties_follow_documented_formulas() -> Result<(), SamplerError> {
        let p = Penalties { presence: 0.5, frequency: 0.25, repetition: 2.0 };
        let mut out = Vec::new();
        let mut scratch = Vec::new();
        let logits = [4.0, -4.0, 1.0, f32::NEG_INFINITY];
        apply_penalties(&p, &logits, &[0, 1, 1, 3, 0, 0], &mut out, &mut scratch)?;
        // token 0: 4/2 - 3*0.25 - 0.5; token 1: -4*2 - 2*0.25 - 0.5; token 2 unseen.
        assert_eq!(out, vec![0.75, -9.0, 1.0, f32::NEG_INFINITY]);

        let err = apply_penalties(&p, &logits, &[7], &mut out, &mut scratch);
        assert_eq!(err, Err(SamplerError::HistoryTokenOutOfRange { token: 7, vocab: 4 }));
        Ok(())
    }

    #[test]
    fn tiny_repetition_penalty_cannot_overflow() -> Result<(), SamplerError> {
        let p = Penalties { presence: 0.0, frequency: 0.0, repetition: 1e-30 };
        let mut out = Vec::new();
        apply_penalties(&p, &[1e10, -1e10], &[0, 1], &mut out, &mut Vec::new())?;
        assert_eq!(out, vec![f32::MAX, -1e10 * 1e-30]);
        Ok(())
    }
}
