//! Steps and probes several drills share.

use std::time::Duration;

use opskit::http::EventStream;

use super::{Evidence, Progress, MODEL};
use crate::cluster::{Cluster, Role};
use crate::process::proc_state;
use crate::proxy::{Fault, Proxy, ProxyCounters};
use crate::{eventually, HarnessError};
use facts::metrics::worker::REQUESTS_RUNNING;

pub(super) use facts::metrics::coordinator::MEMBERSHIP_CHANGES as MEMBERSHIP;

/// How long a fault step waits for the load to reach the point it strikes at.
pub(super) const LOAD_WAIT: Duration = Duration::from_secs(60);

/// The prefill and the decode worker's CPU arguments for a one-pair cluster: a core of
/// its own each where the machine has two (core 1 and core 0), none otherwise.
pub(super) fn core_each() -> (&'static [&'static str], &'static [&'static str]) {
    if std::thread::available_parallelism().is_ok_and(|n| n.get() >= 2) {
        (&["--cpus", "1"], &["--cpus", "0"])
    } else {
        (&[], &[])
    }
}

/// The core [`core_each`] gives the prefill worker, for processes that must stay off the
/// decode worker's (`None` where there are not two).
pub(super) fn prefill_core() -> Option<&'static str> {
    std::thread::available_parallelism().is_ok_and(|n| n.get() >= 2).then_some("1")
}

/// The process is gone (or a zombie awaiting its reaper).
/// The decode workers' counter of requests cancelled by their client.
pub(super) const CANCELLED: (&str, &[(&str, &str)]) =
    (facts::metrics::decode::DECODE_REQUESTS, &[("outcome", "cancelled")]);

/// Requests the decode workers counted as cancelled (all of them).
pub(super) async fn cancelled(c: &Cluster) -> Result<f64, HarnessError> {
    decode_requests(c, CANCELLED.1).await
}

/// Waits (up to `limit`) until the decode workers' cancelled requests, all of them together,
/// reach `at_least`: like [`counter_reaches`] over every decode worker; the last count seen.
pub(super) async fn cancelled_reaches(c: &Cluster, at_least: f64, limit: Duration) -> (Result<(), HarnessError>, f64) {
    let now = std::sync::Mutex::new(0.0);
    let r = eventually(&format!("the decode workers' cancelled requests reach {at_least}"), limit, || {
        let now = &now;
        async move {
            let v = cancelled(c).await.unwrap_or(0.0);
            *now.lock().unwrap_or_else(|e| e.into_inner()) = v;
            v >= at_least
        }
    })
    .await;
    (r, now.into_inner().unwrap_or_else(|e| e.into_inner()))
}

/// Requests the decode workers counted with these labels (`&[]`: every outcome).
pub(super) async fn decode_requests(c: &Cluster, labels: &[(&str, &str)]) -> Result<f64, HarnessError> {
    let mut sum = 0.0;
    for w in c.workers_of(Role::Decode) {
        sum +=
            crate::metrics::scrape(&w.metrics_addr()?).await?.sum(facts::metrics::decode::DECODE_REQUESTS, labels)?;
    }
    Ok(sum)
}

pub(super) fn gone(pid: u32) -> bool {
    matches!(proc_state(pid), None | Some('Z'))
}

/// Resident memory of `pid`, KiB (`VmRSS` in /proc).
pub(super) fn rss_kib(pid: u32) -> Option<u64> {
    opskit::process::status_kib(pid, "VmRSS")
}

/// Resident anonymous memory of `pid`, KiB (`RssAnon` in /proc): the heap and private
/// mappings, where a leak grows. Not the pages of files it maps (the model file's rows,
/// mapped in as tokens are first seen, are the kernel's cache) or shared memory.
pub(super) fn anon_kib(pid: u32) -> Option<u64> {
    opskit::process::status_kib(pid, "RssAnon")
}

/// The first decode worker seen running a request.
pub(super) async fn busy_decoder(c: &Cluster, limit: Duration) -> Result<String, HarnessError> {
    let decoders: Vec<(String, String)> = c
        .workers_of(Role::Decode)
        .map(|w| Ok((w.proc.name.clone(), w.metrics_addr()?)))
        .collect::<Result<_, HarnessError>>()?;
    let victim = opskit::poll("a decode worker runs a request", limit, || {
        let decoders = &decoders;
        async move {
            // A worker that does not answer, or lacks the series, is the last error if none runs one.
            let mut last = None;
            for (name, m) in decoders {
                match crate::metrics::scrape(m).await.and_then(|p| Ok(p.get(REQUESTS_RUNNING, &[])?)) {
                    Ok(n) if n >= 1.0 => return Ok(Some(name.clone())),
                    Ok(_) => {}
                    Err(e) => last = Some(e),
                }
            }
            last.map_or(Ok(None), Err)
        }
    })
    .await?;
    Ok(victim)
}

/// After a fault ended process `name` (pid `pid`) in an attached cluster: its exit seen,
/// then its supervisor's restart awaited and followed ([`Cluster::await_restart`]), so the
/// cluster is left as found; what happened goes to `ev.notes`, what did not to `ev.missing`.
/// Nothing to do in a drill's own cluster, whose processes nobody restarts.
pub(super) async fn await_supervisor(c: &mut Cluster, name: &str, pid: u32, ev: &mut Evidence) {
    if !c.is_attached() {
        return;
    }
    match c.worker_mut(name) {
        Ok(w) => {
            if let Err(e) = w.proc.wait_exit(Duration::from_secs(10)).await {
                ev.missing.push(e.to_string());
                return;
            }
        }
        Err(e) => {
            ev.missing.push(e.to_string());
            return;
        }
    }
    let limit = c.lease_ttl * 2 + crate::cluster::RESTART_WAIT;
    match c.await_restart(name, pid, limit).await {
        Ok(r) => ev.notes.push(format!(
            "its supervisor restarted it as pid {} (restart {}, it saw {}), and the coordinator counts every worker \
             serving again",
            r.pid,
            r.restarts,
            r.last_exit.as_deref().unwrap_or("no exit")
        )),
        Err(e) => ev.missing.push(e.to_string()),
    }
}

/// Waits until the coordinator counts `n` serving workers of `role`.
pub(super) async fn serving_becomes(c: &Cluster, role: Role, n: f64, limit: Duration) -> Result<(), HarnessError> {
    let role = if role == Role::Prefill { "prefill" } else { "decode" };
    let what = format!("the coordinator counts {n} serving {role} worker(s)");
    let counted = opskit::poll(&what, limit, || async move {
        let p = c.coordinator_metrics().await?;
        let serving = p.get(facts::metrics::coordinator::WORKERS, &[("role", role), ("state", "serving")])?;
        Ok::<_, HarnessError>((serving == n).then_some(()))
    });
    Ok(counted.await?)
}

/// The metrics address of the first decode worker the drill did not fault.
pub(super) fn decode_metrics(c: &Cluster) -> Result<String, String> {
    c.workers_of(Role::Decode)
        .find(|w| !c.is_faulted(&w.proc.name))
        .ok_or("no live decode worker")?
        .metrics_addr()
        .map_err(|e| e.to_string())
}

/// Waits until counter `metric` (summed over `labels`) at `addr` reaches `at_least`; its
/// last value either way. A counter with labels is rendered from its first increment, so
/// while no series matches it counts as 0; the wait only passes once the series exists with
/// a value of at least `at_least` (> 0), so a renamed counter fails it.
pub(super) async fn counter_reaches(
    addr: &str,
    metric: &str,
    labels: &[(&str, &str)],
    at_least: f64,
    limit: Duration,
) -> (Result<(), HarnessError>, f64) {
    let now = std::sync::Mutex::new(0.0);
    let r = eventually(&format!("{metric} at {addr} reaches {at_least}"), limit, || {
        let now = &now;
        async move {
            let v = crate::metrics::scrape(addr).await.map_or(0.0, |p| p.absent_as_zero(metric, labels));
            *now.lock().unwrap_or_else(|e| e.into_inner()) = v;
            v >= at_least
        }
    })
    .await;
    (r, now.into_inner().unwrap_or_else(|e| e.into_inner()))
}

/// A streaming completion read event by event; dropping it hangs up.
pub(super) struct Stream(EventStream);

/// How long a stream may go without an event.
const EVENT_WAIT: Duration = Duration::from_secs(60);

/// Opens a long streaming completion (400 tokens, `ignore_eos`) for client `i`; returns once
/// the answer's head arrived.
pub(super) async fn open_stream(c: &Cluster, addr: &str, i: usize) -> Result<Stream, HarnessError> {
    let body = serde_json::json!({
        "model": MODEL, "prompt": format!("Client {i} will hang up on this story about a lighthouse keeper:"),
        "max_tokens": 400, "temperature": 0, "ignore_eos": true, "stream": true,
    });
    let s = c.post(addr, "/v1/completions").json(&body).timeout(EVENT_WAIT).stream().await?;
    Ok(Stream(s))
}

impl Stream {
    /// The next event's data, `None` at the end of the answer.
    pub(super) async fn event(&mut self) -> Result<Option<String>, HarnessError> {
        Ok(self.0.next_event().await?)
    }

    pub(super) async fn first_data(&mut self) -> Result<(), HarnessError> {
        while let Some(e) = self.event().await? {
            if e.contains("\"text\"") {
                return Ok(());
            }
        }
        Err(HarnessError::Fault(format!("the stream ({}) ended before its first token", self.0.status)))
    }

    pub(super) async fn read_to_end(&mut self) -> Result<(), HarnessError> {
        while self.event().await?.is_some() {}
        Ok(())
    }
}

/// One short non-streaming request: (status, Retry-After).
pub(super) async fn probe(c: &Cluster, addr: &str) -> Result<(u16, Option<String>), HarnessError> {
    let body = probe_body();
    let r = c.post(addr, "/v1/completions").json(&body).timeout(EVENT_WAIT).send().await?;
    Ok((r.status, r.header("retry-after").map(str::to_owned)))
}

/// One load-like request after the drill's load has ended: a new seeded prompt as long as
/// the load's (so it is prefilled remotely and may be handed a breaker's probe), through
/// whatever the load went through. `n` picks the prompt. Ok when it completed.
pub(super) async fn load_like_request(c: &Cluster, n: u64) -> Result<bool, HarnessError> {
    // A prompt no earlier run sent: a cached one is routed to whichever worker caches it.
    let prompt = loadgen::prompts::generate(1, super::load_prompt_tokens(c), fresh_seed() ^ n).remove(0);
    let body = serde_json::json!({"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0,
                                  "user": format!("after-load-{n}")});
    let url = c.base_url()?;
    let addr = url.trim_start_matches("http://");
    let r = c.post(addr, "/v1/completions").json(&body).timeout(LOAD_WAIT).send().await?;
    Ok(r.status == 200)
}

/// After [`Cluster::proxy_kv_link`]: load-like requests, one at a time, until one's KV has
/// crossed the proxy into worker `name` whole. An attached cluster may have that worker's
/// pairs out of routing when the drill begins (a breaker an earlier drill opened waits out
/// its cooldown before its probe), and a drill whose fault strikes the next transfer on the
/// proxy would wait for one in vain. Counted in the load's metrics baseline: the loads it
/// makes happened after attach, and proofs that count loads count them as arrived.
pub(super) async fn warm_kv_proxy(c: &Cluster, name: &str) -> Result<u64, HarnessError> {
    let w = c.worker(name)?;
    let proxy = w.proxy.as_ref().ok_or_else(|| HarnessError::Setup(format!("{name} has no proxy")))?;
    let count = format!("{}_count", facts::metrics::decode::KV_LOAD_SECONDS);
    let loads = || async { crate::metrics::scrape(&w.metrics_addr()?).await.map(|p| p.absent_as_zero(&count, &[])) };
    let before = loads().await?;
    let crossed = || async { Ok(proxy.counters().bytes_forwarded > 0 && loads().await? > before) };
    let sent = requests_until(c, LOAD_WAIT, crossed).await?;
    match sent.met {
        true => Ok(sent.sent),
        false => Err(HarnessError::Setup(format!(
            "no KV load reached {name} through the drill's proxy in {LOAD_WAIT:?} ({} requests sent): are its \
             pairs' breakers open, or is it out of routing?",
            sent.sent
        ))),
    }
}

/// What [`requests_until`] sent.
pub(super) struct Sent {
    pub sent: u64,
    /// Of them, not answered 200.
    pub refused: u64,
    /// Whether the condition held before the limit.
    pub met: bool,
}

/// Load-like requests ([`load_like_request`]), one at a time, until `done` holds or `limit`
/// has passed; `done` is checked before each.
pub(super) async fn requests_until<F, Fut>(c: &Cluster, limit: Duration, done: F) -> Result<Sent, HarnessError>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<bool, HarnessError>>,
{
    let until = tokio::time::Instant::now() + limit;
    let (mut sent, mut refused) = (0, 0);
    while tokio::time::Instant::now() < until {
        if done().await? {
            return Ok(Sent { sent, refused, met: true });
        }
        refused += u64::from(!load_like_request(c, sent).await?);
        sent += 1;
    }
    Ok(Sent { sent, refused, met: done().await? })
}

/// A prompt seed no earlier call in any process drew (the clock's nanoseconds, and a
/// counter for calls within one tick): prompts a running cluster has not cached.
pub(super) fn fresh_seed() -> u64 {
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    (nanos as u64).wrapping_add(CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) << 32)
}

/// A one-token probe request, each a new request: its `user` differs from every other
/// probe's, so the coordinator's retry gate does not take it for a retry of an earlier
/// probe it refused (a probe polls; it does not retry).
pub(super) fn probe_body() -> serde_json::Value {
    static PROBES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = PROBES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    serde_json::json!({"model": MODEL, "prompt": "Probe", "max_tokens": 1, "temperature": 0, "user": format!("probe-{n}")})
}

/// The coordinator's breaker transitions counter (labels `prefill`, `decode`, `from`, `to`).
pub(super) use facts::metrics::coordinator::BREAKER_TRANSITIONS;

/// What the coordinator's breaker of one (prefill worker, decode worker) pair did.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct PairBreaker {
    /// Times it opened (from closed or after a failed probe).
    pub opened: f64,
    /// Probes handed out (open -> half-open).
    pub probes: f64,
    /// Times a probe closed it again.
    pub closed: f64,
}

impl PairBreaker {
    /// The pair's figures from the coordinator's metrics.
    pub async fn of(c: &Cluster, prefill: &str, decode: &str) -> Result<Self, String> {
        let p = c.coordinator_metrics().await.map_err(|e| e.to_string())?;
        // A pair's transitions are rendered from its first one: none yet counts 0.
        let n =
            |to: &str| p.absent_as_zero(BREAKER_TRANSITIONS, &[("prefill", prefill), ("decode", decode), ("to", to)]);
        Ok(Self { opened: n("open"), probes: n("half_open"), closed: n("closed") })
    }

    /// "breaker (p, d) opened N time(s), M probe(s), closed K time(s)", for proof notes.
    pub fn note(&self, prefill: &str, decode: &str) -> String {
        format!(
            "breaker ({prefill}, {decode}) opened {} time(s), {} probe(s), closed again {} time(s)",
            self.opened, self.probes, self.closed
        )
    }
}

/// Strikes `n` times with `fault` on `proxy`: arms it, waits until `count` (one of the
/// proxy's counters) rises or the load ends, and arms it again, until `count` reaches `n`;
/// then disarms the proxy. `what` names one strike for the timeout message.
pub(super) async fn strike(
    proxy: &Proxy,
    fault: Fault,
    n: u64,
    count: impl Fn(&ProxyCounters) -> u64,
    load: &Progress,
    what: &str,
) -> Result<(), HarnessError> {
    let mut struck = count(&proxy.counters());
    while struck < n && !load.finished() {
        proxy.arm(fault);
        let before = struck;
        eventually(&format!("{what} (or the load ends)"), LOAD_WAIT, || async {
            count(&proxy.counters()) > before || load.finished()
        })
        .await?;
        struck = count(&proxy.counters());
    }
    proxy.arm(Fault::None);
    Ok(())
}

/// Latency a delay drill puts on a link: `base` ± `jitter` per chunk.
#[derive(Debug, Clone, Copy)]
pub(super) struct Latency {
    pub base: Duration,
    pub jitter: Duration,
}

/// The delay drills' latency: 75 ms ± 50 ms per chunk.
pub(super) const LATENCY: Latency = Latency { base: Duration::from_millis(75), jitter: Duration::from_millis(50) };

/// Delays every chunk through `proxy` by `latency` while the load runs (the window marked
/// on `ev`; nothing armed when `skip`), then disarms it.
pub(super) async fn delay_during_load(
    proxy: &Proxy,
    latency: Latency,
    load: &Progress,
    skip: bool,
    mut ev: Evidence,
) -> Result<Evidence, HarnessError> {
    if !skip {
        ev.began();
        proxy.arm(Fault::Delay { base: latency.base, jitter: latency.jitter });
    }
    load.wait_finished().await?;
    proxy.arm(Fault::None);
    ev.ended();
    Ok(ev)
}

/// What `proxy`'s counters show of [`delay_during_load`] (`to`: whose chunks, for the
/// text), and whether at least `min_chunks` were delayed, every one within `latency`.
pub(super) fn delays_seen(k: &ProxyCounters, latency: Latency, to: &str, min_chunks: u64) -> (String, bool) {
    let (lo, hi) = (latency.base - latency.jitter, latency.base + latency.jitter);
    let (lo, hi) = (lo.as_millis() as u64, hi.as_millis() as u64);
    let min = k.min_delay_ms.unwrap_or(0);
    let text = format!(
        "the proxy delayed {} chunk(s){to} by {min}..{} ms (want within [{lo}, {hi}])",
        k.delayed_chunks, k.max_delay_ms
    );
    let ok = k.delayed_chunks >= min_chunks.max(1) && min >= lo && k.max_delay_ms <= hi;
    (text, ok)
}
