//! The connection's thread behind a [`UcxKvSender`](super::UcxKvSender):
//! it owns the UCX worker and the endpoints to one decode worker, and runs
//! the commands the handle sends it: the handshake, grants, puts and
//! mapped stores, `Layer` announcements of what direct writers stored, and
//! every reservation's ending (`Complete`, `Abort`, the fence, `Bye`).

use std::collections::HashMap;
use std::future::{poll_fn, Future};
use std::io;
use std::pin::pin;
use std::ptr::NonNull;
use std::sync::atomic::Ordering;
use std::task::Poll;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::time::{timeout, Instant};
use types::kv::KvLayout;
use ucx_sys::{Context, Endpoint, PeerFailure, RemoteKey, Request, Worker};

use super::driver::{mail, Driver};
use super::runs::runs;
use super::sender::{Cmd, Counts, UcxSenderConfig};
use super::wire::{Grant, LandingRefusal, Msg, ProcessId, TO_SENDER, TO_SERVER};
use super::writer::{self, Grants, StoredLayer, UcxDirectWriter};
use crate::buffers::Buffer;
use crate::checksum;
use crate::frame::{AbortReason, Ack, Frame, Hello, LayerDataHeader};
use crate::sender::SplitError;
use crate::session::Reservation;
use crate::transport::error::TransferError;
use crate::transport::outbound::{self, Outbound};
use crate::transport::send::LayerPlan;
use crate::transport::stream::Recent;

/// Stores `src` at `to` (bytes of the decode worker's landing region or
/// pool mapped into this process) and returns `crc32c_append(crc, src)`,
/// computed on the words as they are stored ([`checksum::copy_crc`]);
/// `pool`: into the decode pool, with streaming stores
/// ([`checksum::copy_crc_streaming`]).
#[allow(unsafe_code)]
fn store_mapped(to: NonNull<u8>, src: &[u8], crc: u32, pool: bool) -> u32 {
    // SAFETY: `to` is what `RemoteKey::mapped` answered for at least
    // `src.len()` bytes inside what this reservation was granted (a landing
    // range, or one of its pool blocks; the caller asked for exactly that
    // span, or one byte of it), and the key that keeps the mapping alive is
    // held by the `Link` for as long as the connection lives. `src` is this
    // thread's own buffer and cannot overlap a shared mapping of the peer's
    // memory. No reference into the mapping is formed. Only this
    // reservation's sender is granted these bytes, and the server reads
    // them only after our `Layer` message; a peer that writes them anyway
    // changes only what it will checksum and refuse itself.
    unsafe {
        if pool {
            checksum::copy_crc_streaming(src.as_ptr(), to.as_ptr(), src.len(), crc)
        } else {
            checksum::copy_crc(src.as_ptr(), to.as_ptr(), src.len(), crc)
        }
    }
}

/// A pool block the mapping does not cover: the server granted what its own
/// pool does not hold.
fn gone_pool() -> TransferError {
    TransferError::Protocol("a granted pool block is outside the decode worker's mapped pool".into())
}

fn ucx_err(what: &str, e: ucx_sys::Error) -> TransferError {
    let kind = if e.is_peer_failure() { io::ErrorKind::ConnectionReset } else { io::ErrorKind::Other };
    TransferError::Io(io::Error::new(kind, format!("{what}: {e}")))
}

pub(super) fn link_thread(
    server: Vec<u8>,
    hello: Hello,
    layout: KvLayout,
    config: UcxSenderConfig,
    counts: Counts,
    ready: oneshot::Sender<Result<Vec<String>, TransferError>>,
    mut cmds: mpsc::Receiver<Cmd>,
) {
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            let _ = ready.send(Err(TransferError::Io(e)));
            return;
        }
    };
    rt.block_on(async move {
        let setup = || -> Result<_, TransferError> {
            let ctx = Context::new("tandem-kv-prefill").map_err(|e| ucx_err("UCX context", e))?;
            let worker = Worker::new(&ctx).map_err(|e| ucx_err("UCX worker", e))?;
            let me = worker.address().map_err(|e| ucx_err("UCX address", e))?;
            let ep = worker.connect(&server).map_err(|e| ucx_err("connecting", e))?;
            let driver = Driver::new(worker, TO_SENDER).map_err(|e| TransferError::Io(io::Error::other(e)))?;
            Ok((ctx, driver, me, ep))
        };
        let (_ctx, driver, me, ep) = match setup() {
            Ok(s) => s,
            Err(e) => {
                let _ = ready.send(Err(e));
                return;
            }
        };
        let d = &driver;
        let link = driver.run(Link::handshake(d, ep, &server, me, hello, layout, config.timeout)).await;
        let mut link = match link {
            Ok(link) => {
                let pool = if config.mapped_stores && config.direct { link.pool } else { None };
                Link { mapped_stores: config.mapped_stores, pool, counts, ..link }
            }
            Err(e) => {
                let _ = ready.send(Err(e));
                return;
            }
        };
        if ready.send(Ok(link.data.transports())).is_err() {
            driver.run(link.goodbye()).await;
            return;
        }
        driver
            .run(async {
                while let Some(cmd) = cmds.recv().await {
                    match cmd {
                        Cmd::Send { r, layer, first_block, k, v, reply } => {
                            if let Err(e) = link.deferred_failure(r) {
                                let _ = reply.send(Err(e));
                                continue;
                            }
                            match link.post_blocks(r, layer, first_block, k, v).await {
                                Ok(posted) => {
                                    // The caller goes on to its next layer while this one
                                    // is flushed and announced.
                                    let _ = reply.send(Ok(()));
                                    if let Err(e) = link.finish_blocks(posted).await {
                                        link.deferred = Some((r, e));
                                    }
                                }
                                Err(e) => {
                                    let _ = reply.send(Err(e));
                                }
                            }
                        }
                        Cmd::Complete { r, reply } => {
                            let _ = match link.deferred_failure(r) {
                                Ok(()) => reply.send(link.complete(r).await),
                                Err(e) => reply.send(Err(e)),
                            };
                        }
                        Cmd::Writer { r, reply } => {
                            let _ = match link.deferred_failure(r) {
                                Ok(()) => reply.send(link.writer(r).await),
                                Err(e) => reply.send(Err(e)),
                            };
                        }
                        Cmd::Announce { stored } => {
                            for s in stored {
                                let r = s.reservation;
                                // After a failure of `r` nothing more of it goes out; the
                                // failure waits for its next command.
                                if !matches!(&link.deferred, Some((of, _)) if *of == r) {
                                    if let Err(e) = link.announce(s).await {
                                        link.deferred = Some((r, e));
                                    }
                                }
                            }
                        }
                        Cmd::Abort { r, reason, reply } => {
                            // The caller gives up on `r` anyway: a failure of its last
                            // layer changes nothing, and the abort still fences.
                            let _ = link.deferred_failure(r);
                            let _ = reply.send(link.abort(r, reason).await);
                        }
                    }
                }
                link.goodbye().await;
            })
            .await;
    });
}

/// Where the server said a reservation's KV goes.
#[derive(Clone)]
enum Dest {
    Landing(Grant),
    /// The reservation's own pool blocks, in order.
    Pool(Vec<u32>),
}

/// What the server told us, by reservation (bounded).
#[derive(Default)]
struct Heard {
    grants: HashMap<Reservation, Dest>,
    refused: HashMap<Reservation, LandingRefusal>,
    /// Acks and aborts, as every transport's sender keeps them.
    frames: Outbound,
}

impl Heard {
    fn abort_of(&self, r: Reservation) -> Option<AbortReason> {
        self.frames.aborted(r)
    }

    fn note(&mut self, msg: Msg) {
        match msg {
            Msg::Grant(g) => {
                self.grants.insert(g.reservation, Dest::Landing(g));
            }
            Msg::Blocks { reservation, blocks } => {
                self.grants.insert(reservation, Dest::Pool(blocks));
            }
            Msg::Refused { reservation, refusal } => {
                self.refused.insert(reservation, refusal);
            }
            Msg::Frame(f @ (Frame::Abort(_) | Frame::Ack(_))) => {
                // Only Ack and Abort reach here, which on_frame takes.
                let _ = self.frames.on_frame(f);
            }
            // Anything else is not for a sender after the handshake: ignored.
            _ => {}
        }
    }
}

/// One connection, on its thread.
struct Link<'d> {
    d: &'d Driver,
    /// Control: active messages both ways, and the peer's liveness (UCX
    /// reports its failure).
    ep: Endpoint,
    /// The puts, on an endpoint without peer-failure handling so that UCX
    /// may use shared memory and CMA on one host (see
    /// [`PeerFailure::Reported`]). Its waits are bounded and end early when
    /// the control endpoint fails.
    data: Endpoint,
    /// The landing region's key, unpacked on `data`.
    key: RemoteKey,
    base: u64,
    conn: u64,
    layout: KvLayout,
    side: usize,
    timeout: Duration,
    heard: Heard,
    /// Reservations this side fenced (flushed and told the server), bounded.
    fenced: Recent<Reservation>,
    /// How finishing a layer (its flush or its completion message) failed
    /// after the caller was told the layer was posted: the next command for
    /// that reservation returns it.
    deferred: Option<(Reservation, TransferError)>,
    /// `Layer` messages of announced layers on their way, by reservation:
    /// each reservation's are complete before its `Complete` (or `Abort`,
    /// `Fenced`, `Bye`) is sent, as a layer sent by this thread is.
    announced: Vec<(Reservation, Request)>,
    /// Grants handed to direct writers, revoked before this connection says
    /// it stopped writing a reservation and when it ends: declared before
    /// `pool`, so they are revoked before the key that maps the pool drops.
    writers: Grants,
    /// The decode worker's pool, where it offered it (same host).
    pool: Option<PoolKey>,
    /// [`UcxSenderConfig::mapped_stores`].
    mapped_stores: bool,
    /// Shared with the handle.
    counts: Counts,
}

/// The decode worker's pool as offered in its `PoolKey`.
struct PoolKey {
    key: RemoteKey,
    base: u64,
    num_blocks: usize,
}

/// A layer whose bytes are on their way: what [`Link::finish_blocks`] waits
/// for and announces.
struct Posted {
    /// The K and V puts, or `None` when the layer is stored through a mapping.
    puts: Option<(Request, Request)>,
    /// The stores through a mapping, made in [`Link::finish_blocks`] (after
    /// the caller was answered, so that it prepares its next layer meanwhile).
    stores: Option<Stores>,
    header: LayerDataHeader,
}

/// One layer's K and V and where each piece of them goes in the decode
/// worker's memory mapped here: the K and V ranges of a landing range, or
/// each block's K and V in its pool blocks, in checksum order (every piece
/// of K, then of V).
struct Stores {
    k: Buffer,
    v: Buffer,
    /// (destination, whether V, offset in K or V, length).
    pieces: Vec<(NonNull<u8>, bool, usize, usize)>,
    /// Which KV this is, for the drills' fault hook.
    #[cfg_attr(not(feature = "fault-injection"), allow(dead_code))]
    layer: usize,
    #[cfg_attr(not(feature = "fault-injection"), allow(dead_code))]
    first_block: usize,
    /// Whether into pool blocks (counted as direct).
    direct: bool,
}

impl Stores {
    /// Stores every piece and returns the CRC-32C of what was stored,
    /// taken on the words as they are stored.
    #[cfg_attr(not(feature = "fault-injection"), allow(unused_mut))]
    fn run(mut self) -> u32 {
        let mut crc = 0;
        for &(to, is_v, at, len) in &self.pieces {
            let src = if is_v { &self.v[at..at + len] } else { &self.k[at..at + len] };
            crc = store_mapped(to, src, crc, self.direct);
        }
        // Drills only (built with `fault-injection` and armed): a byte flipped after the checksum.
        #[cfg(feature = "fault-injection")]
        if let Some(off) = crate::transport::fault::after_checksum(self.layer, self.first_block, &mut self.k) {
            let piece = self.pieces.iter().find(|(_, is_v, at, len)| !is_v && (*at..at + len).contains(&off));
            // One byte inside a piece's own mapped range.
            if let Some(byte) = piece.and_then(|&(to, _, at, _)| NonNull::new(to.as_ptr().wrapping_add(off - at))) {
                store_mapped(byte, &self.k[off..=off], 0, false);
            }
        }
        // The stores are complete before anything this thread sends next (the
        // `Layer` message, a fence): copies may use weakly ordered stores.
        std::sync::atomic::fence(Ordering::SeqCst);
        crc
    }
}

impl<'d> Link<'d> {
    async fn handshake(
        d: &'d Driver,
        ep: Endpoint,
        server: &[u8],
        me: Vec<u8>,
        hello: Hello,
        layout: KvLayout,
        wait: Duration,
    ) -> Result<Link<'d>, TransferError> {
        let (h, b) = Msg::Hello { addr: me, process: ProcessId::me(), frame: Frame::Hello(hello) }.encode(0);
        let sent = ep.send_am(TO_SERVER, h, b).map_err(|e| ucx_err("sending Hello", e))?;
        let answer = async {
            sent.await.map_err(|e| ucx_err("sending Hello", e))?;
            // The server sends HelloAck, PoolKey (if it offers its pool), then Key; taken
            // in any order in which UCX delivers them, all from the same connection id.
            let (mut acked, mut pool, mut key) = (None, None, None);
            loop {
                while let Some(m) = d.pop() {
                    let Ok((conn, msg)) = m else { continue };
                    match msg {
                        Msg::Frame(f @ (Frame::HelloAck(_) | Frame::HelloReject(_))) => {
                            outbound::hello_answer_frame(f)?;
                            acked = Some(conn)
                        }
                        Msg::PoolKey { base, num_blocks, rkey } => pool = Some((conn, base, num_blocks as usize, rkey)),
                        Msg::Key { base, rkey } => key = Some((conn, base, rkey)),
                        other => return Err(TransferError::Protocol(format!("{} during the handshake", other.name()))),
                    }
                }
                if let (Some(a), Some((conn, base, rkey))) = (acked, &key) {
                    if a != *conn {
                        return Err(TransferError::Protocol("HelloAck and Key for different connections".into()));
                    }
                    let pool = pool.filter(|p| p.0 == a).map(|(_, base, n, rkey)| (base, n, rkey));
                    return Ok((a, *base, rkey.clone(), pool));
                }
                if let Some(e) = ep.failure() {
                    return Err(ucx_err("the decode worker's endpoint", e));
                }
                mail(d).await;
            }
        };
        let (conn, base, rkey, pool) = timeout(wait, answer)
            .await
            .map_err(|_| TransferError::Timeout { what: "HelloAck and the landing key", after: wait })??;
        let data = d
            .worker
            .connect_with(server, PeerFailure::Unreported)
            .map_err(|e| ucx_err("connecting the put endpoint", e))?;
        let key = data.unpack_key(&rkey).map_err(|e| ucx_err("unpacking the landing key", e))?;
        // The pool is written only through a mapping (stores this thread makes,
        // so its fence covers them); a pool UCX cannot map here is not used.
        let pool = pool.and_then(|(base, num_blocks, rkey)| {
            let key = data.unpack_key(&rkey).ok()?;
            key.mapped(base, 1)?;
            Some(PoolKey { key, base, num_blocks })
        });
        let side = layout.block_elems() * layout.dtype.size();
        Ok(Link {
            d,
            ep,
            data,
            key,
            base,
            conn,
            layout,
            side,
            timeout: wait,
            heard: Heard::default(),
            fenced: Recent::default(),
            deferred: None,
            announced: Vec::new(),
            writers: Grants::default(),
            pool,
            mapped_stores: false,
            counts: Counts::default(),
        })
    }

    fn absorb(&mut self) {
        while let Some(m) = self.d.pop() {
            if let Ok((_, msg)) = m {
                self.heard.note(msg);
            }
        }
    }

    async fn message(&self, msg: &Msg, what: &'static str) -> Result<(), TransferError> {
        let (h, b) = msg.encode(self.conn);
        let req = self.ep.send_am(TO_SERVER, h, b).map_err(|e| ucx_err(what, e))?;
        self.bounded(req, what).await
    }

    /// Waits for a request, within the timeout, failing early if the
    /// control endpoint fails (the put endpoint does not report it; UCX
    /// wakes the driver on the control connection's failure, and the driver
    /// polls this again).
    async fn bounded(&self, req: Request, what: &'static str) -> Result<(), TransferError> {
        let mut req = pin!(req);
        let done = poll_fn(|cx| {
            if let Poll::Ready(r) = req.as_mut().poll(cx) {
                return Poll::Ready(r.map_err(|e| ucx_err(what, e)));
            }
            match self.ep.failure() {
                Some(e) => Poll::Ready(Err(ucx_err("the decode worker's endpoint", e))),
                None => Poll::Pending,
            }
        });
        match timeout(self.timeout, done).await {
            Ok(r) => r,
            Err(_) => Err(TransferError::Timeout { what, after: self.timeout }),
        }
    }

    /// Waits until `check` finds what it waits for in what the server sent.
    async fn until<T>(
        &mut self,
        what: &'static str,
        mut check: impl FnMut(&mut Heard) -> Option<T>,
    ) -> Result<T, TransferError> {
        let wait = self.timeout;
        let waiting = async {
            loop {
                self.absorb();
                if let Some(out) = check(&mut self.heard) {
                    return Ok(out);
                }
                if let Some(e) = self.ep.failure() {
                    return Err(ucx_err("the decode worker's endpoint", e));
                }
                mail(self.d).await;
            }
        };
        timeout(wait, waiting).await.map_err(|_| TransferError::Timeout { what, after: wait })?
    }

    /// The server aborted `r`: flush every put we started (after which none
    /// of ours can land), tell it so, and report the abort.
    async fn fenced_abort(&mut self, r: Reservation, reason: AbortReason) -> TransferError {
        if !self.fenced.contains(&r) {
            self.fenced.push(r);
            self.heard.grants.remove(&r);
            self.writers.revoke(r);
            let _ = self.settle(Some(r)).await;
            if self.flush().await.is_ok() {
                let _ = self.message(&Msg::Fenced(r), "sending Fenced").await;
            }
        }
        TransferError::PeerAbort { reason }
    }

    /// Completes every put at the decode worker (after which none of ours
    /// can land).
    async fn flush(&self) -> Result<(), TransferError> {
        let req = self.data.flush().map_err(|e| ucx_err("flushing puts", e))?;
        self.bounded(req, "flushing puts").await
    }

    async fn check_not_aborted(&mut self, r: Reservation) -> Result<(), TransferError> {
        self.absorb();
        match self.heard.abort_of(r) {
            Some(reason) => Err(self.fenced_abort(r, reason).await),
            None => Ok(()),
        }
    }

    /// [`check_not_aborted`](Self::check_not_aborted), then asks the
    /// machine whether more of `r` may go out.
    async fn may_send(&mut self, r: Reservation) -> Result<(), TransferError> {
        self.check_not_aborted(r).await?;
        self.heard.frames.layer(r)
    }

    async fn grant(&mut self, r: Reservation) -> Result<Dest, TransferError> {
        if let Some(g) = self.heard.grants.get(&r) {
            return Ok(g.clone());
        }
        let claim = if self.mapped_stores && self.pool.is_some() { Msg::ClaimDirect(r) } else { Msg::Claim(r) };
        self.message(&claim, "sending Claim").await?;
        let heard = self
            .until("a landing grant", |h| {
                if let Some(g) = h.grants.get(&r) {
                    return Some(Ok(g.clone()));
                }
                if let Some(refusal) = h.refused.remove(&r) {
                    return Some(Err(Ok(refusal)));
                }
                h.abort_of(r).map(|reason| Err(Err(reason)))
            })
            .await?;
        match heard {
            Ok(g) => Ok(g),
            Err(Ok(refusal)) => Err(TransferError::Landing { refusal }),
            Err(Err(reason)) => Err(self.fenced_abort(r, reason).await),
        }
    }

    /// The failure [`finish_blocks`](Self::finish_blocks) deferred, if it was
    /// `r`'s; one of another reservation is dropped (that caller has moved on,
    /// and a broken connection fails the new command by itself).
    fn deferred_failure(&mut self, r: Reservation) -> Result<(), TransferError> {
        match self.deferred.take() {
            Some((of, e)) if of == r => Err(e),
            _ => Ok(()),
        }
    }

    /// Checks, claims the landing range if needed, takes the checksum and
    /// posts the puts of one layer's blocks.
    async fn post_blocks(
        &mut self,
        r: Reservation,
        layer: usize,
        first_block: usize,
        k: Buffer,
        v: Buffer,
    ) -> Result<Posted, TransferError> {
        self.may_send(r).await?;
        let plan = LayerPlan::new(&self.layout, layer, &k, &v, usize::MAX)?;
        let g = match self.grant(r).await? {
            Dest::Landing(g) => g,
            Dest::Pool(blocks) => return self.store_in_pool(r, layer, first_block, plan.n_blocks, &blocks, k, v),
        };
        let (nb, side) = (g.n_blocks as usize, self.side);
        let end = first_block.checked_add(plan.n_blocks).filter(|end| *end <= nb);
        if end.is_none() {
            return Err(SplitError::TooManyBlocks { n_blocks: first_block.saturating_add(plan.n_blocks) }.into());
        }
        let layer_at = self.base + g.offset + (layer * 2 * nb * side) as u64;
        let k_at = layer_at + (first_block * side) as u64;
        let v_at = layer_at + ((nb + first_block) * side) as u64;
        let mut header = LayerDataHeader {
            reservation: r.id.0,
            generation: r.generation,
            layer: layer as u32,
            first_block: first_block as u32,
            n_blocks: plan.n_blocks as u32,
            checksum: 0,
            payload_len: k.len() + v.len(),
        };
        // Where UCX reaches the decode worker through shared memory, its landing region
        // is mapped here: store the layer with the checksum taken in the same pass (a put
        // there is the same copy, with the checksum a second pass over the bytes).
        let mapped = |at, len| self.mapped_stores.then(|| self.key.mapped(at, len)).flatten();
        if let (Some(k_to), Some(v_to)) = (mapped(k_at, k.len()), mapped(v_at, v.len())) {
            let pieces = vec![(k_to, false, 0, k.len()), (v_to, true, 0, v.len())];
            let stores = Stores { k, v, pieces, layer, first_block, direct: false };
            return Ok(Posted { puts: None, stores: Some(stores), header });
        }
        // The checksum is of exactly the bytes handed to UCX below.
        header.checksum = checksum::crc32c_append(checksum::crc32c_append(0, &k), &v);
        // Drills only (built with `fault-injection` and armed): a byte flipped after the checksum.
        #[cfg(feature = "fault-injection")]
        let k = {
            let mut k = k;
            let _ = crate::transport::fault::after_checksum(layer, first_block, &mut k);
            k
        };
        let put_k = self.data.put(k, k_at, &self.key).map_err(|e| ucx_err("putting K", e))?;
        let put_v = self.data.put(v, v_at, &self.key).map_err(|e| ucx_err("putting V", e))?;
        Ok(Posted { puts: Some((put_k, put_v)), stores: None, header })
    }

    /// Plans the stores of K and V of blocks `first_block..first_block + n`
    /// of one layer straight into the reservation's pool blocks (`blocks`,
    /// as granted), each where the decode worker's engine reads it: K of
    /// every block in order, then V, as the server checksums them in its pool.
    #[allow(clippy::too_many_arguments)]
    fn store_in_pool(
        &self,
        r: Reservation,
        layer: usize,
        first_block: usize,
        n: usize,
        blocks: &[u32],
        k: Buffer,
        v: Buffer,
    ) -> Result<Posted, TransferError> {
        let (side, pool) = (self.side, self.pool.as_ref().ok_or_else(gone_pool)?);
        let Some(ours) = first_block.checked_add(n).and_then(|end| blocks.get(first_block..end)) else {
            return Err(SplitError::TooManyBlocks { n_blocks: first_block.saturating_add(n) }.into());
        };
        if ours.iter().any(|&b| b as usize >= pool.num_blocks) {
            return Err(gone_pool());
        }
        // Runs of consecutive block ids are consecutive in the pool too: one piece each,
        // so that the copy takes the fused checksum loop over long runs.
        let runs = runs(ours.iter().enumerate().map(|(i, &b)| (i, b as usize)));
        let mut pieces = Vec::with_capacity(2 * runs.len());
        for is_v in [false, true] {
            for run in &runs {
                let at = pool.base + self.layout.pool_offset(pool.num_blocks, layer, is_v, run.to) as u64;
                let to = pool.key.mapped(at, run.len * side).ok_or_else(gone_pool)?;
                pieces.push((to, is_v, run.index * side, run.len * side));
            }
        }
        let header = LayerDataHeader {
            reservation: r.id.0,
            generation: r.generation,
            layer: layer as u32,
            first_block: first_block as u32,
            n_blocks: n as u32,
            checksum: 0,
            payload_len: k.len() + v.len(),
        };
        let stores = Stores { k, v, pieces, layer, first_block, direct: true };
        Ok(Posted { puts: None, stores: Some(stores), header })
    }

    /// Waits until a posted layer is in the decode worker's memory, then
    /// sends its completion.
    async fn finish_blocks(&mut self, mut p: Posted) -> Result<(), TransferError> {
        if let Some(stores) = p.stores {
            let direct = stores.direct;
            p.header.checksum = stores.run();
            self.counts.mapped.fetch_add(1, Ordering::Relaxed);
            if direct {
                self.counts.direct.fetch_add(1, Ordering::Relaxed);
            }
        }
        if let Some((put_k, put_v)) = p.puts {
            // The flush completes once both puts are in the decode worker's
            // memory; only then may the server copy the layer out.
            self.flush().await?;
            self.bounded(put_k, "putting K").await?;
            self.bounded(put_v, "putting V").await?;
        }
        self.message(&Msg::Layer(p.header), "sending a layer's completion").await
    }

    /// A direct writer for `r` (see [`UcxKvSender::direct_writer`]).
    #[allow(unsafe_code)]
    async fn writer(&mut self, r: Reservation) -> Result<Option<UcxDirectWriter>, TransferError> {
        self.may_send(r).await?;
        if let Some(g) = self.writers.get(r) {
            return Ok(Some(UcxDirectWriter::new(g.clone())));
        }
        if !self.mapped_stores || self.pool.is_none() {
            return Ok(None);
        }
        let Dest::Pool(blocks) = self.grant(r).await? else { return Ok(None) };
        let pool = self.pool.as_ref().ok_or_else(gone_pool)?;
        let bytes = self.layout.pool_bytes(pool.num_blocks).ok_or_else(gone_pool)?;
        // The whole pool in one piece, or no writer (the layers then go through
        // this thread's stores, block run by block run).
        let Some(at) = pool.key.mapped(pool.base, bytes) else { return Ok(None) };
        // SAFETY: `at` maps `bytes` bytes of the decode worker's pool for as long as
        // `pool.key` lives; `self.writers` revokes the grant before the key drops
        // (field order) and before any message that ends the reservation here.
        // Nothing else in this process writes the reservation's blocks while the
        // grant is live: the stores of this thread go to the blocks of layers the
        // caller hands it, and a caller hands each layer one way only.
        let grant = unsafe { writer::Grant::new(r, self.layout, at, pool.num_blocks, blocks)? };
        self.writers.push(grant.clone());
        Ok(Some(UcxDirectWriter::new(grant)))
    }

    /// Announces a layer a writer stored (see [`UcxKvSender::announce`]).
    async fn announce(&mut self, s: StoredLayer) -> Result<(), TransferError> {
        let r = s.reservation;
        self.may_send(r).await?;
        if self.writers.get(r).is_none() {
            return Err(TransferError::Revoked { reservation: r.id.0, generation: r.generation });
        }
        let header = LayerDataHeader {
            reservation: r.id.0,
            generation: r.generation,
            layer: s.layer as u32,
            first_block: s.first_block as u32,
            n_blocks: s.n_blocks as u32,
            checksum: s.checksum,
            payload_len: s.bytes,
        };
        self.counts.mapped.fetch_add(1, Ordering::Relaxed);
        self.counts.direct.fetch_add(1, Ordering::Relaxed);
        // Posted, not awaited: the next layers' messages go out meanwhile, and
        // `settle` waits for them all before the reservation's next message.
        let (h, b) = Msg::Layer(header).encode(self.conn);
        let req = self.ep.send_am(TO_SERVER, h, b).map_err(|e| ucx_err("sending a layer's completion", e))?;
        self.announced.push((r, req));
        self.reap_announced();
        Ok(())
    }

    /// Drops the announced messages that went out; one that failed becomes
    /// its reservation's deferred failure.
    fn reap_announced(&mut self) {
        let mut failed = None;
        self.announced.retain(|(r, req)| match req.poll_done() {
            None => true,
            Some(Ok(())) => false,
            Some(Err(e)) => {
                failed.get_or_insert((*r, ucx_err("sending a layer's completion", e)));
                false
            }
        });
        if let Some(f) = failed {
            self.deferred.get_or_insert(f);
        }
    }

    /// Waits until every announced `Layer` message of `r` (of every
    /// reservation: `None`) went out, each bounded as every message: after
    /// this no message of those layers is in flight from this side.
    async fn settle(&mut self, r: Option<Reservation>) -> Result<(), TransferError> {
        let (ours, rest) =
            std::mem::take(&mut self.announced).into_iter().partition(|(of, _)| r.is_none_or(|r| *of == r));
        self.announced = rest;
        let mut result = Ok(());
        for (_, req) in ours {
            let sent = self.bounded(req, "sending a layer's completion").await;
            if result.is_ok() {
                result = sent;
            }
        }
        result
    }

    async fn complete(&mut self, r: Reservation) -> Result<Ack, TransferError> {
        // Every layer's message is out before Complete follows them.
        self.settle(Some(r)).await?;
        self.check_not_aborted(r).await?;
        let complete = self.heard.frames.complete(r, &self.layout, Instant::now(), self.timeout)?;
        // Complete frees the blocks at once: no writer may store after it.
        self.writers.revoke(r);
        self.message(&Msg::Frame(complete), "sending Complete").await?;
        let heard = self
            .until("Ack", |h| {
                if h.frames.acked(r).is_some() {
                    return Some(None);
                }
                h.abort_of(r).map(Some)
            })
            .await?;
        match heard {
            None => {
                self.heard.grants.remove(&r);
                Ok(Ack { reservation: r.id.0, generation: r.generation })
            }
            Some(reason) => Err(self.fenced_abort(r, reason).await),
        }
    }

    async fn abort(&mut self, r: Reservation, reason: AbortReason) -> Result<(), TransferError> {
        self.writers.revoke(r);
        // Given up anyway: a layer message that failed changes nothing.
        let _ = self.settle(Some(r)).await;
        self.flush().await?;
        self.heard.grants.remove(&r);
        // None due when the server acknowledged or aborted it, or it was aborted already.
        let Some(abort) = self.heard.frames.abort(r, reason) else { return Ok(()) };
        self.message(&Msg::Frame(abort), "sending Abort").await
    }

    /// Flushes the puts, says `Bye`, and flushes the control endpoint so the
    /// `Bye` is at the server before it closes (best effort: a dead server
    /// needs neither).
    async fn goodbye(&mut self) {
        self.writers.revoke_all();
        let _ = self.settle(None).await;
        if self.flush().await.is_ok() && self.message(&Msg::Bye, "sending Bye").await.is_ok() {
            if let Ok(req) = self.ep.flush() {
                let _ = self.bounded(req, "flushing Bye").await;
            }
        }
    }
}
