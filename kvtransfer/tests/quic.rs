//! The QUIC transport on real loopback UDP: KV lands bit-exact in another
//! pool's blocks; handshakes refuse the wrong group, layout fingerprint,
//! pinned certificate, CA or missing client certificate with typed errors;
//! corruption is caught; a peer that goes silent never hangs either side.
//!
//! Every wait is bounded by a timeout whose message says what did not
//! happen; events are awaited (server stats watch, stream reads), never
//! slept for. A peer "dies" behind a UDP relay that starts dropping every
//! datagram, so neither end gets a close.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]

mod common;
mod net;

use net::{layout, lock, now, peer, side, within, WAIT};

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use engine::kv::KvPool;

use kvtransfer::frame::LAYER_DATA_OVERHEAD;
use kvtransfer::transport::quic::tls::ALPN;
use kvtransfer::{
    AbortReason, DecodeLimits, Decoded, ErrorKind, Frame, Hello, LayerData, Peer, PeerTrust, QuicKvSender,
    QuicKvServer, QuicSenderConfig, QuicServerConfig, QuicServerStats, QuicTuning, Receiver, ReceiverConfig,
    RejectReason, ReleaseCause, Reservation, ReservationState, TlsError, TlsIdentity, TransferError, PROTOCOL_VERSION,
};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::UdpSocket;
use types::kv::{BlockId, KvLayout};

/// A cluster CA that signs node certificates.
struct Ca {
    issuer: Issuer<'static, KeyPair>,
    cert: CertificateDer<'static>,
}

impl Ca {
    fn new(name: &str) -> Self {
        let key = KeyPair::generate().expect("CA key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let cert = params.self_signed(&key).expect("CA cert").der().clone();
        Self { issuer: Issuer::new(params, key), cert }
    }

    fn trust(&self) -> PeerTrust {
        PeerTrust::ca(vec![self.cert.clone()]).expect("CA trust")
    }

    /// A node certificate for `name`, signed by this CA.
    fn node(&self, name: &str) -> TlsIdentity {
        let key = KeyPair::generate().expect("node key");
        let params = CertificateParams::new(vec![name.to_string()]).expect("node params");
        let cert = params.signed_by(&key, &self.issuer).expect("sign node");
        let key = PrivateKeyDer::try_from(key.serialize_der()).expect("key der");
        TlsIdentity::new(vec![cert.der().clone()], key).expect("identity")
    }
}

/// Decode side: a receiver, a pool with some decoy blocks taken, and a server.
struct DecodeSide {
    layout: KvLayout,
    rx: Arc<Mutex<Receiver>>,
    pool: Arc<Mutex<KvPool>>,
    server: QuicKvServer,
}

impl DecodeSide {
    async fn start(config: QuicServerConfig) -> Self {
        let l = layout();
        let rx = Arc::new(Mutex::new(Receiver::new(peer(&l, "smollm2", 0x11), ReceiverConfig::new(l)).expect("rx")));
        let pool = Arc::new(Mutex::new(KvPool::new(l, 32).expect("pool B")));
        let _decoys = lock(&pool).allocate(3).expect("decoys");
        let server = QuicKvServer::bind("127.0.0.1:0", rx.clone(), pool.clone(), config).await.expect("bind");
        Self { layout: l, rx, pool, server }
    }

    /// A server with a fresh self-signed certificate, and a sender config pinning it.
    async fn pinned() -> (Self, QuicSenderConfig) {
        let id = TlsIdentity::self_signed(&["tandem-kv"]).expect("self-signed");
        let pin = PeerTrust::Pinned(id.fingerprint());
        let d = Self::start(QuicServerConfig::new(id)).await;
        (d, sender_config(pin))
    }

    fn reserve(&self, n: usize, ttl: Duration) -> (Reservation, Vec<BlockId>) {
        let blocks = lock(&self.pool).allocate(n).expect("alloc B");
        (lock(&self.rx).reserve(blocks.clone(), ttl, now()).expect("reserve"), blocks)
    }

    async fn wait_stats(&self, what: &str, pred: impl FnMut(&QuicServerStats) -> bool) -> QuicServerStats {
        let mut w = self.server.watch_stats();
        let s = within(what, w.wait_for(pred)).await.expect("server alive").clone();
        s
    }

    async fn connect(&self, p: &Peer, config: QuicSenderConfig) -> Result<QuicKvSender, TransferError> {
        within("handshake", QuicKvSender::connect(self.server.local_addr(), p, self.layout, config)).await
    }
}

fn sender_config(trust: PeerTrust) -> QuicSenderConfig {
    QuicSenderConfig { timeout: WAIT, ..QuicSenderConfig::new(trust) }
}

/// Sends `layers` of `table` from `pool`, in the order given.
async fn send_layers(tx: &mut QuicKvSender, pool: &KvPool, table: &[BlockId], r: Reservation, layers: &[usize]) {
    for &layer in layers {
        let (k, v) = pool.gather_layer(layer, table).expect("gather layer");
        within("a layer sent", tx.send_layer(r, layer, &k, &v)).await.expect("send layer");
    }
}

#[tokio::test]
async fn full_transfer_lands_bit_exact_in_other_blocks() {
    let (d, config) = DecodeSide::pinned().await;
    let l = d.layout;
    let (pool_a, table_a) = common::source(l, 5, 32);
    let (r, table_b) = d.reserve(5, Duration::from_secs(30));
    assert_ne!(table_a, table_b, "the test must move KV between different ids");

    // Two blocks per frame: 3 frames per layer.
    let config = QuicSenderConfig { max_frame_bytes: LAYER_DATA_OVERHEAD + 2 * 2 * side(&l), ..config };
    let mut tx = d.connect(&peer(&l, "smollm2", 0x11), config).await.expect("connect");
    let reversed: Vec<usize> = (0..l.n_layers).rev().collect();
    send_layers(&mut tx, &pool_a, &table_a, r, &reversed).await;
    let ack = within("Ack", tx.complete(r)).await.expect("complete");
    assert_eq!((ack.reservation, ack.generation), (r.id.0, r.generation));

    let blocks = lock(&d.rx).take_ready(r).expect("ready after Ack");
    assert_eq!(blocks, table_b);
    let got = lock(&d.pool).gather(&blocks).expect("gather B");
    assert_eq!(got, pool_a.gather(&table_a).expect("gather A"), "KV bytes differ after the transfer");
    assert_eq!(lock(&d.rx).counters().layer_frames_accepted, 4 * 3);
    assert_eq!(tx.bytes_sent(), (4 * 3 * LAYER_DATA_OVERHEAD + 4 * 5 * 2 * side(&l)) as u64);

    // Dropping the sender ends its connection the normal way.
    drop(tx);
    let s = d.wait_stats("the dropped connection seen closed", |s| s.connections_closed() == 1).await;
    assert_eq!(s.closed_by("peer_closed"), 1, "{s:?}");
}

#[tokio::test]
async fn handshake_rejects_fingerprint_and_version_group_mismatch() {
    let (d, config) = DecodeSide::pinned().await;
    let l = d.layout;
    match d.connect(&peer(&l, "smollm2", 0x99), config.clone()).await {
        Err(e @ TransferError::Rejected { reason: RejectReason::Fingerprint }) => {
            assert_eq!(e.kind(), ErrorKind::VersionMismatch)
        }
        other => panic!("expected a fingerprint rejection, got {other:?}"),
    }
    match d.connect(&peer(&l, "llama-8b", 0x11), config).await {
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
async fn a_wrong_pinned_certificate_is_refused_before_any_frame() {
    let id = TlsIdentity::self_signed(&["tandem-kv"]).expect("self-signed");
    let real = id.fingerprint();
    let d = DecodeSide::start(QuicServerConfig::new(id)).await;
    let l = d.layout;
    let stale = TlsIdentity::self_signed(&["tandem-kv"]).expect("another cert").fingerprint();
    match d.connect(&peer(&l, "smollm2", 0x11), sender_config(PeerTrust::Pinned(stale))).await {
        Err(e @ TransferError::Tls(TlsError::FingerprintMismatch { .. })) => {
            assert_eq!(e.kind(), ErrorKind::VersionMismatch);
            let TransferError::Tls(TlsError::FingerprintMismatch { expected, got }) = e else { unreachable!() };
            assert_eq!((expected, got), (stale, real));
        }
        other => panic!("expected a fingerprint mismatch, got {other:?}"),
    }
    let s = d.wait_stats("the refused handshake counted", |s| s.closed_by("tls") == 1).await;
    assert_eq!(s.connections_closed(), 1);
    let c = lock(&d.rx).counters().clone();
    assert_eq!(c.hello_accepted + c.hello_rejected(RejectReason::Fingerprint), 0, "no protocol handshake happened");
}

#[tokio::test]
async fn cluster_ca_with_client_certificates() {
    let ca = Ca::new("tandem test CA");
    let config = QuicServerConfig { client_trust: Some(ca.trust()), ..QuicServerConfig::new(ca.node("tandem-kv")) };
    let d = DecodeSide::start(config).await;
    let l = d.layout;
    let me = peer(&l, "smollm2", 0x11);

    // A sender with a node certificate of the same CA: served end to end.
    let good = QuicSenderConfig { identity: Some(ca.node("prefill-0")), ..sender_config(ca.trust()) };
    let (pool_a, table_a) = common::source(l, 2, 32);
    let (r, table_b) = d.reserve(2, Duration::from_secs(30));
    let mut tx = d.connect(&me, good.clone()).await.expect("mutual TLS connect");
    send_layers(&mut tx, &pool_a, &table_a, r, &[0, 1, 2, 3]).await;
    within("Ack", tx.complete(r)).await.expect("complete");
    let blocks = lock(&d.rx).take_ready(r).expect("ready");
    assert_eq!(lock(&d.pool).gather(&blocks).expect("B"), pool_a.gather(&table_a).expect("A"));
    assert_eq!(blocks, table_b);
    drop(tx);

    // No client certificate: the decode worker refuses the handshake.
    match d.connect(&me, sender_config(ca.trust())).await {
        Err(e @ TransferError::Tls(TlsError::RefusedByPeer(_))) => assert_eq!(e.kind(), ErrorKind::VersionMismatch),
        other => panic!("expected the server to refuse a sender without a certificate, got {other:?}"),
    }
    // A client certificate from another CA: refused too.
    let rogue = Ca::new("rogue CA");
    let config = QuicSenderConfig { identity: Some(rogue.node("prefill-0")), ..sender_config(ca.trust()) };
    assert!(matches!(d.connect(&me, config).await, Err(TransferError::Tls(TlsError::RefusedByPeer(_)))));
    // A sender trusting another CA refuses the decode worker.
    let config = QuicSenderConfig { identity: Some(ca.node("prefill-0")), ..sender_config(rogue.trust()) };
    assert!(matches!(d.connect(&me, config).await, Err(TransferError::Tls(TlsError::Untrusted(_)))));
    // The right CA but a certificate for another name.
    let config = QuicSenderConfig { server_name: "decode-7".into(), ..good };
    assert!(matches!(d.connect(&me, config).await, Err(TransferError::Tls(TlsError::Untrusted(_)))));

    let s = d.wait_stats("four refused handshakes counted", |s| s.closed_by("tls") == 4).await;
    assert_eq!(s.closed_by("peer_closed"), 1, "{s:?}");
    assert_eq!(lock(&d.rx).counters().hello_accepted, 1, "refused peers never reached the protocol handshake");
}

#[test]
fn identities_and_trust_load_from_pem_files() {
    let ca = Ca::new("tandem file CA");
    let node = KeyPair::generate().expect("key");
    let cert = CertificateParams::new(vec!["tandem-kv".to_string()])
        .expect("params")
        .signed_by(&node, &ca.issuer)
        .expect("sign");
    let dir = std::env::temp_dir().join(format!("kvtransfer-quic-pem-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let (cert_path, key_path, ca_path) = (dir.join("node.pem"), dir.join("node.key"), dir.join("ca.pem"));
    std::fs::write(&cert_path, cert.pem()).expect("write cert");
    std::fs::write(&key_path, node.serialize_pem()).expect("write key");
    let ca_pem = rcgen::CertifiedIssuer::self_signed(
        {
            let mut p = CertificateParams::new(Vec::<String>::new()).expect("params");
            p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            p
        },
        KeyPair::generate().expect("key"),
    )
    .expect("another CA")
    .pem();
    std::fs::write(&ca_path, ca_pem).expect("write CA");

    let id = TlsIdentity::from_pem_files(&cert_path, &key_path).expect("identity from files");
    assert_eq!(id.cert_chain()[0].as_ref(), cert.der().as_ref());
    assert!(matches!(PeerTrust::ca_from_pem_file(&ca_path), Ok(PeerTrust::Ca(_))));
    // A key that is not the certificate's, and files that are not PEM, are typed errors.
    let other = dir.join("other.key");
    std::fs::write(&other, KeyPair::generate().expect("key").serialize_pem()).expect("write");
    assert!(matches!(TlsIdentity::from_pem_files(&cert_path, &other), Err(TlsError::Config { what: "key", .. })));
    assert!(matches!(TlsIdentity::from_pem_files(&key_path, &key_path), Err(TlsError::Config { .. })));
    assert!(matches!(PeerTrust::ca_from_pem_file(dir.join("missing.pem")), Err(TlsError::Config { .. })));
    let fp = id.fingerprint();
    assert_eq!(fp.to_string().parse::<kvtransfer::CertFingerprint>().expect("hex"), fp);
    let _ = std::fs::remove_dir_all(&dir);
}

// ------------------------------------------------- raw QUIC peers (CA mode)

/// A plain quinn client trusting `ca`.
fn raw_client(ca: &Ca) -> quinn::ClientConfig {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.cert.clone()).expect("root");
    let mut c = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("TLS 1.3")
        .with_root_certificates(roots)
        .with_no_client_auth();
    c.alpn_protocols = vec![ALPN.to_vec()];
    quinn::ClientConfig::new(Arc::new(quinn::crypto::rustls::QuicClientConfig::try_from(c).expect("QUIC TLS")))
}

async fn raw_connect(addr: SocketAddr, ca: &Ca) -> quinn::Connection {
    let ep = quinn::Endpoint::client("127.0.0.1:0".parse().expect("addr")).expect("client endpoint");
    let connecting = ep.connect_with(raw_client(ca), addr, "tandem-kv").expect("connect");
    within("raw QUIC handshake", connecting).await.expect("raw handshake")
}

/// Opens the stream and does the protocol handshake by hand.
async fn raw_handshake(d: &DecodeSide, ca: &Ca) -> (quinn::Connection, quinn::SendStream, quinn::RecvStream, Vec<u8>) {
    let conn = raw_connect(d.server.local_addr(), ca).await;
    let (mut s, mut r) = within("stream opened", conn.open_bi()).await.expect("open");
    let p = peer(&d.layout, "smollm2", 0x11);
    let hello =
        Hello { version_group: p.version_group, fingerprint: p.fingerprint, protocol_version: PROTOCOL_VERSION };
    let mut wire = Vec::new();
    Frame::Hello(hello).encode(&mut wire).expect("encode");
    within("hello written", s.write_all(&wire)).await.expect("write");
    let mut buf = Vec::new();
    assert!(matches!(read_frame(&mut r, &mut buf).await, Frame::HelloAck(_)));
    (conn, s, r, buf)
}

async fn read_frame(r: &mut quinn::RecvStream, buf: &mut Vec<u8>) -> Frame {
    loop {
        if let Decoded::Frame { frame, consumed } = Frame::decode(buf, &DecodeLimits::default()).expect("valid reply") {
            buf.drain(..consumed);
            return frame;
        }
        let mut chunk = [0u8; 256];
        let n = within("a reply frame", r.read(&mut chunk)).await.expect("read");
        let n = n.expect("server ended the stream instead of replying");
        buf.extend_from_slice(&chunk[..n]);
    }
}

#[tokio::test]
async fn corrupt_payload_fails_the_reservation_and_returns_blocks_once() {
    let ca = Ca::new("tandem test CA");
    let d = DecodeSide::start(QuicServerConfig::new(ca.node("tandem-kv"))).await;
    let l = d.layout;
    let (r, table_b) = d.reserve(3, Duration::from_secs(30));
    let (_conn, mut s, mut rs, mut buf) = raw_handshake(&d, &ca).await;

    let payload: Vec<u8> = (0..3 * 2 * side(&l)).map(|i| (i * 7 + 1) as u8).collect();
    let mut wire = Vec::new();
    Frame::LayerData(LayerData::new(r.id.0, r.generation, 1, 0, 3, payload)).encode(&mut wire).expect("encode");
    wire[LAYER_DATA_OVERHEAD + 17] ^= 0x40;
    within("corrupt frame written", s.write_all(&wire)).await.expect("write");

    match read_frame(&mut rs, &mut buf).await {
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
    assert!(lock(&d.pool).gather(&table_b).expect("gather").iter().all(|&b| b == 0), "nothing was written");
    assert_eq!(d.server.stats().connections_closed(), 0, "a refused frame keeps the stream");
}

#[tokio::test]
async fn first_frame_not_hello_closes_the_connection() {
    let ca = Ca::new("tandem test CA");
    let d = DecodeSide::start(QuicServerConfig::new(ca.node("tandem-kv"))).await;
    let conn = raw_connect(d.server.local_addr(), &ca).await;
    let (mut s, mut r) = within("stream opened", conn.open_bi()).await.expect("open");
    within("garbage written", s.write_all(b"GET / HTTP/1.1\r\n\r\n")).await.expect("write");
    // The server ends the stream (or the connection): either way the read ends.
    let _ = within("the server ending the stream", r.read_to_end(1 << 16)).await;
    let st = d.wait_stats("the bad connection counted", |s| s.connections_closed() == 1).await;
    assert_eq!(st.closed_by("decode"), 1, "{st:?}");
}

// ------------------------------------------------------------ dead peers

/// A UDP relay between a client and `server` that can start dropping
/// every datagram, both ways: the peer behind it looks dead (no close, no
/// reset, nothing).
struct Relay {
    addr: SocketAddr,
    dead: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Relay {
    async fn start(server: SocketAddr) -> Self {
        let front = UdpSocket::bind("127.0.0.1:0").await.expect("relay front");
        let back = UdpSocket::bind("127.0.0.1:0").await.expect("relay back");
        back.connect(server).await.expect("relay to server");
        let addr = front.local_addr().expect("relay addr");
        let dead = Arc::new(AtomicBool::new(false));
        let d = dead.clone();
        let task = tokio::spawn(async move {
            let (mut a, mut b) = (vec![0u8; 65536], vec![0u8; 65536]);
            let mut client: Option<SocketAddr> = None;
            loop {
                tokio::select! {
                    Ok((n, from)) = front.recv_from(&mut a) => {
                        client = Some(from);
                        if !d.load(Ordering::SeqCst) {
                            let _ = back.send(&a[..n]).await;
                        }
                    }
                    Ok(n) = back.recv(&mut b) => {
                        if let (Some(c), false) = (client, d.load(Ordering::SeqCst)) {
                            let _ = front.send_to(&b[..n], c).await;
                        }
                    }
                }
            }
        });
        Self { addr, dead, task }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[tokio::test]
async fn a_server_that_never_answers_times_the_connect_out() {
    let l = layout();
    // A bound UDP socket that reads nothing: the handshake gets no reply.
    let silent = UdpSocket::bind("127.0.0.1:0").await.expect("silent socket");
    let pin = PeerTrust::Pinned(TlsIdentity::self_signed(&["x"]).expect("cert").fingerprint());
    let config = QuicSenderConfig { timeout: Duration::from_millis(300), ..QuicSenderConfig::new(pin) };
    let res = within(
        "the connect to time out",
        QuicKvSender::connect(silent.local_addr().expect("addr"), &peer(&l, "smollm2", 0x11), l, config),
    )
    .await;
    match res {
        Err(e @ TransferError::Timeout { .. }) => assert_eq!(e.kind(), ErrorKind::Deadline),
        other => panic!("expected a timeout, got {other:?}"),
    }
}

#[tokio::test]
async fn a_peer_that_goes_silent_mid_transfer_ends_in_timeouts_on_both_sides() {
    let id = TlsIdentity::self_signed(&["tandem-kv"]).expect("self-signed");
    let pin = PeerTrust::Pinned(id.fingerprint());
    let config = QuicServerConfig { idle_timeout: Duration::from_millis(400), ..QuicServerConfig::new(id) };
    let d = DecodeSide::start(config).await;
    let l = d.layout;
    let relay = Relay::start(d.server.local_addr()).await;
    let (pool_a, table_a) = common::source(l, 2, 32);
    let (r, _) = d.reserve(2, Duration::from_secs(30));
    let config = QuicSenderConfig { timeout: Duration::from_millis(400), ..QuicSenderConfig::new(pin) };
    let mut tx =
        within("connect through the relay", QuicKvSender::connect(relay.addr, &peer(&l, "smollm2", 0x11), l, config))
            .await
            .expect("connect");
    send_layers(&mut tx, &pool_a, &table_a, r, &[0, 1]).await;

    relay.dead.store(true, Ordering::SeqCst);
    // Whatever the sender does next, it gets a deadline error, not a hang.
    let (k, v) = pool_a.gather_layer(2, &table_a).expect("gather");
    let res = match within("the send to fail", tx.send_layer(r, 2, &k, &v)).await {
        Ok(()) => within("the complete to fail", tx.complete(r)).await.map(|_| ()),
        Err(e) => Err(e),
    };
    match res {
        Err(e) => assert_eq!(e.kind(), ErrorKind::Deadline, "{e:?}"),
        Ok(()) => panic!("a transfer through a dead relay cannot be acknowledged"),
    }
    // The server gives the silent connection up too, and the reservation
    // stays unready (its lease will return the blocks).
    let s = d.wait_stats("the server closing the silent connection", |s| s.connections_closed() == 1).await;
    assert_eq!(s.closed_by("idle"), 1, "{s:?}");
    assert_eq!(lock(&d.rx).state(r), Some(ReservationState::Receiving));
}

/// See the TCP test of the same name: `check_open` fails once the server
/// closed the pooled frame stream for idling.
#[tokio::test]
async fn check_open_sees_the_idle_close() {
    let id = TlsIdentity::self_signed(&["tandem-kv"]).expect("self-signed");
    let pin = PeerTrust::Pinned(id.fingerprint());
    let config = QuicServerConfig { idle_timeout: Duration::from_millis(300), ..QuicServerConfig::new(id) };
    let d = DecodeSide::start(config).await;
    let l = d.layout;
    let (pool_a, table_a) = common::source(l, 2, 32);
    let (r, _) = d.reserve(2, Duration::from_secs(30));
    let mut tx = d.connect(&peer(&l, "smollm2", 0x11), sender_config(pin)).await.expect("connect");
    send_layers(&mut tx, &pool_a, &table_a, r, &[0, 1, 2, 3]).await;
    within("Ack", tx.complete(r)).await.expect("complete");
    tx.check_open().expect("open after a transfer");
    d.wait_stats("the idle close counted", |s| s.closed_by("idle") == 1).await;
    let e = common::until_closed(|| tx.check_open()).await;
    assert_eq!(e.kind(), ErrorKind::Retryable, "{e:?}");
}

#[tokio::test]
async fn any_configured_path_datagram_size_completes_the_handshake() {
    // Loopback carries 64 KB datagrams; sizes above 9000 are clamped (larger
    // first flights stall quinn's handshake), so all of these connect.
    for path in [1200u16, 1472, 9000, 65000] {
        let id = TlsIdentity::self_signed(&["tandem-kv"]).expect("self-signed");
        let pin = PeerTrust::Pinned(id.fingerprint());
        let tuning = QuicTuning { path_udp_payload: path, ..QuicTuning::default() };
        let d = DecodeSide::start(QuicServerConfig { tuning: tuning.clone(), ..QuicServerConfig::new(id) }).await;
        let config = QuicSenderConfig { tuning, ..sender_config(pin) };
        let tx = d.connect(&peer(&d.layout, "smollm2", 0x11), config).await;
        let mtu = tx.unwrap_or_else(|e| panic!("path {path}: {e}")).connection_stats().path.current_mtu;
        assert!(mtu >= path.min(9000), "path {path}: datagrams of {mtu}");
    }
}
