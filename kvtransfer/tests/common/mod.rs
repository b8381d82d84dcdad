//! Helpers shared by the kvtransfer integration tests.

#![allow(dead_code)] // each test binary uses its own part of this module

use std::time::Duration;

use engine::kv::KvPool;

use kvtransfer::{Reservation, TransferError, UcxKvSender};
use types::kv::{BlockId, KvLayout};

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

/// Whether UCX reaches the server through shared memory (mapped stores and
/// the direct path are possible).
pub fn shared_lanes(tx: &UcxKvSender) -> bool {
    tx.transports().iter().any(|t| t.starts_with("sysv") || t.starts_with("posix"))
}

/// Sends `layers` of `table` from `pool` for `r` on a UCX sender whose
/// decode side went away, then `Complete`, and returns the first failure: a
/// layer's send returns once its puts are posted, so the loss may show only
/// on a later call for the same reservation, at the latest its `Complete`.
/// Panics if none fails, or if a call takes over 10 s.
pub async fn ucx_failure_after_loss(
    tx: &mut UcxKvSender,
    pool: &KvPool,
    table: &[BlockId],
    r: Reservation,
    layers: std::ops::Range<usize>,
) -> TransferError {
    const BOUND: Duration = Duration::from_secs(10);
    for layer in layers {
        let (k, v) = pool.gather_layer(layer, table).expect("gather");
        match tokio::time::timeout(BOUND, tx.send_layer(r, layer, &k, &v)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return e,
            Err(_) => panic!("a layer's send after the loss took over {BOUND:?}"),
        }
    }
    match tokio::time::timeout(BOUND, tx.complete(r)).await {
        Ok(got) => got.expect_err("an Ack from a decode side that went away"),
        Err(_) => panic!("Complete after the loss took over {BOUND:?}"),
    }
}
