//! AVX2 + FMA + F16C kernels, and the AVX-VNNI variant of the quantized ones.
//!
//! Quantized dot products use `vpmaddubsw` (u8 × i8 → i16 pairs) and
//! `vpmaddwd` (→ i32), then one FMA per block with the product of scales.
//! With AVX-VNNI, one `vpdpbusd` (u8 × i8, four at a time, → i32) replaces
//! the pair; the i32 sums are the same (the pairs never saturate: weights
//! are at most 15 in Q4 and 127 in magnitude in Q8), so both give the same
//! bits. The kernels are written once, generic over `VNNI`, and inlined
//! into one entry point per instruction set.
//! Up to four activation rows share one unpacked weight block, which is
//! where prefill gets its reuse; every output still sees the identical
//! instruction sequence (see the module doc of `matmul`).
#![allow(unsafe_code)]

use std::ops::Range;

use crate::matmul::{QMatrix, WeightType};
use crate::pool::SharedSlice;
use crate::quant::QActs;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

#[cfg(target_arch = "x86_64")]
fn available() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
}

/// [`super::scalar::quant_rows`] with AVX2 where the CPU has it.
///
/// # Safety
/// As [`super::scalar::quant_rows`]: concurrent callers pass disjoint `rows`.
pub unsafe fn quant_rows(w: &QMatrix<'_>, acts: &QActs, rows: Range<usize>, out: &SharedSlice<f32>) {
    #[cfg(target_arch = "x86_64")]
    if available() {
        // SAFETY: the CPU supports avx2, fma and f16c (checked just above); `rows` are this
        // caller's alone (the function's contract).
        unsafe {
            match w.ty {
                WeightType::Q4_1 => q4_rows::<true>(w, acts, rows, out),
                WeightType::Q4_0 => q4_rows::<false>(w, acts, rows, out),
                WeightType::Q8_0 => q8_rows(w, acts, rows, out),
                _ => super::scalar::quant_rows(w, acts, rows, out),
            }
        }
        return;
    }
    // SAFETY: the function's contract.
    unsafe { super::scalar::quant_rows(w, acts, rows, out) }
}

/// [`quant_rows`] with AVX-VNNI's `vpdpbusd` for the integer dot products where
/// the CPU has it (else [`quant_rows`]).
///
/// # Safety
/// As [`super::scalar::quant_rows`]: concurrent callers pass disjoint `rows`.
pub unsafe fn quant_rows_vnni(w: &QMatrix<'_>, acts: &QActs, rows: Range<usize>, out: &SharedSlice<f32>) {
    #[cfg(target_arch = "x86_64")]
    if crate::Isa::AvxVnni.available() {
        // SAFETY: the CPU supports avx2, fma, f16c and avxvnni (checked just above);
        // `rows` are this caller's alone (the function's contract).
        unsafe {
            match w.ty {
                WeightType::Q4_1 => q4_rows_vnni::<true>(w, acts, rows, out),
                WeightType::Q4_0 => q4_rows_vnni::<false>(w, acts, rows, out),
                WeightType::Q8_0 => q8_rows_vnni(w, acts, rows, out),
                _ => super::scalar::quant_rows(w, acts, rows, out),
            }
        }
        return;
    }
    // SAFETY: the function's contract.
    unsafe { quant_rows(w, acts, rows, out) }
}

pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if available() {
        // SAFETY: features checked just above.
        return unsafe { dot_f32_avx2(a, b) };
    }
    super::scalar::dot_f32(a, b)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_f32_avx2(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(test)]
    crate::isa::trace::hit(crate::Isa::Avx2);
    let n = a.len().min(b.len());
    let mut acc0 = _mm256_setzero_ps();
    let mut acc1 = _mm256_setzero_ps();
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: i + 16 <= n, both slices have at least n elements.
        unsafe {
            acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a.as_ptr().add(i)), _mm256_loadu_ps(b.as_ptr().add(i)), acc0);
            acc1 =
                _mm256_fmadd_ps(_mm256_loadu_ps(a.as_ptr().add(i + 8)), _mm256_loadu_ps(b.as_ptr().add(i + 8)), acc1);
        }
        i += 16;
    }
    let mut s = hsum(_mm256_add_ps(acc0, acc1));
    while i < n {
        s += a[i] * b[i];
        i += 1;
    }
    s
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn hsum(v: __m256) -> f32 {
    // SAFETY: callers are themselves `target_feature(enable = "avx2")`
    // functions, so these (AVX/SSE) instructions are available.
    unsafe {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps(v, 1);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }
}

/// Activation rows per cache tile: 32 rows of quantized activations
/// (~18 KiB for 576 columns) stay in L1 while a chunk of weight rows
/// streams past them.
const X_TILE: usize = 32;

/// # Safety
/// The CPU has avx2, fma and f16c, and concurrent callers pass disjoint `rows`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_rows<const Q41: bool>(w: &QMatrix<'_>, acts: &QActs, rows: Range<usize>, out: &SharedSlice<f32>) {
    // SAFETY: this function's contract; the body is inlined with these features.
    unsafe { q4_rows_with::<Q41, false>(w, acts, rows, out) }
}

/// # Safety
/// The CPU has avx2, fma, f16c and avxvnni, and concurrent callers pass disjoint `rows`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn q4_rows_vnni<const Q41: bool>(w: &QMatrix<'_>, acts: &QActs, rows: Range<usize>, out: &SharedSlice<f32>) {
    // SAFETY: this function's contract; the body is inlined with these features.
    unsafe { q4_rows_with::<Q41, true>(w, acts, rows, out) }
}

/// The body of [`q4_rows`] and [`q4_rows_vnni`], inlined into each.
///
/// # Safety
/// Only called from those two, whose target features it runs with.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn q4_rows_with<const Q41: bool, const VNNI: bool>(
    w: &QMatrix<'_>,
    acts: &QActs,
    rows: Range<usize>,
    out: &SharedSlice<f32>,
) {
    #[cfg(test)]
    crate::isa::trace::hit(if VNNI { crate::Isa::AvxVnni } else { crate::Isa::Avx2 });
    let m = acts.rows;
    let mut t0 = 0;
    while t0 < m {
        let t1 = (t0 + X_TILE).min(m);
        for r in rows.clone() {
            super::prefetch_ahead(w, r, &rows);
            let wrow = w.row(r);
            let mut i = t0;
            while i + 4 <= t1 {
                // SAFETY: same target features as this function.
                let v = unsafe { q4_kernel::<4, Q41, VNNI>(wrow, acts, i) };
                for (j, v) in v.into_iter().enumerate() {
                    // SAFETY: rows are this caller's alone (the function's contract: disjoint rows per thread).
                    unsafe { out.set((i + j) * w.rows + r, v) };
                }
                i += 4;
            }
            while i < t1 {
                // SAFETY: as above.
                let v = unsafe { q4_kernel::<1, Q41, VNNI>(wrow, acts, i) };
                // SAFETY: rows are this caller's alone (the function's contract: disjoint rows per thread).
                unsafe { out.set(i * w.rows + r, v[0]) };
                i += 1;
            }
        }
        t0 = t1;
    }
}

/// `R` activation rows starting at `x0` against one Q4_0/Q4_1 weight row.
///
/// # Safety
/// Inlined only into functions with avx2, fma and f16c (and avxvnni when `VNNI`).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn q4_kernel<const R: usize, const Q41: bool, const VNNI: bool>(
    wrow: &[u8],
    acts: &QActs,
    x0: usize,
) -> [f32; R] {
    let nb = acts.blocks_per_row();
    let bb = if Q41 { 20 } else { 18 };
    let qoff = if Q41 { 4 } else { 2 };
    // Every pointer below stays inside these bounds; checking once here
    // keeps bounds checks out of the inner loop (they were 30% of its instructions).
    assert!(wrow.len() >= nb * bb, "weight row shorter than the activation row");
    assert!((x0 + R) * nb <= acts.d.len() && (x0 + R) * nb <= acts.s.len(), "activation rows out of range");
    assert!((x0 + R) * nb * 32 <= acts.qs.len(), "activation rows out of range");
    let mask = _mm_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); R];
    // The offset terms are summed block by block in order (a product, then a sum), the
    // order the kernels have always used: greedy output is checked against llama.cpp's,
    // and a changed rounding here flipped a token (summing them in lanes and reducing at
    // the end, as the AVX-512 kernel does, flips one of the fixture's tokens). With four
    // activation rows, lane j of `accm4` is row j's sum, and one 4-lane add per block
    // does the four rows' scalar adds in the same order, so the bits are the same.
    let mut accm = [0f32; R];
    let mut accm4 = _mm_setzero_ps();
    let wp = wrow.as_ptr();
    // SAFETY (all `add`s and loads below): block g + b < nb of row x0 + j < x0 + R,
    // within the lengths asserted above; masked-off lanes are not read.
    let (xq0, d0, s0) =
        unsafe { (acts.qs.as_ptr().add(x0 * nb * 32), acts.d.as_ptr().add(x0 * nb), acts.s.as_ptr().add(x0 * nb)) };
    let mut g = 0;
    while g < nb {
        let n = (nb - g).min(GROUP);
        let live = live_lanes(n);
        let gp = unsafe { wp.add(g * bb) };
        let (dw, mw) = unsafe { block_scales(gp, bb, live) };
        let mw = if Q41 { mw } else { _mm256_mul_ps(dw, _mm256_set1_ps(-8.0)) };
        let mut scales = [_mm256_setzero_ps(); R];
        let mut offs = [_mm256_setzero_ps(); R];
        for j in 0..R {
            let idx = j * nb + g;
            let (dx, sx) = unsafe { (_mm256_maskload_ps(d0.add(idx), live), _mm256_maskload_ps(s0.add(idx), live)) };
            scales[j] = _mm256_mul_ps(dw, dx);
            offs[j] = _mm256_mul_ps(mw, sx);
        }
        if let Ok(four) = <&[__m256; 4]>::try_from(offs.as_slice()) {
            // Block b's four rows' terms in one 4-lane vector, added in block order.
            for v in &transpose_4x8(four)[..n] {
                accm4 = _mm_add_ps(accm4, *v);
            }
        } else {
            for j in 0..R {
                let mut o = [0f32; GROUP];
                // SAFETY: `o` holds eight f32.
                unsafe { _mm256_storeu_ps(o.as_mut_ptr(), offs[j]) };
                for o in &o[..n] {
                    accm[j] += o;
                }
            }
        }
        for b in 0..n {
            let qs = unsafe { _mm_loadu_si128(gp.add(b * bb + qoff) as *const __m128i) };
            let lo = _mm_and_si128(qs, mask);
            let hi = _mm_and_si128(_mm_srli_epi16(qs, 4), mask);
            let wq = _mm256_set_m128i(hi, lo);
            let sel = _mm256_set1_epi32(b as i32);
            for j in 0..R {
                let xq = unsafe { _mm256_loadu_si256(xq0.add((j * nb + g + b) * 32) as *const __m256i) };
                let p = _mm256_cvtepi32_ps(dot_u8_i8::<VNNI>(wq, xq, ones));
                acc[j] = _mm256_fmadd_ps(p, _mm256_permutevar8x32_ps(scales[j], sel), acc[j]);
            }
        }
        g += GROUP;
    }
    if let Ok(four) = <&mut [f32; 4]>::try_from(accm.as_mut_slice()) {
        // SAFETY: `four` holds four f32.
        unsafe { _mm_storeu_ps(four.as_mut_ptr(), accm4) };
    }
    let mut res = [0f32; R];
    for j in 0..R {
        res[j] = hsum(acc[j]) + accm[j];
    }
    res
}

/// Four rows of eight lanes (`rows[j]` lane b) as eight columns of four
/// (`out[b]` lane j).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn transpose_4x8(rows: &[__m256; 4]) -> [__m128; 8] {
    // SAFETY: inlined only into avx2-enabled kernels (all SSE/AVX shuffles).
    unsafe {
        let (r0, r1, r2, r3) = (rows[0], rows[1], rows[2], rows[3]);
        // [r0b0 r1b0 r0b1 r1b1 | r0b4 r1b4 r0b5 r1b5] and the like.
        let t0 = _mm256_unpacklo_ps(r0, r1);
        let t1 = _mm256_unpackhi_ps(r0, r1);
        let t2 = _mm256_unpacklo_ps(r2, r3);
        let t3 = _mm256_unpackhi_ps(r2, r3);
        // [b0 | b4], [b1 | b5], [b2 | b6], [b3 | b7], each four rows.
        let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
        let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
        let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
        let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
        [
            _mm256_castps256_ps128(u0),
            _mm256_castps256_ps128(u1),
            _mm256_castps256_ps128(u2),
            _mm256_castps256_ps128(u3),
            _mm256_extractf128_ps::<1>(u0),
            _mm256_extractf128_ps::<1>(u1),
            _mm256_extractf128_ps::<1>(u2),
            _mm256_extractf128_ps::<1>(u3),
        ]
    }
}

/// Blocks whose scales are fetched and multiplied together, one per lane.
const GROUP: usize = 8;

/// All-ones in the first `n` of eight i32 lanes (the mask of a group of `n` blocks).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn live_lanes(n: usize) -> __m256i {
    // SAFETY: inlined only into avx2-enabled kernels.
    unsafe { _mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)) }
}

/// The first two f16 of each of up to eight blocks `bb` bytes apart from `gp` (a block's
/// `d`, and `m` in Q4_1), as f32 lanes, by one gather: a block's scales then cost a lane
/// each instead of two scalar f16 conversions and a multiply per block. Lanes not in
/// `live` are 0 and read nothing.
///
/// # Safety
/// Every live lane's four bytes at `gp + lane * bb` are readable; avx2 and f16c.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn block_scales(gp: *const u8, bb: usize, live: __m256i) -> (__m256, __m256) {
    // SAFETY: the caller's contract.
    unsafe {
        let offsets = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(bb as i32));
        let dm = _mm256_mask_i32gather_epi32::<1>(_mm256_setzero_si256(), gp as *const i32, offsets, live);
        // In each 128-bit half: the four low u16 into bytes 0..8, the four high into 8..16;
        // then the halves' quadwords [lo0, hi0, lo1, hi1] become [lo0, lo1, hi0, hi1].
        let split = _mm256_setr_epi8(
            0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
        );
        let s = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_shuffle_epi8(dm, split));
        (_mm256_cvtph_ps(_mm256_castsi256_si128(s)), _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(s)))
    }
}

/// Sums of four adjacent u8 × i8 products, as i32 lanes: one `vpdpbusd` with
/// AVX-VNNI, else `vpmaddubsw` + `vpmaddwd` (`ones`: i16 ones).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn dot_u8_i8<const VNNI: bool>(u: __m256i, s: __m256i, ones: __m256i) -> __m256i {
    // SAFETY: inlined only into functions with avx2 (and avxvnni when `VNNI`).
    unsafe {
        if VNNI {
            _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s)
        } else {
            _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), ones)
        }
    }
}

/// # Safety
/// The CPU has avx2, fma and f16c, and concurrent callers pass disjoint `rows`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_rows(w: &QMatrix<'_>, acts: &QActs, rows: Range<usize>, out: &SharedSlice<f32>) {
    // SAFETY: this function's contract; the body is inlined with these features.
    unsafe { q8_rows_with::<false>(w, acts, rows, out) }
}

/// # Safety
/// The CPU has avx2, fma, f16c and avxvnni, and concurrent callers pass disjoint `rows`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn q8_rows_vnni(w: &QMatrix<'_>, acts: &QActs, rows: Range<usize>, out: &SharedSlice<f32>) {
    // SAFETY: this function's contract; the body is inlined with these features.
    unsafe { q8_rows_with::<true>(w, acts, rows, out) }
}

/// The body of [`q8_rows`] and [`q8_rows_vnni`], inlined into each.
///
/// # Safety
/// Only called from those two, whose target features it runs with.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn q8_rows_with<const VNNI: bool>(w: &QMatrix<'_>, acts: &QActs, rows: Range<usize>, out: &SharedSlice<f32>) {
    #[cfg(test)]
    crate::isa::trace::hit(if VNNI { crate::Isa::AvxVnni } else { crate::Isa::Avx2 });
    let m = acts.rows;
    for r in rows.clone() {
        super::prefetch_ahead(w, r, &rows);
        let wrow = w.row(r);
        let mut i = 0;
        while i + 4 <= m {
            // SAFETY: same target features as this function.
            let v = unsafe { q8_kernel::<4, VNNI>(wrow, acts, i) };
            for (j, v) in v.into_iter().enumerate() {
                // SAFETY: rows are this caller's alone (the function's contract: disjoint rows per thread).
                unsafe { out.set((i + j) * w.rows + r, v) };
            }
            i += 4;
        }
        while i < m {
            // SAFETY: as above.
            let v = unsafe { q8_kernel::<1, VNNI>(wrow, acts, i) };
            // SAFETY: rows are this caller's alone (the function's contract: disjoint rows per thread).
            unsafe { out.set(i * w.rows + r, v[0]) };
            i += 1;
        }
    }
}

/// `R` activation rows starting at `x0` against one Q8_0 weight row.
///
/// # Safety
/// Inlined only into functions with avx2, fma and f16c (and avxvnni when `VNNI`).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn q8_kernel<const R: usize, const VNNI: bool>(wrow: &[u8], acts: &QActs, x0: usize) -> [f32; R] {
    let nb = acts.blocks_per_row();
    assert!(wrow.len() >= nb * 34, "weight row shorter than the activation row");
    assert!((x0 + R) * nb <= acts.d.len(), "activation rows out of range");
    assert!((x0 + R) * nb * 32 <= acts.qs.len(), "activation rows out of range");
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); R];
    let wp = wrow.as_ptr();
    // SAFETY (all `add`s and loads below): within the lengths asserted above; masked-off
    // lanes are not read. A gather reads 4 bytes at a block start (a block is 34).
    let (xq0, d0) = unsafe { (acts.qs.as_ptr().add(x0 * nb * 32), acts.d.as_ptr().add(x0 * nb)) };
    let mut g = 0;
    while g < nb {
        let n = (nb - g).min(GROUP);
        let live = live_lanes(n);
        let gp = unsafe { wp.add(g * 34) };
        let (dw, _) = unsafe { block_scales(gp, 34, live) };
        let mut scales = [_mm256_setzero_ps(); R];
        for (j, s) in scales.iter_mut().enumerate() {
            *s = _mm256_mul_ps(dw, unsafe { _mm256_maskload_ps(d0.add(j * nb + g), live) });
        }
        for b in 0..n {
            let wq = unsafe { _mm256_loadu_si256(gp.add(b * 34 + 2) as *const __m256i) };
            // |w| as u8 and x with w's sign: maddubs needs an unsigned operand.
            let aw = _mm256_sign_epi8(wq, wq);
            let sel = _mm256_set1_epi32(b as i32);
            for (j, acc_j) in acc.iter_mut().enumerate() {
                let xq = unsafe { _mm256_loadu_si256(xq0.add((j * nb + g + b) * 32) as *const __m256i) };
                let sx = _mm256_sign_epi8(xq, wq);
                let p = _mm256_cvtepi32_ps(dot_u8_i8::<VNNI>(aw, sx, ones));
                *acc_j = _mm256_fmadd_ps(p, _mm256_permutevar8x32_ps(scales[j], sel), *acc_j);
            }
        }
        g += GROUP;
    }
    let mut res = [0f32; R];
    for j in 0..R {
        res[j] = hsum(acc[j]);
    }
    res
}
