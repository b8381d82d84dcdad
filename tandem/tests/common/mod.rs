//! Shared by the tests that start `tandem up`: start it and wait for its
//! table, read its state file, stop it (bounded), and plain HTTP/1.1 calls.

#![allow(dead_code)] // each test binary uses its own part of this module

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use cluster_tests::metrics::scrape;
use loadgen::{Arrival, Plan, PromptSource};

/// Bound on `tandem up` becoming ready, on its stop, and on a request (a loaded machine).
pub const WAIT: Duration = Duration::from_secs(180);

pub type TestResult = Result<(), Box<dyn std::error::Error>>;

/// A running `tandem up`. Dropping it stops it (SIGTERM, SIGKILL if it does
/// not exit), so a failing test leaves no cluster behind.
pub struct Up {
    child: Option<Child>,
    pub pid: u32,
    pub state_file: PathBuf,
    /// Where its stderr goes (its restart and give-up lines).
    pub stderr: PathBuf,
    /// The state file as written once the cluster was ready.
    pub state: serde_json::Value,
}

impl Up {
    /// `tandem up ARGS --http 127.0.0.1:0 --grpc 127.0.0.1:0 --threads 1
    /// --shutdown-timeout-ms 5000 --state-file DIR/state.json`, returned
    /// once it has printed its table (printed after the state file is written).
    /// Its stderr goes to DIR/tandem-up.stderr.
    pub fn start(dir: &Path, args: &[&str]) -> Result<Up, Box<dyn std::error::Error>> {
        let state_file = dir.join("state.json");
        let stderr = dir.join("tandem-up.stderr");
        let mut child = Command::new(env!("CARGO_BIN_EXE_tandem"))
            .arg("up")
            .args(["--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0", "--threads", "1"])
            .args(["--shutdown-timeout-ms", "5000"])
            .args(args)
            .arg("--state-file")
            .arg(&state_file)
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr)?)
            .spawn()?;
        let out = child.stdout.take().ok_or("no stdout")?;
        let mut up = Up { pid: child.id(), child: Some(child), state_file, stderr, state: serde_json::Value::Null };
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let mut table = Vec::new();
        while !table.iter().any(|l: &String| l.starts_with("coordinator")) {
            let line = rx.recv_timeout(WAIT).map_err(|_| {
                format!("tandem up printed no table within {WAIT:?}: {table:?}; stderr:\n{}", up.stderr_text())
            })?;
            table.push(line);
        }
        up.state = serde_json::from_str(&std::fs::read_to_string(&up.state_file)?)?;
        Ok(up)
    }

    /// What it wrote to stderr so far.
    pub fn stderr_text(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// Reads the state file again (it is rewritten on every exit and restart).
    pub fn reload(&mut self) -> Result<(), String> {
        let text =
            std::fs::read_to_string(&self.state_file).map_err(|e| format!("{}: {e}", self.state_file.display()))?;
        self.state = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", self.state_file.display()))?;
        Ok(())
    }

    /// The component named `name` (`prefill-1`) in the state file as last read.
    pub fn component(&self, name: &str) -> Result<serde_json::Value, String> {
        self.components()?
            .iter()
            .find(|c| c["name"] == name)
            .cloned()
            .ok_or_else(|| format!("no {name} in the state file: {}", self.state))
    }

    /// The state file's components.
    pub fn components(&self) -> Result<&Vec<serde_json::Value>, String> {
        self.state["components"].as_array().ok_or_else(|| format!("no components in {}", self.state))
    }

    /// The coordinator's HTTP address.
    pub fn http(&self) -> Result<String, String> {
        let comps = self.components()?;
        let c = comps.iter().find(|c| c["role"] == "coordinator").ok_or("no coordinator in the state file")?;
        c["http"].as_str().map(str::to_owned).ok_or_else(|| format!("no http in {c}"))
    }

    /// SIGTERM and wait up to 60 s (then SIGKILL); its exit status.
    pub fn stop(&mut self) -> Result<ExitStatus, String> {
        let mut c = self.child.take().ok_or("already stopped")?;
        let _ = Command::new("kill").args(["-TERM", &c.id().to_string()]).status();
        let (tx, rx) = mpsc::channel();
        let pid = c.id();
        std::thread::spawn(move || drop(tx.send(c.wait())));
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(r) => r.map_err(|e| e.to_string()),
            Err(_) => {
                let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).status();
                Err("tandem up did not exit within 60 s of SIGTERM".into())
            }
        }
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        if self.child.is_some() {
            let _ = self.stop();
        }
    }
}

/// A fresh temporary directory for one test, named after it and this process.
pub fn temp_dir(name: &str) -> std::io::Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// `METHOD path` with an optional JSON body, `Connection: close`: the status
/// and the whole response (head and body).
pub fn request(addr: &str, method: &str, path: &str, body: Option<&str>) -> Result<(u16, String), String> {
    let sa: SocketAddr = addr.parse().map_err(|e| format!("{addr}: {e}"))?;
    let mut s = TcpStream::connect_timeout(&sa, Duration::from_secs(5)).map_err(|e| format!("{addr}: {e}"))?;
    s.set_read_timeout(Some(WAIT)).map_err(|e| e.to_string())?;
    let head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    match body {
        Some(b) => {
            write!(s, "{head}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{b}", b.len())
        }
        None => write!(s, "{head}\r\n"),
    }
    .map_err(|e| e.to_string())?;
    let mut raw = String::new();
    s.read_to_string(&mut raw).map_err(|e| e.to_string())?;
    let status = raw.split(' ').nth(1).and_then(|c| c.parse().ok()).ok_or_else(|| format!("no status in {raw:?}"))?;
    Ok((status, raw))
}

/// `POST path` with a JSON body: the status and the response body.
pub fn post(addr: &str, path: &str, body: &str) -> Result<(u16, String), String> {
    let (status, raw) = request(addr, "POST", path, Some(body))?;
    Ok((status, raw.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default()))
}

/// The state letter of `/proc/PID/stat` (`None`: gone).
pub fn proc_state(pid: u64) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.split_whitespace().next()?.chars().next()
}

/// Running and not stopped (a zombie or a stopped process is not).
pub fn running(pid: u64) -> bool {
    !matches!(proc_state(pid), None | Some('Z' | 'T'))
}

/// Polls `check` (every 100 ms) until it gives `Some`, or fails after `limit` with `what`.
pub fn wait_for<T>(
    limit: Duration,
    what: &str,
    mut check: impl FnMut() -> Result<Option<T>, String>,
) -> Result<T, String> {
    let until = Instant::now() + limit;
    let mut last = String::new();
    loop {
        match check() {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) => last = e,
        }
        if Instant::now() > until {
            return Err(format!("{what} did not happen within {limit:?} (last error: {last})"));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The series `name{labels}` on `addr`'s /metrics; an error when the page lacks it.
pub fn metric(rt: &tokio::runtime::Runtime, addr: &str, name: &str, labels: &[(&str, &str)]) -> Result<f64, String> {
    let page = rt.block_on(scrape(addr)).map_err(|e| e.to_string())?;
    page.find(name, labels).ok_or_else(|| format!("{addr}/metrics has no {name}{labels:?}"))
}

/// Waits until the coordinator counts `n` serving workers of `role`.
pub fn serving(rt: &tokio::runtime::Runtime, http: &str, role: &str, n: f64, within: Duration) -> Result<(), String> {
    wait_for(within, &format!("{n} {role} workers serving"), || {
        let v = metric(rt, http, coordinator::metrics::WORKERS, &[("role", role), ("state", "serving")])?;
        Ok((v == n).then_some(()))
    })
}

/// A steady closed-loop load of short streaming completions, until cancelled.
pub fn plan(http: &str) -> Plan {
    let mut p = Plan::new(format!("http://{http}"), "SmolLM2-135M-Instruct");
    p.requests = 10_000;
    p.arrival = Arrival::Closed { concurrency: 3 };
    p.prompts = PromptSource::Generated { tokens: 48 };
    p.max_tokens = 24;
    p.timeout = Duration::from_secs(120);
    p
}
