//! QUIC transport throughput on loopback against TLS over TCP, in the same
//! run.
//!
//! Moves the KV of `BLOCKS` blocks of the real SmolLM2-135M layout (F16,
//! ~256 MiB) from pre-gathered layers into a destination as large as the
//! transfer, sender and receiver in this one process, interleaved run by
//! run so that noise from other work on the machine hits all of them alike:
//! - QUIC transport: `QuicKvSender` -> `QuicKvServer`, the sink copying each
//!   accepted payload to its place (checksums, framing, receiver rules);
//! - raw QUIC stream: the same bytes, same pieces, over one quinn stream
//!   with the same tuning, read straight into the destination (what quinn
//!   itself costs here);
//! - rustls over TCP: the same bytes, same pieces, through a tokio-rustls
//!   TLS 1.3 stream (ring and AES-128-GCM, like the QUIC transport), read
//!   straight into the destination — the baseline: encrypted transfer as
//!   plain TLS does it.
//!
//! Run: `cargo bench -p kvtransfer --bench quic` (optional args: frame sizes,
//! `256k` or `1` (MiB); `profile` to loop the QUIC transport alone).

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]

// The source pool there is the pool-to-pool benches'.
#[allow(dead_code)]
mod common;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

use common::{
    actor_hops, cpu_seconds, dst_sink, expected_dst, frame_payload, frame_sizes, gbps, lock, lock_take, peer, rates,
    read_into, summary_us, write_layers, Res, BLOCKS, LAYOUT, SIDE, TOTAL,
};
use kvtransfer::transport::quic::tls::ALPN;
use kvtransfer::{
    PeerTrust, QuicKvSender, QuicKvServer, QuicSenderConfig, QuicServerConfig, QuicTuning, Receiver, ReceiverConfig,
    TlsIdentity,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use types::kv::BlockId;

const RUNS: usize = 5;

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let profile = args.iter().any(|a| a == "profile");
    let frames = frame_sizes(&args, &[1 << 20]);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let total = TOTAL;
    println!(
        "layout {LAYOUT:?}; {BLOCKS} blocks = {:.1} MiB per transfer; best and median of {RUNS} interleaved runs",
        total as f64 / (1 << 20) as f64
    );
    println!("tuning {:?}", tuning());
    // Distinct, deterministic bytes per layer (what is moved does not matter to the speed).
    let layers: Vec<(Vec<u8>, Vec<u8>)> = (0..LAYOUT.n_layers)
        .map(|l| {
            let k: Vec<u8> = (0..BLOCKS * SIDE).map(|i| (i * 31 + l * 7) as u8).collect();
            let v: Vec<u8> = k.iter().map(|b| !b).collect();
            (k, v)
        })
        .collect();
    let dst = Arc::new(Mutex::new(vec![1u8; total]));
    let id = TlsIdentity::self_signed(&["tandem-kv"])?;

    if profile {
        for _ in 0..10 {
            let c = cpu_seconds();
            let t = rt.block_on(quic_run(&layers, &dst, frames[0], &id))?;
            let cpu = cpu_seconds() - c;
            println!("quic transport: {:.2} GB/s, {:.2} CPU-s/GB", gbps(t), cpu / (total as f64 / 1e9));
        }
        return Ok(());
    }
    for max_frame in frames {
        let chunk = frame_payload(max_frame);
        println!("\nframes <= {} KiB ({chunk} bytes of payload)", max_frame >> 10);
        let [mut quic, mut raw_quic, mut tls]: [Vec<Duration>; 3] = Default::default();
        let mut last_lock = None;
        for _ in 0..RUNS {
            let buf = std::mem::take(&mut *lock(&dst));
            let (t, buf) = rt.block_on(tls_run(&layers, buf, chunk / 2))?;
            tls.push(t);
            let (t, buf) = rt.block_on(raw_quic_run(&layers, buf, chunk / 2))?;
            raw_quic.push(t);
            *lock(&dst) = buf;
            lock_take();
            quic.push(rt.block_on(quic_run(&layers, &dst, max_frame, &id))?);
            last_lock = lock_take();
        }
        if *lock(&dst) != expected_dst(&layers, chunk) {
            return Err("bytes differ after the QUIC transfer".into());
        }
        let [q, r, t] = [&quic, &raw_quic, &tls].map(|d| rates(d));
        println!("  quic transport (memory -> memory): {:6.2} GB/s best, {:6.2} median", q.0, q.1);
        println!("  raw quic stream (same tuning):     {:6.2} GB/s best, {:6.2} median", r.0, r.1);
        println!("  rustls over tcp:                   {:6.2} GB/s best, {:6.2} median", t.0, t.1);
        println!("  ratio quic transport / rustls-tcp: {:.2} best, {:.2} median (goal >= 0.8)", q.0 / t.0, q.1 / t.1);
        println!("  ratio raw quic / rustls-tcp:       {:.2} best, {:.2} median", r.0 / t.0, r.1 / t.1);
        if let Some(l) = last_lock {
            println!("  receiver lock (last run): {l}");
        }
    }
    let idle = rt.block_on(actor_hops(Arc::new(std::sync::atomic::AtomicBool::new(true)), 100_000));
    println!("\nactor round trip (a request to an owning task and its answer), idle runtime: {}", summary_us(&idle));
    Ok(())
}

/// The transport's default tuning (path-MTU discovery takes loopback to 64 KB datagrams).
fn tuning() -> QuicTuning {
    QuicTuning::default()
}

/// The QUIC transport, memory -> memory.
async fn quic_run(
    layers: &[(Vec<u8>, Vec<u8>)],
    dst: &Arc<Mutex<Vec<u8>>>,
    max_frame: usize,
    id: &TlsIdentity,
) -> Res<Duration> {
    let sink = dst_sink(dst);
    let rx = Arc::new(Mutex::new(Receiver::new(peer(), ReceiverConfig::new(LAYOUT))?));
    let config = QuicServerConfig { tuning: tuning(), ..QuicServerConfig::new(id.clone()) };
    let server = QuicKvServer::bind("127.0.0.1:0", rx.clone(), sink, config).await?;
    let ids: Vec<BlockId> = (0..BLOCKS as BlockId).collect();
    let r = lock(&rx).reserve(ids, Duration::from_secs(60), tokio::time::Instant::now())?;
    let config =
        QuicSenderConfig { max_frame_bytes: max_frame, ..QuicSenderConfig::new(PeerTrust::Pinned(id.fingerprint())) };
    let mut tx = QuicKvSender::connect(server.local_addr(), &peer(), LAYOUT, config).await?;
    let start = Instant::now();
    for (layer, (k, v)) in layers.iter().enumerate() {
        tx.send_layer(r, layer, k, v).await?;
    }
    tx.complete(r).await?;
    let elapsed = start.elapsed();
    if std::env::var_os("QUIC_STATS").is_some() {
        let s = tx.connection_stats();
        println!(
            "  path mtu {} (probes {} sent, {} lost, black holes {}) cwnd {} rtt {:?}; udp tx {} datagrams / {} ios, rx {} / {}; lost {} packets; congestion events {}",
            s.path.current_mtu, s.path.sent_plpmtud_probes, s.path.lost_plpmtud_probes, s.path.black_holes_detected, s.path.cwnd, s.path.rtt, s.udp_tx.datagrams, s.udp_tx.ios, s.udp_rx.datagrams, s.udp_rx.ios,
            s.path.lost_packets, s.path.congestion_events
        );
    }
    drop(tx);
    server.shutdown();
    Ok(elapsed)
}

/// TLS 1.3 configs around a fresh self-signed certificate, with the
/// transport's crypto: ring, AES-128-GCM preferred.
fn tls_configs() -> Res<(rustls::ServerConfig, rustls::ClientConfig)> {
    let mut provider = rustls::crypto::ring::default_provider();
    provider.cipher_suites.sort_by_key(|s| s.suite() != rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
    let provider = Arc::new(provider);
    let ck = rcgen::generate_simple_self_signed(vec!["tandem-kv".to_string()])?;
    let cert: CertificateDer<'static> = ck.cert.der().clone();
    let key = PrivateKeyDer::try_from(ck.signing_key.serialize_der())?;
    let mut server = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_no_client_auth()
        .with_single_cert(vec![cert.clone()], key)?;
    server.alpn_protocols = vec![ALPN.to_vec()];
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert)?;
    let mut client = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(roots)
        .with_no_client_auth();
    client.alpn_protocols = vec![ALPN.to_vec()];
    Ok((server, client))
}

/// The same bytes through tokio-rustls over TCP, read straight into `dst`.
async fn tls_run(layers: &[(Vec<u8>, Vec<u8>)], mut dst: Vec<u8>, piece: usize) -> Res<(Duration, Vec<u8>)> {
    let (server, client) = tls_configs()?;
    let (server, client) = (Arc::new(server), Arc::new(client));
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let reader = tokio::spawn(async move {
        let (s, _) = listener.accept().await?;
        s.set_nodelay(true)?;
        let mut s = tokio_rustls::TlsAcceptor::from(server).accept(s).await?;
        read_into(&mut s, &mut dst).await?;
        s.write_all(b"k").await?;
        s.flush().await?;
        Ok::<_, std::io::Error>(dst)
    });
    let tcp = TcpStream::connect(addr).await?;
    tcp.set_nodelay(true)?;
    let name = rustls::pki_types::ServerName::try_from("tandem-kv")?;
    let mut s = tokio_rustls::TlsConnector::from(client).connect(name, tcp).await?;
    let start = Instant::now();
    write_layers(&mut s, layers, piece).await?;
    let mut ack = [0u8; 1];
    s.read_exact(&mut ack).await?;
    let elapsed = start.elapsed();
    let dst = reader.await??;
    Ok((elapsed, dst))
}

/// The same bytes over one plain quinn stream with the transport's tuning.
async fn raw_quic_run(layers: &[(Vec<u8>, Vec<u8>)], mut dst: Vec<u8>, piece: usize) -> Res<(Duration, Vec<u8>)> {
    let (server, client) = tls_configs()?;
    let tuning = tuning();
    let mut transport = quinn::TransportConfig::default();
    transport
        .stream_receive_window(quinn::VarInt::from_u32(tuning.window))
        .receive_window(quinn::VarInt::from_u32(tuning.window))
        .send_window(u64::from(tuning.window))
        .initial_mtu(tuning.path_udp_payload)
        .min_mtu(tuning.path_udp_payload)
        .enable_segmentation_offload(tuning.max_udp_payload <= 6500);
    let mut mtu = quinn::MtuDiscoveryConfig::default();
    mtu.upper_bound(tuning.max_udp_payload);
    transport.mtu_discovery_config((tuning.max_udp_payload > tuning.path_udp_payload).then_some(mtu));
    let transport = Arc::new(transport);
    let mut sc = quinn::ServerConfig::with_crypto(Arc::new(quinn::crypto::rustls::QuicServerConfig::try_from(server)?));
    sc.transport_config(transport.clone());
    let mut ec = quinn::EndpointConfig::default();
    ec.max_udp_payload_size(tuning.max_udp_payload)?;
    let sock = std::net::UdpSocket::bind("127.0.0.1:0")?;
    let server_ep = quinn::Endpoint::new(ec.clone(), Some(sc), sock, Arc::new(quinn::TokioRuntime))?;
    let addr: SocketAddr = server_ep.local_addr()?;
    let reader = tokio::spawn(async move {
        let conn = server_ep.accept().await.ok_or("no connection")?.await?;
        let (mut s, mut r) = conn.accept_bi().await?;
        read_into(&mut r, &mut dst).await?;
        s.write_all(b"k").await?;
        s.finish()?;
        let _ = s.stopped().await;
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(dst)
    });
    let mut cc = quinn::ClientConfig::new(Arc::new(quinn::crypto::rustls::QuicClientConfig::try_from(client)?));
    cc.transport_config(transport);
    let client_ep =
        quinn::Endpoint::new(ec, None, std::net::UdpSocket::bind("127.0.0.1:0")?, Arc::new(quinn::TokioRuntime))?;
    let conn = client_ep.connect_with(cc, addr, "tandem-kv")?.await?;
    let (mut s, mut r) = conn.open_bi().await?;
    let start = Instant::now();
    write_layers(&mut s, layers, piece).await?;
    let mut ack = [0u8; 1];
    r.read_exact(&mut ack).await?;
    let elapsed = start.elapsed();
    let dst = reader.await??;
    conn.close(0u32.into(), b"");
    Ok((elapsed, dst))
}
