//! SIGSTOP of a worker past its lease, then SIGCONT: a process that is alive but silent.

use loadgen::Report;
use std::time::Duration;

use crate::cluster::{Cluster, ClusterSpec, Role};
use crate::drills::common::{busy_decoder, serving_becomes, LOAD_WAIT, MEMBERSHIP};
use crate::drills::{Drill, DrillInfo, Evidence, Progress, Setup};
use crate::invariants::Invariants;
use crate::process::{proc_state, Signal};
use crate::{eventually, HarnessError};

/// The fault's start: SIGSTOP `name` and check that the kernel stopped it (its `/proc`
/// state `T`), in `ev` (`seen`, and a note of what it was `running`).
async fn freeze(c: &mut Cluster, ev: &mut Evidence, name: &str, pid: u32, running: &str) -> Result<(), HarnessError> {
    ev.began();
    c.signal(name, Signal::Stop)?;
    let stopped = eventually("the stopped worker's /proc state is T", Duration::from_secs(5), || async {
        proc_state(pid) == Some('T')
    })
    .await;
    ev.seen = stopped.is_ok();
    ev.notes.push(format!("{name} (pid {pid}) was running {running}; SIGSTOP: /proc state {:?}", proc_state(pid)));
    Ok(())
}

/// SIGSTOP a decode worker past its lease, then SIGCONT.
pub(in crate::drills) struct WorkerSigstop;

#[async_trait::async_trait]
impl Drill for WorkerSigstop {
    fn info(&self) -> DrillInfo {
        DrillInfo {
            name: "worker-sigstop",
            description: "SIGSTOP a decode worker (2 decode workers, lease TTL 2 s) past its lease, then SIGCONT: \
                          it leaves membership, the load finishes on the other worker, and it registers again",
        }
    }

    fn setup(&self, _skip: bool) -> Setup {
        Setup {
            sampled: None,
            spec: ClusterSpec::default().prefill("g1").decode("g1").decode("g1"),
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
                ..Invariants::default()
            },
        }
    }

    async fn fault(&self, c: &mut Cluster, _: &Progress, skip: bool) -> Result<Evidence, HarnessError> {
        let mut ev = Evidence::default();
        let name = busy_decoder(c, LOAD_WAIT).await?;
        let pid = c.worker(&name)?.proc.pid;
        ev.before = c.coordinator_metrics().await?.sum(MEMBERSHIP, &[("change", "left")])?;
        ev.victim = Some((name.clone(), pid));
        if skip {
            return Ok(ev);
        }
        // Every decode worker serves before; one fewer while it is stopped. The lease must
        // lapse (the cluster's TTL: 2 s for a drill's own cluster, the workers' default for
        // `tandem up`) and the coordinator see it, on a loaded machine.
        let n = c.workers_of(Role::Decode).count() as f64;
        let limit = c.lease_ttl * 3 + Duration::from_secs(10);
        let ttl = c.lease_ttl;
        freeze(c, &mut ev, &name, pid, "a request").await?;
        // The lease (TTL `ttl`) lapses; the coordinator must drop it. Continue it whatever happened.
        let left = serving_becomes(c, Role::Decode, n - 1.0, limit).await;
        let t = ev.before;
        // Unreadable or missing reads as unchanged: the drill then fails unless the serving count fell.
        let now = c.coordinator_metrics().await.map_or(t, |p| p.sum(MEMBERSHIP, &[("change", "left")]).unwrap_or(t));
        ev.notes.push(format!(
            "left membership (lease TTL {ttl:?}): serving decode {}: {}; `left` changes {t} -> {now}",
            n - 1.0,
            left.is_ok()
        ));
        if left.is_err() && now <= t {
            ev.missing.push("the coordinator never saw the stopped worker leave".into());
        }
        c.signal(&name, Signal::Cont)?;
        ev.ended();
        match serving_becomes(c, Role::Decode, n, limit).await {
            Ok(()) => ev.notes.push(format!("after SIGCONT it registered again: {n} decode serving")),
            Err(e) => ev.missing.push(format!("after SIGCONT: {e}")),
        }
        Ok(ev)
    }

    /// Reversible (SIGCONT ends it), so it may run against a running cluster with a second
    /// decode worker to finish the load.
    fn against(&self, c: &Cluster) -> Result<(), String> {
        match c.workers_of(Role::Decode).count() {
            n if n >= 2 => Ok(()),
            n => Err(format!("needs at least 2 decode workers (one to stop, one to serve); the cluster has {n}")),
        }
    }

    async fn prove(&self, _: &Cluster, ev: &Evidence, _: &Report) -> Result<String, String> {
        let (name, pid) = ev.victim.clone().ok_or("no victim was chosen")?;
        if !ev.seen {
            return Err(format!("{name} (pid {pid}) was never seen stopped (state T)"));
        }
        if !ev.missing.is_empty() {
            return Err(format!("{}; but {}", ev.notes.join("; "), ev.missing.join("; ")));
        }
        Ok(ev.notes.join("; "))
    }
}

/// SIGSTOP the decode worker running most of eight long streams (half sampled): it sends
/// nothing and its load reports go stale, so the coordinator moves its streams to the other
/// decode worker (request migration, reason `stalled`) well inside their deadline; then
/// SIGCONT: the thawed worker drops what it held (the coordinator told it to abort).
pub(in crate::drills) struct DecodeFreezeMigrate;

/// The coordinator's successful `stalled` moves.
async fn stalled_moves(c: &Cluster) -> Result<f64, HarnessError> {
    use facts::metrics::coordinator::MIGRATIONS;
    Ok(c.coordinator_metrics().await?.get(MIGRATIONS, &[("reason", "stalled"), ("outcome", "ok")])?)
}

#[async_trait::async_trait]
impl Drill for DecodeFreezeMigrate {
    fn info(&self) -> DrillInfo {
        DrillInfo {
            name: "decode-freeze-migrate",
            description: "SIGSTOP the decode worker running most of eight 200-token streams (half sampled; 2 \
                          decode workers): its streams move to the other worker once it is silent and stale, \
                          every one completes exactly; SIGCONT, and the thawed worker frees what it held",
        }
    }

    fn setup(&self, _skip: bool) -> Setup {
        super::kill::migration_load(Invariants { all_complete: true, ..Invariants::default() })
    }

    /// Reversible (SIGCONT ends it): it may run against a running cluster with a second
    /// decode worker to take the streams.
    fn against(&self, c: &Cluster) -> Result<(), String> {
        super::super::at_least(c, Role::Decode, 2, "one to freeze, one to take its streams")
    }

    async fn fault(&self, c: &mut Cluster, progress: &Progress, skip: bool) -> Result<Evidence, HarnessError> {
        let mut ev = Evidence::default();
        let (name, running) = super::kill::busiest_decoder(c, 3.0, LOAD_WAIT).await?;
        let pid = c.worker(&name)?.proc.pid;
        ev.before = stalled_moves(c).await?;
        ev.victim = Some((name.clone(), pid));
        ev.done_at.push(running as usize);
        if skip {
            return Ok(ev);
        }
        freeze(c, &mut ev, &name, pid, &format!("{running} requests")).await?;
        // Frozen until its streams moved (or the load is over: then the proof says whether they did).
        let before = ev.before;
        let moved = eventually("the coordinator moved the frozen worker's streams", LOAD_WAIT, || async {
            progress.finished.load(std::sync::atomic::Ordering::SeqCst)
                || stalled_moves(c).await.is_ok_and(|n| n - before >= running)
        })
        .await;
        if let Err(e) = moved {
            ev.missing.push(e.to_string());
        }
        c.signal(&name, Signal::Cont)?;
        ev.ended();
        Ok(ev)
    }

    async fn prove(&self, c: &Cluster, ev: &Evidence, _: &Report) -> Result<String, String> {
        let (name, pid) = ev.victim.clone().ok_or("no victim was chosen")?;
        if !ev.seen {
            return Err(format!("{name} (pid {pid}) was never seen stopped (state T)"));
        }
        let running = ev.done_at.first().copied().unwrap_or(1) as f64;
        let moved = stalled_moves(c).await.map_err(|e| e.to_string())? - ev.before;
        if moved < running || !ev.missing.is_empty() {
            return Err(format!(
                "{}; {moved} of its {running} streams moved as stalled; {}",
                ev.notes.join("; "),
                ev.missing.join("; ")
            ));
        }
        Ok(format!("{}; {moved} streams moved as stalled", ev.notes.join("; ")))
    }
}
