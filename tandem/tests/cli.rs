//! The `tandem` binary as a user runs it: stdout carries only generated
//! text, stats go to stderr as one JSON line, and bad input exits non-zero
//! with an `error:` line and no panic.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]

use std::process::{Command, Output};

fn tandem(args: &[&str]) -> Output {
    let model = engine::paths::default_model_path();
    assert!(model.is_file(), "test model {} not found: run `make model`", model.display());
    Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(args)
        .env("TANDEM_MODEL", &model)
        .env("TANDEM_THREADS", "2")
        .output()
        .expect("run tandem")
}

fn text(b: &[u8]) -> String {
    String::from_utf8(b.to_vec()).expect("utf-8 output")
}

fn assert_clean_failure(out: &Output, needle: &str) {
    let err = text(&out.stderr);
    assert!(!out.status.success(), "expected failure, stdout: {}", text(&out.stdout));
    assert!(err.contains("error:"), "no error line in: {err}");
    assert!(err.contains(needle), "stderr lacks {needle:?}: {err}");
    assert!(!err.contains("panicked"), "panic: {err}");
}

#[test]
fn generate_prints_only_the_continuation_and_stats_json() {
    let out = tandem(&["generate", "--prompt", "The capital of France is", "--max-tokens", "3", "--stats"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert_eq!(stdout, " Paris.\n\n", "greedy continuation (3 tokens: ' Paris', '.', newline) plus the final newline");
    let stats: serde_json::Value =
        serde_json::from_str(text(&out.stderr).lines().last().expect("stats line")).expect("json");
    assert_eq!(stats["prompt_tokens"], 5);
    assert_eq!(stats["generated_tokens"], 3);
    assert_eq!(stats["threads"], 2);
    assert!(stats["prefill_ms"].as_f64().expect("ms") > 0.0);
    assert!(stats["decode_ms"].as_f64().expect("ms") >= 0.0);
}

#[test]
fn chat_uses_the_template_and_stops_at_end_of_turn() {
    let out = tandem(&[
        "generate",
        "--chat",
        "What is the capital of France? Answer in one sentence.",
        "--max-tokens",
        "64",
        "--stats",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.contains("Paris"), "{stdout}");
    assert!(!stdout.contains("<|im_end|>"), "special tokens must not be printed: {stdout}");
    let stats: serde_json::Value =
        serde_json::from_str(text(&out.stderr).lines().last().expect("stats")).expect("json");
    assert!(stats["generated_tokens"].as_u64().expect("n") < 64, "should stop at <|im_end|> before the limit");
}

#[test]
fn stop_string_is_not_printed() {
    let out = tandem(&["generate", "--prompt", "The capital of France is", "--max-tokens", "8", "--stop", "."]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), " Paris\n");
}

#[test]
fn seeded_sampling_is_reproducible() {
    let args =
        ["generate", "--prompt", "Once upon a time", "--max-tokens", "12", "--temperature", "0.9", "--seed", "7"];
    let a = tandem(&args);
    let b = tandem(&args);
    assert!(a.status.success());
    assert_eq!(a.stdout, b.stdout);
}

#[test]
fn bad_input_fails_cleanly() {
    assert_clean_failure(&tandem(&["generate", "--prompt", "hi", "--max-tokens", "0"]), "max_tokens");
    assert_clean_failure(&tandem(&["generate", "--prompt", "hi", "--temperature", "-1"]), "temperature");
    assert_clean_failure(&tandem(&["generate", "--prompt", "hi", "--top-p", "0"]), "top_p");
    assert_clean_failure(&tandem(&["generate", "--prompt", "hi", "--threads", "0"]), "threads");
    assert_clean_failure(&tandem(&["generate", "--model", "/nonexistent/model.gguf", "--prompt", "hi"]), "not found");
    let long = "word ".repeat(9000);
    assert_clean_failure(&tandem(&["generate", "--prompt", &long, "--max-tokens", "1"]), "context");

    let dir = std::env::temp_dir().join(format!("tandem-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp");
    let garbage = dir.join("garbage.gguf");
    std::fs::write(&garbage, b"definitely not a model file").expect("write");
    assert_clean_failure(
        &tandem(&["generate", "--model", garbage.to_str().expect("utf8"), "--prompt", "hi"]),
        "not a GGUF file",
    );
    // The real file cut short: the header parses, tensor data is missing.
    let real = std::fs::read(engine::paths::default_model_path()).expect("model");
    let cut = dir.join("truncated.gguf");
    std::fs::write(&cut, &real[..real.len() / 2]).expect("write");
    assert_clean_failure(&tandem(&["generate", "--model", cut.to_str().expect("utf8"), "--prompt", "hi"]), "outside");
    std::fs::remove_dir_all(&dir).expect("cleanup");

    let missing =
        Command::new(env!("CARGO_BIN_EXE_tandem")).args(["generate", "--max-tokens", "3"]).output().expect("run");
    assert!(!missing.status.success(), "--prompt or --chat is required");
}

#[test]
fn drill_lists_its_drills_and_refuses_unknown_ones() {
    let out = tandem(&["drill", "--list"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let listed = text(&out.stdout);
    for name in
        ["decode-kill", "prefill-kill-recompute", "kv-corrupt", "etcd-restart", "client-disconnect", "overload-3x"]
    {
        assert!(listed.lines().any(|l| l.starts_with(name)), "{name} missing from:\n{listed}");
    }
    assert_clean_failure(&tandem(&["drill", "run", "no-such-drill"]), "unknown drill `no-such-drill`");
    assert_clean_failure(&tandem(&["drill"]), "tandem drill run NAME");
    assert_clean_failure(&tandem(&["drill", "run", "kv-corrupt", "--repeat", "0"]), "--repeat");
}

/// `tandem bench handoff` runs a real hand-off end to end (two engines, a
/// streaming prefill over the TCP KV transport, the join and a decode step on
/// the second engine) and prints its row: the prompt's KV size from the
/// model's layout, and a verdict. Its figures are for the bench to judge;
/// this only keeps it working.
#[test]
fn bench_handoff_hands_a_prompt_over_and_prints_its_row() {
    let out = tandem(&["bench", "handoff", "--reps", "1", "--prompt-tokens", "48"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("tcp, sent from the pool, read straight into the pool"),
        "the workers' tcp paths: {stdout}"
    );
    let row = stdout.lines().find(|l| l.trim_start().starts_with("48 ")).unwrap_or_else(|| panic!("no row: {stdout}"));
    let cols: Vec<&str> = row.split_whitespace().collect();
    // 48 tokens = 3 blocks of 16; 30 layers x K and V x 3 heads x 64 dims x 16 slots x 2 bytes.
    assert_eq!(cols[1], format!("{:.1}", (3 * 30 * 2 * 3 * 64 * 16 * 2) as f64 / (1 << 20) as f64), "{row}");
    assert!(row.contains("met") || row.contains("missed"), "{row}");
}
