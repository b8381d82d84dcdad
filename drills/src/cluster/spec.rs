//! What a drill asks for: [`ClusterSpec`] (etcd members, workers, their links and
//! proxies, coordinators) and its builder methods.

/// A worker's role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Prefill,
    Decode,
}

impl Role {
    /// `prefill` or `decode`, as metrics label it.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

/// One worker to start.
#[derive(Debug, Clone)]
pub struct WorkerSpec {
    pub role: Role,
    pub group: String,
    /// Decode only: advertise a fault [`Proxy`](crate::Proxy) in front of the real KV listener.
    pub behind_proxy: bool,
    /// Run it in its own [`Netns`](crate::Netns), its listeners on the namespace's address.
    pub netns: bool,
    /// Flags added last.
    pub extra: Vec<String>,
}

/// What to start. Built with the chained methods; [`Cluster::start`](crate::Cluster::start) runs it.
#[derive(Debug, Clone)]
pub struct ClusterSpec {
    pub workers: Vec<WorkerSpec>,
    /// Decode workers' `--kv-load-failure-policy`.
    pub policy: String,
    pub kv_blocks: u32,
    /// Workers' etcd lease TTL: how fast a dead worker leaves membership.
    pub lease_ttl_s: u32,
    /// Flags added to the coordinator's.
    pub coordinator_args: Vec<String>,
    /// CPUs every coordinator runs on (`taskset -c`, so each of its threads), when set.
    pub coordinator_cpus: Option<String>,
    /// Coordinators serving the one membership (more than 1: clients reach them through a
    /// round-robin [`Front`](crate::Front), and each listens on fixed ports so a restart keeps its flags).
    pub coordinators: usize,
    /// etcd members (1, or 3 for failover and quorum drills). Every process gets all
    /// their endpoints.
    pub etcd_members: usize,
    /// Processes (`decode-1`, `coordinator`, ...) whose etcd traffic crosses fault
    /// proxies, one per member ([`Cluster::etcd_proxies`](crate::Cluster::etcd_proxies)), to cut them off alone.
    pub etcd_via_proxy: Vec<String>,
    /// Clients (loadgen) reach the coordinator's HTTP port through a fault proxy acting on
    /// its answers ([`Cluster::client_proxy`](crate::Cluster::client_proxy)): the request link.
    pub clients_via_proxy: bool,
    /// Decode workers (`decode-0`, ...) the coordinator reaches through a fault proxy acting
    /// on their answers ([`Cluster::control_proxies`](crate::Cluster::control_proxies)): the control link. Each binds its gRPC
    /// on a fixed port and advertises the proxy (`--advertise-grpc`).
    pub control_via_proxy: Vec<String>,
    /// Decode workers' `--kv-transport` (`None`: the workers' default, tcp). Prefill workers
    /// follow each destination's transport.
    pub kv_transport: Option<String>,
    /// A tenants file every coordinator is started with (`--tenants`), and the key the
    /// drill's load presents ([`ClusterSpec::tenants`]).
    pub tenants: Option<TenantsSpec>,
    /// The coordinators' `--local-prefill-max-tokens` (the one local-vs-remote decision; the
    /// decode worker follows it): prompts this short are prefilled on the decode worker. 0
    /// (the default): every prompt crosses the KV link.
    pub local_prefill_max_tokens: usize,
}

/// The coordinators' tenants file and the API key of the tenant the drill's load runs as.
#[derive(Debug, Clone)]
pub struct TenantsSpec {
    /// The file's TOML (coordinator/src/tenants/config.rs has the format).
    pub toml: String,
    /// Sent by the load as `Authorization: Bearer`.
    pub load_key: String,
}

impl Default for ClusterSpec {
    fn default() -> Self {
        Self {
            workers: Vec::new(),
            policy: "recompute".into(),
            kv_blocks: 256,
            lease_ttl_s: 2,
            coordinator_args: Vec::new(),
            coordinator_cpus: None,
            coordinators: 1,
            etcd_members: 1,
            etcd_via_proxy: Vec::new(),
            clients_via_proxy: false,
            control_via_proxy: Vec::new(),
            kv_transport: None,
            tenants: None,
            local_prefill_max_tokens: 0,
        }
    }
}

impl ClusterSpec {
    /// A plain worker of `role` with `extra` flags (added last).
    fn worker(mut self, role: Role, group: &str, extra: &[&str]) -> Self {
        self.workers.push(WorkerSpec {
            role,
            group: group.into(),
            behind_proxy: false,
            netns: false,
            extra: extra.iter().map(|s| (*s).to_owned()).collect(),
        });
        self
    }

    pub fn prefill(self, group: &str) -> Self {
        self.worker(Role::Prefill, group, &[])
    }

    pub fn decode(self, group: &str) -> Self {
        self.worker(Role::Decode, group, &[])
    }

    /// A decode worker whose KV link crosses a fault proxy.
    pub fn decode_behind_proxy(mut self, group: &str) -> Self {
        self.workers.push(WorkerSpec {
            role: Role::Decode,
            group: group.into(),
            behind_proxy: true,
            netns: false,
            extra: vec![],
        });
        self
    }

    /// A decode worker in its own network namespace: its gRPC, metrics and KV
    /// listeners bind the namespace's address, it reaches etcd through a
    /// forwarding [`Proxy`](crate::Proxy) on the namespace's gateway, and prefill workers
    /// bind their gRPC on that gateway so it can call them. Faults then go
    /// in with [`Netns::iptables`](crate::Netns::iptables).
    pub fn decode_in_netns(mut self, group: &str) -> Self {
        self.workers.push(WorkerSpec {
            role: Role::Decode,
            group: group.into(),
            behind_proxy: false,
            netns: true,
            extra: vec![],
        });
        self
    }

    /// A prefill worker with extra flags (added last).
    pub fn prefill_with(self, group: &str, extra: &[&str]) -> Self {
        self.worker(Role::Prefill, group, extra)
    }

    /// A decode worker with extra flags (added last).
    pub fn decode_with(self, group: &str, extra: &[&str]) -> Self {
        self.worker(Role::Decode, group, extra)
    }

    /// `n` coordinators on the same etcd membership, behind a round-robin front.
    pub fn coordinators(mut self, n: usize) -> Self {
        self.coordinators = n.max(1);
        self
    }

    pub fn policy(mut self, p: &str) -> Self {
        self.policy = p.into();
        self
    }

    /// Runs `n` etcd members instead of one.
    pub fn etcd_members(mut self, n: usize) -> Self {
        self.etcd_members = n;
        self
    }

    /// Routes process `name`'s etcd traffic (`decode-0`, `prefill-1`, `coordinator`)
    /// through fault proxies of its own.
    pub fn etcd_via_proxy(mut self, name: &str) -> Self {
        self.etcd_via_proxy.push(name.into());
        self
    }

    /// Puts a fault proxy between the clients and the coordinator's HTTP port (its faults
    /// act on the coordinator's answers).
    pub fn clients_via_proxy(mut self) -> Self {
        self.clients_via_proxy = true;
        self
    }

    /// Puts a fault proxy between the coordinator and decode worker `name`'s gRPC port
    /// (its faults act on the worker's answers: the token streams).
    pub fn control_via_proxy(mut self, name: &str) -> Self {
        self.control_via_proxy.push(name.into());
        self
    }

    /// Starts every coordinator with this tenants file; the drill's load runs as the tenant
    /// of `load_key`.
    pub fn tenants(mut self, toml: &str, load_key: &str) -> Self {
        self.tenants = Some(TenantsSpec { toml: toml.into(), load_key: load_key.into() });
        self
    }

    /// Decode workers receive KV over `transport` (`tcp`, `quic`, `local`, `ucx`).
    pub fn kv_transport(mut self, transport: &str) -> Self {
        self.kv_transport = Some(transport.into());
        self
    }

    pub fn coordinator_args(mut self, args: &[&str]) -> Self {
        self.coordinator_args.extend(args.iter().map(|s| (*s).to_owned()));
        self
    }

    /// Runs the coordinators on `cpus` (a `taskset -c` list; `None`: anywhere).
    pub fn coordinator_cpus(mut self, cpus: Option<&str>) -> Self {
        self.coordinator_cpus = cpus.map(str::to_owned);
        self
    }
}
