//! Transports: the I/O that drives the sans-I/O protocol of this crate.
//!
//! The protocol modules ([`frame`](crate::frame), [`session`](crate::session),
//! [`sender`](crate::sender)) never touch a socket or a clock. A transport
//! owns the bytes in flight: it decodes frames, passes them with the current
//! time to the [`Receiver`](crate::Receiver), and writes accepted payloads
//! straight into pool blocks through a [`BlockSink`].
//!
//! Transports so far:
//! - [`tcp`]: plain TCP for a trusted cluster network. Integrity comes from
//!   the per-frame CRC-32C; there is no encryption or peer authentication.
//! - [`local`]: same host; payloads through a shared-memory ring, control
//!   over a Unix socket.
//! - [`quic`]: QUIC (TLS 1.3) for links the cluster does not trust: the
//!   same frames on one stream per connection, certificates checked
//!   against a cluster CA or a pinned fingerprint.
//! - [`ucx`]: one-sided puts through UCX (RDMA verbs where present, shared
//!   memory, CMA or TCP otherwise) into a registered landing region, never
//!   into the pool; the receiver checksums its own copy.

pub mod any;
pub mod local;
pub mod quic;
pub mod tcp;
pub mod ucx;

mod close;
mod direct;
mod error;
#[cfg(feature = "fault-injection")]
pub mod fault;
mod inbound;
mod lock;
mod outbound;
mod pinned;
mod send;
mod serve;
mod stream;

pub use close::{CloseReason, ServerStats, UcxStats};
pub use direct::{DirectPool, PoolMemory};
pub use error::TransferError;
#[cfg(feature = "lock-stats")]
pub use lock::stats as lock_stats;
pub use pinned::PinnedLayer;

use std::task::{Context, Poll};

#[cfg(feature = "pool")]
use engine::kv::KvPool;
use types::kv::BlockId;

use crate::session::WriteInstruction;

/// Where accepted KV lands: one layer's K and V of some blocks, written in
/// place. The bytes are little-endian elements of the layout's dtype, blocks
/// in `blocks` order — what the engine's `KvPool::scatter_layer` takes. The write
/// happens while the transport holds the receiver, after
/// [`Receiver::on_layer`](crate::Receiver::on_layer) (or
/// [`on_layer_checked`](crate::Receiver::on_layer_checked)) accepted the frame, so
/// the blocks cannot be released (and reused) during it. The server waits
/// for [`poll_ready`](BlockSink::poll_ready) first, without the receiver.
pub trait BlockSink: Send {
    /// Whether the sink can take a write of `payload_len` bytes now; if not,
    /// `cx` is woken when it can. A server polls it to readiness for every
    /// `LayerData` frame *before* it takes the receiver and calls
    /// [`write_layer_owned`](Self::write_layer_owned) with that frame, so a
    /// sink that defers writes to another thread (the decode worker's
    /// engine) bounds what waits there: while it is not ready the
    /// connection stops reading, which is back-pressure on the sender, and
    /// nothing else waits (the receiver is not held). The default is always
    /// ready (a sink that writes in place).
    fn poll_ready(&mut self, cx: &mut Context<'_>, payload_len: usize) -> Poll<()> {
        let _ = (cx, payload_len);
        Poll::Ready(())
    }

    /// The frame [`poll_ready`](Self::poll_ready) was last polled for will
    /// not be written (the receiver refused it): give back whatever was set
    /// aside for it, so a connection whose frames are refused holds nothing
    /// while it idles. The default has nothing to give back.
    fn unready(&mut self) {}

    /// Writes `k` and `v` of `layer` into `blocks`. An error voids the
    /// reservation: the transport aborts it and its blocks come back through
    /// [`Receiver::poll_released`](crate::Receiver::poll_released).
    fn write_layer(&mut self, layer: usize, blocks: &[BlockId], k: &[u8], v: &[u8]) -> Result<(), String>;

    /// The same write, given the frame's payload by value (K half, then V
    /// half; see [`OwnedPayload`]) so a sink can hand it to another thread without copying it,
    /// e.g. the decode worker's engine thread, which owns the pool. A sink
    /// that defers the write must still apply it before anything the caller
    /// does with these blocks afterwards (the runner's command queue is
    /// FIFO) and must void the reservation's use if it fails. The default
    /// writes in place through [`write_layer`](Self::write_layer).
    fn write_layer_owned(&mut self, w: WriteInstruction, payload: OwnedPayload) -> Result<(), String> {
        let (k, v) = w.split_payload((*payload).as_ref());
        self.write_layer(w.layer, &w.blocks, k, v)
    }

    /// A layer of `payload_len` bytes that a peer wrote straight into the
    /// pool's memory, which the receiver has now accepted (checksummed over
    /// that memory): there is nothing to write. Only a transport whose pool
    /// memory the engine adopted calls it (the UCX transport's direct path,
    /// `UcxKvServer::enable_direct`). A sink that counts what arrives
    /// counts it here; the default does nothing.
    fn landed_in_place(&mut self, w: &WriteInstruction, payload_len: usize) {
        let _ = (w, payload_len);
    }
}

/// An accepted frame's payload, owned: a `Vec<u8>` read off a socket, or a
/// guard over a shared-memory slot that frees the slot when dropped.
pub type OwnedPayload = Box<dyn AsRef<[u8]> + Send>;

/// The engine's pool behind a lock (feature `pool`: tests and benches; the decode worker
/// writes through its runner's own sink). Lock order: a transport takes the
/// receiver's lock, then this one; the owner of both must never hold the
/// pool's lock while it waits for the receiver's.
#[cfg(feature = "pool")]
impl BlockSink for std::sync::Arc<std::sync::Mutex<KvPool>> {
    fn write_layer(&mut self, layer: usize, blocks: &[BlockId], k: &[u8], v: &[u8]) -> Result<(), String> {
        // A poisoned lock means another thread panicked mid-write; the pool's
        // own bookkeeping is still consistent (scatter only copies bytes),
        // and the transfer's checksum-verified bytes are about to overwrite
        // the blocks anyway.
        let mut pool = self.lock().unwrap_or_else(|e| e.into_inner());
        pool.scatter_layer(layer, blocks, k, v).map_err(|e| e.to_string())
    }
}

/// A closure as a sink (tests, or a pool that lives elsewhere, e.g. on a GPU).
#[derive(Debug, Clone)]
pub struct FnSink<F>(pub F);

impl<F> BlockSink for FnSink<F>
where
    F: FnMut(usize, &[BlockId], &[u8], &[u8]) -> Result<(), String> + Send,
{
    fn write_layer(&mut self, layer: usize, blocks: &[BlockId], k: &[u8], v: &[u8]) -> Result<(), String> {
        (self.0)(layer, blocks, k, v)
    }
}
