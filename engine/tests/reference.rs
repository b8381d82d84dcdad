//! Greedy decoding against llama.cpp's recorded output (see
//! `tests/fixtures/README.md` for how the fixture was made and the rule).
//!
//! Rule (the engine issue's): decoding `prompt_ids` greedily, with
//! llama.cpp's end-of-generation ids masked as its `ignore_eos` does, must
//! reproduce llama.cpp's tokens at least up to the first near-tie (a
//! position where llama.cpp's top-2 log-probability gap is < 0.1, so either
//! choice is an honest greedy answer), and all 32 where there is none.
//!
//! Past a near-tie both runs still agree for a while, and a 4-bit model's
//! rounding noise (activation quantization, f16 KV, and llama.cpp's f16
//! attention arithmetic) can then flip a gap of a few tenths; so beyond the
//! rule we check the numbers themselves: over every position where both
//! runs saw the same context, our log-probability of the chosen token must
//! track llama.cpp's closely on average and never stray far.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]

mod common;

use engine::kv::KvPool;

use engine::model::SeqChunk;
use serde_json::Value;
use types::kv::KvDtype;

/// Top-2 gap below which either token is an honest greedy choice (the
/// engine issue's rule). It sits close to the noise floor of 8-bit
/// activation quantization, which makes logits a discontinuous function of
/// the input: this engine's scalar and AVX2 paths, identical but for
/// summation order, differ by 0.11 at the first position of `fibonacci_def`,
/// and llama.cpp's own flash-attention and plain attention paths pick
/// different continuations of `capital_of_france` from position 5 on. The
/// test passes at 0.1 because the kernels round as ggml's do (activation
/// quantization, f64 RMSNorm sums, f32 RoPE angles); a kernel change that
/// alters rounding can legitimately move a divergence past a gap of 0.1–0.3.
const NEAR_TIE: f32 = 0.1;

fn fixture() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/llama_cpp_reference.json");
    let text = std::fs::read_to_string(path).expect("fixture missing: run `make fixtures`");
    serde_json::from_str(&text).expect("fixture is JSON")
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().expect("array").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

fn log_softmax_at(logits: &[f32], i: usize) -> f32 {
    let max = logits.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
    let sum: f64 = logits.iter().map(|&v| ((v - max) as f64).exp()).sum();
    (logits[i] - max) - sum.ln() as f32
}

#[test]
fn greedy_matches_llama_cpp_until_a_near_tie() {
    let fx = fixture();
    let eog = ids(&fx["eog_ids"]);
    let (mut model, _) = common::load(2);
    // F32 KV, as the fixture was recorded (see scripts/make-fixtures.py).
    let mut pool = KvPool::new(model.kv_layout(16, KvDtype::F32), 64).expect("pool");
    let mut worst_lp = 0f32;
    let (mut sum_lp, mut n_lp) = (0f64, 0usize);
    let mut diverged = Vec::new();
    let mut matched_total = 0;
    for case in fx["greedy"].as_array().expect("greedy") {
        let name = case["name"].as_str().expect("name");
        let prompt = ids(&case["prompt_ids"]);
        let want = ids(&case["tokens"]);
        let gap = |pos: usize| {
            let t = &case["top2"][pos];
            (t[0][1].as_f64().expect("lp") - t[1][1].as_f64().expect("lp")) as f32
        };
        let first_tie = (0..want.len()).find(|&p| gap(p) < NEAR_TIE).unwrap_or(want.len());
        let table = pool.allocate((prompt.len() + want.len()).div_ceil(16)).expect("blocks");
        let mut seq = prompt.clone();
        let mut start = 0;
        for (pos, &expected) in want.iter().enumerate() {
            let chunk = SeqChunk { tokens: &seq[start..], start, table: &table, logits: 1 };
            let logits = model.forward(&mut pool, &[chunk]).expect("forward").to_vec();
            let mut masked = logits.clone();
            for &e in &eog {
                masked[e as usize] = f32::NEG_INFINITY;
            }
            let best = masked
                .iter()
                .enumerate()
                .fold((0usize, f32::NEG_INFINITY), |a, (i, &v)| if v > a.1 { (i, v) } else { a })
                .0 as u32;
            if best != expected {
                eprintln!(
                    "{name}@{pos}: ours {best} lp {:.4} / their choice lp {:.4}",
                    log_softmax_at(&logits, best as usize),
                    log_softmax_at(&logits, expected as usize)
                );
                assert!(pos >= first_tie, "{name}: position {pos}: we chose {best}, llama.cpp {expected}, before llama.cpp's first near-tie ({first_tie})");
                diverged.push(format!("{name}@{pos}"));
                break;
            }
            let theirs = case["top2"][pos][0][1].as_f64().expect("logprob") as f32;
            if case["top2"][pos][0][0].as_u64() == Some(expected as u64) {
                let ours = log_softmax_at(&logits, expected as usize);
                worst_lp = worst_lp.max((ours - theirs).abs());
                sum_lp += (ours - theirs).abs() as f64;
                n_lp += 1;
            }
            matched_total += 1;
            start = seq.len();
            seq.push(best);
        }
        pool.release(&table).expect("release");
    }
    let mean = sum_lp / n_lp.max(1) as f64;
    eprintln!("matched {matched_total} tokens; diverged after a near-tie at {diverged:?}; chosen-token logprob vs llama.cpp: mean |diff| {mean:.4}, max {worst_lp:.4}");
    assert!(matched_total >= 200, "too few positions compared: {matched_total}");
    assert!(mean < 0.06, "log-probabilities drift from llama.cpp: mean |diff| {mean}");
    assert!(worst_lp < 0.35, "log-probabilities drift from llama.cpp: max |diff| {worst_lp}");
    assert_eq!(pool.stats().used, 0);
}
