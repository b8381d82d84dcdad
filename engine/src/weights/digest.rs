//! The weights digest that goes into the KV layout fingerprint.
//!
//! Choice: SHA-256 of the model's bytes as stored — the GGUF file, or for a
//! safetensors directory its `.json` and `.safetensors` files in name order
//! (each preceded by its name and length). It is the simplest digest every
//! worker computes identically from the artifact it loads, independent of
//! how a loader orders tensors, and for the models we serve it costs well
//! under a second, once, at start-up. A re-quantized or re-exported model
//! gets a new digest even when the tensors are equal: that errs on the side
//! of refusing KV exchange, which is the safe side.

use std::io;
use std::path::Path;

use sha2::{Digest, Sha256};

/// SHA-256 of the model at `path` (a file, or a safetensors directory).
pub fn weights_digest(path: &Path) -> io::Result<[u8; 32]> {
    let mut h = Sha256::new();
    if path.is_dir() {
        let mut files: Vec<_> = std::fs::read_dir(path)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == "json" || x == "safetensors"))
            .collect();
        files.sort();
        for f in files {
            let name = f.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            h.update((name.len() as u64).to_le_bytes());
            h.update(name.as_bytes());
            h.update(std::fs::metadata(&f)?.len().to_le_bytes());
            io::copy(&mut std::fs::File::open(&f)?, &mut h)?;
        }
    } else {
        io::copy(&mut std::fs::File::open(path)?, &mut h)?;
    }
    Ok(h.finalize().into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_and_directory_digests_change_with_content() {
        let dir = std::env::temp_dir().join(format!("tandem-digest-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let f = dir.join("model.safetensors");
        std::fs::write(&f, b"abc").expect("write");
        std::fs::write(dir.join("config.json"), b"{}").expect("write");
        std::fs::write(dir.join("README.md"), b"ignored").expect("write");
        let d1 = weights_digest(&dir).expect("dir digest");
        let f1 = weights_digest(&f).expect("file digest");
        std::fs::write(dir.join("README.md"), b"still ignored").expect("write");
        assert_eq!(weights_digest(&dir).expect("dir digest"), d1);
        std::fs::write(&f, b"abd").expect("write");
        assert_ne!(weights_digest(&dir).expect("dir digest"), d1);
        assert_ne!(weights_digest(&f).expect("file digest"), f1);
        assert!(weights_digest(&dir.join("missing")).is_err());
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
