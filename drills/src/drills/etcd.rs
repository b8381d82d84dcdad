//! Drills on etcd and the workers' and coordinators' links to it: a restart, the
//! leader's death and the loss of quorum in a three-member cluster, and one process
//! partitioned from etcd alone (a [`Fault::Blackhole`] proxy on its etcd link).

use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;

use facts::metrics::worker::{FENCED, FENCES};
use loadgen::Report;

use super::common::{counter_reaches, gone, serving_becomes, LOAD_WAIT, MEMBERSHIP};
use super::{Drill, DrillInfo, Evidence, Progress, Setup};
use crate::cluster::{Cluster, ClusterSpec, Role};
use crate::invariants::Invariants;
use crate::metrics::{get_status, scrape};
use crate::process::Signal;
use crate::proxy::Fault;
use crate::{eventually, HarnessError};
use facts::state::Action;

use facts::metrics::coordinator::{REGISTRY_HEALTHY, REGISTRY_RESYNCS as RESYNCS};
/// The coordinator's code for "etcd unreachable past `--registry-max-stale-ms`".
const REGISTRY_UNAVAILABLE: &str = "registry_unavailable";
/// `--registry-max-stale-ms` in the drills that outlast it.
const MAX_STALE_MS: u64 = 3000;
/// Bound on each wait for a consequence of a fault (fencing, a 503, a rejoin).
const CONSEQUENCE_WAIT: Duration = Duration::from_secs(30);

/// One short completion's answer: status, `Retry-After` and the error's `code`.
#[derive(Debug, Clone, Default)]
struct Answer {
    status: u16,
    retry_after: Option<String>,
    code: Option<String>,
}

impl std::fmt::Display for Answer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.status)?;
        if let Some(c) = &self.code {
            write!(f, " {c}")?;
        }
        if let Some(r) = &self.retry_after {
            write!(f, " (Retry-After: {r})")?;
        }
        Ok(())
    }
}

/// Sends one short completion (max_tokens 1) to the coordinator at `addr`.
async fn ask(c: &Cluster, addr: &str) -> Result<Answer, HarnessError> {
    let body = super::common::probe_body();
    let r = c.post(addr, "/v1/completions").json(&body).timeout(Duration::from_secs(30)).send().await;
    let r = r.map_err(|e| match e {
        opskit::Error::Timeout(what) => HarnessError::Timeout(what),
        e => HarnessError::Fault(format!("asking {addr}: {e}")),
    })?;
    let code = r.json().ok().and_then(|v| v["error"]["code"].as_str().map(str::to_owned));
    Ok(Answer { status: r.status, retry_after: r.header("retry-after").map(str::to_owned), code })
}

/// Asks until an answer satisfies `want` (within `limit`); that answer.
async fn ask_until(
    c: &Cluster,
    addr: &str,
    what: &str,
    limit: Duration,
    want: impl Fn(&Answer) -> bool,
) -> Result<Answer, String> {
    let last = Mutex::new(None::<Answer>);
    let found = Mutex::new(None::<Answer>);
    let r = eventually(what, limit, || {
        let (last, found, want) = (&last, &found, &want);
        async move {
            match ask(c, addr).await {
                Ok(a) if want(&a) => {
                    *found.lock().unwrap_or_else(|e| e.into_inner()) = Some(a);
                    true
                }
                Ok(a) => {
                    *last.lock().unwrap_or_else(|e| e.into_inner()) = Some(a);
                    false
                }
                Err(_) => false,
            }
        }
    })
    .await;
    let found = found.into_inner().unwrap_or_else(|e| e.into_inner());
    match (r, found) {
        (Ok(()), Some(a)) => Ok(a),
        (r, _) => {
            let last = last.into_inner().unwrap_or_else(|e| e.into_inner());
            Err(format!(
                "{}; last answer {}",
                r.err().map_or_else(|| what.to_owned(), |e| e.to_string()),
                last.map_or_else(|| "none".to_owned(), |a| a.to_string())
            ))
        }
    }
}

/// Waits until a member reports itself leader that is not the process `not` (member index,
/// pid): another member, or the same member started again under a new pid (a supervisor can
/// restart a killed leader before the election ends, and it may win it); which member.
async fn wait_leader(c: &Cluster, not: Option<(usize, u32)>, limit: Duration) -> Result<usize, HarnessError> {
    let found = Mutex::new(None);
    eventually("an etcd member reports itself leader", limit, || {
        let found = &found;
        async move {
            match c.etcd_leader().await {
                Some(l) if not.is_none_or(|(i, pid)| l != i || c.etcd_pid(l) != Some(pid)) => {
                    *found.lock().unwrap_or_else(|e| e.into_inner()) = Some(l);
                    true
                }
                _ => false,
            }
        }
    })
    .await?;
    found.into_inner().unwrap_or_else(|e| e.into_inner()).ok_or_else(|| HarnessError::Fault("no leader".into()))
}

/// A coordinator counter before a fault (0 if it cannot be read, or while it has not been
/// incremented: counters are rendered from their first increment). The drill then waits for
/// it to rise ([`counter_reaches`]), which a renamed counter never does.
async fn counter_before(c: &Cluster, metric: &str, labels: &[(&str, &str)]) -> f64 {
    c.coordinator_metrics().await.map_or(0.0, |p| p.absent_as_zero(metric, labels))
}

/// A coordinator metric now; Err when the page cannot be read or has no such series
/// (a renamed or missing metric must not read as 0).
async fn coordinator_find(c: &Cluster, metric: &str, labels: &[(&str, &str)]) -> Result<f64, String> {
    let page = c.coordinator_metrics().await.map_err(|e| e.to_string())?;
    page.get(metric, labels).map_err(|e| format!("the coordinator: {e}"))
}

/// Waits until gauge `metric` at `addr` equals `value` exactly (a missing series never does,
/// and is the wait's last error).
async fn gauge_becomes(addr: &str, metric: &str, value: f64, limit: Duration) -> Result<(), HarnessError> {
    let what = format!("{metric} at {addr} becomes {value}");
    let became = opskit::poll(&what, limit, || async move {
        let v = scrape(addr).await?.get(metric, &[])?;
        Ok::<_, HarnessError>((v == value).then_some(()))
    });
    Ok(became.await?)
}

/// Records `r` as a note (`ok`) or as a missing consequence.
fn note(ev: &mut Evidence, r: Result<String, String>) {
    match r {
        Ok(n) => ev.notes.push(n),
        Err(e) => ev.missing.push(e),
    }
}

fn ms(t: Instant) -> u128 {
    t.elapsed().as_millis()
}

/// `Drill::against` for the etcd drills: the attached cluster has at least `members` etcd
/// members and, when `kills`, something starts a killed one again (its supervisor under
/// `on-failure` or `always`, or a `restart` template on every member).
fn etcd_against(c: &Cluster, members: usize, kills: bool) -> Result<(), String> {
    let n = c.etcd_len();
    if n < members {
        return Err(format!(
            "needs at least {members} etcd members and the state file lists {n} (`tandem up --etcd-members 3`)"
        ));
    }
    if !kills {
        return Ok(());
    }
    let templated = c.attached_etcd().all(|p| p.actions().is_some_and(|a| a.template(Action::Restart).is_some()));
    match c.restart_policy() {
        Some("always" | "on-failure") => Ok(()),
        _ if templated => Ok(()),
        p => Err(format!(
            "it SIGKILLs etcd members, which must be started again: the state file's restart policy is {} and \
             its etcd members have no `restart` template",
            p.unwrap_or("none")
        )),
    }
}

/// Restart etcd under load with two version groups.
pub(super) struct EtcdRestart;

#[async_trait::async_trait]
impl Drill for EtcdRestart {
    fn info(&self) -> DrillInfo {
        DrillInfo {
            name: "etcd-restart",
            description: "restart etcd under load with two version groups: serving continues from the cached \
                          membership, the coordinator re-lists, no KV crosses groups",
        }
    }

    /// Against a running cluster: every member is killed and waited for until its
    /// supervisor (or `restart` template) started it again; the cluster's own groups.
    fn against(&self, c: &Cluster) -> Result<(), String> {
        etcd_against(c, 1, true)
    }

    fn setup(&self, _skip: bool) -> Setup {
        Setup {
            // Leases outlive the restart, so workers do not fence; two groups give G3 teeth.
            spec: ClusterSpec { lease_ttl_s: 5, ..ClusterSpec::default() }
                .prefill("g1")
                .decode("g1")
                .prefill("g2")
                .decode("g2"),
            requests: 8,
            max_tokens: 16,
            concurrency: 2,
            invariants: Invariants { all_complete: true, transfers_intact: true, ..Invariants::default() },
            sampled: None,
        }
    }

    async fn fault(&self, c: &mut Cluster, load: &Progress, skip: bool) -> Result<Evidence, HarnessError> {
        let mut ev = Evidence { before: counter_before(c, RESYNCS, &[]).await, ..Evidence::default() };
        load.wait_done(2, LOAD_WAIT).await?;
        ev.victim = c.etcd_pid(0).map(|p| ("etcd".to_owned(), p));
        if !skip {
            ev.began();
            // Every member down, then each back: one member (ours), or all of an attached
            // cluster's, so the coordinator's watch has nowhere to stay connected.
            let mut killed = Vec::new();
            for i in 0..c.etcd_len() {
                killed.push(c.etcd_kill(i).await?);
            }
            for (i, pid) in killed.into_iter().enumerate() {
                c.etcd_restart(i, pid).await?;
            }
            ev.ended();
        }
        Ok(ev)
    }

    async fn prove(&self, c: &Cluster, ev: &Evidence, _: &Report) -> Result<String, String> {
        let (_, pid) = ev.victim.clone().ok_or("no victim was chosen")?;
        if !gone(pid) {
            return Err(format!("etcd (pid {pid}) is still the running member"));
        }
        let h = c.http_addr().map_err(|e| e.to_string())?;
        let (seen, now) = counter_reaches(&h, RESYNCS, &[], ev.before + 1.0, Duration::from_secs(10)).await;
        seen.map_err(|e| format!("old etcd pid {pid} is gone, but {e}"))?;
        Ok(format!("old etcd pid {pid} gone, new pid {:?}; coordinator resyncs {} -> {now}", c.etcd_pid(0), ev.before))
    }
}

/// SIGKILL the etcd leader (of three members) under load.
pub(super) struct EtcdLeaderKill;

#[async_trait::async_trait]
impl Drill for EtcdLeaderKill {
    fn info(&self) -> DrillInfo {
        DrillInfo {
            name: "etcd-leader-kill",
            description: "SIGKILL the leader of a three-member etcd under load: a follower is elected, leases and the \
                          coordinator's watch carry on, every request completes",
        }
    }

    /// Against a running cluster of three or more members, whose killed leader is started
    /// again by its supervisor (or template): the drill waits for that before it ends.
    fn against(&self, c: &Cluster) -> Result<(), String> {
        etcd_against(c, 3, true)
    }

    fn setup(&self, _skip: bool) -> Setup {
        Setup {
            // Leases (5 s) outlive the election, so no worker should fence.
            spec: ClusterSpec { lease_ttl_s: 5, ..ClusterSpec::default() }.etcd_members(3).prefill("g1").decode("g1"),
            requests: 8,
            max_tokens: 16,
            concurrency: 2,
            invariants: Invariants { all_complete: true, transfers_intact: true, ..Invariants::default() },
            sampled: None,
        }
    }

    async fn fault(&self, c: &mut Cluster, load: &Progress, skip: bool) -> Result<Evidence, HarnessError> {
        let mut ev = Evidence::default();
        load.wait_done(2, LOAD_WAIT).await?;
        let leader = wait_leader(c, None, Duration::from_secs(15)).await?;
        let pid = c.etcd_pid(leader).ok_or_else(|| HarnessError::Fault("the leader has no pid".into()))?;
        let name = c.etcd_name(leader);
        ev.victim = Some((name.clone(), pid));
        if skip {
            return Ok(ev);
        }
        ev.began();
        let t0 = Instant::now();
        c.etcd_kill(leader).await?;
        ev.killed.push((name, pid));
        let new = wait_leader(c, Some((leader, pid)), Duration::from_secs(15)).await?;
        ev.ended();
        ev.notes.push(format!("{} elected within {} ms", c.etcd_name(new), ms(t0)));
        if c.is_attached() {
            // Someone else's cluster is left whole: its supervisor starts the old leader again.
            c.etcd_restart(leader, Some(pid)).await?;
            ev.notes.push(format!("{} started again", c.etcd_name(leader)));
        }
        Ok(ev)
    }

    async fn prove(&self, c: &Cluster, ev: &Evidence, _: &Report) -> Result<String, String> {
        let (name, pid) = ev.victim.clone().ok_or("no leader was found to kill")?;
        if !gone(pid) {
            return Err(format!("the etcd leader {name} (pid {pid}) is still running"));
        }
        let now = c.etcd_leader().await.ok_or_else(|| format!("{name} (pid {pid}) is gone but no member leads"))?;
        if c.etcd_pid(now) == Some(pid) {
            return Err(format!("{name} (pid {pid}) still reported as leader after its kill"));
        }
        // Another member, or (a running cluster's supervisor restarted it) the same one anew.
        let now = match c.etcd_pid(now) {
            Some(p) if c.etcd_name(now) == name => format!("{name} again, restarted as pid {p},"),
            _ => c.etcd_name(now),
        };
        Ok(format!("leader {name} (pid {pid}) gone; {now} leads; {}", ev.notes.join("; ")))
    }
}

/// Kill two of three etcd members under load, then restart them.
pub(super) struct EtcdQuorumLoss;

#[async_trait::async_trait]
impl Drill for EtcdQuorumLoss {
    fn info(&self) -> DrillInfo {
        DrillInfo {
            name: "etcd-quorum-loss",
            description: "kill two of three etcd members under load: no worker fences (static stability), the \
                          coordinator serves from its cache for --registry-max-stale-ms then answers 503 \
                          registry_unavailable; restart them: serving resumes",
        }
    }

    /// Against a running cluster two members are stopped (SIGSTOP) rather than killed: its
    /// supervisor would start a killed one again within its backoff, so the quorum would
    /// return before the bound the drill proves. The bound is the coordinator's
    /// `registry-max-stale-ms` from the state file, which must fit the drill's wait.
    fn against(&self, c: &Cluster) -> Result<(), String> {
        if c.etcd_len() < 3 {
            return Err(format!(
                "it takes two of three etcd members away, and the cluster has {} (`tandem up --etcd-members 3`)",
                c.etcd_len()
            ));
        }
        attached_stale_bound(c).map(|_| ())
    }

    fn setup(&self, _skip: bool) -> Setup {
        let stale = MAX_STALE_MS.to_string();
        Setup {
            sampled: None,
            spec: ClusterSpec { lease_ttl_s: 2, ..ClusterSpec::default() }
                .etcd_members(3)
                .prefill("g1")
                .decode("g1")
                .coordinator_args(&["--registry-max-stale-ms", &stale]),
            requests: 8,
            max_tokens: 16,
            concurrency: 2,
            invariants: Invariants {
                // Past the bound only: workers serve on and stay ready throughout.
                allowed_errors: Some(vec![REGISTRY_UNAVAILABLE.into()]),
                ..Invariants::default()
            },
        }
    }

    async fn fault(&self, c: &mut Cluster, load: &Progress, skip: bool) -> Result<Evidence, HarnessError> {
        let mut ev = Evidence::default();
        let h = c.http_addr()?;
        load.wait_done(2, LOAD_WAIT).await?;
        let leader = wait_leader(c, None, Duration::from_secs(15)).await?;
        let follower = (0..c.etcd_len()).find(|&i| i != leader).unwrap_or(0);
        if skip {
            return Ok(ev);
        }
        ev.began();
        let t0 = Instant::now();
        let attached = c.is_attached();
        for i in [leader, follower] {
            if attached {
                // Stopped, not killed: its supervisor would start a killed member again.
                let pid = c.etcd_pid(i);
                match c.etcd_signal(i, Signal::Stop) {
                    Ok(()) => {
                        c.faulted.insert(c.etcd_name(i), Signal::Stop);
                        ev.killed.extend(pid.map(|p| (c.etcd_name(i), p)));
                    }
                    Err(e) => ev.missing.push(format!("stopping {}: {e}", c.etcd_name(i))),
                }
            } else if let Some(pid) = c.etcd_kill(i).await? {
                ev.killed.push((c.etcd_name(i), pid));
            }
        }
        let refused = ask_until(c, &h, "a 503 registry_unavailable with Retry-After", CONSEQUENCE_WAIT, |a| {
            a.status == 503 && a.code.as_deref() == Some(REGISTRY_UNAVAILABLE) && a.retry_after.is_some()
        })
        .await;
        ev.seen = refused.is_ok();
        note(&mut ev, refused.map(|a| format!("quorum lost; {a} after {} ms", ms(t0))));
        let ready = get_status(&h, "/ready").await.map_err(|e| e.to_string());
        note(&mut ev, ready.and_then(|s| if s == 503 { Ok("/ready 503".into()) } else { Err(format!("/ready {s}")) }));
        // Quorum back: the first restart makes two of three.
        if attached {
            // The follower first, and the old leader only once the two running members elected
            // another: a new leader renews every lease, where the old one, thawed while it
            // still leads, would expire the leases its pause outlived.
            let cont = c.etcd_signal(follower, Signal::Cont);
            note(&mut ev, cont.map(|()| format!("{} continued", c.etcd_name(follower))).map_err(|e| e.to_string()));
            let elected = eventually("the running members elect another leader", CONSEQUENCE_WAIT, || async {
                c.etcd_leader().await.is_some_and(|l| l != leader)
            })
            .await;
            let cont = c.etcd_signal(leader, Signal::Cont);
            for i in [follower, leader] {
                c.faulted.remove(&c.etcd_name(i));
            }
            note(&mut ev, elected.map(|()| "another leader elected".to_owned()).map_err(|e| e.to_string()));
            note(&mut ev, cont.map(|()| format!("{} continued", c.etcd_name(leader))).map_err(|e| e.to_string()));
        } else {
            for i in [follower, leader] {
                let pid = ev.killed.iter().find(|(n, _)| *n == c.etcd_name(i)).map(|(_, p)| *p);
                c.etcd_restart(i, pid).await?;
            }
        }
        ev.ended();
        let t1 = Instant::now();
        let back =
            ask_until(c, &h, "a request served after quorum returned", CONSEQUENCE_WAIT, |a| a.status == 200).await;
        note(&mut ev, back.map(|_| format!("served again {} ms after quorum returned", ms(t1))));
        Ok(ev)
    }

    async fn prove(&self, c: &Cluster, ev: &Evidence, _: &Report) -> Result<String, String> {
        if ev.killed.len() < 2 {
            return Err(format!("{} etcd member(s) killed, quorum needs two down", ev.killed.len()));
        }
        // Against a running cluster they were stopped and are running again.
        if let Some((name, pid)) = ev.killed.iter().find(|(_, pid)| !gone(*pid) && !c.is_attached()) {
            return Err(format!("{name} (pid {pid}) is still running"));
        }
        if !ev.missing.is_empty() {
            return Err(format!("members killed, but: {}", ev.missing.join("; ")));
        }
        let fences = fences(c).await?;
        if let Some((name, n)) = fences.iter().find(|(_, n)| *n != 0.0) {
            return Err(format!(
                "{name} fenced ({} = {n}) while etcd only lacked quorum",
                facts::metrics::worker::FENCES
            ));
        }
        let killed: Vec<String> = ev.killed.iter().map(|(n, p)| format!("{n} (pid {p})")).collect();
        let how = if c.is_attached() { "stopped (SIGSTOP)" } else { "killed" };
        Ok(format!("{how} {}; {}; no fence: {fences:?}", killed.join(", "), ev.notes.join("; ")))
    }
}

/// The decode worker whose etcd link the cutoff drill blackholes.
const CUT_WORKER: &str = "decode-1";

/// Partition one decode worker (of two) from etcd, then heal it.
pub(super) struct WorkerEtcdCutoff;

#[async_trait::async_trait]
impl Drill for WorkerEtcdCutoff {
    fn info(&self) -> DrillInfo {
        DrillInfo {
            name: "worker-etcd-cutoff",
            description: "blackhole one decode worker's etcd link (it alone): its lease lapses but it does not \
                          fence (its coordinator still reaches it); the coordinator drops it after the departed \
                          grace and the load runs on the other; lift the partition: it re-registers unfenced",
        }
    }

    /// Against a running cluster the partition is an `iptables` rule per etcd member in
    /// decode-1's network, through its `link-fault` template (`tandem up --hosts`).
    fn against(&self, c: &Cluster) -> Result<(), String> {
        super::at_least(c, Role::Decode, 2, "one cut off, one to serve")?;
        match c.worker(CUT_WORKER) {
            Ok(w) if w.has_link_net() => Ok(()),
            Ok(_) => Err(format!(
                "{CUT_WORKER} has no `link-fault` template to cut its etcd link with (`tandem up --hosts 2` gives \
                 each worker one)"
            )),
            Err(_) => Err(format!("it cuts off {CUT_WORKER}, which the cluster does not have")),
        }
    }

    fn setup(&self, _skip: bool) -> Setup {
        Setup {
            spec: ClusterSpec { lease_ttl_s: 2, ..ClusterSpec::default() }
                .prefill("g1")
                .decode("g1")
                .decode("g1")
                .etcd_via_proxy(CUT_WORKER),
            requests: 10,
            max_tokens: 16,
            concurrency: 2,
            invariants: Invariants { all_complete: true, transfers_intact: true, ..Invariants::default() },
            sampled: None,
        }
    }

    async fn fault(&self, c: &mut Cluster, load: &Progress, skip: bool) -> Result<Evidence, HarnessError> {
        let mut ev = Evidence::default();
        let h = c.http_addr()?;
        let m = c.worker(CUT_WORKER)?.metrics_addr()?;
        let left0 = counter_before(c, MEMBERSHIP, &[("change", "left")]).await;
        let joined0 = counter_before(c, MEMBERSHIP, &[("change", "joined")]).await;
        load.wait_done(2, LOAD_WAIT).await?;
        if skip {
            return Ok(ev);
        }
        ev.began();
        let t0 = Instant::now();
        c.etcd_link(CUT_WORKER, Fault::Blackhole)?;
        let (left, n) = counter_reaches(&h, MEMBERSHIP, &[("change", "left")], left0 + 1.0, CONSEQUENCE_WAIT).await;
        note(&mut ev, left.map(|()| format!("left {left0} -> {n} after {} ms", ms(t0))).map_err(|e| e.to_string()));
        let one = serving_becomes(c, Role::Decode, 1.0, CONSEQUENCE_WAIT).await;
        note(&mut ev, one.map(|()| "1 decode worker serving".into()).map_err(|e| e.to_string()));
        c.etcd_link(CUT_WORKER, Fault::None)?;
        ev.ended();
        let t1 = Instant::now();
        let (joined, n) =
            counter_reaches(&h, MEMBERSHIP, &[("change", "joined")], joined0 + 1.0, CONSEQUENCE_WAIT).await;
        note(
            &mut ev,
            joined.map(|()| format!("joined {joined0} -> {n} {} ms after the lift", ms(t1))).map_err(|e| e.to_string()),
        );
        let two = serving_becomes(c, Role::Decode, 2.0, CONSEQUENCE_WAIT).await;
        note(&mut ev, two.map(|()| "2 decode workers serving".into()).map_err(|e| e.to_string()));
        let unfenced = gauge_becomes(&m, FENCED, 0.0, CONSEQUENCE_WAIT).await;
        note(&mut ev, unfenced.map(|()| format!("{CUT_WORKER} not fenced")).map_err(|e| e.to_string()));
        Ok(ev)
    }

    async fn prove(&self, c: &Cluster, ev: &Evidence, _: &Report) -> Result<String, String> {
        let dropped = c.etcd_link_dropped(CUT_WORKER);
        let what = if c.etcd_proxies.contains_key(CUT_WORKER) { "bytes (its proxy)" } else { "packets (its rules)" };
        if dropped == 0 {
            return Err(format!("{CUT_WORKER}'s etcd link dropped 0 {what}: it was never cut off"));
        }
        if !ev.missing.is_empty() {
            return Err(format!("{dropped} {what} dropped, but: {}", ev.missing.join("; ")));
        }
        let m = c.worker(CUT_WORKER).and_then(|w| w.metrics_addr()).map_err(|e| e.to_string())?;
        let fences =
            scrape(&m).await.map_err(|e| e.to_string())?.get(FENCES, &[]).map_err(|e| format!("{CUT_WORKER}: {e}"))?;
        if fences != 0.0 {
            return Err(format!(
                "{CUT_WORKER} fenced ({} = {fences}) though its coordinator reached it",
                facts::metrics::worker::FENCES
            ));
        }
        Ok(format!("dropped {dropped} {what}; {}; {} = 0", ev.notes.join("; "), facts::metrics::worker::FENCES))
    }
}

/// Partition the coordinator from etcd past its staleness bound, then heal it.
pub(super) struct CoordinatorEtcdCutoff;

#[async_trait::async_trait]
impl Drill for CoordinatorEtcdCutoff {
    /// Against a running cluster the partition is an `iptables` rule per etcd member in the
    /// coordinator's own network, through its `link-fault` template (`tandem up --hosts N
    /// --coordinator-hosts`); nothing else may share that network, or the rule would cut it too.
    fn against(&self, c: &Cluster) -> Result<(), String> {
        let name = c.coordinator.name.as_str();
        let Some(ns) = c.netns_of(name).filter(|_| c.has_link_net(name)) else {
            return Err(format!(
                "it blackholes {name}'s own etcd link, and the state file gives it no network namespace with a \
                 `link-fault` template (`tandem up --hosts N --coordinator-hosts` does); on the host's network a \
                 rule would cut every process's etcd"
            ));
        };
        if let Some(other) = c.procs().map(|p| p.name.as_str()).find(|&n| n != name && c.netns_of(n) == Some(ns)) {
            return Err(format!(
                "{other} shares {name}'s network namespace {ns}: the rule would cut its etcd link too"
            ));
        }
        attached_stale_bound(c).map(|_| ())
    }

    fn info(&self) -> DrillInfo {
        DrillInfo {
            name: "coordinator-etcd-cutoff",
            description: "blackhole the coordinator's etcd link: it serves from its cached membership for \
                          --registry-max-stale-ms, then answers 503 registry_unavailable and /ready 503; lift the \
                          partition: it re-lists and serves again",
        }
    }

    fn setup(&self, _skip: bool) -> Setup {
        let stale = MAX_STALE_MS.to_string();
        Setup {
            sampled: None,
            spec: ClusterSpec { lease_ttl_s: 2, ..ClusterSpec::default() }
                .prefill("g1")
                .decode("g1")
                .etcd_via_proxy("coordinator")
                .coordinator_args(&["--registry-max-stale-ms", &stale]),
            requests: 8,
            max_tokens: 16,
            concurrency: 2,
            invariants: Invariants {
                allowed_errors: Some(vec![REGISTRY_UNAVAILABLE.into()]),
                transfers_intact: true,
                ..Invariants::default()
            },
        }
    }

    async fn fault(&self, c: &mut Cluster, load: &Progress, skip: bool) -> Result<Evidence, HarnessError> {
        let before = coordinator_find(c, RESYNCS, &[]).await.map_err(HarnessError::Metrics)?;
        let mut ev = Evidence { before, ..Evidence::default() };
        let h = c.http_addr()?;
        load.wait_done(2, LOAD_WAIT).await?;
        if skip {
            return Ok(ev);
        }
        ev.began();
        let t0 = Instant::now();
        c.etcd_link("coordinator", Fault::Blackhole)?;
        let refused = ask_until(c, &h, "a 503 registry_unavailable with Retry-After", CONSEQUENCE_WAIT, |a| {
            a.status == 503 && a.code.as_deref() == Some(REGISTRY_UNAVAILABLE) && a.retry_after.is_some()
        })
        .await;
        let served_for = ms(t0);
        ev.seen = refused.is_ok();
        note(&mut ev, refused.map(|a| format!("{a} after {served_for} ms cut off")));
        // Refusals start once the last sync (a progress answer, about every second) is
        // older than the bound, so about 2-3 s after the cut; a loaded machine can delay
        // progress ticks, hence only a third of the bound is required.
        let stale = stale_bound(c).as_millis();
        if ev.seen && served_for < stale / 3 {
            ev.missing.push(format!(
                "refused {served_for} ms after the cut: the cache was not served for --registry-max-stale-ms \
                 {stale} (less the last sync's age)"
            ));
        }
        let ready = get_status(&h, "/ready").await.map_err(|e| e.to_string());
        note(&mut ev, ready.and_then(|s| if s == 503 { Ok("/ready 503".into()) } else { Err(format!("/ready {s}")) }));
        match coordinator_find(c, REGISTRY_HEALTHY, &[]).await {
            Ok(0.0) => ev.notes.push(format!("{REGISTRY_HEALTHY} 0")),
            Ok(healthy) => ev.missing.push(format!("{REGISTRY_HEALTHY} {healthy} while cut off")),
            Err(e) => ev.missing.push(e),
        }
        c.etcd_link("coordinator", Fault::None)?;
        ev.ended();
        let t1 = Instant::now();
        let back = ask_until(c, &h, "a request served after the lift", CONSEQUENCE_WAIT, |a| a.status == 200).await;
        note(&mut ev, back.map(|_| format!("served again {} ms after the lift", ms(t1))));
        let (resynced, n) = counter_reaches(&h, RESYNCS, &[], ev.before + 1.0, CONSEQUENCE_WAIT).await;
        let before = ev.before;
        note(&mut ev, resynced.map(|()| format!("resyncs {before} -> {n}")).map_err(|e| e.to_string()));
        Ok(ev)
    }

    async fn prove(&self, c: &Cluster, ev: &Evidence, _: &Report) -> Result<String, String> {
        let dropped = c.etcd_link_dropped("coordinator");
        let what = if c.etcd_proxies.contains_key("coordinator") { "bytes (its proxy)" } else { "packets (its rules)" };
        if dropped == 0 {
            return Err(format!("the coordinator's etcd link dropped 0 {what}: it was never cut off"));
        }
        if !ev.seen {
            return Err(format!(
                "{dropped} {what} dropped, but no 503 {REGISTRY_UNAVAILABLE}: {}",
                ev.missing.join("; ")
            ));
        }
        if !ev.missing.is_empty() {
            return Err(format!("{dropped} {what} dropped, but: {}", ev.missing.join("; ")));
        }
        // The workers kept their etcd links and their coordinator's Health polls.
        let fences = fences(c).await?;
        if let Some((name, n)) = fences.iter().find(|(_, n)| *n != 0.0) {
            return Err(format!(
                "{name} fenced ({} = {n}) while only the coordinator was cut off from etcd",
                facts::metrics::worker::FENCES
            ));
        }
        Ok(format!("{dropped} {what} dropped; {}; no fence: {fences:?}", ev.notes.join("; ")))
    }
}

/// The attached coordinator's `registry-max-stale-ms` from the state file: the bound the
/// drills that cut it off from etcd prove, which must fit their wait for its refusal.
fn attached_stale_bound(c: &Cluster) -> Result<Duration, String> {
    let key = facts::state::flag::REGISTRY_MAX_STALE_MS;
    let name = c.coordinator.name.clone();
    let stale = c.flag_ms(&name, key)?.ok_or_else(|| {
        format!(
            "the state file does not give {name}'s `{key}`, the bound it proves (`tandem up \
             --registry-max-stale-ms 12000` gives it)"
        )
    })?;
    if stale + Duration::from_secs(5) > CONSEQUENCE_WAIT {
        return Err(format!(
            "{name} serves from its cache for {} ms, longer than the drill waits for its refusal (`tandem up \
             --registry-max-stale-ms 12000`)",
            stale.as_millis()
        ));
    }
    Ok(stale)
}

/// The coordinator's `--registry-max-stale-ms`: the attached cluster's, else the one the
/// drill's own cluster is started with.
fn stale_bound(c: &Cluster) -> Duration {
    attached_stale_bound(c).unwrap_or(Duration::from_millis(MAX_STALE_MS))
}

/// How long `etcd-stall` keeps etcd stopped: past the 2 s lease TTL several times over, and
/// past the coordinator's 3 s watch silence timeout, well within `--registry-max-stale-ms`.
const STALL: Duration = Duration::from_secs(8);
/// What an attached coordinator's cache must outlast the stall by: the stall is sampled a
/// little past its end, and the coordinator re-lists after SIGCONT.
const STALL_MARGIN: Duration = Duration::from_secs(3);

/// Whether process `pid` is stopped (state `T` in /proc).
fn stopped(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(')').map(|(_, rest)| rest.trim_start().starts_with('T')))
        .unwrap_or(false)
}

/// `tandem_worker_fences_total` on every worker; Err if a worker does not export it.
async fn fences(c: &Cluster) -> Result<Vec<(String, f64)>, String> {
    let mut out = Vec::new();
    for w in &c.workers {
        let m = w.metrics_addr().map_err(|e| e.to_string())?;
        let page = scrape(&m).await.map_err(|e| e.to_string())?;
        let n = page.get(FENCES, &[]).map_err(|e| format!("{}: {e}", w.proc.name))?;
        out.push((w.proc.name.clone(), n));
    }
    Ok(out)
}

/// SIGSTOP the only etcd for 8 s under load.
pub(super) struct EtcdStall;

#[async_trait::async_trait]
impl Drill for EtcdStall {
    fn info(&self) -> DrillInfo {
        DrillInfo {
            name: "etcd-stall",
            description: "SIGSTOP etcd for 8 s (4 lease TTLs) under load: static stability — every request \
                          succeeds, /ready stays 200, no worker fences; after SIGCONT the workers re-register \
                          and membership is whole again",
        }
    }

    /// Against a running cluster every member is stopped (the drill continues them), and the
    /// coordinator must route from its cache for longer than the stall: its state file's
    /// `registry-max-stale-ms` when given (the coordinator's default is a minute).
    fn against(&self, c: &Cluster) -> Result<(), String> {
        etcd_against(c, 1, false)?;
        let key = facts::state::flag::REGISTRY_MAX_STALE_MS;
        let name = c.coordinator.name.clone();
        if let Some(stale) = c.flag_ms(&name, key)? {
            if stale < STALL + STALL_MARGIN {
                return Err(format!(
                    "it proves {name} serves through a {STALL:?} etcd stall, and it routes from its cache for only \
                     {} ms (`tandem up --registry-max-stale-ms 12000` fits both this and etcd-quorum-loss)",
                    stale.as_millis()
                ));
            }
        }
        Ok(())
    }

    fn setup(&self, _skip: bool) -> Setup {
        Setup {
            spec: ClusterSpec { lease_ttl_s: 2, ..ClusterSpec::default() }.prefill("g1").decode("g1"),
            requests: 10,
            max_tokens: 16,
            concurrency: 2,
            invariants: Invariants { all_complete: true, transfers_intact: true, ..Invariants::default() },
            sampled: None,
        }
    }

    async fn fault(&self, c: &mut Cluster, load: &Progress, skip: bool) -> Result<Evidence, HarnessError> {
        let mut ev = Evidence::default();
        let h = c.http_addr()?;
        let before = fences(c).await.map_err(HarnessError::Fault)?;
        ev.notes.push(format!("fences before: {before:?}"));
        let resyncs0 = counter_before(c, RESYNCS, &[]).await;
        load.wait_done(2, LOAD_WAIT).await?;
        let pid = c.etcd_pid(0).ok_or_else(|| HarnessError::Fault("etcd has no pid".into()))?;
        let pids: Vec<u32> = (0..c.etcd_len()).filter_map(|i| c.etcd_pid(i)).collect();
        ev.victim = Some(("etcd".into(), pid));
        ev.began();
        if !skip {
            // Every member: with one left running a quorum could still answer.
            for i in 0..c.etcd_len() {
                c.etcd_signal(i, Signal::Stop)?;
            }
        }
        // Sample through the stall: a probe request and /ready, every ~half second.
        let t0 = Instant::now();
        let (mut asked, mut failed, mut samples, mut unready) = (0, Vec::new(), 0, Vec::new());
        while t0.elapsed() < STALL {
            ev.seen |= !pids.is_empty() && pids.iter().all(|&p| stopped(p));
            match ask(c, &h).await {
                Ok(a) if a.status == 200 => {}
                Ok(a) => failed.push(format!("{a} at {} ms", ms(t0))),
                Err(e) => failed.push(format!("{e} at {} ms", ms(t0))),
            }
            asked += 1;
            match get_status(&h, "/ready").await {
                Ok(200) => {}
                Ok(s) => unready.push(format!("{s} at {} ms", ms(t0))),
                Err(e) => unready.push(format!("{e} at {} ms", ms(t0))),
            }
            samples += 1;
            tokio::time::sleep(Duration::from_millis(400)).await;
        }
        let healthy = coordinator_find(c, REGISTRY_HEALTHY, &[]).await.unwrap_or_else(|e| {
            ev.missing.push(e);
            f64::NAN
        });
        if !skip {
            for i in 0..c.etcd_len() {
                c.etcd_signal(i, Signal::Cont)?;
            }
        }
        ev.ended();
        ev.notes.push(format!("etcd stopped {} ms; {REGISTRY_HEALTHY} {healthy} at the end", STALL.as_millis()));
        if failed.is_empty() {
            ev.notes.push(format!("{asked} probe requests during the stall, all 200"));
        } else {
            ev.missing.push(format!("{} of {asked} probe requests failed during the stall: {failed:?}", failed.len()));
        }
        if unready.is_empty() {
            ev.notes.push(format!("/ready 200 in all {samples} samples"));
        } else {
            ev.missing.push(format!("/ready not 200 in {} of {samples} samples: {unready:?}", unready.len()));
        }
        // etcd back: membership whole and live again.
        let t1 = Instant::now();
        let n = c.workers.len() as f64;
        let whole = opskit::poll("membership whole and etcd healthy again", CONSEQUENCE_WAIT, || async {
            let p = c.coordinator_metrics().await?;
            // Every worker of every role and state, the watch live, and a resync since the stall.
            let (listed, healthy) = (p.sum(facts::metrics::coordinator::WORKERS, &[])?, p.get(REGISTRY_HEALTHY, &[])?);
            let resynced = p.sum(RESYNCS, &[])? > resyncs0;
            Ok::<_, HarnessError>((listed == n && healthy == 1.0 && resynced).then_some(()))
        })
        .await;
        note(
            &mut ev,
            whole
                .map(|()| format!("{n} workers listed, re-listed, healthy {} ms after SIGCONT", ms(t1)))
                .map_err(|e| e.to_string()),
        );
        let back = ask_until(c, &h, "a request served after SIGCONT", CONSEQUENCE_WAIT, |a| a.status == 200).await;
        note(&mut ev, back.map(|_| "served after SIGCONT".into()));
        ev.before = before.iter().map(|(_, n)| n).sum();
        Ok(ev)
    }

    async fn prove(&self, c: &Cluster, ev: &Evidence, _: &Report) -> Result<String, String> {
        let (_, pid) = ev.victim.clone().ok_or("no etcd pid was found")?;
        if !ev.seen {
            return Err(format!("etcd (pid {pid}) was never seen stopped (state T): the stall did not happen"));
        }
        if !ev.missing.is_empty() {
            return Err(format!("etcd (pid {pid}) stopped {} s, but: {}", STALL.as_secs(), ev.missing.join("; ")));
        }
        let after = fences(c).await?;
        let total: f64 = after.iter().map(|(_, n)| n).sum();
        if total != ev.before {
            return Err(format!("a worker fenced: {} {} -> {after:?}", facts::metrics::worker::FENCES, ev.before));
        }
        Ok(format!("etcd (pid {pid}) stopped {} s; {}; no fence: {after:?}", STALL.as_secs(), ev.notes.join("; ")))
    }
}
