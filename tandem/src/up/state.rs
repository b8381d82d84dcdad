//! What `tandem up` tells the outside about its processes: the state file
//! (JSON, rewritten whole on every change) and the table printed once the
//! cluster is ready.

use std::io::Write;
use std::path::Path;
use std::process::ExitStatus;

use facts::state::{Component, StateFile};

/// Writes the state file whole (through a temporary file and a rename, so a reader never
/// sees half of it), each component with the templates drills act on it through: the
/// built-in ones for a process of this host ([`Component::builtin_actions`]), and no
/// `restart`, since this supervisor restarts what exits.
pub fn write(path: &Path, restart: &str, components: &[Component]) -> anyhow::Result<()> {
    let mut components = components.to_vec();
    for c in &mut components {
        if c.actions.is_empty() {
            c.actions = Component::builtin_actions(c.netns.as_deref());
        }
    }
    let file = StateFile { restart: Some(restart.to_owned()), components };
    Ok(file.write(path)?)
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
            let mut labels = serde_json::json!({ "role": c.role.as_str(), "component": c.name });
            if let Some(g) = &c.version_group {
                labels["version_group"] = g.clone().into();
            }
            Some(serde_json::json!({ "targets": [target], "labels": labels }))
        })
        .collect();
    Ok(facts::state::replace(path, &serde_json::to_string_pretty(&groups)?)?)
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
            c.role.as_str(),
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
    use facts::state::Role;
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
        let mut c = Component::new(Role::Decode, "decode-0");
        c.pid = 42;
        c.restarts = 2;
        c.last_exit = Some("signal 9 (SIGKILL)".into());
        write(&path, "on-failure", &[c]).expect("write");
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
        assert_eq!(v["restart"], "on-failure");
        assert_eq!(v["components"][0]["restarts"], 2);
        assert_eq!(v["components"][0]["state"], "running");
        assert_eq!(v["components"][0]["last_exit"], "signal 9 (SIGKILL)");
        // Each component says how drills act on it: signals by pid, no restart (the
        // supervisor restarts), no link faults on the host's own network.
        assert_eq!(v["components"][0]["actions"]["kill"], "kill -KILL {pid}");
        assert_eq!(v["components"][0]["actions"]["exec"], "sh -c {cmd}");
        assert!(v["components"][0]["actions"].get("restart").is_none(), "{v}");
        assert!(v["components"][0]["actions"].get("link-fault").is_none(), "{v}");
        assert!(!dir.join("state.json.tmp").exists(), "the temporary file is renamed away");

        let mut w = Component::new(Role::Decode, "decode-0");
        w.metrics = Some("127.0.0.1:9100".into());
        w.version_group = Some("g1".into());
        let mut e = Component::new(Role::Etcd, "etcd");
        e.metrics = Some("127.0.0.1:2379".into());
        let silent = Component::new(Role::Prefill, "prefill-0"); // no metrics address: no target
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
