//! `tandem sim`: many simulated workers in one process, for measuring the control
//! plane at fleet sizes this machine cannot run real engines for. Each simulated worker
//! registers in etcd under its own lease through the registry crate, exactly as a real
//! worker does (its own keeper task and etcd connection), and serves the worker gRPC API
//! on its own loopback port ([`worker`]): `Health` with load, the real prefix set as a
//! `WatchPrefixes` stream of changes (and as a `Health` report to a caller that does not
//! watch), `Generate` and `Prefill` at a modelled pace. Real coordinators and a real etcd run
//! against them unchanged.
//!
//! The process is the unit of failure: SIGKILL it and every worker in it dies at once
//! (their leases run out), SIGSTOP it and they all freeze; run two to kill a share of a
//! fleet. SIGTERM or Ctrl-C deregisters every worker and exits.

mod worker;

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use proto::worker::v1::decode_worker_server::DecodeWorkerServer;
use proto::worker::v1::prefill_worker_server::PrefillWorkerServer;
use registry::{Capacity, EtcdConfig, Registration, RegistrationConfig, Role, TransferEndpoint, WorkerInfo};

pub use worker::{Shape, StepModel};

/// Most simulated workers one process runs.
const MAX_WORKERS: usize = 5_000;
/// File descriptors a worker may hold: its listener, its etcd connection, and one
/// connection from each of a few coordinators and decode workers.
const FDS_PER_WORKER: u64 = 6;

#[derive(clap::Args)]
pub struct Args {
    /// etcd endpoints (comma-separated) the workers register in. Env: TANDEM_ETCD.
    #[arg(long, env = "TANDEM_ETCD", value_delimiter = ',', required = true)]
    etcd: Vec<String>,
    /// Cluster prefix of the etcd keys. Env: TANDEM_CLUSTER_PREFIX.
    #[arg(long, env = "TANDEM_CLUSTER_PREFIX", default_value = "tandem")]
    cluster_prefix: String,
    /// Simulated decode workers.
    #[arg(long, default_value_t = 4)]
    decode: usize,
    /// Simulated prefill workers.
    #[arg(long, default_value_t = 2)]
    prefill: usize,
    /// Worker ids are NAME-decode-N and NAME-prefill-N (default `sim-PID`); two
    /// processes need two names.
    #[arg(long)]
    name: Option<String>,
    /// The workers' version group (real workers never share it: simulated workers
    /// report their own layout and determinism fingerprints).
    #[arg(long, default_value = "sim")]
    version_group: String,
    /// Lease TTL, s. Each worker sends a keepalive every third of it: 1,000 workers at
    /// 2 s send 1,500/s, near the ~1,900/s etcd 3.4 was measured to take here.
    #[arg(long, default_value_t = 5)]
    lease_ttl_s: u64,
    /// Tokens per KV block (the prefix report's block size).
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// KV blocks per worker.
    #[arg(long, default_value_t = 2_048)]
    kv_blocks: u32,
    /// Most sequences a worker runs at once; the rest wait.
    #[arg(long, default_value_t = 16)]
    max_running: u32,
    /// Prefill time per prompt token not cached, µs.
    #[arg(long, default_value_t = 1_270)]
    prefill_us_per_token: u64,
    /// One decode step of one sequence, µs.
    #[arg(long, default_value_t = 5_500)]
    decode_step_us: u64,
    /// Added to a decode step per other running sequence, µs.
    #[arg(long, default_value_t = 400)]
    decode_step_us_per_sequence: u64,
    /// The coordinators' `--prefix-affinity`: the oracle judging the prefix hit rate
    /// scores as they do (`oracle_tokens` in the stats).
    #[arg(long, default_value_t = 1.0)]
    oracle_affinity: f64,
    /// Threads of this process's runtime.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Every this many seconds, a `sim stats: {JSON}` line on stderr: Health answers,
    /// prefix hashes sent, Generate and Prefill calls, all workers together (0: never).
    #[arg(long, default_value_t = 0)]
    stats_every_s: u64,
}

/// This process's limits on open files, (soft, hard), from /proc/self/limits.
pub fn open_files_limits() -> Option<(u64, u64)> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    let mut f = line.split_whitespace().skip(3).map(str::parse::<u64>);
    Some((f.next()?.ok()?, f.next()?.ok()?))
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let workers = a.decode + a.prefill;
    if a.decode == 0 || workers > MAX_WORKERS {
        bail!("--decode must be at least 1 and --decode + --prefill at most {MAX_WORKERS} (got {workers})");
    }
    if a.block_size == 0 || a.kv_blocks == 0 || a.max_running == 0 || a.threads == 0 || a.lease_ttl_s == 0 {
        bail!("--block-size, --kv-blocks, --max-running, --threads and --lease-ttl-s must be at least 1");
    }
    let needed = workers as u64 * FDS_PER_WORKER + 64;
    if let Some((limit, _)) = open_files_limits().filter(|&(soft, _)| soft < needed) {
        bail!(
            "{workers} workers need about {needed} open files and this process may open {limit}: raise the \
             limit first (`ulimit -n {needed}`, or `prlimit --nofile={needed}`)"
        );
    }
    let name = a.name.clone().unwrap_or_else(|| format!("sim-{}", std::process::id()));
    let shape = Arc::new(Shape {
        version_group: a.version_group.clone(),
        block_size: a.block_size,
        kv_blocks: a.kv_blocks,
        max_running: a.max_running,
        model: StepModel {
            prefill_per_token: Duration::from_micros(a.prefill_us_per_token),
            decode_step: Duration::from_micros(a.decode_step_us),
            decode_step_per_sequence: Duration::from_micros(a.decode_step_us_per_sequence),
        },
        affinity: a.oracle_affinity,
        counters: worker::Counters::default(),
        peers: std::sync::Mutex::new(Vec::new()),
    });
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(a.threads).enable_all().build()?;
    rt.block_on(serve(a, name, shape))
}

/// One simulated worker serving and registered.
struct Running {
    registration: Registration,
    server: tokio::task::JoinHandle<()>,
}

async fn start(id: String, role: Role, shape: Arc<Shape>, config: RegistrationConfig) -> anyhow::Result<Running> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.context("binding a worker's port")?;
    let addr = listener.local_addr()?.to_string();
    let sim = Arc::new(worker::SimWorker::new(&id, role, shape.clone()));
    shape.peers.lock().unwrap_or_else(|e| e.into_inner()).push(Arc::downgrade(&sim));
    let svc = worker::Service(sim);
    let router = match role {
        Role::Decode => tonic::transport::Server::builder().add_service(DecodeWorkerServer::new(svc)),
        Role::Prefill => tonic::transport::Server::builder().add_service(PrefillWorkerServer::new(svc)),
    };
    let server = tokio::spawn(async move {
        if let Err(e) = router.serve_with_incoming(registry::grpc::incoming(listener)).await {
            tracing::warn!(error = %e, "a simulated worker's server ended");
        }
    });
    let info = WorkerInfo {
        id: id.clone(),
        role,
        version_group: shape.version_group.clone(),
        layout_fingerprint: worker::hex(&worker::layout_fingerprint()),
        determinism_fingerprint: worker::hex(&worker::determinism_fingerprint()),
        grpc_addr: addr,
        // Never dialled: simulated prefill workers push no KV.
        transfer: (role == Role::Decode).then(|| TransferEndpoint {
            addr: "127.0.0.1:9".into(),
            transport: "tcp".into(),
            cert_sha256: None,
        }),
        metrics_addr: None,
        zone: String::new(),
        capacity: Capacity { kv_blocks_total: u64::from(shape.kv_blocks), max_running: shape.max_running },
        draining: false,
        started_at_unix_ms: WorkerInfo::unix_ms_now(),
    };
    let registration =
        Registration::register(config, info).await.with_context(|| format!("registering simulated worker {id}"))?;
    Ok(Running { registration, server })
}

async fn serve(a: Args, name: String, shape: Arc<Shape>) -> anyhow::Result<()> {
    let mut signals = registry::StopSignals::install()?;
    let mut config = RegistrationConfig::new(EtcdConfig::new(a.etcd.clone()), a.cluster_prefix.clone());
    config.ttl = Duration::from_secs(a.lease_ttl_s);
    let ids = (0..a.decode)
        .map(|i| (format!("{name}-decode-{i}"), Role::Decode))
        .chain((0..a.prefill).map(|i| (format!("{name}-prefill-{i}"), Role::Prefill)));
    // Registered a batch at a time: a thousand at once would be a thousand etcd
    // connections opening together.
    let mut running: Vec<Running> = Vec::new();
    let ids: Vec<(String, Role)> = ids.collect();
    let started = tokio::time::Instant::now();
    for batch in ids.chunks(50) {
        let mut starts = tokio::task::JoinSet::new();
        for (id, role) in batch {
            starts.spawn(start(id.clone(), *role, shape.clone(), config.clone()));
        }
        let mut failed = None;
        while let Some(r) = starts.join_next().await {
            match r.context("a simulated worker's start panicked").and_then(|r| r) {
                Ok(w) => running.push(w),
                Err(e) => failed = failed.or(Some(e)),
            }
        }
        if let Some(e) = failed {
            deregister(running).await;
            return Err(e);
        }
    }
    println!(
        "sim: {} decode and {} prefill workers ({name}-*) registered under /{} with a {} s lease in {:.1} s; ready",
        a.decode,
        a.prefill,
        a.cluster_prefix,
        a.lease_ttl_s,
        started.elapsed().as_secs_f64()
    );
    if a.stats_every_s > 0 {
        let (every, shape) = (Duration::from_secs(a.stats_every_s), shape.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            loop {
                tick.tick().await;
                eprintln!("sim stats: {}", shape.counters.json());
            }
        });
    }
    let signal = signals.recv().await;
    eprintln!("sim: {signal}: deregistering {} workers", running.len());
    deregister(running).await;
    Ok(())
}

async fn deregister(running: Vec<Running>) {
    let mut ends = tokio::task::JoinSet::new();
    for w in running {
        ends.spawn(async move {
            w.server.abort();
            if let Err(e) = w.registration.deregister().await {
                tracing::warn!(error = %e, "deregistering a simulated worker");
            }
        });
    }
    while ends.join_next().await.is_some() {}
}
