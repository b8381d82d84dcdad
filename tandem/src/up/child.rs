//! Starting one child process the same way the first time and every time
//! after: its arguments, the addresses it must keep, how to tell it is up,
//! and its log.

use std::fs::File;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::time::Instant;

use facts::state::{Addr, Component, Role};

use super::state::utc_now;

/// Waits for a component's start-up: its `listening` lines, or etcd answering.
pub const START_TIMEOUT: Duration = Duration::from_secs(180);

/// How to tell that a started process is up.
#[derive(Debug, Clone)]
pub enum Ready {
    /// It printed `listening NAME=ADDR ...` for each of these keys.
    Listening(Vec<&'static str>),
    /// `GET /health` on this address answers 200 (etcd).
    Health(String),
}

/// Everything needed to start a component, and to start it again after it exited.
#[derive(Debug, Clone)]
pub struct Spec {
    pub bin: PathBuf,
    /// Its arguments, less the address flags.
    pub args: Vec<String>,
    /// `(flag, key, first value)`: an address flag (`--grpc`) and the key it is printed and
    /// recorded under (`grpc`). The first start passes the first value (port 0 picks a free
    /// port); a restart passes the address the component had, so clients, the state file and
    /// Prometheus targets stay valid.
    pub addrs: Vec<(&'static str, &'static str, String)>,
    pub ready: Ready,
    pub log: PathBuf,
    /// The network namespace it runs in (`tandem up --hosts`), through `ip netns exec`,
    /// which execs it: the pid is the program's own.
    pub netns: Option<String>,
}

/// A started process.
pub struct Running {
    pub child: Child,
    pub since: Instant,
}

/// The last lines of a log, for a message saying why a child failed.
pub fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

/// Starts the component `c` describes per `spec` and waits until it is up, filling in
/// `c.pid` and the addresses it printed. The first start (`restart` = None) empties the log
/// (one left by an earlier run with the same --log-dir is not this one's); a restart appends
/// to it after a separator line naming the restart and why the last process ended.
pub async fn start(spec: &Spec, c: &mut Component, restart: Option<u32>) -> anyhow::Result<Running> {
    let log = &spec.log;
    let mut file = match restart {
        None => File::create(log),
        Some(_) => File::options().create(true).append(true).open(log),
    }
    .with_context(|| format!("opening {}", log.display()))?;
    if let Some(n) = restart {
        let why = c.last_exit.as_deref().unwrap_or("unknown");
        writeln!(file, "\n===== tandem up: restart {n} of {} at {} (last exit: {why}) =====", c.name, utc_now())
            .with_context(|| format!("writing {}", log.display()))?;
    }
    let err = file.try_clone().with_context(|| format!("opening {}", log.display()))?;
    let mut copy = file;
    let mut args = spec.args.clone();
    for (flag, key, first) in &spec.addrs {
        let value = match Addr::from_key(key).and_then(|a| c.addr(a)) {
            Some(last) if restart.is_some() => last,
            _ => first,
        };
        args.extend([flag.to_string(), value.clone()]);
    }
    let mut cmd = match &spec.netns {
        Some(ns) => {
            let mut cmd = Command::new("ip");
            cmd.args(["netns", "exec", ns]).arg(&spec.bin);
            cmd
        }
        None => Command::new(&spec.bin),
    };
    c.netns.clone_from(&spec.netns);
    if let Some(format) = facts::log::installed() {
        // `tandem up --log-format json` makes every process's log JSON, not only ours.
        cmd.env(facts::log::FORMAT_ENV, format.to_string());
    }
    let mut child = cmd
        .args(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::from(err))
        .kill_on_drop(true)
        // A process group of its own: a terminal's Ctrl-C reaches `tandem up` alone, which
        // stops the children in order (coordinator first, etcd last). In the terminal's group
        // every child got SIGINT at once, etcd died of it, and its supervisor could read that
        // as a crash to restart.
        .process_group(0)
        .spawn()
        .with_context(|| format!("starting {}", spec.bin.display()))?;
    let pid = child.id().context("the child has no pid")?;
    c.pid = pid;
    c.log = Some(log.clone());
    let name = c.name.clone();
    let out = child.stdout.take().context("no stdout pipe")?;
    let mut lines = BufReader::new(out).lines();
    let up = async {
        match &spec.ready {
            Ready::Listening(wants) => {
                // What this process printed: a restarted component still holds the addresses
                // of its last process.
                let mut seen: Vec<String> = Vec::new();
                while wants.iter().any(|w| !seen.iter().any(|s| s == w)) {
                    let Some(line) = lines.next_line().await? else {
                        // The log is flushed by the child's exit; give its status a moment to land.
                        let status = tokio::time::timeout(Duration::from_secs(5), child.wait()).await;
                        let how = match status {
                            Ok(Ok(s)) => super::state::describe(s),
                            _ => "closed its output".into(),
                        };
                        bail!(
                            "{name} (pid {pid}) exited before it was listening ({how}); {}:\n{}",
                            log.display(),
                            log_tail(log)
                        );
                    };
                    let _ = writeln!(copy, "{line}");
                    // `listening NAME=ADDR [NAME=ADDR ...]`
                    let Some(pairs) = line.strip_prefix("listening ") else { continue };
                    for (k, v) in pairs.split_whitespace().filter_map(|p| p.split_once('=')) {
                        if let Some(a) = Addr::from_key(k) {
                            *c.addr_mut(a) = Some(v.to_owned());
                            seen.push(k.to_owned());
                        }
                    }
                }
            }
            Ready::Health(addr) => loop {
                if let Ok(Some(status)) = child.try_wait() {
                    bail!(
                        "{name} (pid {pid}) exited during start-up ({}); {}:\n{}",
                        super::state::describe(status),
                        log.display(),
                        log_tail(log)
                    );
                }
                let a = addr.clone();
                if tokio::task::spawn_blocking(move || get_status(&a, "/health")).await? == Some(200) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            },
        }
        anyhow::Ok(())
    };
    tokio::time::timeout(START_TIMEOUT, up).await.map_err(|_| {
        anyhow::anyhow!("{name} (pid {pid}) did not start within {START_TIMEOUT:?}; see {}", log.display())
    })??;
    // Keep copying its stdout into its log, so it never blocks on a full pipe.
    tokio::spawn(async move {
        while let Ok(Some(line)) = lines.next_line().await {
            let _ = writeln!(copy, "{line}");
        }
    });
    Ok(Running { child, since: Instant::now() })
}

/// GET `path` on `addr`; the status code.
pub fn get_status(addr: &str, path: &str) -> Option<u16> {
    http_get(addr, path).map(|(status, _)| status)
}

/// GET `path` on `addr` (2 s to connect, 5 s per read): the status code and
/// the body. HTTP/1.0, so the body comes whole, never chunked.
pub fn http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    let sa: SocketAddr = addr.parse().ok()?;
    let mut s = TcpStream::connect_timeout(&sa, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    let status = buf.split(' ').nth(1)?.parse().ok()?;
    let body = buf.split_once("\r\n\r\n").map_or("", |(_, body)| body).to_owned();
    Some((status, body))
}

/// Stops what is running, one role at a time in `order` (the coordinator first, so no new
/// request arrives, etcd last): SIGTERM to every process of the role, wait up to the grace
/// (plus a margin), then SIGKILL.
pub async fn stop_all(running: &mut [(Component, Running)], order: &[Role], grace: Duration) {
    for role in order {
        let group: Vec<&mut (Component, Running)> = running.iter_mut().filter(|(c, _)| c.role == *role).collect();
        for (c, _) in &group {
            let _ = std::process::Command::new("kill").args(["-TERM", &c.pid.to_string()]).status();
        }
        for (c, r) in group {
            match tokio::time::timeout(grace + Duration::from_secs(5), r.child.wait()).await {
                // Ending by the SIGTERM just sent is as clean as exiting 0 (etcd does).
                Ok(Ok(status))
                    if !status.success() && std::os::unix::process::ExitStatusExt::signal(&status) != Some(15) =>
                {
                    eprintln!("tandem up: {} (pid {}) exited with {status}", c.name, c.pid)
                }
                Ok(_) => {}
                Err(_) => {
                    eprintln!("tandem up: {} (pid {}) did not stop within the grace; killing it", c.name, c.pid);
                    let _ = r.child.kill().await;
                }
            }
        }
    }
}

/// Why `bin` is not usable next to the running `tandem`.
pub fn sibling(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("locating the tandem binary")?;
    let path = exe.parent().map(|d| d.join(name)).context("the tandem binary has no directory")?;
    if !path.is_file() {
        bail!("{} not found next to tandem: build with `cargo build --release --workspace --bins`", path.display());
    }
    Ok(path)
}
