//! One simulated worker: the gRPC service a real prefill or decode worker serves, with
//! the engine replaced by a model of its step times. What a coordinator sees of it is
//! what it sees of a real worker: a registration under a lease, `Health` with load, the
//! real prefix set (the engine's chained block hashes) on a `WatchPrefixes` stream of
//! changes (and in `Health` reports to a caller that does not watch), and streams of
//! tokens at a modelled pace.
//!
//! Not simulated: KV bytes. A simulated decode worker asks a simulated prefill worker to
//! prefill (the `Prefill` call, its time and its prefix cache) but no KV crosses; the
//! tokens are made up (a pure function of the prompt and the index), never a model's.

use std::collections::{HashMap, HashSet, VecDeque};
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use proto::worker::v1::decode_worker_server::DecodeWorker;
use proto::worker::v1::prefill_worker_client::PrefillWorkerClient;
use proto::worker::v1::prefill_worker_server::PrefillWorker;
use proto::worker::v1::{
    generate_response, prefill_response, AbortRequest, AbortResponse, FinishReason, Finished, FirstToken,
    GenerateRequest, GenerateResponse, HealthRequest, HealthResponse, KvDestination, PrefillAttempt, PrefillRequest,
    PrefillResponse, PrefillState, PrefillStatusRequest, PrefillStatusResponse, PrefixReport, TokenChunk,
    WatchPrefixesRequest, WatchedLoad,
};
use registry::Role;
use tokio::sync::{mpsc, Semaphore};
use worker_common::prefix_feed::{Feed, Updates};
// When a prefix set changed, for freshness: on tokio's clock as every other.
use tokio::time::Instant;
use tonic::{Request, Response, Status};

/// Most prefix hashes a worker reports, as a real one does.
pub const MAX_REPORTED: usize = 8_192;

/// How long a simulated worker takes, modelled on the engine's measured figures on a
/// 2-core machine (FACTS: prefill ~790 prompt tokens/s, decode ~180 tokens/s for one
/// sequence at 2 threads), with a batch's step growing slowly with its size.
#[derive(Debug, Clone, Copy)]
pub struct StepModel {
    /// Per prompt token not held in the prefix cache.
    pub prefill_per_token: Duration,
    /// One decode step of a single sequence.
    pub decode_step: Duration,
    /// Added to a step per other sequence running on the worker.
    pub decode_step_per_sequence: Duration,
}

impl Default for StepModel {
    fn default() -> Self {
        Self {
            prefill_per_token: Duration::from_micros(1_270),
            decode_step: Duration::from_micros(5_500),
            decode_step_per_sequence: Duration::from_micros(400),
        }
    }
}

impl StepModel {
    fn step(&self, running: u32) -> Duration {
        self.decode_step + self.decode_step_per_sequence * running.saturating_sub(1)
    }
}

/// What every simulated worker of one process shares.
#[derive(Debug)]
pub struct Shape {
    pub version_group: String,
    pub block_size: usize,
    pub kv_blocks: u32,
    pub max_running: u32,
    pub model: StepModel,
    /// The coordinators' `--prefix-affinity`, for the oracle's scoring.
    pub affinity: f64,
    pub counters: Counters,
    /// Every worker of the process, for the oracle ([`Counters::oracle_tokens`]).
    pub peers: Mutex<Vec<Weak<SimWorker>>>,
}

/// Upper bounds (ms) of the freshness buckets; the last catches the rest.
pub const FRESHNESS_MS: [f64; 19] = [
    1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 75.0, 100.0, 150.0, 200.0, 250.0, 300.0, 400.0, 500.0, 750.0, 1e3, 2.5e3, 5e3, 1e9,
];

/// What all of a process's simulated workers answered (`tandem sim --stats-every-s`).
#[derive(Debug, Default)]
pub struct Counters {
    pub health: AtomicU64,
    /// Prefix hashes sent in Health answers and on watch streams (8 bytes each on the wire).
    pub prefix_hashes: AtomicU64,
    /// Watch messages that carried the worker's load (about 16 bytes each on the wire).
    pub load_updates: AtomicU64,
    pub generate: AtomicU64,
    pub prefill: AtomicU64,
    /// Prompt tokens prefilled, those the prefilling worker held cached, those held by
    /// the worker of its role in this process an oracle would have chosen (the router's
    /// own scoring — load traded against the held share of the prompt — with perfect and
    /// instant information, [`SimWorker::oracle`]), and the most any of them held (where
    /// a router ignoring load would send it).
    pub prompt_tokens: AtomicU64,
    pub hit_tokens: AtomicU64,
    pub oracle_tokens: AtomicU64,
    pub best_tokens: AtomicU64,
    /// Freshness: from a worker's prefix set changing to the change going out on a watch
    /// stream (or in a Health answer to a caller that held the set before it), by
    /// [`FRESHNESS_MS`] bucket.
    pub freshness: [AtomicU64; FRESHNESS_MS.len()],
}

impl Counters {
    pub fn json(&self) -> serde_json::Value {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        serde_json::json!({
            "health": get(&self.health),
            "prefix_hashes": get(&self.prefix_hashes),
            "load_updates": get(&self.load_updates),
            "generate": get(&self.generate),
            "prefill": get(&self.prefill),
            "prompt_tokens": get(&self.prompt_tokens),
            "hit_tokens": get(&self.hit_tokens),
            "oracle_tokens": get(&self.oracle_tokens),
            "best_tokens": get(&self.best_tokens),
            // Cumulative, as Prometheus buckets are.
            "freshness_ms": FRESHNESS_MS
                .iter()
                .zip(&self.freshness)
                .scan(0, |sum, (le, c)| {
                    *sum += get(c);
                    Some((*le, *sum))
                })
                .collect::<Vec<_>>(),
        })
    }

    fn fresh(&self, d: Duration) {
        let ms = d.as_secs_f64() * 1e3;
        let i = FRESHNESS_MS.iter().position(|&le| ms <= le).unwrap_or(FRESHNESS_MS.len() - 1);
        self.freshness[i].fetch_add(1, Ordering::Relaxed);
    }
}

/// The blocks a worker's pool indexes, most recently used last, at most `cap`.
#[derive(Debug, Default)]
struct PrefixSet {
    /// Hash → the tick it was last used at.
    used: HashMap<u64, u64>,
    tick: u64,
    /// Changes whenever the set does; never 0.
    epoch: u64,
    /// The last epochs and when each began, newest last (at most [`CHANGES_KEPT`]).
    changes: VecDeque<(u64, Instant)>,
}

const CHANGES_KEPT: usize = 1_024;

impl PrefixSet {
    /// Leading hashes of `chain` the set holds.
    fn held(&self, chain: &[u64]) -> usize {
        chain.iter().take_while(|h| self.used.contains_key(h)).count()
    }

    /// Marks `chain` used now, adding what is new and evicting the least recently used
    /// beyond `cap`; the hashes added and evicted.
    fn touch(&mut self, chain: &[u64], cap: usize) -> (Vec<u64>, Vec<u64>) {
        let (mut added, mut removed) = (Vec::new(), Vec::new());
        for &h in chain {
            self.tick += 1;
            if self.used.insert(h, self.tick).is_none() {
                added.push(h);
            }
        }
        while self.used.len() > cap {
            let Some((&oldest, _)) = self.used.iter().min_by_key(|(_, &t)| t) else { break };
            self.used.remove(&oldest);
            // One added by this very call (a chain longer than the cap) was never announced.
            match added.iter().position(|&h| h == oldest) {
                Some(i) => {
                    added.swap_remove(i);
                }
                None => removed.push(oldest),
            }
        }
        if !added.is_empty() || !removed.is_empty() {
            self.epoch = self.epoch.wrapping_add(1).max(1);
            if self.changes.len() == CHANGES_KEPT {
                self.changes.pop_front();
            }
            self.changes.push_back((self.epoch, Instant::now()));
        }
        (added, removed)
    }

    /// When the set first changed after epoch `known` (`None`: `known` is not one it
    /// had lately, e.g. 0 from a caller that held nothing).
    fn changed_after(&self, known: u64) -> Option<Instant> {
        let i = self.changes.iter().position(|&(e, _)| e == known)?;
        self.changes.get(i + 1).map(|&(_, at)| at)
    }

    /// The report: the most recently used first.
    fn report(&self, block_size: usize) -> PrefixReport {
        let mut by_use: Vec<(u64, u64)> = self.used.iter().map(|(&h, &t)| (t, h)).collect();
        by_use.sort_unstable_by(|a, b| b.cmp(a));
        PrefixReport { block_size: block_size as u32, hashes: by_use.into_iter().map(|(_, h)| h).collect() }
    }
}

/// One simulated worker's state.
pub struct SimWorker {
    role: Role,
    shape: Arc<Shape>,
    prefixes: Mutex<PrefixSet>,
    /// The set's changes for `WatchPrefixes`, fed under the set's lock (so in its order).
    feed: Feed,
    running: AtomicU32,
    waiting: AtomicU32,
    kv_used: AtomicU32,
    slots: Semaphore,
    /// Prefill workers by address, connected lazily (a decode worker's).
    prefill_clients: Mutex<HashMap<String, PrefillWorkerClient<tonic::transport::Channel>>>,
    /// Request ids being prefilled here (a prefill worker's), for `PrefillStatus`.
    prefilling: Mutex<HashSet<String>>,
}

/// The fixed fingerprints every simulated worker reports: simulated workers pair with
/// each other (one layout, one determinism class) and never with real ones.
pub fn layout_fingerprint() -> [u8; 32] {
    fingerprint(b"tandem-sim layout v1")
}

pub fn determinism_fingerprint() -> [u8; 32] {
    fingerprint(b"tandem-sim determinism v1")
}

fn fingerprint(label: &[u8]) -> [u8; 32] {
    // A fixed, recognisable pattern; the coordinator only compares fingerprints.
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = label[i % label.len()] ^ (i as u8).wrapping_mul(0x9d);
    }
    out
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Decrements one of a worker's load counters when dropped (a sequence's slot, whatever
/// ends it), and tells the worker's watchers, as [`SimWorker::hold`] did when it
/// counted.
struct Held<'a> {
    worker: &'a SimWorker,
    counter: &'a AtomicU32,
    n: u32,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.counter.fetch_sub(self.n, Ordering::Relaxed);
        self.worker.push_load();
    }
}

/// A made-up token: a pure function of the prompt and the index, in a range of ordinary
/// vocabulary ids (no special token), so the coordinator detokenizes it as text.
fn token(prompt: &[u32], index: u32) -> u32 {
    let h = fnv1a(prompt.iter().chain(std::iter::once(&index)).map(|&t| u64::from(t)));
    1_000 + (h % 20_000) as u32
}

/// FNV-1a (64 bits) over `items`, one step each: made-up tokens and epoch seeds.
fn fnv1a(items: impl Iterator<Item = u64>) -> u64 {
    items.fold(0xcbf2_9ce4_8422_2325, |h, x| (h ^ x).wrapping_mul(0x0000_0100_0000_01b3))
}

impl SimWorker {
    /// Worker `id`'s state: its prefix epoch starts from a number no other worker and no
    /// earlier run of this one had, as a real worker's does.
    pub fn new(id: &str, role: Role, shape: Arc<Shape>) -> Self {
        let start = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        let epoch = (start.as_nanos() as u64 ^ fnv1a(id.bytes().map(u64::from))) | 1;
        let prefixes = PrefixSet { epoch, changes: VecDeque::from([(epoch, Instant::now())]), ..PrefixSet::default() };
        let s = shape.clone();
        let feed = Feed::new(Some(Arc::new(move |hashes: usize, age: Option<Duration>, load: bool| {
            s.counters.prefix_hashes.fetch_add(hashes as u64, Ordering::Relaxed);
            s.counters.load_updates.fetch_add(u64::from(load), Ordering::Relaxed);
            if let Some(age) = age {
                s.counters.fresh(age);
            }
        })));
        Self {
            role,
            feed,
            slots: Semaphore::new(shape.max_running as usize),
            shape,
            prefixes: Mutex::new(prefixes),
            running: AtomicU32::new(0),
            waiting: AtomicU32::new(0),
            kv_used: AtomicU32::new(0),
            prefill_clients: Mutex::new(HashMap::new()),
            prefilling: Mutex::new(HashSet::new()),
        }
    }

    /// Counts `n` in one of this worker's load counters until the guard drops.
    fn hold<'a>(&'a self, counter: &'a AtomicU32, n: u32) -> Held<'a> {
        counter.fetch_add(n, Ordering::Relaxed);
        self.push_load();
        Held { worker: self, counter, n }
    }

    /// The load now, to the watch streams when it moved enough (as a real worker's
    /// ticker sends it).
    fn push_load(&self) {
        self.feed.observe_load(|| WatchedLoad {
            running: self.running.load(Ordering::Relaxed),
            waiting: self.waiting.load(Ordering::Relaxed),
            kv_blocks_used: self.kv_used.load(Ordering::Relaxed).min(self.shape.kv_blocks),
            kv_blocks_total: self.shape.kv_blocks,
        });
    }

    fn chain(&self, tokens: &[u32], salt: u64) -> Vec<u64> {
        engine::kv::prefix_hashes(tokens, self.shape.block_size, salt)
    }

    /// Marks `chain` used in this worker's set and tells the watchers what changed.
    fn touch(&self, chain: &[u64]) {
        let mut p = self.prefixes.lock().unwrap_or_else(|e| e.into_inner());
        let (added, removed) = p.touch(chain, MAX_REPORTED);
        self.feed.apply(added, removed);
    }

    fn health(&self, asked: &HealthRequest) -> HealthResponse {
        let p = self.prefixes.lock().unwrap_or_else(|e| e.into_inner());
        let mut h = HealthResponse {
            live: true,
            ready: true,
            version_group: self.shape.version_group.clone(),
            layout_fingerprint: layout_fingerprint().to_vec(),
            determinism_fingerprint: determinism_fingerprint().to_vec(),
            kv_blocks_total: self.shape.kv_blocks,
            kv_blocks_used: self.kv_used.load(Ordering::Relaxed).min(self.shape.kv_blocks),
            running: self.running.load(Ordering::Relaxed),
            waiting: self.waiting.load(Ordering::Relaxed),
            prefix_epoch: p.epoch,
            ..HealthResponse::default()
        };
        if asked.prefix_epoch != p.epoch && !asked.prefix_watched {
            if let Some(at) = p.changed_after(asked.prefix_epoch) {
                self.shape.counters.fresh(at.elapsed());
            }
            let report = p.report(self.shape.block_size);
            self.shape.counters.prefix_hashes.fetch_add(report.hashes.len() as u64, Ordering::Relaxed);
            h.prefix = Some(report);
        }
        self.shape.counters.health.fetch_add(1, Ordering::Relaxed);
        h
    }

    /// Prefills `tokens` here: waits the modelled time for the blocks not cached, then
    /// caches them. The prompt tokens that were cached.
    async fn prefill_here(&self, tokens: &[u32], salt: u64) -> u32 {
        let chain = self.chain(tokens, salt);
        let cached = self.prefixes.lock().unwrap_or_else(|e| e.into_inner()).held(&chain) * self.shape.block_size;
        let (oracle, best) = self.oracle(&chain, tokens.len());
        let c = &self.shape.counters;
        c.prompt_tokens.fetch_add(tokens.len() as u64, Ordering::Relaxed);
        c.hit_tokens.fetch_add(cached as u64, Ordering::Relaxed);
        c.oracle_tokens.fetch_add(oracle as u64, Ordering::Relaxed);
        c.best_tokens.fetch_add(best.max(cached) as u64, Ordering::Relaxed);
        let todo = tokens.len().saturating_sub(cached) as u32;
        tokio::time::sleep(self.shape.model.prefill_per_token * todo).await;
        self.touch(&chain);
        cached as u32
    }

    /// Among this process's workers of this one's role, for a prompt of `len` tokens
    /// hashed to `chain`: the cached tokens of the one the router's scoring picks with
    /// perfect and instant information (decode: queue / max_running + used KV fraction -
    /// affinity x held share; prefill: queue - affinity x held share; the lowest wins,
    /// the longer prefix on a tie), and the most cached tokens any of them holds. This
    /// worker's queue counts the request being judged: it is taken off.
    fn oracle(&self, chain: &[u64], len: usize) -> (usize, usize) {
        let (bs, shape) = (self.shape.block_size, &self.shape);
        let peers = shape.peers.lock().unwrap_or_else(|e| e.into_inner());
        let mut best: Option<(f64, usize)> = None;
        let mut most = 0;
        for w in peers.iter().filter_map(Weak::upgrade).filter(|w| w.role == self.role) {
            let held = w.prefixes.lock().unwrap_or_else(|e| e.into_inner()).held(chain) * bs;
            let mut queue = w.running.load(Ordering::Relaxed) + w.waiting.load(Ordering::Relaxed);
            if std::ptr::eq(Arc::as_ptr(&w), self) {
                queue = queue.saturating_sub(1);
            }
            let bonus = shape.affinity * (held as f64 / len.max(1) as f64).min(1.0);
            let score = match self.role {
                Role::Decode => {
                    let kv = f64::from(w.kv_used.load(Ordering::Relaxed)) / f64::from(shape.kv_blocks.max(1));
                    f64::from(queue) / f64::from(shape.max_running.max(1)) + kv.min(1.0) - bonus
                }
                Role::Prefill => f64::from(queue) - bonus,
            };
            if best.is_none_or(|(s, h)| score < s || (score == s && held > h)) {
                best = Some((score, held));
            }
            most = most.max(held);
        }
        (best.map_or(0, |b| b.1), most)
    }

    fn prefill_client(&self, addr: &str) -> Result<PrefillWorkerClient<tonic::transport::Channel>, Status> {
        let mut m = self.prefill_clients.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = m.get(addr) {
            return Ok(c.clone());
        }
        let ep = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| Status::invalid_argument(format!("prefill address {addr}: {e}")))?;
        let c = PrefillWorkerClient::new(ep.connect_lazy());
        m.insert(addr.to_owned(), c.clone());
        Ok(c)
    }

    /// Runs one request to its end on `tx`.
    async fn generate(self: Arc<Self>, r: GenerateRequest, tx: mpsc::Sender<Result<GenerateResponse, Status>>) {
        self.shape.counters.generate.fetch_add(1, Ordering::Relaxed);
        let max_tokens = r.sampling.as_ref().map_or(16, |s| s.max_tokens.max(1));
        let waiting = self.hold(&self.waiting, 1);
        let Ok(_slot) = self.slots.acquire().await else { return };
        drop(waiting);
        let _running = self.hold(&self.running, 1);
        let blocks = (r.token_ids.len() + max_tokens as usize).div_ceil(self.shape.block_size) as u32;
        let _kv = self.hold(&self.kv_used, blocks);

        // Remote prefill on the first target that answers, else here.
        let mut attempts = Vec::new();
        let mut prefilled = None;
        for target in &r.prefill {
            let call = async {
                let mut c = self.prefill_client(&target.grpc_addr)?;
                let req = PrefillRequest {
                    request_id: r.request_id.clone(),
                    token_ids: r.token_ids.clone(),
                    sampling: r.sampling.clone(),
                    deadline_unix_ms: r.deadline_unix_ms,
                    destination: Some(KvDestination {
                        transfer_addr: "sim".into(),
                        transport: "tcp".into(),
                        layout_fingerprint: layout_fingerprint().to_vec(),
                        version_group: self.shape.version_group.clone(),
                        ..KvDestination::default()
                    }),
                    cache_salt: r.cache_salt,
                    priority: r.priority,
                    ..PrefillRequest::default()
                };
                c.prefill(req).await.map(Response::into_inner)
            };
            match call.await.map(|p| p.outcome) {
                Ok(Some(prefill_response::Outcome::FirstToken(f))) => {
                    attempts.push(PrefillAttempt { target: Some(target.clone()), ..PrefillAttempt::default() });
                    prefilled = Some(f.cached_prompt_tokens);
                    break;
                }
                Ok(other) => attempts.push(PrefillAttempt {
                    target: Some(target.clone()),
                    error: match other {
                        Some(prefill_response::Outcome::Error(e)) => Some(e),
                        _ => None,
                    },
                    reason: "prefill_error".into(),
                }),
                Err(_) => {
                    attempts.push(PrefillAttempt { target: Some(target.clone()), error: None, reason: "rpc".into() })
                }
            }
        }
        let remote = prefilled.is_some();
        let cached = match prefilled {
            Some(c) => {
                // The KV "arrived": this worker holds the prompt's blocks now.
                let chain = self.chain(&r.token_ids, r.cache_salt);
                self.touch(&chain);
                c
            }
            None => self.prefill_here(&r.token_ids, r.cache_salt).await,
        };

        for i in 0..max_tokens {
            if i > 0 {
                tokio::time::sleep(self.shape.model.step(self.running.load(Ordering::Relaxed))).await;
            }
            let chunk = TokenChunk { id: token(&r.token_ids, i), index: Some(i), ..TokenChunk::default() };
            let msg = GenerateResponse {
                event: Some(generate_response::Event::Token(chunk)),
                prefill_attempts: if i == 0 { std::mem::take(&mut attempts) } else { Vec::new() },
            };
            if tx.send(Ok(msg)).await.is_err() {
                return; // the caller went away: the request is cancelled
            }
        }
        let finished = Finished {
            reason: FinishReason::Length as i32,
            prompt_tokens: r.token_ids.len() as u32,
            generated_tokens: max_tokens,
            prefilled_remotely: remote,
            cached_prompt_tokens: cached,
            seed: r.sampling.as_ref().and_then(|s| s.seed).unwrap_or(0),
        };
        let _ = tx
            .send(Ok(GenerateResponse {
                event: Some(generate_response::Event::Finished(finished)),
                prefill_attempts: Vec::new(),
            }))
            .await;
    }
}

/// A simulated worker as the gRPC service of its role.
#[derive(Clone)]
pub struct Service(pub Arc<SimWorker>);

type Events = Pin<Box<dyn tokio_stream::Stream<Item = Result<GenerateResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DecodeWorker for Service {
    type GenerateStream = Events;

    async fn generate(&self, request: Request<GenerateRequest>) -> Result<Response<Events>, Status> {
        let r = request.into_inner();
        if r.token_ids.is_empty() {
            return Err(Status::invalid_argument("token_ids is empty"));
        }
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(self.0.clone().generate(r, tx));
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx)) as Events))
    }

    /// Not tracked: a simulated request ends when its caller drops the stream.
    async fn abort(&self, _: Request<AbortRequest>) -> Result<Response<AbortResponse>, Status> {
        Ok(Response::new(AbortResponse { found: false }))
    }

    async fn health(&self, request: Request<HealthRequest>) -> Result<Response<HealthResponse>, Status> {
        Ok(Response::new(self.0.health(&request.into_inner())))
    }

    type WatchPrefixesStream = Updates;

    async fn watch_prefixes(&self, _: Request<WatchPrefixesRequest>) -> Result<Response<Updates>, Status> {
        self.0.push_load();
        Ok(Response::new(self.0.feed.watch(self.0.shape.block_size as u32)))
    }
}

#[tonic::async_trait]
impl PrefillWorker for Service {
    async fn prefill(&self, request: Request<PrefillRequest>) -> Result<Response<PrefillResponse>, Status> {
        let r = request.into_inner();
        if r.token_ids.is_empty() {
            return Err(Status::invalid_argument("token_ids is empty"));
        }
        let w = &self.0;
        w.shape.counters.prefill.fetch_add(1, Ordering::Relaxed);
        let waiting = w.hold(&w.waiting, 1);
        let _slot = w.slots.acquire().await.map_err(|_| Status::unavailable("shutting down"))?;
        drop(waiting);
        let _running = w.hold(&w.running, 1);
        w.prefilling.lock().unwrap_or_else(|e| e.into_inner()).insert(r.request_id.clone());
        let cached = w.prefill_here(&r.token_ids, r.cache_salt).await;
        w.prefilling.lock().unwrap_or_else(|e| e.into_inner()).remove(&r.request_id);
        let first = FirstToken { id: token(&r.token_ids, 0), cached_prompt_tokens: cached, ..FirstToken::default() };
        Ok(Response::new(PrefillResponse { outcome: Some(prefill_response::Outcome::FirstToken(first)) }))
    }

    async fn abort(&self, _: Request<AbortRequest>) -> Result<Response<AbortResponse>, Status> {
        Ok(Response::new(AbortResponse { found: false }))
    }

    async fn health(&self, request: Request<HealthRequest>) -> Result<Response<HealthResponse>, Status> {
        Ok(Response::new(self.0.health(&request.into_inner())))
    }

    type WatchPrefixesStream = Updates;

    async fn watch_prefixes(&self, _: Request<WatchPrefixesRequest>) -> Result<Response<Updates>, Status> {
        self.0.push_load();
        Ok(Response::new(self.0.feed.watch(self.0.shape.block_size as u32)))
    }

    async fn prefill_status(
        &self,
        request: Request<PrefillStatusRequest>,
    ) -> Result<Response<PrefillStatusResponse>, Status> {
        let id = request.into_inner().request_id;
        let here = self.0.prefilling.lock().unwrap_or_else(|e| e.into_inner()).contains(&id);
        let state = if here { PrefillState::Running } else { PrefillState::Unknown };
        Ok(Response::new(PrefillStatusResponse { state: state as i32 }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefix_set_reports_recent_blocks_first_and_changes_its_epoch_with_the_set() {
        let mut p = PrefixSet { epoch: 5, ..PrefixSet::default() };
        assert_eq!(p.touch(&[1, 2, 3], 4), (vec![1, 2, 3], vec![]));
        let e1 = p.epoch;
        assert_ne!(e1, 5);
        assert_eq!(p.held(&[1, 2, 9, 3]), 2, "leading blocks only");
        p.touch(&[1, 2], 4);
        assert_eq!(p.epoch, e1, "nothing new, nothing evicted: the same epoch");
        assert_eq!(p.touch(&[7, 8], 4), (vec![7, 8], vec![3]), "what the watchers are told");
        assert_eq!(p.used.len(), 4, "capped");
        assert!(!p.used.contains_key(&3), "the least recently used went first");
        assert_eq!(p.report(16).hashes, [8, 7, 2, 1]);
        assert_eq!(p.report(16).block_size, 16);
    }

    #[test]
    fn a_change_is_dated_from_the_epoch_a_caller_held_and_freshness_is_bucketed() {
        let mut p = PrefixSet { epoch: 5, changes: VecDeque::from([(5, Instant::now())]), ..PrefixSet::default() };
        assert_eq!(p.changed_after(5), None, "nothing changed since");
        p.touch(&[1], 8);
        let first = p.changes.back().map(|c| c.1);
        p.touch(&[2], 8);
        assert_eq!(p.changed_after(5), first, "the first change after what the caller held");
        assert_eq!(p.changed_after(0), None, "a caller that held nothing gives no sample");
        let c = Counters::default();
        c.fresh(Duration::from_millis(3));
        c.fresh(Duration::from_millis(300));
        c.fresh(Duration::from_secs(3600));
        let f = c.json()["freshness_ms"].clone();
        assert_eq!(f[2], serde_json::json!([5.0, 1]), "3 ms in the 5 ms bucket: {f}");
        assert_eq!(f[11], serde_json::json!([300.0, 2]), "cumulative: {f}");
        assert_eq!(f[18], serde_json::json!([1e9, 3]), "the last bucket catches the rest: {f}");
    }

    #[test]
    fn steps_grow_with_the_batch_and_tokens_are_ordinary_ids() {
        let m = StepModel::default();
        assert!(m.step(8) > m.step(1) && m.step(0) == m.step(1));
        let t: Vec<u32> = (0..100).map(|i| token(&[1, 2, 3], i)).collect();
        assert!(t.iter().all(|&t| (1_000..21_000).contains(&t)));
        assert_eq!(t, (0..100).map(|i| token(&[1, 2, 3], i)).collect::<Vec<_>>(), "a pure function");
        assert_ne!(layout_fingerprint(), determinism_fingerprint());
    }
}
