//! `tandem bench interference`: what a long prompt costs the streams already
//! running when prefill and decode workers share one host's cores, for one or
//! more `tandem up` configurations, each measured in the same run.
//!
//! Per configuration: start `tandem up` with its flags; run two streaming
//! decoders alone for `--window-s` (idle); then the same two decoders while
//! ~`--prompt-tokens`-token prompts arrive at `--rate`/s (Poisson, one
//! output token each, so their end-to-end time is their time to first
//! token); then, once every long prompt has ended, the two decoders alone
//! again for `--window-s`. Reported: decode tokens/s kept under
//! interference over the mean of the two idle windows, the worst gap
//! between two tokens of a stream, the idle ITL p99 (both idle windows) and
//! the long prompts' TTFT.
//!
//! Per configuration it also prints the idle windows' own worst gap and the
//! CPU time the hypervisor took from this VM in each window (`steal` in
//! /proc/stat): on the shared VMs this runs on, a decoder alone has shown
//! 70-90 ms gaps against a 25 ms ITL p99, so a busy window's single worst
//! gap is only read as interference when it stands clear of those.
//!
//! Why idle on both sides: the shared VMs this runs on change speed by
//! ±10-30% within minutes (the same one-thread decode measured 94-144
//! tok/s in one session), so a baseline taken only before the busy window
//! puts the host's drift into the ratio. Bracketing cancels a drift that is
//! steady over the run; both idle rates are printed, and a large difference
//! between them says the run was too noisy to read.
//!
//! With `--llama-server BIN`, llama.cpp's server on the same model, threads
//! and load is measured first as the reference row (`-t 2 --parallel 4
//! -c 8192`, as `make bench-serve` starts it), and each configuration's
//! figures are then set against the targets: decode tokens kept >= 0.9x,
//! worst gap <= 3x the idle ITL p99, long-prompt TTFT <= 1.2x
//! llama-server's. Only tokens inside each window count.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use loadgen::{Arrival, Hooks, Plan, PromptSource, Record, Report};
use tokio::process::{Child, Command};

#[derive(clap::Args)]
pub struct Args {
    /// A configuration, NAME=FLAGS: `tandem up` flags, space-separated (e.g.
    /// `nice10=--prefill-nice 10`). Repeat; each gets a fresh cluster.
    #[arg(long = "config", value_name = "NAME=FLAGS", required = true)]
    configs: Vec<String>,
    /// GGUF model (default: the cached SmolLM2 file).
    #[arg(long, env = "TANDEM_MODEL")]
    model: Option<PathBuf>,
    /// Length of each measured window (idle, under interference, idle again), s.
    #[arg(long, default_value_t = 40)]
    window_s: u64,
    /// Long prompts per second during the interference window (Poisson).
    #[arg(long, default_value_t = 0.5)]
    rate: f64,
    /// Length of the long prompts, about, in tokens.
    #[arg(long, default_value_t = 1080)]
    prompt_tokens: usize,
    /// Streaming decoders running throughout.
    #[arg(long, default_value_t = 2)]
    decoders: usize,
    /// Seed of prompts and arrivals (the same for every configuration).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// llama.cpp's `llama-server` binary (`make llama` builds it): measured
    /// first, under the same load, as the reference row.
    #[arg(long)]
    llama_server: Option<PathBuf>,
    /// Write every request's record (start, TTFT, each inter-token gap) here as
    /// `NAME-idle.json`, `NAME-busy.json`, `NAME-long.json` and
    /// `NAME-idle-after.json`, to place a gap
    /// against the long prompts' arrivals (both busy-window runs start together),
    /// each cluster's process logs in `NAME-logs`, and every process's
    /// `/metrics` page, read at the end (after the second idle window), as
    /// `NAME-metrics-COMPONENT.prom`.
    #[arg(long, value_name = "DIR")]
    records: Option<PathBuf>,
}

/// What a row measures: `tandem up` with flags, or llama.cpp's server.
#[derive(Clone, Copy)]
enum Launch<'a> {
    Tandem(&'a [String]),
    Llama(&'a Path),
}

/// One configuration's figures.
#[derive(Debug, Default)]
struct Figures {
    idle_before_tok_s: f64,
    idle_after_tok_s: f64,
    busy_tok_s: f64,
    idle_itl_p99_ms: f64,
    worst_gap_ms: f64,
    /// The worst gap of the two idle windows.
    idle_worst_gap_ms: f64,
    /// CPU time stolen from this VM during the idle, busy and second idle
    /// windows, ms (None where the kernel does not report it).
    steal_ms: [Option<f64>; 3],
    long_done: usize,
    long_sent: usize,
    long_ttft_p50_s: f64,
    long_ttft_max_s: f64,
}

impl Figures {
    /// Mean of the idle windows before and after the busy one.
    fn idle_tok_s(&self) -> f64 {
        (self.idle_before_tok_s + self.idle_after_tok_s) / 2.0
    }

    /// Decode tokens/s under interference over idle.
    fn kept(&self) -> f64 {
        self.busy_tok_s / self.idle_tok_s().max(f64::MIN_POSITIVE)
    }
}

pub fn run(a: &Args) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(run_all(a))
}

async fn run_all(a: &Args) -> Result<()> {
    println!("cpu: {}", crate::bench::cpu_summary());
    let mut rows = Vec::new();
    let mut reference = None;
    if let Some(bin) = &a.llama_server {
        eprintln!("== llama-server: {}", bin.display());
        let f = measure(a, "llama-server", Launch::Llama(bin)).await.context("llama-server")?;
        rows.push(("llama-server".to_owned(), f));
        reference = rows.last().map(|(_, f)| f.long_ttft_p50_s);
    }
    for c in &a.configs {
        let (name, flags) = c.split_once('=').with_context(|| format!("--config {c:?}: expected NAME=FLAGS"))?;
        let flags: Vec<String> = flags.split_whitespace().map(str::to_owned).collect();
        eprintln!("== {name}: tandem up {}", flags.join(" "));
        let f = measure(a, name, Launch::Tandem(&flags)).await.with_context(|| format!("configuration {name}"))?;
        rows.push((name.to_owned(), f));
    }
    println!(
        "{:<14} {:>10} {:>13} {:>10} {:>6} {:>12} {:>12} {:>10} {:>10} {:>8}",
        "config",
        "idle tok/s",
        "before/after",
        "busy tok/s",
        "kept",
        "idle ITL p99",
        "worst gap",
        "TTFT p50",
        "TTFT max",
        "long ok"
    );
    for (name, f) in &rows {
        println!(
            "{:<14} {:>10.1} {:>6.0}/{:<6.0} {:>10.1} {:>5.2}x {:>10.0} ms {:>9.0} ms {:>8.1} s {:>8.1} s {:>4}/{:<3}",
            name,
            f.idle_tok_s(),
            f.idle_before_tok_s,
            f.idle_after_tok_s,
            f.busy_tok_s,
            f.kept(),
            f.idle_itl_p99_ms,
            f.worst_gap_ms,
            f.long_ttft_p50_s,
            f.long_ttft_max_s,
            f.long_done,
            f.long_sent
        );
    }
    if let Some(llama_ttft) = reference {
        println!(
            "against the targets (kept >= 0.90x, worst gap <= 3x idle ITL p99, long TTFT p50 <= 1.2x llama-server's):"
        );
        for (name, f) in rows.iter().filter(|(n, _)| n != "llama-server") {
            let kept = f.kept();
            let gap = f.worst_gap_ms / f.idle_itl_p99_ms.max(f64::MIN_POSITIVE);
            let ttft = f.long_ttft_p50_s / llama_ttft;
            let mark = |ok: bool| if ok { "ok" } else { "MISSED" };
            println!(
                "{name:<14} kept {kept:.2}x {}  worst gap {gap:.1}x idle p99 {}  long TTFT {ttft:.2}x llama-server {}",
                mark(kept >= 0.9),
                mark(gap <= 3.0),
                mark(ttft <= 1.2)
            );
        }
    }
    println!("host noise (the idle windows' own worst gap; CPU time stolen from this VM in idle / busy / idle-after):");
    for (name, f) in &rows {
        let steal: Vec<String> =
            f.steal_ms.iter().map(|s| s.map_or_else(|| "-".to_owned(), |ms| format!("{ms:.0}"))).collect();
        println!(
            "{name:<14} idle worst gap {:.0} ms ({:.1}x idle p99)  steal {} ms",
            f.idle_worst_gap_ms,
            f.idle_worst_gap_ms / f.idle_itl_p99_ms.max(f64::MIN_POSITIVE),
            steal.join(" / ")
        );
    }
    Ok(())
}

/// CPU time the hypervisor has taken from this VM since boot, all CPUs
/// summed, ms: the `steal` column of /proc/stat's `cpu` line, in USER_HZ
/// ticks (100 a second on x86-64 and every architecture this builds for).
fn steal_ms() -> Option<f64> {
    steal_ms_of(&std::fs::read_to_string("/proc/stat").ok()?)
}

fn steal_ms_of(stat: &str) -> Option<f64> {
    let cpu = stat.lines().next()?.strip_prefix("cpu ")?;
    // user nice system idle iowait irq softirq steal ...
    let ticks: u64 = cpu.split_whitespace().nth(7)?.parse().ok()?;
    Some(ticks as f64 * 10.0)
}

/// How much `f` grew while `work` ran (None if either reading failed).
async fn during<T>(f: fn() -> Option<f64>, work: impl std::future::Future<Output = T>) -> (T, Option<f64>) {
    let before = f();
    let out = work.await;
    (out, before.zip(f()).map(|(b, a)| a - b))
}

/// A `tandem up` cluster (or a llama-server) of this process's own, stopped
/// (SIGTERM, then waited for) through [`Cluster::stop`], killed if dropped.
struct Cluster {
    child: Child,
    url: String,
    _dir: TempDir,
}

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl Cluster {
    async fn start(a: &Args, name: &str, launch: Launch<'_>) -> Result<Self> {
        let dir =
            TempDir(std::env::temp_dir().join(format!("tandem-interference-{}-{}", std::process::id(), free_port()?)));
        std::fs::create_dir_all(&dir.0)?;
        let port = free_port()?;
        let http = format!("127.0.0.1:{port}");
        let mut cmd = match launch {
            Launch::Tandem(flags) => {
                let grpc = format!("127.0.0.1:{}", free_port()?);
                let mut cmd = Command::new(std::env::current_exe()?);
                cmd.arg("up").args(["--http", &http, "--grpc", &grpc]);
                cmd.arg("--state-file").arg(dir.0.join("cluster.json"));
                if let Some(records) = &a.records {
                    cmd.arg("--log-dir").arg(records.join(format!("{name}-logs")));
                }
                if let Some(m) = &a.model {
                    cmd.arg("--model").arg(m);
                }
                cmd.args(flags);
                cmd
            }
            Launch::Llama(bin) => {
                let model = crate::load::model_path(a.model.clone())?;
                let mut cmd = Command::new(bin);
                cmd.arg("-m").arg(model);
                cmd.args(["-t", "2", "--parallel", "4", "-c", "8192", "--host", "127.0.0.1"]);
                cmd.args(["--port", &port.to_string()]);
                cmd
            }
        };
        let log = std::fs::File::create(dir.0.join("up.log"))?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone()?))
            .stderr(Stdio::from(log))
            .kill_on_drop(true)
            .spawn()
            .context("starting the server")?;
        let c = Self { child, url: format!("http://{http}"), _dir: dir };
        // Ready when a one-token request completes (bounded: model loads on 2 cores).
        let mut probe = Plan::new(&c.url, "SmolLM2-135M-Instruct");
        probe.requests = 1;
        probe.max_tokens = 1;
        probe.timeout = Duration::from_secs(10);
        let until = tokio::time::Instant::now() + Duration::from_secs(180);
        loop {
            let r = loadgen::run(&probe).await?;
            if r.records.iter().all(|r| r.outcome.is_complete()) {
                return Ok(c);
            }
            if tokio::time::Instant::now() > until {
                bail!("the cluster did not answer within 180 s; log: {}", c._dir.0.join("up.log").display());
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    async fn stop(mut self) -> Result<()> {
        if let Some(pid) = self.child.id() {
            let _ = std::process::Command::new("kill").args(["-TERM", &pid.to_string()]).status();
        }
        tokio::time::timeout(Duration::from_secs(60), self.child.wait())
            .await
            .context("the server did not stop within 60 s of SIGTERM")??;
        Ok(())
    }
}

/// Runs `decoders` streams until `window` has passed; returns their records.
async fn decoders(a: &Args, url: &str, window: Duration) -> Result<(Report, Duration)> {
    let mut p = Plan::new(url, "SmolLM2-135M-Instruct");
    p.requests = 10_000;
    p.arrival = Arrival::Closed { concurrency: a.decoders };
    p.prompts = PromptSource::Generated { tokens: 32 };
    p.max_tokens = 256;
    p.ignore_eos = true;
    p.seed = a.seed;
    let hooks = Hooks::default();
    let cancel = hooks.cancel.clone();
    let stopper = tokio::spawn(async move {
        tokio::time::sleep(window).await;
        cancel.cancel();
    });
    let report = loadgen::run_with(&p, hooks).await?;
    stopper.abort();
    Ok((report, window))
}

/// The moments (from the run's start) at which a record's tokens arrived.
fn token_times(r: &Record) -> Vec<Duration> {
    let Some(first) = r.ttft else { return Vec::new() };
    let mut t = r.start + first;
    let mut out = vec![t];
    for gap in &r.itl {
        t += *gap;
        out.push(t);
    }
    out
}

/// The tokens of one decoders run that arrived inside its window.
struct Window {
    tok_s: f64,
    /// Every gap between two tokens of a stream, ms, sorted.
    gaps_ms: Vec<f64>,
}

impl Window {
    fn of(report: &Report, window: Duration) -> Self {
        let mut tokens = 0usize;
        let mut gaps_ms: Vec<f64> = Vec::new();
        for r in &report.records {
            let times = token_times(r);
            tokens += times.iter().filter(|t| **t <= window).count();
            gaps_ms.extend(times.windows(2).filter(|w| w[1] <= window).map(|w| (w[1] - w[0]).as_secs_f64() * 1e3));
        }
        gaps_ms.sort_by(f64::total_cmp);
        Self { tok_s: tokens as f64 / window.as_secs_f64(), gaps_ms }
    }

    fn worst_ms(&self) -> f64 {
        self.gaps_ms.last().copied().unwrap_or(0.0)
    }
}

/// ITL p99 over the gaps of several windows together, ms.
fn p99_ms(windows: &[&Window]) -> f64 {
    let mut gaps: Vec<f64> = windows.iter().flat_map(|w| w.gaps_ms.iter().copied()).collect();
    gaps.sort_by(f64::total_cmp);
    loadgen::percentile(&gaps, 0.99).unwrap_or(0.0)
}

/// Writes `report` as `DIR/NAME-WHAT.json` when `--records DIR` was given.
fn keep_records(a: &Args, name: &str, what: &str, report: &Report) -> Result<()> {
    let Some(dir) = &a.records else { return Ok(()) };
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join(format!("{name}-{what}.json"));
    std::fs::write(&path, serde_json::to_vec(report)?).with_context(|| format!("writing {}", path.display()))
}

/// Saves each `/metrics` page `tandem up` lists in its Prometheus targets file.
async fn keep_metrics(dir: &Path, name: &str) -> Result<()> {
    let targets = dir.join(format!("{name}-logs")).join("prometheus-targets.json");
    let text = std::fs::read_to_string(&targets).with_context(|| format!("reading {}", targets.display()))?;
    let groups: Vec<serde_json::Value> = serde_json::from_str(&text)?;
    for g in &groups {
        let (Some(addr), Some(component)) = (g["targets"][0].as_str(), g["labels"]["component"].as_str()) else {
            continue;
        };
        let target = addr.to_owned();
        let page = match tokio::task::spawn_blocking(move || crate::up::http_get(&target, "/metrics")).await? {
            Some((200, page)) => page,
            Some((status, _)) => bail!("{component}'s /metrics at {addr} answered {status}"),
            None => bail!("{component}'s /metrics at {addr} could not be read"),
        };
        let path = dir.join(format!("{name}-metrics-{component}.prom"));
        std::fs::write(&path, page).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

async fn measure(a: &Args, name: &str, launch: Launch<'_>) -> Result<Figures> {
    let cluster = Cluster::start(a, name, launch).await?;
    let window = Duration::from_secs(a.window_s);
    let (idle, steal_idle) = during(steal_ms, decoders(a, &cluster.url, window)).await;
    let (idle, _) = idle?;

    let mut long = Plan::new(&cluster.url, "SmolLM2-135M-Instruct");
    long.requests = ((a.window_s as f64) * a.rate).round().max(1.0) as usize;
    long.arrival = Arrival::Poisson { rate: a.rate };
    long.prompts = PromptSource::Generated { tokens: a.prompt_tokens };
    long.max_tokens = 1;
    long.seed = a.seed.wrapping_add(1);
    long.timeout = Duration::from_secs(120);
    let ((busy, long), steal_busy) =
        during(steal_ms, async { tokio::join!(decoders(a, &cluster.url, window), loadgen::run(&long)) }).await;
    let (busy, _) = busy?;
    let long = long?;
    // Every long prompt has ended (or failed): the host is as quiet as before.
    let (after, steal_after) = during(steal_ms, decoders(a, &cluster.url, window)).await;
    let (after, _) = after?;
    keep_records(a, name, "idle", &idle)?;
    keep_records(a, name, "busy", &busy)?;
    keep_records(a, name, "long", &long)?;
    keep_records(a, name, "idle-after", &after)?;
    if let (Some(dir), Launch::Tandem(_)) = (&a.records, launch) {
        keep_metrics(dir, name).await?;
    }
    let (before, busy, after) = (Window::of(&idle, window), Window::of(&busy, window), Window::of(&after, window));
    let mut ttft: Vec<f64> =
        long.records.iter().filter(|r| r.outcome.is_complete()).map(|r| r.e2e.as_secs_f64()).collect();
    ttft.sort_by(f64::total_cmp);
    cluster.stop().await?;
    Ok(Figures {
        idle_before_tok_s: before.tok_s,
        idle_after_tok_s: after.tok_s,
        busy_tok_s: busy.tok_s,
        idle_itl_p99_ms: p99_ms(&[&before, &after]),
        worst_gap_ms: busy.worst_ms(),
        idle_worst_gap_ms: before.worst_ms().max(after.worst_ms()),
        steal_ms: [steal_idle, steal_busy, steal_after],
        long_done: ttft.len(),
        long_sent: long.records.len(),
        long_ttft_p50_s: loadgen::percentile(&ttft, 0.5).unwrap_or(f64::NAN),
        long_ttft_max_s: ttft.last().copied().unwrap_or(f64::NAN),
    })
}

#[cfg(test)]
mod tests {
    use super::steal_ms_of;

    #[test]
    fn steal_is_the_eighth_field_of_the_cpu_line_in_ms() {
        let stat = "cpu  1555370 49789 105981 597896 3059 0 2160 22419 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n";
        assert_eq!(steal_ms_of(stat), Some(224_190.0));
        assert_eq!(steal_ms_of("cpu  1 2 3\n"), None, "a kernel without the column");
        assert_eq!(steal_ms_of("intr 1 2\n"), None);
    }
}
