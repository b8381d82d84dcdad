//! AVX-512 (F/BW/VL) + VNNI kernels.
//!
//! One 512-bit register holds two 32-element blocks, and `vpdpbusd`
//! multiplies u8 × i8 and sums groups of four into i32 in one instruction
//! (AVX2 needs `vpmaddubsw` + `vpmaddwd`). Q4 nibbles are unsigned and the
//! activations signed, which is the operand order `vpdpbusd` wants; Q8_0
//! weights are signed, so they go in as |w| with w's sign moved onto x.
//!
//! As in the AVX2 kernels, up to four activation rows share one unpacked
//! pair of weight blocks, and each output sees the same instruction
//! sequence whatever the batch (see the module doc of `matmul`). A row with
//! an odd number of blocks ends with a half-register step whose upper half
//! is zero.
#![allow(unsafe_code)]

use std::ops::Range;

use crate::matmul::{QMatrix, WeightType};
use crate::pool::SharedSlice;
use crate::quant::QActs;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

#[cfg(target_arch = "x86_64")]
fn available() -> bool {
    crate::Isa::Avx512.available()
}

/// [`super::scalar::quant_rows`] with AVX-512 where the CPU has it, else AVX2's.
///
/// # Safety
/// As [`super::scalar::quant_rows`]: concurrent callers pass disjoint `rows`.
pub unsafe fn quant_rows(w: &QMatrix<'_>, acts: &QActs, rows: Range<usize>, out: &SharedSlice<f32>) {
    #[cfg(target_arch = "x86_64")]
    if available() {
        // SAFETY: the CPU has every flag `Isa::Avx512` needs (checked just above), which
        // covers the kernels' target features; `rows` are this caller's alone (the contract).
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
    unsafe { super::avx2::quant_rows(w, acts, rows, out) }
}

pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if available() {
        // SAFETY: features checked just above.
        return unsafe { dot_f32_avx512(a, b) };
    }
    super::avx2::dot_f32(a, b)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn dot_f32_avx512(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(test)]
    crate::isa::trace::hit(crate::Isa::Avx512);
    let n = a.len().min(b.len());
    let mut acc0 = _mm512_setzero_ps();
    let mut acc1 = _mm512_setzero_ps();
    let mut i = 0;
    while i + 32 <= n {
        // SAFETY: i + 32 <= n, both slices have at least n elements.
        unsafe {
            acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a.as_ptr().add(i)), _mm512_loadu_ps(b.as_ptr().add(i)), acc0);
            acc1 =
                _mm512_fmadd_ps(_mm512_loadu_ps(a.as_ptr().add(i + 16)), _mm512_loadu_ps(b.as_ptr().add(i + 16)), acc1);
        }
        i += 32;
    }
    if i + 16 <= n {
        // SAFETY: i + 16 <= n.
        unsafe {
            acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a.as_ptr().add(i)), _mm512_loadu_ps(b.as_ptr().add(i)), acc0);
        }
        i += 16;
    }
    let mut s = hsum512(_mm512_add_ps(acc0, acc1));
    while i < n {
        s += a[i] * b[i];
        i += 1;
    }
    s
}

/// Sum of 16 lanes in a fixed order (`_mm512_reduce_add_ps` leaves the order to the compiler).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn hsum512(v: __m512) -> f32 {
    // SAFETY: callers are themselves AVX-512F-enabled functions.
    unsafe {
        let lo = _mm512_castps512_ps256(v);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
        super::avx2::hsum(_mm256_add_ps(lo, hi))
    }
}

/// Activation rows per cache tile, as in the AVX2 kernels.
const X_TILE: usize = 32;

/// # Safety
/// The CPU has `Isa::Avx512`'s flags, and concurrent callers pass disjoint `rows`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_rows<const Q41: bool>(w: &QMatrix<'_>, acts: &QActs, rows: Range<usize>, out: &SharedSlice<f32>) {
    #[cfg(test)]
    crate::isa::trace::hit(crate::Isa::Avx512);
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
                let v = unsafe { q4_kernel::<4, Q41>(wrow, acts, i) };
                for (j, v) in v.into_iter().enumerate() {
                    // SAFETY: rows are this caller's alone (the function's contract: disjoint rows per thread).
                    unsafe { out.set((i + j) * w.rows + r, v) };
                }
                i += 4;
            }
            while i < t1 {
                // SAFETY: as above.
                let v = unsafe { q4_kernel::<1, Q41>(wrow, acts, i) };
                // SAFETY: rows are this caller's alone (the function's contract: disjoint rows per thread).
                unsafe { out.set(i * w.rows + r, v[0]) };
                i += 1;
            }
        }
        t0 = t1;
    }
}

/// Blocks whose scales are fetched and multiplied together, one per lane.
const GROUP: usize = 16;

/// `R` activation rows starting at `x0` against one Q4_0/Q4_1 weight row.
///
/// Per group of up to 16 blocks, one gather fetches every block's `d` and `m`
/// (the first four bytes of each block), so block scales cost a lane each
/// instead of scalar f16 conversions per block; each pair of blocks then
/// picks its two scales out of that register with one permute.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn q4_kernel<const R: usize, const Q41: bool>(wrow: &[u8], acts: &QActs, x0: usize) -> [f32; R] {
    let nb = acts.blocks_per_row();
    let bb: usize = if Q41 { 20 } else { 18 };
    let qoff = if Q41 { 4 } else { 2 };
    // Every pointer below stays inside these bounds; checking once here keeps
    // bounds checks out of the inner loop.
    assert!(wrow.len() >= nb * bb, "weight row shorter than the activation row");
    assert!((x0 + R) * nb <= acts.d.len() && (x0 + R) * nb <= acts.s.len(), "activation rows out of range");
    assert!((x0 + R) * nb * 32 <= acts.qs.len(), "activation rows out of range");
    let nib = _mm512_set1_epi8(0x0F);
    let offsets = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(bb as i32),
    );
    // Lanes 0..8 take block b's scale, 8..16 block b + 1's.
    let pair_sel = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    let mut acc = [_mm512_setzero_ps(); R];
    let mut accm = [_mm512_setzero_ps(); R];
    let wp = wrow.as_ptr();
    // SAFETY (all `add`s, loads and gathers below): blocks g + i < nb of rows x0 + j < x0 + R,
    // within the lengths asserted above; masked-off lanes are not read.
    let (xq0, d0, s0) =
        unsafe { (acts.qs.as_ptr().add(x0 * nb * 32), acts.d.as_ptr().add(x0 * nb), acts.s.as_ptr().add(x0 * nb)) };
    let mut g = 0;
    while g < nb {
        let n = (nb - g).min(GROUP);
        let k: __mmask16 = if n == GROUP { !0 } else { (1u16 << n) - 1 };
        let gp = unsafe { wp.add(g * bb) };
        let dm = unsafe { _mm512_mask_i32gather_epi32::<1>(_mm512_setzero_si512(), k, offsets, gp as *const i32) };
        let dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
        let mw = if Q41 {
            _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(dm)))
        } else {
            _mm512_mul_ps(dw, _mm512_set1_ps(-8.0))
        };
        let mut scales = [_mm512_setzero_ps(); R];
        for j in 0..R {
            let idx = j * nb + g;
            let (dx, sx) = unsafe { (_mm512_maskz_loadu_ps(k, d0.add(idx)), _mm512_maskz_loadu_ps(k, s0.add(idx))) };
            scales[j] = _mm512_mul_ps(dw, dx);
            accm[j] = _mm512_fmadd_ps(mw, sx, accm[j]);
        }
        let mut b = 0;
        while b < n {
            // Groups are even-sized, so a lone block only ends a row with an odd count.
            let pair = b + 1 < n;
            let blk = unsafe { gp.add(b * bb) };
            // [q0 | q1] (q1 zero for a lone block), then [q0, q0>>4, q1, q1>>4] & 0x0F:
            // low nibbles are elements 0..16 of a block, high nibbles 16..32.
            let q0 = unsafe { _mm_loadu_si128(blk.add(qoff) as *const __m128i) };
            let q1 = if pair {
                unsafe { _mm_loadu_si128(blk.add(bb + qoff) as *const __m128i) }
            } else {
                _mm_setzero_si128()
            };
            let q = _mm256_set_m128i(q1, q0);
            let qq = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(q), _mm256_srli_epi16::<4>(q));
            let wq = _mm512_and_si512(_mm512_shuffle_i64x2::<0b11_01_10_00>(qq, qq), nib);
            let sel = _mm512_add_epi32(pair_sel, _mm512_set1_epi32(b as i32));
            // Two blocks' activations are contiguous; a lone block loads only its 32 bytes.
            let xmask: __mmask64 = if pair { !0 } else { 0xFFFF_FFFF };
            for j in 0..R {
                let xq = unsafe { _mm512_maskz_loadu_epi8(xmask, xq0.add((j * nb + g + b) * 32)) };
                let p = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wq, xq));
                // A lone block's upper lanes are zero products times a masked-off (zero) scale.
                acc[j] = _mm512_fmadd_ps(p, _mm512_permutexvar_ps(sel, scales[j]), acc[j]);
            }
            b += 2;
        }
        g += GROUP;
    }
    let mut res = [0f32; R];
    for j in 0..R {
        res[j] = hsum512(acc[j]) + hsum512(accm[j]);
    }
    res
}

/// # Safety
/// The CPU has `Isa::Avx512`'s flags, and concurrent callers pass disjoint `rows`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q8_rows(w: &QMatrix<'_>, acts: &QActs, rows: Range<usize>, out: &SharedSlice<f32>) {
    #[cfg(test)]
    crate::isa::trace::hit(crate::Isa::Avx512);
    let m = acts.rows;
    for r in rows.clone() {
        super::prefetch_ahead(w, r, &rows);
        let wrow = w.row(r);
        let mut i = 0;
        while i + 4 <= m {
            // SAFETY: same target features as this function.
            let v = unsafe { q8_kernel::<4>(wrow, acts, i) };
            for (j, v) in v.into_iter().enumerate() {
                // SAFETY: rows are this caller's alone (the function's contract: disjoint rows per thread).
                unsafe { out.set((i + j) * w.rows + r, v) };
            }
            i += 4;
        }
        while i < m {
            // SAFETY: as above.
            let v = unsafe { q8_kernel::<1>(wrow, acts, i) };
            // SAFETY: rows are this caller's alone (the function's contract: disjoint rows per thread).
            unsafe { out.set(i * w.rows + r, v[0]) };
            i += 1;
        }
    }
}

/// `R` activation rows starting at `x0` against one Q8_0 weight row; scales
/// as in [`q4_kernel`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn q8_kernel<const R: usize>(wrow: &[u8], acts: &QActs, x0: usize) -> [f32; R] {
    const BB: usize = 34;
    let nb = acts.blocks_per_row();
    assert!(wrow.len() >= nb * BB, "weight row shorter than the activation row");
    assert!((x0 + R) * nb <= acts.d.len(), "activation rows out of range");
    assert!((x0 + R) * nb * 32 <= acts.qs.len(), "activation rows out of range");
    let offsets = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(BB as i32),
    );
    let pair_sel = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    let mut acc = [_mm512_setzero_ps(); R];
    let wp = wrow.as_ptr();
    // SAFETY (all `add`s, loads and gathers below): within the lengths asserted above;
    // masked-off lanes are not read. A gather reads 4 bytes at a block start (a block is 34).
    let (xq0, d0) = unsafe { (acts.qs.as_ptr().add(x0 * nb * 32), acts.d.as_ptr().add(x0 * nb)) };
    let mut g = 0;
    while g < nb {
        let n = (nb - g).min(GROUP);
        let k: __mmask16 = if n == GROUP { !0 } else { (1u16 << n) - 1 };
        let gp = unsafe { wp.add(g * BB) };
        let d = unsafe { _mm512_mask_i32gather_epi32::<1>(_mm512_setzero_si512(), k, offsets, gp as *const i32) };
        let dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(d));
        let mut scales = [_mm512_setzero_ps(); R];
        for (j, s) in scales.iter_mut().enumerate() {
            *s = _mm512_mul_ps(dw, unsafe { _mm512_maskz_loadu_ps(k, d0.add(j * nb + g)) });
        }
        let mut b = 0;
        while b < n {
            let pair = b + 1 < n;
            let blk = unsafe { gp.add(b * BB) };
            let w0 = unsafe { _mm256_loadu_si256(blk.add(2) as *const __m256i) };
            let w1 = if pair {
                unsafe { _mm256_loadu_si256(blk.add(BB + 2) as *const __m256i) }
            } else {
                _mm256_setzero_si256()
            };
            let wq = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(w0), w1);
            // |w| as u8 (|-128| = 128 fits) and x negated where w < 0: vpdpbusd needs an
            // unsigned operand. Activations lie in [-127, 127], so negating them is exact.
            let aw = _mm512_abs_epi8(wq);
            let neg = _mm512_movepi8_mask(wq);
            let sel = _mm512_add_epi32(pair_sel, _mm512_set1_epi32(b as i32));
            let xmask: __mmask64 = if pair { !0 } else { 0xFFFF_FFFF };
            for (j, acc_j) in acc.iter_mut().enumerate() {
                let xq = unsafe { _mm512_maskz_loadu_epi8(xmask, xq0.add((j * nb + g + b) * 32)) };
                let sx = _mm512_mask_sub_epi8(xq, neg, _mm512_setzero_si512(), xq);
                let p = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), aw, sx));
                *acc_j = _mm512_fmadd_ps(p, _mm512_permutexvar_ps(sel, scales[j]), *acc_j);
            }
            b += 2;
        }
        g += GROUP;
    }
    let mut res = [0f32; R];
    for j in 0..R {
        res[j] = hsum512(acc[j]);
    }
    res
}
