//! Where and how eagerly a worker process computes, for hosts where prefill
//! and decode workers share cores: a nice level (the decode worker's steps
//! win the CPU from a niced prefill worker, which still gets every cycle
//! decode leaves idle) and an optional CPU set.
//!
//! Both are applied to the main thread before any other thread exists
//! ([`apply`] is the first thing a worker's `main` does after reading its
//! config), so the runtime, the engine thread and the kernel pool inherit
//! them. Linux scopes nice and affinity per thread; a thread inherits both
//! from the thread that creates it.

use rustix::process::{getpriority_process, setpriority_process};
use rustix::thread::{sched_setaffinity, CpuSet};

use facts::cpus::CpuList;

/// Why a placement could not be applied (the worker refuses to start: a
/// placement that silently did not happen would skew every measurement).
#[derive(Debug, thiserror::Error)]
pub enum CpuError {
    #[error("setting nice {nice}: {source} (lowering nice below the current level needs CAP_SYS_NICE)")]
    Nice { nice: i32, source: std::io::Error },
    #[error("pinning to CPUs {cpus}: {source} (are they online and in this process's cgroup?)")]
    Affinity { cpus: CpuList, source: std::io::Error },
}

/// Applies `nice` (when set) and `cpus` (when set) to the calling thread,
/// and so to every thread it creates afterwards.
pub fn apply(nice: Option<i32>, cpus: Option<&CpuList>) -> Result<(), CpuError> {
    if let Some(nice) = nice {
        setpriority_process(None, nice).map_err(|e| CpuError::Nice { nice, source: e.into() })?;
    }
    if let Some(list) = cpus {
        let mut set = CpuSet::new();
        for &c in list.cpus() {
            set.set(c);
        }
        sched_setaffinity(None, &set).map_err(|e| CpuError::Affinity { cpus: list.clone(), source: e.into() })?;
    }
    Ok(())
}

/// The calling thread's nice level.
pub fn current_nice() -> std::io::Result<i32> {
    getpriority_process(None).map_err(Into::into)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// In a thread of its own (nice is per thread on Linux): raising nice
    /// works unprivileged, and threads started afterwards inherit it.
    #[test]
    fn nice_applies_to_the_thread_and_what_it_starts() {
        let seen = std::thread::spawn(|| {
            let before = current_nice()?;
            apply(Some(before + 3), None).map_err(std::io::Error::other)?;
            let child = std::thread::spawn(current_nice).join().map_err(|_| std::io::Error::other("panicked"))??;
            Ok::<_, std::io::Error>((before, current_nice()?, child))
        })
        .join()
        .map_err(|_| "panicked");
        let (before, after, child) = seen.expect("thread").expect("nice");
        assert_eq!((after, child), (before + 3, before + 3));
    }

    #[test]
    fn pinning_to_an_online_cpu_works_and_to_a_missing_one_is_an_error() {
        let r = std::thread::spawn(|| {
            let ok = apply(None, Some(&CpuList::parse("0").expect("list"))).map_err(|e| e.to_string());
            let missing = apply(None, Some(&CpuList::parse("1000").expect("list"))).map_err(|e| e.to_string());
            (ok, missing)
        })
        .join()
        .expect("thread");
        assert_eq!(r.0, Ok(()));
        assert!(r.1.as_ref().is_err_and(|e| e.contains("1000")), "{:?}", r.1);
    }
}
