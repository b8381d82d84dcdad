//! Drills where one tenant is the fault: a noisy neighbour flooding its quota.

use std::time::Duration;
use tokio::time::Instant;

use loadgen::{Arrival, Outcome, Plan, PromptSource, Report};
use opskit::http::Request;
use tokio_util::sync::CancellationToken;

use super::common::{core_each, LOAD_WAIT};
use super::{Drill, DrillInfo, Evidence, Progress, Setup, MODEL};
use crate::cluster::{Cluster, ClusterSpec, Role};
use crate::invariants::Invariants;
use crate::metrics::scrape;
use crate::{eventually, HarnessError};
use facts::metrics::coordinator::{FLEET_SPLIT, TENANT_REQUESTS};
use facts::metrics::worker::PREFIX_CACHE_HIT_TOKENS;

/// Tenant A's request quota for the whole fleet, requests per second: each coordinator
/// refills half, so A's admitted work stays a small part of what two 1-thread workers do.
const A_QUOTA: f64 = 1.0;
/// The largest quota of A's a running cluster's tenants file may give: more admitted long
/// prompts would be a load of their own on its workers, not a neighbour's noise.
const A_QUOTA_MAX: f64 = 2.0;
/// The smallest request quota B's tenant may have there: B's one-at-a-time short requests
/// must never meet it (nothing of B's may be refused).
const B_QUOTA_MIN: f64 = 20.0;
/// What A offers: this many times its quota, Poisson arrivals through the front.
const A_OFFERED: f64 = 10.0;
const A_KEY: &str = "sk-noisy-a";
const B_KEY: &str = "sk-steady-b";
/// B's requests measured alone before the flood, and under it (at least); the rest run
/// alone after it, at least [`B_AFTER`] of the [`B_REQUESTS`]. The alone phase is long
/// because its p99 is the bound's baseline: with 8 before and what was left after a
/// 16 s flood on a quick machine (13-17), it was the slowest of ~21 requests, and one
/// slow request in it moved the ratio by a third (a full `make test` once read 1.55x).
const B_ALONE: usize = 24;
const B_FLOOD: usize = 36;
const B_AFTER: usize = 12;
const B_REQUESTS: usize = 128;
/// The flood lasts at least this long (while B has requests to spare): A's rate is a
/// slope over whole admissions at about one a second, so a flood that ends after
/// B_FLOOD fast requests (7 s on a quick machine) measures it to +-15%, not 10%.
const FLOOD_MIN: Duration = Duration::from_secs(16);
/// A's admitted counters are read this often under the flood; the rate is their slope
/// from [`RATE_FROM`] on (after the buckets' initial burst). Not faster: rendering two
/// coordinators' metrics pages four times a second cost B's TTFT more than A's flood did.
const SAMPLE_EVERY: Duration = Duration::from_secs(1);
const RATE_FROM: Duration = Duration::from_secs(3);
/// B's TTFT p99 under the flood may be at most this many times its p99 alone.
const TTFT_BOUND: f64 = 1.5;
/// A's admitted rate, summed over both coordinators, within this fraction of its quota.
const RATE_TOLERANCE: f64 = 0.10;
/// Prompts this short are prefilled on the decode worker: B's (the drills' ~40 tokens), not A's.
const LOCAL_PREFILL_MAX_TOKENS: usize = 64;
/// A's prompts: a long shared preamble (tokens) and a short unique tail.
const A_PREAMBLE_TOKENS: usize = 112;
const A_TAIL_TOKENS: usize = 16;

/// The tenants file: A limited to [`A_QUOTA`] requests per second fleet-wide (split
/// between the coordinators), B with the defaults. Same class: B is protected by A's
/// quota alone, not by priority.
fn tenants_file() -> String {
    format!("[tenants.a]\nkeys = [\"{A_KEY}\"]\nrequests_per_s = {A_QUOTA}\n\n[tenants.b]\nkeys = [\"{B_KEY}\"]\n")
}

/// A's prompts: one long preamble shared by all (a system prompt; cached in A's own
/// scope after the first) and a unique tail each.
fn a_prompts(n: usize) -> Vec<String> {
    let preamble = loadgen::prompts::generate(1, A_PREAMBLE_TOKENS, 101).remove(0);
    loadgen::prompts::generate(n, A_TAIL_TOKENS, 102).into_iter().map(|t| format!("{preamble} {t}")).collect()
}

/// Tenant A sends ten times its quota of long prompts through both coordinators while
/// tenant B sends a steady light load.
pub(super) struct NoisyNeighbour;

/// A coordinator series on every coordinator, in order (absent: 0, which no check here
/// takes for a pass).
async fn over_coordinators(c: &Cluster, name: &str, labels: &[(&str, &str)]) -> Result<Vec<f64>, HarnessError> {
    let mut out = Vec::new();
    for p in c.coordinators() {
        out.push(scrape(&p.addr("http")?).await?.absent_as_zero(name, labels));
    }
    Ok(out)
}

/// Tenant A as the drill floods with it: its name (the metrics' `tenant` label), a key, and
/// its request quota for the whole fleet.
#[derive(Debug)]
struct TenantA {
    name: String,
    key: String,
    quota: f64,
}

impl TenantA {
    fn labels<'a>(&'a self, outcome: &'a str) -> [(&'a str, &'a str); 2] {
        [("tenant", &self.name), ("outcome", outcome)]
    }
}

/// Tenant A: the drill's own, or, against a running cluster, the tenant of the
/// coordinators' tenants file with the lowest `requests_per_s` (at most [`A_QUOTA_MAX`])
/// that the drill traffic's key is not one of; B is that key's tenant, whose requests must
/// not meet a quota (at least [`B_QUOTA_MIN`]).
fn tenant_a(c: &Cluster) -> Result<TenantA, String> {
    if !c.is_attached() {
        return Ok(TenantA { name: "a".into(), key: A_KEY.into(), quota: A_QUOTA });
    }
    let flag = facts::state::flag::TENANTS;
    let name = c.coordinator.name.as_str();
    let Some(path) = c.flag(name, flag) else {
        return Err(format!(
            "its tenants are a flooding one with a request quota and a steady one, and the state file gives {name} \
             no `{flag}` file (`tandem up --tenants FILE`)"
        ));
    };
    let b_key = c.api_key.as_deref().ok_or("B's load needs the drill traffic's own key (`--api-key`)")?;
    let text = std::fs::read_to_string(path).map_err(|e| format!("reading {name}'s tenants file {path}: {e}"))?;
    pick_tenants(&text, b_key).map_err(|e| format!("{name}'s tenants file {path}: {e}"))
}

/// [`tenant_a`] from a tenants file's text: A, and a check of B (`b_key`'s tenant).
fn pick_tenants(text: &str, b_key: &str) -> Result<TenantA, String> {
    let file: toml::Table = toml::from_str(text).map_err(|e| e.to_string())?;
    let quota = |t: &toml::Value| {
        let q = t.get("requests_per_s")?;
        q.as_float().or_else(|| q.as_integer().map(|i| i as f64))
    };
    let default_quota = file.get("defaults").and_then(quota);
    let tenants = file.get("tenants").and_then(toml::Value::as_table).ok_or("it lists no tenants")?;
    let keys = |t: &toml::Value| -> Vec<String> {
        t.get("keys")
            .and_then(toml::Value::as_array)
            .map_or(Vec::new(), |k| k.iter().filter_map(|k| k.as_str().map(str::to_owned)).collect())
    };
    let (b, b_tenant) = tenants
        .iter()
        .find(|(_, t)| keys(t).iter().any(|k| k == b_key))
        .ok_or("the drill traffic's key (`--api-key`) is none of its tenants' keys")?;
    if let Some(q) = quota(b_tenant).or(default_quota).filter(|&q| q < B_QUOTA_MIN) {
        return Err(format!(
            "B (the drill traffic's tenant {b}) may send {q} requests a second, and none of B's may be refused: \
             give it at least {B_QUOTA_MIN}"
        ));
    }
    let a = tenants
        .iter()
        .filter(|(n, _)| *n != b)
        .filter_map(|(n, t)| Some((n, keys(t).into_iter().next()?, quota(t)?)))
        .filter(|(_, _, q)| *q > 0.0 && *q <= A_QUOTA_MAX)
        .min_by(|x, y| x.2.total_cmp(&y.2));
    let (name, key, quota) = a.ok_or_else(|| {
        format!(
            "no tenant but B ({b}) has a key and its own `requests_per_s` of at most {A_QUOTA_MAX}: A, which \
             floods at 10x its quota"
        )
    })?;
    Ok(TenantA { name: name.clone(), key, quota })
}

/// One request as A through the front, `max_tokens` 1: (status, Retry-After, body).
async fn as_a(a: &TenantA, front: &str, prompt: &str) -> Result<(u16, Option<String>, String), HarnessError> {
    let body = serde_json::json!({"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0});
    let r = Request::post(front, "/v1/completions")
        .header("authorization", &format!("Bearer {}", a.key))
        .json(&body)
        .timeout(LOAD_WAIT)
        .send()
        .await?;
    Ok((r.status, r.header("retry-after").map(str::to_owned), r.text()))
}

/// TTFT p99 (s) of the records whose index is in one of `ranges`, and how many there were.
fn ttft_p99(report: &Report, ranges: &[std::ops::Range<usize>]) -> (Option<f64>, usize) {
    let mut v: Vec<f64> = report
        .records
        .iter()
        .filter(|r| ranges.iter().any(|x| x.contains(&r.index)))
        .filter_map(|r| r.ttft.map(|t| t.as_secs_f64()))
        .collect();
    v.sort_by(f64::total_cmp);
    (loadgen::percentile(&v, 0.99), v.len())
}

/// Least-squares slope of `(t, y)` points: a rate from a counter read at known times, not
/// at the instants its increments happened.
fn slope(points: &[(f64, f64)]) -> Option<f64> {
    let n = points.len() as f64;
    let (mt, my) = points.iter().fold((0.0, 0.0), |(a, b), (t, y)| (a + t / n, b + y / n));
    let (num, den) = points.iter().fold((0.0, 0.0), |(a, b), (t, y)| (a + (t - mt) * (y - my), b + (t - mt).powi(2)));
    (points.len() >= 2 && den > 0.0).then(|| num / den)
}

#[async_trait::async_trait]
impl Drill for NoisyNeighbour {
    fn info(&self) -> DrillInfo {
        DrillInfo {
            name: "noisy-neighbour",
            description: "two coordinators behind a round-robin front; tenant A offers 10x its request quota of \
                          long prompts while tenant B sends a steady light load: B's TTFT p99 within 1.5x of B \
                          alone (before and after the flood), nothing of B's refused, A refused 429 with \
                          Retry-After, A's admitted rate summed over both coordinators within 10% of its quota",
        }
    }

    /// B's prompts are prefilled on the decode workers, against a running cluster too.
    fn local_prompts(&self) -> bool {
        true
    }

    /// Against a running cluster: at least two coordinators with a tenants file (`tandem up
    /// --coordinators 2 --tenants FILE`) giving A ([`tenant_a`]) and the drill traffic's tenant, B.
    fn against(&self, c: &Cluster) -> Result<(), String> {
        if c.coordinators().count() < 2 {
            return Err("A's quota is held across two coordinators, and the cluster has one".into());
        }
        // B's short prompts are prefilled on the decode workers, A's long ones on the prefill
        // workers, as in the drill's own cluster: the bound on B's TTFT is for A's excess,
        // and A's admitted prefills ahead of B's on one worker would measure A's quota.
        let key = facts::state::flag::LOCAL_PREFILL_MAX_TOKENS;
        for p in c.coordinators() {
            let n = c.flag(&p.name, key).and_then(|n| n.parse::<usize>().ok());
            if !n.is_some_and(|n| (super::PROMPT_TOKENS..A_PREAMBLE_TOKENS + A_TAIL_TOKENS).contains(&n)) {
                return Err(format!(
                    "its steady tenant's {}-token prompts are prefilled on the decode workers and the flood's \
                     {}-token ones on the prefill workers, and {} gives `{key}` {} (`tandem up \
                     --local-prefill-max-tokens {}`; the other drills then send longer prompts)",
                    super::PROMPT_TOKENS,
                    A_PREAMBLE_TOKENS + A_TAIL_TOKENS,
                    p.name,
                    c.flag(&p.name, key).unwrap_or("none (the coordinator's default, 32)"),
                    super::PROMPT_TOKENS + 8
                ));
            }
        }
        tenant_a(c).map(drop)
    }

    fn setup(&self, _skip: bool) -> Setup {
        let (prefill, decode) = core_each();
        Setup {
            // B's short prompts are prefilled on the decode worker, A's long ones on the
            // prefill worker: what a deployment does with prompts this short. On one host
            // each worker gets a core of its own (DESIGN: one machine, several roles).
            spec: ClusterSpec { local_prefill_max_tokens: LOCAL_PREFILL_MAX_TOKENS, ..ClusterSpec::default() }
                .prefill_with("g1", prefill)
                .decode_with("g1", decode)
                .coordinators(2)
                .tenants(&tenants_file(), B_KEY),
            // B: one request at a time, short answers; the first few run while A's preamble
            // is warmed, then B_ALONE alone, B_FLOOD under the flood, the rest alone again.
            requests: B_REQUESTS,
            max_tokens: 4,
            concurrency: 1,
            // Nothing of B's may be refused.
            invariants: Invariants { all_complete: true, ..Invariants::default() },
            sampled: None,
        }
    }

    async fn fault(&self, c: &mut Cluster, load: &Progress, skip: bool) -> Result<Evidence, HarnessError> {
        let c: &Cluster = c;
        let mut ev = Evidence::default();
        let front = c.base_url()?.trim_start_matches("http://").to_owned();
        let done = || load.done.load(std::sync::atomic::Ordering::SeqCst);
        // Both coordinators count each other before anything is measured: each enforces half.
        let n = c.coordinators().count() as f64;
        let what = format!("every coordinator splits tenant budgets by {n}");
        let split = eventually(&what, LOAD_WAIT, || async {
            over_coordinators(c, FLEET_SPLIT, &[]).await.is_ok_and(|v| v.iter().all(|&k| k == n))
        });
        split.await?;
        let a = tenant_a(c).map_err(HarnessError::Setup)?;
        let prompts = a_prompts((a.quota * A_OFFERED * 120.0) as usize);
        // A's preamble into A's prefix cache (its first request prefills it whole), so the
        // flood's admitted requests cost what a cached system prompt costs.
        let (status, _, body) = as_a(&a, &front, &prompts[0]).await?;
        if status != 200 {
            return Err(HarnessError::Fault(format!("A's warm-up request answered {status}: {body}")));
        }
        // With one request at a time, `done` = d means requests 0..d ended and d may run:
        // B alone is d0+1..d1, under the flood d1+1..d2, alone again d2+1...
        let d0 = done();
        load.wait_done(d0 + 1 + B_ALONE, LOAD_WAIT * 2).await?;
        let d1 = done();
        if skip {
            load.wait_done(d1 + 1 + B_FLOOD, LOAD_WAIT * 2).await?;
            ev.done_at = vec![d0, d1, done()];
            load.wait_finished().await?;
            return Ok(ev);
        }

        let mut plan = Plan::new(c.base_url()?, MODEL);
        plan.requests = prompts.len();
        plan.arrival = Arrival::Poisson { rate: a.quota * A_OFFERED };
        plan.prompts = PromptSource::List(prompts);
        plan.max_tokens = 1;
        plan.api_key = Some(a.key.clone());
        plan.seed = 11;
        plan.deadline = Some(Duration::from_secs(60));
        let cancel = CancellationToken::new();
        let hooks = loadgen::Hooks { cancel: cancel.clone(), ..loadgen::Hooks::default() };
        ev.before = over_coordinators(c, TENANT_REQUESTS, &a.labels("admitted")).await?.iter().sum();
        ev.began();
        let t0 = Instant::now();
        let flood = tokio::spawn(async move { loadgen::run_with(&plan, hooks).await });
        // A's admitted count over time, for its rate.
        let mut samples = Vec::new();
        let mut probed = false;
        let flood_over = || {
            let d = done();
            d >= d1 + 1 + B_FLOOD && (t0.elapsed() >= FLOOD_MIN || d + B_AFTER >= B_REQUESTS)
        };
        while !flood_over() && !load.finished() {
            let admitted: f64 = over_coordinators(c, TENANT_REQUESTS, &a.labels("admitted")).await?.iter().sum();
            let at = t0.elapsed();
            if at >= RATE_FROM {
                samples.push((at.as_secs_f64(), admitted));
            }
            // Once A is being refused, a request of A's own must be refused with a Retry-After.
            if !probed && at >= RATE_FROM {
                probed = true;
                let (status, retry_after, body) = as_a(&a, &front, "A probe over its quota").await?;
                ev.seen = status == 429 && retry_after.is_some() && body.contains("rate_limit_requests");
                ev.notes.push(format!("A's probe under the flood: {status}, Retry-After {retry_after:?}"));
            }
            tokio::time::sleep(SAMPLE_EVERY).await;
        }
        cancel.cancel();
        let secs = t0.elapsed().as_secs_f64();
        // B runs alone again only once A's last admitted requests have ended.
        let offered = flood
            .await
            .map_err(|e| HarnessError::Load(format!("A's flood: {e}")))?
            .map_err(|e| HarnessError::Load(format!("A's flood: {e}")))?;
        ev.ended();
        ev.done_at = vec![d0, d1, done()];
        let mut by = std::collections::BTreeMap::<String, usize>::new();
        for r in &offered.records {
            *by.entry(r.outcome.label()).or_insert(0) += 1;
        }
        ev.notes.push(format!("A offered {} in {secs:.1} s: {by:?}", offered.records.len()));
        // Every admitted request of A's ends complete: the quota refuses, nothing else does.
        let other = offered
            .records
            .iter()
            .filter(|r| {
                !r.outcome.is_complete()
                    && !matches!(&r.outcome, Outcome::HttpError { status: 429, code: Some(c), .. } if c == "rate_limit_requests")
            })
            .count();
        if other > 0 {
            ev.missing.push(format!("{other} of A's requests ended neither complete nor 429 rate_limit_requests"));
        }
        match slope(&samples) {
            Some(rate) => {
                let span = samples.last().map_or(0.0, |s| s.0) - samples.first().map_or(0.0, |s| s.0);
                ev.notes.push(format!(
                    "A ({}) admitted at {rate:.3}/s summed over the coordinators over {span:.1} s (quota {}/s)",
                    a.name, a.quota
                ));
                if (rate / a.quota - 1.0).abs() > RATE_TOLERANCE {
                    ev.missing
                        .push(format!("A's admitted rate {rate:.3}/s is not within 10% of its quota {}/s", a.quota));
                }
            }
            None => ev.missing.push(format!("the flood was too short to measure A's rate ({} samples)", samples.len())),
        }
        Ok(ev)
    }

    async fn prove(&self, c: &Cluster, ev: &Evidence, report: &Report) -> Result<String, String> {
        let mut out = ev.notes.clone();
        let mut bad = ev.missing.clone();
        let a = tenant_a(c)?;
        let admitted = over_coordinators(c, TENANT_REQUESTS, &a.labels("admitted")).await.map_err(|e| e.to_string())?;
        let refused =
            over_coordinators(c, TENANT_REQUESTS, &a.labels("rate_limit_requests")).await.map_err(|e| e.to_string())?;
        out.push(format!("A per coordinator: admitted {admitted:?}, refused {refused:?}"));
        if ev.window.0.is_none() {
            bad.push("A's flood did not run".into());
        }
        if refused.iter().sum::<f64>() < 1.0 || !ev.seen {
            bad.push("A was not refused 429 rate_limit_requests with a Retry-After".into());
        }
        let b_refused = report.records.iter().filter(|r| !r.outcome.is_complete()).count();
        if b_refused > 0 {
            bad.push(format!("{b_refused} of B's requests did not complete"));
        }
        let [d0, d1, d2] = ev.done_at[..] else { return Err("the fault step marked no phases".into()) };
        let (alone, na) = ttft_p99(report, &[d0 + 1..d1, d2 + 1..usize::MAX]);
        let (flood, nf) = ttft_p99(report, std::slice::from_ref(&(d1 + 1..d2)));
        match (alone, flood) {
            (Some(a), Some(f)) if na >= B_ALONE + 4 && nf >= B_FLOOD - 2 => {
                out.push(format!(
                    "B's TTFT p99 alone {:.0} ms ({na} requests, before and after), under the flood {:.0} ms \
                     ({nf}): {:.2}x",
                    a * 1e3,
                    f * 1e3,
                    f / a
                ));
                if f > TTFT_BOUND * a {
                    bad.push(format!("B's TTFT p99 under the flood is {:.2}x alone (bound {TTFT_BOUND}x)", f / a));
                }
            }
            _ => bad.push(format!("B's phases too short: {na} alone, {nf} under the flood")),
        }
        // What A's admitted requests cost: their shared preamble came from A's cache.
        let mut hits = 0.0;
        for w in c.workers_of(Role::Prefill) {
            let page = scrape(&w.metrics_addr().map_err(|e| e.to_string())?).await.map_err(|e| e.to_string())?;
            hits += crate::metrics::sum(&page, PREFIX_CACHE_HIT_TOKENS, &[])?;
        }
        out.push(format!("prefill workers' prefix-cache hit tokens {hits}"));
        if bad.is_empty() {
            Ok(out.join("; "))
        } else {
            Err(format!("{} ({})", bad.join("; "), out.join("; ")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::pick_tenants;

    #[test]
    fn a_is_the_lowest_quota_but_the_drills_own_tenant_and_b_must_not_meet_a_quota() {
        let file = "[tenants.drills]\nkeys = [\"sk-d\"]\n\n[tenants.noisy]\nkeys = [\"sk-n\", \"sk-n2\"]\n\
                    requests_per_s = 1\n\n[tenants.bulk]\nkeys = [\"sk-b\"]\nrequests_per_s = 1.5\n";
        let a = pick_tenants(file, "sk-d").expect("A");
        assert_eq!((a.name.as_str(), a.key.as_str(), a.quota), ("noisy", "sk-n", 1.0));
        // The drill traffic's own tenant is never A, however low its quota.
        let a = pick_tenants(file, "sk-n2").expect_err("B limited to 1/s");
        assert!(a.contains("B (the drill traffic's tenant noisy) may send 1 requests a second"), "{a}");
        let e = pick_tenants(file, "sk-unknown").expect_err("no such key");
        assert!(e.contains("none of its tenants' keys"), "{e}");
        // Defaults limit B too; a quota above the bound is no A.
        let e = pick_tenants("[defaults]\nrequests_per_s = 5\n[tenants.d]\nkeys = [\"k\"]\n", "k").expect_err("B");
        assert!(e.contains("may send 5 requests a second"), "{e}");
        let e = pick_tenants("[tenants.d]\nkeys = [\"k\"]\n[tenants.x]\nkeys = [\"x\"]\nrequests_per_s = 10\n", "k")
            .expect_err("no A");
        assert!(e.contains("no tenant but B (d)"), "{e}");
        assert!(pick_tenants("keys = [", "k").is_err());
    }
}
