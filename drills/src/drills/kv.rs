//! Drills on the KV link between prefill and decode workers: faults in a
//! userspace proxy on the link (corruption, latency, resets) and in the
//! kernel, by iptables inside the decode worker's own network namespace
//! (packet loss, a blackhole).

use std::time::Duration;

use tokio::time::Instant;

use loadgen::Report;
// The decode worker exports its counters at 0 from the start, so they are read with
// `Page::sum`, which fails on a missing (or renamed) series. Its load-time histogram
// appears at its first sample: read with `absent_as_zero`, and the proofs that use it
// need it to have counted every load, which a renamed metric fails.
use facts::metrics::decode::{
    FRAMES_REFUSED, KV_LOAD_FAILURES, KV_LOAD_SECONDS, LOAD_FAILURE_REASONS, OUTCOME_RECOMPUTED, POLICY_OUTCOMES,
};

use super::common::{decode_metrics, delay_during_load, delays_seen, strike, PairBreaker, LOAD_WAIT};
use super::{Drill, DrillInfo, Evidence, Progress, Setup};
use crate::cluster::{Cluster, ClusterSpec, LinkNet, Role, Worker};
use crate::invariants::Invariants;
use crate::metrics::sum;
use crate::proxy::Fault;
use crate::{eventually, HarnessError};

/// Flip one byte inside a KV frame's payload.
pub(super) struct KvCorrupt {
    /// KV over ucx: one-sided puts have no stream a proxy can sit in, so the prefill
    /// worker flips the byte in its own buffer after the checksum (`--fault-kv-corrupt`).
    pub ucx: bool,
}

/// The prefill workers' count of transfers they corrupted (`--fault-kv-corrupt`).
async fn corrupted_by_prefill(c: &Cluster) -> Result<f64, String> {
    let mut n = 0.0;
    for w in c.workers_of(Role::Prefill) {
        let p = c.worker_metrics(&w.proc.name).await.map_err(|e| e.to_string())?;
        n += sum(&p, facts::metrics::prefill::FAULTS_INJECTED, &[("fault", "kv_corrupt")])?;
    }
    Ok(n)
}

#[async_trait::async_trait]
impl Drill for KvCorrupt {
    fn info(&self) -> DrillInfo {
        if self.ucx {
            return DrillInfo {
                name: "kv-corrupt-ucx",
                description: "KV over ucx: the prefill worker flips one byte of a transfer after the checksum \
                              (--fault-kv-corrupt 1; on one host in the decode worker's pool blocks it stored into): \
                              the decode worker's CRC over its pool blocks refuses it, the load is counted as failed, \
                              and policy recompute gives identical answers",
            };
        }
        DrillInfo {
            name: "kv-corrupt",
            description: "flip one byte on a decode worker's KV link: the frame is refused, the load counted as \
                          failed, and policy recompute gives identical answers",
        }
    }

    fn against(&self, c: &Cluster) -> Result<(), String> {
        if self.ucx {
            return super::own_cluster("its fault is a flag the prefill worker is started with (--fault-kv-corrupt)");
        }
        kv_proxy_against(c, Some("recompute"), false)
    }

    fn built(&self) -> Result<(), String> {
        if self.ucx {
            super::prefill_fault_hooks()
        } else {
            Ok(())
        }
    }

    fn setup(&self, skip: bool) -> Setup {
        let spec = if self.ucx {
            let mut spec = ClusterSpec::default().prefill("g1").decode("g1").kv_transport("ucx");
            // The fault is armed at start (the flag is read once), so a skipped run has no flag.
            if !skip {
                spec.workers[0].extra.extend(["--fault-kv-corrupt".to_owned(), "1".to_owned()]);
            }
            spec
        } else {
            ClusterSpec::default().prefill("g1").decode_behind_proxy("g1")
        };
        Setup {
            // One flipped byte fails one load: the pair's breaker (3 failures) stays closed.
            spec,
            requests: 6,
            max_tokens: 16,
            concurrency: 2,
            invariants: Invariants { all_complete: true, ..Invariants::default() },
            sampled: None,
        }
    }

    async fn fault(&self, c: &mut Cluster, _: &Progress, skip: bool) -> Result<Evidence, HarnessError> {
        let mut ev = Evidence::default();
        let decode = c.workers_of(Role::Decode).next().ok_or_else(|| HarnessError::Setup("no decode".into()))?;
        let m = decode.metrics_addr()?;
        ev.before = crate::metrics::scrape(&m).await?.sum(KV_LOAD_FAILURES, &[])?;
        if self.ucx {
            // Armed from the prefill worker's start: its first transfer is the corrupted one.
            if !skip {
                ev.began();
            }
            return Ok(ev);
        }
        if !skip {
            // 100 KiB into the stream: inside a layer's payload, where only the checksum can tell.
            if let Some(p) = decode.proxy.as_ref() {
                ev.began();
                p.arm(Fault::FlipAfter(100 << 10));
            }
        }
        Ok(ev)
    }

    async fn prove(&self, c: &Cluster, ev: &Evidence, _: &Report) -> Result<String, String> {
        let (flips, by) = if self.ucx {
            (corrupted_by_prefill(c).await?, "the prefill worker (after the checksum) flipped")
        } else {
            let proxy = c.workers_of(Role::Decode).next().and_then(|w| w.proxy.as_ref()).ok_or("no proxy")?;
            (proxy.counters().flips as f64, "the proxy flipped")
        };
        let p = crate::metrics::scrape(&decode_metrics(c)?).await.map_err(|e| e.to_string())?;
        let failures = sum(&p, KV_LOAD_FAILURES, &[])? - ev.before;
        let refused = sum(&p, FRAMES_REFUSED, &[("reason", "checksum")])?;
        // Over ucx only the receiver's CRC can catch the byte (no framing to break): it must have.
        if flips == 0.0 || failures < 1.0 || (self.ucx && refused < flips) {
            return Err(format!(
                "{by} {flips} bytes and the decode worker counted {failures} failed loads ({refused} frame(s) \
                 refused by checksum)"
            ));
        }
        let pair = faulty_pair(c).await?;
        Ok(format!("{by} {flips} byte(s); {failures} failed load(s); {refused} frame(s) refused by checksum; {pair}"))
    }
}

/// The comment on every iptables rule a KV drill adds, to read its counter.
const KV_RULE: &str = "tdm-kv-drill";

/// Reservation lease of the namespaced decode worker in the iptables drills: how long it
/// waits for KV that does not come before policy recompute prefills the prompt itself.
const LEASE_MS: u64 = 3000;

/// The decode worker's view of its KV loads.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Loads {
    /// Loads that failed (any reason).
    failed: f64,
    /// Failed loads policy recompute answered by prefilling locally.
    recomputed: f64,
    /// Loads whose KV arrived intact and joined the batch.
    loaded: f64,
    /// Failed loads whose reservation lease ran out waiting (`lease_expired`, `timeout`).
    lease_ran_out: f64,
}

impl Loads {
    /// decode-0's loads so far (in an attached cluster, since the drill attached), and its
    /// failures by reason.
    async fn of(c: &Cluster) -> Result<(Self, String), HarnessError> {
        let d = decode_worker(c)?;
        let p = crate::metrics::scrape(&d.metrics_addr()?).await?;
        let base = c.page_at_attach(&d.proc.name);
        let since = |name: &str, labels: &[(&str, &str)]| -> Result<f64, HarnessError> {
            Ok(p.sum(name, labels)? - base.map_or(0.0, |b| b.sum(name, labels).unwrap_or(0.0)))
        };
        let mut by_reason = Vec::new();
        for r in LOAD_FAILURE_REASONS {
            let n = since(KV_LOAD_FAILURES, &[("reason", r)])?;
            if n > 0.0 {
                by_reason.push(format!("{r} {n}"));
            }
        }
        let count = format!("{KV_LOAD_SECONDS}_count");
        let loads = Self {
            failed: since(KV_LOAD_FAILURES, &[])?,
            recomputed: since(POLICY_OUTCOMES, &[("outcome", OUTCOME_RECOMPUTED)])?,
            loaded: p.absent_as_zero(&count, &[]) - base.map_or(0.0, |b| b.absent_as_zero(&count, &[])),
            lease_ran_out: since(KV_LOAD_FAILURES, &[("reason", "lease_expired")])?
                + since(KV_LOAD_FAILURES, &[("reason", "timeout")])?,
        };
        let reasons = if by_reason.is_empty() { "none".into() } else { by_reason.join(", ") };
        Ok((loads, reasons))
    }
}

/// The decode worker a KV drill strikes: the one behind the drill's proxy, else the first.
pub(super) fn decode_worker(c: &Cluster) -> Result<&Worker, HarnessError> {
    c.workers_of(Role::Decode)
        .find(|w| w.proxy.is_some())
        .or_else(|| c.workers_of(Role::Decode).next())
        .ok_or_else(|| HarnessError::Setup("no decode worker".into()))
}

/// Which attached decode worker the drill's KV proxy goes on ([`Cluster::proxy_kv_link`]):
/// the first whose `kv-load-failure-policy` (state file) is `policy`, the policy the drill's
/// own cluster would run (`tandem up --kv-load-failure-policy recompute,retry` gives each
/// worker its own), else the first decode worker.
pub(super) fn kv_proxy_target<'a>(c: &'a Cluster, policy: &str) -> Option<&'a Worker> {
    use facts::state::flag::KV_LOAD_FAILURE_POLICY;
    c.workers_of(Role::Decode)
        .find(|w| c.flag(&w.proc.name, KV_LOAD_FAILURE_POLICY) == Some(policy))
        .or_else(|| c.workers_of(Role::Decode).next())
}

/// The decode worker's network and the port of its KV listener in there.
fn kv_port(c: &Cluster) -> Result<(LinkNet<'_>, String), HarnessError> {
    let (d, ns) = decode_ns(c)?;
    Ok((ns, port_of(&d.proc.addr("transfer")?)?))
}

/// The decode worker and its network: the namespace the drill made, or an attached
/// worker's `link-fault` template.
fn decode_ns(c: &Cluster) -> Result<(&Worker, LinkNet<'_>), HarnessError> {
    let d = decode_worker(c)?;
    Ok((d, d.link_net(c)?))
}

/// `Drill::against` for the KV-link drills on `iptables`: decode-0 (the faulty link) and
/// decode-1 (the healthy one), decode-0's network reachable through a `link-fault` template,
/// KV over tcp (a rule on its KV port), and its reservation lease in the state file (a held
/// load fails when it ends).
fn link_drill_against(c: &Cluster) -> Result<(), String> {
    let (d0, d1) = (c.worker("decode-0"), c.worker("decode-1"));
    let (Ok(d0), Ok(_)) = (d0, d1) else {
        return Err("it faults decode-0's KV link while decode-1 keeps serving: the cluster needs both".into());
    };
    if !d0.has_link_net() {
        return Err("decode-0 has no `link-fault` template to change its KV link with (`tandem up --hosts 2` gives \
                    each worker its own network and one)"
            .into());
    }
    if d0.proc.addr("transfer").is_ok_and(|a| a.starts_with('@')) {
        return Err("decode-0 takes KV over shared memory (local), which no packet rule can touch".into());
    }
    attached_lease(c).map(drop)
}

/// `Drill::against` for the drills whose fault is the KV-link proxy: it is put on one decode
/// worker's link for the drill ([`kv_proxy_target`]; the drill's spec policy, which is
/// `recompute` where `policy` is `None`), which needs that worker's network namespace, a
/// `link-fault` template, KV over tcp, and, where the proof counts one policy's outcome, that
/// `policy`. `healthy`: a second decode worker must take the load while the first one's pair
/// is broken (those proofs name decode-0 and decode-1).
pub(super) fn kv_proxy_against(c: &Cluster, policy: Option<&str>, healthy: bool) -> Result<(), String> {
    use facts::state::flag;
    let spec_policy = ClusterSpec::default().policy;
    let d0 = kv_proxy_target(c, policy.unwrap_or(&spec_policy)).ok_or("the cluster has no decode worker")?;
    let name = d0.proc.name.as_str();
    if healthy && c.workers_of(Role::Decode).count() < 2 {
        return Err(format!("it breaks {name}'s KV link while another decode worker keeps serving: there is none"));
    }
    if healthy && name != "decode-0" {
        return Err(format!(
            "it breaks decode-0's KV link while decode-1 keeps serving, and its policy's worker is {name}"
        ));
    }
    if c.netns_of(name).is_none() || !d0.has_link_net() {
        return Err(format!(
            "its fault proxy joins {name}'s network namespace and redirects its KV port there, and the state file \
             gives it no `netns` with a `link-fault` template (`tandem up --hosts 2` does)"
        ));
    }
    match c.flag(name, flag::KV_TRANSPORT) {
        Some("tcp") => {}
        Some(t) => return Err(format!("{name} takes KV over {t}, and the proxy sits in a TCP stream")),
        None => {
            return Err(format!(
                "the state file does not give {name}'s `{}` (a newer `tandem up` writes it), and the proxy sits in a \
                 TCP stream",
                flag::KV_TRANSPORT
            ))
        }
    }
    if let Some(want) = policy {
        match c.flag(name, flag::KV_LOAD_FAILURE_POLICY) {
            Some(p) if p == want => {}
            Some(_) => {
                let runs: Vec<String> = c
                    .workers_of(Role::Decode)
                    .map(|w| {
                        format!("{} {}", w.proc.name, c.flag(&w.proc.name, flag::KV_LOAD_FAILURE_POLICY).unwrap_or("?"))
                    })
                    .collect();
                return Err(format!(
                    "it proves policy {want}'s outcome, and no decode worker runs it (`{}`: {}; `tandem up \
                     --kv-load-failure-policy {want}`, or a list with one policy per decode worker, runs it)",
                    flag::KV_LOAD_FAILURE_POLICY,
                    runs.join(", ")
                ));
            }
            None => {
                return Err(format!(
                    "it proves policy {want}'s outcome, and the state file does not give {name}'s `{}`",
                    flag::KV_LOAD_FAILURE_POLICY
                ))
            }
        }
    }
    Ok(())
}

/// decode-0's KV reservation lease as the attached cluster's state file gives it.
fn attached_lease(c: &Cluster) -> Result<Duration, String> {
    c.attached
        .as_ref()
        .and_then(|a| a.reservation_ttls.get("decode-0"))
        .map(|&ms| Duration::from_millis(ms))
        .ok_or_else(|| {
            "the state file does not give decode-0's reservation_ttl_ms (a newer `tandem up` writes it), and a \
             held KV load fails only when that lease ends"
                .into()
        })
}

/// Fits a KV-link drill's deadline to an attached cluster's reservation lease: a held load
/// fails when its lease ends and is then recomputed.
fn fit_deadline(c: &Cluster, s: &mut Setup) {
    if let Ok(lease) = attached_lease(c) {
        s.invariants.deadline = s.invariants.deadline.max(lease + Duration::from_secs(30));
    }
}

/// The INPUT rule spec (without `-A`/`-D`) dropping packets to the KV port; `matcher` narrows it.
fn drop_rule(port: &str, matcher: &[&str]) -> Vec<String> {
    let mut r: Vec<String> = ["INPUT", "-p", "tcp", "--dport", port].map(str::to_owned).to_vec();
    r.extend(matcher.iter().map(|s| (*s).to_owned()));
    r.extend(["-m", "comment", "--comment", KV_RULE, "-j", "DROP"].map(str::to_owned));
    r
}

/// The KV-link drills run with the coordinator's prefill circuit breakers
/// on (the defaults: 3 failures, 5 s cooldown). Breakers are kept per
/// (prefill worker, decode worker) pair, so a broken link on `decode-0`
/// opens only (prefill-0, decode-0): the drills where the fault fails 3
/// loads in a row add a healthy `decode-1` (no fault on its link), which
/// keeps serving long prompts while decode-0's pair is open. Before the
/// breakers were kept per pair they had to be off here: the one prefill
/// worker's breaker opened for every decode worker and the rest of the load
/// got the fast 503 `prefill_unavailable`.
fn with_healthy_decode(spec: ClusterSpec) -> ClusterSpec {
    spec.decode("g1")
}

/// The faulty decode worker's pair with the one prefill worker, as the coordinator's breaker saw it.
async fn faulty_pair(c: &Cluster) -> Result<String, String> {
    Ok(PairBreaker::of(c, "prefill-0", "decode-0").await?.note("prefill-0", "decode-0"))
}

/// KV loads on the healthy decode worker (`decode-1`): (arrived, failed).
async fn healthy_loads(c: &Cluster) -> Result<(f64, f64), String> {
    let m = c.worker("decode-1").and_then(|w| w.metrics_addr()).map_err(|e| e.to_string())?;
    let p = crate::metrics::scrape(&m).await.map_err(|e| e.to_string())?;
    let count = format!("{KV_LOAD_SECONDS}_count");
    let (loaded, failed) = (p.absent_as_zero(&count, &[]), sum(&p, KV_LOAD_FAILURES, &[])?);
    // In an attached cluster, what happened since the drill attached.
    let (loaded0, failed0) = c
        .page_at_attach("decode-1")
        .map_or((0.0, 0.0), |b| (b.absent_as_zero(&count, &[]), sum(b, KV_LOAD_FAILURES, &[]).unwrap_or(0.0)));
    Ok((loaded - loaded0, failed - failed0))
}

fn rule(op: &str, spec: &[String]) -> Vec<String> {
    std::iter::once(op.to_owned()).chain(spec.iter().cloned()).collect()
}

fn iptables(ns: &LinkNet<'_>, args: &[String]) -> Result<String, HarnessError> {
    ns.iptables(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

/// A cluster of one prefill worker and one decode worker in its own namespace
/// (reservation lease [`LEASE_MS`]).
fn netns_spec() -> ClusterSpec {
    let mut spec = ClusterSpec::default().prefill("g1").decode_in_netns("g1");
    for w in spec.workers.iter_mut().filter(|w| w.role == Role::Decode) {
        w.extra.extend(["--reservation-ttl-ms".to_owned(), LEASE_MS.to_string()]);
    }
    spec
}

/// The slowest request of the load, in seconds.
fn slowest(report: &Report) -> f64 {
    report.records.iter().map(|r| r.e2e.as_secs_f64()).fold(0.0, f64::max)
}

/// 75 ms ± 50 ms latency on every KV chunk.
pub(super) struct KvDelay;

#[async_trait::async_trait]
impl Drill for KvDelay {
    fn info(&self) -> DrillInfo {
        DrillInfo {
            name: "kv-delay",
            description: "75 ms ± 50 ms latency on every chunk of a decode worker's KV link (proxy): every load \
                          still succeeds within its lease, no recompute, answers identical",
        }
    }

    fn against(&self, c: &Cluster) -> Result<(), String> {
        kv_proxy_against(c, None, false)
    }

    fn setup(&self, _skip: bool) -> Setup {
        Setup {
            // Latency fails nothing: the pair's breaker stays closed.
            spec: ClusterSpec::default().prefill("g1").decode_behind_proxy("g1"),
            requests: 6,
            max_tokens: 16,
            concurrency: 2,
            invariants: Invariants { all_complete: true, transfers_intact: true, ..Invariants::default() },
            sampled: None,
        }
    }

    async fn fault(&self, c: &mut Cluster, load: &Progress, skip: bool) -> Result<Evidence, HarnessError> {
        let mut ev = Evidence::default();
        let proxy = decode_worker(c)?.proxy.as_ref().ok_or_else(|| HarnessError::Setup("no proxy".into()))?;
        ev.before = Loads::of(c).await?.0.failed;
        delay_during_load(proxy, load, skip, ev).await
    }

    async fn prove(&self, c: &Cluster, ev: &Evidence, report: &Report) -> Result<String, String> {
        let w = decode_worker(c).map_err(|e| e.to_string())?;
        let k = w.proxy.as_ref().ok_or("no proxy")?.counters();
        let (l, reasons) = Loads::of(c).await.map_err(|e| e.to_string())?;
        let failed = l.failed - ev.before;
        let (delayed, in_bounds) = delays_seen(&k, "", 1);
        if !in_bounds {
            return Err(delayed);
        }
        // Against a cluster with another decode worker (no proxy on its link), the load is shared.
        let (other, other_failed) =
            if c.workers_of(Role::Decode).count() > 1 { healthy_loads(c).await? } else { (0.0, 0.0) };
        let want = report.records.len() as f64;
        if l.loaded + other < want || failed + other_failed > 0.0 {
            return Err(format!(
                "{delayed}, but the decode workers loaded {} (behind the proxy) + {other} of {want} KV transfers and \
                 {} failed ({reasons})",
                l.loaded,
                failed + other_failed
            ));
        }
        if l.loaded < 1.0 {
            return Err(format!("{delayed}, but no KV transfer crossed the proxy's decode worker"));
        }
        let mean = crate::metrics::scrape(&w.metrics_addr().map_err(|e| e.to_string())?)
            .await
            .map(|p| p.absent_as_zero(&format!("{KV_LOAD_SECONDS}_sum"), &[]) / l.loaded.max(1.0))
            .unwrap_or(0.0);
        let pair = faulty_pair(c).await?;
        Ok(format!(
            "{delayed}; the decode worker behind it loaded {} KV transfers (mean load {:.0} ms) and any other {other}, \
             0 failed; {pair}",
            l.loaded,
            mean * 1e3
        ))
    }
}

/// 50% random packet loss on the KV port, inside the decode worker's namespace.
pub(super) struct KvLoss;

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
pub(super) struct KvBlackhole {
    /// KV over ucx (UCX over TCP on the namespace's veth): UCX's ports are its own
    /// ephemeral ones, so the rule drops every TCP packet into the namespace except the
    /// decode worker's gRPC, metrics and etcd paths and the prefill workers' gRPC.
    pub ucx: bool,
}

/// Port of `addr` (`host:port`).
fn port_of(addr: &str) -> Result<String, HarnessError> {
    addr.rsplit_once(':')
        .map(|(_, p)| p.to_owned())
        .ok_or_else(|| HarnessError::Setup(format!("address {addr:?} has no port")))
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
            return super::own_cluster(
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
            let (mut extra, mut refused) = (0, 0);
            let limit = Instant::now() + LOAD_WAIT;
            while Loads::of(c).await?.0.loaded <= at_lift.loaded && Instant::now() < limit {
                refused += u32::from(!super::common::load_like_request(c, extra).await?);
                extra += 1;
            }
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

/// Reset the KV connection again and again while the load runs.
pub(super) struct KvResets;

/// Bytes into the next transfer where a reset strikes (its first layers; a prompt's KV is ~1 MB).
const RESET_AT: usize = 64 << 10;
/// Resets a run aims for.
const RESETS: u64 = 3;

#[async_trait::async_trait]
impl Drill for KvResets {
    fn info(&self) -> DrillInfo {
        DrillInfo {
            name: "kv-resets",
            description: "reset decode-0's KV connection (RST both ends, proxy) mid-transfer, re-armed after each \
                          strike: each cut load fails at once and is recomputed; 3 in a row open the breaker of \
                          (prefill-0, decode-0) and decode-1 (healthy link) takes the load; answers identical",
        }
    }

    fn against(&self, c: &Cluster) -> Result<(), String> {
        kv_proxy_against(c, Some("recompute"), true)
    }

    fn setup(&self, _skip: bool) -> Setup {
        Setup {
            spec: with_healthy_decode(ClusterSpec::default().prefill("g1").decode_behind_proxy("g1")),
            requests: 8,
            max_tokens: 16,
            concurrency: 2,
            invariants: Invariants { all_complete: true, ..Invariants::default() },
            sampled: None,
        }
    }

    async fn fault(&self, c: &mut Cluster, load: &Progress, skip: bool) -> Result<Evidence, HarnessError> {
        let mut ev = Evidence::default();
        let proxy = decode_worker(c)?.proxy.as_ref().ok_or_else(|| HarnessError::Setup("no proxy".into()))?;
        ev.before = Loads::of(c).await?.0.failed;
        if skip {
            load.wait_finished().await?;
            return Ok(ev);
        }
        ev.began();
        let fault = Fault::ResetAfter(RESET_AT);
        strike(proxy, fault, RESETS, |k| k.resets, load, "the proxy resets a KV connection").await?;
        ev.ended();
        load.wait_finished().await?;
        Ok(ev)
    }

    async fn prove(&self, c: &Cluster, ev: &Evidence, report: &Report) -> Result<String, String> {
        let resets = decode_worker(c).map_err(|e| e.to_string())?.proxy.as_ref().ok_or("no proxy")?.counters().resets;
        let (l, reasons) = Loads::of(c).await.map_err(|e| e.to_string())?;
        let (healthy, _) = healthy_loads(c).await?;
        let pair = faulty_pair(c).await?;
        let failed = l.failed - ev.before;
        let seen = format!(
            "the proxy reset {resets} KV connection(s); decode-0 counted {failed} failed load(s) ({reasons}), \
             {} recomputed, {} arrived intact; decode-1 (healthy link) loaded {healthy}; of {} requests; {pair}",
            l.recomputed,
            l.loaded,
            report.records.len()
        );
        if resets < 2 || failed < 2.0 {
            return Err(seen);
        }
        if l.recomputed != l.failed {
            return Err(format!("{seen}: every failed load must be recomputed"));
        }
        Ok(seen)
    }
}

/// Deliver bytes of the KV stream out of order.
pub(super) struct KvReorder;

/// Bytes into the stream (from arming) where the first swapped run starts: inside a transfer's
/// first layers (a prompt's KV is ~1 MB, ~36 KB a layer).
const REORDER_AT: usize = 100 << 10;
/// Length of each of the two swapped runs.
const REORDER_LEN: usize = 8 << 10;
/// Swaps a run aims for.
const SWAPS: u64 = 2;

#[async_trait::async_trait]
impl Drill for KvReorder {
    fn info(&self) -> DrillInfo {
        DrillInfo {
            name: "kv-reorder",
            description: "swap two adjacent 8 KiB runs of a decode worker's KV stream (proxy), twice: the receiver \
                          refuses what arrives out of order (checksum or framing), the load fails and is \
                          recomputed, answers identical",
        }
    }

    fn against(&self, c: &Cluster) -> Result<(), String> {
        kv_proxy_against(c, Some("recompute"), false)
    }

    fn setup(&self, _skip: bool) -> Setup {
        Setup {
            spec: ClusterSpec::default().prefill("g1").decode_behind_proxy("g1"),
            requests: 6,
            max_tokens: 16,
            concurrency: 2,
            invariants: Invariants { all_complete: true, ..Invariants::default() },
            sampled: None,
        }
    }

    async fn fault(&self, c: &mut Cluster, load: &Progress, skip: bool) -> Result<Evidence, HarnessError> {
        let mut ev = Evidence::default();
        let proxy = decode_worker(c)?.proxy.as_ref().ok_or_else(|| HarnessError::Setup("no proxy".into()))?;
        let (l, _) = Loads::of(c).await?;
        ev.before = l.failed;
        if skip {
            load.wait_finished().await?;
            return Ok(ev);
        }
        ev.began();
        let fault = Fault::Reorder { after: REORDER_AT, len: REORDER_LEN };
        strike(proxy, fault, SWAPS, |k| k.swaps, load, "the proxy swaps two runs of KV bytes").await?;
        ev.ended();
        load.wait_finished().await?;
        Ok(ev)
    }

    async fn prove(&self, c: &Cluster, ev: &Evidence, report: &Report) -> Result<String, String> {
        let k = decode_worker(c).map_err(|e| e.to_string())?.proxy.as_ref().ok_or("no proxy")?.counters();
        let (l, reasons) = Loads::of(c).await.map_err(|e| e.to_string())?;
        let p = crate::metrics::scrape(&decode_metrics(c)?).await.map_err(|e| e.to_string())?;
        let mut refused = Vec::new();
        for r in ["checksum", "payload_length", "block_range", "layer_out_of_range", "duplicate"] {
            let n = sum(&p, FRAMES_REFUSED, &[("reason", r)])?;
            if n > 0.0 {
                refused.push(format!("{r} {n}"));
            }
        }
        let failed = l.failed - ev.before;
        let seen = format!(
            "the proxy swapped {} pair(s) of runs ({} bytes); the decode worker refused frames ({}), counted \
             {failed} failed load(s) ({reasons}), {} recomputed, {} of {} arrived intact",
            k.swaps,
            k.swapped_bytes,
            if refused.is_empty() { "none by the receiver".to_owned() } else { refused.join(", ") },
            l.recomputed,
            l.loaded,
            report.records.len()
        );
        if k.swaps == 0 || failed < 1.0 {
            return Err(seen);
        }
        if l.recomputed != l.failed {
            return Err(format!("{seen}: every failed load must be recomputed"));
        }
        Ok(seen)
    }
}
