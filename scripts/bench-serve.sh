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

readonly WAIT_S=300

model="${MODEL:-$(scripts/fetch-model.sh | tail -n 1)}"
[[ -f "$model" ]] || die "model not found: $model"
llama="${LLAMA_SERVER:-$(scripts/build-llama.sh | tail -n 1)/llama-server}"
[[ -x "$llama" ]] || die "llama-server not found: $llama (make llama)"
threads="${THREADS:-2}"

log "building release binaries"
cargo build --release --workspace --bins >&2
tandem="${CARGO_TARGET_DIR:-target}/release/tandem"

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

work="$(mktemp -d)"
llama_pid=""
tandem_pid=""

# stop PID NAME: SIGTERM, up to 30 s (tandem up drains), then SIGKILL.
stop() {
  local pid=$1 name=$2 i
  [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null || return 0
  log "stopping ${name} (pid ${pid})"
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < 300; i++)); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$pid" 2>/dev/null; then
    log "${name} (pid ${pid}) did not stop; killing it"
    kill -KILL "$pid" 2>/dev/null || true
  fi
  wait "$pid" 2>/dev/null || true
}

cleanup() {
  stop "$tandem_pid" "tandem up"
  stop "$llama_pid" llama-server
  rm -rf "$work"
}
trap cleanup EXIT

# wait_ready URL PID NAME LOG: poll URL until it answers 200, while PID lives.
wait_ready() {
  local url=$1 pid=$2 name=$3 logfile=$4 i
  for ((i = 0; i < WAIT_S * 5; i++)); do
    if [[ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "$url" || true)" == 200 ]]; then
      log "${name} is ready (${url})"
      return 0
    fi
    if ! kill -0 "$pid" 2>/dev/null; then
      tail -n 20 "$logfile" >&2 || true
      die "${name} exited before ${url} answered 200 (log above)"
    fi
    sleep 0.2
  done
  tail -n 20 "$logfile" >&2 || true
  die "${url} did not answer 200 within ${WAIT_S}s"
}

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
  --requests 32 --concurrency 4 --prompt-tokens 235 --max-tokens 64 "$@"
