//! The AVX-512 level's two Q4 kernels against each other, batch size by
//! batch size: 256-bit registers with eight weight rows per panel, and
//! 512-bit registers with sixteen. `AVX512_SMALL_BATCH` (the batch size up to
//! which the first is used) is chosen from this.
//!
//! Each step multiplies a batch of activation rows by every Q4_1 matrix of
//! a 30-layer SmolLM2-135M-shaped model (576 wide, 1,536 in the MLP; 66 MB,
//! more than this host's cache, so weights stream from memory as in a
//! decode step), on a pool of `--threads` threads (default 2). The two
//! kernels alternate step by step so that host noise hits both alike; the
//! median step time of each is printed with their ratio.
//!
//! Run: `cargo bench -p kernels --bench q4` (args: steps per kernel and
//! batch size, default 15; threads, default 2). Needs a CPU with AVX-512
//! F/BW/VL and VNNI; elsewhere it says so and exits.

use std::time::{Duration, Instant};

use kernels::matmul::{matmul, set_avx512_small_batch, MatmulScratch, AVX512_SMALL_BATCH};
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
    if !Isa::Avx512.available() {
        println!(
            "q4 kernel widths: this CPU lacks {} (AVX-512 level); nothing to compare",
            Isa::Avx512.missing().join(" ")
        );
        return;
    }
    println!("q4 kernel widths, {threads} threads, {steps} steps each; {}", cpu());
    let shapes =
        [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (FFN, HIDDEN), (FFN, HIDDEN), (HIDDEN, FFN)];
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
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
    println!("{:>6} {:>12} {:>12} {:>14}", "batch", "256-bit ms", "512-bit ms", "512 / 256 time");
    for m in BATCHES {
        let x: Vec<f32> = (0..m * FFN).map(|_| (next() % 2001) as f32 / 1000.0 - 1.0).collect();
        let mut y = vec![0f32; m * FFN];
        let mut times = [Vec::new(), Vec::new()];
        let mut step = |narrow: bool| {
            set_avx512_small_batch(if narrow { usize::MAX } else { 0 });
            let start = Instant::now();
            for w in &mats {
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
    set_avx512_small_batch(AVX512_SMALL_BATCH);
    println!("AVX512_SMALL_BATCH = {AVX512_SMALL_BATCH}: batches up to it take the 256-bit kernel");
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
