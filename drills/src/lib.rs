//! Failure drills on a real tandem cluster.
//!
//! A drill starts a small cluster of real processes on loopback
//! ([`Cluster`]: etcd, prefill and decode workers, a coordinator), applies
//! one fault (a signal, a corrupted or held KV link through a [`Proxy`], an
//! etcd restart, clients that hang up, offered load over capacity), proves
//! the fault happened, drives [`loadgen`] load through it, and checks the
//! invariants every drill shares ([`Invariants`], G1–G6 in [`Guarantee`]).
//! [`run_drill`] does all of it and returns a serializable [`DrillReport`].
//!
//! Owns: the cluster's shape, the drills' faults and judging a run. The tools
//! under them (processes, the fault proxy, etcd, HTTP, metric pages, waits)
//! are `opskit`'s, shared with every crate's tests. Must not: mock a
//! component that can run for real, wait without a bound, read a metric by a
//! string copy of its name or a missing series as 0, or pass a drill whose
//! fault did not happen (G6 is checked in every run; `skip_fault` shows it bites).

#![forbid(unsafe_code)]

pub mod chaos;
mod cluster;
mod drills;
pub mod front;
mod invariants;
pub mod metrics;
pub mod netns;
mod reference;

pub use opskit::{process, proxy};

use std::future::Future;
use std::time::Duration;

pub use cluster::{Attached, Cluster, ClusterSpec, PastLife, Restarted, Role, TenantsSpec, Worker, WorkerSpec};
pub use drills::{
    drills, drills_against, drills_built, planned_requests, run_drill, DrillInfo, DrillOptions, DrillReport, Goodput,
};
pub use front::{Front, FrontCounters};
pub use invariants::{Guarantee, Invariants, Violation};
pub use netns::Netns;
pub use process::{proc_state, socket_owner, Proc, Signal};
pub use proxy::{Fault, Proxy, ProxyCounters};
pub use reference::reference_texts;

/// Why a drill could not be run or judged (as opposed to a [`Violation`], which it found).
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    /// Starting something failed (a binary missing, a process exited at start).
    #[error("setup: {0}")]
    Setup(String),
    /// A bounded wait ran out; the message says what did not happen.
    #[error("timed out: {0}")]
    Timeout(String),
    /// A metrics page could not be read.
    #[error("metrics: {0}")]
    Metrics(String),
    /// Applying a fault failed.
    #[error("fault: {0}")]
    Fault(String),
    /// The drill name is not in [`drills`].
    #[error("unknown drill `{0}`")]
    UnknownDrill(String),
    /// The drill cannot run against the attached cluster ([`DrillOptions::against`]).
    #[error("{drill} cannot run against the cluster of {state}: {why}")]
    NotAgainst { drill: String, state: String, why: String },
    /// The binaries beside this one cannot apply the drill's fault (a fault hook the
    /// product build leaves out).
    #[error("{drill} cannot run with these binaries: {why}")]
    NotBuilt { drill: String, why: String },
    /// The load plan was refused.
    #[error("load: {0}")]
    Load(String),
    /// A system command (`ip`, `iptables`) failed: which one, how it ended, its stderr.
    #[error("`{command}` failed ({status}): {stderr}")]
    Command { command: String, status: String, stderr: String },
}

impl From<opskit::Error> for HarnessError {
    fn from(e: opskit::Error) -> Self {
        match e {
            opskit::Error::Timeout(what) => Self::Timeout(what),
            opskit::Error::Http(e) | opskit::Error::Metric(e) => Self::Metrics(e),
            e @ (opskit::Error::Process(_) | opskit::Error::Io { .. }) => Self::Setup(e.to_string()),
        }
    }
}

/// [`opskit::eventually`] with the drills' error: polls `f` until it is true; the error
/// says `what` did not happen within `limit`.
pub async fn eventually<F, Fut>(what: &str, limit: Duration, f: F) -> Result<(), HarnessError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    Ok(opskit::eventually(what, limit, f).await?)
}
