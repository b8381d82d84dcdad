//! `tandem up --hosts N`: N network namespaces standing in for hosts, so the
//! workers' KV, control and etcd traffic crosses real interfaces that link
//! faults can act on (`iptables`, `tc` inside a namespace).
//!
//! One bridge in the root namespace (`tup<pid>`, `10.79.K.1/24`, K the first
//! /24 of 10.79.0.0/16 no interface of this machine holds) and per host a
//! namespace `tandem-up-<pid>-h<i>` whose `eth0` (one end of a veth pair, the
//! other end on the bridge) holds `10.79.K.(10+i)/24`, its default route
//! through the bridge. Hosts reach each other over the bridge and reach what
//! runs in the root namespace (etcd, the coordinator) on `10.79.K.1`.
//!
//! Dropping [`Hosts`] deletes the namespaces (their veths go with them) and
//! the bridge. A `tandem up` killed before that leaves them behind: the next
//! [`Hosts::create`] deletes every `tandem-up-<pid>-h*` namespace and `tup<pid>`
//! bridge whose pid is not running, and never another live one's.

use std::net::Ipv4Addr;
use std::process::Command;

use anyhow::{bail, Context};

/// The most hosts: one /24 holds them with room to spare.
pub const MAX_HOSTS: usize = 64;

/// One host: a network namespace and its address.
#[derive(Debug, Clone)]
pub struct Host {
    /// `tandem-up-<pid>-h<i>`.
    pub netns: String,
    pub ip: Ipv4Addr,
}

/// The hosts of one `tandem up`, deleted when dropped.
#[derive(Debug)]
pub struct Hosts {
    bridge: String,
    /// The bridge's address: where processes of the root namespace are reached from a host.
    pub gateway: Ipv4Addr,
    pub hosts: Vec<Host>,
}

/// Runs `ip ARGS`; its stdout, or which command failed and its stderr.
fn ip(args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .with_context(|| format!("running `ip {}` (--hosts needs iproute2: `make deps`)", args.join(" ")))?;
    if !out.status.success() {
        bail!("`ip {}` failed ({}): {}", args.join(" "), out.status, String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Whether process `pid` runs.
fn alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// The pid in a name `PREFIX<pid>SUFFIX...`, when it has that shape.
fn owner(name: &str, prefix: &str, sep: char) -> Option<u32> {
    let rest = name.strip_prefix(prefix)?;
    let end = rest.find(sep).unwrap_or(rest.len());
    rest[..end].parse().ok()
}

/// Deletes namespaces and bridges an earlier `tandem up` left behind (its pid not running).
fn sweep() {
    if let Ok(list) = ip(&["netns", "list"]) {
        for ns in list.lines().filter_map(|l| l.split_whitespace().next()) {
            if owner(ns, "tandem-up-", '-').is_some_and(|pid| !alive(pid)) {
                let _ = ip(&["netns", "del", ns]);
            }
        }
    }
    if let Ok(list) = ip(&["-o", "link", "show", "type", "bridge"]) {
        for line in list.lines() {
            // `12: tup4242: <BROADCAST,...`
            let Some(name) = line.split(':').nth(1).map(str::trim) else { continue };
            if owner(name, "tup", '\0').is_some_and(|pid| !alive(pid)) {
                let _ = ip(&["link", "del", name]);
            }
        }
    }
}

/// The first K whose 10.79.K.0/24 no interface of this machine has an address in.
fn free_subnet() -> anyhow::Result<u8> {
    let held = ip(&["-4", "-o", "addr", "show"])?;
    (0..=255u8)
        .find(|k| !held.contains(&format!(" 10.79.{k}.")))
        .context("every 10.79.K.0/24 is in use on this machine: no subnet for --hosts")
}

impl Hosts {
    /// Creates `n` hosts (see the module doc). Needs root and `ip`; a failure part-way
    /// deletes what was made.
    pub fn create(n: usize) -> anyhow::Result<Self> {
        if n == 0 || n > MAX_HOSTS {
            bail!("--hosts {n}: from 1 to {MAX_HOSTS}");
        }
        use std::os::unix::fs::MetadataExt;
        // `/proc/self` belongs to the process's effective user.
        if std::fs::metadata("/proc/self").map(|m| m.uid()).ok() != Some(0) {
            bail!("--hosts needs root: it creates network namespaces, a bridge and veth pairs");
        }
        sweep();
        let pid = std::process::id();
        let k = free_subnet()?;
        let bridge = format!("tup{pid}");
        let gateway = Ipv4Addr::new(10, 79, k, 1);
        // Made before anything is created, so a failure below deletes what exists.
        let mut hosts = Hosts { bridge: bridge.clone(), gateway, hosts: Vec::new() };
        ip(&["link", "add", &bridge, "type", "bridge"])?;
        ip(&["addr", "add", &format!("{gateway}/24"), "dev", &bridge])?;
        ip(&["link", "set", &bridge, "up"])?;
        for i in 0..n {
            let netns = format!("tandem-up-{pid}-h{i}");
            let host_ip = Ipv4Addr::new(10, 79, k, 10 + i as u8);
            let (outside, inside) = (format!("tup{pid}v{i}"), format!("tup{pid}n{i}"));
            ip(&["netns", "add", &netns])?;
            hosts.hosts.push(Host { netns: netns.clone(), ip: host_ip });
            ip(&["link", "add", &outside, "type", "veth", "peer", "name", &inside])?;
            ip(&["link", "set", &inside, "netns", &netns])?;
            ip(&["link", "set", &outside, "master", &bridge])?;
            ip(&["link", "set", &outside, "up"])?;
            ip(&["-n", &netns, "link", "set", &inside, "name", "eth0"])?;
            ip(&["-n", &netns, "addr", "add", &format!("{host_ip}/24"), "dev", "eth0"])?;
            ip(&["-n", &netns, "link", "set", "eth0", "up"])?;
            ip(&["-n", &netns, "link", "set", "lo", "up"])?;
            ip(&["-n", &netns, "route", "add", "default", "via", &gateway.to_string()])?;
        }
        Ok(hosts)
    }

    /// The host the `i`th worker runs on (round robin).
    pub fn host(&self, i: usize) -> &Host {
        &self.hosts[i % self.hosts.len()]
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for h in &self.hosts {
            if let Err(e) = ip(&["netns", "del", &h.netns]) {
                eprintln!("tandem up: {e:#}");
            }
        }
        if let Err(e) = ip(&["link", "del", &self.bridge]) {
            eprintln!("tandem up: {e:#}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owners_are_read_from_names() {
        assert_eq!(owner("tandem-up-4242-h3", "tandem-up-", '-'), Some(4242));
        assert_eq!(owner("tup4242", "tup", '\0'), Some(4242));
        assert_eq!(owner("tup4242v1", "tup", '\0'), None, "a veth is not a bridge");
        assert_eq!(owner("tdm-4242-1", "tandem-up-", '-'), None, "the drills' namespaces are not ours");
    }
}
