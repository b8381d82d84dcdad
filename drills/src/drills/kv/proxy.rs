//! The KV-link drills whose fault is the userspace proxy on the link: a flipped byte,
//! latency, resets and bytes out of order, each answered by a refused frame or a load
//! that fails and is recomputed (or, for latency, by nothing failing at all).

use super::*;

/// Flip one byte inside a KV frame's payload.
pub(in crate::drills) struct KvCorrupt {
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
            return crate::drills::own_cluster(
                "its fault is a flag the prefill worker is started with (--fault-kv-corrupt)",
            );
        }
        kv_proxy_against(c, Some("recompute"), false)
    }

    fn built(&self) -> Result<(), String> {
        if self.ucx {
            crate::drills::prefill_fault_hooks()
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

/// 75 ms ± 50 ms latency on every KV chunk.
pub(in crate::drills) struct KvDelay;

#[async_trait::async_trait]
impl Drill for KvDelay {
    fn info(&self) -> DrillInfo {
        DrillInfo {
            name: "kv-delay",
            description: "75 ms ± 50 ms latency on every chunk of a decode worker's KV link (proxy; less, in \
                          proportion, for a lease under 6.75 s): every load still succeeds within its lease, no \
                          recompute, answers identical",
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
        delay_during_load(proxy, kv_latency(c), load, skip, ev).await
    }

    async fn prove(&self, c: &Cluster, ev: &Evidence, report: &Report) -> Result<String, String> {
        let w = decode_worker(c).map_err(|e| e.to_string())?;
        let k = w.proxy.as_ref().ok_or("no proxy")?.counters();
        let (l, reasons) = Loads::of(c).await.map_err(|e| e.to_string())?;
        let failed = l.failed - ev.before;
        let (delayed, in_bounds) = delays_seen(&k, kv_latency(c), "", 1);
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

/// kv-delay's latency: [`LATENCY`], or against a running cluster whose struck decode worker
/// has a short reservation lease, less in proportion, so a delayed transfer (some 30 chunks)
/// still lands within a third of the lease: the drill proves latency the lease absorbs (with
/// a 3 s lease, 75 ms a chunk had delayed transfers take 2.7 s on average, and pushes queued
/// behind them at the prefill workers outlived other decode workers' leases).
fn kv_latency(c: &Cluster) -> Latency {
    let lease = decode_worker(c)
        .ok()
        .and_then(|w| c.attached.as_ref()?.reservation_ttls.get(&w.proc.name).copied())
        .map(Duration::from_millis);
    match lease {
        Some(lease) if lease / 90 < LATENCY.base => {
            let base = lease / 90;
            Latency { base, jitter: base * 2 / 3 }
        }
        _ => LATENCY,
    }
}

/// Reset the KV connection again and again while the load runs.
pub(in crate::drills) struct KvResets;

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
pub(in crate::drills) struct KvReorder;

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
