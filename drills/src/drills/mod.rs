//! The drills. Each is one [`Drill`]: a cluster and a load ([`Setup`]), one
//! fault applied while the load runs, and the proof that the fault happened
//! (G6). [`run_drill`] runs one and judges it with the shared invariants.
//!
//! Drills live in modules by what they break: processes ([`process`]), the KV
//! link ([`kv`]), the request and control links ([`links`]), etcd ([`etcd`]), the load
//! itself ([`load`]), a tenant flooding its quota ([`tenants`]), and what the
//! coordinator does for the cluster ([`coordinator`]: breakers, slow readers). Adding a
//! drill is one type implementing [`Drill`] in its module and one line in
//! [`all`].

mod common;
pub(crate) mod coordinator;
mod etcd;
mod goodput;
mod kv;
mod links;
mod load;
mod process;
mod tenants;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use loadgen::{Arrival, Outcome, Plan, PromptSource, Report};
use tokio_util::sync::CancellationToken;

use crate::cluster::{Cluster, ClusterSpec, Role};
use crate::invariants::{self, Guarantee, Invariants, Violation};
use crate::{eventually, reference_texts, HarnessError};
pub use goodput::Goodput;
use goodput::{saturating_load, Throughput};

const MODEL: &str = "SmolLM2-135M-Instruct";
const PROMPT_TOKENS: usize = 40;

/// One drill. Implementations are unit types in this module's children.
#[async_trait::async_trait]
pub(crate) trait Drill: Send + Sync {
    fn info(&self) -> DrillInfo;
    /// The cluster, the load and how the run is judged; `skip_fault` may shape the load
    /// (a no-fault run of an overload drill offers no overload).
    fn setup(&self, skip_fault: bool) -> Setup;
    /// Applies the fault while the load runs (everything but the fault itself when `skip`),
    /// and records what it observed for [`Drill::prove`].
    async fn fault(&self, c: &mut Cluster, load: &Progress, skip: bool) -> Result<Evidence, HarnessError>;
    /// G6: the fault happened. Ok says what showed it; Err what did not.
    async fn prove(&self, c: &Cluster, ev: &Evidence, report: &Report) -> Result<String, String>;
    /// Whether the drill can run against `c`, a cluster someone else started
    /// ([`Cluster::attach`]), and leave it as found; Err says why not. A fault must be
    /// reversible there: lifted by the drill (SIGCONT) or, for a process that exits, undone
    /// by the cluster's supervisor ([`supervisor_restarts`]).
    fn against(&self, _c: &Cluster) -> Result<(), String> {
        own_cluster("its fault needs a cluster shaped for it (a fault proxy or network namespace on the KV link, or an etcd of its own to restart)")
    }
    /// Fits the setup's bounds to an attached cluster (its leases, say), after
    /// [`Drill::against`] allowed it; nothing by default.
    fn adapt(&self, _c: &Cluster, _s: &mut Setup) {}
    /// Whether the binaries beside this one can apply the drill's fault; Err says why not.
    /// Most faults act from outside (signals, proxies, namespaces); a fault hook inside a
    /// worker exists only in a build with the `fault-injection` feature.
    fn built(&self) -> Result<(), String> {
        Ok(())
    }
    /// Clients of the overload phase that retry refusals (the retry-storm drill); none by
    /// default.
    fn retry(&self) -> Option<loadgen::Retry> {
        None
    }
    /// Whether the load's clients resume cut streams from their last cursor
    /// ([`loadgen::Plan::resume`]); none do by default.
    fn resume(&self) -> bool {
        false
    }
    /// Whether the load's prompts stay [`PROMPT_TOKENS`] long against a running cluster,
    /// short enough for its decode workers to prefill themselves (noisy-neighbour's steady
    /// tenant); by default they are made longer than its coordinators prefill locally
    /// ([`load_prompt_tokens`]), so their KV crosses a link as in the drill's own cluster.
    fn local_prompts(&self) -> bool {
        false
    }
}

/// How long the drills' prompts are against `c`: [`PROMPT_TOKENS`], or longer than the
/// prompts its coordinators prefill on a decode worker (the state file's
/// `local-prefill-max-tokens`), so each is prefilled on a prefill worker and its KV moves.
pub(crate) fn load_prompt_tokens(c: &Cluster) -> usize {
    let key = facts::state::flag::LOCAL_PREFILL_MAX_TOKENS;
    let local = c.coordinators().filter_map(|p| c.flag(&p.name, key)?.parse::<usize>().ok()).max();
    local.map_or(PROMPT_TOKENS, |n| PROMPT_TOKENS.max(n + 8))
}

/// `Drill::built`'s check for a drill whose fault is a prefill worker's hook: the prefill
/// worker beside this binary was built with `fault-injection` (its `--version` says so).
pub(super) fn prefill_fault_hooks() -> Result<(), String> {
    let bin = crate::process::bin(facts::argv::PREFILL_BINARY).map_err(|e| e.to_string())?;
    let out = std::process::Command::new(&bin)
        .arg("--version")
        .output()
        .map_err(|e| format!("running {} --version: {e}", bin.display()))?;
    let version = String::from_utf8_lossy(&out.stdout);
    if version.contains("fault-injection") {
        Ok(())
    } else {
        Err(format!(
            "needs a prefill worker built with the `fault-injection` feature (`make drills` builds one; the binaries \
             users get have no fault hooks), and {} says `{}`",
            bin.display(),
            version.trim()
        ))
    }
}

/// `Drill::against`'s refusal: the drill needs a cluster of its own, because `why`.
pub(super) fn own_cluster(why: &str) -> Result<(), String> {
    Err(format!("needs its own cluster: {why}"))
}

/// How a drill's victim exits, for [`supervisor_restarts`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Exit {
    /// SIGKILL: a failure to every restart policy but `never`.
    Killed,
    /// SIGTERM: the worker drains and exits 0, which only `always` restarts.
    Drained,
}

/// `Drill::against`'s check for a drill whose victim exits: the attached cluster's
/// supervisor must start it again, or its state file must give every worker a `restart`
/// template (the drill waits for that, so the cluster is left as found). Err says which
/// `tandem up --restart` would.
pub(crate) fn supervisor_restarts(c: &Cluster, exit: Exit) -> Result<(), String> {
    // A state file that says how to restart every worker (a `restart` template) needs no
    // supervisor for a kill: the drill runs the template once the victim exited. A drain's
    // proof is the worker's exit status 0, which only a supervisor that reaped it can tell.
    let templated = |w: &crate::cluster::Worker| {
        w.proc.actions().is_some_and(|a| a.template(facts::state::Action::Restart).is_some())
    };
    let all_templated = !c.workers.is_empty() && c.workers.iter().all(templated);
    if all_templated && exit == Exit::Killed {
        return Ok(());
    }
    if all_templated && c.restart_policy().is_none() {
        return Err("it drains workers and proves each exited 0, which only a supervisor that reaped them can \
                    report: a `restart` template cannot"
            .into());
    }
    let policy = c.restart_policy();
    let restarts = match (policy, exit) {
        (Some("always"), _) | (Some("on-failure"), Exit::Killed) => return Ok(()),
        (None, _) => {
            return Err("its victim exits, and the state file names no restart policy: the `tandem up` that \
                        wrote it restarts nothing (a newer one supervises)"
                .into())
        }
        (Some(p), _) => p,
    };
    Err(match exit {
        Exit::Killed => format!(
            "it SIGKILLs a worker, which `tandem up --restart {restarts}` leaves down: run `tandem up --restart \
             on-failure` (the default) or `--restart always`"
        ),
        Exit::Drained => format!(
            "it drains workers (SIGTERM: each exits 0), which `tandem up --restart {restarts}` leaves down: run \
             `tandem up --restart always`"
        ),
    })
}

/// At least two coordinators, which the drill reaches through its own round-robin front, and
/// a supervisor (or `restart` templates) that starts a coordinator again after `exit`.
pub(crate) fn coordinators_against(c: &Cluster, exit: Exit) -> Result<(), String> {
    let n = c.coordinators().count();
    if n < 2 {
        return Err(format!(
            "it faults one of several coordinators while the drill's own round-robin front sends its clients on to \
             the others; this cluster has {n} (`tandem up --coordinators 2`)"
        ));
    }
    supervisor_restarts(c, exit)
}

/// Every check's reason at once (joined by "; "), or Ok when none refuses.
pub(crate) fn all_of<const N: usize>(checks: [Result<(), String>; N]) -> Result<(), String> {
    let reasons: Vec<String> = checks.into_iter().filter_map(Result::err).collect();
    if reasons.is_empty() {
        Ok(())
    } else {
        Err(reasons.join("; "))
    }
}

/// At least `n` workers of `role`, so one is faulted while another serves.
pub(crate) fn at_least(c: &Cluster, role: crate::cluster::Role, n: usize, why: &str) -> Result<(), String> {
    match c.workers_of(role).count() {
        k if k >= n => Ok(()),
        k => Err(format!("needs at least {n} {} workers ({why}); the cluster has {k}", role.as_str())),
    }
}

/// Where the prefill-kill drills hold a KV push: 16 KiB in, inside the first layers' frames.
const MID_PUSH: usize = 16 << 10;

/// Every drill, in the order `--all` and the tests run them.
fn all() -> Vec<Box<dyn Drill>> {
    vec![
        Box::new(process::DecodeKill { sampled: false }),
        Box::new(process::PrefillKill { policy: "recompute", hold_at: MID_PUSH, ucx: false }),
        Box::new(process::PrefillKill { policy: "retry", hold_at: MID_PUSH, ucx: false }),
        Box::new(process::PrefillKill { policy: "fail", hold_at: MID_PUSH, ucx: false }),
        Box::new(process::PrefillKill { policy: "recompute", hold_at: 0, ucx: false }),
        Box::new(kv::KvCorrupt { ucx: false }),
        Box::new(etcd::EtcdRestart),
        Box::new(load::ClientDisconnect),
        Box::new(load::Overload3x),
        Box::new(load::RetryStorm),
        Box::new(process::WorkerSigstop),
        Box::new(process::RollingDrain),
        Box::new(load::TightDeadlines),
        Box::new(process::CoordinatorKill),
        Box::new(process::VersionRelabel { ucx: false }),
        Box::new(process::DrainGraceShort),
        Box::new(kv::KvDelay),
        Box::new(kv::KvLoss),
        Box::new(kv::KvBlackhole { ucx: false }),
        Box::new(kv::KvBandwidth),
        Box::new(kv::KvResets),
        Box::new(coordinator::PrefillErrors),
        Box::new(coordinator::PrefillUnavailable),
        Box::new(coordinator::LayoutMismatch),
        Box::new(coordinator::SlowReader),
        Box::new(etcd::EtcdLeaderKill),
        Box::new(etcd::EtcdQuorumLoss),
        Box::new(etcd::WorkerEtcdCutoff),
        Box::new(etcd::CoordinatorEtcdCutoff),
        Box::new(etcd::EtcdStall),
        Box::new(kv::KvReorder),
        Box::new(links::RequestLinkResets),
        Box::new(links::RequestLinkDelay),
        Box::new(links::ControlLinkResets),
        // The KV-link drills that apply to one-sided transfer, with KV over ucx.
        Box::new(process::PrefillKill { policy: "recompute", hold_at: MID_PUSH, ucx: true }),
        Box::new(process::PrefillKill { policy: "retry", hold_at: MID_PUSH, ucx: true }),
        Box::new(process::PrefillKill { policy: "fail", hold_at: MID_PUSH, ucx: true }),
        Box::new(kv::KvCorrupt { ucx: true }),
        Box::new(process::VersionRelabel { ucx: true }),
        Box::new(kv::KvBlackhole { ucx: true }),
        Box::new(tenants::NoisyNeighbour),
        // Request migration: long streams, half sampled, outlive their decode worker.
        Box::new(process::DecodeKill { sampled: true }),
        Box::new(process::DecodeFreezeMigrate),
        // Streams outlive their coordinator: resuming clients behind a front.
        Box::new(process::CoordinatorKillResume),
        Box::new(process::CoordinatorRollingDrain),
    ]
}

/// A drill's name and what it does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct DrillInfo {
    pub name: &'static str,
    pub description: &'static str,
}

/// Every drill, in the order the tests run them.
pub fn drills() -> Vec<DrillInfo> {
    all().iter().map(|d| d.info()).collect()
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
    /// Counts the load's requests as they end (reset to 0 at the start), for a progress display.
    pub progress: Option<Arc<AtomicUsize>>,
    /// Run against the running cluster this `tandem up --state-file` describes instead of
    /// starting one ([`Cluster::attach`]): only drills whose `Drill::against` allows it; the
    /// cluster is not shut down at the end (G5 checks it is left running instead).
    pub against: Option<PathBuf>,
    /// The API key drill traffic carries against a cluster whose coordinators have tenants
    /// ([`Cluster::api_key`]).
    pub api_key: Option<String>,
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
    /// Requests with no typed outcome (transport, protocol, timeout), except those below.
    pub lost: usize,
    /// Requests that ended in a transport error while in flight across a coordinator's
    /// SIGKILL (nobody was left to send a typed error); allowed, and counted here.
    pub coordinator_lost: usize,
    /// Requests whose client connection the drill cut on purpose (a reset on the request
    /// link, [`Invariants::cuts_allowed`]): transport errors, allowed, and counted here.
    pub cut_by_fault: usize,
    /// KV blocks still used on live workers after settling.
    pub leaked_blocks: f64,
    pub p99_ttft_ms: Option<f64>,
    pub wall_ms: f64,
    /// When the fault was applied and lifted, in ms from the load's start
    /// (`end` None: it lasted to the end of the load).
    pub fault_window_ms: Option<(f64, Option<f64>)>,
    /// Overload drills: goodput against the no-overload baseline, and the coordinator's memory.
    pub goodput: Option<Goodput>,
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

/// A process's resident memory (MiB), from /proc.
pub(crate) fn rss_mib(pid: u32) -> Option<f64> {
    common::rss_kib(pid).map(|kib| kib as f64 / 1024.0)
}

/// A process's resident anonymous memory (MiB), from /proc ([`common::anon_kib`]).
pub(crate) fn anon_mib(pid: u32) -> Option<f64> {
    common::anon_kib(pid).map(|kib| kib as f64 / 1024.0)
}

/// What a fault step observed, for its proof.
#[derive(Debug, Default)]
pub(crate) struct Evidence {
    pub victim: Option<(String, u32)>,
    pub before: f64,
    pub notes: Vec<String>,
    pub seen: bool,
    /// What the fault step waited for and did not see.
    pub missing: Vec<String>,
    /// Drained workers: name, pid, exit code (`None`: did not exit, or not by `exit`).
    pub drained: Vec<(String, u32, Option<i32>)>,
    /// Processes (etcd members included) the fault killed: name, pid.
    pub killed: Vec<(String, u32)>,
    /// When the fault was applied and lifted ([`Evidence::began`], [`Evidence::ended`]).
    pub window: (Option<Instant>, Option<Instant>),
    /// Requests of the load ended when the fault step passed each of its marks, for proofs
    /// that judge the load by phase (before and during the fault).
    pub done_at: Vec<usize>,
    /// Counters read before the fault, for a proof that counts what changed since (an
    /// attached cluster has served before the drill).
    pub counts: Vec<f64>,
}

impl Evidence {
    /// A fault that is in place from the setup, or is the load itself: it begins with
    /// the load, unless the run skips it (`--vacuity`).
    pub fn standing(skip: bool) -> Self {
        let mut ev = Self::default();
        if !skip {
            ev.began();
        }
        ev
    }

    /// The fault is applied now (the chart's shaded window starts here).
    pub fn began(&mut self) {
        self.window.0.get_or_insert_with(Instant::now);
    }

    /// The fault is lifted now.
    pub fn ended(&mut self) {
        self.window.1 = Some(Instant::now());
    }
}

/// Progress of the load, for fault steps that wait on it.
#[derive(Clone)]
pub(crate) struct Progress {
    pub done: Arc<AtomicUsize>,
    pub finished: Arc<AtomicBool>,
}

impl Progress {
    /// Waits until `n` requests have ended.
    pub async fn wait_done(&self, n: usize, limit: Duration) -> Result<(), HarnessError> {
        let done = self.done.clone();
        eventually(&format!("{n} requests end"), limit, || {
            let k = done.load(Ordering::SeqCst);
            async move { k >= n }
        })
        .await
    }

    pub fn finished(&self) -> bool {
        self.finished.load(Ordering::SeqCst)
    }

    /// Waits (bounded: 180 s) until the load has finished.
    pub async fn wait_finished(&self) -> Result<(), HarnessError> {
        eventually("the load finishes", Duration::from_secs(180), || async { self.finished() }).await
    }
}

/// What a drill runs: its cluster, its load, and how it is judged.
pub(crate) struct Setup {
    pub spec: ClusterSpec,
    pub requests: usize,
    pub max_tokens: u32,
    pub concurrency: usize,
    pub invariants: Invariants,
    /// Requests of the load that sample (seeded) instead of decoding greedily; G1
    /// compares them with the engine's answer for their seed.
    pub sampled: Option<loadgen::Sampled>,
}

/// Runs drill `name`: starts its cluster, runs the load with the fault, checks G1–G6,
/// shuts the cluster down (SIGTERM must end every process cleanly: G5). With
/// [`DrillOptions::against`] it attaches to that running cluster instead (refusing a drill
/// whose `Drill::against` says no, before anything runs) and leaves it running: G5 then
/// checks every process still runs and `/ready` is 200.
pub async fn run_drill(name: &str, opts: &DrillOptions) -> Result<DrillReport, HarnessError> {
    let drill =
        all().into_iter().find(|d| d.info().name == name).ok_or_else(|| HarnessError::UnknownDrill(name.into()))?;
    let info = drill.info();
    drill.built().map_err(|why| HarnessError::NotBuilt { drill: name.into(), why })?;
    // Refuse a drill that cannot run against the attached cluster before anything else.
    let attached = match &opts.against {
        Some(state) => {
            let c = Cluster::attach(state, opts.api_key.as_deref()).await?;
            can_run_against(drill.as_ref(), &c).map_err(|why| HarnessError::NotAgainst {
                drill: name.into(),
                state: state.display().to_string(),
                why,
            })?;
            Some(c)
        }
        None => None,
    };
    let mut s = drill.setup(opts.skip_fault);
    if let Some(c) = &attached {
        drill.adapt(c, &mut s);
    }
    if let Some(n) = opts.requests {
        s.requests = n;
    }
    // A running cluster's prefix caches hold the prompts of every drill run against it before,
    // and prefix routing sends a prompt where it is cached: with the same prompts each run, a
    // decode worker restarted by an earlier drill (its cache empty) got none of the load, and a
    // drill faulting its link had nothing to strike. Against one, each run's prompts are new.
    let seed = match &opts.against {
        Some(_) => common::fresh_seed(),
        None => 7,
    };
    let prompt_tokens = match &attached {
        Some(c) if !drill.local_prompts() => load_prompt_tokens(c),
        _ => PROMPT_TOKENS,
    };
    let prompts = loadgen::prompts::generate(s.requests, prompt_tokens, seed);
    // Goodput compares loads whose requests must be the same work whichever are admitted:
    // each generates exactly `max_tokens` (an answer ending early at EOS costs a whole
    // prefill for fewer tokens, and moved the ratio by 10% here).
    // A sampled load generates exactly `max_tokens` too: every answer is long enough to be
    // moved mid-stream, and its reference is the whole seeded answer.
    let ignore_eos = s.invariants.goodput.is_some() || s.sampled.is_some();
    let (p2, max, sampled) = (prompts.clone(), s.max_tokens, s.sampled);
    let reference = tokio::task::spawn_blocking(move || reference_texts(&p2, max, ignore_eos, sampled))
        .await
        .map_err(|e| HarnessError::Setup(format!("reference task: {e}")))??;

    let mut cluster = match attached {
        Some(mut c) => {
            // Several coordinators are reached as the drill's own cluster reaches them: through
            // a round-robin front, here the drill's own (what a layer-4 load balancer does).
            if s.spec.coordinators > 1 {
                let mut http = Vec::new();
                let mut grpc = Vec::new();
                for p in c.coordinators() {
                    http.push(p.socket_addr("http")?);
                    grpc.push(p.socket_addr("grpc")?);
                }
                c.front = Some(crate::front::Front::start(http).await?);
                c.grpc_front = Some(crate::front::Front::start(grpc).await?);
            }
            // A request-link fault needs no change to someone else's cluster: the drill's own
            // fault proxy between its clients and the coordinator.
            if s.spec.clients_via_proxy {
                let upstream = match &c.front {
                    Some(f) => f.addr,
                    None => c.coordinator.socket_addr("http")?,
                };
                c.client_proxy = Some(crate::proxy::Proxy::start_replies(upstream)?);
            }
            // A KV-link fault on the proxy: one in the namespace of the decode worker running
            // the drill's policy (else the first), which its KV port is redirected to for the drill.
            if s.spec.workers.iter().any(|w| w.role == Role::Decode && w.behind_proxy) {
                let target = kv::kv_proxy_target(&c, &s.spec.policy).map(|w| w.proc.name.clone());
                let name = target.ok_or_else(|| HarnessError::Setup("the cluster has no decode worker".into()))?;
                c.proxy_kv_link(&name)?;
                common::warm_kv_proxy(&c, &name).await?;
            }
            c
        }
        None => Cluster::start(&s.spec, opts.keep_logs).await?,
    };
    let mut plan = Plan::new(cluster.base_url()?, MODEL);
    plan.requests = s.requests;
    plan.arrival = Arrival::Closed { concurrency: s.concurrency };
    plan.prompts = PromptSource::List(prompts);
    plan.max_tokens = s.max_tokens;
    plan.ignore_eos = ignore_eos;
    plan.seed = seed;
    plan.sampled = s.sampled;
    // An attached cluster's tenants are its own: the drill traffic's key (`--api-key`).
    plan.api_key = match cluster.is_attached() {
        true => cluster.api_key.clone(),
        false => s.spec.tenants.as_ref().map(|t| t.load_key.clone()),
    };
    plan.deadline = Some(s.invariants.deadline);
    plan.timeout = s.invariants.deadline + s.invariants.grace + Duration::from_secs(10);
    plan.resume = drill.resume();

    // Overload drills: the no-overload maximum first, then Poisson arrivals at a multiple of it.
    let bound = s.invariants.goodput;
    let before = match &bound {
        Some(g) => {
            saturating_load(&plan, g, g.saturating, seed + 3).await?;
            let t = saturating_load(&plan, g, g.baseline_requests, seed + 1).await?;
            if !opts.skip_fault && !g.closed {
                plan.arrival = Arrival::Poisson { rate: g.factor * t.rps() };
                plan.retry = drill.retry();
            }
            Some(t)
        }
        None => None,
    };
    let rss_before = rss_mib(cluster.coordinator.pid);
    // What the decode workers begin during an open-loop overload (see `GoodputBound`).
    let overload = bound.is_some_and(|g| !g.closed) && !opts.skip_fault;
    let computed_before = if overload { Some(common::decode_requests(&cluster, &[]).await?) } else { None };
    let done = opts.progress.clone().unwrap_or_default();
    done.store(0, Ordering::SeqCst);
    let progress = Progress { done, finished: Arc::default() };
    // loadgen's hook takes an unbounded sender; it carries one record per request of a
    // finite plan, and the task below drains it as they come.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    // Record offsets count from `load_start`, the clock the fault windows are read on
    // (`coordinator_kills`): a request that failed a millisecond after a kill must not
    // appear to have ended before it.
    let load_start = Instant::now();
    let hooks = loadgen::Hooks { cancel: CancellationToken::new(), records: Some(tx), origin: Some(load_start) };
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
    let evidence = drill.fault(&mut cluster, &progress, opts.skip_fault).await;
    let report = load
        .await
        .map_err(|e| HarnessError::Load(format!("load task: {e}")))?
        .map_err(|e| HarnessError::Load(e.to_string()))?;
    let evidence = evidence?;
    let computed_after = if overload { Some(common::decode_requests(&cluster, &[]).await?) } else { None };
    let proof = drill.prove(&cluster, &evidence, &report).await;
    let rss_after = bound.and_then(|_| rss_mib(cluster.coordinator.pid));
    let since_start = |t: Instant| t.saturating_duration_since(load_start);
    s.invariants.coordinator_kills =
        cluster.coordinator_kills.iter().map(|&(sent, dead)| (since_start(sent), since_start(dead))).collect();

    let (mut violations, measured) = s.invariants.check_measured(&cluster, &report, &reference).await;
    let goodput = match (bound, before) {
        (Some(g), Some(before)) => {
            let after = saturating_load(&plan, &g, g.baseline_requests, seed + 2).await?;
            let under = if g.arrivals_only { Throughput::during_arrivals(&report) } else { Throughput::of(&report) };
            let tok_s = under.tok_s();
            let raw_ratio = tok_s / before.tok_s().min(after.tok_s()).max(f64::MIN_POSITIVE);
            let ratio = match (before.at_speed(), under.at_speed(), after.at_speed()) {
                (Some(b), Some(u), Some(a)) => u / b.min(a).max(f64::MIN_POSITIVE),
                _ => raw_ratio,
            };
            let ms = |t: Throughput| t.token_secs.map(|s| s * 1e3);
            let completed = report.records.iter().filter(|r| matches!(r.outcome, Outcome::Complete { .. })).count();
            Some(Goodput {
                baseline_tok_s: [before.tok_s(), after.tok_s()],
                tok_s,
                token_ms: [ms(before), ms(under), ms(after)],
                ratio,
                raw_ratio,
                computed: computed_before.zip(computed_after).map(|(b, a)| (a - b, completed)),
                capacity_rps: before.rps(),
                offered_rps: match plan.arrival {
                    Arrival::Poisson { rate } => rate,
                    Arrival::Closed { .. } => 0.0,
                },
                rss_growth_mib: rss_after.zip(rss_before).map(|(a, b)| a - b),
                regenerated_tokens: report.records.iter().map(|r| u64::from(r.retries.regenerated)).sum(),
            })
        }
        _ => None,
    };
    if let (Some(g), Some(bound)) = (&goodput, bound) {
        if g.ratio < bound.floor {
            violations.push(Violation::new(
                Guarantee::Drill,
                format!(
                    "goodput {:.1} tok/s is {:.0}% of the no-overload {:.1}/{:.1} tok/s (before/after) at the \
                     machine's speed in each ({}; {:.0}% as measured), below {:.0}%",
                    g.tok_s,
                    g.ratio * 100.0,
                    g.baseline_tok_s[0],
                    g.baseline_tok_s[1],
                    g.token_ms_text(),
                    g.raw_ratio * 100.0,
                    bound.floor * 100.0
                ),
            ));
        }
        if let Some((begun, completed)) = g.computed {
            if begun > completed as f64 {
                violations.push(Violation::new(
                    Guarantee::Drill,
                    format!(
                        "the decode workers began {begun} requests during the overload for {completed} completed \
                         answers: refused requests were computed"
                    ),
                ));
            }
        }
        match g.rss_growth_mib {
            Some(grew) if grew > s.invariants.max_rss_growth_mib => violations.push(Violation::new(
                Guarantee::Drill,
                format!(
                    "the coordinator's memory grew {grew:.1} MiB under overload (bound {} MiB)",
                    s.invariants.max_rss_growth_mib
                ),
            )),
            Some(_) => {}
            None => violations.push(Violation::new(Guarantee::Drill, "the coordinator's VmRSS could not be read")),
        }
    }
    if let Err(e) = &proof {
        violations.push(Violation::new(Guarantee::G6, e.clone()));
    }
    let end = if cluster.is_attached() {
        cluster.unproxy_kv_link();
        for e in cluster.clear_link_rules() {
            violations.push(Violation::new(Guarantee::G5, e));
        }
        invariants::left_as_found(&cluster).await
    } else {
        invariants::shutdown(&mut cluster, Duration::from_secs(20)).await
    };
    for v in end {
        if !violations.contains(&v) {
            violations.push(v);
        }
    }
    let summary = report.summary();
    let mut typed = BTreeMap::new();
    let (mut lost, mut coordinator_lost, mut cut_by_fault) = (0, 0, 0);
    for r in &report.records {
        match &r.outcome {
            Outcome::Complete { .. } => {}
            o if o.error_code().is_some() => *typed.entry(r.outcome.label()).or_insert(0) += 1,
            _ if s.invariants.coordinator_lost(r) => coordinator_lost += 1,
            Outcome::Transport(_) if s.invariants.cuts_allowed => cut_by_fault += 1,
            _ => lost += 1,
        }
    }
    let ms = |t: Instant| t.saturating_duration_since(load_start).as_secs_f64() * 1e3;
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
        coordinator_lost,
        cut_by_fault,
        leaked_blocks: measured.leaked_blocks,
        p99_ttft_ms: summary.ttft.p99.map(|d| d.as_secs_f64() * 1e3),
        wall_ms: summary.wall.as_secs_f64() * 1e3,
        fault_window_ms: evidence.window.0.map(|a| (ms(a), evidence.window.1.map(ms))),
        goodput,
        g3_skipped_groups: measured.g3_skipped_groups,
        violations,
        log_dir: cluster.log_dir().display().to_string(),
        load: report,
    })
}

/// Attaches to the cluster `state` describes (see [`Cluster::attach`]) and says, for every
/// drill in `--all` order, whether it can run against it (Err: why not). Leaves it as found.
pub async fn drills_against(
    state: &Path,
    api_key: Option<&str>,
) -> Result<Vec<(DrillInfo, Result<(), String>)>, HarnessError> {
    let c = Cluster::attach(state, api_key).await?;
    Ok(all().iter().map(|d| (d.info(), can_run_against(d.as_ref(), &c))).collect())
}

/// Whether `drill` can run against attached `c`: its own [`Drill::against`], after drill
/// traffic has a key wherever the coordinators take only keys.
fn can_run_against(drill: &dyn Drill, c: &Cluster) -> Result<(), String> {
    c.keyed()?;
    drill.against(c)
}

/// Every drill with whether the binaries beside this one can apply its fault (`Drill::built`).
pub fn drills_built() -> Vec<(DrillInfo, Result<(), String>)> {
    all().iter().map(|d| (d.info(), d.built())).collect()
}

/// How many requests drill `name`'s load sends by default.
pub fn planned_requests(name: &str) -> Option<usize> {
    all().into_iter().find(|d| d.info().name == name).map(|d| d.setup(false).requests)
}
