//! Where the project keeps downloaded models and reference builds.

use std::path::PathBuf;

/// The model `make model` fetches (SmolLM2-135M-Instruct, Q4_1).
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// `$TANDEM_CACHE`, else `$HOME/.cache/tandem`.
pub fn cache_dir() -> PathBuf {
    if let Some(p) = std::env::var_os("TANDEM_CACHE") {
        return PathBuf::from(p);
    }
    std::env::var_os("HOME")
        .map(|h| PathBuf::from(h).join(".cache/tandem"))
        .unwrap_or_else(|| PathBuf::from(".cache/tandem"))
}

/// `$TANDEM_MODEL`, else the cached default model.
pub fn default_model_path() -> PathBuf {
    match std::env::var_os("TANDEM_MODEL") {
        Some(p) => PathBuf::from(p),
        None => cache_dir().join("models").join(DEFAULT_MODEL_FILE),
    }
}

/// Where workers share packed panels by default (`weights::panel_file`):
/// `/dev/shm/tandem-panels-UID` (memory, gone at reboot, shared by every
/// process that sees this `/dev/shm`), else `cache_dir()/panels` (a disk
/// file's pages are shared through the page cache as well).
pub fn default_panel_dir() -> PathBuf {
    let shm = std::path::Path::new("/dev/shm");
    match crate::weights::panel_file::current_uid() {
        Ok(uid) if shm.is_dir() => shm.join(format!("tandem-panels-{uid}")),
        _ => cache_dir().join("panels"),
    }
}
