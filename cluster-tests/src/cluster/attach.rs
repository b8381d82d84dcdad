//! [`Cluster::attach`]: a cluster someone else started (`tandem up --state-file`),
//! adopted so drills can run against it and leave it as found.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::{temp_dir, Cluster, Role, Worker};
use crate::process::Proc;
use crate::HarnessError;

/// What an [attached](Cluster::attach) cluster was found as.
#[derive(Debug)]
pub struct Attached {
    /// The state file it was read from.
    pub state: PathBuf,
    /// Its etcd, when the state file lists one (adopted: left running).
    pub etcd: Option<Proc>,
    /// Each log's length when the drill attached: G5 reads only what was written after,
    /// so a panic from before the drill (already reported, or the operator's to look at)
    /// does not fail this drill and every later one.
    pub log_starts: BTreeMap<PathBuf, u64>,
}

/// The version group of a worker whose state entry names none.
pub const DEFAULT_VERSION_GROUP: &str = "default";

/// One entry of `tandem up --state-file`.
#[derive(Debug, serde::Deserialize)]
struct StateEntry {
    role: String,
    pid: u32,
    grpc: Option<String>,
    http: Option<String>,
    metrics: Option<String>,
    transfer: Option<String>,
    version_group: Option<String>,
    /// Workers: their etcd lease TTL, whole seconds.
    lease_ttl_s: Option<u64>,
    /// The file its stdout and stderr go to.
    log: Option<PathBuf>,
}

#[derive(Debug, serde::Deserialize)]
struct StateFile {
    components: Vec<StateEntry>,
}

impl Cluster {
    /// Attaches to a cluster already running, as `tandem up --state-file STATE` describes it:
    /// every process is [adopted](Proc::adopt) (never signalled unless a drill's fault does,
    /// never killed on drop). Workers are named `prefill-N`/`decode-N` in the file's order; a
    /// worker entry without `version_group` is in [`DEFAULT_VERSION_GROUP`]; the lease TTL is
    /// the longest of the workers' `lease_ttl_s`; each process's `log` is scanned by G5. Fails
    /// unless every worker lists its lease TTL, every listed process is running and the
    /// coordinator is ready and counts every listed worker as serving.
    pub async fn attach(state: &Path) -> Result<Self, HarnessError> {
        let text = std::fs::read_to_string(state)
            .map_err(|e| HarnessError::Setup(format!("read the state file {}: {e}", state.display())))?;
        let file: StateFile = serde_json::from_str(&text)
            .map_err(|e| HarnessError::Setup(format!("state file {}: {e}", state.display())))?;
        let mut etcd = None;
        let mut workers = Vec::new();
        let mut coordinators = Vec::new();
        let mut counts = BTreeMap::<Role, usize>::new();
        let mut lease_ttl = Duration::ZERO;
        for e in file.components {
            if matches!(crate::process::proc_state(e.pid), None | Some('Z')) {
                return Err(HarnessError::Setup(format!(
                    "{} (pid {}) listed in {} is not running",
                    e.role,
                    e.pid,
                    state.display()
                )));
            }
            let addrs: std::collections::HashMap<String, String> =
                [("grpc", &e.grpc), ("http", &e.http), ("metrics", &e.metrics), ("transfer", &e.transfer)]
                    .into_iter()
                    .filter_map(|(k, v)| v.clone().map(|v| (k.to_owned(), v)))
                    .collect();
            let role = match e.role.as_str() {
                "etcd" => {
                    etcd = Some(Proc::adopt("etcd", e.pid, addrs, e.log));
                    continue;
                }
                "coordinator" => {
                    let name = if coordinators.is_empty() {
                        "coordinator".into()
                    } else {
                        format!("coordinator-{}", coordinators.len())
                    };
                    coordinators.push(Proc::adopt(&name, e.pid, addrs, e.log));
                    continue;
                }
                "prefill" => Role::Prefill,
                "decode" => Role::Decode,
                other => {
                    return Err(HarnessError::Setup(format!("{}: unknown role {other:?}", state.display())));
                }
            };
            let n = counts.entry(role).or_insert(0);
            let name = format!("{}-{n}", e.role);
            *n += 1;
            let ttl = e.lease_ttl_s.ok_or_else(|| {
                HarnessError::Setup(format!(
                    "{name} (pid {}) in {} has no lease_ttl_s (written by an older `tandem up`? restart it)",
                    e.pid,
                    state.display()
                ))
            })?;
            lease_ttl = lease_ttl.max(Duration::from_secs(ttl));
            workers.push(Worker {
                role,
                group: e.version_group.unwrap_or_else(|| DEFAULT_VERSION_GROUP.to_owned()),
                proc: Proc::adopt(&name, e.pid, addrs, e.log),
                proxy: None,
                past: Vec::new(),
                etcd_path: None,
                netns: None,
            });
        }
        let mut coordinators = coordinators.into_iter();
        let coordinator = coordinators
            .next()
            .ok_or_else(|| HarnessError::Setup(format!("{} lists no coordinator", state.display())))?;
        let mut cluster = Self {
            etcd: registry::testing::EtcdCluster::none(),
            etcd_proxies: BTreeMap::new(),
            attached: Some(Attached { state: state.to_owned(), etcd, log_starts: BTreeMap::new() }),
            lease_ttl,
            workers,
            coordinator,
            other_coordinators: coordinators.collect(),
            front: None,
            client_proxy: None,
            control_proxies: BTreeMap::new(),
            coordinator_kills: Vec::new(),
            prefix: String::new(),
            log_dir: temp_dir()?,
            faulted: BTreeMap::new(),
            keep_logs: false,
        };
        let starts = cluster
            .log_paths()
            .into_iter()
            .map(|(_, p)| {
                let len = std::fs::metadata(&p).map_or(0, |m| m.len());
                (p, len)
            })
            .collect();
        if let Some(a) = cluster.attached.as_mut() {
            a.log_starts = starts;
        }
        cluster.wait_ready().await?;
        Ok(cluster)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn attaching_to_a_state_file_whose_process_is_gone_is_an_error() {
        let dir = temp_dir().expect("dir");
        let state = dir.join("state.json");
        // pid_max is at most 2^22: this pid is never running.
        std::fs::write(&state, r#"{"components":[{"role":"coordinator","pid":4194304,"http":"127.0.0.1:1"}]}"#)
            .expect("write");
        let e = Cluster::attach(&state).await.expect_err("a dead coordinator");
        assert!(e.to_string().contains("is not running"), "{e}");
        std::fs::write(&state, r#"{"components":[]}"#).expect("write");
        let e = Cluster::attach(&state).await.expect_err("no coordinator");
        assert!(e.to_string().contains("no coordinator"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
