//! SIGKILL of one of several coordinators mid-stream, then its restart.

use loadgen::Report;
use std::time::Duration;

use super::stream_end;
use crate::cluster::{Cluster, ClusterSpec};
use crate::drills::common::{cancelled, cancelled_reaches, gone, open_stream, probe, LOAD_WAIT};
use crate::drills::{coordinators_against, Drill, DrillInfo, Evidence, Exit, Progress, Setup};
use crate::invariants::Invariants;
use crate::{eventually, HarnessError};

/// SIGKILL one of two coordinators mid-stream, then restart it.
pub(in crate::drills) struct CoordinatorKill;

#[async_trait::async_trait]
impl Drill for CoordinatorKill {
    /// Against a running cluster of several coordinators: the drill's own front before
    /// them, and the victim started again by its supervisor.
    fn against(&self, c: &Cluster) -> Result<(), String> {
        coordinators_against(c, Exit::Killed)
    }

    fn info(&self) -> DrillInfo {
        DrillInfo {
            name: "coordinator-kill",
            description: "SIGKILL one of two coordinators (behind a round-robin TCP front) mid-stream: its clients \
                          see the connection drop (coordinator_lost), new requests complete via the other, the \
                          decode worker cancels the orphaned streams and frees their KV; restarted, it serves again",
        }
    }

    fn setup(&self, _skip: bool) -> Setup {
        Setup {
            spec: ClusterSpec::default().prefill("g1").decode("g1").coordinators(2),
            requests: 12,
            max_tokens: 32,
            concurrency: 2,
            // Only transport errors across the kill (counted as coordinator_lost); nothing typed.
            invariants: Invariants { allowed_errors: Some(vec![]), ..Invariants::default() },
            sampled: None,
        }
    }

    async fn fault(&self, c: &mut Cluster, load: &Progress, skip: bool) -> Result<Evidence, HarnessError> {
        let mut ev = Evidence::default();
        let a = c.coordinator.addr("http")?;
        let pid = c.coordinator.pid;
        // Cancelled Generate streams, on every decode worker (either may run A's streams).
        ev.before = cancelled(c).await?;
        // A client of A mid-stream for sure (a long answer), besides the load's own.
        let mut long = open_stream(c, &a, 0).await?;
        long.first_data().await?;
        let a_busy = eventually("coordinator A runs a load request besides the long stream", LOAD_WAIT, || {
            let a = a.clone();
            async move {
                let p = crate::metrics::scrape(&a).await;
                p.is_ok_and(|p| p.get(facts::metrics::coordinator::RUNNING, &[]).is_ok_and(|n| n >= 2.0))
            }
        })
        .await;
        ev.notes.push(format!(
            "coordinator (pid {pid}) streaming a long answer; a load request on it too: {}",
            a_busy.is_ok()
        ));
        ev.victim = Some(("coordinator".into(), pid));
        if skip {
            drop(long);
            return Ok(ev);
        }
        ev.began();
        c.kill_coordinator("coordinator").await?;
        let to_b = c.front.as_ref().map_or(0, |f| f.counters().forwarded.get(1).copied().unwrap_or(0));
        match stream_end(&mut long).await {
            Err(e) => ev.notes.push(format!("A's long-stream client: {e}")),
            Ok(end) => ev.missing.push(format!("A's long stream ended as if A were alive: {end:?}")),
        }
        let (r, now) = cancelled_reaches(c, ev.before + 1.0, Duration::from_secs(20)).await;
        match r {
            Ok(()) => ev.notes.push(format!("the decode workers cancelled {} orphaned stream(s)", now - ev.before)),
            Err(e) => ev.missing.push(format!("no decode worker cancelled any of A's streams: {e}")),
        }
        // Restart A once the load is done (behind the front, a coordinator that has not yet
        // listed membership would answer no_worker), with the very same flags.
        eventually("the load finishes", LOAD_WAIT * 2, || async { load.finished() }).await?;
        let new_pid = c.restart("coordinator", None).await?;
        c.wait_coordinator_ready(&c.coordinator).await?;
        ev.ended();
        let (status, _) = probe(c, &a).await?;
        ev.notes.push(format!("restarted as pid {new_pid} on {a}: a request through it answered {status}"));
        if status != 200 {
            ev.missing.push(format!("the restarted coordinator answered {status}"));
        }
        if let Some(f) = &c.front {
            let k = f.counters();
            ev.notes.push(format!(
                "front: forwarded {:?}, connects refused {:?} (A dead: sent on to B)",
                k.forwarded, k.refused
            ));
            let to_b_now = k.forwarded.get(1).copied().unwrap_or(0);
            ev.notes.push(format!("{} load connection(s) went to B after the kill", to_b_now - to_b));
            // A running cluster's supervisor may start A again before the front tries it
            // (`tandem up --restart-backoff-ms 300`): then no connect is refused, and what
            // shows the kill did not stop new requests is those B took after it.
            let refused = k.refused.first().is_some_and(|&n| n > 0);
            ev.seen = (refused || c.is_attached()) && to_b_now > to_b;
        }
        Ok(ev)
    }

    async fn prove(&self, c: &Cluster, ev: &Evidence, report: &Report) -> Result<String, String> {
        let (name, pid) = ev.victim.clone().ok_or("no victim was chosen")?;
        if !gone(pid) || c.coordinator_kills.is_empty() {
            return Err(format!("coordinator {name} (pid {pid}) was never killed: it is still running"));
        }
        if !ev.missing.is_empty() {
            return Err(format!("{}; but {}", ev.notes.join("; "), ev.missing.join("; ")));
        }
        // G1 holds every request to complete unless it was in flight across the kill; here:
        // load requests did reach B after A died (the front sent them on).
        if !ev.seen {
            return Err(format!(
                "{}; but no load request was sent on to B after A died (no refused connect to A, or none \
                 forwarded to B after the kill)",
                ev.notes.join("; ")
            ));
        }
        let lost = report.records.iter().filter(|r| matches!(r.outcome, loadgen::Outcome::Transport(_))).count();
        Ok(format!("{}; {lost} load request(s) lost with A; pid {pid} is gone from /proc", ev.notes.join("; ")))
    }
}
