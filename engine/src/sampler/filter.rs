//! The random path: temperature, min-p, top-k, top-p, and the draw.
//!
//! Ordering everywhere is "higher logit first, then lower token id", so every
//! tie (top-k cut, top-p cut) resolves the same way as greedy does.

/// Temperature and truncation filters for the random (non-greedy) path.
#[derive(Debug, Clone, Copy)]
pub(super) struct Filters {
    pub(super) temperature: f32,
    pub(super) top_k: u32,
    pub(super) top_p: f32,
    pub(super) min_p: f32,
}

impl Filters {
    /// Smallest logit min-p keeps: p_i >= min_p * p_max is
    /// `l >= max + T * ln(min_p)`, a comparison per token instead of an exp.
    /// -inf when min-p is off.
    fn min_logit(&self, max: f32) -> f32 {
        let t = f64::from(self.temperature);
        (f64::from(max) + t * f64::from(self.min_p).ln()) as f32
    }
}

/// Unnormalised probability of `logit`: `exp((logit - max) / T)`, in (0, 1].
/// f32 is enough: it only underflows below 1e-38 of the top token.
fn weight(logit: f32, max: f32, inv_t: f32) -> f32 {
    ((logit - max) * inv_t).exp()
}

/// Draws a token from `values` after temperature, min-p, top-k and top-p,
/// with `draw` (uniform in [0, 1)) choosing it by cumulative weight. `max`
/// must be the largest value in `values` (which holds no NaN or +inf); `keys`
/// and `weights` are scratch buffers. `None` only if every weight is 0, which
/// cannot happen because the top token has weight 1.
pub(super) fn sample_random(
    values: &[f32],
    max: f32,
    f: &Filters,
    keys: &mut Vec<u64>,
    weights: &mut Vec<f32>,
    draw: f64,
) -> Option<u32> {
    let inv_t = 1.0 / f.temperature;
    if f.top_k == 0 && f.top_p >= 1.0 {
        // No ranking needed: draw straight from the (min-p masked) weights.
        let min_logit = f.min_logit(max);
        weights.clear();
        weights.extend(values.iter().map(|&l| if l >= min_logit { weight(l, max, inv_t) } else { 0.0 }));
        let total: f64 = weights.iter().map(|&w| f64::from(w)).sum();
        let u = draw * total;
        let mut cum = 0.0;
        for (i, &w) in weights.iter().enumerate() {
            cum += f64::from(w);
            if u < cum {
                return Some(i as u32);
            }
        }
        // `u` fell in the rounding sliver at the very end.
        return weights.iter().rposition(|&w| w > 0.0).map(|i| i as u32);
    }
    candidates(values, max, f, keys);
    let total: f64 = keys.iter().map(|&k| f64::from(key_weight(k, max, inv_t))).sum();
    let u = draw * total;
    let mut cum = 0.0;
    for &k in keys.iter() {
        cum += f64::from(key_weight(k, max, inv_t));
        if u < cum {
            return Some(key_id(k));
        }
    }
    keys.iter().rev().find(|&&k| key_weight(k, max, inv_t) > 0.0).map(|&k| key_id(k))
}

/// Candidates are packed into one `u64` whose ascending order is "higher
/// logit first, then lower id": the high half is the logit mapped to an
/// order-preserving integer, the low half the inverted id, and the whole is
/// inverted. Selection and sorting then compare plain integers, several times
/// faster than a float comparator with a tie-break, and the ordering is total.
fn key(id: u32, logit: f32) -> u64 {
    // Adding 0.0 turns -0.0 into +0.0 so equal logits tie on id alone.
    let bits = (logit + 0.0).to_bits();
    let ordered = if bits >> 31 == 1 { !bits } else { bits | 1 << 31 };
    !((u64::from(ordered) << 32) | u64::from(!id))
}

fn key_id(key: u64) -> u32 {
    !(!key as u32)
}

fn key_logit(key: u64) -> f32 {
    let ordered = (!key >> 32) as u32;
    let bits = if ordered >> 31 == 1 { ordered & !(1 << 31) } else { !ordered };
    f32::from_bits(bits)
}

fn key_weight(key: u64, max: f32, inv_t: f32) -> f32 {
    weight(key_logit(key), max, inv_t)
}

/// First sorted chunk for top-p. Most nucleus sets at top_p ~0.9 hold tens of
/// tokens, so one partial selection of this size usually settles it.
const TOP_P_FIRST_CHUNK: usize = 64;

/// Fills `keys` with the tokens that survive, in vLLM v1's order: temperature,
/// then min-p, then top-k, then top-p (over the top-k survivors, renormalised).
/// min-p goes first because it is one comparison per token and shrinks the set
/// before any selection work; its cut is relative to the top token, so it does
/// not depend on what the other filters removed.
fn candidates(values: &[f32], max: f32, f: &Filters, keys: &mut Vec<u64>) {
    let inv_t = 1.0 / f.temperature;
    let p = f64::from(f.top_p);
    let min_logit = f.min_logit(max);
    // -inf must go even when min-p is off (min_logit is then -inf).
    let eligible = |l: f32| l >= min_logit && l > f32::NEG_INFINITY;
    let mut floor = min_logit;
    let mut total = None;
    if f.top_k == 0 && p < 1.0 {
        // Top-p alone: prune before ranking. Let c = (1 - p) * Z / n. The
        // tokens below weight c are the lowest-ranked and hold less than
        // n * c = (1 - p) * Z together, so the tokens above c already hold
        // more than p * Z: the nucleus (the shortest top prefix reaching p * Z)
        // ends before any token below c. Halving c leaves a margin for the
        // rounding of the logit-space cut. Z is also the top-p normaliser.
        let (z, n) = values
            .iter()
            .filter(|&&l| eligible(l))
            .fold((0.0f64, 0usize), |(z, n), &l| (z + f64::from(weight(l, max, inv_t)), n + 1));
        let cut = 0.5 * (1.0 - p) * z / n.max(1) as f64;
        let cut_logit = (f64::from(max) + f64::from(f.temperature) * cut.ln()) as f32;
        floor = floor.max(cut_logit);
        total = Some(z);
    }
    keys.clear();
    keys.extend(values.iter().enumerate().filter(|&(_, &l)| l >= floor && eligible(l)).map(|(i, &l)| key(i as u32, l)));
    let k = f.top_k as usize;
    if k > 0 && k < keys.len() {
        // O(n) selection; the k survivors stay unsorted unless top-p needs them.
        keys.select_nth_unstable(k - 1);
        keys.truncate(k);
    }
    if p < 1.0 {
        let total = total.unwrap_or_else(|| keys.iter().map(|&k| f64::from(key_weight(k, max, inv_t))).sum());
        top_p(keys, max, inv_t, p * total);
    }
}

/// Truncates `keys` to the smallest highest-ranked prefix whose weight sum
/// reaches `target`, leaving that prefix sorted. Instead of sorting the whole
/// vocabulary it sorts growing chunks: select the next `chunk` best with
/// `select_nth_unstable` (O(n)), sort only them, and stop once the mass is
/// reached; the chunk grows 4x so a flat distribution costs O(n log n) at
/// worst, no more than a full sort.
fn top_p(keys: &mut Vec<u64>, max: f32, inv_t: f32, target: f64) {
    let mut cum = 0.0;
    let mut sorted = 0;
    let mut chunk = TOP_P_FIRST_CHUNK;
    while sorted < keys.len() {
        let end = (sorted + chunk).min(keys.len());
        let rest = &mut keys[sorted..];
        let take = end - sorted;
        if take < rest.len() {
            rest.select_nth_unstable(take - 1);
        }
        rest[..take].sort_unstable();
        for i in sorted..end {
            cum += f64::from(key_weight(keys[i], max, inv_t));
            if cum >= target {
                keys.truncate(i + 1);
                return;
            }
        }
        sorted = end;
        chunk = chunk.saturating_mul(4);
    }
    // Rounding kept the sum just under the target: keep everything.
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filters(temperature: f32, top_k: u32, top_p: f32, min_p: f32) -> Filters {
        Filters { temperature, top_k, top_p, min_p }
    }

    fn kept(logits: &[f32], f: Filters) -> Vec<u32> {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut keys = Vec::new();
        candidates(logits, max, &f, &mut keys);
        let mut ids: Vec<u32> = keys.iter().map(|&k| key_id(k)).collect();
        ids.sort_unstable();
        ids
    }

    #[test]
    fn keys_sort_by_logit_then_id_and_round_trip() {
        let vals = [(3, 1.5f32), (1, -0.0), (2, 0.0), (0, -7.25), (9, 1.5), (4, f32::MAX), (5, f32::MIN), (6, 1e-40)];
        let mut keys: Vec<u64> = vals.iter().map(|&(id, l)| key(id, l)).collect();
        keys.sort_unstable();
        let order: Vec<u32> = keys.iter().map(|&k| key_id(k)).collect();
        assert_eq!(order, vec![4, 3, 9, 6, 1, 2, 0, 5]);
        for &(id, l) in &vals {
            assert_eq!(key_id(key(id, l)), id);
            assert_eq!(key_logit(key(id, l)), l + 0.0);
        }
    }

    #[test]
    fn min_p_top_k_top_p_and_masking() {
        // Probabilities at T=1 are proportional to 8:4:2:1 (ln of each).
        let logits = [8f32.ln(), 4f32.ln(), 2f32.ln(), 1f32.ln(), f32::NEG_INFINITY];
        let all = filters(1.0, 0, 1.0, 0.0);
        assert_eq!(kept(&logits, all), vec![0, 1, 2, 3], "-inf is always dropped");
        let min_p = filters(1.0, 0, 1.0, 0.2);
        assert_eq!(kept(&logits, min_p), vec![0, 1, 2], "1/8 < 0.2 is dropped");
        assert_eq!(kept(&logits, filters(1.0, 2, 1.0, 0.0)), vec![0, 1]);
        let big_k = filters(1.0, 9, 1.0, 0.0);
        assert_eq!(kept(&logits, big_k), vec![0, 1, 2, 3], "k above vocab");
        // Top-p over 8:4:2:1 = 0.533, 0.8, 0.933, 1.0 cumulative.
        assert_eq!(kept(&logits, filters(1.0, 0, 0.79, 0.0)), vec![0, 1]);
        assert_eq!(kept(&logits, filters(1.0, 0, 0.81, 0.0)), vec![0, 1, 2]);
        // Top-p renormalises over the top-k survivors: 8:4 -> 0.667, 1.0.
        assert_eq!(kept(&logits, filters(1.0, 2, 0.6, 0.0)), vec![0]);
        // Temperature sharpens before min-p: at T=0.5 the weights are 64:16:4:1.
        assert_eq!(kept(&logits, filters(0.5, 0, 1.0, 0.2)), vec![0, 1]);
    }

    #[test]
    fn top_k_ties_keep_lower_ids() {
        let logits = [1.0, 2.0, 2.0, 2.0, 0.0];
        assert_eq!(kept(&logits, filters(0.5, 2, 1.0, 0.0)), vec![1, 2]);
    }

    /// The pruned, chunked top-p must keep exactly what a full sort keeps,
    /// on a flat distribution (nucleus spans several chunk growths) and a
    /// peaked one (nucleus inside the first chunk), with and without min-p.

    #[test]
    fn chunked_top_p_matches_full_sort_on_large_vocab() {
        let mut rng = types::rng::XorShift64::seeded(99);
        let flat: Vec<f32> = (0..49_152).map(|_| (rng.unit_f64() * 3.0) as f32).collect();
        let peaked: Vec<f32> = (0..49_152).map(|_| (rng.unit_f64().powi(8) * 30.0) as f32).collect();
        for logits in [&flat, &peaked] {
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            for (top_p, min_p) in [(0.001f32, 0.0), (0.3, 0.0), (0.9, 0.0), (0.999, 0.0), (0.9, 0.5)] {
                let temperature = 0.8;
                let inv_t = 1.0 / temperature;
                let mut got = Vec::new();
                let f = filters(temperature, 0, top_p, min_p);
                candidates(logits, max, &f, &mut got);

                let mut all = Vec::new();
                candidates(logits, max, &filters(temperature, 0, 1.0, min_p), &mut all);
                all.sort_unstable();
                let total: f64 = all.iter().map(|&k| f64::from(key_weight(k, max, inv_t))).sum();
                let mut cum = 0.0;
                let keep = all
                    .iter()
                    .position(|&k| {
                        cum += f64::from(key_weight(k, max, inv_t));
                        cum >= f64::from(top_p) * total
                    })
                    .map_or(all.len(), |i| i + 1);
                assert_eq!(got.len(), keep, "{f:?}");
                assert_eq!(got, all[..keep].to_vec(), "{f:?}");
            }
        }
    }

    #[test]
    fn sample_random_never_draws_filtered_tokens() {
        let logits = [8f32.ln(), 4f32.ln(), 2f32.ln(), 1f32.ln(), f32::NEG_INFINITY];
        let mut rng = types::rng::XorShift64::seeded(1);
        let (mut keys, mut weights) = (Vec::new(), Vec::new());
        for (f, allowed) in [
            (filters(1.0, 0, 1.0, 0.0), 4),
            (filters(1.0, 0, 1.0, 0.2), 3),
            (filters(1.0, 2, 1.0, 0.0), 2),
            (filters(1.0, 0, 0.5, 0.0), 1),
        ] {
            for _ in 0..500 {
                let id = sample_random(&logits, 8f32.ln(), &f, &mut keys, &mut weights, rng.unit_f64());
                assert!(id.is_some_and(|id| id < allowed), "{id:?} with {f:?}");
            }
        }
    }
}
