//! The no-fault answers G1 compares against: the single-process engine's
//! continuation of each prompt, tokenized as the coordinator does for
//! `/v1/completions` (no special tokens), stopping at EOS (unless
//! `ignore_eos`, as the request said) or `max_tokens`: greedy, or for a
//! request the load samples, sampled with its seed (token n is drawn at
//! (seed, n) wherever it is computed, so the cluster must give the same).

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use engine::batch::{Engine, EngineConfig, Request};
use engine::model::Model;
use engine::tokenizer::Tokenizer;
use engine::weights::Weights;
use types::sampling::SamplingParams;

use crate::HarnessError;

type Key = (Vec<String>, u32, bool, Option<(usize, u32, u32, u64)>);

/// The answers of `prompts` (greedy, or as `sampled` says for the requests it samples), as
/// text; memoized per (prompts, max_tokens, ignore_eos, sampled) for the process.
pub fn reference_texts(
    prompts: &[String],
    max_tokens: u32,
    ignore_eos: bool,
    sampled: Option<loadgen::Sampled>,
) -> Result<Vec<String>, HarnessError> {
    static CACHE: OnceLock<Mutex<HashMap<Key, Vec<String>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let s = sampled.map(|s| (s.every, s.temperature.to_bits(), s.top_p.to_bits(), s.seed));
    let key = (prompts.to_vec(), max_tokens, ignore_eos, s);
    if let Some(v) = cache.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return Ok(v.clone());
    }
    let v = compute(prompts, max_tokens, ignore_eos, sampled)
        .map_err(|e| HarnessError::Setup(format!("reference engine: {e}")))?;
    cache.lock().unwrap_or_else(|e| e.into_inner()).insert(key, v.clone());
    Ok(v)
}

fn compute(
    prompts: &[String],
    max_tokens: u32,
    ignore_eos: bool,
    sampled: Option<loadgen::Sampled>,
) -> Result<Vec<String>, String> {
    let path = engine::paths::default_model_path();
    let (w, f) = Weights::from_gguf(&path).map_err(|e| format!("load {} (run `make model`): {e}", path.display()))?;
    let tok = Tokenizer::from_gguf(&f).map_err(|e| e.to_string())?;
    let model = Model::new(w, 2).map_err(|e| e.to_string())?;
    let cfg = EngineConfig { kv_blocks: 1024, ..EngineConfig::default() };
    let mut e = Engine::new(model, cfg, tok.eos_ids().to_vec()).map_err(|e| e.to_string())?;
    for (i, p) in prompts.iter().enumerate() {
        let ids = tok.encode(p, false).map_err(|e| e.to_string())?;
        let mut params = SamplingParams { max_tokens, ignore_eos, ..SamplingParams::default() };
        if let Some((s, seed)) = sampled.and_then(|s| Some((s, s.seed_of(i)?))) {
            params.temperature = s.temperature;
            params.top_p = s.top_p;
            params.seed = Some(seed);
        }
        e.add(Request {
            id: i as u64,
            prompt: ids,
            params,
            salt: 0,
            priority: Default::default(),
            generated: Vec::new(),
        })
        .map_err(|e| e.to_string())?;
    }
    let mut out = vec![Vec::new(); prompts.len()];
    for _ in 0..1_000_000 {
        if !e.has_work() {
            return out.iter().map(|ids| tok.decode(ids, true).map_err(|e| e.to_string())).collect();
        }
        for ev in e.step().map_err(|e| e.to_string())? {
            if !tok.eos_ids().contains(&ev.token.id) {
                if let Some(o) = out.get_mut(ev.id as usize) {
                    o.push(ev.token.id);
                }
            }
        }
    }
    Err("the reference engine did not finish".into())
}
