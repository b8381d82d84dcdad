//! A plain round-robin TCP front for clusters with several coordinators:
//! what a layer-4 load balancer does in production. Each client connection
//! goes to the next coordinator in turn; a coordinator that refuses the
//! connect (dead: its port is closed) is skipped for the next one. Bytes are
//! forwarded as they are; when a coordinator dies mid-answer its clients see
//! their connection end mid-body (a transport error), as they would behind a
//! real load balancer.
//!
//! Why a front rather than loadgen with several base URLs: the client stays
//! the one every drill uses, and failover is by connect, where a real
//! deployment has it, not a retry policy inside the load generator.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use crate::HarnessError;

/// What the front did, per backend in the order given to [`Front::start`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FrontCounters {
    /// Client connections forwarded to each backend.
    pub forwarded: Vec<u64>,
    /// Connects to each backend that failed (so the next one was tried).
    pub refused: Vec<u64>,
    /// Client connections no backend accepted (dropped).
    pub unserved: u64,
}

#[derive(Debug)]
struct Shared {
    backends: Vec<SocketAddr>,
    next: AtomicUsize,
    forwarded: Vec<AtomicU64>,
    refused: Vec<AtomicU64>,
    unserved: AtomicU64,
}

/// A running front on `127.0.0.1`; stops accepting when dropped.
#[derive(Debug)]
pub struct Front {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    task: JoinHandle<()>,
}

impl Drop for Front {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Front {
    /// Listens on an ephemeral loopback port and forwards to `backends` round-robin.
    pub async fn start(backends: Vec<SocketAddr>) -> Result<Self, HarnessError> {
        let listener =
            TcpListener::bind("127.0.0.1:0").await.map_err(|e| HarnessError::Setup(format!("front: bind: {e}")))?;
        let addr = listener.local_addr().map_err(|e| HarnessError::Setup(format!("front: {e}")))?;
        let n = backends.len();
        let shared = Arc::new(Shared {
            backends,
            next: AtomicUsize::new(0),
            forwarded: (0..n).map(|_| AtomicU64::new(0)).collect(),
            refused: (0..n).map(|_| AtomicU64::new(0)).collect(),
            unserved: AtomicU64::new(0),
        });
        let s = shared.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                tokio::spawn(forward(client, s.clone()));
            }
        });
        Ok(Self { addr, shared, task })
    }

    pub fn counters(&self) -> FrontCounters {
        let load = |v: &[AtomicU64]| v.iter().map(|a| a.load(Ordering::SeqCst)).collect();
        FrontCounters {
            forwarded: load(&self.shared.forwarded),
            refused: load(&self.shared.refused),
            unserved: self.shared.unserved.load(Ordering::SeqCst),
        }
    }
}

async fn forward(mut client: TcpStream, s: Arc<Shared>) {
    let _ = client.set_nodelay(true);
    let n = s.backends.len();
    let first = s.next.fetch_add(1, Ordering::SeqCst);
    for k in 0..n {
        let i = (first + k) % n;
        let Some(addr) = s.backends.get(i) else { continue };
        match tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(addr)).await {
            Ok(Ok(mut up)) => {
                let _ = up.set_nodelay(true);
                if let Some(c) = s.forwarded.get(i) {
                    c.fetch_add(1, Ordering::SeqCst);
                }
                // Ends when both directions have ended (or one failed): a dead coordinator's
                // EOF or reset reaches the client as the end of its connection.
                let _ = tokio::io::copy_bidirectional(&mut client, &mut up).await;
                return;
            }
            _ => {
                if let Some(c) = s.refused.get(i) {
                    c.fetch_add(1, Ordering::SeqCst);
                }
            }
        }
    }
    s.unserved.fetch_add(1, Ordering::SeqCst);
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// A backend that answers every connection with its `tag` and closes.
    async fn tagged(tag: u8) -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = l.local_addr().expect("addr");
        tokio::spawn(async move {
            while let Ok((mut c, _)) = l.accept().await {
                let _ = c.write_all(&[tag]).await;
            }
        });
        addr
    }

    /// A port nothing listens on.
    fn dead() -> SocketAddr {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr")
    }

    async fn ask(f: &Front) -> Vec<u8> {
        let mut c = TcpStream::connect(f.addr).await.expect("connect");
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), c.read_to_end(&mut got)).await.expect("answer").expect("read");
        got
    }

    #[tokio::test]
    async fn connections_take_turns_and_a_dead_backend_is_skipped() {
        let (a, b) = (tagged(b'a').await, tagged(b'b').await);
        let f = Front::start(vec![a, b]).await.expect("front");
        let mut seen = Vec::new();
        for _ in 0..4 {
            seen.extend(ask(&f).await);
        }
        assert_eq!(seen, b"abab");
        assert_eq!(f.counters().forwarded, vec![2, 2]);

        let f = Front::start(vec![dead(), b]).await.expect("front");
        for _ in 0..3 {
            assert_eq!(ask(&f).await, b"b");
        }
        let k = f.counters();
        assert_eq!((k.forwarded.clone(), k.unserved), (vec![0, 3], 0));
        assert!(k.refused[0] >= 1, "{k:?}");
    }
}
