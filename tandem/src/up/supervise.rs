//! Supervision: a component that exits on its own is started again, as a
//! Kubernetes Deployment or a systemd unit would, while the rest of the
//! cluster keeps serving.
//!
//! Each component has one task that owns its process ([`supervise`]): it
//! waits for the exit, decides by the restart policy, waits out a capped
//! exponential backoff (Kubernetes' CrashLoopBackOff: 1 s doubling to 30 s
//! by default, back to the start after a minute of health) and starts it
//! again with the same arguments and addresses. A component that exits too
//! often within a minute is given up on: it stays down, loudly, and the
//! others keep running. The task reports every change as an [`Event`] to the
//! one place that owns the state file; on stop it hands its running process
//! back so the caller can stop the cluster in order.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::child::{start, Running, Spec};
use facts::state::{Component, State};

use super::state::describe;

/// What happens to a component whose process exits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Policy {
    /// Leave it down.
    Never,
    /// Start it again unless it exited 0 (a drained worker stays down).
    OnFailure,
    /// Start it again whatever the exit.
    Always,
}

impl Policy {
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::Never => "never",
            Policy::OnFailure => "on-failure",
            Policy::Always => "always",
        }
    }

    fn restarts(self, clean_exit: bool) -> bool {
        match self {
            Policy::Never => false,
            Policy::OnFailure => !clean_exit,
            Policy::Always => true,
        }
    }
}

/// The restart rules every component follows.
#[derive(Debug, Clone, Copy)]
pub struct Rules {
    pub policy: Policy,
    /// The first backoff; each exit without a healthy minute in between doubles it.
    pub backoff: Duration,
    /// The longest backoff.
    pub backoff_max: Duration,
    /// A process that ran this long before exiting was healthy: the backoff starts over.
    pub healthy_after: Duration,
    /// Exits within [`Rules::window`] that end the restarts.
    pub give_up_after: usize,
    pub window: Duration,
}

/// The backoff and the recent exits of one component.
#[derive(Debug)]
struct History {
    next: Duration,
    exits: VecDeque<Instant>,
}

/// What to do after an exit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Start again after this wait.
    Restart(Duration),
    /// The policy leaves it down.
    Stay,
    /// Too many exits within the window.
    GiveUp,
}

impl History {
    fn new(rules: &Rules) -> Self {
        Self { next: rules.backoff, exits: VecDeque::new() }
    }

    /// Records an exit at `now` of a process that ran for `ran` and decides what follows.
    fn exited(&mut self, rules: &Rules, now: Instant, ran: Duration, clean: bool) -> Next {
        if !rules.policy.restarts(clean) {
            return Next::Stay;
        }
        self.exits.push_back(now);
        while self.exits.front().is_some_and(|t| now.duration_since(*t) > rules.window) {
            self.exits.pop_front();
        }
        if self.exits.len() >= rules.give_up_after {
            return Next::GiveUp;
        }
        if ran >= rules.healthy_after {
            self.next = rules.backoff;
        }
        let wait = self.next;
        self.next = (self.next * 2).min(rules.backoff_max);
        Next::Restart(wait)
    }
}

/// A change the supervisor of component `index` reports.
#[derive(Debug)]
pub struct Event {
    pub index: usize,
    /// The component as it is now (pid, addresses, state, restarts, last exit).
    pub component: Component,
    /// One line for the terminal.
    pub line: String,
}

/// Supervises one component until `stop`: returns its process if one is running then.
pub async fn supervise(
    index: usize,
    spec: Spec,
    mut c: Component,
    mut run: Running,
    rules: Rules,
    events: mpsc::UnboundedSender<Event>,
    stop: CancellationToken,
) -> Option<(Component, Running)> {
    let mut history = History::new(&rules);
    let report = |c: &Component, line: String| {
        let _ = events.send(Event { index, component: c.clone(), line });
    };
    loop {
        let status = tokio::select! {
            s = run.child.wait() => s,
            _ = stop.cancelled() => return Some((c, run)),
        };
        let (mut exit, mut clean) = match status {
            Ok(s) => (describe(s), s.success()),
            Err(e) => (format!("waiting for it failed: {e}"), false),
        };
        let mut ran = run.since.elapsed();
        let old_pid = c.pid;
        // Start attempts until one succeeds, the policy leaves it down, or it is given up on.
        run = loop {
            c.last_exit = Some(exit.clone());
            let wait = match history.exited(&rules, Instant::now(), ran, clean) {
                Next::Restart(wait) => wait,
                next => {
                    let give_up = next == Next::GiveUp;
                    c.state = if give_up { State::GivenUp } else { State::Exited };
                    let line = if give_up {
                        format!(
                            "tandem up: GIVING UP on {} (pid {old_pid}): {} exits within {:?}, the last: {exit}; \
                             it stays down, the rest of the cluster keeps running. Its log, {}:\n{}",
                            c.name,
                            rules.give_up_after,
                            rules.window,
                            spec.log.display(),
                            super::child::log_tail(&spec.log)
                        )
                    } else {
                        format!(
                            "tandem up: {} (pid {old_pid}) exited: {exit}; not restarted (--restart {})",
                            c.name,
                            rules.policy.as_str()
                        )
                    };
                    report(&c, line);
                    stop.cancelled().await;
                    return None;
                }
            };
            c.state = State::Restarting;
            report(
                &c,
                format!(
                    "tandem up: {} (pid {old_pid}) exited: {exit}; restart {} in {:.1} s",
                    c.name,
                    c.restarts + 1,
                    wait.as_secs_f64()
                ),
            );
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = stop.cancelled() => return None,
            }
            c.restarts += 1;
            let n = c.restarts;
            let started = tokio::select! {
                r = start(&spec, &mut c, Some(n)) => r,
                _ = stop.cancelled() => return None,
            };
            match started {
                Ok(r) => break r,
                // A failed start is an exit like any other: it counts towards giving up.
                Err(e) => {
                    exit = format!("start failed: {}", e.to_string().lines().next().unwrap_or_default());
                    clean = false;
                    ran = Duration::ZERO;
                }
            }
        };
        c.state = State::Running;
        report(&c, format!("tandem up: {} restarted as pid {} (restart {})", c.name, c.pid, c.restarts));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(policy: Policy) -> Rules {
        Rules {
            policy,
            backoff: Duration::from_secs(1),
            backoff_max: Duration::from_secs(30),
            healthy_after: Duration::from_secs(60),
            give_up_after: 5,
            window: Duration::from_secs(60),
        }
    }

    #[test]
    fn policies_decide_which_exits_restart() {
        let now = Instant::now();
        let r = rules(Policy::Never);
        assert_eq!(History::new(&r).exited(&r, now, Duration::ZERO, false), Next::Stay);
        let r = rules(Policy::OnFailure);
        assert_eq!(History::new(&r).exited(&r, now, Duration::ZERO, true), Next::Stay, "a drained worker stays down");
        assert!(matches!(History::new(&r).exited(&r, now, Duration::ZERO, false), Next::Restart(_)));
        let r = rules(Policy::Always);
        assert!(matches!(History::new(&r).exited(&r, now, Duration::ZERO, true), Next::Restart(_)));
    }

    #[test]
    fn backoff_doubles_to_its_cap_and_starts_over_after_a_healthy_run() {
        let r = Rules { give_up_after: 100, ..rules(Policy::Always) };
        let mut h = History::new(&r);
        let mut now = Instant::now();
        let mut waits = Vec::new();
        for _ in 0..7 {
            now += Duration::from_secs(61); // spread out: never a crash loop
            match h.exited(&r, now, Duration::from_secs(1), false) {
                Next::Restart(w) => waits.push(w.as_secs()),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(waits, [1, 2, 4, 8, 16, 30, 30]);
        assert_eq!(h.exited(&r, now, Duration::from_secs(60), false), Next::Restart(Duration::from_secs(1)));
        assert_eq!(h.exited(&r, now, Duration::from_secs(5), false), Next::Restart(Duration::from_secs(2)));
    }

    #[test]
    fn five_exits_within_a_minute_give_up_and_older_exits_do_not_count() {
        let r = rules(Policy::OnFailure);
        let mut h = History::new(&r);
        let t0 = Instant::now();
        for i in 0..4 {
            assert!(matches!(h.exited(&r, t0 + Duration::from_secs(i), Duration::ZERO, false), Next::Restart(_)));
        }
        assert_eq!(h.exited(&r, t0 + Duration::from_secs(10), Duration::ZERO, false), Next::GiveUp);

        let mut h = History::new(&r);
        for i in 0..4 {
            assert!(matches!(h.exited(&r, t0 + Duration::from_secs(i), Duration::ZERO, false), Next::Restart(_)));
        }
        // The first four are over a minute old by now.
        let later = t0 + Duration::from_secs(70);
        assert!(matches!(h.exited(&r, later, Duration::ZERO, false), Next::Restart(_)));
    }
}
