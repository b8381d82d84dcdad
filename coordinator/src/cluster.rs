//! The workers this coordinator routes to, and one request's trip to them.
//!
//! Workers come from etcd membership (`--etcd`; only non-draining ones, a
//! decode worker paired only with prefill workers of its own version group
//! and KV layout fingerprint)
//! or from fixed addresses (`--decode`, `--prefill`). Their live load comes
//! from the workers themselves ([`crate::load`]); the decision is
//! [`crate::router::route`]: the decode worker with the most headroom, and
//! prefill workers of its group by power of two choices (the rest as
//! fallbacks for the `retry` policy), or none when the prompt is at most
//! `local_prefill_max_tokens` long (the decode worker prefills it).
//!
//! Each request's stream reports the remote prefill attempts the decode
//! worker made; they feed the circuit breakers of the (prefill worker, that
//! decode worker) pairs ([`crate::breaker`]) that routing consults. Pairs
//! whose worker left the membership are dropped as routing sees it go.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use types::priority::Priority;

use proto::worker::v1::decode_worker_client::DecodeWorkerClient;
use proto::worker::v1::{generate_response, GenerateRequest, PrefillAttempt, PrefillTarget};
use tonic::transport::{Channel, Endpoint};
use types::sampling::SamplingParams;

use crate::admission::Admission;
use crate::breaker::{BreakerConfig, Breakers, Gate, Gates, Outcome, Pair};
use crate::error::Error;
use crate::load::{Kind, LoadBoard};
use crate::metrics;
use crate::prefix::Query;
use crate::router::{self, DecodeCandidate, NoRoute, PrefillCandidate, ZonePairing};
use types::rng::XorShift64;

mod listing;
mod route;
pub use route::Route;

/// One decode worker's client and this coordinator's in-flight count for it.
struct Decode {
    client: DecodeWorkerClient<Channel>,
    inflight: AtomicUsize,
}

/// Where the worker set comes from.
pub enum Source {
    /// Fixed addresses (`--decode`, `--prefill`): one version group assumed.
    Static { decode: Vec<String>, prefill: Vec<String> },
    /// etcd membership: only non-draining workers; a decode worker is paired
    /// only with prefill workers of its own version group and registered KV
    /// layout fingerprint. While etcd is
    /// unreachable the cached view is used for at most `max_stale`, then
    /// requests get 503.
    Etcd { membership: registry::Membership, max_stale: Duration },
}

/// Routing settings.
#[derive(Clone, Copy, Debug)]
pub struct RouteSettings {
    /// Prompts of at most this many tokens are prefilled by the decode worker.
    pub local_prefill_max_tokens: usize,
    /// How often each worker's load is polled.
    pub load_poll: Duration,
    /// The prefill workers' circuit breakers.
    pub breaker: BreakerConfig,
    /// What a worker holding the whole prompt in its prefix cache is worth
    /// in load (decode: score units, a full batch's queue is 1; prefill:
    /// queued requests); a partial prefix in proportion. 0 = load only.
    pub prefix_affinity: f64,
    /// Remote prefill attempts one dispatch may make, across every decode worker
    /// it is routed to (`--prefill-attempts`): the coordinator lists at most this
    /// many prefill workers in all, and a decode worker walks its list (policy
    /// `retry`) without adding any, so retries inside the cluster happen in this
    /// one layer and never multiply.
    pub prefill_attempts: usize,
    /// Whether a prefill worker's zone counts in pairing (`--zone-pairing`).
    pub zone_pairing: ZonePairing,
}

impl Default for RouteSettings {
    fn default() -> Self {
        Self {
            local_prefill_max_tokens: 32,
            load_poll: Duration::from_millis(250),
            breaker: BreakerConfig::default(),
            prefix_affinity: 1.0,
            prefill_attempts: 3,
            zone_pairing: ZonePairing::Any,
        }
    }
}

/// Whether the membership cache is past trusting: etcd has not confirmed it for
/// `max_stale`. Routing and readiness share this test, so `/ready` and requests
/// turn together. Workers whose key just went away stay routable for the
/// cache's departed grace ([`registry::MembershipView::routable`]): only those
/// answering their health checks get requests (docs/REGISTRY.md).
fn registry_expired(membership: &registry::Membership, max_stale: Duration) -> bool {
    !membership.healthy() && membership.last_sync_age().is_none_or(|age| age > max_stale)
}

/// The worker set and per-worker clients.
pub struct Cluster {
    source: Source,
    settings: RouteSettings,
    board: Arc<LoadBoard>,
    breakers: Breakers,
    /// (membership revision, breaker count) when breakers of departed workers were last dropped.
    pruned: Mutex<(i64, usize)>,
    /// The workers a decision lists, as one table kept while they stay the same
    /// ([`listing`]).
    listing: Mutex<listing::Listing>,
    decode: Mutex<rustc_hash::FxHashMap<String, Arc<Decode>>>,
    rng: Mutex<XorShift64>,
    next_id: AtomicU64,
}

/// A request's stream from its decode worker; dropping it cancels the
/// request there (and its KV transfer and prefill). Its first message was
/// read by [`Cluster::generate`] (to route around a refusal) and is
/// replayed first.
pub struct WorkerStream {
    first: Option<Result<Option<proto::worker::v1::GenerateResponse>, tonic::Status>>,
    rest: tonic::Streaming<proto::worker::v1::GenerateResponse>,
    /// Where it runs: its prefill attempt reports feed the decode worker's pairs' breakers,
    /// and a continuation elsewhere must match its group and determinism.
    placement: Placement,
    /// The id the decode worker knows the request by (an attempt's own id).
    request_id: String,
}

/// Where a request runs now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// The decode worker's registry id (its address for fixed-address workers).
    pub decode_id: String,
    pub decode_addr: String,
    pub version_group: String,
    /// Hex; empty when unknown.
    pub determinism: String,
}

/// What a continuation must run on: a decode worker of the same version group and
/// determinism fingerprint as the one that generated its tokens, other than those
/// already tried.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pin {
    /// Decode worker addresses this request has lost; never chosen again for it.
    pub exclude: Vec<String>,
    pub version_group: String,
    /// Hex; empty: no fingerprint to match (fixed-address workers, older workers).
    pub determinism: String,
}

/// One request as a decode worker gets it.
#[derive(Debug, Clone)]
pub struct Dispatch {
    /// The id the decode worker knows it by (a migration's attempt has its own).
    pub request_id: String,
    /// The prompt's token ids.
    pub prompt: Vec<u32>,
    /// A continuation's tokens generated so far (empty for a fresh request).
    pub generated: Vec<u32>,
    /// Sampling: a continuation's `max_tokens` is what is left of the request's.
    pub params: SamplingParams,
    pub deadline_unix_ms: u64,
    pub tags: WorkerTags,
    /// A continuation's constraint on where it may run.
    pub pin: Option<Pin>,
}

impl WorkerStream {
    /// Where the request runs.
    pub fn placement(&self) -> &Placement {
        &self.placement
    }

    /// The id the decode worker knows this attempt by.
    pub fn request_id(&self) -> &str {
        &self.request_id
    }

    /// The next message, as `tonic::Streaming::message`.
    pub async fn message(&mut self) -> Result<Option<proto::worker::v1::GenerateResponse>, tonic::Status> {
        match self.first.take() {
            Some(first) => first,
            None => self.rest.message().await,
        }
    }
}

/// The worker refused the request before starting it, in a way another
/// worker may not: fenced (another process holds its etcd key, or no coordinator reached it) or draining.
fn refused_at_start(first: &Result<Option<proto::worker::v1::GenerateResponse>, tonic::Status>) -> bool {
    use proto::worker::v1::ErrorKind as K;
    matches!(
        first,
        Ok(Some(proto::worker::v1::GenerateResponse { event: Some(generate_response::Event::Error(e)), .. }))
            if e.kind() == K::Retryable
    )
}

/// Holds a decode worker's in-flight count for one request (the router's
/// headroom estimate between load polls); released on drop.
pub struct Inflight {
    decode: Arc<Decode>,
    /// Prompt tokens the worker that prefills it (the first prefill worker,
    /// or the decode worker for local prefill) reported holding in its
    /// prefix cache under the request's salt when it was routed.
    pub cached_tokens: usize,
}

impl Drop for Inflight {
    fn drop(&mut self) {
        self.decode.inflight.fetch_sub(1, Ordering::Relaxed);
    }
}

fn endpoint(addr: &str) -> Result<Endpoint, String> {
    Endpoint::from_shared(format!("http://{addr}"))
        .map(|e| e.connect_timeout(Duration::from_secs(2)).tcp_nodelay(true))
        .map_err(|e| format!("worker address {addr:?}: {e}"))
}

/// Running requests assumed per fixed-address decode worker (the workers'
/// default `max_running`).
pub const STATIC_MAX_RUNNING: usize = 16;

/// The group fixed-address workers are assumed to share.
const STATIC_GROUP: &str = "static";

/// What a request carries to the workers from its tenant.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkerTags {
    /// Scopes the request's prefix-cache entries (its tenant's
    /// [`crate::tenants::CacheScope`]), so no other scope can hit them.
    pub cache_salt: u64,
    /// Its class: the workers' queues serve higher classes first and
    /// preempt lower ones first.
    pub priority: Priority,
}

impl Cluster {
    /// Lazy connections: a worker that is down now is tried per request.
    /// Call [`Cluster::spawn_load_poller`] to learn the workers' load.
    pub fn new(source: Source, settings: RouteSettings) -> Result<Self, String> {
        if let Source::Static { decode, .. } = &source {
            for a in decode {
                endpoint(a)?;
            }
        }
        let seed =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64);
        Ok(Self {
            source,
            settings,
            board: LoadBoard::new(settings.load_poll),
            breakers: Breakers::new(settings.breaker),
            pruned: Mutex::new((0, 0)),
            listing: Mutex::new(listing::Listing::default()),
            decode: Mutex::new(rustc_hash::FxHashMap::default()),
            rng: Mutex::new(XorShift64::new(seed ^ u64::from(std::process::id()))),
            next_id: AtomicU64::new(1),
        })
    }

    /// Starts polling every known worker's load (stops when the cluster is dropped).
    /// Each round also forgets the clients of decode workers that left.
    pub fn spawn_load_poller(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let me = Arc::downgrade(self);
        self.board.spawn(move || {
            me.upgrade()
                .map(|c| {
                    let targets = c.poll_targets();
                    c.forget_departed(&targets);
                    targets
                })
                .unwrap_or_default()
        })
    }

    /// Drops the client of every decode worker no longer among `targets` and with
    /// nothing of ours in flight on it. A worker that restarts comes back at another
    /// address (a new port, a new pod IP): without this the table grew by one client a
    /// restart for the coordinator's whole life (found by `tandem chaos`'s memory check).
    /// A worker that returns at a known address is connected anew on its first request.
    fn forget_departed(&self, targets: &HashMap<String, Kind>) -> usize {
        let mut m = self.decode.lock().unwrap_or_else(|e| e.into_inner());
        let before = m.len();
        m.retain(|addr, d| targets.contains_key(addr) || d.inflight.load(Ordering::Relaxed) > 0);
        before - m.len()
    }

    /// Decode workers this coordinator holds a client for.
    pub fn decode_clients(&self) -> usize {
        self.decode.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// The live-load board (read by `/ready` and metrics).
    pub fn board(&self) -> &LoadBoard {
        &self.board
    }

    /// The prefill workers' circuit breakers.
    pub fn breakers(&self) -> &Breakers {
        &self.breakers
    }

    /// Feeds the remote prefill attempts decode worker (`decode_id`,
    /// `decode_addr`) reported to the breakers of its pairs.
    pub fn record_prefill_attempts(&self, decode_id: &str, decode_addr: &str, attempts: &[PrefillAttempt]) {
        for a in attempts {
            let Some(t) = a.target.as_ref() else { continue };
            let (outcome, label) = match &a.error {
                None => (Outcome::Success, "ok"),
                // Busy is not broken.
                Some(e) if e.kind() == proto::worker::v1::ErrorKind::Overloaded => (Outcome::Neutral, "overloaded"),
                Some(_) => (Outcome::Failure, if a.reason.is_empty() { "failed" } else { a.reason.as_str() }),
            };
            metrics::prefill_attempt(&t.worker_id, decode_id, label);
            let why = a.error.as_ref().map_or("", |e| e.message.as_str());
            let pair = Pair { prefill_id: &t.worker_id, prefill_addr: &t.grpc_addr, decode_id, decode_addr };
            self.breakers.record(pair, outcome, why);
        }
    }

    fn poll_targets(&self) -> HashMap<String, Kind> {
        match &self.source {
            Source::Static { decode, prefill } => decode
                .iter()
                .map(|a| (a.clone(), Kind::Decode))
                .chain(prefill.iter().map(|a| (a.clone(), Kind::Prefill)))
                .collect(),
            Source::Etcd { membership, .. } => membership
                .view()
                .routable()
                .map(|w| {
                    let kind = if w.role == registry::Role::Decode { Kind::Decode } else { Kind::Prefill };
                    (w.grpc_addr.clone(), kind)
                })
                .collect(),
        }
    }

    /// Known workers that are stale (no load poll answered for the board's
    /// max age), as (decode, prefill); they get no requests.
    pub fn stale_workers(&self) -> (usize, usize) {
        let targets = self.poll_targets();
        let of = |k: Kind| self.board.count_stale(targets.iter().filter(|(_, t)| **t == k).map(|(a, _)| a.as_str()));
        (of(Kind::Decode), of(Kind::Prefill))
    }

    /// (decode, prefill) workers whose load is known and fresh (see [`LoadBoard::count_known`]).
    pub fn load_known_workers(&self) -> (usize, usize) {
        let targets = self.poll_targets();
        let of = |k: Kind| self.board.count_known(targets.iter().filter(|(_, t)| **t == k).map(|(a, _)| a.as_str()));
        (of(Kind::Decode), of(Kind::Prefill))
    }

    /// Decode worker addresses known now (for readiness).
    pub fn decode_addrs(&self) -> Vec<String> {
        match &self.source {
            Source::Static { decode, .. } => decode.clone(),
            Source::Etcd { membership, .. } => membership
                .view()
                .routable()
                .filter(|w| w.role == registry::Role::Decode && !w.draining)
                .map(|w| w.grpc_addr.clone())
                .collect(),
        }
    }

    /// The decode workers' KV cache as this coordinator knows it, for
    /// tenants' `max_kv_share`: (tokens, the largest block size), from each
    /// non-draining decode worker's last load report (its pool's blocks)
    /// and prefix report (its block size). A worker not yet heard from
    /// counts nothing, so an unknown cluster is a small one: shares err on
    /// the side of refusing.
    pub fn kv_capacity(&self) -> (u64, usize) {
        let loads = self.board.read();
        let (mut tokens, mut block) = (0u64, 1usize);
        for addr in self.decode_addrs() {
            let (Some(load), Some(block_size)) = (loads.get(&addr), loads.block_size(&addr)) else { continue };
            tokens += u64::from(load.kv_blocks_total) * block_size as u64;
            block = block.max(block_size);
        }
        (tokens, block)
    }

    /// Requests the cluster runs at once: the sum of the non-draining
    /// decode workers' `max_running` (their registrations; fixed addresses
    /// count [`STATIC_MAX_RUNNING`] each), at least 1 so a request can reach
    /// routing and get its typed refusal when no worker exists.
    pub fn capacity(&self) -> usize {
        let n: usize = match &self.source {
            Source::Static { decode, .. } => decode.len() * STATIC_MAX_RUNNING,
            Source::Etcd { membership, .. } => membership
                .view()
                .routable()
                .filter(|w| w.role == registry::Role::Decode && !w.draining)
                .map(|w| w.capacity.max_running as usize)
                .sum(),
        };
        n.max(1)
    }

    /// Whether the cluster can serve now: membership within its stale bound
    /// (with `--etcd`: an etcd blip changes nothing) and a decode worker
    /// answering ready, with a ready prefill worker of its version group and
    /// layout (or none configured in static mode: the decode worker
    /// prefills). Reads the load board; no I/O. The error says what
    /// is missing.
    pub fn ready(&self) -> Result<(), String> {
        let ready = |addr: &str| self.board.get(addr).is_some_and(|l| l.ready && l.reachable);
        match &self.source {
            Source::Static { decode, prefill } => {
                if !decode.iter().any(|a| ready(a)) {
                    return Err("no decode worker answers ready".into());
                }
                if !prefill.is_empty() && !prefill.iter().any(|a| ready(a)) {
                    return Err("no prefill worker answers ready".into());
                }
                Ok(())
            }
            Source::Etcd { membership, max_stale } => {
                if registry_expired(membership, *max_stale) {
                    let ms = max_stale.as_millis();
                    return Err(format!("etcd unreachable past --registry-max-stale-ms ({ms} ms)"));
                }
                let view = membership.view();
                let live = || view.routable().filter(|w| !w.draining && ready(&w.grpc_addr));
                // A decode worker can serve when a ready prefill worker of its group and
                // layout can prefill for it, or when its group has no prefill worker at all
                // (a decode-only group prefills locally, as routing does). A group whose
                // prefill workers are registered but none ready is not served: routing
                // would answer prefill_unavailable.
                let serving = live().filter(|d| d.role == registry::Role::Decode).any(|d| {
                    !view.routable().any(|p| p.role == registry::Role::Prefill && p.version_group == d.version_group)
                        || live().any(|p| {
                            p.role == registry::Role::Prefill
                                && p.version_group == d.version_group
                                && p.layout_fingerprint == d.layout_fingerprint
                        })
                });
                if serving {
                    Ok(())
                } else {
                    Err("no ready decode worker with a ready prefill worker of its version group and KV layout \
                         (or in a group without prefill workers)"
                        .into())
                }
            }
        }
    }

    /// A fresh cluster-wide request id.
    pub fn request_id(&self) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("req-{}-{n}", std::process::id())
    }

    fn decode_entry(&self, addr: &str) -> Result<Arc<Decode>, Error> {
        let mut m = self.decode.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(d) = m.get(addr) {
            return Ok(d.clone());
        }
        let ep = endpoint(addr).map_err(Error::WorkerUnavailable)?;
        let d = Arc::new(Decode { client: DecodeWorkerClient::new(ep.connect_lazy()), inflight: AtomicUsize::new(0) });
        m.insert(addr.to_owned(), d.clone());
        Ok(d)
    }

    /// Starts `Generate` on a decode worker and returns its stream. A worker
    /// that cannot be reached (connection refused or broken before it
    /// answered) or that refuses at once (fenced, draining) is marked and the
    /// request is routed once more. A continuation (`d.pin`) goes only where
    /// its pin allows, carries its tokens so far and the determinism
    /// fingerprint its worker must have.
    pub async fn generate(self: &Arc<Self>, d: Dispatch) -> Result<(WorkerStream, Inflight), Error> {
        let expected = match &d.pin {
            Some(p) => hex_bytes(&p.determinism),
            None => Vec::new(),
        };
        let mut req = GenerateRequest {
            request_id: d.request_id.clone(),
            token_ids: d.prompt.clone(),
            sampling: Some((&d.params).into()),
            deadline_unix_ms: d.deadline_unix_ms,
            prefill: Vec::new(),
            policy_override: None,
            cache_salt: d.tags.cache_salt,
            priority: proto::worker::v1::Priority::from(d.tags.priority) as i32,
            generated_ids: d.generated.clone(),
            determinism_fingerprint: expected,
        };
        // Routing sees the prompt and a continuation's tokens: together they are what
        // gets prefilled, locally or remotely (the one local-vs-remote decision).
        let tokens: Vec<u32> = d.prompt.iter().chain(&d.generated).copied().collect();
        let mut pin = d.pin.clone();
        // Decode workers whose stream broke or that refused in this dispatch.
        let mut avoid: Vec<String> = Vec::new();
        let mut attempt = 0;
        // The dispatch's remote prefill attempts, spent as lists are sent (a list sent
        // counts whole: a stream that broke does not say how much of it was walked).
        let mut prefills_left = self.settings.prefill_attempts;
        loop {
            attempt += 1;
            if attempt > 1 {
                // Each attempt has its own id: the route may lead back to the worker whose
                // stream just broke (its load poll got through again), and that worker may
                // still hold the first attempt until it sees the break; it refuses an id it
                // runs (`invalid_argument`, seen in the control-link-resets drill).
                req.request_id = format!("{}.{attempt}", d.request_id);
            }
            let route = self.route_pinned(&tokens, req.cache_salt, pin.as_ref(), &avoid)?;
            let decode = self.decode_entry(&route.decode)?;
            decode.inflight.fetch_add(1, Ordering::Relaxed);
            let inflight = Inflight { decode: decode.clone(), cached_tokens: route.cached_tokens };
            req.prefill = route.prefill;
            if !req.prefill.is_empty() {
                if prefills_left == 0 {
                    // Every attempt this dispatch had is spent: no further route.
                    return Err(Error::WorkerUnavailable(format!(
                        "decode worker {}: refused or unreachable, and the request's {} prefill attempts are spent",
                        route.decode, self.settings.prefill_attempts
                    )));
                }
                req.prefill.truncate(prefills_left);
                prefills_left -= req.prefill.len();
            }
            let placement = Placement {
                decode_id: route.decode_id,
                decode_addr: route.decode.clone(),
                version_group: route.version_group,
                determinism: route.determinism,
            };
            let mut client = decode.client.clone();
            let retry = attempt < MAX_DECODE_ATTEMPTS;
            match client.generate(req.clone()).await {
                Ok(stream) => {
                    // The first message is the first token, or a refusal. A worker that
                    // fenced itself (or began draining) after the last load poll refuses
                    // with RETRYABLE before doing anything; nothing reached the client, so
                    // another worker may take the request (seen in worker-etcd-cutoff).
                    let mut rest = stream.into_inner();
                    let first = rest.message().await;
                    if refused_at_start(&first) && retry {
                        tracing::warn!(worker = %route.decode, "decode worker refused (fenced or draining); routing again");
                        self.board.mark_not_ready(&route.decode);
                        metrics::decode_reroute("refused");
                        lost(&mut pin, &mut avoid, &route.decode);
                        continue;
                    }
                    // The stream broke before its first message (the connection was reset
                    // while the worker prefilled or loaded KV): still nothing reached the
                    // client, so another worker may take the request. The worker sees its
                    // stream end and cancels the request there, freeing its KV.
                    if let Err(s) = &first {
                        if transport_failure(s.code()) && retry {
                            tracing::warn!(worker = %route.decode, error = %s.message(), "decode worker stream broke before its first token; routing again");
                            self.board.mark_unreachable(&route.decode);
                            metrics::decode_reroute("stream_broken");
                            lost(&mut pin, &mut avoid, &route.decode);
                            continue;
                        }
                    }
                    let stream =
                        WorkerStream { first: Some(first), rest, placement, request_id: req.request_id.clone() };
                    return Ok((stream, inflight));
                }
                // The decode worker answers `Generate` at once and reports its own errors
                // in the stream, so an error here is the transport's: the worker is gone or
                // its connection broke before it answered (a SIGKILLed worker shows up as
                // Unavailable, Cancelled or Unknown "h2 protocol error", depending on timing).
                // Nothing reached the client yet, so another worker may take the request.
                Err(s) if transport_failure(s.code()) && retry => {
                    tracing::warn!(worker = %route.decode, error = %s.message(), "decode worker unreachable; routing again");
                    self.board.mark_unreachable(&route.decode);
                    metrics::decode_reroute("unreachable");
                    lost(&mut pin, &mut avoid, &route.decode);
                }
                Err(s) => {
                    return Err(Error::WorkerUnavailable(format!("decode worker {}: {}", route.decode, s.message())))
                }
            }
        }
    }

    /// Whether `addr`'s load reports have gone stale (no Health answer for the
    /// board's max age): a frozen or cut-off worker, not a busy one.
    pub fn load_stale(&self, addr: &str) -> bool {
        self.board.read().stale(addr)
    }

    /// Tells decode worker `addr` to abort `request_id`, from a task of its own,
    /// again and again until it answers or `until` passes: a worker a request
    /// migrated away from because it froze may thaw and must not go on with it.
    pub fn abort_later(self: &Arc<Self>, addr: &str, request_id: &str, until: tokio::time::Instant) {
        let Ok(decode) = self.decode_entry(addr) else { return };
        let (addr, id) = (addr.to_owned(), request_id.to_owned());
        tokio::spawn(async move {
            let mut wait = Duration::from_millis(250);
            loop {
                let mut client = decode.client.clone();
                let call = client.abort(proto::worker::v1::AbortRequest { request_id: id.clone() });
                if let Ok(Ok(r)) = tokio::time::timeout(Duration::from_secs(1), call).await {
                    tracing::info!(worker = %addr, request = %id, found = r.into_inner().found, "told a decode worker a request moved away");
                    return;
                }
                if tokio::time::Instant::now() + wait >= until {
                    return;
                }
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(4));
            }
        });
    }
}

/// A dispatch lost decode worker `addr` (its stream broke, or it refused): a
/// continuation's pin never goes there again, and any request avoids it while another
/// worker can serve (`avoid`, see `Cluster::route_pinned`).
fn lost(pin: &mut Option<Pin>, avoid: &mut Vec<String>, addr: &str) {
    if let Some(p) = pin {
        p.exclude.push(addr.to_owned());
    }
    avoid.push(addr.to_owned());
}

/// The bytes of a hex string (a fingerprint); empty for anything that is not hex.
fn hex_bytes(hex: &str) -> Vec<u8> {
    let b = hex.as_bytes();
    if b.len() % 2 != 0 {
        return Vec::new();
    }
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    b.chunks(2).map(|p| Some(digit(p[0])? << 4 | digit(p[1])?)).collect::<Option<Vec<u8>>>().unwrap_or_default()
}

/// Decode workers tried for one request when the first cannot be reached.
const MAX_DECODE_ATTEMPTS: u32 = 2;

/// A `Generate` call failed in the transport, before the worker answered.
fn transport_failure(code: tonic::Code) -> bool {
    matches!(code, tonic::Code::Unavailable | tonic::Code::Cancelled | tonic::Code::Unknown)
}

/// What one step of a worker stream means to the frontend.
pub enum Step {
    Token(proto::worker::v1::TokenChunk),
    Finished(proto::worker::v1::Finished),
}

/// The next event of a worker stream; a worker's typed error comes with
/// `admission`'s drain estimate (when a retry may help). Remote prefill
/// attempts it reports go to `cluster`'s breakers.
pub async fn next(stream: &mut WorkerStream, cluster: &Cluster, admission: &Admission) -> Result<Step, Error> {
    let msg =
        stream.message().await.map_err(|s| Error::WorkerStream(format!("decode worker stream: {}", s.message())))?;
    if let Some(m) = &msg {
        let p = &stream.placement;
        cluster.record_prefill_attempts(&p.decode_id, &p.decode_addr, &m.prefill_attempts);
    }
    match msg.and_then(|m| m.event) {
        Some(generate_response::Event::Token(t)) => Ok(Step::Token(t)),
        Some(generate_response::Event::Finished(f)) => Ok(Step::Finished(f)),
        Some(generate_response::Event::Error(e)) => {
            Err(Error::Worker { kind: e.kind(), message: e.message, drain: admission.drain_estimate() })
        }
        None => Err(Error::WorkerStream("decode worker stream ended without a result".into())),
    }
}

#[cfg(test)]
mod tests;
