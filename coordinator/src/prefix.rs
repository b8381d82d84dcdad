//! Which prompt prefixes each worker holds in its KV cache, for routing.
//!
//! Workers send the chained hashes of the prefix blocks their pools index as
//! they change, on a `WatchPrefixes` stream of numbered updates
//! ([`proto::worker::v1::PrefixUpdate`]: the whole set, then each change),
//! one per coordinator; a worker without that RPC (an older release) is
//! read from its `Health` answers instead ([`proto::worker::v1::PrefixReport`],
//! sent only when the set changed since the epoch the poller holds, at most
//! 8,192 hashes). The router hashes a prompt the same way
//! (`engine::kv::prefix_hashes`, under the request's `cache_salt`, in the
//! worker's block size) and counts how many leading blocks a worker holds.
//! The salt is in every hash of the chain, so a prompt never matches blocks
//! cached under another tenant's scope: another tenant's cache can neither
//! attract its requests nor be probed through routing.
//!
//! [`Index`] holds every worker's set and, for each block hash, the workers
//! holding it, so one prompt's match costs a walk down its own chain through
//! the workers that hold its blocks, whatever the fleet's size. It fails
//! closed: an update out of sequence (a lost step) drops that worker's set
//! at once, and so does a broken stream; the worker then counts as holding
//! nothing until a new stream's snapshot arrives.

#[cfg(test)]
use std::collections::HashSet;
use std::collections::{BTreeMap, HashMap};

use proto::worker::v1::{PrefixReport, PrefixUpdate};
use rustc_hash::{FxHashMap, FxHashSet};
use smallvec::SmallVec;

/// One worker's prefix blocks as a plain set: the reference [`Index::matches`] is
/// tested against, and the router's tests' way of saying what a worker holds.
#[cfg(test)]
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Prefixes {
    /// The worker's `prefix_epoch` for this set.
    pub epoch: u64,
    /// Tokens per block.
    pub block_size: usize,
    pub hashes: HashSet<u64>,
}

#[cfg(test)]
impl Prefixes {
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
#[cfg(test)]
pub fn bonus(affinity: f64, held: Option<&Prefixes>, query: &mut Query<'_>) -> (f64, usize) {
    let cached = held.map_or(0, |p| p.cached_tokens(query));
    (affinity * query.fraction(cached), cached)
}

/// How a worker's set in the [`Index`] reached this coordinator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Via {
    /// A `Health` answer's report of this epoch.
    Report(u64),
    /// A `WatchPrefixes` stream, whose last applied update had this number.
    Watch(u64),
}

/// A `WatchPrefixes` update out of sequence: the worker's set was dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("prefix update {got} after {after:?}: a step was lost")]
pub struct Gap {
    /// The number of the last update applied (`None`: no stream's snapshot yet).
    pub after: Option<u64>,
    pub got: u64,
}

struct Held {
    slot: u32,
    block_size: usize,
    via: Via,
    hashes: FxHashSet<u64>,
}

/// Every worker's cached prefix blocks, and the workers holding each block
/// (see the module doc).
#[derive(Default)]
pub struct Index {
    workers: HashMap<String, Held>,
    /// Block hash → the slots of the workers holding it (inline up to 4: most blocks have
    /// one holder, so a (worker, block) pair costs about 50 bytes in all, the set's and
    /// this map's entries together).
    holders: FxHashMap<u64, SmallVec<[u32; 4]>>,
    /// Slot → (address, block size); `None`: free, reused from `free`.
    slots: Vec<Option<(String, usize)>>,
    free: Vec<u32>,
    /// Block size → workers using it: a prompt is hashed in each.
    block_sizes: BTreeMap<usize, usize>,
}

impl Index {
    /// Replaces `addr`'s whole set.
    pub fn replace(&mut self, addr: &str, block_size: usize, hashes: impl IntoIterator<Item = u64>, via: Via) {
        self.forget(addr);
        let slot = match self.free.pop() {
            Some(s) => {
                self.slots[s as usize] = Some((addr.to_owned(), block_size));
                s
            }
            None => {
                self.slots.push(Some((addr.to_owned(), block_size)));
                (self.slots.len() - 1) as u32
            }
        };
        let mut held = Held { slot, block_size, via, hashes: FxHashSet::default() };
        for h in hashes {
            if held.hashes.insert(h) {
                self.holders.entry(h).or_default().push(slot);
            }
        }
        *self.block_sizes.entry(block_size).or_default() += 1;
        self.workers.insert(addr.to_owned(), held);
    }

    /// A worker's `Health` report.
    pub fn report(&mut self, addr: &str, epoch: u64, r: &PrefixReport) {
        self.replace(addr, r.block_size as usize, r.hashes.iter().copied(), Via::Report(epoch));
    }

    /// One `WatchPrefixes` update: a snapshot numbered 1 starts a stream; every other
    /// update must follow the last one applied, or the worker's set is dropped.
    pub fn apply(&mut self, addr: &str, u: &PrefixUpdate) -> Result<(), Gap> {
        let after = match self.workers.get(addr).map(|w| w.via) {
            Some(Via::Watch(seq)) => Some(seq),
            _ => None,
        };
        let in_sequence = match after {
            Some(seq) => u.seq == seq.wrapping_add(1),
            None => u.seq == 1 && u.snapshot,
        };
        if !in_sequence {
            self.forget(addr);
            return Err(Gap { after, got: u.seq });
        }
        if u.snapshot {
            self.replace(addr, u.block_size as usize, u.added.iter().copied(), Via::Watch(u.seq));
            return Ok(());
        }
        let Some(w) = self.workers.get_mut(addr) else { return Err(Gap { after, got: u.seq }) };
        if u.block_size as usize != w.block_size {
            // A worker does not change its block size mid-stream; one that says so is not believed.
            self.forget(addr);
            return Err(Gap { after, got: u.seq });
        }
        w.via = Via::Watch(u.seq);
        for &h in &u.removed {
            if w.hashes.remove(&h) {
                unhold(&mut self.holders, h, w.slot);
            }
        }
        for &h in &u.added {
            if w.hashes.insert(h) {
                self.holders.entry(h).or_default().push(w.slot);
            }
        }
        Ok(())
    }

    /// Drops `addr`'s set: it holds nothing as far as routing knows.
    pub fn forget(&mut self, addr: &str) {
        let Some(w) = self.workers.remove(addr) else { return };
        for &h in &w.hashes {
            unhold(&mut self.holders, h, w.slot);
        }
        self.slots[w.slot as usize] = None;
        self.free.push(w.slot);
        if let Some(n) = self.block_sizes.get_mut(&w.block_size) {
            *n -= 1;
            if *n == 0 {
                self.block_sizes.remove(&w.block_size);
            }
        }
    }

    /// Keeps only the workers `keep` accepts.
    pub fn retain(&mut self, keep: impl Fn(&str) -> bool) {
        let gone: Vec<String> = self.workers.keys().filter(|a| !keep(a)).cloned().collect();
        for a in gone {
            self.forget(&a);
        }
    }

    /// How `addr`'s set arrived, if held.
    pub fn via(&self, addr: &str) -> Option<Via> {
        self.workers.get(addr).map(|w| w.via)
    }

    pub fn block_size(&self, addr: &str) -> Option<usize> {
        self.workers.get(addr).map(|w| w.block_size)
    }

    /// Blocks `addr` holds (0: none known).
    pub fn blocks(&self, addr: &str) -> usize {
        self.workers.get(addr).map_or(0, |w| w.hashes.len())
    }

    /// Whether `addr` holds `hash` (tests, benches).
    pub fn holds(&self, addr: &str, hash: u64) -> bool {
        self.workers.get(addr).is_some_and(|w| w.hashes.contains(&hash))
    }

    /// For each worker holding the start of `query`'s prompt, the tokens it holds
    /// (counted from the start up to the first block it does not hold, as its own set
    /// would give): a walk down the prompt's chain in each block size in use, through
    /// the holders of each block, stopping where nobody holds the next one.
    pub fn matches(&self, query: &mut Query<'_>) -> Matches<'_> {
        let mut tokens = FxHashMap::default();
        for &bs in self.block_sizes.keys() {
            // Slot → leading blocks held so far.
            let mut run: FxHashMap<u32, usize> = FxHashMap::default();
            for (i, h) in query.hashes(bs).iter().enumerate() {
                let Some(slots) = self.holders.get(h) else { break };
                let mut longer = false;
                for &s in slots {
                    let Some((_, size)) = &self.slots[s as usize] else { continue };
                    if *size != bs {
                        continue;
                    }
                    if i == 0 {
                        run.insert(s, 1);
                        longer = true;
                    } else if let Some(n) = run.get_mut(&s).filter(|n| **n == i) {
                        *n += 1;
                        longer = true;
                    }
                }
                if !longer {
                    break;
                }
            }
            for (s, n) in run {
                if let Some((addr, _)) = &self.slots[s as usize] {
                    tokens.insert(addr.as_str(), n * bs);
                }
            }
        }
        Matches { tokens }
    }
}

/// Takes `slot` off `hash`'s holders, and the hash out when nobody holds it.
fn unhold(holders: &mut FxHashMap<u64, SmallVec<[u32; 4]>>, hash: u64, slot: u32) {
    if let Some(v) = holders.get_mut(&hash) {
        v.retain(|s| *s != slot);
        if v.is_empty() {
            holders.remove(&hash);
        }
    }
}

/// What [`Index::matches`] found for one prompt.
pub struct Matches<'a> {
    // Asked of every candidate of a decision: a fast hash of our own keys.
    tokens: FxHashMap<&'a str, usize>,
}

impl Matches<'_> {
    /// Prompt tokens `addr` holds cached.
    pub fn tokens(&self, addr: &str) -> usize {
        if self.tokens.is_empty() {
            return 0;
        }
        self.tokens.get(addr).copied().unwrap_or(0)
    }

    /// `addr`'s routing bonus: `affinity` x the held share of the prompt.
    pub fn bonus(&self, affinity: f64, addr: &str, query: &Query<'_>) -> f64 {
        affinity * query.fraction(self.tokens(addr))
    }

    /// Each worker holding any of the prompt, with the prompt tokens it holds.
    pub fn iter(&self) -> impl Iterator<Item = (&str, usize)> + '_ {
        self.tokens.iter().map(|(a, n)| (*a, *n))
    }

    /// Workers holding any of the prompt.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
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

    fn update(seq: u64, snapshot: bool, added: Vec<u64>, removed: Vec<u64>) -> PrefixUpdate {
        PrefixUpdate { seq, block_size: 16, snapshot, added, removed, load: None }
    }

    #[test]
    fn the_index_finds_what_each_workers_own_set_would() {
        let prompt: Vec<u32> = (0..200).collect();
        let other: Vec<u32> = (1_000..1_200).collect();
        let mut ix = Index::default();
        let mut each = Vec::new();
        // Runs of every length, in two block sizes, a worker with a gap, one holding
        // another prompt, one holding it under another salt.
        for (i, (tokens, bs, salt)) in
            [(0, 16, 7), (16, 16, 7), (48, 16, 7), (199, 16, 7), (64, 32, 7), (192, 32, 7), (128, 16, 8)]
                .into_iter()
                .enumerate()
        {
            let p = holding(&prompt[..tokens], bs, salt);
            let addr = format!("w{i}");
            ix.replace(&addr, bs, p.hashes.iter().copied(), Via::Report(1));
            each.push((addr, p));
        }
        let mut gap = holding(&prompt[..96], 16, 7);
        gap.hashes.remove(&engine::kv::prefix_hashes(&prompt[..32], 16, 7)[1]);
        ix.replace("gap", 16, gap.hashes.iter().copied(), Via::Report(1));
        each.push(("gap".into(), gap));
        let o = holding(&other, 16, 7);
        ix.replace("other", 16, o.hashes.iter().copied(), Via::Report(1));
        each.push(("other".into(), o));
        for (p, salt) in [(&prompt[..], 7), (&prompt[..100], 7), (&other[..], 7), (&prompt[..], 8)] {
            let mut q = Query::new(p, salt);
            let m = ix.matches(&mut q);
            for (addr, own) in &each {
                assert_eq!(m.tokens(addr), own.cached_tokens(&mut q), "{addr}, {} tokens, salt {salt}", p.len());
            }
        }
        assert_eq!(ix.matches(&mut Query::new(&prompt, 7)).len(), 6, "w1 to w5 and gap hold a run of it");
    }

    #[test]
    fn updates_apply_in_sequence_and_a_lost_one_drops_the_set() {
        let prompt: Vec<u32> = (0..100).collect();
        let chain = engine::kv::prefix_hashes(&prompt, 16, 7);
        let mut ix = Index::default();
        let held = |ix: &Index| ix.matches(&mut Query::new(&prompt, 7)).tokens("w");
        assert_eq!(ix.apply("w", &update(2, false, vec![chain[0]], vec![])), Err(Gap { after: None, got: 2 }));
        assert_eq!(
            ix.apply("w", &update(1, false, vec![], vec![])),
            Err(Gap { after: None, got: 1 }),
            "not a snapshot"
        );
        ix.apply("w", &update(1, true, chain[..2].to_vec(), vec![])).unwrap();
        assert_eq!(held(&ix), 32);
        ix.apply("w", &update(2, false, chain[2..4].to_vec(), vec![])).unwrap();
        assert_eq!(held(&ix), 64);
        ix.apply("w", &update(3, false, vec![], vec![chain[1]])).unwrap();
        assert_eq!(held(&ix), 16, "a removed block ends the run");
        assert_eq!(ix.via("w"), Some(Via::Watch(3)));
        // Update 5 after 3: a step was lost. The set goes at once: routing holds nothing.
        assert_eq!(ix.apply("w", &update(5, false, vec![chain[1]], vec![])), Err(Gap { after: Some(3), got: 5 }));
        assert_eq!((held(&ix), ix.via("w"), ix.blocks("w")), (0, None, 0));
        assert!(ix.holders.is_empty(), "no holder left behind");
        // Only a new stream's snapshot brings it back.
        assert!(ix.apply("w", &update(4, false, vec![], vec![])).is_err());
        ix.apply("w", &update(1, true, chain.clone(), vec![])).unwrap();
        assert_eq!(held(&ix), 96);
        // A resync mid-stream (the worker's snapshot in sequence) replaces the set.
        ix.apply("w", &update(2, true, chain[..1].to_vec(), vec![])).unwrap();
        assert_eq!(held(&ix), 16);
        // A block size that changes mid-stream is not believed.
        let mut odd = update(3, false, vec![], vec![]);
        odd.block_size = 32;
        assert!(ix.apply("w", &odd).is_err());
        assert_eq!(ix.blocks("w"), 0);
    }

    #[test]
    fn the_index_has_no_cap_and_forgets_cleanly() {
        let mut ix = Index::default();
        ix.replace("big", 16, 0..100_000u64, Via::Watch(1));
        ix.replace("small", 16, 50_000..50_010u64, Via::Report(9));
        assert_eq!((ix.blocks("big"), ix.blocks("small")), (100_000, 10));
        assert!(ix.holds("big", 99_999));
        assert_eq!(ix.holders[&50_005].len(), 2);
        ix.retain(|a| a == "small");
        assert_eq!((ix.blocks("big"), ix.holders.len()), (0, 10));
        // The freed slot is reused; the old worker's blocks do not come back with it.
        ix.replace("next", 32, [1, 2], Via::Report(1));
        assert!(!ix.holds("next", 3) && ix.holders.len() == 12 && ix.slots.len() == 2);
        assert_eq!(ix.block_sizes.len(), 2);
        ix.forget("small");
        ix.forget("next");
        assert!(ix.holders.is_empty() && ix.block_sizes.is_empty() && ix.workers.is_empty());
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
