//! Q4 weights repacked at load into the layout the panel kernels read.
//!
//! In a model file a Q4 matrix is row after row, each row block after block
//! (`d`, `m` for Q4_1, sixteen bytes of nibbles). The SIMD kernels take
//! eight rows at a time with one row per 32-bit lane (a *panel*, see
//! `avx2::q4_rows_with`), so from the file layout each panel's blocks are
//! transposed on every product: eight 16-byte loads from eight rows, a
//! dword transpose and a gather of the scales per block. A decode step
//! reads every weight once, so it paid that transpose for every byte; with
//! the Q4 kernel at one activation row streaming about half the rate a plain
//! read of the same bytes reaches, the transpose was most of the gap.
//!
//! [`pack_q4_panels`] does the transpose once, at load. Panel `p` (rows
//! `8p..8p + 8`) is `nb` packed blocks in order, block `b` of it
//! `8 × block_bytes` long:
//!
//! | bytes     | holds                                                       |
//! |-----------|-------------------------------------------------------------|
//! | 0..128    | for k in 0..4: dword k (nibble bytes 4k..4k + 4) of rows 0..8 |
//! | 128..144  | `d` of rows 0..8 (f16)                                      |
//! | 144..160  | Q4_1 only: `m` of rows 0..8 (f16)                           |
//!
//! That is exactly the register the file-layout unpack builds, so a kernel
//! reading it does the same arithmetic and returns the same bits. The packed
//! bytes are as many as the file's for those rows: a matrix's whole panels
//! (`rows / 8 * 8` rows) are packed, and rows past them (fewer than eight)
//! are read from the file layout, which a [`QMatrix`] keeps alongside.

use crate::matmul::{QMatrix, WeightType};
use crate::KernelError;

/// Weight rows in one packed panel.
pub const PANEL_ROWS: usize = 8;

/// Bytes of `ty`'s packed panels for a `rows × cols` matrix: its whole
/// panels (`rows / 8 * 8` rows), as many bytes as those rows in the file.
/// Zero for types that are not packed (everything but Q4_0 and Q4_1).
pub fn packed_len(ty: WeightType, rows: usize, cols: usize) -> usize {
    if is_packed_type(ty) {
        rows / PANEL_ROWS * PANEL_ROWS * ty.row_bytes(cols)
    } else {
        0
    }
}

/// Whether [`pack_q4_panels`] packs matrices of `ty`.
pub fn is_packed_type(ty: WeightType) -> bool {
    matches!(ty, WeightType::Q4_0 | WeightType::Q4_1)
}

/// The version of the packed layout (the module doc's table). A copy of
/// packed panels kept outside this process (the engine's host-wide panel
/// file) is keyed by it: a change to [`pack_q4_panels_into`]'s output must
/// bump it, so a copy packed by another build is refused, never read.
pub const PANEL_LAYOUT: u32 = 1;

/// `w`'s whole panels in the packed layout (see the module doc); `None` for
/// a type that is not packed.
pub fn pack_q4_panels(w: &QMatrix<'_>) -> Option<Vec<u8>> {
    let mut out = vec![0u8; packed_len(w.ty, w.rows, w.cols)];
    pack_q4_panels_into(w, &mut out).ok()?;
    Some(out)
}

/// Writes `w`'s whole panels in the packed layout into `out`, which must be
/// exactly [`packed_len`] bytes (so the panels can be packed straight into
/// shared memory). An error for a type that is not packed or a wrong length.
pub fn pack_q4_panels_into(w: &QMatrix<'_>, out: &mut [u8]) -> Result<(), KernelError> {
    let want = packed_len(w.ty, w.rows, w.cols);
    if !is_packed_type(w.ty) || out.len() != want {
        return Err(KernelError::Shape {
            op: "pack_q4_panels_into",
            detail: format!("{:?} {}x{} packs into {want} bytes, got {}", w.ty, w.rows, w.cols, out.len()),
        });
    }
    let bb = w.ty.block_bytes();
    let qoff = bb - 16;
    let nb = w.cols / w.ty.block_elems();
    let mut at = 0;
    let mut put = |bytes: &[u8]| {
        out[at..at + bytes.len()].copy_from_slice(bytes);
        at += bytes.len();
    };
    for p in 0..w.rows / PANEL_ROWS {
        let rows: [&[u8]; PANEL_ROWS] = std::array::from_fn(|l| w.row(p * PANEL_ROWS + l));
        for b in 0..nb {
            let blocks = rows.map(|r| &r[b * bb..(b + 1) * bb]);
            for k in 0..4 {
                for blk in &blocks {
                    put(&blk[qoff + 4 * k..qoff + 4 * k + 4]);
                }
            }
            for blk in &blocks {
                put(&blk[..2]);
            }
            if w.ty == WeightType::Q4_1 {
                for blk in &blocks {
                    put(&blk[2..4]);
                }
            }
        }
    }
    debug_assert_eq!(at, want);
    Ok(())
}

impl<'a> QMatrix<'a> {
    /// This matrix with its whole panels also readable from `panels`, the
    /// output of [`pack_q4_panels`] for it. The SIMD kernels then read
    /// those panels from `panels` and only the rows past them from the file
    /// layout; the results are the same bits either way.
    pub fn with_panels(mut self, panels: &'a [u8]) -> Result<Self, KernelError> {
        let want = packed_len(self.ty, self.rows, self.cols);
        if !is_packed_type(self.ty) || panels.len() != want {
            return Err(KernelError::Shape {
                op: "QMatrix::with_panels",
                detail: format!(
                    "{:?} {}x{} packs into {want} bytes, got {}",
                    self.ty,
                    self.rows,
                    self.cols,
                    panels.len()
                ),
            });
        }
        self.panels = Some(panels);
        Ok(self)
    }

    /// Whether the SIMD kernels read this matrix's whole panels packed.
    pub fn has_panels(&self) -> bool {
        self.panels.is_some()
    }

    /// The packed bytes of panel `p` (rows `8p..8p + 8`), when this matrix
    /// has packed panels and `p` is a whole panel.
    pub(crate) fn packed_panel(&self, p: usize) -> Option<&'a [u8]> {
        let panels = self.panels?;
        let len = self.ty.row_bytes(self.cols) * PANEL_ROWS;
        panels.get(p * len..(p + 1) * len)
    }
}
