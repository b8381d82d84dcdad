//! TCP transport throughput on loopback against raw-TCP baselines, in the
//! same run.
//!
//! Moves the KV of `BLOCKS` blocks of the real SmolLM2-135M layout (30
//! layers, 3 KV heads, head dim 64, block size 16, F16: ~256 MiB) with
//! sender and receiver in this one process. Measured, interleaved run by
//! run so that noise from other work on the machine hits all of them alike:
//! - transport, memory -> memory: pre-gathered layers in, each accepted
//!   payload copied by a sink into a destination as large as the transfer;
//! - transport, pool -> pool: everything the worker binaries do:
//!   `gather_layer` on the sender, checksums both ways, framing, decode and
//!   `scatter_layer` into a second pool (other block ids), twice: payloads
//!   read into buffers and scattered by the sink, and read straight into
//!   the second pool's blocks (`TcpServerConfig::direct`, the decode
//!   worker's default);
//! - transport, pool -> pool as the workers run it: a thread of its own (the
//!   prefill engine's) writes each layer of each 512-token step's blocks
//!   (the model computing it) and gathers it into recycled buffers while the
//!   sender sends the one before; read straight into the second pool. The
//!   writing is the model's work: its CPU time (that thread's clock) is not
//!   counted as the transport's;
//! - transport, pinned (no gather): the same with the prefill pool in mapped
//!   memory (its blocks in descending ids, so none merge): the thread takes
//!   each layer's frame checksums from the blocks it just wrote
//!   (`PinnedLayer`) and the sender writes each frame straight from them
//!   (`send_pinned`);
//! - raw tcp, same memory: a plain tokio writer/reader moving the same bytes
//!   from the same pre-gathered layers, in the transport's frame-sized
//!   pieces, straight into a destination as large as the transfer — what
//!   any TCP transport here has to do at least;
//! - raw tcp, hot buffer: one frame-sized buffer written over and over and
//!   read into one frame-sized buffer, both staying in cache: the loopback
//!   ceiling, which nothing that reads and writes 256 MiB of distinct memory
//!   reaches;
//! - memcpy: the same bytes copied in the same pieces between buffers larger
//!   than the cache (the ceiling for anything in one address space).
//!
//! Run: `cargo bench -p kvtransfer --bench tcp` (optional args: frame sizes,
//! `256k` or `1` (MiB), e.g. `-- 256k 1 4`; `profile` to loop the
//! memory -> memory transport alone, for perf, and `profile raw`,
//! `profile gathered`, `profile pinned` or `profile direct` (gathered by the sender, read
//! into the pool) that variant, 20 transfers each
//! with its CPU per GB: alternate them for a paired comparison).

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

use common::{
    actor_hops, cpu_seconds, dst_sink, expected_dst, frame_payload, frame_sizes, gbps, lock, lock_take, peer, rates,
    read_into, summary_us, write_layers, Res, BLOCKS, LAYOUT, SIDE, TOTAL,
};
use engine::kv::KvPool;
use kvtransfer::transport::{DirectPool, PoolMemory};
use kvtransfer::{PinnedLayer, Receiver, ReceiverConfig, TcpKvSender, TcpKvServer, TcpSenderConfig, TcpServerConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use types::kv::BlockId;

const RUNS: usize = 7;
/// Senders at once in the parallel variant.
const PARALLEL: usize = 4;

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let profile = args.iter().any(|a| a == "profile");
    let frames = frame_sizes(&args, &[256 << 10, 1 << 20, 4 << 20]);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;

    let total = TOTAL;
    println!(
        "layout {LAYOUT:?}; {BLOCKS} blocks = {:.1} MiB per transfer; best and median of {RUNS} interleaved runs",
        total as f64 / (1 << 20) as f64
    );
    crc_speed();
    let (mut pool_a, table_a) = common::source_pool(LAYOUT, BLOCKS, 0)?;
    let pool_b = Arc::new(Mutex::new(KvPool::new(LAYOUT, BLOCKS + 7)?));
    // In memory the TCP server can read into, as the decode worker's pool is.
    let memory = PoolMemory::new(LAYOUT, BLOCKS + 7)?;
    let direct = memory.direct();
    lock(&pool_b).adopt(memory.into_shared())?;
    let _decoys = lock(&pool_b).allocate(7)?;
    let table_b = lock(&pool_b).allocate(BLOCKS)?;
    // Touched up front: page faults on fresh memory are no transport's cost.
    lock(&pool_b).scatter_layer(0, &table_b, &vec![1; BLOCKS * SIDE], &vec![1; BLOCKS * SIDE])?;
    for l in 1..LAYOUT.n_layers {
        let (k, v) = pool_a.gather_layer(l, &table_a)?;
        lock(&pool_b).scatter_layer(l, &table_b, &k, &v)?;
    }
    // The same KV in a prefill pool in mapped memory, for sends straight from its blocks
    // (pinned): its table in descending ids, so no two blocks merge into one piece of a
    // vectored write (a sequence's blocks seldom lie side by side).
    let memory_p = PoolMemory::new(LAYOUT, BLOCKS)?;
    let source_p = memory_p.direct();
    let mut pool_p = KvPool::new(LAYOUT, BLOCKS)?;
    pool_p.adopt(memory_p.into_shared())?;
    let mut table_p = pool_p.allocate(BLOCKS)?;
    table_p.sort_unstable_by(|a, b| b.cmp(a));
    for l in 0..LAYOUT.n_layers {
        let (k, v) = pool_a.gather_layer(l, &table_a)?;
        pool_p.scatter_layer(l, &table_p, &k, &v)?;
    }
    let want = pool_a.gather(&table_a)?;
    let layers: Vec<(Vec<u8>, Vec<u8>)> =
        (0..LAYOUT.n_layers).map(|l| pool_a.gather_layer(l, &table_a)).collect::<Result<_, _>>()?;
    let dst = Arc::new(Mutex::new(vec![1u8; total]));

    if profile && args.iter().any(|a| a == "gathered") {
        let max_frame = frames[0];
        let direct_b = direct.clone();
        for _ in 0..20 {
            let c = cpu_seconds();
            let (t, produced) =
                pipelined_run(&rt, &mut pool_a, &table_a, &layers, &pool_b, &table_b, max_frame, direct_b.clone())?;
            let cpu = (cpu_seconds() - c - produced) / (total as f64 / 1e9);
            println!("gathered: {:.2} GB/s, {cpu:.3} CPU-s/GB (production excluded)", gbps(t));
        }
        return Ok(());
    }
    if profile && args.iter().any(|a| a == "pinned") {
        let max_frame = frames[0];
        let direct_b = direct.clone();
        for _ in 0..20 {
            let c = cpu_seconds();
            let (t, produced) = pinned_run(
                &rt,
                &mut pool_p,
                &source_p,
                &table_p,
                &layers,
                &pool_b,
                &table_b,
                max_frame,
                direct_b.clone(),
            )?;
            let cpu = (cpu_seconds() - c - produced) / (total as f64 / 1e9);
            println!("pinned: {:.2} GB/s, {cpu:.3} CPU-s/GB (production excluded)", gbps(t));
        }
        return Ok(());
    }
    if profile && args.iter().any(|a| a == "direct") {
        let max_frame = frames[0];
        for _ in 0..20 {
            let c = cpu_seconds();
            let d = Some(direct.clone());
            let (t, _) = rt.block_on(transport_pool_run(&pool_a, &table_a, &pool_b, &table_b, max_frame, d))?;
            let cpu = (cpu_seconds() - c) / (total as f64 / 1e9);
            println!("direct: {:.2} GB/s, {cpu:.3} CPU-s/GB (gathered by the sender, read into the pool)", gbps(t));
        }
        return Ok(());
    }
    if profile {
        let max_frame = frames[0];
        let raw = args.iter().any(|a| a == "raw");
        for _ in 0..20 {
            let c = cpu_seconds();
            let t = if raw {
                let buf = std::mem::take(&mut *lock(&dst));
                let (t, buf) = rt.block_on(raw_same_memory_run(&layers, buf, frame_payload(max_frame) / 2))?;
                *lock(&dst) = buf;
                t
            } else {
                rt.block_on(transport_mem_run(&layers, &dst, max_frame))?
            };
            let cpu = (cpu_seconds() - c) / (total as f64 / 1e9);
            println!("{}: {:.2} GB/s, {cpu:.2} CPU-s/GB", if raw { "raw" } else { "transport" }, gbps(t));
        }
        return Ok(());
    }

    for max_frame in frames {
        let chunk = frame_payload(max_frame);
        println!("\nframes <= {} KiB ({chunk} bytes of payload, {} blocks)", max_frame >> 10, chunk / (2 * SIDE));
        let [mut mem, mut pool, mut pool_direct, mut piped, mut pinned, mut gather, mut raw, mut hot, mut copy, mut par]: [Vec<
            Duration,
        >;
            10] = Default::default();
        let mut locks: [Option<String>; 4] = Default::default();
        // CPU seconds of the whole process per run (raw, memory, pool, direct,
        // as the workers run): on a host whose cores the transfer saturates,
        // throughput follows CPU time per byte.
        let mut cpu: [Vec<f64>; 6] = Default::default();
        for _ in 0..RUNS {
            let buf = std::mem::take(&mut *lock(&dst));
            let (t, buf) = cpu_of(&mut cpu[0], || rt.block_on(raw_same_memory_run(&layers, buf, chunk / 2)))?;
            *lock(&dst) = buf;
            raw.push(t);
            lock_take();
            mem.push(cpu_of(&mut cpu[1], || rt.block_on(transport_mem_run(&layers, &dst, max_frame)))?);
            locks[0] = lock_take();
            let run = || rt.block_on(transport_pool_run(&pool_a, &table_a, &pool_b, &table_b, max_frame, None));
            let (t, g) = cpu_of(&mut cpu[2], run)?;
            locks[1] = lock_take();
            pool.push(t);
            gather.push(g);
            // Cleared first, so the check after the runs sees what direct reads wrote.
            lock(&pool_b).clear(&table_b)?;
            let d = Some(direct.clone());
            let run = || rt.block_on(transport_pool_run(&pool_a, &table_a, &pool_b, &table_b, max_frame, d));
            let (t, _) = cpu_of(&mut cpu[3], run)?;
            locks[3] = lock_take();
            pool_direct.push(t);
            lock(&pool_b).clear(&table_b)?;
            // These two produce each layer as the engine would (written into the pool
            // just before it goes): that writing is the model's work, not the
            // transport's, so its CPU time (the producing thread's) is taken off.
            let run =
                || pipelined_run(&rt, &mut pool_a, &table_a, &layers, &pool_b, &table_b, max_frame, direct.clone());
            let (t, produced) = cpu_of(&mut cpu[4], run)?;
            piped.push(t);
            exclude_last(&mut cpu[4], produced);
            lock(&pool_b).clear(&table_b)?;
            let run = || {
                pinned_run(&rt, &mut pool_p, &source_p, &table_p, &layers, &pool_b, &table_b, max_frame, direct.clone())
            };
            let (t, produced) = cpu_of(&mut cpu[5], run)?;
            pinned.push(t);
            exclude_last(&mut cpu[5], produced);
            par.push(rt.block_on(transport_parallel_run(&layers, PARALLEL, max_frame))?);
            locks[2] = lock_take();
            hot.push(rt.block_on(raw_hot_run(total, chunk))?);
            copy.push(memcpy_run(total, chunk));
        }
        if lock(&pool_b).gather(&table_b)? != want {
            return Err("KV differs after the pool -> pool transfer".into());
        }
        if *lock(&dst) != expected_dst(&layers, chunk) {
            return Err("bytes differ after the memory -> memory transfer".into());
        }

        let [m, p, g, r, h, c] = [&mem, &pool, &gather, &raw, &hot, &copy].map(|t| rates(t));
        println!("  transport, memory -> memory:   {:6.2} GB/s best, {:6.2} median", m.0, m.1);
        println!(
            "  transport, pool -> pool:       {:6.2} GB/s best, {:6.2} median  (gather_layer alone: {:.2} GB/s)",
            p.0, p.1, g.0
        );
        let pd = rates(&pool_direct);
        println!("  transport, pool -> pool direct:{:6.2} GB/s best, {:6.2} median  (read into the pool)", pd.0, pd.1);
        let pp = rates(&piped);
        println!("  transport, as the workers run: {:6.2} GB/s best, {:6.2} median  (gathered on a thread, read into the pool)", pp.0, pp.1);
        let pn = rates(&pinned);
        println!("  transport, pinned (no gather): {:6.2} GB/s best, {:6.2} median  (checksummed on a thread, written from the pool, read into the pool)", pn.0, pn.1);
        let q = rates(&par);
        println!(
            "  transport, {PARALLEL} senders at once:   {:6.2} GB/s best, {:6.2} median  (deferred sink, lock taken every ms)",
            q.0, q.1
        );
        println!("  raw tcp, same memory:          {:6.2} GB/s best, {:6.2} median", r.0, r.1);
        println!("  raw tcp, hot buffer:           {:6.2} GB/s best, {:6.2} median", h.0, h.1);
        println!("  memcpy:                        {:6.2} GB/s best, {:6.2} median", c.0, c.1);
        println!(
            "  ratio transport/raw same memory, memory -> memory: {:.2} best, {:.2} median (goal >= 0.8)",
            m.0 / r.0,
            m.1 / r.1
        );
        println!("  ratio transport/raw same memory, pool -> pool:     {:.2} best, {:.2} median", p.0 / r.0, p.1 / r.1);
        println!(
            "  ratio transport/raw same memory, pool -> pool direct: {:.2} best, {:.2} median (goal >= 0.85)",
            pd.0 / r.0,
            pd.1 / r.1
        );
        let gb = total as f64 / 1e9;
        let per_gb: Vec<String> = cpu
            .iter()
            .zip(["raw tcp", "memory -> memory", "pool -> pool", "pool -> pool direct", "as the workers run", "pinned"])
            .map(|(c, what)| {
                let mut c = c.clone();
                c.sort_by(f64::total_cmp);
                format!("{what} {:.3}", c[c.len() / 2] / gb)
            })
            .collect();
        println!("  CPU seconds per GB, median (both ends, this process): {}", per_gb.join(", "));
        let by_cpu = |i: usize| {
            let mut r: Vec<f64> = cpu[0].iter().zip(&cpu[i]).map(|(raw, t)| raw / t).collect();
            r.sort_by(f64::total_cmp);
            r
        };
        for (what, i) in [("as the workers run", 4), ("pinned (no gather)", 5)] {
            let r = by_cpu(i);
            println!(
                "  {what}: raw tcp's CPU per byte / its own (the layer's production excluded), run by run: {} (median {:.2}; goal >= 0.85)",
                r.iter().map(|x| format!("{x:.2}")).collect::<Vec<_>>().join(" "),
                r[r.len() / 2]
            );
        }
        for (what, runs) in
            [("pool -> pool direct", &pool_direct), ("as the workers run", &piped), ("pinned (no gather)", &pinned)]
        {
            let paired = paired_ratios(runs, &raw);
            println!(
                "  {what} / raw same memory, run by run: {} (median {:.2}; goal >= 0.85)",
                paired.iter().map(|x| format!("{x:.2}")).collect::<Vec<_>>().join(" "),
                paired[paired.len() / 2]
            );
        }
        println!("  ratio transport/raw hot buffer,  memory -> memory: {:.2} best, {:.2} median", m.0 / h.0, m.1 / h.1);
        println!("  ratio transport/raw hot buffer,  pool -> pool:     {:.2} best, {:.2} median", p.0 / h.0, p.1 / h.1);
        let what = ["memory -> memory", "pool -> pool", "senders at once", "pool -> pool direct"];
        for (w, l) in what.iter().zip(&locks) {
            if let Some(l) = l {
                println!("  receiver lock, {w} (last run): {l}");
            }
        }
        if locks[0].is_some() {
            let frames = TOTAL.div_ceil(chunk);
            println!("  frames per transfer: {frames}");
        }
    }
    // The alternative to the lock, priced on the same runtime: idle, then
    // while the parallel variant runs (its lock figures alongside).
    let idle = rt.block_on(actor_hops(Arc::new(AtomicBool::new(true)), 100_000));
    println!("\nactor round trip (a request to an owning task and its answer), idle runtime: {}", summary_us(&idle));
    let stop = Arc::new(AtomicBool::new(false));
    lock_take();
    let (t, hops) = rt.block_on(async {
        let hops = tokio::spawn(actor_hops(stop.clone(), 1));
        let t = transport_parallel_run(&layers, PARALLEL, 1 << 20).await;
        stop.store(true, Ordering::Relaxed);
        (t, hops.await)
    });
    println!("while {PARALLEL} senders run (1 MiB frames, {:.2} GB/s): actor {}", gbps(t?), summary_us(&hops?));
    if let Some(l) = lock_take() {
        println!("  receiver lock meanwhile: {l}");
    }
    Ok(())
}

/// `f`'s result, its CPU seconds (the whole process's) pushed to `cpu`.
fn cpu_of<T>(cpu: &mut Vec<f64>, f: impl FnOnce() -> T) -> T {
    let start = cpu_seconds();
    let out = f();
    cpu.push(cpu_seconds() - start);
    out
}

/// Each run's rate against the same run's baseline, sorted: noise from the
/// machine hits a run and its baseline alike.
fn paired_ratios(runs: &[Duration], base: &[Duration]) -> Vec<f64> {
    let mut r: Vec<f64> = runs.iter().zip(base).map(|(t, b)| b.as_secs_f64() / t.as_secs_f64()).collect();
    r.sort_by(f64::total_cmp);
    r
}

fn crc_speed() {
    for (what, len, reps) in [("64 MiB buffer", 64usize << 20, 1), ("1 MiB buffer, in cache", 1 << 20, 64)] {
        let buf: Vec<u8> = (0..len).map(|i| i as u8).collect();
        let mut c = crc32c::crc32c(&buf);
        let t = Instant::now();
        for _ in 0..reps {
            c = crc32c::crc32c_append(c, &buf);
        }
        let rate = (len * reps) as f64 / t.elapsed().as_secs_f64() / 1e9;
        let t = Instant::now();
        let mut f = kvtransfer::checksum::crc32c_append(0, &buf);
        for _ in 0..reps {
            f = kvtransfer::checksum::crc32c_append(f, &buf);
        }
        let folded = (len * reps) as f64 / t.elapsed().as_secs_f64() / 1e9;
        assert_eq!(f, c, "the two checksums agree");
        println!("crc32c, {what}: {rate:.2} GB/s by the CRC instruction, {folded:.2} GB/s as the transports take it");
    }
}

/// One full transfer pool -> pool; returns (total time, time spent in gather_layer).
async fn transport_pool_run(
    pool_a: &KvPool,
    table_a: &[BlockId],
    pool_b: &Arc<Mutex<KvPool>>,
    table_b: &[BlockId],
    max_frame: usize,
    direct: Option<DirectPool>,
) -> Res<(Duration, Duration)> {
    let rx = Arc::new(Mutex::new(Receiver::new(peer(), ReceiverConfig::new(LAYOUT))?));
    let server_config = TcpServerConfig { direct, ..TcpServerConfig::default() };
    let server = TcpKvServer::bind("127.0.0.1:0", rx.clone(), pool_b.clone(), server_config).await?;
    let r = lock(&rx).reserve(table_b.to_vec(), Duration::from_secs(60), tokio::time::Instant::now())?;
    let config = TcpSenderConfig { max_frame_bytes: max_frame, ..TcpSenderConfig::default() };
    let mut tx = TcpKvSender::connect(server.local_addr(), &peer(), LAYOUT, config).await?;

    let start = Instant::now();
    let mut gather = Duration::ZERO;
    let (mut k, mut v) = (Vec::new(), Vec::new());
    for layer in 0..LAYOUT.n_layers {
        let g = Instant::now();
        pool_a.gather_layer_into(layer, table_a, &mut k, &mut v)?;
        gather += g.elapsed();
        tx.send_layer(r, layer, &k, &v).await?;
    }
    tx.complete(r).await?;
    let elapsed = start.elapsed();
    let blocks = lock(&rx).take_ready(r)?;
    assert_eq!(blocks, table_b);
    server.shutdown();
    Ok((elapsed, gather))
}

/// One full transfer pool -> pool as the prefill and decode workers run it:
/// a thread (the prefill engine's) writes each layer of each step's blocks
/// (the model computing it, from `layers`; [`steps`]), gathers it into one of a few recycled
/// buffer pairs while it is in cache and hands it over, the sender sends it
/// meanwhile, and the server reads each payload straight into `pool_b`'s
/// blocks. Clocked from the first layer written to the `Ack`; also returns
/// the CPU seconds the writing took (the thread's clock), which is the
/// model's work.
#[allow(clippy::too_many_arguments, reason = "one run's whole context")]
fn pipelined_run(
    rt: &tokio::runtime::Runtime,
    pool_a: &mut KvPool,
    table_a: &[BlockId],
    layers: &[(Vec<u8>, Vec<u8>)],
    pool_b: &Arc<Mutex<KvPool>>,
    table_b: &[BlockId],
    max_frame: usize,
    direct: DirectPool,
) -> Res<(Duration, f64)> {
    let (rx, server, r, mut tx) = reading_into(rt, pool_b, table_b, max_frame, direct)?;
    let (full, mut gathered) = tokio::sync::mpsc::channel::<(usize, usize, Vec<u8>, Vec<u8>)>(2);
    let (empty, recycled) = std::sync::mpsc::channel::<(Vec<u8>, Vec<u8>)>();
    for _ in 0..3 {
        empty.send((Vec::new(), Vec::new()))?;
    }
    let start = Instant::now();
    let (elapsed, produced) = std::thread::scope(|scope| {
        let engine = scope.spawn(move || {
            let mut produced = 0.0;
            for (first, blocks) in steps(table_a) {
                for (layer, (k, v)) in layers.iter().enumerate() {
                    let Ok((mut gk, mut gv)) = recycled.recv() else { return produced };
                    let t = thread_cpu_seconds();
                    let part = first * SIDE..(first + blocks.len()) * SIDE;
                    pool_a.scatter_layer(layer, blocks, &k[part.clone()], &v[part]).expect("produce");
                    produced += thread_cpu_seconds() - t;
                    pool_a.gather_layer_into(layer, blocks, &mut gk, &mut gv).expect("gather");
                    if full.blocking_send((layer, first, gk, gv)).is_err() {
                        return produced;
                    }
                }
            }
            produced
        });
        let sent = rt.block_on(async {
            while let Some((layer, first, k, v)) = gathered.recv().await {
                tx.send_blocks(r, layer, first, &k, &v).await?;
                let _ = empty.send((k, v));
            }
            tx.complete(r).await?;
            Ok::<_, kvtransfer::TransferError>(start.elapsed())
        });
        sent.map(|t| (t, engine.join().unwrap_or(0.0)))
    })?;
    assert_eq!(lock(&rx).take_ready(r)?, table_b);
    server.shutdown();
    Ok((elapsed, produced))
}

/// One full transfer pool -> pool as the workers run it with a prefill pool in mapped
/// memory: a thread (the prefill engine's) writes each layer of each step's blocks (the
/// model computing it, from `layers`; [`steps`]), takes the layer's frame checksums there while it is in
/// cache and hands the layer over; the sender writes each frame from the blocks where
/// they lie; the server reads each payload straight into `pool_b`'s. Clocked from the
/// first layer written to the `Ack`; also returns the writing's CPU seconds.
#[allow(clippy::too_many_arguments, reason = "one run's whole context")]
fn pinned_run(
    rt: &tokio::runtime::Runtime,
    pool_p: &mut KvPool,
    source: &DirectPool,
    table_p: &[BlockId],
    layers: &[(Vec<u8>, Vec<u8>)],
    pool_b: &Arc<Mutex<KvPool>>,
    table_b: &[BlockId],
    max_frame: usize,
    direct: DirectPool,
) -> Res<(Duration, f64)> {
    let (rx, server, r, mut tx) = reading_into(rt, pool_b, table_b, max_frame, direct)?;
    let (ready, mut pinned) = tokio::sync::mpsc::channel::<PinnedLayer>(2 * LAYOUT.n_layers);
    let start = Instant::now();
    let (elapsed, produced) = std::thread::scope(|scope| {
        let engine = scope.spawn(move || {
            let mut produced = 0.0;
            for (first, blocks) in steps(table_p) {
                for (layer, (k, v)) in layers.iter().enumerate() {
                    let t = thread_cpu_seconds();
                    let part = first * SIDE..(first + blocks.len()) * SIDE;
                    pool_p.scatter_layer(layer, blocks, &k[part.clone()], &v[part]).expect("produce");
                    produced += thread_cpu_seconds() - t;
                    let (k, v) = pool_p.layer_bytes(layer).expect("layer bytes");
                    let p = PinnedLayer::new(&LAYOUT, layer, first, blocks, k, v, max_frame).expect("pinned layer");
                    if ready.blocking_send(p).is_err() {
                        return produced;
                    }
                }
            }
            produced
        });
        let sent = rt.block_on(async {
            while let Some(p) = pinned.recv().await {
                tx.send_pinned(r, &p, source).await?;
            }
            tx.complete(r).await?;
            Ok::<_, kvtransfer::TransferError>(start.elapsed())
        });
        sent.map(|t| (t, engine.join().unwrap_or(0.0)))
    })?;
    assert_eq!(lock(&rx).take_ready(r)?, table_b);
    server.shutdown();
    Ok((elapsed, produced))
}

/// Blocks a prefill step of the engine's default 512 tokens computes.
const STEP_BLOCKS: usize = 512 / LAYOUT.block_size;

/// `table` cut into the runs of blocks the engine's steps compute, each with its index in
/// the table: every layer of a run is computed (and streamed) before the next run's.
fn steps(table: &[BlockId]) -> impl Iterator<Item = (usize, &[BlockId])> {
    table.chunks(STEP_BLOCKS).enumerate().map(|(i, blocks)| (i * STEP_BLOCKS, blocks))
}

/// A server reading straight into `pool_b` (`direct` over it), a reservation of
/// `table_b`, and a sender connected to it with frames of `max_frame`.
fn reading_into(
    rt: &tokio::runtime::Runtime,
    pool_b: &Arc<Mutex<KvPool>>,
    table_b: &[BlockId],
    max_frame: usize,
    direct: DirectPool,
) -> Res<(Arc<Mutex<Receiver>>, TcpKvServer, kvtransfer::Reservation, TcpKvSender)> {
    let rx = Arc::new(Mutex::new(Receiver::new(peer(), ReceiverConfig::new(LAYOUT))?));
    let server_config = TcpServerConfig { direct: Some(direct), ..TcpServerConfig::default() };
    let server = rt.block_on(TcpKvServer::bind("127.0.0.1:0", rx.clone(), pool_b.clone(), server_config))?;
    let r = lock(&rx).reserve(table_b.to_vec(), Duration::from_secs(60), tokio::time::Instant::now())?;
    let config = TcpSenderConfig { max_frame_bytes: max_frame, ..TcpSenderConfig::default() };
    let tx = rt.block_on(TcpKvSender::connect(server.local_addr(), &peer(), LAYOUT, config))?;
    Ok((rx, server, r, tx))
}

/// Takes `seconds` off the last sample of `cpu`.
fn exclude_last(cpu: &mut [f64], seconds: f64) {
    if let Some(last) = cpu.last_mut() {
        *last -= seconds;
    }
}

/// This thread's CPU seconds so far (`CLOCK_THREAD_CPUTIME_ID`).
fn thread_cpu_seconds() -> f64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

/// The transport alone: pre-gathered layers in, each accepted payload
/// copied by a sink to its place in `dst` (the bytes a pool scatter
/// would move, at memcpy speed), so the pool's gather/scatter are excluded.
async fn transport_mem_run(
    layers: &[(Vec<u8>, Vec<u8>)],
    dst: &Arc<Mutex<Vec<u8>>>,
    max_frame: usize,
) -> Res<Duration> {
    let sink = dst_sink(dst);
    let rx = Arc::new(Mutex::new(Receiver::new(peer(), ReceiverConfig::new(LAYOUT))?));
    let server = TcpKvServer::bind("127.0.0.1:0", rx.clone(), sink, TcpServerConfig::default()).await?;
    let ids: Vec<BlockId> = (0..BLOCKS as BlockId).collect();
    let r = lock(&rx).reserve(ids, Duration::from_secs(60), tokio::time::Instant::now())?;
    let config = TcpSenderConfig { max_frame_bytes: max_frame, ..TcpSenderConfig::default() };
    let mut tx = TcpKvSender::connect(server.local_addr(), &peer(), LAYOUT, config).await?;
    let start = Instant::now();
    for (layer, (k, v)) in layers.iter().enumerate() {
        tx.send_layer(r, layer, k, v).await?;
    }
    tx.complete(r).await?;
    let elapsed = start.elapsed();
    server.shutdown();
    Ok(elapsed)
}

/// `n` senders at once, each its own connection and a reservation of its
/// share of the blocks, into one receiver whose sink hands each payload to
/// another thread (as the decode worker's sink hands it to the engine
/// thread), while a task takes the receiver's lock every millisecond (as
/// the decode worker's reaper and request tasks do). Clocked until every
/// sender's `Complete` was acknowledged.
async fn transport_parallel_run(layers: &[(Vec<u8>, Vec<u8>)], n: usize, max_frame: usize) -> Res<Duration> {
    let (jobs, done) = std::sync::mpsc::channel::<kvtransfer::OwnedPayload>();
    let drain = std::thread::spawn(move || {
        let mut bytes = 0usize;
        for p in done {
            bytes += (*p).as_ref().len();
        }
        bytes
    });
    let sink = Deferred(jobs);
    let rx = Arc::new(Mutex::new(Receiver::new(peer(), ReceiverConfig::new(LAYOUT))?));
    let server = TcpKvServer::bind("127.0.0.1:0", rx.clone(), sink, TcpServerConfig::default()).await?;
    let per = BLOCKS / n;
    let mut reservations = Vec::new();
    for i in 0..n {
        let ids: Vec<BlockId> = ((i * per) as BlockId..((i + 1) * per) as BlockId).collect();
        reservations.push(lock(&rx).reserve(ids, Duration::from_secs(60), tokio::time::Instant::now())?);
    }
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let poller = {
        let (rx, stop) = (rx.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                {
                    let mut r = lock(&rx);
                    let _ = r.poll_released(tokio::time::Instant::now());
                    std::hint::black_box(r.counters().clone());
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
    };
    let config = TcpSenderConfig { max_frame_bytes: max_frame, ..TcpSenderConfig::default() };
    let start = Instant::now();
    let mut senders = tokio::task::JoinSet::new();
    for (i, r) in reservations.into_iter().enumerate() {
        let addr = server.local_addr();
        let config = config.clone();
        let layers: Vec<(Vec<u8>, Vec<u8>)> = layers
            .iter()
            .map(|(k, v)| {
                (k[i * per * SIDE..(i + 1) * per * SIDE].to_vec(), v[i * per * SIDE..(i + 1) * per * SIDE].to_vec())
            })
            .collect();
        senders.spawn(async move {
            let mut tx = TcpKvSender::connect(addr, &peer(), LAYOUT, config).await?;
            for (layer, (k, v)) in layers.iter().enumerate() {
                tx.send_layer(r, layer, k, v).await?;
            }
            tx.complete(r).await?;
            Ok::<_, kvtransfer::TransferError>(())
        });
    }
    while let Some(r) = senders.join_next().await {
        r??;
    }
    let elapsed = start.elapsed();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    poller.await?;
    server.shutdown();
    drop(rx);
    let _ = drain.join();
    // Per-sender copies of the layers were made before the clock started.
    Ok(elapsed.mul_f64(TOTAL as f64 / (n * per * 2 * SIDE * LAYOUT.n_layers) as f64))
}

/// Hands each payload to another thread, as the decode worker's sink does.
#[derive(Clone)]
struct Deferred(std::sync::mpsc::Sender<kvtransfer::OwnedPayload>);

impl kvtransfer::BlockSink for Deferred {
    fn write_layer(&mut self, _: usize, _: &[BlockId], _: &[u8], _: &[u8]) -> Result<(), String> {
        Err("payloads by value only".into())
    }

    fn write_layer_owned(
        &mut self,
        _w: kvtransfer::WriteInstruction,
        payload: kvtransfer::OwnedPayload,
    ) -> Result<(), String> {
        self.0.send(payload).map_err(|_| "drain thread gone".to_string())
    }
}

/// The same layer bytes over a plain socket pair: K then V pieces of
/// `piece` bytes, as the transport frames them, read straight into `dst`.
async fn raw_same_memory_run(
    layers: &[(Vec<u8>, Vec<u8>)],
    mut dst: Vec<u8>,
    piece: usize,
) -> Res<(Duration, Vec<u8>)> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let reader = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await?;
        read_into(&mut s, &mut dst).await?;
        s.write_all(b"k").await?;
        Ok::<_, std::io::Error>(dst)
    });
    let mut s = TcpStream::connect(addr).await?;
    s.set_nodelay(true)?;
    let start = Instant::now();
    write_layers(&mut s, layers, piece).await?;
    let mut ack = [0u8; 1];
    s.read_exact(&mut ack).await?;
    let elapsed = start.elapsed();
    let dst = reader.await??;
    Ok((elapsed, dst))
}

/// `total` bytes over a plain socket pair from one `chunk`-byte buffer into another.
async fn raw_hot_run(total: usize, chunk: usize) -> Res<Duration> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let reader = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await?;
        let mut buf = vec![0u8; chunk];
        let mut got = 0;
        while got < total {
            let n = s.read(&mut buf).await?;
            if n == 0 {
                return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof));
            }
            got += n;
        }
        s.write_all(b"k").await?;
        Ok::<_, std::io::Error>(())
    });
    let mut s = TcpStream::connect(addr).await?;
    s.set_nodelay(true)?;
    let buf: Vec<u8> = (0..chunk).map(|i| i as u8).collect();
    let start = Instant::now();
    let mut sent = 0;
    while sent < total {
        let n = chunk.min(total - sent);
        s.write_all(&buf[..n]).await?;
        sent += n;
    }
    let mut ack = [0u8; 1];
    s.read_exact(&mut ack).await?;
    let elapsed = start.elapsed();
    reader.await??;
    Ok(elapsed)
}

/// The same bytes copied in `chunk`-byte pieces between buffers larger than
/// the cache.
fn memcpy_run(total: usize, chunk: usize) -> Duration {
    let span = 64 << 20;
    let src: Vec<u8> = (0..span).map(|i| i as u8).collect();
    // Touched up front (a zeroed Vec would be fresh pages, faulted in on
    // the clock), as every buffer the transport writes is and as
    // `benches/local.rs` does.
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
