//! Drills only (the `fault-injection` feature): bugs planted on purpose, so that a
//! chaos run can show its invariants catch them (`tandem chaos --plant`). Each names
//! the N-th prefill this worker starts (1-based; 0 is off) and is counted in
//! `tandem_faults_injected_total{fault}` when it strikes.

use std::sync::atomic::{AtomicU64, Ordering};

static SWAP_TOKEN_AT: AtomicU64 = AtomicU64::new(0);
static LEAK_BLOCKS_AT: AtomicU64 = AtomicU64::new(0);
static STARTED: AtomicU64 = AtomicU64::new(0);

/// Arms the plants: the `swap_token_at`-th prefill answers with another first token
/// (a wrong token behind HTTP 200); the `leak_blocks_at`-th keeps its KV blocks for good
/// (no release, no runner deadline).
pub fn arm(swap_token_at: u64, leak_blocks_at: u64) {
    SWAP_TOKEN_AT.store(swap_token_at, Ordering::SeqCst);
    LEAK_BLOCKS_AT.store(leak_blocks_at, Ordering::SeqCst);
}

/// What is planted in one prefill.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Planted {
    pub swap_first_token: bool,
    pub leak_blocks: bool,
}

/// The plants of the prefill starting now.
pub fn next() -> Planted {
    let n = STARTED.fetch_add(1, Ordering::SeqCst) + 1;
    Planted {
        swap_first_token: SWAP_TOKEN_AT.load(Ordering::SeqCst) == n,
        leak_blocks: LEAK_BLOCKS_AT.load(Ordering::SeqCst) == n,
    }
}

/// The first token a swapped prefill answers with: another id of the vocabulary (the
/// low bit flipped, so it stays below any even vocabulary size).
pub fn swapped(id: u32) -> u32 {
    id ^ 1
}
