//! `tandem bench handoff`: what handing a prompt's KV from a prefill engine
//! to a decode engine costs beyond moving its bytes, over the TCP KV
//! transport on loopback, for several prompt lengths, in one process on one
//! clock.
//!
//! Per prompt length and repetition, interleaved:
//! - **raw**: the prompt's KV bytes (every layer's K and V of its blocks)
//!   over a plain loopback TCP connection, 1 MiB writes, read into one
//!   destination buffer: what any TCP hand-off has to pay at least;
//! - **hand-off**: a real streaming prefill on engine A whose layers go out
//!   as they are computed (gathered into recycled buffers on A's thread, as
//!   the prefill worker does) through `TcpKvSender` to a `TcpKvServer`,
//!   whose sink posts each accepted frame to engine B's thread, which writes
//!   it into B's pool; then, as the prefill worker does once the prefill is
//!   done, `Complete`/`Ack`, `take_ready` and `add_prefilled` on B. Timed
//!   from A's prefill done (its last layer written and its first token
//!   sampled: the earliest moment any design can answer) to B holding the
//!   sequence with its KV, ready to stream token 0: the transfer still in
//!   flight, the acknowledgement and the join; the prefill's compute is not
//!   in it. Beside it: A's compute after its last KV write (the rest of the
//!   last layer, the logits, the sampling), which a streaming transfer
//!   overlaps, and B's first decode step (token 1).
//!
//! The target at 1,024 tokens: hand-off ≤ 1.3 × raw + 1 ms.

#![allow(clippy::disallowed_types, reason = "a benchmark: wall time on purpose")]

use std::path::PathBuf;
use std::sync::{mpsc, Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _, Result};
use engine::batch::{Engine, EngineConfig, LayerView, Request};
use engine::model::Model;
use engine::sampler::SampledToken;
use kvtransfer::{
    BlockSink, Buffer, Buffers, LayoutFingerprint, OwnedPayload, Peer, Receiver, ReceiverConfig, Reservation,
    TcpKvSender, TcpKvServer, TcpSenderConfig, TcpServerConfig, VersionGroup, WriteInstruction,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use types::kv::{BlockId, KvLayout};
use types::sampling::SamplingParams;

#[derive(clap::Args)]
pub struct Args {
    /// GGUF model (default: the cached SmolLM2 file).
    #[arg(long, env = "TANDEM_MODEL")]
    model: Option<PathBuf>,
    /// Model compute threads of each engine.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Prompt lengths, tokens.
    #[arg(long, value_delimiter = ',', default_value = "128,1024,4096")]
    prompt_tokens: Vec<usize>,
    /// Repetitions per length (medians are printed, with min and max).
    #[arg(long, default_value_t = 5)]
    reps: usize,
}

/// Blocks of each engine's pool: a 4,096-token prompt and room to spare.
const KV_BLOCKS: usize = 512;
/// Bytes per write of the raw baseline.
const PIECE: usize = 1 << 20;

pub fn run(a: &Args) -> Result<()> {
    if a.threads == 0 || a.reps == 0 || a.prompt_tokens.iter().any(|n| *n < 2) {
        bail!("--threads and --reps must be positive, every --prompt-tokens at least 2");
    }
    let path = crate::load::model_path(a.model.clone())?;
    let engine = |path: &std::path::Path| -> Result<Engine> {
        let (weights, _) = engine::weights::Weights::from_gguf(path)?;
        let model = Model::new(weights, a.threads)?;
        let cfg = EngineConfig { kv_blocks: KV_BLOCKS, prefix_cache: false, ..EngineConfig::default() };
        Ok(Engine::new(model, cfg, Vec::new())?)
    };
    let (prefill, decode) = (engine(&path)?, engine(&path)?);
    let layout = *prefill.pool().layout();
    let vocab = prefill.model().config().vocab as u32;
    let context = prefill.model().config().context;
    if let Some(n) = a.prompt_tokens.iter().find(|n| **n >= context || n.div_ceil(layout.block_size) > KV_BLOCKS) {
        bail!("a {n}-token prompt does not fit the model's context ({context}) or {KV_BLOCKS} KV blocks");
    }
    println!("cpu: {}", crate::bench::cpu_summary());
    println!(
        "hand-off benchmark: {} ({} thread(s) per engine), tcp on loopback, {} reps per length",
        path.display(),
        a.threads,
        a.reps
    );
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let mut bench = rt.block_on(Bench::start(prefill, decode, layout))?;
    println!(
        "{:>7} {:>8} {:>22} {:>22} {:>12} {:>8} {:>12} {:>10}",
        "tokens",
        "KV MiB",
        "raw ms (min-max)",
        "hand-off ms (min-max)",
        "hand-off/raw",
        "target",
        "A's tail ms",
        "decode ms"
    );
    for &n in &a.prompt_tokens {
        let (mut raw, mut handoff, mut tail, mut step) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for rep in 0..a.reps {
            let prompt = tokens(n, rep as u64, vocab);
            let bytes = n.div_ceil(layout.block_size) * layout.n_layers * 2 * layout.side_bytes();
            raw.push(rt.block_on(raw_tcp(bytes))?);
            let h = rt.block_on(bench.handoff(prompt, 1000 * n as u64 + rep as u64))?;
            handoff.push(h.handoff);
            tail.push(h.tail);
            step.push(h.first_step);
        }
        let bytes = n.div_ceil(layout.block_size) * layout.n_layers * 2 * layout.side_bytes();
        let (r, h, t, s) = (spread(&mut raw), spread(&mut handoff), spread(&mut tail), spread(&mut step));
        let target = 1.3 * r.1 + 1.0;
        let verdict = if h.1 <= target { "met" } else { "missed" };
        println!(
            "{n:>7} {:>8.1} {:>8.2} ({:>5.2}-{:>5.2}) {:>8.2} ({:>5.2}-{:>5.2}) {:>11.2}x {:>8} {:>12.1} {:>10.1}",
            bytes as f64 / (1 << 20) as f64,
            r.1,
            r.0,
            r.2,
            h.1,
            h.0,
            h.2,
            h.1 / r.1,
            verdict,
            t.1,
            s.1
        );
    }
    println!("target: hand-off median <= 1.3 x raw median + 1 ms (held to it at 1,024 tokens)");
    rt.block_on(bench.stop());
    Ok(())
}

/// (min, median, max) in milliseconds.
fn spread(v: &mut [Duration]) -> (f64, f64, f64) {
    v.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    (ms(v[0]), ms(v[v.len() / 2]), ms(v[v.len() - 1]))
}

/// Seeded pseudo-random prompt tokens.
fn tokens(n: usize, seed: u64, vocab: u32) -> Vec<u32> {
    let mut rng = types::rng::XorShift64::new(0x5DEE_CE66_D1CE_4E5B ^ seed.wrapping_mul(0x2545_F491_4F6C_DD1D));
    (0..n).map(|_| rng.below(u64::from(vocab)) as u32).collect()
}

/// `bytes` over a fresh loopback TCP connection: first write to last read.
async fn raw_tcp(bytes: usize) -> Result<Duration> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let src = vec![0x5au8; bytes];
    let reader = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await?;
        let mut dst = vec![0u8; bytes];
        s.read_exact(&mut dst).await?;
        Ok::<_, std::io::Error>(Instant::now())
    });
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.set_nodelay(true)?;
    let start = Instant::now();
    for piece in src.chunks(PIECE) {
        s.write_all(piece).await?;
    }
    let end = reader.await??;
    Ok(end - start)
}

/// What the decode engine's thread is told.
enum ToDecode {
    /// Reserve blocks for a prompt of this many tokens and register them.
    Reserve(usize, mpsc::Sender<Result<Reservation, String>>),
    /// An accepted frame, to write into the pool (from the server's sink).
    Write(WriteInstruction, OwnedPayload),
    /// The prefill's first token; then the `Ack` arrived: join and step.
    Join {
        req: Request,
        r: Reservation,
        first: SampledToken,
        done: mpsc::Sender<Result<Joined, String>>,
    },
    Stop,
}

struct Joined {
    /// When B held the sequence with its KV.
    at: Instant,
    /// B's first decode step.
    step: Duration,
}

/// The server's sink: each accepted frame to the decode thread, in order.
#[derive(Clone)]
struct ToThread(mpsc::Sender<ToDecode>);

impl BlockSink for ToThread {
    fn write_layer(&mut self, layer: usize, blocks: &[BlockId], k: &[u8], v: &[u8]) -> Result<(), String> {
        let w = WriteInstruction {
            reservation: Reservation { id: kvtransfer::ReservationId(0), generation: 0 },
            layer,
            blocks: blocks.to_vec(),
        };
        let payload: OwnedPayload = Box::new([k, v].concat());
        self.write_layer_owned(w, payload)
    }

    fn write_layer_owned(&mut self, w: WriteInstruction, payload: OwnedPayload) -> Result<(), String> {
        self.0.send(ToDecode::Write(w, payload)).map_err(|_| "the decode thread is gone".to_owned())
    }
}

struct Figures {
    /// Prefill done to B joined.
    handoff: Duration,
    /// A's last KV write to its prefill done.
    tail: Duration,
    first_step: Duration,
}

struct Bench {
    prefill: Arc<Mutex<Engine>>,
    layout: KvLayout,
    decode: mpsc::Sender<ToDecode>,
    decode_thread: Option<thread::JoinHandle<()>>,
    server: TcpKvServer,
    peer: Peer,
    buffers: Buffers,
}

impl Bench {
    async fn start(prefill: Engine, decode: Engine, layout: KvLayout) -> Result<Self> {
        let peer = Peer {
            version_group: VersionGroup::new("bench").map_err(|e| anyhow!("{e}"))?,
            fingerprint: LayoutFingerprint::new(&layout, &[0; 32], &[0; 32]),
        };
        let receiver = Arc::new(Mutex::new(
            Receiver::new(peer.clone(), ReceiverConfig::new(layout)).map_err(|e| anyhow!("receiver: {e}"))?,
        ));
        let (tx, rx) = mpsc::channel();
        let rx_for_thread = receiver.clone();
        let decode_thread = thread::spawn(move || decode_loop(decode, rx_for_thread, rx));
        let server = TcpKvServer::bind("127.0.0.1:0", receiver, ToThread(tx.clone()), TcpServerConfig::default())
            .await
            .context("binding the KV server")?;
        Ok(Self {
            prefill: Arc::new(Mutex::new(prefill)),
            layout,
            decode: tx,
            decode_thread: Some(decode_thread),
            server,
            peer,
            buffers: Buffers::new(64 << 20),
        })
    }

    async fn stop(mut self) {
        let _ = self.decode.send(ToDecode::Stop);
        if let Some(t) = self.decode_thread.take() {
            let _ = tokio::task::spawn_blocking(move || t.join()).await;
        }
    }

    /// One prompt handed from A to B; see the module doc.
    async fn handoff(&mut self, prompt: Vec<u32>, id: u64) -> Result<Figures> {
        let (reply, reserved) = mpsc::channel();
        self.decode.send(ToDecode::Reserve(prompt.len(), reply)).map_err(|_| anyhow!("decode thread gone"))?;
        let r = tokio::task::spawn_blocking(move || reserved.recv()).await??.map_err(|e| anyhow!(e))?;
        let mut tx =
            TcpKvSender::connect(self.server.local_addr(), &self.peer, self.layout, TcpSenderConfig::default())
                .await
                .context("connecting")?;

        // A's streaming sink: gather into recycled buffers, note the time of each call.
        let (layers_tx, mut layers) = tokio::sync::mpsc::unbounded_channel::<(usize, usize, Buffer, Buffer)>();
        let last_layer = Arc::new(Mutex::new(None::<Instant>));
        let (buffers, last) = (self.buffers.clone(), last_layer.clone());
        let sink: engine::batch::LayerSink = Box::new(move |view: LayerView<'_>| {
            let (mut k, mut v) = (buffers.take(), buffers.take());
            if view.gather_into(&mut k, &mut v).is_ok() {
                let _ = layers_tx.send((view.layer, view.first_block, k, v));
            }
            *last.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
        });
        let params = SamplingParams { max_tokens: 2, ignore_eos: true, ..SamplingParams::default() };
        let req = Request { id, prompt, params, salt: 0, priority: Default::default(), generated: Vec::new() };
        let prefill = self.prefill.clone();
        let req_a = req.clone();
        let computing = tokio::task::spawn_blocking(move || -> Result<(SampledToken, Instant), String> {
            let mut e = prefill.lock().unwrap_or_else(|e| e.into_inner());
            e.add_prefill_streaming(req_a, sink).map_err(|e| e.to_string())?;
            let first = loop {
                if let Some(ev) = e.step().map_err(|e| e.to_string())?.into_iter().next() {
                    break ev.token;
                }
            };
            let done = Instant::now();
            e.release_held(id);
            Ok((first, done))
        });
        while let Some((layer, first_block, k, v)) = layers.recv().await {
            tx.send_blocks(r, layer, first_block, &k, &v).await.context("sending a layer")?;
        }
        // As the prefill worker: Complete once the prefill is done.
        let (first, prefilled) = computing.await?.map_err(|e| anyhow!("prefill: {e}"))?;
        tx.complete(r).await.context("Complete")?;
        let (done, joined) = mpsc::channel();
        self.decode.send(ToDecode::Join { req, r, first, done }).map_err(|_| anyhow!("decode thread gone"))?;
        let joined = tokio::task::spawn_blocking(move || joined.recv()).await??.map_err(|e| anyhow!(e))?;
        let last = last_layer.lock().unwrap_or_else(|e| e.into_inner()).ok_or_else(|| anyhow!("no layer streamed"))?;
        Ok(Figures {
            handoff: joined.at.saturating_duration_since(prefilled),
            tail: prefilled.saturating_duration_since(last),
            first_step: joined.step,
        })
    }
}

fn lock(r: &Mutex<Receiver>) -> std::sync::MutexGuard<'_, Receiver> {
    r.lock().unwrap_or_else(|e| e.into_inner())
}

/// Engine B's thread: reserves, writes accepted frames into the pool in
/// arrival order, and joins a sequence once told its `Ack` arrived (every
/// frame it acknowledged was posted here before).
fn decode_loop(mut e: Engine, receiver: Arc<Mutex<Receiver>>, rx: mpsc::Receiver<ToDecode>) {
    while let Ok(m) = rx.recv() {
        match m {
            ToDecode::Reserve(n, reply) => {
                let got = e.reserve_blocks(e.blocks_for(n)).map_err(|e| e.to_string()).and_then(|blocks| {
                    lock(&receiver)
                        .reserve(blocks, Duration::from_secs(60), tokio::time::Instant::now())
                        .map_err(|e| e.to_string())
                });
                let _ = reply.send(got);
            }
            ToDecode::Write(w, payload) => {
                let (k, v) = w.split_payload((*payload).as_ref());
                if let Err(err) = e.pool_mut().scatter_layer(w.layer, &w.blocks, k, v) {
                    eprintln!("writing received KV failed: {err}");
                }
            }
            ToDecode::Join { req, r, first, done } => {
                let id = req.id;
                let joined = lock(&receiver)
                    .take_ready(r)
                    .map_err(|e| e.to_string())
                    .and_then(|blocks| e.add_prefilled(req, blocks, &first).map_err(|e| e.to_string()));
                let at = Instant::now();
                let result = joined.and_then(|_| {
                    let t = Instant::now();
                    let events = e.step().map_err(|e| e.to_string())?;
                    let step = t.elapsed();
                    if !events.iter().any(|ev| ev.id == id) {
                        return Err("the joined sequence produced no token".to_owned());
                    }
                    e.abort(id);
                    Ok(Joined { at, step })
                });
                let _ = done.send(result);
            }
            ToDecode::Stop => return,
        }
    }
}
