//! tandem's worker registry on etcd.
//!
//! # What it owns
//! - [`WorkerInfo`]: what a worker publishes about itself (role, version group, layout
//!   fingerprint, addresses, static capacity, draining flag), as JSON.
//! - The key layout under a cluster prefix ([`keys`]): `/{prefix}/workers/{role}/{id}`.
//! - [`Registration`]: a worker's key under a lease, kept alive by one owned task that
//!   **fences** the worker ([`Fence`]) whenever the lease is or may be lost, before it
//!   re-registers with a fresh lease.
//! - [`Membership`]: the coordinator's watch-fed cache of every worker, readable with no
//!   etcd round trip, with its freshness ([`Membership::healthy`],
//!   [`Membership::last_sync_age`]) so a coordinator can serve from it through an etcd blip
//!   for a bounded time.
//! - [`StopSignals`]: SIGTERM/SIGINT handling shared by every tandem process, and
//!   [`grpc::incoming`], the accepted connections of every tandem gRPC server (`TCP_NODELAY`
//!   on); here only because this is the lowest crate they all depend on.
//!
//! # What it must not do
//! - Carry load: queue depth and KV headroom change per request and reach coordinators
//!   straight from workers. The only value a worker rewrites is its draining flag.
//! - Route, admit, or decide how long a stale cache may be served: it reports freshness,
//!   the coordinator chooses.
//! - Block without a bound or panic on anything etcd or the network does: every etcd call
//!   has a timeout and failures are typed ([`RegistryError`]).
//!
//! # Fencing rule
//! A worker takes new work only while its [`Registration`] reads [`Fence::Serving`]. An
//! unreachable etcd fences nothing (static stability: the data plane outlives a control
//! plane outage). When a reachable etcd says the lease is gone (keepalive TTL 0) or the key
//! is not ours, the keeper claims the key again under a fresh lease while still serving
//! (a transaction: absent, unleased, or still held by our old lease); only if another lease
//! holds it — another process has this id — does it flip to [`Fence::Fenced`] until it
//! holds the key again. Details in [`registration`].
//!
//! # etcd 3.4 caveats (Debian's etcd-server with etcd-client 0.21)
//! - `KvClient::get_stream` is a 3.7 API ("unknown method RangeStream" on 3.4): listing
//!   uses plain `get` with `limit`, paging at a fixed revision.
//! - No automatic keepalive: the keeper sends each keepalive on the stream from
//!   `lease_keep_alive` every TTL/3 and reads each answer.
//! - Streams do not survive a reconnect: after any failure both tasks drop their client,
//!   connect afresh and rebuild the keepalive stream or the list + watch.
//! - A watch can go silent when etcd dies: the membership task sends a progress request
//!   every [`MembershipConfig::progress_interval`] and re-lists when nothing arrives within
//!   [`MembershipConfig::silence_timeout`].
//! - A restarted etcd extends every lease by its TTL, so an old lease may outlive the
//!   worker's own fence; reclaiming the key from our old lease and then revoking it handles
//!   that without a window where the key is missing.
//! - etcd raises a TTL below its minimum (1.5 × election timeout, so 2 s with default
//!   flags); the keeper uses the TTL etcd granted.

#![forbid(unsafe_code)]

mod error;
mod etcd;
pub mod grpc;
mod info;
pub mod keys;
pub mod membership;
pub mod registration;
mod shutdown;

pub use error::RegistryError;
pub use etcd::EtcdConfig;
pub use info::{check_zone, Capacity, Role, TransferEndpoint, WorkerInfo};
pub use keys::ClusterPrefix;
pub use membership::{Membership, MembershipConfig, MembershipView};
pub use registration::{Fence, FenceReason, Registration, RegistrationConfig};
pub use shutdown::StopSignals;
