//! The KV-link drills whose fault the kernel applies inside the decode worker's network
//! namespace: iptables rules (packet loss and a blackhole, which fail a load only when
//! its reservation lease ends) and a token bucket (tc tbf) capping the link's bandwidth.

use super::*;
use facts::metrics::decode::KV_RECEIVED_BYTES;

/// 50% random packet loss on the KV port, inside the decode worker's namespace.
pub(in crate::drills) struct KvLoss;

#[async_trait::async_trait]
impl Drill for KvLoss {
    fn info(&self) -> DrillInfo {
        DrillInfo {
            name: "kv-loss",
            description: "drop 50% of the packets to decode-0's KV port (iptables in its namespace): ~1 MB \
                          transfers stall in TCP backoff, each load that outlives its 3 s lease fails \
                          (lease_expired) and is recomputed; after 3 the breaker of (prefill-0, decode-0) opens and \
                          decode-1 (healthy link) takes the load; answers identical",
        }
    }

    /// Against a running cluster: the rule goes in decode-0's network through its
    /// `link-fault` template, and the deadline allows for its reservation lease.
    fn against(&self, c: &Cluster) -> Result<(), String> {
        link_drill_against(c)
    }

    fn adapt(&self, c: &Cluster, s: &mut Setup) {
        fit_deadline(c, s);
    }

    fn setup(&self, _skip: bool) -> Setup {
        Setup {
            spec: with_healthy_decode(netns_spec()),
            requests: 6,
            max_tokens: 16,
            concurrency: 2,
            invariants: Invariants { all_complete: true, deadline: Duration::from_secs(30), ..Invariants::default() },
            sampled: None,
        }
    }

    async fn fault(&self, c: &mut Cluster, load: &Progress, skip: bool) -> Result<Evidence, HarnessError> {
        let mut ev = Evidence::default();
        let (ns, port) = kv_port(c)?;
        let spec = drop_rule(&port, &["-m", "statistic", "--mode", "random", "--probability", "0.5"]);
        if !skip {
            ev.began();
            iptables(&ns, &rule("-A", &spec))?;
        }
        load.wait_finished().await?;
        // The rule stays until the namespace goes: the proof reads its counter.
        Ok(ev)
    }

    async fn prove(&self, c: &Cluster, _: &Evidence, report: &Report) -> Result<String, String> {
        let (ns, port) = kv_port(c).map_err(|e| e.to_string())?;
        let dropped = ns.rule_packets("INPUT", KV_RULE).map_err(|e| e.to_string())?.unwrap_or(0);
        let (l, reasons) = Loads::of(c).await.map_err(|e| e.to_string())?;
        let (healthy, healthy_failed) = healthy_loads(c).await?;
        let pair = faulty_pair(c).await?;
        let n = report.records.len() as f64;
        let seen = format!(
            "the 50% DROP rule on KV port {port} dropped {dropped} packet(s); of {n} KV loads, decode-0's {} \
             arrived intact and {} failed ({reasons}), {} recomputed; decode-1 (healthy link) loaded {healthy}, \
             {healthy_failed} failed; {pair}; slowest request {:.1} s",
            l.loaded,
            l.failed,
            l.recomputed,
            slowest(report)
        );
        if dropped == 0 {
            return Err(seen);
        }
        // Each request made one load: it arrived, or its lease ran out (loss slows a
        // connection, it never cuts one) and it was recomputed.
        if l.loaded + l.failed + healthy + healthy_failed != n
            || l.recomputed != l.failed
            || l.lease_ran_out != l.failed
            || healthy_failed > 0.0
        {
            return Err(format!(
                "{seen}: every load must arrive, or fail on decode-0 when its lease runs out and be recomputed"
            ));
        }
        Ok(seen)
    }
}

/// Drop every packet to the KV port until half the load is done, then let it through again.
pub(in crate::drills) struct KvBlackhole {
    /// KV over ucx (UCX over TCP on the namespace's veth): UCX's ports are its own
    /// ephemeral ones, so the rule drops every TCP packet into the namespace except the
    /// decode worker's gRPC, metrics and etcd paths and the prefill workers' gRPC.
    pub ucx: bool,
}

/// The INPUT rule (without `-A`/`-D`) that blackholes decode-0's KV link, and what it drops.
fn blackhole_rule(c: &Cluster, ucx: bool) -> Result<(LinkNet<'_>, Vec<String>, String), HarnessError> {
    if !ucx {
        let (ns, port) = kv_port(c)?;
        return Ok((ns, drop_rule(&port, &[]), format!("KV port {port}")));
    }
    let (d, ns) = decode_ns(c)?;
    let mut keep = vec![port_of(&d.proc.addr("grpc")?)?, port_of(&d.metrics_addr()?)?];
    if let Some(p) = &d.etcd_path {
        keep.push(p.addr.port().to_string());
    }
    for w in c.workers_of(Role::Prefill) {
        keep.push(port_of(&w.proc.addr("grpc")?)?);
    }
    let keep = keep.join(",");
    let rule = ["INPUT", "-p", "tcp", "-m", "multiport", "!", "--ports", &keep, "-m", "comment", "--comment", KV_RULE]
        .into_iter()
        .chain(["-j", "DROP"])
        .map(str::to_owned)
        .collect();
    Ok((ns, rule, format!("every TCP port but {keep} (UCX over TCP)")))
}

#[async_trait::async_trait]
impl Drill for KvBlackhole {
    fn info(&self) -> DrillInfo {
        if self.ucx {
            return DrillInfo {
                name: "kv-blackhole-ucx",
                description: "kv-blackhole with KV over ucx (UCX over TCP on decode-0's veth): every packet of its \
                              UCX connections dropped for part of the load; each of its loads fails when its 3 s lease \
                              ends and is recomputed while decode-1 keeps serving; once the rule goes, decode-0 loads \
                              again; answers identical",
            };
        }
        DrillInfo {
            name: "kv-blackhole",
            description: "drop every packet to decode-0's KV port (iptables in its namespace) for part of the \
                          load: each of its loads fails when its 3 s lease ends and is recomputed while decode-1 \
                          (healthy link) keeps serving; once the rule goes, decode-0 loads again (its pair's \
                          breaker, if open, is probed after 2 s); answers identical",
        }
    }

    /// Against a running cluster (KV over tcp; ucx's ports are its own): the rule goes in
    /// decode-0's network through its `link-fault` template, and the deadline allows for its
    /// reservation lease.
    fn against(&self, c: &Cluster) -> Result<(), String> {
        if self.ucx {
            return crate::drills::own_cluster(
                "with KV over ucx its rule spares the decode worker's other ports, which include its etcd proxy's",
            );
        }
        link_drill_against(c)
    }

    fn adapt(&self, c: &Cluster, s: &mut Setup) {
        fit_deadline(c, s);
    }

    fn setup(&self, _skip: bool) -> Setup {
        Setup {
            // A 2 s cooldown: decode-0's pair, opened by the blackhole, is probed while the load still runs.
            spec: {
                let spec =
                    with_healthy_decode(netns_spec()).coordinator_args(&["--prefill-breaker-cooldown-ms", "2000"]);
                if self.ucx {
                    spec.kv_transport("ucx")
                } else {
                    spec
                }
            },
            requests: 12,
            max_tokens: 16,
            concurrency: 2,
            invariants: Invariants { all_complete: true, deadline: Duration::from_secs(30), ..Invariants::default() },
            sampled: None,
        }
    }

    async fn fault(&self, c: &mut Cluster, load: &Progress, skip: bool) -> Result<Evidence, HarnessError> {
        let mut ev = Evidence::default();
        let (ns, spec, dropping) = blackhole_rule(c, self.ucx)?;
        if !skip {
            ev.began();
            iptables(&ns, &rule("-A", &spec))?;
        }
        load.wait_done(4, LOAD_WAIT).await?;
        if !skip {
            // decode-0 shares the load with the healthy decode-1: lift only once one of its loads failed.
            let failed = || async { Loads::of(c).await.is_ok_and(|(l, _)| l.failed >= 1.0) };
            let _ = eventually("decode-0 fails a KV load in the blackhole", LOAD_WAIT, failed).await;
        }
        let (at_lift, _) = Loads::of(c).await?;
        let dropped = ns.rule_packets("INPUT", KV_RULE)?.unwrap_or(0);
        if !skip {
            iptables(&ns, &rule("-D", &spec))?;
            ev.ended();
        }
        ev.seen = dropped > 0;
        ev.before = at_lift.loaded;
        ev.notes.push(format!(
            "the DROP rule on {dropping} dropped {dropped} packet(s) while 4 requests ended; meanwhile \
             {} load(s) failed and {} were recomputed, {} arrived",
            at_lift.failed, at_lift.recomputed, at_lift.loaded
        ));
        if at_lift.failed < 1.0 || at_lift.recomputed != at_lift.failed {
            ev.missing.push(format!(
                "{} failed and {} recomputed loads while the rule dropped the KV link",
                at_lift.failed, at_lift.recomputed
            ));
        }
        // The link is back: decode-0 loads again (at once, or after its pair's breaker is probed).
        let back = || async { Loads::of(c).await.is_ok_and(|(l, _)| l.loaded > at_lift.loaded) || load.finished() };
        let _ = eventually("decode-0 loads KV again after the rule went", LOAD_WAIT, back).await;
        load.wait_finished().await?;
        // A cluster's own breaker cooldown may outlast the load (the drill's own cluster sets
        // 2 s; `tandem up` keeps the coordinator's 5 s default): then load-like requests, one
        // at a time, until the pair's probe reaches decode-0 again.
        if !skip {
            let back = || async { Ok(Loads::of(c).await?.0.loaded > at_lift.loaded) };
            let sent = crate::drills::common::requests_until(c, LOAD_WAIT, back).await?;
            let (extra, refused) = (sent.sent, sent.refused);
            if extra > 0 {
                ev.notes.push(format!(
                    "{extra} request(s) after the load ({refused} not answered 200), until the breaker's cooldown \
                     let one through"
                ));
            }
        }
        Ok(ev)
    }

    async fn prove(&self, c: &Cluster, ev: &Evidence, report: &Report) -> Result<String, String> {
        let (l, reasons) = Loads::of(c).await.map_err(|e| e.to_string())?;
        let (healthy, _) = healthy_loads(c).await?;
        let pair = faulty_pair(c).await?;
        let seen = format!(
            "{}; after the rule went, {} more load(s) arrived on decode-0 (failure reasons overall: {reasons}); \
             decode-1 (healthy link) loaded {healthy}; {pair}; slowest request {:.1} s (lease {:.1} s)",
            ev.notes.join("; "),
            l.loaded - ev.before,
            slowest(report),
            attached_lease(c).map_or(LEASE_MS as f64 / 1e3, |l| l.as_secs_f64())
        );
        if !ev.seen || !ev.missing.is_empty() {
            return Err(format!("{seen}: {}", ev.missing.join("; ")));
        }
        if l.loaded - ev.before < 1.0 {
            return Err(format!("{seen}: the KV link did not come back"));
        }
        Ok(seen)
    }
}

/// The KV link into decode-0 capped by a token bucket.
pub(in crate::drills) struct KvBandwidth;

/// kv-bandwidth's cap, Mbit/s: a prompt's KV (1-1.5 MB) takes about half a second through
/// it, two at once a second, well within a 3 s lease.
const CAP_MBIT: f64 = 24.0;
/// The IFB device the KV port's ingress is redirected through: a token bucket (tc tbf)
/// shapes what leaves a device, and this one's egress is decode-0's KV ingress.
const IFB: &str = "tdm-ifb";

/// The interface in `ns` that holds `ip` (`ip -o -4 addr show`: `2: eth0    inet 10.79.0.12/24 ...`).
fn interface_of(ns: &LinkNet<'_>, ip: &str) -> Result<String, HarnessError> {
    let out = ns.exec("ip -o -4 addr show")?;
    out.lines()
        .find(|l| l.split_whitespace().any(|w| w.split('/').next() == Some(ip)))
        .and_then(|l| l.split_whitespace().nth(1))
        .map(|d| d.split('@').next().unwrap_or(d).to_owned())
        .ok_or_else(|| HarnessError::Setup(format!("no interface holds {ip}: {out}")))
}

/// The commands that cap what reaches `port` through `dev` at [`CAP_MBIT`], and undo that
/// (also a part-made cap: every step is undone whether or not it was made).
fn bucket(dev: &str, port: &str) -> (String, String) {
    let cap = format!(
        "ip link add {IFB} type ifb && ip link set {IFB} up && tc qdisc add dev {dev} handle ffff: ingress && \
         tc filter add dev {dev} parent ffff: protocol ip u32 match ip dport {port} 0xffff \
         action mirred egress redirect dev {IFB} && \
         tc qdisc add dev {IFB} root tbf rate {CAP_MBIT}mbit burst 32kb latency 10s"
    );
    let undo = format!("tc qdisc del dev {dev} ingress 2>/dev/null; ip link del {IFB} 2>/dev/null; true");
    (cap, undo)
}

/// (bytes sent, times over its rate) of the bucket on [`IFB`] (`tc -s qdisc show`:
/// ` Sent 4182634 bytes 2767 pkt (dropped 0, overlimits 1222 requeues 0)`).
fn bucket_counters(ns: &LinkNet<'_>) -> Result<(u64, u64), HarnessError> {
    let out = ns.exec(&format!("tc -s qdisc show dev {IFB}"))?;
    let after = |word: &str| -> Option<u64> {
        let rest = out.split(word).nth(1)?.trim_start();
        rest.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
    };
    match (after("Sent "), after("overlimits ")) {
        (Some(sent), Some(over)) => Ok((sent, over)),
        _ => Err(HarnessError::Fault(format!("no token-bucket counters on {IFB}: {out}"))),
    }
}

#[async_trait::async_trait]
impl Drill for KvBandwidth {
    fn info(&self) -> DrillInfo {
        DrillInfo {
            name: "kv-bandwidth",
            description: "cap the KV link into decode-0 at 24 Mbit/s (tc tbf, its KV port's ingress redirected \
                          through an IFB in its namespace) for the load: transfers take what the cap allows (the \
                          bucket holds back, drops nothing), every load lands within its lease, nothing is \
                          recomputed, answers identical",
        }
    }

    /// Against a running cluster: the bucket goes in decode-0's network through its
    /// `link-fault` template (undone when the drill ends, or is interrupted).
    fn against(&self, c: &Cluster) -> Result<(), String> {
        link_drill_against(c)
    }

    fn adapt(&self, c: &Cluster, s: &mut Setup) {
        fit_deadline(c, s);
    }

    fn setup(&self, _skip: bool) -> Setup {
        Setup {
            spec: netns_spec(),
            requests: 6,
            max_tokens: 16,
            concurrency: 2,
            invariants: Invariants { all_complete: true, transfers_intact: true, ..Invariants::default() },
            sampled: None,
        }
    }

    async fn fault(&self, c: &mut Cluster, load: &Progress, skip: bool) -> Result<Evidence, HarnessError> {
        let mut ev = Evidence::default();
        let (d, ns) = decode_ns(c)?;
        let transfer = d.proc.addr("transfer")?;
        let (ip, port) =
            transfer.rsplit_once(':').ok_or_else(|| HarnessError::Setup(format!("KV address {transfer:?}")))?;
        let dev = interface_of(&ns, ip)?;
        let (cap, undo) = bucket(&dev, port);
        if !skip {
            ev.began();
            ns.apply(&cap, &undo)?;
        }
        let waited = load.wait_finished().await;
        if !skip {
            let counters = bucket_counters(&ns);
            ns.revert(&undo)?;
            ev.ended();
            let (sent, over) = counters?;
            ev.seen = sent > 0 && over > 0;
            ev.notes.push(format!(
                "the {CAP_MBIT} Mbit/s bucket on {dev}'s traffic to KV port {port} passed {sent} bytes and held \
                 packets back {over} time(s)"
            ));
        }
        waited?;
        Ok(ev)
    }

    async fn prove(&self, c: &Cluster, ev: &Evidence, _: &Report) -> Result<String, String> {
        let (l, reasons) = Loads::of(c).await.map_err(|e| e.to_string())?;
        let d = decode_worker(c).map_err(|e| e.to_string())?;
        let page =
            crate::metrics::scrape(&d.metrics_addr().map_err(|e| e.to_string())?).await.map_err(|e| e.to_string())?;
        let base = c.page_at_attach(&d.proc.name);
        let bytes = page.sum(KV_RECEIVED_BYTES, &[]).map_err(|e| e.to_string())?
            - base.map_or(0.0, |b| b.sum(KV_RECEIVED_BYTES, &[]).unwrap_or(0.0));
        let sum = format!("{KV_LOAD_SECONDS}_sum");
        let secs = page.absent_as_zero(&sum, &[]) - base.map_or(0.0, |b| b.absent_as_zero(&sum, &[]));
        // Loads at once share the cap, so their summed time is at least their bytes over it.
        let mbit = if secs > 0.0 { bytes * 8.0 / secs / 1e6 } else { f64::INFINITY };
        let seen = format!(
            "{}; decode-0 loaded {} transfer(s), {:.2} MB over {secs:.2} s of loads ({mbit:.1} Mbit/s), {} failed \
             ({reasons}), {} recomputed",
            ev.notes.join("; "),
            l.loaded,
            bytes / 1e6,
            l.failed,
            l.recomputed
        );
        if !ev.seen {
            return Err(format!("{seen}: the bucket never held a packet back"));
        }
        if l.loaded < 1.0 || l.failed > 0.0 {
            return Err(format!("{seen}: every load through the cap must land within its lease"));
        }
        if mbit > CAP_MBIT * 1.25 {
            return Err(format!("{seen}: faster than the {CAP_MBIT} Mbit/s cap"));
        }
        Ok(seen)
    }
}
