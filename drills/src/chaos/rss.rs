//! Resident anonymous memory (`RssAnon`: heap and private mappings) of every process
//! incarnation over a chaos run, and its slope once warmed up: a leak shows as a slope
//! that a restart resets, so each incarnation (a name and a pid) is fitted on its own.
//! Not `VmRSS`: it also counts file pages a process maps in as it first touches them
//! (the model file's embedding rows, as new tokens appear), which grew a worker's RSS by
//! megabytes in the first certification's hour and are the kernel's cache, not a leak.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;

/// How long an incarnation warms up (caches, pools, the allocator's arenas) before
/// its slope counts.
pub const WARM_UP: Duration = Duration::from_secs(120);
/// Incarnations that lived at least this long (warm-up included) are held to
/// [`MAX_SLOPE_MIB_PER_10_MIN`]; shorter ones are only reported.
pub const JUDGED_AFTER: Duration = Duration::from_secs(20 * 60);
pub const MAX_SLOPE_MIB_PER_10_MIN: f64 = 1.0;

/// One process life's resident memory over the run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Incarnation {
    pub name: String,
    pub pid: u32,
    /// First and last sample, from the start of the run.
    pub first_ms: u64,
    pub last_ms: u64,
    pub samples: usize,
    pub first_mib: f64,
    pub last_mib: f64,
    /// Least-squares slope after [`WARM_UP`], MiB per 10 minutes (`None`: fewer than
    /// three samples after it).
    pub slope_mib_per_10_min: Option<f64>,
}

impl Incarnation {
    /// Long enough to be held to the bound.
    pub fn judged(&self) -> bool {
        Duration::from_millis(self.last_ms - self.first_ms) >= JUDGED_AFTER
    }
}

/// Samples taken so far, by (name, pid).
#[derive(Debug, Default)]
pub struct RssWatch {
    samples: BTreeMap<(String, u32), Vec<(u64, f64)>>,
}

impl RssWatch {
    /// Records one sample of each process at `at_ms`; `read` gives a pid's resident
    /// memory in MiB (`None`: gone, not recorded).
    pub fn sample<'a>(
        &mut self,
        at_ms: u64,
        procs: impl IntoIterator<Item = (&'a str, u32)>,
        read: impl Fn(u32) -> Option<f64>,
    ) {
        for (name, pid) in procs {
            if let Some(mib) = read(pid) {
                self.samples.entry((name.to_owned(), pid)).or_default().push((at_ms, mib));
            }
        }
    }

    pub fn incarnations(&self) -> Vec<Incarnation> {
        self.samples
            .iter()
            .filter_map(|((name, pid), s)| {
                let (&(first_ms, first_mib), &(last_ms, last_mib)) = (s.first()?, s.last()?);
                let warm: Vec<(u64, f64)> =
                    s.iter().copied().filter(|&(t, _)| t >= first_ms + WARM_UP.as_millis() as u64).collect();
                Some(Incarnation {
                    name: name.clone(),
                    pid: *pid,
                    first_ms,
                    last_ms,
                    samples: s.len(),
                    first_mib,
                    last_mib,
                    slope_mib_per_10_min: slope(&warm).map(|per_ms| per_ms * 600_000.0),
                })
            })
            .collect()
    }
}

/// The least-squares slope of `points` (y per x); `None` for fewer than three points or
/// no spread in x.
fn slope(points: &[(u64, f64)]) -> Option<f64> {
    if points.len() < 3 {
        return None;
    }
    let n = points.len() as f64;
    let mx = points.iter().map(|p| p.0 as f64).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 as f64 - mx).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 as f64 - mx) * (p.1 - my)).sum();
    (sxx > 0.0).then(|| sxy / sxx)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A leak of 2 MiB per 10 minutes in one incarnation is measured as such after its
    /// warm-up (whose growth does not count), a flat one as flat, and a restart starts a
    /// new incarnation with its own fit.
    #[test]
    fn each_incarnation_gets_its_own_slope_after_warm_up() {
        let mut w = RssWatch::default();
        let minute = 60_000u64;
        for i in 0..=30u64 {
            let t = i * minute;
            // decode-0's first life: +40 MiB while warming up, then 0.2 MiB a minute; its
            // second life (from minute 20) flat. prefill-0: flat throughout.
            let leak = |t: u64| {
                if t < 2 * minute {
                    100.0 + 20.0 * t as f64 / minute as f64
                } else {
                    140.0 + 0.2 * (t - 2 * minute) as f64 / minute as f64
                }
            };
            let procs: Vec<(&str, u32)> = if t < 20 * minute {
                vec![("decode-0", 10), ("prefill-0", 11)]
            } else {
                vec![("decode-0", 12), ("prefill-0", 11)]
            };
            w.sample(t, procs, |pid| match pid {
                10 => Some(leak(t)),
                12 => Some(90.0),
                _ => Some(80.0),
            });
        }
        w.sample(31 * minute, [("decode-0", 99)], |_| None);
        let inc = w.incarnations();
        assert_eq!(inc.len(), 3, "{inc:?}");
        let first = inc.iter().find(|i| i.pid == 10).expect("decode-0's first life");
        let fitted = first.slope_mib_per_10_min.expect("enough samples");
        assert!((fitted - 2.0).abs() < 1e-9, "{fitted}");
        assert!(!first.judged(), "19 minutes is short of the bound's 20");
        let flat = inc.iter().find(|i| i.pid == 11).expect("prefill-0");
        assert!(flat.judged() && flat.slope_mib_per_10_min == Some(0.0), "{flat:?}");
        let second = inc.iter().find(|i| i.pid == 12).expect("decode-0's second life");
        assert_eq!((second.first_ms, second.samples), (20 * minute, 11));
        assert_eq!(slope(&[(0, 1.0), (1, 2.0)]), None, "two points are no fit");
    }
}
