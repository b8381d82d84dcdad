//! Log-probabilities for the response, taken from the raw logits (before
//! penalties and temperature; see the module docs of [`super`] for why).

/// Log-softmax of the chosen token and the `n` most likely tokens, from the
/// raw logits. `max` is the largest raw logit. Tokens at -inf (masked) have
/// no probability and are left out of the top list.
pub(super) fn logprobs(logits: &[f32], max: f32, chosen: u32, n: usize) -> (f32, Vec<(u32, f32)>) {
    // f32 exp is plenty for a normaliser summed in f64, and about twice as
    // fast as f64 exp over a 49k vocabulary.
    let sum: f64 = logits.iter().map(|&l| f64::from((l - max).exp())).sum();
    let lse = f64::from(max) + sum.ln();
    let logprob = |l: f32| (f64::from(l) - lse) as f32;
    let chosen_lp = logits.get(chosen as usize).map_or(f32::NEG_INFINITY, |&l| logprob(l));
    let top = top_n(logits, n).into_iter().map(|(id, l)| (id, logprob(l))).collect();
    (chosen_lp, top)
}

/// The `n` largest finite logits, descending, ties by lower id. One pass with
/// a small sorted buffer: n <= 20, and after the first few hundred tokens
/// almost every value fails the single comparison against the buffer's tail.
fn top_n(logits: &[f32], n: usize) -> Vec<(u32, f32)> {
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
    if n == 0 {
        return top;
    }
    for (i, &l) in logits.iter().enumerate() {
        if l == f32::NEG_INFINITY {
            continue;
        }
        if top.len() == n && top.last().is_some_and(|&(_, last)| l <= last) {
            continue;
        }
        // Ids arrive in increasing order, so an equal value goes after the
        // existing ones: the lower id keeps the better rank.
        let pos = top.partition_point(|&(_, v)| v >= l);
        top.insert(pos, (i as u32, l));
        top.truncate(n);
    }
    top
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_n_orders_by_value_then_id_and_skips_masked() {
        let logits = [1.0, 3.0, f32::NEG_INFINITY, 3.0, 2.0, 3.0];
        assert_eq!(top_n(&logits, 4), vec![(1, 3.0), (3, 3.0), (5, 3.0), (4, 2.0)]);
        assert_eq!(top_n(&logits, 0), vec![]);
        assert_eq!(top_n(&logits, 20).len(), 5);
    }

    #[test]
    fn logprobs_of_uniform_and_masked() {
        let logits = [0.0, 0.0, f32::NEG_INFINITY, 0.0];
        let (chosen, top) = logprobs(&logits, 0.0, 2, 4);
        assert_eq!(chosen, f32::NEG_INFINITY, "a masked token has no mass");
        let third = (1.0f32 / 3.0).ln();
        assert_eq!(top.len(), 3);
        for (want, &(id, lp)) in [0u32, 1, 3].iter().zip(&top) {
            assert_eq!(id, *want);
            assert!((lp - third).abs() < 1e-6, "{lp}");
        }
    }

    #[test]
    fn large_logits_do_not_overflow() {
        let (chosen, top) = logprobs(&[1e30, 1e30 - 1e24, -1e30], 1e30, 0, 1);
        assert!(chosen.is_finite() && chosen <= 0.0, "{chosen}");
        assert_eq!(top.first().map(|t| t.0), Some(0));
    }
}
