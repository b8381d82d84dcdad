//! Where each role's workers run on this host: `tandem up`'s default CPU
//! split and the thread counts that follow from it.
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

use anyhow::{bail, Context, Result};

/// CPUs, ascending, without repeats.
pub type Cpus = Vec<usize>;

/// Parses a CPU list as the workers' `--cpus` and `taskset -c` take it: `0-3,6`.
pub fn parse(text: &str) -> Result<Cpus> {
    let mut out = Vec::new();
    for part in text.trim().split(',').map(str::trim) {
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (a.trim(), b.trim()),
            None => (part, part),
        };
        let lo: usize = lo.parse().with_context(|| format!("CPU list {text:?}: {part:?} is not a CPU or range"))?;
        let hi: usize = hi.parse().with_context(|| format!("CPU list {text:?}: {part:?} is not a CPU or range"))?;
        if hi < lo {
            bail!("CPU list {text:?}: range {part:?} runs backwards");
        }
        out.extend(lo..=hi);
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

/// Writes `cpus` as a CPU list (`0-3,6`).
pub fn format(cpus: &[usize]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        parts.push(if i == j { cpus[i].to_string() } else { format!("{}-{}", cpus[i], cpus[j]) });
        i = j + 1;
    }
    parts.join(",")
}

/// The CPUs this process may run on (`Cpus_allowed_list` in
/// `/proc/self/status`: taskset, cgroup cpusets and offline CPUs included).
pub fn allowed() -> Result<Cpus> {
    let status = std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .context("/proc/self/status has no Cpus_allowed_list")?;
    parse(line)
}

/// The default split of `allowed` between (prefill, decode): the first
/// half to prefill, the rest to decode. `None` below two CPUs.
pub fn split(allowed: &[usize]) -> Option<(Cpus, Cpus)> {
    if allowed.len() < 2 {
        return None;
    }
    let (p, d) = allowed.split_at(allowed.len() / 2);
    Some((p.to_vec(), d.to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_parse_and_format_back() {
        assert_eq!(parse("0-3,6").expect("a list"), vec![0, 1, 2, 3, 6]);
        assert_eq!(parse(" 5, 1-2 ,2\n").expect("a list"), vec![1, 2, 5]);
        assert_eq!(format(&[0, 1, 2, 3, 6, 8, 9]), "0-3,6,8-9");
        assert_eq!(format(&parse("7").expect("a list")), "7");
        for bad in ["", "a", "3-1", "1-", "1,,2"] {
            assert!(parse(bad).is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn the_split_gives_decode_the_larger_half_and_needs_two_cpus() {
        assert_eq!(split(&[0, 1]), Some((vec![0], vec![1])));
        assert_eq!(split(&[0, 1, 2]), Some((vec![0], vec![1, 2])));
        assert_eq!(split(&[2, 3, 6, 7]), Some((vec![2, 3], vec![6, 7])));
        assert_eq!(split(&[4]), None);
        assert_eq!(split(&[]), None);
    }

    #[test]
    fn this_process_may_run_somewhere() {
        let cpus = allowed().expect("the allowed CPUs");
        assert!(!cpus.is_empty(), "no CPU allowed");
        assert!(cpus.windows(2).all(|w| w[0] < w[1]), "{cpus:?}");
    }
}
