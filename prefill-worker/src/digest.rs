//! The weights digest that goes into the [`kvtransfer::LayoutFingerprint`].
//!
//! Choice: SHA-256 of the model file's bytes. It is the simplest digest that
//! every worker can compute identically from the artifact it loads (no
//! dependence on how the loader orders tensors), and for the models we serve
//! it costs well under a second, once, at start-up. A re-quantized or
//! re-exported file gets a new digest even when the tensors are equal; that
//! errs on the side of refusing KV exchange, which is the safe side.

use std::io;
use std::path::Path;

use sha2::{Digest, Sha256};

/// SHA-256 of the file at `path`.
pub fn weights_digest(path: &Path) -> io::Result<[u8; 32]> {
    let mut file = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    io::copy(&mut file, &mut h)?;
    Ok(h.finalize().into())
}
