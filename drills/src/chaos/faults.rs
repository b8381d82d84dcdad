//! Applying and lifting one fault of the schedule ([`apply`], [`lift`]) and running the
//! whole schedule against the cluster ([`run_faults`]), with its audit lines and the
//! processes' memory sampled on the way.

use std::io::Write;
use std::time::Duration;

use loadgen::{Arrival, Plan, PromptSource, Report};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::schedule::SLOW_READER_HOLD;
use super::{Action, FaultKind, Planned, RssWatch, BURST, DEADLINE, GRACE, INTERACTIVE_KEY, MODEL, RSS_EVERY};
use crate::cluster::{Cluster, PastLife};
use crate::drills::coordinator::slow_stream;
use crate::process::{signal, Signal};
use crate::proxy::{Fault, Proxy};
use crate::HarnessError;
/// Appends audit lines: stderr and the journal.
pub(super) struct Audit {
    pub(super) start: Instant,
    pub(super) journal: Option<std::fs::File>,
    pub(super) actions: Vec<Action>,
}

impl Audit {
    fn record(&mut self, what: &'static str, p: &Planned, r: &Result<(), HarnessError>) {
        let a = Action {
            at_ms: self.start.elapsed().as_millis() as u64,
            what,
            kind: p.kind,
            target: p.target.clone(),
            error: r.as_ref().err().map(ToString::to_string).unwrap_or_default(),
        };
        eprintln!(
            "chaos {:>8.1} s  {what:<5} {:<17} {}{}",
            a.at_ms as f64 / 1e3,
            p.kind.name(),
            p.target,
            if a.error.is_empty() { String::new() } else { format!("  FAILED: {}", a.error) }
        );
        if let Some(f) = &mut self.journal {
            if let Ok(line) = serde_json::to_string(&a) {
                let _ = writeln!(f, "{line}");
            }
        }
        self.actions.push(a);
    }
}

/// A burst's load, running.
type Burst = tokio::task::JoinHandle<Result<Report, loadgen::PlanError>>;

/// What faults left running, judged at the end of the run.
#[derive(Default)]
pub(super) struct Spawned {
    /// Each burst's load.
    pub(super) bursts: Vec<Burst>,
    /// Each slow reader, until it hangs up.
    pub(super) slow_readers: Vec<tokio::task::JoinHandle<()>>,
}

/// The key the faults' own traffic (bursts, disconnecting and slow clients) carries: the
/// interactive tenant's in chaos's own cluster, the run's (`--api-key`) in an attached one.
fn fault_key(c: &Cluster) -> Option<String> {
    match c.is_attached() {
        true => c.api_key.clone(),
        false => Some(INTERACTIVE_KEY.into()),
    }
}

/// Applies `p` to the cluster; a burst's load or a slow reader goes into `spawned`.
async fn apply(c: &mut Cluster, p: &Planned, base_url: &str, spawned: &mut Spawned) -> Result<(), HarnessError> {
    let name = p.target.as_str();
    match p.kind {
        FaultKind::KillDecode | FaultKind::KillPrefill => {
            let pid = c.signal(name, Signal::Kill)?;
            c.proc_mut(name)?.wait_exit(Duration::from_secs(10)).await?;
            // Its KV counters died with it: G3 cannot count its group (listed as skipped).
            let w = c.worker_mut(name)?;
            let life = PastLife::uncounted(pid, &w.group);
            w.past.push(life);
        }
        FaultKind::KillCoordinator => {
            c.kill_coordinator(name).await?;
        }
        FaultKind::StopDecode | FaultKind::StopPrefill | FaultKind::StopCoordinator => {
            c.signal(name, Signal::Stop)?;
        }
        FaultKind::KillEtcd if c.attached.is_some() => {
            let member = c.any_proc_mut(name)?;
            member.signal(Signal::Kill)?;
            member.wait_exit(Duration::from_secs(10)).await?;
        }
        FaultKind::KillEtcd => {
            c.etcd.kill(0).ok_or_else(|| HarnessError::Fault("etcd was not running".into()))?;
        }
        FaultKind::StopEtcd if c.attached.is_some() => c.any_proc_mut(name)?.signal(Signal::Stop)?,
        FaultKind::StopEtcd => signal(etcd_pid(c)?, Signal::Stop)?,
        FaultKind::KvDelay => {
            link(c, name)?.arm(Fault::Delay { base: Duration::from_millis(75), jitter: Duration::from_millis(50) });
        }
        FaultKind::KvBlackhole => link(c, name)?.arm(Fault::Blackhole),
        FaultKind::KvCorrupt => {
            // Somewhere in the first 256 KiB (a 40-token prompt's KV is ~0.9 MB), drawn from
            // the fault's time so the run repeats it.
            let after = (p.at.as_millis() as usize).wrapping_mul(2_654_435_761) % (256 << 10);
            link(c, name)?.arm(Fault::FlipAfter(after));
        }
        FaultKind::KvReset => {
            link(c, name)?.reset_open();
        }
        FaultKind::Burst => {
            let mut plan = Plan::new(base_url, MODEL);
            plan.requests = BURST;
            plan.arrival = Arrival::Closed { concurrency: BURST };
            plan.prompts = PromptSource::List(loadgen::prompts::generate(BURST, 40, p.at.as_millis() as u64));
            plan.max_tokens = 8;
            plan.deadline = Some(DEADLINE);
            plan.timeout = DEADLINE + GRACE + Duration::from_secs(10);
            plan.api_key = fault_key(c);
            // Resuming clients too: a burst that meets a killed coordinator goes on at the other.
            plan.resume = true;
            // Judged at the end: complete or typed, within the deadline.
            spawned.bursts.push(tokio::spawn(async move { loadgen::run(&plan).await }));
        }
        FaultKind::Disconnect => {
            let body = serde_json::json!({
                "model": MODEL, "prompt": "The lighthouse keeper wrote", "max_tokens": 64, "stream": true,
                "ignore_eos": true,
            });
            let addr = base_url.trim_start_matches("http://").to_owned();
            let mut req = opskit::http::Request::post(&addr, "/v1/completions");
            if let Some(k) = fault_key(c) {
                req = req.header("authorization", &format!("Bearer {k}"));
            }
            tokio::spawn(async move {
                let req = req.json(&body);
                if let Ok(mut s) = req.stream().await {
                    // Two events, then the client is gone.
                    for _ in 0..2 {
                        if !matches!(s.next_event().await, Ok(Some(_))) {
                            break;
                        }
                    }
                }
            });
        }
        FaultKind::SlowReader => {
            // The coordinators in turn, by the fault's time (so the run repeats it).
            let i = p.at.as_millis() as usize;
            let addrs: Vec<String> = c.coordinators().map(|p| p.addr("http")).collect::<Result<_, _>>()?;
            let addr = addrs.get(i % addrs.len().max(1)).ok_or_else(|| HarnessError::Setup("no coordinator".into()))?;
            let addr = addr.parse().map_err(|e| HarnessError::Setup(format!("a coordinator's address {addr}: {e}")))?;
            let key = fault_key(c);
            spawned.slow_readers.push(tokio::task::spawn_blocking(move || slow_reader(addr, i, key.as_deref())));
        }
    }
    Ok(())
}

/// One slow reader: a stream from a socket with a 1 KiB receive window, straight to a
/// coordinator (a front's buffers would absorb the stall), never read for
/// [`SLOW_READER_HOLD`], then hung up. The coordinator's stream idle timeout or the
/// hang-up must free its slot and KV (checked at quiescence), and the rest of the load
/// must keep its deadlines meanwhile. A stream refused at its start (no worker, the
/// coordinator down) is no stall.
fn slow_reader(addr: std::net::SocketAddr, i: usize, key: Option<&str>) {
    if let Ok(s) = slow_stream(addr, i, true, key) {
        std::thread::sleep(SLOW_READER_HOLD);
        drop(s);
    }
}

/// The pid of the chaos cluster's one etcd member.
fn etcd_pid(c: &Cluster) -> Result<u32, HarnessError> {
    c.etcd.pid(0).ok_or_else(|| HarnessError::Fault("etcd was not running".into()))
}

/// The fault proxy on the KV link `kv:NAME` names.
fn link<'a>(c: &'a Cluster, target: &str) -> Result<&'a Proxy, HarnessError> {
    let name = target.strip_prefix("kv:").unwrap_or(target);
    c.worker(name)?.proxy.as_ref().ok_or_else(|| HarnessError::Setup(format!("{name} has no KV fault proxy")))
}

/// Lifts `p`: a killed process started again, a stopped one continued, etcd back, a
/// KV link healed.
async fn lift(c: &mut Cluster, p: &Planned) -> Result<(), HarnessError> {
    let name = p.target.as_str();
    match p.kind {
        // An attached cluster's supervisor (or its `restart` template) starts a killed
        // process again: the lift waits for that and follows the new pid.
        FaultKind::KillDecode | FaultKind::KillPrefill | FaultKind::KillEtcd if c.attached.is_some() => {
            let old = c.any_proc_mut(name)?.pid;
            c.follow_restart(name, old, super::RESTART_LIMIT).await?;
        }
        FaultKind::KillDecode | FaultKind::KillPrefill => {
            c.restart(name, None).await?;
        }
        FaultKind::KillCoordinator => {
            c.restart(name, None).await?;
            // Lifted once it listens again. A short wait for `/ready` keeps the front from
            // sending it requests before it lists the workers, but not more: with other
            // faults held no coordinator may be ready (and "sees every worker" can be false
            // for the whole run), and a lift must not stall the schedule.
            let addr = c.coordinators().find(|p| p.name == name).map(|p| p.addr("http")).transpose()?;
            if let Some(addr) = addr {
                let what = format!("{name} ready");
                let ready = crate::eventually(&what, Duration::from_secs(10), || {
                    let addr = addr.clone();
                    async move {
                        opskit::http::status(&addr, "/ready", Duration::from_secs(2)).await.is_ok_and(|s| s == 200)
                    }
                });
                if let Err(e) = ready.await {
                    eprintln!("chaos: {name} restarted; not ready within 10 s ({e}): other faults may be held");
                }
            }
        }
        FaultKind::StopDecode | FaultKind::StopPrefill | FaultKind::StopCoordinator => {
            c.proc_mut(name)?.signal(Signal::Cont)?;
            c.faulted.remove(name);
        }
        FaultKind::KillEtcd => {
            c.etcd.restart(0).await.map_err(|e| HarnessError::Fault(format!("etcd restart: {e}")))?;
        }
        FaultKind::StopEtcd if c.attached.is_some() => c.any_proc_mut(name)?.signal(Signal::Cont)?,
        FaultKind::StopEtcd => signal(etcd_pid(c)?, Signal::Cont)?,
        FaultKind::KvDelay | FaultKind::KvBlackhole | FaultKind::KvCorrupt => link(c, name)?.arm(Fault::None),
        FaultKind::KvReset | FaultKind::Burst | FaultKind::Disconnect | FaultKind::SlowReader => {}
    }
    Ok(())
}

/// Runs the schedule against `c` from `start`: each fault applied at its time and lifted
/// at its end; on `cancel`, everything held is lifted at once and nothing more applied.
pub(super) async fn run_faults(
    c: &mut Cluster,
    plan: &[Planned],
    start: Instant,
    base_url: &str,
    audit: &mut Audit,
    cancel: &CancellationToken,
    rss: &mut RssWatch,
) -> Spawned {
    let mut spawned = Spawned::default();
    // (when, apply?, index), applies before lifts at one instant.
    let mut timeline: Vec<(Duration, bool, usize)> = Vec::new();
    for (i, p) in plan.iter().enumerate() {
        timeline.push((p.at, true, i));
        if !p.hold.is_zero() {
            timeline.push((p.until(), false, i));
        }
    }
    timeline.sort_by_key(|&(t, apply, i)| (t, !apply, i));
    let mut held: Vec<usize> = Vec::new();
    let mut sampling = tokio::time::interval(RSS_EVERY);
    sampling.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    'events: for (t, is_apply, i) in timeline {
        let p = &plan[i];
        loop {
            tokio::select! {
                () = tokio::time::sleep_until(start + t) => break,
                () = cancel.cancelled() => break 'events,
                _ = sampling.tick() => sample_rss(c, start, rss),
            }
        }
        if is_apply {
            let r = apply(c, p, base_url, &mut spawned).await;
            audit.record("apply", p, &r);
            if r.is_ok() && !p.hold.is_zero() {
                held.push(i);
            }
        } else if let Some(k) = held.iter().position(|&h| h == i) {
            held.remove(k);
            let r = lift(c, p).await;
            audit.record("lift", p, &r);
        }
    }
    // Cancelled (or a lift left over): lift what is still held, latest first.
    while let Some(i) = held.pop() {
        let r = lift(c, &plan[i]).await;
        audit.record("lift", &plan[i], &r);
    }
    spawned
}

/// One resident-memory sample of every process of the cluster, etcd included.
pub(super) fn sample_rss(c: &Cluster, start: Instant, rss: &mut RssWatch) {
    let at_ms = start.elapsed().as_millis() as u64;
    let procs = c
        .procs()
        .chain(c.attached_etcd())
        .map(|p| (p.name.as_str(), p.pid))
        .chain(c.etcd.pid(0).map(|pid| ("etcd", pid)));
    rss.sample(at_ms, procs, crate::drills::anon_mib);
}
