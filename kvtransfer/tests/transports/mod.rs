//! The decode side and sender of any transport, for the conformance suites
//! (`conformance.rs`, `conformance_fault.rs`): the same test body runs over
//! tcp (reading into buffers, and straight into the pool), quic, local and
//! ucx, on loopback, and asserts the same outcome.

#![allow(dead_code)] // each test binary uses its own part of this module

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::Duration;

use engine::kv::KvPool;
use kvtransfer::transport::PoolMemory;
use kvtransfer::{
    KvSender, KvServer, LocalSenderConfig, LocalServerConfig, Peer, PeerTrust, QuicSenderConfig, QuicServerConfig,
    Receiver, ReceiverConfig, Released, Reservation, SenderConfig, ServerConfig, ServerStats, TcpSenderConfig,
    TcpServerConfig, TlsIdentity, TransferError, TransportKind, UcxSenderConfig, UcxServerConfig,
};
use tokio::sync::watch;
use types::kv::{BlockId, KvLayout};

use crate::net::{layout, lock, now, peer, within, WAIT};

/// Blocks of the decode pool.
const POOL_BLOCKS: usize = 32;

/// Decode side: a receiver, a pool with some decoy blocks taken (so block
/// ids differ from the source's), and a server of one transport writing
/// into that pool.
pub struct DecodeSide {
    pub kind: TransportKind,
    pub layout: KvLayout,
    pub rx: Arc<Mutex<Receiver>>,
    pub pool: Arc<Mutex<KvPool>>,
    server: Option<KvServer>,
    /// How a sender trusts the QUIC server's self-signed certificate.
    quic_pin: Option<PeerTrust>,
}

impl DecodeSide {
    pub async fn start(kind: TransportKind) -> Self {
        Self::start_with(kind, false).await
    }

    /// `direct`: tcp only, the pool in memory the server reads payloads
    /// straight into (`TcpServerConfig::direct`, the decode worker's default).
    pub async fn start_with(kind: TransportKind, direct: bool) -> Self {
        assert!(!direct || kind == TransportKind::Tcp, "direct reads are tcp's");
        let l = layout();
        let rx = Arc::new(Mutex::new(Receiver::new(peer(&l, "smollm2", 0x11), ReceiverConfig::new(l)).expect("rx")));
        let pool = Arc::new(Mutex::new(KvPool::new(l, POOL_BLOCKS).expect("pool B")));
        let direct = direct.then(|| {
            let memory = PoolMemory::new(l, POOL_BLOCKS).expect("pool memory");
            let view = memory.direct();
            lock(&pool).adopt(memory.into_shared()).expect("adopt");
            view
        });
        let _decoys = lock(&pool).allocate(3).expect("decoys");
        let sink = pool.clone();
        let mut quic_pin = None;
        let (addr, config) = match kind {
            TransportKind::Tcp => {
                ("127.0.0.1:0".to_owned(), ServerConfig::Tcp(TcpServerConfig { direct, ..TcpServerConfig::default() }))
            }
            TransportKind::Quic => {
                let id = TlsIdentity::self_signed(&["tandem-kv"]).expect("self-signed");
                quic_pin = Some(PeerTrust::Pinned(id.fingerprint()));
                ("127.0.0.1:0".to_owned(), ServerConfig::Quic(QuicServerConfig::new(id)))
            }
            TransportKind::Local => (unique_addr(), ServerConfig::Local(LocalServerConfig::default())),
            TransportKind::Ucx => {
                ucx_env();
                // The landing region only (no direct pool): every write is copied out and
                // checked before it reaches the pool, as the streams' are.
                (String::new(), ServerConfig::Ucx(UcxServerConfig::default()))
            }
        };
        let server = within("the server up", KvServer::bind(&addr, rx.clone(), sink, config)).await.expect("bind");
        Self { kind, layout: l, rx, pool, server: Some(server), quic_pin }
    }

    fn server(&self) -> &KvServer {
        self.server.as_ref().expect("the server is up")
    }

    /// Connects a sender presenting `p`.
    pub async fn connect(&self, p: &Peer) -> Result<KvSender, TransferError> {
        let config = match self.kind {
            TransportKind::Tcp => SenderConfig::Tcp(TcpSenderConfig { timeout: WAIT, ..TcpSenderConfig::default() }),
            TransportKind::Quic => {
                let pin = self.quic_pin.clone().expect("a quic server's pin");
                SenderConfig::Quic(QuicSenderConfig { timeout: WAIT, ..QuicSenderConfig::new(pin) })
            }
            TransportKind::Local => {
                SenderConfig::Local(LocalSenderConfig { timeout: WAIT, ..LocalSenderConfig::default() })
            }
            TransportKind::Ucx => {
                SenderConfig::Ucx(UcxSenderConfig { timeout: Duration::from_secs(3), ..UcxSenderConfig::default() })
            }
        };
        let addr = self.server().local_addr();
        within("the handshake", KvSender::connect(&addr, p, self.layout, config)).await
    }

    /// A sender presenting the decode side's own group and fingerprint.
    pub async fn connect_matching(&self) -> KvSender {
        self.connect(&peer(&self.layout, "smollm2", 0x11)).await.expect("handshake")
    }

    pub fn reserve(&self, n: usize, ttl: Duration) -> (Reservation, Vec<BlockId>) {
        let blocks = lock(&self.pool).allocate(n).expect("alloc B");
        (lock(&self.rx).reserve(blocks.clone(), ttl, now()).expect("reserve"), blocks)
    }

    pub fn watch_stats(&self) -> watch::Receiver<ServerStats> {
        self.server().watch_stats()
    }

    pub async fn wait_stats(&self, what: &str, pred: impl FnMut(&ServerStats) -> bool) -> ServerStats {
        let mut w = self.watch_stats();
        let s = within(what, w.wait_for(pred)).await.expect("server alive").clone();
        s
    }

    /// Frees what `poll_released` hands back, as the decode worker's reaper does.
    pub fn reap(&self, at: tokio::time::Instant) -> Vec<Released> {
        let released = lock(&self.rx).poll_released(at);
        for r in &released {
            lock(&self.pool).release(&r.blocks).expect("release");
        }
        released
    }

    /// Blocks free in the decode pool.
    pub fn free_blocks(&self) -> usize {
        lock(&self.pool).available()
    }

    /// Stops the server (every connection ends; ucx: its thread and worker).
    pub fn stop(&mut self) {
        if let Some(s) = self.server.take() {
            s.shutdown();
        }
    }
}

/// Connections that ended normally: the sender finished and left
/// (`peer_closed` on a stream or the local socket, `bye` over ucx).
pub fn normal_closes(s: &ServerStats) -> u64 {
    s.closed_by("peer_closed") + s.closed_by("bye")
}

/// Polls `cond` (every 2 ms) until it holds; fails the test after [`WAIT`].
/// For state no event announces (a reservation's state in the receiver).
pub async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    within(what, async {
        while !cond() {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await
}

fn ucx_env() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        if std::env::var_os("UCX_NET_DEVICES").is_none() {
            std::env::set_var("UCX_NET_DEVICES", "lo");
        }
    });
}

/// A fresh abstract socket name: unique per process and server.
fn unique_addr() -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    format!("@tandem-kv-conformance-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}
