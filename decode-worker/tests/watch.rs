//! A real `tandem-decode-worker`'s `WatchPrefixes` stream carries its load as it
//! changes, which the coordinator routes on in place of its polls' figures: idle in the
//! snapshot, the request running with its KV blocks while it decodes, idle again once it
//! ended; and the blocks its prompt left cached in the set.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]

mod common;
#[path = "common/rpc.rs"]
mod rpc;

use common::{prompt_of, tokenizer, within, TestResult};
use proto::worker::v1::{PrefixUpdate, WatchPrefixesRequest, WatchedLoad};
use rpc::{client, generate, request, GROUP};

/// Long enough to be seen running by a 10 ms ticker many times over.
const TOKENS: u32 = 96;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watch_stream_carries_the_load_while_a_request_runs_and_after() -> TestResult {
    let decode = common::decode_worker(GROUP, &["--kv-load-failure-policy", "retry"])?;
    let mut c = client(&decode).await?;
    let mut watch = within("WatchPrefixes", c.watch_prefixes(WatchPrefixesRequest {})).await??.into_inner();
    let mut next = async move || -> Result<PrefixUpdate, String> {
        let u = within("a watch message", watch.message()).await.map_err(|e| e.to_string())?;
        u.map_err(|s| s.to_string())?.ok_or_else(|| "the stream ended".to_owned())
    };
    let first = next().await?;
    let idle = first.load.ok_or("the snapshot carries no load")?;
    assert!(first.snapshot && first.seq == 1, "{first:?}");
    assert_eq!((idle.running, idle.waiting, idle.kv_blocks_used), (0, 0, 0), "{idle:?}");
    assert_eq!(idle.kv_blocks_total, 256, "the pool the worker was started with: {idle:?}");

    let prompt = prompt_of(&tokenizer()?, 40)?;
    let mut req = request("watch-1", &prompt, Vec::new());
    req.sampling = Some((&common::greedy(TOKENS)).into());
    let run = tokio::spawn(async move { generate(&mut c, req).await });
    // Every message is in sequence; the loads go busy, then idle again.
    let (mut seq, mut busy, mut cached) = (1, None::<WatchedLoad>, 0);
    loop {
        let u = next().await?;
        seq += 1;
        assert_eq!((u.seq, u.snapshot), (seq, false), "{u:?}");
        cached += u.added.len();
        match (u.load, busy) {
            (Some(l), None) if l.running == 1 => {
                let blocks = prompt.len().div_ceil(first.block_size as usize);
                assert!(l.kv_blocks_used as usize >= blocks, "its {blocks} blocks: {l:?}");
                busy = Some(l);
            }
            (Some(l), Some(_)) if l.running == 0 && l.waiting == 0 => {
                assert!(l.kv_blocks_used < busy.map_or(0, |b| b.kv_blocks_used), "blocks freed: {l:?}");
                break;
            }
            _ => {}
        }
    }
    let out = within("the request's end", run).await???;
    assert_eq!(out.tokens.len(), TOKENS as usize, "{:?}", out.end);
    assert!(cached > 0, "the prompt's blocks were announced cached");
    Ok(())
}
