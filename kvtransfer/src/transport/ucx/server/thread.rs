//! The UCX KV server's thread: it owns the UCX worker, the landing region
//! and the registered pool, answers senders' active messages (hello,
//! claims, `Layer`, `Complete`, `Abort`, the fence, `Bye`) and feeds the
//! [`Receiver`]; the [`UcxKvServer`](super::UcxKvServer) handle starts it.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::{oneshot, watch};
use tokio::time::MissedTickBehavior;
use types::kv::KvLayout;
use ucx_sys::{Context, Endpoint, OutOfRange, Region, Request, Worker};

use super::{Hooks, Pool, Ready, UcxServerConfig, UcxServerStats};
use crate::buffers::Buffers;
use crate::checksum;
use crate::frame::{Abort, AbortReason, Complete, Frame, Hello, LayerDataHeader};
use crate::session::{Receiver, Reservation, ReservationId, ReservationState};
use crate::transport::close::CloseReason;
use crate::transport::inbound::{self, Event, InboundConn, Verdict};
use crate::transport::lock::lock;
use crate::transport::ucx::direct::UcxPoolMemory;
use crate::transport::ucx::driver::{mail, Driver, Inbound};
use crate::transport::ucx::landing::Landing;
use crate::transport::ucx::runs::runs;
use crate::transport::ucx::wire::{Grant, LandingRefusal, Msg, ProcessId, MAX_DIRECT_BLOCKS, TO_SENDER, TO_SERVER};
use crate::transport::BlockSink;
use types::kv::BlockId;

#[allow(clippy::too_many_arguments)]
pub(super) fn serve_thread<S: BlockSink>(
    receiver: Arc<Mutex<Receiver>>,
    sink: S,
    config: UcxServerConfig,
    hooks: Hooks,
    direct: Arc<AtomicBool>,
    ready: oneshot::Sender<Ready>,
    stop: oneshot::Receiver<()>,
    stats: watch::Sender<UcxServerStats>,
) {
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            let _ = ready.send(Err(format!("runtime: {e}")));
            return;
        }
    };
    rt.block_on(async move {
        let layout = lock(&receiver).config().layout;
        let setup = || -> Result<_, String> {
            let ctx = Context::new("tandem-kv-decode").map_err(|e| e.to_string())?;
            let worker = Worker::new(&ctx).map_err(|e| e.to_string())?;
            let region = ctx.map(config.landing_bytes).map_err(|e| e.to_string())?;
            let rkey = region.pack_key().map_err(|e| e.to_string())?;
            let pool = match config.pool_blocks {
                None => None,
                Some(num_blocks) => {
                    let bytes = layout
                        .pool_bytes(num_blocks)
                        .filter(|b| *b > 0)
                        .ok_or_else(|| format!("a pool of {num_blocks} blocks has no valid size"))?;
                    let region = ctx.map(bytes).map_err(|e| format!("mapping the {bytes}-byte KV pool: {e}"))?;
                    let rkey = region.pack_key().map_err(|e| e.to_string())?;
                    Some(Pool { region, rkey, num_blocks, lease: Arc::new(()) })
                }
            };
            let addr = worker.address().map_err(|e| e.to_string())?;
            let driver = Driver::new(worker, TO_SERVER)?;
            Ok((ctx, driver, region, rkey, pool, addr))
        };
        let (_ctx, driver, region, rkey, pool, addr) = match setup() {
            Ok(s) => s,
            Err(e) => {
                let _ = ready.send(Err(e));
                return;
            }
        };
        let memory = pool.as_ref().and_then(|p| {
            let addr = p.region.ptr(0, p.region.len()).ok()? as usize;
            Some(UcxPoolMemory { addr, len: p.region.len(), lease: p.lease.clone() })
        });
        let mut state = State {
            receiver,
            sink,
            layout,
            side: layout.side_bytes(),
            pool,
            direct,
            orphans: Vec::new(),
            landing: Landing::new(region.len()),
            region,
            rkey,
            conns: HashMap::new(),
            owner: HashMap::new(),
            next_conn: 1,
            lingering: Vec::new(),
            counts: UcxServerStats::default(),
            stats,
            config,
            hooks,
            buffers: Buffers::new(KEPT_BYTES),
        };
        state.publish();
        if ready.send(Ok((crate::transport::ucx::hex(&addr), memory))).is_err() {
            return;
        }
        driver.run(state.serve(&driver, stop)).await;
        // Endpoints close (forced) first, then the worker goes, and only then
        // the memory it exposed: on transports where UCX emulates puts (tcp),
        // this worker itself writes each arriving put, during its progress, at
        // the address the sender's key names, without checking that the
        // memory is still registered, and destroying the worker progresses
        // it (`ucx_sys`'s wire-up drain). Unmapped first, a sender's late put
        // faulted this process.
        let (region, pool) = state.into_memory();
        drop(driver);
        drop(region);
        if let Some(pool) = pool {
            if Arc::strong_count(&pool.lease) > 1 {
                // The engine still keeps its KV there: leave it mapped (with the
                // context it belongs to) until the process exits.
                std::mem::forget(pool);
            }
        }
    });
}

/// Where a live transfer's KV goes.
#[derive(Clone)]
enum Granted {
    /// A landing range, with the reservation's block count.
    Landing(Range<usize>, usize),
    /// Straight into these pool blocks (the reservation's, in order).
    Direct(Vec<BlockId>),
}

/// One sender.
struct Conn {
    ep: Endpoint,
    /// The sender's process, if it may write the pool directly (on this
    /// host, visible in `/proc`).
    process: Option<ProcessId>,
    grants: HashMap<Reservation, Granted>,
    /// Transfers that ended unfinished, until the sender fences: a landing
    /// range, or `None` for pool blocks (which the receiver quarantines).
    quarantine: HashMap<Reservation, Option<Range<usize>>>,
    /// The rules every transport shares (the one abort per reservation).
    inbound: InboundConn,
}

struct State<S> {
    receiver: Arc<Mutex<Receiver>>,
    sink: S,
    layout: KvLayout,
    /// Bytes of one block's K (or V) in one layer.
    side: usize,
    pool: Option<Pool>,
    /// [`UcxKvServer::enable_direct`] was called.
    direct: Arc<AtomicBool>,
    /// Direct writers whose control connection failed while their process
    /// still ran: their reservations are fenced once it has exited.
    orphans: Vec<(ProcessId, Vec<Reservation>)>,
    landing: Landing,
    region: Region,
    rkey: Vec<u8>,
    conns: HashMap<u64, Conn>,
    /// Which connection holds each granted reservation.
    owner: HashMap<Reservation, u64>,
    next_conn: u64,
    /// Endpoints kept only until their last message (a `HelloReject`) arrived.
    lingering: Vec<(Endpoint, Option<Request>)>,
    counts: UcxServerStats,
    stats: watch::Sender<UcxServerStats>,
    config: UcxServerConfig,
    hooks: Hooks,
    buffers: Buffers,
}

/// Most bytes of layer copies kept for reuse once the sink is done with
/// them: a steady stream of layers reuses warm memory instead of faulting
/// in (and zeroing) a fresh allocation for every layer, which was most of
/// this thread's time in a profile of the pool-to-pool bench.
const KEPT_BYTES: usize = 64 << 20;

/// Appends the landing region's `len` bytes at `at` to `out` and returns
/// `crc32c_append(crc, <them>)`, taken on the words as they are stored into
/// `out` (one pass, [`checksum::append_crc`]): the checksum is of the copy.
#[allow(unsafe_code)]
fn copy_out(region: &Region, at: usize, len: usize, out: &mut Vec<u8>, crc: u32) -> Result<u32, OutOfRange> {
    let src = region.ptr(at, len)?;
    // SAFETY: `Region::ptr` checked that the `len` bytes at `at` lie inside the
    // region, which the borrow keeps mapped for the call; `out` is this
    // thread's own buffer, not part of the region. A sender may write the
    // bytes meanwhile: they are read once, through raw pointers.
    Ok(unsafe { checksum::append_crc(src, len, out, crc) })
}

impl Granted {
    /// The message that tells the sender where `r`'s KV goes.
    fn message(&self, r: Reservation) -> Msg {
        match self {
            Granted::Landing(range, n_blocks) => {
                Msg::Grant(Grant { reservation: r, offset: range.start as u64, n_blocks: *n_blocks as u32 })
            }
            Granted::Direct(blocks) => Msg::Blocks { reservation: r, blocks: blocks.clone() },
        }
    }
}

fn send(ep: &Endpoint, conn: u64, msg: &Msg) -> Option<Request> {
    let (header, body) = msg.encode(conn);
    // A failed send means a failed endpoint, which the sweep notices.
    ep.send_am(TO_SENDER, header, body).ok()
}

impl<S> State<S> {
    /// Closes every endpoint (forced) and drops all but the memory senders
    /// write: the landing region and the pool, unmapped by the caller once
    /// the worker is gone.
    fn into_memory(self) -> (Region, Option<Pool>) {
        let State { region, pool, conns, lingering, .. } = self;
        drop(conns);
        drop(lingering);
        (region, pool)
    }
}

impl<S: BlockSink> State<S> {
    async fn serve(&mut self, d: &Driver, mut stop: oneshot::Receiver<()>) {
        let mut tick = tokio::time::interval(self.config.sweep_interval);
        tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
        loop {
            while let Some(m) = d.pop() {
                self.handle(d, m).await;
                self.publish();
            }
            tokio::select! {
                biased;
                _ = &mut stop => return,
                _ = mail(d) => {}
                _ = tick.tick() => {
                    self.sweep();
                    self.publish();
                }
            }
        }
    }

    fn publish(&mut self) {
        let c = &mut self.counts;
        c.ucx.landing_bytes = self.landing.size() as u64;
        c.ucx.landing_in_use_bytes = self.landing.in_use() as u64;
        let (bytes, ranges) = self.landing.quarantined();
        (c.ucx.quarantined_bytes, c.ucx.quarantined_ranges) = (bytes as u64, ranges as u64);
        if self.pool.is_some() {
            c.ucx.quarantined_blocks = lock(&self.receiver).quarantined_blocks() as u64;
        }
        c.ucx.granted_transfers = self.conns.values().map(|c| c.grants.len() as u64).sum();
        let now = self.counts.clone();
        self.stats.send_if_modified(|s| {
            let changed = *s != now;
            *s = now;
            changed
        });
    }

    async fn handle(&mut self, d: &Driver, m: Inbound) {
        let Ok((conn, msg)) = m else {
            self.counts.ucx.bad_messages += 1;
            return;
        };
        if !matches!(msg, Msg::Hello { .. }) && !self.conns.contains_key(&conn) {
            self.counts.ucx.bad_messages += 1;
            return;
        }
        match msg {
            Msg::Hello { addr, process, frame: Frame::Hello(h) } => self.hello(&d.worker, &addr, process, &h),
            Msg::Claim(r) => self.claim(conn, r),
            Msg::ClaimDirect(r) => self.claim_direct(conn, r),
            Msg::Layer(h) => self.layer(conn, h).await,
            Msg::Frame(Frame::Complete(c)) => self.complete(conn, c).await,
            Msg::Frame(Frame::Abort(a)) => self.peer_abort(conn, a).await,
            Msg::Fenced(r) => self.fenced(conn, r),
            Msg::Bye => self.close(conn, CloseReason::Bye),
            _ => self.counts.ucx.bad_messages += 1,
        }
    }

    fn hello(&mut self, worker: &Worker, addr: &[u8], process: ProcessId, h: &Hello) {
        // Counted as every transport counts a connection: accepted when it
        // arrives, then closed once with its reason (a refusal included), so
        // accepted − closed is what is open.
        if self.conns.len() >= self.config.max_connections {
            self.counts.connections_accepted += 1;
            self.counts.close(&CloseReason::Busy);
            return;
        }
        let Ok(ep) = worker.connect(addr) else {
            self.counts.ucx.bad_messages += 1;
            return;
        };
        self.counts.connections_accepted += 1;
        let id = self.next_conn;
        self.next_conn += 1;
        let (reply, refused) = inbound::hello(&self.receiver, h);
        send(&ep, id, &Msg::Frame(reply));
        if let Some(close) = refused {
            // Kept until the rejection is at the sender (a flush completes
            // remotely), so closing the endpoint cannot drop it.
            let flushed = ep.flush().ok();
            self.counts.close(&close);
            self.lingering.push((ep, flushed));
            return;
        }
        // The pool's key only to a sender whose end this server can see
        // (module `direct`), before the landing key that ends the handshake:
        // the keys go only to a sender whose group and layout fingerprint match.
        let process = self.pool.as_ref().filter(|_| process.alive()).map(|pool| {
            let key = Msg::PoolKey {
                base: pool.region.remote_base(),
                num_blocks: pool.num_blocks as u32,
                rkey: pool.rkey.clone(),
            };
            send(&ep, id, &key);
            process
        });
        let key = Msg::Key { base: self.region.remote_base(), rkey: self.rkey.clone() };
        send(&ep, id, &key);
        let conn =
            Conn { ep, process, grants: HashMap::new(), quarantine: HashMap::new(), inbound: InboundConn::default() };
        self.conns.insert(id, conn);
    }

    fn claim(&mut self, id: u64, r: Reservation) {
        let Some(conn) = self.conns.get_mut(&id) else { return };
        if let Some(granted) = conn.grants.get(&r) {
            send(&conn.ep, id, &granted.message(r));
            return;
        }
        let verdict = if self.owner.contains_key(&r) {
            Err(LandingRefusal::Claimed)
        } else {
            match lock(&self.receiver).receiving_blocks(r) {
                None => Err(LandingRefusal::NotReceiving),
                Some(n_blocks) => {
                    let len = self.layout.n_layers.saturating_mul(n_blocks).saturating_mul(2 * self.side);
                    self.landing.alloc(len).map(|range| (range, n_blocks))
                }
            }
        };
        match verdict {
            Ok((range, n_blocks)) => {
                let grant = Grant { reservation: r, offset: range.start as u64, n_blocks: n_blocks as u32 };
                send(&conn.ep, id, &Msg::Grant(grant));
                conn.grants.insert(r, Granted::Landing(range, n_blocks));
                self.owner.insert(r, id);
                self.counts.ucx.grants += 1;
            }
            Err(refusal) => {
                send(&conn.ep, id, &Msg::Refused { reservation: r, refusal });
                if let Some(i) = LandingRefusal::ALL.iter().position(|x| *x == refusal) {
                    self.counts.ucx.refused[i] += 1;
                }
            }
        }
    }

    /// A claim for the reservation's own pool blocks: granted to a sender
    /// on this host once the engine's pool lives in the registered memory,
    /// for a reservation small enough to name in one message; otherwise the
    /// claim is a landing claim like any other.
    fn claim_direct(&mut self, id: u64, r: Reservation) {
        let Some(conn) = self.conns.get_mut(&id) else { return };
        if let Some(granted) = conn.grants.get(&r) {
            send(&conn.ep, id, &granted.message(r));
            return;
        }
        let direct = conn.process.is_some() && self.direct.load(Ordering::Acquire) && !self.owner.contains_key(&r);
        let fits = lock(&self.receiver).receiving_blocks(r).is_some_and(|n| n > 0 && n <= MAX_DIRECT_BLOCKS);
        if !(direct && fits) {
            return self.claim(id, r);
        }
        // From here until this sender is fenced, the receiver keeps the
        // blocks from the pool however the reservation ends.
        let Some(blocks) = lock(&self.receiver).expose(r) else { return self.claim(id, r) };
        let granted = Granted::Direct(blocks);
        send(&conn.ep, id, &granted.message(r));
        conn.grants.insert(r, granted);
        self.owner.insert(r, id);
        self.counts.ucx.direct_grants += 1;
    }

    /// A layer the sender finished: direct, checksum it in the pool; else
    /// see [`landed`](Self::landed).
    async fn layer(&mut self, id: u64, h: LayerDataHeader) {
        let r = Reservation { id: ReservationId(h.reservation), generation: h.generation };
        let Some(conn) = self.conns.get(&id) else { return };
        let (range, n_blocks) = match conn.grants.get(&r) {
            Some(Granted::Landing(range, n)) => (range.clone(), *n),
            Some(Granted::Direct(blocks)) => {
                let blocks = blocks.clone();
                return self.in_pool(id, r, h, &blocks).await;
            }
            None => {
                if !conn.quarantine.contains_key(&r) {
                    self.abort_once(id, r, AbortReason::ProtocolViolation);
                }
                return;
            }
        };
        self.landed(id, r, h, range, n_blocks).await;
    }

    /// A direct layer the sender stored (and fenced) in the reservation's
    /// pool blocks: checksum it there and have the receiver accept it. The
    /// bytes are already where the engine reads them.
    #[allow(unsafe_code)]
    async fn in_pool(&mut self, id: u64, r: Reservation, h: LayerDataHeader, blocks: &[BlockId]) {
        let (layer, first, n) = (h.layer as usize, h.first_block as usize, h.n_blocks as usize);
        let fits = layer < self.layout.n_layers
            && n > 0
            && first.checked_add(n).is_some_and(|end| end <= blocks.len())
            && h.payload_len == 2 * n * self.side;
        let Some(pool) = self.pool.as_ref().filter(|_| fits) else {
            self.abort_once(id, r, AbortReason::ProtocolViolation);
            return;
        };
        // Runs of consecutive block ids are consecutive in the pool: one piece each.
        let runs = runs(blocks[first..first + n].iter().map(|&b| (b as usize, b as usize)));
        let mut crc = 0;
        for v in [false, true] {
            for run in &runs {
                let (at, len) = (self.layout.pool_offset(pool.num_blocks, layer, v, run.to), run.len);
                // The receiver's blocks are inside the pool; a miss is refused.
                let Ok(p) = pool.region.ptr(at, len * self.side) else {
                    self.abort_once(id, r, AbortReason::ProtocolViolation);
                    return;
                };
                // SAFETY: `ptr` checked the range is inside the registered pool,
                // which lives as long as `self.pool`; it is read through raw
                // pointers only (a sender may still be writing it: then the
                // checksum fails, which is the point).
                crc = unsafe { checksum::crc_raw(p, len * self.side, crc) };
            }
        }
        match self.judge(id, Event::StoredInPlace { header: h, crc }).await {
            Some(Verdict::Taken(_)) => self.counts.ucx.direct_layers += 1,
            Some(Verdict::Refused(_)) => self.settle(id, r),
            _ => {}
        }
    }

    /// A layer the sender put and flushed into its landing range: copy it
    /// out, checksum the copy, and hand the copy to the receiver and sink
    /// exactly as a `LayerData` frame's payload.
    async fn landed(&mut self, id: u64, r: Reservation, h: LayerDataHeader, range: Range<usize>, n_blocks: usize) {
        let (layer, first, n) = (h.layer as usize, h.first_block as usize, h.n_blocks as usize);
        let side = self.side;
        let fits = layer < self.layout.n_layers
            && n > 0
            && first.checked_add(n).is_some_and(|end| end <= n_blocks)
            && h.payload_len == 2 * n * side;
        if !fits {
            // Nothing is read outside the reservation's own range.
            self.abort_once(id, r, AbortReason::ProtocolViolation);
            return;
        }
        let layer_at = range.start + layer * 2 * n_blocks * side;
        let (k_at, v_at, half) = (layer_at + first * side, layer_at + (n_blocks + first) * side, n * side);
        self.hooks.before_copy(&self.region, k_at..k_at + half);
        // The copy is the KV: from here nothing reads the landing region
        // for this layer, and the checksum below is of exactly these bytes.
        let mut buf = self.buffers.take();
        let copied = copy_out(&self.region, k_at, half, &mut buf, 0)
            .and_then(|crc| copy_out(&self.region, v_at, half, &mut buf, crc));
        let Ok(crc) = copied else {
            self.abort_once(id, r, AbortReason::ProtocolViolation);
            return;
        };
        let event = Event::Layer { header: h, payload: Box::new(buf), crc };
        if let Some(Verdict::Refused(_)) = self.judge(id, event).await {
            self.settle(id, r);
        }
    }

    async fn complete(&mut self, id: u64, c: Complete) {
        let r = Reservation { id: ReservationId(c.reservation), generation: c.generation };
        match self.judge(id, Event::Frame(Frame::Complete(c))).await {
            Some(Verdict::Taken(_)) => {
                // Every layer was flushed (or fenced) by the sender before its
                // Layer message, and each was copied out or checksummed in
                // place: nothing is left to write.
                let granted = self.conns.get_mut(&id).and_then(|conn| conn.grants.remove(&r));
                if let Some(granted) = granted {
                    self.owner.remove(&r);
                    if let Granted::Landing(range, _) = granted {
                        self.landing.free(range);
                    }
                }
            }
            Some(Verdict::Refused(_)) => self.settle(id, r),
            _ => {}
        }
    }

    /// The sender flushes before it sends `Abort`: its range is free at once.
    async fn peer_abort(&mut self, id: u64, a: Abort) {
        let r = Reservation { id: ReservationId(a.reservation), generation: a.generation };
        self.judge(id, Event::Frame(Frame::Abort(a))).await;
        self.fenced(id, r);
    }

    /// Sender `id`'s event through the rules every transport shares
    /// ([`InboundConn::on_event`], the step `drive` loops over), with the
    /// reply they chose sent; `None` for a connection no longer open. What
    /// only one-sided puts add (ranges, grants, quarantine, fences) is the
    /// caller's, by the verdict.
    async fn judge(&mut self, id: u64, event: Event) -> Option<Verdict> {
        let conn = self.conns.get_mut(&id)?;
        let mut verdict = conn.inbound.on_event(&self.receiver, &mut self.sink, &mut self.counts, event).await;
        if let Some(reply) = verdict.reply() {
            send(&conn.ep, id, &Msg::Frame(reply));
        }
        Some(verdict)
    }

    /// The sender flushed its endpoint after its last put for `r` (or, for
    /// direct stores, fenced them).
    fn fenced(&mut self, id: u64, r: Reservation) {
        let Some(conn) = self.conns.get_mut(&id) else { return };
        if let Some(range) = conn.quarantine.remove(&r) {
            match range {
                Some(range) => self.landing.release(range),
                None => {
                    lock(&self.receiver).fence(r);
                }
            }
            self.counts.ucx.fences_completed += 1;
        } else if let Some(granted) = conn.grants.remove(&r) {
            self.owner.remove(&r);
            match granted {
                Granted::Landing(range, _) => self.landing.free(range),
                Granted::Direct(_) => {
                    lock(&self.receiver).fence(r);
                }
            }
        }
    }

    /// Ends a connection: its sender flushed and left, or UCX says it is
    /// gone. A sender that left can no longer write, so its ranges and
    /// blocks are free; one whose endpoint failed may still run and store
    /// into pool blocks (direct), so those wait until its process exits.
    fn close(&mut self, id: u64, reason: CloseReason) {
        let Some(conn) = self.conns.remove(&id) else { return };
        let mut direct = Vec::new();
        for (r, granted) in conn.grants {
            self.owner.remove(&r);
            match granted {
                Granted::Landing(range, _) => self.landing.free(range),
                Granted::Direct(_) => direct.push(r),
            }
        }
        for (r, range) in conn.quarantine {
            match range {
                Some(range) => self.landing.release(range),
                None => direct.push(r),
            }
            self.counts.ucx.fences_completed += 1;
        }
        match conn.process {
            Some(p) if reason != CloseReason::Bye && !direct.is_empty() && p.alive() => self.orphans.push((p, direct)),
            _ => {
                let mut rx = lock(&self.receiver);
                for r in direct {
                    rx.fence(r);
                }
            }
        }
        self.counts.close(&reason);
    }

    /// Moves `r`'s range to quarantine if its reservation no longer receives.
    fn settle(&mut self, id: u64, r: Reservation) {
        let state = lock(&self.receiver).state(r);
        self.settle_as(id, r, state);
    }

    fn settle_as(&mut self, id: u64, r: Reservation, state: Option<ReservationState>) {
        let reason = match state {
            Some(ReservationState::Receiving) => return,
            Some(ReservationState::Ready | ReservationState::Taken) => None,
            Some(ReservationState::Failed) => Some(AbortReason::Corrupt),
            Some(ReservationState::Aborted) => Some(AbortReason::Cancelled),
            Some(ReservationState::Expired) | None => Some(AbortReason::LeaseExpired),
        };
        let Some(conn) = self.conns.get_mut(&id) else { return };
        let Some(granted) = conn.grants.remove(&r) else { return };
        self.owner.remove(&r);
        match (reason, granted) {
            // Completed through this connection: nothing left to write.
            (None, Granted::Landing(range, _)) => self.landing.free(range),
            (None, Granted::Direct(_)) => {}
            (Some(reason), granted) => {
                // The sender may still have puts in flight for it (or stores,
                // direct: the receiver quarantined those blocks when it ended).
                let held = match granted {
                    Granted::Landing(range, _) => {
                        self.landing.quarantine(&range);
                        Some(range)
                    }
                    Granted::Direct(_) => None,
                };
                conn.quarantine.insert(r, held);
                self.abort_once(id, r, reason);
            }
        }
    }

    fn abort_once(&mut self, id: u64, r: Reservation, reason: AbortReason) {
        let Some(conn) = self.conns.get_mut(&id) else { return };
        let a = Abort { reservation: r.id.0, generation: r.generation, reason };
        if let Some(a) = conn.inbound.abort_once(&mut self.counts, a) {
            send(&conn.ep, id, &Msg::Frame(Frame::Abort(a)));
        }
    }

    /// Closes connections whose endpoint failed, quarantines the ranges of
    /// reservations that ended (lease, local abort), drops sent rejections.
    fn sweep(&mut self) {
        let failed: Vec<u64> = self.conns.iter().filter(|(_, c)| c.ep.failure().is_some()).map(|(id, _)| *id).collect();
        for id in failed {
            self.close(id, CloseReason::PeerFailed);
        }
        let mut ended: Vec<(u64, Reservation, Option<ReservationState>)> = Vec::new();
        {
            let rx = lock(&self.receiver);
            for (id, c) in &self.conns {
                for r in c.grants.keys() {
                    let state = rx.state(*r);
                    if state != Some(ReservationState::Receiving) {
                        ended.push((*id, *r, state));
                    }
                }
            }
        }
        for (id, r, state) in ended {
            self.settle_as(id, r, state);
        }
        if !self.orphans.is_empty() {
            let (gone, alive): (Vec<_>, Vec<_>) =
                std::mem::take(&mut self.orphans).into_iter().partition(|(p, _)| !p.alive());
            self.orphans = alive;
            let mut rx = lock(&self.receiver);
            for r in gone.into_iter().flat_map(|(_, rs)| rs) {
                rx.fence(r);
            }
        }
        self.lingering
            .retain(|(ep, req)| ep.failure().is_none() && req.as_ref().is_some_and(|r| r.poll_done().is_none()));
    }
}
