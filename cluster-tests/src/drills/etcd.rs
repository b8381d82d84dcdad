//! Drills on etcd and the workers' and coordinators' links to it.

use std::time::Duration;

use loadgen::Report;

use super::common::{counter_reaches, gone, LOAD_WAIT};
use super::{BoxFuture, Drill, DrillInfo, Evidence, Progress, Setup};
use crate::cluster::{Cluster, ClusterSpec};
use crate::invariants::Invariants;
use crate::HarnessError;

const RESYNCS: &str = "tandem_coordinator_registry_resyncs_total";

/// Restart etcd under load with two version groups.
pub(super) struct EtcdRestart;

impl Drill for EtcdRestart {
    fn info(&self) -> DrillInfo {
        DrillInfo {
            name: "etcd-restart",
            description: "restart etcd under load with two version groups: serving continues from the cached \
                          membership, the coordinator re-lists, no KV crosses groups",
        }
    }

    fn setup(&self, _skip: bool) -> Setup {
        Setup {
            // Leases outlive the restart, so workers do not fence; two groups give G3 teeth.
            spec: ClusterSpec { lease_ttl_s: 5, ..ClusterSpec::default() }
                .prefill("g1")
                .decode("g1")
                .prefill("g2")
                .decode("g2"),
            requests: 8,
            max_tokens: 16,
            concurrency: 2,
            invariants: Invariants { all_complete: true, transfers_intact: true, ..Invariants::default() },
        }
    }

    fn fault<'a>(
        &'a self,
        c: &'a mut Cluster,
        load: &'a Progress,
        skip: bool,
    ) -> BoxFuture<'a, Result<Evidence, HarnessError>> {
        Box::pin(async move {
            let mut ev = Evidence { before: c.coordinator_metrics().await?.sum(RESYNCS, &[]), ..Evidence::default() };
            load.wait_done(2, LOAD_WAIT).await?;
            let etcd =
                c.etcd.as_mut().ok_or_else(|| HarnessError::Setup("the cluster has no etcd of its own".into()))?;
            ev.victim = etcd.pid().map(|p| ("etcd".to_owned(), p));
            if !skip {
                ev.began();
                etcd.restart().await.map_err(|e| HarnessError::Fault(format!("etcd restart: {e}")))?;
                ev.ended();
            }
            Ok(ev)
        })
    }

    fn prove<'a>(&'a self, c: &'a Cluster, ev: &'a Evidence, _: &'a Report) -> BoxFuture<'a, Result<String, String>> {
        Box::pin(async move {
            let (_, pid) = ev.victim.clone().ok_or("no victim was chosen")?;
            if !gone(pid) {
                return Err(format!("etcd (pid {pid}) is still the running member"));
            }
            let h = c.http_addr().map_err(|e| e.to_string())?;
            let (seen, now) = counter_reaches(&h, RESYNCS, &[], ev.before + 1.0, Duration::from_secs(10)).await;
            seen.map_err(|e| format!("old etcd pid {pid} is gone, but {e}"))?;
            Ok(format!(
                "old etcd pid {pid} gone, new pid {:?}; coordinator resyncs {} -> {now}",
                c.etcd.as_ref().and_then(|e| e.pid()),
                ev.before
            ))
        })
    }
}
