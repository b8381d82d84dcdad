//! `tandem bench serve` (in `bench_serve.rs`): one seeded load against
//! OpenAI-compatible servers side by side.
//!
//! `tandem bench engine`: prefill and decode throughput of this engine and
//! of llama.cpp's `llama-bench` on the same GGUF and thread count, measured
//! in the same run and printed side by side with their ratio.
//!
//! Both sides measure the same things: prefill = one forward pass over a
//! `--prompt-tokens` prompt (llama-bench's `pp`), decode = `--gen-tokens`
//! single-token steps from an empty context (llama-bench's `tg`), each
//! repeated `--reps` times and averaged.
//!
//! With `--rounds N` the two alternate N times (llama.cpp, this engine,
//! llama.cpp, ...) and the ratio printed is the median of the rounds' own
//! ratios: a shared host whose speed drifts between the two measurements
//! (memory bandwidth here moved between 10 and 17 GB/s within minutes)
//! then moves both sides of most rounds alike instead of deciding the
//! ratio.

#![allow(clippy::disallowed_types, reason = "a benchmark: wall time on purpose")]

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use engine::kv::KvPool;
use engine::model::{Model, SeqChunk};
use types::kv::KvDtype;

use crate::bench_serve;

#[derive(clap::Subcommand)]
pub enum Cmd {
    /// Engine throughput vs llama.cpp.
    Engine(EngineArgs),
    /// Serving latency and throughput of OpenAI-compatible servers, side by
    /// side (e.g. llama-server vs `tandem up`), under the same seeded load.
    Serve(bench_serve::Args),
    /// What long prompts cost running streams when prefill and decode
    /// workers share cores, for several `tandem up` configurations.
    Interference(crate::bench_interference::Args),
    /// What a long prompt prefilled on a decode worker costs its running
    /// streams, for several `max_decode_stall_ms` budgets (engine only).
    Stall(crate::bench_stall::Args),
    /// What handing a prompt's KV from a prefill engine to a decode engine
    /// costs beyond moving its bytes (tcp on loopback, one clock).
    Handoff(crate::bench_handoff::Args),
    /// What one packed weight copy per host saves: a prefill and a decode
    /// worker started with private panels, then sharing one copy.
    Panels(crate::bench_panels::Args),
    /// Prompt-lookup speculation against plain decoding, on answers that
    /// repeat their prompt and on answers that do not (engine only).
    Lookup(crate::bench_lookup::Args),
    /// Decode throughput with several sequences at once vs llama.cpp's
    /// llama-batched-bench.
    Batched(crate::bench_batched::Args),
    /// Today's control plane at fleet sizes: simulated workers (`tandem sim`) on a real
    /// etcd under real coordinators; CPU, polls, etcd load, routing time, convergence.
    Scale(crate::bench_scale::Args),
}

#[derive(clap::Args)]
pub struct EngineArgs {
    /// GGUF model (default: the cached SmolLM2 file).
    #[arg(long, env = "TANDEM_MODEL")]
    model: Option<PathBuf>,
    /// Threads for both engines.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Prompt length of the prefill test.
    #[arg(long, default_value_t = 512)]
    prompt_tokens: usize,
    /// Tokens of the decode test.
    #[arg(long, default_value_t = 128)]
    gen_tokens: usize,
    /// Repetitions (averaged).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Rounds of (llama-bench, this engine), alternated; the ratio is the
    /// median of the rounds' ratios.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// llama.cpp's llama-bench binary (`make llama` builds it). Without it
    /// only this engine is measured.
    #[arg(long)]
    llama_bench: Option<PathBuf>,
    /// KV cache element type for this engine (llama-bench uses f16).
    #[arg(long, default_value = "f16", value_parser = ["f16", "f32"])]
    kv_dtype: String,
}

#[derive(Debug, Clone, Copy, serde::Serialize)]
struct Figures {
    prefill_tps: f64,
    decode_tps: f64,
}

pub fn run(cmd: Cmd) -> Result<()> {
    match cmd {
        Cmd::Engine(a) => engine_bench(a),
        Cmd::Serve(a) => bench_serve::run(a),
        Cmd::Interference(a) => crate::bench_interference::run(&a),
        Cmd::Stall(a) => crate::bench_stall::run(&a),
        Cmd::Handoff(a) => crate::bench_handoff::run(&a),
        Cmd::Panels(a) => crate::bench_panels::run(&a),
        Cmd::Lookup(a) => crate::bench_lookup::run(&a),
        Cmd::Batched(a) => crate::bench_batched::run(&a),
        Cmd::Scale(a) => crate::bench_scale::run(a),
    }
}

/// The machine a figure was measured on: core count, model name, and the
/// SIMD flags that matter to the kernels (every benchmark prints it).
pub fn cpu_summary() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |k: &str| {
        info.lines().find_map(|l| l.split_once(':').filter(|(a, _)| a.trim() == k).map(|(_, v)| v.trim().to_owned()))
    };
    let flags = field("flags").unwrap_or_default();
    let have: Vec<&str> =
        ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "amx_tile"]
            .into_iter()
            .filter(|f| flags.split_whitespace().any(|x| x == *f))
            .collect();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    format!("{cores} cores, {}, flags: {}", field("model name").unwrap_or_default(), have.join(" "))
}

fn engine_bench(a: EngineArgs) -> Result<()> {
    if a.threads == 0 || a.reps == 0 || a.rounds == 0 || a.prompt_tokens == 0 || a.gen_tokens == 0 {
        bail!("--threads, --reps, --rounds, --prompt-tokens and --gen-tokens must be positive");
    }
    let path = crate::load::model_path(a.model.clone())?;
    let mut rounds: Vec<(Figures, Option<Figures>)> = Vec::new();
    for _ in 0..a.rounds {
        let theirs = match &a.llama_bench {
            Some(bin) => Some(llama_bench(bin, &path, &a)?),
            None => None,
        };
        rounds.push((our_bench(&path, &a)?, theirs));
    }
    let ours = Figures {
        prefill_tps: median(rounds.iter().map(|r| r.0.prefill_tps)),
        decode_tps: median(rounds.iter().map(|r| r.0.decode_tps)),
    };
    let theirs = a.llama_bench.as_ref().map(|_| Figures {
        prefill_tps: median(rounds.iter().filter_map(|r| r.1.map(|t| t.prefill_tps))),
        decode_tps: median(rounds.iter().filter_map(|r| r.1.map(|t| t.decode_tps))),
    });
    // Each round's ratio: both sides measured minutes apart at most.
    let ratios: Vec<(f64, f64)> = rounds
        .iter()
        .filter_map(|(o, t)| t.map(|t| (o.prefill_tps / t.prefill_tps, o.decode_tps / t.decode_tps)))
        .collect();
    let rss_mib = peak_rss_kib().map(|k| k as f64 / 1024.0);
    let per_token = bytes_per_token(&path)?;
    let bandwidth = read_bandwidth(a.threads);

    println!(
        "engine benchmark: {} ({} threads, pp{}, tg{}, {} reps, {} round(s)); {}",
        path.display(),
        a.threads,
        a.prompt_tokens,
        a.gen_tokens,
        a.reps,
        a.rounds,
        cpu_summary()
    );
    let median_ratio = |f: fn(&(f64, f64)) -> f64| median(ratios.iter().map(f));
    let (prefill_ratio, decode_ratio) = (median_ratio(|r| r.0), median_ratio(|r| r.1));
    println!("{:<10} {:>14} {:>14} {:>8}", "", "tandem tok/s", "llama.cpp", "ratio");
    let row = |name: &str, o: f64, t: Option<f64>, ratio: f64| match t {
        Some(t) => println!("{name:<10} {o:>14.1} {t:>14.1} {ratio:>7.2}x"),
        None => println!("{name:<10} {o:>14.1} {:>14} {:>8}", "-", "-"),
    };
    row(&format!("prefill{}", a.prompt_tokens), ours.prefill_tps, theirs.map(|t| t.prefill_tps), prefill_ratio);
    row(&format!("decode{}", a.gen_tokens), ours.decode_tps, theirs.map(|t| t.decode_tps), decode_ratio);
    if ratios.len() > 1 {
        let list =
            |f: fn(&(f64, f64)) -> f64| ratios.iter().map(|r| format!("{:.2}", f(r))).collect::<Vec<_>>().join(" ");
        println!(
            "rounds' ratios (tok/s above and ratio are medians): prefill {}; decode {}",
            list(|r| r.0),
            list(|r| r.1)
        );
    }
    if let Some(r) = rss_mib {
        println!("tandem peak RSS: {r:.0} MiB");
    }
    // Decode streams every weight once per token: the memory bound on tok/s.
    let used = per_token as f64 * ours.decode_tps / 1e9;
    println!(
        "decode reads {:.1} MiB of weights per token: {used:.1} GB/s at {:.1} tok/s, {:.0}% of the {bandwidth:.1} GB/s \
         read bandwidth measured here ({} threads; limit {:.0} tok/s)",
        per_token as f64 / (1 << 20) as f64,
        ours.decode_tps,
        100.0 * used / bandwidth,
        a.threads,
        bandwidth * 1e9 / per_token as f64
    );
    let json = serde_json::json!({
        "threads": a.threads, "tandem": ours, "llama_cpp": theirs, "tandem_peak_rss_mib": rss_mib,
        "weight_bytes_per_token": per_token, "read_bandwidth_gbps": bandwidth,
        "ratio": {"prefill": prefill_ratio, "decode": decode_ratio},
        "rounds": rounds.iter().map(|(o, t)| serde_json::json!({"tandem": o, "llama_cpp": t})).collect::<Vec<_>>(),
    });
    eprintln!("{json}");
    Ok(())
}

fn our_bench(path: &std::path::Path, a: &EngineArgs) -> Result<Figures> {
    let (weights, _) = engine::weights::Weights::from_gguf(path)?;
    let mut model = Model::new(weights, a.threads)?;
    let vocab = model.config().vocab as u32;
    let bs = 16;
    let need = (a.prompt_tokens.max(a.gen_tokens) + 1).div_ceil(bs);
    let dtype = KvDtype::parse(&a.kv_dtype).unwrap_or(KvDtype::F16);
    let mut pool = KvPool::new(model.kv_layout(bs, dtype), need)?;
    let table = pool.allocate(need)?;
    // Deterministic pseudo-random prompt, like llama-bench's random tokens.
    let mut rng = types::rng::XorShift64::new(0x2545_F491_4F6C_DD1D);
    let prompt: Vec<u32> = (0..a.prompt_tokens).map(|_| rng.below(vocab as u64) as u32).collect();

    // Warm-up: page the weights in and size the scratch buffers.
    model.forward(
        &mut pool,
        &[SeqChunk { tokens: &prompt[..prompt.len().min(64)], start: 0, table: &table, logits: 1 }],
    )?;

    let mut prefill = 0.0;
    let mut decode = 0.0;
    for _ in 0..a.reps {
        let t = Instant::now();
        model.forward(&mut pool, &[SeqChunk { tokens: &prompt, start: 0, table: &table, logits: 1 }])?;
        prefill += t.elapsed().as_secs_f64();

        let t = Instant::now();
        let mut tok = [1u32];
        for pos in 0..a.gen_tokens {
            let logits =
                model.forward(&mut pool, &[SeqChunk { tokens: &tok, start: pos, table: &table, logits: 1 }])?;
            tok[0] = argmax(logits);
        }
        decode += t.elapsed().as_secs_f64();
    }
    let reps = a.reps as f64;
    Ok(Figures {
        prefill_tps: a.prompt_tokens as f64 * reps / prefill,
        decode_tps: a.gen_tokens as f64 * reps / decode,
    })
}

/// Weight bytes one decode step reads: every tensor, except that with a
/// separate output matrix the token embedding gives only one row.
fn bytes_per_token(path: &std::path::Path) -> Result<usize> {
    let (weights, _) = engine::weights::Weights::from_gguf(path)?;
    let all: usize = weights.tensors.values().map(|t| t.len).sum();
    let embedding = match (weights.tensors.get("output.weight"), weights.tensors.get("token_embd.weight")) {
        (Some(_), Some(e)) => e.len - e.len / weights.config.vocab.max(1),
        _ => 0,
    };
    Ok(all - embedding)
}

/// Read bandwidth of this machine, GB/s: `threads` threads summing
/// disjoint parts of a 512 MiB buffer (far beyond any cache), best of 3.
fn read_bandwidth(threads: usize) -> f64 {
    let words = 64usize << 20;
    let buf: Vec<u64> = (0..words as u64).collect();
    let part = words.div_ceil(threads.max(1));
    let mut best = 0.0f64;
    for _ in 0..3 {
        let t = Instant::now();
        let total = std::thread::scope(|s| {
            let handles: Vec<_> =
                buf.chunks(part).map(|c| s.spawn(move || c.iter().fold(0u64, |a, x| a.wrapping_add(*x)))).collect();
            handles.into_iter().map(|h| h.join().unwrap_or(0)).fold(0u64, u64::wrapping_add)
        });
        std::hint::black_box(total);
        best = best.max((words * 8) as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    best
}

/// The median (the mean of the middle two for an even count: loadgen's
/// interpolating percentile at 0.5); NaN for none.
fn median(values: impl Iterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = values.collect();
    v.sort_by(f64::total_cmp);
    loadgen::percentile(&v, 0.5).unwrap_or(f64::NAN)
}

/// The median (as [`median`]), minimum and maximum of a benchmark's rounds;
/// displayed `median (min-max)` at the format's precision (1 by default).
#[derive(Debug, Clone, Copy)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    /// NaNs for no values.
    pub fn of(values: impl Iterator<Item = f64>) -> Self {
        let v: Vec<f64> = values.collect();
        let (min, max) = v.iter().fold((f64::NAN, f64::NAN), |(lo, hi), &x| (x.min(lo), x.max(hi)));
        Self { median: median(v.into_iter()), min, max }
    }
}

impl std::fmt::Display for Spread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let p = f.precision().unwrap_or(1);
        write!(f, "{:.p$} ({:.p$}-{:.p$})", self.median, self.min, self.max)
    }
}

pub(crate) fn argmax(v: &[f32]) -> u32 {
    v.iter().enumerate().fold((0usize, f32::NEG_INFINITY), |b, (i, &x)| if x > b.1 { (i, x) } else { b }).0 as u32
}

fn llama_bench(bin: &std::path::Path, model: &std::path::Path, a: &EngineArgs) -> Result<Figures> {
    let out = Command::new(bin)
        .args(["-m"])
        .arg(model)
        .args(["-t", &a.threads.to_string(), "-p", &a.prompt_tokens.to_string(), "-n", &a.gen_tokens.to_string()])
        .args(["-r", &a.reps.to_string(), "-o", "json"])
        .output()
        .with_context(|| format!("running {}", bin.display()))?;
    if !out.status.success() {
        bail!("llama-bench failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr));
    }
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).context("parsing llama-bench JSON")?;
    let mut f = Figures { prefill_tps: f64::NAN, decode_tps: f64::NAN };
    for r in rows.as_array().context("llama-bench JSON is not an array")? {
        let (p, n) = (r["n_prompt"].as_u64().unwrap_or(0), r["n_gen"].as_u64().unwrap_or(0));
        let ts = r["avg_ts"].as_f64().context("llama-bench row without avg_ts")?;
        if p > 0 && n == 0 {
            f.prefill_tps = ts;
        } else if n > 0 && p == 0 {
            f.decode_tps = ts;
        }
    }
    if f.prefill_tps.is_nan() || f.decode_tps.is_nan() {
        bail!("llama-bench output lacked a pp or tg row");
    }
    Ok(f)
}

/// Peak resident set (VmHWM) of this process, in KiB.
fn peak_rss_kib() -> Option<u64> {
    opskit::process::status_kib(std::process::id(), "VmHWM")
}

#[cfg(test)]
mod tests {
    use super::{median, Spread};

    #[test]
    fn median_of_odd_even_and_no_values() {
        assert_eq!(median([3.0, 1.0, 2.0].into_iter()), 2.0);
        assert_eq!(median([4.0, 1.0, 3.0, 2.0].into_iter()), 2.5);
        assert!(median(std::iter::empty()).is_nan());
    }

    #[test]
    fn spread_is_median_min_max_at_the_formats_precision() {
        let s = Spread::of([3.0, 1.25, 2.0, 9.5].into_iter());
        assert_eq!((s.median, s.min, s.max), (2.5, 1.25, 9.5));
        assert_eq!(format!("{s}"), "2.5 (1.2-9.5)");
        assert_eq!(format!("{s:.2}"), "2.50 (1.25-9.50)");
        let none = Spread::of(std::iter::empty());
        assert!(none.median.is_nan() && none.min.is_nan() && none.max.is_nan());
    }
}
