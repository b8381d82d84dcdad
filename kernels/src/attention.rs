//! Attention of one query token over a sequence's paged KV cache, with
//! grouped-query heads (several query heads share one KV head).
//!
//! A layer's K (or V) storage is `num_blocks × block_size × kv_heads ×
//! head_dim` elements; a sequence owns the blocks its block table names, in
//! order, so position `t` lives in block `table[t / block_size]` at slot
//! `t % block_size`. Scores are computed position by position in order,
//! softmaxed, then V is accumulated in position order: the arithmetic is the
//! same whatever the block size, so results do not depend on it.
#![allow(unsafe_code)]

use crate::Isa;

/// One layer's K or V storage.
#[derive(Debug, Clone, Copy)]
pub enum KvSlice<'a> {
    F32(&'a [f32]),
    /// IEEE half-precision bit patterns.
    F16(&'a [u16]),
}

/// Shape of the attention problem for one layer.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
}

impl AttnShape {
    /// Elements of one token's K (or V) row: all KV heads.
    pub fn kv_row(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    fn offset(&self, table: &[u32], t: usize, kv_head: usize) -> usize {
        let block = table[t / self.block_size] as usize;
        (block * self.block_size + t % self.block_size) * self.kv_row() + kv_head * self.head_dim
    }
}

/// Computes attention for the query heads of KV head `kv_head`, for one
/// token whose context is positions `0..n_ctx` of the sequence.
///
/// `q` holds all query heads of the token (`n_heads * head_dim`); `out`
/// receives the group's heads only (`group * head_dim`, group =
/// `n_heads / n_kv_heads`). `scores` is scratch, resized as needed.
#[allow(clippy::too_many_arguments)]
pub fn attend_group(
    isa: Isa,
    shape: &AttnShape,
    k: KvSlice<'_>,
    v: KvSlice<'_>,
    table: &[u32],
    n_ctx: usize,
    kv_head: usize,
    q: &[f32],
    out: &mut [f32],
    scores: &mut Vec<f32>,
) {
    let group = shape.n_heads / shape.n_kv_heads;
    attend_heads(isa, shape, k, v, table, n_ctx, kv_head * group..(kv_head + 1) * group, q, out, scores);
}

/// [`attend_group`] for some of one KV head's query heads: `heads` (query head indices)
/// must share a KV head, and `out` receives `heads.len() * head_dim` values. Each head's
/// arithmetic is the same whichever heads are computed together, so splitting a group
/// (to spread a single token's attention over more threads) does not change results.
#[allow(clippy::too_many_arguments)]
pub fn attend_heads(
    isa: Isa,
    shape: &AttnShape,
    k: KvSlice<'_>,
    v: KvSlice<'_>,
    table: &[u32],
    n_ctx: usize,
    heads: std::ops::Range<usize>,
    q: &[f32],
    out: &mut [f32],
    scores: &mut Vec<f32>,
) {
    let per_kv = shape.n_heads / shape.n_kv_heads;
    let kv_head = heads.start / per_kv;
    assert!(
        !heads.is_empty() && heads.end <= shape.n_heads && (heads.end - 1) / per_kv == kv_head,
        "query heads {heads:?} do not share one KV head"
    );
    let group = heads.len();
    let hd = shape.head_dim;
    assert!(n_ctx > 0 && n_ctx.div_ceil(shape.block_size) <= table.len(), "block table too short for context");
    scores.clear();
    scores.resize(group * n_ctx, 0.0);
    let scale = 1.0 / (hd as f32).sqrt();
    let path = simd::path(isa, hd);
    #[cfg(test)]
    crate::isa::trace::hit(path);
    #[cfg(target_arch = "x86_64")]
    if path != Isa::Scalar && hd == simd::TILED_HEAD_DIM {
        // SAFETY: `path` chose AVX2, so the CPU has AVX2, FMA and F16C; the block table
        // covers `n_ctx` (asserted above) and every row read lies in the storage (checked
        // per block inside); `out` holds `group * hd`, `scores` `group * n_ctx`.
        match (k, v) {
            (KvSlice::F16(k), KvSlice::F16(v)) => unsafe {
                simd::attend_tiled(shape, k, v, table, n_ctx, kv_head, heads, q, scale, out, scores)
            },
            (KvSlice::F32(k), KvSlice::F32(v)) => unsafe {
                simd::attend_tiled(shape, k, v, table, n_ctx, kv_head, heads, q, scale, out, scores)
            },
            _ => panic!("K and V storage of one layer differ in element type"),
        }
        return;
    }
    attend_rows(path, shape, k, v, table, n_ctx, kv_head, heads, q, scale, out, scores);
}

/// [`attend_heads`] one position and head at a time: the reference order
/// every path keeps (the tiled kernels compute these same bits).
#[allow(clippy::too_many_arguments)]
fn attend_rows(
    path: Isa,
    shape: &AttnShape,
    k: KvSlice<'_>,
    v: KvSlice<'_>,
    table: &[u32],
    n_ctx: usize,
    kv_head: usize,
    heads: std::ops::Range<usize>,
    q: &[f32],
    scale: f32,
    out: &mut [f32],
    scores: &mut [f32],
) {
    let group = heads.len();
    let hd = shape.head_dim;
    // Scores: heads of the group share each K row load.
    for t in 0..n_ctx {
        let off = shape.offset(table, t, kv_head);
        for (gi, h) in heads.clone().enumerate() {
            let qh = &q[h * hd..(h + 1) * hd];
            let dot = match (k, path) {
                (KvSlice::F32(s), Isa::Avx2 | Isa::AvxVnni | Isa::Avx512) => simd::dot_f32(qh, &s[off..off + hd]),
                (KvSlice::F16(s), Isa::Avx2 | Isa::AvxVnni | Isa::Avx512) => simd::dot_f16(qh, &s[off..off + hd]),
                (KvSlice::F32(s), Isa::Scalar) => qh.iter().zip(&s[off..off + hd]).map(|(a, b)| a * b).sum(),
                (KvSlice::F16(s), Isa::Scalar) => {
                    qh.iter().zip(&s[off..off + hd]).map(|(a, b)| a * crate::f16::f16_bits_to_f32(*b)).sum()
                }
            };
            scores[gi * n_ctx + t] = dot * scale;
        }
    }
    for gi in 0..group {
        crate::ops::softmax(&mut scores[gi * n_ctx..(gi + 1) * n_ctx]);
    }

    // Weighted sum of V rows, in position order.
    out[..group * hd].fill(0.0);
    for t in 0..n_ctx {
        let off = shape.offset(table, t, kv_head);
        for gi in 0..group {
            let p = scores[gi * n_ctx + t];
            let oh = &mut out[gi * hd..(gi + 1) * hd];
            match (v, path) {
                (KvSlice::F32(s), Isa::Avx2 | Isa::AvxVnni | Isa::Avx512) => simd::axpy_f32(p, &s[off..off + hd], oh),
                (KvSlice::F16(s), Isa::Avx2 | Isa::AvxVnni | Isa::Avx512) => simd::axpy_f16(p, &s[off..off + hd], oh),
                (KvSlice::F32(s), Isa::Scalar) => {
                    for (o, x) in oh.iter_mut().zip(&s[off..off + hd]) {
                        *o += p * x;
                    }
                }
                (KvSlice::F16(s), Isa::Scalar) => {
                    for (o, x) in oh.iter_mut().zip(&s[off..off + hd]) {
                        *o += p * crate::f16::f16_bits_to_f32(*x);
                    }
                }
            }
        }
    }
}

/// AVX2 + FMA + F16C.
mod simd {
    use super::AttnShape;
    use crate::Isa;
    #[cfg(target_arch = "x86_64")]
    use std::arch::x86_64::*;

    /// The head size the register-tiled kernels take (SmolLM2's): a head's
    /// output is eight 8-lane registers.
    pub const TILED_HEAD_DIM: usize = 64;
    const CHUNKS: usize = TILED_HEAD_DIM / 8;

    /// K/V storage read 8 elements at a time as f32.
    #[cfg(target_arch = "x86_64")]
    pub trait Lanes: Copy {
        /// # Safety
        /// `p..p + 8` is in bounds; the caller is an AVX2 + F16C function.
        unsafe fn load8(p: *const Self) -> __m256;
    }

    #[cfg(target_arch = "x86_64")]
    impl Lanes for f32 {
        #[inline(always)]
        unsafe fn load8(p: *const f32) -> __m256 {
            // SAFETY: per the trait's contract.
            unsafe { _mm256_loadu_ps(p) }
        }
    }

    #[cfg(target_arch = "x86_64")]
    impl Lanes for u16 {
        #[inline(always)]
        unsafe fn load8(p: *const u16) -> __m256 {
            // SAFETY: per the trait's contract.
            unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
        }
    }

    /// `attend_rows`' scores, softmax and weighted sum for a 64-wide head,
    /// bit for bit, with the latency taken out: each score is the same
    /// 8-lane FMA chain over the head then the same horizontal sum as
    /// `dot_f32` / `dot_f16`, but four positions' chains run side by side;
    /// each head's output stays in eight registers across all positions
    /// (the same FMA per lane and position, in position order, as `axpy_*`
    /// through memory); positions are walked block by block, with no
    /// division per position. In a prompt's prefill this is most of the
    /// attention time: at 1,080 tokens attention was about 65% of a
    /// one-thread prefill.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; `table` covers `n_ctx` positions;
    /// `q` holds every query head, `out` `heads.len() * 64` values and
    /// `scores` `heads.len() * n_ctx`.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn attend_tiled<T: Lanes>(
        shape: &AttnShape,
        k: &[T],
        v: &[T],
        table: &[u32],
        n_ctx: usize,
        kv_head: usize,
        heads: std::ops::Range<usize>,
        q: &[f32],
        scale: f32,
        out: &mut [f32],
        scores: &mut [f32],
    ) {
        const HD: usize = TILED_HEAD_DIM;
        let (bs, row) = (shape.block_size, shape.kv_row());
        // First element of each position's row of this KV head, block by block.
        let blocks = || {
            table.iter().enumerate().map_while(move |(b, &blk)| {
                let t0 = b * bs;
                (t0 < n_ctx).then(|| (t0, (n_ctx - t0).min(bs), (blk as usize * bs) * row + kv_head * HD))
            })
        };
        for (_, n_in, base) in blocks() {
            let end = base + (n_in - 1) * row + HD;
            assert!(end <= k.len() && end <= v.len(), "a block lies outside the KV storage");
        }
        for (gi, h) in heads.clone().enumerate() {
            let qp = q[h * HD..(h + 1) * HD].as_ptr();
            let sc = &mut scores[gi * n_ctx..(gi + 1) * n_ctx];
            for (t0, n_in, base) in blocks() {
                let mut s = 0;
                while s + 4 <= n_in {
                    let kp = |j: usize| k[base + (s + j) * row..].as_ptr();
                    let (k0, k1, k2, k3) = (kp(0), kp(1), kp(2), kp(3));
                    let mut acc = [_mm256_setzero_ps(); 4];
                    for c in 0..CHUNKS {
                        // SAFETY: c * 8 + 8 <= 64 elements of q's head and of each row (asserted).
                        unsafe {
                            let qv = _mm256_loadu_ps(qp.add(c * 8));
                            acc[0] = _mm256_fmadd_ps(qv, T::load8(k0.add(c * 8)), acc[0]);
                            acc[1] = _mm256_fmadd_ps(qv, T::load8(k1.add(c * 8)), acc[1]);
                            acc[2] = _mm256_fmadd_ps(qv, T::load8(k2.add(c * 8)), acc[2]);
                            acc[3] = _mm256_fmadd_ps(qv, T::load8(k3.add(c * 8)), acc[3]);
                        }
                    }
                    for (j, a) in acc.into_iter().enumerate() {
                        sc[t0 + s + j] = crate::matmul::hsum_avx(a) * scale;
                    }
                    s += 4;
                }
                while s < n_in {
                    let off = base + s * row;
                    // SAFETY: both slices are 64 long; the features are this function's.
                    sc[t0 + s] = unsafe { dot_k(&q[h * HD..(h + 1) * HD], &k[off..off + HD]) } * scale;
                    s += 1;
                }
            }
            crate::ops::softmax(sc);
            let mut acc = [_mm256_setzero_ps(); CHUNKS];
            for (t0, n_in, base) in blocks() {
                for s in 0..n_in {
                    let pv = _mm256_set1_ps(sc[t0 + s]);
                    let vp = v[base + s * row..].as_ptr();
                    for (c, a) in acc.iter_mut().enumerate() {
                        // SAFETY: as above, for V.
                        *a = _mm256_fmadd_ps(pv, unsafe { T::load8(vp.add(c * 8)) }, *a);
                    }
                }
            }
            let o = &mut out[gi * HD..(gi + 1) * HD];
            for (c, a) in acc.into_iter().enumerate() {
                // SAFETY: c * 8 + 8 <= 64 = o.len().
                unsafe { _mm256_storeu_ps(o.as_mut_ptr().add(c * 8), a) };
            }
        }
    }

    /// The code `isa` runs for heads of `hd` elements: AVX2's on every SIMD level when
    /// the CPU has it and the head fills whole registers, else scalar. AVX-512 runs
    /// AVX2's code too: attention is a small share of a step, and with one code path
    /// (and the quantized matmuls' shared rounding) every SIMD level computes the same
    /// bits, so a prompt prefilled on an AVX-512 host and decoded on an AVX2 one gives
    /// what either host alone would. A 16-lane version summed in another order and
    /// moved the engine's greedy output against llama.cpp's fixture (a chosen-token
    /// log-probability drift of 0.40 against the test's 0.35 bound).
    pub fn path(isa: Isa, hd: usize) -> Isa {
        match isa {
            Isa::Avx512 | Isa::AvxVnni | Isa::Avx2 if hd % 8 == 0 && Isa::Avx2.available() => Isa::Avx2,
            _ => Isa::Scalar,
        }
    }

    // Callers use these only when `path` chose AVX2; slice lengths are
    // asserted equal and a multiple of 8 before any unsafe load.

    pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
        assert!(a.len() == b.len() && a.len() % 8 == 0);
        #[cfg(target_arch = "x86_64")]
        // SAFETY: features checked by the caller via `available()`; lengths asserted.
        return unsafe { dot_k(a, b) };
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!()
    }

    pub fn dot_f16(a: &[f32], b: &[u16]) -> f32 {
        assert!(a.len() == b.len() && a.len() % 8 == 0);
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        return unsafe { dot_k(a, b) };
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!()
    }

    /// `out += p * x`.
    pub fn axpy_f32(p: f32, x: &[f32], out: &mut [f32]) {
        assert!(x.len() == out.len() && x.len() % 8 == 0);
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        unsafe {
            axpy_k(p, x, out)
        }
    }

    pub fn axpy_f16(p: f32, x: &[u16], out: &mut [f32]) {
        assert!(x.len() == out.len() && x.len() % 8 == 0);
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        unsafe {
            axpy_k(p, x, out)
        }
    }

    /// `a · b`: one 8-lane FMA chain over the row, then the horizontal sum.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_k<T: Lanes>(a: &[f32], b: &[T]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for i in (0..a.len()).step_by(8) {
            // SAFETY: i + 8 <= len for both slices (len % 8 == 0, asserted by the callers).
            acc = unsafe { _mm256_fmadd_ps(_mm256_loadu_ps(a.as_ptr().add(i)), T::load8(b.as_ptr().add(i)), acc) };
        }
        crate::matmul::hsum_avx(acc)
    }

    /// `out += p * x`, through memory.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn axpy_k<T: Lanes>(p: f32, x: &[T], out: &mut [f32]) {
        let pv = _mm256_set1_ps(p);
        for i in (0..x.len()).step_by(8) {
            // SAFETY: in bounds as above.
            unsafe {
                let o = out.as_mut_ptr().add(i);
                _mm256_storeu_ps(o, _mm256_fmadd_ps(pv, T::load8(x.as_ptr().add(i)), _mm256_loadu_ps(o)));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matmul::tests::Rng;

    fn run(
        isa: Isa,
        shape: &AttnShape,
        k: KvSlice<'_>,
        v: KvSlice<'_>,
        table: &[u32],
        n: usize,
        q: &[f32],
    ) -> Vec<f32> {
        let mut out = vec![0f32; q.len()];
        let mut scratch = Vec::new();
        let gw = shape.n_heads / shape.n_kv_heads * shape.head_dim;
        for g in 0..shape.n_kv_heads {
            attend_group(isa, shape, k, v, table, n, g, q, &mut out[g * gw..(g + 1) * gw], &mut scratch);
        }
        out
    }

    #[test]
    fn simd_matches_scalar_and_block_size_does_not_matter() {
        let mut rng = Rng::new(3);
        let (nh, nkv, hd, n) = (9, 3, 64, 37);
        let row = nkv * hd;
        // Token t's K/V rows, contiguous (block size 1, identity table, is the reference layout).
        let kf: Vec<f32> = (0..n * row).map(|_| rng.f32()).collect();
        let vf: Vec<f32> = (0..n * row).map(|_| rng.f32()).collect();
        let q: Vec<f32> = (0..nh * hd).map(|_| rng.f32()).collect();
        let shape1 = AttnShape { n_heads: nh, n_kv_heads: nkv, head_dim: hd, block_size: 1 };
        let ident: Vec<u32> = (0..n as u32).collect();
        let reference = run(Isa::Scalar, &shape1, KvSlice::F32(&kf), KvSlice::F32(&vf), &ident, n, &q);

        for bs in [1usize, 4, 16] {
            // Scatter the same tokens into shuffled blocks of size bs.
            let nblocks = n.div_ceil(bs) + 3;
            let table: Vec<u32> = (0..n.div_ceil(bs) as u32).map(|b| (b * 7 + 2) % nblocks as u32).collect();
            let mut kp = vec![0f32; nblocks * bs * row];
            let mut vp = vec![0f32; nblocks * bs * row];
            for t in 0..n {
                let dst = (table[t / bs] as usize * bs + t % bs) * row;
                kp[dst..dst + row].copy_from_slice(&kf[t * row..(t + 1) * row]);
                vp[dst..dst + row].copy_from_slice(&vf[t * row..(t + 1) * row]);
            }
            let shape = AttnShape { block_size: bs, ..shape1 };
            let scalar = crate::isa::trace::assert_ran(Isa::Scalar, "attention scalar", || {
                run(Isa::Scalar, &shape, KvSlice::F32(&kp), KvSlice::F32(&vp), &table, n, &q)
            });
            assert_eq!(scalar, reference, "scalar result changed with block size {bs}");
            let kh: Vec<u16> = kp.iter().map(|&x| crate::f16::f32_to_f16_bits(x)).collect();
            let vh: Vec<u16> = vp.iter().map(|&x| crate::f16::f32_to_f16_bits(x)).collect();
            let h_scalar = run(Isa::Scalar, &shape, KvSlice::F16(&kh), KvSlice::F16(&vh), &table, n, &q);
            for isa in Isa::ALL {
                if !crate::isa::trace::runnable("attention", isa) {
                    continue;
                }
                let what = format!("attention {} bs={bs}", isa.name());
                let simd = crate::isa::trace::assert_ran(simd::path(isa, hd), &what, || {
                    run(isa, &shape, KvSlice::F32(&kp), KvSlice::F32(&vp), &table, n, &q)
                });
                for (a, b) in simd.iter().zip(&reference) {
                    assert!((a - b).abs() < 1e-5, "{what}: simd {a} vs scalar {b}");
                }
                // F16 storage agrees with F32 to half precision.
                let h_simd = crate::isa::trace::assert_ran(simd::path(isa, hd), &what, || {
                    run(isa, &shape, KvSlice::F16(&kh), KvSlice::F16(&vh), &table, n, &q)
                });
                for ((a, b), r) in h_simd.iter().zip(&h_scalar).zip(&reference) {
                    assert!((a - b).abs() < 1e-5, "{what}: f16 simd {a} vs scalar {b}");
                    assert!((a - r).abs() < 5e-3, "{what}: f16 {a} vs f32 {r}");
                }
            }
        }
    }

    /// Heads computed one at a time give the group's result bit for bit (the model splits
    /// a lone decode token's groups into heads to use every thread).
    #[test]
    fn single_heads_equal_their_group() {
        let mut rng = Rng::new(5);
        let (nh, nkv, hd, n, bs) = (9, 3, 64, 21usize, 4);
        let shape = AttnShape { n_heads: nh, n_kv_heads: nkv, head_dim: hd, block_size: bs };
        let row = nkv * hd;
        let table: Vec<u32> = (0..n.div_ceil(bs) as u32).rev().collect();
        let kh: Vec<u16> = (0..table.len() * bs * row).map(|_| crate::f16::f32_to_f16_bits(rng.f32())).collect();
        let vh: Vec<u16> = (0..table.len() * bs * row).map(|_| crate::f16::f32_to_f16_bits(rng.f32())).collect();
        let q: Vec<f32> = (0..nh * hd).map(|_| rng.f32()).collect();
        for isa in Isa::ALL {
            if !crate::isa::trace::runnable("single_heads_equal_their_group", isa) {
                continue;
            }
            let (k, v) = (KvSlice::F16(&kh), KvSlice::F16(&vh));
            let grouped = run(isa, &shape, k, v, &table, n, &q);
            let mut split = vec![0f32; nh * hd];
            let mut scratch = Vec::new();
            for h in 0..nh {
                attend_heads(
                    isa,
                    &shape,
                    k,
                    v,
                    &table,
                    n,
                    h..h + 1,
                    &q,
                    &mut split[h * hd..(h + 1) * hd],
                    &mut scratch,
                );
            }
            assert_eq!(split, grouped, "{}", isa.name());
        }
        let mut out = vec![0f32; 2 * hd];
        let crosses = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            attend_heads(
                Isa::Scalar,
                &shape,
                KvSlice::F16(&kh),
                KvSlice::F16(&vh),
                &table,
                n,
                2..4,
                &q,
                &mut out,
                &mut Vec::new(),
            )
        }));
        assert!(crosses.is_err(), "heads 2 and 3 belong to different KV heads");
    }

    /// The register-tiled kernels (64-wide heads) give the per-position kernels' bits
    /// exactly, for F16 and F32 storage, every tail of a block (contexts of 1 to 70 over
    /// 16-token blocks in shuffled order) and every group split: prefill and decode go
    /// through it, and a prompt prefilled on one host decodes the same on another.
    #[test]
    fn tiled_kernels_equal_the_per_position_ones_bit_for_bit() {
        if !crate::isa::trace::runnable("attention tiled", Isa::Avx2) {
            return;
        }
        let mut rng = Rng::new(11);
        let (nh, nkv, hd, bs) = (9, 3, 64, 16usize);
        let shape = AttnShape { n_heads: nh, n_kv_heads: nkv, head_dim: hd, block_size: bs };
        let row = nkv * hd;
        let nblocks = 8;
        let table: Vec<u32> = (0..5u32).map(|b| (b * 3 + 1) % nblocks as u32).collect();
        let kf: Vec<f32> = (0..nblocks * bs * row).map(|_| rng.f32()).collect();
        let vf: Vec<f32> = (0..nblocks * bs * row).map(|_| rng.f32()).collect();
        let kh: Vec<u16> = kf.iter().map(|&x| crate::f16::f32_to_f16_bits(x)).collect();
        let vh: Vec<u16> = vf.iter().map(|&x| crate::f16::f32_to_f16_bits(x)).collect();
        let q: Vec<f32> = (0..nh * hd).map(|_| rng.f32() * 4.0).collect();
        let scale = 1.0 / (hd as f32).sqrt();
        for (k, v) in [(KvSlice::F16(&kh), KvSlice::F16(&vh)), (KvSlice::F32(&kf), KvSlice::F32(&vf))] {
            for n in [1usize, 3, 4, 5, 16, 17, 37, 64, 70] {
                for heads in [0..3, 3..6, 7..8] {
                    let kv_head = heads.start / 3;
                    let mut want = vec![f32::NAN; heads.len() * hd];
                    let mut s = vec![0f32; heads.len() * n];
                    attend_rows(
                        Isa::Avx2,
                        &shape,
                        k,
                        v,
                        &table,
                        n,
                        kv_head,
                        heads.clone(),
                        &q,
                        scale,
                        &mut want,
                        &mut s,
                    );
                    let mut got = vec![f32::NAN; heads.len() * hd];
                    attend_heads(Isa::Avx2, &shape, k, v, &table, n, heads.clone(), &q, &mut got, &mut Vec::new());
                    let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "context {n}, heads {heads:?}");
                }
            }
        }
    }

    #[test]
    fn single_position_returns_its_value() {
        let shape = AttnShape { n_heads: 2, n_kv_heads: 1, head_dim: 8, block_size: 4 };
        let k = vec![0.5f32; 4 * 8];
        let v: Vec<f32> = (0..32).map(|i| i as f32).collect();
        let q = vec![1.0f32; 16];
        let out = run(Isa::detect(), &shape, KvSlice::F32(&k), KvSlice::F32(&v), &[0], 1, &q);
        assert_eq!(&out[..8], &v[..8]);
        assert_eq!(&out[8..], &v[..8]);
    }
}
