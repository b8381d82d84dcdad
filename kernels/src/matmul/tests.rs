use super::*;
use crate::quant::quantize_row_q8_0;

/// The workspace's seeded generator, with the kernels' tests' one helper.
pub(crate) struct Rng(types::rng::XorShift64);
impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(types::rng::XorShift64::seeded(seed))
    }
    /// Uniform in [-1, 1).
    pub fn f32(&mut self) -> f32 {
        self.0.f32_signed()
    }
}

fn random_weights(rng: &mut Rng, ty: WeightType, rows: usize, cols: usize) -> Vec<u8> {
    let mut data = vec![0u8; rows * ty.row_bytes(cols)];
    match ty {
        WeightType::Q8_0 => {
            for r in 0..rows {
                let x: Vec<f32> = (0..cols).map(|_| rng.f32()).collect();
                let rb = ty.row_bytes(cols);
                quantize_row_q8_0(&x, &mut data[r * rb..(r + 1) * rb]);
            }
        }
        WeightType::Q4_0 | WeightType::Q4_1 => {
            let bb = ty.block_bytes();
            for blk in data.chunks_exact_mut(bb) {
                blk[..2].copy_from_slice(&crate::f16::f32_to_f16_bits(rng.f32() * 0.1).to_le_bytes());
                let start = if ty == WeightType::Q4_1 {
                    blk[2..4].copy_from_slice(&crate::f16::f32_to_f16_bits(rng.f32() * 0.5).to_le_bytes());
                    4
                } else {
                    2
                };
                for b in &mut blk[start..] {
                    *b = rng.0.next_u64() as u8;
                }
            }
        }
        WeightType::F32 => {
            for c in data.chunks_exact_mut(4) {
                c.copy_from_slice(&rng.f32().to_le_bytes());
            }
        }
        WeightType::F16 => {
            for c in data.chunks_exact_mut(2) {
                c.copy_from_slice(&crate::f16::f32_to_f16_bits(rng.f32()).to_le_bytes());
            }
        }
        WeightType::BF16 => {
            for c in data.chunks_exact_mut(2) {
                c.copy_from_slice(&half::bf16::from_f32(rng.f32()).to_bits().to_le_bytes());
            }
        }
    }
    data
}

/// Dequantize-then-f64-dot: the mathematical value the kernels approximate
/// (up to activation quantization for quantized types).
fn reference(w: &QMatrix<'_>, x: &[f32], m: usize) -> Vec<f32> {
    let mut y = vec![0f32; m * w.rows];
    let mut row = vec![0f32; w.cols];
    for r in 0..w.rows {
        w.dequantize_row_into(r, &mut row);
        for i in 0..m {
            let s: f64 = row.iter().zip(&x[i * w.cols..]).map(|(a, b)| *a as f64 * *b as f64).sum();
            y[i * w.rows + r] = s as f32;
        }
    }
    y
}

fn run(isa: Isa, threads: usize, w: &QMatrix<'_>, x: &[f32], m: usize) -> Vec<f32> {
    let pool = ThreadPool::new(threads).expect("pool");
    let mut y = vec![0f32; m * w.rows];
    matmul(&pool, isa, w, x, m, &mut y, &mut MatmulScratch::default());
    y
}

const ALL: [WeightType; 6] =
    [WeightType::F32, WeightType::F16, WeightType::BF16, WeightType::Q4_0, WeightType::Q4_1, WeightType::Q8_0];

#[test]
fn simd_matches_scalar_and_reference_for_every_type() {
    let mut rng = Rng::new(7);
    for ty in ALL {
        // 96 columns: an odd number of blocks, the AVX-512 kernels' half-register tail.
        for (rows, cols, m) in [(17, 64, 1), (40, 576, 5), (9, 1536, 9), (12, 96, 6)] {
            let data = random_weights(&mut rng, ty, rows, cols);
            let w = QMatrix::new(ty, rows, cols, &data).expect("shape");
            let x: Vec<f32> = (0..m * cols).map(|_| rng.f32()).collect();
            // One thread: the pool runs the kernels here, where the path trace is kept.
            let scalar = crate::isa::trace::assert_ran(Isa::Scalar, &format!("{ty:?} scalar"), || {
                run(Isa::Scalar, 1, &w, &x, m)
            });
            let exact = reference(&w, &x, m);
            let scale = exact.iter().fold(0f32, |a, v| a.max(v.abs())).max(1.0);
            for i in 0..exact.len() {
                // Activation quantization costs ~1% of the value's scale.
                let tol = if ty.is_quantized() { 0.02 * scale } else { 1e-4 * scale };
                assert!((scalar[i] - exact[i]).abs() <= tol, "{ty:?} [{i}]: {} vs exact {}", scalar[i], exact[i]);
            }
            for isa in Isa::ALL {
                if !crate::isa::trace::runnable("matmul", isa) {
                    continue;
                }
                let what = format!("{ty:?} {rows}x{cols} m={m} {}", isa.name());
                // Float weights run the level's float code (AVX-VNNI's is AVX2's).
                let ran = if ty.is_quantized() { isa } else { isa.float() };
                let simd = crate::isa::trace::assert_ran(ran, &what, || run(isa, 1, &w, &x, m));
                assert_eq!(simd, run(isa, 2, &w, &x, m), "{what}: 1 and 2 threads differ");
                for i in 0..exact.len() {
                    assert!(
                        (scalar[i] - simd[i]).abs() <= 1e-4 * scale,
                        "{what} [{i}]: scalar {} {} {}",
                        scalar[i],
                        isa.name(),
                        simd[i]
                    );
                }
            }
        }
    }
}

/// Q4 products round alike on every SIMD level (ggml's AVX2 order, lane by lane: see
/// `avx2::panel_dots`), so a prompt prefilled on one host and decoded on another with
/// a different instruction set sees the same numbers. 40 rows: five whole AVX2 panels,
/// two AVX-512 panels and a part one; 9 rows: a part panel on both.
#[test]
fn q4_products_are_the_same_bits_on_every_simd_level() {
    let mut rng = Rng::new(11);
    for ty in [WeightType::Q4_0, WeightType::Q4_1] {
        for (rows, cols, m) in [(40, 576, 5), (9, 1536, 3), (16, 96, 1)] {
            let data = random_weights(&mut rng, ty, rows, cols);
            let w = QMatrix::new(ty, rows, cols, &data).expect("shape");
            let x: Vec<f32> = (0..m * cols).map(|_| rng.f32()).collect();
            let levels: Vec<Isa> = [Isa::Avx2, Isa::AvxVnni, Isa::Avx512]
                .into_iter()
                .filter(|i| crate::isa::trace::runnable("matmul", *i))
                .collect();
            let Some((first, rest)) = levels.split_first() else { continue };
            let want = crate::isa::trace::assert_ran(*first, "q4 bits", || run(*first, 1, &w, &x, m));
            for isa in rest {
                let got = crate::isa::trace::assert_ran(*isa, "q4 bits", || run(*isa, 1, &w, &x, m));
                assert_eq!(got, want, "{ty:?} {rows}x{cols} m={m}: {} differs from {}", isa.name(), first.name());
            }
        }
    }
}

#[test]
fn output_is_independent_of_batch_and_threads() {
    let mut rng = Rng::new(11);
    for isa in Isa::ALL {
        if !crate::isa::trace::runnable("batch invariance", isa) {
            continue;
        }
        for ty in ALL {
            for (rows, cols) in [(33, 128), (13, 96)] {
                let data = random_weights(&mut rng, ty, rows, cols);
                let w = QMatrix::new(ty, rows, cols, &data).expect("shape");
                let m = 7;
                let x: Vec<f32> = (0..m * cols).map(|_| rng.f32()).collect();
                let batched = run(isa, 2, &w, &x, m);
                for i in 0..m {
                    let alone = run(isa, 1, &w, &x[i * cols..(i + 1) * cols], 1);
                    assert_eq!(&batched[i * rows..(i + 1) * rows], &alone[..], "{ty:?} {} row {i}", isa.name());
                }
            }
        }
    }
}

#[test]
fn dot_f32_matches_scalar_on_every_level() {
    let mut rng = Rng::new(13);
    for n in [0usize, 7, 16, 33, 64, 100] {
        let a: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
        let b: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
        let scalar = crate::isa::trace::assert_ran(Isa::Scalar, "dot scalar", || dot_f32(Isa::Scalar, &a, &b));
        for isa in Isa::ALL {
            if !crate::isa::trace::runnable("dot_f32", isa) {
                continue;
            }
            let what = format!("dot_f32 n={n} {}", isa.name());
            let got = crate::isa::trace::assert_ran(isa.float(), &what, || dot_f32(isa, &a, &b));
            assert!((got - scalar).abs() <= 1e-5 * n.max(1) as f32, "{what}: {got} vs scalar {scalar}");
        }
    }
}

#[test]
fn bad_shape_is_an_error() {
    assert!(QMatrix::new(WeightType::Q4_1, 2, 32, &[0u8; 39]).is_err());
    assert!(QMatrix::new(WeightType::Q4_1, 2, 31, &[0u8; 40]).is_err());
    assert!(QMatrix::new(WeightType::Q4_1, 2, 32, &[0u8; 40]).is_ok());
}

#[test]
fn multi_equals_separate_products() {
    let mut rng = Rng::new(5);
    let pool = ThreadPool::new(2).expect("pool");
    let (cols, m) = (64, 5);
    let shapes = [(WeightType::Q4_1, 24), (WeightType::Q8_0, 8), (WeightType::F16, 16)];
    let datas: Vec<Vec<u8>> = shapes.iter().map(|&(ty, rows)| random_weights(&mut rng, ty, rows, cols)).collect();
    let ws: Vec<QMatrix<'_>> =
        shapes.iter().zip(&datas).map(|(&(ty, rows), d)| QMatrix::new(ty, rows, cols, d).expect("shape")).collect();
    let x: Vec<f32> = (0..m * cols).map(|_| rng.f32()).collect();
    for isa in Isa::ALL {
        if !crate::isa::trace::runnable("matmul_multi", isa) {
            continue;
        }
        let mut ys: Vec<Vec<f32>> = ws.iter().map(|w| vec![0f32; m * w.rows]).collect();
        {
            let mut refs: Vec<&mut [f32]> = ys.iter_mut().map(|y| y.as_mut_slice()).collect();
            matmul_multi(&pool, isa, &ws, &x, m, &mut refs, &mut MatmulScratch::default());
        }
        for (w, y) in ws.iter().zip(&ys) {
            assert_eq!(*y, run(isa, 1, w, &x, m), "{:?} {}", w.ty, isa.name());
        }
    }
}

/// The AVX-512 level's two Q4 kernels (256-bit with eight-row panels for
/// small batches, 512-bit with sixteen-row panels above
/// `AVX512_SMALL_BATCH`) return the same bits at every batch size, so the
/// switch between them never changes an output. Run here only where the
/// CPU has the level.
#[test]
fn avx512_q4_kernel_widths_return_the_same_bits() {
    if !crate::isa::trace::runnable("avx512 q4 widths", Isa::Avx512) {
        return;
    }
    let mut rng = Rng::new(17);
    let chosen = super::avx512_small_batch();
    for ty in [WeightType::Q4_0, WeightType::Q4_1] {
        for (rows, cols) in [(40, 576), (9, 1536)] {
            let data = random_weights(&mut rng, ty, rows, cols);
            let w = QMatrix::new(ty, rows, cols, &data).expect("shape");
            for m in 1..=2 * super::AVX512_SMALL_BATCH + 1 {
                let x: Vec<f32> = (0..m * cols).map(|_| rng.f32()).collect();
                super::set_avx512_small_batch(usize::MAX);
                let narrow = run(Isa::Avx512, 2, &w, &x, m);
                super::set_avx512_small_batch(0);
                let wide = run(Isa::Avx512, 2, &w, &x, m);
                super::set_avx512_small_batch(chosen);
                assert_eq!(narrow, wide, "{ty:?} {rows}x{cols} m={m}: the 256- and 512-bit kernels differ");
                assert_eq!(
                    narrow,
                    run(Isa::Avx2, 1, &w, &x, m),
                    "{ty:?} {rows}x{cols} m={m}: AVX-512 differs from AVX2"
                );
            }
        }
    }
}

/// Q4 matrices with their whole panels repacked at load (`panels`) give the
/// same bits as the file layout, on every level, at every batch size (one
/// row reads the packed bytes directly, a few rows unpack them, the AVX-512
/// level's large batches pair two into a sixteen-row panel) and thread
/// count. 13 rows: a part panel read from the file layout after a packed one.
#[test]
fn packed_panels_return_the_same_bits_as_the_file_layout() {
    let mut rng = Rng::new(23);
    for ty in [WeightType::Q4_0, WeightType::Q4_1] {
        for (rows, cols) in [(40, 576), (13, 1536), (16, 96), (8, 64)] {
            let data = random_weights(&mut rng, ty, rows, cols);
            let w = QMatrix::new(ty, rows, cols, &data).expect("shape");
            let packed = panels::pack_q4_panels(&w).expect("a Q4 type packs");
            assert_eq!(packed.len(), rows / 8 * 8 * ty.row_bytes(cols));
            let wp = w.with_panels(&packed).expect("packed length");
            for isa in Isa::ALL {
                if !crate::isa::trace::runnable("packed panels", isa) {
                    continue;
                }
                for m in [1, 2, 3, 5, 9] {
                    let x: Vec<f32> = (0..m * cols).map(|_| rng.f32()).collect();
                    let want = run(isa, 1, &w, &x, m);
                    // The trace counts this thread's calls: with two threads the pool's
                    // other thread may take every item, so the level is checked on one.
                    let got = crate::isa::trace::assert_ran(isa, "packed", || run(isa, 1, &wp, &x, m));
                    assert_eq!(got, want, "{ty:?} {rows}x{cols} m={m} {} 1 thread", isa.name());
                    let got = run(isa, 2, &wp, &x, m);
                    assert_eq!(got, want, "{ty:?} {rows}x{cols} m={m} {} 2 threads", isa.name());
                }
            }
        }
    }
}

/// In a product of several matrices a packed matrix's rows may start off a
/// panel boundary (the rows of all matrices are split together); those
/// panels are read from the file layout and the bits stay the same. After
/// an eight-row matrix the second one's rows split at 8 and 24: on the
/// AVX-512 level a batch of nine pairs packed panels 1 and 2 into one
/// sixteen-row panel.
#[test]
fn packed_panels_after_an_unaligned_matrix_in_a_multi_product() {
    let mut rng = Rng::new(29);
    let pool = ThreadPool::new(2).expect("pool");
    multi_packed_equals_separate(&mut rng, &pool, WeightType::Q4_1, [13, 64], &[1]);
    multi_packed_equals_separate(&mut rng, &pool, WeightType::Q4_0, [8, 40], &[1, 9]);
}

/// Two packed matrices of `rows` multiplied together (`matmul_multi`) give
/// each one's product alone from the file layout, at each batch size in `ms`.
fn multi_packed_equals_separate(rng: &mut Rng, pool: &ThreadPool, ty: WeightType, rows: [usize; 2], ms: &[usize]) {
    let cols = 128;
    let datas = rows.map(|r| random_weights(rng, ty, r, cols));
    let plain: Vec<QMatrix<'_>> =
        rows.iter().zip(&datas).map(|(&r, d)| QMatrix::new(ty, r, cols, d).expect("shape")).collect();
    let packs: Vec<Vec<u8>> = plain.iter().map(|w| panels::pack_q4_panels(w).expect("q4")).collect();
    let packed: Vec<QMatrix<'_>> = plain.iter().zip(&packs).map(|(w, p)| w.with_panels(p).expect("len")).collect();
    for &m in ms {
        let x: Vec<f32> = (0..m * cols).map(|_| rng.f32()).collect();
        for isa in Isa::ALL {
            if !crate::isa::trace::runnable("packed multi", isa) {
                continue;
            }
            let (mut y0, mut y1) = (vec![0f32; rows[0] * m], vec![0f32; rows[1] * m]);
            matmul_multi(pool, isa, &packed, &x, m, &mut [&mut y0, &mut y1], &mut MatmulScratch::default());
            assert_eq!(y0, run(isa, 1, &plain[0], &x, m), "{ty:?} {rows:?} {} m={m}: first matrix", isa.name());
            assert_eq!(y1, run(isa, 1, &plain[1], &x, m), "{ty:?} {rows:?} {} m={m}: second matrix", isa.name());
        }
    }
}

/// The packed layout puts dword k of row l's block at `32k + 4l`, row l's
/// `d` at `128 + 2l` and (Q4_1) its `m` at `144 + 2l` (see `panels`).
#[test]
fn packed_layout_transposes_each_blocks_dwords() {
    let mut rng = Rng::new(31);
    let (rows, cols) = (8, 64);
    for ty in [WeightType::Q4_0, WeightType::Q4_1] {
        let (bb, qoff) = (ty.block_bytes(), ty.block_bytes() - 16);
        let data = random_weights(&mut rng, ty, rows, cols);
        let w = QMatrix::new(ty, rows, cols, &data).expect("shape");
        let p = panels::pack_q4_panels(&w).expect("q4");
        assert_eq!(p.len(), 2 * 8 * bb);
        for b in 0..2 {
            let blk = &p[b * 8 * bb..(b + 1) * 8 * bb];
            for l in 0..rows {
                let src = &w.row(l)[b * bb..(b + 1) * bb];
                for k in 0..4 {
                    let dw = &src[qoff + 4 * k..qoff + 4 * k + 4];
                    assert_eq!(&blk[32 * k + 4 * l..32 * k + 4 * l + 4], dw, "{ty:?} b{b} l{l} k{k}");
                }
                assert_eq!(&blk[128 + 2 * l..130 + 2 * l], &src[..2], "{ty:?} d of b{b} l{l}");
                if ty == WeightType::Q4_1 {
                    assert_eq!(&blk[144 + 2 * l..146 + 2 * l], &src[2..4], "{ty:?} m of b{b} l{l}");
                }
            }
        }
    }
}

/// The SIMD kernels really read the packed panels: with every packed block's
/// nibbles altered, every row of a whole panel changes, at one row (read
/// straight from the packed bytes), a few (unpacked from them) and, on the
/// AVX-512 level, a large batch (sixteen-row panels paired from them); the
/// rows past the last whole panel, read from the file layout, do not.
#[test]
fn altered_packed_panels_change_exactly_the_packed_rows() {
    let mut rng = Rng::new(37);
    let (rows, cols) = (21, 128);
    for ty in [WeightType::Q4_0, WeightType::Q4_1] {
        let bb = ty.block_bytes();
        let data = random_weights(&mut rng, ty, rows, cols);
        let w = QMatrix::new(ty, rows, cols, &data).expect("shape");
        let mut altered = panels::pack_q4_panels(&w).expect("q4");
        for blk in altered.chunks_exact_mut(8 * bb) {
            for byte in &mut blk[..128] {
                *byte ^= 0x5A;
            }
        }
        let wa = w.with_panels(&altered).expect("packed length");
        for isa in [Isa::Avx2, Isa::AvxVnni, Isa::Avx512] {
            if !crate::isa::trace::runnable("altered packed panels", isa) {
                continue;
            }
            for m in [1, 3, 9] {
                let x: Vec<f32> = (0..m * cols).map(|_| rng.f32()).collect();
                let (file, packed) = (run(isa, 2, &w, &x, m), run(isa, 2, &wa, &x, m));
                for i in 0..m {
                    for r in 0..rows {
                        let (a, b) = (file[i * rows + r], packed[i * rows + r]);
                        let what = format!("{ty:?} {} m={m} x{i} row {r}", isa.name());
                        if r < 16 {
                            assert_ne!(a, b, "{what}: a packed row read the file layout");
                        } else {
                            assert_eq!(a, b, "{what}: a row past the whole panels changed");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn panels_of_the_wrong_length_or_type_are_refused() {
    let data = vec![0u8; 16 * 40];
    let w = QMatrix::new(WeightType::Q4_1, 16, 64, &data).expect("shape");
    assert!(w.with_panels(&data[..16 * 40 - 1]).is_err());
    assert!(w.with_panels(&data).is_ok());
    let q8 = vec![0u8; 16 * 68];
    let w8 = QMatrix::new(WeightType::Q8_0, 16, 64, &q8).expect("shape");
    assert!(panels::pack_q4_panels(&w8).is_none());
    assert!(w8.with_panels(&q8).is_err());
    let mut short = vec![0u8; 16 * 40 - 1];
    assert!(panels::pack_q4_panels_into(&w, &mut short).is_err());
    let mut exact = vec![0u8; 16 * 40];
    panels::pack_q4_panels_into(&w, &mut exact).expect("exact length");
    assert_eq!(Some(exact), panels::pack_q4_panels(&w));
}
