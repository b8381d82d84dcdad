//! Property-style test: across random sequences of reservations, frames,
//! completions, aborts, corruption and expiry, every block the receiver was
//! given comes back exactly once, to a real engine pool that refuses double
//! frees, and nothing is left held at the end.

use std::collections::{HashMap, HashSet};
use std::time::Duration;
use tokio::time::Instant;

use engine::kv::KvPool;

use types::kv::{BlockId, KvDtype, KvLayout};

use super::*;
use crate::frame::{Abort, AbortReason, Complete, LayerData};
use crate::testutil::Rng;

const N_LAYERS: u32 = 2;

fn layout() -> KvLayout {
    KvLayout { n_layers: N_LAYERS as usize, n_kv_heads: 1, head_dim: 4, block_size: 2, dtype: KvDtype::F16 }
}

const PER_BLOCK: usize = 2 * 2 * 4 * 2;

struct World {
    rng: Rng,
    pool: KvPool,
    rx: Receiver,
    now: Instant,
    /// Every reservation ever made, with its block count.
    known: Vec<(Reservation, u32)>,
    /// Blocks handed to the receiver and not yet handed back.
    given: HashSet<BlockId>,
    written: HashMap<Reservation, HashSet<(u32, u32)>>,
    acked: HashSet<Reservation>,
}

impl World {
    /// Takes blocks back from the receiver: each must be one it held, and the
    /// pool must accept the release (it refuses a double free).
    fn give_back(&mut self, blocks: &[BlockId]) {
        for b in blocks {
            assert!(self.given.remove(b), "block {b} handed back twice or never given");
        }
        self.pool.release(blocks).expect("pool accepts every returned block");
    }

    /// Mostly a live reservation (so transfers can finish), sometimes any
    /// reservation ever made (late frames, stale generations).
    fn pick(&mut self) -> Option<(Reservation, u32)> {
        let live: Vec<_> = self
            .known
            .iter()
            .copied()
            .filter(|(r, _)| matches!(self.rx.state(*r), Some(ReservationState::Receiving | ReservationState::Ready)))
            .collect();
        let from = if !live.is_empty() && self.rng.below(5) != 0 { &live } else { &self.known };
        (!from.is_empty()).then(|| from[self.rng.below(from.len())])
    }

    fn reserve(&mut self) {
        let n = match self.rng.below(10) {
            0 => 0,
            1 => 9, // over max_blocks_per_reservation
            _ => 1 + self.rng.below(4),
        };
        let Ok(mut blocks) = self.pool.allocate(n) else { return };
        let fresh = blocks.clone();
        let steal = !self.given.is_empty() && self.rng.below(8) == 0;
        if steal {
            let held = *self.given.iter().next().expect("non-empty");
            blocks.push(held);
        }
        let ttl = Duration::from_millis(self.rng.below(4000) as u64);
        match self.rx.reserve(blocks, ttl, self.now) {
            Ok(r) => {
                assert!(!steal, "a block already held must be refused");
                self.given.extend(fresh.iter().copied());
                self.known.push((r, n as u32));
            }
            Err(e) => {
                if steal {
                    assert!(matches!(
                        e.refusal,
                        ReserveRefusal::AlreadyHeld { .. }
                            | ReserveRefusal::Empty
                            | ReserveRefusal::TooManyBlocks { .. }
                            | ReserveRefusal::InvalidTtl { .. }
                    ));
                }
                self.pool.release(&fresh).expect("refused blocks are still ours");
            }
        }
    }

    fn layer(&mut self) {
        let Some((r, n)) = self.pick() else { return };
        let written = self.written.entry(r).or_default();
        let unwritten: Vec<(u32, u32)> =
            (0..N_LAYERS).flat_map(|l| (0..n).map(move |b| (l, b))).filter(|c| !written.contains(c)).collect();
        let (layer, first, count) = if !unwritten.is_empty() && self.rng.below(3) != 0 {
            let (l, b) = unwritten[self.rng.below(unwritten.len())];
            let mut count = 1;
            while b + count < n && !written.contains(&(l, b + count)) && self.rng.below(2) == 0 {
                count += 1;
            }
            (l, b, count)
        } else {
            let l = self.rng.below(N_LAYERS as usize + 1) as u32;
            let first = self.rng.below(n as usize + 1) as u32;
            (l, first, self.rng.below(3) as u32)
        };
        let mut f =
            LayerData::new(r.id.0, r.generation, layer, first, count, self.rng.bytes(count as usize * PER_BLOCK));
        if self.rng.below(25) == 0 {
            f.checksum ^= 1;
        }
        if let Ok(w) = self.rx.on_layer(&f, self.now) {
            assert_eq!(w.blocks.len(), count as usize);
            let written = self.written.entry(r).or_default();
            for b in first..first + count {
                assert!(written.insert((layer, b)), "({layer}, {b}) accepted twice");
            }
        }
    }

    fn complete(&mut self) {
        let Some((r, n)) = self.pick() else { return };
        let c = Complete { reservation: r.id.0, generation: r.generation, n_layers: N_LAYERS };
        if self.rx.on_complete(&c, self.now).is_ok() {
            let full = self.written.get(&r).map_or(0, HashSet::len);
            assert_eq!(full, (N_LAYERS * n) as usize, "acked before every block arrived");
            self.acked.insert(r);
        }
    }

    fn step(&mut self) {
        match self.rng.below(16) {
            0..=2 => self.reserve(),
            3..=8 => self.layer(),
            9 => self.complete(),
            10 => {
                if let Some((r, _)) = self.pick() {
                    if let Ok(blocks) = self.rx.take_ready(r) {
                        assert!(self.acked.contains(&r), "taken without an acknowledged Complete");
                        self.give_back(&blocks);
                    }
                }
            }
            11 => {
                if let Some((r, _)) = self.pick() {
                    if let Ok(blocks) = self.rx.abort(r) {
                        self.give_back(&blocks);
                    }
                }
            }
            12 => {
                if let Some((r, _)) = self.pick() {
                    let a = Abort { reservation: r.id.0, generation: r.generation, reason: AbortReason::PrefillFailed };
                    let _ = self.rx.on_abort(&a, self.now);
                }
            }
            13 | 14 => self.now += Duration::from_millis(self.rng.below(400) as u64),
            _ => self.poll(),
        }
    }

    fn poll(&mut self) {
        for r in self.rx.poll_released(self.now) {
            self.give_back(&r.blocks);
        }
    }

    fn check(&self) {
        assert_eq!(self.rx.held_blocks(), self.given.len());
        assert_eq!(self.pool.stats().used, self.given.len(), "pool and receiver disagree on what is out");
    }
}

#[test]
fn every_block_comes_back_exactly_once() {
    let mut totals = ReceiverCounters::default();
    for seed in 0..16u64 {
        let config = ReceiverConfig {
            max_reservations: 6,
            max_blocks_per_reservation: 8,
            max_lease: Duration::from_secs(5),
            ..ReceiverConfig::new(layout())
        };
        let local = Peer {
            version_group: VersionGroup::new("g").expect("label"),
            fingerprint: LayoutFingerprint::new(&layout(), &[0; 32], &[0; 32]),
        };
        let mut w = World {
            rng: Rng::new(seed),
            pool: KvPool::new(layout(), 48).expect("pool"),
            rx: Receiver::new(local, config).expect("receiver"),
            now: Instant::now(),
            known: Vec::new(),
            given: HashSet::new(),
            written: HashMap::new(),
            acked: HashSet::new(),
        };
        for _ in 0..3000 {
            w.step();
            w.check();
        }
        // Every lease runs out eventually; then nothing may remain anywhere.
        w.now += Duration::from_secs(3600);
        w.poll();
        w.check();
        assert!(w.given.is_empty(), "seed {seed}: leaked {:?}", w.given);
        assert_eq!(w.rx.live_reservations(), 0);
        assert_eq!(w.pool.stats().used, 0);
        let c = w.rx.counters();
        totals.reservations_taken += c.reservations_taken;
        totals.reservations_aborted += c.reservations_aborted;
        totals.reservations_expired += c.reservations_expired;
        totals.reservations_failed += c.reservations_failed;
        for (t, x) in totals.frames_refused.iter_mut().zip(c.frames_refused) {
            *t += x;
        }
    }
    // The walk must reach every ending, or it proves less than it claims.
    assert!(totals.reservations_taken > 50, "{totals:?}");
    assert!(totals.reservations_aborted > 50, "{totals:?}");
    assert!(totals.reservations_expired > 50, "{totals:?}");
    assert!(totals.reservations_failed > 20, "{totals:?}");
    for reason in ["duplicate", "stale_generation", "expired", "checksum", "incomplete", "block_range"] {
        assert!(totals.refused(reason) > 0, "never refused for {reason}: {totals:?}");
    }
}

/// The two layer entry points follow one set of rules: two receivers fed
/// the same random history, one checking frames with `on_layer`, the other
/// with `on_layer_checked` and the checksum computed here over the payload,
/// answer every call alike and end with the same counters.
#[test]
fn checked_and_plain_layer_entries_agree_on_every_history() {
    let config = ReceiverConfig {
        max_reservations: 4,
        max_blocks_per_reservation: 6,
        max_lease: Duration::from_secs(5),
        ..ReceiverConfig::new(layout())
    };
    let local = Peer {
        version_group: VersionGroup::new("g").expect("label"),
        fingerprint: LayoutFingerprint::new(&layout(), &[0; 32], &[0; 32]),
    };
    for seed in 0..8u64 {
        let mut rng = Rng::new(seed);
        let mut plain = Receiver::new(local.clone(), config.clone()).expect("receiver");
        let mut checked = Receiver::new(local.clone(), config.clone()).expect("receiver");
        let mut now = Instant::now();
        let (mut known, mut next_block): (Vec<(Reservation, u32)>, BlockId) = (Vec::new(), 0);
        for _ in 0..2000 {
            // Mostly a live reservation, sometimes any (late frames, stale generations).
            let pick = |rng: &mut Rng| {
                let live: Vec<_> = known
                    .iter()
                    .copied()
                    .filter(|(r, _)| plain.state(*r) == Some(ReservationState::Receiving))
                    .collect();
                let from = if !live.is_empty() && rng.below(5) != 0 { &live } else { &known };
                (!from.is_empty()).then(|| from[rng.below(from.len())])
            };
            match rng.below(10) {
                0 => {
                    let n = 1 + rng.below(6) as u32;
                    let blocks: Vec<BlockId> = (next_block..next_block + n).collect();
                    next_block += n;
                    let ttl = Duration::from_millis(1 + rng.below(3000) as u64);
                    let r = plain.reserve(blocks.clone(), ttl, now);
                    assert_eq!(checked.reserve(blocks, ttl, now), r.clone());
                    if let Ok(r) = r {
                        known.push((r, n));
                    }
                }
                1..=5 => {
                    let Some((r, n)) = pick(&mut rng) else { continue };
                    let out_of_range = usize::from(rng.below(8) == 0);
                    let layer = rng.below(N_LAYERS as usize + out_of_range) as u32;
                    let first = rng.below(n as usize) as u32;
                    let count = 1 + rng.below((n - first) as usize + 1) as u32;
                    let mut f = LayerData::new(
                        r.id.0,
                        r.generation,
                        layer,
                        first,
                        count,
                        rng.bytes(count as usize * PER_BLOCK),
                    );
                    match rng.below(12) {
                        0 => f.payload[0] ^= 1,
                        1 => f.checksum ^= 1,
                        2 => drop(f.payload.pop()),
                        _ => {}
                    }
                    let want = plain.on_layer(&f, now);
                    assert_eq!(checked.on_layer_checked(&f.header(), crc32c::crc32c(&f.payload), now), want);
                }
                6 => {
                    let Some((r, _)) = pick(&mut rng) else { continue };
                    let c = Complete { reservation: r.id.0, generation: r.generation, n_layers: N_LAYERS };
                    assert_eq!(checked.on_complete(&c, now), plain.on_complete(&c, now));
                    assert_eq!(checked.take_ready(r), plain.take_ready(r));
                }
                7 => {
                    let Some((r, _)) = pick(&mut rng) else { continue };
                    let a = Abort { reservation: r.id.0, generation: r.generation, reason: AbortReason::PrefillFailed };
                    assert_eq!(checked.on_abort(&a, now), plain.on_abort(&a, now));
                }
                8 => now += Duration::from_millis(rng.below(400) as u64),
                _ => assert_eq!(checked.poll_released(now), plain.poll_released(now)),
            }
        }
        assert_eq!(checked.counters(), plain.counters(), "seed {seed}");
        assert!(
            plain.counters().refused("checksum") > 0 && plain.counters().layer_frames_accepted > 100,
            "seed {seed}: {:?}",
            plain.counters()
        );
    }
}
