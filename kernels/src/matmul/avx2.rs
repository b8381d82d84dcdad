//! AVX2 + FMA + F16C kernels.
//!
//! Quantized dot products use `vpmaddubsw` (u8 × i8 → i16 pairs) and
//! `vpmaddwd` (→ i32), then one FMA per block with the product of scales.
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

pub fn quant_rows(w: &QMatrix<'_>, acts: &QActs, rows: Range<usize>, out: &SharedSlice<f32>) {
    #[cfg(target_arch = "x86_64")]
    if available() {
        // SAFETY: the CPU supports avx2, fma and f16c (checked just above).
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
    super::scalar::quant_rows(w, acts, rows, out)
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

#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn f16_at(p: &[u8], byte: usize) -> f32 {
    let bits = u16::from_le_bytes([p[byte], p[byte + 1]]);
    // SAFETY: only reached from f16c-enabled kernels.
    unsafe { _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32))) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_rows<const Q41: bool>(w: &QMatrix<'_>, acts: &QActs, rows: Range<usize>, out: &SharedSlice<f32>) {
    let m = acts.rows;
    for r in rows {
        let wrow = w.row(r);
        let mut i = 0;
        while i + 4 <= m {
            // SAFETY: same target features as this function.
            let v = unsafe { q4_kernel::<4, Q41>(wrow, acts, i) };
            for (j, v) in v.into_iter().enumerate() {
                out.set((i + j) * w.rows + r, v);
            }
            i += 4;
        }
        while i < m {
            // SAFETY: as above.
            let v = unsafe { q4_kernel::<1, Q41>(wrow, acts, i) };
            out.set(i * w.rows + r, v[0]);
            i += 1;
        }
    }
}

/// `R` activation rows starting at `x0` against one Q4_0/Q4_1 weight row.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q4_kernel<const R: usize, const Q41: bool>(wrow: &[u8], acts: &QActs, x0: usize) -> [f32; R] {
    let nb = acts.blocks_per_row();
    let bb = if Q41 { 20 } else { 18 };
    let qoff = if Q41 { 4 } else { 2 };
    assert!(wrow.len() >= nb * bb, "weight row shorter than the activation row");
    assert!((x0 + R) * nb <= acts.d.len(), "activation rows out of range");
    let mask = _mm_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); R];
    let mut accm = [0f32; R];
    for b in 0..nb {
        let blk = &wrow[b * bb..(b + 1) * bb];
        let dw = f16_at(blk, 0);
        let mw = if Q41 { f16_at(blk, 2) } else { -8.0 * dw };
        // SAFETY: `blk` has bb bytes, and qoff + 16 == bb.
        let qs = unsafe { _mm_loadu_si128(blk.as_ptr().add(qoff) as *const __m128i) };
        let lo = _mm_and_si128(qs, mask);
        let hi = _mm_and_si128(_mm_srli_epi16(qs, 4), mask);
        let wq = _mm256_set_m128i(hi, lo);
        for j in 0..R {
            let idx = (x0 + j) * nb + b;
            // SAFETY: idx < rows * nb (asserted above), and qs holds 32 bytes per block.
            let xq = unsafe { _mm256_loadu_si256(acts.qs.as_ptr().add(idx * 32) as *const __m256i) };
            let p = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(wq, xq), ones));
            acc[j] = _mm256_fmadd_ps(p, _mm256_set1_ps(dw * acts.d[idx]), acc[j]);
            accm[j] += mw * acts.s[idx];
        }
    }
    let mut res = [0f32; R];
    for j in 0..R {
        res[j] = hsum(acc[j]) + accm[j];
    }
    res
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_rows(w: &QMatrix<'_>, acts: &QActs, rows: Range<usize>, out: &SharedSlice<f32>) {
    let m = acts.rows;
    for r in rows {
        let wrow = w.row(r);
        let mut i = 0;
        while i + 4 <= m {
            // SAFETY: same target features as this function.
            let v = unsafe { q8_kernel::<4>(wrow, acts, i) };
            for (j, v) in v.into_iter().enumerate() {
                out.set((i + j) * w.rows + r, v);
            }
            i += 4;
        }
        while i < m {
            // SAFETY: as above.
            let v = unsafe { q8_kernel::<1>(wrow, acts, i) };
            out.set(i * w.rows + r, v[0]);
            i += 1;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q8_kernel<const R: usize>(wrow: &[u8], acts: &QActs, x0: usize) -> [f32; R] {
    let nb = acts.blocks_per_row();
    assert!(wrow.len() >= nb * 34, "weight row shorter than the activation row");
    assert!((x0 + R) * nb <= acts.d.len(), "activation rows out of range");
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); R];
    for b in 0..nb {
        let blk = &wrow[b * 34..(b + 1) * 34];
        let dw = f16_at(blk, 0);
        // SAFETY: `blk` has 34 bytes: 2 of scale, 32 of quants.
        let wq = unsafe { _mm256_loadu_si256(blk.as_ptr().add(2) as *const __m256i) };
        // |w| as u8 and x with w's sign: maddubs needs an unsigned operand.
        let aw = _mm256_sign_epi8(wq, wq);
        for (j, acc_j) in acc.iter_mut().enumerate() {
            let idx = (x0 + j) * nb + b;
            // SAFETY: idx < rows * nb (asserted above).
            let xq = unsafe { _mm256_loadu_si256(acts.qs.as_ptr().add(idx * 32) as *const __m256i) };
            let sx = _mm256_sign_epi8(xq, wq);
            let p = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), ones));
            *acc_j = _mm256_fmadd_ps(p, _mm256_set1_ps(dw * acts.d[idx]), *acc_j);
        }
    }
    let mut res = [0f32; R];
    for j in 0..R {
        res[j] = hsum(acc[j]);
    }
    res
}
