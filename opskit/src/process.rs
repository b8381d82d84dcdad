//! Child processes of a test: a workspace binary found beside the test executable
//! ([`bin`]), started with its stderr in a log file, its `listening NAME=ADDR` stdout lines
//! read within a bound ([`Launch`]), signalled by pid, and SIGKILLed and reaped when its
//! [`Proc`] is dropped, also when the test panics (then its log's tail is printed, so a
//! failure shows what the process said).
//!
//! Every tandem process prints `listening NAME=ADDR [NAME=ADDR ...]` once a listener is
//! bound; tests bind port 0 and learn the port from that line, so tests run in parallel.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::Duration;
use tokio::time::Instant;

use crate::{Error, Result};
use facts::state::{Action, Actions};

/// How long one action's command may run (a `kubectl` or `ssh` template crosses a network).
pub const ACTION_WAIT: Duration = Duration::from_secs(30);

/// Runs `command` with `sh -c`, bounded by `limit` (then killed); its stdout, or an error
/// naming the command, its status and its stderr.
pub fn run_shell(command: &str, limit: Duration) -> Result<String> {
    let mut child = Command::new("sh")
        .args(["-c", command])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| Error::Process(format!("`{command}`: sh did not start: {e}")))?;
    let until = Instant::now() + limit;
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if Instant::now() > until => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(Error::Timeout(format!("`{command}` did not finish within {limit:?}")));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => return Err(Error::Process(format!("`{command}`: {e}"))),
        }
    }
    let out = child.wait_with_output().map_err(|e| Error::Process(format!("`{command}`: {e}")))?;
    if !out.status.success() {
        return Err(Error::Process(format!(
            "`{command}` failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// How long a process may take to print its addresses by default (a model load on a busy
/// 2-core machine).
pub const START_WAIT: Duration = Duration::from_secs(120);

/// A signal sent with `kill(1)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Signal {
    Kill,
    Term,
    Int,
    Stop,
    Cont,
}

impl Signal {
    /// The state file's action that sends it.
    pub fn action(self) -> Option<Action> {
        match self {
            Signal::Kill => Some(Action::Kill),
            Signal::Term => Some(Action::Term),
            Signal::Stop => Some(Action::Stop),
            Signal::Cont => Some(Action::Cont),
            Signal::Int => None,
        }
    }

    fn flag(self) -> &'static str {
        match self {
            Signal::Kill => "-KILL",
            Signal::Term => "-TERM",
            Signal::Int => "-INT",
            Signal::Stop => "-STOP",
            Signal::Cont => "-CONT",
        }
    }
}

/// Sends `sig` to `pid`.
pub fn signal(pid: u32, sig: Signal) -> Result<()> {
    let status = Command::new("kill")
        .args([sig.flag(), &pid.to_string()])
        .status()
        .map_err(|e| Error::Process(format!("kill {} {pid}: {e}", sig.flag())))?;
    if status.success() {
        Ok(())
    } else {
        Err(Error::Process(format!("kill {} {pid} failed: {status}", sig.flag())))
    }
}

/// A binary of this workspace beside the running test executable
/// (`target/debug/deps/x` → `target/debug/NAME`; also `target/debug/x`). The error says
/// how to build it: cargo builds only the tested package's own binaries for its tests.
pub fn bin(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe().map_err(|e| Error::Process(format!("current_exe: {e}")))?;
    for dir in exe.ancestors().skip(1).take(2) {
        let path = dir.join(name);
        if path.is_file() {
            return Ok(path);
        }
    }
    Err(Error::Process(format!(
        "{name} is not built beside {}: run `cargo build --workspace --bins` (make test does)",
        exe.display()
    )))
}

/// The state letter of `/proc/PID/stat` (`R`, `S`, `T` stopped, `Z` zombie), or `None`
/// when the pid is gone.
pub fn proc_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `pid (comm) S ...`: comm may hold spaces and parentheses; the state follows the last `)`.
    stat.rsplit_once(')')?.1.split_whitespace().next()?.chars().next()
}

/// A kB field of `/proc/PID/status` (`"VmRSS"`, `"RssAnon"`, `"VmHWM"`), in KiB; `None`
/// when the pid is gone or has no such field. `RssAnon` is where a leak grows (the heap
/// and private mappings), not `VmRSS`, which also counts the file pages a process maps
/// in as it first touches them (the model's rows) and shared memory.
pub fn status_kib(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':')?.trim().strip_suffix("kB")?.trim().parse().ok())
}

/// Running and not stopped (a zombie, a stopped or a vanished process is not).
pub fn running(pid: u32) -> bool {
    !matches!(proc_state(pid), None | Some('Z' | 'T'))
}

/// Resident pages of one process, in kB, summed per mapped file (keyed by path; every
/// anonymous mapping under ""), from `/proc/PID/smaps`: `Rss`, its proportional share
/// (`Pss`: a page mapped by n processes counts 1/n), and of those the pages only this
/// process maps (`Private_*`) and those others map too (`Shared_*`). Memory that
/// processes share shows here, where RSS counts it in full in each.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Pages {
    pub rss_kb: u64,
    pub pss_kb: u64,
    pub private_kb: u64,
    pub shared_kb: u64,
}

/// [`Pages`] of `pid` per mapped file.
pub fn mapped_pages(pid: u32) -> Result<HashMap<String, Pages>> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps"))
        .map_err(|e| Error::Process(format!("reading /proc/{pid}/smaps: {e}")))?;
    let mut by = HashMap::<String, Pages>::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        // A mapping's header: `start-end perms offset dev inode [path]`.
        let header =
            fields.first().is_some_and(|f| f.contains('-') && f.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-'));
        if header {
            let inode = fields.get(4).copied().unwrap_or("0");
            current = Some(if inode == "0" { String::new() } else { fields.get(5..).unwrap_or_default().join(" ") });
            continue;
        }
        let (Some(key), Some(kb), Some(name)) = (fields.first(), fields.get(1), current.as_ref()) else { continue };
        let Ok(kb) = kb.parse::<u64>() else { continue };
        let p = by.entry(name.clone()).or_default();
        match *key {
            "Rss:" => p.rss_kb += kb,
            "Pss:" => p.pss_kb += kb,
            "Private_Clean:" | "Private_Dirty:" => p.private_kb += kb,
            "Shared_Clean:" | "Shared_Dirty:" => p.shared_kb += kb,
            _ => {}
        }
    }
    Ok(by)
}

/// The pid among `pids` owning the TCP socket whose local address is `local` (IPv4), found
/// through each pid's `/proc/PID/net/tcp` (its own network namespace's table) and `/proc/PID/fd`.
pub fn socket_owner(local: std::net::SocketAddr, pids: &[u32]) -> Option<u32> {
    let std::net::SocketAddr::V4(v4) = local else { return None };
    // /proc/net/tcp shows the address as the in-memory u32 (little-endian here) and the port big-endian.
    let want = format!("{:08X}:{:04X}", u32::from_le_bytes(v4.ip().octets()), v4.port());
    pids.iter().copied().find(|pid| {
        // Each process's own table: it may run in another network namespace.
        let Ok(table) = std::fs::read_to_string(format!("/proc/{pid}/net/tcp")) else { return false };
        // Every row with that local address: an earlier connection from the same port to
        // another peer may linger in TIME_WAIT (inode 0, owned by no process) before the live one.
        let links: Vec<String> = table
            .lines()
            .skip(1)
            .filter_map(|l| {
                let cols: Vec<&str> = l.split_whitespace().collect();
                let inode = cols.get(9).filter(|i| **i != "0")?;
                (cols.get(1) == Some(&want.as_str())).then(|| format!("socket:[{inode}]"))
            })
            .collect();
        !links.is_empty()
            && std::fs::read_dir(format!("/proc/{pid}/fd")).is_ok_and(|dir| {
                dir.filter_map(Result::ok).any(|e| {
                    std::fs::read_link(e.path()).is_ok_and(|t| links.iter().any(|l| t.to_string_lossy() == *l))
                })
            })
    })
}

/// `n` distinct free loopback ports, held together while probing so they differ (two
/// probes one after the other may both get the port the first released). Free when
/// returned: a process that binds them later may race another for them.
pub fn free_ports(n: usize) -> std::io::Result<Vec<u16>> {
    let listeners = (0..n)
        .map(|_| std::net::TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0)))
        .collect::<std::io::Result<Vec<_>>>()?;
    listeners.iter().map(|l| l.local_addr().map(|a| a.port())).collect()
}

/// Where a started process's stderr goes.
#[derive(Debug, Clone)]
enum Stderr {
    /// A fresh file under the temporary directory (the default).
    Temp,
    /// `DIR/NAME.log`.
    Dir(PathBuf),
    /// This file.
    File(PathBuf),
    /// The test's own stderr (no log file to scan or show).
    Inherit,
}

/// How to start a process; [`Launch::start`] starts it.
#[derive(Debug, Clone)]
pub struct Launch {
    name: String,
    /// A binary name for [`bin`], or a path.
    program: Program,
    args: Vec<String>,
    wants: Vec<String>,
    until_line: Option<String>,
    prefix: Vec<String>,
    env: Vec<(String, String)>,
    stderr: Stderr,
    wait: Duration,
}

#[derive(Debug, Clone)]
enum Program {
    Bin(String),
    Path(PathBuf),
}

impl Launch {
    /// The workspace binary `name` (found by [`bin`] at start); the process is named after it.
    pub fn bin(name: &str) -> Self {
        Self::new(name, Program::Bin(name.to_owned()))
    }

    /// The program at `path` (e.g. `env!("CARGO_BIN_EXE_...")`).
    pub fn path(path: impl Into<PathBuf>) -> Self {
        let path = path.into();
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        Self::new(&name, Program::Path(path))
    }

    fn new(name: &str, program: Program) -> Self {
        Self {
            name: name.to_owned(),
            program,
            args: Vec::new(),
            wants: Vec::new(),
            until_line: None,
            prefix: Vec::new(),
            env: Vec::new(),
            stderr: Stderr::Temp,
            wait: START_WAIT,
        }
    }

    /// Its name in messages and its log's name (`prefill-0`, `coordinator`).
    pub fn name(mut self, name: &str) -> Self {
        self.name = name.to_owned();
        self
    }

    pub fn arg(mut self, arg: impl AsRef<str>) -> Self {
        self.args.push(arg.as_ref().to_owned());
        self
    }

    pub fn args<S: AsRef<str>>(mut self, args: impl IntoIterator<Item = S>) -> Self {
        self.args.extend(args.into_iter().map(|a| a.as_ref().to_owned()));
        self
    }

    /// Waits for a `listening NAME=ADDR` line for each of `names`.
    pub fn wants(mut self, names: &[&str]) -> Self {
        self.wants = names.iter().map(|n| (*n).to_owned()).collect();
        self
    }

    /// Also waits for a stdout line starting with `prefix` (a process that announces
    /// readiness otherwise, like `tandem up`'s table).
    pub fn until_line(mut self, prefix: &str) -> Self {
        self.until_line = Some(prefix.to_owned());
        self
    }

    /// Runs it as `PREFIX... PROGRAM ARGS...` (e.g. `ip netns exec NAME`). The prefix must
    /// exec the program (not fork it), so the pid is the program's own.
    pub fn prefix(mut self, prefix: &[String]) -> Self {
        self.prefix = prefix.to_vec();
        self
    }

    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.to_owned(), value.to_owned()));
        self
    }

    /// Stderr to `dir/NAME.log`.
    pub fn log_dir(mut self, dir: &Path) -> Self {
        self.stderr = Stderr::Dir(dir.to_owned());
        self
    }

    /// Stderr to `path`.
    pub fn log_file(mut self, path: &Path) -> Self {
        self.stderr = Stderr::File(path.to_owned());
        self
    }

    /// Stderr to the test's own (shown by the test runner on failure; nothing to scan).
    pub fn inherit_stderr(mut self) -> Self {
        self.stderr = Stderr::Inherit;
        self
    }

    /// The bound on printing the wanted lines (default [`START_WAIT`]).
    pub fn wait(mut self, limit: Duration) -> Self {
        self.wait = limit;
        self
    }

    /// The log file it will write (none when stderr is inherited). Without a choice, a
    /// fresh file under the temporary directory.
    fn log_path(&self) -> Option<PathBuf> {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        match &self.stderr {
            Stderr::Temp => {
                let dir = std::env::temp_dir().join(format!("opskit-{}", std::process::id()));
                Some(dir.join(format!("{}-{}.log", self.name, SEQ.fetch_add(1, Ordering::Relaxed))))
            }
            Stderr::Dir(dir) => Some(dir.join(format!("{}.log", self.name))),
            Stderr::File(f) => Some(f.clone()),
            Stderr::Inherit => None,
        }
    }

    /// Spawns it; the waiting is left to the caller.
    fn spawn(self) -> Result<(Proc, mpsc::Receiver<String>)> {
        let log = self.log_path();
        let err = match &log {
            Some(path) => {
                if let Some(dir) = path.parent() {
                    std::fs::create_dir_all(dir).map_err(|e| Error::io(format!("create {}", dir.display()), e))?;
                }
                Stdio::from(File::create(path).map_err(|e| Error::io(format!("create {}", path.display()), e))?)
            }
            None => Stdio::inherit(),
        };
        let path = match &self.program {
            Program::Bin(name) => bin(name)?,
            Program::Path(p) => p.clone(),
        };
        let mut command = match self.prefix.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(&path);
                c
            }
            None => Command::new(&path),
        };
        let mut child = command
            .args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(err)
            .spawn()
            .map_err(|e| Error::Process(format!("spawn {} ({}): {e}", self.name, path.display())))?;
        let stdout = child.stdout.take();
        let pid = child.id();
        let p = Proc {
            name: self.name.clone(),
            pid,
            child: Some(child),
            addrs: HashMap::new(),
            log: log.unwrap_or_default(),
            exit: None,
            launch: Some(self),
            past_logs: Vec::new(),
            adopted: false,
            actions: None,
        };
        let Some(stdout) = stdout else { return Err(Error::Process(format!("{}: no stdout pipe", p.name))) };
        let (tx, rx) = mpsc::channel();
        // Keeps draining stdout for the process's life, so it never blocks on a full pipe.
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(std::result::Result::ok) {
                let _ = tx.send(line);
            }
        });
        Ok((p, rx))
    }

    /// Starts it and waits (on a blocking thread) until it printed what it must.
    pub async fn start(self) -> Result<Proc> {
        let waiter = self.clone();
        let (p, rx) = self.spawn()?;
        let waited = tokio::task::spawn_blocking(move || waiter.wait_ready(&rx))
            .await
            .map_err(|e| Error::Process(format!("waiting for {}: {e}", p.name)))?;
        p.ready(waited)
    }

    /// [`Launch::start`] from sync code.
    pub fn start_blocking(self) -> Result<Proc> {
        let waiter = self.clone();
        let (p, rx) = self.spawn()?;
        p.ready(waiter.wait_ready(&rx))
    }

    /// Reads lines until every wanted address (and the wanted line) was printed.
    fn wait_ready(&self, rx: &mpsc::Receiver<String>) -> std::result::Result<HashMap<String, String>, Waited> {
        let until = Instant::now() + self.wait;
        let mut addrs = HashMap::new();
        let mut line_seen = self.until_line.is_none();
        let mut lines = Vec::new();
        loop {
            let missing = self.wants.iter().find(|w| !addrs.contains_key(*w));
            let waiting_for = match (missing, &self.until_line) {
                (Some(w), _) => format!("`listening {w}=`"),
                (None, Some(l)) if !line_seen => format!("a line starting `{l}`"),
                _ => return Ok(addrs),
            };
            let left = until.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) => {
                    if let Some(pairs) = line.strip_prefix("listening ") {
                        for (k, v) in pairs.split_whitespace().filter_map(|p| p.split_once('=')) {
                            addrs.insert(k.to_owned(), v.to_owned());
                        }
                    }
                    if self.until_line.as_ref().is_some_and(|l| line.starts_with(l.as_str())) {
                        line_seen = true;
                    }
                    if lines.len() < 40 {
                        lines.push(line);
                    }
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => return Err(Waited::Exited { waiting_for, lines }),
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    return Err(Waited::Timeout { waiting_for, limit: self.wait, lines })
                }
            }
        }
    }
}

/// Why a start's wait ended without what it wanted.
enum Waited {
    Exited { waiting_for: String, lines: Vec<String> },
    Timeout { waiting_for: String, limit: Duration, lines: Vec<String> },
}

/// A running child; SIGKILLed (by its pid) and reaped when dropped. An *adopted* process
/// ([`Proc::adopt`]: one found running, not our child) is never killed on drop, has the log
/// its starter gave it (if any), and its exit is seen through `/proc`.
#[derive(Debug)]
pub struct Proc {
    /// A name unique among a test's processes (`prefill-0`, `decode-1`, `coordinator`).
    pub name: String,
    pub pid: u32,
    child: Option<Child>,
    addrs: HashMap<String, String>,
    /// Its stderr's file (empty: inherited, or an adopted process without one).
    log: PathBuf,
    /// How it ended, once reaped.
    exit: Option<ExitStatus>,
    /// What started it, for [`Proc::restart`] (`None`: adopted).
    launch: Option<Launch>,
    /// Logs of its earlier lives (before a restart).
    past_logs: Vec<PathBuf>,
    /// Not our child: found running ([`Proc::adopt`]); left running when dropped.
    adopted: bool,
    /// How to act on it ([`Proc::with_actions`]); `None`: signals by pid.
    actions: Option<Actions>,
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
            // A failing test shows what its processes said.
            if std::thread::panicking() && !self.log.as_os_str().is_empty() {
                eprintln!(
                    "--- {} (pid {}) log tail, {} ---\n{}",
                    self.name,
                    self.pid,
                    self.log.display(),
                    self.log_tail()
                );
            }
        }
    }
}

impl Proc {
    /// Starts workspace binary `bin_name` with `args`, stderr to `log_dir/NAME.log`, and
    /// waits until it printed an address for each of `wants`.
    pub async fn start(name: &str, bin_name: &str, args: &[String], wants: &[&str], log_dir: &Path) -> Result<Self> {
        Launch::bin(bin_name).name(name).args(args).wants(wants).log_dir(log_dir).start().await
    }

    /// [`Proc::start`] through `prefix` (see [`Launch::prefix`]).
    pub async fn start_with(
        prefix: &[String],
        name: &str,
        bin_name: &str,
        args: &[String],
        wants: &[&str],
        log_dir: &Path,
    ) -> Result<Self> {
        Launch::bin(bin_name).name(name).prefix(prefix).args(args).wants(wants).log_dir(log_dir).start().await
    }

    /// Records what the wait found, or turns its failure into an error (the process is
    /// killed when `self` drops).
    fn ready(mut self, waited: std::result::Result<HashMap<String, String>, Waited>) -> Result<Self> {
        match waited {
            Ok(addrs) => {
                self.addrs = addrs;
                Ok(self)
            }
            Err(Waited::Exited { waiting_for, lines }) => {
                let how =
                    self.wait_exit_blocking(Duration::from_secs(5)).map_or_else(|e| e.to_string(), |s| s.to_string());
                Err(Error::Process(format!(
                    "{} (pid {}) exited ({how}) before printing {waiting_for}; its stdout: {lines:?}; log tail:\n{}",
                    self.name,
                    self.pid,
                    self.log_tail()
                )))
            }
            Err(Waited::Timeout { waiting_for, limit, lines }) => Err(Error::Timeout(format!(
                "{} (pid {}) did not print {waiting_for} within {limit:?}; its stdout: {lines:?}; log tail:\n{}",
                self.name,
                self.pid,
                self.log_tail()
            ))),
        }
    }

    /// A process already running (not started here, e.g. one `tandem up` started), known by
    /// its pid, addresses and the file its output goes to (`log`). Dropping it leaves it
    /// running; [`Proc::exited`] sees its end through `/proc`; it cannot be restarted.
    pub fn adopt(name: &str, pid: u32, addrs: HashMap<String, String>, log: Option<PathBuf>) -> Self {
        Self {
            name: name.to_owned(),
            pid,
            child: None,
            addrs,
            log: log.unwrap_or_default(),
            exit: None,
            launch: None,
            past_logs: Vec::new(),
            adopted: true,
            actions: None,
        }
    }

    /// Acts on it through `actions`' command templates (a state file's) instead of by pid:
    /// [`Proc::signal`] runs the `kill`, `stop`, `cont` or `term` template.
    pub fn with_actions(mut self, actions: Actions) -> Self {
        self.actions = Some(actions);
        self
    }

    /// Its action templates, when it is acted on through them.
    pub fn actions(&self) -> Option<&Actions> {
        self.actions.as_ref()
    }

    /// Does `a` to it through its template (`cmd` fills `{cmd}`); its output. Err: it has
    /// no templates, none for `a`, or the command failed.
    pub fn act(&self, a: Action, cmd: Option<&str>) -> Result<String> {
        let actions = self.actions.as_ref().ok_or_else(|| {
            Error::Process(format!("{} (pid {}) has no action templates: no `{}`", self.name, self.pid, a.as_str()))
        })?;
        let command = actions.command(a, self.pid, cmd).map_err(Error::Process)?;
        run_shell(&command, ACTION_WAIT).map_err(|e| Error::Process(format!("{}: {e}", self.name)))
    }

    /// An adopted process its supervisor started again (on the same addresses, appending to
    /// the same log): follow its new `pid` from now on.
    pub fn supervisor_restarted(&mut self, pid: u32) -> Result<()> {
        if !self.adopted {
            return Err(Error::Process(format!(
                "{} (pid {}) is this test's child: no supervisor restarts it",
                self.name, self.pid
            )));
        }
        self.pid = pid;
        self.exit = None;
        Ok(())
    }

    /// Whether it was adopted ([`Proc::adopt`]) rather than started.
    pub fn is_adopted(&self) -> bool {
        self.adopted
    }

    /// The address it printed as `listening NAME=ADDR`.
    pub fn addr(&self, name: &str) -> Result<String> {
        self.addrs.get(name).cloned().ok_or_else(|| Error::Process(format!("{}: no `{name}` address", self.name)))
    }

    /// [`Proc::addr`] as a socket address.
    pub fn socket_addr(&self, name: &str) -> Result<std::net::SocketAddr> {
        let a = self.addr(name)?;
        a.parse().map_err(|e| Error::Process(format!("{}: `{name}` address {a:?} is not host:port: {e}", self.name)))
    }

    /// Its stderr's file (empty when inherited).
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// Its current log and those of its earlier lives.
    pub fn log_paths(&self) -> impl Iterator<Item = &Path> {
        let current = (!self.log.as_os_str().is_empty()).then_some(self.log.as_path());
        self.past_logs.iter().map(PathBuf::as_path).chain(current)
    }

    /// The flags it was started with.
    pub fn args(&self) -> &[String] {
        self.launch.as_ref().map_or(&[], |l| l.args.as_slice())
    }

    /// The end of its log (empty without one).
    pub fn log_tail(&self) -> String {
        if self.log.as_os_str().is_empty() {
            return String::new();
        }
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let mut start = text.len().saturating_sub(3000);
        while !text.is_char_boundary(start) {
            start += 1;
        }
        text[start..].to_owned()
    }

    /// Starts it again, same name and program, with `args` (its old flags when `None`),
    /// once it has exited; the old log is kept as `NAME.PID.log`.
    pub async fn restart(&mut self, args: Option<Vec<String>>) -> Result<()> {
        let Some(mut launch) = self.launch.clone() else {
            return Err(Error::Process(format!(
                "{} (pid {}) was not started by this test: not restarting it",
                self.name, self.pid
            )));
        };
        if self.exited().is_none() {
            return Err(Error::Process(format!(
                "{} (pid {}) is still running: not restarting it",
                self.name, self.pid
            )));
        }
        let mut past = std::mem::take(&mut self.past_logs);
        if !self.log.as_os_str().is_empty() {
            let old = self.log.with_file_name(format!("{}.{}.log", self.name, self.pid));
            std::fs::rename(&self.log, &old)
                .map_err(|e| Error::io(format!("keep {}'s log as {}", self.name, old.display()), e))?;
            past.push(old);
            launch.stderr = Stderr::File(self.log.clone());
        }
        if let Some(args) = args {
            launch.args = args;
        }
        let mut next = launch.start().await?;
        next.past_logs = past;
        *self = next;
        Ok(())
    }

    /// Sends `sig` to it: through its action template when it has templates
    /// ([`Proc::with_actions`]), else by pid.
    pub fn signal(&self, sig: Signal) -> Result<()> {
        if let (Some(_), Some(a)) = (&self.actions, sig.action()) {
            return self.act(a, None).map(drop);
        }
        signal(self.pid, sig).map_err(|e| Error::Process(format!("{}: {e}", self.name)))
    }

    /// Whether it has exited (reaping it if so). An adopted process is not ours to reap: once
    /// `/proc` shows it gone (or a zombie) its status is unknown and reported as 0.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        if self.adopted && self.exit.is_none() && matches!(proc_state(self.pid), None | Some('Z')) {
            use std::os::unix::process::ExitStatusExt;
            self.exit = Some(ExitStatus::from_raw(0));
        }
        if self.exit.is_none() {
            if let Some(c) = self.child.as_mut() {
                if let Ok(Some(st)) = c.try_wait() {
                    self.exit = Some(st);
                    self.child = None;
                }
            }
        }
        self.exit
    }

    /// Waits up to `limit` for it to exit; the error says it did not.
    pub async fn wait_exit(&mut self, limit: Duration) -> Result<ExitStatus> {
        let until = tokio::time::Instant::now() + limit;
        loop {
            if let Some(st) = self.exited() {
                return Ok(st);
            }
            if tokio::time::Instant::now() > until {
                return Err(Error::Timeout(format!("{} (pid {}) did not exit within {limit:?}", self.name, self.pid)));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// [`Proc::wait_exit`] from sync code.
    pub fn wait_exit_blocking(&mut self, limit: Duration) -> Result<ExitStatus> {
        let until = Instant::now() + limit;
        loop {
            if let Some(st) = self.exited() {
                return Ok(st);
            }
            if Instant::now() > until {
                return Err(Error::Timeout(format!("{} (pid {}) did not exit within {limit:?}", self.name, self.pid)));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL, then reap (bounded).
    pub async fn kill9(&mut self) -> Result<ExitStatus> {
        self.signal(Signal::Kill)?;
        self.wait_exit(Duration::from_secs(10)).await
    }

    /// [`Proc::kill9`] from sync code.
    pub fn kill9_blocking(&mut self) -> Result<ExitStatus> {
        self.signal(Signal::Kill)?;
        self.wait_exit_blocking(Duration::from_secs(10))
    }

    /// SIGTERM, and its exit within `limit`; past that it is SIGKILLed and the error says so.
    pub fn stop_blocking(&mut self, limit: Duration) -> Result<ExitStatus> {
        if let Some(st) = self.exited() {
            return Ok(st);
        }
        self.signal(Signal::Term)?;
        self.wait_exit_blocking(limit).inspect_err(|_| {
            let _ = self.kill9_blocking();
        })
    }
}

#[cfg(test)]
mod tests;
