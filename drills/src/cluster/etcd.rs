//! The cluster's etcd members, whoever started them: the drill's own
//! ([`opskit::etcd::EtcdCluster`], members named `etcd-m0`, ...) or an
//! attached cluster's (named as its state file names them, acted on through
//! its templates, started again by its supervisor or `restart` template).
//! Etcd drills use these calls, so one drill body runs on both.

use std::time::Duration;

use super::Cluster;
use crate::process::{proc_state, Signal};
use crate::HarnessError;

/// How long an attached member may take to be started again after a kill.
const MEMBER_RESTART_WAIT: Duration = Duration::from_secs(60);

impl Cluster {
    /// How many etcd members the cluster has.
    pub fn etcd_len(&self) -> usize {
        match &self.attached {
            Some(a) => a.etcd.len(),
            None => self.etcd.len(),
        }
    }

    /// Member `i`'s name (`etcd-m0` for our own; the state file's for an attached one).
    pub fn etcd_name(&self, i: usize) -> String {
        match &self.attached {
            Some(a) => a.etcd.get(i).map_or_else(|| format!("etcd member {i}"), |p| p.name.clone()),
            None => format!("etcd-{}", self.etcd.name(i)),
        }
    }

    /// Member `i`'s pid while it runs.
    pub fn etcd_pid(&self, i: usize) -> Option<u32> {
        match &self.attached {
            Some(a) => a.etcd.get(i).map(|p| p.pid).filter(|&pid| !matches!(proc_state(pid), None | Some('Z'))),
            None => self.etcd.pid(i),
        }
    }

    /// The member that says it leads, if one does. An attached member is asked whatever its
    /// pid: its supervisor may have started it again before the drill followed the new pid.
    pub async fn etcd_leader(&self) -> Option<usize> {
        let Some(a) = &self.attached else { return self.etcd.leader().await };
        for (i, p) in a.etcd.iter().enumerate() {
            let Ok(addr) = p.addr("grpc") else { continue };
            if opskit::etcd::is_leader(&format!("http://{addr}")).await {
                return Some(i);
            }
        }
        None
    }

    /// SIGKILLs member `i` and waits for its exit; the pid it had (`None`: not running).
    /// Recorded as faulted until [`Cluster::etcd_restart`].
    pub async fn etcd_kill(&mut self, i: usize) -> Result<Option<u32>, HarnessError> {
        let name = self.etcd_name(i);
        let Some(a) = self.attached.as_mut() else {
            let pid = self.etcd.kill(i);
            self.faulted.insert(name, Signal::Kill);
            return Ok(pid);
        };
        let p = a.etcd.get_mut(i).ok_or_else(|| HarnessError::Setup(format!("no {name}")))?;
        if matches!(proc_state(p.pid), None | Some('Z')) {
            return Ok(None);
        }
        let pid = p.pid;
        p.signal(Signal::Kill)?;
        p.wait_exit(Duration::from_secs(10)).await?;
        self.faulted.insert(name, Signal::Kill);
        Ok(Some(pid))
    }

    /// Member `i` running again after [`Cluster::etcd_kill`]: our own is started on its
    /// ports and data (and answers a linearizable read, which needs a quorum); an attached
    /// one is waited for until its supervisor or `restart` template started it (`old_pid`:
    /// the pid it was killed as).
    pub async fn etcd_restart(&mut self, i: usize, old_pid: Option<u32>) -> Result<(), HarnessError> {
        let name = self.etcd_name(i);
        if self.attached.is_none() {
            self.etcd.restart(i).await.map_err(|e| HarnessError::Fault(format!("restarting {name}: {e}")))?;
        } else if let Some(old) = old_pid {
            self.follow_restart(&name, old, MEMBER_RESTART_WAIT).await?;
        }
        self.faulted.remove(&name);
        Ok(())
    }

    /// Sends `sig` (SIGSTOP, SIGCONT) to member `i`, through its template when attached.
    pub fn etcd_signal(&self, i: usize, sig: Signal) -> Result<(), HarnessError> {
        let pid = match &self.attached {
            Some(a) => {
                let p = a.etcd.get(i).ok_or_else(|| HarnessError::Setup(format!("no {}", self.etcd_name(i))))?;
                return Ok(p.signal(sig)?);
            }
            None => {
                self.etcd.pid(i).ok_or_else(|| HarnessError::Fault(format!("{} is not running", self.etcd_name(i))))?
            }
        };
        Ok(crate::process::signal(pid, sig)?)
    }
}
