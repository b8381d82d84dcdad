//! Model weights, whatever file they came from.
//!
//! Both loaders produce [`Weights`]: a byte backing (a memory-mapped GGUF,
//! or an owned buffer) and a table from canonical tensor names — GGUF's
//! (`blk.N.attn_q.weight`, …) — to typed regions of that backing. Q and K
//! rows are in GGUF order (interleaved RoPE pairs); the safetensors loader
//! permutes HF's layout into it.

pub mod digest;
pub mod export;
pub mod gguf;
pub mod hf;
pub mod panel_file;
pub mod panels;
pub mod safetensors;

use std::collections::HashMap;

use kernels::{QMatrix, WeightType};

use crate::gguf::GgufError;
use crate::model::LlamaConfig;
use panel_file::PanelError;
use panels::{PanelOutcome, PanelSource, PanelStore, Panels, Plan, Slot};

/// Errors loading weights.
#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// A safetensors file or its config.json is malformed.
    #[error("safetensors: {0}")]
    Safetensors(String),
    /// A tensor exists but has the wrong shape for this model.
    #[error("tensor {name:?}: expected shape {expected:?}, found {found:?}")]
    Shape { name: String, expected: Vec<usize>, found: Vec<usize> },
    /// A required tensor is absent.
    #[error("missing tensor {0:?}")]
    Missing(String),
    /// The host panel directory could not be used (and the store said not
    /// to fall back to private panels).
    #[error(transparent)]
    Panels(#[from] PanelError),
    #[error("cannot read {path}: {source}")]
    Io {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}

pub(crate) enum Backing {
    Mapped(crate::mmap::Mapped),
    Owned(Vec<u8>),
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Mapped(m) => m.bytes(),
            Backing::Owned(v) => v,
        }
    }

    /// Resident pages of `range` may go (a mapped file reads them back on use).
    fn release(&self, range: std::ops::Range<usize>) {
        if let Backing::Mapped(m) = self {
            m.release(range);
        }
    }
}

/// A typed region of the backing. `dims` are outermost-first: `[rows, cols]`
/// for a matrix, `[n]` for a vector.
#[derive(Debug, Clone)]
pub struct TensorRef {
    pub ty: WeightType,
    pub dims: Vec<usize>,
    pub offset: usize,
    pub len: usize,
}

/// Loaded weights plus the model's hyper-parameters.
pub struct Weights {
    pub(crate) backing: Backing,
    pub tensors: HashMap<String, TensorRef>,
    pub config: LlamaConfig,
    /// Q4 matrices' whole panels repacked for the SIMD kernels
    /// ([`Weights::pack_panels`], [`Weights::share_panels`]), by tensor name.
    pub(crate) panels: Panels,
}

impl Weights {
    pub fn get(&self, name: &str) -> Result<&TensorRef, WeightsError> {
        self.tensors.get(name).ok_or_else(|| WeightsError::Missing(name.to_owned()))
    }

    pub fn bytes(&self, t: &TensorRef) -> &[u8] {
        &self.backing.bytes()[t.offset..t.offset + t.len]
    }

    /// A matrix with the expected `[rows, cols]`.
    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<QMatrix<'_>, WeightsError> {
        let t = self.get(name)?;
        if t.dims != [rows, cols] {
            return Err(WeightsError::Shape { name: name.into(), expected: vec![rows, cols], found: t.dims.clone() });
        }
        let shape_error = |e: kernels::KernelError| WeightsError::Shape {
            name: format!("{name} ({e})"),
            expected: vec![rows, cols],
            found: t.dims.clone(),
        };
        let w = QMatrix::new(t.ty, rows, cols, self.bytes(t)).map_err(shape_error)?;
        match self.panels.get(name) {
            Some(p) => w.with_panels(p).map_err(shape_error),
            None => Ok(w),
        }
    }

    /// Repacks the whole panels of the named Q4 matrices (the ones a
    /// forward pass multiplies with) into the layout the SIMD kernels read
    /// (`kernels::matmul::panels`), once, at load, into this process's
    /// memory: a decode step then streams each panel with no transpose.
    /// Products return the same bits either way. A mapped file's pages of
    /// those tensors are released as each is packed, so this process's
    /// resident memory stays about the model's size (the rows are read back
    /// from the file only for the last part panel of a matrix whose rows are
    /// not a multiple of eight, and for a thread's rows that start off a
    /// panel boundary). Other names, other types and misshapen tensors are
    /// left as they are; a second call replaces the first's panels.
    pub fn pack_panels<'n>(&mut self, names: impl IntoIterator<Item = &'n str>) -> PanelOutcome {
        let plan = self.panel_plan(names);
        let bytes = match panels::pack_private(&plan, |slot, out| self.pack_slot(slot, out)) {
            Ok(b) => b,
            // Every slot was checked when planned, so packing cannot fail;
            // were it to, the kernels read the file layout (same bits).
            Err(e) => {
                tracing::warn!(error = %e, "packing panels failed; the kernels read the file layout");
                return PanelOutcome::new(PanelSource::Unpacked, 0);
            }
        };
        self.panels = Panels::owned(&plan, bytes);
        PanelOutcome::new(PanelSource::Private, plan.len)
    }

    /// As [`Weights::pack_panels`], into the host-wide copy of `store`
    /// (`panel_file`): mapped when another process packed it, packed into
    /// it otherwise. Where the directory cannot be used the panels are
    /// packed privately if `store.private_on_error` (the outcome says why),
    /// else the error is returned.
    pub fn share_panels<'n>(
        &mut self,
        names: impl IntoIterator<Item = &'n str>,
        store: &PanelStore,
    ) -> Result<PanelOutcome, WeightsError> {
        let plan = self.panel_plan(names);
        if plan.slots.is_empty() {
            return Ok(PanelOutcome::new(PanelSource::Unpacked, 0));
        }
        let got = panel_file::obtain(store, &plan, |slot, out| self.pack_slot(slot, out), panel_file::LOCK_WAIT);
        match got {
            Ok(got) => {
                if !got.built {
                    // Packing released each matrix's file pages as it went; a
                    // mapped copy did not, and those pages are resident by now
                    // (decode-worker/tests/panels.rs sees 64 MB of them otherwise).
                    self.release_packed(&plan);
                }
                self.panels = Panels::shared(&plan, got.shared);
                let source = if got.built { PanelSource::Built(got.path) } else { PanelSource::Mapped(got.path) };
                let mut outcome = PanelOutcome::new(source, plan.len);
                outcome.refused = got.refused;
                outcome.pruned = got.pruned;
                Ok(outcome)
            }
            Err(e) if store.private_on_error => {
                tracing::warn!(dir = %store.dir.display(), error = %e, "host panel directory unusable; packing privately");
                let mut outcome = self.pack_panels(plan.slots.iter().map(|s| s.name.as_str()));
                outcome.fallback = Some(e.to_string());
                Ok(outcome)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Where the named matrices that pack go, in order, each once.
    fn panel_plan<'n>(&self, names: impl IntoIterator<Item = &'n str>) -> Plan {
        let mut plan = Plan::default();
        for name in names {
            let Some(t) = self.tensors.get(name) else { continue };
            if t.dims.len() != 2 || !kernels::matmul::panels::is_packed_type(t.ty) {
                continue;
            }
            if plan.slots.iter().any(|s| s.name == name) {
                continue;
            }
            // A misshapen tensor is left for `matrix` to report.
            if QMatrix::new(t.ty, t.dims[0], t.dims[1], self.bytes(t)).is_err() {
                continue;
            }
            plan.push(name, kernels::matmul::panels::packed_len(t.ty, t.dims[0], t.dims[1]));
        }
        plan
    }

    /// Packs one matrix into `out`, then releases the mapped file's pages of
    /// it (see `pack_panels`), so a load holds one matrix's file pages at a
    /// time.
    fn pack_slot(&self, slot: &Slot, out: &mut [u8]) -> Result<(), PanelError> {
        let fail = |why: String| PanelError::Pack { name: slot.name.clone(), why };
        let t = self.get(&slot.name).map_err(|e| fail(e.to_string()))?;
        let w = QMatrix::new(t.ty, t.dims[0], t.dims[1], self.bytes(t)).map_err(|e| fail(e.to_string()))?;
        kernels::matmul::panels::pack_q4_panels_into(&w, out).map_err(|e| fail(e.to_string()))?;
        self.backing.release(t.offset..t.offset + t.len);
        Ok(())
    }

    /// Releases a mapped file's pages of every matrix of `plan`.
    fn release_packed(&self, plan: &Plan) {
        for slot in &plan.slots {
            if let Some(t) = self.tensors.get(&slot.name) {
                self.backing.release(t.offset..t.offset + t.len);
            }
        }
    }

    /// A vector of `n` values widened to f32.
    pub fn vector(&self, name: &str, n: usize) -> Result<Vec<f32>, WeightsError> {
        let t = self.get(name)?;
        if t.dims != [n] {
            return Err(WeightsError::Shape { name: name.into(), expected: vec![n], found: t.dims.clone() });
        }
        let mut out = vec![0f32; n];
        kernels::quant::dequantize_row(t.ty, self.bytes(t), &mut out);
        Ok(out)
    }
}

/// Maps a GGUF tensor type to the kernel's weight type.
pub fn weight_type(t: crate::gguf::GgmlType) -> WeightType {
    t.weight_type()
}
