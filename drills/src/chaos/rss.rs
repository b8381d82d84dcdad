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
/// its slope counts: from its start or from the first fault, whichever is later. A
/// process that lived through the fault-free lead-in reaches its working set under
/// faults only once they begin (buffers held by stalled peers, reconnects, the threads
/// and arenas faults bring): before, its warm-up ended as the first fault landed and
/// that one-off rise counted as a slope over the whole run (a 25-minute seed-1 run,
/// sampled each minute: the prefill worker fitted 0.87 MiB per 10 minutes from the end
/// of the lead-in, 0.09 from two faulted minutes later; the decode worker 2.72 and
/// 1.27, still over the bound). A leak keeps growing after it, and is fitted as before.
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
    /// When faults begin, ms from the start of the run (0: from the start).
    faults_from_ms: u64,
}

impl RssWatch {
    /// A watch whose incarnations warm up from `faults_from` (the end of the lead-in) at
    /// the earliest.
    pub fn new(faults_from: Duration) -> Self {
        Self { samples: BTreeMap::new(), faults_from_ms: faults_from.as_millis() as u64 }
    }

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
                let warm_from = first_ms.max(self.faults_from_ms) + WARM_UP.as_millis() as u64;
                let warm: Vec<(u64, f64)> = s.iter().copied().filter(|&(t, _)| t >= warm_from).collect();
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

    /// A process alive from the start warms up from the first fault: the rise its first
    /// faulted minutes bring is not a slope, a leak after it still is; one started during
    /// the faults warms up from its own start.
    #[test]
    fn processes_warm_up_from_the_first_fault() {
        let minute = 60_000u64;
        // Flat through a 3-minute lead-in, +20 MiB over the first 2 faulted minutes, then
        // flat (`onset`) or then 0.3 MiB a minute (`leak`).
        let onset = |t: u64| 100.0 + 10.0 * (t.clamp(3 * minute, 5 * minute) - 3 * minute) as f64 / minute as f64;
        let leak = |t: u64| onset(t) + 0.3 * t.saturating_sub(5 * minute) as f64 / minute as f64;
        let run = |mut w: RssWatch| {
            for i in 0..=30u64 {
                let t = i * minute;
                let mut procs = vec![("prefill-1", 1), ("decode-1", 2)];
                if t >= 10 * minute {
                    procs.push(("decode-0", 3));
                }
                w.sample(t, procs, |pid| match pid {
                    1 => Some(onset(t)),
                    2 => Some(leak(t)),
                    // Restarted during the faults: rises in its first minute, then flat.
                    _ => Some(if t == 10 * minute { 90.0 } else { 95.0 }),
                });
            }
            let inc = w.incarnations();
            let slope_of = |pid| inc.iter().find(|i| i.pid == pid).and_then(|i| i.slope_mib_per_10_min);
            (slope_of(1), slope_of(2), slope_of(3))
        };
        let (onset_slope, leak_slope, restarted) = run(RssWatch::new(Duration::from_secs(180)));
        assert_eq!(onset_slope, Some(0.0), "the first faulted minutes' rise is warm-up");
        let leak_slope = leak_slope.expect("fitted");
        assert!((leak_slope - 3.0).abs() < 1e-9, "a leak after the onset is fitted: {leak_slope}");
        assert_eq!(restarted, Some(0.0), "a restart warms up from its own start");
        // Warmed up from the start of the run, the onset would be read as growth.
        let (from_start, _, _) = run(RssWatch::default());
        assert!(from_start.is_some_and(|s| s > MAX_SLOPE_MIB_PER_10_MIN), "{from_start:?}");
    }
}
