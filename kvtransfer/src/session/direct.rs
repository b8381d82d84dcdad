//! Writers in place: a peer storing into the reservation's pool blocks
//! itself (UCX's direct path: [`Receiver::expose`] and
//! [`Receiver::fence`]), and direct reads, a stream transport reading a
//! layer's payload straight into them (TCP with a direct pool: one copy,
//! socket to pool) instead of into a buffer the sink then copies from.
//! Either way the blocks may be written while the reservation ends, so an
//! end then quarantines them until the last writer is done.
//!
//! The bytes are in the blocks before their checksum can be checked, so the
//! order of the rules changes, not the rules: every check but the checksum
//! before the first byte lands ([`Receiver::begin_direct`], which also
//! claims the frame's cells so no second writer lands on them), the
//! checksum once the last one has ([`Receiver::end_direct`]). While a
//! direct read is open the reservation's blocks are written by it, so an end of
//! the reservation meanwhile (lease, abort, another frame's corruption)
//! quarantines them, as for a one-sided writer ([`Receiver::expose`]):
//! they come back through `poll_released` only when the last direct read ended,
//! and its `Complete` is refused until then.

use tokio::time::Instant;
use types::kv::BlockId;

use super::{FrameError, Receiver, Reservation, ReservationId, SlotState, WriteInstruction};
use crate::frame::LayerDataHeader;

impl Receiver {
    /// Marks a receiving `r` as written in place by a peer (a one-sided
    /// transport writing straight into the pool) and returns its blocks, in
    /// reservation order; `None` if it is not receiving. From here until
    /// [`fence`](Self::fence) (or its `Complete` is acknowledged), an end
    /// of `r` — lease, abort on either side, corruption — does not give its
    /// blocks back: they wait in quarantine, counted as held, because the
    /// peer may still be writing them.
    pub fn expose(&mut self, r: Reservation) -> Option<Vec<BlockId>> {
        let slot = self.slots.get_mut(usize::try_from(r.id.0).ok()?)?;
        match &mut slot.state {
            SlotState::Live(l) if slot.generation == r.generation && !l.ready => {
                l.exposed = true;
                Some(l.blocks.clone())
            }
            _ => None,
        }
    }

    /// The peer that wrote `r` in place can write no more (it flushed and
    /// said so, or it is gone). A quarantined `r`'s blocks go to
    /// [`poll_released`](Self::poll_released) (returns `true`); a live one
    /// ends normally from now on. Unknown or unexposed: nothing happens.
    pub fn fence(&mut self, r: Reservation) -> bool {
        if let Some(q) = self.quarantine.get_mut(&r) {
            q.exposed = false;
            return self.unquarantine_if_unwritten(r);
        }
        if let Ok(idx) = self.find(r) {
            if let SlotState::Live(l) = &mut self.slots[idx].state {
                l.exposed = false;
            }
        }
        false
    }

    /// Blocks of ended reservations waiting for their writer's fence.
    pub fn quarantined_blocks(&self) -> usize {
        self.quarantine.values().map(|q| q.released.blocks.len()).sum()
    }

    /// Opens a direct read of the frame `header` announces: every check
    /// [`on_layer_checked`](Self::on_layer_checked) makes but the
    /// checksum, then its cells claimed and the reservation held as written
    /// in place. Returns the pool blocks its payload goes into, K then V of
    /// each, in order. A refusal is not counted and changes nothing but an
    /// expiry that was due: the caller reads the payload the ordinary way
    /// and `on_layer_checked` refuses it again, counted once.
    ///
    /// Every `Ok` must be followed by [`end_direct`](Self::end_direct)
    /// (the payload landed) or [`abandon_direct`](Self::abandon_direct)
    /// (it did not), once.
    pub fn begin_direct(&mut self, header: &LayerDataHeader, now: Instant) -> Result<Vec<BlockId>, FrameError> {
        let (idx, _, range) = self.check_layer(header, now)?;
        let Some(live) = self.live_mut(idx) else {
            return Err(FrameError::UnknownReservation { id: header.reservation });
        };
        live.coverage.mark(header.layer as usize, range.clone());
        live.direct += 1;
        Ok(live.blocks[range].to_vec())
    }

    /// Closes a direct read whose payload is all in the blocks, with CRC-32C
    /// `computed_crc32c` of the bytes as they lie there: accepted as
    /// `on_layer_checked` accepts a frame (the returned instruction names
    /// the blocks, already written), or refused — the reservation ended
    /// meanwhile, or the checksum differs, which fails it — counted as
    /// `on_layer_checked` counts.
    pub fn end_direct(
        &mut self,
        header: &LayerDataHeader,
        computed_crc32c: u32,
        now: Instant,
    ) -> Result<WriteInstruction, FrameError> {
        self.close_direct(header, true);
        let r = self.landed(header, computed_crc32c, now);
        self.count_layer(header, &r);
        r
    }

    /// Closes a direct read whose payload did not all arrive (the connection
    /// failed mid-frame): its cells are no longer claimed, and nothing is
    /// counted (the connection's close says why).
    pub fn abandon_direct(&mut self, header: &LayerDataHeader) {
        self.close_direct(header, false);
    }

    /// Open direct reads of `r` (0 when it is unknown or ended).
    pub fn direct_reads(&self, r: Reservation) -> u32 {
        match self.slots.get(r.id.0 as usize) {
            Some(slot) if slot.generation == r.generation => match &slot.state {
                SlotState::Live(l) => l.direct,
                SlotState::Ended(_) => self.quarantine.get(&r).map_or(0, |q| q.direct),
            },
            _ => 0,
        }
    }

    fn landed(&mut self, f: &LayerDataHeader, crc: u32, now: Instant) -> Result<WriteInstruction, FrameError> {
        let (idx, res) = self.receiving(f.reservation, f.generation, now)?;
        if crc != f.checksum {
            self.end_to_outbox(idx, super::ReservationState::Failed, super::ReleaseCause::Corrupt);
            return Err(FrameError::ChecksumMismatch { reservation: res, expected: f.checksum, actual: crc });
        }
        let Some(live) = self.live_mut(idx) else { return Err(FrameError::UnknownReservation { id: f.reservation }) };
        let (first, n) = (f.first_block as usize, f.n_blocks as usize);
        Ok(WriteInstruction {
            reservation: res,
            layer: f.layer as usize,
            blocks: live.blocks[first..first + n].to_vec(),
        })
    }

    /// One direct read of `header`'s reservation fewer; its cells unclaimed
    /// unless it `landed`. A quarantined reservation's blocks go to the
    /// outbox with its last writer.
    fn close_direct(&mut self, header: &LayerDataHeader, landed: bool) {
        let r = Reservation { id: ReservationId(header.reservation), generation: header.generation };
        let Some(slot) = self.slots.get_mut(header.reservation as usize) else { return };
        if slot.generation == r.generation {
            if let SlotState::Live(l) = &mut slot.state {
                l.direct = l.direct.saturating_sub(1);
                if !landed {
                    let first = header.first_block as usize;
                    l.coverage.unmark(header.layer as usize, first..first + header.n_blocks as usize);
                }
                return;
            }
        }
        if let Some(q) = self.quarantine.get_mut(&r) {
            q.direct = q.direct.saturating_sub(1);
            self.unquarantine_if_unwritten(r);
        }
    }

    /// Moves a quarantined `r` to the outbox once nothing writes it; says
    /// whether it did.
    pub(super) fn unquarantine_if_unwritten(&mut self, r: Reservation) -> bool {
        match self.quarantine.get(&r) {
            Some(q) if !q.exposed && q.direct == 0 => {
                let Some(q) = self.quarantine.remove(&r) else { return false };
                self.outbox.push(q.released);
                true
            }
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::time::Instant;

    use super::super::{Receiver, ReceiverConfig, ReleaseCause, ReservationState};
    use crate::fingerprint::{LayoutFingerprint, VersionGroup};
    use crate::frame::{Complete, LayerData, LayerDataHeader};
    use crate::session::{FrameError, Peer, Reservation};
    use types::kv::{KvDtype, KvLayout};

    const SEC: Duration = Duration::from_secs(1);
    const LAYOUT: KvLayout = KvLayout { n_layers: 2, n_kv_heads: 1, head_dim: 8, block_size: 4, dtype: KvDtype::F16 };
    /// K and V of one block in one layer.
    const PER_BLOCK: usize = 2 * 4 * 8 * 2;

    fn rx() -> Receiver {
        let peer = Peer {
            version_group: VersionGroup::new("g1").expect("label"),
            fingerprint: LayoutFingerprint::new(&LAYOUT, &[1; 32], &[2; 32]),
        };
        Receiver::new(peer, ReceiverConfig::new(LAYOUT)).expect("config")
    }

    /// A frame's header and the checksum of its payload.
    fn frame(r: Reservation, layer: u32, first: u32, n: u32) -> (LayerDataHeader, u32) {
        let payload = (0..n as usize * PER_BLOCK).map(|i| (i as u32 ^ layer) as u8).collect();
        let f = LayerData::new(r.id.0, r.generation, layer, first, n, payload);
        (f.header(), f.checksum)
    }

    fn complete(r: Reservation) -> Complete {
        Complete { reservation: r.id.0, generation: r.generation, n_layers: 2 }
    }

    #[test]
    fn a_landed_layer_counts_as_an_accepted_one_and_completes_the_reservation() {
        let (mut rx, t0) = (rx(), Instant::now());
        let r = rx.reserve(vec![7, 8, 9], 10 * SEC, t0).expect("reserve");
        let (h0, crc0) = frame(r, 0, 1, 2);
        assert_eq!(rx.begin_direct(&h0, t0), Ok(vec![8, 9]));
        assert_eq!(rx.direct_reads(r), 1);
        let w = rx.end_direct(&h0, crc0, t0).expect("landed");
        assert_eq!((w.layer, w.blocks), (0, vec![8, 9]));
        assert_eq!(rx.direct_reads(r), 0);
        // The rest the ordinary way: both paths fill one coverage.
        let data = |layer, first, n| {
            let payload = (0..n as usize * PER_BLOCK).map(|i| (i as u32 ^ layer) as u8).collect();
            LayerData::new(r.id.0, r.generation, layer, first, n, payload)
        };
        rx.on_layer(&data(0, 0, 1), t0).expect("layer 0, block 0");
        rx.on_layer(&data(1, 0, 3), t0).expect("layer 1");
        assert_eq!(rx.counters().layer_frames_accepted, 3);
        assert_eq!(rx.counters().payload_bytes_accepted, 6 * PER_BLOCK as u64);
        rx.on_complete(&complete(r), t0).expect("complete");
        assert_eq!(rx.take_ready(r), Ok(vec![7, 8, 9]));
    }

    #[test]
    fn a_refused_direct_read_is_not_counted_and_the_ordinary_check_refuses_it_once() {
        let (mut rx, t0) = (rx(), Instant::now());
        let r = rx.reserve(vec![1, 2], 10 * SEC, t0).expect("reserve");
        let (h, crc) = frame(r, 0, 0, 2);
        rx.begin_direct(&h, t0).expect("open");
        // A second writer of the same cells, while the first still lands.
        assert_eq!(rx.begin_direct(&h, t0), Err(FrameError::Duplicate { layer: 0, block: 0 }));
        let (bad, _) = frame(r, 2, 0, 1);
        assert_eq!(rx.begin_direct(&bad, t0), Err(FrameError::LayerOutOfRange { layer: 2, n_layers: 2 }));
        assert_eq!(rx.counters().frames_refused.iter().sum::<u64>(), 0, "refusals to begin are not counted");
        rx.end_direct(&h, crc, t0).expect("landed");
        assert_eq!(rx.counters().layer_frames_accepted, 1);
    }

    #[test]
    fn a_wrong_checksum_after_a_direct_read_fails_the_reservation_and_returns_the_blocks_once() {
        let (mut rx, t0) = (rx(), Instant::now());
        let r = rx.reserve(vec![4, 5], 10 * SEC, t0).expect("reserve");
        let (h, crc) = frame(r, 1, 0, 2);
        rx.begin_direct(&h, t0).expect("open");
        let e = rx.end_direct(&h, crc ^ 1, t0);
        assert!(matches!(e, Err(FrameError::ChecksumMismatch { .. })), "{e:?}");
        assert_eq!(rx.state(r), Some(ReservationState::Failed));
        let released = rx.poll_released(t0);
        assert_eq!(released.len(), 1);
        assert_eq!((released[0].blocks.clone(), released[0].cause), (vec![4, 5], ReleaseCause::Corrupt));
        assert_eq!(rx.held_blocks(), 0);
    }

    /// The hazard direct read adds: blocks handed back (and reused by the
    /// engine) while a socket still writes into them. An end meanwhile —
    /// lease, local abort, another frame's corruption — waits for the last
    /// direct read, and a Complete waits too.
    #[test]
    fn blocks_being_read_into_stay_quarantined_until_the_last_direct_read_ends() {
        let (mut rx, t0) = (rx(), Instant::now());
        // Lease: two direct reads open when it passes.
        let r = rx.reserve(vec![1, 2], SEC, t0).expect("reserve");
        let (a, crc_a) = frame(r, 0, 0, 2);
        let (b, _) = frame(r, 1, 0, 2);
        rx.begin_direct(&a, t0).expect("open a");
        rx.begin_direct(&b, t0).expect("open b");
        assert!(rx.poll_released(t0 + 2 * SEC).is_empty(), "expired while direct read: quarantined");
        assert_eq!((rx.quarantined_blocks(), rx.held_blocks(), rx.direct_reads(r)), (2, 2, 2));
        assert_eq!(rx.end_direct(&a, crc_a, t0 + 2 * SEC), Err(FrameError::Expired(r)));
        assert!(rx.poll_released(t0 + 2 * SEC).is_empty(), "one direct read still open");
        rx.abandon_direct(&b);
        let released = rx.poll_released(t0 + 2 * SEC);
        assert_eq!((released.len(), released[0].cause), (1, ReleaseCause::LeaseExpired));
        assert_eq!((rx.quarantined_blocks(), rx.held_blocks()), (0, 0));

        // A local abort while direct read returns nothing now, everything at the end.
        let r = rx.reserve(vec![3], 10 * SEC, t0).expect("reserve");
        let (h, _) = frame(r, 0, 0, 1);
        rx.begin_direct(&h, t0).expect("open");
        assert_eq!(rx.abort(r), Ok(vec![]));
        assert_eq!(rx.quarantined_blocks(), 1);
        rx.abandon_direct(&h);
        assert_eq!(rx.poll_released(t0)[0].blocks, vec![3]);

        // Complete while another connection lands a layer: refused, not ready.
        let r = rx.reserve(vec![6], 10 * SEC, t0).expect("reserve");
        let (l0, c0) = frame(r, 0, 0, 1);
        let (l1, c1) = frame(r, 1, 0, 1);
        rx.begin_direct(&l0, t0).expect("open");
        rx.begin_direct(&l1, t0).expect("open");
        rx.end_direct(&l0, c0, t0).expect("landed");
        assert!(matches!(rx.on_complete(&complete(r), t0), Err(FrameError::Incomplete { .. })));
        rx.end_direct(&l1, c1, t0).expect("landed");
        rx.on_complete(&complete(r), t0).expect("complete once nothing lands");
    }

    #[test]
    fn an_abandoned_direct_read_frees_its_cells_for_a_resend() {
        let (mut rx, t0) = (rx(), Instant::now());
        let r = rx.reserve(vec![1, 2], 10 * SEC, t0).expect("reserve");
        let (h, crc) = frame(r, 0, 0, 2);
        rx.begin_direct(&h, t0).expect("open");
        rx.abandon_direct(&h);
        assert_eq!(rx.counters().layer_frames_accepted, 0);
        rx.begin_direct(&h, t0).expect("the same cells again");
        rx.end_direct(&h, crc, t0).expect("landed");
        assert_eq!(rx.state(r), Some(ReservationState::Receiving));
    }
}
