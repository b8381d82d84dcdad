//! `tandem bench scale`: today's control plane at fleet sizes — every coordinator polls
//! every worker's `Health` (`--load-poll-ms`) and watches its prefix set (a
//! `WatchPrefixes` stream of changes into one block-hash index), and every worker keeps
//! a lease alive in etcd — measured with simulated workers (`tandem sim`)
//! against a real etcd and real coordinators, one fleet size after another.
//!
//! Per size: a fresh etcd, the fleet as two `tandem sim` processes (the larger share
//! and `--kill-share` of it, to be killed at once), `--coordinators` coordinators. Once
//! every coordinator sees every worker serving, a window of `--window` under a light
//! chat load (multi-turn, so prefix routing has something to find) measures per
//! coordinator CPU seconds per second (from /proc, user + system) and resident memory,
//! the simulators' Health answers per second and prefix bytes sent per second, etcd's
//! committed proposals and lease keepalives per second, the coordinators' own routing
//! decision time (`tandem_coordinator_route_decision_seconds` and, without waits for a
//! CPU or a lock, `..._cpu_seconds`; p50/p99 from their buckets), the prefix hit rate beside an oracle's and the prefix sets' freshness
//! (both from the simulators, [`crate::sim`]), and each coordinator's `/metrics` series
//! count. Then the smaller simulator
//! is SIGKILLed: membership convergence is the time until every coordinator counts
//! exactly the survivors, against two lease TTLs.
//!
//! Processes are pinned (`taskset`): coordinators on `--coordinator-cpus`, etcd and the
//! simulators on `--sim-cpus`, so the coordinators' CPU is their own. The open-files
//! limit of the simulators and coordinators is raised to the hard limit (`prlimit`).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use opskit::etcd::Etcd;
use opskit::process::{Launch, Proc, Signal};
use opskit::prom::Page;
use serde::Serialize;
// Wall time of a measurement, on tokio's clock as every other in the workspace.
use tokio::time::Instant;

use crate::up::child::sibling;

#[derive(clap::Args)]
pub struct Args {
    /// Fleet sizes, simulated workers in all (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "100,300,1000")]
    sizes: Vec<usize>,
    /// Coordinators, each polling every worker.
    #[arg(long, default_value_t = 3)]
    coordinators: usize,
    /// Share of each fleet that are prefill workers.
    #[arg(long, default_value_t = 0.25)]
    prefill_share: f64,
    /// Share of each fleet killed at once (membership convergence).
    #[arg(long, default_value_t = 0.1)]
    kill_share: f64,
    /// The workers' lease TTL, s (stated in the table: 1,000 keepalives every TTL/3).
    #[arg(long, default_value_t = 5)]
    lease_ttl_s: u64,
    /// The coordinators' `--load-poll-ms`.
    #[arg(long, default_value_t = 250)]
    load_poll_ms: u64,
    /// How long each size is measured, s.
    #[arg(long, default_value_t = 20)]
    window_s: u64,
    /// Chat conversations in flight during the window (spread over the coordinators).
    #[arg(long, default_value_t = 4)]
    load: usize,
    /// CPUs the coordinators run on (a `taskset` list).
    #[arg(long, default_value = "0")]
    coordinator_cpus: String,
    /// CPUs etcd and the simulators run on (a `taskset` list).
    #[arg(long, default_value = "1")]
    sim_cpus: String,
    /// GGUF model: the coordinators' tokenizer and chat template.
    #[arg(long, env = "TANDEM_MODEL")]
    model: PathBuf,
    /// Write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// One fleet size's figures.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub workers: usize,
    pub coordinators: usize,
    /// Mean over coordinators.
    pub coordinator_cpu_per_s: f64,
    pub coordinator_rss_mib: f64,
    /// Health answers per second, all coordinators together.
    pub polls_per_s: f64,
    /// Prefix-report payload (8 bytes a hash) per second.
    pub prefix_bytes_per_s: f64,
    /// Watch messages carrying a worker's load, per second, all coordinators together.
    pub load_updates_per_s: f64,
    pub etcd_proposals_per_s: f64,
    pub etcd_keepalives_per_s: f64,
    /// Prompt tokens the prefilling worker had cached, of those prefilled; what an
    /// oracle scoring as the router does with perfect and instant information would have
    /// had; and the most cached anywhere (placing each prompt by its prefix alone).
    pub hit_rate: f64,
    pub oracle_hit_rate: f64,
    pub most_cached_rate: f64,
    /// A worker's prefix set changing → the change sent to a coordinator, ms (bucket bound).
    pub freshness_p50_ms: f64,
    pub freshness_p99_ms: f64,
    /// Routing decision time in the coordinators, µs (upper bucket bound).
    pub decision_p50_us: f64,
    pub decision_p99_us: f64,
    /// The same decisions in CPU time of the thread that made them (without waits for a
    /// CPU or a lock), µs (upper bucket bound).
    pub decision_cpu_p50_us: f64,
    pub decision_cpu_p99_us: f64,
    pub decisions: f64,
    /// Requests completed during the window, of those sent.
    pub requests_ok: usize,
    pub requests: usize,
    /// From the coordinators' start to each seeing every worker serving (the slowest).
    pub start_convergence_s: f64,
    /// From the SIGKILL of `killed` workers to every coordinator counting the rest.
    pub killed: usize,
    pub kill_convergence_s: f64,
    /// `/metrics` series (sample lines), mean over coordinators.
    pub series: f64,
}

/// User + system CPU seconds a process has used, and its resident MiB.
fn cpu_and_rss(pid: u32) -> Result<(f64, f64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).with_context(|| format!("pid {pid} gone"))?;
    // Fields after the command's closing parenthesis: utime and stime are the 12th and 13th.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).context("odd /proc stat")?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).context("odd /proc stat");
    let cpu = (ticks(11)? + ticks(12)?) / 100.0; // USER_HZ is 100 on Linux
    let rss_kb = opskit::process::status_kib(pid, "VmRSS").context("no VmRSS")?;
    Ok((cpu, rss_kb as f64 / 1024.0))
}

/// The bound of the bucket where a histogram's cumulative count reaches quantile `q`.
fn quantile(buckets: &[(f64, f64)], q: f64) -> f64 {
    let total = buckets.last().map_or(0.0, |b| b.1);
    buckets.iter().find(|(_, c)| *c >= q * total).map_or(f64::NAN, |b| b.0)
}

/// A histogram's cumulative buckets (`le`, count) on a page, by bound.
fn histogram(page: &Page, name: &str) -> Vec<(f64, f64)> {
    let bucket = format!("{name}_bucket");
    let mut b: Vec<(f64, f64)> = page
        .series(&bucket)
        .filter_map(|s| {
            let le = s.labels.get("le")?.as_str();
            let le = if le == "+Inf" { f64::INFINITY } else { le.parse().ok()? };
            Some((le, s.value))
        })
        .collect();
    b.sort_by(|x, y| x.0.total_cmp(&y.0));
    b
}

/// Buckets summed over several pages.
fn sum_buckets(pages: &[Vec<(f64, f64)>]) -> Vec<(f64, f64)> {
    let mut out: Vec<(f64, f64)> = pages.first().cloned().unwrap_or_default();
    for p in pages.iter().skip(1) {
        for (o, b) in out.iter_mut().zip(p) {
            o.1 += b.1;
        }
    }
    out
}

/// The difference between two snapshots of cumulative buckets.
fn diff_buckets(after: &[(f64, f64)], before: &[(f64, f64)]) -> Vec<(f64, f64)> {
    after.iter().map(|&(le, c)| (le, c - before.iter().find(|b| b.0 == le).map_or(0.0, |b| b.1))).collect()
}

/// The simulators' counters, all simulators together (their last `sim stats:` lines).
#[derive(Debug, Default)]
struct SimCounts {
    health: f64,
    prefix_hashes: f64,
    load_updates: f64,
    prompt_tokens: f64,
    hit_tokens: f64,
    oracle_tokens: f64,
    best_tokens: f64,
    /// Cumulative (bound ms, count).
    freshness: Vec<(f64, f64)>,
}

fn sim_counts(sims: &[&Proc]) -> Result<SimCounts> {
    let mut out = SimCounts::default();
    let mut freshness = Vec::new();
    for s in sims {
        let text = std::fs::read_to_string(s.log_path())?;
        let line = text
            .lines()
            .rev()
            .find_map(|l| l.split_once("sim stats: ").map(|(_, r)| r))
            .with_context(|| format!("{} wrote no stats line", s.name))?;
        let v: serde_json::Value = serde_json::from_str(line)?;
        let f = |k: &str| v[k].as_f64().unwrap_or(0.0);
        out.health += f("health");
        out.prefix_hashes += f("prefix_hashes");
        out.load_updates += f("load_updates");
        out.prompt_tokens += f("prompt_tokens");
        out.hit_tokens += f("hit_tokens");
        out.oracle_tokens += f("oracle_tokens");
        out.best_tokens += f("best_tokens");
        let buckets = v["freshness_ms"]
            .as_array()
            .map(|b| b.iter().filter_map(|p| Some((p[0].as_f64()?, p[1].as_f64()?))).collect::<Vec<(f64, f64)>>());
        freshness.push(buckets.unwrap_or_default());
    }
    out.freshness = sum_buckets(&freshness);
    Ok(out)
}

fn etcd_counts(page: &Page) -> (f64, f64) {
    let proposals = page.absent_as_zero("etcd_server_proposals_committed_total", &[]);
    let keepalives = page.absent_as_zero("grpc_server_msg_received_total", &[("grpc_method", "LeaseKeepAlive")]);
    (proposals, keepalives)
}

pub fn run(a: Args) -> Result<()> {
    if a.sizes.is_empty() || a.sizes.iter().any(|&n| n < 4) {
        bail!("--sizes: each fleet needs at least 4 workers");
    }
    if a.coordinators == 0 || !(0.0..1.0).contains(&a.prefill_share) || !(0.0..0.5).contains(&a.kill_share) {
        bail!("--coordinators must be at least 1, --prefill-share in [0, 1), --kill-share in [0, 0.5)");
    }
    let cpus = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let flags = cpus.lines().find_map(|l| l.strip_prefix("flags")).unwrap_or_default();
    let named: Vec<&str> =
        flags.split_whitespace().filter(|f| f.starts_with("avx") || f.starts_with("amx") || *f == "fma").collect();
    eprintln!("bench scale: CPU flags {}", named.join(" "));
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let mut rows = Vec::new();
    for &n in &a.sizes {
        let row = rt.block_on(measure(&a, n))?;
        eprintln!("bench scale: {n} workers measured");
        rows.push(row);
    }
    print_table(&a, &rows);
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&rows)?)?;
    }
    Ok(())
}

async fn wait_counts(http: &[String], want: f64, limit: Duration) -> Result<Duration> {
    let started = Instant::now();
    for h in http {
        opskit::poll(&format!("{h} counting {want} serving workers"), limit, || async {
            let page = opskit::prom::scrape(h).await?;
            let serving = page.sum(facts::metrics::coordinator::WORKERS, &[("state", "serving")])?;
            let known = page.sum(facts::metrics::coordinator::WORKERS_LOAD_KNOWN, &[])?;
            Ok::<_, opskit::Error>((serving == want && known == want).then_some(()))
        })
        .await?;
    }
    Ok(started.elapsed())
}

async fn measure(a: &Args, n: usize) -> Result<Row> {
    let logs = std::env::temp_dir().join(format!("tandem-bench-scale-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&logs);
    std::fs::create_dir_all(&logs)?;
    let etcd = Etcd::start().await?;
    if let Some(pid) = etcd.pid() {
        pin(pid, &a.sim_cpus)?;
    }
    let ep = etcd.endpoint();
    // The simulators and coordinators get the hard limit as their soft one.
    let nofile = crate::sim::open_files_limits().map_or(1024, |(_, hard)| hard);
    let killed = ((n as f64 * a.kill_share).round() as usize).max(1);
    let prefill = |w: usize| ((w as f64 * a.prefill_share).round() as usize).min(w - 1);
    let sim_bin = std::env::current_exe()?;
    let start_sim = |name: &str, workers: usize| {
        let (p, d) = (prefill(workers), workers - prefill(workers));
        Launch::path(sim_bin.clone())
            .name(name)
            .prefix(&prefix(&a.sim_cpus, nofile))
            .args(["sim", "--etcd", ep.as_str(), "--name", name, "--stats-every-s", "1"])
            .args(["--decode", &d.to_string(), "--prefill", &p.to_string()])
            .args(["--lease-ttl-s", &a.lease_ttl_s.to_string()])
            .until_line("sim: ")
            .wait(Duration::from_secs(300))
            .log_dir(&logs)
            .start()
    };
    let main = start_sim("fleet", n - killed).await?;
    let victim = start_sim("victims", killed).await?;

    let model = a.model.to_str().context("the model path is not UTF-8")?;
    let coordinator_bin = sibling("tandem-coordinator")?;
    let started = Instant::now();
    let mut coordinators: Vec<Proc> = Vec::new();
    for i in 0..a.coordinators {
        let c = Launch::path(coordinator_bin.clone())
            .name(&format!("coordinator-{i}"))
            .prefix(&prefix(&a.coordinator_cpus, nofile))
            .args(["--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0", "--etcd", ep.as_str(), "--model", model])
            .args(["--load-poll-ms", &a.load_poll_ms.to_string()])
            .wants(&["http", "grpc"])
            .log_dir(&logs)
            .start()
            .await?;
        coordinators.push(c);
    }
    let http: Vec<String> = coordinators.iter().map(|c| c.addr("http")).collect::<Result<_, _>>()?;
    wait_counts(&http, n as f64, Duration::from_secs(300)).await?;
    let start_convergence = started.elapsed();

    // The window, under load.
    let pages_before = scrape_all(&http).await?;
    let cpu_before: Vec<(f64, f64)> = coordinators.iter().map(|c| cpu_and_rss(c.pid)).collect::<Result<_>>()?;
    let sims = [&main, &victim];
    let sim_before = sim_counts(&sims)?;
    let etcd_before = etcd_counts(&opskit::prom::scrape(&ep_addr(&ep)).await?);
    let t0 = Instant::now();
    let load = tokio::spawn(chat_load(http.clone(), a.load, Duration::from_secs(a.window_s)));
    tokio::time::sleep(Duration::from_secs(a.window_s)).await;
    // Stats lines are written every second: wait for one past the window's end.
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let secs = t0.elapsed().as_secs_f64();
    let (requests, requests_ok) = load.await??;
    let pages_after = scrape_all(&http).await?;
    let cpu_after: Vec<(f64, f64)> = coordinators.iter().map(|c| cpu_and_rss(c.pid)).collect::<Result<_>>()?;
    let sim_after = sim_counts(&sims)?;
    let etcd_after = etcd_counts(&opskit::prom::scrape(&ep_addr(&ep)).await?);
    let in_window = |name: &str| {
        let before = sum_buckets(&pages_before.iter().map(|p| histogram(p, name)).collect::<Vec<_>>());
        let after = sum_buckets(&pages_after.iter().map(|p| histogram(p, name)).collect::<Vec<_>>());
        diff_buckets(&after, &before)
    };
    let window = in_window(facts::metrics::coordinator::ROUTE_DECISION);
    let window_cpu = in_window(facts::metrics::coordinator::ROUTE_DECISION_CPU);
    let c = a.coordinators as f64;
    let fresh = diff_buckets(&sim_after.freshness, &sim_before.freshness);
    let prompt = (sim_after.prompt_tokens - sim_before.prompt_tokens).max(1.0);
    let series = pages_after.iter().map(|p| p.samples().len() as f64).sum::<f64>() / c;

    // A share of the fleet dies at once.
    let killed_at = Instant::now();
    victim.signal(Signal::Kill)?;
    wait_counts(&http, (n - killed) as f64, Duration::from_secs(10 * a.lease_ttl_s)).await?;
    let kill_convergence = killed_at.elapsed();
    drop(coordinators);
    drop((main, victim, etcd));
    let _ = std::fs::remove_dir_all(&logs);

    Ok(Row {
        workers: n,
        coordinators: a.coordinators,
        coordinator_cpu_per_s: cpu_after.iter().zip(&cpu_before).map(|(x, y)| x.0 - y.0).sum::<f64>() / secs / c,
        coordinator_rss_mib: cpu_after.iter().map(|x| x.1).sum::<f64>() / c,
        polls_per_s: (sim_after.health - sim_before.health) / secs,
        prefix_bytes_per_s: 8.0 * (sim_after.prefix_hashes - sim_before.prefix_hashes) / secs,
        load_updates_per_s: (sim_after.load_updates - sim_before.load_updates) / secs,
        hit_rate: (sim_after.hit_tokens - sim_before.hit_tokens) / prompt,
        oracle_hit_rate: (sim_after.oracle_tokens - sim_before.oracle_tokens) / prompt,
        most_cached_rate: (sim_after.best_tokens - sim_before.best_tokens) / prompt,
        freshness_p50_ms: quantile(&fresh, 0.5),
        freshness_p99_ms: quantile(&fresh, 0.99),
        etcd_proposals_per_s: (etcd_after.0 - etcd_before.0) / secs,
        etcd_keepalives_per_s: (etcd_after.1 - etcd_before.1) / secs,
        decision_p50_us: quantile(&window, 0.5) * 1e6,
        decision_p99_us: quantile(&window, 0.99) * 1e6,
        decision_cpu_p50_us: quantile(&window_cpu, 0.5) * 1e6,
        decision_cpu_p99_us: quantile(&window_cpu, 0.99) * 1e6,
        decisions: window.last().map_or(0.0, |b| b.1),
        requests_ok,
        requests,
        start_convergence_s: start_convergence.as_secs_f64(),
        killed,
        kill_convergence_s: kill_convergence.as_secs_f64(),
        series,
    })
}

/// `taskset -c CPUS prlimit --nofile=N:N`: both exec the program, so its pid is its own.
fn prefix(cpus: &str, nofile: u64) -> Vec<String> {
    ["taskset", "-c", cpus, "prlimit", &format!("--nofile={nofile}:{nofile}")].map(str::to_owned).to_vec()
}

/// Pins a running process, every thread of it.
fn pin(pid: u32, cpus: &str) -> Result<()> {
    let ok = std::process::Command::new("taskset").args(["-a", "-p", "-c", cpus, &pid.to_string()]).output()?;
    if !ok.status.success() {
        bail!("taskset -a -p -c {cpus} {pid}: {}", String::from_utf8_lossy(&ok.stderr));
    }
    Ok(())
}

/// `host:port` of an etcd client URL (its `/metrics` is served there).
fn ep_addr(ep: &str) -> String {
    ep.trim_start_matches("http://").to_owned()
}

async fn scrape_all(http: &[String]) -> Result<Vec<Page>> {
    let mut out = Vec::new();
    for h in http {
        out.push(opskit::prom::scrape(h).await?);
    }
    Ok(out)
}

/// Multi-turn chats, `conversations` at a time spread over the coordinators, for
/// `window`: (requests sent, completed).
async fn chat_load(http: Vec<String>, conversations: usize, window: Duration) -> Result<(usize, usize)> {
    let mut tasks = tokio::task::JoinSet::new();
    for (i, h) in http.iter().cycle().take(conversations.max(1)).enumerate() {
        let mut p = loadgen::Plan::new(format!("http://{h}"), "SmolLM2-135M-Instruct");
        p.endpoint = loadgen::Endpoint::Chat;
        p.arrival = loadgen::Arrival::Closed { concurrency: 1 };
        p.prompts = loadgen::PromptSource::Chats { system_prompts: 2, system_tokens: 96, turns: 4, user_tokens: 24 };
        p.max_tokens = 8;
        p.seed = i as u64 + 1;
        // More than a conversation can send in the window (turns take 50 ms or more);
        // a plan's prompts are made up front, so not a million.
        p.requests = (window.as_secs() as usize + 1) * 40;
        p.timeout = Duration::from_secs(30);
        let hooks = loadgen::Hooks::default();
        let cancel = hooks.cancel.clone();
        tasks.spawn(async move {
            let run = tokio::spawn(async move { loadgen::run_with(&p, hooks).await });
            tokio::time::sleep(window).await;
            cancel.cancel();
            run.await
        });
    }
    let (mut sent, mut ok) = (0, 0);
    while let Some(r) = tasks.join_next().await {
        let report = r???;
        sent += report.records.len();
        ok += report.records.iter().filter(|r| r.outcome.is_complete()).count();
    }
    Ok((sent, ok))
}

fn print_table(a: &Args, rows: &[Row]) {
    println!(
        "\n`tandem bench scale`: {} coordinators polling every {} ms, lease TTL {} s, a {} s window with {} chat \
         conversations, {} of each fleet killed at once",
        a.coordinators, a.load_poll_ms, a.lease_ttl_s, a.window_s, a.load, a.kill_share
    );
    println!(
        "| workers | coord CPU s/s | coord RSS MiB | polls/s | prefix KB/s | loads/s | etcd proposals/s | keepalives/s | \
         route p50 / p99 µs (cpu) | hit rate / oracle / most cached | fresh p50 / p99 ms | requests ok | series/coord | \
         start conv. s | kill conv. s (killed) |"
    );
    println!(
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    );
    for r in rows {
        println!(
            "| {} | {:.3} | {:.1} | {:.0} | {:.1} | {:.0} | {:.1} | {:.0} | {:.0} / {:.0} ({:.0} / {:.0}) | {:.1}% / {:.1}% / {:.1}% | {:.0} / {:.0} \
             | {}/{} | {:.0} | {:.1} | {:.1} ({}) |",
            r.workers,
            r.coordinator_cpu_per_s,
            r.coordinator_rss_mib,
            r.polls_per_s,
            r.prefix_bytes_per_s / 1e3,
            r.load_updates_per_s,
            r.etcd_proposals_per_s,
            r.etcd_keepalives_per_s,
            r.decision_p50_us,
            r.decision_p99_us,
            r.decision_cpu_p50_us,
            r.decision_cpu_p99_us,
            100.0 * r.hit_rate,
            100.0 * r.oracle_hit_rate,
            100.0 * r.most_cached_rate,
            r.freshness_p50_ms,
            r.freshness_p99_ms,
            r.requests_ok,
            r.requests,
            r.series,
            r.start_convergence_s,
            r.kill_convergence_s,
            r.killed
        );
    }
    if let Some((a, b)) = fit(&rows.iter().map(|r| (r.workers as f64, r.series)).collect::<Vec<_>>()) {
        println!("series per coordinator ≈ {a:.2} × workers + {b:.0}");
    }
    if let (Some(first), Some(last)) = (rows.first(), rows.last()) {
        if last.workers > first.workers {
            let size = last.workers as f64 / first.workers as f64;
            // A figure that was zero at the smallest size has no ratio: both ends are shown.
            let growth = |x: f64, y: f64| if y > 0.0 { format!("{:.1}x", x / y) } else { format!("{y:.1} → {x:.1}") };
            println!(
                "growth {}→{} workers ({size:.0}x): coordinator CPU {}, polls {}, etcd proposals {}, \
                 keepalives {}, series {}",
                first.workers,
                last.workers,
                growth(last.coordinator_cpu_per_s, first.coordinator_cpu_per_s),
                growth(last.polls_per_s, first.polls_per_s),
                growth(last.etcd_proposals_per_s, first.etcd_proposals_per_s),
                growth(last.etcd_keepalives_per_s, first.etcd_keepalives_per_s),
                growth(last.series, first.series),
            );
        }
    }
}

/// Least squares `y = a·x + b` (`None` under two distinct x).
fn fit(points: &[(f64, f64)]) -> Option<(f64, f64)> {
    let n = points.len() as f64;
    let (sx, sy) = points.iter().fold((0.0, 0.0), |(sx, sy), (x, y)| (sx + x, sy + y));
    let (mx, my) = (sx / n, sy / n);
    let sxx: f64 = points.iter().map(|(x, _)| (x - mx) * (x - mx)).sum();
    if points.len() < 2 || sxx == 0.0 {
        return None;
    }
    let a = points.iter().map(|(x, y)| (x - mx) * (y - my)).sum::<f64>() / sxx;
    Some((a, my - a * mx))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_come_from_cumulative_buckets_and_windows_from_differences() {
        let before = [(1e-6, 0.0), (1e-5, 10.0), (1e-4, 10.0), (f64::INFINITY, 10.0)];
        let after = [(1e-6, 0.0), (1e-5, 60.0), (1e-4, 109.0), (f64::INFINITY, 110.0)];
        let w = diff_buckets(&after, &before);
        assert_eq!(w, [(1e-6, 0.0), (1e-5, 50.0), (1e-4, 99.0), (f64::INFINITY, 100.0)]);
        assert_eq!(quantile(&w, 0.5), 1e-5);
        assert_eq!(quantile(&w, 0.99), 1e-4);
        assert!(quantile(&w, 1.0).is_infinite());
        assert_eq!(sum_buckets(&[w.clone(), w.clone()])[1], (1e-5, 100.0));
        assert_eq!(fit(&[(100.0, 250.0), (300.0, 650.0), (1000.0, 2050.0)]), Some((2.0, 50.0)));
        assert_eq!(fit(&[(100.0, 250.0)]), None);
        assert_eq!(
            prefix("0", 4096),
            ["taskset", "-c", "0", "prlimit", "--nofile=4096:4096"].map(str::to_owned).to_vec()
        );
    }
}
