//! Matrix products `y = x · Wᵀ` with quantized or float weights.
//!
//! `W` is `rows × cols` in its file format (one row per output feature), `x`
//! is `m × cols` f32 (one row per token) and `y` is `m × rows`. Quantized
//! weights multiply against activations quantized to 8 bits
//! ([`QActs`]), the scheme llama.cpp uses, so the inner
//! loop is integer multiply-adds.
//!
//! Work is split across the pool by weight rows. Each output element is
//! computed by the same instruction sequence whatever `m` is and whichever
//! thread computes it (on the AVX-512 level, Q4 products up to
//! [`AVX512_SMALL_BATCH`] rows take a 256-bit kernel and larger ones a
//! 512-bit one, which do the same lane arithmetic and return the same
//! bits), so a token's logits do not depend on what else is in its batch —
//! the engine's batch-invariance tests rely on that.

// Row ranges of one output are written from several threads (`SharedSlice`); see the SAFETY notes.
#![allow(unsafe_code)]

mod avx2;
mod avx512;
pub mod panels;
mod scalar;

use crate::pool::{SharedSlice, ThreadPool};
use crate::quant::{dequantize_row, QActs, QK};
use crate::{Isa, KernelError};

/// Weight element types the matmul understands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q8_0,
}

impl WeightType {
    pub fn block_elems(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::BF16 => 1,
            Self::Q4_0 | Self::Q4_1 | Self::Q8_0 => QK,
        }
    }

    pub fn block_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q8_0 => 34,
        }
    }

    pub fn is_quantized(self) -> bool {
        self.block_elems() > 1
    }

    /// Bytes of one row of `cols` elements.
    pub fn row_bytes(self, cols: usize) -> usize {
        cols / self.block_elems() * self.block_bytes()
    }
}

/// A weight matrix borrowed from a model file or buffer.
#[derive(Debug, Clone, Copy)]
pub struct QMatrix<'a> {
    pub ty: WeightType,
    pub rows: usize,
    pub cols: usize,
    data: &'a [u8],
    /// The whole panels repacked for the SIMD kernels, when the loader did
    /// that (see [`panels`]).
    panels: Option<&'a [u8]>,
}

impl<'a> QMatrix<'a> {
    pub fn new(ty: WeightType, rows: usize, cols: usize, data: &'a [u8]) -> Result<Self, KernelError> {
        if cols % ty.block_elems() != 0 || data.len() != rows * ty.row_bytes(cols) {
            return Err(KernelError::Shape {
                op: "QMatrix::new",
                detail: format!("{ty:?} {rows}x{cols} needs {} bytes, got {}", rows * ty.row_bytes(cols), data.len()),
            });
        }
        Ok(Self { ty, rows, cols, data, panels: None })
    }

    pub fn row(&self, r: usize) -> &'a [u8] {
        let rb = self.ty.row_bytes(self.cols);
        &self.data[r * rb..(r + 1) * rb]
    }

    pub fn data(&self) -> &'a [u8] {
        self.data
    }

    /// Dequantizes row `r` (e.g. an embedding lookup) into `out`.
    pub fn dequantize_row_into(&self, r: usize, out: &mut [f32]) {
        dequantize_row(self.ty, self.row(r), out);
    }
}

/// Weight rows the row-at-a-time SIMD kernels (Q8_0) ask for ahead of the
/// one they compute; the Q4 panel kernels ask for whole panels ahead
/// ([`prefetch_row`]). A decode step reads each weight byte once; without
/// the hint, over half of the AVX-512 Q4 row kernel's samples sat on the
/// first load of each row (the gather of its block scales), which the
/// hardware prefetcher does not run ahead of. 2 rows gave decode 1.30x
/// llama.cpp against 1.17x without, and 1.27x at 4 (`tandem bench engine
/// --rounds 5`, AMD EPYC, AVX-512).
#[cfg(target_arch = "x86_64")]
const PREFETCH_ROWS: usize = 2;

/// Asks for row `r + PREFETCH_ROWS` of `w` (when `rows` has it) to be
/// brought into cache ([`prefetch_row`]). Only a hint: results do not
/// depend on it.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_ahead(w: &QMatrix<'_>, r: usize, rows: &std::ops::Range<usize>) {
    let ahead = r + PREFETCH_ROWS;
    if ahead < rows.end {
        prefetch_row(w, ahead);
    }
}

/// For a panel kernel at the panel of `panel` rows starting at `r0` in `rows`: asks
/// for the rows of the panel `panels_ahead` after it, and before the first panel for
/// every panel up to that one, so the hint runs that far ahead from the start.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_panels_ahead(
    w: &QMatrix<'_>,
    r0: usize,
    rows: &std::ops::Range<usize>,
    panel: usize,
    panels_ahead: usize,
) {
    let first = if r0 == rows.start { r0 + panel } else { r0 + panels_ahead * panel };
    let end = (r0 + (panels_ahead + 1) * panel).min(rows.end);
    // Rows of a packed panel are asked for where the kernel will read them: the kernels
    // read a whole packed panel at a panel boundary, even where the range ends inside it.
    let mut r = first;
    while r < end {
        let packed = if r % panels::PANEL_ROWS == 0 { w.packed_panel(r / panels::PANEL_ROWS) } else { None };
        match packed {
            Some(bytes) => {
                prefetch_bytes(bytes);
                r += panels::PANEL_ROWS;
            }
            None => {
                prefetch_row(w, r);
                r += 1;
            }
        }
    }
}

/// Asks for row `r` of `w` to be brought into the outer caches, one request
/// per cache line (a hint, as [`prefetch_ahead`]).
///
/// The hint is `T2`, not `T0` (into L1). A `T0` request holds one of the
/// core's few L1 miss buffers until its line arrives, and a panel's worth
/// of them (eight rows of up to 16 lines) filled those buffers: the
/// instruction after the `prefetcht0` took 17% of a decode step's samples,
/// waiting for one to free up. `T2` leaves the line in L2 and the kernel's
/// own loads find it there. On the 2-core Zen 4 host, alternated runs of
/// `tandem bench engine --prompt-tokens 16` decoded 110-140 tok/s with `T2`
/// against 82-104 with `T0` (+21-35% in each pair), and the Q4 kernel alone
/// at one activation row streamed 9.4-13.8 GB/s against 6.5-11.0 GB/s
/// (`T1` measured as `T2`; no hint at all was slower than either).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_row(w: &QMatrix<'_>, r: usize) {
    prefetch_bytes(w.row(r));
}

/// Asks for `bytes` to be brought into the outer caches, as [`prefetch_row`].
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_bytes(bytes: &[u8]) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T2};
    for line in bytes.chunks(64) {
        // SAFETY: a prefetch of an address inside `bytes` (SSE, which every x86_64 has);
        // it reads nothing architecturally and cannot fault.
        unsafe { _mm_prefetch::<_MM_HINT_T2>(line.as_ptr().cast::<i8>()) };
    }
}

/// Batches of up to this many activation rows take the AVX-512 level's
/// 256-bit Q4 kernel (eight weight rows per panel), larger ones its 512-bit
/// kernel (sixteen). Decode steps (a few rows) read every weight once, and
/// the wider panel reads sixteen weight rows side by side, which streamed
/// slower: on the 2-core AMD EPYC hosts here (Zen 4, which runs 512-bit
/// instructions as two 256-bit halves, and Zen 5) the 256-bit kernels
/// decoded faster, while prefill (hundreds of rows, each panel reused by
/// all of them) gains from the width. Chosen with `cargo bench -p kernels
/// --bench q4`, which times both widths at each batch size over weights
/// larger than the cache.
pub const AVX512_SMALL_BATCH: usize = 4;

/// [`AVX512_SMALL_BATCH`] on Intel CPUs, whose 512-bit units are full width:
/// on the 2-core Xeon (Sapphire Rapids) here the 512-bit kernel took a
/// model step of 2 to 4 rows (prompt-lookup verification, small decode
/// batches) in 0.59-0.79x the 256-bit one's time (SmolLM2-135M: 4 rows 9.4
/// against 15.9 ms), and one row stays on the 256-bit kernel.
pub const AVX512_SMALL_BATCH_INTEL: usize = 1;

/// Sets the batch size up to which the AVX-512 level takes its 256-bit Q4
/// kernel (by default [`AVX512_SMALL_BATCH_INTEL`] on Intel CPUs, else
/// [`AVX512_SMALL_BATCH`]; 0: always the 512-bit one). For benchmarks:
/// both kernels return the same bits, so no result depends on it.
pub fn set_avx512_small_batch(rows: usize) {
    avx512::set_small_batch(rows);
}

/// The batch size up to which the AVX-512 level takes its 256-bit Q4 kernel
/// (see [`set_avx512_small_batch`]).
pub fn avx512_small_batch() -> usize {
    avx512::small_batch()
}

/// Reusable buffers for [`matmul`].
#[derive(Debug, Default)]
pub struct MatmulScratch {
    acts: QActs,
}

impl MatmulScratch {
    /// Grows the buffers for `m` activation rows of `k` and writes them (see
    /// [`QActs::reserve`]).
    pub fn reserve(&mut self, m: usize, k: usize) {
        self.acts.reserve(m, k);
    }

    /// Bytes the buffers hold.
    pub fn capacity_bytes(&self) -> usize {
        self.acts.capacity_bytes()
    }
}

/// `y[m × w.rows] = x[m × w.cols] · wᵀ`, split across the pool by weight rows.
pub fn matmul(
    pool: &ThreadPool,
    isa: Isa,
    w: &QMatrix<'_>,
    x: &[f32],
    m: usize,
    y: &mut [f32],
    scratch: &mut MatmulScratch,
) {
    matmul_multi(pool, isa, &[*w], x, m, &mut [y], scratch);
}

/// Several products of the same input (`ys[i] = x · ws[i]ᵀ`), e.g. Q, K and
/// V of one layer: the input is quantized once, and one pool call covers
/// the rows of all matrices, so small matrices do not each pay a dispatch.
pub fn matmul_multi(
    pool: &ThreadPool,
    isa: Isa,
    ws: &[QMatrix<'_>],
    x: &[f32],
    m: usize,
    ys: &mut [&mut [f32]],
    scratch: &mut MatmulScratch,
) {
    assert_eq!(ws.len(), ys.len(), "matmul_multi: one output per matrix");
    let Some(first) = ws.first() else { return };
    let k = first.cols;
    assert!(ws.iter().all(|w| w.cols == k), "matmul_multi: matrices differ in columns");
    assert_eq!(x.len(), m * k, "matmul: x is not m x cols");
    for (w, y) in ws.iter().zip(ys.iter()) {
        assert_eq!(y.len(), m * w.rows, "matmul: y is not m x rows");
    }
    if ws.iter().any(|w| w.ty.is_quantized()) {
        scratch.acts.quantize_par(pool, isa, x, m, k);
    }
    let acts = &scratch.acts;
    let outs: Vec<SharedSlice<'_, f32>> = ys.iter_mut().map(|y| SharedSlice::new(y)).collect();
    let total: usize = ws.iter().map(|w| w.rows).sum();
    // Chunks of the concatenated rows of all matrices: about eight per
    // thread, so a late or descheduled thread's share is small, but few
    // enough that claiming them (a contended atomic) costs nothing.
    let chunk = total.div_ceil(pool.threads() * 8).max(16).next_multiple_of(8);
    pool.for_ranges(total, chunk, &|mine| {
        let mut base = 0;
        for (w, out) in ws.iter().zip(&outs) {
            let lo = mine.start.max(base).min(base + w.rows) - base;
            let hi = mine.end.max(base).min(base + w.rows) - base;
            base += w.rows;
            if lo == hi {
                continue;
            }
            // SAFETY: `for_ranges` hands each range of the concatenated rows to exactly one
            // call, so `lo..hi` of this matrix is this call's alone: no other thread writes
            // these rows' outputs, and `ys` stays borrowed until the pool returns.
            unsafe {
                match (w.ty.is_quantized(), isa) {
                    (true, Isa::Avx512) => avx512::quant_rows(w, acts, lo..hi, out),
                    (true, Isa::AvxVnni) => avx2::quant_rows_vnni(w, acts, lo..hi, out),
                    (true, Isa::Avx2) => avx2::quant_rows(w, acts, lo..hi, out),
                    (true, Isa::Scalar) => scalar::quant_rows(w, acts, lo..hi, out),
                    (false, _) => float_rows(isa, w, x, m, lo..hi, out),
                }
            }
        }
    });
}

/// Float weights: each row is widened to f32 once, then dotted with every x row.
///
/// # Safety
/// Concurrent callers pass disjoint `rows` (see `SharedSlice::set`).
unsafe fn float_rows(
    isa: Isa,
    w: &QMatrix<'_>,
    x: &[f32],
    m: usize,
    rows: std::ops::Range<usize>,
    out: &crate::pool::SharedSlice<f32>,
) {
    let k = w.cols;
    let mut wrow = vec![0f32; k];
    for r in rows {
        dequantize_row(w.ty, w.row(r), &mut wrow);
        for i in 0..m {
            let xi = &x[i * k..(i + 1) * k];
            let v = match isa {
                Isa::Avx512 => avx512::dot_f32(&wrow, xi),
                Isa::Avx2 | Isa::AvxVnni => avx2::dot_f32(&wrow, xi),
                Isa::Scalar => scalar::dot_f32(&wrow, xi),
            };
            // SAFETY: row r is this caller's alone (the function's contract).
            unsafe { out.set(i * w.rows + r, v) };
        }
    }
}

/// The dot product of two f32 vectors with the chosen ISA.
pub fn dot_f32(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    match isa {
        Isa::Avx512 => avx512::dot_f32(a, b),
        Isa::Avx2 | Isa::AvxVnni => avx2::dot_f32(a, b),
        Isa::Scalar => scalar::dot_f32(a, b),
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use avx2::hsum as hsum_avx;

#[cfg(test)]
pub(crate) mod tests;
