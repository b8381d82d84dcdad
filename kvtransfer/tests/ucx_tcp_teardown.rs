//! Tearing a UCX connection down mid-transfer over tcp, where UCX emulates
//! puts in software: the decode side's own worker writes each arriving put
//! during its progress, and endpoint failures are reported from queued
//! callbacks. Both once broke this process, not the transfer:
//! - the server unmapped its landing region before its worker was
//!   destroyed, and destroying the worker progresses it, so a sender's late
//!   put was written into unmapped (or freed and reused) memory: SIGSEGV in
//!   `ucp_put_handler`;
//! - an endpoint's failure cell was freed when the endpoint closed, and UCX
//!   1.13 may still call the error handler after a forced close: glibc
//!   aborted at a thread's exit ("unaligned tcache chunk detected").
//!
//! Both were races, seen in about half the runs of the in-process tests with
//! `UCX_TLS=tcp`; each case runs several rounds here. Its own binary (its own
//! process under any test runner): `UCX_TLS` is read by every UCX context of
//! the process, and this one must be tcp whatever the caller's environment.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]

mod common;
mod net;

use net::{layout, lock, now, peer, side, within, WAIT};

use std::sync::{Arc, Mutex};
use std::time::Duration;

use engine::kv::KvPool;
use kvtransfer::{ErrorKind, Receiver, ReceiverConfig, UcxKvSender, UcxKvServer, UcxSenderConfig, UcxServerConfig};

/// Rounds per case: each round alone hit the race about half the time.
const ROUNDS: usize = 4;

fn tcp_only() {
    std::env::set_var("UCX_TLS", "tcp");
    if std::env::var_os("UCX_NET_DEVICES").is_none() {
        std::env::set_var("UCX_NET_DEVICES", "lo");
    }
}

/// A decode side: its receiver, its pool (32 blocks, in UCX memory when
/// `direct`) and its server.
async fn decode_side(direct: bool) -> (Arc<Mutex<Receiver>>, Arc<Mutex<KvPool>>, UcxKvServer) {
    let l = layout();
    let rx = Arc::new(Mutex::new(Receiver::new(peer(&l, "smollm2", 0x11), ReceiverConfig::new(l)).expect("rx")));
    let pool = Arc::new(Mutex::new(KvPool::new(l, 32).expect("pool B")));
    let config = UcxServerConfig { pool_blocks: direct.then_some(32), ..UcxServerConfig::default() };
    let mut server =
        within("the UCX server up", UcxKvServer::bind(rx.clone(), pool.clone(), config)).await.expect("bind");
    if let Some(memory) = server.pool_memory() {
        lock(&pool).adopt(memory.into_shared()).expect("adopt");
        server.enable_direct();
    }
    (rx, pool, server)
}

async fn connect(server: &UcxKvServer) -> UcxKvSender {
    let l = layout();
    let config = UcxSenderConfig { timeout: Duration::from_secs(3), ..UcxSenderConfig::default() };
    within("handshake", UcxKvSender::connect(server.local_addr(), &peer(&l, "smollm2", 0x11), l, config))
        .await
        .expect("connect")
}

/// A server shut down while its sender keeps putting layers: every round
/// ends in a typed error for the sender, and this process goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_shut_down_under_a_senders_puts_fails_the_transfer_not_the_process() {
    tcp_only();
    let l = layout();
    let (pool_a, table_a) = common::source(l, 3, 32);
    for round in 0..ROUNDS {
        let (rx, pool, server) = decode_side(false).await;
        let blocks = lock(&pool).allocate(3).expect("alloc B");
        let r = lock(&rx).reserve(blocks, Duration::from_secs(30), now()).expect("reserve");
        let mut tx = connect(&server).await;
        assert!(tx.transports().iter().all(|t| t.starts_with("tcp")), "{:?}", tx.transports());
        let (k, v) = pool_a.gather_layer(0, &table_a).expect("gather");
        within("the first layer", tx.send_layer(r, 0, &k, &v)).await.expect("the first layer is sent");
        assert_eq!(tx.bytes_sent(), (3 * 2 * side(&l)) as u64, "round {round}: one layer of 3 blocks");
        server.shutdown();
        let started = tokio::time::Instant::now();
        let failure = common::ucx_failure_after_loss(&mut tx, &pool_a, &table_a, r, 1..l.n_layers).await;
        assert!(matches!(failure.kind(), ErrorKind::Deadline | ErrorKind::Retryable), "round {round}: {failure}");
        assert!(started.elapsed() < WAIT, "round {round}: bounded by the sender's timeout");
    }
}

/// A sender that connected and asked for a writer, then dropped, and its
/// server shut down just after it: both sides close endpoints whose peer
/// is failing. Over tcp there is no pool to write in place, so no
/// writer is handed out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_closed_while_their_peer_fails_leave_the_process_intact() {
    tcp_only();
    for round in 0..ROUNDS {
        let (rx, pool, server) = decode_side(true).await;
        let blocks = lock(&pool).allocate(4).expect("alloc B");
        let r = lock(&rx).reserve(blocks, Duration::from_secs(30), now()).expect("reserve");
        let mut tx = connect(&server).await;
        let writer = within("a writer", tx.direct_writer(r)).await.expect("direct_writer");
        assert!(writer.is_none(), "round {round}: a writer over {:?}", tx.transports());
        // The sender goes (its Bye on its way) and the server right after it.
        drop(tx);
        server.shutdown();
    }
}
