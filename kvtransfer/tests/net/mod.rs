//! Helpers shared by the network transport tests (tcp.rs, quic.rs): the
//! small layout they move, peers, and bounded waits.

#![allow(dead_code)] // each test binary uses its own part of this module

use std::future::Future;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use kvtransfer::{LayoutFingerprint, Peer, VersionGroup};
use types::kv::{KvDtype, KvLayout};

/// The longest any awaited event may take.
pub const WAIT: Duration = Duration::from_secs(10);

/// Awaits `fut`, failing the test with `what` if it takes longer than [`WAIT`].
pub async fn within<T>(what: &str, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(WAIT, fut).await {
        Ok(t) => t,
        Err(_) => panic!("timed out after {WAIT:?}: {what} did not happen"),
    }
}

pub fn layout() -> KvLayout {
    KvLayout { n_layers: 4, n_kv_heads: 2, head_dim: 8, block_size: 4, dtype: KvDtype::F16 }
}

/// Bytes of one block's K (or V) in one layer.
pub fn side(l: &KvLayout) -> usize {
    l.block_elems() * l.dtype.size()
}

/// A peer of version group `group` whose weights hash is all `weights`.
pub fn peer(l: &KvLayout, group: &str, weights: u8) -> Peer {
    Peer {
        version_group: VersionGroup::new(group).expect("label"),
        fingerprint: LayoutFingerprint::new(l, &[weights; 32], &[0x22; 32]),
    }
}

pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().expect("test lock")
}

/// Now, on tokio's clock, as the receiver takes it.
pub fn now() -> tokio::time::Instant {
    tokio::time::Instant::now()
}
