//! A seeded schedule of overlapping faults. Pure: the same seed, options and
//! cluster shape give the same schedule on every machine, which is what
//! `tandem chaos --dry-run` prints and what a failing run's command repeats.
//!
//! Faults arrive as a Poisson process (`per_minute`), each of a kind drawn
//! from the enabled list, on a target drawn from that kind's processes. A
//! held fault (a kill until its restart, a stop until its SIGCONT, etcd down
//! until it is back, a KV link delayed or cut until it heals) keeps its
//! target busy: no second fault lands on a busy
//! target, and at most `max_in_flight` faults are held at once (a draw that
//! would break either is dropped, not delayed, so the schedule stays a
//! function of the seed). Every fault is lifted by the end of the run.

use std::time::Duration;

use serde::Serialize;
use types::rng::XorShift64;

/// What a fault does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum FaultKind {
    /// SIGKILL a decode worker; started again after the hold.
    KillDecode,
    /// SIGKILL a prefill worker; started again after the hold.
    KillPrefill,
    /// SIGKILL a coordinator (behind the front); started again after the hold.
    KillCoordinator,
    /// SIGSTOP a decode worker; SIGCONT after the hold.
    StopDecode,
    /// SIGSTOP a prefill worker; SIGCONT after the hold.
    StopPrefill,
    /// SIGSTOP a coordinator; SIGCONT after the hold.
    StopCoordinator,
    /// SIGKILL etcd; started again (same data) after the hold.
    KillEtcd,
    /// SIGSTOP etcd (a stall: connections stay open, nothing answers); SIGCONT after the hold.
    StopEtcd,
    /// 75 ms ± 50 ms latency on every chunk of a decode worker's KV link (its fault
    /// proxy), until the hold ends.
    KvDelay,
    /// A partition of a decode worker's KV link: no byte crosses either way, new
    /// connections hang, until the hold ends (then the connections that lost bytes close).
    KvBlackhole,
    /// One byte flipped within the first 256 KiB a decode worker's KV link carries once
    /// armed (disarmed at the end of the hold if nothing crossed).
    KvCorrupt,
    /// Every connection open on a decode worker's KV link reset (RST both ends), at once.
    KvReset,
    /// A burst of extra requests at once, over the steady load.
    Burst,
    /// A client that hangs up mid-stream.
    Disconnect,
    /// A client that stops reading its stream (a tiny receive window, never read,
    /// straight to a coordinator) and hangs up after [`SLOW_READER_HOLD`]; its slot and
    /// KV must be freed, and the rest of the load keep its deadlines.
    SlowReader,
}

/// How long a slow reader holds its unread connection.
pub const SLOW_READER_HOLD: Duration = Duration::from_secs(8);

/// Which processes a kind acts on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TargetKind {
    Decode,
    Prefill,
    Coordinator,
    Etcd,
    /// A decode worker's KV link (its fault proxy), named `kv:NAME`.
    KvLink,
    /// The clients' side: no process.
    Load,
}

impl FaultKind {
    pub const ALL: [Self; 15] = [
        Self::KillDecode,
        Self::KillPrefill,
        Self::KillCoordinator,
        Self::StopDecode,
        Self::StopPrefill,
        Self::StopCoordinator,
        Self::KillEtcd,
        Self::StopEtcd,
        Self::KvDelay,
        Self::KvBlackhole,
        Self::KvCorrupt,
        Self::KvReset,
        Self::Burst,
        Self::Disconnect,
        Self::SlowReader,
    ];

    /// The name `--faults` takes.
    pub fn name(self) -> &'static str {
        match self {
            Self::KillDecode => "kill-decode",
            Self::KillPrefill => "kill-prefill",
            Self::KillCoordinator => "kill-coordinator",
            Self::StopDecode => "stop-decode",
            Self::StopPrefill => "stop-prefill",
            Self::StopCoordinator => "stop-coordinator",
            Self::KillEtcd => "kill-etcd",
            Self::StopEtcd => "stop-etcd",
            Self::KvDelay => "kv-delay",
            Self::KvBlackhole => "kv-blackhole",
            Self::KvCorrupt => "kv-corrupt",
            Self::KvReset => "kv-reset",
            Self::Burst => "burst",
            Self::Disconnect => "disconnect",
            Self::SlowReader => "slow-reader",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.name() == s)
    }

    pub fn target(self) -> TargetKind {
        match self {
            Self::KillDecode | Self::StopDecode => TargetKind::Decode,
            Self::KillPrefill | Self::StopPrefill => TargetKind::Prefill,
            Self::KillCoordinator | Self::StopCoordinator => TargetKind::Coordinator,
            Self::KillEtcd | Self::StopEtcd => TargetKind::Etcd,
            Self::KvDelay | Self::KvBlackhole | Self::KvCorrupt | Self::KvReset => TargetKind::KvLink,
            Self::Burst | Self::Disconnect | Self::SlowReader => TargetKind::Load,
        }
    }

    /// A SIGKILL: the target's life ends (a new one starts after the hold).
    pub fn kills(self) -> bool {
        matches!(self, Self::KillDecode | Self::KillPrefill | Self::KillCoordinator | Self::KillEtcd)
    }

    /// A fault with nothing to lift (a reset, a burst, a hang-up): applied and done.
    pub fn instant(self) -> bool {
        self.hold_ms() == (0, 0)
    }

    /// How long the fault is held before it is lifted, drawn from this range (ms).
    fn hold_ms(self) -> (u64, u64) {
        match self {
            Self::KillDecode | Self::KillPrefill | Self::KillCoordinator => (2_000, 6_000),
            Self::StopDecode | Self::StopPrefill | Self::StopCoordinator => (1_500, 5_000),
            // Short enough that worker leases (5 s in chaos clusters) outlive it.
            Self::KillEtcd | Self::StopEtcd => (1_000, 3_000),
            Self::KvDelay => (2_000, 6_000),
            // Shorter than the prefill workers' 10 s transfer timeout and the requests'
            // deadline: the transfers it stalls fail when it lifts, and are retried.
            Self::KvBlackhole => (1_000, 4_000),
            Self::KvCorrupt => (1_000, 3_000),
            // A slow reader's connection is held by its own task (SLOW_READER_HOLD).
            Self::KvReset | Self::Burst | Self::Disconnect | Self::SlowReader => (0, 0),
        }
    }
}

/// The processes a schedule may act on, by name.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Targets {
    pub decode: Vec<String>,
    pub prefill: Vec<String>,
    pub coordinators: Vec<String>,
    pub etcd: Vec<String>,
    /// Decode workers' KV links, `kv:NAME` (empty when the workers have no fault proxy).
    pub kv_links: Vec<String>,
}

/// A decode worker's KV link, as schedules name it.
pub fn kv_link(decode: &str) -> String {
    format!("kv:{decode}")
}

/// Whether `target` is excluded: by its own name, or a KV link by its worker's.
fn excluded(exclude: &[String], target: &str) -> bool {
    exclude.iter().any(|e| e == target || target.strip_prefix("kv:") == Some(e.as_str()))
}

impl Targets {
    fn of(&self, t: TargetKind) -> Vec<String> {
        match t {
            TargetKind::Decode => self.decode.clone(),
            TargetKind::Prefill => self.prefill.clone(),
            TargetKind::Coordinator => self.coordinators.clone(),
            TargetKind::Etcd => self.etcd.clone(),
            TargetKind::KvLink => self.kv_links.clone(),
            TargetKind::Load => vec!["clients".to_owned()],
        }
    }
}

/// What to schedule.
#[derive(Debug, Clone, PartialEq)]
pub struct ScheduleOptions {
    pub seed: u64,
    /// Faults start within this long; all are lifted by its end.
    pub duration: Duration,
    /// Mean faults per minute.
    pub per_minute: f64,
    /// The kinds to draw from.
    pub kinds: Vec<FaultKind>,
    /// Targets never acted on, by name.
    pub exclude: Vec<String>,
    /// Targets never killed, by name: every other fault still lands on them, and their
    /// one life spans the run, so a long run judges their memory slope.
    pub never_kill: Vec<String>,
    /// Most faults held at once.
    pub max_in_flight: usize,
}

/// One fault of the schedule.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Planned {
    /// When it is applied, from the start of the run.
    #[serde(rename = "at_ms", serialize_with = "ms")]
    pub at: Duration,
    pub kind: FaultKind,
    pub target: String,
    /// How long it is held before it is lifted (0: nothing to lift).
    #[serde(rename = "hold_ms", serialize_with = "ms")]
    pub hold: Duration,
}

fn ms<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u64(d.as_millis() as u64)
}

impl Planned {
    /// When it is lifted.
    pub fn until(&self) -> Duration {
        self.at + self.hold
    }
}

impl std::fmt::Display for Planned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:>8.1} s  {:<17} {}", self.at.as_secs_f64(), self.kind.name(), self.target)?;
        if !self.hold.is_zero() {
            write!(f, " for {:.1} s", self.hold.as_secs_f64())?;
        }
        Ok(())
    }
}

/// A uniform draw in [0, 1).
fn unit(rng: &mut XorShift64) -> f64 {
    (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
}

/// The schedule: faults in the order they are applied.
pub fn schedule(o: &ScheduleOptions, targets: &Targets) -> Vec<Planned> {
    let mut rng = XorShift64::new(o.seed ^ 0x6368_616f_735f_7631); // "chaos_v1"
    let mean_gap = 60.0 / o.per_minute.max(1e-6);
    let eligible = |k: FaultKind| -> Vec<String> {
        let spared = |n: &String| k.kills() && o.never_kill.contains(n);
        targets.of(k.target()).into_iter().filter(|n| !excluded(&o.exclude, n) && !spared(n)).collect()
    };
    let kinds: Vec<FaultKind> = o.kinds.iter().copied().filter(|&k| !eligible(k).is_empty()).collect();
    let mut out: Vec<Planned> = Vec::new();
    let mut t = 0.0;
    if kinds.is_empty() {
        return out;
    }
    loop {
        // Exponential gaps: a Poisson process of faults.
        t += -mean_gap * (1.0 - unit(&mut rng)).ln();
        let at = Duration::from_secs_f64(t);
        if at >= o.duration {
            return out;
        }
        let kind = kinds[rng.below(kinds.len() as u64) as usize];
        let (lo, hi) = kind.hold_ms();
        let hold = Duration::from_millis(lo + rng.below(hi - lo + 1));
        let candidates = eligible(kind);
        let target = candidates[rng.below(candidates.len() as u64) as usize].clone();
        let held = |p: &&Planned| !p.hold.is_zero() && p.at <= at && at < p.until();
        let busy = out.iter().filter(held).any(|p| p.target == target);
        let in_flight = out.iter().filter(held).count();
        // An instant fault lands on a busy target no more than a held one does (a reset
        // during a partition of the same link would prove nothing), but is not capped.
        if !busy && (hold.is_zero() || in_flight < o.max_in_flight) {
            // Lifted by the end of the run, however long it was drawn.
            let hold = hold.min(o.duration.saturating_sub(at));
            out.push(Planned { at, kind, target, hold });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn targets() -> Targets {
        Targets {
            decode: vec!["decode-0".into(), "decode-1".into()],
            prefill: vec!["prefill-0".into(), "prefill-1".into()],
            coordinators: vec!["coordinator".into(), "coordinator-1".into()],
            etcd: vec!["etcd".into()],
            kv_links: vec![kv_link("decode-0"), kv_link("decode-1")],
        }
    }

    fn options(seed: u64) -> ScheduleOptions {
        ScheduleOptions {
            seed,
            duration: Duration::from_secs(600),
            per_minute: 12.0,
            kinds: FaultKind::ALL.to_vec(),
            exclude: Vec::new(),
            never_kill: Vec::new(),
            max_in_flight: 3,
        }
    }

    #[test]
    fn a_seed_gives_one_schedule_and_another_seed_another() {
        let t = targets();
        assert_eq!(schedule(&options(7), &t), schedule(&options(7), &t));
        assert_ne!(schedule(&options(7), &t), schedule(&options(8), &t));
    }

    #[test]
    fn faults_overlap_within_the_cap_and_never_twice_on_one_target() {
        let s = schedule(&options(1), &targets());
        assert!(s.len() > 60, "about 12 a minute for 10 minutes: {}", s.len());
        assert!(s.windows(2).all(|w| w[0].at <= w[1].at), "in order");
        let mut most = 0;
        for p in &s {
            let held: Vec<&Planned> =
                s.iter().filter(|q| !q.hold.is_zero() && q.at <= p.at && p.at < q.until()).collect();
            most = most.max(held.len());
            assert!(held.len() <= 3, "at {:?}: {held:?}", p.at);
            let mut names: Vec<&str> = held.iter().map(|q| q.target.as_str()).collect();
            names.sort_unstable();
            names.dedup();
            assert_eq!(names.len(), held.len(), "one fault per target at {:?}: {held:?}", p.at);
        }
        assert!(most >= 2, "faults overlap");
        for k in FaultKind::ALL {
            assert!(s.iter().any(|p| p.kind == k), "{k:?} drawn in ten minutes");
        }
        assert!(s.iter().all(|p| p.until() <= Duration::from_secs(600)), "every fault lifted by the end");
    }

    #[test]
    fn kinds_and_exclusions_are_kept_to() {
        let mut o = options(3);
        o.kinds = vec![FaultKind::KillDecode, FaultKind::StopCoordinator, FaultKind::KillEtcd];
        o.exclude = vec!["decode-1".into(), "etcd".into()];
        let s = schedule(&o, &targets());
        assert!(!s.is_empty());
        assert!(s.iter().all(|p| matches!(p.kind, FaultKind::KillDecode | FaultKind::StopCoordinator)), "{s:?}");
        assert!(s.iter().all(|p| p.target != "decode-1"), "{s:?}");
        o.kinds = vec![FaultKind::KillEtcd];
        assert!(schedule(&o, &targets()).is_empty(), "every target of the only kind excluded");
        // A KV link is excluded by its worker's name too.
        o.kinds = vec![FaultKind::KvReset, FaultKind::KvDelay];
        let s = schedule(&o, &targets());
        assert!(!s.is_empty() && s.iter().all(|p| p.target == kv_link("decode-0")), "{s:?}");
    }

    #[test]
    fn processes_never_killed_still_meet_every_other_fault() {
        let mut o = options(5);
        o.never_kill = vec!["decode-1".into(), "coordinator".into(), "etcd".into()];
        let s = schedule(&o, &targets());
        let on = |name: &str| -> Vec<FaultKind> { s.iter().filter(|p| p.target == name).map(|p| p.kind).collect() };
        let (d1, c0) = (on("decode-1"), on("coordinator"));
        assert!(d1.iter().all(|k| !k.kills()) && d1.contains(&FaultKind::StopDecode), "{d1:?}");
        assert!(c0.iter().all(|k| !k.kills()) && !c0.is_empty(), "{c0:?}");
        assert!(s.iter().all(|p| p.kind != FaultKind::KillEtcd), "the only etcd spared: no etcd kill drawn");
        assert!(on("etcd").contains(&FaultKind::StopEtcd), "{s:?}");
        assert!(on("decode-0").contains(&FaultKind::KillDecode), "the others are still killed");
        // Sparing nobody draws the schedule it always drew.
        o.never_kill.clear();
        assert_eq!(schedule(&o, &targets()), schedule(&options(5), &targets()));
    }

    #[test]
    fn kinds_parse_by_their_names() {
        for k in FaultKind::ALL {
            assert_eq!(FaultKind::parse(k.name()), Some(k));
        }
        assert_eq!(FaultKind::parse("kill-everything"), None);
    }
}
