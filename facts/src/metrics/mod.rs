//! Metric names, their kinds, label names and exporters.
//!
//! Names are prefixed `tandem_` (Prometheus reserves colons for recording rules; vLLM's
//! `vllm:` names map over by a rename), the coordinator's `tandem_coordinator_` so they
//! never collide with the workers' series in one Prometheus. Each constant's doc names
//! the vLLM metric it corresponds to where there is one.
//!
//! [`catalog`] lists every metric once. A test scrapes each real process and checks that
//! every `tandem_` series it exports is in the catalog under that process, with exactly
//! the catalog's label names (`cluster-tests`), and the docs check (tandem/tests/docs.rs)
//! fails on a constant the docs do not mention.

pub mod coordinator;
pub mod decode;
pub mod prefill;
pub mod worker;

/// `tandem_process_start_time_seconds`: when this process started, Unix seconds. It
/// changes with every restart, however fast, which is how the restart alert counts them.
/// Every tandem process exports it. vLLM: none (the Python client's
/// `process_start_time_seconds`).
pub const PROCESS_START: &str = "tandem_process_start_time_seconds";

/// What kind of series a metric is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    /// Rendered as `_bucket{le}`, `_sum` and `_count`.
    Histogram,
}

/// Which processes export a metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exporter {
    /// Every tandem process.
    Every,
    /// Prefill and decode workers.
    Workers,
    Prefill,
    Decode,
    Coordinator,
}

/// A process that serves `/metrics`, as [`Exporter`] sorts them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Process {
    Prefill,
    Decode,
    Coordinator,
}

impl Exporter {
    /// Whether `p` exports a metric of this exporter.
    pub fn includes(self, p: Process) -> bool {
        match self {
            Exporter::Every => true,
            Exporter::Workers => matches!(p, Process::Prefill | Process::Decode),
            Exporter::Prefill => p == Process::Prefill,
            Exporter::Decode => p == Process::Decode,
            Exporter::Coordinator => p == Process::Coordinator,
        }
    }
}

/// One metric: its name, kind, label names (in any order on the wire) and exporter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Metric {
    pub name: &'static str,
    pub kind: Kind,
    pub labels: &'static [&'static str],
    pub exporter: Exporter,
}

const SHARED: &[Metric] = &[Metric { name: PROCESS_START, kind: Kind::Gauge, labels: &[], exporter: Exporter::Every }];

/// Every metric any tandem process exports.
pub fn catalog() -> impl Iterator<Item = &'static Metric> {
    SHARED.iter().chain(worker::CATALOG).chain(prefill::CATALOG).chain(decode::CATALOG).chain(coordinator::CATALOG)
}

/// The catalog entry for `name` as exported by `p`: a histogram's `_bucket`, `_sum` and
/// `_count` series find their histogram.
pub fn lookup(name: &str, p: Process) -> Option<&'static Metric> {
    let base = |m: &Metric| {
        m.name == name
            || (m.kind == Kind::Histogram
                && ["_bucket", "_sum", "_count"].iter().any(|s| name.strip_suffix(s) == Some(m.name)))
    };
    catalog().find(|m| m.exporter.includes(p) && base(m))
}

/// Checks one exported series against the catalog: `name{labels}` as process `p`
/// rendered it. The error says what disagrees.
pub fn check_series(p: Process, name: &str, labels: &[&str]) -> Result<(), String> {
    let m = lookup(name, p).ok_or_else(|| format!("{p:?} exports {name}, which is not in the catalog for it"))?;
    let mut got: Vec<&str> = labels.iter().copied().filter(|l| !(m.kind == Kind::Histogram && *l == "le")).collect();
    let mut want = m.labels.to_vec();
    got.sort_unstable();
    want.sort_unstable();
    if got == want {
        Ok(())
    } else {
        Err(format!("{p:?} exports {name} with labels {got:?}; the catalog says {want:?}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_per_process_and_prefixed() {
        let all: Vec<&Metric> = catalog().collect();
        assert!(all.len() >= 90, "{} metrics", all.len());
        for (i, a) in all.iter().enumerate() {
            assert!(a.name.starts_with("tandem_"), "{}", a.name);
            for b in &all[i + 1..] {
                let clash = [Process::Prefill, Process::Decode, Process::Coordinator]
                    .iter()
                    .any(|&p| a.exporter.includes(p) && b.exporter.includes(p));
                assert!(!(a.name == b.name && clash), "{} listed twice for one process", a.name);
            }
        }
    }

    #[test]
    fn series_are_checked_by_name_exporter_and_label_set() {
        assert_eq!(check_series(Process::Decode, decode::TTFT, &[]), Ok(()));
        assert_eq!(check_series(Process::Decode, "tandem_time_to_first_token_seconds_bucket", &["le"]), Ok(()));
        assert_eq!(check_series(Process::Coordinator, coordinator::REQUESTS, &["code", "api", "status"]), Ok(()));
        assert!(check_series(Process::Coordinator, coordinator::REQUESTS, &["api", "status"]).is_err());
        assert!(check_series(Process::Prefill, decode::TTFT, &[]).is_err(), "a decode metric on a prefill worker");
        assert!(check_series(Process::Prefill, "tandem_made_up_total", &[]).is_err());
        assert_eq!(check_series(Process::Coordinator, PROCESS_START, &[]), Ok(()));
    }
}
