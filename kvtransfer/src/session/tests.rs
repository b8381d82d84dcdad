use std::time::Duration;
use tokio::time::Instant;

use types::kv::{BlockId, KvDtype, KvLayout};

use super::*;
use crate::frame::{Abort, AbortReason, Complete, Hello, LayerData, RejectReason};

const SEC: Duration = Duration::from_secs(1);

fn layout() -> KvLayout {
    KvLayout { n_layers: 2, n_kv_heads: 1, head_dim: 8, block_size: 4, dtype: KvDtype::F16 }
}

/// Bytes of K and V of one block in one layer.
const PER_BLOCK: usize = 2 * 4 * 8 * 2;

fn peer() -> Peer {
    Peer {
        version_group: VersionGroup::new("g1").expect("label"),
        fingerprint: LayoutFingerprint::new(&layout(), &[1; 32], &[2; 32]),
    }
}

fn rx_with(max_reservations: usize) -> Receiver {
    let config = ReceiverConfig { max_reservations, ..ReceiverConfig::new(layout()) };
    Receiver::new(peer(), config).expect("config")
}

fn rx() -> Receiver {
    rx_with(16)
}

fn data(r: Reservation, layer: u32, first: u32, n: u32) -> LayerData {
    let payload = (0..n as usize * PER_BLOCK).map(|i| (i as u32 ^ layer ^ first) as u8).collect();
    LayerData::new(r.id.0, r.generation, layer, first, n, payload)
}

fn complete(r: Reservation) -> Complete {
    Complete { reservation: r.id.0, generation: r.generation, n_layers: 2 }
}

/// Writes every (layer, block) of a reservation of `n` blocks.
fn fill(rx: &mut Receiver, r: Reservation, n: u32, now: Instant) {
    for layer in 0..2 {
        rx.on_layer(&data(r, layer, 0, n), now).expect("layer accepted");
    }
}

#[test]
fn handshake_accepts_a_matching_peer() {
    let mut rx = rx();
    let p = peer();
    let hello =
        Hello { version_group: p.version_group, fingerprint: p.fingerprint, protocol_version: crate::PROTOCOL_VERSION };
    assert_eq!(rx.on_hello(&hello), Ok(HelloAck { protocol_version: crate::PROTOCOL_VERSION }));
    assert_eq!(rx.counters().hello_accepted, 1);
}

#[test]
fn handshake_refuses_each_mismatch_and_counts_it() {
    let mut rx = rx();
    let p = peer();
    let ok =
        Hello { version_group: p.version_group, fingerprint: p.fingerprint, protocol_version: crate::PROTOCOL_VERSION };
    let other_fp = LayoutFingerprint::new(&KvLayout { block_size: 8, ..layout() }, &[1; 32], &[2; 32]);
    let cases = [
        (Hello { fingerprint: other_fp, ..ok.clone() }, RejectReason::Fingerprint),
        (
            Hello { fingerprint: LayoutFingerprint::new(&layout(), &[3; 32], &[2; 32]), ..ok.clone() },
            RejectReason::Fingerprint,
        ),
        (Hello { version_group: VersionGroup::new("g2").expect("label"), ..ok.clone() }, RejectReason::VersionGroup),
        (
            Hello { version_group: VersionGroup::new("g2").expect("label"), fingerprint: other_fp, ..ok.clone() },
            RejectReason::VersionGroup,
        ),
        (Hello { protocol_version: crate::PROTOCOL_VERSION + 1, ..ok.clone() }, RejectReason::ProtocolVersion),
    ];
    for (hello, reason) in cases {
        assert_eq!(rx.on_hello(&hello), Err(HelloReject { reason }), "{hello:?}");
    }
    let c = rx.counters();
    assert_eq!((c.hello_rejected(RejectReason::Fingerprint), c.hello_rejected(RejectReason::VersionGroup)), (2, 2));
    assert_eq!((c.hello_rejected(RejectReason::ProtocolVersion), c.hello_accepted), (1, 0));
}

#[test]
fn layers_and_ranges_arrive_in_any_order_and_map_to_reserved_blocks() {
    let mut rx = rx();
    let t0 = Instant::now();
    let r = rx.reserve(vec![40, 7, 13, 22], 10 * SEC, t0).expect("reserve");
    assert_eq!(rx.state(r), Some(ReservationState::Receiving));
    let w = rx.on_layer(&data(r, 1, 2, 2), t0).expect("layer 1 first");
    assert_eq!(w, WriteInstruction { reservation: r, layer: 1, blocks: vec![13, 22] });
    assert_eq!(rx.on_layer(&data(r, 0, 1, 3), t0).expect("layer 0 tail").blocks, [7, 13, 22]);
    assert_eq!(rx.on_layer(&data(r, 1, 0, 2), t0).expect("layer 1 head").blocks, [40, 7]);
    assert_eq!(rx.on_layer(&data(r, 0, 0, 1), t0).expect("layer 0 head").blocks, [40]);
    assert_eq!(rx.on_complete(&complete(r), t0 + SEC), Ok(Ack { reservation: r.id.0, generation: r.generation }));
    assert_eq!(rx.take_ready(r), Ok(vec![40, 7, 13, 22]));
    let c = rx.counters();
    assert_eq!((c.layer_frames_accepted, c.payload_bytes_accepted), (4, 8 * PER_BLOCK as u64));
    assert_eq!((c.reservations_completed, c.reservations_taken, rx.held_blocks()), (1, 1, 0));
}

#[test]
fn split_payload_gives_k_then_v() {
    let r = Reservation { id: ReservationId(0), generation: 1 };
    let w = WriteInstruction { reservation: r, layer: 0, blocks: vec![1, 2] };
    let payload: Vec<u8> = (0..8).collect();
    assert_eq!(w.split_payload(&payload), (&payload[..4], &payload[4..]));
}

#[test]
fn duplicate_and_overlapping_frames_are_refused_without_effect() {
    let mut rx = rx();
    let t0 = Instant::now();
    let r = rx.reserve(vec![1, 2, 3], 10 * SEC, t0).expect("reserve");
    rx.on_layer(&data(r, 0, 0, 2), t0).expect("first");
    assert_eq!(rx.on_layer(&data(r, 0, 0, 2), t0), Err(FrameError::Duplicate { layer: 0, block: 0 }));
    assert_eq!(rx.on_layer(&data(r, 0, 1, 2), t0), Err(FrameError::Duplicate { layer: 0, block: 1 }));
    // The overlapping frame marked nothing: block 2 is still writable.
    rx.on_layer(&data(r, 0, 2, 1), t0).expect("block 2 still free");
    assert_eq!(rx.counters().refused("duplicate"), 2);
    assert_eq!(rx.state(r), Some(ReservationState::Receiving));
}

#[test]
fn wrong_generation_and_unknown_ids_are_refused() {
    let mut rx = rx_with(1);
    let t0 = Instant::now();
    let old = rx.reserve(vec![1, 2], 10 * SEC, t0).expect("reserve");
    assert_eq!(rx.abort(old), Ok(vec![1, 2]));
    // The only slot is reused with a fresh generation.
    let new = rx.reserve(vec![3, 4], 10 * SEC, t0).expect("reserve again");
    assert_eq!(new.id, old.id);
    assert!(new.generation > old.generation);
    let late = data(old, 0, 0, 1);
    let stale = FrameError::StaleGeneration { id: old.id.0, got: old.generation, current: new.generation };
    assert_eq!(rx.on_layer(&late, t0), Err(stale));
    let future = Reservation { generation: new.generation + 1, ..new };
    assert!(matches!(rx.on_layer(&data(future, 0, 0, 1), t0), Err(FrameError::StaleGeneration { .. })));
    let unknown = Reservation { id: ReservationId(5), generation: new.generation };
    assert_eq!(rx.on_layer(&data(unknown, 0, 0, 1), t0), Err(FrameError::UnknownReservation { id: 5 }));
    let huge = Reservation { id: ReservationId(u64::MAX), generation: 1 };
    assert_eq!(rx.on_complete(&complete(huge), t0), Err(FrameError::UnknownReservation { id: u64::MAX }));
    assert!(matches!(rx.take_ready(old), Err(ReservationError::StaleGeneration { .. })));
    assert!(matches!(rx.abort(old), Err(ReservationError::StaleGeneration { .. })));
    // The new reservation is untouched by all that.
    fill(&mut rx, new, 2, t0);
    assert!(rx.on_complete(&complete(new), t0).is_ok());
    assert_eq!(rx.take_ready(new), Ok(vec![3, 4]));
    assert_eq!(rx.counters().refused("stale_generation"), 2);
}

/// A failed write is recorded in the receiver, the one holder of block
/// state: before the take it fails the reservation (blocks back once, the
/// sender's next frame refused, the take refused); after the take it is
/// answered once to the taker; on an ended or unknown reservation it
/// changes nothing.
#[test]
fn a_failed_write_fails_a_live_reservation_and_is_told_once_after_the_take() {
    let mut rx = rx();
    let t0 = Instant::now();
    let live = rx.reserve(vec![1, 2], SEC, t0).expect("reserve");
    rx.on_layer(&data(live, 0, 0, 2), t0).expect("layer 0");
    rx.on_write_failed(live);
    assert_eq!(rx.state(live), Some(ReservationState::Failed));
    assert!(rx.on_layer(&data(live, 1, 0, 2), t0).is_err(), "the sender's next frame is refused");
    let failed = ReservationError::Ended { reservation: live, state: ReservationState::Failed };
    assert_eq!(rx.take_ready(live), Err(failed));
    let released = rx.poll_released(t0);
    assert_eq!(released, [Released { reservation: live, blocks: vec![1, 2], cause: ReleaseCause::Corrupt }]);
    assert!(!rx.take_write_failure(live), "a live failure is the reservation's end, not a record");

    let taken = rx.reserve(vec![3], SEC, t0).expect("reserve");
    fill(&mut rx, taken, 1, t0);
    rx.on_complete(&complete(taken), t0).expect("complete");
    assert_eq!(rx.take_ready(taken), Ok(vec![3]));
    rx.on_write_failed(taken);
    assert!(rx.take_write_failure(taken), "told to the taker");
    assert!(!rx.take_write_failure(taken), "told once");
    assert!(rx.poll_released(t0).is_empty(), "the taker owns the blocks");

    // A failure that comes after the taken slot was reused by a new
    // generation is still the taken reservation's, and not the new one's.
    let small = &mut rx_with(1);
    let first = small.reserve(vec![7], SEC, t0).expect("reserve");
    for layer in 0..2 {
        small.on_layer(&data(first, layer, 0, 1), t0).expect("layer");
    }
    small.on_complete(&complete(first), t0).expect("complete");
    small.take_ready(first).expect("take");
    let second = small.reserve(vec![8], SEC, t0).expect("the one slot, reused");
    assert_eq!(second.id, first.id);
    small.on_write_failed(first);
    assert_eq!(small.state(second), Some(ReservationState::Receiving), "the new generation is untouched");
    assert!(small.take_write_failure(first), "the failure reaches the taker across the reuse");
    assert!(!small.take_write_failure(second));

    let expired = rx.reserve(vec![4], SEC, t0).expect("reserve");
    rx.poll_released(t0 + SEC);
    rx.on_write_failed(expired);
    rx.on_write_failed(Reservation { id: ReservationId(99), generation: 1 });
    assert!(!rx.take_write_failure(expired));
    let c = rx.counters();
    assert_eq!((c.reservations_failed, c.reservations_expired, rx.held_blocks()), (1, 1, 0));
}

#[test]
fn a_late_frame_expires_the_reservation_and_blocks_come_back_once() {
    let mut rx = rx();
    let t0 = Instant::now();
    let r = rx.reserve(vec![5, 6], SEC, t0).expect("reserve");
    rx.on_layer(&data(r, 0, 0, 2), t0 + SEC / 2).expect("within lease");
    assert_eq!(rx.on_layer(&data(r, 1, 0, 2), t0 + SEC), Err(FrameError::Expired(r)), "deadline is exclusive");
    assert_eq!(rx.state(r), Some(ReservationState::Expired));
    assert_eq!(rx.held_blocks(), 2, "held until polled");
    let released = rx.poll_released(t0 + SEC);
    assert_eq!(released, [Released { reservation: r, blocks: vec![5, 6], cause: ReleaseCause::LeaseExpired }]);
    assert!(rx.poll_released(t0 + 100 * SEC).is_empty(), "returned exactly once");
    // Every later frame or call is refused.
    assert_eq!(rx.on_layer(&data(r, 1, 0, 2), t0 + 2 * SEC), Err(FrameError::Expired(r)));
    assert_eq!(rx.on_complete(&complete(r), t0 + 2 * SEC), Err(FrameError::Expired(r)));
    let abort = Abort { reservation: r.id.0, generation: r.generation, reason: AbortReason::Cancelled };
    assert_eq!(rx.on_abort(&abort, t0 + 2 * SEC), Err(FrameError::Expired(r)));
    let ended = ReservationError::Ended { reservation: r, state: ReservationState::Expired };
    assert_eq!(rx.take_ready(r), Err(ended.clone()));
    assert_eq!(rx.abort(r), Err(ended));
    assert!(rx.poll_released(t0 + 100 * SEC).is_empty());
    let c = rx.counters();
    assert_eq!((c.reservations_expired, c.refused("expired"), rx.held_blocks()), (1, 4, 0));
}

#[test]
fn a_renewed_lease_outlives_its_first_end_and_never_shrinks_or_revives() {
    let mut rx = rx_with(1);
    let t0 = Instant::now();
    let r = rx.reserve(vec![5, 6], SEC, t0).expect("reserve");
    assert_eq!(rx.lease_end(r), Some(t0 + SEC));
    // Renewed at 0.9 s: it now ends at 1.9 s, so 1.5 s is within the lease.
    assert_eq!(rx.renew(r, SEC, t0 + SEC * 9 / 10), Ok(t0 + SEC * 19 / 10));
    assert!(rx.poll_released(t0 + SEC * 3 / 2).is_empty(), "expired at its first end despite the renewal");
    rx.on_layer(&data(r, 0, 0, 2), t0 + SEC * 3 / 2).expect("a frame within the renewed lease");
    // A shorter renewal keeps the later end.
    assert_eq!(rx.renew(r, SEC / 10, t0 + SEC * 3 / 2), Ok(t0 + SEC * 19 / 10));
    // Leases the receiver would not grant are refused, and change nothing.
    let max = rx.config().max_lease;
    assert_eq!(rx.renew(r, Duration::ZERO, t0), Err(ReservationError::InvalidTtl { ttl: Duration::ZERO, max }));
    let over = max + SEC;
    assert_eq!(rx.renew(r, over, t0), Err(ReservationError::InvalidTtl { ttl: over, max }));
    assert_eq!(rx.lease_end(r), Some(t0 + SEC * 19 / 10));
    // Past its end, a renewal does not revive it: it expires then and there, once.
    let ended = ReservationError::Ended { reservation: r, state: ReservationState::Expired };
    assert_eq!(rx.renew(r, SEC, t0 + 2 * SEC), Err(ended.clone()));
    assert_eq!(rx.lease_end(r), None);
    let released = rx.poll_released(t0 + 2 * SEC);
    assert_eq!(released, [Released { reservation: r, blocks: vec![5, 6], cause: ReleaseCause::LeaseExpired }]);
    assert_eq!(rx.renew(r, SEC, t0 + 2 * SEC), Err(ended));
    assert_eq!(rx.counters().reservations_expired, 1);
    // One slot: the next reservation reuses it, and the old generation is not renewed.
    let next = rx.reserve(vec![7], SEC, t0 + 2 * SEC).expect("reserve");
    assert_eq!(next.id, r.id);
    assert!(matches!(rx.renew(r, SEC, t0 + 2 * SEC), Err(ReservationError::StaleGeneration { .. })));
    assert_eq!((rx.lease_end(r), rx.lease_end(next)), (None, Some(t0 + 3 * SEC)));
}

#[test]
fn poll_expires_idle_reservations_including_untaken_ready_ones() {
    let mut rx = rx();
    let t0 = Instant::now();
    let a = rx.reserve(vec![1], SEC, t0).expect("a");
    let b = rx.reserve(vec![2], 3 * SEC, t0).expect("b");
    let c = rx.reserve(vec![3], 2 * SEC, t0).expect("c");
    fill(&mut rx, c, 1, t0);
    rx.on_complete(&complete(c), t0).expect("c complete");
    assert_eq!(rx.next_deadline(), Some(t0 + SEC));
    assert!(rx.poll_released(t0 + SEC / 2).is_empty());
    let got = rx.poll_released(t0 + 2 * SEC);
    assert_eq!(got.iter().map(|r| (r.reservation, r.blocks.clone())).collect::<Vec<_>>(), [(a, vec![1]), (c, vec![3])]);
    assert_eq!(rx.take_ready(c), Err(ReservationError::Ended { reservation: c, state: ReservationState::Expired }));
    assert_eq!(rx.next_deadline(), Some(t0 + 3 * SEC));
    assert_eq!(rx.state(b), Some(ReservationState::Receiving));
    assert_eq!(rx.live_reservations(), 1);
}

#[test]
fn a_corrupt_frame_fails_the_reservation_for_good() {
    let mut rx = rx();
    let t0 = Instant::now();
    let r = rx.reserve(vec![8, 9], 10 * SEC, t0).expect("reserve");
    rx.on_layer(&data(r, 0, 0, 2), t0).expect("good frame");
    let mut bad = data(r, 1, 0, 2);
    bad.payload[17] ^= 0x40;
    let actual = bad.payload_checksum();
    assert_eq!(
        rx.on_layer(&bad, t0),
        Err(FrameError::ChecksumMismatch { reservation: r, expected: bad.checksum, actual })
    );
    assert_eq!(rx.state(r), Some(ReservationState::Failed));
    assert_eq!(rx.poll_released(t0), [Released { reservation: r, blocks: vec![8, 9], cause: ReleaseCause::Corrupt }]);
    // A correct retransmission cannot revive it, nor can Complete.
    assert_eq!(rx.on_layer(&data(r, 1, 0, 2), t0), Err(FrameError::Failed(r)));
    assert_eq!(rx.on_complete(&complete(r), t0), Err(FrameError::Failed(r)));
    assert!(matches!(rx.take_ready(r), Err(ReservationError::Ended { state: ReservationState::Failed, .. })));
    assert!(rx.poll_released(t0 + 100 * SEC).is_empty());
    assert_eq!(rx.counters().reservations_failed, 1);
    assert_eq!(FrameError::Failed(r).abort_reason(), AbortReason::Corrupt);
}

#[test]
fn complete_before_every_block_arrived_is_refused() {
    let mut rx = rx();
    let t0 = Instant::now();
    let r = rx.reserve(vec![1, 2], 10 * SEC, t0).expect("reserve");
    assert_eq!(rx.on_complete(&complete(r), t0), Err(FrameError::Incomplete { written: 0, expected: 4 }));
    rx.on_layer(&data(r, 0, 0, 2), t0).expect("layer 0");
    rx.on_layer(&data(r, 1, 1, 1), t0).expect("layer 1 block 1");
    assert_eq!(rx.on_complete(&complete(r), t0), Err(FrameError::Incomplete { written: 3, expected: 4 }));
    let wrong_layers = Complete { n_layers: 3, ..complete(r) };
    assert_eq!(rx.on_complete(&wrong_layers, t0), Err(FrameError::LayerCount { got: 3, expected: 2 }));
    assert_eq!(rx.state(r), Some(ReservationState::Receiving), "refusals do not end the reservation");
    rx.on_layer(&data(r, 1, 0, 1), t0).expect("last block");
    assert!(rx.on_complete(&complete(r), t0).is_ok());
    assert_eq!(rx.on_complete(&complete(r), t0), Err(FrameError::AlreadyComplete(r)));
}

#[test]
fn blocks_are_handed_out_only_after_complete() {
    let mut rx = rx();
    let t0 = Instant::now();
    let r = rx.reserve(vec![4, 5], 10 * SEC, t0).expect("reserve");
    let not_ready = ReservationError::NotReady { reservation: r, state: ReservationState::Receiving };
    assert_eq!(rx.take_ready(r), Err(not_ready.clone()));
    fill(&mut rx, r, 2, t0);
    assert_eq!(rx.take_ready(r), Err(not_ready), "all data but no Complete yet");
    rx.on_complete(&complete(r), t0).expect("complete");
    assert_eq!(rx.state(r), Some(ReservationState::Ready));
    assert_eq!(rx.on_layer(&data(r, 0, 0, 1), t0), Err(FrameError::AlreadyComplete(r)));
    assert_eq!(rx.take_ready(r), Ok(vec![4, 5]));
    assert_eq!(rx.take_ready(r), Err(ReservationError::Ended { reservation: r, state: ReservationState::Taken }));
    assert_eq!(rx.on_layer(&data(r, 0, 0, 1), t0), Err(FrameError::AlreadyComplete(r)));
    assert!(rx.poll_released(t0 + 100 * SEC).is_empty(), "taken blocks never come back again");
}

#[test]
fn frame_shape_is_checked_against_layout_and_reservation() {
    let mut rx = rx();
    let t0 = Instant::now();
    let r = rx.reserve(vec![1, 2], 10 * SEC, t0).expect("reserve");
    assert_eq!(rx.on_layer(&data(r, 2, 0, 1), t0), Err(FrameError::LayerOutOfRange { layer: 2, n_layers: 2 }));
    assert_eq!(rx.on_layer(&data(r, 0, 0, 0), t0), Err(FrameError::EmptyRange));
    let range = |first_block, n_blocks| FrameError::BlockRange { first_block, n_blocks, reserved: 2 };
    assert_eq!(rx.on_layer(&data(r, 0, 1, 2), t0), Err(range(1, 2)));
    assert_eq!(rx.on_layer(&data(r, 0, 2, 1), t0), Err(range(2, 1)));
    let mut overflow = data(r, 0, 0, 1);
    (overflow.first_block, overflow.n_blocks) = (u32::MAX, u32::MAX);
    assert_eq!(rx.on_layer(&overflow, t0), Err(range(u32::MAX, u32::MAX)));
    let mut short = data(r, 0, 0, 2);
    short.payload.pop();
    short.checksum = short.payload_checksum();
    assert_eq!(
        rx.on_layer(&short, t0),
        Err(FrameError::PayloadLength { got: 2 * PER_BLOCK - 1, expected: 2 * PER_BLOCK })
    );
    assert_eq!(rx.state(r), Some(ReservationState::Receiving));
    for reason in ["layer_out_of_range", "empty_range", "payload_length"] {
        assert_eq!(rx.counters().refused(reason), 1, "{reason}");
    }
    assert_eq!(rx.counters().refused("block_range"), 3);
}

#[test]
fn reserve_refusals_hand_the_blocks_back() {
    let mut rx = Receiver::new(
        peer(),
        ReceiverConfig { max_reservations: 1, max_blocks_per_reservation: 3, max_lease: 60 * SEC, layout: layout() },
    )
    .expect("config");
    let t0 = Instant::now();
    let refused = |r: Result<Reservation, ReserveError>| r.map_err(|e| (e.refusal, e.blocks));
    assert_eq!(refused(rx.reserve(vec![], SEC, t0)), Err((ReserveRefusal::Empty, vec![])));
    assert_eq!(
        refused(rx.reserve(vec![1, 2, 3, 4], SEC, t0)),
        Err((ReserveRefusal::TooManyBlocks { n: 4, max: 3 }, vec![1, 2, 3, 4]))
    );
    assert_eq!(
        refused(rx.reserve(vec![1, 2, 1], SEC, t0)),
        Err((ReserveRefusal::DuplicateBlock { block: 1 }, vec![1, 2, 1]))
    );
    for ttl in [Duration::ZERO, 61 * SEC, Duration::MAX] {
        assert_eq!(
            refused(rx.reserve(vec![1], ttl, t0)),
            Err((ReserveRefusal::InvalidTtl { ttl, max: 60 * SEC }, vec![1]))
        );
    }
    let r = rx.reserve(vec![1, 2], SEC, t0).expect("reserve");
    assert_eq!(refused(rx.reserve(vec![3, 2], SEC, t0)), Err((ReserveRefusal::AlreadyHeld { block: 2 }, vec![3, 2])));
    let full = rx.reserve(vec![3], SEC, t0).map_err(|e| e.refusal);
    assert_eq!(full, Err(ReserveRefusal::Full { max: 1 }));
    assert_eq!(ReserveRefusal::Full { max: 1 }.kind(), crate::ErrorKind::Overloaded);
    // Blocks of an expired reservation stay held until polled, then are free to reserve.
    assert_eq!(rx.on_layer(&data(r, 0, 0, 1), t0 + SEC), Err(FrameError::Expired(r)));
    let held = rx.reserve(vec![2], SEC, t0 + SEC).map_err(|e| e.refusal);
    assert_eq!(held, Err(ReserveRefusal::AlreadyHeld { block: 2 }));
    assert_eq!(rx.poll_released(t0 + SEC).len(), 1);
    assert!(rx.reserve(vec![2], SEC, t0 + SEC).is_ok());
}

#[test]
fn config_is_validated_naming_the_field() {
    let bad = [
        (ReceiverConfig { max_reservations: 0, ..ReceiverConfig::new(layout()) }, "max_reservations"),
        (
            ReceiverConfig { max_blocks_per_reservation: 0, ..ReceiverConfig::new(layout()) },
            "max_blocks_per_reservation",
        ),
        (ReceiverConfig { max_lease: Duration::ZERO, ..ReceiverConfig::new(layout()) }, "max_lease"),
        (ReceiverConfig::new(KvLayout { n_layers: 0, ..layout() }), "layout"),
    ];
    for (config, field) in bad {
        assert_eq!(Receiver::new(peer(), config).map(|_| ()).map_err(|e| e.field), Err(field));
    }
}

#[test]
fn a_peer_abort_releases_through_poll_and_refuses_later_frames() {
    let mut rx = rx();
    let t0 = Instant::now();
    let r = rx.reserve(vec![1, 2], 10 * SEC, t0).expect("reserve");
    rx.on_layer(&data(r, 0, 0, 1), t0).expect("frame");
    let abort = Abort { reservation: r.id.0, generation: r.generation, reason: AbortReason::PrefillFailed };
    assert_eq!(rx.on_abort(&abort, t0), Ok(()));
    assert_eq!(rx.on_abort(&abort, t0), Err(FrameError::Aborted(r)));
    assert_eq!(rx.on_layer(&data(r, 0, 1, 1), t0), Err(FrameError::Aborted(r)));
    assert_eq!(
        rx.poll_released(t0),
        [Released { reservation: r, blocks: vec![1, 2], cause: ReleaseCause::PeerAborted(AbortReason::PrefillFailed) }]
    );
    assert_eq!(rx.counters().reservations_aborted, 1);
}

#[test]
fn a_local_abort_returns_blocks_directly_once() {
    let mut rx = rx();
    let t0 = Instant::now();
    let r = rx.reserve(vec![1, 2], 10 * SEC, t0).expect("reserve");
    fill(&mut rx, r, 2, t0);
    rx.on_complete(&complete(r), t0).expect("complete");
    // Even a ready reservation can be abandoned (request cancelled meanwhile).
    assert_eq!(rx.abort(r), Ok(vec![1, 2]));
    assert_eq!(rx.abort(r), Err(ReservationError::Ended { reservation: r, state: ReservationState::Aborted }));
    assert!(rx.poll_released(t0 + 100 * SEC).is_empty());
    assert_eq!(rx.held_blocks(), 0);
}

#[test]
fn slots_are_reused_oldest_ended_first_so_recent_ends_stay_recognised() {
    let mut rx = rx_with(3);
    let t0 = Instant::now();
    let rs: Vec<Reservation> = (0..3).map(|i| rx.reserve(vec![i as BlockId], 10 * SEC, t0).expect("reserve")).collect();
    // End slot 2 first, then slot 0.
    rx.abort(rs[2]).expect("abort");
    rx.abort(rs[0]).expect("abort");
    let next = rx.reserve(vec![10], 10 * SEC, t0).expect("reuse");
    assert_eq!(next.id, rs[2].id, "the slot that ended first is reused first");
    assert!(next.generation > rs[2].generation);
    // Slot 0 still remembers why it ended.
    assert_eq!(rx.on_layer(&data(rs[0], 0, 0, 1), t0), Err(FrameError::Aborted(rs[0])));
    let gens: std::collections::HashSet<u32> = rs.iter().chain([&next]).map(|r| r.generation).collect();
    assert_eq!(gens.len(), 4, "every reservation gets a fresh generation");
}

#[test]
fn error_labels_and_kinds() {
    let r = Reservation { id: ReservationId(0), generation: 1 };
    assert_eq!(FrameError::Expired(r).reason(), "expired");
    assert_eq!(FrameError::Expired(r).kind(), crate::ErrorKind::Deadline);
    assert_eq!(FrameError::Expired(r).abort_reason(), AbortReason::LeaseExpired);
    assert_eq!(FrameError::EmptyRange.abort_reason(), AbortReason::ProtocolViolation);
    assert_eq!(FrameError::LayerCount { got: 1, expected: 2 }.reason(), "layer_count");
    let mut labels = FrameError::REASONS.to_vec();
    labels.sort_unstable();
    labels.dedup();
    assert_eq!(labels.len(), FrameError::REASONS.len());
}

/// Two receivers with the same history, to compare the two entry points.
fn twins(t0: Instant) -> (Receiver, Receiver, Reservation) {
    let (mut a, mut b) = (rx(), rx());
    let r = a.reserve(vec![8, 9, 10], 10 * SEC, t0).expect("reserve");
    assert_eq!(b.reserve(vec![8, 9, 10], 10 * SEC, t0), Ok(r));
    (a, b, r)
}

#[test]
fn checked_entry_accepts_what_on_layer_accepts() {
    let t0 = Instant::now();
    let (mut a, mut b, r) = twins(t0);
    for (layer, first, n) in [(1, 1, 2), (0, 0, 3), (1, 0, 1)] {
        let d = data(r, layer, first, n);
        let w = a.on_layer(&d, t0).expect("accepted");
        assert_eq!(b.on_layer_checked(&d.header(), crc32c::crc32c(&d.payload), t0), Ok(w));
    }
    assert_eq!(b.on_complete(&complete(r), t0), a.on_complete(&complete(r), t0));
    assert_eq!(b.take_ready(r), Ok(vec![8, 9, 10]));
    assert_eq!(a.take_ready(r), Ok(vec![8, 9, 10]));
    assert_eq!(a.counters(), b.counters());
    assert_eq!(b.counters().payload_bytes_accepted, 6 * PER_BLOCK as u64);
}

#[test]
fn checked_entry_with_another_checksum_fails_like_a_corrupt_frame() {
    let t0 = Instant::now();
    let (mut a, mut b, r) = twins(t0);
    let good = data(r, 0, 0, 3);
    let mut bad = good.clone();
    bad.payload[5] ^= 1;
    let actual = bad.payload_checksum();
    let refused = Err(FrameError::ChecksumMismatch { reservation: r, expected: good.checksum, actual });
    assert_eq!(a.on_layer(&bad, t0), refused);
    // The transport's copy differs from what the sender checksummed.
    assert_eq!(b.on_layer_checked(&good.header(), actual, t0), refused);
    for rx in [&mut a, &mut b] {
        assert_eq!(rx.state(r), Some(ReservationState::Failed));
        assert_eq!(
            rx.poll_released(t0),
            [Released { reservation: r, blocks: vec![8, 9, 10], cause: ReleaseCause::Corrupt }]
        );
        assert_eq!(rx.on_layer(&data(r, 1, 0, 3), t0), Err(FrameError::Failed(r)));
    }
    assert_eq!(b.on_layer_checked(&good.header(), good.checksum, t0), Err(FrameError::Failed(r)));
    assert_eq!(a.on_layer(&good, t0), Err(FrameError::Failed(r)));
    assert_eq!(a.counters(), b.counters());
    assert_eq!(b.counters().refused("checksum"), 1);
    assert_eq!(b.counters().reservations_failed, 1);
}

#[test]
fn checked_entry_checks_everything_else_before_the_checksum() {
    let t0 = Instant::now();
    let (mut a, mut b, r) = twins(t0);
    let d = data(r, 0, 0, 2);
    a.on_layer(&d, t0).expect("accepted");
    b.on_layer_checked(&d.header(), d.checksum, t0).expect("accepted");
    // A duplicate with a wrong checksum is a duplicate: the reservation lives on.
    let dup = Err(FrameError::Duplicate { layer: 0, block: 1 });
    let mut wrong = data(r, 0, 1, 1);
    wrong.checksum ^= 1;
    assert_eq!(a.on_layer(&wrong, t0), dup);
    assert_eq!(b.on_layer_checked(&wrong.header(), wrong.checksum ^ 1, t0), dup);
    // The length is the payload's as the transport holds it, not a declared one.
    let mut short = data(r, 1, 0, 1).header();
    short.payload_len -= 1;
    let len = Err(FrameError::PayloadLength { got: PER_BLOCK - 1, expected: PER_BLOCK });
    assert_eq!(b.on_layer_checked(&short, 0, t0), len);
    let mut short = data(r, 1, 0, 1);
    short.payload.pop();
    assert_eq!(a.on_layer(&short, t0), len);
    // So is a late frame, whatever its checksum.
    let late = data(r, 1, 0, 1);
    assert_eq!(a.on_layer(&late, t0 + 11 * SEC), Err(FrameError::Expired(r)));
    assert_eq!(b.on_layer_checked(&late.header(), 7, t0 + 11 * SEC), Err(FrameError::Expired(r)));
    for rx in [&mut a, &mut b] {
        assert_eq!(rx.state(r), Some(ReservationState::Expired));
    }
    assert_eq!(a.counters(), b.counters());
}

/// The quarantine behind the UCX transport's direct path: blocks a peer
/// writes in place are not handed back, however their reservation ends,
/// until that peer is fenced; a completed one needs no fence.
#[test]
fn exposed_blocks_come_back_only_after_their_writer_is_fenced() {
    let mut rx = rx();
    let t0 = Instant::now();
    // Ended by its lease while exposed: held in quarantine, not released.
    let late = rx.reserve(vec![5, 6], SEC, t0).expect("reserve");
    assert_eq!(rx.expose(late), Some(vec![5, 6]));
    assert!(rx.poll_released(t0 + SEC).is_empty(), "an exposed reservation's blocks wait for the fence");
    assert_eq!(rx.state(late), Some(ReservationState::Expired));
    assert_eq!((rx.quarantined_blocks(), rx.held_blocks()), (2, 2));
    assert_eq!(rx.expose(late), None, "an ended reservation cannot be exposed again");
    // Ended by this side: `abort` returns nothing to free now.
    let cancelled = rx.reserve(vec![7], 10 * SEC, t0).expect("reserve");
    rx.expose(cancelled).expect("receiving");
    assert_eq!(rx.abort(cancelled), Ok(vec![]));
    assert_eq!(rx.quarantined_blocks(), 3);
    // Ended by corruption.
    let corrupt = rx.reserve(vec![8], 10 * SEC, t0).expect("reserve");
    rx.expose(corrupt).expect("receiving");
    let mut bad = data(corrupt, 0, 0, 1);
    bad.checksum ^= 1;
    assert!(rx.on_layer(&bad, t0).is_err());
    assert!(rx.poll_released(t0 + 2 * SEC).is_empty());
    assert_eq!(rx.quarantined_blocks(), 4);
    // Each fence releases exactly its reservation's blocks, once, with the original cause.
    assert!(rx.fence(late));
    assert!(!rx.fence(late), "fenced once");
    assert_eq!(
        rx.poll_released(t0 + 2 * SEC),
        [Released { reservation: late, blocks: vec![5, 6], cause: ReleaseCause::LeaseExpired }]
    );
    assert!(rx.fence(cancelled) && rx.fence(corrupt));
    let rest = rx.poll_released(t0 + 2 * SEC);
    assert_eq!(
        rest.iter().map(|r| (r.blocks.clone(), r.cause)).collect::<Vec<_>>(),
        [(vec![7], ReleaseCause::Aborted), (vec![8], ReleaseCause::Corrupt)]
    );
    assert_eq!((rx.quarantined_blocks(), rx.held_blocks()), (0, 0));
    // Completed while exposed: the writer announced every layer, no fence needed.
    let done = rx.reserve(vec![9, 10], 10 * SEC, t0).expect("reserve");
    rx.expose(done).expect("receiving");
    fill(&mut rx, done, 2, t0);
    rx.on_complete(&complete(done), t0).expect("complete");
    assert_eq!(rx.take_ready(done), Ok(vec![9, 10]));
    // Fenced while live (its writer left): a later end releases at once.
    let left = rx.reserve(vec![11], SEC, t0).expect("reserve");
    rx.expose(left).expect("receiving");
    assert!(!rx.fence(left), "nothing was quarantined");
    assert_eq!(rx.poll_released(t0 + SEC).len(), 1);
    assert_eq!(rx.held_blocks(), 0);
}
