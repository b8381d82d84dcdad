//! The host-wide panel file: a model's packed panels written once, mapped
//! by every worker process on the host.
//!
//! In the panel directory, per key (a hash of the file format, the panel
//! layout version, the model's SHA-256 and the plan):
//!
//! | file            | what                                                   |
//! |-----------------|--------------------------------------------------------|
//! | `KEY.lock`      | held exclusively (`flock`) while a process looks for, checks or writes the copy |
//! | `KEY.panels`    | the copy; every process that maps it holds a shared lock on it |
//! | `KEY.tmp-PID`   | a copy being written, renamed to `KEY.panels` when whole |
//!
//! A copy is the magic `TNDMPANL`, a little-endian `u32` header length, a
//! JSON header (format, layout, model digest, slots, the data's length
//! and SHA-256), zeros to the next page, then the data laid out by the
//! plan. Every process checks all of it before use, the SHA-256 over the
//! data included (about 30 ms for 62 MB with SHA extensions): a stale copy
//! (another layout or plan), a foreign one (another model) or a corrupt or
//! torn one is refused, said in the load's outcome and replaced. Once
//! renamed into place a copy is never written again; replacing one renames
//! a new file over it, and processes that mapped the old one keep its pages.
//!
//! Copies of other keys that no process holds (their shared lock is free)
//! are removed when a copy is obtained, so a host that moved to a new model
//! or build does not keep the old panels in its tmpfs.

use std::fs::{self, DirBuilder, File, OpenOptions, TryLockError};
use std::io::{self, Write};
use std::ops::Range;
use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::panels::{PanelStore, Plan, Slot};
use crate::mmap::Mapped;

/// Why the panel directory could not be used.
#[derive(Debug, thiserror::Error)]
pub enum PanelError {
    /// The directory is missing and cannot be made, or is not safe to use.
    #[error("panel directory {dir}: {why}")]
    Dir { dir: PathBuf, why: String },
    #[error("panel file {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// Another process held the key's lock past the wait.
    #[error("{lock} stayed locked by another process for {secs} s (a stopped worker mid-pack?)")]
    LockTimeout { lock: PathBuf, secs: u64 },
    /// A matrix could not be packed.
    #[error("packing {name}: {why}")]
    Pack { name: String, why: String },
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> PanelError + '_ {
    move |source| PanelError::Io { path: path.to_owned(), source }
}

const MAGIC: &[u8; 8] = b"TNDMPANL";
/// Version of this file's format (the header and the layout around it).
const FORMAT: u32 = 1;
/// Magic and header length.
const PREFIX: usize = 12;
/// A longer header is refused unread.
const HEADER_CAP: usize = 1 << 20;
const PAGE: usize = 4096;
/// How long a process waits for another to finish packing a copy.
pub(crate) const LOCK_WAIT: Duration = Duration::from_secs(60);

/// A copy's header.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Header {
    format: u32,
    layout: u32,
    model_sha256: String,
    data_len: usize,
    data_sha256: String,
    panels: Vec<Slot>,
}

impl Header {
    fn new(store: &PanelStore, plan: &Plan, data_sha256: [u8; 32]) -> Self {
        Self {
            format: FORMAT,
            layout: kernels::matmul::panels::PANEL_LAYOUT,
            model_sha256: hex(&store.model_digest),
            data_len: plan.len,
            data_sha256: hex(&data_sha256),
            panels: plan.slots.clone(),
        }
    }

    /// The header as written, and where the data starts after it.
    fn encode(&self) -> (Vec<u8>, usize) {
        // Cannot fail for this struct (plain fields, string keys); were it
        // to, the empty header written would be refused by every reader.
        let json = serde_json::to_vec(self).unwrap_or_default();
        let mut out = Vec::with_capacity(PREFIX + json.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&(json.len() as u32).to_le_bytes());
        out.extend_from_slice(&json);
        let data_start = out.len().next_multiple_of(PAGE);
        (out, data_start)
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The file name stem of the copy for `store`'s model laid out by `plan`.
pub(crate) fn key(store: &PanelStore, plan: &Plan) -> String {
    let mut h = Sha256::new();
    h.update(FORMAT.to_le_bytes());
    h.update(kernels::matmul::panels::PANEL_LAYOUT.to_le_bytes());
    h.update(store.model_digest);
    for s in &plan.slots {
        h.update((s.name.len() as u64).to_le_bytes());
        h.update(s.name.as_bytes());
        h.update((s.offset as u64).to_le_bytes());
        h.update((s.len as u64).to_le_bytes());
    }
    hex(&h.finalize()[..16])
}

/// A mapped, checked copy; the file stays open with a shared lock on it, so
/// no other process prunes it while this one reads it.
pub(crate) struct Shared {
    map: Mapped,
    data: Range<usize>,
    _file: File,
}

impl Shared {
    pub fn data(&self) -> &[u8] {
        &self.map.bytes()[self.data.clone()]
    }
}

/// What [`obtain`] found or made.
pub(crate) struct Obtained {
    pub shared: Shared,
    pub path: PathBuf,
    /// This process packed the copy.
    pub built: bool,
    /// A copy found and refused, and why.
    pub refused: Option<String>,
    pub pruned: Vec<PathBuf>,
}

/// Maps the host copy of `plan`'s panels for `store`'s model, packing it
/// with `pack` (slot by slot) when there is none or the one there is
/// refused.
pub(crate) fn obtain(
    store: &PanelStore,
    plan: &Plan,
    pack: impl FnMut(&Slot, &mut [u8]) -> Result<(), PanelError>,
    lock_wait: Duration,
) -> Result<Obtained, PanelError> {
    prepare_dir(&store.dir)?;
    let key = key(store, plan);
    let lock_path = store.dir.join(format!("{key}.lock"));
    let _lock = lock_exclusive(&lock_path, lock_wait)?;
    remove_partial(&store.dir, &key);
    let path = store.dir.join(format!("{key}.panels"));
    let (shared, built, refused) = match open_checked(&path, store, plan) {
        Found::Valid(shared) => (shared, false, None),
        Found::Absent => (write(&path, &key, store, plan, pack)?, true, None),
        Found::Refused(why) => {
            tracing::warn!(path = %path.display(), why = %why, "refusing a host panel copy; packing a new one");
            (write(&path, &key, store, plan, pack)?, true, Some(why))
        }
    };
    let pruned = prune(&store.dir, &key);
    Ok(Obtained { shared, path, built, refused, pruned })
}

/// Creates the directory (0700) if absent and checks that it is one this
/// user owns and no one else may write: a copy there is mapped as weights.
fn prepare_dir(dir: &Path) -> Result<(), PanelError> {
    let bad = |why: String| PanelError::Dir { dir: dir.to_owned(), why };
    DirBuilder::new().recursive(true).mode(0o700).create(dir).map_err(|e| bad(format!("cannot create it: {e}")))?;
    let md = fs::symlink_metadata(dir).map_err(|e| bad(e.to_string()))?;
    if !md.is_dir() {
        return Err(bad("is not a directory (a symlink is refused too)".into()));
    }
    let me = current_uid().map_err(|e| bad(format!("cannot tell this process's user: {e}")))?;
    if md.uid() != me {
        return Err(bad(format!("is owned by uid {}, not this process's uid {me}", md.uid())));
    }
    if md.mode() & 0o022 != 0 {
        return Err(bad(format!("group or others may write it (mode {:o}); use a 0700 directory", md.mode() & 0o777)));
    }
    Ok(())
}

/// This process's effective uid (the owner of `/proc/self`).
pub(crate) fn current_uid() -> io::Result<u32> {
    fs::metadata("/proc/self").map(|m| m.uid())
}

/// Takes `path`'s exclusive lock, waiting at most `wait`.
fn lock_exclusive(path: &Path, wait: Duration) -> Result<File, PanelError> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)
        .map_err(io_err(path))?;
    // Wall time on purpose: no runtime here, and the wait bounds a start-up.
    #[allow(clippy::disallowed_types)]
    let started = std::time::Instant::now();
    loop {
        match file.try_lock() {
            Ok(()) => return Ok(file),
            Err(TryLockError::WouldBlock) if started.elapsed() < wait => std::thread::sleep(Duration::from_millis(10)),
            Err(TryLockError::WouldBlock) => {
                return Err(PanelError::LockTimeout { lock: path.to_owned(), secs: wait.as_secs() })
            }
            Err(TryLockError::Error(e)) => return Err(PanelError::Io { path: path.to_owned(), source: e }),
        }
    }
}

/// Removes `key`'s partial copies: with its lock held, whoever wrote them
/// is gone.
fn remove_partial(dir: &Path, key: &str) {
    let prefix = format!("{key}.tmp-");
    for name in names(dir) {
        if name.starts_with(&prefix) {
            let _ = fs::remove_file(dir.join(name));
        }
    }
}

fn names(dir: &Path) -> Vec<String> {
    fs::read_dir(dir).map(|rd| rd.filter_map(|e| e.ok()?.file_name().into_string().ok()).collect()).unwrap_or_default()
}

enum Found {
    Valid(Shared),
    Absent,
    Refused(String),
}

/// Opens, maps and checks the copy at `path` against what this process
/// would write.
fn open_checked(path: &Path, store: &PanelStore, plan: &Plan) -> Found {
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Found::Absent,
        Err(e) => return Found::Refused(format!("cannot open it: {e}")),
    };
    match check(file, store, plan) {
        Ok(shared) => Found::Valid(shared),
        Err(why) => Found::Refused(why),
    }
}

fn check(file: File, store: &PanelStore, plan: &Plan) -> Result<Shared, String> {
    file.lock_shared().map_err(|e| format!("cannot lock it: {e}"))?;
    let len = file.metadata().map_err(|e| e.to_string())?.len() as usize;
    if len < PREFIX {
        return Err(format!("truncated ({len} bytes)"));
    }
    let map = Mapped::of_file(&file).map_err(|e| format!("cannot map it: {e}"))?;
    let bytes = map.bytes();
    if &bytes[..8] != MAGIC {
        return Err("not a panel file (bad magic)".into());
    }
    let header_len = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize;
    if header_len > HEADER_CAP || PREFIX + header_len > len {
        return Err(format!("header length {header_len} does not fit the file ({len} bytes)"));
    }
    let header: Header =
        serde_json::from_slice(&bytes[PREFIX..PREFIX + header_len]).map_err(|e| format!("unreadable header: {e}"))?;
    let want = Header::new(store, plan, [0; 32]);
    if header.format != want.format || header.layout != want.layout {
        return Err(format!(
            "format {} layout {} (this build writes format {} layout {})",
            header.format, header.layout, want.format, want.layout
        ));
    }
    if header.model_sha256 != want.model_sha256 {
        return Err(format!("packed from another model (sha256 {})", header.model_sha256));
    }
    if header.panels != want.panels || header.data_len != want.data_len {
        return Err("laid out for another set of matrices".into());
    }
    let data_start = (PREFIX + header_len).next_multiple_of(PAGE);
    if len != data_start + header.data_len {
        return Err(format!("{len} bytes, not the {} its header says (torn?)", data_start + header.data_len));
    }
    let data = data_start..len;
    if hex(&Sha256::digest(&bytes[data.clone()])) != header.data_sha256 {
        return Err("its data does not match its SHA-256 (corrupt)".into());
    }
    Ok(Shared { map, data, _file: file })
}

/// Packs a new copy under a temporary name, renames it to `path` and maps
/// it. Written with `write`, not through a map: a full tmpfs is then an
/// error here, not a SIGBUS.
fn write(
    path: &Path,
    key: &str,
    store: &PanelStore,
    plan: &Plan,
    mut pack: impl FnMut(&Slot, &mut [u8]) -> Result<(), PanelError>,
) -> Result<Shared, PanelError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = dir.join(format!("{key}.tmp-{}", std::process::id()));
    let file =
        OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(&tmp).map_err(io_err(&tmp))?;
    let guard = RemoveOnDrop(&tmp);
    file.lock_shared().map_err(io_err(&tmp))?;
    // The header's length does not depend on the hash's value, so the data
    // can start where the final header will end.
    let (placeholder, data_start) = Header::new(store, plan, [0; 32]).encode();
    let mut out = io::BufWriter::with_capacity(1 << 20, &file);
    out.write_all(&vec![0u8; data_start]).map_err(io_err(&tmp))?;
    let mut hash = Sha256::new();
    let mut at = 0;
    let mut buf = Vec::new();
    for slot in &plan.slots {
        let pad = vec![0u8; slot.offset - at];
        buf.clear();
        buf.resize(slot.len, 0);
        pack(slot, &mut buf)?;
        for part in [&pad[..], &buf[..]] {
            hash.update(part);
            out.write_all(part).map_err(io_err(&tmp))?;
        }
        at = slot.offset + slot.len;
    }
    out.flush().map_err(io_err(&tmp))?;
    drop(out);
    let (header, start) = Header::new(store, plan, hash.finalize().into()).encode();
    debug_assert_eq!((header.len(), start), (placeholder.len(), data_start));
    file.write_all_at(&header, 0).map_err(io_err(&tmp))?;
    fs::rename(&tmp, path).map_err(io_err(path))?;
    std::mem::forget(guard);
    let map = Mapped::of_file(&file).map_err(io_err(path))?;
    Ok(Shared { map, data: data_start..data_start + plan.len, _file: file })
}

struct RemoveOnDrop<'a>(&'a Path);

impl Drop for RemoveOnDrop<'_> {
    fn drop(&mut self) {
        let _ = fs::remove_file(self.0);
    }
}

/// Removes other keys' files whose copy no process holds; returns the
/// copies removed. Only names this module writes are touched.
fn prune(dir: &Path, keep: &str) -> Vec<PathBuf> {
    let is_key = |k: &str| k.len() == 32 && k.bytes().all(|b| b.is_ascii_hexdigit());
    let mut keys: Vec<String> = names(dir)
        .into_iter()
        .filter_map(|n| {
            let stem = n.split_once('.').map(|(k, _)| k.to_owned())?;
            (is_key(&stem) && stem != keep).then_some(stem)
        })
        .collect();
    keys.sort();
    keys.dedup();
    let mut pruned = Vec::new();
    for key in keys {
        let lock_path = dir.join(format!("{key}.lock"));
        // Someone is looking for, checking or packing this copy: leave it.
        let Ok(_lock) = lock_exclusive(&lock_path, Duration::ZERO) else { continue };
        let copy = dir.join(format!("{key}.panels"));
        if let Ok(f) = File::open(&copy) {
            // A shared lock: some process maps it.
            if f.try_lock().is_err() {
                continue;
            }
            if fs::remove_file(&copy).is_ok() {
                pruned.push(copy);
            }
        }
        remove_partial(dir, &key);
        let _ = fs::remove_file(&lock_path);
    }
    pruned
}

#[cfg(test)]
mod tests;
