//! The etcd `tandem up` starts when no `--etcd` is given — one member, or
//! `--etcd-members` of them on loopback, so leader and quorum loss can be
//! drilled: a production launcher (etcd's own heartbeat and election
//! timeouts), not the test harness's, with each member's data dir kept
//! across restarts so the supervisor can start it again with the leases and
//! keys it had.

use std::net::{Ipv4Addr, TcpListener};
use std::path::Path;

use anyhow::Context;

use super::child::{Ready, Spec};

/// The binary: `$TANDEM_ETCD_BIN` if set, else `etcd` on `PATH` (Debian's `etcd-server`).
fn binary() -> std::path::PathBuf {
    std::env::var_os("TANDEM_ETCD_BIN").map_or_else(|| "etcd".into(), Into::into)
}

/// `n` free loopback ports below the kernel's ephemeral range (a port inside it can become
/// some outgoing connection's source port between this probe and etcd's bind).
fn free_ports(n: usize, ip: Ipv4Addr) -> anyhow::Result<Vec<u16>> {
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let span = u32::from(low.saturating_sub(10_000)).max(1);
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    // Any spread will do: the bind below is the real check.
    let mut rng = types::rng::XorShift64::new(u64::from(seed ^ std::process::id().rotate_left(16)));
    let mut found = Vec::new();
    for _ in 0..1_000 {
        let port = 10_000 + rng.below(u64::from(span)) as u16;
        if !found.contains(&port) && TcpListener::bind((ip, port)).is_ok() {
            found.push(port);
            if found.len() == n {
                return Ok(found);
            }
        }
    }
    anyhow::bail!("no {n} free ports on {ip} found below {low} for etcd")
}

/// The most members `--etcd-members` takes (etcd's own advice: 3, 5 or 7).
pub const MAX_MEMBERS: usize = 7;

/// Refuses a member count etcd advises against (even counts tolerate no more losses than
/// the odd count below them).
pub fn check_members(members: usize) -> anyhow::Result<()> {
    anyhow::ensure!(
        (1..=MAX_MEMBERS).contains(&members) && members % 2 == 1,
        "--etcd-members {members}: an odd count from 1 to {MAX_MEMBERS} (a quorum survives (N-1)/2 losses)"
    );
    Ok(())
}

/// One member of the etcd cluster `tandem up` starts: how to start it (and again, after it
/// exited: same name, ports and data), its component name and its client address.
pub struct Member {
    pub spec: Spec,
    pub name: String,
    pub addr: String,
}

/// How to start an etcd of `members` members on free loopback ports: a single member is
/// `etcd` with its data in `data_dir` (as before multi-member clusters existed); members of
/// a larger cluster are `etcd-0`, `etcd-1`, ... with their data in `data_dir/etcd-I`. Each
/// member's output goes to `NAME.log` in `logs`.
pub fn members(members: usize, data_dir: &Path, logs: &Path, ip: Ipv4Addr) -> anyhow::Result<Vec<Member>> {
    check_members(members)?;
    let ports = free_ports(2 * members, ip)?;
    let name = |i: usize| if members == 1 { "etcd".to_owned() } else { format!("etcd-{i}") };
    let peer_url = |i: usize| format!("http://{ip}:{}", ports[2 * i + 1]);
    let cluster = (0..members).map(|i| format!("{}={}", name(i), peer_url(i))).collect::<Vec<_>>().join(",");
    let mut out = Vec::new();
    for i in 0..members {
        let dir = if members == 1 { data_dir.to_owned() } else { data_dir.join(name(i)) };
        std::fs::create_dir_all(&dir).with_context(|| format!("creating etcd's data dir {}", dir.display()))?;
        // etcd warns about (and a shared host should not have) a data dir others can read.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
            .with_context(|| format!("restricting {} to its owner", dir.display()))?;
        let client_url = format!("http://{ip}:{}", ports[2 * i]);
        let args = [
            "--name",
            &name(i),
            "--data-dir",
            &dir.display().to_string(),
            "--listen-client-urls",
            &client_url,
            "--advertise-client-urls",
            &client_url,
            "--listen-peer-urls",
            &peer_url(i),
            "--initial-advertise-peer-urls",
            &peer_url(i),
            "--initial-cluster",
            &cluster,
            "--initial-cluster-state",
            "new",
            "--initial-cluster-token",
            &format!("tandem-up-{}", std::process::id()),
            "--logger",
            "zap",
            "--log-outputs",
            "stderr",
            "--log-level",
            "warn",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let addr = format!("{ip}:{}", ports[2 * i]);
        let log = logs.join(format!("{}.log", name(i)));
        let spec =
            Spec { bin: binary(), args, addrs: Vec::new(), ready: Ready::Health(addr.clone()), log, netns: None };
        out.push(Member { spec, name: name(i), addr });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn three_members_name_each_other_and_keep_their_own_data() {
        let dir = std::env::temp_dir().join(format!("tandem-etcd-members-{}", std::process::id()));
        let m = members(3, &dir.join("data"), &dir, Ipv4Addr::LOCALHOST).expect("members");
        assert_eq!(m.iter().map(|m| m.name.as_str()).collect::<Vec<_>>(), ["etcd-0", "etcd-1", "etcd-2"]);
        let arg = |m: &Member, flag: &str| {
            let i = m.spec.args.iter().position(|a| a == flag).expect(flag);
            m.spec.args[i + 1].clone()
        };
        let cluster = arg(&m[0], "--initial-cluster");
        for x in &m {
            assert_eq!(arg(x, "--initial-cluster"), cluster, "one cluster");
            assert!(cluster.contains(&format!("{}={}", x.name, arg(x, "--initial-advertise-peer-urls"))), "{cluster}");
            assert_eq!(arg(x, "--data-dir"), dir.join("data").join(&x.name).display().to_string());
            assert!(x.spec.log.ends_with(format!("{}.log", x.name)));
            assert_eq!(format!("http://{}", x.addr), arg(x, "--listen-client-urls"));
        }
        let ports: std::collections::BTreeSet<String> =
            m.iter().flat_map(|x| [x.addr.clone(), arg(x, "--listen-peer-urls").replace("http://", "")]).collect();
        assert_eq!(ports.len(), 6, "a client and a peer port each, all different: {ports:?}");
        let one = members(1, &dir.join("one"), &dir, Ipv4Addr::LOCALHOST).expect("one member");
        assert_eq!(one[0].name, "etcd");
        assert_eq!(arg(&one[0], "--data-dir"), dir.join("one").display().to_string());
        for bad in [0, 2, 9] {
            let e = members(bad, &dir.join("bad"), &dir, Ipv4Addr::LOCALHOST).err().expect("refused").to_string();
            assert!(e.contains(&format!("--etcd-members {bad}")), "{e}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
