//! Drills that partition one process from etcd while etcd itself is healthy: a
//! decode worker (its lease lapses, it does not fence) or the coordinator (it serves
//! from its cached membership for its staleness bound, then refuses).

use super::*;

/// The decode worker whose etcd link the cutoff drill blackholes.
const CUT_WORKER: &str = "decode-1";

/// Partition one decode worker (of two) from etcd, then heal it.
pub(in crate::drills) struct WorkerEtcdCutoff;

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
        crate::drills::at_least(c, Role::Decode, 2, "one cut off, one to serve")?;
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
pub(in crate::drills) struct CoordinatorEtcdCutoff;

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
