//! A network namespace with a private link to the host, for faults the
//! kernel applies (this kernel has no `tc netem`; `iptables` and link state
//! work inside a namespace).
//!
//! [`Netns::create`] makes namespace `tdm-<pid>-<n>` and a veth pair: the
//! host end (`tdmh<k>`) holds `10.77.a.b+1/30`, the end inside (`veth0`)
//! holds `.b+2/30` with a default route through the host end. A process
//! started with [`Netns::exec_prefix`] lives inside (`ip netns exec` execs,
//! so its pid is the program's own). [`Netns::iptables`] changes the
//! namespace's own firewall, and [`Netns::rule_packets`] reads a rule's
//! packet counter — how a drill proves its rule matched.
//!
//! Dropping a [`Netns`] deletes the veth pair and the namespace (also when
//! a test panics). A process killed before its drop leaves its
//! namespace behind; the next [`Netns::create`] sweeps every `tdm-<pid>-*`
//! whose pid is dead, and never touches another live process's.
//!
//! Needs root and `ip` (iproute2) and `iptables` (see `scripts/deps.sh`).

use std::net::Ipv4Addr;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::HarnessError;

/// Subnets this harness hands out: 10.77.0.0/16 in /30s.
const SUBNETS: u32 = 1 << 14;

/// A network namespace linked to the host by a veth pair; deleted when dropped.
#[derive(Debug)]
pub struct Netns {
    /// `tdm-<pid>-<n>`.
    pub name: String,
    /// The host end's address (the namespace's gateway).
    pub host_ip: Ipv4Addr,
    /// The address inside the namespace.
    pub ns_ip: Ipv4Addr,
    /// The host end's interface name.
    pub host_if: String,
}

/// A veth pair between two namespaces ([`Netns::join`]).
#[derive(Debug, Clone)]
pub struct Join {
    /// The interface and address in the namespace `join` was called on.
    pub here_if: String,
    pub here_ip: Ipv4Addr,
    /// The interface and address in the other namespace.
    pub there_if: String,
    pub there_ip: Ipv4Addr,
}

/// Runs `argv`; its stdout, or which command failed and its stderr.
pub(crate) fn run(argv: &[&str]) -> Result<String, HarnessError> {
    let command = argv.join(" ");
    let Some((prog, args)) = argv.split_first() else {
        return Err(HarnessError::Command { command, status: "not run".into(), stderr: "empty command".into() });
    };
    let out = Command::new(prog).args(args).output().map_err(|e| HarnessError::Command {
        command: command.clone(),
        status: "not started".into(),
        stderr: e.to_string(),
    })?;
    if !out.status.success() {
        return Err(HarnessError::Command {
            command,
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Our namespaces' names: `tdm-<pid>-<n>`.
fn owner_pid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("tdm-")?;
    let (pid, n) = rest.split_once('-')?;
    n.parse::<u32>().ok()?;
    pid.parse().ok()
}

/// The two addresses of subnet `k` of [`SUBNETS`].
fn subnet(k: u32) -> (Ipv4Addr, Ipv4Addr) {
    let base = u32::from(Ipv4Addr::new(10, 77, 0, 0)) + 4 * (k % SUBNETS);
    (Ipv4Addr::from(base + 1), Ipv4Addr::from(base + 2))
}

impl Netns {
    /// Creates a namespace with its veth link up (and `lo`), after sweeping stale ones.
    pub fn create() -> Result<Self, HarnessError> {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        // Sweep failures are not this namespace's problem; a stale one just stays.
        let _ = Self::sweep_stale();
        let pid = std::process::id();
        let n = SEQ.fetch_add(1, Ordering::Relaxed);
        let name = format!("tdm-{pid}-{n}");
        run(&["ip", "netns", "add", &name])?;
        // From here on, Drop deletes the namespace whatever fails next.
        let mut ns =
            Self { name, host_ip: Ipv4Addr::UNSPECIFIED, ns_ip: Ipv4Addr::UNSPECIFIED, host_if: String::new() };
        // The host end's name claims its subnet: interface names are unique on
        // the host, so two processes never pick the same one (a collision is
        // "File exists", and the next subnet is tried).
        let start = pid.wrapping_mul(64).wrapping_add(n.wrapping_mul(7));
        let mut last = None;
        for k in (0..64).map(|i| start.wrapping_add(i) % SUBNETS) {
            let host_if = format!("tdmh{k}");
            match run(&["ip", "link", "add", &host_if, "type", "veth", "peer", "name", "veth0", "netns", &ns.name]) {
                Ok(_) => {
                    (ns.host_ip, ns.ns_ip) = subnet(k);
                    ns.host_if = host_if;
                    break;
                }
                Err(e @ HarnessError::Command { .. }) if e.to_string().contains("File exists") => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        if ns.host_if.is_empty() {
            return Err(last.unwrap_or_else(|| HarnessError::Setup("no free 10.77.0.0/16 subnet".into())));
        }
        let (host, inside) = (format!("{}/30", ns.host_ip), format!("{}/30", ns.ns_ip));
        run(&["ip", "addr", "add", &host, "dev", &ns.host_if])?;
        run(&["ip", "link", "set", &ns.host_if, "up"])?;
        ns.exec(&["ip", "addr", "add", &inside, "dev", "veth0"])?;
        ns.exec(&["ip", "link", "set", "veth0", "up"])?;
        ns.exec(&["ip", "link", "set", "lo", "up"])?;
        // Every host address (another namespace's gateway too) is reachable from inside.
        ns.exec(&["ip", "route", "add", "default", "via", &ns.host_ip.to_string()])?;
        Ok(ns)
    }

    /// The argv prefix that runs a program inside: `ip netns exec NAME`.
    pub fn exec_prefix(&self) -> Vec<String> {
        vec!["ip".into(), "netns".into(), "exec".into(), self.name.clone()]
    }

    /// Runs `argv` inside the namespace; its stdout.
    pub fn exec(&self, argv: &[&str]) -> Result<String, HarnessError> {
        let prefix = self.exec_prefix();
        let mut all: Vec<&str> = prefix.iter().map(String::as_str).collect();
        all.extend_from_slice(argv);
        run(&all)
    }

    /// Runs `iptables ARGS` inside the namespace (`-w`: waits for the xtables lock).
    pub fn iptables(&self, args: &[&str]) -> Result<String, HarnessError> {
        let mut argv = vec!["iptables", "-w", "5"];
        argv.extend_from_slice(args);
        self.exec(&argv)
    }

    /// Packets matched by the rules of `chain` (filter table) whose comment is
    /// `comment` (`-m comment --comment COMMENT`); `None` when no such rule exists.
    pub fn rule_packets(&self, chain: &str, comment: &str) -> Result<Option<u64>, HarnessError> {
        let listing = self.iptables(&["-L", chain, "-v", "-n", "-x"])?;
        Ok(packets_of(&listing, comment))
    }

    /// Deletes namespaces `tdm-<pid>-*` whose pid is no longer running (left by a
    /// killed run); returns their names. Never touches a live process's.
    pub fn sweep_stale() -> Result<Vec<String>, HarnessError> {
        let list = run(&["ip", "netns", "list"])?;
        let mut swept = Vec::new();
        for name in list.lines().filter_map(|l| l.split_whitespace().next()) {
            let Some(pid) = owner_pid(name) else { continue };
            if pid == std::process::id() || std::path::Path::new(&format!("/proc/{pid}")).exists() {
                continue;
            }
            run(&["ip", "netns", "del", name])?;
            swept.push(name.to_owned());
        }
        Ok(swept)
    }

    /// Joins this namespace to `other` with a veth pair of their own (a
    /// direct link, no host in between): `tdmj<k>` here holds
    /// `10.78.a.b+1/30`, `tdmk<k>` in `other` holds `.b+2/30`. The pair goes
    /// with the namespaces (deleting either end's namespace deletes it).
    pub fn join(&self, other: &Netns) -> Result<Join, HarnessError> {
        let start = std::process::id().wrapping_mul(64).wrapping_add(self.name.len() as u32 * 131);
        let mut last = None;
        for k in (0..64).map(|i| start.wrapping_add(i) % SUBNETS) {
            let (here_if, there_if) = (format!("tdmj{k}"), format!("tdmk{k}"));
            // Made in the host namespace, where names are unique (a taken one is
            // "File exists": try the next), then moved into the two namespaces.
            match run(&["ip", "link", "add", &here_if, "type", "veth", "peer", "name", &there_if]) {
                Ok(_) => {}
                Err(e @ HarnessError::Command { .. }) if e.to_string().contains("File exists") => {
                    last = Some(e);
                    continue;
                }
                Err(e) => return Err(e),
            }
            let moved = run(&["ip", "link", "set", &here_if, "netns", &self.name])
                .and_then(|_| run(&["ip", "link", "set", &there_if, "netns", &other.name]));
            if let Err(e) = moved {
                let _ = run(&["ip", "link", "del", &here_if]);
                return Err(e);
            }
            let base = u32::from(Ipv4Addr::new(10, 78, 0, 0)) + 4 * k;
            let (here_ip, there_ip) = (Ipv4Addr::from(base + 1), Ipv4Addr::from(base + 2));
            self.exec(&["ip", "addr", "add", &format!("{here_ip}/30"), "dev", &here_if])?;
            self.exec(&["ip", "link", "set", &here_if, "up"])?;
            other.exec(&["ip", "addr", "add", &format!("{there_ip}/30"), "dev", &there_if])?;
            other.exec(&["ip", "link", "set", &there_if, "up"])?;
            return Ok(Join { here_if, here_ip, there_if, there_ip });
        }
        Err(last.unwrap_or_else(|| HarnessError::Setup("no free 10.78.0.0/16 subnet".into())))
    }

    /// Whether namespace `name` exists.
    pub fn exists(name: &str) -> Result<bool, HarnessError> {
        let list = run(&["ip", "netns", "list"])?;
        Ok(list.lines().any(|l| l.split_whitespace().next() == Some(name)))
    }
}

/// Sums the `pkts` column of the rules in an `iptables -L -v -n -x` listing
/// whose comment is `comment`.
pub(crate) fn packets_of(listing: &str, comment: &str) -> Option<u64> {
    let tag = format!("/* {comment} */");
    let counts: Vec<u64> = listing
        .lines()
        .filter(|l| l.contains(&tag))
        .filter_map(|l| l.split_whitespace().next()?.parse().ok())
        .collect();
    (!counts.is_empty()).then(|| counts.iter().sum())
}

impl Drop for Netns {
    fn drop(&mut self) {
        // The veth pair first: deleting the namespace would destroy it too, but later (the
        // kernel cleans up namespaces asynchronously), keeping its subnet claimed meanwhile.
        if !self.host_if.is_empty() {
            let _ = run(&["ip", "link", "del", &self.host_if]);
        }
        if let Err(e) = run(&["ip", "netns", "del", &self.name]) {
            eprintln!("netns: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead, BufReader, Read};
    use std::net::{SocketAddr, TcpStream};
    use std::process::Stdio;
    use std::time::Duration;

    use super::*;

    /// A one-shot TCP listener inside `ns` (python3, started through the exec prefix):
    /// the child and its port. It answers `hi` to each of up to `n` connections.
    fn listener_inside(ns: &Netns, n: usize) -> (std::process::Child, u16) {
        let script = format!(
            "import socket\ns = socket.socket()\ns.bind(('{}', 0))\ns.listen()\n\
             print(s.getsockname()[1], flush=True)\nfor _ in range({n}):\n    c, _ = s.accept()\n    \
             c.sendall(b'hi')\n    c.close()\n",
            ns.ns_ip
        );
        let prefix = ns.exec_prefix();
        let mut child = Command::new(&prefix[0])
            .args(&prefix[1..])
            .args(["python3", "-c", &script])
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn a listener inside");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("read its port");
        let port = line.trim().parse().unwrap_or_else(|e| panic!("port {line:?}: {e}"));
        (child, port)
    }

    fn hello(addr: SocketAddr) -> std::io::Result<String> {
        let mut c = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
        c.set_read_timeout(Some(Duration::from_secs(5)))?;
        let mut got = String::new();
        c.read_to_string(&mut got)?;
        Ok(got)
    }

    /// Created, reachable from the host, filtered by its own iptables (the rule's
    /// counter shows it), and gone with its veth after drop.
    #[test]
    fn a_namespace_is_reachable_filterable_and_gone_after_drop() {
        let ns = Netns::create().expect("create");
        assert!(Netns::exists(&ns.name).expect("list"), "{} exists", ns.name);
        assert!(ns.name.starts_with(&format!("tdm-{}-", std::process::id())), "{}", ns.name);
        let (mut child, port) = listener_inside(&ns, 1);
        // `ip netns exec` execs: the pid is the program's own.
        let exe = std::fs::read_link(format!("/proc/{}/exe", child.id())).expect("exe");
        assert!(exe.to_string_lossy().contains("python3"), "{}", exe.display());
        let addr = SocketAddr::new(ns.ns_ip.into(), port);
        assert_eq!(hello(addr).expect("connect from the host"), "hi");
        let _ = child.wait();

        let (mut child, port) = listener_inside(&ns, 1);
        let dport = port.to_string();
        let rule = ["INPUT", "-p", "tcp", "--dport", &dport, "-m", "comment", "--comment", "tdm-test", "-j", "DROP"];
        assert_eq!(ns.rule_packets("INPUT", "tdm-test").expect("list"), None);
        ns.iptables(&[&["-A"][..], &rule].concat()).expect("add the rule");
        let addr = SocketAddr::new(ns.ns_ip.into(), port);
        assert!(hello(addr).is_err(), "dropped SYNs: the connect times out");
        let dropped = ns.rule_packets("INPUT", "tdm-test").expect("list").expect("the rule");
        assert!(dropped >= 1, "{dropped}");
        ns.iptables(&[&["-D"][..], &rule].concat()).expect("delete the rule");
        assert_eq!(hello(addr).expect("connect once the rule is gone"), "hi");
        let _ = child.wait();

        let err = ns.iptables(&["-A", "NO-SUCH-CHAIN", "-j", "DROP"]).expect_err("no such chain");
        assert!(
            matches!(&err, HarnessError::Command { command, stderr, .. }
            if command.contains("iptables") && command.contains("NO-SUCH-CHAIN") && !stderr.is_empty()),
            "{err}"
        );

        let (name, host_if) = (ns.name.clone(), ns.host_if.clone());
        drop(ns);
        assert!(!Netns::exists(&name).expect("list"), "{name} is gone");
        assert!(run(&["ip", "link", "show", &host_if]).is_err(), "{host_if} is gone");
    }

    /// A namespace of a dead pid is swept; one of a live pid is not.
    #[test]
    fn the_sweep_removes_only_namespaces_of_dead_pids() {
        let mut dead = Command::new("true").spawn().expect("spawn");
        let dead_pid = dead.id();
        dead.wait().expect("reap");
        // Pid 1 is always alive: its namespace must survive the sweep.
        let (stale, alive) = (format!("tdm-{dead_pid}-0"), format!("tdm-1-{}", std::process::id()));
        run(&["ip", "netns", "add", &stale]).expect("add stale");
        run(&["ip", "netns", "add", &alive]).expect("add alive");
        let swept = Netns::sweep_stale();
        // (Another test's `create` may have swept it first: what counts is that it is gone.)
        let (stale_left, alive_left) = (Netns::exists(&stale), Netns::exists(&alive));
        let _ = run(&["ip", "netns", "del", &alive]);
        let _ = run(&["ip", "netns", "del", &stale]);
        let swept = swept.expect("sweep");
        assert!(!stale_left.expect("list"), "{stale} was swept");
        assert!(!swept.contains(&alive), "{swept:?}");
        assert!(alive_left.expect("list"), "{alive} survived");
    }

    #[test]
    fn rule_counters_are_read_by_comment() {
        let listing = "Chain INPUT (policy ACCEPT 12 packets, 900 bytes)\n\
             \x20   pkts      bytes target     prot opt in     out     source               destination\n\
             \x20     17     2040 DROP       6    --  *      *       0.0.0.0/0            0.0.0.0/0            \
             tcp dpt:4000 /* tdm-kv */\n\
             \x20      3      120 ACCEPT     6    --  *      *       0.0.0.0/0            0.0.0.0/0            \
             tcp dpt:5000 /* other */\n";
        assert_eq!(packets_of(listing, "tdm-kv"), Some(17));
        assert_eq!(packets_of(listing, "other"), Some(3));
        assert_eq!(packets_of(listing, "missing"), None);
    }

    #[test]
    fn only_our_names_have_an_owner() {
        assert_eq!(owner_pid("tdm-123-4"), Some(123));
        assert_eq!(owner_pid("tdm-123"), None);
        assert_eq!(owner_pid("tdm-x-1"), None);
        assert_eq!(owner_pid("other-123-4"), None);
    }

    #[test]
    fn subnets_are_disjoint_slash_30s_in_10_77() {
        assert_eq!(subnet(0), (Ipv4Addr::new(10, 77, 0, 1), Ipv4Addr::new(10, 77, 0, 2)));
        assert_eq!(subnet(65), (Ipv4Addr::new(10, 77, 1, 5), Ipv4Addr::new(10, 77, 1, 6)));
        assert_eq!(subnet(SUBNETS - 1).1, Ipv4Addr::new(10, 77, 255, 254));
        assert_eq!(subnet(SUBNETS), subnet(0));
    }
}
