//! Drills on the KV link between prefill and decode workers.

use loadgen::Report;

use super::common::decode_metrics;
use super::{BoxFuture, Drill, DrillInfo, Evidence, Progress, Setup};
use crate::cluster::{Cluster, ClusterSpec, Role};
use crate::invariants::Invariants;
use crate::proxy::Fault;
use crate::HarnessError;

/// Flip one byte inside a KV frame's payload.
pub(super) struct KvCorrupt;

impl Drill for KvCorrupt {
    fn info(&self) -> DrillInfo {
        DrillInfo {
            name: "kv-corrupt",
            description: "flip one byte on a decode worker's KV link: the frame is refused, the load counted as \
                          failed, and policy recompute gives identical answers",
        }
    }

    fn setup(&self, _skip: bool) -> Setup {
        Setup {
            spec: ClusterSpec::default().prefill("g1").decode_behind_proxy("g1"),
            requests: 6,
            max_tokens: 16,
            concurrency: 2,
            invariants: Invariants { all_complete: true, ..Invariants::default() },
        }
    }

    fn fault<'a>(
        &'a self,
        c: &'a mut Cluster,
        _: &'a Progress,
        skip: bool,
    ) -> BoxFuture<'a, Result<Evidence, HarnessError>> {
        Box::pin(async move {
            let mut ev = Evidence::default();
            let decode = c.workers_of(Role::Decode).next().ok_or_else(|| HarnessError::Setup("no decode".into()))?;
            let m = decode.metrics_addr()?;
            ev.before = crate::metrics::scrape(&m).await?.sum("tandem_kv_load_failures_total", &[]);
            if !skip {
                // 100 KiB into the stream: inside a layer's payload, where only the checksum can tell.
                if let Some(p) = decode.proxy.as_ref() {
                    ev.began();
                    p.arm(Fault::FlipAfter(100 << 10));
                }
            }
            Ok(ev)
        })
    }

    fn prove<'a>(&'a self, c: &'a Cluster, ev: &'a Evidence, _: &'a Report) -> BoxFuture<'a, Result<String, String>> {
        Box::pin(async move {
            let proxy = c.workers_of(Role::Decode).next().and_then(|w| w.proxy.as_ref()).ok_or("no proxy")?;
            let flips = proxy.counters().flips;
            let p = crate::metrics::scrape(&decode_metrics(c)?).await.map_err(|e| e.to_string())?;
            let failures = p.sum("tandem_kv_load_failures_total", &[]) - ev.before;
            let refused = p.sum("tandem_kv_frames_refused_total", &[("reason", "checksum")]);
            if flips == 0 || failures < 1.0 {
                return Err(format!(
                    "the proxy flipped {flips} bytes and the decode worker counted {failures} failed loads"
                ));
            }
            Ok(format!(
                "proxy flipped {flips} byte(s); {failures} failed load(s); {refused} frame(s) refused by checksum"
            ))
        })
    }
}
