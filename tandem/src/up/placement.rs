//! Where each role's workers run on this host: `tandem up`'s default CPU
//! placement and the thread counts that follow from it.
//!
//! Default: when neither `--prefill-cpus` nor `--decode-cpus` is given, the
//! decode workers are pinned to the second half of the CPUs this process
//! may use (the larger half on an odd count) and run one compute thread per
//! CPU there; the prefill workers stay on every CPU, one thread per CPU, at
//! `--prefill-nice` 19. Decode steps then never share a CPU with a thread
//! of equal priority, and prefill still takes whatever decode leaves idle
//! (the kernels' pool lets a descheduled thread claim nothing, so a prefill
//! thread starved on a decode CPU does not stall the others).
//!
//! Measured with `tandem bench interference` on two cores in one run
//! (README, "Sharing cores"), against llama-server's long-prompt TTFT:
//! this placement kept 0.94x of the idle decode tokens, a worst gap of 2.1x
//! the idle ITL p99 and 1.13x the TTFT; a full split (prefill on the first
//! half only) 0.88x, 2.3x and 1.33x; both roles on every CPU with prefill
//! niced (`--share-cpus`, the old default) 0.76x, 30x and 1.84x, because
//! the decode streams keep every core busy and the niced prefill starves.
//! One CPU, or no prefill worker, leaves everything unpinned.

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

/// The decode workers' default CPUs among `allowed`: its second half, the
/// larger one on an odd count. `None` below two CPUs.
pub fn decode_half(allowed: &[usize]) -> Option<Cpus> {
    if allowed.len() < 2 {
        return None;
    }
    Some(allowed[allowed.len() / 2..].to_vec())
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
    fn decode_gets_the_larger_second_half_and_needs_two_cpus() {
        assert_eq!(decode_half(&[0, 1]), Some(vec![1]));
        assert_eq!(decode_half(&[0, 1, 2]), Some(vec![1, 2]));
        assert_eq!(decode_half(&[2, 3, 6, 7]), Some(vec![6, 7]));
        assert_eq!(decode_half(&[4]), None);
        assert_eq!(decode_half(&[]), None);
    }

    #[test]
    fn this_process_may_run_somewhere() {
        let cpus = allowed().expect("the allowed CPUs");
        assert!(!cpus.is_empty(), "no CPU allowed");
        assert!(cpus.windows(2).all(|w| w[0] < w[1]), "{cpus:?}");
    }
}
