//! The prefill side of one frame stream, over any byte stream: handshake,
//! `LayerData` frames written from the caller's K and V in place,
//! `Complete`/`Ack`, `Abort`. The TCP and QUIC senders wrap it.

use std::io;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::time::{timeout_at, Instant};
use types::kv::KvLayout;

use super::error::TransferError;
use super::outbound::{self, Outbound};
use super::stream::{write_frame, write_parts, FrameReader, ReadError};
use crate::buffers::Buffers;
use crate::checksum;
use crate::frame::{AbortReason, Ack, DecodeLimits, Frame, LayerDataHeader, LAYER_DATA_OVERHEAD};
use crate::sender::{blocks_per_frame, SplitError};
use crate::session::{Peer, Reservation};

/// How one layer's K and V are cut into frames.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LayerPlan {
    /// Bytes of one block's K (or V).
    pub(crate) side: usize,
    pub(crate) n_blocks: usize,
    /// Blocks per frame.
    pub(crate) per_frame: usize,
}

impl LayerPlan {
    /// Checks `k`/`v` against the layout and sizes frames to `max_frame_bytes`
    /// (the same cut as [`split_layer`](crate::split_layer)).
    pub(crate) fn new(
        l: &KvLayout,
        layer: usize,
        k: &[u8],
        v: &[u8],
        max_frame_bytes: usize,
    ) -> Result<Self, SplitError> {
        if layer >= l.n_layers || layer > u32::MAX as usize {
            return Err(SplitError::LayerOutOfRange { layer, n_layers: l.n_layers });
        }
        let side = l.block_elems() * l.dtype.size();
        if side == 0 || k.is_empty() || k.len() != v.len() || k.len() % side != 0 {
            return Err(SplitError::Shape { len: k.len() + v.len(), per_block: 2 * side });
        }
        let n_blocks = k.len() / side;
        if n_blocks > u32::MAX as usize {
            return Err(SplitError::TooManyBlocks { n_blocks });
        }
        let per_frame = blocks_per_frame(2 * side, max_frame_bytes)?;
        Ok(Self { side, n_blocks, per_frame })
    }

    /// Frames of the layer.
    pub(crate) fn n_frames(&self) -> usize {
        self.n_blocks.div_ceil(self.per_frame)
    }
}

/// The sender's end of one frame stream, after the handshake.
#[derive(Debug)]
pub(crate) struct FrameSender<R, W> {
    rd: R,
    wr: W,
    layout: KvLayout,
    timeout: Duration,
    max_frame_bytes: usize,
    reader: FrameReader,
    out: Vec<u8>,
    /// Acks and aborts that arrived before the caller asked about them.
    heard: Outbound,
    bytes_sent: u64,
}

impl<R, W> FrameSender<R, W>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    /// Does the handshake as `local`, whose KV has `layout`, on a fresh stream.
    pub(crate) async fn handshake(
        rd: R,
        wr: W,
        local: &Peer,
        layout: KvLayout,
        wait: Duration,
        max_frame_bytes: usize,
    ) -> Result<Self, TransferError> {
        // The receiver only sends small control frames.
        let reader = FrameReader::new(DecodeLimits { max_payload_bytes: 0 }, Buffers::new(0));
        let mut s = Self {
            rd,
            wr,
            layout,
            timeout: wait,
            max_frame_bytes,
            reader,
            out: Vec::with_capacity(LAYER_DATA_OVERHEAD),
            heard: Outbound::default(),
            bytes_sent: 0,
        };
        let hello = Frame::Hello(outbound::hello(local));
        write_frame(&mut s.wr, &mut s.out, &hello, wait).await.map_err(|e| TransferError::write(e, "sending Hello"))?;
        match s.reader.next(&mut s.rd, wait).await.map_err(|e| TransferError::read(e, "HelloAck"))? {
            Some(f) => outbound::hello_answer_frame(f).map(|()| s),
            None => Err(TransferError::Io(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "receiver closed the connection during the handshake",
            ))),
        }
    }

    /// The largest `LayerData` frame this stream writes.
    pub(crate) fn max_frame_bytes(&self) -> usize {
        self.max_frame_bytes
    }

    /// Payload and header bytes written so far.
    pub(crate) fn bytes_sent(&self) -> u64 {
        self.bytes_sent
    }

    /// The stream's two halves, for a graceful close.
    pub(crate) fn into_parts(self) -> (R, W) {
        (self.rd, self.wr)
    }

    /// Sends K and V of blocks `first_block..` of the reservation for one
    /// layer, cut into frames of whole blocks. See `TcpKvSender::send_blocks`.
    pub(crate) async fn send_blocks(
        &mut self,
        r: Reservation,
        layer: usize,
        first_block: usize,
        k: &[u8],
        v: &[u8],
    ) -> Result<(), TransferError> {
        let plan = LayerPlan::new(&self.layout, layer, k, v, self.max_frame_bytes)?;
        if first_block.checked_add(plan.n_blocks).is_none_or(|end| end > u32::MAX as usize) {
            return Err(SplitError::TooManyBlocks { n_blocks: first_block.saturating_add(plan.n_blocks) }.into());
        }
        self.send_frames(r, layer, first_block, k, v, plan).await
    }

    /// Sends every frame of `k`/`v` under `plan`, numbering blocks from `base`.
    async fn send_frames(
        &mut self,
        r: Reservation,
        layer: usize,
        base: usize,
        k: &[u8],
        v: &[u8],
        plan: LayerPlan,
    ) -> Result<(), TransferError> {
        let LayerPlan { side, n_blocks, per_frame } = plan;
        let frames = 0..plan.n_frames();
        for i in frames {
            self.may_send(r)?;
            let first = i * per_frame;
            if first >= n_blocks {
                break;
            }
            let n = per_frame.min(n_blocks - first);
            let range = first * side..(first + n) * side;
            let (kr, vr) = (&k[range.clone()], &v[range]);
            let header = LayerDataHeader {
                reservation: r.id.0,
                generation: r.generation,
                // All checked to fit u32 by LayerPlan::new and send_blocks.
                layer: layer as u32,
                first_block: (base + first) as u32,
                n_blocks: n as u32,
                checksum: checksum::crc32c_append(checksum::crc32c_append(0, kr), vr),
                payload_len: 2 * kr.len(),
            };
            #[cfg(feature = "fault-injection")]
            let flipped = super::fault::corrupt_copy(layer, base + first, kr);
            #[cfg(feature = "fault-injection")]
            let kr = flipped.as_deref().unwrap_or(kr);
            self.out.clear();
            header.encode(&mut self.out).map_err(|e| TransferError::Protocol(e.to_string()))?;
            write_parts(&mut self.wr, [self.out.as_slice(), kr, vr], self.timeout)
                .await
                .map_err(|e| TransferError::write(e, "writing a LayerData frame"))?;
            self.bytes_sent += (LAYER_DATA_OVERHEAD + 2 * kr.len()) as u64;
        }
        Ok(())
    }

    /// Sends `Complete` and waits for the `Ack`. See `TcpKvSender::complete`.
    pub(crate) async fn complete(&mut self, r: Reservation) -> Result<Ack, TransferError> {
        let drained = self.drain();
        let wait = self.timeout;
        let complete = self.heard.complete(r, &self.layout, Instant::now(), wait)?;
        drained?;
        write_frame(&mut self.wr, &mut self.out, &complete, wait)
            .await
            .map_err(|e| TransferError::write(e, "sending Complete"))?;
        loop {
            if let Some(answer) = self.heard.answer(r, Instant::now()) {
                return answer;
            }
            let Some(deadline) = self.heard.deadline(r) else {
                return Err(TransferError::Protocol("Complete no longer awaited".into()));
            };
            // Past the deadline the machine answers Timeout on the next turn.
            let Ok(next) = timeout_at(deadline, self.reader.next(&mut self.rd, wait)).await else { continue };
            match next.map_err(|e| TransferError::read(e, "Ack"))? {
                Some(f) => self.heard.on_frame(f)?,
                None => {
                    return Err(TransferError::Io(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "receiver closed the connection before acknowledging",
                    )))
                }
            }
        }
    }

    /// Sends `Abort`, unless the machine says none is due (the receiver
    /// acknowledged or aborted `r`, or it was aborted already).
    pub(crate) async fn abort(&mut self, r: Reservation, reason: AbortReason) -> Result<(), TransferError> {
        let Some(abort) = self.heard.abort(r, reason) else { return Ok(()) };
        write_frame(&mut self.wr, &mut self.out, &abort, self.timeout)
            .await
            .map_err(|e| TransferError::write(e, "sending Abort"))
    }

    /// Takes in whatever the receiver already sent, without waiting; fails
    /// when it closed the stream. See `TcpKvSender::check_open`.
    pub(crate) fn check_open(&mut self) -> Result<(), TransferError> {
        self.drain()
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
            while let Some(f) = self.reader.decode().map_err(|e| TransferError::read(ReadError::Decode(e), ""))? {
                self.heard.on_frame(f)?;
            }
            match self.reader.read_ready(&mut self.rd)? {
                Some(0) => return Ok(()),
                Some(_) => {}
                None => {
                    return Err(TransferError::Io(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "receiver closed the connection",
                    )))
                }
            }
        }
    }
}

impl<R: AsyncRead + Unpin> FrameSender<R, tokio::net::tcp::OwnedWriteHalf> {
    /// Sends a layer's frames straight from the sender's pool (see
    /// [`PinnedLayer`](super::PinnedLayer)): each frame's header with the checksum the
    /// layer was given where it was computed, then its blocks' K and V where they lie in
    /// `pool`. See `TcpKvSender::send_pinned`.
    pub(crate) async fn send_pinned(
        &mut self,
        r: Reservation,
        layer: &super::PinnedLayer,
        pool: &super::DirectPool,
    ) -> Result<(), TransferError> {
        if pool.layout() != &self.layout || !layer.cut_for(&self.layout, self.max_frame_bytes) {
            return Err(TransferError::Protocol(
                "a pinned layer of another layout or frame size than its connection's".into(),
            ));
        }
        let side = self.layout.side_bytes();
        for (first_block, blocks, crc) in layer.frames() {
            self.may_send(r)?;
            let pieces = pool.pieces(layer.layer(), blocks).ok_or_else(|| {
                TransferError::Protocol(format!("a pinned layer names blocks outside its pool: {blocks:?}"))
            })?;
            let payload_len = 2 * side * blocks.len();
            #[allow(unused_mut, reason = "only a drill's fault changes it")]
            let mut checksum = crc;
            #[cfg(feature = "fault-injection")]
            if super::fault::corrupt_checksum(layer.layer(), first_block, payload_len) {
                checksum ^= 1;
            }
            let header = LayerDataHeader {
                reservation: r.id.0,
                generation: r.generation,
                // Checked to fit u32 by PinnedLayer::new.
                layer: layer.layer() as u32,
                first_block: first_block as u32,
                n_blocks: blocks.len() as u32,
                checksum,
                payload_len,
            };
            self.out.clear();
            header.encode(&mut self.out).map_err(|e| TransferError::Protocol(e.to_string()))?;
            super::pinned::write_pinned(self.wr.as_ref(), &self.out, &pieces, self.timeout)
                .await
                .map_err(|e| TransferError::write(e, "writing a LayerData frame"))?;
            self.bytes_sent += (LAYER_DATA_OVERHEAD + payload_len) as u64;
        }
        Ok(())
    }
}
