//! Weights from a GGUF file, borrowed from its memory map.

use std::path::Path;

use super::{weight_type, Backing, TensorRef, Weights, WeightsError};
use crate::gguf::GgufFile;
use crate::model::LlamaConfig;

impl Weights {
    /// Opens a GGUF model. The returned weights borrow the file's map; the
    /// [`GgufFile`] is returned too for its tokenizer metadata.
    pub fn from_gguf(path: &Path) -> Result<(Weights, GgufFile), WeightsError> {
        let file = GgufFile::open(path)?;
        let config = LlamaConfig::from_gguf(&file)?;
        let tensors = file
            .header
            .tensors
            .iter()
            .map(|t| {
                let dims = t.dims.iter().rev().map(|&d| d as usize).collect();
                (t.name.clone(), TensorRef { ty: weight_type(t.dtype), dims, offset: t.offset, len: t.len })
            })
            .collect();
        // A second map of the same file: the GgufFile keeps its own for metadata.
        let backing = Backing::Mapped(
            crate::mmap::Mapped::open(path).map_err(|source| WeightsError::Io { path: path.to_owned(), source })?,
        );
        Ok((Weights { backing, tensors, config, panels: Default::default() }, file))
    }
}
