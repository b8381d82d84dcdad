//! One sequence's state inside the engine.

use crate::kv::{KvPool, PrefixHash};

use crate::sampler::{Sampler, StopChecker};
use types::kv::BlockId;

use super::{EngineError, Request};

pub(super) struct Seq {
    /// Prompt then generated tokens. The last one may not be in the KV
    /// cache yet: `computed` counts those that are.
    pub tokens: Vec<u32>,
    pub generated: Vec<u32>,
    pub computed: usize,
    pub table: Vec<BlockId>,
    pub sampler: Sampler,
    pub stop: StopChecker,
    /// Prefill-only: keep the blocks when finished (they are to be sent).
    pub hold: bool,
    /// Prefill-only, streaming: receives each layer's blocks as steps
    /// complete them; dropped once every prompt block was streamed.
    pub stream: Option<super::LayerSink>,
    /// Prompt blocks already streamed (for every layer).
    pub streamed: usize,
    pub priority: super::Priority,
    /// Prompt tokens whose KV the latest admission took from the prefix
    /// cache instead of computing (0 without a hit, or when the KV came
    /// from elsewhere, as for a prefilled sequence).
    pub cached: usize,
    /// Prompt-lookup draft tokens of the step being scheduled or run
    /// (`Engine::run_step`); empty between steps.
    pub draft: Vec<u32>,
    /// The request's `max_tokens`: no draft reaches past it.
    pub max_new: usize,
    /// The longest draft its next step may take (0: not yet set, the
    /// engine's `prompt_lookup`): grows while drafts are accepted whole and
    /// shrinks to what was accepted, so text that does not repeat wastes
    /// little compute.
    pub draft_len: usize,
    /// The request allows prompt lookup (`SamplingParams::prompt_lookup`).
    pub lookup: bool,
    salt: u64,
    /// Full blocks already in the prefix index, and the hash chain so far.
    registered: usize,
    last_hash: Option<PrefixHash>,
}

impl Seq {
    /// Past its prompt (and the tokens it resumed from): each step computes
    /// its one newest token.
    pub fn is_decoding(&self) -> bool {
        !self.generated.is_empty() && self.tokens.len() - self.computed == 1
    }

    pub fn new(req: &Request, eos: &[u32]) -> Result<Self, EngineError> {
        Ok(Self {
            tokens: req.prompt.iter().chain(&req.generated).copied().collect(),
            generated: req.generated.clone(),
            computed: 0,
            table: Vec::new(),
            sampler: Sampler::new(&req.params)?,
            stop: StopChecker::new(&req.params, eos)?,
            hold: false,
            stream: None,
            streamed: 0,
            priority: req.priority,
            cached: 0,
            draft: Vec::new(),
            max_new: req.params.max_tokens as usize,
            draft_len: 0,
            lookup: req.params.prompt_lookup,
            salt: req.salt,
            registered: 0,
            last_hash: None,
        })
    }

    /// Gives all blocks back and forgets what was computed (preemption or end).
    pub fn release(&mut self, pool: &mut KvPool) {
        if let Err(e) = pool.release(&self.table) {
            // Only a bookkeeping bug can get here; losing track of blocks is
            // better reported loudly than hidden.
            tracing::error!(error = %e, "releasing a sequence's KV blocks failed");
        }
        self.table.clear();
        self.draft.clear();
        self.computed = 0;
        self.registered = 0;
        self.last_hash = None;
    }

    /// Shares the longest cached prefix of this sequence's tokens, always
    /// leaving at least one token to compute (its logits are needed).
    pub fn acquire_prefix(&mut self, pool: &mut KvPool) {
        let bs = pool.layout().block_size;
        let usable = (self.tokens.len() - 1) / bs * bs;
        let hashes = pool.prefix_hashes(&self.tokens[..usable], self.salt);
        let blocks = pool.acquire_prefix(&hashes);
        self.computed = blocks.len() * bs;
        // After a preemption `tokens` holds generated ones too; only the
        // prompt's count.
        self.cached = self.computed.min(self.tokens.len() - self.generated.len());
        self.registered = blocks.len();
        self.last_hash = blocks.len().checked_sub(1).map(|i| hashes[i]);
        self.table = blocks;
    }

    /// Indexes every block that became full since the last call.
    pub fn register_full_blocks(&mut self, pool: &mut KvPool) -> Result<(), EngineError> {
        let bs = pool.layout().block_size;
        let full = self.computed / bs;
        while self.registered < full {
            let i = self.registered;
            let parent = self.last_hash.unwrap_or(self.salt);
            let h = pool.prefix_hashes(&self.tokens[i * bs..(i + 1) * bs], parent)[0];
            pool.register(self.table[i], h)?;
            self.last_hash = Some(h);
            self.registered += 1;
        }
        Ok(())
    }
}
