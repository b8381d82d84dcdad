//! The data frames of a reservation as the receiver checks them: each layer's
//! payload (where it goes, or why it is refused), the sender's completion and its
//! abort. Every refusal is counted by its reason.

use super::*;

impl Receiver {
    /// Checks a layer frame and says where its payload goes. The caller
    /// writes the payload only on `Ok`. Computes the payload's CRC-32C
    /// (only once every other check passed); a transport that already
    /// computed it while copying the payload calls
    /// [`on_layer_checked`](Self::on_layer_checked) instead.
    pub fn on_layer(&mut self, frame: &LayerData, now: Instant) -> Result<WriteInstruction, FrameError> {
        self.layer_checked(&frame.header(), || frame.payload_checksum(), now)
    }

    /// [`on_layer`](Self::on_layer) for a transport that computed the
    /// payload's CRC-32C itself, in the same pass that copied the payload
    /// into memory it owns (so the checksum reads bytes still in cache
    /// rather than reading them all again). Same checks, errors, counters
    /// and outcomes as `on_layer` for a frame whose payload has that
    /// checksum: a `computed_crc32c` that differs from `header.checksum`
    /// fails the reservation with [`FrameError::ChecksumMismatch`].
    ///
    /// The caller's side of the contract: `header.payload_len` is the
    /// length of the payload it holds, `computed_crc32c` was computed over
    /// exactly those bytes *where they will be read from for the write* —
    /// the transport's own copy, never memory a peer can still change (a
    /// shared-memory slot) — and it writes those bytes only on `Ok`.
    pub fn on_layer_checked(
        &mut self,
        header: &LayerDataHeader,
        computed_crc32c: u32,
        now: Instant,
    ) -> Result<WriteInstruction, FrameError> {
        self.layer_checked(header, || computed_crc32c, now)
    }

    /// Both entry points: `crc` yields the payload's checksum, asked for
    /// only after every other check passed.
    fn layer_checked(
        &mut self,
        header: &LayerDataHeader,
        crc: impl FnOnce() -> u32,
        now: Instant,
    ) -> Result<WriteInstruction, FrameError> {
        let r = self.layer_inner(header, crc, now);
        self.count_layer(header, &r);
        r
    }

    /// Counts a layer frame's verdict: accepted with its bytes, or refused by reason.
    pub(super) fn count_layer(&mut self, header: &LayerDataHeader, verdict: &Result<WriteInstruction, FrameError>) {
        match verdict {
            Ok(_) => {
                self.counters.layer_frames_accepted += 1;
                self.counters.payload_bytes_accepted += header.payload_len as u64;
            }
            Err(e) => self.counters.count_refusal(e),
        }
    }

    fn layer_inner(
        &mut self,
        f: &LayerDataHeader,
        crc: impl FnOnce() -> u32,
        now: Instant,
    ) -> Result<WriteInstruction, FrameError> {
        let (idx, res, blocks) = self.check_layer(f, now)?;
        let actual = crc();
        if actual != f.checksum {
            self.end_to_outbox(idx, ReservationState::Failed, ReleaseCause::Corrupt);
            return Err(FrameError::ChecksumMismatch { reservation: res, expected: f.checksum, actual });
        }
        let Some(live) = self.live_mut(idx) else { return Err(FrameError::UnknownReservation { id: f.reservation }) };
        live.coverage.mark(f.layer as usize, blocks.clone());
        Ok(WriteInstruction { reservation: res, layer: f.layer as usize, blocks: live.blocks[blocks].to_vec() })
    }

    /// Every check of a layer frame but its checksum: its reservation
    /// receiving within its lease (expired here if it passed), its layer,
    /// its range within the reservation, its length, and none of its
    /// blocks written (or being read into directly) already. Returns the slot, the
    /// reservation and the range of the reservation's blocks it covers.
    pub(super) fn check_layer(
        &mut self,
        f: &LayerDataHeader,
        now: Instant,
    ) -> Result<(usize, Reservation, std::ops::Range<usize>), FrameError> {
        let (idx, res) = self.receiving(f.reservation, f.generation, now)?;
        let n_layers = self.config.layout.n_layers;
        let side_bytes = self.side_bytes;
        let Some(live) = self.live_mut(idx) else { return Err(FrameError::UnknownReservation { id: f.reservation }) };
        let layer = f.layer as usize;
        if layer >= n_layers {
            return Err(FrameError::LayerOutOfRange { layer: f.layer, n_layers });
        }
        if f.n_blocks == 0 {
            return Err(FrameError::EmptyRange);
        }
        let (first, n) = (f.first_block as usize, f.n_blocks as usize);
        // Both are u32, so the sum cannot overflow usize on 64-bit; checked anyway.
        let end = match first.checked_add(n) {
            Some(end) if end <= live.blocks.len() => end,
            _ => {
                let reserved = live.blocks.len();
                return Err(FrameError::BlockRange { first_block: f.first_block, n_blocks: f.n_blocks, reserved });
            }
        };
        // n <= blocks.len(): at most the reservation's bytes for one layer.
        let expected = n.saturating_mul(2 * side_bytes);
        if f.payload_len != expected {
            return Err(FrameError::PayloadLength { got: f.payload_len, expected });
        }
        if let Some(b) = live.coverage.first_written(layer, first..end) {
            return Err(FrameError::Duplicate { layer: f.layer, block: b as u32 });
        }
        Ok((idx, res, first..end))
    }

    /// Acknowledges a complete transfer; from here [`take_ready`](Self::take_ready)
    /// hands the blocks to the engine.
    pub fn on_complete(&mut self, c: &Complete, now: Instant) -> Result<Ack, FrameError> {
        let r = self.complete_inner(c, now);
        match &r {
            Ok(_) => self.counters.reservations_completed += 1,
            Err(e) => self.counters.count_refusal(e),
        }
        r
    }

    fn complete_inner(&mut self, c: &Complete, now: Instant) -> Result<Ack, FrameError> {
        let (idx, _) = self.receiving(c.reservation, c.generation, now)?;
        let expected_layers = self.config.layout.n_layers;
        if c.n_layers as usize != expected_layers {
            return Err(FrameError::LayerCount { got: c.n_layers, expected: expected_layers });
        }
        let Some(live) = self.live_mut(idx) else { return Err(FrameError::UnknownReservation { id: c.reservation }) };
        // A layer still being read into directly is claimed in the coverage but not yet
        // written: only another connection's frame can be (a sender reads
        // nothing between its last layer and its Complete), and the blocks
        // must not reach the engine while it writes them.
        if !live.coverage.is_full() || live.direct > 0 {
            return Err(FrameError::Incomplete { written: live.coverage.written(), expected: live.coverage.total() });
        }
        live.ready = true;
        // Every layer was announced after its last write and checked since:
        // the sender has nothing more to write for it.
        live.exposed = false;
        Ok(Ack { reservation: c.reservation, generation: c.generation })
    }

    /// The sender gave up. The blocks come back through `poll_released`.
    pub fn on_abort(&mut self, a: &Abort, now: Instant) -> Result<(), FrameError> {
        let r = self.receiving(a.reservation, a.generation, now).map(|(idx, _)| {
            self.end_to_outbox(idx, ReservationState::Aborted, ReleaseCause::PeerAborted(a.reason));
        });
        if let Err(e) = &r {
            self.counters.count_refusal(e);
        }
        r
    }
}
