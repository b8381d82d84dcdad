//! TCP transport throughput on loopback against two baselines.
//!
//! Moves the KV of `BLOCKS` blocks of the real SmolLM2-135M layout (30
//! layers, 3 KV heads, head dim 64, block size 16, F16: ~264 MiB) from one
//! pool into other block ids of a second pool, with sender and receiver in
//! this one process, and in the same run:
//! - raw TCP: a plain tokio writer/reader pair moving the same bytes in the
//!   same chunk sizes (the ceiling for any TCP transport here);
//! - memcpy: the same bytes copied in the same chunk sizes (the ceiling for
//!   anything in one address space).
//!
//! The transport figure includes everything the worker binaries will do:
//! `gather_layer` on the sender, checksums both ways, framing, decode and
//! `scatter_layer` into the receiving pool.
//!
//! Run: `cargo bench -p kvtransfer --bench tcp` (optional args: frame sizes in
//! MiB, e.g. `-- 1 4`).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use engine::kv::{BlockId, KvDtype, KvLayout, KvPool};
use kvtransfer::frame::LAYER_DATA_OVERHEAD;
use kvtransfer::{
    BlockSink, FnSink, LayoutFingerprint, Peer, Receiver, ReceiverConfig, TcpKvSender, TcpKvServer, TcpSenderConfig,
    TcpServerConfig, VersionGroup,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const LAYOUT: KvLayout = KvLayout { n_layers: 30, n_kv_heads: 3, head_dim: 64, block_size: 16, dtype: KvDtype::F16 };
/// 729 blocks x 368,640 bytes = 268.7 MB (256.3 MiB).
const BLOCKS: usize = 729;
const RUNS: usize = 5;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn main() -> Res<()> {
    let frame_mibs: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let frame_mibs = if frame_mibs.is_empty() { vec![1, 4] } else { frame_mibs };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;

    let total = BLOCKS * LAYOUT.block_bytes();
    println!(
        "layout {LAYOUT:?}; {BLOCKS} blocks = {:.1} MiB per transfer; best and median of {RUNS} runs",
        total as f64 / (1 << 20) as f64
    );
    {
        let buf: Vec<u8> = (0..64usize << 20).map(|i| i as u8).collect();
        let t = Instant::now();
        let c = crc32c::crc32c(&buf);
        println!("crc32c: {:.2} GB/s ({c:#x})", buf.len() as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    let (pool_a, table_a) = source();
    let pool_b = Arc::new(Mutex::new(KvPool::new(LAYOUT, BLOCKS + 7)?));
    let _decoys = lock(&pool_b).allocate(7)?;
    let table_b = lock(&pool_b).allocate(BLOCKS)?;
    let want = pool_a.gather(&table_a)?;
    let layers: Vec<(Vec<u8>, Vec<u8>)> =
        (0..LAYOUT.n_layers).map(|l| pool_a.gather_layer(l, &table_a)).collect::<Result<_, _>>()?;

    for mib in frame_mibs {
        let max_frame = mib << 20;
        let side = LAYOUT.block_elems() * LAYOUT.dtype.size();
        let chunk = (max_frame - LAYER_DATA_OVERHEAD) / (2 * side) * 2 * side;
        println!("\nframes <= {mib} MiB ({} bytes of payload, {} blocks)", chunk, chunk / (2 * side));

        let mut tcp = Vec::new();
        let mut gather = Vec::new();
        let mut bare = Vec::new();
        for _ in 0..RUNS {
            bare.push(rt.block_on(transport_only_run(&layers, max_frame))?);
        }
        for _ in 0..RUNS {
            let (t, g) = rt.block_on(transport_run(&pool_a, &table_a, &pool_b, &table_b, max_frame))?;
            tcp.push(t);
            gather.push(g);
        }
        let got = lock(&pool_b).gather(&table_b)?;
        if got != want {
            return Err("KV differs after the transfer".into());
        }
        let raw: Vec<Duration> = (0..RUNS).map(|_| rt.block_on(raw_run(total, chunk))).collect::<Res<_>>()?;
        let mem: Vec<Duration> = (0..RUNS).map(|_| memcpy_run(total, chunk)).collect();

        let (tb, tm) = rates(total, &tcp);
        let (rb, rm) = rates(total, &raw);
        let (mb, mm) = rates(total, &mem);
        let (gb, _) = rates(total, &gather);
        let (bb, bm) = rates(total, &bare);
        println!(
            "  tcp transport (pool -> pool): {tb:6.2} GB/s best, {tm:6.2} median  (gather_layer alone: {gb:.2} GB/s)"
        );
        println!("  tcp transport (memory -> memory, no pool): {bb:6.2} GB/s best, {bm:6.2} median");
        println!("  raw tcp baseline:             {rb:6.2} GB/s best, {rm:6.2} median");
        println!("  memcpy baseline:              {mb:6.2} GB/s best, {mm:6.2} median");
        println!("  ratio tcp/raw, pool -> pool:     {:.2} best, {:.2} median (goal >= 0.8)", tb / rb, tm / rm);
        println!("  ratio tcp/raw, memory -> memory: {:.2} best, {:.2} median", bb / rb, bm / rm);
    }
    Ok(())
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

fn source() -> (KvPool, Vec<BlockId>) {
    let mut pool = KvPool::new(LAYOUT, BLOCKS + 3).unwrap_or_else(|e| panic!("pool A: {e}"));
    let _skip = pool.allocate(3).unwrap_or_else(|e| panic!("{e}"));
    let table = pool.allocate(BLOCKS).unwrap_or_else(|e| panic!("{e}"));
    let row = LAYOUT.row_elems();
    let mut k = vec![0f32; row];
    let mut v = vec![0f32; row];
    for layer in 0..LAYOUT.n_layers {
        for (i, &b) in table.iter().enumerate() {
            for slot in 0..LAYOUT.block_size {
                for j in 0..row {
                    k[j] = ((layer * 31 + i * 7 + slot * 3 + j) % 2048) as f32 * 0.125;
                    v[j] = -k[j];
                }
                pool.write(layer, b, slot, &k, &v);
            }
        }
    }
    (pool, table)
}

/// One full transfer; returns (total time, time spent in gather_layer).
async fn transport_run(
    pool_a: &KvPool,
    table_a: &[BlockId],
    pool_b: &Arc<Mutex<KvPool>>,
    table_b: &[BlockId],
    max_frame: usize,
) -> Res<(Duration, Duration)> {
    let rx = Arc::new(Mutex::new(Receiver::new(peer(), ReceiverConfig::new(LAYOUT))?));
    let server = TcpKvServer::bind("127.0.0.1:0", rx.clone(), pool_b.clone(), TcpServerConfig::default()).await?;
    let r = lock(&rx).reserve(table_b.to_vec(), Duration::from_secs(60), tokio::time::Instant::now().into_std())?;
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

/// The transport alone: pre-gathered layers in, payloads copied into one
/// big buffer by a [`FnSink`] (the same bytes a pool scatter would move,
/// at memcpy speed), so the pool's own gather/scatter cost is excluded.
async fn transport_only_run(layers: &[(Vec<u8>, Vec<u8>)], max_frame: usize) -> Res<Duration> {
    let side = LAYOUT.block_elems() * LAYOUT.dtype.size();
    let per_layer = BLOCKS * 2 * side;
    // Touched up front: page faults on a fresh buffer are not the transport's cost.
    let mut dst = vec![1u8; LAYOUT.n_layers * per_layer];
    let sink = FnSink(move |layer: usize, blocks: &[BlockId], k: &[u8], v: &[u8]| {
        // Pool ids 0..BLOCKS stand for positions in the reservation.
        let at = (layer * BLOCKS + blocks.first().copied().unwrap_or(0) as usize) * 2 * side;
        let out = dst.get_mut(at..at + k.len() + v.len()).ok_or("out of range")?;
        out[..k.len()].copy_from_slice(k);
        out[k.len()..].copy_from_slice(v);
        Ok(())
    });
    let rx = Arc::new(Mutex::new(Receiver::new(peer(), ReceiverConfig::new(LAYOUT))?));
    let sink = Arc::new(Mutex::new(sink));
    let server = TcpKvServer::bind("127.0.0.1:0", rx.clone(), SharedSink(sink), TcpServerConfig::default()).await?;
    let ids: Vec<BlockId> = (0..BLOCKS as BlockId).collect();
    let r = lock(&rx).reserve(ids, Duration::from_secs(60), tokio::time::Instant::now().into_std())?;
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

/// A sink shared by the server's connections.
#[derive(Clone)]
struct SharedSink<S>(Arc<Mutex<S>>);

impl<S: BlockSink> BlockSink for SharedSink<S> {
    fn write_layer(&mut self, layer: usize, blocks: &[BlockId], k: &[u8], v: &[u8]) -> Result<(), String> {
        lock(&self.0).write_layer(layer, blocks, k, v)
    }
}

/// The same bytes over a plain socket pair, in `chunk`-byte writes and reads.
async fn raw_run(total: usize, chunk: usize) -> Res<Duration> {
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
    let mut dst = vec![0u8; span];
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
