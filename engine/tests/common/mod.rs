//! Shared helpers for the engine's integration tests (real model).
#![allow(dead_code)]

use std::path::PathBuf;

use engine::batch::{Engine, EngineConfig, Request};
use engine::model::Model;
use engine::tokenizer::Tokenizer;
use engine::weights::Weights;
use types::sampling::SamplingParams;

pub fn model_path() -> PathBuf {
    let p = engine::paths::default_model_path();
    assert!(p.is_file(), "test model {} not found: run `make model` (or set TANDEM_MODEL)", p.display());
    p
}

pub fn load(threads: usize) -> (Model, Tokenizer) {
    let (w, f) = Weights::from_gguf(&model_path()).expect("load model");
    let tok = Tokenizer::from_gguf(&f).expect("tokenizer");
    (Model::new(w, threads).expect("model"), tok)
}

pub fn engine(cfg: EngineConfig) -> (Engine, Tokenizer) {
    let (m, tok) = load(2);
    let eos = tok.eos_ids().to_vec();
    (Engine::new(m, cfg, eos).expect("engine"), tok)
}

pub fn greedy(max_tokens: u32) -> SamplingParams {
    SamplingParams { max_tokens, ignore_eos: true, ..SamplingParams::default() }
}

/// Runs requests to completion; returns each one's generated tokens, in request order.
pub fn run_all(e: &mut Engine, prompts: &[Vec<u32>], params: &SamplingParams) -> Vec<Vec<u32>> {
    for (i, p) in prompts.iter().enumerate() {
        e.add(Request {
            id: i as u64,
            prompt: p.clone(),
            params: params.clone(),
            salt: 0,
            priority: Default::default(),
            generated: Vec::new(),
        })
        .expect("add");
    }
    let mut out = vec![Vec::new(); prompts.len()];
    let mut steps = 0;
    while e.has_work() {
        for ev in e.step().expect("step") {
            out[ev.id as usize].push(ev.token.id);
        }
        steps += 1;
        assert!(steps < 100_000, "engine did not finish");
    }
    out
}
