//! A userspace TCP fault proxy for KV links (the kernel here has no netem).
//!
//! A decode worker advertises the proxy as its transfer address
//! (`--advertise-transfer`), so every prefill worker's KV push crosses it.
//! Prefill workers keep one connection per destination for many transfers,
//! so a fault is armed on the byte stream, not on a connection: it strikes
//! the sender-to-receiver byte that many bytes after arming, on whichever
//! connection carries it. The proxy counts what it did, which is how a
//! drill proves the fault happened.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

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
}

#[derive(Debug)]
struct State {
    armed: Fault,
    counters: ProxyCounters,
    held_conn: Option<u64>,
    released: bool,
    stopped: bool,
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
        let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| HarnessError::Setup(format!("proxy bind: {e}")))?;
        let addr = listener.local_addr().map_err(|e| HarnessError::Setup(format!("proxy addr: {e}")))?;
        let state: Shared = Arc::new((
            Mutex::new(State {
                armed: Fault::None,
                counters: ProxyCounters::default(),
                held_conn: None,
                released: false,
                stopped: false,
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
                let Ok(up) = TcpStream::connect(upstream) else { continue };
                lock(&st).counters.connections += 1;
                let peer = down.peer_addr().ok();
                let (Ok(down2), Ok(up2)) = (down.try_clone(), up.try_clone()) else { continue };
                let st2 = st.clone();
                std::thread::spawn(move || forward(down, up, id, peer, &st2));
                std::thread::spawn(move || plain(up2, down2));
            }
        });
        Ok(Self { addr, upstream, state })
    }

    /// Arms `fault` on the stream from now on (replacing one not yet struck).
    pub fn arm(&self, fault: Fault) {
        lock(&self.state).armed = fault;
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
        lock(&self.state).stopped = true;
        self.state.1.notify_all();
        // Wakes the accept loop so it sees `stopped`.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
    }
}

/// Sender to receiver, with the armed fault applied.
fn forward(mut from: TcpStream, mut to: TcpStream, id: u64, peer: Option<SocketAddr>, st: &Shared) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let mut pass = n;
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
                Fault::None => {}
            }
            s.counters.bytes_forwarded += pass as u64;
        }
        if to.write_all(&buf[..pass]).is_err() {
            break;
        }
        if pass < n {
            let (m, cv) = &**st;
            let guard = m.lock().unwrap_or_else(|e| e.into_inner());
            let guard = cv.wait_while(guard, |s| !s.released && !s.stopped).unwrap_or_else(|e| e.into_inner());
            let go_on = !guard.stopped;
            drop(guard);
            if !go_on || to.write_all(&buf[pass..n]).is_err() {
                break;
            }
        }
    }
    let _ = to.shutdown(Shutdown::Write);
    let _ = from.shutdown(Shutdown::Both);
}

/// Receiver to sender, untouched.
fn plain(mut from: TcpStream, mut to: TcpStream) {
    let mut buf = vec![0u8; 16 << 10];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}
