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
                    Request { id, prompt: p.clone(), params: greedy(12), salt: 0, priority: Default::default() },
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
        Request { id: 1, prompt: p.clone(), params: greedy(4), salt: 0, priority: Default::default() },
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
        .add_prefilled(Request { id: 2, prompt: p, params, salt: 0, priority: Default::default() }, blocks, &first)
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
        let req = Request { id, prompt: p.clone(), params: greedy(1), salt: 0, priority: Default::default() };
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
