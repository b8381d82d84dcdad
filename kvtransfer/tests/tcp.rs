//! The TCP transport on real loopback sockets: KV from one engine pool lands
//! in another pool's reserved blocks, and every failure ends in a typed
//! error and blocks that come back exactly once.
//!
//! Every wait is bounded by a timeout whose message says what did not
//! happen; events are awaited (server stats watch, socket reads), never slept for.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]

mod common;
mod net;

use net::{layout, lock, now, peer, side, within, WAIT};

use std::sync::{Arc, Mutex};
use std::time::Duration;

use engine::kv::KvPool;

use kvtransfer::frame::LAYER_DATA_OVERHEAD;
use kvtransfer::transport::{DirectPool, PoolMemory};
use kvtransfer::{
    AbortReason, Complete, DecodeLimits, Decoded, Frame, Hello, LayerData, Peer, PinnedLayer, Receiver, ReceiverConfig,
    RejectReason, ReleaseCause, Reservation, ReservationState, TcpKvSender, TcpKvServer, TcpSenderConfig,
    TcpServerConfig, TcpServerStats, TransferError, PROTOCOL_VERSION,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use types::kv::{BlockId, KvLayout};

/// Prefill side: `n` blocks of known K/V values.
fn source(l: KvLayout, n: usize) -> (KvPool, Vec<BlockId>) {
    common::source(l, n, 32)
}

/// Decode side: a receiver, a pool with some decoy blocks taken, and a server.
struct DecodeSide {
    layout: KvLayout,
    rx: Arc<Mutex<Receiver>>,
    pool: Arc<Mutex<KvPool>>,
    server: TcpKvServer,
}

impl DecodeSide {
    async fn start(config: TcpServerConfig) -> Self {
        Self::start_with(config, false).await
    }

    /// `direct`: the pool in memory the server reads payloads straight into.
    async fn start_with(mut config: TcpServerConfig, direct: bool) -> Self {
        let l = layout();
        let rx = Arc::new(Mutex::new(Receiver::new(peer(&l, "smollm2", 0x11), ReceiverConfig::new(l)).expect("rx")));
        let pool = Arc::new(Mutex::new(KvPool::new(l, 32).expect("pool B")));
        if direct {
            let memory = PoolMemory::new(l, 32).expect("pool memory");
            config.direct = Some(memory.direct());
            lock(&pool).adopt(memory.into_shared()).expect("adopt");
        }
        let _decoys = lock(&pool).allocate(3).expect("decoys");
        let server = TcpKvServer::bind("127.0.0.1:0", rx.clone(), pool.clone(), config).await.expect("bind");
        Self { layout: l, rx, pool, server }
    }

    fn reserve(&self, n: usize, ttl: Duration) -> (Reservation, Vec<BlockId>) {
        let blocks = lock(&self.pool).allocate(n).expect("alloc B");
        (lock(&self.rx).reserve(blocks.clone(), ttl, now()).expect("reserve"), blocks)
    }

    async fn wait_stats(&self, what: &str, pred: impl FnMut(&TcpServerStats) -> bool) -> TcpServerStats {
        let mut w = self.server.watch_stats();
        let s = within(what, w.wait_for(pred)).await.expect("server alive").clone();
        s
    }

    async fn connect(&self, p: &Peer, max_frame_bytes: usize) -> Result<TcpKvSender, TransferError> {
        let config = TcpSenderConfig { timeout: WAIT, max_frame_bytes };
        within("handshake", TcpKvSender::connect(self.server.local_addr(), p, self.layout, config)).await
    }
}

/// Sends `layers` of `table` from `pool`, in the order given.
async fn send_layers(tx: &mut TcpKvSender, pool: &KvPool, table: &[BlockId], r: Reservation, layers: &[usize]) {
    for &layer in layers {
        let (k, v) = pool.gather_layer(layer, table).expect("gather layer");
        within("a layer sent", tx.send_layer(r, layer, &k, &v)).await.expect("send layer");
    }
}

/// Reads one frame from a raw socket.
async fn read_frame(s: &mut TcpStream, buf: &mut Vec<u8>) -> Frame {
    loop {
        if let Decoded::Frame { frame, consumed } = Frame::decode(buf, &DecodeLimits::default()).expect("valid reply") {
            buf.drain(..consumed);
            return frame;
        }
        let mut chunk = [0u8; 256];
        let n = within("a reply frame", s.read(&mut chunk)).await.expect("read");
        assert!(n > 0, "server closed instead of replying");
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// Connects a raw socket and does the handshake by hand.
async fn raw_handshake(d: &DecodeSide) -> (TcpStream, Vec<u8>) {
    let mut s = within("raw connect", TcpStream::connect(d.server.local_addr())).await.expect("connect");
    let p = peer(&d.layout, "smollm2", 0x11);
    let hello =
        Hello { version_group: p.version_group, fingerprint: p.fingerprint, protocol_version: PROTOCOL_VERSION };
    let mut wire = Vec::new();
    Frame::Hello(hello).encode(&mut wire).expect("encode");
    within("hello written", s.write_all(&wire)).await.expect("write");
    let mut buf = Vec::new();
    assert!(matches!(read_frame(&mut s, &mut buf).await, Frame::HelloAck(_)));
    (s, buf)
}

/// Waits until the server closes a raw connection (EOF or reset).
async fn expect_closed(s: &mut TcpStream, what: &str) {
    let mut chunk = [0u8; 64];
    loop {
        match within(what, s.read(&mut chunk)).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {} // a reply before the close is fine
        }
    }
}

#[tokio::test]
async fn full_transfer_lands_bit_exact_in_other_blocks() {
    let d = DecodeSide::start(TcpServerConfig::default()).await;
    let l = d.layout;
    let (pool_a, table_a) = source(l, 5);
    let (r, table_b) = d.reserve(5, Duration::from_secs(30));
    assert_ne!(table_a, table_b, "the test must move KV between different ids");

    // Two blocks per frame: 3 frames per layer.
    let mut tx = d.connect(&peer(&l, "smollm2", 0x11), LAYER_DATA_OVERHEAD + 2 * 2 * side(&l)).await.expect("connect");
    let reversed: Vec<usize> = (0..l.n_layers).rev().collect();
    send_layers(&mut tx, &pool_a, &table_a, r, &reversed).await;
    assert_eq!(lock(&d.rx).state(r), Some(ReservationState::Receiving), "not readable before Complete");
    let ack = within("Ack", tx.complete(r)).await.expect("complete");
    assert_eq!((ack.reservation, ack.generation), (r.id.0, r.generation));

    let blocks = lock(&d.rx).take_ready(r).expect("ready after Ack");
    assert_eq!(blocks, table_b);
    let got = lock(&d.pool).gather(&blocks).expect("gather B");
    assert_eq!(got, pool_a.gather(&table_a).expect("gather A"), "KV bytes differ after the transfer");
    assert_eq!(lock(&d.rx).counters().layer_frames_accepted, 4 * 3);
    assert_eq!(tx.bytes_sent(), (4 * 3 * LAYER_DATA_OVERHEAD + 4 * 5 * 2 * side(&l)) as u64);
}

#[tokio::test]
async fn layers_sent_in_block_ranges_as_a_streaming_prefill_completes_them() {
    let d = DecodeSide::start(TcpServerConfig::default()).await;
    let l = d.layout;
    let (pool_a, table_a) = source(l, 5);
    let (r, _) = d.reserve(5, Duration::from_secs(30));
    let mut tx = d.connect(&peer(&l, "smollm2", 0x11), 1 << 20).await.expect("connect");
    // Blocks 0..2 of every layer first (an early step), then 2..5 (the last step).
    for (from, to) in [(0, 2), (2, 5)] {
        for layer in 0..l.n_layers {
            let (k, v) = pool_a.gather_layer(layer, &table_a[from..to]).expect("gather");
            within("blocks sent", tx.send_blocks(r, layer, from, &k, &v)).await.expect("send blocks");
        }
        if from == 0 {
            // Half the blocks are not a complete transfer.
            assert_eq!(lock(&d.rx).state(r), Some(ReservationState::Receiving));
        }
    }
    within("Ack", tx.complete(r)).await.expect("complete");
    let blocks = lock(&d.rx).take_ready(r).expect("ready after Ack");
    let got = lock(&d.pool).gather(&blocks).expect("gather B");
    assert_eq!(got, pool_a.gather(&table_a).expect("gather A"), "KV bytes differ after a ranged transfer");

    // A range past the reservation is refused by the receiver, not written.
    let (r2, _) = d.reserve(2, Duration::from_secs(30));
    let (k, v) = pool_a.gather_layer(0, &table_a[..2]).expect("gather");
    let sent = within("blocks sent", tx.send_blocks(r2, 0, 1, &k, &v)).await;
    let completed = match sent {
        Ok(()) => within("Ack or Abort", tx.complete(r2)).await.map(drop),
        Err(e) => Err(e),
    };
    assert!(matches!(completed, Err(TransferError::PeerAbort { .. })), "{completed:?}");
    assert_eq!(lock(&d.rx).counters().refused("block_range"), 1);
}

#[tokio::test]
async fn handshake_rejects_fingerprint_and_version_group_mismatch() {
    let d = DecodeSide::start(TcpServerConfig::default()).await;
    let l = d.layout;
    let other_weights = peer(&l, "smollm2", 0x99);
    match d.connect(&other_weights, 1 << 20).await {
        Err(e @ TransferError::Rejected { reason: RejectReason::Fingerprint }) => {
            assert_eq!(e.kind(), kvtransfer::ErrorKind::VersionMismatch)
        }
        other => panic!("expected a fingerprint rejection, got {other:?}"),
    }
    let other_group = peer(&l, "llama-8b", 0x11);
    match d.connect(&other_group, 1 << 20).await {
        Err(TransferError::Rejected { reason: RejectReason::VersionGroup }) => {}
        other => panic!("expected a version-group rejection, got {other:?}"),
    }
    let s = d.wait_stats("two rejected connections closed", |s| s.closed_by("rejected") == 2).await;
    assert_eq!(s.connections_accepted, 2);
    let c = lock(&d.rx).counters().clone();
    assert_eq!(c.hello_rejected(RejectReason::Fingerprint), 1);
    assert_eq!(c.hello_rejected(RejectReason::VersionGroup), 1);
    assert_eq!(c.hello_accepted, 0);
}

#[tokio::test]
async fn corrupt_payload_fails_the_reservation_and_returns_blocks_once() {
    let d = DecodeSide::start(TcpServerConfig::default()).await;
    let l = d.layout;
    let (r, table_b) = d.reserve(3, Duration::from_secs(30));
    let (mut s, mut buf) = raw_handshake(&d).await;

    let payload: Vec<u8> = (0..3 * 2 * side(&l)).map(|i| (i * 7 + 1) as u8).collect();
    let frame = LayerData::new(r.id.0, r.generation, 1, 0, 3, payload);
    let mut wire = Vec::new();
    Frame::LayerData(frame).encode(&mut wire).expect("encode");
    wire[LAYER_DATA_OVERHEAD + 17] ^= 0x40;
    within("corrupt frame written", s.write_all(&wire)).await.expect("write");

    match read_frame(&mut s, &mut buf).await {
        Frame::Abort(a) => {
            assert_eq!((a.reservation, a.generation, a.reason), (r.id.0, r.generation, AbortReason::Corrupt))
        }
        other => panic!("expected Abort(Corrupt), got {other:?}"),
    }
    assert_eq!(lock(&d.rx).state(r), Some(ReservationState::Failed));
    assert!(lock(&d.rx).take_ready(r).is_err(), "a failed reservation is never readable");
    let released = lock(&d.rx).poll_released(now());
    assert_eq!(released.len(), 1);
    assert_eq!((released[0].cause, &released[0].blocks), (ReleaseCause::Corrupt, &table_b));
    assert!(lock(&d.rx).poll_released(now()).is_empty(), "blocks come back exactly once");
    assert!(lock(&d.pool).gather(&table_b).expect("gather").iter().all(|&b| b == 0), "nothing was written");
    assert_eq!(lock(&d.rx).held_blocks(), 0);

    // A refused frame leaves the stream in sync: the connection still serves.
    let unknown = Complete { reservation: 999, generation: 1, n_layers: l.n_layers as u32 };
    wire.clear();
    Frame::Complete(unknown).encode(&mut wire).expect("encode");
    within("complete written", s.write_all(&wire)).await.expect("write");
    match read_frame(&mut s, &mut buf).await {
        Frame::Abort(a) => assert_eq!((a.reservation, a.reason), (999, AbortReason::ProtocolViolation)),
        other => panic!("expected Abort(ProtocolViolation), got {other:?}"),
    }
    assert_eq!(d.server.stats().connections_closed(), 0);
}

#[tokio::test]
async fn dropped_sender_leaves_reservation_unready_until_its_lease_returns_blocks() {
    let d = DecodeSide::start(TcpServerConfig::default()).await;
    let l = d.layout;
    let (pool_a, table_a) = source(l, 4);
    // Expiry is driven by the clock value passed in, not by waiting; the
    // lease is only long enough that a slow machine cannot expire it early.
    let (r, table_b) = d.reserve(4, Duration::from_secs(2));
    let mut tx = d.connect(&peer(&l, "smollm2", 0x11), 1 << 20).await.expect("connect");
    send_layers(&mut tx, &pool_a, &table_a, r, &[3, 0]).await;
    drop(tx);

    let s = d.wait_stats("the dropped connection seen closed", |s| s.connections_closed() == 1).await;
    assert_eq!(s.closed_by("peer_closed"), 1);
    let mut rx = lock(&d.rx);
    assert_eq!(rx.counters().layer_frames_accepted, 2, "both layers arrived before the drop");
    assert_eq!(rx.state(r), Some(ReservationState::Receiving));
    assert!(rx.take_ready(r).is_err(), "half a transfer is never readable");

    let deadline = rx.next_deadline().expect("the reservation's lease");
    assert!(rx.poll_released(deadline - Duration::from_millis(1)).is_empty(), "nothing before the lease ends");
    let released = rx.poll_released(deadline);
    assert_eq!(released.len(), 1);
    assert_eq!((released[0].cause, &released[0].blocks), (ReleaseCause::LeaseExpired, &table_b));
    assert!(rx.poll_released(deadline + Duration::from_secs(1)).is_empty(), "blocks come back exactly once");
    assert_eq!(rx.state(r), Some(ReservationState::Expired));
    drop(rx);
    let mut pool = lock(&d.pool);
    pool.release(&released[0].blocks).expect("release");
    assert_eq!(pool.stats().used, 3, "only the decoys remain: no block leaked");
}

#[tokio::test]
async fn garbage_and_wrong_first_frame_close_the_connection_and_the_server_keeps_serving() {
    let d = DecodeSide::start(TcpServerConfig::default()).await;
    let l = d.layout;

    let mut s = within("raw connect", TcpStream::connect(d.server.local_addr())).await.expect("connect");
    within("garbage written", s.write_all(b"GET / HTTP/1.1\r\nHost: decode\r\n\r\n")).await.expect("write");
    expect_closed(&mut s, "server closing the garbage connection").await;

    let mut s = within("raw connect", TcpStream::connect(d.server.local_addr())).await.expect("connect");
    let mut wire = Vec::new();
    Frame::Complete(Complete { reservation: 0, generation: 1, n_layers: 4 }).encode(&mut wire).expect("encode");
    within("complete written", s.write_all(&wire)).await.expect("write");
    expect_closed(&mut s, "server closing a connection that skipped Hello").await;

    let st = d.wait_stats("both bad connections counted", |s| s.connections_closed() == 2).await;
    assert_eq!((st.closed_by("decode"), st.closed_by("not_hello")), (1, 1));

    // A good client is still served end to end.
    let (pool_a, table_a) = source(l, 2);
    let (r, table_b) = d.reserve(2, Duration::from_secs(30));
    let mut tx = d.connect(&peer(&l, "smollm2", 0x11), 1 << 20).await.expect("connect after garbage");
    send_layers(&mut tx, &pool_a, &table_a, r, &[0, 1, 2, 3]).await;
    within("Ack", tx.complete(r)).await.expect("complete");
    let blocks = lock(&d.rx).take_ready(r).expect("ready");
    assert_eq!(blocks, table_b);
    assert_eq!(lock(&d.pool).gather(&blocks).expect("B"), pool_a.gather(&table_a).expect("A"));
}

#[tokio::test]
async fn idle_connection_is_closed() {
    let config = TcpServerConfig { idle_timeout: Duration::from_millis(100), ..TcpServerConfig::default() };
    let d = DecodeSide::start(config).await;
    let (mut s, _) = raw_handshake(&d).await;
    expect_closed(&mut s, "server closing an idle connection").await;
    let st = d.wait_stats("the idle close counted", |s| s.connections_closed() == 1).await;
    assert_eq!(st.closed_by("idle"), 1);
}

/// A pooled sender asks `check_open` before reusing its connection: open
/// while the server holds it, failing once the server closed it for idling
/// (the prefill worker then connects anew instead of failing a transfer).
#[tokio::test]
async fn check_open_sees_the_idle_close() {
    let config = TcpServerConfig { idle_timeout: Duration::from_millis(200), ..TcpServerConfig::default() };
    let d = DecodeSide::start(config).await;
    let l = d.layout;
    let (pool_a, table_a) = source(l, 2);
    let (r, _) = d.reserve(2, Duration::from_secs(30));
    let mut tx = d.connect(&peer(&l, "smollm2", 0x11), 1 << 20).await.expect("connect");
    send_layers(&mut tx, &pool_a, &table_a, r, &[0, 1, 2, 3]).await;
    within("Ack", tx.complete(r)).await.expect("complete");
    tx.check_open().expect("open after a transfer");
    d.wait_stats("the idle close counted", |s| s.closed_by("idle") == 1).await;
    let e = common::until_closed(|| tx.check_open()).await;
    assert!(matches!(e, TransferError::Io(_)), "{e:?}");
    assert_eq!(e.kind(), kvtransfer::ErrorKind::Retryable);
}

#[tokio::test]
async fn sender_learns_of_an_abort_and_stops() {
    let d = DecodeSide::start(TcpServerConfig::default()).await;
    let l = d.layout;
    let (pool_a, table_a) = source(l, 2);
    let (r, _) = d.reserve(2, Duration::from_secs(30));
    let mut tx = d.connect(&peer(&l, "smollm2", 0x11), 1 << 20).await.expect("connect");
    send_layers(&mut tx, &pool_a, &table_a, r, &[0]).await;
    // Layer 0 again: a duplicate, refused with an Abort.
    let (k, v) = pool_a.gather_layer(0, &table_a).expect("gather");
    within("duplicate sent", tx.send_layer(r, 0, &k, &v)).await.expect("the write itself succeeds");
    match within("complete answered", tx.complete(r)).await {
        Err(e @ TransferError::PeerAbort { reason: AbortReason::ProtocolViolation }) => {
            assert_eq!(e.kind(), kvtransfer::ErrorKind::InvalidInput)
        }
        other => panic!("expected PeerAbort(ProtocolViolation), got {other:?}"),
    }
    // And it is remembered: further sends for that reservation fail fast.
    assert!(matches!(tx.send_layer(r, 1, &k, &v).await, Err(TransferError::PeerAbort { .. })));
}

// ---- Rolling upgrades: today's frames, frozen ----------------------------------------

/// The frames of protocol version 1, as `tests/fixtures/frames-v1.hex` holds them.
fn v1_frames() -> Vec<(String, Frame)> {
    let hello = Hello {
        version_group: kvtransfer::VersionGroup::new("smollm2-135m.q4_1").expect("label"),
        fingerprint: kvtransfer::LayoutFingerprint::from_bytes([7; 32]),
        protocol_version: 1,
    };
    let mut frames = vec![
        ("hello".to_owned(), Frame::Hello(hello)),
        ("hello_ack".to_owned(), Frame::HelloAck(kvtransfer::HelloAck { protocol_version: 1 })),
    ];
    for (i, reason) in RejectReason::ALL.into_iter().enumerate() {
        frames.push((format!("hello_reject_{i}"), Frame::HelloReject(kvtransfer::HelloReject { reason })));
    }
    frames.push((
        "layer_data".to_owned(),
        Frame::LayerData(LayerData::new(0x0102_0304_0506_0708, 9, 3, 5, 2, (0..64).collect())),
    ));
    frames.push(("complete".to_owned(), Frame::Complete(Complete { reservation: 9, generation: 10, n_layers: 30 })));
    frames.push(("ack".to_owned(), Frame::Ack(kvtransfer::Ack { reservation: 9, generation: 10 })));
    for (i, reason) in AbortReason::ALL.into_iter().enumerate() {
        frames.push((format!("abort_{i}"), Frame::Abort(kvtransfer::Abort { reservation: 1, generation: 2, reason })));
    }
    frames
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Vec<u8> {
    (0..text.len()).step_by(2).map(|i| u8::from_str_radix(&text[i..i + 2], 16).expect("hex")).collect()
}

/// `name -> bytes` of the frozen fixture.
fn v1_fixture() -> std::collections::BTreeMap<String, Vec<u8>> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/frames-v1.hex");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let (name, bytes) = l.split_once(' ').expect("`name hex` lines");
            (name.to_owned(), unhex(bytes.trim()))
        })
        .collect()
}

/// Protocol version 1's bytes never change: today's encoder writes exactly the frozen
/// fixture and decodes it back. A change to the wire format fails here; it needs a new
/// `PROTOCOL_VERSION` and a new fixture beside this one, never an edit of it.
#[test]
fn version_1_frames_are_frozen() {
    let fixture = v1_fixture();
    let frames = v1_frames();
    let mut wrong = Vec::new();
    for (name, frame) in &frames {
        let mut bytes = Vec::new();
        frame.encode(&mut bytes).expect("encode");
        match fixture.get(name) {
            Some(frozen) if *frozen == bytes => match Frame::decode(frozen, &DecodeLimits::default()) {
                Ok(Decoded::Frame { frame: back, consumed }) if consumed == frozen.len() => {
                    assert_eq!(&back, frame, "{name}: the frozen bytes decode to another frame")
                }
                other => panic!("{name}: the frozen bytes do not decode whole: {other:?}"),
            },
            _ => wrong.push(format!("{name} {}", hex(&bytes))),
        }
    }
    assert!(wrong.is_empty(), "today's encoding differs from frames-v1.hex for:\n{}", wrong.join("\n"));
    assert_eq!(fixture.len(), frames.len(), "the fixture names a frame the test does not build");
}

/// A peer of another protocol version — the frozen v1 `Hello` with its version field set
/// to 0 (an older peer) and 2 (a newer one) — is refused cleanly over a real socket: a
/// `HelloReject(ProtocolVersion)`, the connection closed, counted, nothing reserved; the
/// frozen v1 `Hello` itself passes the version check (refused only for its version group,
/// which is not the server's). Until version 2 exists, this is what a rolling upgrade's
/// mixed pairs get.
#[tokio::test]
async fn a_peer_of_another_protocol_version_is_refused_cleanly() {
    let d = DecodeSide::start(TcpServerConfig::default()).await;
    let frozen = v1_fixture().remove("hello").expect("a frozen hello");
    let with_version = |v: u32| {
        let mut b = frozen.clone();
        b[kvtransfer::frame::HEADER_LEN..kvtransfer::frame::HEADER_LEN + 4].copy_from_slice(&v.to_le_bytes());
        b
    };
    let cases = [(with_version(0), RejectReason::ProtocolVersion), (with_version(2), RejectReason::ProtocolVersion)];
    let expect_v1 = if PROTOCOL_VERSION == 1 { RejectReason::VersionGroup } else { RejectReason::ProtocolVersion };
    for (bytes, want) in cases.into_iter().chain([(frozen.clone(), expect_v1)]) {
        let mut s = within("raw connect", TcpStream::connect(d.server.local_addr())).await.expect("connect");
        within("hello written", s.write_all(&bytes)).await.expect("write");
        let mut buf = Vec::new();
        match read_frame(&mut s, &mut buf).await {
            Frame::HelloReject(r) => assert_eq!(r.reason, want),
            other => panic!("expected a HelloReject({want:?}), got {other:?}"),
        }
        expect_closed(&mut s, "the refused connection closed").await;
    }
    d.wait_stats("three refused connections closed", |s| s.closed_by("rejected") == 3).await;
    let c = lock(&d.rx).counters().clone();
    assert_eq!(c.hello_rejected(RejectReason::ProtocolVersion), 2 + u64::from(PROTOCOL_VERSION != 1));
    assert_eq!(c.hello_accepted, 0);
    let pool = lock(&d.pool);
    assert_eq!(pool.num_blocks() - pool.available(), 3, "only the decoys are held");
}

/// Waits, bounded, until `cond` holds (receiver state no event announces).
async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    within(what, async {
        while !cond() {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await
}

/// Encodes a `LayerData` of `n` blocks of layer `layer` for `r`, known bytes.
fn layer_frame(l: &KvLayout, r: Reservation, layer: u32, n: u32) -> Vec<u8> {
    let payload: Vec<u8> = (0..n as usize * 2 * side(l)).map(|i| (i * 13 + layer as usize) as u8).collect();
    let mut wire = Vec::new();
    Frame::LayerData(LayerData::new(r.id.0, r.generation, layer, 0, n, payload)).encode(&mut wire).expect("encode");
    wire
}

/// Read straight into the pool, a payload the sender cuts off mid-way
/// holds nothing for good: the direct read is abandoned with the
/// connection, its cells can be sent again (a new connection's whole layer
/// is accepted) and the transfer completes bit for bit.
#[tokio::test]
async fn a_payload_cut_off_mid_read_into_the_pool_is_abandoned() {
    let d = DecodeSide::start_with(TcpServerConfig::default(), true).await;
    let l = d.layout;
    let (pool_a, table_a) = source(l, 3);
    let (r, table_b) = d.reserve(3, Duration::from_secs(30));
    let (mut s, _) = raw_handshake(&d).await;
    let wire = layer_frame(&l, r, 1, 3);
    within("half a frame written", s.write_all(&wire[..wire.len() / 2])).await.expect("write");
    eventually("the direct read opened", || lock(&d.rx).direct_reads(r) == 1).await;
    drop(s);
    let stats = d.wait_stats("the cut connection closed", |s| s.connections_closed() == 1).await;
    assert_eq!(stats.closed_by("truncated"), 1, "{stats:?}");
    assert_eq!(lock(&d.rx).direct_reads(r), 0, "abandoned with its connection");
    assert_eq!(lock(&d.rx).state(r), Some(ReservationState::Receiving));

    let mut tx = d.connect(&peer(&l, "smollm2", 0x11), 1 << 20).await.expect("connect");
    send_layers(&mut tx, &pool_a, &table_a, r, &(0..l.n_layers).collect::<Vec<_>>()).await;
    within("the Ack", tx.complete(r)).await.expect("complete");
    assert_eq!(lock(&d.rx).take_ready(r).expect("ready"), table_b);
    assert_eq!(lock(&d.pool).gather(&table_b).expect("B"), pool_a.gather(&table_a).expect("A"));
    let stats = d.server.stats();
    assert_eq!((stats.layers_read_in_place, stats.sink_failures), (l.n_layers as u64, 0));
}

/// A lease that ends while a payload is being read into its blocks: the
/// blocks wait in quarantine (the socket still writes them) and come back
/// once, as expired, when the read ends — here with the connection, the
/// sender stalled mid-frame.
#[tokio::test]
async fn blocks_being_read_into_come_back_only_when_the_read_ends() {
    let d = DecodeSide::start_with(TcpServerConfig::default(), true).await;
    let l = d.layout;
    let (r, table_b) = d.reserve(3, Duration::from_secs(30));
    let (mut s, _) = raw_handshake(&d).await;
    let wire = layer_frame(&l, r, 0, 3);
    within("part of a frame written", s.write_all(&wire[..LAYER_DATA_OVERHEAD + 100])).await.expect("write");
    eventually("the direct read opened", || lock(&d.rx).direct_reads(r) == 1).await;
    // Past the lease, by the clock passed in.
    let after = lock(&d.rx).lease_end(r).expect("live") + Duration::from_millis(1);
    {
        let mut rx = lock(&d.rx);
        assert!(rx.poll_released(after).is_empty(), "handed back while the socket writes them");
        assert_eq!(rx.state(r), Some(ReservationState::Expired));
        assert_eq!((rx.quarantined_blocks(), rx.held_blocks()), (3, 3));
    }
    drop(s);
    eventually("the read abandoned", || lock(&d.rx).direct_reads(r) == 0).await;
    let mut rx = lock(&d.rx);
    let released = rx.poll_released(after);
    assert_eq!(released.len(), 1);
    assert_eq!((released[0].cause, &released[0].blocks), (ReleaseCause::LeaseExpired, &table_b));
    assert_eq!((rx.quarantined_blocks(), rx.held_blocks()), (0, 0));
}

/// The server stopped while a connection reads into the pool: the task's
/// end abandons the read (nothing can close it later), so the blocks are
/// not held for good.
#[tokio::test]
async fn a_server_stopped_mid_read_abandons_it() {
    let d = DecodeSide::start_with(TcpServerConfig::default(), true).await;
    let l = d.layout;
    let (r, table_b) = d.reserve(2, Duration::from_secs(30));
    let (mut s, _) = raw_handshake(&d).await;
    let wire = layer_frame(&l, r, 0, 2);
    within("part of a frame written", s.write_all(&wire[..LAYER_DATA_OVERHEAD + 10])).await.expect("write");
    eventually("the direct read opened", || lock(&d.rx).direct_reads(r) == 1).await;
    let DecodeSide { rx, server, .. } = d;
    server.shutdown();
    eventually("the read abandoned by the stopped task", || lock(&rx).direct_reads(r) == 0).await;
    assert_eq!(lock(&rx).abort(r), Ok(table_b), "a local abort gets the blocks back at once");
    drop(s);
}

/// A payload for blocks outside the mapped pool is never written there:
/// it is read into a buffer and given to the sink, which refuses it, and
/// the reservation is voided.
#[tokio::test]
async fn blocks_outside_the_mapped_pool_are_never_read_into() {
    let d = DecodeSide::start_with(TcpServerConfig::default(), true).await;
    let l = d.layout;
    let r = lock(&d.rx).reserve(vec![40], Duration::from_secs(30), now()).expect("reserve");
    let (mut s, mut buf) = raw_handshake(&d).await;
    within("frame written", s.write_all(&layer_frame(&l, r, 0, 1))).await.expect("write");
    match read_frame(&mut s, &mut buf).await {
        Frame::Abort(a) => assert_eq!((a.reservation, a.reason), (r.id.0, AbortReason::Corrupt)),
        other => panic!("expected Abort(Corrupt), got {other:?}"),
    }
    let stats = d.server.stats();
    assert_eq!((stats.layers_read_in_place, stats.sink_failures), (0, 1));
    assert_eq!(lock(&d.rx).direct_reads(r), 0);
}

#[tokio::test]
async fn a_direct_pool_of_another_layout_is_refused_at_bind() {
    let l = layout();
    let rx = Arc::new(Mutex::new(Receiver::new(peer(&l, "smollm2", 0x11), ReceiverConfig::new(l)).expect("rx")));
    let other = KvLayout { n_layers: l.n_layers + 1, ..l };
    let memory = PoolMemory::new(other, 4).expect("pool memory");
    let config = TcpServerConfig { direct: Some(memory.direct()), ..TcpServerConfig::default() };
    let pool = Arc::new(Mutex::new(KvPool::new(l, 4).expect("pool")));
    let err = TcpKvServer::bind("127.0.0.1:0", rx, pool, config).await.expect_err("a mismatched pool");
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
}

/// A sender that stalls mid-payload does not keep the blocks past its
/// lease: the read stops itself at the lease's end (the blocks come back
/// at once, as expired), and when the rest arrives it is read, refused as
/// expired and told, on a connection that goes on serving.
#[tokio::test]
async fn a_read_into_the_pool_stops_at_the_lease_end_and_the_rest_is_refused() {
    let d = DecodeSide::start_with(TcpServerConfig::default(), true).await;
    let l = d.layout;
    let (r, table_b) = d.reserve(3, Duration::from_millis(300));
    let (mut s, mut buf) = raw_handshake(&d).await;
    let wire = layer_frame(&l, r, 0, 3);
    let cut = LAYER_DATA_OVERHEAD + 100;
    within("part of a frame written", s.write_all(&wire[..cut])).await.expect("write");
    eventually("the direct read opened", || lock(&d.rx).direct_reads(r) == 1).await;
    eventually("the read stopped at the lease end", || lock(&d.rx).direct_reads(r) == 0).await;
    let released = lock(&d.rx).poll_released(now());
    assert_eq!(released.len(), 1, "the blocks come back without the rest of the frame");
    assert_eq!((released[0].cause, &released[0].blocks), (ReleaseCause::LeaseExpired, &table_b));
    within("the rest written", s.write_all(&wire[cut..])).await.expect("write");
    match read_frame(&mut s, &mut buf).await {
        Frame::Abort(a) => assert_eq!((a.reservation, a.reason), (r.id.0, AbortReason::LeaseExpired)),
        other => panic!("expected Abort(LeaseExpired), got {other:?}"),
    }
    assert_eq!(lock(&d.rx).counters().refused("expired"), 1);
    let stats = d.server.stats();
    assert_eq!((stats.layers_read_in_place, stats.connections_closed()), (0, 0), "{stats:?}");
}

/// A prefill pool in mapped memory with `n` blocks of known K/V values, taken out of
/// order (the blocks of a sequence rarely lie side by side).
fn pinned_source(l: KvLayout, n: usize) -> (KvPool, DirectPool, Vec<BlockId>) {
    let memory = PoolMemory::new(l, 32).expect("pool memory");
    let direct = memory.direct();
    let mut pool = KvPool::new(l, 32).expect("pool A");
    pool.adopt(memory.into_shared()).expect("adopt");
    let all = pool.allocate(2 * n).expect("alloc A");
    // Every other block, last first: no two of the table's blocks are adjacent.
    let table: Vec<BlockId> = all.iter().step_by(2).rev().copied().collect();
    let row = l.row_elems();
    for layer in 0..l.n_layers {
        for (i, &b) in table.iter().enumerate() {
            for slot in 0..l.block_size {
                let k: Vec<f32> = (0..row).map(|j| ((layer * 1000 + i * 100 + slot * 10 + j) as f32) * 0.5).collect();
                let v: Vec<f32> = k.iter().map(|x| -x - 0.25).collect();
                pool.write(layer, b, slot, &k, &v);
            }
        }
    }
    (pool, direct, table)
}

/// Each layer of `table` as the engine thread would hand it over: checksummed in place.
fn pinned_layers(pool: &KvPool, table: &[BlockId], max_frame_bytes: usize) -> Vec<PinnedLayer> {
    let l = *pool.layout();
    (0..l.n_layers)
        .map(|layer| {
            let (k, v) = pool.layer_bytes(layer).expect("layer bytes");
            PinnedLayer::new(&l, layer, 0, table, k, v, max_frame_bytes).expect("pinned layer")
        })
        .collect()
}

#[tokio::test]
async fn layers_sent_straight_from_the_pool_land_bit_exact_read_either_way() {
    for direct in [false, true] {
        let d = DecodeSide::start_with(TcpServerConfig::default(), direct).await;
        let l = d.layout;
        let (pool_a, memory, table_a) = pinned_source(l, 5);
        let (r, table_b) = d.reserve(5, Duration::from_secs(30));
        // Two blocks per frame: 3 frames per layer, the last of one block.
        let max_frame = LAYER_DATA_OVERHEAD + 2 * 2 * side(&l);
        let mut tx = d.connect(&peer(&l, "smollm2", 0x11), max_frame).await.expect("connect");
        for p in pinned_layers(&pool_a, &table_a, max_frame).iter().rev() {
            within("a pinned layer sent", tx.send_pinned(r, p, &memory)).await.expect("send pinned");
        }
        within("Ack", tx.complete(r)).await.expect("complete");
        let blocks = lock(&d.rx).take_ready(r).expect("ready after Ack");
        let got = lock(&d.pool).gather(&blocks).expect("gather B");
        assert_eq!(got, pool_a.gather(&table_a).expect("gather A"), "direct {direct}: KV bytes differ");
        assert_eq!(lock(&d.rx).counters().layer_frames_accepted, 4 * 3, "direct {direct}");
        assert_eq!(tx.bytes_sent(), (4 * 3 * LAYER_DATA_OVERHEAD + 4 * 5 * 2 * side(&l)) as u64);
        let read_in_place = d.server.stats().layers_read_in_place;
        assert_eq!(read_in_place > 0, direct, "direct {direct}: {read_in_place} layers read in place");
        drop(table_b);
    }
}

/// The checksum is taken where the layer was computed: a block written after that
/// (freed and reused before its push ended) goes out with a checksum it no longer
/// matches, and the receiver refuses it as corrupt rather than land the wrong bytes.
#[tokio::test]
async fn a_block_written_after_its_checksum_is_refused_as_corrupt() {
    let d = DecodeSide::start_with(TcpServerConfig::default(), true).await;
    let l = d.layout;
    let (mut pool_a, memory, table_a) = pinned_source(l, 3);
    let (r, table_b) = d.reserve(3, Duration::from_secs(30));
    let max_frame = 1 << 20;
    let mut tx = d.connect(&peer(&l, "smollm2", 0x11), max_frame).await.expect("connect");
    let layers = pinned_layers(&pool_a, &table_a, max_frame);
    let row = vec![7.0f32; l.row_elems()];
    pool_a.write(0, table_a[1], 0, &row, &row);
    for p in &layers {
        // The first frame is refused; the rest may already be on their way.
        if within("a pinned layer sent", tx.send_pinned(r, p, &memory)).await.is_err() {
            break;
        }
    }
    let e = within("Complete refused", tx.complete(r)).await.expect_err("refused");
    assert!(matches!(e, TransferError::PeerAbort { reason: AbortReason::Corrupt }), "{e}");
    let released = lock(&d.rx).poll_released(now());
    assert_eq!((released.len(), released[0].cause, &released[0].blocks), (1, ReleaseCause::Corrupt, &table_b));
    assert_eq!(lock(&d.rx).held_blocks(), 0);
}

#[tokio::test]
async fn a_pinned_layer_cut_for_another_frame_size_is_refused_with_nothing_sent() {
    let d = DecodeSide::start(TcpServerConfig::default()).await;
    let l = d.layout;
    let (pool_a, memory, table_a) = pinned_source(l, 3);
    let (r, _) = d.reserve(3, Duration::from_secs(30));
    let mut tx = d.connect(&peer(&l, "smollm2", 0x11), 1 << 20).await.expect("connect");
    let cut_elsewhere = pinned_layers(&pool_a, &table_a, LAYER_DATA_OVERHEAD + 2 * side(&l));
    let e = tx.send_pinned(r, &cut_elsewhere[0], &memory).await.expect_err("refused");
    assert!(matches!(e, TransferError::Protocol(_)), "{e}");
    let other = PoolMemory::new(l, 2).expect("a pool too small for the table").direct();
    let fits = pinned_layers(&pool_a, &table_a, 1 << 20);
    let e = tx.send_pinned(r, &fits[0], &other).await.expect_err("blocks outside the pool");
    assert!(matches!(e, TransferError::Protocol(_)), "{e}");
    assert_eq!(tx.bytes_sent(), 0, "nothing went out");
    // The connection still carries the transfer.
    for p in &fits {
        within("a pinned layer sent", tx.send_pinned(r, p, &memory)).await.expect("send pinned");
    }
    within("Ack", tx.complete(r)).await.expect("complete");
}
