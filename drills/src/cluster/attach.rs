//! [`Cluster::attach`]: a cluster someone else started (`tandem up --state-file`),
//! adopted so drills can run against it and leave it as found.
//!
//! `tandem up` supervises its processes: one that exits is started again on the same
//! addresses, its log appended, and the state file rewritten with the new pid. A drill
//! whose victim exits (a kill, a drain) therefore does not start it again itself: it
//! waits until the state file shows the supervisor did ([`Cluster::await_restart`]) and
//! follows the new pid, so the later checks (KV settled, logs, every process running)
//! see the cluster as it is.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::{temp_dir, Cluster, PastLife, Role, Worker};
use crate::metrics::scrape;
use crate::process::Proc;
use crate::HarnessError;
use facts::state::{Action, Component, Role as Kind, State, StateFile};

/// What an [attached](Cluster::attach) cluster was found as.
#[derive(Debug)]
pub struct Attached {
    /// The state file it was read from.
    pub state: PathBuf,
    /// Its etcd members the state file lists (adopted: left running), under their names
    /// there (`etcd`; `etcd-0`, `etcd-1`, ... for `tandem up --etcd-members 3`).
    pub etcd: Vec<Proc>,
    /// Each log's length when the drill attached: G5 reads only what was written after,
    /// so a panic from before the drill (already reported, or the operator's to look at)
    /// does not fail this drill and every later one.
    pub log_starts: BTreeMap<PathBuf, u64>,
    /// What its supervisor does with a process that exits (`never`, `on-failure`, `always`);
    /// `None`: the state file names no policy (a `tandem up` that did not restart anything).
    pub restart: Option<String>,
    /// Each component's `restarts` as last read from the state file, by name.
    pub restarts: BTreeMap<String, u32>,
    /// Each worker's KV counters when the drill attached (`tandem_kv_transfer_bytes_total`,
    /// `tandem_kv_received_bytes_total`): G3 counts only what moved during the drill, since
    /// an earlier drill's SIGKILL leaves totals no check can balance.
    pub kv_at_attach: BTreeMap<String, (f64, f64)>,
    /// Link changes the drill made through `link-fault` templates and has not undone yet, by
    /// process name; undone when the drill ends.
    pub link_rules: super::links::Held,
    /// Packets the etcd-link rules of each worker dropped, counted when they were deleted.
    pub etcd_dropped: std::sync::Mutex<BTreeMap<String, u64>>,
    /// Each decode worker's KV reservation lease (ms), where the state file gives it.
    pub reservation_ttls: BTreeMap<String, u64>,
    /// Each worker's metrics page when the drill attached: proofs that count a worker's
    /// events count those since ([`Cluster::page_at_attach`]).
    pub pages_at_attach: BTreeMap<String, crate::metrics::Page>,
    /// Each component's settings the state file gives (`flags`), by name.
    pub flags: BTreeMap<String, BTreeMap<String, String>>,
    /// Each component's network namespace the state file gives (`netns`), by name.
    pub netns: BTreeMap<String, String>,
}

/// A component the supervisor started again ([`Cluster::await_restart`]).
#[derive(Debug, Clone)]
pub struct Restarted {
    pub pid: u32,
    /// Its `restarts` in the state file now.
    pub restarts: u32,
    /// How the previous process ended, as the supervisor saw it (`exit status 0`,
    /// `signal 9 (SIGKILL)`).
    pub last_exit: Option<String>,
}

/// How long [`Cluster::attach`] waits for a component the supervisor is restarting.
const RESTARTING_WAIT: Duration = Duration::from_secs(60);

/// The version group of a worker whose state entry names none.
pub const DEFAULT_VERSION_GROUP: &str = "default";

fn read_state(state: &Path) -> Result<StateFile, HarnessError> {
    StateFile::read(state).map_err(|e| HarnessError::Setup(e.to_string()))
}

/// `exit status 3` or `signal 9 (SIGKILL)` (how `tandem up` describes an exit) as a status.
pub fn parse_exit(described: &str) -> Option<std::process::ExitStatus> {
    use std::os::unix::process::ExitStatusExt;
    if let Some(code) = described.strip_prefix("exit status ") {
        return code.trim().parse::<i32>().ok().map(|c| std::process::ExitStatus::from_raw(c << 8));
    }
    let sig = described.strip_prefix("signal ")?.split_whitespace().next()?.parse::<i32>().ok()?;
    Some(std::process::ExitStatus::from_raw(sig))
}

/// Reads `state` until no component is `restarting` (bounded by `limit`); refuses one
/// that is down for good (`exited`, `given_up`).
async fn settled_state(state: &Path, limit: Duration) -> Result<StateFile, HarnessError> {
    let until = tokio::time::Instant::now() + limit;
    loop {
        let file = read_state(state)?;
        let down = |e: &Component| format!("{} (pid {})", e.name, e.pid);
        if let Some(e) = file.components.iter().find(|e| e.state.is_down()) {
            return Err(HarnessError::Setup(format!(
                "{} in {} is {} (last exit: {}): its supervisor will not start it again, so the cluster is \
                 not whole; restart `tandem up`",
                down(e),
                state.display(),
                e.state.as_str(),
                e.last_exit.as_deref().unwrap_or("unknown")
            )));
        }
        let Some(e) = file.components.iter().find(|e| e.state == State::Restarting) else {
            return Ok(file);
        };
        if tokio::time::Instant::now() > until {
            return Err(HarnessError::Timeout(format!(
                "{} in {} was still restarting after {limit:?} (restart {}, last exit: {}): attach once it runs",
                down(e),
                state.display(),
                e.restarts + 1,
                e.last_exit.as_deref().unwrap_or("unknown")
            )));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

impl Cluster {
    /// Attaches to a cluster already running, as `tandem up --state-file STATE` describes it:
    /// every process is [adopted](Proc::adopt) (never signalled unless a drill's fault does,
    /// never killed on drop), under the names the file gives them; a
    /// worker entry without `version_group` is in the group `default`; the lease TTL is
    /// the longest of the workers' `lease_ttl_s`; each process's `log` is scanned by G5. Fails
    /// unless every worker lists its lease TTL, every listed process is running and the
    /// coordinator is ready and counts every listed worker as serving. A component its
    /// supervisor is restarting is waited for (bounded); one it left down is refused. Drill
    /// traffic carries `api_key` ([`Cluster::api_key`]; [`Cluster::keyed`] says whether the
    /// cluster needs one).
    pub async fn attach(state: &Path, api_key: Option<&str>) -> Result<Self, HarnessError> {
        let file = settled_state(state, RESTARTING_WAIT).await?;
        let restart = file.restart.clone();
        let restarts = file.components.iter().map(|e| (e.name.clone(), e.restarts)).collect();
        let reservation_ttls =
            file.components.iter().filter_map(|e| Some((e.name.clone(), e.reservation_ttl_ms?))).collect();
        let flags = file.components.iter().map(|e| (e.name.clone(), e.flags.clone())).collect();
        let netns = file.components.iter().filter_map(|e| Some((e.name.clone(), e.netns.clone()?))).collect();
        let mut etcd = Vec::new();
        let mut workers = Vec::new();
        let mut coordinators = Vec::new();
        let mut lease_ttl = Duration::ZERO;
        for e in file.components {
            if matches!(crate::process::proc_state(e.pid), None | Some('Z')) {
                return Err(HarnessError::Setup(format!(
                    "{} (pid {}) listed in {} is not running",
                    e.name,
                    e.pid,
                    state.display()
                )));
            }
            let addrs: std::collections::HashMap<String, String> =
                e.addrs().map(|(k, v)| (k.to_owned(), v.clone())).collect();
            let actions = e.actions();
            let adopt = |name: &str, log| Proc::adopt(name, e.pid, addrs.clone(), log).with_actions(actions.clone());
            let role = match e.role {
                Kind::Etcd => {
                    etcd.push(adopt(&e.name, e.log.clone()));
                    continue;
                }
                Kind::Coordinator => {
                    let name = if coordinators.is_empty() {
                        "coordinator".into()
                    } else {
                        format!("coordinator-{}", coordinators.len())
                    };
                    coordinators.push(adopt(&name, e.log.clone()));
                    continue;
                }
                Kind::Prefill => Role::Prefill,
                Kind::Decode => Role::Decode,
            };
            let name = e.name.clone();
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
                proc: adopt(&name, e.log.clone()),
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
            etcd: opskit::etcd::EtcdCluster::none(),
            etcd_proxies: BTreeMap::new(),
            attached: Some(Attached {
                state: state.to_owned(),
                etcd,
                log_starts: BTreeMap::new(),
                restart,
                restarts,
                kv_at_attach: BTreeMap::new(),
                link_rules: Default::default(),
                etcd_dropped: Default::default(),
                reservation_ttls,
                pages_at_attach: BTreeMap::new(),
                flags,
                netns,
            }),
            lease_ttl,
            workers,
            coordinator,
            other_coordinators: coordinators.collect(),
            front: None,
            grpc_front: None,
            client_proxy: None,
            control_proxies: BTreeMap::new(),
            coordinator_kills: Vec::new(),
            api_key: api_key.map(str::to_owned),
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
        let mut kv = BTreeMap::new();
        let mut pages = BTreeMap::new();
        for w in &cluster.workers {
            let p = scrape(&w.metrics_addr()?).await?;
            let moved = crate::invariants::kv_moved(w.role, &p).map_err(HarnessError::Metrics)?;
            let counted = if w.role == Role::Prefill { (moved, 0.0) } else { (0.0, moved) };
            kv.insert(w.proc.name.clone(), counted);
            pages.insert(w.proc.name.clone(), p);
        }
        if let Some(a) = cluster.attached.as_mut() {
            a.kv_at_attach = kv;
            a.pages_at_attach = pages;
        }
        Ok(cluster)
    }

    /// Worker `name`'s metrics page when an attached cluster was attached; `None` for the
    /// drill's own cluster (its counters start at zero).
    pub fn page_at_attach(&self, name: &str) -> Option<&crate::metrics::Page> {
        self.attached.as_ref().and_then(|a| a.pages_at_attach.get(name))
    }

    /// The attached cluster's restart policy (`never`, `on-failure`, `always`); `None` when
    /// the cluster is ours or its state file names none.
    pub fn restart_policy(&self) -> Option<&str> {
        self.attached.as_ref().and_then(|a| a.restart.as_deref())
    }

    /// Waits (up to `limit`) until the attached cluster's supervisor has started process
    /// `name` (pid `old_pid`, which exited) again: the state file lists it `running` under a
    /// new pid with `restarts` one higher than before; then follows the new pid (it is no
    /// longer counted as faulted: it must run at the end) and waits until the coordinator
    /// counts every worker as serving. A worker killed without a last scrape is recorded as
    /// a life whose KV G3 cannot count.
    pub async fn await_restart(
        &mut self,
        name: &str,
        old_pid: u32,
        limit: Duration,
    ) -> Result<Restarted, HarnessError> {
        let r = self.follow_restart(name, old_pid, limit).await?;
        self.wait_ready().await?;
        Ok(r)
    }

    /// [`Cluster::await_restart`] without the wait for every worker serving (chaos lifts a
    /// kill while other faults may be held); `name` may also be an etcd member.
    pub async fn follow_restart(
        &mut self,
        name: &str,
        old_pid: u32,
        limit: Duration,
    ) -> Result<Restarted, HarnessError> {
        let a = self.attached.as_ref().ok_or_else(|| {
            HarnessError::Setup(format!("{name}: this drill's own cluster has no supervisor to restart it"))
        })?;
        let (state, want) = (a.state.clone(), a.restarts.get(name).copied().unwrap_or(0) + 1);
        let restart =
            self.any_proc_mut(name)?.actions().and_then(|x| x.template(Action::Restart).is_some().then(|| x.clone()));
        if let Some(actions) = restart {
            return self.restart_by_template(name, old_pid, &actions, &state, want, limit).await;
        }
        let mut found = None;
        let mut seen = String::from("not listed");
        let what = format!(
            "the supervisor restarts {name} (pid {old_pid}): {} lists it running under a new pid with restarts {want}",
            state.display()
        );
        let r = crate::eventually(&what, limit, || {
            let entry = read_state(&state)
                .ok()
                .and_then(|f| f.components.into_iter().find(|e| e.name == name || e.role.as_str() == name));
            if let Some(e) = entry {
                seen = format!(
                    "pid {}, state {}, restarts {}, last exit {}",
                    e.pid,
                    e.state.as_str(),
                    e.restarts,
                    e.last_exit.as_deref().unwrap_or("none")
                );
                let alive = !matches!(crate::process::proc_state(e.pid), None | Some('Z'));
                if e.state == State::Running && e.pid != old_pid && e.restarts >= want && alive {
                    found = Some(Restarted { pid: e.pid, restarts: e.restarts, last_exit: e.last_exit });
                }
            }
            std::future::ready(found.is_some())
        })
        .await;
        if let Err(e) = r {
            return Err(HarnessError::Timeout(format!("{e}; last seen: {seen}")));
        }
        let restarted = found.ok_or_else(|| HarnessError::Fault(format!("{what}: not found")))?;
        self.follow(name, old_pid, &restarted)?;
        Ok(restarted)
    }

    /// Follows `name`'s new process after a restart (its old one, `old_pid`, exited): a
    /// worker's old life is one G3 cannot count; it is no longer faulted (it must run at
    /// the end).
    fn follow(&mut self, name: &str, old_pid: u32, restarted: &Restarted) -> Result<(), HarnessError> {
        if let Ok(w) = self.worker_mut(name) {
            if !w.past.iter().any(|l| l.pid == old_pid) {
                w.past.push(PastLife::uncounted(old_pid, &w.group));
            }
        }
        self.any_proc_mut(name)?.supervisor_restarted(restarted.pid)?;
        self.faulted.remove(name);
        if let Some(a) = self.attached.as_mut() {
            a.restarts.insert(name.to_owned(), restarted.restarts);
        }
        Ok(())
    }

    /// The attached cluster's etcd members.
    pub fn attached_etcd(&self) -> impl Iterator<Item = &Proc> {
        self.attached.iter().flat_map(|a| &a.etcd)
    }

    /// Whether drill traffic can reach the attached coordinators: Err when their tenants
    /// file (the state file's `tenants` flag) lets in only keys and none was given.
    pub fn keyed(&self) -> Result<(), String> {
        if self.api_key.is_some() {
            return Ok(());
        }
        let tenants =
            self.coordinators().find_map(|p| Some((&p.name, self.flag(&p.name, facts::state::flag::TENANTS)?)));
        match tenants {
            Some((name, file)) => Err(format!(
                "{name} takes only the API keys its tenants file {file} lists, and drill traffic was given none \
                 (`--api-key KEY`, or TANDEM_API_KEY)"
            )),
            None => Ok(()),
        }
    }

    /// A POST to `path` of the coordinator (or front) at `addr` as drill traffic: with the
    /// drills' API key ([`Cluster::api_key`]) where there is one.
    pub fn post(&self, addr: &str, path: &str) -> opskit::http::Request {
        let r = opskit::http::Request::post(addr, path);
        match &self.api_key {
            Some(k) => r.header("authorization", &format!("Bearer {k}")),
            None => r,
        }
    }

    /// Process `name`: a worker, a coordinator or an attached etcd member.
    pub fn any_proc_mut(&mut self, name: &str) -> Result<&mut Proc, HarnessError> {
        let etcd = self.attached.iter_mut().flat_map(|a| a.etcd.iter_mut());
        let procs = self
            .workers
            .iter_mut()
            .map(|w| &mut w.proc)
            .chain(std::iter::once(&mut self.coordinator))
            .chain(self.other_coordinators.iter_mut());
        procs.chain(etcd).find(|p| p.name == name).ok_or_else(|| HarnessError::Setup(format!("no process {name}")))
    }

    /// Starts `name` again with its state file's `restart` template once its process
    /// (`old_pid`) has exited: the template's last line of output is the new pid, which must
    /// be running; the state file's entry is rewritten with it (pid, `running`, `restarts`
    /// `want`), so the next drill attaching finds the live process.
    async fn restart_by_template(
        &mut self,
        name: &str,
        old_pid: u32,
        actions: &facts::state::Actions,
        state: &Path,
        want: u32,
        limit: Duration,
    ) -> Result<Restarted, HarnessError> {
        let gone = format!("{name} (pid {old_pid}) has exited, before its restart template runs");
        crate::eventually(&gone, limit, || {
            std::future::ready(matches!(crate::process::proc_state(old_pid), None | Some('Z')))
        })
        .await?;
        let command = actions.command(Action::Restart, old_pid, None).map_err(HarnessError::Fault)?;
        let out = tokio::task::spawn_blocking(move || crate::process::run_shell(&command, crate::process::ACTION_WAIT))
            .await
            .map_err(|e| HarnessError::Fault(format!("{name}'s restart template: {e}")))??;
        let last = out.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("").trim();
        let pid: u32 = last.parse().ok().filter(|p| *p != 0).ok_or_else(|| {
            HarnessError::Fault(format!(
                "{name}'s restart template printed no pid as its last line (it printed {out:?})"
            ))
        })?;
        if matches!(crate::process::proc_state(pid), None | Some('Z')) {
            return Err(HarnessError::Fault(format!(
                "{name}'s restart template printed pid {pid}, which is not running"
            )));
        }
        let mut file = read_state(state)?;
        let entry = file
            .components
            .iter_mut()
            .find(|e| e.name == name)
            .ok_or_else(|| HarnessError::Setup(format!("{name} is no longer listed in {}", state.display())))?;
        entry.pid = pid;
        entry.state = State::Running;
        entry.restarts = want;
        entry.last_exit = Some("restarted by its restart template".into());
        file.write(state).map_err(|e| HarnessError::Setup(e.to_string()))?;
        let restarted = Restarted { pid, restarts: want, last_exit: None };
        self.follow(name, old_pid, &restarted)?;
        Ok(restarted)
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
        std::fs::write(&state, r#"{"components":[{"role":"coordinator","name":"coordinator","pid":4194304,"state":"running","http":"127.0.0.1:1"}]}"#)
            .expect("write");
        let e = Cluster::attach(&state, None).await.expect_err("a dead coordinator");
        assert!(e.to_string().contains("is not running"), "{e}");
        std::fs::write(&state, r#"{"components":[]}"#).expect("write");
        let e = Cluster::attach(&state, None).await.expect_err("no coordinator");
        assert!(e.to_string().contains("no coordinator"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn a_component_restarting_is_waited_for_and_one_left_down_refused() {
        let dir = temp_dir().expect("dir");
        let state = dir.join("state.json");
        let me = std::process::id();
        let file = |s: &str| {
            format!(
                r#"{{"restart":"always","components":[{{"role":"decode","name":"decode-0","pid":{me},"state":"{s}",
                "restarts":2,"last_exit":"signal 9 (SIGKILL)"}}]}}"#
            )
        };
        std::fs::write(&state, file("restarting")).expect("write");
        let e = settled_state(&state, Duration::from_millis(300)).await.expect_err("still restarting");
        let e = e.to_string();
        assert!(e.contains("decode-0") && e.contains("still restarting") && e.contains("restart 3"), "{e}");
        // It runs again while attach waits.
        let later = {
            let (state, running) = (state.clone(), file("running"));
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(300)).await;
                std::fs::write(&state, running).expect("write");
            })
        };
        let f = settled_state(&state, Duration::from_secs(10)).await.expect("it runs");
        assert_eq!((f.restart.as_deref(), f.components[0].restarts), (Some("always"), 2));
        later.await.expect("writer");
        for down in ["exited", "given_up"] {
            std::fs::write(&state, file(down)).expect("write");
            let e = Cluster::attach(&state, None).await.expect_err("left down").to_string();
            assert!(e.contains("decode-0") && e.contains(down) && e.contains("SIGKILL"), "{e}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn exits_read_as_tandem_up_describes_them() {
        assert_eq!(parse_exit("exit status 0").and_then(|s| s.code()), Some(0));
        assert_eq!(parse_exit("exit status 3").and_then(|s| s.code()), Some(3));
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(parse_exit("signal 9 (SIGKILL)").and_then(|s| s.signal()), Some(9));
        assert!(parse_exit("start failed: no such file").is_none());
    }
}
