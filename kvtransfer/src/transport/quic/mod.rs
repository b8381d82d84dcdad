//! QUIC transport (quinn + rustls): encrypted and authenticated KV transfer
//! across links the cluster does not trust.
//!
//! The same frames, the same [`Receiver`](crate::Receiver) rules and the
//! same frame-stream code as [`tcp`](super::tcp) — one QUIC connection
//! carries one bidirectional stream, which carries exactly what a TCP
//! connection carries — so the public types mirror the TCP ones and the
//! worker binaries can dispatch over both with an enum. What QUIC adds is
//! TLS 1.3 ([`tls`]): the sender checks the decode worker's certificate
//! (cluster CA, or a pinned self-signed certificate for development), and a
//! decode worker given a client trust checks the sender's (mutual TLS).
//!
//! ```text
//! prefill: QuicKvSender                          decode: QuicKvServer (one task per connection)
//!   QUIC + TLS handshake ─────────────────────▶  certificate refused: closed (CloseReason::Tls)
//!   open the stream; then exactly the TCP conversation (see transport::tcp)
//!   (drop) ─── FIN / CONNECTION_CLOSE(0) ─────▶  PeerClosed
//! ```
//!
//! Failures and what the server does are those of the TCP table, plus a
//! failed TLS handshake (closed, counted as `tls`). Each side also runs
//! QUIC's own idle timeout, so a peer that vanishes without a packet is
//! noticed even between frames.
//!
//! # Throughput
//!
//! QUIC does per packet what TCP leaves to the kernel (acks, loss
//! recovery, congestion control) plus AEAD encryption, in user space, and
//! quinn copies stream data into its own buffers on both sides. What the
//! defaults do about it ([`QuicTuning`], [`tls`]):
//! - Datagram size: path-MTU discovery goes up to 64 KB datagrams where
//!   the path carries them (loopback; jumbo frames to ~9 KB), so per-packet
//!   work is paid every 64 KB instead of every 1.2 KB. quinn's segmentation
//!   offload (GSO) sends up to 10 datagrams per system call, and one such
//!   send cannot exceed 64 KiB (the IP length field): once discovery passes
//!   6.5 KB those sends fail, loss-based black-hole detection drops the MTU
//!   back to 1200, and the connection stays there (seen here: MTU 1200,
//!   one black hole, 230k datagrams per 256 MiB). So GSO is on only when
//!   datagrams cannot grow past 6.5 KB; without it discovery reaches
//!   65,495 bytes on loopback and throughput went up 2-3x.
//! - Windows of 16 MiB per stream and connection, and large UDP socket
//!   buffers, so a whole layer can be in flight.
//! - AES-128-GCM preferred over AES-256-GCM.
//!
//! One connection carries one frame stream: a reservation's frames cannot
//! be spread over several streams or connections without a barrier before
//! `Complete` (streams are not ordered with each other), which the protocol
//! does not have. Concurrent reservations use concurrent senders. See
//! benches/quic.rs for the figures against rustls over TCP.

mod sender;
mod server;
pub mod tls;

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use quinn::{ConnectionError, VarInt};

pub use sender::{QuicKvSender, QuicSenderConfig};
pub use server::{QuicKvServer, QuicServerConfig, QuicServerStats};
pub use tls::{CertFingerprint, PeerTrust, TlsError, TlsIdentity};

use crate::TransferError;

/// Transport settings both sides use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuicTuning {
    /// Flow-control window, per stream and per connection: bytes a receiver
    /// lets the sender have in flight (and buffers at most, per connection).
    pub window: u32,
    /// UDP payload size the path is known to carry: used from the first
    /// packet, and what loss-triggered black-hole detection falls back to.
    /// 1200 (QUIC's minimum) works anywhere; 1472 on a plain Ethernet
    /// IPv4 path; 8972 with jumbo frames. Above what the path carries, no
    /// connection can even complete its handshake. At most 9000 is used:
    /// larger first flights stalled quinn 0.11's handshake even on loopback
    /// (discovery still takes the connection beyond).
    pub path_udp_payload: u16,
    /// Largest UDP payload path-MTU discovery tries beyond
    /// `path_udp_payload` (no discovery if not larger). Probes beyond what
    /// the path carries are lost and cost nothing else.
    pub max_udp_payload: u16,
    /// Socket send and receive buffer sizes asked of the kernel (capped by
    /// `net.core.wmem_max` / `rmem_max`).
    pub socket_buffer_bytes: usize,
}

impl Default for QuicTuning {
    /// 16 MiB windows; 1200-byte datagrams from the start, discovery up to
    /// 65,527; 8 MiB socket buffers.
    fn default() -> Self {
        Self { window: 16 << 20, path_udp_payload: 1200, max_udp_payload: 65527, socket_buffer_bytes: 8 << 20 }
    }
}

impl QuicTuning {
    fn transport(&self, idle: Duration, keep_alive: Option<Duration>) -> quinn::TransportConfig {
        let mut t = quinn::TransportConfig::default();
        let window = VarInt::from_u32(self.window);
        let path = self.path_udp_payload.clamp(1200, MAX_PATH_UDP_PAYLOAD);
        t.stream_receive_window(window)
            .receive_window(window)
            .send_window(u64::from(self.window))
            .max_concurrent_bidi_streams(VarInt::from_u32(1))
            .max_concurrent_uni_streams(VarInt::from_u32(0))
            // A timeout beyond QUIC's range (~146 years in ms) means none at all.
            .max_idle_timeout(quinn::IdleTimeout::try_from(idle).ok())
            .keep_alive_interval(keep_alive)
            .initial_mtu(path)
            .min_mtu(path);
        let mut mtu = quinn::MtuDiscoveryConfig::default();
        mtu.upper_bound(self.max_udp_payload.max(path));
        t.mtu_discovery_config((self.max_udp_payload > path).then_some(mtu));
        // quinn hands the kernel up to 10 datagrams per segmentation-offload
        // send, and the kernel takes at most 64 KiB per send: beyond 6.5 KB
        // datagrams such sends fail, the packets are lost, and loss-based
        // black-hole detection drops the MTU back to `path_udp_payload`.
        t.enable_segmentation_offload(self.max_udp_payload.max(path) <= GSO_MAX_UDP_PAYLOAD);
        t
    }

    fn endpoint_config(&self) -> quinn::EndpointConfig {
        let mut e = quinn::EndpointConfig::default();
        // Only fails below 1200; the value is clamped above.
        let _ =
            e.max_udp_payload_size(self.max_udp_payload.max(self.path_udp_payload.min(MAX_PATH_UDP_PAYLOAD)).max(1200));
        e
    }

    /// A UDP socket with the buffers asked for.
    fn socket(&self, addr: SocketAddr) -> io::Result<std::net::UdpSocket> {
        let domain = socket2::Domain::for_address(addr);
        let s = socket2::Socket::new(domain, socket2::Type::DGRAM, Some(socket2::Protocol::UDP))?;
        // Best effort: the kernel caps (or, unprivileged, may refuse) the size.
        let _ = s.set_send_buffer_size(self.socket_buffer_bytes);
        let _ = s.set_recv_buffer_size(self.socket_buffer_bytes);
        s.bind(&addr.into())?;
        Ok(s.into())
    }

    fn endpoint(&self, addr: SocketAddr, server: Option<quinn::ServerConfig>) -> io::Result<quinn::Endpoint> {
        let socket = self.socket(addr)?;
        quinn::Endpoint::new(self.endpoint_config(), server, socket, Arc::new(quinn::TokioRuntime))
    }
}

/// Largest `path_udp_payload` used (see there).
const MAX_PATH_UDP_PAYLOAD: u16 = 9000;

/// Largest datagram for which quinn's segmentation offload (up to 10
/// datagrams per send) stays within the kernel's 64 KiB per send.
const GSO_MAX_UDP_PAYLOAD: u16 = 6500;

/// A QUIC application close code: 0, the normal end of a connection.
const CLOSE_DONE: u32 = 0;

/// Whether a connection error is the peer's TLS alert (it refused us).
fn is_crypto_refusal(e: &ConnectionError) -> Option<String> {
    let code = match e {
        ConnectionError::ConnectionClosed(c) => c.error_code,
        ConnectionError::TransportError(t) => t.code,
        _ => return None,
    };
    // Crypto errors are 0x100 + the TLS alert.
    let raw = u64::from(code);
    (0x100..0x200).contains(&raw).then(|| format!("{e} (TLS alert {})", raw - 0x100))
}

/// The sender's view of a failed connection.
fn connection_error(
    e: ConnectionError,
    refusal: Option<TlsError>,
    what: &'static str,
    wait: Duration,
) -> TransferError {
    if let Some(t) = refusal {
        return TransferError::Tls(t);
    }
    if let Some(alert) = is_crypto_refusal(&e) {
        return TransferError::Tls(TlsError::RefusedByPeer(alert));
    }
    match e {
        ConnectionError::TimedOut => TransferError::Timeout { what, after: wait },
        ConnectionError::ApplicationClosed(_) | ConnectionError::ConnectionClosed(_) | ConnectionError::Reset => {
            TransferError::Io(io::Error::new(io::ErrorKind::ConnectionReset, e))
        }
        ConnectionError::LocallyClosed => TransferError::Io(io::Error::new(io::ErrorKind::NotConnected, e)),
        other => TransferError::Io(io::Error::other(other)),
    }
}
