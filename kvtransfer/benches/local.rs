//! Local (shared-memory) transport throughput against `memcpy`.
//!
//! Moves the KV of `BLOCKS` blocks of the real SmolLM2-135M layout (30
//! layers, 3 KV heads, head dim 64, block size 16, F16: ~256 MiB) from one
//! pool into other block ids of a second pool, sender and receiver in this
//! one process on a real Unix socket and a real memfd ring, and in the
//! same run (interleaved, so that other load on the machine hits all
//! alike) copies the same bytes in the same chunk sizes (one slot's
//! payload) with `memcpy`: the ceiling for anything on one host.
//!
//! Variants, each pool -> pool unless said otherwise, each including every
//! copy and checksum on the way:
//! - `gather`: `gather_layer_into` then `send_layer`, the sink scattering
//!   into the pool inline (what `benches/tcp.rs` measures for TCP);
//! - `direct`: `send_stored_blocks` (blocks copied from the pool straight into
//!   the slots), inline sink;
//! - `direct, deferred sink`: as `direct`, but the sink hands each payload
//!   to another thread that scatters it, as the decode worker's sink hands
//!   it to the engine thread; the clock stops when the last write landed;
//! - `memory -> memory`: pre-gathered layers in, a plain buffer as the sink:
//!   the transport alone.
//!
//! The sender and the receiver each need a core; `memcpy` needs one. On a
//! machine that other work shares, the ratios fall accordingly.
//!
//! Run: `cargo bench -p kvtransfer --bench local` (optional args: rings as
//! slot KiB x slots, e.g. `-- 256x8 1024x16`).

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]

// The other benches' helpers; this one takes only the source pool.
#[allow(dead_code)]
mod common;

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

use engine::kv::KvPool;

use kvtransfer::{
    BlockSink, FnSink, LayoutFingerprint, LocalKvSender, LocalKvServer, LocalSenderConfig, LocalServerConfig,
    OwnedPayload, Peer, Receiver, ReceiverConfig, VersionGroup, WriteInstruction,
};
use types::kv::{BlockId, KvDtype, KvLayout};

const LAYOUT: KvLayout = KvLayout { n_layers: 30, n_kv_heads: 3, head_dim: 64, block_size: 16, dtype: KvDtype::F16 };
/// 729 blocks x 368,640 bytes = 268.7 MB (256.3 MiB).
const BLOCKS: usize = 729;
const RUNS: usize = 5;
const SLOTS: usize = 8;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Variant {
    Gather,
    Direct,
    DirectDeferred,
    Memory,
}

impl Variant {
    const ALL: [Variant; 4] = [Self::Gather, Self::Direct, Self::DirectDeferred, Self::Memory];

    fn label(self) -> &'static str {
        match self {
            Self::Gather => "pool -> pool, gather + send_layer",
            Self::Direct => "pool -> pool, send_stored_blocks",
            Self::DirectDeferred => "pool -> pool, send_stored_blocks, deferred sink",
            Self::Memory => "memory -> memory",
        }
    }
}

fn main() -> Res<()> {
    // Arguments: rings as KIBxSLOTS (e.g. 256x8); a bare number is KiB with the default slot count.
    let parse = |a: String| -> Option<(usize, usize)> {
        let (kib, slots) = a.split_once('x').unwrap_or((&a, ""));
        Some((kib.parse().ok()?, if slots.is_empty() { SLOTS } else { slots.parse().ok()? }))
    };
    let rings: Vec<(usize, usize)> = std::env::args().skip(1).filter_map(parse).collect();
    let rings = if rings.is_empty() { vec![(256, SLOTS), (1024, SLOTS)] } else { rings };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;

    let total = BLOCKS * LAYOUT.block_bytes();
    println!(
        "layout {LAYOUT:?}; {BLOCKS} blocks = {:.1} MiB per transfer; best and median of {RUNS} runs",
        total as f64 / (1 << 20) as f64
    );
    let bench = Bench::new()?;
    // Servers live for the whole bench, as a worker's does; every run is a
    // new connection with a new ring.
    let decodes: Vec<Decode> = rt.block_on(async {
        let mut d = Vec::new();
        for v in Variant::ALL {
            d.push(bench.decode(v).await?);
        }
        Ok::<_, Box<dyn std::error::Error>>(d)
    })?;

    for (kib, slots) in rings {
        let slot_bytes = kib << 10;
        let block = LAYOUT.block_elems() * LAYOUT.dtype.size() * 2;
        let chunk = slot_bytes / block * block;
        println!("\n{slots} slots of {kib} KiB ({chunk} bytes of payload, {} blocks per frame)", chunk / block);
        let config = LocalSenderConfig { slots, slot_bytes, ..LocalSenderConfig::default() };

        let mut times: Vec<Vec<Duration>> = vec![Vec::new(); Variant::ALL.len()];
        let mut mem = Vec::new();
        let mut locks: Vec<Option<String>> = vec![None; Variant::ALL.len()];
        for _ in 0..RUNS {
            for (i, v) in Variant::ALL.into_iter().enumerate() {
                lock(&bench.pool_b).clear(&bench.table_b)?;
                lock_take();
                times[i].push(rt.block_on(bench.run(v, &decodes[i], &config))?);
                locks[i] = lock_take();
                if v != Variant::Memory && lock(&bench.pool_b).gather(&bench.table_b)? != bench.want {
                    return Err(format!("{}: KV differs after the transfer", v.label()).into());
                }
            }
            mem.push(memcpy_run(total, chunk));
        }
        let (mb, mm) = rates(total, &mem);
        println!("  {:46} {mb:6.2} GB/s best, {mm:6.2} median", "memcpy baseline");
        for (v, t) in Variant::ALL.into_iter().zip(&times) {
            let (b, m) = rates(total, t);
            println!(
                "  {:46} {b:6.2} GB/s best, {m:6.2} median; ratio to memcpy {:.2} best, {:.2} median",
                v.label(),
                b / mb,
                m / mm
            );
        }
        println!("  (goal: pool -> pool at >= 0.8 of memcpy)");
        for (v, l) in Variant::ALL.into_iter().zip(&locks) {
            if let Some(l) = l {
                println!("  receiver lock, {} (last run): {l}", v.label());
            }
        }
        if locks[0].is_some() {
            println!("  frames per transfer: {}", total.div_ceil(chunk));
        }
    }
    Ok(())
}

/// The receiver lock's figures since the last call (feature `lock-stats`;
/// `None` without it), and a fresh start for the next.
fn lock_take() -> Option<String> {
    #[cfg(feature = "lock-stats")]
    {
        let s = kvtransfer::transport::lock_stats::snapshot();
        kvtransfer::transport::lock_stats::reset();
        let us = |ns: u64| ns as f64 / 1e3;
        Some(format!(
            "{} acquisitions, {} contended; hold mean {:.2} us, p50 <= {:.2}, p99 <= {:.2}, max {:.2}; \
             contended wait mean {:.2} us, max {:.2}; held {:.2} ms in all; waited {:.3} us per acquisition",
            s.acquired,
            s.contended,
            s.hold.mean_ns() / 1e3,
            us(s.hold.quantile_ns(0.5)),
            us(s.hold.quantile_ns(0.99)),
            us(s.hold.max_ns),
            s.wait.mean_ns() / 1e3,
            us(s.wait.max_ns),
            s.hold.sum_ns as f64 / 1e6,
            s.wait.sum_ns as f64 / 1e3 / s.acquired.max(1) as f64,
        ))
    }
    #[cfg(not(feature = "lock-stats"))]
    None
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// (best, median) in GB/s (10^9 bytes per second).
fn rates(bytes: usize, times: &[Duration]) -> (f64, f64) {
    let mut r: Vec<f64> = times.iter().map(|t| bytes as f64 / t.as_secs_f64() / 1e9).collect();
    r.sort_by(|a, b| b.total_cmp(a));
    (r[0], r[r.len() / 2])
}

fn peer() -> Peer {
    Peer {
        version_group: VersionGroup::new("smollm2-135m").unwrap_or_else(|e| panic!("label: {e}")),
        fingerprint: LayoutFingerprint::new(&LAYOUT, &[1; 32], &[2; 32]),
    }
}

/// A fresh abstract name per server: a shut-down server's listener closes
/// asynchronously.
fn addr() -> String {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("@tandem-kv-bench-{}-{n}", std::process::id())
}

struct Bench {
    pool_a: KvPool,
    table_a: Vec<BlockId>,
    pool_b: Arc<Mutex<KvPool>>,
    table_b: Vec<BlockId>,
    /// What pool B's blocks must hold after a transfer.
    want: Vec<u8>,
    /// Pre-gathered layers for the memory -> memory variant.
    layers: Vec<(Vec<u8>, Vec<u8>)>,
    /// The memory -> memory variant's destination, touched up front.
    flat: Arc<Mutex<Vec<u8>>>,
}

impl Bench {
    fn new() -> Res<Self> {
        let (pool_a, table_a) = common::source_pool(LAYOUT, BLOCKS, 0)?;
        let pool_b = Arc::new(Mutex::new(KvPool::new(LAYOUT, BLOCKS + 7)?));
        let _decoys = lock(&pool_b).allocate(7)?;
        let table_b = lock(&pool_b).allocate(BLOCKS)?;
        let want = pool_a.gather(&table_a)?;
        let layers = (0..LAYOUT.n_layers).map(|l| pool_a.gather_layer(l, &table_a)).collect::<Result<_, _>>()?;
        let flat = Arc::new(Mutex::new(vec![1u8; BLOCKS * LAYOUT.block_bytes()]));
        Ok(Self { pool_a, table_a, pool_b, table_b, want, layers, flat })
    }

    /// The decode side for variant `v`.
    async fn decode(&self, v: Variant) -> Res<Decode> {
        let rx = Arc::new(Mutex::new(Receiver::new(peer(), ReceiverConfig::new(LAYOUT))?));
        let config = LocalServerConfig::default();
        let mut scatter = None;
        let server = match v {
            Variant::Gather | Variant::Direct => {
                LocalKvServer::bind(addr(), rx.clone(), self.pool_b.clone(), config).await?
            }
            Variant::DirectDeferred => {
                let s = Scatter::start(self.pool_b.clone());
                let sink = s.sink();
                scatter = Some(s);
                LocalKvServer::bind(addr(), rx.clone(), sink, config).await?
            }
            Variant::Memory => {
                let flat = self.flat.clone();
                let side = LAYOUT.block_elems() * LAYOUT.dtype.size();
                let sink = FnSink(move |layer: usize, blocks: &[BlockId], k: &[u8], v: &[u8]| {
                    // Pool ids 0..BLOCKS stand for positions in the reservation.
                    let at = (layer * BLOCKS + blocks.first().copied().unwrap_or(0) as usize) * 2 * side;
                    let mut flat = lock(&flat);
                    let out = flat.get_mut(at..at + k.len() + v.len()).ok_or("out of range")?;
                    out[..k.len()].copy_from_slice(k);
                    out[k.len()..].copy_from_slice(v);
                    Ok(())
                });
                LocalKvServer::bind(addr(), rx.clone(), Cloned(Arc::new(Mutex::new(sink))), config).await?
            }
        };
        Ok(Decode { rx, server, scatter })
    }

    /// One full transfer on a new connection; returns the time from the
    /// first byte to the Ack (and, with a deferred sink, to the last write
    /// landing).
    async fn run(&self, v: Variant, d: &Decode, config: &LocalSenderConfig) -> Res<Duration> {
        let rx = &d.rx;
        let blocks = match v {
            Variant::Memory => (0..BLOCKS as BlockId).collect(),
            _ => self.table_b.clone(),
        };
        let r = lock(rx).reserve(blocks, Duration::from_secs(60), tokio::time::Instant::now())?;
        let mut tx = LocalKvSender::connect(d.server.local_addr(), &peer(), LAYOUT, config.clone()).await?;

        let start = Instant::now();
        let (mut k, mut vv) = (Vec::new(), Vec::new());
        for layer in 0..LAYOUT.n_layers {
            match v {
                Variant::Gather => {
                    self.pool_a.gather_layer_into(layer, &self.table_a, &mut k, &mut vv)?;
                    tx.send_layer(r, layer, &k, &vv).await?;
                }
                Variant::Direct | Variant::DirectDeferred => {
                    let (ks, vs) = self.pool_a.layer_bytes(layer)?;
                    tx.send_stored_blocks(r, layer, 0, ks, vs, &self.table_a).await?
                }
                Variant::Memory => {
                    let (k, vv) = &self.layers[layer];
                    tx.send_layer(r, layer, k, vv).await?;
                }
            }
        }
        tx.complete(r).await?;
        if let Some(s) = &d.scatter {
            s.flush()?;
        }
        let elapsed = start.elapsed();
        lock(rx).take_ready(r)?;
        Ok(elapsed)
    }
}

/// A decode side: receiver, server, and the thread of a deferred sink.
struct Decode {
    rx: Arc<Mutex<Receiver>>,
    server: LocalKvServer,
    scatter: Option<Scatter>,
}

/// A sink shared by the server's connections.
struct Cloned<S>(Arc<Mutex<S>>);

impl<S> Clone for Cloned<S> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<S: BlockSink> BlockSink for Cloned<S> {
    fn write_layer(&mut self, layer: usize, blocks: &[BlockId], k: &[u8], v: &[u8]) -> Result<(), String> {
        lock(&self.0).write_layer(layer, blocks, k, v)
    }
}

enum Job {
    Write(WriteInstruction, OwnedPayload),
    Flush(mpsc::SyncSender<()>),
}

/// A thread that owns the pool writes, in order, as the decode worker's
/// engine thread does.
struct Scatter {
    jobs: mpsc::Sender<Job>,
    thread: std::thread::JoinHandle<Result<(), String>>,
}

impl Scatter {
    fn start(pool: Arc<Mutex<KvPool>>) -> Self {
        let (jobs, rx) = mpsc::channel::<Job>();
        let thread = std::thread::spawn(move || {
            for job in rx {
                match job {
                    Job::Write(w, payload) => {
                        let (k, v) = w.split_payload((*payload).as_ref());
                        lock(&pool).scatter_layer(w.layer, &w.blocks, k, v).map_err(|e| e.to_string())?;
                    }
                    Job::Flush(done) => {
                        let _ = done.send(());
                    }
                }
            }
            Ok(())
        });
        Self { jobs, thread }
    }

    fn sink(&self) -> DeferredSink {
        DeferredSink(self.jobs.clone())
    }

    /// Waits until every write posted so far has landed.
    fn flush(&self) -> Res<()> {
        let (done, wait) = mpsc::sync_channel(1);
        if self.jobs.send(Job::Flush(done)).is_ok() && wait.recv().is_ok() {
            return Ok(());
        }
        Err(if self.thread.is_finished() { "a write failed" } else { "the scatter thread is stuck" }.into())
    }
}

#[derive(Clone)]
struct DeferredSink(mpsc::Sender<Job>);

impl BlockSink for DeferredSink {
    fn write_layer(&mut self, _: usize, _: &[BlockId], _: &[u8], _: &[u8]) -> Result<(), String> {
        Err("payloads go by value".into())
    }

    fn write_layer_owned(&mut self, w: WriteInstruction, payload: OwnedPayload) -> Result<(), String> {
        self.0.send(Job::Write(w, payload)).map_err(|_| "the scatter thread has stopped".to_string())
    }
}

/// The same bytes copied in `chunk`-byte pieces between buffers larger than
/// the cache.
fn memcpy_run(total: usize, chunk: usize) -> Duration {
    let span = 64 << 20;
    let src: Vec<u8> = (0..span).map(|i| i as u8).collect();
    // Touched up front, as every buffer the transport writes is.
    let mut dst = vec![1u8; span];
    let start = Instant::now();
    let mut done = 0;
    while done < total {
        let at = done % (span - chunk);
        let n = chunk.min(total - done);
        dst[at..at + n].copy_from_slice(&src[at..at + n]);
        done += n;
    }
    let elapsed = start.elapsed();
    std::hint::black_box(&dst);
    elapsed
}
