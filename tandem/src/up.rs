//! `tandem up`: a whole local cluster as child processes — prefill
//! workers, decode workers and a coordinator serving the OpenAI API — with
//! one command, and a clean stop on Ctrl-C/SIGTERM. The coordinator also
//! serves the gRPC frontend (`--grpc`).
//!
//! Unless `--etcd URL` is given, a single-member etcd is started on free
//! loopback ports (temporary data dir). Children are started on loopback
//! ports they pick (they print `listening NAME=ADDR [NAME=ADDR ...]`),
//! register in etcd under a prefix unique to this run, prefill and decode workers share one
//! version group and move KV over shared memory (`local`), and the
//! coordinator routes from etcd membership. Each child's stdout and stderr go to its own file
//! in the log directory (`--log-dir`; kept after the stop). Once `/ready` answers, the state
//! file is written and a table printed. A child that exits on its own stops the whole cluster
//! (exit status non-zero, the end of its log in the error); a signal stops the coordinator
//! first, then the decode workers, then the prefill workers, each with SIGTERM and its drain
//! grace, then SIGKILL for anything left, then etcd. No process is left behind.
//!
//! The state file (`--state-file`, removed on stop) is `{"components": [...]}`, one object per
//! process: `role` (etcd | prefill | decode | coordinator), `pid`, the addresses it listens
//! on (`grpc`, `http`, `metrics`, `transfer`, as it has them), `log` (the file its output goes
//! to; etcd's is inside its temporary data dir) and, for workers, `version_group` and
//! `lease_ttl_s` (its etcd lease TTL). `tandem drill --against` reads it.

use std::fs::File;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::Serialize;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// GGUF model file (default: the cached SmolLM2 file).
    #[arg(long)]
    model: Option<PathBuf>,
    /// An etcd to register in (`http://host:port`); default: start a
    /// single-member etcd on free loopback ports with a temporary data dir.
    #[arg(long)]
    etcd: Option<String>,
    /// The coordinator's HTTP address.
    #[arg(long, default_value = "127.0.0.1:8000")]
    http: SocketAddr,
    /// The coordinator's gRPC address (`tandem.frontend.v1.Frontend`, health, reflection).
    #[arg(long, default_value = "127.0.0.1:50051")]
    grpc: SocketAddr,
    /// Prefill workers.
    #[arg(long, default_value_t = 1)]
    prefill: usize,
    /// Decode workers.
    #[arg(long, default_value_t = 1)]
    decode: usize,
    /// Compute threads per worker (default: every core, for each worker: on
    /// one host the prefill and decode workers seldom peak together, and an
    /// even split left the prefill worker, the bottleneck, half the machine).
    #[arg(long)]
    threads: Option<usize>,
    /// Compute threads per prefill worker (default: --threads).
    #[arg(long)]
    prefill_threads: Option<usize>,
    /// Compute threads per decode worker (default: --threads).
    #[arg(long)]
    decode_threads: Option<usize>,
    /// KV transport between the workers: local (shared memory) | tcp | quic.
    #[arg(long, default_value = "local")]
    kv_transport: String,
    /// The decode workers' kv_load_failure_policy: recompute | retry | fail.
    #[arg(long, default_value = "recompute")]
    kv_load_failure_policy: String,
    /// Write the cluster's components as JSON here once it is ready.
    #[arg(long)]
    state_file: Option<PathBuf>,
    /// Drain grace per component on stop, ms.
    #[arg(long, default_value_t = 10_000)]
    shutdown_timeout_ms: u64,
    /// The workers' etcd lease TTL, whole seconds: how long a dead or stopped worker stays in
    /// membership (recorded in the state file).
    #[arg(long, env = "TANDEM_LEASE_TTL_S", default_value_t = 5)]
    lease_ttl_s: u64,
    /// Where each process's stdout and stderr go, one file each (`prefill-0.log`,
    /// `decode-0.log`, `coordinator.log`), kept after the stop. Default: `STATEFILE.logs`
    /// next to `--state-file`, else `$TMPDIR/tandem-up-PID`.
    #[arg(long, value_name = "DIR")]
    log_dir: Option<PathBuf>,
}

/// One component, as written to the state file (a field only where the component has it).
#[derive(Debug, Clone, Serialize)]
struct Component {
    role: &'static str,
    pid: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    grpc: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    http: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    metrics: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    transfer: Option<String>,
    /// Prefill and decode workers: the version group they registered in.
    #[serde(skip_serializing_if = "Option::is_none")]
    version_group: Option<String>,
    /// Prefill and decode workers: their etcd lease TTL, whole seconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    lease_ttl_s: Option<u64>,
    /// The file its stdout and stderr go to.
    #[serde(skip_serializing_if = "Option::is_none")]
    log: Option<PathBuf>,
}

impl Component {
    fn new(role: &'static str, pid: u32) -> Self {
        Self {
            role,
            pid,
            grpc: None,
            http: None,
            metrics: None,
            transfer: None,
            version_group: None,
            lease_ttl_s: None,
            log: None,
        }
    }
}

struct Running {
    component: Component,
    child: Child,
}

/// Waits for a component's start-up lines.
const START_TIMEOUT: Duration = Duration::from_secs(180);

fn sibling(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("locating the tandem binary")?;
    let path = exe.parent().map(|d| d.join(name)).context("the tandem binary has no directory")?;
    if !path.is_file() {
        bail!("{} not found next to tandem: build with `cargo build --release --workspace --bins`", path.display());
    }
    Ok(path)
}

/// The log directory: `--log-dir`, else next to the state file, else a temporary one.
fn log_dir(a: &Args) -> PathBuf {
    match (&a.log_dir, &a.state_file) {
        (Some(dir), _) => dir.clone(),
        (None, Some(state)) => {
            let mut name = state.as_os_str().to_owned();
            name.push(".logs");
            PathBuf::from(name)
        }
        (None, None) => std::env::temp_dir().join(format!("tandem-up-{}", std::process::id())),
    }
}

/// The last lines of a log, for an error saying why a child failed.
fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

/// Starts `bin` with its stderr, and its stdout once read here, appended to `log` (emptied
/// first); returns once it printed a `listening` address for each of `wants`.
async fn spawn(role: &'static str, bin: &Path, args: &[String], wants: &[&str], log: &Path) -> anyhow::Result<Running> {
    let opened = || File::options().create(true).append(true).open(log);
    // Emptied first: a log left by an earlier run with the same --log-dir is not this one's.
    File::create(log).with_context(|| format!("creating {}", log.display()))?;
    let err = opened().with_context(|| format!("opening {}", log.display()))?;
    let mut copy = opened().with_context(|| format!("opening {}", log.display()))?;
    let mut child = Command::new(bin)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::from(err))
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let pid = child.id().context("the child has no pid")?;
    let mut c = Component::new(role, pid);
    c.log = Some(log.to_owned());
    let out = child.stdout.take().context("no stdout pipe")?;
    let mut lines = BufReader::new(out).lines();
    let read = async {
        while wants.iter().any(|w| match *w {
            "grpc" => c.grpc.is_none(),
            "http" => c.http.is_none(),
            "metrics" => c.metrics.is_none(),
            _ => c.transfer.is_none(),
        }) {
            let Some(line) = lines.next_line().await? else {
                bail!("{role} (pid {pid}) exited before it was listening; {}:\n{}", log.display(), log_tail(log));
            };
            let _ = writeln!(copy, "{line}");
            // `listening NAME=ADDR [NAME=ADDR ...]`
            let Some(pairs) = line.strip_prefix("listening ") else { continue };
            for (k, v) in pairs.split_whitespace().filter_map(|p| p.split_once('=')) {
                let slot = match k {
                    "grpc" => &mut c.grpc,
                    "http" => &mut c.http,
                    "metrics" => &mut c.metrics,
                    "transfer" => &mut c.transfer,
                    _ => continue,
                };
                *slot = Some(v.to_owned());
            }
        }
        Ok(())
    };
    tokio::time::timeout(START_TIMEOUT, read).await.map_err(|_| {
        anyhow::anyhow!("{role} (pid {pid}) did not start within {START_TIMEOUT:?}; see {}", log.display())
    })??;
    // Keep copying its stdout into its log, so it never blocks on a full pipe.
    tokio::spawn(async move {
        while let Ok(Some(line)) = lines.next_line().await {
            let _ = writeln!(copy, "{line}");
        }
    });
    Ok(Running { component: c, child })
}

/// GET `path` on `addr`; the status code.
fn get_status(addr: &str, path: &str) -> Option<u16> {
    let sa: SocketAddr = addr.parse().ok()?;
    let mut s = TcpStream::connect_timeout(&sa, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    buf.split(' ').nth(1)?.parse().ok()
}

pub fn run(a: Args) -> anyhow::Result<()> {
    if a.prefill == 0 && a.decode == 0 {
        bail!("nothing to start: --prefill and --decode are both 0");
    }
    if a.decode == 0 {
        bail!("--decode must be at least 1");
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(up(a))
}

async fn up(a: Args) -> anyhow::Result<()> {
    // Installed before any child starts, so a signal from then on stops the cluster cleanly.
    let mut signals = registry::StopSignals::install().context("installing the SIGTERM/SIGINT handlers")?;
    let model = a.model.clone().unwrap_or_else(engine::paths::default_model_path);
    if !model.is_file() {
        bail!("model {} not found: run `make model` or pass --model", model.display());
    }
    // Our own etcd lives as long as this function: dropping it kills it and
    // removes its data dir, after every worker has deregistered.
    let (own_etcd, endpoint) = match &a.etcd {
        Some(url) => (None, url.clone()),
        None => {
            let e = registry::testing::Etcd::start()
                .await
                .context("starting etcd (is etcd-server installed? `make deps`)")?;
            let ep = e.endpoint();
            (Some(e), ep)
        }
    };
    let prefix = format!("tandem-up-{}", std::process::id());
    let model_s = model.display().to_string();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = a.threads.unwrap_or(cores);
    let prefill_threads = a.prefill_threads.unwrap_or(threads).to_string();
    let decode_threads = a.decode_threads.unwrap_or(threads).to_string();
    let grace = a.shutdown_timeout_ms.to_string();
    let group = "local";
    let lease_ttl_s = a.lease_ttl_s.to_string();
    let logs = log_dir(&a);
    std::fs::create_dir_all(&logs).with_context(|| format!("creating the log directory {}", logs.display()))?;
    println!("logs in {}", logs.display());
    let mut running: Vec<Running> = Vec::new();
    let started = async {
        let common = |threads: &str, extra: &[&str]| -> Vec<String> {
            let mut v: Vec<String> = [
                "--model",
                &model_s,
                "--version-group",
                group,
                "--threads",
                threads,
                "--shutdown-timeout-ms",
                &grace,
                "--etcd",
                &endpoint,
                "--cluster-prefix",
                &prefix,
                "--lease-ttl-s",
                &lease_ttl_s,
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            v.extend(extra.iter().map(|s| s.to_string()));
            v
        };
        let worker = |mut r: Running| {
            r.component.version_group = Some(group.to_owned());
            r.component.lease_ttl_s = Some(a.lease_ttl_s);
            r
        };
        let pbin = sibling("tandem-prefill-worker")?;
        for i in 0..a.prefill {
            let log = logs.join(format!("prefill-{i}.log"));
            running.push(worker(
                spawn("prefill", &pbin, &common(&prefill_threads, &[]), &["grpc", "metrics"], &log).await?,
            ));
        }
        let dbin = sibling("tandem-decode-worker")?;
        for i in 0..a.decode {
            let transfer = match a.kv_transport.as_str() {
                "local" => format!("@tandem-up-{}-{i}", std::process::id()),
                _ => "127.0.0.1:0".to_owned(),
            };
            let extra = [
                "--kv-transport",
                &a.kv_transport,
                "--transfer",
                &transfer,
                "--kv-load-failure-policy",
                &a.kv_load_failure_policy,
            ];
            let log = logs.join(format!("decode-{i}.log"));
            running.push(worker(
                spawn("decode", &dbin, &common(&decode_threads, &extra), &["grpc", "metrics", "transfer"], &log)
                    .await?,
            ));
        }
        let cargs: Vec<String> = [
            "--http",
            &a.http.to_string(),
            "--grpc",
            &a.grpc.to_string(),
            "--model",
            &model_s,
            "--etcd",
            &endpoint,
            "--cluster-prefix",
            &prefix,
            "--shutdown-timeout-ms",
            &grace,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let cbin = sibling("tandem-coordinator")?;
        running.push(spawn("coordinator", &cbin, &cargs, &["http", "grpc"], &logs.join("coordinator.log")).await?);
        let http = running.last().and_then(|r| r.component.http.clone()).context("no coordinator address")?;
        // The coordinator serves Prometheus on its HTTP port, path /metrics.
        if let Some(c) = running.last_mut() {
            c.component.metrics = Some(http.clone());
        }
        // Ready: etcd reachable and a ready prefill/decode pair (its /ready).
        let until = Instant::now() + START_TIMEOUT;
        loop {
            let h = http.clone();
            if tokio::task::spawn_blocking(move || get_status(&h, "/ready")).await? == Some(200) {
                break;
            }
            if Instant::now() > until {
                bail!("the cluster was not ready within {START_TIMEOUT:?}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        anyhow::Ok(())
    };
    let outcome = tokio::select! {
        r = started => r,
        _ = signals.recv() => Err(anyhow::anyhow!("interrupted during start-up")),
    };
    if let Err(e) = outcome {
        stop_all(&mut running, Duration::from_millis(a.shutdown_timeout_ms)).await;
        return Err(e);
    }

    let mut components: Vec<Component> = Vec::new();
    if let Some(e) = &own_etcd {
        let grpc = e.endpoint().trim_start_matches("http://").to_owned();
        let mut c = Component::new("etcd", e.pid().unwrap_or(0));
        c.grpc = Some(grpc);
        c.log = Some(e.log_path());
        components.push(c);
    }
    components.extend(running.iter().map(|r| r.component.clone()));
    if let Some(path) = &a.state_file {
        let json = serde_json::to_string_pretty(&serde_json::json!({ "components": components }))?;
        std::fs::write(path, json).with_context(|| format!("writing {}", path.display()))?;
    }
    print_table(&components);

    // Serve until a signal, or until a child dies on its own.
    let died = async {
        loop {
            for r in running.iter_mut() {
                if let Ok(Some(status)) = r.child.try_wait() {
                    return (r.component.role, r.component.pid, status, r.component.log.clone().unwrap_or_default());
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    let result = tokio::select! {
        (role, pid, status, log) = died => Err(anyhow::anyhow!(
            "{role} (pid {pid}) exited on its own ({status}); stopping the cluster; {}:\n{}",
            log.display(),
            log_tail(&log)
        )),
        s = signals.recv() => { eprintln!("{s}: stopping the cluster"); Ok(()) }
    };
    stop_all(&mut running, Duration::from_millis(a.shutdown_timeout_ms)).await;
    drop(own_etcd);
    if let Some(path) = &a.state_file {
        let _ = std::fs::remove_file(path);
    }
    result
}

/// Coordinator first (no new requests), then decode, then prefill workers:
/// SIGTERM, wait up to the grace (plus a margin), then SIGKILL.
async fn stop_all(running: &mut [Running], grace: Duration) {
    for role in ["coordinator", "decode", "prefill"] {
        let group: Vec<&mut Running> = running.iter_mut().filter(|r| r.component.role == role).collect();
        for r in &group {
            let _ = std::process::Command::new("kill").args(["-TERM", &r.component.pid.to_string()]).status();
        }
        for r in group {
            match tokio::time::timeout(grace + Duration::from_secs(5), r.child.wait()).await {
                Ok(Ok(status)) if !status.success() => {
                    eprintln!("{} (pid {}) exited with {status}", r.component.role, r.component.pid)
                }
                Ok(_) => {}
                Err(_) => {
                    eprintln!(
                        "{} (pid {}) did not stop within the grace; killing it",
                        r.component.role, r.component.pid
                    );
                    let _ = r.child.kill().await;
                }
            }
        }
    }
}

fn print_table(components: &[Component]) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{:<12} {:>8}  {:<22} {:<22} {:<22} transfer", "role", "pid", "grpc", "http", "metrics");
    for c in components {
        let f = |o: &Option<String>| o.clone().unwrap_or_else(|| "-".into());
        let _ = writeln!(
            out,
            "{:<12} {:>8}  {:<22} {:<22} {:<22} {}",
            c.role,
            c.pid,
            f(&c.grpc),
            f(&c.http),
            f(&c.metrics),
            f(&c.transfer)
        );
    }
    let _ = out.flush();
}
