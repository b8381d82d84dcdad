//! UCX transport: KV lands by one-sided puts (RDMA where the fabric has it;
//! shared memory, CMA or TCP otherwise, chosen by `UCX_TLS`), control goes
//! by active messages.
//!
//! # Design
//!
//! ```text
//! prefill: UcxKvSender (thread, UCX worker)        decode: UcxKvServer (thread, UCX worker, landing region)
//!   AM Hello{its worker address, Hello} ─────────▶  connect back; Receiver::on_hello
//!          ◀── HelloAck + Key{base, rkey} | HelloReject   (the key only after the handshake passed)
//!   first layer of a reservation:
//!   AM Claim{res, gen} ──────────────────────────▶  Receiver::receiving_blocks → landing range
//!          ◀── Grant{res, gen, offset, n_blocks} | Refused{landing_full, …}
//!   each layer (blocks as computed):
//!   put K, put V → landing range; flush
//!   AM Layer{LayerData header, crc32c} ──────────▶  copy K‖V out of the landing range into an owned
//!                                                   buffer, CRC the copy, Receiver::on_layer_checked
//!                                                   → BlockSink::write_layer_owned
//!          ◀── Abort{reason} (once) ──────────────  refused; the range goes to quarantine
//!   AM Complete ─────────────────────────────────▶  Receiver::on_complete; the range is free
//!          ◀── Ack | Abort
//!   after an Abort: flush, AM Fenced{res, gen} ──▶  quarantined range free
//!   drop: flush, AM Bye ─────────────────────────▶  the connection's ranges free
//! ```
//!
//! The decode worker's KV pool is never exposed to remote writes. The
//! server registers one *landing region* at start ([`UcxServerConfig::landing_bytes`])
//! and grants each reservation its own range of it; the sender puts each
//! layer there as the layer is computed, and the server copies the layer
//! into a buffer only it can touch, computes the CRC-32C over that copy,
//! and feeds the copy to the same [`Receiver`](crate::Receiver) and
//! [`BlockSink`](super::BlockSink) path as a received `LayerData` frame:
//! handshake, leases, generations, checksum refusals and the decode
//! worker's `kv_load_failure_policy` are the other transports' code.
//!
//! # The fence
//!
//! With one-sided writes the receiver does not see bytes arrive, so a
//! stalled or partitioned sender may write after its reservation expired.
//! Such a write can only land in the landing range it was granted, never in
//! pool blocks. That range is *quarantined* when its reservation ends
//! without completing (lease, local abort, corruption) and is reused only
//! after the sender is fenced: it flushed its endpoint and said so
//! (`Fenced`, or `Abort`/`Bye`, each sent after a flush), or UCX reported
//! its endpoint failed. A completed reservation's range is free at once:
//! the sender flushed before every `Layer` message. A write that lands
//! after reuse anyway (a sender that breaks the protocol) is caught by the
//! CRC, which is computed over the copy that goes to the pool, never over
//! memory a peer can still write.
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
//! As TCP: a trusted cluster network. A sender that knows the key can put
//! anywhere in the landing region (never elsewhere: UCX checks the remote
//! range against the registration); the CRC over the private copy makes a
//! stray write fail a transfer rather than corrupt KV. Addresses are UCX
//! worker addresses, hex-encoded; UCX parses the one a `Hello` carries.

mod driver;
pub mod fault;
mod landing;
mod sender;
mod server;
mod wire;

pub use sender::{UcxKvSender, UcxSenderConfig};
pub use server::{UcxCloseReason, UcxKvServer, UcxServerConfig, UcxServerStats};
pub use wire::{LandingRefusal, WireError};

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
