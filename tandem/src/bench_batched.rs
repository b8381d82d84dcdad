//! `tandem bench batched`: decode throughput with several sequences decoding
//! at once, against llama.cpp's `llama-batched-bench` on the same GGUF and
//! thread count, in the same run.
//!
//! Both sides do what `llama-batched-bench -npp P -ntg T -npl B` does: B
//! sequences of P prompt tokens each (random, not shared), prefilled, then
//! T steps in which every sequence decodes one token in one batch; the
//! figure is the decode speed, B x T tokens over the decode steps' time
//! (its `S_TG t/s`). Here each step's tokens are the previous step's argmax
//! (llama.cpp feeds random tokens; a step costs the same). Prefill is not
//! timed.
//!
//! Rounds alternate (llama.cpp, this engine, ...) and each batch size's
//! ratio is the median of the rounds' own ratios, so drift on a shared host
//! moves both sides of a round alike.

#![allow(clippy::disallowed_types, reason = "a benchmark: wall time on purpose")]

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use engine::kv::KvPool;
use engine::model::{Model, SeqChunk};
use types::kv::KvDtype;

use crate::bench::{cpu_summary, Spread};

#[derive(clap::Args)]
pub struct Args {
    /// GGUF model (default: the cached SmolLM2 file).
    #[arg(long, env = "TANDEM_MODEL")]
    model: Option<PathBuf>,
    /// Threads for both engines.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Sequences decoding at once, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "4,16,64")]
    batch: Vec<usize>,
    /// Prompt tokens per sequence (`-npp`).
    #[arg(long, default_value_t = 128)]
    prompt_tokens: usize,
    /// Decode steps (`-ntg`).
    #[arg(long, default_value_t = 128)]
    gen_tokens: usize,
    /// Rounds of (llama-batched-bench, this engine), alternated.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// llama.cpp's llama-batched-bench binary (`make llama` builds it). Without it only
    /// this engine is measured.
    #[arg(long)]
    llama_batched_bench: Option<PathBuf>,
}

/// KV block size of this engine's pool here (tokens).
const BLOCK: usize = 16;

pub fn run(a: &Args) -> Result<()> {
    if a.threads == 0 || a.rounds == 0 || a.prompt_tokens == 0 || a.gen_tokens == 0 {
        bail!("--threads, --rounds, --prompt-tokens and --gen-tokens must be positive");
    }
    if a.batch.is_empty() || a.batch.contains(&0) {
        bail!("--batch: one or more positive sizes");
    }
    let path = crate::load::model_path(a.model.clone())?;
    println!("{}", cpu_summary());
    println!(
        "model {}; {} threads; {} prompt tokens per sequence, {} decode steps; rounds {}",
        path.display(),
        a.threads,
        a.prompt_tokens,
        a.gen_tokens,
        a.rounds
    );
    let (weights, _) = engine::weights::Weights::from_gguf(&path)?;
    let mut model = Model::new(weights, a.threads)?;
    let largest = a.batch.iter().copied().max().unwrap_or(1);
    let per_seq = (a.prompt_tokens + a.gen_tokens).div_ceil(BLOCK);
    let mut pool = KvPool::new(model.kv_layout(BLOCK, KvDtype::F16), largest * per_seq)?;
    // rounds[r][i]: (ours, llama.cpp's) for batch size i.
    let mut rounds: Vec<Vec<(f64, Option<f64>)>> = Vec::new();
    for r in 0..a.rounds {
        let theirs = match &a.llama_batched_bench {
            Some(bin) => Some(llama_batched(bin, &path, a)?),
            None => None,
        };
        let mut row = Vec::new();
        for (i, &b) in a.batch.iter().enumerate() {
            let ours = our_decode(&mut model, &mut pool, b, a)?;
            let t = theirs.as_ref().map(|v| v[i]);
            eprintln!(
                "round {}: batch {b}: tandem {ours:.1} tok/s{}",
                r + 1,
                t.map(|t| format!(", llama.cpp {t:.1} tok/s, ratio {:.2}", ours / t)).unwrap_or_default()
            );
            row.push((ours, t));
        }
        rounds.push(row);
    }
    println!("| batch | tandem tok/s | llama.cpp tok/s | tandem / llama.cpp |");
    println!("|---|---|---|---|");
    let mut json = Vec::new();
    for (i, &b) in a.batch.iter().enumerate() {
        let ours = Spread::of(rounds.iter().map(|r| r[i].0));
        let theirs: Vec<f64> = rounds.iter().filter_map(|r| r[i].1).collect();
        let ratio = Spread::of(rounds.iter().filter_map(|r| Some(r[i].0 / r[i].1?)));
        if theirs.is_empty() {
            println!("| {b} | {ours} | - | - |");
        } else {
            println!("| {b} | {ours} | {} | {ratio:.2} |", Spread::of(theirs.iter().copied()));
        }
        json.push(serde_json::json!({
            "batch": b, "tandem_tps": ours.median,
            "llama_cpp_tps": (!theirs.is_empty()).then(|| Spread::of(theirs.iter().copied()).median),
            "ratio": (!theirs.is_empty()).then_some(ratio.median),
        }));
    }
    println!("medians of {} rounds (min-max); the ratio is the median of each round's own", a.rounds);
    eprintln!("{}", serde_json::json!({"cpu": cpu_summary(), "threads": a.threads, "rows": json}));
    Ok(())
}

/// `b` sequences prefilled one by one, then `gen_tokens` steps of all of them in one
/// forward pass each: decode tokens per second.
fn our_decode(model: &mut Model, pool: &mut KvPool, b: usize, a: &Args) -> Result<f64> {
    let vocab = model.config().vocab as u64;
    let per_seq = (a.prompt_tokens + a.gen_tokens).div_ceil(BLOCK);
    let mut rng = types::rng::XorShift64::seeded(b as u64);
    let mut tables = Vec::with_capacity(b);
    let mut next = Vec::with_capacity(b);
    for _ in 0..b {
        let table = pool.allocate(per_seq)?;
        let prompt: Vec<u32> = (0..a.prompt_tokens).map(|_| rng.below(vocab) as u32).collect();
        let logits = model.forward(pool, &[SeqChunk { tokens: &prompt, start: 0, table: &table, logits: 1 }])?;
        next.push([crate::bench::argmax(logits)]);
        tables.push(table);
    }
    let vocab = vocab as usize;
    let t = Instant::now();
    for step in 0..a.gen_tokens {
        let batch: Vec<SeqChunk<'_>> = next
            .iter()
            .zip(&tables)
            .map(|(tok, table)| SeqChunk { tokens: tok, start: a.prompt_tokens + step, table, logits: 1 })
            .collect();
        let picked: Vec<u32> = model.forward(pool, &batch)?.chunks_exact(vocab).map(crate::bench::argmax).collect();
        drop(batch);
        for (tok, p) in next.iter_mut().zip(picked) {
            tok[0] = p;
        }
    }
    let secs = t.elapsed().as_secs_f64();
    for table in &tables {
        pool.release(table)?;
    }
    Ok((b * a.gen_tokens) as f64 / secs)
}

/// `llama-batched-bench` once over every batch size: `S_TG t/s` for each, in `a.batch`'s order.
fn llama_batched(bin: &std::path::Path, model: &std::path::Path, a: &Args) -> Result<Vec<f64>> {
    let largest = a.batch.iter().copied().max().unwrap_or(1);
    let ctx = largest * (a.prompt_tokens + a.gen_tokens);
    let npl: Vec<String> = a.batch.iter().map(ToString::to_string).collect();
    let out = Command::new(bin)
        .arg("-m")
        .arg(model)
        .args(["-c", &ctx.to_string(), "-b", "2048", "-ub", "512"])
        .args(["-npp", &a.prompt_tokens.to_string(), "-ntg", &a.gen_tokens.to_string(), "-npl", &npl.join(",")])
        .args(["-t", &a.threads.to_string(), "--output-format", "jsonl"])
        .output()
        .with_context(|| format!("running {}", bin.display()))?;
    if !out.status.success() {
        bail!("llama-batched-bench failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr));
    }
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let rows: Vec<serde_json::Value> =
        text.lines().filter(|l| l.trim_start().starts_with('{')).filter_map(|l| serde_json::from_str(l).ok()).collect();
    a.batch
        .iter()
        .map(|&b| {
            rows.iter()
                .find(|r| r["pl"].as_u64() == Some(b as u64))
                .and_then(|r| r["speed_tg"].as_f64())
                .with_context(|| format!("llama-batched-bench printed no row for batch {b}"))
        })
        .collect()
}
