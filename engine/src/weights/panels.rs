//! Packed panels, one buffer per model: this process's own, or one file
//! every worker process on the host maps ([`super::panel_file`]).
//!
//! The SIMD kernels read Q4 matrices repacked at load
//! (`kernels::matmul::panels`); those panels are about the model's size. A
//! prefill and a decode worker on one host used to hold them twice, eight
//! workers eight times. With a [`PanelHome::Host`] the first worker to start
//! packs them into a file under the host's panel directory (a tmpfs by
//! default) and every worker, that one included, maps the same pages.
//!
//! One plan (names, offsets, lengths) lays out the buffer both ways, so
//! a shared copy and a private one hold the same bytes at the same offsets,
//! and the kernels return the same bits from either.

use std::collections::HashMap;
use std::fmt;
use std::ops::Range;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::panel_file::{self, PanelError};

/// Where a model's packed panels live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PanelHome {
    /// In this process's own memory.
    Private,
    /// In one file per model and panel layout under a host-wide directory.
    Host(PanelStore),
}

/// A host-wide panel directory and the model the panels are packed from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PanelStore {
    /// Created 0700 if absent; it must be a directory this user owns that
    /// no one else may write.
    pub dir: PathBuf,
    /// SHA-256 of the model file (`weights::digest`): a copy packed from
    /// another model is refused.
    pub model_digest: [u8; 32],
    /// When the directory cannot be used (no space, not ours, a stuck
    /// lock): `true` packs privately and says why in the outcome (the
    /// default directory); `false` fails the load (one the operator named).
    pub private_on_error: bool,
}

/// How this load came by its panels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PanelSource {
    /// Nothing packed: the scalar kernels read the file layout, or no
    /// matrix has a packed type.
    Unpacked,
    /// Packed into this process's memory.
    Private,
    /// Packed by this process into the host file at the path, which it maps.
    Built(PathBuf),
    /// Mapped from the host file another process packed.
    Mapped(PathBuf),
}

/// What a load did about panels, for the start-up log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PanelOutcome {
    pub source: PanelSource,
    /// Bytes of packed panels.
    pub bytes: usize,
    /// A host copy found and refused (stale, foreign, corrupt), and why; it
    /// was replaced.
    pub refused: Option<String>,
    /// Why the host directory was not used, when the load fell back to
    /// private panels.
    pub fallback: Option<String>,
    /// Other models' or layouts' host copies no process held, removed.
    pub pruned: Vec<PathBuf>,
}

impl PanelOutcome {
    /// `bytes` of panels from `source`, nothing refused, pruned or fallen back from.
    pub fn new(source: PanelSource, bytes: usize) -> Self {
        Self { source, bytes, refused: None, fallback: None, pruned: Vec::new() }
    }
}

impl fmt::Display for PanelOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mib = self.bytes as f64 / (1 << 20) as f64;
        match &self.source {
            PanelSource::Unpacked => write!(f, "none packed")?,
            PanelSource::Private => write!(f, "private ({mib:.1} MiB)")?,
            PanelSource::Built(p) => write!(f, "shared, packed into {} ({mib:.1} MiB)", p.display())?,
            PanelSource::Mapped(p) => write!(f, "shared, mapped from {} ({mib:.1} MiB)", p.display())?,
        }
        if let Some(r) = &self.refused {
            write!(f, "; a copy there was refused: {r}")?;
        }
        if let Some(r) = &self.fallback {
            write!(f, "; the panel directory was not used: {r}")?;
        }
        if !self.pruned.is_empty() {
            write!(f, "; removed {} unused copies", self.pruned.len())?;
        }
        Ok(())
    }
}

/// One matrix's packed panels in the buffer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Slot {
    pub name: String,
    pub offset: usize,
    pub len: usize,
}

impl Slot {
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.len
    }
}

/// Where each packed matrix goes in the buffer, in the order asked, each
/// on a cache line (so a panel file's slots start where a private
/// buffer's do).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Plan {
    pub slots: Vec<Slot>,
    pub len: usize,
}

/// Alignment of each slot.
const SLOT_ALIGN: usize = 64;

impl Plan {
    /// Adds `len` bytes under `name`.
    pub fn push(&mut self, name: &str, len: usize) {
        let offset = self.len.next_multiple_of(SLOT_ALIGN);
        self.slots.push(Slot { name: name.to_owned(), offset, len });
        self.len = offset + len;
    }
}

/// The memory the panels are in.
enum Memory {
    Owned(Vec<u8>),
    Shared(panel_file::Shared),
}

/// Packed panels by tensor name.
pub(crate) struct Panels {
    memory: Memory,
    index: HashMap<String, Range<usize>>,
}

impl Default for Panels {
    fn default() -> Self {
        Self { memory: Memory::Owned(Vec::new()), index: HashMap::new() }
    }
}

impl Panels {
    pub fn owned(plan: &Plan, bytes: Vec<u8>) -> Self {
        Self { memory: Memory::Owned(bytes), index: Self::index(plan) }
    }

    pub fn shared(plan: &Plan, file: panel_file::Shared) -> Self {
        Self { memory: Memory::Shared(file), index: Self::index(plan) }
    }

    fn index(plan: &Plan) -> HashMap<String, Range<usize>> {
        plan.slots.iter().map(|s| (s.name.clone(), s.range())).collect()
    }

    pub fn get(&self, name: &str) -> Option<&[u8]> {
        let range = self.index.get(name)?.clone();
        let bytes = match &self.memory {
            Memory::Owned(v) => v.as_slice(),
            Memory::Shared(f) => f.data(),
        };
        bytes.get(range)
    }
}

/// Packs a plan's slots into one private buffer.
pub(crate) fn pack_private(
    plan: &Plan,
    mut pack: impl FnMut(&Slot, &mut [u8]) -> Result<(), PanelError>,
) -> Result<Vec<u8>, PanelError> {
    let mut out = vec![0u8; plan.len];
    for slot in &plan.slots {
        pack(slot, &mut out[slot.range()])?;
    }
    Ok(out)
}
