//! The `tandem up` state file: what a running local cluster tells the outside about its
//! processes (JSON, rewritten whole on every change). `tandem up` writes it; drills
//! attached to the cluster (`tandem drill --against`) and tests read it. One type for
//! both sides, so a field cannot mean one thing to the writer and another to a reader.

use std::collections::BTreeMap;
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
    /// Decode workers: the lease of a KV reservation (how long a prefill worker has to
    /// deliver its KV before the load fails), ms. Drills that hold KV back wait it out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reservation_ttl_ms: Option<u64>,
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
    /// The network namespace it runs in (`tandem up --hosts N`): its link faults act there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub netns: Option<String>,
    /// How drills act on it: a shell command template per action. An action it does not
    /// list falls back to the built-in one for its `pid` and `netns` ([`Component::actions`]);
    /// one with neither is refused.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub actions: BTreeMap<Action, String>,
    /// Settings it was started with that drills fit themselves to, by the flag's name
    /// without dashes in front: [`flag`] names the ones read. A setting not listed is
    /// unknown, and a drill that needs it is refused saying so.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub flags: BTreeMap<String, String>,
}

/// The flags drills read from [`Component::flags`].
pub mod flag {
    /// Decode workers: how KV reaches them (`local`, `tcp`, `quic`, `ucx`).
    pub const KV_TRANSPORT: &str = "kv-transport";
    /// Decode workers: what a failed KV load becomes (`recompute`, `retry`, `fail`).
    pub const KV_LOAD_FAILURE_POLICY: &str = "kv-load-failure-policy";
    /// Workers and coordinators: the drain grace on SIGTERM, ms.
    pub const SHUTDOWN_TIMEOUT_MS: &str = "shutdown-timeout-ms";
    /// Coordinators: how long a streamed answer's client may take nothing before it is ended, ms.
    pub const STREAM_IDLE_TIMEOUT_MS: &str = "stream-idle-timeout-ms";
    /// Coordinators: how long they route from cached membership while etcd is unreachable, ms.
    pub const REGISTRY_MAX_STALE_MS: &str = "registry-max-stale-ms";
    /// Coordinators: prompts of at most this many tokens are prefilled by the decode worker.
    pub const LOCAL_PREFILL_MAX_TOKENS: &str = "local-prefill-max-tokens";
    /// Coordinators: the tenants file they were started with (its path on their host); with
    /// one, every request needs an API key it lists.
    pub const TENANTS: &str = "tenants";
}

/// What a drill does to a component, each through a command template
/// ([`Component::actions`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Action {
    /// Ends it at once (SIGKILL).
    Kill,
    /// Freezes it (SIGSTOP).
    Stop,
    /// Thaws it (SIGCONT).
    Cont,
    /// Asks it to drain and exit (SIGTERM).
    Term,
    /// Runs `{cmd}` where it runs (its host, its namespace, its pod).
    Exec,
    /// Runs `{cmd}`, an `iptables` or `tc` command, against its network: drops, resets,
    /// partitions and bandwidth limits on its links.
    LinkFault,
    /// Starts it again after it exited, on the same addresses; prints the new pid as the
    /// last line of its output. Without it, a supervisor must restart the component (the
    /// state file's `restart` policy), and rewrite the file with the new pid.
    Restart,
}

impl Action {
    pub const ALL: [Action; 7] =
        [Action::Kill, Action::Stop, Action::Cont, Action::Term, Action::Exec, Action::LinkFault, Action::Restart];

    /// `kill`, `stop`, `cont`, `term`, `exec`, `link-fault`, `restart`, as the file spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Kill => "kill",
            Action::Stop => "stop",
            Action::Cont => "cont",
            Action::Term => "term",
            Action::Exec => "exec",
            Action::LinkFault => "link-fault",
            Action::Restart => "restart",
        }
    }
}

/// The placeholders a template may name; each is replaced by one shell word.
pub const PLACEHOLDERS: [&str; 4] = ["pid", "name", "netns", "cmd"];

/// How to act on one component: its templates (its own, else the built-in ones) and the
/// values their placeholders take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Actions {
    /// The component's name (`{name}`).
    pub name: String,
    /// Its namespace (`{netns}`), when it has one.
    pub netns: Option<String>,
    pub templates: BTreeMap<Action, String>,
}

impl Actions {
    /// The template for `a`, when there is one.
    pub fn template(&self, a: Action) -> Option<&str> {
        self.templates.get(&a).map(String::as_str)
    }

    /// The shell command that does `a` to the process `pid`; `cmd` fills `{cmd}` (`exec`,
    /// `link-fault`). Err: no template for `a`, or one naming a value this component lacks.
    pub fn command(&self, a: Action, pid: u32, cmd: Option<&str>) -> Result<String, String> {
        let t = self.template(a).ok_or_else(|| {
            format!(
                "{} has no `{}` action (the state file lists none, and no built-in one applies)",
                self.name,
                a.as_str()
            )
        })?;
        let pid = (pid != 0).then(|| pid.to_string());
        expand(t, |key| match key {
            "pid" => pid.clone(),
            "name" => Some(self.name.clone()),
            "netns" => self.netns.clone(),
            "cmd" => cmd.map(str::to_owned),
            _ => None,
        })
        .map_err(|e| format!("{}'s `{}` action `{t}`: {e}", self.name, a.as_str()))
    }
}

/// `template` with each `{key}` replaced by `value(key)` as one shell word (quoted unless it
/// is plain); `{{` and `}}` stand for braces. Err names an unknown or empty placeholder.
pub fn expand(template: &str, value: impl Fn(&str) -> Option<String>) -> Result<String, String> {
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(i) = rest.find(['{', '}']) {
        out.push_str(&rest[..i]);
        let tail = &rest[i..];
        if let Some(r) = tail.strip_prefix("{{") {
            out.push('{');
            rest = r;
            continue;
        }
        if let Some(r) = tail.strip_prefix("}}") {
            out.push('}');
            rest = r;
            continue;
        }
        if tail.starts_with('}') {
            return Err("a `}` with no `{` (write `}}` for a brace)".into());
        }
        let end = tail.find('}').ok_or("a `{` with no `}` (write `{{` for a brace)")?;
        let key = &tail[1..end];
        if !PLACEHOLDERS.contains(&key) {
            return Err(format!(
                "unknown placeholder {{{key}}} (templates know {{pid}}, {{name}}, {{netns}}, {{cmd}})"
            ));
        }
        let v = value(key).ok_or_else(|| format!("{{{key}}} has no value here"))?;
        out.push_str(&shell_word(&v));
        rest = &tail[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// `s` as one `sh` word: as is when it holds only plain characters, else single-quoted.
pub fn shell_word(s: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "_-./:=@,+%".contains(c);
    if !s.is_empty() && s.chars().all(plain) {
        s.to_owned()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
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
            reservation_ttl_ms: None,
            log: None,
            state: State::Running,
            restarts: 0,
            last_exit: None,
            netns: None,
            actions: BTreeMap::new(),
            flags: BTreeMap::new(),
        }
    }

    /// The built-in templates for a process on this host, in `netns` when given: signals
    /// by pid, `exec` through `sh` (in the namespace), and `link-fault` only in a namespace
    /// (on the host's own network a link fault would cut every process's link). No
    /// `restart`: a supervisor restarts the component.
    pub fn builtin_actions(netns: Option<&str>) -> BTreeMap<Action, String> {
        let mut t: BTreeMap<Action, String> = [
            (Action::Kill, "kill -KILL {pid}"),
            (Action::Stop, "kill -STOP {pid}"),
            (Action::Cont, "kill -CONT {pid}"),
            (Action::Term, "kill -TERM {pid}"),
        ]
        .into_iter()
        .map(|(a, t)| (a, t.to_owned()))
        .collect();
        match netns {
            Some(_) => {
                t.insert(Action::Exec, "ip netns exec {netns} sh -c {cmd}".into());
                t.insert(Action::LinkFault, "ip netns exec {netns} sh -c {cmd}".into());
            }
            None => {
                t.insert(Action::Exec, "sh -c {cmd}".into());
            }
        }
        t
    }

    /// How drills act on it: the templates it lists, and the built-in one for any action it
    /// does not (signals need its `pid`; `link-fault` its `netns`).
    pub fn actions(&self) -> Actions {
        let mut templates = if self.pid != 0 || self.netns.is_some() {
            Component::builtin_actions(self.netns.as_deref())
        } else {
            BTreeMap::new()
        };
        templates.extend(self.actions.iter().map(|(a, t)| (*a, t.clone())));
        Actions { name: self.name.clone(), netns: self.netns.clone(), templates }
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
        c.flags.insert(flag::KV_TRANSPORT.into(), "tcp".into());
        let file = StateFile { restart: Some("on-failure".into()), components: vec![c] };
        file.write(&path).expect("write");
        assert!(!dir.join("state.json.tmp").exists(), "the temporary file is renamed away");
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
        assert_eq!(v["restart"], "on-failure");
        assert_eq!(v["components"][0]["role"], "decode");
        assert_eq!(v["components"][0]["state"], "restarting");
        assert!(v["components"][0].get("http").is_none(), "absent addresses are left out: {v}");
        assert_eq!(v["components"][0]["flags"]["kv-transport"], "tcp", "settings by flag name: {v}");
        assert_eq!(StateFile::read(&path).expect("read back"), file);
        assert_eq!(file.component("decode-0").map(|c| c.addrs().count()), Some(1));

        std::fs::write(&path, r#"{"components":[{"role":"router","name":"x","pid":1,"state":"running"}]}"#)
            .expect("write");
        let e = StateFile::read(&path).expect_err("an unknown role").to_string();
        assert!(e.contains("state.json") && e.contains("router"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn templates_expand_each_placeholder_as_one_shell_word() {
        let mut c = Component::new(Role::Decode, "decode-0");
        c.pid = 4242;
        c.actions.insert(Action::Restart, "systemctl restart tandem@{name} && pidof x".into());
        let a = c.actions();
        assert_eq!(a.command(Action::Kill, c.pid, None).as_deref(), Ok("kill -KILL 4242"));
        assert_eq!(
            a.command(Action::Restart, c.pid, None).as_deref(),
            Ok("systemctl restart tandem@decode-0 && pidof x")
        );
        // A command with spaces and quotes stays one word.
        let e = a.command(Action::Exec, c.pid, Some("echo 'a b' $HOME")).expect("exec");
        assert_eq!(e, r#"sh -c 'echo '\''a b'\'' $HOME'"#);
        let out = std::process::Command::new("sh").args(["-c", &e]).env("HOME", "/h").output().expect("sh");
        assert_eq!(String::from_utf8_lossy(&out.stdout), "a b /h\n");
        // No namespace: no link faults on the host's own network.
        let e = a.command(Action::LinkFault, c.pid, Some("iptables -L")).expect_err("no netns");
        assert!(e.contains("decode-0") && e.contains("link-fault"), "{e}");
        c.netns = Some("tdm-host-1".into());
        assert_eq!(
            c.actions().command(Action::LinkFault, c.pid, Some("iptables -L")).as_deref(),
            Ok("ip netns exec tdm-host-1 sh -c 'iptables -L'")
        );
        // A listed template wins over the built-in one; a placeholder with no value is refused.
        c.actions.insert(Action::Stop, "kubectl exec {name} -- kill -STOP 1".into());
        assert_eq!(c.actions().command(Action::Stop, 0, None).as_deref(), Ok("kubectl exec decode-0 -- kill -STOP 1"));
        let e = c.actions().command(Action::Kill, 0, None).expect_err("no pid");
        assert!(e.contains("{pid} has no value"), "{e}");
        for (t, why) in [("kill {pdi}", "unknown placeholder {pdi}"), ("x {pid", "no `}`"), ("x }", "no `{`")] {
            let e = expand(t, |_| Some("1".into())).expect_err(t);
            assert!(e.contains(why), "{t}: {e}");
        }
        assert_eq!(expand("awk '{{print}}' {pid}", |_| Some("7".into())).as_deref(), Ok("awk '{print}' 7"));

        // The file spells actions in kebab-case and reads them back.
        let file = StateFile { restart: None, components: vec![c] };
        let v = serde_json::to_value(&file).expect("json");
        assert_eq!(v["components"][0]["actions"]["restart"], "systemctl restart tandem@{name} && pidof x");
        assert_eq!(v["components"][0]["netns"], "tdm-host-1");
        let back: StateFile = serde_json::from_value(v).expect("back");
        assert_eq!(back, file);
        let e = serde_json::from_str::<StateFile>(
            r#"{"components":[{"role":"decode","name":"d","pid":1,"state":"running","actions":{"reboot":"x"}}]}"#,
        )
        .expect_err("unknown action");
        assert!(e.to_string().contains("reboot"), "{e}");
    }
}
