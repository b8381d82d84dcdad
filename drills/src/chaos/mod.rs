//! `tandem chaos`: a seeded schedule of overlapping faults ([`schedule()`]) on a
//! local cluster of real processes under steady mixed load, with the drills'
//! invariants checked as every request ends and again at quiescence.
//!
//! The cluster: etcd, two prefill and two decode workers, two coordinators
//! behind round-robin fronts on their HTTP and gRPC listeners (worker leases
//! of 5 s, so a short etcd outage does not fence them). The load (`load`):
//! Poisson arrivals from resuming clients (loadgen's `resume`) of two tenants,
//! streamed over HTTP and gRPC and whole over HTTP, the HTTP clients retrying
//! refusals after their `Retry-After`; short and long prompts, greedy and
//! seeded sampling, each with a deadline. Bursts, clients that hang up and
//! slow readers come as faults. The run opens with a fault-free lead-in, the
//! baseline of the goodput check ([`goodput`]). Each fault is applied at its
//! time and lifted at its end (`faults`: a killed process started again with
//! its flags, a stopped one continued, etcd restarted), with one audit line
//! per action on stderr and in the journal; a cancelled run lifts whatever is
//! held at once.
//!
//! Invariants, as each request ends: it completed with exactly the
//! undisturbed answer of its prompt and seed, or failed with a typed error,
//! within its deadline and a second; what it got before a failure is the
//! start of that answer; nothing is lost or hangs. At quiescence (every fault
//! lifted, the load done, the settle bound): no KV block or reservation left
//! on any worker, KV only inside its version group, no panic in any log, and
//! every process stops cleanly on SIGTERM (the drills' G1–G5); goodput outside
//! the fault windows at least 90% of the lead-in's; no process life that
//! lived 20 minutes grew past the memory bound ([`rss`]).

mod faults;
pub mod goodput;
mod load;
pub mod report;
pub mod rss;
pub mod schedule;
pub mod shrink;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use loadgen::{Outcome, Report};
use serde::Serialize;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::cluster::{Cluster, ClusterSpec, Role};
use crate::invariants::{self, Guarantee, Invariants, Violation};
use crate::proxy::ProxyCounters;
use crate::HarnessError;
use faults::{run_faults, sample_rss, Audit};
pub use goodput::{lead_in, Goodput};
pub use load::requests;
use load::{judge_burst, run_steady, steady_loads, Steady};
pub use report::{junit, svg, RequestPoint};
pub use rss::{Incarnation, RssWatch};
pub use schedule::{kv_link, schedule, FaultKind, Planned, ScheduleOptions, Targets};
pub use shrink::{Bounds, Shrunk, Stopped};

/// The model every chaos request names.
const MODEL: &str = "SmolLM2-135M-Instruct";
/// Tokens each answer generates (every one: `ignore_eos`, so references are whole).
const MAX_TOKENS: u32 = 32;
/// A request's deadline; G4 allows a second past it.
const DEADLINE: Duration = Duration::from_secs(30);
const GRACE: Duration = Duration::from_secs(1);
/// How often every process's resident anonymous memory is sampled.
pub const RSS_EVERY: Duration = Duration::from_secs(5);
/// The coordinators' stream idle timeout in chaos clusters (their clients read at once):
/// a slow reader's stream is ended by it before the reader hangs up.
const STREAM_IDLE_TIMEOUT_MS: u64 = 4_000;
/// Requests of one burst, sent at once.
const BURST: usize = 8;
/// Most requests a run references (the rate times the lead-in and duration is capped here).
const MAX_REQUESTS: usize = 2_000;
/// The two tenants the load runs as: `interactive` streams, `batch` asks for whole
/// answers (a third of the steady load); neither has a quota.
const INTERACTIVE_KEY: &str = "chaos-interactive-key";
const BATCH_KEY: &str = "chaos-batch-key";

/// How a chaos run is shaped.
#[derive(Debug, Clone)]
pub struct ChaosOptions {
    pub schedule: ScheduleOptions,
    /// Steady load, requests per second.
    pub load_rps: f64,
    /// Keep the processes' logs (their directory is in the report).
    pub keep_logs: bool,
    /// Where each applied and lifted fault is appended as a JSON line.
    pub journal: Option<PathBuf>,
    /// Cancelled: stop applying faults, lift every held one, finish the run.
    pub cancel: CancellationToken,
    /// Plant bugs ([`PLANTED`]; binaries built with `fault-injection`): a run that
    /// must fail, naming each.
    pub plant: bool,
    /// Plant [`PLANTED_ON_MOVE`]: a bug only a fault that moves a stream sets off.
    pub plant_on_move: bool,
    /// Apply only these faults of the seeded schedule, by index (0-based, in the order
    /// `--dry-run` lists them); `None`: all. What `--shrink` runs its candidates with.
    pub keep: Option<Vec<usize>>,
    /// Run against the cluster this state file describes ([`Cluster::attach`]) instead of
    /// starting one, and leave it as found. The schedule draws only from the kinds
    /// [`kinds_against`] allows there.
    pub against: Option<PathBuf>,
    /// Against a cluster whose coordinators have tenants: the key every request of the run
    /// carries ([`Cluster::api_key`]), for both steady loads and the faults' own traffic.
    pub api_key: Option<String>,
}

/// How long a lift waits for a supervisor (or a `restart` template) to start a killed
/// process of an attached cluster again.
const RESTART_LIMIT: Duration = Duration::from_secs(60);

/// For a cluster someone else started: each fault kind, and whether chaos can apply it
/// there and leave the cluster as found (Err: why not).
pub fn kinds_against(c: &Cluster) -> Vec<(FaultKind, Result<(), String>)> {
    use crate::drills::{at_least, supervisor_restarts, Exit};
    let etcd_members = c.attached_etcd().count();
    FaultKind::ALL
        .iter()
        .map(|&k| {
            let can = match k {
                FaultKind::KillDecode => at_least(c, Role::Decode, 2, "one to kill, one to take its streams")
                    .and_then(|()| supervisor_restarts(c, Exit::Killed)),
                FaultKind::KillPrefill => at_least(c, Role::Prefill, 2, "one to kill, one to prefill meanwhile")
                    .and_then(|()| supervisor_restarts(c, Exit::Killed)),
                FaultKind::StopDecode => at_least(c, Role::Decode, 2, "one to freeze, one to take its streams"),
                FaultKind::StopPrefill => at_least(c, Role::Prefill, 2, "one to freeze, one to prefill meanwhile"),
                FaultKind::KillCoordinator | FaultKind::StopCoordinator => {
                    Err("its clients reach the state file's first coordinator directly: a coordinator fault needs a \
                     front they fail over through (chaos's own cluster has one)"
                        .into())
                }
                FaultKind::KillEtcd if etcd_members == 0 => Err("the state file lists no etcd member".into()),
                FaultKind::KillEtcd => match c.restart_policy() {
                    Some("always" | "on-failure") => Ok(()),
                    _ if c
                        .attached_etcd()
                        .all(|p| p.actions().is_some_and(|a| a.template(facts::state::Action::Restart).is_some())) =>
                    {
                        Ok(())
                    }
                    _ => Err("a killed etcd member must be started again: by a supervisor (`tandem up --restart \
                              on-failure`) or a `restart` template in the state file"
                        .into()),
                },
                FaultKind::StopEtcd if etcd_members == 0 => Err("the state file lists no etcd member".into()),
                FaultKind::StopEtcd => Ok(()),
                FaultKind::KvDelay | FaultKind::KvBlackhole | FaultKind::KvCorrupt | FaultKind::KvReset => Err(
                    "it acts through a fault proxy on a decode worker's KV link, which only chaos's own cluster has"
                        .into(),
                ),
                FaultKind::Burst | FaultKind::Disconnect | FaultKind::SlowReader => Ok(()),
            };
            (k, can)
        })
        .collect()
}

/// The bugs `--plant` starts the cluster with, each of which the invariants must catch:
/// every prefill worker answers its 3rd prefill with a wrong first token (G1: an answer
/// that is not its undisturbed one) and never frees the KV blocks of its 5th (G2);
/// every coordinator's 4th streamed answer never ends (G1: a request that hangs).
pub const PLANTED: [(&str, &str); 3] =
    [("--fault-swap-token", "3"), ("--fault-leak-blocks", "5"), ("--fault-endless-stream", "4")];

/// The bug `--plant-on-move` starts the coordinators with: a request moved to another
/// decode worker loses the first token the new worker generates (G1: an answer that is
/// not its undisturbed one). No fault-free run sets it off; a killed or frozen decode
/// worker with a stream on it does, so a failing run has a cause to shrink to.
pub const PLANTED_ON_MOVE: &str = "--fault-move-drops-token";

/// One fault action as it happened.
#[derive(Debug, Clone, Serialize)]
pub struct Action {
    /// From the start of the run.
    pub at_ms: u64,
    /// `apply` or `lift`.
    pub what: &'static str,
    pub kind: FaultKind,
    pub target: String,
    /// Empty when it worked; else why not.
    pub error: String,
}

/// A broken invariant and when it was found.
#[derive(Debug, Clone, Serialize)]
pub struct Found {
    /// From the start of the run; the end of the run for quiescence checks.
    pub at_ms: u64,
    pub guarantee: Guarantee,
    pub detail: String,
}

/// What a chaos run did and found.
#[derive(Debug, Clone, Serialize)]
pub struct ChaosReport {
    pub seed: u64,
    /// The faults' part of the run; a fault-free lead-in of `goodput.lead_in_ms` comes first.
    pub duration_s: f64,
    pub faults_per_minute: f64,
    pub schedule: Vec<Planned>,
    pub actions: Vec<Action>,
    /// Fault events applied, by kind.
    pub applied: BTreeMap<&'static str, u32>,
    pub requests: usize,
    pub complete: usize,
    /// Typed failures by code (what clients were told).
    pub typed_errors: BTreeMap<String, u32>,
    /// Streams resumed from their cursor after their connection broke or drained.
    pub resumed: u32,
    /// Each steady load (`interactive`, `interactive-grpc`, `batch`): its requests, how
    /// many completed, were resumed, and were sent again after a refusal.
    pub loads: BTreeMap<&'static str, LoadCounts>,
    /// What each KV link's fault proxy did (flips, resets, delayed chunks, blackholed
    /// bytes): that the link faults struck traffic, not an idle link.
    pub kv_links: BTreeMap<String, ProxyCounters>,
    /// Each request of the steady load: when it started, how long it took, how it ended.
    pub load: Vec<RequestPoint>,
    /// Every process incarnation's resident anonymous memory, first and last, and its slope after
    /// warm-up (sampled every [`RSS_EVERY`]).
    pub incarnations: Vec<Incarnation>,
    /// Goodput outside fault windows against the fault-free lead-in ([`goodput`]).
    pub goodput: Goodput,
    pub violations: Vec<Found>,
    pub log_dir: String,
    /// The command that repeats this run's schedule.
    pub command: String,
}

/// One steady load's requests in a [`ChaosReport`].
#[derive(Debug, Clone, Default, Serialize)]
pub struct LoadCounts {
    pub requests: usize,
    pub complete: usize,
    /// Resumes, over its requests.
    pub resumed: u32,
    /// Sends after a 429/503 refusal's `Retry-After`, over its requests.
    pub retried: u32,
}

impl ChaosReport {
    pub fn passed(&self) -> bool {
        self.violations.is_empty() && self.actions.iter().all(|a| a.error.is_empty())
    }
}

/// The cluster chaos runs on; with `plant`, its prefill workers and coordinators carry
/// the [`PLANTED`] bugs, with `on_move` its coordinators [`PLANTED_ON_MOVE`].
pub fn cluster_spec(plant: bool, on_move: bool) -> ClusterSpec {
    let (prefill, mut coordinator): (Vec<&str>, Vec<&str>) = if plant {
        (
            PLANTED[..2].iter().flat_map(|&(f, v)| [f, v]).collect(),
            PLANTED[2..].iter().flat_map(|&(f, v)| [f, v]).collect(),
        )
    } else {
        (Vec::new(), Vec::new())
    };
    if on_move {
        coordinator.push(PLANTED_ON_MOVE);
    }
    let idle = STREAM_IDLE_TIMEOUT_MS.to_string();
    coordinator.extend(["--stream-idle-timeout-ms", &idle]);
    ClusterSpec { lease_ttl_s: 5, ..ClusterSpec::default() }
        .prefill_with("g1", &prefill)
        .prefill_with("g1", &prefill)
        .coordinator_args(&coordinator)
        .decode_behind_proxy("g1")
        .decode_behind_proxy("g1")
        .coordinators(2)
        .tenants(
            &format!(
                "[tenants.interactive]\nkeys = [\"{INTERACTIVE_KEY}\"]\n\n[tenants.batch]\nkeys = [\"{BATCH_KEY}\"]\n"
            ),
            INTERACTIVE_KEY,
        )
}

/// The targets of a cluster of [`cluster_spec`]'s shape, by name: what `--dry-run` schedules
/// over without starting anything.
pub fn targets_of(c: Option<&Cluster>) -> Targets {
    match c {
        Some(c) => Targets {
            decode: c.workers_of(Role::Decode).map(|w| w.proc.name.clone()).collect(),
            prefill: c.workers_of(Role::Prefill).map(|w| w.proc.name.clone()).collect(),
            coordinators: c.coordinators().map(|p| p.name.clone()).collect(),
            etcd: match c.attached {
                Some(_) => c.attached_etcd().map(|p| p.name.clone()).collect(),
                None => vec!["etcd".into()],
            },
            kv_links: c.workers_of(Role::Decode).filter(|w| w.proxy.is_some()).map(|w| kv_link(&w.proc.name)).collect(),
        },
        None => Targets {
            decode: vec!["decode-0".into(), "decode-1".into()],
            prefill: vec!["prefill-0".into(), "prefill-1".into()],
            coordinators: vec!["coordinator".into(), "coordinator-1".into()],
            etcd: vec!["etcd".into()],
            kv_links: vec![kv_link("decode-0"), kv_link("decode-1")],
        },
    }
}

/// Of `kinds`, those chaos can apply to the attached cluster `c`, and each refused one with
/// why (`kind: reason`); Err when none is left, naming why each was refused.
pub fn usable_kinds(kinds: &[FaultKind], c: &Cluster) -> Result<(Vec<FaultKind>, Vec<String>), String> {
    let mut usable = Vec::new();
    let mut refused = Vec::new();
    for (k, can) in kinds_against(c) {
        if !kinds.contains(&k) {
            continue;
        }
        match can {
            Ok(()) => usable.push(k),
            Err(why) => refused.push(format!("{}: {why}", k.name())),
        }
    }
    if usable.is_empty() {
        return Err(format!("no fault kind can be applied to this cluster:\n  {}", refused.join("\n  ")));
    }
    Ok((usable, refused))
}

/// The command line that repeats a run with these options.
pub fn command(o: &ChaosOptions) -> String {
    let s = &o.schedule;
    let mut cmd = format!(
        "tandem chaos --seed {} --duration {}s --rate {} --load-rps {} --max-in-flight {}",
        s.seed,
        s.duration.as_secs(),
        s.per_minute,
        o.load_rps,
        s.max_in_flight
    );
    if s.kinds.len() != FaultKind::ALL.len() {
        cmd.push_str(&format!(" --faults {}", s.kinds.iter().map(|k| k.name()).collect::<Vec<_>>().join(",")));
    }
    if !s.exclude.is_empty() {
        cmd.push_str(&format!(" --exclude {}", s.exclude.join(",")));
    }
    if !s.never_kill.is_empty() {
        cmd.push_str(&format!(" --never-kill {}", s.never_kill.join(",")));
    }
    if o.plant {
        cmd.push_str(" --plant");
    }
    if o.plant_on_move {
        cmd.push_str(" --plant-on-move");
    }
    if let Some(state) = &o.against {
        cmd.push_str(&format!(" --against {}", facts::state::shell_word(&state.display().to_string())));
    }
    // The key itself never appears in a printed command.
    if o.api_key.is_some() {
        cmd.push_str(" --api-key \"$TANDEM_API_KEY\"");
    }
    if let Some(keep) = &o.keep {
        let list: Vec<String> = keep.iter().map(usize::to_string).collect();
        cmd.push_str(&format!(" --keep-faults {}", if list.is_empty() { "none".into() } else { list.join(",") }));
    }
    cmd
}

/// The faults a run applies: the seeded schedule, or the `keep` of it.
pub fn planned(o: &ChaosOptions, targets: &Targets) -> Result<Vec<Planned>, String> {
    let all = schedule(&o.schedule, targets);
    let Some(keep) = &o.keep else { return Ok(all) };
    if let Some(i) = keep.iter().find(|&&i| i >= all.len()) {
        return Err(format!(
            "--keep-faults {i}: the schedule has {} faults (0 to {})",
            all.len(),
            all.len().max(1) - 1
        ));
    }
    Ok(all.into_iter().enumerate().filter(|(i, _)| keep.contains(i)).map(|(_, p)| p).collect())
}

/// Whether `candidate` failed the way `original` did: it broke a guarantee the original
/// broke. The statistical bounds (goodput, memory slope: [`Guarantee::Drill`]) count only
/// when the original broke nothing else, since a busy host can miss them with no bug at
/// all; an original that broke no guarantee (only a fault action failed) is matched by
/// any failed run.
pub fn same_failure(original: &ChaosReport, candidate: &ChaosReport) -> bool {
    let strict = original.violations.iter().any(|v| v.guarantee != Guarantee::Drill);
    let wanted: Vec<Guarantee> =
        original.violations.iter().map(|v| v.guarantee).filter(|g| !strict || *g != Guarantee::Drill).collect();
    if wanted.is_empty() {
        return !candidate.passed();
    }
    candidate.violations.iter().any(|v| wanted.contains(&v.guarantee))
}

/// Shrinks a failed run (`original`, made with `o` and `loads`, which took `took`) to the
/// fewest of its faults that still fail the same way ([`shrink`](shrink::shrink)), each
/// candidate a whole run of the same seed, load and fault times (no journal: the first
/// run's is the record); `progress` hears of each run. The options to repeat the result
/// are `o` with `keep` set to [`Shrunk::kept`]. A candidate cut short by `o.cancel` is not
/// judged, and a run that cannot start ends the search with what it found so far.
pub async fn shrink_run(
    o: &ChaosOptions,
    original: &ChaosReport,
    took: Duration,
    bounds: Bounds,
    loads: &Loads,
    mut progress: impl FnMut(&str),
) -> Shrunk {
    let failing: Vec<usize> = match &o.keep {
        Some(k) => k.clone(),
        None => (0..original.schedule.len()).collect(),
    };
    let trial = async |faults: &[usize]| {
        if o.cancel.is_cancelled() {
            return Err(Stopped::Cancelled);
        }
        let run = ChaosOptions { keep: Some(faults.to_vec()), journal: None, ..o.clone() };
        let started = Instant::now();
        let result = run_with(&run, Some(loads.clone())).await;
        if o.cancel.is_cancelled() {
            return Err(Stopped::Cancelled);
        }
        let (r, _) = result.map_err(|e| Stopped::Failed(e.to_string()))?;
        let reproduced = same_failure(original, &r);
        let cost = started.elapsed();
        progress(&format!(
            "shrink: faults {faults:?}: {} in {:.0} s{}",
            if reproduced { "fails" } else { "passes" },
            cost.as_secs_f64(),
            r.violations.first().map(|v| format!(" ({:?}: {})", v.guarantee, v.detail)).unwrap_or_default()
        ));
        Ok(shrink::Trial { reproduced, cost })
    };
    shrink::shrink(&failing, took, bounds, trial).await
}

/// Incarnations that lived long enough and grew faster than the bound, as violations.
fn rss_violations(incarnations: &[Incarnation]) -> Vec<Violation> {
    incarnations
        .iter()
        .filter(|i| i.judged())
        .filter_map(|i| {
            let slope = i.slope_mib_per_10_min?;
            (slope >= rss::MAX_SLOPE_MIB_PER_10_MIN).then(|| {
                Violation::new(
                    Guarantee::Drill,
                    format!(
                        "{} (pid {}) grew {slope:.2} MiB per 10 minutes after its warm-up, over {:.0} minutes \
                         ({:.1} -> {:.1} MiB; bound {} MiB)",
                        i.name,
                        i.pid,
                        (i.last_ms - i.first_ms) as f64 / 60_000.0,
                        i.first_mib,
                        i.last_mib,
                        rss::MAX_SLOPE_MIB_PER_10_MIN
                    ),
                )
            })
        })
        .collect()
}

/// A run's steady loads with their undisturbed answers: computed by the first run of a
/// seed, given to the next runs of it (a shrinking run's candidates share the seed, so the
/// load, and a minute of answers for each would cost as much as the run).
#[derive(Clone)]
pub struct Loads(Vec<Steady>);

/// Starts the cluster, runs the load and the schedule, and judges the run.
pub async fn run_chaos(o: &ChaosOptions) -> Result<ChaosReport, HarnessError> {
    Ok(run_with(o, None).await?.0)
}

/// [`run_chaos`], also handing back its loads for [`shrink_run`].
pub async fn run_chaos_with_loads(o: &ChaosOptions) -> Result<(ChaosReport, Loads), HarnessError> {
    run_with(o, None).await
}

/// [`run_chaos`], with the loads of an earlier run of the same seed if given.
async fn run_with(o: &ChaosOptions, loads: Option<Loads>) -> Result<(ChaosReport, Loads), HarnessError> {
    let seed = o.schedule.seed;
    // The references are computed while the cluster starts.
    let loads = {
        let o = o.clone();
        tokio::spawn(async move {
            match loads {
                Some(l) => Ok(l.0),
                None => steady_loads(&o).await,
            }
        })
    };
    let mut c = match &o.against {
        Some(state) => {
            let c = Cluster::attach(state, o.api_key.as_deref()).await?;
            c.keyed().map_err(HarnessError::Setup)?;
            c
        }
        None => Cluster::start(&cluster_spec(o.plant, o.plant_on_move), o.keep_logs).await?,
    };
    let base_url = c.base_url()?;
    let mut loads = loads.await.map_err(|e| HarnessError::Setup(format!("reference task: {e}")))??;
    let grpc_url = c.grpc_url()?;
    for l in &mut loads {
        l.plan.base_url.clone_from(if l.plan.api == loadgen::Api::Grpc { &grpc_url } else { &base_url });
        // A running cluster's tenants are its own: every load carries the run's key.
        if c.is_attached() {
            l.plan.api_key.clone_from(&c.api_key);
        }
    }
    let targets = targets_of(Some(&c));
    let mut o = o.clone();
    if o.against.is_some() {
        o.schedule.kinds = usable_kinds(&o.schedule.kinds, &c).map_err(HarnessError::Setup)?.0;
    }
    let o = &o;
    let plan_faults = planned(o, &targets).map_err(HarnessError::Setup)?;

    let start = Instant::now();
    let found: Arc<Mutex<Vec<Found>>> = Arc::default();
    let kept = Loads(loads.clone());
    let running: Vec<_> = loads.into_iter().map(|s| (s.name, run_steady(s, start, found.clone()))).collect();

    let mut audit = Audit {
        start,
        journal: match &o.journal {
            Some(path) => Some(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .map_err(|e| HarnessError::Setup(format!("the journal {}: {e}", path.display())))?,
            ),
            None => None,
        },
        actions: Vec::new(),
    };
    // The lead-in: the load runs, no fault yet (its requests are the goodput baseline).
    let lead = lead_in(o.schedule.duration);
    let mut rss = RssWatch::new(lead);
    let spawned = run_faults(&mut c, &plan_faults, start + lead, &base_url, &mut audit, &o.cancel, &mut rss).await;
    let mut records = Vec::new();
    let mut wall = Duration::ZERO;
    let mut load = Vec::new();
    let mut loads = BTreeMap::new();
    for (name, r) in running {
        let r = r.await.map_err(|e| HarnessError::Load(format!("load task: {e}")))??;
        wall = wall.max(r.wall);
        let counts: &mut LoadCounts = loads.entry(name).or_default();
        for x in &r.records {
            counts.requests += 1;
            counts.complete += usize::from(x.outcome.is_complete());
            counts.resumed += x.retries.resumed;
            counts.retried += x.retries.sent;
        }
        load.extend(r.records.iter().map(|x| RequestPoint {
            load: name,
            index: x.index,
            start_ms: x.start.as_millis() as u64,
            e2e_ms: x.e2e.as_millis() as u64,
            outcome: x.outcome.label(),
            resumed: x.retries.resumed,
        }));
        records.extend(r.records);
    }
    let report = Report { wall, records };
    let mut burst_found = Vec::new();
    // Every slow reader hung up before the cluster is judged at quiescence.
    for s in spawned.slow_readers {
        if let Err(e) = s.await {
            burst_found.push(Violation::new(Guarantee::Drill, format!("a slow reader's task: {e}")));
        }
    }
    for b in spawned.bursts {
        match b.await {
            Ok(Ok(r)) => burst_found.extend(judge_burst(&r)),
            Ok(Err(e)) => burst_found.push(Violation::new(Guarantee::G1, format!("a burst's load was refused: {e}"))),
            Err(e) => burst_found.push(Violation::new(Guarantee::G1, format!("a burst's load task: {e}"))),
        }
    }
    let end_ms = start.elapsed().as_millis() as u64;

    // Quiescence: every fault lifted, the load done; KV must settle back on every worker.
    let since = |t: Instant| t.saturating_duration_since(start);
    let inv = Invariants {
        deadline: DEADLINE,
        grace: GRACE,
        coordinator_kills: c.coordinator_kills.iter().map(|&(a, b)| (since(a), since(b))).collect(),
        ..Invariants::default()
    };
    let (quiet, _) = inv.check_measured(&c, &Report { wall: report.wall, records: Vec::new() }, &[]).await;
    let mut violations = std::mem::take(&mut *found.lock().unwrap_or_else(|e| e.into_inner()));
    sample_rss(&c, start, &mut rss);
    let incarnations = rss.incarnations();
    let goodput = goodput::goodput(&load, &goodput::windows(&audit.actions, end_ms), lead.as_millis() as u64, end_ms);
    let mut end: Vec<Violation> = quiet;
    end.extend(goodput.broken().map(|b| Violation::new(Guarantee::Drill, b)));
    end.extend(burst_found);
    end.extend(rss_violations(&incarnations));
    if c.attached.is_some() {
        end.extend(invariants::left_as_found(&c).await);
    } else {
        end.extend(invariants::shutdown(&mut c, Duration::from_secs(20)).await);
    }
    violations.extend(end.into_iter().map(|v| Found { at_ms: end_ms, guarantee: v.guarantee, detail: v.detail }));

    let mut typed = BTreeMap::new();
    let mut complete = 0;
    for r in &report.records {
        match &r.outcome {
            Outcome::Complete { .. } => complete += 1,
            o => {
                if let Some(code) = o.error_code() {
                    *typed.entry(code.to_owned()).or_insert(0) += 1;
                }
            }
        }
    }
    let kv_links = c
        .workers_of(Role::Decode)
        .filter_map(|w| Some((kv_link(&w.proc.name), w.proxy.as_ref()?.counters())))
        .collect();
    let mut applied = BTreeMap::new();
    for a in audit.actions.iter().filter(|a| a.what == "apply" && a.error.is_empty()) {
        *applied.entry(a.kind.name()).or_insert(0) += 1;
    }
    let report = ChaosReport {
        seed,
        duration_s: o.schedule.duration.as_secs_f64(),
        faults_per_minute: o.schedule.per_minute,
        schedule: plan_faults,
        actions: audit.actions,
        applied,
        requests: report.records.len(),
        complete,
        typed_errors: typed,
        resumed: report.records.iter().map(|r| r.retries.resumed).sum(),
        loads,
        kv_links,
        load,
        incarnations,
        goodput,
        violations,
        log_dir: c.log_dir().display().to_string(),
        command: command(o),
    };
    Ok((report, kept))
}

#[cfg(test)]
mod tests {
    use super::*;
    use loadgen::Record;

    fn record(index: usize, outcome: Outcome, e2e: Duration) -> Record {
        Record {
            index,
            outcome,
            start: Duration::ZERO,
            ttft: None,
            itl: Vec::new(),
            output_tokens: 0,
            usage_reported: false,
            prompt_tokens: None,
            cached_tokens: None,
            e2e,
            text: String::new(),
            retries: loadgen::Retries::default(),
            cuts: Vec::new(),
        }
    }

    /// The burst judge is not vacuous: a lost request and one past its deadline are caught,
    /// complete and typed ones within it are not.
    #[test]
    fn a_burst_request_lost_or_late_is_a_violation() {
        let ok = Duration::from_secs(1);
        let fine = Report {
            wall: ok,
            records: vec![
                record(0, Outcome::Complete { finish_reason: "length".into() }, ok),
                record(
                    1,
                    Outcome::HttpError { status: 503, code: Some("queue_full".into()), message: String::new() },
                    ok,
                ),
            ],
        };
        assert!(judge_burst(&fine).is_empty());
        let bad = Report {
            wall: ok,
            records: vec![
                record(0, Outcome::Transport("reset".into()), ok),
                record(1, Outcome::Timeout, ok),
                record(2, Outcome::Complete { finish_reason: "length".into() }, DEADLINE + GRACE + ok),
            ],
        };
        let v = judge_burst(&bad);
        assert_eq!(v.iter().filter(|v| v.guarantee == Guarantee::G1).count(), 2, "{v:?}");
        assert_eq!(v.iter().filter(|v| v.guarantee == Guarantee::G4).count(), 1, "{v:?}");
    }

    /// The memory bound is not vacuous: a judged incarnation at the bound is a violation
    /// naming it; one under it, or too short-lived to judge, is not.
    #[test]
    fn an_incarnation_growing_past_the_bound_is_a_violation() {
        let life = |pid, minutes: u64, slope| Incarnation {
            name: "decode-0".into(),
            pid,
            first_ms: 0,
            last_ms: minutes * 60_000,
            samples: 100,
            first_mib: 100.0,
            last_mib: 110.0,
            slope_mib_per_10_min: Some(slope),
        };
        let v = rss_violations(&[life(1, 25, 1.0), life(2, 25, 0.9), life(3, 19, 5.0), life(4, 40, 3.5)]);
        assert_eq!(v.len(), 2, "{v:?}");
        assert!(v[0].detail.starts_with("decode-0 (pid 1) grew 1.00 MiB per 10 minutes"), "{v:?}");
        assert!(v[1].detail.contains("(pid 4)") && v.iter().all(|v| v.guarantee == Guarantee::Drill), "{v:?}");
    }

    fn report(guarantees: &[Guarantee]) -> ChaosReport {
        ChaosReport {
            seed: 1,
            duration_s: 1.0,
            faults_per_minute: 1.0,
            schedule: Vec::new(),
            actions: Vec::new(),
            applied: BTreeMap::new(),
            requests: 0,
            complete: 0,
            typed_errors: BTreeMap::new(),
            resumed: 0,
            loads: BTreeMap::new(),
            kv_links: BTreeMap::new(),
            load: Vec::new(),
            incarnations: Vec::new(),
            goodput: Goodput::default(),
            violations: guarantees
                .iter()
                .map(|&guarantee| Found { at_ms: 0, guarantee, detail: String::new() })
                .collect(),
            log_dir: String::new(),
            command: String::new(),
        }
    }

    /// A shrinking candidate fails "the same way" when it breaks a guarantee the original
    /// broke; the statistical bounds count only when nothing else broke.
    #[test]
    fn a_candidate_matches_the_failure_by_its_guarantees() {
        use Guarantee::{Drill, G1, G2};
        let same = |a: &[Guarantee], b: &[Guarantee]| same_failure(&report(a), &report(b));
        assert!(same(&[G1, G2], &[G2]));
        assert!(!same(&[G1], &[G2]));
        assert!(!same(&[G1], &[]), "a clean run never matches");
        assert!(!same(&[G1, Drill], &[Drill]), "goodput missed on a busy host is not the G1 bug");
        assert!(same(&[Drill], &[Drill]), "a goodput failure alone is shrunk as one");
        let mut action_failed = report(&[]);
        action_failed.actions.push(Action {
            at_ms: 0,
            what: "apply",
            kind: FaultKind::Burst,
            target: "clients".into(),
            error: "refused".into(),
        });
        assert!(same_failure(&action_failed, &report(&[G2])), "any failure matches one with no violation");
    }

    #[test]
    fn the_command_repeats_the_options() {
        let o = ChaosOptions {
            schedule: ScheduleOptions {
                seed: 9,
                duration: Duration::from_secs(90),
                per_minute: 4.0,
                kinds: vec![FaultKind::KillDecode, FaultKind::Burst],
                exclude: vec!["etcd".into()],
                never_kill: vec!["decode-1".into()],
                max_in_flight: 2,
            },
            load_rps: 1.5,
            keep_logs: false,
            journal: None,
            cancel: CancellationToken::new(),
            plant: true,
            plant_on_move: true,
            keep: Some(vec![0, 3]),
            against: None,
            api_key: None,
        };
        assert_eq!(
            command(&o),
            "tandem chaos --seed 9 --duration 90s --rate 4 --load-rps 1.5 --max-in-flight 2 --faults kill-decode,burst \
             --exclude etcd --never-kill decode-1 --plant --plant-on-move --keep-faults 0,3"
        );
        let none = ChaosOptions { keep: Some(Vec::new()), plant: false, plant_on_move: false, ..o.clone() };
        assert!(command(&none).ends_with("--never-kill decode-1 --keep-faults none"), "{}", command(&none));
    }
}
