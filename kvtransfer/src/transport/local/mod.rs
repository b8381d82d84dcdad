//! Same-host transport: KV payloads through shared memory, control over a
//! Unix domain socket. For a prefill and a decode worker on one machine,
//! run by one operator.
//!
//! # Design
//!
//! ```text
//! prefill: LocalKvSender                         decode: LocalKvServer (one task per connection)
//!   connect ── Hello ─────────────────────────▶  (peer uid checked, then) Receiver::on_hello
//!          ◀── HelloAck | HelloReject ────────   reject: reply, close
//!   ring ───── Ring{slots, slot_bytes} + memfd ─▶  fd checked (sealed shmem, size), mapped read-only
//!          ◀── RingAck | RingReject ──────────   reject: reply, close
//!   send_layer: copy K‖V into a free slot, CRC it,
//!          ─── Data{slot, LayerData header} ──▶  copy the slot out, Credit the slot back,
//!          ◀── Credit{slot} ──────────────────     Receiver::on_layer_checked → BlockSink::write_layer_owned
//!          ◀── Abort{reason} (once) ──────────   the frame was refused
//!   complete ─ Complete ──────────────────────▶  Receiver::on_complete
//!          ◀── Ack | Abort ───────────────────
//! ```
//!
//! The socket carries the protocol's own frames (the [`frame`](crate::frame)
//! codec) and this transport's few messages (`wire.rs` has the table). The
//! sender creates the ring — a memfd of `slots` slots, each holding one
//! frame's payload — and passes it with `SCM_RIGHTS`: its size is the
//! sender's choice, bounded by the server's limits, and its memory is
//! charged to the sender. Slots are credit-based: the sender writes only
//! slots it owns, a `Data` message hands one to the receiver, and a
//! `Credit` hands it back, so at most `slots` frames are in flight and
//! a long transfer streams through a small ring.
//!
//! Copies. The sender copies K and V into a free slot and the receiver
//! copies the slot into a payload buffer of its own; each computes the
//! CRC-32C *in* its copy, on every 8-byte word between its load and its
//! store (`checksum::copy_crc`: three interleaved CRC streams, merged with a
//! precomputed shift), so the checksum costs no pass over memory of its own.
//! Copying a chunk and then checksumming it from L1 (16-64 KiB chunks) was
//! measured first and was slower than copy-then-checksum here: the CRC is
//! bound by the CRC instruction's throughput, not by memory, so it only
//! overlaps the copy when the two share one loop. In a 256 MiB
//! microbenchmark: copy alone ~25 ms, copy then CRC ~40 ms, chunked ~45 ms,
//! fused ~31 ms. The sender copies from the caller's gathered layer
//! ([`LocalKvSender::send_layer`], the TCP sender's signature) or straight
//! from the pool's storage ([`LocalKvSender::send_stored_blocks`], one copy
//! fewer, three blocks per fused round). The receiver credits the slot once
//! copied and hands [`Receiver::on_layer_checked`](crate::Receiver::on_layer_checked)
//! the checksum of its own copy, so the receiver state machine never reads
//! the payload; the [`BlockSink`](super::BlockSink) gets the buffer by
//! value ([`OwnedPayload`](super::OwnedPayload), back to a bounded pool
//! when dropped), so the decode worker can pass it to its engine thread
//! without another copy. The receiver's copy is one more than reading the
//! slot in place, and it is kept on purpose:
//! - **Trust.** A slot is shared memory the sender can still write. Had the
//!   receiver checked the checksum over the slot and then copied the slot
//!   into the pool, a sender rewriting the slot in between (a bug reusing a
//!   slot before its credit came back, or malice) would land unchecked
//!   bytes in KV. The checksum is of the words as stored into private
//!   memory, and everything after — block range checks, the sink — reads
//!   only that memory; a rewritten slot can at worst fail its own frame's
//!   checksum, which fails that reservation.
//! - **Cost.** It is cache to cache (a recently written slot into a reused
//!   buffer), and with the checksum fused into it, little more than the
//!   copy. Before fusing, in `benches/local.rs`, the receiver spent per
//!   256 MiB: copy 16 ms, checksum 11 ms, the pool scatter 29 ms, vs.
//!   ~30 ms for one `memcpy` of the same bytes. The receiver's thread is the
//!   pipeline's bottleneck with an inline sink; a deferring sink (the decode
//!   worker's) moves the scatter to another core.
//!
//! Credits are batched (a quarter of the ring at a time, all of them before
//! the server waits for input): each one is a wake-up for the sender.
//!
//! The alternatives considered: `pread`/`pwrite` on the memfd instead of
//! mappings (no `unsafe` at all, but the kernel's copies ran at 35-40% of
//! the speed of a user-space copy between the same buffers here), and the
//! payload inline on the Unix socket (two kernel copies per byte, socket
//! buffer limits).
//!
//! # Trust model
//!
//! Same host, processes of one operator. A filesystem socket path is
//! guarded by its directory's permissions; an abstract name (`@name`) is
//! open to every process in the network namespace, so by default the server
//! also refuses peers whose user id differs from its own (`SO_PEERCRED`;
//! [`LocalServerConfig::same_uid_only`]). As with TCP, the CRC-32C guards
//! against accidents, not against a hostile sender, who can always send
//! well-checksummed wrong KV for reservations it names. What the transport
//! does guarantee against a faulty or hostile peer: the server never
//! panics, never faults on the mapping (see `shm.rs`: sealed, tmpfs,
//! read-only), holds at most one mapping of bounded size per connection,
//! never reads a byte of KV that was not checksummed in private memory,
//! and never frees blocks: a peer that vanishes mid-transfer leaves its
//! reservation to end through the [`Receiver`](crate::Receiver)'s lease. The sender's ring is
//! sealed so that no one else can write to it.
//!
//! # Errors
//!
//! | event | reply | connection |
//! |---|---|---|
//! | peer's uid differs (with `same_uid_only`) | none | closed |
//! | bytes that are not a message | none | closed |
//! | first message not `Hello`; handshake refused | —; `HelloReject` | closed |
//! | ring refused (no fd, not sealed shmem, wrong size, over limits) | `RingReject{reason}` | closed |
//! | `Data` naming a slot or length outside the ring | none | closed: slot accounting is lost |
//! | a message a sender never sends | none | closed |
//! | `Data`/`Complete` refused by the [`Receiver`](crate::Receiver) | `Abort{reason}`, once per reservation | kept |
//! | the sink fails | reservation aborted, `Abort{Corrupt}` | kept |
//! | no byte for `idle_timeout` | none | closed |
//!
//! Linux only (memfd, seals, `SCM_RIGHTS`, abstract names).

mod sender;
mod server;
mod shm;
mod wire;

use std::io;
use std::os::unix::ffi::OsStringExt;
use std::path::PathBuf;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::time::timeout;

pub use sender::{LocalKvSender, LocalSenderConfig};
pub use server::{LocalKvServer, LocalServerConfig, LocalServerStats};
pub use wire::{check_decode, RingRefusal, RingSpec, WireError};

use super::stream::WriteError;
use wire::{Msg, MsgReader};

/// Default slot size (payload bytes per frame). In `benches/local.rs`,
/// 1 MiB slots beat 256 KiB ones (fewer messages and wake-ups per byte)
/// and matched 2 MiB ones.
pub const DEFAULT_SLOT_BYTES: usize = 1 << 20;

/// Default number of slots: 8 MiB of ring, which did as well as larger
/// rings and better than 4 slots.
pub const DEFAULT_SLOTS: usize = 8;

/// The path tokio binds or connects for an address string: `@name` is
/// `name` in the Linux abstract namespace, anything else a filesystem path.
fn socket_path(addr: &str) -> io::Result<PathBuf> {
    if addr.is_empty() || addr == "@" {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "empty local socket address"));
    }
    Ok(match addr.strip_prefix('@') {
        Some(name) => {
            let mut bytes = Vec::with_capacity(name.len() + 1);
            bytes.push(0);
            bytes.extend_from_slice(name.as_bytes());
            PathBuf::from(std::ffi::OsString::from_vec(bytes))
        }
        None => PathBuf::from(addr),
    })
}

/// Why reading the next message failed.
#[derive(Debug)]
enum ReadError {
    Io(io::Error),
    Idle(Duration),
    Wire(WireError),
    /// EOF inside a message.
    Truncated,
}

/// Reads until a whole message is buffered, each read waiting at most
/// `idle`. `Ok(None)`: the peer closed cleanly between messages — a reset
/// there included: a Unix socket is reset only by a peer that closed with
/// bytes of ours unread (credits a sender no longer needed), which ends the
/// connection at a message boundary just as a plain close does.
async fn next_msg(stream: &mut UnixStream, reader: &mut MsgReader, idle: Duration) -> Result<Option<Msg>, ReadError> {
    loop {
        if let Some(m) = reader.decode().map_err(ReadError::Wire)? {
            return Ok(Some(m));
        }
        let n = match timeout(idle, stream.read(reader.space())).await {
            Err(_) => return Err(ReadError::Idle(idle)),
            Ok(Err(e)) if e.kind() == io::ErrorKind::ConnectionReset && reader.is_empty() => return Ok(None),
            Ok(Err(e)) => return Err(ReadError::Io(e)),
            Ok(Ok(n)) => n,
        };
        if n == 0 {
            return if reader.is_empty() { Ok(None) } else { Err(ReadError::Truncated) };
        }
        reader.advance(n);
    }
}

/// Encodes `msg` into `out` and writes it within `wait`.
async fn write_msg(stream: &mut UnixStream, out: &mut Vec<u8>, msg: &Msg, wait: Duration) -> Result<(), WriteError> {
    out.clear();
    msg.encode(out);
    write_all(stream, out, wait).await
}

/// Writes `bytes` within `wait`.
async fn write_all(stream: &mut UnixStream, bytes: &[u8], wait: Duration) -> Result<(), WriteError> {
    // Control messages are small and almost always fit the socket buffer at
    // once: try that first and skip arming a timer on the hot path.
    let done = match stream.try_write(bytes) {
        Ok(n) => n,
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => 0,
        Err(e) => return Err(WriteError::Io(e)),
    };
    if done == bytes.len() {
        return Ok(());
    }
    match timeout(wait, stream.write_all(&bytes[done..])).await {
        Err(_) => Err(WriteError::Timeout(wait)),
        Ok(r) => r.map_err(WriteError::Io),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_map_to_paths_and_abstract_names() {
        assert_eq!(socket_path("/run/tandem/kv.sock").expect("path"), PathBuf::from("/run/tandem/kv.sock"));
        let abs = socket_path("@tandem-kv").expect("abstract");
        assert_eq!(abs.as_os_str().as_encoded_bytes(), b"\0tandem-kv");
        assert!(socket_path("").is_err());
        assert!(socket_path("@").is_err());
    }
}
