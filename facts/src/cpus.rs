//! The kernel's CPU list syntax (`0-3,6`): what `--cpus` takes and `/proc` and cgroups
//! print, parsed and printed the same way by the workers and by `tandem up`.

use std::fmt;

/// The most CPUs a list may name: the kernel's `CPU_SETSIZE`, which the workers' affinity
/// call can address.
pub const MAX_CPU: usize = 1024;

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
            if b >= MAX_CPU {
                return Err(format!("CPU {b} is beyond the {MAX_CPU} this build can address"));
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
}
