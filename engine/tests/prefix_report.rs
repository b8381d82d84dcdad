//! What a worker reports of its prefix cache for routing: the hashes the
//! pool indexes are the ones `engine::kv::prefix_hashes` computes from the
//! prompt and salt alone (which is how the coordinator matches a prompt),
//! and the epoch moves exactly when that set changes.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]

mod common;

use common::{engine, greedy};
use engine::batch::{EngineConfig, Request};
use engine::kv::prefix_hashes;

#[test]
fn the_reported_prefixes_match_the_prompts_hash_chain_and_the_epoch_follows_the_set() {
    let (mut e, tok) = engine(EngineConfig { block_size: 16, kv_blocks: 64, ..EngineConfig::default() });
    let prompt = tok.encode(&"The history of Paris is long and rich. ".repeat(5), false).expect("encode");
    assert!(prompt.len() > 33, "at least two full blocks: {}", prompt.len());
    let epoch0 = e.pool().prefix_epoch();
    assert!(e.pool().cached_prefixes(100).is_empty());
    e.add(Request {
        id: 1,
        prompt: prompt.clone(),
        params: greedy(2),
        salt: 42,
        priority: Default::default(),
        generated: Vec::new(),
    })
    .expect("add");
    while e.has_work() {
        e.step().expect("step");
    }
    let epoch1 = e.pool().prefix_epoch();
    assert_ne!(epoch0, epoch1, "blocks were indexed");
    let reported = e.pool().cached_prefixes(100);
    let chain = prefix_hashes(&prompt, 16, 42);
    assert!(!chain.is_empty());
    for h in &chain {
        assert!(reported.contains(h), "block hash {h:x} of the prompt is not reported: {reported:x?}");
    }
    for h in prefix_hashes(&prompt, 16, 43) {
        assert!(!reported.contains(&h), "another salt's chain matched");
    }
    assert!(e.pool().cached_prefixes(1).len() == 1, "the bound holds");
    // Nothing changed: the epoch stays. Another request's blocks move it.
    assert_eq!(e.pool().prefix_epoch(), epoch1);
    let other = tok.encode(&"Rivers of Europe flow to the sea in many ways. ".repeat(5), false).expect("encode");
    e.add(Request {
        id: 2,
        prompt: other,
        params: greedy(2),
        salt: 42,
        priority: Default::default(),
        generated: Vec::new(),
    })
    .expect("add");
    while e.has_work() {
        e.step().expect("step");
    }
    assert_ne!(e.pool().prefix_epoch(), epoch1);
}

/// The hit counter a worker exports: a repeat under the same salt takes
/// every full block but the last token's from the cache; the same prompt
/// under another salt takes nothing.
#[test]
fn prefix_hit_tokens_count_only_same_salt_repeats() {
    let (mut e, tok) = engine(EngineConfig { block_size: 16, kv_blocks: 64, ..EngineConfig::default() });
    let prompt = tok.encode(&"The history of Paris is long and rich. ".repeat(5), false).expect("encode");
    let mut run = |id: u64, salt: u64| {
        e.add(Request {
            id,
            prompt: prompt.clone(),
            params: greedy(2),
            salt,
            priority: Default::default(),
            generated: Vec::new(),
        })
        .expect("add");
        while e.has_work() {
            e.step().expect("step");
        }
        e.prefix_hit_tokens()
    };
    assert_eq!(run(1, 42), 0, "a cold cache");
    let full = ((prompt.len() - 1) / 16 * 16) as u64;
    assert_eq!(run(2, 42), full, "the repeat: every full block before the last token");
    assert_eq!(run(3, 43), full, "another salt hits nothing");
}
