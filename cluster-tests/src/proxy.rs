//! A userspace TCP fault proxy for KV links (the kernel here has no netem).
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
//! [`Fault::Blackhole`] is a partition rather than a fault on the stream: while armed no
//! byte crosses either way on any connection, and new connections are accepted but never
//! connected upstream, so the client sees silence (not a refusal or a reset). Lifting it
//! (arming anything else) closes every connection that lost bytes, and every connection
//! accepted meanwhile, so clients reconnect cleanly instead of waiting on a stream with a
//! hole in it. Used between a process and etcd: no netem here, and a per-process link.

use std::collections::{HashMap, HashSet};
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::HarnessError;

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
    /// Forward this many more bytes, then reset the connection that carries the next one:
    /// both ends get an RST (SO_LINGER 0), not a FIN.
    ResetAfter(usize),
    /// Delay every sender-to-receiver byte by `base` ± up to `jitter` (uniform), in order,
    /// until another fault is armed.
    Delay { base: Duration, jitter: Duration },
    /// A partition, until another fault (e.g. [`Fault::None`]) is armed: bytes either way
    /// are read and dropped, new connections are accepted and never connected upstream.
    /// Lifting it closes the connections that lost bytes and those accepted meanwhile.
    Blackhole,
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
    /// Connections reset.
    pub resets: u64,
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
}

#[derive(Debug)]
struct State {
    armed: Fault,
    counters: ProxyCounters,
    held_conn: Option<u64>,
    released: bool,
    stopped: bool,
    /// xorshift state for the delay's jitter.
    rng: u64,
    /// Both sockets of every connection being forwarded, to close those a blackhole hit.
    live: HashMap<u64, [TcpStream; 2]>,
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
            if let Some(socks) = self.live.remove(&id) {
                for s in &socks {
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

/// A loopback proxy in front of `upstream`; stops (and lets go of held connections) when dropped.
#[derive(Debug)]
pub struct Proxy {
    pub addr: SocketAddr,
    pub upstream: SocketAddr,
    state: Shared,
}

impl Proxy {
    pub fn start(upstream: SocketAddr) -> Result<Self, HarnessError> {
        Self::start_on(std::net::Ipv4Addr::LOCALHOST.into(), upstream)
    }

    /// A proxy listening on `bind_ip` (any free port), e.g. a namespace's gateway
    /// address, so processes inside a [`crate::Netns`] reach a host-loopback `upstream`.
    pub fn start_on(bind_ip: std::net::IpAddr, upstream: SocketAddr) -> Result<Self, HarnessError> {
        let listener = TcpListener::bind(SocketAddr::new(bind_ip, 0))
            .map_err(|e| HarnessError::Setup(format!("proxy bind {bind_ip}: {e}")))?;
        let addr = listener.local_addr().map_err(|e| HarnessError::Setup(format!("proxy addr: {e}")))?;
        let state: Shared = Arc::new((
            Mutex::new(State {
                armed: Fault::None,
                counters: ProxyCounters::default(),
                held_conn: None,
                released: false,
                stopped: false,
                rng: 0x9E37_79B9_7F4A_7C15,
                live: HashMap::new(),
                tainted: HashSet::new(),
                pending: Vec::new(),
            }),
            Condvar::new(),
        ));
        let st = state.clone();
        std::thread::spawn(move || {
            for (id, conn) in (0u64..).zip(listener.incoming()) {
                if lock(&st).stopped {
                    return;
                }
                let Ok(down) = conn else { continue };
                {
                    let mut s = lock(&st);
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
                {
                    let mut s = lock(&st);
                    s.counters.connections += 1;
                    s.live.insert(id, [down3, up3]);
                }
                let peer = down.peer_addr().ok();
                let (st2, st3) = (st.clone(), st.clone());
                let reset = Arc::new(AtomicBool::new(false));
                let reset2 = reset.clone();
                std::thread::spawn(move || forward(down, up, id, peer, &st2, &reset));
                std::thread::spawn(move || plain(up2, down2, id, &st3, &reset2));
            }
        });
        Ok(Self { addr, upstream, state })
    }

    /// Arms `fault` on the stream from now on (replacing one not yet struck). Arming
    /// anything but [`Fault::Blackhole`] while a blackhole is armed lifts it.
    pub fn arm(&self, fault: Fault) {
        let mut s = lock(&self.state);
        let lifting = s.armed == Fault::Blackhole && fault != Fault::Blackhole;
        s.armed = fault;
        if lifting {
            s.lift();
        }
    }

    pub fn counters(&self) -> ProxyCounters {
        lock(&self.state).counters
    }

    /// Waits until a connection is held; its sender's address.
    pub fn wait_held(&self, limit: Duration) -> Result<SocketAddr, HarnessError> {
        let (m, cv) = &*self.state;
        let guard = m.lock().unwrap_or_else(|e| e.into_inner());
        let (s, _) =
            cv.wait_timeout_while(guard, limit, |s| s.counters.held_peer.is_none()).unwrap_or_else(|e| e.into_inner());
        s.counters
            .held_peer
            .ok_or_else(|| HarnessError::Timeout(format!("the proxy held no KV connection within {limit:?}")))
    }

    /// Lets a held connection go on.
    pub fn release(&self) {
        lock(&self.state).released = true;
        self.state.1.notify_all();
    }
}

impl Drop for Proxy {
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

/// Sender to receiver, with the armed fault applied. A writer thread sends
/// each chunk at its deadline (now, unless a delay is armed).
fn forward(mut from: TcpStream, to: TcpStream, id: u64, peer: Option<SocketAddr>, st: &Shared, reset: &AtomicBool) {
    let Ok(to_ctl) = to.try_clone() else { return };
    let (tx, rx) = mpsc::channel::<(Instant, Vec<u8>)>();
    let writer = std::thread::spawn(move || write_at_deadlines(to, &rx));
    let mut buf = vec![0u8; 64 << 10];
    // Deadlines never go backwards, so jitter cannot reorder bytes.
    let mut last_due = Instant::now();
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let mut pass = n;
        let mut reset_now = false;
        let mut delay = Duration::ZERO;
        let mut dropped = false;
        {
            let mut s = lock(st);
            match s.armed {
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
                Fault::ResetAfter(k) if k < n => {
                    pass = k;
                    reset_now = true;
                    s.armed = Fault::None;
                    s.counters.resets += 1;
                }
                Fault::ResetAfter(k) => s.armed = Fault::ResetAfter(k - n),
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
                Fault::None => {}
            }
            s.counters.bytes_forwarded += pass as u64;
        }
        last_due = last_due.max(Instant::now() + delay);
        if pass > 0 && tx.send((last_due, buf[..pass].to_vec())).is_err() {
            break;
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
            if !go_on || tx.send((Instant::now(), buf[pass..n].to_vec())).is_err() {
                break;
            }
        }
    }
    drop(tx);
    let _ = writer.join();
    lock(st).live.remove(&id);
    if !reset.load(Ordering::SeqCst) {
        let _ = to_ctl.shutdown(Shutdown::Write);
        let _ = from.shutdown(Shutdown::Both);
    }
}

/// Writes each chunk no earlier than its deadline; ends when the sender side ends.
fn write_at_deadlines(mut to: TcpStream, rx: &mpsc::Receiver<(Instant, Vec<u8>)>) {
    while let Ok((due, bytes)) = rx.recv() {
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
fn jittered(rng: &mut u64, base: Duration, jitter: Duration) -> Duration {
    // xorshift64: enough to spread delays; the drill checks the spread it got.
    *rng ^= *rng << 13;
    *rng ^= *rng >> 7;
    *rng ^= *rng << 17;
    let j = jitter.as_micros() as i128;
    if j == 0 {
        return base;
    }
    let offset = (*rng % (2 * j as u64 + 1)) as i128 - j;
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
mod tests {
    use super::*;

    /// An upstream that echoes what it reads, on a thread per connection.
    fn echo() -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr");
        std::thread::spawn(move || {
            for c in l.incoming() {
                let Ok(mut c) = c else { return };
                std::thread::spawn(move || {
                    let mut buf = [0u8; 4096];
                    while let Ok(n) = c.read(&mut buf) {
                        if n == 0 || c.write_all(&buf[..n]).is_err() {
                            return;
                        }
                    }
                });
            }
        });
        addr
    }

    fn client(p: &Proxy) -> TcpStream {
        let c = TcpStream::connect(p.addr).expect("connect");
        c.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        c
    }

    #[test]
    fn a_delay_holds_every_byte_back_and_keeps_order() {
        let p = Proxy::start(echo()).expect("proxy");
        let mut c = client(&p);
        p.arm(Fault::Delay { base: Duration::from_millis(80), jitter: Duration::from_millis(40) });
        let t0 = Instant::now();
        let mut got = Vec::new();
        for i in 0u8..5 {
            c.write_all(&[i]).expect("write");
            let mut b = [0u8; 1];
            c.read_exact(&mut b).expect("read");
            got.push(b[0]);
        }
        // Five round trips, each delayed at least base - jitter on the way up.
        assert!(t0.elapsed() >= Duration::from_millis(5 * 40), "{:?}", t0.elapsed());
        assert_eq!(got, [0, 1, 2, 3, 4]);
        let k = p.counters();
        assert_eq!(k.delayed_chunks, 5);
        assert!(k.min_delay_ms.is_some_and(|m| m >= 40) && k.max_delay_ms <= 120, "{k:?}");
        p.arm(Fault::None);
        c.write_all(b"x").expect("write");
        let mut b = [0u8; 1];
        c.read_exact(&mut b).expect("read");
        assert_eq!(p.counters().delayed_chunks, 5, "disarmed: no more delays");
    }

    #[test]
    fn a_reset_reaches_the_sender_as_an_rst() {
        let p = Proxy::start(echo()).expect("proxy");
        let mut c = client(&p);
        c.write_all(b"hello").expect("write");
        let mut b = [0u8; 5];
        c.read_exact(&mut b).expect("echo before the fault");
        p.arm(Fault::ResetAfter(2));
        c.write_all(b"abcdef").expect("write");
        // Two bytes pass, then the connection is reset: reads end in ECONNRESET, not EOF.
        let mut rest = Vec::new();
        let err = loop {
            let mut b = [0u8; 16];
            match c.read(&mut b) {
                Ok(0) => panic!("EOF (a FIN), not a reset; read {rest:?}"),
                Ok(n) => rest.extend_from_slice(&b[..n]),
                Err(e) => break e,
            }
        };
        assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset, "{err}");
        assert!(rest.len() <= 2, "{rest:?}");
        assert_eq!(p.counters().resets, 1);
    }

    /// What `c` reads within `wait`: `Some(bytes)` (empty: EOF), `None`: nothing (silence).
    fn read_within(c: &mut TcpStream, wait: Duration) -> Option<Vec<u8>> {
        c.set_read_timeout(Some(wait)).expect("timeout");
        let mut b = [0u8; 64];
        match c.read(&mut b) {
            Ok(n) => Some(b[..n].to_vec()),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => None,
            // A reset also ends the connection.
            Err(_) => Some(Vec::new()),
        }
    }

    #[test]
    fn a_blackhole_is_silence_both_ways_until_lifted_then_closes_what_it_hit() {
        let p = Proxy::start(echo()).expect("proxy");
        let mut hit = client(&p);
        hit.write_all(b"ping").expect("write");
        let mut b = [0u8; 4];
        hit.read_exact(&mut b).expect("echo before the blackhole");
        let mut idle = client(&p);
        idle.write_all(b"x").expect("write");
        idle.read_exact(&mut b[..1]).expect("echo before the blackhole");

        p.arm(Fault::Blackhole);
        hit.write_all(b"lost").expect("write");
        assert_eq!(read_within(&mut hit, Duration::from_millis(300)), None, "no echo through a blackhole");
        // A new connection is accepted (no refusal) but goes nowhere.
        let mut late = client(&p);
        late.write_all(b"hello?").expect("write");
        assert_eq!(read_within(&mut late, Duration::from_millis(300)), None, "no answer on a new connection");
        let k = p.counters();
        assert_eq!((k.connections, k.blackholed_connections), (2, 1), "{k:?}");
        assert_eq!(k.blackholed_bytes, 10, "{k:?}");

        p.arm(Fault::None);
        // The connection that lost bytes and the one accepted meanwhile are closed: EOF.
        assert_eq!(read_within(&mut hit, Duration::from_secs(5)), Some(vec![]), "the hit connection is closed");
        assert_eq!(read_within(&mut late, Duration::from_secs(5)), Some(vec![]), "the late connection is closed");
        assert_eq!(p.counters().blackhole_closed, 2);
        // A connection that lost nothing goes on, and so do new ones.
        idle.write_all(b"y").expect("write");
        assert_eq!(read_within(&mut idle, Duration::from_secs(5)), Some(b"y".to_vec()));
        let mut fresh = client(&p);
        fresh.write_all(b"back").expect("write");
        assert_eq!(read_within(&mut fresh, Duration::from_secs(5)), Some(b"back".to_vec()));
    }

    #[test]
    fn a_blackhole_drops_the_receivers_bytes_too() {
        // An upstream that answers each byte it reads 200 ms later.
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let up = l.local_addr().expect("addr");
        std::thread::spawn(move || {
            for c in l.incoming() {
                let Ok(mut c) = c else { return };
                let mut b = [0u8; 1];
                while let Ok(1) = c.read(&mut b) {
                    std::thread::sleep(Duration::from_millis(200));
                    if c.write_all(b"late answer").is_err() {
                        return;
                    }
                }
            }
        });
        let p = Proxy::start(up).expect("proxy");
        let mut c = client(&p);
        c.write_all(b"q").expect("write");
        let mut answer = [0u8; 11];
        c.read_exact(&mut answer).expect("an answer before the blackhole");
        c.write_all(b"r").expect("write");
        // Arm only once "r" went up, so that only its answer meets the blackhole.
        let t0 = Instant::now();
        while p.counters().bytes_forwarded < 2 {
            assert!(t0.elapsed() < Duration::from_secs(5), "the proxy did not forward the second byte");
            std::thread::sleep(Duration::from_millis(5));
        }
        p.arm(Fault::Blackhole);
        assert_eq!(read_within(&mut c, Duration::from_millis(600)), None, "the answer must not cross");
        let k = p.counters();
        assert_eq!((k.bytes_forwarded, k.blackholed_bytes, k.blackholed_reply_bytes), (2, 0, 11), "{k:?}");
        p.arm(Fault::None);
        assert_eq!(read_within(&mut c, Duration::from_secs(5)), Some(vec![]), "closed on lift");
    }
}
