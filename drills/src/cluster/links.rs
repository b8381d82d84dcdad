//! Where a drill changes a worker's links with `iptables`: inside the
//! namespace the drill made for it ([`Netns`]), or, for an attached cluster,
//! through the worker's `link-fault` template (`tandem up --hosts`: inside the
//! worker's host namespace). Rules a drill adds to an attached cluster are
//! recorded, and any it did not delete itself are deleted when the drill ends
//! ([`Cluster::clear_link_rules`]), so the cluster is left as found.

use super::{Cluster, Worker};
use crate::netns::{packets_of, Netns};
use crate::process::Proc;
use crate::HarnessError;
use facts::state::{shell_word, Action};

/// A worker's network, as drills reach it.
pub enum LinkNet<'a> {
    /// A namespace this drill made (deleted with the cluster, rules and all).
    Own(&'a Netns),
    /// An attached worker's `link-fault` template; `rules` records what is added.
    Template { proc: &'a Proc, rules: &'a std::sync::Mutex<Vec<(String, Vec<String>)>> },
}

impl LinkNet<'_> {
    /// Runs `iptables -w 5 ARGS` there; its output.
    pub fn iptables(&self, args: &[&str]) -> Result<String, HarnessError> {
        match self {
            LinkNet::Own(ns) => ns.iptables(args),
            LinkNet::Template { proc, rules } => {
                let cmd = std::iter::once("iptables -w 5".to_owned())
                    .chain(args.iter().map(|a| shell_word(a)))
                    .collect::<Vec<_>>()
                    .join(" ");
                let out = proc.act(Action::LinkFault, Some(&cmd))?;
                let spec: Vec<String> = args.iter().skip(1).map(|a| (*a).to_owned()).collect();
                let mut held = rules.lock().unwrap_or_else(|e| e.into_inner());
                match args.first() {
                    Some(&"-A" | &"-I") => held.push((proc.name.clone(), spec)),
                    Some(&"-D") => {
                        if let Some(k) = held.iter().position(|(n, s)| *n == proc.name && *s == spec) {
                            held.remove(k);
                        }
                    }
                    _ => {}
                }
                Ok(out)
            }
        }
    }

    /// Runs the shell command `cmd` there (`ss -K ...`); its output. Rules are added
    /// through [`LinkNet::iptables`], which records them.
    pub fn exec(&self, cmd: &str) -> Result<String, HarnessError> {
        match self {
            LinkNet::Own(ns) => ns.exec(&["sh", "-c", cmd]),
            LinkNet::Template { proc, .. } => Ok(proc.act(Action::LinkFault, Some(cmd))?),
        }
    }

    /// Packets matched by the rules of `chain` whose comment is `comment`; `None` when no
    /// such rule exists.
    pub fn rule_packets(&self, chain: &str, comment: &str) -> Result<Option<u64>, HarnessError> {
        let listing = self.iptables(&["-L", chain, "-v", "-n", "-x"])?;
        Ok(packets_of(&listing, comment))
    }
}

impl Worker {
    /// Where drills change this worker's links, when they can.
    pub fn link_net<'a>(&'a self, c: &'a Cluster) -> Result<LinkNet<'a>, HarnessError> {
        if let Some(ns) = &self.netns {
            return Ok(LinkNet::Own(ns));
        }
        let templated = self.proc.actions().is_some_and(|a| a.template(Action::LinkFault).is_some());
        match &c.attached {
            Some(a) if templated => Ok(LinkNet::Template { proc: &self.proc, rules: &a.link_rules }),
            _ => Err(HarnessError::Setup(format!(
                "{} is in no namespace of the drill's and has no `link-fault` template",
                self.proc.name
            ))),
        }
    }

    /// Whether drills can change this worker's links (see [`Worker::link_net`]).
    pub fn has_link_net(&self) -> bool {
        self.netns.is_some() || self.proc.actions().is_some_and(|a| a.template(Action::LinkFault).is_some())
    }
}

impl Cluster {
    /// Deletes every rule a drill added to an attached cluster's links and did not delete
    /// itself; says which could not be deleted.
    pub fn clear_link_rules(&self) -> Vec<String> {
        let Some(a) = &self.attached else { return Vec::new() };
        let held = std::mem::take(&mut *a.link_rules.lock().unwrap_or_else(|e| e.into_inner()));
        let mut failed = Vec::new();
        for (name, spec) in held {
            let Ok(w) = self.worker(&name) else { continue };
            let cmd = std::iter::once("iptables -w 5 -D".to_owned())
                .chain(spec.iter().map(|a| shell_word(a)))
                .collect::<Vec<_>>()
                .join(" ");
            if let Err(e) = w.proc.act(Action::LinkFault, Some(&cmd)) {
                failed.push(format!("deleting {name}'s rule `{}`: {e}", spec.join(" ")));
            }
        }
        failed
    }
}
