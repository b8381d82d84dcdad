//! Drills on what the coordinator does for the cluster: stop routing to a
//! prefill worker that keeps failing (circuit breakers, fast 503), and end
//! streams whose clients stopped reading.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::time::Duration;
use tokio::time::Instant;

use loadgen::{Outcome, Report};

use super::common::{counter_reaches, decode_metrics, rss_kib, PairBreaker, LOAD_WAIT};
use super::{Drill, DrillInfo, Evidence, Progress, Setup, MODEL};
use crate::cluster::{Cluster, ClusterSpec, Role, WorkerSpec};
use crate::invariants::Invariants;
use crate::proxy::Fault;
use crate::HarnessError;

/// Consecutive failures that open a breaker, and its cooldown, in these drills.
const BREAKER_FAILURES: u32 = 3;
const BREAKER_COOLDOWN_MS: u64 = 3000;
use facts::metrics::coordinator::{
    BREAKER_TRANSITIONS as TRANSITIONS, PREFILL_ATTEMPTS as ATTEMPTS, PREFILL_UNAVAILABLE, ROUTE_DECISIONS,
    ROUTE_PAIRS_SKIPPED, STREAM_SEND_TIMEOUTS as SEND_TIMEOUTS,
};
use facts::metrics::decode::{DECODE_REQUESTS, KV_LOAD_FAILURES};
use facts::metrics::prefill::{KV_TRANSFER_FAILURES, PREFILL_REQUESTS};

use crate::metrics::sum;

// Counters with a fixed label set are exported at 0 from the start and read with `sum`,
// which fails on a missing (or renamed) series. The per-pair series (breaker transitions,
// prefill attempts) appear at their first increment: a proof reads them with
// `absent_as_zero` and requires the ones its fault must raise to be at least 1 (a renamed
// counter fails that); a run without the fault reads 0 and fails its proof, as it must.

fn breaker_args() -> [String; 4] {
    [
        "--prefill-breaker-failures".into(),
        BREAKER_FAILURES.to_string(),
        "--prefill-breaker-cooldown-ms".into(),
        BREAKER_COOLDOWN_MS.to_string(),
    ]
}

/// Latency the decode worker's KV link gets in the failing-prefill drills
/// (proxy, every sender-to-receiver byte, no jitter).
const LINK_DELAY: Duration = Duration::from_millis(50);
/// The faulty prefill worker's KV transfer timeout (connect, each frame, Ack), ms.
const FAULTY_TRANSFER_TIMEOUT_MS: u64 = 10;

/// A prefill worker in `group` that fails every prefill it is asked for
/// when `faulty`: its KV transfer timeout (10 ms) is shorter than the KV
/// link's latency ([`LINK_DELAY`], armed on the decode worker's proxy by
/// [`slow_link`]), so its handshake never completes (`HelloAck` times out)
/// and it answers every prefill `kv_load_failed`; it stays healthy to its
/// load polls. Its layout is the group's, so routing pairs it (a layout
/// mismatch is no longer a way to fail prefills: routing filters it, see
/// the layout-mismatch drill).
fn prefill(group: &str, faulty: bool) -> WorkerSpec {
    WorkerSpec {
        role: Role::Prefill,
        group: group.into(),
        behind_proxy: false,
        netns: false,
        extra: if faulty {
            vec!["--transfer-timeout-ms".into(), FAULTY_TRANSFER_TIMEOUT_MS.to_string()]
        } else {
            Vec::new()
        },
    }
}

/// Arms [`LINK_DELAY`] on the decode worker's KV link (it is behind a proxy in these drills).
fn slow_link(c: &Cluster) -> Result<(), HarnessError> {
    let proxy = c
        .workers_of(Role::Decode)
        .find_map(|w| w.proxy.as_ref())
        .ok_or_else(|| HarnessError::Setup("no decode worker behind a proxy".into()))?;
    proxy.arm(Fault::Delay { base: LINK_DELAY, jitter: Duration::ZERO });
    Ok(())
}

/// Breaker state and counts the coordinator exports for one prefill worker.
struct BreakerSeen {
    opened: f64,
    probes: f64,
    failed: f64,
    ok: f64,
}

async fn breaker_seen(c: &Cluster, worker: &str) -> Result<BreakerSeen, String> {
    let p = c.coordinator_metrics().await.map_err(|e| e.to_string())?;
    let sum = |name: &str, labels: &[(&str, &str)]| p.absent_as_zero(name, labels);
    let attempts = sum(ATTEMPTS, &[("worker", worker)]);
    let ok = sum(ATTEMPTS, &[("worker", worker), ("outcome", "ok")]);
    // Summed over the prefill worker's pairs (one decode worker in these drills).
    Ok(BreakerSeen {
        opened: sum(TRANSITIONS, &[("prefill", worker), ("to", "open")]),
        probes: sum(TRANSITIONS, &[("prefill", worker), ("to", "half_open")]),
        failed: attempts - ok + 0.0,
        ok,
    })
}

/// The faulty worker's own count of KV transfers that failed.
async fn refused_by(c: &Cluster, worker: &str) -> Result<f64, String> {
    let p = c.worker_metrics(worker).await.map_err(|e| e.to_string())?;
    sum(&p, KV_TRANSFER_FAILURES, &[])
}

/// Waits (bounded) for the coordinator to open the breaker of (`worker`, decode-0); notes what it saw.
async fn wait_open(c: &Cluster, worker: &str, ev: &mut Evidence) -> Result<(), HarnessError> {
    let h = c.http_addr()?;
    let labels = [("prefill", worker), ("decode", "decode-0"), ("to", "open")];
    let (seen, _) = counter_reaches(&h, TRANSITIONS, &labels, 1.0, LOAD_WAIT).await;
    match seen {
        Ok(()) => {
            ev.seen = true;
            ev.notes.push(format!("the coordinator opened the breaker of ({worker}, decode-0)"));
        }
        Err(e) => ev.missing.push(e.to_string()),
    }
    Ok(())
}

/// One of two prefill workers fails every prefill.
pub(super) struct PrefillErrors;

#[async_trait::async_trait]
impl Drill for PrefillErrors {
    fn against(&self, _: &Cluster) -> Result<(), String> {
        super::own_cluster(
            "one of its two prefill workers is started with a KV transfer timeout (10 ms) shorter than its \
             delayed KV link, and the decode worker with policy retry; a running cluster's workers keep the flags \
             they were started with",
        )
    }

    fn info(&self) -> DrillInfo {
        DrillInfo {
            name: "prefill-errors",
            description: "one of two prefill workers fails every prefill (its 10 ms KV transfer timeout is shorter \
                          than the 50 ms KV link): after 3 failures the breaker of its pair with the decode worker \
                          opens and every request goes to the healthy one; policy retry keeps every answer identical",
        }
    }

    fn setup(&self, skip: bool) -> Setup {
        let mut spec = ClusterSpec::default().policy("retry");
        spec.workers.push(prefill("g1", false));
        spec.workers.push(prefill("g1", !skip));
        spec = spec.decode_behind_proxy("g1");
        spec.coordinator_args.extend(breaker_args());
        // Prefill choice by load alone. With prefix affinity every request shares the chat
        // template's first blocks, which only the healthy worker ever caches, so after its
        // first success it took nearly every request and the faulty one could see fewer
        // than the breaker's 3 failures before the workload ended (seen under `make test`'s
        // parallel load: 2 of 14).
        spec.coordinator_args.extend(["--prefix-affinity".into(), "0".into()]);
        Setup {
            spec,
            // Enough that the faulty worker is chosen 3 times even when a loaded machine
            // makes the healthy one look idler for most of the run (14 requests once gave
            // it 2 under `make test`); the proof's bound on later choices is unchanged.
            requests: 30,
            max_tokens: 8,
            concurrency: 2,
            // `retry` falls back to the healthy worker: the fault is one the cluster hides.
            invariants: Invariants { all_complete: true, ..Invariants::default() },
            sampled: None,
        }
    }

    async fn fault(&self, c: &mut Cluster, _: &Progress, skip: bool) -> Result<Evidence, HarnessError> {
        let mut ev = Evidence::default();
        // The faulty worker is in the cluster from the start (see `setup`); the slow link makes
        // its timeout fail. This arms it and watches the fault take effect.
        if !skip {
            ev.began();
            slow_link(c)?;
            wait_open(c, "prefill-1", &mut ev).await?;
        }
        Ok(ev)
    }

    async fn prove(&self, c: &Cluster, ev: &Evidence, report: &Report) -> Result<String, String> {
        let bad = breaker_seen(c, "prefill-1").await?;
        let good = breaker_seen(c, "prefill-0").await?;
        let refused = refused_by(c, "prefill-1").await?;
        let dm = crate::metrics::scrape(&decode_metrics(c)?).await.map_err(|e| e.to_string())?;
        let mismatches = sum(&dm, KV_LOAD_FAILURES, &[("reason", "prefill_error")])?;
        let seen = format!(
            "prefill-1: {} failed attempts reported (its own count of failed transfers {refused}, the decode \
             worker's prefill_error loads {mismatches}), breaker (prefill-1, decode-0) opened {} time(s), {} \
             probe(s); prefill-0: {} ok, breaker (prefill-0, decode-0) opened {} time(s)",
            bad.failed, bad.opened, bad.probes, good.ok, good.opened
        );
        if bad.opened < 1.0 || bad.failed < f64::from(BREAKER_FAILURES) || refused < f64::from(BREAKER_FAILURES) {
            return Err(format!("the faulty worker's breaker never opened: {seen}; {}", ev.missing.join("; ")));
        }
        // Once open, prefill-1 is tried only by requests already routed (at most the
        // concurrency) and by one probe per cooldown.
        let bound = f64::from(BREAKER_FAILURES) + 1.0 + bad.probes;
        if bad.failed > bound {
            return Err(format!(
                "prefill-1 kept being chosen after its breaker opened ({} > {bound}): {seen}",
                bad.failed
            ));
        }
        if good.opened > 0.0 || good.ok < 1.0 {
            return Err(format!("the healthy worker's breaker opened or it served nothing: {seen}"));
        }
        let complete = report.records.iter().filter(|r| r.outcome.is_complete()).count();
        Ok(format!("{seen}; {complete}/{} requests complete", report.records.len()))
    }
}

/// The group's only prefill worker fails every prefill.
pub(super) struct PrefillUnavailable;

#[async_trait::async_trait]
impl Drill for PrefillUnavailable {
    fn against(&self, _: &Cluster) -> Result<(), String> {
        super::own_cluster(
            "the version group's only prefill worker is started with a KV transfer timeout shorter than its \
             link's latency; a running cluster's prefill workers keep the flags they were started with",
        )
    }

    fn info(&self) -> DrillInfo {
        DrillInfo {
            name: "prefill-unavailable",
            description: "the version group's only prefill worker fails every prefill (transfer timeout shorter than \
                          the KV link's latency): the first requests end kv_load_failed (typed), then the breaker of \
                          its pair with the only decode worker opens and the rest are refused at once with 503 \
                          prefill_unavailable + Retry-After, never dispatched to the decode worker",
        }
    }

    fn setup(&self, skip: bool) -> Setup {
        let mut spec = ClusterSpec::default().policy("fail");
        spec.workers.push(prefill("g1", !skip));
        spec = spec.decode_behind_proxy("g1");
        spec.coordinator_args.extend(breaker_args());
        Setup {
            sampled: None,
            spec,
            requests: 16,
            max_tokens: 8,
            concurrency: 2,
            invariants: Invariants {
                allowed_errors: Some(vec!["kv_load_failed".into(), "prefill_unavailable".into()]),
                ..Invariants::default()
            },
        }
    }

    async fn fault(&self, c: &mut Cluster, _: &Progress, skip: bool) -> Result<Evidence, HarnessError> {
        let mut ev = Evidence::default();
        if skip {
            return Ok(ev);
        }
        ev.began();
        slow_link(c)?;
        wait_open(c, "prefill-0", &mut ev).await?;
        if ev.seen {
            // While it is open, a request is refused at once, with Retry-After.
            let t = Instant::now();
            let (status, retry_after) = super::common::probe(c, &c.http_addr()?).await?;
            ev.notes.push(format!(
                "a probe request got {status} with Retry-After {retry_after:?} in {:.0} ms",
                t.elapsed().as_secs_f64() * 1e3
            ));
            let secs = retry_after.as_deref().and_then(|s| s.parse::<u64>().ok());
            let max = BREAKER_COOLDOWN_MS.div_ceil(1000);
            // The probe may land just as the cooldown ends (half-open): then it is the breaker's probe.
            if status == 503 && !secs.is_some_and(|s| (1..=max).contains(&s)) {
                ev.missing.push(format!("Retry-After {retry_after:?} is not within 1..={max} s"));
            }
        }
        Ok(ev)
    }

    async fn prove(&self, c: &Cluster, ev: &Evidence, report: &Report) -> Result<String, String> {
        let b = breaker_seen(c, "prefill-0").await?;
        let p = c.coordinator_metrics().await.map_err(|e| e.to_string())?;
        let fast = sum(&p, PREFILL_UNAVAILABLE, &[])?;
        let refused: Vec<&loadgen::Record> = report
            .records
            .iter()
            .filter(|r| {
                matches!(&r.outcome, Outcome::HttpError { status: 503, code: Some(c), .. } if c == "prefill_unavailable")
            })
            .collect();
        let slowest = refused.iter().map(|r| r.e2e).max().unwrap_or_default();
        // Every request the decode worker saw made exactly one prefill attempt: none was
        // dispatched to wait for KV that could not come.
        let dm = crate::metrics::scrape(&decode_metrics(c)?).await.map_err(|e| e.to_string())?;
        let dispatched = sum(&dm, DECODE_REQUESTS, &[])?;
        let seen = format!(
            "breaker opened {} time(s), {} probe(s); {} failed attempts; {fast} fast 503s counted, {} in the load \
             (slowest {:.0} ms); the decode worker ran {dispatched} requests",
            b.opened,
            b.probes,
            b.failed,
            refused.len(),
            slowest.as_secs_f64() * 1e3
        );
        if b.opened < 1.0 || fast < 1.0 || refused.is_empty() || !ev.seen {
            return Err(format!("no fast 503 behind an open breaker: {seen}; {}", ev.missing.join("; ")));
        }
        if !ev.missing.is_empty() {
            return Err(format!("{}: {seen}", ev.missing.join("; ")));
        }
        if dispatched != b.failed + b.ok {
            return Err(format!("requests reached the decode worker without a prefill attempt: {seen}"));
        }
        if slowest > Duration::from_secs(2) {
            return Err(format!("a prefill_unavailable refusal was not fast: {seen}"));
        }
        Ok(format!("{seen}; {}", ev.notes.join("; ")))
    }
}

/// A prefill worker whose KV layout differs from its group's under the same label.
pub(super) struct LayoutMismatch;

/// The coordinator's count of prefill workers left out of routes for their layout.
const LAYOUT_SKIPPED: (&str, &[(&str, &str)]) = (ROUTE_PAIRS_SKIPPED, &[("reason", "layout_fingerprint")]);

#[async_trait::async_trait]
impl Drill for LayoutMismatch {
    fn against(&self, _: &Cluster) -> Result<(), String> {
        super::own_cluster(
            "one of its prefill workers is started with another KV block size (32) under the version group's \
             label; a running cluster's workers all keep the layout they were started with",
        )
    }

    fn info(&self) -> DrillInfo {
        DrillInfo {
            name: "layout-mismatch",
            description: "one of two prefill workers has another KV layout (block size 32, the group 16) under the \
                          same version-group label: routing compares the registered layout fingerprints and never \
                          pairs it with the decode worker, so no prefill fails and no breaker opens",
        }
    }

    fn setup(&self, skip: bool) -> Setup {
        let mut spec = ClusterSpec::default().policy("fail");
        spec.workers.push(prefill("g1", false));
        let mut other = prefill("g1", false);
        if !skip {
            other.extra.extend(["--kv-block-size".into(), "32".into()]);
        }
        spec.workers.push(other);
        spec = spec.decode("g1");
        spec.coordinator_args.extend(breaker_args());
        Setup {
            spec,
            requests: 10,
            max_tokens: 8,
            concurrency: 2,
            // Policy `fail`: a request paired with the mismatched worker would end version_mismatch.
            invariants: Invariants { all_complete: true, ..Invariants::default() },
            sampled: None,
        }
    }

    async fn fault(&self, _: &mut Cluster, _: &Progress, skip: bool) -> Result<Evidence, HarnessError> {
        // The mismatched worker is in the cluster from the start (see `setup`).
        Ok(Evidence::standing(skip))
    }

    async fn prove(&self, c: &Cluster, _: &Evidence, report: &Report) -> Result<String, String> {
        let p = c.coordinator_metrics().await.map_err(|e| e.to_string())?;
        let skipped = sum(&p, LAYOUT_SKIPPED.0, LAYOUT_SKIPPED.1)?;
        let remote = sum(&p, ROUTE_DECISIONS, &[("prefill", "remote")])?;
        let odd = breaker_seen(c, "prefill-1").await?;
        let good = breaker_seen(c, "prefill-0").await?;
        let pair = PairBreaker::of(c, "prefill-1", "decode-0").await?;
        let asked = sum(&c.worker_metrics("prefill-1").await.map_err(|e| e.to_string())?, PREFILL_REQUESTS, &[])?;
        let seen = format!(
            "{skipped} pair(s) skipped for their layout fingerprint over {remote} remote-prefill routes; \
             prefill-1 (block size 32) was asked for {asked} prefill(s), {} attempt(s) reported; prefill-0 \
             served {} ok; {}",
            odd.failed + odd.ok,
            good.ok,
            pair.note("prefill-1", "decode-0")
        );
        if skipped < 1.0 || remote < 1.0 || skipped < remote {
            return Err(format!("routing did not leave the mismatched prefill worker out of every route: {seen}"));
        }
        if asked > 0.0 || odd.failed + odd.ok > 0.0 || pair.opened > 0.0 || good.ok < 1.0 {
            return Err(format!("the mismatched prefill worker was used: {seen}"));
        }
        let complete = report.records.iter().filter(|r| r.outcome.is_complete()).count();
        Ok(format!("{seen}; {complete}/{} requests complete", report.records.len()))
    }
}

/// The slow readers' count, and the coordinator's idle timeout in this drill.
const SLOW_CLIENTS: usize = 3;
const IDLE_TIMEOUT_MS: u64 = 3000;
/// The longest stream idle timeout of an attached coordinator [`SlowReader`] accepts: its
/// slow streams' answers take several seconds to generate here, and must outlast it.
const MAX_IDLE_TIMEOUT_MS: u64 = 4000;

/// A streaming request from a socket with a tiny receive buffer; returns the
/// socket once the response head arrived (nothing after it is read). Raw on purpose: the
/// fault is the socket itself (receive window and MSS set before connect, never read after
/// the head), below what an HTTP client exposes; opskit's client is for well-behaved ones.
/// `small` shrinks the client's window and MSS (the fault's bite); a run with the fault
/// skipped reads promptly with ordinary buffers (with the small ones, reading 400 tokens of
/// top-20 logprobs takes longer than the read bound). `api_key`: where the coordinator has tenants.
pub(crate) fn slow_stream(
    addr: SocketAddr,
    i: usize,
    small: bool,
    api_key: Option<&str>,
) -> Result<std::net::TcpStream, HarnessError> {
    use socket2::{Domain, Protocol, Socket, Type};
    let err = |e: std::io::Error| HarnessError::Fault(format!("slow client {i}: {e}"));
    let s = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP)).map_err(err)?;
    // Before connect, so the handshake announces them: a small window, and a small MSS.
    // Loopback's 64 KiB MSS would let the coordinator's kernel grow its send buffer to
    // over a megabyte, which a short drill's output fits in; at 536 bytes (a classic
    // Internet MSS) it stays at tens of KiB, so the stall reaches the coordinator.
    if small {
        s.set_recv_buffer_size(1024).map_err(err)?;
        s.set_tcp_mss(536).map_err(err)?;
    }
    s.connect_timeout(&addr.into(), Duration::from_secs(10)).map_err(err)?;
    let mut s: std::net::TcpStream = s.into();
    s.set_read_timeout(Some(Duration::from_secs(60))).map_err(err)?;
    // Top-20 logprobs make each event ~1 KB, so the buffers on the way fill within ~100 tokens.
    let body = serde_json::json!({
        "model": MODEL, "prompt": format!("Slow reader {i} asks for a long story about a lighthouse keeper:"),
        "max_tokens": 400, "temperature": 0, "ignore_eos": true, "stream": true, "logprobs": 20,
    })
    .to_string();
    let auth = api_key.map(|k| format!("Authorization: Bearer {k}\r\n")).unwrap_or_default();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\n\
         {auth}Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(head.as_bytes()).map_err(err)?;
    let mut got = Vec::new();
    let mut b = [0u8; 1];
    while !got.ends_with(b"\r\n\r\n") {
        match s.read(&mut b).map_err(err)? {
            0 => return Err(HarnessError::Fault(format!("slow client {i}: closed before the response head"))),
            _ => got.push(b[0]),
        }
    }
    if !got.starts_with(b"HTTP/1.1 200") {
        return Err(HarnessError::Fault(format!("slow client {i}: {}", String::from_utf8_lossy(&got))));
    }
    Ok(s)
}

/// Reads what is left on a slow socket: `Ok(bytes)` when the server closed it
/// (EOF or reset), an error when it stays open past the bound.
fn drained(mut s: std::net::TcpStream, limit: Duration) -> Result<Vec<u8>, String> {
    let until = Instant::now() + limit;
    s.set_read_timeout(Some(Duration::from_secs(5))).map_err(|e| e.to_string())?;
    let mut all = Vec::new();
    let mut buf = [0u8; 4096];
    while Instant::now() < until {
        match s.read(&mut buf) {
            Ok(0) => return Ok(all),
            Ok(n) => all.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Ok(all),
            Err(e) => return Err(format!("the connection is still open after {} bytes: {e}", all.len())),
        }
    }
    Err(format!("the server was still sending after {limit:?} ({} bytes)", all.len()))
}

/// Streaming clients stop reading after the response head.
pub(super) struct SlowReader;

#[async_trait::async_trait]
impl Drill for SlowReader {
    fn info(&self) -> DrillInfo {
        DrillInfo {
            name: "slow-reader",
            description: "3 streaming clients with a 1 KiB receive buffer read nothing after the response head \
                          (--stream-idle-timeout-ms 3000): each stream is ended and its connection closed, the \
                          decode worker cancels it and frees its KV, the normal load completes identically",
        }
    }

    /// Against a coordinator whose stream idle timeout (its state file's
    /// `stream-idle-timeout-ms`) ends a slow stream while its 400-token answer is still
    /// being generated, so the decode worker has something to cancel.
    fn against(&self, c: &Cluster) -> Result<(), String> {
        let key = facts::state::flag::STREAM_IDLE_TIMEOUT_MS;
        let name = c.coordinator.name.clone();
        let ms = c.flag_ms(&name, key)?.ok_or_else(|| {
            format!(
                "the state file does not give {name}'s `{key}`, and a slow stream must be ended while its answer is \
                 still generated (`tandem up --stream-idle-timeout-ms {IDLE_TIMEOUT_MS}` gives it)"
            )
        })?;
        let ms = ms.as_millis();
        if ms > u128::from(MAX_IDLE_TIMEOUT_MS) {
            return Err(format!(
                "{name} ends a slow stream after {ms} ms, by when its 400-token answer is done and the decode worker \
                 has nothing to cancel (`tandem up --stream-idle-timeout-ms {IDLE_TIMEOUT_MS}`)"
            ));
        }
        Ok(())
    }

    fn setup(&self, _skip: bool) -> Setup {
        Setup {
            spec: ClusterSpec::default()
                .prefill("g1")
                .decode("g1")
                .coordinator_args(&["--stream-idle-timeout-ms", &IDLE_TIMEOUT_MS.to_string()]),
            requests: 8,
            max_tokens: 16,
            concurrency: 2,
            invariants: Invariants { all_complete: true, ..Invariants::default() },
            sampled: None,
        }
    }

    async fn fault(&self, c: &mut Cluster, _: &Progress, skip: bool) -> Result<Evidence, HarnessError> {
        // Counted from here (an attached cluster's counters hold earlier drills'): the decode
        // workers' cancellations (any of them may run a slow stream) and the send timeouts.
        let timeouts_before = c.coordinator_metrics().await?.absent_as_zero(SEND_TIMEOUTS, &[]);
        let mut ev = Evidence {
            before: super::common::cancelled(c).await?,
            counts: vec![timeouts_before],
            ..Evidence::default()
        };
        let pid = c.coordinator.pid;
        let rss_before = rss_kib(pid).unwrap_or(0);
        let addr: SocketAddr =
            c.http_addr()?.parse().map_err(|e| HarnessError::Setup(format!("coordinator address: {e}")))?;
        ev.began();
        let mut socks = Vec::new();
        for i in 0..SLOW_CLIENTS {
            let key = c.api_key.clone();
            socks.push(tokio::task::spawn_blocking(move || slow_stream(addr, i, !skip, key.as_deref())));
        }
        let mut open = Vec::new();
        for s in socks {
            open.push(s.await.map_err(|e| HarnessError::Fault(format!("slow client task: {e}")))??);
        }
        ev.notes.push(format!("{SLOW_CLIENTS} slow clients got their response heads and stopped reading"));
        if skip {
            // Read everything, all at once and promptly: no timeout may fire.
            let readers: Vec<_> =
                // Three whole 400-token answers beside the load: give them time to finish.
                open.into_iter()
                    .map(|s| tokio::task::spawn_blocking(move || drained(s, Duration::from_secs(120))))
                    .collect();
            for r in readers {
                r.await.map_err(|e| HarnessError::Fault(format!("reader task: {e}")))?.map_err(HarnessError::Fault)?;
            }
            ev.ended();
            return Ok(ev);
        }
        let h = c.http_addr()?;
        let n = SLOW_CLIENTS as f64;
        let (timeouts, now) = counter_reaches(&h, SEND_TIMEOUTS, &[], timeouts_before + n, LOAD_WAIT).await;
        if let Err(e) = timeouts {
            ev.missing.push(format!("{e}: {now}"));
        }
        let rss_after = rss_kib(pid).unwrap_or(0);
        ev.notes.push(format!("coordinator VmRSS {rss_before} KiB before, {rss_after} KiB with the slow streams"));
        if rss_after > rss_before + 64 * 1024 {
            ev.missing.push(format!("coordinator RSS grew by {} KiB", rss_after - rss_before));
        }
        // Still not reading from our side: the coordinator must have closed each connection.
        let mut closed = 0;
        for s in open {
            let got = tokio::task::spawn_blocking(move || drained(s, Duration::from_secs(30)))
                .await
                .map_err(|e| HarnessError::Fault(format!("reader task: {e}")))?;
            match got {
                Ok(bytes) if !String::from_utf8_lossy(&bytes).contains("[DONE]") => closed += 1,
                Ok(_) => ev.missing.push("a slow stream ran to [DONE]".into()),
                Err(e) => ev.missing.push(e),
            }
        }
        ev.ended();
        ev.notes.push(format!("{closed} slow connection(s) closed by the coordinator before [DONE]"));
        ev.seen = closed == SLOW_CLIENTS;
        Ok(ev)
    }

    async fn prove(&self, c: &Cluster, ev: &Evidence, _: &Report) -> Result<String, String> {
        let p = c.coordinator_metrics().await.map_err(|e| e.to_string())?;
        let timeouts = sum(&p, SEND_TIMEOUTS, &[])? - ev.counts.first().copied().unwrap_or(0.0);
        let by_conn = sum(&p, SEND_TIMEOUTS, &[("layer", "connection")])?;
        let n = SLOW_CLIENTS as f64;
        let (seen, now) = super::common::cancelled_reaches(c, ev.before + n, Duration::from_secs(10)).await;
        let cancelled = now - ev.before;
        let summary = format!(
            "{timeouts} stream send timeouts ({by_conn} at the connection, ever); the decode workers cancelled \
             {cancelled}; {}",
            ev.notes.join("; ")
        );
        if timeouts < n || seen.is_err() || !ev.seen || !ev.missing.is_empty() {
            return Err(format!("slow streams were not ended: {summary}; {}", ev.missing.join("; ")));
        }
        Ok(summary)
    }
}
