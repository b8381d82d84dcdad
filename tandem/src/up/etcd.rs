//! The single-member etcd `tandem up` starts when no `--etcd` is given: a
//! production launcher (etcd's own heartbeat and election timeouts), not
//! the test harness's, with its data dir kept across restarts so the
//! supervisor can start it again with the leases and keys it had.

use std::net::{Ipv4Addr, TcpListener};
use std::path::Path;

use anyhow::Context;

use super::child::{Ready, Spec};

/// The binary: `$TANDEM_ETCD_BIN` if set, else `etcd` on `PATH` (Debian's `etcd-server`).
fn binary() -> std::path::PathBuf {
    std::env::var_os("TANDEM_ETCD_BIN").map_or_else(|| "etcd".into(), Into::into)
}

/// Two free loopback ports below the kernel's ephemeral range (a port inside it can become
/// some outgoing connection's source port between this probe and etcd's bind).
fn free_ports() -> anyhow::Result<(u16, u16)> {
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
        if !found.contains(&port) && TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok() {
            found.push(port);
            if let [a, b] = found[..] {
                return Ok((a, b));
            }
        }
    }
    anyhow::bail!("no two free loopback ports found below {low} for etcd")
}

/// How to start etcd on free loopback ports with its data in `data_dir` and its output in
/// `log`; the client address (`127.0.0.1:PORT`).
pub fn spec(data_dir: &Path, log: &Path) -> anyhow::Result<(Spec, String)> {
    std::fs::create_dir_all(data_dir).with_context(|| format!("creating etcd's data dir {}", data_dir.display()))?;
    // etcd warns about (and a shared host should not have) a data dir others can read.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(data_dir, std::fs::Permissions::from_mode(0o700))
        .with_context(|| format!("restricting {} to its owner", data_dir.display()))?;
    let (client, peer) = free_ports()?;
    let client_url = format!("http://127.0.0.1:{client}");
    let peer_url = format!("http://127.0.0.1:{peer}");
    let args = [
        "--name",
        "tandem-up",
        "--data-dir",
        &data_dir.display().to_string(),
        "--listen-client-urls",
        &client_url,
        "--advertise-client-urls",
        &client_url,
        "--listen-peer-urls",
        &peer_url,
        "--initial-advertise-peer-urls",
        &peer_url,
        "--initial-cluster",
        &format!("tandem-up={peer_url}"),
        "--initial-cluster-state",
        "new",
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
    let addr = format!("127.0.0.1:{client}");
    let spec = Spec { bin: binary(), args, addrs: Vec::new(), ready: Ready::Health(addr.clone()), log: log.to_owned() };
    Ok((spec, addr))
}
