//! A small real cluster on loopback: etcd, prefill and decode workers
//! registered under a prefix unique to the cluster, and a coordinator
//! routing from that membership. Every process is a child killed by pid
//! when the [`Cluster`] is dropped (also when a test panics).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::task::JoinSet;

use crate::metrics::{get_status, scrape, Page};
use crate::process::{Proc, Signal};
use crate::proxy::Proxy;
use crate::{eventually, HarnessError};

/// A worker's role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Prefill,
    Decode,
}

/// One worker to start.
#[derive(Debug, Clone)]
pub struct WorkerSpec {
    pub role: Role,
    pub group: String,
    /// Decode only: advertise a fault [`Proxy`] in front of the real KV listener.
    pub behind_proxy: bool,
    /// Flags added last.
    pub extra: Vec<String>,
}

/// What to start. Built with the chained methods; [`Cluster::start`] runs it.
#[derive(Debug, Clone)]
pub struct ClusterSpec {
    pub workers: Vec<WorkerSpec>,
    /// Decode workers' `--kv-load-failure-policy`.
    pub policy: String,
    pub kv_blocks: u32,
    /// Workers' etcd lease TTL: how fast a dead worker leaves membership.
    pub lease_ttl_s: u32,
    /// Flags added to the coordinator's.
    pub coordinator_args: Vec<String>,
    /// etcd members (1, or 3 for failover and quorum drills). Every process gets all
    /// their endpoints.
    pub etcd_members: usize,
    /// Processes (`decode-1`, `coordinator`, ...) whose etcd traffic crosses fault
    /// proxies, one per member ([`Cluster::etcd_proxies`]), to cut them off alone.
    pub etcd_via_proxy: Vec<String>,
}

impl Default for ClusterSpec {
    fn default() -> Self {
        Self {
            workers: Vec::new(),
            policy: "recompute".into(),
            kv_blocks: 256,
            lease_ttl_s: 2,
            coordinator_args: Vec::new(),
            etcd_members: 1,
            etcd_via_proxy: Vec::new(),
        }
    }
}

impl ClusterSpec {
    pub fn prefill(mut self, group: &str) -> Self {
        self.workers.push(WorkerSpec { role: Role::Prefill, group: group.into(), behind_proxy: false, extra: vec![] });
        self
    }

    pub fn decode(mut self, group: &str) -> Self {
        self.workers.push(WorkerSpec { role: Role::Decode, group: group.into(), behind_proxy: false, extra: vec![] });
        self
    }

    /// A decode worker whose KV link crosses a fault proxy.
    pub fn decode_behind_proxy(mut self, group: &str) -> Self {
        self.workers.push(WorkerSpec { role: Role::Decode, group: group.into(), behind_proxy: true, extra: vec![] });
        self
    }

    pub fn policy(mut self, p: &str) -> Self {
        self.policy = p.into();
        self
    }

    /// Runs `n` etcd members instead of one.
    pub fn etcd_members(mut self, n: usize) -> Self {
        self.etcd_members = n;
        self
    }

    /// Routes process `name`'s etcd traffic (`decode-0`, `prefill-1`, `coordinator`)
    /// through fault proxies of its own.
    pub fn etcd_via_proxy(mut self, name: &str) -> Self {
        self.etcd_via_proxy.push(name.into());
        self
    }

    pub fn coordinator_args(mut self, args: &[&str]) -> Self {
        self.coordinator_args.extend(args.iter().map(|s| (*s).to_owned()));
        self
    }
}

/// A running worker.
#[derive(Debug)]
pub struct Worker {
    pub role: Role,
    pub group: String,
    pub proc: Proc,
    /// The proxy on its KV link, for a decode worker started behind one.
    pub proxy: Option<Proxy>,
}

impl Worker {
    pub fn metrics_addr(&self) -> Result<String, HarnessError> {
        self.proc.addr("metrics")
    }
}

/// A running cluster. Fields are public so drills can reach any process.
#[derive(Debug)]
pub struct Cluster {
    /// etcd: [`ClusterSpec::etcd_members`] members.
    pub etcd: registry::testing::EtcdCluster,
    /// Fault proxies on a process's links to etcd (one per member, in member order), by
    /// process name, for those in [`ClusterSpec::etcd_via_proxy`].
    pub etcd_proxies: BTreeMap<String, Vec<Proxy>>,
    pub workers: Vec<Worker>,
    pub coordinator: Proc,
    pub prefix: String,
    /// Per-process stderr logs (and etcd's, elsewhere: [`registry::testing::EtcdCluster::log_path`]).
    pub log_dir: PathBuf,
    /// Names of processes a drill killed, stopped or terminated on purpose,
    /// with what was done; the rest must be alive at the end.
    pub faulted: BTreeMap<String, Signal>,
    keep_logs: bool,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Processes are killed by their own Drop; SIGCONT first so a stopped one is reaped promptly.
        for p in self.procs() {
            if self.faulted.get(&p.name) == Some(&Signal::Stop) {
                let _ = p.signal(Signal::Cont);
            }
        }
        if !self.keep_logs {
            let _ = std::fs::remove_dir_all(&self.log_dir);
        }
    }
}

fn temp_dir() -> Result<PathBuf, HarnessError> {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let dir = std::env::temp_dir().join(format!(
        "tandem-drill-{}-{}-{nanos}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).map_err(|e| HarnessError::Setup(format!("create {}: {e}", dir.display())))?;
    Ok(dir)
}

fn free_port() -> Result<std::net::SocketAddr, HarnessError> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| HarnessError::Setup(format!("pick a port: {e}")))
}

impl Cluster {
    /// Starts everything in `spec` and waits until the coordinator is ready
    /// and sees every worker registered. `keep_logs` keeps the log directory after drop.
    pub async fn start(spec: &ClusterSpec, keep_logs: bool) -> Result<Self, HarnessError> {
        let log_dir = temp_dir()?;
        let etcd = registry::testing::EtcdCluster::start(spec.etcd_members.max(1))
            .await
            .map_err(|e| HarnessError::Setup(format!("etcd: {e}")))?;
        let mut etcd_proxies = BTreeMap::new();
        // Every member's endpoint, or for a process behind proxies, its proxies'.
        let mut etcd_flag = |name: &str| -> Result<String, HarnessError> {
            if !spec.etcd_via_proxy.iter().any(|n| n == name) {
                return Ok(etcd.endpoints().join(","));
            }
            let mut proxies = Vec::new();
            for ep in etcd.endpoints() {
                let addr = ep
                    .trim_start_matches("http://")
                    .parse()
                    .map_err(|e| HarnessError::Setup(format!("etcd endpoint {ep}: {e}")))?;
                proxies.push(Proxy::start(addr)?);
            }
            let flag = proxies.iter().map(|p| format!("http://{}", p.addr)).collect::<Vec<_>>().join(",");
            etcd_proxies.insert(name.to_owned(), proxies);
            Ok(flag)
        };
        let prefix = log_dir.file_name().map(|n| n.to_string_lossy().replace('-', "_")).unwrap_or_default();

        let mut starting = JoinSet::new();
        let mut counts = BTreeMap::<Role, usize>::new();
        for w in &spec.workers {
            let n = counts.entry(w.role).or_insert(0);
            let name = format!("{}-{n}", if w.role == Role::Prefill { "prefill" } else { "decode" });
            *n += 1;
            let ep = etcd_flag(&name)?;
            let mut args: Vec<String> = [
                "--etcd",
                &ep,
                "--cluster-prefix",
                &prefix,
                "--lease-ttl-s",
                &spec.lease_ttl_s.to_string(),
                "--version-group",
                &w.group,
                "--worker-id",
                &name,
                "--threads",
                "1",
                "--kv-blocks",
                &spec.kv_blocks.to_string(),
            ]
            .iter()
            .map(|s| (*s).to_owned())
            .collect();
            let (bin, wants): (&str, &[&str]) = match w.role {
                Role::Prefill => ("tandem-prefill-worker", &["grpc", "metrics"]),
                Role::Decode => ("tandem-decode-worker", &["grpc", "metrics", "transfer"]),
            };
            let mut proxy = None;
            if w.role == Role::Decode {
                args.extend(
                    ["--kv-load-failure-policy", &spec.policy, "--local-prefill-max-tokens", "0"].map(str::to_owned),
                );
                if w.behind_proxy {
                    let transfer = free_port()?;
                    let p = Proxy::start(transfer)?;
                    args.extend([
                        "--transfer".into(),
                        transfer.to_string(),
                        "--advertise-transfer".into(),
                        p.addr.to_string(),
                    ]);
                    proxy = Some(p);
                }
            }
            args.extend(w.extra.iter().cloned());
            let (role, group, dir) = (w.role, w.group.clone(), log_dir.clone());
            starting.spawn(async move {
                let proc = Proc::start(&name, bin, &args, wants, &dir).await?;
                Ok::<_, HarnessError>(Worker { role, group, proc, proxy })
            });
        }
        let mut workers = Vec::new();
        while let Some(r) = starting.join_next().await {
            workers.push(r.map_err(|e| HarnessError::Setup(format!("start task: {e}")))??);
        }
        workers.sort_by(|a, b| (a.role, &a.proc.name).cmp(&(b.role, &b.proc.name)));

        let ep = etcd_flag("coordinator")?;
        let mut cargs: Vec<String> = [
            "--http",
            "127.0.0.1:0",
            "--grpc",
            "127.0.0.1:0",
            "--etcd",
            &ep,
            "--cluster-prefix",
            &prefix,
            "--local-prefill-max-tokens",
            "0",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        cargs.extend(spec.coordinator_args.iter().cloned());
        let coordinator = Proc::start("coordinator", "tandem-coordinator", &cargs, &["http", "grpc"], &log_dir).await?;
        let cluster =
            Self { etcd, etcd_proxies, workers, coordinator, prefix, log_dir, faulted: BTreeMap::new(), keep_logs };
        cluster.wait_ready().await?;
        Ok(cluster)
    }

    /// Waits until `/ready` says 200 and the coordinator counts every worker as serving.
    pub async fn wait_ready(&self) -> Result<(), HarnessError> {
        let h = self.http_addr()?;
        let want = |role: Role| self.workers.iter().filter(|w| w.role == role).count() as f64;
        let (np, nd) = (want(Role::Prefill), want(Role::Decode));
        eventually("the coordinator is ready and sees every worker", Duration::from_secs(60), || async {
            let Ok(200) = get_status(&h, "/ready").await else { return false };
            let Ok(page) = scrape(&h).await else { return false };
            let serving = |role| page.sum("tandem_coordinator_workers", &[("role", role), ("state", "serving")]);
            serving("prefill") == np && serving("decode") == nd
        })
        .await?;
        // Two load polls (250 ms each), so the router knows every worker's load, not just its lease.
        tokio::time::sleep(Duration::from_millis(600)).await;
        Ok(())
    }

    /// The coordinator's HTTP address (`host:port`).
    pub fn http_addr(&self) -> Result<String, HarnessError> {
        self.coordinator.addr("http")
    }

    /// The coordinator's base URL for loadgen.
    pub fn base_url(&self) -> Result<String, HarnessError> {
        Ok(format!("http://{}", self.http_addr()?))
    }

    pub fn workers_of(&self, role: Role) -> impl Iterator<Item = &Worker> {
        self.workers.iter().filter(move |w| w.role == role)
    }

    pub fn worker(&self, name: &str) -> Result<&Worker, HarnessError> {
        self.workers
            .iter()
            .find(|w| w.proc.name == name)
            .ok_or_else(|| HarnessError::Setup(format!("no worker {name}")))
    }

    pub fn worker_mut(&mut self, name: &str) -> Result<&mut Worker, HarnessError> {
        self.workers
            .iter_mut()
            .find(|w| w.proc.name == name)
            .ok_or_else(|| HarnessError::Setup(format!("no worker {name}")))
    }

    /// Every child process except etcd.
    pub fn procs(&self) -> impl Iterator<Item = &Proc> {
        self.workers.iter().map(|w| &w.proc).chain(std::iter::once(&self.coordinator))
    }

    pub fn procs_mut(&mut self) -> impl Iterator<Item = &mut Proc> {
        self.workers.iter_mut().map(|w| &mut w.proc).chain(std::iter::once(&mut self.coordinator))
    }

    /// Sends `sig` to worker `name` and records it as a deliberate fault.
    pub fn signal(&mut self, name: &str, sig: Signal) -> Result<u32, HarnessError> {
        let w = self.worker(name)?;
        w.proc.signal(sig)?;
        let pid = w.proc.pid;
        self.faulted.insert(name.to_owned(), sig);
        Ok(pid)
    }

    /// A live worker's `/metrics`.
    pub async fn worker_metrics(&self, name: &str) -> Result<Page, HarnessError> {
        scrape(&self.worker(name)?.metrics_addr()?).await
    }

    pub async fn coordinator_metrics(&self) -> Result<Page, HarnessError> {
        scrape(&self.http_addr()?).await
    }

    /// Whether the drill meant this process to die or stop.
    pub fn is_faulted(&self, name: &str) -> bool {
        self.faulted.contains_key(name)
    }

    pub fn log_paths(&self) -> Vec<(String, PathBuf)> {
        let mut v: Vec<(String, PathBuf)> = self.procs().map(|p| (p.name.clone(), p.log_path().to_owned())).collect();
        v.extend(self.etcd.log_paths().into_iter().map(|(m, p)| (format!("etcd-{m}"), p)));
        v
    }

    /// Arms `fault` on every proxy between process `name` and etcd
    /// ([`ClusterSpec::etcd_via_proxy`]); `Fault::Blackhole` cuts it off, `Fault::None` lifts that.
    pub fn etcd_link(&self, name: &str, fault: crate::proxy::Fault) -> Result<(), HarnessError> {
        let proxies = self
            .etcd_proxies
            .get(name)
            .ok_or_else(|| HarnessError::Setup(format!("{name}'s etcd traffic crosses no proxy")))?;
        for p in proxies {
            p.arm(fault);
        }
        Ok(())
    }

    /// Bytes (both ways) the blackhole dropped on `name`'s etcd links so far.
    pub fn etcd_link_dropped(&self, name: &str) -> u64 {
        self.etcd_proxies.get(name).map_or(0, |ps| {
            ps.iter()
                .map(|p| {
                    let k = p.counters();
                    k.blackholed_bytes + k.blackholed_reply_bytes
                })
                .sum()
        })
    }

    pub fn log_dir(&self) -> &Path {
        &self.log_dir
    }
}
