//! The receiver side of a KV transfer: a state machine with time passed in
//! and no I/O.
//!
//! The decode worker keeps one behind a `std::sync::Mutex`, shared by its
//! transfer connections (each frame is checked here and its write posted
//! while the lock is held), its request tasks (reserve, take, abort) and its
//! reaper (`poll_released` on the lease timer). Every hold is short and
//! synchronous, never across an await; why a lock and not an owning task,
//! with the measurements, is in `transport/lock.rs`.
//!
//! The decode worker allocates blocks from its pool and registers them with
//! [`Receiver::reserve`]; from then on the receiver holds them. Frames from
//! the sender are checked ([`Receiver::on_layer`] returns where to write, the
//! caller does the write), and the blocks come back to the caller exactly
//! once, by exactly one of:
//!
//! | how it ends | state | blocks come back from |
//! |---|---|---|
//! | completed and handed to the engine | `Taken` | [`Receiver::take_ready`] |
//! | aborted locally (request cancelled) | `Aborted` | [`Receiver::abort`] |
//! | aborted by the sender | `Aborted` | [`Receiver::poll_released`] |
//! | lease ran out (before hand-off) | `Expired` | [`Receiver::poll_released`] |
//! | a frame failed its checksum | `Failed` | [`Receiver::poll_released`] |
//!
//! Endings the caller asks for return the blocks directly; endings that
//! happen to it (a peer's frame, the clock) queue them for
//! [`Receiver::poll_released`], which the caller polls when
//! [`Receiver::next_deadline`] passes and after ending a reservation (the
//! decode worker's reaper and its request tasks) — the quinn-proto `poll_*`
//! shape, so one place frees blocks and tells the request why.
//!
//! The lease covers the whole time the receiver holds the blocks, including
//! `Ready` before [`Receiver::take_ready`]: whatever the peer or the engine
//! does, no block outlives its lease.
//!
//! Time is a `tokio::time::Instant` passed into every call that needs it; the
//! receiver never reads a clock. An async caller passes
//! `tokio::time::Instant::now()`, which follows tokio's paused
//! test clock.
//!
//! Reservation ids are slots, reused oldest-ended first so a finished
//! reservation stays recognisable (and its late frames get a precise error)
//! for as long as possible while memory stays bounded by
//! [`ReceiverConfig::max_reservations`]. Generations come from one counter,
//! so every reservation — new slot or reused — has a fresh one.

mod coverage;
mod direct;
mod error;
mod frames;

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::time::Duration;
use tokio::time::Instant;

use types::kv::{BlockId, KvLayout};

use crate::fingerprint::{LayoutFingerprint, VersionGroup};
use crate::frame::{
    Abort, AbortReason, Ack, Complete, Hello, HelloAck, HelloReject, LayerData, LayerDataHeader, RejectReason,
};
use coverage::Coverage;
pub use error::{ConfigError, FrameError, ReservationError, ReserveError, ReserveRefusal};

/// Index of a reservation slot on one receiver.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReservationId(pub u64);

/// A reservation as the sender names it: slot and generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Reservation {
    pub id: ReservationId,
    pub generation: u32,
}

impl fmt::Display for Reservation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/g{}", self.id.0, self.generation)
    }
}

/// Where a reservation is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReservationState {
    /// Accepting layer frames.
    Receiving,
    /// Every (layer, block) arrived and `Complete` was acknowledged; waiting
    /// for [`Receiver::take_ready`].
    Ready,
    /// Handed to the engine.
    Taken,
    /// Aborted by either side.
    Aborted,
    /// The lease ran out first.
    Expired,
    /// A frame failed its checksum.
    Failed,
}

/// This worker's identity in the handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    pub version_group: VersionGroup,
    pub fingerprint: LayoutFingerprint,
}

/// Receiver limits. Everything is bounded: slots, blocks per reservation, lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReceiverConfig {
    /// The local pool's layout (frames are checked against it).
    pub layout: KvLayout,
    /// Reservation slots, live and remembered. Live reservations never
    /// exceed this; ended ones are remembered until their slot is reused.
    pub max_reservations: usize,
    /// Most blocks one reservation may hold.
    pub max_blocks_per_reservation: usize,
    /// Longest lease [`Receiver::reserve`] accepts.
    pub max_lease: Duration,
}

impl ReceiverConfig {
    /// Defaults: 1024 slots, 65,536 blocks per reservation, 10-minute lease cap.
    pub fn new(layout: KvLayout) -> Self {
        Self {
            layout,
            max_reservations: 1024,
            max_blocks_per_reservation: 1 << 16,
            max_lease: Duration::from_secs(600),
        }
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let l = &self.layout;
        if l.n_layers == 0 || l.block_elems() == 0 || l.n_layers > u32::MAX as usize {
            return Err(ConfigError { field: "layout", why: format!("unusable layout {l:?}") });
        }
        if self.max_reservations == 0 || self.max_reservations > u32::MAX as usize {
            return Err(ConfigError { field: "max_reservations", why: "must be 1..=2^32-1".into() });
        }
        if self.max_blocks_per_reservation == 0 || self.max_blocks_per_reservation > u32::MAX as usize {
            return Err(ConfigError { field: "max_blocks_per_reservation", why: "must be 1..=2^32-1".into() });
        }
        if self.max_lease.is_zero() {
            return Err(ConfigError { field: "max_lease", why: "must be positive".into() });
        }
        Ok(())
    }
}

/// Where to write an accepted [`LayerData`] payload: the caller copies the
/// payload's K half and V half of `layer` into these pool blocks, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteInstruction {
    /// The reservation the frame belongs to (a deferring sink reports a
    /// failed write against it).
    pub reservation: Reservation,
    pub layer: usize,
    /// Pool block ids for the frame's `first_block..first_block + n_blocks`.
    pub blocks: Vec<BlockId>,
}

impl WriteInstruction {
    /// Splits an accepted frame's payload into its K and V halves.
    pub fn split_payload<'a>(&self, payload: &'a [u8]) -> (&'a [u8], &'a [u8]) {
        payload.split_at(payload.len() / 2)
    }
}

/// Why blocks came back through [`Receiver::poll_released`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReleaseCause {
    /// The lease passed before the engine took the blocks.
    LeaseExpired,
    /// A frame failed its checksum, or its write into the pool failed
    /// ([`Receiver::on_write_failed`]).
    Corrupt,
    /// The sender aborted the transfer.
    PeerAborted(AbortReason),
    /// This side ended it ([`Receiver::abort`]) while a peer could still
    /// write its blocks: they come back once that peer is fenced.
    Aborted,
}

/// A reservation that ended without reaching the engine, and its blocks,
/// which the caller now owns again (to free, or to reserve anew for a retry).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Released {
    pub reservation: Reservation,
    pub blocks: Vec<BlockId>,
    pub cause: ReleaseCause,
}

/// What the receiver has done, for metrics. A getter, never reset.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReceiverCounters {
    pub hello_accepted: u64,
    pub hello_rejected_protocol_version: u64,
    pub hello_rejected_version_group: u64,
    pub hello_rejected_fingerprint: u64,
    pub reservations_created: u64,
    /// `Complete` acknowledged.
    pub reservations_completed: u64,
    pub reservations_taken: u64,
    pub reservations_aborted: u64,
    pub reservations_expired: u64,
    pub reservations_failed: u64,
    pub layer_frames_accepted: u64,
    pub payload_bytes_accepted: u64,
    /// Refused frames by [`FrameError::reason`], in `FrameError::REASONS` order.
    pub frames_refused: [u64; FrameError::REASONS.len()],
}

impl ReceiverCounters {
    pub fn hello_rejected(&self, reason: RejectReason) -> u64 {
        match reason {
            RejectReason::ProtocolVersion => self.hello_rejected_protocol_version,
            RejectReason::VersionGroup => self.hello_rejected_version_group,
            RejectReason::Fingerprint => self.hello_rejected_fingerprint,
        }
    }

    /// Frames refused with this [`FrameError::reason`] label.
    pub fn refused(&self, reason: &str) -> u64 {
        FrameError::REASONS.iter().position(|r| *r == reason).map_or(0, |i| self.frames_refused[i])
    }

    fn count_refusal(&mut self, e: &FrameError) {
        if let Some(i) = FrameError::REASONS.iter().position(|r| *r == e.reason()) {
            self.frames_refused[i] += 1;
        }
    }
}

#[derive(Debug)]
struct Live {
    blocks: Vec<BlockId>,
    deadline: Instant,
    coverage: Coverage,
    ready: bool,
    /// A peer writes the blocks in place ([`Receiver::expose`]) and has not
    /// been fenced since.
    exposed: bool,
    /// Layers a stream transport is reading straight into the blocks now
    /// ([`Receiver::begin_direct`]), not yet ended.
    direct: u32,
}

/// An ended reservation's blocks, held back while something may still
/// write them: a peer not yet fenced, or direct reads not yet ended.
#[derive(Debug)]
struct Quarantined {
    released: Released,
    exposed: bool,
    direct: u32,
}

#[derive(Debug)]
enum SlotState {
    Live(Live),
    /// Terminal; the blocks have been (or are queued to be) handed back.
    Ended(ReservationState),
}

#[derive(Debug)]
struct Slot {
    generation: u32,
    state: SlotState,
}

/// Taken reservations a receiver remembers for [`Receiver::on_write_failed`]:
/// far more than are ever between their take and their taker's question.
const TAKEN_REMEMBERED: usize = 4096;

/// The receiver state machine. See the module docs.
#[derive(Debug)]
pub struct Receiver {
    local: Peer,
    config: ReceiverConfig,
    /// Bytes of one block's K (or V) in one layer.
    side_bytes: usize,
    slots: Vec<Slot>,
    /// Ended slots, oldest end first: the next to reuse.
    reusable: VecDeque<usize>,
    next_generation: u32,
    /// Every block the receiver holds (live reservations and the outbox).
    held: HashSet<BlockId>,
    outbox: Vec<Released>,
    /// Ended reservations whose blocks a peer may still write: they go to
    /// the outbox only once nothing does, at the writer's
    /// [`Receiver::fence`] and the last direct read's end.
    quarantine: HashMap<Reservation, Quarantined>,
    /// Reservations taken and not yet asked about by
    /// [`Receiver::take_write_failure`] (the most recent [`TAKEN_REMEMBERED`]):
    /// a write that fails after the take is recorded against them even once
    /// their slot was reused by a new generation.
    taken: VecDeque<Reservation>,
    /// Those of them a write of which failed.
    write_failed: HashSet<Reservation>,
    counters: ReceiverCounters,
}

impl Receiver {
    pub fn new(local: Peer, config: ReceiverConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        let side_bytes = config.layout.block_elems() * config.layout.dtype.size();
        Ok(Self {
            local,
            config,
            side_bytes,
            slots: Vec::new(),
            reusable: VecDeque::new(),
            next_generation: 1,
            held: HashSet::new(),
            outbox: Vec::new(),
            quarantine: HashMap::new(),
            taken: VecDeque::new(),
            write_failed: HashSet::new(),
            counters: ReceiverCounters::default(),
        })
    }

    pub fn local(&self) -> &Peer {
        &self.local
    }

    pub fn config(&self) -> &ReceiverConfig {
        &self.config
    }

    pub fn counters(&self) -> &ReceiverCounters {
        &self.counters
    }

    /// Reservations holding blocks (receiving or ready).
    pub fn live_reservations(&self) -> usize {
        self.slots.iter().filter(|s| matches!(s.state, SlotState::Live(_))).count()
    }

    /// Blocks the receiver holds now, including those awaiting `poll_released`.
    pub fn held_blocks(&self) -> usize {
        self.held.len()
    }

    /// The state of `r`, or `None` if the id is unknown or on another generation.
    pub fn state(&self, r: Reservation) -> Option<ReservationState> {
        let slot = self.slots.get(usize::try_from(r.id.0).ok()?)?;
        let state = match &slot.state {
            SlotState::Live(l) if l.ready => ReservationState::Ready,
            SlotState::Live(_) => ReservationState::Receiving,
            SlotState::Ended(s) => *s,
        };
        (slot.generation == r.generation).then_some(state)
    }

    /// How many blocks `r` holds while it is receiving (within its lease at
    /// the last check, not yet complete); `None` otherwise. What a one-sided
    /// transport sizes the landing space of a transfer by.
    pub fn receiving_blocks(&self, r: Reservation) -> Option<usize> {
        let slot = self.slots.get(usize::try_from(r.id.0).ok()?)?;
        match &slot.state {
            SlotState::Live(l) if slot.generation == r.generation && !l.ready => Some(l.blocks.len()),
            _ => None,
        }
    }

    /// The earliest lease deadline, for the caller's timer (the decode worker's reaper).
    pub fn next_deadline(&self) -> Option<Instant> {
        self.slots
            .iter()
            .filter_map(|s| match &s.state {
                SlotState::Live(l) => Some(l.deadline),
                SlotState::Ended(_) => None,
            })
            .min()
    }

    /// Checks a sender's handshake. Labels first (a routing mistake), then
    /// the fingerprint, which is refused even when labels agree.
    pub fn on_hello(&mut self, hello: &Hello) -> Result<HelloAck, HelloReject> {
        let reason = if hello.protocol_version != crate::PROTOCOL_VERSION {
            RejectReason::ProtocolVersion
        } else if hello.version_group != self.local.version_group {
            RejectReason::VersionGroup
        } else if hello.fingerprint != self.local.fingerprint {
            RejectReason::Fingerprint
        } else {
            self.counters.hello_accepted += 1;
            return Ok(HelloAck { protocol_version: crate::PROTOCOL_VERSION });
        };
        *match reason {
            RejectReason::ProtocolVersion => &mut self.counters.hello_rejected_protocol_version,
            RejectReason::VersionGroup => &mut self.counters.hello_rejected_version_group,
            RejectReason::Fingerprint => &mut self.counters.hello_rejected_fingerprint,
        } += 1;
        Err(HelloReject { reason })
    }

    /// Registers blocks the caller allocated from its pool under a lease of
    /// `ttl` from `now`. From here the receiver holds them until they come
    /// back by one of the paths in the module docs. On error the blocks come
    /// back in the error.
    pub fn reserve(&mut self, blocks: Vec<BlockId>, ttl: Duration, now: Instant) -> Result<Reservation, ReserveError> {
        let refuse = |refusal, blocks| Err(ReserveError { refusal, blocks });
        let max_lease = self.config.max_lease;
        let deadline = match now.checked_add(ttl) {
            Some(d) if !ttl.is_zero() && ttl <= max_lease => d,
            _ => return refuse(ReserveRefusal::InvalidTtl { ttl, max: max_lease }, blocks),
        };
        if blocks.is_empty() {
            return refuse(ReserveRefusal::Empty, blocks);
        }
        let max = self.config.max_blocks_per_reservation;
        if blocks.len() > max {
            return refuse(ReserveRefusal::TooManyBlocks { n: blocks.len(), max }, blocks);
        }
        let mut seen = HashSet::with_capacity(blocks.len());
        for &b in &blocks {
            if self.held.contains(&b) {
                return refuse(ReserveRefusal::AlreadyHeld { block: b }, blocks);
            }
            if !seen.insert(b) {
                return refuse(ReserveRefusal::DuplicateBlock { block: b }, blocks);
            }
        }
        let idx = if self.slots.len() < self.config.max_reservations {
            self.slots.push(Slot { generation: 0, state: SlotState::Ended(ReservationState::Taken) });
            self.slots.len() - 1
        } else if let Some(i) = self.reusable.pop_front() {
            i
        } else {
            return refuse(ReserveRefusal::Full { max: self.config.max_reservations }, blocks);
        };
        let generation = self.next_generation;
        // 0 is never issued; wrapping needs 2^32 reservations, long after
        // any frame of the first one could still be in flight.
        self.next_generation = self.next_generation.checked_add(1).unwrap_or(1);
        self.held.extend(blocks.iter().copied());
        let coverage = Coverage::new(self.config.layout.n_layers, blocks.len());
        self.slots[idx] = Slot {
            generation,
            state: SlotState::Live(Live { blocks, deadline, coverage, ready: false, exposed: false, direct: 0 }),
        };
        self.counters.reservations_created += 1;
        Ok(Reservation { id: ReservationId(idx as u64), generation })
    }

    /// Hands a `Ready` reservation's blocks to the engine. The only way to
    /// read received KV: blocks are never handed out before the full set was
    /// acknowledged.
    pub fn take_ready(&mut self, r: Reservation) -> Result<Vec<BlockId>, ReservationError> {
        let idx = self.find(r)?;
        match &self.slots[idx].state {
            SlotState::Live(l) if l.ready => {}
            SlotState::Live(_) => {
                return Err(ReservationError::NotReady { reservation: r, state: ReservationState::Receiving })
            }
            SlotState::Ended(state) => return Err(ReservationError::Ended { reservation: r, state: *state }),
        }
        self.counters.reservations_taken += 1;
        if self.taken.len() == TAKEN_REMEMBERED {
            // A taker that never asked: its writes ran long ago.
            if let Some(old) = self.taken.pop_front() {
                self.write_failed.remove(&old);
            }
        }
        self.taken.push_back(r);
        Ok(self.end_returning(idx, ReservationState::Taken))
    }

    /// A write of `r`'s accepted KV failed where the sink put it (the decode
    /// worker writes on its engine thread, after the frame was accepted):
    /// the blocks' content is unknown. The receiver is the one record of it.
    /// A live `r` ends as `Failed` (its blocks come back through
    /// [`poll_released`](Self::poll_released) as [`ReleaseCause::Corrupt`]; the
    /// sender's next frame is refused); a taken one is remembered until
    /// [`take_write_failure`](Self::take_write_failure); one that ended
    /// otherwise has nothing left to spoil.
    pub fn on_write_failed(&mut self, r: Reservation) {
        if self.taken.contains(&r) {
            // Whatever its slot holds now (a reused slot has a new generation).
            self.write_failed.insert(r);
            return;
        }
        let Ok(idx) = self.find(r) else { return };
        if let SlotState::Live(_) = &self.slots[idx].state {
            self.end_to_outbox(idx, ReservationState::Failed, ReleaseCause::Corrupt);
        }
    }

    /// Whether a write of the taken `r` failed (and forgets `r`). The taker
    /// asks once every write of `r` has run (the decode worker: on the
    /// engine thread, after `take_ready`), and treats a hit as corrupt KV.
    pub fn take_write_failure(&mut self, r: Reservation) -> bool {
        self.taken.retain(|t| *t != r);
        self.write_failed.remove(&r)
    }

    /// Moves a live reservation's lease end to `now + ttl` if that is later
    /// (a renewal never shortens a lease) and returns the lease end. The
    /// decode worker renews while the prefill worker reports the prompt
    /// still queued there: the lease bounds how long blocks wait on a peer
    /// that shows no sign of progress, not how long a busy peer's queue is.
    /// A lease that already ran out is not revived: the reservation expires
    /// here (its blocks go to [`Receiver::poll_released`]).
    pub fn renew(&mut self, r: Reservation, ttl: Duration, now: Instant) -> Result<Instant, ReservationError> {
        let max = self.config.max_lease;
        let until = match now.checked_add(ttl) {
            Some(t) if !ttl.is_zero() && ttl <= max => t,
            _ => return Err(ReservationError::InvalidTtl { ttl, max }),
        };
        let idx = self.find(r)?;
        match &mut self.slots[idx].state {
            SlotState::Live(l) if now >= l.deadline => {
                self.end_to_outbox(idx, ReservationState::Expired, ReleaseCause::LeaseExpired);
                Err(ReservationError::Ended { reservation: r, state: ReservationState::Expired })
            }
            SlotState::Live(l) => {
                l.deadline = l.deadline.max(until);
                Ok(l.deadline)
            }
            SlotState::Ended(state) => Err(ReservationError::Ended { reservation: r, state: *state }),
        }
    }

    /// When a live reservation's lease ends; `None` once it has ended (or
    /// for a reservation this receiver does not know).
    pub fn lease_end(&self, r: Reservation) -> Option<Instant> {
        let slot = self.slots.get(usize::try_from(r.id.0).ok()?)?;
        match &slot.state {
            SlotState::Live(l) if slot.generation == r.generation => Some(l.deadline),
            _ => None,
        }
    }

    /// Ends a live reservation on the caller's behalf (request cancelled,
    /// shutting down) and returns its blocks. The caller tells the sender
    /// with an `Abort` frame. An [`expose`](Self::expose)d reservation
    /// returns none: its blocks wait in quarantine for the writer's
    /// [`fence`](Self::fence), then come back through `poll_released`.
    pub fn abort(&mut self, r: Reservation) -> Result<Vec<BlockId>, ReservationError> {
        let idx = self.find(r)?;
        if let SlotState::Ended(state) = self.slots[idx].state {
            return Err(ReservationError::Ended { reservation: r, state });
        }
        if matches!(&self.slots[idx].state, SlotState::Live(l) if l.exposed || l.direct > 0) {
            // `end_to_outbox` counts it and quarantines the blocks.
            self.end_to_outbox(idx, ReservationState::Aborted, ReleaseCause::Aborted);
            return Ok(Vec::new());
        }
        self.counters.reservations_aborted += 1;
        Ok(self.end_returning(idx, ReservationState::Aborted))
    }

    /// Expires every live reservation whose lease has passed, then hands
    /// back the blocks of all reservations that ended without reaching the
    /// engine since the last call. Each block comes back exactly once.
    pub fn poll_released(&mut self, now: Instant) -> Vec<Released> {
        for idx in 0..self.slots.len() {
            if matches!(&self.slots[idx].state, SlotState::Live(l) if now >= l.deadline) {
                self.end_to_outbox(idx, ReservationState::Expired, ReleaseCause::LeaseExpired);
            }
        }
        let out = std::mem::take(&mut self.outbox);
        for r in &out {
            for b in &r.blocks {
                self.held.remove(b);
            }
        }
        out
    }

    fn find(&self, r: Reservation) -> Result<usize, ReservationError> {
        let id = r.id.0;
        let idx = usize::try_from(id).ok().filter(|&i| i < self.slots.len()).ok_or(ReservationError::Unknown { id })?;
        let current = self.slots[idx].generation;
        if current != r.generation {
            return Err(ReservationError::StaleGeneration { id, got: r.generation, current });
        }
        Ok(idx)
    }

    /// Resolves a frame's reservation to a slot that is receiving and within
    /// its lease; expires it first if the lease has passed.
    fn receiving(&mut self, id: u64, generation: u32, now: Instant) -> Result<(usize, Reservation), FrameError> {
        let res = Reservation { id: ReservationId(id), generation };
        let idx = self.find(res).map_err(|e| match e {
            ReservationError::StaleGeneration { id, got, current } => FrameError::StaleGeneration { id, got, current },
            _ => FrameError::UnknownReservation { id },
        })?;
        match &self.slots[idx].state {
            SlotState::Live(l) if now >= l.deadline => {
                self.end_to_outbox(idx, ReservationState::Expired, ReleaseCause::LeaseExpired);
                Err(FrameError::Expired(res))
            }
            SlotState::Live(l) if l.ready => Err(FrameError::AlreadyComplete(res)),
            SlotState::Live(_) => Ok((idx, res)),
            SlotState::Ended(s) => Err(match s {
                ReservationState::Expired => FrameError::Expired(res),
                ReservationState::Failed => FrameError::Failed(res),
                ReservationState::Aborted => FrameError::Aborted(res),
                ReservationState::Taken | ReservationState::Ready | ReservationState::Receiving => {
                    FrameError::AlreadyComplete(res)
                }
            }),
        }
    }

    /// The live state of a slot `receiving` just checked. `None` cannot
    /// happen (nothing in between ends a reservation); callers refuse the
    /// frame rather than panic if it ever did.
    fn live_mut(&mut self, idx: usize) -> Option<&mut Live> {
        match &mut self.slots[idx].state {
            SlotState::Live(l) => Some(l),
            SlotState::Ended(_) => None,
        }
    }

    /// Ends a live slot and returns its blocks to the caller directly.
    fn end_returning(&mut self, idx: usize, state: ReservationState) -> Vec<BlockId> {
        let blocks = self.end(idx, state);
        for b in &blocks {
            self.held.remove(b);
        }
        blocks
    }

    /// Ends a live slot and queues its blocks for `poll_released` (they stay
    /// counted as held until then).
    fn end_to_outbox(&mut self, idx: usize, state: ReservationState, cause: ReleaseCause) {
        match state {
            ReservationState::Expired => self.counters.reservations_expired += 1,
            ReservationState::Failed => self.counters.reservations_failed += 1,
            ReservationState::Aborted => self.counters.reservations_aborted += 1,
            _ => {}
        }
        let generation = self.slots[idx].generation;
        let (exposed, direct) = match &self.slots[idx].state {
            SlotState::Live(l) => (l.exposed, l.direct),
            SlotState::Ended(_) => (false, 0),
        };
        let blocks = self.end(idx, state);
        let reservation = Reservation { id: ReservationId(idx as u64), generation };
        let released = Released { reservation, blocks, cause };
        if exposed || direct > 0 {
            self.quarantine.insert(reservation, Quarantined { released, exposed, direct });
        } else {
            self.outbox.push(released);
        }
    }

    /// Marks a live slot ended and takes its blocks. Callers end only live
    /// slots; an ended one yields no blocks, so nothing is handed back twice.
    fn end(&mut self, idx: usize, state: ReservationState) -> Vec<BlockId> {
        let SlotState::Live(_) = &self.slots[idx].state else {
            debug_assert!(false, "slot {idx} ended twice");
            return Vec::new();
        };
        let prev = std::mem::replace(&mut self.slots[idx].state, SlotState::Ended(state));
        self.reusable.push_back(idx);
        match prev {
            SlotState::Live(l) => l.blocks,
            SlotState::Ended(_) => Vec::new(),
        }
    }
}

// Checks the receiver against the engine's real pool: needs feature `pool`.
#[cfg(test)]
#[cfg(feature = "pool")]
mod prop_tests;
#[cfg(test)]
mod tests;
