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

mod cutoff;
mod members;

pub(super) use cutoff::{CoordinatorEtcdCutoff, WorkerEtcdCutoff};
pub(super) use members::{EtcdLeaderKill, EtcdQuorumLoss, EtcdRestart, EtcdStall};
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
