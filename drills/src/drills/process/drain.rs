//! Draining (SIGTERM) workers under load: rolling restarts of every worker, moving a
//! worker to another version group, and a grace far shorter than the longest request.

use loadgen::Report;
use std::time::Duration;

use super::stream_end;
use crate::cluster::{Cluster, ClusterSpec, Role};
use crate::drills::common::{
    busy_decoder, counter_reaches, open_stream, probe, serving_becomes, LOAD_WAIT, MEMBERSHIP,
};
use crate::drills::{
    all_of, at_least, own_cluster, supervisor_restarts, Drill, DrillInfo, Evidence, Exit, Progress, Setup,
};
use crate::invariants::{kv_moved, Invariants};
use crate::process::Signal;
use crate::{eventually, HarnessError};

/// SIGTERM a decode then a prefill worker under load.
pub(in crate::drills) struct RollingDrain;

#[async_trait::async_trait]
impl Drill for RollingDrain {
    /// Against a supervised cluster the supervisor starts each drained worker again (only
    /// under `--restart always`: a drained worker exits 0), on the same flags and group.
    fn against(&self, c: &Cluster) -> Result<(), String> {
        let why = "one drains while its twin serves, so every request completes";
        all_of([
            supervisor_restarts(c, Exit::Drained),
            at_least(c, Role::Prefill, 2, why),
            at_least(c, Role::Decode, 2, why),
        ])
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
            sampled: None,
        }
    }

    async fn fault(&self, c: &mut Cluster, load: &Progress, skip: bool) -> Result<Evidence, HarnessError> {
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
            let n = c.workers_of(role).count() as f64;
            if let Err(e) = serving_becomes(c, role, n, Duration::from_secs(20)).await {
                ev.missing.push(format!("after restarting {name}: {e}"));
            }
        }
        ev.ended();
        Ok(ev)
    }

    async fn prove(&self, c: &Cluster, ev: &Evidence, _: &Report) -> Result<String, String> {
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
    }
}

/// Drain g2's decode worker and start it again in g1.
pub(in crate::drills) struct VersionRelabel {
    /// Decode workers receive KV over ucx.
    pub ucx: bool,
}

/// KV bytes prefill worker `name` sent in completed transfers; an error when its page cannot
/// be read or lacks the series.
async fn sent_bytes(c: &Cluster, name: &str) -> Result<f64, String> {
    let page = c.worker_metrics(name).await.map_err(|e| e.to_string())?;
    kv_moved(Role::Prefill, &page).map_err(|e| format!("{name}: {e}"))
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

#[async_trait::async_trait]
impl Drill for VersionRelabel {
    fn against(&self, _: &Cluster) -> Result<(), String> {
        own_cluster(
            "it starts a drained worker again in another version group (g2 to g1); a running cluster's \
             supervisor restarts a worker with the flags it chose, in the same group",
        )
    }

    fn info(&self) -> DrillInfo {
        if self.ucx {
            return DrillInfo {
                name: "version-relabel-ucx",
                description: "version-relabel with KV over ucx: g2's decode worker, drained and started again in g1, \
                              takes KV only from g1's prefill worker over ucx; every request completes identically",
            };
        }
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
            spec: {
                let spec = ClusterSpec::default().prefill("g1").prefill("g2").decode("g1").decode("g2");
                if self.ucx {
                    spec.kv_transport("ucx")
                } else {
                    spec
                }
            },
            requests: 12,
            max_tokens: 16,
            concurrency: 2,
            invariants: Invariants { all_complete: true, transfers_intact: true, ..Invariants::default() },
            sampled: None,
        }
    }

    async fn fault(&self, c: &mut Cluster, load: &Progress, skip: bool) -> Result<Evidence, HarnessError> {
        let mut ev = Evidence::default();
        let name = "decode-1";
        if c.worker(name)?.group != "g2" {
            return Err(HarnessError::Setup(format!("{name} is not in g2")));
        }
        load.wait_done(2, LOAD_WAIT).await?;
        let h = c.http_addr()?;
        let cm = c.coordinator_metrics().await?;
        // Exported at 0 from the start; the drill waits for each to rise.
        let left0 = cm.sum(MEMBERSHIP, &[("change", "left")])?;
        let joined0 = cm.sum(MEMBERSHIP, &[("change", "joined")])?;
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
        let g2_sent = sent_bytes(c, "prefill-1").await.map_err(HarnessError::Metrics)?;
        // It must now take work; if the load has ended, a few probes through the coordinator.
        let m = c.worker(name)?.metrics_addr()?;
        let c: &Cluster = c;
        let got = eventually(&format!("{name} receives KV in g1"), Duration::from_secs(30), || {
            let (m, h) = (m.clone(), h.clone());
            async move {
                let page = crate::metrics::scrape(&m).await;
                let got = page.map_or(0.0, |p| kv_moved(Role::Decode, &p).unwrap_or(0.0));
                if got > 0.0 {
                    return true;
                }
                let _ = probe(c, &h).await;
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
    }

    async fn prove(&self, c: &Cluster, ev: &Evidence, _: &Report) -> Result<String, String> {
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
        let got = kv_moved(Role::Decode, &page)?;
        // Mirrored for every reason from the receiver's start, so present even at 0.
        let rejected = page.sum(facts::metrics::decode::HANDSHAKES_REJECTED, &[]).map_err(|e| e.to_string())?;
        let g1_sent = sent_bytes(c, "prefill-0").await?;
        let g2_after = sent_bytes(c, "prefill-1").await?;
        if rejected > 0.0 || g2_after != ev.before || got > g1_sent {
            return Err(format!(
                "{name} in g1 received {got} bytes, refused {rejected} handshakes; g1's prefill sent {g1_sent}, \
                 g2's prefill sent {} after the relabel",
                g2_after - ev.before
            ));
        }
        Ok(format!(
            "{}; in g1 it received {got} KV bytes (g1's prefill sent {g1_sent} in all), refused no handshake; g2's \
             prefill sent nothing after the relabel",
            ev.notes.join("; ")
        ))
    }
}

/// SIGTERM a decode worker whose grace is far shorter than its longest request.
pub(in crate::drills) struct DrainGraceShort;

/// `--shutdown-timeout-ms` of the busy worker in [`DrainGraceShort`].
const SHORT_GRACE: Duration = Duration::from_millis(1000);
/// How long past the grace its exit may take (runner join, deregistration, a loaded machine).
const EXIT_SLACK: Duration = Duration::from_secs(5);
/// The load's concurrency in [`DrainGraceShort`].
const LONG_STREAM_LOAD: usize = 2;
/// Most long streams [`DrainGraceShort`] opens to get some onto its victim.
const MAX_LONG_STREAMS: usize = 12;
/// The longest grace of an attached victim [`DrainGraceShort`] accepts: its 400-token
/// answers take several seconds here, and must outlast it.
const MAX_GRACE: Duration = Duration::from_millis(2000);

/// The drain grace of [`DrainGraceShort`]'s victim: the drill's own [`SHORT_GRACE`], or an
/// attached decode-0's `shutdown-timeout-ms` from the state file.
fn victim_grace(c: &Cluster) -> Result<Duration, String> {
    if !c.is_attached() {
        return Ok(SHORT_GRACE);
    }
    let key = facts::state::flag::SHUTDOWN_TIMEOUT_MS;
    c.flag_ms("decode-0", key)?
        .ok_or_else(|| format!("the state file does not give decode-0's `{key}`, the grace its exit is timed against"))
}

#[async_trait::async_trait]
impl Drill for DrainGraceShort {
    /// Against a supervised cluster (`--restart always`) whose decode-0 drains within a grace
    /// far shorter than the long answers, as its state file's `shutdown-timeout-ms` says.
    fn against(&self, c: &Cluster) -> Result<(), String> {
        at_least(c, Role::Decode, 2, "the streams the victim cannot finish move to another")?;
        supervisor_restarts(c, Exit::Drained)?;
        let grace = victim_grace(c)?;
        if grace > MAX_GRACE {
            return Err(format!(
                "its victim's 400-token answers must outlast its drain grace, and decode-0 drains for {grace:?} \
                 (`tandem up --shutdown-timeout-ms 1000` gives {SHORT_GRACE:?})"
            ));
        }
        Ok(())
    }

    fn info(&self) -> DrillInfo {
        DrillInfo {
            name: "drain-grace-short",
            description: "SIGTERM a decode worker with --shutdown-timeout-ms 1000 while it streams 400-token answers \
                          (2 decode workers): it finishes what it can and exits 0 within the grace plus slack; the \
                          streams it could not finish move to the other worker (request migration) and complete",
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
            invariants: Invariants { all_complete: true, ..Invariants::default() },
            sampled: None,
        }
    }

    async fn fault(&self, c: &mut Cluster, load: &Progress, skip: bool) -> Result<Evidence, HarnessError> {
        let mut ev = Evidence::default();
        let name = "decode-0";
        let h = c.http_addr()?;
        load.wait_done(1, LOAD_WAIT).await?;
        // Long answers (400 tokens, ignore_eos), spread by the router over both workers, until
        // the victim runs more requests than the load's concurrency: then at least one of
        // them is a long one.
        let m = c.worker(name)?.metrics_addr()?;
        let (mut streams, mut running) = (Vec::new(), 0.0);
        // Up to 12: routing by load may put the first several on the other worker (seen
        // once in a full `make test`: 5 of 6 there, the victim ran 1 request and finished it
        // within its grace, so nothing had to move).
        for i in 0..MAX_LONG_STREAMS {
            let mut s = open_stream(c, &h, i).await?;
            s.first_data().await?;
            streams.push(s);
            let want = LONG_STREAM_LOAD as f64 + 1.0;
            let enough;
            (enough, running) =
                counter_reaches(&m, facts::metrics::worker::REQUESTS_RUNNING, &[], want, Duration::from_secs(2)).await;
            if enough.is_ok() {
                break;
            }
        }
        let pid = c.worker(name)?.proc.pid;
        let grace = victim_grace(c).map_err(HarnessError::Setup)?;
        ev.victim = Some((name.into(), pid));
        ev.notes.push(format!(
            "{name} (pid {pid}, grace {grace:?}) running {running} request(s) ({} long streams open)",
            streams.len()
        ));
        if skip {
            return Ok(ev);
        }
        ev.before = refused_moves(c).await?;
        ev.began();
        let t0 = tokio::time::Instant::now();
        c.signal(name, Signal::Term)?;
        // The long streams end as they end; read them while the worker drains.
        let mut ends = tokio::task::JoinSet::new();
        for (i, mut s) in streams.into_iter().enumerate() {
            ends.spawn(async move { (i, stream_end(&mut s).await) });
        }
        let exit = c.worker_mut(name)?.proc.wait_exit(grace + EXIT_SLACK + Duration::from_secs(20)).await;
        let took = t0.elapsed();
        // An attached worker's exit status is what its supervisor saw, once it started it again.
        let exit = match exit {
            Ok(_) if c.is_attached() => {
                let limit = c.lease_ttl * 2 + crate::cluster::RESTART_WAIT;
                c.await_restart(name, pid, limit).await.and_then(|r| {
                    let seen = r.last_exit.unwrap_or_default();
                    crate::cluster::parse_exit(&seen).ok_or_else(|| {
                        HarnessError::Fault(format!("its supervisor saw an exit it did not describe: {seen:?}"))
                    })
                })
            }
            other => other.map_err(HarnessError::from),
        };
        match exit {
            Ok(st) => {
                ev.drained.push((name.into(), pid, st.code()));
                ev.notes.push(format!("exited {st} {took:?} after SIGTERM"));
                if took > grace + EXIT_SLACK {
                    ev.missing.push(format!("it took {took:?} to exit, past grace {grace:?} + {EXIT_SLACK:?}"));
                }
            }
            Err(e) => ev.missing.push(e.to_string()),
        }
        ev.ended();
        // The streams the drained worker could not finish were ended as retryable at its
        // grace and moved to the other worker: every long stream completes its 400 tokens.
        let until = tokio::time::Instant::now() + LOAD_WAIT;
        let mut completed = 0;
        while let Ok(Some(Ok((i, end)))) = tokio::time::timeout_at(until, ends.join_next()).await {
            match end {
                Ok(Some(code)) => ev.missing.push(format!("long stream {i} ended with error {code}")),
                Ok(None) => completed += 1,
                Err(e) => ev.missing.push(format!("long stream {i} ended untyped: {e}")),
            }
        }
        if !ends.is_empty() {
            ev.missing.push(format!("{} long streams had not ended after {LOAD_WAIT:?}", ends.len()));
        }
        ends.abort_all();
        let moved = refused_moves(c).await? - ev.before;
        ev.seen = moved >= 1.0;
        ev.notes.push(format!("{completed} long streams completed; {moved} moved off the draining worker"));
        Ok(ev)
    }

    async fn prove(&self, _: &Cluster, ev: &Evidence, _: &Report) -> Result<String, String> {
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
            return Err(format!("{}; but no stream moved off the draining worker", ev.notes.join("; ")));
        }
        Ok(ev.notes.join("; "))
    }
}

/// The coordinator's successful moves of streams a worker ended as retryable (drained past
/// its grace, or fenced).
async fn refused_moves(c: &Cluster) -> Result<f64, HarnessError> {
    use facts::metrics::coordinator::MIGRATIONS;
    Ok(c.coordinator_metrics().await?.get(MIGRATIONS, &[("reason", "refused"), ("outcome", "ok")])?)
}
