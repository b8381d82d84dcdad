//! The prefill worker's side: one connection and one ring to a decode worker.

use std::io::{self, IoSlice};
use std::mem::MaybeUninit;
use std::sync::Arc;
use std::time::Duration;

use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
use tokio::io::{AsyncWriteExt, Interest};
use tokio::net::UnixStream;
use tokio::time::{timeout, Instant};
use types::kv::{BlockId, KvLayout};

use super::shm::SenderRing;
use super::wire::{Msg, MsgReader, RingSpec, SlotData};
use super::{next_msg, socket_path, write_msg, ReadError, WriteError, DEFAULT_SLOTS, DEFAULT_SLOT_BYTES};
use crate::checksum::{copy_crc3, copy_crc32c, Shift};
use crate::frame::{AbortReason, Ack, Frame, LayerDataHeader};
use crate::sender::SplitError;
use crate::session::{Peer, Reservation};
use crate::transport::outbound::{self, Outbound};
use crate::TransferError;

/// Sender settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalSenderConfig {
    /// Limit for connecting, the handshake, waiting for a free slot, each
    /// control write and waiting for an `Ack`.
    pub timeout: Duration,
    /// Slots in the ring (frames in flight).
    pub slots: usize,
    /// Payload bytes per slot: the largest frame (whole blocks per frame).
    pub slot_bytes: usize,
}

impl Default for LocalSenderConfig {
    /// 10 s, [`DEFAULT_SLOTS`] slots of [`DEFAULT_SLOT_BYTES`].
    fn default() -> Self {
        Self { timeout: Duration::from_secs(10), slots: DEFAULT_SLOTS, slot_bytes: DEFAULT_SLOT_BYTES }
    }
}

/// The prefill worker's end of one connection to a decode worker, with its
/// shared-memory ring.
#[derive(Debug)]
pub struct LocalKvSender {
    stream: UnixStream,
    ring: SenderRing,
    /// Slots the sender owns (not handed to the receiver, or credited back).
    free: Vec<u32>,
    layout: KvLayout,
    config: LocalSenderConfig,
    reader: MsgReader,
    out: Vec<u8>,
    /// Acks and aborts that arrived before the caller asked about them.
    heard: Outbound,
    bytes_sent: u64,
    /// Merges the checksums of three blocks' K (or V) copied side by side.
    shift: Arc<Shift>,
}

fn closed(what: &str) -> TransferError {
    TransferError::Io(io::Error::new(io::ErrorKind::UnexpectedEof, format!("receiver closed the connection {what}")))
}

fn read_error(e: ReadError, what: &'static str) -> TransferError {
    match e {
        ReadError::Io(e) => TransferError::Io(e),
        ReadError::Idle(after) => TransferError::Timeout { what, after },
        ReadError::Wire(e) => TransferError::Protocol(format!("undecodable bytes from the receiver: {e}")),
        ReadError::Truncated => closed("mid-message"),
    }
}

fn write_error(e: WriteError, what: &'static str) -> TransferError {
    match e {
        WriteError::Io(e) => TransferError::Io(e),
        WriteError::Timeout(after) => TransferError::Timeout { what, after },
    }
}

impl LocalKvSender {
    /// Connects to `addr` (a socket path, or `@name` in the abstract
    /// namespace), does the handshake as `local`, whose KV has `layout`,
    /// and hands the receiver a fresh ring.
    pub async fn connect(
        addr: impl AsRef<str>,
        local: &Peer,
        layout: KvLayout,
        config: LocalSenderConfig,
    ) -> Result<Self, TransferError> {
        let side = layout.block_elems() * layout.dtype.size();
        if side == 0 || config.slot_bytes < 2 * side {
            let (max_frame_bytes, needed) = (config.slot_bytes, 2 * side);
            return Err(SplitError::FrameTooSmall { max_frame_bytes, needed }.into());
        }
        let spec = match (u32::try_from(config.slots), u32::try_from(config.slot_bytes)) {
            (Ok(slots), Ok(slot_bytes)) if slots > 0 => RingSpec { slots, slot_bytes },
            _ => {
                let why =
                    format!("{} slots of {} bytes: need 1..2^32 slots of < 4 GiB", config.slots, config.slot_bytes);
                return Err(TransferError::Io(io::Error::new(io::ErrorKind::InvalidInput, why)));
            }
        };
        let ring = SenderRing::create(config.slots, config.slot_bytes)?;
        let wait = config.timeout;
        let path = socket_path(addr.as_ref())?;
        let stream = timeout(wait, UnixStream::connect(path))
            .await
            .map_err(|_| TransferError::Timeout { what: "connecting the local socket", after: wait })??;
        let mut s = Self {
            stream,
            ring,
            // Popped from the back: slot 0 first.
            free: (0..spec.slots).rev().collect(),
            layout,
            config,
            reader: MsgReader::new(),
            out: Vec::with_capacity(64),
            heard: Outbound::default(),
            bytes_sent: 0,
            shift: Arc::new(Shift::new(side)),
        };
        let hello = Frame::Hello(outbound::hello(local));
        write_msg(&mut s.stream, &mut s.out, &Msg::Frame(hello), wait)
            .await
            .map_err(|e| write_error(e, "sending Hello"))?;
        match next_msg(&mut s.stream, &mut s.reader, wait).await.map_err(|e| read_error(e, "HelloAck"))? {
            Some(Msg::Frame(f @ (Frame::HelloAck(_) | Frame::HelloReject(_)))) => outbound::hello_answer_frame(f)?,
            Some(other) => return Err(TransferError::Protocol(format!("{} instead of HelloAck", other.name()))),
            None => return Err(closed("during the handshake")),
        }
        s.send_ring(spec).await?;
        match next_msg(&mut s.stream, &mut s.reader, wait).await.map_err(|e| read_error(e, "RingAck"))? {
            Some(Msg::RingAck) => Ok(s),
            Some(Msg::RingReject(r)) => Err(TransferError::Protocol(format!("receiver refused the ring: {r}"))),
            Some(other) => Err(TransferError::Protocol(format!("{} instead of RingAck", other.name()))),
            None => Err(closed("before accepting the ring")),
        }
    }

    /// Writes the `Ring` message with the memfd attached.
    async fn send_ring(&mut self, spec: RingSpec) -> Result<(), TransferError> {
        self.out.clear();
        Msg::Ring(spec).encode(&mut self.out);
        let (stream, out, fd) = (&self.stream, &self.out, self.ring.fd());
        let send = stream.async_io(Interest::WRITABLE, || {
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
            let mut control = SendAncillaryBuffer::new(&mut space);
            let fds = [fd];
            if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
                return Err(io::Error::other("no room for the descriptor in the control message"));
            }
            rustix::net::sendmsg(stream, &[IoSlice::new(out)], &mut control, SendFlags::NOSIGNAL)
                .map_err(io::Error::from)
        });
        let wait = self.config.timeout;
        let sent =
            timeout(wait, send).await.map_err(|_| TransferError::Timeout { what: "sending Ring", after: wait })??;
        // The descriptor travelled with the first byte; the rest (if the
        // socket took only part) follows as plain bytes.
        let rest = self.out.get(sent..).unwrap_or_default();
        timeout(wait, self.stream.write_all(rest))
            .await
            .map_err(|_| TransferError::Timeout { what: "sending Ring", after: wait })??;
        Ok(())
    }

    /// Payload bytes placed in shared memory plus control bytes written so far.
    pub fn bytes_sent(&self) -> u64 {
        self.bytes_sent
    }

    /// See [`TcpKvSender::check_open`](crate::TcpKvSender::check_open).
    pub fn check_open(&mut self) -> Result<(), TransferError> {
        self.drain()
    }

    /// Sends one layer's K and V of the reservation's blocks (as
    /// the engine's `KvPool::gather_layer` returns
    /// them), cut into frames of whole blocks of at most `slot_bytes`,
    /// each copied once, into a free slot. Waits (up to the timeout) for a
    /// credit when every slot is in flight. Fails fast with
    /// [`PeerAbort`](TransferError::PeerAbort) if the receiver already
    /// refused this reservation.
    pub async fn send_layer(&mut self, r: Reservation, layer: usize, k: &[u8], v: &[u8]) -> Result<(), TransferError> {
        self.send_blocks(r, layer, 0, k, v).await
    }

    /// Sends one layer's K and V of the reservation's blocks
    /// `first_block..first_block + n` (`n` from the lengths of `k` and `v`),
    /// as [`send_layer`](Self::send_layer) does for all of them: a layer may
    /// go out in pieces, as a streaming prefill completes its blocks. Each
    /// (layer, block) must be sent exactly once.
    pub async fn send_blocks(
        &mut self,
        r: Reservation,
        layer: usize,
        first_block: usize,
        k: &[u8],
        v: &[u8],
    ) -> Result<(), TransferError> {
        let side = self.side();
        if k.is_empty() || k.len() != v.len() || k.len() % side != 0 {
            return Err(SplitError::Shape { len: k.len() + v.len(), per_block: 2 * side }.into());
        }
        self.send_frames(r, layer, first_block, k.len() / side, |dst, i, n| {
            let range = i * side..(i + n) * side;
            fill(dst, &k[range.clone()], &v[range])
        })
        .await
    }

    /// Sends one layer of `blocks` straight from where they are stored: `ks` and `vs` are
    /// that layer's whole K and V storage as little-endian bytes, block `b` at
    /// `b * block_bytes` (an engine pool's layer storage, say); `blocks` are the
    /// reservation's blocks `first_block..`. The same frames as gathering the blocks and
    /// [`send_blocks`](Self::send_blocks), with one copy fewer: each block's K and V go
    /// from the storage directly into the slot. For a caller that can lend the storage while
    /// the layer is sent.
    pub async fn send_stored_blocks(
        &mut self,
        r: Reservation,
        layer: usize,
        first_block: usize,
        ks: &[u8],
        vs: &[u8],
        blocks: &[BlockId],
    ) -> Result<(), TransferError> {
        let side = self.side();
        if ks.len() != vs.len() || ks.len() % side != 0 {
            return Err(invalid(&format!(
                "K and V storage of {} and {} bytes are not whole blocks of {side}",
                ks.len(),
                vs.len()
            )));
        }
        let stored = ks.len() / side;
        if let Some(b) = blocks.iter().find(|&&b| b as usize >= stored) {
            return Err(invalid(&format!("block {b} is outside the {stored} stored blocks")));
        }
        if blocks.is_empty() {
            return Err(SplitError::Shape { len: 0, per_block: 2 * side }.into());
        }
        if layer >= self.layout.n_layers {
            return Err(SplitError::LayerOutOfRange { layer, n_layers: self.layout.n_layers }.into());
        }
        let shift = self.shift.clone();
        self.send_frames(r, layer, first_block, blocks.len(), |dst, i, n| {
            fill_blocks(dst, ks, vs, &blocks[i..i + n], &shift)
        })
        .await
    }

    /// Bytes of one block's K (or V) in one layer; connect() checked it is
    /// not 0 and that K and V of one block fit a slot.
    fn side(&self) -> usize {
        self.layout.block_elems() * self.layout.dtype.size()
    }

    /// Sends blocks `first_block..first_block + n_blocks` of `layer` in
    /// frames of whole blocks, each through a free slot that `fill(slot,
    /// i, n)` fills with K then V of the `n` blocks from the `i`-th on,
    /// returning their checksum.
    async fn send_frames(
        &mut self,
        r: Reservation,
        layer: usize,
        first_block: usize,
        n_blocks: usize,
        mut fill: impl FnMut(&mut [u8], usize, usize) -> u32,
    ) -> Result<(), TransferError> {
        let n_layers = self.layout.n_layers;
        if layer >= n_layers || layer > u32::MAX as usize {
            return Err(SplitError::LayerOutOfRange { layer, n_layers }.into());
        }
        // Block indices travel as u32.
        let end = first_block.saturating_add(n_blocks);
        if end > u32::MAX as usize {
            return Err(SplitError::TooManyBlocks { n_blocks: end }.into());
        }
        let side = self.side();
        let per_frame = (self.config.slot_bytes / (2 * side)).max(1);
        let mut i = 0;
        while i < n_blocks {
            self.may_send(r)?;
            let slot = self.free_slot(r).await?;
            let n = per_frame.min(n_blocks - i);
            let dst = self.ring.slot_mut(slot as usize).ok_or_else(|| TransferError::Protocol("slot lost".into()))?;
            let checksum = fill(dst, i, n);
            #[cfg(feature = "fault-injection")]
            let _ = crate::transport::fault::after_checksum(layer, first_block + i, &mut dst[..n * side]);
            let header = LayerDataHeader {
                reservation: r.id.0,
                generation: r.generation,
                // Both checked to fit u32 above.
                layer: layer as u32,
                first_block: (first_block + i) as u32,
                n_blocks: n as u32,
                checksum,
                payload_len: 2 * n * side,
            };
            let msg = Msg::Data(SlotData { slot, header });
            write_msg(&mut self.stream, &mut self.out, &msg, self.config.timeout)
                .await
                .map_err(|e| write_error(e, "writing a Data message"))?;
            self.bytes_sent += (header.payload_len + self.out.len()) as u64;
            i += n;
        }
        Ok(())
    }

    /// A slot the sender owns, waiting for a credit if none is.
    async fn free_slot(&mut self, r: Reservation) -> Result<u32, TransferError> {
        if let Some(s) = self.free.pop() {
            return Ok(s);
        }
        let wait = self.config.timeout;
        let deadline = Instant::now() + wait;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let what = "a free slot (the receiver's Credit)";
            match next_msg(&mut self.stream, &mut self.reader, left).await.map_err(|e| read_error(e, what))? {
                Some(m) => self.note(m)?,
                None => return Err(closed("while slots were in flight")),
            }
            self.heard.check_aborted(r)?;
            if let Some(s) = self.free.pop() {
                return Ok(s);
            }
        }
    }

    /// Says every layer was sent and waits (up to the configured timeout)
    /// for the receiver's `Ack`. After `Ok` the sender may drop its copy.
    pub async fn complete(&mut self, r: Reservation) -> Result<Ack, TransferError> {
        let drained = self.drain();
        let wait = self.config.timeout;
        let complete = self.heard.complete(r, &self.layout, Instant::now(), wait)?;
        drained?;
        write_msg(&mut self.stream, &mut self.out, &Msg::Frame(complete), wait)
            .await
            .map_err(|e| write_error(e, "sending Complete"))?;
        loop {
            if let Some(answer) = self.heard.answer(r, Instant::now()) {
                return answer;
            }
            let Some(deadline) = self.heard.deadline(r) else {
                return Err(TransferError::Protocol("Complete no longer awaited".into()));
            };
            let left = deadline.saturating_duration_since(Instant::now());
            match next_msg(&mut self.stream, &mut self.reader, left).await.map_err(|e| read_error(e, "Ack"))? {
                Some(m) => self.note(m)?,
                None => return Err(closed("before acknowledging")),
            }
        }
    }

    /// Tells the receiver this transfer is abandoned (prefill failed,
    /// request cancelled), unless the machine says no `Abort` is due (the
    /// receiver acknowledged or aborted it, or it was aborted already).
    pub async fn abort(&mut self, r: Reservation, reason: AbortReason) -> Result<(), TransferError> {
        let Some(abort) = self.heard.abort(r, reason) else { return Ok(()) };
        write_msg(&mut self.stream, &mut self.out, &Msg::Frame(abort), self.config.timeout)
            .await
            .map_err(|e| write_error(e, "sending Abort"))
    }

    /// Takes in whatever the receiver already sent, without waiting, then
    /// asks the machine whether more of `r` may go out.
    fn may_send(&mut self, r: Reservation) -> Result<(), TransferError> {
        let drained = self.drain();
        self.heard.layer(r)?;
        drained
    }

    fn drain(&mut self) -> Result<(), TransferError> {
        loop {
            while let Some(m) = self.reader.decode().map_err(|e| read_error(ReadError::Wire(e), ""))? {
                self.note(m)?;
            }
            match self.stream.try_read(self.reader.space()) {
                Ok(0) => return Err(closed("while the sender was busy")),
                Ok(n) => self.reader.advance(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) => return Err(e.into()),
            }
        }
    }

    fn note(&mut self, m: Msg) -> Result<(), TransferError> {
        match m {
            Msg::Credit(slot) if slot < self.config.slots as u32 && !self.free.contains(&slot) => self.free.push(slot),
            Msg::Credit(slot) => {
                return Err(TransferError::Protocol(format!("Credit for slot {slot}, which the sender holds")))
            }
            Msg::Frame(f @ (Frame::Abort(_) | Frame::Ack(_))) => self.heard.on_frame(f)?,
            other => return Err(TransferError::Protocol(format!("unexpected {} from the receiver", other.name()))),
        }
        Ok(())
    }
}

fn invalid(why: &str) -> TransferError {
    TransferError::Io(io::Error::new(io::ErrorKind::InvalidInput, why.to_owned()))
}

/// Copies the K of `blocks` then their V (each `shift.n` bytes in the
/// storages, at `block * shift.n`) to the front of `dst` and returns the
/// CRC-32C of what it wrote, computed in the copy's pass: three blocks at
/// a time ([`copy_crc3`]), the rest one by one.
fn fill_blocks(dst: &mut [u8], ks: &[u8], vs: &[u8], blocks: &[BlockId], shift: &Shift) -> u32 {
    let side = shift.n();
    let mut crc = 0;
    let mut at = 0;
    for storage in [ks, vs] {
        let block = |b: BlockId| &storage[b as usize * side..(b as usize + 1) * side];
        let mut triples = blocks.chunks_exact(3);
        for t in &mut triples {
            crc = copy_crc3(&mut dst[at..], [block(t[0]), block(t[1]), block(t[2])], shift, crc);
            at += 3 * side;
        }
        for &b in triples.remainder() {
            crc = copy_crc32c(&mut dst[at..], block(b), crc);
            at += side;
        }
    }
    crc
}

/// Copies `k` then `v` to the front of `dst` and returns the CRC-32C of
/// what it wrote, computed in the copy's pass ([`copy_crc32c`]).
fn fill(dst: &mut [u8], k: &[u8], v: &[u8]) -> u32 {
    let crc = copy_crc32c(dst, k, 0);
    copy_crc32c(&mut dst[k.len()..], v, crc)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_blocks_matches_a_gather() {
        // Six blocks of 16 bytes per side, each byte naming its block and side.
        let side = 16;
        let ks: Vec<u8> = (0..6 * side).map(|i| (i / side * 10 + i % side) as u8).collect();
        let vs: Vec<u8> = ks.iter().map(|b| b.wrapping_add(128)).collect();
        // A triple and one more block: both paths of fill_blocks.
        let order: [BlockId; 4] = [4, 1, 5, 0];
        let gather = |s: &[u8]| -> Vec<u8> {
            order.iter().flat_map(|&b| s[b as usize * side..(b as usize + 1) * side].to_vec()).collect()
        };
        let want = [gather(&ks), gather(&vs)].concat();
        let mut dst = vec![0u8; 8 * side + 5];
        let crc = fill_blocks(&mut dst, &ks, &vs, &order, &Shift::new(side));
        assert_eq!(&dst[..8 * side], &want[..]);
        assert_eq!(crc, crc32c::crc32c(&dst[..8 * side]));
        assert!(dst[8 * side..].iter().all(|&b| b == 0), "nothing written past the blocks");
    }

    #[test]
    fn fill_copies_k_then_v_and_checksums_what_it_wrote() {
        let k: Vec<u8> = (0..100_000u32).map(|i| (i * 7) as u8).collect();
        let v: Vec<u8> = (0..100_000u32).map(|i| (i * 13 + 1) as u8).collect();
        let mut dst = vec![0u8; 250_000];
        let crc = fill(&mut dst, &k, &v);
        assert_eq!(&dst[..100_000], &k[..]);
        assert_eq!(&dst[100_000..200_000], &v[..]);
        assert!(dst[200_000..].iter().all(|&b| b == 0));
        assert_eq!(crc, crc32c::crc32c(&dst[..200_000]));
    }
}
