//! The local transport on a real Unix socket and real shared memory: KV
//! from one engine pool lands in another pool's reserved blocks through a
//! small ring, and every failure ends in a typed error, a closed
//! connection or blocks that come back exactly once.
//!
//! A hand-rolled client (the wire format written out below, a memfd of its
//! own) plays the faulty or hostile sender. Every wait is bounded by a
//! timeout whose message says what did not happen; events are awaited
//! (server stats watch, socket reads), never slept for.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]

mod common;

use std::fs::File;
use std::future::Future;
use std::io::IoSlice;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use engine::kv::KvPool;

use kvtransfer::transport::local::RingRefusal;
use kvtransfer::{
    AbortReason, Complete, DecodeLimits, Decoded, Frame, Hello, LayerData, LayoutFingerprint, LocalKvSender,
    LocalKvServer, LocalSenderConfig, LocalServerConfig, LocalServerStats, Peer, Receiver, ReceiverConfig,
    RejectReason, ReleaseCause, Reservation, ReservationState, TransferError, VersionGroup, PROTOCOL_VERSION,
};
use rustix::fs::{MemfdFlags, SealFlags};
use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use types::kv::{BlockId, KvDtype, KvLayout};

const WAIT: Duration = Duration::from_secs(10);

async fn within<T>(what: &str, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(WAIT, fut).await {
        Ok(t) => t,
        Err(_) => panic!("timed out after {WAIT:?}: {what} did not happen"),
    }
}

fn layout() -> KvLayout {
    KvLayout { n_layers: 4, n_kv_heads: 2, head_dim: 8, block_size: 4, dtype: KvDtype::F16 }
}

/// Bytes of one block's K (or V) in one layer.
fn side(l: &KvLayout) -> usize {
    l.block_elems() * l.dtype.size()
}

fn peer(l: &KvLayout, group: &str, weights: u8) -> Peer {
    Peer {
        version_group: VersionGroup::new(group).expect("label"),
        fingerprint: LayoutFingerprint::new(l, &[weights; 32], &[0x22; 32]),
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().expect("test lock")
}

fn now() -> tokio::time::Instant {
    tokio::time::Instant::now()
}

/// A fresh abstract socket name: unique per process and test.
fn unique_addr() -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    format!("@tandem-kv-test-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}

/// Decode side: a receiver, a pool with some decoy blocks taken, and a server.
struct DecodeSide {
    layout: KvLayout,
    rx: Arc<Mutex<Receiver>>,
    pool: Arc<Mutex<KvPool>>,
    server: LocalKvServer,
}

impl DecodeSide {
    async fn start(config: LocalServerConfig) -> Self {
        Self::start_at(&unique_addr(), config).await
    }

    async fn start_at(addr: &str, config: LocalServerConfig) -> Self {
        let l = layout();
        let rx = Arc::new(Mutex::new(Receiver::new(peer(&l, "smollm2", 0x11), ReceiverConfig::new(l)).expect("rx")));
        let pool = Arc::new(Mutex::new(KvPool::new(l, 64).expect("pool B")));
        let _decoys = lock(&pool).allocate(3).expect("decoys");
        let server = LocalKvServer::bind(addr, rx.clone(), pool.clone(), config).await.expect("bind");
        Self { layout: l, rx, pool, server }
    }

    fn reserve(&self, n: usize, ttl: Duration) -> (Reservation, Vec<BlockId>) {
        let blocks = lock(&self.pool).allocate(n).expect("alloc B");
        (lock(&self.rx).reserve(blocks.clone(), ttl, now()).expect("reserve"), blocks)
    }

    async fn wait_stats(&self, what: &str, pred: impl FnMut(&LocalServerStats) -> bool) -> LocalServerStats {
        let mut w = self.server.watch_stats();
        let s = within(what, w.wait_for(pred)).await.expect("server alive").clone();
        s
    }

    async fn connect(&self, p: &Peer, slots: usize, slot_bytes: usize) -> Result<LocalKvSender, TransferError> {
        let config = LocalSenderConfig { timeout: WAIT, slots, slot_bytes };
        within("handshake", LocalKvSender::connect(self.server.local_addr(), p, self.layout, config)).await
    }
}

/// Sends `layers` of `table` from `pool`, in the order given.
async fn send_layers(tx: &mut LocalKvSender, pool: &KvPool, table: &[BlockId], r: Reservation, layers: &[usize]) {
    for &layer in layers {
        let (k, v) = pool.gather_layer(layer, table).expect("gather layer");
        within("a layer sent", tx.send_layer(r, layer, &k, &v)).await.expect("send layer");
    }
}

// ------------------------------------------------------------ a raw client
//
// The local wire format, written out: `"tS" | kind | 0 | body_len: u32 LE |
// body`; slot `i`'s payload at `i * stride + 64`, stride = 64 + slot bytes
// rounded up to 4 KiB.

const RING: u8 = 1;
const RING_ACK: u8 = 2;
const RING_REJECT: u8 = 3;
const DATA: u8 = 4;
const CREDIT: u8 = 5;

fn local_msg(kind: u8, body: &[u8]) -> Vec<u8> {
    let mut m = b"tS".to_vec();
    m.extend_from_slice(&[kind, 0]);
    m.extend_from_slice(&(body.len() as u32).to_le_bytes());
    m.extend_from_slice(body);
    m
}

fn stride(slot_bytes: usize) -> usize {
    (64 + slot_bytes).next_multiple_of(4096)
}

/// A message from the server: a protocol frame or a local (kind, body).
#[derive(Debug, PartialEq)]
enum Reply {
    Frame(Frame),
    Local(u8, Vec<u8>),
}

async fn read_reply(s: &mut UnixStream) -> Reply {
    let mut head = [0u8; 8];
    within("a reply", s.read_exact(&mut head)).await.expect("server closed instead of replying");
    let mut body = vec![0u8; u32::from_le_bytes([head[4], head[5], head[6], head[7]]) as usize];
    within("a reply body", s.read_exact(&mut body)).await.expect("reply body");
    if head[..2] == *b"tS" {
        return Reply::Local(head[2], body);
    }
    let whole = [&head[..], &body].concat();
    match Frame::decode(&whole, &DecodeLimits::default()).expect("valid frame") {
        Decoded::Frame { frame, .. } => Reply::Frame(frame),
        Decoded::NeedMore { .. } => panic!("a whole frame was read"),
    }
}

/// Waits until the server closes a raw connection (EOF or reset).
async fn expect_closed(s: &mut UnixStream, what: &str) {
    let mut chunk = [0u8; 64];
    loop {
        match within(what, s.read(&mut chunk)).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {} // a reply before the close is fine
        }
    }
}

/// A hand-made ring: a memfd written with `pwrite`, sealed with `seals`.
fn raw_ring(slots: usize, slot_bytes: usize, seals: SealFlags) -> File {
    let fd = rustix::fs::memfd_create("raw-ring", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).expect("memfd");
    rustix::fs::ftruncate(&fd, (slots * stride(slot_bytes)) as u64).expect("size");
    rustix::fs::fcntl_add_seals(&fd, seals).expect("seal");
    File::from(fd)
}

/// Connects, does the handshake, and offers `ring` as (slots, slot_bytes);
/// returns the stream and the server's answer to the ring.
async fn raw_connect(d: &DecodeSide, ring: &File, slots: u32, slot_bytes: u32) -> (UnixStream, Reply) {
    let path = format!("\0{}", d.server.local_addr().trim_start_matches('@'));
    let mut s = within("raw connect", UnixStream::connect(path)).await.expect("connect");
    let p = peer(&d.layout, "smollm2", 0x11);
    let hello =
        Hello { version_group: p.version_group, fingerprint: p.fingerprint, protocol_version: PROTOCOL_VERSION };
    let mut wire = Vec::new();
    Frame::Hello(hello).encode(&mut wire).expect("encode");
    within("hello written", s.write_all(&wire)).await.expect("write");
    assert!(matches!(read_reply(&mut s).await, Reply::Frame(Frame::HelloAck(_))));

    let msg = local_msg(RING, &[slots.to_le_bytes(), slot_bytes.to_le_bytes()].concat());
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    let fds = [std::os::fd::AsFd::as_fd(ring)];
    assert!(control.push(SendAncillaryMessage::ScmRights(&fds)));
    // A fresh socket has room: the message goes out whole at once.
    let sent = rustix::net::sendmsg(&s, &[IoSlice::new(&msg)], &mut control, SendFlags::NOSIGNAL).expect("sendmsg");
    assert_eq!(sent, msg.len());
    let answer = read_reply(&mut s).await;
    (s, answer)
}

/// Puts `payload` into `slot` of a raw ring and sends the Data message.
#[allow(clippy::too_many_arguments)]
async fn raw_data(
    s: &mut UnixStream,
    ring: &File,
    slot_bytes: usize,
    slot: u32,
    r: Reservation,
    layer: u32,
    first_block: u32,
    n_blocks: u32,
    checksum: u32,
    payload: &[u8],
) {
    rustix::io::pwrite(ring, payload, (slot as usize * stride(slot_bytes) + 64) as u64).expect("pwrite");
    let msg = data_msg(slot, r, [layer, first_block, n_blocks, checksum, payload.len() as u32]);
    within("Data written", s.write_all(&msg)).await.expect("write");
}

/// A Data message: slot, reservation, then layer, first block, block
/// count, checksum and length.
fn data_msg(slot: u32, r: Reservation, fields: [u32; 5]) -> Vec<u8> {
    let mut body = slot.to_le_bytes().to_vec();
    body.extend_from_slice(&r.id.0.to_le_bytes());
    body.extend_from_slice(&r.generation.to_le_bytes());
    for v in fields {
        body.extend_from_slice(&v.to_le_bytes());
    }
    local_msg(DATA, &body)
}

// ------------------------------------------------------------------ tests

#[tokio::test]
async fn full_transfer_through_a_small_ring_lands_bit_exact_in_other_blocks() {
    let d = DecodeSide::start(LocalServerConfig::default()).await;
    let l = d.layout;
    let (pool_a, table_a) = common::source(l, 45, 64);
    let (r, table_b) = d.reserve(45, Duration::from_secs(30));
    assert_ne!(table_a, table_b, "the test must move KV between different ids");

    // Four blocks per slot: 12 frames per layer, 48 in all, through 3 slots,
    // so every slot is credited back and reused many times.
    let slot_bytes = 4 * 2 * side(&l) + 100;
    let mut tx = d.connect(&peer(&l, "smollm2", 0x11), 3, slot_bytes).await.expect("connect");
    let reversed: Vec<usize> = (0..l.n_layers).rev().collect();
    send_layers(&mut tx, &pool_a, &table_a, r, &reversed).await;
    let ack = within("Ack", tx.complete(r)).await.expect("complete");
    assert_eq!((ack.reservation, ack.generation), (r.id.0, r.generation));

    let blocks = lock(&d.rx).take_ready(r).expect("ready after Ack");
    assert_eq!(blocks, table_b);
    let got = lock(&d.pool).gather(&blocks).expect("gather B");
    assert_eq!(got, pool_a.gather(&table_a).expect("gather A"), "KV bytes differ after the transfer");
    assert_eq!(lock(&d.rx).counters().layer_frames_accepted, 4 * 12);
    let payload = 4 * 45 * 2 * side(&l);
    assert_eq!(tx.bytes_sent(), (payload + 4 * 12 * 44) as u64, "payload plus one 44-byte Data message per frame");
    assert_eq!(d.server.stats().rings_mapped, 1);
}

#[tokio::test]
async fn pool_reads_and_layers_in_pieces_move_the_same_bytes() {
    let d = DecodeSide::start(LocalServerConfig::default()).await;
    let l = d.layout;
    let (pool_a, table_a) = common::source(l, 9, 16);
    // Blocks in an order of their own: frames follow the table, not the pool.
    let table_a: Vec<BlockId> = table_a.iter().rev().copied().collect();
    let (r, table_b) = d.reserve(9, Duration::from_secs(30));
    let mut tx = d.connect(&peer(&l, "smollm2", 0x11), 2, 2 * 2 * side(&l)).await.expect("connect");
    let outside = [table_a[0], 16];
    let (ks, vs) = pool_a.layer_bytes(0).expect("layer bytes");
    assert!(matches!(tx.send_stored_blocks(r, 0, 0, ks, vs, &outside).await, Err(TransferError::Io(_))));
    assert!(matches!(tx.send_stored_blocks(r, 0, 0, ks, &vs[1..], &table_a).await, Err(TransferError::Io(_))));
    assert!(matches!(tx.send_stored_blocks(r, 4, 0, ks, vs, &table_a).await, Err(TransferError::Layer(_))));

    // Whole layers straight from the pool.
    for layer in [2, 0] {
        let (ks, vs) = pool_a.layer_bytes(layer).expect("layer bytes");
        within("a layer sent", tx.send_stored_blocks(r, layer, 0, ks, vs, &table_a)).await.expect("send");
    }
    // Layer 3 in two pieces, the first from the pool, the second gathered.
    let (ks, vs) = pool_a.layer_bytes(3).expect("layer bytes");
    within("piece", tx.send_stored_blocks(r, 3, 0, ks, vs, &table_a[..4])).await.expect("send");
    let (k, v) = pool_a.gather_layer(3, &table_a[4..]).expect("gather");
    within("piece", tx.send_blocks(r, 3, 4, &k, &v)).await.expect("send");
    // Layer 1 in two gathered pieces, the later blocks first.
    for range in [5..9, 0..5] {
        let (k, v) = pool_a.gather_layer(1, &table_a[range.clone()]).expect("gather");
        within("piece", tx.send_blocks(r, 1, range.start, &k, &v)).await.expect("send");
    }
    within("Ack", tx.complete(r)).await.expect("complete");
    assert_eq!(lock(&d.rx).take_ready(r).expect("ready"), table_b);
    assert_eq!(lock(&d.pool).gather(&table_b).expect("B"), pool_a.gather(&table_a).expect("A"));
    assert_eq!(lock(&d.rx).counters().layer_frames_accepted, 4 * 5, "at most two blocks per frame");
}

#[tokio::test]
async fn the_receiver_never_reads_kv_before_complete() {
    let d = DecodeSide::start(LocalServerConfig::default()).await;
    let l = d.layout;
    let (pool_a, table_a) = common::source(l, 4, 16);
    let (r, _) = d.reserve(4, Duration::from_secs(30));
    let mut tx = d.connect(&peer(&l, "smollm2", 0x11), 2, 1 << 16).await.expect("connect");
    send_layers(&mut tx, &pool_a, &table_a, r, &[0, 1, 2, 3]).await;
    // The frames were all processed once a Complete for another (unknown)
    // reservation is answered: the socket is ordered.
    let bogus = Reservation { id: kvtransfer::ReservationId(999), generation: 1 };
    assert!(matches!(within("refusal", tx.complete(bogus)).await, Err(TransferError::PeerAbort { .. })));
    assert_eq!(lock(&d.rx).counters().layer_frames_accepted, 4);
    assert_eq!(lock(&d.rx).state(r), Some(ReservationState::Receiving), "not readable before Complete");
    assert!(lock(&d.rx).take_ready(r).is_err());
    within("Ack", tx.complete(r)).await.expect("complete");
    assert_eq!(lock(&d.rx).state(r), Some(ReservationState::Ready));
}

#[tokio::test]
async fn handshake_rejects_fingerprint_and_version_group_mismatch() {
    let d = DecodeSide::start(LocalServerConfig::default()).await;
    let l = d.layout;
    match d.connect(&peer(&l, "smollm2", 0x99), 2, 1 << 16).await {
        Err(e @ TransferError::Rejected { reason: RejectReason::Fingerprint }) => {
            assert_eq!(e.kind(), kvtransfer::ErrorKind::VersionMismatch)
        }
        other => panic!("expected a fingerprint rejection, got {other:?}"),
    }
    match d.connect(&peer(&l, "llama-8b", 0x11), 2, 1 << 16).await {
        Err(TransferError::Rejected { reason: RejectReason::VersionGroup }) => {}
        other => panic!("expected a version-group rejection, got {other:?}"),
    }
    let s = d.wait_stats("two rejected connections closed", |s| s.closed_by("rejected") == 2).await;
    assert_eq!((s.connections_accepted, s.rings_mapped), (2, 0), "no ring is taken before the handshake passes");
    let c = lock(&d.rx).counters().clone();
    assert_eq!(c.hello_rejected(RejectReason::Fingerprint), 1);
    assert_eq!(c.hello_rejected(RejectReason::VersionGroup), 1);
    assert_eq!(c.hello_accepted, 0);
}

#[tokio::test]
async fn corrupt_slot_fails_the_reservation_and_returns_blocks_once() {
    let d = DecodeSide::start(LocalServerConfig::default()).await;
    let l = d.layout;
    let (r, table_b) = d.reserve(3, Duration::from_secs(30));
    let slot_bytes = 4096;
    let ring = raw_ring(2, slot_bytes, SealFlags::SHRINK | SealFlags::GROW);
    let (mut s, answer) = raw_connect(&d, &ring, 2, slot_bytes as u32).await;
    assert_eq!(answer, Reply::Local(RING_ACK, vec![]));

    // The checksum is of the bytes as written; then one byte of the slot
    // flips, as a sender rewriting a slot it no longer owns would do.
    let mut payload: Vec<u8> = (0..3 * 2 * side(&l)).map(|i| (i * 7 + 1) as u8).collect();
    let crc = crc32c::crc32c(&payload);
    payload[17] ^= 0x40;
    raw_data(&mut s, &ring, slot_bytes, 1, r, 1, 0, 3, crc, &payload).await;

    assert_eq!(read_reply(&mut s).await, Reply::Local(CREDIT, 1u32.to_le_bytes().to_vec()), "slot credited back");
    match read_reply(&mut s).await {
        Reply::Frame(Frame::Abort(a)) => {
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

    // A refused frame leaves the connection in sync: it still serves.
    let unknown = Complete { reservation: 999, generation: 1, n_layers: l.n_layers as u32 };
    let mut wire = Vec::new();
    Frame::Complete(unknown).encode(&mut wire).expect("encode");
    within("complete written", s.write_all(&wire)).await.expect("write");
    match read_reply(&mut s).await {
        Reply::Frame(Frame::Abort(a)) => assert_eq!((a.reservation, a.reason), (999, AbortReason::ProtocolViolation)),
        other => panic!("expected Abort(ProtocolViolation), got {other:?}"),
    }
    assert_eq!(d.server.stats().connections_closed(), 0);
}

#[tokio::test]
async fn dropped_sender_leaves_reservation_unready_until_its_lease_returns_blocks() {
    let d = DecodeSide::start(LocalServerConfig::default()).await;
    let l = d.layout;
    let (pool_a, table_a) = common::source(l, 4, 16);
    // Expiry is driven by the clock value passed in, not by waiting; the
    // lease is only long enough that a slow machine cannot expire it early.
    let (r, table_b) = d.reserve(4, Duration::from_secs(2));
    let mut tx = d.connect(&peer(&l, "smollm2", 0x11), 2, 2 * 2 * side(&l)).await.expect("connect");
    send_layers(&mut tx, &pool_a, &table_a, r, &[3, 0]).await;
    drop(tx);

    let s = d.wait_stats("the dropped connection seen closed", |s| s.connections_closed() == 1).await;
    assert_eq!(s.closed_by("peer_closed"), 1);
    let mut rx = lock(&d.rx);
    assert_eq!(rx.counters().layer_frames_accepted, 4, "both layers (two frames each) arrived before the drop");
    assert_eq!(rx.state(r), Some(ReservationState::Receiving));
    assert!(rx.take_ready(r).is_err(), "half a transfer is never readable");

    let deadline = rx.next_deadline().expect("the reservation's lease");
    assert!(rx.poll_released(deadline - Duration::from_millis(1)).is_empty(), "nothing before the lease ends");
    let released = rx.poll_released(deadline);
    assert_eq!(released.len(), 1);
    assert_eq!((released[0].cause, &released[0].blocks), (ReleaseCause::LeaseExpired, &table_b));
    assert!(rx.poll_released(deadline + Duration::from_secs(1)).is_empty(), "blocks come back exactly once");
    drop(rx);
    let mut pool = lock(&d.pool);
    pool.release(&released[0].blocks).expect("release");
    assert_eq!(pool.stats().used, 3, "only the decoys remain: no block leaked");
}

#[tokio::test]
async fn rings_that_could_fault_or_exceed_the_limits_are_refused() {
    let config = LocalServerConfig { max_slots: 4, ..LocalServerConfig::default() };
    let d = DecodeSide::start(config).await;
    let l = d.layout;

    // Not sealed against shrinking: the sender could truncate it under the
    // server's mapping (SIGBUS).
    let unsealed = raw_ring(2, 4096, SealFlags::GROW);
    let (mut s, answer) = raw_connect(&d, &unsealed, 2, 4096).await;
    assert_eq!(answer, Reply::Local(RING_REJECT, 3u16.to_le_bytes().to_vec()), "NotSealed");
    expect_closed(&mut s, "server closing after refusing the ring").await;

    // Sealed, but smaller than announced.
    let short = raw_ring(1, 4096, SealFlags::SHRINK | SealFlags::GROW);
    let (mut s, answer) = raw_connect(&d, &short, 2, 4096).await;
    assert_eq!(answer, Reply::Local(RING_REJECT, 4u16.to_le_bytes().to_vec()), "Size");
    expect_closed(&mut s, "server closing after refusing the ring").await;

    // A well-formed ring over the server's slot limit.
    match d.connect(&peer(&l, "smollm2", 0x11), 5, 1 << 16).await {
        Err(e @ TransferError::Protocol(_)) => assert!(e.to_string().contains("limits"), "{e}"),
        other => panic!("expected the ring refused, got {other:?}"),
    }
    let s = d.wait_stats("three refused rings counted", |s| s.closed_by("ring_refused") == 3).await;
    assert_eq!(s.rings_mapped, 0);
    assert_eq!(RingRefusal::NotSealed.to_string(), "the ring is not sealed against shrinking");
    // And a sender within the limits is served.
    assert!(d.connect(&peer(&l, "smollm2", 0x11), 4, 1 << 16).await.is_ok());
}

#[tokio::test]
async fn data_outside_the_ring_or_inline_closes_the_connection() {
    let d = DecodeSide::start(LocalServerConfig::default()).await;
    let l = d.layout;
    let (r, _) = d.reserve(2, Duration::from_secs(30));
    let slot_bytes = 4096;
    let ring = raw_ring(2, slot_bytes, SealFlags::SHRINK | SealFlags::GROW);

    // Slot 2 of a 2-slot ring.
    let (mut s, answer) = raw_connect(&d, &ring, 2, slot_bytes as u32).await;
    assert_eq!(answer, Reply::Local(RING_ACK, vec![]));
    let payload = vec![1u8; 2 * side(&l)];
    let msg = data_msg(2, r, [0, 0, 1, crc32c::crc32c(&payload), payload.len() as u32]);
    within("Data written", s.write_all(&msg)).await.expect("write");
    expect_closed(&mut s, "server closing on a slot outside the ring").await;

    // A length longer than a slot.
    let (mut s, _) = raw_connect(&d, &ring, 2, slot_bytes as u32).await;
    let msg = data_msg(0, r, [0, 0, 1, 0, slot_bytes as u32 + 1]);
    within("Data written", s.write_all(&msg)).await.expect("write");
    expect_closed(&mut s, "server closing on a length past the slot").await;

    // A LayerData frame with its payload inline: not on this transport.
    let (mut s, _) = raw_connect(&d, &ring, 2, slot_bytes as u32).await;
    let mut wire = Vec::new();
    Frame::LayerData(LayerData::new(r.id.0, r.generation, 0, 0, 1, vec![1u8; 2 * side(&l)]))
        .encode(&mut wire)
        .expect("encode");
    within("inline frame written", s.write_all(&wire)).await.expect("write");
    expect_closed(&mut s, "server closing on an inline payload").await;

    // Garbage instead of Hello.
    let path = format!("\0{}", d.server.local_addr().trim_start_matches('@'));
    let mut s = within("raw connect", UnixStream::connect(path)).await.expect("connect");
    within("garbage written", s.write_all(b"GET / HTTP/1.1\r\n\r\n")).await.expect("write");
    expect_closed(&mut s, "server closing the garbage connection").await;

    let st = d.wait_stats("four bad connections counted", |s| s.connections_closed() == 4).await;
    assert_eq!((st.closed_by("bad_slot"), st.closed_by("decode")), (2, 2));
    assert_eq!(lock(&d.rx).counters().layer_frames_accepted, 0, "nothing outside the ring was read");
    assert_eq!(lock(&d.rx).state(r), Some(ReservationState::Receiving), "the reservation waits for its lease");
}

#[tokio::test]
async fn silent_peers_time_out_on_both_sides() {
    // Server side: a client that completes the handshake and goes quiet.
    let config = LocalServerConfig { idle_timeout: Duration::from_millis(250), ..LocalServerConfig::default() };
    let d = DecodeSide::start(config).await;
    let ring = raw_ring(1, 4096, SealFlags::SHRINK);
    let (mut s, answer) = raw_connect(&d, &ring, 1, 4096).await;
    assert_eq!(answer, Reply::Local(RING_ACK, vec![]));
    expect_closed(&mut s, "server closing an idle connection").await;
    let st = d.wait_stats("the idle close counted", |s| s.connections_closed() == 1).await;
    assert_eq!(st.closed_by("idle"), 1);
    assert_eq!(kvtransfer::CloseReason::Idle(Duration::ZERO).as_str(), "idle");

    // Sender side: a listener that accepts and never answers.
    let addr = unique_addr();
    let listener = UnixListener::bind(format!("\0{}", &addr[1..])).expect("bind");
    let l = layout();
    let config = LocalSenderConfig { timeout: Duration::from_millis(200), ..LocalSenderConfig::default() };
    let me = peer(&l, "smollm2", 0x11);
    let connecting = LocalKvSender::connect(&addr, &me, l, config);
    match within("the sender giving up", connecting).await {
        Err(e @ TransferError::Timeout { .. }) => assert_eq!(e.kind(), kvtransfer::ErrorKind::Deadline),
        other => panic!("expected a timeout, got {other:?}"),
    }
    drop(listener);
}

/// See the TCP test of the same name: `check_open` fails once the server
/// closed the pooled connection for idling.
#[tokio::test]
async fn check_open_sees_the_idle_close() {
    let config = LocalServerConfig { idle_timeout: Duration::from_millis(200), ..LocalServerConfig::default() };
    let d = DecodeSide::start(config).await;
    let l = d.layout;
    let (pool_a, table_a) = common::source(l, 2, 16);
    let (r, _) = d.reserve(2, Duration::from_secs(30));
    let mut tx = d.connect(&peer(&l, "smollm2", 0x11), 2, 1 << 16).await.expect("connect");
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
    let d = DecodeSide::start(LocalServerConfig::default()).await;
    let l = d.layout;
    let (pool_a, table_a) = common::source(l, 2, 16);
    let (r, _) = d.reserve(2, Duration::from_secs(30));
    let mut tx = d.connect(&peer(&l, "smollm2", 0x11), 2, 1 << 16).await.expect("connect");
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

#[tokio::test]
async fn a_filesystem_socket_serves_and_is_removed_on_shutdown() {
    let dir = std::env::temp_dir().join(format!("tandem-kv-local-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let path = dir.join("kv.sock");
    // A stale socket file from an earlier run is replaced.
    drop(std::os::unix::net::UnixListener::bind(&path).expect("stale socket"));
    let addr = path.to_str().expect("utf-8 path").to_owned();
    let d = DecodeSide::start_at(&addr, LocalServerConfig::default()).await;
    assert_eq!(d.server.local_addr(), addr);

    let l = d.layout;
    let (pool_a, table_a) = common::source(l, 3, 16);
    let (r, table_b) = d.reserve(3, Duration::from_secs(30));
    let mut tx = d.connect(&peer(&l, "smollm2", 0x11), 2, 1 << 16).await.expect("connect");
    send_layers(&mut tx, &pool_a, &table_a, r, &[0, 1, 2, 3]).await;
    within("Ack", tx.complete(r)).await.expect("complete");
    assert_eq!(lock(&d.rx).take_ready(r).expect("ready"), table_b);
    assert_eq!(lock(&d.pool).gather(&table_b).expect("B"), pool_a.gather(&table_a).expect("A"));

    d.server.shutdown();
    assert!(!path.exists(), "the socket file is removed");
    let _ = std::fs::remove_dir(&dir);
}
