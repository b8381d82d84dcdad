//! Drills that kill, stop or drain worker processes.

use std::time::Duration;

use loadgen::Report;

use super::common::{
    busy_decoder, counter_reaches, decode_metrics, gone, open_stream, probe, serving_becomes, Stream, LOAD_WAIT,
    MEMBERSHIP,
};
use super::{own_cluster, BoxFuture, Drill, DrillInfo, Evidence, Progress, Setup};
use crate::cluster::{Cluster, ClusterSpec, Role};
use crate::invariants::Invariants;
use crate::process::{proc_state, socket_owner, Signal};
use crate::proxy::Fault;
use crate::{eventually, HarnessError};

/// SIGKILL a decode worker mid-stream.
pub(super) struct DecodeKill;

impl Drill for DecodeKill {
    fn against(&self, _: &Cluster) -> Result<(), String> {
        own_cluster("it SIGKILLs a decode worker; `tandem up` stops the whole cluster when any of its processes exits")
    }

    fn info(&self) -> DrillInfo {
        DrillInfo {
            name: "decode-kill",
            description: "SIGKILL a decode worker while it streams (2 decode workers): its streams end typed \
                          (worker_stream), the rest complete on the other worker",
        }
    }

    fn setup(&self, _skip: bool) -> Setup {
        Setup {
            spec: ClusterSpec::default().prefill("g1").decode("g1").decode("g1"),
            requests: 8,
            max_tokens: 32,
            concurrency: 2,
            invariants: Invariants {
                allowed_errors: Some(vec!["worker_stream".into(), "retryable".into(), "no_worker".into()]),
                ..Invariants::default()
            },
        }
    }

    fn fault<'a>(
        &'a self,
        c: &'a mut Cluster,
        _: &'a Progress,
        skip: bool,
    ) -> BoxFuture<'a, Result<Evidence, HarnessError>> {
        Box::pin(async move {
            let mut ev = Evidence::default();
            // The first decode worker seen running a request is the victim.
            let name = busy_decoder(c, LOAD_WAIT).await?;
            let pid = c.worker(&name)?.proc.pid;
            if !skip {
                ev.began();
                c.signal(&name, Signal::Kill)?;
            }
            ev.notes.push(format!("{name} (pid {pid}) was running a request"));
            ev.victim = Some((name, pid));
            Ok(ev)
        })
    }

    fn prove<'a>(&'a self, _: &'a Cluster, ev: &'a Evidence, _: &'a Report) -> BoxFuture<'a, Result<String, String>> {
        Box::pin(async move {
            let (name, pid) = ev.victim.clone().ok_or("no victim was chosen")?;
            if !gone(pid) {
                return Err(format!("decode worker {name} (pid {pid}) is still running"));
            }
            Ok(format!("{}; pid {pid} is gone from /proc", ev.notes.join("; ")))
        })
    }
}

/// SIGKILL the prefill worker whose KV push is held mid-transfer, under one
/// `kv_load_failure_policy`: `recompute` (the decode worker prefills),
/// `retry` (the other prefill worker pushes again), `fail` (a typed
/// `kv_load_failed` for that request).
pub(super) struct PrefillKill {
    pub policy: &'static str,
}

/// The policy's outcome label on `tandem_kv_load_policy_outcomes_total`.
fn policy_outcome(policy: &str) -> &'static str {
    match policy {
        "retry" => "retried",
        "fail" => "failed",
        _ => "recomputed",
    }
}

async fn policy_outcomes(m: &str, policy: &str) -> Result<f64, HarnessError> {
    Ok(crate::metrics::scrape(m)
        .await?
        .sum("tandem_kv_load_policy_outcomes_total", &[("outcome", policy_outcome(policy))]))
}

impl Drill for PrefillKill {
    fn against(&self, _: &Cluster) -> Result<(), String> {
        own_cluster("it SIGKILLs a prefill worker; `tandem up` stops the whole cluster when any of its processes exits")
    }

    fn info(&self) -> DrillInfo {
        match self.policy {
            "retry" => DrillInfo {
                name: "prefill-kill-retry",
                description: "SIGKILL the prefill worker whose KV push is held mid-transfer on the proxy (policy \
                              retry, 2 prefill workers): the other prefill worker pushes again, every answer identical",
            },
            "fail" => DrillInfo {
                name: "prefill-kill-fail",
                description: "SIGKILL the prefill worker whose KV push is held mid-transfer on the proxy (policy \
                              fail): that request ends with the typed 502 kv_load_failed, the rest are identical",
            },
            _ => DrillInfo {
                name: "prefill-kill-recompute",
                description: "SIGKILL the prefill worker whose KV push is held mid-transfer on the proxy (policy \
                              recompute): the decode worker recomputes and every answer is identical",
            },
        }
    }

    fn setup(&self, _skip: bool) -> Setup {
        let fail = self.policy == "fail";
        Setup {
            spec: ClusterSpec::default().prefill("g1").prefill("g1").decode_behind_proxy("g1").policy(self.policy),
            requests: 6,
            max_tokens: 16,
            concurrency: 2,
            invariants: Invariants {
                all_complete: !fail,
                // Under `fail`, the held request; and one routed to the dead worker before its lease ran out.
                allowed_errors: fail.then(|| vec!["kv_load_failed".into()]),
                ..Invariants::default()
            },
        }
    }

    fn fault<'a>(
        &'a self,
        c: &'a mut Cluster,
        _: &'a Progress,
        skip: bool,
    ) -> BoxFuture<'a, Result<Evidence, HarnessError>> {
        Box::pin(async move {
            let mut ev = Evidence::default();
            let decode = c.workers_of(Role::Decode).next().ok_or_else(|| HarnessError::Setup("no decode".into()))?;
            let proxy = decode.proxy.as_ref().ok_or_else(|| HarnessError::Setup("decode not behind a proxy".into()))?;
            let m = decode.metrics_addr()?;
            ev.before = policy_outcomes(&m, self.policy).await?;
            // 16 KiB into the next push: inside the first layers' frames, long before its Ack.
            proxy.arm(Fault::HoldAfter(16 << 10));
            let prefills: Vec<u32> = c.workers_of(Role::Prefill).map(|w| w.proc.pid).collect();
            let held = tokio::task::block_in_place(|| proxy.wait_held(LOAD_WAIT))?;
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
                ev.began();
                c.signal(&name, Signal::Kill)?;
                let _ = c.worker_mut(&name)?.proc.wait_exit(Duration::from_secs(10)).await;
            }
            if let Some(p) = c.workers_of(Role::Decode).next().and_then(|w| w.proxy.as_ref()) {
                p.release();
            }
            ev.victim = Some((name, pid));
            Ok(ev)
        })
    }

    fn prove<'a>(
        &'a self,
        c: &'a Cluster,
        ev: &'a Evidence,
        report: &'a Report,
    ) -> BoxFuture<'a, Result<String, String>> {
        Box::pin(async move {
            let (name, pid) = ev.victim.clone().ok_or("no victim was chosen")?;
            if !gone(pid) {
                return Err(format!("prefill worker {name} (pid {pid}) is still running"));
            }
            let m = decode_metrics(c)?;
            let outcome = policy_outcome(self.policy);
            let now = policy_outcomes(&m, self.policy).await.map_err(|e| e.to_string())?;
            if now <= ev.before {
                return Err(format!("pid {pid} is gone but the decode worker counted no `{outcome}` failed load"));
            }
            let typed = report
                .records
                .iter()
                .filter(|r| match &r.outcome {
                    loadgen::Outcome::HttpError { code: Some(c), .. }
                    | loadgen::Outcome::StreamError { code: Some(c), .. } => c == "kv_load_failed",
                    _ => false,
                })
                .count();
            if self.policy == "fail" && typed == 0 {
                return Err(format!("policy fail, {outcome} {}, but no request ended kv_load_failed", now - ev.before));
            }
            Ok(format!(
                "{}; pid {pid} gone; the decode worker counted {} `{outcome}`; {typed} request(s) ended kv_load_failed",
                ev.notes.join("; "),
                now - ev.before
            ))
        })
    }
}

/// SIGSTOP a decode worker past its lease, then SIGCONT.
pub(super) struct WorkerSigstop;

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

    fn fault<'a>(
        &'a self,
        c: &'a mut Cluster,
        _: &'a Progress,
        skip: bool,
    ) -> BoxFuture<'a, Result<Evidence, HarnessError>> {
        Box::pin(async move {
            let mut ev = Evidence::default();
            let name = busy_decoder(c, LOAD_WAIT).await?;
            let pid = c.worker(&name)?.proc.pid;
            ev.before = c.coordinator_metrics().await?.sum(MEMBERSHIP, &[("change", "left")]);
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
            ev.began();
            c.signal(&name, Signal::Stop)?;
            let stopped = eventually("the stopped worker's /proc state is T", Duration::from_secs(5), || async {
                proc_state(pid) == Some('T')
            })
            .await;
            ev.seen = stopped.is_ok();
            ev.notes
                .push(format!("{name} (pid {pid}) was running a request; SIGSTOP: /proc state {:?}", proc_state(pid)));
            // The lease (TTL `ttl`) lapses; the coordinator must drop it. Continue it whatever happened.
            let left = serving_becomes(c, Role::Decode, n - 1.0, limit).await;
            let t = ev.before;
            let now = c.coordinator_metrics().await.map_or(t, |p| p.sum(MEMBERSHIP, &[("change", "left")]));
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
        })
    }

    /// Reversible (SIGCONT ends it), so it may run against a running cluster with a second
    /// decode worker to finish the load.
    fn against(&self, c: &Cluster) -> Result<(), String> {
        match c.workers_of(Role::Decode).count() {
            n if n >= 2 => Ok(()),
            n => Err(format!("needs at least 2 decode workers (one to stop, one to serve); the cluster has {n}")),
        }
    }

    fn prove<'a>(&'a self, _: &'a Cluster, ev: &'a Evidence, _: &'a Report) -> BoxFuture<'a, Result<String, String>> {
        Box::pin(async move {
            let (name, pid) = ev.victim.clone().ok_or("no victim was chosen")?;
            if !ev.seen {
                return Err(format!("{name} (pid {pid}) was never seen stopped (state T)"));
            }
            if !ev.missing.is_empty() {
                return Err(format!("{}; but {}", ev.notes.join("; "), ev.missing.join("; ")));
            }
            Ok(ev.notes.join("; "))
        })
    }
}

/// SIGTERM a decode then a prefill worker under load.
pub(super) struct RollingDrain;

impl Drill for RollingDrain {
    fn against(&self, _: &Cluster) -> Result<(), String> {
        own_cluster("it drains and restarts every worker; `tandem up` stops the whole cluster when one exits")
    }

    fn info(&self) -> DrillInfo {
        DrillInfo {
            name: "rolling-drain",
            description: "a rolling restart under load: SIGTERM each of 2 prefill and 2 decode workers in turn, \
                          wait for it to drain and exit 0, start it again, wait until it serves: every request \
                          completes identically",
        }
    }

    fn setup(&self, _skip: bool) -> Setup {
        Setup {
            spec: ClusterSpec::default().prefill("g1").prefill("g1").decode("g1").decode("g1"),
            requests: 40,
            max_tokens: 16,
            concurrency: 2,
            invariants: Invariants { all_complete: true, ..Invariants::default() },
        }
    }

    fn fault<'a>(
        &'a self,
        c: &'a mut Cluster,
        load: &'a Progress,
        skip: bool,
    ) -> BoxFuture<'a, Result<Evidence, HarnessError>> {
        Box::pin(async move {
            let mut ev = Evidence::default();
            load.wait_done(2, LOAD_WAIT).await?;
            // A decode worker mid-answer first, then the other workers; each time its twin serves.
            let first = busy_decoder(c, LOAD_WAIT).await?;
            let mut order = vec![(Role::Decode, first.clone())];
            for w in c.workers.iter().filter(|w| w.proc.name != first) {
                order.push((w.role, w.proc.name.clone()));
            }
            if skip {
                return Ok(ev);
            }
            ev.began();
            for (role, name) in order {
                let (pid, group) = (c.worker(&name)?.proc.pid, c.worker(&name)?.group.clone());
                let under_load = !load.finished();
                // Same group: a drain, then the same flags again.
                match c.relabel_worker(&name, &group, Duration::from_secs(20)).await {
                    Ok((st, took)) => {
                        ev.notes.push(format!(
                            "{name} (pid {pid}) drained in {:.1} s (load running: {under_load}), exited {st}",
                            took.as_secs_f64()
                        ));
                        ev.drained.push((name.clone(), pid, st.code()));
                    }
                    Err(e) => {
                        ev.missing.push(format!("{name}: {e}"));
                        ev.drained.push((name.clone(), pid, None));
                        continue;
                    }
                }
                if let Err(e) = serving_becomes(c, role, 2.0, Duration::from_secs(20)).await {
                    ev.missing.push(format!("after restarting {name}: {e}"));
                }
            }
            ev.ended();
            Ok(ev)
        })
    }

    fn prove<'a>(&'a self, c: &'a Cluster, ev: &'a Evidence, _: &'a Report) -> BoxFuture<'a, Result<String, String>> {
        Box::pin(async move {
            if ev.drained.len() != c.workers.len() || !ev.missing.is_empty() {
                return Err(format!(
                    "drained {} of {} workers: {:?}; {}",
                    ev.drained.len(),
                    c.workers.len(),
                    ev.drained,
                    ev.missing.join("; ")
                ));
            }
            if let Some((name, pid, code)) = ev.drained.iter().find(|d| d.2 != Some(0)) {
                return Err(format!("{name} (pid {pid}) exited {code:?} after SIGTERM, not 0"));
            }
            Ok(format!("{}; each restarted and serving again", ev.notes.join("; ")))
        })
    }
}

/// Cancelled Generate streams the decode worker at `m` counted.
async fn cancelled(m: &str) -> Result<f64, HarnessError> {
    Ok(crate::metrics::scrape(m).await?.sum("tandem_decode_requests_total", &[("outcome", "cancelled")]))
}

/// How a raw SSE stream ended: `Ok(None)` complete (`[DONE]` or a finish reason), `Ok(Some(code))`
/// a typed error event, `Err` it ended with neither (EOF or a failed read).
async fn stream_end(s: &mut Stream) -> Result<Option<String>, String> {
    let mut finished = false;
    loop {
        match s.line().await {
            Ok(Some(l)) => {
                let Some(data) = l.trim().strip_prefix("data:").map(str::trim) else { continue };
                if data == "[DONE]" {
                    return if finished { Ok(None) } else { Err("[DONE] without a finish reason".into()) };
                }
                let Ok(v) = serde_json::from_str::<serde_json::Value>(data) else { continue };
                if let Some(e) = v.get("error") {
                    let code = e.get("code").and_then(|c| c.as_str()).unwrap_or("(no code)");
                    return Ok(Some(code.to_owned()));
                }
                if v.pointer("/choices/0/finish_reason").is_some_and(|f| !f.is_null()) {
                    finished = true;
                }
            }
            Ok(None) if finished => return Ok(None),
            Ok(None) => return Err("the connection ended without a finish reason or an error".into()),
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// SIGKILL one of two coordinators mid-stream, then restart it.
pub(super) struct CoordinatorKill;

impl Drill for CoordinatorKill {
    fn against(&self, _: &Cluster) -> Result<(), String> {
        own_cluster("it SIGKILLs a coordinator (of several behind a front); `tandem up` stops the whole cluster when any of its processes exits")
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
        }
    }

    fn fault<'a>(
        &'a self,
        c: &'a mut Cluster,
        load: &'a Progress,
        skip: bool,
    ) -> BoxFuture<'a, Result<Evidence, HarnessError>> {
        Box::pin(async move {
            let mut ev = Evidence::default();
            let a = c.coordinator.addr("http")?;
            let pid = c.coordinator.pid;
            let m = decode_metrics(c).map_err(HarnessError::Setup)?;
            ev.before = cancelled(&m).await?;
            // A client of A mid-stream for sure (a long answer), besides the load's own.
            let mut long = open_stream(&a, 0).await?;
            long.first_data().await?;
            let a_busy = eventually("coordinator A runs a load request besides the long stream", LOAD_WAIT, || {
                let a = a.clone();
                async move {
                    crate::metrics::scrape(&a).await.is_ok_and(|p| p.sum("tandem_coordinator_running", &[]) >= 2.0)
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
            let (r, now) = counter_reaches(
                &m,
                "tandem_decode_requests_total",
                &[("outcome", "cancelled")],
                ev.before + 1.0,
                Duration::from_secs(20),
            )
            .await;
            match r {
                Ok(()) => ev.notes.push(format!("decode-0 cancelled {} orphaned stream(s)", now - ev.before)),
                Err(e) => ev.missing.push(format!("the decode worker cancelled none of A's streams: {e}")),
            }
            // Restart A once the load is done (behind the front, a coordinator that has not yet
            // listed membership would answer no_worker), with the very same flags.
            eventually("the load finishes", LOAD_WAIT * 2, || async { load.finished() }).await?;
            let new_pid = c.restart("coordinator", None).await?;
            c.wait_coordinator_ready(&c.coordinator).await?;
            ev.ended();
            let (status, _) = probe(&a).await?;
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
                ev.seen = k.refused.first().is_some_and(|&n| n > 0) && to_b_now > to_b;
            }
            Ok(ev)
        })
    }

    fn prove<'a>(
        &'a self,
        c: &'a Cluster,
        ev: &'a Evidence,
        report: &'a Report,
    ) -> BoxFuture<'a, Result<String, String>> {
        Box::pin(async move {
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
        })
    }
}

/// Drain g2's decode worker and start it again in g1.
pub(super) struct VersionRelabel;

/// `tandem_kv_transfer_bytes_total` of worker `name` (0 if unreadable).
async fn sent_bytes(c: &Cluster, name: &str) -> f64 {
    c.worker_metrics(name).await.map_or(0.0, |p| p.sum("tandem_kv_transfer_bytes_total", &[]))
}

/// The version group decode worker `name` is registered under in the cluster's etcd membership.
async fn registered_group(c: &Cluster, name: &str) -> Result<String, HarnessError> {
    let config = registry::MembershipConfig::new(registry::EtcdConfig::new(c.etcd.endpoints()), c.prefix.clone());
    let m = registry::Membership::start(config).await.map_err(|e| HarnessError::Fault(format!("membership: {e}")))?;
    let view =
        m.wait_synced(Duration::from_secs(10)).await.map_err(|e| HarnessError::Fault(format!("membership: {e}")));
    m.stop().await;
    let view = view?;
    view.get(registry::Role::Decode, name)
        .map(|w| w.version_group.clone())
        .ok_or_else(|| HarnessError::Fault(format!("{name} is not registered")))
}

impl Drill for VersionRelabel {
    fn against(&self, _: &Cluster) -> Result<(), String> {
        own_cluster("it drains a worker and restarts it in another version group")
    }

    fn info(&self) -> DrillInfo {
        DrillInfo {
            name: "version-relabel",
            description: "Two version groups g1/g2 (prefill+decode each): under load, SIGTERM g2's decode worker and \
                          start it again with --version-group g1: every request completes identically, it leaves and \
                          rejoins membership, and its KV comes only from g1's prefill worker (G3 per group)",
        }
    }

    fn setup(&self, _skip: bool) -> Setup {
        Setup {
            // prefill-0 g1, prefill-1 g2, decode-0 g1, decode-1 g2.
            spec: ClusterSpec::default().prefill("g1").prefill("g2").decode("g1").decode("g2"),
            requests: 12,
            max_tokens: 16,
            concurrency: 2,
            invariants: Invariants { all_complete: true, transfers_intact: true, ..Invariants::default() },
        }
    }

    fn fault<'a>(
        &'a self,
        c: &'a mut Cluster,
        load: &'a Progress,
        skip: bool,
    ) -> BoxFuture<'a, Result<Evidence, HarnessError>> {
        Box::pin(async move {
            let mut ev = Evidence::default();
            let name = "decode-1";
            if c.worker(name)?.group != "g2" {
                return Err(HarnessError::Setup(format!("{name} is not in g2")));
            }
            load.wait_done(2, LOAD_WAIT).await?;
            let h = c.http_addr()?;
            let cm = c.coordinator_metrics().await?;
            let (left0, joined0) =
                (cm.sum(MEMBERSHIP, &[("change", "left")]), cm.sum(MEMBERSHIP, &[("change", "joined")]));
            let pid = c.worker(name)?.proc.pid;
            ev.victim = Some((name.into(), pid));
            if skip {
                return Ok(ev);
            }
            ev.began();
            let (status, took) = c.relabel_worker(name, "g1", Duration::from_secs(30)).await?;
            let new_pid = c.worker(name)?.proc.pid;
            ev.drained.push((name.into(), pid, status.code()));
            ev.notes.push(format!(
                "{name} (pid {pid}, g2) drained in {took:?} and exited {status}; started again as pid {new_pid} in g1"
            ));
            // Both changes seen by the coordinator: it left (g2) and joined again (g1).
            for (change, was) in [("left", left0), ("joined", joined0)] {
                let (r, now) =
                    counter_reaches(&h, MEMBERSHIP, &[("change", change)], was + 1.0, Duration::from_secs(20)).await;
                match r {
                    Ok(()) => ev.notes.push(format!("membership `{change}` {} -> {now}", was + 0.0)),
                    Err(e) => ev.missing.push(e.to_string()),
                }
            }
            if let Err(e) = serving_becomes(c, Role::Decode, 2.0, Duration::from_secs(20)).await {
                ev.missing.push(e.to_string());
            }
            // The membership the coordinator routes from, read the same way: its entry is in g1 now.
            match registered_group(c, name).await {
                Ok(g) if g == "g1" => ev.notes.push(format!("etcd membership lists {name} in {g}")),
                Ok(g) => ev.missing.push(format!("etcd membership lists {name} in {g}, not g1")),
                Err(e) => ev.missing.push(format!("reading membership: {e}")),
            }
            let g2_sent = sent_bytes(c, "prefill-1").await;
            // It must now take work; if the load has ended, a few probes through the coordinator.
            let m = c.worker(name)?.metrics_addr()?;
            let got = eventually(&format!("{name} receives KV in g1"), Duration::from_secs(30), || {
                let (m, h) = (m.clone(), h.clone());
                async move {
                    let got =
                        crate::metrics::scrape(&m).await.map_or(0.0, |p| p.sum("tandem_kv_received_bytes_total", &[]));
                    if got > 0.0 {
                        return true;
                    }
                    let _ = probe(&h).await;
                    false
                }
            })
            .await;
            if let Err(e) = got {
                ev.missing.push(e.to_string());
            }
            ev.ended();
            ev.before = g2_sent;
            Ok(ev)
        })
    }

    fn prove<'a>(&'a self, c: &'a Cluster, ev: &'a Evidence, _: &'a Report) -> BoxFuture<'a, Result<String, String>> {
        Box::pin(async move {
            let (name, pid) = ev.victim.clone().ok_or("no victim was chosen")?;
            let w = c.worker(&name).map_err(|e| e.to_string())?;
            if w.group != "g1" || w.past.is_empty() {
                return Err(format!(
                    "{name} (pid {pid}) was never relabelled: it is still pid {} in {}",
                    w.proc.pid, w.group
                ));
            }
            if !ev.missing.is_empty() {
                return Err(format!("{}; but {}", ev.notes.join("; "), ev.missing.join("; ")));
            }
            if let Some(d) = ev.drained.iter().find(|d| d.2 != Some(0)) {
                return Err(format!("{} (pid {}) exited {:?} after SIGTERM, not 0", d.0, d.1, d.2));
            }
            let page = c.worker_metrics(&name).await.map_err(|e| e.to_string())?;
            let got = page.sum("tandem_kv_received_bytes_total", &[]);
            let rejected = page.sum("tandem_kv_handshakes_rejected_total", &[]);
            let g1_sent = sent_bytes(c, "prefill-0").await;
            let g2_sent = sent_bytes(c, "prefill-1").await;
            if rejected > 0.0 || g2_sent != ev.before || got > g1_sent {
                return Err(format!(
                    "{name} in g1 received {got} bytes, refused {rejected} handshakes; g1's prefill sent {g1_sent}, \
                     g2's prefill sent {} after the relabel",
                    g2_sent - ev.before
                ));
            }
            Ok(format!(
                "{}; in g1 it received {got} KV bytes (g1's prefill sent {g1_sent} in all), refused no handshake; g2's \
                 prefill sent nothing after the relabel",
                ev.notes.join("; ")
            ))
        })
    }
}

/// SIGTERM a decode worker whose grace is far shorter than its longest request.
pub(super) struct DrainGraceShort;

/// `--shutdown-timeout-ms` of the busy worker in [`DrainGraceShort`].
const SHORT_GRACE: Duration = Duration::from_millis(1000);
/// How long past the grace its exit may take (runner join, deregistration, a loaded machine).
const EXIT_SLACK: Duration = Duration::from_secs(5);
/// The load's concurrency in [`DrainGraceShort`].
const LONG_STREAM_LOAD: usize = 2;

impl Drill for DrainGraceShort {
    fn against(&self, _: &Cluster) -> Result<(), String> {
        own_cluster("it drains (SIGTERM) a worker with a short grace, which exits; `tandem up` stops the whole cluster when any of its processes exits")
    }

    fn info(&self) -> DrillInfo {
        DrillInfo {
            name: "drain-grace-short",
            description: "SIGTERM a decode worker with --shutdown-timeout-ms 1000 while it streams 400-token answers \
                          (2 decode workers): it finishes what it can, ends the rest with a typed error, and exits 0 \
                          within the grace plus slack",
        }
    }

    fn setup(&self, _skip: bool) -> Setup {
        let grace = SHORT_GRACE.as_millis().to_string();
        Setup {
            spec: ClusterSpec::default()
                .prefill("g1")
                .decode_with("g1", &["--shutdown-timeout-ms", &grace])
                .decode("g1"),
            requests: 10,
            max_tokens: 24,
            concurrency: LONG_STREAM_LOAD,
            invariants: Invariants { allowed_errors: Some(vec!["retryable".into()]), ..Invariants::default() },
        }
    }

    fn fault<'a>(
        &'a self,
        c: &'a mut Cluster,
        load: &'a Progress,
        skip: bool,
    ) -> BoxFuture<'a, Result<Evidence, HarnessError>> {
        Box::pin(async move {
            let mut ev = Evidence::default();
            let name = "decode-0";
            let h = c.http_addr()?;
            load.wait_done(1, LOAD_WAIT).await?;
            // Long answers (400 tokens, ignore_eos), spread by the router over both workers, until
            // the victim runs more requests than the load's concurrency: then at least one of
            // them is a long one.
            let m = c.worker(name)?.metrics_addr()?;
            let (mut streams, mut running) = (Vec::new(), 0.0);
            for i in 0..6 {
                let mut s = open_stream(&h, i).await?;
                s.first_data().await?;
                streams.push(s);
                let want = LONG_STREAM_LOAD as f64 + 1.0;
                let enough;
                (enough, running) =
                    counter_reaches(&m, "tandem_num_requests_running", &[], want, Duration::from_secs(2)).await;
                if enough.is_ok() {
                    break;
                }
            }
            let pid = c.worker(name)?.proc.pid;
            ev.victim = Some((name.into(), pid));
            ev.notes.push(format!(
                "{name} (pid {pid}, grace {SHORT_GRACE:?}) running {running} request(s) ({} long streams open)",
                streams.len()
            ));
            if skip {
                return Ok(ev);
            }
            ev.began();
            let t0 = std::time::Instant::now();
            c.signal(name, Signal::Term)?;
            // The long streams end as they end; read them while the worker drains.
            let mut ends = tokio::task::JoinSet::new();
            for (i, mut s) in streams.into_iter().enumerate() {
                ends.spawn(async move { (i, stream_end(&mut s).await) });
            }
            let exit = c.worker_mut(name)?.proc.wait_exit(SHORT_GRACE + EXIT_SLACK + Duration::from_secs(20)).await;
            let took = t0.elapsed();
            match exit {
                Ok(st) => {
                    ev.drained.push((name.into(), pid, st.code()));
                    ev.notes.push(format!("exited {st} {took:?} after SIGTERM"));
                    if took > SHORT_GRACE + EXIT_SLACK {
                        ev.missing
                            .push(format!("it took {took:?} to exit, past grace {SHORT_GRACE:?} + {EXIT_SLACK:?}"));
                    }
                }
                Err(e) => ev.missing.push(e.to_string()),
            }
            ev.ended();
            // The drained worker's streams ended (typed) by its exit; the others go on for their
            // 400 tokens: 3 s more for the relay, then those are hung up on (their worker cancels them).
            let until = tokio::time::Instant::now() + Duration::from_secs(3);
            let mut typed = Vec::new();
            while let Ok(Some(Ok((i, end)))) = tokio::time::timeout_at(until, ends.join_next()).await {
                match end {
                    Ok(Some(code)) => typed.push(format!("stream {i}: {code}")),
                    Ok(None) => ev.notes.push(format!("long stream {i} completed")),
                    Err(e) => ev.missing.push(format!("long stream {i} ended untyped: {e}")),
                }
            }
            ends.abort_all();
            ev.seen = !typed.is_empty();
            ev.notes.push(format!("long streams ended typed: {typed:?}"));
            Ok(ev)
        })
    }

    fn prove<'a>(&'a self, _: &'a Cluster, ev: &'a Evidence, _: &'a Report) -> BoxFuture<'a, Result<String, String>> {
        Box::pin(async move {
            let (name, pid) = ev.victim.clone().ok_or("no victim was chosen")?;
            let Some((_, _, code)) = ev.drained.first() else {
                return Err(format!("{name} (pid {pid}) was never drained: {}", ev.notes.join("; ")));
            };
            if !ev.missing.is_empty() {
                return Err(format!("{}; but {}", ev.notes.join("; "), ev.missing.join("; ")));
            }
            if *code != Some(0) {
                return Err(format!("{name} (pid {pid}) exited {code:?} after SIGTERM, not 0"));
            }
            if !ev.seen {
                return Err(format!("{}; but no long stream ended with a typed drain error", ev.notes.join("; ")));
            }
            Ok(ev.notes.join("; "))
        })
    }
}
