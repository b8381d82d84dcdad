//! A small real cluster on loopback: etcd, prefill and decode workers
//! registered under a prefix unique to the cluster, and a coordinator
//! routing from that membership. Every process is a child killed by pid
//! when the [`Cluster`] is dropped (also when a test panics).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::time::Instant;

use tokio::task::JoinSet;

use crate::front::Front;
use crate::invariants::kv_moved;
use crate::metrics::{get_status, scrape, Page};
use crate::netns::Netns;
use crate::process::{Proc, Signal};
use crate::proxy::Proxy;
use crate::HarnessError;
use facts::argv::{WorkerArgv, DECODE_BINARY, PREFILL_BINARY};

mod attach;
mod etcd;
mod links;

pub use links::LinkNet;
mod spec;

pub use attach::{parse_exit, Attached, Restarted};
pub use spec::{ClusterSpec, Role, TenantsSpec, WorkerSpec};

/// The comment on the `iptables` rules that cut an attached worker off from etcd.
pub const ETCD_LINK_RULE: &str = "tandem-drill-etcd-link";

/// A running worker.
#[derive(Debug)]
pub struct Worker {
    pub role: Role,
    pub group: String,
    pub proc: Proc,
    /// The proxy on its KV link, for a decode worker started behind one.
    pub proxy: Option<Proxy>,
    /// KV counters of its earlier lives (a restart resets them), for G3.
    pub past: Vec<PastLife>,
    /// In a namespace: the plain proxy it reaches etcd through.
    pub etcd_path: Option<Proxy>,
    /// The namespace it runs in; last, so it is deleted after the process is killed.
    pub netns: Option<Netns>,
}

/// What a worker's earlier life counted before it exited (last scrape before its exit).
#[derive(Debug, Clone, PartialEq)]
pub struct PastLife {
    pub pid: u32,
    pub group: String,
    /// `tandem_kv_transfer_bytes_total` (prefill).
    pub kv_sent: f64,
    /// `tandem_kv_received_bytes_total` (decode).
    pub kv_received: f64,
    /// False for a life that was SIGKILLed with no last scrape: its counters are unknown, so
    /// G3 cannot count its group.
    pub counted: bool,
}

impl PastLife {
    /// A life that ended with counters nobody read (SIGKILL).
    pub fn uncounted(pid: u32, group: &str) -> Self {
        Self { pid, group: group.to_owned(), kv_sent: 0.0, kv_received: 0.0, counted: false }
    }
}

impl Worker {
    pub fn metrics_addr(&self) -> Result<String, HarnessError> {
        Ok(self.proc.addr("metrics")?)
    }
}

/// A running cluster. Fields are public so drills can reach any process.
#[derive(Debug)]
pub struct Cluster {
    /// etcd: [`ClusterSpec::etcd_members`] members.
    pub etcd: opskit::etcd::EtcdCluster,
    /// Fault proxies on a process's links to etcd (one per member, in member order), by
    /// process name, for those in [`ClusterSpec::etcd_via_proxy`].
    pub etcd_proxies: BTreeMap<String, Vec<Proxy>>,
    /// Set when the cluster was [attached](Cluster::attach) rather than started (then
    /// `etcd` has no members: the attached etcd, if any, is in [`Attached`]).
    pub attached: Option<Attached>,
    /// The workers' etcd lease TTL: how long a dead or stopped worker stays in membership.
    pub lease_ttl: Duration,
    pub workers: Vec<Worker>,
    /// The first coordinator (`coordinator`); [`Cluster::http_addr`] and the metrics helpers use it.
    pub coordinator: Proc,
    /// Further coordinators (`coordinator-1`, ...) when [`ClusterSpec::coordinators`] > 1.
    pub other_coordinators: Vec<Proc>,
    /// The round-robin front clients use when there are several coordinators.
    pub front: Option<Front>,
    /// The same over the coordinators' gRPC listeners.
    pub grpc_front: Option<Front>,
    /// The fault proxy clients reach the coordinator through ([`ClusterSpec::clients_via_proxy`]).
    pub client_proxy: Option<Proxy>,
    /// Fault proxies on the coordinator's gRPC link to decode workers, by worker name
    /// ([`ClusterSpec::control_via_proxy`]).
    pub control_proxies: BTreeMap<String, Proxy>,
    /// When a coordinator was SIGKILLed: (signal sent, death seen). A request in flight
    /// across one may end in a transport error (counted as `coordinator_lost`).
    pub coordinator_kills: Vec<(Instant, Instant)>,
    /// The API key drill traffic carries (`tandem drill --api-key`), for an attached
    /// cluster whose coordinators take only keys their tenants file lists.
    pub api_key: Option<String>,
    pub prefix: String,
    /// Per-process stderr logs (and etcd's, elsewhere: [`opskit::etcd::EtcdCluster::log_path`]).
    pub log_dir: PathBuf,
    /// Names of processes a drill killed, stopped or terminated on purpose,
    /// with what was done; the rest must be alive at the end.
    pub faulted: BTreeMap<String, Signal>,
    keep_logs: bool,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // An attached cluster is left as found even when a drill ended early: the connections
        // through a KV proxy are reset (while its REDIRECT still maps them: the resets reached
        // no prefill worker once the rule had gone), then its link rules go.
        self.unproxy_kv_link();
        let _ = self.clear_link_rules();
        // Processes are killed by their own Drop; SIGCONT first so a stopped one is reaped promptly.
        for p in self.procs().chain(self.attached_etcd()) {
            if self.faulted.get(&p.name) == Some(&Signal::Stop) {
                let _ = p.signal(Signal::Cont);
            }
        }
        if !self.keep_logs {
            let _ = std::fs::remove_dir_all(&self.log_dir);
        }
    }
}

/// How long a supervisor may take to start an exited worker again, besides waiting out its
/// predecessor's lease: its backoff and a model load on a busy 2-core machine.
pub const RESTART_WAIT: Duration = Duration::from_secs(90);

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

/// `http://127.0.0.1:PORT` as a socket address.
fn etcd_addr(endpoint: &str) -> Result<std::net::SocketAddr, HarnessError> {
    let hostport = endpoint.strip_prefix("http://").unwrap_or(endpoint);
    hostport.parse().map_err(|e| HarnessError::Setup(format!("etcd endpoint {endpoint:?}: {e}")))
}

/// A loopback port free now, for a process that must be told its port before it
/// starts. Chosen below the kernel's ephemeral range: a port probed inside it can be
/// taken, before the child binds it, as the source port of any outgoing connection on
/// the machine (CI lost a run that way: "Address already in use" for a decode worker's
/// `--grpc`); below it only another explicit bind can take it.
fn free_port() -> Result<std::net::SocketAddr, HarnessError> {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let ephemeral_lo = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let (lo, hi) = (ephemeral_lo / 2, ephemeral_lo);
    if lo >= 1024 {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        // A different start per process and call, so concurrent harnesses spread out.
        let seed = nanos as u64 ^ (u64::from(std::process::id()) << 32) ^ SEQ.fetch_add(1, Ordering::Relaxed);
        let mut rng = types::rng::XorShift64::new(seed);
        for _ in 0..64 {
            let port = lo + rng.below(u64::from(hi - lo)) as u16;
            if let Ok(a) = std::net::TcpListener::bind(("127.0.0.1", port)).and_then(|l| l.local_addr()) {
                return Ok(a);
            }
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| HarnessError::Setup(format!("pick a port: {e}")))
}

impl Cluster {
    /// Starts everything in `spec` and waits until the coordinator is ready
    /// and sees every worker registered. `keep_logs` keeps the log directory after drop.
    pub async fn start(spec: &ClusterSpec, keep_logs: bool) -> Result<Self, HarnessError> {
        let log_dir = temp_dir()?;
        let etcd = opskit::etcd::EtcdCluster::start(spec.etcd_members.max(1))
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

        // Namespaces first: prefill workers bind where a namespaced decode worker can call them.
        let mut spaces =
            spec.workers.iter().map(|w| w.netns.then(Netns::create).transpose()).collect::<Result<Vec<_>, _>>()?;
        let gateway = spaces.iter().flatten().next().map(|ns| ns.host_ip);
        // KV over ucx with a namespace: UCX over TCP on the veth only (each side's end of it),
        // so the KV crosses the link the drill faults (UCX's shared memory and loopback reach
        // across namespaces on one host).
        let ucx_if = (spec.kv_transport.as_deref() == Some("ucx"))
            .then(|| spaces.iter().flatten().next().map(|ns| ns.host_if.clone()))
            .flatten();
        let mut starting = JoinSet::new();
        let mut control_proxies = BTreeMap::new();
        let mut counts = BTreeMap::<Role, usize>::new();
        for (w, netns) in spec.workers.iter().zip(spaces.iter_mut().map(Option::take)) {
            let n = counts.entry(w.role).or_insert(0);
            let name = format!("{}-{n}", if w.role == Role::Prefill { "prefill" } else { "decode" });
            *n += 1;
            let ep = etcd_flag(&name)?;
            // In a namespace, etcd (on loopback) is reached through a proxy on the gateway.
            let etcd_path = match &netns {
                Some(ns) => Some(Proxy::start_on(ns.host_ip.into(), etcd_addr(&etcd.endpoint(0))?)?),
                None => None,
            };
            let worker_ep = etcd_path.as_ref().map_or_else(|| ep.clone(), |p| format!("http://{}", p.addr));
            // The flags every worker gets; a decode worker's own follow below.
            fn common<R>(
                a: WorkerArgv<R>,
                etcd: &str,
                prefix: &str,
                spec: &ClusterSpec,
                w: &WorkerSpec,
                name: &str,
            ) -> WorkerArgv<R> {
                a.etcd(etcd)
                    .cluster_prefix(prefix)
                    .lease_ttl_s(u64::from(spec.lease_ttl_s))
                    .version_group(&w.group)
                    .worker_id(name)
                    .threads(1)
                    .kv_blocks(spec.kv_blocks as usize)
            }
            let (bin, wants): (&str, &[&str]) = match w.role {
                Role::Prefill => (PREFILL_BINARY, &["grpc", "metrics"]),
                Role::Decode => (DECODE_BINARY, &["grpc", "metrics", "transfer"]),
            };
            // Listeners in a namespace bind its address; a prefill worker outside one binds
            // the gateway, where a namespaced decode worker can call it.
            let listen = match (&netns, w.role, gateway) {
                (Some(ns), ..) => Some(format!("{}:0", ns.ns_ip)),
                (None, Role::Prefill, Some(gw)) => Some(format!("{gw}:0")),
                _ => None,
            };
            let mut proxy = None;
            let mut args = match w.role {
                Role::Prefill => {
                    let mut a = common(WorkerArgv::prefill(), &worker_ep, &prefix, spec, w, &name);
                    if let Some(addr) = &listen {
                        a = a.grpc(addr);
                        if netns.is_some() {
                            a = a.metrics(addr);
                        }
                    }
                    a.build()
                }
                Role::Decode => {
                    let mut a = common(WorkerArgv::decode(), &worker_ep, &prefix, spec, w, &name);
                    if let Some(addr) = &listen {
                        a = a.grpc(addr).metrics(addr);
                        if !w.behind_proxy {
                            a = a.transfer(addr);
                        }
                    }
                    a = a.kv_load_failure_policy(&spec.policy);
                    if let Some(t) = &spec.kv_transport {
                        a = a.kv_transport(t);
                    }
                    if w.behind_proxy {
                        let mut transfer = free_port()?;
                        if let Some(ns) = &netns {
                            transfer.set_ip(ns.ns_ip.into());
                        }
                        let p = Proxy::start(transfer)?;
                        a = a.transfer(&transfer.to_string()).advertise_transfer(&p.addr.to_string());
                        proxy = Some(p);
                    }
                    if spec.control_via_proxy.contains(&name) {
                        let grpc = free_port()?;
                        let p = Proxy::start_replies(grpc)?;
                        a = a.grpc(&grpc.to_string()).advertise_grpc(&p.addr.to_string());
                        control_proxies.insert(name.clone(), p);
                    }
                    a.build()
                }
            };
            args.extend(w.extra.iter().cloned());
            let (role, group, dir, ucx_if) = (w.role, w.group.clone(), log_dir.clone(), ucx_if.clone());
            starting.spawn(async move {
                let mut prefix = netns.as_ref().map(Netns::exec_prefix).unwrap_or_default();
                if let Some(host_if) = ucx_if {
                    let dev = if netns.is_some() { "veth0".to_owned() } else { host_if };
                    prefix.extend(["env".into(), "UCX_TLS=tcp".into(), format!("UCX_NET_DEVICES={dev}")]);
                }
                let proc = Proc::start_with(&prefix, &name, bin, &args, wants, &dir).await?;
                Ok::<_, HarnessError>(Worker { role, group, proc, proxy, past: Vec::new(), etcd_path, netns })
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
            &spec.local_prefill_max_tokens.to_string(),
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        cargs.extend(spec.coordinator_args.iter().cloned());
        if let Some(t) = &spec.tenants {
            let file = log_dir.join("tenants.toml");
            std::fs::write(&file, &t.toml)
                .map_err(|e| HarnessError::Setup(format!("write {}: {e}", file.display())))?;
            cargs.extend(["--tenants".to_owned(), file.display().to_string()]);
        }
        // With several coordinators, each listens on fixed ports, so a restart with the same
        // flags comes back where the front expects it.
        let fixed_ports = |mut args: Vec<String>| -> Result<(Vec<String>, SocketAddr, SocketAddr), HarnessError> {
            let (h, g) = (free_port()?, free_port()?);
            for (flag, addr) in [("--http", h), ("--grpc", g)] {
                if let Some(v) = args.iter().position(|a| a == flag).and_then(|k| args.get_mut(k + 1)) {
                    *v = addr.to_string();
                }
            }
            Ok((args, h, g))
        };
        let (mut http, mut grpc) = (Vec::new(), Vec::new());
        let pinned: Vec<String> = spec
            .coordinator_cpus
            .as_ref()
            .map(|cpus| vec!["taskset".to_owned(), "-c".to_owned(), cpus.clone()])
            .unwrap_or_default();
        let mut coordinators = Vec::new();
        for i in 0..spec.coordinators.max(1) {
            let name = if i == 0 { "coordinator".to_owned() } else { format!("coordinator-{i}") };
            let args = if spec.coordinators > 1 {
                let (args, h, g) = fixed_ports(cargs.clone())?;
                http.push(h);
                grpc.push(g);
                args
            } else {
                cargs.clone()
            };
            coordinators.push(
                Proc::start_with(&pinned, &name, "tandem-coordinator", &args, &["http", "grpc"], &log_dir).await?,
            );
        }
        let front = if http.len() > 1 { Some(Front::start(http).await?) } else { None };
        let grpc_front = if grpc.len() > 1 { Some(Front::start(grpc).await?) } else { None };
        let mut coordinators = coordinators.into_iter();
        let coordinator = coordinators.next().ok_or_else(|| HarnessError::Setup("no coordinator".into()))?;
        let client_proxy = if spec.clients_via_proxy {
            let upstream = match &front {
                Some(f) => f.addr,
                None => coordinator
                    .addr("http")?
                    .parse()
                    .map_err(|e| HarnessError::Setup(format!("the coordinator's http address: {e}")))?,
            };
            Some(Proxy::start_replies(upstream)?)
        } else {
            None
        };
        let other_coordinators: Vec<Proc> = coordinators.collect();
        let cluster = Self {
            etcd,
            etcd_proxies,
            attached: None,
            lease_ttl: Duration::from_secs(spec.lease_ttl_s.into()),
            workers,
            coordinator,
            other_coordinators,
            front,
            grpc_front,
            client_proxy,
            control_proxies,
            coordinator_kills: Vec::new(),
            api_key: None,
            prefix,
            log_dir,
            faulted: BTreeMap::new(),
            keep_logs,
        };
        cluster.wait_ready().await?;
        Ok(cluster)
    }

    /// Whether this cluster was [attached](Cluster::attach) (someone else's, to leave as found).
    pub fn is_attached(&self) -> bool {
        self.attached.is_some()
    }

    /// Waits until `/ready` says 200 and the coordinator counts every worker as serving.
    pub async fn wait_ready(&self) -> Result<(), HarnessError> {
        for c in self.coordinators() {
            self.wait_coordinator_ready(c).await?;
        }
        Ok(())
    }

    /// Waits until coordinator `c` says `/ready` 200, counts every worker as serving and
    /// knows every worker's load (its polls answered), so routing scores them on real figures.
    pub async fn wait_coordinator_ready(&self, c: &Proc) -> Result<(), HarnessError> {
        let h = c.addr("http")?;
        let want = |role: Role| self.workers.iter().filter(|w| w.role == role).count() as f64;
        let (np, nd) = (want(Role::Prefill), want(Role::Decode));
        let what = format!("{} is ready and sees every worker", c.name);
        let ready = opskit::poll(&what, Duration::from_secs(60), || async {
            let status = get_status(&h, "/ready").await?;
            if status != 200 {
                return Err(HarnessError::Setup(format!("/ready answers {status}")));
            }
            let page = scrape(&h).await?;
            let count = |name, role, extra: &[(&str, &str)]| {
                let mut labels = vec![("role", role)];
                labels.extend_from_slice(extra);
                page.get(name, &labels)
            };
            let serving = |role| count(facts::metrics::coordinator::WORKERS, role, &[("state", "serving")]);
            let known = |role| count(facts::metrics::coordinator::WORKERS_LOAD_KNOWN, role, &[]);
            // A series missing is an error (the wait's last one), not 0: the check cannot pass on
            // a renamed metric.
            let counted = [serving("prefill")?, serving("decode")?, known("prefill")?, known("decode")?];
            Ok::<_, HarnessError>((counted == [np, nd, np, nd]).then_some(()))
        });
        Ok(ready.await?)
    }

    /// Every coordinator, the first one first.
    pub fn coordinators(&self) -> impl Iterator<Item = &Proc> {
        std::iter::once(&self.coordinator).chain(self.other_coordinators.iter())
    }

    /// The coordinator's HTTP address (`host:port`).
    pub fn http_addr(&self) -> Result<String, HarnessError> {
        Ok(self.coordinator.addr("http")?)
    }

    /// The base URL for loadgen: the client proxy's when there is one, else the front's
    /// when there are several coordinators, else the coordinator's.
    pub fn base_url(&self) -> Result<String, HarnessError> {
        match (&self.client_proxy, &self.front) {
            (Some(p), _) => Ok(format!("http://{}", p.addr)),
            (None, Some(f)) => Ok(format!("http://{}", f.addr)),
            (None, None) => Ok(format!("http://{}", self.http_addr()?)),
        }
    }

    /// The gRPC frontend's URL: the gRPC front's when there are several coordinators,
    /// else the coordinator's.
    pub fn grpc_url(&self) -> Result<String, HarnessError> {
        match &self.grpc_front {
            Some(f) => Ok(format!("http://{}", f.addr)),
            None => Ok(format!("http://{}", self.coordinator.addr("grpc")?)),
        }
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
        self.workers
            .iter()
            .map(|w| &w.proc)
            .chain(std::iter::once(&self.coordinator))
            .chain(self.other_coordinators.iter())
    }

    pub fn procs_mut(&mut self) -> impl Iterator<Item = &mut Proc> {
        self.workers
            .iter_mut()
            .map(|w| &mut w.proc)
            .chain(std::iter::once(&mut self.coordinator))
            .chain(self.other_coordinators.iter_mut())
    }

    /// The process (worker or coordinator) called `name`.
    pub fn proc_mut(&mut self, name: &str) -> Result<&mut Proc, HarnessError> {
        self.procs_mut().find(|p| p.name == name).ok_or_else(|| HarnessError::Setup(format!("no process {name}")))
    }

    /// Sends `sig` to process `name` (worker or coordinator) and records it as a deliberate fault.
    pub fn signal(&mut self, name: &str, sig: Signal) -> Result<u32, HarnessError> {
        let p = self.proc_mut(name)?;
        p.signal(sig)?;
        let pid = p.pid;
        self.faulted.insert(name.to_owned(), sig);
        Ok(pid)
    }

    /// SIGKILLs coordinator `name` and waits until it is reaped; the window is recorded so
    /// requests in flight on it may end in a transport error (see [`Cluster::coordinator_kills`]).
    pub async fn kill_coordinator(&mut self, name: &str) -> Result<u32, HarnessError> {
        if !self.coordinators().any(|c| c.name == name) {
            return Err(HarnessError::Setup(format!("no coordinator {name}")));
        }
        let sent = Instant::now();
        let pid = self.signal(name, Signal::Kill)?;
        let r = self.proc_mut(name)?.wait_exit(Duration::from_secs(10)).await;
        self.coordinator_kills.push((sent, Instant::now()));
        Ok(r.map(|_| pid)?)
    }

    /// Starts the exited process `name` again with `args` (its old flags when `None`); it is
    /// no longer counted as faulted: it must be alive at the end and stop cleanly (G5).
    /// In an attached cluster its supervisor (or `restart` template) starts it again, with
    /// the flags it chose: `args` must be `None`; then waits until it is ready.
    pub async fn restart(&mut self, name: &str, args: Option<Vec<String>>) -> Result<u32, HarnessError> {
        if self.is_attached() {
            if args.is_some() {
                return Err(HarnessError::Fault(format!(
                    "{name} belongs to a cluster someone else started: its supervisor restarts it with its own flags"
                )));
            }
            let old = self.proc_mut(name)?.pid;
            let r = self.follow_restart(name, old, self.lease_ttl * 2 + RESTART_WAIT).await?;
            self.wait_ready().await?;
            return Ok(r.pid);
        }
        let p = self.proc_mut(name)?;
        p.restart(args).await?;
        let pid = p.pid;
        self.faulted.remove(name);
        Ok(pid)
    }

    /// Drains worker `name` (SIGTERM), records its last KV counters as a past life, and starts
    /// it again in version group `group` (its other flags unchanged). Returns the drained
    /// life's exit status and how long the drain took. In an attached cluster its supervisor
    /// starts it again ([`Cluster::await_restart`], same group only: the supervisor chose its
    /// flags), and the exit status is the one the supervisor saw.
    pub async fn relabel_worker(
        &mut self,
        name: &str,
        group: &str,
        limit: Duration,
    ) -> Result<(std::process::ExitStatus, Duration), HarnessError> {
        let m = self.worker(name)?.metrics_addr()?;
        let supervised = self.worker(name)?.proc.is_adopted();
        if supervised && self.worker(name)?.group != group {
            return Err(HarnessError::Fault(format!(
                "{name} belongs to a cluster someone else started: its supervisor restarts it in its own group, not {group}"
            )));
        }
        let started = Instant::now();
        let (old_pid, old_group) = (self.signal(name, Signal::Term)?, self.worker(name)?.group.clone());
        // Scrape until it exits: the last page is what this life counted (its transfers ended
        // in the drain's first phase, long before the process exits).
        let mut last = scrape(&m).await.ok();
        let status = loop {
            if let Some(st) = self.worker_mut(name)?.proc.exited() {
                break st;
            }
            if started.elapsed() > limit {
                return Err(HarnessError::Timeout(format!(
                    "{name} (pid {old_pid}) did not exit within {limit:?} of SIGTERM"
                )));
            }
            if let Ok(p) = scrape(&m).await {
                last = Some(p);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let took = started.elapsed();
        let last = last.ok_or_else(|| HarnessError::Metrics(format!("{name}: no metrics page before it exited")))?;
        let w = self.worker_mut(name)?;
        w.past.push(PastLife {
            pid: old_pid,
            group: old_group.clone(),
            kv_sent: if w.role == Role::Prefill {
                kv_moved(Role::Prefill, &last).map_err(HarnessError::Metrics)?
            } else {
                0.0
            },
            kv_received: if w.role == Role::Decode {
                kv_moved(Role::Decode, &last).map_err(HarnessError::Metrics)?
            } else {
                0.0
            },
            counted: true,
        });
        if supervised {
            let r = self.await_restart(name, old_pid, self.lease_ttl * 2 + RESTART_WAIT).await?;
            let described = r.last_exit.unwrap_or_default();
            let status = parse_exit(&described).ok_or_else(|| {
                HarnessError::Fault(format!(
                    "{name} (pid {old_pid}): the supervisor saw an exit it did not describe: {described:?}"
                ))
            })?;
            return Ok((status, took));
        }
        let mut args = w.proc.args().to_vec();
        match args.iter().position(|a| a == "--version-group").and_then(|k| args.get_mut(k + 1)) {
            Some(v) => *v = group.to_owned(),
            None => args.extend(["--version-group".to_owned(), group.to_owned()]),
        }
        w.group = group.to_owned();
        self.restart(name, Some(args)).await?;
        Ok((status, took))
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
        let mut v: Vec<(String, PathBuf)> =
            self.procs().flat_map(|p| p.log_paths().map(|l| (p.name.clone(), l.to_owned()))).collect();
        v.extend(self.etcd.log_paths().into_iter().map(|(m, p)| (format!("etcd-{m}"), p)));
        v.extend(self.attached_etcd().flat_map(|p| p.log_paths().map(|l| (p.name.clone(), l.to_owned()))));
        v
    }

    /// Where G5 starts reading log `path`: its length when an attached cluster was
    /// attached ([`Attached::log_starts`]), else 0.
    pub fn log_start(&self, path: &Path) -> u64 {
        self.attached.as_ref().and_then(|a| a.log_starts.get(path).copied()).unwrap_or(0)
    }

    /// Worker `name`'s KV counters (sent, received) when an attached cluster was attached
    /// ([`Attached::kv_at_attach`]), else zero.
    pub fn kv_at_attach(&self, name: &str) -> (f64, f64) {
        self.attached.as_ref().and_then(|a| a.kv_at_attach.get(name).copied()).unwrap_or_default()
    }

    /// Arms `fault` on every proxy between process `name` and etcd
    /// ([`ClusterSpec::etcd_via_proxy`]); `Fault::Blackhole` cuts it off, `Fault::None` lifts that.
    /// In an attached cluster, `name`'s etcd links are cut by an `iptables` rule per member in
    /// its network instead ([`Worker::link_net`]).
    pub fn etcd_link(&self, name: &str, fault: crate::proxy::Fault) -> Result<(), HarnessError> {
        if self.attached.is_some() && !self.etcd_proxies.contains_key(name) {
            let net = self.link_net_of(name)?;
            let op = match fault {
                crate::proxy::Fault::Blackhole => "-A",
                crate::proxy::Fault::None => "-D",
                other => return Err(HarnessError::Fault(format!("{other:?} on an etcd link needs a fault proxy"))),
            };
            if op == "-D" {
                // The rules' counters go with them: keep what they dropped for the proof.
                let n = net.rule_packets("OUTPUT", ETCD_LINK_RULE)?.unwrap_or(0);
                if let Some(a) = &self.attached {
                    *a.etcd_dropped.lock().unwrap_or_else(|e| e.into_inner()).entry(name.to_owned()).or_default() += n;
                }
            }
            for rule in self.etcd_drop_rules()? {
                let args: Vec<&str> = std::iter::once(op).chain(rule.iter().map(String::as_str)).collect();
                net.iptables(&args)?;
            }
            return Ok(());
        }
        let proxies = self
            .etcd_proxies
            .get(name)
            .ok_or_else(|| HarnessError::Setup(format!("{name}'s etcd traffic crosses no proxy")))?;
        for p in proxies {
            p.arm(fault);
        }
        Ok(())
    }

    /// The OUTPUT rules (without `-A`/`-D`) that cut a worker off from each attached etcd
    /// member.
    fn etcd_drop_rules(&self) -> Result<Vec<Vec<String>>, HarnessError> {
        let mut rules = Vec::new();
        for p in self.attached_etcd() {
            let addr = p.socket_addr("grpc")?;
            rules.push(
                ["OUTPUT", "-p", "tcp", "-d", &addr.ip().to_string(), "--dport", &addr.port().to_string()]
                    .into_iter()
                    .chain(["-m", "comment", "--comment", ETCD_LINK_RULE, "-j", "DROP"])
                    .map(str::to_owned)
                    .collect(),
            );
        }
        if rules.is_empty() {
            return Err(HarnessError::Setup("the attached cluster lists no etcd member".into()));
        }
        Ok(rules)
    }

    /// Bytes (both ways) the blackhole dropped on `name`'s etcd links so far; in an attached
    /// cluster, the packets its `iptables` rules dropped.
    pub fn etcd_link_dropped(&self, name: &str) -> u64 {
        if self.attached.is_some() && !self.etcd_proxies.contains_key(name) {
            let net = self.link_net_of(name);
            let now = net.and_then(|n| n.rule_packets("OUTPUT", ETCD_LINK_RULE)).ok().flatten().unwrap_or(0);
            let before = self.attached.as_ref().map_or(0, |a| {
                a.etcd_dropped.lock().unwrap_or_else(|e| e.into_inner()).get(name).copied().unwrap_or(0)
            });
            return now + before;
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probed_ports_lie_below_the_ephemeral_range_and_are_free() {
        let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").expect("port range");
        let lo: u16 = range.split_whitespace().next().and_then(|p| p.parse().ok()).expect("range start");
        for _ in 0..20 {
            let a = free_port().expect("a port");
            assert!(a.port() < lo && a.port() >= lo / 2, "{a} is not below the ephemeral range {range}");
            drop(std::net::TcpListener::bind(a).expect("still free"));
        }
    }
}
