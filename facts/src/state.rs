//! The `tandem up` state file: what a running local cluster tells the outside about its
//! processes (JSON, rewritten whole on every change). `tandem up` writes it; drills
//! attached to the cluster (`tandem drill --against`) and tests read it. One type for
//! both sides, so a field cannot mean one thing to the writer and another to a reader.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The state file's whole content.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StateFile {
    /// What the supervisor does with a component that exits: `never`, `on-failure` or
    /// `always`. `None`: the writer names no policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart: Option<String>,
    pub components: Vec<Component>,
}

/// What a component is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Etcd,
    Prefill,
    Decode,
    Coordinator,
}

impl Role {
    /// `etcd`, `prefill`, `decode` or `coordinator`, as the file and metric labels spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Etcd => "etcd",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Coordinator => "coordinator",
        }
    }
}

/// One component (a field only where the component has it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Component {
    pub role: Role,
    /// Its name in `tandem up`'s lines and logs: `etcd`, `prefill-0`, `decode-1`,
    /// `coordinator`. Workers register under it as their worker id, so a restarted worker
    /// takes its own key back.
    pub name: String,
    /// The running process; after an exit, the last one until a restart replaces it.
    pub pid: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grpc: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transfer: Option<String>,
    /// Prefill and decode workers: the version group they registered in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version_group: Option<String>,
    /// Prefill and decode workers: their etcd lease TTL, whole seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_ttl_s: Option<u64>,
    /// The file its stdout and stderr go to (appended across restarts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log: Option<PathBuf>,
    /// Where the supervisor has it.
    pub state: State,
    /// Times it was started again after an exit.
    #[serde(default)]
    pub restarts: u32,
    /// How its last process ended (`exit status 1`, `signal 9 (SIGKILL)`, or why a start
    /// failed), once one has.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_exit: Option<String>,
}

/// A component's place in the supervisor's cycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
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

impl State {
    /// Down for good: its supervisor will not start it again.
    pub fn is_down(self) -> bool {
        matches!(self, State::Exited | State::GivenUp)
    }

    /// `running`, `restarting`, `exited`, `given_up`, as the file spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            State::Running => "running",
            State::Restarting => "restarting",
            State::Exited => "exited",
            State::GivenUp => "given_up",
        }
    }
}

/// An address kind a component may have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Addr {
    Grpc,
    Http,
    Metrics,
    Transfer,
}

impl Addr {
    pub const ALL: [Addr; 4] = [Addr::Grpc, Addr::Http, Addr::Metrics, Addr::Transfer];

    /// The name a process prints it under (`listening grpc=...`) and the file's key.
    pub fn key(self) -> &'static str {
        match self {
            Addr::Grpc => "grpc",
            Addr::Http => "http",
            Addr::Metrics => "metrics",
            Addr::Transfer => "transfer",
        }
    }

    /// The address kind printed under `key`.
    pub fn from_key(key: &str) -> Option<Addr> {
        Addr::ALL.into_iter().find(|a| a.key() == key)
    }
}

impl Component {
    /// A component not started yet: no pid, no addresses, `running`.
    pub fn new(role: Role, name: impl Into<String>) -> Self {
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

    /// Its address of kind `a`, when it has one.
    pub fn addr(&self, a: Addr) -> Option<&String> {
        match a {
            Addr::Grpc => self.grpc.as_ref(),
            Addr::Http => self.http.as_ref(),
            Addr::Metrics => self.metrics.as_ref(),
            Addr::Transfer => self.transfer.as_ref(),
        }
    }

    /// Its address slot of kind `a`.
    pub fn addr_mut(&mut self, a: Addr) -> &mut Option<String> {
        match a {
            Addr::Grpc => &mut self.grpc,
            Addr::Http => &mut self.http,
            Addr::Metrics => &mut self.metrics,
            Addr::Transfer => &mut self.transfer,
        }
    }

    /// Every address it has, by key.
    pub fn addrs(&self) -> impl Iterator<Item = (&'static str, &String)> {
        Addr::ALL.into_iter().filter_map(|a| Some((a.key(), self.addr(a)?)))
    }
}

/// Why a state file could not be read or written.
#[derive(Debug)]
pub enum StateError {
    /// Reading, writing or renaming the file failed.
    Io { path: PathBuf, source: std::io::Error },
    /// The file is not a state file (or not whole JSON).
    Parse { path: PathBuf, source: serde_json::Error },
}

impl std::fmt::Display for StateError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StateError::Io { path, source } => write!(f, "state file {}: {source}", path.display()),
            StateError::Parse { path, source } => write!(f, "state file {}: {source}", path.display()),
        }
    }
}

impl std::error::Error for StateError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            StateError::Io { source, .. } => Some(source),
            StateError::Parse { source, .. } => Some(source),
        }
    }
}

impl StateFile {
    /// Reads and parses `path`.
    pub fn read(path: &Path) -> Result<Self, StateError> {
        let text = std::fs::read_to_string(path).map_err(|source| StateError::Io { path: path.to_owned(), source })?;
        serde_json::from_str(&text).map_err(|source| StateError::Parse { path: path.to_owned(), source })
    }

    /// Writes the file whole, through a temporary file and a rename, so a reader never
    /// sees half of it.
    pub fn write(&self, path: &Path) -> Result<(), StateError> {
        let text =
            serde_json::to_string_pretty(self).map_err(|source| StateError::Parse { path: path.to_owned(), source })?;
        replace(path, &text)
    }

    /// The component named `name`.
    pub fn component(&self, name: &str) -> Option<&Component> {
        self.components.iter().find(|c| c.name == name)
    }
}

/// Replaces `path`'s content whole, through a temporary file beside it and a rename.
pub fn replace(path: &Path, text: &str) -> Result<(), StateError> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let io = |p: &Path| {
        let p = p.to_owned();
        move |source| StateError::Io { path: p, source }
    };
    std::fs::write(&tmp, text).map_err(io(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io(path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_file_round_trips_and_is_replaced_whole() {
        let dir = std::env::temp_dir().join(format!("tandem-facts-state-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("state.json");
        let mut c = Component::new(Role::Decode, "decode-0");
        c.pid = 42;
        c.restarts = 2;
        c.state = State::Restarting;
        c.last_exit = Some("signal 9 (SIGKILL)".into());
        *c.addr_mut(Addr::Grpc) = Some("127.0.0.1:7001".into());
        let file = StateFile { restart: Some("on-failure".into()), components: vec![c] };
        file.write(&path).expect("write");
        assert!(!dir.join("state.json.tmp").exists(), "the temporary file is renamed away");
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
        assert_eq!(v["restart"], "on-failure");
        assert_eq!(v["components"][0]["role"], "decode");
        assert_eq!(v["components"][0]["state"], "restarting");
        assert!(v["components"][0].get("http").is_none(), "absent addresses are left out: {v}");
        assert_eq!(StateFile::read(&path).expect("read back"), file);
        assert_eq!(file.component("decode-0").map(|c| c.addrs().count()), Some(1));

        std::fs::write(&path, r#"{"components":[{"role":"router","name":"x","pid":1,"state":"running"}]}"#)
            .expect("write");
        let e = StateFile::read(&path).expect_err("an unknown role").to_string();
        assert!(e.contains("state.json") && e.contains("router"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
