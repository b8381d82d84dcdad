//! `tandem up`: a whole local cluster as child processes — prefill
//! workers, decode workers and a coordinator serving the OpenAI API — with
//! one command, supervised, and a clean stop on Ctrl-C/SIGTERM. The
//! coordinator also serves the gRPC frontend (`--grpc`).
//!
//! Unless `--etcd URL` is given, an etcd is started on free loopback ports:
//! one member, or `--etcd-members` (3, 5, 7) of them, each its own process,
//! data dir (under the log directory, or `--etcd-data-dir`) and log. Children are
//! started on loopback ports they pick (they print `listening NAME=ADDR [NAME=ADDR ...]`),
//! register in etcd under a prefix unique to this run with their component name as worker id,
//! prefill and decode workers share one version group and move KV over shared memory
//! (`local`), and the coordinator routes from etcd membership. The host's CPUs are split
//! between the roles unless CPUs are given or `--share-cpus` ([`placement`]). With
//! `--hosts N` the workers run in N network namespaces on a bridge ([`hosts`]), KV over tcp.
//! Each child's stdout and stderr
//! go to its own file in the log directory (`--log-dir`; kept after the stop). Once `/ready`
//! answers, the state file is written and a table printed.
//!
//! From then on every process is supervised ([`supervise()`]): one that exits on its own is
//! started again after a capped exponential backoff (`--restart`, default `on-failure`) on the
//! same addresses, its log appended after a separator line, and one line printed per exit and
//! restart; one that exits `--give-up-after` times within a minute is left down, loudly, while
//! the rest keep serving. A signal stops the coordinator first, then the decode workers, then
//! the prefill workers, each with SIGTERM and its drain grace, then SIGKILL for anything left,
//! then etcd. No process is left behind.
//!
//! The state file (`--state-file`, removed on stop, rewritten on every exit and restart) is
//! `{"restart": POLICY, "components": [...]}`, one object per process: `role` (etcd | prefill
//! | decode | coordinator), `name`, `pid`, the addresses it listens on (`grpc`, `http`,
//! `metrics`, `transfer`, as it has them), `log` (the file its output goes to), `state`
//! (running | restarting | exited | given_up), `restarts`, `last_exit` and, for workers,
//! `version_group` and `lease_ttl_s` (its etcd lease TTL), `netns` with `--hosts`, and
//! `actions`: the command templates drills act on it through. `tandem drill --against`
//! and `tandem chaos --against` read it.

pub(crate) mod child;
mod etcd;
mod hosts;
mod per_decode;
mod placement;
mod state;
mod supervise;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use facts::cpus::CpuList;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

pub(crate) use child::http_get;
use child::{get_status, sibling, start, stop_all, Ready, Running, Spec, START_TIMEOUT};
use facts::argv::WorkerArgv;
use facts::state::{flag, Component, Role, State};
use per_decode::{decode_leases, decode_policies};
use state::print_table;
use supervise::{supervise, Policy, Rules};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// GGUF model file (default: the cached SmolLM2 file).
    #[arg(long)]
    model: Option<PathBuf>,
    /// An etcd to register in (`http://host:port`, comma-separated for several
    /// members); default: start one on free loopback ports with a temporary data dir.
    #[arg(long)]
    etcd: Option<String>,
    /// Members of the etcd `tandem up` starts (1, 3, 5 or 7; each its own process,
    /// ports, data dir and log, named `etcd-0`, `etcd-1`, ... beyond one): with 3, one
    /// member's loss (the leader's included) leaves a quorum, two members' loses it — what
    /// etcd drills act on. Every worker and coordinator is given every member.
    #[arg(long, default_value_t = 1, conflicts_with = "etcd")]
    etcd_members: usize,
    /// The coordinator's HTTP address.
    #[arg(long, default_value = "127.0.0.1:8000")]
    http: SocketAddr,
    /// The coordinator's gRPC address (`tandem.frontend.v1.Frontend`, health, reflection).
    #[arg(long, default_value = "127.0.0.1:50051")]
    grpc: SocketAddr,
    /// Coordinators, each on the same etcd membership with its own log: the first on --http
    /// and --grpc, the others on free loopback ports (named `coordinator-1`, ... in the state
    /// file). Clients spread over them, and fail over, through a load balancer of their own
    /// (drills against the cluster bring theirs).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=8))]
    coordinators: u64,
    /// Prefill workers.
    #[arg(long, default_value_t = 1)]
    prefill: usize,
    /// Decode workers.
    #[arg(long, default_value_t = 1)]
    decode: usize,
    /// Compute threads per worker (default: one per CPU its role is pinned
    /// to, else one per core).
    #[arg(long)]
    threads: Option<usize>,
    /// Compute threads per prefill worker (default: --threads).
    #[arg(long)]
    prefill_threads: Option<usize>,
    /// Compute threads per decode worker (default: --threads).
    #[arg(long)]
    decode_threads: Option<usize>,
    /// Nice level of the prefill workers (-20..19; each worker's --nice). Where
    /// they share CPUs with decode workers (--share-cpus) a prefill worker
    /// niced above them gives way to decode steps; on its own CPUs it still
    /// gives way to the coordinator and etcd. README's "Sharing cores" says
    /// how to measure the curve.
    #[arg(long, allow_negative_numbers = true, default_value_t = DEFAULT_PREFILL_NICE)]
    prefill_nice: i32,
    /// Nice level of the decode workers (each worker's --nice).
    #[arg(long, allow_negative_numbers = true, default_value_t = 0)]
    decode_nice: i32,
    /// Pin the prefill workers to these CPUs (`0-3,6`; each worker's --cpus).
    /// Default, when neither role's CPUs are given: the first half of the
    /// CPUs this process may use (the decode workers get the rest), unless
    /// --share-cpus, one CPU, or no prefill worker. Given for one role only,
    /// the other stays unpinned.
    #[arg(long)]
    prefill_cpus: Option<String>,
    /// Pin the decode workers to these CPUs. Default: the CPUs the prefill
    /// workers do not get (see --prefill-cpus).
    #[arg(long)]
    decode_cpus: Option<String>,
    /// Run both roles on every CPU, the prefill workers niced (the old
    /// default), instead of splitting the CPUs between them. Measured worse
    /// on two cores: the decode streams keep every core busy and the niced
    /// prefill starves.
    #[arg(long, conflicts_with_all = ["prefill_cpus", "decode_cpus"])]
    share_cpus: bool,
    /// KV transport between the workers: local (shared memory) | tcp | quic | ucx (one-sided puts; UCX_TLS picks
    /// shared memory, TCP or RDMA). Default: local; tcp with --hosts (shared memory does not cross hosts).
    #[arg(long)]
    kv_transport: Option<String>,
    /// Run the workers on N hosts: network namespaces behind veths and a bridge, so their KV,
    /// control and etcd traffic crosses real interfaces (link faults act there); workers are
    /// placed round robin. Needs root. etcd stays in this namespace, and the coordinators too
    /// unless --coordinator-hosts.
    #[arg(long, value_name = "N", conflicts_with = "etcd")]
    hosts: Option<usize>,
    /// With --hosts: each coordinator on a host of its own too, a namespace beside the N
    /// worker hosts (a front-end node), so its etcd and control links cross the bridge and
    /// can be cut without cutting a worker's (the coordinator-etcd-cutoff drill). The first
    /// coordinator listens on its host's address at --http's and --grpc's ports.
    #[arg(long, requires = "hosts")]
    coordinator_hosts: bool,
    /// The decode workers' KV reservation lease, ms: how long a prefill worker has to deliver a
    /// request's KV before the load fails (and is handled per --kv-load-failure-policy).
    /// A comma-separated list gives one per decode worker, as --kv-load-failure-policy does.
    #[arg(long, default_value = "30000")]
    reservation_ttl_ms: String,
    /// The decode workers' kv_load_failure_policy: recompute | retry | fail; or a
    /// comma-separated list, one per decode worker in order (`recompute,retry`: decode-0
    /// recomputes, decode-1 retries), as a fleet trying a policy on part of it runs.
    #[arg(long, default_value = "recompute")]
    kv_load_failure_policy: String,
    /// The coordinator's tenants file (its --tenants: API keys, classes and
    /// limits per tenant; reloaded on SIGHUP to the coordinator). Default: none (one tenant).
    #[arg(long, value_name = "PATH")]
    tenants: Option<PathBuf>,
    /// The coordinator's --local-prefill-max-tokens: prompts of at most this many tokens are
    /// prefilled by the decode worker itself (recorded in the state file, where
    /// noisy-neighbour reads it). Default: the coordinator's (32).
    #[arg(long, value_name = "TOKENS")]
    local_prefill_max_tokens: Option<u32>,
    /// The coordinator's --prefix-affinity: how much a decode (or prefill)
    /// worker's cached share of the prompt counts against its load when
    /// routing; 0 routes by load alone. Default: the coordinator's.
    #[arg(long)]
    prefix_affinity: Option<f64>,
    /// The coordinator's --stream-idle-timeout-ms: a streamed answer whose client takes nothing
    /// for this long is ended (recorded in the state file, where the slow-reader drill reads
    /// it). Default: the coordinator's (30 s).
    #[arg(long, value_name = "MS")]
    stream_idle_timeout_ms: Option<u64>,
    /// The coordinator's --registry-max-stale-ms: how long it routes from its cached
    /// membership while etcd is unreachable before refusing (503 registry_unavailable);
    /// recorded in the state file, where the etcd-quorum-loss drill reads it. Default: the
    /// coordinator's (a minute).
    #[arg(long, value_name = "MS")]
    registry_max_stale_ms: Option<u64>,
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
    /// Our etcd's data dir, kept after the stop (default: `etcd-data` in the log directory,
    /// removed on stop). Ignored with --etcd.
    #[arg(long, value_name = "DIR")]
    etcd_data_dir: Option<PathBuf>,
    /// A Prometheus `file_sd_configs` file listing every process's /metrics target, written
    /// once the cluster is ready and again on every exit and restart, removed on stop.
    /// Default: `prometheus-targets.json` in the log directory.
    #[arg(long, value_name = "PATH")]
    prometheus_targets: Option<PathBuf>,
    /// What happens to a process that exits on its own: never (leave it down), on-failure
    /// (start it again unless it exited 0, as a drained worker does), always.
    #[arg(long, value_enum, default_value = "on-failure")]
    restart: Policy,
    /// The first wait before a restart, ms; it doubles with each exit up to
    /// --restart-backoff-max-ms, and starts over after a process ran a minute.
    #[arg(long, default_value_t = 1_000)]
    restart_backoff_ms: u64,
    /// The longest wait before a restart, ms.
    #[arg(long, default_value_t = 30_000)]
    restart_backoff_max_ms: u64,
    /// A process that exits this many times within a minute is given up on: it stays down,
    /// reported, and the rest of the cluster keeps running.
    #[arg(long, default_value_t = 5)]
    give_up_after: usize,
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

pub fn run(a: Args) -> anyhow::Result<()> {
    if a.prefill == 0 && a.decode == 0 {
        bail!("nothing to start: --prefill and --decode are both 0");
    }
    if a.decode == 0 {
        bail!("--decode must be at least 1");
    }
    if a.give_up_after == 0 {
        bail!("--give-up-after must be at least 1");
    }
    etcd::check_members(a.etcd_members)?;
    decode_policies(&a.kv_load_failure_policy, a.decode)?;
    decode_leases(&a.reservation_ttl_ms, a.decode)?;
    // Whole, so a restart from another directory and the state file's readers find it.
    let mut a = a;
    if let Some(t) = &a.tenants {
        a.tenants = Some(std::fs::canonicalize(t).with_context(|| format!("--tenants {}", t.display()))?);
    }
    if a.restart_backoff_ms == 0 || a.restart_backoff_max_ms < a.restart_backoff_ms {
        bail!("--restart-backoff-ms must be above 0 and at most --restart-backoff-max-ms");
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(up(a))
}

/// Takes `logs/tandem-up.lock` (an exclusive `flock`, released when the process ends, even
/// by SIGKILL) and writes this process's pid in it; refuses when another `tandem up` holds it.
fn lock_log_dir(logs: &std::path::Path) -> anyhow::Result<std::fs::File> {
    use std::io::{Read, Seek, Write};
    let path = logs.join("tandem-up.lock");
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    if let Err(e) = f.try_lock() {
        let mut pid = String::new();
        let _ = f.read_to_string(&mut pid);
        bail!(
            "another tandem up (pid {}) runs with the log directory {} ({e}): stop it first, or give this one \
             another --state-file or --log-dir",
            pid.trim(),
            logs.display()
        );
    }
    f.set_len(0)?;
    f.rewind()?;
    write!(f, "{}", std::process::id())?;
    Ok(f)
}

/// A component started once, with what its supervisor needs to start it again.
struct Started {
    spec: Spec,
    component: Component,
    run: Running,
}

/// Stop order: no new requests first, etcd (which the others deregister from) last.
const STOP_ORDER: [Role; 4] = [Role::Coordinator, Role::Decode, Role::Prefill, Role::Etcd];

async fn up(a: Args) -> anyhow::Result<()> {
    // Installed before any child starts, so a signal from then on stops the cluster cleanly.
    let mut signals = registry::StopSignals::install().context("installing the SIGTERM/SIGINT handlers")?;
    let model = a.model.clone().unwrap_or_else(engine::paths::default_model_path);
    if !model.is_file() {
        bail!("model {} not found: run `make model` or pass --model", model.display());
    }
    let logs = log_dir(&a);
    std::fs::create_dir_all(&logs).with_context(|| format!("creating the log directory {}", logs.display()))?;
    // Held until this process exits: a second `tandem up` on the same directory (the same
    // --state-file) would share its etcd data dir, which the first one's stop removes.
    let _lock = lock_log_dir(&logs)?;
    println!("logs in {}", logs.display());
    let grace = Duration::from_millis(a.shutdown_timeout_ms);
    // Our own etcd's data dir: kept when the operator named it, else removed on stop.
    let etcd_data = a.etcd_data_dir.clone().unwrap_or_else(|| logs.join("etcd-data"));
    // Declared before the children: dropped (namespaces deleted) after they are stopped.
    let hosts = match a.hosts {
        Some(n) => {
            // The coordinators' hosts come after the workers' N.
            let fronts = if a.coordinator_hosts { a.coordinators as usize } else { 0 };
            let h = hosts::Hosts::create(n + fronts)?;
            let list = |hs: &[hosts::Host]| hs.iter().map(|h| format!("{} {}", h.netns, h.ip)).collect::<Vec<_>>();
            println!(
                "hosts: {} network namespaces on a bridge, gateway {} (workers: {}{})",
                h.hosts.len(),
                h.gateway,
                list(&h.hosts[..n]).join(", "),
                if fronts > 0 { format!("; coordinators: {}", list(&h.hosts[n..]).join(", ")) } else { String::new() }
            );
            Some(h)
        }
        None => None,
    };
    let mut started: Vec<Started> = Vec::new();
    let outcome = tokio::select! {
        r = start_cluster(&a, &model, &logs, &etcd_data, hosts.as_ref(), &mut started) => r,
        _ = signals.recv() => Err(anyhow::anyhow!("interrupted during start-up")),
    };
    if let Err(e) = outcome {
        let mut running: Vec<(Component, Running)> = started.into_iter().map(|s| (s.component, s.run)).collect();
        stop_all(&mut running, &STOP_ORDER, grace).await;
        remove_etcd_data(&a, &etcd_data);
        return Err(e);
    }

    let policy = a.restart;
    let mut components: Vec<Component> = started.iter().map(|s| s.component.clone()).collect();
    let targets = a.prometheus_targets.clone().unwrap_or_else(|| logs.join("prometheus-targets.json"));
    let write_state = |components: &[Component]| -> anyhow::Result<()> {
        state::write_targets(&targets, components)?;
        match &a.state_file {
            Some(path) => state::write(path, policy.as_str(), components),
            None => Ok(()),
        }
    };
    write_state(&components)?;
    print_table(&components);
    println!("prometheus targets in {}", targets.display());

    let rules = Rules {
        policy,
        backoff: Duration::from_millis(a.restart_backoff_ms),
        backoff_max: Duration::from_millis(a.restart_backoff_max_ms),
        healthy_after: Duration::from_secs(60),
        give_up_after: a.give_up_after,
        window: Duration::from_secs(60),
    };
    // Unbounded on purpose, and bounded in practice: a supervisor sends one line per
    // exit, restart or give-up of its process, at most one per backoff (>= 1 s by
    // default, give-up after --give-up-after exits a minute), and the loop below reads
    // it at once. A bounded channel could only make a supervisor wait on the printer.
    let (events_tx, mut events) = mpsc::unbounded_channel();
    let stop = CancellationToken::new();
    let supervisors: Vec<_> = started
        .into_iter()
        .enumerate()
        .map(|(i, s)| tokio::spawn(supervise(i, s.spec, s.component, s.run, rules, events_tx.clone(), stop.clone())))
        .collect();
    drop(events_tx);

    // Serve until a signal; report every exit and restart as it happens.
    let signal = loop {
        tokio::select! {
            s = signals.recv() => break s,
            Some(ev) = events.recv() => {
                let given_up = ev.component.state == State::GivenUp;
                eprintln!("{}", ev.line);
                if let Some(slot) = components.get_mut(ev.index) {
                    *slot = ev.component;
                }
                if let Err(e) = write_state(&components) {
                    eprintln!("tandem up: {e:#}");
                }
                if given_up && components.iter().all(|c| matches!(c.state, State::GivenUp | State::Exited)) {
                    eprintln!("tandem up: every component is down; still supervising until Ctrl-C");
                }
            }
        }
    };
    eprintln!("{signal}: stopping the cluster");
    stop.cancel();
    let mut running = Vec::new();
    for s in supervisors {
        if let Ok(Some(r)) = s.await {
            running.push(r);
        }
    }
    stop_all(&mut running, &STOP_ORDER, grace).await;
    remove_etcd_data(&a, &etcd_data);
    let _ = std::fs::remove_file(&targets);
    if let Some(path) = &a.state_file {
        let _ = std::fs::remove_file(path);
    }
    Ok(())
}

/// Our etcd's data dir goes with the cluster unless the operator named it.
fn remove_etcd_data(a: &Args, dir: &std::path::Path) {
    if a.etcd.is_none() && a.etcd_data_dir.is_none() {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// Starts etcd's members at once (each waits for the others to form the cluster) and waits
/// until every one answers `/health` (a leader elected). On an error every member started is
/// stopped (dropped) before it returns.
async fn start_etcd(members: Vec<etcd::Member>) -> anyhow::Result<Vec<Started>> {
    let mut tasks = tokio::task::JoinSet::new();
    for (i, m) in members.into_iter().enumerate() {
        tasks.spawn(async move {
            let mut c = Component::new(Role::Etcd, &m.name);
            c.grpc = Some(m.addr.clone());
            // etcd serves Prometheus /metrics on its client port.
            c.metrics = Some(m.addr.clone());
            let run = start(&m.spec, &mut c, None).await;
            (i, run.map(|run| Started { spec: m.spec, component: c, run }))
        });
    }
    let mut up = Vec::new();
    let mut failed = None;
    while let Some(joined) = tasks.join_next().await {
        let error = match joined {
            Ok((i, Ok(s))) => {
                up.push((i, s));
                continue;
            }
            Ok((_, Err(e))) => e,
            Err(e) if e.is_cancelled() => continue,
            Err(e) => anyhow::anyhow!("an etcd start task: {e}"),
        };
        // One member down at the start: the rest would wait out the start timeout for a
        // quorum. Stopped (their children dropped, so killed) and tried again on new ports.
        tasks.abort_all();
        failed = failed.or(Some(error));
    }
    if let Some(e) = failed {
        return Err(e);
    }
    up.sort_by_key(|(i, _)| *i);
    Ok(up.into_iter().map(|(_, s)| s).collect())
}

/// Starts etcd (unless `--etcd`), the prefill and decode workers and the coordinator, in that
/// order, each once it is listening, then waits for the coordinator's `/ready`. What started
/// is in `started`, also on error, for the caller to stop.
async fn start_cluster(
    a: &Args,
    model: &std::path::Path,
    logs: &std::path::Path,
    etcd_data: &std::path::Path,
    hosts: Option<&hosts::Hosts>,
    started: &mut Vec<Started>,
) -> anyhow::Result<()> {
    // Shared memory does not cross hosts: tcp by default there, and local refused.
    let kv_transport = match (a.kv_transport.as_deref(), hosts) {
        (Some("local"), Some(_)) => bail!(
            "--kv-transport local moves KV over shared memory, which does not cross --hosts: use tcp, quic or ucx"
        ),
        (Some(t), _) => t.to_owned(),
        (None, Some(_)) => "tcp".to_owned(),
        (None, None) => "local".to_owned(),
    };
    // What the workers bind: their host's address, else loopback; etcd is reached from a
    // host on the bridge's address.
    let etcd_ip = hosts.map_or(std::net::Ipv4Addr::LOCALHOST, |h| h.gateway);
    // Workers round robin over the first --hosts; the coordinators' own hosts follow them.
    let worker_hosts = a.hosts.unwrap_or(1);
    let mut next_host = 0;
    let mut place = || {
        let h = hosts.map(|h| h.host(next_host % worker_hosts).clone());
        next_host += 1;
        match h {
            Some(h) => (format!("{}:0", h.ip), Some(h.netns)),
            None => ("127.0.0.1:0".to_owned(), None),
        }
    };
    let endpoint = match &a.etcd {
        Some(url) => url.clone(),
        None => {
            // Data this run did not write stays; a named dir is the operator's (the default one
            // is ours: one left by an earlier run with the same log dir goes, as on stop). Members of a
            // cluster know each other by their peer ports, which each `tandem up` picks anew:
            // data from an earlier cluster of several members could never form a quorum again.
            remove_etcd_data(a, etcd_data);
            let fresh = std::fs::read_dir(etcd_data).map_or(true, |mut d| d.next().is_none());
            if a.etcd_members > 1 && !fresh {
                bail!(
                    "--etcd-data-dir {}: not empty; a cluster of {} etcd members starts on new ports \
                     every time, so it needs an empty data dir",
                    etcd_data.display(),
                    a.etcd_members
                );
            }
            let mut attempt = 0;
            // A port probed free can be taken before etcd binds it: try others a few times.
            loop {
                attempt += 1;
                let members = etcd::members(a.etcd_members, etcd_data, logs, etcd_ip)?;
                let endpoints = members.iter().map(|m| format!("http://{}", m.addr)).collect::<Vec<_>>().join(",");
                match start_etcd(members).await {
                    Ok(up) => {
                        started.extend(up);
                        break endpoints;
                    }
                    Err(e) if attempt < 5 => {
                        eprintln!("tandem up: etcd did not start ({e:#}); trying other ports");
                        if fresh {
                            let _ = std::fs::remove_dir_all(etcd_data);
                        }
                    }
                    Err(e) => return Err(e.context("starting etcd (is etcd-server installed? `make deps`)")),
                }
            }
        }
    };
    let prefix = format!("tandem-up-{}", std::process::id());
    let model_s = model.display().to_string();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let (prefill_cpus, decode_cpus) = role_cpus(a)?;
    // Per role: its flag, else --threads, else one per CPU of its set, else every core.
    let threads_of = |role: Option<usize>, cpus: &Option<CpuList>| {
        role.or(a.threads).unwrap_or_else(|| cpus.as_ref().map_or(cores, |c| c.cpus().len()))
    };
    let prefill_threads = threads_of(a.prefill_threads, &prefill_cpus);
    let decode_threads = threads_of(a.decode_threads, &decode_cpus);
    let shown = |cpus: &Option<CpuList>| cpus.as_ref().map_or("every CPU".to_owned(), ToString::to_string);
    println!(
        "placement: prefill on {} ({prefill_threads} threads, nice {}), decode on {} ({decode_threads} threads, nice {})",
        shown(&prefill_cpus),
        a.prefill_nice,
        shown(&decode_cpus),
        a.decode_nice
    );
    let group = "local";
    let shared = Shared {
        model: &model_s,
        group,
        grace_ms: a.shutdown_timeout_ms,
        etcd: &endpoint,
        prefix: &prefix,
        ttl_s: a.lease_ttl_s,
    };
    for i in 0..a.prefill {
        let name = format!("prefill-{i}");
        let argv = shared.worker(WorkerArgv::prefill(), &name, prefill_threads, a.prefill_nice, prefill_cpus.as_ref());
        let (addr, netns) = place();
        let spec = Spec {
            bin: sibling(argv.binary())?,
            args: argv.build(),
            addrs: vec![("--grpc", "grpc", addr.clone()), ("--metrics", "metrics", addr)],
            ready: Ready::Listening(vec!["grpc", "metrics"]),
            log: logs.join(format!("{name}.log")),
            netns,
        };
        started.push(start_worker(spec, worker_component(a, Role::Prefill, name, group)).await?);
    }
    let policies = decode_policies(&a.kv_load_failure_policy, a.decode)?;
    let leases = decode_leases(&a.reservation_ttl_ms, a.decode)?;
    for (i, (policy, &lease_ms)) in policies.iter().zip(&leases).enumerate() {
        let name = format!("decode-{i}");
        let (addr, netns) = place();
        let transfer = match kv_transport.as_str() {
            "local" => format!("@tandem-up-{}-{i}", std::process::id()),
            _ => addr.clone(),
        };
        let argv = shared
            .worker(WorkerArgv::decode(), &name, decode_threads, a.decode_nice, decode_cpus.as_ref())
            .kv_transport(&kv_transport)
            .kv_load_failure_policy(policy)
            .reservation_ttl_ms(lease_ms);
        let spec = Spec {
            bin: sibling(argv.binary())?,
            args: argv.build(),
            addrs: vec![
                ("--grpc", "grpc", addr.clone()),
                ("--metrics", "metrics", addr),
                ("--transfer", "transfer", transfer),
            ],
            ready: Ready::Listening(vec!["grpc", "metrics", "transfer"]),
            log: logs.join(format!("{name}.log")),
            netns,
        };
        let mut c = worker_component(a, Role::Decode, name, group);
        c.reservation_ttl_ms = Some(lease_ms);
        c.flags.insert(flag::KV_LOAD_FAILURE_POLICY.into(), policy.clone());
        c.flags.insert(flag::KV_TRANSPORT.into(), kv_transport.clone());
        started.push(start_worker(spec, c).await?);
    }
    let grace = a.shutdown_timeout_ms.to_string();
    let strings = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<String>>();
    let mut args = strings(&[
        "--model",
        &model_s,
        "--etcd",
        &endpoint,
        "--cluster-prefix",
        &prefix,
        "--shutdown-timeout-ms",
        &grace,
    ]);
    if let Some(t) = &a.tenants {
        args.extend(["--tenants".to_owned(), t.display().to_string()]);
    }
    if let Some(x) = a.prefix_affinity {
        args.extend(["--prefix-affinity".to_owned(), x.to_string()]);
    }
    if let Some(n) = a.local_prefill_max_tokens {
        args.extend(["--local-prefill-max-tokens".to_owned(), n.to_string()]);
    }
    if let Some(ms) = a.stream_idle_timeout_ms {
        args.extend(["--stream-idle-timeout-ms".to_owned(), ms.to_string()]);
    }
    if let Some(ms) = a.registry_max_stale_ms {
        args.extend(["--registry-max-stale-ms".to_owned(), ms.to_string()]);
    }
    let mut https = Vec::new();
    for i in 0..a.coordinators {
        // The first keeps the names and addresses a single coordinator always had.
        // On a host of its own (--coordinator-hosts), at that host's address.
        let host = hosts.filter(|_| a.coordinator_hosts).map(|h| h.host(worker_hosts + i as usize).clone());
        let ip = host.as_ref().map_or(std::net::Ipv4Addr::LOCALHOST, |h| h.ip);
        let (name, http, grpc) = match i {
            0 => match &host {
                Some(h) => (
                    "coordinator".to_owned(),
                    format!("{}:{}", h.ip, a.http.port()),
                    format!("{}:{}", h.ip, a.grpc.port()),
                ),
                None => ("coordinator".to_owned(), a.http.to_string(), a.grpc.to_string()),
            },
            _ => (format!("coordinator-{i}"), format!("{ip}:0"), format!("{ip}:0")),
        };
        let spec = Spec {
            bin: sibling("tandem-coordinator")?,
            args: args.clone(),
            addrs: vec![("--http", "http", http), ("--grpc", "grpc", grpc)],
            ready: Ready::Listening(vec!["http", "grpc"]),
            log: logs.join(format!("{name}.log")),
            netns: host.map(|h| h.netns),
        };
        let mut c = Component::new(Role::Coordinator, name);
        c.flags.insert(flag::SHUTDOWN_TIMEOUT_MS.into(), grace.clone());
        if let Some(ms) = a.stream_idle_timeout_ms {
            c.flags.insert(flag::STREAM_IDLE_TIMEOUT_MS.into(), ms.to_string());
        }
        if let Some(ms) = a.registry_max_stale_ms {
            c.flags.insert(flag::REGISTRY_MAX_STALE_MS.into(), ms.to_string());
        }
        if let Some(t) = &a.tenants {
            c.flags.insert(flag::TENANTS.into(), t.display().to_string());
        }
        if let Some(n) = a.local_prefill_max_tokens {
            c.flags.insert(flag::LOCAL_PREFILL_MAX_TOKENS.into(), n.to_string());
        }
        let run = start(&spec, &mut c, None).await?;
        let http = c.http.clone().context("no coordinator address")?;
        // The coordinator serves Prometheus on its HTTP port, path /metrics.
        c.metrics = Some(http.clone());
        https.push(http);
        started.push(Started { spec, component: c, run });
    }
    // Ready: etcd reachable and a ready prefill/decode pair, or with --prefill 0 a ready decode
    // worker (each coordinator's /ready).
    let until = tokio::time::Instant::now() + START_TIMEOUT;
    for http in https {
        loop {
            let h = http.clone();
            if tokio::task::spawn_blocking(move || get_status(&h, "/ready")).await? == Some(200) {
                break;
            }
            if tokio::time::Instant::now() > until {
                bail!("the cluster was not ready within {START_TIMEOUT:?} (coordinator at {http})");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    Ok(())
}

/// What every worker of the cluster is started with.
struct Shared<'a> {
    model: &'a str,
    group: &'a str,
    grace_ms: u64,
    etcd: &'a str,
    prefix: &'a str,
    ttl_s: u64,
}

impl Shared<'_> {
    /// A worker's flags but its addresses (a restart passes the ones it printed).
    fn worker<R>(
        &self,
        argv: WorkerArgv<R>,
        name: &str,
        threads: usize,
        nice: i32,
        cpus: Option<&CpuList>,
    ) -> WorkerArgv<R> {
        let argv = argv
            .model(self.model)
            .version_group(self.group)
            .threads(threads)
            .shutdown_timeout_ms(self.grace_ms)
            .etcd(self.etcd)
            .cluster_prefix(self.prefix)
            .lease_ttl_s(self.ttl_s)
            .worker_id(name)
            .nice(nice);
        match cpus {
            Some(c) => argv.cpus(c),
            None => argv,
        }
    }
}

/// A worker's state-file entry before it starts: what every worker records.
fn worker_component(a: &Args, role: Role, name: String, group: &str) -> Component {
    let mut c = Component::new(role, name);
    c.version_group = Some(group.to_owned());
    c.lease_ttl_s = Some(a.lease_ttl_s);
    c.flags.insert(flag::SHUTDOWN_TIMEOUT_MS.into(), a.shutdown_timeout_ms.to_string());
    c
}

async fn start_worker(spec: Spec, mut c: Component) -> anyhow::Result<Started> {
    let run = start(&spec, &mut c, None).await?;
    Ok(Started { spec, component: c, run })
}

/// `tandem up --prefill-nice`'s default: 19, the lowest priority: on its own
/// CPUs (the default split) the prefill worker lets the coordinator, etcd and
/// the tokenizer threads in at once; with --share-cpus it gives way to decode
/// steps, where it measured best of 0, 10 and 19 (README, "Sharing cores").
const DEFAULT_PREFILL_NICE: i32 = 19;

/// Each role's CPUs: as given, else the default split (see [`placement`]).
fn role_cpus(a: &Args) -> anyhow::Result<(Option<CpuList>, Option<CpuList>)> {
    let given = |flag: &str, s: &Option<String>| {
        s.as_deref().map(|t| CpuList::parse(t).map_err(|e| anyhow::anyhow!("{flag} {t:?}: {e}"))).transpose()
    };
    let (p, d) = (given("--prefill-cpus", &a.prefill_cpus)?, given("--decode-cpus", &a.decode_cpus)?);
    if p.is_some() || d.is_some() || a.share_cpus || a.prefill == 0 {
        return Ok((p, d));
    }
    Ok(placement::split(&placement::allowed()?).map_or((None, None), |(p, d)| (Some(p), Some(d))))
}
