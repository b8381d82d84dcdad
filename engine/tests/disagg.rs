//! Prefill in one engine, decode in another: the KV moves layer by layer
//! between two separate pools (as it will between two processes), and the
//! output must equal one engine doing both.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]

mod common;

use common::{engine, greedy, run_all};
use engine::batch::{EngineConfig, EngineError, Request};
use engine::sampler::FinishReason;

#[test]
fn prefill_here_decode_there_equals_one_engine() {
    let cfg = EngineConfig { prefix_cache: false, ..EngineConfig::default() };
    let (mut prefill, tok) = engine(cfg.clone());
    let (mut decode, _) = engine(cfg.clone());
    let (mut single, _) = engine(cfg);
    let layers = prefill.model().config().n_layers;
    let long = "The lighthouse keeper climbed the stairs every evening. ".repeat(125);
    let prompts: Vec<Vec<u32>> = ["Hello", "The capital of France is", long.as_str()]
        .iter()
        .map(|t| tok.encode(t, false).expect("encode"))
        .collect();
    let lens: Vec<usize> = prompts.iter().map(Vec::len).collect();
    assert!(lens[0] == 1 && lens[2] > 1000, "cover 1-token and long prompts: {lens:?}");
    let reference = run_all(&mut single, &prompts, &greedy(12));

    for (i, p) in prompts.iter().enumerate() {
        let id = i as u64;
        prefill
            .add_prefill_only(Request {
                id,
                prompt: p.clone(),
                params: greedy(12),
                salt: 0,
                priority: Default::default(),
                generated: Vec::new(),
            })
            .expect("add");
        let mut first = None;
        while first.is_none() {
            for ev in prefill.step().expect("step") {
                assert_eq!(ev.finished, Some(FinishReason::Length), "prefill-only stops after one token");
                first = Some(ev.token);
            }
        }
        let first = first.expect("first token");
        let src = prefill.held_blocks(id).expect("held").to_vec();
        assert_eq!(src.len(), prefill.blocks_for(p.len()));

        let dst = decode.reserve_blocks(decode.blocks_for(p.len())).expect("reserve");
        for l in 0..layers {
            let (k, v) = prefill.pool().gather_layer(l, &src).expect("gather");
            decode.pool_mut().scatter_layer(l, &dst, &k, &v).expect("scatter");
        }
        assert!(prefill.release_held(id));
        assert_eq!(prefill.kv_stats().used, 0, "prefill side keeps nothing after the transfer");

        let mut out = vec![first.id];
        assert_eq!(
            decode
                .add_prefilled(
                    Request {
                        id,
                        prompt: p.clone(),
                        params: greedy(12),
                        salt: 0,
                        priority: Default::default(),
                        generated: Vec::new()
                    },
                    dst,
                    &first
                )
                .expect("join"),
            None
        );
        while decode.has_work() {
            out.extend(decode.step().expect("step").into_iter().map(|e| e.token.id));
        }
        assert_eq!(out, reference[i], "prompt {i} ({} tokens)", p.len());
        assert_eq!(decode.kv_stats().used, 0);
    }
}

#[test]
fn joining_with_wrong_blocks_or_a_final_first_token() {
    let (mut e, tok) = engine(EngineConfig::default());
    let p = tok.encode("The capital of France is", false).expect("encode");
    let blocks = e.reserve_blocks(3).expect("reserve");
    let first = engine::sampler::SampledToken { id: 7042, logprob: None, top: vec![] };
    let err = e.add_prefilled(
        Request {
            id: 1,
            prompt: p.clone(),
            params: greedy(4),
            salt: 0,
            priority: Default::default(),
            generated: Vec::new(),
        },
        blocks.clone(),
        &first,
    );
    assert!(matches!(err, Err(EngineError::InvalidPrompt(_))), "1 block needed, 3 given");
    // On error the caller still owns them.
    e.release_reserved(&blocks).expect("release");
    assert_eq!(e.kv_stats().used, 0);
    // A first token that is a stop token ends the request at once and frees the blocks.
    let blocks = e.reserve_blocks(1).expect("reserve");
    let params = types::sampling::SamplingParams { stop_token_ids: vec![7042], ..greedy(4) };
    let done = e
        .add_prefilled(
            Request { id: 2, prompt: p, params, salt: 0, priority: Default::default(), generated: Vec::new() },
            blocks,
            &first,
        )
        .expect("join");
    assert_eq!(done, Some(FinishReason::Stop));
    assert_eq!(e.kv_stats().used, 0);
    assert!(!e.has_work());
}

#[test]
fn streamed_prefill_kv_equals_the_held_blocks_exactly_once() {
    // Chunked (64 tokens a step) so blocks complete over several steps.
    let cfg = EngineConfig { max_batch_tokens: 64, ..EngineConfig::default() };
    let (mut e, tok) = engine(cfg);
    let layers = e.model().config().n_layers;
    let text = "A river runs to the sea, and the sea is never full; the wind goes round and round. ".repeat(12);
    let prompt = tok.encode(&text, false).expect("encode");
    assert!(prompt.len() > 200 && prompt.len() % 16 != 0, "{}", prompt.len());

    // Run 1: a cold cache. Run 2: the same prompt hits the prefix cache, so
    // the first step must also send the blocks it did not compute.
    let mut all_chunks = Vec::new();
    for (id, p) in [(1u64, prompt.clone()), (2, prompt.clone())] {
        let (tx, rx) = std::sync::mpsc::channel();
        let req = Request {
            id,
            prompt: p.clone(),
            params: greedy(1),
            salt: 0,
            priority: Default::default(),
            generated: Vec::new(),
        };
        e.add_prefill_streaming(req, Box::new(move |c| drop(tx.send(c.gather().expect("gather"))))).expect("add");
        let mut chunks = Vec::new();
        let mut steps = 0;
        loop {
            let events = e.step().expect("step");
            steps += 1;
            chunks.extend(rx.try_iter());
            if !events.is_empty() {
                break;
            }
        }
        assert!(
            matches!(rx.try_recv(), Err(std::sync::mpsc::TryRecvError::Disconnected)),
            "request {id}: the sink is dropped once every block was streamed, before the first token"
        );
        if id == 1 {
            assert!(steps > 3, "the prompt should take several steps, took {steps}");
        }
        let held = e.held_blocks(id).expect("held").to_vec();
        assert_eq!(held.len(), p.len().div_ceil(16));
        // Every (layer, block) exactly once, and the bytes equal the held blocks'.
        let mut seen = vec![vec![false; held.len()]; layers];
        let side = e.pool().layout().block_bytes() / layers / 2;
        for c in &chunks {
            let n = c.k.len() / side;
            assert_eq!(c.v.len(), c.k.len());
            for (b, s) in seen[c.layer].iter_mut().enumerate().skip(c.first_block).take(n) {
                assert!(!*s, "request {id}: layer {} block {b} streamed twice", c.layer);
                *s = true;
            }
            let (k, v) = e.pool().gather_layer(c.layer, &held[c.first_block..c.first_block + n]).expect("gather");
            assert!(k == c.k && v == c.v, "request {id}: layer {} blocks {}.. differ", c.layer, c.first_block);
        }
        assert!(seen.iter().all(|l| l.iter().all(|&b| b)), "request {id}: some (layer, block) never streamed");
        all_chunks.push(chunks.len());
        assert!(e.release_held(id));
    }
    assert!(all_chunks[1] < all_chunks[0], "the cached run streams its prefix in fewer, larger chunks: {all_chunks:?}");
}

/// Every generated token with its logprob, bit for bit.
fn tokens_of(events: &[engine::sampler::SampledToken]) -> Vec<(u32, Option<u32>)> {
    events.iter().map(|t| (t.id, t.logprob.map(f32::to_bits))).collect()
}

/// Runs `req` alone on `e` to its end.
fn run_one(e: &mut engine::batch::Engine, req: Request) -> Vec<engine::sampler::SampledToken> {
    e.add(req).expect("add");
    let mut out = Vec::new();
    while e.has_work() {
        out.extend(e.step().expect("step").into_iter().map(|ev| ev.token));
    }
    out
}

/// Prefills `req` on `p` (its first token sampled there), moves the KV into `d`'s blocks
/// layer by layer and decodes there: what a remote prefill does across two processes.
fn run_split(
    p: &mut engine::batch::Engine,
    d: &mut engine::batch::Engine,
    req: Request,
) -> Vec<engine::sampler::SampledToken> {
    let len = req.prompt.len() + req.generated.len();
    p.add_prefill_only(req.clone()).expect("add prefill-only");
    let mut first = None;
    while first.is_none() {
        first = p.step().expect("step").into_iter().next().map(|ev| ev.token);
    }
    let first = first.expect("first token");
    let src = p.held_blocks(req.id).expect("held").to_vec();
    let dst = d.reserve_blocks(d.blocks_for(len)).expect("reserve");
    for l in 0..p.model().config().n_layers {
        let (k, v) = p.pool().gather_layer(l, &src).expect("gather");
        d.pool_mut().scatter_layer(l, &dst, &k, &v).expect("scatter");
    }
    assert!(p.release_held(req.id));
    let last = req.params.max_tokens == 1;
    let done = d.add_prefilled(req, dst, &first).expect("join");
    assert_eq!(done, last.then_some(FinishReason::Length), "only a one-token answer ends with its first token");
    let mut out = vec![first];
    while d.has_work() {
        out.extend(d.step().expect("step").into_iter().map(|ev| ev.token));
    }
    out
}

/// The determinism contract behind request migration: a seeded answer is bit-equal however
/// it is computed. For greedy and for temperature 0.8 / top-p 0.95 / penalties, over 200
/// tokens: one engine alone; prefill on one engine and decode on another (the prefill side
/// samples token 0, the decode side token 1 onward); and a continuation from token k on a
/// fresh engine, given prompt + the first k tokens (`generated`) and the remaining
/// max_tokens, both prefilled locally and prefilled remotely. Token ids and logprobs equal.
#[test]
fn seeded_answers_are_bit_equal_local_remote_and_continued() {
    let cfg = EngineConfig { prefix_cache: false, ..EngineConfig::default() };
    let (mut single, tok) = engine(cfg.clone());
    let (mut prefill, _) = engine(cfg.clone());
    let (mut decode, _) = engine(cfg);
    let prompt = tok.encode("Once upon a time, in a village by the sea, there lived", false).expect("encode");
    let total = 200u32;
    let sampled = types::sampling::SamplingParams {
        temperature: 0.8,
        top_p: 0.95,
        presence_penalty: 0.3,
        frequency_penalty: 0.2,
        seed: Some(0x5eed),
        logprobs: Some(2),
        ..greedy(total)
    };
    let greedy_lp = types::sampling::SamplingParams { logprobs: Some(2), ..greedy(total) };
    for (name, params) in [("greedy", greedy_lp), ("sampled", sampled)] {
        let req = |id: u64, generated: &[u32], params: &types::sampling::SamplingParams| Request {
            id,
            prompt: prompt.clone(),
            params: types::sampling::SamplingParams {
                max_tokens: params.max_tokens - generated.len() as u32,
                ..params.clone()
            },
            salt: 0,
            priority: Default::default(),
            generated: generated.to_vec(),
        };
        let alone = run_one(&mut single, req(1, &[], &params));
        assert_eq!(alone.len(), total as usize, "{name}");
        let ids: Vec<u32> = alone.iter().map(|t| t.id).collect();
        if name == "sampled" {
            let greedy_ids: Vec<u32> = run_one(&mut single, req(9, &[], &greedy(total))).iter().map(|t| t.id).collect();
            assert_ne!(ids, greedy_ids, "the sampled run must actually sample");
        }
        let split = run_split(&mut prefill, &mut decode, req(2, &[], &params));
        assert_eq!(tokens_of(&split), tokens_of(&alone), "{name}: remote prefill");
        for k in [1usize, 57, 199] {
            let cont = run_one(&mut single, req(10 + k as u64, &ids[..k], &params));
            assert_eq!(tokens_of(&cont), tokens_of(&alone[k..]), "{name}: continued from token {k}");
            let cont = run_split(&mut prefill, &mut decode, req(20 + k as u64, &ids[..k], &params));
            assert_eq!(
                tokens_of(&cont),
                tokens_of(&alone[k..]),
                "{name}: continued from token {k} over remote prefill"
            );
        }
        assert_eq!((single.kv_stats().used, prefill.kv_stats().used, decode.kv_stats().used), (0, 0, 0));
    }
}
