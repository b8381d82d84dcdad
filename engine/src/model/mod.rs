//! The Llama-family forward pass over a batch of sequence chunks.
//!
//! One call ([`Model::forward`]) runs any mix of prefill chunks and single
//! decode tokens: all tokens of the batch go through each matmul together
//! (which is where batching pays), while attention runs per token against
//! its own sequence's paged KV. Each token's K and V are written into the
//! pool before attention, so a chunk attends causally over its own tokens
//! and everything cached before it.

mod config;

pub use config::LlamaConfig;

use kernels::attention::{attend_heads, AttnShape};
use kernels::matmul::{matmul, matmul_multi, MatmulScratch};
use kernels::ops::{add_in_place, rmsnorm, swiglu, RopeTable};
use kernels::{Isa, ThreadPool};

use crate::kv::KvPool;

use crate::weights::panels::{PanelHome, PanelOutcome, PanelSource};
use crate::weights::{Weights, WeightsError};
use types::kv::{BlockId, KvLayout};

/// Errors from a forward pass; all are caller mistakes caught before any
/// state changes.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ForwardError {
    #[error("token id {id} is outside the vocabulary of {vocab}")]
    BadToken { id: u32, vocab: usize },
    #[error("position {pos} exceeds the context length {context}")]
    TooLong { pos: usize, context: usize },
    #[error("block table of {blocks} blocks cannot hold position {pos}")]
    TableTooShort { blocks: usize, pos: usize },
    #[error("empty chunk in batch")]
    EmptyChunk,
    /// A weight checked at load time failed to resolve: a bug, reported rather than panicking.
    #[error("weights: {0}")]
    Weights(String),
    #[error("KV layout {pool:?} does not match the model {model:?}")]
    LayoutMismatch { pool: Box<KvLayout>, model: Box<KvLayout> },
}

/// One sequence's tokens for this step: `tokens` occupy positions
/// `start..start + tokens.len()`; `table` must cover all of them.
#[derive(Debug, Clone, Copy)]
pub struct SeqChunk<'a> {
    pub tokens: &'a [u32],
    pub start: usize,
    pub table: &'a [BlockId],
    /// Compute logits for this many of the chunk's last tokens (0: none;
    /// 1: the last token's, as a prefill or a decode step needs; more: a
    /// draft's positions, for speculation).
    pub logits: usize,
}

struct Layer {
    attn_norm: Vec<f32>,
    ffn_norm: Vec<f32>,
    names: [String; 7],
}

const Q: usize = 0;
const K: usize = 1;
const V: usize = 2;
const O: usize = 3;
const GATE: usize = 4;
const UP: usize = 5;
const DOWN: usize = 6;

#[derive(Default)]
struct Scratch {
    x: Vec<f32>,
    xn: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    tmp: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    last: Vec<f32>,
    logits: Vec<f32>,
    mm: MatmulScratch,
}

impl Scratch {
    /// The buffers a step needs one row of per token, with their row widths: what
    /// `forward_hooked` sizes for each step and `reserve_scratch` for the largest.
    fn per_token(&mut self, cfg: &LlamaConfig) -> [(&mut Vec<f32>, usize); 9] {
        let (h, kvd, ffn) = (cfg.hidden, cfg.kv_dim(), cfg.ffn);
        [
            (&mut self.x, h),
            (&mut self.xn, h),
            (&mut self.q, h),
            (&mut self.k, kvd),
            (&mut self.v, kvd),
            (&mut self.att, h),
            (&mut self.tmp, h),
            (&mut self.gate, ffn),
            (&mut self.up, ffn),
        ]
    }

    /// Every float buffer, for counting their bytes.
    fn floats(&self) -> [&Vec<f32>; 11] {
        [
            &self.x,
            &self.xn,
            &self.q,
            &self.k,
            &self.v,
            &self.att,
            &self.tmp,
            &self.gate,
            &self.up,
            &self.last,
            &self.logits,
        ]
    }
}

/// A loaded model ready to run.
pub struct Model {
    cfg: LlamaConfig,
    weights: Weights,
    layers: Vec<Layer>,
    output_norm: Vec<f32>,
    output_name: String,
    rope: RopeTable,
    pool: ThreadPool,
    isa: Isa,
    s: Scratch,
}

impl Model {
    /// Checks every tensor's presence and shape up front, so a forward pass
    /// never meets a missing or misshapen weight. Packed panels are this
    /// process's own ([`Model::load`] can share them across the host).
    pub fn new(weights: Weights, threads: usize) -> Result<Self, WeightsError> {
        Self::load(weights, threads, &PanelHome::Private).map(|(model, _)| model)
    }

    /// As [`Model::new`], with the packed panels where `home` says; the
    /// outcome tells how they were come by (for the start-up log).
    pub fn load(mut weights: Weights, threads: usize, home: &PanelHome) -> Result<(Self, PanelOutcome), WeightsError> {
        let cfg = weights.config.clone();
        let isa = Isa::detect();
        let (h, kvd, ffn) = (cfg.hidden, cfg.kv_dim(), cfg.ffn);
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for l in 0..cfg.n_layers {
            let n = |s: &str| format!("blk.{l}.{s}.weight");
            let names =
                [n("attn_q"), n("attn_k"), n("attn_v"), n("attn_output"), n("ffn_gate"), n("ffn_up"), n("ffn_down")];
            let shapes = [(h, h), (kvd, h), (kvd, h), (h, h), (ffn, h), (ffn, h), (h, ffn)];
            for (name, (r, c)) in names.iter().zip(shapes) {
                weights.matrix(name, r, c)?;
            }
            layers.push(Layer {
                attn_norm: weights.vector(&n("attn_norm"), h)?,
                ffn_norm: weights.vector(&n("ffn_norm"), h)?,
                names,
            });
        }
        weights.matrix("token_embd.weight", cfg.vocab, h)?;
        let output_name = if cfg.tied_embeddings { "token_embd.weight" } else { "output.weight" }.to_owned();
        weights.matrix(&output_name, cfg.vocab, h)?;
        // The matrices a forward pass multiplies with get packed panels (the
        // SIMD kernels read those; the scalar ones read the file layout, so
        // for them a packed copy would only cost memory). An untied
        // `token_embd` is only looked up row by row and stays as it is.
        let packed: Vec<String> = layers.iter().flat_map(|l| l.names.iter()).chain([&output_name]).cloned().collect();
        let names = packed.iter().map(String::as_str);
        let panels = match home {
            _ if isa == Isa::Scalar => PanelOutcome::new(PanelSource::Unpacked, 0),
            PanelHome::Private => weights.pack_panels(names),
            PanelHome::Host(store) => weights.share_panels(names, store)?,
        };
        let output_norm = weights.vector("output_norm.weight", h)?;
        let rope = RopeTable::new(cfg.head_dim, cfg.rope_dims, cfg.rope_theta, cfg.context);
        let pool =
            ThreadPool::new(threads).map_err(|source| WeightsError::Io { path: "<thread pool>".into(), source })?;
        let model = Self { cfg, weights, layers, output_norm, output_name, rope, pool, isa, s: Scratch::default() };
        Ok((model, panels))
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// Grows every buffer of a step to what a step of `tokens` tokens with
    /// `logit_rows` rows of logits needs, and writes them; returns the
    /// scratch's bytes (see [`scratch_bytes`](Self::scratch_bytes)).
    ///
    /// Why: the buffers are kept from step to step and only grow, so left
    /// alone they grow to a worker's largest step so far, in steps, whenever
    /// a load or a fault brings a larger batch than before (on a decode
    /// worker: a re-prefill after a prefill worker died, a burst of
    /// resumes), each step another few MiB resident for good. An hour of
    /// chaos read that as a leak (1.16 MiB per 10 minutes after warm-up).
    /// Reserved at start, the worker's memory is its working set from the
    /// first request on, and a first large step does not fault it in.
    pub fn reserve_scratch(&mut self, tokens: usize, logit_rows: usize) -> usize {
        let cfg = &self.cfg;
        let rows = logit_rows.min(tokens);
        let s = &mut self.s;
        for (buf, width) in s.per_token(cfg) {
            grow(buf, tokens * width);
        }
        grow(&mut s.last, rows * cfg.hidden);
        grow(&mut s.logits, rows * cfg.vocab);
        // The widest activations a matmul quantizes are the FFN's.
        s.mm.reserve(tokens, cfg.hidden.max(cfg.ffn));
        self.scratch_bytes()
    }

    /// Bytes the step buffers hold (their capacity): they grow to the
    /// largest step so far unless [`reserve_scratch`](Self::reserve_scratch)
    /// sized them at start. Not counted: each pool thread's attention
    /// scores (a few tens of KiB, by context length).
    pub fn scratch_bytes(&self) -> usize {
        let floats: usize = self.s.floats().iter().map(|b| b.capacity()).sum();
        floats * std::mem::size_of::<f32>() + self.s.mm.capacity_bytes()
    }

    /// The KV layout this model needs for a given block size and dtype.
    pub fn kv_layout(&self, block_size: usize, dtype: types::kv::KvDtype) -> KvLayout {
        KvLayout {
            n_layers: self.cfg.n_layers,
            n_kv_heads: self.cfg.n_kv_heads,
            head_dim: self.cfg.head_dim,
            block_size,
            dtype,
        }
    }

    fn validate(&self, kv: &KvPool, batch: &[SeqChunk<'_>]) -> Result<(), ForwardError> {
        let want = self.kv_layout(kv.layout().block_size, kv.layout().dtype);
        if *kv.layout() != want {
            return Err(ForwardError::LayoutMismatch { pool: Box::new(*kv.layout()), model: Box::new(want) });
        }
        for c in batch {
            if c.tokens.is_empty() {
                return Err(ForwardError::EmptyChunk);
            }
            if let Some(&id) = c.tokens.iter().find(|&&t| t as usize >= self.cfg.vocab) {
                return Err(ForwardError::BadToken { id, vocab: self.cfg.vocab });
            }
            let last = c.start + c.tokens.len() - 1;
            if last >= self.cfg.context {
                return Err(ForwardError::TooLong { pos: last, context: self.cfg.context });
            }
            if last / want.block_size >= c.table.len() {
                return Err(ForwardError::TableTooShort { blocks: c.table.len(), pos: last });
            }
        }
        Ok(())
    }

    /// Runs one step. Returns logits (`vocab` each): each chunk's last
    /// `logits` rows, in batch order.
    pub fn forward(&mut self, kv: &mut KvPool, batch: &[SeqChunk<'_>]) -> Result<&[f32], ForwardError> {
        self.forward_hooked(kv, batch, &mut |_, _| {})
    }

    /// [`forward`](Self::forward), calling `after_kv(layer, pool)` as soon as
    /// the step's K and V of `layer` are in the pool (before that layer's
    /// attention), so a caller can ship a layer while later ones compute.
    pub fn forward_hooked(
        &mut self,
        kv: &mut KvPool,
        batch: &[SeqChunk<'_>],
        after_kv: &mut dyn FnMut(usize, &KvPool),
    ) -> Result<&[f32], ForwardError> {
        self.validate(kv, batch)?;
        let cfg = &self.cfg;
        let (h, kvd, ffn, hd) = (cfg.hidden, cfg.kv_dim(), cfg.ffn, cfg.head_dim);
        let n_tok: usize = batch.iter().map(|c| c.tokens.len()).sum();
        // (chunk, position) of every token in the step.
        let mut where_ = Vec::with_capacity(n_tok);
        for (ci, c) in batch.iter().enumerate() {
            where_.extend((0..c.tokens.len()).map(|i| (ci, c.start + i)));
        }
        let s = &mut self.s;
        for (buf, width) in s.per_token(cfg) {
            buf.resize(n_tok * width, 0.0);
        }

        let embd =
            self.weights.matrix("token_embd.weight", cfg.vocab, h).map_err(|e| ForwardError::Weights(e.to_string()))?;
        let mut row = 0;
        for c in batch {
            for &t in c.tokens {
                embd.dequantize_row_into(t as usize, &mut s.x[row * h..(row + 1) * h]);
                row += 1;
            }
        }

        let shape = AttnShape {
            n_heads: cfg.n_heads,
            n_kv_heads: cfg.n_kv_heads,
            head_dim: hd,
            block_size: kv.layout().block_size,
        };
        let group_w = cfg.n_heads / cfg.n_kv_heads * hd;
        for (l, layer) in self.layers.iter().enumerate() {
            let w = |i: usize, r: usize, c: usize| {
                self.weights.matrix(&layer.names[i], r, c).map_err(|e| ForwardError::Weights(e.to_string()))
            };
            par_rmsnorm(&self.pool, &s.x, &layer.attn_norm, cfg.rms_eps, &mut s.xn);
            matmul_multi(
                &self.pool,
                self.isa,
                &[w(Q, h, h)?, w(K, kvd, h)?, w(V, kvd, h)?],
                &s.xn,
                n_tok,
                &mut [&mut s.q, &mut s.k, &mut s.v],
                &mut s.mm,
            );
            for (i, &(ci, pos)) in where_.iter().enumerate() {
                self.rope.apply(&mut s.q[i * h..(i + 1) * h], pos);
                self.rope.apply(&mut s.k[i * kvd..(i + 1) * kvd], pos);
                let c = &batch[ci];
                let bs = shape.block_size;
                kv.write(l, c.table[pos / bs], pos % bs, &s.k[i * kvd..(i + 1) * kvd], &s.v[i * kvd..(i + 1) * kvd]);
            }
            after_kv(l, kv);
            // Attention: work items are (token, KV head) pairs, whose query heads share each
            // K/V load; with too few of them to keep every thread busy (a lone decode token
            // has n_kv_heads = 3 items for 2 threads, so one thread did two), items are
            // single (token, query head) pairs instead. Results are the same either way.
            let (ks, vs) = kv.layer(l);
            let q = &s.q;
            let per_item = if n_tok * cfg.n_kv_heads < 2 * self.pool.threads() { 1 } else { group_w / hd };
            let item_w = per_item * hd;
            let per_tok = cfg.n_heads / per_item;
            let items = n_tok * per_tok;
            let isa = self.isa;
            let where_ref = &where_;
            let chunk = if items < 64 { 1 } else { 4 };
            // Item (i, j) owns att[i * h + j * item_w..][..item_w]: h = per_tok * item_w, so
            // that is item * item_w, and the pool lends each range of items its own part.
            self.pool.for_chunks_mut(&mut s.att[..items * item_w], item_w, chunk, &|range, part| {
                SCORES.with_borrow_mut(|scores| {
                    for (k, item) in range.enumerate() {
                        let (i, j) = (item / per_tok, item % per_tok);
                        let (ci, pos) = where_ref[i];
                        let out = &mut part[k * item_w..(k + 1) * item_w];
                        attend_heads(
                            isa,
                            &shape,
                            ks,
                            vs,
                            batch[ci].table,
                            pos + 1,
                            j * per_item..(j + 1) * per_item,
                            &q[i * h..(i + 1) * h],
                            out,
                            scores,
                        );
                    }
                })
            });
            matmul(&self.pool, self.isa, &w(O, h, h)?, &s.att, n_tok, &mut s.tmp, &mut s.mm);
            add_in_place(&mut s.x, &s.tmp);

            par_rmsnorm(&self.pool, &s.x, &layer.ffn_norm, cfg.rms_eps, &mut s.xn);
            matmul_multi(
                &self.pool,
                self.isa,
                &[w(GATE, ffn, h)?, w(UP, ffn, h)?],
                &s.xn,
                n_tok,
                &mut [&mut s.gate, &mut s.up],
                &mut s.mm,
            );
            par_swiglu(&self.pool, &mut s.gate, &s.up, ffn);
            matmul(&self.pool, self.isa, &w(DOWN, h, ffn)?, &s.gate, n_tok, &mut s.tmp, &mut s.mm);
            add_in_place(&mut s.x, &s.tmp);
        }

        // Logits only for the rows that asked.
        s.last.clear();
        let mut end = 0;
        for c in batch {
            end += c.tokens.len();
            let from = end - c.logits.min(c.tokens.len());
            s.last.extend_from_slice(&s.x[from * h..end * h]);
        }
        let n_out = s.last.len() / h;
        s.xn.resize(n_out * h, 0.0);
        rmsnorm(&s.last, &self.output_norm, cfg.rms_eps, &mut s.xn[..n_out * h]);
        s.logits.resize(n_out * cfg.vocab, 0.0);
        let out =
            self.weights.matrix(&self.output_name, cfg.vocab, h).map_err(|e| ForwardError::Weights(e.to_string()))?;
        matmul(&self.pool, self.isa, &out, &s.xn[..n_out * h], n_out, &mut s.logits, &mut s.mm);
        Ok(&s.logits)
    }
}

/// Grows `buf` to `n` elements, written (so resident), allocating no more than that.
fn grow(buf: &mut Vec<f32>, n: usize) {
    if buf.len() < n {
        buf.reserve_exact(n - buf.len());
        buf.resize(n, 0.0);
    }
}

thread_local! {
    /// Each pool thread's attention scores, kept from step to step: a fresh buffer per
    /// work item was an allocation per item and layer in every decode step.
    static SCORES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// RMSNorm of each row, rows split across the pool (prefill has hundreds).
fn par_rmsnorm(pool: &ThreadPool, x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let n = weight.len();
    let rows = x.len() / n;
    pool.for_chunks_mut(&mut out[..rows * n], n, 16, &|r, out| {
        rmsnorm(&x[r.start * n..r.end * n], weight, eps, out);
    });
}

/// `gate = silu(gate) * up` across the pool (one `exp` per element adds up in prefill, and
/// in a decode step it was serial work while the other threads waited). The op is
/// element-wise, so it is split by runs of elements, not rows: a lone decode row is
/// shared too, and no element's result depends on the split.
fn par_swiglu(pool: &ThreadPool, gate: &mut [f32], up: &[f32], width: usize) {
    const RUN: usize = 256;
    let n = gate.len() / width * width;
    let whole = n / RUN * RUN;
    let (head, tail) = gate[..n].split_at_mut(whole);
    pool.for_chunks_mut(head, RUN, 4, &|r, g| {
        swiglu(g, &up[r.start * RUN..r.end * RUN]);
    });
    swiglu(tail, &up[whole..n]);
}
