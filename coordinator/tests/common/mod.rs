//! Shared by the coordinator's process tests: starting workspace binaries
//! and reading the addresses they print, a bare HTTP/1.1 client, metric
//! scraping, bounded waits, and the single-process engine's reference output.

#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use engine::batch::{Engine, EngineConfig, Request};
use engine::model::Model;
use engine::sampler::SamplingParams;
use engine::tokenizer::Tokenizer;
use engine::weights::Weights;
use serde_json::Value;

pub type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

pub const WAIT: Duration = Duration::from_secs(120);
pub const MODEL: &str = "SmolLM2-135M-Instruct";

/// A child process, killed when dropped.
pub struct Proc {
    pub child: Child,
    pub addrs: HashMap<String, String>,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A binary of this workspace, next to the test's own target directory.
pub fn bin(name: &str) -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let dir = exe.parent().and_then(|d| d.parent()).ok_or("no target dir")?;
    let path = dir.join(name);
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!("{} is not built: run `cargo build --workspace --bins` (make test does)", path.display()))
    }
}

pub fn start(name: &str, args: &[&str], wants: &[&str]) -> Result<Proc, String> {
    let mut child = Command::new(bin(name)?)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("spawn {name}: {e}"))?;
    let out = child.stdout.take().ok_or("no stdout")?;
    let mut p = Proc { child, addrs: HashMap::new() };
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            // `listening NAME=ADDR [NAME=ADDR ...]`
            let Some(pairs) = line.strip_prefix("listening ") else { continue };
            for (k, v) in pairs.split_whitespace().filter_map(|p| p.split_once('=')) {
                let _ = tx.send((k.to_owned(), v.to_owned()));
            }
        }
    });
    while wants.iter().any(|w| !p.addrs.contains_key(*w)) {
        let (k, v) = rx.recv_timeout(WAIT).map_err(|_| format!("{name} did not print `listening {wants:?}=`"))?;
        p.addrs.insert(k, v);
    }
    Ok(p)
}

impl Proc {
    pub fn addr(&self, k: &str) -> Result<String, String> {
        self.addrs.get(k).cloned().ok_or_else(|| format!("no {k} address"))
    }
}

/// A bare HTTP/1.1 exchange: (status, headers lower-cased, body de-chunked).
pub fn http(
    addr: &str,
    method: &str,
    path: &str,
    content_type: &str,
    body: &[u8],
    extra: &[(&str, &str)],
) -> Result<(u16, HashMap<String, String>, String), String> {
    let sa: SocketAddr = addr.parse().map_err(|e| format!("{addr}: {e}"))?;
    let mut s = TcpStream::connect_timeout(&sa, WAIT).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(WAIT)).map_err(|e| e.to_string())?;
    let mut head =
        format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n", body.len());
    if !content_type.is_empty() {
        head.push_str(&format!("Content-Type: {content_type}\r\n"));
    }
    for (k, v) in extra {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).and_then(|()| s.write_all(body)).map_err(|e| e.to_string())?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).map_err(|e| format!("reading the response: {e}"))?;
    let raw = String::from_utf8(raw).map_err(|e| e.to_string())?;
    let (h, b) = raw.split_once("\r\n\r\n").ok_or("no header end")?;
    let mut lines = h.lines();
    let status = lines.next().and_then(|l| l.split(' ').nth(1)).and_then(|c| c.parse().ok()).ok_or("bad status")?;
    let headers: HashMap<String, String> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let body = if headers.get("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
        dechunk(b)?
    } else {
        b.to_owned()
    };
    Ok((status, headers, body))
}

pub fn dechunk(mut b: &str) -> Result<String, String> {
    let mut out = String::new();
    loop {
        let (size, rest) = b.split_once("\r\n").ok_or("bad chunk header")?;
        let n = usize::from_str_radix(size.trim(), 16).map_err(|e| format!("chunk size {size:?}: {e}"))?;
        if n == 0 {
            return Ok(out);
        }
        out.push_str(rest.get(..n).ok_or("short chunk")?);
        b = rest.get(n + 2..).ok_or("short chunk end")?;
    }
}

pub fn post(addr: &str, path: &str, v: &Value) -> Result<(u16, HashMap<String, String>, String), String> {
    http(addr, "POST", path, "application/json", v.to_string().as_bytes(), &[])
}

pub fn json_of(body: &str) -> Result<Value, String> {
    serde_json::from_str(body).map_err(|e| format!("{e}: {body}"))
}

/// Greedy continuation of `ids` from the single-process engine, as text.
pub fn reference(tok: &Tokenizer, ids: &[u32], max_tokens: u32) -> Result<String, String> {
    let path = engine::paths::default_model_path();
    let (w, _) = Weights::from_gguf(&path).map_err(|e| e.to_string())?;
    let model = Model::new(w, 2).map_err(|e| e.to_string())?;
    let mut e = Engine::new(model, EngineConfig::default(), tok.eos_ids().to_vec()).map_err(|e| e.to_string())?;
    let params = SamplingParams { max_tokens, ..SamplingParams::default() };
    e.add(Request { id: 1, prompt: ids.to_vec(), params, salt: 0 }).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    while e.has_work() {
        for ev in e.step().map_err(|e| e.to_string())? {
            if !tok.eos_ids().contains(&ev.token.id) {
                out.push(ev.token.id);
            }
        }
    }
    tok.decode(&out, true).map_err(|e| e.to_string())
}

pub fn error_of(status: u16, body: &str, want_status: u16, want_param: Option<&str>) -> TestResult {
    assert_eq!(status, want_status, "{body}");
    let v = json_of(body)?;
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{body}");
    assert!(e["type"].is_string() && e.get("code").is_some() && e.get("param").is_some(), "{body}");
    if let Some(p) = want_param {
        assert_eq!(e["param"], p, "{body}");
    }
    Ok(())
}

/// Polls `f` every 50 ms until it returns true; the error says what did not happen.
pub async fn eventually(what: &str, mut f: impl FnMut() -> bool) -> TestResult {
    let until = std::time::Instant::now() + WAIT;
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    loop {
        tick.tick().await;
        if f() {
            return Ok(());
        }
        if std::time::Instant::now() > until {
            return Err(format!("{what} did not happen within {WAIT:?}").into());
        }
    }
}

pub fn metric(addr: &str, series: &str) -> Result<f64, String> {
    let (_, _, body) = http(addr, "GET", "/metrics", "", b"", &[])?;
    Ok(body.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok()).unwrap_or(0.0))
}

/// An SSE response being read as it arrives.
pub struct EventStream {
    reader: BufReader<TcpStream>,
    pub status: u16,
}

/// Posts `body` to `path` and returns once the response head is read; the
/// events are read with [`EventStream::next_event`]. Dropping it closes the
/// connection (the client going away).
pub fn open_stream(addr: &str, path: &str, body: &Value, extra: &[(&str, &str)]) -> Result<EventStream, String> {
    let sa: SocketAddr = addr.parse().map_err(|e| format!("{addr}: {e}"))?;
    let mut s = TcpStream::connect_timeout(&sa, WAIT).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(WAIT)).map_err(|e| e.to_string())?;
    let body = body.to_string();
    let mut head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in extra {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).and_then(|()| s.write_all(body.as_bytes())).map_err(|e| e.to_string())?;
    let mut reader = BufReader::new(s);
    let mut line = String::new();
    reader.read_line(&mut line).map_err(|e| format!("reading the status line: {e}"))?;
    let status = line.split(' ').nth(1).and_then(|c| c.parse().ok()).ok_or_else(|| format!("bad status {line:?}"))?;
    loop {
        line.clear();
        reader.read_line(&mut line).map_err(|e| format!("reading headers: {e}"))?;
        if line == "\r\n" || line.is_empty() {
            break;
        }
    }
    Ok(EventStream { reader, status })
}

impl EventStream {
    /// The next `data:` payload, or `None` at the end of the response.
    pub fn next_event(&mut self) -> Result<Option<String>, String> {
        let mut line = String::new();
        loop {
            line.clear();
            let n = self.reader.read_line(&mut line).map_err(|e| format!("reading events: {e}"))?;
            if n == 0 {
                return Ok(None);
            }
            if let Some(d) = line.trim_end().strip_prefix("data: ") {
                return Ok(Some(d.to_owned()));
            }
        }
    }

    /// Reads to the end: the events' payloads.
    pub fn rest(mut self) -> Result<Vec<String>, String> {
        let mut out = Vec::new();
        while let Some(e) = self.next_event()? {
            out.push(e);
        }
        Ok(out)
    }
}

/// Sends SIGKILL or SIGTERM to a child.
pub fn signal(p: &Proc, sig: &str) {
    let _ = Command::new("kill").args([sig, &p.child.id().to_string()]).status();
}

/// Sends a request and returns the open connection without reading the
/// answer; dropping it is a client that gave up waiting.
pub fn send_only(addr: &str, path: &str, body: &Value) -> Result<TcpStream, String> {
    let sa: SocketAddr = addr.parse().map_err(|e| format!("{addr}: {e}"))?;
    let mut s = TcpStream::connect_timeout(&sa, WAIT).map_err(|e| e.to_string())?;
    let body = body.to_string();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).and_then(|()| s.write_all(body.as_bytes())).map_err(|e| e.to_string())?;
    Ok(s)
}

/// A prefill and a decode worker (version group `g`, one thread each,
/// `kv_blocks` KV blocks, policy `recompute`, every prompt prefilled
/// remotely) and a coordinator in front of them by address, with
/// `coordinator_args` added to its flags.
pub struct Pair {
    pub prefill: Proc,
    pub decode: Proc,
    pub coord: Proc,
}

pub fn start_pair(kv_blocks: &str, coordinator_args: &[&str]) -> Result<Pair, String> {
    let common = ["--version-group", "g", "--threads", "1", "--kv-blocks", kv_blocks];
    let prefill = start("tandem-prefill-worker", &common, &["grpc", "metrics"])?;
    let mut dargs = common.to_vec();
    dargs.extend(["--kv-load-failure-policy", "recompute", "--local-prefill-max-tokens", "0"]);
    let decode = start("tandem-decode-worker", &dargs, &["grpc", "metrics", "transfer"])?;
    let (d, p) = (decode.addr("grpc")?, prefill.addr("grpc")?);
    let mut args = vec!["--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0", "--decode", &d, "--prefill", &p];
    args.extend_from_slice(coordinator_args);
    let coord = start("tandem-coordinator", &args, &["http", "grpc"])?;
    Ok(Pair { prefill, decode, coord })
}

/// Sum of every series of `name` (all label sets) on a `/metrics` page.
pub fn metric_sum(addr: &str, name: &str) -> Result<f64, String> {
    let (_, _, body) = http(addr, "GET", "/metrics", "", b"", &[])?;
    Ok(body
        .lines()
        .filter(|l| l.strip_prefix(name).is_some_and(|r| r.starts_with('{') || r.starts_with(' ')))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum())
}

/// A coordinator routing from etcd membership under `prefix` (every prompt
/// prefilled remotely), with `extra` flags.
pub fn start_etcd_coordinator(ep: &str, prefix: &str, extra: &[&str]) -> Result<Proc, String> {
    let mut args = vec!["--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0", "--etcd", ep, "--cluster-prefix", prefix];
    args.extend(["--local-prefill-max-tokens", "0"]);
    args.extend_from_slice(extra);
    start("tandem-coordinator", &args, &["http"])
}
