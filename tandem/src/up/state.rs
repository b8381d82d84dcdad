//! What `tandem up` tells the outside about its processes: the state file
//! (JSON, rewritten whole on every change) and the table printed once the
//! cluster is ready.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;

use anyhow::Context;
use serde::Serialize;

/// One component, as written to the state file (a field only where the component has it).
#[derive(Debug, Clone, Serialize)]
pub struct Component {
    pub role: &'static str,
    /// Its name in `tandem up`'s lines and logs: `etcd`, `prefill-0`, `decode-1`, `coordinator`.
    /// Workers register under it as their worker id, so a restarted worker takes its own key back.
    pub name: String,
    /// The running process; after an exit, the last one until a restart replaces it.
    pub pid: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grpc: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub http: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub transfer: Option<String>,
    /// Prefill and decode workers: the version group they registered in.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub version_group: Option<String>,
    /// Prefill and decode workers: their etcd lease TTL, whole seconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lease_ttl_s: Option<u64>,
    /// The file its stdout and stderr go to (appended across restarts).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub log: Option<PathBuf>,
    /// Where the supervisor has it.
    pub state: State,
    /// Times it was started again after an exit.
    pub restarts: u32,
    /// How its last process ended (`exit status 1`, `signal 9 (SIGKILL)`, or why a start
    /// failed), once one has.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_exit: Option<String>,
}

/// A component's place in the supervisor's cycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum State {
    /// Its process is up (started and listening).
    Running,
    /// It exited and is waiting out its backoff or starting again.
    Restarting,
    /// It exited and the restart policy leaves it down (`never`, or a clean exit under
    /// `on-failure`).
    Exited,
    /// It exited too often too fast: no more restarts (crash loop).
    GivenUp,
}

impl Component {
    pub fn new(role: &'static str, name: impl Into<String>) -> Self {
        Self {
            role,
            name: name.into(),
            pid: 0,
            grpc: None,
            http: None,
            metrics: None,
            transfer: None,
            version_group: None,
            lease_ttl_s: None,
            log: None,
            state: State::Running,
            restarts: 0,
            last_exit: None,
        }
    }

    /// The address it printed or was given under `key` (`grpc`, `http`, `metrics`, `transfer`).
    pub fn addr(&self, key: &str) -> Option<&String> {
        match key {
            "grpc" => self.grpc.as_ref(),
            "http" => self.http.as_ref(),
            "metrics" => self.metrics.as_ref(),
            "transfer" => self.transfer.as_ref(),
            _ => None,
        }
    }

    pub fn addr_mut(&mut self, key: &str) -> Option<&mut Option<String>> {
        match key {
            "grpc" => Some(&mut self.grpc),
            "http" => Some(&mut self.http),
            "metrics" => Some(&mut self.metrics),
            "transfer" => Some(&mut self.transfer),
            _ => None,
        }
    }
}

/// The state file's whole content.
#[derive(Serialize)]
struct StateFile<'a> {
    /// `never` | `on-failure` | `always`: what happens to a component that exits.
    restart: &'a str,
    components: &'a [Component],
}

/// Writes the state file whole, through a temporary file and a rename, so a reader never
/// sees half of it.
pub fn write(path: &Path, restart: &str, components: &[Component]) -> anyhow::Result<()> {
    replace(path, &serde_json::to_string_pretty(&StateFile { restart, components })?)
}

/// Writes a Prometheus `file_sd_configs` file: one target group per component that serves
/// `/metrics` (every worker, the coordinator on its HTTP port, etcd on its client port), labelled
/// with its `role`, `component` name and `version_group`. Given-up and exited components stay
/// listed, so their targets show as down (`up == 0`) instead of vanishing.
pub fn write_targets(path: &Path, components: &[Component]) -> anyhow::Result<()> {
    let groups: Vec<serde_json::Value> = components
        .iter()
        .filter_map(|c| {
            let target = c.metrics.as_ref()?;
            let mut labels = serde_json::json!({ "role": c.role, "component": c.name });
            if let Some(g) = &c.version_group {
                labels["version_group"] = g.clone().into();
            }
            Some(serde_json::json!({ "targets": [target], "labels": labels }))
        })
        .collect();
    replace(path, &serde_json::to_string_pretty(&groups)?)
}

/// Replaces `path`'s content whole, through a temporary file and a rename.
fn replace(path: &Path, text: &str) -> anyhow::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
}

pub fn print_table(components: &[Component]) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(
        out,
        "{:<12} {:<12} {:>8}  {:<22} {:<22} {:<22} transfer",
        "role", "name", "pid", "grpc", "http", "metrics"
    );
    for c in components {
        let f = |o: &Option<String>| o.clone().unwrap_or_else(|| "-".into());
        let _ = writeln!(
            out,
            "{:<12} {:<12} {:>8}  {:<22} {:<22} {:<22} {}",
            c.role,
            c.name,
            c.pid,
            f(&c.grpc),
            f(&c.http),
            f(&c.metrics),
            f(&c.transfer)
        );
    }
    let _ = out.flush();
}

/// `exit status 3`, `signal 9 (SIGKILL)`.
pub fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit status {code}"),
        (None, Some(sig)) => {
            let name = match sig {
                1 => " (SIGHUP)",
                2 => " (SIGINT)",
                6 => " (SIGABRT)",
                9 => " (SIGKILL)",
                11 => " (SIGSEGV)",
                15 => " (SIGTERM)",
                _ => "",
            };
            format!("signal {sig}{name}")
        }
        (None, None) => format!("{status}"),
    }
}

/// The current UTC time as `YYYY-MM-DDTHH:MM:SSZ`, for log separator lines.
pub fn utc_now() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    #[test]
    fn exits_are_described_by_code_or_signal() {
        assert_eq!(describe(ExitStatus::from_raw(3 << 8)), "exit status 3");
        assert_eq!(describe(ExitStatus::from_raw(9)), "signal 9 (SIGKILL)");
        assert_eq!(describe(ExitStatus::from_raw(10)), "signal 10");
    }

    #[test]
    fn utc_dates_are_civil() {
        let s = utc_now();
        assert_eq!(s.len(), 20, "{s}");
        let year: i64 = s[..4].parse().expect("a year");
        assert!((2024..3000).contains(&year), "{s}");
        assert!(s.ends_with('Z') && &s[10..11] == "T", "{s}");
    }

    #[test]
    fn the_state_file_is_replaced_whole() {
        let dir = std::env::temp_dir().join(format!("tandem-state-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("state.json");
        let mut c = Component::new("decode", "decode-0");
        c.pid = 42;
        c.restarts = 2;
        c.last_exit = Some("signal 9 (SIGKILL)".into());
        write(&path, "on-failure", &[c]).expect("write");
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
        assert_eq!(v["restart"], "on-failure");
        assert_eq!(v["components"][0]["restarts"], 2);
        assert_eq!(v["components"][0]["state"], "running");
        assert_eq!(v["components"][0]["last_exit"], "signal 9 (SIGKILL)");
        assert!(!dir.join("state.json.tmp").exists(), "the temporary file is renamed away");

        let mut w = Component::new("decode", "decode-0");
        w.metrics = Some("127.0.0.1:9100".into());
        w.version_group = Some("g1".into());
        let mut e = Component::new("etcd", "etcd");
        e.metrics = Some("127.0.0.1:2379".into());
        let silent = Component::new("prefill", "prefill-0"); // no metrics address: no target
        let targets = dir.join("targets.json");
        write_targets(&targets, &[w, e, silent]).expect("write targets");
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&targets).expect("read")).expect("json");
        assert_eq!(v.as_array().map(Vec::len), Some(2), "{v}");
        assert_eq!(v[0]["targets"][0], "127.0.0.1:9100");
        assert_eq!(v[0]["labels"]["component"], "decode-0");
        assert_eq!(v[0]["labels"]["version_group"], "g1");
        assert_eq!(v[1]["labels"]["role"], "etcd");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
