//! Prompt-lookup drafts: model-free guesses of a decoding sequence's next
//! tokens, copied from what followed the latest earlier occurrence of its
//! last few tokens in the prompt or the text so far. Answers that repeat
//! their prompt (edits, extraction, code) hit often.
//!
//! A draft is only a guess: the engine computes the draft's tokens in the
//! sequence's step and samples each position from its own logits, exactly
//! as plain decoding would (the kernels return the same bits for any batch
//! size), accepting draft tokens only while they equal what was sampled.
//! The output is plain decoding's by construction; a wrong draft costs
//! compute, never a token.

/// Longest suffix matched first; shorter ones only if it has no earlier occurrence.
const MAX_NGRAM: usize = 3;
/// A single token repeats too often to predict what follows it.
const MIN_NGRAM: usize = 2;

/// Up to `max` tokens that followed the latest earlier occurrence of the
/// last `n` tokens of `tokens` (`n` from 3 down to 2); empty when none occurs.
pub(super) fn draft(tokens: &[u32], max: usize) -> &[u32] {
    if max == 0 {
        return &[];
    }
    for n in (MIN_NGRAM..=MAX_NGRAM).rev() {
        if tokens.len() <= n {
            continue;
        }
        let suffix = &tokens[tokens.len() - n..];
        // Latest first: the text nearest the end predicts it best.
        let found = (0..tokens.len() - n).rev().find(|&i| &tokens[i..i + n] == suffix);
        if let Some(i) = found {
            let from = i + n;
            return &tokens[from..(from + max).min(tokens.len())];
        }
    }
    &[]
}

#[cfg(test)]
mod tests {
    use super::draft;

    #[test]
    fn the_latest_occurrence_of_the_longest_suffix_is_followed() {
        // "1 2 3 9 ... 1 2 3" → what followed the last "1 2 3" before the end.
        let t = [1, 2, 3, 4, 5, 6, 1, 2, 3, 7, 8, 1, 2, 3];
        assert_eq!(draft(&t, 2), &[7, 8]);
        assert_eq!(draft(&t, 10), &[7, 8, 1, 2, 3]);
        // Only a 2-gram occurs earlier.
        let t = [5, 6, 7, 9, 6, 7];
        assert_eq!(draft(&t, 3), &[9, 6, 7]);
        // A lone repeated token is not enough.
        assert!(draft(&[4, 1, 5, 1], 3).is_empty());
        assert!(draft(&[1, 2, 3], 3).is_empty());
        assert!(draft(&t, 0).is_empty());
        assert!(draft(&[], 3).is_empty());
    }
}
