//! Which prompt prefixes each worker holds in its KV cache, for routing.
//!
//! Workers report the chained hashes of the prefix blocks their pools
//! index ([`proto::worker::v1::PrefixReport`], with their `Health` answer,
//! sent only when the set changed since the epoch the poller holds). The
//! router hashes a prompt the same way (`engine::kv::prefix_hashes`, under
//! the request's `cache_salt`, in the worker's block size) and counts how
//! many leading blocks a worker holds. The salt is in every hash of the
//! chain, so a prompt never matches blocks cached under another tenant's
//! scope: another tenant's cache can neither attract its requests nor be
//! probed through routing.

use std::collections::HashSet;

use proto::worker::v1::PrefixReport;

/// One worker's reported prefix blocks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Prefixes {
    /// The worker's `prefix_epoch` for this set.
    pub epoch: u64,
    /// Tokens per block.
    pub block_size: usize,
    pub hashes: HashSet<u64>,
}

impl Prefixes {
    pub fn from_report(epoch: u64, r: &PrefixReport) -> Self {
        Self { epoch, block_size: r.block_size as usize, hashes: r.hashes.iter().copied().collect() }
    }

    /// Tokens of `query`'s prompt in blocks this worker holds, counted from
    /// the start up to the first block it does not hold.
    pub fn cached_tokens(&self, query: &mut Query<'_>) -> usize {
        if self.hashes.is_empty() || self.block_size == 0 {
            return 0;
        }
        let held = query.hashes(self.block_size).iter().take_while(|h| self.hashes.contains(h)).count();
        held * self.block_size
    }
}

/// A candidate's routing bonus for `query` and the tokens it holds:
/// `affinity` x the held share of the prompt (see [`crate::router`]).
pub fn bonus(affinity: f64, held: Option<&Prefixes>, query: &mut Query<'_>) -> (f64, usize) {
    let cached = held.map_or(0, |p| p.cached_tokens(query));
    (affinity * query.fraction(cached), cached)
}

/// A prompt to match, its hash chain computed once per block size.
pub struct Query<'a> {
    pub tokens: &'a [u32],
    pub salt: u64,
    chains: Vec<(usize, Vec<u64>)>,
}

impl<'a> Query<'a> {
    pub fn new(tokens: &'a [u32], salt: u64) -> Self {
        Self { tokens, salt, chains: Vec::new() }
    }

    /// The prompt's block hashes in blocks of `block_size`, leaving out the
    /// last token (the engine always computes it, for its logits).
    fn hashes(&mut self, block_size: usize) -> &[u64] {
        let i = match self.chains.iter().position(|(bs, _)| *bs == block_size) {
            Some(i) => i,
            None => {
                let usable = self.tokens.len().saturating_sub(1);
                let chain = engine::kv::prefix_hashes(&self.tokens[..usable], block_size, self.salt);
                self.chains.push((block_size, chain));
                self.chains.len() - 1
            }
        };
        &self.chains[i].1
    }

    /// Share of the prompt's tokens that `cached` tokens are, 0..=1.
    pub fn fraction(&self, cached: usize) -> f64 {
        if self.tokens.is_empty() {
            return 0.0;
        }
        (cached as f64 / self.tokens.len() as f64).min(1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holding(tokens: &[u32], block_size: usize, salt: u64) -> Prefixes {
        let hashes = engine::kv::prefix_hashes(tokens, block_size, salt).into_iter().collect();
        Prefixes { epoch: 1, block_size, hashes }
    }

    #[test]
    fn the_longest_held_run_from_the_start_counts_and_nothing_after_a_gap() {
        let prompt: Vec<u32> = (0..70).collect();
        let w = holding(&prompt[..48], 16, 7);
        assert_eq!(w.cached_tokens(&mut Query::new(&prompt, 7)), 48);
        // A worker holding blocks 2 and 3 but not 1 holds no usable prefix.
        let mut gap = holding(&prompt[..64], 16, 7);
        let first = engine::kv::prefix_hashes(&prompt[..16], 16, 7)[0];
        gap.hashes.remove(&first);
        assert_eq!(gap.cached_tokens(&mut Query::new(&prompt, 7)), 0);
        // The last token is never counted: a 48-token prompt can match 32.
        assert_eq!(w.cached_tokens(&mut Query::new(&prompt[..48], 7)), 32);
    }

    #[test]
    fn another_salt_never_matches() {
        let prompt: Vec<u32> = (0..70).collect();
        let w = holding(&prompt, 16, 7);
        assert_eq!(w.cached_tokens(&mut Query::new(&prompt, 8)), 0);
        assert_eq!(w.cached_tokens(&mut Query::new(&prompt, 0)), 0);
        assert_eq!(w.cached_tokens(&mut Query::new(&prompt, 7)), 64);
    }

    #[test]
    fn the_query_hashes_in_each_workers_block_size() {
        let prompt: Vec<u32> = (0..70).collect();
        let mut q = Query::new(&prompt, 3);
        assert_eq!(holding(&prompt, 16, 3).cached_tokens(&mut q), 64);
        assert_eq!(holding(&prompt, 32, 3).cached_tokens(&mut q), 64);
        assert_eq!(holding(&prompt[..40], 8, 3).cached_tokens(&mut q), 40);
        assert_eq!(q.fraction(35), 0.5);
    }
}
