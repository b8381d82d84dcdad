//! ggml block-quantized formats, their dequantization, and the 8-bit
//! activation format that quantized matmuls multiply against.
//!
//! Block layouts (32 weights a block, little-endian, as in GGUF):
//! - Q4_0: `d: f16, qs: [u8; 16]` — w = d * (q - 8)
//! - Q4_1: `d: f16, m: f16, qs: [u8; 16]` — w = d * q + m
//! - Q8_0: `d: f16, qs: [i8; 32]` — w = d * q
//!
//! In Q4 blocks byte `j` holds element `j` in its low nibble and element
//! `j + 16` in its high nibble.

// `quantize_par` splits three buffers between threads by rows (`SharedSlice::range_mut`).
#![allow(unsafe_code)]

use crate::f16::{bf16_bits_to_f32, f16_bits_to_f32, le_u16};
use crate::matmul::WeightType;
use crate::Isa;

pub const QK: usize = 32;

/// Dequantizes one row of `k` weights of type `ty` into `out`.
pub fn dequantize_row(ty: WeightType, row: &[u8], out: &mut [f32]) {
    match ty {
        WeightType::F32 => {
            for (o, c) in out.iter_mut().zip(row.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        WeightType::F16 => {
            for (i, o) in out.iter_mut().enumerate() {
                *o = f16_bits_to_f32(le_u16(row, i));
            }
        }
        WeightType::BF16 => {
            for (i, o) in out.iter_mut().enumerate() {
                *o = bf16_bits_to_f32(le_u16(row, i));
            }
        }
        WeightType::Q4_0 => {
            for (blk, o) in row.chunks_exact(18).zip(out.chunks_exact_mut(QK)) {
                let d = f16_bits_to_f32(le_u16(blk, 0));
                for j in 0..16 {
                    let b = blk[2 + j];
                    o[j] = d * ((b & 0x0F) as f32 - 8.0);
                    o[j + 16] = d * ((b >> 4) as f32 - 8.0);
                }
            }
        }
        WeightType::Q4_1 => {
            for (blk, o) in row.chunks_exact(20).zip(out.chunks_exact_mut(QK)) {
                let d = f16_bits_to_f32(le_u16(blk, 0));
                let m = f16_bits_to_f32(le_u16(blk, 1));
                for j in 0..16 {
                    let b = blk[4 + j];
                    o[j] = d * (b & 0x0F) as f32 + m;
                    o[j + 16] = d * (b >> 4) as f32 + m;
                }
            }
        }
        WeightType::Q8_0 => {
            for (blk, o) in row.chunks_exact(34).zip(out.chunks_exact_mut(QK)) {
                let d = f16_bits_to_f32(le_u16(blk, 0));
                for j in 0..QK {
                    o[j] = d * (blk[2 + j] as i8) as f32;
                }
            }
        }
    }
}

/// Quantizes a row of `k` floats (k a multiple of 32) to Q8_0 bytes.
pub fn quantize_row_q8_0(x: &[f32], out: &mut [u8]) {
    for (xb, ob) in x.chunks_exact(QK).zip(out.chunks_exact_mut(34)) {
        let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        ob[..2].copy_from_slice(&crate::f16::f32_to_f16_bits(d).to_le_bytes());
        for (o, v) in ob[2..].iter_mut().zip(xb) {
            *o = (v * id).round() as i8 as u8;
        }
    }
}

/// Activations quantized to 8 bits in blocks of 32, one row per token.
///
/// Each block keeps its scale `d` and `s = d * sum(q)`; the `s` term lets
/// Q4_1 (with its offset `m`) and Q4_0 (with its bias of 8) be multiplied
/// with integer dot products only.
#[derive(Debug, Default, Clone)]
pub struct QActs {
    pub rows: usize,
    pub k: usize,
    pub qs: Vec<i8>,
    pub d: Vec<f32>,
    pub s: Vec<f32>,
}

impl QActs {
    /// Quantizes `rows` rows of `k` floats each from `x` (row-major),
    /// reusing this buffer's allocations.
    /// Every level gives the same bytes as the scalar reference.
    pub fn quantize(&mut self, isa: Isa, x: &[f32], rows: usize, k: usize) {
        self.reshape(rows, k);
        quantize_blocks(isa, x, &mut self.qs, &mut self.d, &mut self.s);
    }

    /// As [`quantize`](Self::quantize), with the rows split across the pool.
    pub fn quantize_par(&mut self, pool: &crate::ThreadPool, isa: Isa, x: &[f32], rows: usize, k: usize) {
        self.reshape(rows, k);
        let nb_row = k / QK;
        let qs = crate::pool::SharedSlice::new(&mut self.qs);
        let d = crate::pool::SharedSlice::new(&mut self.d);
        let s = crate::pool::SharedSlice::new(&mut self.s);
        pool.for_ranges(rows, 8, &|r| {
            // SAFETY: `for_ranges` hands each row range to exactly one call, and each slice's
            // sub-range is a function of the rows alone, so no two calls overlap in any of
            // the three; the buffers stay borrowed until the pool returns.
            let (qs, d, s) = unsafe {
                (
                    qs.range_mut(r.start * k..r.end * k),
                    d.range_mut(r.start * nb_row..r.end * nb_row),
                    s.range_mut(r.start * nb_row..r.end * nb_row),
                )
            };
            quantize_blocks(isa, &x[r.start * k..r.end * k], qs, d, s);
        });
    }

    fn reshape(&mut self, rows: usize, k: usize) {
        assert_eq!(k % QK, 0, "activation row length must be a multiple of {QK}");
        self.rows = rows;
        self.k = k;
        let nb = rows * k / QK;
        self.qs.resize(rows * k, 0);
        self.d.resize(nb, 0.0);
        self.s.resize(nb, 0.0);
    }

    /// Blocks per row.
    pub fn blocks_per_row(&self) -> usize {
        self.k / QK
    }

    /// Grows the buffers to hold `rows` rows of `k` and writes them, so that quantizing
    /// up to that many elements later neither allocates nor faults a page in.
    pub fn reserve(&mut self, rows: usize, k: usize) {
        self.reshape(rows, k);
    }

    /// Bytes the buffers hold (their capacity).
    pub fn capacity_bytes(&self) -> usize {
        self.qs.capacity() + (self.d.capacity() + self.s.capacity()) * std::mem::size_of::<f32>()
    }
}

/// Quantizes whole blocks of `x` into `qs`, with per-block scale `d` and `s = d * sum(q)`,
/// using `isa`'s code: every SIMD level gives the scalar reference's bytes.
///
/// This runs before every quantized matmul, over every activation element: in scalar
/// code each element's rounding is a libm call (x86-64's baseline has no `roundps`),
/// which cost about 5% of a decode step.
fn quantize_blocks(isa: Isa, x: &[f32], qs: &mut [i8], d_out: &mut [f32], s_out: &mut [f32]) {
    assert_eq!(x.len(), qs.len());
    assert_eq!(x.len(), d_out.len() * QK);
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Scalar && Isa::Avx2.available() {
        // SAFETY: the CPU has AVX2, FMA and F16C (checked just above); lengths were checked.
        unsafe { quantize_blocks_avx2(x, qs, d_out, s_out) };
        return;
    }
    let _ = isa;
    quantize_blocks_scalar(x, qs, d_out, s_out);
}

/// The reference [`quantize_blocks`].
fn quantize_blocks_scalar(x: &[f32], qs: &mut [i8], d_out: &mut [f32], s_out: &mut [f32]) {
    for (b, (xb, qb)) in x.chunks_exact(QK).zip(qs.chunks_exact_mut(QK)).enumerate() {
        let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        // 127/amax and round-half-to-even, as ggml's x86 quantizer does.
        let id = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for (q, v) in qb.iter_mut().zip(xb) {
            let r = (v * id).round_ties_even() as i32;
            *q = r as i8;
            sum += r;
        }
        // Scales are kept at f16 precision, as ggml's Q8_0/Q8_1 blocks
        // store them: products then round the way llama.cpp's do, which
        // keeps greedy output aligned with the reference at near-ties.
        d_out[b] = round_f16(d);
        s_out[b] = round_f16(d * sum as f32);
    }
}

/// [`quantize_blocks_scalar`] on eight lanes: the same operations in the same order per
/// element (the block maximum and the integer sum do not depend on order), so the bytes
/// are the reference's. NaN elements quantize to 0 and are ignored by the maximum, as in
/// the reference (`f32::max` drops NaN, `NaN as i32` is 0).
///
/// # Safety
/// The CPU has AVX2; `x.len() == qs.len() == d_out.len() * 32 == s_out.len() * 32`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_blocks_avx2(x: &[f32], qs: &mut [i8], d_out: &mut [f32], s_out: &mut [f32]) {
    use std::arch::x86_64::*;
    assert!(x.len() == qs.len() && x.len() == d_out.len() * QK && d_out.len() == s_out.len());
    let sign = _mm256_set1_ps(-0.0);
    // packs_epi32 then packs_epi16 interleave the 128-bit lanes; this puts the dwords back.
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for b in 0..d_out.len() {
        // SAFETY: block b's 32 floats and 32 bytes lie inside x and qs (asserted above).
        let (xp, qp) = unsafe { (x.as_ptr().add(b * QK), qs.as_mut_ptr().add(b * QK)) };
        let v: [__m256; 4] = std::array::from_fn(|i| unsafe { _mm256_loadu_ps(xp.add(8 * i)) });
        // max(|v|, m) keeps m when |v| is NaN (the second operand wins on NaN).
        let mut m = _mm256_setzero_ps();
        for vi in v {
            m = _mm256_max_ps(_mm256_andnot_ps(sign, vi), m);
        }
        let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps::<0b01>(m2, m2)));
        let d = amax / 127.0;
        let id = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        let idv = _mm256_set1_ps(id);
        let q: [__m256i; 4] = std::array::from_fn(|i| {
            let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(v[i], idv));
            // NaN lanes (a NaN or infinite input) become 0, as `NaN as i32` does.
            _mm256_cvtps_epi32(_mm256_and_ps(r, _mm256_cmp_ps::<_CMP_ORD_Q>(r, r)))
        });
        let sum8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        let s4 = _mm_add_epi32(_mm256_castsi256_si128(sum8), _mm256_extracti128_si256::<1>(sum8));
        let s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
        let sum = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32::<0b01>(s2)));
        // Every value is in [-127, 127], so the saturating packs are exact.
        let w = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        // SAFETY: 32 bytes of block b (see above).
        unsafe { _mm256_storeu_si256(qp as *mut __m256i, _mm256_permutevar8x32_epi32(w, order)) };
        d_out[b] = round_f16(d);
        s_out[b] = round_f16(d * sum as f32);
    }
}

fn round_f16(v: f32) -> f32 {
    crate::f16::f16_bits_to_f32(crate::f16::f32_to_f16_bits(v))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_roundtrip_is_close() {
        let x: Vec<f32> = (0..64).map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0).collect();
        let mut q = vec![0u8; 68];
        quantize_row_q8_0(&x, &mut q);
        let mut y = vec![0f32; 64];
        dequantize_row(WeightType::Q8_0, &q, &mut y);
        for (a, b) in x.iter().zip(&y) {
            assert!((a - b).abs() < 0.02, "{a} vs {b}");
        }
    }

    #[test]
    fn q4_1_nibble_order() {
        // d = 1, m = 0: element j is the low nibble of byte j, j+16 the high one.
        let mut blk = vec![0u8; 20];
        blk[..2].copy_from_slice(&crate::f16::f32_to_f16_bits(1.0).to_le_bytes());
        blk[4] = 0x53;
        let mut out = vec![0f32; 32];
        dequantize_row(WeightType::Q4_1, &blk, &mut out);
        assert_eq!(out[0], 3.0);
        assert_eq!(out[16], 5.0);
    }

    /// Every SIMD level quantizes activations to the reference's bytes, scales and sums,
    /// including ties (x·127/amax exactly k + 0.5), zero, NaN and infinite blocks.
    #[test]
    fn simd_quantize_matches_the_reference_bit_for_bit() {
        let mut rng = crate::matmul::tests::Rng::new(11);
        let k = 32 * 24;
        let mut x: Vec<f32> = (0..3 * k).map(|_| rng.f32() * 4.0).collect();
        // Block 1: amax 127 so id = 1, and halves that must round to even.
        for (j, v) in x[32..64].iter_mut().enumerate() {
            *v = if j == 0 { 127.0 } else { (j as f32 - 16.0) + 0.5 };
        }
        x[64..96].fill(0.0);
        x[96..128].fill(-0.0);
        x[130] = f32::NAN;
        x[170] = f32::INFINITY;
        x[200..232].fill(f32::NAN);
        x[300] = 1e30;
        x[333] = -1e-30;
        let mut want = QActs::default();
        want.quantize(Isa::Scalar, &x, 3, k);
        for isa in Isa::ALL.into_iter().skip(1) {
            if !crate::isa::trace::runnable("simd_quantize_matches_the_reference_bit_for_bit", isa) {
                continue;
            }
            let mut got = QActs::default();
            got.quantize(isa, &x, 3, k);
            assert_eq!(got.qs, want.qs, "{}: quantized values", isa.name());
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got.d), bits(&want.d), "{}: scales", isa.name());
            assert_eq!(bits(&got.s), bits(&want.s), "{}: sums", isa.name());
        }
        // The ties really are ties: 0.5 -> 0, 1.5 -> 2, -0.5 -> -0, -1.5 -> -2.
        assert_eq!(&want.qs[32 + 16..32 + 18], &[0, 2]);
        assert_eq!(&want.qs[32 + 15], &0);
        assert_eq!(&want.qs[32 + 14], &-2);
    }

    #[test]
    fn qacts_sum_term() {
        let x: Vec<f32> = (0..32).map(|i| i as f32 - 10.0).collect();
        let mut a = QActs::default();
        a.quantize(Isa::Scalar, &x, 1, 32);
        let back: f32 = a.qs.iter().map(|&q| q as f32 * a.d[0]).sum();
        // s is stored at f16 precision (relative error 2^-11).
        assert!((back - a.s[0]).abs() <= back.abs() * 1e-3, "{back} vs {}", a.s[0]);
        assert!((back - x.iter().sum::<f32>()).abs() < 0.5);
    }
}
