//! Helpers shared by the kvtransfer integration tests.

#![allow(dead_code)] // each test binary uses its own part of this module

use std::time::Duration;

use engine::kv::{BlockId, KvLayout, KvPool};
use kvtransfer::TransferError;

/// Calls `check` (a sender's `check_open`) until it fails and returns the
/// error, yielding between calls so the runtime can take in the peer's
/// close; panics if it has not failed within 120 s.
pub async fn until_closed(mut check: impl FnMut() -> Result<(), TransferError>) -> TransferError {
    let polling = async {
        loop {
            match check() {
                Err(e) => break e,
                Ok(()) => tokio::task::yield_now().await,
            }
        }
    };
    match tokio::time::timeout(Duration::from_secs(120), polling).await {
        Ok(e) => e,
        Err(_) => panic!("check_open still reported the connection open after 120 s"),
    }
}

/// Prefill side: a pool of `pool_blocks` whose `n` allocated blocks (ids
/// offset by two, so they differ from a fresh pool's) hold distinct known
/// K/V values.
pub fn source(l: KvLayout, n: usize, pool_blocks: usize) -> (KvPool, Vec<BlockId>) {
    let mut pool = KvPool::new(l, pool_blocks).expect("pool A");
    let _skip = pool.allocate(2).expect("offset the ids");
    let table = pool.allocate(n).expect("alloc A");
    let row = l.row_elems();
    for layer in 0..l.n_layers {
        for (i, &b) in table.iter().enumerate() {
            for slot in 0..l.block_size {
                let k: Vec<f32> = (0..row).map(|j| ((layer * 1000 + i * 100 + slot * 10 + j) as f32) * 0.25).collect();
                let v: Vec<f32> = k.iter().map(|x| -x - 0.5).collect();
                pool.write(layer, b, slot, &k, &v);
            }
        }
    }
    (pool, table)
}
