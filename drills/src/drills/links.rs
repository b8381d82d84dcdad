//! Drills on the links around the coordinator: the request link (clients to
//! the coordinator's HTTP port) and the control link (the coordinator's gRPC
//! calls to a decode worker). A fault proxy on each acts on the answers
//! flowing back: the SSE stream to the client, the token stream to the
//! coordinator. (The KV link's drills are in [`super::kv`].)

use std::time::Duration;

use loadgen::{Outcome, Report};

use super::common::{cancelled, delay_during_load, delays_seen, strike, CANCELLED, LATENCY, LOAD_WAIT};
use super::{Drill, DrillInfo, Evidence, Progress, Setup};
use crate::cluster::{Cluster, ClusterSpec};
use crate::invariants::Invariants;
use crate::proxy::{Fault, Proxy};
use crate::{eventually, HarnessError};

// The workers and the coordinator export these counters at 0 from the start: read with
// `sum`, which fails on a missing (or renamed) series.
use facts::metrics::coordinator::DECODE_REROUTES as REROUTES;
/// Running requests the coordinator moved to another decode worker, by reason and outcome.
use facts::metrics::coordinator::MIGRATIONS;
/// Tokens a decode worker generated.
use facts::metrics::decode::GENERATION_TOKENS as GENERATED;
/// Requests a decode worker routed for prefill: counted as each arrives.
use facts::metrics::decode::PREFILL_ROUTE as ROUTED;
use facts::metrics::worker::REQUESTS_RUNNING;

fn client_proxy(c: &Cluster) -> Result<&Proxy, HarnessError> {
    c.client_proxy.as_ref().ok_or_else(|| HarnessError::Setup("the clients reach the coordinator directly".into()))
}

/// Requests whose client saw a transport error (the connection reset).
fn transport_errors(report: &Report) -> usize {
    report.records.iter().filter(|r| matches!(r.outcome, Outcome::Transport(_))).count()
}

/// Bytes of a response after which a cut client's connection is reset: the
/// headers (~150 bytes) and the first two or three SSE events (~200 bytes each)
/// of an answer of ~18 events.
const CUT_AT: usize = 700;
/// Client connections a run cuts.
const CUTS: u64 = 3;

/// Reset some clients' connections mid-answer on the request link.
pub(super) struct RequestLinkResets;

#[async_trait::async_trait]
impl Drill for RequestLinkResets {
    fn info(&self) -> DrillInfo {
        DrillInfo {
            name: "request-link-resets",
            description: "reset 3 clients' connections (RST, proxy on the request link) a few SSE events into \
                          their answers: each is a client disconnect, cancelled on the decode worker, KV freed; \
                          the cut requests and only they end in transport errors, the rest identical",
        }
    }

    /// Against a running cluster: the proxy is the drill's own, between its clients and the
    /// coordinator; nothing of the cluster changes.
    fn against(&self, c: &Cluster) -> Result<(), String> {
        super::at_least(c, crate::cluster::Role::Decode, 1, "to serve the load")
    }

    fn setup(&self, _skip: bool) -> Setup {
        Setup {
            spec: ClusterSpec::default().prefill("g1").decode("g1").clients_via_proxy(),
            requests: 10,
            max_tokens: 16,
            concurrency: 2,
            invariants: Invariants { all_complete: true, cuts_allowed: true, ..Invariants::default() },
            sampled: None,
        }
    }

    async fn fault(&self, c: &mut Cluster, load: &Progress, skip: bool) -> Result<Evidence, HarnessError> {
        let mut ev = Evidence::default();
        let proxy = client_proxy(c)?;
        ev.before = cancelled(c).await?;
        if !skip {
            ev.began();
            // The next request's connection: one connection per request (loadgen keeps none).
            let fault = Fault::ResetNextAfter(CUT_AT);
            strike(proxy, fault, CUTS, |k| k.resets, load, "the proxy cuts a client's connection").await?;
            ev.ended();
        }
        load.wait_finished().await?;
        Ok(ev)
    }

    async fn prove(&self, c: &Cluster, ev: &Evidence, report: &Report) -> Result<String, String> {
        let resets = client_proxy(c).map_err(|e| e.to_string())?.counters().resets;
        let cut = transport_errors(report);
        // The decode worker counts a cut stream once the coordinator's write fails and it
        // drops the worker stream: wait for as many cancellations as cuts (bounded).
        let want = ev.before + resets as f64;
        let now = std::sync::Mutex::new(ev.before);
        let seen = eventually("the decode worker cancels every cut request", Duration::from_secs(10), || {
            let now = &now;
            async move {
                let v = cancelled(c).await.unwrap_or(0.0);
                *now.lock().unwrap_or_else(|e| e.into_inner()) = v;
                v >= want
            }
        })
        .await;
        let got = now.into_inner().unwrap_or_else(|e| e.into_inner()) - ev.before;
        let partial: Vec<usize> = report
            .records
            .iter()
            .filter(|r| matches!(r.outcome, Outcome::Transport(_)))
            .map(|r| r.text.chars().count())
            .collect();
        let text = format!(
            "the proxy reset {resets} client connection(s) {CUT_AT} bytes into their answers; {cut} request(s) \
             ended in a transport error (characters received before the cut: {partial:?}); the decode worker \
             cancelled {got}"
        );
        if resets == 0 {
            return Err(text);
        }
        if cut as u64 != resets {
            return Err(format!("{text}: every cut request, and only those, must end in a transport error"));
        }
        if seen.is_err() {
            return Err(format!("{text}: every cut request must be cancelled on the decode worker"));
        }
        Ok(text)
    }
}

/// 75 ms ± 50 ms latency on the request link.
pub(super) struct RequestLinkDelay;

#[async_trait::async_trait]
impl Drill for RequestLinkDelay {
    fn info(&self) -> DrillInfo {
        DrillInfo {
            name: "request-link-delay",
            description: "75 ms ± 50 ms latency on every chunk the coordinator sends its clients (proxy on the \
                          request link): every answer complete and identical, nothing lost; TTFT p50/p99 in the proof",
        }
    }

    /// Against a running cluster: the proxy is the drill's own, between its clients and the
    /// coordinator; nothing of the cluster changes.
    fn against(&self, c: &Cluster) -> Result<(), String> {
        super::at_least(c, crate::cluster::Role::Decode, 1, "to serve the load")
    }

    fn setup(&self, _skip: bool) -> Setup {
        Setup {
            spec: ClusterSpec::default().prefill("g1").decode("g1").clients_via_proxy(),
            requests: 8,
            max_tokens: 16,
            concurrency: 2,
            invariants: Invariants { all_complete: true, transfers_intact: true, ..Invariants::default() },
            sampled: None,
        }
    }

    async fn fault(&self, c: &mut Cluster, load: &Progress, skip: bool) -> Result<Evidence, HarnessError> {
        delay_during_load(client_proxy(c)?, LATENCY, load, skip, Evidence::default()).await
    }

    async fn prove(&self, c: &Cluster, _: &Evidence, report: &Report) -> Result<String, String> {
        let k = client_proxy(c).map_err(|e| e.to_string())?.counters();
        // Every answer crosses the proxy: at least its headers and its first event were delayed.
        let (delayed, in_bounds) = delays_seen(&k, LATENCY, " to the clients", report.records.len() as u64);
        let s = report.summary();
        let ms = |d: Option<Duration>| d.map_or_else(|| "-".to_owned(), |d| format!("{:.0} ms", d.as_secs_f64() * 1e3));
        let text = format!(
            "{delayed}; {} of {} answers complete; TTFT p50 {} p99 {}",
            s.ok,
            s.requests,
            ms(s.ttft.p50),
            ms(s.ttft.p99)
        );
        if !in_bounds {
            return Err(text);
        }
        Ok(text)
    }
}

/// Reset the coordinator's gRPC connection to a decode worker while it streams.
pub(super) struct ControlLinkResets;

/// The decode worker behind the control proxy (the other one is reached directly).
const BEHIND: &str = "decode-0";
/// Times a run resets the control link.
const STRIKES: u64 = 3;

impl ControlLinkResets {
    fn proxy(c: &Cluster) -> Result<&Proxy, HarnessError> {
        c.control_proxies.get(BEHIND).ok_or_else(|| HarnessError::Setup(format!("{BEHIND} has no control proxy")))
    }
}

/// How control-link-resets cuts the link: the proxy on it (its own cluster), or, in an
/// attached cluster, `ss -K` in the worker's network killing the established sockets on its
/// gRPC port (the kernel answers the coordinator's next segment with a RST).
enum Cutter<'a> {
    Proxy(&'a Proxy),
    Sockets(crate::cluster::LinkNet<'a>, String),
}

impl Cutter<'_> {
    fn of(c: &Cluster) -> Result<Cutter<'_>, HarnessError> {
        if c.control_proxies.contains_key(BEHIND) || !c.is_attached() {
            return Ok(Cutter::Proxy(ControlLinkResets::proxy(c)?));
        }
        let w = c.worker(BEHIND)?;
        let port = w.proc.socket_addr("grpc")?.port().to_string();
        Ok(Cutter::Sockets(w.link_net(c)?, port))
    }

    /// Cuts every open connection; how many.
    fn cut(&self) -> Result<u64, HarnessError> {
        match self {
            Cutter::Proxy(p) => Ok(p.reset_open()),
            Cutter::Sockets(net, port) => {
                let out = net.exec(&format!("ss -K -t -n state established '( sport = :{port} )'"))?;
                // A header line, then one line per killed socket.
                Ok(out.lines().skip(1).filter(|l| !l.trim().is_empty()).count() as u64)
            }
        }
    }
}

#[async_trait::async_trait]
impl Drill for ControlLinkResets {
    fn info(&self) -> DrillInfo {
        DrillInfo {
            name: "control-link-resets",
            description: "reset the coordinator's gRPC connection to a decode worker (RST, proxy on the control \
                          link) mid-answer, at a request's start, mid-answer again: requests before their first \
                          token go to the other decode worker, those mid-answer move there (request migration) or \
                          end in a typed worker_stream error (never spliced), the worker cancels them and frees \
                          their KV",
        }
    }

    fn setup(&self, _skip: bool) -> Setup {
        Setup {
            spec: ClusterSpec::default().prefill("g1").decode("g1").decode("g1").control_via_proxy(BEHIND),
            requests: 10,
            max_tokens: 16,
            concurrency: 2,
            invariants: Invariants { allowed_errors: Some(vec!["worker_stream".into()]), ..Invariants::default() },
            sampled: None,
        }
    }

    /// Against a running cluster: `ss -K` through decode-0's `link-fault` template (its own
    /// network, `tandem up --hosts`) cuts the coordinator's connections to it.
    fn against(&self, c: &Cluster) -> Result<(), String> {
        super::at_least(c, crate::cluster::Role::Decode, 2, "one whose link is cut, one to route to")?;
        match c.worker(BEHIND) {
            Ok(w) if w.has_link_net() => Ok(()),
            Ok(_) => {
                Err(format!("{BEHIND} has no `link-fault` template to cut its sockets with (`tandem up --hosts 2`)"))
            }
            Err(_) => Err(format!("it cuts {BEHIND}'s control link, and the cluster has no {BEHIND}")),
        }
    }

    async fn fault(&self, c: &mut Cluster, load: &Progress, skip: bool) -> Result<Evidence, HarnessError> {
        let mut ev = Evidence::default();
        let cutter = Cutter::of(c)?;
        let m = c.worker(BEHIND)?.metrics_addr()?;
        ev.before = crate::metrics::scrape(&m).await?.sum(CANCELLED.0, CANCELLED.1)?;
        let coord = c.coordinator_metrics().await?;
        ev.counts = vec![
            crate::metrics::sum(&coord, REROUTES, &[]).map_err(HarnessError::Metrics)?,
            crate::metrics::sum(&coord, REROUTES, &[("reason", "stream_broken")]).map_err(HarnessError::Metrics)?,
            0.0,
            crate::metrics::sum(&coord, MIGRATIONS, &[("outcome", "ok")]).map_err(HarnessError::Metrics)?,
        ];
        let mut strikes = 0;
        while strikes < STRIKES && !load.finished() {
            // Strikes alternate: mid-answer (the worker runs a request and has streamed
            // tokens since), then just after a request arrived (the worker has routed its
            // prompt to the prefill worker: its first token is a prefill away).
            let mid_answer = strikes % 2 == 0;
            let forwarded = match &cutter {
                Cutter::Proxy(p) => p.counters().bytes_forwarded,
                Cutter::Sockets(..) => 0,
            };
            let page = crate::metrics::scrape(&m).await?;
            let started = page.sum(ROUTED, &[])?;
            // Rendered from its first increment: absent is none yet.
            let tokens = page.absent_as_zero(GENERATED, &[]);
            let cutter = &cutter;
            let what = if mid_answer { "streams a request" } else { "starts a request" };
            eventually(&format!("{BEHIND} {what} (or the load ends)"), LOAD_WAIT, || {
                let m = &m;
                async move {
                    if load.finished() {
                        return true;
                    }
                    let Ok(p) = crate::metrics::scrape(m).await else { return false };
                    if mid_answer {
                        // Tokens have flowed to the coordinator since: through the proxy, or
                        // generated on the worker.
                        let streamed = match cutter {
                            Cutter::Proxy(p) => p.counters().bytes_forwarded > forwarded + 200,
                            Cutter::Sockets(..) => p.absent_as_zero(GENERATED, &[]) > tokens + 2.0,
                        };
                        p.get(REQUESTS_RUNNING, &[]).is_ok_and(|n| n >= 1.0) && streamed
                    } else {
                        p.sum(ROUTED, &[]).is_ok_and(|n| n > started)
                    }
                }
            })
            .await?;
            if load.finished() {
                break;
            }
            ev.began();
            if !skip {
                let n = cutter.cut()?;
                ev.counts[2] += n as f64;
                ev.notes.push(format!("{} {n}", if mid_answer { "mid-answer" } else { "at a request's start" }));
            }
            strikes += 1;
        }
        ev.ended();
        load.wait_finished().await?;
        Ok(ev)
    }

    async fn prove(&self, c: &Cluster, ev: &Evidence, report: &Report) -> Result<String, String> {
        let resets = match Cutter::of(c).map_err(|e| e.to_string())? {
            Cutter::Proxy(p) => p.counters().resets,
            Cutter::Sockets(..) => ev.counts.get(2).copied().unwrap_or(0.0) as u64,
        };
        let (rerouted0, broken0) =
            (ev.counts.first().copied().unwrap_or(0.0), ev.counts.get(1).copied().unwrap_or(0.0));
        let m = c.worker(BEHIND).and_then(|w| w.metrics_addr()).map_err(|e| e.to_string())?;
        let ended_typed = report
            .records
            .iter()
            .filter(|r| matches!(&r.outcome, Outcome::StreamError { code: Some(c), .. } if c == "worker_stream"))
            .count();
        let coord = c.coordinator_metrics().await.map_err(|e| e.to_string())?;
        let rerouted = crate::metrics::sum(&coord, REROUTES, &[])? - rerouted0;
        // A stream cut mid-answer that request migration moved to the other decode worker.
        let moved =
            crate::metrics::sum(&coord, MIGRATIONS, &[("outcome", "ok")])? - ev.counts.get(3).copied().unwrap_or(0.0);
        let broken = crate::metrics::sum(&coord, REROUTES, &[("reason", "stream_broken")])? - broken0;
        // Every request cut on the worker is cancelled there (its KV freed: G2).
        let want = ev.before + ended_typed as f64 + broken;
        let now = std::sync::Mutex::new(ev.before);
        let seen = eventually(&format!("{BEHIND} cancels every cut stream"), Duration::from_secs(10), || {
            let (m, now) = (&m, &now);
            async move {
                // NaN (never enough) while the page or its series cannot be read.
                let v = crate::metrics::scrape(m)
                    .await
                    .map_or(f64::NAN, |p| p.sum(CANCELLED.0, CANCELLED.1).unwrap_or(f64::NAN));
                *now.lock().unwrap_or_else(|e| e.into_inner()) = v;
                v >= want
            }
        })
        .await;
        let cancelled = now.into_inner().unwrap_or_else(|e| e.into_inner()) - ev.before + 0.0;
        let text = format!(
            "the control link's {resets} open connection(s) were reset (by strike: {}); {ended_typed} request(s) mid-answer ended in \
             worker_stream, {moved} moved mid-answer to the other decode worker, {rerouted} were routed again \
             before their first token ({broken} of them on a broken stream); {BEHIND} cancelled {cancelled}",
            ev.notes.join(", ")
        );
        if resets == 0 || (ended_typed == 0 && rerouted == 0.0 && moved == 0.0) {
            return Err(text);
        }
        if seen.is_err() {
            return Err(format!("{text}: every stream cut on the worker must be cancelled there"));
        }
        Ok(text)
    }
}
