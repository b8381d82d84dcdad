//! Fault injection for drills and the transport conformance suite: corrupt
//! the KV a transfer sends *after* the sender took its checksum, as a
//! flipped bit on an RDMA link, in a NIC or in the sender's memory would.
//! A fault proxy on a TCP link cannot do this to one-sided puts (there is
//! no stream to sit in), so every sender does it to itself, at the one
//! point where it takes the checksum: ucx's puts and direct stores, the
//! local ring's slot, the streams' (tcp, quic) frame payload.
//!
//! Off unless the process arms it ([`arm_corrupt`]; the prefill worker's
//! `--fault-kv-corrupt` / `TANDEM_FAULT_KV_CORRUPT`, read once at start,
//! off by default). Process-wide, because it is armed once for the process.
//! Never armed by anything else: a production sender pays one atomic load
//! per transfer.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// Transfers still to corrupt.
static LEFT: AtomicU64 = AtomicU64::new(0);
/// Transfers corrupted so far.
static DONE: AtomicU64 = AtomicU64::new(0);
/// Called on the sender's thread after each flip (the process counts it).
static ON_FLIP: OnceLock<fn()> = OnceLock::new();

/// Arms the fault for this process: each of the next `transfers`
/// transfers it sends (any transport) gets one byte of its first put flipped after the
/// checksum is taken (0 disarms). `on_flip` runs after each flip, before
/// the put (the first arming's is kept).
pub fn arm_corrupt(transfers: u64, on_flip: fn()) {
    let _ = ON_FLIP.set(on_flip);
    LEFT.store(transfers, Ordering::SeqCst);
}

/// Transfers this process corrupted (each one byte).
pub fn corrupted() -> u64 {
    DONE.load(Ordering::SeqCst)
}

/// The hook at the sender's checksum point: `k` is layer `layer`'s K from
/// block `first_block`, whose CRC-32C is already in the `Layer` header and
/// which is about to be put (or was just stored through the mapped landing
/// region). Returns the offset of the byte it flipped in `k`, which a
/// sender that already stored `k` stores again.
pub(crate) fn after_checksum(layer: usize, first_block: usize, k: &mut [u8]) -> Option<usize> {
    if !flip_first_put(&LEFT, &DONE, layer, first_block, k) {
        return None;
    }
    if let Some(f) = ON_FLIP.get() {
        f();
    }
    Some(k.len() / 2)
}

/// [`after_checksum`] for bytes already stored through a mapping by a
/// direct writer: `len` bytes of layer `layer`'s K from block
/// `first_block`, checksummed. Returns the offset of the byte the caller
/// must flip where it stored them, if this transfer is to be corrupted.
pub(crate) fn flip_in_place(layer: usize, first_block: usize, len: usize) -> Option<usize> {
    if !take_first_put(&LEFT, &DONE, layer, first_block, len) {
        return None;
    }
    if let Some(f) = ON_FLIP.get() {
        f();
    }
    Some(len / 2)
}

/// [`after_checksum`] for a sender that writes straight from its pool (tcp's pinned
/// layers), where no byte may be changed: whether to send this frame with its checksum
/// off by one bit instead, which the receiver refuses just as a flipped byte.
pub(crate) fn corrupt_checksum(layer: usize, first_block: usize, len: usize) -> bool {
    if !take_first_put(&LEFT, &DONE, layer, first_block, len) {
        return false;
    }
    if let Some(f) = ON_FLIP.get() {
        f();
    }
    true
}

/// [`after_checksum`] for a sender that writes from the caller's memory (the
/// streams): a copy of `k` with the byte flipped, if this transfer is to be
/// corrupted. The copy is made only when the process is armed and this is
/// a transfer's first frame.
pub(crate) fn corrupt_copy(layer: usize, first_block: usize, k: &[u8]) -> Option<Vec<u8>> {
    if layer != 0 || first_block != 0 || k.is_empty() || LEFT.load(Ordering::SeqCst) == 0 {
        return None;
    }
    let mut copy = k.to_vec();
    after_checksum(layer, first_block, &mut copy)?;
    Some(copy)
}

/// Flips one byte in the middle of `k` if this is a transfer's first put
/// ([`take_first_put`]).
fn flip_first_put(left: &AtomicU64, done: &AtomicU64, layer: usize, first_block: usize, k: &mut [u8]) -> bool {
    if !take_first_put(left, done, layer, first_block, k.len()) {
        return false;
    }
    k[k.len() / 2] ^= 0xff;
    true
}

/// Whether to corrupt these `len` bytes: a transfer's first put (layer 0
/// from block 0: exactly once per reservation, however the layers are split
/// into block ranges) while `left` allows one more; counts it in `done`.
fn take_first_put(left: &AtomicU64, done: &AtomicU64, layer: usize, first_block: usize, len: usize) -> bool {
    if layer != 0 || first_block != 0 || len == 0 {
        return false;
    }
    if left.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_err() {
        return false;
    }
    done.fetch_add(1, Ordering::SeqCst);
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flips_one_byte_of_each_first_put_while_armed() {
        let (left, done) = (AtomicU64::new(2), AtomicU64::new(0));
        let clean = vec![7u8; 64];
        let mut k = clean.clone();
        // Not a transfer's first put: untouched, nothing spent.
        assert!(!flip_first_put(&left, &done, 1, 0, &mut k));
        assert!(!flip_first_put(&left, &done, 0, 3, &mut k));
        assert_eq!((k.as_slice(), left.load(Ordering::SeqCst)), (clean.as_slice(), 2));
        assert!(flip_first_put(&left, &done, 0, 0, &mut k));
        let changed: Vec<usize> = (0..k.len()).filter(|&i| k[i] != clean[i]).collect();
        assert_eq!(changed, [32]);
        assert_ne!(crc32c::crc32c(&k), crc32c::crc32c(&clean));
        let mut k2 = clean.clone();
        assert!(flip_first_put(&left, &done, 0, 0, &mut k2));
        // Spent: the third transfer is left alone.
        let mut k3 = clean.clone();
        assert!(!flip_first_put(&left, &done, 0, 0, &mut k3));
        assert_ne!(k2, clean);
        assert_eq!(k3, clean);
        assert_eq!((left.load(Ordering::SeqCst), done.load(Ordering::SeqCst)), (0, 2));
    }

    #[test]
    fn unarmed_touches_nothing() {
        let (left, done) = (AtomicU64::new(0), AtomicU64::new(0));
        let mut k = vec![1u8; 16];
        assert!(!flip_first_put(&left, &done, 0, 0, &mut k));
        assert_eq!((k, done.load(Ordering::SeqCst)), (vec![1u8; 16], 0));
    }
}
