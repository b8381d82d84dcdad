//! The direct path's pieces that need no UCX: which process a sender is
//! (and whether it is gone), and the decode pool's memory as handed to the
//! engine.
//!
//! Direct writes go straight into the decode worker's pool, so a writer
//! that is not fenced must never see its blocks reused. A sender that says
//! `Fenced`, `Abort` or `Bye` has stored everything it will (its stores are
//! its connection thread's own, made before that message). One whose
//! control connection failed may still be alive and storing (a blackholed
//! control link while its stores go through shared memory), so its blocks
//! stay quarantined until its *process* is gone — which the server can see
//! only for a process on its own host, named by pid and start time in
//! `/proc`. That is why only such a sender is offered the pool.

use std::sync::Arc;

use super::wire::ProcessId;

impl ProcessId {
    /// This process.
    pub(super) fn me() -> Self {
        let pid = std::process::id();
        Self { pid, start: start_time(pid).unwrap_or(0) }
    }

    /// Whether this process still runs, as `/proc` shows it: `false` once
    /// it exited (no entry, a zombie, or another process under its pid).
    pub(super) fn alive(&self) -> bool {
        self.pid != 0 && self.start != 0 && start_time(self.pid) == Some(self.start)
    }
}

/// Field 22 (start time) of `/proc/<pid>/stat`, unless the process is
/// gone or a zombie.
fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold anything.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    if matches!(fields.first(), Some(&"Z") | Some(&"X") | None) {
        return None;
    }
    fields.get(19)?.parse().ok()
}

/// The decode pool's memory, allocated and registered by the UCX server
/// ([`UcxServerConfig::pool_blocks`](super::UcxServerConfig::pool_blocks)),
/// for the engine's pool to adopt (`KvPool::adopt`, through
/// [`into_shared`](Self::into_shared)). It stays mapped
/// while this value, or what it became, lives: the server thread leaves it
/// mapped at exit if the engine still holds it.
#[derive(Debug)]
pub struct UcxPoolMemory {
    pub(super) addr: usize,
    pub(super) len: usize,
    pub(super) lease: Arc<()>,
}

impl UcxPoolMemory {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The memory as the engine's pool adopts it.
    #[allow(unsafe_code)]
    pub fn into_shared(self) -> types::memory::SharedMemory {
        let ptr = std::ptr::NonNull::new(self.addr as *mut u8).unwrap_or(std::ptr::NonNull::dangling());
        // SAFETY: `addr..addr + len` is the UCX allocation the server made
        // (never null: `ucx_sys::Context::map` checks), zeroed, and the server
        // unmaps it only once no lease clone is left; the owner below holds one.
        // No Rust reference into it exists in this process: the server reads
        // it through raw pointers only. Peers write it only as the UCX
        // transport's fence allows (see the module doc and `SharedMemory`).
        unsafe { types::memory::SharedMemory::new(ptr, self.len, Box::new(self.lease)) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_alive_and_a_made_up_one_is_not() {
        let me = ProcessId::me();
        assert!(me.start > 0, "a start time from /proc");
        assert!(me.alive());
        assert!(!ProcessId { start: me.start + 1, ..me }.alive(), "another start time is another process");
        assert!(!ProcessId { pid: 0, start: 0 }.alive());
    }

    #[test]
    fn a_killed_child_is_gone_once_it_exits() {
        let mut child = std::process::Command::new("sleep").arg("30").spawn().expect("spawn sleep");
        let p = ProcessId { pid: child.id(), start: start_time(child.id()).expect("a running child's start time") };
        assert!(p.alive());
        child.kill().expect("kill");
        child.wait().expect("wait");
        assert!(!p.alive(), "reaped: no /proc entry, or another process under the pid");
    }
}
