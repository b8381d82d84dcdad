//! `tandem drill`: run failure drills against fresh local clusters and
//! report them (the `cluster-tests` crate does the work).
//!
//! `tandem drill --list`; `tandem drill run NAME...`; `tandem drill --all`;
//! `--repeat N`; `--json PATH` writes every report (with each request's
//! record); `--charts DIR` writes one SVG per run (latency over time, fault
//! window shaded); `--vacuity` runs each drill with its fault skipped and
//! passes only when every such run fails its proof (G6). Each run starts its
//! own small cluster on loopback (etcd, workers, coordinator as child
//! processes next to this binary), applies the drill's fault, drives load
//! through it and checks the invariants G1–G6. The table has one row per
//! run; the exit status is non-zero when any run found a violation or could
//! not be run. On a terminal a progress line shows the running drill.
//!
//! `--against STATEFILE` runs the drills against the cluster a running
//! `tandem up --state-file STATEFILE` describes instead of starting one, and
//! leaves it running as found: drills whose fault the drill lifts itself
//! (SIGSTOP, then SIGCONT) and drills whose victim exits (SIGKILL, a drain)
//! when `tandem up`'s supervisor starts it again under the state file's
//! restart policy (a kill: `on-failure` or `always`; a drain, which exits 0:
//! `always`); the drill waits for the restart and follows the new pid.
//! `run NAME` of any other drill is an error saying why; `--all` runs those
//! that can and lists the skipped ones with the reason.

mod chart;

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use anyhow::{bail, Context};
use drills::{drills, drills_against, drills_built, planned_requests, run_drill, DrillOptions, DrillReport};

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
    /// Write one SVG chart per run into this directory (created if missing).
    #[arg(long)]
    charts: Option<PathBuf>,
    /// Run each drill with its fault skipped: passes only if every such run fails its proof (G6),
    /// showing no drill passes vacuously.
    #[arg(long)]
    vacuity: bool,
    /// Keep the processes' logs (their directory is in each report).
    #[arg(long)]
    keep_logs: bool,
    /// Requests per drill (default: each drill's own).
    #[arg(long)]
    requests: Option<usize>,
    /// Run against the running cluster this `tandem up --state-file` wrote, instead of starting
    /// one per drill: only drills it recovers from (SIGSTOP; a kill or drain its supervisor
    /// restarts); others are refused with the reason, or skipped with `--all`.
    #[arg(long, value_name = "STATEFILE")]
    against: Option<PathBuf>,
    /// With --against: the API key drill traffic carries, where the cluster's coordinators
    /// take only keys their tenants file lists (a tenant of its own, so the drills spend no
    /// other tenant's quota). Env: TANDEM_API_KEY.
    #[arg(long, env = "TANDEM_API_KEY", value_name = "KEY", hide_env_values = true)]
    api_key: Option<String>,
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
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let names: Vec<String> = if a.all {
        match &a.against {
            Some(state) => {
                let mut runnable = Vec::new();
                for (d, can) in rt.block_on(drills_against(state, a.api_key.as_deref()))? {
                    match can {
                        Ok(()) => runnable.push(d.name.to_owned()),
                        Err(why) => println!("skipped {}: {why}", d.name),
                    }
                }
                if runnable.is_empty() {
                    bail!("no drill can run against the cluster of {}", state.display());
                }
                runnable
            }
            None => known.iter().map(|d| d.name.to_owned()).collect(),
        }
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
    // A drill whose fault is a hook these binaries were built without: skipped with the
    // reason under --all, refused when named.
    let built = drills_built();
    let unbuilt = |n: &str| built.iter().find(|(d, _)| d.name == n).and_then(|(_, b)| b.clone().err());
    let names: Vec<String> = if a.all {
        names
            .into_iter()
            .filter(|n| match unbuilt(n) {
                Some(why) => {
                    println!("skipped {n}: {why}");
                    false
                }
                None => true,
            })
            .collect()
    } else {
        let refused: Vec<String> = names.iter().filter_map(|n| Some(format!("{n}: {}", unbuilt(n)?))).collect();
        if !refused.is_empty() {
            bail!("cannot run with these binaries:\n  {}", refused.join("\n  "));
        }
        names
    };
    if a.repeat == 0 {
        bail!("--repeat must be at least 1");
    }
    if let Some(dir) = &a.charts {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    if let (Some(state), false) = (&a.against, a.all) {
        // Every named drill must be able to run against it: refuse before running any.
        let can = rt.block_on(drills_against(state, a.api_key.as_deref()))?;
        let refused: Vec<String> = names
            .iter()
            .filter_map(|n| {
                can.iter()
                    .find(|(d, _)| d.name == n)
                    .and_then(|(_, c)| c.clone().err())
                    .map(|why| format!("{n}: {why}"))
            })
            .collect();
        if !refused.is_empty() {
            bail!("cannot run against the cluster of {}:\n  {}", state.display(), refused.join("\n  "));
        }
    }
    let done = Arc::new(AtomicUsize::new(0));
    let options = DrillOptions {
        keep_logs: a.keep_logs,
        requests: a.requests,
        skip_fault: a.vacuity,
        progress: Some(done.clone()),
        against: a.against.clone(),
        api_key: a.api_key.clone(),
    };
    let mut reports: Vec<DrillReport> = Vec::new();
    let mut failed = Vec::new();
    let total = names.len() * a.repeat as usize;
    let tty = std::io::stderr().is_terminal();
    if a.vacuity {
        println!("each drill with its fault skipped: its proof (G6) must fail");
    }
    println!("{}", header());
    let mut n = 0;
    for round in 1..=a.repeat {
        for name in &names {
            n += 1;
            let planned = a.requests.or_else(|| planned_requests(name)).unwrap_or(0);
            let line = format!("[{n}/{total}] {name}");
            let ticker = (tty).then(|| Ticker::start(line.clone(), done.clone(), planned));
            if !tty {
                eprintln!("{line}");
            }
            // SIGINT or SIGTERM drops the drill where it stands: its `Cluster` lifts what it
            // holds as it goes (a running cluster's rules deleted, its KV proxy taken off,
            // what it stopped continued), so an operator's Ctrl-C leaves their fleet as found.
            let result = rt.block_on(async {
                let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
                tokio::select! {
                    r = run_drill(name, &options) => anyhow::Ok(Some(r)),
                    _ = tokio::signal::ctrl_c() => Ok(None),
                    _ = term.recv() => Ok(None),
                }
            })?;
            drop(ticker);
            let Some(result) = result else {
                bail!("interrupted during {name}: its faults were lifted; no further drill ran");
            };
            match result {
                Ok(r) => {
                    println!("{}", row(&r, a.vacuity));
                    if let Some(g) = &r.goodput {
                        println!(
                            "    goodput {:.1} tok/s = {:.0}% of the no-overload {:.1}/{:.1} tok/s (before/after) at \
                             the machine's speed in each, {:.0}% as measured ({}; {:.2} req/s, offered {:.2} req/s; \
                             {} tokens regenerated to resume{}); coordinator memory {}",
                            g.tok_s,
                            100.0 * g.ratio,
                            g.baseline_tok_s[0],
                            g.baseline_tok_s[1],
                            100.0 * g.raw_ratio,
                            g.token_ms_text(),
                            g.capacity_rps,
                            g.offered_rps,
                            g.regenerated_tokens,
                            g.computed.map_or_else(String::new, |(b, c)| format!(
                                "; decode workers began {b} requests for {c} answers"
                            )),
                            g.rss_growth_mib.map_or_else(|| "unread".to_owned(), |m| format!("{m:+.1} MiB"))
                        );
                    }
                    for v in r.violations.iter().filter(|_| !a.vacuity) {
                        println!("    {:?}: {}", v.guarantee, v.detail);
                    }
                    if a.vacuity {
                        println!("    proof: {}", r.proof);
                    }
                    if let Some(dir) = &a.charts {
                        let suffix = if a.vacuity { "-nofault" } else { "" };
                        let path = dir.join(format!("{name}{suffix}-{round}.svg"));
                        chart::write(&r, &path)?;
                    }
                    reports.push(r);
                }
                Err(e) => {
                    println!("{name:<24} could not run (round {round}): {e}");
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
    if let Some(dir) = &a.charts {
        eprintln!("charts in {}", dir.display());
    }
    if a.vacuity {
        let vacuous: Vec<&str> = reports.iter().filter(|r| r.fault_proven).map(|r| r.drill.as_str()).collect();
        if !vacuous.is_empty() || !failed.is_empty() {
            bail!("passed without their fault: {vacuous:?}; could not run: {}", failed.len());
        }
        eprintln!("{total} runs without their fault, every one failed its proof (G6)");
        return Ok(());
    }
    let violating = reports.iter().filter(|r| !r.violations.is_empty() || !r.fault_proven).count();
    if violating > 0 || !failed.is_empty() {
        bail!("{violating} of {total} runs broke an invariant, {} could not run", failed.len());
    }
    eprintln!("{total} runs, every invariant held");
    Ok(())
}

/// A progress line on stderr, redrawn until dropped.
struct Ticker {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Ticker {
    fn start(label: String, done: Arc<AtomicUsize>, planned: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            let t0 = Instant::now();
            while !s.load(Ordering::SeqCst) {
                let k = done.load(Ordering::SeqCst).min(planned);
                eprint!("\r\x1b[2K{}", progress_line(&label, k, planned, t0.elapsed()));
                let _ = std::io::stderr().flush();
                std::thread::sleep(Duration::from_millis(200));
            }
            eprint!("\r\x1b[2K");
        });
        Self { stop, thread: Some(thread) }
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// `[2/9] decode-kill ▕██████····▏ 5/8 requests  12 s`
fn progress_line(label: &str, done: usize, planned: usize, elapsed: Duration) -> String {
    const WIDTH: usize = 20;
    let filled = (done * WIDTH).checked_div(planned).unwrap_or(0);
    format!(
        "{label} ▕{}{}▏ {done}/{planned} requests  {} s",
        "█".repeat(filled),
        "·".repeat(WIDTH - filled),
        elapsed.as_secs()
    )
}

fn header() -> String {
    format!(
        "{:<24} {:>6} {:>5} {:>8} {:>5} {:>7} {:>9} {:>5}  typed errors",
        "drill", "proven", "reqs", "complete", "lost", "leaked", "p99 TTFT", "viol"
    )
}

fn row(r: &DrillReport, vacuity: bool) -> String {
    let mut errors: Vec<String> = r.typed_errors.iter().map(|(k, n)| format!("{k} ×{n}")).collect();
    if r.coordinator_lost > 0 {
        errors.push(format!("coordinator_lost (transport) ×{}", r.coordinator_lost));
    }
    if r.cut_by_fault > 0 {
        errors.push(format!("cut_by_fault (transport) ×{}", r.cut_by_fault));
    }
    let ttft = r.p99_ttft_ms.map_or_else(|| "-".to_owned(), |ms| format!("{:.2} s", ms / 1000.0));
    let proven = match (r.fault_proven, vacuity) {
        (true, false) => "yes",
        (false, false) => "NO",
        // Without its fault, a drill must fail its proof.
        (false, true) => "no (ok)",
        (true, true) => "VACUOUS",
    };
    format!(
        "{:<24} {:>6} {:>5} {:>8} {:>5} {:>7} {:>9} {:>5}  {}",
        r.drill,
        proven,
        r.requests,
        r.complete,
        r.lost,
        r.leaked_blocks,
        ttft,
        r.violations.len(),
        if errors.is_empty() { "-".to_owned() } else { errors.join(", ") }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_progress_bar_fills_with_finished_requests() {
        let l = progress_line("[1/2] x", 5, 10, Duration::from_secs(3));
        assert_eq!(l, "[1/2] x ▕██████████··········▏ 5/10 requests  3 s");
        assert!(progress_line("x", 0, 0, Duration::ZERO).contains("····················"));
        assert!(progress_line("x", 8, 8, Duration::ZERO).contains(&"█".repeat(20)));
    }
}
