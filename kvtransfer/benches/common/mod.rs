//! What the transport benches share: the layout moved, the memory -> memory
//! sink and its check, the raw-stream baselines' reader and writer, and
//! figures (best and median rates, CPU time).

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use engine::kv::{KvError, KvPool};
use kvtransfer::{BlockSink, FnSink, LayoutFingerprint, Peer, VersionGroup};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use types::kv::{BlockId, KvDtype, KvLayout};

pub type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// The real SmolLM2-135M KV layout.
pub const LAYOUT: KvLayout =
    KvLayout { n_layers: 30, n_kv_heads: 3, head_dim: 64, block_size: 16, dtype: KvDtype::F16 };
/// 729 blocks x 368,640 bytes = 268.7 MB (256.3 MiB).
pub const BLOCKS: usize = 729;
/// Bytes of one block's K (or V) in one layer.
pub const SIDE: usize = LAYOUT.n_kv_heads * LAYOUT.head_dim * LAYOUT.block_size * 2;
/// Bytes of one transfer.
pub const TOTAL: usize = BLOCKS * 2 * SIDE * LAYOUT.n_layers;

/// The pool the benches move KV out of: `blocks` blocks (ids offset by
/// three, so they differ from a fresh pool's) of `layout` filled with
/// values f16 holds exactly, shifted by `seed` (two seeds, two different
/// pools).
pub fn source_pool(layout: KvLayout, blocks: usize, seed: usize) -> Result<(KvPool, Vec<BlockId>), KvError> {
    let mut pool = KvPool::new(layout, blocks + 3)?;
    let _skip = pool.allocate(3)?;
    let table = pool.allocate(blocks)?;
    let row = layout.row_elems();
    let (mut k, mut v) = (vec![0f32; row], vec![0f32; row]);
    for layer in 0..layout.n_layers {
        for (i, &b) in table.iter().enumerate() {
            for slot in 0..layout.block_size {
                for j in 0..row {
                    k[j] = ((layer * 31 + i * 7 + slot * 3 + j + seed) % 2048) as f32 * 0.125;
                    v[j] = -k[j];
                }
                pool.write(layer, b, slot, &k, &v);
            }
        }
    }
    Ok((pool, table))
}

/// Frame sizes from the command line: `256k` (KiB) or `4` (MiB); `default` if none.
pub fn frame_sizes(args: &[String], default: &[usize]) -> Vec<usize> {
    let parsed: Vec<usize> = args
        .iter()
        .filter_map(|a| match a.strip_suffix('k') {
            Some(k) => k.parse::<usize>().ok().map(|k| k << 10),
            None => a.parse::<usize>().ok().map(|m| m << 20),
        })
        .collect();
    if parsed.is_empty() {
        default.to_vec()
    } else {
        parsed
    }
}

pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// (best, median) in GB/s (10^9 bytes per second) for transfers of [`TOTAL`] bytes.
pub fn rates(times: &[Duration]) -> (f64, f64) {
    let mut r: Vec<f64> = times.iter().map(|t| gbps(*t)).collect();
    r.sort_by(|a, b| b.total_cmp(a));
    (r[0], r[r.len() / 2])
}

pub fn gbps(t: Duration) -> f64 {
    TOTAL as f64 / t.as_secs_f64() / 1e9
}

/// CPU seconds this process has used (user + system, every thread), by the
/// nanosecond clock (`CLOCK_PROCESS_CPUTIME_ID`; /proc's 10 ms ticks were a
/// tenth of a transfer's CPU time here): with other work on the machine, CPU
/// per byte is a steadier comparison than wall time.
pub fn cpu_seconds() -> f64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

pub fn peer() -> Peer {
    Peer {
        version_group: VersionGroup::new("smollm2-135m").unwrap_or_else(|e| panic!("label: {e}")),
        fingerprint: LayoutFingerprint::new(&LAYOUT, &[1; 32], &[2; 32]),
    }
}

/// Payload bytes of one frame of at most `max_frame` bytes (whole blocks).
pub fn frame_payload(max_frame: usize) -> usize {
    (max_frame - kvtransfer::frame::LAYER_DATA_OVERHEAD) / (2 * SIDE) * 2 * SIDE
}

/// A sink that copies each accepted payload to its place in `dst` (pool ids
/// `0..BLOCKS` standing for positions in the reservation): the bytes a pool
/// scatter would move, at memcpy speed.
pub fn dst_sink(dst: &Arc<Mutex<Vec<u8>>>) -> impl BlockSink + Clone + 'static {
    let out = dst.clone();
    let per_layer = BLOCKS * 2 * SIDE;
    FnSink(move |layer: usize, blocks: &[BlockId], k: &[u8], v: &[u8]| {
        let at = layer * per_layer + blocks.first().copied().unwrap_or(0) as usize * 2 * SIDE;
        let mut out = lock(&out);
        let out = out.get_mut(at..at + k.len() + v.len()).ok_or("out of range")?;
        out[..k.len()].copy_from_slice(k);
        out[k.len()..].copy_from_slice(v);
        Ok(())
    })
}

/// What `dst` holds after a memory -> memory transfer of `layers` with
/// `payload`-byte frames (or the same K and V pieces over a raw stream).
pub fn expected_dst(layers: &[(Vec<u8>, Vec<u8>)], payload: usize) -> Vec<u8> {
    let mut expect = Vec::with_capacity(TOTAL);
    for (k, v) in layers {
        for (kp, vp) in k.chunks(payload / 2).zip(v.chunks(payload / 2)) {
            expect.extend_from_slice(kp);
            expect.extend_from_slice(vp);
        }
    }
    expect
}

/// Writes the layers as K and V pieces of `piece` bytes.
pub async fn write_layers<W: AsyncWrite + Unpin>(w: &mut W, layers: &[(Vec<u8>, Vec<u8>)], piece: usize) -> Res<()> {
    for (k, v) in layers {
        for (kp, vp) in k.chunks(piece).zip(v.chunks(piece)) {
            w.write_all(kp).await?;
            w.write_all(vp).await?;
        }
    }
    w.flush().await?;
    Ok(())
}

/// Reads exactly `dst.len()` bytes into `dst`.
pub async fn read_into<R: AsyncRead + Unpin>(r: &mut R, dst: &mut [u8]) -> std::io::Result<()> {
    let mut got = 0;
    while got < dst.len() {
        let n = r.read(&mut dst[got..]).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        got += n;
    }
    Ok(())
}

/// The receiver lock's figures since the last call (feature `lock-stats`;
/// `None` without it), and a fresh start for the next.
pub fn lock_take() -> Option<String> {
    #[cfg(feature = "lock-stats")]
    {
        let s = kvtransfer::transport::lock_stats::snapshot();
        kvtransfer::transport::lock_stats::reset();
        let us = |ns: u64| ns as f64 / 1e3;
        Some(format!(
            "{} acquisitions, {} contended ({:.2}%); hold mean {:.2} us, p50 <= {:.2}, p99 <= {:.2}, max {:.2}; \
             contended wait mean {:.2} us, p99 <= {:.2}, max {:.2}; held {:.2} ms in all; waited {:.3} us per acquisition",
            s.acquired,
            s.contended,
            100.0 * s.contended as f64 / s.acquired.max(1) as f64,
            s.hold.mean_ns() / 1e3,
            us(s.hold.quantile_ns(0.5)),
            us(s.hold.quantile_ns(0.99)),
            us(s.hold.max_ns),
            s.wait.mean_ns() / 1e3,
            us(s.wait.quantile_ns(0.99)),
            us(s.wait.max_ns),
            s.hold.sum_ns as f64 / 1e6,
            s.wait.sum_ns as f64 / 1e3 / s.acquired.max(1) as f64,
        ))
    }
    #[cfg(not(feature = "lock-stats"))]
    None
}

/// What one frame would pay if the receiver were owned by a task instead of
/// locked: a request to the owner over a bounded channel and its answer
/// back, each a task wake-up, made one after another on the current
/// runtime until `stop` is set (at least `min` of them). Returns each round
/// trip in ns, sorted.
pub async fn actor_hops(stop: std::sync::Arc<std::sync::atomic::AtomicBool>, min: usize) -> Vec<u64> {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<(u64, tokio::sync::oneshot::Sender<u64>)>(64);
    let owner = tokio::spawn(async move {
        let mut state = 0u64;
        while let Some((v, reply)) = rx.recv().await {
            state = state.wrapping_add(v);
            let _ = reply.send(state);
        }
    });
    let client = tokio::spawn(async move {
        let mut times = Vec::new();
        let mut i = 0u64;
        while times.len() < min || !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let t = tokio::time::Instant::now();
            let (reply, answer) = tokio::sync::oneshot::channel();
            if tx.send((i, reply)).await.is_err() {
                break;
            }
            let _ = answer.await;
            times.push(t.elapsed().as_nanos() as u64);
            i += 1;
        }
        times
    });
    let mut times = client.await.unwrap_or_default();
    let _ = owner.await;
    times.sort_unstable();
    times
}

/// Mean, median and 99th percentile of sorted ns, as "mean X us, p50 Y, p99 Z".
pub fn summary_us(sorted_ns: &[u64]) -> String {
    let n = sorted_ns.len().max(1);
    let at = |q: f64| sorted_ns.get(((n as f64 * q) as usize).min(n - 1)).copied().unwrap_or(0) as f64 / 1e3;
    let mean = sorted_ns.iter().sum::<u64>() as f64 / n as f64 / 1e3;
    format!("{} round trips, mean {mean:.2} us, p50 {:.2}, p99 {:.2}", sorted_ns.len(), at(0.5), at(0.99))
}
