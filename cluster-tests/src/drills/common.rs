//! Steps and probes several drills share.

use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use super::{Evidence, Progress, MODEL};
use crate::cluster::{Cluster, Role};
use crate::process::proc_state;
use crate::proxy::{Fault, Proxy, ProxyCounters};
use crate::{eventually, HarnessError};

pub(super) const MEMBERSHIP: &str = "tandem_coordinator_membership_changes_total";

/// How long a fault step waits for the load to reach the point it strikes at.
pub(super) const LOAD_WAIT: Duration = Duration::from_secs(60);

/// The process is gone (or a zombie awaiting its reaper).
pub(super) fn gone(pid: u32) -> bool {
    matches!(proc_state(pid), None | Some('Z'))
}

/// Resident memory of `pid`, KiB (`VmRSS` in /proc).
pub(super) fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// The first decode worker seen running a request.
pub(super) async fn busy_decoder(c: &Cluster, limit: Duration) -> Result<String, HarnessError> {
    let decoders: Vec<(String, String)> = c
        .workers_of(Role::Decode)
        .map(|w| Ok((w.proc.name.clone(), w.metrics_addr()?)))
        .collect::<Result<_, HarnessError>>()?;
    let victim = std::sync::Mutex::new(None);
    eventually("a decode worker runs a request", limit, || {
        let (decoders, victim) = (&decoders, &victim);
        async move {
            for (name, m) in decoders {
                if let Ok(p) = crate::metrics::scrape(m).await {
                    if p.sum("tandem_num_requests_running", &[]) >= 1.0 {
                        *victim.lock().unwrap_or_else(|e| e.into_inner()) = Some(name.clone());
                        return true;
                    }
                }
            }
            false
        }
    })
    .await?;
    victim.into_inner().unwrap_or_else(|e| e.into_inner()).ok_or_else(|| HarnessError::Fault("no victim".into()))
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
    eventually(&format!("the coordinator counts {n} serving {role} worker(s)"), limit, || async move {
        c.coordinator_metrics()
            .await
            .is_ok_and(|p| p.sum("tandem_coordinator_workers", &[("role", role), ("state", "serving")]) == n)
    })
    .await
}

/// The metrics address of the first decode worker the drill did not fault.
pub(super) fn decode_metrics(c: &Cluster) -> Result<String, String> {
    c.workers_of(Role::Decode)
        .find(|w| !c.is_faulted(&w.proc.name))
        .ok_or("no live decode worker")?
        .metrics_addr()
        .map_err(|e| e.to_string())
}

/// Waits until `metric` (summed over `labels`) at `addr` reaches `at_least`; its last value either way.
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
            let v = crate::metrics::scrape(addr).await.map_or(0.0, |p| p.sum(metric, labels));
            *now.lock().unwrap_or_else(|e| e.into_inner()) = v;
            v >= at_least
        }
    })
    .await;
    (r, now.into_inner().unwrap_or_else(|e| e.into_inner()))
}

/// A streaming completion read line by line; dropping it hangs up.
pub(super) struct Stream(BufReader<TcpStream>);

pub(super) async fn open_stream(addr: &str, i: usize) -> Result<Stream, HarnessError> {
    let err = |e: std::io::Error| HarnessError::Fault(format!("stream to {addr}: {e}"));
    let mut s = TcpStream::connect(addr).await.map_err(err)?;
    let body = serde_json::json!({
        "model": MODEL, "prompt": format!("Client {i} will hang up on this story about a lighthouse keeper:"),
        "max_tokens": 400, "temperature": 0, "ignore_eos": true, "stream": true,
    })
    .to_string();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.map_err(err)?;
    s.write_all(body.as_bytes()).await.map_err(err)?;
    Ok(Stream(BufReader::new(s)))
}

impl Stream {
    pub(super) async fn line(&mut self) -> Result<Option<String>, HarnessError> {
        let mut l = String::new();
        let n = tokio::time::timeout(Duration::from_secs(60), self.0.read_line(&mut l))
            .await
            .map_err(|_| HarnessError::Timeout("no line of the stream within 60 s".into()))?
            .map_err(|e| HarnessError::Fault(format!("reading the stream: {e}")))?;
        Ok((n > 0).then_some(l))
    }

    pub(super) async fn first_data(&mut self) -> Result<(), HarnessError> {
        while let Some(l) = self.line().await? {
            if l.contains("\"text\"") {
                return Ok(());
            }
        }
        Err(HarnessError::Fault("the stream ended before its first token".into()))
    }

    pub(super) async fn read_to_end(&mut self) -> Result<(), HarnessError> {
        while self.line().await?.is_some() {}
        Ok(())
    }
}

/// One short non-streaming request: (status, Retry-After).
pub(super) async fn probe(addr: &str) -> Result<(u16, Option<String>), HarnessError> {
    let mut s = Stream(BufReader::new(
        TcpStream::connect(addr).await.map_err(|e| HarnessError::Fault(format!("probe {addr}: {e}")))?,
    ));
    let body = serde_json::json!({"model": MODEL, "prompt": "Probe", "max_tokens": 1, "temperature": 0}).to_string();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.0.get_mut().write_all(head.as_bytes()).await.map_err(|e| HarnessError::Fault(format!("probe: {e}")))?;
    let status_line = s.line().await?.unwrap_or_default();
    let status = status_line.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let mut retry_after = None;
    while let Some(l) = s.line().await? {
        if l == "\r\n" {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            if k.eq_ignore_ascii_case("retry-after") {
                retry_after = Some(v.trim().to_owned());
            }
        }
    }
    Ok((status, retry_after))
}

/// The coordinator's breaker transitions counter (labels `prefill`, `decode`, `from`, `to`).
pub(super) const BREAKER_TRANSITIONS: &str = "tandem_coordinator_prefill_breaker_transitions_total";

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
        // `+ 0.0`: an empty sum is -0.0, which prints as "-0".
        let n = |to: &str| p.sum(BREAKER_TRANSITIONS, &[("prefill", prefill), ("decode", decode), ("to", to)]) + 0.0;
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

/// Latency the delay drills put on a link: `DELAY` ± `JITTER` per chunk.
pub(super) const DELAY: Duration = Duration::from_millis(75);
pub(super) const JITTER: Duration = Duration::from_millis(50);

/// Delays every chunk through `proxy` by [`DELAY`] ± [`JITTER`] while the load runs (the
/// window marked on `ev`; nothing armed when `skip`), then disarms it.
pub(super) async fn delay_during_load(
    proxy: &Proxy,
    load: &Progress,
    skip: bool,
    mut ev: Evidence,
) -> Result<Evidence, HarnessError> {
    if !skip {
        ev.began();
        proxy.arm(Fault::Delay { base: DELAY, jitter: JITTER });
    }
    load.wait_finished().await?;
    proxy.arm(Fault::None);
    ev.ended();
    Ok(ev)
}

/// What `proxy`'s counters show of [`delay_during_load`] (`to`: whose chunks, for the
/// text), and whether at least `min_chunks` were delayed, every one within [`DELAY`] ± [`JITTER`].
pub(super) fn delays_seen(k: &ProxyCounters, to: &str, min_chunks: u64) -> (String, bool) {
    let (lo, hi) = ((DELAY - JITTER).as_millis() as u64, (DELAY + JITTER).as_millis() as u64);
    let min = k.min_delay_ms.unwrap_or(0);
    let text = format!(
        "the proxy delayed {} chunk(s){to} by {min}..{} ms (want within [{lo}, {hi}])",
        k.delayed_chunks, k.max_delay_ms
    );
    let ok = k.delayed_chunks >= min_chunks.max(1) && min >= lo && k.max_delay_ms <= hi;
    (text, ok)
}
