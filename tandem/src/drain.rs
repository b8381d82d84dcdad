//! `tandem drain NAME`: drain one component of a running cluster, addressed by its name in
//! the cluster's state file (`tandem up --state-file`, or one written by hand with action
//! templates), and wait for the drain to end.
//!
//! Draining is what a component does on SIGTERM, sent through its `term` action (the
//! state file's template, else `kill -TERM {pid}`): a worker marks its registration
//! draining, takes no new work, finishes what it runs within its shutdown grace, then
//! exits; a coordinator hands its running streams to a peer. This command sends that
//! and then follows the component until its process has exited: through the state file
//! where a supervisor keeps it (a new pid, or the state leaving `running`), else by the
//! process disappearing from this host. Under a supervisor that restarts it, it also
//! waits for the new process, so a rolling restart is `tandem drain` over the names in
//! turn.

#![allow(clippy::disallowed_types, reason = "the drain's duration is wall time, read in a synchronous command")]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use facts::state::{flag, Action, Component, Role, State, StateFile};

#[derive(clap::Args)]
pub struct Args {
    /// The component, as the state file names it (`decode-0`, `prefill-1`, `coordinator`).
    pub name: String,
    /// The cluster's state file (what `tandem up --state-file` writes).
    #[arg(long)]
    pub state_file: PathBuf,
    /// Longest wait for the process to exit, ms; default: the component's recorded
    /// `shutdown-timeout-ms` plus 10 s, else 60 s.
    #[arg(long)]
    pub timeout_ms: Option<u64>,
    /// Only send the signal; do not wait for the drain to end.
    #[arg(long)]
    pub no_wait: bool,
}

pub fn run(a: Args) -> Result<()> {
    let file = read(&a.state_file)?;
    let c = file.component(&a.name).cloned().with_context(|| {
        let names: Vec<&str> = file.components.iter().map(|c| c.name.as_str()).collect();
        format!("{} lists no component `{}` (it lists: {})", a.state_file.display(), a.name, names.join(", "))
    })?;
    if c.role == Role::Etcd {
        bail!("{} is an etcd member: members do not drain (stop one with its `term` action yourself)", c.name);
    }
    if c.state != State::Running {
        bail!("{} is not running (state {}): nothing to drain", c.name, c.state.as_str());
    }
    let timeout = Duration::from_millis(a.timeout_ms.unwrap_or_else(|| default_timeout_ms(&c)));
    let cmd = c.actions().command(Action::Term, c.pid, None).map_err(anyhow::Error::msg)?;
    let supervised = file.restart.is_some();
    let start = Instant::now();
    let out = std::process::Command::new("sh")
        .args(["-c", &cmd])
        .output()
        .with_context(|| format!("running {}'s `term` action `{cmd}`", c.name))?;
    if !out.status.success() {
        bail!(
            "{}'s `term` action `{cmd}` failed ({}): {}",
            c.name,
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    eprintln!("tandem drain: {} (pid {}): asked to drain (`{cmd}`)", c.name, c.pid);
    if a.no_wait {
        return Ok(());
    }
    let exited = wait_for(&format!("{} (pid {}) exiting", c.name, c.pid), timeout, || {
        if supervised {
            let now = read(&a.state_file)?;
            let e = now.component(&c.name).with_context(|| format!("{} left the state file", c.name))?;
            Ok((e.pid != c.pid || e.state != State::Running || e.restarts != c.restarts).then(|| e.clone()))
        } else {
            Ok(gone(c.pid).then(|| c.clone()))
        }
    })?;
    let took = start.elapsed();
    let how = exited.last_exit.as_deref().filter(|_| supervised).unwrap_or("exited");
    println!("{} (pid {}) drained in {:.2} s: {how}", c.name, c.pid, took.as_secs_f64());
    if !supervised {
        return Ok(());
    }
    // Its supervisor decides what comes next: a new process, or none.
    let next = wait_for(&format!("{}'s supervisor starting it again or leaving it down", c.name), timeout, || {
        let now = read(&a.state_file)?;
        let e = now.component(&c.name).with_context(|| format!("{} left the state file", c.name))?;
        let settled = (e.state == State::Running && e.pid != c.pid) || e.state.is_down();
        Ok(settled.then(|| e.clone()))
    })?;
    if next.state == State::Running {
        println!("{} restarted by its supervisor as pid {} (restart {})", c.name, next.pid, next.restarts);
    } else {
        println!("{} left down by its supervisor (state {})", c.name, next.state.as_str());
    }
    Ok(())
}

fn read(path: &Path) -> Result<StateFile> {
    StateFile::read(path).map_err(|e| anyhow::anyhow!("{e} (is a cluster running? `tandem up --state-file` writes it)"))
}

/// The component's own drain grace plus 10 s, else 60 s.
fn default_timeout_ms(c: &Component) -> u64 {
    c.flags.get(flag::SHUTDOWN_TIMEOUT_MS).and_then(|v| v.parse::<u64>().ok()).map_or(60_000, |g| g + 10_000)
}

/// Polls `probe` (opskit's bounded wait) until it returns a value, for at most `limit`;
/// an error from `probe` ends the wait at once.
fn wait_for<T>(what: &str, limit: Duration, mut probe: impl FnMut() -> Result<Option<T>>) -> Result<T> {
    opskit::wait::blocking::poll(what, limit, || Ok::<_, std::convert::Infallible>(probe().transpose()))?
}

/// The process is gone from this host (or a zombie its parent has not reaped).
fn gone(pid: u32) -> bool {
    matches!(opskit::process::proc_state(pid), None | Some('Z'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_wait_is_the_recorded_grace_plus_ten_seconds() {
        let mut c = Component::new(Role::Decode, "decode-0");
        assert_eq!(default_timeout_ms(&c), 60_000);
        c.flags.insert(flag::SHUTDOWN_TIMEOUT_MS.into(), "5000".into());
        assert_eq!(default_timeout_ms(&c), 15_000);
        c.flags.insert(flag::SHUTDOWN_TIMEOUT_MS.into(), "soon".into());
        assert_eq!(default_timeout_ms(&c), 60_000);
    }

    #[test]
    fn this_process_is_not_gone_and_a_reaped_child_is() {
        assert!(!gone(std::process::id()));
        let mut child = std::process::Command::new("true").spawn().expect("spawn");
        let pid = child.id();
        child.wait().expect("wait");
        assert!(gone(pid));
    }
}
