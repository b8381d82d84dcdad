//! The drills: each names a cluster, a load, one fault, the proof that the
//! fault happened (G6) and how its outcome is judged; [`run_drill`] runs one.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use loadgen::{Arrival, Outcome, Plan, PromptSource, Report};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

use crate::cluster::{Cluster, ClusterSpec, Role};
use crate::invariants::{self, Guarantee, Invariants, Violation};
use crate::process::{proc_state, socket_owner, Signal};
use crate::proxy::Fault;
use crate::{eventually, reference_texts, HarnessError};

const MODEL: &str = "SmolLM2-135M-Instruct";
const PROMPT_TOKENS: usize = 40;

/// A drill's name and what it does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct DrillInfo {
    pub name: &'static str,
    pub description: &'static str,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Id {
    DecodeKill,
    PrefillKillRecompute,
    KvCorrupt,
    EtcdRestart,
    ClientDisconnect,
    Overload3x,
    WorkerSigstop,
    RollingDrain,
    TightDeadlines,
}

const ALL: [(Id, DrillInfo); 9] = [
    (
        Id::DecodeKill,
        DrillInfo {
            name: "decode-kill",
            description: "SIGKILL a decode worker while it streams (2 decode workers): its streams end typed \
                          (worker_stream), the rest complete on the other worker",
        },
    ),
    (
        Id::PrefillKillRecompute,
        DrillInfo {
            name: "prefill-kill-recompute",
            description: "SIGKILL the prefill worker whose KV push is held mid-transfer on the proxy (policy \
                          recompute): the decode worker recomputes and every answer is identical",
        },
    ),
    (
        Id::KvCorrupt,
        DrillInfo {
            name: "kv-corrupt",
            description: "flip one byte on a decode worker's KV link: the frame is refused, the load counted as \
                          failed, and policy recompute gives identical answers",
        },
    ),
    (
        Id::EtcdRestart,
        DrillInfo {
            name: "etcd-restart",
            description: "restart etcd under load with two version groups: serving continues from the cached \
                          membership, the coordinator re-lists, no KV crosses groups",
        },
    ),
    (
        Id::ClientDisconnect,
        DrillInfo {
            name: "client-disconnect",
            description: "clients hang up on streaming requests mid-answer: each is cancelled on the decode \
                          worker and its KV freed",
        },
    ),
    (
        Id::Overload3x,
        DrillInfo {
            name: "overload-3x",
            description: "offer 3x what admission holds (--max-running 1 --max-queued 2): the excess is refused \
                          429/503 with Retry-After, nothing is lost, admitted answers are identical",
        },
    ),
    (
        Id::WorkerSigstop,
        DrillInfo {
            name: "worker-sigstop",
            description: "SIGSTOP a decode worker (2 decode workers, lease TTL 2 s) past its lease, then SIGCONT: \
                          it leaves membership, the load finishes on the other worker, and it registers again",
        },
    ),
    (
        Id::RollingDrain,
        DrillInfo {
            name: "rolling-drain",
            description: "SIGTERM one decode worker, then one prefill worker, under load while a replacement of \
                          each role serves: every request completes identically and each drained worker exits 0",
        },
    ),
    (
        Id::TightDeadlines,
        DrillInfo {
            name: "tight-deadlines",
            description: "load with an x-request-timeout-ms some requests cannot meet (--max-running 1): each \
                          completes or ends 504 deadline_exceeded, none past its deadline, KV back to 0",
        },
    ),
];

/// Every drill, in the order the tests run them.
pub fn drills() -> Vec<DrillInfo> {
    ALL.iter().map(|(_, i)| *i).collect()
}

/// How to run a drill.
#[derive(Debug, Clone, Default)]
pub struct DrillOptions {
    /// Do everything but the fault itself (to show the drill does not pass vacuously: G6 fails).
    pub skip_fault: bool,
    /// Keep the processes' logs after the run (their directory is in the report).
    pub keep_logs: bool,
    /// Requests in the load (default per drill).
    pub requests: Option<usize>,
}

/// The result of one drill, for tests, the CLI and charts.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DrillReport {
    pub drill: String,
    pub description: String,
    pub skip_fault: bool,
    /// G6 held: the fault provably happened.
    pub fault_proven: bool,
    /// What the proof saw (or why it failed).
    pub proof: String,
    pub requests: usize,
    pub complete: usize,
    /// Typed errors by code (`http 503 queue_full` style labels).
    pub typed_errors: BTreeMap<String, usize>,
    /// Requests with no typed outcome (transport, protocol, timeout).
    pub lost: usize,
    /// KV blocks still used on live workers after settling.
    pub leaked_blocks: f64,
    pub p99_ttft_ms: Option<f64>,
    pub wall_ms: f64,
    /// Version groups G3 could not count (a member was killed).
    pub g3_skipped_groups: Vec<String>,
    pub violations: Vec<Violation>,
    /// Where the processes' logs are (removed after the run unless `keep_logs`).
    pub log_dir: String,
    /// The load's records, for charts.
    pub load: Report,
}

impl DrillReport {
    /// Violations of one guarantee.
    pub fn of(&self, g: Guarantee) -> Vec<&Violation> {
        self.violations.iter().filter(|v| v.guarantee == g).collect()
    }
}

/// What a fault step observed, for its proof.
#[derive(Debug, Default)]
struct Evidence {
    victim: Option<(String, u32)>,
    before: f64,
    notes: Vec<String>,
    seen: bool,
    /// What the fault step waited for and did not see.
    missing: Vec<String>,
    /// Drained workers: name, pid, exit code (`None`: did not exit, or not by `exit`).
    drained: Vec<(String, u32, Option<i32>)>,
}

/// Progress of the load, for fault steps that wait on it.
#[derive(Clone)]
struct Progress {
    done: Arc<AtomicUsize>,
    finished: Arc<AtomicBool>,
}

struct Setup {
    spec: ClusterSpec,
    requests: usize,
    max_tokens: u32,
    concurrency: usize,
    invariants: Invariants,
}

fn setup(id: Id, skip_fault: bool) -> Setup {
    let base = ClusterSpec::default();
    let inv = Invariants::default();
    let intact = Invariants { all_complete: true, transfers_intact: true, ..inv.clone() };
    match id {
        Id::DecodeKill => Setup {
            spec: base.prefill("g1").decode("g1").decode("g1"),
            requests: 8,
            max_tokens: 32,
            concurrency: 2,
            invariants: Invariants {
                allowed_errors: Some(vec!["worker_stream".into(), "retryable".into(), "no_worker".into()]),
                ..inv
            },
        },
        Id::PrefillKillRecompute => Setup {
            spec: base.prefill("g1").prefill("g1").decode_behind_proxy("g1"),
            requests: 6,
            max_tokens: 16,
            concurrency: 2,
            invariants: Invariants { all_complete: true, ..inv },
        },
        Id::KvCorrupt => Setup {
            spec: base.prefill("g1").decode_behind_proxy("g1"),
            requests: 6,
            max_tokens: 16,
            concurrency: 2,
            invariants: Invariants { all_complete: true, ..inv },
        },
        Id::EtcdRestart => Setup {
            // Leases outlive the restart, so workers do not fence; two groups give G3 teeth.
            spec: ClusterSpec { lease_ttl_s: 5, ..base }.prefill("g1").decode("g1").prefill("g2").decode("g2"),
            requests: 8,
            max_tokens: 16,
            concurrency: 2,
            invariants: intact,
        },
        Id::ClientDisconnect => Setup {
            spec: base.prefill("g1").decode("g1"),
            requests: 6,
            max_tokens: 16,
            concurrency: 2,
            invariants: Invariants { all_complete: true, ..inv },
        },
        Id::Overload3x => Setup {
            spec: base.prefill("g1").decode("g1").coordinator_args(&["--max-running", "1", "--max-queued", "2"]),
            requests: 12,
            max_tokens: 16,
            // 3x the 3 requests admission holds; the no-fault run stays within them.
            concurrency: if skip_fault { 1 } else { 9 },
            invariants: Invariants {
                allowed_errors: Some(vec!["queue_full".into(), "rate_limit_exceeded".into()]),
                transfers_intact: true,
                ..inv
            },
        },
        Id::WorkerSigstop => Setup {
            spec: base.prefill("g1").decode("g1").decode("g1"),
            requests: 12,
            max_tokens: 32,
            concurrency: 2,
            invariants: Invariants {
                allowed_errors: Some(vec![
                    "worker_stream".into(),
                    "retryable".into(),
                    "no_worker".into(),
                    "deadline_exceeded".into(),
                ]),
                ..inv
            },
        },
        Id::RollingDrain => Setup {
            spec: base.prefill("g1").prefill("g1").decode("g1").decode("g1"),
            requests: 16,
            max_tokens: 16,
            concurrency: 2,
            invariants: Invariants { all_complete: true, ..inv },
        },
        Id::TightDeadlines => Setup {
            // One request runs at a time; the queue behind it outlives the deadline.
            spec: base.prefill("g1").decode("g1").coordinator_args(&["--max-running", "1"]),
            requests: 10,
            max_tokens: 16,
            concurrency: if skip_fault { 1 } else { 6 },
            invariants: Invariants {
                deadline: if skip_fault { inv.deadline } else { TIGHT_DEADLINE },
                allowed_errors: Some(vec!["deadline_exceeded".into()]),
                ..inv
            },
        },
    }
}

/// tight-deadlines' `x-request-timeout-ms`.
const TIGHT_DEADLINE: Duration = Duration::from_millis(4000);

/// Runs drill `name`: starts its cluster, runs the load with the fault, checks G1–G6,
/// shuts the cluster down (SIGTERM must end every process cleanly: G5).
pub async fn run_drill(name: &str, opts: &DrillOptions) -> Result<DrillReport, HarnessError> {
    let (id, info) =
        ALL.iter().find(|(_, i)| i.name == name).copied().ok_or_else(|| HarnessError::UnknownDrill(name.into()))?;
    let mut s = setup(id, opts.skip_fault);
    if let Some(n) = opts.requests {
        s.requests = n;
    }
    let seed = 7;
    let prompts = loadgen::prompts::generate(s.requests, PROMPT_TOKENS, seed);
    let (p2, max) = (prompts.clone(), s.max_tokens);
    let reference = tokio::task::spawn_blocking(move || reference_texts(&p2, max))
        .await
        .map_err(|e| HarnessError::Setup(format!("reference task: {e}")))??;

    let mut cluster = Cluster::start(&s.spec, opts.keep_logs).await?;
    let mut plan = Plan::new(cluster.base_url()?, MODEL);
    plan.requests = s.requests;
    plan.arrival = Arrival::Closed { concurrency: s.concurrency };
    plan.prompts = PromptSource::List(prompts);
    plan.max_tokens = s.max_tokens;
    plan.seed = seed;
    plan.deadline = Some(s.invariants.deadline);
    plan.timeout = s.invariants.deadline + s.invariants.grace + Duration::from_secs(10);

    let progress = Progress { done: Arc::default(), finished: Arc::default() };
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let hooks = loadgen::Hooks { cancel: CancellationToken::new(), records: Some(tx) };
    {
        let done = progress.done.clone();
        tokio::spawn(async move {
            while rx.recv().await.is_some() {
                done.fetch_add(1, Ordering::SeqCst);
            }
        });
    }
    let load = {
        let (plan, finished) = (plan.clone(), progress.finished.clone());
        tokio::spawn(async move {
            let r = loadgen::run_with(&plan, hooks).await;
            finished.store(true, Ordering::SeqCst);
            r
        })
    };
    let evidence = fault(id, &mut cluster, &progress, opts.skip_fault).await;
    let report = load
        .await
        .map_err(|e| HarnessError::Load(format!("load task: {e}")))?
        .map_err(|e| HarnessError::Load(e.to_string()))?;
    let evidence = evidence?;
    let proof = prove(id, &cluster, &evidence, &report).await;

    let (mut violations, measured) = s.invariants.check_measured(&cluster, &report, &reference).await;
    if let Err(e) = &proof {
        violations.push(Violation::new(Guarantee::G6, e.clone()));
    }
    for v in invariants::shutdown(&mut cluster, Duration::from_secs(20)).await {
        if !violations.contains(&v) {
            violations.push(v);
        }
    }
    let summary = report.summary();
    let mut typed = BTreeMap::new();
    let mut lost = 0;
    for r in &report.records {
        match &r.outcome {
            Outcome::Complete { .. } => {}
            Outcome::HttpError { code: Some(_), .. } | Outcome::StreamError { code: Some(_), .. } => {
                *typed.entry(r.outcome.label()).or_insert(0) += 1
            }
            _ => lost += 1,
        }
    }
    Ok(DrillReport {
        drill: info.name.into(),
        description: info.description.into(),
        skip_fault: opts.skip_fault,
        fault_proven: proof.is_ok(),
        proof: match proof {
            Ok(p) => p,
            Err(e) => e,
        },
        requests: summary.requests,
        complete: summary.ok,
        typed_errors: typed,
        lost,
        leaked_blocks: measured.leaked_blocks,
        p99_ttft_ms: summary.ttft.p99.map(|d| d.as_secs_f64() * 1e3),
        wall_ms: summary.wall.as_secs_f64() * 1e3,
        g3_skipped_groups: measured.g3_skipped_groups,
        violations,
        log_dir: cluster.log_dir().display().to_string(),
        load: report,
    })
}

/// Applies the drill's fault during the load (everything but the fault itself when `skip`).
async fn fault(id: Id, c: &mut Cluster, progress: &Progress, skip: bool) -> Result<Evidence, HarnessError> {
    let mut ev = Evidence::default();
    let load_wait = Duration::from_secs(60);
    match id {
        Id::DecodeKill => {
            // The first decode worker seen running a request is the victim.
            let name = busy_decoder(c, load_wait).await?;
            let pid = c.worker(&name)?.proc.pid;
            if !skip {
                c.signal(&name, Signal::Kill)?;
            }
            ev.notes.push(format!("{name} (pid {pid}) was running a request"));
            ev.victim = Some((name, pid));
        }
        Id::PrefillKillRecompute => {
            let decode = c.workers_of(Role::Decode).next().ok_or_else(|| HarnessError::Setup("no decode".into()))?;
            let proxy = decode.proxy.as_ref().ok_or_else(|| HarnessError::Setup("decode not behind a proxy".into()))?;
            let m = decode.metrics_addr()?;
            ev.before = recomputed(&m).await?;
            // 16 KiB into the next push: inside the first layers' frames, long before its Ack.
            proxy.arm(Fault::HoldAfter(16 << 10));
            let prefills: Vec<u32> = c.workers_of(Role::Prefill).map(|w| w.proc.pid).collect();
            let held = tokio::task::block_in_place(|| proxy.wait_held(load_wait))?;
            let pid = socket_owner(held, &prefills).ok_or_else(|| {
                HarnessError::Fault(format!("no prefill worker owns the held connection from {held}"))
            })?;
            let name = c
                .workers
                .iter()
                .find(|w| w.proc.pid == pid)
                .map(|w| w.proc.name.clone())
                .ok_or_else(|| HarnessError::Fault(format!("pid {pid} is no worker")))?;
            ev.notes.push(format!("{name} (pid {pid}) owns the held KV connection from {held}"));
            if !skip {
                c.signal(&name, Signal::Kill)?;
                let _ = c.worker_mut(&name)?.proc.wait_exit(Duration::from_secs(10)).await;
            }
            if let Some(p) = c.workers_of(Role::Decode).next().and_then(|w| w.proxy.as_ref()) {
                p.release();
            }
            ev.victim = Some((name, pid));
        }
        Id::KvCorrupt => {
            let decode = c.workers_of(Role::Decode).next().ok_or_else(|| HarnessError::Setup("no decode".into()))?;
            let m = decode.metrics_addr()?;
            ev.before = crate::metrics::scrape(&m).await?.sum("tandem_kv_load_failures_total", &[]);
            if !skip {
                // 100 KiB into the stream: inside a layer's payload, where only the checksum can tell.
                if let Some(p) = decode.proxy.as_ref() {
                    p.arm(Fault::FlipAfter(100 << 10));
                }
            }
        }
        Id::EtcdRestart => {
            let before = c.coordinator_metrics().await?.sum("tandem_coordinator_registry_resyncs_total", &[]);
            ev.before = before;
            let done = progress.done.clone();
            eventually("2 requests complete before the restart", load_wait, || {
                let n = done.load(Ordering::SeqCst);
                async move { n >= 2 }
            })
            .await?;
            ev.victim = c.etcd.pid().map(|p| ("etcd".to_owned(), p));
            if !skip {
                c.etcd.restart().await.map_err(|e| HarnessError::Fault(format!("etcd restart: {e}")))?;
            }
        }
        Id::ClientDisconnect => {
            let m = c.workers_of(Role::Decode).next().ok_or_else(|| HarnessError::Setup("no decode".into()))?;
            let m = m.metrics_addr()?;
            ev.before =
                crate::metrics::scrape(&m).await?.sum("tandem_decode_requests_total", &[("outcome", "cancelled")]);
            let h = c.http_addr()?;
            for i in 0..3 {
                let mut s = open_stream(&h, i).await?;
                // Read up to the first token, so the request is mid-answer when dropped.
                s.first_data().await?;
                if skip {
                    s.read_to_end().await?;
                }
                drop(s);
            }
            ev.notes.push("3 streaming clients hung up after their first token".into());
        }
        Id::Overload3x => {
            // Once the queue is full (1 running, 2 queued), a probe must be refused with Retry-After.
            let h = c.http_addr()?;
            while !progress.finished.load(Ordering::SeqCst) {
                let depth = c.coordinator_metrics().await?.sum("tandem_coordinator_queue_depth", &[]);
                if depth >= 2.0 {
                    let (status, retry_after) = probe(&h).await?;
                    if status == 429 || status == 503 {
                        ev.seen = true;
                        ev.notes.push(format!("a probe was refused {status}, Retry-After {retry_after:?}"));
                        if retry_after.is_none() {
                            return Err(HarnessError::Fault(format!("a {status} refusal without Retry-After")));
                        }
                        break;
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        Id::WorkerSigstop => {
            let name = busy_decoder(c, load_wait).await?;
            let pid = c.worker(&name)?.proc.pid;
            ev.before = c.coordinator_metrics().await?.sum(MEMBERSHIP, &[("change", "left")]);
            ev.victim = Some((name.clone(), pid));
            if !skip {
                c.signal(&name, Signal::Stop)?;
                let stopped = eventually("the stopped worker's /proc state is T", Duration::from_secs(5), || async {
                    proc_state(pid) == Some('T')
                })
                .await;
                ev.seen = stopped.is_ok();
                ev.notes.push(format!(
                    "{name} (pid {pid}) was running a request; SIGSTOP: /proc state {:?}",
                    proc_state(pid)
                ));
                // The lease (TTL 2 s) lapses; the coordinator must drop it. Continue it whatever happened.
                let left = serving_becomes(c, Role::Decode, 1.0, Duration::from_secs(15)).await;
                let t = ev.before + 0.0;
                let now = c.coordinator_metrics().await.map_or(t, |p| p.sum(MEMBERSHIP, &[("change", "left")]));
                ev.notes
                    .push(format!("left membership: serving decode 1: {}; `left` changes {t} -> {now}", left.is_ok()));
                if left.is_err() && now <= t {
                    ev.missing.push("the coordinator never saw the stopped worker leave".into());
                }
                c.signal(&name, Signal::Cont)?;
                match serving_becomes(c, Role::Decode, 2.0, Duration::from_secs(15)).await {
                    Ok(()) => ev.notes.push("after SIGCONT it registered again: 2 decode serving".into()),
                    Err(e) => ev.missing.push(format!("after SIGCONT: {e}")),
                }
            }
        }
        Id::RollingDrain => {
            let done = progress.done.clone();
            eventually("2 requests complete before the drain", load_wait, || {
                let n = done.load(Ordering::SeqCst);
                async move { n >= 2 }
            })
            .await?;
            // A decode worker mid-answer first, then a prefill worker; each has a serving twin.
            let decode = busy_decoder(c, load_wait).await?;
            let prefill = c
                .workers_of(Role::Prefill)
                .next()
                .map(|w| w.proc.name.clone())
                .ok_or_else(|| HarnessError::Setup("no prefill".into()))?;
            for (role, name) in [(Role::Decode, decode), (Role::Prefill, prefill)] {
                let pid = c.worker(&name)?.proc.pid;
                if skip {
                    continue;
                }
                let under_load = !progress.finished.load(Ordering::SeqCst);
                c.signal(&name, Signal::Term)?;
                let code = match c.worker_mut(&name)?.proc.wait_exit(Duration::from_secs(20)).await {
                    Ok(st) => {
                        ev.notes
                            .push(format!("{name} (pid {pid}) drained (load running: {under_load}) and exited {st}"));
                        st.code()
                    }
                    Err(e) => {
                        ev.missing.push(e.to_string());
                        None
                    }
                };
                ev.drained.push((name, pid, code));
                if let Err(e) = serving_becomes(c, role, 1.0, Duration::from_secs(10)).await {
                    ev.missing.push(e.to_string());
                }
            }
        }
        Id::TightDeadlines => {
            // The fault is the load's own deadline (see `setup`); the proof reads the outcomes.
        }
    }
    Ok(ev)
}

const MEMBERSHIP: &str = "tandem_coordinator_membership_changes_total";

/// The first decode worker seen running a request.
async fn busy_decoder(c: &Cluster, limit: Duration) -> Result<String, HarnessError> {
    let decoders: Vec<(String, String)> = c
        .workers_of(Role::Decode)
        .map(|w| Ok((w.proc.name.clone(), w.metrics_addr()?)))
        .collect::<Result<_, HarnessError>>()?;
    let victim = std::sync::Mutex::new(None);
    eventually("a decode worker runs a request", limit, || {
        let (decoders, victim) = (&decoders, &victim);
        async move {
            for (name, m) in decoders {
                if let Ok(p) = crate::metrics::scrape(m).await {
                    if p.sum("tandem_num_requests_running", &[]) >= 1.0 {
                        *victim.lock().unwrap_or_else(|e| e.into_inner()) = Some(name.clone());
                        return true;
                    }
                }
            }
            false
        }
    })
    .await?;
    victim.into_inner().unwrap_or_else(|e| e.into_inner()).ok_or_else(|| HarnessError::Fault("no victim".into()))
}

/// Waits until the coordinator counts `n` serving workers of `role`.
async fn serving_becomes(c: &Cluster, role: Role, n: f64, limit: Duration) -> Result<(), HarnessError> {
    let role = if role == Role::Prefill { "prefill" } else { "decode" };
    eventually(&format!("the coordinator counts {n} serving {role} worker(s)"), limit, || async move {
        c.coordinator_metrics()
            .await
            .is_ok_and(|p| p.sum("tandem_coordinator_workers", &[("role", role), ("state", "serving")]) == n)
    })
    .await
}

/// G6: the fault happened. Ok says what showed it; Err what did not.
async fn prove(id: Id, c: &Cluster, ev: &Evidence, report: &Report) -> Result<String, String> {
    let gone = |pid: u32| matches!(proc_state(pid), None | Some('Z'));
    let victim = || ev.victim.clone().ok_or("no victim was chosen".to_owned());
    match id {
        Id::DecodeKill => {
            let (name, pid) = victim()?;
            if !gone(pid) {
                return Err(format!("decode worker {name} (pid {pid}) is still running"));
            }
            Ok(format!("{}; pid {pid} is gone from /proc", ev.notes.join("; ")))
        }
        Id::PrefillKillRecompute => {
            let (name, pid) = victim()?;
            if !gone(pid) {
                return Err(format!("prefill worker {name} (pid {pid}) is still running"));
            }
            let m = decode_metrics(c)?;
            let now = recomputed(&m).await.map_err(|e| e.to_string())?;
            if now <= ev.before {
                return Err(format!("pid {pid} is gone but the decode worker recomputed no failed load"));
            }
            Ok(format!("{}; pid {pid} gone; decode recomputed {} loads", ev.notes.join("; "), now - ev.before))
        }
        Id::KvCorrupt => {
            let proxy = c.workers_of(Role::Decode).next().and_then(|w| w.proxy.as_ref()).ok_or("no proxy")?;
            let flips = proxy.counters().flips;
            let p = crate::metrics::scrape(&decode_metrics(c)?).await.map_err(|e| e.to_string())?;
            let failures = p.sum("tandem_kv_load_failures_total", &[]) - ev.before;
            let refused = p.sum("tandem_kv_frames_refused_total", &[("reason", "checksum")]);
            if flips == 0 || failures < 1.0 {
                return Err(format!(
                    "the proxy flipped {flips} bytes and the decode worker counted {failures} failed loads"
                ));
            }
            Ok(format!(
                "proxy flipped {flips} byte(s); {failures} failed load(s); {refused} frame(s) refused by checksum"
            ))
        }
        Id::EtcdRestart => {
            let (_, pid) = victim()?;
            if !gone(pid) {
                return Err(format!("etcd (pid {pid}) is still the running member"));
            }
            let now = std::sync::Mutex::new(0.0);
            let seen = eventually("the coordinator re-lists membership", Duration::from_secs(10), || {
                let now = &now;
                async move {
                    let v = c
                        .coordinator_metrics()
                        .await
                        .map_or(0.0, |p| p.sum("tandem_coordinator_registry_resyncs_total", &[]));
                    *now.lock().unwrap_or_else(|e| e.into_inner()) = v;
                    v > ev.before
                }
            })
            .await;
            seen.map_err(|e| format!("old etcd pid {pid} is gone, but {e}"))?;
            let now = now.into_inner().unwrap_or_else(|e| e.into_inner());
            Ok(format!(
                "old etcd pid {pid} gone, new pid {:?}; coordinator resyncs {} -> {now}",
                c.etcd.pid(),
                ev.before
            ))
        }
        Id::ClientDisconnect => {
            let m = decode_metrics(c)?;
            let now = std::sync::Mutex::new(0.0);
            let seen = eventually("the decode worker cancels the abandoned streams", Duration::from_secs(10), || {
                let (m, now) = (&m, &now);
                async move {
                    let v = crate::metrics::scrape(m)
                        .await
                        .map_or(0.0, |p| p.sum("tandem_decode_requests_total", &[("outcome", "cancelled")]));
                    *now.lock().unwrap_or_else(|e| e.into_inner()) = v;
                    v >= ev.before + 3.0
                }
            })
            .await;
            let now = now.into_inner().unwrap_or_else(|e| e.into_inner());
            seen.map_err(|e| format!("{e}: {} cancelled", now - ev.before))?;
            Ok(format!("{}; the decode worker cancelled {}", ev.notes.join("; "), now - ev.before))
        }
        Id::Overload3x => {
            let shed = c
                .coordinator_metrics()
                .await
                .map_err(|e| e.to_string())?
                .sum("tandem_coordinator_admission_shed_total", &[]);
            if shed < 1.0 || !ev.seen {
                return Err(format!("admission shed {shed} requests; a probe refused with Retry-After: {}", ev.seen));
            }
            Ok(format!("admission shed {shed} requests; {}", ev.notes.join("; ")))
        }
        Id::WorkerSigstop => {
            let (name, pid) = victim()?;
            if !ev.seen {
                return Err(format!("{name} (pid {pid}) was never seen stopped (state T)"));
            }
            if !ev.missing.is_empty() {
                return Err(format!("{}; but {}", ev.notes.join("; "), ev.missing.join("; ")));
            }
            Ok(ev.notes.join("; "))
        }
        Id::RollingDrain => {
            if ev.drained.len() != 2 || !ev.missing.is_empty() {
                return Err(format!("drained {:?}; {}", ev.drained, ev.missing.join("; ")));
            }
            if let Some((name, pid, code)) = ev.drained.iter().find(|d| d.2 != Some(0)) {
                return Err(format!("{name} (pid {pid}) exited {code:?} after SIGTERM, not 0"));
            }
            Ok(format!("{}; the coordinator counts 1 serving worker of each role", ev.notes.join("; ")))
        }
        Id::TightDeadlines => {
            let complete = report.records.iter().filter(|r| matches!(r.outcome, Outcome::Complete { .. })).count();
            let expired = |http: bool| {
                report
                    .records
                    .iter()
                    .filter(|r| match &r.outcome {
                        Outcome::HttpError { status: 504, code: Some(c), .. } => http && c == "deadline_exceeded",
                        Outcome::StreamError { code: Some(c), .. } => !http && c == "deadline_exceeded",
                        _ => false,
                    })
                    .count()
            };
            let (http, stream) = (expired(true), expired(false));
            if complete == 0 || http + stream == 0 {
                return Err(format!("{complete} complete and {} deadline_exceeded: both must be seen", http + stream));
            }
            Ok(format!(
                "{complete} complete, {} ended deadline_exceeded ({http} http 504, {stream} in-stream) at deadline \
                 {TIGHT_DEADLINE:?}",
                http + stream
            ))
        }
    }
}

fn decode_metrics(c: &Cluster) -> Result<String, String> {
    c.workers_of(Role::Decode)
        .find(|w| !c.is_faulted(&w.proc.name))
        .ok_or("no live decode worker")?
        .metrics_addr()
        .map_err(|e| e.to_string())
}

async fn recomputed(m: &str) -> Result<f64, HarnessError> {
    Ok(crate::metrics::scrape(m).await?.sum("tandem_kv_load_policy_outcomes_total", &[("outcome", "recomputed")]))
}

/// A streaming completion read line by line; dropping it hangs up.
struct Stream(BufReader<TcpStream>);

async fn open_stream(addr: &str, i: usize) -> Result<Stream, HarnessError> {
    let err = |e: std::io::Error| HarnessError::Fault(format!("stream to {addr}: {e}"));
    let mut s = TcpStream::connect(addr).await.map_err(err)?;
    let body = serde_json::json!({
        "model": MODEL, "prompt": format!("Client {i} will hang up on this story about a lighthouse keeper:"),
        "max_tokens": 400, "temperature": 0, "ignore_eos": true, "stream": true,
    })
    .to_string();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.map_err(err)?;
    s.write_all(body.as_bytes()).await.map_err(err)?;
    Ok(Stream(BufReader::new(s)))
}

impl Stream {
    async fn line(&mut self) -> Result<Option<String>, HarnessError> {
        let mut l = String::new();
        let n = tokio::time::timeout(Duration::from_secs(60), self.0.read_line(&mut l))
            .await
            .map_err(|_| HarnessError::Timeout("no line of the stream within 60 s".into()))?
            .map_err(|e| HarnessError::Fault(format!("reading the stream: {e}")))?;
        Ok((n > 0).then_some(l))
    }

    async fn first_data(&mut self) -> Result<(), HarnessError> {
        while let Some(l) = self.line().await? {
            if l.contains("\"text\"") {
                return Ok(());
            }
        }
        Err(HarnessError::Fault("the stream ended before its first token".into()))
    }

    async fn read_to_end(&mut self) -> Result<(), HarnessError> {
        while self.line().await?.is_some() {}
        Ok(())
    }
}

/// One short non-streaming request: (status, Retry-After).
async fn probe(addr: &str) -> Result<(u16, Option<String>), HarnessError> {
    let mut s = Stream(BufReader::new(
        TcpStream::connect(addr).await.map_err(|e| HarnessError::Fault(format!("probe {addr}: {e}")))?,
    ));
    let body = serde_json::json!({"model": MODEL, "prompt": "Probe", "max_tokens": 1, "temperature": 0}).to_string();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.0.get_mut().write_all(head.as_bytes()).await.map_err(|e| HarnessError::Fault(format!("probe: {e}")))?;
    let status_line = s.line().await?.unwrap_or_default();
    let status = status_line.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let mut retry_after = None;
    while let Some(l) = s.line().await? {
        if l == "\r\n" {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            if k.eq_ignore_ascii_case("retry-after") {
                retry_after = Some(v.trim().to_owned());
            }
        }
    }
    Ok((status, retry_after))
}
