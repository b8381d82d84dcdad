//! What the tests of `tandem up` share beyond opskit (the workspace's one harness): start
//! `tandem up` and wait for its table, read its state file, stop it (bounded), and opskit's
//! calls with these tests' bounds and shapes.

#![allow(dead_code)] // each test binary uses its own part of this module

use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::Duration;

pub use facts::state::{Component, Role, StateFile};
use loadgen::{Arrival, Plan, PromptSource};
use opskit::process::{Launch, Proc};

/// Bound on `tandem up` becoming ready, on its stop, and on a request (a loaded machine).
pub const WAIT: Duration = Duration::from_secs(180);

pub type TestResult = Result<(), Box<dyn std::error::Error>>;

/// A running `tandem up`. Dropping it stops it (SIGTERM, SIGKILL if it does not exit), so a
/// failing test leaves no cluster behind: SIGKILL alone would orphan its children.
pub struct Up {
    proc: Proc,
    pub pid: u32,
    pub state_file: PathBuf,
    /// Where its stderr goes (its restart and give-up lines).
    pub stderr: PathBuf,
    /// The state file as written once the cluster was ready (the one schema `tandem up`
    /// writes and drills read: `facts::state`).
    pub state: StateFile,
}

impl Up {
    /// `tandem up ARGS --http 127.0.0.1:0 --grpc 127.0.0.1:0 --threads 1
    /// --shutdown-timeout-ms 5000 --state-file DIR/state.json`, returned
    /// once it has printed its table (printed after the state file is written).
    /// Its stderr goes to DIR/tandem-up.stderr.
    pub fn start(dir: &Path, args: &[&str]) -> Result<Up, Box<dyn std::error::Error>> {
        let state_file = dir.join("state.json");
        let stderr = dir.join("tandem-up.stderr");
        let proc = Launch::path(env!("CARGO_BIN_EXE_tandem"))
            .name("tandem-up")
            .arg("up")
            .args(["--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0", "--threads", "1"])
            .args(["--shutdown-timeout-ms", "5000"])
            .args(args)
            .arg("--state-file")
            .arg(state_file.to_string_lossy())
            .log_file(&stderr)
            // Its table's last row is the coordinator's.
            .until_line("coordinator")
            .wait(WAIT)
            .start_blocking()?;
        let state = StateFile::read(&state_file)?;
        Ok(Up { pid: proc.pid, proc, state_file, stderr, state })
    }

    /// What it wrote to stderr so far.
    pub fn stderr_text(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// Reads the state file again (it is rewritten on every exit and restart).
    pub fn reload(&mut self) -> Result<(), String> {
        self.state = StateFile::read(&self.state_file).map_err(|e| e.to_string())?;
        Ok(())
    }

    /// The component named `name` (`prefill-1`) in the state file as last read.
    pub fn component(&self, name: &str) -> Result<Component, String> {
        self.state.component(name).cloned().ok_or_else(|| format!("no {name} in the state file: {:?}", self.state))
    }

    /// The state file's components.
    pub fn components(&self) -> Result<&Vec<Component>, String> {
        Ok(&self.state.components)
    }

    /// The coordinator's HTTP address.
    pub fn http(&self) -> Result<String, String> {
        let c = self.state.components.iter().find(|c| c.role == Role::Coordinator).ok_or("no coordinator")?;
        c.http.clone().ok_or_else(|| format!("no http in {c:?}"))
    }

    /// SIGTERM and wait up to 60 s (then SIGKILL); its exit status.
    pub fn stop(&mut self) -> Result<ExitStatus, String> {
        self.proc.stop_blocking(Duration::from_secs(60)).map_err(|e| format!("tandem up: {e}"))
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

/// A fresh temporary directory for one test, named after it and this process.
pub fn temp_dir(name: &str) -> std::io::Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// `POST path` with a JSON body (as text): the status and the response body.
pub fn post(addr: &str, path: &str, body: &str) -> opskit::Result<(u16, String)> {
    let r = opskit::http::Request::post(addr, path).body("application/json", body).timeout(WAIT).send_blocking()?;
    Ok((r.status, r.text()))
}

/// `GET path`: the status and the response body.
pub fn get(addr: &str, path: &str) -> opskit::Result<(u16, String)> {
    let r = opskit::http::Request::get(addr, path).timeout(WAIT).send_blocking()?;
    Ok((r.status, r.text()))
}

/// The state letter of `/proc/PID/stat` (`None`: gone).
pub fn proc_state(pid: u32) -> Option<char> {
    opskit::process::proc_state(pid)
}

/// Running and not stopped (a zombie or a stopped process is not).
pub fn running(pid: u32) -> bool {
    opskit::process::running(pid)
}

/// Polls `check` until it gives `Some`, or fails after `limit` saying `what` did not happen
/// (and the last error).
pub fn wait_for<T>(limit: Duration, what: &str, check: impl FnMut() -> Result<Option<T>, String>) -> Result<T, String> {
    opskit::wait::blocking::poll(what, limit, check).map_err(|e| e.to_string())
}

/// The series `name{labels}` on `addr`'s /metrics; an error when the page lacks it.
pub fn metric(addr: &str, name: &str, labels: &[(&str, &str)]) -> Result<f64, String> {
    opskit::prom::scrape_blocking(addr).and_then(|p| p.get(name, labels)).map_err(|e| e.to_string())
}

/// Checks every `tandem_` series `addr`'s /metrics exports against the metric catalog
/// (`facts::metrics`): listed for process `p`, with exactly the catalog's label names.
/// Returns how many series were checked; an error lists every disagreement.
pub fn matches_catalog(addr: &str, p: facts::metrics::Process) -> Result<usize, String> {
    let page = opskit::prom::scrape_blocking(addr).map_err(|e| e.to_string())?;
    let mut wrong = Vec::new();
    let mut n = 0;
    for s in page.samples().iter().filter(|s| s.name.starts_with("tandem_")) {
        n += 1;
        let labels: Vec<&str> = s.labels.keys().map(String::as_str).collect();
        if let Err(e) = facts::metrics::check_series(p, &s.name, &labels) {
            if !wrong.contains(&e) {
                wrong.push(e);
            }
        }
    }
    if wrong.is_empty() {
        Ok(n)
    } else {
        Err(wrong.join("\n"))
    }
}

/// Waits until the coordinator counts `n` serving workers of `role`.
pub fn serving(http: &str, role: &str, n: f64, within: Duration) -> Result<(), String> {
    wait_for(within, &format!("{n} {role} workers serving"), || {
        let v = metric(http, facts::metrics::coordinator::WORKERS, &[("role", role), ("state", "serving")])?;
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
