//! AVX2 + FMA + F16C kernels, and the AVX-VNNI variant of the quantized ones.
//!
//! Quantized dot products use `vpmaddubsw` (u8 × i8 → i16 pairs) and
//! `vpmaddwd` (→ i32), then one FMA per block with the product of scales.
//! With AVX-VNNI, one `vpdpbusd` (u8 × i8, four at a time, → i32) replaces
//! the pair; the i32 sums are the same (the pairs never saturate: weights
//! are at most 15 in Q4 and 127 in magnitude in Q8), so both give the same
//! bits. The kernels are written once, generic over `DOT` (which of the
//! three), and inlined into one entry point per instruction set; the
//! AVX-512 level's small-batch entry points (`avx512.rs`) are a third.
//!
//! Q4 weights go eight rows at a time with one row per 32-bit lane (a
//! *panel*, unpacked once from the file's layout by a transpose of the
//! rows' nibbles), and each activation block is broadcast four bytes at a
//! time, so a block's eight integer dot products come out in one register
//! with no horizontal sums, and every activation row of the batch reuses the
//! unpacked panel; this is where prefill gets its reuse. Q8_0 (the output
//! head) shares one unpacked weight group between up to four activation rows
//! and reduces each row's eight block sums with one `vphaddd` tree. Every
//! output sees the identical instruction sequence whatever the batch (see
//! the module doc of `matmul`).
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

/// # Safety
/// The CPU has avx2, fma and f16c, and concurrent callers pass disjoint `rows`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_rows<const Q41: bool>(w: &QMatrix<'_>, acts: &QActs, rows: Range<usize>, out: &SharedSlice<f32>) {
    // SAFETY: this function's contract; the body is inlined with these features.
    unsafe { q4_rows_with::<Q41, MADD>(w, acts, rows, out) }
}

/// # Safety
/// The CPU has avx2, fma, f16c and avxvnni, and concurrent callers pass disjoint `rows`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn q4_rows_vnni<const Q41: bool>(w: &QMatrix<'_>, acts: &QActs, rows: Range<usize>, out: &SharedSlice<f32>) {
    // SAFETY: this function's contract; the body is inlined with these features.
    unsafe { q4_rows_with::<Q41, VEX>(w, acts, rows, out) }
}

/// Weight rows one Q4 panel holds: one per i32 lane.
const PANEL: usize = 8;

/// Panels whose rows are asked for ahead of the one being computed.
const PANEL_AHEAD: usize = 2;

/// Eight weight rows' blocks, unpacked so that lanes are rows: `w[k]` holds
/// elements `4k..4k + 4` of the block of each of the panel's rows (lane l,
/// four u8), the order in which a block's activations are broadcast four at
/// a time; `d` and `m` are the rows' block scales (`m` is `-8 d` in Q4_0).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct PanelBlock {
    w: [__m256i; 8],
    d: __m256,
    m: __m256,
}

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// Each thread's unpacked panel, reused across calls.
    static PANEL_BUF: std::cell::Cell<Vec<PanelBlock>> = const { std::cell::Cell::new(Vec::new()) };
}

/// The body of [`q4_rows`] and [`q4_rows_vnni`], inlined into each.
///
/// Rows are taken eight at a time (a panel; a last panel of fewer rows
/// repeats its last row in the spare lanes, which are not stored). A panel's
/// blocks are unpacked once into [`PanelBlock`]s (a transpose of the rows'
/// nibbles, so a lane holds one row), then every activation row of the batch
/// runs against them: per block and four-element group, one broadcast of
/// four activation bytes and one `vpmaddubsw` + `vpmaddwd` (or `vpdpbusd`)
/// give the eight rows' exact partial dot products at once, with no
/// horizontal sums and one weight unpack per panel instead of one per
/// activation row. The rounding is ggml's (see [`panel_dots`]); an output is
/// one lane, the same instruction sequence whatever the batch and whichever
/// rows share its panel.
///
/// # Safety
/// Only called from those two, whose target features it runs with.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn q4_rows_with<const Q41: bool, const DOT: u8>(
    w: &QMatrix<'_>,
    acts: &QActs,
    rows: Range<usize>,
    out: &SharedSlice<f32>,
) {
    #[cfg(test)]
    crate::isa::trace::hit(dot_isa(DOT));
    let nb = acts.blocks_per_row();
    let m = acts.rows;
    let bb = w.ty.block_bytes();
    assert_eq!(bb, if Q41 { 20 } else { 18 }, "the kernel's Q4 type differs from the matrix's");
    assert!(w.cols == nb * 32, "weight columns differ from the activation row");
    assert!(m * nb * 32 <= acts.qs.len() && m * nb <= acts.d.len() && m * nb <= acts.s.len(), "activations short");
    let zero = PanelBlock { w: [_mm256_setzero_si256(); 8], d: _mm256_setzero_ps(), m: _mm256_setzero_ps() };
    // The panel buffer is kept per thread: a fresh one per call (15 KiB on AVX2, 30 on
    // AVX-512 for a 1,536-column matrix, zeroed)
    // cost a decode step hundreds of allocations and memsets.
    let mut buf = PANEL_BUF.take();
    if buf.len() < nb {
        buf.resize(nb, zero);
    }
    let panel = &mut buf[..nb];
    let mut r0 = rows.start;
    while r0 < rows.end {
        let live = (rows.end - r0).min(PANEL);
        // A whole packed panel (its spare lanes, past `live`, are rows of `w` too, computed
        // and not stored) or rows from the file layout.
        let packed = if r0 % PANEL == 0 { w.packed_panel(r0 / PANEL) } else { None };
        if let Some(pp) = packed {
            assert!(pp.len() >= nb * PANEL * bb, "packed panel shorter than a row's blocks");
        }
        super::prefetch_panels_ahead(w, r0, &rows, PANEL, PANEL_AHEAD);
        let mut lanes = [0f32; PANEL];
        let mut store = |i: usize, v: __m256| {
            // SAFETY: `lanes` holds eight f32.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), v) };
            for (l, x) in lanes.iter().take(live).enumerate() {
                // SAFETY: rows r0..r0 + live are this caller's alone (the contract: disjoint rows).
                unsafe { out.set(i * w.rows + r0 + l, *x) };
            }
        };
        if let (Some(pp), 1) = (packed, m) {
            // One activation row (a decode step): straight from the packed bytes, with no
            // unpacked copy to store and read back.
            // SAFETY: `pp` holds the panel's nb packed blocks (asserted), activation row 0
            // has nb blocks (asserted above); same target features as this function.
            store(0, unsafe { panel_dots::<DOT>(nb, |b| packed_block::<Q41>(pp.as_ptr(), b), acts, 0) });
        } else {
            match packed {
                Some(pp) => {
                    for (b, pb) in panel.iter_mut().enumerate() {
                        // SAFETY: block b < nb of the packed panel (asserted); same target
                        // features as this function.
                        *pb = unsafe { packed_block::<Q41>(pp.as_ptr(), b) };
                    }
                }
                // SAFETY: rows r0..r0 + live are rows of `w`; same target features as this
                // function.
                None => unsafe { unpack_panel::<Q41>(w, r0, live, panel) },
            }
            for i in 0..m {
                // SAFETY: activation row i < m, within the lengths asserted above.
                store(i, unsafe { panel_dots::<DOT>(nb, |b| panel[b], acts, i) });
            }
        }
        r0 += PANEL;
    }
    PANEL_BUF.set(buf);
}

/// Unpacks rows `r0..r0 + live` of `w` (`live` <= 8; spare lanes repeat the
/// last row) into `panel`, one [`PanelBlock`] per block.
///
/// # Safety
/// Rows `r0..r0 + live` exist in `w`, `live` >= 1, `panel` has a block per
/// block of a row; avx2, fma and f16c.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn unpack_panel<const Q41: bool>(w: &QMatrix<'_>, r0: usize, live: usize, panel: &mut [PanelBlock]) {
    let bb = if Q41 { 20 } else { 18 };
    let qoff = if Q41 { 4 } else { 2 };
    let row: [*const u8; PANEL] = std::array::from_fn(|l| w.row(r0 + l.min(live - 1)).as_ptr());
    let rb = w.ty.row_bytes(w.cols);
    assert!(panel.len() * bb <= rb, "panel longer than a row");
    // The gather's lane offsets (rows apart from the first) must fit an i32.
    assert!(rb * PANEL <= i32::MAX as usize, "rows too long for a panel");
    // Byte offsets of the lanes' rows from the first (for the scale gather).
    let base = row[0];
    let offs = _mm256_setr_epi32(
        0,
        (row[1] as usize - base as usize) as i32,
        (row[2] as usize - base as usize) as i32,
        (row[3] as usize - base as usize) as i32,
        (row[4] as usize - base as usize) as i32,
        (row[5] as usize - base as usize) as i32,
        (row[6] as usize - base as usize) as i32,
        (row[7] as usize - base as usize) as i32,
    );
    let nib = _mm256_set1_epi8(0x0F);
    let split = _mm256_setr_epi8(
        0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
    );
    for (b, pb) in panel.iter_mut().enumerate() {
        // SAFETY (loads and the gather): block b of each lane's row lies within the row
        // (`panel.len() * bb <= rb`, asserted above).
        unsafe {
            macro_rules! q {
                ($l:expr) => {
                    _mm_loadu_si128(row[$l].add(b * bb + qoff) as *const __m128i)
                };
            }
            // Rows l and l + 4 in one register; then a 4x4 transpose of dwords in each half.
            let t0 = _mm256_set_m128i(q!(4), q!(0));
            let t1 = _mm256_set_m128i(q!(5), q!(1));
            let t2 = _mm256_set_m128i(q!(6), q!(2));
            let t3 = _mm256_set_m128i(q!(7), q!(3));
            let a = _mm256_unpacklo_epi32(t0, t1);
            let c = _mm256_unpackhi_epi32(t0, t1);
            let e = _mm256_unpacklo_epi32(t2, t3);
            let f = _mm256_unpackhi_epi32(t2, t3);
            // Dword k of every row: bytes 4k..4k + 4, whose low nibbles are elements
            // 4k..4k + 4 and high nibbles 16 + 4k..16 + 4k + 4.
            let dw = [
                _mm256_unpacklo_epi64(a, e),
                _mm256_unpackhi_epi64(a, e),
                _mm256_unpacklo_epi64(c, f),
                _mm256_unpackhi_epi64(c, f),
            ];
            for (k, d) in dw.into_iter().enumerate() {
                pb.w[k] = _mm256_and_si256(d, nib);
                pb.w[4 + k] = _mm256_and_si256(_mm256_srli_epi16::<4>(d), nib);
            }
            // Each row's d (and m) from the block's first four bytes, as in `block_scales`.
            let dm = _mm256_i32gather_epi32::<1>(base.add(b * bb) as *const i32, offs);
            let s = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_shuffle_epi8(dm, split));
            pb.d = _mm256_cvtph_ps(_mm256_castsi256_si128(s));
            pb.m = if Q41 {
                _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(s))
            } else {
                _mm256_mul_ps(pb.d, _mm256_set1_ps(-8.0))
            };
        }
    }
}

/// Block `b` of a packed panel (see `panels`) as a [`PanelBlock`]: the
/// dwords are already transposed, so four loads and a nibble split give the
/// eight weight registers, and the scales are two loads.
///
/// # Safety
/// `pp` points at a packed panel with more than `b` blocks; avx2 and f16c.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn packed_block<const Q41: bool>(pp: *const u8, b: usize) -> PanelBlock {
    let bb = if Q41 { 20 } else { 18 };
    let nib = _mm256_set1_epi8(0x0F);
    // SAFETY: block b's `PANEL * bb` bytes are in the panel (the caller's contract): 128
    // bytes of nibbles, then eight f16 `d` and (Q4_1) eight f16 `m`.
    unsafe {
        let p = pp.add(b * PANEL * bb);
        let mut w = [_mm256_setzero_si256(); 8];
        for k in 0..4 {
            let d = _mm256_loadu_si256(p.add(32 * k) as *const __m256i);
            w[k] = _mm256_and_si256(d, nib);
            w[4 + k] = _mm256_and_si256(_mm256_srli_epi16::<4>(d), nib);
        }
        let d = _mm256_cvtph_ps(_mm_loadu_si128(p.add(128) as *const __m128i));
        let m = if Q41 {
            _mm256_cvtph_ps(_mm_loadu_si128(p.add(144) as *const __m128i))
        } else {
            _mm256_mul_ps(d, _mm256_set1_ps(-8.0))
        };
        PanelBlock { w, d, m }
    }
}

/// The panel's eight rows against activation row `xr`: lane l is row l's dot
/// product with it. `block(b)` gives the panel's block b (unpacked earlier,
/// or read from packed weights).
///
/// The rounding is ggml's `vec_dot_q4_1_q8_1` on AVX2 (and this crate's
/// earlier kernels'), lane by lane: each of a block's eight four-element
/// groups `k` has its own f32 accumulator, `a[k] += dot_k * (dw * dx)` with
/// one FMA per block; the offset terms `mw * sx` are rounded and added one
/// block at a time; at the end `((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 +
/// a7))`, then the offsets. So every level (AVX2, AVX-VNNI, AVX-512) returns
/// the same bits, and greedy output keeps matching llama.cpp's, which a
/// cheaper order (one i16 sum per block and one FMA) did not: it moved
/// choices at top-2 gaps of 0.16-0.27 in the fixture.
///
/// # Safety
/// Activation row `xr` exists in `acts` with `nb` blocks; avx2, fma and f16c
/// (and the `vpdpbusd` flags `DOT` needs).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn panel_dots<const DOT: u8>(nb: usize, block: impl Fn(usize) -> PanelBlock, acts: &QActs, xr: usize) -> __m256 {
    let ones = _mm256_set1_epi16(1);
    let mut a = [_mm256_setzero_ps(); 8];
    let mut offs = _mm256_setzero_ps();
    for b in 0..nb {
        let pb = block(b);
        let idx = xr * nb + b;
        // SAFETY: block b of activation row xr (the caller's contract).
        unsafe {
            let xp = acts.qs.as_ptr().add(idx * 32) as *const i32;
            let scale = _mm256_mul_ps(pb.d, _mm256_set1_ps(*acts.d.get_unchecked(idx)));
            for (k, a) in a.iter_mut().enumerate() {
                let x = _mm256_set1_epi32(xp.add(k).read_unaligned());
                let dot = dot_u8_i8::<DOT>(pb.w[k], x, ones);
                *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, *a);
            }
            offs = _mm256_add_ps(offs, _mm256_mul_ps(pb.m, _mm256_set1_ps(*acts.s.get_unchecked(idx))));
        }
    }
    let s04 = _mm256_add_ps(a[0], a[4]);
    let s26 = _mm256_add_ps(a[2], a[6]);
    let s15 = _mm256_add_ps(a[1], a[5]);
    let s37 = _mm256_add_ps(a[3], a[7]);
    _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(s04, s26), _mm256_add_ps(s15, s37)), offs)
}

/// Lane b of the result: the sum of the eight i32 lanes of `p[b]` (exact: a
/// block's dot product is at most 32 x 15 x 127 in magnitude for Q4 and
/// 32 x 128 x 127 for Q8).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn block_sums(p: &[__m256i; GROUP]) -> __m256i {
    // SAFETY: inlined only into avx2-enabled kernels.
    unsafe {
        // [p0 01, p0 23, p1 01, p1 23 | p0 45, p0 67, p1 45, p1 67], lanes summed in pairs.
        let h01 = _mm256_hadd_epi32(p[0], p[1]);
        let h23 = _mm256_hadd_epi32(p[2], p[3]);
        let h45 = _mm256_hadd_epi32(p[4], p[5]);
        let h67 = _mm256_hadd_epi32(p[6], p[7]);
        // [p0 0..4, p1 0..4, p2 0..4, p3 0..4 | the same of lanes 4..8].
        let h0123 = _mm256_hadd_epi32(h01, h23);
        let h4567 = _mm256_hadd_epi32(h45, h67);
        // Lanes 0..4 of blocks 0..8, then lanes 4..8 of them.
        let lo = _mm256_permute2x128_si256::<0x20>(h0123, h4567);
        let hi = _mm256_permute2x128_si256::<0x31>(h0123, h4567);
        _mm256_add_epi32(lo, hi)
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

/// How the 256-bit kernels take u8 × i8 dot products (their `DOT` parameter):
/// `vpmaddubsw` + `vpmaddwd` (AVX2) ...
pub(super) const MADD: u8 = 0;
/// ... one VEX `vpdpbusd` (AVX-VNNI) ...
pub(super) const VEX: u8 = 1;
/// ... or one EVEX `vpdpbusd` on 256-bit registers (AVX-512 VNNI + VL: the
/// AVX-512 level's kernels for small batches, see `avx512::quant_rows`).
pub(super) const EVEX: u8 = 2;

/// The level a kernel with `DOT` runs at (what the tests' trace records).
#[cfg(test)]
fn dot_isa(dot: u8) -> crate::Isa {
    match dot {
        MADD => crate::Isa::Avx2,
        VEX => crate::Isa::AvxVnni,
        _ => crate::Isa::Avx512,
    }
}

/// Sums of four adjacent u8 × i8 products, as i32 lanes: one `vpdpbusd` with
/// AVX-VNNI or AVX-512 VNNI, else `vpmaddubsw` + `vpmaddwd` (`ones`: i16 ones).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn dot_u8_i8<const DOT: u8>(u: __m256i, s: __m256i, ones: __m256i) -> __m256i {
    // SAFETY: inlined only into functions with avx2, and avxvnni when `DOT` is `VEX`,
    // avx512vnni and avx512vl when it is `EVEX`.
    unsafe {
        match DOT {
            VEX => _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s),
            EVEX => _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s),
            _ => _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), ones),
        }
    }
}

/// # Safety
/// The CPU has avx2, fma and f16c, and concurrent callers pass disjoint `rows`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_rows(w: &QMatrix<'_>, acts: &QActs, rows: Range<usize>, out: &SharedSlice<f32>) {
    // SAFETY: this function's contract; the body is inlined with these features.
    unsafe { q8_rows_with::<MADD>(w, acts, rows, out) }
}

/// # Safety
/// The CPU has avx2, fma, f16c and avxvnni, and concurrent callers pass disjoint `rows`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn q8_rows_vnni(w: &QMatrix<'_>, acts: &QActs, rows: Range<usize>, out: &SharedSlice<f32>) {
    // SAFETY: this function's contract; the body is inlined with these features.
    unsafe { q8_rows_with::<VEX>(w, acts, rows, out) }
}

/// The body of [`q8_rows`] and [`q8_rows_vnni`], inlined into each.
///
/// # Safety
/// Only called from those two, whose target features it runs with.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn q8_rows_with<const DOT: u8>(w: &QMatrix<'_>, acts: &QActs, rows: Range<usize>, out: &SharedSlice<f32>) {
    #[cfg(test)]
    crate::isa::trace::hit(dot_isa(DOT));
    let m = acts.rows;
    for r in rows.clone() {
        super::prefetch_ahead(w, r, &rows);
        let wrow = w.row(r);
        let mut i = 0;
        while i + 4 <= m {
            // SAFETY: same target features as this function.
            let v = unsafe { q8_kernel::<4, DOT>(wrow, acts, i) };
            for (j, v) in v.into_iter().enumerate() {
                // SAFETY: rows are this caller's alone (the function's contract: disjoint rows per thread).
                unsafe { out.set((i + j) * w.rows + r, v) };
            }
            i += 4;
        }
        while i < m {
            // SAFETY: as above.
            let v = unsafe { q8_kernel::<1, DOT>(wrow, acts, i) };
            // SAFETY: rows are this caller's alone (the function's contract: disjoint rows per thread).
            unsafe { out.set(i * w.rows + r, v[0]) };
            i += 1;
        }
    }
}

/// `R` activation rows starting at `x0` against one Q8_0 weight row.
///
/// # Safety
/// Inlined only into functions with avx2, fma and f16c (and the `vpdpbusd` flags `DOT` needs).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn q8_kernel<const R: usize, const DOT: u8>(wrow: &[u8], acts: &QActs, x0: usize) -> [f32; R] {
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
        // The group's weights once for all rows: |w| as u8 (maddubs needs an unsigned
        // operand) and w itself, whose sign moves onto x. Blocks past `n` stay zero.
        let mut wq = [_mm256_setzero_si256(); GROUP];
        let mut aw = [_mm256_setzero_si256(); GROUP];
        for b in 0..n {
            wq[b] = unsafe { _mm256_loadu_si256(gp.add(b * 34 + 2) as *const __m256i) };
            aw[b] = _mm256_sign_epi8(wq[b], wq[b]);
        }
        for (j, acc_j) in acc.iter_mut().enumerate() {
            let dx = unsafe { _mm256_maskload_ps(d0.add(j * nb + g), live) };
            let xj = unsafe { xq0.add((j * nb + g) * 32) };
            let mut p = [_mm256_setzero_si256(); GROUP];
            if n == GROUP {
                for (b, p) in p.iter_mut().enumerate() {
                    let xq = unsafe { _mm256_loadu_si256(xj.add(b * 32) as *const __m256i) };
                    *p = dot_u8_i8::<DOT>(aw[b], _mm256_sign_epi8(xq, wq[b]), ones);
                }
            } else {
                for (b, p) in p.iter_mut().enumerate().take(n) {
                    let xq = unsafe { _mm256_loadu_si256(xj.add(b * 32) as *const __m256i) };
                    *p = dot_u8_i8::<DOT>(aw[b], _mm256_sign_epi8(xq, wq[b]), ones);
                }
            }
            *acc_j = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_sums(&p)), _mm256_mul_ps(dw, dx), *acc_j);
        }
        g += GROUP;
    }
    let mut res = [0f32; R];
    for j in 0..R {
        res[j] = hsum(acc[j]);
    }
    res
}
