//! What only the server's inside can show: a write that lands in the
//! landing region after the sender's put and before the server copies the
//! layer out is caught by the checksum over the copy, and no byte of that
//! layer reaches the sink.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use types::kv::{BlockId, KvDtype, KvLayout};

use super::{UcxKvSender, UcxKvServer, UcxSenderConfig, UcxServerConfig};
use crate::frame::AbortReason;
use crate::session::{Peer, Receiver, ReceiverConfig, ReservationState};
use crate::transport::{FnSink, TransferError};
use crate::{LayoutFingerprint, VersionGroup};

fn layout() -> KvLayout {
    KvLayout { n_layers: 3, n_kv_heads: 2, head_dim: 8, block_size: 4, dtype: KvDtype::F16 }
}

async fn within<T>(what: &str, fut: impl std::future::Future<Output = T>) -> T {
    match tokio::time::timeout(Duration::from_secs(10), fut).await {
        Ok(t) => t,
        Err(_) => panic!("timed out: {what} did not happen"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_landing_between_put_and_copy_is_refused_by_the_checksum() {
    if std::env::var_os("UCX_NET_DEVICES").is_none() {
        std::env::set_var("UCX_NET_DEVICES", "lo");
    }
    let l = layout();
    let me = Peer {
        version_group: VersionGroup::new("smollm2").expect("label"),
        fingerprint: LayoutFingerprint::new(&l, &[0x11; 32], &[0x22; 32]),
    };
    let rx = Arc::new(Mutex::new(Receiver::new(me.clone(), ReceiverConfig::new(l)).expect("rx")));
    let written: Arc<Mutex<Vec<usize>>> = Arc::default();
    let seen = written.clone();
    let sink = FnSink(move |layer: usize, _: &[BlockId], _: &[u8], _: &[u8]| {
        seen.lock().expect("sink log").push(layer);
        Ok(())
    });
    // Layer 0 lands clean; layer 1 gets one byte changed in the region
    // after the sender's flush, before the server's copy.
    let mut calls = 0;
    let hook = Box::new(move |region: &ucx_sys::Region, k: std::ops::Range<usize>| {
        calls += 1;
        if calls == 2 {
            let mut b = [0u8; 1];
            region.read(k.start, &mut b).expect("read");
            region.write(k.start, &[b[0] ^ 0x5a]).expect("write");
        }
    });
    let server = UcxKvServer::bind_with_hook(rx.clone(), sink, UcxServerConfig::default(), hook).await.expect("bind");
    let blocks: Vec<BlockId> = (10..14).collect();
    let r =
        rx.lock().expect("rx").reserve(blocks, Duration::from_secs(30), tokio::time::Instant::now()).expect("reserve");
    let config = UcxSenderConfig { timeout: Duration::from_secs(3), ..UcxSenderConfig::default() };
    let mut tx = within("handshake", UcxKvSender::connect(server.local_addr(), &me, l, config)).await.expect("connect");
    let side = l.block_elems() * l.dtype.size();
    let (k, v) = (vec![7u8; 4 * side], vec![9u8; 4 * side]);
    within("layer 0", tx.send_layer(r, 0, &k, &v)).await.expect("layer 0");
    // The sender cannot tell: its put and flush succeeded.
    within("layer 1", tx.send_layer(r, 1, &k, &v)).await.expect("layer 1 put");
    match within("the answer to Complete", tx.complete(r)).await {
        Err(TransferError::PeerAbort { reason: AbortReason::Corrupt }) => {}
        other => panic!("expected the transfer refused as corrupt, got {other:?}"),
    }
    let mut stats = server.watch_stats();
    within("the failed range fenced", stats.wait_for(|s| s.ucx.quarantined_ranges == 0 && s.ucx.fences_completed == 1))
        .await
        .expect("server alive");
    let rx = rx.lock().expect("rx");
    assert_eq!(rx.state(r), Some(ReservationState::Failed));
    assert_eq!(rx.counters().refused("checksum"), 1);
    assert_eq!(*written.lock().expect("sink log"), vec![0], "only the clean layer reached the sink");
}
