//! Read-only memory maps of model files.
//!
//! The one place in the engine that needs `unsafe`: mapping a file is unsafe
//! because another process could truncate or rewrite it while mapped. Model
//! files are treated as immutable while the engine runs (they are opened
//! read-only from a cache directory that the engine owns), which is the
//! contract every mmap-based loader (llama.cpp, safetensors) relies on.
#![allow(unsafe_code)]

use std::fs::File;
use std::path::Path;

pub struct Mapped {
    map: memmap2::Mmap,
}

impl Mapped {
    pub fn open(path: &Path) -> std::io::Result<Self> {
        let file = File::open(path)?;
        // SAFETY: the file is opened read-only and the engine never writes
        // model files; see the module doc for the immutability contract.
        let map = unsafe { memmap2::Mmap::map(&file)? };
        Ok(Self { map })
    }

    /// Maps a file this process holds open (a host-wide panel file, see
    /// `weights::panel_file`), read-only, with every page mapped now
    /// (`MAP_POPULATE`): the first request does not fault the weights in,
    /// and the process's memory figures show the sharing from the start.
    /// Those files are written whole under a temporary name, renamed into
    /// place and never written again: the same immutability contract as
    /// model files.
    pub fn of_file(file: &File) -> std::io::Result<Self> {
        // SAFETY: the map is read-only, and panel files are immutable once
        // renamed into place (see the doc above and the module doc).
        let map = unsafe { memmap2::MmapOptions::new().populate().map(file)? };
        Ok(Self { map })
    }

    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// Lets the kernel drop this process's resident pages of `range` (e.g.
    /// weights that were copied elsewhere at load), lowering its RSS; the
    /// pages stay in the page cache, and a later read of them faults the
    /// same bytes back in. Only a hint: errors are ignored.
    pub fn release(&self, range: std::ops::Range<usize>) {
        // SAFETY: the map is a read-only shared mapping of the file, so MADV_DONTNEED only
        // drops this process's page-table entries (no write exists to lose): the pages' next
        // access reads them again from the page cache or the file, which holds the same bytes
        // (the module doc's immutability contract). Bytes borrowed from the map therefore
        // never change. memmap2 rejects an offset or length beyond the map and rounds the
        // start down to a page, so neighbouring bytes in that page may be dropped too; they
        // fault back in the same way.
        let _ =
            unsafe { self.map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, range.start, range.len()) };
    }
}
