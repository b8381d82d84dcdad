//! Who may exchange KV with whom.
//!
//! Two checks, for two kinds of mistake. The [`VersionGroup`] is an operator's
//! label: the coordinator pairs only workers with equal labels. The
//! [`LayoutFingerprint`] is computed from what actually decides the meaning
//! of KV bytes — protocol version, weights, tokenizer and block layout — so a
//! mislabelled rollout (same label, different model) is still refused at the
//! transfer handshake instead of producing wrong answers.

use std::fmt;

use sha2::{Digest, Sha256};
use types::kv::{KvDtype, KvLayout};

/// Domain separation: this hash can never collide with another tandem digest
/// of the same bytes.
const DOMAIN: &[u8] = b"tandem/kv-layout-fingerprint/v1";

/// SHA-256 over everything two peers must share for one's KV to be valid in
/// the other's pool.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct LayoutFingerprint([u8; 32]);

impl LayoutFingerprint {
    /// Fingerprint for this build's [`PROTOCOL_VERSION`](crate::PROTOCOL_VERSION).
    pub fn new(layout: &KvLayout, weights_digest: &[u8; 32], tokenizer_digest: &[u8; 32]) -> Self {
        Self::with_protocol(crate::PROTOCOL_VERSION, layout, weights_digest, tokenizer_digest)
    }

    /// Fingerprint for an explicit protocol version.
    ///
    /// Encoding (all integers little-endian, sizes as u64 so the hash does
    /// not depend on the platform's `usize`): `len(DOMAIN): u32, DOMAIN,
    /// protocol_version: u32, weights: [u8; 32], tokenizer: [u8; 32],
    /// n_layers, n_kv_heads, head_dim, block_size: u64, dtype: u8`.
    pub fn with_protocol(
        protocol_version: u32,
        layout: &KvLayout,
        weights_digest: &[u8; 32],
        tokenizer_digest: &[u8; 32],
    ) -> Self {
        let mut h = Sha256::new();
        h.update((DOMAIN.len() as u32).to_le_bytes());
        h.update(DOMAIN);
        h.update(protocol_version.to_le_bytes());
        h.update(weights_digest);
        h.update(tokenizer_digest);
        for n in [layout.n_layers, layout.n_kv_heads, layout.head_dim, layout.block_size] {
            h.update((n as u64).to_le_bytes());
        }
        h.update([dtype_code(layout.dtype)]);
        Self(h.finalize().into())
    }

    /// A fingerprint received from a peer.
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// All 64 hex digits (for logs that must identify a build exactly).
    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }
}

/// Stable codes, independent of the enum's declaration order.
fn dtype_code(d: KvDtype) -> u8 {
    match d {
        KvDtype::F32 => 1,
        KvDtype::F16 => 2,
    }
}

fn hex(bytes: &[u8]) -> String {
    use fmt::Write as _;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// Short form (first 8 bytes, 16 hex digits), like a git short hash.
impl fmt::Display for LayoutFingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex(&self.0[..8]))
    }
}

impl fmt::Debug for LayoutFingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LayoutFingerprint({})", self.to_hex())
    }
}

/// An operator-chosen label naming a set of workers whose KV is
/// interchangeable (same model build). 1..=64 characters of `[A-Za-z0-9._-]`,
/// so it is safe in etcd keys, metric labels and log lines.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct VersionGroup(String);

/// Why a string is not a [`VersionGroup`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VersionGroupError {
    /// The label is empty.
    #[error("version group is empty")]
    Empty,
    /// The label is longer than [`VersionGroup::MAX_LEN`] bytes.
    #[error("version group is {len} bytes; at most {max} allowed", max = VersionGroup::MAX_LEN)]
    TooLong { len: usize },
    /// The label has a character outside `[A-Za-z0-9._-]`.
    #[error("version group has {ch:?} at byte {at}; only A-Z a-z 0-9 . _ - are allowed")]
    InvalidChar { ch: char, at: usize },
}

impl VersionGroup {
    pub const MAX_LEN: usize = 64;

    pub fn new(label: impl Into<String>) -> Result<Self, VersionGroupError> {
        let label = label.into();
        Self::validate(label.as_bytes())?;
        Ok(Self(label))
    }

    /// Validates raw bytes (as read off the wire) without allocating first.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, VersionGroupError> {
        Self::validate(bytes)?;
        // Validation admits ASCII only, so this is lossless.
        Ok(Self(bytes.iter().map(|&b| b as char).collect()))
    }

    fn validate(bytes: &[u8]) -> Result<(), VersionGroupError> {
        if bytes.is_empty() {
            return Err(VersionGroupError::Empty);
        }
        if bytes.len() > Self::MAX_LEN {
            return Err(VersionGroupError::TooLong { len: bytes.len() });
        }
        match bytes.iter().position(|&b| !(b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))) {
            Some(at) => {
                // Report the character, decoding a multi-byte one if it is there.
                let ch = std::str::from_utf8(&bytes[at..])
                    .ok()
                    .and_then(|s| s.chars().next())
                    .unwrap_or(char::REPLACEMENT_CHARACTER);
                Err(VersionGroupError::InvalidChar { ch, at })
            }
            None => Ok(()),
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for VersionGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::str::FromStr for VersionGroup {
    type Err = VersionGroupError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

impl TryFrom<String> for VersionGroup {
    type Error = VersionGroupError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        Self::new(s)
    }
}

impl From<VersionGroup> for String {
    fn from(g: VersionGroup) -> String {
        g.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> KvLayout {
        KvLayout { n_layers: 2, n_kv_heads: 1, head_dim: 8, block_size: 4, dtype: KvDtype::F16 }
    }

    #[test]
    fn fingerprint_is_stable_and_covers_every_input() {
        let (w, t) = ([1u8; 32], [2u8; 32]);
        let base = LayoutFingerprint::new(&layout(), &w, &t);
        assert_eq!(base, LayoutFingerprint::new(&layout(), &w, &t), "deterministic");
        let variants = [
            LayoutFingerprint::with_protocol(crate::PROTOCOL_VERSION + 1, &layout(), &w, &t),
            LayoutFingerprint::new(&layout(), &[9; 32], &t),
            LayoutFingerprint::new(&layout(), &w, &[9; 32]),
            LayoutFingerprint::new(&KvLayout { n_layers: 3, ..layout() }, &w, &t),
            LayoutFingerprint::new(&KvLayout { n_kv_heads: 2, ..layout() }, &w, &t),
            LayoutFingerprint::new(&KvLayout { head_dim: 16, ..layout() }, &w, &t),
            LayoutFingerprint::new(&KvLayout { block_size: 8, ..layout() }, &w, &t),
            LayoutFingerprint::new(&KvLayout { dtype: KvDtype::F32, ..layout() }, &w, &t),
        ];
        for (i, v) in variants.iter().enumerate() {
            assert_ne!(*v, base, "variant {i} must change the fingerprint");
        }
        // Swapping the two digests must not collide (they are positional).
        assert_ne!(LayoutFingerprint::new(&layout(), &t, &w), base);
    }

    #[test]
    fn fingerprint_encoding_is_pinned() {
        // Recompute by hand from the documented encoding, so an accidental
        // change of field order or width is caught.
        let mut h = Sha256::new();
        h.update(31u32.to_le_bytes());
        h.update(b"tandem/kv-layout-fingerprint/v1");
        h.update(1u32.to_le_bytes());
        h.update([1u8; 32]);
        h.update([2u8; 32]);
        for n in [2u64, 1, 8, 4] {
            h.update(n.to_le_bytes());
        }
        h.update([2u8]);
        let want: [u8; 32] = h.finalize().into();
        let got = LayoutFingerprint::with_protocol(1, &layout(), &[1; 32], &[2; 32]);
        assert_eq!(got.as_bytes(), &want);
    }

    #[test]
    fn fingerprint_display_is_short_hex() {
        let fp = LayoutFingerprint::from_bytes([0xab; 32]);
        assert_eq!(fp.to_string(), "abababababababab");
        assert_eq!(fp.to_hex().len(), 64);
        assert!(format!("{fp:?}").contains(&fp.to_hex()));
    }

    #[test]
    fn version_group_validation() {
        for ok in ["a", "llama-3.1_8b", &"x".repeat(64), "A.B-C_9"] {
            assert_eq!(VersionGroup::new(ok).map(|g| g.as_str().to_owned()), Ok(ok.to_owned()));
        }
        assert_eq!(VersionGroup::new(""), Err(VersionGroupError::Empty));
        assert_eq!(VersionGroup::new("x".repeat(65)), Err(VersionGroupError::TooLong { len: 65 }));
        assert_eq!(VersionGroup::new("a b"), Err(VersionGroupError::InvalidChar { ch: ' ', at: 1 }));
        assert_eq!(VersionGroup::new("ab/c"), Err(VersionGroupError::InvalidChar { ch: '/', at: 2 }));
        assert_eq!(VersionGroup::new("é"), Err(VersionGroupError::InvalidChar { ch: 'é', at: 0 }));
        assert!(matches!(VersionGroup::from_bytes(&[b'a', 0xff]), Err(VersionGroupError::InvalidChar { at: 1, .. })));
        assert_eq!("g1".parse::<VersionGroup>().map(String::from), Ok("g1".to_owned()));
    }
}
