//! Continuous batching: the step loop that decode and prefill share.
//!
//! Each [`Engine::step`] builds one batch under a token budget: first one
//! token for every running sequence that is decoding, then prefill chunks
//! (the rest of the budget) for sequences still reading their prompt, then
//! new sequences from the waiting queue while blocks and seats allow. A long
//! prompt is therefore spread over several steps (chunked prefill) instead
//! of stalling every decode behind it.
//!
//! Requests carry a priority class (`Request::priority`): the waiting queue
//! is ordered highest class first, FIFO inside a class, and the running
//! list likewise, so higher classes get a step's tokens first (see `order`
//! for the rule and its starvation story).
//!
//! When a decoding sequence needs a new block and the pool is exhausted,
//! the lowest class's most recently admitted sequence is preempted by
//! recompute: its blocks are released and it goes back to the front of its
//! class in the queue with every token it has so far, to be prefilled again
//! later. Its sampler (and so its random stream and penalties) carries on
//! unchanged.
//!
//! With `max_decode_stall_ms` set, a step that carries decodes takes only
//! the prefill that fits in that time beside them (see `stall`), so a long
//! prompt arriving at a decode worker delays its running streams by at most
//! about that much per token.

mod lookup;
mod order;
mod remote;
mod seq;
mod stall;

use std::collections::{HashMap, VecDeque};

use crate::kv::{KvError, KvPool, KvStats};

use crate::model::{ForwardError, Model, SeqChunk};
use crate::sampler::{FinishReason, SampledToken};
use types::kv::KvDtype;
use types::sampling::{SamplerError, SamplingParams};

use seq::Seq;
use stall::StepCost;

use types::priority::Priority;

/// Engine sizing and scheduling knobs.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// Element type of the KV cache.
    pub kv_dtype: KvDtype,
    /// Number of KV blocks in the pool.
    pub kv_blocks: usize,
    /// Token budget of one step (decode tokens + prefill chunk tokens).
    pub max_batch_tokens: usize,
    /// Sequences running at once.
    pub max_running: usize,
    /// Share full blocks between sequences with a common prefix.
    pub prefix_cache: bool,
    /// While any running sequence decodes, the longest a step should take,
    /// ms: prefill chunks are cut to what fits beside the decodes by the
    /// measured step costs (at least one block per step, so prompts always
    /// progress). `None`: chunks take the whole `max_batch_tokens`.
    #[serde(default)]
    pub max_decode_stall_ms: Option<f64>,
    /// Prompt-lookup speculation: up to this many draft tokens per decoding
    /// sequence and step, copied from the sequence's own earlier text
    /// (`lookup`) and checked in the same forward pass; tokens are plain
    /// decoding's either way. 0: off.
    #[serde(default)]
    pub prompt_lookup: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            kv_dtype: KvDtype::F16,
            kv_blocks: 1024,
            max_batch_tokens: 512,
            max_running: 16,
            prefix_cache: true,
            max_decode_stall_ms: None,
            prompt_lookup: 0,
        }
    }
}

impl EngineConfig {
    pub fn validate(&self) -> Result<(), EngineError> {
        let bad = |field: &'static str, why: String| Err(EngineError::Config { field, why });
        if self.block_size == 0 || self.block_size > 1024 {
            return bad("block_size", format!("must be 1..=1024, got {}", self.block_size));
        }
        if self.kv_blocks == 0 {
            return bad("kv_blocks", "must be positive".into());
        }
        if self.max_batch_tokens == 0 {
            return bad("max_batch_tokens", "must be positive".into());
        }
        if let Some(ms) = self.max_decode_stall_ms {
            if !(ms.is_finite() && ms > 0.0) {
                return bad("max_decode_stall_ms", format!("must be a positive number of ms, got {ms}"));
            }
        }
        if self.max_running == 0 || self.max_running > self.max_batch_tokens {
            return bad(
                "max_running",
                format!("must be 1..=max_batch_tokens ({}), got {}", self.max_batch_tokens, self.max_running),
            );
        }
        Ok(())
    }
}

/// A generation request, in token ids.
#[derive(Debug, Clone)]
pub struct Request {
    pub id: u64,
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    /// Scopes prefix-cache sharing (e.g. per tenant); equal salts share.
    pub salt: u64,
    /// Its class: the waiting queue serves higher classes first and
    /// preemption evicts lower ones first.
    pub priority: Priority,
    /// Tokens this request already generated elsewhere (a continuation on
    /// another worker): the sequence is `prompt` then these, its KV computed
    /// (or received) for all of them, and it goes on after them exactly as
    /// if it had never moved: they are the penalties' history and the next
    /// token is draw `generated.len()`. `params.max_tokens` counts only the
    /// tokens generated from here. Empty for a fresh request.
    pub generated: Vec<u32>,
}

/// One generated token of one sequence.
#[derive(Debug, Clone)]
pub struct TokenEvent {
    pub id: u64,
    pub token: SampledToken,
    /// Set on the sequence's last token; its KV blocks are already released.
    pub finished: Option<FinishReason>,
    /// Prompt tokens the sequence took from the prefix cache (see
    /// `Seq::cached`), for usage accounting.
    pub cached_prompt_tokens: usize,
}

/// One layer's K and V of a run of a streaming prefill-only request's
/// blocks (see [`Engine::add_prefill_streaming`]): blocks
/// `first_block..first_block + n` of its block table, laid out as
/// [`KvPool::gather_layer`](crate::kv::KvPool::gather_layer) returns them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerBlocks {
    pub layer: usize,
    pub first_block: usize,
    pub k: Vec<u8>,
    pub v: Vec<u8>,
}

/// One layer's newly complete blocks of a streaming prefill-only request
/// (see [`Engine::add_prefill_streaming`]), where they lie in the engine's
/// pool, right after the forward pass wrote them: blocks
/// `first_block..first_block + blocks.len()` of its block table. A sink
/// [`gather`](Self::gather)s them into buffers of its own, or copies them
/// out of [`KvPool::layer_bytes`](crate::kv::KvPool::layer_bytes) itself
/// (straight into a transfer's destination: no gather).
#[derive(Debug, Clone, Copy)]
pub struct LayerView<'a> {
    pub layer: usize,
    pub first_block: usize,
    /// The pool's ids of those blocks, in table order.
    pub blocks: &'a [types::kv::BlockId],
    pub pool: &'a KvPool,
}

impl LayerView<'_> {
    /// The blocks' K and V, gathered into new buffers (as
    /// [`KvPool::gather_layer`](crate::kv::KvPool::gather_layer)).
    pub fn gather(&self) -> Result<LayerBlocks, KvError> {
        let (k, v) = self.pool.gather_layer(self.layer, self.blocks)?;
        Ok(LayerBlocks { layer: self.layer, first_block: self.first_block, k, v })
    }

    /// The blocks' K and V, gathered into the caller's buffers (cleared
    /// first; recycled buffers keep the engine thread from allocating, and
    /// faulting in, fresh memory for every layer mid-step).
    pub fn gather_into(&self, k: &mut Vec<u8>, v: &mut Vec<u8>) -> Result<(), KvError> {
        self.pool.gather_layer_into(self.layer, self.blocks, k, v)
    }
}

/// Receives a streaming prefill's layers, on the engine thread, mid-step:
/// it must be quick (a gather or a copy of the layer's blocks, and a push
/// into a channel). The view is valid only for the call.
pub type LayerSink = Box<dyn FnMut(LayerView<'_>) + Send>;

/// A streaming sequence during one step.
struct Streaming {
    id: u64,
    /// `None` once the sink panicked (it is not called again).
    sink: Option<LayerSink>,
    blocks: Vec<types::kv::BlockId>,
    first_block: usize,
    /// Blocks complete after this step.
    complete: usize,
    /// This step finishes the prompt.
    last: bool,
}

impl Streaming {
    fn send(&mut self, layer: usize, pool: &KvPool) {
        if self.blocks.is_empty() {
            return;
        }
        let Some(sink) = self.sink.as_mut() else { return };
        let view = LayerView { layer, first_block: self.first_block, blocks: &self.blocks, pool };
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| sink(view))).is_err() {
            tracing::error!(id = self.id, "KV stream sink panicked; streaming stopped");
            self.sink = None;
        }
    }
}

/// Engine errors. `Invalid*` are the caller's input; the rest are internal.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("invalid engine config {field}: {why}")]
    Config { field: &'static str, why: String },
    /// The prompt is empty, too long, or has out-of-vocabulary ids.
    #[error("invalid prompt: {0}")]
    InvalidPrompt(String),
    /// Sampling parameters failed validation.
    #[error("invalid sampling parameters: {0}")]
    InvalidParams(#[from] SamplerError),
    /// A request with this id is already in the engine.
    #[error("duplicate request id {0}")]
    DuplicateId(u64),
    #[error("KV cache: {0}")]
    Kv(#[from] KvError),
    #[error("forward pass: {0}")]
    Forward(#[from] ForwardError),
    /// The scheduler's bookkeeping disagrees with itself: a bug, reported
    /// instead of panicking.
    #[error("internal engine error: {0}")]
    Internal(&'static str),
}

/// The continuous-batching engine.
pub struct Engine {
    model: Model,
    pool: KvPool,
    cfg: EngineConfig,
    eos: Vec<u32>,
    seqs: HashMap<u64, Seq>,
    /// Highest class first, FIFO inside a class (`order::behind_class`).
    waiting: VecDeque<u64>,
    /// Highest class first, admission order inside a class; the back is
    /// preempted first.
    running: Vec<u64>,
    /// Finished prefill-only sequences whose blocks wait to be sent.
    held: HashMap<u64, Seq>,
    preemptions: u64,
    /// `preemptions` by the evicted sequence's class (`Priority::index`).
    preemptions_by_class: [u64; 3],
    /// Prompt tokens whose KV came from the prefix cache instead of being computed.
    prefix_hit_tokens: u64,
    /// Streaming prefills of the step in progress (see `step`).
    streams_scratch: Vec<Streaming>,
    /// Measured step costs, for `max_decode_stall_ms`.
    cost: StepCost,
    /// Prompt-lookup draft tokens computed, and those accepted.
    drafted: u64,
    accepted: u64,
}

impl Engine {
    /// `eos` are the token ids that end a sequence unless `ignore_eos`.
    pub fn new(model: Model, cfg: EngineConfig, eos: Vec<u32>) -> Result<Self, EngineError> {
        cfg.validate()?;
        let pool = KvPool::new(model.kv_layout(cfg.block_size, cfg.kv_dtype), cfg.kv_blocks)?;
        Ok(Self {
            model,
            pool,
            cfg,
            eos,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            held: HashMap::new(),
            preemptions: 0,
            preemptions_by_class: [0; 3],
            prefix_hit_tokens: 0,
            streams_scratch: Vec::new(),
            cost: StepCost::default(),
            drafted: 0,
            accepted: 0,
        })
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    /// Sizes the model's step buffers for this engine's largest step
    /// ([`Model::reserve_scratch`]): `max_batch_tokens` tokens, and a row of
    /// logits per running sequence and draft token. Returns their bytes.
    /// The worker binaries reserve at start, beside committing the KV pool;
    /// tests and benches that build many small engines need not.
    pub fn reserve_scratch(&mut self) -> usize {
        let rows = self.cfg.max_running.saturating_mul(1 + self.cfg.prompt_lookup);
        self.model.reserve_scratch(self.cfg.max_batch_tokens, rows)
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    pub fn kv_stats(&self) -> KvStats {
        self.pool.stats()
    }

    pub fn pool(&self) -> &KvPool {
        &self.pool
    }

    /// The pool, for code that fills or reads a sequence's blocks directly
    /// (KV transfer). Only blocks of [`block_table`](Self::block_table) may be touched.
    pub fn pool_mut(&mut self) -> &mut KvPool {
        &mut self.pool
    }

    /// A sequence's current block table.
    pub fn block_table(&self, id: u64) -> Option<&[types::kv::BlockId]> {
        self.seqs.get(&id).map(|s| s.table.as_slice())
    }

    /// Tokens of a sequence whose KV is in the cache.
    pub fn computed_tokens(&self, id: u64) -> Option<usize> {
        self.seqs.get(&id).map(|s| s.computed)
    }

    /// Prompt-lookup draft tokens computed so far, and how many of them
    /// were accepted (each accepted one is a decode step saved).
    pub fn draft_tokens(&self) -> (u64, u64) {
        (self.drafted, self.accepted)
    }

    /// Sequences preempted (by recompute) since start.
    pub fn preemptions(&self) -> u64 {
        self.preemptions
    }

    /// [`preemptions`](Self::preemptions) by the evicted sequence's class,
    /// indexed by [`Priority::index`].
    pub fn preemptions_by_class(&self) -> [u64; 3] {
        self.preemptions_by_class
    }

    /// Tokens taken from the prefix cache instead of computed, since start
    /// (a preempted sequence's re-admission counts again: it is saved again).
    pub fn prefix_hit_tokens(&self) -> u64 {
        self.prefix_hit_tokens
    }

    /// Waiting requests by class, indexed by [`Priority::index`].
    pub fn waiting_by_class(&self) -> [usize; 3] {
        let mut n = [0; 3];
        for id in &self.waiting {
            n[self.class_of(*id).index()] += 1;
        }
        n
    }

    /// The waiting requests' ids in the order they will be admitted.
    pub fn waiting_order(&self) -> impl Iterator<Item = u64> + '_ {
        self.waiting.iter().copied()
    }

    /// The running sequences' ids, highest class first; the last is
    /// preempted first.
    pub fn running_order(&self) -> impl Iterator<Item = u64> + '_ {
        self.running.iter().copied()
    }

    fn class_of(&self, id: u64) -> Priority {
        self.seqs.get(&id).map_or(Priority::Normal, |s| s.priority)
    }

    /// Queues `id` behind every waiting request of its class or higher.
    fn enqueue(&mut self, id: u64) {
        let at = order::behind_class(self.waiting.iter().map(|w| self.class_of(*w)), self.class_of(id));
        self.waiting.insert(at, id);
    }

    /// Queues a preempted `id` in front of its own class.
    fn requeue(&mut self, id: u64) {
        let at = order::front_of_class(self.waiting.iter().map(|w| self.class_of(*w)), self.class_of(id));
        self.waiting.insert(at, id);
    }

    /// Seats `id` behind every running sequence of its class or higher.
    fn seat(&mut self, id: u64) {
        let at = order::behind_class(self.running.iter().map(|r| self.class_of(*r)), self.class_of(id));
        self.running.insert(at, id);
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    /// Validates and queues a request.
    pub fn add(&mut self, req: Request) -> Result<(), EngineError> {
        let seq = self.validate(&req)?;
        self.seqs.insert(req.id, seq);
        self.enqueue(req.id);
        Ok(())
    }

    /// Checks a request and builds its sequence state.
    fn validate(&self, req: &Request) -> Result<Seq, EngineError> {
        let cfg = self.model.config();
        if self.seqs.contains_key(&req.id) || self.held.contains_key(&req.id) {
            return Err(EngineError::DuplicateId(req.id));
        }
        if req.prompt.is_empty() {
            return Err(EngineError::InvalidPrompt("prompt has no tokens".into()));
        }
        let len = req.prompt.len() + req.generated.len();
        if len > cfg.context {
            return Err(EngineError::InvalidPrompt(format!(
                "prompt and generated tokens are {len}, the model's context is {}",
                cfg.context
            )));
        }
        if let Some(&t) = req.prompt.iter().chain(&req.generated).find(|&&t| t as usize >= cfg.vocab) {
            return Err(EngineError::InvalidPrompt(format!("token id {t} is outside the vocabulary of {}", cfg.vocab)));
        }
        let need = len.div_ceil(self.cfg.block_size);
        if need > self.pool.num_blocks() {
            return Err(EngineError::InvalidPrompt(format!(
                "prompt needs {need} KV blocks, the pool has {}",
                self.pool.num_blocks()
            )));
        }
        Seq::new(req, &self.eos)
    }

    /// Drops a request wherever it is and frees its blocks. Returns whether it existed.
    pub fn abort(&mut self, id: u64) -> bool {
        if let Some(mut seq) = self.held.remove(&id) {
            seq.release(&mut self.pool);
            return true;
        }
        let Some(mut seq) = self.seqs.remove(&id) else { return false };
        self.running.retain(|&r| r != id);
        self.waiting.retain(|&r| r != id);
        seq.release(&mut self.pool);
        true
    }

    /// Runs one batch step and returns the tokens it produced.
    pub fn step(&mut self) -> Result<Vec<TokenEvent>, EngineError> {
        let plan = self.schedule()?;
        if plan.is_empty() {
            return Ok(Vec::new());
        }
        let decodes = plan.iter().filter(|(id, _)| self.seqs[id].is_decoding()).count();
        let prefill = plan.iter().filter(|(id, _)| !self.seqs[id].is_decoding()).map(|(_, n)| n).sum::<usize>();
        self.streams_scratch = self.take_streams(&plan);
        #[allow(clippy::disallowed_types, reason = "the step cost model is wall time on the engine thread")]
        let started = std::time::Instant::now();
        let result = self.run_step(&plan);
        self.cost.observe(decodes, prefill, started.elapsed().as_secs_f64() * 1e3);
        // Sinks go back to their sequences (or are dropped when done), also on error.
        let streams = std::mem::take(&mut self.streams_scratch);
        self.return_streams(streams);
        result
    }

    /// The streaming prefill-only sequences of `plan`, with the blocks this
    /// step completes. Their sinks are taken out for the forward pass.
    fn take_streams(&mut self, plan: &[(u64, usize)]) -> Vec<Streaming> {
        let bs = self.cfg.block_size;
        let mut out = Vec::new();
        for &(id, n) in plan {
            let Some(s) = self.seqs.get_mut(&id) else { continue };
            let Some(sink) = s.stream.take() else { continue };
            let end = s.computed + n;
            let last = end == s.tokens.len();
            let complete = if last { end.div_ceil(bs) } else { end / bs }.min(s.table.len());
            let from = s.streamed.min(complete);
            out.push(Streaming {
                id,
                sink: Some(sink),
                blocks: s.table[from..complete].to_vec(),
                first_block: from,
                complete,
                last,
            });
        }
        out
    }

    fn return_streams(&mut self, streams: Vec<Streaming>) {
        for st in streams {
            let Some(s) = self.seqs.get_mut(&st.id).or_else(|| self.held.get_mut(&st.id)) else { continue };
            s.streamed = s.streamed.max(st.complete);
            if !st.last {
                s.stream = st.sink;
            }
        }
    }

    fn run_step(&mut self, plan: &[(u64, usize)]) -> Result<Vec<TokenEvent>, EngineError> {
        let plan = plan.to_vec();
        // A decoding sequence's draft is computed after its newest token, in
        // its chunk, with logits at every position; `tokens` holds the
        // draft only for the forward pass.
        for &(id, _) in &plan {
            if let Some(s) = self.seqs.get_mut(&id) {
                s.tokens.extend_from_slice(&s.draft);
            }
        }
        let chunks: Vec<SeqChunk<'_>> = plan
            .iter()
            .map(|&(id, n)| {
                let s = &self.seqs[&id];
                let last = s.computed + n == s.tokens.len();
                SeqChunk {
                    tokens: &s.tokens[s.computed..s.computed + n],
                    start: s.computed,
                    table: &s.table,
                    logits: if last { 1 + s.draft.len() } else { 0 },
                }
            })
            .collect();
        let vocab = self.model.config().vocab;
        let context = self.model.config().context;
        let mut streams = std::mem::take(&mut self.streams_scratch);
        let logits = self.model.forward_hooked(&mut self.pool, &chunks, &mut |layer, pool| {
            for st in streams.iter_mut() {
                st.send(layer, pool);
            }
        });
        drop(chunks);
        for &(id, _) in &plan {
            if let Some(s) = self.seqs.get_mut(&id) {
                s.tokens.truncate(s.tokens.len() - s.draft.len());
            }
        }
        let logits = logits?;
        let mut row = 0;
        let mut events = Vec::new();
        let mut done = Vec::new();
        for &(id, n) in &plan {
            let Some(s) = self.seqs.get_mut(&id) else { continue };
            let draft = std::mem::take(&mut s.draft);
            s.computed += n - draft.len();
            if s.computed < s.tokens.len() {
                if self.cfg.prefix_cache {
                    s.register_full_blocks(&mut self.pool)?;
                }
                continue;
            }
            let rows = row..row + 1 + draft.len();
            row = rows.end;
            self.drafted += draft.len() as u64;
            // Each position's token is sampled from its own logits, as plain
            // decoding would; a draft token is kept (its KV valid) only while
            // it equals the token sampled before it.
            let mut kept = 0;
            for (j, r) in rows.enumerate() {
                // Draw index = tokens generated before this one: the same on any worker
                // that continues this sequence (a remote prefill's first token is 0).
                let draw = s.generated.len() as u64;
                let tok = s.sampler.sample(&logits[r * vocab..(r + 1) * vocab], &s.generated, draw)?;
                s.tokens.push(tok.id);
                s.generated.push(tok.id);
                let mut finished = s.stop.check_token(tok.id);
                if finished.is_none() && s.tokens.len() >= context {
                    finished = Some(FinishReason::Length);
                }
                let sampled = tok.id;
                events.push(TokenEvent { id, token: tok, finished, cached_prompt_tokens: s.cached });
                if finished.is_some() {
                    done.push(id);
                    break;
                }
                if draft.get(j) != Some(&sampled) {
                    break;
                }
                s.computed += 1;
                kept += 1;
            }
            self.accepted += kept as u64;
            if !draft.is_empty() {
                s.draft_len = if kept == draft.len() { (2 * kept).min(self.cfg.prompt_lookup) } else { kept + 1 };
            }
            if self.cfg.prefix_cache {
                s.register_full_blocks(&mut self.pool)?;
            }
        }
        self.streams_scratch = streams;
        for id in done {
            self.finish(id);
        }
        Ok(events)
    }

    /// Ends a sequence: frees its blocks, or for a prefill-only sequence
    /// keeps them (see [`add_prefill_only`](Self::add_prefill_only)).
    fn finish(&mut self, id: u64) {
        match self.seqs.get(&id) {
            Some(s) if s.hold => {
                self.running.retain(|&r| r != id);
                self.waiting.retain(|&r| r != id);
                if let Some(seq) = self.seqs.remove(&id) {
                    self.held.insert(id, seq);
                }
            }
            _ => {
                self.abort(id);
            }
        }
    }

    /// Chooses this step's (sequence, token count) pairs, allocating the
    /// blocks they need.
    fn schedule(&mut self) -> Result<Vec<(u64, usize)>, EngineError> {
        let bs = self.cfg.block_size;
        let mut budget = self.cfg.max_batch_tokens;
        let mut plan = Vec::new();
        // Prefill tokens this step may take: all the budget, unless sequences
        // decode and a stall budget is set.
        let decoding = self.running.iter().any(|id| self.seqs.get(id).is_some_and(Seq::is_decoding));
        let mut prefill_left = match self.cfg.max_decode_stall_ms {
            Some(ms) if decoding => self.cost.allowance(ms, bs),
            _ => usize::MAX,
        };

        // 1. Running sequences, highest class first and oldest first inside
        //    a class: decodes take one token, prefills take what the budget
        //    leaves.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let s = &self.seqs[&id];
            let decode = s.is_decoding();
            let mut n = (s.tokens.len() - s.computed).min(budget).min(if decode { 1 } else { prefill_left });
            let draft = if decode && s.lookup && self.cfg.prompt_lookup > 0 {
                // Never past the step's budget, the request's max_tokens or the context,
                // and only into free blocks: a guess never preempts a sequence.
                let free = (s.table.len() + self.pool.available()) * bs;
                let room = (s.max_new.saturating_sub(s.generated.len() + 1))
                    .min(self.model.config().context.saturating_sub(s.tokens.len() + 1))
                    .min(budget - n)
                    .min(free.saturating_sub(s.computed + n))
                    .min(if s.draft_len == 0 { self.cfg.prompt_lookup } else { s.draft_len });
                lookup::draft(&s.tokens, room).to_vec()
            } else {
                Vec::new()
            };
            n += draft.len();
            if n == 0 {
                // A prefill past this step's allowance: it goes on next step.
                i += 1;
                continue;
            }
            let need = (s.computed + n).div_ceil(bs).saturating_sub(s.table.len());
            if need > self.pool.available() && !self.make_room(need, i)? {
                // `make_room` preempted this very sequence.
                continue;
            }
            let blocks = self.pool.allocate(need)?;
            let s = self.seqs.get_mut(&id).ok_or(EngineError::Internal("scheduled sequence missing"))?;
            s.table.extend(blocks);
            s.draft = draft;
            plan.push((id, n));
            budget -= n;
            if !decode {
                prefill_left -= n;
            }
            i += 1;
        }

        // 2. Admit waiting sequences, in queue order (highest class first),
        //    while seats, budget and blocks allow. A request that cannot
        //    have its blocks stops admission: a lower class never takes the
        //    blocks a higher one waits for.
        while budget > 0 && self.running.len() < self.cfg.max_running {
            let Some(&id) = self.waiting.front() else { break };
            let s = self.seqs.get_mut(&id).ok_or(EngineError::Internal("scheduled sequence missing"))?;
            if self.cfg.prefix_cache && s.table.is_empty() {
                s.acquire_prefix(&mut self.pool);
                self.prefix_hit_tokens += s.computed as u64;
            }
            let n = (s.tokens.len() - s.computed).min(budget).min(prefill_left);
            let need = (s.computed + n).div_ceil(bs).saturating_sub(s.table.len());
            if n == 0 || need > self.pool.available() {
                // Keep its prefix blocks; it will try again next step.
                break;
            }
            let blocks = self.pool.allocate(need)?;
            s.table.extend(blocks);
            self.waiting.pop_front();
            self.seat(id);
            plan.push((id, n));
            budget -= n;
            prefill_left -= n;
        }
        Ok(plan)
    }

    /// Preempts sequences from the back of `running` (the lowest class's
    /// newest; everything behind `index` is of its class or lower) until
    /// `need` blocks are available. Returns false if the sequence at `index`
    /// itself had to go.
    fn make_room(&mut self, need: usize, index: usize) -> Result<bool, EngineError> {
        while need > self.pool.available() {
            let Some(victim) = self.running.pop() else { return Ok(false) };
            let s = self.seqs.get_mut(&victim).ok_or(EngineError::Internal("preempted sequence missing"))?;
            s.release(&mut self.pool);
            let class = s.priority;
            self.requeue(victim);
            self.preemptions += 1;
            self.preemptions_by_class[class.index()] += 1;
            tracing::debug!(victim, %class, "preempted by recompute: KV pool exhausted");
            if self.running.len() == index {
                return Ok(false);
            }
        }
        Ok(true)
    }
}
