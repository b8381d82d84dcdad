use std::time::Duration;

use axum::http::{HeaderMap, HeaderValue};

use super::*;

fn as_key(key: &str) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert("authorization", HeaderValue::from_str(&format!("Bearer {key}")).expect("a header value"));
    h
}

fn limit_of(e: &Error) -> Option<TenantLimit> {
    match e {
        Error::TenantLimit { limit, .. } => Some(*limit),
        _ => None,
    }
}

struct TempFile(PathBuf);

impl TempFile {
    fn new(tag: &str, text: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("tandem-tenants-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a temp dir");
        let path = dir.join("tenants.toml");
        std::fs::write(&path, text).expect("write");
        Self(path)
    }

    fn write(&self, text: &str) {
        std::fs::write(&self.0, text).expect("write");
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if let Some(dir) = self.0.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

const TWO: &str = r#"
[tenants.a]
keys = ["sk-a"]
requests_per_s = 10
max_in_flight = 4
max_streams = 2

[tenants.b]
keys = ["sk-b", "sk-b2"]
"#;

#[tokio::test(start_paused = true)]
async fn the_request_rate_is_the_fleet_budget_over_the_split() {
    let f = TempFile::new("rate", TWO);
    let split = Split::new(1);
    let gate = Tenancy::from_file(&f.0, split.clone()).expect("valid");
    let mut passes = Vec::new();
    let admitted = |gate: &Arc<Tenancy>| -> usize {
        let mut n = 0;
        loop {
            match gate.enter(&as_key("sk-a")) {
                Ok(p) => {
                    n += 1;
                    // Released at once: only the rate limits here.
                    drop(p);
                }
                Err(e) => {
                    assert_eq!(limit_of(&e), Some(TenantLimit::Requests), "{e}");
                    return n;
                }
            }
        }
    };
    assert_eq!(admitted(&gate), 10, "one second's burst alone");
    // Two coordinators: each refills at 5/s and holds at most 5.
    split.set(2);
    tokio::time::advance(Duration::from_secs(10)).await;
    assert_eq!(admitted(&gate), 5);
    let e = gate.enter(&as_key("sk-a")).expect_err("empty");
    assert_eq!(e.retry_after(), Some(1), "a 0.2 s refill rounds up to 1 s");
    tokio::time::advance(Duration::from_millis(200)).await;
    passes.push(gate.enter(&as_key("sk-a")).expect("one token refilled at 5/s"));
    // Tenant b is untouched by a's budget.
    passes.push(gate.enter(&as_key("sk-b2")).expect("b has its own"));
}

#[tokio::test(start_paused = true)]
async fn in_flight_and_stream_caps_are_split_but_never_below_one() {
    let f = TempFile::new("counts", TWO);
    let split = Split::new(1);
    let gate = Tenancy::from_file(&f.0, split.clone()).expect("valid");
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(gate.enter(&as_key("sk-a")).expect("under 4"));
    }
    let e = gate.enter(&as_key("sk-a")).expect_err("a fifth");
    assert_eq!(limit_of(&e), Some(TenantLimit::InFlight));
    assert!(e.retry_after().is_some(), "429 always says when to come back");
    held[0].open_stream().expect("first stream");
    held[1].open_stream().expect("second stream");
    let e = held[2].open_stream().expect_err("a third stream");
    assert_eq!(limit_of(&e), Some(TenantLimit::Streams));
    assert_eq!(gate.counts("a"), (4, 2));
    drop(held.remove(0));
    assert_eq!(gate.counts("a"), (3, 1), "a dropped pass gives back its place and its stream");
    held[1].open_stream().expect("a freed stream place");
    // Eight coordinators: 4 / 8 rounds down to 0, kept at 1.
    drop(held);
    split.set(8);
    let one = gate.enter(&as_key("sk-a")).expect("one per coordinator");
    assert_eq!(limit_of(&gate.enter(&as_key("sk-a")).expect_err("a second")), Some(TenantLimit::InFlight));
    drop(one);
    assert_eq!(gate.counts("a"), (0, 0));
}

#[tokio::test(start_paused = true)]
async fn output_tokens_are_charged_as_max_tokens_and_the_unused_part_given_back() {
    let text = "[tenants.a]\nkeys=[\"sk-a\"]\noutput_tokens_per_min = 600\nprompt_tokens_per_min = 60\n";
    let f = TempFile::new("tokens", text);
    let gate = Tenancy::from_file(&f.0, Split::new(1)).expect("valid");
    let mut p = gate.enter(&as_key("sk-a")).expect("in");
    p.charge_output(500).expect("600 in the bucket");
    p.generated(100);
    drop(p);
    // 100 left, 400 given back: 500.
    let mut p = gate.enter(&as_key("sk-a")).expect("in");
    p.charge_output(500).expect("the unused part came back");
    let mut q = gate.enter(&as_key("sk-a")).expect("in");
    let e = q.charge_output(200).expect_err("none left");
    assert_eq!(limit_of(&e), Some(TenantLimit::OutputTokens));
    // 200 missing at 10 per second.
    assert_eq!(e.retry_after(), Some(20));
    // Prompt tokens: the cap on a bucket larger than a request never
    // starves it, and the debt of a large prompt blocks the next.
    q.check_prompt_budget().expect("a full bucket");
    q.charge_prompt("prompt", 100).expect("a full bucket covers any prompt");
    let e = q.check_prompt_budget().expect_err("in debt: not worth tokenizing");
    assert_eq!(limit_of(&e), Some(TenantLimit::PromptTokens));
    assert_eq!(e.retry_after(), Some(41), "41 tokens at 1 per second");
    drop(p);
}

#[tokio::test(start_paused = true)]
async fn caps_name_the_field_and_the_cap() {
    let text = "[tenants.a]\nkeys=[\"sk-a\"]\nmax_tokens = 16\nmax_prompt_tokens = 8\ndefault_max_tokens = 4\n";
    let f = TempFile::new("caps", text);
    let gate = Tenancy::from_file(&f.0, Split::new(1)).expect("valid");
    let mut p = gate.enter(&as_key("sk-a")).expect("in");
    assert_eq!(p.default_max_tokens(256), 4);
    p.check_max_tokens("max_tokens", 16).expect("at the cap");
    let e = p.check_max_tokens("max_completion_tokens", 17).expect_err("over");
    assert_eq!(e, Error::OverCap { param: "max_completion_tokens", what: Cap::MaxTokens, cap: 16, got: 17 });
    let e = p.charge_prompt("messages", 9).expect_err("over");
    assert_eq!(e, Error::OverCap { param: "messages", what: Cap::PromptTokens, cap: 8, got: 9 });
    assert_eq!(crate::http::error::status(&e), axum::http::StatusCode::PAYLOAD_TOO_LARGE);
}

#[tokio::test(start_paused = true)]
async fn a_reload_applies_a_good_file_keeps_the_old_on_a_bad_one_and_revokes_removed_keys() {
    let f = TempFile::new("reload", TWO);
    let gate = Tenancy::from_file(&f.0, Split::new(1)).expect("valid");
    let held = gate.enter(&as_key("sk-b2")).expect("b");
    // A bad file: refused with the key named, nothing changes.
    f.write("[tenants.a]\nkeys=[\"sk-a\"]\nmax_streams = 0\n");
    let e = gate.reload().expect_err("invalid");
    assert!(e.to_string().contains("tenants.a.max_streams"), "{e}");
    gate.enter(&as_key("sk-b")).expect("the old file stays in force");
    // A good file without sk-b2: revoked at once; sk-b still works with new limits.
    f.write("[tenants.b]\nkeys=[\"sk-b\"]\nmax_in_flight = 1\n");
    assert_eq!(gate.reload().expect("valid"), 1);
    assert_eq!(gate.enter(&as_key("sk-b2")).expect_err("revoked"), Error::WrongApiKey);
    assert_eq!(gate.enter(&as_key("sk-a")).expect_err("tenant a is gone"), Error::WrongApiKey);
    // The request admitted before the reload still counts against b.
    assert_eq!(limit_of(&gate.enter(&as_key("sk-b")).expect_err("b's one place is held")), Some(TenantLimit::InFlight));
    drop(held);
    gate.enter(&as_key("sk-b")).expect("free again");
    // A file that went missing: refused, kept.
    std::fs::remove_file(&f.0).expect("rm");
    assert!(matches!(gate.reload(), Err(TenantsError::Read { .. })));
    gate.enter(&as_key("sk-b")).expect("still the last good file");
}

#[tokio::test(start_paused = true)]
async fn without_a_file_every_caller_shares_the_builtin_tenant() {
    let keys = ApiKeys::load(&["sk-1".into(), "sk-2".into()], None).expect("keys");
    let mut t = Tenant::builtin();
    t.limits.max_in_flight = 1;
    let gate = Tenancy::builtin(keys, t, Split::new(1));
    let p = gate.enter(&as_key("sk-1")).expect("in");
    assert_eq!((p.caller(), p.tenant().name.as_str()), ("key-1", DEFAULT_TENANT), "fairness stays per key");
    assert_eq!(limit_of(&gate.enter(&as_key("sk-2")).expect_err("one tenant")), Some(TenantLimit::InFlight));
    assert_eq!(gate.enter(&HeaderMap::new()).expect_err("no key"), Error::MissingApiKey);
    assert_eq!(Tenant::builtin().class_of(Some(types::priority::Priority::High)), types::priority::Priority::High);
}

/// A tenant flooding one coordinator's share at 10x with Poisson arrivals
/// gets its rate: the bucket's smallest size is two requests, so the refill
/// that accrues while a full bucket waits is not lost (with one it got 91%).
#[tokio::test(start_paused = true)]
async fn a_flood_of_ten_times_a_small_share_is_admitted_at_the_share() {
    let f = TempFile::new("flood", "[tenants.a]\nkeys=[\"sk-a\"]\nrequests_per_s = 1\n");
    // Two coordinators: this one's share is 0.5/s.
    let gate = Tenancy::from_file(&f.0, Split::new(2)).expect("valid");
    let mut rng = types::rng::XorShift64::new(7);
    let (secs, offered) = (2000.0, 5.0);
    let (mut t, mut admitted) = (0.0, 0u32);
    while t < secs {
        // Exponential gaps of mean 1/offered.
        let gap = -(1.0 - rng.unit_f64()).ln() / offered;
        t += gap;
        tokio::time::advance(Duration::from_secs_f64(gap)).await;
        if gate.enter(&as_key("sk-a")).is_ok() {
            admitted += 1;
        }
    }
    // The first MIN_REQUEST_BURST came from the full bucket.
    let rate = (f64::from(admitted) - MIN_REQUEST_BURST) / secs;
    assert!((rate / 0.5 - 1.0).abs() < 0.01, "admitted {admitted} in {secs} s: {rate}/s against 0.5/s");
}

const KV: &str = "[tenants.a]\nkeys=[\"sk-a\"]\nmax_kv_share = 0.25\n\n[tenants.b]\nkeys=[\"sk-b\"]\n";

#[tokio::test(start_paused = true)]
async fn a_tenant_holds_at_most_its_kv_share_split_between_coordinators() {
    let f = TempFile::new("kv", KV);
    let split = Split::new(2);
    let gate = Tenancy::from_file(&f.0, split.clone()).expect("valid");
    // A cluster of 1,000 KV tokens: a's share is 250, 125 per coordinator.
    assert_eq!(kv_limit(0.25, 1000, 2), 125);
    let mut first = gate.enter(&as_key("sk-a")).expect("in");
    first.hold_kv(100, 1000).expect("100 of 125");
    let mut second = gate.enter(&as_key("sk-a")).expect("in");
    let e = second.hold_kv(50, 1000).expect_err("150 of 125");
    assert_eq!(limit_of(&e), Some(TenantLimit::KvShare));
    assert_eq!(e.code(), "kv_share");
    assert_eq!(crate::http::error::status(&e), axum::http::StatusCode::TOO_MANY_REQUESTS);
    assert!(e.retry_after().is_some(), "frees as a's own requests end");
    second.hold_kv(25, 1000).expect("125 of 125");
    assert_eq!(gate.kv_held("a"), 125);
    // b's share is the whole cluster: nothing counted.
    let mut b = gate.enter(&as_key("sk-b")).expect("in");
    b.hold_kv(1000, 1000).expect("b is unlimited");
    assert_eq!(gate.kv_held("b"), 0);
    // One coordinator: the whole 250 here.
    split.set(1);
    let mut third = gate.enter(&as_key("sk-a")).expect("in");
    third.hold_kv(125, 1000).expect("250 of 250");
    drop(first);
    assert_eq!(gate.kv_held("a"), 150, "an ended request gives its KV back");
    drop((second, third));
    // Holding nothing, a request larger than the share still runs, alone.
    let mut big = gate.enter(&as_key("sk-a")).expect("in");
    big.hold_kv(600, 1000).expect("alone");
    let mut next = gate.enter(&as_key("sk-a")).expect("in");
    assert_eq!(limit_of(&next.hold_kv(1, 1000).expect_err("over, behind it")), Some(TenantLimit::KvShare));
    drop(big);
    next.hold_kv(1, 1000).expect("free again");
}
