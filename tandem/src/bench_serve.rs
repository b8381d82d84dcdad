//! `tandem bench serve`: the same seeded load against one or more
//! OpenAI-compatible servers, one after another, printed side by side with
//! each target's ratio to the first (the baseline). The load itself is the
//! `loadgen` crate's; this file is flags, a table and the JSON file.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use loadgen::{Arrival, Endpoint, Plan, PromptSource, Report, Summary};

/// A flag given twice takes the last value, so scripts can append overrides.
#[derive(clap::Args)]
#[command(args_override_self = true)]
pub struct Args {
    /// One target's base URL (e.g. http://127.0.0.1:8000).
    #[arg(long, value_name = "URL", conflicts_with = "targets")]
    url: Option<String>,
    /// A named target, NAME=URL; repeat to compare servers in one run. The
    /// first is the baseline of the ratios.
    #[arg(long = "target", id = "targets", value_name = "NAME=URL", value_parser = parse_target)]
    targets: Vec<Target>,
    /// The `model` field of the requests.
    #[arg(long, default_value = "SmolLM2-135M-Instruct")]
    model: String,
    /// completions (raw prompt) | chat (one user message). Default: completions,
    /// chat for `--workload chats`.
    #[arg(long)]
    endpoint: Option<Endpoint>,
    /// unique: generated prompts of `--prompt-tokens`, unique from their first
    /// word (a prefix cache cannot help) | chats: multi-turn chats on shared
    /// system prompts (`--system-prompts`, `--turns`, ...), where a prefix
    /// cache and prefix-aware routing can.
    #[arg(long, value_enum, default_value = "unique")]
    workload: Workload,
    /// chats: distinct system prompts, shared round-robin by the conversations.
    #[arg(long, default_value_t = 4)]
    system_prompts: usize,
    /// chats: length of each system prompt, about.
    #[arg(long, default_value_t = 200)]
    system_tokens: usize,
    /// chats: turns per conversation (`--requests` / turns conversations).
    #[arg(long, default_value_t = 4)]
    turns: usize,
    /// chats: length of each new user message, about.
    #[arg(long, default_value_t = 40)]
    user_tokens: usize,
    /// Requests per target.
    #[arg(long, default_value_t = 32)]
    requests: usize,
    /// Requests in flight (closed loop); for chats, conversations in flight.
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// Poisson arrivals at this many requests/s (chats: conversations/s)
    /// instead of the closed loop.
    #[arg(long)]
    rate: Option<f64>,
    /// Length of the generated prompts, about (unique per request).
    #[arg(long, default_value_t = 235)]
    prompt_tokens: usize,
    /// `max_tokens` of every request.
    #[arg(long, default_value_t = 64)]
    max_tokens: u32,
    /// Stream (SSE, with usage); false: whole answers, no TTFT or ITL.
    #[arg(long, default_value_t = true, num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set)]
    stream: bool,
    /// Seed of the prompts and arrivals (the same for every target; round k
    /// uses seed + k).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Rounds: each loads every target once, in turn, on its own seed, the
    /// order reversed every other round so that no target always follows
    /// another. With more than one, the tables of each round are followed by
    /// one over all rounds pooled (every record ranked together; tokens/s
    /// over the summed time) and the range of each round's ratios.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// Send `ignore_eos: true`, so every answer has `--max-tokens` tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Client-side limit per request, ms.
    #[arg(long, default_value_t = 300_000)]
    timeout_ms: u64,
    /// Server-side deadline sent as `x-request-timeout-ms`.
    #[arg(long)]
    deadline_ms: Option<u64>,
    /// Sent as `x-priority`.
    #[arg(long)]
    priority: Option<String>,
    /// Sent as `Authorization: Bearer KEY`.
    #[arg(long, env = "TANDEM_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Write the plan, summaries and every request's record here (JSON).
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum Workload {
    Unique,
    Chats,
}

#[derive(Debug, Clone)]
struct Target {
    name: String,
    url: String,
}

fn parse_target(s: &str) -> Result<Target, String> {
    match s.split_once('=') {
        Some((n, u)) if !n.is_empty() && !u.is_empty() => Ok(Target { name: n.to_owned(), url: u.to_owned() }),
        _ => Err(format!("`{s}`: expected NAME=URL")),
    }
}

pub fn run(a: Args) -> Result<()> {
    let targets = match (&a.url, a.targets.is_empty()) {
        (Some(u), _) => vec![Target { name: "target".into(), url: u.clone() }],
        (None, false) => a.targets.clone(),
        (None, true) => bail!("give --url URL or one or more --target NAME=URL"),
    };
    let mut plan = Plan::new(targets[0].url.clone(), a.model.clone());
    plan.endpoint = a.endpoint.unwrap_or(match a.workload {
        Workload::Unique => Endpoint::Completions,
        Workload::Chats => Endpoint::Chat,
    });
    plan.requests = a.requests;
    plan.arrival = match a.rate {
        Some(rate) => Arrival::Poisson { rate },
        None => Arrival::Closed { concurrency: a.concurrency },
    };
    plan.prompts = match a.workload {
        Workload::Unique => PromptSource::Generated { tokens: a.prompt_tokens },
        Workload::Chats => PromptSource::Chats {
            system_prompts: a.system_prompts,
            system_tokens: a.system_tokens,
            turns: a.turns,
            user_tokens: a.user_tokens,
        },
    };
    plan.max_tokens = a.max_tokens;
    plan.stream = a.stream;
    plan.ignore_eos = a.ignore_eos;
    plan.seed = a.seed;
    plan.timeout = Duration::from_millis(a.timeout_ms);
    plan.deadline = a.deadline_ms.map(Duration::from_millis);
    plan.priority = a.priority.clone();
    plan.api_key = a.api_key.clone();

    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    // rounds[k][i]: target i's report in round k (targets in their given order), and
    // its summary.
    let mut rounds: Vec<Vec<Report>> = Vec::new();
    let mut round_summaries: Vec<Vec<Summary>> = Vec::new();
    let seed = a.seed;
    let arrival = arrival_text(&plan.arrival);
    for k in 0..a.rounds {
        plan.seed = seed.wrapping_add(u64::from(k));
        let mut reports: Vec<Option<Report>> = vec![None; targets.len()];
        for i in round_order(targets.len(), k) {
            let t = &targets[i];
            plan.base_url = t.url.clone();
            eprintln!(
                "bench serve: round {}/{}: {} ({}): {} requests, {arrival}, seed {}",
                k + 1,
                a.rounds,
                t.name,
                t.url,
                plan.requests,
                plan.seed
            );
            let report = rt.block_on(loadgen::run(&plan)).with_context(|| format!("target {}", t.name))?;
            reports[i] = Some(report);
        }
        let reports: Vec<Report> = reports.into_iter().flatten().collect();
        let summaries: Vec<Summary> = reports.iter().map(Report::summary).collect();
        let rows: Vec<(&str, Summary)> =
            targets.iter().map(|t| t.name.as_str()).zip(summaries.iter().cloned()).collect();
        print_table(&plan, &rows, &format!("round {}/{}, seed {}", k + 1, a.rounds, plan.seed));
        rounds.push(reports);
        round_summaries.push(summaries);
    }
    plan.seed = seed;
    let pooled: Vec<Report> =
        (0..targets.len()).map(|i| Report::pooled(rounds.iter().map(|reports| &reports[i]))).collect();
    let summaries: Vec<(&str, Summary)> =
        targets.iter().zip(&pooled).map(|(t, r)| (t.name.as_str(), r.summary())).collect();
    if a.rounds > 1 {
        print_table(
            &plan,
            &summaries,
            &format!("all {} rounds pooled, seeds {seed}-{}", a.rounds, seed.wrapping_add(u64::from(a.rounds - 1))),
        );
        print_ratio_ranges(&targets, &round_summaries);
    }
    if let Some(path) = &a.json {
        // The plan as run, less the URL: each target has its own.
        let mut plan_json = serde_json::to_value(&plan)?;
        if let Some(o) = plan_json.as_object_mut() {
            o.remove("base_url");
        }
        let json = serde_json::json!({
            "plan": plan_json,
            "rounds": a.rounds,
            "targets": targets.iter().enumerate().zip(&summaries).map(|((i, t), (_, s))| serde_json::json!({
                "name": t.name, "url": t.url, "summary": s,
                "rounds": rounds.iter().map(|reports| &reports[i]).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
        });
        std::fs::write(path, serde_json::to_string_pretty(&json)?)
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("bench serve: wrote {}", path.display());
    }
    Ok(())
}

/// The order targets are loaded in round `k`: as given in even rounds,
/// reversed in odd ones (drift on the host then hits every target alike).
fn round_order(n: usize, k: u32) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    if k % 2 == 1 {
        order.reverse();
    }
    order
}

/// For each target after the first, the lowest and highest of the rounds'
/// ratios to the first (output tok/s, TTFT p99, ITL p99); `summaries[k][i]`
/// is target i's in round k.
fn print_ratio_ranges(targets: &[Target], summaries: &[Vec<Summary>]) {
    for (i, t) in targets.iter().enumerate().skip(1) {
        let each = |f: &dyn Fn(&Summary) -> Option<f64>| -> String {
            let mut r: Vec<f64> = summaries.iter().filter_map(|s| ratio_of(f(&s[i]), f(&s[0]))).collect();
            r.sort_by(f64::total_cmp);
            match (r.first(), r.last()) {
                (Some(lo), Some(hi)) => format!("{lo:.2}-{hi:.2}x"),
                _ => "-".into(),
            }
        };
        println!(
            "{} / {}, range over rounds: out tok/s {}, TTFT p99 {}, ITL p99 {}",
            t.name,
            targets[0].name,
            each(&|s| Some(s.output_tok_per_s)),
            each(&|s| secs(s.ttft.p99)),
            each(&|s| secs(s.itl.p99))
        );
    }
}

/// A latency for the table: ms below a second, else s.
fn dur(d: Option<Duration>) -> String {
    match d {
        None => "-".into(),
        Some(d) if d < Duration::from_secs(1) => format!("{:.1} ms", d.as_secs_f64() * 1e3),
        Some(d) => format!("{:.2} s", d.as_secs_f64()),
    }
}

/// `a / b`, when both are known and `b` is positive.
fn ratio_of(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

fn ratio(a: Option<f64>, b: Option<f64>) -> String {
    ratio_of(a, b).map_or("-".into(), |r| format!("{r:.2}x"))
}

fn secs(d: Option<Duration>) -> Option<f64> {
    d.map(|d| d.as_secs_f64())
}

fn arrival_text(arrival: &Arrival) -> String {
    match arrival {
        Arrival::Closed { concurrency } => format!("concurrency {concurrency}"),
        Arrival::Poisson { rate } => format!("Poisson {rate} req/s"),
    }
}

fn print_table(plan: &Plan, rows: &[(&str, Summary)], title: &str) {
    let mean = |s: &Summary| s.mean_prompt_tokens.map_or("-".into(), |m| format!("{m:.0}"));
    let computed = |s: &Summary| s.computed_prompt_tokens.map_or("-".into(), |c| c.to_string());
    let workload = match &plan.prompts {
        PromptSource::Chats { system_prompts, system_tokens, turns, user_tokens } => format!(
            "chats ({system_prompts} system prompts of ~{system_tokens} tokens, {turns} turns of ~{user_tokens}-token user messages)"
        ),
        PromptSource::Generated { tokens } => format!("unique prompts of ~{tokens} tokens"),
        PromptSource::List(l) => format!("{} listed prompts", l.len()),
    };
    println!(
        "serving benchmark ({title}): {workload}, {} requests a round, max_tokens {}, {}, stream {}",
        plan.requests,
        plan.max_tokens,
        arrival_text(&plan.arrival),
        plan.stream
    );
    let w = rows.iter().map(|(n, _)| n.len()).chain(rows.iter().skip(1).map(|(n, _)| n.len() + 8)).max().unwrap_or(6);
    println!(
        "{:<w$} {:>7} {:>10} {:>8} {:>9} {:>10} {:>10} {:>10} {:>10} {:>10}",
        "target", "ok/err", "out tok/s", "prompt", "computed", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "e2e p50"
    );
    for (name, s) in rows {
        println!(
            "{name:<w$} {:>7} {:>10.1} {:>8} {:>9} {:>10} {:>10} {:>10} {:>10} {:>10}",
            format!("{}/{}", s.ok, s.errors),
            s.output_tok_per_s,
            mean(s),
            computed(s),
            dur(s.ttft.p50),
            dur(s.ttft.p99),
            dur(s.itl.p50),
            dur(s.itl.p99),
            dur(s.e2e.p50)
        );
    }
    if let Some((base_name, base)) = rows.first() {
        for (name, s) in rows.iter().skip(1) {
            let computed = |s: &Summary| s.computed_prompt_tokens.map(|c| c as f64);
            println!(
                "{:<w$} {:>7} {:>10} {:>8} {:>9} {:>10} {:>10} {:>10} {:>10} {:>10}",
                format!("{name} / {base_name}"),
                "",
                ratio(Some(s.output_tok_per_s), Some(base.output_tok_per_s)),
                "",
                ratio(computed(s), computed(base)),
                ratio(secs(s.ttft.p50), secs(base.ttft.p50)),
                ratio(secs(s.ttft.p99), secs(base.ttft.p99)),
                ratio(secs(s.itl.p50), secs(base.itl.p50)),
                ratio(secs(s.itl.p99), secs(base.itl.p99)),
                ratio(secs(s.e2e.p50), secs(base.e2e.p50))
            );
        }
    }
    for (name, s) in rows {
        if s.errors > 0 {
            let counts: Vec<String> = s.counts.iter().map(|(k, v)| format!("{k}: {v}")).collect();
            println!("{name}: {}", counts.join(", "));
        }
    }
    println!(
        "prompt = mean usage.prompt_tokens; computed = prompt tokens the server computed, summed over completed \
         requests (usage.prompt_tokens - prompt_tokens_details.cached_tokens; - when not reported); ratios are \
         target / baseline (tok/s: higher is better; computed and latencies: lower)"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse_as_name_equals_url() {
        let t = parse_target("llama-server=http://127.0.0.1:1");
        assert_eq!(t.map(|t| (t.name, t.url)), Ok(("llama-server".into(), "http://127.0.0.1:1".into())));
        assert!(parse_target("http://127.0.0.1:1").is_err());
        assert!(parse_target("=http://x").is_err());
    }

    #[test]
    fn table_cells() {
        assert_eq!(dur(Some(Duration::from_micros(33_260))), "33.3 ms");
        assert_eq!(dur(Some(Duration::from_millis(3712))), "3.71 s");
        assert_eq!(dur(None), "-");
        assert_eq!(ratio(Some(3.0), Some(2.0)), "1.50x");
        assert_eq!(ratio(Some(3.0), Some(0.0)), "-");
    }

    #[test]
    fn rounds_alternate_the_order_of_targets() {
        assert_eq!(round_order(3, 0), [0, 1, 2]);
        assert_eq!(round_order(3, 1), [2, 1, 0]);
        assert_eq!(round_order(3, 2), [0, 1, 2]);
        assert_eq!(round_order(1, 1), [0]);
    }
}
