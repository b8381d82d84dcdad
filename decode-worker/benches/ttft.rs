//! Time to first token of a 1,024-token prompt with remote prefill (a
//! prefill worker process computes it and streams the KV into the decode
//! worker over TCP, or the transport named on the command line) against
//! local prefill (the decode worker computes it), both measured in this run
//! with the same thread count per engine.
//!
//! Every request gets its own `cache_salt`, so neither side's prefix cache
//! helps; runs alternate remote/local so drift hits both alike.
//!
//! Run: `cargo bench -p decode-worker --bench ttft` (optional args: runs, prompt
//! tokens, threads; defaults 7, 1024, 2; and a transport, `tcp` (default),
//! `quic`, `local` or `ucx`, e.g. `-- 7 1024 2 ucx`). Goal: remote/local <= 1.10.
//! It starts the release `tandem-prefill-worker` found beside it, which `cargo bench`
//! does not rebuild: run `cargo build --release --bins` first after changing it.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]
#![allow(clippy::disallowed_types, reason = "measures wall time on purpose (std::time::Instant)")]

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::{decode_worker, prefill_worker, prompt_of, Worker};
use proto::worker::v1::decode_worker_client::DecodeWorkerClient;
use proto::worker::v1::{generate_response, GenerateRequest, PrefillTarget};
use tonic::transport::Channel;

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

async fn ttft(c: &mut DecodeWorkerClient<Channel>, req: GenerateRequest) -> Res<Duration> {
    let started = Instant::now();
    let mut stream = c.generate(req).await?.into_inner();
    let mut first = None;
    while let Some(msg) = stream.message().await? {
        match msg.event {
            Some(generate_response::Event::Token(_)) if first.is_none() => first = Some(started.elapsed()),
            Some(generate_response::Event::Error(e)) => return Err(format!("generate failed: {e:?}").into()),
            _ => {}
        }
    }
    first.ok_or_else(|| "no token".into())
}

fn stats(mut v: Vec<Duration>) -> (Duration, Duration) {
    v.sort();
    (v[0], v[v.len() / 2])
}

fn main() -> Res<()> {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let runs = args.first().copied().unwrap_or(7);
    let tokens = args.get(1).copied().unwrap_or(1024);
    let threads = args.get(2).copied().unwrap_or(2).to_string();
    let transport = std::env::args().skip(1).find(|a| a.parse::<usize>().is_err() && !a.starts_with('-'));
    let transport = transport.unwrap_or_else(|| "tcp".to_owned());
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async {
        let tok = common::tokenizer()?;
        let prompt = prompt_of(&tok, tokens)?;
        let p: Worker = prefill_worker("bench", &["--threads", &threads])?;
        let d: Worker = decode_worker(
            "bench",
            &["--threads", &threads, "--kv-load-failure-policy", "fail", "--kv-transport", &transport],
        )?;
        let mut c = DecodeWorkerClient::connect(format!("http://{}", d.addr("grpc")?)).await?;
        let target = PrefillTarget { worker_id: "p".into(), grpc_addr: p.addr("grpc")?.to_string() };
        let request = |salt: u64, remote: bool| GenerateRequest {
            request_id: format!("bench-{salt}"),
            token_ids: prompt.clone(),
            sampling: Some((&common::greedy(1)).into()),
            deadline_unix_ms: 0,
            prefill: if remote { vec![target.clone()] } else { vec![] },
            policy_override: None,
            cache_salt: salt,
            priority: 0,
            generated_ids: Vec::new(),
            determinism_fingerprint: Vec::new(),
        };
        // Warm-up: connections, page cache, allocator.
        ttft(&mut c, request(1_000_000, true)).await?;
        ttft(&mut c, request(1_000_001, false)).await?;
        let (mut remote, mut local) = (Vec::new(), Vec::new());
        for i in 0..runs as u64 {
            remote.push(ttft(&mut c, request(2 * i, true)).await?);
            local.push(ttft(&mut c, request(2 * i + 1, false)).await?);
        }
        let (rb, rm) = stats(remote);
        let (lb, lm) = stats(local);
        let kv_mib = (tokens.div_ceil(16) * 368_640) as f64 / (1 << 20) as f64;
        println!(
            "prompt {tokens} tokens ({kv_mib:.1} MiB of KV over {transport}), {threads} threads per engine, \
             {runs} runs each"
        );
        println!(
            "local  prefill TTFT: best {:>8.1} ms  median {:>8.1} ms",
            lb.as_secs_f64() * 1e3,
            lm.as_secs_f64() * 1e3
        );
        println!(
            "remote prefill TTFT: best {:>8.1} ms  median {:>8.1} ms",
            rb.as_secs_f64() * 1e3,
            rm.as_secs_f64() * 1e3
        );
        println!(
            "remote/local: best {:.3}x  median {:.3}x  (goal <= 1.10x)",
            rb.as_secs_f64() / lb.as_secs_f64(),
            rm.as_secs_f64() / lm.as_secs_f64()
        );
        Ok(())
    })
}
