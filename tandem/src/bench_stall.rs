//! `tandem bench stall`: what a long prompt prefilled on a decode worker
//! costs the streams it is already running, for several
//! `max_decode_stall_ms` budgets, measured in the same run on the engine
//! itself (no processes, no network: only the step schedule differs).
//!
//! Per budget: `--decoders` sequences decode; once each has streamed a few
//! tokens, a `--prompt-tokens` prompt arrives. Reported: the decoders' idle
//! inter-token gap (median, before the prompt), their worst gap while the
//! prompt is prefilled, and the prompt's time to first token; each set
//! against the budget that is off (whole `max_batch_tokens` chunks).

#![allow(clippy::disallowed_types, reason = "a benchmark: wall time on purpose")]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use engine::batch::{Engine, EngineConfig, Request};
use engine::model::Model;
use types::sampling::SamplingParams;

#[derive(clap::Args)]
pub struct Args {
    /// GGUF model (default: the cached SmolLM2 file).
    #[arg(long, env = "TANDEM_MODEL")]
    model: Option<PathBuf>,
    /// Model compute threads.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Budgets to measure, ms (0: off, the reference).
    #[arg(long, value_delimiter = ',', default_value = "0,25,50,100,200")]
    budgets: Vec<u64>,
    /// Sequences decoding when the prompt arrives.
    #[arg(long, default_value_t = 2)]
    decoders: usize,
    /// Length of the arriving prompt, tokens.
    #[arg(long, default_value_t = 1024)]
    prompt_tokens: usize,
    /// Repetitions per budget (the worst gap is the worst of all, the others are medians).
    #[arg(long, default_value_t = 3)]
    reps: usize,
}

#[derive(Debug, Clone, Copy)]
struct Figures {
    idle_gap_ms: f64,
    worst_gap_ms: f64,
    ttft_ms: f64,
}

pub fn run(a: &Args) -> Result<()> {
    if a.threads == 0 || a.reps == 0 || a.decoders == 0 || a.prompt_tokens < 2 {
        bail!("--threads, --reps and --decoders must be positive, --prompt-tokens at least 2");
    }
    let path = crate::load::model_path(a.model.clone())?;
    println!("cpu: {}", crate::bench::cpu_summary());
    println!(
        "stall benchmark: {} ({} threads, {} decoders, a {}-token prompt, {} reps)",
        path.display(),
        a.threads,
        a.decoders,
        a.prompt_tokens,
        a.reps
    );
    let mut rows = Vec::new();
    for &ms in &a.budgets {
        let mut runs = Vec::new();
        for rep in 0..a.reps {
            runs.push(measure(&path, a, ms, rep as u64)?);
        }
        let med = |f: fn(&Figures) -> f64| {
            let mut v: Vec<f64> = runs.iter().map(f).collect();
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let worst = runs.iter().map(|f| f.worst_gap_ms).fold(0.0, f64::max);
        rows.push((
            ms,
            Figures { idle_gap_ms: med(|f| f.idle_gap_ms), worst_gap_ms: worst, ttft_ms: med(|f| f.ttft_ms) },
        ));
    }
    let reference = rows.iter().find(|(ms, _)| *ms == 0).map(|(_, f)| *f);
    println!(
        "{:<10} {:>12} {:>12} {:>12} {:>10} {:>10}",
        "budget", "idle gap", "worst gap", "prompt TTFT", "gap vs off", "TTFT vs off"
    );
    for (ms, f) in &rows {
        let name = if *ms == 0 { "off".to_owned() } else { format!("{ms} ms") };
        let (g, t) = match reference {
            Some(r) => (format!("{:.2}x", f.worst_gap_ms / r.worst_gap_ms), format!("{:.2}x", f.ttft_ms / r.ttft_ms)),
            None => ("-".into(), "-".into()),
        };
        println!(
            "{name:<10} {:>9.0} ms {:>9.0} ms {:>9.0} ms {g:>10} {t:>10}",
            f.idle_gap_ms, f.worst_gap_ms, f.ttft_ms
        );
    }
    Ok(())
}

/// Seeded pseudo-random prompt tokens (no prefix cache can help).
fn tokens(n: usize, seed: u64, vocab: u32) -> Vec<u32> {
    let mut rng = types::rng::XorShift64::new(0x9E37_79B9_7F4A_7C15 ^ seed.wrapping_mul(0x2545_F491_4F6C_DD1D));
    (0..n).map(|_| rng.below(u64::from(vocab)) as u32).collect()
}

fn measure(path: &std::path::Path, a: &Args, budget_ms: u64, rep: u64) -> Result<Figures> {
    let (weights, _) = engine::weights::Weights::from_gguf(path)?;
    let model = Model::new(weights, a.threads)?;
    let vocab = model.config().vocab as u32;
    let cfg = EngineConfig {
        kv_blocks: 1024,
        prefix_cache: false,
        max_decode_stall_ms: (budget_ms > 0).then_some(budget_ms as f64),
        ..EngineConfig::default()
    };
    let mut e = Engine::new(model, cfg, Vec::new())?;
    let params = |n| SamplingParams { max_tokens: n, ignore_eos: true, ..SamplingParams::default() };
    let long_id = a.decoders as u64;
    for d in 0..a.decoders {
        e.add(Request {
            id: d as u64,
            prompt: tokens(16, rep * 100 + d as u64, vocab),
            params: params(100_000),
            salt: 0,
            priority: Default::default(),
            generated: Vec::new(),
        })?;
    }
    // Warm up: every decoder streams a few tokens; the last gaps are the idle figure.
    let mut last: Vec<Option<Instant>> = vec![None; a.decoders];
    let mut idle = Vec::new();
    let mut worst = Duration::ZERO;
    let mut seen = vec![0usize; a.decoders];
    let mut arrived: Option<Instant> = None;
    let mut ttft = None;
    for _ in 0..100_000 {
        let events = e.step()?;
        let now = Instant::now();
        for ev in &events {
            if ev.id == long_id {
                if let Some(t0) = arrived {
                    ttft.get_or_insert(now - t0);
                }
                continue;
            }
            let d = ev.id as usize;
            if let Some(prev) = last[d] {
                let gap = now - prev;
                match arrived {
                    None if seen[d] >= 4 => idle.push(gap),
                    Some(_) if ttft.is_none() => worst = worst.max(gap),
                    _ => {}
                }
            }
            last[d] = Some(now);
            seen[d] += 1;
        }
        if arrived.is_none() && seen.iter().all(|n| *n >= 12) {
            e.add(Request {
                id: long_id,
                prompt: tokens(a.prompt_tokens, rep * 100 + 99, vocab),
                params: params(1),
                salt: 0,
                priority: Default::default(),
                generated: Vec::new(),
            })?;
            arrived = Some(Instant::now());
        }
        if ttft.is_some() {
            break;
        }
    }
    let Some(ttft) = ttft else { bail!("the prompt got no token") };
    idle.sort();
    let idle_gap = idle.get(idle.len() / 2).copied().unwrap_or_default();
    Ok(Figures {
        idle_gap_ms: idle_gap.as_secs_f64() * 1e3,
        worst_gap_ms: worst.as_secs_f64() * 1e3,
        ttft_ms: ttft.as_secs_f64() * 1e3,
    })
}
