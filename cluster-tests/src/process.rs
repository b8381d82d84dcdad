//! One child process of a drill's cluster: started from this workspace's
//! binaries, its `listening NAME=ADDR` lines read from stdout, its stderr
//! kept in a log file (scanned for panics), signalled and killed by pid.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use tokio::sync::mpsc;

use crate::HarnessError;

/// How long a process may take to print its addresses (model load on a busy 2-core machine).
pub const START_WAIT: Duration = Duration::from_secs(120);

/// A signal sent with `kill(1)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Signal {
    Kill,
    Term,
    Stop,
    Cont,
}

impl Signal {
    fn flag(self) -> &'static str {
        match self {
            Signal::Kill => "-KILL",
            Signal::Term => "-TERM",
            Signal::Stop => "-STOP",
            Signal::Cont => "-CONT",
        }
    }
}

/// A running child; SIGKILLed (by its pid) and reaped when dropped. An *adopted* process
/// ([`Proc::adopt`]: one of a running cluster's, not our child) is never killed on drop,
/// has the log its starter gave it (if any), and its exit is seen through `/proc`.
#[derive(Debug)]
pub struct Proc {
    /// A name unique in its cluster (`prefill-0`, `decode-1`, `coordinator`).
    pub name: String,
    pub pid: u32,
    child: Option<Child>,
    addrs: HashMap<String, String>,
    log: PathBuf,
    /// How it ended, once reaped.
    exit: Option<ExitStatus>,
    /// What started it, for [`Proc::restart`].
    bin_name: String,
    args: Vec<String>,
    wants: Vec<String>,
    /// The command it runs under (`ip netns exec NAME`), if any.
    prefix: Vec<String>,
    /// Logs of its earlier lives (before a restart), still scanned for panics.
    past_logs: Vec<PathBuf>,
    /// Not our child: found running ([`Proc::adopt`]); left running when dropped.
    adopted: bool,
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A binary of this workspace, next to the running executable's target directory
/// (`target/debug/deps/x` → `target/debug/NAME`; also `target/debug/x`).
pub fn bin(name: &str) -> Result<PathBuf, HarnessError> {
    let exe = std::env::current_exe().map_err(|e| HarnessError::Setup(format!("current_exe: {e}")))?;
    for dir in exe.ancestors().skip(1).take(2) {
        let path = dir.join(name);
        if path.is_file() {
            return Ok(path);
        }
    }
    Err(HarnessError::Setup(format!(
        "{name} is not built next to {}: run `cargo build --workspace --bins`",
        exe.display()
    )))
}

impl Proc {
    /// Starts binary `bin_name` with `args`, stderr to `log_dir/NAME.log`, and waits until it
    /// printed an address for each of `wants`.
    pub async fn start(
        name: &str,
        bin_name: &str,
        args: &[String],
        wants: &[&str],
        log_dir: &Path,
    ) -> Result<Self, HarnessError> {
        Self::start_with(&[], name, bin_name, args, wants, log_dir).await
    }

    /// [`Proc::start`] through `prefix` (e.g. a [`crate::Netns::exec_prefix`]): runs
    /// `PREFIX... BIN ARGS...`. The prefix must exec the binary (not fork it), so the
    /// pid is the binary's own.
    pub async fn start_with(
        prefix: &[String],
        name: &str,
        bin_name: &str,
        args: &[String],
        wants: &[&str],
        log_dir: &Path,
    ) -> Result<Self, HarnessError> {
        let log = log_dir.join(format!("{name}.log"));
        let err = File::create(&log).map_err(|e| HarnessError::Setup(format!("create {}: {e}", log.display())))?;
        let path = bin(bin_name)?;
        let mut command = match prefix.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(&path);
                c
            }
            None => Command::new(&path),
        };
        let mut child = command
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(err))
            .spawn()
            .map_err(|e| HarnessError::Setup(format!("spawn {bin_name}: {e}")))?;
        let stdout = child.stdout.take();
        let pid = child.id();
        let mut p = Self {
            name: name.to_owned(),
            pid,
            child: Some(child),
            addrs: HashMap::new(),
            log,
            exit: None,
            bin_name: bin_name.to_owned(),
            args: args.to_vec(),
            wants: wants.iter().map(|w| (*w).to_owned()).collect(),
            prefix: prefix.to_vec(),
            past_logs: Vec::new(),
            adopted: false,
        };
        let Some(stdout) = stdout else { return Err(HarnessError::Setup(format!("{name}: no stdout pipe"))) };
        let (tx, mut rx) = mpsc::unbounded_channel();
        // Keeps draining stdout for the process's life, so it never blocks on a full pipe.
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let Some(pairs) = line.strip_prefix("listening ") else { continue };
                for (k, v) in pairs.split_whitespace().filter_map(|p| p.split_once('=')) {
                    let _ = tx.send((k.to_owned(), v.to_owned()));
                }
            }
        });
        while let Some(missing) = wants.iter().find(|w| !p.addrs.contains_key(**w)) {
            match tokio::time::timeout(START_WAIT, rx.recv()).await {
                Ok(Some((k, v))) => {
                    p.addrs.insert(k, v);
                }
                Ok(None) => {
                    return Err(HarnessError::Setup(format!(
                        "{name} ({bin_name}) exited before printing `listening {missing}=`; log tail:\n{}",
                        p.log_tail()
                    )))
                }
                Err(_) => {
                    return Err(HarnessError::Timeout(format!(
                        "{name} did not print `listening {missing}=` within {START_WAIT:?}"
                    )))
                }
            }
        }
        Ok(p)
    }

    /// A process already running (not started by us, e.g. one `tandem up` started), known by
    /// its pid, addresses and the file its output goes to (`log`; `None`: G5's log scan
    /// skips it). Dropping it leaves it running; [`Proc::exited`] sees its end through
    /// `/proc`; it cannot be restarted. G5 scans its log from where it stood when the
    /// cluster was attached ([`crate::Cluster::log_start`]).
    pub fn adopt(name: &str, pid: u32, addrs: HashMap<String, String>, log: Option<PathBuf>) -> Self {
        Self {
            name: name.to_owned(),
            pid,
            child: None,
            addrs,
            log: log.unwrap_or_default(),
            exit: None,
            bin_name: String::new(),
            args: Vec::new(),
            wants: Vec::new(),
            prefix: Vec::new(),
            past_logs: Vec::new(),
            adopted: true,
        }
    }

    /// An adopted process its supervisor started again (`tandem up` restarts a process on the
    /// same addresses, appending to the same log): follow its new `pid` from now on.
    pub fn supervisor_restarted(&mut self, pid: u32) -> Result<(), HarnessError> {
        if !self.adopted {
            return Err(HarnessError::Fault(format!(
                "{} (pid {}) is this drill's child: no supervisor restarts it",
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
    pub fn addr(&self, name: &str) -> Result<String, HarnessError> {
        self.addrs.get(name).cloned().ok_or_else(|| HarnessError::Setup(format!("{}: no `{name}` address", self.name)))
    }

    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// Its current log and those of its earlier lives (an adopted process: the log it was
    /// adopted with, if any).
    pub fn log_paths(&self) -> impl Iterator<Item = &Path> {
        let current = (!self.log.as_os_str().is_empty()).then_some(self.log.as_path());
        self.past_logs.iter().map(PathBuf::as_path).chain(current)
    }

    /// The flags it was started with.
    pub fn args(&self) -> &[String] {
        &self.args
    }

    /// Starts it again, same name and binary, with `args` (its old flags when `None`),
    /// once it has exited; the old log is kept as `NAME.PID.log` (still scanned for panics).
    pub async fn restart(&mut self, args: Option<Vec<String>>) -> Result<(), HarnessError> {
        if self.adopted {
            return Err(HarnessError::Fault(format!(
                "{} (pid {}) was not started by this drill: not restarting it",
                self.name, self.pid
            )));
        }
        if self.exited().is_none() {
            return Err(HarnessError::Fault(format!(
                "{} (pid {}) is still running: not restarting it",
                self.name, self.pid
            )));
        }
        let dir = self.log.parent().map(Path::to_owned).unwrap_or_default();
        let old = dir.join(format!("{}.{}.log", self.name, self.pid));
        std::fs::rename(&self.log, &old)
            .map_err(|e| HarnessError::Setup(format!("keep {}'s log as {}: {e}", self.name, old.display())))?;
        let args = args.unwrap_or_else(|| self.args.clone());
        let wants: Vec<&str> = self.wants.iter().map(String::as_str).collect();
        let mut next = Self::start_with(&self.prefix, &self.name, &self.bin_name, &args, &wants, &dir).await?;
        next.past_logs = std::mem::take(&mut self.past_logs);
        next.past_logs.push(old);
        *self = next;
        Ok(())
    }

    pub fn log_tail(&self) -> String {
        if self.log.as_os_str().is_empty() {
            return String::new();
        }
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let start = text.len().saturating_sub(2000);
        text.get(start..).unwrap_or(&text).to_owned()
    }

    /// Sends `sig` to the process by pid.
    pub fn signal(&self, sig: Signal) -> Result<(), HarnessError> {
        let status = Command::new("kill")
            .args([sig.flag(), &self.pid.to_string()])
            .status()
            .map_err(|e| HarnessError::Fault(format!("kill {} {}: {e}", sig.flag(), self.pid)))?;
        if status.success() {
            Ok(())
        } else {
            Err(HarnessError::Fault(format!("kill {} {} ({}) failed: {status}", sig.flag(), self.pid, self.name)))
        }
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
    pub async fn wait_exit(&mut self, limit: Duration) -> Result<ExitStatus, HarnessError> {
        let until = tokio::time::Instant::now() + limit;
        loop {
            if let Some(st) = self.exited() {
                return Ok(st);
            }
            if tokio::time::Instant::now() > until {
                return Err(HarnessError::Timeout(format!(
                    "{} (pid {}) did not exit within {limit:?}",
                    self.name, self.pid
                )));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGKILL, then reap (bounded).
    pub async fn kill9(&mut self) -> Result<ExitStatus, HarnessError> {
        self.signal(Signal::Kill)?;
        self.wait_exit(Duration::from_secs(10)).await
    }
}

/// The state letter of `/proc/PID/stat` (`R`, `S`, `T` stopped, `Z` zombie), or `None`
/// when the pid is gone.
pub fn proc_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `pid (comm) S ...`: comm may hold spaces and parentheses; the state follows the last `)`.
    stat.rsplit_once(')')?.1.split_whitespace().next()?.chars().next()
}

/// The pid among `pids` owning the TCP socket whose local address is `local` (loopback IPv4),
/// found through `/proc/net/tcp` and each pid's `/proc/PID/fd`.
pub fn socket_owner(local: std::net::SocketAddr, pids: &[u32]) -> Option<u32> {
    let std::net::SocketAddr::V4(v4) = local else { return None };
    // /proc/net/tcp shows the address as the in-memory u32 (little-endian here) and the port big-endian.
    let want = format!("{:08X}:{:04X}", u32::from_le_bytes(v4.ip().octets()), v4.port());
    let table = std::fs::read_to_string("/proc/net/tcp").ok()?;
    let inode = table.lines().skip(1).find_map(|l| {
        let cols: Vec<&str> = l.split_whitespace().collect();
        (cols.get(1) == Some(&want.as_str())).then(|| cols.get(9).map(|s| (*s).to_owned())).flatten()
    })?;
    let link = format!("socket:[{inode}]");
    pids.iter().copied().find(|pid| {
        std::fs::read_dir(format!("/proc/{pid}/fd")).is_ok_and(|dir| {
            dir.filter_map(Result::ok).any(|e| std::fs::read_link(e.path()).is_ok_and(|t| t.to_string_lossy() == link))
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_adopted_process_is_left_running_and_its_exit_seen_through_proc() {
        let mut child = Command::new("sleep").arg("60").spawn().expect("spawn sleep");
        let pid = child.id();
        let addrs = HashMap::from([("http".to_owned(), "127.0.0.1:1".to_owned())]);
        let mut p = Proc::adopt("adopted", pid, addrs, None);
        assert!(p.is_adopted());
        assert_eq!(p.addr("http").expect("addr"), "127.0.0.1:1");
        assert_eq!(p.log_paths().count(), 0, "no log to scan");
        assert!(p.exited().is_none());
        drop(p);
        assert!(matches!(proc_state(pid), Some(s) if s != 'Z'), "dropping an adopted process must not kill it");
        let mut p = Proc::adopt("adopted", pid, HashMap::new(), None);
        assert!(p.restart(None).await.is_err(), "not ours to restart");
        p.signal(Signal::Kill).expect("kill");
        // Our child here, so reap it; an adopted one's exit shows as the pid gone (or a zombie).
        let _ = child.wait();
        assert!(p.wait_exit(Duration::from_secs(10)).await.is_ok());
    }
}
