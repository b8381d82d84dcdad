//! Where each role's workers run on this host: `tandem up`'s default CPU
//! split (the thread counts that follow from it are set in `start_cluster`).
//!
//! Default: when neither `--prefill-cpus` nor `--decode-cpus` is given, the
//! CPUs this process may use are split in two, the first half to the
//! prefill workers and the rest (the larger half on an odd count) to the
//! decode workers, each worker running one compute thread per CPU of its
//! role. Decode steps then never wait for a prefill thread.
//!
//! Measured with `tandem bench interference` on two cores (README, "Sharing
//! cores"), two runs against llama-server, kept decode tokens / worst gap
//! over idle ITL p99 / long-prompt TTFT over llama-server's: the split
//! 0.88x / 2.3x / 1.33x and 0.99x / 1.5x / 1.07x; decode pinned with
//! prefill on every CPU at nice 19 0.94x / 2.1x / 1.13x and 0.98x / 15x /
//! 1.53x (a prefill thread descheduled mid-item on the decode CPU holds its
//! whole pool up, so prefill fell behind until reservations expired and the
//! decode worker recomputed); both roles on every CPU with prefill niced
//! (`--share-cpus`, the old default) 0.76x / 30x / 1.84x and 0.58x / 155x /
//! 1.61x. The split has the steadiest gap. One CPU, or no prefill worker,
//! leaves everything unpinned.

use anyhow::{anyhow, Context, Result};
use facts::cpus::CpuList;

/// The CPUs this process may run on (`Cpus_allowed_list` in
/// `/proc/self/status`: taskset, cgroup cpusets and offline CPUs included).
pub fn allowed() -> Result<CpuList> {
    let status = std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .context("/proc/self/status has no Cpus_allowed_list")?;
    CpuList::parse(line.trim()).map_err(|e| anyhow!("Cpus_allowed_list {line:?}: {e}"))
}

/// The default split of `allowed` between (prefill, decode): the first
/// half to prefill, the rest to decode. `None` below two CPUs.
pub fn split(allowed: &CpuList) -> Option<(CpuList, CpuList)> {
    let cpus = allowed.cpus();
    if cpus.len() < 2 {
        return None;
    }
    let (p, d) = cpus.split_at(cpus.len() / 2);
    Some((CpuList::new(p.to_vec()).ok()?, CpuList::new(d.to_vec()).ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(text: &str) -> CpuList {
        CpuList::parse(text).expect("a CPU list")
    }

    #[test]
    fn the_split_gives_decode_the_larger_half_and_needs_two_cpus() {
        assert_eq!(split(&list("0-1")), Some((list("0"), list("1"))));
        assert_eq!(split(&list("0-2")), Some((list("0"), list("1-2"))));
        assert_eq!(split(&list("2-3,6-7")), Some((list("2-3"), list("6-7"))));
        assert_eq!(split(&list("4")), None);
    }

    #[test]
    fn this_process_may_run_somewhere() {
        let cpus = allowed().expect("the allowed CPUs");
        assert!(!cpus.cpus().is_empty(), "no CPU allowed");
    }
}
