#!/usr/bin/env bash
# Prefix routing benchmark: two local clusters (`tandem up`), each with 2
# decode workers that prefill their own prompts, on free loopback ports; one
# routes by load alone (`--prefix-affinity 0`), the other by load and cached
# prefix (the coordinator's default affinity). `tandem bench serve --workload
# chats` sends both the same seeded multi-turn chats on shared system
# prompts, one cluster after the other, and prints them side by side: the
# prompt tokens each computed (usage's cached tokens subtracted) and TTFT.
# Both clusters are stopped on exit, whatever happens.
#
#   MODEL         GGUF (default: the path scripts/fetch-model.sh prints)
#   AFFINITY      the prefix-aware cluster's --prefix-affinity (default: the coordinator's, 1)
#   TANDEM_CACHE  cache root (default: $HOME/.cache/tandem)
#
# Extra arguments go to `tandem bench serve` after the defaults, e.g.
#   scripts/bench-prefix.sh --json /tmp/prefix.json --requests 32
set -euo pipefail

LOG_PREFIX=bench-prefix
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$(dirname "${BASH_SOURCE[0]}")/.."

model="${MODEL:-$(scripts/fetch-model.sh | tail -n 1)}"
[[ -f "$model" ]] || die "model not found: $model"

log "building release binaries"
cargo build --release --workspace --bins >&2
tandem="${CARGO_TARGET_DIR:-target}/release/tandem"

work="$(mktemp -d)"
pids=()

cleanup() {
  local pid
  for pid in "${pids[@]}"; do
    stop_pid "$pid" "tandem up"
  done
  rm -rf "$work"
}
trap cleanup EXIT

# cluster NAME [ARGS...] : start `tandem up` with 2 decode workers and no prefill
# worker; prints its base URL once ready.
cluster() {
  local name=$1 http grpc
  shift
  http="$(free_port)"
  grpc="$(free_port)"
  log "starting ${name} on 127.0.0.1:${http} ($*)"
  "$tandem" up --model "$model" --prefill 0 --decode 2 --http "127.0.0.1:${http}" --grpc "127.0.0.1:${grpc}" \
    --state-file "${work}/${name}.json" "$@" >"${work}/${name}.log" 2>&1 &
  pids+=($!)
  wait_ready "http://127.0.0.1:${http}/ready" "$!" "$name" "${work}/${name}.log"
  echo "http://127.0.0.1:${http}"
}

affinity=()
[[ -n "${AFFINITY:-}" ]] && affinity=(--prefix-affinity "$AFFINITY")
# Not in $(...): the cluster's pid must stay in this shell's `pids` for cleanup.
cluster load-only --prefix-affinity 0 >"${work}/load-only.url"
cluster prefix-aware "${affinity[@]}" >"${work}/prefix-aware.url"

log "CPU flags: $(grep -m1 -o -w -E 'avx2|avx512f|avx512_vnni|avx_vnni|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' ')"
"$tandem" bench serve --workload chats \
  --target "load-only=$(cat "${work}/load-only.url")" \
  --target "prefix-aware=$(cat "${work}/prefix-aware.url")" \
  --requests 64 --concurrency 4 --system-prompts 4 --system-tokens 300 --turns 4 --user-tokens 40 \
  --max-tokens 32 "$@"
