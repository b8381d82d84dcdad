//! The engine's half of disaggregation: a prefill-only request that keeps
//! its KV blocks for sending, and a decode request that joins with KV that
//! arrived from elsewhere.
//!
//! Prefill side: [`Engine::add_prefill_only`] runs the prompt and samples
//! the first token like any request, but when it finishes its blocks are
//! *held* instead of freed; the caller reads them
//! ([`Engine::held_blocks`], then the pool's per-layer gather) and lets go
//! with [`Engine::release_held`] (or `abort`).
//!
//! Decode side: the caller reserves blocks ([`Engine::reserve_blocks`]),
//! has them filled (KV transfer writes into the pool), and then hands them
//! over with [`Engine::add_prefilled`] together with the first token the
//! prefill side sampled. From then on the sequence decodes as if it had
//! been prefilled here. Until `add_prefilled` succeeds the caller owns the
//! blocks and must [`Engine::release_reserved`] them on any failure.

use crate::sampler::{FinishReason, SampledToken};
use types::kv::BlockId;

use super::{Engine, EngineError, LayerSink, Request};

impl Engine {
    /// Queues a request that stops after its first token and keeps its
    /// prompt's KV blocks (see the module doc). `max_tokens` is forced to 1.
    pub fn add_prefill_only(&mut self, mut req: Request) -> Result<(), EngineError> {
        req.params.max_tokens = 1;
        let id = req.id;
        let mut seq = self.validate(&req)?;
        seq.hold = true;
        self.seqs.insert(id, seq);
        self.enqueue(id);
        Ok(())
    }

    /// [`add_prefill_only`](Self::add_prefill_only), streaming the prompt's
    /// KV to `sink` while it is computed: after each step, every layer's
    /// newly complete blocks (those the step filled, and on the first step
    /// any prefix-cache hits) go out as one [`LayerView`](super::LayerView), on the engine
    /// thread, from inside the forward pass right after that layer's K/V
    /// writes. Each (layer, block) is sent exactly once, in block order per
    /// layer; the sink is dropped after the last one, before the request's
    /// first token is reported. Preemption does not resend what was sent
    /// (recomputed KV is identical).
    pub fn add_prefill_streaming(&mut self, req: Request, sink: LayerSink) -> Result<(), EngineError> {
        let id = req.id;
        self.add_prefill_only(req)?;
        if let Some(s) = self.seqs.get_mut(&id) {
            s.stream = Some(sink);
        }
        Ok(())
    }

    /// Blocks of a finished prefill-only request, in prompt order, if it is held.
    pub fn held_blocks(&self, id: u64) -> Option<&[BlockId]> {
        self.held.get(&id).map(|s| s.table.as_slice())
    }

    /// Frees a held request's blocks. Returns whether it was held.
    pub fn release_held(&mut self, id: u64) -> bool {
        self.held.contains_key(&id) && self.abort(id)
    }

    /// Allocates `n` blocks for KV that another process will write.
    pub fn reserve_blocks(&mut self, n: usize) -> Result<Vec<BlockId>, EngineError> {
        Ok(self.pool.allocate(n)?)
    }

    /// Returns reserved blocks that were never handed to `add_prefilled`.
    pub fn release_reserved(&mut self, blocks: &[BlockId]) -> Result<(), EngineError> {
        Ok(self.pool.release(blocks)?)
    }

    /// Blocks a prompt of `prompt_len` tokens occupies (for a continuation:
    /// the prompt and the tokens it resumes from).
    pub fn blocks_for(&self, prompt_len: usize) -> usize {
        prompt_len.div_ceil(self.cfg.block_size)
    }

    /// Joins a sequence whose prompt KV is already in `blocks` (reserved
    /// here and filled by a transfer) and whose first token was sampled by
    /// the prefill side. On success the engine owns the blocks; if that
    /// first token already ends the request, the blocks are freed and its
    /// finish reason returned. On error the caller still owns the blocks.
    pub fn add_prefilled(
        &mut self,
        req: Request,
        blocks: Vec<BlockId>,
        first: &SampledToken,
    ) -> Result<Option<FinishReason>, EngineError> {
        let mut seq = self.validate(&req)?;
        let len = req.prompt.len() + req.generated.len();
        let want = self.blocks_for(len);
        if blocks.len() != want {
            return Err(EngineError::InvalidPrompt(format!(
                "{} KV blocks supplied for a {len}-token prompt that needs {want}",
                blocks.len(),
            )));
        }
        if first.id as usize >= self.model.config().vocab {
            return Err(EngineError::InvalidPrompt(format!("first token {} is outside the vocabulary", first.id)));
        }
        seq.computed = len;
        seq.table = blocks;
        seq.tokens.push(first.id);
        seq.generated.push(first.id);
        let mut finished = seq.stop.check_token(first.id);
        if finished.is_none() && seq.tokens.len() >= self.model.config().context {
            finished = Some(FinishReason::Length);
        }
        if finished.is_some() {
            seq.release(&mut self.pool);
            return Ok(finished);
        }
        self.seqs.insert(req.id, seq);
        self.enqueue(req.id);
        Ok(None)
    }
}
