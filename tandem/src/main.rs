//! `tandem`: the command-line entry to the engine and the local cluster.
//!
//! Output contract: commands that generate text print only that text on
//! stdout; logs, progress and statistics go to stderr. Errors exit non-zero
//! with a message naming what is wrong.

mod bench;
mod bench_batched;
mod bench_handoff;
mod bench_interference;
mod bench_lookup;
mod bench_panels;
mod bench_scale;
mod bench_serve;
mod bench_stall;
mod chaos;
mod convert;
mod drain;
mod drill;
mod generate;
mod load;
mod sim;
mod up;

use clap::{Parser, Subcommand};
use facts::log::LogFormat;

#[derive(Parser)]
#[command(name = "tandem", version, about = "Disaggregated prefill/decode LLM serving")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
    /// Log line format of this command's own lines (and, inherited through the
    /// environment, of the processes `tandem up` starts): `text` or `json`. The
    /// filter is TANDEM_LOG, else RUST_LOG, else `info`. Env: TANDEM_LOG_FORMAT.
    #[arg(long, global = true, env = "TANDEM_LOG_FORMAT", default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate text from a prompt or one chat message, streamed to stdout.
    Generate(generate::Args),
    /// Dequantize a GGUF model into an HF safetensors checkpoint directory.
    Convert(convert::Args),
    /// Benchmarks (ratios against a baseline measured in the same run).
    #[command(subcommand)]
    Bench(bench::Cmd),
    /// Start a local cluster (prefill and decode workers, coordinator) serving the OpenAI API.
    Up(Box<up::Args>),
    /// Failure drills: start a small cluster, apply a fault, drive load, check invariants.
    Drill(drill::Args),
    /// Seeded overlapping faults on a local cluster under load, invariants checked throughout.
    Chaos(chaos::Args),
    /// Drain one component of a running cluster (named in its state file) and wait until
    /// it has exited, and, under a supervisor, started again.
    Drain(drain::Args),
    /// Simulated workers (many per process) registered in etcd, for real coordinators
    /// to be measured against at fleet sizes: the worker API at a modelled pace.
    Sim(sim::Args),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    if let Err(e) = facts::log::init(cli.log_format) {
        eprintln!("error: {e}");
        return std::process::ExitCode::FAILURE;
    }
    let result = match cli.cmd {
        Cmd::Generate(a) => generate::run(a),
        Cmd::Convert(a) => convert::run(a),
        Cmd::Bench(c) => bench::run(c),
        Cmd::Up(a) => up::run(*a),
        Cmd::Drill(a) => drill::run(a),
        Cmd::Chaos(a) => chaos::run(a),
        Cmd::Drain(a) => drain::run(a),
        Cmd::Sim(a) => sim::run(a),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
