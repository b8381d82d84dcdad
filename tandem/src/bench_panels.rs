//! `tandem bench panels`: what one packed weight copy per host saves. Per
//! round, a prefill worker then a decode worker start on this host twice:
//! with private panels (`--panel-dir off`, the baseline) and sharing one
//! copy (a fresh directory: the prefill worker packs it, the decode worker
//! checks and maps it). Reported per configuration: each worker's start to
//! ready and panel time (from their logs), the decode worker's proportional
//! (`Pss`) and private memory, its private pages of the model file and the
//! panel copy, and both workers' `Pss` together (from `/proc/PID/smaps`, not
//! RSS, which counts shared pages in full in each process).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use drills::process::{mapped_pages, Launch, Pages, Proc};

use crate::bench::Spread;
use crate::up::child::sibling;

#[derive(clap::Args)]
pub struct Args {
    /// GGUF model (default: the cached SmolLM2 file).
    #[arg(long, env = "TANDEM_MODEL")]
    model: Option<PathBuf>,
    /// Rounds (each starts both configurations once; figures are medians).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Each worker's KV blocks (the pool is committed at start, so it is in the figures).
    #[arg(long, default_value_t = 256)]
    kv_blocks: usize,
    /// Each worker's compute threads.
    #[arg(long, default_value_t = 1)]
    threads: usize,
}

/// One start of both workers.
#[derive(Debug, Clone, Copy, Default)]
struct Sample {
    prefill_ready_ms: f64,
    decode_ready_ms: f64,
    prefill_panels_ms: f64,
    decode_panels_ms: f64,
    decode_pss_mib: f64,
    decode_private_mib: f64,
    /// The decode worker's private pages of the model file and the panel copy.
    decode_weight_files_private_mib: f64,
    pair_pss_mib: f64,
}

/// A figure's row name and how to read it from a sample.
type Field = (&'static str, fn(&Sample) -> f64);

const FIELDS: [Field; 8] = [
    ("prefill worker start to ready, ms", |s| s.prefill_ready_ms),
    ("decode worker start to ready, ms", |s| s.decode_ready_ms),
    ("prefill worker panels, ms", |s| s.prefill_panels_ms),
    ("decode worker panels, ms", |s| s.decode_panels_ms),
    ("decode worker Pss, MiB", |s| s.decode_pss_mib),
    ("decode worker private memory, MiB", |s| s.decode_private_mib),
    ("decode worker private pages of model file + panel copy, MiB", |s| s.decode_weight_files_private_mib),
    ("both workers' Pss, MiB", |s| s.pair_pss_mib),
];

pub fn run(a: &Args) -> Result<()> {
    if a.rounds == 0 || a.threads == 0 || a.kv_blocks == 0 {
        bail!("--rounds, --threads and --kv-blocks must be positive");
    }
    let model = std::fs::canonicalize(crate::load::model_path(a.model.clone())?)?;
    let model_mib = std::fs::metadata(&model)?.len() as f64 / MIB;
    println!("cpu: {}", crate::bench::cpu_summary());
    println!(
        "panels benchmark: {} ({model_mib:.1} MiB), a prefill then a decode worker ({} threads, {} KV blocks \
         each), private panels then one host copy, {} rounds",
        model.display(),
        a.threads,
        a.kv_blocks,
        a.rounds
    );
    let base = if Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
    let dir = base.join(format!("tandem-bench-panels-{}", std::process::id()));
    let (mut off, mut shared) = (Vec::new(), Vec::new());
    for round in 0..a.rounds {
        off.push(start_pair(a, &model, None).with_context(|| format!("round {round}, private panels"))?);
        let _ = std::fs::remove_dir_all(&dir);
        let s = start_pair(a, &model, Some(&dir)).with_context(|| format!("round {round}, one host copy"));
        let _ = std::fs::remove_dir_all(&dir);
        shared.push(s?);
        let line = |s: &Sample| {
            format!(
                "ready {:.0}/{:.0} ms, decode private {:.1} MiB, pair Pss {:.1} MiB",
                s.prefill_ready_ms, s.decode_ready_ms, s.decode_private_mib, s.pair_pss_mib
            )
        };
        println!("round {round}: private panels {}; one host copy {}", line(&off[round]), line(&shared[round]));
    }
    println!("\n| medians (min-max) | private panels | one host copy | host copy / private |");
    println!("|---|---|---|---|");
    for (name, get) in FIELDS {
        let (o, s) = (Spread::of(off.iter().map(get)), Spread::of(shared.iter().map(get)));
        let ratio = if o.median > 0.0 { format!("{:.2}x", s.median / o.median) } else { "-".into() };
        println!("| {name} | {o:.1} | {s:.1} | {ratio} |");
    }
    Ok(())
}

const MIB: f64 = (1 << 20) as f64;

/// Starts a prefill worker, then a decode worker, both with `panel_dir` (`None`: off),
/// and measures them once both are ready.
fn start_pair(a: &Args, model: &Path, panel_dir: Option<&Path>) -> Result<Sample> {
    let logs = std::env::temp_dir().join(format!("tandem-bench-panels-logs-{}", std::process::id()));
    std::fs::create_dir_all(&logs)?;
    let panel = panel_dir.map_or("off".to_owned(), |d| d.display().to_string());
    let (threads, blocks) = (a.threads.to_string(), a.kv_blocks.to_string());
    let common = [
        "--version-group",
        "bench",
        "--model",
        model.to_str().context("the model path is not UTF-8")?,
        "--threads",
        &threads,
        "--kv-blocks",
        &blocks,
        "--panel-dir",
        &panel,
        "--coordinator-silence-fence-ms",
        "0",
    ];
    let start = |bin: &str, extra: &[&str], log: &Path| -> Result<Proc> {
        Ok(Launch::path(sibling(bin)?)
            .args(common.iter().chain(extra))
            .wants(&["grpc"])
            .env("TANDEM_LOG", "info")
            .env("NO_COLOR", "1")
            .log_file(log)
            .start_blocking()?)
    };
    let (plog, dlog) = (logs.join("prefill.log"), logs.join("decode.log"));
    let prefill = start("tandem-prefill-worker", &[], &plog)?;
    let decode = start("tandem-decode-worker", &["--kv-load-failure-policy", "fail"], &dlog)?;
    let (p, d) = (mapped_pages(prefill.pid)?, mapped_pages(decode.pid)?);
    let copy = panel_dir.map(copy_in).transpose()?;
    let file = |pages: &HashMap<String, Pages>, path: &Path| {
        pages.get(&path.display().to_string()).copied().unwrap_or_default().private_kb as f64
    };
    let total = |pages: &HashMap<String, Pages>, f: fn(&Pages) -> u64| pages.values().map(f).sum::<u64>() as f64;
    let (plog_text, dlog_text) = (std::fs::read_to_string(&plog)?, std::fs::read_to_string(&dlog)?);
    let sample = Sample {
        prefill_ready_ms: field(&plog_text, "start_to_ready_ms=")?,
        decode_ready_ms: field(&dlog_text, "start_to_ready_ms=")?,
        prefill_panels_ms: panels_ms(&plog_text)?,
        decode_panels_ms: panels_ms(&dlog_text)?,
        decode_pss_mib: total(&d, |p| p.pss_kb) / 1024.0,
        decode_private_mib: total(&d, |p| p.private_kb) / 1024.0,
        decode_weight_files_private_mib: (file(&d, model) + copy.as_deref().map_or(0.0, |c| file(&d, c))) / 1024.0,
        pair_pss_mib: (total(&p, |p| p.pss_kb) + total(&d, |p| p.pss_kb)) / 1024.0,
    };
    drop((prefill, decode));
    let _ = std::fs::remove_dir_all(&logs);
    Ok(sample)
}

/// The one panel copy in `dir`.
fn copy_in(dir: &Path) -> Result<PathBuf> {
    let copies: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "panels"))
        .collect();
    match copies.as_slice() {
        [one] => Ok(one.clone()),
        _ => bail!("expected one panel copy in {}, found {copies:?}", dir.display()),
    }
}

/// The number after `key` on the first line that has it.
fn field(log: &str, key: &str) -> Result<f64> {
    log.lines()
        .find_map(|l| l.split_once(key).and_then(|(_, rest)| number(rest)))
        .with_context(|| format!("no `{key}` in the worker's log"))
}

/// The `ms=` of the `weight panels:` line.
fn panels_ms(log: &str) -> Result<f64> {
    let line = log.lines().find(|l| l.contains("weight panels:")).context("no `weight panels:` line in the log")?;
    line.rsplit_once("ms=").and_then(|(_, rest)| number(rest)).context("no ms= on the `weight panels:` line")
}

fn number(text: &str) -> Option<f64> {
    let digits: String = text.chars().take_while(|c| c.is_ascii_digit() || *c == '.').collect();
    digits.parse().ok()
}
