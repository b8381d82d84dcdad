//! A real etcd for tests: one `etcd` process on free loopback ports with a temporary data
//! directory. Enabled by the `testing` feature.
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
use std::net::{Ipv4Addr, TcpListener};
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

    /// [`Etcd::endpoint`] as a list, for [`crate::EtcdConfig::new`].
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
        let client = format!("http://127.0.0.1:{}", self.client_port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let bin = std::env::var_os("TANDEM_ETCD_BIN").unwrap_or_else(|| "etcd".into());
        let child = Command::new(&bin)
            .arg("--name=tandem-test")
            .arg(format!("--data-dir={}", self.data_dir().display()))
            .arg(format!("--listen-client-urls={client}"))
            .arg(format!("--advertise-client-urls={client}"))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster=tandem-test={peer}"))
            .arg("--initial-cluster-state=new")
            .args(["--heartbeat-interval=50", "--election-timeout=500"])
            .args(["--logger=zap", "--log-outputs=stderr", "--log-level=warn"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|source| io(format!("running {}", Path::new(&bin).display()), source))?;
        self.child = Some(child);
        self.wait_ready().await
    }

    async fn wait_ready(&mut self) -> Result<(), EtcdError> {
        let endpoint = self.endpoint();
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    self.child = None;
                    return Err(EtcdError::Exited { status, log: self.log_tail() });
                }
            }
            if answers(&endpoint).await {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(EtcdError::NotReady { endpoint, after: READY_TIMEOUT, log: self.log_tail() });
            }
            // Polling a process we just started; nothing to wait on instead.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn log_tail(&self) -> String {
        let text = fs::read_to_string(self.log_path()).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop();
        let _ = fs::remove_dir_all(&self.root);
    }
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
    let bind =
        || TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).map_err(|source| io("probing a free port".into(), source));
    let (a, b) = (bind()?, bind()?);
    let port = |l: &TcpListener| l.local_addr().map(|a| a.port()).map_err(|source| io("reading a port".into(), source));
    Ok((port(&a)?, port(&b)?))
}

fn io(what: String, source: std::io::Error) -> EtcdError {
    EtcdError::Io { what, source }
}
