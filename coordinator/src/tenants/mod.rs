//! Tenants: who is calling ([`crate::auth`]'s API keys, mapped to a tenant
//! by the tenants file) and what each tenant may use, checked before any
//! work is spent on a request.
//!
//! A request passes the [`Tenancy`] in order of cost, cheapest first:
//! [`Tenancy::enter`] (API key, then the tenant's requests in flight and its
//! requests-per-second bucket: no body read yet), then on the parsed body
//! [`Pass::check_max_tokens`] (the cap), [`Pass::open_stream`] (streams
//! open), [`Pass::charge_output`] (the output-token bucket, charged with
//! `max_tokens`) and [`Pass::check_prompt_budget`] (the prompt-token bucket
//! not in debt) — all before the prompt is tokenized — and after
//! tokenizing [`Pass::charge_prompt`] (the prompt cap and the prompt-token
//! bucket). The [`Pass`] lives as long as the request: dropping it ends
//! the request's in-flight and stream counts, and gives back the output
//! tokens it was charged and did not generate.
//!
//! Every limit is a budget for the whole fleet of coordinators. Each
//! coordinator enforces `budget / n`, where `n` is [`Split`]: the live
//! coordinators as etcd last said ([`crate::fleet`]), or a configured
//! count. Rates are split exactly; in-flight and stream caps as
//! `max(1, cap / n)`, so each coordinator can always admit one (the fleet
//! may then hold up to `max(cap, n)`). docs/ARCHITECTURE.md has the error
//! bounds during membership changes.
//!
//! The tenants file is reloaded on SIGHUP and when it changes
//! ([`Tenancy::reload`]); a file that does not validate is refused with the
//! reason (log and metric) and the one in force stays. Without a file,
//! every caller belongs to one built-in tenant, [`DEFAULT_TENANT`], with
//! [`Limits::default`].
//!
//! Must not: hold a lock across an `await`, or let a caller's key reach a
//! log or metric (tenant names only).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Duration;

use axum::http::HeaderMap;
use tokio::time::Instant;

use crate::auth::ApiKeys;
use crate::error::Error;
use crate::metrics;

mod bucket;
mod config;

pub use bucket::{retry_after_secs, Bucket, Refill};
pub use config::{CacheScope, Limits, Tenant, TenantsError, TenantsFile, DEFAULT_TENANT};

/// The limit a tenant is over: each has its own error code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TenantLimit {
    Requests,
    PromptTokens,
    OutputTokens,
    InFlight,
    Streams,
    /// The tenant's share of the cluster's KV cache ([`Pass::hold_kv`]).
    KvShare,
}

impl TenantLimit {
    pub const ALL: [TenantLimit; 6] = [
        TenantLimit::Requests,
        TenantLimit::PromptTokens,
        TenantLimit::OutputTokens,
        TenantLimit::InFlight,
        TenantLimit::Streams,
        TenantLimit::KvShare,
    ];

    /// The OpenAI error `code` (README's error table).
    pub fn code(self) -> &'static str {
        match self {
            TenantLimit::Requests => "rate_limit_requests",
            TenantLimit::PromptTokens => "rate_limit_prompt_tokens",
            TenantLimit::OutputTokens => "rate_limit_output_tokens",
            TenantLimit::InFlight => "too_many_in_flight",
            TenantLimit::Streams => "too_many_streams",
            TenantLimit::KvShare => "kv_share",
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            TenantLimit::Requests => "requests per second",
            TenantLimit::PromptTokens => "prompt tokens per minute",
            TenantLimit::OutputTokens => "output tokens per minute",
            TenantLimit::InFlight => "requests in flight",
            TenantLimit::Streams => "concurrent streams",
            TenantLimit::KvShare => "share of the cluster's KV cache",
        }
    }

    /// A bucket that refills (so a Retry-After can be computed), not a count.
    pub fn is_rate(self) -> bool {
        matches!(self, TenantLimit::Requests | TenantLimit::PromptTokens | TenantLimit::OutputTokens)
    }
}

/// A per-request cap of a tenant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cap {
    /// `max_tokens` (400).
    MaxTokens,
    /// Prompt tokens (413).
    PromptTokens,
}

impl Cap {
    pub fn code(self) -> &'static str {
        match self {
            Cap::MaxTokens => "max_tokens_too_large",
            Cap::PromptTokens => "prompt_too_long",
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Cap::MaxTokens => "output tokens per request",
            Cap::PromptTokens => "prompt tokens per request",
        }
    }
}

/// How many coordinators share every tenant's budget; at least 1. Written
/// by [`crate::fleet`] as coordinators come and go, read per request.
#[derive(Debug)]
pub struct Split(AtomicUsize);

impl Split {
    pub fn new(n: usize) -> Arc<Self> {
        Arc::new(Self(AtomicUsize::new(n.max(1))))
    }

    pub fn get(&self) -> usize {
        self.0.load(Ordering::Relaxed).max(1)
    }

    pub fn set(&self, n: usize) {
        self.0.store(n.max(1), Ordering::Relaxed);
    }
}

/// The configuration in force: keys and tenants.
#[derive(Debug)]
struct Book {
    keys: ApiKeys,
    /// From the tenants file: a caller is its tenant.
    tenants: BTreeMap<String, Arc<Tenant>>,
    /// Without a file: every caller's tenant.
    builtin: Option<Arc<Tenant>>,
}

impl Book {
    fn tenant_of(&self, caller: &str) -> Option<Arc<Tenant>> {
        match &self.builtin {
            Some(t) => Some(t.clone()),
            None => self.tenants.get(caller).cloned(),
        }
    }
}

/// One tenant's counts and buckets on this coordinator.
#[derive(Debug)]
struct Usage {
    requests: Bucket,
    prompt: Bucket,
    output: Bucket,
    in_flight: u32,
    streams: u32,
    /// KV tokens its admitted requests may hold ([`Pass::hold_kv`]).
    kv_tokens: u64,
}

/// This coordinator's share of a tenant's limits, for a split of `n`.
#[derive(Debug, Clone, Copy)]
struct Share {
    requests: Refill,
    prompt: Refill,
    output: Refill,
    in_flight: u32,
    streams: u32,
}

/// The smallest request bucket, in requests. One token would lose the
/// refill that accrues while a full bucket waits for the next request: a
/// tenant sending Poisson arrivals at k times its share gets k/(k+1) of it
/// (91% at 10x, half at 1x). With two, a full-then-waiting bucket is rare
/// under any real excess, at the price of a fleet burst of 2n requests.
pub const MIN_REQUEST_BURST: f64 = 2.0;

impl Share {
    fn of(l: &Limits, n: usize) -> Self {
        let n = n.max(1) as f64;
        let per_min = |v: u64| Refill { capacity: (v as f64 / n).max(1.0), per_s: v as f64 / n / 60.0 };
        let count = |v: u32| ((f64::from(v) / n).floor() as u32).max(1);
        Self {
            requests: Refill { capacity: (l.requests_per_s / n).max(MIN_REQUEST_BURST), per_s: l.requests_per_s / n },
            prompt: per_min(l.prompt_tokens_per_min),
            output: per_min(l.output_tokens_per_min),
            in_flight: count(l.max_in_flight),
            streams: count(l.max_streams),
        }
    }
}

/// The tenants and their usage. Share it as `Arc<Tenancy>`.
pub struct Tenancy {
    book: RwLock<Arc<Book>>,
    usage: Mutex<HashMap<String, Usage>>,
    split: Arc<Split>,
    /// The tenants file, when one is used.
    path: Option<PathBuf>,
}

impl std::fmt::Debug for Tenancy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tenancy").field("path", &self.path).field("split", &self.split.get()).finish()
    }
}

impl Tenancy {
    /// No tenants file: every caller (per `keys`) is in the built-in tenant.
    pub fn builtin(keys: ApiKeys, tenant: Tenant, split: Arc<Split>) -> Arc<Self> {
        let book = Book { keys, tenants: BTreeMap::new(), builtin: Some(Arc::new(tenant)) };
        Arc::new(Self { book: RwLock::new(Arc::new(book)), usage: Mutex::default(), split, path: None })
    }

    /// Tenants and keys from `path` (see [`TenantsFile`]).
    pub fn from_file(path: &Path, split: Arc<Split>) -> Result<Arc<Self>, TenantsError> {
        let file = TenantsFile::load(path)?;
        let gate = Arc::new(Self {
            book: RwLock::new(Arc::new(book_of(file))),
            usage: Mutex::default(),
            split,
            path: Some(path.to_owned()),
        });
        metrics::tenants_loaded(gate.tenant_count());
        Ok(gate)
    }

    /// The tenants file, if one is used.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// The split in force.
    pub fn split(&self) -> &Arc<Split> {
        &self.split
    }

    fn book(&self) -> Arc<Book> {
        self.book.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn usage(&self) -> MutexGuard<'_, HashMap<String, Usage>> {
        self.usage.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// How many tenants are configured (1 without a file).
    pub fn tenant_count(&self) -> usize {
        let b = self.book();
        b.tenants.len() + usize::from(b.builtin.is_some())
    }

    /// A tenant by name (tests and diagnostics).
    pub fn tenant(&self, name: &str) -> Option<Arc<Tenant>> {
        let b = self.book();
        match &b.builtin {
            Some(t) if t.name == name => Some(t.clone()),
            _ => b.tenants.get(name).cloned(),
        }
    }

    /// Reads the tenants file again. A file that does not validate changes
    /// nothing (the error says why); a valid one takes effect for every
    /// request that enters from now on, and a removed key is refused at
    /// once. Requests already admitted run on under the limits they passed.
    pub fn reload(&self) -> Result<usize, TenantsError> {
        let Some(path) = &self.path else { return Ok(self.tenant_count()) };
        match TenantsFile::load(path) {
            Ok(file) => {
                let n = file.tenants.len();
                let book = book_of(file);
                // Usage of a tenant that is gone is dropped once nothing of it runs.
                self.usage().retain(|name, u| book.tenants.contains_key(name) || u.in_flight > 0);
                *self.book.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(book);
                metrics::tenants_reload("applied");
                metrics::tenants_loaded(n);
                tracing::info!(path = %path.display(), tenants = n, "tenants file reloaded");
                Ok(n)
            }
            Err(e) => {
                metrics::tenants_reload("refused");
                tracing::error!(error = %e, "tenants file refused; the previous one stays in force");
                Err(e)
            }
        }
    }

    /// The caller named by the request's API key (401 without a valid
    /// one), for routes that only need to know who calls.
    pub fn caller(&self, headers: &HeaderMap) -> Result<String, Error> {
        self.book().keys.check(headers)
    }

    /// The first, cheapest checks: the API key (401), then the tenant's
    /// requests in flight and its request rate (429). On success the
    /// request holds one of the tenant's in-flight places until the
    /// returned [`Pass`] is dropped.
    pub fn enter(self: &Arc<Self>, headers: &HeaderMap) -> Result<Pass, Error> {
        let book = self.book();
        let caller = book.keys.check(headers)?;
        // A key always names a tenant of the same book.
        let tenant = book.tenant_of(&caller).ok_or(Error::WrongApiKey)?;
        let checked = self.with_usage(&tenant, |u, share, now| -> Result<(), (TenantLimit, Option<Duration>)> {
            if u.in_flight >= share.in_flight {
                return Err((TenantLimit::InFlight, None));
            }
            u.requests.take(1.0, share.requests, now).map_err(|wait| (TenantLimit::Requests, Some(wait)))?;
            u.in_flight += 1;
            Ok(())
        });
        if let Err((limit, wait)) = checked {
            metrics::tenant_outcome(&tenant.name, limit.code());
            return Err(Error::TenantLimit { tenant: tenant.name.clone(), limit, wait });
        }
        Ok(Pass { gate: self.clone(), caller, tenant, stream: false, output_charged: 0, generated: 0, kv_tokens: 0 })
    }

    /// Runs `f` on the tenant's usage (created if it is new).
    fn with_usage<R>(&self, tenant: &Tenant, f: impl FnOnce(&mut Usage, Share, Instant) -> R) -> R {
        let share = Share::of(&tenant.limits, self.split.get());
        let now = Instant::now();
        let mut usage = self.usage();
        let u = usage.entry(tenant.name.clone()).or_insert_with(|| Usage {
            requests: Bucket::full(share.requests, now),
            prompt: Bucket::full(share.prompt, now),
            output: Bucket::full(share.output, now),
            in_flight: 0,
            streams: 0,
            kv_tokens: 0,
        });
        f(u, share, now)
    }

    /// (in flight, streams) of a tenant on this coordinator.
    pub fn counts(&self, tenant: &str) -> (u32, u32) {
        self.usage().get(tenant).map_or((0, 0), |u| (u.in_flight, u.streams))
    }

    /// KV tokens a tenant's requests hold on this coordinator ([`Pass::hold_kv`]).
    pub fn kv_held(&self, tenant: &str) -> u64 {
        self.usage().get(tenant).map_or(0, |u| u.kv_tokens)
    }
}

/// KV tokens one coordinator lets a tenant hold: its `share` of the
/// cluster's `cluster_tokens`, split between `n` coordinators.
pub fn kv_limit(share: f64, cluster_tokens: u64, n: usize) -> u64 {
    (share * cluster_tokens as f64 / n.max(1) as f64).floor() as u64
}

fn book_of(file: TenantsFile) -> Book {
    Book { keys: file.keys, tenants: file.tenants.into_iter().map(|(n, t)| (n, Arc::new(t))).collect(), builtin: None }
}

/// A request inside its tenant's limits, for as long as it lives.
pub struct Pass {
    gate: Arc<Tenancy>,
    caller: String,
    tenant: Arc<Tenant>,
    stream: bool,
    output_charged: u32,
    generated: u32,
    /// KV tokens this request holds against its tenant's share.
    kv_tokens: u64,
}

impl std::fmt::Debug for Pass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pass").field("caller", &self.caller).field("tenant", &self.tenant.name).finish()
    }
}

impl Pass {
    /// The caller's name (the key's name, or the tenant's with a tenants
    /// file): the queue's fairness key and the idempotency scope.
    pub fn caller(&self) -> &str {
        &self.caller
    }

    pub fn tenant(&self) -> &Tenant {
        &self.tenant
    }

    /// `max_tokens` when the request sets none: the tenant's default, else `fallback`.
    pub fn default_max_tokens(&self, fallback: u32) -> u32 {
        self.tenant.limits.default_max_tokens.unwrap_or(fallback).min(self.tenant.limits.max_tokens)
    }

    /// 400 `max_tokens_too_large` when `max_tokens` (named `param`) passes the tenant's cap.
    pub fn check_max_tokens(&self, param: &'static str, max_tokens: u32) -> Result<(), Error> {
        let cap = self.tenant.limits.max_tokens;
        if max_tokens > cap {
            metrics::tenant_outcome(&self.tenant.name, Cap::MaxTokens.code());
            return Err(Error::OverCap { param, what: Cap::MaxTokens, cap: cap.into(), got: max_tokens.into() });
        }
        Ok(())
    }

    /// Takes one of the tenant's stream places (429 `too_many_streams`),
    /// held until the pass is dropped.
    pub fn open_stream(&mut self) -> Result<(), Error> {
        if self.stream {
            return Ok(());
        }
        let tenant = self.tenant.clone();
        let ok = self.gate.with_usage(&tenant, |u, share, _| {
            if u.streams >= share.streams {
                return false;
            }
            u.streams += 1;
            true
        });
        if !ok {
            return Err(self.refused(TenantLimit::Streams, None));
        }
        self.stream = true;
        Ok(())
    }

    /// Charges `max_tokens` to the output-token bucket (429
    /// `rate_limit_output_tokens`); what the request does not generate is
    /// given back when the pass is dropped.
    pub fn charge_output(&mut self, max_tokens: u32) -> Result<(), Error> {
        let tenant = self.tenant.clone();
        let r = self.gate.with_usage(&tenant, |u, share, now| u.output.take(f64::from(max_tokens), share.output, now));
        match r {
            Ok(()) => {
                self.output_charged += max_tokens;
                Ok(())
            }
            Err(wait) => Err(self.refused(TenantLimit::OutputTokens, Some(wait))),
        }
    }

    /// 429 `rate_limit_prompt_tokens` when the prompt bucket is in debt:
    /// no prompt could pass, so it is not worth tokenizing.
    pub fn check_prompt_budget(&self) -> Result<(), Error> {
        let tenant = self.tenant.clone();
        match self.gate.with_usage(&tenant, |u, share, now| u.prompt.check(share.prompt, now)) {
            Ok(()) => Ok(()),
            Err(wait) => Err(self.refused(TenantLimit::PromptTokens, Some(wait))),
        }
    }

    /// After tokenizing: the prompt cap (413 `prompt_too_long`, naming
    /// `param`) and the prompt-token bucket (429).
    pub fn charge_prompt(&mut self, param: &'static str, prompt_tokens: usize) -> Result<(), Error> {
        let cap = self.tenant.limits.max_prompt_tokens;
        if prompt_tokens > cap as usize {
            metrics::tenant_outcome(&self.tenant.name, Cap::PromptTokens.code());
            return Err(Error::OverCap { param, what: Cap::PromptTokens, cap: cap.into(), got: prompt_tokens as u64 });
        }
        let tenant = self.tenant.clone();
        let n = prompt_tokens as f64;
        match self.gate.with_usage(&tenant, |u, share, now| u.prompt.take(n, share.prompt, now)) {
            Ok(()) => {
                metrics::tenant_tokens(&self.tenant.name, "prompt", prompt_tokens as u64);
                Ok(())
            }
            Err(wait) => Err(self.refused(TenantLimit::PromptTokens, Some(wait))),
        }
    }

    /// Holds `tokens` of KV (the most the request can fill: prompt plus
    /// `max_tokens`, in whole blocks) against the tenant's `max_kv_share` of
    /// `cluster_tokens`, the cluster's KV capacity as this coordinator knows
    /// it (429 `kv_share` beyond). The share is split between coordinators
    /// like every budget: each holds at most `share x cluster / n`. A
    /// tenant holding nothing here always gets one request through, so a
    /// request larger than the share still runs, alone. Released when the
    /// pass drops. A share of 1 is no limit beyond the cluster's own (its
    /// workers refuse what does not fit) and is not counted.
    pub fn hold_kv(&mut self, tokens: u64, cluster_tokens: u64) -> Result<(), Error> {
        let share = self.tenant.limits.max_kv_share;
        if share >= 1.0 || self.kv_tokens > 0 {
            return Ok(());
        }
        let tenant = self.tenant.clone();
        let n = self.gate.split.get();
        let held = self.gate.with_usage(&tenant, |u, _, _| {
            if u.kv_tokens > 0 && u.kv_tokens + tokens > kv_limit(share, cluster_tokens, n) {
                return None;
            }
            u.kv_tokens += tokens;
            Some(u.kv_tokens)
        });
        let Some(held) = held else { return Err(self.refused(TenantLimit::KvShare, None)) };
        metrics::tenant_kv_tokens(&tenant.name, held);
        self.kv_tokens = tokens;
        Ok(())
    }

    /// Every check passed: counted as admitted for the tenant.
    pub fn admitted(&self) {
        metrics::tenant_outcome(&self.tenant.name, "admitted");
    }

    /// Records tokens generated so far (the rest of the charge is given back on drop).
    pub fn generated(&mut self, n: u32) {
        self.generated = n;
    }

    fn refused(&self, limit: TenantLimit, wait: Option<Duration>) -> Error {
        metrics::tenant_outcome(&self.tenant.name, limit.code());
        Error::TenantLimit { tenant: self.tenant.name.clone(), limit, wait }
    }
}

impl Drop for Pass {
    fn drop(&mut self) {
        let unused = self.output_charged.saturating_sub(self.generated);
        let (stream, kv_tokens) = (self.stream, self.kv_tokens);
        let tenant = self.tenant.clone();
        let kv_held = self.gate.with_usage(&tenant, |u, share, now| {
            u.in_flight = u.in_flight.saturating_sub(1);
            u.kv_tokens = u.kv_tokens.saturating_sub(kv_tokens);
            if stream {
                u.streams = u.streams.saturating_sub(1);
            }
            if unused > 0 {
                u.output.give_back(f64::from(unused), share.output, now);
            }
            u.kv_tokens
        });
        if kv_tokens > 0 {
            metrics::tenant_kv_tokens(&tenant.name, kv_held);
        }
        if self.generated > 0 {
            metrics::tenant_tokens(&self.tenant.name, "output", u64::from(self.generated));
        }
    }
}

#[cfg(test)]
mod tests;

/// How often the tenants file is checked for a change on disk.
pub const RELOAD_POLL: Duration = Duration::from_secs(1);

impl Tenancy {
    /// Reloads the tenants file on SIGHUP and whenever its modification
    /// time or size changes (checked every [`RELOAD_POLL`]). Without a file
    /// there is nothing to do and no handler is installed. Install it
    /// before the process announces itself: SIGHUP's default action ends it.
    pub fn spawn_reloader(self: &Arc<Self>) -> std::io::Result<Option<tokio::task::JoinHandle<()>>> {
        let Some(path) = self.path.clone() else { return Ok(None) };
        let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
        let gate = Arc::downgrade(self);
        let stamp = move || std::fs::metadata(&path).ok().map(|m| (m.modified().ok(), m.len()));
        Ok(Some(tokio::spawn(async move {
            let mut seen = stamp();
            let mut tick = tokio::time::interval(RELOAD_POLL);
            loop {
                let why = tokio::select! {
                    _ = hup.recv() => "SIGHUP",
                    _ = tick.tick() => {
                        let now = stamp();
                        if now == seen {
                            continue;
                        }
                        seen = now;
                        "changed on disk"
                    }
                };
                let Some(gate) = gate.upgrade() else { return };
                tracing::info!(why, "reloading the tenants file");
                // The outcome is logged and counted by `reload`.
                let _ = gate.reload();
            }
        })))
    }
}
