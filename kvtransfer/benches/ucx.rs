//! UCX transport throughput, pool to pool, against `ucx_perftest`'s put
//! bandwidth on the same `UCX_TLS`, and beside the local and tcp transports
//! moving the same data, all in the same run.
//!
//! Moves the KV of a 1,024-token prompt (64 blocks of the real SmolLM2-135M
//! layout: 30 layers, 3 KV heads, head dim 64, block size 16, F16; 23.6 MB)
//! from one pool into other block ids of a second pool, sender and receiver
//! in this one process, each transport with everything a worker does:
//! `gather_layer_into` on the sender, the transport, checksums, and the
//! scatter into pool B. Pool A is moved into the same blocks of pool B
//! again and again, as `ucx_perftest` puts one buffer into another: the
//! same working set; a few bytes of every block of pool A change before
//! each transfer (`Bench::stamp`), so each must write every block anew.
//! Runs are interleaved so that other load on the machine hits all of them
//! alike:
//! - ucx: pool B lives in memory the UCX server registered (`KvPool::adopt`),
//!   and where UCX maps it here (shared memory) a thread of its own, as the
//!   prefill engine's, copies each layer's blocks from pool A straight into
//!   the reservation's blocks of pool B with a `UcxDirectWriter`, the
//!   checksum taken as it stores (no gather); the `Layer` message; the
//!   server checksums the blocks in pool B (the direct path, the default).
//!   Timed from that thread's first store to the `Ack`: the writer's grant
//!   (a round trip to the server) is asked for first and timed on its own,
//!   since a prefill worker asks for it as the prefill starts, overlapped
//!   with the first layer's compute (the ttft bench times it end to end);
//! - ucx gathered: the direct path without a writer: the layer gathered
//!   out of pool A, and the connection's thread stores the buffers into
//!   pool B (what a sender does for layers computed before its writer came);
//! - ucx landing: the same sender told not to use the pool (`direct:
//!   false`): stores (or, without a mapping, puts) into the landing region,
//!   and the server copies the layer out, CRCs its copy and scatters it;
//! - ucx puts only: the landing path with puts and a flush, no mapping;
//! - `ucx_perftest -t ucp_put_bw`, a server and a client process, on the
//!   `UCX_TLS` and `UCX_NET_DEVICES` this bench runs with, twice per run:
//!   with messages the size of one ucx put here (one layer's K of the 64
//!   blocks; one buffer put again and again, so it stays in cache), and
//!   with one message the size of the whole transfer (23.6 MB, the same
//!   working set as the pools, so memory rather than cache bounds it): what
//!   UCX itself moves with puts on this machine and these transports;
//! - tcp and local (shared-memory ring): the same pools, the same blocks;
//! - two floors (`floor/mod.rs`): the same bytes moved by two threads with
//!   no transport at all, doing only the copies and checksums of the
//!   landing path, and of a sender writing straight into the decode pool
//!   with its checksum fused into the copy (the direct path's least work:
//!   no gather on the sender). What they reach against `ucx_perftest`
//!   bounds what any transport of that shape can reach on this host.
//!
//! `UCX_NET_DEVICES` is set to `lo` unless the caller set it. UCX picks its
//! transports from `UCX_TLS` (shared memory and CMA between processes when
//! unset); run once per setting to compare, e.g. `UCX_TLS=tcp`.
//!
//! Run: `cargo bench -p kvtransfer --features pool --bench ucx` (optional arg: runs,
//! default 7). Goal: ucx pool -> pool >= 0.8x ucx_perftest's put bandwidth.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]

// The raw-stream baselines and frame helpers there are the tcp and quic benches'.
#[allow(dead_code)]
mod common;
mod floor;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

use common::{lock, peer, Res, LAYOUT, SIDE};
use engine::kv::KvPool;
use kvtransfer::{
    LocalKvSender, LocalKvServer, LocalSenderConfig, LocalServerConfig, Receiver, ReceiverConfig, TcpKvSender,
    TcpKvServer, TcpSenderConfig, TcpServerConfig, UcxKvSender, UcxKvServer, UcxSenderConfig, UcxServerConfig,
};
use types::kv::BlockId;

/// 1,024 tokens.
const BLOCKS: usize = 64;
/// Bytes of one transfer: 64 x 368,640.
const TOTAL: usize = BLOCKS * 2 * SIDE * LAYOUT.n_layers;
/// One ucx put: one layer's K (or V) of the reservation.
const PUT: usize = BLOCKS * SIDE;
/// `ucx_perftest` runs: (message bytes, iterations, warm-up iterations),
/// each ten transfers' worth of bytes: one-put-sized messages, then one
/// message per transfer.
const PERF_RUNS: [(usize, usize, usize); 2] = [(PUT, 10 * 2 * LAYOUT.n_layers, 2 * LAYOUT.n_layers), (TOTAL, 10, 2)];
/// Debian's (ucx-utils), against the same libucp as the binding; `make deps` installs it.
const PERFTEST: &str = "/usr/bin/ucx_perftest";

#[derive(Debug, Clone, Copy)]
enum Kind {
    Ucx,
    UcxGathered,
    UcxLanding,
    UcxPuts,
    Tcp,
    Local,
}

impl Kind {
    const ALL: [Kind; 6] = [Self::Ucx, Self::UcxGathered, Self::UcxLanding, Self::UcxPuts, Self::Tcp, Self::Local];

    fn label(self) -> &'static str {
        match self {
            Self::Ucx => "ucx, pool -> pool",
            Self::UcxGathered => "ucx gathered, pool -> pool",
            Self::UcxLanding => "ucx landing, pool -> pool",
            Self::UcxPuts => "ucx puts only, pool -> pool",
            Self::Tcp => "tcp, pool -> pool",
            Self::Local => "local, pool -> pool",
        }
    }
}

fn main() -> Res<()> {
    let runs = std::env::args().skip(1).find_map(|a| a.parse::<usize>().ok()).unwrap_or(7).max(1);
    if std::env::var_os("UCX_NET_DEVICES").is_none() {
        std::env::set_var("UCX_NET_DEVICES", "lo");
    }
    let tls = kvtransfer::transport::ucx::ucx_tls();
    let devices = std::env::var("UCX_NET_DEVICES").unwrap_or_default();
    println!(
        "layout {LAYOUT:?}; {BLOCKS} blocks (1,024 tokens) = {:.1} MB per transfer; UCX_TLS={tls} \
         UCX_NET_DEVICES={devices}; best and median of {runs} interleaved runs",
        TOTAL as f64 / 1e6
    );
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let mut b = Bench::new()?;
    let servers = rt.block_on(b.servers())?;
    // One connection per transport for the whole bench, as the prefill worker keeps one
    // per destination; one untimed transfer each first (connection set-up, first touch).
    let mut senders = Vec::new();
    for k in Kind::ALL {
        let mut tx = rt.block_on(servers.connect(k))?;
        if let (Tx::Ucx(t), Kind::Ucx) = (&tx, k) {
            println!("  ucx puts go over: {}", t.transports().join(", "));
        }
        b.stamp()?;
        rt.block_on(b.run(k, &servers, &mut tx))?;
        senders.push(tx);
    }

    let mut times: Vec<Vec<Duration>> = vec![Vec::new(); Kind::ALL.len()];
    let mut grants = Vec::new();
    let mut perf = Vec::new();
    let mut floor = floor::Floor::new(LAYOUT.n_layers, BLOCKS, SIDE);
    let mut floor_times: Vec<Vec<Duration>> = vec![Vec::new(); floor::Shape::ALL.len()];
    for _ in 0..runs {
        for (i, k) in Kind::ALL.into_iter().enumerate() {
            b.stamp()?;
            let t = rt.block_on(b.run(k, &servers, &mut senders[i]))?;
            times[i].push(t.moved);
            grants.extend(t.granted);
            if lock(&b.pool_b).gather(&b.table_b)? != b.source.gather(&b.table_a)? {
                return Err(format!("{}: KV differs after the transfer", k.label()).into());
            }
        }
        let mut row = [0.0; PERF_RUNS.len()];
        for (slot, (size, iters, warmup)) in row.iter_mut().zip(PERF_RUNS) {
            *slot = perftest_put_gbps(size, iters, warmup)?;
        }
        perf.push(row);
        for (t, shape) in floor_times.iter_mut().zip(floor::Shape::ALL) {
            t.push(floor.run(shape)?);
        }
    }
    let mut perf_rates = Vec::new();
    for (i, (size, ..)) in PERF_RUNS.iter().enumerate() {
        let (pb, pm) = best_and_median(perf.iter().map(|p| p[i]).collect());
        println!("  {:28} {pb:6.2} GB/s best, {pm:6.2} median  ({size}-byte puts)", "ucx_perftest ucp_put_bw");
        perf_rates.push((*size, pb, pm));
    }
    let mut ucx = (0.0, 0.0);
    for (k, t) in Kind::ALL.into_iter().zip(&times) {
        let (best, median) = rates(t);
        if matches!(k, Kind::Ucx) {
            ucx = (best, median);
        }
        println!("  {:28} {best:6.2} GB/s best, {median:6.2} median", k.label());
    }
    let mut grants: Vec<f64> = grants.iter().map(|g| g.as_secs_f64() * 1e6).collect();
    grants.sort_by(f64::total_cmp);
    println!(
        "  {:28} {:6.0} us best, {:6.0} median  (untimed above: a worker asks while the first layer computes)",
        "ucx writer granted in",
        grants[0],
        grants[grants.len() / 2]
    );
    let mut floors = Vec::new();
    for (shape, t) in floor::Shape::ALL.into_iter().zip(&floor_times) {
        let (best, median) = rates(t);
        println!("  {:28} {best:6.2} GB/s best, {median:6.2} median  (no transport)", shape.label());
        floors.push((shape.label(), best, median));
    }
    for (size, pb, pm) in perf_rates {
        println!(
            "  ratio ucx pool -> pool / ucx_perftest {size}-byte puts: {:.2} best, {:.2} median (goal >= 0.8)",
            ucx.0 / pb,
            ucx.1 / pm
        );
        if size == TOTAL {
            for (label, best, median) in &floors {
                println!("    {label} / the same: {:.2} best, {:.2} median", best / pb, median / pm);
            }
        }
    }
    for (k, tx) in Kind::ALL.into_iter().zip(&senders) {
        if let Tx::Ucx(t) = tx {
            let sends = (runs + 1) * LAYOUT.n_layers;
            println!(
                "  {}: {} of {sends} layers stored through a mapping, {} of them straight into pool blocks",
                k.label(),
                t.mapped_layers(),
                t.direct_layers()
            );
        }
    }
    let s = servers.ucx.stats();
    if s.ucx.quarantined_ranges != 0
        || s.ucx.quarantined_blocks != 0
        || s.ucx.landing_in_use_bytes != 0
        || s.aborts_sent != 0
    {
        return Err(format!("ucx server left state behind: {s:?}").into());
    }
    Ok(())
}

/// (best, median) in GB/s (10^9 bytes per second) for transfers of [`TOTAL`] bytes.
fn rates(times: &[Duration]) -> (f64, f64) {
    best_and_median(times.iter().map(|t| TOTAL as f64 / t.as_secs_f64() / 1e9).collect())
}

/// The highest and the median of `rates` (at least one).
fn best_and_median(mut rates: Vec<f64>) -> (f64, f64) {
    rates.sort_by(|a, b| b.total_cmp(a));
    (rates[0], rates[rates.len() / 2])
}

struct Bench {
    /// Pool A, moved again and again into the same blocks of pool B, as
    /// `ucx_perftest` puts one buffer into one buffer: the same working set
    /// (two 23.6 MB regions). Before each transfer [`stamp`](Self::stamp)
    /// writes one token row of every block of every layer anew, so a
    /// transfer that leaves any block's K or V as it was fails the check;
    /// pool B is not cleared between transfers (23.6 MB of zeroes written
    /// just before a transfer leave its destination dirty in this core's
    /// caches, which neither a worker's transfer nor `ucx_perftest` sees).
    /// Shared with the thread that stores from it, as the prefill engine's
    /// pool.
    source: Arc<KvPool>,
    table_a: Vec<BlockId>,
    pool_b: Arc<Mutex<KvPool>>,
    table_b: Vec<BlockId>,
    /// Transfers so far.
    turn: usize,
}

/// One transfer's times.
struct Timed {
    /// From the first layer's gather (or store) to the `Ack`.
    moved: Duration,
    /// The ucx writer's grant, asked for before the timer starts.
    granted: Option<Duration>,
}

/// The decode sides, bound once as a worker's are.
struct Servers {
    ucx: UcxKvServer,
    tcp: TcpKvServer,
    local: LocalKvServer,
    /// The ucx, tcp and local servers' receivers.
    rx: [Arc<Mutex<Receiver>>; 3],
}

impl Bench {
    fn new() -> Res<Self> {
        let (source, table_a) = common::source_pool(LAYOUT, BLOCKS, 0)?;
        // Its blocks are allocated once it lives in the UCX server's memory (`servers`).
        let pool_b = Arc::new(Mutex::new(KvPool::new(LAYOUT, BLOCKS + 7)?));
        Ok(Self { source: Arc::new(source), table_a, pool_b, table_b: Vec::new(), turn: 0 })
    }

    /// Writes token row `turn % block_size` of every block of every layer
    /// of pool A with values of this turn (1,000 and up: `source_pool`'s are
    /// below 256), so each transfer has KV in every block that pool B does
    /// not hold yet. Touches 1/16 of pool A, untimed.
    fn stamp(&mut self) -> Res<()> {
        self.turn += 1;
        let (turn, slot) = (self.turn, self.turn % LAYOUT.block_size);
        let pool = Arc::get_mut(&mut self.source).ok_or("pool A is still shared after a transfer")?;
        let row = LAYOUT.row_elems();
        let (mut k, mut v) = (vec![0f32; row], vec![0f32; row]);
        for layer in 0..LAYOUT.n_layers {
            for (i, &b) in self.table_a.iter().enumerate() {
                for j in 0..row {
                    // Whole numbers below 2,048: exact in F16.
                    k[j] = 1000.0 + ((turn + layer + i + j) % 512) as f32;
                    v[j] = -k[j];
                }
                pool.write(layer, b, slot, &k, &v);
            }
        }
        Ok(())
    }

    async fn servers(&mut self) -> Res<Servers> {
        let rx = || Receiver::new(peer(), ReceiverConfig::new(LAYOUT)).map(|r| Arc::new(Mutex::new(r)));
        let rx = [rx()?, rx()?, rx()?];
        let config = UcxServerConfig { pool_blocks: Some(BLOCKS + 7), ..UcxServerConfig::default() };
        let mut ucx = UcxKvServer::bind(rx[0].clone(), self.pool_b.clone(), config).await?;
        // As the decode worker: pool B moves into the registered memory, then direct writes start.
        let memory = ucx.pool_memory().ok_or("the UCX server mapped no pool")?;
        lock(&self.pool_b).adopt(memory.into_shared())?;
        ucx.enable_direct();
        let _decoys = lock(&self.pool_b).allocate(7)?;
        self.table_b = lock(&self.pool_b).allocate(BLOCKS)?;
        let tcp =
            TcpKvServer::bind("127.0.0.1:0", rx[1].clone(), self.pool_b.clone(), TcpServerConfig::default()).await?;
        let name = format!("@tandem-kv-bench-ucx-{}", std::process::id());
        let local = LocalKvServer::bind(name, rx[2].clone(), self.pool_b.clone(), LocalServerConfig::default()).await?;
        Ok(Servers { ucx, tcp, local, rx })
    }

    /// One transfer on `tx`, timed from the first gather (ucx: the first
    /// layer's store) to the Ack.
    async fn run(&self, kind: Kind, s: &Servers, tx: &mut Tx) -> Res<Timed> {
        let pool_a = &self.source;
        let rx = &s.rx[match kind {
            Kind::Ucx | Kind::UcxGathered | Kind::UcxLanding | Kind::UcxPuts => 0,
            Kind::Tcp => 1,
            Kind::Local => 2,
        }];
        let r = lock(rx).reserve(self.table_b.clone(), Duration::from_secs(60), tokio::time::Instant::now())?;
        if let (Tx::Ucx(t), Kind::Ucx) = (&mut *tx, kind) {
            // As the prefill worker: the writer is asked for as the prefill
            // starts, its grant overlapping the first layer's compute (which
            // this bench has none of: the grant is timed on its own); then a
            // thread of its own (the engine's) stores each layer and hands
            // what it stored to this task, which announces it.
            let asked = Instant::now();
            let w = t.direct_writer(r).await?.ok_or("ucx: no direct writer (the pool is not mapped here)")?;
            let granted = asked.elapsed();
            let (stored_tx, mut stored) = tokio::sync::mpsc::channel(LAYOUT.n_layers);
            let (pool, table, writer) = (pool_a.clone(), self.table_a.clone(), w.clone());
            let engine = tokio::task::spawn_blocking(move || -> Result<Instant, String> {
                let start = Instant::now();
                for layer in 0..LAYOUT.n_layers {
                    let (k, v) = pool.layer_bytes(layer).map_err(|e| e.to_string())?;
                    let s = writer.store_layer(layer, 0, k, v, &table).map_err(|e| e.to_string())?;
                    stored_tx.blocking_send(s).map_err(|e| e.to_string())?;
                }
                Ok(start)
            });
            // As the prefill worker's push: whatever was stored meanwhile goes together.
            while let Some(s) = stored.recv().await {
                let mut batch = vec![s];
                while let Ok(s) = stored.try_recv() {
                    batch.push(s);
                }
                t.announce(batch).await?;
            }
            let start = engine.await??;
            let _ack = t.complete(r).await?;
            let moved = start.elapsed();
            if w.is_live() {
                return Err("ucx: the writer outlived its reservation's Complete".into());
            }
            if lock(rx).take_ready(r)? != self.table_b {
                return Err(format!("{}: the reservation's blocks changed", kind.label()).into());
            }
            return Ok(Timed { moved, granted: Some(granted) });
        }
        let start = Instant::now();
        // As the prefill worker: the engine hands each layer over in recycled
        // buffers, which come home once sent (ucx: once put).
        let home = kvtransfer::Buffers::new(64 << 20);
        for layer in 0..LAYOUT.n_layers {
            let (mut k, mut v) = (home.take(), home.take());
            pool_a.gather_layer_into(layer, &self.table_a, &mut k, &mut v)?;
            match &mut *tx {
                Tx::Ucx(t) => t.send_blocks_owned(r, layer, 0, k, v).await?,
                Tx::Tcp(t) => t.send_layer(r, layer, &k, &v).await?,
                Tx::Local(t) => t.send_layer(r, layer, &k, &v).await?,
            }
        }
        match tx {
            Tx::Ucx(t) => drop(t.complete(r).await?),
            Tx::Tcp(t) => drop(t.complete(r).await?),
            Tx::Local(t) => drop(t.complete(r).await?),
        }
        let moved = start.elapsed();
        if lock(rx).take_ready(r)? != self.table_b {
            return Err(format!("{}: the reservation's blocks changed", kind.label()).into());
        }
        Ok(Timed { moved, granted: None })
    }
}

impl Servers {
    async fn connect(&self, kind: Kind) -> Res<Tx> {
        Ok(match kind {
            Kind::Ucx | Kind::UcxGathered | Kind::UcxLanding | Kind::UcxPuts => {
                let config = UcxSenderConfig {
                    mapped_stores: !matches!(kind, Kind::UcxPuts),
                    direct: matches!(kind, Kind::Ucx | Kind::UcxGathered),
                    ..UcxSenderConfig::default()
                };
                Tx::Ucx(UcxKvSender::connect(self.ucx.local_addr(), &peer(), LAYOUT, config).await?)
            }
            Kind::Tcp => {
                Tx::Tcp(TcpKvSender::connect(self.tcp.local_addr(), &peer(), LAYOUT, TcpSenderConfig::default()).await?)
            }
            Kind::Local => Tx::Local(
                LocalKvSender::connect(self.local.local_addr(), &peer(), LAYOUT, LocalSenderConfig::default()).await?,
            ),
        })
    }
}

enum Tx {
    Ucx(UcxKvSender),
    Tcp(TcpKvSender),
    Local(LocalKvSender),
}

/// One `ucx_perftest` put-bandwidth run of `iters` puts of `size` bytes
/// after `warmup` (server and client process on this host, the
/// environment's `UCX_*`), in GB/s.
fn perftest_put_gbps(size: usize, iters: usize, warmup: usize) -> Res<f64> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port().to_string();
    let mut server = Command::new(PERFTEST)
        .args(["-p", &port])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("start {PERFTEST} (Debian's ucx-utils; make deps installs it): {e}"))?;
    // Started when its port listens: the client refuses to retry.
    let listening = wait_listening(&port, Duration::from_secs(20));
    let client = listening.and_then(|()| {
        let out = Command::new(PERFTEST)
            .args(["127.0.0.1", "-p", &port, "-t", "ucp_put_bw"])
            .args(["-s", &size.to_string(), "-n", &iters.to_string(), "-w", &warmup.to_string()])
            .stderr(Stdio::inherit())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("start the {PERFTEST} client: {e}"))?;
        final_mib_per_s(out)
    });
    if client.is_err() {
        let _ = server.kill();
    }
    let status = server.wait()?;
    let mib = client?;
    if !status.success() {
        return Err(format!("{PERFTEST} server: {status}").into());
    }
    Ok(mib * (1 << 20) as f64 / 1e9)
}

/// The overall bandwidth of the client's `Final:` line (ucx_perftest's MB are MiB).
fn final_mib_per_s(mut child: std::process::Child) -> Res<f64> {
    let stdout = child.stdout.take().ok_or("no stdout")?;
    let mut found = None;
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        if let Some(rest) = line.trim().strip_prefix("Final:") {
            // iterations, latency 50%/average/overall, bandwidth average/overall, rate average/overall
            let cols: Vec<f64> = rest.split_whitespace().filter_map(|c| c.parse().ok()).collect();
            found = cols.get(5).copied();
        }
    }
    let status = child.wait()?;
    match found {
        Some(mib) if status.success() => Ok(mib),
        _ => Err(format!("{PERFTEST} client ({status}) printed no Final bandwidth").into()),
    }
}

/// Waits until a socket listens on 127.0.0.1:`port` (/proc/net/tcp), at most `wait`.
fn wait_listening(port: &str, wait: Duration) -> Res<()> {
    let hex = format!("{:04X}", port.parse::<u16>()?);
    let deadline = Instant::now() + wait;
    loop {
        for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
            let text = std::fs::read_to_string(table).unwrap_or_default();
            // sl local_address rem_address st ...; st 0A = LISTEN
            let listens = text.lines().skip(1).any(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                f.get(1).and_then(|a| a.rsplit(':').next()) == Some(hex.as_str()) && f.get(3) == Some(&"0A")
            });
            if listens {
                return Ok(());
            }
        }
        if Instant::now() > deadline {
            return Err(format!("{PERFTEST} server did not listen on port {port} within {wait:?}").into());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}
