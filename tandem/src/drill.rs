//! `tandem drill`: run failure drills against a fresh local cluster and
//! report them (the `cluster-tests` crate does the work).
//!
//! `tandem drill --list`; `tandem drill run NAME...`; `tandem drill --all`;
//! `--repeat N`; `--json PATH` writes every report (with each request's
//! record, for charts). Each run starts its own small cluster on loopback
//! (etcd, workers, coordinator as child processes next to this binary),
//! applies the drill's fault, drives load through it and checks the
//! invariants G1–G6. The table has one row per run; the exit status is
//! non-zero when any run found a violation or could not be run.

use std::path::PathBuf;

use anyhow::{bail, Context};
use cluster_tests::{drills, run_drill, DrillOptions, DrillReport};

#[derive(clap::Args)]
pub struct Args {
    /// List the drills and what each does.
    #[arg(long)]
    list: bool,
    /// Run every drill.
    #[arg(long, conflicts_with = "names")]
    all: bool,
    /// Run each drill this many times.
    #[arg(long, default_value_t = 1)]
    repeat: u32,
    /// Write every report as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Keep the processes' logs (their directory is in each report).
    #[arg(long)]
    keep_logs: bool,
    /// Requests per drill (default: each drill's own).
    #[arg(long)]
    requests: Option<usize>,
    /// `run NAME...`: the drills to run.
    names: Vec<String>,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let known = drills();
    if a.list {
        for d in &known {
            println!("{:<24} {}", d.name, d.description);
        }
        return Ok(());
    }
    let names: Vec<String> = if a.all {
        known.iter().map(|d| d.name.to_owned()).collect()
    } else {
        match a.names.split_first() {
            Some((first, rest)) if first == "run" && !rest.is_empty() => rest.to_vec(),
            _ => bail!("say what to run: `tandem drill run NAME...`, `tandem drill --all` or `tandem drill --list`"),
        }
    };
    for n in &names {
        if !known.iter().any(|d| d.name == n) {
            bail!("unknown drill `{n}` (tandem drill --list shows them)");
        }
    }
    if a.repeat == 0 {
        bail!("--repeat must be at least 1");
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let options = DrillOptions { keep_logs: a.keep_logs, requests: a.requests, ..DrillOptions::default() };
    let mut reports: Vec<DrillReport> = Vec::new();
    let mut failed = Vec::new();
    let total = names.len() * a.repeat as usize;
    println!("{}", header());
    for round in 0..a.repeat {
        for name in &names {
            eprintln!("[{}/{total}] {name}", reports.len() + failed.len() + 1);
            match rt.block_on(run_drill(name, &options)) {
                Ok(r) => {
                    println!("{}", row(&r));
                    for v in &r.violations {
                        println!("    {:?}: {}", v.guarantee, v.detail);
                    }
                    reports.push(r);
                }
                Err(e) => {
                    println!("{name:<24} could not run (round {}): {e}", round + 1);
                    failed.push(format!("{name}: {e}"));
                }
            }
        }
    }
    if let Some(path) = &a.json {
        let text = serde_json::to_string_pretty(&reports)?;
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    let violating = reports.iter().filter(|r| !r.violations.is_empty() || !r.fault_proven).count();
    if violating > 0 || !failed.is_empty() {
        bail!("{violating} of {total} runs broke an invariant, {} could not run", failed.len());
    }
    eprintln!("{total} runs, every invariant held");
    Ok(())
}

fn header() -> String {
    format!(
        "{:<24} {:>6} {:>5} {:>8} {:>5} {:>7} {:>9} {:>5}  typed errors",
        "drill", "proven", "reqs", "complete", "lost", "leaked", "p99 TTFT", "viol"
    )
}

fn row(r: &DrillReport) -> String {
    let mut errors: Vec<String> = r.typed_errors.iter().map(|(k, n)| format!("{k} ×{n}")).collect();
    if r.coordinator_lost > 0 {
        errors.push(format!("coordinator_lost (transport) ×{}", r.coordinator_lost));
    }
    let ttft = r.p99_ttft_ms.map_or_else(|| "-".to_owned(), |ms| format!("{:.2} s", ms / 1000.0));
    format!(
        "{:<24} {:>6} {:>5} {:>8} {:>5} {:>7} {:>9} {:>5}  {}",
        r.drill,
        if r.fault_proven { "yes" } else { "NO" },
        r.requests,
        r.complete,
        r.lost,
        r.leaked_blocks,
        ttft,
        r.violations.len(),
        if errors.is_empty() { "-".to_owned() } else { errors.join(", ") }
    )
}
