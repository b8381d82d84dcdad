//! One transport conformance suite: the same test bodies run over tcp
//! (into buffers, and read straight into the pool), quic, local and ucx
//! (landing region) on loopback, and assert the same
//! outcome on each — the sender's error, the receiver's state and released
//! blocks, the server's close reasons and counters, and no leaked block:
//! a whole transfer, a sender's abort, a lease that expires mid-transfer
//! (and the late write after it), a sender that dies, a receiver that dies,
//! and a peer of another version. The corrupt frame is in
//! `conformance_fault.rs` (its fault hook is process-wide).
//!
//! Every wait is bounded ([`within`]); events are awaited (the server's
//! stats watch) or, for receiver state that no event announces, polled.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]

mod common;
mod net;
mod transports;

use std::time::Duration;

use kvtransfer::{
    AbortReason, KvSender, RejectReason, ReleaseCause, Released, Reservation, ReservationState, TransferError,
    TransportKind,
};
use net::{lock, now, peer, within, WAIT};
use transports::{eventually, normal_closes, DecodeSide};
use types::kv::BlockId;

/// Blocks a transfer moves.
const N: usize = 5;
const LEASE: Duration = Duration::from_secs(60);

/// Sends layers `layers` of the source blocks for `r`, one `send_blocks` each.
async fn send_layers(
    tx: &mut KvSender,
    src: &engine::kv::KvPool,
    table: &[BlockId],
    r: Reservation,
    layers: std::ops::Range<usize>,
) -> Result<(), TransferError> {
    for layer in layers {
        let (k, v) = src.gather_layer(layer, table).expect("gather");
        tx.send_blocks(r, layer, 0, &k, &v).await?;
    }
    Ok(())
}

/// Every layer of `dst`'s blocks in the decode pool equals the source's.
fn assert_same_kv(d: &DecodeSide, src: &engine::kv::KvPool, table: &[BlockId], dst: &[BlockId]) {
    let pool = lock(&d.pool);
    for layer in 0..d.layout.n_layers {
        let want = src.gather_layer(layer, table).expect("gather A");
        let got = pool.gather_layer(layer, dst).expect("gather B");
        assert!(got == want, "{}: layer {layer} differs after the transfer", d.kind);
    }
}

/// Layer `layer` of `dst`'s blocks was never written (still the fresh pool's zeros).
fn assert_unwritten(d: &DecodeSide, layer: usize, dst: &[BlockId]) {
    let (k, v) = lock(&d.pool).gather_layer(layer, dst).expect("gather B");
    assert!(k.iter().chain(&v).all(|b| *b == 0), "{}: a refused layer {layer} reached the pool", d.kind);
}

/// The end of every body: the receiver holds nothing and the pool has
/// every block back but the decoys and what the engine took (`taken`).
fn assert_no_leak(d: &DecodeSide, taken: usize) {
    assert_eq!(lock(&d.rx).held_blocks(), 0, "{}: blocks still held by the receiver", d.kind);
    assert_eq!(d.free_blocks(), 32 - 3 - taken, "{}: blocks leaked from the pool", d.kind);
}

/// A whole transfer: every layer lands bit for bit in the reserved blocks,
/// `Complete` is acknowledged, the engine takes the blocks; the sender's
/// close is a normal one and nothing was aborted.
async fn moves_kv_whole(kind: TransportKind, direct: bool) {
    let d = DecodeSide::start_with(kind, direct).await;
    let (src, table) = common::source(d.layout, N, 32);
    let (r, dst) = d.reserve(N, LEASE);
    let mut tx = d.connect_matching().await;
    send_layers(&mut tx, &src, &table, r, 0..d.layout.n_layers).await.expect("layers");
    let ack = within("the Ack", tx.complete(r)).await.expect("complete");
    assert_eq!((ack.reservation, ack.generation), (r.id.0, r.generation));
    assert_eq!(lock(&d.rx).take_ready(r).expect("ready"), dst);
    assert_same_kv(&d, &src, &table, &dst);
    drop(tx);
    let s = d.wait_stats("the sender's close", |s| s.connections_closed() == 1).await;
    assert_eq!((normal_closes(&s), s.aborts_sent, s.sink_failures), (1, 0, 0), "{kind}: {s:?}");
    let in_place = if direct { d.layout.n_layers as u64 } else { 0 };
    assert_eq!(s.layers_read_in_place, in_place, "{kind}: layers read straight into the pool");
    let c = lock(&d.rx).counters().clone();
    assert_eq!((c.reservations_completed, c.reservations_taken, c.frames_refused.iter().sum::<u64>()), (1, 1, 0));
    assert_no_leak(&d, N);
}

/// The sender gives up mid-transfer: the reservation ends `Aborted`, its
/// blocks come back once as `PeerAborted`, and the server tells no abort
/// back (the sender knows).
async fn a_senders_abort_returns_the_blocks_once(kind: TransportKind, direct: bool) {
    let d = DecodeSide::start_with(kind, direct).await;
    let (src, table) = common::source(d.layout, N, 32);
    let (r, dst) = d.reserve(N, LEASE);
    let mut tx = d.connect_matching().await;
    send_layers(&mut tx, &src, &table, r, 0..1).await.expect("layer 0");
    tx.abort(r, AbortReason::Cancelled).await.expect("abort");
    eventually("the reservation aborted", || lock(&d.rx).state(r) == Some(ReservationState::Aborted)).await;
    let released = d.reap(now());
    let want = Released { reservation: r, blocks: dst, cause: ReleaseCause::PeerAborted(AbortReason::Cancelled) };
    assert_eq!(released, [want], "{kind}");
    assert!(d.reap(now()).is_empty(), "{kind}: released twice");
    drop(tx);
    let s = d.wait_stats("the sender's close", |s| s.connections_closed() == 1).await;
    assert_eq!((normal_closes(&s), s.aborts_sent), (1, 0), "{kind}: {s:?}");
    assert_eq!(s.ucx.granted_transfers, 0, "{kind}: a landing range outlived its transfer");
    assert_no_leak(&d, 0);
}

/// The lease ends mid-transfer: the next layer is refused as expired and
/// never reaches the pool, the sender is told once (`LeaseExpired`) and its
/// `Complete` fails with it, and the blocks come back once as expired.
async fn an_expired_lease_refuses_the_late_write(kind: TransportKind, direct: bool) {
    let d = DecodeSide::start_with(kind, direct).await;
    let (src, table) = common::source(d.layout, N, 32);
    let (r, dst) = d.reserve(N, Duration::from_millis(300));
    let mut tx = d.connect_matching().await;
    send_layers(&mut tx, &src, &table, r, 0..1).await.expect("layer 0 within the lease");
    eventually("layer 0 accepted", || lock(&d.rx).counters().layer_frames_accepted > 0).await;
    let lease_end = lock(&d.rx).lease_end(r).expect("live");
    // The condition under test is time itself: wait until the lease has passed.
    tokio::time::sleep_until(lease_end).await;
    // Sent after the lease: refused on arrival. The sender may learn it
    // here already, or at its Complete.
    let late = send_layers(&mut tx, &src, &table, r, 1..d.layout.n_layers).await;
    let err = match late {
        Err(e) => e,
        Ok(()) => within("the refused Complete", tx.complete(r)).await.expect_err("an Ack after the lease"),
    };
    assert!(
        matches!(err, TransferError::PeerAbort { reason: AbortReason::LeaseExpired }),
        "{kind}: the sender got {err:?}"
    );
    assert_eq!(lock(&d.rx).state(r), Some(ReservationState::Expired), "{kind}");
    let s = d.wait_stats("the abort told", |s| s.aborts_sent == 1).await;
    assert_eq!(s.sink_failures, 0);
    assert!(lock(&d.rx).counters().refused("expired") >= 1, "{kind}: no frame refused as expired");
    for layer in 1..d.layout.n_layers {
        assert_unwritten(&d, layer, &dst);
    }
    let released = d.reap(now());
    assert_eq!(released, [Released { reservation: r, blocks: dst, cause: ReleaseCause::LeaseExpired }], "{kind}");
    drop(tx);
    let s = d.wait_stats("the sender's close", |s| s.connections_closed() == 1).await;
    assert_eq!((normal_closes(&s), s.aborts_sent), (1, 1), "{kind}: {s:?}");
    eventually("the landing range fenced", || d.watch_stats().borrow().ucx.quarantined_ranges == 0).await;
    assert_no_leak(&d, 0);
}

/// The sender goes away mid-transfer without a word: its connection ends,
/// the reservation stays until its lease says otherwise, then comes back
/// once as expired. Nothing is aborted by the connection's end alone.
async fn a_dead_sender_leaves_its_blocks_to_the_lease(kind: TransportKind, direct: bool) {
    let d = DecodeSide::start_with(kind, direct).await;
    let (src, table) = common::source(d.layout, N, 32);
    let (r, dst) = d.reserve(N, Duration::from_millis(500));
    let mut tx = d.connect_matching().await;
    send_layers(&mut tx, &src, &table, r, 0..2).await.expect("two layers");
    drop(tx);
    let s = d.wait_stats("the sender's end", |s| s.connections_closed() == 1).await;
    assert_eq!((normal_closes(&s), s.aborts_sent), (1, 0), "{kind}: {s:?}");
    assert_eq!(lock(&d.rx).state(r), Some(ReservationState::Receiving), "{kind}: ended by the connection alone");
    assert!(d.reap(now()).is_empty());
    let lease_end = lock(&d.rx).lease_end(r).expect("live");
    tokio::time::sleep_until(lease_end).await;
    let released = d.reap(now());
    assert_eq!(released, [Released { reservation: r, blocks: dst, cause: ReleaseCause::LeaseExpired }], "{kind}");
    assert_eq!(d.watch_stats().borrow().ucx.granted_transfers, 0, "{kind}: the sender's landing range is held");
    assert_no_leak(&d, 0);
}

/// The decode side goes away mid-transfer: the sender's next call fails
/// with a typed error in bounded time, never a hang and never an `Ack`.
async fn a_dead_receiver_is_a_typed_error_in_bounded_time(kind: TransportKind, direct: bool) {
    let mut d = DecodeSide::start_with(kind, direct).await;
    let (src, table) = common::source(d.layout, N, 32);
    let (r, _dst) = d.reserve(N, LEASE);
    let mut tx = d.connect_matching().await;
    send_layers(&mut tx, &src, &table, r, 0..1).await.expect("layer 0");
    d.stop();
    let failed = async {
        match send_layers(&mut tx, &src, &table, r, 1..d.layout.n_layers).await {
            Err(e) => e,
            Ok(()) => tx.complete(r).await.expect_err("an Ack from a stopped server"),
        }
    };
    let err = tokio::time::timeout(WAIT, failed).await.unwrap_or_else(|_| panic!("{kind}: no error within {WAIT:?}"));
    assert!(
        !matches!(err, TransferError::Rejected { .. } | TransferError::Layer(_)),
        "{kind}: a dead receiver reported as {err:?}"
    );
    // The receiver itself still holds the reservation: the decode worker
    // that owns it is gone with its server or expires it by lease.
    assert_eq!(lock(&d.rx).state(r), Some(ReservationState::Receiving));
}

/// A sender of another version group, then of another layout fingerprint,
/// is refused by its hello: the sender gets `Rejected` with the reason, the
/// server counts `rejected` closes and the receiver the rejections, and no
/// block is touched.
async fn a_peer_of_another_version_is_refused_by_its_hello(kind: TransportKind, direct: bool) {
    let d = DecodeSide::start_with(kind, direct).await;
    let l = d.layout;
    for (p, reason) in
        [(peer(&l, "other", 0x11), RejectReason::VersionGroup), (peer(&l, "smollm2", 0x99), RejectReason::Fingerprint)]
    {
        match d.connect(&p).await {
            Err(TransferError::Rejected { reason: got }) => assert_eq!(got, reason, "{kind}"),
            other => panic!("{kind}: a {reason:?} mismatch gave {other:?}"),
        }
    }
    let s = d.wait_stats("two rejections counted", |s| s.closed_by("rejected") == 2).await;
    // Accepted as they came, closed as refused: nothing is left open.
    assert_eq!((s.connections_accepted, s.connections_closed(), s.aborts_sent), (2, 2, 0), "{kind}: {s:?}");
    let c = lock(&d.rx).counters().clone();
    let rejected = (c.hello_rejected(RejectReason::VersionGroup), c.hello_rejected(RejectReason::Fingerprint));
    assert_eq!((rejected, c.hello_accepted), ((1, 1), 0), "{kind}");
    assert_no_leak(&d, 0);
}

/// One test per (body, transport): `transport::body`.
macro_rules! conformance {
    ($($body:ident),* $(,)?) => {
        mod tcp { $( #[tokio::test] async fn $body() { super::$body(kvtransfer::TransportKind::Tcp, false).await } )* }
        mod tcp_direct { $( #[tokio::test] async fn $body() { super::$body(kvtransfer::TransportKind::Tcp, true).await } )* }
        mod quic { $( #[tokio::test] async fn $body() { super::$body(kvtransfer::TransportKind::Quic, false).await } )* }
        mod local { $( #[tokio::test] async fn $body() { super::$body(kvtransfer::TransportKind::Local, false).await } )* }
        mod ucx { $( #[tokio::test] async fn $body() { super::$body(kvtransfer::TransportKind::Ucx, false).await } )* }
    };
}

conformance!(
    moves_kv_whole,
    a_senders_abort_returns_the_blocks_once,
    an_expired_lease_refuses_the_late_write,
    a_dead_sender_leaves_its_blocks_to_the_lease,
    a_dead_receiver_is_a_typed_error_in_bounded_time,
    a_peer_of_another_version_is_refused_by_its_hello,
);
