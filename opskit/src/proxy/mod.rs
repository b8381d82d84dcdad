//! A userspace TCP fault proxy (the kernel here has no netem), for KV links, HTTP and
//! gRPC streams, and etcd links.
//!
//! A decode worker advertises the proxy as its transfer address
//! (`--advertise-transfer`), so every prefill worker's KV push crosses it.
//! Prefill workers keep one connection per destination for many transfers,
//! so a fault is armed on the byte stream, not on a connection: it strikes
//! the sender-to-receiver byte that many bytes after arming, on whichever
//! connection carries it. A [`Fault::Delay`] instead stays armed: it delays
//! every sender-to-receiver byte (latency, not a slower link: bytes queue in
//! order behind their deadline and none waits for another). The proxy counts
//! what it did, which is how a drill proves the fault happened.
//!
//! Which way the faults act is the proxy's [`Direction`]: by default on the
//! client's bytes to the upstream (a KV push), or with [`Proxy::start_replies`]
//! on the upstream's answers to the client (an HTTP response stream, a gRPC
//! token stream). The other direction is forwarded untouched.
//!
//! [`Fault::Reorder`] swaps two adjacent runs of bytes: in a byte stream,
//! reordering can only mean bytes delivered out of order. [`Fault::ResetNextAfter`]
//! picks a connection rather than a byte: the next one accepted, so that a
//! client making one connection per request has exactly that request cut.
//! [`Proxy::reset_open`] resets every connection open at that moment.
//!
//! [`Fault::Blackhole`] is a partition rather than a fault on the stream: while armed no
//! byte crosses either way on any connection, and new connections are accepted but never
//! connected upstream, so the client sees silence (not a refusal or a reset). Lifting it
//! (arming anything else) closes every connection that lost bytes, and every connection
//! accepted meanwhile, so clients reconnect cleanly instead of waiting on a stream with a
//! hole in it. Used between a process and etcd: no netem here, and a per-process link.
//!
//! [`Fault::Freeze`] is a pause rather than a loss: while armed no byte crosses either way and
//! every connection stays open; lifting it delivers what waited, in order (a partition that
//! heals before TCP gives up). [`Fault::BufferAfter`] holds one connection's bytes like
//! [`Fault::HoldAfter`] but keeps reading them, so the sender finishes writing (its KV is
//! "sent") while nothing reaches the receiver until [`Proxy::release`].
//!
//! A [`Proxy`] is a cheap handle: clones share one proxy, which stops when the last is dropped.

use std::collections::{HashMap, HashSet};
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;
use tokio::time::Instant;

use crate::{Error, Result};
use types::rng::XorShift64;

/// What the proxy does next to the sender's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Fault {
    /// Forward untouched.
    None,
    /// XOR with 0xFF the byte this many bytes after arming.
    FlipAfter(usize),
    /// Forward this many more bytes, then hold the connection that carries the next one:
    /// nothing more is read from it or forwarded until [`Proxy::release`].
    HoldAfter(usize),
    /// Forward this many more bytes, then keep reading the connection that carries the next
    /// one but hold back all it sends (counted in [`ProxyCounters::buffered_bytes`]) until
    /// [`Proxy::release`]; then forward it all, even if the sender has gone meanwhile.
    BufferAfter(usize),
    /// Forward this many more bytes, then reset the connection that carries the next one:
    /// both ends get an RST (SO_LINGER 0), not a FIN.
    ResetAfter(usize),
    /// Delay every sender-to-receiver byte by `base` ± up to `jitter` (uniform), in order,
    /// until another fault is armed.
    Delay { base: Duration, jitter: Duration },
    /// The `len` bytes starting `after` bytes from arming trade places with the `len` bytes
    /// that follow them (one swap, counted in [`ProxyCounters::swaps`]), on whichever
    /// connection carries them. A sender that pauses meanwhile (it waits for an answer)
    /// gets what was held delivered after [`REORDER_WAIT`], still swapped.
    Reorder { after: usize, len: usize },
    /// The next connection accepted from now on forwards this many bytes, then is reset
    /// (both ends get an RST); one connection per arming.
    ResetNextAfter(usize),
    /// A partition, until another fault (e.g. [`Fault::None`]) is armed: bytes either way
    /// are read and dropped, new connections are accepted and never connected upstream.
    /// Lifting it closes the connections that lost bytes and those accepted meanwhile.
    Blackhole,
    /// A pause, until another fault is armed: no byte crosses either way on any connection,
    /// and every connection stays open (peers see silence, not a refusal or a reset). What
    /// was read meanwhile is delivered after, in order. New connections are accepted and
    /// connected upstream, and wait too.
    Freeze,
}

/// What the proxy has done so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ProxyCounters {
    /// Connections accepted.
    pub connections: u64,
    /// Sender-to-receiver bytes forwarded.
    pub bytes_forwarded: u64,
    /// Bytes flipped.
    pub flips: u64,
    /// Connections held.
    pub holds: u64,
    /// The sender's address (its local end) of the connection held last.
    pub held_peer: Option<SocketAddr>,
    /// Connections buffered ([`Fault::BufferAfter`]), and the bytes held back behind the
    /// buffer before [`Proxy::release`].
    pub buffers: u64,
    pub buffered_bytes: u64,
    /// Connections reset (by [`Fault::ResetAfter`], [`Fault::ResetNextAfter`] or
    /// [`Proxy::reset_open`]).
    pub resets: u64,
    /// Adjacent runs of bytes swapped ([`Fault::Reorder`]), and the bytes they moved.
    pub swaps: u64,
    pub swapped_bytes: u64,
    /// Chunks delayed, and the longest and shortest delay given (ms).
    pub delayed_chunks: u64,
    pub max_delay_ms: u64,
    pub min_delay_ms: Option<u64>,
    /// Sender-to-receiver bytes a blackhole dropped (including those sent on connections
    /// accepted during it).
    pub blackholed_bytes: u64,
    /// Receiver-to-sender bytes a blackhole dropped.
    pub blackholed_reply_bytes: u64,
    /// Connections accepted during a blackhole (never connected upstream).
    pub blackholed_connections: u64,
    /// Connections closed when a blackhole was lifted.
    pub blackhole_closed: u64,
    /// Chunks (either way) that waited for a freeze to be lifted.
    pub frozen_chunks: u64,
}

/// Which bytes the armed fault acts on; the other direction is forwarded untouched.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Direction {
    /// The client's bytes to the upstream (requests, a KV push).
    Requests,
    /// The upstream's bytes to the client (responses, a token stream).
    Replies,
}

/// How long a [`Fault::Reorder`] holds bytes for a sender that paused before the swap was whole.
pub const REORDER_WAIT: Duration = Duration::from_millis(200);

/// One connection's sockets, and whether it was reset (then it is not closed gracefully).
#[derive(Debug)]
struct Live {
    socks: [TcpStream; 2],
    reset: Arc<AtomicBool>,
}

#[derive(Debug)]
struct State {
    armed: Fault,
    counters: ProxyCounters,
    held_conn: Option<u64>,
    released: bool,
    stopped: bool,
    /// The delay's jitter.
    rng: XorShift64,
    /// Bytes held back by the [`Fault::BufferAfter`] armed last (0 until it strikes).
    buffered_now: u64,
    /// Both sockets of every connection being forwarded, to close those a blackhole hit.
    live: HashMap<u64, Live>,
    /// Connections that lost bytes to the blackhole armed now.
    tainted: HashSet<u64>,
    /// Connections accepted during the blackhole armed now.
    pending: Vec<TcpStream>,
}

impl State {
    /// Lifts a blackhole: closes the connections it hit and those it accepted.
    fn lift(&mut self) {
        let mut closed = 0;
        for id in std::mem::take(&mut self.tainted) {
            if let Some(l) = self.live.remove(&id) {
                for s in &l.socks {
                    let _ = s.shutdown(Shutdown::Both);
                }
                closed += 1;
            }
        }
        for s in std::mem::take(&mut self.pending) {
            let _ = s.shutdown(Shutdown::Both);
            closed += 1;
        }
        self.counters.blackhole_closed += closed;
    }
}

type Shared = Arc<(Mutex<State>, Condvar)>;

fn lock(s: &Shared) -> MutexGuard<'_, State> {
    s.0.lock().unwrap_or_else(|e| e.into_inner())
}

/// A loopback proxy in front of `upstream`; stops (and lets go of held connections) when its
/// last clone is dropped.
#[derive(Debug, Clone)]
pub struct Proxy {
    pub addr: SocketAddr,
    pub upstream: SocketAddr,
    /// Which way its faults act.
    pub direction: Direction,
    state: Shared,
    _stop: Arc<StopOnDrop>,
}

/// Stops the proxy when the last [`Proxy`] handle goes.
#[derive(Debug)]
struct StopOnDrop {
    addr: SocketAddr,
    state: Shared,
}

impl Proxy {
    /// A loopback proxy whose faults act on the client's bytes ([`Direction::Requests`]).
    pub fn start(upstream: SocketAddr) -> Result<Self> {
        Self::start_on(std::net::Ipv4Addr::LOCALHOST.into(), upstream)
    }

    /// A loopback proxy whose faults act on the upstream's answers ([`Direction::Replies`]).
    pub fn start_replies(upstream: SocketAddr) -> Result<Self> {
        Self::start_with(std::net::Ipv4Addr::LOCALHOST.into(), upstream, Direction::Replies)
    }

    /// A proxy listening on `bind_ip` (any free port), e.g. a namespace's gateway
    /// address, so processes inside a network namespace reach a host-loopback `upstream`.
    pub fn start_on(bind_ip: std::net::IpAddr, upstream: SocketAddr) -> Result<Self> {
        Self::start_with(bind_ip, upstream, Direction::Requests)
    }

    /// A proxy whose sockets live in the network namespace `netns` (a bind mount such as
    /// `/run/netns/NAME`, or `/proc/PID/ns/net`): it listens on `bind_ip` (any free port)
    /// there and connects to `upstream` from there, so a rule inside the namespace (an
    /// iptables REDIRECT of a worker's own port) can pass the worker's traffic through it.
    /// Its accept thread joins the namespace; no other thread of this process does. Stopping
    /// it wakes that thread through `bind_ip`, which the caller's namespace must reach.
    pub fn start_in_netns(netns: &std::path::Path, bind_ip: std::net::IpAddr, upstream: SocketAddr) -> Result<Self> {
        Self::start_with_in(Some(netns.to_owned()), bind_ip, upstream, Direction::Requests)
    }

    fn start_with(bind_ip: std::net::IpAddr, upstream: SocketAddr, direction: Direction) -> Result<Self> {
        Self::start_with_in(None, bind_ip, upstream, direction)
    }

    fn start_with_in(
        netns: Option<std::path::PathBuf>,
        bind_ip: std::net::IpAddr,
        upstream: SocketAddr,
        direction: Direction,
    ) -> Result<Self> {
        let state: Shared = Arc::new((
            Mutex::new(State {
                armed: Fault::None,
                counters: ProxyCounters::default(),
                held_conn: None,
                released: false,
                stopped: false,
                rng: XorShift64::new(0x9E37_79B9_7F4A_7C15),
                buffered_now: 0,
                live: HashMap::new(),
                tainted: HashSet::new(),
                pending: Vec::new(),
            }),
            Condvar::new(),
        ));
        // The accept thread makes every socket the proxy owns (the listener, each upstream
        // connection), so it alone joins the namespace; it reports the bound listener back.
        let (bound_tx, bound_rx) = mpsc::channel();
        let st = state.clone();
        std::thread::spawn(move || {
            let listener = (|| {
                if let Some(path) = &netns {
                    let ns =
                        std::fs::File::open(path).map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
                    rustix::thread::move_into_link_name_space(
                        std::os::fd::AsFd::as_fd(&ns),
                        Some(rustix::thread::LinkNameSpaceType::Network),
                    )
                    .map_err(|e| Error::io(format!("joining network namespace {}", path.display()), e.into()))?;
                }
                let l = TcpListener::bind(SocketAddr::new(bind_ip, 0))
                    .map_err(|e| Error::io(format!("proxy bind {bind_ip}"), e))?;
                let addr = l.local_addr().map_err(|e| Error::io("proxy addr", e))?;
                Ok::<_, Error>((l, addr))
            })();
            match listener {
                Ok((l, addr)) => {
                    let _ = bound_tx.send(Ok(addr));
                    accept_loop(&l, upstream, direction, &st);
                }
                Err(e) => {
                    let _ = bound_tx.send(Err(e));
                }
            }
        });
        let addr = bound_rx.recv().map_err(|_| {
            Error::io("proxy accept thread", std::io::Error::other("it ended before binding its listener"))
        })??;
        let stop = Arc::new(StopOnDrop { addr, state: state.clone() });
        Ok(Self { addr, upstream, direction, state, _stop: stop })
    }

    /// Resets every connection open now (both ends get an RST); how many.
    pub fn reset_open(&self) -> u64 {
        let mut s = lock(&self.state);
        let open: Vec<Live> = std::mem::take(&mut s.live).into_values().collect();
        for l in &open {
            l.reset.store(true, Ordering::SeqCst);
            for sock in &l.socks {
                abort(sock);
            }
        }
        s.counters.resets += open.len() as u64;
        open.len() as u64
    }

    /// Arms `fault` on the stream from now on (replacing one not yet struck). Arming
    /// anything but [`Fault::Blackhole`] while a blackhole is armed lifts it.
    pub fn arm(&self, fault: Fault) {
        let mut s = lock(&self.state);
        let lifting = s.armed == Fault::Blackhole && fault != Fault::Blackhole;
        s.armed = fault;
        if matches!(fault, Fault::BufferAfter(_)) {
            s.buffered_now = 0;
        }
        if lifting {
            s.lift();
        }
        // Wakes what a freeze stopped.
        self.state.1.notify_all();
    }

    pub fn counters(&self) -> ProxyCounters {
        lock(&self.state).counters
    }

    /// Waits until a connection is held; its sender's address.
    pub fn wait_held(&self, limit: Duration) -> Result<SocketAddr> {
        let (m, cv) = &*self.state;
        let guard = m.lock().unwrap_or_else(|e| e.into_inner());
        let (s, _) =
            cv.wait_timeout_while(guard, limit, |s| s.counters.held_peer.is_none()).unwrap_or_else(|e| e.into_inner());
        s.counters.held_peer.ok_or_else(|| Error::Timeout(format!("the proxy held no connection within {limit:?}")))
    }

    /// Waits until the [`Fault::BufferAfter`] armed last holds back at least `bytes` (bytes
    /// an earlier one held do not count).
    pub fn wait_buffered(&self, bytes: u64, limit: Duration) -> Result<()> {
        let (m, cv) = &*self.state;
        let guard = m.lock().unwrap_or_else(|e| e.into_inner());
        let (s, _) = cv.wait_timeout_while(guard, limit, |s| s.buffered_now < bytes).unwrap_or_else(|e| e.into_inner());
        if s.buffered_now >= bytes {
            Ok(())
        } else {
            Err(Error::Timeout(format!(
                "the proxy's last buffer held back {} bytes, not {bytes}, within {limit:?}",
                s.buffered_now
            )))
        }
    }

    /// Lets a held connection go on.
    pub fn release(&self) {
        lock(&self.state).released = true;
        self.state.1.notify_all();
    }
}

/// Accepts connections on `listener` and forwards each to `upstream` until the proxy stops.
fn accept_loop(listener: &TcpListener, upstream: SocketAddr, direction: Direction, st: &Shared) {
    for (id, conn) in (0u64..).zip(listener.incoming()) {
        if lock(st).stopped {
            return;
        }
        let Ok(down) = conn else { continue };
        {
            let mut s = lock(st);
            if s.armed == Fault::Blackhole {
                let Ok(keep) = down.try_clone() else { continue };
                s.pending.push(keep);
                s.counters.blackholed_connections += 1;
                let st2 = st.clone();
                std::thread::spawn(move || swallow(down, &st2));
                continue;
            }
        }
        let Ok(up) = TcpStream::connect(upstream) else { continue };
        let (Ok(down2), Ok(up2), Ok(down3), Ok(up3)) =
            (down.try_clone(), up.try_clone(), down.try_clone(), up.try_clone())
        else {
            continue;
        };
        let reset = Arc::new(AtomicBool::new(false));
        let reset_next = {
            let mut s = lock(st);
            s.counters.connections += 1;
            s.live.insert(id, Live { socks: [down3, up3], reset: reset.clone() });
            match s.armed {
                Fault::ResetNextAfter(k) => {
                    s.armed = Fault::None;
                    Some(k)
                }
                _ => None,
            }
        };
        let peer = down.peer_addr().ok();
        let (st2, st3) = (st.clone(), st.clone());
        let reset2 = reset.clone();
        let (sender, receiver, back_from, back_to) = match direction {
            Direction::Requests => (down, up, up2, down2),
            Direction::Replies => (up, down, down2, up2),
        };
        std::thread::spawn(move || forward(sender, receiver, id, peer, reset_next, &st2, &reset));
        std::thread::spawn(move || plain(back_from, back_to, id, &st3, &reset2));
    }
}

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        {
            let mut s = lock(&self.state);
            s.stopped = true;
            for c in std::mem::take(&mut s.pending) {
                let _ = c.shutdown(Shutdown::Both);
            }
        }
        self.state.1.notify_all();
        // Wakes the accept loop so it sees `stopped`.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
    }
}

/// A [`Fault::Reorder`] under way on one connection: the first run of bytes held,
/// then the second gathered, until both are whole (or the sender pauses).
struct Swap {
    len: usize,
    first: Vec<u8>,
    second: Vec<u8>,
}

impl Swap {
    /// Takes what of `bytes` the swap still needs; the rest is returned to pass on.
    fn take<'b>(&mut self, bytes: &'b [u8]) -> &'b [u8] {
        let mut rest = bytes;
        for run in [&mut self.first, &mut self.second] {
            let k = (self.len - run.len()).min(rest.len());
            run.extend_from_slice(&rest[..k]);
            rest = &rest[k..];
        }
        rest
    }

    fn whole(&self) -> bool {
        self.second.len() == self.len
    }

    /// The held bytes, second run first; counts a swap when there was a second run.
    fn deliver(self, st: &Shared) -> Vec<u8> {
        let mut s = lock(st);
        if !self.second.is_empty() {
            s.counters.swaps += 1;
            s.counters.swapped_bytes += (self.first.len() + self.second.len()) as u64;
        }
        s.counters.bytes_forwarded += (self.first.len() + self.second.len()) as u64;
        drop(s);
        let mut out = self.second;
        out.extend_from_slice(&self.first);
        out
    }
}

/// Sender to receiver, with the armed fault applied (and `reset_next`, a
/// [`Fault::ResetNextAfter`] this connection took when it was accepted). A writer
/// thread sends each chunk at its deadline (now, unless a delay is armed).
fn forward(
    mut from: TcpStream,
    to: TcpStream,
    id: u64,
    peer: Option<SocketAddr>,
    mut reset_next: Option<usize>,
    st: &Shared,
    reset: &AtomicBool,
) {
    let Ok(to_ctl) = to.try_clone() else { return };
    let (tx, rx) = mpsc::channel::<Out>();
    let gate = st.clone();
    let writer = std::thread::spawn(move || write_at_deadlines(to, &rx, &gate));
    let mut buf = vec![0u8; 64 << 10];
    // Deadlines never go backwards, so jitter cannot reorder bytes.
    let mut last_due = Instant::now();
    let mut swap: Option<Swap> = None;
    // This connection's bytes wait behind a gate ([`Fault::BufferAfter`]).
    let mut buffering = false;
    loop {
        // While a swap waits for its second run, a pausing sender does not stall it forever.
        let _ = from.set_read_timeout(swap.as_ref().map(|_| REORDER_WAIT));
        let n = match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                if let Some(sw) = swap.take() {
                    if tx.send(Out::Bytes(last_due.max(Instant::now()), sw.deliver(st))).is_err() {
                        break;
                    }
                }
                continue;
            }
            Err(_) => break,
        };
        if reset.load(Ordering::SeqCst) {
            break;
        }
        let swapping = swap.is_some();
        let mut start = 0;
        let mut pass = n;
        let mut reset_now = false;
        let mut delay = Duration::ZERO;
        let mut dropped = false;
        let mut gate_now = false;
        {
            let mut s = lock(st);
            if s.armed == Fault::Freeze {
                s.counters.frozen_chunks += 1;
                s = st.1.wait_while(s, |s| s.armed == Fault::Freeze && !s.stopped).unwrap_or_else(|e| e.into_inner());
                if s.stopped {
                    break;
                }
            }
            // This connection's bytes wait behind a gate not yet released.
            let held = buffering && !s.released;
            match reset_next {
                Some(k) if k < n => {
                    pass = k;
                    reset_now = true;
                    s.counters.resets += 1;
                }
                Some(k) => reset_next = Some(k - n),
                None => {}
            }
            match s.armed {
                _ if reset_now => {}
                Fault::FlipAfter(k) if k < n => {
                    buf[k] ^= 0xFF;
                    s.counters.flips += 1;
                    s.armed = Fault::None;
                }
                Fault::FlipAfter(k) => s.armed = Fault::FlipAfter(k - n),
                Fault::HoldAfter(k) if k < n => {
                    pass = k;
                    s.armed = Fault::None;
                    s.held_conn = Some(id);
                    s.released = false;
                    s.counters.holds += 1;
                    s.counters.held_peer = peer;
                    st.1.notify_all();
                }
                Fault::HoldAfter(k) => s.armed = Fault::HoldAfter(k - n),
                Fault::BufferAfter(k) if k < n && !held => {
                    pass = k;
                    gate_now = true;
                    buffering = true;
                    s.armed = Fault::None;
                    s.released = false;
                    s.counters.buffers += 1;
                }
                Fault::BufferAfter(k) if !held => s.armed = Fault::BufferAfter(k - n),
                Fault::ResetAfter(k) if k < n => {
                    pass = k;
                    reset_now = true;
                    s.armed = Fault::None;
                    s.counters.resets += 1;
                }
                Fault::ResetAfter(k) => s.armed = Fault::ResetAfter(k - n),
                Fault::Reorder { after, len } if after < n && swap.is_none() && len > 0 => {
                    s.armed = Fault::None;
                    swap = Some(Swap { len, first: Vec::with_capacity(len), second: Vec::with_capacity(len) });
                    pass = after;
                }
                Fault::Reorder { after, len } if swap.is_none() => s.armed = Fault::Reorder { after: after - n, len },
                Fault::Delay { base, jitter } => {
                    delay = jittered(&mut s.rng, base, jitter);
                    let ms = delay.as_millis() as u64;
                    s.counters.delayed_chunks += 1;
                    s.counters.max_delay_ms = s.counters.max_delay_ms.max(ms);
                    s.counters.min_delay_ms = Some(s.counters.min_delay_ms.map_or(ms, |m| m.min(ms)));
                }
                Fault::Blackhole => {
                    pass = 0;
                    dropped = true;
                    s.counters.blackholed_bytes += n as u64;
                    s.tainted.insert(id);
                }
                _ => {}
            }
            if swap.is_some() && !reset_now {
                // Bytes before the swap's start go on; the swap takes what it needs of the rest.
                start = if swapping { 0 } else { pass };
                pass = n;
                s.counters.bytes_forwarded += start as u64;
            } else if gate_now {
                s.counters.bytes_forwarded += pass as u64;
                s.counters.buffered_bytes += (n - pass) as u64;
                s.buffered_now += (n - pass) as u64;
                st.1.notify_all();
            } else if buffering && !s.released {
                // Queued behind the gate.
                s.counters.buffered_bytes += pass as u64;
                s.buffered_now += pass as u64;
                st.1.notify_all();
            } else {
                s.counters.bytes_forwarded += pass as u64;
            }
        }
        last_due = last_due.max(Instant::now() + delay);
        if let Some(sw) = swap.as_mut().filter(|_| !reset_now) {
            // Before the swap, after it: what came in this read, in the order it leaves.
            let before = &buf[..start];
            let rest = sw.take(&buf[start..n]);
            let mut out = before.to_vec();
            if sw.whole() {
                if let Some(sw) = swap.take() {
                    out.extend(sw.deliver(st));
                }
                lock(st).counters.bytes_forwarded += rest.len() as u64;
                out.extend_from_slice(rest);
            }
            if !out.is_empty() && tx.send(Out::Bytes(last_due, out)).is_err() {
                break;
            }
            continue;
        }
        if pass > 0 && tx.send(Out::Bytes(last_due, buf[..pass].to_vec())).is_err() {
            break;
        }
        if gate_now {
            // The rest of this read, and all that follows, waits in the writer's queue.
            if tx.send(Out::Gate).is_err() || tx.send(Out::Bytes(last_due, buf[pass..n].to_vec())).is_err() {
                break;
            }
            continue;
        }
        if reset_now {
            reset.store(true, Ordering::SeqCst);
            abort(&from);
            abort(&to_ctl);
            break;
        }
        if pass < n && !dropped {
            let (m, cv) = &**st;
            let guard = m.lock().unwrap_or_else(|e| e.into_inner());
            let guard = cv.wait_while(guard, |s| !s.released && !s.stopped).unwrap_or_else(|e| e.into_inner());
            let go_on = !guard.stopped;
            drop(guard);
            if !go_on || tx.send(Out::Bytes(Instant::now(), buf[pass..n].to_vec())).is_err() {
                break;
            }
        }
    }
    if let Some(sw) = swap.take().filter(|_| !reset.load(Ordering::SeqCst)) {
        let _ = tx.send(Out::Bytes(last_due, sw.deliver(st)));
    }
    drop(tx);
    let _ = writer.join();
    lock(st).live.remove(&id);
    if !reset.load(Ordering::SeqCst) {
        let _ = to_ctl.shutdown(Shutdown::Write);
        let _ = from.shutdown(Shutdown::Both);
    }
}

/// What the reading side of [`forward`] hands its writer.
enum Out {
    /// Bytes to write no earlier than the instant.
    Bytes(Instant, Vec<u8>),
    /// Write nothing more until [`Proxy::release`] ([`Fault::BufferAfter`]).
    Gate,
}

/// Writes each chunk no earlier than its deadline, and nothing past a gate before the
/// release; ends when the sender side ends (or at a gate, when the proxy stops).
fn write_at_deadlines(mut to: TcpStream, rx: &mpsc::Receiver<Out>, st: &Shared) {
    while let Ok(out) = rx.recv() {
        let (due, bytes) = match out {
            Out::Bytes(due, bytes) => (due, bytes),
            Out::Gate => {
                let s = st.1.wait_while(lock(st), |s| !s.released && !s.stopped).unwrap_or_else(|e| e.into_inner());
                if s.stopped {
                    return;
                }
                continue;
            }
        };
        let now = Instant::now();
        if due > now {
            std::thread::sleep(due - now);
        }
        if to.write_all(&bytes).is_err() {
            return;
        }
    }
}

/// `base` ± a uniform draw up to `jitter`, never below zero.
fn jittered(rng: &mut XorShift64, base: Duration, jitter: Duration) -> Duration {
    // Enough to spread delays; the drill checks the spread it got.
    let draw = rng.next_u64();
    let j = jitter.as_micros() as i128;
    if j == 0 {
        return base;
    }
    let offset = (draw % (2 * j as u64 + 1)) as i128 - j;
    Duration::from_micros((base.as_micros() as i128 + offset).max(0) as u64)
}

/// Makes the socket's last close send an RST, and wakes every reader of it.
fn abort(s: &TcpStream) {
    let _ = socket2::SockRef::from(s).set_linger(Some(Duration::ZERO));
    let _ = s.shutdown(Shutdown::Read);
}

/// Reads a connection accepted during a blackhole until it is closed, dropping every byte.
fn swallow(mut from: TcpStream, st: &Shared) {
    let mut buf = vec![0u8; 16 << 10];
    while let Ok(n) = from.read(&mut buf) {
        if n == 0 {
            break;
        }
        lock(st).counters.blackholed_bytes += n as u64;
    }
}

/// Receiver to sender, untouched unless a blackhole is armed.
fn plain(mut from: TcpStream, mut to: TcpStream, id: u64, st: &Shared, reset: &AtomicBool) {
    let mut buf = vec![0u8; 16 << 10];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        {
            let mut s = lock(st);
            if s.armed == Fault::Freeze {
                s.counters.frozen_chunks += 1;
                s = st.1.wait_while(s, |s| s.armed == Fault::Freeze && !s.stopped).unwrap_or_else(|e| e.into_inner());
                if s.stopped {
                    break;
                }
            }
            if s.armed == Fault::Blackhole {
                s.counters.blackholed_reply_bytes += n as u64;
                s.tainted.insert(id);
                continue;
            }
        }
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    if !reset.load(Ordering::SeqCst) {
        let _ = to.shutdown(Shutdown::Write);
    }
}

#[cfg(test)]
mod tests;
