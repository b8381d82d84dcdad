//! Helpers for the worker process tests: start real worker binaries on
//! loopback ports they pick, read the addresses they print, scrape their
//! `/metrics`, compute reference outputs with the in-process engine, and put
//! a fault-injecting TCP proxy on a KV link.
//!
//! Every wait is bounded and says what did not happen; nothing sleeps.
#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use engine::batch::{Engine, EngineConfig, Request};
use engine::model::Model;
use engine::sampler::SamplingParams;
use engine::tokenizer::Tokenizer;
use engine::weights::Weights;

pub type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// Model loading and long prefills on a 2-core machine; a hang hits this.
pub const WAIT: Duration = Duration::from_secs(120);

pub async fn within<T>(what: &str, fut: impl std::future::Future<Output = T>) -> Result<T, String> {
    tokio::time::timeout(WAIT, fut).await.map_err(|_| format!("{what} did not happen within {WAIT:?}"))
}

/// A worker process; killed (SIGKILL) when dropped if still running.
pub struct Worker {
    child: Option<Child>,
    pub pid: u32,
    addrs: HashMap<String, String>,
}

impl Drop for Worker {
    fn drop(&mut self) {
        if let Some(c) = self.child.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Worker {
    /// Starts `bin` with `args` and waits until it printed a
    /// `listening NAME=ADDR` line for each of `names`.
    pub fn start(bin: &str, args: &[&str], names: &[&str]) -> Result<Self, String> {
        Self::start_with(bin, args, names, None)
    }

    /// [`Worker::start`], with its info-level log written to `log` when given.
    pub fn start_with(bin: &str, args: &[&str], names: &[&str], log: Option<&std::path::Path>) -> Result<Self, String> {
        let mut cmd = Command::new(bin);
        cmd.args(args).stdout(Stdio::piped()).stderr(Stdio::inherit());
        if let Some(path) = log {
            let f = std::fs::File::create(path).map_err(|e| format!("create {}: {e}", path.display()))?;
            cmd.env("RUST_LOG", "info").env("NO_COLOR", "1").stderr(f);
        }
        let mut child = cmd.spawn().map_err(|e| format!("spawn {bin}: {e}"))?;
        let stdout = child.stdout.take().ok_or("no stdout pipe")?;
        let pid = child.id();
        let mut w = Self { child: Some(child), pid, addrs: HashMap::new() };
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if let Some((name, addr)) = line.strip_prefix("listening ").and_then(|l| l.split_once('=')) {
                    let _ = tx.send((name.to_owned(), addr.to_owned()));
                }
            }
        });
        while names.iter().any(|n| !w.addrs.contains_key(*n)) {
            let (name, addr) = rx.recv_timeout(WAIT).map_err(|e| match e {
                mpsc::RecvTimeoutError::Timeout => {
                    format!("{bin} did not print `listening {names:?}=` within {WAIT:?}")
                }
                mpsc::RecvTimeoutError::Disconnected => format!("{bin} {args:?} exited before listening"),
            })?;
            w.addrs.insert(name, addr);
        }
        Ok(w)
    }

    /// The `name` address as host:port.
    pub fn addr(&self, name: &str) -> Result<SocketAddr, String> {
        let a = self.addrs.get(name).ok_or_else(|| format!("no `{name}` address"))?;
        a.parse().map_err(|e| format!("`{name}` address {a:?} is not host:port: {e}"))
    }

    pub fn signal(&self, sig: &str) -> Result<(), String> {
        let status = Command::new("kill").args([sig, &self.pid.to_string()]).status().map_err(|e| e.to_string())?;
        if status.success() {
            Ok(())
        } else {
            Err(format!("kill {sig} {} failed", self.pid))
        }
    }

    /// SIGKILL, then reap.
    pub fn kill9(&mut self) -> Result<(), String> {
        self.signal("-KILL")?;
        self.wait_exit().map(drop)
    }

    /// Waits for the process to exit; on timeout it is killed and the error says so.
    pub fn wait_exit(&mut self) -> Result<ExitStatus, String> {
        let mut child = self.child.take().ok_or("already exited")?;
        let pid = child.id();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || drop(tx.send(child.wait())));
        match rx.recv_timeout(WAIT) {
            Ok(status) => status.map_err(|e| e.to_string()),
            Err(_) => {
                let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).status();
                Err(format!("worker {pid} did not exit within {WAIT:?}"))
            }
        }
    }
}

/// The worker binary of this package comes from cargo (`CARGO_BIN_EXE_*`); the
/// other role's is found beside the test executable (`cargo build --workspace
/// --bins` builds it, as `make test` does).
fn bin(own: Option<&'static str>, name: &str) -> String {
    if let Some(path) = own {
        return path.to_owned();
    }
    let exe = std::env::current_exe().unwrap_or_default();
    exe.ancestors()
        .skip(1)
        .take(2)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .map(|p| p.display().to_string())
        .unwrap_or_else(|| panic!("{name} is not built beside {}: run `cargo build --workspace --bins`", exe.display()))
}

#[allow(non_snake_case)]
pub fn PREFILL_BIN() -> String {
    bin(option_env!("CARGO_BIN_EXE_tandem-prefill-worker"), "tandem-prefill-worker")
}

#[allow(non_snake_case)]
pub fn DECODE_BIN() -> String {
    bin(option_env!("CARGO_BIN_EXE_tandem-decode-worker"), "tandem-decode-worker")
}

/// Worker flags: `group`, 1 thread, 256 KV blocks and no coordinator-silence fence unless
/// `extra` sets them, then `extra`.
fn worker_args<'a>(group: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["--version-group", group];
    // These tests call Health as they please, then go quiet for longer than a
    // coordinator would: the silence fence (on by default) would fence the
    // worker mid-test. A test of that fence passes the flag itself.
    let defaults = [("--threads", "1"), ("--kv-blocks", "256"), ("--coordinator-silence-fence-ms", "0")];
    for (flag, default) in defaults {
        if !extra.contains(&flag) {
            args.extend([flag, default]);
        }
    }
    args.extend_from_slice(extra);
    args
}

/// A prefill worker in `group` (see `worker_args`).
pub fn prefill_worker(group: &str, extra: &[&str]) -> Result<Worker, String> {
    Worker::start(&PREFILL_BIN(), &worker_args(group, extra), &["grpc", "metrics"])
}

/// A decode worker in `group` (see `worker_args`); `extra` must include
/// `--kv-load-failure-policy` unless a config sets it.
pub fn decode_worker(group: &str, extra: &[&str]) -> Result<Worker, String> {
    Worker::start(&DECODE_BIN(), &worker_args(group, extra), &["grpc", "metrics", "transfer"])
}

/// [`decode_worker`], its info-level log in `log`.
pub fn decode_worker_logged(group: &str, extra: &[&str], log: &std::path::Path) -> Result<Worker, String> {
    Worker::start_with(&DECODE_BIN(), &worker_args(group, extra), &["grpc", "metrics", "transfer"], Some(log))
}

/// GETs `/metrics` with a bare HTTP/1.1 request; returns the body.
pub fn scrape(addr: SocketAddr) -> Result<String, String> {
    let mut s = TcpStream::connect_timeout(&addr, WAIT).map_err(|e| format!("connect to metrics {addr}: {e}"))?;
    s.set_read_timeout(Some(WAIT)).map_err(|e| e.to_string())?;
    s.set_write_timeout(Some(WAIT)).map_err(|e| e.to_string())?;
    write!(s, "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n")
        .map_err(|e| format!("send the metrics request: {e}"))?;
    let mut raw = String::new();
    s.read_to_string(&mut raw).map_err(|e| format!("read the metrics response within {WAIT:?}: {e}"))?;
    let (head, body) = raw.split_once("\r\n\r\n").ok_or_else(|| format!("no HTTP header end in {raw:?}"))?;
    if !head.starts_with("HTTP/1.1 200") {
        return Err(format!("metrics answered {head:?}"));
    }
    if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        return Err(format!("chunked metrics response not expected: {head:?}"));
    }
    Ok(body.to_owned())
}

/// The value of the sample line `series` (name plus labels, exactly as rendered).
pub fn sample(body: &str, series: &str) -> Option<f64> {
    body.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Scrapes until `series` satisfies `ok` (the worker updates some values
/// asynchronously, e.g. on its reaper's next turn); the error shows the last body.
pub async fn wait_metric(addr: SocketAddr, series: &str, ok: impl Fn(f64) -> bool) -> Result<f64, String> {
    let until = Instant::now() + WAIT;
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    loop {
        tick.tick().await;
        let body = tokio::task::spawn_blocking(move || scrape(addr)).await.map_err(|e| e.to_string())??;
        if let Some(v) = sample(&body, series).filter(|v| ok(*v)) {
            return Ok(v);
        }
        if Instant::now() > until {
            return Err(format!("`{series}` did not reach the expected value within {WAIT:?}:\n{body}"));
        }
    }
}

pub fn tokenizer() -> Result<Tokenizer, String> {
    let path = engine::paths::default_model_path();
    let (_, f) = Weights::from_gguf(&path).map_err(|e| format!("load {}: {e}", path.display()))?;
    Tokenizer::from_gguf(&f).map_err(|e| e.to_string())
}

/// A prompt of exactly `n` tokens cut from real text (repeated as needed).
pub fn prompt_of(tok: &Tokenizer, n: usize) -> Result<Vec<u32>, String> {
    let text = "The quick brown fox jumps over the lazy dog. The capital of France is Paris, and the capital \
                of Germany is Berlin. Rivers run to the sea, and the sea does not fill. ";
    let one = tok.encode(text, false).map_err(|e| e.to_string())?;
    Ok(one.iter().copied().cycle().take(n).collect())
}

pub fn greedy(max_tokens: u32) -> SamplingParams {
    SamplingParams { max_tokens, ignore_eos: true, ..SamplingParams::default() }
}

/// Greedy output of each prompt from the single-process engine.
pub fn reference(prompts: &[Vec<u32>], max_tokens: u32) -> Result<Vec<Vec<u32>>, String> {
    let path = engine::paths::default_model_path();
    let (w, f) = Weights::from_gguf(&path).map_err(|e| format!("load {}: {e}", path.display()))?;
    let tok = Tokenizer::from_gguf(&f).map_err(|e| e.to_string())?;
    let model = Model::new(w, 2).map_err(|e| e.to_string())?;
    let cfg = EngineConfig { kv_blocks: 512, ..EngineConfig::default() };
    let mut e = Engine::new(model, cfg, tok.eos_ids().to_vec()).map_err(|e| e.to_string())?;
    for (i, p) in prompts.iter().enumerate() {
        e.add(Request { id: i as u64, prompt: p.clone(), params: greedy(max_tokens), salt: 0 })
            .map_err(|e| e.to_string())?;
    }
    let mut out = vec![Vec::new(); prompts.len()];
    for _ in 0..100_000 {
        if !e.has_work() {
            return Ok(out);
        }
        for ev in e.step().map_err(|e| e.to_string())? {
            out[ev.id as usize].push(ev.token.id);
        }
    }
    Err("the reference engine did not finish".into())
}

// ------------------------------------------------------------ fault proxy

/// What the proxy does to the next connection it accepts (later ones, and
/// the direction back to the sender, are forwarded untouched).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    None,
    /// XOR the byte at this offset of the sender's stream with 0xFF.
    FlipAt(usize),
    /// Forward this many bytes, then keep reading but hold everything back
    /// until [`Proxy::release`].
    HoldAfter(usize),
}

#[derive(Default)]
struct ProxyState {
    armed: Option<Fault>,
    /// Bytes held back so far on the faulted connection.
    held: usize,
    released: bool,
    connections: usize,
}

/// A loopback TCP proxy in front of `upstream` (a decode worker's KV port).
#[derive(Clone)]
pub struct Proxy {
    pub addr: SocketAddr,
    state: Arc<(Mutex<ProxyState>, Condvar)>,
}

impl Proxy {
    pub fn start(upstream: SocketAddr) -> Result<Self, String> {
        let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        let state = Arc::new((Mutex::new(ProxyState::default()), Condvar::new()));
        let st = state.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(down) = conn else { continue };
                let Ok(up) = TcpStream::connect(upstream) else { continue };
                let fault = {
                    let mut s = st.0.lock().unwrap_or_else(|e| e.into_inner());
                    s.connections += 1;
                    s.armed.take().unwrap_or(Fault::None)
                };
                let (Ok(down2), Ok(up2)) = (down.try_clone(), up.try_clone()) else { continue };
                let st2 = st.clone();
                std::thread::spawn(move || pump(down, up, fault, st2));
                std::thread::spawn(move || pump(up2, down2, Fault::None, Arc::new(Default::default())));
            }
        });
        Ok(Self { addr, state })
    }

    /// Applies `fault` to the next accepted connection.
    pub fn arm(&self, fault: Fault) {
        let mut s = self.state.0.lock().unwrap_or_else(|e| e.into_inner());
        *s = ProxyState { armed: Some(fault), connections: s.connections, ..ProxyState::default() };
    }

    /// Waits until at least `bytes` are held back.
    pub fn wait_held(&self, bytes: usize) -> Result<(), String> {
        let (m, cv) = &*self.state;
        let guard = m.lock().unwrap_or_else(|e| e.into_inner());
        let (s, timeout) = cv.wait_timeout_while(guard, WAIT, |s| s.held < bytes).unwrap_or_else(|e| e.into_inner());
        if timeout.timed_out() {
            return Err(format!("the proxy held {} bytes, not {bytes}, within {WAIT:?}", s.held));
        }
        Ok(())
    }

    /// Forwards everything held back, and everything after it.
    pub fn release(&self) {
        let (m, cv) = &*self.state;
        m.lock().unwrap_or_else(|e| e.into_inner()).released = true;
        cv.notify_all();
    }

    pub fn connections(&self) -> usize {
        self.state.0.lock().unwrap_or_else(|e| e.into_inner()).connections
    }
}

fn pump(mut from: TcpStream, mut to: TcpStream, fault: Fault, st: Arc<(Mutex<ProxyState>, Condvar)>) {
    if let Fault::HoldAfter(limit) = fault {
        return pump_hold(from, to, limit, st);
    }
    let mut buf = vec![0u8; 64 << 10];
    let mut offset = 0usize;
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if let Fault::FlipAt(at) = fault {
            if (offset..offset + n).contains(&at) {
                buf[at - offset] ^= 0xFF;
            }
        }
        offset += n;
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Write);
}

/// Reads everything the sender writes (so it never blocks), forwards the
/// first `limit` bytes at once and the rest only after `release`, even if
/// the sender is gone by then.
fn pump_hold(mut from: TcpStream, mut to: TcpStream, limit: usize, st: Arc<(Mutex<ProxyState>, Condvar)>) {
    let (tx, rx) = mpsc::channel::<Vec<u8>>();
    let gate = st.clone();
    std::thread::spawn(move || {
        let mut sent = 0usize;
        for chunk in rx {
            let pass = limit.saturating_sub(sent).min(chunk.len());
            if to.write_all(&chunk[..pass]).is_err() {
                return;
            }
            if pass < chunk.len() {
                let (m, cv) = &*gate;
                let guard = m.lock().unwrap_or_else(|e| e.into_inner());
                let (guard, timeout) =
                    cv.wait_timeout_while(guard, WAIT, |s| !s.released).unwrap_or_else(|e| e.into_inner());
                drop(guard);
                if timeout.timed_out() || to.write_all(&chunk[pass..]).is_err() {
                    return;
                }
            }
            sent += chunk.len();
        }
        let _ = to.shutdown(std::net::Shutdown::Write);
    });
    let mut buf = vec![0u8; 64 << 10];
    let mut read = 0usize;
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        read += n;
        {
            let (m, cv) = &*st;
            m.lock().unwrap_or_else(|e| e.into_inner()).held = read.saturating_sub(limit);
            cv.notify_all();
        }
        if tx.send(buf[..n].to_vec()).is_err() {
            break;
        }
    }
}
