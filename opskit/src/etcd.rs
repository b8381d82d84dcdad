//! A real etcd for tests: one `etcd` process on free loopback ports with a temporary data
//! directory ([`Etcd`]), or a cluster of several members ([`EtcdCluster`], for leader
//! failover and quorum loss).
//!
//! The process listens on 127.0.0.1 only. It is killed (by its pid, via the child handle)
//! and its directory deleted when the [`Etcd`] is dropped. [`Etcd::stop`] and
//! [`Etcd::restart`] keep the ports and data, for outage tests.
//!
//! The binary is `$TANDEM_ETCD_BIN` if set, else `etcd` on `PATH` (Debian's `etcd-server`).
//! Heartbeat and election timeouts are shortened (50 ms / 500 ms) so that leases as short
//! as 1 s are granted as asked (etcd's minimum TTL is 1.5 × the election timeout) and a
//! restarted member elects itself quickly.

use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

/// How long [`Etcd::start`] and [`Etcd::restart`] wait for etcd to answer.
const READY_TIMEOUT: Duration = Duration::from_secs(20);
/// Attempts with fresh ports when etcd exits at start (another process took a port).
const PORT_ATTEMPTS: usize = 5;

/// Why the test etcd could not be run.
#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    /// Creating or using the temporary directory or log file failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The process exited before answering; the log tail says why.
    #[error("etcd exited during start-up ({status}); log tail:\n{log}")]
    Exited {
        /// Its exit status.
        status: std::process::ExitStatus,
        /// The end of its log.
        log: String,
    },
    /// It did not answer in time.
    #[error("etcd did not answer on {endpoint} within {after:?}; log tail:\n{log}")]
    NotReady {
        /// The client URL tried.
        endpoint: String,
        /// The wait.
        after: Duration,
        /// The end of its log.
        log: String,
    },
}

/// A running (or stopped) test etcd.
#[derive(Debug)]
pub struct Etcd {
    child: Option<Child>,
    root: PathBuf,
    client_port: u16,
    peer_port: u16,
}

impl Etcd {
    /// Starts etcd on free loopback ports and waits until it answers.
    pub async fn start() -> Result<Self, EtcdError> {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let name = format!("tandem-etcd-{}-{}-{nanos}", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed));
        let root = std::env::temp_dir().join(name);
        fs::create_dir_all(&root).map_err(|source| io(format!("creating {}", root.display()), source))?;
        let mut etcd = Self { child: None, root, client_port: 0, peer_port: 0 };
        let mut last = None;
        for _ in 0..PORT_ATTEMPTS {
            (etcd.client_port, etcd.peer_port) = free_ports()?;
            match etcd.spawn_and_wait().await {
                Ok(()) => return Ok(etcd),
                // A port taken between probing and binding: try others, with a clean data dir.
                Err(e @ EtcdError::Exited { .. }) => {
                    let _ = fs::remove_dir_all(etcd.data_dir());
                    last = Some(e);
                }
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or_else(|| io("starting etcd".into(), std::io::Error::other("no attempt made"))))
    }

    /// The client URL, `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// [`Etcd::endpoint`] as a list, for `registry::EtcdConfig::new`.
    pub fn endpoints(&self) -> Vec<String> {
        vec![self.endpoint()]
    }

    /// The process id while running.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The log file (etcd's stderr), kept across restarts.
    pub fn log_path(&self) -> PathBuf {
        self.root.join("etcd.log")
    }

    /// Kills the process (SIGKILL) and waits for it; data and ports are kept.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the process again on the same ports and data, and waits until it answers.
    pub async fn restart(&mut self) -> Result<(), EtcdError> {
        self.stop();
        self.spawn_and_wait().await
    }

    fn data_dir(&self) -> PathBuf {
        self.root.join("data")
    }

    async fn spawn_and_wait(&mut self) -> Result<(), EtcdError> {
        let log_path = self.log_path();
        let log = File::options()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|source| io(format!("opening {}", log_path.display()), source))?;
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let child = spawn_member(
            "tandem-test",
            &self.data_dir(),
            self.client_port,
            self.peer_port,
            &format!("tandem-test={peer}"),
            "etcd-cluster",
            log,
        )?;
        self.child = Some(child);
        self.wait_ready().await
    }

    async fn wait_ready(&mut self) -> Result<(), EtcdError> {
        let (endpoint, log) = (self.endpoint(), self.log_path());
        wait_answers(&mut self.child, &endpoint, &log).await
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop();
        let _ = fs::remove_dir_all(&self.root);
    }
}

/// Waits until `endpoint` serves a linearizable read, or the child exits, or
/// [`READY_TIMEOUT`] passes. A child that exited is taken out of `child`.
async fn wait_answers(child: &mut Option<Child>, endpoint: &str, log: &Path) -> Result<(), EtcdError> {
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        if let Some(c) = child.as_mut() {
            if let Ok(Some(status)) = c.try_wait() {
                *child = None;
                return Err(EtcdError::Exited { status, log: log_tail(log) });
            }
        }
        if answers(endpoint).await {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(EtcdError::NotReady {
                endpoint: endpoint.to_owned(),
                after: READY_TIMEOUT,
                log: log_tail(log),
            });
        }
        // Polling a process we just started; nothing to wait on instead.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn log_tail(path: &Path) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

/// Starts one etcd member on loopback: `initial_cluster` is `name=peer-url,...` of every
/// member, `token` keeps concurrent test clusters apart. A data directory that already
/// holds a member's state makes etcd ignore the `--initial-*` flags (a restart).
fn spawn_member(
    name: &str,
    data_dir: &Path,
    client_port: u16,
    peer_port: u16,
    initial_cluster: &str,
    token: &str,
    log: File,
) -> Result<Child, EtcdError> {
    let client = format!("http://127.0.0.1:{client_port}");
    let peer = format!("http://127.0.0.1:{peer_port}");
    let bin = std::env::var_os("TANDEM_ETCD_BIN").unwrap_or_else(|| "etcd".into());
    Command::new(&bin)
        .arg(format!("--name={name}"))
        .arg(format!("--data-dir={}", data_dir.display()))
        .arg(format!("--listen-client-urls={client}"))
        .arg(format!("--advertise-client-urls={client}"))
        .arg(format!("--listen-peer-urls={peer}"))
        .arg(format!("--initial-advertise-peer-urls={peer}"))
        .arg(format!("--initial-cluster={initial_cluster}"))
        .arg(format!("--initial-cluster-token={token}"))
        .arg("--initial-cluster-state=new")
        .args(["--heartbeat-interval=50", "--election-timeout=500"])
        .args(["--logger=zap", "--log-outputs=stderr", "--log-level=warn"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .map_err(|source| io(format!("running {}", Path::new(&bin).display()), source))
}

/// One member of an [`EtcdCluster`].
#[derive(Debug)]
struct Member {
    name: String,
    client_port: u16,
    peer_port: u16,
    child: Option<Child>,
}

/// A real multi-member etcd cluster for tests: `n` `etcd` processes on free loopback
/// client and peer ports, one data directory and one log per member under a temporary
/// directory. Members are numbered `0..n`. [`EtcdCluster::kill`] and
/// [`EtcdCluster::restart`] keep a member's ports and data, for failover and quorum-loss
/// tests. Dropping it kills every member (by pid, via the child handles) and deletes the
/// directory.
///
/// `EtcdCluster::start(1)` behaves like [`Etcd::start`], with member-indexed methods.
#[derive(Debug)]
pub struct EtcdCluster {
    root: PathBuf,
    token: String,
    members: Vec<Member>,
}

impl EtcdCluster {
    /// A cluster of no members, for a harness attached to an etcd it did not
    /// start: nothing to kill, restart or clean up.
    pub fn none() -> Self {
        Self { root: PathBuf::new(), token: String::new(), members: Vec::new() }
    }

    /// Starts `n` members (at least one) and waits until every one serves a linearizable
    /// read, so the cluster has a leader and every member has joined it.
    pub async fn start(n: usize) -> Result<Self, EtcdError> {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let token = format!("tandem-etcd{n}-{}-{}-{nanos}", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed));
        let root = std::env::temp_dir().join(&token);
        fs::create_dir_all(&root).map_err(|source| io(format!("creating {}", root.display()), source))?;
        let mut cluster = Self { root, token, members: Vec::new() };
        let mut last = None;
        for _ in 0..PORT_ATTEMPTS {
            let ports = free_port_list(2 * n.max(1))?;
            cluster.members = ports
                .chunks(2)
                .enumerate()
                .map(|(i, p)| Member { name: format!("m{i}"), client_port: p[0], peer_port: p[1], child: None })
                .collect();
            match cluster.spawn_all_and_wait().await {
                Ok(()) => return Ok(cluster),
                // A port taken between probing and binding: try others, with clean data dirs.
                Err(e @ EtcdError::Exited { .. }) => {
                    for i in 0..cluster.members.len() {
                        cluster.kill(i);
                        let _ = fs::remove_dir_all(cluster.data_dir(i));
                    }
                    last = Some(e);
                }
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or_else(|| io("starting etcd".into(), std::io::Error::other("no attempt made"))))
    }

    /// How many members it has (running or not).
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Whether it has no member (never, once started).
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// Member `i`'s client URL, `http://127.0.0.1:PORT`.
    pub fn endpoint(&self, i: usize) -> String {
        self.members.get(i).map(|m| format!("http://127.0.0.1:{}", m.client_port)).unwrap_or_default()
    }

    /// Every member's client URL (killed ones too), for `registry::EtcdConfig::new` or a
    /// comma-separated `--etcd` flag.
    pub fn endpoints(&self) -> Vec<String> {
        (0..self.members.len()).map(|i| self.endpoint(i)).collect()
    }

    /// Member `i`'s process id while it runs.
    pub fn pid(&self, i: usize) -> Option<u32> {
        self.members.get(i)?.child.as_ref().map(Child::id)
    }

    /// Member `i`'s name in `--initial-cluster` (`m0`, `m1`, ...).
    pub fn name(&self, i: usize) -> &str {
        self.members.get(i).map_or("", |m| m.name.as_str())
    }

    /// Member `i`'s log (its stderr), kept across restarts.
    pub fn log_path(&self, i: usize) -> PathBuf {
        self.root.join(format!("{}.log", self.name(i)))
    }

    /// Every member's log, with the member's name.
    pub fn log_paths(&self) -> Vec<(String, PathBuf)> {
        (0..self.members.len()).map(|i| (self.name(i).to_owned(), self.log_path(i))).collect()
    }

    /// Asks every running member for its status (`/v3/maintenance/status`) and returns
    /// the member that says it is the leader, if one does within about a second each.
    pub async fn leader(&self) -> Option<usize> {
        for i in 0..self.members.len() {
            if self.pid(i).is_none() {
                continue;
            }
            if member_status(&self.endpoint(i)).await.is_some_and(|(me, leader)| me == leader && leader != 0) {
                return Some(i);
            }
        }
        None
    }

    /// SIGKILLs member `i` and reaps it; its data and ports are kept. Returns the pid it
    /// had, `None` if it was not running.
    pub fn kill(&mut self, i: usize) -> Option<u32> {
        let child = self.members.get_mut(i)?.child.take();
        child.map(|mut c| {
            let pid = c.id();
            let _ = c.kill();
            let _ = c.wait();
            pid
        })
    }

    /// Starts member `i` again on its ports and data (killing it first if it runs) and
    /// waits until it serves a linearizable read, which needs a quorum: restart enough
    /// members for one.
    pub async fn restart(&mut self, i: usize) -> Result<(), EtcdError> {
        if i >= self.members.len() {
            return Err(io(format!("restarting etcd member {i}"), std::io::Error::other("no such member")));
        }
        self.kill(i);
        self.spawn(i)?;
        let (endpoint, log) = (self.endpoint(i), self.log_path(i));
        wait_answers(&mut self.members[i].child, &endpoint, &log).await
    }

    fn data_dir(&self, i: usize) -> PathBuf {
        self.root.join(format!("{}.data", self.name(i)))
    }

    fn spawn(&mut self, i: usize) -> Result<(), EtcdError> {
        let initial = self
            .members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer_port))
            .collect::<Vec<_>>()
            .join(",");
        let log_path = self.log_path(i);
        let log = File::options()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|source| io(format!("opening {}", log_path.display()), source))?;
        let data = self.data_dir(i);
        let m = &self.members[i];
        let child = spawn_member(&m.name, &data, m.client_port, m.peer_port, &initial, &self.token, log)?;
        self.members[i].child = Some(child);
        Ok(())
    }

    /// Spawns every member (they need each other to elect a leader), then waits for each.
    async fn spawn_all_and_wait(&mut self) -> Result<(), EtcdError> {
        for i in 0..self.members.len() {
            self.spawn(i)?;
        }
        for i in 0..self.members.len() {
            let (endpoint, log) = (self.endpoint(i), self.log_path(i));
            wait_answers(&mut self.members[i].child, &endpoint, &log).await?;
        }
        Ok(())
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
        if !self.root.as_os_str().is_empty() {
            let _ = fs::remove_dir_all(&self.root);
        }
    }
}

/// A member's own id and the leader id it knows (0: none), from its status.
/// Whether the etcd member at `endpoint` says it is its cluster's leader (its status within
/// about a second).
pub async fn is_leader(endpoint: &str) -> bool {
    member_status(endpoint).await.is_some_and(|(me, leader)| me == leader && leader != 0)
}

async fn member_status(endpoint: &str) -> Option<(u64, u64)> {
    let options = etcd_client::ConnectOptions::new().with_connect_timeout(Duration::from_millis(500));
    let attempt = async {
        let mut client = etcd_client::Client::connect([endpoint], Some(options)).await?;
        client.status().await
    };
    let status = tokio::time::timeout(Duration::from_secs(1), attempt).await.ok()?.ok()?;
    Some((status.header()?.member_id(), status.leader()))
}

/// Whether etcd serves a linearizable read (so it has a leader).
async fn answers(endpoint: &str) -> bool {
    let options = etcd_client::ConnectOptions::new().with_connect_timeout(Duration::from_millis(500));
    let attempt = async {
        let mut client = etcd_client::Client::connect([endpoint], Some(options)).await?;
        client.get("/tandem-health", None).await
    };
    matches!(tokio::time::timeout(Duration::from_secs(1), attempt).await, Ok(Ok(_)))
}

/// Two distinct free loopback ports (held together while probing, so they differ).
fn free_ports() -> Result<(u16, u16), EtcdError> {
    let p = free_port_list(2)?;
    Ok((p[0], p[1]))
}

fn free_port_list(n: usize) -> Result<Vec<u16>, EtcdError> {
    crate::process::free_ports(n).map_err(|source| io("probing free ports".into(), source))
}

fn io(what: String, source: std::io::Error) -> EtcdError {
    EtcdError::Io { what, source }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_restarted_etcd_keeps_its_data_and_port() {
        let mut etcd = Etcd::start().await.expect("etcd starts");
        let mut c = etcd_client::Client::connect(etcd.endpoints(), None).await.expect("connect");
        c.put("k", "v", None).await.expect("put");
        let (pid, endpoint) = (etcd.pid(), etcd.endpoint());
        etcd.restart().await.expect("restart");
        assert_ne!(etcd.pid(), pid, "a new process");
        assert_eq!(etcd.endpoint(), endpoint);
        let mut c = etcd_client::Client::connect(etcd.endpoints(), None).await.expect("connect");
        let got = c.get("k", None).await.expect("get");
        assert_eq!(got.kvs().first().map(|kv| kv.value()), Some(&b"v"[..]));
        etcd.stop();
        assert!(!answers(&endpoint).await, "stopped");
    }
}
