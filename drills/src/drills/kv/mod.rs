//! Drills on the KV link between prefill and decode workers: faults in a
//! userspace proxy on the link (corruption, latency, resets) and in the
//! kernel, by iptables inside the decode worker's own network namespace
//! (packet loss, a blackhole).

use std::time::Duration;

use loadgen::Report;
// The decode worker exports its counters at 0 from the start, so they are read with
// `Page::sum`, which fails on a missing (or renamed) series. Its load-time histogram
// appears at its first sample: read with `absent_as_zero`, and the proofs that use it
// need it to have counted every load, which a renamed metric fails.
use facts::metrics::decode::{
    FRAMES_REFUSED, KV_LOAD_FAILURES, KV_LOAD_SECONDS, LOAD_FAILURE_REASONS, OUTCOME_RECOMPUTED, POLICY_OUTCOMES,
};

use super::common::{decode_metrics, delay_during_load, delays_seen, strike, Latency, PairBreaker, LATENCY, LOAD_WAIT};
use super::{Drill, DrillInfo, Evidence, Progress, Setup};
use crate::cluster::{Cluster, ClusterSpec, LinkNet, Role, Worker};
use crate::invariants::Invariants;
use crate::metrics::sum;
use crate::proxy::Fault;
use crate::{eventually, HarnessError};

mod proxy;
mod rules;

pub(super) use proxy::{KvCorrupt, KvDelay, KvReorder, KvResets};
pub(super) use rules::{KvBandwidth, KvBlackhole, KvLoss};

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

/// Port of `addr` (`host:port`).
fn port_of(addr: &str) -> Result<String, HarnessError> {
    addr.rsplit_once(':')
        .map(|(_, p)| p.to_owned())
        .ok_or_else(|| HarnessError::Setup(format!("address {addr:?} has no port")))
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
