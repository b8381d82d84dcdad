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

use std::fmt;

use rustix::process::{getpriority_process, setpriority_process};
use rustix::thread::{sched_setaffinity, CpuSet};

/// A set of CPUs, parsed from the kernel's list syntax (`0-3,6`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuList(Vec<usize>);

impl CpuList {
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut cpus = Vec::new();
        for part in text.split(',').map(str::trim) {
            let (a, b) = part.split_once('-').unwrap_or((part, part));
            let parse =
                |s: &str| s.trim().parse::<usize>().map_err(|_| format!("{part:?} is not a CPU or a range a-b"));
            let (a, b) = (parse(a)?, parse(b)?);
            if a > b {
                return Err(format!("{part:?}: the range runs backwards"));
            }
            if b >= CpuSet::MAX_CPU {
                return Err(format!("CPU {b} is beyond the {} this build can address", CpuSet::MAX_CPU));
            }
            cpus.extend(a..=b);
        }
        Self::new(cpus)
    }

    /// The set of `cpus` (any order, repeats allowed); at least one.
    pub fn new(mut cpus: Vec<usize>) -> Result<Self, String> {
        cpus.sort_unstable();
        cpus.dedup();
        if cpus.is_empty() {
            return Err("names no CPU".into());
        }
        Ok(Self(cpus))
    }

    pub fn cpus(&self) -> &[usize] {
        &self.0
    }
}

/// The kernel's list syntax, runs as ranges (`0-3,6`).
impl fmt::Display for CpuList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        let mut rest = self.0.as_slice();
        while let Some(&first) = rest.first() {
            let run = rest.windows(2).take_while(|w| w[1] == w[0] + 1).count() + 1;
            let last = rest[run - 1];
            parts.push(if run == 1 { first.to_string() } else { format!("{first}-{last}") });
            rest = &rest[run..];
        }
        f.write_str(&parts.join(","))
    }
}

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

    #[test]
    fn cpu_lists_parse_like_the_kernel_writes_them() {
        assert_eq!(CpuList::parse("0-2,5").map(|l| l.cpus().to_vec()), Ok(vec![0, 1, 2, 5]));
        assert_eq!(CpuList::parse("3, 1,1").map(|l| l.to_string()), Ok("1,3".into()));
        assert_eq!(CpuList::parse("6,0-3,8, 9").map(|l| l.to_string()), Ok("0-3,6,8-9".into()));
        assert_eq!(CpuList::new(vec![2, 1, 2]).map(|l| l.cpus().to_vec()), Ok(vec![1, 2]));
        assert!(CpuList::new(Vec::new()).is_err());
        for bad in ["", "a", "2-1", "1-", "99999"] {
            assert!(CpuList::parse(bad).is_err(), "{bad:?} parsed");
        }
    }

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
