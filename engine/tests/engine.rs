//! Self-consistency of the engine on the real model: a sequence's greedy
//! tokens must not depend on batching, block size, chunking, preemption,
//! prefix sharing, or a gather/scatter round trip of its KV blocks.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]

mod common;

use common::{engine, greedy, run_all};
use engine::batch::{EngineConfig, EngineError, Request};
use engine::weights::Weights;
use types::kv::KvDtype;
use types::sampling::SamplingParams;

fn prompts(tok: &engine::tokenizer::Tokenizer) -> Vec<Vec<u32>> {
    let texts = [
        "The capital of France is",
        "Once upon a time, there was a",
        "def fibonacci(n):\n",
        "List three colors:",
        "1, 2, 3, 4, 5,",
        "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. Again:",
        "Water boils at",
        "Hi",
    ];
    texts.iter().map(|t| tok.encode(t, false).expect("encode")).collect()
}

const N: u32 = 12;

#[test]
fn batch_of_8_equals_each_alone() {
    let (mut e, tok) = engine(EngineConfig::default());
    let ps = prompts(&tok);
    let batched = run_all(&mut e, &ps, &greedy(N));
    for (i, p) in ps.iter().enumerate() {
        let alone = run_all(&mut e, std::slice::from_ref(p), &greedy(N));
        assert_eq!(batched[i], alone[0], "prompt {i} differs batched vs alone");
        assert_eq!(alone[0].len(), N as usize);
    }
    assert_eq!(e.kv_stats().used, 0, "finished sequences leaked KV blocks");
}

#[test]
fn block_size_and_chunking_do_not_change_tokens() {
    let (mut base, tok) = engine(EngineConfig { prefix_cache: false, ..EngineConfig::default() });
    let ps = prompts(&tok);
    let reference = run_all(&mut base, &ps, &greedy(N));
    drop(base);
    for (bs, chunk) in [(1, 512), (32, 512), (16, 7), (16, 1)] {
        let cfg = EngineConfig {
            block_size: bs,
            max_batch_tokens: chunk,
            max_running: chunk.min(16),
            prefix_cache: false,
            kv_blocks: 8192 / bs,
            ..EngineConfig::default()
        };
        let (mut e, _) = engine(cfg);
        assert_eq!(run_all(&mut e, &ps, &greedy(N)), reference, "block size {bs}, chunk budget {chunk}");
        assert_eq!(e.kv_stats().used, 0);
    }
}

#[test]
fn preemption_by_recompute_keeps_outputs() {
    let (mut big, tok) = engine(EngineConfig::default());
    let ps = prompts(&tok);
    let reference = run_all(&mut big, &ps, &greedy(24));
    drop(big);
    // 12 blocks of 4 tokens cannot hold 8 sequences of ~10-30 tokens at once.
    let (mut small, _) =
        engine(EngineConfig { block_size: 4, kv_blocks: 12, prefix_cache: false, ..EngineConfig::default() });
    let out = run_all(&mut small, &ps, &greedy(24));
    assert!(small.preemptions() > 0, "the small pool should have forced preemption");
    assert_eq!(out, reference);
    assert_eq!(small.kv_stats().used, 0);
}

#[test]
fn shared_prefix_reuses_blocks_and_keeps_outputs() {
    let (mut e, tok) = engine(EngineConfig::default());
    let system = "You are a careful assistant. Answer briefly and precisely. ".repeat(4);
    let a = tok.encode(&format!("{system}Question: what is 2+2?"), false).expect("encode");
    let first = run_all(&mut e, std::slice::from_ref(&a), &greedy(8));
    let cached = e.kv_stats().cached;
    assert!(cached >= a.len() / 16 - 1, "full prompt blocks should stay cached, got {cached}");
    // Same prompt again: served from cached blocks, same answer.
    e.add(Request {
        id: 100,
        prompt: a.clone(),
        params: greedy(8),
        salt: 0,
        priority: Default::default(),
        generated: Vec::new(),
    })
    .expect("add");
    e.step().expect("step");
    let computed_from_cache = e.computed_tokens(100).expect("running");
    // After one step it has computed everything; its table starts with the cached blocks.
    assert!(computed_from_cache >= a.len());
    e.abort(100);
    let again = run_all(&mut e, std::slice::from_ref(&a), &greedy(8));
    assert_eq!(first, again);
    // A different salt must not see the cache: run with salt 7 and check outputs equal anyway.
    e.add(Request {
        id: 5,
        prompt: a.clone(),
        params: greedy(8),
        salt: 7,
        priority: Default::default(),
        generated: Vec::new(),
    })
    .expect("add");
    let mut salted = Vec::new();
    while e.has_work() {
        salted.extend(e.step().expect("step").into_iter().map(|ev| ev.token.id));
    }
    assert_eq!(salted, first[0]);
    assert_eq!(e.kv_stats().used, 0);
}

#[test]
fn prefix_cache_hit_skips_prefill_work() {
    let (mut e, tok) = engine(EngineConfig { max_batch_tokens: 16, max_running: 4, ..EngineConfig::default() });
    let a = tok.encode(&"The history of the lighthouse is long and varied. ".repeat(6), false).expect("encode");
    assert!(a.len() > 48);
    run_all(&mut e, std::slice::from_ref(&a), &greedy(1));
    // With a 16-token budget a cold prefill takes ceil(len/16) steps; a warm one starts
    // at the first uncached block, so its first step already reaches past the cached prefix.
    e.add(Request {
        id: 9,
        prompt: a.clone(),
        params: greedy(1),
        salt: 0,
        priority: Default::default(),
        generated: Vec::new(),
    })
    .expect("add");
    e.step().expect("step");
    let done = e.computed_tokens(9).unwrap_or(a.len());
    assert!(done > 16, "warm prefill computed only {done} tokens in its first step");
    e.abort(9);
    assert_eq!(e.kv_stats().used, 0);
}

#[test]
fn gather_clear_scatter_mid_sequence_is_bit_exact() {
    let (mut e, tok) = engine(EngineConfig { prefix_cache: false, ..EngineConfig::default() });
    let p = tok.encode("Once upon a time, in a kingdom by the sea, there lived", false).expect("encode");
    let reference = run_all(&mut e, std::slice::from_ref(&p), &greedy(16));

    e.add(Request {
        id: 1,
        prompt: p.clone(),
        params: greedy(16),
        salt: 0,
        priority: Default::default(),
        generated: Vec::new(),
    })
    .expect("add");
    let mut out = Vec::new();
    // Prefill + a few decode steps.
    for _ in 0..4 {
        out.extend(e.step().expect("step").into_iter().map(|ev| ev.token.id));
    }
    let table = e.block_table(1).expect("running").to_vec();
    let before = e.pool().gather(&table).expect("gather");
    e.pool_mut().clear(&table).expect("clear");
    assert_ne!(e.pool().gather(&table).expect("gather"), before, "clear must change the blocks");
    e.pool_mut().scatter(&table, &before).expect("scatter");
    assert_eq!(e.pool().gather(&table).expect("gather"), before);
    while e.has_work() {
        out.extend(e.step().expect("step").into_iter().map(|ev| ev.token.id));
    }
    assert_eq!(out, reference[0]);
}

#[test]
fn f32_kv_cache_runs_and_mostly_agrees() {
    let (mut e16, tok) = engine(EngineConfig::default());
    let ps = prompts(&tok);
    let a = run_all(&mut e16, &ps[..2], &greedy(6));
    drop(e16);
    let (mut e32, _) = engine(EngineConfig { kv_dtype: KvDtype::F32, ..EngineConfig::default() });
    let b = run_all(&mut e32, &ps[..2], &greedy(6));
    // F16 vs F32 KV can flip a near-tie, but not the first token of these prompts.
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x[0], y[0]);
    }
}

#[test]
fn bad_requests_are_typed_errors() {
    let (mut e, _) = engine(EngineConfig { kv_blocks: 64, ..EngineConfig::default() });
    let ctx = e.model().config().context;
    let add = |e: &mut engine::batch::Engine, id, prompt: Vec<u32>, params: SamplingParams| {
        e.add(Request { id, prompt, params, salt: 0, priority: Default::default(), generated: Vec::new() })
    };
    assert!(matches!(add(&mut e, 1, vec![], greedy(4)), Err(EngineError::InvalidPrompt(_))));
    assert!(matches!(add(&mut e, 2, vec![1; ctx + 1], greedy(4)), Err(EngineError::InvalidPrompt(_))));
    assert!(matches!(add(&mut e, 3, vec![60_000], greedy(4)), Err(EngineError::InvalidPrompt(_))));
    // Fits the context but not this small pool.
    assert!(matches!(add(&mut e, 4, vec![1; 64 * 16 + 1], greedy(4)), Err(EngineError::InvalidPrompt(_))));
    assert!(matches!(add(&mut e, 5, vec![1, 2], greedy(0)), Err(EngineError::InvalidParams(_))));
    let nan = SamplingParams { temperature: f32::NAN, ..greedy(4) };
    assert!(matches!(add(&mut e, 6, vec![1, 2], nan), Err(EngineError::InvalidParams(_))));
    add(&mut e, 7, vec![1, 2], greedy(4)).expect("valid");
    assert!(matches!(add(&mut e, 7, vec![1, 2], greedy(4)), Err(EngineError::DuplicateId(7))));
    assert!(e.abort(7));
    assert!(!e.abort(7));
    assert_eq!(e.kv_stats().used, 0);
}

#[test]
fn abort_mid_generation_frees_blocks() {
    let (mut e, tok) = engine(EngineConfig::default());
    let ps = prompts(&tok);
    for (i, p) in ps.iter().enumerate() {
        e.add(Request {
            id: i as u64,
            prompt: p.clone(),
            params: greedy(50),
            salt: 0,
            priority: Default::default(),
            generated: Vec::new(),
        })
        .expect("add");
    }
    for _ in 0..3 {
        e.step().expect("step");
    }
    assert!(e.kv_stats().used > 0);
    for i in 0..ps.len() as u64 {
        assert!(e.abort(i));
    }
    assert_eq!(e.kv_stats().used, 0);
    assert!(!e.has_work());
}

#[test]
fn stop_token_ends_sequence_and_max_tokens_counts() {
    let (mut e, tok) = engine(EngineConfig::default());
    let p = tok.encode("The capital of France is", false).expect("encode");
    let free = run_all(&mut e, std::slice::from_ref(&p), &greedy(10));
    // Make the third generated token a stop token: generation must end right there.
    let stop = free[0][2];
    let params = SamplingParams { stop_token_ids: vec![stop], ..greedy(10) };
    let out = run_all(&mut e, std::slice::from_ref(&p), &params);
    let first = free[0].iter().position(|&t| t == stop).expect("present");
    assert_eq!(out[0], free[0][..=first].to_vec());
}

/// Steps `e` with sequence 1 decoding and a long prompt (sequence 2) arriving, until the
/// prompt is computed; returns the prompt tokens each step computed. Every step must give
/// sequence 1 its next token.
fn chunks_beside_a_decoder(e: &mut engine::batch::Engine, short: &[u32], long: &[u32]) -> Vec<usize> {
    e.add(Request {
        id: 1,
        prompt: short.to_vec(),
        params: greedy(4096),
        salt: 0,
        priority: Default::default(),
        generated: Vec::new(),
    })
    .expect("add");
    while !e.step().expect("step").iter().any(|t| t.id == 1) {}
    e.add(Request {
        id: 2,
        prompt: long.to_vec(),
        params: greedy(2),
        salt: 0,
        priority: Default::default(),
        generated: Vec::new(),
    })
    .expect("add");
    let (mut chunks, mut before) = (Vec::new(), 0);
    while before < long.len() {
        let events = e.step().expect("step");
        assert!(events.iter().any(|t| t.id == 1), "the decoding sequence skipped a step");
        let done = e.computed_tokens(2).unwrap_or(long.len());
        chunks.push(done - before);
        before = done;
        assert!(chunks.len() < 1000, "the prompt never finished");
    }
    e.abort(1);
    e.abort(2);
    assert_eq!(e.kv_stats().used, 0);
    chunks
}

#[test]
fn a_decode_stall_budget_cuts_prefill_chunks_only_while_sequences_decode() {
    let long_text = "The history of the lighthouse is long and varied. ".repeat(12);
    let cfg = |ms| EngineConfig { max_decode_stall_ms: ms, prefix_cache: false, ..EngineConfig::default() };
    let (mut e, tok) = engine(cfg(Some(0.001)));
    let short = tok.encode("Once upon a time", false).expect("encode");
    let long = tok.encode(&long_text, false).expect("encode");
    assert!(long.len() > 100 && long.len() < 500, "{} tokens", long.len());
    let bs = e.config().block_size;

    // A budget no step can meet: one block per step, the decoder never waits longer.
    let tight = chunks_beside_a_decoder(&mut e, &short, &long);
    assert!(tight.iter().all(|n| *n <= bs), "chunks {tight:?} over one block ({bs})");
    assert_eq!(tight.len(), long.len().div_ceil(bs), "chunks {tight:?}");

    // Without decoders the budget does not apply: the prompt goes in one step.
    e.add(Request {
        id: 3,
        prompt: long.clone(),
        params: greedy(1),
        salt: 0,
        priority: Default::default(),
        generated: Vec::new(),
    })
    .expect("add");
    e.step().expect("step");
    assert_eq!(e.computed_tokens(3).unwrap_or(long.len()), long.len());
    e.abort(3);

    // A budget the prompt fits in (the decoder's own prompt measured the cost per token):
    // nothing is cut.
    let (mut e, _) = engine(cfg(Some(60_000.0)));
    assert_eq!(chunks_beside_a_decoder(&mut e, &short, &long), vec![long.len()]);

    // No budget: the whole prompt in the step it arrives.
    let (mut e, _) = engine(cfg(None));
    assert_eq!(chunks_beside_a_decoder(&mut e, &short, &long), vec![long.len()]);
}

#[test]
fn a_stall_budget_changes_no_token() {
    let (mut base, tok) = engine(EngineConfig { prefix_cache: false, ..EngineConfig::default() });
    let ps = prompts(&tok);
    let reference = run_all(&mut base, &ps, &greedy(N));
    drop(base);
    let cfg = EngineConfig { max_decode_stall_ms: Some(0.001), prefix_cache: false, ..EngineConfig::default() };
    let (mut e, _) = engine(cfg);
    assert_eq!(run_all(&mut e, &ps, &greedy(N)), reference);
    assert_eq!(e.kv_stats().used, 0);
}

/// Every Q4 matrix of the real model is repacked at load (`Weights::pack_panels`), and
/// its products are the same bits as the file layout's, one activation row (a decode
/// step, read straight from the packed panels) and several (unpacked from them).
#[test]
fn packed_q4_weights_give_the_file_layouts_bits() {
    use kernels::matmul::{matmul, MatmulScratch};
    let (plain, _) = Weights::from_gguf(&common::model_path()).expect("load model");
    let (mut packed, _) = Weights::from_gguf(&common::model_path()).expect("load model");
    let q4: Vec<(String, Vec<usize>)> = plain
        .tensors
        .iter()
        .filter(|(_, t)| t.dims.len() == 2 && kernels::matmul::panels::is_packed_type(t.ty))
        .map(|(n, t)| (n.clone(), t.dims.clone()))
        .collect();
    assert!(q4.len() >= 7 * plain.config.n_layers, "the test model's layer matrices are Q4 ({} found)", q4.len());
    packed.pack_panels(q4.iter().map(|(n, _)| n.as_str()));
    let last = format!("blk.{}.", plain.config.n_layers - 1);
    let pool = kernels::ThreadPool::new(2).expect("pool");
    let isa = kernels::Isa::detect();
    for (name, dims) in &q4 {
        let (rows, cols) = (dims[0], dims[1]);
        let (a, b) =
            (plain.matrix(name, rows, cols).expect("matrix"), packed.matrix(name, rows, cols).expect("matrix"));
        assert!(!a.has_panels() && b.has_panels(), "{name}: packed after pack_panels only");
        if !name.starts_with("blk.0.") && !name.starts_with(&last) {
            continue;
        }
        for m in [1, 5] {
            let x: Vec<f32> = (0..m * cols).map(|i| ((i * 7919) % 2001) as f32 / 1000.0 - 1.0).collect();
            let (mut ya, mut yb) = (vec![0f32; m * rows], vec![0f32; m * rows]);
            matmul(&pool, isa, &a, &x, m, &mut ya, &mut MatmulScratch::default());
            matmul(&pool, isa, &b, &x, m, &mut yb, &mut MatmulScratch::default());
            assert_eq!(ya, yb, "{name} m={m} on {}", isa.name());
        }
    }
}

/// Panels shared through a host panel directory (`Model::load` with `PanelHome::Host`):
/// the first load packs the copy, the second maps it, and both generate the same
/// tokens as a model with private panels.
#[test]
fn shared_panels_generate_the_private_panels_tokens() {
    use engine::batch::Engine;
    use engine::model::Model;
    use engine::weights::panels::{PanelHome, PanelSource, PanelStore};
    let path = common::model_path();
    let dir = std::env::temp_dir().join(format!("tandem-shared-panels-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let digest = engine::weights::digest::weights_digest(&path).expect("digest");
    let home = PanelHome::Host(PanelStore { dir: dir.clone(), model_digest: digest, private_on_error: false });
    let (base, tok) = engine(EngineConfig::default());
    let ps = prompts(&tok);
    let mut base = base;
    let reference = run_all(&mut base, &ps, &greedy(N));
    drop(base);
    let scalar = kernels::Isa::detect() == kernels::Isa::Scalar;
    let mut held = Vec::new();
    for round in 0..2 {
        let (w, _) = Weights::from_gguf(&path).expect("load model");
        let (model, outcome) = Model::load(w, 2, &home).expect("model");
        match (&outcome.source, round) {
            _ if scalar => assert_eq!(outcome.source, PanelSource::Unpacked),
            (PanelSource::Built(p), 0) | (PanelSource::Mapped(p), 1) => assert!(p.starts_with(&dir), "{outcome}"),
            _ => panic!("load {round}: {outcome}"),
        }
        assert_eq!(outcome.refused, None);
        let mut e = Engine::new(model, EngineConfig::default(), tok.eos_ids().to_vec()).expect("engine");
        assert_eq!(run_all(&mut e, &ps, &greedy(N)), reference, "load {round}: {outcome}");
        held.push(e);
    }
    drop(held);
    std::fs::remove_dir_all(&dir).expect("cleanup");
}

/// Prompts whose answers repeat them, so prompt-lookup drafts are accepted.
fn repeating_prompts(tok: &engine::tokenizer::Tokenizer) -> Vec<Vec<u32>> {
    let texts = [
        "Copy this line: red green blue yellow red green blue yellow red green blue yellow\nCopy: red green",
        "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
        "one two three four five six seven eight one two three four five six seven eight one two three",
    ];
    texts.iter().map(|t| tok.encode(t, false).expect("encode")).collect()
}

/// Prompt-lookup speculation (`EngineConfig::prompt_lookup`) returns plain decoding's
/// tokens, greedy and seeded-sampled with penalties, batched, at a `max_tokens` inside a
/// draft and under preemption, and leaks no block; drafts were accepted, so the
/// verification path really ran.
#[test]
fn prompt_lookup_changes_no_token() {
    let (mut base, tok) = engine(EngineConfig::default());
    let mut ps = prompts(&tok);
    ps.extend(repeating_prompts(&tok));
    let sampled = SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        seed: Some(11),
        frequency_penalty: 0.3,
        max_tokens: 32,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let cases = [("greedy", greedy(32)), ("greedy, 5 tokens", greedy(5)), ("seeded", sampled)];
    let references: Vec<_> = cases.iter().map(|(_, p)| run_all(&mut base, &ps, p)).collect();
    drop(base);
    let configs = [
        ("lookup 8", EngineConfig { prompt_lookup: 8, ..EngineConfig::default() }),
        ("lookup 3, chunked", EngineConfig { prompt_lookup: 3, max_batch_tokens: 20, ..EngineConfig::default() }),
        (
            "lookup 8, preempting",
            EngineConfig {
                prompt_lookup: 8,
                block_size: 4,
                kv_blocks: 24,
                prefix_cache: false,
                ..EngineConfig::default()
            },
        ),
    ];
    for (name, cfg) in configs {
        let (mut e, _) = engine(cfg);
        for ((case, params), reference) in cases.iter().zip(&references) {
            assert_eq!(&run_all(&mut e, &ps, params), reference, "{name}, {case}");
        }
        let (drafted, accepted) = e.draft_tokens();
        assert!(accepted > 20 && drafted >= accepted, "{name}: {accepted} of {drafted} draft tokens accepted");
        assert_eq!(e.kv_stats().used, 0, "{name}: blocks leaked");
        if name.ends_with("preempting") {
            assert!(e.preemptions() > 0, "the small pool should have forced preemption");
        }
        // A request that turns it off gets no draft, and the same tokens.
        let off = SamplingParams { prompt_lookup: false, ..greedy(32) };
        assert_eq!(run_all(&mut e, &ps, &off), references[0], "{name}, off by request");
        assert_eq!(e.draft_tokens(), (drafted, accepted), "{name}: a request that said no was drafted for");
    }
}

/// The step buffers reserved for the largest step the config allows (as the workers do at
/// start) are never outgrown, cover what an engine left to grow reaches at its largest
/// step, and change no token: a worker's memory does not step up with its batches.
#[test]
fn reserved_step_buffers_hold_the_largest_step_and_change_no_token() {
    let cfg = EngineConfig { max_batch_tokens: 48, max_running: 4, ..EngineConfig::default() };
    let (mut grown, tok) = engine(cfg.clone());
    let (mut reserved, _) = engine(cfg);
    let mut ps = prompts(&tok);
    // A prompt longer than the step budget, so that some step is a full one.
    ps.push(tok.encode(&"The quick brown fox jumps over the lazy dog. ".repeat(8), false).expect("encode"));
    assert!(ps.last().map_or(0, Vec::len) > 48);

    let at_start = grown.model().scratch_bytes();
    let bytes = reserved.reserve_scratch();
    assert!(bytes > at_start, "reserving grew the buffers: {at_start} -> {bytes} bytes");

    let want = run_all(&mut grown, &ps, &greedy(N));
    let got = run_all(&mut reserved, &ps, &greedy(N));
    assert_eq!(got, want, "reserved buffers changed a token");
    let high_water = grown.model().scratch_bytes();
    assert!(high_water > at_start, "the engine left alone grew its buffers: {at_start} -> {high_water} bytes");
    assert!(high_water <= bytes, "the reserve covers the largest step: grew to {high_water}, reserved {bytes}");
    assert_eq!(reserved.model().scratch_bytes(), bytes, "a reserved engine never outgrows its buffers");
}
