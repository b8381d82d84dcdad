//! AVX-512 (F/BW/VL) + VNNI kernels.
//!
//! One 512-bit register holds two 32-element blocks, and `vpdpbusd`
//! multiplies u8 × i8 and sums groups of four into i32 in one instruction
//! (AVX2 needs `vpmaddubsw` + `vpmaddwd`). Q4 nibbles are unsigned and the
//! activations signed, which is the operand order `vpdpbusd` wants; Q8_0
//! weights are signed, so they go in as |w| with w's sign moved onto x.
//!
//! Q4 weights go sixteen rows at a time, one row per 32-bit lane, as in the
//! AVX2 kernels' panels; Q8_0 (the output head) shares one unpacked pair of
//! weight blocks between up to four activation rows. Each output sees the
//! same instruction sequence whatever the batch (see the module doc of
//! `matmul`). A Q8_0 row with an odd number of blocks ends with a
//! half-register step whose upper half is zero.
#![allow(unsafe_code)]

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};

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
        let wide = acts.rows > small_batch();
        unsafe {
            match w.ty {
                WeightType::Q4_1 if wide => q4_rows::<true>(w, acts, rows, out),
                WeightType::Q4_0 if wide => q4_rows::<false>(w, acts, rows, out),
                WeightType::Q4_1 => q4_rows_256::<true>(w, acts, rows, out),
                WeightType::Q4_0 => q4_rows_256::<false>(w, acts, rows, out),
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

/// Activation rows up to which Q4 products take the 256-bit panel kernel
/// (eight weight rows per panel, EVEX `vpdpbusd`); above it, sixteen-row
/// panels in 512-bit registers. Chosen by CPU vendor on first use
/// ([`super::AVX512_SMALL_BATCH`], [`super::AVX512_SMALL_BATCH_INTEL`]);
/// see [`super::set_avx512_small_batch`].
static SMALL_BATCH: AtomicUsize = AtomicUsize::new(super::AVX512_SMALL_BATCH);
static SMALL_BATCH_CHOSEN: std::sync::Once = std::sync::Once::new();

/// The current [`SMALL_BATCH`], chosen for this CPU on the first call.
pub(super) fn small_batch() -> usize {
    SMALL_BATCH_CHOSEN.call_once(|| {
        let rows = if intel() { super::AVX512_SMALL_BATCH_INTEL } else { super::AVX512_SMALL_BATCH };
        SMALL_BATCH.store(rows, Ordering::Relaxed);
    });
    SMALL_BATCH.load(Ordering::Relaxed)
}

/// Sets [`SMALL_BATCH`] (after the vendor's choice, so that it sticks).
pub(super) fn set_small_batch(rows: usize) {
    small_batch();
    SMALL_BATCH.store(rows, Ordering::Relaxed);
}

/// Whether the CPU is Intel's (the vendor string of `cpuid` leaf 0).
fn intel() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: `cpuid` leaf 0 exists on every x86_64 CPU (it reads registers only).
        #[allow(unused_unsafe)]
        let r = unsafe { std::arch::x86_64::__cpuid(0) };
        let mut vendor = [0u8; 12];
        vendor[..4].copy_from_slice(&r.ebx.to_le_bytes());
        vendor[4..8].copy_from_slice(&r.edx.to_le_bytes());
        vendor[8..].copy_from_slice(&r.ecx.to_le_bytes());
        &vendor == b"GenuineIntel"
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// The 256-bit Q4 panel kernel of the AVX2 and AVX-VNNI levels with
/// AVX-512 VNNI's `vpdpbusd` (which runs on 256-bit registers with VL).
/// Both widths return the same bits, so which one a batch takes changes no
/// output.
///
/// # Safety
/// The CPU has `Isa::Avx512`'s flags, and concurrent callers pass disjoint `rows`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_rows_256<const Q41: bool>(w: &QMatrix<'_>, acts: &QActs, rows: Range<usize>, out: &SharedSlice<f32>) {
    // SAFETY: this function's contract; the body is inlined with these features.
    unsafe { super::avx2::q4_rows_with::<Q41, { super::avx2::EVEX }>(w, acts, rows, out) }
}

/// Weight rows one Q4 panel holds: one per i32 lane.
const PANEL: usize = 16;

/// Panels whose rows are asked for ahead of the one being computed.
const PANEL_AHEAD: usize = 2;

/// Sixteen weight rows' blocks with lanes as rows, as the AVX2 kernel's
/// `PanelBlock` with twice the rows: `w[k]` holds elements `4k..4k + 4` of
/// each row's block, `d` and `m` the rows' scales (`m` is `-8 d` in Q4_0).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct PanelBlock {
    w: [__m512i; 8],
    d: __m512,
    m: __m512,
}

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// Each thread's unpacked panel, reused across calls.
    static PANEL_BUF: std::cell::Cell<Vec<PanelBlock>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Rows go sixteen at a time, one per lane, as in the AVX2 kernel (see its
/// `q4_rows_with`): a panel's blocks are unpacked once, then each activation
/// row runs against them with eight broadcasts and eight `vpdpbusd` per
/// block, which give the sixteen rows' exact block dot products, and one FMA
/// per block for the scales. An output is one lane summed over blocks in
/// order, whatever the batch and whichever rows share its panel.
///
/// # Safety
/// The CPU has `Isa::Avx512`'s flags, and concurrent callers pass disjoint `rows`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_rows<const Q41: bool>(w: &QMatrix<'_>, acts: &QActs, rows: Range<usize>, out: &SharedSlice<f32>) {
    #[cfg(test)]
    crate::isa::trace::hit(crate::Isa::Avx512);
    let nb = acts.blocks_per_row();
    let m = acts.rows;
    assert!(w.cols == nb * 32, "weight columns differ from the activation row");
    assert!(m * nb * 32 <= acts.qs.len() && m * nb <= acts.d.len() && m * nb <= acts.s.len(), "activations short");
    let zero = PanelBlock { w: [_mm512_setzero_si512(); 8], d: _mm512_setzero_ps(), m: _mm512_setzero_ps() };
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
        // Two whole packed eight-row panels (spare lanes past `live` are rows of `w` too,
        // computed and not stored), or rows from the file layout.
        let half = super::panels::PANEL_ROWS;
        let packed = if r0 % half == 0 { w.packed_panel(r0 / half).zip(w.packed_panel(r0 / half + 1)) } else { None };
        match packed {
            // SAFETY: both hold `nb` packed blocks (the assert inside); same target features.
            Some((lo, hi)) => unsafe { unpack_packed::<Q41>(lo, hi, panel) },
            // SAFETY: rows r0..r0 + live are rows of `w`; same target features as this function.
            None => unsafe { unpack_panel::<Q41>(w, r0, live, panel) },
        }
        super::prefetch_panels_ahead(w, r0, &rows, PANEL, PANEL_AHEAD);
        let mut lanes = [0f32; PANEL];
        for i in 0..m {
            // SAFETY: activation row i < m, within the lengths asserted above; `lanes` holds
            // sixteen f32.
            unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), panel_dots(panel, acts, i)) };
            for (l, x) in lanes.iter().take(live).enumerate() {
                // SAFETY: rows r0..r0 + live are this caller's alone (the contract: disjoint rows).
                unsafe { out.set(i * w.rows + r0 + l, *x) };
            }
        }
        r0 += PANEL;
    }
    PANEL_BUF.set(buf);
}

/// Unpacks rows `r0..r0 + live` of `w` (`live` <= 16; spare lanes repeat the
/// last row) into `panel`, one [`PanelBlock`] per block.
///
/// # Safety
/// Rows `r0..r0 + live` exist in `w`, `live` >= 1; `Isa::Avx512`'s flags.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn unpack_panel<const Q41: bool>(w: &QMatrix<'_>, r0: usize, live: usize, panel: &mut [PanelBlock]) {
    let bb = if Q41 { 20 } else { 18 };
    let qoff = if Q41 { 4 } else { 2 };
    let row: [*const u8; PANEL] = std::array::from_fn(|l| w.row(r0 + l.min(live - 1)).as_ptr());
    assert!(panel.len() * bb <= w.ty.row_bytes(w.cols), "panel longer than a row");
    // The gather's lane offsets (rows apart from the first) must fit an i32.
    assert!(w.ty.row_bytes(w.cols) * PANEL <= i32::MAX as usize, "rows too long for a panel");
    let base = row[0];
    let mut off = [0i32; PANEL];
    for (o, r) in off.iter_mut().zip(&row) {
        *o = (*r as usize - base as usize) as i32;
    }
    // SAFETY: `off` holds sixteen i32.
    let offs = unsafe { _mm512_loadu_si512(off.as_ptr().cast()) };
    let nib = _mm512_set1_epi8(0x0F);
    for (b, pb) in panel.iter_mut().enumerate() {
        // SAFETY (loads and the gather): block b of each lane's row lies within the row.
        unsafe {
            macro_rules! q {
                ($l:expr) => {
                    _mm_loadu_si128(row[$l].add(b * bb + qoff) as *const __m128i)
                };
            }
            // Register i holds rows i, 4 + i, 8 + i and 12 + i; then a 4x4 transpose of
            // dwords in each 128-bit quarter puts row 4q + i in lane 4q + i.
            macro_rules! four {
                ($i:expr) => {{
                    let lo = _mm256_set_m128i(q!(4 + $i), q!($i));
                    let hi = _mm256_set_m128i(q!(12 + $i), q!(8 + $i));
                    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
                }};
            }
            let (t0, t1, t2, t3) = (four!(0), four!(1), four!(2), four!(3));
            let a = _mm512_unpacklo_epi32(t0, t1);
            let c = _mm512_unpackhi_epi32(t0, t1);
            let e = _mm512_unpacklo_epi32(t2, t3);
            let f = _mm512_unpackhi_epi32(t2, t3);
            let dw = [
                _mm512_unpacklo_epi64(a, e),
                _mm512_unpackhi_epi64(a, e),
                _mm512_unpacklo_epi64(c, f),
                _mm512_unpackhi_epi64(c, f),
            ];
            for (k, d) in dw.into_iter().enumerate() {
                pb.w[k] = _mm512_and_si512(d, nib);
                pb.w[4 + k] = _mm512_and_si512(_mm512_srli_epi16::<4>(d), nib);
            }
            let dm = _mm512_i32gather_epi32::<1>(offs, base.add(b * bb) as *const i32);
            pb.d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
            pb.m = if Q41 {
                _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(dm)))
            } else {
                _mm512_mul_ps(pb.d, _mm512_set1_ps(-8.0))
            };
        }
    }
}

/// Fills `panel` from two packed eight-row panels (see `panels`): `lo` gives
/// lanes 0..8 and `hi` lanes 8..16, each block's dwords already transposed.
///
/// # Safety
/// `Isa::Avx512`'s flags.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn unpack_packed<const Q41: bool>(lo: &[u8], hi: &[u8], panel: &mut [PanelBlock]) {
    let bb = if Q41 { 20 } else { 18 };
    let len = super::panels::PANEL_ROWS * bb;
    assert!(lo.len() >= panel.len() * len && hi.len() >= panel.len() * len, "packed panel shorter than a row");
    let nib = _mm512_set1_epi8(0x0F);
    for (b, pb) in panel.iter_mut().enumerate() {
        // SAFETY: block b's `len` bytes lie in both panels (asserted above): 128 bytes of
        // nibbles, eight f16 `d`, then (Q4_1) eight f16 `m`.
        unsafe {
            let (l, h) = (lo.as_ptr().add(b * len), hi.as_ptr().add(b * len));
            let both = |off: usize| {
                let a = _mm256_loadu_si256(l.add(off) as *const __m256i);
                _mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), _mm256_loadu_si256(h.add(off) as *const __m256i))
            };
            for k in 0..4 {
                let d = both(32 * k);
                pb.w[k] = _mm512_and_si512(d, nib);
                pb.w[4 + k] = _mm512_and_si512(_mm512_srli_epi16::<4>(d), nib);
            }
            let f16s = |off: usize| {
                _mm256_set_m128i(
                    _mm_loadu_si128(h.add(off) as *const __m128i),
                    _mm_loadu_si128(l.add(off) as *const __m128i),
                )
            };
            pb.d = _mm512_cvtph_ps(f16s(128));
            pb.m = if Q41 { _mm512_cvtph_ps(f16s(144)) } else { _mm512_mul_ps(pb.d, _mm512_set1_ps(-8.0)) };
        }
    }
}

/// The panel's sixteen rows against activation row `xr`: lane l is row l's
/// dot product with it, rounded exactly as the AVX2 kernel's `panel_dots`
/// (ggml's order), so both levels return the same bits.
///
/// # Safety
/// Activation row `xr` exists in `acts` with `panel.len()` blocks;
/// `Isa::Avx512`'s flags.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn panel_dots(panel: &[PanelBlock], acts: &QActs, xr: usize) -> __m512 {
    let nb = panel.len();
    let mut a = [_mm512_setzero_ps(); 8];
    let mut offs = _mm512_setzero_ps();
    for (b, pb) in panel.iter().enumerate() {
        let idx = xr * nb + b;
        // SAFETY: block b of activation row xr (the caller's contract).
        unsafe {
            let xp = acts.qs.as_ptr().add(idx * 32) as *const i32;
            let scale = _mm512_mul_ps(pb.d, _mm512_set1_ps(*acts.d.get_unchecked(idx)));
            for (k, a) in a.iter_mut().enumerate() {
                let x = _mm512_set1_epi32(xp.add(k).read_unaligned());
                let dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), pb.w[k], x);
                *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, *a);
            }
            offs = _mm512_add_ps(offs, _mm512_mul_ps(pb.m, _mm512_set1_ps(*acts.s.get_unchecked(idx))));
        }
    }
    let s04 = _mm512_add_ps(a[0], a[4]);
    let s26 = _mm512_add_ps(a[2], a[6]);
    let s15 = _mm512_add_ps(a[1], a[5]);
    let s37 = _mm512_add_ps(a[3], a[7]);
    _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(s04, s26), _mm512_add_ps(s15, s37)), offs)
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

/// Blocks whose scales are fetched and multiplied together, one per lane.
const GROUP: usize = 16;

/// `R` activation rows starting at `x0` against one Q8_0 weight row. Per
/// group of up to 16 blocks, one gather fetches every block's `d` (the first
/// bytes of each block), and each pair of blocks picks its two scales out of
/// that register with one permute.
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
