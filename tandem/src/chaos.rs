//! `tandem chaos`: a seeded schedule of overlapping faults on a local
//! cluster under steady load, invariants checked as each request ends and at
//! quiescence (the `drills` crate's `chaos` does the work).
//!
//! `--dry-run` prints the schedule and starts nothing. The seed (printed
//! when not given) reproduces the schedule; a failing run prints the command
//! that repeats it. `--keep-faults` applies only some of the schedule's
//! faults, by their index in `--dry-run`'s list; `--shrink` runs a failing
//! schedule again with fewer and fewer of them, to the shortest list that
//! still fails (flake-aware, bounded in time), and prints its command. Ctrl-C (SIGINT) or SIGTERM lifts every held fault at once
//! and ends the run; each applied and lifted fault is an audit line on stderr
//! and, with `--journal`, a JSON line there. Exit status: 0 when no
//! invariant broke and every fault action worked.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use drills::chaos::{self, ChaosOptions, FaultKind, ScheduleOptions};
use tokio_util::sync::CancellationToken;

#[derive(clap::Args)]
pub struct Args {
    /// Seeds the schedule and the load (default: drawn and printed).
    #[arg(long)]
    seed: Option<u64>,
    /// How long faults are applied, after a fault-free lead-in of a tenth of it (15 s to
    /// 2 min, the goodput baseline): `90s`, `10m`, `1h` (bare numbers are seconds).
    #[arg(long, default_value = "120s", value_parser = parse_duration)]
    duration: Duration,
    /// Mean faults per minute.
    #[arg(long, default_value_t = 6.0)]
    rate: f64,
    /// Fault kinds to draw from, comma-separated (default: all; `--list-faults` names them).
    #[arg(long, value_delimiter = ',')]
    faults: Vec<String>,
    /// Processes never acted on, comma-separated names (`decode-1`, `coordinator`, `etcd`;
    /// `kv:decode-1` for a KV link alone, which naming its worker excludes too).
    #[arg(long, value_delimiter = ',')]
    exclude: Vec<String>,
    /// Processes never killed, comma-separated names: every other fault still lands on
    /// them, and their one life spans the run, so a run of 20 minutes or more judges its
    /// memory slope (`make certify` spares `decode-1,prefill-1,coordinator-1`).
    #[arg(long, value_delimiter = ',')]
    never_kill: Vec<String>,
    /// Most faults held at once.
    #[arg(long, default_value_t = 2)]
    max_in_flight: usize,
    /// Steady load, requests per second.
    #[arg(long, default_value_t = 1.0)]
    load_rps: f64,
    /// Print the schedule and exit: nothing is started.
    #[arg(long)]
    dry_run: bool,
    /// List the fault kinds and exit.
    #[arg(long)]
    list_faults: bool,
    /// Write the report as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write the report as JUnit XML here: a test case per guarantee, failed with each
    /// violation of it, and one for the fault actions.
    #[arg(long)]
    junit: Option<PathBuf>,
    /// Draw the run as an SVG timeline here: faults as bars on their targets' rows,
    /// requests as dots (start, time taken, outcome), violations as red lines.
    #[arg(long)]
    svg: Option<PathBuf>,
    /// Append each applied and lifted fault here, one JSON line each.
    #[arg(long)]
    journal: Option<PathBuf>,
    /// Keep the processes' logs (their directory is in the report).
    #[arg(long)]
    keep_logs: bool,
    /// Start the cluster with planted bugs (a wrong first token, leaked KV blocks, a
    /// stream that never ends; binaries built with `fault-injection`, as `make drills`
    /// builds them): the run must fail, naming each. Proves the invariants are not vacuous.
    #[arg(long)]
    plant: bool,
    /// Start the coordinators with a planted bug only a fault sets off: a request moved
    /// to another decode worker (its worker killed or frozen mid-stream) loses a token.
    /// Binaries built with `fault-injection`. With `--shrink`, shows the search finding
    /// the faults that matter.
    #[arg(long)]
    plant_on_move: bool,
    /// Apply only these faults of the seeded schedule, comma-separated indices as
    /// `--dry-run` numbers them (`none`: no fault; the load and its timing stay the
    /// same). What a shrunk run's command names.
    #[arg(long, value_parser = parse_keep)]
    keep_faults: Option<Keep>,
    /// If the run fails, shrink it: run the same seed and load again with fewer faults
    /// (each candidate up to `--shrink-runs` times, failing at its first run that breaks a
    /// guarantee the run broke) to the shortest list that still fails, then print its
    /// command. Exits non-zero whenever the first run failed.
    #[arg(long)]
    shrink: bool,
    /// Run against the running cluster this state file describes (`tandem up --state-file`,
    /// or one written by hand with action templates) instead of starting one, and leave it
    /// as found: only the fault kinds it allows (each refused kind is printed with why).
    #[arg(long, value_name = "STATEFILE", conflicts_with_all = ["plant", "plant_on_move"])]
    against: Option<PathBuf>,
    /// With --against: the API key every request of the run carries, where the cluster's
    /// coordinators take only keys their tenants file lists. The printed commands name
    /// TANDEM_API_KEY instead of the key. Env: TANDEM_API_KEY.
    #[arg(long, env = "TANDEM_API_KEY", value_name = "KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// The most time the shrinking runs may take together (`30m`, `1h`, `900s`).
    #[arg(long, default_value = "30m", value_parser = parse_duration)]
    shrink_budget: Duration,
    /// Clean runs before a candidate counts as passing.
    #[arg(long, default_value_t = 3)]
    shrink_runs: u32,
}

/// `--keep-faults`: indices, or none.
#[derive(Debug, Clone)]
struct Keep(Vec<usize>);

fn parse_keep(s: &str) -> Result<Keep, String> {
    if s == "none" {
        return Ok(Keep(Vec::new()));
    }
    let mut v = s
        .split(',')
        .map(|x| x.trim().parse::<usize>().map_err(|_| format!("{x:?} is not a fault index (0, 1, ...; or `none`)")))
        .collect::<Result<Vec<_>, _>>()?;
    v.sort_unstable();
    v.dedup();
    Ok(Keep(v))
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let (n, unit) = match s.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => s.split_at(i),
        None => (s, "s"),
    };
    let n: u64 = n.parse().map_err(|_| format!("{s:?} is not a duration (90s, 10m, 1h)"))?;
    let secs = match unit {
        "s" => n,
        "m" => n * 60,
        "h" => n * 3600,
        _ => return Err(format!("{s:?}: the unit must be s, m or h")),
    };
    if secs == 0 {
        return Err("the duration must be at least a second".into());
    }
    Ok(Duration::from_secs(secs))
}

pub fn run(a: Args) -> anyhow::Result<()> {
    if a.list_faults {
        for k in FaultKind::ALL {
            println!("{}", k.name());
        }
        return Ok(());
    }
    let kinds = if a.faults.is_empty() {
        FaultKind::ALL.to_vec()
    } else {
        a.faults
            .iter()
            .map(|f| FaultKind::parse(f).with_context(|| format!("unknown fault `{f}` (--list-faults names them)")))
            .collect::<anyhow::Result<Vec<_>>>()?
    };
    let positive = |x: f64| x > 0.0 && x.is_finite();
    if !positive(a.rate) || !positive(a.load_rps) {
        bail!("--rate and --load-rps must be positive");
    }
    if a.max_in_flight == 0 {
        bail!("--max-in-flight must be at least 1");
    }
    if a.shrink_runs == 0 {
        bail!("--shrink-runs must be at least 1");
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    // Against a running cluster: its processes are the targets, and only the fault kinds it
    // allows are drawn.
    let (targets, kinds) = match &a.against {
        None => (chaos::targets_of(None), kinds),
        Some(state) => {
            let c = rt.block_on(drills::Cluster::attach(state, a.api_key.as_deref()))?;
            c.keyed().map_err(anyhow::Error::msg)?;
            let (usable, refused) = chaos::usable_kinds(&kinds, &c).map_err(anyhow::Error::msg)?;
            for r in refused {
                eprintln!("chaos: not against this cluster: {r}");
            }
            (chaos::targets_of(Some(&c)), usable)
        }
    };
    let known: Vec<&String> =
        [&targets.decode, &targets.prefill, &targets.coordinators, &targets.etcd, &targets.kv_links]
            .into_iter()
            .flatten()
            .collect();
    if let Some(x) = a.exclude.iter().find(|x| !known.contains(x)) {
        bail!("--exclude {x}: no such process (the cluster has {known:?})");
    }
    if let Some(x) = a.never_kill.iter().find(|x| !known.contains(x) || x.starts_with("kv:")) {
        bail!("--never-kill {x}: no such process (the cluster has {known:?}; a KV link is never killed)");
    }
    let seed = a.seed.unwrap_or_else(|| {
        let s = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64);
        eprintln!("seed {s}");
        s
    });
    let cancel = CancellationToken::new();
    let o = ChaosOptions {
        schedule: ScheduleOptions {
            seed,
            duration: a.duration,
            per_minute: a.rate,
            kinds,
            exclude: a.exclude,
            never_kill: a.never_kill,
            max_in_flight: a.max_in_flight,
        },
        load_rps: a.load_rps,
        keep_logs: a.keep_logs,
        journal: a.journal,
        cancel: cancel.clone(),
        plant: a.plant,
        plant_on_move: a.plant_on_move,
        keep: a.keep_faults.map(|k| k.0),
        against: a.against,
        api_key: a.api_key,
    };
    // Checked before anything starts (an index past the schedule's end).
    chaos::planned(&o, &targets).map_err(anyhow::Error::msg)?;
    if a.dry_run {
        println!("# {}", chaos::command(&o));
        let all = chaos::schedule(&o.schedule, &targets);
        let kept: Vec<(usize, &chaos::Planned)> =
            all.iter().enumerate().filter(|(i, _)| o.keep.as_ref().is_none_or(|k| k.contains(i))).collect();
        for (i, p) in &kept {
            println!("{i:>4}  {p}");
        }
        println!("# {} of {} faults", kept.len(), all.len());
        return Ok(());
    }
    let abort = cancel.clone();
    let (report, loads, took) = rt.block_on(async {
        // The abort key: lift everything held and end the run.
        tokio::spawn(async move {
            let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(t) => t,
                Err(_) => return,
            };
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            eprintln!("chaos: stopping: lifting every held fault");
            abort.cancel();
        });
        let started = tokio::time::Instant::now();
        let (report, loads) = chaos::run_chaos_with_loads(&o).await?;
        anyhow::Ok((report, loads, started.elapsed()))
    })?;
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_vec_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &a.junit {
        std::fs::write(path, chaos::junit(&report)).with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &a.svg {
        std::fs::write(path, chaos::svg(&report)).with_context(|| format!("writing {}", path.display()))?;
    }
    println!(
        "chaos seed {}: {:.0} s, {} fault events ({}), {} requests: {} complete, typed errors {:?}, {} streams resumed",
        report.seed,
        report.duration_s,
        report.applied.values().sum::<u32>(),
        report.applied.iter().map(|(k, n)| format!("{k} {n}")).collect::<Vec<_>>().join(", "),
        report.requests,
        report.complete,
        report.typed_errors,
        report.resumed
    );
    let g = &report.goodput;
    println!(
        "goodput outside fault windows: {} ({} of {} requests completed outside, {:.0}% of the faulted time; \
         {} of {} in the {:.0} s fault-free lead-in)",
        g.ratio.map_or("not judged (too few requests on one side)".to_owned(), |r| format!(
            "{:.0}% of the lead-in's",
            r * 100.0
        )),
        g.outside_met,
        g.outside_requests,
        g.outside_time_share * 100.0,
        g.baseline_met,
        g.baseline_requests,
        g.lead_in_ms as f64 / 1e3
    );
    for (name, l) in &report.loads {
        println!(
            "load {name}: {} requests, {} complete, {} resumes, {} retries after a refusal",
            l.requests, l.complete, l.resumed, l.retried
        );
    }
    for (link, k) in &report.kv_links {
        println!(
            "{link}: {} chunks delayed, {} connections reset, {} bytes flipped, {} bytes blackholed",
            k.delayed_chunks,
            k.resets,
            k.flips,
            k.blackholed_bytes + k.blackholed_reply_bytes
        );
    }
    let judged: Vec<_> = report.incarnations.iter().filter(|i| i.judged()).collect();
    let worst = judged.iter().filter_map(|i| Some((i.slope_mib_per_10_min?, i))).max_by(|a, b| a.0.total_cmp(&b.0));
    match worst {
        Some((slope, i)) => println!(
            "memory: {} process lives, {} long enough to judge; steepest {} (pid {}) {slope:+.2} MiB per 10 minutes",
            report.incarnations.len(),
            judged.len(),
            i.name,
            i.pid
        ),
        None => println!("memory: {} process lives, none long enough to judge (20 minutes)", report.incarnations.len()),
    }
    for a in report.actions.iter().filter(|a| !a.error.is_empty()) {
        println!(
            "fault action failed at {:.1} s: {} {} {}: {}",
            a.at_ms as f64 / 1e3,
            a.what,
            a.kind.name(),
            a.target,
            a.error
        );
    }
    for v in &report.violations {
        println!("violation at {:.1} s ({:?}): {}", v.at_ms as f64 / 1e3, v.guarantee, v.detail);
    }
    if report.passed() {
        println!("no invariant broke");
        if a.shrink {
            println!("nothing to shrink");
        }
        Ok(())
    } else {
        println!("repeat: {}", report.command);
        if a.shrink && cancel.is_cancelled() {
            println!("not shrunk: the run was cancelled");
        } else if a.shrink {
            let bounds = chaos::Bounds { runs_per_candidate: a.shrink_runs, budget: a.shrink_budget };
            eprintln!(
                "shrink: the run failed with {} faults; shrinking (up to {} runs a candidate, within {} s)",
                report.schedule.len(),
                bounds.runs_per_candidate,
                bounds.budget.as_secs()
            );
            let s = rt.block_on(chaos::shrink_run(&o, &report, took, bounds, &loads, |line| eprintln!("{line}")));
            let minimal = ChaosOptions { keep: Some(s.kept.clone()), ..o.clone() };
            let all = chaos::schedule(&o.schedule, &targets);
            println!(
                "shrunk from {} to {} faults in {} runs ({:.1} min){}:",
                report.schedule.len(),
                s.kept.len(),
                s.runs,
                s.spent.as_secs_f64() / 60.0,
                s.stopped
                    .as_ref()
                    .map(|why| format!(", stopped early ({why}): a shorter list may fail too"))
                    .unwrap_or_default()
            );
            for &i in &s.kept {
                println!("{i:>4}  {}", all[i]);
            }
            println!("minimal: {}", chaos::command(&minimal));
        }
        bail!("chaos seed {} found {} violation(s)", report.seed, report.violations.len())
    }
}
