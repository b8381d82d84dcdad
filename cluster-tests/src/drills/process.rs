//! Drills that kill, stop or drain worker processes.

use std::time::Duration;

use loadgen::Report;

use super::common::{busy_decoder, decode_metrics, gone, recomputed, serving_becomes, LOAD_WAIT, MEMBERSHIP};
use super::{BoxFuture, Drill, DrillInfo, Evidence, Progress, Setup};
use crate::cluster::{Cluster, ClusterSpec, Role};
use crate::invariants::Invariants;
use crate::process::{proc_state, socket_owner, Signal};
use crate::proxy::Fault;
use crate::{eventually, HarnessError};

/// SIGKILL a decode worker mid-stream.
pub(super) struct DecodeKill;

impl Drill for DecodeKill {
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

/// SIGKILL the prefill worker whose KV push is held mid-transfer; policy recompute.
pub(super) struct PrefillKillRecompute;

impl Drill for PrefillKillRecompute {
    fn info(&self) -> DrillInfo {
        DrillInfo {
            name: "prefill-kill-recompute",
            description: "SIGKILL the prefill worker whose KV push is held mid-transfer on the proxy (policy \
                          recompute): the decode worker recomputes and every answer is identical",
        }
    }

    fn setup(&self, _skip: bool) -> Setup {
        Setup {
            spec: ClusterSpec::default().prefill("g1").prefill("g1").decode_behind_proxy("g1"),
            requests: 6,
            max_tokens: 16,
            concurrency: 2,
            invariants: Invariants { all_complete: true, ..Invariants::default() },
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
            ev.before = recomputed(&m).await?;
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

    fn prove<'a>(&'a self, c: &'a Cluster, ev: &'a Evidence, _: &'a Report) -> BoxFuture<'a, Result<String, String>> {
        Box::pin(async move {
            let (name, pid) = ev.victim.clone().ok_or("no victim was chosen")?;
            if !gone(pid) {
                return Err(format!("prefill worker {name} (pid {pid}) is still running"));
            }
            let m = decode_metrics(c)?;
            let now = recomputed(&m).await.map_err(|e| e.to_string())?;
            if now <= ev.before {
                return Err(format!("pid {pid} is gone but the decode worker recomputed no failed load"));
            }
            Ok(format!("{}; pid {pid} gone; decode recomputed {} loads", ev.notes.join("; "), now - ev.before))
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
            ev.began();
            c.signal(&name, Signal::Stop)?;
            let stopped = eventually("the stopped worker's /proc state is T", Duration::from_secs(5), || async {
                proc_state(pid) == Some('T')
            })
            .await;
            ev.seen = stopped.is_ok();
            ev.notes
                .push(format!("{name} (pid {pid}) was running a request; SIGSTOP: /proc state {:?}", proc_state(pid)));
            // The lease (TTL 2 s) lapses; the coordinator must drop it. Continue it whatever happened.
            let left = serving_becomes(c, Role::Decode, 1.0, Duration::from_secs(15)).await;
            let t = ev.before;
            let now = c.coordinator_metrics().await.map_or(t, |p| p.sum(MEMBERSHIP, &[("change", "left")]));
            ev.notes.push(format!("left membership: serving decode 1: {}; `left` changes {t} -> {now}", left.is_ok()));
            if left.is_err() && now <= t {
                ev.missing.push("the coordinator never saw the stopped worker leave".into());
            }
            c.signal(&name, Signal::Cont)?;
            ev.ended();
            match serving_becomes(c, Role::Decode, 2.0, Duration::from_secs(15)).await {
                Ok(()) => ev.notes.push("after SIGCONT it registered again: 2 decode serving".into()),
                Err(e) => ev.missing.push(format!("after SIGCONT: {e}")),
            }
            Ok(ev)
        })
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
    fn info(&self) -> DrillInfo {
        DrillInfo {
            name: "rolling-drain",
            description: "SIGTERM one decode worker, then one prefill worker, under load while a replacement of \
                          each role serves: every request completes identically and each drained worker exits 0",
        }
    }

    fn setup(&self, _skip: bool) -> Setup {
        Setup {
            spec: ClusterSpec::default().prefill("g1").prefill("g1").decode("g1").decode("g1"),
            requests: 16,
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
            // A decode worker mid-answer first, then a prefill worker; each has a serving twin.
            let decode = busy_decoder(c, LOAD_WAIT).await?;
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
                let under_load = !load.finished();
                ev.began();
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
            if !skip {
                ev.ended();
            }
            Ok(ev)
        })
    }

    fn prove<'a>(&'a self, _: &'a Cluster, ev: &'a Evidence, _: &'a Report) -> BoxFuture<'a, Result<String, String>> {
        Box::pin(async move {
            if ev.drained.len() != 2 || !ev.missing.is_empty() {
                return Err(format!("drained {:?}; {}", ev.drained, ev.missing.join("; ")));
            }
            if let Some((name, pid, code)) = ev.drained.iter().find(|d| d.2 != Some(0)) {
                return Err(format!("{name} (pid {pid}) exited {code:?} after SIGTERM, not 0"));
            }
            Ok(format!("{}; the coordinator counts 1 serving worker of each role", ev.notes.join("; ")))
        })
    }
}
