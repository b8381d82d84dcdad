//! How much prefill a step may take while sequences decode.
//!
//! A step runs every decoding sequence's next token together with prefill
//! chunks, so a long prompt's chunk delays each running stream's next token
//! by the chunk's compute time. With [`EngineConfig::max_decode_stall_ms`]
//! set, a step that carries decodes takes only as many prefill tokens as
//! fit in that time by the measured costs, and never less than one block, so
//! a prompt always progresses. Steps without decodes keep the whole
//! `max_batch_tokens`.
//!
//! The costs are measured, not configured: [`StepCost`] keeps a moving
//! average of the time of steps that carried only decodes, and of the time
//! per prefill token of steps that carried prefill (what they took beyond
//! their decodes' share). Attention grows with the prompt's position, and
//! the machine's load changes, so both follow the latest steps.
//!
//! [`EngineConfig::max_decode_stall_ms`]: super::EngineConfig::max_decode_stall_ms

/// Weight of the newest sample in the moving averages.
const ALPHA: f64 = 0.3;

/// Measured step costs.
#[derive(Debug, Clone, Default)]
pub(super) struct StepCost {
    /// A decodes-only step, ms.
    decode_ms: Option<f64>,
    /// One prefill token, ms.
    per_token_ms: Option<f64>,
}

fn blend(avg: &mut Option<f64>, sample: f64) {
    *avg = Some(match *avg {
        Some(a) => a + ALPHA * (sample - a),
        None => sample,
    });
}

impl StepCost {
    /// Records a step that ran `decodes` decode tokens and `prefill`
    /// prefill tokens in `ms`.
    pub fn observe(&mut self, decodes: usize, prefill: usize, ms: f64) {
        if !ms.is_finite() || ms < 0.0 {
            return;
        }
        if prefill == 0 {
            if decodes > 0 {
                blend(&mut self.decode_ms, ms);
            }
            return;
        }
        let decode_share = if decodes > 0 { self.decode_ms.unwrap_or(0.0) } else { 0.0 };
        blend(&mut self.per_token_ms, (ms - decode_share).max(0.0) / prefill as f64);
    }

    /// Prefill tokens a step with decodes may take to stay within
    /// `budget_ms`: at least `min` (one block). Before any prefill was
    /// measured, `min`: the first chunks are small, then grow to what the
    /// budget allows.
    pub fn allowance(&self, budget_ms: f64, min: usize) -> usize {
        let Some(per) = self.per_token_ms.filter(|p| *p > 0.0) else { return min };
        let spare = budget_ms - self.decode_ms.unwrap_or(0.0);
        if spare <= 0.0 {
            return min;
        }
        // Saturating: a tiny per-token cost must not overflow.
        let n = (spare / per).floor();
        if n >= usize::MAX as f64 {
            usize::MAX
        } else {
            (n as usize).max(min)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_measured_allows_one_block() {
        assert_eq!(StepCost::default().allowance(100.0, 16), 16);
    }

    #[test]
    fn the_allowance_is_what_fits_beside_the_decodes() {
        let mut c = StepCost::default();
        c.observe(2, 0, 20.0); // decodes alone: 20 ms
        c.observe(2, 100, 220.0); // 200 ms beyond the decodes for 100 tokens: 2 ms each
        assert_eq!(c.allowance(100.0, 16), 40); // (100 - 20) / 2
        assert_eq!(c.allowance(1000.0, 16), 490);
        // A budget the decodes alone exceed still lets one block through.
        assert_eq!(c.allowance(10.0, 16), 16);
    }

    #[test]
    fn prefill_only_steps_count_all_their_time_as_prefill() {
        let mut c = StepCost::default();
        c.observe(0, 50, 100.0);
        assert_eq!(c.allowance(60.0, 1), 30);
    }

    #[test]
    fn costs_follow_the_latest_steps() {
        let mut c = StepCost::default();
        c.observe(0, 100, 100.0); // 1 ms/token
        for _ in 0..30 {
            c.observe(0, 100, 400.0); // the machine got slower: 4 ms/token
        }
        let n = c.allowance(400.0, 1);
        assert!((99..=101).contains(&n), "{n}");
    }

    #[test]
    fn nonsense_times_are_ignored() {
        let mut c = StepCost::default();
        c.observe(1, 10, f64::NAN);
        c.observe(1, 10, -5.0);
        assert_eq!(c.allowance(100.0, 16), 16);
    }
}
