#!/usr/bin/env bash
# Serving benchmark: llama.cpp's llama-server and tandem's local cluster
# (`tandem up`) on the same GGUF, both on free loopback ports, loaded one
# after the other by `tandem bench serve` with the same seeded unique
# prompts (llama-server caches repeated prompts). Prints the side-by-side
# table; both servers are stopped on exit, whatever happens.
#
#   MODEL         GGUF (default: the path scripts/fetch-model.sh prints)
#   LLAMA_SERVER  llama-server binary (default: scripts/build-llama.sh's, built if missing)
#   THREADS       llama-server threads (default: 2)
#   TANDEM_CACHE  cache root (default: $HOME/.cache/tandem)
#
# Extra arguments go to `tandem bench serve` after the defaults, e.g.
#   scripts/bench-serve.sh --json /tmp/bench.json --requests 8
set -euo pipefail

LOG_PREFIX=bench-serve
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$(dirname "${BASH_SOURCE[0]}")/.."

model="${MODEL:-$(scripts/fetch-model.sh | tail -n 1)}"
[[ -f "$model" ]] || die "model not found: $model"
llama="${LLAMA_SERVER:-$(scripts/build-llama.sh | tail -n 1)/llama-server}"
[[ -x "$llama" ]] || die "llama-server not found: $llama (make llama)"
threads="${THREADS:-2}"

log "building release binaries"
cargo build --release --workspace --bins >&2
tandem="${CARGO_TARGET_DIR:-target}/release/tandem"

work="$(mktemp -d)"
llama_pid=""
tandem_pid=""

cleanup() {
  stop_pid "$tandem_pid" "tandem up"
  stop_pid "$llama_pid" llama-server
  rm -rf "$work"
}
trap cleanup EXIT

llama_port="$(free_port)"
log "starting llama-server on 127.0.0.1:${llama_port} (${threads} threads, 4 slots)"
"$llama" -m "$model" -t "$threads" --parallel 4 --host 127.0.0.1 --port "$llama_port" -c 8192 \
  >"${work}/llama-server.log" 2>&1 &
llama_pid=$!
wait_ready "http://127.0.0.1:${llama_port}/health" "$llama_pid" llama-server "${work}/llama-server.log"

tandem_port="$(free_port)"
log "starting tandem up on 127.0.0.1:${tandem_port}"
"$tandem" up --model "$model" --http "127.0.0.1:${tandem_port}" --state-file "${work}/cluster.json" \
  >"${work}/tandem-up.log" 2>&1 &
tandem_pid=$!
wait_ready "http://127.0.0.1:${tandem_port}/ready" "$tandem_pid" "tandem up" "${work}/tandem-up.log"

"$tandem" bench serve \
  --target "llama-server=http://127.0.0.1:${llama_port}" \
  --target "tandem=http://127.0.0.1:${tandem_port}" \
  --requests 32 --concurrency 4 --prompt-tokens 235 --max-tokens 64 --rounds 3 "$@"
