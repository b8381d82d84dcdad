//! Portable reference kernels.

// Its row writer shares one output slice between threads (`SharedSlice::set`, an `unsafe fn`).
#![allow(unsafe_code)]

use std::ops::Range;

use crate::f16::{f16_bits_to_f32, le_u16};
use crate::matmul::{QMatrix, WeightType};
use crate::pool::SharedSlice;
use crate::quant::{QActs, QK};

pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(test)]
    crate::isa::trace::hit(crate::Isa::Scalar);
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// One weight row (quantized) against one activation row: sum over blocks of
/// `dw*dx*dot(qw, qx) + mw*sx`, with `mw` the block's offset term.
pub fn dot_row(ty: WeightType, wrow: &[u8], acts: &QActs, xr: usize) -> f32 {
    let nb = acts.blocks_per_row();
    let mut acc = 0f32;
    for b in 0..nb {
        let xq = &acts.qs[(xr * nb + b) * QK..][..QK];
        let dx = acts.d[xr * nb + b];
        let sx = acts.s[xr * nb + b];
        let blk = &wrow[b * ty.block_bytes()..][..ty.block_bytes()];
        let (dot, dw, mw) = match ty {
            WeightType::Q4_0 | WeightType::Q4_1 => {
                let qs = if ty == WeightType::Q4_1 { &blk[4..20] } else { &blk[2..18] };
                let mut dot = 0i32;
                for j in 0..16 {
                    dot += (qs[j] & 0x0F) as i32 * xq[j] as i32;
                    dot += (qs[j] >> 4) as i32 * xq[j + 16] as i32;
                }
                let dw = f16_bits_to_f32(le_u16(blk, 0));
                let mw = if ty == WeightType::Q4_1 { f16_bits_to_f32(le_u16(blk, 1)) } else { -8.0 * dw };
                (dot, dw, mw)
            }
            WeightType::Q8_0 => {
                let mut dot = 0i32;
                for j in 0..QK {
                    dot += (blk[2 + j] as i8) as i32 * xq[j] as i32;
                }
                (dot, f16_bits_to_f32(le_u16(blk, 0)), 0.0)
            }
            WeightType::F32 | WeightType::F16 | WeightType::BF16 => unreachable!("float weights use float_rows"),
        };
        acc += dw * dx * dot as f32 + mw * sx;
    }
    acc
}

/// Writes `out[i * w.rows + r]` for every activation row `i` and weight row `r` in `rows`.
///
/// # Safety
/// No other thread may touch those elements of `out` meanwhile: concurrent callers pass
/// disjoint `rows` (see `SharedSlice::set`).
pub unsafe fn quant_rows(w: &QMatrix<'_>, acts: &QActs, rows: Range<usize>, out: &SharedSlice<f32>) {
    #[cfg(test)]
    crate::isa::trace::hit(crate::Isa::Scalar);
    for r in rows {
        let wrow = w.row(r);
        for i in 0..acts.rows {
            // SAFETY: row r is this caller's alone (the function's contract).
            unsafe { out.set(i * w.rows + r, dot_row(w.ty, wrow, acts, i)) };
        }
    }
}
