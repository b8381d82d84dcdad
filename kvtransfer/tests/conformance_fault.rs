//! The transport conformance suite's corrupt frame (see `conformance.rs`):
//! one byte of a transfer's first frame flipped after the sender took its
//! checksum, through the one fault hook every sender calls there. The hook
//! is armed process-wide, so the four transports run one after another in
//! one test, and this binary holds nothing else.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]

mod common;
mod net;
mod transports;

use std::time::Duration;

use engine::kv::KvPool;
use kvtransfer::transport::fault;
use kvtransfer::transport::PoolMemory;
use kvtransfer::{AbortReason, PinnedLayer, ReleaseCause, Released, ReservationState, TransferError, TransportKind};
use net::{lock, now, within};
use transports::{normal_closes, DecodeSide};

/// Over every transport: the corrupted layer is refused by its checksum and
/// never reaches the pool, the reservation fails, the sender is told once
/// (`Corrupt`) and its `Complete` fails with it, and the blocks come back
/// once as corrupt.
#[tokio::test]
async fn a_corrupt_frame_fails_the_reservation_on_every_transport() {
    // (transport, read straight into the pool, sent straight from a mapped pool)
    let runs = TransportKind::ALL
        .into_iter()
        .map(|k| (k, false, false))
        .chain([(TransportKind::Tcp, true, false), (TransportKind::Tcp, true, true)]);
    for (i, (kind, direct, pinned)) in runs.enumerate() {
        let d = DecodeSide::start_with(kind, direct).await;
        let (src, table) = common::source(d.layout, 5, 32);
        let (r, dst) = d.reserve(5, Duration::from_secs(60));
        let mut tx = d.connect_matching().await;
        // The pinned sender's source: the same KV in a pool in mapped memory.
        let mapped = pinned.then(|| {
            let memory = PoolMemory::new(d.layout, 32).expect("pool memory");
            let view = memory.direct();
            let mut pool = KvPool::new(d.layout, 32).expect("pool");
            pool.adopt(memory.into_shared()).expect("adopt");
            let blocks = pool.allocate(5).expect("blocks");
            for layer in 0..d.layout.n_layers {
                let (k, v) = src.gather_layer(layer, &table).expect("gather");
                pool.scatter_layer(layer, &blocks, &k, &v).expect("scatter");
            }
            (pool, view, blocks)
        });
        fault::arm_corrupt(1, || {});
        let mut sent = Ok(());
        for layer in 0..d.layout.n_layers {
            sent = match &mapped {
                Some((pool, view, blocks)) => {
                    let (k, v) = pool.layer_bytes(layer).expect("layer bytes");
                    let max_frame = tx.pinned_frames().expect("tcp sends pinned layers");
                    let p = PinnedLayer::new(&d.layout, layer, 0, blocks, k, v, max_frame).expect("pinned");
                    tx.send_pinned(r, &p, view).await
                }
                None => {
                    let (k, v) = src.gather_layer(layer, &table).expect("gather");
                    tx.send_blocks(r, layer, 0, &k, &v).await
                }
            };
            if sent.is_err() {
                break;
            }
        }
        let err = match sent {
            Err(e) => e,
            Ok(()) => within("the refused Complete", tx.complete(r)).await.expect_err("an Ack for corrupt KV"),
        };
        assert_eq!(fault::corrupted(), i as u64 + 1, "{kind}: the first frame was not corrupted");
        assert!(matches!(err, TransferError::PeerAbort { reason: AbortReason::Corrupt }), "{kind}: got {err:?}");
        assert_eq!(lock(&d.rx).state(r), Some(ReservationState::Failed), "{kind}");
        assert_eq!(lock(&d.rx).counters().refused("checksum"), 1, "{kind}");
        // Read straight into the pool, a payload is there before its checksum is
        // checked: the failed reservation's blocks go back to the pool unused.
        if !direct {
            let (k, _) = lock(&d.pool).gather_layer(0, &dst).expect("gather B");
            assert!(k.iter().all(|b| *b == 0), "{kind}: the corrupt layer reached the pool");
        }
        let released = d.reap(now());
        assert_eq!(released, [Released { reservation: r, blocks: dst, cause: ReleaseCause::Corrupt }], "{kind}");
        drop(tx);
        let s = d.wait_stats("the sender's close", |s| s.connections_closed() == 1).await;
        assert_eq!((normal_closes(&s), s.aborts_sent, s.sink_failures), (1, 1, 0), "{kind}: {s:?}");
        assert_eq!(lock(&d.rx).held_blocks(), 0, "{kind}");
        assert_eq!(d.free_blocks(), 32 - 3, "{kind}: blocks leaked");
    }
}
