//! SIGKILL of a worker mid-request: a decode worker, and a prefill worker under each
//! `kv_load_failure_policy` (recompute, retry, fail).

use loadgen::Report;
use std::time::Duration;

use crate::cluster::{Cluster, ClusterSpec, Role};
use crate::drills::common::{await_supervisor, decode_metrics, gone, LOAD_WAIT};
use crate::drills::{
    all_of, at_least, own_cluster, supervisor_restarts, Drill, DrillInfo, Evidence, Exit, Progress, Setup,
};
use crate::invariants::Invariants;
use crate::process::{signal, socket_owner, Signal};
use crate::proxy::Fault;
use crate::HarnessError;

/// SIGKILL a decode worker mid-stream: with request migration, its streams move to
/// the other decode worker and every request completes with its undisturbed answer.
/// `sampled`: eight long streams, half of them sampled (seeded), and the victim is the
/// worker running the most of them.
pub(in crate::drills) struct DecodeKill {
    pub sampled: bool,
}

/// The coordinator's moves of running requests with `reason` that succeeded, plus the
/// routes taken again before a first token (a request killed while prefilling).
async fn moved(c: &Cluster, reason: &str) -> Result<f64, HarnessError> {
    use facts::metrics::coordinator::{DECODE_REROUTES, MIGRATIONS};
    let p = c.coordinator_metrics().await?;
    Ok(p.get(MIGRATIONS, &[("reason", reason), ("outcome", "ok")])? + p.sum(DECODE_REROUTES, &[])?)
}

/// The sampled load of the migration drills: eight requests at once, 200 tokens each
/// (ignore_eos), every second one sampled at temperature 0.8 / top-p 0.95 with its own seed.
pub(in crate::drills) fn migration_load(invariants: Invariants) -> Setup {
    Setup {
        spec: ClusterSpec::default().prefill("g1").decode("g1").decode("g1"),
        requests: 8,
        max_tokens: 200,
        concurrency: 8,
        invariants,
        sampled: Some(loadgen::Sampled { every: 2, temperature: 0.8, top_p: 0.95, seed: 1000 }),
    }
}

#[async_trait::async_trait]
impl Drill for DecodeKill {
    /// Against a supervised cluster: the supervisor starts the victim again, and the drill
    /// waits for that before it judges.
    fn against(&self, c: &Cluster) -> Result<(), String> {
        at_least(c, Role::Decode, 2, "one to kill, one to take its streams")?;
        supervisor_restarts(c, Exit::Killed)
    }

    fn info(&self) -> DrillInfo {
        if self.sampled {
            return DrillInfo {
                name: "decode-kill-sampled",
                description: "SIGKILL the decode worker running most of eight 200-token streams (half sampled, \
                              seeded; 2 decode workers): every stream moves to the other worker and completes \
                              with no error and exactly its undisturbed answer",
            };
        }
        DrillInfo {
            name: "decode-kill",
            description: "SIGKILL a decode worker while it streams (2 decode workers): its streams move to the \
                          other worker (request migration); every request completes, no error reaches a client",
        }
    }

    fn setup(&self, _skip: bool) -> Setup {
        let invariants = Invariants { all_complete: true, ..Invariants::default() };
        if self.sampled {
            return migration_load(invariants);
        }
        Setup {
            sampled: None,
            spec: ClusterSpec::default().prefill("g1").decode("g1").decode("g1"),
            requests: 8,
            max_tokens: 32,
            concurrency: 2,
            invariants,
        }
    }

    async fn fault(&self, c: &mut Cluster, _: &Progress, skip: bool) -> Result<Evidence, HarnessError> {
        let mut ev = Evidence::default();
        // The victim: the worker running the most requests (at least 3 of the eight for
        // the sampled load, so streams really move; 1 for the plain one).
        let least = if self.sampled { 3.0 } else { 1.0 };
        let (name, running) = busiest_decoder(c, least, LOAD_WAIT).await?;
        let pid = c.worker(&name)?.proc.pid;
        ev.before = moved(c, "worker_lost").await?;
        ev.notes.push(format!("{name} (pid {pid}) was running {running} requests"));
        ev.victim = Some((name.clone(), pid));
        ev.done_at.push(running as usize);
        if !skip {
            ev.began();
            c.signal(&name, Signal::Kill)?;
            await_supervisor(c, &name, pid, &mut ev).await;
        }
        Ok(ev)
    }

    async fn prove(&self, c: &Cluster, ev: &Evidence, _: &Report) -> Result<String, String> {
        let (name, pid) = ev.victim.clone().ok_or("no victim was chosen")?;
        if !gone(pid) {
            return Err(format!("decode worker {name} (pid {pid}) is still running"));
        }
        if !ev.missing.is_empty() {
            return Err(format!("{}; pid {pid} is gone, but {}", ev.notes.join("; "), ev.missing.join("; ")));
        }
        let running = ev.done_at.first().copied().unwrap_or(1) as f64;
        let now = moved(c, "worker_lost").await.map_err(|e| e.to_string())?;
        if now - ev.before < running {
            return Err(format!(
                "{}; pid {pid} is gone, but the coordinator moved {} requests of the {running} it ran",
                ev.notes.join("; "),
                now - ev.before
            ));
        }
        Ok(format!("{}; pid {pid} is gone from /proc; {} requests moved", ev.notes.join("; "), now - ev.before))
    }
}

/// Waits until a decode worker runs at least `least` requests; the one running the most,
/// with how many.
pub(in crate::drills) async fn busiest_decoder(
    c: &Cluster,
    least: f64,
    limit: Duration,
) -> Result<(String, f64), HarnessError> {
    use facts::metrics::worker::REQUESTS_RUNNING;
    let decoders: Vec<(String, String)> = c
        .workers_of(Role::Decode)
        .map(|w| Ok((w.proc.name.clone(), w.metrics_addr()?)))
        .collect::<Result<_, HarnessError>>()?;
    opskit::poll(&format!("a decode worker runs {least} requests"), limit, || {
        let decoders = &decoders;
        async move {
            let mut best: Option<(String, f64)> = None;
            for (name, m) in decoders {
                let n = crate::metrics::scrape(m).await?.get(REQUESTS_RUNNING, &[])?;
                if best.as_ref().is_none_or(|(_, b)| n > *b) {
                    best = Some((name.clone(), n));
                }
            }
            Ok::<_, HarnessError>(best.filter(|(_, n)| *n >= least))
        }
    })
    .await
    .map_err(HarnessError::from)
}

/// SIGKILL the prefill worker whose KV push is held mid-transfer, under one
/// `kv_load_failure_policy`: `recompute` (the decode worker prefills),
/// `retry` (the other prefill worker pushes again), `fail` (a typed
/// `kv_load_failed` for that request).
pub(in crate::drills) struct PrefillKill {
    pub policy: &'static str,
    /// Bytes of the KV push the proxy lets through before it holds the rest: 0 kills the
    /// prefill worker before any KV (not even its Hello) reached the decode worker.
    pub hold_at: usize,
    /// KV over ucx (one-sided writes, no stream a proxy can hold): the push is held by
    /// stopping its sender once the decode worker granted it a landing range or its
    /// pool blocks.
    pub ucx: bool,
}

/// Attempts at stopping a ucx sender mid-transfer (each on a later request of the load).
const UCX_HOLD_TRIES: usize = 8;

/// Holds a ucx KV push mid-transfer: waits until the decode worker (`m`) has a transfer
/// granted (a landing range or its pool blocks) while exactly one prefill worker has a
/// Prefill in flight (received, not yet answered; the load runs one request at a time),
/// SIGSTOPs that worker, and keeps it stopped only if its grant still stands and no
/// transfer completed meanwhile (else it continues it and waits for the next request).
/// Returns the stopped worker's name and pid.
async fn hold_ucx_push(c: &Cluster, m: &str) -> Result<(String, u32), HarnessError> {
    use facts::metrics::decode::{KV_TRANSFERS_COMPLETED, UCX_GRANTED_TRANSFERS};
    use facts::metrics::prefill::PREFILL_REQUESTS;
    use facts::metrics::worker::REQUESTS_BY_PRIORITY;
    let prefills: Vec<(String, u32, String)> = c
        .workers_of(Role::Prefill)
        .map(|w| Ok((w.proc.name.clone(), w.proc.pid, w.metrics_addr()?)))
        .collect::<Result<_, HarnessError>>()?;
    let mut seen = Vec::new();
    for _ in 0..UCX_HOLD_TRIES {
        let sender = opskit::poll("a prefill worker mid-way through a ucx KV push", LOAD_WAIT, || async {
            let d = crate::metrics::scrape(m).await?;
            if d.get(UCX_GRANTED_TRANSFERS, &[])? == 0.0 {
                return Ok(None);
            }
            let done = d.get(KV_TRANSFERS_COMPLETED, &[])?;
            let mut holding = Vec::new();
            for (name, pid, pm) in &prefills {
                let p = crate::metrics::scrape(pm).await?;
                if p.sum(REQUESTS_BY_PRIORITY, &[])? > p.sum(PREFILL_REQUESTS, &[])? {
                    holding.push((name.clone(), *pid));
                }
            }
            Ok::<_, HarnessError>((holding.len() == 1).then(|| (holding.remove(0), done)))
        })
        .await?;
        let ((name, pid), done) = sender;
        signal(pid, Signal::Stop)?;
        let d = crate::metrics::scrape(m).await?;
        let (granted, now) = (d.get(UCX_GRANTED_TRANSFERS, &[])?, d.get(KV_TRANSFERS_COMPLETED, &[])?);
        if granted > 0.0 && now == done {
            return Ok((name, pid));
        }
        seen.push(format!("{name} had finished its push when it stopped"));
        signal(pid, Signal::Cont)?;
    }
    Err(HarnessError::Fault(format!("no ucx KV push was stopped mid-way: {}", seen.join("; "))))
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
    // Exported at 0 from the start; the proof needs it to rise.
    let outcomes = facts::metrics::decode::POLICY_OUTCOMES;
    Ok(crate::metrics::scrape(m).await?.sum(outcomes, &[("outcome", policy_outcome(policy))])?)
}

#[async_trait::async_trait]
impl Drill for PrefillKill {
    /// Against a supervised cluster with its workers in namespaces: the drill's proxy goes on
    /// the first decode worker's KV link, the victim's supervisor starts it again.
    fn against(&self, c: &Cluster) -> Result<(), String> {
        if self.ucx {
            return own_cluster(
                "over ucx it stops the prefill worker holding a grant, and picks it by the decode worker's \
                 grant counter, which a shared cluster's other traffic moves",
            );
        }
        all_of([
            at_least(c, Role::Prefill, 2, "one to kill, one to push again"),
            crate::drills::kv::kv_proxy_against(c, Some(self.policy), false),
            supervisor_restarts(c, Exit::Killed),
        ])
    }

    fn info(&self) -> DrillInfo {
        if self.ucx {
            return match self.policy {
                "retry" => DrillInfo {
                    name: "prefill-kill-retry-ucx",
                    description: "KV over ucx (policy retry, 2 prefill workers): SIGKILL the prefill worker stopped \
                                  while it holds a grant of the decode worker (its pool blocks on one host); the \
                                  other pushes again, every answer identical, the dead sender's blocks freed",
                },
                "fail" => DrillInfo {
                    name: "prefill-kill-fail-ucx",
                    description: "KV over ucx (policy fail): SIGKILL the prefill worker stopped while it holds a \
                                  grant of the decode worker (its pool blocks on one host); that request ends with \
                                  the typed 502 kv_load_failed, the rest are identical",
                },
                _ => DrillInfo {
                    name: "prefill-kill-recompute-ucx",
                    description: "KV over ucx (policy recompute): SIGKILL the prefill worker stopped while it \
                                  holds a grant of the decode worker (its pool blocks on one host); the decode worker \
                                  recomputes, every answer identical",
                },
            };
        }
        if self.hold_at == 0 {
            return DrillInfo {
                name: "prefill-kill-before-kv",
                description: "SIGKILL the prefill worker whose KV push is held on the proxy before its first byte \
                              (policy recompute): the decode worker, which received nothing, recomputes and every \
                              answer is identical",
            };
        }
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
        let spec = ClusterSpec::default().prefill("g1").prefill("g1").policy(self.policy);
        Setup {
            sampled: None,
            spec: if self.ucx { spec.decode("g1").kv_transport("ucx") } else { spec.decode_behind_proxy("g1") },
            requests: 6,
            max_tokens: 16,
            // Over ucx one request at a time: the one prefill worker holding KV is the sender.
            concurrency: if self.ucx { 1 } else { 2 },
            invariants: Invariants {
                all_complete: !fail,
                // Under `fail`, the held request; and one routed to the dead worker before its lease ran out.
                allowed_errors: fail.then(|| vec!["kv_load_failed".into()]),
                ..Invariants::default()
            },
        }
    }

    async fn fault(&self, c: &mut Cluster, _: &Progress, skip: bool) -> Result<Evidence, HarnessError> {
        let mut ev = Evidence::default();
        let decode = crate::drills::kv::decode_worker(c)?;
        let m = decode.metrics_addr()?;
        ev.before = policy_outcomes(&m, self.policy).await?;
        if self.ucx {
            let (name, pid) = hold_ucx_push(c, &m).await?;
            ev.notes.push(format!("{name} (pid {pid}) was stopped while it held a grant of the decode worker"));
            if !skip {
                ev.began();
                c.signal(&name, Signal::Kill)?;
                let _ = c.worker_mut(&name)?.proc.wait_exit(Duration::from_secs(10)).await;
            } else {
                signal(pid, Signal::Cont)?;
            }
            ev.victim = Some((name, pid));
            return Ok(ev);
        }
        let proxy = decode.proxy.as_ref().ok_or_else(|| HarnessError::Setup("decode not behind a proxy".into()))?;
        // By default 16 KiB into the next push: inside the first layers' frames, long
        // before its Ack.
        proxy.arm(Fault::HoldAfter(self.hold_at));
        let prefills: Vec<u32> = c.workers_of(Role::Prefill).map(|w| w.proc.pid).collect();
        let held = tokio::task::block_in_place(|| proxy.wait_held(LOAD_WAIT))?;
        let pid = socket_owner(held, &prefills)
            .ok_or_else(|| HarnessError::Fault(format!("no prefill worker owns the held connection from {held}")))?;
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
        if let Some(p) = c.workers_of(Role::Decode).find_map(|w| w.proxy.as_ref()) {
            p.release();
        }
        if !skip {
            await_supervisor(c, &name, pid, &mut ev).await;
        }
        ev.victim = Some((name, pid));
        Ok(ev)
    }

    async fn prove(&self, c: &Cluster, ev: &Evidence, report: &Report) -> Result<String, String> {
        let (name, pid) = ev.victim.clone().ok_or("no victim was chosen")?;
        if !gone(pid) {
            return Err(format!("prefill worker {name} (pid {pid}) is still running"));
        }
        if !ev.missing.is_empty() {
            return Err(format!("{}; pid {pid} is gone, but {}", ev.notes.join("; "), ev.missing.join("; ")));
        }
        // The struck decode worker's (ucx: the only one), not a survivor's.
        let (decode, m) = match self.ucx {
            true => ("the decode worker".to_owned(), decode_metrics(c)?),
            false => {
                let w = crate::drills::kv::decode_worker(c).map_err(|e| e.to_string())?;
                (w.proc.name.clone(), w.metrics_addr().map_err(|e| e.to_string())?)
            }
        };
        let outcome = policy_outcome(self.policy);
        let now = policy_outcomes(&m, self.policy).await.map_err(|e| e.to_string())?;
        if now <= ev.before {
            return Err(format!("pid {pid} is gone but {decode} counted no `{outcome}` failed load"));
        }
        let typed = report.records.iter().filter(|r| r.outcome.error_code() == Some("kv_load_failed")).count();
        if self.policy == "fail" && typed == 0 {
            return Err(format!("policy fail, {outcome} {}, but no request ended kv_load_failed", now - ev.before));
        }
        Ok(format!(
            "{}; pid {pid} gone; {decode} counted {} `{outcome}`; {typed} request(s) ended kv_load_failed",
            ev.notes.join("; "),
            now - ev.before
        ))
    }
}
