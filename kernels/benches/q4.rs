//! The Q4 kernels over weights larger than the cache, batch size by batch
//! size, in two comparisons, each alternating its two sides step by step so
//! that host noise hits both alike (median step times and their ratio):
//!
//! 1. Packed panels (`kernels::matmul::panels`, what the engine multiplies
//!    with) against the file layout, at the CPU's best level, with a plain
//!    read of the same bytes through the same pool as the ceiling at one
//!    activation row (a decode step).
//! 2. The AVX-512 level's two kernel widths against each other, over packed
//!    panels as the engine runs them: 256-bit
//!    registers with eight weight rows per panel, and 512-bit registers with
//!    sixteen. `AVX512_SMALL_BATCH` (AMD) and `AVX512_SMALL_BATCH_INTEL`
//!    (the batch size up to which the first is used, by CPU vendor) are
//!    chosen from this. Only on CPUs with AVX-512 F/BW/VL and VNNI.
//!
//! Each step multiplies a batch of activation rows by every Q4_1 matrix of
//! a 30-layer SmolLM2-135M-shaped model (576 wide, 1,536 in the MLP; 66 MB,
//! more than this host's cache, so weights stream from memory as in a
//! decode step), on a pool of `--threads` threads (default 2).
//!
//! Run: `cargo bench -p kernels --bench q4` (args: steps per side and batch
//! size, default 15; threads, default 2).

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]
#![allow(clippy::disallowed_types, reason = "measures wall time on purpose (std::time::Instant)")]

use std::time::{Duration, Instant};

use kernels::matmul::panels::pack_q4_panels;
use kernels::matmul::{avx512_small_batch, matmul, set_avx512_small_batch, MatmulScratch};
use kernels::{Isa, QMatrix, ThreadPool, WeightType};

const LAYERS: usize = 30;
const HIDDEN: usize = 576;
const KV: usize = 192;
const FFN: usize = 1536;
const BATCHES: [usize; 7] = [1, 2, 3, 4, 6, 8, 16];

fn main() {
    let mut args = std::env::args().skip(1).filter_map(|a| a.parse::<usize>().ok());
    let steps = args.next().unwrap_or(15).max(1);
    let threads = args.next().unwrap_or(2).max(1);
    println!("q4 kernels, {threads} threads, {steps} steps each; {}", cpu());
    let shapes =
        [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (FFN, HIDDEN), (FFN, HIDDEN), (HIDDEN, FFN)];
    let mut rng = types::rng::XorShift64::new(0x2545_f491_4f6c_dd1d);
    let mut next = move || rng.next_u64();
    let mut data = Vec::new();
    for _ in 0..LAYERS {
        for (rows, cols) in shapes {
            data.push((rows, cols, q4_1_matrix(rows, cols, &mut next)));
        }
    }
    let bytes: usize = data.iter().map(|(.., d)| d.len()).sum();
    let mats: Vec<QMatrix<'_>> = data
        .iter()
        .map(|(rows, cols, d)| QMatrix::new(WeightType::Q4_1, *rows, *cols, d).expect("matrix shape"))
        .collect();
    println!("{} matrices, {:.1} MB of Q4_1 weights per step", mats.len(), bytes as f64 / 1e6);
    let pool = ThreadPool::new(threads).expect("thread pool");
    let mut scratch = MatmulScratch::default();
    let packs: Vec<Vec<u8>> = mats.iter().map(|w| pack_q4_panels(w).expect("Q4 packs")).collect();
    let packed: Vec<QMatrix<'_>> =
        mats.iter().zip(&packs).map(|(w, p)| w.with_panels(p).expect("packed length")).collect();
    let isa = Isa::detect();
    println!("\npacked panels against the file layout ({} level)", isa.name());
    println!("{:>6} {:>12} {:>12} {:>14}", "batch", "file ms", "packed ms", "packed / file");
    for m in BATCHES {
        let x: Vec<f32> = (0..m * FFN).map(|_| (next() % 2001) as f32 / 1000.0 - 1.0).collect();
        let mut y = vec![0f32; m * FFN];
        let mut times = [Vec::new(), Vec::new()];
        let mut step = |ws: &[QMatrix<'_>]| {
            let start = Instant::now();
            for w in ws {
                matmul(&pool, isa, w, &x[..m * w.cols], m, &mut y[..m * w.rows], &mut scratch);
            }
            start.elapsed()
        };
        step(&mats);
        step(&packed);
        for _ in 0..steps {
            times[0].push(step(&mats));
            times[1].push(step(&packed));
        }
        let [f, p] = times.map(median);
        println!("{m:>6} {:>12.2} {:>12.2} {:>13.2}x", ms(f), ms(p), p.as_secs_f64() / f.as_secs_f64());
        if m == 1 {
            let read = median((0..steps).map(|_| plain_read(&pool, &mats)).collect());
            let gbs = |d: Duration| bytes as f64 / d.as_secs_f64() / 1e9;
            println!(
                "       one row: file {:.1} GB/s, packed {:.1} GB/s, a plain read of the same bytes {:.1} GB/s",
                gbs(f),
                gbs(p),
                gbs(read)
            );
        }
    }
    if !Isa::Avx512.available() {
        println!(
            "\nq4 kernel widths: this CPU lacks {} (AVX-512 level); nothing to compare",
            Isa::Avx512.missing().join(" ")
        );
        return;
    }
    let chosen = avx512_small_batch();
    println!("\nthe AVX-512 level's kernel widths (packed panels, as the engine runs them)");
    println!("{:>6} {:>12} {:>12} {:>14}", "batch", "256-bit ms", "512-bit ms", "512 / 256 time");
    for m in BATCHES {
        let x: Vec<f32> = (0..m * FFN).map(|_| (next() % 2001) as f32 / 1000.0 - 1.0).collect();
        let mut y = vec![0f32; m * FFN];
        let mut times = [Vec::new(), Vec::new()];
        let mut step = |narrow: bool| {
            set_avx512_small_batch(if narrow { usize::MAX } else { 0 });
            let start = Instant::now();
            for w in &packed {
                matmul(&pool, Isa::Avx512, w, &x[..m * w.cols], m, &mut y[..m * w.rows], &mut scratch);
            }
            start.elapsed()
        };
        step(true);
        step(false);
        for _ in 0..steps {
            for (i, narrow) in [true, false].into_iter().enumerate() {
                times[i].push(step(narrow));
            }
        }
        let [n, w] = times.map(median);
        println!("{m:>6} {:>12.2} {:>12.2} {:>13.2}x", ms(n), ms(w), w.as_secs_f64() / n.as_secs_f64());
    }
    set_avx512_small_batch(chosen);
    println!("this CPU's small batch = {chosen}: batches up to it take the 256-bit kernel (AVX512_SMALL_BATCH on AMD, AVX512_SMALL_BATCH_INTEL on Intel)");
}

/// One pass over every matrix's bytes, split across the pool by rows as the
/// matmul splits them, summing them as u64 words: the rate a kernel that
/// only read its weights would reach.
fn plain_read(pool: &ThreadPool, mats: &[QMatrix<'_>]) -> Duration {
    let start = Instant::now();
    for w in mats {
        let rb = w.data().len() / w.rows;
        let total = std::sync::atomic::AtomicU64::new(0);
        let chunk = w.rows.div_ceil(pool.threads() * 8).max(16).next_multiple_of(8);
        pool.for_ranges(w.rows, chunk, &|r| {
            let bytes = &w.data()[r.start * rb..r.end * rb];
            let sum = bytes
                .chunks_exact(8)
                .fold(0u64, |a, c| a.wrapping_add(u64::from_le_bytes(c.try_into().expect("8 bytes"))));
            total.fetch_add(sum, std::sync::atomic::Ordering::Relaxed);
        });
        std::hint::black_box(total.into_inner());
    }
    start.elapsed()
}

/// The machine, as `tandem::bench::cpu_summary` prints it for the other
/// benchmarks (that crate has no library to call it from here), plus the CPU
/// family and model, which tell the generations of one model name apart.
fn cpu() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |k: &str| {
        info.lines().find_map(|l| l.split_once(':').filter(|(a, _)| a.trim() == k).map(|(_, v)| v.trim().to_owned()))
    };
    let flags = field("flags").unwrap_or_default();
    let have: Vec<&str> =
        ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "amx_tile"]
            .into_iter()
            .filter(|f| flags.split_whitespace().any(|x| x == *f))
            .collect();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let [name, family, model] = ["model name", "cpu family", "model"].map(|k| field(k).unwrap_or_default());
    format!("{cores} cores, {name} (family {family}, model {model}), flags: {}", have.join(" "))
}

/// A Q4_1 matrix of random nibbles with small positive f16 scales and offsets.
fn q4_1_matrix(rows: usize, cols: usize, next: &mut impl FnMut() -> u64) -> Vec<u8> {
    let mut d = Vec::with_capacity(rows * WeightType::Q4_1.row_bytes(cols));
    for _ in 0..rows * cols / 32 {
        let r = next();
        // f16 0x1c00..0x1fff: 0.0039..0.0078.
        d.extend_from_slice(&(0x1c00 | (r as u16 & 0x3ff)).to_le_bytes());
        d.extend_from_slice(&(0x1c00 | ((r >> 16) as u16 & 0x3ff)).to_le_bytes());
        for _ in 0..2 {
            d.extend_from_slice(&next().to_le_bytes());
        }
    }
    d
}

fn median(mut t: Vec<Duration>) -> Duration {
    t.sort();
    t[t.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
