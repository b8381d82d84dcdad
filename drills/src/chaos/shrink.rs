//! Shrinking a failing chaos run to the fewest faults that still fail it
//! (`tandem chaos --shrink`).
//!
//! The search is delta debugging over the schedule's faults, by their index
//! in the seeded schedule: drop one of `n` chunks of what is still kept; if
//! the run without it still fails, keep that and try coarser chunks again,
//! else finer ones, down to single faults (and, from one fault, none at all).
//! Every candidate is a whole run of the same seed and load with only its
//! faults applied, at their times.
//!
//! Chaos runs are not deterministic (a kill lands between two tokens or on
//! an idle worker), so a candidate counts as passing only after
//! [`Bounds::runs_per_candidate`] clean runs, and as failing at its first
//! run that fails the way the original did (the caller's judgement). The
//! search stops when no single fault can go, or before a run that would take
//! it past [`Bounds::budget`] (judged by the longest run so far), or when a
//! trial cannot run: what it kept then still fails, and [`Shrunk::stopped`]
//! says why a shorter list may too.
//!
//! Sans-I/O: the trial is the caller's (a real run, or a model of one in
//! the tests) and reports what it cost, or why the search must end (the run
//! was cancelled, or could not start); nothing here reads a clock.

use std::collections::HashMap;
use std::time::Duration;

/// How hard to look.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// Clean runs before a candidate counts as passing (a failing run ends it at once).
    pub runs_per_candidate: u32,
    /// The most time all trial runs together may take.
    pub budget: Duration,
}

impl Default for Bounds {
    fn default() -> Self {
        Self { runs_per_candidate: 3, budget: Duration::from_secs(30 * 60) }
    }
}

/// One trial run of a candidate.
#[derive(Debug, Clone)]
pub struct Trial {
    /// It failed the way the original run did.
    pub reproduced: bool,
    /// How long it took.
    pub cost: Duration,
}

/// Why a search ended before it was done.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stopped {
    /// The next run would have taken it past [`Bounds::budget`].
    Budget,
    /// The caller cancelled it (Ctrl-C).
    Cancelled,
    /// A trial could not run (the cluster did not start): why.
    Failed(String),
}

impl std::fmt::Display for Stopped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Budget => f.write_str("the time budget (--shrink-budget) ran out"),
            Self::Cancelled => f.write_str("cancelled"),
            Self::Failed(why) => write!(f, "a run failed to run: {why}"),
        }
    }
}

/// One candidate fault list and what its runs said.
#[derive(Debug, Clone)]
pub struct Tried {
    pub faults: Vec<usize>,
    pub runs: u32,
    pub reproduced: bool,
}

/// What the search found.
#[derive(Debug, Clone)]
pub struct Shrunk {
    /// The shortest fault list found that still fails, as indices into the seeded
    /// schedule, ascending.
    pub kept: Vec<usize>,
    /// Trial runs made.
    pub runs: u32,
    /// Their time together.
    pub spent: Duration,
    /// Why the search ended before it was done, if it did: `kept` fails, a shorter list
    /// may too.
    pub stopped: Option<Stopped>,
    /// Every candidate, in the order tried.
    pub tried: Vec<Tried>,
}

/// Shrinks `failing` (a fault list whose run failed; `estimate` is how long that run
/// took) to the shortest list whose runs still fail, running candidates through `trial`
/// (an error: stop here, for that reason).
pub async fn shrink(
    failing: &[usize],
    estimate: Duration,
    bounds: Bounds,
    mut trial: impl AsyncFnMut(&[usize]) -> Result<Trial, Stopped>,
) -> Shrunk {
    let mut s = Search {
        out: Shrunk { kept: sorted(failing), runs: 0, spent: Duration::ZERO, stopped: None, tried: Vec::new() },
        longest: estimate,
        bounds,
        known: HashMap::new(),
    };
    let mut n = 2usize;
    'search: while !s.out.kept.is_empty() {
        let kept = s.out.kept.clone();
        n = n.min(kept.len());
        for chunk in chunks(kept.len(), n) {
            let candidate: Vec<usize> =
                kept.iter().enumerate().filter(|(i, _)| !chunk.contains(i)).map(|(_, f)| *f).collect();
            match s.fails(&candidate, &mut trial).await {
                Err(why) => {
                    s.out.stopped = Some(why);
                    break 'search;
                }
                Ok(true) => {
                    s.out.kept = candidate;
                    n = n.saturating_sub(1).max(2);
                    continue 'search;
                }
                Ok(false) => {}
            }
        }
        if n >= kept.len() {
            break;
        }
        n = (2 * n).min(kept.len());
    }
    s.out
}

struct Search {
    out: Shrunk,
    longest: Duration,
    bounds: Bounds,
    /// Candidates already judged.
    known: HashMap<Vec<usize>, bool>,
}

impl Search {
    /// Whether `candidate` still fails; an error when the budget allows no further run or
    /// the trial says stop.
    async fn fails(
        &mut self,
        candidate: &[usize],
        trial: &mut impl AsyncFnMut(&[usize]) -> Result<Trial, Stopped>,
    ) -> Result<bool, Stopped> {
        if let Some(&known) = self.known.get(candidate) {
            return Ok(known);
        }
        let mut runs = 0;
        let mut reproduced = false;
        while runs < self.bounds.runs_per_candidate.max(1) {
            if self.out.spent + self.longest > self.bounds.budget {
                return Err(Stopped::Budget);
            }
            let t = trial(candidate).await?;
            runs += 1;
            self.out.runs += 1;
            self.out.spent += t.cost;
            self.longest = self.longest.max(t.cost);
            if t.reproduced {
                reproduced = true;
                break;
            }
        }
        self.out.tried.push(Tried { faults: candidate.to_vec(), runs, reproduced });
        self.known.insert(candidate.to_vec(), reproduced);
        Ok(reproduced)
    }
}

fn sorted(v: &[usize]) -> Vec<usize> {
    let mut v = v.to_vec();
    v.sort_unstable();
    v.dedup();
    v
}

/// `n` chunks of `0..len`, as even as they come, each a range of positions.
fn chunks(len: usize, n: usize) -> Vec<std::ops::Range<usize>> {
    let n = n.clamp(1, len.max(1));
    (0..n).map(|i| (i * len / n)..((i + 1) * len / n)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    const RUN: Duration = Duration::from_secs(100);

    fn run<F: FnMut(&[usize]) -> bool>(failing: &[usize], bounds: Bounds, mut fails: F) -> Shrunk {
        let trial = async |c: &[usize]| Ok(Trial { reproduced: fails(c), cost: RUN });
        block_on(shrink(failing, RUN, bounds, trial))
    }

    /// Drives a future that never waits (the trials here are plain functions).
    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread().build().expect("runtime").block_on(f)
    }

    /// Three runs a candidate, time enough for any search here.
    fn wide() -> Bounds {
        Bounds { runs_per_candidate: 3, budget: RUN * 1000 }
    }

    fn all(n: usize) -> Vec<usize> {
        (0..n).collect()
    }

    #[test]
    fn one_culprit_among_ten_is_found_alone() {
        let s = run(&all(10), wide(), |c| c.contains(&7));
        assert_eq!(s.kept, vec![7], "{s:?}");
        assert_eq!(s.stopped, None);
        // A candidate that passes is run three times, one that fails once.
        for t in &s.tried {
            assert_eq!(t.runs, if t.reproduced { 1 } else { 3 }, "{t:?}");
        }
        assert_eq!(s.runs, s.tried.iter().map(|t| t.runs).sum::<u32>());
        assert_eq!(s.spent, RUN * s.runs);
        // The last question asked: does it fail with no fault at all (no).
        assert!(s.tried.iter().any(|t| t.faults.is_empty() && !t.reproduced), "{:?}", s.tried);
    }

    #[test]
    fn two_faults_that_fail_only_together_are_both_kept() {
        let s = run(&all(12), wide(), |c| c.contains(&2) && c.contains(&9));
        assert_eq!(s.kept, vec![2, 9], "{s:?}");
    }

    #[test]
    fn a_failure_that_needs_no_fault_shrinks_to_none() {
        let s = run(&[3, 1, 4], wide(), |_| true);
        assert!(s.kept.is_empty(), "{s:?}");
    }

    #[test]
    fn a_run_that_never_fails_again_keeps_every_fault() {
        let s = run(&all(4), wide(), |_| false);
        assert_eq!(s.kept, all(4));
        assert_eq!(s.stopped, None);
    }

    /// A culprit that fails only every third run: found with three runs per candidate,
    /// and not with one, where a flake passes for the fix.
    #[test]
    fn a_flaky_failure_is_shrunk_because_candidates_are_run_again() {
        let flaky = |runs: u32| {
            let n = Cell::new(0u32);
            let s = run(&all(8), Bounds { runs_per_candidate: runs, ..wide() }, |c| {
                if !c.contains(&5) {
                    return false;
                }
                n.set(n.get() + 1);
                n.get() % 3 == 0
            });
            s.kept
        };
        assert_eq!(flaky(3), vec![5]);
        assert_ne!(flaky(1), vec![5], "one run a candidate misses the flaky culprit");
    }

    #[test]
    fn the_budget_stops_the_search_before_a_run_would_pass_it() {
        let bounds = Bounds { runs_per_candidate: 3, budget: RUN * 5 + RUN / 2 };
        let s = run(&all(16), bounds, |c| c.contains(&11));
        assert_eq!(s.stopped, Some(Stopped::Budget), "{s:?}");
        assert!(s.runs <= 5 && s.spent <= bounds.budget, "{s:?}");
        assert!(s.kept.contains(&11) && s.kept.len() < 16, "still a failing list, shorter: {s:?}");
    }

    #[test]
    fn a_trial_that_cannot_run_ends_the_search_with_what_still_fails() {
        let mut left = 2i32;
        let trial = async |c: &[usize]| {
            left -= 1;
            if left < 0 {
                return Err(Stopped::Failed("etcd did not start".into()));
            }
            Ok(Trial { reproduced: c.contains(&5), cost: RUN })
        };
        let s = block_on(shrink(&all(8), RUN, wide(), trial));
        assert_eq!(s.stopped, Some(Stopped::Failed("etcd did not start".into())), "{s:?}");
        assert_eq!(s.runs, 2, "{s:?}");
        assert_eq!(s.kept, vec![4, 5, 6, 7], "the second half failed alone, its halves were not judged: {s:?}");
    }

    #[test]
    fn chunks_cover_every_position_once() {
        for len in 1..20 {
            for n in 1..=len {
                let c = chunks(len, n);
                assert_eq!(c.len(), n);
                assert_eq!(c.iter().map(|r| r.len()).sum::<usize>(), len);
                assert!(c.windows(2).all(|w| w[0].end == w[1].start) && c.iter().all(|r| !r.is_empty()));
            }
        }
    }
}
