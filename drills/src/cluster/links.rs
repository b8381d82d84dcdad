//! Where a drill changes a worker's links with `iptables`: inside the
//! namespace the drill made for it ([`Netns`]), or, for an attached cluster,
//! through the worker's `link-fault` template (`tandem up --hosts`: inside the
//! worker's host namespace). Rules a drill adds to an attached cluster are
//! recorded, and any it did not delete itself are deleted when the drill ends
//! ([`Cluster::clear_link_rules`]), so the cluster is left as found.

use std::path::Path;

use super::{Cluster, Worker};
use crate::netns::{packets_of, Netns};
use crate::process::Proc;
use crate::proxy::Proxy;
use crate::HarnessError;
use facts::state::{shell_word, Action};

/// Changes a drill made to attached processes' networks and has not undone yet: (process
/// name, the shell command that undoes the change).
pub type Held = std::sync::Mutex<Vec<(String, String)>>;

/// A worker's network, as drills reach it.
pub enum LinkNet<'a> {
    /// A namespace this drill made (deleted with the cluster, rules and all).
    Own(&'a Netns),
    /// An attached worker's `link-fault` template; `rules` records what is changed.
    Template { proc: &'a Proc, rules: &'a Held },
}

/// The shell line `iptables -w 5 ARGS`.
fn iptables_line(args: &[&str]) -> String {
    std::iter::once("iptables -w 5".to_owned()).chain(args.iter().map(|a| shell_word(a))).collect::<Vec<_>>().join(" ")
}

impl LinkNet<'_> {
    /// Runs `iptables -w 5 ARGS` there; its output. An attached process's rule added with
    /// `-A`/`-I` is held with its `-D` line as the undo, which a `-D` of it forgets.
    pub fn iptables(&self, args: &[&str]) -> Result<String, HarnessError> {
        match self {
            LinkNet::Own(ns) => ns.iptables(args),
            LinkNet::Template { proc, rules } => {
                let out = proc.act(Action::LinkFault, Some(&iptables_line(args)))?;
                let delete =
                    || iptables_line(&std::iter::once("-D").chain(args[1..].iter().copied()).collect::<Vec<_>>());
                let mut held = rules.lock().unwrap_or_else(|e| e.into_inner());
                match args.first() {
                    Some(&"-A" | &"-I") => held.push((proc.name.clone(), delete())),
                    Some(&"-D") => forget(&mut held, &proc.name, &delete()),
                    _ => {}
                }
                Ok(out)
            }
        }
    }

    /// Runs the shell command `cmd` there (`ss -K ...`); its output. Rules are added
    /// through [`LinkNet::iptables`], which records them, other changes through
    /// [`LinkNet::apply`].
    pub fn exec(&self, cmd: &str) -> Result<String, HarnessError> {
        match self {
            LinkNet::Own(ns) => ns.exec(&["sh", "-c", cmd]),
            LinkNet::Template { proc, .. } => Ok(proc.act(Action::LinkFault, Some(cmd))?),
        }
    }

    /// Runs `cmd` there, a change `undo` reverses; an attached process's is recorded, so
    /// the drill's end (or [`Cluster`]'s drop) undoes what [`LinkNet::revert`] did not.
    /// `undo` should undo a part-made change too: `cmd` may fail half way.
    pub fn apply(&self, cmd: &str, undo: &str) -> Result<String, HarnessError> {
        if let LinkNet::Template { proc, rules } = self {
            rules.lock().unwrap_or_else(|e| e.into_inner()).push((proc.name.clone(), undo.to_owned()));
        }
        self.exec(cmd)
    }

    /// Runs `undo` (given to [`LinkNet::apply`]) there and forgets it.
    pub fn revert(&self, undo: &str) -> Result<String, HarnessError> {
        if let LinkNet::Template { proc, rules } = self {
            forget(&mut rules.lock().unwrap_or_else(|e| e.into_inner()), &proc.name, undo);
        }
        self.exec(undo)
    }

    /// Packets matched by the rules of `chain` whose comment is `comment`; `None` when no
    /// such rule exists.
    pub fn rule_packets(&self, chain: &str, comment: &str) -> Result<Option<u64>, HarnessError> {
        let listing = self.iptables(&["-L", chain, "-v", "-n", "-x"])?;
        Ok(packets_of(&listing, comment))
    }
}

/// Drops the held change of `name` that `undo` undoes (the last one, if held twice).
fn forget(held: &mut Vec<(String, String)>, name: &str, undo: &str) {
    if let Some(k) = held.iter().rposition(|(n, u)| n == name && u == undo) {
        held.remove(k);
    }
}

/// An attached process's network through its `link-fault` template, when it has one.
fn template_net<'a>(proc: &'a Proc, c: &'a Cluster) -> Result<LinkNet<'a>, HarnessError> {
    match &c.attached {
        Some(a) if templated(proc) => Ok(LinkNet::Template { proc, rules: &a.link_rules }),
        _ => Err(HarnessError::Setup(format!(
            "{} is in no namespace of the drill's and has no `link-fault` template",
            proc.name
        ))),
    }
}

fn templated(proc: &Proc) -> bool {
    proc.actions().is_some_and(|a| a.template(Action::LinkFault).is_some())
}

impl Worker {
    /// Where drills change this worker's links, when they can.
    pub fn link_net<'a>(&'a self, c: &'a Cluster) -> Result<LinkNet<'a>, HarnessError> {
        match &self.netns {
            Some(ns) => Ok(LinkNet::Own(ns)),
            None => template_net(&self.proc, c),
        }
    }

    /// Whether drills can change this worker's links (see [`Worker::link_net`]).
    pub fn has_link_net(&self) -> bool {
        self.netns.is_some() || templated(&self.proc)
    }
}

impl Cluster {
    /// Where drills change process `name`'s links: a worker's ([`Worker::link_net`]), or an
    /// attached coordinator's through its `link-fault` template (`tandem up --hosts N
    /// --coordinator-hosts`).
    pub fn link_net_of(&self, name: &str) -> Result<LinkNet<'_>, HarnessError> {
        if let Ok(w) = self.worker(name) {
            return w.link_net(self);
        }
        let p = self.coordinators().find(|p| p.name == name);
        template_net(p.ok_or_else(|| HarnessError::Setup(format!("no worker or coordinator {name}")))?, self)
    }

    /// Whether drills can change process `name`'s links ([`Cluster::link_net_of`]).
    pub fn has_link_net(&self, name: &str) -> bool {
        self.link_net_of(name).is_ok()
    }
}

impl Cluster {
    /// Deletes every rule a drill added to an attached cluster's links and did not delete
    /// itself; says which could not be deleted.
    pub fn clear_link_rules(&self) -> Vec<String> {
        let Some(a) = &self.attached else { return Vec::new() };
        let held = std::mem::take(&mut *a.link_rules.lock().unwrap_or_else(|e| e.into_inner()));
        let mut failed = Vec::new();
        // Last made, first undone.
        for (name, undo) in held.into_iter().rev() {
            let Some(p) = self.procs().find(|p| p.name == name) else { continue };
            if let Err(e) = p.act(Action::LinkFault, Some(&undo)) {
                failed.push(format!("undoing {name}'s change with `{undo}`: {e}"));
            }
        }
        failed
    }
}

/// The comment on the REDIRECT rule that passes an attached worker's KV link through a
/// drill's proxy ([`Cluster::proxy_kv_link`]).
pub const KV_PROXY_RULE: &str = "tdm-kv-proxy";

/// Where `ip netns` keeps the namespaces it names.
const NETNS_DIR: &str = "/run/netns";

impl Cluster {
    /// What the attached cluster's state file gives as component `name`'s setting `flag`
    /// ([`facts::state::flag`]); `None` for the drill's own cluster, or when it is not given.
    pub fn flag(&self, name: &str, flag: &str) -> Option<&str> {
        self.attached.as_ref()?.flags.get(name)?.get(flag).map(String::as_str)
    }

    /// [`Cluster::flag`] read as milliseconds: `Ok(None)` when not given, Err (naming the
    /// component and flag) when it is not a whole number.
    pub fn flag_ms(&self, name: &str, flag: &str) -> Result<Option<std::time::Duration>, String> {
        let Some(ms) = self.flag(name, flag) else { return Ok(None) };
        let ms: u64 = ms.parse().map_err(|e| format!("{name}'s `{flag}` {ms:?}: {e}"))?;
        Ok(Some(std::time::Duration::from_millis(ms)))
    }

    /// The network namespace the attached cluster's state file gives worker `name`.
    pub fn netns_of(&self, name: &str) -> Option<&str> {
        self.attached.as_ref()?.netns.get(name).map(String::as_str)
    }

    /// Puts a fault proxy on attached worker `name`'s KV link, as the drill's own cluster has
    /// one ([`crate::ClusterSpec::decode_behind_proxy`]): the proxy's sockets live in the
    /// worker's namespace, an iptables REDIRECT there (through its `link-fault` template)
    /// sends new connections to the worker's KV port to the proxy, and the connections open
    /// now are reset (`ss -K`) so prefill workers reconnect through it (a pooled connection
    /// is checked before each transfer, so no transfer fails on it). Undone when the drill
    /// ends: [`Cluster::unproxy_kv_link`], then [`Cluster::clear_link_rules`], which deletes
    /// the REDIRECT as it deletes every rule added through the template.
    pub fn proxy_kv_link(&mut self, name: &str) -> Result<(), HarnessError> {
        let ns = self
            .netns_of(name)
            .ok_or_else(|| HarnessError::Setup(format!("{name} runs in no network namespace the state file names")))?;
        let path = Path::new(NETNS_DIR).join(ns);
        let w = self.worker(name)?;
        let transfer = w.proc.socket_addr("transfer")?;
        let proxy = Proxy::start_in_netns(&path, transfer.ip(), transfer)?;
        let port = transfer.port().to_string();
        let to = proxy.addr.port().to_string();
        let spec: Vec<String> = [
            "PREROUTING",
            "-p",
            "tcp",
            "--dport",
            &port,
            "-m",
            "comment",
            "--comment",
            KV_PROXY_RULE,
            "-j",
            "REDIRECT",
            "--to-ports",
            &to,
            "-t",
            "nat",
        ]
        .map(str::to_owned)
        .to_vec();
        let net = w.link_net(self)?;
        // Reset first: a reset sent through the REDIRECT went astray here (see `unproxy_kv_link`).
        net.exec(&format!("ss -K state established '( sport = :{port} )'"))?;
        net.iptables(&std::iter::once("-A").chain(spec.iter().map(String::as_str)).collect::<Vec<_>>())?;
        self.worker_mut(name)?.proxy = Some(proxy);
        Ok(())
    }

    /// Takes the proxy [`Cluster::proxy_kv_link`] put on an attached worker's KV link away:
    /// every connection through it is reset. Its REDIRECT rule must still be there (the
    /// callers run [`Cluster::clear_link_rules`] next): resets sent after the rule had gone
    /// never reached the prefill workers (measured: their pooled connections stayed
    /// established, and the next transfer on each failed).
    pub fn unproxy_kv_link(&mut self) {
        if !self.is_attached() {
            return;
        }
        for w in &mut self.workers {
            if let Some(p) = w.proxy.take() {
                p.reset_open();
            }
        }
    }
}
