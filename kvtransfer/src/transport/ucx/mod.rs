//! UCX transport: KV lands by one-sided writes (RDMA where the fabric has
//! it; shared memory, CMA or TCP otherwise, chosen by `UCX_TLS`), control
//! goes by active messages.
//!
//! # Design
//!
//! ```text
//! prefill: UcxKvSender (thread, UCX worker)        decode: UcxKvServer (thread, UCX worker, landing region,
//!                                                          and with pool_blocks the KV pool's own memory)
//!   AM Hello{its worker address, its process, Hello} ─▶  connect back; Receiver::on_hello
//!          ◀── HelloAck [+ PoolKey{base, num_blocks, rkey}] + Key{base, rkey} | HelloReject
//!              (keys only after the handshake passed; the pool's only to a process it can see)
//!   a direct writer, or the first layer of a reservation:
//!   AM ClaimDirect{res, gen} (pool mapped here) ─▶  Receiver::expose → the reservation's blocks
//!          ◀── Blocks{res, gen, block ids}
//!   or AM Claim{res, gen} ───────────────────────▶  Receiver::receiving_blocks → landing range
//!          ◀── Grant{res, gen, offset, n_blocks} | Refused{landing_full, …}
//!   each layer (blocks as computed):
//!   direct: store K, V into its pool blocks (CRC as it stores), fence —
//!     from the engine's thread out of its own pool (UcxDirectWriter), or
//!     from this connection's thread out of a gathered layer
//!   landing: put (or store) K, V → landing range; flush
//!   AM Layer{LayerData header, crc32c} ──────────▶  direct: CRC the blocks in the pool;
//!                                                   landing: copy K‖V out, CRC the copy;
//!                                                   Receiver::on_layer_checked → BlockSink
//!          ◀── Abort{reason} (once) ──────────────  refused; the range or blocks go to quarantine
//!   AM Complete ─────────────────────────────────▶  Receiver::on_complete; nothing left to fence
//!          ◀── Ack | Abort
//!   after an Abort: flush, AM Fenced{res, gen} ──▶  quarantined range or blocks free
//!   drop: flush, AM Bye ─────────────────────────▶  the connection's ranges and blocks free
//! ```
//!
//! **Direct** (one host): the decode worker's engine pool lives in memory
//! the server allocated and registered ([`UcxServerConfig::pool_blocks`],
//! `KvPool::adopt`, then [`UcxKvServer::enable_direct`]), laid out as
//! `KvLayout::pool_offset` says. A sender that can map it (UCX's shared
//! memory transports, `ucp_rkey_ptr`) stores each layer's blocks straight
//! where the engine reads them, with the CRC-32C taken on the words as it
//! stores them; the server checks the CRC over its own pool blocks. No copy
//! on the decode side, and with a [`UcxDirectWriter`] (`writer.rs`) none on
//! the prefill side but that store: the prefill engine's thread stores each
//! layer from its own pool as it computes it, and the connection only
//! announces it.
//!
//! **Landing** (across hosts, or no mapping): the server registers one
//! *landing region* ([`UcxServerConfig::landing_bytes`]) and grants each
//! reservation its own range of it; the sender puts (or, mapped, stores)
//! each layer there, and the server copies the layer into a buffer only it
//! can touch, computes the CRC-32C over that copy, and feeds the copy to
//! the same [`Receiver`](crate::Receiver) and [`BlockSink`](super::BlockSink)
//! path as a received `LayerData` frame.
//!
//! Either way handshake, leases, generations, checksum refusals and the
//! decode worker's `kv_load_failure_policy` are the other transports' code.
//!
//! # The fence
//!
//! With one-sided writes the receiver does not see bytes arrive, so a
//! stalled or partitioned sender may write after its reservation expired.
//! A landing write can only land in the range it was granted, never in pool
//! blocks; a direct write only in its reservation's blocks. Either is
//! *quarantined* when its reservation ends without completing (lease, an
//! abort on either side, corruption) — the range by the server, the blocks
//! by the [`Receiver`](crate::Receiver), which does not hand them back
//! through `poll_released` — and is reused only after the sender is
//! fenced: it flushed its endpoint and said so (`Fenced`, or `Abort`/`Bye`,
//! each sent after a flush and after every store of its thread), or UCX
//! reported its endpoint failed — and, for direct blocks, its process is
//! gone (`direct.rs`: a process cut off from its control connection may
//! still be storing). A completed reservation is free at once: the sender
//! finished every layer before its `Layer` message. A landing write that
//! lands after reuse anyway is caught by the CRC over the private copy.
//!
//! Unregistering memory is not a fence here: UCX's shared-memory and CMA
//! transports write straight into the receiver's virtual memory, and
//! unmapping gives no ordering against a put that already passed its key
//! check. docs/ARCHITECTURE.md has the full argument.
//!
//! # Threads
//!
//! UCX handles are single-threaded (`ucx_sys` is `Rc`-based): the server
//! and each sender connection own a thread with a current-thread tokio
//! runtime that progresses the worker on its event fd. The async handles
//! ([`UcxKvServer`], [`UcxKvSender`]) talk to them by channels.
//!
//! # Two endpoints per sender
//!
//! A sender reaches the server's worker twice: active messages go on an
//! endpoint in UCX's peer error-handling mode (a dead server fails the
//! connection at once), puts and their flushes on one without error
//! handling (`ucx_sys::PeerFailure::Unreported`). UCX 1.13 selects only
//! transports that can report a dead peer for the first kind, which on one
//! host leaves TCP loopback; the second kind may use shared memory and CMA.
//! Every wait on the put endpoint is bounded and ends early when the
//! control endpoint fails.
//!
//! # Trust model
//!
//! As TCP: a trusted cluster network. A sender that knows the landing key
//! can put anywhere in the landing region (never elsewhere: UCX checks the
//! remote range against the registration); the CRC over the private copy
//! makes a stray write fail a transfer rather than corrupt KV. The pool's
//! key goes only to a sender process this host's `/proc` shows, and UCX
//! maps it only for processes that may attach its shared memory; such a
//! sender could write any pool block, including live ones: trusted as the
//! handshake trusts it, with the quarantine guarding against late writes,
//! not hostile ones.
//! Addresses are UCX worker addresses, hex-encoded; UCX parses the one a
//! `Hello` carries.

mod direct;
mod driver;
mod landing;
mod link;
mod runs;
mod sender;
mod server;
mod wire;
mod writer;

pub use direct::UcxPoolMemory;
pub use sender::{UcxKvSender, UcxSenderConfig};
pub use server::{UcxKvServer, UcxServerConfig, UcxServerStats};
pub use wire::{check_decode, LandingRefusal, WireError};
pub use writer::{StoredLayer, UcxDirectWriter};

/// The UCX transports in use as configured: `UCX_TLS`, or `default` when
/// UCX chooses (the `ucx_tls` label of `tandem_kv_transport_info`).
pub fn ucx_tls() -> String {
    match std::env::var("UCX_TLS") {
        Ok(t) if !t.trim().is_empty() => t,
        _ => "default".to_owned(),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    let s = s.trim();
    if s.is_empty() || s.len() % 2 != 0 {
        return None;
    }
    (0..s.len()).step_by(2).map(|i| s.get(i..i + 2).and_then(|d| u8::from_str_radix(d, 16).ok())).collect()
}

#[cfg(test)]
mod tests;
