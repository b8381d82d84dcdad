//! What must hold after every drill, whatever its fault (G1–G5 here; G6,
//! the fault's own proof, is the drill's and is recorded the same way).

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::time::Duration;

use loadgen::{Outcome, Record, Report};

use facts::metrics::decode::{KV_RECEIVED_BYTES, RESERVATIONS_ACTIVE};
use facts::metrics::prefill::KV_TRANSFER_BYTES;
use facts::metrics::worker::KV_BLOCKS_USED;

use crate::cluster::{Cluster, Role};
use crate::metrics::{scrape, Page};
use crate::process::{proc_state, Signal};

/// The guarantees a drill checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
pub enum Guarantee {
    /// Every accepted request ends in a complete answer equal to the no-fault one, or a
    /// typed error (of a kind the drill allows); none is lost or hangs.
    G1,
    /// After settling, no KV block is used and no reservation is active on any live worker.
    G2,
    /// No KV crosses version groups: per group, the bytes prefill workers sent in completed
    /// transfers all landed in that group's decode workers.
    G3,
    /// No response bytes after a request's deadline (plus a small grace).
    G4,
    /// No panic in any log; every process alive or exited as the drill meant.
    G5,
    /// The fault provably happened.
    G6,
    /// The drill's own outcome bound (overload: goodput against the no-overload maximum,
    /// coordinator memory).
    Drill,
}

/// One broken guarantee.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Violation {
    pub guarantee: Guarantee,
    pub detail: String,
}

impl Violation {
    pub fn new(guarantee: Guarantee, detail: impl Into<String>) -> Self {
        Self { guarantee, detail: detail.into() }
    }
}

/// How one drill's run is judged.
#[derive(Debug, Clone)]
pub struct Invariants {
    /// The deadline each request carried (`x-request-timeout-ms`).
    pub deadline: Duration,
    /// Slack past the deadline before G4 (and G1's "hang") counts it.
    pub grace: Duration,
    /// Every request must complete (the fault is one the cluster hides).
    pub all_complete: bool,
    /// Error codes the drill expects; `None` allows any typed error.
    pub allowed_errors: Option<Vec<String>>,
    /// Nothing cut a transfer short: per group, sent bytes equal received bytes.
    pub transfers_intact: bool,
    /// Bound on waiting for counters and KV to settle.
    pub settle: Duration,
    /// Overload drills: how the load is offered and how much goodput it must keep (see
    /// `GoodputBound`); the coordinator's resident memory may grow at most
    /// [`Invariants::max_rss_growth_mib`] under it.
    pub goodput: Option<GoodputBound>,
    pub max_rss_growth_mib: f64,
    /// When a coordinator was SIGKILLed, from the load's start: (signal sent, death seen).
    /// Filled by the drill runner from [`Cluster::coordinator_kills`]. A request in flight
    /// across one of these windows may end in a transport error: its coordinator is gone,
    /// so nobody is left to send a typed one. Such requests are counted apart
    /// (`coordinator_lost`), never as complete and never silently.
    pub coordinator_kills: Vec<(Duration, Duration)>,
    /// The drill cuts client connections on purpose (a fault proxy on the request link
    /// resets them): a transport error is such a request's expected end. Counted apart
    /// (`cut_by_fault`); the drill's proof checks their number equals the proxy's resets.
    pub cuts_allowed: bool,
}

impl Default for Invariants {
    fn default() -> Self {
        Self {
            deadline: Duration::from_secs(60),
            grace: Duration::from_secs(2),
            all_complete: false,
            allowed_errors: None,
            transfers_intact: false,
            settle: Duration::from_secs(20),
            goodput: None,
            max_rss_growth_mib: 64.0,
            coordinator_kills: Vec::new(),
            cuts_allowed: false,
        }
    }
}

/// An overload drill's load and its goodput bound.
///
/// The no-overload maximum is measured on the drill's own cluster, twice: a
/// closed loop of `saturating` clients (enough to keep admission's running
/// slots busy without a single refusal) before the overload and again after
/// it. The overload is open-loop: Poisson arrivals at `factor` times the
/// request rate the first measurement achieved, so the offered load stays
/// `factor` times capacity whatever admission refuses (a closed loop cannot
/// keep an overload going: its refusals come back at once and use the
/// requests up). Every request of such a drill generates exactly
/// `max_tokens` (`ignore_eos`, the reference too), so requests are the same
/// work whichever are admitted. Goodput is the output tokens of completed
/// requests per second from the first arrival to the last completion, and must reach
/// `floor` times the lower of the two measurements, which bracket the
/// overload in time. The lower, not the mean: on the 2-core VMs the
/// machine's own speed moves 10-30% between two 12-request measurements a
/// few seconds apart (52/50, 45/52, 62/68, 54/42 tok/s in one hour), in
/// either direction, and against the mean one quiet run in three failed
/// while nothing was wasted. What the bound is for, capacity lost to the
/// excess (refused requests computed, a slot left idle while requests
/// wait), costs far more than the gap between the two.
///
/// The machine's speed moves within a load too, so each throughput is judged at
/// the speed it was measured at: multiplied by the median time between two
/// tokens of an answer in the same load (as the client saw them), which makes it
/// the share of the time an answer was streaming at the machine's pace — a slot
/// left idle or a stream stalled lowers it, a slower machine does not. Raw, the
/// retry storm's goodput spread 78-113% of the lower baseline over eight quiet
/// runs of one build (one run's two baselines 42 and 54 tok/s), with no CPU
/// stolen by the hypervisor and the decode worker's core to itself; at speed, the
/// next four read 96-105% (raw 90-113%), and overload-3x 103% where it measured
/// 85% raw (its answers streamed at 24.0 ms a token against 19.5/19.7 around it).
/// The raw ratio is reported beside it. What a speed
/// correction could hide, refused requests computed beside the admitted ones
/// (they would slow the admitted answers' tokens), is counted directly: the
/// decode workers must have begun no more requests during the overload than it
/// completed.
///
/// With `closed`, the drill's own load is not an overload: it keeps the baseline's
/// closed loop of `saturating` clients (the drill's `concurrency`), so goodput is
/// what a fault (a rolling drain) costs a steady load, against the same load
/// undisturbed; `factor` is unused. Tokens a coordinator generated again to resume a
/// stream (loadgen's `Retries::regenerated`) count as work done: regenerating from
/// the cursor is how resumption works without state shared between coordinators, and
/// it is reported beside the ratio. What the bound catches is capacity lost besides:
/// a drain that stalls clients, a slot left idle. (In coordinator-rolling-drain it is
/// small but not bounded by anything the drill controls: one run regenerated 43 tokens
/// for 5 resumes of 2,304; a drain late in long streams would regenerate most of them.)
///
/// With `arrivals_only`, goodput is measured while the arrivals last (from the first
/// arrival to the last), counting each output token by when it arrived: for loads
/// whose clients retry, whose tail after the last arrival is only retries spaced by
/// their Retry-After, when the cluster is no longer offered more than it takes.
#[derive(Debug, Clone, Copy)]
pub struct GoodputBound {
    pub floor: f64,
    pub factor: f64,
    pub saturating: usize,
    /// Requests in each no-overload measurement.
    pub baseline_requests: usize,
    pub arrivals_only: bool,
    pub closed: bool,
}

/// Numbers the checks measured, for the report.
#[derive(Debug, Clone, Default)]
pub struct Measured {
    pub leaked_blocks: f64,
    pub active_reservations: f64,
    pub g3_skipped_groups: Vec<String>,
}

impl Invariants {
    /// G1–G5 over a finished run; `reference[i]` is request `i`'s no-fault answer.
    pub async fn check(&self, cluster: &Cluster, report: &Report, reference: &[String]) -> Vec<Violation> {
        self.check_measured(cluster, report, reference).await.0
    }

    pub(crate) async fn check_measured(
        &self,
        cluster: &Cluster,
        report: &Report,
        reference: &[String],
    ) -> (Vec<Violation>, Measured) {
        let mut v = self.requests(report, reference);
        let mut m = Measured::default();
        v.extend(self.kv_settled(cluster, &mut m).await);
        v.extend(self.groups(cluster, &mut m).await);
        v.extend(logs_and_processes(cluster));
        (v, m)
    }

    /// Whether `r` ended in a transport error while in flight across a coordinator's SIGKILL:
    /// started before its death was seen, and still running when the signal was sent.
    pub fn coordinator_lost(&self, r: &Record) -> bool {
        matches!(r.outcome, Outcome::Transport(_))
            && self.coordinator_kills.iter().any(|&(sent, dead)| r.start <= dead && r.start + r.e2e >= sent)
    }

    /// Where a lost request stood against the coordinator kills, for its violation's text.
    fn window_note(&self, r: &Record) -> String {
        if self.coordinator_kills.is_empty() {
            return String::new();
        }
        let ms = |d: Duration| d.as_millis();
        let kills: Vec<String> =
            self.coordinator_kills.iter().map(|&(s, d)| format!("{}..{} ms", ms(s), ms(d))).collect();
        format!(
            " (in flight {}..{} ms; coordinator kills, signal sent..death seen: {})",
            ms(r.start),
            ms(r.start + r.e2e),
            kills.join(", ")
        )
    }

    /// G1 and G4, from the client's records.
    pub fn requests(&self, report: &Report, reference: &[String]) -> Vec<Violation> {
        let mut v = Vec::new();
        for r in &report.records {
            let i = r.index;
            match &r.outcome {
                Outcome::Complete { .. } => match reference.get(i) {
                    Some(want) if *want != r.text => v.push(Violation::new(
                        Guarantee::G1,
                        format!(
                            "request {i}: answer differs from the no-fault run:\n  got  {:?}\n  want {want:?}",
                            r.text
                        ),
                    )),
                    Some(_) => {}
                    None => v.push(Violation::new(Guarantee::G1, format!("request {i}: no reference answer"))),
                },
                o if o.error_code().is_some() => {
                    let c = o.error_code().unwrap_or_default();
                    if self.all_complete {
                        v.push(Violation::new(
                            Guarantee::G1,
                            format!("request {i}: {} where every request should complete", r.outcome.label()),
                        ));
                    } else if self.allowed_errors.as_ref().is_some_and(|a| !a.iter().any(|x| x == c)) {
                        v.push(Violation::new(
                            Guarantee::G1,
                            format!(
                                "request {i}: error `{c}` is not one this drill expects ({:?})",
                                self.allowed_errors
                            ),
                        ));
                    }
                }
                Outcome::Transport(_) if self.coordinator_lost(r) && !self.all_complete => {}
                Outcome::Transport(_) if self.cuts_allowed => {}
                Outcome::Timeout => v.push(Violation::new(
                    Guarantee::G1,
                    format!("request {i}: hung until the client gave up ({:?}){}", r.e2e, cut_notes(r)),
                )),
                other => v.push(Violation::new(
                    Guarantee::G1,
                    format!("request {i}: lost, not a typed outcome: {other:?}{}", self.window_note(r)),
                )),
            }
            // Whatever reached the client before an error is the start of the no-fault answer:
            // tokens are never duplicated, spliced from another attempt or reordered.
            if !r.outcome.is_complete() && !r.text.is_empty() {
                if let Some(want) = reference.get(i).filter(|w| !w.starts_with(&r.text)) {
                    v.push(Violation::new(
                        Guarantee::G1,
                        format!(
                            "request {i}: the text it got before `{}` is not the start of the no-fault answer:\n  \
                             got  {:?}\n  want {want:?}",
                            r.outcome.label(),
                            r.text
                        ),
                    ));
                }
            }
            // A retry after a refusal is a new request with its own deadline (the client
            // chose to wait out the Retry-After); a resume is judged from the first attempt.
            let ran = r.retries.last_start.map_or(r.e2e, |last| (r.start + r.e2e).saturating_sub(last));
            if ran > self.deadline + self.grace {
                v.push(Violation::new(
                    Guarantee::G4,
                    format!(
                        "request {i}: last byte {ran:?} after its last attempt started, past deadline {:?} + grace",
                        self.deadline
                    ),
                ));
            }
        }
        v
    }

    /// G2: every live worker's KV back to zero within `settle`.
    async fn kv_settled(&self, cluster: &Cluster, m: &mut Measured) -> Vec<Violation> {
        let live: Vec<_> = cluster.workers.iter().filter(|w| !cluster.is_faulted(&w.proc.name)).collect();
        let until = tokio::time::Instant::now() + self.settle;
        loop {
            let mut pages = Vec::new();
            for w in &live {
                let page = scrape(&w.proc.addr("metrics").unwrap_or_default()).await.map_err(|e| e.to_string());
                pages.push((w.proc.name.as_str(), w.role, page));
            }
            let (left, blocks, res) = kv_left(&pages);
            (m.leaked_blocks, m.active_reservations) = (blocks, res);
            if left.is_empty() {
                return Vec::new();
            }
            if tokio::time::Instant::now() > until {
                return left
                    .into_iter()
                    .map(|l| Violation::new(Guarantee::G2, format!("not settled after {:?}: {l}", self.settle)))
                    .collect();
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// G3: per version group, prefill bytes sent in completed transfers landed in that
    /// group's decode workers (equal when nothing cut a transfer short). A group with a
    /// killed member cannot be counted and is listed as skipped.
    async fn groups(&self, cluster: &Cluster, m: &mut Measured) -> Vec<Violation> {
        let mut groups: BTreeMap<&str, bool> = BTreeMap::new();
        for w in &cluster.workers {
            let whole = groups.entry(&w.group).or_insert(true);
            *whole &= !cluster.is_faulted(&w.proc.name);
            for life in &w.past {
                *groups.entry(&life.group).or_insert(true) &= life.counted;
            }
        }
        let mut out = Vec::new();
        for (g, whole) in groups {
            if !whole {
                m.g3_skipped_groups.push(g.to_owned());
                continue;
            }
            let until = tokio::time::Instant::now() + self.settle;
            loop {
                let (mut sent, mut got, mut err) = (0.0, 0.0, None);
                // Earlier lives of restarted workers (their counters reset with the process).
                for life in cluster.workers.iter().flat_map(|w| &w.past).filter(|l| l.group == g) {
                    sent += life.kv_sent;
                    got += life.kv_received;
                }
                for w in cluster.workers.iter().filter(|w| w.group == g) {
                    // An attached cluster: only what moved since the drill attached.
                    let (s0, r0) = cluster.kv_at_attach(&w.proc.name);
                    sent -= s0;
                    got -= r0;
                    let page = scrape(&w.proc.addr("metrics").unwrap_or_default()).await;
                    match page.map_err(|e| e.to_string()).and_then(|p| kv_moved(w.role, &p)) {
                        Ok(bytes) if w.role == Role::Prefill => sent += bytes,
                        Ok(bytes) => got += bytes,
                        Err(e) => err = Some(format!("{}: {e}", w.proc.name)),
                    }
                }
                let ok = err.is_none() && if self.transfers_intact { sent == got } else { sent <= got };
                if ok {
                    break;
                }
                if tokio::time::Instant::now() > until {
                    out.push(Violation::new(
                        Guarantee::G3,
                        format!(
                            "group {g}: prefill workers sent {sent} bytes in completed transfers, its decode workers \
                             received {got} ({}){}",
                            if self.transfers_intact { "should be equal" } else { "should be at least as many" },
                            err.map(|e| format!("; {e}")).unwrap_or_default()
                        ),
                    ));
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        out
    }
}

/// One round of G2 over the live workers' pages (name, role, page or why it could not be
/// read): what is not settled, one line per worker, and the KV blocks used and reservations
/// active counted in all. A page that lacks a series G2 reads is not settled.
pub(crate) fn kv_left(pages: &[(&str, Role, Result<Page, String>)]) -> (Vec<String>, f64, f64) {
    let mut left = Vec::new();
    let (mut blocks, mut res) = (0.0, 0.0);
    for (name, role, page) in pages {
        match page.as_ref().map_err(Clone::clone).and_then(|p| kv_held(*role, p)) {
            Ok((b, r)) => {
                blocks += b;
                res += r;
                if b != 0.0 || r != 0.0 {
                    left.push(format!("{name}: {b} KV blocks used, {r} reservations active"));
                }
            }
            Err(e) => left.push(format!("{name}: {e}")),
        }
    }
    (left, blocks, res)
}

/// What G2 reads of one live worker: (KV blocks used, reservations active), by the names
/// the workers export. An error names a series the page lacks, so a renamed metric fails
/// G2 instead of reading as "nothing leaked". A prefill worker holds no reservations.
pub(crate) fn kv_held(role: Role, page: &Page) -> Result<(f64, f64), String> {
    let blocks = page.get(KV_BLOCKS_USED, &[]).map_err(|e| e.to_string())?;
    let reservations = match role {
        Role::Decode => page.get(RESERVATIONS_ACTIVE, &[]).map_err(|e| e.to_string())?,
        Role::Prefill => 0.0,
    };
    Ok((blocks, reservations))
}

/// What G3 reads of one worker: KV bytes a prefill worker sent in completed transfers, or a
/// decode worker received; an error names the missing series.
pub(crate) fn kv_moved(role: Role, page: &Page) -> Result<f64, String> {
    let name = if role == Role::Prefill { KV_TRANSFER_BYTES } else { KV_RECEIVED_BYTES };
    page.get(name, &[]).map_err(|e| e.to_string())
}

/// What `path` holds from byte `start` on (all of it when it has shrunk below `start`:
/// rotated or truncated); empty when it cannot be read.
fn log_since(path: &Path, start: u64) -> String {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut f) = std::fs::File::open(path) else { return String::new() };
    let len = f.metadata().map_or(0, |m| m.len());
    let from = if start <= len { start } else { 0 };
    let mut bytes = Vec::new();
    if f.seek(SeekFrom::Start(from)).and_then(|_| f.read_to_end(&mut bytes)).is_err() {
        return String::new();
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

/// G5, part one: no panic in any log; every process the drill did not fault is still running.
pub fn logs_and_processes(cluster: &Cluster) -> Vec<Violation> {
    let mut v = Vec::new();
    for (name, path) in cluster.log_paths() {
        let text = log_since(&path, cluster.log_start(&path));
        if let Some(line) = text.lines().find(|l| l.contains("panicked at")) {
            v.push(Violation::new(Guarantee::G5, format!("{name} panicked ({}): {line}", path.display())));
        }
    }
    for p in cluster.procs() {
        if !cluster.is_faulted(&p.name) && matches!(proc_state(p.pid), None | Some('Z')) {
            v.push(Violation::new(Guarantee::G5, format!("{} (pid {}) exited during the drill", p.name, p.pid)));
        }
    }
    for i in 0..cluster.etcd.len() {
        let name = format!("etcd-{}", cluster.etcd.name(i));
        if !cluster.is_faulted(&name)
            && cluster.etcd.pid(i).is_none_or(|pid| matches!(proc_state(pid), None | Some('Z')))
        {
            v.push(Violation::new(Guarantee::G5, format!("{name} is not running at the end of the drill")));
        }
    }
    // An attached cluster's etcd members, when its state file lists them.
    for p in cluster.attached_etcd() {
        if matches!(proc_state(p.pid), None | Some('Z')) {
            v.push(Violation::new(Guarantee::G5, format!("{} is not running at the end of the drill", p.name)));
        }
    }
    v
}

/// G5 for an [attached](Cluster::attach) cluster, instead of [`shutdown`] (it is not ours to
/// stop): continue any process the drill stopped, then every process — faulted or not, since
/// only reversible faults run against someone else's cluster — must be running (not stopped)
/// and the coordinator's `/ready` must answer 200.
pub async fn left_as_found(cluster: &Cluster) -> Vec<Violation> {
    let mut v = Vec::new();
    for p in cluster.procs() {
        if cluster.faulted.get(&p.name) == Some(&Signal::Stop) {
            if let Err(e) = p.signal(Signal::Cont) {
                v.push(Violation::new(Guarantee::G5, format!("continuing {}: {e}", p.name)));
            }
        }
    }
    let etcd = cluster.attached_etcd();
    for p in cluster.procs().chain(etcd) {
        let what = format!("{} (pid {}) runs (not stopped) after the drill", p.name, p.pid);
        let running = crate::eventually(&what, Duration::from_secs(5), || async {
            !matches!(proc_state(p.pid), None | Some('Z' | 'T'))
        })
        .await;
        if let Err(e) = running {
            v.push(Violation::new(Guarantee::G5, format!("{e}: state {:?}", proc_state(p.pid))));
        }
    }
    match cluster.http_addr() {
        Ok(h) => {
            let ready = crate::eventually(
                "the coordinator's /ready answers 200 after the drill",
                cluster.lease_ttl * 3,
                || {
                    let h = h.clone();
                    async move { crate::metrics::get_status(&h, "/ready").await.is_ok_and(|s| s == 200) }
                },
            )
            .await;
            if let Err(e) = ready {
                v.push(Violation::new(Guarantee::G5, e.to_string()));
            }
        }
        Err(e) => v.push(Violation::new(Guarantee::G5, e.to_string())),
    }
    v
}

/// G5, part two: SIGTERM every process (coordinator first) and require a clean exit
/// within `limit`; a process the drill SIGKILLed must have died of that signal.
pub async fn shutdown(cluster: &mut Cluster, limit: Duration) -> Vec<Violation> {
    let mut v = Vec::new();
    let faulted = cluster.faulted.clone();
    for p in cluster.procs() {
        match faulted.get(&p.name) {
            Some(Signal::Kill) => {}
            Some(Signal::Stop) => {
                let _ = p.signal(Signal::Cont);
            }
            _ => {}
        }
    }
    // The coordinator first, so workers are not drained under a live frontend; then every
    // worker at once.
    let coordinator: Vec<String> = cluster.coordinators().map(|c| c.name.clone()).collect();
    let workers: Vec<String> = cluster.workers.iter().map(|w| w.proc.name.clone()).collect();
    for phase in [coordinator, workers] {
        for name in &phase {
            let Some(p) = cluster.procs_mut().find(|p| &p.name == name) else { continue };
            if faulted.get(name) != Some(&Signal::Kill) && p.exited().is_none() {
                if let Err(e) = p.signal(Signal::Term) {
                    v.push(Violation::new(Guarantee::G5, e.to_string()));
                }
            }
        }
        for name in &phase {
            let Some(p) = cluster.procs_mut().find(|p| &p.name == name) else { continue };
            let killed = faulted.get(name) == Some(&Signal::Kill);
            match p.wait_exit(limit).await {
                Ok(st) if killed && st.signal() == Some(9) => {}
                Ok(st) if killed => {
                    v.push(Violation::new(Guarantee::G5, format!("{name} was SIGKILLed but exited with {st}")))
                }
                Ok(st) if st.success() => {}
                Ok(st) => v.push(Violation::new(Guarantee::G5, format!("{name} exited with {st} after SIGTERM"))),
                Err(e) => v.push(Violation::new(Guarantee::G5, format!("after SIGTERM: {e}"))),
            }
        }
    }
    let panics = logs_and_processes(cluster).into_iter().filter(|x| x.detail.contains("panicked"));
    v.extend(panics);
    v
}

/// The cuts a resumed request met before it ended (the first and last few), for its
/// violation's detail.
fn cut_notes(r: &Record) -> String {
    const ENDS: usize = 3;
    let c = &r.cuts;
    let shown = if c.len() <= 2 * ENDS {
        c.join("; ")
    } else {
        format!("{}; ({} more); {}", c[..ENDS].join("; "), c.len() - 2 * ENDS, c[c.len() - ENDS..].join("; "))
    };
    if c.is_empty() {
        String::new()
    } else {
        format!(", after {} resumes, each attempt ended: {shown}", c.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `/metrics` of an idle decode and prefill worker, captured after their first Health
    /// poll (a coordinator in front; `curl http://METRICS/metrics`).
    const DECODE_PAGE: &str = include_str!("../fixtures/decode-worker.metrics");
    const PREFILL_PAGE: &str = include_str!("../fixtures/prefill-worker.metrics");

    fn page(text: &str) -> Result<Page, String> {
        Page::parse(text).map_err(|e| e.to_string())
    }

    #[test]
    fn g2_fails_naming_the_series_when_a_metric_it_reads_is_renamed() {
        let idle = [("decode-0", Role::Decode, page(DECODE_PAGE)), ("prefill-0", Role::Prefill, page(PREFILL_PAGE))];
        assert_eq!(kv_left(&idle), (Vec::new(), 0.0, 0.0), "idle workers are settled");
        for (role, text, name) in [
            (Role::Decode, DECODE_PAGE, KV_BLOCKS_USED),
            (Role::Decode, DECODE_PAGE, RESERVATIONS_ACTIVE),
            (Role::Prefill, PREFILL_PAGE, KV_BLOCKS_USED),
        ] {
            assert!(text.contains(&format!("\n{name} 0\n")), "the captured page exports {name}");
            let renamed = text.replace(name, &format!("{name}_v2"));
            let (left, _, _) = kv_left(&[("w", role, page(&renamed))]);
            assert_eq!(left.len(), 1, "{role:?} without {name}: {left:?}");
            assert!(left[0].starts_with("w: ") && left[0].contains(&format!("no series {name} ")), "{left:?}");
        }
        // And a page that cannot be read is not settled either.
        let (left, _, _) = kv_left(&[("w", Role::Decode, Err("connect: refused".into()))]);
        assert_eq!(left, ["w: connect: refused"]);
    }

    #[test]
    fn g3_fails_naming_the_series_when_a_kv_counter_is_renamed() {
        assert_eq!(kv_moved(Role::Decode, &page(DECODE_PAGE).expect("parse")), Ok(0.0));
        assert_eq!(kv_moved(Role::Prefill, &page(PREFILL_PAGE).expect("parse")), Ok(0.0));
        for (role, text, name) in
            [(Role::Decode, DECODE_PAGE, KV_RECEIVED_BYTES), (Role::Prefill, PREFILL_PAGE, KV_TRANSFER_BYTES)]
        {
            let renamed = page(&text.replace(name, "tandem_kv_bytes_moved_total")).expect("parse");
            let e = kv_moved(role, &renamed).expect_err("a renamed counter must fail G3");
            assert!(e.contains(&format!("no series {name} ")), "{e}");
        }
    }

    fn transport(start_ms: u64, e2e_ms: u64) -> Record {
        Record {
            index: 0,
            outcome: Outcome::Transport("connection closed before message completed".into()),
            start: Duration::from_millis(start_ms),
            ttft: None,
            itl: Vec::new(),
            output_tokens: 0,
            usage_reported: false,
            prompt_tokens: None,
            cached_tokens: None,
            e2e: Duration::from_millis(e2e_ms),
            text: String::new(),
            retries: Default::default(),
            cuts: Vec::new(),
        }
    }

    #[test]
    fn a_transport_error_is_allowed_only_across_a_coordinator_kill() {
        let inv = Invariants {
            coordinator_kills: vec![(Duration::from_millis(1000), Duration::from_millis(1020))],
            ..Invariants::default()
        };
        let report = |r: Record| Report { wall: Duration::from_secs(5), records: vec![r] };
        let reference = vec![String::new()];
        // In flight across the kill, or connected while it was dying: counted, not a violation.
        for r in [transport(500, 600), transport(1010, 2)] {
            assert!(inv.coordinator_lost(&r), "{r:?}");
            assert!(inv.requests(&report(r), &reference).is_empty());
        }
        // Ended before the kill, or started after the death was seen: lost (G1).
        for r in [transport(100, 200), transport(1100, 50)] {
            assert!(!inv.coordinator_lost(&r), "{r:?}");
            let v = inv.requests(&report(r), &reference);
            assert!(v.len() == 1 && v[0].detail.contains("lost, not a typed outcome"), "{v:?}");
        }
        // Where every request must complete, nothing is excused.
        let strict = Invariants { all_complete: true, ..inv };
        assert_eq!(strict.requests(&report(transport(500, 600)), &reference).len(), 1);
    }

    /// A request that hung after being resumed says how each attempt ended: the first
    /// and last few, so the cause (the first cut) and the loop (the last ones) both show.
    #[test]
    fn a_hung_request_names_its_cuts() {
        let mut r = transport(0, 41_000);
        r.outcome = Outcome::Timeout;
        r.cuts = (0..10).map(|i| format!("{i}.0 s: cut {i}")).collect();
        let report = Report { wall: Duration::from_secs(50), records: vec![r.clone()] };
        let v = Invariants::default().requests(&report, &[String::new()]);
        let d = &v[0].detail;
        assert!(d.contains("hung until the client gave up") && d.contains("after 10 resumes"), "{d}");
        assert!(d.contains("0.0 s: cut 0; 1.0 s: cut 1; 2.0 s: cut 2; (4 more); 7.0 s: cut 7"), "{d}");
        assert!(d.ends_with("9.0 s: cut 9") && !d.contains("cut 5"), "{d}");
        r.cuts.clear();
        let report = Report { wall: Duration::from_secs(50), records: vec![r] };
        let v = Invariants::default().requests(&report, &[String::new()]);
        assert!(v[0].detail.ends_with("gave up (41s)"), "{v:?}");
    }
}
