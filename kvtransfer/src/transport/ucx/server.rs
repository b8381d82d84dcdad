//! The decode worker's side: one thread that owns a UCX worker and the
//! landing region, answers senders' active messages and feeds a [`Receiver`].

use std::io;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::sync::{oneshot, watch};
use ucx_sys::Region;

use super::direct::UcxPoolMemory;
use crate::session::Receiver;
use crate::transport::close::ServerStats;
use crate::transport::BlockSink;
use thread::serve_thread;

mod thread;

/// Server settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UcxServerConfig {
    /// Bytes of the landing region, registered once at start: the most KV
    /// in flight (and in quarantine) at once. A reservation that does not
    /// fit is refused ([`LandingRefusal::Full`](super::LandingRefusal::Full)).
    pub landing_bytes: usize,
    /// How often the server looks for reservations that ended (lease,
    /// abort, corruption) and for senders whose endpoint failed.
    pub sweep_interval: Duration,
    /// Senders served at once; a `Hello` beyond it is ignored.
    pub max_connections: usize,
    /// Blocks of the decode pool to allocate and register at start for the
    /// direct path: senders on this host store KV straight into the pool
    /// (no landing copy), once the engine's pool adopted the memory
    /// ([`UcxKvServer::pool_memory`], then [`UcxKvServer::enable_direct`]).
    /// `None`: every transfer lands in the landing region.
    pub pool_blocks: Option<usize>,
}

impl Default for UcxServerConfig {
    /// 256 MiB of landing region, a 20 ms sweep, 256 senders, no direct pool.
    fn default() -> Self {
        Self {
            landing_bytes: 256 << 20,
            sweep_interval: Duration::from_millis(20),
            max_connections: 256,
            pool_blocks: None,
        }
    }
}

/// What the UCX server has done: see [`ServerStats`], its own counters in
/// [`ServerStats::ucx`]. A connection ends with `bye`, `peer_failed`,
/// `rejected` or `busy` ([`CloseReason`](crate::CloseReason)).
pub type UcxServerStats = ServerStats;

/// Called on the server thread with the landing region and a layer's K
/// range just before that layer is copied out (tests: a write that lands
/// between a sender's put and the server's copy).
#[cfg(test)]
pub(super) type BeforeCopy = Box<dyn FnMut(&Region, Range<usize>) + Send>;

/// The decode worker's UCX KV server: a thread with its own UCX context
/// and worker, one registered landing region, and the [`Receiver`] shared
/// with the rest of the worker. Dropping it (or
/// [`shutdown`](Self::shutdown)) ends the thread, which closes every
/// endpoint and unregisters the region.
#[derive(Debug)]
pub struct UcxKvServer {
    addr: String,
    pool: Option<UcxPoolMemory>,
    direct: Arc<AtomicBool>,
    stats: watch::Receiver<UcxServerStats>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl UcxKvServer {
    /// Starts the server thread, maps the landing region and returns once
    /// the worker's address is known. UCX picks its transports from the
    /// environment (`UCX_TLS`, `UCX_NET_DEVICES`).
    pub async fn bind<S>(receiver: Arc<Mutex<Receiver>>, sink: S, config: UcxServerConfig) -> io::Result<Self>
    where
        S: BlockSink + 'static,
    {
        Self::start(receiver, sink, config, Hooks::default()).await
    }

    #[cfg(test)]
    pub(super) async fn bind_with_hook<S>(
        receiver: Arc<Mutex<Receiver>>,
        sink: S,
        config: UcxServerConfig,
        before_copy: BeforeCopy,
    ) -> io::Result<Self>
    where
        S: BlockSink + 'static,
    {
        Self::start(receiver, sink, config, Hooks { before_copy: Some(before_copy) }).await
    }

    async fn start<S>(
        receiver: Arc<Mutex<Receiver>>,
        sink: S,
        config: UcxServerConfig,
        hooks: Hooks,
    ) -> io::Result<Self>
    where
        S: BlockSink + 'static,
    {
        let (ready_tx, ready_rx) = oneshot::channel();
        let (stop_tx, stop_rx) = oneshot::channel();
        let (stats_tx, stats) = watch::channel(UcxServerStats::default());
        let direct = Arc::new(AtomicBool::new(false));
        let on = direct.clone();
        let thread = std::thread::Builder::new().name("tandem-ucx-kv".into()).spawn(move || {
            serve_thread(receiver, sink, config, hooks, on, ready_tx, stop_rx, stats_tx);
        })?;
        let (addr, pool) = match ready_rx.await {
            Ok(Ok(ready)) => ready,
            Ok(Err(e)) => return Err(io::Error::other(format!("starting the UCX KV server: {e}"))),
            Err(_) => return Err(io::Error::other("the UCX KV server thread ended during start-up")),
        };
        Ok(Self { addr, pool, direct, stats, stop: Some(stop_tx), thread: Some(thread) })
    }

    /// The decode pool's memory ([`UcxServerConfig::pool_blocks`]), once:
    /// for the engine's pool to adopt before [`enable_direct`](Self::enable_direct).
    pub fn pool_memory(&mut self) -> Option<UcxPoolMemory> {
        self.pool.take()
    }

    /// Starts granting senders on this host pool blocks to write directly.
    /// Call only once the engine's pool lives in [`pool_memory`](Self::pool_memory)
    /// (`KvPool::adopt` succeeded): before that a direct write would land
    /// in memory the engine does not read. Until then, and for a server
    /// without a pool, every transfer lands in the landing region.
    pub fn enable_direct(&self) {
        self.direct.store(true, Ordering::Release);
    }

    /// The address a [`UcxKvSender`](super::UcxKvSender) connects to: this
    /// worker's UCX address, hex-encoded.
    pub fn local_addr(&self) -> &str {
        &self.addr
    }

    pub fn stats(&self) -> UcxServerStats {
        self.stats.borrow().clone()
    }

    /// A watch on the counters, to await an event instead of polling.
    pub fn watch_stats(&self) -> watch::Receiver<UcxServerStats> {
        self.stats.clone()
    }

    /// Ends the server thread and waits for it.
    pub fn shutdown(self) {
        // Drop does it all.
    }
}

impl Drop for UcxKvServer {
    fn drop(&mut self) {
        // Pool memory nobody took is not kept mapped past the thread.
        drop(self.pool.take());
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            // The thread stops at its next poll (the stop channel wakes it) and
            // only force-closes endpoints on its way out: a short wait.
            let _ = t.join();
        }
    }
}

#[derive(Default)]
struct Hooks {
    #[cfg(test)]
    before_copy: Option<BeforeCopy>,
}

impl Hooks {
    #[cfg(test)]
    fn before_copy(&mut self, region: &Region, k_range: Range<usize>) {
        if let Some(hook) = self.before_copy.as_mut() {
            hook(region, k_range);
        }
    }

    #[cfg(not(test))]
    fn before_copy(&mut self, _: &Region, _: Range<usize>) {}
}

/// What the server thread reports once it is up: its address and the pool memory.
type Ready = Result<(String, Option<UcxPoolMemory>), String>;

/// The decode pool, allocated and registered by the server thread.
struct Pool {
    region: Region,
    rkey: Vec<u8>,
    num_blocks: usize,
    /// One clone per holder of the memory ([`UcxPoolMemory`]); the region is
    /// unmapped at exit only if this is the last.
    lease: Arc<()>,
}
