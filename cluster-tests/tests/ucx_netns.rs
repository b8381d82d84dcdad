//! Across hosts: a prefill worker and a decode worker in two network
//! namespaces joined only by a veth pair, KV over UCX with `UCX_TLS=tcp` on
//! that veth. Remote prefill gives the same greedy tokens as the decode
//! worker's own prefill of the same prompts, and every KV byte crossed the
//! link: nothing in the transport assumes one host (no shared memory, no
//! CMA, no loopback address can be reached between the namespaces).
//!
//! Needs root, `ip` (iproute2), the workspace binaries and the model. A
//! machine without network namespaces fails this test; it does not skip.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]

use std::time::Duration;

use drills::netns::Netns;
use facts::metrics::decode::{KV_RECEIVED_BYTES, TRANSPORT_INFO, UCX_LANDING_IN_USE};
use opskit::process::{Launch, Proc};
use proto::worker::v1::decode_worker_client::DecodeWorkerClient;
use proto::worker::v1::{generate_response, GenerateRequest, PrefillTarget};

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

const WAIT: Duration = Duration::from_secs(120);
const GROUP: &str = "g-ucx";
const MAX_TOKENS: u32 = 6;
/// K+V bytes of one 16-token block of SmolLM2-135M (f16 KV): layers x (K, V) x heads x dim x 2 x 16.
const BLOCK_BYTES: usize = 30 * 2 * 3 * 64 * 2 * 16;

async fn worker(bin: &str, ns: &Netns, ip: &str, ucx_if: &str, extra: &[&str]) -> opskit::Result<Proc> {
    let mut args = vec![
        "--version-group".to_owned(),
        GROUP.to_owned(),
        "--threads".to_owned(),
        "1".to_owned(),
        "--kv-blocks".to_owned(),
        "256".to_owned(),
        "--coordinator-silence-fence-ms".to_owned(),
        "0".to_owned(),
        "--grpc".to_owned(),
        format!("{ip}:0"),
        "--metrics".to_owned(),
        format!("{ip}:0"),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let wants: &[&str] = if extra.is_empty() { &["grpc", "metrics"] } else { &["grpc", "metrics", "transfer"] };
    Launch::bin(bin)
        .prefix(&ns.exec_prefix())
        .env("UCX_TLS", "tcp")
        .env("UCX_NET_DEVICES", ucx_if)
        .args(args)
        .wants(wants)
        .wait(WAIT)
        .start()
        .await
}

async fn generate(
    c: &mut DecodeWorkerClient<tonic::transport::Channel>,
    id: &str,
    prompt: &[u32],
    prefill: Vec<PrefillTarget>,
) -> Result<(Vec<u32>, bool), String> {
    let greedy = types::sampling::SamplingParams { max_tokens: MAX_TOKENS, ignore_eos: true, ..Default::default() };
    let req = GenerateRequest {
        request_id: id.into(),
        token_ids: prompt.to_vec(),
        sampling: Some((&greedy).into()),
        deadline_unix_ms: 0,
        prefill,
        policy_override: None,
        cache_salt: 0,
        priority: 0,
        generated_ids: Vec::new(),
        determinism_fingerprint: Vec::new(),
    };
    let collect = async {
        let mut stream = c.generate(req).await.map_err(|s| format!("Generate {id}: {s}"))?.into_inner();
        let mut tokens = Vec::new();
        while let Some(msg) = stream.message().await.map_err(|s| format!("Generate {id} stream: {s}"))? {
            match msg.event {
                Some(generate_response::Event::Token(t)) => tokens.push(t.id),
                Some(generate_response::Event::Finished(f)) => return Ok((tokens, f.prefilled_remotely)),
                Some(generate_response::Event::Error(e)) => return Err(format!("Generate {id}: {e:?}")),
                None => return Err(format!("Generate {id}: an empty event")),
            }
        }
        Err(format!("Generate {id}: the stream ended without Finished"))
    };
    opskit::within(&format!("Generate {id} to end"), WAIT, collect).await.map_err(|e| e.to_string())?
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_prefill_over_ucx_tcp_between_two_namespaces() -> TestResult {
    let (prefill_ns, decode_ns) = (Netns::create()?, Netns::create()?);
    let link = prefill_ns.join(&decode_ns)?;
    // The prefill worker is reachable only over the join; the decode worker's
    // gRPC also on its host link, for this test.
    let prefill = worker("tandem-prefill-worker", &prefill_ns, &link.here_ip.to_string(), &link.here_if, &[]).await?;
    let decode = worker(
        "tandem-decode-worker",
        &decode_ns,
        &decode_ns.ns_ip.to_string(),
        &link.there_if,
        &["--kv-transport", "ucx", "--kv-load-failure-policy", "fail"],
    )
    .await?;
    let grpc = decode.addr("grpc")?;
    let mut c = opskit::within("gRPC connect", WAIT, DecodeWorkerClient::connect(format!("http://{grpc}"))).await??;
    let target = PrefillTarget { worker_id: "prefill-ns".into(), grpc_addr: prefill.addr("grpc")? };
    // Token ids of the model's vocabulary (49,152), no tokenizer needed.
    let prompt = |n: u32| (0..n).map(|i| 200 + (i * 37) % 9000).collect::<Vec<u32>>();
    let prompts = [prompt(37), prompt(200)];
    let mut blocks = 0;
    for (i, p) in prompts.iter().enumerate() {
        // The decode worker's own prefill (no prefill worker named) is the reference.
        let (want, remote) = generate(&mut c, &format!("local-{i}"), p, vec![]).await?;
        assert!(!remote, "the reference run prefilled locally");
        let (got, remote) = generate(&mut c, &format!("ucx-{i}"), p, vec![target.clone()]).await?;
        assert!(remote, "prompt {i}: the KV came from the other namespace");
        assert_eq!(got, want, "prompt of {} tokens: remote prefill over ucx/tcp differs", p.len());
        blocks += p.len().div_ceil(16);
    }
    let metrics = decode.addr("metrics")?;
    let page = opskit::prom::scrape_within(&metrics, WAIT).await?;
    assert_eq!(page.get(KV_RECEIVED_BYTES, &[])?, (blocks * BLOCK_BYTES) as f64, "every block crossed the veth");
    assert_eq!(page.get(TRANSPORT_INFO, &[("transport", "ucx"), ("ucx_tls", "tcp")])?, 1.0);
    // Every transfer completed: no landing range is held or quarantined.
    opskit::poll("the landing region empty", WAIT, || async {
        let page = opskit::prom::scrape_within(&metrics, WAIT).await?;
        Ok::<_, opskit::Error>((page.get(UCX_LANDING_IN_USE, &[])? == 0.0).then_some(()))
    })
    .await?;
    Ok(())
}
