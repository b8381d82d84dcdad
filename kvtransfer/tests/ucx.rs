//! The UCX transport on loopback: KV put into the decode side's landing
//! region reaches the pool byte-exact through the receiver, a reservation
//! that ends unfinished holds its landing range in quarantine until its
//! sender is fenced, and every failure is a typed error in bounded time.
//!
//! UCX picks its transports from the environment: with `UCX_TLS` unset it
//! uses shared memory and CMA between these two in-process workers (TCP on
//! `lo` is there too); `UCX_TLS=tcp` runs the same tests over TCP.
//! `UCX_NET_DEVICES` is set to `lo` unless the caller set it. Every wait is
//! bounded and named; events are awaited on the server's stats watch.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]

mod common;
mod net;

use net::{layout, lock, now, peer, side, within, WAIT};

use std::sync::{Arc, Mutex, Once};
use std::time::Duration;

use engine::kv::KvPool;

use kvtransfer::{
    AbortReason, ErrorKind, LandingRefusal, Peer, Receiver, ReceiverConfig, RejectReason, ReleaseCause, Reservation,
    ReservationState, TransferError, UcxKvSender, UcxKvServer, UcxSenderConfig, UcxServerConfig, UcxServerStats,
};
use types::kv::{BlockId, KvLayout};

fn ucx_env() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        if std::env::var_os("UCX_NET_DEVICES").is_none() {
            std::env::set_var("UCX_NET_DEVICES", "lo");
        }
    });
}

/// Landing bytes of one reservation of `n` blocks.
fn landing_of(l: &KvLayout, n: usize) -> usize {
    l.n_layers * n * 2 * side(l)
}

struct DecodeSide {
    layout: KvLayout,
    rx: Arc<Mutex<Receiver>>,
    pool: Arc<Mutex<KvPool>>,
    server: UcxKvServer,
}

impl DecodeSide {
    async fn start(config: UcxServerConfig) -> Self {
        ucx_env();
        let l = layout();
        let rx = Arc::new(Mutex::new(Receiver::new(peer(&l, "smollm2", 0x11), ReceiverConfig::new(l)).expect("rx")));
        let pool = Arc::new(Mutex::new(KvPool::new(l, 32).expect("pool B")));
        let server = within("the UCX server up", UcxKvServer::bind(rx.clone(), pool.clone(), config)).await;
        let mut server = server.expect("bind");
        if let Some(memory) = server.pool_memory() {
            // As the decode worker does: the pool moves into UCX memory, then direct writes start.
            lock(&pool).adopt(memory.into_shared()).expect("the pool adopts the UCX memory");
            server.enable_direct();
        }
        let _decoys = lock(&pool).allocate(3).expect("decoys");
        Self { layout: l, rx, pool, server }
    }

    /// A server whose pool (32 blocks) is in UCX memory, written directly by senders on this host.
    async fn start_direct() -> Self {
        Self::start(UcxServerConfig { pool_blocks: Some(32), ..UcxServerConfig::default() }).await
    }

    fn reserve(&self, n: usize, ttl: Duration) -> (Reservation, Vec<BlockId>) {
        let blocks = lock(&self.pool).allocate(n).expect("alloc B");
        (lock(&self.rx).reserve(blocks.clone(), ttl, now()).expect("reserve"), blocks)
    }

    async fn wait_stats(&self, what: &str, pred: impl FnMut(&UcxServerStats) -> bool) -> UcxServerStats {
        let mut w = self.server.watch_stats();
        let s = within(what, w.wait_for(pred)).await.expect("server alive").clone();
        s
    }

    async fn connect(&self, p: &Peer) -> Result<UcxKvSender, TransferError> {
        self.connect_with(p, true).await
    }

    /// With [`UcxSenderConfig::mapped_stores`] as given.
    async fn connect_with(&self, p: &Peer, mapped_stores: bool) -> Result<UcxKvSender, TransferError> {
        let config = UcxSenderConfig { timeout: Duration::from_secs(3), mapped_stores, ..UcxSenderConfig::default() };
        within("handshake", UcxKvSender::connect(self.server.local_addr(), p, self.layout, config)).await
    }

    /// Frees what `poll_released` hands back, as the decode worker's reaper does.
    fn reap(&self, at: tokio::time::Instant) -> Vec<kvtransfer::Released> {
        let released = lock(&self.rx).poll_released(at);
        for r in &released {
            lock(&self.pool).release(&r.blocks).expect("release");
        }
        released
    }
}

/// Polls `cond` (every 5 ms) until it holds; fails the test after [`WAIT`].
async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    within(what, async {
        while !cond() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
}

async fn send_layers(tx: &mut UcxKvSender, pool: &KvPool, table: &[BlockId], r: Reservation, layers: &[usize]) {
    for &layer in layers {
        let (k, v) = pool.gather_layer(layer, table).expect("gather layer");
        within("a layer sent", tx.send_layer(r, layer, &k, &v)).await.expect("send layer");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_lands_byte_exact_through_the_landing_region() {
    transfer_lands_byte_exact(true, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_lands_byte_exact_through_the_landing_region_with_puts_only() {
    transfer_lands_byte_exact(false, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_transfer_lands_byte_exact_in_its_pool_blocks() {
    transfer_lands_byte_exact(true, true).await;
}

/// The direct path with the gather removed: a `UcxDirectWriter` stores
/// layers from the sender's own pool straight into the reservation's pool
/// blocks (sources out of order and in two pieces, beside a layer the
/// connection's thread stores), byte-exact; shapes that do not fit store
/// nothing; `Complete`, `Abort` and the sender's end revoke it, and a store
/// after that is refused and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_writer_stores_from_the_senders_pool_until_its_grant_is_revoked() {
    let d = DecodeSide::start_direct().await;
    let l = d.layout;
    let (pool_a, table) = common::source(l, 5, 32);
    // Sources out of order, so the copies run in pieces: 0 1 | 3 | 2 | 4.
    let table_a = vec![table[0], table[1], table[3], table[2], table[4]];
    let (r, table_b) = d.reserve(5, Duration::from_secs(30));
    let mut tx = d.connect(&peer(&l, "smollm2", 0x11)).await.expect("connect");
    let w = within("a writer", tx.direct_writer(r)).await.expect("direct_writer");
    if !common::shared_lanes(&tx) {
        // No shared-memory lane to the server (a UCX_TLS without one): nothing to map.
        assert!(w.is_none(), "a writer without a mapping, over {:?}", tx.transports());
        return;
    }
    let w = w.expect("a writer where UCX maps the pool");
    assert_eq!((w.reservation(), w.is_live()), (r, true));
    // Layer 0 by the connection's thread, as a layer computed before the writer came.
    send_layers(&mut tx, &pool_a, &table_a, r, &[0]).await;
    let before = lock(&d.pool).gather(&table_b).expect("gather B");
    let (k, v) = pool_a.layer_bytes(1).expect("layer bytes");
    let bad = [
        w.store_layer(l.n_layers, 0, k, v, &table_a),
        w.store_layer(1, 3, k, v, &table_a[..3]),
        w.store_layer(1, 0, k, &v[1..], &table_a),
        w.store_layer(1, 0, k, v, &[31, 32]),
        w.store_layer(1, 0, k, v, &[]),
    ];
    for (i, e) in bad.into_iter().enumerate() {
        assert!(matches!(e, Err(TransferError::Layer(_))), "bad store {i}: {e:?}");
    }
    assert_eq!(lock(&d.pool).gather(&table_b).expect("gather B"), before, "a refused store wrote");
    for layer in 1..l.n_layers {
        let (k, v) = pool_a.layer_bytes(layer).expect("layer bytes");
        let stored = if layer == 2 {
            let s1 = w.store_layer(2, 0, k, v, &table_a[..2]).expect("piece 1");
            let s2 = w.store_layer(2, 2, k, v, &table_a[2..]).expect("piece 2");
            within("announce", tx.announce(vec![s1])).await.expect("announce piece 1");
            s2
        } else {
            w.store_layer(layer, 0, k, v, &table_a).expect("store")
        };
        assert_eq!((stored.reservation, stored.layer), (r, layer));
        within("announce", tx.announce(vec![stored])).await.expect("announce");
    }
    assert_eq!(lock(&d.rx).state(r), Some(ReservationState::Receiving), "not readable before Complete");
    within("Ack", tx.complete(r)).await.expect("complete");
    assert!(!w.is_live(), "Complete revokes the writer");
    assert_eq!(lock(&d.rx).take_ready(r).expect("ready after Ack"), table_b);
    let moved = pool_a.gather(&table_a).expect("gather A");
    assert_eq!(lock(&d.pool).gather(&table_b).expect("gather B"), moved, "byte-exact");
    let (k, v) = pool_a.layer_bytes(0).expect("layer bytes");
    let late = w.store_layer(0, 0, k, v, &table);
    assert!(matches!(late, Err(TransferError::Revoked { .. })), "{late:?}");
    assert_eq!(lock(&d.pool).gather(&table_b).expect("gather B"), moved, "a revoked store wrote");
    let bytes = (l.n_layers * 5 * 2 * side(&l)) as u64;
    assert_eq!((tx.bytes_sent(), lock(&d.rx).counters().payload_bytes_accepted), (bytes, bytes));
    // Every send but the connection thread's layer 0 went through the writer; all direct.
    assert_eq!((tx.mapped_layers(), tx.direct_layers()), (l.n_layers as u64 + 1, l.n_layers as u64 + 1));
    let s = d.wait_stats("the layers checked", |s| s.ucx.direct_layers == l.n_layers as u64 + 1).await;
    assert_eq!((s.ucx.direct_grants, s.aborts_sent, s.ucx.quarantined_blocks), (1, 0, 0));

    // Abort revokes too, and so does the sender's end.
    let (r2, _) = d.reserve(2, Duration::from_secs(30));
    let w2 = within("a writer", tx.direct_writer(r2)).await.expect("direct_writer").expect("a writer");
    let (k, v) = pool_a.layer_bytes(0).expect("layer bytes");
    within("announce", tx.announce(vec![w2.store_layer(0, 0, k, v, &table[..2]).expect("store")]))
        .await
        .expect("announce");
    within("Abort", tx.abort(r2, AbortReason::PrefillFailed)).await.expect("abort");
    assert!(!w2.is_live(), "Abort revokes the writer");
    let (r3, _) = d.reserve(2, Duration::from_secs(30));
    let w3 = within("a writer", tx.direct_writer(r3)).await.expect("direct_writer").expect("a writer");
    drop(tx);
    d.wait_stats("the sender's Bye", |s| s.closed_by("bye") == 1).await;
    assert!(!w3.is_live(), "the sender's end revokes its writers");
    assert!(matches!(w3.store_layer(0, 0, k, v, &table[..2]), Err(TransferError::Revoked { .. })));
}

/// One transfer of 5 blocks (31 sends: every layer, one of them in two
/// pieces): byte-exact, counted on both sides, nothing left behind; stored
/// through the mapped landing region where UCX reaches the server through
/// shared memory and `mapped_stores` is on, put otherwise; with `direct`
/// (the pool in UCX memory) stored straight into the reservation's pool
/// blocks where UCX maps them.
async fn transfer_lands_byte_exact(mapped_stores: bool, direct: bool) {
    let d = if direct { DecodeSide::start_direct().await } else { DecodeSide::start(UcxServerConfig::default()).await };
    let l = d.layout;
    let (pool_a, table_a) = common::source(l, 5, 32);
    let (r, table_b) = d.reserve(5, Duration::from_secs(30));
    assert_ne!(table_a, table_b, "the test must move KV between different ids");

    let mut tx = d.connect_with(&peer(&l, "smollm2", 0x11), mapped_stores).await.expect("connect");
    // Layers in reverse, and layer 1 in two pieces (blocks 0..3, then 3..5), as
    // the prefill engine streams newly complete blocks.
    for layer in (0..l.n_layers).rev() {
        let (k, v) = pool_a.gather_layer(layer, &table_a).expect("gather");
        if layer == 1 {
            let cut = 3 * side(&l);
            within("piece", tx.send_blocks(r, 1, 0, &k[..cut], &v[..cut])).await.expect("piece 1");
            within("piece", tx.send_blocks(r, 1, 3, &k[cut..], &v[cut..])).await.expect("piece 2");
        } else {
            within("a layer sent", tx.send_layer(r, layer, &k, &v)).await.expect("send layer");
        }
    }
    assert_eq!(lock(&d.rx).state(r), Some(ReservationState::Receiving), "not readable before Complete");
    let ack = within("Ack", tx.complete(r)).await.expect("complete");
    assert_eq!((ack.reservation, ack.generation), (r.id.0, r.generation));
    assert_eq!(lock(&d.rx).take_ready(r).expect("ready after Ack"), table_b);

    for layer in 0..l.n_layers {
        let a = pool_a.gather_layer(layer, &table_a).expect("gather A");
        let b = lock(&d.pool).gather_layer(layer, &table_b).expect("gather B");
        assert_eq!(a, b, "layer {layer} differs after the transfer");
    }
    let sends = l.n_layers as u64 + 1;
    let mapped = mapped_stores && common::shared_lanes(&tx);
    let want = if mapped { sends } else { 0 };
    assert_eq!(tx.mapped_layers(), want, "sends stored through the mapping, over {:?}", tx.transports());
    let want_direct = if mapped && direct { sends } else { 0 };
    assert_eq!(tx.direct_layers(), want_direct, "sends stored in the pool blocks, over {:?}", tx.transports());
    let bytes = (l.n_layers * 5 * 2 * side(&l)) as u64;
    assert_eq!(tx.bytes_sent(), bytes, "sender: blocks x block bytes");
    assert_eq!(lock(&d.rx).counters().payload_bytes_accepted, bytes, "receiver: blocks x block bytes");
    let s = d.wait_stats("the range freed", |s| s.ucx.landing_in_use_bytes == 0).await;
    let (landing, pool) = if want_direct > 0 { (0, 1) } else { (1, 0) };
    assert_eq!((s.ucx.grants, s.ucx.direct_grants, s.ucx.direct_layers), (landing, pool, want_direct));
    assert_eq!((s.aborts_sent, s.ucx.quarantined_ranges, s.ucx.quarantined_blocks), (0, 0, 0));
    drop(tx);
    d.wait_stats("the sender's Bye", |s| s.closed_by("bye") == 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layout_or_group_mismatch_is_refused_before_any_key_or_byte_moves() {
    let d = DecodeSide::start(UcxServerConfig::default()).await;
    let l = d.layout;
    match d.connect(&peer(&l, "smollm2", 0x99)).await {
        Err(e @ TransferError::Rejected { reason: RejectReason::Fingerprint }) => {
            assert_eq!(e.kind(), ErrorKind::VersionMismatch)
        }
        other => panic!("expected a fingerprint rejection, got {other:?}"),
    }
    match d.connect(&peer(&l, "llama-8b", 0x11)).await {
        Err(TransferError::Rejected { reason: RejectReason::VersionGroup }) => {}
        other => panic!("expected a version-group rejection, got {other:?}"),
    }
    let s = d.wait_stats("two rejections", |s| s.closed_by("rejected") == 2).await;
    assert_eq!((s.connections_accepted, s.ucx.grants, s.ucx.landing_in_use_bytes), (2, 0, 0));
    let c = lock(&d.rx).counters().clone();
    assert_eq!((c.hello_accepted, c.layer_frames_accepted, c.payload_bytes_accepted), (0, 0, 0));
}

/// The fence: a reservation whose lease ran out while its sender still held
/// a landing range keeps that range out of use until the sender is fenced —
/// it flushes and says so when it next acts, or it goes away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_reservations_range_is_quarantined_until_its_sender_is_fenced() {
    let l = layout();
    // Room for exactly one 4-block reservation.
    let config = UcxServerConfig { landing_bytes: landing_of(&l, 4), ..UcxServerConfig::default() };
    let d = DecodeSide::start(config).await;
    let (pool_a, table_a) = common::source(l, 4, 32);
    let ttl = Duration::from_secs(30);
    let me = peer(&l, "smollm2", 0x11);

    // 1: a sender puts one layer, then stalls past the lease.
    let (r1, _) = d.reserve(4, ttl);
    let mut stalled = d.connect(&me).await.expect("connect");
    send_layers(&mut stalled, &pool_a, &table_a, r1, &[0]).await;
    eventually("layer 0 accepted", || lock(&d.rx).counters().layer_frames_accepted == 1).await;
    let released = d.reap(now() + ttl + Duration::from_millis(1));
    assert_eq!(released.len(), 1);
    assert_eq!(released[0].cause, ReleaseCause::LeaseExpired, "blocks back to the pool at once");
    let s = d.wait_stats("the range quarantined", |s| s.ucx.quarantined_ranges == 1).await;
    assert_eq!(s.ucx.quarantined_bytes as usize, landing_of(&l, 4));

    // Another transfer cannot have those bytes: back-pressure, typed.
    let (r2, table_b) = d.reserve(4, ttl);
    let mut other = d.connect(&me).await.expect("connect");
    let (k, v) = pool_a.gather_layer(0, &table_a).expect("gather");
    match within("refusal", other.send_layer(r2, 0, &k, &v)).await {
        Err(e @ TransferError::Landing { refusal: LandingRefusal::Full }) => {
            assert_eq!(e.kind(), ErrorKind::Overloaded)
        }
        other => panic!("expected landing_full while the range is quarantined, got {other:?}"),
    }
    assert_eq!(d.server.stats().ucx.quarantined_ranges, 1, "still quarantined: the stalled sender was not fenced");

    // The stalled sender resumes. Its late layer, if put before it heard of
    // the expiry, lands in the quarantined range and goes no further; at the
    // latest its Complete learns of the expiry, and it flushes and fences.
    match within("the late layer", stalled.send_layer(r1, 1, &k, &v)).await {
        Ok(()) | Err(TransferError::PeerAbort { reason: AbortReason::LeaseExpired }) => {}
        other => panic!("expected the late layer put or refused as lease_expired, got {other:?}"),
    }
    match within("the late Complete", stalled.complete(r1)).await {
        Err(TransferError::PeerAbort { reason: AbortReason::LeaseExpired }) => {}
        other => panic!("expected the late transfer refused as lease_expired, got {other:?}"),
    }
    let s = d.wait_stats("the fence completed", |s| s.ucx.quarantined_ranges == 0 && s.ucx.fences_completed == 1).await;
    assert_eq!(s.ucx.landing_in_use_bytes, 0);
    assert_eq!(lock(&d.rx).counters().layer_frames_accepted, 1, "the late layer never reached the receiver");

    // Now the other transfer gets the range and lands.
    send_layers(&mut other, &pool_a, &table_a, r2, &(0..l.n_layers).collect::<Vec<_>>()).await;
    within("Ack", other.complete(r2)).await.expect("complete");
    assert_eq!(lock(&d.rx).take_ready(r2).expect("ready"), table_b);

    // 2: a sender that never acts again is fenced by closing its endpoint.
    let (r3, _) = d.reserve(4, ttl);
    let mut silent = d.connect(&me).await.expect("connect");
    send_layers(&mut silent, &pool_a, &table_a, r3, &[2]).await;
    let blocks = lock(&d.rx).abort(r3).expect("the decode side cancels");
    lock(&d.pool).release(&blocks).expect("release");
    d.wait_stats("the cancelled range quarantined", |s| s.ucx.quarantined_ranges == 1).await;
    drop(silent);
    let closed = |s: &UcxServerStats| s.ucx.quarantined_ranges == 0 && s.closed_by("bye") >= 1;
    let s = d.wait_stats("released by the sender's close", closed).await;
    assert_eq!((s.ucx.fences_completed, s.ucx.landing_in_use_bytes), (2, 0));
    assert_eq!(lock(&d.rx).held_blocks(), 0);
}

/// The fence of the direct path, in one process: a sender writing pool
/// blocks stalls past its lease; its blocks stay out of the pool (however
/// the reservation ended) while another transfer runs, and come back only
/// once the sender fenced. Its late layer lands in its own quarantined
/// blocks, never in the other transfer's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_direct_reservations_blocks_stay_out_of_the_pool_until_its_sender_is_fenced() {
    let d = DecodeSide::start_direct().await;
    let l = d.layout;
    let (pool_a, table_a) = common::source(l, 4, 32);
    let ttl = Duration::from_secs(30);
    let me = peer(&l, "smollm2", 0x11);
    let free_before = lock(&d.pool).available();

    let (r1, blocks1) = d.reserve(4, ttl);
    let mut stalled = d.connect(&me).await.expect("connect");
    send_layers(&mut stalled, &pool_a, &table_a, r1, &[0]).await;
    eventually("layer 0 accepted", || lock(&d.rx).counters().layer_frames_accepted == 1).await;
    if !common::shared_lanes(&stalled) {
        // No shared memory between the workers (e.g. UCX_TLS=tcp): the landing
        // region's own test covers this fence; nothing went to the pool directly.
        assert_eq!((stalled.direct_layers(), d.server.stats().ucx.direct_grants), (0, 0));
        return;
    }
    assert_eq!(stalled.direct_layers(), 1);
    // The lease runs out: nothing comes back to the pool yet.
    assert!(d.reap(now() + ttl + Duration::from_millis(1)).is_empty(), "blocks held for the fence");
    assert_eq!(lock(&d.rx).state(r1), Some(ReservationState::Expired));
    let s = d.wait_stats("the blocks quarantined", |s| s.ucx.quarantined_blocks == 4).await;
    assert_eq!(s.ucx.direct_grants, 1);
    assert_eq!(lock(&d.pool).available(), free_before - 4, "the pool cannot hand them out");

    // Another transfer, meanwhile, gets other blocks and lands byte-exact.
    let (r2, table_b) = d.reserve(4, ttl);
    assert!(table_b.iter().all(|b| !blocks1.contains(b)), "quarantined blocks are not reused");
    let mut other = d.connect(&me).await.expect("connect");
    send_layers(&mut other, &pool_a, &table_a, r2, &(0..l.n_layers).collect::<Vec<_>>()).await;
    within("Ack", other.complete(r2)).await.expect("complete");
    assert_eq!(lock(&d.rx).take_ready(r2).expect("ready"), table_b);

    // The stalled sender resumes: its late layer goes to its own quarantined
    // blocks or is refused; its Complete learns of the expiry; it fences.
    let (k, v) = pool_a.gather_layer(1, &table_a).expect("gather");
    match within("the late layer", stalled.send_layer(r1, 1, &k, &v)).await {
        Ok(()) | Err(TransferError::PeerAbort { reason: AbortReason::LeaseExpired }) => {}
        other => panic!("expected the late layer stored or refused as lease_expired, got {other:?}"),
    }
    match within("the late Complete", stalled.complete(r1)).await {
        Err(TransferError::PeerAbort { reason: AbortReason::LeaseExpired }) => {}
        other => panic!("expected the late transfer refused as lease_expired, got {other:?}"),
    }
    let s = d.wait_stats("the fence completed", |s| s.ucx.quarantined_blocks == 0 && s.ucx.fences_completed == 1).await;
    assert_eq!(s.ucx.landing_in_use_bytes, 0);
    let released = d.reap(now());
    assert_eq!(released.len(), 1);
    assert_eq!((released[0].cause, &released[0].blocks), (ReleaseCause::LeaseExpired, &blocks1));
    for layer in 0..l.n_layers {
        let a = pool_a.gather_layer(layer, &table_a).expect("gather A");
        let b = lock(&d.pool).gather_layer(layer, &table_b).expect("gather B");
        assert_eq!(a, b, "layer {layer} of the other transfer changed");
    }
    lock(&d.pool).release(&table_b).expect("release");
    assert_eq!(lock(&d.pool).available(), free_before);

    // A cancelled direct reservation: `abort` hands back nothing until the
    // sender's close fences it.
    let (r3, _) = d.reserve(4, ttl);
    let mut silent = d.connect(&me).await.expect("connect");
    send_layers(&mut silent, &pool_a, &table_a, r3, &[2]).await;
    assert_eq!(lock(&d.rx).abort(r3).expect("the decode side cancels"), Vec::<BlockId>::new());
    d.wait_stats("the cancelled blocks quarantined", |s| s.ucx.quarantined_blocks == 4).await;
    drop(silent);
    d.wait_stats("released by the sender's close", |s| s.ucx.quarantined_blocks == 0).await;
    assert_eq!(d.reap(now()).len(), 1);
    assert_eq!((lock(&d.rx).held_blocks(), lock(&d.pool).available()), (0, free_before));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_peers_give_typed_errors_in_bounded_time_and_leak_nothing() {
    let d = DecodeSide::start(UcxServerConfig::default()).await;
    let l = d.layout;
    let (pool_a, table_a) = common::source(l, 3, 32);
    let me = peer(&l, "smollm2", 0x11);
    let free_before = lock(&d.pool).available();

    // The sender goes away mid-transfer: the lease returns the blocks once,
    // and its close frees its landing range.
    let ttl = Duration::from_secs(30);
    let (r, _) = d.reserve(3, ttl);
    let mut tx = d.connect(&me).await.expect("connect");
    send_layers(&mut tx, &pool_a, &table_a, r, &[0, 1]).await;
    drop(tx);
    d.wait_stats("the sender's close", |s| s.closed_by("bye") == 1 && s.ucx.landing_in_use_bytes == 0).await;
    assert_eq!(lock(&d.rx).state(r), Some(ReservationState::Receiving), "never readable without Complete");
    let released = d.reap(now() + ttl);
    assert_eq!(released.len(), 1);
    assert!(d.reap(now() + ttl).is_empty(), "blocks come back exactly once");
    assert_eq!(lock(&d.pool).available(), free_before, "every reserved block is back in the pool");

    // The decode side goes away: the sender's next step fails, typed, within its timeout.
    let (r2, _) = d.reserve(3, ttl);
    let mut tx = d.connect(&me).await.expect("connect");
    let DecodeSide { server, .. } = d;
    server.shutdown();
    let (k, v) = pool_a.gather_layer(0, &table_a).expect("gather");
    let started = tokio::time::Instant::now();
    match within("the sender giving up", tx.send_layer(r2, 0, &k, &v)).await {
        Err(e @ (TransferError::Timeout { .. } | TransferError::Io(_))) => {
            assert!(matches!(e.kind(), ErrorKind::Deadline | ErrorKind::Retryable), "{e}")
        }
        other => panic!("expected a timeout or connection error, got {other:?}"),
    }
    assert!(started.elapsed() < WAIT, "bounded by the sender's timeout");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_side_lost_after_the_grant_fails_the_transfer_by_its_complete_at_the_latest() {
    // A layer's send returns once its puts are posted; its flush and
    // completion message go out afterwards. When those fail, the failure
    // must reach the caller on a later call for the same reservation, never
    // be lost: this transfer can only end in a typed error.
    let d = DecodeSide::start(UcxServerConfig::default()).await;
    let l = d.layout;
    let (pool_a, table_a) = common::source(l, 3, 32);
    let me = peer(&l, "smollm2", 0x11);
    let (r, _) = d.reserve(3, Duration::from_secs(30));
    let mut tx = d.connect(&me).await.expect("connect");
    send_layers(&mut tx, &pool_a, &table_a, r, &[0]).await;
    let DecodeSide { server, .. } = d;
    server.shutdown();
    let started = tokio::time::Instant::now();
    let failure = common::ucx_failure_after_loss(&mut tx, &pool_a, &table_a, r, 1..l.n_layers).await;
    assert!(matches!(failure.kind(), ErrorKind::Deadline | ErrorKind::Retryable), "{failure}");
    assert!(started.elapsed() < WAIT, "bounded by the sender's timeout");
}
