//! The corruption drill's hook on the direct writer path: a byte flipped in
//! the decode pool after the writer took its checksum is refused by the
//! decode side's checksum over its own pool, and the reservation ends
//! without its blocks coming back until the sender fenced.
//!
//! Its own test binary (its own process under any test runner): arming the
//! fault is process-wide, and another test's first store must not take it.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]

mod common;
mod net;

use net::{layout, lock, now, peer, side, within};

use std::sync::{Arc, Mutex};
use std::time::Duration;

use engine::kv::KvPool;
use kvtransfer::transport::fault;
use kvtransfer::{
    AbortReason, Receiver, ReceiverConfig, TransferError, UcxKvSender, UcxKvServer, UcxSenderConfig, UcxServerConfig,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_byte_flipped_in_the_pool_after_the_writers_checksum_is_refused() {
    if std::env::var_os("UCX_NET_DEVICES").is_none() {
        std::env::set_var("UCX_NET_DEVICES", "lo");
    }
    let l = layout();
    let rx = Arc::new(Mutex::new(Receiver::new(peer(&l, "smollm2", 0x11), ReceiverConfig::new(l)).expect("rx")));
    let pool = Arc::new(Mutex::new(KvPool::new(l, 32).expect("pool B")));
    let config = UcxServerConfig { pool_blocks: Some(32), ..UcxServerConfig::default() };
    let mut server =
        within("the UCX server up", UcxKvServer::bind(rx.clone(), pool.clone(), config)).await.expect("bind");
    let memory = server.pool_memory().expect("the server maps the pool");
    lock(&pool).adopt(memory.into_shared()).expect("adopt");
    server.enable_direct();
    let table_b = lock(&pool).allocate(4).expect("alloc B");
    let r = lock(&rx).reserve(table_b.clone(), Duration::from_secs(30), now()).expect("reserve");

    let (pool_a, table_a) = common::source(l, 4, 16);
    let config = UcxSenderConfig { timeout: Duration::from_secs(3), ..UcxSenderConfig::default() };
    let mut tx = within("handshake", UcxKvSender::connect(server.local_addr(), &peer(&l, "smollm2", 0x11), l, config))
        .await
        .expect("connect");
    let Some(w) = within("a writer", tx.direct_writer(r)).await.expect("direct_writer") else {
        // UCX reaches the server without shared memory here (a UCX_TLS without
        // it): there is no pool to write in place, and no writer.
        assert!(!common::shared_lanes(&tx), "no writer over {:?}", tx.transports());
        return;
    };
    fault::arm_corrupt(1, || {});
    // Every layer is stored before any is announced: once the decode side
    // checked the corrupt first layer it aborts the reservation, and the
    // abort revokes the writer, so a store after that is refused.
    let mut stored = Vec::new();
    for layer in 0..l.n_layers {
        let (k, v) = pool_a.layer_bytes(layer).expect("layer bytes");
        let s = w.store_layer(layer, 0, k, v, &table_a).expect("store");
        assert_eq!(s.bytes, 4 * 2 * side(&l));
        stored.push(s);
    }
    within("announce", tx.announce(stored)).await.expect("announce");
    assert_eq!(fault::corrupted(), 1, "the first store was corrupted once");
    let got = within("Complete", tx.complete(r)).await;
    assert!(matches!(got, Err(TransferError::PeerAbort { reason: AbortReason::Corrupt })), "{got:?}");
    assert!(!w.is_live(), "the abort revoked the writer");
    // The sender fenced on hearing the abort: the blocks come back, as corrupt.
    let mut w8 = server.watch_stats();
    within("fenced", w8.wait_for(|s| s.ucx.fences_completed == 1 && s.ucx.quarantined_blocks == 0))
        .await
        .expect("server alive");
    let released = lock(&rx).poll_released(now());
    assert_eq!(released.iter().map(|r| r.blocks.clone()).collect::<Vec<_>>(), [table_b]);
}
