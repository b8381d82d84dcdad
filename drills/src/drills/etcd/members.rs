//! Drills on the etcd members themselves: a restart, the leader's death, the loss of
//! quorum in a three-member cluster, and every member stopped for a while.

use super::*;

/// Restart etcd under load with two version groups.
pub(in crate::drills) struct EtcdRestart;

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
pub(in crate::drills) struct EtcdLeaderKill;

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
pub(in crate::drills) struct EtcdQuorumLoss;

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
/// SIGSTOP the only etcd for 8 s under load.
pub(in crate::drills) struct EtcdStall;

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
